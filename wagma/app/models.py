"""Small models for the training application: an MLP, a CNN, a Transformer encoder and a byte-level language
model, picked by name.

The MLP and the CNN take ``(N, C, H, W)`` images (the MLP flattens them itself); the Transformer takes ``(N, L)``
int64 token rows, 0 padding, ``L`` at most the data's ``max_len`` (``data=sequences``). These three return
``(N, num_classes)`` logits. The byte-level language model (``byte_lm``, ``data=torch_source``) is a causal
Transformer: ``(N, L)`` token rows in, ``(N, L, vocab)`` logits out, position t seeing tokens 0..t only. The CNN
ends in an adaptive pooling layer, so the same architecture works on 8x8 and 28x28 inputs. None has BatchNorm:
every tensor of their state is a parameter (the Transformers' LayerNorms included), which keeps model averaging
simple.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from wagma.checks import check_int, fail

__all__ = ["ByteLM", "CNN", "KNOWN_MODELS", "MLP", "Transformer", "build_model"]


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
            raise fail("model.hidden", "positive layer widths", list(hidden))
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
            raise fail("in_shape", "a (C, H, W) input with H, W >= 2 (CNN)", tuple(in_shape))
        if len(channels) != 2 or min(int(c) for c in channels) < 1:
            raise fail("model.channels", "two positive channel counts", list(channels))
        check_int("model.hidden", hidden, minimum=1)
        c1, c2 = int(channels[0]), int(channels[1])
        super().__init__(
            nn.Conv2d(int(in_shape[0]), c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(c2 * 16, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class Transformer(nn.Module):
    """Token and position embeddings, a pre-norm ``nn.TransformerEncoder`` that ignores padding, the mean over the
    real tokens, a linear classifier. A step's cost grows with the tokens of its batch (attention with their
    square), which is what makes ``data=sequences`` imbalanced by its data."""

    def __init__(
        self,
        in_shape: Sequence[int],
        num_classes: int,
        *,
        vocab_size: int,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        ff: int = 128,
    ) -> None:
        """
        Args:
            in_shape: ``(max_len,)``: the longest token row the model will see.
            num_classes: output classes.
            vocab_size: token ids are ``0 .. vocab_size - 1``, 0 the padding.
            d_model, heads, layers, ff: the encoder's width, attention heads (dividing ``d_model``), layers and
                feed-forward width.
        """
        super().__init__()
        if len(in_shape) != 1 or int(in_shape[0]) < 1:
            raise fail("in_shape", f"token rows of shape (max_len,) ({type(self).__name__})", tuple(in_shape))
        if min(vocab_size, d_model, heads, layers, ff) < 1 or d_model % heads:
            raise ValueError(  # the form of wagma.checks.fail, with several values found
                f"{type(self).__name__}: expected positive sizes and heads dividing d_model, found "
                f"vocab_size={vocab_size}, d_model={d_model}, heads={heads}, layers={layers}, ff={ff}"
            )
        self.max_len = int(in_shape[0])
        self.embed = nn.Embedding(int(vocab_size), int(d_model), padding_idx=0)
        self.position = nn.Parameter(torch.randn(self.max_len, int(d_model)) * 0.02)
        layer = nn.TransformerEncoderLayer(
            int(d_model), int(heads), int(ff), dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, int(layers), enable_nested_tensor=False)
        self.norm = nn.LayerNorm(int(d_model))
        self.head = nn.Linear(int(d_model), int(num_classes))

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        """Refuse anything but ``(N, L)`` token rows no longer than the model's ``max_len``."""
        if tokens.dim() != 2 or tokens.shape[1] > self.max_len:
            raise fail("tokens", f"(N, L) token rows with L <= {self.max_len}", tuple(tokens.shape))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_tokens(tokens)
        pad = tokens == 0
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        h = self.norm(self.encoder(h, src_key_padding_mask=pad))
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


class ByteLM(Transformer):
    """A causal Transformer over tokens: :class:`Transformer`'s embeddings, encoder and final LayerNorm with a causal
    mask instead of the padding mask, and its linear head at every position, to the vocabulary. Padding sits after
    the real tokens, so the causal mask alone keeps it out of every real position; its logits are ignored by the
    loss (:func:`wagma.app.source_text.token_cross_entropy`). A step costs what its longest row costs (the batch is
    cut to it), attention the square of that."""

    def __init__(
        self,
        in_shape: Sequence[int],
        num_classes: int,
        *,
        vocab_size: int,
        d_model: int = 128,
        heads: int = 4,
        layers: int = 2,
        ff: int = 512,
    ) -> None:
        """
        Args:
            in_shape: ``(max_len,)``: the longest token row the model will see.
            num_classes: the logits per position: the vocabulary (``vocab_size``).
            vocab_size: token ids are ``0 .. vocab_size - 1``, 0 the padding.
            d_model, heads, layers, ff: the encoder's width, attention heads (dividing ``d_model``), layers and
                feed-forward width.
        """
        if int(num_classes) != int(vocab_size):
            raise fail("num_classes", f"vocab_size={vocab_size} (ByteLM predicts tokens)", num_classes)
        super().__init__(
            in_shape, num_classes, vocab_size=vocab_size, d_model=d_model, heads=heads, layers=layers, ff=ff
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_tokens(tokens)
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        h = self.embed(tokens) + self.position[:length]
        return self.head(self.norm(self.encoder(h, mask=mask, is_causal=True)))


_MODELS: dict[str, Callable[..., nn.Module]] = {"byte_lm": ByteLM, "cnn": CNN, "mlp": MLP, "transformer": Transformer}
KNOWN_MODELS: tuple[str, ...] = tuple(sorted(_MODELS))


def build_model(name: str, in_shape: Sequence[int], num_classes: int, **kwargs: object) -> nn.Module:
    """Build the model called ``name`` ("mlp", "cnn", "transformer" or "byte_lm") for inputs of ``in_shape``.

    ``kwargs`` go to the model's constructor (``hidden=[256, 128]`` for the MLP; ``channels``, ``hidden``
    for the CNN; ``vocab_size`` -- from the data, :meth:`wagma.app.data.Dataset.model_options` -- and ``d_model``,
    ``heads``, ``layers``, ``ff`` for the Transformer and the byte-level model; ``token_targets``, from the data,
    marks data whose targets are the next token at every position, which only ``byte_lm`` predicts). Lists from a
    config are accepted wherever a sequence is expected.

    Raises:
        ValueError: for an unknown name or bad sizes.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    token_targets = bool(kwargs.pop("token_targets", False))
    if name == "byte_lm" and not token_targets:
        raise ValueError("model=byte_lm predicts the next byte: use it with data=torch_source")
    if token_targets and name != "byte_lm":
        raise ValueError(f"data=torch_source predicts every next byte: it needs model=byte_lm, not model={name}")
    if (name in ("transformer", "byte_lm")) != ("vocab_size" in kwargs):
        raise ValueError(
            "model=transformer reads token data: use it with data=sequences"
            if name == "transformer"
            else f"model={name} reads images: data=sequences needs model=transformer"
        )
    try:
        return _MODELS[name](tuple(in_shape), int(num_classes), **kwargs)
    except TypeError as exc:  # an unexpected keyword from a config
        raise ValueError(f"bad arguments for model {name!r}: {exc}") from exc
