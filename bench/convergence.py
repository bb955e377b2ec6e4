"""Convergence: validation loss of a local swarm (2 stages x 2 servers, 2 trainers) vs the reference.

The swarm (LocalSwarm: coordinator, servers and trainers as separate processes on 127.0.0.1)
trains until its slowest stage reaches --steps; its trainers are then stopped and the validation
loss is measured through the swarm. The single-process ReferenceTrainer then trains on as many
samples as the swarm's trainers completed (in steps of the config's batch) and is evaluated on the
same validation windows. Printed: both losses and swarm / reference (goal <= 1.02).

The two differ in data order (two trainers with their own sampler seeds vs one), and a swarm step
may gather more than a batch (each server learns of the others' samples a DHT round trip late),
so the swarm takes fewer, larger steps for the same samples.

    .venv/bin/python bench/convergence.py                  # configs/tiny.yaml, 200 steps
    .venv/bin/python bench/convergence.py --quick          # 40 steps
    .venv/bin/python bench/convergence.py --config configs/small.yaml --steps 50
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import threading
import time
from pathlib import Path

from coordinator.local_swarm import LocalSwarm
from swarm.config import RunConfig
from swarm.reference import ReferenceTrainer

SERVERS_PER_STAGE = 2
TRAINERS = 2


def measure(config_path: str, steps: int, stages: int, log_dir: str | None) -> dict:
    config = RunConfig.load(config_path)
    config.stages.num_stages = stages
    config.validate()
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        swarm = LocalSwarm(str(path), config, servers_per_stage=SERVERS_PER_STAGE, trainers=TRAINERS,
                           log_dir=log_dir or str(Path(tmp) / "logs"), metrics_port=None,
                           stop=threading.Event()).run(steps)
    reference_steps = max(1, math.ceil(swarm["samples"] / config.optimizer.batch_size))
    started = time.monotonic()
    reference = ReferenceTrainer(config).run(reference_steps)
    return {
        "config": config_path,
        "swarm_val_loss": swarm["val_loss"],
        "reference_val_loss": reference["val_loss"],
        "ratio": swarm["val_loss"] / reference["val_loss"],
        "samples": swarm["samples"],
        "swarm_steps": swarm["steps"],
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
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", help="keep the swarm's logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    steps = args.steps or (40 if args.quick else 200)
    r = measure(args.config, steps, args.stages, args.log_dir)
    print(f"{r['config']}: {r['samples']} samples; val loss swarm {r['swarm_val_loss']:.4f} "
          f"({r['swarm_steps']} steps, {r['swarm_wall_seconds']:.0f}s), reference {r['reference_val_loss']:.4f} "
          f"({r['reference_steps']} steps, {r['reference_wall_seconds']:.0f}s); "
          f"swarm/reference {r['ratio']:.3f} (goal <= 1.02)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
