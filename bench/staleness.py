"""What late samples cost, and what wins it back, in one process: exactly reproducible.

In the swarm, a stage's servers close a batch, then all-reduce its gradients while compute goes on.
Samples computed during that round are on the parameters w_t the round started from, but they are
applied at the next step, to w_{t+1}: one step late. The share of late samples is what the swarm's
`late_share` reports (55-66% at tiny.yaml's batch 16, about 40% at batch 128). Here, both stages of
configs/tiny.yaml train in one process, and each micro-batch is late with probability --share: its
forward and backward run on the parameters the late samples would have seen. What is compared:

- optimizer: adamw (the run's betas) and nadamw (torch's NAdam, decoupled weight decay, beta1 0.99);
- look-ahead: late samples run on a prediction of w_{t+1} instead of w_t: the step the optimizer
  would take with this server's own share of the batch (1/--servers of it), its moments, clipping
  and learning rate: all a server knows when its round starts;
- DC-ASGD: at apply time the late gradients' mean g becomes g + lambda * g * g * (w_now - w_used),
  lambda = --dc-lambda / sqrt(mean(g^2)) per tensor (the adaptive form of Zheng et al., 2017);
- block: the first --block-steps steps have no late samples (rounds block compute during warm-up).

Printed: validation loss at each --at step for each variant, its ratio to the exact run (no late
samples) with the same optimizer, and to exact AdamW. Runs in one thread, seeded: the same command
gives the same figures.

    .venv/bin/python bench/staleness.py                               # share 0.6, steps 50 and 300
    .venv/bin/python bench/staleness.py --share 0.4 --batch-size 128 --at 50
    .venv/bin/python bench/staleness.py --variants adamw adamw+lookahead nadamw nadamw+lookahead
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import RunConfig  # noqa: E402
from swarm.optim import StageOptimizer  # noqa: E402
from swarm.reference import ReferenceTrainer  # noqa: E402

VARIANTS = ("adamw", "adamw+lookahead", "adamw+dc", "adamw+block", "nadamw", "nadamw+lookahead", "nadamw+dc",
            "nadamw+lookahead+dc", "nadamw+lookahead+block")


@dataclass(frozen=True)
class Variant:
    optimizer: str
    lookahead: bool = False
    dc: bool = False
    block: bool = False

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, *extras = text.split("+")
        unknown = set(extras) - {"lookahead", "dc", "block"}
        if name not in ("adamw", "nadamw") or unknown:
            raise SystemExit(f"unknown variant {text!r}: an optimizer (adamw, nadamw) and +lookahead, +dc, +block")
        return cls(name, "lookahead" in extras, "dc" in extras, "block" in extras)


def configure(base: RunConfig, optimizer: str, batch_size: int | None, nadamw_beta1: float = 0.99) -> RunConfig:
    config = copy.deepcopy(base)
    config.optimizer.name = optimizer
    config.optimizer.beta1 = nadamw_beta1 if optimizer == "nadamw" else 0.9
    if batch_size is not None:
        config.optimizer.batch_size = batch_size
    return config.validate()


def chain(stages: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hidden = x
    for stage in stages[:-1]:
        hidden = stage(hidden)
    return stages[-1](hidden, targets=y)


def grads_of(stages: list[torch.nn.Module]) -> list[list[torch.Tensor]]:
    return [[torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in s.parameters()]
            for s in stages]


def preview(stages: list[torch.nn.Module], optimizers: list[StageOptimizer], grads: list[list[torch.Tensor]],
            samples: int) -> list[torch.nn.Module]:
    """Copies of `stages` after the step their optimizers would take on the gradient sums `grads`."""
    ahead = []
    for stage, opt, sums in zip(stages, optimizers, grads):
        stage_copy = copy.deepcopy(stage)
        opt_copy = StageOptimizer(stage_copy, opt.config)
        opt_copy.load_state_dict(opt.state_dict())
        opt_copy.step_with([g / samples for g in sums], samples)
        ahead.append(stage_copy)
    return ahead


def compensate(late: list[list[torch.Tensor]], samples: int, now: list[torch.nn.Module],
               used: list[torch.nn.Module], lam: float) -> None:
    """DC-ASGD on the late gradient sums `late` (of `samples` samples), in place."""
    for sums, stage_now, stage_used in zip(late, now, used):
        for g, p_now, p_used in zip(sums, stage_now.parameters(), stage_used.parameters()):
            mean = g / samples
            scale = lam / (float(mean.pow(2).mean().sqrt()) + 1e-12)
            g.add_(mean * mean * (p_now.detach() - p_used.detach()) * scale * samples)


def train(config: RunConfig, variant: Variant, share: float, at: list[int], servers: int, block_steps: int,
          dc_lambda: float, seed: int = 0) -> dict[int, float]:
    torch.manual_seed(seed)
    trainer = ReferenceTrainer(config)
    stages, optimizers = trainer.stages, trainer.optimizers
    rng = random.Random(seed)
    used: list[torch.nn.Module] | None = None  # the parameters late samples run on (none before the first step)
    losses = {}
    for step in range(max(at)):
        late_share = 0.0 if used is None or (variant.block and step < block_steps) else share
        late = [[torch.zeros_like(p) for p in s.parameters()] for s in stages]
        local = [[torch.zeros_like(p) for p in s.parameters()] for s in stages]  # this server's own share
        late_n = local_n = index = 0
        while not optimizers[0].ready:
            x, y = trainer.sampler.next_batch()
            n = x.shape[0]
            if used is not None and rng.random() < late_share:
                for s in used:
                    s.zero_grad(set_to_none=True)
                (chain(used, x, y) * n).backward()
                mine = grads_of(used)
                for sums, part in zip(late, mine):
                    for g, d in zip(sums, part):
                        g.add_(d)
                late_n += n
            else:
                before = grads_of(stages)
                (chain(stages, x, y) * n).backward()
                mine = [[a - b for a, b in zip(after, prior)] for after, prior in zip(grads_of(stages), before)]
            if index % servers == 0:
                for sums, part in zip(local, mine):
                    for g, d in zip(sums, part):
                        g.add_(d)
                local_n += n
            index += 1
            for opt in optimizers:
                opt.add_samples(n)
        if late_n:
            if variant.dc:
                compensate(late, late_n, stages, used, dc_lambda)
            for stage, sums in zip(stages, late):
                for p, g in zip(stage.parameters(), sums):
                    p.grad = g if p.grad is None else p.grad + g
        current = [copy.deepcopy(s) for s in stages]
        next_used = preview(stages, optimizers, local, local_n) if variant.lookahead else current
        for opt in optimizers:
            opt.step()
        used = next_used
        if step + 1 in at:
            losses[step + 1] = trainer.evaluate()
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--share", type=float, default=0.6, help="probability that a micro-batch is late")
    p.add_argument("--at", type=int, nargs="+", help="steps to evaluate at (default: 50 and the schedule's end)")
    p.add_argument("--batch-size", type=int, help="optimizer.batch_size (default: the config's)")
    p.add_argument("--servers", type=int, default=2, help="servers per stage: look-ahead sees 1/servers of a batch")
    p.add_argument("--block-steps", type=int, default=20, help="steps without late samples, with +block")
    p.add_argument("--dc-lambda", type=float, default=2.0, help="DC-ASGD's lambda_0 (adaptive form)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--nadamw-beta1", type=float, default=0.99, help="NAdamW's beta1 (AdamW's is 0.9)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    base = RunConfig.from_yaml(Path(args.config).read_text())
    at = sorted(set(args.at or [50, base.optimizer.total_steps]))
    variants = [Variant.parse(v) for v in args.variants]
    exact: dict[str, dict[int, float]] = {}
    print(f"{args.config}: batch {args.batch_size or base.optimizer.batch_size}, late share {args.share}, "
          f"NAdamW beta1 {args.nadamw_beta1}, "
          f"{args.servers} servers per stage; validation loss at steps {at}", flush=True)
    for name in sorted({v.optimizer for v in variants} | {"adamw"}):
        started = time.perf_counter()
        exact[name] = train(configure(base, name, args.batch_size, args.nadamw_beta1), Variant(name), 0.0, at,
                            args.servers, args.block_steps, args.dc_lambda)
        print(f"  {name + ' exact':26} " + "  ".join(f"{exact[name][s]:.4f}" for s in at)
              + f"   ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"  {'variant':26} " + "  ".join(f"{'@' + str(s):>6}  /own   /adamw" for s in at))
    for text, variant in zip(args.variants, variants):
        started = time.perf_counter()
        losses = train(configure(base, variant.optimizer, args.batch_size, args.nadamw_beta1), variant, args.share, at,
                       args.servers, args.block_steps, args.dc_lambda)
        cells = [f"{losses[s]:.4f} {losses[s] / exact[variant.optimizer][s]:.3f} {losses[s] / exact['adamw'][s]:.3f}"
                 for s in at]
        print(f"  {text:26} " + "  ".join(cells) + f"   ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
