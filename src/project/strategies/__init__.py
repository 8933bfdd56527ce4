"""Training strategies the Trainer finds by name (``trainer.strategy=...``)."""
