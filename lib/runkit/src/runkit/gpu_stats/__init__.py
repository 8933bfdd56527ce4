"""Per-epoch GPU statistics from NVML: sampling, statistics, the callback, the run summary."""
