"""Tensor codec, framing, stage messages and the service's error replies, without any network."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter

from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    BUSY,
    DEFAULT_LIMITS,
    FORWARD,
    INTERNAL,
    NOT_READY,
    ProtocolError,
    RemoteStageError,
    RequestRejected,
    StageHandler,
    StageReply,
    StageRequest,
    StageService,
    WireLimits,
    decode_tensor,
    encode_tensor,
    receive_reply,
    receive_request,
    reply_frames,
    request_frames,
)
from swarm.protocol.framing import encode_metadata, gather_frames, to_frames
from swarm.protocol.messages import MAX_EXPERT_ENTRIES, MAX_MOE_BLOCKS, check_moe_lost, error_frames

pytestmark = pytest.mark.timeout(30)

# Relative error of one rounding to the wire dtype: half an ulp at 1.0 (10 and 7 mantissa bits).
BOUNDS = {"float32": 0.0, "float16": 2**-11, "bfloat16": 2**-8}


@pytest.mark.parametrize("wire_dtype", sorted(BOUNDS))
def test_float_round_trip_within_wire_precision(wire_dtype):
    tensor = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    serialized = encode_tensor(tensor, wire_dtype)
    decoded = decode_tensor(runtime_pb2.Tensor.FromString(serialized.SerializeToString()))
    assert decoded.dtype == torch.float32 and decoded.shape == tensor.shape
    # plus half the float16 subnormal spacing, for the rare values below float16's normal range
    assert torch.all((decoded - tensor).abs() <= BOUNDS[wire_dtype] * tensor.abs() + 2**-25)
    bytes_per_element = 4 if wire_dtype == "float32" else 2
    assert len(serialized.buffer) == tensor.numel() * bytes_per_element


def test_float16_saturates_instead_of_overflowing():
    decoded = decode_tensor(encode_tensor(torch.tensor([1e6, -1e6]), "float16"))
    assert torch.isfinite(decoded).all() and decoded[0] == torch.finfo(torch.float16).max


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_scalar_loss_travels_at_full_precision(wire_dtype):
    loss = torch.tensor(2.718281828)
    assert decode_tensor(encode_tensor(loss, wire_dtype)).item() == loss.item()


def test_integers_are_lossless_and_compact_when_they_fit():
    ids = torch.tensor([[0, 1, 50256], [7, 8, 2**31 - 1]])
    serialized = encode_tensor(ids, "bfloat16")  # the wire dtype applies to floats only
    assert serialized.dtype == "int32"
    assert torch.equal(decode_tensor(serialized), ids) and decode_tensor(serialized).dtype == torch.int64
    big = torch.tensor([2**40, -(2**40)])
    assert encode_tensor(big, "float32").dtype == "int64" and torch.equal(
        decode_tensor(encode_tensor(big, "float32")), big
    )


def test_empty_and_noncontiguous_tensors():
    for wire_dtype in BOUNDS:
        assert decode_tensor(encode_tensor(torch.zeros(0, 4), wire_dtype)).shape == (0, 4)
    strided = torch.arange(12.0).reshape(3, 4).t()
    for wire_dtype in BOUNDS:
        assert torch.equal(decode_tensor(encode_tensor(strided, wire_dtype)), strided)


@pytest.mark.parametrize("wire_dtype", sorted(BOUNDS))
def test_encoding_leaves_the_callers_tensor_alone(wire_dtype):
    tensor = torch.tensor([1e6, -1e6, 0.1])
    original = tensor.clone()
    encode_tensor(tensor, wire_dtype)
    assert torch.equal(tensor, original)


def test_unsendable_tensors_are_refused():
    with pytest.raises(ProtocolError, match="wire dtype"):
        encode_tensor(torch.ones(2), "float8")
    with pytest.raises(ProtocolError, match="bool"):
        encode_tensor(torch.ones(2, dtype=torch.bool), "float32")


def _garbage_cases():
    good = encode_tensor(torch.ones(4, 4), "float32")
    cases = {
        "truncated buffer": runtime_pb2.Tensor(buffer=good.buffer[:-3], size=good.size, dtype="float32"),
        "shape larger than buffer": runtime_pb2.Tensor(buffer=good.buffer, size=[4, 5], dtype="float32"),
        "unknown dtype": runtime_pb2.Tensor(buffer=good.buffer, size=good.size, dtype="complex64"),
        "no dtype": runtime_pb2.Tensor(buffer=good.buffer, size=good.size),
        "object dtype": runtime_pb2.Tensor(buffer=good.buffer, size=good.size, dtype="object"),
        "8-bit codec": runtime_pb2.Tensor(
            buffer=good.buffer, size=good.size, dtype="float32", compression=runtime_pb2.UNIFORM_8BIT
        ),
        "unknown codec number": runtime_pb2.Tensor(buffer=good.buffer, size=good.size, dtype="float32", compression=99),
        "rank 5": runtime_pb2.Tensor(buffer=b"\0" * 4, size=[1, 1, 1, 1, 1], dtype="float32"),
        # 2**96 elements: must be refused from the header, without allocating anything
        "absurd shape": runtime_pb2.Tensor(buffer=b"", size=[2**32 - 1] * 3, dtype="float32"),
        "random bytes": runtime_pb2.Tensor(buffer=bytes(range(256)) * 3, size=[10, 10], dtype="bfloat16"),
    }
    return list(cases.items())


@pytest.mark.parametrize(("name", "serialized"), _garbage_cases(), ids=[name for name, _ in _garbage_cases()])
def test_garbage_tensors_raise_protocol_error(name, serialized):
    with pytest.raises(ProtocolError):
        decode_tensor(serialized)


def test_element_limit_is_configurable():
    serialized = encode_tensor(torch.ones(100), "float32")
    assert decode_tensor(serialized, max_elements=100).numel() == 100
    with pytest.raises(ProtocolError, match="over the limit of 99"):
        decode_tensor(serialized, max_elements=99)


def _gather(frames, receive=receive_request, limits=DEFAULT_LIMITS):
    frames = [type(frame).FromString(frame.SerializeToString()) for frame in frames]  # as if sent
    return asyncio.run(receive(iter_as_aiter(frames), limits))


def test_request_round_trip_in_parts():
    limits = WireLimits(part_bytes=1000)
    inputs, grad = torch.randn(8, 100), torch.randn(8, 100)
    request = StageRequest(BACKWARD, 2, "batch-7/mb-3", inputs, grad_outputs=grad, wire_dtype="float16",
                           forward_step=41)
    frames = list(request_frames(request, limits))
    assert len(frames) > 3 and all(frame.ByteSize() < 2000 for frame in frames)
    received = _gather(frames, limits=limits)
    assert (received.kind, received.stage, received.request_id) == (BACKWARD, 2, "batch-7/mb-3")
    assert received.targets is None and received.wire_dtype == "float16" and received.forward_step == 41
    assert torch.allclose(received.grad_outputs, grad, rtol=1e-3, atol=1e-4)


def test_a_forward_says_whether_its_backward_follows_and_never_who_sent_it():
    request = StageRequest(FORWARD, 0, "mb", torch.ones(2, 3), backward_follows=True, caller="forged")
    assert "caller" not in request.metadata()
    received = _gather(request_frames(request))
    assert received.backward_follows is True and received.caller is None  # the receiving side sets it
    assert _gather(request_frames(StageRequest(FORWARD, 0, "mb", torch.ones(2, 3)))).backward_follows is False



def test_a_request_says_whether_its_caller_has_nowhere_else_to_go():
    received = _gather(request_frames(StageRequest(BACKWARD, 1, "mb", torch.ones(2, 3), grad_outputs=torch.ones(2, 3),
                                                   patient=True)))
    assert received.patient is True
    assert "patient" not in StageRequest(FORWARD, 0, "mb", torch.ones(2, 3)).metadata()  # only said when true
    assert _gather(request_frames(StageRequest(FORWARD, 0, "mb", torch.ones(2, 3)))).patient is False


def test_last_stage_requests_carry_targets():
    ids, targets = torch.randint(0, 100, (2, 5)), torch.randint(0, 100, (2, 5))
    for kind in (FORWARD, BACKWARD):
        received = _gather(request_frames(StageRequest(kind, 0, "r", ids, targets=targets)))
        assert torch.equal(received.inputs, ids) and torch.equal(received.targets, targets)
        assert received.grad_outputs is None


def test_unknown_metadata_fields_are_ignored():
    meta = dict(kind=FORWARD, stage=1, request_id="r", wire_dtype="float32", from_the_future={"x": [1, 2]})
    frames = to_frames(meta, [encode_tensor(torch.ones(2, 3), "float32")], runtime_pb2.ExpertRequest)
    received = _gather(frames)
    assert received.stage == 1 and torch.equal(received.inputs, torch.ones(2, 3))


def test_reply_round_trip_and_error_reply():
    reply = StageReply([torch.ones(3, 4)], server_step=12, info={"note": "hi"})
    received = _gather(reply_frames(reply, "bfloat16"), receive=receive_reply)
    assert received.server_step == 12 and received.info == {"note": "hi"}
    assert torch.equal(received.tensors[0], torch.ones(3, 4))
    with pytest.raises(RemoteStageError) as error:
        _gather(error_frames("not_ready", "still loading"), receive=receive_reply)
    assert (error.value.code, error.value.message) == ("not_ready", "still loading")


@pytest.mark.parametrize(
    ("meta", "tensor_count", "match"),
    [
        (dict(kind="sideways", stage=0, request_id="r"), 1, "kind"),
        (dict(kind=FORWARD, stage=-1, request_id="r"), 1, "stage"),
        (dict(kind=FORWARD, stage=True, request_id="r"), 1, "stage"),
        (dict(kind=FORWARD, stage=0, request_id=5), 1, "request_id"),
        (dict(kind=FORWARD, stage=0, request_id="r", wire_dtype="int8"), 1, "wire_dtype"),
        (dict(kind=FORWARD, stage=0, request_id="r"), 2, "1 tensor"),
        (dict(kind=BACKWARD, stage=0, request_id="r"), 1, "2 tensor"),
        (dict(kind=FORWARD, stage=0, request_id="r", has_targets="yes"), 2, "has_targets"),
        (dict(kind=BACKWARD, stage=0, request_id="r", forward_step=-1), 2, "forward_step"),
        (dict(kind=BACKWARD, stage=0, request_id="r", forward_step="3"), 2, "forward_step"),
        (dict(kind=BACKWARD, stage=0, request_id="r", forward_step=True), 2, "forward_step"),
        (dict(kind=FORWARD, stage=0, request_id="r", backward_follows=1), 1, "backward_follows"),
        (dict(kind=FORWARD, stage=0, request_id="r", backward_follows="true"), 1, "backward_follows"),
        (dict(kind=FORWARD, stage=0, request_id="r", patient=1), 1, "patient"),
        (dict(kind=FORWARD, stage=0, request_id="r", patient="true"), 1, "patient"),
    ],
)
def test_invalid_requests_raise_protocol_error(meta, tensor_count, match):
    tensors = [encode_tensor(torch.ones(2, 2), "float32")] * tensor_count
    with pytest.raises(ProtocolError, match=match):
        _gather(to_frames(meta, tensors, runtime_pb2.ExpertRequest))


def test_request_validation_on_the_sending_side():
    with pytest.raises(ProtocolError, match="targets must be integer"):
        StageRequest(FORWARD, 0, "r", torch.ones(2), targets=torch.ones(2))
    with pytest.raises(ProtocolError, match="either targets"):
        StageRequest(BACKWARD, 0, "r", torch.ones(2))
    with pytest.raises(ProtocolError, match="over the limit"):
        request_frames(StageRequest(FORWARD, 0, "r", torch.ones(1000)), WireLimits(max_message_bytes=1000))


def _frames(*parts, meta=b"\x80"):
    return [runtime_pb2.ExpertRequest(metadata=meta)] + [runtime_pb2.ExpertRequest(tensors=[p]) for p in parts]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "before any metadata"),
        (_frames(meta=b"\xc1garbage"), "not valid msgpack"),
        (_frames(meta=msgpack.packb([1, 2])), "must be a map"),
        (_frames(runtime_pb2.Tensor(buffer=b"abc")), "without a header"),
        (_frames(runtime_pb2.Tensor(buffer=b"\0" * 8, size=[4], dtype="float32", chunks=2)), "missing 1"),
        (
            _frames(
                runtime_pb2.Tensor(buffer=b"\0" * 16, size=[4], dtype="float32", chunks=1),
                runtime_pb2.Tensor(buffer=b"\0"),
            ),
            "more parts",
        ),
        (
            _frames(
                runtime_pb2.Tensor(buffer=b"\0" * 8, size=[4], dtype="float32", chunks=2),
                runtime_pb2.Tensor(buffer=b""),
            ),
            "empty continuation",
        ),
        (_frames(runtime_pb2.Tensor(size=[2**20], dtype="float32", chunks=9)), "over what is left"),
        (_frames(*[runtime_pb2.Tensor(buffer=b"\0" * 4, size=[1], dtype="float32")] * 3), "at most 2 tensors"),
        (_frames(meta=b"\x80" + b"\0" * 2000), "metadata is 2001 bytes"),
    ],
    ids=[
        "empty",
        "garbage-meta",
        "list-meta",
        "headless",
        "truncated",
        "extra",
        "empty-part",
        "cap",
        "count",
        "big-meta",
    ],
)
def test_malformed_streams_raise_protocol_error(frames, match):
    limits = WireLimits(max_message_bytes=1 << 20, max_tensors=2, max_metadata_bytes=1000)
    with pytest.raises(ProtocolError, match=match):
        asyncio.run(gather_frames(iter_as_aiter(frames), limits))


def test_metadata_helpers_round_trip():
    meta = {"ok": True, "server_step": 3, "nested": {"a": [1.5, "b"]}}
    frames = [runtime_pb2.ExpertResponse(metadata=encode_metadata(meta))]
    assert asyncio.run(gather_frames(iter_as_aiter(frames))) == (meta, [])


class _Stage(StageHandler):
    """Replies with whatever `reply` says, or raises `error`."""

    def __init__(self, reply=None, error=None):
        self.reply, self.error = reply, error

    async def forward(self, request):
        if self.error is not None:
            raise self.error
        return self.reply

    backward = forward


def _context() -> P2PContext:
    return P2PContext(handle_name="test", local_id=None, remote_id=None)


def _serve(handler, frames, endpoint="rpc_forward", **service_options):
    """Run one request through a StageService endpoint, no network; returns (reply or error, frames left)."""
    remaining = list(frames)

    async def requests():
        while remaining:
            yield remaining.pop(0)

    async def scenario():
        service = StageService(handler, limits=WireLimits(max_tensors=2, max_message_bytes=1 << 16),
                               **service_options)
        # like hivemind, run the endpoint to its end before the caller reads the reply
        responses = [frame async for frame in getattr(service, endpoint)(requests(), _context())]
        try:
            return await receive_reply(iter_as_aiter(responses)), len(remaining)
        except RemoteStageError as e:
            return e, len(remaining)

    return asyncio.run(asyncio.wait_for(scenario(), 10))


def test_service_turns_every_failure_into_an_error_reply():
    forward = list(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(2, 2))))
    ok, _ = _serve(_Stage(StageReply([torch.ones(1)], server_step=4)), forward)
    assert ok.server_step == 4 and torch.equal(ok.tensors[0], torch.ones(1))

    cases = [
        (_Stage(error=RequestRejected(NOT_READY, "loading")), forward, "rpc_forward", NOT_READY, "loading"),
        (_Stage(error=KeyError("boom")), forward, "rpc_forward", INTERNAL, "KeyError"),
        (_Stage(StageReply([torch.ones(1)] * 3)), forward, "rpc_forward", INTERNAL, "could not encode"),
        (_Stage(StageReply()), forward, "rpc_backward", BAD_REQUEST, "forward request was sent to the backward"),
    ]
    for handler, frames, endpoint, code, text in cases:
        error, _ = _serve(handler, frames, endpoint)
        assert isinstance(error, RemoteStageError) and error.code == code and text in error.message


def test_service_refuses_an_oversized_request_early_and_drains_the_rest():
    big = list(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(64, 1024)), WireLimits(part_bytes=4096)))
    error, left = _serve(_Stage(StageReply()), big)
    assert error.code == BAD_REQUEST and "message limit" in error.message
    assert left == 0  # read to the end, so hivemind's reader never blocks on a full queue


@pytest.mark.parametrize("kept", [0, 1], ids=["metadata-only", "one-of-two"])
def test_a_stream_cut_after_whole_tensors_is_caught(kept):
    """Frames end on a tensor boundary (seen under load: a reply that lost its tail in transport)."""
    tensors = [encode_tensor(torch.ones(3), "float32"), encode_tensor(torch.zeros(2), "float32")]
    frames = list(to_frames({"ok": True}, tensors, runtime_pb2.ExpertResponse))
    assert asyncio.run(gather_frames(iter_as_aiter(frames)))[0] == {"ok": True}  # whole: the count is not metadata
    with pytest.raises(ProtocolError, match=f"declared 2 tensors, {kept} arrived"):
        asyncio.run(gather_frames(iter_as_aiter(frames[:1 + kept])))


def test_admission_refuses_from_the_metadata_before_any_tensor_is_read():
    seen = []

    def admit(kind, meta):
        seen.append((kind, meta["request_id"]))
        raise RequestRejected(NOT_READY, "queue full")

    forward = list(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(64, 1024)), WireLimits(part_bytes=4096)))
    forward[1] = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=b"junk", dtype="nonsense")])
    handler = _Stage(StageReply([torch.ones(1)]))
    error, left = _serve(handler, forward, admit=admit)
    # NOT_READY, not the BAD_REQUEST the junk tensor and the oversized message would have earned
    assert error.code == NOT_READY and error.message == "queue full"
    assert seen == [(FORWARD, "r")] and left == 0  # the rest was drained, not decoded

    ok, _ = _serve(handler, request_frames(StageRequest(FORWARD, 0, "r", torch.ones(2))), admit=lambda k, m: None)
    assert torch.equal(ok.tensors[0], torch.ones(1))


class _Gate(StageHandler):
    """Holds every request until `release` is set."""

    def __init__(self):
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def forward(self, request):
        self.entered.set()
        await self.release.wait()
        return StageReply([torch.ones(1)])

    backward = forward


def test_requests_over_the_concurrency_cap_are_refused_at_once_as_busy():
    async def scenario():
        gate = _Gate()
        service = StageService(gate, max_concurrent=1)
        request = StageRequest(FORWARD, 0, "r", torch.ones(2))

        async def call(endpoint="rpc_forward"):
            frames = iter_as_aiter(list(request_frames(request)))
            responses = [frame async for frame in getattr(service, endpoint)(frames, _context())]
            try:
                return await receive_reply(iter_as_aiter(responses))
            except RemoteStageError as e:
                return e

        first = asyncio.ensure_future(call())
        await asyncio.wait_for(gate.entered.wait(), 5)
        assert service.active == 1
        busy = await asyncio.wait_for(call("rpc_backward"), 5)  # answered while the first is still held
        assert isinstance(busy, RemoteStageError) and busy.code == BUSY and "max_concurrent" in busy.message
        gate.release.set()
        assert torch.equal((await asyncio.wait_for(first, 5)).tensors[0], torch.ones(1))
        assert service.active == 0  # the slot came back
        assert torch.equal((await asyncio.wait_for(call(), 5)).tensors[0], torch.ones(1))

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_cancelled_request_gives_its_slot_back():
    async def scenario():
        gate = _Gate()
        service = StageService(gate, max_concurrent=1)
        frames = iter_as_aiter(list(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(2)))))
        task = asyncio.ensure_future(service.rpc_forward(frames, _context()).__anext__())
        await asyncio.wait_for(gate.entered.wait(), 5)
        task.cancel()  # what hivemind does when the caller goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.active == 0

    asyncio.run(asyncio.wait_for(scenario(), 20))


# ---- expert calls: `experts`, `samples`, `moe_lost` ------------------------------------------------


def test_an_expert_backward_round_trips_its_experts_and_samples():
    inputs, grad = torch.randn(5, 16), torch.randn(5, 16)
    request = StageRequest(BACKWARD, 1, "mb/experts", inputs, grad_outputs=grad, experts=[(0, 2), (3, 0), (2, 3)],
                           samples=4, stage_step=7)
    received = _gather(request_frames(request))
    assert received.stage_step == 7
    assert (received.kind, received.stage, received.request_id) == (BACKWARD, 1, "mb/experts")
    assert received.experts == [(0, 2), (3, 0), (2, 3)] and received.samples == 4 and received.moe_lost is None
    assert torch.equal(received.inputs, inputs) and torch.equal(received.grad_outputs, grad)
    plain = _gather(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(2, 3))))
    assert (plain.experts, plain.samples, plain.moe_lost) == (None, None, None)  # absent stays absent


def test_a_forward_to_no_expert_with_no_rows_is_well_formed():
    received = _gather(request_frames(StageRequest(FORWARD, 0, "r", torch.zeros(0, 4), experts=[(1, 0)])))
    assert received.experts == [(1, 0)] and received.inputs.shape == (0, 4)


def test_moe_lost_round_trips():
    request = StageRequest(BACKWARD, 0, "r", torch.ones(2, 3), grad_outputs=torch.ones(2, 3),
                           moe_lost=[(0, [1, 2]), (3, [])])
    assert _gather(request_frames(request)).moe_lost == [(0, [1, 2]), (3, [])]


def _expert_meta(kind=FORWARD, **fields):
    return dict(kind=kind, stage=0, request_id="r", wire_dtype="float32", **fields)


@pytest.mark.parametrize(
    ("fields", "shape", "match"),
    [
        (dict(experts=[[0, 2], [1, 2]]), (3, 4), "account for 4 rows"),  # rows over the inputs'
        (dict(experts=[[0, 1]]), (3, 4), "account for 1 rows"),  # rows under the inputs'
        (dict(experts=[[0, 1], [0, 2]]), (3, 4), "twice"),
        (dict(experts=[[-1, 3]]), (3, 4), "non-negative"),
        (dict(experts=[[0, -3]]), (3, 4), "non-negative"),
        (dict(experts=[[True, 3]]), (3, 4), "non-negative integers"),
        (dict(experts=[[0, True], [1, 2]]), (3, 4), "non-negative integers"),
        (dict(experts=[[0, 3.0]]), (3, 4), "non-negative integers"),
        (dict(experts=[[0, 1, 2]]), (3, 4), "\\[expert, rows\\]"),
        (dict(experts=[3]), (3, 4), "\\[expert, rows\\]"),
        (dict(experts="0:3"), (3, 4), "must be a list"),
        (dict(experts={"0": 3}), (3, 4), "must be a list"),
        (dict(experts=3), (3, 4), "must be a list"),
        (dict(experts=[[0, 4]]), (2, 2, 1), "expected \\[rows, d_model\\]"),
        (dict(experts=[[0, 2]]), (2,), "expected \\[rows, d_model\\]"),
        (dict(samples=0), (3, 4), "samples"),
        (dict(samples=-4), (3, 4), "samples"),
        (dict(samples=True), (3, 4), "samples"),
        (dict(samples=2.0), (3, 4), "samples"),
        (dict(samples="4"), (3, 4), "samples"),
        (dict(stage_step=-1), (3, 4), "stage_step"),
        (dict(stage_step=True), (3, 4), "stage_step"),
        (dict(stage_step=1.0), (3, 4), "stage_step"),
        (dict(moe_lost="0"), (3, 4), "moe_lost must be a list"),
        (dict(moe_lost={"0": [1]}), (3, 4), "moe_lost must be a list"),
        (dict(moe_lost=[0, [1]]), (3, 4), "moe_lost entry"),  # one level of nesting missing
        (dict(moe_lost=[[0]]), (3, 4), "moe_lost entry"),
        (dict(moe_lost=[[0, 1]]), (3, 4), "moe_lost entry"),  # experts not a list
        (dict(moe_lost=[[0, [[1]]]]), (3, 4), "moe_lost entry"),  # one level too many
        (dict(moe_lost=[[0, [1], 2]]), (3, 4), "moe_lost entry"),
        (dict(moe_lost=[[-1, [1]]]), (3, 4), "moe_lost entry"),
        (dict(moe_lost=[[0, [-1]]]), (3, 4), "moe_lost entry"),
        (dict(moe_lost=[[True, [1]]]), (3, 4), "moe_lost entry"),
        (dict(moe_lost=[[0, [False]]]), (3, 4), "moe_lost entry"),
        (dict(moe_lost=[[0, "1"]]), (3, 4), "moe_lost entry"),
    ],
)
def test_malformed_expert_fields_raise_protocol_error(fields, shape, match):
    frames = to_frames(_expert_meta(**fields), [encode_tensor(torch.ones(shape), "float32")],
                       runtime_pb2.ExpertRequest)
    with pytest.raises(ProtocolError, match=match):
        _gather(frames)


def test_expert_fields_are_checked_on_the_sending_side_too():
    x = torch.ones(3, 4)
    assert StageRequest(FORWARD, 0, "r", x, experts=[[0, 1], [5, 2]]).experts == [(0, 1), (5, 2)]
    with pytest.raises(ProtocolError, match="twice"):
        StageRequest(FORWARD, 0, "r", x, experts=[(2, 1), (2, 2)])
    with pytest.raises(ProtocolError, match="account for"):
        StageRequest(FORWARD, 0, "r", x, experts=[(0, 2)])
    with pytest.raises(ProtocolError, match="samples"):
        StageRequest(BACKWARD, 0, "r", x, grad_outputs=x, experts=[(0, 3)], samples=0)
    with pytest.raises(ProtocolError, match="moe_lost"):
        StageRequest(BACKWARD, 0, "r", x, grad_outputs=x, moe_lost=[(0, [-2])])


def test_expert_lists_are_bounded():
    limit = MAX_EXPERT_ENTRIES
    many = torch.zeros(limit, 2)
    ok = StageRequest(FORWARD, 0, "r", many, experts=[(e, 1) for e in range(limit)])
    assert len(ok.experts) == limit
    assert len(_gather(request_frames(ok)).experts) == limit  # the most there may be also fits the metadata
    with pytest.raises(ProtocolError, match=f"at most {limit}"):
        StageRequest(FORWARD, 0, "r", torch.zeros(limit + 1, 2), experts=[(e, 1) for e in range(limit + 1)])
    frames = to_frames(_expert_meta(experts=[[e, 0] for e in range(limit + 1)]),
                       [encode_tensor(torch.zeros(0, 2), "float32")], runtime_pb2.ExpertRequest)
    with pytest.raises(ProtocolError, match=f"at most {limit}"):
        _gather(frames)

    x = torch.ones(1, 2)
    assert len(check_moe_lost([[b, [0]] for b in range(MAX_MOE_BLOCKS)])) == MAX_MOE_BLOCKS
    with pytest.raises(ProtocolError, match=f"at most {MAX_MOE_BLOCKS}"):
        StageRequest(FORWARD, 0, "r", x, moe_lost=[(b, [0]) for b in range(MAX_MOE_BLOCKS + 1)])
    assert check_moe_lost([[0, list(range(limit))]])[0][1] == list(range(limit))
    with pytest.raises(ProtocolError, match="moe_lost entry"):
        StageRequest(FORWARD, 0, "r", x, moe_lost=[(0, list(range(limit + 1)))])
