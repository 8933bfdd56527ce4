"""scripts/rename.py: one command renames the package everywhere, and the renamed copy still works.

The rewriting rules and the name checks are tested directly (fast); the whole rename runs on a
clone of HEAD (not the working tree, where other changes may be in flight), whose own tests,
training run and lint then have to pass under the new name.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import clean_env, run_dirs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "rename.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rename_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rename = _load_script()
# The name the whole-rename tests give a clone (one the repository is not already named).
NEW = "mypkg" if rename.current_name(REPO) != "mypkg" else "mypkg2"

RENAMED = [
    ("x.py", "from project.machinery.gpus import nvml", "from mypkg.machinery.gpus import nvml"),
    ("x.py", "import project.machinery.run.cli as c", "import mypkg.machinery.run.cli as c"),
    ("x.py", "from project import devices as d", "from mypkg import devices as d"),
    ("x.yaml", "_target_: project.models.Classifier", "_target_: mypkg.models.Classifier"),
    ("x.py", '"project.machinery.testing.fake_nvml:create"', '"mypkg.machinery.testing.fake_nvml:create"'),
    ("x.py", 'command = f"project.{task}"', 'command = f"mypkg.{task}"'),
    ("x.md", "`python -m project.<task>`", "`python -m mypkg.<task>`"),
    ("Makefile", "\t$(PY) -m project.train $(ARGS)", "\t$(PY) -m mypkg.train $(ARGS)"),
    ("x.py", "LOG project.machinery.gpu_stats", "LOG mypkg.machinery.gpu_stats"),
    ("x.toml", 'name = "project"', 'name = "mypkg"'),
    ("x.toml", 'packages = ["src/project"]', 'packages = ["src/mypkg"]'),
    ("x.toml", '"configs" = "project/configs"', '"configs" = "mypkg/configs"'),
    ("x.toml", 'known-first-party = ["project", "conftest"]', 'known-first-party = ["mypkg", "conftest"]'),
    ("x.py", "# src/project (or site-packages/project)", "# src/mypkg (or site-packages/mypkg)"),
    ("x.py", "``project`` itself pulls in", "``mypkg`` itself pulls in"),
    ("x.yaml", "# pip install 'project[wandb]'.", "# pip install 'mypkg[wandb]'."),
    ("x.py", 'glob("project-*.whl")', 'glob("mypkg-*.whl")'),
    ("x.yaml", "  project: project", "  project: mypkg"),
    ("x.md", "# project — a template\n# project notes", "# mypkg — a template\n# project notes"),
    ("x.ipynb", '"from project.train import train\\n",', '"from mypkg.train import train\\n",'),
    ("Makefile", "PROJECT_LOG_DIR=$(CURDIR)/logs", "MYPKG_LOG_DIR=$(CURDIR)/logs"),
    ("x.py", 'k.startswith(("PROJECT_", "PL_"))', 'k.startswith(("MYPKG_", "PL_"))'),
]  # fmt: skip

UNCHANGED = [
    ("setup.sh", "# project's own requirement (torch>=2.4) is already met"),
    ("train.sbatch", "# Activate the environment the project is installed in."),
    ("x.py", '"""README\'s worked example, as a user\'s own project would use it"""'),
    ("x.md", "the project.\nNext line"),
    ("x.toml", "[project]\n[project.optional-dependencies]\n[[project.x]]"),
    ("x.toml", 'description = "A PyTorch Lightning + Hydra project template"'),
    ("x.py", "PYPROJECT = REPO / 'pyproject.toml'; my-project.train; subproject/x; project_root"),
    ("x.md", "see https://project.example.org and MY_PROJECT_DIR"),
    ("x.yaml", "project: the project is ours"),
]


@pytest.mark.parametrize(("name", "before", "after"), RENAMED)
def test_code_like_occurrences_are_renamed(name: str, before: str, after: str) -> None:
    text, count = rename.rewriter("project", "mypkg", Path(name).suffix)(before)
    assert text == after
    assert count == after.lower().count("mypkg")


@pytest.mark.parametrize(("name", "text"), UNCHANGED)
def test_prose_and_longer_names_stay(name: str, text: str) -> None:
    assert rename.rewriter("project", "mypkg", Path(name).suffix)(text) == (text, 0)


def _package_root(tmp_path: Path) -> Path:
    (tmp_path / "src" / "project").mkdir(parents=True)
    (tmp_path / "src" / "project" / "__init__.py").write_text("")
    (tmp_path / "tests").mkdir()
    return tmp_path


@pytest.mark.parametrize("name", ["mypkg", "my_pkg2", "a"])
def test_good_names_pass(name: str, tmp_path: Path) -> None:
    rename.check_name(name, "project", _package_root(tmp_path))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("MyPkg", "is not a valid package name"),
        ("my-pkg", "is not a valid package name"),
        ("2pkg", "is not a valid package name"),
        ("", "is not a valid package name"),
        ("_private", "is not a valid package name"),
        ("class", "is a Python keyword"),
        ("json", "would shadow the standard-library module"),
        ("test", "would shadow the installed module at"),  # CPython's own tests
        ("torch", "would shadow the installed module at"),
        ("tests", "is already a name at the top of"),
    ],
)
def test_bad_names_are_refused_in_one_line(
    name: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _package_root(tmp_path)
    before = sorted(root.rglob("*"))
    assert rename.main([name], root=root) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {name!r} {why}") and err.count("\n") == 1, err
    assert "expected a lowercase Python identifier" in err
    assert sorted(root.rglob("*")) == before


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """HEAD of this repository, with the rename script under test, in a path with a space and é."""
    repo = tmp_path / "my clone é"
    subprocess.run(["git", "clone", "-q", str(REPO), str(repo)], check=True, capture_output=True)
    (repo / "scripts" / "rename.py").write_bytes(SCRIPT.read_bytes())
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "the rename script under test")
    return repo


def _snapshot(repo: Path) -> dict[str, bytes]:
    return {
        p.relative_to(repo).as_posix(): p.read_bytes()
        for p in repo.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(repo).parts
    }


@pytest.mark.slow
def test_dry_run_lists_the_changes_and_changes_nothing(
    clone: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = rename.current_name(clone)
    before = _snapshot(clone)
    assert rename.main([NEW, "--dry-run"], root=clone) == 0
    out = capsys.readouterr().out
    assert f'pyproject.toml:6: name = "{NEW}"' in out
    assert re.search(rf"^src/{old}/\S+\.py:\d+: (from|import) {NEW}\b", out, re.MULTILINE), out
    assert out.splitlines()[-1].startswith(f"dry run, nothing changed: {old} -> {NEW}: ")
    assert out.splitlines()[-1].endswith(f"src/{old} -> src/{NEW}")
    assert _snapshot(clone) == before
    assert _git(clone, "status", "--porcelain") == ""


@pytest.mark.slow
def test_uncommitted_changes_or_an_existing_target_are_refused(
    clone: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (clone / "notes é.txt").write_text("mine, not committed: import project.train\n")
    before = _snapshot(clone)
    assert rename.main([NEW], root=clone) == 2
    assert "uncommitted change" in capsys.readouterr().err
    assert _snapshot(clone) == before

    (clone / "notes é.txt").unlink()
    (clone / "src" / NEW).mkdir()
    assert rename.main([NEW], root=clone) == 2
    assert capsys.readouterr().err.startswith(f"error: {clone / 'src' / NEW} already exists")

    (clone / "src" / NEW).rmdir()
    (clone / "README.md").write_text((clone / "README.md").read_text() + f"\nimport {NEW}\n")
    _git(clone, "commit", "-qam", f"{NEW} already in use")
    before = _snapshot(clone)
    assert rename.main([NEW], root=clone) == 2
    assert f"{NEW!r} is already used in the code (README.md:" in capsys.readouterr().err
    assert _snapshot(clone) == before


CODE_LIKE = (r"\b{old}\.[A-Za-z_{{<]", r"(import|from) {old}\b", r"src/{old}\b", r"-m {old}\b",
             r"[\"'`]{old}[\"'`]", r"\b{old}\[", r"\b{upper}_")  # fmt: skip


@pytest.mark.slow
def test_a_renamed_clone_trains_and_passes_its_tests(clone: Path, tmp_path: Path) -> None:
    old, new = rename.current_name(clone), NEW
    done = subprocess.run(
        [sys.executable, "scripts/rename.py", new], cwd=clone, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "pip install -e '.[dev]'" in done.stdout
    assert (clone / "src" / new / "__init__.py").is_file() and not (clone / "src" / old).exists()

    # No code-like reference to the old name is left (outside the rename's own files).
    code_like = re.compile("|".join(p.format(old=old, upper=old.upper()) for p in CODE_LIKE))
    left = [
        f"{path}: {line}"
        for path, data in _snapshot(clone).items()
        if Path(path) not in rename.OWN_FILES and b"\0" not in data
        for line in data.decode("utf-8", "replace").splitlines()
        if code_like.search(line) and not line.startswith("[")  # pyproject's [project] tables
    ]
    assert not left, "\n".join(left[:20])
    pyproject = (clone / "pyproject.toml").read_text()
    assert "\n[project]\n" in pyproject and "\n[project.optional-dependencies]\n" in pyproject

    # Idempotent: the same command again changes nothing.
    again = subprocess.run(
        [sys.executable, "scripts/rename.py", new], cwd=clone, capture_output=True, text=True
    )
    assert again.returncode == 0 and "already named" in again.stdout, again.stderr

    # The clone's src first: `new` must come from the clone, never from this checkout.
    env = clean_env(PYTHONPATH=str(clone / "src"))

    def run(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], cwd=clone, env={**env, **extra_env},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    where = run("-c", f"import {new}; print({new}.__file__)")
    assert where.stdout.strip() == str(clone / "src" / new / "__init__.py"), where.stderr

    lint = run("-m", "ruff", "check", "--quiet", ".")
    assert lint.returncode == 0, lint.stdout[-3000:]
    formatted = run("-m", "ruff", "format", "--check", "--quiet", ".")
    assert formatted.returncode == 0, formatted.stdout[-3000:]

    tests = run("-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                "tests/test_configs.py", "tests/test_readme.py")  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:]

    log_dir = tmp_path / "logs"
    train = run("-m", f"{new}.train", "trainer.max_epochs=1", "data.batch_size=256",
                "callbacks.progress_bar.refresh_rate=0", f"paths.log_dir={log_dir}")  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    assert run_dirs(log_dir), "the renamed train run wrote its run directory"

    # The environment variables follow the package: the fake NVML is found under the new names.
    (fake,) = (clone / "src" / new).rglob("fake_nvml.py")
    fake_module = ".".join(fake.relative_to(clone / "src").with_suffix("").parts)
    upper = new.upper()
    devices = run("-m", f"{new}.devices", "--json", **{
        f"{upper}_NVML_BACKEND": f"{fake_module}:create", f"{upper}_FAKE_NVML": '{"gpus": 2}'})  # fmt: skip
    assert devices.returncode == 0, devices.stderr[-3000:]
    assert len(json.loads(devices.stdout)["gpus"]) == 2
