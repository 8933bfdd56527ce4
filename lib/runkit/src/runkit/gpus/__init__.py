"""GPUs, one job per module.

=============  ==================================================================================
nvml.py        the one door to NVML: session, backend switch, safe queries, the UUID spelling
reader.py      the one reader of an NVML device (identity and figures), for the listing and the
               statistics alike
records.py     the data: ``Gpu``, ``GpuProcess``, ``TorchCuda``, ``Inventory``
inventory.py   the GPUs of this machine and which ``cuda:N`` each is; NVML read once per job
visible.py     CUDA's ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` rules, MIG by driver version
resolve.py     ``accelerator``/``devices``/``select_gpus`` → what the Trainer gets
claims.py      ``least_used`` on a shared machine: thresholds, waiting, a lock per GPU
listing.py     ``python -m runkit.devices [--json] [--watch [SECONDS]]``
=============  ==================================================================================
"""
