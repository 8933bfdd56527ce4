"""The template's digits (1,797 8x8 images, UCI, CC BY 4.0) as an ArrayDataModule."""

from pathlib import Path

import numpy as np
import torch

from runkit import ArrayDataModule


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    arrays = np.load(Path(__file__).with_name("digits.npz"))
    inputs = torch.from_numpy(arrays["images"].astype(np.float32) / 16.0).unsqueeze(1)
    return inputs, torch.from_numpy(arrays["labels"].astype(np.int64))


class DigitsDataModule(ArrayDataModule):
    def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        return load_digits()
