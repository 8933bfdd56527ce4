"""README's worked example, as a user's own project would use it: a package and a config folder
outside ``src/project``, found through ``PYTHONPATH`` and ``--config-dir``, trained by
``python -m project.train``.

The Python and YAML files are taken from README.md itself (each block starts with a comment
naming its path), so the example a newcomer copies is the example that is tested.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import prewarmed
from conftest import clean_env, run_dirs

README = Path(__file__).resolve().parents[3] / "README.md"
COMMAND = "PYTHONPATH=. python -m project.train --config-dir my_configs model=tiny data=my_csv"
EXAMPLE_FILES = {
    "my_project/nets.py",
    "my_project/data.py",
    "my_configs/model/tiny.yaml",
    "my_configs/data/my_csv.yaml",
}


def readme_files() -> dict[str, str]:
    """``{path: text}`` for every python/yaml block of README whose first line is ``# <path>``."""
    blocks = re.findall(
        r"^```(?:python|yaml)\n# (\S+)[^\n]*\n(.*?)^```", README.read_text(), re.S | re.M
    )
    return {path: body for path, body in blocks}


def write_table(path: Path, rows: int = 300, seed: int = 0) -> None:
    """Three well separated classes of 4 features: a model that trains at all gets them right."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    centres = np.array([[0, 0, 0, 0], [4, 4, 0, 0], [0, 4, 4, 4]], dtype=float)
    features = centres[labels] + rng.normal(0, 0.5, (rows, 4))
    table = np.column_stack([features, labels])
    np.savetxt(path, table, delimiter=",", header="a,b,c,d,label", comments="", fmt="%.4f")


def test_readme_has_the_worked_example_and_its_command() -> None:
    assert set(readme_files()) >= EXAMPLE_FILES
    assert f"```bash\n{COMMAND}\n```" in README.read_text()


@pytest.mark.slow
def test_own_package_and_configs_outside_the_template_train(tmp_path: Path) -> None:
    files = readme_files()
    for name in EXAMPLE_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(files[name])
    (tmp_path / "my_project" / "__init__.py").write_text("")
    write_table(tmp_path / "table.csv")

    env_part, _, command = COMMAND.partition(" ")
    key, _, value = env_part.partition("=")
    words = command.split()
    assert words[:3] == ["python", "-m", "project.train"]
    budget = ["trainer.max_epochs=15", "callbacks.progress_bar.refresh_rate=0"]
    result = prewarmed.run(
        [sys.executable, *words[1:], *budget],
        cwd=tmp_path,
        env=clean_env(**{key: value}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    (run,) = run_dirs(tmp_path / "logs")
    config = (run / "config.yaml").read_text()
    assert "_target_: my_project.nets.TinyNet" in config
    assert "_target_: my_project.data.CsvDataModule" in config
    metrics = json.loads((run / "metrics.json").read_text())["metrics"]
    assert metrics["test/acc"] > 0.9, metrics  # it learned the three classes
    assert (run / "model.pth").is_file() and (run / "curves.png").is_file()

    # The exported network loads back through the user's own class, as README says: once their
    # package is trusted (a run folder may come from anyone; see test_untrusted_files.py).
    check = (
        "import torch; "
        "import runkit; "
        f"net = runkit.load_network({str(run / 'model.pth')!r}, "
        "allowed=[*runkit.TRUSTED_TARGETS, 'project.', 'my_project.']); "
        "print(type(net).__module__, net(torch.zeros(2, 4)).shape[-1])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env=clean_env(PYTHONPATH="."),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["my_project.nets", "3"]
