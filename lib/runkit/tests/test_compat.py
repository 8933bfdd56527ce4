"""Every private Lightning/torch/Hydra access the library makes still works (one test each): a
release that moves one fails here with a line naming the access and who relies on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runkit import compat


@pytest.mark.parametrize("api", compat.PRIVATE_APIS, ids=lambda a: f"{a.owner}.{a.name}")
def test_private_access_still_works(api: compat.PrivateApi) -> None:
    assert api.missing() is None, api.missing()


def test_a_moved_access_or_a_failing_probe_is_named_in_one_line() -> None:
    gone = compat.PrivateApi("lightning.pytorch:Trainer", "_no_such_thing", "someone", "a reason")
    line = gone.missing()
    assert line is not None and "\n" not in line
    assert line.startswith("lightning.pytorch:Trainer._no_such_thing is gone or changed")
    assert "someone relies on it (a reason)" in line
    failing = compat.PrivateApi("x:Y", "z", "who", "why", lambda: [][0])
    assert "(IndexError: list index out of range)" in str(failing.missing())
    assert compat.PrivateApi("x:Y", "z", "who", "why", lambda: False).missing() is not None


def test_private_hydra_accesses_go_through_compat() -> None:
    source = Path(compat.__file__).parent.parent  # runkit and its Hydra plugin
    for path in source.rglob("*.py"):
        if path.name == "compat.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "hydra._internal" not in text and "_return_value" not in text, path
    names = {(api.owner, api.name) for api in compat.PRIVATE_APIS}
    assert ("hydra._internal.utils", "get_args_parser") in names


def _runkit_callback_classes() -> list[type]:
    import importlib
    import pkgutil

    import lightning.pytorch as pl

    import runkit

    for module in pkgutil.walk_packages(runkit.__path__, "runkit."):
        if not module.name.startswith("runkit.testing"):
            importlib.import_module(module.name)

    def subclasses(cls: type) -> list[type]:
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    return sorted(
        {
            c
            for c in subclasses(pl.Callback)
            if c.__module__.startswith("runkit.") and "<locals>" not in c.__qualname__
        },  # a probe's class made inside a function is no runkit callback
        key=lambda c: c.__qualname__,
    )


def test_every_runkit_callback_leaves_the_dispatch_of_batch_hooks_it_does_not_implement(
    tmp_path: Path,
) -> None:
    # A runkit callback built with its defaults opts out of the batch hooks it inherits unchanged.
    import lightning.pytorch as pl

    classes = _runkit_callback_classes()
    assert {"GpuStatsMonitor", "FiniteLoss", "GracefulInterrupt", "ModelCheckpoint"} <= {
        c.__name__ for c in classes
    }
    required = {"PredictionWriter": {"output_dir": tmp_path}}
    for cls in classes:
        callback = cls(**required.get(cls.__name__, {}))
        for name in compat.BATCH_HOOKS:
            inherited = getattr(cls, name) is getattr(pl.Callback, name)
            assert (getattr(callback, name) is None) == inherited, (cls.__qualname__, name)
