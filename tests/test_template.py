"""This repository as a Copier template, offline, as a user meets it, in a fresh environment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COPIER = [sys.executable, "-m", "copier"]
NAMES = [
    pytest.param(("Sky Survey", "sky_survey"), id="sky_survey"),  # its imports sort after runkit's
    pytest.param(("Élan Vital", "elan_vital"), id="elan_vital"),  # and before
]
SET_UP = "Élan Vital"  # the project whose README commands run as written
SETUP_AND_RUN_S = 3600  # a fresh install and the default run: many minutes on a busy machine
# What of this repository must not reach a project: the placeholder package, tools, tests, material.
LEFTOVERS = re.compile(
    r"(?<![\w\-])(?<!^\[)project(?=\.[\w\"'`\\]|\[\w|/)|(?<=[\"'`/])project\b(?!-)|-m project\b"
    r"|\bPROJECT_|benchmarks/|scripts/gpu_check|gpu-check|mutmut|mutants|make mutate|(?<![/\w])docs/"
    r"|tools/|copier\.yml|test_template|lib/runkit/tests|tests/README|\$OUT|rename\.py"
    r"|tests/test_\w+\.py|`test_[a-z0-9]+_\w+`"
)
IDENTITY = {f"GIT_{who}_{key}": value for who in ("AUTHOR", "COMMITTER")
            for key, value in (("NAME", "t"), ("EMAIL", "t@example.com"))}  # fmt: skip


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, env={**os.environ, **IDENTITY}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def template_repository(target: Path) -> Path:
    """The working tree (committed or not) as a git repository tagged v1."""
    listed = git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the working tree (or a link there that is a folder now)
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            destination.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, destination)
    git(target, "init", "-q", "-b", "main")
    commit_and_tag(target, "v1")
    return target


def commit_and_tag(repository: Path, tag: str) -> None:
    git(repository, "add", "-A")
    git(repository, "commit", "-q", "-m", f"template {tag}")
    git(repository, "tag", tag)


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)  # fmt: skip


def make_project(repository: Path, where: Path, project_name: str) -> Path:
    """``copier copy`` as the README gives it, then the git repository its README starts."""
    done = run([*COPIER, "copy", "--defaults", "--vcs-ref", "v1", "--data",
                f"project_name={project_name}", str(repository), str(where)], where.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (start,) = [b for b in bash_blocks((where / "README.md").read_text("utf-8")) if "git init" in b]
    started = run_bash(start, where, {**os.environ, **IDENTITY})
    assert started.returncode == 0 and not git(where, "status", "--porcelain"), started.stderr
    return where


def run_bash(command: str, cwd: Path, env: dict[str, str]) -> CompletedProcess:
    return run(["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", "-c", command], cwd, env)


def ci_steps(root: Path, job: str = "test") -> list[tuple[str, str, dict[str, str]]]:
    """(name, command, the step's env) of each ``run:`` step of one job, in order."""
    workflow = yaml.safe_load((root / ".github" / "workflows" / "ci.yml").read_text("utf-8"))
    steps = [s for s in workflow["jobs"][job]["steps"] if "run" in s]
    return [(s.get("name", s["run"]), s["run"], {k: str(v) for k, v in s.get("env", {}).items()})
            for s in steps]  # fmt: skip


def fresh_environment() -> dict[str, str]:
    """A newcomer's shell: no venv, PYTHONPATH, pytest or run variables (pip's settings stay)."""
    ours = {str(Path(sys.prefix) / "bin"), str(ROOT / ".venv" / "bin")}
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and p not in ours]
    dropped = (
        "PYTHONPATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        "PROJECT_",
        "RUNKIT_",
        "PYTEST",
        "COV_",
        "OMP_NUM_THREADS",
    )  # the suite's one thread per worker is not the user's
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PATH"] = os.pathsep.join(path)
    return env


def section(readme: str, heading: str) -> str:
    return readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)]


def failures(runs: list[tuple[str, CompletedProcess]]) -> list[str]:
    return [f"{step}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            for step, r in runs if r.returncode]  # fmt: skip


@dataclass
class Made:
    root: Path
    package: str
    readme: str


Pushed = dict[str, list[tuple[str, CompletedProcess]]]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return template_repository(tmp_path_factory.mktemp("template") / "template repo")


@pytest.fixture(scope="module")
def projects(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Made]:
    made = {}
    for project_name, package in (p.values[0] for p in NAMES):
        where = tmp_path_factory.mktemp("made") / "my projects" / project_name
        where.parent.mkdir(parents=True)
        make_project(repository, where, project_name)
        made[project_name] = Made(where, package, (where / "README.md").read_text("utf-8"))
    return made


@pytest.fixture(scope="module", params=NAMES)
def made(request: pytest.FixtureRequest, projects: dict[str, Made]) -> Made:
    return projects[request.param[0]]


@pytest.fixture(scope="module")
def pushed(projects: dict[str, Made]) -> Pushed:
    """CI's ``run:`` steps up to the first that fails; the other project's in the first's .venv."""
    done: Pushed = {}
    for name in sorted(projects, key=lambda n: n != SET_UP):
        done[name], root = [], projects[name].root
        if name != SET_UP:
            (root / ".venv").symlink_to(projects[SET_UP].root / ".venv", target_is_directory=True)
            cache = projects[SET_UP].root / ".mypy_cache"  # mypy re-checks each file by its hash
            if cache.is_dir():
                shutil.copytree(cache, root / ".mypy_cache")
        for step, command, env in ci_steps(root):
            if name != SET_UP and ("-m pytest" in command or command == "bash scripts/setup.sh"):
                continue
            done[name].append((step, run_bash(command, root, {**fresh_environment(), **env})))
            if done[name][-1][1].returncode != 0:
                break
    return done


@pytest.fixture(scope="module")
def trained(projects: dict[str, Made], pushed: Pushed) -> CompletedProcess:
    made = projects[SET_UP]
    train, _ = bash_blocks(section(made.readme, "Two commands on a fresh machine"))
    return run_bash(train, made.root, fresh_environment())


def test_the_template_is_what_the_generator_writes_from_the_project(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert make_template().main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(SETUP_AND_RUN_S)
def test_the_readme_commands_as_written_train_to_what_the_readme_claims_and_pass_the_suite(
    projects: dict[str, Made], pushed: Pushed, trained: CompletedProcess
) -> None:
    made = projects[SET_UP]
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (made.root / "src" / made.package / "train.py").is_file()
    (metrics,) = (made.root / "logs" / "train" / "runs").glob("*/metrics.json")
    accuracy = json.loads(metrics.read_text())["metrics"]["test/acc"]
    claimed = re.search(r"~(\d+)% test accuracy", made.readme)
    assert claimed is not None, "the README says what the default run reaches"
    assert accuracy >= int(claimed.group(1)) / 100 - 0.015, accuracy
    assert (metrics.parent / "model.pth").is_file() and (metrics.parent / "curves.png").is_file()
    _, test = bash_blocks(section(made.readme, "Two commands on a fresh machine"))
    tested = next((run for _, run in pushed[SET_UP] if run.args[-1] == test), None)
    assert tested is not None, "the CI job did not reach the README's test command"
    assert tested.returncode == 0, tested.stdout[-4000:] + tested.stderr[-2000:]
    assert re.search(r"\d+ passed", tested.stdout) and " failed" not in tested.stdout


@pytest.mark.slow
@pytest.mark.timeout(SETUP_AND_RUN_S)
def test_a_made_project_is_green_on_its_first_push(made: Made, pushed: Pushed) -> None:
    runs = pushed[made.root.name]
    failed = failures(runs)
    assert not failed, failed[0]
    commands = "\n".join(run.args[-1] for _, run in runs)
    suite = ("-m pytest",) if made.root.name == SET_UP else ()
    for expected in ("ruff check .", "ruff format --check .", "-m mypy", "git grep", *suite):
        assert expected in commands, f"the CI job runs no {expected!r}"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(SETUP_AND_RUN_S)
def test_a_made_projects_slurm_job_passes_on_a_one_host_cluster(
    projects: dict[str, Made], pushed: Pushed, tmp_path: Path
) -> None:
    env = fresh_environment()
    if shutil.which("sudo") is None and os.geteuid() == 0:  # a runner's sudo, as root: a no-op
        (tmp_path / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
        (tmp_path / "sudo").chmod(0o755)
        env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    elif shutil.which("sudo") is None:
        message = "the project's slurm job runs scripts/slurm/cluster.sh with sudo: none here"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    steps = ci_steps(projects[SET_UP].root, "slurm")
    runs = [(step, run_bash(command, projects[SET_UP].root, {**env, **own}))
            for step, command, own in steps]  # fmt: skip
    failed = failures(runs)
    assert not failed, failed[0]
    tested = next(r.stdout for _, r in runs if "-m slurm" in r.args[-1])
    assert re.search(r"\b1 passed", tested) and "skipped" not in tested, tested[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(SETUP_AND_RUN_S)
def test_every_makefile_target_works_in_a_path_with_a_space(
    projects: dict[str, Made], pushed: Pushed
) -> None:
    made = projects[SET_UP]
    assert " " in str(made.root)

    def make(target: str) -> None:
        done = run_bash(f"make {target}", made.root, fresh_environment())
        assert done.returncode == 0, f"make {target}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"

    for target in ("help", "lint", "format", "devices"):
        make(target)
    runs = made.root / "logs" / "train" / "runs"
    before = set(runs.glob("*/curves.png"))
    make('train ARGS="trainer.max_epochs=1 data.batch_size=256 test=false"')
    (curves,) = set(runs.glob("*/curves.png")) - before
    curves.unlink()
    for target in ("plot", "notebooks", "clean"):
        make(target)
    logs = made.root / "logs"  # every notebook ran top to bottom (jupyter execute stops on errors)
    executed = {p.name for p in (logs / "notebooks").glob("*.ipynb")}
    assert executed == {p.name for p in (made.root / "notebooks").glob("*.ipynb")}, executed
    assert "01_gpu_story.ipynb" in executed and curves.is_file()
    trained = [p.parent for p in (logs / "notebook" / "runs").glob("*/model.pth")]  # 01's run
    assert trained and all((run / "curves.png").is_file() for run in trained)
    assert not (made.root / ".pytest_cache").exists()
    assert not git(made.root, "status", "--porcelain")  # format changed nothing; runs ignored


@pytest.mark.slow
def test_the_generated_projects_wheel_holds_its_package_and_configs(
    projects: dict[str, Made], tmp_path: Path
) -> None:
    made = projects[SET_UP]  # one build: the package's name only fills the paths checked
    built = run(  # by this environment's pip and hatchling: the build needs no other
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path), "."], made.root,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob(f"{made.package}-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("__init__.py", "train.py", "eval.py", "models/classifier.py", "data/digits.py"):
        assert f"{made.package}/{module}" in names, module
    assert f"{made.package}/configs/train.yaml" in names


@pytest.mark.slow
def test_nothing_in_a_generated_project_names_the_template_or_this_repository(
    made: Made,
) -> None:
    found = []
    for name in git(made.root, "ls-files", "-z").split("\0"):
        path = made.root / name
        if not name or name == ".copier-answers.yml" or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # the digits' .npz
        for number, line in enumerate(text.splitlines(), 1):
            if LEFTOVERS.search(line):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    assert not found, "\n".join(found)


@pytest.fixture(scope="module")
def repository_v2(repository: Path) -> Path:
    train = repository / "configs" / "train.yaml"  # a comment, an lr, a note in nets.py
    old = "# Seed for weights, dropout and shuffling"
    train.write_text(train.read_text().replace(old, "# The seed of weights, dropout and shuffling"))
    convnet = repository / "configs" / "model" / "convnet.yaml"
    convnet.write_text(convnet.read_text().replace("lr: 0.005", "lr: 0.004") + "# added upstream\n")
    nets = repository / "src" / "project" / "models" / "nets.py"
    nets.write_text("# Upstream note on the networks.\n" + nets.read_text())
    subprocess.run(
        [sys.executable, "tools/make_template.py"], cwd=repository, check=True, timeout=120
    )
    commit_and_tag(repository, "v2")
    return repository


@pytest.mark.slow
@pytest.mark.timeout(SETUP_AND_RUN_S)
def test_copier_update_keeps_the_users_edits_and_a_conflict_cannot_train(
    projects: dict[str, Made], trained: CompletedProcess, repository_v2: Path
) -> None:
    made = projects[SET_UP]
    project = made.root
    nets = project / "src" / made.package / "models" / "nets.py"
    convnet = project / "configs" / "model" / "convnet.yaml"
    train = project / "configs" / "train.yaml"
    # The user's own edits, committed: a network, the lr line the template also changes, and the
    # seed: the line right below the comment the template rewords (adjacent lines conflict too).
    nets.write_text(nets.read_text() + "\n\nclass MyNet:  # the user's own network\n    pass\n")
    convnet.write_text(convnet.read_text().replace("lr: 0.005", "lr: 0.002"))
    train.write_text(train.read_text().replace("seed: 42", "seed: 7"))
    git(project, "commit", "-q", "-am", "our changes")

    update, see = bash_blocks(section(made.readme, "Template updates"))[0].splitlines()[:2]
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # where copier is
    updated = run(update.split("#")[0].split(), project, {**fresh_environment(), "PATH": path})
    assert updated.returncode == 0, updated.stderr[-3000:]
    assert "_commit: v2" in (project / ".copier-answers.yml").read_text()
    merged_nets = nets.read_text()
    assert merged_nets.startswith("# Upstream note on the networks.\n")  # the template's change
    assert "class MyNet:  # the user's own network" in merged_nets  # and the user's, both kept
    merged = convnet.read_text()
    assert "# added upstream" in merged
    assert "lr: 0.002" in merged and "lr: 0.004" in merged and "<<<<<<<" in merged
    assert "<<<<<<<" in train.read_text() and "seed: 7" in train.read_text()

    # The README's way to see them names each file with a conflict.
    seen = run(["bash", "-c", see.split("#")[0]], project)
    assert seen.returncode != 0
    assert "configs/train.yaml" in seen.stdout and "configs/model/convnet.yaml" in seen.stdout

    # A run refuses the conflicted config in one line, before it makes any directory.
    shutil.rmtree(project / "logs", ignore_errors=True)
    refused = run([".venv/bin/python", "-m", f"{made.package}.train"], project, fresh_environment())
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"error: configs/(train|model/convnet)\.yaml:\d+ has merge-conflict markers .*", lines[0]
    ), refused.stderr
    assert not (project / "logs").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "shown"),
    [("package_name=numpy", "is the name of a package the project"),
     ("package_name=lightning_runkit", "is the name of a"), ("package_name=hydra_plugins", "is the name of a"),
     ("package_name=json", "is the name of a package"), ("package_name=Acme-Vision", "is not a Python package name"),
     ("project_name=NumPy", None)],  # Copier checks a default before it asks: NumPy's is numpy_project
)  # fmt: skip
def test_a_package_name_that_would_break_the_project_is_refused_in_one_line(
    repository: Path, tmp_path: Path, data: str, shown: str | None
) -> None:
    where = tmp_path / "made"
    done = run([*COPIER, "copy", "--defaults", "--quiet", "--data", data, str(repository),
                str(where)], tmp_path)  # fmt: skip
    if shown is None:
        assert done.returncode == 0, done.stderr[-2000:]
        assert (where / "src" / "numpy_project" / "train.py").is_file()
        return
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{data} {shown}" in lines[0], done.stderr[-2000:]
    assert not where.exists()


@pytest.mark.slow
def test_asked_interactively_a_refused_package_name_is_said_at_the_prompt_and_asked_again(
    repository: Path, tmp_path: Path
) -> None:
    import pexpect  # a terminal for Copier's prompts

    where = tmp_path / "asked"
    child = pexpect.spawn(sys.executable, ["-m", "copier", "copy", str(repository), str(where)],
                          encoding="utf-8", timeout=120, dimensions=(40, 250))  # fmt: skip
    for prompts, answer in (
        (["project's name"], "NumPy"),
        (["package's name", "numpy_project"], "numpy"),  # the default offered is accepted
        (["package_name=numpy is the name of a package the project installs or imports"], "numpy_tools"),
    ):  # fmt: skip
        for prompt in prompts:
            child.expect(prompt)
        child.send("\x15")  # Ctrl-U: Copier's prompt starts filled with the default
        child.sendline(answer)
    child.expect("saying what the project does")  # accepted: the next question
    child.terminate(force=True)
    assert not where.exists()


def make_template() -> Any:  # tools/make_template.py, imported
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_template
    finally:
        sys.path.pop(0)
    return make_template


def test_the_refused_names_cover_everything_the_project_installs() -> None:
    found = re.search(r"set reserved = (\[.*?\]) -%\}", make_template().NAMES_FILE.read_text())
    assert found
    listed = set(json.loads(found.group(1)))
    missing = sorted(set(make_template().reserved_names()) - listed)
    assert not missing, f"not refused yet: {missing}; run python tools/make_template.py --names"
    assert {"numpy", "torch", "lightning", "lightning_runkit", "runkit", "hydra_plugins"} <= listed
