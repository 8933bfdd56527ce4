"""GPUs: one NVML access layer, the inventory, CUDA numbering, resolution, the listing."""
