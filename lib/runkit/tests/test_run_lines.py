"""What a run prints through the real CLI: no line a user cannot act on, each line once per run;
predict with a module of one's own (the zoo's: no predict_step, no predict_dataloader)."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import clean_env, last_line, run_dirs, run_entry
from runkit.safety.checkpoints import load_network

pytestmark = pytest.mark.slow

ZOO = Path(__file__).resolve().parent / "zoo"
QUIET = "callbacks.progress_bar.refresh_rate=0"
ZOO_DDP = ("--config-dir", "zoo/configs", "experiment=zoo_regression", "trainer=ddp_sim",
           "precision=16-mixed", QUIET)  # fmt: skip


def _ok(done: subprocess.CompletedProcess) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Output of a DDP x2 16-mixed fit of the zoo's module (no ``net``), its resume, its eval;
    ``root`` (holding the zoo) and the first ``run``."""
    root = tmp_path_factory.mktemp("lines")
    shutil.copytree(ZOO, root / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    logs = root / "logs"
    seen = {
        "fit": _ok(
            run_entry(root, "train", *ZOO_DDP, "trainer.max_epochs=1", f"paths.log_dir={logs}")
        )
    }
    (run,) = run_dirs(logs)
    resume = ("trainer.max_epochs=2", f"ckpt_path={run}", f"paths.log_dir={logs}")
    seen["resume"] = _ok(run_entry(root, "train", *ZOO_DDP, *resume))
    last = run / "checkpoints" / "last.ckpt"
    trusted = ("trusted_targets=[zoo.,torch.]", f"paths.log_dir={logs}")
    seen["eval"] = _ok(run_entry(root, "eval", f"ckpt_path={last}", *trusted))
    return {**seen, "root": root, "run": run}


@pytest.mark.parametrize("phase", ["fit", "resume", "eval"])
def test_no_line_a_user_cannot_act_on(zoo: dict[str, Any], phase: str) -> None:
    output = zoo[phase]
    # Lightning's, about its own summary callback that the template's replaces
    assert "Trainer already configured with model summary" not in output
    # channels-last means nothing on the CPU: nothing said about a module without `net`
    assert "channels_last" not in output
    # eval restoring the states of training callbacks it does not have
    assert "Please add the following callbacks" not in output


def test_16_mixed_on_the_cpu_says_once_that_bf16_mixed_runs(zoo: dict[str, Any]) -> None:
    output = zoo["fit"]
    assert output.count("Speed: precision=bf16-mixed") == 1, output
    assert "Speed: precision=16-mixed" not in output
    assert output.count("precision=16-mixed: fp16 mixed precision does not exist on the CPU") == 1
    assert "AMP with fp16 is not supported" not in output  # Lightning's own warning: not needed


def test_resuming_is_said_once_not_once_per_rank(zoo: dict[str, Any]) -> None:
    assert zoo["resume"].count("Resuming from ") == 1, zoo["resume"]


def test_a_module_without_predict_step_predicts_its_forward_on_the_test_split(
    zoo: dict[str, Any],
) -> None:
    trained, out = zoo["run"], zoo["root"] / "predicted"
    done = run_entry(zoo["root"], "predict", f"ckpt_path={trained}",
                     "trusted_targets=[zoo.,torch.]", f"paths.log_dir={out}")  # fmt: skip
    output = _ok(done)
    line = (
        "Predicting with RegressionModule's forward (it has no predict_step) on the inputs of "
        "each batch, on PointsData.test_dataloader (it has no predict_dataloader)"
    )
    assert output.count(line) == 1, output
    (run,) = run_dirs(out, "predict")
    datamodule = instantiate(OmegaConf.load(trained / "config.yaml").data)
    datamodule.setup("test")  # zoo imports from the root, as in the CLI's copy
    dataset = datamodule.test_dataloader().dataset
    inputs = torch.stack([dataset[i][0] for i in range(len(dataset))])
    module = load_network(trained / "model.pth", device="cpu", allowed=("zoo.", "torch."))
    with torch.no_grad():
        expected = module(inputs)
    data = torch.load(run / "predictions.pt", weights_only=True)
    assert torch.equal(data["index"], torch.arange(len(inputs)))
    torch.testing.assert_close(data["predictions"], expected)
    with (run / "predictions.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["prediction"]) for r in rows] == pytest.approx(expected.tolist())


def test_a_config_refused_under_ddp_is_one_line_once(tmp_path: Path) -> None:
    done = run_entry(
        tmp_path, "train", "trainer=fsdp", "trainer.accelerator=cpu",
        "trainer.strategy.cpu_offload=true", "callbacks.model_checkpoint.monitor=val/nope",
        "data.batch_size=256", QUIET, f"paths.log_dir={tmp_path / 'logs'}",
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert last_line(done.stderr).startswith("error: callbacks.model_checkpoint.monitor='val/nope'")
    assert done.stderr.count("error: ") == 1, done.stderr
    assert "Error executing job" not in output
    assert "cannot create or write" not in output
    assert output.count("trainer.strategy.cpu_offload: the run is on the CPU already") == 1
    # judged at the first validation, as Lightning's ModelCheckpoint does: nothing saved yet
    assert len(run_dirs(tmp_path / "logs")) == 1
    assert not list((tmp_path / "logs").rglob("*.ckpt"))


WORKER = """
import sys
from runkit.errors import RunError
from runkit.run import cli
print("ready", flush=True)
cli.WORKER_WAIT_S = float(sys.argv[1])
cli._worker_fails(RunError("callbacks.x=1 is wrong"))
"""


def test_a_worker_whose_rank_0_lives_on_says_the_mistake_itself() -> None:
    """A mistake of rank 1 alone, rank 0 (this process) living on: the worker says it."""
    env = clean_env(LOCAL_RANK="1", RANK="1")
    done = subprocess.run(
        [sys.executable, "-c", WORKER, "0.2"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr == "error: rank 1: callbacks.x=1 is wrong\n"
    assert done.stdout == "ready\n"


def test_a_worker_leaves_the_line_to_rank_0_once_rank_0_ends(tmp_path: Path) -> None:
    """Rank 0 (the parent) reports and ends: the worker then ends too, without a second line."""
    err = tmp_path / "worker.err"
    parent = f"""
import subprocess, sys
worker = subprocess.Popen(
    [sys.executable, "-c", {WORKER!r}, "300"],
    stdout=subprocess.PIPE, stderr=open({str(err)!r}, "w"), stdin=subprocess.DEVNULL,
)
worker.stdout.readline()  # it knows its parent now
print(worker.pid, flush=True)
sys.stdin.readline()  # ends when the test closes stdin
"""
    env = clean_env(LOCAL_RANK="1", RANK="1")
    rank0 = subprocess.Popen(
        [sys.executable, "-c", parent], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    worker = int(rank0.stdout.readline())
    rank0.stdin.close()  # rank 0 ends
    rank0.wait(timeout=120)
    # the worker is not our child: wait until it has exited, bounded below its own 300 s wait
    stat = Path(f"/proc/{worker}/stat")
    deadline = time.monotonic() + 120
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, (
            "the worker outlived rank 0",
            Path(f"/proc/{worker}/status").read_text()[:400],
            err.read_text(),
        )
        time.sleep(0.05)
    assert err.read_text() == ""
