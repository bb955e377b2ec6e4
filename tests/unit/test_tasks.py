"""swarm.tasks: loops made after keep_tasks_alive hold every task until it is done, on asyncio's and uvloop's."""

from __future__ import annotations

import asyncio
import gc

import pytest
import uvloop

from swarm.tasks import hold_tasks, keep_tasks_alive, live_tasks

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("policy", [asyncio.DefaultEventLoopPolicy, uvloop.EventLoopPolicy])
def test_a_task_nothing_else_holds_survives_the_collector(policy):
    keep_tasks_alive()
    loop = policy().new_event_loop()
    try:
        reached = []

        async def waits_on_its_own_future():
            # The future is this coroutine's alone: without the loop holding the task, nothing reachable does
            await asyncio.get_running_loop().create_future()
            reached.append("never")

        async def main():
            task = asyncio.get_running_loop().create_task(waits_on_its_own_future())
            name = task.get_name()
            del task
            await asyncio.sleep(0)
            gc.collect()
            held = [t for t in asyncio.all_tasks() if t.get_name() == name]
            assert len(held) == 1 and not held[0].done(), "the collector took a pending task"
            assert live_tasks(asyncio.get_running_loop()) == 2  # main and the waiter
            held[0].cancel()
            await asyncio.gather(held[0], return_exceptions=True)
            assert live_tasks(asyncio.get_running_loop()) == 1  # a finished task is let go

        loop.run_until_complete(main())
        assert not reached
    finally:
        loop.close()


def test_hold_tasks_is_idempotent_and_keep_tasks_alive_too():
    keep_tasks_alive()
    keep_tasks_alive()  # (the wrapper is not wrapped twice)
    loop = hold_tasks(hold_tasks(asyncio.new_event_loop()))
    try:
        async def main():
            return live_tasks(asyncio.get_running_loop())

        assert loop.run_until_complete(main()) == 1
        assert live_tasks(loop) == 0
    finally:
        loop.close()
