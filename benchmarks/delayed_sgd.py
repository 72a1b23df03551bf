"""Why stale gradients lose the model: a one-process reference of P ranks whose gradients arrive late.

Two tools, both free of any wagma protocol, so that what they show is the optimizer meeting staleness and not an
implementation defect:

- ``emulate``: P virtual ranks train one model on the application's data and model (same shards, batches and
  optimizer as ``train.py``); at step t rank i's gradient is computed at the model of step ``t - s``, ``s`` drawn
  per gradient from a staleness distribution, and the mean of the P gradients is applied at step t. ``s = 0`` is
  synchronous SGD; ``{1: 1.0}`` is what eager-SGD with ``overlap=true`` does to every gradient; ``{0: 0.2, 1: 0.8}``
  about what solo does at P = 8 on two shared cores.
- ``stability``: the largest stable step ``eta * h`` of heavy-ball momentum on a quadratic of curvature h when the
  gradient is ``s`` steps old (the spectral radius of the recurrence ``v' = mu v + h x_{t-s}, x' = x - eta v'``).
  Training at a learning rate near the edge of stability -- where SGD with momentum usually runs -- leaves no room
  for the drop that one step of delay causes.

Usage::

    python benchmarks/delayed_sgd.py stability
    python benchmarks/delayed_sgd.py emulate --staleness 0:1       # synchronous reference
    python benchmarks/delayed_sgd.py emulate --staleness 1:1       # every gradient one step late
    python benchmarks/delayed_sgd.py emulate --staleness 0:0.2,1:0.8 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from wagma.app.data import BatchIterator, load_dataset  # noqa: E402
from wagma.app.models import build_model  # noqa: E402
from wagma.hooks.lookahead import in_flight_steps, lookahead_coefficient  # noqa: E402

__all__ = ["REMEDIES", "emulate", "lowered_momentum", "max_stable_step", "parse_staleness"]


def parse_staleness(text: str) -> dict[int, float]:
    """``"0:0.2,1:0.8"`` -> ``{0: 0.2, 1: 0.8}`` (rounds of staleness: probability)."""
    out: dict[int, float] = {}
    for part in text.split(","):
        s, sep, p = part.partition(":")
        if not sep or int(s) < 0 or float(p) < 0:
            raise ValueError(f"staleness: expected ROUNDS:PROBABILITY pairs such as 0:0.2,1:0.8, found {text!r}")
        out[int(s)] = float(p)
    if not sum(out.values()) > 0:
        raise ValueError(f"staleness: the probabilities must not all be 0, found {text!r}")
    return out


def max_stable_step(mu: float, s: int, *, fresh: float = 0.0) -> float:
    """The largest ``eta * h`` for which heavy ball with momentum ``mu`` converges on ``h x^2 / 2`` when a fraction
    ``1 - fresh`` of each gradient is ``s`` steps old (and ``fresh`` of it current)."""

    def radius(eh: float) -> float:
        n = s + 2  # state: x_t .. x_{t-s}, and u = eta * v
        a = np.zeros((n, n))
        a[s + 1, s + 1] = mu
        a[s + 1, 0] += eh * fresh
        a[s + 1, s] += eh * (1 - fresh)
        a[0, 0] = 1.0
        a[0, :] -= a[s + 1, :]
        for i in range(1, s + 1):
            a[i, i - 1] = 1.0
        return float(max(abs(np.linalg.eigvals(a))))

    lo, hi = 0.0, 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid) < 1 else (lo, mid)
    return lo


#: The remedies ``emulate`` can apply to late gradients (``"none"``: the optimizer meets them as they are).
REMEDIES = (
    "none",
    "outside",
    "momentum",
    "staleness_lr",
    "dc",
    "dc_adaptive",
    "lookahead",
    "nesterov",
    "extrapolate",
    "lookahead_last",
    "lookahead_own",
)
#: remedies that compute a late gradient at a point predicted from the momentum buffer at ``w_stale``
_PREDICTS = ("lookahead", "extrapolate", "lookahead_last", "lookahead_own")


def lowered_momentum(momentum: float, staleness: dict[int, float]) -> float:
    """Explicit momentum lowered by the implicit momentum of asynchrony (Mitliagkas et al., Allerton 2016): with
    mean staleness ``s`` (their queue of ``M = s + 1`` workers) asynchrony adds about ``1 - 1/M = s / (s + 1)``;
    keep the total at ``momentum``, never below 0."""
    total = sum(staleness.values())
    mean = sum(s * p for s, p in staleness.items()) / total
    return max(0.0, momentum - mean / (mean + 1))


def emulate(
    staleness: dict[int, float],
    *,
    dataset: str = "mnist",
    model: str = "cnn",
    ranks: int = 8,
    steps: int = 400,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    remedy: str = "none",
    dc_lambda: float | None = None,
    cover: int | None = None,
) -> float:
    """Train with every gradient ``s`` steps late (``s`` drawn from ``staleness`` per gradient); return the final
    test accuracy.

    ``remedy`` (``REMEDIES``) changes what a late gradient (``s > 0``) does; a fresh one is always the gradient at
    the current model, through the optimizer's momentum:

    - ``"none"``: the mean of the P gradients goes through SGD with heavy-ball momentum, as they are.
    - ``"outside"``: the late gradients skip the momentum buffer: ``v <- mu v + g_fresh``,
      ``w <- w - lr (v + g_late)`` (means over the P ranks, zeros where none). A separate momentum buffer for the
      late part is not a remedy: momentum is linear, so two buffers add up to the one of ``"none"``.
    - ``"momentum"``: SGD with the explicit momentum lowered by asynchrony's implicit one (:func:`lowered_momentum`).
    - ``"staleness_lr"``: a gradient ``s`` steps late is divided by ``s`` (Zhang et al., IJCAI 2016: learning rate
      ``lr / s`` for ``s >= 1``, ``lr`` when fresh).
    - ``"dc"``: delay compensation (Zheng et al., ICML 2017, DC-ASGD-c):
      ``g + lambda * g * g * (w_now - w_stale)``, ``lambda`` = ``dc_lambda`` (default 0.04).
    - ``"dc_adaptive"``: DC-ASGD-a: ``lambda = lambda0 / sqrt(ms + 1e-7)`` per element, ``ms <- 0.95 ms + 0.05 g*g``
      over the received gradients, ``lambda0`` = ``dc_lambda`` (default 2).
    - ``"lookahead"``: the gradient is computed at where momentum will have carried the model when it is applied:
      ``w_stale - lr * (mu + ... + mu^s) * v_stale`` (``v_stale`` the momentum buffer at ``w_stale``): the momentum
      part of the next ``s`` steps, a weight prediction as delayed-momentum methods make (Chen et al., 2018,
      SpecTrain, extrapolates by ``s`` whole steps; Hakimi et al., 2019, DANA). For ``s = 1`` it is Nesterov's
      look-ahead point.
    - ``"nesterov"``: SGD with ``nesterov=True``, every gradient (fresh ones too) computed at its parameters: what
      ``PartialAllreduceState(late="lookahead")`` does (the same recurrence; the model kept is ``w``, not the
      look-ahead point). With every gradient one step late it is ``"lookahead"``.
    - ``"extrapolate"``: the whole last step repeated ``s`` times, ``w_stale - lr * s * v_stale`` (SpecTrain's
      weight prediction; for ``s = 1`` the in-flight step's gradient estimated by ``(1 - mu) v``).
    - ``"lookahead_last"``: the look-ahead point plus the in-flight step's gradient estimated by the last mean
      gradient applied, ``w_stale - lr * (mu * v_stale + g_last)`` (``s = 1``; further steps as ``"lookahead"``).
    - ``"lookahead_own"``: as ``"lookahead_last"`` with this rank's own gradient of the step before (its share of
      the in-flight round) as the estimate of every step in flight: ``w_stale - lr * (mu * v_stale + g_own)`` for
      ``s = 1``; for ``s`` steps, where SGD's recurrence carries ``w_stale`` if each of them applies ``g_own``:
      ``w_stale - lr * ((mu + ... + mu^s) * v_stale + c_s * g_own)``, ``c_s = sum_{j=1..s} (1 - mu^j) / (1 - mu)``
      (``c_1 = 1``, ``c_2 = 2 + mu``).

    ``cover``: the steps of delay the predicted point covers (the ``s`` in the formulas above) for every late
    gradient, whatever its age; ``None`` (default): its own age, as if each gradient knew how late it would be.
    ``cover=1`` is what ``PartialAllreduceState(late="lookahead_local")`` computes (its point covers one round).
    """
    if remedy not in REMEDIES:
        raise ValueError(f"remedy: expected one of {REMEDIES}, found {remedy!r}")
    if cover is not None and (isinstance(cover, bool) or not isinstance(cover, int) or cover < 1):
        raise ValueError(f"cover: expected None or an integer >= 1 (steps the predicted point covers), found {cover!r}")
    torch.manual_seed(seed)
    data = load_dataset(dataset, seed=seed)
    net = build_model(model, data.in_shape, data.num_classes)
    params = list(net.parameters())
    mu = lowered_momentum(momentum, staleness) if remedy == "momentum" else momentum
    opt = torch.optim.SGD(params, lr=lr, momentum=mu, nesterov=remedy == "nesterov")
    shards = [BatchIterator(*data.shard(r, ranks), batch_size, seed=seed, rank=r) for r in range(ranks)]
    draw = random.Random(seed)
    ages, weights = list(staleness), list(staleness.values())
    history: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=max(ages) + 1)
    buffers: collections.deque[list[torch.Tensor | None]] = collections.deque(maxlen=max(ages) + 1)  # _PREDICTS
    if dc_lambda is None:
        dc_lambda = 2.0 if remedy == "dc_adaptive" else 0.04
    mean_square = [torch.zeros_like(p) for p in params]  # dc_adaptive
    applied: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=max(ages) + 1)  # lookahead_last
    own: list[list[torch.Tensor] | None] = [None] * ranks  # lookahead_own: each rank's gradient of the step before
    for _ in range(steps):
        now = [p.detach().clone() for p in params]
        history.appendleft(now)
        if remedy in _PREDICTS:
            buffers.appendleft([opt.state[p]["momentum_buffer"].clone() if p in opt.state else None for p in params])
        total = [torch.zeros_like(p) for p in params]
        late = [torch.zeros_like(p) for p in params]  # outside
        for r, shard in enumerate(shards):
            age = min(draw.choices(ages, weights)[0], len(history) - 1)
            old = history[age]
            with torch.no_grad():
                for i, (p, w) in enumerate(zip(params, old)):
                    p.copy_(w)
                    if remedy in _PREDICTS and age > 0 and (v := buffers[age][i]) is not None:
                        ahead = age if cover is None else cover
                        if remedy == "extrapolate":
                            p.sub_(v, alpha=lr * ahead)
                        else:
                            p.sub_(v, alpha=lookahead_coefficient(lr, mu, ahead))
                        if remedy == "lookahead_last" and len(applied) > age:
                            p.sub_(applied[age][i], alpha=lr)
                        elif remedy == "lookahead_own" and (mine := own[r]) is not None:
                            p.sub_(mine[i], alpha=lr * in_flight_steps(mu, ahead))
            x, y = next(shard)
            grads = torch.autograd.grad(F.cross_entropy(net(x), y), params)
            if remedy == "lookahead_own":
                own[r] = [g.detach() for g in grads]
            with torch.no_grad():
                for i, g in enumerate(grads):
                    if remedy == "staleness_lr" and age > 0:
                        g = g / age
                    elif remedy == "dc" and age > 0:
                        g = g + dc_lambda * g * g * (now[i] - old[i])
                    elif remedy == "dc_adaptive":
                        mean_square[i].mul_(0.95).addcmul_(g, g, value=0.05)
                        if age > 0:
                            scale = dc_lambda / torch.sqrt(mean_square[i] + 1e-7)
                            g = g + scale * g * g * (now[i] - old[i])
                    (late if remedy == "outside" and age > 0 else total)[i].add_(g, alpha=1.0 / ranks)
        with torch.no_grad():
            for p, w, g in zip(params, now, total):
                p.copy_(w)
                p.grad = g
        if remedy == "lookahead_last":
            applied.appendleft([g.clone() for g in total])
        opt.step()
        if remedy == "outside":
            with torch.no_grad():
                for p, g in zip(params, late):
                    p.sub_(g, alpha=lr)
    with torch.no_grad():
        return float((net(data.x_test).argmax(1) == data.y_test).float().mean())


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    st = sub.add_parser("stability", help="the largest stable eta*h of heavy ball with a delayed gradient")
    st.add_argument("--momenta", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    st.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2, 4])
    em = sub.add_parser("emulate", help="train P virtual ranks whose gradients are late")
    em.add_argument("--staleness", type=parse_staleness, default={0: 1.0}, help="ROUNDS:PROBABILITY,...")
    em.add_argument("--dataset", default="mnist")
    em.add_argument("--model", default="cnn")
    em.add_argument("--ranks", type=int, default=8)
    em.add_argument("--steps", type=int, default=400)
    em.add_argument("--batch-size", type=int, default=32)
    em.add_argument("--lr", type=float, default=0.05)
    em.add_argument("--momentum", type=float, default=0.9)
    em.add_argument("--seeds", type=int, nargs="+", default=[0])
    em.add_argument("--remedy", choices=REMEDIES, default="none", help="what late gradients do (emulate's docstring)")
    em.add_argument("--dc-lambda", type=float, default=None, help="dc: lambda (0.04); dc_adaptive: lambda0 (2)")
    em.add_argument("--cover", type=int, default=None, help="steps a predicted point covers (default: the age)")
    em.add_argument("--json", type=Path, default=None, help="also write the accuracies and the arguments here")
    args = p.parse_args(argv)
    if args.what == "stability":
        print("largest stable eta*h (heavy ball, the whole gradient s steps old); synchronous: s = 0")
        print("s    " + "  ".join(f"mu={m:<5g}" for m in args.momenta))
        for s in args.delays:
            print(f"{s:<4} " + "  ".join(f"{max_stable_step(m, s):<8.3f}" for m in args.momenta))
        return
    torch.set_num_threads(1)
    accs = [
        emulate(
            args.staleness,
            dataset=args.dataset,
            model=args.model,
            ranks=args.ranks,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=args.momentum,
            seed=s,
            remedy=args.remedy,
            dc_lambda=args.dc_lambda,
            cover=args.cover,
        )
        for s in args.seeds
    ]
    for s, a in zip(args.seeds, accs):
        print(f"seed {s}: test accuracy {100 * a:.2f} %")
    covered = "" if args.cover is None else f" (cover {args.cover})"
    print(
        f"staleness {args.staleness}, lr {args.lr}, momentum {args.momentum}, {args.ranks} ranks x {args.steps} steps, "
        f"remedy {args.remedy}{covered}: median {100 * statistics.median(accs):.2f} %, "
        f"mean {100 * statistics.mean(accs):.2f} %"
    )
    if args.json is not None:
        record = {k: v for k, v in vars(args).items() if k not in ("what", "json")}
        record["staleness"] = {str(k): v for k, v in args.staleness.items()}
        record["accuracy"] = dict(zip(map(str, args.seeds), accs))
        record["command"] = "python benchmarks/delayed_sgd.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
