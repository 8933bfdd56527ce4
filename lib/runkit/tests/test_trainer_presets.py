"""Every preset in configs/trainer/ composes, passes preflight where it can run, and runs on the CPU
(``multi_node``, ``dp`` and ``fsdp`` run in test_multinode.py, test_dp.py, test_fsdp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from conftest import CliRunner, last_line, run_dirs
from tinyapp import config_dir
from runkit.errors import RunError
from runkit.run.launch import register_resolvers
from runkit.run.preflight import check_config

PRESETS = ("default", "cpu", "gpu", "ddp", "ddp_sim", "ddp_spawn", "dp", "fsdp", "multi_node")
TINY = ("trainer.max_epochs=1", "data.batch_size=256", "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
        "callbacks.progress_bar.refresh_rate=0")  # fmt: skip


def composed(*overrides: str) -> DictConfig:
    register_resolvers()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_every_preset_file_is_listed_here() -> None:
    on_disk = {p.stem for p in (config_dir() / "trainer").glob("*.yaml")}
    assert on_disk == {*PRESETS, "lightning"}  # lightning.yaml: the node the presets build on


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_with_the_expected_strategy(preset: str) -> None:
    trainer = composed(f"trainer={preset}").trainer
    expected = {"ddp": ("ddp", 2, 1), "ddp_sim": ("ddp", 2, 1), "ddp_spawn": ("ddp_spawn", 2, 1),
                "dp": ("dp", 2, 1), "fsdp": ("fsdp", 2, 1),
                "multi_node": ("ddp", "auto", 2)}.get(preset, ("auto", 1, 1))  # fmt: skip
    # trainer=dp names the strategy by its class, with the network attribute it parallelises.
    strategy = trainer.strategy if isinstance(trainer.strategy, str) else preset
    if preset == "dp":
        assert trainer.strategy._target_.endswith("strategies.dp.DataParallelStrategy")
    if preset == "fsdp":
        assert trainer.strategy._target_.endswith("strategies.fsdp.FSDPStrategy")
    assert (strategy, trainer.devices, trainer.num_nodes) == expected
    assert trainer._target_ == "lightning.pytorch.Trainer"


def test_cpu_presets_pass_preflight_and_ddp_on_cpu_equals_ddp_sim() -> None:
    for preset in ("cpu", "ddp_sim", "ddp_spawn", "fsdp", "multi_node"):
        check_config(composed(f"trainer={preset}", "trainer.accelerator=cpu"))
    ddp_cpu = OmegaConf.to_container(composed("trainer=ddp", "trainer.accelerator=cpu").trainer)
    ddp_sim = OmegaConf.to_container(composed("trainer=ddp_sim").trainer)
    assert ddp_cpu == ddp_sim  # every Trainer argument is a key of both (sync_batchnorm too)


def test_dp_preset_without_gpus_fails_in_preflight() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU; DP runs in tests/test_dp.py")
    with pytest.raises(RunError, match=r"strategy=dp asks for a GPU .*trainer=ddp_sim"):
        check_config(composed("trainer=dp"))


@pytest.mark.slow
def test_dp_preset_from_the_cli_is_one_line(cli: CliRunner) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU; DP runs in tests/test_dp.py")
    result = cli("train", "trainer=dp")
    assert result.returncode == 2
    assert last_line(result.stderr).startswith("error: trainer.strategy=dp asks for a GPU")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "processes"),
    [("cpu", 1), ("ddp_sim", 2), ("ddp_spawn", 2)],
)
def test_preset_runs_on_the_cpu(cli: CliRunner, log_dir: Path, preset: str, processes: int) -> None:
    result = cli("train", f"trainer={preset}", "trainer.accelerator=cpu", *TINY, timeout=400)
    # A worker's own traceback comes first on stderr, the launcher's last: both are shown.
    assert result.returncode == 0, result.stderr[:4000] + "\n...\n" + result.stderr[-2000:]
    (run,) = run_dirs(log_dir)
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["devices"] == processes
    assert "test/acc" in summary["metrics"]
    assert (run / "checkpoints" / "last.ckpt").is_file()
