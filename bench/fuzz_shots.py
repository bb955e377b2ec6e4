"""What bench/fuzz.py sends: valid and broken stage requests, each with the outcomes that are right for it.

A maker turns a seeded random source into one Shot; `shots` draws them by kind, weighted, so a run is
reproducible from its seed. Backwards are always broken in a way that cannot pass: the stage must
come out of the fuzz unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgpack
import torch
from hivemind.proto import runtime_pb2

from swarm.config import RunConfig
from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    BUSY,
    FORWARD,
    NOT_READY,
    WRONG_STAGE,
    StageRequest,
    WireLimits,
    encode_tensor,
    request_frames,
)
from swarm.protocol.framing import encode_metadata

OK, UNAVAILABLE, ABANDONED = "ok", "unavailable", "abandoned"  # outcomes besides error codes
OVERLOAD = frozenset({NOT_READY, BUSY})  # right for any request when the server is full


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
