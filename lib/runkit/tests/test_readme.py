"""README.md stays true: :data:`CHECKS` says how each ``bash`` command is proven (or why not)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

import prewarmed
from conftest import clean_env, run_dirs

ROOT = Path(__file__).resolve().parents[3]
OWN = ROOT / "lib" / "runkit" / "docs" / "own-model-and-data.md"  # run as written, a test below

READMES = (ROOT / "README.md", ROOT / "lib" / "runkit" / "README.md",
           *sorted((ROOT / "lib" / "runkit" / "docs").glob("*.md")),
           ROOT / "docs" / "library-development.md")  # fmt: skip


def readme() -> str:
    return "\n".join(path.read_text() for path in READMES)


TRAIN_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m project.train"
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest"
# Appended to RUN commands that train: one epoch, a narrower ConvNet run the same code path.
BUDGET = ("trainer.max_epochs=1", "data.batch_size=256", "callbacks.progress_bar.refresh_rate=0")
NARROW = "model.net.channels=[8,16]"
MARKER = re.compile(r"^<!-- not run by the README test: (.+) -->$")
RUN, CLI, COMPOSE_ONLY, DRY, SKIP, SECTION = "run", "cli", "compose-only", "dry", "skip", "section"


def _same(how: str, why: str, *commands: str) -> dict[str, tuple[str, str]]:
    return {command: (how, why) for command in commands}


T = "python -m project.train"
PARALLEL = f"{T} -m hydra/launcher=parallel hydra.launcher.n_jobs=2 model.optimizer.lr=0.01,0.001"
SUITE = "the suite itself"
WATCH = "runs until Ctrl-C; tests/test_devices_cli.py drives it"
CHECKS: dict[str, tuple[str, str]] = {  # how, why (unless RUN, CLI)
    TRAIN_COMMAND: (SKIP, "creates .venv and pip-installs; the training it runs is RUN below"),
    TEST_COMMAND: (SKIP, "the suite itself; .ci/run runs it verbatim (checked below)"),
    **_same(
        RUN, "", T, f"{T} trainer.max_epochs=3 model.optimizer.lr=0.01",
        f"{T} model=mlp data.batch_size=128", f"{T} experiment=example",
        f"{T} trainer=fsdp trainer.devices=2 trainer.accelerator=cpu", f"{T} trainer=ddp_sim",
        f"{T} ckpt_path=last", f"{T} ckpt_path=logs/train/runs/<run>",
        f"{T} callbacks.finite_loss.action=skip",
        "python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth",
        "python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth 'trusted_targets=[project.models.,project.data.,torch.nn.,torch.optim.,my_project.]'",
        "python -m project.eval ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt",
        "python -m project.predict ckpt_path=logs/train/runs/<run>",
        "python -m project.predict ckpt_path=logs/train/runs/<run>/model.pth data.batch_size=512 trainer.devices=2",
        "python -m runkit.plot logs/train/runs/<run>", "python -m runkit.plot logs/train/multiruns/<sweep>",
        "python -m runkit.plot logs/train/runs/<run> logs/train/runs/<other-run> --out compare.png",
        f"{T} -m model.optimizer.lr=0.01,0.001", PARALLEL,
        f"{PARALLEL} hydra.sweep.dir=logs/train/multiruns/<that-sweep>",
        *(f"{T} debug={d}" for d in ("fdr", "overfit", "limit", "profiler")),
    ),
    **_same(
        CLI, "", f"{T} --help", f"{T} --cfg job", "python -m runkit.devices",
        "python -m runkit.devices --json", "make help",
    ),
    **_same(
        COMPOSE_ONLY, "needs CUDA GPUs", f"{T} trainer=gpu",
        f"{T} trainer.devices=2 select_gpus=least_used", f"{T} trainer.devices=[0,2]",
        f"{T} trainer.devices=2 select_gpus=least_used gpu_min_free_gib=20 gpu_max_util=30 gpu_wait_s=3600",
        f"CUDA_VISIBLE_DEVICES=1,3 {T} trainer.devices=2", f"{T} trainer=ddp trainer.devices=4",
        f"{T} trainer=dp trainer.devices=2", f"{T} trainer=fsdp trainer.devices=4",
    ),
    **_same(
        SKIP, WATCH, "python -m runkit.devices --watch", "python -m runkit.devices --watch 0.5",
        "python -m runkit.devices --json --watch 5",
    ),
    "torchrun --nnodes=2 --nproc-per-node=4 --node-rank=0 --master-addr=node0 --master-port=29500 "
    "--rdzv-id=exp1 -m project.train trainer=multi_node trainer.devices=4": (SKIP, "two machines with 4 GPUs each; tests/test_multinode.py runs two nodes on localhost"),
    "mkdir -p logs/slurm && sbatch scripts/slurm/train.sbatch": (SKIP, "needs SLURM"),
    "torchrun --nproc-per-node=4 --max-restarts=3 --rdzv-backend=c10d "
    "--rdzv-endpoint=localhost:29400 --rdzv-id=exp1 -m project.train trainer=multi_node "
    "trainer.num_nodes=1 trainer.devices=4": (SKIP, "4 GPUs; tests/test_multinode.py restarts a killed worker on two CPU processes"),
    "python scripts/gpu_check.py --fetch-wheels": (SKIP, "downloads wheels; tests/test_gpu_check.py checks the folder logic"),
    "python scripts/gpu_check.py --dry-run": (SKIP, "tests/test_gpu_check.py runs the dry run"),
    "python scripts/gpu_check.py": (SKIP, "needs a GPU machine"),
    f"{T} -m hydra/launcher=slurm model.optimizer.lr=0.01,0.001": (SKIP, "needs SLURM and the slurm extra (submitit)"),
    f"{T} -m hparams_search=optuna": (SKIP, "needs the optuna extra (a network install) and 20 trainings"),
    **_same(
        SECTION, "test_your_own_model_and_data_runs_as_written runs its section as written",
        "python make_table.py",
        "PYTHONPATH=. python -m project.train --config-dir my_configs model=tiny data=my_csv",
        "PYTHONPATH=. python -m project.train --config-dir my_configs experiment=regression",
        "PYTHONPATH=. python -m project.train --config-dir my_configs experiment=regression trainer.devices=2",
        "PYTHONPATH=. python -m project.eval ckpt_path=logs/train/runs/<run> 'trusted_targets=[my_project.]'",
    ),
    "python -m pytest": (SKIP, "the suite itself (TEST_COMMAND)"),
    **_same(
        DRY, SUITE, 'python -m pytest -m "not slow"', "python -m pytest lib/runkit/tests/test_plot.py",
        "python -m pytest -m gpu", "make test-fast",
    ),
    "python -m pytest tests": (DRY, "the project's own tests, run by the suite itself"),
    "pip install copier": (SKIP, "installs from PyPI; the dev extra has it"),
    "copier copy <this repository> my-project": (SKIP, "tests/test_template.py makes a project from a local git repository of the template"),
    "copier update --skip-answered": (SKIP, "tests/test_template.py updates such a project to a later tagged version"),
    "git status && git diff --check": (SKIP, "tests/test_template.py runs it after an update that conflicts"),
    "make lint": (DRY, "lints the whole tree, which other work in progress may not pass"),
    "make format": (DRY, "rewrites files"),
    "make plot": (DRY, "the newest run of the repository's own logs/"),
    "pre-commit install": (SKIP, "writes git hooks and fetches the hook repositories"),
}  # fmt: skip


def of(how: str) -> list[str]:
    return [c for c, k in CHECKS.items() if k[0] == how]


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of the ``bash`` blocks: continuation lines joined, comments removed."""
    text = readme() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(re.sub(r"\s+", " ", command))
    return commands


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """``VAR=x python -m m args`` -> ({VAR: x}, [sys.executable, -m, m, args])."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words and words[0] in ("python", ".venv/bin/python"):
        words[0] = sys.executable
    return env, words


def test_every_readme_command_is_checked_and_every_check_is_in_readme() -> None:
    commands = readme_commands()
    unchecked, stale = set(commands) - CHECKS.keys(), CHECKS.keys() - set(commands)
    assert not unchecked and not stale, f"not in CHECKS: {unchecked}; not in README: {stale}"
    assert all(k[0] in (RUN, CLI) or k[1] for k in CHECKS.values())
    text = "```bash\n# a comment\npython -m a \\\n  x=1   # why\n```\n```text\nnot this\n```\n"
    assert readme_commands(text) == ["python -m a x=1"]


def test_every_command_of_an_unmarked_block_runs() -> None:
    counted = 0
    for path in READMES:
        lines = path.read_text().splitlines(keepends=True)
        for i in (i for i, line in enumerate(lines) if line == "```bash\n"):
            counted += 1
            end = lines.index("```\n", i + 1)
            idle = [c for c in readme_commands("".join(lines[i : end + 1])) if CHECKS[c][0]
                    not in (RUN, CLI, SECTION)]  # fmt: skip
            marked = MARKER.match(lines[i - 1].strip())
            assert bool(idle) == bool(marked), f"{path.name}: marker and commands disagree: {idle}"
    assert counted == readme().count("```bash\n")


def test_fresh_machine_commands_are_in_readme_and_ci_runs_the_test_one() -> None:
    text = readme()
    assert f"```bash\n{TRAIN_COMMAND}\n```" in text and f"```bash\n{TEST_COMMAND}\n```" in text
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def test_layout_names_files_that_exist() -> None:
    listing = re.search(r"```text\n(.*?)```", readme().split("## Layout", 1)[1], re.S)
    assert listing
    parent, checked = "", 0
    for line in listing.group(1).splitlines():
        indent = len(line) - len(line.lstrip())
        match = re.match(r"[\w./-]+(?:, [\w./-]+)*", line.strip())
        if indent > 2 or not match:
            continue  # a description running on from the line above
        if indent == 0:
            parent = match.group(0) if match.group(0).endswith("/") else ""
        for name in match.group(0).split(", "):
            assert (ROOT / (name if indent == 0 else parent + name)).exists(), name
            checked += 1
    assert checked > 12


def test_config_group_table_names_real_options() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", readme(), flags=re.M)
    groups = {group: options for group, options in rows if (ROOT / "configs" / group).is_dir()}
    assert {"data", "model", "trainer", "callbacks", "logger", "debug", "experiment"} <= set(groups)
    for group, options in groups.items():
        for option in re.findall(r"`([\w]+)`", options):
            assert (ROOT / "configs" / group / f"{option}.yaml").is_file(), f"{group}={option}"


@pytest.mark.parametrize("command", of(COMPOSE_ONLY))
def test_composed_commands(command: str) -> None:
    from hydra import compose, initialize_config_dir

    from project import config_dir

    _, words = split(command)
    overrides = [w.replace("<run>", "some-run") for w in words[3:]]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        compose(config_name=words[2].removeprefix("project."), overrides=overrides)


def _run(
    command: str, cwd: Path, extra: tuple[str, ...] = (), fresh: bool = False
) -> subprocess.CompletedProcess:
    env, words = split(command)
    result = (subprocess.run if fresh else prewarmed.run)(
        [*words, *extra], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_cli_and_dry_run_commands(tmp_path: Path) -> None:
    def one(command: str) -> None:
        make = ("PY=" + sys.executable,) if command.startswith("make") else ()
        if CHECKS[command][0] == CLI:
            _run(command, ROOT if make else tmp_path, make)
        elif make:
            assert sys.executable in _run(command.replace("make", "make -n", 1), ROOT, make).stdout
        else:
            out = _run(command, ROOT, ("--collect-only", "-q", "-p", "no:cacheprovider")).stdout
            assert re.search(r"\d+(/\d+)? tests? collected", out), out[-500:]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, of(CLI) + of(DRY)))
    assert not (tmp_path / "logs").exists()


def budget(command: str) -> tuple[str, ...]:
    if "project.train" not in command:
        return ()
    own = {word.partition("=")[0] for word in shlex.split(command)}
    kept = tuple(o for o in BUDGET if o.partition("=")[0] not in own)
    kept = kept[:1] if "debug" in own else kept  # a debug preset's own settings, one epoch
    return (*kept, *(() if own & {"model", "experiment"} else (NARROW,)))


@pytest.mark.slow
def test_run_commands_in_a_fresh_directory(tmp_path: Path) -> None:
    logs, ran, places = tmp_path / "logs", [], {}
    multiruns = logs / "train" / "multiruns"

    def run(command: str, *extra: str, fresh: bool = False) -> subprocess.CompletedProcess:
        ran.append(command)
        filled = command
        for placeholder, path in places.items():
            filled = filled.replace(placeholder, str(path.relative_to(tmp_path)))
        return _run(filled, tmp_path, (*budget(command), *extra), fresh)

    run(T, fresh=True)  # the first in an interpreter of its own
    (first,) = run_dirs(logs)
    places["logs/train/runs/<run>"] = first
    assert (first / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by every run
    report = json.loads((first / "metrics.json").read_text())

    # A 1-epoch run resumed with 1 epoch has nothing left to train: these ask for a second.
    run(f"{T} ckpt_path=last", "trainer.max_epochs=2")
    (resumed,) = set(run_dirs(logs)) - {first}
    assert json.loads((resumed / "metrics.json").read_text())["resumed_from"]
    places["logs/train/runs/<other-run>"] = resumed
    run(f"{T} ckpt_path=logs/train/runs/<run>", "trainer.max_epochs=2")
    (named,) = set(run_dirs(logs)) - {first, resumed}
    assert first.name in json.loads((named / "metrics.json").read_text())["resumed_from"]

    run("python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth")
    (evaluated,) = run_dirs(logs, "eval")
    tested = json.loads((evaluated / "metrics.json").read_text())["metrics"]["test/acc"]
    assert abs(tested - report["metrics"]["test/acc"]) <= 1e-3
    for command in (c for c in of(RUN) if "project.eval" in c and c not in ran):
        run(command)
    assert len(run_dirs(logs, "eval")) == 3

    run(f"{T} -m model.optimizer.lr=0.01,0.001")
    (sweep,) = multiruns.iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    places["logs/train/multiruns/<sweep>"] = sweep
    run(PARALLEL)  # two jobs at once; again in its own folder, it finds both finished
    (parallel,) = set(multiruns.iterdir()) - {sweep}
    assert (parallel / "summary.csv").is_file()
    places["logs/train/multiruns/<that-sweep>"] = parallel
    again = run(f"{PARALLEL} hydra.sweep.dir=logs/train/multiruns/<that-sweep>")
    assert "2 job(s) skipped (finished earlier), 0 resumed, 0 started" in again.stdout

    (first / "curves.png").unlink()
    for command in (c for c in of(RUN) if "runkit.plot " in c):
        run(command)
    assert (first / "curves.png").is_file() and (sweep / "curves.png").is_file()
    assert (tmp_path / "compare.png").is_file()
    run(f"{T} debug=fdr")
    assert run_dirs(logs, "debug")

    # Every other command that trains, each a run of its own; predict's write their predictions.
    def counted() -> int:
        return sum(len(run_dirs(logs, task)) for task in ("train", "debug", "predict"))

    before, rest = counted(), [c for c in of(RUN) if c not in ran]
    for command in rest:
        run(command)
    assert counted() == before + len(rest) and sorted(ran) == sorted(of(RUN))
    assert all((d / "predictions.pt").is_file() for d in run_dirs(logs, "predict"))

    # The snippets that load model.pth: onto the chosen device, and with a longer allow-list.
    snippets = re.findall(r"^```python\n(.*?)^```", readme(), flags=re.S | re.M)
    outputs = []
    for snippet in (s for s in snippets if "load_network" in s):
        code = snippet.replace("logs/train/runs/<run>", str(first.relative_to(tmp_path)))
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_env(),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert len(outputs) == 2 and re.fullmatch(r"tensor\(\[(\d, ){4}\d\]\)\n", outputs[0])


def _row(test_id: str) -> str:
    (row,) = [line for line in readme().splitlines() if line.startswith(f"| `{test_id}`")]
    return row


def test_readme_tells_the_flow_in_its_own_words() -> None:
    text = readme()
    assert "article" not in text.lower()
    flow = text.split("**The flow.**", 1)[1].split("\n\n", 1)[0]
    steps = ["check the GPUs", "train on the CPU", "choose which", "build the data and the model",
             "; train;", "evaluate the best", "save the tested network as `model.pth`",
             "restores onto any device"]  # fmt: skip
    positions = [flow.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), positions


def test_the_ddp_row_claims_what_its_test_asserts() -> None:
    row = _row("test_ddp_metrics_count_every_sample_once")
    assert "the accuracy equals one process's to the last bit" in row
    assert "the loss agrees to float32 rounding, within a relative 1e-6, not to the bit" in row
    source = (ROOT / "lib" / "runkit" / "tests" / "test_data.py").read_text()
    body = source.split("def test_ddp_metrics_count_every_sample_once", 1)[1]
    assert 'assert validated["val/acc"] == logged["val/acc"]' in body  # exact: to the bit
    assert 'assert tested["test/acc"] == logged["test/acc"]' in body
    for key in ('validated["val/loss"]', 'tested["test/loss"]'):
        assert f"assert {key} == pytest.approx(" in body and "rel=1e-6, abs=0)" in body


def test_the_makefile_and_fast_test_claims() -> None:
    said = "They run `.venv/bin/python` when there is a `.venv`, else the `python3` on `PATH`"
    assert said in " ".join(readme().split())
    (line,) = [x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("PY ?=")]
    assert "$(wildcard .venv/bin/python),.venv/bin/python," in line and "python3" in line
    dev = (ROOT / "docs" / "library-development.md").read_text()  # a measurement, with its date
    (line,) = [x for x in dev.splitlines() if x.startswith('python -m pytest -m "not slow"')]
    assert "(seconds)" not in dev
    assert re.search(r"# the fast tests only \(\d+ s on 2 cores, \d{4}-\d{2}-\d{2}\)$", line), line


@pytest.mark.slow
def test_the_crafted_checkpoint_row_is_the_line_eval_prints(tmp_path: Path) -> None:
    from test_untrusted_files import crafted_checkpoint

    victim = tmp_path / "keep me.txt"
    victim.write_text("precious")
    net = {"_target_": "pathlib.Path.unlink", "_args_": [str(victim)]}
    path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": net}, "data": {}})
    done = prewarmed.run(
        [sys.executable, "-m", "project.eval", f"ckpt_path={path}", f"paths.log_dir={tmp_path}"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    row = _row("test_eval_of_a_crafted_checkpoint_deletes_nothing")
    shown = re.search(r"\| `(error: .*?)` \(exit 2\) \|", row)
    assert shown
    assert done.stderr.strip().splitlines()[-1] == shown.group(1).replace("…/", f"{tmp_path}/")
    assert victim.read_text() == "precious"


class Block(NamedTuple):
    lang: str
    text: str


def blocks(text: str) -> list[Block]:
    return [Block(*found) for found in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def file_path(block: Block) -> str | None:
    """The path a file block names (``# my_project/nets.py``, ``# a.yaml: why``), else None."""
    if block.lang not in ("python", "yaml"):
        return None
    for line in block.text.splitlines():
        if re.match(r"#\s*@", line):
            continue  # a Hydra header: it has to come first
        found = re.match(r"# ((?:[\w.-]+/)*[\w.-]+\.(?:py|yaml))(?::\s|$)", line)
        return found.group(1) if found else None
    return None


def shell_env() -> dict[str, str]:  # a user's shell: ``python`` is this one, no PYTHONPATH
    env = clean_env()
    env.pop("PYTHONPATH", None)
    env.pop("OMP_NUM_THREADS", None)  # the suite's one thread per worker (conftest)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_section(text: str, cwd: Path) -> list[tuple[str, subprocess.CompletedProcess]]:
    done: list[tuple[str, subprocess.CompletedProcess]] = []
    printed: str | None = None
    for block in blocks(text):
        path = file_path(block)
        if path is not None:
            (cwd / path).parent.mkdir(parents=True, exist_ok=True)
            (cwd / path).write_text(block.text)
        if block.lang != "bash":
            continue
        for command in readme_commands(f"```bash\n{block.text}```\n"):
            line = command
            if "logs/train/runs/<run>" in command:
                assert printed, f"{command!r} needs a run directory; no command before printed one"
                line = command.replace("logs/train/runs/<run>", shlex.quote(printed))
            result = subprocess.run(["bash", "-c", line], cwd=cwd, env=shell_env(),
                                    capture_output=True, text=True, timeout=900)  # fmt: skip
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"{line}\n{output[-4000:]}"
            found = re.findall(r"Run directory: (\S.*)", output)
            printed = found[-1].strip() if found else printed
            done.append((command, result))
    return done


def test_file_blocks_name_their_path_keep_hydra_headers_first_and_every_block_runs() -> None:
    covered = {file_path(b) for b in blocks(OWN.read_text())}
    for readme in READMES:
        found = blocks(readme.read_text())
        for block in found:  # Hydra reads '# @package' only before any other line
            assert "@package" not in block.text or block.text.startswith("# @package"), block.text
            assert block.lang != "yaml" or file_path(block), f"{readme.name}: no path: {block}"
        named = {file_path(b) for b in found} - {None, "tests/test_mine.py"}  # the suite's example
        assert named <= covered, f"file blocks no test writes: {sorted(named - covered)}"
    for readme, block in python_snippets():  # load_network's run on test_readme.py's trained run
        runs = "load_network" in block.text or file_path(block) in (None, "tests/test_mine.py")
        assert runs, f"{readme.name}: a python block no test runs:\n{block.text}"


@pytest.mark.slow
def test_your_own_model_and_data_runs_as_written(tmp_path: Path) -> None:
    done = run_section(OWN.read_text(), tmp_path)
    ran = [command for command, _ in done]
    assert ran[0] == "python make_table.py" and len(ran) == 5, ran
    assert set(ran) == {c for c, k in CHECKS.items() if k[0] == SECTION}  # CHECKS

    runs = sorted((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 3, runs  # tiny + csv, the regression, the regression under DDP
    tiny, regression, ddp = runs
    config = yaml.safe_load((tiny / "config.yaml").read_text())
    assert config["model"]["net"]["_target_"] == "my_project.nets.TinyNet"
    assert config["data"]["_target_"] == "my_project.data.CsvDataModule"
    metrics = json.loads((tiny / "metrics.json").read_text())["metrics"]
    assert metrics["test/acc"] > 0.9, metrics  # it learned the three classes
    assert (tiny / "model.pth").is_file() and (tiny / "curves.png").is_file()

    for run in (regression, ddp):
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["model"]["_target_"] == "my_project.regression.RegressionModule"
        assert config["data"]["_target_"] == "my_project.points.PointsDataModule"
        report = json.loads((run / "metrics.json").read_text())
        assert report["monitor"] == "val/loss", report  # the experiment's checkpoint key
    assert yaml.safe_load((ddp / "config.yaml").read_text())["trainer"]["devices"] == 2

    (evaluated,) = (tmp_path / "logs" / "eval" / "runs").iterdir()
    tested = json.loads((evaluated / "metrics.json").read_text())["metrics"]
    trained = json.loads((ddp / "metrics.json").read_text())["metrics"]
    assert tested["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-4)


def python_snippets() -> list[tuple[Path, Block]]:  # that no section test runs
    return [(readme, b) for readme in READMES if readme != OWN for b in blocks(readme.read_text())
            if b.lang == "python"]  # fmt: skip


@pytest.mark.slow
def test_library_readme_snippets_run(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parent
    snippets = [b for _, b in python_snippets() if "load_network" not in b.text]
    (trainer,) = [b for b in snippets if file_path(b) is None]
    (test_file,) = [b for b in snippets if file_path(b) == "tests/test_mine.py"]
    done = subprocess.run([sys.executable, "-c", trainer.text], cwd=tmp_path, env=shell_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mine.py").write_text(test_file.text)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_mine.py", "-p", "conftest", "-q", "-p",
         "no:cacheprovider"],
        cwd=tmp_path, env={**shell_env(), "PYTHONPATH": str(tests)},  # the suite's conftest
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]
