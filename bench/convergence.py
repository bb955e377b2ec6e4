"""Convergence: validation loss of a local swarm (2 stages x 2 servers, 2 trainers) vs the reference.

The swarm (LocalSwarm: coordinator, servers and trainers as separate processes on 127.0.0.1)
trains until its slowest stage reaches --steps; its trainers are then stopped and the validation
loss is measured through the swarm. The single-process ReferenceTrainer then takes as many steps
(of one batch each) as the swarm's model had taken at that moment (its slowest stage; the servers
say their step in every reply), and is evaluated on the same validation windows. Printed: both
losses and swarm / reference (goals: <= 1.03 on configs/tiny.yaml, <= 1.02 at batch 128), the
samples each side trained (a swarm step can take more than a batch: the samples that come while its
round runs count towards the next step), and the share of samples that came one step late.

What can make them differ: data order (two trainers with their own sampler seeds vs one), larger
steps, and stale gradients. Samples a server takes while its stage's round runs beside compute are
one step late (their gradient is of the parameters before that round's step); a micro-batch whose
stage steps between its forward and its backward is computed on the parameters its forward used
(weight stashing), so it too is one step late; how often that happens grows with the samples in
flight (trainers x --in-flight x micro-batch) relative to the batch. Averaging itself is exact:
with one server per stage, one trainer and one micro-batch in flight the swarm reproduces the
reference's loss to the last digit (--servers-per-stage 1 --trainers 1 --in-flight 1).

    .venv/bin/python bench/convergence.py                  # configs/tiny.yaml, 200 steps
    .venv/bin/python bench/convergence.py --quick          # 40 steps
    .venv/bin/python bench/convergence.py --batch-size 64 --steps 30   # 8 micro-batches a step
    .venv/bin/python bench/convergence.py --config configs/small.yaml --steps 50
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from coordinator.local_swarm import LocalSwarm
from swarm.config import RunConfig
from swarm.reference import ReferenceTrainer


def measure(config_path: str, steps: int, stages: int, log_dir: str | None, servers_per_stage: int = 2,
            trainers: int = 2, in_flight: int | None = None, batch_size: int | None = None) -> dict:
    config = RunConfig.load(config_path)
    config.stages.num_stages = stages
    if batch_size is not None:
        config.optimizer.batch_size = batch_size
    config.validate()
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        swarm = LocalSwarm(str(path), config, servers_per_stage=servers_per_stage, trainers=trainers,
                           log_dir=log_dir or str(Path(tmp) / "logs"), metrics_port=None,
                           stop=threading.Event(), in_flight=in_flight).run(steps)
    # the steps the swarm's model had taken when its validation loss was measured (each of one batch,
    # or a micro-batch more now and then): the samples the trainers computed but no step applied yet
    # are not in it
    reference_steps = max(1, min(swarm["model_steps"]))
    started = time.monotonic()
    reference = ReferenceTrainer(config).run(reference_steps)
    return {
        "config": config_path,
        "batch_size": config.optimizer.batch_size,
        "servers_per_stage": servers_per_stage,
        "trainers": trainers,
        "in_flight": in_flight,
        "swarm_val_loss": swarm["val_loss"],
        "reference_val_loss": reference["val_loss"],
        "ratio": swarm["val_loss"] / reference["val_loss"],
        "samples": swarm["samples"],
        "swarm_steps": swarm["model_steps"],
        **{key: swarm[key] for key in ("late_share", "stale_share", "stale2_share", "round_seconds",
                                       "round_start_seconds")},
        "reference_steps": reference_steps,
        "reference_samples": reference["samples"],
        "swarm_wall_seconds": swarm["wall_seconds"],
        "reference_wall_seconds": time.monotonic() - started,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, help="swarm steps of the slowest stage (default 200; --quick: 40)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--servers-per-stage", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--in-flight", type=int, help="each trainer's micro-batches in flight (default: the trainers')")
    p.add_argument("--batch-size", type=int, help="override the config's optimizer.batch_size")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", help="keep the swarm's logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    steps = args.steps or (40 if args.quick else 200)
    r = measure(args.config, steps, args.stages, args.log_dir, args.servers_per_stage, args.trainers,
                args.in_flight, args.batch_size)
    in_flight = "default" if r["in_flight"] is None else r["in_flight"]
    print(f"{r['config']} (batch {r['batch_size']}; "
          f"{args.stages} stages x {r['servers_per_stage']} servers, "
          f"{r['trainers']} trainers, in flight {in_flight}): trainers completed {r['samples']} samples; "
          f"val loss swarm {r['swarm_val_loss']:.4f} "
          f"({r['swarm_steps']} steps, {r['swarm_wall_seconds']:.0f}s; share of samples one step late per stage "
          f"{r['late_share']}; backwards a step stale {r['stale_share']}, two or more {r['stale2_share']}; "
          f"mean round {r['round_seconds']} s, group formed after {r['round_start_seconds']} s), "
          f"reference {r['reference_val_loss']:.4f} "
          f"({r['reference_steps']} steps of {r['reference_samples']} samples, {r['reference_wall_seconds']:.0f}s); "
          f"swarm/reference {r['ratio']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
