"""Conformance against plain Lightning (issue #31): the corpus of ``conformance/``.

Each member is trained with the same seed and Trainer budget by a bare ``Trainer``
(``conformance/oracle.py``) and by ``python -m tinyapp.train --config-dir conformance/configs``,
the package in the run's working directory as a user's package sits in their project. Every value
the oracle logs must be in the CLI's CSV log to the digit, and the final weights equal bit for bit
(CPU runs are deterministic for a seed, under DDP x2 over gloo too). Then the template's own
guarantees on the same pair, shared by the file's tests: test after fit, eval of ``model.pth`` and
of the best checkpoint, ``curves.png``, resume, and SIGTERM under DDP.
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
from conftest import clean_env, last_line, run_dirs, run_entry

HERE = Path(__file__).resolve().parent
README = HERE.parents[2] / "lib" / "runkit" / "docs" / "own-model-and-data.md"
QUIET = "callbacks.progress_bar.refresh_rate=0"
TRUSTED = "trusted_targets=[conformance.,lightning.pytorch.demos.,torch.nn.,torch.optim.]"
TIMEOUT = 400  # seconds a CLI run may take on a loaded 2-core machine (5-30 s quiet)


@dataclass
class Pair:
    """One member trained by the oracle (``cwd/oracle``) and by the CLI (``run``), in ``cwd``."""

    member: Member
    cwd: Path
    run: Path


def train_args(log_dir: Path, member: Member, *extra: str, **trainer: object) -> list[str]:
    return ["--config-dir", "conformance/configs", *member.overrides(**trainer), QUIET,
            f"paths.log_dir={log_dir}", *extra]  # fmt: skip


def train(cwd: Path, member: Member, *extra: str, **trainer: object):
    return run_entry(
        cwd, "train", *train_args(cwd / "logs", member, *extra, **trainer), timeout=TIMEOUT
    )


def evaluate(cwd: Path, source: Path) -> subprocess.CompletedProcess:
    """Eval of ``source`` on as many test batches as the test after fit (eval.yaml's Trainer)."""
    limit = f"trainer.limit_test_batches={conformance.TRAINER['limit_test_batches']}"
    return run_entry(cwd, "eval", f"ckpt_path={source}", TRUSTED, limit,
                     f"paths.log_dir={cwd / 'logs'}", timeout=TIMEOUT)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """``trained(name, devices)``: the member's oracle and CLI runs, made once per module."""
    made: dict[tuple[str, int], Pair] = {}

    def get(name: str, devices: int = 1) -> Pair:
        if (name, devices) not in made:
            cwd = tmp_path_factory.mktemp(f"{name}-{devices}")
            shutil.copytree(HERE / "conformance", cwd / "conformance",
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
            oracle = prewarmed.run(
                [sys.executable, "-m", "conformance.oracle", name, str(cwd / "oracle"), str(devices)],
                cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT,
            )  # fmt: skip
            assert oracle.returncode == 0, oracle.stderr[-3000:]
            extra = [f"trainer.devices={devices}"] if devices > 1 else []
            done = train(cwd, MEMBERS[name], *extra)
            assert done.returncode == 0, done.stderr[-3000:]
            (run,) = run_dirs(cwd / "logs")
            made[name, devices] = Pair(MEMBERS[name], cwd, run)
        return made[name, devices]

    return get


def logged(metrics_csv: Path) -> dict[tuple[str, str], str]:
    """Every value a CSV log holds, by (step, key), as written (so equal means to the digit)."""
    if not metrics_csv.is_file():
        return {}  # Lightning's CSVLogger writes no file for a module that logs nothing
    with metrics_csv.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {(r["step"], k): v for r in rows for k, v in r.items() if v and k != "step"}


def state(path: Path) -> dict:
    return torch.load(path, weights_only=True)["state_dict"]


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def figures(run: Path) -> dict[str, float]:
    return {k: v for k, v in metrics(run)["metrics"].items() if k.startswith("test")}


def newest(log_dir: Path, task: str = "train") -> Path:
    return max(run_dirs(log_dir, task), key=lambda p: p.stat().st_mtime)


RUNS = [(name, 1) for name in MEMBERS] + [(m.name, 2) for m in MEMBERS.values() if m.ddp]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "devices"), RUNS, ids=[f"{n}-x{d}" for n, d in RUNS])
def test_the_cli_logs_and_learns_what_plain_lightning_does(
    trained, name: str, devices: int
) -> None:
    pair = trained(name, devices)
    expected = logged(pair.cwd / "oracle" / "csv" / "metrics.csv")
    got = logged(pair.run / "csv" / "metrics.csv")
    differ = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
    assert not differ, f"{len(differ)} of {len(expected)} logged values differ: {differ}"
    oracle = torch.load(pair.cwd / "oracle" / "weights.pt", weights_only=True)
    cli = state(pair.run / "checkpoints" / "last.ckpt")
    assert oracle.keys() == cli.keys()
    assert [k for k in oracle if not torch.equal(oracle[k], cli[k])] == []
    assert metrics(pair.run)["epochs"] == conformance.TRAINER["max_epochs"]
    assert (pair.run / "curves.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMBERS))
def test_test_after_fit_and_eval_of_model_pth_and_best_checkpoint_agree(trained, name: str) -> None:
    pair = trained(name)
    reported = figures(pair.run)
    assert (pair.run / "model.pth").is_file()
    best = metrics(pair.run)["best_checkpoint"]
    sources = [pair.run, *([Path(best)] if best else [])]  # a run directory: its model.pth
    if not conformance.overrides_hook(_classes(name)[0], "test_step"):
        # Plain Lightning's trainer.test refuses such a module; eval says so in one line.
        done = evaluate(pair.cwd, pair.run)
        assert (done.returncode, done.stderr.count("\n")) == (2, 1), done.stderr[-3000:]
        assert "has no test_step" in done.stderr and not run_dirs(pair.cwd / "logs", "eval")
        return
    got = []
    for source in sources:
        done = evaluate(pair.cwd, source)
        assert done.returncode == 0, done.stderr[-3000:]
        got.append(figures(newest(pair.cwd / "logs", "eval")))
    if pair.member.fixed_test_data:
        assert got == [reported] * len(sources)  # exactly, not approximately
    else:  # other samples than after fit, but the same ones for each eval (from the seed)
        assert got == [got[0]] * len(sources) and got[0].keys() == reported.keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMBERS))
def test_resume_continues_to_the_same_weights(trained, name: str) -> None:
    pair = trained(name)
    first = train(pair.cwd, pair.member, "test=false", max_epochs=1)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(pair.cwd, pair.member, f"ckpt_path={newest(pair.cwd / 'logs')}", "test=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = newest(pair.cwd / "logs")
    assert metrics(later)["global_step"] == metrics(pair.run)["global_step"]
    straight = state(pair.run / "checkpoints" / "last.ckpt")
    again = state(later / "checkpoints" / "last.ckpt")
    assert straight.keys() == again.keys()
    if pair.member.exact_resume:
        assert [k for k in straight if not torch.equal(straight[k], again[k])] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MEMBERS.values() if m.ddp])
def test_sigterm_under_ddp_saves_one_checkpoint_and_exits_143(trained, name: str) -> None:
    pair = trained(name, 2)
    log_dir = pair.cwd / "sigterm"
    args = train_args(log_dir, pair.member, "trainer.devices=2", "test=false", max_epochs=1000)
    process = subprocess.Popen(
        [sys.executable, "-m", "tinyapp.train", *args], cwd=pair.cwd, env=clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
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
    assert (
        state(interrupted).keys()
        == torch.load(pair.cwd / "oracle" / "weights.pt", weights_only=True).keys()
    )


def _classes(name: str) -> tuple[type, type]:
    def target(group: str) -> type:
        return get_class(OmegaConf.load(conformance.CONFIGS / group / f"{name}.yaml")._target_)

    return target("model"), target("data")


@pytest.mark.parametrize("feature", FEATURES, ids=[f.name for f in FEATURES])
def test_each_feature_of_the_table_is_in_the_member_it_names(feature: conformance.Feature) -> None:
    assert feature.member in MEMBERS and feature.present(*_classes(feature.member))


def test_the_readme_table_is_the_corpus_features() -> None:
    table = re.search(r"<!-- conformance table -->\n(.*?)\n<!-- end -->", README.read_text(), re.S)
    assert table, "the page has no conformance table between its markers"
    assert table.group(1) == conformance.feature_table(), "paste conformance.feature_table()"
