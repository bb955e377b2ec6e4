"""The low-communication mode against averaging every step: bytes per sample, and the model at equal samples.

For each mode (``every_step``, then ``local`` at each --local-steps H) a local swarm (LocalSwarm: 2 stages
x 2 servers, 2 trainers, separate processes on 127.0.0.1) trains the config until its slowest stage reaches
--steps (default: the whole schedule, optimizer.total_steps; in the local mode a server's inner steps count,
so both modes run as many steps per sample). Measured per mode, side by side in one run:

- bytes the stage's servers sent in averaging rounds per sample they served
  (swarm_averaging_bytes_sent_total / swarm_server_samples_total, summed over each stage's servers);
  goal: local at H = 50 with float16 pseudo-gradients <= 1/30 of every_step's;
- the validation loss of the stages' newest checkpoints (in the local mode the slow weights of the last
  outer step: what a newcomer, a checkpoint and swarm-export take), against the single-process reference
  trained on as many samples as those steps took (each stage's servers' step logs); the mode's ratio
  to every_step's is the figure (goal: <= 1.03 at the end of tiny.yaml's schedule);
- the trainers' samples/s (on 2 shared cores compute dominates, so little changes: the speed goal is
  for slow links, bench/wan.py's lab);
- the state downloads the servers made after they joined (a replica behind or apart takes the stage's state:
  with 8-bit pseudo-gradients the members' slow weights differ by a rounding after each round, and a download
  costs more than many rounds).

--codecs runs each H with each pseudo-gradient codec, --error-feedback with it on and/or off.

    .venv/bin/python bench/lowcomm.py                          # tiny.yaml, every_step vs local H = 16 and 50
    .venv/bin/python bench/lowcomm.py --local-steps 50 --steps 100
    .venv/bin/python bench/lowcomm.py --config configs/small.yaml --steps 100
    .venv/bin/python bench/lowcomm.py --local-steps 16 --outer-momentum 0.5   # the outer constants
    .venv/bin/python bench/lowcomm.py --local-steps 50 --codecs float16 float8 --error-feedback on off
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convergence import reference_curve, stepped_samples  # noqa: E402
from coordinator.local_swarm import LocalSwarm  # noqa: E402
from swarm.checkpoint.store import StageCheckpoints  # noqa: E402
from swarm.config import COMPRESSIONS, RunConfig  # noqa: E402
from swarm.reference import ReferenceTrainer  # noqa: E402
from swarm.state import PARAM  # noqa: E402

OUTER_LINE = re.compile(r"stage (\d+) outer step (\d+) at inner step \d+ .*; (\d+) in this server's outer steps")


def outer_samples(log_dir: Path, stage: int, step: int) -> int | None:
    """The samples in stage `stage`'s outer steps up to `step`, from its servers' logs (the largest count: a server
    that took every one)."""
    counts = [int(m[3]) for log in log_dir.glob(f"server-{stage}-*.log")
              for m in OUTER_LINE.finditer(log.read_text(errors="replace")) if int(m[1]) == stage and int(m[2]) == step]
    return max(counts) if counts else None


def newest_model(config: RunConfig, logs: Path, local: bool) -> tuple[ReferenceTrainer, list[int], list[int]]:
    """The model of each stage's newest checkpoint (any server's), each stage's step there and the samples its
    steps up to there took."""
    model, steps, samples = ReferenceTrainer(config), [], []
    for stage, module in enumerate(model.stages):
        found = []
        for server in sorted((logs / "checkpoints").glob(f"server-{stage}-*")):
            store = StageCheckpoints(server, config.run_id, stage, config.checkpoint.keep)
            found += [(int(p.name.removeprefix("step")), p, store) for p in store.dir.glob("step*") if p.is_dir()]
        # (the newest whose samples a log line says: a server logs every outer step, and every 10th other step)
        samples_at = outer_samples if local else stepped_samples
        counted = [(step, path, store, samples_at(logs, stage, step)) for step, path, store in found]
        counted = [c for c in counted if c[3] is not None]
        if not counted:
            raise SystemExit(f"no checkpoint of stage {stage} with a step log line of its step (see {logs})")
        step, path, store, count = max(counted, key=lambda f: f[0])
        _, _, tensors = store.load(path, state_hash=config.state_hash())
        module.load_state_dict({k[len(PARAM):]: t for k, t in tensors.items() if k.startswith(PARAM)})
        steps.append(step)
        samples.append(count)
    return model, steps, samples


def run_mode(base: RunConfig, name: str, local_steps: int | None, steps: int, log_root: Path,
             codec: str | None = None, error_feedback: bool = True) -> dict:
    config = copy.deepcopy(base)
    if local_steps is not None:
        config.averaging.mode, config.averaging.local_steps = "local", local_steps
        config.averaging.pseudo_gradient_compression = codec or config.averaging.pseudo_gradient_compression
        config.averaging.pseudo_gradient_error_feedback = error_feedback
        config.checkpoint.every_steps = 1  # (outer steps)
    else:
        config.checkpoint.every_steps = 10  # (where servers log their step)
    config.checkpoint.every_seconds = 0.0
    config.validate()
    logs = log_root / name
    path = log_root / f"{name}.yaml"
    config.save(path)
    swarm = LocalSwarm(str(path), config, servers_per_stage=2, trainers=2, log_dir=str(logs), metrics_port=None,
                       stop=threading.Event()).run(steps)
    model, at, samples = newest_model(config, logs, local_steps is not None)
    return {"mode": name, "config": config, "val_loss": model.evaluate(), "checkpoint_steps": at,
            "samples_per_stage": samples, "bytes_per_sample": swarm["averaging_bytes_per_sample"],
            "samples_per_second": swarm["samples_per_second"], "trainer_samples": swarm["samples"],
            "wall_seconds": swarm["wall_seconds"], "state_downloads": state_downloads(logs)}


def state_downloads(logs: Path) -> int:
    """The catch-ups the servers logged (a state taken from the stage after joining it)."""
    return sum(text.count("caught up with its peers")
               for text in (f.read_text(errors="replace") for f in logs.rglob("*.log")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, help="steps of the slowest stage (default: optimizer.total_steps)")
    p.add_argument("--local-steps", type=int, nargs="+", default=[16, 50], help="H of each local run")
    p.add_argument("--outer-lr", type=float, help="averaging.outer_lr of the local runs (default: the config's)")
    p.add_argument("--outer-momentum", type=float, help="averaging.outer_momentum of the local runs")
    p.add_argument("--codecs", nargs="+", choices=COMPRESSIONS,
                   help="averaging.pseudo_gradient_compression of the local runs, each in turn (default: the config's)")
    p.add_argument("--error-feedback", nargs="+", choices=["on", "off"], default=["on"],
                   help="averaging.pseudo_gradient_error_feedback of the local runs, each in turn")
    p.add_argument("--log-dir", help="keep the swarms' logs and checkpoints here (default: a temporary directory)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    base = RunConfig.load(args.config)
    base.stages.num_stages = 2
    base.checkpoint.keep = 1000
    if args.outer_lr is not None:
        base.averaging.outer_lr = args.outer_lr
    if args.outer_momentum is not None:
        base.averaging.outer_momentum = args.outer_momentum
    steps = args.steps or base.optimizer.total_steps
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-lowcomm-") as tmp:
        root = Path(args.log_dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs = [run_mode(base, "every_step", None, steps, root)]
        codecs = args.codecs or [base.averaging.pseudo_gradient_compression]
        runs += [run_mode(base, f"local_H{h}_{codec}" + ("" if feedback == "on" else "_noEF"), h, steps, root, codec,
                          feedback == "on")
                 for h in args.local_steps for codec in codecs for feedback in args.error_feedback]
    wanted = sorted({max(1, round(sum(r["samples_per_stage"]) / 2 / base.optimizer.batch_size)) for r in runs})
    reference = reference_curve(base.validate(), wanted)
    every = runs[0]
    print(f"{args.config}, batch {base.optimizer.batch_size}, 2 stages x 2 servers, 2 trainers, {steps} steps of the "
          f"slowest stage:")
    for r in runs:
        ref_steps = max(1, round(sum(r["samples_per_stage"]) / 2 / base.optimizer.batch_size))
        r["reference_steps"], r["reference_val_loss"] = ref_steps, reference[ref_steps]
        r["ratio"] = r["val_loss"] / reference[ref_steps]
        per_sample = [round(b / e, 4) if b is not None and e else None
                      for b, e in zip(r["bytes_per_sample"], every["bytes_per_sample"])]
        print(f"  {r['mode']}: averaging bytes per sample by stage {r['bytes_per_sample']} "
              f"(/ every_step {per_sample}); checkpoint of step {r['checkpoint_steps']} with "
              f"{r['samples_per_stage']} samples: val loss {r['val_loss']:.4f}, reference at equal samples "
              f"({ref_steps} steps) {reference[ref_steps]:.4f}, ratio {r['ratio']:.3f} "
              f"(/ every_step's {r['ratio'] / every['ratio']:.3f}); {r['samples_per_second']:.1f} samples/s "
              f"(/ every_step {r['samples_per_second'] / every['samples_per_second']:.2f}); "
              f"{r['state_downloads']} state downloads after joining; {r['wall_seconds']:.0f}s", flush=True)
    if args.json:
        for r in runs:
            r.pop("config")
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
