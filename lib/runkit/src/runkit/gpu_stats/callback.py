"""GPU statistics per epoch from NVML: what the GPUs of *this run* did, not a snapshot.

Why not Lightning's ``DeviceStatsMonitor``: it reads ``torch.cuda.memory_stats`` on the training
thread at every step and knows nothing of utilisation, power or throttling. Here a daemon thread
samples NVML every ``interval_s`` (:mod:`.sampler`); the training thread makes no NVML call and
never waits for a reading. Each training epoch and validation is a phase; once its figures are
in, rank 0 logs the mean/max/min of each GPU (``gpu/node{N}/cuda{i}/...``, ``gpu_val/`` for
validation) in one ``logger.log_metrics`` call, at the step of Lightning's own rows. Each torch
device is matched to its NVML device by UUID (``CUDA_VISIBLE_DEVICES``, MIG). Under DDP each
rank hands its figures to rank 0 through the job's key-value store, not a collective. Keys a GPU
cannot report are left out, never logged as 0; a missing driver or a lost GPU costs one log
line. The run's energy is kept in the checkpoint. Reference: lib/runkit/docs/gpu-statistics.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch

from runkit import compat
from runkit.gpu_stats import report
from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.loop import LoopTimer
from runkit.gpu_stats.sampler import (
    DEFAULT_GROUPS,
    OPTIONAL_GROUPS,
    GpuReader,
    GpuSampler,
    Phase,
    TorchPeakMemory,
)
from runkit.gpu_stats.statistics import flatten_epoch, flatten_loop
from runkit.gpus import nvml

log = logging.getLogger(__name__)

MIN_WAIT_WARNING_S = 1.0
"""An epoch waiting for data less than this in all gets no warning, whatever the share: a short
epoch's first batch (loader start-up) would otherwise raise it for nothing."""
STATE_VERSION = 1
EXTRAS = (*OPTIONAL_GROUPS, "sample_ms")
"""What ``extras`` may name: metrics often unsupported, and the sampler's own NVML time."""


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


@dataclasses.dataclass
class _Record:
    """A training epoch or validation of this rank whose figures rank 0 has not had yet."""

    payload: dict[str, Any]  # root, step, epoch, node, boards and (training) loop
    phase: Phase | None
    peaks: dict[str, dict[str, float]]


def _within(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def _strings(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(item, str) for item in value)
    )


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


class GpuStatsMonitor(pl.Callback):
    """Log per-epoch GPU statistics from NVML for every GPU of the run (see the module docstring).

    Args:
        interval_s: seconds between samples.
        report_validation: also log the validation runs, under ``gpu_val/``.
        extras: also log these (often unsupported): ``fan``, ``pcie``, ``ecc``,
            ``memory_temperature``, ``sample_ms`` (the NVML time of a sample of each GPU).
        gpm: read GPM metrics (SM activity, occupancy, tensor cores, DRAM) where supported.
        per_gpu_keys_up_to: per-GPU keys for nodes with at most this many GPUs; only the
            ``gpu/all/`` aggregates beyond.
        data_wait_warning: warn when an epoch's loop waited more than this share of its time for
            data while the GPUs were mostly idle (1.0: never) ...
        gpu_idle_below_pct: ... that is, their mean utilisation was below this.
        summary_table: print a Rich table of every GPU at the end of ``fit`` (rank 0).
        device_uuids: the NVML UUID of each entry of ``trainer.strategy.parallel_devices``, for
            runs whose devices are not CUDA devices (the fake NVML on a CPU). Leave ``None`` on
            real GPUs: the UUIDs then come from CUDA.
    """

    gather_timeout_s = 30.0
    """How long rank 0 waits for the other ranks' figures before it goes on without them."""

    def __init__(
        self,
        interval_s: float = 1.0,
        report_validation: bool = True,
        extras: Sequence[str] = (),
        gpm: bool = True,
        per_gpu_keys_up_to: int = 8,
        data_wait_warning: float = 0.3,
        gpu_idle_below_pct: float = 50.0,
        summary_table: bool = True,
        device_uuids: Sequence[str] | None = None,
    ) -> None:
        for name, value, ok, accepted in (
            ("interval_s", interval_s, _within(interval_s, 0, math.inf) and interval_s > 0,
             "seconds > 0"),
            ("extras", extras, _strings(extras) and set(extras) <= set(EXTRAS),
             f"a list of some of {', '.join(EXTRAS)}"),
            ("per_gpu_keys_up_to", per_gpu_keys_up_to, isinstance(per_gpu_keys_up_to, int)
             and _within(per_gpu_keys_up_to, 0, math.inf), "a GPU count >= 0"),
            ("data_wait_warning", data_wait_warning, _within(data_wait_warning, 0, 1),
             "a number in [0, 1]"),
            ("gpu_idle_below_pct", gpu_idle_below_pct, _within(gpu_idle_below_pct, 0, 100),
             "a number in [0, 100]"),
            ("device_uuids", device_uuids, device_uuids is None or _strings(device_uuids),
             "a list of NVML UUID strings"),
        ):  # fmt: skip
            if not ok:
                raise ValueError(f"GpuStatsMonitor: {name}={value!r}; give {accepted}")
        self.interval_s = float(interval_s)
        self.report_validation = report_validation
        self.groups = [*DEFAULT_GROUPS, *(g for g in OPTIONAL_GROUPS if g in extras)]
        if not gpm:
            self.groups.remove("gpm")
        self.log_sampler_cost = "sample_ms" in extras
        self.per_gpu_keys_up_to = per_gpu_keys_up_to
        self.data_wait_warning = float(data_wait_warning)
        self.gpu_idle_below_pct = float(gpu_idle_below_pct)
        self.summary_table = summary_table
        self.device_uuids = None if device_uuids is None else list(device_uuids)
        self._reset_state()
        compat.skip_unused_batch_hooks(self)

    def _reset_state(self) -> None:
        self._stack = ExitStack()
        self._sampler: GpuSampler | None = None
        self._peaks: TorchPeakMemory | None = None
        self._exchanges = {
            hook: RankExchange(hook, self.gather_timeout_s)
            for hook in ("setup", "validation end", "training epoch end", "training end")
        }
        self._identities: list[dict[str, Any]] = []
        self._summary = report.RunSummary()
        self._train: Phase | None = None  # the training epoch under way
        self._val: Phase | None = None
        self._records: list[_Record] = []  # this rank's, not sent yet
        self._sent = 0  # records sent by this rank (numbered alike on every rank)
        self._arrived: dict[int, dict[int, dict[str, Any]]] = {}  # rank 0: number -> rank -> it
        self._loop = LoopTimer()
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
        if trainer.is_global_zero:
            self._report_setup(everyone)
        if self._sampler is not None:
            self._sampler.start()

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
        try:
            lib = self._stack.enter_context(nvml.nvml_session())
        except nvml.NvmlUnavailable as err:
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
        if readers:
            self._sampler = GpuSampler(readers, self.interval_s)
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
    def _begin(self, phase: Phase | None) -> Phase | None:
        """Later readings count for ``phase``; the sampler's thread begins one now for a new one."""
        if self._sampler is not None:
            self._sampler.begin(phase)
        return phase

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop.start_epoch()
        self._train = self._begin(Phase())
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.clear())

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
        self._loop.batch_end(batch)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._loop.pause()  # until the next training batch: validation is not a data wait
        self._val = self._begin(Phase())
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.stash())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        phase, self._val = self._val, self._begin(self._train)
        peaks = self._peaks_now(False)
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.restart())
        if self.report_validation:
            self._record(trainer, "gpu_val", compat.logging_step(trainer), phase, peaks)
        everyone = self._exchange(trainer, "validation end")
        self._epoch_samples = count_samples([p.get("loop") for p in everyone])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        peaks = self._peaks_now(True)
        phase, self._train = self._train, self._begin(None)
        step = compat.logging_step(trainer) - 1  # Lightning's rows of the epoch: its last batch
        self._record(trainer, "gpu", step, phase, peaks, loop=self._loop.summary())
        everyone = self._exchange(trainer, "training epoch end")
        epoch_samples = count_samples([p.get("loop") for p in everyone])
        fit = self._fit_samples
        self._fit_samples = None if None in (fit, epoch_samples) else fit + epoch_samples
        self._epoch_samples = 0.0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The phases whose figures were not in yet: waited for, and published."""
        self._exchange(trainer, "training end", final=True)

    def _peaks_now(self, include_carry: bool) -> dict[str, dict[str, float]]:
        peaks = self._peaks
        if peaks is None:
            return {}
        return self._guarded("peaks", lambda: peaks.peaks(include_carry)) or {}

    # ------------------------------------------------------------------ figures to rank 0
    def _record(
        self,
        trainer: pl.Trainer,
        root: str,
        step: int,
        phase: Phase | None,
        peaks: Any,
        **more: Any,
    ) -> None:
        """Keep a phase's figures for rank 0, to be sent once the sampler has them."""
        sampler = self._sampler
        payload = {
            "root": root,
            "step": step,
            "epoch": trainer.current_epoch,
            "node": trainer.node_rank,
            "boards": {r.label: r.board_uuid for r in sampler.readers} if sampler else {},
            **more,
        }
        self._records.append(_Record(payload, phase, peaks))

    def _ready(self, wait: bool) -> list[tuple[int, dict[str, Any]]]:
        """This rank's records whose figures are in (``wait``: all), in order, numbered."""
        ready = []
        for record in self._records:
            sampler, phase = self._sampler, record.phase
            if not (phase is None or sampler is None or sampler.settled(phase, wait)):
                break
            gpus = {} if phase is None else phase.figures()
            for label, values in record.peaks.items():
                gpus.get(label, {}).update(values)
            self._sent += 1
            ready.append((self._sent, {**record.payload, "gpus": gpus}))
        del self._records[: len(ready)]
        return ready

    def _exchange(
        self, trainer: pl.Trainer, hook: str, final: bool = False
    ) -> list[dict[str, Any]]:
        """Every rank: its energy, its loop so far and its ready records to rank 0 (to every rank
        when a monitor watches a key of ours, after waiting for them); rank 0 publishes."""
        watched = self._watched(trainer)
        local: dict[str, Any] = {"node": trainer.node_rank, "rank": trainer.global_rank}
        local.update(loop=self._loop.summary(), records=self._ready(wait=watched or final))
        if self._sampler is not None:
            local["boards"] = {r.label: r.board_uuid for r in self._sampler.readers}
            local["energy_total_j"] = self._sampler.energy_totals_j()
        everyone = self._exchanges[hook].gather(trainer, local, watched)
        self._add_energy(everyone)
        if not (trainer.is_global_zero or watched):
            return everyone
        for payload in everyone:
            for number, figures in payload["records"]:
                self._arrived.setdefault(number, {})[payload["rank"]] = figures
        present = {payload["rank"] for payload in everyone}
        for number in sorted(self._arrived):
            if not (final or present <= self._arrived[number].keys()):
                break
            ranks = self._arrived.pop(number)
            self._publish(trainer, [ranks[rank] for rank in sorted(ranks)])
        return everyone

    def _watched(self, trainer: pl.Trainer) -> bool:
        """Whether a monitor watches one of this callback's keys: then every rank needs the
        run's figures at each hook, not only rank 0, and waits for them."""
        return any(k.startswith(("gpu/", "gpu_val/", "loop/")) for k in monitored_keys(trainer))

    def _publish(self, trainer: pl.Trainer, payloads: list[dict[str, Any]]) -> None:
        """One phase of every rank: to every logger in one call (rank 0) at the phase's step, and
        the monitored keys to ``trainer.callback_metrics`` (every rank that has them)."""
        first = payloads[0]
        flat = flatten_epoch(
            payloads, first["root"], self.log_sampler_cost, self.per_gpu_keys_up_to
        )
        if first["root"] == "gpu":  # a training epoch
            flat.update(flatten_loop([p.get("loop") for p in payloads]))
            self._summary.add_epoch(payloads)
            if trainer.is_global_zero:
                self._warn_if_starved(trainer, payloads, flat, first["epoch"])
        if not flat:
            return
        wanted = monitored_keys(trainer) & flat.keys()
        # private: writes into the dict Lightning returns as trainer.callback_metrics (its
        # logger connector's own), which is what monitors read; self.log would cost a result
        # entry and an all-reduce per key for values every rank already holds.
        trainer.callback_metrics.update({k: torch.tensor(float(flat[k])) for k in wanted})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({**flat, "epoch": first["epoch"]}, step=first["step"])

    # ------------------------------------------------------------------ data starvation
    def _warn_if_starved(
        self,
        trainer: pl.Trainer,
        everyone: Sequence[dict[str, Any]],
        flat: dict[str, float],
        epoch: int,
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
            epoch,
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
