"""The simulator against a real small swarm: given the service times each real server measured, does the
simulated pipeline finish as many samples per second as the real one did?

    .venv/bin/python bench/sim/validate.py [tests/data/sim_validation.json | tests/data/sim_validation_lab.json]

The file comes from bench/sim/measure.py (a coordinator, one server per stage and a trainer on
127.0.0.1, or on hosts of the network lab, per in-flight count). Each real server becomes a simulated
one pinned to its stage, whose speed makes a forward and backward of one sample take the busy seconds
that server measured; the network is loopback (one region, 0.2 ms, 8 Gbit/s) or the lab's (one region,
its one-way latency, its rate on every link); one trainer with the same in-flight count, no churn.
Printed: simulated / measured samples/s per in-flight count (the goal: within 15%).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sim import swarm as model  # noqa: E402
from bench.sim.swarm import Scenario, simulate  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[2] / "tests" / "data" / "sim_validation.json"
LAB_RECORD = DEFAULT.with_name("sim_validation_lab.json")  # tiny.yaml in tests/netlab at 50 ms one way
SECONDS_PER_SAMPLE = 0.01
LOOPBACK, LAB = "loopback", "lab"
UNLIMITED_MBIT = 8000


def simulated(record: dict, run: dict, minutes: float = 10.0) -> float:
    """Samples/s the simulator finishes for one measured run."""
    lab = record.get("lab")  # measured in tests/netlab: every host this far from the others, every link this fast
    region = LAB if lab else LOOPBACK
    model.ONE_WAY_MS[(region, region)] = lab["one_way_ms"] if lab else 0.2
    rate = (lab or {}).get("rate_mbit") or UNLIMITED_MBIT
    stages = record["stages"]
    scenario = Scenario(stages=stages, servers=stages, trainers=1, micro_batch=record["micro_batch_size"],
                        in_flight=run["in_flight"], seconds_per_sample=SECONDS_PER_SAMPLE,
                        wire_bytes_per_sample=record["seq_len"] * record["d_model"] * record.get(
                            "wire_bytes_per_value", 4), token_bytes_per_sample=record["seq_len"] * 8,
                        session=0.0, rebalance=False, links=(((rate, rate), 1.0),), nat_share=0.0, regions=(region,),
                        join_overhead=1.0, choose_spread=0.0, stage_state_bytes=0)
    # busy seconds per sample = (forward 1 + backward 2) x SECONDS_PER_SAMPLE / speed
    pinned = [(k, 3 * SECONDS_PER_SAMPLE / busy) for k, busy in enumerate(run["busy_seconds_per_sample"])]
    _, windows = simulate(scenario, minutes * 60, window=minutes * 60, warmup=60.0, pinned=pinned)
    return windows[0].samples_per_second


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    record = json.loads(path.read_text())
    lab = record.get("lab")
    where = (f"in the network lab at {lab['one_way_ms']:g} ms one way, {lab['rate_mbit'] or 'unlimited'} Mbit/s"
             if lab else "on loopback")
    print(f"{record['config']} cut to {record['stages']} stages, {where}, measured {record['measured']}")
    for run in record["runs"]:
        sim = simulated(record, run)
        print(f"in flight {run['in_flight']}: measured {run['samples_per_second']:.2f} samples/s, simulated "
              f"{sim:.2f}: {sim / run['samples_per_second']:.3f}")


if __name__ == "__main__":
    main()
