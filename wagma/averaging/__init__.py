"""Synchronous model-averaging policies and their shared base (docs/design.md §2.5).

- :class:`AveragerBase` -- base of every averager: binding, flattening, counters, state, ``synchronize``.
- :class:`ParameterBinding` -- the tensors an averager works on, bound by identity (any call order).
- :class:`PeriodicAverager` -- K-AVG: a global mean every ``period`` steps.
- :class:`HierarchicalAverager` -- local means in fixed groups, global means less often.
- :class:`ReductionMomentum` -- momentum on the progress between reductions, around either of them.
- :class:`AveragingOptimizer` -- ``optimizer.step()`` and the averager's step, in the averager's order.
- :class:`WagmaAverager` -- WAGMA-SGD: wait-avoiding group averages on rotating groups (docs/design.md §2.2).
- :class:`DPSGDAverager`, :class:`SGPAverager`, :class:`ADPSGDAverager` -- the decentralized baselines (D-PSGD;
  SGP and OSGP; AD-PSGD on a progress thread; docs/design.md §2.6).
"""

from wagma.averaging.adpsgd import ADPSGDAverager
from wagma.averaging.base import (
    AveragerBase,
    AveragerStats,
    FlatBuffers,
    ParamsLike,
    Reduction,
    collect_buffers,
    collect_parameters,
)
from wagma.averaging.gossip import TOPOLOGIES, DPSGDAverager, SGPAverager
from wagma.averaging.hierarchical import HierarchicalAverager
from wagma.averaging.momentum import MomentumLevels, ReductionMomentum, reduction_momentum_update_
from wagma.averaging.optimizer import AveragingOptimizer
from wagma.averaging.periodic import PeriodicAverager
from wagma.averaging.tensors import ParameterBinding, collect_named, flatten_parameters
from wagma.averaging.wagma import ORDERS, WagmaAverager
from wagma.groups import DEFAULT_TIMEOUT

__all__ = [
    "ADPSGDAverager",
    "DEFAULT_TIMEOUT",
    "ORDERS",
    "AveragerBase",
    "AveragerStats",
    "AveragingOptimizer",
    "DPSGDAverager",
    "FlatBuffers",
    "HierarchicalAverager",
    "MomentumLevels",
    "ParameterBinding",
    "ParamsLike",
    "PeriodicAverager",
    "Reduction",
    "ReductionMomentum",
    "SGPAverager",
    "TOPOLOGIES",
    "WagmaAverager",
    "collect_buffers",
    "collect_named",
    "collect_parameters",
    "flatten_parameters",
    "reduction_momentum_update_",
]
