"""What each peer sends per sample, measured, against the README's formula (swarm.traffic).

    .venv/bin/python bench/traffic.py [--config configs/tiny.yaml] [--servers-per-stage 2] [--seconds 60]

A coordinator, N servers per stage and one trainer on 127.0.0.1. After the trainer's first samples,
every peer's /metrics is read at the start and the end of a window; the table gives, per peer, the
bytes it sent in the window by kind (swarm_bytes_sent_total) per sample the swarm trained in it
(the trainer's swarm_trainer_samples_total), next to swarm.traffic.wire_bytes_per_sample; and per
server, the averaging bytes per round against the all-reduce's payload, 2(n-1)/n x the stage's
parameters x 4 bytes (compression none), n the round's group size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import RunConfig  # noqa: E402
from swarm.model import build_stage  # noqa: E402
from swarm.traffic import KINDS, wire_bytes_per_sample  # noqa: E402
from tests.procs import LOCALHOST, ProcSet, free_port, http_get, metric_in, start_coordinator  # noqa: E402

WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def scrape(port: int) -> dict[str, float]:
    body = http_get(port, "/metrics") or ""
    figures = {kind: metric_in(body, "swarm_bytes_sent_total", kind=kind) or 0.0 for kind in KINDS}
    for name in ("swarm_trainer_samples_total", "swarm_averaging_group_size"):
        figures[name] = metric_in(body, name) or 0.0
    figures["rounds"] = metric_in(body, "swarm_averaging_rounds_total", outcome="succeeded") or 0.0
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--servers-per-stage", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    args = parser.parse_args()
    config = RunConfig.load(args.config)
    stages, model = config.stages.num_stages, config.model
    wire = config.stages.wire
    expected = wire_bytes_per_sample(model.seq_len, model.d_model, stages, WIRE_BYTES.get(wire, 4))
    params = [sum(p.numel() for p in build_stage(config, s).parameters()) for s in range(stages)]
    with tempfile.TemporaryDirectory(prefix="bench-traffic-") as work:
        procs = ProcSet(Path(work))
        try:
            coordinator = start_coordinator(procs, Path(args.config), metrics_port=free_port())
            join = ("--initial-peers", *coordinator.maddrs, *LOCALHOST)
            ports = {"coordinator": coordinator.metrics_port}
            for stage in range(stages):
                for replica in range(args.servers_per_stage):
                    port = ports[f"stage {stage} #{replica}"] = free_port()
                    procs.start("swarm-peer", *join, "--role", "server", "--stage", str(stage),
                                "--metrics-port", str(port))
            trainer = ports["trainer"] = free_port()
            procs.start("swarm-peer", *join, "--role", "trainer", "--metrics-port", str(trainer))
            deadline = time.monotonic() + 300
            while scrape(trainer)["swarm_trainer_samples_total"] < 10 * config.optimizer.batch_size:
                if time.monotonic() > deadline:
                    raise SystemExit("the swarm did not train within 300 s")
                time.sleep(1.0)
            start = {name: scrape(port) for name, port in ports.items()}
            began = time.monotonic()
            time.sleep(args.seconds)
            end = {name: scrape(port) for name, port in ports.items()}
            took = time.monotonic() - began
        finally:
            procs.stop_all()
    delta = {name: {key: end[name][key] - start[name][key] for key in end[name]} for name in ports}
    samples = delta["trainer"]["swarm_trainer_samples_total"]
    print(f"{args.config}, {args.servers_per_stage} server(s) per stage, wire {wire}: {samples:.0f} samples "
          f"in {took:.0f} s ({samples / took:.1f}/s)")
    print(f"{'peer':<14} {'fwd+bwd B/sample':>17} {'formula':>9} {'ratio':>6} {'avg B/round':>12} "
          f"{'payload':>10} {'ratio':>6} {'DHT B/s':>8}")
    rows = {name: (delta[name]["forward"] + delta[name]["backward"]) / samples for name in ports}
    for stage in range(stages):  # a stage's servers split its samples as the trainer routes them
        rows[f"stage {stage} (all)"] = sum(value for name, value in rows.items() if name.startswith(f"stage {stage} #"))
    for name, wire_sent in rows.items():
        line = f"{name:<14} {wire_sent:>17.0f} "
        formula = expected.get(name.replace(" (all)", "")) if name == "trainer" or "(all)" in name else None
        line += f"{formula:>9.0f} {wire_sent / formula:>6.3f} " if formula else f"{'':>9} {'':>6} "
        got = delta.get(name)
        if got is not None and got["rounds"] > 0:
            n = end[name]["swarm_averaging_group_size"]
            payload = 2 * (n - 1) / n * params[int(name.split()[1])] * 4
            per_round = got["averaging"] / got["rounds"]
            line += f"{per_round:>12.0f} {payload:>10.0f} {per_round / payload:>6.3f} "
        else:
            line += f"{'':>12} {'':>10} {'':>6} "
        print(line + (f"{got['dht'] / took:>8.0f}" if got is not None else ""))


if __name__ == "__main__":
    main()
