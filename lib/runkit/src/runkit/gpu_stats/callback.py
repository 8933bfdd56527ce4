"""GPU statistics per epoch from NVML: what the GPUs of *this run* did, not a snapshot.

Why not Lightning's ``DeviceStatsMonitor``: it reads ``torch.cuda.memory_stats`` on the training
thread at every step and knows nothing of utilisation, power or throttling. Here NVML is sampled
off the training thread (a process of its own, :mod:`.process`, or a thread), every
``interval_s``; once per epoch rank 0 logs the mean/max/min of each GPU (``gpu/node{N}/cuda{i}/...``,
``gpu_val/`` for validation) in one ``logger.log_metrics`` call, at the step of Lightning's own rows.
Each torch device is matched to its NVML device by UUID, so ``CUDA_VISIBLE_DEVICES`` and MIG land
on the right GPU. Under DDP each rank hands its figures to rank 0 through the job's key-value
store, not a collective, so nothing can deadlock against Lightning's own syncs. Keys a GPU cannot
report are left out, never logged as 0; a missing driver or a lost GPU costs one log line, never
the run. The run's energy is kept in the checkpoint and continues after a resume.
The keys, the phases and the failure modes in full: lib/runkit/docs/gpu-statistics.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch

from runkit import compat
from runkit.gpu_stats import loop, report
from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.loop import LoopTimer, Ticker, fixed_batches
from runkit.gpu_stats.process import ProcessSampler, SamplerUnavailable
from runkit.gpu_stats.sampler import (
    DEFAULT_GROUPS,
    OPTIONAL_GROUPS,
    TRAIN,
    VAL,
    GpuReader,
    GpuSampler,
    Later,
    TorchPeakMemory,
)
from runkit.gpu_stats.statistics import flatten_epoch, flatten_loop
from runkit.gpus import nvml

log = logging.getLogger(__name__)

MIN_WAIT_WARNING_S = 1.0
"""An epoch waiting for data less than this in all gets no warning, whatever the share: a short
epoch's first batch (loader start-up) would otherwise raise it for nothing."""
STATE_VERSION = 1
SAMPLERS = ("process", "thread")


# --------------------------------------------------------------------------- device mapping
def cuda_device_uuid(index: int) -> str | None:
    """The UUID CUDA reports for ``cuda:index`` (this already reflects CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def process_devices(trainer: Any) -> list[tuple[int, torch.device]]:
    """The devices this process drives, each with its position in ``parallel_devices``.

    One process per device (DDP and friends): the root device only. One process for several
    devices on its node (``world_size == num_nodes`` with several ``parallel_devices``): all.
    """
    strategy = trainer.strategy
    devices = list(getattr(strategy, "parallel_devices", None) or [strategy.root_device])
    if len(devices) > 1 and trainer.world_size == trainer.num_nodes:
        return list(enumerate(devices))
    position = trainer.local_rank if trainer.local_rank < len(devices) else 0
    return [(position, torch.device(strategy.root_device))]


# --------------------------------------------------------------------------- helpers for ranks
def monitored_keys(trainer: Any) -> set[str]:
    """The metric names a callback (``EarlyStopping``, ``ModelCheckpoint``, ...) or a learning
    rate scheduler watches, through their public ``monitor`` attributes."""
    watchers = [*getattr(trainer, "callbacks", []), *getattr(trainer, "lr_scheduler_configs", [])]
    return {m for w in watchers if isinstance(m := getattr(w, "monitor", None), str)}


def gpu_busy_pct(everyone: Sequence[dict[str, Any]]) -> float | None:
    """Mean utilisation of the run's GPUs this epoch (SM activity where a MIG slice has no
    utilisation); None without any reading."""
    values = [
        summary.get("util_mean", summary.get("sm_active_mean"))
        for payload in everyone
        for summary in payload.get("gpus", {}).values()
    ]
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def count_samples(loops: Sequence[dict[str, float] | None]) -> float | None:
    """Training samples of every rank's loop figures; None when a batch held no tensor."""
    if any(loop is not None and "samples" not in loop for loop in loops):
        return None
    return sum(loop["samples"] for loop in loops if loop)


def _loads() -> bool:
    """Load NVML's bindings (not initialise them), so that a sampler process forked now inherits
    the same library; False where there are none (the session below says so in one line)."""
    try:
        nvml.load_library()
    except nvml.NvmlUnavailable:
        return False
    return True


@dataclasses.dataclass
class _Validation:
    """One validation of this rank whose figures rank 0 has not had yet."""

    number: int
    payload: dict[str, Any]  # node, boards, step and epoch: the rest of what rank 0 needs
    figures: Later = dataclasses.field(default_factory=lambda: Later(dict))
    peaks: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")  # the loop timer's
_HOOKS_LOCK = threading.Lock()
"""Turns a monitor's two batch hooks on and off as one, against the ticker's thread (one for
every monitor: an instance's own would not pickle, as ``ddp_spawn`` does)."""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def energy_report(trainer: Any) -> dict[str, Any] | None:
    """The run's energy for ``metrics.json``, from the trainer's :class:`GpuStatsMonitor`: J,
    kWh, J per training sample and J per physical GPU; None without a monitor or a reading."""
    monitor = next((c for c in trainer.callbacks if isinstance(c, GpuStatsMonitor)), None)
    per_gpu = monitor.run_energy_j() if monitor is not None else {}
    if not per_gpu:
        return None
    total = sum(per_gpu.values())
    samples = monitor.run_samples()
    return {
        "energy_j": round(total, 3),
        "energy_kwh": total / 3.6e6,
        "energy_j_per_training_sample": total / samples if samples else None,
        "training_samples": None if samples is None else int(samples),
        "energy_j_per_gpu": {k: round(v, 3) for k, v in per_gpu.items()},
    }


# --------------------------------------------------------------------------- the callback
class GpuStatsMonitor(pl.Callback):
    """Log per-epoch GPU statistics from NVML for every GPU of the run (see the module docstring).

    Args:
        interval_s: seconds between background samples.
        report_validation: also log the validation runs, under ``gpu_val/``.
        fan, pcie, ecc, memory_temperature: log these too (off by default; often unsupported).
        log_sampler_cost: log ``sample_ms``, the NVML time per sample of each GPU.
        summary_table: print a Rich table of every GPU at the end of ``fit`` (rank 0).
        device_uuids: the NVML UUID of each entry of ``trainer.strategy.parallel_devices``, for
            runs whose devices are not CUDA devices (tests and demos on CPU with the fake NVML;
            not in the shipped YAML: ``+callbacks.gpu_stats.device_uuids=[...]`` adds it).
            Leave ``None`` on real GPUs: the UUIDs then come from CUDA.
        key_prefix: first part of every key (``gpu``); validation uses ``{key_prefix}_val``.
        gpm: read GPM metrics (SM activity, occupancy, tensor cores, DRAM) where supported.
        per_gpu_keys_up_to: per-GPU keys for nodes with at most this many GPUs; only the
            ``gpu/all/`` aggregates beyond.
        data_wait_warning: warn when an epoch's loop waited more than this share of its time for
            data while the GPUs were mostly idle (1.0: never).
        gpu_idle_below_pct: "mostly idle": mean utilisation of the run's GPUs below this.
        gather_timeout_s: how long rank 0 waits at an epoch end for the other ranks' figures
            before it logs the epoch without the late ones (one warning naming them).
        sampler: ``"process"`` (default): sample in a child process of each rank, so the
            training process does no NVML work between the epoch boundaries (:mod:`.process`;
            where no process can be started, a thread, with one log line); ``"thread"``: in a
            background thread of the training process.
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        report_validation: bool = True,
        fan: bool = False,
        pcie: bool = False,
        ecc: bool = False,
        memory_temperature: bool = False,
        log_sampler_cost: bool = False,
        summary_table: bool = True,
        device_uuids: Sequence[str] | None = None,
        key_prefix: str = "gpu",
        gpm: bool = True,
        per_gpu_keys_up_to: int = 8,
        data_wait_warning: float = 0.3,
        gpu_idle_below_pct: float = 50.0,
        gather_timeout_s: float = 30.0,
        sampler: str = "process",
    ) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(
                f"GpuStatsMonitor: sampler={sampler!r}; give one of {', '.join(SAMPLERS)}"
            )
        self.sampler = sampler
        for name, seconds in (("interval_s", interval_s), ("gather_timeout_s", gather_timeout_s)):
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))
                or not seconds > 0
            ):
                raise ValueError(f"GpuStatsMonitor: {name}={seconds!r}; give seconds > 0")
        if device_uuids is not None and (
            isinstance(device_uuids, str) or not all(isinstance(u, str) for u in device_uuids)
        ):
            raise ValueError(
                f"GpuStatsMonitor: device_uuids={device_uuids!r}; give a list of NVML UUID strings"
            )
        if not key_prefix or "/" in key_prefix:
            raise ValueError(f"GpuStatsMonitor: key_prefix={key_prefix!r}; give a word without '/'")
        if (
            isinstance(per_gpu_keys_up_to, bool)
            or not isinstance(per_gpu_keys_up_to, int)
            or (per_gpu_keys_up_to < 0)
        ):
            raise ValueError(
                f"GpuStatsMonitor: per_gpu_keys_up_to={per_gpu_keys_up_to!r}; give a GPU count >= 0"
            )
        for name, value, high in (
            ("data_wait_warning", data_wait_warning, 1.0),
            ("gpu_idle_below_pct", gpu_idle_below_pct, 100.0),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0 <= value <= high)
            ):
                raise ValueError(
                    f"GpuStatsMonitor: {name}={value!r}; give a number in [0, {high:g}]"
                )
        self.interval_s = float(interval_s)
        self.gather_timeout_s = float(gather_timeout_s)
        self.report_validation = report_validation
        optional = {"fan": fan, "pcie": pcie, "ecc": ecc, "memory_temperature": memory_temperature}
        self.groups = [*DEFAULT_GROUPS, *(g for g in OPTIONAL_GROUPS if optional[g])]
        if not gpm:
            self.groups.remove("gpm")
        self.per_gpu_keys_up_to = per_gpu_keys_up_to
        self.data_wait_warning = float(data_wait_warning)
        self.gpu_idle_below_pct = float(gpu_idle_below_pct)
        self.log_sampler_cost = log_sampler_cost
        self.summary_table = summary_table
        self.device_uuids = None if device_uuids is None else list(device_uuids)
        self.key_prefix = key_prefix
        self._reset_state()
        compat.skip_unused_batch_hooks(self)

    def _reset_state(self) -> None:
        self._stack = ExitStack()
        self._sampler: GpuSampler | ProcessSampler | None = None
        self._peaks: TorchPeakMemory | None = None
        self._active = False  # some rank samples a GPU (rank 0 knows of all, others of their own)
        self._exchanges = {
            hook: RankExchange(hook, self.gather_timeout_s)
            for hook in ("setup", "validation end", "training epoch end", "training end")
        }
        self._identities: list[dict[str, Any]] = []
        self._summary = report.RunSummary()
        self._phase_before_val: str | None = None
        self._validation_count = 0  # this fit's validations, numbered alike on every rank
        self._validations: list[_Validation] = []  # this rank's, their figures not sent yet
        self._arrived: dict[int, dict[int, dict[str, Any]]] = {}  # rank 0: number -> rank -> it
        self._loop = LoopTimer()
        self._ticker: Ticker | None = None  # begins the loop's measuring windows (loop.py)
        self._measure_steps()
        self._fit_energy_j: dict[str, float] = {}  # this fit, per physical GPU
        self._fit_samples: float | None = 0.0  # training samples of this fit, every rank
        self._epoch_samples: float | None = 0.0  # of the epoch under way, at its validation
        self._restored_energy_j: dict[str, float] = {}  # from the checkpoint a resume starts at
        self._restored_samples: float | None = 0.0

    @property
    def identities(self) -> list[dict[str, Any]]:
        """What every rank reported at setup: status, problems and, per GPU, its identity."""
        return list(self._identities)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._close()
        self._reset_state()
        try:
            local = self._open(trainer)
        except ValueError as err:  # a configuration error: raised below, on every rank at once
            self._close()
            local = {"config_error": str(err)}
        except Exception as err:  # never let statistics break a run
            self._close()
            local = {"status": f"failed to start ({type(err).__name__}: {err})", "gpus": []}
        local.update(node=trainer.node_rank, rank=trainer.global_rank)
        # before anyone may raise
        everyone = self._exchanges["setup"].gather(trainer, local, self._watched(trainer))
        errors = [p["config_error"] for p in everyone if p.get("config_error")]
        if errors:
            self._close()
            raise ValueError(errors[0])
        self._identities = everyone
        self._active = any(p["gpus"] for p in everyone)
        if trainer.is_global_zero:
            self._report_setup(everyone)
        if self._sampler is not None:
            self._start_sampler()

    def _start_sampler(self) -> None:
        sampler = self._sampler
        try:
            sampler.start()
        except SamplerUnavailable as err:
            self._fall_back(err)
            sampler.stop()
            self._sampler = GpuSampler(sampler.readers, self.interval_s)
            self._sampler.start()

    def _fall_back(self, err: Exception) -> None:
        log.warning("gpu_stats: %s; sampling in a thread of the training process instead", err)

    def _open(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Map this process's devices to NVML and probe them. Returns what rank 0 should hear."""
        devices = process_devices(trainer)
        wanted: list[tuple[str, torch.device, str | None]] = []
        for position, device in devices:
            if self.device_uuids is not None:
                if position >= len(self.device_uuids):
                    raise ValueError(
                        f"GpuStatsMonitor: device_uuids has {len(self.device_uuids)} entries but "
                        f"this process drives parallel_devices[{position}]; give one UUID a device"
                    )
                wanted.append((f"cuda{position}", device, self.device_uuids[position]))
            elif device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                wanted.append((f"cuda{index}", device, cuda_device_uuid(index)))
        if not wanted:
            return {"status": "off: this run uses no CUDA device", "gpus": [], "quiet": True}
        child = None
        if self.sampler == "process" and _loads():  # forked before this process opens NVML
            try:
                child = ProcessSampler.fork(
                    [(label, uuid) for label, _device, uuid in wanted if uuid],
                    self.groups,
                    self.interval_s,
                )
            except SamplerUnavailable as err:
                self._fall_back(err)
            else:
                self._stack.callback(child.stop)
        try:
            lib = self._stack.enter_context(nvml.nvml_session())
        except nvml.NvmlUnavailable as err:
            self._close()  # the child, if any, found the same
            return {"status": f"off: {err}", "gpus": []}
        readers, problems = [], []
        for label, _device, uuid in wanted:
            found = nvml.find_handle(lib, uuid) if uuid else None
            if found is None:
                problems.append(f"{label}: no NVML device with UUID {uuid!r}")
                continue
            reader = None
            try:
                reader = GpuReader(lib, found[0], label, self.groups)
                reader.probe()
            except Exception as err:
                if reader is not None:
                    reader.close()
                problems.append(f"{label}: {type(err).__name__}: {err}")
                continue
            readers.append(reader)
            self._stack.callback(reader.close)  # its GPM samples go before NVML shuts down
        if readers and child is not None:
            child.attach(readers)
            self._sampler = child
        elif readers:
            self._sampler = GpuSampler(readers, self.interval_s)
        if readers:
            self._peaks = TorchPeakMemory({label: dev for label, dev, _ in wanted})
        else:
            self._close()
        status = "on" if readers else "off: no usable GPU"
        return {"status": status, "gpus": [r.identity() for r in readers], "problems": problems}

    def _report_setup(self, everyone: Sequence[dict[str, Any]]) -> None:
        idle: dict[tuple[str, bool], list[str]] = {}
        for payload in everyone:
            where = f"rank {payload['rank']} (node {payload['node']})"
            for problem in payload.get("problems", []):
                log.warning("gpu_stats: %s: %s", where, problem)
            if not payload["gpus"]:  # one line for all ranks in the same state
                key = (payload["status"], bool(payload.get("quiet")))
                idle.setdefault(key, []).append(str(payload["rank"]))
            for gpu in payload["gpus"]:
                log.info(
                    "gpu_stats: node%s/%s = %s, %s, NVML index %s, PCI %s%s; not supported: %s",
                    payload["node"],
                    gpu["label"],
                    gpu["name"],
                    gpu["uuid"],
                    gpu["nvml_index"],
                    gpu["pci_bus_id"],
                    " (MIG slice)" if gpu["mig"] else "",
                    ", ".join(gpu["unsupported"]) or "none",
                )
        for (status, quiet), ranks in idle.items():
            log.log(
                logging.INFO if quiet else logging.WARNING,
                "gpu_stats: rank %s: %s; training continues without GPU statistics",
                ",".join(ranks),
                status,
            )

    def _close(self) -> None:
        """Stop the thread and shut NVML down; safe to call any number of times."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()
        self._stack.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()  # Lightning does not call ``teardown`` on this path

    def _guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run local bookkeeping; on a bug, stop sampling here but keep training (and gathers)."""
        try:
            return fn()
        except Exception as err:
            log.warning(
                "gpu_stats: %s failed (%s: %s); sampling stops", what, type(err).__name__, err
            )
            self._close()
            return None

    # ------------------------------------------------------------------ phases
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop.start_epoch(fixed_batches(getattr(trainer, "train_dataloader", None)))
        self._measure_steps()
        if self._sampler is not None:
            self._begin_phase(TRAIN, "epoch start")
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.clear())

    def _begin_phase(self, phase: str, what: str) -> None:
        """Later readings count for ``phase``, the first of them begun now by the sampler process
        (not by this thread): a phase shorter than the interval (a validation, a short epoch)
        then ends without waiting for a reading of every GPU."""
        sampler = self._sampler

        def begin() -> None:
            sampler.set_phase(phase, reset=True, sample=False)
            sampler.sample_soon()

        self._guarded(what, begin)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._loop.batch_start()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._loop.batch_end(batch, batch_idx):  # a window's fast steps: enough
            self._skip_steps()

    def _measure_steps(self) -> None:
        """Lightning calls the two batch hooks again (from the ticker's thread too)."""
        with _HOOKS_LOCK:
            compat.restore_hooks(self, *_STEP_HOOKS)

    def _skip_steps(self) -> None:
        """Lightning skips the two batch hooks until the ticker, an epoch's start or a
        validation's start begins the next window."""
        with _HOOKS_LOCK:
            compat.skip_hooks(self, *_STEP_HOOKS)
        if self._ticker is None:
            self._ticker = Ticker(loop.WINDOW_EVERY_S, self._measure_steps)
            self._stack.callback(self._stop_ticker)

    def _stop_ticker(self) -> None:
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.stop()
        self._measure_steps()

    def _loop_summary(self, trainer: pl.Trainer) -> dict[str, float] | None:
        """The epoch's loop figures; once a window closed, counted from Lightning's batch index."""
        timer = self._loop
        return timer.summary(compat.fit_batch_index(trainer) if timer.windowed else None)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._loop.pause()  # until the next training batch: validation is not a data wait
            self._measure_steps()  # which the next training batch's start tells

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._sampler is None:
            return
        self._phase_before_val = self._sampler.phase
        self._begin_phase(VAL, "validation start")
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.stash())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The validation's figures are asked for here and published once the sampler has
        them (see the module docstring): nothing here waits for a reading."""
        if trainer.sanity_checking:
            return
        sampler, peaks, resume = self._sampler, self._peaks, self._phase_before_val
        local = self._energy_payload(trainer)
        self._validation_count += 1
        validation = _Validation(
            self._validation_count,
            {
                "node": local["node"],
                "boards": local.get("boards", {}),
                "step": compat.logging_step(trainer),
                "epoch": trainer.current_epoch,
            },
        )
        if sampler is not None and self.report_validation:  # asked before the phase switches
            later = self._guarded("validation summary", lambda: sampler.summaries_later(VAL))
            validation.figures = later or validation.figures
            if peaks is not None:
                validation.peaks = self._guarded("peaks", lambda: peaks.peaks(False)) or {}
        if sampler is not None:
            self._guarded(
                "validation end", lambda: sampler.set_phase(resume, reset=False, sample=False)
            )
        if peaks is not None:
            self._guarded("peak reset", lambda: peaks.restart())
        root = f"{self.key_prefix}_val"
        watched = self.report_validation and self._watches(trainer, f"{root}/")
        local["loop"] = self._loop_summary(trainer)  # the epoch so far, for a checkpoint now
        if watched:  # a monitor reads the figures right after this hook: wait for them
            local["gpus"] = self._figures("validation", validation.figures.result, validation.peaks)
        elif self.report_validation:
            self._validations.append(validation)
            local["validations"] = self._ready_validations(wait=False)
        # Every rank, every validation: the run's energy is current when a checkpoint is saved.
        everyone = self._exchanges["validation end"].gather(trainer, local, self._watched(trainer))
        self._add_energy(everyone)
        self._epoch_samples = count_samples([p.get("loop") for p in everyone])
        if watched and self._active:
            flat = flatten_epoch(everyone, root, self.log_sampler_cost, self.per_gpu_keys_up_to)
            self._publish(trainer, flat)
        self._publish_validations(trainer, everyone)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler, peaks = self._sampler, self._peaks
        gpus = None
        if sampler is not None:
            epoch_peaks = {}
            if peaks is not None:
                epoch_peaks = self._guarded("peaks", lambda: peaks.peaks(True)) or {}
            gpus = self._figures("training", lambda: sampler.summaries(TRAIN), epoch_peaks)
        local = self._energy_payload(trainer)  # after the epoch's closing sample, if it took one
        if gpus is not None:
            local["gpus"] = gpus
        if sampler is not None:
            self._guarded("epoch end", lambda: sampler.set_phase(None, sample=False))
        local["loop"] = self._loop_summary(trainer)
        local["validations"] = self._ready_validations(wait=False)
        everyone = self._exchanges["training epoch end"].gather(
            trainer, local, self._watched(trainer)
        )
        self._publish_validations(trainer, everyone)
        flat = flatten_epoch(
            everyone, self.key_prefix, self.log_sampler_cost, self.per_gpu_keys_up_to
        )
        loops = [p.get("loop") for p in everyone]
        flat.update(flatten_loop(loops))
        self._publish(trainer, flat, epoch_end=True)
        self._add_energy(everyone)
        epoch_samples = count_samples(loops)
        self._fit_samples = (
            None
            if None in (self._fit_samples, epoch_samples)
            else (self._fit_samples + epoch_samples)
        )
        self._epoch_samples = 0.0
        self._summary.add_epoch(everyone)
        if trainer.is_global_zero:
            self._warn_if_starved(trainer, everyone, flat)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The validations whose figures were not in yet: waited for, and published."""
        if not self.report_validation:  # alike on every rank: none to wait for
            return
        local = {"rank": trainer.global_rank, "validations": self._ready_validations(wait=True)}
        everyone = self._exchanges["training end"].gather(trainer, local)
        self._publish_validations(trainer, everyone, final=True)

    # ------------------------------------------------------------------ validations, late
    def _ready_validations(self, wait: bool) -> list[tuple[int, dict[str, Any]]]:
        """This rank's validations whose figures are in (``wait``: all of them), as
        ``(number, payload)`` for rank 0, in the order they ran."""
        ready = []
        for validation in self._validations:
            if not (wait or validation.figures.ready()):
                break
            ready.append(validation)
        del self._validations[: len(ready)]
        return [
            (
                v.number,
                {**v.payload, "gpus": self._figures("validation", v.figures.result, v.peaks)},
            )
            for v in ready
        ]

    def _publish_validations(
        self, trainer: pl.Trainer, everyone: Sequence[dict[str, Any]], final: bool = False
    ) -> None:
        """Rank 0: take in the validations every rank sent, and publish each, in order, once
        every rank of this exchange has sent it (``final``: whatever came)."""
        if not trainer.is_global_zero:
            return
        for payload in everyone:
            for number, figures in payload.get("validations", []):
                self._arrived.setdefault(number, {})[payload["rank"]] = figures
        present = {payload["rank"] for payload in everyone}
        root = f"{self.key_prefix}_val"
        for number in sorted(self._arrived):
            ranks = self._arrived[number]
            if not (final or present <= ranks.keys()):
                break
            del self._arrived[number]
            payloads = [ranks[rank] for rank in sorted(ranks)]
            if self._active:
                flat = flatten_epoch(payloads, root, self.log_sampler_cost, self.per_gpu_keys_up_to)
                self._publish(trainer, flat, payloads[0]["step"], payloads[0]["epoch"])

    def _energy_payload(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Who this rank is, and its GPUs' energy so far (read without a wait)."""
        payload: dict[str, Any] = {"node": trainer.node_rank, "rank": trainer.global_rank}
        sampler = self._sampler
        if sampler is not None:
            payload["boards"] = {r.label: r.board_uuid for r in sampler.readers}
            payload["energy_total_j"] = self._guarded("energy", sampler.energy_totals_j) or {}
        return payload

    def _figures(
        self,
        phase: str,
        figures: Callable[[], dict[str, dict[str, float]]],
        peaks: dict[str, dict[str, float]],
    ) -> dict[str, dict[str, float]]:
        """A phase's figures per GPU from the sampler (``figures``), with PyTorch's peaks added."""
        gpus = self._guarded(f"{phase} summary", figures) or {}
        for label, values in peaks.items():
            if label in gpus:
                gpus[label].update(values)
        return gpus

    def _watches(self, trainer: pl.Trainer, *prefixes: str) -> bool:
        return any(key.startswith(prefixes) for key in monitored_keys(trainer))

    def _watched(self, trainer: pl.Trainer) -> bool:
        """Whether a monitor watches one of this callback's keys: then every rank needs the
        run's figures, not only rank 0 (each rank waits for the others at the epoch ends)."""
        return self._watches(trainer, f"{self.key_prefix}/", f"{self.key_prefix}_val/", "loop/")

    def _publish(
        self,
        trainer: pl.Trainer,
        metrics: dict[str, float],
        step: int | None = None,
        epoch: int | None = None,
        epoch_end: bool = False,
    ) -> None:
        """Hand the figures to every logger in one call (rank 0), and the monitored ones to
        ``trainer.callback_metrics`` (every rank); see the module docstring. ``step`` and
        ``epoch``: of the phase the figures are of (default: now, the step of Lightning's rows
        now; ``epoch_end``: of its rows of the epoch, one lower)."""
        if not metrics:
            return
        wanted = monitored_keys(trainer) & metrics.keys()
        if wanted:
            # private: writes into the dict Lightning returns as trainer.callback_metrics (its
            # logger connector's own), which is what monitors read; self.log would cost a result
            # entry and an all-reduce per key for values every rank already holds.
            trainer.callback_metrics.update({k: torch.tensor(float(metrics[k])) for k in wanted})
        if trainer.is_global_zero and trainer.loggers:
            row = {**metrics, "epoch": trainer.current_epoch if epoch is None else epoch}
            if step is None:
                step = compat.logging_step(trainer) - int(epoch_end)
            # Files are written when Lightning next saves its loggers (for its own rows of this
            # moment, or at the end of training); a CSV logger writes here only at a step of
            # its flush interval, where it would write for Lightning's row of the step anyway.
            for logger in trainer.loggers:
                logger.log_metrics(row, step=step)

    # ------------------------------------------------------------------ data starvation
    def _warn_if_starved(
        self, trainer: pl.Trainer, everyone: Sequence[dict[str, Any]], flat: dict[str, float]
    ) -> None:
        share = flat.get("loop/data_wait_frac")
        waited = max((p["loop"]["data_wait_s"] for p in everyone if p.get("loop")), default=0.0)
        if share is None or share <= self.data_wait_warning or waited < MIN_WAIT_WARNING_S:
            return
        busy = gpu_busy_pct(everyone)
        if busy is not None and busy >= self.gpu_idle_below_pct:
            return
        loader = trainer.train_dataloader
        settings = ", ".join(
            f"{name}={getattr(loader, attr, '?')}"
            for name, attr in (
                ("data.num_workers", "num_workers"),
                ("data.pin_memory", "pin_memory"),
                ("data.batch_size", "batch_size"),
            )
        )
        gpus = "no GPU reading" if busy is None else f"the GPUs were {busy:.0f}% busy"
        log.warning(
            "loop: epoch %d waited for the next batch %.0f%% of its training time (%.1f s) and "
            "%s: the input pipeline holds training back. What helps: more loader processes "
            "(data.num_workers), pinned memory (data.pin_memory), a larger batch "
            "(data.batch_size); now %s",
            trainer.current_epoch,
            100 * share,
            waited,
            gpus,
            settings,
        )

    # ------------------------------------------------------------------ energy over the run
    def _add_energy(self, everyone: Sequence[dict[str, Any]]) -> None:
        """This fit's energy per physical GPU so far, each GPU once (the first slice reporting
        it names it), from every rank's cumulative counters."""
        seen: set[str] = set()
        for payload in everyone:
            boards = payload.get("boards", {})
            for label, joules in payload.get("energy_total_j", {}).items():
                board = boards.get(label, f"{payload['node']}/{label}")
                if board not in seen:
                    seen.add(board)
                    self._fit_energy_j[f"node{payload['node']}/{label}"] = joules

    def run_energy_j(self) -> dict[str, float]:
        """Energy per physical GPU over the whole run (earlier runs it resumed included), J."""
        keys = sorted(set(self._restored_energy_j) | set(self._fit_energy_j))
        return {
            k: self._restored_energy_j.get(k, 0.0) + self._fit_energy_j.get(k, 0.0) for k in keys
        }

    def run_samples(self) -> float | None:
        """Training samples over the whole run (resumed runs included); None when unknown."""
        parts = (self._restored_samples, self._fit_samples, self._epoch_samples)
        return None if None in parts else sum(parts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "energy_j": self.run_energy_j(),
            "train_samples": self.run_samples(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the run's energy from a checkpoint; a damaged entry is ignored (one line)."""
        energy = state_dict.get("energy_j") if isinstance(state_dict, Mapping) else None
        samples = state_dict.get("train_samples") if isinstance(state_dict, Mapping) else None
        good_energy = isinstance(energy, Mapping) and all(
            isinstance(k, str) and _finite(v) and v >= 0 for k, v in energy.items()
        )
        good_samples = samples is None or (_finite(samples) and samples >= 0)
        if not (good_energy and good_samples):
            log.warning(
                "gpu_stats: the checkpoint's GPU statistics state is not what this callback "
                "writes (%.80r); the run's energy counts from this resume on",
                state_dict,
            )
            return
        self._restored_energy_j = {k: float(v) for k, v in energy.items()}
        self._restored_samples = None if samples is None else float(samples)

    # ------------------------------------------------------------------ end of run
    def run_summary(self) -> list[dict[str, Any]]:
        """One row per GPU over the whole ``fit`` (training epochs): what the table shows."""
        return self._summary.rows(self._identities)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.summary_table and trainer.is_global_zero and self._summary:
            report.print_table(self.run_summary())
