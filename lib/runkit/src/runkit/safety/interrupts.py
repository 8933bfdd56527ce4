"""The stop signals in every phase: all ranks stop together, save once, exit 128+N.

:mod:`~runkit.safety.signals` records a signal and nothing else. This module acts on it:

* :class:`GracefulInterrupt` (always on) replaces Lightning's own signal handling for the run:
  Lightning 2.6's SIGTERM handler broadcasts inside the handler and each rank raises
  ``SIGTERMException`` on its own, so DDP ranks diverge and hang. Instead, at the end of every
  training batch and the start of every batch of the other loops the ranks all-reduce the signal
  they received (one integer, on the CPU: a gloo group when the job runs NCCL, so the GPU is
  never synchronised). When any rank got one,
  every rank ends the loop at that same batch. In fit they then save
  ``checkpoints/interrupted.ckpt`` together (rank 0 writes) and rank 0 prints the command that
  resumes. Under SLURM, SIGUSR1 (``#SBATCH --signal=SIGUSR1@90``) does the same and then
  requeues the job, which resumes from that checkpoint by itself
  (:func:`runkit.run.launch.requeued_checkpoint`).
* :func:`phase` wraps each phase of the tasks (fit, test, export, eval, predict): a stop
  ends it with one line and exit code ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM); a DDP
  peer that died ends it with :class:`PeerDied` instead of a traceback.
* :func:`watch_parent` ends a DDP worker whose rank 0 died.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.connectors.signal_connector import (  # private: no public switch
    _SignalConnector,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from runkit import compat, quoting
from runkit.errors import RunError
from runkit.safety import signals
from runkit.safety.checkpoints import explain_load_failure

log = logging.getLogger(__name__)

INTERRUPTED_FILE = "interrupted.ckpt"


class _RecordOnlyConnector(_SignalConnector):  # private: Lightning's signal connector
    """Lightning's signal connector without its handlers: :mod:`signals` records the signals."""

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False


class GracefulInterrupt(Callback):
    """Stop every rank at the same batch when any rank got a stop signal; save in fit."""

    def __init__(self) -> None:
        self.saved: Path | None = None
        self._group: Any = None
        self._stopping = False
        self._limits: list[float] = []  # predict under DDP: the batches every rank runs, per loader
        compat.skip_unused_batch_hooks(self)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        request = signals.request
        request.quiet = request.quiet or not trainer.is_global_zero
        if not request.active:
            return  # no handlers of ours (a notebook, a test): Lightning keeps its own
        connector = trainer._signal_connector  # private: Lightning has no switch for its handlers
        if not isinstance(connector, _RecordOnlyConnector):
            trainer._signal_connector = _RecordOnlyConnector(trainer)  # private: see above
        if self._group is None and _distributed(trainer) and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # every rank calls setup: collective-safe

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Lightning's predict sampler does not pad: the ranks may run different numbers of
        batches, and agree at the starts of those they all run."""
        self._limits = []
        if _distributed(trainer) and signals.request.active:
            counts = torch.tensor(trainer.num_predict_batches, dtype=torch.float64)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self._group)
            self._limits = counts.tolist()

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 0:  # before the first step: nothing to save, stop at once
            self._agree(trainer, *args)

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self._agree(trainer, module, *args)

    def _agree(
        self, trainer: Trainer, module: Any, batch: Any, batch_idx: int, loader: int = 0
    ) -> None:
        """At the start of every batch of every loop (the sanity check's, predict's...) and the
        end of every training batch: one all-reduce (MAX) of the signal each rank received, so
        every rank learns the same, and an agreed stop ends the loop there. After a training
        step Lightning ends fit after that batch, where a save resumes exactly (the next batch
        is fetched, and its random draws taken, only after it); fit's validation ends first."""
        request = signals.request
        if self._stopping or not request.active:
            return
        if trainer.predicting and self._limits and batch_idx >= self._limits[loader]:
            return
        signum = request.received or 0
        if _distributed(trainer):
            flag = torch.tensor([signum], dtype=torch.int32)  # CPU: no device sync
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            signum = int(flag.item())
        if not signum:
            return
        self._stopping = True
        request.agreed = signum
        procs = getattr(trainer.strategy.launcher, "procs", None)  # private: its worker list
        if procs:
            # Lightning's watchdog thread holds this list and SIGKILLs rank 0 as soon as a worker
            # exits non-zero; the workers now stop with 128+N on purpose, and rank 0 waits for them.
            request.children = list(procs)
            procs.clear()
        if trainer.training and trainer.global_step:
            trainer._signal_connector.received_sigterm = True  # private: Lightning's loop-stop flag
        elif not _in_fit_validation(trainer):
            raise SIGTERMException

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _agree

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_validation_end(trainer, pl_module, stop=False)  # after a stop at a training batch

    def on_validation_end(
        self, trainer: Trainer, pl_module: LightningModule, stop: bool = True
    ) -> None:
        # A stop agreed before or during fit's validation takes effect once that validation is
        # over (Lightning would end it at its first batch).
        if self._stopping and _in_fit_validation(trainer):
            trainer._signal_connector.received_sigterm = stop  # private: see _agree

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        request = signals.request
        if not isinstance(exception, SIGTERMException) or request.agreed is None:
            return
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.sanity_checking or trainer.global_step == 0:
            request.detail = " before the first training step (nothing to save)"
            return
        path = checkpoint_dir(trainer) / INTERRUPTED_FILE
        trainer.save_checkpoint(path, weights_only=False)  # every rank calls it; rank 0 writes
        self.saved = path
        request.detail = (
            f" at epoch {trainer.current_epoch}, step {trainer.global_step}; saved {path}"
        )
        if trainer.is_global_zero:
            log.warning("Interrupted; resume with:\n  %s", resume_command(path))


def _in_fit_validation(trainer: Trainer) -> bool:
    """Whether fit is validating (not its sanity check).

    Lightning can stop there, but it can not resume there exactly: the checkpoint holds neither
    the epoch's training metrics (logged at the epoch's end) nor the half-done validation, so the
    resumed run logs NaN and zero for that epoch and validates on part of the data. A stop there
    lets the validation finish: the epoch then ends as uninterrupted (metrics logged, the best
    and last checkpoints saved) and the run stops before the next training batch.
    """
    return (
        trainer.state.fn == TrainerFn.FITTING and trainer.validating and not trainer.sanity_checking
    )


def _distributed(trainer: Trainer) -> bool:
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


@contextmanager
def phase(name: str, trainer: Trainer | None = None) -> Iterator[None]:
    """Run one phase of the run (``fit``, ``test``, ``export``...); a stop ends it with 128 + N.

    ``trainer``: the phase runs Lightning with it (its ranks agree on stops at batch boundaries).
    """
    request = signals.request
    request.phase, request.phase_done = name, False
    try:
        yield
    except SIGTERMException:  # Lightning ended the loop: an agreed stop, or Lightning's own handler
        _stop(request.agreed or request.received or signal.SIGTERM)
    except RuntimeError as err:
        misfit = trainer is not None and explain_load_failure(trainer, err)
        if misfit:  # Lightning's strict load, after setup(): one line naming the keys
            raise misfit from err
        if trainer is None or trainer.world_size < 2 or not any(t in str(err) for t in _PEER_GONE):
            raise
        if request.active and request.received is not None:  # that rank quit on the signal too
            request.detail += "; another rank had already stopped"
            _stop(request.received)
        first = textwrap.shorten(str(err).splitlines()[0], width=300, placeholder=" ...")
        raise PeerDied(
            f"rank {trainer.global_rank}: another process of this {trainer.world_size}-process "
            f"job died ({first}); stopping the job. The last complete checkpoint is in "
            f"{checkpoint_dir(trainer)}"
        ) from err
    if request.agreed is not None:  # agreed at the phase's last batch: every rank stops here
        _stop(request.agreed)
    request.phase_done = True  # a signal from here on comes after the phase's files are written


def _stop(signum: int) -> None:
    request = signals.request
    if signum == signal.SIGUSR1 and not request.quiet:
        request.detail += requeue_slurm_job()
    signals.exit_stopped(signum)


def requeue_slurm_job() -> str:
    """Put this SLURM job back in the queue (``scontrol requeue``); what happened, for the last line."""
    job = signals.slurm_job_id()
    if job is None:
        return ""
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"; could not requeue SLURM job {job} ({err}): submit it again to resume"
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return (
            f"; could not requeue SLURM job {job} (scontrol: {reason}): submit it again to resume"
        )
    return f"; requeued SLURM job {job}"


def checkpoint_dir(trainer: Trainer) -> Path:
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"


def resume_command(checkpoint: Path) -> str:
    """``[PYTHONPATH=...] python -m <package>.train <config options> <the same overrides>
    ckpt_path=<checkpoint>``, ready to paste.

    Whatever found the run's configs and code comes along (``--config-dir`` and the other config
    options, ``PYTHONPATH``): without them the pasted command fails to compose or to import. The
    overrides are the user's own, already in Hydra's syntax, so only the shell quotes them; the
    checkpoint's path is a raw value (spaces, é, quotes...) and is quoted for Hydra as well.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    options = quoting.config_options(sys.argv[1:])
    overrides = _task_overrides()
    kept = [o for o in overrides if not o.lstrip("+~").startswith("ckpt_path=")]
    command = quoting.command([*program, *options, *kept])
    prefix = "".join(f"{word} " for word in quoting.environment_prefix(os.environ))
    return f"{prefix}{command} {quoting.override('ckpt_path', str(checkpoint))}"


def _task_overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # not running under Hydra (a notebook, a test): the command line's
        args, _ = compat.hydra_args_parser().parse_known_args(sys.argv[1:])
        return list(args.overrides)


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class PeerDied(RunError):
    """A DDP peer process died; this one stops instead of waiting for it."""

    exit_code = 1


def watch_parent(period: float = 1.0) -> None:
    """In a DDP worker, exit when the process that launched it (rank 0) dies.

    Rank 0 watches its workers (Lightning's ``_ChildProcessObserver`` kills the job when one
    dies), but nothing watches rank 0: an orphaned worker would wait in a collective until the
    process group's timeout (30 minutes by default). Polling the parent id bounds that to about
    ``period`` seconds. Does nothing outside a worker started by Lightning's launcher.
    """
    if os.environ.get("LOCAL_RANK", "0") in ("", "0") or os.environ.get("RUNKIT_NO_PARENT_WATCH"):
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
