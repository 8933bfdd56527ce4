"""Every private Lightning, torch, OmegaConf and Hydra API the library relies on, in one list.

Each entry names the access, who uses it and why no public API does the job, and has a probe
that the test suite runs, so a release that moves one fails in a line naming it. The simplest
accesses live here as functions. Import-light: the probes import what they check.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrivateApi:
    """One private access: ``owner`` has ``name``; ``probe`` (default: hasattr) proves it."""

    owner: str
    name: str
    used_by: str
    why: str
    probe: Callable[[], bool] | None = None

    def missing(self) -> str | None:
        """``None`` while the access still works; else one line naming it and who breaks."""
        detail = ""
        try:
            if self.probe() if self.probe else hasattr(_resolve(self.owner), self.name):
                return None
        except Exception as err:  # an import that moved, a signature that changed
            detail = f" ({type(err).__name__}: {err})"
        return (
            f"{self.owner}.{self.name} is gone or changed{detail}; {self.used_by} relies on it "
            f"({self.why}); adapt it to this release"
        )


def _resolve(path: str) -> Any:
    module_name, _, rest = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, rest.split(".")):
        obj = getattr(obj, part)
    return obj


def _trainer_attribute(name: str) -> Callable[[], bool]:
    return lambda: hasattr(_trainer(), name)


def _compiled_marker() -> bool:
    import torch

    net, plain = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    net.compile()  # marks the module; nothing is compiled before the first call
    return net._compiled_call_impl is not None and plain._compiled_call_impl is None


def _default_store_probe() -> bool:
    import torch.distributed.distributed_c10d as c10d

    return callable(getattr(c10d, "_get_default_store", None))


def _hydra_args_parser() -> bool:
    args = hydra_args_parser().parse_args(["-m", "--cfg", "job", "-cd", "d", "a=1"])
    return (
        args.multirun is True
        and args.cfg == "job"
        and args.config_dir == "d"
        and args.config_name is None
        and args.overrides == ["a=1"]
    )


def _job_return_value() -> bool:
    from hydra.core.utils import JobReturn, JobStatus

    hydras = JobReturn.__dict__.get("return_value")
    failure = ValueError("a job's failure")
    job = JobReturn(status=JobStatus.FAILED)
    job.return_value = failure
    return isinstance(hydras, property) and hydras.fset is not None and job_failure(job) is failure


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(
        "lightning.pytorch.trainer.call:_call_callback_hooks",
        "callable",
        "runkit.compat.skip_unused_batch_hooks (every runkit callback)",
        "Lightning's hook dispatch skips a hook attribute that is not callable; no public way to "
        "say a callback does not use a hook",
        lambda: _skips_hooks_that_are_not_callable(),
    ),
    PrivateApi(
        "lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector",
        "register_signal_handlers",
        "runkit.safety.interrupts",
        "a subclass without Lightning's SIGTERM handler, so all ranks stop together; no switch",
    ),
    PrivateApi(
        "lightning.pytorch:Trainer",
        "_signal_connector",
        "runkit.safety.interrupts",
        "the flag Lightning's loop checks to stop at a batch boundary",
        _trainer_attribute("_signal_connector"),
    ),
    PrivateApi(
        "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop",
        "batch_idx",
        "runkit.compat.fit_batch_index (finite-loss guard)",
        "the batch index inside the epoch, which the error names; not on the Trainer",
        lambda: hasattr(_trainer_attribute_value("fit_loop").epoch_loop, "batch_idx"),
    ),
    PrivateApi(
        "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop",
        "_batches_that_stepped",
        "runkit.compat.logging_step (GpuStatsMonitor's rows)",
        "the step Lightning logs its own rows at (its LearningRateMonitor and DeviceStatsMonitor "
        "read it too); trainer.global_step is one ahead of it at a validation's and an epoch's end",
        lambda: "_batches_that_stepped" in vars(_trainer_attribute_value("fit_loop").epoch_loop),
    ),
    PrivateApi(
        "rich.live:Live",
        "_refresh_thread",
        "runkit.compat.detach_refresh_thread (runkit.run.progress_bar)",
        "Lightning's refresh thread sleeps 1/refresh_rate and its stop joins it: each stage's "
        "end waited up to a second; nothing public stops a display without that join",
        lambda: (
            "_refresh_thread" in vars(_resolve("rich.live:Live")())
            and "_refresh_thread"
            in _resolve(
                "lightning.pytorch.callbacks.progress.rich_progress:CustomProgress.stop"
            ).__code__.co_names
        ),
    ),
    PrivateApi(
        "torch.nn:Module",
        "_compiled_call_impl",
        "runkit.speed, runkit.strategies.dp",
        "whether nn.Module.compile was called (compile once; refuse DP of a compiled network)",
        _compiled_marker,
    ),
    PrivateApi(
        "torch.nn:Module",
        "_modules",
        "runkit.strategies.dp",
        "pl_module.net shadowed by the DataParallel wrapper without registering it, so "
        "parameters and state_dict keys stay those of the network",
        lambda: "net" in _linear_holder()._modules,
    ),
    PrivateApi(
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        "runkit.compat.default_store (gpu_stats' exchange between ranks)",
        "the job's key-value store: ranks hand rank 0 their figures without a collective, "
        "which would deadlock against Lightning's rank-0-only metric sync",
        _default_store_probe,
    ),
    PrivateApi(
        "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher",
        "procs",
        "runkit.run.launch",
        "collecting a sweep job's DDP children before the next job starts",
        lambda: (
            "procs"
            in _resolve(
                "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher"
            ).__init__.__code__.co_names
        ),
    ),
    PrivateApi(
        "hydra._internal.utils",
        "get_args_parser",
        "runkit.compat.hydra_args_parser (runkit.run.cli, -m with --cfg; runkit.quoting.config_options; "
        "runkit.safety.interrupts outside Hydra)",
        "Hydra's own command-line parser, to tell flags from overrides exactly as Hydra will",
        _hydra_args_parser,
    ),
    PrivateApi(
        "hydra.core.utils:JobReturn",
        "_return_value",
        "runkit.compat.job_failure (runkit.run.cli, a sweep's reported job)",
        "a failed job's exception, read without Hydra's 'Error executing job' report, which "
        "the public return_value writes first",
        _job_return_value,
    ),
    PrivateApi(
        "torch.utils.data._utils.signal_handling",
        "_set_worker_signal_handlers",
        "runkit.compat.leave_dataloader_workers_out_of_stops (runkit.safety.signals)",
        "a forked DataLoader worker sets torch's SIGTERM handler, which dies by a signal its parent "
        "did not send (a process group's SIGTERM) and so crashes the parent's stop; the only "
        "point after it and before the worker's loop",
        lambda: _worker_signal_handlers(),
    ),
    PrivateApi(
        "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter",
        "__init__",
        "runkit.compat.forked_for_a_dataloader_worker (runkit.safety.signals)",
        "a child forked from there will be a DataLoader worker, which keeps the stop signals "
        "blocked from the fork on; nothing else marks a worker before its loop starts",
        lambda: (
            "start"
            in _resolve(
                "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter.__init__"
            ).__code__.co_names
        ),
    ),
    PrivateApi(
        "lightning.pytorch.strategies:ModelParallelStrategy",
        "_data_parallel_size",
        "runkit.compat.set_data_parallel_size (runkit.strategies.fsdp)",
        "FSDP over every process: the data-parallel size is devices * num_nodes, known only "
        "once the Trainer has set the processes up ('auto' means num_nodes)",
        lambda: (
            "_data_parallel_size"
            in vars(_resolve("lightning.pytorch.strategies:ModelParallelStrategy")())
        ),
    ),
    PrivateApi(
        "lightning.pytorch.loops.fit_loop:_FitLoop",
        "_data_fetcher",
        "runkit.compat.restart_train_data (runkit.safety.resume)",
        "the training epoch's iterator: Lightning restores the loops after on_fit_start and "
        "creates it before on_train_start (no hook between), so a resume re-creates it after "
        "reseeding and reads the batches trained on; a DataLoader's sampler cannot be swapped",
        lambda: "_data_fetcher" in vars(_trainer_attribute_value("fit_loop")),
    ),
    PrivateApi(
        "lightning.pytorch.loops.fetchers:_DataFetcher",
        "fetched",
        "runkit.compat.restart_train_data (runkit.safety.resume)",
        "batches read again on resume are not new batches; Lightning adds the checkpoint's own",
        lambda: "fetched" in vars(_resolve("lightning.pytorch.loops.fetchers:_DataFetcher")()),
    ),
    PrivateApi(
        "lightning.pytorch.strategies:DDPStrategy",
        "_get_process_group_backend",
        "runkit.compat.process_group_backend (runkit.run.launch.join_restarted_group)",
        "the backend Lightning would pass to init_process_group, for a torchrun restart that "
        "sets the group up first (torch's store for it lacks a per-attempt prefix)",
    ),
)


def _skips_hooks_that_are_not_callable() -> bool:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer import call

    called: list[str] = []

    class Probe(pl.Callback):
        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            called.append("on_after_backward")

    probe = Probe()
    skip_unused_batch_hooks(probe)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    call._call_callback_hooks(trainer, "on_before_backward", None)  # None: skipped, no error
    call._call_callback_hooks(trainer, "on_after_backward")
    return probe.on_before_backward is None and called == ["on_after_backward"]


def _worker_signal_handlers() -> bool:
    from torch.utils.data import _utils
    from torch.utils.data._utils import signal_handling, worker

    return callable(signal_handling._set_worker_signal_handlers) and (
        "signal_handling" in vars(worker)
        and "_set_worker_signal_handlers" in worker._worker_loop.__code__.co_names
        and _utils.signal_handling is signal_handling
    )


def _trainer() -> Any:
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )


def _trainer_attribute_value(name: str) -> Any:
    return getattr(_trainer(), name)


def _linear_holder() -> Any:
    import torch

    holder, wrapper = torch.nn.Module(), torch.nn.Identity()
    holder.net = torch.nn.Linear(1, 1)
    vars(holder)["net"] = wrapper  # what DataParallelStrategy does
    assert holder.net is wrapper and list(holder.state_dict()) == ["net.weight", "net.bias"]
    return holder


def check_all() -> list[str]:
    """One line per private access that no longer works in the installed releases."""
    return [line for api in PRIVATE_APIS if (line := api.missing()) is not None]


BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


def skip_unused_batch_hooks(callback: Any) -> None:
    """Leave ``callback`` out of Lightning's dispatch of each per-batch hook its class inherits
    unchanged from ``Callback`` (set to ``None`` on the instance, which the dispatch skips; six
    calls a step otherwise, whatever they do). Private: see PRIVATE_APIS."""
    from lightning.pytorch import Callback

    skip_hooks(
        callback,
        *(n for n in BATCH_HOOKS if getattr(type(callback), n, None) is getattr(Callback, n)),
    )


def skip_hooks(callback: Any, *names: str) -> None:
    """Leave ``callback`` out of Lightning's dispatch of the hooks ``names`` (private: see
    PRIVATE_APIS; how, see :func:`skip_unused_batch_hooks`)."""
    for name in names:
        setattr(callback, name, None)


def fit_batch_index(trainer: Any) -> int:
    """The index of the current training batch within its epoch (private: see PRIVATE_APIS)."""
    return int(trainer.fit_loop.epoch_loop.batch_idx)


def logging_step(trainer: Any) -> int:
    """The step Lightning logs its own rows at now (private: see PRIVATE_APIS). A training
    epoch's end is the exception: Lightning logs the epoch's rows one lower, at its last batch."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def detach_refresh_thread(progress: Any) -> None:
    """Tell a Rich display's refresh thread to end and let the display stop without joining it
    (private: see PRIVATE_APIS). Lightning's thread sleeps a whole redraw interval between
    checks of its flag; detached, it ends at its next wake-up by itself (a daemon thread that
    draws nothing more)."""
    live = progress.live
    thread = live._refresh_thread
    if thread is not None:
        thread.refresh_cond = False  # Lightning's "redraw when you wake" request
        thread.stop()
        live._refresh_thread = None


def default_store() -> Any:
    """The default process group's key-value store (private: see PRIVATE_APIS)."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def hydra_args_parser() -> Any:
    """Hydra's own ``argparse`` parser of a command line (private: see PRIVATE_APIS)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def job_failure(job: Any) -> Any:
    """What a Hydra ``JobReturn`` holds (a failed job's exception) without the report Hydra's
    ``return_value`` writes (private: see PRIVATE_APIS)."""
    return getattr(job, "_return_value", None)


def set_data_parallel_size(strategy: Any, size: int) -> None:
    """Set a ``ModelParallelStrategy``'s data-parallel mesh size (private: see PRIVATE_APIS)."""
    strategy._data_parallel_size = int(size)


def restart_train_data(trainer: Any, skip: int) -> int:
    """Create the training epoch's iterator again and read ``skip`` batches; how many were read
    (fewer when the data ends first). Private: see PRIVATE_APIS."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None:
        return 0
    iter(fetcher)
    read = 0
    for _ in range(skip):
        try:
            next(fetcher)
        except StopIteration:
            break
        read += 1
    fetcher.fetched -= read  # Lightning adds the batches the checkpoint had done
    return read


def process_group_backend(strategy: Any) -> str | None:
    """The process-group backend a Lightning strategy will use (``gloo``, ``nccl``...), or
    ``None`` for a strategy without one (private: see PRIVATE_APIS)."""
    get = getattr(strategy, "_get_process_group_backend", None)
    return get() if callable(get) else None


def leave_dataloader_workers_out_of_stops(install: Callable[[], Any]) -> None:
    """In a forked child: run ``install`` right after a DataLoader worker sets torch's signal
    handlers, before its loop (private: see PRIVATE_APIS). Only this child's module changes."""
    from torch.utils.data._utils import signal_handling

    torchs = signal_handling._set_worker_signal_handlers

    def worker_handlers(*args: Any) -> None:
        torchs(*args)
        install()

    signal_handling._set_worker_signal_handlers = worker_handlers


def forked_for_a_dataloader_worker() -> bool:
    """In a child, right after the fork: whether torch's DataLoader forked it to be a worker (the
    fork was called from ``_MultiProcessingDataLoaderIter.__init__``; private: see PRIVATE_APIS)."""
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    if dataloader is None:
        return False
    starts = dataloader._MultiProcessingDataLoaderIter.__init__.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not starts:
        frame = frame.f_back
    return frame is not None
