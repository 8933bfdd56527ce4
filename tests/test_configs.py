"""Every config file composes, every ``_target_`` resolves and accepts its keys, overrides land."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from project import config_dir
from runkit.errors import RunError
from runkit.run.preflight import check_config, check_targets

CONFIGS = config_dir()
# Composed only: loggers that need an optional extra, and the node the trainer presets build on.
EXTRA_ONLY = {("logger", "wandb"), ("logger", "mlflow"), ("trainer", "lightning")}


def compose_train(*overrides: str, name: str = "train") -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/never-used"  # normally set by Hydra at run time
    return cfg


OPTIONS = [
    (p.parent.name, p.stem) for p in sorted(CONFIGS.glob("*/*.yaml")) if p.parent.name != "hydra"
]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_passes_preflight(group: str, option: str) -> None:
    if group == "hparams_search":
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="needs the optuna extra")
    cfg = compose_train(f"{group}={option}")
    assert cfg.get(group) is not None or group in ("experiment", "debug", "hparams_search")
    if (group, option) in EXTRA_ONLY:
        return
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        # A GPU preset on a CPU-only machine must be refused before anything starts.
        with pytest.raises(RunError, match="asks for a GPU"):
            check_config(cfg)
        return
    check_config(cfg)


def test_the_configs_compose_with_hydras_own_api_in_a_fresh_interpreter() -> None:
    """As Hydra's docs compose them, nothing of the project imported first; every Trainer
    argument a key of the config even so."""
    code = """import sys
from hydra import compose, initialize_config_dir
with initialize_config_dir(config_dir=sys.argv[1], version_base='1.3'):
    for name in ('train', 'eval', 'predict'):
        assert compose(name).trainer.gradient_clip_val is None, name
assert 'project' not in sys.modules
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(CONFIGS)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_lightning_trainer_config_is_every_trainer_argument_at_its_default() -> None:
    from runkit.run.builders import TRAINER_DEFAULTS

    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "trainer" / "lightning.yaml"))
    assert node == TRAINER_DEFAULTS


@pytest.mark.parametrize("name", ["eval", "predict"])
def test_eval_and_predict_name_the_checkpoint_they_require(name: str) -> None:
    """predict is eval's config with the prediction writer: same checkpoint, trust, GPU and
    speed keys; the writer puts predictions.pt in the run directory."""
    with pytest.raises(RunError, match=r"^ckpt_path is required; add ckpt_path=<a \.ckpt"):
        check_config(compose_train(name=name))
    cfg, evaluation = (
        compose_train("ckpt_path=x", name=name),
        compose_train("ckpt_path=x", name="eval"),
    )
    check_config(cfg)
    shared = [k for k in evaluation if k not in ("task_name", "callbacks", "paths", "hydra")]
    assert {k: cfg[k] for k in shared} == {k: evaluation[k] for k in shared}
    assert "graceful_interrupt" in cfg.callbacks
    if name == "predict":
        assert cfg.callbacks.predictions._target_ == "runkit.run.predictions.PredictionWriter"
        assert cfg.callbacks.predictions.output_dir == cfg.paths.output_dir


def test_overrides_reach_the_objects_the_config_builds() -> None:
    cfg = compose_train("trainer.max_epochs=3", "model.optimizer.lr=0.01", "trainer.devices=2")
    assert (cfg.trainer.max_epochs, cfg.trainer.devices) == (3, 2)
    assert cfg.model.scheduler.T_max == 3  # interpolated from trainer.max_epochs
    model = instantiate(cfg.model)
    assert type(model.net).__name__ == "ConvNet"
    assert model.optimizer_factory(params=model.parameters()).param_groups[0]["lr"] == 0.01
    assert instantiate(cfg.data).batch_size == cfg.data.batch_size
    names = {type(instantiate(node)).__name__ for node in cfg.callbacks.values()}
    assert {"ModelCheckpoint", "RichProgressBar"} <= names


def test_a_key_the_target_does_not_take_is_named_with_how_to_drop_it() -> None:
    cfg = compose_train("model._target_=lightning.pytorch.demos.boring_classes.BoringModel")
    with open_dict(cfg):
        del cfg.model.net
    with pytest.raises(RunError) as error:
        check_targets(cfg.model, "model")
    assert str(error.value).endswith(
        "are not arguments of lightning.pytorch.demos.boring_classes.BoringModel; it takes none; "
        "remove them with ~model.num_classes ~model.optimizer ~model.scheduler"
    )


def test_checkpoint_hyperparameters_are_plain_data() -> None:
    from runkit.run.builders import plain

    cfg = compose_train()
    with open_dict(cfg):
        del cfg["hydra"]  # the task never sees Hydra's own node
    assert OmegaConf.to_container(OmegaConf.create(plain(cfg))) == plain(cfg)  # no objects
    assert all(type(v) in (str, int, float, bool, type(None)) for v in _leaves(plain(cfg)))


def _leaves(data: object) -> list[object]:
    if isinstance(data, dict | list):
        return [x for v in (data.values() if isinstance(data, dict) else data) for x in _leaves(v)]
    return [data]


PLUGIN = "lightning.pytorch.plugins.environments.LightningEnvironment"
SCHEDULER = ["model.scheduler._target_=torch.optim.lr_scheduler.StepLR", "~model.scheduler.T_max",
             "+model.scheduler.step_size=1"]  # fmt: skip
BAD = [
    (["model.optimizer.lr=-1"], r"^model\.optimizer\.lr=-1 is invalid: torch\.optim\.AdamW "),
    (["+model.optimizer.betas=[0.9,1.5]"], r"^model\.optimizer\.betas=\[0\.9, 1\.5\] is invalid"),
    (["model.optimizer._target_=torch.optim.SGD", "+model.optimizer.momentum=-1"],
     r"^model\.optimizer\.momentum=-1 is invalid: torch\.optim\.SGD refuses it"),
    ([*SCHEDULER, "+model.scheduler.gamma=nan"], r"^model\.scheduler\.gamma=nan is not a finite number"),
    (["data.val_fraction=inf"], r"^data\.val_fraction=inf is not a finite number"),
    (["seed=-1"], r"^seed=-1 is invalid; expected an integer from 0 to 4294967295$"),
    (["seed=4294967296"], r"^seed=4294967296 is invalid"),
    (["seed=null"], r"^seed=None is invalid"),
    (["paths.log_dir="], r"^paths\.log_dir is empty; expected a directory$"),
    (["trainer.max_epochs=abc"], r"^trainer\.max_epochs='abc' has the wrong type; expected Optional\[int\]$"),
    (["data.batch_size='3'"], r"^data\.batch_size='3' has the wrong type; expected int$"),  # not converted
    (["trainer.accelerator=abacus"], r"^trainer\.accelerator='abacus' does not exist; .*cpu"),
    ([f"trainer.plugins=[{{_target_: {PLUGIN}, nope: 1}}]"],
     r"^trainer\.plugins\[0\]\.nope is not an argument of"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[o[-1] for o, _ in BAD])
def test_preflight_names_the_bad_value_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(RunError, match=message) as info:
        check_config(compose_train(*overrides))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [["seed=0"], ["seed=4294967295"], ["data.batch_size=7"]])
def test_good_values_pass(overrides: list[str]) -> None:
    check_config(compose_train(*overrides))  # model=mlp &c.: every option's test above


def test_safety_parts_speed_switches_and_gpu_keys_show_in_train_and_eval() -> None:
    """``--cfg job`` shows what every run has; ``python -m project.eval select_gpus=least_used
    gpu_wait_s=600`` waits as training does."""
    train, evaluation = compose_train(), compose_train("ckpt_path=x", name="eval")
    assert {"resume_state", "graceful_interrupt"} <= set(train.callbacks)
    assert train.trainer.plugins[0]._target_.endswith("checkpoints.AtomicCheckpointIO")
    assert "graceful_interrupt" in evaluation.callbacks
    assert (evaluation.precision, evaluation.matmul_precision) == (train.precision, "high")
    assert evaluation.keep_freed_memory is train.keep_freed_memory is True
    keys = {k for k in train if str(k).startswith("gpu_")}
    assert keys and {k: evaluation[k] for k in keys} == {k: train[k] for k in keys}
    check_config(compose_train("ckpt_path=x", "gpu_wait_s=600", name="eval"))
    with pytest.raises(RunError, match=r"^gpu_wait_s=-5 is invalid; expected"):
        check_config(compose_train("ckpt_path=x", "gpu_wait_s=-5", name="eval"))


def test_a_decoding_error_blames_only_config_files_that_do_not_decode(tmp_path: Path) -> None:
    """A non-UTF-8 data file read by the run is not reported as a config file (its traceback stays)."""
    from runkit.run.cli import undecodable_config

    err = UnicodeDecodeError("utf-8", b"ab\xe9", 2, 3, "invalid continuation byte")
    assert undecodable_config(err, [f"--config-dir={tmp_path}"], CONFIGS) is None
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "fine.yaml").write_text("a: 1\n")
    latin1 = tmp_path / "experiment" / "réglages.yaml"
    latin1.write_bytes("# réglages\n".encode("latin-1"))
    expected = f"{latin1} is not UTF-8 text (byte 0xe9 at position 2); save it as UTF-8"
    assert undecodable_config(err, ["--config-dir", str(tmp_path)], CONFIGS) == expected
    assert undecodable_config(err, [f"-cd={tmp_path}"], CONFIGS) == expected
