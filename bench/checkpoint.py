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

Then the cost to training (``--overhead``, on by default): the same stage trains on random batches
through a real StageBackend, its steps handed to a real StageKeeper as a server's are, in
alternating blocks with checkpoints off and with a checkpoint after every step (the DHT is a
stand-in that accepts every announcement). The time one checkpoint adds to training is the
difference between the two, per checkpoint written; scaled to the default interval (every_steps of the run config,
one per `every_steps` steps), it is the overhead on training throughput (goal <= 3%). A write that
outlasts a step is not queued behind (the next step after it is written instead), so the extra time
is divided by the checkpoints actually written.

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

from swarm.backend import StageBackend
from swarm.checkpoint import StageCheckpoints
from swarm.checkpoint.keeper import KeeperScope, StageKeeper
from swarm.checkpoint.verify import STATE_NAME
from swarm.config import RunConfig
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState

GOAL = 2.0
OVERHEAD_GOAL = 0.03


def stage_state(config: RunConfig, stage: int) -> StageState:
    """A stage replica after one AdamW step on random gradients (so its moments exist)."""
    torch.manual_seed(0)
    module = build_stage(config, stage)
    optimizer = StageOptimizer(module, config.optimizer)
    for param in optimizer.params:
        param.grad = torch.randn_like(param)
    optimizer.add_samples(config.optimizer.batch_size)
    optimizer.step()
    return StageState(module, optimizer, stage, "bench")


def stage_tensors(config: RunConfig, stage: int) -> dict[str, torch.Tensor]:
    """A stage's state as a checkpoint holds it (docs/checkpoints.md)."""
    return stage_state(config, stage).state_dict()[1]


class AcceptingRecords:
    """Stands in for the DHT: takes every checkpoint announcement, knows of none."""

    def announce_checkpoints(self, record: Any, ttl: float) -> bool:
        return True

    def lookup_checkpoints(self, stage: int) -> list:
        return []


def overhead(config_path: str, stage: int, steps: int, blocks: int, parent: str | None) -> dict:
    """Seconds per training step with checkpoints off and after every step, in alternating blocks."""
    config = RunConfig.load(config_path)
    every_steps = config.checkpoint.every_steps
    config.checkpoint.every_steps, config.checkpoint.every_seconds = 1, 0.0
    state = stage_state(config, stage)
    module, n, t = state.module, config.optimizer.micro_batch_size, config.model.seq_len
    micro_batches = config.optimizer.batch_size // n
    times: dict[str, list[float]] = {"off": [], "every step": []}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=parent) as tmp:
        keeper = StageKeeper(state, KeeperScope.of(config), config.checkpoint, Path(tmp),  # type: ignore[arg-type]
                             AcceptingRecords(), None, "bench")
        backend = StageBackend(module, state.optimizer)
        try:
            for block in range(2 * blocks):
                mode = "off" if block % 2 == 0 else "every step"
                backend.on_step = None if mode == "off" else lambda stats: keeper.after_step(stats["step"])
                started = time.perf_counter()
                for _ in range(steps * micro_batches):
                    x = torch.randn(n, t, config.model.d_model) if not module.is_first else \
                        torch.randint(0, config.model.vocab_size, (n, t))
                    y = torch.randint(0, config.model.vocab_size, (n, t)) if module.is_last else None
                    grad = None if module.is_last else torch.randn(n, t, config.model.d_model)
                    backend.call(lambda x=x, g=grad, y=y: backend.backward(x, g, y))
                if keeper._writing is not None:  # the block ends when its last write does
                    keeper._writing.result()
                times[mode].append(time.perf_counter() - started)
            written = keeper.written  # (fewer than the steps if a write outlasts a step: it is not queued)
        finally:
            backend.shutdown()
    per_step = {mode: statistics.median(values) / steps for mode, values in times.items()}
    per_checkpoint = max(0.0, sum(times["every step"]) - sum(times["off"])) / max(written, 1)
    return {"steps_per_block": steps, "blocks": blocks, "seconds_per_step": per_step, "written": written,
            "seconds_per_checkpoint": per_checkpoint, "every_steps": every_steps,
            "overhead_at_default": per_checkpoint / (every_steps * per_step["off"])}


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
    p.add_argument("--no-overhead", action="store_true", help="skip the cost-to-training measurement")
    p.add_argument("--steps", type=int, default=4, help="training steps per block of the overhead measurement")
    p.add_argument("--blocks", type=int, default=3, help="blocks of each kind (off, every step), alternating")
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
    if not args.no_overhead:
        cost = overhead(args.config, args.stage, args.steps, args.blocks, args.dir)
        result["overhead"] = cost
        off, every = cost["seconds_per_step"]["off"], cost["seconds_per_step"]["every step"]
        print(f"training, medians of {args.blocks} blocks of {args.steps} steps: {off * 1e3:.0f} ms/step with "
              f"checkpoints off, {every * 1e3:.0f} ms/step with one after every step "
              f"({cost['written']} written): {cost['seconds_per_checkpoint'] * 1e3:.0f} ms per checkpoint")
        verdict = "ok" if cost["overhead_at_default"] <= OVERHEAD_GOAL else f"over the goal of {OVERHEAD_GOAL:.0%}"
        print(f"  overhead at the default interval (every {cost['every_steps']} steps): "
              f"{cost['overhead_at_default']:.2%} ({verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
