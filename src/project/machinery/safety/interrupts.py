"""Ctrl-C and SIGTERM save a checkpoint and say how to resume; a worker whose parent dies exits.

Lightning 2.6 already handles SIGTERM well: its signal connector sets a flag and the training
loop raises ``SIGTERMException`` at the end of the current batch, when the weights, the optimiser
and the loop counters agree. Ctrl-C, by contrast, raises ``KeyboardInterrupt`` wherever Python
happens to be (inside ``optimizer.step``, say), and Lightning exits without saving. So during
training :class:`GracefulInterrupt` turns the first Ctrl-C into the same flag as SIGTERM; either
one then ends the batch, saves ``checkpoints/interrupted.ckpt``, prints the command that resumes,
and the process exits with ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM). A second Ctrl-C
quits at once, without saving.

SLURM: with ``#SBATCH --signal=SIGUSR1@90`` Lightning's SLURM environment saves an ``hpc_ckpt``
and requeues the job on SIGUSR1; nothing here touches SIGUSR1.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from project.errors import ProjectError

log = logging.getLogger(__name__)

INTERRUPTED_FILE = "interrupted.ckpt"


class GracefulInterrupt(Callback):
    """Save a checkpoint on Ctrl-C or SIGTERM at the next batch boundary, then exit non-zero."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.saved: Path | None = None
        self._previous: dict[int, Any] = {}

    # Installed at train start: Lightning registers its own SIGTERM handler just before.
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._trainer = trainer
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: quit now
        first = self.signal is None
        self.signal = signum
        if signum == signal.SIGTERM:
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)  # Lightning's: sets its flag, passes it to DDP workers
        self._trainer._signal_connector.received_sigterm = True
        if first:
            name = signal.Signals(signum).name
            print(
                f"\n{name} received: finishing this batch and saving a checkpoint "
                "(Ctrl-C again quits at once, without saving)",
                file=sys.stderr,
                flush=True,
            )

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException) or self.signal is None:
            return
        self._restore()
        if trainer.sanity_checking or trainer.global_step == 0:
            log.warning("Interrupted before the first training step: no checkpoint to save")
            return
        path = checkpoint_dir(trainer) / INTERRUPTED_FILE
        trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes (crash-safe)
        self.saved = path
        log.warning(
            "Interrupted at epoch %d, step %d; saved %s. Resume with:\n  %s",
            trainer.current_epoch,
            trainer.global_step,
            path,
            resume_command(path),
        )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}


def checkpoint_dir(trainer: Trainer) -> Path:
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"


def resume_command(checkpoint: Path) -> str:
    """``python -m project.train <the same overrides> ckpt_path=<checkpoint>``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else f"python {shlex.quote(sys.argv[0])}"
    overrides = _task_overrides()
    kept = [o for o in overrides if not o.lstrip("+~").startswith("ckpt_path=")]
    return " ".join([program, *map(shlex.quote, kept), shlex.quote(f"ckpt_path={checkpoint}")])


def _task_overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # not running under Hydra (a notebook, a test)
        return list(sys.argv[1:])


def fit(trainer: Trainer, model: LightningModule, datamodule: Any, ckpt_path: Any) -> None:
    """``trainer.fit`` whose interruption by Ctrl-C or SIGTERM exits with ``128 + signal``.

    Lightning ends an interrupted fit with ``SIGTERMException``, a ``SystemExit`` whose code is 0,
    so a scheduler or a shell script would take the run for finished.
    """
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        callback = next((c for c in trainer.callbacks if isinstance(c, GracefulInterrupt)), None)
        signum = (callback.signal if callback else None) or signal.SIGTERM
        raise SystemExit(128 + int(signum)) from None
    except RuntimeError as err:
        if trainer.world_size < 2 or not any(text in str(err) for text in _PEER_GONE):
            raise
        raise PeerDied(
            f"rank {trainer.global_rank}: another process of this {trainer.world_size}-process "
            f"job died ({str(err).splitlines()[0][-120:]}); stopping the job. The last complete "
            f"checkpoint is in {checkpoint_dir(trainer)}"
        ) from err


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class PeerDied(ProjectError):
    """A DDP peer process died; this one stops instead of waiting for it."""

    exit_code = 1


def watch_parent(period: float = 1.0) -> None:
    """In a DDP worker, exit when the process that launched it (rank 0) dies.

    Rank 0 watches its workers (Lightning's ``_ChildProcessObserver`` kills the job when one
    dies), but nothing watches rank 0: an orphaned worker would wait in a collective until the
    process group's timeout (30 minutes by default). Polling the parent id bounds that to about
    ``period`` seconds. Does nothing outside a worker started by Lightning's launcher.
    """
    if os.environ.get("LOCAL_RANK", "0") in ("", "0") or os.environ.get("PROJECT_NO_PARENT_WATCH"):
        return
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
                print(
                    f"error: rank {rank}: the launching process (pid {parent}) died; "
                    "ending this worker instead of waiting in a collective",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
