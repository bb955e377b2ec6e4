"""`swarm-local`: a whole swarm on this machine, or the single-process reference trainer."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from swarm.config import ConfigError, RunConfig
from swarm.envflags import apply_env_defaults
from swarm.logs import setup_logging

from .progress import ProgressLine

log = logging.getLogger("swarm.local")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-local",
        description="Train on this machine: a whole swarm as separate processes, or (--reference) "
        "the single-process reference trainer every swarm run is compared with.",
    )
    p.add_argument("--config", required=True, help="run config YAML (e.g. configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps to train for")
    p.add_argument("--reference", action="store_true", help="train the whole model in this one process")
    p.add_argument("--summary", help="write a JSON summary of the run to this path")
    p.add_argument("--log-level", default="WARNING", help="log level of this program")
    apply_env_defaults(p)
    return p


def run_reference(config: RunConfig, steps: int) -> dict:
    from swarm.reference import ReferenceTrainer

    print(f"reference trainer: {config.run_id}, {config.model.n_layer} layers x {config.model.d_model}, "
          f"{config.stages.num_stages} stages in one process, batch {config.optimizer.batch_size}", flush=True)
    trainer = ReferenceTrainer(config)
    progress = ProgressLine(steps, every=max(1, steps // 20))

    def on_progress(stats: dict) -> None:
        progress.update(stats["step"], loss=float(stats["loss"]), lr=float(stats["lr"]))

    try:
        summary = trainer.run(steps, on_progress=on_progress)
    finally:
        progress.close()
    return summary


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    if args.steps <= 0:
        sys.exit(f"swarm-local: error: --steps must be positive, got {args.steps}")
    try:
        config = RunConfig.load(args.config)
    except ConfigError as e:
        sys.exit(f"swarm-local: error: {e}")
    try:
        if not args.reference:
            sys.exit("swarm-local: error: the multi-process swarm needs the pipeline (issue 3); use --reference")
        summary = run_reference(config, args.steps)
    except KeyboardInterrupt:
        sys.exit("swarm-local: interrupted")
    print(
        f"done: {summary['steps']} steps, loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f}, "
        f"validation loss {summary['val_loss']:.3f}, {summary['samples_per_second']:.1f} samples/s",
        flush=True,
    )
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
