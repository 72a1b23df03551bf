"""How the ranks hold the model: one full replica per rank (``parallel=ddp``) or HSDP (``parallel=hsdp``).

With ``parallel=hsdp shard_size=K`` the P ranks form a 2-D ``DeviceMesh`` ``("replicate", "shard")`` of
``P / K`` replicas x ``K`` shards (:func:`build_layout`; ranks ``rK .. rK + K - 1`` are replica ``r``). FSDP2
(``fully_shard``) splits every parameter among the ``K`` ranks of a replica (:func:`shard_model`), and the
averaging policy runs on the world ``(mesh, "replicate")``: it averages each rank's shards with the same shards
of other replicas, so every policy's sizes (a WAGMA group, a hierarchical block, a gossip graph) count
replicas, not ranks. Data stays per rank, as FSDP users expect: each rank draws its own batches and FSDP2's
reduce-scatter averages the gradients of a replica's ``K`` ranks, so a replica steps on ``K x batch_size``
examples.

This module also moves sharded state in and out of the app's per-rank checkpoints: :func:`local_state` turns
every ``DTensor`` of a state dict into the shard this rank holds (a plain tensor, loadable with
``weights_only=True``), :func:`load_local_model_state` and :func:`load_local_optimizer_state` put such shards
back into the ``DTensor`` parameters and optimizer state, bit for bit; :func:`full_model_state` gathers the
whole model for ``model.pt``.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from wagma.averaging.tensors import local_tensor
from wagma.checks import fail, is_int

__all__ = [
    "PARALLELS",
    "Layout",
    "build_layout",
    "check_parallel",
    "full_model_state",
    "is_dtensor",
    "load_local_model_state",
    "load_local_optimizer_state",
    "local_state",
    "replica_count",
    "shard_model",
    "shard_units",
]

#: The values of the root config key ``parallel``.
PARALLELS: tuple[str, ...] = ("ddp", "hsdp")
#: Modules that are one FSDP2 unit each under HSDP (their own all-gather and reduce-scatter), outermost first.
_UNITS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def check_parallel(parallel: Any, shard_size: Any, world_size: int) -> list[str]:
    """The problems of ``parallel`` / ``shard_size`` for ``world_size`` ranks, one line each (empty: fine).

    ``parallel`` is ``ddp`` or ``hsdp``; under ``ddp`` ``shard_size`` is 1; under ``hsdp`` it is an integer >= 2
    that divides the world size.
    """
    if parallel not in PARALLELS:
        return [str(fail("parallel", f"one of {', '.join(map(repr, PARALLELS))}", parallel))]
    if not is_int(shard_size):
        return [str(fail("shard_size", "an integer", shard_size))]
    if parallel == "ddp":
        if shard_size != 1:
            expected, advice = (
                "1 with parallel=ddp (each rank holds the whole model)",
                "set parallel=hsdp to shard the model",
            )
            return [str(fail("shard_size", expected, shard_size, advice))]
        return []
    if shard_size < 2:
        return [str(fail("shard_size", "an integer >= 2 with parallel=hsdp (ranks sharing one replica)", shard_size))]
    if world_size >= 1 and world_size % shard_size:
        return [str(fail("shard_size", f"a divisor of the world size {world_size} with parallel=hsdp", shard_size))]
    return []


def replica_count(cfg: Mapping[str, Any], world_size: int) -> int:
    """The number of model replicas: ``world_size / shard_size`` under ``parallel=hsdp``, else ``world_size``."""
    if cfg.get("parallel", "ddp") != "hsdp":
        return world_size
    return world_size // int(cfg.get("shard_size", 1))


@dataclasses.dataclass
class Layout:
    """The ranks' layout: ``parallel`` and ``shard_size`` as configured, and the 2-D mesh under ``hsdp``.

    ``mesh`` is ``None`` under ``ddp``; under ``hsdp`` a ``DeviceMesh`` with dimensions ``("replicate", "shard")``.
    """

    parallel: str
    shard_size: int
    world_size: int
    mesh: Any = None

    @property
    def replicas(self) -> int:
        """Model replicas (the averaging world's size)."""
        return self.world_size // self.shard_size

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (``parallel=hsdp``)."""
        return self.mesh is not None


def build_layout(parallel: str, shard_size: int, world_size: int, device: torch.device, timeout_s: float) -> Layout:
    """The layout of this job; under ``hsdp`` builds the mesh (collective over the default group, every rank).

    On the CPU the mesh's gloo groups get ``timeout_s`` (``dist_timeout_s``), like the default group; on CUDA
    they get the backend's default.
    """
    if parallel != "hsdp":
        return Layout(parallel, 1, world_size)
    from torch.distributed.device_mesh import init_device_mesh

    override: dict[int | str, Any] | None = None
    if device.type == "cpu":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=float(timeout_s))
        override = {"replicate": ("gloo", options), "shard": ("gloo", options)}
    mesh = init_device_mesh(
        device.type,
        (world_size // shard_size, shard_size),
        mesh_dim_names=("replicate", "shard"),
        backend_override=override,
    )
    return Layout(parallel, shard_size, world_size, mesh)


def shard_units(net: nn.Module) -> list[nn.Module]:
    """The submodules that become FSDP2 units of their own: every Linear, Conv and Transformer layer not inside one.

    The root gathers the rest (embeddings, norms). A Transformer layer is one unit as a whole: its attention uses
    its projections' weights without calling their ``forward``, which FSDP2 needs to gather them.
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, _UNITS):
                units.append(child)
            else:
                visit(child)

    visit(net)
    return units


def shard_model(net: nn.Module, mesh: Any, *, per_layer: bool = True) -> nn.Module:
    """``fully_shard`` ``net`` over ``mesh`` in place: each of :func:`shard_units` (``per_layer``), then the root.

    ``mesh`` is ``layout.mesh["shard"]`` for FSDP2 inside a replica, or the 2-D mesh itself for FSDP2's own
    HSDP (gradients reduced across replicas too). ``per_layer=False`` shards the root alone (one reduce-scatter
    output per backward pass, as :class:`wagma.FSDPPartialAllreduce` needs).
    """
    from torch.distributed.fsdp import fully_shard

    if per_layer:
        for unit in shard_units(net):
            fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP2 parameter or its optimizer state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_state(state: Any) -> Any:
    """``state`` (nested dicts, lists, tuples) with every ``DTensor`` replaced by a copy of this rank's shard."""
    if is_dtensor(state):
        return local_tensor(state).detach().clone()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_state(v) for v in state)
    return state


@torch.no_grad()
def load_local_model_state(net: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy the shards :func:`local_state` saved of ``net.state_dict()`` back into ``net``'s (sharded) tensors.

    Raises:
        ValueError: naming the first missing or unexpected key, or a shard whose shape differs from this rank's.
    """
    own = net.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"expected the keys of this model's state dict, found missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, tensor in own.items():
        target = local_tensor(tensor)
        if target.shape != state[name].shape:
            raise ValueError(
                f"{name}: expected a shard of shape {tuple(target.shape)}, found {tuple(state[name].shape)}"
            )
        target.copy_(state[name])


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state dict saved through :func:`local_state` into ``optimizer`` over sharded parameters.

    Each saved per-parameter tensor shaped like its parameter's shard becomes a ``DTensor`` laid out like the
    parameter again (so the optimizer's next step mixes no plain tensor with a ``DTensor``), then
    ``optimizer.load_state_dict`` loads it.
    """
    from torch.distributed.tensor import DTensor

    index_to_param: dict[int, torch.Tensor] = {}
    for saved_group, group in zip(optimizer.state_dict()["param_groups"], optimizer.param_groups):
        index_to_param.update(zip(saved_group["params"], group["params"]))
    rebuilt: dict[Any, Any] = {}
    for index, per_param in state["state"].items():
        param = index_to_param.get(int(index))
        if param is None or not is_dtensor(param):
            rebuilt[index] = per_param
            continue
        shard_shape = local_tensor(param).shape
        mesh, placements = cast(DTensor, param).device_mesh, cast(DTensor, param).placements
        rebuilt[index] = {
            key: DTensor.from_local(value, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
            if isinstance(value, torch.Tensor) and key != "step" and value.shape == shard_shape
            else value
            for key, value in per_param.items()
        }
    optimizer.load_state_dict({**state, "state": rebuilt})


def full_model_state(net: nn.Module) -> dict[str, torch.Tensor]:
    """``net.state_dict()`` with every sharded tensor gathered whole; collective over each tensor's mesh.

    Every rank must call it (the all-gathers run inside each replica); plain tensors are returned as they are.
    """
    return {name: t.full_tensor() if is_dtensor(t) else t for name, t in net.state_dict().items()}
