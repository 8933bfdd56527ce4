"""Every private Lightning/torch/OmegaConf access the template makes still works (one test each).

A release that moves one fails here with a line naming the access and who relies on it.
"""

from __future__ import annotations

import pytest

from project.machinery import compat


@pytest.mark.parametrize("api", compat.PRIVATE_APIS, ids=lambda a: f"{a.owner}.{a.name}")
def test_private_access_still_works(api: compat.PrivateApi) -> None:
    assert api.missing() is None, api.missing()


def test_a_moved_access_is_named_in_one_line() -> None:
    gone = compat.PrivateApi("lightning.pytorch:Trainer", "_no_such_thing", "someone", "a reason")
    line = gone.missing()
    assert line is not None and "\n" not in line
    assert line.startswith("lightning.pytorch:Trainer._no_such_thing is gone or changed")
    assert "someone relies on it (a reason)" in line


def test_a_failing_probe_is_reported_with_its_error() -> None:
    def probe() -> bool:
        raise ImportError("moved")

    line = compat.PrivateApi("x:Y", "z", "who", "why", probe).missing()
    assert line is not None and "(ImportError: moved)" in line
