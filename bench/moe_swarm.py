"""bench/moe.py --part swarm: an MoE swarm (experts on expert servers) vs the MoE reference trainer.

The swarm is `swarm-local` run as a program (coordinator, one server per stage, --expert-servers
expert servers with the experts dealt out, one trainer), trained until the swarm's step (its
slowest stage's, as announced in the DHT) reaches `steps`; it writes its summary, whose validation
loss is measured through the swarm on the first EVAL_BATCHES validation windows. The announced
step lags the stages by up to an announce period, so the stages usually stop a few steps past
`steps`: the summary's model_steps are the stages' steps when the validation loss was measured.

The reference (swarm.reference.ReferenceTrainer of the same config: same seed, same sampler seed
as trainer 0, the experts kept apart with their own optimizers as expert servers keep them) then
trains in this process up to the most steps any stage of the swarm took, and is evaluated with
ReferenceTrainer.evaluate (the same eval_batches windows, the same count) at `steps` and at each
stage step of the swarm. The ratio that counts compares the swarm with the reference after the
same optimizer steps, that is the same samples applied (steps x batch_size); the one at `steps`
is printed beside it. The swarm's samples are those its trainer reports (micro-batches finished,
including those whose stage step has not come yet); the reference's are steps x batch_size.

swarm-local gives every server a checkpoint directory of its own in its log directory; it runs
here with XDG_CACHE_HOME set to a fresh directory there as well, so nothing it starts can resume
from what earlier runs or tests of the same run id left in ~/.cache/swarm/checkpoints.

The two run one after the other, never at once; the swarm's programs get OMP_NUM_THREADS=1, the
reference uses this process's torch threads (printed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from moe_churn import OthersCpu

from swarm.config import RunConfig
from swarm.reference import EVAL_BATCHES, FINAL_LOSS_WINDOW, ReferenceTrainer

ROOT = Path(__file__).resolve().parent.parent


def run_swarm(config_path: str, steps: int, expert_servers: int, log_dir: Path) -> dict:
    """`swarm-local` as a program; its JSON summary, plus the wall time of the whole program."""
    summary_path = log_dir / "summary.json"
    cmd = [sys.executable, "-m", "coordinator.local", "--config", config_path, "--steps", str(steps),
           "--expert-servers", str(expert_servers), "--summary", str(summary_path), "--log-dir", str(log_dir / "swarm")]
    started, others = time.monotonic(), OthersCpu()
    with open(log_dir / "swarm-local.out", "wb") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(log_dir / "cache")},
                              check=False)
    if proc.returncode != 0 or not summary_path.exists():
        tail = (log_dir / "swarm-local.out").read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"swarm-local failed (exit {proc.returncode}):\n  " + "\n  ".join(tail))
    summary = json.loads(summary_path.read_text())
    summary["program_seconds"] = time.monotonic() - started
    summary["others_cpu"] = others.share()
    return summary


def run_reference(config: RunConfig, eval_at: list[int]) -> dict:
    """Train the reference to max(eval_at) steps, evaluating after each step count in eval_at."""
    others = OthersCpu()
    trainer = ReferenceTrainer(config)
    losses, seconds, val = [], 0.0, {}
    for step in range(1, max(eval_at) + 1):
        started = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
        seconds += time.perf_counter() - started
        if step in eval_at:
            val[step] = trainer.evaluate(EVAL_BATCHES)
    samples = max(eval_at) * config.optimizer.batch_size
    last = losses[-FINAL_LOSS_WINDOW:]
    return {"val_loss": val, "final_loss": sum(last) / len(last), "samples": samples, "train_seconds": seconds,
            "samples_per_second": samples / seconds, "torch_threads": torch.get_num_threads(),
            "others_cpu": others.share()}


def measure(config_path: str, steps: int, expert_servers: int, log_dir: str | None = None) -> dict:
    config = RunConfig.load(config_path)
    moe = config.model.moe
    if moe is None or not moe.expert_servers:
        raise SystemExit(f"{config_path}: --part swarm needs model.moe.expert_servers (experts on expert servers)")
    with tempfile.TemporaryDirectory(prefix="bench-moe-swarm-") as tmp:
        logs = Path(log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        print(f"swarm: swarm-local, {config.stages.num_stages} stages x 1 server, {expert_servers} expert servers, "
              f"1 trainer, {steps} steps (logs: {logs})...", flush=True)
        swarm = run_swarm(config_path, steps, expert_servers, logs)
    model_steps = [int(s) for s in swarm["model_steps"]]
    applied = max(model_steps)
    print(f"reference: training {applied} steps in this process...", flush=True)
    reference = run_reference(config, sorted({steps, *model_steps}))
    return {"config": config_path, "steps": steps, "expert_servers": expert_servers,
            "batch_size": config.optimizer.batch_size, "swarm": swarm, "reference": reference,
            "model_steps": model_steps, "compared_at": applied,
            "val_loss_ratio": swarm["val_loss"] / reference["val_loss"][applied],
            "val_loss_ratio_at_steps": swarm["val_loss"] / reference["val_loss"][steps],
            "speed_ratio": swarm["samples_per_second"] / reference["samples_per_second"]}


def report(r: dict) -> None:
    s, ref, batch = r["swarm"], r["reference"], r["batch_size"]
    steps, at = r["steps"], r["compared_at"]
    print(f"{r['config']}: MoE swarm ({r['expert_servers']} expert servers) vs MoE reference, "
          f"{EVAL_BATCHES} validation micro-batches (the same windows)", flush=True)
    print(f"  {'':<30} {'samples':>8} {'val loss':>9} {'train loss':>11} {'samples/s':>10} {'train s':>8}")
    print(f"  {'swarm (stage steps ' + ','.join(map(str, r['model_steps'])) + ')':<30} {s['samples']:>8} "
          f"{s['val_loss']:>9.4f} {_num(s['final_loss']):>11} {s['samples_per_second']:>10.1f} "
          f"{s['train_seconds']:>8.0f}")
    for step in sorted(ref["val_loss"]):
        train = f"{ref['final_loss']:>11.3f}" if step == max(ref["val_loss"]) else f"{'':>11}"
        speed = (f"{ref['samples_per_second']:>10.1f} {ref['train_seconds']:>8.0f}"
                 if step == max(ref["val_loss"]) else "")
        print(f"  {f'reference ({step} steps)':<30} {step * batch:>8} {ref['val_loss'][step]:>9.4f} {train} {speed}")
    print("  (the swarm's samples: as its trainer last published them; the reference's: steps x batch size)")
    print(f"  swarm / reference val loss after the same steps ({at}, {at * batch} samples applied): "
          f"{r['val_loss_ratio']:.3f}  (goal <= 1.03)", flush=True)
    if at != steps:
        print(f"  (vs the reference at {steps} steps, the target the swarm overshot: "
              f"{r['val_loss_ratio_at_steps']:.3f})")
    print(f"  samples/s swarm / reference: {r['speed_ratio']:.2f} (reference on {ref['torch_threads']} torch "
          f"threads; swarm-local took {s['program_seconds']:.0f} s in all, start-up and validation included)",
          flush=True)
    print(f"  other programs on this machine took {100 * s['others_cpu']:.0f}% / {100 * ref['others_cpu']:.0f}% of "
          f"its {os.cpu_count()} cores while the swarm / the reference ran", flush=True)


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3f}"
