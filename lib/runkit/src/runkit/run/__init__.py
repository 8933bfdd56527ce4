"""The run itself: the Hydra entry, preflight checks, builders, run files, sweep/DDP launch."""
