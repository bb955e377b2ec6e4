"""The sharded-round mailbox (swarm.averaging.collective), without a network: the checks of what arrives,
the early buffer, the inbox, and how messages are packed and read back."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm.averaging import collective
from swarm.averaging.collective import (
    CHECK,
    CHECK_CHUNKS,
    EARLY_ROUNDS,
    GRAD,
    LIMITS,
    MAX_ROUND_KEY,
    MESSAGE_CHUNKS,
    MESSAGE_ELEMENTS,
    NORM,
    STATE,
    UPDATE,
    Mailbox,
)
from swarm.averaging.crosscheck import DIGEST_BYTES
from swarm.protocol.codec import encode_tensor
from swarm.protocol.errors import ProtocolError
from swarm.protocol.framing import decode_metadata, encode_metadata
from swarm.zero import ChunkMoments, Layout

pytestmark = pytest.mark.timeout(60)

PEERS = [f"peer-{name}" for name in ("alpha", "bravo", "charlie", "delta", "echo")]

# ---------------------------------------------------------------------------------------------------------------
# collective.Mailbox: checks of what arrives, without a network

SENDER, OTHER, STRANGER = "12D3KooWsender00000001", "12D3KooWother000000002", "12D3KooWstranger000003"


def mailbox() -> Mailbox:
    # chunks [0, 8), [8, 16), [16, 17): the last one has a single element
    return Mailbox(p2p=None, loop=None, prefix="x", layout=Layout([(10,), (7,)], chunk_elements=8), send_timeout=1.0)


def request(meta: dict, *tensors: torch.Tensor) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=encode_metadata(meta),
                                     tensors=[encode_tensor(t, "float32") for t in tensors])


def many_chunks_mailbox() -> Mailbox:
    # one element a chunk: room for more chunk ids than one message may list
    layout = Layout([(2 * MESSAGE_CHUNKS,)], chunk_elements=1)
    return Mailbox(p2p=None, loop=None, prefix="x", layout=layout, send_timeout=1.0)


def test_mailbox_parses_a_good_grad_message():
    box = mailbox()
    tensor = torch.randn(8)
    round_key, messages = box._parse(request({"round": "5:g", "kind": GRAD, "chunks": [1]}, tensor), SENDER)
    assert round_key == "5:g"
    assert len(messages) == 1
    key, payload = messages[0]
    assert key == (GRAD, 1, SENDER)
    assert torch.equal(payload, tensor)


def test_mailbox_parses_every_kind():
    box = mailbox()
    one = torch.tensor([0.5])
    _, [(key, payload)] = box._parse(request({"round": "r", "kind": UPDATE, "chunks": [2]}, one), SENDER)
    assert key == (UPDATE, 2, SENDER)
    assert torch.equal(payload, one)
    _, norms = box._parse(request({"round": "r", "kind": NORM, "chunks": [0, 2], "values": [2.5, 0.5]}), SENDER)
    assert norms == [((NORM, 0, SENDER), 2.5), ((NORM, 2, SENDER), 0.5)]
    short, long = b"u" * DIGEST_BYTES, b"u" * DIGEST_BYTES + b"m" * DIGEST_BYTES
    _, checks = box._parse(request({"round": "r", "kind": CHECK, "chunks": [1, 2], "digests": [short, long]}), SENDER)
    # (the update's digest, and the moments' where the receiver gets them)
    assert checks == [((CHECK, 1, SENDER), (short, None)), ((CHECK, 2, SENDER), (short, b"m" * DIGEST_BYTES))]
    meta = {"round": "r", "kind": STATE, "chunks": [2], "steps": [3]}
    _, [(key, state)] = box._parse(request(meta, one, one * 2), SENDER)
    assert key == (STATE, 2, SENDER)
    assert isinstance(state, ChunkMoments) and state.steps == 3
    assert torch.equal(state.exp_avg, one) and torch.equal(state.exp_avg_sq, one * 2)
    longest = "k" * MAX_ROUND_KEY  # the longest round key allowed still parses
    assert box._parse(request({"round": longest, "kind": GRAD, "chunks": [2]}, one), SENDER)[0] == longest


@pytest.mark.parametrize("value", [0.0, math.inf, math.nan])
def test_mailbox_takes_a_zero_or_non_finite_norm(value):
    # a non-finite sum of squares (its owners agreeing) is every member's signal to skip the step: it must travel
    meta = {"round": "r", "kind": NORM, "chunks": [1], "values": [value]}
    _, [(key, got)] = mailbox()._parse(request(meta), SENDER)
    assert key == (NORM, 1, SENDER)
    assert got == value or (math.isnan(value) and math.isnan(got))


@pytest.mark.parametrize("kind", [GRAD, UPDATE])
@pytest.mark.parametrize("chunks", [[0, 1, 2], [0, 2], [1, 2], [0, 1]])
def test_mailbox_splits_a_packed_message_into_its_chunks(kind, chunks):
    box = mailbox()
    flat = torch.randn(box.layout.numel)
    tensor = torch.cat([flat[slice(*box.layout.bounds(c))] for c in chunks])
    _, messages = box._parse(request({"round": "r", "kind": kind, "chunks": chunks}, tensor), SENDER)
    assert [key for key, _ in messages] == [(kind, c, SENDER) for c in chunks]
    for c, (_, payload) in zip(chunks, messages):
        assert payload.shape == (box.layout.chunk_numel(c),)
        assert torch.equal(payload, flat[slice(*box.layout.bounds(c))])


def test_mailbox_splits_packed_moments_with_their_own_step_counts():
    box = mailbox()
    exp_avg, exp_avg_sq = torch.randn(17), torch.rand(17)
    meta = {"round": "r", "kind": STATE, "chunks": [0, 1, 2], "steps": [4, 1, 9]}
    _, messages = box._parse(request(meta, exp_avg, exp_avg_sq), SENDER)
    assert [key for key, _ in messages] == [(STATE, c, SENDER) for c in (0, 1, 2)]
    for (c, steps), (_, moments) in zip([(0, 4), (1, 1), (2, 9)], messages):
        start, end = box.layout.bounds(c)
        assert isinstance(moments, ChunkMoments) and moments.steps == steps
        assert torch.equal(moments.exp_avg, exp_avg[start:end])
        assert torch.equal(moments.exp_avg_sq, exp_avg_sq[start:end])


def test_mailbox_takes_as_many_chunks_as_a_message_may_list_and_no_more():
    box = many_chunks_mailbox()
    ids = list(range(1, 2 * MESSAGE_CHUNKS, 2))  # (not consecutive: any increasing ids will do)
    assert len(ids) == MESSAGE_CHUNKS
    _, messages = box._parse(request({"round": "r", "kind": GRAD, "chunks": ids}, torch.arange(len(ids)) * 1.0),
                             SENDER)
    assert [(key, float(payload)) for key, payload in messages] == [((GRAD, c, SENDER), float(i))
                                                                    for i, c in enumerate(ids)]
    for over in ([*ids, ids[-1] + 1], list(range(MESSAGE_CHUNKS + 1))):
        with pytest.raises(ValueError):
            box._parse(request({"round": "r", "kind": GRAD, "chunks": over}, torch.zeros(len(over))), SENDER)


def test_the_largest_state_message_fits_the_metadata_limit():
    # the most chunk ids a message may list, each as large as msgpack makes them, with large step counts
    box = Mailbox(p2p=None, loop=None, prefix="x", send_timeout=1.0,
                  layout=Layout([(2**16 + MESSAGE_CHUNKS,)], chunk_elements=1))
    ids = list(range(2**16, 2**16 + MESSAGE_CHUNKS))
    meta = {"round": "r" * MAX_ROUND_KEY, "kind": STATE, "chunks": ids, "steps": [2**40] * MESSAGE_CHUNKS}
    assert len(encode_metadata(meta)) <= LIMITS.max_metadata_bytes
    _, messages = box._parse(request(meta, torch.zeros(MESSAGE_CHUNKS), torch.zeros(MESSAGE_CHUNKS)), SENDER)
    assert len(messages) == MESSAGE_CHUNKS and messages[-1][1].steps == 2**40


def test_the_largest_norm_and_check_messages_fit_the_metadata_limit():
    box = Mailbox(p2p=None, loop=None, prefix="x", send_timeout=1.0,
                  layout=Layout([(2**16 + MESSAGE_CHUNKS,)], chunk_elements=1))
    ids = list(range(2**16, 2**16 + MESSAGE_CHUNKS))
    norms = {"round": "r" * MAX_ROUND_KEY, "kind": NORM, "chunks": ids, "values": [math.pi] * MESSAGE_CHUNKS}
    checks = {"round": "r" * MAX_ROUND_KEY, "kind": CHECK, "chunks": ids[:CHECK_CHUNKS],
              "digests": [b"d" * 2 * DIGEST_BYTES] * CHECK_CHUNKS}
    for meta in (norms, checks):
        assert len(encode_metadata(meta)) <= LIMITS.max_metadata_bytes
        assert len(box._parse(request(meta), SENDER)[1]) == len(meta["chunks"])
    # one more check than a message may carry is refused
    checks = {**checks, "chunks": ids[:CHECK_CHUNKS + 1], "digests": [b"d" * DIGEST_BYTES] * (CHECK_CHUNKS + 1)}
    with pytest.raises(ValueError):
        box._parse(request(checks), SENDER)


def test_mailbox_takes_metadata_up_to_its_limit():
    meta = {"round": "r", "kind": GRAD, "chunks": [0], "pad": ""}
    # "pad" grows from a 1-byte to a 3-byte string header once it is over 255 bytes
    meta["pad"] = "x" * (LIMITS.max_metadata_bytes - len(encode_metadata(meta)) - 2)
    assert len(encode_metadata(meta)) == LIMITS.max_metadata_bytes
    assert len(mailbox()._parse(request(meta, torch.zeros(8)), SENDER)[1]) == 1
    meta["pad"] += "x"
    with pytest.raises(ProtocolError):
        mailbox()._parse(request(meta, torch.zeros(8)), SENDER)


def state(chunks: list, steps, *tensors: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
    meta = {"round": "r", "kind": STATE, "chunks": chunks}
    if steps is not None:
        meta["steps"] = steps
    return meta, list(tensors)


@pytest.mark.parametrize("meta, tensors", [
    # kinds
    ({"round": "r", "kind": "gradient", "chunks": [0]}, [torch.zeros(8)]),
    ({"round": "r", "chunks": [0]}, [torch.zeros(8)]),
    # chunk ids: of this layout, ints, strictly increasing, in a list
    ({"round": "r", "kind": GRAD, "chunks": [3]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [1, 3]}, [torch.zeros(9)]),
    ({"round": "r", "kind": GRAD, "chunks": [-1]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [-1, 0]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": [True]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, True]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": [0.0]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 1.0]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": ["0"]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [None]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [[0]]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 0]}, [torch.zeros(16)]),  # a repeat
    ({"round": "r", "kind": GRAD, "chunks": [1, 1]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": [1, 0]}, [torch.zeros(16)]),  # decreasing
    ({"round": "r", "kind": GRAD, "chunks": [2, 1, 0]}, [torch.zeros(17)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 2, 1]}, [torch.zeros(17)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 1, 1, 2]}, [torch.zeros(25)]),
    ({"round": "r", "kind": GRAD}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunk": 0}, [torch.zeros(8)]),  # the old single-chunk form
    ({"round": "r", "kind": GRAD, "chunks": 0}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": None}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": "0"}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": {"0": 0}}, [torch.zeros(8)]),
    # a tensor kind needs at least one chunk
    ({"round": "r", "kind": GRAD, "chunks": []}, [torch.zeros(0)]),
    ({"round": "r", "kind": GRAD, "chunks": []}, [torch.zeros(8)]),
    ({"round": "r", "kind": UPDATE, "chunks": []}, [torch.zeros(0)]),
    state([], [], torch.zeros(0), torch.zeros(0)),
    # the number of tensors
    ({"round": "r", "kind": GRAD, "chunks": [0]}, []),
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(8), torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(8), torch.zeros(8)]),  # one tensor, not one a chunk
    state([0], [1], torch.zeros(8)),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [1.0]}, [torch.zeros(8)]),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [b"d" * DIGEST_BYTES]}, [torch.zeros(8)]),
    # sizes: the sum of the listed chunks', in float32
    ({"round": "r", "kind": GRAD, "chunks": [1]}, [torch.zeros(7)]),  # chunk 1 has 8 elements
    ({"round": "r", "kind": GRAD, "chunks": [2]}, [torch.zeros(8)]),  # chunk 2 has 1
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(8)]),  # two chunks have 16
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(17)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 2]}, [torch.zeros(16)]),  # 9
    ({"round": "r", "kind": UPDATE, "chunks": [0, 1, 2]}, [torch.zeros(16)]),  # 17
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(MESSAGE_ELEMENTS + 1)]),  # over the cap, never decoded
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(2, 4)]),  # the right count in the wrong shape
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(2, 8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(8, dtype=torch.int64)]),
    state([1, 2], [1, 1], torch.zeros(9), torch.zeros(8)),  # both tensors have every chunk's elements
    state([1, 2], [1, 1], torch.zeros(8), torch.zeros(9)),
    # norms: a float >= 0 for each chunk listed
    ({"round": "r", "kind": NORM, "chunks": []}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "values": []}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "value": 1.0}, []),  # the old form: one partial sum, no chunks
    ({"round": "r", "kind": NORM, "chunks": [0], "value": 1.0}, []),
    ({"round": "r", "kind": NORM, "chunks": [0]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": 1.0}, []),
    ({"round": "r", "kind": NORM, "chunks": [0, 1], "values": [1.0]}, []),  # fewer values than chunks
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [1.0, 2.0]}, []),  # more
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [1]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [True]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": ["1.0"]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [[1.0]]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [None]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0], "values": [-math.inf]}, []),
    ({"round": "r", "kind": NORM, "chunks": [0, 1], "values": [1.0, -1e-300]}, []),
    # checks: one or two digests of DIGEST_BYTES for each chunk listed
    ({"round": "r", "kind": CHECK, "chunks": []}, []),
    ({"round": "r", "kind": CHECK, "chunks": [], "digests": []}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": b"d" * DIGEST_BYTES}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0, 1], "digests": [b"d" * DIGEST_BYTES]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [b"d" * DIGEST_BYTES] * 2}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [b"d" * (DIGEST_BYTES - 1)]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [b"d" * (DIGEST_BYTES + 1)]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [b"d" * 3 * DIGEST_BYTES]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [b""]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": ["d" * DIGEST_BYTES]}, []),
    ({"round": "r", "kind": CHECK, "chunks": [0], "digests": [None]}, []),
    ({"round": "r", "kind": "mean", "chunks": [0]}, [torch.zeros(8)]),  # version 1's mean for co-owners
    # moments: one step count >= 1 a chunk, finite values, second moments >= 0
    state([2], None, torch.ones(1), torch.ones(1)),
    state([2], 1, torch.ones(1), torch.ones(1)),  # the old single count
    state([2], [0], torch.ones(1), torch.ones(1)),
    state([2], [-1], torch.ones(1), torch.ones(1)),
    state([2], [True], torch.ones(1), torch.ones(1)),
    state([2], [1.0], torch.ones(1), torch.ones(1)),
    state([2], ["1"], torch.ones(1), torch.ones(1)),
    state([2], [None], torch.ones(1), torch.ones(1)),
    state([2], [], torch.ones(1), torch.ones(1)),
    state([2], [1, 1], torch.ones(1), torch.ones(1)),  # more counts than chunks
    state([1, 2], [1], torch.ones(9), torch.ones(9)),  # fewer
    state([0, 1, 2], [1, 1], torch.ones(17), torch.ones(17)),
    state([1, 2], [1, 0], torch.ones(9), torch.ones(9)),
    state([2], [1], torch.tensor([math.nan]), torch.ones(1)),
    state([2], [1], torch.ones(1), torch.tensor([math.inf])),
    state([2], [1], torch.ones(1), torch.tensor([-1e-3])),
    state([1, 2], [1, 1], torch.ones(9), torch.cat([torch.ones(8), torch.tensor([-1e-3])])),  # in the last chunk
    state([1, 2], [1, 1], torch.cat([torch.tensor([math.inf]), torch.ones(8)]), torch.ones(9)),  # in the first
    # a non-finite update (a gradient may be: every member then skips the step)
    ({"round": "r", "kind": UPDATE, "chunks": [0]}, [torch.cat([torch.ones(7), torch.tensor([math.nan])])]),
    ({"round": "r", "kind": UPDATE, "chunks": [0, 1]}, [torch.cat([torch.tensor([math.inf]), torch.ones(15)])]),
    # round keys
    ({"round": "r" * (MAX_ROUND_KEY + 1), "kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    ({"round": "", "kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    ({"round": 5, "kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    ({"kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    # metadata over its limit
    ({"round": "r", "kind": GRAD, "chunks": [0], "pad": "x" * LIMITS.max_metadata_bytes}, [torch.zeros(8)]),
])
def test_mailbox_refuses_malformed_messages(meta, tensors):
    with pytest.raises((ValueError, ProtocolError)):
        mailbox()._parse(request(meta, *tensors), SENDER)


def test_mailbox_refuses_metadata_that_is_not_a_map():
    bad = runtime_pb2.ExpertRequest(metadata=encode_metadata([1, 2]))
    with pytest.raises(ProtocolError):
        mailbox()._parse(bad, SENDER)


def test_mailbox_refuses_a_negative_norm():
    # a partial sum of squares is never negative; accepting one lets a single member make every member's
    # clip_coefficient raise ValueError (math domain error) instead of RoundFailed, or silently shrink the norm
    with pytest.raises(ValueError):
        mailbox()._parse(request({"round": "r", "kind": NORM, "chunks": [0], "values": [-1.0]}), SENDER)


def test_handle_delivers_a_packed_message_and_refuses_a_bad_one():
    box = mailbox()
    inbox = box.open_round("r", [SENDER])
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: SENDER))
    tensor = torch.randn(9)
    reply = asyncio.run(box._handle(request({"round": "r", "kind": UPDATE, "chunks": [1, 2]}, tensor), context))
    assert decode_metadata(reply.metadata) == {"ok": True}
    assert torch.equal(inbox.messages[(UPDATE, 1, SENDER)], tensor[:8])
    assert torch.equal(inbox.messages[(UPDATE, 2, SENDER)], tensor[8:])
    reply = asyncio.run(box._handle(request({"round": "r", "kind": UPDATE, "chunks": [0, 0]}, torch.zeros(16)),
                                    context))
    assert "error" in decode_metadata(reply.metadata)
    assert box.dropped == 1
    assert set(inbox.messages) == {(UPDATE, 1, SENDER), (UPDATE, 2, SENDER)}


def test_deliver_to_an_open_round_takes_members_only():
    box = mailbox()
    inbox = box.open_round("r", [SENDER, OTHER])
    with pytest.raises(ValueError):
        box._deliver("r", [((GRAD, 0, STRANGER), torch.zeros(8))])
    with pytest.raises(ValueError):
        box._deliver("r", [((GRAD, 0, STRANGER), torch.zeros(8)), ((GRAD, 1, STRANGER), torch.zeros(8))])
    first, second = torch.ones(8), torch.full((8,), 2.0)
    box._deliver("r", [((GRAD, 0, SENDER), first)])
    box._deliver("r", [((GRAD, 0, SENDER), second)])  # a repeat never replaces what came first
    got = inbox.wait([(GRAD, 0, SENDER)], time.monotonic() + 1.0)
    assert torch.equal(got[(GRAD, 0, SENDER)], first)
    assert not any(sender == STRANGER for _, _, sender in inbox.messages)


def test_deliver_puts_every_chunk_of_a_packed_message():
    box = mailbox()
    inbox = box.open_round("r", [SENDER])
    parts = [torch.full((8,), 1.0), torch.full((8,), 2.0), torch.full((1,), 3.0)]
    box._deliver("r", [((UPDATE, c, SENDER), part) for c, part in enumerate(parts)])
    got = inbox.wait([(UPDATE, c, SENDER) for c in range(3)], time.monotonic() + 1.0)
    for c, part in enumerate(parts):
        assert torch.equal(got[(UPDATE, c, SENDER)], part)


def test_early_messages_are_delivered_when_their_round_opens():
    box = mailbox()
    box._deliver("r", [((GRAD, 0, SENDER), torch.ones(8)), ((GRAD, 2, SENDER), torch.ones(1))])
    box._deliver("r", [((NORM, 0, STRANGER), 1.0)])  # membership is unknown until the round opens
    box._deliver("later", [((GRAD, 1, OTHER), torch.ones(8)), ((GRAD, 2, OTHER), torch.ones(1))])
    inbox = box.open_round("r", [SENDER, OTHER])
    assert set(inbox.messages) == {(GRAD, 0, SENDER), (GRAD, 2, SENDER)}  # the stranger's message is dropped
    assert "r" not in box._early and "later" in box._early
    assert box._early_bytes == 9 * 4  # only "later"'s message still counts against the budget
    box.close_round("r")
    # after the round closes, a late message waits among the early ones instead of reaching the old inbox
    box._deliver("r", [((GRAD, 1, OTHER), torch.ones(8))])
    assert (GRAD, 1, OTHER) not in inbox.messages


def test_early_buffer_is_bounded_in_bytes():
    box = mailbox()
    filler = torch.zeros(box.max_early_bytes // 4)  # exactly the budget
    box._deliver("r", [((GRAD, 0, SENDER), filler)])
    with pytest.raises(ValueError):
        box._deliver("r", [((GRAD, 1, SENDER), torch.zeros(8))])
    with pytest.raises(ValueError):
        box._deliver("other", [((NORM, 0, SENDER), 1.0)])
    box.forget_early()  # the rounds are over: their budget is free again
    assert box._early == {} and box._early_bytes == 0
    box._deliver("r", [((GRAD, 1, SENDER), torch.zeros(8))])


def test_early_buffer_counts_every_chunk_of_a_message_and_takes_all_or_none():
    box = mailbox()
    half = torch.zeros(box.max_early_bytes // 8)
    with pytest.raises(ValueError):  # each part fits alone; together they are over
        box._deliver("r", [((GRAD, 0, SENDER), half), ((GRAD, 1, SENDER), half), ((GRAD, 2, SENDER), torch.zeros(1))])
    assert box._early == {} and box._early_bytes == 0
    box._deliver("r", [((GRAD, 0, SENDER), half), ((GRAD, 1, SENDER), half)])
    assert box._early_bytes == box.max_early_bytes // 8 * 8
    assert [key for key, _ in box._early["r"]] == [(GRAD, 0, SENDER), (GRAD, 1, SENDER)]


def test_early_buffer_is_bounded_in_rounds_and_forget_early_keeps_what_it_is_told():
    box = mailbox()
    for i in range(EARLY_ROUNDS):
        box._deliver(f"r{i}", [((GRAD, 0, SENDER), torch.zeros(8))])
    with pytest.raises(ValueError):
        box._deliver("one-too-many", [((GRAD, 0, SENDER), torch.zeros(8))])
    box._deliver("r0", [((GRAD, 1, SENDER), torch.zeros(8))])  # more for a round already buffered is fine
    box.forget_early(keep=["r0"])
    assert list(box._early) == ["r0"]
    assert box._early_bytes == 2 * 8 * 4
    box._deliver("one-too-many", [((GRAD, 0, SENDER), torch.zeros(8))])  # room again
    inbox = box.open_round("r0", [SENDER])
    assert set(inbox.messages) == {(GRAD, 0, SENDER), (GRAD, 1, SENDER)}


def test_inbox_wait_fails_after_its_deadline_naming_what_is_missing():
    box = mailbox()
    inbox = box.open_round("r", [SENDER, OTHER])
    box._deliver("r", [((GRAD, 0, SENDER), torch.zeros(8))])
    started = time.monotonic()
    with pytest.raises(collective.RoundFailed, match=r"1 messages did not come in time \(grad from " + OTHER[-8:]):
        inbox.wait([(GRAD, 0, SENDER), (GRAD, 0, OTHER)], time.monotonic() + 0.05)
    assert time.monotonic() - started < 1.0  # it gives up at the deadline, not after a wait slice


def test_inbox_wait_wakes_when_a_message_arrives():
    box = mailbox()
    inbox = box.open_round("r", [SENDER])
    timer = threading.Timer(0.05, box._deliver, args=("r", [((NORM, 0, SENDER), 0.25)]))
    timer.start()
    try:
        started = time.monotonic()
        got = inbox.wait([(NORM, 0, SENDER)], time.monotonic() + 5.0)
        assert got == {(NORM, 0, SENDER): 0.25}
        assert time.monotonic() - started < 1.0  # woken by the message, not by polling to the deadline
    finally:
        timer.cancel()
