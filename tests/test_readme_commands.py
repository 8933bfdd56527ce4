"""README.md's commands: each training command composes as typed; CI runs the test one."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from project import config_dir
from runkit.run.preflight import check_config

ROOT = Path(__file__).resolve().parents[1]
README = "\n".join(  # and the pages it links, which ship with the library
    path.read_text() for path in [ROOT / "README.md", *sorted(ROOT.glob("lib/runkit/docs/*.md"))]
)
PACKAGE = "project"
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest"


def commands() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README, flags=re.S | re.M)
    lines = [
        re.sub(r"\s+#\s.*$", "", line).strip()
        for b in blocks
        for line in b.replace("\\\n", " ").splitlines()
    ]
    return [line for line in lines if line and not line.startswith("#")]


def training_commands() -> list[str]:
    """``python -m <package>.train|eval key=value ...`` with nothing to fill in or to set up
    first (no ``<run>`` placeholder, no config folder of one's own, no sweep)."""
    entry = re.compile(rf"^python -m {PACKAGE}\.(train|eval)\b")
    rest = re.compile(r"<|--|\s-m\s|PYTHONPATH")
    return [c for c in commands() if entry.match(c) and not rest.search(c[len("python -m ") :])]


@pytest.mark.parametrize("command", training_commands())
def test_each_training_command_composes_as_typed(command: str) -> None:
    words = shlex.split(command)
    task, overrides = words[2].rsplit(".", 1)[1], words[3:]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name=task, overrides=overrides, return_hydra_config=False)
    check_config(cfg)  # the values pass the checks a run makes before it starts
    assert cfg.trainer.max_epochs >= 1


def test_readme_gives_a_newcomers_two_commands_and_ci_runs_the_test_one_and_lints() -> None:
    assert f"bash scripts/setup.sh && .venv/bin/python -m {PACKAGE}.train" in commands()
    assert TEST_COMMAND in commands()
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    steps = [step.get("run", "") for job in workflow["jobs"].values() for step in job["steps"]]
    assert TEST_COMMAND in steps
    assert any("ruff check ." in step and "ruff format --check ." in step for step in steps)
