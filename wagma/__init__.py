"""wagma: data-parallel training that does not wait for stragglers or for global reductions it does not need.

The library imports with torch alone; use it from your own DDP script (docs/library.md has complete recipes):

- WAGMA-SGD model averaging: :class:`WagmaAverager` (wait-avoiding group averages on rotating groups).
- eager-SGD partial collectives: :class:`PartialAllreduceState` + :func:`partial_allreduce_hook`, a DDP
  comm hook (solo or majority allreduce of gradients).
- Fewer global reductions: :class:`PeriodicAverager` (K-step averaging), :class:`HierarchicalAverager`
  (local reductions on subsets of learners), :class:`ReductionMomentum`.
- The decentralized baselines WAGMA-SGD is measured against: :class:`DPSGDAverager` (D-PSGD) and
  :class:`SGPAverager` (SGP, and OSGP with ``overlap=True``), :class:`ADPSGDAverager` (AD-PSGD).
- :class:`AveragingOptimizer` runs the local step and an averager's step in the averager's order;
  :func:`post_local_hook` (with :class:`PostLocalState`) is the DDP hook for model averaging: allreduce for a
  warm-up, then no gradient communication.
- :func:`flatten_parameters` lays a model's parameters out in one flat storage, so averagers average that
  memory in place instead of copying the model in and out every round.
- Building blocks: :class:`GroupSchedule` (which ranks average together in which round),
  :class:`WaitAvoidingGroupAllreduce` and :class:`AccumulatingGroupAllreduce` (the engine under WAGMA-SGD and
  eager-SGD, in its model and its gradient mode; :class:`RoundOptions` checks the options of their rounds) and
  :class:`SharedMemoryAllreduce` (CPU collectives of ranks on one host through shared memory, ``transport="shm"``).

The training application (Hydra configs, ``train.py``, datasets, checkpoints) is built on top of it.
"""

__version__ = "0.1.0"

from wagma.averaging import (
    ADPSGDAverager,
    AveragerBase,
    AveragingOptimizer,
    DPSGDAverager,
    HierarchicalAverager,
    PeriodicAverager,
    ReductionMomentum,
    SGPAverager,
    WagmaAverager,
    flatten_parameters,
)
from wagma.engine import (
    AccumulatingGroupAllreduce,
    GroupAllreduceEngine,
    RoundOptions,
    RoundResult,
    WaitAvoidingGroupAllreduce,
)
from wagma.hooks import (
    AllreduceState,
    GroupAllreduceState,
    PartialAllreduceState,
    allreduce_hook,
    group_allreduce_hook,
    local_hook,
    partial_allreduce_hook,
)
from wagma.hooks.fsdp import FSDPPartialAllreduce
from wagma.hooks.post_local import PostLocalState, post_local_hook
from wagma.schedule import GroupSchedule
from wagma.shm import SharedMemoryAllreduce
from wagma.wire import as_wire_dtype
from wagma.world import World, as_world

__all__ = [
    "ADPSGDAverager",
    "AccumulatingGroupAllreduce",
    "AllreduceState",
    "AveragerBase",
    "AveragingOptimizer",
    "DPSGDAverager",
    "FSDPPartialAllreduce",
    "GroupAllreduceEngine",
    "GroupAllreduceState",
    "GroupSchedule",
    "HierarchicalAverager",
    "PartialAllreduceState",
    "PeriodicAverager",
    "PostLocalState",
    "ReductionMomentum",
    "RoundOptions",
    "RoundResult",
    "SGPAverager",
    "SharedMemoryAllreduce",
    "WagmaAverager",
    "WaitAvoidingGroupAllreduce",
    "World",
    "__version__",
    "allreduce_hook",
    "as_wire_dtype",
    "as_world",
    "flatten_parameters",
    "group_allreduce_hook",
    "local_hook",
    "partial_allreduce_hook",
    "post_local_hook",
]
