"""Check a composed config before anything is created, so a run that cannot start leaves nothing.

Hydra creates the run directory before it calls the task; :class:`PreflightCallback` runs earlier
(Hydra's ``on_run_start`` / ``on_multirun_start``), and :func:`check_config` turns each mistake
into one :class:`~runkit.errors.RunError` line that names the bad value and what is accepted:

* a required value left out (``???``, e.g. eval's ``ckpt_path``),
* an argument the ``_target_`` class does not take (``+trainer.devicez=2``),
* a value of the wrong type for that argument (``trainer.max_epochs=abc``),
* a NaN or infinite number anywhere, a seed Lightning refuses, an empty ``paths.*`` directory,
* epochs below one, a strategy or an accelerator that does not exist here,
* an optimiser or scheduler value torch refuses (each is built once against a dummy parameter).

:class:`PreflightCallback` then checks the files the run reads (:func:`check_inputs`: the
checkpoint in ``ckpt_path``) and claims the run directory (:func:`claim_run_dir`): a directory
that holds an earlier run, or one another process is starting in, is refused, atomically. A run
that fails later with a :class:`~runkit.errors.RunError`, before it wrote anything of its
own, is removed again by :func:`discard_unused`.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from runkit.errors import RunError, file_failure
from runkit.run.collector import resume_collector

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
            check_config(config)
            check_inputs(config)
            resume_collector(freeze=True)  # check_config imported every _target_: the heavy part
            if dir_key == "hydra.sweep.dir" and _resumable_sweep(config):
                from runkit.run.sweep import check_n_jobs

                check_n_jobs(OmegaConf.select(config, "hydra.launcher.n_jobs"))
            claim_run_dir(config, dir_key)  # last: it creates the directory
        except RunError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(err.exit_code) from err


def check_config(cfg: DictConfig) -> None:
    """Raise :class:`RunError` for the first mistake found in ``cfg`` (reads no file)."""
    check_required(cfg)
    check_seed(cfg)  # before the nodes that interpolate it (callbacks.resume_state.seed)
    check_finite(cfg)
    check_paths(cfg)
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
            raise RunError(
                f"trainer.{key}={value} is invalid; expected an integer >= {minimum} (or -1: no limit)"
            )
    check_strategy(_value(trainer, "strategy"))
    check_accelerator(_value(trainer, "accelerator"))
    dp_keys = [_value(trainer, key) for key in ("accelerator", "devices", "num_nodes")]
    strategy = _value(trainer, "strategy")  # "dp", or the trainer=dp node with its _target_
    target = strategy.get("_target_", "") if isinstance(strategy, dict) else ""
    is_dp = strategy == "dp" or str(target).endswith(".DataParallelStrategy")
    if is_dp and _UNKNOWN not in dp_keys:
        from runkit.strategies.dp import check_dp_request

        check_dp_request(*dp_keys)  # DP needs CUDA GPUs on one machine: say so before starting
    check_devices(cfg)
    check_optimizers(cfg)


def check_devices(cfg: DictConfig) -> None:
    """GPUs asked for must exist (``trainer.devices=4`` on a 2-GPU machine fails here).

    Changes nothing: the choice ``select_gpus=least_used`` makes is handed to DDP ranks only where
    the run starts (:func:`~runkit.gpus.resolve.resolve_for_run`), which also measures
    afresh, waits and claims. The GPU list is read once per job, so ``train`` resolving again costs
    nothing. The ``gpu_*`` keys of ``least_used`` are checked here, whatever ``select_gpus`` is."""
    from runkit.gpus.claims import policy_from_config
    from runkit.gpus.resolve import SELECT_CHOICES, resolve_devices

    select = cfg.get("select_gpus", "first")
    if select not in SELECT_CHOICES:
        raise RunError(f"select_gpus={select!r} is invalid; expected one of {SELECT_CHOICES}")
    policy_from_config(cfg)  # gpu_min_free_gib, gpu_max_util, gpu_wait_s...: one line if bad
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
        elif isinstance(child, ListConfig):  # trainer.plugins: a list of target nodes
            for index, item in enumerate(child):
                if isinstance(item, DictConfig) and "_target_" in item:
                    check_targets(item, f"{path}.{key}[{index}]")
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
            raise RunError(
                f"{path}.{key} is not an argument of {node['_target_']}{hint}; "
                f"accepted: {', '.join(names)}"
            )
        value = _value(node, key)
        expected = hints.get(key)
        if expected is not None and value is not _UNKNOWN and _accepts(expected, value) is False:
            raise RunError(
                f"{path}.{key}={value!r} has the wrong type; expected {_type_name(expected)}"
            )


def check_strategy(strategy: Any) -> None:
    """A strategy given by name must be one Lightning (or this template) registers."""
    if not isinstance(strategy, str) or strategy == "auto":
        return
    from lightning.pytorch.strategies import StrategyRegistry

    import runkit.strategies  # noqa: F401  (registers "dp")

    known = set(StrategyRegistry.available_strategies()) | {"auto"}
    if strategy not in known:
        shown = sorted(name for name in known if "find_unused" not in name)
        raise RunError(
            f"trainer.strategy={strategy!r} does not exist; choose one of: {', '.join(shown)}"
        )


def check_accelerator(accelerator: Any) -> None:
    """An accelerator given by name must exist in Lightning and be usable here.

    GPUs (``gpu``, ``cuda``, ``auto``) are checked by :func:`check_devices`, which says more.
    """
    if not isinstance(accelerator, str) or accelerator.lower() in ("auto", "gpu", "cuda"):
        return
    from lightning.pytorch.accelerators import AcceleratorRegistry

    known = sorted(AcceleratorRegistry.available_accelerators())
    name = accelerator.lower()
    if name not in known:
        raise RunError(
            f"trainer.accelerator={accelerator!r} does not exist; choose one of: auto, gpu, "
            f"{', '.join(known)}"
        )
    usable = [n for n in known if AcceleratorRegistry[n]["accelerator"].is_available()]
    if name not in usable:
        raise RunError(
            f"trainer.accelerator={accelerator} is not available on this machine; usable here: "
            f"auto, {', '.join(usable)}"
        )


MAX_SEED = 2**32 - 1  # lightning.seed_everything (NumPy) accepts 0 ... 2**32 - 1


def check_seed(cfg: DictConfig) -> None:
    """``seed`` must be what ``seed_everything`` accepts: an integer from 0 to 2**32 - 1."""
    if "seed" not in cfg:
        return
    seed = _value(cfg, "seed")
    if seed is _UNKNOWN:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise RunError(f"seed={seed!r} is invalid; expected an integer from 0 to {MAX_SEED}")


def check_required(cfg: DictConfig) -> None:
    """A value the config marks as required (``???``) must be given."""
    for path, node, key in _leaves(cfg):
        if OmegaConf.is_missing(node, key):
            what = REQUIRED_HINTS.get(path, "a value")
            raise RunError(f"{path} is required; add {path}=<{what}> to the command line")


REQUIRED_HINTS = {"ckpt_path": "a .ckpt file, a model.pth or a run directory"}


def check_finite(cfg: DictConfig) -> None:
    """No NaN or infinite number anywhere (``model.optimizer.lr=nan`` would train on NaNs)."""
    for path, node, key in _leaves(cfg):
        value = _leaf_value(node, key)
        if isinstance(value, float) and not math.isfinite(value):
            raise RunError(f"{path}={value} is not a finite number; expected a finite value")


def check_paths(cfg: DictConfig) -> None:
    """Directories under ``paths`` must not be empty: ``${paths.log_dir}/train`` would be
    ``/train``, in the filesystem root."""
    paths = cfg.get("paths")
    if not isinstance(paths, DictConfig):
        return
    for key in paths:
        value = _value(paths, str(key))
        if isinstance(value, str) and not value.strip():
            raise RunError(f"paths.{key} is empty; expected a directory")


def check_optimizers(cfg: DictConfig) -> None:
    """Optimiser and scheduler partials under ``model`` must accept their values.

    Each is built once against a dummy parameter, so ``model.optimizer.lr=-1`` (or a negative
    ``weight_decay``, ``betas`` out of [0, 1), ...) fails here in one line naming the key,
    with torch's own reason, instead of in a traceback when fit starts.
    """
    model = cfg.get("model")
    if not isinstance(model, DictConfig):
        return
    import torch
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    def dummy_optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    for path, node in _partials(model, "model"):
        target = _locate(str(node["_target_"]), path)
        if not inspect.isclass(target):
            continue
        if issubclass(target, torch.optim.Optimizer):
            _try_partial(node, path, lambda f: f(params=[torch.nn.Parameter(torch.zeros(1))]))
        elif issubclass(target, LRScheduler | ReduceLROnPlateau):
            _try_partial(node, path, lambda f: f(optimizer=dummy_optimizer()))


def _partials(node: DictConfig, path: str) -> list[tuple[str, DictConfig]]:
    found = []
    for key in node:
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            continue
        child = node[key]  # not an interpolation: nothing is resolved
        if isinstance(child, DictConfig):
            if "_target_" in child and child.get("_partial_") is True:
                found.append((f"{path}.{key}", child))
            found += _partials(child, f"{path}.{key}")
    return found


def _try_partial(node: DictConfig, path: str, call: Any) -> None:
    """Build the partial at ``node`` and ``call`` it; name the key that makes it fail."""
    from hydra.utils import instantiate

    try:
        values = OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation only the run can resolve: the run will tell
        return
    assert isinstance(values, dict)

    def failure(drop: str | None = None) -> Exception | None:
        try:
            call(instantiate({k: v for k, v in values.items() if k != drop}))
        except Exception as err:
            return err
        return None

    error = failure()
    if error is None:
        return
    reason = " ".join(str(error).split()) or type(error).__name__
    target = values["_target_"]
    for key in values:
        if key not in HYDRA_KEYS and failure(drop=key) is None:
            raise RunError(
                f"{path}.{key}={values[key]!r} is invalid: {target} refuses it ({reason})"
            ) from error
    raise RunError(f"{path} is invalid: {target} refuses its values ({reason})") from error


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every leaf of the config as ``(dotted path, parent node, key)``, Hydra's own node left out.

    Missing values and interpolations are leaves: nothing is resolved on the way down.
    """
    found: list[tuple[str, Any, Any]] = []
    listed = isinstance(node, ListConfig)
    for key in range(len(node)) if listed else list(node):
        if not prefix and key == "hydra":
            continue
        path = f"{prefix}[{key}]" if listed else f"{prefix}{'.' if prefix else ''}{key}"
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            found.append((path, node, key))
            continue
        child = node[key]
        if isinstance(child, DictConfig | ListConfig):
            found += _leaves(child, path)
        else:
            found.append((path, node, key))
    return found


def _leaf_value(node: Any, key: Any) -> Any:
    """The resolved value of a leaf, or ``_UNKNOWN`` when it cannot be resolved yet."""
    try:
        return node[key]
    except Exception:  # e.g. ${hydra:runtime.output_dir} before Hydra has set it
        return _UNKNOWN


def check_inputs(cfg: DictConfig) -> None:
    """The files a run reads must be there and readable: ``ckpt_path`` (train and eval).

    Kept apart from :func:`check_config`, which looks at the config only (the README test
    composes commands whose files do not exist on purpose).
    """
    value = _value(cfg, "ckpt_path")
    if value in (None, "", _UNKNOWN) or OmegaConf.is_missing(cfg, "ckpt_path"):
        return
    from runkit.safety import checkpoints

    trains = "train" in cfg  # a training config; eval's has no `train` key and reads any weights
    task = str(cfg.get("task_name") or "train") if trains else "train"
    log_dir = _value(cfg.get("paths"), "log_dir")
    if value == "last" and not isinstance(log_dir, str):
        return
    path = checkpoints.resolve_ckpt_path(str(value), str(log_dir), task)
    assert path is not None
    data = _peek_checkpoint(path, value)
    lightning = isinstance(data.get("state_dict"), dict) and "pytorch-lightning_version" in data
    if trains and cfg.get("train") and not lightning:
        raise RunError(
            f"{checkpoints.typed_as(path, str(value))} holds only weights (a model.pth or a bare "
            "state_dict), so training cannot resume from it; pass a Lightning checkpoint (a .ckpt "
            f"file or a run directory), or evaluate it with {_sibling_entry('eval')}"
        )
    if trains and cfg.get("train"):
        _check_earlier_log(path)


def _sibling_entry(task: str) -> str:
    """``python -m <package>.<task>`` for the package whose entry point runs (``mypkg.train``
    gives ``python -m mypkg.eval``); the task's name alone when not run with ``-m``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    package = (getattr(spec, "name", None) or "").rpartition(".")[0]
    return f"python -m {package}.{task}" if package else task


def _check_earlier_log(checkpoint: Path) -> None:
    """The earlier run's CSV log, which a resumed run carries on, read once now: damage there
    is one line naming the file, before the new run directory is made."""
    from runkit import plots
    from runkit.safety.resume import run_dir_of

    log = run_dir_of(checkpoint) / plots.METRICS_CSV
    if log.exists() or log.is_symlink():
        try:
            plots.read_csv_log(log)
        except plots.PlotError as err:
            raise RunError(f"{err}; resume from a run whose log is intact") from err


def _peek_checkpoint(path: Path, value: Any) -> dict[str, Any]:
    """Load ``path`` as ``weights_only`` and memory-mapped: the tensors are not read, and a file
    that would run code when unpickled is refused without running it."""
    import pickle

    from runkit.safety.checkpoints import load_file, typed_as

    try:
        return load_file(path, mmap=True)
    except RunError as err:
        if not isinstance(err.__cause__, pickle.UnpicklingError):
            raise
        lines = [line.strip() for line in str(err.__cause__).splitlines() if "GLOBAL" in line]
        what = f" ({lines[0]})" if lines else ""
        raise RunError(
            f"{typed_as(path, str(value))} was refused: it holds objects that loading with "
            f"weights_only does not allow{what}; it is not loaded"
        ) from err


@dataclass
class _Claim:
    directory: Path
    first_new: Path | None  # the highest directory the claim created (None: it existed)
    marker: str
    had_files: bool  # the directory existed with files in it: never removed


_claimed: _Claim | None = None


def claim_run_dir(cfg: DictConfig, key: str) -> None:
    """Refuse a directory that holds an earlier run, then claim it for this one, atomically.

    Checking first and creating later is a race: two runs given the same ``hydra.run.dir`` would
    both pass the check and write over each other. The claim is one ``mkdir`` of Hydra's own
    ``.hydra`` folder (``multirun.yaml``, created exclusively, for a sweep): exactly one of two
    racing runs gets it, the other stops here in one line. Processes started for a run that has
    been claimed already (DDP ranks, torchrun and SLURM tasks) share its directory on purpose.
    """
    global _claimed
    from runkit.run.launch import launched_externally, ranks_start_together

    # Lightning's DDP children reuse rank 0's directory, made before they start. The ranks of
    # torchrun and SLURM start together, each checks (none can write there before all have met
    # in the process group), so a used directory is one line on every node, not one rank's line
    # and a peer's C++ traceback from the rendezvous it waits in.
    if is_worker_process() and not ranks_start_together():
        return
    if os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
        return  # a requeued SLURM job resumes in its own directory (runkit.run.launch.run_id)
    try:
        directory = Path(os.path.abspath(str(OmegaConf.select(cfg, key))))  # as Hydra makes it
    except Exception:  # an unresolvable path fails later with Hydra's own message
        return
    found = [name for name in RUN_MARKERS if (directory / name).exists()]
    if found:
        elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        hint = (
            f"give torchrun a new --rdzv-id (not {elastic})"
            if elastic != "none"
            else "pick a new directory"
        )
        raise RunError(
            f"{key}={str(directory)!r} already holds a run ({', '.join(found)}); {hint} "
            "(resuming with ckpt_path=... starts a new run directory by itself)"
        )
    if launched_externally():
        return  # torchrun / SLURM: every rank runs Hydra here; run_id names the launch
    sweep = key == "hydra.sweep.dir"
    if sweep and _resumable_sweep(cfg) and (directory / "multirun.yaml").is_file():
        return  # an earlier parallel sweep, resumed there; its launcher locks the folder
    marker = (
        "multirun.yaml" if sweep else str(OmegaConf.select(cfg, "hydra.output_subdir") or ".hydra")
    )
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
        raise file_failure(err) or err from err  # never None here: it names a file
    _claimed = _Claim(directory, first_new, marker, had_files)


def _resumable_sweep(cfg: DictConfig) -> bool:
    """Whether the sweep runs with the parallel launcher, which resumes an earlier sweep's folder
    (:mod:`runkit.run.sweep`)."""
    target = OmegaConf.select(cfg, "hydra.launcher._target_", default=None)
    return str(target).endswith(".RunkitParallelLauncher")


# What Hydra and a run's first steps write before the run produced anything of its own.
_HYDRA_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}


def discard_unused(run_dir: Path) -> bool:
    """Remove ``run_dir`` if it holds only Hydra's files, ``config.yaml`` and log files, and the
    parent directories its claim created; keep everything if it holds anything else.

    For a run that failed with a one-line mistake before producing anything: it leaves nothing.
    Returns whether the directory was removed.
    """
    run_dir = Path(os.path.abspath(run_dir))
    claim = _claimed if _claimed is not None and _claimed.directory == run_dir else None
    subdir = run_dir / (claim.marker if claim is not None else ".hydra")
    if claim is not None and claim.had_files:
        return False  # a directory the user gave with files in it: not ours to remove
    if not run_dir.is_dir() or not _only_start_files(run_dir, subdir):
        return False
    if subdir.is_dir():
        for file in subdir.iterdir():
            file.unlink()
        subdir.rmdir()
    for entry in run_dir.iterdir():
        if entry.is_dir():  # an empty folder a logger or the checkpoint callback made
            entry.rmdir()
        else:
            entry.unlink()
    run_dir.rmdir()
    if claim is not None and claim.first_new is not None:
        for directory in run_dir.parents:  # the parents the claim created, now empty
            if claim.first_new not in (directory, *directory.parents):
                break
            try:
                directory.rmdir()
            except OSError:
                break
    return True


def _only_start_files(run_dir: Path, subdir: Path) -> bool:
    for entry in run_dir.iterdir():
        if entry == subdir and entry.is_dir() and not entry.is_symlink():
            if any(f.name not in _HYDRA_FILES or not f.is_file() for f in entry.iterdir()):
                return False
        elif entry.is_dir() and not entry.is_symlink():
            if any(entry.iterdir()):
                return False
        elif not entry.is_file() or not (entry.suffix == ".log" or entry.name == "config.yaml"):
            return False
    return True


def is_worker_process() -> bool:
    """Whether this process is a DDP rank other than the first (global or node rank > 0)."""
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
        raise RunError(
            f"{path}._target_={target!r} cannot be imported; expected a dotted path to a class "
            "or function, e.g. torch.nn.Linear"
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
