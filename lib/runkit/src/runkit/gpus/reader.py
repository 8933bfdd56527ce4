"""The one reader of an NVML device, for the listing and the statistics alike.

Why: each quantity is read one way everywhere (units, MIG, old drivers). Methods return NVML's
units and raise ``NVMLError`` on refusal. On a MIG slice memory, utilisation and processes are the
slice's; the rest is the whole GPU's, read through :attr:`DeviceReader.board`.
"""

from __future__ import annotations

from typing import Any

from runkit.gpus import nvml


class DeviceReader:
    """Reads one NVML device; ``board`` is its physical GPU's handle (itself unless a MIG slice)."""

    def __init__(self, lib: Any, handle: Any, board: Any | None = None) -> None:
        self.lib = lib
        self.handle = handle
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

    def name(self) -> str:
        return nvml.as_text(self.lib.nvmlDeviceGetName(self.handle))

    def uuid(self) -> str:
        return nvml.as_text(self.lib.nvmlDeviceGetUUID(self.handle))

    def index(self) -> int:
        return int(self.lib.nvmlDeviceGetIndex(self.board))

    def pci_bus_id(self) -> str:
        return nvml.as_text(self.lib.nvmlDeviceGetPciInfo(self.board).busId)

    def mig_enabled(self) -> bool:
        mode = self.lib.nvmlDeviceGetMigMode(self.board)
        return bool(mode) and mode[0] == getattr(self.lib, "NVML_DEVICE_MIG_ENABLE", 1)

    def mig_slices(self) -> list[tuple[int, DeviceReader]]:
        slices = []
        for slot in range(
            nvml.optional(self.lib, "nvmlDeviceGetMaxMigDeviceCount", self.board) or 0
        ):
            child = nvml.optional(self.lib, "nvmlDeviceGetMigDeviceHandleByIndex", self.board, slot)
            if child is not None:  # an empty slot: NVML says NOT_FOUND
                slices.append((slot, DeviceReader(self.lib, child, self.board)))
        return slices

    def gpu_instance_id(self) -> int:
        return int(self.lib.nvmlDeviceGetGpuInstanceId(self.handle))

    def compute_instance_id(self) -> int:
        return int(self.lib.nvmlDeviceGetComputeInstanceId(self.handle))

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

    def temperature_c(self) -> int:
        return int(self.lib.nvmlDeviceGetTemperature(self.board, self.lib.NVML_TEMPERATURE_GPU))

    def power_mw(self) -> float:
        return float(self.lib.nvmlDeviceGetPowerUsage(self.board))

    def power_limit_mw(self) -> float:
        return float(self.lib.nvmlDeviceGetEnforcedPowerLimit(self.board))

    def sm_clock_mhz(self) -> float:
        return float(self.lib.nvmlDeviceGetClockInfo(self.board, self.lib.NVML_CLOCK_SM))

    def clock_event_reasons(self) -> int:
        """Why the clocks are held back, a bit mask (nvmlClocksEventReason*)."""
        if self._clock_events is None:
            try:  # the newer name; drivers before 535 only have the "throttle" one
                reasons = self.lib.nvmlDeviceGetCurrentClocksEventReasons(self.board)
                self._clock_events = self.lib.nvmlDeviceGetCurrentClocksEventReasons
                return int(reasons)
            except (*nvml.error_classes(self.lib, nvml.UNSUPPORTED_ERRORS), AttributeError):
                self._clock_events = self.lib.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(self._clock_events(self.board))

    def energy_mj(self) -> float:
        return float(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.board))

    def fan_pct(self) -> float:
        return float(self.lib.nvmlDeviceGetFanSpeed(self.board))

    def pcie_kbs(self) -> tuple[float, float]:
        lib = self.lib
        return (
            float(lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_TX_BYTES)),
            float(lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_RX_BYTES)),
        )

    def ecc_uncorrected(self) -> float:
        lib = self.lib
        return float(
            lib.nvmlDeviceGetTotalEccErrors(
                self.board, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
            )
        )

    def memory_temperature_c(self) -> float:
        lib = self.lib
        (value,) = lib.nvmlDeviceGetFieldValues(self.board, [lib.NVML_FI_DEV_MEMORY_TEMP])
        if value.nvmlReturn != lib.NVML_SUCCESS:
            raise lib.NVMLError(value.nvmlReturn)
        kind = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal")[min(value.valueType, 5)]
        return float(getattr(value.value, kind))
