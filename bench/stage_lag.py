"""What stage 0's gradients cost when they are not of the parameters of the step they count in: one process, exact.

configs/tiny.yaml's two stages train in one process, a micro-batch of each of two trainers' windows in turn (as
the reference of bench/convergence.py), and stage 0's gradient is taken in one of these ways:

- exact: on its parameters of now (the reference itself);
- behind D [FROM-TO]: on its parameters of D steps before, forward and backward (in steps FROM to TO only);
- pipeline L [recomputed]: each micro-batch's forward runs through both stages at once (stage 1 steps on its own
  full batch), and its backward reaches stage 0 L micro-batches later, as in a pipeline with more in flight: on
  the forward's parameters (stashed), or `recomputed` on stage 0's parameters when the backward comes, with the
  gradient of the output of then (not the output those parameters give);
- predicted K: on a prediction of the parameters the step before makes, from the first K micro-batches of that
  step's batch (look-ahead from one of two replicas' share: K 1 of 2), or from AdamW's moments alone (K 0).

Printed: the validation loss every 10 steps of stage 0, and at the last over exact's. On 2026-12-07 (50 steps):
exact 2.7345; behind 1 +9.6%, behind 1 in steps 1-5 +2.5%, in 31-50 +5.1%; pipeline 1 +2.5%, 2 +9.8%, 1
recomputed +9.7%; predicted 1 +1.8% (+3.8% at step 30), predicted 0 +9.3% (README, Learning).

    .venv/bin/python bench/stage_lag.py                       # each way at its figures above
    .venv/bin/python bench/stage_lag.py --way pipeline --arg 2 --steps 100
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from pathlib import Path

import torch
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import RunConfig  # noqa: E402
from swarm.reference import ReferenceTrainer  # noqa: E402

WAYS = [("exact", 0, None), ("behind", 1, None), ("behind", 1, (1, 5)), ("behind", 1, (31, 10**9)),
        ("pipeline", 1, None), ("pipeline", 2, None), ("pipeline-recomputed", 1, None), ("predicted", 1, None),
        ("predicted", 0, None)]


class Run:
    def __init__(self, config: RunConfig):
        self.ref = ReferenceTrainer(config, trainers=2)
        self.s0, self.s1 = self.ref.stages
        self.o0, self.o1 = self.ref.optimizers
        self.names = [n for n, _ in self.s0.named_parameters()]
        self.turn = 0

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.ref.samplers[self.turn].next_batch()
        self.turn = (self.turn + 1) % len(self.ref.samplers)
        return x, y

    def params0(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.s0.parameters()]

    def add0(self, leaves: list[torch.Tensor], n: int) -> None:
        """Stage 0's gradient, taken on `leaves`, into its accumulation."""
        with torch.no_grad():
            for p, leaf in zip(self.s0.parameters(), leaves):
                p.grad = leaf.grad.clone() if p.grad is None else p.grad + leaf.grad
        self.o0.add_samples(n)

    def through(self, on: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
        """A micro-batch through both stages, stage 0 on `on`; both accumulate."""
        leaves = [p.clone().requires_grad_(True) for p in on]
        loss = self.s1(functional_call(self.s0, dict(zip(self.names, leaves)), (x,)), targets=y)
        (loss * x.shape[0]).backward()
        self.add0(leaves, x.shape[0])
        self.o1.add_samples(x.shape[0])


def train(config: RunConfig, way: str, arg: int, window: tuple[int, int] | None, steps: int) -> list[float]:
    run, losses = Run(config), []
    history = [run.params0()]  # stage 0's parameters after each step
    predicted = None  # way predicted: the parameters the last step was predicted to make
    pending: deque = deque()  # way pipeline: (x, stage 0's parameters, gradient of its output)
    while run.o0.step_count < steps:
        k = run.o0.step_count + 1  # the step this batch makes
        if way.startswith("pipeline"):
            x, y = run.sample()
            on = run.params0()
            h = functional_call(run.s0, dict(zip(run.names, on)), (x,)).detach().requires_grad_(True)
            (run.s1(h, targets=y) * x.shape[0]).backward()
            run.o1.add_samples(x.shape[0])
            if run.o1.ready:
                run.o1.step()
            pending.append((x, on, h.grad.detach()))
            while len(pending) > arg:
                xb, onb, grad = pending.popleft()
                leaves = [p.clone().requires_grad_(True) for p in (run.params0() if way.endswith("recomputed")
                                                                   else onb)]
                functional_call(run.s0, dict(zip(run.names, leaves)), (xb,)).backward(grad)
                run.add0(leaves, xb.shape[0])
        else:
            if way == "behind" and (window is None or window[0] <= k <= window[1]):
                on = history[max(0, len(history) - 1 - arg)]
            elif way == "predicted" and predicted is not None:
                on = predicted
            else:
                on = run.params0()
            count, predicted = 0, None
            if way == "predicted" and arg == 0:  # from the moments alone
                predicted = run.o0.preview([torch.zeros_like(p) for p in run.s0.parameters()], 1)
            while not (run.o0.ready and run.o1.ready):
                run.through(on, *run.sample())
                count += 1
                if way == "predicted" and arg and count == arg:
                    predicted = run.o0.preview([p.grad for p in run.s0.parameters()], run.o0.samples)
            run.o1.step()
        if run.o0.ready:
            run.o0.step()
            history = (history + [run.params0()])[-4:]
            if run.o0.step_count % 10 == 0:
                losses.append(run.ref.evaluate())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--way", choices=["exact", "behind", "pipeline", "pipeline-recomputed", "predicted"])
    p.add_argument("--arg", type=int, default=1, help="D, L or K (see above)")
    p.add_argument("--window", help="FROM-TO: the steps `behind` applies in")
    args = p.parse_args()
    config = RunConfig.load(args.config)
    window = tuple(int(v) for v in args.window.split("-")) if args.window else None
    ways = [(args.way, args.arg, window)] if args.way else WAYS
    exact = None
    for way, arg, win in [("exact", 0, None)] + [w for w in ways if w[0] != "exact"]:
        losses = train(config, way, arg, win, args.steps)
        exact = exact or losses
        label = way if way == "exact" else f"{way} {arg}" + (f" in steps {win[0]}-{min(win[1], args.steps)}" if win
                                                            else "")
        print(f"{label}: {' '.join(f'{v:.4f}' for v in losses)}; at step {args.steps} x{losses[-1] / exact[-1]:.3f} "
              "of exact", flush=True)


if __name__ == "__main__":
    main()
