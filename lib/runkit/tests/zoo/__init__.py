"""LightningModules and DataModules written as Lightning users write them, not as the template does.

The machinery's tests drop this package into a run's working directory (as a user drops their
code into their project) and train, test, evaluate, export, resume, run DDP and signal them
through the real CLI. None of them is a classifier, only one has a ``net``, and each one logs
with ``sync_dist=True``:

* :class:`RegressionModule`: tuple batches, ``on_step`` and ``on_epoch`` logging in every stage,
  slash and underscore keys, ReduceLROnPlateau with a monitor.
* :class:`TwoOptimizerModule`: manual optimisation with two optimisers and no scheduler, dict
  batches, a ``forward`` that returns a dict.
* :class:`LazyModule`: layers built in ``configure_model``, batches as a dataclass.
* :class:`HeadModule`: a ``net`` with a head beside it built in ``setup()`` from the data module,
  list and dict arguments (issue #31).
* :class:`TwoLoadersModule`: two validation loaders, a key logged in ``on_validation_epoch_end``
  outside the sanity check, no ``test_step``.
* :class:`NoValidationModule`: no ``validation_step``.
* :class:`PointsData`: a plain ``LightningDataModule`` giving any of those batch kinds;
  :class:`TwoValidationSets`: the same with two validation loaders.
"""
