"""A scriptable stand-in for ``pynvml``, so every GPU path is tested on a CPU.

Why a fake and not mocks: :class:`FakeNvml` has pynvml's function names and constants and raises
pynvml's own error classes, so the code under test runs unchanged behind
:func:`runkit.gpus.nvml.use_library` or, in a subprocess,
``RUNKIT_NVML_BACKEND=runkit.testing.fake_nvml:create`` with a JSON scenario in
``RUNKIT_FAKE_NVML``. The scenario schema is lib/runkit/docs/fake-nvml.md.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

SCENARIO_ENV = "RUNKIT_FAKE_NVML"
SELF_PID = "self"
GIB = 1024**3

Script = Any  # number | sequence of (t, value) steps | callable(t) -> number

# The metric names of ``failures``, each with the pynvml functions (``nvmlDeviceGet*`` unless
# named in full) whose calls it fails.
_METRIC_FUNCTIONS = {
    "name": "Name", "uuid": "UUID", "index": "Index", "pci": "PciInfo", "memory": "MemoryInfo",
    "utilization": "UtilizationRates", "temperature": "Temperature",
    "memory_temperature": "FieldValues", "power": "PowerUsage",
    "power_limit": "EnforcedPowerLimit PowerManagementLimit", "energy": "TotalEnergyConsumption",
    "clock": "ClockInfo", "throttle": "CurrentClocksEventReasons CurrentClocksThrottleReasons",
    "fan": "FanSpeed", "pcie": "PcieThroughput", "ecc": "TotalEccErrors",
    "processes": "ComputeRunningProcesses",
    "mig": "MigMode MaxMigDeviceCount MigDeviceHandleByIndex GpuInstanceId ComputeInstanceId",
    "gpm": "nvmlGpmQueryDeviceSupport nvmlGpmSampleGet nvmlGpmMigSampleGet nvmlGpmMetricsGet",
}  # fmt: skip
FUNCTION_METRIC = {
    name if name.startswith("nvml") else f"nvmlDeviceGet{name}": metric
    for metric, names in _METRIC_FUNCTIONS.items()
    for name in names.split()
}
METRICS = frozenset(FUNCTION_METRIC.values())
# What a MIG handle answers NotSupported, as real ones do: its GPU's handle has it.
MIG_UNSUPPORTED = frozenset(
    {"utilization", "temperature", "power", "power_limit", "energy", "clock", "throttle", "fan", "pcie", "ecc"}
)  # fmt: skip
MAX_MIG_DEVICES = 7

# pynvml getter -> the FakeGpu figure it answers, by its argument where that picks one (a sensor,
# clock or counter: another is InvalidArgument); a figure of None is NotSupported.
FIGURES: dict[str, Any] = {
    "nvmlDeviceGetTemperature": {pynvml.NVML_TEMPERATURE_GPU: "temperature"},
    "nvmlDeviceGetPowerUsage": "power_mw",
    "nvmlDeviceGetEnforcedPowerLimit": "power_limit_mw",
    "nvmlDeviceGetPowerManagementLimit": "power_limit_mw",
    "nvmlDeviceGetClockInfo": dict.fromkeys((pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS), "clock_sm_mhz"),
    "nvmlDeviceGetCurrentClocksEventReasons": "clocks_event_reasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons": "clocks_event_reasons",
    "nvmlDeviceGetFanSpeed": "fan_pct",
    "nvmlDeviceGetPcieThroughput": {pynvml.NVML_PCIE_UTIL_TX_BYTES: "pcie_tx_kbs", pynvml.NVML_PCIE_UTIL_RX_BYTES: "pcie_rx_kbs"},
    "nvmlDeviceGetTotalEccErrors": "ecc_uncorrected",
}  # fmt: skip


def nvml_error(name: str) -> pynvml.NVMLError:
    """The pynvml exception for an error name such as ``"not_supported"`` (its own subclass)."""
    code = getattr(pynvml, f"NVML_ERROR_{name.upper()}", None)
    if not isinstance(code, int):
        known = sorted(
            n[len("NVML_ERROR_") :].lower()
            for n in dir(pynvml)
            if n.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, n), int)
        )
        raise ValueError(f"unknown NVML error name {name!r}; accepted: {', '.join(known)}")
    return pynvml.NVMLError(code)


class FakeClock:
    """A clock the test moves by hand: ``clock.advance(2.5)``; reading it is calling it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock forward and return the new time."""
        if seconds < 0:
            raise ValueError(f"FakeClock.advance({seconds}): time only moves forward")
        self.now += seconds
        return self.now

    def set(self, t: float) -> None:
        """Jump to an absolute time (forward only)."""
        if t < self.now:
            raise ValueError(f"FakeClock.set({t}): the clock is already at {self.now}")
        self.now = float(t)


def _check_script(value: Script, what: str) -> Script:
    """Validate a script once, at construction, so a bad scenario fails with one clear line."""
    if value is None or callable(value) or isinstance(value, (int, float)):
        return value
    if isinstance(value, (list, tuple)):
        steps = []
        for step in value:
            if not (isinstance(step, (list, tuple)) and len(step) == 2):
                raise ValueError(f"{what}: bad step {step!r}; a step is a pair [t, value]")
            steps.append((float(step[0]), step[1]))
        if not steps:
            raise ValueError(f"{what}: an empty list of steps; give at least one [t, value]")
        if any(b[0] < a[0] for a, b in itertools.pairwise(steps)):
            raise ValueError(f"{what}: steps {value!r} are not sorted by time")
        return steps
    raise ValueError(
        f"{what}: bad value {value!r}; accepted: a number, a list of [t, value] steps or f(t)"
    )


def evaluate(script: Script, t: float) -> Any:
    """The value of a script at time ``t`` (steps hold their value until the next step)."""
    if callable(script):
        return script(t)
    if isinstance(script, list):
        times = [s[0] for s in script]
        i = bisect.bisect_right(times, t) - 1
        return script[max(i, 0)][1]
    return script


def integrate(script: Script, t: float) -> float:
    """The integral of a script from 0 to ``t`` (exact for constants and steps)."""
    if t <= 0:
        return 0.0
    if isinstance(script, (int, float)):
        return float(script) * t
    if isinstance(script, list):
        total, prev_t, prev_v = 0.0, 0.0, script[0][1]
        for step_t, step_v in script:
            if step_t >= t:
                break
            if step_t > prev_t:
                total += prev_v * (step_t - prev_t)
                prev_t = step_t
            prev_v = step_v
        return total + prev_v * (t - prev_t)
    n = max(1, min(10_000, int(t / 0.01)))
    dt = t / n
    return sum((script(i * dt) + script((i + 1) * dt)) * dt / 2 for i in range(n))


@dataclass
class FakeProcess:
    """A process holding memory on a GPU; ``pid="self"`` means whoever asks."""

    pid: int | str = SELF_PID
    used_memory: Script = GIB

    def __post_init__(self) -> None:
        if not (isinstance(self.pid, int) or self.pid == SELF_PID):
            raise ValueError(f"process pid {self.pid!r}: give an int or {SELF_PID!r}")
        self.used_memory = _check_script(self.used_memory, "process used_memory")


@dataclass
class Failure:
    """An error one metric raises from time ``start`` on."""

    error: str
    start: float = float("-inf")

    def __post_init__(self) -> None:
        nvml_error(self.error)  # validate the name early


@dataclass
class FakeGpu:
    """One GPU (or one MIG slice when it sits in a parent's ``mig`` list) and its scripted state."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total: int = 80 * GIB
    memory_used: Script = 0
    util_gpu: Script = 0
    util_memory: Script = 0
    temperature: Script = 35
    memory_temperature: Script = None
    power_mw: Script = 70_000
    power_limit_mw: int = 700_000
    energy_mj: Script = None
    clock_sm_mhz: Script = 1980
    clocks_event_reasons: Script = 0
    fan_pct: Script = None
    pcie_tx_kbs: Script = 0
    pcie_rx_kbs: Script = 0
    ecc_uncorrected: Script = 0
    processes: list[FakeProcess] = field(default_factory=list)
    mig: list[FakeGpu] = field(default_factory=list)
    mig_capable: bool | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int = 0
    failures: dict[str, Failure] = field(default_factory=dict)
    lost_at: float | None = None
    gpm: dict[str, Script] | None = None

    def _check_gpm(self) -> None:
        if self.gpm is None:
            return
        if not isinstance(self.gpm, dict):
            raise ValueError(f"{self.name}: gpm={self.gpm!r}; give {{METRIC: SCRIPT}} or null")
        checked = {}
        for metric, script in self.gpm.items():
            if not isinstance(getattr(pynvml, f"NVML_GPM_METRIC_{metric}", None), int):
                raise ValueError(
                    f"{self.name}: unknown GPM metric {metric!r}; give a pynvml NVML_GPM_METRIC_* "
                    "name without the prefix (SM_UTIL, SM_OCCUPANCY, ANY_TENSOR_UTIL, ...)"
                )
            checked[metric] = _check_script(script, f"{self.name}: gpm {metric}")
        self.gpm = checked

    def __post_init__(self) -> None:
        for attr in (f.name for f in fields(self) if f.type == "Script"):
            setattr(self, attr, _check_script(getattr(self, attr), f"{self.name}: {attr}"))
        self.processes = [
            p if isinstance(p, FakeProcess) else FakeProcess(**p) for p in self.processes
        ]
        self.mig = [m if isinstance(m, FakeGpu) else FakeGpu(**m) for m in self.mig]
        self._check_gpm()
        if self.mig_capable is None:
            self.mig_capable = bool(self.mig)
        failures, self.failures = self.failures, {}
        for metric, spec in failures.items():
            if isinstance(spec, Failure):
                self._add_failure(metric, spec)
            elif isinstance(spec, str):
                self.fail(metric, spec)
            elif isinstance(spec, dict):
                self.fail(metric, spec.get("error", ""), start=spec.get("from", float("-inf")))
            else:
                raise ValueError(f"failure for {metric!r}: bad spec {spec!r}")

    def fail(self, metric: str, error: str, start: float = float("-inf")) -> FakeGpu:
        """Make ``metric`` (or one pynvml function) raise ``error`` from time ``start`` on."""
        self._add_failure(metric, Failure(error, float(start)))
        return self

    def _add_failure(self, metric: str, failure: Failure) -> None:
        if metric not in METRICS and metric not in FUNCTION_METRIC:
            raise ValueError(
                f"unknown metric {metric!r} for a failure; accepted: {', '.join(sorted(METRICS))} "
                "or a pynvml function name"
            )
        self.failures[metric] = failure

    def heal(self, metric: str) -> None:
        """Remove a scripted failure."""
        self.failures.pop(metric, None)

    def lose(self, at: float) -> FakeGpu:
        """From time ``at`` on every call on this GPU raises ``NVMLError_GpuIsLost``."""
        self.lost_at = float(at)
        return self


class FakeHandle:
    """An opaque device handle, as NVML's are; ``gpu`` and ``parent`` are for the fake only."""

    __slots__ = ("gpu", "index", "parent")

    def __init__(self, gpu: FakeGpu, index: int, parent: FakeHandle | None = None) -> None:
        self.gpu = gpu
        self.index = index
        self.parent = parent


def _api(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An NVML function of the fake: counted, charged, refused before nvmlInit (:meth:`_enter`)."""

    @functools.wraps(fn)
    def wrapper(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        self._enter(fn.__name__)
        return fn(self, *args, **kwargs)

    return wrapper


class FakeNvml:
    """The pynvml look-alike. See the module docstring for what it models."""

    def __init__(
        self,
        gpus: Iterable[FakeGpu] | int = 2,
        *,
        clock: Callable[[], float] | None = None,
        call_cost_s: float = 0.0,
        init_error: str | None = None,
        driver_version: str = "570.133.20",
    ) -> None:
        gpu_list = [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus)
        self.gpus: list[FakeGpu] = [g if isinstance(g, FakeGpu) else FakeGpu(**g) for g in gpu_list]
        start = time.monotonic()  # scripted times count from the fake's creation
        self.clock: Callable[[], float] = clock or (lambda: time.monotonic() - start)
        # "self" in a process list: the process that made the fake (a GPU statistics sampler
        # forked from it is asked about the training process, not about itself)
        self.owner_pid = os.getpid()
        self.call_cost_s = float(call_cost_s)
        if init_error is not None:
            nvml_error(init_error)
        self.init_error = init_error
        self.driver_version = driver_version
        self._name_defaults()
        self._depth = 0
        self._lock = threading.Lock()
        self.init_count = 0
        self.shutdown_count = 0
        self.calls: Counter[str] = Counter()
        self._thread_calls: Counter[int] = Counter()
        self._handles = [FakeHandle(g, i) for i, g in enumerate(self.gpus)]
        # GPM samples: address -> (handle the sample was taken on, the slice or GPU, time) or None
        self._gpm_samples: dict[int, tuple[FakeHandle, FakeGpu, float] | None] = {}
        self._gpm_next_address = 0
        self._by_uuid: dict[str, FakeHandle] = {}
        for handle in self._handles:
            self._by_uuid[handle.gpu.uuid] = handle  # type: ignore[index]
            for j, child in enumerate(handle.gpu.mig):
                self._by_uuid[child.uuid] = FakeHandle(child, j, parent=handle)  # type: ignore[index]

    # ---------------------------------------------------------------- construction helpers
    @classmethod
    def from_dict(cls, spec: dict[str, Any], clock: Callable[[], float] | None = None) -> FakeNvml:
        """Build a fake from a JSON scenario (the schema: the library repository's fake NVML page)."""
        if not isinstance(spec, dict):
            raise ValueError(f"fake NVML scenario must be a JSON object, got {type(spec).__name__}")
        allowed = {"gpus", "driver_version", "call_cost_s", "init_error"}
        unknown = set(spec) - allowed
        if unknown:
            raise ValueError(
                f"fake NVML scenario: unknown keys {sorted(unknown)}; accepted: {sorted(allowed)}"
            )
        gpus = spec.get("gpus", 2)
        if isinstance(gpus, list):
            gpus = [_gpu_from_dict(g, f"gpus[{i}]") for i, g in enumerate(gpus)]
        elif not isinstance(gpus, int):
            raise ValueError(f"fake NVML scenario: 'gpus' is {gpus!r}; give a count or a list")
        kwargs = {k: spec[k] for k in allowed - {"gpus"} if k in spec}
        return cls(gpus, clock=clock, **kwargs)

    def _name_defaults(self) -> None:
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid is None:
                gpu.uuid = f"GPU-{i:08x}-fa6e-4000-8000-{i:012x}"
            if gpu.pci_bus_id is None:
                gpu.pci_bus_id = f"00000000:{0x17 + 0x10 * i:02X}:00.0"
            for j, child in enumerate(gpu.mig):
                if child.uuid is None:
                    child.uuid = f"MIG-{i:08x}-fa6e-4000-8000-{(j + 1) << 16 | i:012x}"
                child.pci_bus_id = gpu.pci_bus_id
                if child.name == FakeGpu.name:
                    child.name = f"{gpu.name} MIG 1g.10gb"
                if child.gpu_instance_id is None:
                    child.gpu_instance_id = j + 1  # what the process list reports for the slice

    # ---------------------------------------------------------------- test hooks
    @property
    def balanced(self) -> bool:
        """Every successful nvmlInit was matched by an nvmlShutdown."""
        return self.init_count == self.shutdown_count

    @property
    def initialised(self) -> bool:
        return self._depth > 0

    def calls_in_thread(self, ident: int | None = None) -> int:
        """How many NVML calls the thread ``ident`` (default: the calling thread) has made."""
        return self._thread_calls[threading.get_ident() if ident is None else ident]

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def reset_counters(self) -> None:
        with self._lock:
            self.calls.clear()
            self._thread_calls.clear()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1
            self._thread_calls[threading.get_ident()] += 1

    def _enter(self, name: str) -> None:
        """Count the call, charge its cost and refuse it before nvmlInit, as NVML would."""
        self._count(name)
        if self.call_cost_s:
            time.sleep(self.call_cost_s)
        if self._depth <= 0:
            raise nvml_error("uninitialized")

    def _figure(self, name: str, handle: FakeHandle, *args: Any) -> int:
        self._enter(name)
        gpu, spec = self._read(handle, name), FIGURES[name]
        figure = spec.get(args[0]) if isinstance(spec, dict) else spec
        if figure is None:
            raise nvml_error("invalid_argument")
        if getattr(gpu, figure) is None:
            raise nvml_error("not_supported")
        return int(self._value(getattr(gpu, figure)))

    # ---------------------------------------------------------------- pynvml surface: attributes
    NVMLError = pynvml.NVMLError

    def __getattr__(self, name: str) -> Any:
        if name in FIGURES:
            return functools.partial(self._figure, name)
        value = getattr(pynvml, name, None)
        if value is None:
            raise AttributeError(f"FakeNvml has no attribute {name!r} (nor has pynvml)")
        if isinstance(value, type) or not callable(value):
            return value  # constants and error classes are pynvml's own
        if name.startswith("nvml"):

            def missing(*args: Any, **kwargs: Any) -> Any:
                self._count(name)
                raise nvml_error("function_not_found")

            return missing
        return value

    # ---------------------------------------------------------------- lifecycle
    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        with self._lock:
            self._depth += 1
            self.init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        with self._lock:
            if self._depth <= 0:
                raise nvml_error("uninitialized")
            self._depth -= 1
            self.shutdown_count += 1

    # ---------------------------------------------------------------- system
    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    # ---------------------------------------------------------------- handles
    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not isinstance(index, int) or not 0 <= index < len(self._handles):
            raise nvml_error("invalid_argument")
        return self._alive(self._handles[index], "nvmlDeviceGetHandleByIndex")

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        key = uuid.decode() if isinstance(uuid, bytes) else uuid
        handle = self._by_uuid.get(key)
        if handle is None:
            raise nvml_error("not_found")
        return self._alive(handle, "nvmlDeviceGetHandleByUUID")

    # ---------------------------------------------------------------- identity
    @_api
    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._read(handle, "nvmlDeviceGetName").name

    @_api
    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._read(handle, "nvmlDeviceGetUUID").uuid  # type: ignore[return-value]

    @_api
    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._read(handle, "nvmlDeviceGetIndex")
        if handle.parent is not None:
            raise nvml_error("not_supported")
        return handle.index

    @_api
    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> SimpleNamespace:
        gpu = self._read(handle, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=(gpu.pci_bus_id or "").encode())  # bytes, as in pynvml

    # ---------------------------------------------------------------- memory and load
    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> Any:
        gpu = self._read(handle, "nvmlDeviceGetMemoryInfo")
        used = int(self._value(gpu.memory_used))
        return SimpleNamespace(total=gpu.memory_total, used=used, free=gpu.memory_total - used)

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> SimpleNamespace:
        gpu = self._read(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(
            gpu=int(self._value(gpu.util_gpu)), memory=int(self._value(gpu.util_memory))
        )

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        gpu = self._read(handle, "nvmlDeviceGetComputeRunningProcesses")
        whole = 0xFFFFFFFF  # NVML's "no instance": a process on the GPU itself
        owners = [(gpu, whole, whole)]
        owners += [(c, c.gpu_instance_id, c.compute_instance_id) for c in gpu.mig]
        result = []
        for owner, instance, compute_instance in owners:
            for proc in owner.processes:
                pid = self.owner_pid if proc.pid == SELF_PID else proc.pid
                result.append(
                    SimpleNamespace(
                        pid=pid,
                        usedGpuMemory=int(self._value(proc.used_memory)),
                        gpuInstanceId=instance,
                        computeInstanceId=compute_instance,
                    )
                )
        return result

    # ---------------------------------------------------------------- thermals, power, clocks
    @_api
    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: Sequence[Any]) -> list[Any]:
        gpu = self._read(handle, "nvmlDeviceGetFieldValues")
        values = []
        for fid in field_ids:
            ret, raw = pynvml.NVML_ERROR_NOT_SUPPORTED, 0
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and gpu.memory_temperature is not None:
                ret, raw = pynvml.NVML_SUCCESS, int(self._value(gpu.memory_temperature))
            value = SimpleNamespace(uiVal=raw)
            values.append(
                SimpleNamespace(
                    valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, nvmlReturn=ret, value=value
                )
            )
        return values

    @_api
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        gpu = self._read(handle, "nvmlDeviceGetTotalEnergyConsumption")
        if gpu.energy_mj is not None:
            return int(self._value(gpu.energy_mj))
        return int(5_000_000 + integrate(gpu.power_mw, self.clock()))

    # ---------------------------------------------------------------- MIG
    @_api
    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        gpu = self._read(handle, "nvmlDeviceGetMigMode")
        if handle.parent is not None or not gpu.mig_capable:
            raise nvml_error("not_supported")
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        gpu = self._read(handle, "nvmlDeviceGetMaxMigDeviceCount")
        if handle.parent is not None or not gpu.mig_capable:
            raise nvml_error("not_supported")
        return MAX_MIG_DEVICES if gpu.mig else 0

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        gpu = self._read(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if handle.parent is not None or not gpu.mig_capable:
            raise nvml_error("not_supported")
        if not 0 <= index < MAX_MIG_DEVICES:
            raise nvml_error("invalid_argument")
        if index >= len(gpu.mig):
            raise nvml_error("not_found")
        return self._by_uuid[gpu.mig[index].uuid]  # type: ignore[index]

    @_api
    def nvmlDeviceGetGpuInstanceId(self, handle: FakeHandle) -> int:
        gpu = self._read(handle, "nvmlDeviceGetGpuInstanceId")
        if handle.parent is None:
            raise nvml_error("invalid_argument")  # a physical GPU has no instance id
        return int(gpu.gpu_instance_id)  # type: ignore[arg-type]

    @_api
    def nvmlDeviceGetComputeInstanceId(self, handle: FakeHandle) -> int:
        gpu = self._read(handle, "nvmlDeviceGetComputeInstanceId")
        if handle.parent is None:
            raise nvml_error("invalid_argument")
        return int(gpu.compute_instance_id)

    @_api
    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeHandle) -> int:
        self._alive(handle, "nvmlDeviceIsMigDeviceHandle")
        return int(handle.parent is not None)

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeHandle) -> FakeHandle:
        self._alive(handle, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        if handle.parent is None:
            raise nvml_error("invalid_argument")
        return handle.parent

    # ---------------------------------------------------------------- GPM
    @property
    def gpm_samples_live(self) -> int:
        """GPM samples allocated and not yet freed (a test hook: every exit path frees them)."""
        return len(self._gpm_samples)

    @_api
    def nvmlGpmQueryDeviceSupport(self, handle: FakeHandle) -> Any:
        gpu = self._read(handle, "nvmlGpmQueryDeviceSupport")
        if handle.parent is not None:
            raise nvml_error("not_supported")  # asked of the physical GPU, as NVML wants
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(
            gpu.gpm is not None or any(c.gpm is not None for c in gpu.mig)
        )
        return support

    @_api
    def nvmlGpmSampleAlloc(self) -> Any:
        with self._lock:
            self._gpm_next_address += 64
            address = self._gpm_next_address
            self._gpm_samples[address] = None
        # An opaque pointer, as NVML's: the fake keeps the sample behind its address.
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    @_api
    def nvmlGpmSampleFree(self, sample: Any) -> None:
        with self._lock:
            if self._gpm_samples.pop(self._gpm_address(sample), False) is False:
                raise nvml_error("invalid_argument")

    @_api
    def nvmlGpmSampleGet(self, handle: FakeHandle, sample: Any) -> Any:
        gpu = self._read(handle, "nvmlGpmSampleGet")
        if handle.parent is not None or gpu.gpm is None:
            raise nvml_error("not_supported")  # a MIG slice: nvmlGpmMigSampleGet on its GPU
        self._store_gpm_sample(sample, handle, gpu)
        return sample

    @_api
    def nvmlGpmMigSampleGet(self, handle: FakeHandle, gpu_instance_id: int, sample: Any) -> Any:
        gpu = self._read(handle, "nvmlGpmMigSampleGet")
        if handle.parent is not None:
            raise nvml_error("invalid_argument")  # the physical GPU's handle is wanted
        child = next((c for c in gpu.mig if c.gpu_instance_id == gpu_instance_id), None)
        if child is None:
            raise nvml_error("invalid_argument")
        if child.gpm is None:
            raise nvml_error("not_supported")
        self._store_gpm_sample(sample, handle, child)
        return sample

    @_api
    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any:
        if metrics_get.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise nvml_error("argument_version_mismatch")
        first = self._gpm_samples.get(self._gpm_address(metrics_get.sample1))
        second = self._gpm_samples.get(self._gpm_address(metrics_get.sample2))
        if first is None or second is None or first[1] is not second[1]:
            raise nvml_error("invalid_argument")
        self._read(first[0], "nvmlGpmMetricsGet")
        gpu, start, end = first[1], first[2], second[2]
        if not end > start:
            raise nvml_error("invalid_argument")  # sample2 must be taken after sample1
        names = {getattr(pynvml, f"NVML_GPM_METRIC_{n}"): n for n in (gpu.gpm or {})}
        for i in range(metrics_get.numMetrics):
            metric = metrics_get.metrics[i]
            script = (gpu.gpm or {}).get(names.get(metric.metricId, ""))
            if script is None:
                metric.nvmlReturn, metric.value = pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                mean = (integrate(script, end) - integrate(script, start)) / (end - start)
                metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, float(mean)
        return metrics_get

    @staticmethod
    def _gpm_address(sample: Any) -> int:
        try:
            return int(ctypes.cast(sample, ctypes.c_void_p).value or 0)
        except (ctypes.ArgumentError, TypeError):
            raise nvml_error("invalid_argument") from None

    def _store_gpm_sample(self, sample: Any, handle: FakeHandle, gpu: FakeGpu) -> None:
        address = self._gpm_address(sample)
        with self._lock:
            if address not in self._gpm_samples:
                raise nvml_error("invalid_argument")
            self._gpm_samples[address] = (handle, gpu, self.clock())

    # ---------------------------------------------------------------- internals
    def _value(self, script: Script) -> Any:
        return evaluate(script, self.clock())

    def _alive(self, handle: FakeHandle, function: str) -> FakeHandle:
        if not isinstance(handle, FakeHandle):
            raise nvml_error("invalid_argument")
        root = handle.parent or handle
        lost_at = root.gpu.lost_at if root.gpu.lost_at is not None else handle.gpu.lost_at
        if lost_at is not None and self.clock() >= lost_at:
            raise nvml_error("gpu_is_lost")
        return handle

    def _read(self, handle: FakeHandle, function: str) -> FakeGpu:
        """Check liveness and scripted failures, then give the GPU whose state to read."""
        self._alive(handle, function)
        gpu = handle.gpu
        metric = FUNCTION_METRIC.get(function, "")
        now = self.clock()
        for key in (function, metric):
            failure = gpu.failures.get(key)
            if failure is not None and now >= failure.start:
                raise nvml_error(failure.error)
        if handle.parent is not None and metric in MIG_UNSUPPORTED:
            raise nvml_error("not_supported")
        return gpu


def _gpu_from_dict(spec: Any, where: str) -> FakeGpu:
    if not isinstance(spec, dict):
        raise ValueError(f"fake NVML scenario: {where} is {spec!r}; give a JSON object")
    known = {f for f in FakeGpu.__dataclass_fields__}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(
            f"fake NVML scenario: {where} has unknown keys {sorted(unknown)}; "
            f"accepted: {sorted(known)}"
        )
    spec = dict(spec)
    if "mig" in spec:
        spec["mig"] = [_gpu_from_dict(m, f"{where}.mig[{i}]") for i, m in enumerate(spec["mig"])]
    return FakeGpu(**spec)


_PRESET_GPM: dict[str, Script] = {
    "SM_UTIL": [(0, 15), (1, 60)],
    "SM_OCCUPANCY": [(0, 5), (1, 25)],
    "ANY_TENSOR_UTIL": [(0, 0), (1, 20)],
    "DRAM_BW_UTIL": [(0, 5), (1, 35)],
    "FP32_UTIL": [(0, 5), (1, 10)],
}


def preset() -> FakeNvml:
    """Two busy H100-like GPUs with this process on each: the default for CLI demos and tests."""
    return FakeNvml(
        [
            FakeGpu(
                memory_used=[(0, 2 * GIB), (1, 20 * GIB)],
                util_gpu=[(0, 20), (1, 85)],
                util_memory=[(0, 5), (1, 40)],
                temperature=[(0, 40), (1, 62)],
                power_mw=[(0, 90_000), (1, 450_000)],
                processes=[FakeProcess(SELF_PID, 2 * GIB)],
                gpm=dict(_PRESET_GPM),
            ),
            FakeGpu(
                memory_used=[(0, 2 * GIB), (1, 18 * GIB)],
                util_gpu=[(0, 20), (1, 70)],
                util_memory=[(0, 5), (1, 35)],
                temperature=[(0, 41), (1, 58)],
                power_mw=[(0, 88_000), (1, 380_000)],
                processes=[FakeProcess(SELF_PID, 2 * GIB)],
                gpm=dict(_PRESET_GPM),
            ),
        ]
    )


def load_scenario(text: str) -> FakeNvml:
    """Build a fake from inline JSON, a path to a JSON file, or (empty) the preset."""
    text = text.strip()
    if not text:
        return preset()
    if not text.startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(
                f"{SCENARIO_ENV}={text!r} is neither inline JSON (starting with '{{') "
                "nor the path of a JSON file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{SCENARIO_ENV}={str(path)!r} cannot be read ({err})") from err
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{SCENARIO_ENV}: invalid JSON ({err})") from err
    return FakeNvml.from_dict(spec)


def create() -> FakeNvml:
    """Factory for ``RUNKIT_NVML_BACKEND=runkit.testing.fake_nvml:create``."""
    return load_scenario(os.environ.get(SCENARIO_ENV, ""))
