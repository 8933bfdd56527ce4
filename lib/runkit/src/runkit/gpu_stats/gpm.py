"""GPM (GPU Performance Monitoring, Hopper and newer): what the SMs did, not only *whether* they ran.
Two samples of the counters, swapped at every reading, give the interval since the last; a
profiler holding the counters pauses GPM (one log line); only ``GpuIsLost`` is passed on."""

from __future__ import annotations

import logging
import math
from typing import Any

from runkit.gpus import nvml

log = logging.getLogger(__name__)

# Logged metric -> pynvml's metric id constant; all are percentages (0-100).
GPM_METRICS = {
    "sm_active": "NVML_GPM_METRIC_SM_UTIL",
    "sm_occupancy": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "tensor_active": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "dram_active": "NVML_GPM_METRIC_DRAM_BW_UTIL",
    "fp16_active": "NVML_GPM_METRIC_FP16_UTIL",
    "fp32_active": "NVML_GPM_METRIC_FP32_UTIL",
    "fp64_active": "NVML_GPM_METRIC_FP64_UTIL",
}


class GpmUnsupported(Exception):
    """This GPU (or driver, or binding) has no GPM: the metrics are left out, never zero."""


class GpmCounters:
    """GPM metrics of one device through its physical GPU ``board`` (a MIG slice's through its
    GPU instance ``gpu_instance_id``); :meth:`close` frees the samples on every path."""

    def __init__(self, lib: Any, board: Any, label: str, gpu_instance_id: int | None) -> None:
        self.lib, self.board, self.label, self.gpu_instance_id = lib, board, label, gpu_instance_id
        self._samples: list[Any] = []
        self._have_previous = self._paused = False
        self._names: list[str] = []
        self._request: Any = None

    def open(self) -> None:
        """Allocate the two samples and take the first; :class:`GpmUnsupported` without GPM."""
        lib = self.lib
        try:
            support = lib.nvmlGpmQueryDeviceSupport(self.board)
        except (*nvml.error_classes(lib, nvml.UNSUPPORTED_ERRORS), AttributeError) as err:
            raise GpmUnsupported(type(err).__name__.replace("NVMLError_", "")) from err
        if not getattr(support, "isSupportedDevice", 0):
            raise GpmUnsupported("NotSupported")
        ids = {name: getattr(lib, const, None) for name, const in GPM_METRICS.items()}
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
        """The metrics since the previous call (empty the first time, or while GPM is refused)."""
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
        """Free the samples (safe to call again, and after a failed :meth:`open`)."""
        samples, self._samples, self._have_previous = self._samples, [], False
        for sample in samples:
            try:
                self.lib.nvmlGpmSampleFree(sample)
            except self.lib.NVMLError as err:
                log.debug("gpu_stats: %s: freeing a GPM sample failed: %s", self.label, err)
