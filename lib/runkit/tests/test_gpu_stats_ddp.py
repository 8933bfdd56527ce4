"""GpuStatsMonitor under real DDP (two CPU ranks over gloo, one fake NVML each): rank 0 has no
NVML, yet GPU 1's figures reach its logger and every rank's monitors through the job's store
(a GPU lost mid-run: test_gpu_telemetry; its rank keeps posting, as rank 0 does here)."""

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
    import os, sys
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from runkit.gpus import nvml
    from runkit.gpu_stats.callback import GpuStatsMonitor
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    out_dir = sys.argv[1]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning for the launched ranks
    fake = FakeNvml([FakeGpu(util_gpu=u, name=f"gpu{i}") for i, u in enumerate((30, 80))],
                    init_error="driver_not_loaded" if rank == 0 else None)  # rank 0: no NVML
    nvml.use_library(fake)

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

    data = torch.utils.data.TensorDataset(torch.randn(30, 4), torch.randint(0, 2, (30,)))
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[g.uuid for g in fake.gpus],
                              summary_table=False)
    # Monitors on GPU keys: each rank must find them in its own trainer.callback_metrics.
    watchers = [
        EarlyStopping(monitor="loop/data_wait_frac", patience=5, check_on_train_epoch_end=True),
        ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), mode="max",
                        monitor="gpu/node0/cuda1/util_mean", save_on_train_epoch_end=True),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, log_every_n_steps=1,
        logger=CSVLogger(out_dir, name="csv", version=0), enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor, *watchers],
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(M(), loader, loader)
    print(f"RANK {trainer.global_rank} BEST {float(watchers[1].best_model_score)} "
          f"SAMPLES {monitor.run_samples()} GPUS {sorted(monitor.run_energy_j())}", flush=True)
    print(f"RANK {trainer.global_rank} DONE balanced={fake.balanced} inits={fake.init_count}",
          flush=True)
    """
)


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


@pytest.mark.slow
def test_ddp_rank_0_without_nvml_gathers_rank_1s_gpu_for_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    # the timeout: a hang in a collective fails here instead of blocking the suite
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert column(rows, "gpu/node0/cuda1/util_mean") == [80, 80]  # only rank 1 sampled it
    assert not column(rows, "gpu/node0/cuda0/util_mean")  # rank 0 has no NVML
    assert not any(k.startswith("gpu/all/") for k in rows[0])  # one GPU in the run
    assert len(column(rows, "loop/data_wait_frac")) == 2
    # each validation's figures reach rank 0 with the validation's exchange
    assert column(rows, "gpu_val/node0/cuda1/util_mean") == [80, 80]
    assert "self.log('gpu" not in output  # every rank logs the same value: no advice to sync
    assert "rank 0: off: NVML is not available" in output
    for rank, inits in ((0, 0), (1, 1)):
        assert f"RANK {rank} DONE balanced=True inits={inits}" in output, output
        # every rank's monitors saw the GPU keys (no all-reduce); 2 epochs x 30 samples
        assert f"RANK {rank} BEST 80.0 SAMPLES 60.0 GPUS ['node0/cuda1']" in output, output
