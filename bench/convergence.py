"""Convergence over a whole run: a local swarm (2 stages x 2 servers, 2 trainers) vs one process, at equal samples.

The swarm (LocalSwarm: coordinator, servers and trainers as separate processes on 127.0.0.1)
trains until its slowest stage reaches --steps (default: the config's whole schedule,
optimizer.total_steps). Its servers write a checkpoint every --every steps (50), and their step log
says how many samples their steps took so far. After the run, the model of each measured step
(--at: 50 and the last) is put together from the stages' checkpoints of exactly that step and
evaluated on the fixed validation windows.

The single-process ReferenceTrainer then trains on as many samples as the swarm's steps took up to
each point (a swarm step can take more than a batch: the samples that come while its round runs
count towards the next step), in steps of one batch, with the same optimizer; and, where that is not
AdamW at beta1 0.9 (the default), once more with it.
Printed for each point: swarm / reference (goals on configs/tiny.yaml at batch 16 and 128: <= 1.03
at step 50, <= 1.02 at the end of the schedule) and swarm / AdamW reference (goal <= 1.00 at the
end); also the reference at equal steps, and the share of samples that came one step late.

The reference draws its micro-batches in turn from the windows of as many trainers as the swarm has (the
same sampler seeds): both train on the same windows. Other windows alone move tiny.yaml's validation
loss by up to 6% at the end (trainer seeds 0-3, one stream each: 2.289-2.446), more than the goals
allow; before 2026-12-07 the reference drew from trainer 0's windows alone, whatever the swarm's.
Exact training on those same windows moves too, when micro-batches fall into other steps (one step of
24 samples instead of 16 moved the end by up to 2%): --orderings (4) trains the reference again on
them in seeded random orders, and prints the spread of these exact runs around their mean beside the
swarm's ratio to that mean. A swarm within that spread is as good as exact training can be told apart.

What can make them differ: the order micro-batches fall into steps, larger steps, and stale
gradients. Samples a server takes while its stage's round runs beside compute are one step late
(computed on the parameters that step is about to make with look-ahead, the default); a micro-batch
whose stage steps between its forward and its backward is computed on the parameters its forward
used (weight stashing). Averaging itself is exact: with one server per stage, one
trainer and one micro-batch in flight the swarm reproduces the reference to the last digit.

    .venv/bin/python bench/convergence.py                        # configs/tiny.yaml, batch 16, 300 steps
    .venv/bin/python bench/convergence.py --batch-size 128       # 16 micro-batches a step
    .venv/bin/python bench/convergence.py --quick                # 50 steps
    .venv/bin/python bench/convergence.py --servers-per-stage 1 --trainers 1 --in-flight 1 --quick
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import tempfile
import threading
import time
from pathlib import Path

import torch

from coordinator.local_swarm import LocalSwarm
from swarm.checkpoint.store import StageCheckpoints
from swarm.config import RunConfig
from swarm.reference import ReferenceTrainer
from swarm.state import PARAM

STEP_LINE = re.compile(r"stage (\d+) step (\d+) \(.*; (\d+) in this server's steps since it started\)")


def stepped_samples(log_dir: Path, stage: int, step: int) -> int | None:
    """The samples stage `stage`'s steps up to `step` took, from its servers' step logs (a server that caught up
    by download saw fewer of them: the largest count is of one that took every step)."""
    counts = []
    for log in log_dir.glob(f"server-{stage}-*.log"):
        for m in STEP_LINE.finditer(log.read_text(errors="replace")):
            if int(m[1]) == stage and int(m[2]) == step:
                counts.append(int(m[3]))
    return max(counts) if counts else None


def swarm_model_at(config: RunConfig, checkpoints: Path, step: int) -> ReferenceTrainer | None:
    """The swarm's model at `step`: every stage from a server's checkpoint of that step (None if a stage has none)."""
    model = ReferenceTrainer(config)  # (its stages, chained and evaluated as the reference's are)
    for stage, module in enumerate(model.stages):
        for server in sorted(checkpoints.glob(f"server-{stage}-*")):
            store = StageCheckpoints(server, config.run_id, stage, config.checkpoint.keep)
            path = store.dir / f"step{step:010d}"
            if path.is_dir():
                _, _, tensors = store.load(path, state_hash=config.state_hash())
                module.load_state_dict({k[len(PARAM):]: t for k, t in tensors.items() if k.startswith(PARAM)})
                break
        else:
            return None
    return model


def reference_curve(config: RunConfig, at_steps: list[int], trainers: int,
                    order_seed: int | None = None) -> dict[int, float]:
    """Validation loss of the single-process reference after each of `at_steps` steps, on the windows of the swarm's
    `trainers` (`order_seed`: their micro-batches in a seeded random order, not in turn)."""
    reference, losses = ReferenceTrainer(config, trainers=trainers, order_seed=order_seed), {}
    for step in range(1, max(at_steps) + 1):
        reference.train_step()
        if step in at_steps:
            losses[step] = reference.evaluate()
    return losses


def adamw(config: RunConfig) -> RunConfig:
    """The same run with plain AdamW (beta1 0.9, no look-ahead): the baseline whatever the run's optimizer."""
    other = copy.deepcopy(config)
    other.optimizer.name, other.optimizer.beta1, other.optimizer.lookahead = "adamw", 0.9, False
    return other.validate()


def measure(config_path: str, steps: int | None, at: list[int], every: int, stages: int, log_dir: str | None,
            servers_per_stage: int = 2, trainers: int = 2, in_flight: int | None = None,
            batch_size: int | None = None, orderings: int = 0) -> dict:
    config = RunConfig.load(config_path)
    config.stages.num_stages = stages
    if batch_size is not None:
        config.optimizer.batch_size = batch_size
    steps = steps or config.optimizer.total_steps
    points = sorted({p for p in at if 0 < p < steps} | {steps})
    config.checkpoint.every_steps = every
    config.checkpoint.every_seconds = 0.0  # (only the steps the points are at)
    config.checkpoint.keep = 10 * (steps // every + 2)  # (a stage may run well past the slowest one meanwhile)
    config.validate()
    if any(p % every for p in points):
        raise SystemExit(f"every point ({points}) must be a multiple of --every {every}: checkpoints are written there")
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        logs = Path(log_dir or Path(tmp) / "logs")
        swarm = LocalSwarm(str(path), config, servers_per_stage=servers_per_stage, trainers=trainers,
                           log_dir=str(logs), metrics_port=None, stop=threading.Event(), in_flight=in_flight).run(steps)
        rows = []
        for p in points:
            model = swarm_model_at(config, logs / "checkpoints", p)
            samples = [stepped_samples(logs, k, p) for k in range(stages)]
            if model is None or None in samples:
                raise SystemExit(f"no checkpoint or step log line of step {p} for every stage (see {logs})")
            rows.append({"step": p, "swarm_val_loss": model.evaluate(), "samples_per_stage": samples})
    started = time.monotonic()
    for row in rows:  # the reference at equal samples: the stages' mean (they differ by a micro-batch or two)
        row["reference_steps"] = max(1, round(sum(row["samples_per_stage"]) / stages / config.optimizer.batch_size))
    wanted = sorted({r["reference_steps"] for r in rows} | set(points))
    same = reference_curve(config, wanted, trainers)
    plain = (config.optimizer.name, config.optimizer.beta1) == ("adamw", 0.9)  # (look-ahead: nothing in one process)
    before = same if plain else reference_curve(adamw(config), wanted, trainers)
    # the same windows in other orders: how far exact training moves when micro-batches fall into other steps
    # (one trainer's windows have one order: nothing to spread)
    others = [reference_curve(config, wanted, trainers, order_seed=seed)
              for seed in range(1, orderings + 1 if trainers > 1 else 1)]
    for row in rows:
        n = row["reference_steps"]
        row.update(reference_val_loss=same[n], adamw_val_loss=before[n], ratio=row["swarm_val_loss"] / same[n],
                   ratio_adamw=row["swarm_val_loss"] / before[n],
                   ratio_equal_steps=row["swarm_val_loss"] / same[row["step"]])
        if others:
            losses = [same[n]] + [curve[n] for curve in others]
            mean = sum(losses) / len(losses)
            row.update(orderings_val_loss=losses, ratio_orderings_mean=row["swarm_val_loss"] / mean,
                       orderings_spread=[min(losses) / mean, max(losses) / mean])
    return {
        "config": config_path, "optimizer": config.optimizer.name, "lookahead": config.optimizer.lookahead,
        "batch_size": config.optimizer.batch_size, "servers_per_stage": servers_per_stage, "trainers": trainers,
        "in_flight": in_flight, "points": rows, "trainer_samples": swarm["samples"],
        "through_swarm_val_loss": swarm["val_loss"], "through_swarm_steps": swarm["model_steps"],
        **{key: swarm[key] for key in ("late_share", "stale_share", "stale2_share", "behind_share", "early_share",
                                       "round_seconds", "round_start_seconds")},
        "swarm_wall_seconds": swarm["wall_seconds"], "reference_wall_seconds": time.monotonic() - started,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, help="swarm steps of the slowest stage (default: optimizer.total_steps; "
                                             "--quick: 50)")
    p.add_argument("--at", default="50", help="comma-separated steps to measure at besides the last (default 50)")
    p.add_argument("--every", type=int, default=50, help="checkpoint every this many steps (the points' divisor)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--servers-per-stage", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--in-flight", type=int, help="each trainer's micro-batches in flight (default: the trainers')")
    p.add_argument("--batch-size", type=int, help="override the config's optimizer.batch_size")
    p.add_argument("--orderings", type=int, default=4,
                   help="also train the reference this many times more on the same windows in other (seeded random) "
                        "orders: the spread exact training itself shows (0: none)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", help="keep the swarm's logs and checkpoints here (default: a temporary directory)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    at = [int(x) for x in args.at.split(",") if x.strip()]
    torch.manual_seed(0)
    r = measure(args.config, 50 if args.quick and not args.steps else args.steps, at, args.every, args.stages,
                args.log_dir, args.servers_per_stage, args.trainers, args.in_flight, args.batch_size,
                args.orderings)
    in_flight = "default" if r["in_flight"] is None else r["in_flight"]
    print(f"{r['config']} ({r['optimizer']}{' + look-ahead' if r['lookahead'] else ''}, batch {r['batch_size']}; "
          f"{args.stages} stages x {r['servers_per_stage']} servers, {r['trainers']} trainers, in flight {in_flight}; "
          f"swarm {r['swarm_wall_seconds']:.0f}s, references {r['reference_wall_seconds']:.0f}s): "
          f"share of samples one step late per stage {r['late_share']}; backwards a step stale {r['stale_share']}, "
          f"two or more {r['stale2_share']}; gradients of parameters a step or more behind their step's "
          f"{r['behind_share']}, a step early {r['early_share']}; mean round {r['round_seconds']} s, group formed "
          f"after {r['round_start_seconds']} s", flush=True)
    for row in r["points"]:
        print(f"  step {row['step']}: swarm {row['swarm_val_loss']:.4f} ({row['samples_per_stage']} samples by stage); "
              f"reference at equal samples ({row['reference_steps']} steps) {row['reference_val_loss']:.4f}, "
              f"AdamW {row['adamw_val_loss']:.4f}; swarm/reference {row['ratio']:.3f}, "
              f"swarm/AdamW reference {row['ratio_adamw']:.3f}, swarm/reference at equal steps "
              f"{row['ratio_equal_steps']:.3f}", flush=True)
        if "orderings_val_loss" in row:
            low, high = row["orderings_spread"]
            print(f"    the reference on the same windows in {len(row['orderings_val_loss'])} orders: "
                  f"{min(row['orderings_val_loss']):.4f}-{max(row['orderings_val_loss']):.4f}, {low:.3f}-{high:.3f} "
                  f"of their mean; swarm / their mean {row['ratio_orderings_mean']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
