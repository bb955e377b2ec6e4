"""One request or reply on the wire: msgpack metadata plus tensors, streamed as hivemind protobuf frames.

A message is a stream of `ExpertRequest` (or `ExpertResponse`) frames. The first frame carries the
metadata; every frame after it carries exactly one tensor part. Tensors are cut into parts with
`hivemind.utils.streaming.split_for_streaming`: the first part of a tensor holds its header (dtype,
shape, number of parts), the following parts hold only bytes. The receiver checks every header and
the running byte count against `WireLimits` as frames arrive, so an oversized or malformed message
is refused before it is buffered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgpack
import torch
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.protocol.codec import MAX_TENSOR_ELEMENTS, decode_tensor, expected_buffer_bytes
from swarm.protocol.errors import ProtocolError

MIB = 2**20
# Half of hivemind's 4 MiB message cap, as hivemind itself budgets: leaves room for the frame header.
DEFAULT_PART_BYTES = MAX_UNARY_PAYLOAD_SIZE

Frame = TypeVar("Frame", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


# Every message's metadata says how many tensors follow (absent from error replies, and from older
# peers), so a stream that ends after whole tensors is caught like one that ends inside a tensor.
TENSOR_COUNT = "n_tensors"

@dataclass(frozen=True)
class WireLimits:
    """Caps on one message (request or reply); both sides check them, the receiver strictly."""

    max_message_bytes: int = 256 * MIB  # metadata plus every tensor buffer
    max_tensor_elements: int = MAX_TENSOR_ELEMENTS
    max_tensors: int = 4  # a stage message carries at most input + targets/grad
    max_metadata_bytes: int = 64 * 1024
    part_bytes: int = DEFAULT_PART_BYTES


DEFAULT_LIMITS = WireLimits()


def encode_metadata(meta: dict) -> bytes:
    """Pack a metadata dict with msgpack."""
    return msgpack.packb(meta, use_bin_type=True)


def answered_ok(metadata: bytes) -> bool:
    """Whether a peer's answer says ``{"ok": True}`` (a progress push or a matchmaking declaration taken); a
    garbled answer counts as no."""
    try:
        answer = decode_metadata(metadata, DEFAULT_LIMITS)
    except Exception:  # noqa: BLE001
        return False
    return isinstance(answer, dict) and answer.get("ok") is True


def decode_metadata(data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> dict:
    """Unpack metadata from a peer; anything but a msgpack dict within the size cap is a ProtocolError."""
    if len(data) > limits.max_metadata_bytes:
        raise ProtocolError(f"metadata is {len(data)} bytes, over the limit of {limits.max_metadata_bytes}")
    try:
        meta = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises a zoo of types on garbage; all mean the same to us
        raise ProtocolError(f"metadata is not valid msgpack ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict):
        raise ProtocolError(f"metadata must be a map, got {type(meta).__name__}")
    return meta


def to_frames(
    meta: dict,
    tensors: Sequence[runtime_pb2.Tensor],
    frame_type: type[Frame],
    limits: WireLimits = DEFAULT_LIMITS,
) -> Iterator[Frame]:
    """Check a message against `limits` now, and return an iterator over its frames.

    Parts are cut lazily, so only one extra part is held in memory at a time.
    """
    meta_bytes = encode_metadata({**meta, TENSOR_COUNT: len(tensors)})
    if len(tensors) > limits.max_tensors:
        raise ProtocolError(f"a message carries at most {limits.max_tensors} tensors, got {len(tensors)}")
    total = len(meta_bytes) + sum(len(tensor.buffer) for tensor in tensors)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message is {total} bytes, over the limit of {limits.max_message_bytes}")

    def frames() -> Iterator[Frame]:
        yield frame_type(metadata=meta_bytes)
        for tensor in tensors:
            for part in split_for_streaming(tensor, limits.part_bytes):
                yield frame_type(tensors=[part])

    return frames()


async def gather_frames(
    stream: AsyncIterator[Frame],
    limits: WireLimits = DEFAULT_LIMITS,
    on_metadata: Callable[[dict], None] | None = None,
) -> tuple[dict, list[torch.Tensor]]:
    """Read one whole message from `stream`; return its metadata and decoded tensors.

    `on_metadata` sees the metadata as soon as it arrives and may raise to stop reading early
    (a client does this for error replies, which carry no tensors).
    """
    meta, declared = None, None
    assembler = _TensorAssembler(limits)
    async for frame in stream:
        if meta is None:
            meta = decode_metadata(frame.metadata, limits)
            assembler.take_bytes(len(frame.metadata))
            declared = meta.pop(TENSOR_COUNT, None)
            if declared is not None and (not isinstance(declared, int) or isinstance(declared, bool)
                                         or not 0 <= declared <= limits.max_tensors):
                raise ProtocolError(f"a message must declare 0..{limits.max_tensors} tensors, got {declared!r}")
            if on_metadata is not None:
                on_metadata(meta)
        elif frame.metadata:
            raise ProtocolError("only the first frame of a message may carry metadata")
        elif not frame.tensors:
            raise ProtocolError("a frame after the first carries neither metadata nor tensor parts")
        for part in frame.tensors:
            assembler.add(part)
    if meta is None:
        raise ProtocolError("the stream ended before any metadata arrived")
    tensors = assembler.finish()
    if declared is not None and len(tensors) != declared:  # a stream cut short after whole tensors
        raise ProtocolError(f"the message declared {declared} tensors, {len(tensors)} arrived")
    return meta, tensors


class _TensorAssembler:
    """Collects tensor parts, checking each header and the byte budget before buffering."""

    def __init__(self, limits: WireLimits):
        self.limits = limits
        self.bytes_left = limits.max_message_bytes
        self.tensors: list[torch.Tensor] = []
        self.parts: list[runtime_pb2.Tensor] = []
        self.parts_left = 0

    def take_bytes(self, count: int) -> None:
        self.bytes_left -= count
        if self.bytes_left < 0:
            raise ProtocolError(f"message exceeds the limit of {self.limits.max_message_bytes} bytes")

    def add(self, part: runtime_pb2.Tensor) -> None:
        if part.dtype:  # hivemind's convention: only the first part of a tensor names its dtype
            self._finish_current()
            if len(self.tensors) >= self.limits.max_tensors:
                raise ProtocolError(f"a message carries at most {self.limits.max_tensors} tensors")
            declared = expected_buffer_bytes(part, self.limits.max_tensor_elements)
            if declared > self.bytes_left:
                raise ProtocolError(
                    f"tensor of shape {list(part.size)} needs {declared} bytes, "
                    f"over what is left of the {self.limits.max_message_bytes}-byte message limit"
                )
            self.parts_left = max(part.chunks, 1)  # an unsplit tensor declares 0 chunks
        elif not self.parts:
            raise ProtocolError("a tensor part arrived without a header part before it")
        elif not part.buffer:
            raise ProtocolError("empty continuation part")  # would let a peer send parts forever
        if self.parts_left == 0:
            raise ProtocolError("a tensor has more parts than its header declared")
        self.take_bytes(len(part.buffer))
        self.parts.append(part)
        self.parts_left -= 1

    def _finish_current(self) -> None:
        if not self.parts:
            return
        if self.parts_left:
            raise ProtocolError(f"tensor {len(self.tensors)} is missing {self.parts_left} of its parts")
        serialized = combine_from_streaming(self.parts)
        self.parts = []
        self.tensors.append(decode_tensor(serialized, self.limits.max_tensor_elements))

    def finish(self) -> list[torch.Tensor]:
        self._finish_current()
        return self.tensors
