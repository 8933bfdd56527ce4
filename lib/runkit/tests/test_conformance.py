"""Each member of ``conformance/`` trained by a bare ``Trainer`` (``conformance/oracle.py``) and by
the CLI logs the same values and ends with bit-equal weights (DDP x2 too); then test, eval, resume
and SIGTERM on each pair."""

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


def train_args(log_dir: Path, member: Member, *extra: str, **trainer: object) -> list[str]:
    return ["--config-dir", "conformance/configs", *member.overrides(**trainer), QUIET,
            f"paths.log_dir={log_dir}", *extra]  # fmt: skip


def train(cwd: Path, member: Member, *extra: str, **trainer: object):
    return run_entry(
        cwd, "train", *train_args(cwd / "logs", member, *extra, **trainer), timeout=TIMEOUT
    )


def evaluate(cwd: Path, source: Path) -> subprocess.CompletedProcess:
    limit = conformance.TRAINER["limit_test_batches"]  # as many test batches as after fit
    return run_entry(cwd, "eval", f"ckpt_path={source}", TRUSTED, f"paths.log_dir={cwd / 'logs'}",
                     f"trainer.limit_test_batches={limit}", timeout=TIMEOUT)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple[str, int], tuple[Path, Path]] = {}  # its cwd, its CLI run

    def get(name: str, devices: int = 1) -> tuple[Path, Path]:
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
            made[name, devices] = cwd, run
        return made[name, devices]

    return get


def logged(metrics_csv: Path) -> dict[tuple[str, str], str]:  # by (step, key), as written
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
    cwd, run = trained(name, devices)
    expected = logged(cwd / "oracle" / "csv" / "metrics.csv")
    got = logged(run / "csv" / "metrics.csv")
    differ = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
    assert not differ, f"{len(differ)} of {len(expected)} logged values differ: {differ}"
    oracle = torch.load(cwd / "oracle" / "weights.pt", weights_only=True)
    cli = state(run / "checkpoints" / "last.ckpt")
    assert oracle.keys() == cli.keys()
    assert [k for k in oracle if not torch.equal(oracle[k], cli[k])] == []
    assert metrics(run)["epochs"] == conformance.TRAINER["max_epochs"]
    assert (run / "curves.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMBERS))
def test_test_after_fit_and_eval_of_model_pth_and_best_checkpoint_agree(trained, name: str) -> None:
    cwd, run = trained(name)
    reported = figures(run)
    best = metrics(run)["best_checkpoint"]
    sources = [run, *([Path(best)] if best else [])]  # a run directory: its model.pth
    if not conformance.overrides_hook(_classes(name)[0], "test_step"):  # eval says so in one line
        done = evaluate(cwd, run)
        assert (done.returncode, done.stderr.count("\n")) == (2, 1), done.stderr[-3000:]
        assert "has no test_step" in done.stderr and not run_dirs(cwd / "logs", "eval")
        return
    got = []
    for source in sources:
        done = evaluate(cwd, source)
        assert done.returncode == 0, done.stderr[-3000:]
        got.append(figures(newest(cwd / "logs", "eval")))
    if MEMBERS[name].fixed_test_data:
        assert got == [reported] * len(sources)  # exactly, not approximately
    else:  # other samples than after fit, but the same ones for each eval (from the seed)
        assert got == [got[0]] * len(sources) and got[0].keys() == reported.keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMBERS))
def test_resume_continues_to_the_same_weights(trained, name: str) -> None:
    cwd, run = trained(name)
    first = train(cwd, MEMBERS[name], "test=false", max_epochs=1)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(cwd, MEMBERS[name], f"ckpt_path={newest(cwd / 'logs')}", "test=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = newest(cwd / "logs")
    assert metrics(later)["global_step"] == metrics(run)["global_step"]
    straight, again = (state(r / "checkpoints" / "last.ckpt") for r in (run, later))
    assert straight.keys() == again.keys()
    if MEMBERS[name].exact_resume:
        assert [k for k in straight if not torch.equal(straight[k], again[k])] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MEMBERS.values() if m.ddp])
def test_sigterm_under_ddp_saves_one_checkpoint_and_exits_143(trained, name: str) -> None:
    cwd, _ = trained(name, 2)
    log_dir = cwd / "sigterm"
    args = train_args(log_dir, MEMBERS[name], "trainer.devices=2", "test=false", max_epochs=1000)
    process = subprocess.Popen(
        [sys.executable, "-m", "tinyapp.train", *args], cwd=cwd, env=clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT
    while not list(log_dir.glob("train/runs/*/checkpoints/last.ckpt")):
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint after {TIMEOUT} s"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"still running {TIMEOUT} s after SIGTERM") from None
    assert process.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM during fit at epoch" in last_line(err), err[-3000:]
    (interrupted,) = log_dir.glob("train/runs/*/checkpoints/interrupted.ckpt")
    oracle = torch.load(cwd / "oracle" / "weights.pt", weights_only=True)
    assert state(interrupted).keys() == oracle.keys()


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
