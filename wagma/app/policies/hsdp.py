"""Which averaging policies run on a sharded model (``parallel=hsdp``), and how.

Under HSDP a policy's :attr:`~wagma.app.policies.base.Policy.mesh` is the job's ``("replicate", "shard")`` mesh
(set by :func:`wagma.app.policies.build_policy` before ``wrap``) and its world is ``(mesh, "replicate")``:

=============================  ===================================================================================
``allreduce``                  FSDP2's own HSDP: ``fully_shard`` over the 2-D mesh (reduce-scatter inside a
                               replica, allreduce across the replicas), one global reduction per step.
``local_sgd``, ``hierarchical``,  ``fully_shard`` over the ``shard`` dimension; the averager averages this rank's
``hierarchical_momentum``,     shards with the same shards of other replicas (warm-up steps allreduce the shard
``wagma`` (+ presets),         gradients over the replicas).
``dpsgd``, ``sgp``, ``osgp``,
``adpsgd``
``eager_solo``,                the root alone ``fully_shard``-ed over the ``shard`` dimension;
``eager_majority``             :class:`wagma.FSDPPartialAllreduce` sums the shard gradients over the replicas
                               (no ``overlap``, no ``transport=shm``; resumes with its rounds and residuals).
=============================  ===================================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["HSDP_POLICIES", "validate_hsdp", "replicate_world"]

#: The registered policies that run under ``parallel=hsdp``.
HSDP_POLICIES: tuple[str, ...] = (
    "allreduce",
    "local_sgd",
    "hierarchical",
    "hierarchical_momentum",
    "wagma",
    "dpsgd",
    "sgp",
    "osgp",
    "adpsgd",
    "eager_solo",
    "eager_majority",
)
#: Policies whose ``transport=shm`` has no sharded form (their gradient exchange is FSDP2's or the FSDP hook's).
_NO_SHM: tuple[str, ...] = ("allreduce", "eager_solo", "eager_majority")


def validate_hsdp(cfg: Mapping[str, Any]) -> None:
    """Refuse an ``averaging`` config that cannot run under ``parallel=hsdp``, with what to use instead.

    Raises:
        ValueError: one line naming the policy (or option), what was expected and what to use.
    """
    name = cfg.get("name")
    if name not in HSDP_POLICIES:
        raise ValueError(
            f"averaging={name} cannot run with parallel=hsdp: expected one of {', '.join(HSDP_POLICIES)}; "
            "use one of those, or parallel=ddp"
        )
    if name in _NO_SHM and cfg.get("transport", "default") != "default":
        raise ValueError(
            f"averaging={name} with averaging.transport={cfg.get('transport')} cannot run with parallel=hsdp "
            "(FSDP2 reduces its gradients itself): expected averaging.transport=default"
        )
    if str(name).startswith("eager_") and cfg.get("overlap", False):
        raise ValueError(
            f"averaging={name} with averaging.overlap=true cannot run with parallel=hsdp (FSDPPartialAllreduce has "
            f"no overlap yet): use averaging=reference/{name} (overlap=false), or averaging=wagma_relaxed"
        )


def replicate_world(mesh: Any) -> Any:
    """The averaging world of an HSDP policy, ``(mesh, "replicate")``, or ``None`` (the whole job) without a mesh."""
    return None if mesh is None else (mesh, "replicate")
