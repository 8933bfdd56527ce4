"""Every preset in configs/trainer/ composes, passes preflight where it can and runs on the CPU
(multi_node, dp, fsdp, ddp_sim: in test_multinode, test_dp, test_fsdp, test_multirun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import CliRunner, compose_train, run_dirs
from tinyapp import config_dir
from runkit.run.preflight import check_config

EXPECTED = {"default": ("auto", 1, 1), "cpu": ("auto", 1, 1), "gpu": ("auto", 1, 1),
            "ddp": ("ddp", 2, 1), "ddp_sim": ("ddp", 2, 1), "ddp_spawn": ("ddp_spawn", 2, 1),
            "dp": ("dp", 2, 1), "fsdp": ("fsdp", 2, 1), "multi_node": ("ddp", "auto", 2)}  # fmt: skip


def test_every_preset_file_is_listed_here() -> None:
    on_disk = {p.stem for p in (config_dir() / "trainer").glob("*.yaml")}
    assert on_disk == {*EXPECTED, "lightning"}  # lightning.yaml: the node the presets build on


@pytest.mark.parametrize("preset", EXPECTED)
def test_preset_composes_with_the_expected_strategy(preset: str) -> None:
    trainer = compose_train(f"trainer={preset}").trainer
    # trainer=dp and fsdp name the strategy by its class (dp: with the network it parallelises).
    strategy = trainer.strategy if isinstance(trainer.strategy, str) else preset
    classes = {"dp": "strategies.dp.DataParallelStrategy", "fsdp": "strategies.fsdp.FSDPStrategy"}
    if preset in classes:
        assert trainer.strategy._target_.endswith(classes[preset])
    assert (strategy, trainer.devices, trainer.num_nodes) == EXPECTED[preset]
    assert trainer._target_ == "lightning.pytorch.Trainer"


def test_cpu_presets_pass_preflight_and_ddp_on_cpu_equals_ddp_sim() -> None:
    for preset in ("cpu", "ddp_sim", "ddp_spawn", "fsdp", "multi_node"):
        check_config(compose_train(f"trainer={preset}", "trainer.accelerator=cpu"))
    ddp_cpu = compose_train("trainer=ddp", "trainer.accelerator=cpu").trainer
    ddp_sim = compose_train("trainer=ddp_sim").trainer
    assert OmegaConf.to_container(ddp_cpu) == OmegaConf.to_container(ddp_sim)  # every key


@pytest.mark.slow
def test_ddp_spawn_preset_runs_on_the_cpu(cli: CliRunner, log_dir: Path) -> None:
    # test=false: each fit or test spawns its processes anew (fresh interpreters), the same way
    tiny = ("trainer.max_epochs=1", "data.batch_size=256", "+trainer.limit_train_batches=2",
            "+trainer.limit_val_batches=1", "test=false", "callbacks.progress_bar.refresh_rate=0")  # fmt: skip
    result = cli("train", "trainer=ddp_spawn", "trainer.accelerator=cpu", *tiny, timeout=400)
    # A worker's own traceback comes first on stderr, the launcher's last: both are shown.
    assert result.returncode == 0, result.stderr[:4000] + "\n...\n" + result.stderr[-2000:]
    (run,) = run_dirs(log_dir)
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["devices"] == 2 and "val/acc" in summary["metrics"]
    assert (run / "checkpoints" / "last.ckpt").is_file()
