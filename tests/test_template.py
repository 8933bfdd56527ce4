"""This repository as a Copier template: real Copier on real git repositories, offline.

The template (template/) is written from the project at the top by tools/make_template.py. These
tests copy the working tree into a fresh git repository, tag it, and make and update projects
from it as a user would: ``copier copy``, the user's own commits, a template change, ``copier
update``. Not part of generated projects (tools/make_template.py leaves this file out).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "acme_vision"
# The template's package name where code uses it (imports, module paths, strings, variables).
NAMED = re.compile(r"(?<![\w-])project\.|\"project\"|PROJECT_|\bfrom project\b|\bimport project\b")
COPIER = [sys.executable, "-m", "copier"]
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]


def git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout


def template_repository(target: Path) -> Path:
    """The working tree as it is (committed or not), as a git repository tagged v1."""
    listed = git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            destination.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, destination)
    git(target, "init", "-q", "-b", "main")
    git(target, "add", "-A")
    git(target, "commit", "-q", "-m", "template v1")
    git(target, "tag", "v1")
    return target


def copier(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [*COPIER, *args, "--trust", "--defaults", "--quiet"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return template_repository(tmp_path / "template repo")


def make_project(repository: Path, where: Path, ref: str = "v1") -> Path:
    copier(
        "copy",
        "--vcs-ref",
        ref,
        "--data",
        f"package_name={PACKAGE}",
        "--data",
        "description=Vision models of our own",
        "--data",
        "project_name=Acme Vision",
        str(repository),
        str(where),
        cwd=where.parent,
    )
    git(where, "init", "-q", "-b", "main")
    git(where, "add", "-A")
    git(where, "commit", "-q", "-m", "made with copier")
    return where


def test_the_template_is_what_the_generator_writes_from_the_project() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_template.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_copier_copy_makes_a_project_of_its_own_name(repository: Path, tmp_path: Path) -> None:
    project = make_project(repository, tmp_path / "acme")
    package = project / "src" / PACKAGE
    assert (package / "train.py").is_file() and not (project / "src" / "project").exists()
    # Every place the package's name stood now names the user's package (issue #20.3: rename.py
    # missed string literals); "project" stays only as a word of prose.
    for path in [*package.rglob("*.py"), *(project / "configs").rglob("*.yaml")]:
        text = path.read_text()
        assert not NAMED.search(text), path
    for path in (project / "tests").rglob("*.py"):
        assert not NAMED.search(path.read_text()), path
    pyproject = (project / "pyproject.toml").read_text()
    assert f'name = "{PACKAGE}"' in pyproject and "Vision models of our own" in pyproject
    assert "repo-only" not in pyproject and "mutmut" not in pyproject
    assert "lib/runkit/tests" not in pyproject
    # The library comes along, vendored, without its own tests; nothing of this repository else.
    assert (project / "lib" / "runkit" / "src" / "runkit" / "gpu_stats" / "callback.py").is_file()
    assert not (project / "lib" / "runkit" / "tests").exists()
    for repo_only in ("template", "tools", "copier.yml", "tests/test_template.py", "docs"):
        assert not (project / repo_only).exists(), repo_only
    assert (project / ".copier-answers.yml").is_file()
    assert (project / "README.md").read_text().startswith("# Acme Vision — ")
    assert not any(p.is_symlink() for p in project.rglob("*"))
    # It runs: its config composes under its own name (its whole suite: the next test).
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    shown = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", "--cfg", "job"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert f"_target_: {PACKAGE}.models.classifier.ClassifierModule" in shown.stdout


@pytest.mark.slow
def test_a_generated_project_installs_and_passes_its_own_tests_in_a_minute(
    repository: Path, tmp_path: Path
) -> None:
    project = make_project(repository, tmp_path / "acme")
    wheels = tmp_path / "wheels"
    for source in (project / "lib" / "runkit", project):  # both build offline, no isolation
        built = subprocess.run(
            [*PIP_WHEEL, "-w", str(wheels), str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, built.stderr[-3000:]
    assert {p.name.split("-")[0] for p in wheels.glob("*.whl")} == {"lightning_runkit", PACKAGE}
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "RUNKIT_", "PYTEST"))
    }
    env["PYTHONPATH"] = str(project / "src")
    started = time.monotonic()
    tested = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.monotonic() - started
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-2000:]
    assert re.search(r"\d+ passed", tested.stdout)
    print(f"generated project's suite: {took:.0f} s")  # README's figure; the budget is 60 s


@pytest.mark.slow
def test_copier_update_merges_the_template_change_with_the_users_edits(
    repository: Path, tmp_path: Path
) -> None:
    project = make_project(repository, tmp_path / "acme")
    nets = project / "src" / PACKAGE / "models" / "nets.py"
    convnet = project / "configs" / "model" / "convnet.yaml"
    readme = project / "README.md"
    # The user's own edits, committed: a network of theirs, a learning rate, a README line.
    nets.write_text(nets.read_text() + "\n\nclass MyNet:  # the user's own network\n    pass\n")
    convnet.write_text(convnet.read_text().replace("lr: 0.005", "lr: 0.002"))
    readme.write_text(readme.read_text().replace("\n", "\n\nOur team's notes.\n", 1))
    git(project, "commit", "-q", "-am", "our changes")

    # The template moves on: a new config key, a comment in nets.py, and the same lr line.
    root_convnet = repository / "configs" / "model" / "convnet.yaml"
    root_convnet.write_text(
        root_convnet.read_text().replace("lr: 0.005", "lr: 0.004") + "# added upstream\n"
    )
    root_nets = repository / "src" / "project" / "models" / "nets.py"
    root_nets.write_text("# Upstream note on the networks.\n" + root_nets.read_text())
    subprocess.run(
        [sys.executable, "tools/make_template.py"], cwd=repository, check=True, timeout=120
    )
    git(repository, "add", "-A")
    git(repository, "commit", "-q", "-m", "template v2")
    git(repository, "tag", "v2")

    copier("update", "--vcs-ref", "v2", cwd=project)
    merged_nets = nets.read_text()
    assert merged_nets.startswith("# Upstream note on the networks.\n")  # the template's change
    assert "class MyNet:  # the user's own network" in merged_nets  # and the user's, both kept
    assert "Our team's notes." in readme.read_text()
    merged = convnet.read_text()
    assert "# added upstream" in merged
    # Both sides changed the lr line: a marked conflict holding both, never a silent overwrite.
    assert "lr: 0.002" in merged and "lr: 0.004" in merged
    assert "<<<<<<<" in merged and ">>>>>>>" in merged
    assert "_commit: v2" in (project / ".copier-answers.yml").read_text()
