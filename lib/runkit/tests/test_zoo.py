"""Users' own LightningModules (``zoo/``) through the real CLI; a bare ``Trainer`` is the
reference where plain Lightning decides (monitors, a head built in ``setup()``)."""

from __future__ import annotations

import csv
import inspect
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_conformance import figures, metrics, newest
from torch import nn

from conftest import compose_train, last_line, run_dirs, run_entry

ZOO = Path(__file__).resolve().parent / "zoo"
QUIET = "callbacks.progress_bar.refresh_rate=0"
TRUSTED = "trusted_targets=[zoo.,torch.]"  # eval rebuilds only what the user says they trust


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # ``zoo`` importable
    cwd = tmp_path_factory.mktemp("zoo-project")
    shutil.copytree(ZOO, cwd / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(cwd))
    yield cwd
    sys.path.remove(str(cwd))


def train(cwd: Path, log_dir: Path, *overrides: str):
    args = ("--config-dir", "zoo/configs", QUIET, f"paths.log_dir={log_dir}", *overrides)
    return run_entry(cwd, "train", *args, timeout=400)


def train_ok(cwd: Path, log_dir: Path, *overrides: str):
    done = train(cwd, log_dir, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    return done, run


def evaluate(cwd: Path, log_dir: Path, source: Path, *overrides: str):
    return run_entry(cwd, "eval", f"paths.log_dir={log_dir}", TRUSTED, f"ckpt_path={source}",
                     *overrides)  # fmt: skip


@pytest.fixture(scope="module")
def trained(project: Path, tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple[str, ...], Path] = {}  # a 2-epoch run of experiment=zoo_<module>, once

    def get(module: str, *extra: str) -> Path:
        key = (module, *extra)
        if key not in made:
            log_dir = tmp_path_factory.mktemp(f"zoo-{module}")
            made[key] = train_ok(project, log_dir, f"experiment=zoo_{module}",
                                 "trainer.max_epochs=2", *extra)[1]  # fmt: skip
        return made[key]

    return get


def plain_trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)  # fmt: skip


MODULES = [("regression",), ("two_optimizers",), ("lazy",),
           ("lazy", "trainer.accumulate_grad_batches=3"), ("head",)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("run", MODULES, ids=["-".join(m) for m in MODULES])
def test_a_users_module_trains_tests_exports_and_evaluates_to_the_same_figures(
    project: Path, trained, tmp_path: Path, run: tuple[str, ...]
) -> None:
    done = trained(*run)
    reported = figures(done)
    assert reported and all(v == v for v in reported.values())  # test figures, none NaN
    assert (done / "curves.png").is_file() and (done / "csv" / "metrics.csv").is_file()
    best = Path(metrics(done)["best_checkpoint"])
    checkpoint = torch.load(best, weights_only=True)  # plain containers: weights_only loads it
    weights = torch.load(done / "model.pth", weights_only=True)  # the whole module, no net
    state = checkpoint["state_dict"]
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)
    if run == ("head",):  # list and dict arguments reach the checkpoint as plain data
        assert checkpoint["hyper_parameters"]["hidden"] == [16, 8]
        assert type(checkpoint["hyper_parameters"]["options"]) is dict
        assert {"head.weight", "head.bias"} <= weights.keys()
        from zoo.data import PointsData
        from zoo.modules import HeadModule

        (plain,) = plain_trainer().test(
            HeadModule(hidden=[16, 8], options={"lr": 0.05}), PointsData(), ckpt_path=best
        )
        assert plain["test_loss"] == pytest.approx(reported["test_loss"], rel=1e-6)
    for source in (done, best):  # model.pth (loaded after setup), then the .ckpt
        again = evaluate(project, tmp_path, source)
        assert again.returncode == 0, again.stderr[-3000:]
        evaluated = newest(tmp_path, "eval")
        assert figures(evaluated) == reported  # exactly, not approximately
        assert metrics(evaluated)["evaluated"] == str(
            done / "model.pth" if source == done else best
        )
        assert not {"epochs", "best_checkpoint", "resumed_from"} & metrics(evaluated).keys()
        assert "uses the CPU" in again.stdout and "training runs" not in again.stdout


@pytest.mark.slow
@pytest.mark.parametrize("module", ["lazy", "head"])  # a plain module's resume: conformance's
def test_a_users_module_resumes_from_its_run_directory(
    project: Path, trained, tmp_path: Path, module: str
) -> None:
    earlier = trained(module)
    _, later = train_ok(project, tmp_path, f"experiment=zoo_{module}", "trainer.max_epochs=3",
                        f"ckpt_path={earlier}", "test=false")  # fmt: skip
    assert metrics(later)["global_step"] == 3 * metrics(earlier)["global_step"] // 2
    assert metrics(later)["resumed_from"] == str(earlier / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_weights_of_another_head_are_refused_after_setup_in_one_line(
    project: Path, trained, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained("head"), run)
    weights = torch.load(run / "model.pth", weights_only=True)
    del weights["head.bias"]
    torch.save(weights, run / "model.pth")
    refused = evaluate(project, tmp_path / "logs", run)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = last_line(refused.stderr)
    assert line.startswith(f"error: {str(run / 'model.pth')!r} does not fit HeadModule"), line
    assert "missing keys: head.bias" in line and "Traceback" not in refused.stderr


@pytest.mark.slow
def test_eval_honours_data_overrides_and_refuses_model_ones(
    project: Path, trained, tmp_path: Path
) -> None:
    run = trained("regression")
    refused = evaluate(project, tmp_path, run, "model.num_classes=3")
    assert refused.returncode == 2
    assert last_line(refused.stderr) == (
        "error: model.num_classes=3 is not used: eval rebuilds the model from the config of the run "
        f"that wrote {str(run / 'model.pth')!r}; drop it (data.* overrides do apply)"
    )
    small = evaluate(project, tmp_path, run, "data.batch_size=1")
    assert small.returncode == 0, small.stderr[-3000:]
    (evaluated,) = run_dirs(tmp_path, "eval")
    with (evaluated / "csv" / "metrics.csv").open(newline="") as handle:
        steps = [row for row in csv.DictReader(handle) if row["test/loss_step"]]
    assert len(steps) == 640 - int(0.85 * 640)  # one step per test sample: batches of 1
    assert figures(evaluated)["test_mae"] == pytest.approx(figures(run)["test_mae"])


@pytest.mark.slow
@pytest.mark.parametrize("module", ["regression", "two_optimizers"])
def test_sync_dist_logging_under_ddp_with_every_default_callback_finishes(
    project: Path, tmp_path: Path, module: str
) -> None:
    _, run = train_ok(project, tmp_path, f"experiment=zoo_{module}", "trainer.devices=2",
                      "trainer.max_epochs=2")  # fmt: skip
    assert metrics(run)["devices"] == 2 and Path(metrics(run)["best_checkpoint"]).is_file()
    assert figures(run)


REFUSED = [  # overrides, the setting named, its value, a key the module logs
    (["model=regression", "data=points"], "callbacks.model_checkpoint.monitor", "val/acc",
     "val/loss"),
    (["experiment=zoo_two_optimizers", "callbacks.model_checkpoint.monitor=val/loss"],
     "callbacks.model_checkpoint.monitor", "val/loss", "val_loss"),
    (["experiment=zoo_regression", "callbacks=[default,early_stopping]"],
     "callbacks.early_stopping.monitor", "val/acc", "val/loss"),
    (["experiment=zoo_two_loaders", "callbacks.model_checkpoint.monitor=val_loss"],
     "callbacks.model_checkpoint.monitor", "val_loss",
     "val_loss/dataloader_idx_0, val_loss/dataloader_idx_1"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "setting", "key", "logs"), REFUSED,
    ids=["template-default", "slash-for-underscore", "early-stopping", "missing-loader-suffix"],
)  # fmt: skip
def test_a_monitor_key_the_module_never_logs_ends_the_run_at_the_first_validation(
    project: Path, tmp_path: Path, overrides: list[str], setting: str, key: str, logs: str
) -> None:
    done = train(project, tmp_path, *overrides)
    assert done.returncode == 2, done.stderr[-3000:]
    line = last_line(done.stderr)
    assert line.startswith(f"error: {setting}={key!r} is not a key ")
    assert "Traceback" not in done.stderr
    assert logs in line.split("; it logs: ")[1]
    assert not list(tmp_path.glob("train/**/checkpoints/*.ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("monitor", "devices"), [("val_loss/dataloader_idx_0", 2), ("val_score", 1)]
)
def test_monitors_plain_lightning_accepts_keep_the_best_and_a_run_without_test_step_ends_well(
    project: Path, tmp_path: Path, monitor: str, devices: int
) -> None:
    from zoo.data import TwoValidationSets
    from zoo.modules import TwoLoadersModule

    reference = pl.callbacks.ModelCheckpoint(monitor=monitor, dirpath=tmp_path / "plain")
    plain_trainer(max_epochs=1, callbacks=[reference]).fit(TwoLoadersModule(), TwoValidationSets())
    assert reference.best_model_path  # plain Lightning judges the key and keeps the best

    done, run = train_ok(project, tmp_path, "experiment=zoo_two_loaders", "trainer.max_epochs=2",
                         f"callbacks.model_checkpoint.monitor={monitor}", f"trainer.devices={devices}")  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert metrics(run)["monitor"] == monitor and Path(metrics(run)["best_checkpoint"]).is_file()
    assert metrics(run)["devices"] == devices and (run / "curves.png").is_file()
    exported = torch.load(run / "model.pth", weights_only=True)
    assert exported.keys() == {"layer.weight", "layer.bias"}
    said = [line for line in (done.stdout + done.stderr).splitlines() if "No test phase" in line]
    assert len(said) == 1 and said[0].endswith("No test phase: TwoLoadersModule has no test_step")

    from runkit.plots import panels_for, read_metrics

    logged = read_metrics(run)
    assert [p.name for p in panels_for([logged])][:2] == ["loss", "score"]
    labels = [label for label, _ in logged.lines("loss")]
    assert labels == ["train", "val dataloader_idx_0", "val dataloader_idx_1"]


@pytest.mark.slow
def test_without_validation_step_the_monitor_is_reported_truthfully(
    project: Path, tmp_path: Path
) -> None:
    from zoo.data import PointsData
    from zoo.modules import NoValidationModule

    reference = pl.callbacks.ModelCheckpoint(monitor="val/acc", dirpath=tmp_path / "plain")
    plain_trainer(max_epochs=1, callbacks=[reference]).fit(NoValidationModule(), PointsData())
    assert reference.best_model_path == ""  # plain Lightning keeps no best either (and warns)

    done, run = train_ok(project, tmp_path, "experiment=zoo_no_validation", "trainer.max_epochs=2")
    assert metrics(run)["monitor"] is None and metrics(run)["best_checkpoint"] is None
    assert "test_loss" in metrics(run)["metrics"] and (run / "model.pth").is_file()
    said = [x for x in (done.stdout + done.stderr).splitlines() if "no validation ran" in x]
    assert len(said) == 1, done.stdout[-3000:]
    assert "callbacks.model_checkpoint.monitor='val/acc'" in said[0]
    assert "NoValidationModule has no validation_step" in said[0]


def test_every_trainer_argument_is_a_key_and_reaches_the_trainer() -> None:
    from runkit.run.builders import OWNED_ELSEWHERE, TRAINER_DEFAULTS, build_trainer, set_arguments

    trainer = build_trainer(compose_train(
        "trainer.accumulate_grad_batches=3", "trainer.gradient_clip_val=0.5",
        "trainer.sync_batchnorm=true", "trainer.num_sanity_val_steps=0",
        "trainer.accelerator=cpu", "logger=none", "callbacks=none",
    ))  # fmt: skip
    assert trainer.accumulate_grad_batches == 3 and trainer.gradient_clip_val == 0.5
    assert trainer.num_sanity_val_steps == 0
    signature = inspect.signature(pl.Trainer.__init__).parameters.values()
    lightning = {p.name: p.default for p in signature if p.name not in ("self", *OWNED_ELSEWHERE)}
    assert lightning == TRAINER_DEFAULTS  # the keys are Lightning's own
    # Keys at their defaults are not passed: the Trainer is called as the YAML alone says.
    assert set(set_arguments(compose_train().trainer)) == {
        "_target_", "default_root_dir", "min_epochs", "max_epochs", "devices", "log_every_n_steps",
        "deterministic", "plugins",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("beside", "exported"),
    [("nothing", "net"), ("tied head", "net"), ("unsaved buffer", "net"), ("head", "module"),
     ("buffer", "module"), ("template", "net")],
)  # fmt: skip
def test_model_pth_is_net_alone_only_when_net_holds_every_weight(
    beside: str, exported: str
) -> None:
    from hydra.utils import instantiate

    from runkit.safety.checkpoints import exported_part

    model = nn.Module()
    model.net = nn.Linear(3, 3)
    if beside == "template":  # its best-accuracy metric is saved state, not a weight of forward
        model = instantiate(compose_train().model, _convert_="all")
        assert any(not k.startswith("net.") for k in model.state_dict())
    elif beside == "head":
        model.head = nn.Linear(3, 1)
    elif beside == "tied head":
        model.head = nn.Linear(3, 3)
        model.head.weight, model.head.bias = model.net.weight, model.net.bias
    elif beside.endswith("buffer"):
        model.register_buffer("scale", torch.ones(3), persistent=beside == "buffer")
    assert exported_part(model) is (model.net if exported == "net" else model)


def test_curves_group_names_whatever_their_separator(tmp_path: Path) -> None:
    from runkit.plots import panels_for, read_metrics

    (tmp_path / "csv").mkdir()
    columns = ["epoch", "step", "train_loss_step", "train_loss_epoch", "val_loss/dataloader_idx_0",
               "val-loss/dataloader_idx_1", "val.acc", "alpha", "test_loss"]  # fmt: skip
    rows = [[e, 10 * e, 1, 2, 3, 4, 0.5, 0.1, ""] for e in (0, 1)] + [[1, 20, *[""] * 6, 0.25]]
    with (tmp_path / "csv" / "metrics.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([columns, *rows])
    run = read_metrics(tmp_path)
    assert [p.name for p in panels_for([run]) if p.kind == "metric"] == ["loss", "acc", "alpha"]
    assert run.lines("loss") == [
        ("train", "train_loss_epoch"),
        ("val dataloader_idx_0", "val_loss/dataloader_idx_0"),
        ("val dataloader_idx_1", "val-loss/dataloader_idx_1"),
    ]
    assert run.test_figure("loss") == 0.25 and run.curve("alpha") == ([0, 1], [0.1, 0.1])
