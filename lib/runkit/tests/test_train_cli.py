"""The real CLI in subprocesses: a training run, its run directory, eval and predict on it (one
process and DDP x2 on the CPU, predictions in dataset order), presets, errors; what a run prints
(no line a user cannot act on, each once per run); predict with a module of one's own (the zoo's)."""

from __future__ import annotations

import csv
import json
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

from conftest import FAST, TEMPLATE_TARGETS, clean_env, last_line, run_dirs, run_entry
from runkit import plots
from runkit.safety.checkpoints import load_network

pytestmark = pytest.mark.slow


def q(path: Path | str) -> str:  # spaces and non-ASCII letters need the quotes
    return f'"{path}"'


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    logs = f"paths.log_dir={q(root / 'my logs é')}"
    result = run_entry(root, "train", *FAST, "logger=tensorboard", logs)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(root / "my logs é")
    return run


def test_the_run_directory_holds_every_file_loadable_with_weights_only(trained: Path) -> None:
    for name in ("config.yaml", "train.log", "csv/metrics.csv", "model.pth", "metrics.json"):
        assert (trained / name).is_file(), name
    checkpoints = {p.name for p in (trained / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints and any(n.startswith("epoch_") for n in checkpoints)
    assert "Run directory" in (trained / "train.log").read_text()
    report = json.loads((trained / "metrics.json").read_text())
    metrics = report["metrics"]
    for key in ("train/loss", "train/acc", "val/acc", "val/acc_best", "test/acc", "test/loss"):
        assert 0.0 <= metrics[key] < 10.0, key
    assert metrics["val/acc_best"] >= metrics["val/acc"] - 1e-9
    assert Path(report["best_checkpoint"]).is_file()
    assert report["epochs"] == 2
    for ckpt in (trained / "checkpoints").glob("*.ckpt"):
        data = torch.load(ckpt, weights_only=True)
        assert data["hyper_parameters"]["config"]["model"]["net"]["_target_"].endswith("ConvNet")
    state = torch.load(trained / "model.pth", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert not any(key.startswith("net.") for key in state)  # the bare network's keys
    net = load_network(trained / "model.pth", device="cpu", allowed=TEMPLATE_TARGETS)
    assert net(torch.rand(3, 1, 8, 8)).shape == (3, 10)
    assert list((trained / "tensorboard").glob("events.out.tfevents.*"))
    assert_csv_log_and_curves(trained)


def assert_csv_log_and_curves(run: Path) -> None:
    pytest.importorskip("matplotlib", reason="curves.png is drawn with matplotlib (plot extra)")
    metrics = plots.read_metrics(run)
    assert metrics.curve("val/loss")[0], "no validation loss per epoch in csv/metrics.csv"
    assert "test/acc" in metrics.final
    assert (run / plots.PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("source", ["model.pth", "best"])
def test_eval_matches_what_training_reported(trained: Path, tmp_path: Path, source: str) -> None:
    report = json.loads((trained / "metrics.json").read_text())
    path = trained / "model.pth" if source == "model.pth" else report["best_checkpoint"]
    result = run_entry(
        tmp_path, "eval", f"ckpt_path={q(path)}", f"paths.log_dir={tmp_path / 'logs'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(tmp_path / "logs", "eval")
    evaluated = json.loads((run / "metrics.json").read_text())["metrics"]["test/acc"]
    assert abs(evaluated - report["metrics"]["test/acc"]) <= 1e-3


def predict(root: Path, out: Path, *overrides: str) -> tuple[Path, str]:
    done = run_entry(root, "predict", f"paths.log_dir={out}", *overrides, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = run_dirs(out, "predict")
    return run, output


def inputs_of(run: Path, **data: float) -> torch.Tensor:
    datamodule = instantiate(OmegaConf.load(run / "config.yaml").data, **data)
    datamodule.setup("test")
    dataset = datamodule.test_dataloader().dataset
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


@pytest.mark.parametrize("devices", ["one", "ddp"])
def test_the_template_predicts_its_classes_in_dataset_order(
    trained: Path, tmp_path: Path, devices: str
) -> None:
    # one process: a .ckpt, in batches of another size (data.* overrides apply); DDP: the run,
    # 91 items, 5 a batch: rank 0 runs 10 batches, rank 1 9 (predict's sampler does not pad), so
    # the ranks agree on stops over the first 9 only
    source = trained / "checkpoints" / "last.ckpt" if devices == "one" else trained
    data = {"batch_size": 100} if devices == "one" else {"batch_size": 5, "test_fraction": 0.0506}
    extra = [f"data.{key}={value}" for key, value in data.items()]
    extra += ["trainer=ddp_sim"] if devices == "ddp" else []
    run, output = predict(tmp_path, tmp_path / "logs", f"ckpt_path={q(source)}", *extra)
    assert output.count("Predicting with ClassifierModule.predict_step, on ") == 1, output
    assert "DigitsDataModule.predict_dataloader" in output

    inputs = inputs_of(trained, **data)
    assert devices == "one" or len(inputs) == 91
    net = load_network(trained / "model.pth", device="cpu", allowed=TEMPLATE_TARGETS)
    with torch.no_grad():
        expected = net(inputs).argmax(dim=-1)
    saved = torch.load(run / "predictions.pt", weights_only=True)
    rows = list(csv.DictReader((run / "predictions.csv").open()))
    assert torch.equal(saved["index"], torch.arange(len(inputs)))
    assert torch.equal(saved["predictions"], expected)
    assert list(rows[0]) == ["index", "prediction"]
    assert [int(r["prediction"]) for r in rows] == expected.tolist()
    assert [int(r["index"]) for r in rows] == list(range(len(inputs)))


def test_installed_wheel_finds_its_configs_from_any_directory(tmp_path: Path) -> None:
    # ``pip install .`` puts the configs inside the package; a run from elsewhere uses them
    repo = Path(__file__).resolve().parents[3]
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(repo)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheel_dir.glob("project-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(PYTHONPATH=str(target))
    probe = subprocess.run(
        [sys.executable, "-c", "import project as c; print(c.__file__); print(c.config_dir())"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    module_file, configs = probe.stdout.split()
    assert module_file.startswith(str(target)) and configs.startswith(str(target))
    result = subprocess.run(
        [sys.executable, "-m", "project.train", "debug=fdr"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_dirs(elsewhere / "logs", "debug"), "outputs go under ./logs by default"


def test_empty_project_log_dir_means_unset(tmp_path: Path) -> None:
    # debug=fdr: one batch, no checkpoint, its CSV log and curves, no DEBUG chatter; one line said
    args = ("debug=fdr", "~callbacks.graceful_interrupt", "callbacks.progress_bar.refresh_rate=0")
    result = run_entry(tmp_path, "train", *args, env={"PROJECT_LOG_DIR": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if "callbacks.graceful_interrupt" in line]
    assert said == [
        "callbacks.graceful_interrupt removed: Ctrl-C/SIGTERM will not save a checkpoint, and a "
        "DDP worker whose launching process dies waits in a collective until its timeout"
    ]
    assert "checkpointing is suppressed" in result.stdout + result.stderr  # as Lightning says
    (run,) = run_dirs(tmp_path / "logs", "debug")
    assert not list(run.glob("checkpoints/*.ckpt"))
    assert (run / "model.pth").is_file()  # the run still tests and exports its weights
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 1  # one batch
    assert_csv_log_and_curves(run)
    assert "findfont" not in result.stdout  # matplotlib's DEBUG chatter
    assert "open file" not in result.stdout  # fsspec's, once per metrics.csv write


def test_help_and_cfg_job_do_not_import_torch(tmp_path: Path) -> None:
    probe = (
        "import sys, runpy; sys.argv = ['train', '{flag}'];\n"
        "try: runpy.run_module('tinyapp.train', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print('TORCH' if 'torch' in sys.modules or 'lightning' in sys.modules else 'LIGHT')"
    )
    for flag in ("--help", "--cfg=job"):
        flag_args = flag.replace("=", "', '")
        result = subprocess.run(
            [sys.executable, "-c", probe.format(flag=flag_args)],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().endswith("LIGHT"), flag


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
    # what a DDP x2 16-mixed fit of the zoo's module (no ``net``), its resume and its eval say
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


def test_16_mixed_on_the_cpu_says_once_that_bf16_runs_and_a_resume_says_it_once(zoo) -> None:
    output = zoo["fit"]
    assert output.count("Speed: precision=bf16-mixed") == 1, output
    assert "Speed: precision=16-mixed" not in output
    assert output.count("precision=16-mixed: fp16 mixed precision does not exist on the CPU") == 1
    assert "AMP with fp16 is not supported" not in output  # Lightning's own warning: not needed
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
    inputs = inputs_of(trained)  # zoo imports from the root, as in the CLI's copy
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
    # a mistake of rank 1 alone, rank 0 (this process) living on: the worker says it
    env = clean_env(LOCAL_RANK="1", RANK="1")
    done = subprocess.run(
        [sys.executable, "-c", WORKER, "0.2"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr == "error: rank 1: callbacks.x=1 is wrong\n"
    assert done.stdout == "ready\n"


def test_a_worker_leaves_the_line_to_rank_0_once_rank_0_ends(tmp_path: Path) -> None:
    # rank 0 (the parent) reports and ends: the worker then ends too, without a second line
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
