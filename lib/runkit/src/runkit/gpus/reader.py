"""The one reader of an NVML device, for the listing and the statistics alike, in NVML's units.
On a MIG slice memory, utilisation and processes are the slice's; the rest is its GPU's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runkit.gpus import nvml


def _query(func: str, cast: Callable[[Any], Any] = float, *consts: str, board: bool = True) -> Any:

    def read(self: DeviceReader) -> Any:
        lib = self.lib
        args = (getattr(lib, c) for c in consts)
        return cast(getattr(lib, func)(self.board if board else self.handle, *args))

    return read


class DeviceReader:
    """Reads one NVML device; ``board`` is its physical GPU's handle (itself unless a MIG slice)."""

    def __init__(self, lib: Any, handle: Any, board: Any | None = None) -> None:
        self.lib, self.handle = lib, handle
        self.board = handle if board is None else board
        self._clock_events: Any = None

    @classmethod
    def open(cls, lib: Any, handle: Any) -> DeviceReader:
        if nvml.optional(lib, "nvmlDeviceIsMigDeviceHandle", handle):
            return cls(lib, handle, lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle))
        return cls(lib, handle)

    @property
    def is_mig(self) -> bool:
        return self.board is not self.handle

    name = _query("nvmlDeviceGetName", nvml.as_text, board=False)
    uuid = _query("nvmlDeviceGetUUID", nvml.as_text, board=False)
    index = _query("nvmlDeviceGetIndex", int)
    gpu_instance_id = _query("nvmlDeviceGetGpuInstanceId", int, board=False)
    compute_instance_id = _query("nvmlDeviceGetComputeInstanceId", int, board=False)
    temperature_c = _query("nvmlDeviceGetTemperature", int, "NVML_TEMPERATURE_GPU")
    power_mw = _query("nvmlDeviceGetPowerUsage")
    power_limit_mw = _query("nvmlDeviceGetEnforcedPowerLimit")
    sm_clock_mhz = _query("nvmlDeviceGetClockInfo", float, "NVML_CLOCK_SM")
    energy_mj = _query("nvmlDeviceGetTotalEnergyConsumption")
    fan_pct = _query("nvmlDeviceGetFanSpeed")
    ecc_uncorrected = _query(
        "nvmlDeviceGetTotalEccErrors",
        float,
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
        "NVML_VOLATILE_ECC",
    )

    def pci_bus_id(self) -> str:
        return nvml.as_text(self.lib.nvmlDeviceGetPciInfo(self.board).busId)

    def mig_enabled(self) -> bool:
        mode = self.lib.nvmlDeviceGetMigMode(self.board)
        return bool(mode) and mode[0] == getattr(self.lib, "NVML_DEVICE_MIG_ENABLE", 1)

    def mig_slices(self) -> list[tuple[int, DeviceReader]]:
        lib, count = self.lib, nvml.optional(self.lib, "nvmlDeviceGetMaxMigDeviceCount", self.board)
        children = [
            (slot, nvml.optional(lib, "nvmlDeviceGetMigDeviceHandleByIndex", self.board, slot))
            for slot in range(count or 0)
        ]
        return [(slot, DeviceReader(lib, c, self.board)) for slot, c in children if c is not None]

    def memory(self) -> tuple[int, int, int]:
        info = self.lib.nvmlDeviceGetMemoryInfo(self.handle)
        return int(info.total), int(info.used), int(info.free)

    def utilization(self) -> tuple[int, int]:
        rates = self.lib.nvmlDeviceGetUtilizationRates(self.handle)
        return int(rates.gpu), int(rates.memory)

    def compute_processes(self, kind: str = "Compute") -> list[tuple[int, int | None]]:
        """``(pid, used bytes or None)`` of every process computing (or ``kind="Graphics"``)."""
        procs = getattr(self.lib, f"nvmlDeviceGet{kind}RunningProcesses")(self.handle)
        return [(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in procs]

    def clock_event_reasons(self) -> int:
        """Why the clocks are held back, a bit mask; drivers before 535 only say "throttle"."""
        if self._clock_events is None:
            try:
                reasons = self.lib.nvmlDeviceGetCurrentClocksEventReasons(self.board)
                self._clock_events = self.lib.nvmlDeviceGetCurrentClocksEventReasons
                return int(reasons)
            except (*nvml.error_classes(self.lib, nvml.UNSUPPORTED_ERRORS), AttributeError):
                self._clock_events = self.lib.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(self._clock_events(self.board))

    def pcie_kbs(self) -> tuple[float, float]:
        lib = self.lib
        return (
            float(lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_TX_BYTES)),
            float(lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_RX_BYTES)),
        )

    def memory_temperature_c(self) -> float:
        lib = self.lib
        (value,) = lib.nvmlDeviceGetFieldValues(self.board, [lib.NVML_FI_DEV_MEMORY_TEMP])
        if value.nvmlReturn != lib.NVML_SUCCESS:
            raise lib.NVMLError(value.nvmlReturn)
        kind = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal")[min(value.valueType, 5)]
        return float(getattr(value.value, kind))
