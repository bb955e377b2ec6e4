"""What replication costs beyond compute: 2 servers per stage and 2 trainers vs 1 and 1, same machine.

Two local swarms (LocalSwarm: coordinator, servers and trainers as separate processes on
127.0.0.1) train configs/tiny.yaml one after the other, on the same cores:

    single:     2 stages x 1 server,  1 trainer
    replicated: 2 stages x 2 servers, 2 trainers (every stage averages its replicas each step)

Both have the same cores, so the replicated swarm has no more compute; it can only lose speed to
averaging, matchmaking and the extra processes. The figure of merit is replicated samples/s /
single samples/s, at batch 16 (two micro-batches a step: a round every ~0.1 s of compute) and at
batch 128 (goals >= 0.6 and >= 0.85). Each repeat runs the pair in alternating order, so a drift
in the machine's load shows up between repeats instead of skewing one side. The trainers keep
their default micro-batches in flight (a quarter of a batch).

    .venv/bin/python bench/scaling.py                    # batch 16 and 128, 2 repeats (~12 minutes)
    .venv/bin/python bench/scaling.py --quick            # 1 repeat, fewer steps (~5 minutes)
    .venv/bin/python bench/scaling.py --batch-sizes 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
from pathlib import Path

from coordinator.local_swarm import LocalSwarm
from swarm.config import RunConfig

STEPS = {16: 100, 128: 24}  # optimizer steps per swarm: ~15-30 s of training on 2 cores
GOALS = {16: 0.6, 128: 0.85}
SHAPES = {"single": (1, 1), "replicated": (2, 2)}  # (servers per stage, trainers)


def run_swarm(config: RunConfig, shape: str, steps: int, log_root: Path, repeat: int = 0) -> dict:
    servers, trainers = SHAPES[shape]
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        # (a directory per repeat: each run's checkpoints are in it, and a run would resume from the last one's)
        logs = log_root / f"b{config.optimizer.batch_size}-{shape}-{repeat}"
        summary = LocalSwarm(str(path), config, servers_per_stage=servers, trainers=trainers, log_dir=str(logs),
                             metrics_port=None, stop=threading.Event()).run(steps)
    print(f"  batch {config.optimizer.batch_size}, {shape}: {summary['samples_per_second']:.1f} samples/s "
          f"(val loss {summary['val_loss']:.3f} after {min(summary['model_steps'])} steps; share of samples one "
          f"step late per stage {summary['late_share']}; mean round {summary['round_seconds']} s, of which "
          f"group formation {summary['round_start_seconds']} s)", flush=True)
    return summary


def measure(config_path: str, batch_size: int, repeats: int, steps: int, log_root: Path) -> dict:
    config = RunConfig.load(config_path)
    config.optimizer.batch_size = batch_size
    config.validate()
    speeds: dict[str, list[float]] = {shape: [] for shape in SHAPES}
    for repeat in range(repeats):
        order = list(SHAPES) if repeat % 2 == 0 else list(reversed(SHAPES))
        for shape in order:
            speeds[shape].append(run_swarm(config, shape, steps, log_root, repeat)["samples_per_second"])
    single, replicated = statistics.median(speeds["single"]), statistics.median(speeds["replicated"])
    return {"config": config_path, "batch_size": batch_size, "steps": steps, "speeds": speeds,
            "single": single, "replicated": replicated, "ratio": replicated / single, "goal": GOALS.get(batch_size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--repeats", type=int, help="pairs of runs per batch size (default 2; --quick: 1)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default per batch size)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", help="keep the swarms' logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-logs-") as tmp:
        log_root = Path(args.log_dir or tmp)
        for batch in args.batch_sizes:
            steps = args.steps or STEPS.get(batch, 30) // (2 if args.quick else 1)
            r = measure(args.config, batch, repeats, steps, log_root)
            results.append(r)
            goal = f" (goal >= {r['goal']})" if r["goal"] else ""
            print(f"{args.config} batch {batch}: "
                  f"2x2 servers + 2 trainers {r['replicated']:.1f} samples/s, "
                  f"1x2 + 1 trainer {r['single']:.1f} samples/s (medians of {repeats}): "
                  f"ratio {r['ratio']:.2f}{goal}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
