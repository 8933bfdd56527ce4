"""The shipped digits and the array DataModule: shapes, a fixed split, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from conftest import CliRunner, run_dirs, stand_in
from tinyapp.data import DigitsDataModule
from runkit.data import ArrayDataModule, BatchedTensorDataset
from runkit.errors import RunError


def test_split_is_fixed_by_its_own_seed_and_batches_come_from_one_index(monkeypatch) -> None:
    first, second, other = DigitsDataModule(batch_size=100), DigitsDataModule(), DigitsDataModule(split_seed=1)  # fmt: skip
    first.setup()
    torch.manual_seed(1234)  # the training seed must not move samples between splits
    second.setup()
    other.setup()
    indices = lambda dm: [set(s.indices) for s in (dm.train_set, dm.val_set, dm.test_set)]  # noqa: E731
    train, val, test = indices(first)
    assert len(train) + len(val) + len(test) == 1797
    assert not (train & val or train & test or val & test)
    assert (len(val), len(test)) == (270, 270)
    assert indices(first) == indices(second)
    assert indices(other)[2] != test  # another split_seed, another split
    served: list[int] = []  # samples read one by one
    read = BatchedTensorDataset.__getitem__
    monkeypatch.setattr(BatchedTensorDataset, "__getitem__", lambda s, i: served.append(i) or read(s, i))  # fmt: skip
    images, labels = next(iter(first.train_dataloader()))
    assert images.shape == (100, 1, 8, 8) and images.dtype == torch.float32
    assert labels.shape == (100,) and labels.dtype == torch.int64
    fast = list(first.val_dataloader())
    assert len(first.test_dataloader()) == 3 and served == []  # 270 samples in batches of 100
    assert torch.equal(fast[0][1], next(iter(first.val_dataloader()))[1])
    # A loader built by hand over the split (default collate) still gets (input, label) samples.
    by_hand = DataLoader(first.val_set, batch_size=100)
    for (x_fast, y_fast), (x_slow, y_slow) in zip(fast, by_hand, strict=True):
        assert torch.equal(x_fast, x_slow) and torch.equal(y_fast, y_slow)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, r"data\.batch_size=0 is invalid; expected an integer >= 1"),
        ({"val_fraction": 1.5}, r"data\.val_fraction=1\.5 is invalid"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "leaves nothing to train on"),
        ({"num_workers": -2}, r"data\.num_workers=-2 is invalid"),
    ],
)
def test_bad_arguments_fail_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(RunError, match=message) as info:
        DigitsDataModule(**kwargs)
    assert "\n" not in str(info.value)


def test_own_data_is_one_method_and_pin_memory_auto_pins_only_for_cuda_runs() -> None:
    class Xor(ArrayDataModule):
        def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = torch.randint(0, 2, (200, 2)).float()
            return inputs, (inputs[:, 0] != inputs[:, 1]).long()

    dm = Xor(batch_size=10)
    dm.setup()
    inputs, labels = next(iter(dm.train_dataloader()))
    assert torch.equal(labels, (inputs[:, 0] != inputs[:, 1]).long())
    assert dm.val_dataloader().pin_memory is False  # auto, no Trainer attached
    for device, pinned in (("cpu", False), ("cuda", True)):
        dm.trainer = stand_in(device)
        assert dm.val_dataloader().pin_memory is pinned
    dm.pin_memory = True
    assert dm.test_dataloader().pin_memory is True
    assert Xor(pin_memory=False, num_workers="auto").num_workers == 0


def test_under_ddp_every_evaluation_sample_is_served_exactly_once() -> None:
    # Lightning's own sampler pads a split to a multiple of the ranks (repeating samples)
    served: dict[str, list[int]] = {"val": [], "test": []}
    for rank in range(3):
        dm = DigitsDataModule(batch_size=50, val_fraction=0.17, test_fraction=0.17)  # 305 each
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 3, "rank": rank})
        dm.setup()
        for stage, loader in (("val", dm.val_dataloader()), ("test", dm.test_dataloader())):
            # A DistributedSampler already: Lightning keeps it instead of injecting its own.
            assert isinstance(loader.sampler, DistributedSampler)
            served[stage] += [int(i) for i in loader.sampler]
    for stage, split in (("val", dm.val_set), ("test", dm.test_set)):
        assert len(split) == 305
        assert sorted(served[stage]) == list(range(305)), stage
    one = DigitsDataModule()
    one.trainer = SimpleNamespace(distributed_sampler_kwargs=None)  # one process, or dp
    one.setup()
    assert not isinstance(one.test_dataloader().sampler, DistributedSampler)


@pytest.mark.slow
def test_ddp_metrics_count_every_sample_once(cli: CliRunner, log_dir: Path, tmp_path: Path) -> None:
    """Two forked DDP ranks, splits of 305: the figures equal one process's; no host read in a step."""
    split = ("data.val_fraction=0.17", "data.test_fraction=0.17", "data.batch_size=64")
    reads = ("+callbacks.host_reads._target_=host_reads.HostReadProbe",
             f"+callbacks.host_reads.report={tmp_path / 'reads'}")  # fmt: skip
    result = cli("train", "trainer=ddp_sim", "trainer.strategy=ddp_fork", "trainer.max_epochs=2",
                 *split, *reads, "callbacks.progress_bar.refresh_rate=0", timeout=600,
                 env={"PYTHONPATH": str(Path(__file__).parent)})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"reads.{rank}.json").read_text())
        assert found["windows"] >= 10 and found["reads"] == [], found["reads"][:5]
    (run,) = run_dirs(log_dir)
    logged = json.loads((run / "metrics.json").read_text())["metrics"]
    config = OmegaConf.load(run / "config.yaml")
    data, model = instantiate(config.data), instantiate(config.model)
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    model.load_state_dict(checkpoint["state_dict"])
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    (validated,) = trainer.validate(model, datamodule=data, verbose=False)
    (tested,) = trainer.test(model, datamodule=data, verbose=False)
    assert len(data.val_set) == len(data.test_set) == 305
    assert validated["val/acc"] == logged["val/acc"] < 1.0
    assert logged["val/acc"] > 0.7  # far above chance (batch norm's running statistics once: 0.1)
    assert tested["test/acc"] == logged["test/acc"] < 1.0
    assert validated["val/loss"] == pytest.approx(logged["val/loss"], rel=1e-6, abs=0)
    assert tested["test/loss"] == pytest.approx(logged["test/loss"], rel=1e-6, abs=0)
