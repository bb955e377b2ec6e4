"""Fuzzed RPCs against one real stage server: it must refuse them cleanly and come out unchanged.

One StageServer (stage 0 of a tiny 2-stage run by default) starts in this process on 127.0.0.1, and
a client P2P sends it N requests, `--concurrency` at a time: valid forwards (some announcing a
backward that never comes, so the server keeps their graphs) mixed with malformed msgpack
metadata, bad metadata fields, wrong endpoints, random shapes, dtypes and codecs, buffers of the
wrong size, truncated streams, streams that stop mid-tensor or stall, extra tensors, huge declared
and over-cap batches, invalid backwards, wrong stages and abandoned calls. No valid backward is
sent, so nothing may change the stage. Afterwards it checks, and prints with a table of outcomes:

- every request got an answer with a code its kind allows (never `internal`), or none by design;
- the server still answers a valid forward with the same output, bit for bit, as before the fuzz;
- the stage's parameters, gradients and accumulated sample count are bitwise unchanged;
- the process's resident memory grew by less than `--rss-bound-mib` in all, and by less than
  `--leak-bound-mib` after the first tenth of the requests (a bounded server has reached its
  plateau by then; what keeps growing is a leak).

    .venv/bin/python bench/fuzz.py            # 10000 requests, 32 at a time
    .venv/bin/python bench/fuzz.py --quick    # 300 requests
Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from fuzz_shots import ABANDONED, MAKERS, OK, OVERLOAD, UNAVAILABLE, Fuzzer, Shot, shots  # bench/, beside this file
from hivemind.p2p import P2P, PeerID

from swarm.config import DataConfig, ModelConfig, NetworkConfig, OptimizerConfig, RunConfig, StagesConfig
from swarm.dht import BackgroundLoop, SwarmRecords, load_identity, start_dht, visible_maddrs
from swarm.protocol import (
    BAD_REQUEST,
    BUSY,
    FORWARD,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    RemoteStageError,
    StageClient,
    StageService,
    receive_reply,
    stage_namespace,
)
from swarm.serving import ServerOptions, StageServer

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
START_TIMEOUT = 120.0  # the server's start (stage build, speed test, DHT) on 2 shared cores
CALL_TIMEOUT = 30.0  # one fuzzed call, connect to answer
BACKEND_TIMEOUT = 30.0  # reading the stage's state on its compute thread
RECEIVE_TIMEOUT = 1.0  # the server's: how long a stalled stream may hold a slot
PER_REQUEST_BUDGET = 0.5  # seconds the whole fuzz may take per request, on a loaded machine
ACTIVATION_CACHE_BYTES = 4 * 2**20  # valid forwards may keep graphs: bounded, and inside the RSS bound


def fuzz_config() -> RunConfig:
    """tests/integration/inproc.py's tiny run: a batch no fuzz fills, so the stage never steps."""
    return RunConfig(
        run_id="fuzz",
        model=ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32),
        stages=StagesConfig(num_stages=2),
        optimizer=OptimizerConfig(batch_size=10_000, micro_batch_size=4),
        data=DataConfig(max_bytes=200_000),
        network=NetworkConfig(announce_period=2.0, record_ttl=30.0, request_timeout=30.0),
    ).validate()


# --- sending -----------------------------------------------------------------------------------


async def fire(service_stub, shot: Shot) -> tuple[str, str | None]:
    """Send one shot; its outcome (OK, an error code, UNAVAILABLE: no usable answer, or ABANDONED), and
    for UNAVAILABLE what went wrong."""
    rpc = service_stub.rpc_forward if shot.endpoint == FORWARD else service_stub.rpc_backward
    answered = asyncio.Event()

    async def frames():
        for frame in shot.frames:
            yield frame
        if shot.hold:
            await answered.wait()

    try:
        responses = await asyncio.wait_for(rpc(frames()), CALL_TIMEOUT)
    except Exception as e:  # any failure to open the call is an outcome, not a crash
        return UNAVAILABLE, f"opening the call: {type(e).__name__}: {e}"
    try:
        if shot.abandon:
            return ABANDONED, None
        await asyncio.wait_for(receive_reply(responses), CALL_TIMEOUT)
        return OK, None
    except RemoteStageError as e:
        return e.code, None
    except Exception as e:
        return UNAVAILABLE, f"reading the reply: {type(e).__name__}: {e}"
    finally:
        answered.set()
        await responses.aclose()


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome, expected?) -> calls
    unavailable: Counter = field(default_factory=Counter)  # what went wrong -> calls
    rss_trace: list[float] = field(default_factory=list)  # MiB after every tenth of the calls


async def fuzz_all(service_stub, fuzzer: Fuzzer, count: int, seed: int, concurrency: int,
                   kinds: list[str] | None = None) -> Tally:
    """Fire `count` shots, `concurrency` at a time, and tally them; the resident memory is sampled
    after every tenth of them, to tell a plateau from a leak."""
    tally, pending, every = Tally(), shots(fuzzer, count, seed, kinds), max(1, count // 10)

    async def worker() -> None:
        for name, shot in pending:  # one shared iterator: each shot is taken once
            outcome, trouble = await fire(service_stub, shot)
            tally.outcomes[(name, outcome, outcome in shot.expect or outcome in OVERLOAD)] += 1
            if trouble is not None:
                tally.unavailable[f"{name}, {trouble}"[:200]] += 1
            if tally.outcomes.total() % every == 0:
                tally.rss_trace.append(rss_mib())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


# --- the server and what is checked -------------------------------------------------------------


@dataclass
class Target:
    server: StageServer
    client_loop: BackgroundLoop
    stub: StageClient


@contextlib.contextmanager
def running_server(config: RunConfig, stage: int) -> Iterator[Target]:
    """A StageServer on 127.0.0.1 and a client P2P connected to it; both stopped on exit."""
    with contextlib.ExitStack() as stack:
        server_loop = BackgroundLoop("fuzz-server").start()
        stack.callback(server_loop.stop)
        identity = load_identity(None)
        dht = start_dht(config.run_id, identity, host_maddrs=LOCAL)
        stack.callback(dht.shutdown)
        options = ServerOptions(stage=stage, activation_cache_bytes=ACTIVATION_CACHE_BYTES,
                                receive_timeout=RECEIVE_TIMEOUT)
        server = StageServer(config, dht, SwarmRecords(dht, config.run_id, identity), server_loop, options)
        stack.callback(server.shutdown)
        server.start()
        client_loop = BackgroundLoop("fuzz-client").start()
        stack.callback(client_loop.stop)
        p2p = client_loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=visible_maddrs(dht)), START_TIMEOUT)
        stack.callback(lambda: client_loop.run(p2p.shutdown(), CALL_TIMEOUT))
        stub = StageClient(p2p, PeerID.from_base58(server.peer_id), stage_namespace(config.run_id, stage),
                           timeout=CALL_TIMEOUT)
        yield Target(server, client_loop, stub)


def snapshot(server: StageServer) -> dict:
    """Parameters, buffers, gradients and accumulated samples, read between two tasks of the stage."""
    backend = server.backend

    def read() -> dict:
        state = {f"param:{k}": v.clone() for k, v in backend.module.state_dict().items()}
        state.update({f"grad:{k}": None if p.grad is None else p.grad.clone()
                      for k, p in backend.module.named_parameters()})
        state["samples"] = backend.optimizer.samples
        state["step"] = backend.step
        return state

    return backend.call(read, BACKEND_TIMEOUT)


def same(before: dict, after: dict) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:  # bitwise: -0.0 differs from 0.0
        return t.reshape(-1).view(torch.uint8)

    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
        return a == b

    return before.keys() == after.keys() and all(equal(before[k], after[k]) for k in before)


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class Report:
    requests: int
    seconds: float
    tally: Tally
    rss_before: float
    rss_after: float
    forward_same: bool
    state_same: bool
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def count(self, outcome: str) -> int:
        return sum(n for (_, found, _), n in self.tally.outcomes.items() if found == outcome)


def judge(report: Report, args: argparse.Namespace) -> None:
    """Fill report.failures with every check that did not hold."""
    if report.count(INTERNAL):
        report.failures.append(f"{report.count(INTERNAL)} requests got an `internal` error: the server failed on input")
    wrong = {key: n for key, n in report.tally.outcomes.items() if not key[2] and key[1] not in (UNAVAILABLE, INTERNAL)}
    if wrong:
        report.failures.append(f"outcomes their kind does not allow: {wrong}")
    if report.count(UNAVAILABLE) > args.max_unavailable * report.requests:
        report.failures.append(f"{report.count(UNAVAILABLE)} calls got no usable answer, over "
                               f"{args.max_unavailable:.1%} of them")
    if not report.forward_same:
        report.failures.append("the valid forward after the fuzz did not give the same output as before")
    if not report.state_same:
        report.failures.append("the stage's parameters, gradients or sample count changed")
    growth = report.rss_after - report.rss_before
    if growth >= args.rss_bound_mib:
        report.failures.append(f"resident memory grew by {growth:.1f} MiB, over the bound of "
                               f"{args.rss_bound_mib:g} MiB")
    trace = report.tally.rss_trace
    late = report.rss_after - trace[0] if trace else 0.0
    if late >= args.leak_bound_mib:  # what a bounded server has taken by then it keeps; more is a leak
        report.failures.append(f"resident memory kept growing after the first tenth of the requests: "
                               f"{late:+.1f} MiB, over the bound of {args.leak_bound_mib:g} MiB")


def print_summary(report: Report, args: argparse.Namespace) -> None:
    outcomes = report.tally.outcomes
    columns = [OK, BAD_REQUEST, WRONG_STAGE, NOT_READY, BUSY, INTERNAL, UNAVAILABLE, ABANDONED]
    columns += sorted({outcome for _, outcome, _ in outcomes} - set(columns))
    by_kind: dict[str, Counter] = {}
    for (name, outcome, _), n in outcomes.items():
        by_kind.setdefault(name, Counter())[outcome] += n
    width = max(len(name) for name in [*by_kind, "total"]) + 2
    print(f"{'kind':<{width}}{'sent':>7}" + "".join(f"{c:>13}" for c in columns))
    for name in sorted(by_kind):
        counts = by_kind[name]
        print(f"{name:<{width}}{counts.total():>7}" + "".join(f"{counts[c]:>13}" for c in columns))
    total = sum(by_kind.values(), Counter())
    print(f"{'total':<{width}}{total.total():>7}" + "".join(f"{total[c]:>13}" for c in columns))
    print(f"\n{report.requests} requests, {args.concurrency} at a time, in {report.seconds:.1f}s "
          f"({report.requests / report.seconds:.0f}/s)")
    for trouble, n in report.tally.unavailable.most_common(5):
        print(f"  no usable answer ({n}x): {trouble}")
    print(f"valid forward after the fuzz gives the same output: {'yes' if report.forward_same else 'NO'}")
    print(f"parameters, gradients, samples unchanged: {'yes' if report.state_same else 'NO'}")
    print(f"resident memory: {report.rss_before:.1f} MiB -> {report.rss_after:.1f} MiB "
          f"(grew {report.rss_after - report.rss_before:+.1f} MiB, bound {args.rss_bound_mib:g} MiB)")
    print("resident memory after each tenth of the requests (MiB):",
          " ".join(f"{m:.1f}" for m in report.tally.rss_trace))
    for failure in report.failures:
        print(f"FAILED: {failure}")
    print("PASSED" if report.passed else "FAILED")


def fuzz(args: argparse.Namespace) -> Report:
    config = fuzz_config()
    fuzzer = Fuzzer(config, args.stage)
    with running_server(config, args.stage) as target:
        stub, loop = target.stub, target.client_loop
        reference = fuzzer.valid(random.Random(args.seed), FORWARD)
        service_stub = StageService.get_stub(stub.p2p, stub.peer_id, namespace=stub.namespace)
        for _, shot in shots(fuzzer, 20, seed=args.seed + 1):  # warm up allocators and connections
            loop.run(fire(service_stub, shot), CALL_TIMEOUT)
        expected = loop.run(stub.call(reference), CALL_TIMEOUT).tensors[0]
        before, rss_before = snapshot(target.server), rss_mib()
        started = time.monotonic()
        tally = loop.run(fuzz_all(service_stub, fuzzer, args.requests, args.seed, args.concurrency, args.kinds),
                         START_TIMEOUT + PER_REQUEST_BUDGET * args.requests)
        seconds = time.monotonic() - started
        got = loop.run(stub.call(reference), CALL_TIMEOUT).tensors[0]
        after, rss_after = snapshot(target.server), rss_mib()
    forward_same = got.shape == expected.shape and torch.equal(got, expected)
    report = Report(args.requests, seconds, tally, rss_before, rss_after, forward_same, same(before, after))
    judge(report, args)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="fuzzed requests to send (default 10000)")
    parser.add_argument("--quick", action="store_true", help="300 requests (unless --requests is given)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    parser.add_argument("--stage", type=int, default=0, choices=[0, 1], help="the stage served (of 2; default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", choices=sorted(MAKERS), metavar="KIND",
                        help=f"send only these kinds of request (default: all of {', '.join(MAKERS)})")
    parser.add_argument("--rss-bound-mib", type=float, default=64.0,
                        help="the most resident memory may grow over the fuzz (default 64)")
    parser.add_argument("--leak-bound-mib", type=float, default=16.0,
                        help="the most it may grow after the first tenth of the requests (default 16)")
    parser.add_argument("--max-unavailable", type=float, default=0.002,
                        help="share of calls allowed to get no usable answer (default 0.002: the transport loses "
                             "a reply stream about once in 10^4 calls under this load)")
    args = parser.parse_args(argv)
    if args.quick and "--requests" not in (argv if argv is not None else sys.argv[1:]):
        args.requests = 300
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("swarm.protocol.service").setLevel(logging.ERROR)  # one warning per refusal otherwise
    report = fuzz(args)
    print_summary(report, args)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
