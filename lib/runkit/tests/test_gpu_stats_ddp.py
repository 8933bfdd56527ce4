"""GpuStatsMonitor under real DDP (two forked CPU ranks over gloo, one fake NVML each): rank 0 has
no NVML, yet GPU 1's figures reach its logger and every rank's monitors through the job's store."""

from __future__ import annotations

import csv
import textwrap

import pytest

from conftest import run_python

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers import CSVLogger
    from runkit.gpus import nvml
    from runkit.gpu_stats.callback import GpuStatsMonitor
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    fake = FakeNvml([FakeGpu(util_gpu=30, name="gpu0"), FakeGpu(util_gpu=80, name="gpu1")])

    class Install(pl.Callback):  # before the monitor: rank 1 has both GPUs, rank 0 no NVML
        def setup(self, trainer, pl_module, stage):
            global fake
            fake = fake if trainer.global_rank else FakeNvml(1, init_error="driver_not_loaded")
            nvml.use_library(fake)

    class Report(pl.Callback):  # after the monitor's teardown
        def teardown(self, trainer, pl_module, stage):
            print(f"RANK {trainer.global_rank} BEST {float(watchers[1].best_model_score)} "
                  f"SAMPLES {monitor.run_samples()} GPUS {sorted(monitor.run_energy_j())} "
                  f"balanced={fake.balanced} inits={fake.init_count}", flush=True)

    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[g.uuid for g in fake.gpus],
                              summary_table=False)
    watchers = [  # monitors on GPU keys: each rank must find them in its own callback_metrics
        EarlyStopping(monitor="loop/data_wait_frac", patience=5, check_on_train_epoch_end=True),
        ModelCheckpoint(dirpath=sys.argv[1] + "/ckpt", mode="max",
                        monitor="gpu/node0/cuda1/util_mean", save_on_train_epoch_end=True),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_epochs=2, log_every_n_steps=1,
        logger=CSVLogger(sys.argv[1], name="csv", version=0), enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Install(), monitor, *watchers, Report()],
    )
    loader = torch.utils.data.DataLoader(torch.randn(30, 32), batch_size=4)
    trainer.fit(BoringModel(), loader, loader)
    """
)


@pytest.mark.slow
def test_ddp_rank_0_without_nvml_gathers_rank_1s_gpu_for_every_rank(tmp_path) -> None:
    # the timeout: a hang in a collective fails here instead of blocking the suite
    result = run_python(SCRIPT, str(tmp_path), timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    column = lambda key: [float(r[key]) for r in rows if r.get(key)]  # noqa: E731
    assert column("gpu/node0/cuda1/util_mean") == [80, 80]  # only rank 1 sampled it
    assert not column("gpu/node0/cuda0/util_mean")  # rank 0 has no NVML
    assert not any(k.startswith("gpu/all/") for k in rows[0])  # one GPU in the run
    assert len(column("loop/data_wait_frac")) == 2
    # each validation's figures reach rank 0 with the validation's exchange
    assert column("gpu_val/node0/cuda1/util_mean") == [80, 80]
    assert "self.log('gpu" not in output  # every rank logs the same value: no advice to sync
    assert "rank 0: off: NVML is not available" in output
    # every rank's monitors saw the GPU keys (no all-reduce); 2 epochs x 30 samples
    for rank, inits in ((0, 0), (1, 1)):
        line = (
            f"RANK {rank} BEST 80.0 SAMPLES 60.0 GPUS ['node0/cuda1'] balanced=True inits={inits}"
        )
        assert line in output, output
