"""The compressed wire: which dtype a round's values travel and are summed in (``wire_dtype``).

Averagers, engines and the eager-SGD hooks take ``wire_dtype``: ``None`` (or ``"float32"``, or the model's own
dtype) sends the values as they are; ``torch.bfloat16`` / ``"bf16"`` / ``torch.float16`` / ``"fp16"`` casts them
to that type for the collective, which sums them in it (gloo and NCCL both sum bfloat16 and float16), and the
result is widened back to the model's dtype before anyone reads it. Half the bytes of float32 on the wire.

What is rounded, and why it does not pile up:

- **Models** (an engine in replace mode, the averagers' blocking means) travel as deltas from a *reference*
  that every rank of the world holds bit for bit: the mean of the last global average (a sync round, a
  ``"global"`` reduction); before the first one, world rank 0's model, broadcast once in full precision. A
  bfloat16 model rounded as a whole loses 2^-9 of its magnitude every round, and a local step smaller than that
  vanishes; its delta from the last global mean is small, and so is the delta's rounding.
- **Gradients** (an engine in accumulate mode: the eager-SGD hooks) carry *error feedback*: what the cast
  rounded off stays in this rank's residual and goes out with a later round, so nothing computed is lost
  (``error_feedback=False`` drops it: a plain cast).

Only the sum itself is rounded without feedback (it is the same on every rank, so replicas still agree).
"""

from __future__ import annotations

import torch

from wagma.checks import fail

__all__ = [
    "WIRE_DTYPES",
    "WireDtype",
    "as_wire_dtype",
    "wire_dtype_for",
    "wire_dtype_name",
    "wire_nbytes",
]

#: Names ``wire_dtype`` accepts (besides a ``torch.dtype``); ``None`` and ``"float32"``: no compression.
WIRE_DTYPES: dict[str, torch.dtype | None] = {
    "float32": None,
    "fp32": None,
    "none": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

WireDtype = torch.dtype | str | None


def as_wire_dtype(value: WireDtype, model_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The narrow dtype ``value`` names, or ``None`` when values travel as they are.

    ``None``, ``"float32"``/``"fp32"``/``"none"``, ``torch.float32`` and ``model_dtype`` itself mean no cast.

    Raises:
        ValueError: for another name or dtype (the message lists the accepted ones), or a wire type wider than
            the model's (``model_dtype``), which would add bytes instead of saving them.
    """
    if value is None:
        return None
    if isinstance(value, str):
        key = value.lower()
        if key not in WIRE_DTYPES:
            raise fail("wire_dtype", f"one of {sorted(WIRE_DTYPES)} or a torch dtype", value)
        dtype = WIRE_DTYPES[key]
    elif isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"wire_dtype: expected torch.bfloat16, torch.float16 or torch.float32, found {value}")
        dtype = None if value == torch.float32 else value
    else:
        raise ValueError(f"wire_dtype: expected a torch dtype, one of {sorted(WIRE_DTYPES)} or None, found {value!r}")
    if dtype is None or model_dtype is None or dtype == model_dtype:
        return None if dtype == model_dtype else dtype
    if model_dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"wire_dtype: expected a type narrower than the model's {model_dtype} (or None), found {dtype}"
        )
    return dtype


def wire_nbytes(numel: int, dtype: torch.dtype, wire_dtype: torch.dtype | None) -> int:
    """Bytes one rank hands to a collective for ``numel`` values of ``dtype`` sent as ``wire_dtype``."""
    itemsize = torch.empty((), dtype=wire_dtype if wire_dtype is not None else dtype).element_size()
    return int(numel) * itemsize


def wire_dtype_for(wire_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype | None:
    """The wire type for values of ``dtype``: ``wire_dtype`` for float32/float64 values, ``None`` (sent as they
    are) for the rest, e.g. a model's half-precision buffers, which are narrow already."""
    return wire_dtype if wire_dtype is not None and dtype in (torch.float32, torch.float64) else None


def wire_dtype_name(dtype: torch.dtype | None) -> str:
    """A wire type's config name: ``"bf16"``, ``"fp16"`` or ``"float32"`` (for ``None``)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "float32") if dtype is not None else "float32"
