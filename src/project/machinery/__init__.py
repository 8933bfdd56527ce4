"""The template's machinery: everything a run needs that is not the user's model, data or flow.

Grouped by job, one job per file; nothing here imports ``project.models``, ``project.data`` or
the entry points (the user's code arrives through ``_target_`` in the configs). Import-light:
no subpackage pulls in torch or Lightning at import time, so ``--help`` stays instant.

=============  ==================================================================================
gpus/          NVML access, the GPU inventory, ``CUDA_VISIBLE_DEVICES`` rules, device resolution,
               the listing CLI
gpu_stats/     per-epoch GPU statistics: sampling, statistics, the callback, the run summary
safety/        crash-safe checkpoint I/O and loading, exact resume, interrupts, the finite-loss
               guard, the checkpoint callback
run/           the Hydra entry, preflight checks, builders, run files, sweep/DDP launch
speed.py       the GPU speed switches (TF32, precision=auto, compile, channels-last)
plots.py       ``curves.png`` and ``python -m project.plot``
quoting.py     what the program prints for the user to paste, quoted for the shell and Hydra
strategies/    ``trainer.strategy=dp``
testing/       the fake NVML used by tests, benchmarks and CPU demos
compat.py      every access to a private Lightning/torch/OmegaConf/Hydra API, each with a test
=============  ==================================================================================
"""
