"""Two hivemind P2P daemons on 127.0.0.1, for tests of what passes between them, on a loop that holds its tasks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import uvloop
from hivemind.p2p import P2P

from swarm.tasks import hold_tasks

T = TypeVar("T")


@contextlib.asynccontextmanager
async def server_and_client() -> AsyncIterator[tuple[P2P, P2P]]:
    """A server daemon and a client daemon that knows it; both shut down on the way out."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(m) for m in await server.get_visible_maddrs()])
        try:
            yield server, client
        finally:
            await client.shutdown()
    finally:
        await server.shutdown()


def run_held(main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()` to its end on a fresh uvloop loop (hivemind's kind) that holds its tasks."""
    loop = hold_tasks(uvloop.new_event_loop())
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
