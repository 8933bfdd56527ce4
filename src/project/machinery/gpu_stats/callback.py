"""GPU statistics per epoch from NVML: what the GPUs of *this run* did, not a snapshot.

Why not Lightning's ``DeviceStatsMonitor``: it reads ``torch.cuda.memory_stats`` on the training
thread at every step and knows nothing of utilisation, power or throttling. This callback samples
NVML in a background thread (default every second), keeps running statistics per GPU and logs,
once per epoch, the mean/max/min over the epoch. The training thread makes no NVML call per step;
it only takes one boundary sample at epoch start/end and when validation starts/ends, so that the
training and validation figures (and the energy counter) are split exactly.

Which GPU: every torch device this process trains on is mapped to its NVML device by UUID
(``torch.cuda.get_device_properties(i).uuid`` → ``nvmlDeviceGetHandleByUUID("GPU-…"|"MIG-…")``),
so ``CUDA_VISIBLE_DEVICES=2,3``, ``GPU-…``/``MIG-…`` UUIDs and ``CUDA_DEVICE_ORDER`` all land on
the right physical GPU. Without a GPU (tests, demos with :mod:`project.machinery.testing.fake_nvml`), pass
``device_uuids``: entry *i* is the NVML UUID of ``trainer.strategy.parallel_devices[i]``.

Which process: under DDP every rank samples its own device and, at epoch end, all ranks gather
their figures (a collective called on every rank, whatever state its NVML is in); rank 0's logger
writes them. A process that drives several devices (one process per node) samples them all.

Logged keys (training epoch; validation uses ``gpu_val/`` instead of ``gpu/``)::

    gpu/node{N}/cuda{i}/util_mean       GPU busy %: mean, max, min over the epoch's samples
    gpu/node{N}/cuda{i}/mem_util_mean   memory-bandwidth busy %: mean, max
    gpu/node{N}/cuda{i}/mem_used_gib_*  device memory in use (all processes): mean, max
    gpu/node{N}/cuda{i}/mem_total_gib   device memory size
    gpu/node{N}/cuda{i}/proc_mem_gib_*  this process's memory on the GPU: mean, max
    gpu/node{N}/cuda{i}/torch_peak_alloc_gib, torch_peak_reserved_gib   PyTorch's peaks this epoch
    gpu/node{N}/cuda{i}/temp_c_*        temperature: mean, max
    gpu/node{N}/cuda{i}/power_w_*       power draw: mean, max; power_ratio_* = draw / power limit
    gpu/node{N}/cuda{i}/sm_clock_mhz_*  SM clock: mean, min
    gpu/node{N}/cuda{i}/throttle_*_frac share of samples with clocks held back: power, thermal,
                                        hw (slowdown) or any of them
    gpu/node{N}/cuda{i}/energy_j        energy used during the epoch (total-energy counter)
    gpu/node{N}/cuda{i}/samples         number of samples behind the figures
    optional: fan_pct_*, pcie_{tx,rx}_mbs_*, ecc_uncorrected, mem_temp_c_*, sample_ms (NVML time
    per sample: the sampler's own cost)
    gpu/all/{key}_{min,mean,max}        across every GPU of the run, for the headline keys in
                                        AGGREGATED (plus gpu/all/energy_j_sum), so a straggler shows

``N`` is ``trainer.node_rank``; ``i`` is the CUDA index in the process (or the position in
``parallel_devices`` when ``device_uuids`` stands in for CUDA). A metric a GPU does not support
(fan on datacenter cards, utilisation on MIG slices, ...) is probed once, listed once in the log
and left out: never logged as 0. On a MIG slice, temperature, power, clocks, throttling and
energy are those of the whole physical GPU (NVML reports them only there).

Identity (name, UUID, NVML index, PCI bus) is written once per GPU as an INFO log line on rank 0
(not as logger hyperparameters, which belong to the experiment config). At the end of ``fit``
rank 0 prints one Rich table summarising each GPU over the run.

Never breaks training: no NVML library, no driver or no GPU gives one log line and the callback
does nothing; a GPU lost or NVML failing mid-run gives one warning and that GPU stops being
sampled. Messages go through :mod:`logging`, never :mod:`warnings`, so ``python -W error`` runs.
NVML is opened with :func:`project.machinery.gpus.nvml.nvml_session` and closed on every path, exceptions
included (``teardown`` and ``on_exception``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from project.machinery.gpus import nvml

log = logging.getLogger(__name__)

GIB = 1024**3
TRAIN, VAL = "train", "val"

# Clock event ("throttle") reason bits, from nvml.h (nvmlClocksEventReason*).
_SW_POWER_CAP = 0x4
_HW_SLOWDOWN = 0x8
_SW_THERMAL = 0x20
_HW_THERMAL = 0x40
_HW_POWER_BRAKE = 0x80
THROTTLE_MASKS = {
    "throttle_power": _SW_POWER_CAP | _HW_POWER_BRAKE,
    "throttle_thermal": _SW_THERMAL | _HW_THERMAL,
    "throttle_hw": _HW_SLOWDOWN,
    "throttle_any": _SW_POWER_CAP | _HW_POWER_BRAKE | _SW_THERMAL | _HW_THERMAL | _HW_SLOWDOWN,
}

# metric -> statistics logged for it. "last": the key is the metric name; "frac": mean of 0/1.
METRIC_STATS: dict[str, tuple[str, ...]] = {
    "util": ("mean", "max", "min"),
    "mem_util": ("mean", "max"),
    "mem_used_gib": ("mean", "max"),
    "mem_total_gib": ("last",),
    "proc_mem_gib": ("mean", "max"),
    "temp_c": ("mean", "max"),
    "power_w": ("mean", "max"),
    "power_ratio": ("mean", "max"),
    "sm_clock_mhz": ("mean", "min"),
    "throttle_power": ("frac",),
    "throttle_thermal": ("frac",),
    "throttle_hw": ("frac",),
    "throttle_any": ("frac",),
    "fan_pct": ("mean", "max"),
    "pcie_tx_mbs": ("mean", "max"),
    "pcie_rx_mbs": ("mean", "max"),
    "ecc_uncorrected": ("last",),
    "mem_temp_c": ("mean", "max"),
}
# Per-GPU keys that also get min/mean/max across all GPUs of the run.
AGGREGATED = (
    "util_mean",
    "mem_util_mean",
    "mem_used_gib_max",
    "proc_mem_gib_max",
    "torch_peak_alloc_gib",
    "temp_c_max",
    "power_w_mean",
    "sm_clock_mhz_mean",
    "throttle_any_frac",
    "energy_j",
)
DEFAULT_GROUPS = (
    "utilization",
    "memory",
    "process_memory",
    "temperature",
    "power",
    "clock",
    "throttle",
    "energy",
)
OPTIONAL_GROUPS = ("fan", "pcie", "ecc", "memory_temperature")
# Groups NVML reports only for the physical GPU, not for a MIG slice.
BOARD_GROUPS = frozenset(
    {
        "temperature",
        "power",
        "clock",
        "throttle",
        "energy",
        "fan",
        "pcie",
        "ecc",
        "memory_temperature",
    }
)
_UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
_PROBE_SKIP_ERRORS = (*_UNSUPPORTED_ERRORS, "NVMLError_NoPermission", "NVMLError_NotFound")


def _error_classes(lib: Any, names: Iterable[str]) -> tuple[type[BaseException], ...]:
    return tuple(getattr(lib, n) for n in names if isinstance(getattr(lib, n, None), type))


# --------------------------------------------------------------------------- device mapping
def nvml_uuid_candidates(torch_uuid: str) -> list[str]:
    """NVML spellings of a CUDA device UUID: torch gives bare hex, NVML wants GPU- or MIG-."""
    uuid = str(torch_uuid).strip()
    if uuid.startswith(("GPU-", "MIG-")):
        return [uuid]
    return [f"GPU-{uuid}", f"MIG-{uuid}"]


def cuda_device_uuid(index: int) -> str | None:
    """The UUID CUDA reports for ``cuda:index`` (this already reflects CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def find_nvml_handle(lib: Any, uuid: str) -> tuple[Any, str] | None:
    """The NVML handle and NVML UUID for a device UUID (GPU or MIG), or ``None`` if unknown."""
    for candidate in nvml_uuid_candidates(uuid):
        try:
            return lib.nvmlDeviceGetHandleByUUID(candidate), candidate
        except lib.NVMLError:
            continue
    return None


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


# --------------------------------------------------------------------------- statistics
@dataclass
class RunningStat:
    """Count, sum, min, max and last value of a stream: O(1) memory however long the epoch."""

    count: int = 0
    total: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")
    last: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        self.last = value

    def get(self, stat: str) -> float:
        if stat in ("mean", "frac"):
            return self.total / self.count
        return {"max": self.high, "min": self.low, "last": self.last}[stat]


@dataclass
class GpuAccumulator:
    """What one GPU did during one phase (a training epoch or a validation run)."""

    stats: dict[str, RunningStat] = field(default_factory=dict)
    energy_mj: float | None = None
    samples: int = 0
    sample_seconds: float = 0.0

    def add(self, values: dict[str, float], seconds: float) -> None:
        self.samples += 1
        self.sample_seconds += seconds
        for metric, value in values.items():
            self.stats.setdefault(metric, RunningStat()).add(value)

    def add_energy(self, delta_mj: float) -> None:
        self.energy_mj = (self.energy_mj or 0.0) + delta_mj

    def summary(self) -> dict[str, float]:
        """Flat ``{key: value}`` of the phase, keys as in the module docstring (without prefix)."""
        out: dict[str, float] = {}
        for metric, stat in self.stats.items():
            for which in METRIC_STATS.get(metric, ("mean",)):
                key = metric if which == "last" else f"{metric}_{which}"
                out[key] = stat.get(which)
        if self.energy_mj is not None:
            out["energy_j"] = self.energy_mj / 1000.0
        if self.samples:
            out["samples"] = float(self.samples)
            out["sample_ms"] = 1000.0 * self.sample_seconds / self.samples
        return out


# --------------------------------------------------------------------------- one GPU
class GpuReader:
    """Reads one NVML device: probes once which metric groups it supports, then reads those."""

    def __init__(self, lib: Any, handle: Any, label: str, groups: Sequence[str]) -> None:
        self.lib = lib
        self.handle = handle
        self.label = label
        self.groups = list(groups)
        self.unsupported: dict[str, str] = {}
        self.dead: str | None = None
        self.power_limit_mw: float | None = None
        self.pid = os.getpid()
        self._unsupported_errors = _error_classes(lib, _UNSUPPORTED_ERRORS)
        self._probe_skip_errors = _error_classes(lib, _PROBE_SKIP_ERRORS)
        self.is_mig = bool(self._try(lambda: lib.nvmlDeviceIsMigDeviceHandle(handle), False))
        self.board = handle
        if self.is_mig:
            self.board = lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        self.name = nvml.as_text(lib.nvmlDeviceGetName(handle))
        self.uuid = nvml.as_text(lib.nvmlDeviceGetUUID(handle))
        self.nvml_index = self._try(lambda: lib.nvmlDeviceGetIndex(self.board), None)
        pci = self._try(lambda: lib.nvmlDeviceGetPciInfo(self.board), None)
        self.pci_bus_id = nvml.as_text(pci.busId) if pci is not None else None
        self._throttle_fn: Callable[[Any], int] | None = None

    def _try(self, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except (self.lib.NVMLError, AttributeError):
            return default

    def probe(self) -> None:
        """Read every group once; those the GPU refuses are dropped and listed in ``unsupported``.

        NVMLError_GpuIsLost (and any other failure) propagates: the caller gives up on this GPU.
        """
        if "power" in self.groups:
            self.power_limit_mw = self._try(
                lambda: float(self.lib.nvmlDeviceGetEnforcedPowerLimit(self.board)), None
            )
        for group in list(self.groups):
            try:
                getattr(self, f"_read_{group}")({})
            except (*self._probe_skip_errors, AttributeError) as err:
                self.groups.remove(group)
                self.unsupported[group] = type(err).__name__.replace("NVMLError_", "")

    def read(self) -> tuple[dict[str, float], list[str]]:
        """One sample: ``({metric: value}, groups that stopped being supported just now)``."""
        out: dict[str, float] = {}
        dropped = []
        for group in list(self.groups):
            try:
                getattr(self, f"_read_{group}")(out)
            except self._unsupported_errors as err:
                self.groups.remove(group)
                self.unsupported[group] = type(err).__name__.replace("NVMLError_", "")
                dropped.append(group)
        return out, dropped

    # One method per group; each writes its metrics into ``out``.
    def _read_utilization(self, out: dict[str, float]) -> None:
        rates = self.lib.nvmlDeviceGetUtilizationRates(self.handle)
        out["util"] = float(rates.gpu)
        out["mem_util"] = float(rates.memory)

    def _read_memory(self, out: dict[str, float]) -> None:
        info = self.lib.nvmlDeviceGetMemoryInfo(self.handle)
        out["mem_used_gib"] = info.used / GIB
        out["mem_total_gib"] = info.total / GIB

    def _read_process_memory(self, out: dict[str, float]) -> None:
        procs = self.lib.nvmlDeviceGetComputeRunningProcesses(self.handle)
        mine = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory is not None]
        if mine:  # absent (not yet on the GPU, or another PID namespace): no sample, not a zero
            out["proc_mem_gib"] = sum(mine) / GIB

    def _read_temperature(self, out: dict[str, float]) -> None:
        out["temp_c"] = float(
            self.lib.nvmlDeviceGetTemperature(self.board, self.lib.NVML_TEMPERATURE_GPU)
        )

    def _read_power(self, out: dict[str, float]) -> None:
        milliwatts = float(self.lib.nvmlDeviceGetPowerUsage(self.board))
        out["power_w"] = milliwatts / 1000.0
        if self.power_limit_mw:
            out["power_ratio"] = milliwatts / self.power_limit_mw

    def _read_clock(self, out: dict[str, float]) -> None:
        out["sm_clock_mhz"] = float(
            self.lib.nvmlDeviceGetClockInfo(self.board, self.lib.NVML_CLOCK_SM)
        )

    def _read_throttle(self, out: dict[str, float]) -> None:
        if self._throttle_fn is None:
            try:  # the newer name; drivers before 535 only have the "throttle" one
                reasons = self.lib.nvmlDeviceGetCurrentClocksEventReasons(self.board)
                self._throttle_fn = self.lib.nvmlDeviceGetCurrentClocksEventReasons
            except (*self._unsupported_errors, AttributeError):
                reasons = self.lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.board)
                self._throttle_fn = self.lib.nvmlDeviceGetCurrentClocksThrottleReasons
        else:
            reasons = self._throttle_fn(self.board)
        for metric, mask in THROTTLE_MASKS.items():
            out[metric] = 1.0 if int(reasons) & mask else 0.0

    def _read_energy(self, out: dict[str, float]) -> None:
        out["_energy_mj"] = float(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.board))

    def _read_fan(self, out: dict[str, float]) -> None:
        out["fan_pct"] = float(self.lib.nvmlDeviceGetFanSpeed(self.board))

    def _read_pcie(self, out: dict[str, float]) -> None:
        lib = self.lib
        out["pcie_tx_mbs"] = (
            lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_TX_BYTES) / 1024
        )
        out["pcie_rx_mbs"] = (
            lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_RX_BYTES) / 1024
        )

    def _read_ecc(self, out: dict[str, float]) -> None:
        lib = self.lib
        out["ecc_uncorrected"] = float(
            lib.nvmlDeviceGetTotalEccErrors(
                self.board, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
            )
        )

    def _read_memory_temperature(self, out: dict[str, float]) -> None:
        (value,) = self.lib.nvmlDeviceGetFieldValues(self.board, [self.lib.NVML_FI_DEV_MEMORY_TEMP])
        if value.nvmlReturn != self.lib.NVML_SUCCESS:
            raise self.lib.NVMLError(value.nvmlReturn)
        kind = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal")[min(value.valueType, 5)]
        out["mem_temp_c"] = float(getattr(value.value, kind))

    def identity(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "name": self.name,
            "uuid": self.uuid,
            "nvml_index": self.nvml_index,
            "pci_bus_id": self.pci_bus_id,
            "mig": self.is_mig,
            "unsupported": sorted(self.unsupported),
        }


# --------------------------------------------------------------------------- the sampler
class GpuSampler:
    """Samples a set of :class:`GpuReader` into per-phase accumulators, in a background thread.

    ``set_phase`` and ``collect`` take a boundary sample on the calling thread so that the
    energy counter and the statistics split exactly between phases; everything else happens in
    the thread. ``sample_now`` is public so tests can drive it against a fake clock.
    """

    def __init__(self, readers: Sequence[GpuReader], interval_s: float) -> None:
        self.readers = list(readers)
        self.interval_s = interval_s
        self.phase: str | None = None
        self._acc: dict[str, dict[str, GpuAccumulator]] = {}
        self._last_energy: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> list[GpuReader]:
        return [r for r in self.readers if r.dead is None]

    def start(self) -> None:
        if self._thread is None and self.alive:
            self._thread = threading.Thread(target=self._run, name="gpu-stats-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 10.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self.alive:
            self.sample_now()

    def sample_now(self) -> None:
        """Read every live GPU once and add the values to the current phase."""
        with self._lock:
            for reader in self.alive:
                self._sample(reader)

    def _sample(self, reader: GpuReader) -> None:
        start = time.perf_counter()
        try:
            values, dropped = reader.read()
        except (
            Exception
        ) as err:  # GpuIsLost, NVML gone, anything: this GPU is done, training is not
            reader.dead = f"{type(err).__name__}: {err}"
            log.warning(
                "gpu_stats: stopped sampling %s (%s): %s; training continues",
                reader.label,
                reader.name,
                reader.dead,
            )
            return
        seconds = time.perf_counter() - start
        if dropped:
            log.info(
                "gpu_stats: %s no longer reports %s; left out", reader.label, ", ".join(dropped)
            )
        energy = values.pop("_energy_mj", None)
        acc = self._acc.get(self.phase) if self.phase is not None else None
        if energy is not None:
            previous = self._last_energy.get(reader.label)
            self._last_energy[reader.label] = energy
            if acc is not None and previous is not None:
                acc.setdefault(reader.label, GpuAccumulator()).add_energy(energy - previous)
        if acc is not None:
            acc.setdefault(reader.label, GpuAccumulator()).add(values, seconds)

    def set_phase(self, phase: str | None, *, reset: bool = True, sample: bool = True) -> None:
        """Close the current phase with a sample, then send later samples to ``phase``."""
        if sample:
            self.sample_now()
        with self._lock:
            self.phase = phase
            if phase is not None and (reset or phase not in self._acc):
                self._acc[phase] = {}

    def collect(self, phase: str, *, sample: bool = True) -> dict[str, dict[str, float]]:
        """``{label: summary}`` of ``phase`` so far (after one closing sample if it is current)."""
        if sample and self.phase == phase:
            self.sample_now()
        with self._lock:
            return {label: acc.summary() for label, acc in self._acc.get(phase, {}).items()}


class TorchPeakMemory:
    """PyTorch's own peak allocated/reserved memory per CUDA device, split by phase."""

    def __init__(self, devices: dict[str, torch.device]) -> None:
        self.devices = {k: d for k, d in devices.items() if d.type == "cuda"}
        self._carry: dict[str, tuple[float, float]] = {}

    def _read(self, device: torch.device) -> tuple[float, float]:
        return (
            torch.cuda.max_memory_allocated(device) / GIB,
            torch.cuda.max_memory_reserved(device) / GIB,
        )

    def clear(self) -> None:
        """A new training epoch: forget everything and restart the peaks."""
        self._carry.clear()
        self._restart()

    def stash(self) -> None:
        """Validation starts: remember the training peaks so far, then restart the peaks."""
        for label, device in self.devices.items():
            old, now = self._carry.get(label, (0.0, 0.0)), self._read(device)
            self._carry[label] = (max(old[0], now[0]), max(old[1], now[1]))
        self._restart()

    def restart(self) -> None:
        """Validation ends: its peaks were read; training continues from fresh peaks."""
        self._restart()

    def _restart(self) -> None:
        for device in self.devices.values():
            torch.cuda.reset_peak_memory_stats(device)

    def peaks(self, include_carry: bool) -> dict[str, dict[str, float]]:
        out = {}
        for label, device in self.devices.items():
            alloc, reserved = self._read(device)
            if include_carry:
                carry = self._carry.get(label, (0.0, 0.0))
                alloc, reserved = max(alloc, carry[0]), max(reserved, carry[1])
            out[label] = {"torch_peak_alloc_gib": alloc, "torch_peak_reserved_gib": reserved}
        return out


# --------------------------------------------------------------------------- helpers for ranks
def gather_objects(trainer: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order: the real collective under DDP, ``[obj]`` otherwise."""
    dist = torch.distributed
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    return [obj]


def flatten_epoch(
    payloads: Sequence[dict[str, Any]], root: str, log_cost: bool
) -> dict[str, float]:
    """Turn every rank's ``{"node", "gpus": {label: summary}}`` into logged keys plus aggregates."""
    logged: dict[str, float] = {}
    per_key: dict[str, list[float]] = {}
    for payload in payloads:
        for label, summary in payload.get("gpus", {}).items():
            prefix = f"{root}/node{payload['node']}/{label}/"
            for key, value in summary.items():
                if key == "sample_ms" and not log_cost:
                    continue
                logged[prefix + key] = value
                if key in AGGREGATED:
                    per_key.setdefault(key, []).append(value)
    for key, values in per_key.items():
        logged[f"{root}/all/{key}_min"] = min(values)
        logged[f"{root}/all/{key}_mean"] = sum(values) / len(values)
        logged[f"{root}/all/{key}_max"] = max(values)
        if key == "energy_j":
            logged[f"{root}/all/energy_j_sum"] = sum(values)
    return logged


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
            runs whose devices are not CUDA devices (tests and demos on CPU with the fake NVML).
            Leave ``None`` on real GPUs: the UUIDs then come from CUDA.
        key_prefix: first part of every key (``gpu``); validation uses ``{key_prefix}_val``.
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
    ) -> None:
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"GpuStatsMonitor: interval_s={interval_s!r}; give seconds > 0")
        if device_uuids is not None and (
            isinstance(device_uuids, str) or not all(isinstance(u, str) for u in device_uuids)
        ):
            raise ValueError(
                f"GpuStatsMonitor: device_uuids={device_uuids!r}; give a list of NVML UUID strings"
            )
        if not key_prefix or "/" in key_prefix:
            raise ValueError(f"GpuStatsMonitor: key_prefix={key_prefix!r}; give a word without '/'")
        self.interval_s = float(interval_s)
        self.report_validation = report_validation
        optional = {"fan": fan, "pcie": pcie, "ecc": ecc, "memory_temperature": memory_temperature}
        self.groups = [*DEFAULT_GROUPS, *(g for g in OPTIONAL_GROUPS if optional[g])]
        self.log_sampler_cost = log_sampler_cost
        self.summary_table = summary_table
        self.device_uuids = None if device_uuids is None else list(device_uuids)
        self.key_prefix = key_prefix
        self._reset_state()

    def _reset_state(self) -> None:
        self._stack = ExitStack()
        self._sampler: GpuSampler | None = None
        self._peaks: TorchPeakMemory | None = None
        self._active = False  # some rank samples a GPU: every rank joins the epoch gathers
        self._identities: list[dict[str, Any]] = []
        self._run: dict[tuple[int, str], dict[str, float]] = {}
        self._phase_before_val: str | None = None

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
            local = {"status": "misconfigured", "gpus": [], "config_error": str(err)}
        except Exception as err:  # never let statistics break a run
            self._close()
            local = {"status": f"failed to start ({type(err).__name__}: {err})", "gpus": []}
        local.update(node=trainer.node_rank, rank=trainer.global_rank)
        everyone = gather_objects(trainer, local)  # every rank, before anyone may raise
        errors = [p["config_error"] for p in everyone if p.get("config_error")]
        if errors:
            self._close()
            raise ValueError(errors[0])
        self._identities = everyone
        self._active = any(p["gpus"] for p in everyone)
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
            found = find_nvml_handle(lib, uuid) if uuid else None
            if found is None:
                problems.append(f"{label}: no NVML device with UUID {uuid!r}")
                continue
            try:
                reader = GpuReader(lib, found[0], label, self.groups)
                reader.probe()
            except Exception as err:
                problems.append(f"{label}: {type(err).__name__}: {err}")
                continue
            readers.append(reader)
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
        sampler, self._sampler = getattr(self, "_sampler", None), None
        if sampler is not None:
            sampler.stop()
        stack = getattr(self, "_stack", None)
        if stack is not None:
            stack.close()

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
        if self._sampler is not None:
            self._guarded("epoch start", lambda: self._sampler.set_phase(TRAIN, reset=True))
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.clear())

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._sampler is None:
            return
        self._phase_before_val = self._sampler.phase
        self._guarded("validation start", lambda: self._sampler.set_phase(VAL, reset=True))
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.stash())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self._active:
            return
        local: dict[str, Any] = {}
        if self.report_validation:
            local = self._local_payload(trainer, VAL, include_carry=False)
        sampler, peaks, resume = self._sampler, self._peaks, self._phase_before_val
        if sampler is not None:
            self._guarded("validation end", lambda: sampler.set_phase(resume, reset=False))
        if peaks is not None:
            self._guarded("peak reset", lambda: peaks.restart())
        if self.report_validation:  # the same on every rank, so every rank joins the gather
            everyone = gather_objects(trainer, local)
            root = f"{self.key_prefix}_val"
            self._log(pl_module, flatten_epoch(everyone, root, self.log_sampler_cost))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        local = self._local_payload(trainer, TRAIN, include_carry=True)
        if self._sampler is not None:
            self._guarded("epoch end", lambda: self._sampler.set_phase(None, sample=False))
        everyone = gather_objects(trainer, local)  # every rank, whatever its NVML did
        self._log(pl_module, flatten_epoch(everyone, self.key_prefix, self.log_sampler_cost))
        self._remember(everyone)

    def _local_payload(
        self, trainer: pl.Trainer, phase: str, include_carry: bool
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "node": trainer.node_rank,
            "rank": trainer.global_rank,
            "gpus": {},
        }
        sampler, peaks = self._sampler, self._peaks
        if sampler is None:
            return payload
        gpus = self._guarded(f"{phase} summary", lambda: sampler.collect(phase)) or {}
        if peaks is not None:
            for label, values in (
                self._guarded("peaks", lambda: peaks.peaks(include_carry)) or {}
            ).items():
                if label in gpus:
                    gpus[label].update(values)
        payload["gpus"] = gpus
        return payload

    def _log(self, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        # Every rank holds the same gathered figures and logs them all, in the same order. Under
        # DDP ``sync_dist=True`` then averages identical values (a no-op on the numbers) and keeps
        # Lightning from warning once per key that epoch-level metrics are not synchronised;
        # it also means monitors (EarlyStopping, ModelCheckpoint) see the keys on every rank.
        distributed = pl_module.trainer.world_size > 1
        for key, value in metrics.items():
            pl_module.log(key, float(value), on_step=False, on_epoch=True, sync_dist=distributed)

    # ------------------------------------------------------------------ end of run
    def _remember(self, everyone: Sequence[dict[str, Any]]) -> None:
        for payload in everyone:
            for label, summary in payload.get("gpus", {}).items():
                run = self._run.setdefault((payload["node"], label), {})
                samples = summary.get("samples", 0.0)
                if "util_mean" in summary:
                    run["util_weighted"] = (
                        run.get("util_weighted", 0.0) + summary["util_mean"] * samples
                    )
                    run["util_samples"] = run.get("util_samples", 0.0) + samples
                for key in ("mem_used_gib_max", "proc_mem_gib_max", "torch_peak_alloc_gib"):
                    if key in summary:
                        run[key] = max(run.get(key, 0.0), summary[key])
                if "energy_j" in summary:
                    run["energy_j"] = run.get("energy_j", 0.0) + summary["energy_j"]
                if "sample_ms" in summary:
                    run["sample_ms_weighted"] = (
                        run.get("sample_ms_weighted", 0.0) + summary["sample_ms"] * samples
                    )
                run["samples"] = run.get("samples", 0.0) + samples

    def run_summary(self) -> list[dict[str, Any]]:
        """One row per GPU over the whole ``fit`` (training epochs): what the table shows."""
        names = {(p["node"], g["label"]): g for p in self._identities for g in p.get("gpus", [])}
        rows = []
        for (node, label), run in sorted(self._run.items()):
            ident = names.get((node, label), {})
            samples = run.get("samples", 0.0)
            rows.append(
                {
                    "gpu": f"node{node}/{label}",
                    "name": ident.get("name", "?"),
                    "uuid": ident.get("uuid", "?"),
                    "util_mean": run["util_weighted"] / run["util_samples"]
                    if run.get("util_samples")
                    else None,
                    "mem_used_gib_max": run.get("mem_used_gib_max"),
                    "torch_peak_alloc_gib": run.get("torch_peak_alloc_gib"),
                    "energy_j": run.get("energy_j"),
                    "samples": int(samples),
                    "sample_ms": run["sample_ms_weighted"] / samples if samples else None,
                }
            )
        return rows

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.summary_table and trainer.is_global_zero and self._run):
            return
        from rich.console import Console
        from rich.table import Table

        def fmt(value: float | None, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        table = Table(title="GPU statistics over the run (training epochs)")
        for column in (
            "GPU",
            "name",
            "util %",
            "peak mem GiB",
            "torch peak GiB",
            "energy kJ",
            "samples",
            "NVML ms/sample",
        ):
            table.add_column(column, justify="left" if column in ("GPU", "name") else "right")
        for row in self.run_summary():
            energy = None if row["energy_j"] is None else row["energy_j"] / 1000
            table.add_row(
                row["gpu"],
                row["name"],
                fmt(row["util_mean"], ".1f"),
                fmt(row["mem_used_gib_max"], ".2f"),
                fmt(row["torch_peak_alloc_gib"], ".2f"),
                fmt(energy, ".2f"),
                str(row["samples"]),
                fmt(row["sample_ms"], ".2f"),
            )
        Console().print(table)
