"""`swarm-local`: a whole swarm on this machine, or the single-process reference trainer."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from swarm.config import ConfigError, RunConfig
from swarm.data import DataError
from swarm.dht import SwarmDHTError
from swarm.envflags import apply_env_defaults, positive_int
from swarm.logs import setup_logging, stop_on_signals

from .progress import ProgressLine

log = logging.getLogger("swarm.local")
DEFAULT_EXPERT_SERVERS = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-local",
        description="Train on this machine: a whole swarm as separate processes, or (--reference) "
        "the single-process reference trainer every swarm run is compared with.",
    )
    p.add_argument("--config", required=True, help="run config YAML (e.g. configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps to train for")
    p.add_argument("--servers-per-stage", type=int, default=1, help="server processes per pipeline stage")
    p.add_argument("--trainers", type=int, default=1, help="trainer processes")
    p.add_argument("--expert-servers", type=int, default=None, metavar="N",
                   help="expert server processes, for a run whose experts live on expert servers "
                   "(model.moe.expert_servers; default 2 for such a run); the experts are dealt out among them")
    p.add_argument("--in-flight", type=positive_int, help="each trainer's micro-batches in flight (default: "
                   "swarm-peer's, a sixteenth of a batch, at least 1)")
    p.add_argument("--reference", action="store_true", help="train the whole model in this one process")
    p.add_argument("--metrics-port", type=int, help="the coordinator's /metrics and /status port (default: free)")
    p.add_argument("--log-dir", help="where each process writes its log (default: a new temporary directory)")
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


def run_swarm(args: argparse.Namespace, config: RunConfig) -> dict:
    from .local_swarm import LocalSwarm

    S, R, T = config.stages.num_stages, args.servers_per_stage, args.trainers
    print(f"local swarm: {config.run_id}, {S} stages x {R} server(s), {T} trainer(s), {args.steps} steps", flush=True)
    stop = threading.Event()
    stop_on_signals(stop, (signal.SIGTERM,))
    moe = config.model.moe
    remote = moe is not None and moe.expert_servers
    experts = (DEFAULT_EXPERT_SERVERS if args.expert_servers is None else args.expert_servers) if remote else 0
    if args.expert_servers and not remote:
        raise ConfigError(f"--expert-servers: run {config.run_id} keeps its experts in the stage servers "
                          "(model.moe.expert_servers is not set)")
    if remote and experts < 1:
        raise ConfigError("--expert-servers: this run's experts live on expert servers; start at least one")
    if experts:
        print(f"  and {experts} expert server(s) for the {moe.num_experts} experts of each MoE block", flush=True)
    swarm = LocalSwarm(args.config, config, R, T, args.log_dir, args.metrics_port, stop, in_flight=args.in_flight,
                       expert_servers=experts)
    try:
        return swarm.run(args.steps)
    except KeyboardInterrupt:
        stop.set()
        raise


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    for flag in ("steps", "servers_per_stage", "trainers"):
        if getattr(args, flag) <= 0:
            sys.exit(f"swarm-local: error: --{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    try:
        config = RunConfig.load(args.config)
    except ConfigError as e:
        sys.exit(f"swarm-local: error: {e}")
    try:
        if args.reference:
            summary = run_reference(config, args.steps)
        else:
            summary = run_swarm(args, config)
    except KeyboardInterrupt:
        sys.exit("swarm-local: interrupted; every process it started was ended")
    except (RuntimeError, SwarmDHTError, DataError, OSError, ConfigError) as e:
        sys.exit(f"swarm-local: error: {e}")
    print(f"done: {summary['steps']} steps, loss {_num(summary['initial_loss'])} -> {_num(summary['final_loss'])}, "
          f"validation loss {_num(summary['val_loss'])}, {summary['samples_per_second']:.1f} samples/s", flush=True)
    checkpoint = summary.get("run_checkpoint")
    if checkpoint and config.model.moe is not None:  # GPT-2 cannot hold experts: no export to offer
        print(f"run checkpoint of steps {checkpoint['steps']}: {checkpoint['path']}", flush=True)
    elif checkpoint:
        print(f"run checkpoint of steps {checkpoint['steps']}: swarm-export --checkpoint-dir "
              f"{checkpoint['checkpoint_dir']} --out model/  (a GPT-2 model transformers loads)", flush=True)
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
