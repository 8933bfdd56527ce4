"""Check a composed config before anything is created, so a run that cannot start leaves nothing
(:func:`discard_unused` removes the directory of a run that failed before writing anything)."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import math
import os
import shutil
import sys
import typing
from pathlib import Path
from types import UnionType
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from runkit.errors import RunError, exit_with, file_failure
from runkit.run.collector import resume_collector

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
# Files only a finished or started run writes (DDP workers > 0 write none of them).
RUN_MARKERS = ("checkpoints", "metrics.json", "model.pth", "csv", "tensorboard")
MAX_SEED = 2**32 - 1  # lightning.seed_everything (NumPy) accepts 0 ... 2**32 - 1
_UNKNOWN = object()  # a value that cannot be resolved yet (${hydra:...} before Hydra sets it)


class PreflightCallback(Callback):
    """The checks, before the run directory exists; a mistake ends the process here."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: DictConfig, dir_key: str) -> None:
        try:
            check_config(config)
            trains = "train" in config  # eval's config has no `train` key: it reads any weights
            check_inputs(
                _value(config, "ckpt_path"),
                _value(config.get("paths"), "log_dir"),
                resumes=trains and bool(config.get("train")),
                task=str(config.get("task_name") or "train") if trains else "train",
            )
            resume_collector(freeze=True)  # check_config imported every _target_: the heavy part
            if dir_key == "hydra.sweep.dir" and _resumable_sweep(config):
                from runkit.run.sweep import check_n_jobs

                check_n_jobs(OmegaConf.select(config, "hydra.launcher.n_jobs"))
            claim_run_dir(config, dir_key)  # last: it creates the directory
        except RunError as err:
            exit_with(err)


def check_config(cfg: DictConfig) -> None:
    """Raise :class:`RunError` for the first mistake found in ``cfg`` (reads no file)."""
    plain = OmegaConf.to_container(cfg, resolve=False)  # interpolations stay "${...}" strings
    assert isinstance(plain, dict)
    leaves = list(_walk({k: v for k, v in plain.items() if k != "hydra"}))
    for path, value in leaves:
        if value == "???":
            hint = (
                "a .ckpt file, a model.pth or a run directory" if path == "ckpt_path" else "a value"
            )
            raise RunError(f"{path} is required; add {path}=<{hint}> to the command line")
    seed = _value(cfg, "seed")  # before the nodes that interpolate it
    if "seed" in cfg and seed is not _UNKNOWN and not (type(seed) is int and 0 <= seed <= MAX_SEED):
        raise RunError(f"seed={seed!r} is invalid; expected an integer from 0 to {MAX_SEED}")
    for path, value in leaves:
        if isinstance(value, float) and not math.isfinite(value):
            raise RunError(f"{path}={value} is not a finite number; expected a finite value")
        if path.startswith("paths.") and isinstance(value, str) and not value.strip():
            raise RunError(f"{path} is empty; expected a directory")
    for group in ("trainer", "data", "model", "callbacks", "logger"):
        nodes = cfg.get(group) if group in ("callbacks", "logger") else {group: cfg.get(group)}
        for name, node in (nodes or {}).items():
            if isinstance(node, DictConfig):
                check_targets(node, name if name == group else f"{group}.{name}")
    trainer = cfg.get("trainer") or {}
    for key, minimum in (("max_epochs", 1), ("min_epochs", 0)):
        value = _value(trainer, key)
        if isinstance(value, int) and value < minimum and value != -1:
            raise RunError(
                f"trainer.{key}={value} is invalid; expected an integer >= {minimum} (or -1: no limit)"
            )
    strategy, accelerator = _value(trainer, "strategy"), _value(trainer, "accelerator")
    check_strategy(strategy)
    check_accelerator(accelerator)
    target = strategy.get("_target_", "") if isinstance(strategy, dict) else ""  # trainer=dp
    dp_keys = [accelerator, _value(trainer, "devices"), _value(trainer, "num_nodes")]
    if (strategy == "dp" or str(target).endswith(".DataParallelStrategy")) and (
        _UNKNOWN not in dp_keys
    ):
        from runkit.strategies.dp import check_dp_request

        check_dp_request(*dp_keys)  # DP needs CUDA GPUs on one machine: say so before starting
    check_devices(cfg)


def _walk(data: Any, prefix: str = "") -> Any:
    listed = isinstance(data, list)
    for key, value in enumerate(data) if listed else data.items():
        path = f"{prefix}[{key}]" if listed else f"{prefix}{'.' if prefix else ''}{key}"
        if isinstance(value, dict | list):
            yield from _walk(value, path)
        else:
            yield path, value


def check_devices(cfg: DictConfig) -> None:
    """GPUs asked for must exist, and the ``gpu_*`` keys be valid; claims nothing."""
    from runkit.gpus.claims import policy_from_config
    from runkit.gpus.resolve import SELECT_CHOICES, resolve_devices

    select = cfg.get("select_gpus", "first")
    if select not in SELECT_CHOICES:
        raise RunError(f"select_gpus={select!r} is invalid; expected one of {SELECT_CHOICES}")
    policy_from_config(cfg)
    trainer = cfg.get("trainer") or {}
    accelerator, devices = _value(trainer, "accelerator"), _value(trainer, "devices")
    if _UNKNOWN not in (accelerator, devices):
        resolve_devices(
            accelerator or "auto", "auto" if devices is None else devices, select=select
        )


def check_targets(node: DictConfig, path: str) -> None:
    """Check the keys and scalar types of ``node`` (and nested nodes) against its ``_target_``."""
    for key in node:
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            continue
        child = node[key]
        children = enumerate(child) if isinstance(child, ListConfig) else [(None, child)]
        for index, item in children:  # trainer.plugins: a list of target nodes
            if isinstance(item, DictConfig) and "_target_" in item:
                check_targets(item, f"{path}.{key}" + ("" if index is None else f"[{index}]"))
    if "_target_" not in node:
        return
    try:
        from hydra.utils import get_object

        target = get_object(str(node["_target_"]))
    except Exception as err:
        raise RunError(
            f"{path}._target_={node['_target_']!r} cannot be imported; expected a dotted path to "
            "a class or function, e.g. torch.nn.Linear"
        ) from err
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    keys = [str(k) for k in node if k not in HYDRA_KEYS]
    unknown = [k for k in keys if k not in params]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names = [name for name in params if name not in ("self", "args", "kwargs")]
        close = difflib.get_close_matches(unknown[0], names, n=1)
        one = len(unknown) == 1
        raise RunError(
            f"{', '.join(f'{path}.{k}' for k in unknown)} "
            f"{'is not an argument' if one else 'are not arguments'} of {node['_target_']}"
            + (f" (did you mean {path}.{close[0]}?)" if close and one else "")
            + (f"; accepted: {', '.join(names)}" if names else "; it takes none")
            + f"; remove {'it' if one else 'them'} with "
            + " ".join(f"~{path}.{k}" for k in unknown)
        )
    _check_types(node, path, _hints(target), keys)
    if node.get("_partial_") is True:
        _try_partial(node, path, target)


def _check_types(node: DictConfig, path: str, hints: dict[str, Any], keys: list[str]) -> None:
    for key in keys:  # an int, float, bool or str (or Optional of one); an int for a float is fine
        hint = hints.get(key)
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else ()
        scalar = [arg for arg in args or (hint,) if arg is not type(None)]
        if (
            len(scalar) != 1
            or scalar[0] not in (int, float, bool, str)
            or OmegaConf.is_interpolation(node, key)
            or OmegaConf.is_missing(node, key)
        ):
            continue
        value = _value(node, key)
        if not (
            type(value) is scalar[0]
            or (value is None and len(args) > 1)
            or (scalar[0] is float and type(value) is int)
        ):
            name = str(hint).replace("typing.", "")
            name = name if typing.get_origin(hint) else getattr(hint, "__name__", name)
            raise RunError(f"{path}.{key}={value!r} has the wrong type; expected {name}")


@functools.cache
def _hints(target: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # unresolvable forward references: no type checks for this target
        return {}


def check_strategy(strategy: Any) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import runkit.strategies  # noqa: F401  (registers "dp")

    known = {*StrategyRegistry.available_strategies(), "auto"}
    if isinstance(strategy, str) and strategy not in known:
        shown = ", ".join(sorted(name for name in known if "find_unused" not in name))
        raise RunError(f"trainer.strategy={strategy!r} does not exist; choose one of: {shown}")


def check_accelerator(accelerator: Any) -> None:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    if not isinstance(accelerator, str) or accelerator.lower() in ("auto", "gpu", "cuda"):
        return
    known = sorted(AcceleratorRegistry.available_accelerators())
    usable = [n for n in known if AcceleratorRegistry[n]["accelerator"].is_available()]
    if accelerator.lower() not in known:
        raise RunError(
            f"trainer.accelerator={accelerator!r} does not exist; choose one of: auto, gpu, "
            + ", ".join(known)
        )
    if accelerator.lower() not in usable:
        raise RunError(
            f"trainer.accelerator={accelerator} is not available on this machine; usable here: "
            f"auto, {', '.join(usable)}"
        )


def _try_partial(node: DictConfig, path: str, target: Any) -> None:
    """Build an optimiser's or scheduler's partial once: a value torch refuses is one line."""
    import torch
    from hydra.utils import instantiate
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    kinds = (torch.optim.Optimizer, LRScheduler, ReduceLROnPlateau)
    if not (inspect.isclass(target) and issubclass(target, kinds)):
        return
    try:
        values = OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation only the run can resolve: the run will tell
        return
    assert isinstance(values, dict)

    def failure(drop: str | None = None) -> Exception | None:
        params = [torch.nn.Parameter(torch.zeros(1))]
        try:
            factory = instantiate({k: v for k, v in values.items() if k != drop})
            is_optimizer = issubclass(target, torch.optim.Optimizer)
            factory(params) if is_optimizer else factory(torch.optim.SGD(params, lr=0.1))
        except Exception as err:
            return err
        return None

    if (error := failure()) is None:
        return
    reason, name = " ".join(str(error).split()) or type(error).__name__, values["_target_"]
    for key in values:
        if key not in HYDRA_KEYS and failure(drop=key) is None:
            raise RunError(
                f"{path}.{key}={values[key]!r} is invalid: {name} refuses it ({reason})"
            ) from error
    raise RunError(f"{path} is invalid: {name} refuses its values ({reason})") from error


def check_inputs(value: Any, log_dir: Any, resumes: bool, task: str = "train") -> None:
    """``ckpt_path=value`` must be readable without running code and, when training ``resumes``
    from it, a Lightning checkpoint with an intact log."""
    import pickle

    from runkit import plots
    from runkit.run.predictions import is_lightning_checkpoint
    from runkit.safety import checkpoints
    from runkit.safety.resume import run_dir_of

    if value in (None, "", _UNKNOWN) or (value == "last" and not isinstance(log_dir, str)):
        return
    path = checkpoints.resolve_ckpt_path(str(value), str(log_dir), task)
    assert path is not None
    typed = checkpoints.typed_as(path, str(value))
    try:
        data = checkpoints.load_file(path, mmap=True)  # weights_only: code never runs
    except RunError as err:
        if not isinstance(err.__cause__, pickle.UnpicklingError):
            raise
        lines = [line.strip() for line in str(err.__cause__).splitlines() if "GLOBAL" in line]
        raise RunError(
            f"{typed} was refused: it holds objects that loading with weights_only does not "
            f"allow{f' ({lines[0]})' if lines else ''}; it is not loaded"
        ) from err
    if not resumes:
        return
    if not is_lightning_checkpoint(data):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        package = (getattr(spec, "name", None) or "").rpartition(".")[0]
        raise RunError(
            f"{typed} holds only weights (a model.pth or a bare state_dict), so training cannot "
            "resume from it; pass a Lightning checkpoint (a .ckpt file or a run directory), or "
            "evaluate it with " + (f"python -m {package}.eval" if package else "eval")
        )
    log = run_dir_of(path) / plots.METRICS_CSV  # the earlier run's log, which the run carries on
    if log.exists() or log.is_symlink():
        try:
            plots.read_csv_log(log)
        except plots.PlotError as err:
            raise RunError(f"{err}; resume from a run whose log is intact") from err


# the last claim: (directory, the highest directory it created or None, its marker, whether the
# directory existed with files in it: never removed)
_claimed: tuple[Path, Path | None, str, bool] | None = None


def claim_run_dir(cfg: DictConfig, key: str) -> None:
    """Refuse a directory that holds an earlier run, then claim it with one exclusive ``mkdir``
    of ``.hydra`` (``multirun.yaml`` for a sweep): of two racing runs one gets it."""
    global _claimed
    from runkit.run.launch import launched_externally, ranks_start_together

    # torchrun and SLURM ranks start together and each checks: one line on every node;
    # a requeued SLURM job resumes in its own directory (runkit.run.launch.run_id)
    if (is_worker_process() and not ranks_start_together()) or os.environ.get(
        "SLURM_RESTART_COUNT", "0"
    ) not in ("", "0"):
        return
    try:
        directory = Path(os.path.abspath(str(OmegaConf.select(cfg, key))))  # as Hydra makes it
    except Exception:  # an unresolvable path fails later with Hydra's own message
        return
    if found := [name for name in RUN_MARKERS if (directory / name).exists()]:
        elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        fix = (
            "pick a new directory"
            if elastic == "none"
            else f"give torchrun a new --rdzv-id (not {elastic})"
        )
        raise RunError(
            f"{key}={str(directory)!r} already holds a run ({', '.join(found)}); {fix} "
            "(resuming with ckpt_path=... starts a new run directory by itself)"
        )
    sweep = key == "hydra.sweep.dir"
    if launched_externally() or (
        sweep and _resumable_sweep(cfg) and (directory / "multirun.yaml").is_file()
    ):
        return  # torchrun / SLURM (run_id names the launch); a parallel sweep resumed there
    marker = "multirun.yaml" if sweep else str(OmegaConf.select(cfg, "hydra.output_subdir"))
    marker = marker if marker != "None" else ".hydra"
    first_new = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
    had_files = directory.is_dir() and any(directory.iterdir())
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if sweep:
            os.close(os.open(directory / marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        else:
            (directory / marker).mkdir()
    except FileExistsError:
        raise RunError(
            f"{key}={str(directory)!r} is taken: it already has {marker} (another run is starting "
            "there, or an earlier one stopped there); pick a new directory"
        ) from None
    except OSError as err:  # below a file, no permission (the user's path); a full disk
        err.filename = err.filename or str(directory)
        raise file_failure(err) or err from err
    _claimed = (directory, first_new, marker, had_files)


def _resumable_sweep(cfg: DictConfig) -> bool:
    target = OmegaConf.select(cfg, "hydra.launcher._target_", default=None)
    return str(target).endswith(".RunkitParallelLauncher")


def discard_unused(run_dir: Path) -> bool:
    """Remove ``run_dir`` (and the parents its claim created) if it holds only Hydra's files,
    ``config.yaml`` and logs; whether it was removed."""
    run_dir = Path(os.path.abspath(run_dir))
    claimed = _claimed if _claimed is not None and _claimed[0] == run_dir else None
    _, first_new, marker, had_files = claimed or (run_dir, None, ".hydra", False)
    if had_files or not run_dir.is_dir():
        return False  # a directory the user gave with files in it: not ours to remove

    def removable(entry: Path) -> bool:
        if entry.is_dir() and not entry.is_symlink():
            allowed = (
                {"config.yaml", "hydra.yaml", "overrides.yaml"} if entry.name == marker else ()
            )
            return all(f.name in allowed and f.is_file() for f in entry.iterdir())
        return entry.is_file() and (entry.suffix == ".log" or entry.name == "config.yaml")

    if not all(removable(entry) for entry in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir)
    with contextlib.suppress(OSError):  # the parents the claim created, up to the first not empty
        for directory in [d for d in run_dir.parents if first_new and d.is_relative_to(first_new)]:
            directory.rmdir()
    return True


def is_worker_process() -> bool:
    """Whether this process is a DDP rank other than the first."""
    ranks = ("LOCAL_RANK", "RANK", "NODE_RANK", "SLURM_PROCID")
    return any(os.environ.get(var, "0") not in ("", "0") for var in ranks)


def _value(node: Any, key: Any) -> Any:
    """The resolved value at ``key`` as plain data; ``None`` if absent, ``_UNKNOWN`` if not yet."""
    if not isinstance(node, DictConfig) or key not in node:
        return None
    try:
        value = node[key]
    except Exception:  # e.g. ${hydra:runtime.output_dir} before Hydra has set it
        return _UNKNOWN
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value
