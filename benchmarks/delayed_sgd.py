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

__all__ = ["emulate", "max_stable_step", "parse_staleness"]


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
) -> float:
    """Train with every gradient ``s`` steps late (``s`` drawn from ``staleness`` per gradient); return the final
    test accuracy."""
    torch.manual_seed(seed)
    data = load_dataset(dataset, seed=seed)
    net = build_model(model, data.in_shape, data.num_classes)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    shards = [BatchIterator(*data.shard(r, ranks), batch_size, seed=seed, rank=r) for r in range(ranks)]
    draw = random.Random(seed)
    ages, weights = list(staleness), list(staleness.values())
    history: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=max(ages) + 1)
    for _ in range(steps):
        now = [p.detach().clone() for p in params]
        history.appendleft(now)
        total = [torch.zeros_like(p) for p in params]
        for shard in shards:
            old = history[min(draw.choices(ages, weights)[0], len(history) - 1)]
            with torch.no_grad():
                for p, w in zip(params, old):
                    p.copy_(w)
            x, y = next(shard)
            grads = torch.autograd.grad(F.cross_entropy(net(x), y), params)
            for t, g in zip(total, grads):
                t.add_(g, alpha=1.0 / ranks)
        with torch.no_grad():
            for p, w, g in zip(params, now, total):
                p.copy_(w)
                p.grad = g
        opt.step()
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
        )
        for s in args.seeds
    ]
    for s, a in zip(args.seeds, accs):
        print(f"seed {s}: test accuracy {100 * a:.2f} %")
    print(
        f"staleness {args.staleness}, lr {args.lr}, momentum {args.momentum}, {args.ranks} ranks x {args.steps} steps: "
        f"median {100 * statistics.median(accs):.2f} %"
    )


if __name__ == "__main__":
    main()
