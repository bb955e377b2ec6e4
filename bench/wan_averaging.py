"""Averaging rounds alone on the network lab's links: ours and hivemind's raw all-reduce against the bound.

    sudo .venv/bin/python bench/wan_averaging.py [--rates 20] [--latencies 0] [--n 2] [--rounds 6]

bench/wan.py times the averaging rounds of a training swarm, whose links also carry activations and
gradients (a busy stage-0 server sends about a fifth of a 20 Mbit/s uplink in activations) and whose
two cores also compute. This takes the link alone: `--n` members, each its own process on its own
host of tests/netlab (as root; `make test-net` installs what the lab needs), every link at the
rate (both ways) and half the one-way latency asked for. Each member holds a StageAverager over
stage `--stage` of the config (tiny.yaml's stage 0: the 1.75 MB of gradients bench/wan.py bounds)
and a plain hivemind DecentralizedAverager over tensors of the same shapes, and runs rounds of the
two in turn, the first of each a warm-up (bench/averaging.py's members, on the lab's addresses).

Printed per point, medians over the rounds (each round's time is its slowest member's): the round,
its matchmaking (ours forms its group ahead, so only what is left after the last member joined;
hivemind's within its step), the all-reduce (the rest), each against the bytes-over-rate bound
2(n-1)/n x payload / rate, and the bytes each averaging process wrote per round beside
2(n-1)/n x payload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.averaging import Member, payload_bytes, raw_step, whole_step, written  # noqa: E402
from swarm.config import RunConfig  # noqa: E402
from swarm.dht import load_identity, start_dht, visible_maddrs  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.netlab import Lab  # noqa: E402
from tests.procs import ProcSet  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LISTEN = ["/ip4/0.0.0.0/tcp/0"]
MADDRS_LINE = r"MADDRS (.+)"
START_TIMEOUT = 120.0  # a member's DHT and both averaging processes up
READY_TIMEOUT = 60.0  # every member sees the stage's batch and the others
POLL = 0.05


# --- one member (a process on a lab host) -------------------------------------------------------------

def ours_round(member: Member, batch_size: int, n: int) -> dict:
    """This member's share of the batch into a StageAverager round; the round as it timed it."""
    averager = member.ours
    state = lambda: str(averager.view())  # noqa: E731 - what a timeout says
    # Every member in sight before any samples: a round's group forms ahead, for the members seen then
    wait_until(lambda: averager.view().group_size >= n, READY_TIMEOUT, POLL, "the members to see each other",
               explain=state)
    averager.optimizer.zero_grad()
    averager.accumulate([torch.randn_like(p) for p in averager.optimizer.params], -(-batch_size // n))
    # (a member that saw the batch first is in its round already: its record says so, and closes the batch here)
    wait_until(lambda: (view := averager.view()).group_size == n and (view.samples >= batch_size or view.closed),
               READY_TIMEOUT, POLL, "the stage's batch, full or closed", explain=state)
    before = member.round_seconds(), member.start_seconds(), written(averager.process_id)
    closed = time.time()  # one clock for every member: the lab's hosts share this machine's
    stats = whole_step(averager)
    ended = time.time()
    if (stats or {}).get("averaging") != "succeeded" or stats.get("group_size") != n:
        raise RuntimeError(f"a round of ours did not average all {n}: {stats}")
    return {"round": member.round_seconds() - before[0], "formed": member.start_seconds() - before[1],
            "sent": written(averager.process_id) - before[2], "closed": closed, "ended": ended}


def raw_round(member: Member, n: int, timeout: float) -> dict:
    grads = [torch.randn_like(t) for t in member.ours.optimizer.params]
    before, began = written(member.raw.pid), time.time()
    gathered, seconds, formed = raw_step(member, grads, timeout)
    if not gathered or len(gathered) != n:
        raise RuntimeError(f"a raw round did not average all {n}: {gathered}")
    # (its step begins after the gradients are copied in: began is a few milliseconds early, on every member)
    return {"round": seconds, "formed": formed, "sent": written(member.raw.pid) - before,
            "closed": began + formed, "ended": began + seconds}


def run_hub(args: argparse.Namespace) -> None:
    """A DHT node the members join through, as a swarm's coordinator is: until killed."""
    config = RunConfig.load(args.config)
    dht = start_dht(config.run_id, load_identity(None), initial_peers=[], host_maddrs=LISTEN)
    print("MADDRS", " ".join(visible_maddrs(dht)), flush=True)
    threading.Event().wait()


def run_member(args: argparse.Namespace) -> None:
    config = RunConfig.load(args.config)
    member = Member(config, args.initial_peers, CollectorRegistry(), host_maddrs=LISTEN, stage=args.stage,
                    channel=args.channel)
    try:
        member.start(config, args.n)
        timeout = config.averaging.matchmaking_timeout + config.averaging.allreduce_timeout
        rounds = []
        for index in range(args.rounds + 1):  # the first of each: warm-up (connections, allocations)
            ours = ours_round(member, config.optimizer.batch_size, args.n)
            raw = raw_round(member, args.n, timeout)
            if index:
                rounds.append({"ours": ours, "raw": raw})
            print(f"round {index}: ours {ours['round']:.2f}s, raw {raw['round']:.2f}s", flush=True)
        Path(args.out).write_text(json.dumps(rounds))
    finally:
        member.shutdown()


# --- the lab -------------------------------------------------------------------------------------------

def measure(config_path: Path, args: argparse.Namespace, latency_ms: float, rate: float, workdir: Path) -> list:
    """Every member's rounds: [member][round] = {"ours": ..., "raw": ...}."""
    procs = ProcSet(workdir)
    bench = ["python", str(REPO / "bench" / "wan_averaging.py")]
    member = [*bench, "--member", "--config", str(config_path),
              "--n", str(args.n), "--rounds", str(args.rounds), "--stage", str(args.stage),
              *([] if args.channel else ["--no-channel"])]
    outs = [workdir / f"member{i}.json" for i in range(args.n)]
    with Lab() as lab:
        hub = lab.add_host("hub")
        hosts = [lab.add_host(f"m{i}", latency_ms=latency_ms / 2, rate_mbit=rate or None) for i in range(args.n)]
        lab.start()
        try:
            line = procs.start(*bench, "--hub", "--config", str(config_path), netns=hub.ns).wait_for_line(
                MADDRS_LINE, START_TIMEOUT)
            join = [m for m in line.group(1).split() if f"/ip4/{hub.address}/" in m]
            started = [procs.start(*member, "--out", str(out), "--initial-peers", *join, netns=host.ns)
                       for host, out in zip(hosts, outs)]
            deadline = time.monotonic() + START_TIMEOUT + args.rounds * 4 * (READY_TIMEOUT + 60)
            for proc in started:
                proc.wait_until(lambda proc=proc: proc.has_exited(), max(1.0, deadline - time.monotonic()),
                                "the member to finish its rounds")
                if proc.popen.wait() != 0:
                    raise RuntimeError("a member failed:\n" + "\n".join(p.describe() for p in started))
        finally:
            procs.stop_all()
    return [json.loads(out.read_text()) for out in outs]


def summary(members: list, side: str) -> dict:
    """Medians over rounds of the slowest member's round and matchmaking, and the mean bytes per member."""
    rounds = list(zip(*members))  # [round][member]
    whole = [max(m[side]["round"] for m in r) for r in rounds]
    # the group formed when its last member saw it
    formed = [max(m[side]["formed"] for m in r) for r in rounds]
    # The all-reduce can only run once every member has handed in its part: from the last member's
    # trigger (ours: closing its batch) to the last member's end. Before that, a member that saw the
    # batch full first waits for the others to see it too (its round counts that wait).
    last_in = [max(m[side]["ended"] for m in r) - max(m[side]["closed"] for m in r) for r in rounds]
    return {"round": statistics.median(whole), "formed": statistics.median(formed),
            "all_reduce": statistics.median(last_in),
            "waited": statistics.median(max(m[side]["closed"] for m in r) - min(m[side]["closed"] for m in r)
                                        for r in rounds),
            "sent": statistics.median(statistics.mean(m[side]["sent"] for m in r) for r in rounds)}


def said(r: dict, bound: float | None) -> str:
    against = "" if bound is None else \
        f" ({r['round'] / bound:.2f} x the bound; all-reduce alone {r['all_reduce'] / bound:.2f} x)"
    return (f"round {r['round']:.2f} s (matchmaking {r['formed']:.2f} s; the last member in {r['waited']:.2f} s after "
            f"the first), all-reduce from the last member in {r['all_reduce']:.2f} s{against}, "
            f"{r['sent'] / 1e6:.2f} MB sent a member")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--stage", type=int, default=0, help="the stage whose gradients are averaged")
    p.add_argument("--n", type=int, default=2, help="members, each on its own host")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds of each side (after one warm-up)")
    p.add_argument("--rates", type=float, nargs="+", default=[20], help="Mbit/s each way per host; 0: none")
    p.add_argument("--latencies", type=float, nargs="+", default=[0], help="one-way ms between hosts")
    p.add_argument("--no-channel", dest="channel", action="store_false",
                   help="progress through the DHT alone (a stage server also pushes it straight to the others)")
    p.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hub", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.member:
        run_member(args)
        return
    if args.hub:
        run_hub(args)
        return
    if args.n < 2 or args.rounds < 1:
        p.error("--n must be at least 2 and --rounds at least 1")
    config = RunConfig.load(args.config)
    config.averaging.target_group_size = max(config.averaging.target_group_size, args.n)
    config.validate()
    payload = payload_bytes(config, args.stage)
    share = 2 * (args.n - 1) / args.n * payload
    print(f"{args.config}: stage {args.stage}, {payload / 1e6:.2f} MB of gradients after codec "
          f"{config.averaging.compression}; {args.n} members; medians of {args.rounds} rounds", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="swarm-wan-avg-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config.save(config_path)
        for rate in args.rates:
            for latency in args.latencies:
                workdir = Path(tmp) / f"r{rate}-l{latency}"
                workdir.mkdir()
                members = measure(config_path, args, latency, rate, workdir)
                ours, raw = summary(members, "ours"), summary(members, "raw")
                results.append({"rate_mbit": rate, "latency_ms": latency, "ours": ours, "raw": raw})
                bound = share / (rate * 1e6 / 8) if rate else None
                limit = "unlimited" if not rate else f"{rate:g} Mbit/s"
                print(f"{limit}, {latency:g} ms one way: ours {said(ours, bound)}; raw hivemind "
                      f"{said(raw, bound)}; bound 2(n-1)/n x payload = {share / 1e6:.2f} MB"
                      + ("" if bound is None else f" / rate = {bound:.2f} s"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
