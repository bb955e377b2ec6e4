"""One averaging round of a stage: StageAverager vs hivemind's raw DecentralizedAverager, side by side.

For each group size n, n DHT peers on 127.0.0.1 in this process, each with one StageAverager over
the stage module of stage 1 of configs/small.yaml (about 6.3M parameters) and one plain
DecentralizedAverager over tensors of the same shapes, with the same codec and timeouts. Every
round fills the gradients (and the raw buffers) with random values; rounds of the two alternate,
after one warm-up round each (connections open then).

Printed per n, medians over the repeats:
- ours: a round as StageAverager times it (swarm_averaging_round_seconds: gradients into the
  buffers, matchmaking, all-reduce, mean out of the buffers); "step" adds closing the batch and
  the AdamW step, i.e. StageAverager.step() that starts the round and the one that applies it;
  "formed" is the round's start latency (swarm_averaging_round_start_seconds: from handing the
  batch to the round until its group formed), the last member's, since the group can only form
  once every member has joined;
- raw: DecentralizedAverager.step() as its caller sees it, and the same with what a caller
  averaging gradients must add: copying them into the averager's tensors and the mean back out
  (ours does both inside its round);
- matchmaking and the all-reduce apart, on both sides: ours forms the next round's group ahead
  (while the batch fills), so little of its matchmaking is in its round; raw forms it in its round
  (hivemind's step with a trigger: the time until the group formed, then the rest);
- ours/raw of the round (goal <= 1.1), against both, and of the all-reduce alone;
- bytes each peer sent: what its averaging process wrote (/proc/PID/io wchar: its all-reduce
  parts, written to the local p2pd's socket, plus small control messages), beside the
  2(n-1)/n x (payload after compression) an all-reduce must send, and our
  swarm_averaging_bytes_sent estimate (computed from that same formula, so not a measurement).

    .venv/bin/python bench/averaging.py            # n = 2, 3, 4; 5 timed rounds each
    .venv/bin/python bench/averaging.py --quick    # n = 2, 3; 2 timed rounds each
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionInfo
from prometheus_client import CollectorRegistry

from swarm.averaging import INITIAL_ROUND, ProgressChannel, StageAverager, averaging_prefix
from swarm.averaging.codecs import installed_compression as compression_for
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, SwarmRecords, load_identity, peer_id, start_dht, visible_maddrs
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState

STAGE = 1
HOST = ["/ip4/127.0.0.1/tcp/0"]
READY_TIMEOUT = 30.0  # every StageAverager sees the stage's full batch through the DHT
POLL = 0.05


class Member:
    """One peer of the benchmark: a DHT node, our averager over a stage module, a raw averager."""

    def __init__(self, config: RunConfig, initial_peers: list[str], registry: CollectorRegistry,
                 host_maddrs: list[str] = HOST, stage: int = STAGE, channel: bool = False):
        identity = load_identity(None)
        self.dht = start_dht(config.run_id, identity, initial_peers=initial_peers, host_maddrs=host_maddrs)
        self.registry, self.stage = registry, stage
        # With `channel`, progress also goes straight to the other members, as a stage server's does (else
        # only through the DHT, read each progress period)
        self.loop = BackgroundLoop("avgbench-loop").start() if channel else None
        self.p2p = None if self.loop is None else self.loop.run(self.dht.replicate_p2p(), READY_TIMEOUT)
        self.ours: StageAverager | None = None
        self.raw: DecentralizedAverager | None = None
        self.records = SwarmRecords(self.dht, config.run_id, identity)

    def start(self, config: RunConfig, group_size: int) -> None:
        """Fork both averaging processes (on the main thread, as StageAverager requires)."""
        module = build_stage(config, self.stage)
        optimizer = StageOptimizer(module, config.optimizer)
        state = StageState(module, optimizer, self.stage, INITIAL_ROUND)
        self.ours = StageAverager(state, self.dht, config.averaging, run_id=config.run_id,
                                  owner_key=self.records.local_owner_key,
                                  peer_id=peer_id(self.dht), registry=self.registry)
        channel = None if self.p2p is None else \
            ProgressChannel(self.p2p, self.loop, averaging_prefix(config.run_id, self.stage))
        self.ours.start(lambda: None, channel)  # this benchmark calls step() itself
        avg = config.averaging
        self.raw = DecentralizedAverager(
            [torch.zeros_like(p) for p in optimizer.params], self.dht, start=True, prefix=f"{config.run_id}_raw",
            target_group_size=group_size, min_group_size=2, min_matchmaking_time=avg.min_matchmaking_time,
            request_timeout=avg.request_timeout, allreduce_timeout=avg.allreduce_timeout,
            next_chunk_timeout=avg.next_chunk_timeout, compression=compression_for(avg.compression),
            allow_state_sharing=False, shutdown_timeout=avg.shutdown_timeout)
        self.raw.wait_until_ready(READY_TIMEOUT)

    def shutdown(self) -> None:
        if self.ours is not None:
            self.ours.shutdown()
        if self.raw is not None and self.raw.is_alive():
            self.raw.shutdown()
        self.dht.shutdown()
        if self.loop is not None:
            self.loop.stop()

    def round_seconds(self) -> float:
        return self.registry.get_sample_value("swarm_averaging_round_seconds_sum", {"stage": str(self.stage)}) or 0.0

    def start_seconds(self) -> float:
        return self.registry.get_sample_value("swarm_averaging_round_start_seconds_sum",
                                              {"stage": str(self.stage)}) or 0.0

    def estimated_bytes(self) -> float:
        return self.registry.get_sample_value("swarm_averaging_bytes_sent_total", {"stage": str(self.stage)}) or 0.0


@contextlib.contextmanager
def members(config: RunConfig, n: int) -> Iterator[list[Member]]:
    started: list[Member] = []
    try:
        initial: list[str] = []
        for _ in range(n):
            started.append(Member(config, initial, CollectorRegistry()))
            initial = initial or visible_maddrs(started[0].dht)
        for member in started:
            member.start(config, n)
        yield started
    finally:
        for member in reversed(started):
            member.shutdown()


def written(pid: int) -> int:
    """Bytes process `pid` has written through system calls so far."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io has no wchar")


def together(calls: list[Callable[[], object]]) -> list[tuple[float, object]]:
    """Run the calls at once on threads; (seconds, result) of each."""
    barrier = threading.Barrier(len(calls))

    def timed(call: Callable[[], object]) -> tuple[float, object]:
        barrier.wait()
        started = time.perf_counter()
        result = call()
        return time.perf_counter() - started, result

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(timed, calls))


def ours_round(group: list[Member], batch_size: int) -> dict:
    n = len(group)
    for member in group:
        optimizer = member.ours.optimizer
        optimizer.zero_grad()
        grads = [torch.randn_like(param) for param in optimizer.params]
        member.ours.accumulate(grads, -(-batch_size // n))  # the group holds a full batch between them
    deadline = time.monotonic() + READY_TIMEOUT
    # every member sees the batch, and every other member (else it would expect a smaller group)
    while not all(m.ours.view().samples >= batch_size and m.ours.view().group_size == n for m in group):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the averagers did not see the stage's batch within {READY_TIMEOUT:g}s")
        time.sleep(POLL)
    before = [(m.round_seconds(), written(m.ours.process_id), m.estimated_bytes(), m.start_seconds()) for m in group]
    results = together([lambda m=m: whole_step(m.ours) for m in group])
    outcomes = [(stats or {}).get("averaging") for _, stats in results]
    if outcomes != ["succeeded"] * n or any(stats["group_size"] != n for _, stats in results):
        raise RuntimeError(f"a round of ours did not average all {n}: {[stats for _, stats in results]}")
    return {
        "round": max(m.round_seconds() - b[0] for m, b in zip(group, before)),
        "step": max(seconds for seconds, _ in results),
        "sent": statistics.mean(written(m.ours.process_id) - b[1] for m, b in zip(group, before)),
        "estimated": statistics.mean(m.estimated_bytes() - b[2] for m, b in zip(group, before)),
        "formed": min(m.start_seconds() - b[3] for m, b in zip(group, before)),
    }


def whole_step(averager: StageAverager) -> dict | None:
    """Close the batch (the round runs beside), wait for the round, apply it: a server's step, end to end."""
    if averager.step() is not None or not averager.busy:
        raise RuntimeError("the batch did not go to a round")
    config = averager.config
    deadline = time.monotonic() + READY_TIMEOUT + config.matchmaking_timeout + config.allreduce_timeout
    while not averager.ready:
        if time.monotonic() > deadline:
            raise RuntimeError("the round did not end in time")
        time.sleep(0.001)
    return averager.step()


def raw_step(member: Member, grads: list[torch.Tensor], timeout: float) -> tuple[object, float, float]:
    """Gradients in, step, mean out, as a caller averaging gradients must; and the step's own time, and of
    that its matchmaking (hivemind's step with a trigger: the group forms, then the all-reduce runs on it)."""
    with member.raw.get_tensors() as tensors, torch.no_grad():
        for tensor, grad in zip(tensors, grads):
            tensor.copy_(grad)
    started = time.perf_counter()
    control = member.raw.step(weight=1.0, timeout=timeout, wait=False, require_trigger=True)
    while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and not control.done():
        time.sleep(0.001)
    formed = time.perf_counter() - started
    control.allow_allreduce()
    gathered = control.result(timeout)
    seconds = time.perf_counter() - started
    with member.raw.get_tensors() as tensors:
        [tensor.clone() for tensor in tensors]
    return gathered, seconds, formed


def raw_round(group: list[Member], timeout: float) -> dict:
    n = len(group)
    grads = {id(m): [torch.randn_like(t) for t in m.ours.optimizer.params] for m in group}
    before = [written(m.raw.pid) for m in group]
    results = together([lambda m=m: raw_step(m, grads[id(m)], timeout) for m in group])
    if any(not gathered or len(gathered) != n for _, (gathered, _, _) in results):
        raise RuntimeError(f"a raw round did not average all {n}: {[r[0] for _, r in results]}")
    # the group formed when its last member saw it; the all-reduce is the rest of the round
    formed = max(formed for _, (_, _, formed) in results)
    return {"round": max(seconds for _, (_, seconds, _) in results), "formed": formed,
            "with_copies": max(seconds for seconds, _ in results),
            "sent": statistics.mean(written(m.raw.pid) - b for m, b in zip(group, before))}


def payload_bytes(config: RunConfig, stage: int = STAGE) -> float:
    """Bytes of one replica's gradients of `stage` after the configured compression."""
    codec = compression_for(config.averaging.compression)
    params = [p for p in build_stage(config, stage).parameters() if p.requires_grad]
    return sum(p.numel() * 4 * codec.estimate_compression_ratio(CompressionInfo.from_tensor(p)) for p in params)


def measure(base: RunConfig, n: int, repeats: int) -> dict:
    config = RunConfig.from_dict({**base.to_dict(), "run_id": f"avgbench-n{n}"})
    timeout = config.averaging.matchmaking_timeout + config.averaging.allreduce_timeout
    ours, raw = [], []
    with members(config, n) as group:
        ours_round(group, config.optimizer.batch_size)  # warm-up: connections, first allocations
        raw_round(group, timeout)
        for _ in range(repeats):
            ours.append(ours_round(group, config.optimizer.batch_size))
            raw.append(raw_round(group, timeout))
    median = statistics.median
    return {
        "n": n,
        "ours_round": median(r["round"] for r in ours),
        "ours_step": median(r["step"] for r in ours),
        "ours_formed": median(r["formed"] for r in ours),
        "raw_round": median(r["round"] for r in raw),
        "raw_formed": median(r["formed"] for r in raw),
        "ours_allreduce": median(r["round"] - r["formed"] for r in ours),
        "raw_allreduce": median(r["round"] - r["formed"] for r in raw),
        "raw_with_copies": median(r["with_copies"] for r in raw),
        "ours_sent": median(r["sent"] for r in ours),
        "raw_sent": median(r["sent"] for r in raw),
        "ours_estimated": median(r["estimated"] for r in ours),
        "lower_bound": 2 * (n - 1) / n * payload_bytes(config),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/small.yaml")
    p.add_argument("--sizes", type=int, nargs="+", help="group sizes (default 2 3 4; --quick: 2 3)")
    p.add_argument("--repeats", type=int, help="timed rounds of each per size (default 5; --quick: 2)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    sizes = args.sizes or ([2, 3] if args.quick else [2, 3, 4])
    repeats = args.repeats or (2 if args.quick else 5)
    base = RunConfig.load(args.config)
    base.averaging.target_group_size = max(base.averaging.target_group_size, max(sizes))
    params = sum(p.numel() for p in build_stage(base, STAGE).parameters())
    print(f"{args.config}: stage {STAGE} has {params / 1e6:.2f}M parameters; codec {base.averaging.compression}; "
          f"medians of {repeats} rounds", flush=True)
    mb = 1e6
    for n in sizes:
        r = measure(base, n, repeats)
        print(f"n={n}: round ours {r['ours_round']:.2f}s (whole step {r['ours_step']:.2f}s; matchmaking "
              f"{r['ours_formed'] * 1000:.0f} ms after the last member joined, all-reduce "
              f"{r['ours_allreduce']:.2f}s), raw {r['raw_round']:.2f}s (matchmaking {r['raw_formed']:.2f}s, "
              f"all-reduce {r['raw_allreduce']:.2f}s; {r['raw_with_copies']:.2f}s with the gradients copied in "
              f"and out), ours/raw {r['ours_round'] / r['raw_round']:.2f} "
              f"(/ raw with copies {r['ours_round'] / r['raw_with_copies']:.2f}; all-reduce alone "
              f"{r['ours_allreduce'] / r['raw_allreduce']:.2f}); "
              f"sent per peer: ours {r['ours_sent'] / mb:.1f} MB, "
              f"raw {r['raw_sent'] / mb:.1f} MB, 2(n-1)/n bound {r['lower_bound'] / mb:.1f} MB "
              f"(ours/bound {r['ours_sent'] / r['lower_bound']:.2f}; "
              f"metric estimate {r['ours_estimated'] / mb:.1f} MB)",
              flush=True)


if __name__ == "__main__":
    main()
