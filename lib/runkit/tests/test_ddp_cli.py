"""``python -m tinyapp.train trainer.devices=2`` on a CPU-only machine: two processes over gloo,
one run directory, files by rank 0 only, rank 1's own log, the data sharded between them."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from conftest import CliRunner, run_dirs

TRAIN_SAMPLES = 1797 - 2 * round(1797 * 0.15)  # the digits split: 1257 training samples
BATCH = 256


@pytest.mark.slow
def test_two_cpu_processes_train_one_run(cli: CliRunner, log_dir: Path) -> None:
    result = cli("train", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_epochs=2",
                 f"data.batch_size={BATCH}", "+trainer.limit_val_batches=1",
                 "callbacks.progress_bar.refresh_rate=0", "trainer.log_every_n_steps=1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]

    runs = run_dirs(log_dir)
    assert len(runs) == 1, list(log_dir.rglob("*"))  # rank 1 made no directory of its own
    run = runs[0]
    assert len(list(log_dir.rglob("config.yaml"))) == 2  # config.yaml + .hydra/config.yaml
    assert (run / "config.yaml").is_file() and (run / "model.pth").is_file()
    assert (run / "checkpoints" / "last.ckpt").is_file()

    # Rank 1 ran and logged into the same directory, in a file of its own.
    rank1_log = (run / "train_ddp_process_1.log").read_text()
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in rank1_log

    # batch_size is per process: each rank sees half the data, so an epoch has half the steps.
    steps_per_epoch = math.ceil(math.ceil(TRAIN_SAMPLES / 2) / BATCH)
    assert steps_per_epoch < math.ceil(TRAIN_SAMPLES / BATCH)
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["global_step"] == 2 * steps_per_epoch
    assert summary["devices"] == 2
    assert 0.0 <= summary["metrics"]["test/acc"] <= 1.0

    # metrics.csv written once: one row per logged step/epoch, no duplicates from rank 1.
    with (run / "csv" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    epochs = [row["epoch"] for row in rows if row.get("train/loss")]
    assert epochs == ["0", "1"]
    assert len([row for row in rows if row.get("test/acc")]) == 1
    # The test figures are reported once, by rank 0.
    assert result.stdout.count("Run directory:") == 1


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2])
def test_ddp_on_real_gpus(cli: CliRunner, log_dir: Path, count: int) -> None:
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < count:
        pytest.skip(f"needs {count} CUDA GPU(s); this machine has {available}")
    result = cli("train", "trainer=ddp", "trainer.accelerator=gpu", f"trainer.devices={count}",
                 "trainer.max_epochs=1", f"data.batch_size={BATCH}",
                 "callbacks.progress_bar.refresh_rate=0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["devices"] == count and summary["accelerator"] == "CUDAAccelerator"
    assert summary["global_step"] == math.ceil(math.ceil(TRAIN_SAMPLES / count) / BATCH)
