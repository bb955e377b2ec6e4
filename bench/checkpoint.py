"""Stage checkpoints: writing and loading one, beside copying and reading the same bytes on the same disk.

One stage of configs/small.yaml (stage 1: about 6.3M parameters) after one AdamW step on random
gradients, so its moments exist; its state is packed as docs/checkpoints.md says (``param/<name>``,
``optim/<i>/<slot>``). In a temporary directory, per repeat and side by side:

- write: StageCheckpoints.write (serialize, fsync, sha256, manifest, atomic rename, prune);
- copy: shutil.copyfile of the state file it wrote, then fsync: the disk's cost for those bytes;
- load: StageCheckpoints.load (manifest checks, size and sha256 of every file, safetensors read,
  finiteness of every float tensor);
- read: a plain read of the state file (from the page cache, like the load just before it).

Printed: medians, the throughput of each, and the ratios write/copy and load/read (goal <= 2).

    .venv/bin/python bench/checkpoint.py
    .venv/bin/python bench/checkpoint.py --config configs/tiny.yaml --stage 0 --repeats 9 --dir /mnt/disk
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarm.checkpoint import StageCheckpoints
from swarm.checkpoint.store import STATE_NAME
from swarm.config import RunConfig
from swarm.model import build_stage
from swarm.optim import StageOptimizer

GOAL = 2.0


def stage_tensors(config: RunConfig, stage: int) -> dict[str, torch.Tensor]:
    """A stage's state after one AdamW step, packed as in docs/checkpoints.md."""
    torch.manual_seed(0)
    module = build_stage(config, stage)
    optimizer = StageOptimizer(module, config.optimizer)
    for param in optimizer.params:
        param.grad = torch.randn_like(param)
    optimizer.add_samples(config.optimizer.batch_size)
    optimizer.step()
    tensors = {f"param/{name}": value for name, value in module.state_dict().items()}
    adamw = optimizer.optimizer.state
    for i, param in enumerate(optimizer.params):
        tensors.update({f"optim/{i}/{slot}": value for slot, value in adamw[param].items()})
    return tensors


def timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    started = time.perf_counter()
    result = call(*args, **kwargs)
    return time.perf_counter() - started, result


def copy_synced(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def read_plain(path: Path) -> None:
    with open(path, "rb") as f:
        f.read()


def measure(config_path: str, stage: int, repeats: int, parent: str | None) -> dict:
    config = RunConfig.load(config_path)
    tensors = stage_tensors(config, stage)
    state_hash = config.state_hash()
    times: dict[str, list[float]] = {"write": [], "copy": [], "load": [], "read": []}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=parent) as tmp:
        store = StageCheckpoints(Path(tmp), config.run_id, stage, keep=2)
        for step in range(repeats):
            seconds, (_, _, path) = timed(store.write, tensors, step=step, num_stages=config.stages.num_stages,
                                          state_hash=state_hash, round_id="bench", group=1)
            times["write"].append(seconds)
            state, copy = path / STATE_NAME, Path(tmp) / f"copy-{step}"
            times["copy"].append(timed(copy_synced, state, copy)[0])
            times["load"].append(timed(store.load, path, state_hash=state_hash)[0])
            times["read"].append(timed(read_plain, state)[0])
            copy.unlink()
        nbytes = state.stat().st_size
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "config": config_path,
        "stage": stage,
        "tensors": len(tensors),
        "bytes": nbytes,
        "repeats": repeats,
        "seconds": medians,
        "write_over_copy": medians["write"] / medians["copy"],
        "load_over_read": medians["load"] / medians["read"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/small.yaml")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", help="make the temporary directory here (default: the system's temp dir)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    result = measure(args.config, args.stage, args.repeats, args.dir)
    mb = result["bytes"] / 1e6
    print(f"{args.config} stage {args.stage}: {result['tensors']} tensors, {mb:.1f} MB state file; "
          f"medians of {args.repeats}")
    for name, seconds in result["seconds"].items():
        print(f"  {name:<6} {seconds * 1e3:8.1f} ms  {mb / seconds:8.0f} MB/s")
    for ratio in ("write_over_copy", "load_over_read"):
        verdict = "ok" if result[ratio] <= GOAL else f"over the goal of {GOAL:g}"
        print(f"  {ratio.replace('_over_', '/')}: {result[ratio]:.2f} ({verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
