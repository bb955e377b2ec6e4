"""What stale gradients cost, in one process: the two-stage reference with some micro-batches stale.

A micro-batch is stale when its first stage stepped between its forward and its backward, as
happens in the swarm when micro-batches of several trainers (or several in flight) cross a step.
The second stage then sees activations of the first stage's previous parameters. How the first
stage's gradient is made:

- recompute: the forward is recomputed on the current parameters, as swarm servers do, and
  back-propagated with the gradient the second stage computed from the old activations;
- stash: the forward and backward run on the previous parameters (weight stashing, as in
  PipeDream): a consistent gradient, one step old.

Printed: the validation loss after --steps steps of configs/tiny.yaml for each share of stale
micro-batches, beside exact training (share 0), and the ratio.

    .venv/bin/python bench/staleness.py                     # shares 0, 0.125, 0.25, 0.5, 1; 65 steps
    .venv/bin/python bench/staleness.py --shares 0 0.5 --steps 30
"""

from __future__ import annotations

import argparse
import copy
import random

import torch

from swarm.config import RunConfig
from swarm.reference import ReferenceTrainer


def train(config: RunConfig, steps: int, share: float, mode: str, seed: int = 0) -> float:
    trainer = ReferenceTrainer(config)
    first, last = trainer.stages
    opt_first, opt_last = trainer.optimizers
    previous = copy.deepcopy(first)  # the first stage's parameters one step ago
    rng = random.Random(seed)
    for _ in range(steps):
        before = copy.deepcopy(first.state_dict())
        while not opt_first.ready:
            x, y = trainer.sampler.next_batch()
            n = x.shape[0]
            if rng.random() < share:
                with torch.no_grad():
                    hidden = previous(x).requires_grad_(True)
                (last(hidden, targets=y) * n).backward()
                if mode == "stash":
                    previous.zero_grad(set_to_none=True)
                    previous(x).backward(hidden.grad)
                    for p, q in zip(first.parameters(), previous.parameters()):
                        p.grad = q.grad.clone() if p.grad is None else p.grad + q.grad
                else:
                    first(x).backward(hidden.grad)
            else:
                (trainer.loss(x, y) * n).backward()
            opt_first.add_samples(n)
            opt_last.add_samples(n)
        previous.load_state_dict(before)
        opt_first.step()
        opt_last.step()
    return trainer.evaluate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=65)
    p.add_argument("--shares", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    p.add_argument("--modes", nargs="+", default=["recompute", "stash"], choices=["recompute", "stash"])
    args = p.parse_args()
    config = RunConfig.load(args.config)
    config.stages.num_stages = 2
    config.validate()
    exact = train(config, args.steps, 0.0, "recompute")
    print(f"{args.config}, {args.steps} steps: exact val loss {exact:.4f}", flush=True)
    for share in args.shares:
        for mode in args.modes:
            loss = train(config, args.steps, share, mode)
            print(f"stale share {share:g} ({mode}): val loss {loss:.4f}, / exact {loss / exact:.3f}", flush=True)


if __name__ == "__main__":
    main()
