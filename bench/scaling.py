"""What replication costs beyond compute: 2 servers per stage and 2 trainers vs 1 and 1, same machine.

Two local swarms (LocalSwarm: coordinator, servers and trainers as separate processes on
127.0.0.1) train the same config (2 stages) one after the other, on the same cores:

    single:     2 stages x 1 server,  1 trainer
    replicated: 2 stages x 2 servers, 2 trainers (every stage averages its replicas each step)

Both have the same cores, so the replicated swarm has no more compute; it can only lose speed to
averaging, matchmaking and the extra processes. Like for like: both keep the same micro-batches in
flight in all (the single trainer twice the default of each of the two), and both are timed over one
window, from a tenth of the steps to the last (start-up left out), as the samples all trainers
trained in it over its seconds. The figure of merit is replicated samples/s / single samples/s:
configs/tiny.yaml at batch 16 (two micro-batches a step: a round every ~0.1 s of compute) and at
batch 128 (goals >= 0.6 and >= 0.85), configs/small.yaml at its batch 64 (goal >= 0.85). Beside it,
the CPU seconds per sample each role spent in the window, the servers' split into their compute
threads' and the rest (RPCs, the DHT, averaging, p2pd): what replication costs the machine. Each
repeat runs the pair in alternating order, so a drift in the machine's load shows up between
repeats instead of skewing one side.

    .venv/bin/python bench/scaling.py                    # tiny.yaml at 16 and 128, small.yaml at 64, 2 repeats
    .venv/bin/python bench/scaling.py --quick            # 1 repeat, fewer steps
    .venv/bin/python bench/scaling.py --configs configs/tiny.yaml --batch-sizes 128 --repeats 3
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
from swarm.trainer import default_in_flight

STEPS = {("tiny", 16): 100, ("tiny", 128): 24, ("small", 64): 8}  # optimizer steps per swarm: ~15-60 s on 2 cores
GOALS = {("tiny", 16): 0.6, ("tiny", 128): 0.85, ("small", 64): 0.85}
SHAPES = {"single": (1, 1), "replicated": (2, 2)}  # (servers per stage, trainers)
BATCHES = {"tiny": [16, 128]}  # batch sizes measured by default (other configs: their own)


def run_swarm(config: RunConfig, shape: str, steps: int, log_root: Path, repeat: int = 0) -> dict:
    servers, trainers = SHAPES[shape]
    in_flight = default_in_flight(config) * max(SHAPES[s][1] for s in SHAPES) // trainers  # the same in all
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        # (a directory per repeat: each run's checkpoints are in it, and a run would resume from the last one's)
        logs = log_root / f"{config.run_id}-b{config.optimizer.batch_size}-{shape}-{repeat}"
        summary = LocalSwarm(str(path), config, servers_per_stage=servers, trainers=trainers, log_dir=str(logs),
                             metrics_port=None, stop=threading.Event(), in_flight=in_flight).run(steps)
    window = summary["window"]
    if window is None:
        raise SystemExit(f"{shape}: no timing window (no samples between a tenth of the steps and the last)")
    cpu = ", ".join(f"{role} {value * 1000:.1f}" for role, value in sorted(window["cpu_seconds_per_sample"].items()))
    print(f"  {config.run_id} batch {config.optimizer.batch_size}, {shape} ({in_flight} in flight per trainer): "
          f"{window['samples_per_second']:.1f} samples/s ({window['samples']:.0f} samples in {window['seconds']:.1f}s; "
          f"CPU ms per sample: {cpu}; cores busy {window['cpu_busy_share']:.0%}; val loss {summary['val_loss']:.3f} "
          f"after {min(summary['model_steps'])} steps; share of samples one step late per stage "
          f"{summary['late_share']}; mean round {summary['round_seconds']} s, of which group formation "
          f"{summary['round_start_seconds']} s)", flush=True)
    return summary


def measure(config_path: str, batch_size: int | None, repeats: int, steps: int | None, log_root: Path,
            quick: bool = False) -> dict:
    config = RunConfig.load(config_path)
    config.stages.num_stages = 2
    if batch_size is not None:
        config.optimizer.batch_size = batch_size
    config.validate()
    key = (Path(config_path).stem, config.optimizer.batch_size)
    steps = steps or max(2, STEPS.get(key, 30) // (2 if quick else 1))
    runs: dict[str, list[dict]] = {shape: [] for shape in SHAPES}
    for repeat in range(repeats):
        order = list(SHAPES) if repeat % 2 == 0 else list(reversed(SHAPES))
        for shape in order:
            runs[shape].append(run_swarm(config, shape, steps, log_root, repeat)["window"])
    speeds = {shape: [w["samples_per_second"] for w in windows] for shape, windows in runs.items()}
    single, replicated = statistics.median(speeds["single"]), statistics.median(speeds["replicated"])
    cpu = {shape: {role: statistics.median(w["cpu_seconds_per_sample"].get(role, 0.0) for w in windows)
                   for role in windows[0]["cpu_seconds_per_sample"]} for shape, windows in runs.items()}
    return {"config": config_path, "batch_size": config.optimizer.batch_size, "steps": steps, "speeds": speeds,
            "single": single, "replicated": replicated, "ratio": replicated / single, "goal": GOALS.get(key),
            "cpu_seconds_per_sample": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["configs/tiny.yaml", "configs/small.yaml"])
    p.add_argument("--batch-sizes", type=int, nargs="+",
                   help="batch sizes for every config (default: 16 and 128 for tiny.yaml, the config's own for others)")
    p.add_argument("--repeats", type=int, help="pairs of runs per batch size (default 2; --quick: 1)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default per config and batch size)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", help="keep the swarms' logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-logs-") as tmp:
        log_root = Path(args.log_dir or tmp)
        for config_path in args.configs:
            for batch in args.batch_sizes or BATCHES.get(Path(config_path).stem, [None]):
                r = measure(config_path, batch, repeats, args.steps, log_root, args.quick)
                results.append(r)
                goal = f" (goal >= {r['goal']})" if r["goal"] else ""
                extra = {shape: r["cpu_seconds_per_sample"][shape].get("server_outside_compute", 0.0)
                         + r["cpu_seconds_per_sample"][shape].get("trainer", 0.0)
                         + r["cpu_seconds_per_sample"][shape].get("coordinator", 0.0) for shape in SHAPES}
                print(f"{config_path} batch {r['batch_size']}: "
                      f"2x2 servers + 2 trainers {r['replicated']:.1f} samples/s, "
                      f"2x1 + 1 trainer {r['single']:.1f} samples/s (medians of {repeats}, one window each): "
                      f"ratio {r['ratio']:.2f}{goal}; CPU ms per sample outside stage compute (servers' other "
                      f"threads and processes, trainers, coordinator) {extra['replicated'] * 1000:.1f} vs "
                      f"{extra['single'] * 1000:.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
