"""``python -m tinyapp.predict`` through the real CLI: predictions in dataset order, one process
and DDP x2 on the CPU, the template's ``predict_step`` and a foreign module's forward (a bad
``ckpt_path`` is the preflight's line: test_bad_inputs.py)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import FAST, run_dirs, run_entry
from runkit.safety.checkpoints import load_network

pytestmark = pytest.mark.slow

ZOO = Path(__file__).resolve().parent / "zoo"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One short run of the template's classifier, one of the zoo's regression module (no
    predict_step, a data module without predict_dataloader), shared by the tests below."""
    root = tmp_path_factory.mktemp("predict")
    shutil.copytree(ZOO, root / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    made: dict[str, Path] = {"root": root}
    for name, extra in (
        ("template", ()),
        # 650 points: a test split of 98
        ("zoo", ("--config-dir", "zoo/configs", "experiment=zoo_regression", "data.samples=650")),
    ):
        logs = root / name
        budget = (*FAST, "trainer.max_epochs=1", f"paths.log_dir={logs}")
        done = run_entry(root, "train", *extra, *budget, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        (made[name],) = run_dirs(logs)
    return made


def predict(runs: dict[str, Path], out: Path, *overrides: str) -> tuple[Path, str]:
    done = run_entry(runs["root"], "predict", f"paths.log_dir={out}", *overrides, timeout=600)
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


def saved(run: Path) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.load(run / "predictions.pt", weights_only=True)
    return data["predictions"], data["index"]


def csv_rows(run: Path) -> list[dict[str, str]]:
    with (run / "predictions.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("devices", ["one", "ddp"])
def test_the_template_predicts_its_classes_in_dataset_order(
    runs: dict[str, Path], tmp_path: Path, devices: str
) -> None:
    trained = runs["template"]
    # one process: a .ckpt, in batches of another size (data.* overrides apply); DDP: the run,
    # 91 items, 5 a batch: rank 0 runs 10 batches, rank 1 9 (predict's sampler does not pad), so
    # the ranks agree on stops over the first 9 only
    source = trained / "checkpoints" / "last.ckpt" if devices == "one" else trained
    data = {"batch_size": 100} if devices == "one" else {"batch_size": 5, "test_fraction": 0.0506}
    extra = [f"data.{key}={value}" for key, value in data.items()]
    extra += ["trainer=ddp_sim"] if devices == "ddp" else []
    run, output = predict(runs, tmp_path, f"ckpt_path={source}", *extra)
    assert output.count("Predicting with ClassifierModule.predict_step, on ") == 1, output
    assert "DigitsDataModule.predict_dataloader" in output

    inputs = inputs_of(trained, **data)
    assert devices == "one" or len(inputs) == 91
    net = load_network(trained / "model.pth", device="cpu", allowed=("tinyapp.", "torch."))
    with torch.no_grad():
        expected = net(inputs).argmax(dim=-1)
    predictions, index = saved(run)
    assert torch.equal(index, torch.arange(len(inputs)))
    assert torch.equal(predictions, expected)
    rows = csv_rows(run)
    assert list(rows[0]) == ["index", "prediction"]
    assert [int(r["prediction"]) for r in rows] == expected.tolist()
    assert [int(r["index"]) for r in rows] == list(range(len(inputs)))


def test_a_module_without_predict_step_predicts_its_forward_on_the_test_split(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    trained = runs["zoo"]  # under DDP: the template's tests here
    run, output = predict(runs, tmp_path, f"ckpt_path={trained}", "trusted_targets=[zoo.,torch.]")
    line = (
        "Predicting with RegressionModule's forward (it has no predict_step) on the inputs of "
        "each batch, on PointsData.test_dataloader (it has no predict_dataloader)"
    )
    assert output.count(line) == 1, output

    inputs = inputs_of(trained)  # zoo imports from this directory, as in the CLI's copy
    module = load_network(trained / "model.pth", device="cpu", allowed=("zoo.", "torch."))
    with torch.no_grad():
        expected = module(inputs)
    predictions, index = saved(run)
    assert torch.equal(index, torch.arange(98))
    torch.testing.assert_close(predictions, expected)
    assert [float(r["prediction"]) for r in csv_rows(run)] == pytest.approx(expected.tolist())
