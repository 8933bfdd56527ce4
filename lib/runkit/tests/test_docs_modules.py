"""Modules written as Lightning's documentation teaches behave as under plain Lightning (issue #31).

A network ``net`` with a head beside it built in ``setup()`` from the data module, list and dict
arguments from the config, two validation loaders, a key logged in ``on_validation_epoch_end``,
no ``validation_step``, no ``test_step``: each module of ``zoo/`` goes through the real CLI, and
what plain Lightning does with it (a bare ``Trainer``, in this process) is the reference.
"""

from __future__ import annotations

import csv
import inspect
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from conftest import CliRunner, compose_train, last_line, run_dirs

ZOO = Path(__file__).resolve().parent / "zoo"
QUIET = "callbacks.progress_bar.refresh_rate=0"
TRUSTED = "trusted_targets=[zoo.,torch.]"


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """The run's working directory holding the user's package ``zoo``, importable here too (for
    the plain-Lightning reference runs in this process)."""
    shutil.copytree(ZOO, tmp_path / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))


def train(cli: CliRunner, log_dir: Path, *overrides: str):
    return cli(
        "train", "--config-dir", "zoo/configs", QUIET, f"paths.log_dir={log_dir}", *overrides
    )


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def newest(log_dir: Path, task: str) -> Path:
    return max(run_dirs(log_dir, task), key=lambda p: p.stat().st_mtime)


def plain_trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        **kwargs,
    )  # fmt: skip


@pytest.mark.slow
def test_a_head_built_in_setup_beside_net_exports_evaluates_and_resumes_like_plain_lightning(
    project: Path, cli: CliRunner, log_dir: Path
) -> None:
    # #31.1: model.pth held net only and eval reported the head's initial weights, exit 0.
    # #31.2: eval and resume compared state dicts before setup() built the head.
    # #31.8: the list and dict arguments reached the checkpoint as ListConfig/DictConfig.
    done = train(cli, log_dir, "experiment=zoo_head", "trainer.max_epochs=2")
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    reported = {k: v for k, v in metrics(run)["metrics"].items() if k.startswith("test")}
    best = Path(metrics(run)["best_checkpoint"])
    checkpoint = torch.load(best, weights_only=True)  # plain containers: weights_only loads it
    assert checkpoint["hyper_parameters"]["hidden"] == [16, 8]
    assert type(checkpoint["hyper_parameters"]["options"]) is dict

    weights = torch.load(run / "model.pth", weights_only=True)
    state = checkpoint["state_dict"]
    assert {"head.weight", "head.bias"} <= weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)

    # Plain Lightning's figure for the same checkpoint.
    from zoo.data import PointsData
    from zoo.modules import HeadModule

    (plain,) = plain_trainer().test(
        HeadModule(hidden=[16, 8], options={"lr": 0.05}), PointsData(), ckpt_path=best
    )
    assert plain["test_loss"] == pytest.approx(reported["test_loss"], rel=1e-6)

    for source in (run, best):  # model.pth (through Lightning's load after setup), the .ckpt
        again = cli("eval", f"paths.log_dir={log_dir}", TRUSTED, f"ckpt_path={source}")
        assert again.returncode == 0, again.stderr[-3000:]
        evaluated = newest(log_dir, "eval")
        assert metrics(evaluated)["metrics"] == reported  # exactly

    resumed = train(cli, log_dir, "experiment=zoo_head", "trainer.max_epochs=3", f"ckpt_path={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = newest(log_dir, "train")
    assert metrics(later)["global_step"] == 3 * metrics(run)["global_step"] // 2


@pytest.mark.slow
def test_weights_of_another_head_are_refused_after_setup_in_one_line(
    project: Path, cli: CliRunner, log_dir: Path
) -> None:
    # The comparison that setup() made impossible before it runs still happens, where Lightning
    # loads: a checkpoint whose head is missing a key fails in one line naming it.
    done = train(cli, log_dir, "experiment=zoo_head", "trainer.max_epochs=1", "test=false")
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    weights = torch.load(run / "model.pth", weights_only=True)
    del weights["head.bias"]
    torch.save(weights, run / "model.pth")
    refused = cli("eval", f"paths.log_dir={log_dir}", TRUSTED, f"ckpt_path={run}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = last_line(refused.stderr)
    assert line.startswith(f"error: {str(run / 'model.pth')!r} does not fit HeadModule"), line
    assert "missing keys: head.bias" in line and "Traceback" not in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("monitor", ["val_loss/dataloader_idx_0", "val_score"])
def test_monitors_plain_lightning_accepts_keep_the_best_and_a_run_without_test_step_ends_well(
    project: Path, cli: CliRunner, log_dir: Path, monitor: str
) -> None:
    # #31.3: both monitors were refused after the sanity check. #31.4: no test_step ended in a
    # 70-line traceback, with no model.pth or metrics.json. #31.6: no curve for these names.
    from zoo.data import TwoValidationSets
    from zoo.modules import TwoLoadersModule

    reference = pl.callbacks.ModelCheckpoint(monitor=monitor, dirpath=project / "plain")
    plain_trainer(max_epochs=1, callbacks=[reference]).fit(TwoLoadersModule(), TwoValidationSets())
    assert reference.best_model_path  # plain Lightning judges the key and keeps the best

    done = train(
        cli,
        log_dir,
        "experiment=zoo_two_loaders",
        f"callbacks.model_checkpoint.monitor={monitor}",
        "trainer.max_epochs=2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (run,) = run_dirs(log_dir)
    record = metrics(run)
    assert record["monitor"] == monitor and Path(record["best_checkpoint"]).is_file()
    assert (run / "model.pth").is_file() and (run / "curves.png").is_file()
    said = [line for line in done.stdout.splitlines() if "No test phase" in line]
    assert len(said) == 1 and said[0].endswith("No test phase: TwoLoadersModule has no test_step")

    from runkit.plots import panels_for, read_metrics

    logged = read_metrics(run)
    assert [p.name for p in panels_for([logged])][:2] == ["loss", "score"]
    labels = [label for label, _ in logged.lines("loss")]
    assert labels == ["train", "val dataloader_idx_0", "val dataloader_idx_1"]


@pytest.mark.slow
def test_under_ddp_no_test_step_is_said_once_and_the_run_keeps_its_best_and_exports(
    project: Path, cli: CliRunner, log_dir: Path
) -> None:
    done = train(
        cli, log_dir, "experiment=zoo_two_loaders", "trainer.devices=2", "trainer.max_epochs=1"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = (done.stdout + done.stderr).splitlines()
    assert len([line for line in output if "No test phase" in line]) == 1
    (run,) = run_dirs(log_dir)
    assert metrics(run)["devices"] == 2 and Path(metrics(run)["best_checkpoint"]).is_file()
    assert torch.load(run / "model.pth", weights_only=True).keys() == {"layer.weight", "layer.bias"}


@pytest.mark.slow
def test_a_monitor_missing_its_loader_suffix_is_refused_naming_the_keys_lightning_made(
    project: Path, cli: CliRunner, log_dir: Path
) -> None:
    done = train(
        cli, log_dir, "experiment=zoo_two_loaders", "callbacks.model_checkpoint.monitor=val_loss"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = last_line(done.stderr)
    assert line.startswith("error: callbacks.model_checkpoint.monitor='val_loss' is not a key ")
    assert "val_loss/dataloader_idx_0, val_loss/dataloader_idx_1" in line
    assert not list(log_dir.glob("train/**/checkpoints/*.ckpt"))


@pytest.mark.slow
def test_without_validation_step_the_monitor_is_reported_truthfully(
    project: Path, cli: CliRunner, log_dir: Path
) -> None:
    # #31.3: no check at all, and metrics.json said "monitor": "val/acc" with no best kept.
    from zoo.data import PointsData
    from zoo.modules import NoValidationModule

    reference = pl.callbacks.ModelCheckpoint(monitor="val/acc", dirpath=project / "plain")
    plain_trainer(max_epochs=1, callbacks=[reference]).fit(NoValidationModule(), PointsData())
    assert reference.best_model_path == ""  # plain Lightning keeps no best either (and warns)

    done = train(cli, log_dir, "experiment=zoo_no_validation", "trainer.max_epochs=2")
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    record = metrics(run)
    assert record["monitor"] is None and record["best_checkpoint"] is None
    assert "test_loss" in record["metrics"] and (run / "model.pth").is_file()
    output = (done.stdout + done.stderr).splitlines()
    said = [line for line in output if "no validation ran" in line]
    assert len(said) == 1, done.stdout[-3000:]
    assert "callbacks.model_checkpoint.monitor='val/acc'" in said[0]
    assert "NoValidationModule has no validation_step" in said[0]


def test_every_trainer_argument_is_a_key_and_reaches_the_trainer() -> None:
    # #31.7: trainer.accumulate_grad_batches & co. needed a +.
    from runkit.run.builders import build_trainer

    cfg = compose_train(
        "trainer.accumulate_grad_batches=3",
        "trainer.gradient_clip_val=0.5",
        "trainer.sync_batchnorm=true",
        "trainer.num_sanity_val_steps=0",
        "trainer.accelerator=cpu",
        "logger=none",
        "callbacks=none",
    )
    trainer = build_trainer(cfg)
    assert trainer.accumulate_grad_batches == 3 and trainer.gradient_clip_val == 0.5
    assert trainer.num_sanity_val_steps == 0


def test_the_trainer_keys_are_lightnings_own() -> None:
    from runkit.run.trainer_args import OWNED_ELSEWHERE, TRAINER_DEFAULTS, set_arguments

    signature = inspect.signature(pl.Trainer.__init__).parameters.values()
    lightning = {p.name: p.default for p in signature if p.name not in ("self", *OWNED_ELSEWHERE)}
    assert lightning == TRAINER_DEFAULTS
    # Keys at their defaults are not passed: the Trainer is called as the YAML alone says.
    cfg = compose_train()
    assert set(set_arguments(cfg.trainer)) == {
        "_target_", "default_root_dir", "min_epochs", "max_epochs", "devices", "log_every_n_steps",
        "deterministic", "plugins",
    }  # fmt: skip


@pytest.mark.slow
def test_a_misspelt_trainer_key_still_gets_did_you_mean(cli: CliRunner) -> None:
    done = cli("train", "trainer.gradient_clip_vall=1")
    assert done.returncode == 2
    assert last_line(done.stderr).startswith(
        "error: trainer.gradient_clip_vall is not a key of the config "
        "(did you mean trainer.gradient_clip_val?)"
    )


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)


class _WithNet(pl.LightningModule):
    def __init__(self, beside: str) -> None:
        super().__init__()
        self.net = _Net()
        if beside == "head":
            self.head = nn.Linear(3, 1)
        elif beside == "tied head":
            self.head = nn.Linear(3, 3)
            self.head.weight = self.net.layer.weight
            self.head.bias = self.net.layer.bias
        elif beside == "buffer":
            self.register_buffer("scale", torch.ones(3))
        elif beside == "unsaved buffer":
            self.register_buffer("scale", torch.ones(3), persistent=False)


@pytest.mark.parametrize(
    ("beside", "exported"),
    [("nothing", "net"), ("tied head", "net"), ("unsaved buffer", "net"), ("head", "module"),
     ("buffer", "module")],
)  # fmt: skip
def test_model_pth_is_net_alone_only_when_net_holds_every_weight(
    beside: str, exported: str
) -> None:
    from runkit.safety.checkpoints import exported_part

    model = _WithNet(beside)
    assert exported_part(model) is (model.net if exported == "net" else model)


def test_the_template_classifier_still_exports_its_network_alone() -> None:
    # Its best-accuracy metric is saved state, not a weight the forward uses.
    from hydra.utils import instantiate

    from runkit.safety.checkpoints import exported_part

    model = instantiate(compose_train().model, _convert_="all")
    assert any(not k.startswith("net.") for k in model.state_dict())
    assert exported_part(model) is model.net


def test_a_load_that_would_leave_weights_uninitialised_names_them(tmp_path: Path) -> None:
    from runkit.errors import RunError
    from runkit.safety.checkpoints import load_exported_weights

    network_only = _Net().state_dict()  # an older model.pth of the network alone
    with pytest.raises(RunError, match=r"missing keys: head\.bias, head\.weight, net\.layer"):
        load_exported_weights(_WithNet("head"), network_only, tmp_path / "model.pth")


def test_curves_group_names_whatever_their_separator(tmp_path: Path) -> None:
    # #31.6: names without a slash got no panel, silently.
    from runkit.plots import panels_for, read_metrics

    (tmp_path / "csv").mkdir()
    columns = [
        "epoch", "step", "train_loss_step", "train_loss_epoch", "val_loss/dataloader_idx_0",
        "val-loss/dataloader_idx_1", "val.acc", "alpha", "test_loss",
    ]  # fmt: skip
    with (tmp_path / "csv" / "metrics.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for epoch in (0, 1):
            writer.writerow([epoch, 10 * epoch, 1, 2, 3, 4, 0.5, 0.1, ""])
        writer.writerow([1, 20, "", "", "", "", "", "", 0.25])
    run = read_metrics(tmp_path)
    assert [p.name for p in panels_for([run]) if p.kind == "metric"] == ["loss", "acc", "alpha"]
    assert run.lines("loss") == [
        ("train", "train_loss_epoch"),
        ("val dataloader_idx_0", "val_loss/dataloader_idx_0"),
        ("val dataloader_idx_1", "val-loss/dataloader_idx_1"),
    ]
    assert run.test_figure("loss") == 0.25 and run.curve("alpha") == ([0, 1], [0.1, 0.1])
