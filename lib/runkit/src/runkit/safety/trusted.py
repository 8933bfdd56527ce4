"""Which ``_target_``s a config read from a file may instantiate: a checkpoint may come from
anyone, so each lies under an allowed prefix as written and as what it resolves to."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from runkit import quoting
from runkit.errors import RunError, first_line

# Torch's layers and optimisers; a project adds its own packages (eval.yaml: trusted_targets).
TRUSTED_TARGETS = ("torch.nn.", "torch.optim.")
MAX_DEPTH = 64  # saved configs nest a few levels; a deeper one is damaged or hostile

_DOTTED = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*")


def is_allowed(name: str, allowed: Iterable[str]) -> bool:
    stems = (str(prefix).strip().rstrip(".") for prefix in allowed)
    return any(stem and (name == stem or name.startswith(stem + ".")) for stem in stems)


def check_trusted(tree: Any, allowed: Iterable[str], source: str | Path) -> None:
    """Refuse in one line code not in ``allowed``, ``${...}``, shared nodes, deep nesting."""
    allowed = tuple(str(prefix) for prefix in allowed)
    refused: list[tuple[str, str, str]] = []  # (where, target, what it really is)
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, str):
            if "${" in node:
                raise RunError(
                    f"{str(source)!r} holds an interpolation at {where or 'the top'} ({node[:60]!r}); "
                    "configs saved by a run are resolved, so this file was edited or crafted"
                )
            continue
        if not isinstance(node, dict | list):
            continue
        if id(node) in seen:
            raise RunError(
                f"{str(source)!r} repeats one config node by reference (at {where}); "
                "configs saved by a run never do"
            )
        seen.add(id(node))
        if depth > MAX_DEPTH:
            raise RunError(f"{str(source)!r} nests its config deeper than {MAX_DEPTH} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and "${" in key:
                raise RunError(f"{str(source)!r} holds an interpolation in a key ({key[:60]!r})")
            if key == "_target_":
                refusal = _check_target(value, path, allowed, source)
                if refusal is not None:
                    refused.append(refusal)
            stack.append((value, path, depth + 1))
    if refused:  # every untrusted target at once: one round trip to allow them, not one each
        _refuse(sorted(refused), allowed, source)


def _refuse(
    refused: list[tuple[str, str, str]], allowed: tuple[str, ...], source: str | Path
) -> None:
    named, prefixes = [], []
    for where, target, real in refused:
        really = f" (which is {real})" if real and real != target else ""
        named.append(f"{where}={target!r}{really}")
        prefix = (real or target).rpartition(".")[0] + "."
        if prefix not in prefixes and prefix not in allowed:
            prefixes.append(prefix)
    widened = quoting.override("trusted_targets", [*allowed, *prefixes])  # pasteable as it is
    one = len(named) == 1
    raise RunError(
        f"{str(source)!r} asks to instantiate {', '.join(named)}, which "
        f"{'is' if one else 'are'} not under the trusted targets [{', '.join(allowed)}]; only if "
        f"you trust this file, allow {'it' if one else 'them'} with {widened} (eval, predict) or "
        f"load_network(..., allowed=[..., {', '.join(map(repr, prefixes))}])"
    )


def _check_target(
    target: Any, where: str, allowed: tuple[str, ...], source: str | Path
) -> tuple[str, str, str] | None:
    if not isinstance(target, str) or not _DOTTED.fullmatch(target):
        raise RunError(
            f"{str(source)!r} has {where}={str(target)[:80]!r}, not a plain dotted name "
            "(letters, digits, '_' and '.', no leading '_'); refusing to instantiate it"
        )
    if not is_allowed(target, allowed):  # never imported (_DOTTED refused a leading '_')
        return where, target, ""
    try:  # as instantiate finds it, importing modules (under an allowed prefix only) on the way
        parts = target.split(".")
        obj = importlib.import_module(parts[0])
        for index, part in enumerate(parts[1:], start=1):
            if not hasattr(obj, part) and isinstance(obj, ModuleType):
                importlib.import_module(".".join(parts[: index + 1]))
            obj = getattr(obj, part)
    except Exception as err:
        raise RunError(
            f"{str(source)!r} names {where}={target!r}, which cannot be imported here: "
            f"{first_line(err)}"
        ) from err
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    real = f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else ""
    if not real or not is_allowed(real, allowed):
        return where, target, real or type(obj).__name__
    return None
