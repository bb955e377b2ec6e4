"""Pipeline throughput: a local swarm (2 stages x 1 server, 1 trainer) vs the single-process reference.

Both train the same model with the same batch on this machine, one after the other in one run;
the figure of merit is swarm samples/s divided by reference samples/s.

    .venv/bin/python bench/pipeline.py                 # configs/tiny.yaml and configs/small.yaml
    .venv/bin/python bench/pipeline.py --configs configs/tiny.yaml --swarm-steps 80
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path

from coordinator.local_swarm import LocalSwarm
from swarm.config import RunConfig
from swarm.reference import ReferenceTrainer

STEPS = {"tiny": (60, 80), "small": (6, 10)}  # (reference steps, swarm steps) per config


def measure(config_path: str, ref_steps: int, swarm_steps: int, stages: int, in_flight: int | None = None) -> dict:
    config = RunConfig.load(config_path)
    config.stages.num_stages = stages
    config.validate()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        # The reference runs before and after the swarm, so a change in the machine's load during
        # the run shows up as a gap between the two instead of skewing the ratio unnoticed.
        before = ReferenceTrainer(config).run(ref_steps, eval_max_batches=2)["samples_per_second"]
        swarm = LocalSwarm(str(path), config, servers_per_stage=1, trainers=1, log_dir=str(Path(tmp) / "logs"),
                           metrics_port=None, stop=threading.Event(), in_flight=in_flight).run(swarm_steps)
        after = ReferenceTrainer(config).run(ref_steps, eval_max_batches=2)["samples_per_second"]
    reference = (before + after) / 2
    return {
        "config": config_path,
        "stages": stages,
        "in_flight": in_flight,
        "reference_samples_per_second": reference,
        "reference_before_after": [before, after],
        "swarm_samples_per_second": swarm["samples_per_second"],
        "ratio": swarm["samples_per_second"] / reference,
        "reference_steps": ref_steps,
        "swarm_steps": swarm["steps"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["configs/tiny.yaml", "configs/small.yaml"])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--ref-steps", type=int, help="reference steps (default per config)")
    p.add_argument("--swarm-steps", type=int, help="swarm steps (default per config)")
    p.add_argument("--in-flight", type=int, help="the trainer's micro-batches in flight (default: swarm-peer's)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    results = []
    for path in args.configs:
        ref_steps, swarm_steps = STEPS.get(Path(path).stem, (20, 30))
        result = measure(path, args.ref_steps or ref_steps, args.swarm_steps or swarm_steps, args.stages,
                         args.in_flight)
        results.append(result)
        before, after = result["reference_before_after"]
        print(f"{path}: reference {result['reference_samples_per_second']:.1f} samples/s "
              f"({before:.1f} before, {after:.1f} after the swarm), "
              f"swarm {result['swarm_samples_per_second']:.1f} samples/s, ratio {result['ratio']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
