"""Stage checkpoints between real hivemind peers on 127.0.0.1: announced, fetched, verified, installed.

Three peers: the fetcher (the first, so its daemon is connected to the others), an honest holder and a
dishonest one whose state file was altered after its manifest was written. The peers, stores and
servers are shared by the module's tests; each test fetches into a fresh staging directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# hivemind's ServicerBase recognises streaming RPCs only by typing.AsyncIterator annotations
from typing import AsyncIterator  # noqa: UP035

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter

from swarm.checkpoint.manifest import MANIFEST_NAME
from swarm.checkpoint.serving import CheckpointServer, ServingLimits, serve_checkpoints
from swarm.checkpoint.store import StageCheckpoints
from swarm.checkpoint.transfer import (
    INVALID,
    REFUSED,
    UNAVAILABLE,
    CheckpointTransferError,
    fetch_checkpoint,
    fetch_newest,
)
from swarm.checkpoint.verify import STATE_NAME
from swarm.checkpoint.wire import BAD_REQUEST, BUSY, MAX_CHUNK_BYTES, NOT_FOUND, checkpoint_namespace
from swarm.dht import CheckpointRecord, HeldCheckpoint, visible_maddrs
from tests.helpers import wait_until
from tests.integration.inproc import LOOP_CALL_TIMEOUT, Peer, running_peers, tiny_config

pytestmark = pytest.mark.timeout(120)

RUN_ID = "ckpt-transfer"
STAGE = 1
HONEST_STEP, DISHONEST_STEP = 10, 20
FETCH_TIMEOUT = 30.0  # one checkpoint of a few hundred KiB over loopback; far above what it takes
SEE_TIMEOUT = 20.0  # announced records reach the fetcher
MAX_BYTES = 2**30
SMALL_CHUNKS = ServingLimits(chunk_bytes=4096)  # so every file crosses the wire in many frames


def stage_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"param/blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=g),
            "param/blocks.0.ln.bias": torch.randn(32, generator=g),
            "optim/0/exp_avg": torch.randn(96, 32, generator=g), "optim/0/step": torch.tensor(3.0)}


@dataclass
class Holder:
    peer: Peer
    store: StageCheckpoints
    held: HeldCheckpoint
    tensors: dict[str, torch.Tensor]
    path: Path

    @property
    def peer_id(self) -> PeerID:
        return PeerID.from_base58(self.peer.peer_id)


@dataclass
class Swarm:
    fetcher: Peer
    fetcher_p2p: P2P
    honest: Holder
    dishonest: Holder
    state_hash: str
    root: Path

    def fetch(self, coro):
        return self.fetcher.loop.run(coro, FETCH_TIMEOUT + LOOP_CALL_TIMEOUT)

    def records(self) -> list[CheckpointRecord]:
        return self.fetcher.records.lookup_checkpoints(STAGE)

    def staging(self, name: str) -> Path:
        return self.root / "staging" / name


def make_holder(peer: Peer, root: Path, step: int, state_hash: str, seed: int) -> Holder:
    store = StageCheckpoints(root, RUN_ID, STAGE, keep=3)
    tensors = stage_tensors(seed)
    manifest, mid, path = store.write(tensors, step=step, num_stages=2, state_hash=state_hash,
                                      round_id=f"round-{step}", group=2)
    held = HeldCheckpoint(step=step, manifest_id=mid, size=sum(e.size for e in manifest.files.values()))
    p2p = peer.p2p()
    peer.loop.run(serve_checkpoints(p2p, RUN_ID, store.path_for, SMALL_CHUNKS), LOOP_CALL_TIMEOUT)
    return Holder(peer, store, held, tensors, path)


def announce(holder: Holder, state_hash: str) -> None:
    record = CheckpointRecord(peer_id=holder.peer.peer_id, stage=STAGE, state_hash=state_hash,
                              checkpoints=[holder.held])
    assert holder.peer.records.announce_checkpoints(record, ttl=120.0)


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the content hash can tell
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("checkpoints")
    state_hash = tiny_config(RUN_ID).state_hash()
    with running_peers(RUN_ID, 3) as (fetcher, honest_peer, dishonest_peer):
        honest = make_holder(honest_peer, root / "honest", HONEST_STEP, state_hash, seed=1)
        dishonest = make_holder(dishonest_peer, root / "dishonest", DISHONEST_STEP, state_hash, seed=2)
        flip_a_byte(dishonest.path / STATE_NAME)  # its manifest still claims the original hash
        for holder in (honest, dishonest):
            announce(holder, state_hash)
        swarm = Swarm(fetcher, fetcher.p2p(), honest, dishonest, state_hash, root)
        wait_until(lambda: len(swarm.records()) == 2, SEE_TIMEOUT, interval=0.2, what="both checkpoint records")
        yield swarm


def test_fetch_newest_gets_installs_and_loads_equal_tensors(swarm: Swarm):
    honest_only = [r for r in swarm.records() if r.peer_id == swarm.honest.peer.peer_id]
    fetched = swarm.fetch(fetch_newest(
        swarm.fetcher_p2p, honest_only, RUN_ID, swarm.staging("honest"), expect_stage=STAGE,
        expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES, timeout=FETCH_TIMEOUT))
    assert fetched is not None
    staged, held, holder = fetched
    assert (held, holder) == (swarm.honest.held, swarm.honest.peer.peer_id)

    store = StageCheckpoints(swarm.root / "fetcher", RUN_ID, STAGE, keep=3)
    installed = store.install(staged)
    manifest, mid, tensors = store.load(installed, state_hash=swarm.state_hash)
    assert (manifest.step, mid) == (HONEST_STEP, held.manifest_id)
    assert tensors.keys() == swarm.honest.tensors.keys()
    for name, tensor in swarm.honest.tensors.items():
        assert torch.equal(tensors[name], tensor), name
    assert store.path_for(mid) == installed  # the fetcher can now serve it in turn


def test_dishonest_holder_is_rejected_banned_and_the_honest_one_used(swarm: Swarm, caplog):
    staging = swarm.staging("direct")
    with pytest.raises(CheckpointTransferError) as failure:
        swarm.fetch(fetch_checkpoint(
            swarm.fetcher_p2p, swarm.dishonest.peer_id, RUN_ID, swarm.dishonest.held.manifest_id, staging,
            expect_stage=STAGE, expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES, timeout=FETCH_TIMEOUT))
    assert failure.value.kind == INVALID and failure.value.holder == swarm.dishonest.peer.peer_id
    assert swarm.dishonest.peer.peer_id in str(failure.value) and STATE_NAME in str(failure.value)
    assert "sha256" in str(failure.value) and not staging.exists()

    with caplog.at_level(logging.WARNING, logger="swarm.checkpoint.transfer"):
        fetched = swarm.fetch(fetch_newest(
            swarm.fetcher_p2p, swarm.records(), RUN_ID, swarm.staging("newest"), expect_stage=STAGE,
            expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES, timeout=FETCH_TIMEOUT))
    assert fetched is not None and fetched[1] == swarm.honest.held  # step 10, though 20 was announced
    bans = [r.getMessage() for r in caplog.records if "banning" in r.getMessage()]
    assert len(bans) == 1 and swarm.dishonest.peer.peer_id in bans[0] and STATE_NAME in bans[0]
    _, _, tensors = StageCheckpoints(swarm.root / "check", RUN_ID, STAGE, keep=3).load(
        fetched[0], state_hash=swarm.state_hash)  # verifies every file again
    assert torch.equal(tensors["optim/0/exp_avg"], swarm.honest.tensors["optim/0/exp_avg"])


def test_fetch_newest_respects_min_step_and_expectations(swarm: Swarm):
    def newest(**kwargs):
        options = dict(expect_stage=STAGE, expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES,
                       timeout=FETCH_TIMEOUT) | kwargs
        return swarm.fetch(fetch_newest(swarm.fetcher_p2p, swarm.records(), RUN_ID, swarm.staging("none"),
                                        **options))

    assert newest(min_step=HONEST_STEP + 1) is None  # only the dishonest holder is that new
    assert newest(expect_state_hash="0" * 64) is None  # records of another model shape are not tried
    assert newest(max_bytes=100) is None
    assert not swarm.staging("none").exists()


async def read_raw(p2p: P2P, holder: PeerID, meta: bytes, run_id: str = RUN_ID) -> list[runtime_pb2.ExpertResponse]:
    stub = CheckpointServer.get_stub(p2p, holder, namespace=checkpoint_namespace(run_id))
    responses = await stub.rpc_read(iter_as_aiter([runtime_pb2.ExpertRequest(metadata=meta)]))
    try:
        return [frame async for frame in responses]
    finally:
        await responses.aclose()


def test_bad_requests_get_error_replies_and_the_server_keeps_serving(swarm: Swarm):
    holder = swarm.honest
    mid = holder.held.manifest_id

    def ask(meta) -> tuple[dict, list[bytes]]:
        raw = meta if isinstance(meta, bytes) else msgpack.packb(meta, use_bin_type=True)
        frames = swarm.fetch(read_raw(swarm.fetcher_p2p, holder.peer_id, raw))
        return msgpack.unpackb(frames[0].metadata, raw=False), [frame.metadata for frame in frames[1:]]

    for file in ("../../etc/passwd", "/etc/passwd", "stage1/../../../manifest.json", ".tmp-x", "missing.bin"):
        header, data = ask({"manifest_id": mid, "file": file, "offset": 0})
        assert (header["ok"], header["code"], data) == (False, NOT_FOUND, []), file
    header, _ = ask({"manifest_id": "f" * 64, "file": MANIFEST_NAME, "offset": 0})
    assert (header["ok"], header["code"]) == (False, NOT_FOUND)
    for meta in (b"\xc1 not msgpack", {"manifest_id": mid.upper(), "file": MANIFEST_NAME, "offset": 0},
                 {"manifest_id": mid, "file": MANIFEST_NAME, "offset": -1},
                 {"manifest_id": mid, "file": MANIFEST_NAME, "offset": 10**9},
                 {"manifest_id": mid, "file": "x" * 2000, "offset": 0}):
        header, data = ask(meta)
        assert (header["ok"], header["code"], data) == (False, BAD_REQUEST, []), meta

    manifest_bytes = (holder.path / MANIFEST_NAME).read_bytes()
    header, data = ask({"manifest_id": mid, "file": MANIFEST_NAME, "offset": 0})
    assert header == {"ok": True, "size": len(manifest_bytes), "offset": 0} and b"".join(data) == manifest_bytes
    state_bytes = (holder.path / STATE_NAME).read_bytes()
    header, data = ask({"manifest_id": mid, "file": STATE_NAME, "offset": 1000, "from_a_newer_peer": True})
    assert header["ok"] and b"".join(data) == state_bytes[1000:]
    assert all(0 < len(chunk) <= SMALL_CHUNKS.chunk_bytes for chunk in data) and len(data) > 1


def test_transfer_slots_are_bounded(swarm: Swarm):
    """With every slot taken, a request waits `slot_timeout`, then gets a BUSY reply, not a hang."""
    holder, entered, release = swarm.honest, threading.Event(), threading.Event()

    def slow_resolve(manifest_id: str) -> Path | None:
        entered.set()  # resolving runs inside the slot: this transfer now holds the only one
        release.wait(FETCH_TIMEOUT)
        return holder.store.path_for(manifest_id)

    limits = ServingLimits(max_transfers=1, slot_timeout=0.3)
    server = holder.peer.loop.run(serve_checkpoints(holder.peer.p2p(), "busy", slow_resolve, limits),
                                  LOOP_CALL_TIMEOUT)
    request = msgpack.packb({"manifest_id": holder.held.manifest_id, "file": MANIFEST_NAME, "offset": 0})

    async def two_requests():
        first = asyncio.create_task(read_raw(swarm.fetcher_p2p, holder.peer_id, request, run_id="busy"))
        try:
            assert await asyncio.to_thread(entered.wait, FETCH_TIMEOUT)
            second = await read_raw(swarm.fetcher_p2p, holder.peer_id, request, run_id="busy")
        finally:
            release.set()
        return await first, second

    try:
        first, second = swarm.fetch(two_requests())
    finally:
        release.set()
        holder.peer.loop.run(server.unregister(holder.peer.p2p()), LOOP_CALL_TIMEOUT)
    refused = msgpack.unpackb(second[0].metadata)
    assert (refused["ok"], refused["code"], len(second)) == (False, BUSY, 1), refused
    assert msgpack.unpackb(first[0].metadata)["ok"] and first[1].metadata == (holder.path / MANIFEST_NAME).read_bytes()


def lying_server(manifest: bytes, state: bytes, lie: str) -> ServicerBase:
    """A server speaking the wire format, with the real one's protocol id, that lies about one file."""

    class CheckpointServer(ServicerBase):  # the class name is part of the protocol id
        async def rpc_read(
            self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
        ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
            request = msgpack.unpackb((await anext(requests)).metadata)
            assert await anext(requests, None) is None  # the end of the request stream, as the real server reads
            honest = request["file"] == MANIFEST_NAME and lie != "other_manifest"
            data = (manifest if honest else {MANIFEST_NAME: manifest + b" ", STATE_NAME: state}[request["file"]])
            header = {"ok": True, "size": len(data), "offset": 0}
            if not honest:
                if lie == "refuses":
                    header = {"ok": False, "code": NOT_FOUND, "error": "come back later"}
                elif lie == "wrong_size":
                    header["size"] += 1
                elif lie == "overlong":
                    data += b"extra"
                elif lie == "truncated":
                    data = data[: len(data) // 2]
                elif lie == "huge_frame":
                    data = b"x" * (MAX_CHUNK_BYTES + 1)
            yield runtime_pb2.ExpertResponse(metadata=b"\xc1" if lie == "bad_header" else msgpack.packb(header))
            for start in range(0, len(data), MAX_CHUNK_BYTES + 1):
                yield runtime_pb2.ExpertResponse(metadata=data[start : start + MAX_CHUNK_BYTES + 1])

    return CheckpointServer()


@pytest.mark.parametrize(
    "lie, kind, says",
    [
        ("other_manifest", INVALID, "manifest.json hashes to"),
        ("wrong_size", INVALID, "its manifest says"),
        ("overlong", INVALID, "more of state.safetensors than"),
        ("huge_frame", INVALID, "data frame"),
        ("bad_header", INVALID, "not a header"),
        ("refuses", REFUSED, "come back later"),
        ("truncated", UNAVAILABLE, "ended after"),
    ],
)
def test_lying_holders_are_caught_and_named(swarm: Swarm, lie: str, kind: str, says: str):
    """Every way a holder can break its word ends the fetch with an error naming it and what it did."""
    liar, real = swarm.dishonest, swarm.honest
    manifest, state = (real.path / MANIFEST_NAME).read_bytes(), (real.path / STATE_NAME).read_bytes()
    run_id = f"lie-{lie.replace('_', '-')}"  # the run id names the namespace: one server per lie
    server, p2p = lying_server(manifest, state, lie), liar.peer.p2p()
    liar.peer.loop.run(server.add_p2p_handlers(p2p, namespace=checkpoint_namespace(run_id)), LOOP_CALL_TIMEOUT)
    staging = swarm.staging(run_id)
    try:
        with pytest.raises(CheckpointTransferError) as failure:
            swarm.fetch(fetch_checkpoint(
                swarm.fetcher_p2p, liar.peer_id, run_id, real.held.manifest_id, staging, expect_run_id=RUN_ID,
                expect_stage=STAGE, expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES,
                timeout=FETCH_TIMEOUT))
    finally:
        with contextlib.suppress(Exception):
            liar.peer.loop.run(server.remove_p2p_handlers(p2p, namespace=checkpoint_namespace(run_id)),
                               LOOP_CALL_TIMEOUT)
    assert failure.value.kind == kind and says in str(failure.value), str(failure.value)
    assert liar.peer.peer_id in str(failure.value) and not staging.exists()


# ---- stalls: a fetcher that stops reading, holders that stop sending ------------------------------

BIG_BYTES = 32 * 2**20  # far more than the transport buffers between a holder and a fetcher that stopped reading
PROGRESS_TIMEOUT = 2.0  # the holder's, in the tests below
IDLE_TIMEOUT = 2.0  # the fetcher's, in the tests below
CUT_TIMEOUT = 30.0  # a stalled transfer is cut off within this (progress timeout, plus filling the buffers)


def test_a_fetcher_that_stops_reading_holds_one_slot_and_loses_it_at_the_progress_deadline(swarm: Swarm):
    """Per-caller transfer slots, and a deadline for progress (frames the fetcher takes), not only a total:
    before, one peer could hold every slot, and one that stopped reading held its slot for 900 s."""
    staller, holder, other = swarm.fetcher, swarm.honest, swarm.dishonest.peer
    store = StageCheckpoints(swarm.root / "big", RUN_ID, STAGE, keep=1)
    manifest, mid, path = store.write({"param/big": torch.zeros(BIG_BYTES // 4)}, step=1, num_stages=2,
                                      state_hash=swarm.state_hash, round_id="big", group=1)
    size = (path / STATE_NAME).stat().st_size
    limits = ServingLimits(max_transfers=4, progress_timeout=PROGRESS_TIMEOUT, slot_timeout=1.0)
    server = holder.peer.loop.run(serve_checkpoints(holder.peer.p2p(), "big", store.path_for, limits),
                                  LOOP_CALL_TIMEOUT)
    request = msgpack.packb({"manifest_id": mid, "file": STATE_NAME, "offset": 0})
    stub = CheckpointServer.get_stub(swarm.fetcher_p2p, holder.peer_id, namespace=checkpoint_namespace("big"))

    async def stall() -> tuple[list[dict], int]:
        """Ask for the big file three times at once, read one chunk of the one served, stop reading;
        then, once the holder has given its slot back, read what is left of that stream."""
        streams = [await stub.rpc_read(iter_as_aiter([runtime_pb2.ExpertRequest(metadata=request)]))
                   for _ in range(3)]
        try:
            headers = [msgpack.unpackb((await anext(stream)).metadata) for stream in streams]
            served = [stream for stream, header in zip(streams, headers) if header["ok"]]
            if len(served) != 1:
                return headers, None  # one caller had more than its share of the slots
            served = served[0]
            received = len((await anext(served)).metadata)
            await asyncio.to_thread(wait_until, lambda: server.slots.active == 0, CUT_TIMEOUT,
                                    what="the holder to cut off the transfer nobody reads")
            async for frame in served:  # what the transport held, then the end of the cut-off stream
                received += len(frame.metadata)
            return headers, received
        finally:
            for stream in streams:
                await stream.aclose()

    stalled = asyncio.run_coroutine_threadsafe(stall(), staller.loop.loop)
    try:
        wait_until(lambda: server.slots.held(staller.peer_id) == 1 or stalled.done(), FETCH_TIMEOUT,
                   what="the staller's transfer")
        # meanwhile another peer is served: the staller holds one slot, not all four
        fetched = other.loop.run(fetch_checkpoint(
            other.p2p(), holder.peer_id, "big", mid, swarm.staging("big-other"), expect_run_id=RUN_ID,
            expect_stage=STAGE, expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES, timeout=FETCH_TIMEOUT),
            FETCH_TIMEOUT + LOOP_CALL_TIMEOUT)
        assert (fetched / STATE_NAME).stat().st_size == size
        headers, received = stalled.result(CUT_TIMEOUT + FETCH_TIMEOUT)
    finally:
        holder.peer.loop.run(server.unregister(holder.peer.p2p()), LOOP_CALL_TIMEOUT)
    refused = [header for header in headers if not header["ok"]]
    assert len(refused) == 2 and all(h["code"] == BUSY and "per caller 1" in h["error"] for h in refused), headers
    assert received is not None and received < size, "the stalled transfer was not cut off (or fitted in the transport)"


def stalling_holder(store: StageCheckpoints, trickle: float | None = None) -> CheckpointServer:
    """The real CheckpointServer, except that after a file's header it sends nothing (or, with `trickle`,
    one byte every `trickle` seconds): `asked` counts the files it was asked for."""

    class Stalling(CheckpointServer):
        asked = 0

        async def _send(self, request, context, lease):
            Stalling.asked += 1
            frames = super()._send(request, context, lease)
            try:
                yield await anext(frames)  # the header, as the real server sends it
            finally:
                await frames.aclose()
            while trickle is not None:
                await asyncio.sleep(trickle)
                yield runtime_pb2.ExpertResponse(metadata=b"\0")
            await asyncio.Event().wait()

    Stalling.__name__ = "CheckpointServer"  # the class name is part of the protocol id
    return Stalling(store.path_for)


@contextlib.contextmanager
def stalling_holders(swarm: Swarm, run_id: str, step: int, trickle: float | None = None):
    """Two stalling holders of a step-`step` checkpoint of the stage (on a peer of their own each), and the
    honest holder's checkpoint, all served under `run_id`; yields (records, stalling servers)."""
    with running_peers(RUN_ID, 1, initial_peers=visible_maddrs(swarm.fetcher.dht)) as [extra]:
        servers, records, hosts = [], [], [swarm.dishonest.peer, extra]
        for i, peer in enumerate(hosts):
            store = StageCheckpoints(swarm.root / f"{run_id}-{i}", RUN_ID, STAGE, keep=1)
            manifest, mid, _ = store.write(stage_tensors(seed=10 + i), step=step, num_stages=2,
                                           state_hash=swarm.state_hash, round_id="stall", group=2)
            held = HeldCheckpoint(step=step, manifest_id=mid, size=sum(e.size for e in manifest.files.values()))
            records.append(CheckpointRecord(peer_id=peer.peer_id, stage=STAGE, state_hash=swarm.state_hash,
                                            checkpoints=[held]))
            servers.append(stalling_holder(store, trickle))
            peer.loop.run(servers[-1].add_p2p_handlers(peer.p2p(), namespace=checkpoint_namespace(run_id)),
                          LOOP_CALL_TIMEOUT)
        honest = swarm.honest
        real = honest.peer.loop.run(serve_checkpoints(honest.peer.p2p(), run_id, honest.store.path_for),
                                    LOOP_CALL_TIMEOUT)
        records.append(CheckpointRecord(peer_id=honest.peer.peer_id, stage=STAGE, state_hash=swarm.state_hash,
                                        checkpoints=[honest.held]))
        try:
            yield records, servers
        finally:
            honest.peer.loop.run(real.unregister(honest.peer.p2p()), LOOP_CALL_TIMEOUT)
            for peer, server in zip(hosts, servers):
                with contextlib.suppress(Exception):
                    peer.loop.run(server.remove_p2p_handlers(peer.p2p(), namespace=checkpoint_namespace(run_id)),
                                  LOOP_CALL_TIMEOUT)


def test_holders_that_send_a_header_and_then_nothing_are_left_at_the_idle_deadline(swarm: Swarm, caplog):
    """Two holders of a newer checkpoint stall after their header: the fetch moves on to the honest holder
    after the idle deadline of each, not after the whole per-holder timeout of each (2 x 30 s here)."""
    with stalling_holders(swarm, "stall-silent", step=HONEST_STEP + 5) as (records, stallers), \
            caplog.at_level(logging.INFO, logger="swarm.checkpoint.transfer"):
        started = time.monotonic()
        fetched = swarm.fetch(fetch_newest(
            swarm.fetcher_p2p, records, "stall-silent", swarm.staging("stall-silent"), expect_run_id=RUN_ID,
            expect_stage=STAGE, expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES, timeout=FETCH_TIMEOUT,
            idle_timeout=IDLE_TIMEOUT))
        took = time.monotonic() - started
    assert fetched is not None and fetched[1] == swarm.honest.held
    assert [server.asked for server in stallers] == [1, 1]  # both were tried, newest first
    assert took < FETCH_TIMEOUT, f"{took:.1f}s: a stalled holder kept the fetch for its whole timeout"
    assert sum(f"sent nothing of {MANIFEST_NAME} for {IDLE_TIMEOUT:g}s" in r.getMessage()
               for r in caplog.records) == 2


def test_trickling_holders_cost_a_fetch_no_more_than_its_timeout(swarm: Swarm):
    """Holders that keep sending a byte now and then are never idle: without a total_timeout, fetch_newest
    still ends within its `timeout` (a restoring server falls back to its own disk in time), not after
    `timeout` for each such holder, past what its caller waits (keeper: 2 x 300 s for 300 s each)."""
    timeout = 3.0
    with stalling_holders(swarm, "stall-trickle", step=HONEST_STEP + 5, trickle=0.2) as (records, stallers):
        fetched = swarm.fetch(fetch_newest(
            swarm.fetcher_p2p, records[:2], "stall-trickle", swarm.staging("stall-trickle"), expect_run_id=RUN_ID,
            expect_stage=STAGE, expect_state_hash=swarm.state_hash, max_bytes=MAX_BYTES, timeout=timeout,
            idle_timeout=IDLE_TIMEOUT))
    assert fetched is None
    assert [server.asked for server in stallers] == [1, 0]  # the first took the whole time: the second not asked
