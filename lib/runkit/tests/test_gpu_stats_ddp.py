"""GpuStatsMonitor under real DDP (CPU ranks over gloo, one fake NVML each): GPU 1's figures
reach rank 0 only through the job's store; a rank without NVML or losing its GPU still joins."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from runkit.gpus import nvml
    from runkit.gpu_stats.callback import GpuStatsMonitor
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    variant, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning for the launched rank 1
    faults = variant == "faults"  # rank 1 has no NVML, rank 2 loses its GPU after epoch 0
    utils = (30, 80, 50) if faults else (30, 80)
    fake = FakeNvml([FakeGpu(util_gpu=u, name=f"gpu{i}") for i, u in enumerate(utils)],
                    init_error="driver_not_loaded" if faults and rank == 1 else None)
    nvml.use_library(fake)

    class LoseGpu2(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if faults and trainer.global_rank == 2:
                fake.gpus[2].lose(at=0.0)  # the real clock is past 0: lost from now on
                # the sampler thread's next reading finds it lost; wait for it, so epoch 1
                # cannot end first, reporting epoch 0's reading (a loaded machine did)
                deadline = time.monotonic() + 60
                while not all(r.dead for r in monitor._sampler.readers):
                    assert time.monotonic() < deadline, "the sampler never read the lost GPU"
                    time.sleep(0.01)

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
        def training_step(self, batch, i):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)
        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(x), y))
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[g.uuid for g in fake.gpus],
                              summary_table=False)
    # Monitors on GPU keys: each rank must find them in its own trainer.callback_metrics.
    watchers = []
    if variant == "ok":
        watchers = [
            EarlyStopping(monitor="gpu/all/util_mean_max", mode="max", patience=5,
                          check_on_train_epoch_end=True),
            ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), mode="max",
                            monitor="gpu/node0/cuda1/util_mean", save_on_train_epoch_end=True),
        ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=len(utils), strategy="ddp", max_epochs=2, log_every_n_steps=1,
        logger=CSVLogger(out_dir, name="csv", version=0), enable_checkpointing=bool(watchers),
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor, LoseGpu2(), *watchers],
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(M(), loader, loader)
    if watchers:
        print(f"RANK {trainer.global_rank} BEST {float(watchers[1].best_model_score)} "
              f"SAMPLES {monitor.run_samples()} GPUS {sorted(monitor.run_energy_j())}", flush=True)
    print(f"RANK {trainer.global_rank} DONE balanced={fake.balanced} inits={fake.init_count}",
          flush=True)
    """
)


def run_ddp(tmp_path: Path, variant: str) -> tuple[str, list[dict[str, str]]]:
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    # the timeout: a hang in a collective fails here instead of blocking the suite
    result = subprocess.run([sys.executable, str(script), variant, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return output, rows


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


@pytest.mark.slow
def test_ddp_gathers_every_rank_gpu(tmp_path: Path) -> None:
    output, rows = run_ddp(tmp_path, "ok")
    assert column(rows, "gpu/node0/cuda0/util_mean") == [30, 30]
    assert column(rows, "gpu/node0/cuda1/util_mean") == [80, 80]  # only rank 1 sampled it
    assert column(rows, "gpu/all/util_mean_min") == [30, 30]
    assert column(rows, "gpu/all/util_mean_max") == [80, 80]
    assert column(rows, "gpu/all/util_mean_mean") == [55, 55]
    assert len(column(rows, "loop/data_wait_frac")) == 2
    # each validation's figures, every rank's, reach rank 0 with the epoch's exchange
    assert column(rows, "gpu_val/node0/cuda1/util_mean") == [80, 80]
    assert column(rows, "gpu_val/all/util_mean_mean") == [55, 55]
    assert "self.log('gpu" not in output  # every rank logs the same value: no advice to sync
    for rank in (0, 1):
        assert f"RANK {rank} DONE balanced=True inits=1" in output, output
        # every rank's monitors saw the GPU keys (no all-reduce), 2 x 4 batches x 4 x 2 ranks
        gpus = "['node0/cuda0', 'node0/cuda1']"  # each rank knows both GPUs' energy
        assert f"RANK {rank} BEST 80.0 SAMPLES 64.0 GPUS {gpus}" in output, output


@pytest.mark.slow
def test_ddp_ranks_without_nvml_or_losing_their_gpu_still_join_every_gather(tmp_path) -> None:
    output, rows = run_ddp(tmp_path, "faults")
    assert column(rows, "gpu/node0/cuda0/util_mean") == [30, 30]
    assert not column(rows, "gpu/node0/cuda1/util_mean")
    assert column(rows, "gpu/node0/cuda2/util_mean") == [50]  # epoch 0 only
    assert "RANK 1 DONE balanced=True inits=0" in output, output
    assert "RANK 2 DONE balanced=True inits=1" in output, output
    assert "rank 1: off: NVML is not available" in output
