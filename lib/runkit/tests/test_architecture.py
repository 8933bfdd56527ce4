"""import-linter's contracts from pyproject.toml hold, one test each (README "Layout"); an id
missing from pyproject.toml fails too. The public API is what a type checker sees."""

from __future__ import annotations

import sys
from pathlib import Path

import importlinter.cli
import pytest
from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
CONTRACTS = ("library", "public-api", "user-zone", "layers", "acyclic")


@pytest.mark.parametrize("contract", CONTRACTS)
def test_import_contract_is_kept(
    contract: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(PYPROJECT.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports prepends the cwd
    # Its logging set-up is a dictConfig that disables every existing logger of this process.
    monkeypatch.setattr(importlinter.cli, "_configure_logging", lambda verbose: None)
    status = lint_imports(
        config_filename=str(PYPROJECT), limit_to_contracts=(contract,), no_cache=True
    )
    assert status == EXIT_STATUS_SUCCESS, (
        f"import contract {contract} is broken:\n{capsys.readouterr().out}"
    )


def test_the_public_api_is_what_a_type_checker_sees() -> None:
    """``__all__``, each name from its run-time module, under ``if TYPE_CHECKING:``; py.typed."""
    import ast

    import runkit

    tree = ast.parse(Path(runkit.__file__).read_text("utf-8"))
    checked = next(n for n in tree.body if isinstance(n, ast.If))  # if TYPE_CHECKING:
    seen = {a.name: i.module for i in checked.body for a in getattr(i, "names", [])}
    assert sorted(seen) == sorted(runkit.__all__) and len(seen) >= 30
    for name in runkit.__all__:
        value = getattr(runkit, name)
        assert getattr(value, "__module__", seen[name]) == seen[name], name
    assert (Path(runkit.__file__).parent / "py.typed").is_file()
