"""A scriptable stand-in for ``pynvml`` (its names, constants and own error classes), so the code
under test runs unchanged on a CPU: behind :func:`runkit.gpus.nvml.use_library`, or in a subprocess
with ``RUNKIT_NVML_BACKEND=runkit.testing.fake_nvml:create`` and a JSON scenario in
``RUNKIT_FAKE_NVML`` (schema: lib/runkit/docs/fake-nvml.md)."""

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pynvml

SCENARIO_ENV = "RUNKIT_FAKE_NVML"
SELF_PID = "self"
GIB = 1024**3
MAX_MIG_DEVICES = 7
Script = Any  # number | sequence of (t, value) steps | callable(t) -> number


def nvml_error(name: str) -> pynvml.NVMLError:
    code = getattr(pynvml, f"NVML_ERROR_{name.upper()}", None)
    if not isinstance(code, int):
        known = sorted(n[11:].lower() for n in dir(pynvml) if n.startswith("NVML_ERROR_"))
        raise ValueError(f"unknown NVML error name {name!r}; accepted: {', '.join(known)}")
    return pynvml.NVMLError(code)


@dataclass
class FakeClock:
    """A clock the test moves by hand (forward only): ``clock.advance(2.5)``; call it to read."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.set(self.now + seconds)
        return self.now

    def set(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"FakeClock: time only moves forward ({self.now} -> {t})")
        self.now = float(t)


def _check_script(value: Script, what: str) -> Script:
    if not isinstance(value, (list, tuple)):
        return value
    steps = [(float(t), v) for t, v in value]
    if not steps or any(b[0] < a[0] for a, b in itertools.pairwise(steps)):
        raise ValueError(f"{what}: steps {value!r} are empty or not sorted by time")
    return steps


def evaluate(script: Script, t: float) -> Any:
    if callable(script):
        return script(t)
    if isinstance(script, list):
        return script[max(bisect.bisect_right([s[0] for s in script], t) - 1, 0)][1]
    return script


def integrate(script: Script, t: float) -> float:
    if t <= 0:
        return 0.0
    if isinstance(script, list):
        edges = [0.0, *(min(max(s, 0.0), t) for s, _ in script[1:]), t]
        return sum(v * (b - a) for (_, v), a, b in zip(script, edges, edges[1:], strict=False))
    if not callable(script):
        return float(script) * t
    n = max(1, min(10_000, int(t / 0.01)))
    return sum(script(i * t / n) + script((i + 1) * t / n) for i in range(n)) * t / n / 2


@dataclass
class FakeProcess:
    """A process holding memory on a GPU; ``pid="self"`` means the fake's maker."""

    pid: int | str = SELF_PID
    used_memory: Script = GIB

    def __post_init__(self) -> None:
        self.used_memory = _check_script(self.used_memory, "process used_memory")


@dataclass(eq=False)
class FakeGpu:
    """One GPU (or one MIG slice when it sits in a parent's ``mig`` list) and its scripted state;
    also its own opaque NVML handle (``parent``: the GPU of a MIG slice)."""

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
    failures: dict[str, Any] = field(default_factory=dict)  # metric -> (error, from time)
    lost_at: float | None = None
    gpm: dict[str, Script] | None = None
    index: int = field(default=0, init=False, repr=False)
    parent: FakeGpu | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for attr in (f.name for f in fields(self) if f.type == "Script"):
            setattr(self, attr, _check_script(getattr(self, attr), f"{self.name}: {attr}"))
        self.processes = [
            p if isinstance(p, FakeProcess) else FakeProcess(**p) for p in self.processes
        ]
        self.mig = [m if isinstance(m, FakeGpu) else FakeGpu(**m) for m in self.mig]
        self.mig_capable = bool(self.mig) if self.mig_capable is None else self.mig_capable
        if self.gpm is not None:  # by pynvml's NVML_GPM_METRIC_* names without the prefix
            self.gpm = {m: _check_script(s, f"{self.name}: gpm {m}") for m, s in self.gpm.items()}
        failures, self.failures = self.failures, {}
        for metric, spec in failures.items():
            spec = {"error": spec} if isinstance(spec, str) else spec
            self.fail(metric, spec["error"], spec.get("from", float("-inf")))

    def fail(self, metric: str, error: str, start: float = float("-inf")) -> FakeGpu:
        """Make ``metric`` (or one pynvml function) raise ``error`` from time ``start`` on."""
        if metric not in METRICS and metric not in FUNCTION_METRIC:
            raise ValueError(
                f"unknown metric {metric!r} for a failure; accepted: {', '.join(sorted(METRICS))} "
                "or a pynvml function name"
            )
        nvml_error(error)
        self.failures[metric] = (error, float(start))
        return self

    def heal(self, metric: str) -> None:
        self.failures.pop(metric, None)

    def lose(self, at: float) -> FakeGpu:
        """From time ``at`` on every call on this GPU raises ``NVMLError_GpuIsLost``."""
        self.lost_at = float(at)
        return self


def _field(fake: FakeNvml, gpu: FakeGpu, ids: list[int]) -> list[NS]:
    supported = gpu.memory_temperature is not None
    return [
        NS(valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, value=NS(uiVal=int(fake.value(gpu.memory_temperature)) if ok else 0),
           nvmlReturn=pynvml.NVML_SUCCESS if ok else pynvml.NVML_ERROR_NOT_SUPPORTED)
        for ok in (supported and i == pynvml.NVML_FI_DEV_MEMORY_TEMP for i in ids)
    ]  # fmt: skip


def _processes(fake: FakeNvml, gpu: FakeGpu) -> list[NS]:
    whole = 0xFFFFFFFF  # NVML's "no instance": a process on the GPU itself
    owners = [(gpu, whole, whole), *((c, c.gpu_instance_id, c.compute_instance_id) for c in gpu.mig)]  # fmt: skip
    return [
        NS(pid=fake.owner_pid if p.pid == SELF_PID else p.pid, gpuInstanceId=gi,
           usedGpuMemory=int(fake.value(p.used_memory)), computeInstanceId=ci)
        for owner, gi, ci in owners for p in owner.processes
    ]  # fmt: skip


def _mig_slice(gpu: FakeGpu, index: int) -> FakeGpu:
    if not 0 <= index < len(gpu.mig):
        raise nvml_error("not_found")
    return gpu.mig[index]


def _gpm_support(gpu: FakeGpu) -> Any:
    support = pynvml.c_nvmlGpmSupport_t()
    support.version = pynvml.NVML_GPM_SUPPORT_VERSION
    support.isSupportedDevice = int(any(g.gpm is not None for g in (gpu, *gpu.mig)))
    return support


def _mig_gpm(fake: FakeNvml, gpu: FakeGpu, instance: int, sample: Any) -> Any:
    child = next((c for c in gpu.mig if c.gpu_instance_id == instance), None)
    if gpu.parent is not None or child is None:
        raise nvml_error("invalid_argument")  # the physical GPU's handle is wanted
    return fake.gpm_sample(sample, gpu, child)


_TEMP, _SM = pynvml.NVML_TEMPERATURE_GPU, pynvml.NVML_CLOCK_SM
_TX, _RX = pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES
_ON, _OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
# The handle-taking functions (``nvmlDeviceGet`` + key unless named in full): the metric whose
# scripted failure fails it, what it refuses ("slice": NotSupported on a MIG slice, as real ones
# answer; "mig": also on a GPU that is not MIG-capable; "gpu": InvalidArgument on a physical GPU)
# and the answer: ``f(fake, gpu, *args)``, or the FakeGpu figure it reads (by the call's first
# argument where a dict: one not in it is InvalidArgument; a figure of None: NotSupported).
_DEVICE: dict[str, tuple[str, str, Any]] = {
    "Name": ("name", "", lambda f, g: g.name),
    "UUID": ("uuid", "", lambda f, g: str(g.uuid)),
    "Index": ("index", "slice", lambda f, g: g.index),
    "PciInfo": ("pci", "", lambda f, g: NS(busId=str(g.pci_bus_id).encode())),  # bytes
    "MemoryInfo": ("memory", "", lambda f, g: NS(total=g.memory_total, used=(u := int(f.value(g.memory_used))), free=g.memory_total - u)),
    "UtilizationRates": ("utilization", "slice", lambda f, g: NS(gpu=int(f.value(g.util_gpu)), memory=int(f.value(g.util_memory)))),
    "Temperature": ("temperature", "slice", {_TEMP: "temperature"}),
    "FieldValues": ("memory_temperature", "", _field),
    "PowerUsage": ("power", "slice", "power_mw"),
    "EnforcedPowerLimit": ("power_limit", "slice", "power_limit_mw"),
    # the energy counter: scripted, or the integral of power
    "TotalEnergyConsumption": ("energy", "slice", lambda f, g: int(f.value(g.energy_mj)) if g.energy_mj is not None else int(5_000_000 + integrate(g.power_mw, f.clock()))),
    "ClockInfo": ("clock", "slice", {_SM: "clock_sm_mhz"}),
    "CurrentClocksEventReasons": ("throttle", "slice", "clocks_event_reasons"),
    "CurrentClocksThrottleReasons": ("throttle", "slice", "clocks_event_reasons"),
    "FanSpeed": ("fan", "slice", "fan_pct"),
    "PcieThroughput": ("pcie", "slice", {_TX: "pcie_tx_kbs", _RX: "pcie_rx_kbs"}),
    "TotalEccErrors": ("ecc", "slice", "ecc_uncorrected"),
    "ComputeRunningProcesses": ("processes", "", _processes),
    "MigMode": ("mig", "mig", lambda f, g: [_ON if g.mig else _OFF] * 2),
    "MaxMigDeviceCount": ("mig", "mig", lambda f, g: MAX_MIG_DEVICES if g.mig else 0),
    "MigDeviceHandleByIndex": ("mig", "mig", lambda f, g, i: _mig_slice(g, i)),
    "GpuInstanceId": ("mig", "gpu", lambda f, g: int(g.gpu_instance_id)),
    "ComputeInstanceId": ("mig", "gpu", lambda f, g: g.compute_instance_id),
    "nvmlDeviceIsMigDeviceHandle": ("", "", lambda f, g: int(g.parent is not None)),
    "DeviceHandleFromMigDeviceHandle": ("", "gpu", lambda f, g: g.parent),
    "nvmlGpmQueryDeviceSupport": ("gpm", "slice", lambda f, g: _gpm_support(g)),
    "nvmlGpmSampleGet": ("gpm", "slice", lambda f, g, s: f.gpm_sample(s, g, g)),
    "nvmlGpmMigSampleGet": ("gpm", "", _mig_gpm),
}  # fmt: skip
FUNCTION_METRIC = {
    (k if k.startswith("nvml") else f"nvmlDeviceGet{k}"): m for k, (m, *_) in _DEVICE.items() if m
}
FUNCTION_METRIC["nvmlGpmMetricsGet"] = "gpm"
METRICS = frozenset(FUNCTION_METRIC.values())


class FakeNvml:
    """The pynvml look-alike; test hooks: ``init_count``, ``shutdown_count``, ``balanced``,
    ``calls``, ``calls_in_thread``, ``gpm_samples_live``."""

    NVMLError = pynvml.NVMLError

    def __init__(
        self,
        gpus: Iterable[FakeGpu | dict[str, Any]] | int = 2,
        *,
        clock: Callable[[], float] | None = None,
        call_cost_s: float = 0.0,
        init_error: str | None = None,
        driver_version: str = "570.133.20",
    ) -> None:
        gpus = [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else gpus
        self.gpus = [g if isinstance(g, FakeGpu) else FakeGpu(**g) for g in gpus]
        start = time.monotonic()  # scripted times count from the fake's creation
        self.clock: Callable[[], float] = clock or (lambda: time.monotonic() - start)
        self.owner_pid = os.getpid()  # "self" in a process list
        self.call_cost_s = float(call_cost_s)
        if init_error is not None:
            nvml_error(init_error)  # a bad name fails here
        self.init_error, self.driver_version = init_error, driver_version
        self.init_count = self.shutdown_count = self._depth = self._gpm_next = 0
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self._thread_calls: Counter[int] = Counter()
        self._gpm_samples: dict[int, tuple[FakeGpu, FakeGpu, float] | None] = {}
        self._by_uuid: dict[str, FakeGpu] = {}
        for i, g in enumerate(self.gpus):
            g.uuid = f"GPU-{i:08x}-fa6e-4000-8000-{i:012x}" if g.uuid is None else g.uuid
            g.pci_bus_id, g.index = g.pci_bus_id or f"00000000:{0x17 + 0x10 * i:02X}:00.0", i
            self._by_uuid[g.uuid] = g
            for j, child in enumerate(g.mig):
                if child.uuid is None:
                    child.uuid = f"MIG-{i:08x}-fa6e-4000-8000-{(j + 1) << 16 | i:012x}"
                child.pci_bus_id, child.index, child.parent = g.pci_bus_id, j, g
                child.name = f"{g.name} MIG 1g.10gb" if child.name == FakeGpu.name else child.name
                if child.gpu_instance_id is None:
                    child.gpu_instance_id = j + 1
                self._by_uuid[child.uuid] = child

    @property
    def balanced(self) -> bool:
        return self.init_count == self.shutdown_count

    @property
    def initialised(self) -> bool:
        return self._depth > 0

    @property
    def gpm_samples_live(self) -> int:
        return len(self._gpm_samples)

    def calls_in_thread(self, ident: int | None = None) -> int:
        return self._thread_calls[threading.get_ident() if ident is None else ident]

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def value(self, script: Script) -> Any:
        return evaluate(script, self.clock())

    def _enter(self, name: str, charge: bool = True) -> None:
        """Count the call; ``charge``: its cost, and refused before nvmlInit."""
        with self._lock:
            self.calls[name] += 1
            self._thread_calls[threading.get_ident()] += 1
        if charge and self.call_cost_s:
            time.sleep(self.call_cost_s)
        if charge and self._depth <= 0:
            raise nvml_error("uninitialized")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and (key := name.removeprefix("nvmlDeviceGet")) in _DEVICE:
            return functools.partial(self._device, name, *_DEVICE[key])
        if (value := getattr(pynvml, name, None)) is None:
            raise AttributeError(f"FakeNvml has no attribute {name!r} (nor has pynvml)")
        if not name.startswith("nvml") or isinstance(value, type) or not callable(value):
            return value  # constants and error classes are pynvml's own

        def missing(*args: Any) -> Any:  # what an old driver does
            self._enter(name, charge=False)
            raise nvml_error("function_not_found")

        return missing

    def _device(
        self, name: str, metric: str, refuses: str, answer: Any, gpu: FakeGpu, *args: Any
    ) -> Any:
        self._enter(name)
        self._check(gpu, name, metric)
        slice_ = gpu.parent is not None
        if refuses == "gpu" and not slice_:
            raise nvml_error("invalid_argument")
        if (refuses in ("slice", "mig") and slice_) or (refuses == "mig" and not gpu.mig_capable):
            raise nvml_error("not_supported")
        if callable(answer):
            return answer(self, gpu, *args)
        figure = answer.get(args[0]) if isinstance(answer, dict) else answer
        if figure is None:
            raise nvml_error("invalid_argument")
        if getattr(gpu, figure) is None:
            raise nvml_error("not_supported")
        return int(self.value(getattr(gpu, figure)))

    def _check(self, gpu: FakeGpu | None, *failing: str) -> FakeGpu:
        """``gpu`` as a live handle, none of ``failing`` (a function, its metric) scripted to fail."""
        if not isinstance(gpu, FakeGpu):
            raise nvml_error("invalid_argument")
        lost, now = (gpu.parent or gpu).lost_at, self.clock()
        lost = gpu.lost_at if lost is None else lost
        if lost is not None and now >= lost:
            raise nvml_error("gpu_is_lost")
        for key in failing:
            if (failure := gpu.failures.get(key)) is not None and now >= failure[1]:
                raise nvml_error(failure[0])
        return gpu

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", charge=False)
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        with self._lock:
            self._depth += 1
            self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown", charge=False)
        with self._lock:
            if self._depth <= 0:
                raise nvml_error("uninitialized")
            self._depth -= 1
            self.shutdown_count += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByIndex")
        valid = isinstance(index, int) and 0 <= index < len(self.gpus)
        return self._check(self.gpus[index] if valid else None)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByUUID")
        gpu = self._by_uuid.get(uuid.decode() if isinstance(uuid, bytes) else uuid)
        if gpu is None:
            raise nvml_error("not_found")
        return self._check(gpu)

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        with self._lock:  # an opaque pointer, as NVML's: the sample stays behind its address
            self._gpm_next += 64
            self._gpm_samples[self._gpm_next] = None
            return ctypes.cast(ctypes.c_void_p(self._gpm_next), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._enter("nvmlGpmSampleFree")
        with self._lock:
            if self._gpm_samples.pop(_address(sample), False) is False:
                raise nvml_error("invalid_argument")

    def gpm_sample(self, sample: Any, handle: FakeGpu, gpu: FakeGpu) -> Any:
        if gpu.gpm is None:
            raise nvml_error("not_supported")
        with self._lock:
            if _address(sample) not in self._gpm_samples:
                raise nvml_error("invalid_argument")
            self._gpm_samples[_address(sample)] = (handle, gpu, self.clock())
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        """Each metric: its script's mean between the two samples' times."""
        self._enter("nvmlGpmMetricsGet")
        first = self._gpm_samples.get(_address(request.sample1))
        second = self._gpm_samples.get(_address(request.sample2))
        if first is None or second is None or first[1] is not second[1] or second[2] <= first[2]:
            raise nvml_error("invalid_argument")  # sample2: the same device, taken later
        self._check(first[0], "nvmlGpmMetricsGet", "gpm")
        (_, gpu, start), end = first, second[2]
        scripts = {getattr(pynvml, f"NVML_GPM_METRIC_{n}"): s for n, s in (gpu.gpm or {}).items()}
        for metric in request.metrics[: request.numMetrics]:
            if (script := scripts.get(metric.metricId)) is None:
                metric.nvmlReturn, metric.value = pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                mean = (integrate(script, end) - integrate(script, start)) / (end - start)
                metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, float(mean)
        return request


def _address(sample: Any) -> int:
    return int(ctypes.cast(sample, ctypes.c_void_p).value or 0)


def preset() -> FakeNvml:
    """Two busy H100-like GPUs with this process on each: the default for CLI demos and tests."""
    gpm = {"SM_UTIL": [(0, 15), (1, 60)], "SM_OCCUPANCY": [(0, 5), (1, 25)]}
    gpm |= {"ANY_TENSOR_UTIL": [(0, 0), (1, 20)], "DRAM_BW_UTIL": [(0, 5), (1, 35)]}
    gpm |= {"FP32_UTIL": [(0, 5), (1, 10)]}
    return FakeNvml(
        FakeGpu(memory_used=[(0, 2 * GIB), (1, used * GIB)], util_gpu=[(0, 20), (1, util)],
                util_memory=[(0, 5), (1, mem)], temperature=[(0, t0), (1, t1)],
                power_mw=[(0, p0), (1, p1)], processes=[FakeProcess(SELF_PID, 2 * GIB)],
                gpm=dict(gpm))
        for used, util, mem, t0, t1, p0, p1 in (
            (20, 85, 40, 40, 62, 90_000, 450_000), (18, 70, 35, 41, 58, 88_000, 380_000)
        )
    )  # fmt: skip


def create(text: str | None = None) -> FakeNvml:
    """A fake from inline JSON, a JSON file's path or (empty) the preset; by default
    ``$RUNKIT_FAKE_NVML``: ``RUNKIT_NVML_BACKEND=runkit.testing.fake_nvml:create``."""
    if not (text := (os.environ.get(SCENARIO_ENV, "") if text is None else text).strip()):
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
        return FakeNvml(**spec)
    except json.JSONDecodeError as err:
        raise ValueError(f"{SCENARIO_ENV}: invalid JSON ({err})") from err
    except (TypeError, AttributeError, KeyError) as err:  # an unknown key, a wrong type
        raise ValueError(f"fake NVML scenario {spec!r} is invalid ({err})") from None
