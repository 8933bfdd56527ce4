"""The one reader of an NVML device (a GPU or a MIG slice): its identity and its figures.

The GPU listing (:mod:`runkit.gpus.inventory`) and the statistics sampler
(:mod:`runkit.gpu_stats.sampler`) both read devices through :class:`DeviceReader`, so
each quantity is read one way everywhere: the same units, MIG handling and old-driver fallbacks.

Each method makes the NVML calls for one quantity, returns it in NVML's own units and raises
pynvml's ``NVMLError`` when the device refuses; what a refusal means is the caller's business
(the listing shows "-", the statistics leave the metric out). On a MIG slice NVML reports memory,
utilisation and processes per slice, and the rest (temperature, power, clocks, ...) only for the
whole GPU: those methods read :attr:`DeviceReader.board`, the physical GPU's handle.
"""

from __future__ import annotations

from typing import Any

from runkit.gpus import nvml


class DeviceReader:
    """Reads one NVML device. ``board`` is the physical GPU's handle: ``handle`` itself, or the
    parent's for a MIG slice (see :meth:`open`, which finds it)."""

    def __init__(self, lib: Any, handle: Any, board: Any | None = None) -> None:
        self.lib = lib
        self.handle = handle
        self.board = handle if board is None else board
        self._clock_events: Any = None

    @classmethod
    def open(cls, lib: Any, handle: Any) -> DeviceReader:
        """A reader for ``handle``, asking NVML whether it is a MIG slice (and of which GPU)."""
        if nvml.optional(lib, "nvmlDeviceIsMigDeviceHandle", handle):
            return cls(lib, handle, lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle))
        return cls(lib, handle)

    @property
    def is_mig(self) -> bool:
        """True for a MIG slice."""
        return self.board is not self.handle

    # ---------------------------------------------------------------- identity
    def name(self) -> str:
        return nvml.as_text(self.lib.nvmlDeviceGetName(self.handle))

    def uuid(self) -> str:
        """NVML's UUID, with its ``GPU-`` or ``MIG-`` prefix."""
        return nvml.as_text(self.lib.nvmlDeviceGetUUID(self.handle))

    def index(self) -> int:
        """The physical GPU's NVML index (PCI bus order)."""
        return int(self.lib.nvmlDeviceGetIndex(self.board))

    def pci_bus_id(self) -> str:
        return nvml.as_text(self.lib.nvmlDeviceGetPciInfo(self.board).busId)

    def mig_enabled(self) -> bool:
        """Whether the GPU runs in MIG mode (CUDA then shows its slices instead of itself)."""
        mode = self.lib.nvmlDeviceGetMigMode(self.board)
        return bool(mode) and mode[0] == getattr(self.lib, "NVML_DEVICE_MIG_ENABLE", 1)

    def mig_slices(self) -> list[tuple[int, DeviceReader]]:
        """``(slot, reader)`` for every MIG slice of this GPU (empty slots are skipped)."""
        slices = []
        for slot in range(
            nvml.optional(self.lib, "nvmlDeviceGetMaxMigDeviceCount", self.board) or 0
        ):
            child = nvml.optional(self.lib, "nvmlDeviceGetMigDeviceHandleByIndex", self.board, slot)
            if child is not None:  # an empty slot: NVML says NOT_FOUND
                slices.append((slot, DeviceReader(self.lib, child, self.board)))
        return slices

    def gpu_instance_id(self) -> int:
        """A MIG slice's GPU instance id (the ``gi`` of the pre-R470 ``MIG-GPU-…/gi/ci``)."""
        return int(self.lib.nvmlDeviceGetGpuInstanceId(self.handle))

    def compute_instance_id(self) -> int:
        """A MIG slice's compute instance id (the ``ci`` of ``MIG-GPU-…/gi/ci``)."""
        return int(self.lib.nvmlDeviceGetComputeInstanceId(self.handle))

    # ---------------------------------------------------------------- per device (or slice)
    def memory(self) -> tuple[int, int, int]:
        """``(total, used, free)`` device memory in bytes."""
        info = self.lib.nvmlDeviceGetMemoryInfo(self.handle)
        return int(info.total), int(info.used), int(info.free)

    def utilization(self) -> tuple[int, int]:
        """``(gpu, memory)``: percent of time the GPU computed, and its memory was read/written."""
        rates = self.lib.nvmlDeviceGetUtilizationRates(self.handle)
        return int(rates.gpu), int(rates.memory)

    def compute_processes(self) -> list[tuple[int, int | None]]:
        """``(pid, used bytes or None)`` of every process computing on the device."""
        procs = self.lib.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return [(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in procs]

    def graphics_processes(self) -> list[tuple[int, int | None]]:
        """``(pid, used bytes or None)`` of every graphics process on the device."""
        procs = self.lib.nvmlDeviceGetGraphicsRunningProcesses(self.handle)
        return [(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in procs]

    # ---------------------------------------------------------------- whole GPU (board)
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
        """The GPU's total-energy counter in millijoules (since the driver loaded)."""
        return float(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.board))

    def fan_pct(self) -> float:
        return float(self.lib.nvmlDeviceGetFanSpeed(self.board))

    def pcie_kbs(self) -> tuple[float, float]:
        """``(sent, received)`` PCIe throughput in KB/s."""
        lib = self.lib
        return (
            float(lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_TX_BYTES)),
            float(lib.nvmlDeviceGetPcieThroughput(self.board, lib.NVML_PCIE_UTIL_RX_BYTES)),
        )

    def ecc_uncorrected(self) -> float:
        """Uncorrected ECC errors since the driver loaded."""
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
