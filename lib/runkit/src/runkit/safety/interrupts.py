"""Acting on a recorded stop signal: all ranks stop together, at one batch, and save once
(Lightning's handler broadcasts inside the handler, so DDP ranks diverge and hang)."""

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
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from runkit import compat, quoting
from runkit.errors import RunError
from runkit.safety import signals
from runkit.safety.checkpoints import explain_load_failure

log = logging.getLogger(__name__)

INTERRUPTED_FILE = "interrupted.ckpt"


class _RecordOnlyConnector(_SignalConnector):  # private: Lightning has no switch for its handlers
    def register_signal_handlers(self) -> None:
        self.received_sigterm = False


class GracefulInterrupt(Callback):
    """Stop every rank at the same batch when any rank got a stop signal; save in fit."""

    def __init__(self) -> None:
        self._group: Any = None
        self._stopping = False
        self._limits: list[float] = []  # predict under DDP: the batches every rank runs

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        request = signals.request
        request.quiet = request.quiet or not trainer.is_global_zero
        if not request.active:
            return  # no handlers of ours (a notebook, a test): Lightning keeps its own
        if not isinstance(trainer._signal_connector, _RecordOnlyConnector):  # private
            trainer._signal_connector = _RecordOnlyConnector(trainer)
        if self._group is None and _distributed(trainer) and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # CPU flags: no GPU sync

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning's predict sampler does not pad: agree only at the batches every rank runs.
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
        """One all-reduce (MAX) of each rank's signal; an agreed stop ends the loop."""
        request = signals.request
        if self._stopping or not request.active:
            return
        if trainer.predicting and self._limits and batch_idx >= self._limits[loader]:
            return
        signum = request.received or 0
        if _distributed(trainer):
            flag = torch.tensor([signum], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            signum = int(flag.item())
        if not signum:
            return
        self._stopping, request.agreed = True, signum
        procs = getattr(trainer.strategy.launcher, "procs", None)  # its worker list
        if procs:  # Lightning's watchdog would SIGKILL rank 0 as the workers exit 128+N
            request.children = list(procs)
            procs.clear()
        if trainer.training and trainer.global_step:
            trainer._signal_connector.received_sigterm = True  # private: the loop-stop flag
        elif not _in_fit_validation(trainer):
            raise SIGTERMException

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _agree

    def on_validation_start(self, trainer: Trainer, *args: Any, stop: bool = False) -> None:
        # A stop agreed before or during fit's validation takes effect once it is over.
        if self._stopping and _in_fit_validation(trainer):
            trainer._signal_connector.received_sigterm = stop  # private: see _agree

    def on_validation_end(self, trainer: Trainer, *args: Any) -> None:
        self.on_validation_start(trainer, stop=True)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, err: BaseException
    ) -> None:
        request = signals.request
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not isinstance(err, SIGTERMException) or request.agreed is None or not fitting:
            return
        if trainer.sanity_checking or trainer.global_step == 0:
            request.detail = " before the first training step (nothing to save)"
            return
        path = checkpoint_dir(trainer) / INTERRUPTED_FILE
        trainer.save_checkpoint(path, weights_only=False)  # every rank calls it; rank 0 writes
        request.detail = (
            f" at epoch {trainer.current_epoch}, step {trainer.global_step}; saved {path}"
        )
        if trainer.is_global_zero:
            log.warning("Interrupted; resume with:\n  %s", resume_command(path))


def _in_fit_validation(trainer: Trainer) -> bool:
    """Fit's validation cannot resume where it stopped: a stop there lets it and its epoch end."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    return fitting and trainer.validating and not trainer.sanity_checking


def _distributed(trainer: Trainer) -> bool:
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


@contextmanager
def phase(name: str, trainer: Trainer | None = None) -> Iterator[None]:
    """Run one phase (``fit``, ``test``...): a stop ends it in one line and 128 + N."""
    request = signals.request
    request.phase, request.phase_done = name, False
    try:
        yield
    except SIGTERMException:  # an agreed stop, or Lightning's own handler
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
    if request.agreed is not None:  # agreed at the phase's last batch
        _stop(request.agreed)
    request.phase_done = True


def _stop(signum: int) -> None:
    if signum == signal.SIGUSR1 and not signals.request.quiet:
        signals.request.detail += requeue_slurm_job()
    signals.exit_stopped(signum)


def requeue_slurm_job() -> str:
    if (job := signals.slurm_job_id()) is None:
        return ""
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=120
        )
        if done.returncode == 0:
            return f"; requeued SLURM job {job}"
        reason = (
            "scontrol: " + [f"exit code {done.returncode}", *done.stderr.strip().splitlines()][-1]
        )
    except (OSError, subprocess.SubprocessError) as err:
        reason = str(err)
    return f"; could not requeue SLURM job {job} ({reason}): submit it again to resume"


def checkpoint_dir(trainer: Trainer) -> Path:
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"


def resume_command(checkpoint: Path) -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:  # not under Hydra (a notebook, a test): the command line's
        overrides = compat.hydra_args_parser().parse_known_args(sys.argv[1:])[0].overrides
    kept = [o for o in overrides if not o.lstrip("+~").startswith("ckpt_path=")]
    command = quoting.command([*program, *quoting.config_options(sys.argv[1:]), *kept])
    prefix = "".join(f"{word} " for word in quoting.environment_prefix(os.environ))
    return f"{prefix}{command} {quoting.override('ckpt_path', str(checkpoint))}"


class PeerDied(RunError):
    exit_code = 1  # a DDP peer died: this process stops instead of waiting for it


def watch_parent() -> None:
    """In a DDP worker of Lightning's launcher: exit when rank 0 dies."""
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
        signals._write_line(
            f"error: rank {rank}: the launching process (pid {parent}) died; "
            "ending this worker instead of waiting in a collective"
        )
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
