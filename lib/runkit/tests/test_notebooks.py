"""The notebooks run top to bottom on a CPU, and none is committed with outputs."""

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


def test_notebooks_are_committed_stripped_as_pre_commit_strips_them(tmp_path: Path) -> None:
    assert {"01_gpu_story.ipynb", "02_plot_a_run.ipynb"} <= {path.name for path in NOTEBOOKS}
    for path in NOTEBOOKS:
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
    config = yaml.safe_load((NOTEBOOK_DIR.parent / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert {"nbstripout", "ruff", "ruff-format"} <= hooks
    copies = [tmp_path / path.name for path in NOTEBOOKS]
    for path, copy in zip(NOTEBOOKS, copies, strict=True):
        copy.write_bytes(path.read_bytes())
    done = subprocess.run(
        [sys.executable, "-m", "nbstripout", *map(str, copies)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert [c.read_text() for c in copies] == [p.read_text() for p in NOTEBOOKS], "changed"


@pytest.mark.slow  # 01_gpu_story trains its own run: a made project's `make notebooks` runs it
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name != "01_gpu_story.ipynb"],
                         ids=lambda p: p.name)  # fmt: skip
def test_notebook_runs_top_to_bottom_on_cpu(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    for name in _LEAKY_ENV:  # the kernel inherits this process's environment
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PROJECT_LOG_DIR", str(tmp_path / "logs"))
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(tmp_path)}}
    client = NotebookClient(notebook, kernel_name="python3", timeout=300, resources=resources)
    try:
        client.execute()
    except CellExecutionError as err:  # the failing cell and its traceback, in one message
        pytest.fail(f"{path.name} failed:\n{str(err)[-4000:]}")
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    trained = [p.parent for p in (tmp_path / "logs").glob("**/model.pth")]
    assert trained, "the notebook left no finished training run in its working directory"
    assert all((run / "curves.png").is_file() for run in trained)
