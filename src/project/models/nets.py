"""Plain PyTorch networks. They know nothing of Lightning, so their ``state_dict`` is what
``torch.save(net.state_dict(), "model.pth")`` would write and any PyTorch code can load it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MLP(nn.Module):
    """Flatten, then fully connected layers with ReLU and dropout."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: Sequence[int] = (256, 128),
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(dropout)]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class EpochBatchNorm2d(nn.BatchNorm2d):
    """Batch norm whose evaluation statistics are the plain average over the batches trained on
    since the layer last evaluated: with validation after every epoch, that epoch's.

    With the usual momentum (an exponential average), a short run (a few dozen steps, or DDP's
    halved epochs) evaluates with statistics that lag far behind the weights, and the network
    predicts one class on validation. torch's own plain average (``momentum=None``) reads its
    batch count back to the host at every step (a GPU sync) and never forgets the first steps.
    Here the average is kept with tensor operations only, and the first training batch after an
    evaluation starts a new one. Its ``state_dict`` is a ``BatchNorm2d``'s (``sync_batchnorm=true``
    swaps it for torch's ``SyncBatchNorm``, with the usual momentum).
    """

    running_mean: Tensor  # always tracked here (torch types them Optional)
    running_var: Tensor
    num_batches_tracked: Tensor
    evaluated: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__(num_features, eps=eps)
        # Set by an evaluation forward pass; a buffer, so it follows the layer to its device.
        self.register_buffer("evaluated", torch.tensor(False), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            self.evaluated.fill_(True)
            return super().forward(x)
        # momentum=1 writes this batch's mean and (unbiased) variance into the buffers given.
        mean, var = torch.zeros_like(self.running_mean), torch.zeros_like(self.running_var)
        out = F.batch_norm(x, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        with torch.no_grad():
            count = self.num_batches_tracked
            count.mul_(self.evaluated.logical_not()).add_(1)  # back to 1 after an evaluation
            self.evaluated.fill_(False)
            weight = count.reciprocal()  # 1/n: running values become the mean of n batches
            self.running_mean.lerp_(mean, weight)
            self.running_var.lerp_(var, weight)
        return out


class ConvNet(nn.Module):
    """A small CNN: 3x3 conv blocks (conv, batch norm, ReLU), global pooling, a linear head.

    Sized for small images such as the 8x8 digits; ``channels`` sets the width and depth. The
    batch norms are :class:`EpochBatchNorm2d`: evaluation right after a short run is sound.
    """

    def __init__(
        self,
        in_channels: int = 1,
        channels: Sequence[int] = (32, 64, 128),
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = in_channels
        for size in channels:
            blocks += [
                nn.Conv2d(width, size, kernel_size=3, padding=1, bias=False),
                EpochBatchNorm2d(size),
                nn.ReLU(inplace=True),
            ]
            width = size
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
