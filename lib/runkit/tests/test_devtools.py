"""The developer tools: the Makefile's interpreter, .gitignore, scripts/mutate.py's modules."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PLOT_OUTPUTS = ("curves.png", "compare.png", "ab.svg", "runs.pdf")
# What an outer make (`make test-fast ARGS=...`) exports to the tests; none may reach the make here.
MAKE_ENV = ("PY", "ARGS", "RUN", "NAME", "MODULE", "TESTS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL",
            "MAKEOVERRIDES", "VIRTUAL_ENV")  # fmt: skip


def make(cwd: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in MAKE_ENV}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture
def bare_checkout(tmp_path: Path) -> Path:  # the Makefile alone, no .venv ("your own environment")
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    return tmp_path


def test_make_uses_the_python3_on_path_else_the_venv_else_py(bare_checkout: Path) -> None:
    done = make(bare_checkout, "-n", "devices")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["python3", "-m", "runkit.devices"]  # found on PATH by name
    (bare_checkout / ".venv" / "bin").mkdir(parents=True)
    (bare_checkout / ".venv" / "bin" / "python").symlink_to(sys.executable)
    done = make(bare_checkout, "-n", "devices")
    assert done.stdout.split() == [".venv/bin/python", "-m", "runkit.devices"]
    assert make(bare_checkout, "-n", "devices", "PY=/opt/x/python").stdout.startswith(
        "/opt/x/python"
    )


@pytest.mark.slow  # with a .venv: test_template.py's made project runs make devices
def test_make_devices_runs_in_ones_own_environment(bare_checkout: Path) -> None:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"  # as `activate` puts it first
    done = make(bare_checkout, "devices", "ARGS=--json", path=path)
    assert done.stdout.startswith("python3 -m runkit.devices --json\n")
    assert done.returncode == 0, done.stderr
    document = done.stdout[done.stdout.index("{") :]
    assert json.loads(document)["schema_version"] == 1


def git(repo: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, check=True).stdout


def test_plot_outputs_and_logs_are_ignored_and_nothing_else(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    ignored = [*PLOT_OUTPUTS, "logs/train/runs/x/curves.png", "outputs/a.txt"]
    kept = ["docs/img/new.png", "notebooks/figure.svg", "notes.txt", "src/project/x.py"]
    for name in ignored + kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    status = git(tmp_path, "status", "--porcelain", "--untracked-files=all").split("\n")
    listed = sorted(line[3:] for line in status if line)
    assert listed == sorted([".gitignore", *kept])


def test_every_mutation_module_names_sources_and_tests_that_exist() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutate", REPO / "scripts" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = mutate  # its dataclass looks its module up there
    spec.loader.exec_module(mutate)  # importing it runs nothing
    assert {"checkpoints", "gpus", "gpu_stats", "finite_loss"} <= set(mutate.MODULES)
    for name, (sources, tests) in mutate.MODULES.items():
        for pattern in sources:
            assert list(REPO.glob(pattern)), f"{name}: no file matches {pattern}"
        missing = [t for t in tests if not (REPO / t).is_file()]
        assert not missing, f"{name}: test files missing: {missing}"
    # The documented commands name modules the script knows (or paths that exist).
    docs = " ".join(doc.read_text() for doc in (REPO / "docs" / "mutation").glob("*.md"))
    documented = set(re.findall(r"make mutate MODULE=(\S+?)[`\s]", docs))
    assert "finite_loss" in documented
    for module in documented:
        assert module in mutate.MODULES or (REPO / module).exists(), module
    name = "runkit.safety.finite_loss.xǁFiniteLossǁon_train_batch_end__mutmut_3"  # a mutant's
    assert mutate.module_of(name) == "lib/runkit/src/runkit/safety/finite_loss.py"
