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
- block: the first --block-steps steps have no late samples (rounds block compute during warm-up);
- steps of more samples than a batch (--step-samples: the swarm's steps grow when a round takes longer
  than a batch takes to fill), and what might make up for them: +sqrt (a step's learning rate times
  the square root of its batches' worth of samples) and +bysamples (the schedule advanced by batches'
  worth of samples instead of by steps). Losses are then compared at equal samples.
- what the swarm's late samples may differ by (look-ahead variants): --unpredicted U, the share of late
  micro-batches that run on w_t all the same; --apart A, the share of which one stage (at random) is not
  in a round and runs on its parameters of now, its gradient fresh. At batch 128, 45% late (2026-12-04):
  U 0.25 gives 1.038/1.047 at steps 50/100 and U 0.5 1.103/1.119 (0 gives 1.028/1.015); A 0.5 and 1.0
  cost nothing (1.007/1.000, 0.991/0.995).

One seed's ratio can differ from another's by several percent (tiny.yaml at batch 16, 60% late:
AdamW + look-ahead / exact AdamW 1.010-1.054 at step 300 over 5 seeds, NAdamW + look-ahead / exact
NAdamW 0.965-1.017); --seeds N runs each N times with other model, data and lateness seeds and prints
the mean loss, the mean ratio and its range over seeds (and exact NAdamW / exact AdamW's).

Printed: validation loss at each --at step for each variant, its ratio to the exact run (no late
samples) with the same optimizer, and to exact AdamW. Runs in one thread, seeded: the same command
gives the same figures.

    .venv/bin/python bench/staleness.py                               # share 0.6, steps 50 and 300
    .venv/bin/python bench/staleness.py --share 0.4 --batch-size 128 --at 50
    .venv/bin/python bench/staleness.py --variants adamw adamw+lookahead nadamw nadamw+lookahead
    .venv/bin/python bench/staleness.py --seeds 5 --share 0.7 --step-samples 28 --variants nadamw+lookahead
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import RunConfig  # noqa: E402
from swarm.optim import StageOptimizer, lr_at  # noqa: E402
from swarm.reference import ReferenceTrainer  # noqa: E402

VARIANTS = ("adamw", "adamw+lookahead", "adamw+dc", "adamw+block", "nadamw", "nadamw+lookahead", "nadamw+dc",
            "nadamw+lookahead+dc", "nadamw+lookahead+block")


@dataclass(frozen=True)
class Variant:
    optimizer: str
    lookahead: bool = False
    dc: bool = False
    block: bool = False
    sqrt: bool = False
    bysamples: bool = False
    fill: str | None = None  # look-ahead: the others' share of the batch taken as (None: left out)

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, *extras = text.split("+")
        unknown = set(extras) - {"lookahead", "dc", "block", "sqrt", "bysamples", "fillprev", "fillmom"}
        if name not in ("adamw", "nadamw") or unknown:
            raise SystemExit(f"unknown variant {text!r}: an optimizer (adamw, nadamw) and +lookahead, +dc, +block, "
                             "+sqrt, +bysamples")
        return cls(name, "lookahead" in extras or "fillprev" in extras or "fillmom" in extras, "dc" in extras,
                   "block" in extras, "sqrt" in extras, "bysamples" in extras,
                   "prev" if "fillprev" in extras else "momentum" if "fillmom" in extras else None)


class SampleScaledOptimizer(StageOptimizer):
    """What might make up for steps of more samples than a batch (`--step-samples`): +sqrt multiplies a step's
    learning rate by the square root of its batches' worth of samples (Adam's square-root scaling rule, at most
    2x); +bysamples advances the schedule by batches' worth of samples stepped on instead of by steps."""

    sqrt = bysamples = False
    stepped_batches, last_samples = 0.0, 0

    def learning_rate(self, samples: int | None = None) -> float:
        batch = self.config.batch_size
        scale = min(4.0, (samples if samples is not None else self.last_samples or batch) / batch)
        lr = lr_at(self.stepped_batches if self.bysamples else self.step_count, self.config)
        return lr * math.sqrt(scale) if self.sqrt else lr

    def step_with(self, mean_grads, samples):  # type: ignore[no-untyped-def]
        stats = super().step_with(mean_grads, samples)
        if not stats["skipped"]:
            self.stepped_batches += samples / self.config.batch_size
            self.last_samples = samples
        return stats


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
        with torch.no_grad():
            for param, predicted in zip(stage_copy.parameters(), opt.preview(sums, samples)):
                param.copy_(predicted)
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
          dc_lambda: float, step_samples: int | None = None, seed: int = 0,
          unpredicted: float = 0.0, apart: float = 0.0) -> dict[int, float]:
    """Validation losses after as many samples as `at` batches hold (at those steps, where every step takes a
    batch); with `step_samples`, steps take that many samples on average (whole micro-batches). With
    look-ahead, a late micro-batch runs on w_t instead of the prediction with probability `unpredicted`, and
    with probability `apart` one stage (at random) is not in a round: it runs on its parameters of now and its
    gradient counts fresh, while the others run on their prediction, late."""
    torch.manual_seed(seed)
    trainer = ReferenceTrainer(config)
    stages, optimizers = trainer.stages, trainer.optimizers
    for opt in optimizers:
        opt.__class__ = SampleScaledOptimizer
        opt.sqrt, opt.bysamples = variant.sqrt, variant.bysamples
    batch, micro = config.optimizer.batch_size, config.optimizer.micro_batch_size
    extra = max(0.0, ((step_samples or batch) - batch) / micro)  # mean micro-batches a step takes beyond a batch
    more = extra / (1.0 + extra)  # each one more with this probability: a geometric count of mean `extra`
    rng, sizes, misses, rounds = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2), \
        random.Random(seed + 3)
    used: list[torch.nn.Module] | None = None  # the parameters late samples run on (none before the first step)
    before: list[torch.nn.Module] | None = None  # w_t: the parameters before the last step
    losses: dict[int, float] = {}
    seen = step = 0
    previous: list[list[torch.Tensor]] = [[] for _ in stages]  # the last step's mean gradient (+fillprev)
    while len(losses) < len(at):
        target = batch
        while sizes.random() < more:
            target += micro
        late_share = 0.0 if used is None or (variant.block and step < block_steps) else share
        late = [[torch.zeros_like(p) for p in s.parameters()] for s in stages]
        local = [[torch.zeros_like(p) for p in s.parameters()] for s in stages]  # this server's own share
        late_n = local_n = index = 0
        while optimizers[0].samples < target:
            x, y = trainer.sampler.next_batch()
            n = x.shape[0]
            if used is not None and rng.random() < late_share:
                on = before if variant.lookahead and misses.random() < unpredicted else used
                fresh = rounds.randrange(len(stages)) if variant.lookahead and rounds.random() < apart else None
                if fresh is not None:  # that stage runs now, and its gradient adds to this step's as it comes
                    on = [stages[i] if i == fresh else m for i, m in enumerate(on)]
                for i, s in enumerate(on):
                    if i != fresh:
                        s.zero_grad(set_to_none=True)
                prior_sums = grads_of(stages)
                (chain(on, x, y) * n).backward()
                mine = grads_of(on)
                if fresh is not None:
                    mine[fresh] = [a - b for a, b in zip(mine[fresh], prior_sums[fresh])]
                for i, (sums, part) in enumerate(zip(late, mine)):
                    if i != fresh:
                        for g, d in zip(sums, part):
                            g.add_(d)
                late_n += n
            else:
                prior_sums = grads_of(stages)
                (chain(stages, x, y) * n).backward()
                mine = [[a - b for a, b in zip(after, prior)] for after, prior in zip(grads_of(stages), prior_sums)]
            if index % servers == 0:
                for sums, part in zip(local, mine):
                    for g, d in zip(sums, part):
                        g.add_(d)
                local_n += n
            index += 1
            for opt in optimizers:
                opt.add_samples(n)
            seen += n
        if late_n:
            if variant.dc:
                compensate(late, late_n, stages, used, dc_lambda)
            for stage, sums in zip(stages, late):
                for p, g in zip(stage.parameters(), sums):
                    p.grad = g if p.grad is None else p.grad + g
        current = [copy.deepcopy(s) for s in stages]
        if variant.fill is not None and step > 0:
            total = optimizers[0].samples
            for sums, stage, opt, before in zip(local, stages, optimizers, previous):
                for g, p, prev in zip(sums, stage.parameters(), before):
                    if variant.fill == "prev":
                        g.add_(prev, alpha=total - local_n)
                    else:
                        state = opt.optimizer.state.get(p, {})
                        if "exp_avg" in state:
                            t = float(state["step"])
                            g.add_(state["exp_avg"] / (1 - opt.config.beta1**t), alpha=total - local_n)
            local_n = total
        if variant.fill == "prev":
            previous = [[(torch.zeros_like(p) if p.grad is None else p.grad / optimizers[0].samples)
                         for p in stage.parameters()] for stage in stages]
        next_used = preview(stages, optimizers, local, local_n) if variant.lookahead else current
        for opt in optimizers:
            opt.step()
        used, before = next_used, current
        step += 1
        due = [s for s in at if s not in losses and seen >= s * batch]
        if due:
            loss = trainer.evaluate()
            losses.update({s: loss for s in due})
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
    p.add_argument("--step-samples", type=int, help="samples a step takes on average (default: a batch), as the "
                   "swarm's steps grow when rounds take longer than a batch; losses are then at equal samples")
    p.add_argument("--unpredicted", type=float, default=0.0, help="with look-ahead, the share of late micro-batches "
                   "that run on w_t all the same (the swarm's: backwards after a step no forward ahead predicted, "
                   "samples a replica holds before its own round starts)")
    p.add_argument("--apart", type=float, default=0.0, help="with look-ahead, the share of late micro-batches of "
                   "which one stage (at random) is not in a round: it runs on its parameters of now, its gradient "
                   "fresh (the swarm's stages run their rounds each at its own time)")
    p.add_argument("--seeds", type=int, default=1, help="runs of each, with model, data and lateness seeds 0.. "
                   "(figures: the mean loss, the mean ratio and, with more than one, its range over seeds)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    base = RunConfig.from_yaml(Path(args.config).read_text())
    at = sorted(set(args.at or [50, base.optimizer.total_steps]))
    variants = [Variant.parse(v) for v in args.variants]
    seeds = range(args.seeds)

    def runs(variant: Variant, share: float, step_samples: int | None) -> list[dict[int, float]]:
        out = []
        for seed in seeds:
            config = configure(base, variant.optimizer, args.batch_size, args.nadamw_beta1)
            config.model.seed, config.data.seed = base.model.seed + seed, base.data.seed + seed
            out.append(train(config, variant, share, at, args.servers, args.block_steps, args.dc_lambda, step_samples,
                             seed, args.unpredicted, args.apart))
        return out

    exact: dict[str, list[dict[int, float]]] = {}
    print(f"{args.config}: batch {args.batch_size or base.optimizer.batch_size}, late share {args.share}, "
          f"{args.step_samples or 'a batch of'} samples a step, NAdamW beta1 {args.nadamw_beta1}, "
          f"{args.servers} servers per stage, {args.unpredicted} of late samples unpredicted with look-ahead "
          f"and {args.apart} with one stage apart, "
          f"{args.seeds} seed(s); validation loss at steps {at} "
          "(at equal samples)", flush=True)
    for name in sorted({v.optimizer for v in variants} | {"adamw"}):
        started = time.perf_counter()
        exact[name] = runs(Variant(name), 0.0, None)
        print(f"  {name + ' exact':26} " + "  ".join(f"{statistics.mean(r[s] for r in exact[name]):.4f}" for s in at)
              + f"   ({time.perf_counter() - started:.0f} s)", flush=True)
    for name in sorted(set(exact) - {"adamw"}):
        if args.seeds > 1:
            print(f"  {name + ' / adamw exact':26} " + "  ".join(
                f"{min(r[s] / a[s] for r, a in zip(exact[name], exact['adamw'])):.3f}-"
                f"{max(r[s] / a[s] for r, a in zip(exact[name], exact['adamw'])):.3f}" for s in at) + " over seeds")
    print(f"  {'variant':26} " + "  ".join(f"{'@' + str(s):>6}  /own   /adamw" for s in at))
    for text, variant in zip(args.variants, variants):
        started = time.perf_counter()
        losses = runs(variant, args.share, args.step_samples)
        cells = []
        for s in at:
            own = [r[s] / e[s] for r, e in zip(losses, exact[variant.optimizer])]
            adamw = [r[s] / e[s] for r, e in zip(losses, exact["adamw"])]
            spread = f" [{min(own):.3f}-{max(own):.3f}]" if len(own) > 1 else ""
            cells.append(f"{statistics.mean(r[s] for r in losses):.4f} {statistics.mean(own):.3f}{spread} "
                         f"{statistics.mean(adamw):.3f}")
        print(f"  {text:26} " + "  ".join(cells) + f"   ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
