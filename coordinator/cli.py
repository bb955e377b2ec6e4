"""`swarm-coordinator`: bootstraps a run's DHT and publishes its signed run config."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from swarm.checkpoint.errors import CheckpointError
from swarm.config import ConfigError, RunConfig
from swarm.dht import SwarmDHTError, gate, load_swarm_key, write_initial_peers
from swarm.dht.node import REACHABILITY_CHOICES, NatOptions
from swarm.envflags import apply_env_defaults
from swarm.logs import setup_logging, stop_on_signals

from .discovery import parse_networks
from .node import Coordinator

log = logging.getLogger("swarm.coordinator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-coordinator",
        description="Start a training run: a DHT node with a stable identity that publishes the signed run "
        "config. Prints 'initial peers: MADDR ...' as soon as others can join.",
    )
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--run-id", help="override the run id of the config")
    p.add_argument("--identity", help="identity file (created if missing) so the multiaddr survives restarts")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"],
                   help="multiaddrs to listen on (default: all interfaces, a free TCP port)")
    p.add_argument("--announce-maddrs", nargs="+", default=[], help="multiaddrs others should dial")
    p.add_argument("--reachability", choices=REACHABILITY_CHOICES, default="public",
                   help="whether other peers can dial the coordinator: public (the default: every peer joins "
                   "through it, and it relays for servers behind NAT), auto (libp2p's AutoNAT finds out), or private")
    p.add_argument("--metrics-port", type=int,
                   help="serve the live page /, /status, /metrics, /healthz and Prometheus discovery /sd on this port")
    p.add_argument("--metrics-networks", nargs="+", metavar="CIDR",
                   help="list in /sd only peers whose announced metrics address is an IP in these networks, e.g. "
                   "10.0.0.0/8 (default: any address a peer announces; Prometheus then connects wherever peers say)")
    p.add_argument("--initial-peers-file", metavar="FILE",
                   help="also write the initial peers' multiaddrs to this file once others can join "
                   "(peers read it with --initial-peers @FILE)")
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                   help="keep the run's checkpoints here: each stage's newest, pulled from its servers and verified, "
                   "and whole-run checkpoints for swarm-export (default: none kept by the coordinator)")
    p.add_argument("--swarm-key", metavar="FILE",
                   help="make the swarm private: only peers started with a copy of this file can join it (created "
                   "if missing); the run then goes by a network id derived from the key")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    apply_env_defaults(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = RunConfig.load(args.config)
        if args.run_id:
            config.run_id = args.run_id
        networks = parse_networks(args.metrics_networks) if args.metrics_networks else None
        swarm_key = load_swarm_key(args.swarm_key, create=True) if args.swarm_key else None
        if swarm_key is not None:
            config.run_id = swarm_key.network_id(config.run_id)
        config.validate()
    except (ConfigError, SwarmDHTError, ValueError) as e:
        sys.exit(f"swarm-coordinator: error: {e}")
    if swarm_key is not None:  # before any P2P starts: the DHT process forks from this one
        gate.install(swarm_key)
        log.info("private swarm: peers need a copy of %s (--swarm-key) to join run %s", args.swarm_key, config.run_id)

    stop = threading.Event()
    stop_on_signals(stop)
    # The DHT process is forked: with these handlers it would ignore DHT.shutdown()'s SIGTERM fallback (hang at exit).
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    try:
        nat = NatOptions(reachability=args.reachability, relay_service=True)
        coordinator = Coordinator(config, args.host_maddrs, args.announce_maddrs, args.identity, args.metrics_port,
                                  args.checkpoint_dir, swarm_key, networks, nat)
    except (SwarmDHTError, CheckpointError, OSError) as e:  # (CheckpointError: e.g. a corrupt signing key)
        sys.exit(f"swarm-coordinator: error: {e}")
    try:
        maddrs = coordinator.initial_peers()
        if args.initial_peers_file:
            try:
                write_initial_peers(args.initial_peers_file, maddrs)
            except OSError as e:
                sys.exit(f"swarm-coordinator: error: cannot write --initial-peers-file: {e}")
        print("initial peers: " + " ".join(maddrs), flush=True)
        coordinator.serve_until(stop)
    finally:
        coordinator.shutdown()


if __name__ == "__main__":
    main()
