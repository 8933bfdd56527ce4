"""The shipped digits and the array DataModule: shapes, a fixed split, clear errors."""

from __future__ import annotations

import pytest
import torch

from project.data.arrays import ArrayDataModule
from project.data.digits import DigitsDataModule, load_digits
from project.errors import ProjectError


def test_digits_ship_with_the_package() -> None:
    inputs, labels = load_digits()
    assert inputs.shape == (1797, 1, 8, 8)
    assert inputs.dtype == torch.float32
    assert inputs.min() >= 0.0 and inputs.max() <= 1.0
    assert labels.dtype == torch.int64
    assert torch.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def _indices(dm: ArrayDataModule) -> list[set[int]]:
    return [set(subset.indices) for subset in (dm.train_set, dm.val_set, dm.test_set)]


def test_split_is_disjoint_complete_and_fixed() -> None:
    first, second = DigitsDataModule(), DigitsDataModule()
    first.setup()
    torch.manual_seed(1234)  # the training seed must not move samples between splits
    second.setup()
    train, val, test = _indices(first)
    assert len(train) + len(val) + len(test) == 1797
    assert not (train & val or train & test or val & test)
    assert (len(val), len(test)) == (270, 270)
    assert _indices(first) == _indices(second)


def test_a_different_split_seed_gives_a_different_split() -> None:
    a, b = DigitsDataModule(split_seed=0), DigitsDataModule(split_seed=1)
    a.setup()
    b.setup()
    assert _indices(a)[2] != _indices(b)[2]


def test_loaders_batch_and_shuffle_only_training() -> None:
    dm = DigitsDataModule(batch_size=100)
    dm.setup()
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (100, 1, 8, 8) and labels.shape == (100,)
    assert len(dm.test_dataloader()) == 3  # 270 samples in batches of 100
    first = next(iter(dm.val_dataloader()))[1]
    again = next(iter(dm.val_dataloader()))[1]
    assert torch.equal(first, again)


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
    with pytest.raises(ProjectError, match=message) as info:
        DigitsDataModule(**kwargs)
    assert "\n" not in str(info.value)


def test_own_data_is_one_method() -> None:
    class Xor(ArrayDataModule):
        def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = torch.randint(0, 2, (200, 2)).float()
            return inputs, (inputs[:, 0] != inputs[:, 1]).long()

    dm = Xor(batch_size=10)
    dm.setup()
    inputs, labels = next(iter(dm.train_dataloader()))
    assert torch.equal(labels, (inputs[:, 0] != inputs[:, 1]).long())
