"""The real CLI in subprocesses: a training run, its run directory, eval and predict on it (one
process and DDP x2 on the CPU, predictions in dataset order), presets, errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import FAST, TEMPLATE_TARGETS, clean_env, run_dirs, run_entry
from runkit import plots
from runkit.safety.checkpoints import load_network

pytestmark = pytest.mark.slow


def q(path: Path | str) -> str:
    """A path as a quoted Hydra value: spaces and non-ASCII letters need the quotes."""
    return f'"{path}"'


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short shared training run (with TensorBoard too), in a directory with a space and a
    non-ASCII letter."""
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
    """The run's own CSV record (whatever ``logger`` says) passes the damage checks; curves.png."""
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
    """The inputs of the trained run's test split, built from its own config (``data``: keys
    changed), in dataset order."""
    datamodule = instantiate(OmegaConf.load(run / "config.yaml").data, **data)
    datamodule.setup("test")
    dataset = datamodule.test_dataloader().dataset
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def saved_predictions(run: Path) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, str]]]:
    """``predictions.pt``'s rows and index, and ``predictions.csv``'s rows."""
    data = torch.load(run / "predictions.pt", weights_only=True)
    with (run / "predictions.csv").open() as handle:
        return data["predictions"], data["index"], list(csv.DictReader(handle))


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
    predictions, index, rows = saved_predictions(run)
    assert torch.equal(index, torch.arange(len(inputs)))
    assert torch.equal(predictions, expected)
    assert list(rows[0]) == ["index", "prediction"]
    assert [int(r["prediction"]) for r in rows] == expected.tolist()
    assert [int(r["index"]) for r in rows] == list(range(len(inputs)))


def test_installed_wheel_finds_its_configs_from_any_directory(tmp_path: Path) -> None:
    """``pip install .`` puts the configs inside the package; a run from elsewhere uses them."""
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
    """``debug=fdr``: one batch, no checkpoint, still its CSV log and curves, no DEBUG chatter of
    matplotlib or fsspec; a removed callback is one line; empty = ./logs."""
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
