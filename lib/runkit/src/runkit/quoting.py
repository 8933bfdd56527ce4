"""Overrides and commands the program prints for the user to paste, written so that pasting works.

A printed ``key=value`` passes two parsers: the POSIX shell, then Hydra's override grammar.
``shlex.quote`` alone satisfies the shell only: Hydra takes spaces, non-ASCII letters, ``$``,
commas, brackets and ``=`` in a value only inside quotes (else ``LexerNoViableAltException``, or a
sweep, or a list), and OmegaConf reads ``${...}`` as an interpolation. :func:`override` quotes for
Hydra first, then for the shell. Stdlib only at import, so every layer of the machinery may
import it (:func:`config_options` asks Hydra's parser when it runs).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

# Strings Hydra reads unquoted as exactly themselves: a letter, ``_`` or ``/`` first, then only
# ASCII word characters, dots, slashes and dashes (no word Hydra would read as another type); or
# digits, a dash and such a word (``16-mixed``: no number has a dash after its first digits).
_PLAIN = re.compile(r"(?:[0-9]+-)?[A-Za-z_/][\w./-]*", re.ASCII)
_NOT_STRINGS = {"null", "true", "false", "nan", "inf"}


Value = str | int | float | bool | None | Sequence["Value"]
"""What a printed override can hold: a scalar, or a list (``[a,b]``) of values."""


def override(key: str, value: Value) -> str:
    """``key=value`` as one shell word from which Hydra gives the config exactly ``value`` (a
    sequence becomes a list)."""
    return shlex.quote(f"{key}={hydra_value(value)}")


def command(words: Iterable[str]) -> str:
    """Join the words of a command, quoting each for the shell (overrides already in Hydra's
    syntax, such as the ones a user typed, stay as they are for Hydra)."""
    return " ".join(shlex.quote(word) for word in words)


def hydra_value(value: Value) -> str:
    """``value`` as Hydra's override grammar writes it (before any shell quoting).

    A string that is not plain goes in double quotes: inside them Hydra wants ``\\"`` for a quote
    and doubled backslashes before a quote or the closing quote; ``${`` becomes ``\\${`` (with
    the backslashes before it doubled) so that OmegaConf keeps it as text. A sequence (list,
    tuple, OmegaConf's ListConfig) is ``[a,b]`` with each element written so.
    """
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


_CONFIG_OPTIONS = (("config_dir", "--config-dir"), ("config_name", "--config-name"),
                   ("config_path", "--config-path"))  # fmt: skip


def config_options(argv: Sequence[str]) -> list[str]:
    """The options of the Hydra command line ``argv`` that choose its configs, as typed values
    behind their long names (``["--config-dir", "my_configs", ...]``).

    A command that starts this program again (a sweep's job, a printed resume command) needs them
    to find the same configs; Hydra's own parser reads them, whatever spelling was used
    (``-cd x``, ``--config-dir=x``).
    """
    from runkit import compat  # Hydra's parser, imported only when a command is rebuilt

    args, _ = compat.hydra_args_parser().parse_known_args(list(argv))
    words = []
    for attribute, option in _CONFIG_OPTIONS:
        value = getattr(args, attribute, None)
        if value is not None:
            words += [option, str(value)]
    return words


def environment_prefix(environ: Mapping[str, str]) -> list[str]:
    """``["PYTHONPATH=<value>"]`` when the run found code through ``PYTHONPATH`` (a user's package
    outside the project), for a printed command to find it again; else nothing."""
    value = environ.get("PYTHONPATH")
    return [f"PYTHONPATH={shlex.quote(value)}"] if value else []
