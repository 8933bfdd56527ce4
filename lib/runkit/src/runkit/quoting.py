"""Overrides and commands printed for the user to paste, quoted so that pasting works:
:func:`override` quotes for Hydra's grammar (and OmegaConf's ``${``), then for the shell."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

# Strings Hydra reads unquoted as themselves: ``abc/x.y-z``, ``16-mixed`` (not a number).
_PLAIN = re.compile(r"(?:[0-9]+-)?[A-Za-z_/][\w./-]*", re.ASCII)
_NOT_STRINGS = {"null", "true", "false", "nan", "inf"}


Value = str | int | float | bool | None | Sequence["Value"]  # a scalar, or a list of values


def override(key: str, value: Value) -> str:
    """``key=value`` as one shell word from which Hydra reads exactly ``value``."""
    return shlex.quote(f"{key}={hydra_value(value)}")


def command(words: Iterable[str]) -> str:
    """Join the words of a command, quoting each for the shell only."""
    return " ".join(shlex.quote(word) for word in words)


def hydra_value(value: Value) -> str:
    """``value`` in Hydra's override grammar (a string not plain in escaped double quotes)."""
    if isinstance(value, Sequence) and not isinstance(value, str):  # a list, a tuple, a ListConfig
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if _PLAIN.fullmatch(value) and value.lower() not in _NOT_STRINGS:
        return value
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + r"\${", value)  # OmegaConf's escape
    text = re.sub(r'(\\*)("|\Z)', lambda m: m.group(1) * 2 + ('\\"' if m.group(2) else ""), text)
    return f'"{text}"'


def config_options(argv: Sequence[str]) -> list[str]:
    """The options of ``argv`` that choose its configs (``["--config-dir", "my_configs"]``)."""
    from runkit import compat  # Hydra's parser, imported only when a command is rebuilt

    args, _ = compat.hydra_args_parser().parse_known_args(list(argv))
    words = []
    for name in ("config_dir", "config_name", "config_path"):
        if (value := getattr(args, name, None)) is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    return words


def environment_prefix(environ: Mapping[str, str]) -> list[str]:
    """``["PYTHONPATH=<value>"]`` when set, for a printed command to find the same code."""
    value = environ.get("PYTHONPATH")
    return [f"PYTHONPATH={shlex.quote(value)}"] if value else []
