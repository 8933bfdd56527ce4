"""Every private Lightning, torch and Hydra API the library relies on, each with who uses it,
why, and a probe the suite runs, so a release that moves one fails in a line naming it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple


class PrivateApi(NamedTuple):
    owner: str
    name: str
    used_by: str
    why: str
    probe: Callable[[], Any] | None = None

    def missing(self) -> str | None:
        detail = ""
        try:
            if (self.probe or self._present)():
                return None
        except Exception as err:  # an import that moved, a signature that changed
            detail = f" ({type(err).__name__}: {err})"
        return (
            f"{self.owner}.{self.name} is gone or changed{detail}; {self.used_by} relies on it "
            f"({self.why}); adapt it to this release"
        )

    def _present(self) -> bool:  # on the class, else on an instance made without arguments
        owner = _resolve(self.owner)
        return hasattr(owner, self.name) or hasattr(owner(), self.name)


def _resolve(path: str) -> Any:
    module_name, _, rest = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, rest.split(".")):
        obj = getattr(obj, part)
    return obj


def _uses(path: str, name: str) -> bool:
    return name in _resolve(path).__code__.co_names


def _parses_as_hydra() -> bool:
    args = hydra_args_parser().parse_args(["-m", "--cfg", "job", "-cd", "d", "a=1"])
    return (args.multirun, args.cfg, args.config_dir, args.config_name, args.overrides) == (
        True, "job", "d", None, ["a=1"]
    )  # fmt: skip


PRIVATE_APIS: tuple[PrivateApi, ...] = (
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
    ),
    PrivateApi(
        "rich.live:Live",
        "_refresh_thread",
        "runkit.compat.detach_refresh_thread (runkit.run.progress_bar)",
        "stopping a display joins its refresh thread: up to a second a stage, no public way out",
        lambda: (
            "_refresh_thread" in vars(_resolve("rich.live:Live")())
            and _uses(
                "lightning.pytorch.callbacks.progress.rich_progress:CustomProgress.stop",
                "_refresh_thread",
            )
        ),
    ),
    PrivateApi(
        "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher",
        "procs",
        "runkit.run.launch",
        "collecting a sweep job's DDP children before the next job starts",
        lambda: _uses(
            "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher.__init__",
            "procs",
        ),
    ),
    PrivateApi(
        "hydra._internal.utils",
        "get_args_parser",
        "runkit.compat.hydra_args_parser (run.cli, quoting, safety.interrupts)",
        "Hydra's own command-line parser, to tell flags from overrides exactly as Hydra will",
        _parses_as_hydra,
    ),
    PrivateApi(
        "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter",
        "__init__",
        "runkit.compat.forked_for_a_dataloader_worker (runkit.safety.signals)",
        "a child forked from there is a DataLoader worker, which keeps the stop signals blocked; "
        "nothing else marks a worker before its loop starts",
        lambda: _uses(
            "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter.__init__", "start"
        ),
    ),
    PrivateApi(
        "lightning.pytorch.strategies:ModelParallelStrategy",
        "_data_parallel_size",
        "runkit.strategies.fsdp",
        "FSDP over every process: devices * num_nodes, known only once the processes are set up",
    ),
    PrivateApi(
        "lightning.pytorch.loops.fit_loop:_FitLoop",
        "_data_fetcher",
        "runkit.compat.restart_train_data (runkit.safety.resume)",
        "the epoch's iterator exists before any hook: a resume re-creates it after reseeding",
        lambda: hasattr(
            _resolve("lightning.pytorch:Trainer")(logger=False).fit_loop, "_data_fetcher"
        ),
    ),
    PrivateApi(
        "lightning.pytorch.loops.fetchers:_DataFetcher",
        "fetched",
        "runkit.compat.restart_train_data (runkit.safety.resume)",
        "batches read again on resume are not new batches; Lightning adds the checkpoint's own",
    ),
)


def detach_refresh_thread(progress: Any) -> None:
    """Let a Rich display stop without joining its refresh thread (it ends when it wakes)."""
    live = progress.live
    thread = live._refresh_thread
    if thread is not None:
        thread.refresh_cond = False  # Lightning's "redraw when you wake" request
        thread.stop()
        live._refresh_thread = None


def hydra_args_parser() -> Any:
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def restart_train_data(trainer: Any, skip: int) -> int:
    """Create the training epoch's iterator again and read ``skip`` batches; how many were read."""
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


def forked_for_a_dataloader_worker() -> bool:
    """In a child, right after the fork: whether torch's DataLoader forked it to be a worker."""
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    if dataloader is None:
        return False
    starts = dataloader._MultiProcessingDataLoaderIter.__init__.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not starts:
        frame = frame.f_back
    return frame is not None
