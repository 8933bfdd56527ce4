"""Users' own LightningModules and DataModules, none a classifier, each logging with sync_dist.

Regression (tuple batches, plateau scheduler), TwoOptimizer (manual optimisation, dict batches),
Lazy (``configure_model``, dataclass batches), Head (``net`` plus a head built in ``setup()``),
TwoLoaders (two validation loaders, no ``test_step``), NoValidation (no ``validation_step``).
"""
