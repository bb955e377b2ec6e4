"""How the sharded-round mailbox (swarm.averaging.collective) packs its items into messages, and reads them
back, without a network (the mailbox's checks of what arrives: test_zero_mailbox.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm.averaging import collective
from swarm.averaging.collective import (
    CHECK,
    CHECK_CHUNKS,
    GRAD,
    MESSAGE_CHUNKS,
    MESSAGE_ELEMENTS,
    NORM,
    STATE,
    TENSORS_OF,
    UPDATE,
    Item,
    Mailbox,
)
from swarm.averaging.crosscheck import DIGEST_BYTES
from swarm.zero import MAX_CHUNK_ELEMENTS, ChunkMoments, Layout
from tests.unit.test_zero_mailbox import OTHER, SENDER, STRANGER

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------------------------
# collective._packed and the way Mailbox.send builds its messages

PACK_LAYOUT = Layout([(10,), (7,), (33,)], chunk_elements=8)  # 7 chunks: six of 8 elements, the last of 2


def chunk_items(peers: list[str], kinds: list[str], chunks: list[int], layout: Layout = PACK_LAYOUT,
                seed: int = 0) -> list[Item]:
    generator = torch.Generator().manual_seed(seed)
    items = []
    for peer in peers:
        for kind in kinds:
            for c in chunks:
                n = layout.chunk_numel(c)
                tensors = tuple(torch.rand(n, generator=generator) for _ in range(TENSORS_OF[kind]))
                value = float(torch.rand(1, generator=generator)) if kind == NORM else 0.0
                digest = bytes(range(c, c + DIGEST_BYTES * (1 + c % 2))) if kind == CHECK else b""
                items.append(Item(peer, kind, c, tensors, steps=c + 1 if kind == STATE else 0, value=value,
                                  digest=digest))
    return items


def check_packing(items: list[Item], batches: list[list[Item]]) -> None:
    """What every packing must be: each item exactly once, one (peer, kind) and increasing chunks a message,
    within the message limits, and greedy (a message is only cut where the next item would not fit)."""
    assert sorted(id(item) for batch in batches for item in batch) == sorted(id(item) for item in items)
    assert all(batches)
    for batch in batches:
        assert len({(item.peer, item.kind) for item in batch}) == 1
        chunks = [item.chunk for item in batch]
        assert all(a < b for a, b in zip(chunks, chunks[1:]))
        assert len(batch) <= (collective.CHECK_CHUNKS if batch[0].kind == CHECK else collective.MESSAGE_CHUNKS)
        assert sum(t.numel() for item in batch for t in item.tensors) <= collective.MESSAGE_ELEMENTS
    for before, after in zip(batches, batches[1:]):
        if (before[0].peer, before[0].kind) == (after[0].peer, after[0].kind):
            assert before[-1].chunk < after[0].chunk
            elements = sum(t.numel() for item in [*before, after[0]] for t in item.tensors)
            limit = collective.CHECK_CHUNKS if before[0].kind == CHECK else collective.MESSAGE_CHUNKS
            assert len(before) == limit or elements > collective.MESSAGE_ELEMENTS


def test_packed_groups_items_by_peer_and_kind_in_chunk_order():
    items = chunk_items([OTHER, SENDER, STRANGER], [GRAD, NORM, UPDATE, CHECK, STATE], list(range(7)))
    shuffled = [items[i] for i in torch.randperm(len(items), generator=torch.Generator().manual_seed(1))]
    batches = collective._packed(shuffled)
    check_packing(shuffled, batches)
    # small items: one message for each (peer, kind)
    assert len(batches) == 3 * 5
    assert all([item.chunk for item in batch] == list(range(7)) for batch in batches)


def test_packed_of_nothing_is_no_message():
    assert collective._packed([]) == []


@pytest.mark.parametrize("seed", range(8))
def test_packed_stays_within_small_limits(monkeypatch, seed):
    monkeypatch.setattr(collective, "MESSAGE_ELEMENTS", 40)
    monkeypatch.setattr(collective, "MESSAGE_CHUNKS", 3)
    monkeypatch.setattr(collective, "CHECK_CHUNKS", 2)
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(60):
        peer = [OTHER, SENDER, STRANGER][int(torch.randint(3, (1,), generator=generator))]
        kind = [GRAD, NORM, UPDATE, CHECK, STATE][int(torch.randint(5, (1,), generator=generator))]
        chunk = int(torch.randint(100, (1,), generator=generator))
        size = int(torch.randint(1, 21, (1,), generator=generator))  # a state item has two tensors: up to 40
        items.append(Item(peer, kind, chunk, tuple(torch.zeros(size) for _ in range(TENSORS_OF[kind]))))
    unique = list({(item.peer, item.kind, item.chunk): item for item in items}.values())
    check_packing(unique, collective._packed(unique))


def test_packed_counts_every_tensor_of_an_item_against_the_element_limit():
    quarter = torch.zeros(MESSAGE_ELEMENTS // 4)
    grads = [Item(OTHER, GRAD, c, (quarter,)) for c in range(8)]
    states = [Item(OTHER, STATE, c, (quarter, quarter), 1) for c in range(8)]
    batches = collective._packed(grads + states)
    check_packing(grads + states, batches)
    assert [(batch[0].kind, len(batch)) for batch in batches] == [(GRAD, 4), (GRAD, 4), (STATE, 2), (STATE, 2),
                                                                  (STATE, 2), (STATE, 2)]
    # the largest chunk's moments still fit one message alone
    largest = torch.zeros(MAX_CHUNK_ELEMENTS)
    moments = [Item(OTHER, STATE, c, (largest, largest), 1) for c in range(3)]
    assert [len(batch) for batch in collective._packed(moments)] == [1, 1, 1]


def test_packed_lists_at_most_message_chunks_chunks_a_message():
    one = torch.zeros(1)
    items = [Item(SENDER, UPDATE, c, (one,)) for c in range(2 * MESSAGE_CHUNKS + 5)]
    batches = collective._packed(items)
    check_packing(items, batches)
    assert [len(batch) for batch in batches] == [MESSAGE_CHUNKS, MESSAGE_CHUNKS, 5]
    checks = [Item(SENDER, CHECK, c, digest=b"d" * DIGEST_BYTES) for c in range(2 * CHECK_CHUNKS + 5)]
    assert [len(batch) for batch in collective._packed(checks)] == [CHECK_CHUNKS, CHECK_CHUNKS, 5]


def check_received(items: list[Item], requests: list[tuple[str, runtime_pb2.ExpertRequest]], layout: Layout,
                   round_key: str) -> None:
    """Parse every request as its peer would (we are its sender) and compare with the items packed into it."""
    box = Mailbox(p2p=None, loop=None, prefix="x", layout=layout, send_timeout=1.0)
    received = {}
    for peer, req in requests:
        got_key, messages = box._parse(req, SENDER)
        assert got_key == round_key
        for (kind, chunk, sender), payload in messages:
            assert sender == SENDER
            assert (peer, kind, chunk) not in received
            received[(peer, kind, chunk)] = payload
    assert set(received) == {(item.peer, item.kind, item.chunk) for item in items}
    for item in items:
        payload = received[(item.peer, item.kind, item.chunk)]
        if item.kind == STATE:
            assert isinstance(payload, ChunkMoments) and payload.steps == item.steps
            assert torch.equal(payload.exp_avg, item.tensors[0])
            assert torch.equal(payload.exp_avg_sq, item.tensors[1])
        elif item.kind == NORM:
            assert payload == item.value
        elif item.kind == CHECK:
            assert payload == (item.digest[:DIGEST_BYTES], item.digest[DIGEST_BYTES:] or None)
        else:
            assert torch.equal(payload, item.tensors[0])


@pytest.mark.parametrize("limits", [None, (20, 3), (16, 1)])
def test_packed_messages_parse_back_into_the_items(monkeypatch, limits):
    if limits is not None:  # (the receiver checks the same constants, patched alike)
        monkeypatch.setattr(collective, "MESSAGE_ELEMENTS", limits[0])
        monkeypatch.setattr(collective, "MESSAGE_CHUNKS", limits[1])
        monkeypatch.setattr(collective, "CHECK_CHUNKS", limits[1])
    items = chunk_items([OTHER, STRANGER], [GRAD, NORM, UPDATE, CHECK, STATE], [0, 1, 3, 4, 6])
    items += chunk_items([SENDER], [STATE], [6, 2, 5], seed=1)  # (the last chunk is short)
    requests = collective._requests("7:r", items)
    if limits is None:
        assert len(requests) == 2 * 5 + 1
    check_received(items, requests, PACK_LAYOUT, "7:r")


def test_packed_messages_of_many_chunks_parse_back_into_the_items():
    layout = Layout([(3 * MESSAGE_CHUNKS + 7,)], chunk_elements=1)
    chunks = list(range(layout.num_chunks))
    items = chunk_items([OTHER], [UPDATE, STATE], chunks, layout=layout)
    requests = collective._requests("r", items)
    assert len(requests) == 2 * 4
    check_received(items, requests, layout, "r")


def test_send_packs_its_items_into_messages_that_parse_back_and_passes_them_through_its_seam():
    box = Mailbox(p2p=None, loop=SimpleNamespace(run=lambda coro, timeout: asyncio.run(coro)), prefix="x",
                  layout=PACK_LAYOUT, send_timeout=1.0)
    captured = []

    async def send_all(requests):
        captured.extend(requests)

    box._send_all = send_all
    items = chunk_items([OTHER, STRANGER], [GRAD, NORM, UPDATE, CHECK, STATE], list(range(7)), seed=2)
    sent = box.send("3:s", items, time.monotonic() + 10.0)
    assert sent == sum(len(t.buffer) for _, req in captured for t in req.tensors) + \
        sum(len(req.metadata) for _, req in captured)
    assert sent > sum(t.numel() for item in items for t in item.tensors) * 4
    check_received(items, captured, PACK_LAYOUT, "3:s")
    captured.clear()
    assert box.send("3:s", [], time.monotonic() + 10.0) == 0 and captured == []
    # what a server sends passes through its outbound seam (a test's liar), and only what it returns goes out
    box.outbound = lambda out: [item for item in out if item.kind != UPDATE]
    box.send("3:s", items, time.monotonic() + 10.0)
    check_received([item for item in items if item.kind != UPDATE], captured, PACK_LAYOUT, "3:s")
