"""The notebooks: each runs top to bottom on a CPU without an error, and none is committed with
outputs (they are stripped by nbstripout in pre-commit; this test catches a commit without it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import _LEAKY_ENV

NOTEBOOK_DIR = Path(__file__).resolve().parents[3] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the dev extra")


def test_there_are_notebooks_to_check() -> None:
    names = [path.name for path in NOTEBOOKS]
    assert "01_gpu_story.ipynb" in names and "02_plot_a_run.ipynb" in names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for number, cell in enumerate(notebook.cells):
        where = f"{path.name} cell {number}"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{where} has outputs; run nbstripout (pre-commit does)"
            assert cell.execution_count is None, f"{where} has an execution count"
        assert "execution" not in cell.metadata, f"{where} keeps execution timings"
    assert "widgets" not in notebook.metadata, f"{path.name} keeps widget state"
    assert notebook.metadata["kernelspec"]["name"] == "python3"


def test_nbstripout_would_change_nothing(tmp_path: Path) -> None:
    """The pre-commit hook's own tool, run on copies: a committed notebook is already stripped."""
    copies = []
    for path in NOTEBOOKS:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    result = subprocess.run(
        [sys.executable, "-m", "nbstripout", *map(str, copies)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for path, copy in zip(NOTEBOOKS, copies, strict=True):
        assert copy.read_text() == path.read_text(), f"nbstripout changes {path.name}"


def test_pre_commit_strips_notebooks_and_runs_ruff() -> None:
    config = yaml.safe_load((NOTEBOOK_DIR.parent / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert {"nbstripout", "ruff", "ruff-format"} <= hooks


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom_on_cpu(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executed in a fresh directory, so its runs land in tmp_path/logs, never in the repository."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    for name in _LEAKY_ENV:  # the kernel inherits this process's environment
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PROJECT_LOG_DIR", str(tmp_path / "logs"))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()
    except CellExecutionError as err:  # the failing cell and its traceback, in one message
        pytest.fail(f"{path.name} failed:\n{str(err)[-4000:]}")
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors
    trained = [p.parent for p in (tmp_path / "logs").glob("**/model.pth")]
    assert trained, "the notebook left no finished training run in its working directory"
    assert all((run / "curves.png").is_file() for run in trained)
