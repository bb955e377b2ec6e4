"""A real small swarm, measured for the simulator's validation (bench/sim/validate.py).

    .venv/bin/python bench/sim/measure.py --config configs/small.yaml --stages 2 --in-flight 1 2 \
        --out tests/data/sim_validation.json
    sudo .venv/bin/python bench/sim/measure.py --config configs/tiny.yaml --lab 50 100 --in-flight 1 2 4 \
        --out tests/data/sim_validation_lab.json

A coordinator, one server per stage and one trainer on 127.0.0.1, for each in-flight count; with
`--lab ONE_WAY_MS MBIT` (as root, `make test-net` installs what it needs) each of them on a host of its
own in tests/netlab instead, with that latency between hosts and that rate on every link. After a
warm-up, over one window: the trainer's samples/s, and each server's busy seconds per sample (its
compute thread's utilization, swarm_server_utilization_ratio, read every 2 s and averaged, times the
window, over the samples whose backward it ran): the service times the simulator is given. Written
as JSON, one entry per in-flight count; the simulator must reproduce the samples/s from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from swarm.config import RunConfig  # noqa: E402
from tests.procs import (  # noqa: E402
    INITIAL_PEERS_LINE,
    LOCALHOST,
    ProcSet,
    free_port,
    http_get,
    metric_in,
    start_coordinator,
)

READ_EVERY = 2.0
LAB_PORT = 9100  # every lab host is its own namespace: the same metrics port on each


@dataclass
class Place:
    """Where one program runs: its namespace (None: this one, on loopback) and its metrics port."""

    netns: str | None
    port: int
    host: object = None  # its tests.netlab Host, in the lab

    def read(self, name: str) -> float:
        body = http_get(self.port, "/metrics") if self.host is None else self.host.http_get(self.port, "/metrics")
        return metric_in(body or "", name) or 0.0


def measure(config_path: Path, config: RunConfig, in_flight: int, warmup: float, window: float,
            lab: tuple[float, float | None] | None = None) -> dict:
    """One run; `lab`: (one-way ms between hosts, Mbit/s of every link or None) puts the coordinator, each
    server and the trainer on hosts of their own in tests/netlab, each link carrying half the latency."""
    stages = config.stages.num_stages
    with tempfile.TemporaryDirectory(prefix="bench-sim-measure-") as work, contextlib.ExitStack() as stack:
        if lab is not None:
            from tests.netlab import Lab

            network = stack.enter_context(Lab())  # (removed after the programs in it stopped)
        procs = ProcSet(Path(work))
        stack.callback(procs.stop_all)
        if lab is None:
            coordinator = start_coordinator(procs, config_path)
            join = ("--initial-peers", *coordinator.maddrs, *LOCALHOST)
            servers = [Place(None, free_port()) for _ in range(stages)]
            trainer = Place(None, free_port())
        else:
            one_way_ms, rate = lab
            link = {"latency_ms": one_way_ms / 2, "rate_mbit": rate}
            hub = network.add_host("hub", **link)
            servers = [Place(h.ns, LAB_PORT, h) for h in (network.add_host(f"s{k}", **link) for k in range(stages))]
            host = network.add_host("trainer", **link)
            trainer = Place(host.ns, LAB_PORT, host)
            network.start()
            listen = ("--host-maddrs", "/ip4/0.0.0.0/tcp/0")
            line = procs.start("swarm-coordinator", "--config", str(config_path), *listen,
                               netns=hub.ns).wait_for_line(INITIAL_PEERS_LINE, 120)
            join = ("--initial-peers", *[m for m in line.group(1).split() if f"/ip4/{hub.address}/" in m], *listen)
        for stage, place in enumerate(servers):
            procs.start("swarm-peer", *join, "--role", "server", "--stage", str(stage), "--metrics-port",
                        str(place.port), "--no-checkpoints", netns=place.netns)
        procs.start("swarm-peer", *join, "--role", "trainer", "--trainer-index", "0", "--in-flight",
                    str(in_flight), "--metrics-port", str(trainer.port), netns=trainer.netns)
        deadline = time.monotonic() + 600
        while trainer.read("swarm_trainer_samples_total") < config.optimizer.batch_size:
            if time.monotonic() > deadline:
                raise SystemExit("the swarm did not train within 600 s")
            time.sleep(1.0)
        time.sleep(warmup)
        samples0 = trainer.read("swarm_trainer_samples_total")
        served0 = [place.read("swarm_server_samples_total") for place in servers]
        utilization = [[] for _ in servers]
        began = time.monotonic()
        while time.monotonic() - began < window:
            time.sleep(READ_EVERY)
            for k, place in enumerate(servers):
                utilization[k].append(place.read("swarm_server_utilization_ratio"))
        took = time.monotonic() - began
        samples = trainer.read("swarm_trainer_samples_total") - samples0
        served = [place.read("swarm_server_samples_total") - s for place, s in zip(servers, served0)]
    busy = [sum(u) / len(u) * took / max(n, 1) for u, n in zip(utilization, served)]
    return {"in_flight": in_flight, "samples_per_second": samples / took, "window": took,
            "busy_seconds_per_sample": busy, "utilization": [sum(u) / len(u) for u in utilization]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/small.yaml")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 2])
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--lab", type=float, nargs=2, metavar=("ONE_WAY_MS", "MBIT"),
                   help="run each program on its own host of tests/netlab (as root), this one-way latency between "
                        "hosts and this rate on every link (0: unlimited)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lab = None if args.lab is None else (args.lab[0], args.lab[1] or None)
    config = RunConfig.load(args.config)
    config.stages.num_stages = args.stages
    config.validate()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-sim-config-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        for k in args.in_flight:
            run = measure(path, config, k, args.warmup, args.window, lab)
            print(f"in flight {k}: {run['samples_per_second']:.2f} samples/s; busy s/sample per stage "
                  f"{', '.join(f'{b:.4f}' for b in run['busy_seconds_per_sample'])}; utilization "
                  f"{', '.join(f'{u:.2f}' for u in run['utilization'])}", flush=True)
            runs.append(run)
    record = {"config": args.config, "stages": args.stages, "micro_batch_size": config.optimizer.micro_batch_size,
              "batch_size": config.optimizer.batch_size, "seq_len": config.model.seq_len,
              "d_model": config.model.d_model, "wire_bytes_per_value": 4 if config.stages.wire == "float32" else 2,
              "measured": time.strftime("%Y-%m-%d"), "runs": runs}
    if lab is not None:
        record["lab"] = {"one_way_ms": lab[0], "rate_mbit": lab[1]}
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
