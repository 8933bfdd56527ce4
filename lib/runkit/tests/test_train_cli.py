"""The real CLI: a run's directory, eval and predict on it (one process, DDP x2), configs found
when installed, what a run prints (each line once, none a user cannot act on), workers' lines."""

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


def run_ok(task: str, root: Path, out: Path, *args: str) -> tuple[Path, str]:
    done = run_entry(root, task, *args, f"paths.log_dir={q(out)}", timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = run_dirs(out, task)
    return run, output


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    return run_ok("train", root, root / "my logs é", *FAST, "logger=tensorboard")[0]


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
    run, _ = run_ok("eval", tmp_path, tmp_path / "logs", f"ckpt_path={q(path)}")
    evaluated = json.loads((run / "metrics.json").read_text())["metrics"]["test/acc"]
    assert abs(evaluated - report["metrics"]["test/acc"]) <= 1e-3


def inputs_of(run: Path, **data: float) -> torch.Tensor:
    datamodule = instantiate(OmegaConf.load(run / "config.yaml").data, **data)
    datamodule.setup("test")
    dataset = datamodule.test_dataloader().dataset
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


@pytest.mark.parametrize("case", ["one", "ddp", "zoo"])
def test_predict_writes_every_item_once_in_dataset_order(
    request: pytest.FixtureRequest, tmp_path: Path, case: str
) -> None:
    # one process: a .ckpt in batches of another size (data.* overrides apply); DDP: the run, 91
    # items, 5 a batch: rank 0 runs 10 batches, rank 1 9 (predict's sampler does not pad); zoo: a
    # module without predict_step predicts its forward on the test split
    if case == "zoo":
        zoo = request.getfixturevalue("zoo")
        trained, root, allowed, data = zoo["run"], zoo["root"], ("zoo.", "torch."), {}
        args = [f"ckpt_path={trained}", "trusted_targets=[zoo.,torch.]"]
        line = (
            "Predicting with RegressionModule's forward (it has no predict_step) on the inputs of "
            "each batch, on PointsData.test_dataloader (it has no predict_dataloader)"
        )
    else:
        trained, root, allowed = request.getfixturevalue("trained"), tmp_path, TEMPLATE_TARGETS
        data = {"batch_size": 100} if case == "one" else {"batch_size": 5, "test_fraction": 0.0506}
        source = trained / "checkpoints" / "last.ckpt" if case == "one" else trained
        args = [f"ckpt_path={q(source)}", *(f"data.{key}={v}" for key, v in data.items())]
        args += ["trainer=ddp_sim"] if case == "ddp" else []
        line = (
            "Predicting with ClassifierModule.predict_step, on DigitsDataModule.predict_dataloader"
        )
    run, output = run_ok("predict", root, tmp_path / "out", *args)
    assert output.count(line) == 1, output
    inputs = inputs_of(trained, **data)  # zoo imports from the root, as in the CLI's copy
    assert case != "ddp" or len(inputs) == 91
    with torch.no_grad():
        expected = load_network(trained / "model.pth", device="cpu", allowed=allowed)(inputs)
    expected = expected if case == "zoo" else expected.argmax(dim=-1)
    saved = torch.load(run / "predictions.pt", weights_only=True)
    rows = list(csv.DictReader((run / "predictions.csv").open()))
    assert torch.equal(saved["index"], torch.arange(len(inputs)))
    torch.testing.assert_close(saved["predictions"], expected)
    assert list(rows[0]) == ["index", "prediction"]
    assert [float(r["prediction"]) for r in rows] == pytest.approx(expected.tolist())
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
    result = subprocess.run(
        [sys.executable, "-m", "project.train", "debug=fdr"],
        cwd=elsewhere, env=clean_env(PYTHONPATH=str(target)), capture_output=True, text=True,
        timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(elsewhere / "logs", "debug")  # outputs go under ./logs by default
    configs = target.resolve() / "project" / "configs"  # the installed package's
    assert f"path: {configs}\n" in (run / ".hydra" / "hydra.yaml").read_text()


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
        "import sys, runpy\n"
        "for flag in (['--help'], ['--cfg', 'job']):\n"
        "    sys.argv = ['train', *flag]\n"
        "    try: runpy.run_module('tinyapp.train', run_name='__main__')\n"
        "    except SystemExit: pass\n"
        "    print('TORCH' if 'torch' in sys.modules or 'lightning' in sys.modules else 'LIGHT')"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line in ("TORCH", "LIGHT")] == [
        "LIGHT", "LIGHT"
    ]  # fmt: skip


ZOO = Path(__file__).resolve().parent / "zoo"
QUIET = "callbacks.progress_bar.refresh_rate=0"
ZOO_DDP = ("--config-dir", "zoo/configs", "experiment=zoo_regression", "trainer=ddp_sim",
           "precision=16-mixed", QUIET)  # fmt: skip


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # what a DDP x2 16-mixed fit of the zoo's module (no ``net``), its resume and its eval say
    root = tmp_path_factory.mktemp("lines")
    shutil.copytree(ZOO, root / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    run, fit = run_ok("train", root, root / "logs", *ZOO_DDP, "trainer.max_epochs=1")
    resume = run_ok(
        "train", root, root / "resumed", *ZOO_DDP, "trainer.max_epochs=2", f"ckpt_path={run}"
    )
    trusted = ("trusted_targets=[zoo.,torch.]", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    evaluated = run_ok("eval", root, root / "logs", *trusted)
    return {"fit": fit, "resume": resume[1], "eval": evaluated[1], "root": root, "run": run}


def test_a_zoo_run_says_each_line_once_and_none_a_user_cannot_act_on(zoo: dict[str, Any]) -> None:
    for output in (zoo["fit"], zoo["resume"], zoo["eval"]):
        # Lightning's, about its own summary callback that the template's replaces
        assert "Trainer already configured with model summary" not in output
        # channels-last means nothing on the CPU: nothing said about a module without `net`
        assert "channels_last" not in output
        # eval restoring the states of training callbacks it does not have
        assert "Please add the following callbacks" not in output
    output = zoo["fit"]
    assert output.count("Speed: precision=bf16-mixed") == 1, output
    assert "Speed: precision=16-mixed" not in output
    assert output.count("precision=16-mixed: fp16 mixed precision does not exist on the CPU") == 1
    assert "AMP with fp16 is not supported" not in output  # Lightning's own warning: not needed
    assert zoo["resume"].count("Resuming from ") == 1, zoo["resume"]


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
RANK_0 = f"""
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[1]], stdout=subprocess.PIPE,
                          stderr=open(sys.argv[2], "w"), stdin=subprocess.DEVNULL)
worker.stdout.readline()  # it knows its parent now
print(worker.pid, flush=True)
sys.exit(worker.wait() if sys.argv[3] == "lives" else 0)
"""


@pytest.mark.parametrize(
    ("rank_0", "wait_s", "said"),
    [
        ("lives", "0.2", "error: rank 1: callbacks.x=1 is wrong\n"),  # the worker says it
        ("ends", "300", ""),  # rank 0 has said it: the worker ends without a second line
    ],
)
def test_a_worker_says_a_mistake_only_while_rank_0_lives(
    tmp_path: Path, rank_0: str, wait_s: str, said: str
) -> None:
    err = tmp_path / "worker.err"
    env = clean_env(LOCAL_RANK="1", RANK="1")
    done = subprocess.run([sys.executable, "-c", RANK_0, wait_s, str(err), rank_0], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == (2 if rank_0 == "lives" else 0), done.stderr
    # the worker is not our child: wait until it has exited, bounded below its own 300 s wait
    stat, deadline = Path(f"/proc/{int(done.stdout)}/stat"), time.monotonic() + 120
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, ("the worker outlived rank 0", err.read_text())
        time.sleep(0.05)
    assert err.read_text() == said
