"""Which ``_target_``s may be instantiated from a config that came out of a file.

A checkpoint or a run folder may come from anyone, and ``hydra.utils.instantiate`` calls whatever
its ``_target_`` names: ``pathlib.Path.unlink`` deletes a file, ``torch.hub.load`` runs code from
the network. So before anything is rebuilt from a file, every ``_target_`` in it must name a class
or function under one of the allowed prefixes (the network and data classes, ``torch.nn``,
``torch.optim``, and what the user adds). The name is checked as written *and* as the object it
resolves to, because a dotted path can walk through a module's imports
(``mypkg.models.nets.torch.save`` is ``torch.save``).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from runkit import quoting
from runkit.errors import RunError

# The default of ``load_network(allowed=...)``: torch's layers and optimisers, nothing that
# writes files or loads code. A project adds its own packages (the template's eval.yaml lists
# them in ``trusted_targets``); the library cannot know them.
TRUSTED_TARGETS = ("torch.nn.", "torch.optim.")
MAX_DEPTH = 64  # saved configs nest a few levels; a deeper one is damaged or hostile

_DOTTED = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*")


def is_allowed(name: str, allowed: Iterable[str]) -> bool:
    """Whether the dotted ``name`` lies under one of the ``allowed`` package or module prefixes.

    ``mypkg.`` and ``mypkg`` both allow ``mypkg.x`` but never ``mypkgevil.x``.
    """
    for prefix in allowed:
        stem = str(prefix).strip().rstrip(".")
        if stem and (name == stem or name.startswith(stem + ".")):
            return True
    return False


def check_trusted(tree: Any, allowed: Iterable[str], source: str | Path) -> None:
    """Refuse, in one line, a config from ``source`` that would run code not in ``allowed``.

    Walks every dict and list (``_args_``, ``_partial_`` nodes, lists of nodes). Also refused:
    ``${...}`` interpolations (a resolver could build a ``_target_`` after this check; configs
    saved by a run are resolved), nodes shared by reference (YAML aliases, pickle memo: an
    exponential blow-up when copied) and nesting deeper than :data:`MAX_DEPTH`.
    """
    allowed = tuple(str(prefix) for prefix in allowed)
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
                _check_target(value, path, allowed, source)
            stack.append((value, path, depth + 1))


def _check_target(target: Any, where: str, allowed: tuple[str, ...], source: str | Path) -> None:
    if not isinstance(target, str) or not _DOTTED.fullmatch(target):
        raise RunError(
            f"{str(source)!r} has {where}={str(target)[:80]!r}, not a plain dotted name "
            "(letters, digits, '_' and '.', no leading '_'); refusing to instantiate it"
        )
    if not is_allowed(target, allowed) or any(part.startswith("_") for part in target.split(".")):
        _refuse(target, where, allowed, source)
    try:
        obj = _locate(target)  # imports modules under an allowed prefix only (checked above)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunError(
            f"{str(source)!r} names {where}={target!r}, which cannot be imported here: {reason}"
        ) from err
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    real = f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else ""
    if not real or not is_allowed(real, allowed):
        _refuse(target, where, allowed, source, real=real or type(obj).__name__)


def _locate(path: str) -> Any:
    """The object ``path`` names, found the way ``hydra.utils.instantiate`` finds it.

    Hydra's own ``get_object`` would do, but it logs an ERROR line before raising.
    """
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not isinstance(obj, ModuleType):
                raise
            obj = importlib.import_module(".".join(parts[: index + 1]))
    return obj


def _refuse(
    target: str, where: str, allowed: tuple[str, ...], source: str | Path, real: str = ""
) -> None:
    really = f" (which is {real})" if real and real != target else ""
    prefix = (real or target).rpartition(".")[0] + "."
    widened = quoting.override("trusted_targets", [*allowed, prefix])  # pasteable as it is
    raise RunError(
        f"{str(source)!r} asks to instantiate {where}={target!r}{really}, which is not under the "
        f"trusted targets [{', '.join(allowed)}]; only if you trust this file, allow it with "
        f"{widened} (eval) or "
        f"load_network(..., allowed=[..., {prefix!r}])"
    )
