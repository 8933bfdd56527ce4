"""Plain PyTorch networks. They know nothing of Lightning, so their ``state_dict`` is what
``torch.save(net.state_dict(), "model.pth")`` would write and any PyTorch code can load it."""

from __future__ import annotations

from collections.abc import Sequence

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


class ConvNet(nn.Module):
    """A small CNN: 3x3 conv blocks (conv, batch norm, ReLU), global pooling, a linear head.

    Sized for small images such as the 8x8 digits; ``channels`` sets the width and depth.

    The batch norms average their statistics over one epoch (``momentum=None``, restarted at
    each epoch by :func:`restart_epoch_statistics`) instead of an exponential average: with the
    usual momentum, a short run (a few dozen steps, or DDP's halved epochs) evaluates with
    statistics that lag far behind the weights and predicts one class on validation.
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
                nn.BatchNorm2d(size, momentum=None),  # see the class docstring
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


def restart_epoch_statistics(net: nn.Module) -> None:
    """Zero the running statistics of batch norms that average over an epoch (``momentum=None``).

    Called at the first batch of each training epoch, so evaluation uses the average of that
    epoch's batches, all taken with nearly the current weights. Layers with a momentum are
    left alone.
    """
    for module in net.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
            module.reset_running_stats()
