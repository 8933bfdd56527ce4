"""Conformance against plain Lightning (issue #31): the corpus of ``conformance/``.

Each member is trained twice with the same seed and the same Trainer budget: under a bare
``lightning.pytorch.Trainer`` (``conformance/oracle.py``) and through the real CLI, ``python -m
project.train --config-dir conformance/configs model=<member> data=<member>``, the package copied
into the run's working directory as a user's package sits in their project (``python -m`` puts
that directory on ``sys.path``, as ``PYTHONPATH=.`` does in the README). Every value the oracle
logs must be in the CLI run's CSV log, equal to the last digit, and the final weights equal bit
for bit: the runs are on the CPU, where Lightning and torch are deterministic for a fixed seed,
under DDP x2 over gloo too. Then the template's own guarantees on the same run (one per member,
shared by the tests of this file): test after fit, eval of ``model.pth`` and of the best
checkpoint giving the same test figures, ``curves.png``, resume, and SIGTERM under DDP.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import conformance
import pytest
import torch
from conformance import FEATURES, MEMBERS, Member
from hydra.utils import get_class
from omegaconf import OmegaConf

import prewarmed
from conftest import clean_env, last_line, run_dirs

HERE = Path(__file__).resolve().parent
README = HERE.parents[2] / "lib" / "runkit" / "docs" / "own-model-and-data.md"
QUIET = "callbacks.progress_bar.refresh_rate=0"
TRUSTED = "trusted_targets=[conformance.,lightning.pytorch.demos.,torch.nn.,torch.optim.]"
TIMEOUT = 400  # seconds a CLI run may take on a loaded 2-core machine (they take 5-30 s quiet)


@dataclass
class Pair:
    """One member trained by the oracle and by the CLI, in one working directory."""

    member: Member
    devices: int
    cwd: Path
    oracle: Path  # the oracle's output directory
    run: Path  # the CLI's run directory
    stdout: str
    stderr: str


def _run(cwd: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    return prewarmed.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def train(cwd: Path, member: Member, *extra: str, **trainer: object):
    """``python -m project.train`` on ``member`` in ``cwd``; its run directory is the newest."""
    return _run(
        cwd,
        "project.train",
        "--config-dir",
        "conformance/configs",
        *member.overrides(**trainer),
        QUIET,
        f"paths.log_dir={cwd / 'logs'}",
        *extra,
    )


def evaluate(cwd: Path, source: Path) -> subprocess.CompletedProcess:
    """``python -m project.eval`` of ``source``, on as many test batches as the test after fit
    (eval takes its Trainer from eval.yaml, not from the run's config)."""
    limit = f"trainer.limit_test_batches={conformance.TRAINER['limit_test_batches']}"
    return _run(
        cwd, "project.eval", f"ckpt_path={source}", TRUSTED, limit, f"paths.log_dir={cwd / 'logs'}"
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """``trained(name, devices)``: the member's oracle and CLI runs, made once per module."""
    made: dict[tuple[str, int], Pair] = {}

    def get(name: str, devices: int = 1) -> Pair:
        if (name, devices) not in made:
            cwd = tmp_path_factory.mktemp(f"{name}-{devices}")
            shutil.copytree(
                HERE / "conformance",
                cwd / "conformance",
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            oracle = _run(cwd, "conformance.oracle", name, str(cwd / "oracle"), str(devices))
            assert oracle.returncode == 0, oracle.stderr[-3000:]
            extra = [f"trainer.devices={devices}"] if devices > 1 else []
            done = train(cwd, MEMBERS[name], *extra)
            assert done.returncode == 0, done.stderr[-3000:]
            (run,) = run_dirs(cwd / "logs")
            made[name, devices] = Pair(
                MEMBERS[name], devices, cwd, cwd / "oracle", run, done.stdout, done.stderr
            )
        return made[name, devices]

    return get


def logged(metrics_csv: Path) -> dict[tuple[str, str], str]:
    """Every value a CSV log holds, by (step, key), as written (so equal means to the digit)."""
    if not metrics_csv.is_file():
        return {}  # Lightning's CSVLogger writes no file for a module that logs nothing
    with metrics_csv.open(newline="") as handle:
        return {
            (row["step"], key): value
            for row in csv.DictReader(handle)
            for key, value in row.items()
            if value and key != "step"
        }


def final_weights(pair: Pair) -> tuple[dict, dict]:
    oracle = torch.load(pair.oracle / "weights.pt", weights_only=True)
    cli = torch.load(pair.run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return oracle, cli


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def test_figures(run: Path) -> dict[str, float]:
    return {k: v for k, v in metrics(run)["metrics"].items() if k.startswith("test")}


test_figures.__test__ = False  # a helper, not a test


RUNS = [(name, 1) for name in MEMBERS] + [(m.name, 2) for m in MEMBERS.values() if m.ddp]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "devices"), RUNS, ids=[f"{n}-x{d}" for n, d in RUNS])
def test_the_cli_logs_and_learns_what_plain_lightning_does(
    trained, name: str, devices: int
) -> None:
    pair = trained(name, devices)
    expected = logged(pair.oracle / "csv" / "metrics.csv")
    got = logged(pair.run / "csv" / "metrics.csv")
    differ = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
    assert not differ, f"{len(differ)} of {len(expected)} logged values differ: {differ}"
    oracle, cli = final_weights(pair)
    assert oracle.keys() == cli.keys()
    assert [k for k in oracle if not torch.equal(oracle[k], cli[k])] == []
    assert metrics(pair.run)["epochs"] == conformance.TRAINER["max_epochs"]
    assert (pair.run / "curves.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMBERS))
def test_test_after_fit_and_eval_of_model_pth_and_best_checkpoint_agree(trained, name: str) -> None:
    pair = trained(name)
    reported = test_figures(pair.run)
    assert (pair.run / "model.pth").is_file()
    sources = [pair.run]  # eval of a run directory takes its model.pth
    if metrics(pair.run)["best_checkpoint"]:
        sources.append(Path(metrics(pair.run)["best_checkpoint"]))
    if not conformance.overrides_hook(_classes(name)[0], "test_step"):
        # Plain Lightning's trainer.test refuses such a module; eval says so in one line.
        done = evaluate(pair.cwd, pair.run)
        assert (done.returncode, done.stderr.count("\n")) == (2, 1), done.stderr[-3000:]
        assert "has no test_step" in done.stderr and not run_dirs(pair.cwd / "logs", "eval")
        return
    figures = []
    for source in sources:
        done = evaluate(pair.cwd, source)
        assert done.returncode == 0, done.stderr[-3000:]
        evaluated = max(run_dirs(pair.cwd / "logs", "eval"), key=lambda p: p.stat().st_mtime)
        figures.append(test_figures(evaluated))
    if pair.member.fixed_test_data:
        assert figures == [reported] * len(sources)  # exactly, not approximately
    else:  # other samples than after fit, but the same ones for each eval (from the seed)
        assert figures == [figures[0]] * len(sources) and figures[0].keys() == reported.keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMBERS))
def test_resume_continues_to_the_same_weights(trained, name: str) -> None:
    pair = trained(name)
    first = train(pair.cwd, pair.member, "test=false", max_epochs=1)
    assert first.returncode == 0, first.stderr[-3000:]
    earlier = max(run_dirs(pair.cwd / "logs"), key=lambda p: p.stat().st_mtime)
    resumed = train(pair.cwd, pair.member, f"ckpt_path={earlier}", "test=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = max(run_dirs(pair.cwd / "logs"), key=lambda p: p.stat().st_mtime)
    assert metrics(later)["global_step"] == metrics(pair.run)["global_step"]
    straight = torch.load(pair.run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    again = torch.load(later / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert straight.keys() == again.keys()
    if pair.member.exact_resume:
        assert [k for k in straight if not torch.equal(straight[k], again[k])] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MEMBERS.values() if m.ddp])
def test_sigterm_under_ddp_saves_one_checkpoint_and_exits_143(trained, name: str) -> None:
    pair = trained(name, 2)
    cwd, log_dir = pair.cwd, pair.cwd / "sigterm"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "project.train", "--config-dir", "conformance/configs",
            *pair.member.overrides(max_epochs=1000), "trainer.devices=2", "test=false", QUIET,
            f"paths.log_dir={log_dir}",
        ],
        cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT
    while not list(log_dir.glob("train/runs/*/checkpoints/last.ckpt")):
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint after {TIMEOUT} s"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"still running {TIMEOUT} s after SIGTERM") from None
    assert process.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM during fit at epoch" in last_line(err), err[-3000:]
    (interrupted,) = log_dir.glob("train/runs/*/checkpoints/interrupted.ckpt")
    oracle, _ = final_weights(pair)
    assert torch.load(interrupted, weights_only=True)["state_dict"].keys() == oracle.keys()


def _classes(name: str) -> tuple[type, type]:
    def target(group: str) -> type:
        return get_class(OmegaConf.load(conformance.CONFIGS / group / f"{name}.yaml")._target_)

    return target("model"), target("data")


@pytest.mark.parametrize("feature", FEATURES, ids=[f.name for f in FEATURES])
def test_each_feature_of_the_table_is_in_the_member_it_names(feature: conformance.Feature) -> None:
    assert feature.member in MEMBERS
    assert feature.present(*_classes(feature.member))


def test_the_readme_table_is_the_corpus_features() -> None:
    text = README.read_text()
    table = re.search(r"<!-- conformance table -->\n(.*?)\n<!-- end -->", text, re.S)
    assert table, "README.md has no conformance table between its markers"
    assert table.group(1) == conformance.feature_table(), (
        "README.md's table differs from conformance.FEATURES; paste conformance.feature_table()"
    )
