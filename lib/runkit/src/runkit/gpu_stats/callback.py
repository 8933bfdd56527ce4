"""GPU statistics per epoch from NVML: what the GPUs of *this run* did, not a snapshot.

Lightning's ``DeviceStatsMonitor`` reads ``torch.cuda.memory_stats`` on the training thread at every
step and knows nothing of utilisation, power or throttling. Design and keys:
lib/runkit/docs/gpu-statistics.md."""

from __future__ import annotations

import logging
import math
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.sampler import GROUPS, GpuReader, GpuSampler
from runkit.gpu_stats.statistics import RunSummary, flatten_epoch, flatten_loop, print_table
from runkit.gpus import nvml

log = logging.getLogger(__name__)

MIN_WAIT_WARNING_S = 1.0  # less waiting in all: no starvation line (the loader's start alone)


def process_devices(trainer: Any) -> list[tuple[int, torch.device]]:
    """This process's devices with their positions in ``parallel_devices``."""
    strategy = trainer.strategy
    devices = list(getattr(strategy, "parallel_devices", None) or [strategy.root_device])
    if len(devices) > 1 and trainer.world_size == trainer.num_nodes:
        return list(enumerate(devices))
    position = trainer.local_rank if trainer.local_rank < len(devices) else 0
    return [(position, torch.device(strategy.root_device))]


def monitored_keys(trainer: Any) -> set[str]:
    watchers = [*getattr(trainer, "callbacks", []), *getattr(trainer, "lr_scheduler_configs", [])]
    return {m for w in watchers if isinstance(m := getattr(w, "monitor", None), str)}


def batch_length(batch: Any) -> int | None:
    """The samples in ``batch`` as Lightning counts them for ``self.log``; None without a tensor."""
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if type(first) is torch.Tensor and first.ndim:
        return first.shape[0]
    try:
        return extract_batch_size(batch)
    except MisconfigurationException:
        return None


class LoopTimer:
    """One training epoch's loop time, data wait (one batch's end to the next one's start,
    validation left out), steps and samples: two clock reads a step, no device sync."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self._said_uncountable = False
        self.start_epoch()

    def start_epoch(self) -> None:
        self._epoch_start = self._last_end = self.clock()
        self._paused_at: float | None = None
        self.wait_s = self.paused_s = 0.0  # paused: validation between epoch start and last step
        self.steps = 0
        self.samples: int | None = 0

    def batch_start(self) -> None:
        now = self.clock()
        if self._paused_at is not None:  # after validation: the whole gap since it started is out
            gap, self._paused_at = now - self._paused_at, None
            self.paused_s += gap
            self._last_end += gap
        self.wait_s += now - self._last_end

    def batch_end(self, batch: Any) -> None:
        self._last_end = self.clock()
        self.steps += 1
        if self.samples is not None and (size := batch_length(batch)) is not None:
            self.samples += size
        elif self.samples is not None:
            self.samples = None
            if not self._said_uncountable:
                self._said_uncountable = True
                log.info("loop: a training batch of type %s holds no tensor to count samples "
                         "in; loop/samples_per_s is not logged (loop/data_wait_frac is)",
                         type(batch).__name__)  # fmt: skip

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = self.clock()

    def summary(self) -> dict[str, float] | None:
        """``loop_s``, ``data_wait_s``, ``steps`` and ``samples`` (when countable); None before a step."""
        if not self.steps:
            return None
        loop_s = self._last_end - self._epoch_start - self.paused_s
        out = {"loop_s": loop_s, "data_wait_s": self.wait_s, "steps": float(self.steps)}
        return out if self.samples is None else {**out, "samples": float(self.samples)}


def _check_arguments(a: dict[str, Any]) -> None:
    def number(v: Any, high: float = math.inf) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= high

    uuids, prefix, up_to = a["device_uuids"], a["key_prefix"], a["per_gpu_keys_up_to"]
    checks = {
        "interval_s": (number(a["interval_s"]) and a["interval_s"] > 0, "seconds > 0"),
        "gather_timeout_s": (number(a["gather_timeout_s"]) and a["gather_timeout_s"] > 0, "seconds > 0"),
        "data_wait_warning": (number(a["data_wait_warning"], 1), "a number in [0, 1]"),
        "gpu_idle_below_pct": (number(a["gpu_idle_below_pct"], 100), "a number in [0, 100]"),
        "device_uuids": (uuids is None or (not isinstance(uuids, str) and all(isinstance(u, str) for u in uuids)),
                         "a list of NVML UUID strings"),
        "key_prefix": (bool(prefix) and "/" not in prefix, "a word without '/'"),
        "per_gpu_keys_up_to": (type(up_to) is int and up_to >= 0, "a GPU count >= 0"),
    }  # fmt: skip
    for name, (ok, accepted) in checks.items():
        if not ok:
            raise ValueError(f"GpuStatsMonitor: {name}={a[name]!r}; give {accepted}")


def energy_report(trainer: Any) -> dict[str, Any] | None:
    """The run's energy for ``metrics.json`` (None without a :class:`GpuStatsMonitor` reading)."""
    monitor = next((c for c in trainer.callbacks if isinstance(c, GpuStatsMonitor)), None)
    if monitor is None or not (per_gpu := monitor.run_energy_j()):
        return None
    total, samples = sum(per_gpu.values()), monitor.run_samples()
    return {
        "energy_j": round(total, 3),
        "energy_kwh": total / 3.6e6,
        "energy_j_per_training_sample": total / samples if samples else None,
        "training_samples": None if samples is None else int(samples),
        "energy_j_per_gpu": {k: round(v, 3) for k, v in per_gpu.items()},
    }


class GpuStatsMonitor(pl.Callback):
    """Log per-epoch GPU statistics from NVML for every GPU of the run (see the module docstring).

    ``interval_s``: seconds between samples; ``report_validation``: log validation runs too (under
    ``{key_prefix}_val/``); ``fan``, ``pcie``, ``ecc``, ``memory_temperature`` (off: often
    unsupported), ``gpm``: metric groups; ``log_sampler_cost``: log ``sample_ms``, NVML's time per
    sample; ``summary_table``: a Rich table of every GPU at the end of ``fit``; ``device_uuids``:
    the NVML UUID of each of ``trainer.strategy.parallel_devices``, for CPU runs on the fake NVML
    (None: CUDA's); ``per_gpu_keys_up_to``: per-GPU keys for nodes with at most this many GPUs,
    else the ``gpu/all/`` aggregates only; ``data_wait_warning``, ``gpu_idle_below_pct``: warn when
    an epoch waited more than this share of its loop for data while the GPUs were busy less than
    this; ``gather_timeout_s``: how long rank 0 waits at an epoch end for the others' figures.
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
    ) -> None:
        _check_arguments(locals())
        self.interval_s, self.gather_timeout_s = float(interval_s), float(gather_timeout_s)
        self.report_validation, self.summary_table = report_validation, summary_table
        wanted = dict(fan=fan, pcie=pcie, ecc=ecc, memory_temperature=memory_temperature, gpm=gpm)
        self.groups = [g for g in GROUPS if wanted.get(g, True)]
        self.per_gpu_keys_up_to, self.log_sampler_cost = per_gpu_keys_up_to, log_sampler_cost
        self.data_wait_warning = float(data_wait_warning)
        self.gpu_idle_below_pct = float(gpu_idle_below_pct)
        self.device_uuids = None if device_uuids is None else list(device_uuids)
        self.key_prefix = key_prefix
        self._reset_state()

    def _reset_state(self) -> None:
        self._stack = ExitStack()
        self._sampler: GpuSampler | None = None
        self._exchanges = {
            hook: RankExchange(hook, self.gather_timeout_s)
            for hook in ("setup", "validation end", "training epoch end")
        }
        self.identities: list[dict[str, Any]] = []  # every rank's setup report
        self._summary = RunSummary()
        self._loop = LoopTimer()
        self._energy_j: dict[str, float] = {}  # this fit, per physical GPU
        self._restored_energy_j: dict[str, float] = {}  # from the checkpoint a resume starts at
        self._samples: float | None = 0.0  # training samples, every rank: restored and past epochs
        self._epoch_samples: float | None = 0.0  # of the epoch under way, at its validation

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Every rank logs the same monitored values: Lightning's advice to sync them is wrong here.
        keys = rf"(?:{re.escape(self.key_prefix)}(?:_val)?|loop)/"
        warnings.filterwarnings("ignore", rf"It is recommended to use `self.log\('{keys}")
        self._close()
        self._reset_state()
        try:
            local = self._open(trainer)
        except ValueError as err:  # a configuration error: raised below, on every rank at once
            local = {"config_error": str(err)}
        except Exception as err:  # never let statistics break a run
            local = {"status": f"failed to start ({type(err).__name__}: {err})", "gpus": []}
        if local.get("status") != "on":
            self._close()
        local.update(node=trainer.node_rank, rank=trainer.global_rank)
        everyone = self._gather(trainer, "setup", local)
        if errors := [p["config_error"] for p in everyone if p.get("config_error")]:
            self._close()
            raise ValueError(errors[0])
        self.identities = everyone
        if trainer.is_global_zero:
            self._report_setup(everyone)
        if self._sampler is not None:
            self._sampler.start()

    def _open(self, trainer: pl.Trainer) -> dict[str, Any]:
        wanted: list[tuple[str, torch.device, str | None]] = []
        for position, device in process_devices(trainer):
            if self.device_uuids is not None:
                if position >= len(self.device_uuids):
                    raise ValueError(
                        f"GpuStatsMonitor: device_uuids has {len(self.device_uuids)} entries but "
                        f"this process drives parallel_devices[{position}]; give one UUID a device"
                    )
                wanted.append((f"cuda{position}", device, self.device_uuids[position]))
            elif device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
                wanted.append((f"cuda{index}", device, None if uuid is None else str(uuid)))
        if not wanted:
            return {"status": "off: this run uses no CUDA device", "gpus": [], "quiet": True}
        try:
            lib = self._stack.enter_context(nvml.nvml_session())
        except nvml.NvmlUnavailable as err:
            return {"status": f"off: {err}", "gpus": []}
        readers, problems = [], []
        for label, _device, uuid in wanted:
            try:
                if (found := nvml.find_handle(lib, uuid) if uuid else None) is None:
                    problems.append(f"{label}: no NVML device with UUID {uuid!r}")
                else:
                    readers.append(GpuReader(lib, found[0], label, self.groups))
            except Exception as err:
                problems.append(f"{label}: {type(err).__name__}: {err}")
        if not readers:
            return {"status": "off: no usable GPU", "gpus": [], "problems": problems}
        devices = {label: device for label, device, _ in wanted}
        self._sampler = GpuSampler(readers, self.interval_s, devices)  # stops before NVML closes
        return {"status": "on", "gpus": [r.identity() for r in readers], "problems": problems}

    def _report_setup(self, everyone: Sequence[dict[str, Any]]) -> None:
        idle: dict[tuple[str, bool], list[str]] = {}  # one line for all ranks in the same state
        for p in everyone:
            for problem in p.get("problems", []):
                log.warning("gpu_stats: rank %s (node %s): %s", p["rank"], p["node"], problem)
            if not p["gpus"]:
                idle.setdefault((p["status"], bool(p.get("quiet"))), []).append(str(p["rank"]))
            for gpu in p["gpus"]:
                log.info(
                    "gpu_stats: node%s/%s = %s, %s, NVML index %s, PCI %s%s; not supported: %s",
                    *(p["node"], gpu["label"], gpu["name"], gpu["uuid"], gpu["nvml_index"]),
                    gpu["pci_bus_id"], " (MIG slice)" if gpu["mig"] else "",
                    ", ".join(gpu["unsupported"]) or "none",
                )  # fmt: skip
        for (status, quiet), ranks in idle.items():
            log.log(logging.INFO if quiet else logging.WARNING,
                    "gpu_stats: rank %s: %s; training continues without GPU statistics",
                    ",".join(ranks), status)  # fmt: skip

    def _close(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()
        self._stack.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._close()  # Lightning does not call ``teardown`` on this path

    def _switch(self, what: str, phase: str | None, reset: bool = True) -> None:
        if self._sampler is not None:
            try:
                self._sampler.set_phase(phase, reset)
            except Exception as err:
                self._failed(what, err)

    def _failed(self, what: str, err: Exception) -> None:
        log.warning("gpu_stats: %s failed (%s: %s); sampling stops", what, type(err).__name__, err)
        self._close()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop.start_epoch()
        self._switch("epoch start", "train")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._loop.batch_start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._loop.batch_end(batch)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._loop.pause()  # until the next training batch: validation is not a data wait
            self._switch("validation start", "val")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        local = self._local(trainer, "val" if self.report_validation else None)
        # Validation runs inside the training epoch (Lightning calls on_train_epoch_end after it).
        self._switch("validation end", "train", reset=False)
        # Every rank, every validation: the run's energy is current when a checkpoint is saved.
        everyone = self._gather(trainer, "validation end", local)
        self._add_energy(everyone)
        self._epoch_samples = _count_samples([p.get("loop") for p in everyone])
        if self.report_validation:
            self._publish(trainer, pl_module, self._flatten(everyone, f"{self.key_prefix}_val"))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = self._local(trainer, "train")
        self._switch("epoch end", None)
        everyone = self._gather(trainer, "training epoch end", local)
        loops = [p.get("loop") for p in everyone]
        flat = {**self._flatten(everyone, self.key_prefix), **flatten_loop(loops)}
        self._publish(trainer, pl_module, flat)
        self._add_energy(everyone)
        epoch, fit = _count_samples(loops), self._samples
        self._samples = None if epoch is None or fit is None else fit + epoch
        self._epoch_samples = 0.0
        self._summary.add_epoch(everyone)
        if trainer.is_global_zero:
            self._warn_if_starved(trainer, everyone, flat)

    def _local(self, trainer: pl.Trainer, phase: str | None) -> dict[str, Any]:
        local = {"node": trainer.node_rank, "rank": trainer.global_rank}
        local["loop"] = self._loop.summary()
        if self._sampler is None:
            return local
        local["boards"] = {r.label: r.board_uuid for r in self._sampler.readers}
        try:
            gpus, local["energy_total_j"] = self._sampler.report(phase)
        except Exception as err:
            self._failed("summary", err)
            gpus, local["energy_total_j"] = {}, {}
        return {**local, "gpus": gpus} if phase else local

    def _gather(
        self, trainer: pl.Trainer, hook: str, local: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Every rank's ``local``; a monitor watching one of our keys needs them on every rank."""
        prefixes = (f"{self.key_prefix}/", f"{self.key_prefix}_val/", "loop/")
        watched = any(key.startswith(prefixes) for key in monitored_keys(trainer))
        return self._exchanges[hook].gather(trainer, local, watched)

    def _flatten(self, everyone: Sequence[dict[str, Any]], root: str) -> dict[str, float]:
        return flatten_epoch(everyone, root, self.log_sampler_cost, self.per_gpu_keys_up_to)

    def _publish(self, trainer: pl.Trainer, pl_module: Any, metrics: dict[str, float]) -> None:
        for key in sorted(monitored_keys(trainer) & metrics.keys()):
            pl_module.log(key, float(metrics[key]), logger=False, batch_size=1)
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {**metrics, "epoch": trainer.current_epoch},
                    step=max(trainer.global_step - 1, 0),
                )

    def _warn_if_starved(
        self, trainer: pl.Trainer, everyone: Sequence[dict[str, Any]], flat: dict[str, float]
    ) -> None:
        share = flat.get("loop/data_wait_frac")
        waited = max((p["loop"]["data_wait_s"] for p in everyone if p.get("loop")), default=0.0)
        if share is None or share <= self.data_wait_warning or waited < MIN_WAIT_WARNING_S:
            return
        utils = [s.get("util_mean", s.get("sm_active_mean")) for p in everyone for s in p.get("gpus", {}).values()]  # fmt: skip
        known = [u for u in utils if u is not None]  # SM activity where a MIG slice has no util
        busy = sum(known) / len(known) if known else None
        if busy is not None and busy >= self.gpu_idle_below_pct:
            return
        loader = trainer.train_dataloader
        settings = ", ".join(
            f"data.{name}={getattr(loader, name, '?')}"
            for name in ("num_workers", "pin_memory", "batch_size")
        )
        log.warning(
            "loop: epoch %d waited for the next batch %.0f%% of its training time (%.1f s) and "
            "%s: the input pipeline holds training back. What helps: more loader processes "
            "(data.num_workers), pinned memory (data.pin_memory), a larger batch "
            "(data.batch_size); now %s",
            *(trainer.current_epoch, 100 * share, waited),
            "no GPU reading" if busy is None else f"the GPUs were {busy:.0f}% busy",
            settings,
        )

    def _add_energy(self, everyone: Sequence[dict[str, Any]]) -> None:
        """This fit's energy per physical GPU so far, each counted once."""
        seen: set[str] = set()
        for p in everyone:
            for label, joules in p.get("energy_total_j", {}).items():
                board = p.get("boards", {}).get(label, f"{p['node']}/{label}")
                if board not in seen:
                    seen.add(board)
                    self._energy_j[f"node{p['node']}/{label}"] = joules

    def run_energy_j(self) -> dict[str, float]:
        restored, fit = self._restored_energy_j, self._energy_j
        return {k: restored.get(k, 0.0) + fit.get(k, 0.0) for k in sorted({*restored, *fit})}

    def run_samples(self) -> float | None:
        fit, epoch = self._samples, self._epoch_samples
        return None if fit is None or epoch is None else fit + epoch

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "energy_j": self.run_energy_j(), "train_samples": self.run_samples()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict if isinstance(state_dict, Mapping) else {}
        energy, samples = state.get("energy_j"), state.get("train_samples")

        def good(v: Any) -> bool:
            return type(v) in (int, float) and math.isfinite(v) and v >= 0

        if not (
            isinstance(energy, Mapping)
            and all(isinstance(k, str) and good(v) for k, v in energy.items())
            and (samples is None or good(samples))
        ):
            log.warning(
                "gpu_stats: the checkpoint's GPU statistics state is not what this callback "
                "writes (%.80r); the run's energy counts from this resume on",
                state_dict,
            )
            return
        self._restored_energy_j = {k: float(v) for k, v in energy.items()}
        self._samples = None if samples is None else float(samples)

    def run_summary(self) -> list[dict[str, Any]]:
        return self._summary.rows(self.identities)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.summary_table and trainer.is_global_zero and self._summary.epochs:
            print_table(self.run_summary())


def _count_samples(loops: Sequence[dict[str, float] | None]) -> float | None:
    if any(loop is not None and "samples" not in loop for loop in loops):
        return None
    return sum(loop["samples"] for loop in loops if loop)
