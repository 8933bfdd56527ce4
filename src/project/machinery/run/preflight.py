"""Check a composed config before anything is created, so a run that cannot start leaves nothing.

Hydra creates the run directory before it calls the task; :class:`PreflightCallback` runs earlier
(Hydra's ``on_run_start`` / ``on_multirun_start``), and :func:`check_config` turns each mistake
into one :class:`~project.errors.ProjectError` line that names the bad value and what is accepted:

* an argument the ``_target_`` class does not take (``+trainer.devicez=2``),
* a value of the wrong type for that argument (``trainer.max_epochs=abc``),
* epochs below one, a strategy name that does not exist,
* a run directory that already holds an earlier run (it would be overwritten).
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from project.errors import ProjectError

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
# Files only a finished or started run writes (DDP workers > 0 write none of them).
RUN_MARKERS = ("checkpoints", "metrics.json", "model.pth", "csv", "tensorboard")


class PreflightCallback(Callback):
    """Hydra callback that runs :func:`check_config` before the run directory exists.

    Hydra turns exceptions raised in callbacks into warnings and carries on, so a mistake found
    here is printed as one line and ends the process with ``SystemExit``, which Hydra lets pass.
    The task runs :func:`check_config` again for each job of a sweep, whose values differ.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: DictConfig, dir_key: str) -> None:
        try:
            check_fresh_dir(config, dir_key)
            check_config(config)
        except ProjectError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(err.exit_code) from err


def check_config(cfg: DictConfig) -> None:
    """Raise :class:`ProjectError` for the first mistake found in ``cfg``."""
    for path in ("trainer", "data", "model"):
        if path in cfg and cfg[path] is not None:
            check_targets(cfg[path], path)
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            if isinstance(node, DictConfig):
                check_targets(node, f"{group}.{name}")
    trainer = cfg.get("trainer") or {}
    for key, minimum in (("max_epochs", 1), ("min_epochs", 0)):
        value = _value(trainer, key)
        if isinstance(value, int) and value < minimum and value != -1:
            raise ProjectError(
                f"trainer.{key}={value} is invalid; expected an integer >= {minimum} (or -1: no limit)"
            )
    check_strategy(_value(trainer, "strategy"))
    dp_keys = [_value(trainer, key) for key in ("accelerator", "devices", "num_nodes")]
    if _value(trainer, "strategy") == "dp" and _UNKNOWN not in dp_keys:
        from project.machinery.strategies.dp import check_dp_request

        check_dp_request(*dp_keys)  # DP needs CUDA GPUs on one machine: say so before starting
    check_devices(cfg)


def check_devices(cfg: DictConfig) -> None:
    """GPUs asked for must exist (``trainer.devices=4`` on a 2-GPU machine fails here)."""
    from project.machinery.gpus.devices import SELECT_CHOICES, resolve_devices

    select = cfg.get("select_gpus", "first")
    if select not in SELECT_CHOICES:
        raise ProjectError(f"select_gpus={select!r} is invalid; expected one of {SELECT_CHOICES}")
    trainer = cfg.get("trainer") or {}
    accelerator, devices = _value(trainer, "accelerator"), _value(trainer, "devices")
    if accelerator is _UNKNOWN or devices is _UNKNOWN:
        return
    resolve_devices(accelerator or "auto", "auto" if devices is None else devices, select=select)


def check_targets(node: DictConfig, path: str) -> None:
    """Check the keys and simple value types of ``node`` (and nested nodes) against ``_target_``."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and "_target_" in child:
            check_targets(child, f"{path}.{key}")
    if "_target_" not in node:
        return
    target = _locate(str(node["_target_"]), path)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepts_any = True
    else:
        accepts_any = False
    hints = _type_hints(target)
    for key in node:
        if key in HYDRA_KEYS:
            continue
        if key not in params and not accepts_any:
            names = [name for name in params if name not in ("self", "args", "kwargs")]
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {path}.{close[0]}?)" if close else ""
            raise ProjectError(
                f"{path}.{key} is not an argument of {node['_target_']}{hint}; "
                f"accepted: {', '.join(names)}"
            )
        value = _value(node, key)
        expected = hints.get(key)
        if expected is not None and value is not _UNKNOWN and _accepts(expected, value) is False:
            raise ProjectError(
                f"{path}.{key}={value!r} has the wrong type; expected {_type_name(expected)}"
            )


def check_strategy(strategy: Any) -> None:
    """A strategy given by name must be one Lightning (or this template) registers."""
    if not isinstance(strategy, str) or strategy == "auto":
        return
    from lightning.pytorch.strategies import StrategyRegistry

    import project.machinery.strategies  # noqa: F401  (registers "dp")

    known = set(StrategyRegistry.available_strategies()) | {"auto"}
    if strategy not in known:
        shown = sorted(name for name in known if "find_unused" not in name)
        raise ProjectError(
            f"trainer.strategy={strategy!r} does not exist; choose one of: {', '.join(shown)}"
        )


def check_fresh_dir(cfg: DictConfig, key: str) -> None:
    """Refuse to start a run in a directory that holds an earlier run: it would be overwritten."""
    if _is_worker_process():
        return  # DDP workers reuse rank 0's directory on purpose
    if os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
        return  # a requeued SLURM job resumes in its own directory (project.machinery.run.launch.run_id)
    try:
        directory = Path(str(OmegaConf.select(cfg, key)))
    except Exception:  # an unresolvable path fails later with Hydra's own message
        return
    found = [name for name in RUN_MARKERS if (directory / name).exists()]
    if found:
        raise ProjectError(
            f"{key}={str(directory)!r} already holds a run ({', '.join(found)}); pick a new "
            "directory (resuming with ckpt_path=... starts a new run directory by itself)"
        )


def _is_worker_process() -> bool:
    return any(
        os.environ.get(var, "0") not in ("", "0")
        for var in ("LOCAL_RANK", "RANK", "NODE_RANK", "SLURM_PROCID")
    )


_UNKNOWN = object()


def _value(node: Any, key: str) -> Any:
    """The resolved value at ``key``, or ``_UNKNOWN`` when it cannot be resolved yet."""
    if not isinstance(node, DictConfig) or key not in node:
        return None
    try:
        value = node[key]
    except Exception:  # e.g. ${hydra:runtime.output_dir} before Hydra has set it
        return _UNKNOWN
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=False)
    return value


def _locate(target: str, path: str) -> Any:
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as err:
        raise ProjectError(
            f"{path}._target_={target!r} cannot be imported; expected a dotted path to a class "
            "or function, e.g. project.models.nets.ConvNet"
        ) from err


def _type_hints(target: Any) -> dict[str, Any]:
    func = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(func)
    except Exception:  # unresolvable forward references: skip type checks for this target
        return {}


def _accepts(expected: Any, value: Any) -> bool | None:
    """Whether ``value`` fits the annotation ``expected``; ``None`` when we cannot tell."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_accepts(arg, value) for arg in typing.get_args(expected)]
        if any(v is True for v in verdicts):
            return True
        return False if all(v is False for v in verdicts) else None
    if origin is typing.Literal:
        return value in typing.get_args(expected)
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    return None


def _type_name(expected: Any) -> str:
    text = str(expected).replace("typing.", "")
    return getattr(expected, "__name__", text) if typing.get_origin(expected) is None else text
