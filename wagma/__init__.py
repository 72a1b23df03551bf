"""wagma: data-parallel training that does not wait for stragglers or for global reductions it does not need.

Parts that plug into ``torch.distributed``:

- :class:`GroupSchedule` -- which ranks average together in which round.
- :class:`WaitAvoidingGroupAllreduce` -- the wait-avoiding group allreduce engine (WAGMA-SGD, eager-SGD).
"""

__version__ = "0.1.0"

from wagma.engine import RoundResult, WaitAvoidingGroupAllreduce
from wagma.schedule import GroupSchedule

__all__ = ["GroupSchedule", "RoundResult", "WaitAvoidingGroupAllreduce", "__version__"]
