"""The ``ft`` config group and the ``replicas`` key: live recovery on torchft, checked before any process starts.

``ft=none`` (the default) is the application as before. ``ft=torchft`` makes ``python train.py`` start torchft's
lighthouse and ``replicas`` replica groups (:mod:`wagma.app.ft_launch`), each training the configured data, model and
optimizer (:mod:`wagma.app.ft_replica`) with :class:`wagma.integrations.torchft.ReplicaAverager`. The averaging is
set by the ``ft`` group (``group_size``, ``sync_period``, ``period``), not by ``averaging``, whose policies need a
fixed world. :func:`check_ft` needs only the config (torchft is not imported), so a bad one is refused at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from wagma.app.network import check_rank_net
from wagma.app.quota import check_rank_cpus
from wagma.checks import check_choice, check_int, check_number, fail

__all__ = ["FT_NAMES", "check_ft", "ft_enabled", "ft_rounds"]

#: The options of the ``ft`` config group.
FT_NAMES: tuple[str, ...] = ("none", "torchft")

_INTS: dict[str, int] = {
    "min_replicas": 1,
    "group_size": 2,
    "sync_period": 1,  # the job ends with a sync round: 0 (never) cannot be
    "period": 1,
    "max_restarts": 0,
    "first_replica": 0,
    "nproc": 1,
    "join_timeout_ms": 1,
    "heartbeat_timeout_ms": 1,
}


def ft_enabled(cfg: Mapping[str, Any]) -> bool:
    """Whether ``cfg`` asks for live recovery on torchft (``ft=torchft``); a config without ``ft`` does not."""
    ft = cfg.get("ft")
    return ft is not None and ft.get("name", "none") == "torchft"


def ft_rounds(cfg: Mapping[str, Any]) -> int:
    """The rounds the job commits: ``steps / ft.period`` (the last one a sync round)."""
    return int(cfg["steps"]) // int(cfg["ft"]["period"])


def check_ft(plain: Mapping[str, Any]) -> list[str]:
    """The problems of the ``ft`` group and ``replicas`` in ``plain`` (a resolved config), one line each.

    With ``ft=torchft``: every ``ft`` key of its type and range; ``replicas`` >= 1 and, with the launcher's own
    lighthouse, >= ``ft.min_replicas``; ``steps`` a multiple of ``ft.period x ft.sync_period`` (the last round is a
    sync round, so that every replica ends with the same model); ``rank_cpus`` for ``replicas x ft.nproc``
    processes, and ``rank_net`` for as many; and what the replica groups do not support (``parallel=hsdp``,
    ``resume``, batching by tokens; ``rank_net`` with a running lighthouse).
    """
    ft = plain.get("ft") or {"name": "none"}
    problems: list[str] = []
    name = _attempt(problems, lambda: check_choice("ft.name", ft.get("name"), FT_NAMES))
    if name != "torchft":
        return problems
    values = {
        key: _attempt(problems, functools.partial(check_int, f"ft.{key}", ft.get(key), low))
        for key, low in _INTS.items()
    }
    problems += _timeouts(ft)
    lighthouse = ft.get("lighthouse")
    if lighthouse is not None and not (isinstance(lighthouse, str) and lighthouse.startswith(("http://", "https://"))):
        problems.append(str(fail("ft.lighthouse", "null (start one) or an address http://host:port", lighthouse)))
    if not isinstance(ft.get("host"), str) or not ft.get("host"):
        problems.append(str(fail("ft.host", "the address of this host that the other replicas reach", ft.get("host"))))
    replicas = _attempt(problems, lambda: check_int("replicas", plain.get("replicas"), 1))
    minimum = values["min_replicas"]
    if lighthouse is None and replicas is not None and minimum is not None and replicas < minimum:
        problems.append(
            str(fail("replicas", f"at least ft.min_replicas ({minimum})", replicas, "the quorum could never form"))
        )
    period, sync_period = values["period"], values["sync_period"]
    steps = plain.get("steps")
    if period and sync_period and isinstance(steps, int) and steps % (period * sync_period):
        problems.append(
            str(
                fail(
                    "steps",
                    f"a multiple of ft.period x ft.sync_period ({period * sync_period})",
                    steps,
                    "the job's last round must be a sync round, so that every replica ends with the same model",
                )
            )
        )
    nproc = values["nproc"]
    if nproc is not None and nproc > 1 and replicas is not None:  # validate_config counted one process a replica
        quota = check_rank_cpus(plain.get("rank_cpus"), replicas * nproc)
        if quota is not None:
            problems.append(f"{quota} (replicas x ft.nproc = {replicas * nproc} processes)")
        if plain.get("rank_net") is not None:  # a link for every rank of every group
            net = check_rank_net(plain.get("rank_net"), replicas * nproc)
            if net is not None:
                problems.append(f"{net} (replicas x ft.nproc = {replicas * nproc} processes)")
    problems += _unsupported(plain)
    return problems


def _timeouts(ft: Mapping[str, Any]) -> list[str]:
    """The problems of the deadlines: each > 0, and the quorum's at least a collective's (torchft fails a replica
    whose quorum times out, so a quorum must outwait a peer that is still starting or healing)."""
    problems: list[str] = []
    timeouts = {
        key: _attempt(problems, functools.partial(check_number, f"ft.{key}", ft.get(key), 0, above=True))
        for key in ("timeout_s", "quorum_timeout_s", "rejoin_s")
    }
    if None not in timeouts.values() and timeouts["quorum_timeout_s"] < timeouts["timeout_s"]:
        problems.append(
            str(
                fail(
                    "ft.quorum_timeout_s",
                    f"at least ft.timeout_s ({timeouts['timeout_s']:g})",
                    ft.get("quorum_timeout_s"),
                    "a replica that times out waiting for a quorum fails, so the quorum must outwait a collective",
                )
            )
        )
    return problems


def _unsupported(plain: Mapping[str, Any]) -> list[str]:
    """What replica groups do not take (yet): each a line naming the key and what it must be."""
    wanted = {
        "parallel": ("ddp", plain.get("parallel", "ddp")),
        "resume": (False, plain.get("resume", False)),
        "data.batching": ("samples", (plain.get("data") or {}).get("batching", "samples")),
    }
    advice = "ft=torchft replica groups take no other value (a dead replica heals from a live peer)"
    problems = [str(fail(key, repr(want), found, advice)) for key, (want, found) in wanted.items() if found != want]
    ft = plain.get("ft") or {}
    if plain.get("rank_net") is not None and ft.get("lighthouse") is not None:
        expected = "null with a running lighthouse (ft.lighthouse)"
        advice = (
            f"here ft.lighthouse={ft.get('lighthouse')!r}: the emulated network puts the replicas of one host on "
            "links of their own, with the launcher's own lighthouse (ft.lighthouse=null)"
        )
        problems.append(str(fail("rank_net", expected, plain.get("rank_net"), advice)))
    return problems


def _attempt(problems: list[str], check: Callable[[], Any]) -> Any:
    """``check()``; its ``ValueError`` goes to ``problems`` and the result is None."""
    try:
        return check()
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
        return None
