"""What a backward recomputed on another replica is worth, in the low-communication mode: keep it or drop it?

In ``averaging.mode: local`` the replicas of a stage drift apart between outer steps. When the server that ran a
micro-batch's forward is gone before its backward, another replica recomputes the forward on its own weights and
back-propagates the output gradient the next stage computed from the first replica's output: an inconsistent
gradient. ``averaging.recomputed_weight`` says what it counts for (0: dropped, 1: kept in full). Dropping a
micro-batch costs its share of the batch (the batch's gradient gets noisier); keeping it adds its error. So the
figure is, per micro-batch, the error of the recomputed gradient against the one that replica would have computed
itself, over that micro-batch's own deviation from the batch's mean gradient (its noise):

- ratio < 1: the error is smaller than the micro-batch's noise, and keeping it (weight near 1) is the better
  estimate of the batch gradient; ratio > 1: dropping it is. The weight that makes the batch's gradient closest
  to its expectation is 1 / (1 + ratio**2) (a batch of n micro-batches of noise s, one of them off by e: the
  squared error ((n - 1) s**2 + w**2 (s**2 + e**2)) / (n - 1 + w)**2 is least at w = s**2 / (s**2 + e**2)).

Two whole-model replicas of configs/tiny.yaml cut to 2 stages start from the same weights (a single process trained
--warmup steps, as slow weights mid-run) and each takes H inner steps of the run's optimizer on its own data, as
two servers between outer steps. At several points of that drift, for --micro-batches fresh micro-batches: stage 0
of replica A runs the forward, stage 1 of replica B computes the output gradient from A's output, and stage 0 of
replica B back-propagates it through its own weights (the recompute); against B doing the micro-batch alone.

    .venv/bin/python bench/recompute.py                     # H = 50, warm-up 100 steps
    .venv/bin/python bench/recompute.py --local-steps 16 --warmup 200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import RunConfig  # noqa: E402
from swarm.data import BatchSampler, sampler_seed  # noqa: E402
from swarm.model import build_stage  # noqa: E402
from swarm.optim import StageOptimizer  # noqa: E402
from swarm.reference import ReferenceTrainer  # noqa: E402


class Replica:
    """One server of each stage, copied from the reference, training on its own stream of batches."""

    def __init__(self, config: RunConfig, reference: ReferenceTrainer, seed: int):
        self.config = config
        self.stages, self.optimizers = [], []
        for index, (stage, optimizer) in enumerate(zip(reference.stages, reference.optimizers)):
            module = build_stage(config, index)
            module.load_state_dict(stage.state_dict())
            copy = StageOptimizer(module, config.optimizer)
            copy.load_state_dict(optimizer.state_dict())
            self.stages.append(module)
            self.optimizers.append(copy)
        self.sampler = BatchSampler(reference.train_tokens, config.model.seq_len, config.optimizer.micro_batch_size,
                                    seed=sampler_seed(config.data.seed, 100 + seed))

    def inner_step(self) -> None:
        while not all(opt.ready for opt in self.optimizers):
            x, y = self.sampler.next_batch()
            (self.stages[1](self.stages[0](x), targets=y) * x.shape[0]).backward()
            for opt in self.optimizers:
                opt.add_samples(x.shape[0])
        for opt in self.optimizers:
            opt.step()

    def stage0_params(self) -> list[torch.Tensor]:
        return [p for p in self.stages[0].parameters() if p.requires_grad]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def stage0_gradient(forward: Replica, backward: Replica, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of `backward`'s stage-0 parameters when `forward`'s stage 0 ran the forward and `backward`'s stage 1
    computed the output gradient from it (the same replica for both: the consistent gradient)."""
    with torch.no_grad():
        hidden = forward.stages[0](x)
    hidden.requires_grad_(True)
    loss = backward.stages[1](hidden, targets=y) * x.shape[0]
    (grad_hidden,) = torch.autograd.grad(loss, [hidden])
    recomputed = backward.stages[0](x)
    return flat(torch.autograd.grad(recomputed, backward.stage0_params(), grad_hidden))


def drift(a: Replica, b: Replica) -> float:
    with torch.no_grad():
        pa, pb = flat(a.stage0_params()), flat(b.stage0_params())
        return float((pa - pb).norm() / pb.norm())


def measure(a: Replica, b: Replica, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    true = [stage0_gradient(b, b, x, y) for x, y in batches]
    recomputed = [stage0_gradient(a, b, x, y) for x, y in batches]
    mean = torch.stack(true).mean(0)
    errors = [float((r - t).norm()) for r, t in zip(recomputed, true)]
    noise = [float((t - mean).norm()) for t in true]
    cosines = [min(1.0, float(torch.nn.functional.cosine_similarity(r, t, dim=0))) for r, t in zip(recomputed, true)]
    ratio = sum(errors) / sum(noise)
    return {"drift": drift(a, b), "error_over_noise": ratio, "best_weight": 1 / (1 + ratio**2),
            "relative_error": sum(errors) / sum(float(t.norm()) for t in true),
            "cosine": sum(cosines) / len(cosines)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--local-steps", type=int, default=50, help="H: the inner steps each replica takes")
    p.add_argument("--warmup", type=int, default=100, help="steps the common start was trained for")
    p.add_argument("--micro-batches", type=int, default=16, help="micro-batches measured at each point")
    p.add_argument("--points", type=int, default=5, help="points of the drift measured, evenly spaced up to H")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    config = RunConfig.load(args.config)
    config.stages.num_stages = 2
    config.validate()
    torch.manual_seed(0)
    reference = ReferenceTrainer(config)
    for _ in range(args.warmup):
        reference.train_step()
    a, b = Replica(config, reference, 1), Replica(config, reference, 2)
    probe = BatchSampler(reference.train_tokens, config.model.seq_len, config.optimizer.micro_batch_size,
                         seed=sampler_seed(config.data.seed, 999))
    batches = [probe.next_batch() for _ in range(args.micro_batches)]
    at = sorted({round(args.local_steps * i / (args.points - 1)) for i in range(args.points)})
    results, taken = [], 0
    print(f"{args.config}, 2 stages, batch {config.optimizer.batch_size} (micro-batches of "
          f"{config.optimizer.micro_batch_size}), replicas drifting for H = {args.local_steps} inner steps from "
          f"step {args.warmup}; stage 0's gradient recomputed on the other replica, against its own:")
    for steps in at:
        while taken < steps:
            a.inner_step()
            b.inner_step()
            taken += 1
        result = {"inner_steps": steps, **measure(a, b, batches)}
        results.append(result)
        print(f"  after {steps:3d} inner steps: replicas {result['drift']:.4f} apart (relative); recomputed "
              f"gradient's error {result['relative_error']:.3f} of the gradient, cosine {result['cosine']:.4f}; "
              f"error / the micro-batch's own noise {result['error_over_noise']:.3f} "
              f"({'keep' if result['error_over_noise'] < 1 else 'drop'}; best weight {result['best_weight']:.2f})",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
