"""What an averager averages: collecting tensors, binding them by identity, packing them into flat buffers.

- :func:`collect_parameters` / :func:`collect_named` turn ``model.parameters()``, ``model.named_parameters()``,
  a list of tensors or ``optimizer.param_groups`` into one list of distinct tensors (with names where the
  input carries them: ``named_parameters()`` pairs, or the ``"param_names"`` torch optimizers keep when built
  from named parameters); :func:`collect_buffers` does the same for a module's floating-point buffers.
- :class:`ParameterBinding` remembers the tensors an averager works on *by identity*, in the order they were
  bound. Later calls may list the same tensors in any order (an optimizer's ``param_groups`` rarely follow
  ``model.parameters()``): they are put back into the bound order, so every flat buffer, every engine's
  published model and every piece of per-buffer state keeps meaning the same parameters. A call with another
  set of tensors raises ``ValueError`` naming what is missing and what is new.
- :class:`FlatBuffers` packs a list of tensors into one contiguous buffer per (dtype, device); when the tensors
  already lie back to back in one storage (:func:`flatten_parameters`), the buffer *is* that memory and
  packing and unpacking copy nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "local_tensor",
    "FlatBuffers",
    "flatten_parameters",
    "ParameterBinding",
    "ParamsLike",
    "collect_buffers",
    "collect_named",
    "collect_parameters",
    "reduced_parameters",
    "widened",
]

#: What ``average_parameters`` accepts: ``model.parameters()``, ``model.named_parameters()``, a list of
#: tensors, or ``optimizer.param_groups`` (dicts with a ``"params"`` list, optionally ``"param_names"``).
ParamsLike = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]
#: What an averager takes as buffers: tensors, or ``module.named_buffers()`` pairs.
BuffersLike = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for a ``DTensor`` (an FSDP2 parameter) the shard this rank holds.

    The shard is the DTensor's own local tensor object, which FSDP2 keeps for the parameter's lifetime and whose
    storage the optimizer updates: averaging it in place averages this rank's shard, and only that.
    """
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def collect_named(params: ParamsLike) -> tuple[list[torch.Tensor], list[str | None]]:
    """Flatten ``params`` into distinct floating-point tensors, in order, with their names where known.

    Unlike ``torch.distributed.algorithms.model_averaging.utils.get_params_to_average``, parameters are
    kept whether or not they have a ``.grad``: a parameter that got no gradient this step still differs
    between ranks and must be averaged.

    Args:
        params: ``model.parameters()``, ``model.named_parameters()``, a list of tensors, or
            ``optimizer.param_groups``.

    Returns:
        ``(tensors, names)``: ``names[i]`` is the name of ``tensors[i]``, or ``None`` when the input had none.

    Raises:
        ValueError: for a bare tensor or module, an item that is neither a tensor, a (name, tensor) pair nor
            a param-group dict, or a tensor that is not floating point.
    """
    if isinstance(params, (torch.Tensor, torch.nn.Module, dict)):
        raise ValueError(
            "params: expected an iterable of tensors (model.parameters()) or of param-group dicts "
            f"(optimizer.param_groups), found a {type(params).__name__}"
        )
    out: list[torch.Tensor] = []
    names: list[str | None] = []
    seen: set[int] = set()

    def add(tensor: object, name: str | None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"params: expected tensors, found a {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise ValueError(f"params: expected floating-point tensors, found dtype {tensor.dtype}")
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
            names.append(name)

    for item in params:
        if isinstance(item, dict):
            if "params" not in item:
                raise ValueError(f"params: expected param-group dicts with a 'params' key, found keys {sorted(item)}")
            group = item["params"]
            group = [group] if isinstance(group, torch.Tensor) else list(group)
            group_names = item.get("param_names")
            if group_names is None or len(group_names) != len(group):
                group_names = [None] * len(group)
            for tensor, name in zip(group, group_names):
                add(tensor, name)
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            add(item[1], item[0])
        else:
            add(item, None)
    return out, names


def collect_parameters(params: ParamsLike) -> list[torch.Tensor]:
    """The tensors of :func:`collect_named`, without their names."""
    return collect_named(params)[0]


def reduced_parameters(params: ParamsLike) -> tuple[list[torch.Tensor], torch.dtype, torch.device]:
    """The distinct parameters of ``params`` that require a gradient (those DDP reduces), with their one dtype and
    device.

    Raises:
        ValueError: none requires a gradient, or they do not share one dtype and device.
    """
    grads = [p for p in collect_parameters(params) if p.requires_grad]
    if not grads:
        raise ValueError("params: expected at least one parameter that requires a gradient, found none")
    kinds = {(p.dtype, p.device) for p in grads}
    if len(kinds) != 1:
        raise ValueError(f"params: expected one dtype and device, found {sorted(map(str, kinds))}")
    ((dtype, device),) = kinds
    return grads, dtype, device


def collect_buffers(buffers: BuffersLike, exclude: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Return the distinct floating-point tensors of ``buffers`` not in ``exclude``, in order.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are skipped: they count, they do not average.
    """
    return collect_named_buffers(buffers, exclude)[0]


def collect_named_buffers(
    buffers: BuffersLike, exclude: Sequence[torch.Tensor] = ()
) -> tuple[list[torch.Tensor], list[str | None]]:
    """Like :func:`collect_buffers`, with names for ``module.named_buffers()`` pairs (else ``None``)."""
    if isinstance(buffers, (torch.Tensor, torch.nn.Module)):
        raise ValueError(
            f"buffers: expected an iterable of tensors (module.buffers()), found a {type(buffers).__name__}"
        )
    seen = {id(t) for t in exclude}
    out: list[torch.Tensor] = []
    names: list[str | None] = []
    for item in buffers:
        name = None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, item = item
        if not isinstance(item, torch.Tensor):
            raise ValueError(f"buffers: expected tensors, found a {type(item).__name__}")
        if item.is_floating_point() and id(item) not in seen:
            seen.add(id(item))
            out.append(item)
            names.append(name)
    return out, names


def _describe(tensor: torch.Tensor, name: str | None, index: int) -> str:
    label = repr(name) if name is not None else f"#{index}"
    return f"{label} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _listing(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class ParameterBinding:
    """The tensors an averager works on, bound by identity, in the order they were bound.

    The binding keeps references to its tensors, so their ``id`` stays theirs. :meth:`arrange` accepts the
    same tensor objects in any order and returns them in the bound order; names, when known, only make
    error messages and checkpoints readable.

    Args:
        tensors: the tensors, in the order every later call is put into.
        names: a name (or ``None``) per tensor.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str | None] | None = None) -> None:
        self.tensors: list[torch.Tensor] = list(tensors)
        self.names: list[str | None] = list(names) if names is not None else [None] * len(self.tensors)
        if len(self.names) != len(self.tensors):
            raise ValueError(f"names: expected one per tensor ({len(self.tensors)}), found {len(self.names)}")
        self._index = {id(t): i for i, t in enumerate(self.tensors)}
        self._ids = [id(t) for t in self.tensors]

    def __len__(self) -> int:
        return len(self.tensors)

    def arrange(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str | None] | None = None, *, where: str = "params"
    ) -> list[torch.Tensor]:
        """Return the bound tensors, in the bound order, after checking ``tensors`` are the same objects.

        Args:
            tensors: this call's tensors, in any order.
            names: their names (for the error message), or ``None``.
            where: what to name in the error message (e.g. ``"WagmaAverager.average_parameters"``).

        Raises:
            ValueError: if ``tensors`` are not exactly the bound tensors: the message names (or numbers and
                shapes) the missing and the new ones, and says what to do.
        """
        if [id(t) for t in tensors] == self._ids:
            return self.tensors
        given = {id(t) for t in tensors}
        if len(given) == len(tensors) == len(self.tensors) and given == set(self._index):
            return self.tensors
        names = list(names) if names is not None else [None] * len(tensors)
        missing = [_describe(t, n, i) for i, (t, n) in enumerate(zip(self.tensors, self.names)) if id(t) not in given]
        new = [_describe(t, n, i) for i, (t, n) in enumerate(zip(tensors, names)) if id(t) not in self._index]
        details = []
        if missing:
            details.append(f"{len(missing)} bound tensor(s) missing: {_listing(missing)}")
        if new:
            details.append(f"{len(new)} tensor(s) never bound: {_listing(new)}")
        if not details:
            details.append("a tensor was passed more than once")
        raise ValueError(
            f"{where}: expected the same {len(self.tensors)} tensors the averager was bound to (the same "
            f"objects, in any order), found {len(tensors)} with {'; '.join(details)}. Pass the same parameters "
            "(and buffers) every call, or call bind() on every rank to average another set."
        )

    @classmethod
    def like(
        cls, tensors: Sequence[torch.Tensor], names: Sequence[str | None], signature: Sequence[Sequence[Any]]
    ) -> ParameterBinding:
        """Bind ``tensors`` in the order a checkpoint's :meth:`signature` recorded.

        With names on both sides (the same set), the tensors are ordered by the saved names, so a resumed
        run whose optimizer lists them in another order still pairs saved per-buffer state with the right
        parameters. Without names the call's order is kept, and must match the saved shapes and dtypes.

        Raises:
            ValueError: if the tensors cannot be matched to the signature (names, shapes or dtypes differ).
        """
        saved = [tuple(entry) for entry in signature]
        saved_names = [entry[0] for entry in saved]
        if None not in saved_names and None not in names and sorted(saved_names) == sorted(names):  # type: ignore[type-var]
            by_name = dict(zip(names, tensors))
            binding = cls([by_name[n] for n in saved_names], saved_names)
        else:
            binding = cls(tensors, names)
        found = [(tuple(t.shape), str(t.dtype)) for t in binding.tensors]
        expected = [(tuple(shape), dtype) for _, shape, dtype in saved]
        if found != expected:
            raise ValueError(
                f"params: expected tensors matching the checkpoint ({len(expected)} tensors, shapes and dtypes "
                f"{_listing([f'{s} {d}' for s, d in expected])}), found {len(found)}: "
                f"{_listing([f'{s} {d}' for s, d in found])}; pass the model the checkpoint was saved from, "
                "as named_parameters() so the order can be matched by name"
            )
        return binding

    def signature(self) -> list[tuple[str | None, tuple[int, ...], str]]:
        """(name, shape, dtype) per tensor in bound order: what a checkpoint of per-buffer state records."""
        return [(n, tuple(t.shape), str(t.dtype)) for t, n in zip(self.tensors, self.names)]


class FlatBuffers:
    """Contiguous copies of a list of tensors: one flat buffer per (dtype, device), in first-seen order.

    ``pack()`` copies the tensors into the buffers and returns them; the caller reduces the buffers in
    place; ``unpack()`` copies the buffers back into the tensors (in place, so optimizer state and module
    references stay valid). Tensors keep their dtypes: nothing is up-cast, and after ``unpack()`` each
    buffer holds exactly what was written into the tensors.

    *Aliased buffers.* When the tensors of one (dtype, device) are contiguous and lie back to back, in this
    order, in one storage (as :func:`flatten_parameters` leaves a model's parameters), that buffer is a view of
    their memory: ``pack()`` returns it without copying, so writing into it writes the tensors at once, and
    ``unpack()`` has nothing to do. Every ``pack()`` checks, per tensor, that it still lies where it did (a
    pointer comparison); a tensor moved since (``param.data`` replaced, ``module.to()``) turns that buffer into
    an ordinary copy for good, so the result is the same either way. ``aliased`` says which buffers are views.

    An instance is tied to one list of tensor objects; :meth:`reuse_or_build` returns the cached instance
    while the list is unchanged (same objects, shapes, dtypes and devices, in the same order).

    Args:
        tensors: the tensors to flatten (any layout; non-contiguous tensors are copied element-wise).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor] = list(tensors)
        index: dict[tuple[torch.dtype, torch.device], int] = {}
        sizes: list[int] = []
        self._slots: list[tuple[int, int, int]] = []
        for tensor in self.tensors:
            key = (tensor.dtype, tensor.device)
            if key not in index:
                index[key] = len(sizes)
                sizes.append(0)
            b = index[key]
            self._slots.append((b, sizes[b], tensor.numel()))
            sizes[b] += tensor.numel()
        #: (dtype, device) of each buffer.
        self.keys: list[tuple[torch.dtype, torch.device]] = list(index)
        members: list[list[int]] = [[] for _ in sizes]
        for i, (b, _, _) in enumerate(self._slots):
            members[b].append(i)
        self._members = members
        #: The flat buffers, one per key.
        self.buffers: list[torch.Tensor] = []
        #: Per buffer, the tensors' data pointers when it is a view of their memory (else ``None``).
        self._pointers: list[list[int] | None] = []
        for (dtype, device), n, idx in zip(self.keys, sizes, members):
            view = _consecutive_view([self.tensors[i] for i in idx], n)
            self._pointers.append(None if view is None else [self.tensors[i].data_ptr() for i in idx])
            self.buffers.append(torch.empty(n, dtype=dtype, device=device) if view is None else view)
        self._signature = self._signature_of(self.tensors)

    @staticmethod
    def _signature_of(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, torch.Size, torch.dtype, torch.device], ...]:
        # Ids are stable because the instance keeps references to its tensors.
        return tuple((id(t), t.shape, t.dtype, t.device) for t in tensors)

    @classmethod
    def reuse_or_build(cls, cached: FlatBuffers | None, tensors: Sequence[torch.Tensor]) -> FlatBuffers:
        """Return ``cached`` if it was built for exactly ``tensors``, else a new instance for them."""
        if cached is not None and cached.matches(tensors):
            return cached
        return cls(tensors)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether this instance was built for exactly these tensor objects, shapes, dtypes and devices."""
        return len(tensors) == len(self.tensors) and self._signature == self._signature_of(tensors)

    @property
    def nbytes(self) -> int:
        """Payload bytes of all buffers together (what one reduction of them sends per rank)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def layout(self) -> list[tuple[torch.dtype, torch.device, int]]:
        """(dtype, device, numel) of each buffer: what state kept per buffer must match."""
        return [(b.dtype, b.device, b.numel()) for b in self.buffers]

    @property
    def aliased(self) -> list[bool]:
        """Per buffer, whether it is a view of the tensors' own memory (packing copies nothing)."""
        return [p is not None for p in self._pointers]

    def pack(self) -> list[torch.Tensor]:
        """Copy the tensors into the flat buffers (aliased buffers: nothing to copy); return the buffers."""
        with torch.no_grad():
            for b, idx in enumerate(self._members):
                pointers = self._pointers[b]
                if pointers is not None:
                    if all(self.tensors[i].data_ptr() == ptr for i, ptr in zip(idx, pointers)):
                        continue
                    # A tensor moved (its .data was replaced): from now on this buffer is a copy of its own.
                    self._pointers[b] = None
                    self.buffers[b] = torch.empty_like(self.buffers[b])
                for i in idx:
                    tensor, (_, offset, numel) = self.tensors[i], self._slots[i]
                    self.buffers[b][offset : offset + numel].view(tensor.shape).copy_(tensor)
        return self.buffers

    def unpack(self) -> None:
        """Copy the flat buffers back into the tensors, in place (aliased buffers: they are the tensors)."""
        with torch.no_grad():
            for tensor, (b, offset, numel) in zip(self.tensors, self._slots):
                if self._pointers[b] is None:
                    tensor.copy_(self.buffers[b][offset : offset + numel].view(tensor.shape))

    def __len__(self) -> int:
        return len(self.buffers)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{dtype}@{device}:{b.numel()}{' (aliased)' if alias else ''}"
            for (dtype, device), b, alias in zip(self.keys, self.buffers, self.aliased)
        )
        return f"FlatBuffers({len(self.tensors)} tensors -> [{parts}])"


def _consecutive_view(tensors: Sequence[torch.Tensor], numel: int) -> torch.Tensor | None:
    """A flat view of ``numel`` elements over the memory of ``tensors`` if they are contiguous and lie back to back,
    in this order, in one storage; else ``None``."""
    first = tensors[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    expected = start
    for tensor in tensors:
        if (
            not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() != expected
        ):
            return None
        expected += tensor.numel()
    with torch.no_grad():
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, start, (numel,), (1,))


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to just past its last one."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def flatten_parameters(module: torch.nn.Module, *, buffers: bool = True) -> list[torch.Tensor]:
    """Move ``module``'s parameters (and floating-point buffers) into one contiguous storage per (dtype, device).

    Each parameter stays the same ``Parameter`` object (optimizers, DDP and hooks that hold it see no change);
    only its memory moves, its values are kept (``param.data`` becomes a view of the flat storage). An averager
    given the tensors in the module's order (``module.named_parameters()``, then ``module.named_buffers()``)
    then averages that memory in place: :class:`FlatBuffers` packs and unpacks without copying, which spares
    two passes over the model per averaging round. Call it before building the optimizer and wrapping the
    model in DDP (both keep working if called later, but need not).

    Args:
        module: the model (not a DDP wrapper's ``.module`` copy: the same module the averager is given).
        buffers: also move the floating-point buffers (after the parameters), as averagers average them by
            default.

    Returns:
        The flat storages as 1-D tensors, one per (dtype, device), parameters first in ``module.parameters()``
        order.

    Raises:
        ValueError: if two of the tensors share memory (tied weights as two ``Parameter`` objects over one
            storage, or a buffer that is a view of a parameter): moving them apart would silently untie them.
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module: expected a torch.nn.Module, found a {type(module).__name__}")
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    if buffers:
        named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    spans = sorted(
        (t.device.type, t.device.index or 0, t.data_ptr(), t.data_ptr() + _extent(t), name)
        for name, t in named
        if t.numel()
    )
    for a, b in zip(spans, spans[1:]):
        if a[:2] == b[:2] and b[2] < a[3]:
            raise ValueError(
                f"flatten_parameters: {a[4]!r} and {b[4]!r} share memory; flattening would untie them "
                f"(tie them as one Parameter object, or leave this model unflattened)"
            )
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, tensor in named:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    flats = []
    with torch.no_grad():
        for (dtype, device), tensors in groups.items():
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
            offset = 0
            for tensor in tensors:
                n = tensor.numel()
                view = flat[offset : offset + n].view(tensor.shape)
                view.copy_(tensor)
                tensor.data = view
                offset += n
            flats.append(flat)
    return flats


def widened(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` itself, or a float32 copy of a half-precision one: what averagers sum and keep state in, so that
    float16 / bfloat16 models are not accumulated in their own precision."""
    return buffer.float() if buffer.dtype in (torch.float16, torch.bfloat16) else buffer
