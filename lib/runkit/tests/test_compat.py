"""Every private Lightning/torch/Hydra access the library makes still works, one test each."""

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
