"""GPUs: NVML's one door (``nvml``, ``reader``), the inventory as ``cuda:N`` and CUDA's rules
(``inventory``), what the Trainer gets (``resolve``), ``least_used`` claims (``claims``) and
``python -m runkit.devices`` (``listing``)."""
