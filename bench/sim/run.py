"""The simulator's swarm with rebalancing and without, side by side, against an oracle's placement.

    .venv/bin/python bench/sim/run.py [--servers 900] [--trainers 100] [--stages 8] [--minutes 30]
                                      [--session 3600] [--seed 0] [--only rebalancing|static|oracle]

The same peers (speeds, links, regions, NAT, sessions drawn from one seed) are simulated three times:
with rebalancing (swarm-peer's default for a server without --stage), with --no-rebalance, and placed
by an oracle that knows every server's speed (joiners to the weakest stage, and servers moved free of
cost after every join and leave while that raises the bottleneck), each for `--minutes` after a
two-minute warm-up; the trainers and their routing are the same in all three. Per window and over the
run: the samples/s the trainers finished (and, beside the oracle's placement, their ratio), the
bottleneck of the ONLINE servers where they are, and the oracle's bottleneck for the same alive servers
(placed fastest first, each on the weakest stage so far) with the bound no placement passes (their total
over the stages); and routing: the finish each call would get on the server the trainer chose, over the
best finish among the stage's servers, knowing every queue (1.0: the oracle's choice every time); and answered:
how long each call took to be answered, from the trainer's first choice through any refusals, failures and
retries, over the oracle's best expected finish at that first choice (what the trainer got, where routing is
what it chose).
bench/sim/swarm.py says what is the project's own code and what is modelled.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sim.swarm import AUTO, Scenario, Window, simulate  # noqa: E402

ONLY = {"rebalancing": "rebalancing", "static": "no rebalancing", "oracle": "oracle placement",
        "oracle-routing": "oracle routing"}


def summary(name: str, windows: list[Window], took: float, events: int) -> str:
    mean = lambda key: sum(getattr(w, key) for w in windows) / len(windows)  # noqa: E731
    oracle = mean("oracle")
    return (f"{name:<16} {mean('samples_per_second'):>9.1f} {mean('bottleneck'):>10.1f} {oracle:>8.1f} "
            f"{mean('bound'):>8.1f} {mean('samples_per_second') / oracle:>11.3f} {mean('bottleneck') / oracle:>11.3f} "
            f"{mean('routing'):>8.3f} {mean('answered'):>8.3f} {mean('trip'):>7.2f} {sum(w.moves for w in windows):>6} "
            f"{took:>6.0f}s "
            f"{events / 1e6:>6.1f}M")


def max_wait(value: str) -> float | str | None:
    if value in (AUTO, "none"):
        return None if value == "none" else AUTO
    seconds = float(value)
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"--max-wait must be 'auto', 'none' or seconds > 0, got {value}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=900)
    p.add_argument("--trainers", type=int, default=100)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--session", type=float, default=3600.0, help="mean server session, seconds (0: no churn)")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--in-flight-cap", type=int,
                   help="trainers adapt their micro-batches in flight from --in-flight up to this, as --in-flight "
                        "auto does (swarm.routing.inflight.InFlightWindow)")
    p.add_argument("--max-queue", type=int,
                   help="tasks a server queues before it refuses more as busy (swarm-peer's max_queue; default: none)")
    p.add_argument("--max-wait", type=max_wait, default=AUTO,
                   help="seconds of work queued ahead past which a server refuses a call as busy, unless the caller "
                        "has no other server to go to (swarm-peer's --max-wait); 'auto' (default): as a server with "
                        "none set, swarm.worker.auto_max_wait; 'none': never")
    p.add_argument("--no-claims", action="store_true",
                   help="trainers do not take servers' announced throughput for their speed before measuring it")
    p.add_argument("--no-pings", action="store_true",
                   help="trainers do not time a round trip to each server (swarm.routing.pings) for untried ones")
    p.add_argument("--seconds-per-sample", type=float, default=Scenario.seconds_per_sample,
                   help="one forward of one sample of a stage on a speed-1.0 server")
    p.add_argument("--wire-kb", type=float, default=Scenario.wire_bytes_per_sample / 1024,
                   help="KiB of hidden states per sample a call carries each way")
    p.add_argument("--micro-batch", type=int, default=Scenario.micro_batch)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--only", choices=tuple(ONLY), nargs="+",
                   help="simulate these sides only (static: --no-rebalance; oracle: servers placed by the oracle, free "
                        "moves included; oracle-routing: rebalancing, every call routed by the oracle)")
    p.add_argument("--verbose", action="store_true", help="print every window")
    args = p.parse_args()
    base = Scenario(stages=args.stages, servers=args.servers, trainers=args.trainers, session=args.session,
                    in_flight=args.in_flight, in_flight_cap=args.in_flight_cap, claims=not args.no_claims,
                    pings=not args.no_pings,
                    max_queue=args.max_queue, max_wait=args.max_wait,
                    seed=args.seed, seconds_per_sample=args.seconds_per_sample,
                    wire_bytes_per_sample=int(args.wire_kb * 1024), micro_batch=args.micro_batch)
    print(f"{args.servers} servers, {args.trainers} trainers, {args.stages} stages, {args.minutes:.0f} min, "
          f"sessions of {args.session:.0f} s on average, seed {args.seed}, max wait {args.max_wait}")
    results = []
    sides = (("rebalancing", dict(rebalance=True)), ("no rebalancing", dict(rebalance=False)),
             ("oracle placement", dict(oracle_placement=True)),
             ("oracle routing", dict(rebalance=True, oracle_routing=True)))
    for name, change in sides:
        if args.only is not None and name not in {ONLY[o] for o in args.only}:
            continue
        began = time.monotonic()

        def show(w: Window, name=name) -> None:
            if args.verbose:
                print(f"  {name} t={w.start:.0f}s: {w.samples_per_second:.1f} samples/s, bottleneck "
                      f"{w.bottleneck:.1f}, oracle {w.oracle:.1f}, moves {w.moves}", flush=True)

        swarm, windows = simulate(replace(base, **change), args.minutes * 60, args.window, progress=show)
        results.append((name, windows, time.monotonic() - began, swarm.sim.events))
    print(f"{'':<16} {'samples/s':>9} {'bottleneck':>10} {'oracle':>8} {'bound':>8} {'/ oracle':>11} "
          f"{'bn / oracle':>11} {'routing':>8} {'answered':>8} {'trip s':>7} {'moves':>6} {'took':>7} {'events':>7}")
    for result in results:
        print(summary(*result))
    placed = {name: sum(w.samples_per_second for w in windows) / len(windows) for name, windows, _, _ in results}
    if "oracle placement" in placed:
        for name in ("rebalancing", "no rebalancing"):
            if name in placed:
                print(f"{name} / oracle placement, samples/s the trainers finished: "
                      f"{placed[name] / max(placed['oracle placement'], 1e-9):.3f}")
    trips = {name: sum(w.trip for w in windows) / len(windows) for name, windows, _, _ in results}
    if "oracle routing" in placed and "rebalancing" in placed:
        print(f"rebalancing / oracle routing (the same peers, each call routed by the oracle): samples/s "
              f"{placed['rebalancing'] / max(placed['oracle routing'], 1e-9):.3f}, a micro-batch's trip "
              f"{trips['rebalancing'] / max(trips['oracle routing'], 1e-9):.3f}")


if __name__ == "__main__":
    main()
