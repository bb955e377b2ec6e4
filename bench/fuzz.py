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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from peer.server import ServerOptions, StageServer
from swarm.config import DataConfig, ModelConfig, NetworkConfig, OptimizerConfig, RunConfig, StagesConfig
from swarm.dht import BackgroundLoop, SwarmRecords, load_identity, start_dht, visible_maddrs
from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    BUSY,
    FORWARD,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    RemoteStageError,
    StageClient,
    StageRequest,
    StageService,
    WireLimits,
    encode_tensor,
    receive_reply,
    request_frames,
    stage_namespace,
)
from swarm.protocol.framing import encode_metadata

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
START_TIMEOUT = 120.0  # the server's start (stage build, speed test, DHT) on 2 shared cores
CALL_TIMEOUT = 30.0  # one fuzzed call, connect to answer
BACKEND_TIMEOUT = 30.0  # reading the stage's state on its compute thread
RECEIVE_TIMEOUT = 1.0  # the server's: how long a stalled stream may hold a slot
PER_REQUEST_BUDGET = 0.5  # seconds the whole fuzz may take per request, on a loaded machine
ACTIVATION_CACHE_BYTES = 4 * 2**20  # valid forwards may keep graphs: bounded, and inside the RSS bound
OK, UNAVAILABLE, ABANDONED = "ok", "unavailable", "abandoned"  # outcomes besides error codes
OVERLOAD = frozenset({NOT_READY, BUSY})  # right for any request when the server is full


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


# --- what is sent ------------------------------------------------------------------------------


@dataclass
class Shot:
    """One fuzzed call: frames to an endpoint, and the outcomes that are right for them."""

    endpoint: str
    frames: list
    expect: frozenset
    hold: bool = False  # keep the stream open after the frames until the server answers
    abandon: bool = False  # close the call without reading the reply


class Fuzzer:
    """Builds valid and broken requests for one stage of a run, from a seeded random source."""

    def __init__(self, config: RunConfig, stage: int):
        self.stage, self.num_stages = stage, config.stages.num_stages
        self.first, self.last = stage == 0, stage == config.stages.num_stages - 1
        self.cap, self.seq = config.optimizer.micro_batch_size, config.model.seq_len
        self.d, self.vocab = config.model.d_model, config.model.vocab_size

    def tokens(self, g: torch.Generator, b: int, t: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (b, t), generator=g)

    def hidden(self, g: torch.Generator, b: int, t: int) -> torch.Tensor:
        return torch.randn(b, t, self.d, generator=g)

    def valid(self, rng: random.Random, kind: str, batch: int | None = None, seq: int | None = None,
              follows: bool = False) -> StageRequest:
        """A request this stage accepts (a backward would change it: only ever sent broken)."""
        g = torch.Generator().manual_seed(rng.getrandbits(62))
        b, t = batch or rng.randint(1, self.cap), seq or rng.randint(1, self.seq)
        inputs = self.tokens(g, b, t) if self.first else self.hidden(g, b, t)
        targets = self.tokens(g, b, t) if self.last else None
        grad = self.hidden(g, b, t) if kind == BACKWARD and not self.last else None
        return StageRequest(kind, self.stage, f"fuzz-{rng.getrandbits(32):08x}", inputs, targets=targets,
                            grad_outputs=grad, wire_dtype=rng.choice(["float32", "float16", "bfloat16"]),
                            backward_follows=follows and kind == FORWARD)

    def frames(self, request: StageRequest, rng: random.Random | None = None) -> list:
        """The request's frames, often cut into small parts (so streams can stop mid-tensor)."""
        part_bytes = rng.choice([64, 256, 2**20]) if rng is not None else 2**20
        return list(request_frames(request, WireLimits(part_bytes=part_bytes)))


def message(meta: dict, tensors: list, part_bytes: int = 2**20) -> list:
    """Frames of any metadata and tensor messages, checked by nothing: `n_tensors` only if `meta` has it."""
    frames = [runtime_pb2.ExpertRequest(metadata=encode_metadata(meta))]
    for tensor in tensors:
        buffer, parts = tensor.buffer, max(1, -(-len(tensor.buffer) // part_bytes))
        head = runtime_pb2.Tensor(compression=tensor.compression, size=tensor.size, dtype=tensor.dtype,
                                  buffer=buffer[:part_bytes], chunks=parts)
        frames.append(runtime_pb2.ExpertRequest(tensors=[head]))
        for start in range(part_bytes, len(buffer), part_bytes):
            part = runtime_pb2.Tensor(buffer=buffer[start:start + part_bytes])
            frames.append(runtime_pb2.ExpertRequest(tensors=[part]))
    return frames


def meta_of(request: StageRequest) -> dict:
    return {**request.metadata(), "n_tensors": len(request.tensors)}


def encoded(request: StageRequest) -> list:
    return [encode_tensor(tensor, request.wire_dtype) for tensor in request.tensors]


def any_endpoint(rng: random.Random) -> str:
    return rng.choice([FORWARD, BACKWARD])


# Each maker returns one Shot. Backwards are always broken in a way that cannot pass: the stage must
# come out unchanged. Forwards with random content may happen to be valid, so they may also be `ok`.

def valid_forward(f: Fuzzer, rng: random.Random) -> Shot:
    return Shot(FORWARD, f.frames(f.valid(rng, FORWARD), rng), frozenset({OK}))


def kept_forward(f: Fuzzer, rng: random.Random) -> Shot:
    """A valid forward whose backward is announced and never sent: the server keeps its graph a while."""
    return Shot(FORWARD, f.frames(f.valid(rng, FORWARD, follows=True), rng), frozenset({OK}))


def garbage_metadata(f: Fuzzer, rng: random.Random) -> Shot:
    choice = rng.randrange(3)
    if choice == 0:
        meta = rng.randbytes(rng.randrange(0, 300))
    elif choice == 1:  # deeply nested arrays, under the metadata size cap
        meta = b"\x91" * rng.randrange(100, 60_000) + b"\xc0"
    else:  # valid msgpack, but no map
        meta = msgpack.packb(rng.choice([[1, 2], 7, "forward", None, b"bin", 1.5, True]))
    tail = f.frames(f.valid(rng, FORWARD), rng)[1:]
    return Shot(any_endpoint(rng), [runtime_pb2.ExpertRequest(metadata=meta), *tail], frozenset({BAD_REQUEST}))


BAD_FIELDS: dict[str, list] = {
    "kind": ["", "sideways", 0, None, ["forward"], b"forward"],
    "request_id": [7, None, "x" * 257, "y" * 5000],
    "wire_dtype": ["float64", "int8", "", 32, None],
    "has_targets": [1, "yes", None],
    "forward_step": [-1, "3", 1.5, True],
    "backward_follows": ["yes", 1, None],
    "n_tensors": [-1, "2", 99, True, None],
    "stage": ["0", -1, 1.0, True, None, [0]],
}


def bad_field(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    request = f.valid(rng, kind)
    meta, name = meta_of(request), rng.choice([*BAD_FIELDS, "has_targets-flipped", "n_tensors-off"])
    if name == "has_targets-flipped":
        meta["has_targets"] = not meta["has_targets"]
    elif name == "n_tensors-off":
        meta["n_tensors"] += rng.choice([-1, 1])
    else:
        meta[name] = rng.choice(BAD_FIELDS[name])
        if name == "n_tensors" and meta[name] is None:
            del meta[name]  # then only the request's own checks stand: make them fail too
            meta["kind"] = "sideways"
    return Shot(kind, message(meta, encoded(request)), frozenset({BAD_REQUEST}))


def wrong_endpoint(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    other = BACKWARD if kind == FORWARD else FORWARD
    return Shot(other, f.frames(f.valid(rng, kind), rng), frozenset({BAD_REQUEST}))


def random_shape(f: Fuzzer, rng: random.Random) -> Shot:
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    shape = [rng.randint(0, 12) for _ in range(rng.randint(0, 5))]
    inputs = torch.randn(shape, generator=g) if rng.random() < 0.5 else torch.randint(-5, 300, shape, generator=g)
    targets = torch.randint(0, f.vocab, [rng.randint(0, 6) for _ in range(rng.randint(1, 3))], generator=g)
    request = StageRequest(FORWARD, f.stage, "shape", inputs, targets=targets if rng.random() < 0.5 else None)
    return Shot(FORWARD, f.frames(request, rng), frozenset({OK, BAD_REQUEST}))


DTYPES = ["float32", "float16", "bfloat16", "int32", "int64", "float64", "int8", "bool", "complex64", "", "object"]


def random_encoding(f: Fuzzer, rng: random.Random) -> Shot:
    shape = [rng.randint(0, 8) for _ in range(rng.randint(0, 5))]
    numel = 1
    for dim in shape:
        numel *= dim
    tensor = runtime_pb2.Tensor(compression=rng.choice([0, 0, 1, 2, 3, 4, 5, 6, 99]), size=shape,
                                dtype=rng.choice(DTYPES), buffer=rng.randbytes(rng.randint(0, 8 * numel + 8)))
    meta = dict(kind=FORWARD, stage=f.stage, request_id="enc", has_targets=False, n_tensors=1)
    return Shot(FORWARD, message(meta, [tensor]), frozenset({OK, BAD_REQUEST}))


def wrong_size(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    request = f.valid(rng, kind)
    tensors = encoded(request)
    victim = tensors[rng.randrange(len(tensors))]
    delta = rng.randint(1, 64)
    victim.buffer = victim.buffer[:-delta] if rng.random() < 0.5 and len(victim.buffer) >= delta else (
        victim.buffer + rng.randbytes(delta))
    return Shot(kind, message(meta_of(request), tensors, rng.choice([64, 2**20])), frozenset({BAD_REQUEST}))


def truncated(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    frames = f.frames(f.valid(rng, kind), rng)
    return Shot(kind, frames[:rng.randint(1, len(frames) - 1)], frozenset({BAD_REQUEST}))


def stop_mid_tensor(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    frames = list(request_frames(f.valid(rng, kind, batch=f.cap, seq=f.seq), WireLimits(part_bytes=64)))
    middles = [i for i in range(2, len(frames)) if not frames[i].tensors[0].dtype]  # continuation parts
    return Shot(kind, frames[:rng.choice(middles)], frozenset({BAD_REQUEST}))


def extra_tensors(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    request = f.valid(rng, kind)
    extra = [encode_tensor(torch.ones(rng.randint(1, 4), 3), "float32") for _ in range(rng.randint(1, 3))]
    tensors = encoded(request) + extra
    return Shot(kind, message({**meta_of(request), "n_tensors": len(tensors)}, tensors), frozenset({BAD_REQUEST}))


def huge_batch(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    request = f.valid(rng, kind)
    tensors = encoded(request)
    shape = rng.choice([[2**31 - 1, f.seq], [f.cap * 10**6, f.seq, f.d], [2**32 - 1] * 4, [f.cap * 100, f.seq, f.d]])
    tensors[0] = runtime_pb2.Tensor(size=shape, dtype=tensors[0].dtype, buffer=rng.randbytes(64), chunks=1)
    return Shot(kind, message(meta_of(request), tensors), frozenset({BAD_REQUEST}))


def over_cap(f: Fuzzer, rng: random.Random) -> Shot:
    """Valid in every other way: without the batch cap a backward of these would be accumulated."""
    kind = any_endpoint(rng)
    return Shot(kind, f.frames(f.valid(rng, kind, batch=rng.randint(f.cap + 1, 3 * f.cap)), rng),
                frozenset({BAD_REQUEST}))


def invalid_backward(f: Fuzzer, rng: random.Random) -> Shot:
    request = f.valid(rng, BACKWARD)
    defects = ["nan", "seq"]
    if f.first:
        defects += ["token-over-vocab", "negative-token", "float-tokens"]
    else:
        defects += ["int-hidden", "narrow-hidden"]
    if f.last:
        defects += ["target-over-vocab", "short-targets"]
    else:
        defects += ["grad-shape", "no-grad"]
    defect = rng.choice(defects)
    x, second = request.inputs, request.targets if f.last else request.grad_outputs
    flat = rng.randrange(x[0].numel())
    if defect == "nan":  # float16 on the wire saturates infinities to its largest value: only NaN stays broken
        victim = second if f.first else x
        bad = [float("nan")] + ([float("inf"), -float("inf")] if request.wire_dtype != "float16" else [])
        victim.view(-1)[flat % victim.numel()] = rng.choice(bad)
    elif defect == "seq":
        x = torch.cat([x] * (f.seq // x.shape[1] + 1), dim=1)
    elif defect in ("token-over-vocab", "negative-token"):
        x.view(-1)[flat] = f.vocab + rng.randint(0, 10) if defect == "token-over-vocab" else -rng.randint(1, 10)
    elif defect == "float-tokens":
        x = x.float()
    elif defect == "int-hidden":
        x = x.round().long()
    elif defect == "narrow-hidden":
        x = x[..., : f.d - 1]
    elif defect == "target-over-vocab":
        second.view(-1)[flat % second.numel()] = f.vocab
    elif defect == "short-targets":
        second = second[:, :-1] if second.shape[1] > 1 else second[:, :0]
    elif defect == "grad-shape":
        second = torch.cat([second, second[:1]], dim=0) if rng.random() < 0.5 else second[..., :-1]
    meta = meta_of(request)
    tensors = [encode_tensor(x, request.wire_dtype)]
    if defect != "no-grad":
        tensors.append(encode_tensor(second, request.wire_dtype))
    return Shot(BACKWARD, message({**meta, "n_tensors": len(tensors)}, tensors), frozenset({BAD_REQUEST}))


def wrong_stage(f: Fuzzer, rng: random.Random) -> Shot:
    kind = any_endpoint(rng)
    request = f.valid(rng, kind)
    other = [s for s in range(f.num_stages) if s != f.stage] + [f.num_stages, 2**63 - 1]
    meta = {**meta_of(request), "stage": rng.choice(other)}
    return Shot(kind, message(meta, encoded(request)), frozenset({WRONG_STAGE}))


def odd_frames(f: Fuzzer, rng: random.Random) -> Shot:
    """Streams that break the framing: empty, metadata twice, an empty frame, a part without a header."""
    kind = any_endpoint(rng)
    frames = f.frames(f.valid(rng, kind))
    choice = rng.randrange(4)
    if choice == 0:
        frames = []
    elif choice == 1:
        frames.insert(rng.randint(1, len(frames)), frames[0])
    elif choice == 2:
        frames.insert(rng.randint(1, len(frames)), runtime_pb2.ExpertRequest())
    else:
        headless = runtime_pb2.Tensor(buffer=rng.randbytes(rng.randint(1, 64)))
        frames.insert(1, runtime_pb2.ExpertRequest(tensors=[headless]))
    return Shot(kind, frames, frozenset({BAD_REQUEST}))


def stall(f: Fuzzer, rng: random.Random) -> Shot:
    """Sends part of a request, then nothing, holding the stream open: refused after the receive timeout."""
    kind = any_endpoint(rng)
    frames = f.frames(f.valid(rng, kind), rng)
    return Shot(kind, frames[:rng.randint(1, len(frames) - 1)], frozenset({BAD_REQUEST}), hold=True)


def abandon(f: Fuzzer, rng: random.Random) -> Shot:
    """Sends all or part of a (broken) request and hangs up without reading the answer."""
    shot = rng.choice([truncated, invalid_backward, valid_forward, kept_forward])(f, rng)
    return Shot(shot.endpoint, shot.frames, frozenset({ABANDONED}), abandon=True)


# name: (weight, maker); a stall holds one of the client's slots for RECEIVE_TIMEOUT, so it is rare
MAKERS: dict[str, tuple[float, Callable[[Fuzzer, random.Random], Shot]]] = {
    "valid-forward": (6, valid_forward),
    "kept-forward": (6, kept_forward),
    "garbage-metadata": (6, garbage_metadata),
    "bad-field": (10, bad_field),
    "wrong-endpoint": (4, wrong_endpoint),
    "random-shape": (8, random_shape),
    "random-encoding": (8, random_encoding),
    "wrong-size": (6, wrong_size),
    "truncated": (6, truncated),
    "stop-mid-tensor": (6, stop_mid_tensor),
    "extra-tensors": (4, extra_tensors),
    "huge-batch": (4, huge_batch),
    "over-cap-batch": (6, over_cap),
    "invalid-backward": (10, invalid_backward),
    "wrong-stage": (4, wrong_stage),
    "odd-frames": (4, odd_frames),
    "stall": (0.5, stall),
    "abandon": (3, abandon),
}


def shots(fuzzer: Fuzzer, count: int, seed: int, kinds: list[str] | None = None) -> Iterator[tuple[str, Shot]]:
    """`count` (kind, shot) pairs of `kinds` (default: all); shot i depends on (seed, i) only."""
    names = kinds or list(MAKERS)
    weights = [MAKERS[name][0] for name in names]
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        name = rng.choices(names, weights)[0]
        yield name, MAKERS[name][1](fuzzer, rng)


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
