"""Small classifiers for the training application: an MLP and a CNN, picked by name.

Both take ``(N, C, H, W)`` images (the MLP flattens them itself) and return ``(N, num_classes)`` logits.
The CNN ends in an adaptive pooling layer, so the same architecture works on 8x8 and 28x28 inputs.
Neither has BatchNorm: every tensor of their state is a parameter, which keeps model averaging simple.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["CNN", "KNOWN_MODELS", "MLP", "build_model"]


class MLP(nn.Sequential):
    """Flatten, then ``Linear -> ReLU`` per hidden size, then a linear classifier."""

    def __init__(self, in_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128,)) -> None:
        """
        Args:
            in_shape: shape of one input, e.g. ``(1, 8, 8)``.
            num_classes: number of output logits.
            hidden: widths of the hidden layers (may be empty: a linear model).
        """
        if any(int(h) < 1 for h in hidden):
            raise ValueError(f"hidden sizes must be positive, got {list(hidden)}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(int(d) for d in in_shape)
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


class CNN(nn.Sequential):
    """Two ``3x3 conv -> ReLU`` layers, 2x2 max-pooling, adaptive pooling to 4x4, a two-layer head."""

    def __init__(
        self,
        in_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        hidden: int = 64,
    ) -> None:
        """
        Args:
            in_shape: ``(channels, height, width)`` of one input; height and width at least 2.
            num_classes: number of output logits.
            channels: output channels of the two convolutions.
            hidden: width of the fully connected hidden layer.
        """
        if len(in_shape) != 3 or min(int(in_shape[1]), int(in_shape[2])) < 2:
            raise ValueError(f"CNN needs a (C, H, W) input with H, W >= 2, got {tuple(in_shape)}")
        if len(channels) != 2 or min(int(c) for c in channels) < 1 or hidden < 1:
            raise ValueError(f"CNN needs two positive channel counts and hidden >= 1, got {list(channels)}, {hidden}")
        c1, c2 = int(channels[0]), int(channels[1])
        super().__init__(
            nn.Conv2d(int(in_shape[0]), c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(c2 * 16, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


_MODELS: dict[str, Callable[..., nn.Module]] = {"cnn": CNN, "mlp": MLP}
KNOWN_MODELS: tuple[str, ...] = tuple(sorted(_MODELS))


def build_model(name: str, in_shape: Sequence[int], num_classes: int, **kwargs: object) -> nn.Module:
    """Build the model called ``name`` ("mlp" or "cnn") for inputs of ``in_shape``.

    ``kwargs`` go to the model's constructor (``hidden=[256, 128]`` for the MLP; ``channels``, ``hidden``
    for the CNN). Lists from a config are accepted wherever a sequence is expected.

    Raises:
        ValueError: for an unknown name or bad sizes.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    try:
        return _MODELS[name](tuple(in_shape), int(num_classes), **kwargs)
    except TypeError as exc:  # an unexpected keyword from a config
        raise ValueError(f"bad arguments for model {name!r}: {exc}") from exc
