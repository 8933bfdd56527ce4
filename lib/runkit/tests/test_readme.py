"""README.md stays true: every command in its ``bash`` blocks is checked, its tables name real files.

Each command is looked up in :data:`CHECKS`, which says how it is proven:

* ``RUN``: run for real, in the README's order, in one temporary directory; a command that
  trains gets :data:`BUDGET` appended (one epoch: see there why), nothing else. The first,
  ``python -m project.train``, starts a fresh interpreter; the others fork from the prewarmed
  server (``prewarmed.py``), which spares each ~10 s of imports and nothing else;
* ``CLI``: run exactly as written (it trains nothing: ``--help``, ``--cfg job``, ``devices``);
* ``COMPOSE_ONLY``: composed by Hydra (it needs GPUs, which this machine lacks);
* ``DRY``: ``make -n`` or ``pytest --collect-only`` (running the suite from inside itself would
  recurse);
* ``SECTION``: run as written, in order, with the files its README section defines
  (``test_readme_sections.py``);
* ``SKIP``: not run here, with the reason (SLURM, several machines, network installs).

A README command missing from CHECKS fails the test, and so does a CHECKS entry the README no
longer has, so the two cannot drift apart. Every command of a ``bash`` block is RUN, CLI or
SECTION unless the README marks the block, on the line before it, with
``<!-- not run by the README test: <why> -->`` (GPUs, SLURM, several machines, the suite itself).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import prewarmed
from conftest import clean_env, run_dirs

ROOT = Path(__file__).resolve().parents[3]


class _Readmes:
    """The project's README, the library's and the pages they link, read as one text (the commands
    and claims of all)."""

    files = (
        ROOT / "README.md",
        ROOT / "lib" / "runkit" / "README.md",
        *sorted((ROOT / "lib" / "runkit" / "docs").glob("*.md")),
        ROOT / "docs" / "library-development.md",
    )

    def read_text(self) -> str:
        return "\n".join(path.read_text() for path in self.files)


README = _Readmes()
TRAIN_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m project.train"
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest"
BUDGET = ("trainer.max_epochs=1", "data.batch_size=256", "callbacks.progress_bar.refresh_rate=0")
"""Appended to every RUN command that trains (but the debug presets), visibly: the README's 20 to
25 epochs repeat the one epoch's code path, and a dozen full trainings would not fit the suite's
CI budget. The worked examples of "Your own model and data" run with their own epochs (SECTION)."""
MARKER = re.compile(r"^<!-- not run by the README test: (.+) -->$")

RUN, CLI, COMPOSE_ONLY, DRY, SKIP = "run", "cli", "compose-only", "dry", "skip"
SECTION = "section"  # run as written with its section's files: test_readme_sections.py


@dataclass(frozen=True)
class Check:
    how: str
    why: str = ""  # required for everything not run as written


GPU = "needs CUDA GPUs"
OWN = "test_readme_sections.py runs the section 'Your own model and data' as written"
PARALLEL = (
    "python -m project.train -m hydra/launcher=parallel hydra.launcher.n_jobs=2 "
    "model.optimizer.lr=0.01,0.001"
)
CHECKS: dict[str, Check] = {
    TRAIN_COMMAND: Check(SKIP, "creates .venv and pip-installs; the training it runs is RUN below"),
    TEST_COMMAND: Check(SKIP, "the suite itself; .ci/run runs it verbatim (checked below)"),
    "python -m project.train": Check(RUN),
    "python -m project.train trainer.max_epochs=3 model.optimizer.lr=0.01": Check(RUN),
    "python -m project.train model=mlp data.batch_size=128": Check(RUN),
    "python -m project.train experiment=example": Check(RUN),
    "python -m project.train --help": Check(CLI),
    "python -m project.train --cfg job": Check(CLI),
    "python -m runkit.devices": Check(CLI),
    "python -m runkit.devices --json": Check(CLI),
    # GPUs
    "python -m project.train trainer=gpu": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer.devices=2 select_gpus=least_used": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer.devices=[0,2]": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer.devices=2 select_gpus=least_used gpu_min_free_gib=20 gpu_max_util=30 gpu_wait_s=3600": Check(
        COMPOSE_ONLY, GPU
    ),
    "python -m runkit.devices --watch": Check(
        SKIP, "runs until Ctrl-C; tests/test_devices_cli.py drives it"
    ),
    "python -m runkit.devices --watch 0.5": Check(
        SKIP, "runs until Ctrl-C; tests/test_devices_cli.py drives it"
    ),
    "python -m runkit.devices --json --watch 5": Check(
        SKIP, "runs until Ctrl-C; tests/test_devices_cli.py drives it"
    ),
    "CUDA_VISIBLE_DEVICES=1,3 python -m project.train trainer.devices=2": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer=ddp trainer.devices=4": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer=dp trainer.devices=2": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer=fsdp trainer.devices=4": Check(COMPOSE_ONLY, GPU),
    "python -m project.train trainer=fsdp trainer.devices=2 trainer.accelerator=cpu": Check(RUN),
    "python -m project.train trainer=ddp_sim": Check(RUN),
    # Several machines
    "torchrun --nnodes=2 --nproc-per-node=4 --node-rank=0 --master-addr=node0 "
    "--master-port=29500 --rdzv-id=exp1 -m project.train trainer=multi_node trainer.devices=4": Check(
        SKIP, "two machines with 4 GPUs each; tests/test_multinode.py runs two nodes on localhost"
    ),
    "mkdir -p logs/slurm && sbatch scripts/slurm/train.sbatch": Check(SKIP, "needs SLURM"),
    "torchrun --nproc-per-node=4 --max-restarts=3 --rdzv-backend=c10d "
    "--rdzv-endpoint=localhost:29400 --rdzv-id=exp1 -m project.train trainer=multi_node "
    "trainer.num_nodes=1 trainer.devices=4": Check(
        SKIP, "4 GPUs; tests/test_multinode.py restarts a killed worker on two CPU processes"
    ),
    "python scripts/gpu_check.py --fetch-wheels": Check(
        SKIP, "downloads wheels; tests/test_gpu_check.py checks the folder logic"
    ),
    "python scripts/gpu_check.py --dry-run": Check(
        SKIP, "tests/test_gpu_check.py runs the dry run"
    ),
    "python scripts/gpu_check.py": Check(SKIP, "needs a GPU machine"),
    "python -m project.train -m hydra/launcher=slurm model.optimizer.lr=0.01,0.001": Check(
        SKIP, "needs SLURM and the slurm extra (submitit)"
    ),
    # Resume
    "python -m project.train ckpt_path=last": Check(RUN),
    "python -m project.train ckpt_path=logs/train/runs/<run>": Check(RUN),
    "python -m project.train callbacks.finite_loss.action=skip": Check(RUN),
    # Evaluate
    "python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth": Check(RUN),
    "python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth 'trusted_targets=[project.models.,project.data.,torch.nn.,torch.optim.,my_project.]'": Check(
        RUN
    ),
    "python -m project.eval ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt": Check(RUN),
    # Predict
    "python -m project.predict ckpt_path=logs/train/runs/<run>": Check(RUN),
    "python -m project.predict ckpt_path=logs/train/runs/<run>/model.pth data.batch_size=512 "
    "trainer.devices=2": Check(RUN),
    # Plots
    "python -m runkit.plot logs/train/runs/<run>": Check(RUN),
    "python -m runkit.plot logs/train/multiruns/<sweep>": Check(RUN),
    "python -m runkit.plot logs/train/runs/<run> logs/train/runs/<other-run> --out compare.png": Check(
        RUN
    ),
    # Sweeps
    "python -m project.train -m model.optimizer.lr=0.01,0.001": Check(RUN),
    PARALLEL: Check(RUN),
    f"{PARALLEL} hydra.sweep.dir=logs/train/multiruns/<that-sweep>": Check(RUN),
    "python -m project.train -m hparams_search=optuna": Check(
        SKIP, "needs the optuna extra (a network install) and 20 trainings"
    ),
    # Debug presets
    "python -m project.train debug=fdr": Check(RUN),
    "python -m project.train debug=overfit": Check(RUN),
    "python -m project.train debug=limit": Check(RUN),
    "python -m project.train debug=profiler": Check(RUN),
    # Your own model and data: run as written, in order, with the section's files
    "python make_table.py": Check(SECTION, OWN),
    "PYTHONPATH=. python -m project.train --config-dir my_configs model=tiny data=my_csv": Check(
        SECTION, OWN
    ),
    "PYTHONPATH=. python -m project.train --config-dir my_configs experiment=regression": Check(
        SECTION, OWN
    ),
    "PYTHONPATH=. python -m project.train --config-dir my_configs experiment=regression "
    "trainer.devices=2": Check(SECTION, OWN),
    "PYTHONPATH=. python -m project.eval ckpt_path=logs/train/runs/<run> "
    "'trusted_targets=[my_project.]'": Check(SECTION, OWN),
    # Tests
    "python -m pytest": Check(SKIP, "the suite itself (TEST_COMMAND)"),
    'python -m pytest -m "not slow"': Check(DRY, "the suite itself"),
    "python -m pytest lib/runkit/tests/test_plot.py": Check(DRY, "the suite itself"),
    "python -m pytest tests": Check(DRY, "the project's own tests, run by the suite itself"),
    "pip install copier": Check(SKIP, "installs from PyPI; the dev extra has it"),
    "copier copy <this repository> my-project": Check(
        SKIP, "tests/test_template.py makes a project from a local git repository of the template"
    ),
    "copier update --skip-answered": Check(
        SKIP, "tests/test_template.py updates such a project to a later tagged version"
    ),
    "git status && git diff --check": Check(
        SKIP, "tests/test_template.py runs it after an update that conflicts"
    ),
    "python -m pytest -m gpu": Check(DRY, "the suite itself"),
    # Developer tools
    "make help": Check(CLI),
    "make test-fast": Check(DRY, "the suite itself"),
    "make lint": Check(DRY, "lints the whole tree, which other work in progress may not pass"),
    "make format": Check(DRY, "rewrites files"),
    "make plot": Check(DRY, "the newest run of the repository's own logs/"),
    "pre-commit install": Check(SKIP, "writes git hooks and fetches the hook repositories"),
}


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of README's ``bash`` blocks: continuation lines joined, comments removed."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(re.sub(r"\s+", " ", command))
    return commands


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """``VAR=x python -m m args`` -> ({VAR: x}, [python, -m, m, args])."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def argv(words: list[str]) -> list[str]:
    """Run README's ``python`` / ``.venv/bin/python`` as this interpreter."""
    if words and words[0] in ("python", ".venv/bin/python"):
        return [sys.executable, *words[1:]]
    return words


# ------------------------------------------------------------------------------------------------
# Fast checks


def test_every_readme_command_is_checked_and_every_check_is_in_readme() -> None:
    commands = readme_commands()
    unchecked = [c for c in commands if c not in CHECKS]
    assert not unchecked, f"README commands without an entry in CHECKS: {unchecked}"
    stale = [c for c in CHECKS if c not in commands]
    assert not stale, f"CHECKS entries README no longer has: {stale}"
    for command, check in CHECKS.items():
        assert check.how in (RUN, CLI) or check.why, f"{command!r} needs a reason"


def marked_blocks() -> list[tuple[str | None, list[str]]]:
    """Every ``bash`` block of both READMEs: the reason its marker gives (None: unmarked), its
    commands."""
    found = []
    for path in README.files:
        lines = path.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line != "```bash\n":
                continue
            end = lines.index("```\n", i + 1)
            marker = MARKER.match(lines[i - 1].strip())
            block = "".join(lines[i : end + 1])
            found.append((marker.group(1) if marker else None, readme_commands(block)))
    return found


def test_every_command_of_an_unmarked_block_runs() -> None:
    blocks = marked_blocks()
    assert len(blocks) == README.read_text().count("```bash\n")
    for reason, commands in blocks:
        if reason is None:
            idle = [c for c in commands if CHECKS[c].how not in (RUN, CLI, SECTION)]
            assert not idle, f"README commands not run and not marked as such: {idle}"
        else:
            assert any(CHECKS[c].how not in (RUN, CLI, SECTION) for c in commands), (
                f"a marked block whose commands all run: {commands}"
            )


def test_readme_extraction_joins_continuations_and_drops_comments() -> None:
    text = "```bash\n# a comment\npython -m a \\\n  x=1   # why\n```\n```text\nnot this\n```\n"
    assert readme_commands(text) == ["python -m a x=1"]


def test_fresh_machine_commands_are_in_readme_and_ci_runs_the_test_one() -> None:
    text = README.read_text()
    assert f"```bash\n{TRAIN_COMMAND}\n```" in text
    assert f"```bash\n{TEST_COMMAND}\n```" in text
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci, ".ci/run must run README's test command verbatim, on its own line"


def test_layout_names_files_that_exist() -> None:
    block = README.read_text().split("## Layout", 1)[1]
    listing = re.search(r"```text\n(.*?)```", block, flags=re.S)
    assert listing
    parent = ""
    checked = 0
    for line in listing.group(1).splitlines():
        indent = len(line) - len(line.lstrip())
        if indent > 2:
            continue  # a description running on from the line above
        match = re.match(r"[\w./-]+(?:, [\w./-]+)*", line.strip())
        if not match:
            continue
        names = match.group(0)
        if indent == 0:
            parent = names if names.endswith("/") else ""
        for name in names.split(", "):
            path = ROOT / (name if indent == 0 else parent + name)
            assert path.exists(), (
                f"README's layout lists {path.relative_to(ROOT)}, which is missing"
            )
            checked += 1
    assert checked > 12


def test_config_group_table_names_real_options() -> None:
    text = README.read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", text, flags=re.M)
    groups = {group: options for group, options in rows if (ROOT / "configs" / group).is_dir()}
    assert {"data", "model", "trainer", "callbacks", "logger", "debug", "experiment"} <= set(groups)
    for group, options in groups.items():
        for option in re.findall(r"`([\w]+)`", options):
            path = ROOT / "configs" / group / f"{option}.yaml"
            assert path.is_file(), f"README's config table names {group}={option}; no {path}"


def _compose(command: str) -> None:
    from hydra import compose, initialize_config_dir

    from project import config_dir

    _, words = split(command)
    assert words[:2] == ["python", "-m"], command
    config_name = {"project.train": "train", "project.eval": "eval", "project.predict": "predict"}[
        words[2]
    ]
    overrides = [w.replace("<run>", "some-run") for w in words[3:]]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        compose(config_name=config_name, overrides=overrides)  # what Hydra refuses fails here


@pytest.mark.parametrize("command", [c for c, k in CHECKS.items() if k.how == COMPOSE_ONLY])
def test_composed_commands(command: str) -> None:
    _compose(command)


# ------------------------------------------------------------------------------------------------
# Commands that run


def _run(
    command: str, cwd: Path, extra: tuple[str, ...] = (), fresh: bool = False
) -> subprocess.CompletedProcess:
    """``command`` as written (and ``extra``), in ``cwd``; it must succeed. A ``python -m
    project.<task>`` command forks from the prewarmed server (``prewarmed.py``: its own process,
    arguments, directory and environment, only the imports done already) unless ``fresh``."""
    env, words = split(command)
    result = (subprocess.run if fresh else prewarmed.run)(
        [*argv(words), *extra],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_cli_commands_run_as_written(tmp_path: Path) -> None:
    for command in (c for c, k in CHECKS.items() if k.how == CLI):
        cwd = ROOT if command.startswith("make") else tmp_path
        extra = ("PY=" + sys.executable,) if command.startswith("make") else ()
        _run(command, cwd, extra)
    assert not (tmp_path / "logs").exists()  # none of them started a run


@pytest.mark.slow
def test_dry_run_commands_name_real_targets_and_tests() -> None:
    def dry_run(command: str) -> None:
        if command.startswith("make"):
            result = _run(command.replace("make", "make -n", 1), ROOT, ("PY=" + sys.executable,))
            assert sys.executable in result.stdout
        else:
            result = _run(command, ROOT, ("--collect-only", "-q", "-p", "no:cacheprovider"))
            assert re.search(r"\d+ tests? collected|\d+/\d+ tests collected", result.stdout), (
                result.stdout[-500:]
            )

    # Side by side: each pytest collection is a fresh interpreter importing torch (~7 s), and
    # none writes anything (no cache provider).
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(dry_run, [c for c, k in CHECKS.items() if k.how == DRY]))


def budget(command: str) -> tuple[str, ...]:
    """:data:`BUDGET`'s overrides for a command that trains, less the keys the command sets. The
    debug presets run as written: short already, and each sets its own batches and epochs."""
    if "project.train" not in command or "debug=" in command:
        return ()
    own = {word.partition("=")[0] for word in shlex.split(command)}
    return tuple(o for o in BUDGET if o.partition("=")[0] not in own)


@pytest.mark.slow
def test_run_commands_in_a_fresh_directory(tmp_path: Path) -> None:
    """Every RUN command, sharing one directory: first the run the others evaluate, resume and
    plot, then the rest in the README's order."""
    text = README.read_text()
    log_dir = tmp_path / "logs"
    ran: list[str] = []

    def run(command: str, *extra: str, fresh: bool = False) -> subprocess.CompletedProcess:
        ran.append(command)
        filled = (
            command.replace("logs/train/runs/<run>", str(first.relative_to(tmp_path)))
            .replace("logs/train/runs/<other-run>", str(resumed.relative_to(tmp_path)))
            .replace("logs/train/multiruns/<sweep>", str(sweep.relative_to(tmp_path)))
            .replace("logs/train/multiruns/<that-sweep>", str(parallel.relative_to(tmp_path)))
        )
        return _run(filled, tmp_path, (*budget(command), *extra), fresh)

    first = resumed = sweep = parallel = tmp_path / "unused"
    run("python -m project.train", fresh=True)  # the first in an interpreter of its own
    (first,) = run_dirs(log_dir)
    assert (first / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by every run
    report = json.loads((first / "metrics.json").read_text())

    # A 1-epoch run resumed with 1 epoch has nothing left to train: this one asks for a second.
    run("python -m project.train ckpt_path=last", "trainer.max_epochs=2")
    (resumed,) = set(run_dirs(log_dir)) - {first}
    assert json.loads((resumed / "metrics.json").read_text())["resumed_from"]
    run("python -m project.train ckpt_path=logs/train/runs/<run>", "trainer.max_epochs=2")
    (named,) = set(run_dirs(log_dir)) - {first, resumed}
    assert first.name in json.loads((named / "metrics.json").read_text())["resumed_from"]

    run("python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth")
    (evaluated,) = run_dirs(log_dir, "eval")
    tested = json.loads((evaluated / "metrics.json").read_text())["metrics"]["test/acc"]
    assert abs(tested - report["metrics"]["test/acc"]) <= 1e-3
    for command in (c for c, k in CHECKS.items() if k.how == RUN and "project.eval" in c):
        if command not in ran:
            run(command)
    assert len(run_dirs(log_dir, "eval")) == 3

    run("python -m project.train -m model.optimizer.lr=0.01,0.001")
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]

    # Two jobs at once; the same sweep in its own folder again finds both finished.
    run(PARALLEL)
    (parallel,) = set((log_dir / "train" / "multiruns").iterdir()) - {sweep}
    assert (parallel / "summary.csv").is_file()
    again = run(f"{PARALLEL} hydra.sweep.dir=logs/train/multiruns/<that-sweep>")
    assert "2 job(s) skipped (finished earlier), 0 resumed, 0 started" in again.stdout

    (first / "curves.png").unlink()
    for command in (c for c, k in CHECKS.items() if k.how == RUN and "runkit.plot " in c):
        run(command)
    assert (first / "curves.png").is_file() and (sweep / "curves.png").is_file()
    assert (tmp_path / "compare.png").is_file()

    run("python -m project.train debug=fdr")
    assert run_dirs(log_dir, "debug")

    # Every other command that trains, each a run of its own (DDP and FSDP on 2 CPU processes).
    # Predict's runs go to logs/predict/, each with its predictions.
    def counted() -> int:
        return sum(len(run_dirs(log_dir, task)) for task in ("train", "debug", "predict"))

    before = counted()
    rest = [c for c, k in CHECKS.items() if k.how == RUN and c not in ran]
    for command in rest:
        run(command)
    assert counted() == before + len(rest)
    assert all((d / "predictions.pt").is_file() for d in run_dirs(log_dir, "predict"))

    # README's snippets that load model.pth: onto the chosen device, and with a longer allow-list.
    outputs = []
    for snippet in [b for b in python_blocks(text) if "load_network" in b]:
        code = snippet.replace("logs/train/runs/<run>", str(first.relative_to(tmp_path)))
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout)
    assert len(outputs) == 2
    assert re.fullmatch(r"tensor\(\[(\d, ){4}\d\]\)\n", outputs[0]), outputs[0]
    assert sorted(ran) == sorted(c for c, k in CHECKS.items() if k.how == RUN)


# ------------------------------------------------------------------------------------------------
# Claims in README's prose and tables


def _reliability_row(test_id: str) -> str:
    (row,) = [line for line in README.read_text().splitlines() if line.startswith(f"| `{test_id}`")]
    return row


def test_readme_tells_the_flow_in_its_own_words() -> None:
    """No reference to an article the reader cannot see; the flow is spelled out, in order."""
    text = README.read_text()
    assert "article" not in text.lower()
    flow = text.split("**The flow.**", 1)[1].split("\n\n", 1)[0]
    steps = ["check the GPUs", "train on the CPU", "choose which", "build the data and the model",
             "; train;", "evaluate the best", "save the tested network as `model.pth`",
             "restores onto any device"]  # fmt: skip
    positions = [flow.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), list(
        zip(steps, positions, strict=True)
    )


def test_the_ddp_row_claims_what_its_test_asserts() -> None:
    row = _reliability_row("test_ddp_metrics_count_every_sample_once")
    assert "the accuracy equals one process's to the last bit" in row
    assert "the loss agrees to float32 rounding, within a relative 1e-6, not to the bit" in row
    source = (ROOT / "lib" / "runkit" / "tests" / "test_data.py").read_text()
    body = source.split("def test_ddp_metrics_count_every_sample_once", 1)[1]
    assert 'assert validated["val/acc"] == logged["val/acc"]' in body  # exact: to the bit
    assert 'assert tested["test/acc"] == logged["test/acc"]' in body
    for key in ('validated["val/loss"]', 'tested["test/loss"]'):
        assert f"assert {key} == pytest.approx(" in body and "rel=1e-6, abs=0)" in body


def test_the_makefile_claim_matches_the_makefile() -> None:
    text = " ".join(README.read_text().split())
    assert (
        "They run `.venv/bin/python` when there is a `.venv`, else the `python3` on `PATH`" in text
    )
    (line,) = [x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("PY ?=")]
    assert "$(wildcard .venv/bin/python),.venv/bin/python," in line and "python3" in line


def test_the_fast_test_figure_is_a_measurement_with_its_date() -> None:
    text = (ROOT / "docs" / "library-development.md").read_text()
    assert "(seconds)" not in text
    (line,) = [x for x in text.splitlines() if x.startswith('python -m pytest -m "not slow"')]
    assert re.search(r"# the fast tests only \(\d+ s on 2 cores, \d{4}-\d{2}-\d{2}\)$", line), line


@pytest.mark.slow
def test_the_crafted_checkpoint_row_is_the_line_eval_prints(tmp_path: Path) -> None:
    from test_untrusted_files import crafted_checkpoint

    import prewarmed

    victim = tmp_path / "keep me.txt"
    victim.write_text("precious")
    net = {"_target_": "pathlib.Path.unlink", "_args_": [str(victim)]}
    path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": net}, "data": {}})
    done = prewarmed.run(
        [sys.executable, "-m", "project.eval", f"ckpt_path={path}", f"paths.log_dir={tmp_path}"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    row = _reliability_row("test_eval_of_a_crafted_checkpoint_deletes_nothing")
    shown = re.search(r"\| `(error: .*?)` \(exit 2\) \|", row)
    assert shown, row
    printed = done.stderr.strip().splitlines()[-1]
    assert printed == shown.group(1).replace("…/", f"{tmp_path}/")
    assert victim.read_text() == "precious"
