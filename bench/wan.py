"""Throughput across the internet: a swarm in the network lab at added latency and capped rates.

    sudo .venv/bin/python bench/wan.py [--latencies 0 50] [--rates 0 100] [--fixed]
                                       [--servers-per-stage 2] [--nat-stage 1] [--config ...]

A coordinator, one server per stage (or --servers-per-stage) and one trainer, each on its own host
of tests/netlab (as root;
`make test-net` installs what the lab needs). Every link gets half the one-way latency asked for
(a packet between two hosts crosses two links) and the rate (0: unlimited) both ways (the trainer's
link a rate of its own with --trainer-rate: servers on home uplinks, their trainer in a datacenter). For each
latency and rate the trainer's samples/s is measured over one window after a warm-up, and printed
against the same swarm at 0 ms and the same rate, with the micro-batches in flight the trainer chose
(swarm_trainer_in_flight, `--in-flight auto`) and the share of backwards a stage ran one or more steps
stale. With --fixed, each point is also run with the trainer's default fixed count (a sixteenth of a
batch), side by side, and with --in-flight N ... at each count N. With --nat-stage K, stage K's servers
sit behind NAT and are reached through the coordinator's relay; with --nat-trainer the trainer sits behind a
NAT of its own, and --hub-latency puts latency on the coordinator's link alone (a relayed call pays it, a
direct one not). Also printed: how long after the coordinator every server was serving
(the join), and the mean averaging round in the window (matchmaking included), against the
bytes-over-rate bound 2(n-1)/n x stage 0's gradient bytes / rate when a rate is set (and each stage's). With
--delayer-control, a 0 ms point with every link through the lab's userspace delayer is run too, and
each point is also printed against it: latency needs the delayer, a Python process per link that
handles every packet on the cores the swarm shares, and the plain 0 ms point pays nothing for it.

With --transports, every peer listens on TCP (the default), QUIC or both, each a run of all the points
(QUIC does not work with hivemind 1.1.12's p2pd yet: README, Across the internet).

With --modes every_step local, every point runs once per averaging mode (averaging.mode; the local mode
with --local-steps), and a local point is also printed against the every_step point just before it
(README, Low-communication mode: its goal is >= 3 x at 20 Mbit/s).

Defaults: configs/tiny.yaml at batch 64 (its compute takes milliseconds, as on a GPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import RunConfig  # noqa: E402
from swarm.model import build_stage  # noqa: E402
from swarm.trainer import default_in_flight  # noqa: E402
from tests.netlab import Lab  # noqa: E402
from tests.procs import INITIAL_PEERS_LINE, ProcSet  # noqa: E402

PORT = 9100
TRANSPORTS = {"tcp": ("/ip4/0.0.0.0/tcp/0",), "quic": ("/ip4/0.0.0.0/udp/0/quic-v1",),
              "both": ("/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1")}
REPO = Path(__file__).resolve().parent.parent


def families(host, port: int = PORT) -> dict[tuple[str, tuple], float]:
    body = host.http_get(port, "/metrics") or ""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def stale_share(samples: dict) -> float | None:
    """Share of backwards a stage ran on a stage that had stepped since their forward."""
    count = value(samples, "swarm_server_backward_staleness_steps_count")
    fresh = value(samples, "swarm_server_backward_staleness_steps_bucket", le="0.0")
    return None if not count else 1 - fresh / count


def measure(config_path: Path, stages: int, latency_ms: float, rate: float, fixed: int | None, warmup: float,
            window: float, workdir: Path, per_stage: int = 1, nat_stage: int | None = None,
            nat_reachability: str = "auto", nat_trainer: bool = False, hub_ms: float | None = None,
            queued: bool = False, transport: str = "tcp", trainer_rate: float | None = None) -> dict:
    procs = ProcSet(workdir)
    listen = ("--host-maddrs", *TRANSPORTS[transport])
    link = {"latency_ms": latency_ms / 2, "rate_mbit": rate or None, "queued": queued}
    with Lab() as lab:
        hub = lab.add_host("hub", **{**link, **({} if hub_ms is None else {"latency_ms": hub_ms})})
        servers = [(k, lab.add_host(f"s{k}r{j}", kind="nat" if k == nat_stage else "public", **link))
                   for k in range(stages) for j in range(per_stage)]
        trainer_link = link if trainer_rate is None else {**link, "rate_mbit": trainer_rate or None}
        trainer_host = lab.add_host("trainer", kind="nat" if nat_trainer else "public", **trainer_link)
        lab.start()
        try:
            coordinator = procs.start("swarm-coordinator", "--config", str(config_path), *listen, netns=hub.ns)
            line = coordinator.wait_for_line(INITIAL_PEERS_LINE, 120)
            began = time.monotonic()
            join = ("--initial-peers", *[m for m in line.group(1).split() if f"/ip4/{hub.address}/" in m])
            metrics = ("--metrics-port", str(PORT))
            behind = ("--reachability", nat_reachability)
            peers = [procs.start("swarm-peer", *join, *listen, "--role", "server", "--stage", str(k), *metrics,
                                 *(behind if k == nat_stage else ()), netns=h.ns)
                     for k, h in servers]
            for peer in peers:
                peer.wait_for_line(r"serving stage \d+", 300, stream="stderr")
            joined = time.monotonic() - began
            extra = ("--in-flight", "auto" if fixed is None else str(fixed))
            trainer = procs.start("swarm-peer", *join, *listen, "--role", "trainer", "--trainer-index", "0", *metrics,
                                  *extra,
                                  netns=trainer_host.ns)
            trainer.wait_until(lambda: value(families(trainer_host), "swarm_trainer_samples_total") > 0, 300,
                               "the trainer's first samples")
            time.sleep(warmup)
            start, t0 = value(families(trainer_host), "swarm_trainer_samples_total"), time.monotonic()
            rounds_before = [families(h) for _, h in servers]
            time.sleep(window)
            end_samples = families(trainer_host)
            elapsed = time.monotonic() - t0
            rounds_after = [families(h) for _, h in servers]
            stale = [stale_share(f) for f in rounds_after]
            took = [value(after, "swarm_averaging_round_seconds_sum")
                    - value(before, "swarm_averaging_round_seconds_sum")
                    for before, after in zip(rounds_before, rounds_after)]
            count = [value(after, "swarm_averaging_round_seconds_count")
                     - value(before, "swarm_averaging_round_seconds_count")
                     for before, after in zip(rounds_before, rounds_after)]
            waited = [value(after, "swarm_averaging_round_start_seconds_sum")
                      - value(before, "swarm_averaging_round_start_seconds_sum")
                      for before, after in zip(rounds_before, rounds_after)]
            return {"latency_ms": latency_ms, "rate_mbit": rate, "fixed": fixed, "queued": queued, "joined_s": joined,
                    "transport": transport,
                    "all_reduce_seconds": (sum(took) - sum(waited)) / sum(count) if sum(count) else None,
                    "samples_per_second": (value(end_samples, "swarm_trainer_samples_total") - start) / elapsed,
                    "in_flight": value(end_samples, "swarm_trainer_in_flight"),
                    "pieces": value(end_samples, "swarm_trainer_micro_batch_pieces"),
                    "stale_share": max((s for s in stale if s is not None), default=None),
                    "round_seconds": sum(took) / sum(count) if sum(count) else None,
                    "stage_round_seconds": stage_means(servers, took, count),
                    "rounds": sum(count)}
        finally:
            procs.stop_all()


def stage_means(servers: list, took: list[float], count: list[float]) -> dict[int, float]:
    """Each stage's mean round in the window (its servers' rounds together)."""
    means = {}
    for k in sorted({k for k, _ in servers}):
        n = sum(c for (j, _), c in zip(servers, count) if j == k)
        if n:
            means[k] = sum(t for (j, _), t in zip(servers, took) if j == k) / n
    return means


def base(results: list[dict], rate: float, through_delayer: bool, transport: str, mode: str) -> float | None:
    """The samples/s of the 0 ms adaptive point at `rate` over `transport` in averaging `mode`, plain or through the
    delayer (None: not run yet)."""
    return next((b["samples_per_second"] for b in results if b["rate_mbit"] == rate and b["latency_ms"] == 0
                 and b["fixed"] is None and b["queued"] == through_delayer and b["transport"] == transport
                 and b["mode"] == mode), None)


BYTES_PER_VALUE = {"none": 4, "float16": 2, "bfloat16": 2, "blockwise8bit": 1, "float8": 1}  # (8-bit: scales left out)


def rounds_line(r: dict, config: RunConfig, n: int) -> str:
    """The window's mean averaging round against its bytes-over-rate bound (stage 0's gradient, or pseudo-gradient
    in the local mode, as the mode's compression sends it)."""
    if r["round_seconds"] is None:
        return ""
    line = (f"; {r['rounds']:.0f} averaging rounds, {r['round_seconds']:.2f} s each, of which "
            f"{r['all_reduce_seconds']:.2f} s after the group formed")
    if r["rate_mbit"] and n > 1:
        averaging = config.averaging
        codec = averaging.pseudo_gradient_compression if r.get("mode") == "local" else averaging.compression
        gradient = BYTES_PER_VALUE[codec] * sum(p.numel() for p in build_stage(config, 0).parameters())
        bound = 2 * (n - 1) / n * gradient / (r["rate_mbit"] * 1e6 / 8)
        line += (f" ({r['round_seconds'] / bound:.2f} and {r['all_reduce_seconds'] / bound:.2f} x the bound "
                 f"2(n-1)/n x {'pseudo-' if r.get('mode') == 'local' else ''}gradient ({codec}) / rate = "
                 f"{bound:.2f} s)")
        stages = r.get("stage_round_seconds") or {}
        if len(stages) > 1:
            line += "; by stage " + ", ".join(f"{k}: {t:.2f} s ({t / bound:.2f} x)" for k, t in stages.items())
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--stages", type=int, help="cut the config to this many stages (it must divide n_layer)")
    p.add_argument("--latencies", type=float, nargs="+", default=[0, 10, 50, 100], help="one-way ms between hosts")
    p.add_argument("--rates", type=float, nargs="+", default=[0, 100, 20], help="Mbit/s each way per host; 0: none")
    p.add_argument("--fixed", action="store_true", help="also run each point with the old fixed in-flight count")
    p.add_argument("--in-flight", type=int, nargs="+", default=[], metavar="N",
                   help="also run each point with the trainer's in-flight count fixed at each N")
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--window", type=float, default=40.0)
    p.add_argument("--servers-per-stage", type=int, default=1, help="servers of each stage, each on its own host")
    p.add_argument("--nat-stage", type=int, help="put this stage's servers behind NAT (reached through the relay)")
    p.add_argument("--nat-reachability", default="auto", choices=("auto", "private"),
                   help="--reachability of the servers behind NAT")
    p.add_argument("--nat-trainer", action="store_true", help="put the trainer behind NAT too (its own)")
    p.add_argument("--trainer-rate", type=float,
                   help="Mbit/s each way on the trainer's link alone, 0: unlimited (default: the point's rate): "
                        "servers on home uplinks, their trainer in a datacenter")
    p.add_argument("--hub-latency", type=float, help="one-way ms on the coordinator's link alone (the relay's), "
                   "instead of half the latency asked for: a relayed call crosses it twice each way")
    p.add_argument("--delayer-control", action="store_true",
                   help="also run 0 ms with every link through the userspace delayer (which latency needs), and "
                        "print each point against it too: the latency's own cost, without the delayer's CPU")
    p.add_argument("--transports", nargs="+", default=["tcp"], choices=sorted(TRANSPORTS),
                   help="what every peer listens on (each a run of all the points): tcp (TCP, yamux streams), "
                        "quic (QUIC v1 over UDP), both")
    p.add_argument("--modes", nargs="+", default=["every_step"], choices=("every_step", "local"),
                   help="averaging.mode of each run of a point")
    p.add_argument("--local-steps", type=int, default=50, help="averaging.local_steps in the local mode")
    p.add_argument("--wire-dtype", help="stages.wire_dtype (default: the config's)")
    p.add_argument("--pseudo-gradient-compression",
                   help="averaging.pseudo_gradient_compression in the local mode (default: the config's)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    config = RunConfig.load(args.config)
    config.optimizer.batch_size = args.batch_size
    if args.stages is not None:
        config.stages.num_stages = args.stages
    if args.wire_dtype is not None:
        config.stages.wire_dtype = args.wire_dtype
    if args.pseudo_gradient_compression is not None:
        config.averaging.pseudo_gradient_compression = args.pseudo_gradient_compression
    config.data.max_bytes = min(config.data.max_bytes or 300_000, 300_000)
    config.validate()
    old = default_in_flight(config)
    results = []
    with tempfile.TemporaryDirectory(prefix="swarm-wan-") as tmp:
        config_paths = {}
        for mode in args.modes:
            config.averaging.mode, config.averaging.local_steps = mode, args.local_steps
            config_paths[mode] = Path(tmp) / f"config-{mode}.yaml"
            config.validate().save(config_paths[mode])
        points = [(latency, False) for latency in args.latencies]
        if args.delayer_control:  # right after the plain 0 ms point (or first)
            at = next((i + 1 for i, (latency, _) in enumerate(points) if latency == 0), 0)
            points.insert(at, (0.0, True))
        counts = list(dict.fromkeys([None, *([old] if args.fixed else []), *args.in_flight]))  # (each once)
        for transport, rate in itertools.product(args.transports, args.rates):
            for (latency, queued), fixed, mode in itertools.product(points, counts, args.modes):
                workdir = Path(tmp) / f"{transport}-r{rate}-l{latency}-{fixed}-{'q' if queued else 'd'}-{mode}"
                workdir.mkdir()
                r = measure(config_paths[mode], config.stages.num_stages, latency, rate, fixed, args.warmup,
                            args.window, workdir, args.servers_per_stage, args.nat_stage,
                            args.nat_reachability, args.nat_trainer, args.hub_latency, queued, transport,
                            args.trainer_rate)
                r["mode"] = mode
                results.append(r)

                plain, control = (base(results, rate, through, transport, mode) for through in (False, True))
                ratio = f"{r['samples_per_second'] / plain:.2f}" if plain else "-"
                ratio += " of 0 ms adaptive"
                if control and not (latency == 0 and queued):
                    ratio += f", {r['samples_per_second'] / control:.2f} of 0 ms through the delayer"
                if mode != "every_step" and len(results) > 1 and results[-2].get("mode") == "every_step":
                    ratio += f"; {r['samples_per_second'] / results[-2]['samples_per_second']:.2f} x every_step"
                stale = "-" if r["stale_share"] is None else f"{100 * r['stale_share']:.0f}%"
                trainer_link = "" if args.trainer_rate is None else \
                    f" (the trainer: {f'{args.trainer_rate:g} Mbit/s' if args.trainer_rate else 'unlimited'})"
                pieces = f" in {r['pieces']:.0f} pieces each" if r["pieces"] > 1 else ""
                print(f"{config.run_id} batch {config.optimizer.batch_size}, {mode}, {transport}, "
                      f"{latency:g} ms one way"
                      f"{' (through the delayer)' if queued else ''}, "
                      f"{'unlimited' if not rate else f'{rate:g} Mbit/s'}"
                      f"{trainer_link}, in flight "
                      f"{'adaptive' if fixed is None else f'fixed {fixed}'}: {r['samples_per_second']:.1f} "
                      f"samples/s ({ratio}), {r['in_flight']:.0f} in flight at the end{pieces}, "
                      f"{stale} of backwards stale; all servers serving {r['joined_s']:.1f} s after the "
                      f"coordinator" + rounds_line(r, config, args.servers_per_stage), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
