"""A stranger holding streams open cannot starve a real stage server of its request slots.

Issue 26, attack 4: a peer opened 130 forward streams and sent nothing; the request cap (128, twice
the default queue) was global and a slot was held for the whole 60 s receive timeout, so honest
forwards went from 20/20 to 0/20 (`busy`). Here a real StageServer (stage 0 of a 2-stage run, the
default options) runs on its own peer on 127.0.0.1; an attacker peer keeps 130 silent streams open
against it (reopening each one as soon as the server ends it), and an honest peer sends 20 forwards
meanwhile. Slots are per caller now (swarm.protocol.slots), and a silent stream gives its slot back
after the first-byte deadline.
"""

from __future__ import annotations

import asyncio
import collections

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.protocol import (
    BAD_REQUEST,
    BUSY,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    RemoteStageError,
    StageClient,
    StageService,
    StageUnavailable,
    receive_reply,
    stage_namespace,
)
from tests.helpers import wait_until
from tests.integration.inproc import running_peers, stage_servers, tiny_config

pytestmark = pytest.mark.timeout(150)

CONFIG = tiny_config("stall", 2, batch_size=1000)  # a batch no test fills: the stage never steps
STREAMS = 130  # the attack's figure: more than the 128 slots of a default server
HONEST_CALLS, HONEST_NEEDED = 20, 19
CALL_TIMEOUT = 20.0  # one honest forward, generous for 2 shared CPU cores
OPEN_TIMEOUT = 60.0  # the attacker's 130 streams open and the server takes what it lets them take
BUSY_PAUSE = 1.0  # an attacker refused BUSY tries again this much later (no busy loop on the test's cores)


async def hold_silent_stream(stub, stop: asyncio.Event, outcomes: collections.Counter) -> None:
    """Keep one forward stream open, sending nothing; when the server ends it, open another."""

    async def silence():
        await stop.wait()
        return
        yield  # an async generator that sends no frame

    while not stop.is_set():
        try:
            responses = await stub.rpc_forward(silence())
        except Exception:  # noqa: BLE001 - the daemon refused a stream: count it, try again
            outcomes["not opened"] += 1
            await asyncio.sleep(BUSY_PAUSE)
            continue
        outcomes["opened"] += 1
        try:
            await receive_reply(responses)
            outcomes["served"] += 1
        except RemoteStageError as e:
            outcomes[e.code] += 1
            if e.code == BUSY:
                await asyncio.sleep(BUSY_PAUSE)
        except Exception:  # noqa: BLE001 - a stream cut off: what the server did with it is in its counts
            outcomes["cut"] += 1
        finally:
            await responses.aclose()


def test_130_silent_streams_from_one_peer_leave_honest_forwards_served():
    # the server's peer first: the others join through it, so both daemons hold a connection to it
    with running_peers(CONFIG.run_id, 3) as (server_peer, honest, attacker), \
            stage_servers(CONFIG, [server_peer], [0]) as [server]:
        service = server.service
        assert service.max_concurrent == 128  # the default server of the issue: twice max_queue 64
        server_id, namespace = PeerID.from_base58(server.peer_id), stage_namespace(CONFIG.run_id, 0)

        attacker_p2p = attacker.p2p()
        outcomes: collections.Counter = collections.Counter()
        stop = attacker.loop.run(_make_event(), CALL_TIMEOUT)
        stub = StageService.get_stub(attacker_p2p, server_id, namespace=namespace)

        async def attack():
            await asyncio.gather(*(hold_silent_stream(stub, stop, outcomes) for _ in range(STREAMS)))

        attack_done = asyncio.run_coroutine_threadsafe(attack(), attacker.loop.loop)
        try:
            # every stream reached the server: it holds a slot, or was refused one
            wait_until(lambda: service.active + outcomes[BUSY] >= STREAMS, OPEN_TIMEOUT,
                       what=f"the server to take or refuse all {STREAMS} silent streams")

            client = StageClient(honest.p2p(), server_id, namespace, timeout=CALL_TIMEOUT)
            served, failures = 0, []
            for i in range(HONEST_CALLS):
                tokens = torch.randint(0, CONFIG.model.vocab_size, (2, CONFIG.model.seq_len))
                try:
                    reply = honest.loop.run(client.forward(0, f"honest-{i}", tokens), CALL_TIMEOUT + 5)
                except (RemoteStageError, StageUnavailable) as e:
                    failures.append(str(e))
                    continue
                assert reply.tensors[0].shape == (2, CONFIG.model.seq_len, CONFIG.model.d_model)
                served += 1
            assert served >= HONEST_NEEDED, (f"honest forwards served: {served}/{HONEST_CALLS} during a "
                                             f"{STREAMS}-stream stall; failures: {failures[:3]}")

            # the stranger held no more than its share of the slots, ...
            attacker_id = attacker.peer_id
            assert service.slots.held(attacker_id) <= service.slots.per_caller == 32
            assert outcomes[BUSY] > 0
            # ... and a silent stream gave its slot back after the first-byte deadline, not the 60 s receive timeout
            wait_until(lambda: outcomes[BAD_REQUEST] >= service.slots.per_caller, 4 * DEFAULT_FIRST_BYTE_TIMEOUT,
                       what="the server to refuse the silent streams it took, at their first-byte deadline")
        finally:
            attacker.loop.run(_set(stop), CALL_TIMEOUT)
            attack_done.result(CALL_TIMEOUT)
        wait_until(lambda: service.active == 0, CALL_TIMEOUT, what="every slot back once the attack stops")


async def _make_event() -> asyncio.Event:
    return asyncio.Event()  # created on the attacker's loop, which waits on it


async def _set(event: asyncio.Event) -> None:
    event.set()
