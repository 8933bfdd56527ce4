"""LightningModules and DataModules written as Lightning users write them, not as the template does.

The machinery's tests drop this package into a run's working directory (as a user drops their
code into their project) and train, test, evaluate, export, resume, run DDP and signal them
through the real CLI. None of them has a ``net`` attribute or is a classifier, and each one
logs with ``sync_dist=True``:

* :class:`RegressionModule`: tuple batches, ``on_step`` and ``on_epoch`` logging in every stage,
  slash and underscore keys, ReduceLROnPlateau with a monitor.
* :class:`TwoOptimizerModule`: manual optimisation with two optimisers and no scheduler, dict
  batches, a ``forward`` that returns a dict.
* :class:`LazyModule`: layers built in ``configure_model``, batches as a dataclass.
* :class:`PointsData`: a plain ``LightningDataModule`` giving any of those batch kinds.
"""
