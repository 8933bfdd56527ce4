"""Run safety: crash-safe checkpoints, safe loading, exact resume, interrupts, finite loss."""
