"""The default data: 1,797 handwritten digits, 8x8 pixels, shipped inside this package.

``digits.npz`` holds the UCI "Optical Recognition of Handwritten Digits" test set (E. Alpaydin,
C. Kaynak, 1998; CC BY 4.0), the same copy scikit-learn ships as ``load_digits``. We ship its 45 kB
ourselves instead of depending on scikit-learn (and SciPy) for one file: nothing is downloaded, the
template installs lighter, and loading takes milliseconds.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch

from runkit import ArrayDataModule

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images as float tensors in [0, 1], shape (N, 1, 8, 8), and labels 0-9."""
    with resources.files("project.data").joinpath("digits.npz").open("rb") as handle:
        arrays = np.load(handle)
        images, labels = arrays["images"], arrays["labels"]
    inputs = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    return inputs, torch.from_numpy(labels.astype(np.int64))


class DigitsDataModule(ArrayDataModule):
    """Train/val/test splits of the shipped digits (70/15/15 by default)."""

    def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        return load_digits()
