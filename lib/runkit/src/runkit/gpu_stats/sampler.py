"""Sampling GPUs for the statistics in a background thread: the training thread never reads
NVML nor waits for a reading. A metric group the GPU refuses at the probe is left out for good."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from runkit.gpu_stats.statistics import GpuAccumulator
from runkit.gpus import nvml
from runkit.gpus.reader import DeviceReader

log = logging.getLogger(__name__)

GIB = 1024**3
TRAIN, VAL = "train", "val"
# Clock event ("throttle") reason bits, from nvml.h: SW power cap 0x4, HW slowdown 0x8,
# SW thermal 0x20, HW thermal 0x40, HW power brake 0x80.
THROTTLE_MASKS = {"throttle_power": 0x84, "throttle_thermal": 0x60, "throttle_hw": 0x8,
                  "throttle_any": 0xEC}  # fmt: skip
DEFAULT_GROUPS = ("utilization", "memory", "process_memory", "temperature", "power", "clock",
                  "throttle", "energy", "gpm")  # fmt: skip
OPTIONAL_GROUPS = ("fan", "pcie", "ecc", "memory_temperature")
GROUPS = (*DEFAULT_GROUPS, *OPTIONAL_GROUPS)
# At the probe, these also mean "leave the group out" rather than "this GPU is failing".
_PROBE_SKIP_ERRORS = (*nvml.UNSUPPORTED_ERRORS, "NVMLError_NoPermission", "NVMLError_NotFound")
# Logged metric -> pynvml's NVML_GPM_METRIC_* constant, by its suffix; all are percentages.
GPM_METRICS = {
    "sm_active": "SM_UTIL",
    "sm_occupancy": "SM_OCCUPANCY",
    "tensor_active": "ANY_TENSOR_UTIL",
    "dram_active": "DRAM_BW_UTIL",
    "fp16_active": "FP16_UTIL",
    "fp32_active": "FP32_UTIL",
    "fp64_active": "FP64_UTIL",
}


class GpmCounters:
    """GPM (Hopper and newer): what the SMs did, through the physical GPU ``board`` (a MIG slice:
    its ``gpu_instance_id``); two samples, swapped at every reading, give the interval between.
    Opening raises ``NVMLError_NotSupported`` without GPM."""

    def __init__(self, lib: Any, board: Any, label: str, gpu_instance_id: int | None) -> None:
        self.lib, self.board, self.label, self.gpu_instance_id = lib, board, label, gpu_instance_id
        self._samples: list[Any] = []
        self._have_previous = self._paused = False
        if not getattr(lib.nvmlGpmQueryDeviceSupport(board), "isSupportedDevice", 0):
            raise lib.NVMLError(lib.NVML_ERROR_NOT_SUPPORTED)
        ids = {name: getattr(lib, f"NVML_GPM_METRIC_{c}", None) for name, c in GPM_METRICS.items()}
        self._names = [name for name, metric_id in ids.items() if isinstance(metric_id, int)]
        try:
            request = self._request = lib.c_nvmlGpmMetricsGet_t()
            request.version = lib.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(self._names)
            for i, name in enumerate(self._names):
                request.metrics[i].metricId = ids[name]
            for _ in range(2):  # one by one: a failed second frees the first
                self._samples.append(lib.nvmlGpmSampleAlloc())
            self.read()  # the first sample of the first pair; no figures yet
        except BaseException:
            self.close()
            raise

    def read(self) -> dict[str, float]:
        """The metrics since the previous call (none the first time, nor while a profiler holds
        GPM: one line); only ``GpuIsLost`` is raised."""
        if len(self._samples) < 2:
            return {}
        lib, (previous, current), request = self.lib, self._samples, self._request
        values = {}
        try:
            if self.gpu_instance_id is None:
                lib.nvmlGpmSampleGet(self.board, current)
            else:
                lib.nvmlGpmMigSampleGet(self.board, self.gpu_instance_id, current)
            if self._have_previous:
                request.sample1, request.sample2 = previous, current
                lib.nvmlGpmMetricsGet(request)
                for i, name in enumerate(self._names):
                    metric = request.metrics[i]
                    if metric.nvmlReturn == lib.NVML_SUCCESS and math.isfinite(metric.value):
                        values[name] = float(metric.value)
        except nvml.error_classes(lib, ("NVMLError_GpuIsLost",)):
            raise
        except lib.NVMLError as err:
            self._have_previous = False  # the next reading starts a fresh pair
            if not self._paused:
                self._paused = True
                log.info(
                    "gpu_stats: %s: GPM refused (%s); a profiler (DCGM, Nsight) may hold the "
                    "counters. GPM figures pause and come back when it lets go",
                    *(self.label, type(err).__name__.replace("NVMLError_", "")),
                )
            return {}
        if self._paused and values:
            self._paused = False
            log.info("gpu_stats: %s: GPM figures are back", self.label)
        self._samples, self._have_previous = [current, previous], True
        return values

    def close(self) -> None:
        samples, self._samples = self._samples, []
        for sample in samples:
            try:
                self.lib.nvmlGpmSampleFree(sample)
            except self.lib.NVMLError as err:
                log.debug("gpu_stats: %s: freeing a GPM sample failed: %s", self.label, err)


class GpuReader:
    """One GPU as the statistics see it: every group read once when made (those the GPU refuses
    are dropped, any other failure propagates), then :meth:`read`."""

    def __init__(self, lib: Any, handle: Any, label: str, groups: Sequence[str]) -> None:
        self.lib, self.label, self.groups = lib, label, list(groups)
        self.device = d = DeviceReader.open(lib, handle)
        self.unsupported: dict[str, str] = {}
        self.dead: str | None = None
        self.gpm: GpmCounters | None = None
        self.pid = os.getpid()
        self.is_mig, self.name, self.uuid = d.is_mig, d.name(), d.uuid()
        # The physical GPU: energy is counted once per board, however many slices a run uses.
        self.board_uuid = nvml.as_text(lib.nvmlDeviceGetUUID(d.board)) if d.is_mig else self.uuid
        self.nvml_index = nvml.optional(lib, d.index)
        self.pci_bus_id = nvml.optional(lib, d.pci_bus_id)
        self.power_limit_mw = nvml.optional(lib, d.power_limit_mw) if "power" in groups else None
        skip = (*nvml.error_classes(lib, _PROBE_SKIP_ERRORS), AttributeError)
        try:
            for group in list(self.groups):
                try:
                    if group == "gpm":
                        instance = d.gpu_instance_id() if d.is_mig else None
                        self.gpm = GpmCounters(lib, d.board, label, instance)
                    else:
                        self._values(group)
                except skip as err:
                    self._skip(group, err)
        except BaseException:
            self.close()
            raise

    def _skip(self, group: str, err: BaseException) -> None:
        self.groups.remove(group)
        self.unsupported[group] = type(err).__name__.replace("NVMLError_", "")

    def close(self) -> None:
        if self.gpm is not None:
            self.gpm.close()

    def read(self) -> tuple[dict[str, float], list[str]]:
        """One sample: ``({metric: value}, groups that stopped being supported just now)``."""
        out: dict[str, float] = {}
        dropped = []
        for group in list(self.groups):
            try:
                out.update(self._values(group))
            except nvml.error_classes(self.lib, nvml.UNSUPPORTED_ERRORS) as err:
                self._skip(group, err)
                dropped.append(group)
        return out, dropped

    def _values(self, group: str) -> dict[str, float]:
        d = self.device
        if group == "utilization":
            return dict(zip(("util", "mem_util"), map(float, d.utilization()), strict=True))
        if group == "memory":
            total, used, _free = d.memory()
            return {"mem_used_gib": used / GIB, "mem_total_gib": total / GIB}
        if group == "process_memory":  # absent (not on the GPU yet, another PID namespace): no 0
            mine = [u for pid, u in d.compute_processes() if pid == self.pid and u is not None]
            return {"proc_mem_gib": sum(mine) / GIB} if mine else {}
        if group == "power":
            mw = d.power_mw()
            ratio = {"power_ratio": mw / self.power_limit_mw} if self.power_limit_mw else {}
            return {"power_w": mw / 1000.0, **ratio}
        if group == "throttle":
            reasons = d.clock_event_reasons()
            return {metric: float(bool(reasons & mask)) for metric, mask in THROTTLE_MASKS.items()}
        if group == "pcie":
            sent, received = d.pcie_kbs()
            return {"pcie_tx_mbs": sent / 1024, "pcie_rx_mbs": received / 1024}
        if group == "gpm":
            return self.gpm.read() if self.gpm is not None else {}
        key, read = {
            "temperature": ("temp_c", d.temperature_c),
            "clock": ("sm_clock_mhz", d.sm_clock_mhz),
            "energy": ("_energy_mj", d.energy_mj),
            "fan": ("fan_pct", d.fan_pct),
            "ecc": ("ecc_uncorrected", d.ecc_uncorrected),
            "memory_temperature": ("mem_temp_c", d.memory_temperature_c),
        }[group]
        return {key: float(read())}

    def identity(self) -> dict[str, Any]:
        keys = ("label", "name", "uuid", "nvml_index", "pci_bus_id", "board_uuid")
        return {**{k: getattr(self, k) for k in keys}, "mig": self.is_mig,
                "unsupported": sorted(self.unsupported)}  # fmt: skip


class GpuSampler:
    """Samples :class:`GpuReader` s into per-phase accumulators in a thread, a first sample at
    :meth:`start`; a phase no sample reached reports the latest reading."""

    def __init__(
        self, readers: Sequence[GpuReader], interval_s: float, devices: dict[str, torch.device]
    ) -> None:
        self.readers, self.interval_s = list(readers), interval_s
        self.cuda = {label: d for label, d in devices.items() if d.type == "cuda"}
        self._carry: dict[str, tuple[float, float]] = {}  # training's torch peaks, at validation
        self.phase: str | None = None
        self._acc: dict[str, dict[str, GpuAccumulator]] = {}
        self._latest: dict[str, tuple[dict[str, float], float]] = {}
        self._energy: dict[str, tuple[float, float]] = {}  # label: (last counter, total since), mJ
        self._lock = threading.Lock()  # the aggregates and the phase: never held while reading
        self._reading = threading.Lock()  # one reading at a time; none after stop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-stats", daemon=True)

    def start(self) -> None:
        self.sample_now()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 10.0)
        with self._reading:
            for reader in self.readers:
                reader.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and any(r.dead is None for r in self.readers):
            self.sample_now()

    def sample_now(self) -> None:
        with self._reading:
            if self._stop.is_set():
                return  # stopped: the readers are closed
            phase, readings = self.phase, []
            for reader in (r for r in self.readers if r.dead is None):
                start = time.perf_counter()
                try:
                    values, dropped = reader.read()
                except Exception as err:  # GpuIsLost, NVML gone, anything: this GPU is done
                    reader.dead = f"{type(err).__name__}: {err}"
                    log.warning("gpu_stats: stopped sampling %s (%s): %s; training continues",
                                reader.label, reader.name, reader.dead)  # fmt: skip
                    continue
                if dropped:
                    log.info("gpu_stats: %s no longer reports %s; left out", reader.label, ", ".join(dropped))  # fmt: skip
                readings.append((reader.label, values, time.perf_counter() - start))
            with self._lock:
                for label, values, seconds in readings:
                    self._add(label, phase, values, seconds)

    def _add(self, label: str, phase: str | None, values: dict[str, float], s: float) -> None:
        acc = self._acc[phase].setdefault(label, GpuAccumulator()) if phase else None
        self._latest[label] = values, s
        if (energy := values.pop("_energy_mj", None)) is not None:
            last, total = (previous := self._energy.get(label)) or (energy, 0.0)
            self._energy[label] = energy, total + energy - last
            if acc is not None and previous is not None:
                acc.energy_mj = (acc.energy_mj or 0.0) + energy - last
        if acc is not None:
            acc.add(values, s)

    def set_phase(self, phase: str | None, reset: bool = True) -> None:
        """Samples count for ``phase`` from now; PyTorch's peaks restart (training's are kept
        aside while validation runs; a new epoch forgets them)."""
        if phase == VAL:
            self._carry = self._torch_peaks(self._carry)
        elif phase == TRAIN and reset:
            self._carry = {}
        for device in self.cuda.values():
            torch.cuda.reset_peak_memory_stats(device)
        with self._lock:
            self.phase = phase
            if phase is not None and (reset or phase not in self._acc):
                self._acc[phase] = {}

    def _torch_peaks(self, carry: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """PyTorch's peak (allocated, reserved) GiB of each CUDA device since its restart, or
        ``carry``'s where higher."""
        peaks = {}
        for label, d in self.cuda.items():
            alloc, reserved = carry.get(label, (0.0, 0.0))
            peaks[label] = (
                max(alloc, torch.cuda.max_memory_allocated(d) / GIB),
                max(reserved, torch.cuda.max_memory_reserved(d) / GIB),
            )
        return peaks

    def report(self, phase: str | None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """``{label: figures}`` of ``phase`` so far (a training epoch's torch peaks include those
        before its validation) and each GPU's energy since the start, J."""
        figures = {}
        with self._lock:
            held = self._acc.get(phase, {}) if phase else {}
            for reader in self.readers if phase else []:
                acc = held.get(reader.label)
                if not (acc and acc.samples) and not reader.dead and reader.label in self._latest:
                    acc = GpuAccumulator()
                    acc.add(*self._latest[reader.label])
                if acc is not None:
                    figures[reader.label] = acc.summary()
            energy = {label: total / 1000.0 for label, (_, total) in self._energy.items()}
        peaks = self._torch_peaks(self._carry if phase == TRAIN else {}) if phase else {}
        for label, (alloc, reserved) in peaks.items():
            figures.get(label, {}).update(
                torch_peak_alloc_gib=alloc, torch_peak_reserved_gib=reserved
            )
        return figures, energy
