"""A real small swarm, measured for the simulator's validation (bench/sim/validate.py).

    .venv/bin/python bench/sim/measure.py --config configs/small.yaml --stages 2 --in-flight 1 2 \
        --out tests/data/sim_validation.json

A coordinator, one server per stage and one trainer on 127.0.0.1, for each in-flight count. After a
warm-up, over one window: the trainer's samples/s, and each server's busy seconds per sample (its
compute thread's utilization, swarm_server_utilization_ratio, read every 2 s and averaged, times the
window, over the samples whose backward it ran): the service times the simulator is given. Written
as JSON, one entry per in-flight count; the simulator must reproduce the samples/s from them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from swarm.config import RunConfig  # noqa: E402
from tests.procs import LOCALHOST, ProcSet, free_port, http_get, metric_in, start_coordinator  # noqa: E402

READ_EVERY = 2.0


def read(port: int, name: str) -> float:
    return metric_in(http_get(port, "/metrics") or "", name) or 0.0


def measure(config_path: Path, config: RunConfig, in_flight: int, warmup: float, window: float) -> dict:
    stages = config.stages.num_stages
    with tempfile.TemporaryDirectory(prefix="bench-sim-measure-") as work:
        procs = ProcSet(Path(work))
        try:
            coordinator = start_coordinator(procs, config_path)
            join = ("--initial-peers", *coordinator.maddrs, *LOCALHOST)
            servers = []
            for stage in range(stages):
                port = free_port()
                procs.start("swarm-peer", *join, "--role", "server", "--stage", str(stage), "--metrics-port",
                            str(port), "--no-checkpoints")
                servers.append(port)
            trainer = free_port()
            procs.start("swarm-peer", *join, "--role", "trainer", "--trainer-index", "0", "--in-flight",
                        str(in_flight), "--metrics-port", str(trainer))
            deadline = time.monotonic() + 600
            while read(trainer, "swarm_trainer_samples_total") < config.optimizer.batch_size:
                if time.monotonic() > deadline:
                    raise SystemExit("the swarm did not train within 600 s")
                time.sleep(1.0)
            time.sleep(warmup)
            samples0 = read(trainer, "swarm_trainer_samples_total")
            served0 = [read(port, "swarm_server_samples_total") for port in servers]
            utilization = [[] for _ in servers]
            began = time.monotonic()
            while time.monotonic() - began < window:
                time.sleep(READ_EVERY)
                for k, port in enumerate(servers):
                    utilization[k].append(read(port, "swarm_server_utilization_ratio"))
            took = time.monotonic() - began
            samples = read(trainer, "swarm_trainer_samples_total") - samples0
            served = [read(port, "swarm_server_samples_total") - s for port, s in zip(servers, served0)]
        finally:
            procs.stop_all()
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
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    config = RunConfig.load(args.config)
    config.stages.num_stages = args.stages
    config.validate()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-sim-config-") as tmp:
        path = Path(tmp) / "run.yaml"
        config.save(path)
        for k in args.in_flight:
            run = measure(path, config, k, args.warmup, args.window)
            print(f"in flight {k}: {run['samples_per_second']:.2f} samples/s; busy s/sample per stage "
                  f"{', '.join(f'{b:.4f}' for b in run['busy_seconds_per_sample'])}; utilization "
                  f"{', '.join(f'{u:.2f}' for u in run['utilization'])}", flush=True)
            runs.append(run)
    record = {"config": args.config, "stages": args.stages, "micro_batch_size": config.optimizer.micro_batch_size,
              "batch_size": config.optimizer.batch_size, "seq_len": config.model.seq_len,
              "d_model": config.model.d_model, "measured": time.strftime("%Y-%m-%d"), "runs": runs}
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
