"""bench/zero.py's time part with every member in a process of its own, as each server is in a swarm:
the member processes, the commands the parent sends them over pipes, and the timed rounds."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import statistics
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from zero_rig import (
    ATTEMPTS,
    STAGE,
    Peer,
    Replica,
    alternating,
    check_stats,
    derived,
    fingerprint,
    hand_over,
    max_param_diff,
    medians,
    round_times,
    spread,
    start_peer,
    wait_full,
    whole_step,
)

from swarm.config import RunConfig
from swarm.dht import visible_maddrs
from swarm.logs import setup_logging

START_TIMEOUT = 180.0  # time part, members in processes: a member's imports, its DHT peer and joining the first
REPLY_TIMEOUT = 300.0  # ... any other command (a round's own deadlines are shorter: READY_TIMEOUT, the configs')
STOP_TIMEOUT = 60.0  # ... a member shutting down after "stop", before it is terminated


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


