"""Sharded optimizer state (averaging.zero) vs unsharded averaging, side by side in one run.

Every part runs real StageAveragers on n DHT peers on 127.0.0.1, each peer with its own BackgroundLoop
and P2P replica (the ProgressChannel a sharded averager requires) and holding one averager with
averaging.zero on and one with it off (the same stage, under two run ids, so the two groups never
meet). Both are fed the same gradients and stepped the same way; codec "none" for both (zero requires
it). In bytes and loss all n peers live in this one process; in time, by default, each peer is a
process of its own, as each server is in a swarm (--in-process: all in this one). Parts (--parts,
default all):

bytes  stage 1 of configs/small.yaml (~6.3M parameters; averaging.zero.chunk_elements as configured,
       or --chunk-elements: at the default 2**11, 3079 chunks),
       n = 2, 3, 4 and r = 1, 2: after one real round each, the bytes of AdamW moments every member
       holds sharded (``optimizer.shards.nbytes``) over those it holds unsharded (torch AdamW's
       ``optimizer.state_bytes()``): max and mean over the members, next to the goal 1.05 x r/n.
       Chunks are placed by rendezvous hashing, so with few chunks the max can exceed the goal.
time   the same stage, n members: rounds on random gradients (the same on both sides), medians over
       --repeats after a warm-up round each, the two sides alternating; r = 2 by default (--replicas).
       By default every member is a process of its own (multiprocessing "spawn"): its DHT peer
       (joining the first member's), loop, P2P replica, ProgressChannel and its two averagers; this
       process only sends commands over pipes. For each round every member draws its gradient sums
       from the round's seed and its index (the same on both sides), hands them to the averager and
       waits until it sees the stage's full batch and all n members; once all have, every member is
       told to step at once, and each reports its numbers. With --in-process all n members live in
       this process as in bytes (each round stepped from n threads started together on a barrier):
       then the n members' sharded collectives, which run in each server's own process (its P2P loop
       and averaging thread), share one interpreter lock, while hivemind's all-reduce runs in each
       member's forked averaging process, so this mode handicaps the sharded side; it is kept for
       comparison. Printed, the same in both modes:
       "round" is what swarm_averaging_round_seconds observes (the max over members of the delta
       of its sum; the sharded round is observed in the same histogram): for zero, flattening
       the gradient, matchmaking (hivemind forms the group) and the collective (reduce-scatter,
       norm, steps of the owned chunks, all-gather of updates); unsharded, matchmaking and
       hivemind's all-reduce. "step" is the whole step as a server's compute thread sees it: from
       handing the batch to the round (StageAverager.step()) until the step that applies it
       returned (the max over members). Goal: zero / unsharded <= 1.1. Also: when the group formed
       after the last member joined (swarm_averaging_round_start_seconds, the min over members),
       what each member sent (zero: the tensors' bytes it sent, measured; unsharded: the
       swarm_averaging_bytes_sent estimate, 2(n-1)/n x the gradient), the largest parameter
       difference between the two sides after the same rounds (zero is exact AdamW, so it should be
       at float rounding level; each member compares its own two replicas), and whether the members'
       replicas of each side agree after every round (the sum and the sum of squares of their
       parameters, in float64: "identical", or how far apart, relative; the unsharded side differs
       at float rounding level, hivemind's all-reduce not giving every member the same bits).
       Only with members in processes, a "cpu" line: the CPU seconds one member used during its
       whole step in its own process (all threads: the compute thread, the P2P loop, the sharded
       collective, AdamW) and in the processes under it (the p2p daemon, which relays every message,
       and hivemind's DHT and averaging processes, where the unsharded all-reduce runs); mean over
       members, median over rounds. n x (the two numbers' sum) / the machine's cores bounds the whole
       step's time from below; on 2 cores both sides are CPU-bound.
       Caveat: zero sends (2(n-1) + r - 1)/n x the gradient (a primary also sends the clipped mean to
       each co-owner), i.e. more than the all-reduce when r > 1.
       A round that fails (either side) is reported and the pair measured once more on fresh groups;
       a member process that dies or does not answer within REPLY_TIMEOUT fails that n.
loss   configs/tiny.yaml as one stage (the whole ~0.87M-parameter model, num_stages = 1; 423 chunks at
       2**11), n = 2, 3 (--loss-sizes; --quick: 2) servers, r = 2, batch = n x micro-batch: each step every
       server gets one micro-batch of real data (the stdlib corpus, the same micro-batches for both
       sides), computes its gradient on its own replica, and the group takes one step; after --steps
       steps, the validation loss (ReferenceTrainer's windows) of member 0's parameters, zero /
       unsharded (goal <= 1.01). Beside it, a single StageOptimizer fed every micro-batch (the exact
       math both sides should follow), the training-loss trajectories, and how far apart the
       parameters are (max abs after each step, relative L2 at the end). Both sides follow the
       reference to float rounding (~1e-6) until tiny's loss spikes (n = 3: a gradient norm of ~120
       at step 14, just after the warm-up reached lr 3e-3); from there rounding differences grow to
       ~1e-2, the unsharded side's as much as zero's, so past that step the ratio measures that
       chaos as much as zero: compare it with unsharded/reference, printed beside it. (n = 2 drifts
       apart from about step 16 too.) A failed round restarts that n's training on fresh groups once.

    .venv/bin/python bench/zero.py                  # n = 2, 3, 4; 3 timed rounds; loss n = 2, 3, 30 steps
    .venv/bin/python bench/zero.py --quick          # n = 2, 3; 1 timed round; loss n = 2, 10 steps
    .venv/bin/python bench/zero.py --parts bytes time --replicas 1 2
    .venv/bin/python bench/zero.py --parts time --in-process   # time with every member in this process
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from hivemind.p2p import P2P
from prometheus_client import CollectorRegistry

from swarm.averaging import INITIAL_ROUND, ProgressChannel, StageAverager, averaging_prefix
from swarm.config import RunConfig
from swarm.data import BatchSampler, eval_batches, load_tokenizer, load_tokens, sampler_seed
from swarm.dht import BackgroundLoop, SwarmRecords, load_identity, peer_id, start_dht, visible_maddrs
from swarm.logs import setup_logging
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.reference import EVAL_BATCHES
from swarm.state import StageState

STAGE = 1  # bytes and time: stage 1 of configs/small.yaml
HOST = ["/ip4/127.0.0.1/tcp/0"]
READY_TIMEOUT = 30.0  # every averager sees the stage's full batch through the DHT or its channel
LOOP_TIMEOUT = 30.0  # replicating a DHT's P2P on its loop
POLL = 0.02
LOSS_REPLICAS = 2  # r in the loss part (ZeroConfig's default)
DRIFT = 1e-4  # loss part: parameters further apart than this (max abs) count as diverged
ATTEMPTS = 2  # a pair of groups whose round failed is measured once more, on fresh groups
PARTS = ("bytes", "time", "loss")
MB = 1e6
START_TIMEOUT = 180.0  # time part, members in processes: a member's imports, its DHT peer and joining the first
REPLY_TIMEOUT = 300.0  # ... any other command (a round's own deadlines are shorter: READY_TIMEOUT, the configs')
STOP_TIMEOUT = 60.0  # ... a member shutting down after "stop", before it is terminated


@dataclass
class Peer:
    """One machine of the benchmark: a DHT node, its loop and P2P replica, its signing identity."""

    dht: object
    loop: BackgroundLoop
    p2p: P2P
    records: SwarmRecords
    peer_id: str


def start_peer(run_id: str, initial: Sequence[str], stack: contextlib.ExitStack) -> Peer:
    """A peer (joined through `initial`, if any), shut down when `stack` closes (its DHT, then its loop)."""
    loop = BackgroundLoop("zerobench-loop").start()
    stack.callback(loop.stop)
    identity = load_identity(None)
    dht = start_dht(run_id, identity, initial_peers=list(initial), host_maddrs=HOST)
    stack.callback(dht.shutdown)  # before loop.stop: callbacks unwind in reverse
    p2p = loop.run(dht.replicate_p2p(), LOOP_TIMEOUT)
    return Peer(dht, loop, p2p, SwarmRecords(dht, run_id, identity), peer_id(dht))


@contextlib.contextmanager
def running_peers(run_id: str, n: int) -> Iterator[list[Peer]]:
    """n peers in this process, the others joined through the first; each shut down on exit."""
    with contextlib.ExitStack() as stack:
        peers: list[Peer] = []
        initial: list[str] = []
        for _ in range(n):
            peers.append(start_peer(run_id, initial, stack))
            initial = initial or visible_maddrs(peers[0].dht)
        yield peers


class Replica:
    """One StageAverager (its own module, optimizer and metrics registry) on one peer."""

    def __init__(self, peer: Peer, config: RunConfig, stage: int, stack: contextlib.ExitStack):
        self.stage = stage
        module = build_stage(config, stage)
        optimizer = StageOptimizer(module, config.optimizer)
        self.registry = CollectorRegistry()
        self.averager = StageAverager(StageState(module, optimizer, stage, INITIAL_ROUND), peer.dht, config,
                                      owner_key=peer.records.local_owner_key, peer_id=peer.peer_id,
                                      registry=self.registry)
        stack.callback(self.averager.shutdown)
        channel = ProgressChannel(peer.p2p, peer.loop, averaging_prefix(config.run_id, stage))
        self.averager.start(lambda: None, channel)  # this benchmark calls step() itself

    @property
    def module(self) -> torch.nn.Module:
        return self.averager.optimizer.module

    @property
    def params(self) -> list[torch.Tensor]:
        return self.averager.optimizer.params

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name, {"stage": str(self.stage)}) or 0.0

    def counters(self) -> tuple[float, float, float]:
        return (self.metric("swarm_averaging_round_seconds_sum"),
                self.metric("swarm_averaging_round_start_seconds_sum"),
                self.metric("swarm_averaging_bytes_sent_total"))


def group(peers: Sequence[Peer], config: RunConfig, stage: int, stack: contextlib.ExitStack) -> list[Replica]:
    """One replica per peer (created on the main thread: each forks its averaging process)."""
    return [Replica(peer, config, stage, stack) for peer in peers]


def derived(base: RunConfig, run_id: str, *, zero: bool, replicas: int = 2, batch_size: int | None = None) -> RunConfig:
    """`base` under another run id, codec none, zero on or off (chunk size as `base` has it)."""
    config = RunConfig.from_dict({**base.to_dict(), "run_id": run_id})
    config.averaging.compression = "none"
    config.averaging.zero.enabled = zero
    config.averaging.zero.replicas = replicas
    if batch_size is not None:
        config.optimizer.batch_size = batch_size
    return config.validate()


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


def hand_over(replica: Replica, grads: list[torch.Tensor], samples: int, what: str) -> None:
    replica.averager.accumulate(grads, samples)
    if replica.averager.held_samples:
        raise RuntimeError(f"{what}: a replica held its samples for the next step")


def wait_full(replicas: Sequence[Replica], n: int, what: str) -> None:
    """Until each of `replicas` sees the stage's full batch and all n members (through the DHT or its channel)."""
    batch_size = replicas[0].averager.batch_size
    deadline = time.monotonic() + READY_TIMEOUT
    while not all(r.averager.view().samples >= batch_size and r.averager.view().group_size == n for r in replicas):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the averagers did not see the stage's batch within {READY_TIMEOUT:g}s")
        time.sleep(POLL)


def check_stats(stats: Sequence[dict | None], n: int, what: str) -> None:
    if any(not s or s.get("averaging") != "succeeded" or s.get("group_size") != n for s in stats):
        raise RuntimeError(f"{what}: a round did not average all {n}: {list(stats)}")


def round_times(deltas: Sequence[Sequence[float]], steps: Sequence[float]) -> dict:
    """The members' counter deltas (round, formed, sent) and whole-step seconds, as one round's numbers."""
    return {"round": max(d[0] for d in deltas), "formed": min(d[1] for d in deltas),  # the last member's
            "sent": statistics.mean(d[2] for d in deltas), "step": max(steps)}


def one_round(replicas: list[Replica], grads: list[list[torch.Tensor]], samples: list[int], what: str) -> dict:
    """Hand each replica its gradient sums (copies), wait until every one sees the full batch and the
    whole group, then step them all at once; the round's and the step's times."""
    n = len(replicas)
    for replica, mine, count in zip(replicas, grads, samples):
        hand_over(replica, [g.clone() for g in mine], count, what)
    wait_full(replicas, n, what)
    before = [r.counters() for r in replicas]
    results = together([lambda r=r: whole_step(r.averager) for r in replicas])
    check_stats([s for _, s in results], n, what)
    deltas = [[a - b for a, b in zip(r.counters(), c)] for r, c in zip(replicas, before)]
    return {**round_times(deltas, [seconds for seconds, _ in results]),
            "spread": spread([fingerprint(r.params) for r in replicas])}


def random_grads(replicas: list[Replica], generator: torch.Generator) -> list[list[torch.Tensor]]:
    return [[torch.randn(p.shape, generator=generator) for p in r.params] for r in replicas]


def max_param_diff(a: Replica, b: Replica) -> float:
    return max_diff(a.params, b.params)


def fingerprint(params: Sequence[torch.Tensor]) -> tuple[float, float]:
    """The sum and the sum of squares of the parameters (in float64): equal on replicas that agree."""
    flat = flatten(params).double()
    return float(flat.sum()), float(flat.square().sum())


def spread(fingerprints: Sequence[tuple[float, float]]) -> float:
    """How far the members' fingerprints are from the first's, relative (0.0: identical)."""
    first = fingerprints[0]
    return max(abs(x - y) / max(abs(y), 1e-30) for other in fingerprints[1:] for x, y in zip(other, first))


# bytes and time
def measure_stage(base: RunConfig, n: int, replica_counts: list[int], timed: set[int], repeats: int,
                  do_bytes: bool) -> Iterator[dict]:
    """Per r, the bytes and times of n members (fresh groups per r; a failed round is retried once with fresh
    groups, after saying so: a round that failed leaves the replicas apart)."""
    with running_peers(f"zerobench-n{n}", n) as peers:
        for r in replica_counts:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    yield measure_pair(base, peers, r, r in timed, repeats, do_bytes, f"a{attempt}")
                    break
                except Exception as e:  # noqa: BLE001 - say so, then retry or give up on this r
                    print(f"n={n} r={r}: attempt {attempt} of {ATTEMPTS} FAILED: {type(e).__name__}: {e}", flush=True)


def measure_pair(base: RunConfig, peers: list[Peer], r: int, timed: bool, repeats: int, do_bytes: bool,
                 tag: str) -> dict:
    """An unsharded and a sharded (r replicas) group on the same peers, fed the same gradients."""
    n = len(peers)
    with contextlib.ExitStack() as stack:
        plain = group(peers, derived(base, f"zerobench-n{n}-r{r}-{tag}-plain", zero=False), STAGE, stack)
        zero = group(peers, derived(base, f"zerobench-n{n}-r{r}-{tag}-zero", zero=True, replicas=r), STAGE, stack)
        sides = {"plain": plain, "zero": zero}
        each = -(-base.optimizer.batch_size // n)  # the group holds a full batch between them
        samples = [each] * n
        generator = torch.Generator().manual_seed(1000 * n + r)
        grads = random_grads(plain, generator)  # warm-up: connections, first allocations
        spreads = {"plain": [one_round(plain, grads, samples, f"unsharded n={n} warm-up")["spread"]],
                   "zero": [one_round(zero, grads, samples, f"zero n={n} r={r} warm-up")["spread"]]}
        result: dict = {"n": n, "r": r, "chunks": zero[0].averager.optimizer.shards.layout.num_chunks}
        if do_bytes:
            result.update(held_bytes(plain, zero))
        if timed:
            runs: dict[str, list[dict]] = {"plain": [], "zero": []}
            for i in range(repeats):
                grads = random_grads(plain, generator)
                for name in alternating(i):
                    runs[name].append(one_round(sides[name], grads, samples, f"{name} n={n} r={r}"))
                    spreads[name].append(runs[name][-1]["spread"])
            result.update(medians(runs))
        result["param_diff"] = max(max_param_diff(p, z) for p, z in zip(plain, zero))
        result["zero_torch_state_bytes"] = max(z.averager.optimizer.state_bytes() for z in zero)
        result.update({f"{name}_spread": max(values) for name, values in spreads.items()})
        return result


def alternating(i: int) -> list[str]:
    """The order of the two sides in timed round i: each goes first every other time."""
    return ["plain", "zero"] if i % 2 == 0 else ["zero", "plain"]


def medians(runs: dict[str, list[dict]]) -> dict:
    return {f"{name}_{key}": statistics.median(x[key] for x in rounds)
            for name, rounds in runs.items() for key in ("round", "step", "formed", "sent", "cpu_own", "cpu_children")
            if key in rounds[0]}


def held_bytes(plain: list[Replica], zero: list[Replica]) -> dict:
    unsharded = [p.averager.optimizer.state_bytes() for p in plain]
    sharded = [z.averager.optimizer.shards.nbytes for z in zero]
    gauges = [z.metric("swarm_optimizer_state_bytes") for z in zero]
    ratios = [s / u for s, u in zip(sharded, unsharded)]
    return {"unsharded_bytes": unsharded, "sharded_bytes": sharded, "ratios": ratios, "max_ratio": max(ratios),
            "mean_ratio": statistics.mean(ratios),
            "chunks_held": [len(z.averager.optimizer.shards.chunks) for z in zero],
            "gauge_matches": gauges == [float(s) for s in sharded]}


# time, every member in a process of its own
class Member:
    """What a member process holds: its peer, and (per r) an unsharded and a sharded replica of the stage.

    Its methods are the commands the parent sends ("setup", "prepare", "go", "check", "close", "stop").
    """

    def __init__(self, index: int, n: int, base: RunConfig, peer: Peer):
        self.index, self.n, self.base, self.peer = index, n, base, peer
        self.sides: dict[str, Replica] = {}
        self.stack = contextlib.ExitStack()
        self.before: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.cpu_before: tuple[float, float] = (0.0, 0.0)

    def setup(self, r: int, tag: str) -> int:
        """Fresh groups for r replicas (run ids as the in-process mode has them); the number of chunks."""
        self.close()
        n, base = self.n, self.base
        self.stack = contextlib.ExitStack()
        self.sides = {
            "plain": Replica(self.peer, derived(base, f"zerobench-n{n}-r{r}-{tag}-plain", zero=False), STAGE,
                             self.stack),
            "zero": Replica(self.peer, derived(base, f"zerobench-n{n}-r{r}-{tag}-zero", zero=True, replicas=r),
                            STAGE, self.stack)}
        return self.sides["zero"].averager.optimizer.shards.layout.num_chunks

    def prepare(self, side: str, seed: int, what: str) -> None:
        """Hand the side its gradient sums (random, from the seed and this member's index: the same on both
        sides), wait until it sees the full batch and all n members, and note its counters."""
        replica = self.sides[side]
        generator = torch.Generator().manual_seed(seed * 1000 + self.index)
        grads = [torch.randn(p.shape, generator=generator) for p in replica.params]
        hand_over(replica, grads, -(-self.base.optimizer.batch_size // self.n), what)
        wait_full([replica], self.n, what)
        self.before = replica.counters()
        self.cpu_before = cpu_seconds()

    def go(self, side: str, what: str) -> dict:
        """The whole step (its round beside); its times, what was sent, the CPU time it took (this process,
        the processes under it) and the parameters' fingerprint."""
        replica = self.sides[side]
        started = time.perf_counter()
        stats = whole_step(replica.averager)
        seconds = time.perf_counter() - started
        cpu = [a - b for a, b in zip(cpu_seconds(), self.cpu_before)]
        check_stats([stats], self.n, f"{what} (member {self.index})")
        deltas = [a - b for a, b in zip(replica.counters(), self.before)]
        return {"deltas": deltas, "step": seconds, "cpu": cpu, "fingerprint": fingerprint(replica.params)}

    def check(self) -> dict:
        plain, zero = self.sides["plain"], self.sides["zero"]
        return {"param_diff": max_param_diff(plain, zero),
                "zero_torch_state_bytes": zero.averager.optimizer.state_bytes()}

    def close(self) -> None:
        self.sides = {}
        self.stack.close()

    def stop(self) -> None:
        self.close()


def member_main(index: int, n: int, base: dict, torch_threads: int, conn: Connection) -> None:
    """A member process (spawned): its peer, joined through the multiaddrs the parent sends first (none for the
    first member, which sends its own back), then commands until "stop". Each reply: ("ok", result) or
    ("error", what)."""
    mp.set_start_method("fork", force=True)  # a spawned process would spawn its children too: hivemind forks them
    setup_logging("WARNING")
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        with contextlib.ExitStack() as stack:
            try:
                peer = start_peer(f"zerobench-n{n}", conn.recv(), stack)
                member = Member(index, n, RunConfig.from_dict(base), peer)
                stack.callback(member.close)
                conn.send(("ok", visible_maddrs(peer.dht)))
            except Exception as e:  # noqa: BLE001 - tell the parent, then leave
                conn.send(("error", f"member {index} did not start: {type(e).__name__}: {e}"))
                return
            while True:
                command, *args = conn.recv()
                try:
                    conn.send(("ok", getattr(member, command)(*args)))
                except Exception as e:  # noqa: BLE001 - the parent decides
                    traceback.print_exc()
                    conn.send(("error", f"member {index}: {type(e).__name__}: {e}"))
                if command == "stop":
                    return
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the parent went away
        pass


class MemberError(RuntimeError):
    """A member answered a command with an error (every member answered: they can go on)."""


class Members:
    """n member processes ("spawn": this process has threads, and hivemind forks children of its own)."""

    def __init__(self, base: RunConfig, n: int, torch_threads: int):
        context = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for index in range(n):
            mine, theirs = context.Pipe()
            proc = context.Process(target=member_main, args=(index, n, base.to_dict(), torch_threads, theirs),
                                   name=f"zerobench-member-{index}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def join_dht(self) -> None:
        """The first member starts the DHT; the others join through its multiaddrs."""
        self.conns[0].send([])
        initial = self.replies(self.conns[:1], START_TIMEOUT)[0]
        for conn in self.conns[1:]:
            conn.send(initial)
        self.replies(self.conns[1:], START_TIMEOUT)

    def ask(self, *command: object) -> list:
        """Send the command to every member, then read every reply (so the members act at once)."""
        for conn in self.conns:
            conn.send(command)
        return self.replies(self.conns, REPLY_TIMEOUT)

    def replies(self, conns: list[Connection], timeout: float) -> list:
        deadline = time.monotonic() + timeout
        results, errors = [], []
        for conn in conns:
            index = self.conns.index(conn)
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"member {index} did not answer within {timeout:g}s")
            try:
                status, result = conn.recv()
            except EOFError:
                raise RuntimeError(f"member {index} died (exit code {self.procs[index].exitcode})") from None
            (results if status == "ok" else errors).append(result)
        if errors:
            raise MemberError("; ".join(errors))
        return results

    def close(self) -> None:
        """Ask every member to stop, wait for it, and terminate (with what it started) any that does not."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                below = descendants(proc.pid)
                print(f"WARNING: {proc.name} (pid {proc.pid}) did not stop within {STOP_TIMEOUT:g}s: terminating it "
                      f"and the {len(below)} processes it started", flush=True)
                proc.terminate()
                proc.join(5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5.0)
                for pid in below:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            elif proc.exitcode:
                print(f"WARNING: {proc.name} exited with code {proc.exitcode}", flush=True)
        for conn in self.conns:
            conn.close()


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (from /proc): what a member started, to end if the member has to be killed."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by this process (all its threads) and by the live processes under it (the p2p
    daemons, the DHT's and the averagers' processes), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children = 0.0
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            children += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return time.process_time(), children


def measure_stage_apart(base: RunConfig, n: int, replica_counts: list[int], repeats: int,
                        torch_threads: int) -> Iterator[dict]:
    """As measure_stage (times only), each of the n members in a process of its own."""
    members = Members(base, n, torch_threads)
    try:
        members.join_dht()
        for r in replica_counts:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    result = measure_pair_apart(members, n, r, repeats, f"a{attempt}")
                except MemberError as e:  # say so, then retry or give up on this r
                    print(f"n={n} r={r}: attempt {attempt} of {ATTEMPTS} FAILED: {e}", flush=True)
                    continue
                yield result
                break
    finally:
        members.close()


def measure_pair_apart(members: Members, n: int, r: int, repeats: int, tag: str) -> dict:
    """measure_pair's rounds, sent to the member processes; each round starts on all of them at once."""
    chunks = members.ask("setup", r, tag)[0]
    seed = 1000 * n + r
    spreads: dict[str, list[float]] = {"plain": [], "zero": []}

    def one(name: str, seed: int, what: str) -> dict:
        members.ask("prepare", name, seed, what)
        replies = members.ask("go", name, what)
        spreads[name].append(spread([x["fingerprint"] for x in replies]))
        return {**round_times([x["deltas"] for x in replies], [x["step"] for x in replies]),
                "cpu_own": statistics.mean(x["cpu"][0] for x in replies),
                "cpu_children": statistics.mean(x["cpu"][1] for x in replies)}

    one("plain", seed, f"unsharded n={n} warm-up")  # warm-up: connections, first allocations
    one("zero", seed, f"zero n={n} r={r} warm-up")
    runs: dict[str, list[dict]] = {"plain": [], "zero": []}
    for i in range(repeats):
        for name in alternating(i):
            runs[name].append(one(name, seed + 1 + i, f"{name} n={n} r={r}"))
    checks = members.ask("check")
    members.ask("close")
    return {"n": n, "r": r, "chunks": chunks, **medians(runs),
            "param_diff": max(c["param_diff"] for c in checks),
            "zero_torch_state_bytes": max(c["zero_torch_state_bytes"] for c in checks),
            **{f"{name}_spread": max(values) for name, values in spreads.items()}}


# loss
@torch.no_grad()
def val_loss(module: torch.nn.Module, tokens: torch.Tensor, config: RunConfig) -> float:
    """Mean validation loss over ReferenceTrainer's fixed windows."""
    module.eval()
    total, count = 0.0, 0
    try:
        for x, y in eval_batches(tokens, config.model.seq_len, config.optimizer.micro_batch_size, EVAL_BATCHES):
            total += module(x, targets=y).item() * x.shape[0]
            count += x.shape[0]
    finally:
        module.train()
    return total / count


def grads_on(replica: Replica, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """Gradient sums of one micro-batch on the replica's own parameters (as a server's backward), and its loss."""
    loss = replica.module(x, targets=y)
    grads = torch.autograd.grad(loss * x.shape[0], replica.params)
    return list(grads), float(loss.detach())


def measure_loss(base: RunConfig, n: int, steps: int, tag: str) -> dict:
    base = RunConfig.from_dict(base.to_dict())
    base.stages.num_stages = 1  # the whole model is the one stage: its validation loss needs nothing else
    micro = base.optimizer.micro_batch_size
    tokenizer = load_tokenizer(base.data)
    train = load_tokens(base.data, "train", tokenizer)
    val = load_tokens(base.data, "val", tokenizer)
    sampler = BatchSampler(train, base.model.seq_len, micro, seed=sampler_seed(base.data.seed, 0))
    plain_config = derived(base, f"zerobench-loss-n{n}-{tag}-plain", zero=False, batch_size=n * micro)
    zero_config = derived(base, f"zerobench-loss-n{n}-{tag}-zero", zero=True, replicas=LOSS_REPLICAS,
                          batch_size=n * micro)
    # the exact math both should follow: one StageOptimizer on all the micro-batches (as test_zero.py checks)
    reference = StageOptimizer(build_stage(plain_config, 0), plain_config.optimizer)
    result: dict = {"n": n, "steps": steps, "batch_size": n * micro, "r": LOSS_REPLICAS}
    with running_peers(f"zerobench-loss-n{n}-{tag}", n) as peers, contextlib.ExitStack() as stack:
        sides = {"plain": group(peers, plain_config, 0, stack), "zero": group(peers, zero_config, 0, stack)}
        result["chunks"] = sides["zero"][0].averager.optimizer.shards.layout.num_chunks
        result["initial_val"] = val_loss(reference.module, val, base)
        losses: dict[str, list[float]] = {"plain": [], "zero": [], "reference": []}
        rounds: dict[str, list[float]] = {"plain": [], "zero": []}
        drift: dict[str, list[float]] = {"zero-plain": [], "plain-reference": [], "zero-reference": []}
        norms = []
        for step in range(steps):
            batches = [sampler.next_batch() for _ in range(n)]  # one micro-batch per server, the same on every side
            for name, side in sides.items():
                computed = [grads_on(r, x, y) for r, (x, y) in zip(side, batches)]
                losses[name].append(statistics.mean(loss for _, loss in computed))
                timing = one_round(side, [g for g, _ in computed], [micro] * n, f"{name} step {step + 1}")
                rounds[name].append(timing["round"])
            mine = []
            for x, y in batches:
                loss = reference.module(x, targets=y)
                (loss * x.shape[0]).backward()
                reference.add_samples(x.shape[0])
                mine.append(float(loss.detach()))
            losses["reference"].append(statistics.mean(mine))
            norms.append(reference.step()["grad_norm"])
            plain, zero = sides["plain"][0].params, sides["zero"][0].params
            for key, (one, other) in {"zero-plain": (zero, plain), "plain-reference": (plain, reference.params),
                                      "zero-reference": (zero, reference.params)}.items():
                drift[key].append(max_diff(one, other))
        for name, side in sides.items():
            result[f"{name}_val"] = val_loss(side[0].module, val, base)
            result[f"{name}_round"] = statistics.median(rounds[name])
            result[f"{name}_in_sync"] = max(max_param_diff(side[0], r) for r in side[1:])
            result[f"{name}_steps"] = [r.averager.step_count for r in side]
        result["reference_val"] = val_loss(reference.module, val, base)
        flat = {"plain": flatten(sides["plain"][0].params), "zero": flatten(sides["zero"][0].params),
                "reference": flatten(reference.params)}
        for key in drift:
            one, other = key.split("-")
            result[f"rel_l2 {key}"] = float((flat[one] - flat[other]).norm() / flat[other].norm())
    result.update({"train": losses, "drift": drift, "reference_grad_norms": norms})
    return result


def max_diff(one: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> float:
    with torch.no_grad():
        return max(float((x - y).abs().max()) for x, y in zip(one, other))


def flatten(params: Sequence[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.detach().flatten() for p in params])


# printing
def report_stage(r: dict, timed: bool) -> None:
    n, reps = r["n"], r["r"]
    if "ratios" in r:
        goal = 1.05 * min(reps, n) / n
        ok = "yes" if r["max_ratio"] <= goal else "NO"
        print(f"bytes n={n} r={reps}: sharded/unsharded per member "
              f"[{', '.join(f'{x:.3f}' for x in r['ratios'])}], max {r['max_ratio']:.3f}, mean {r['mean_ratio']:.3f}; "
              f"goal 1.05 x r/n = {goal:.3f}: max <= goal {ok} (chunks held {r['chunks_held']} of {r['chunks']}; "
              f"unsharded {r['unsharded_bytes'][0] / MB:.1f} MB each; "
              f"swarm_optimizer_state_bytes gauge {'matches' if r['gauge_matches'] else 'DIFFERS'})", flush=True)
    if timed:
        ratio, step_ratio = r["zero_round"] / r["plain_round"], r["zero_step"] / r["plain_step"]
        print(f"time n={n} r={reps}: round zero {r['zero_round']:.3f}s, unsharded {r['plain_round']:.3f}s, "
              f"zero/unsharded {ratio:.2f} (goal <= 1.1: {'yes' if ratio <= 1.1 else 'NO'}); "
              f"whole step zero {r['zero_step']:.3f}s, unsharded {r['plain_step']:.3f}s, "
              f"zero/unsharded {step_ratio:.2f}; group formed after the last member joined: "
              f"zero {r['zero_formed'] * 1000:.0f} ms, "
              f"unsharded {r['plain_formed'] * 1000:.0f} ms; sent per member: zero {r['zero_sent'] / MB:.1f} MB "
              f"(measured), unsharded {r['plain_sent'] / MB:.1f} MB (estimate)", flush=True)
    if timed and "zero_cpu_own" in r:
        print(f"cpu n={n} r={reps}: per member during its whole step (mean over members, median over rounds): "
              f"zero {r['zero_cpu_own']:.2f}s in its process + {r['zero_cpu_children']:.2f}s in the processes under "
              f"it, unsharded {r['plain_cpu_own']:.2f}s + {r['plain_cpu_children']:.2f}s "
              f"(under it: its p2p daemon, its DHT's and averagers' processes)", flush=True)
    print(f"check n={n} r={reps}: max |param zero - param unsharded| after the same rounds {r['param_diff']:.2e}; "
          f"members' replicas (parameter sum, sum of squares) after every round: zero {agree(r['zero_spread'])}, "
          f"unsharded {agree(r['plain_spread'])}; "
          f"torch AdamW state on the zero side {r['zero_torch_state_bytes']} bytes", flush=True)


def agree(spread: float) -> str:
    return "identical" if spread == 0 else f"differ by {spread:.1e} (relative)"


def report_loss(r: dict) -> None:
    ratio = r["zero_val"] / r["plain_val"]
    train, drift, last = r["train"], r["drift"], min(5, r["steps"])

    def apart(key: str) -> str:
        """The last step's largest parameter difference, and the first step after which it exceeded DRIFT."""
        step = next((i + 1 for i, d in enumerate(drift[key]) if d > DRIFT), None)
        name = key.replace("plain", "unsharded")
        return f"{name} {drift[key][-1]:.1e} (> {DRIFT:g} from step {step})" if step else \
            f"{name} {drift[key][-1]:.1e} (<= {DRIFT:g} throughout)"

    norms = r["reference_grad_norms"]
    spike = max(range(len(norms)), key=norms.__getitem__)
    print(f"loss n={r['n']} (configs tiny as one stage, {r['chunks']} chunks, r={r['r']}, batch {r['batch_size']}, "
          f"{r['steps']} steps): validation loss zero {r['zero_val']:.5f}, unsharded {r['plain_val']:.5f}, "
          f"one-optimizer reference {r['reference_val']:.5f} (initial {r['initial_val']:.4f}); "
          f"zero/unsharded {ratio:.5f} (goal <= 1.01: {'yes' if ratio <= 1.01 else 'NO'}), "
          f"zero/reference {r['zero_val'] / r['reference_val']:.5f}, "
          f"unsharded/reference {r['plain_val'] / r['reference_val']:.5f}", flush=True)
    print(f"  train loss: first {train['reference'][0]:.4f}; mean of the last {last}: zero "
          f"{statistics.mean(train['zero'][-last:]):.4f}, unsharded {statistics.mean(train['plain'][-last:]):.4f}, "
          f"reference {statistics.mean(train['reference'][-last:]):.4f}; max |zero - unsharded| over the steps "
          f"{max(abs(a - b) for a, b in zip(train['zero'], train['plain'])):.2e}; largest reference grad norm "
          f"{norms[spike]:.1f} at step {spike + 1}", flush=True)
    print(f"  parameters, max |difference| after the last step: {apart('zero-plain')}, {apart('zero-reference')}, "
          f"{apart('plain-reference')}; relative L2: zero-unsharded {r['rel_l2 zero-plain']:.2e}, zero-reference "
          f"{r['rel_l2 zero-reference']:.2e}, unsharded-reference {r['rel_l2 plain-reference']:.2e}", flush=True)
    print(f"  replicas in sync (max |p_i - p_0|): zero {r['zero_in_sync']:.1e}, unsharded {r['plain_in_sync']:.1e}; "
          f"steps per member zero {r['zero_steps']}, unsharded {r['plain_steps']}; median round zero "
          f"{r['zero_round']:.3f}s, unsharded {r['plain_round']:.3f}s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--config", default="configs/small.yaml", help="bytes and time: its stage 1")
    p.add_argument("--loss-config", default="configs/tiny.yaml", help="loss: the whole model as one stage")
    p.add_argument("--sizes", type=int, nargs="+", help="group sizes for bytes and time (default 2 3 4; --quick: 2 3)")
    p.add_argument("--replicas", type=int, nargs="+", default=[2], help="r of the timed rounds (default 2)")
    p.add_argument("--repeats", type=int, help="timed rounds of each side per size (default 3; --quick: 1)")
    p.add_argument("--loss-sizes", type=int, nargs="+", help="servers in the loss part (default 2 3; --quick: 2)")
    p.add_argument("--steps", type=int, help="steps of the loss part (default 30; --quick: 10)")
    p.add_argument("--chunk-elements", type=int, help="averaging.zero.chunk_elements (default: the configs')")
    p.add_argument("--in-process", action="store_true",
                   help="time: all members in this one process (default: each in a process of its own)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="time, members in processes: torch.set_num_threads in each (default: torch's own)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="also write every result here")
    args = p.parse_args()
    setup_logging("WARNING")
    sizes = args.sizes or ([2, 3] if args.quick else [2, 3, 4])
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (10 if args.quick else 30)
    loss_sizes = args.loss_sizes or ([2] if args.quick else [2, 3])
    started = time.monotonic()
    out: dict = {"stage": [], "loss": []}
    if "bytes" in args.parts or "time" in args.parts:
        base = RunConfig.load(args.config)
        if args.chunk_elements:
            base.averaging.zero.chunk_elements = args.chunk_elements
        base.averaging.target_group_size = max(base.averaging.target_group_size, max(sizes))
        timed = set(args.replicas) if "time" in args.parts else set()
        in_process = timed if args.in_process else set()  # timed here, with the bytes; else in member processes
        replica_counts = sorted(({1, 2} if "bytes" in args.parts else set()) | in_process)
        params = sum(p.numel() for p in build_stage(base, STAGE).parameters())
        where = "members in this one process" if args.in_process else "members in separate processes"
        print(f"{args.config}: stage {STAGE} has {params / 1e6:.2f}M parameters; chunks of "
              f"{base.averaging.zero.chunk_elements} elements; codec none; "
              + (f"medians of {repeats} timed rounds, r in {sorted(timed)}, {where}" if timed else "no timing"),
              flush=True)
        for n in sizes:
            try:
                if replica_counts:
                    for r in measure_stage(base, n, replica_counts, in_process, repeats, "bytes" in args.parts):
                        report_stage(r, r["r"] in in_process)
                        out["stage"].append(r)
                if timed and not args.in_process:
                    for r in measure_stage_apart(base, n, sorted(timed), repeats, args.torch_threads):
                        report_stage(r, True)
                        out["stage"].append(r)
            except Exception as e:  # noqa: BLE001 - say so, go on with the next size
                print(f"n={n}: FAILED: {type(e).__name__}: {e}", flush=True)
    if "loss" in args.parts:
        base = RunConfig.load(args.loss_config)
        if args.chunk_elements:
            base.averaging.zero.chunk_elements = args.chunk_elements
        base.averaging.target_group_size = max(base.averaging.target_group_size, max(loss_sizes))
        for n in loss_sizes:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    r = measure_loss(base, n, steps, f"a{attempt}")
                except Exception as e:  # noqa: BLE001 - say so, then train again from the start on fresh groups
                    print(f"loss n={n}: attempt {attempt} of {ATTEMPTS} FAILED: {type(e).__name__}: {e}", flush=True)
                    continue
                report_loss(r)
                out["loss"].append(r)
                break
    print(f"done in {time.monotonic() - started:.0f}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
