"""Sharded optimizer state (averaging.zero): 4 servers of one stage step exactly as one optimizer would,
each holding the moments of about r/n of the parameters, no moment is lost when one is killed, and a
server that sends wrong updates for the chunks it reduces moves no honest server's parameters.

The servers are real (DHT, averaging process, P2P) on 127.0.0.1, in this process; micro-batches go
straight into their backends (see test_averaging.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.serving import StageServer
from swarm.zero import Layout, targets
from tests.integration.inproc import BACKEND_CALL_TIMEOUT, running_peers, stage_servers
from tests.integration.test_averaging import (
    MICRO,
    STAGE,
    make_config,
    micro_batch,
    run_round,
)

pytestmark = pytest.mark.timeout(240)

SERVERS = 4
CHUNK = 256  # the tiny stage has ~21k parameters: about 80 chunks
# Rendezvous hashing balances owners only on average: a member's share of the chunks is binomial around
# r/n; the test allows 5 standard deviations (the bench measures the balance on a real stage)
BALANCE_SIGMAS = 5
STEPS = 2


def zero_config(run_id: str, replicas: int):
    config = make_config(run_id)
    config.averaging.zero.enabled = True
    config.optimizer.name, config.optimizer.beta1 = "adamw", 0.9  # (sharded rounds run AdamW)
    config.averaging.zero.replicas = replicas
    config.averaging.zero.chunk_elements = CHUNK
    config.optimizer.batch_size = SERVERS * MICRO  # one micro-batch per server makes a step
    # Progress records at the default period (test_averaging's 0.3 s lets them live 1.5 s): on 2 loaded cores
    # the DHT stored them late, they expired mid-round, and a round failed ("nobody left to average with"), so
    # one server stepped alone and the exactness check failed (seen once in CI with a simulator busy beside).
    # test_stage_sync found the same.
    config.averaging.progress_period = 1.0
    return config.validate()


def sharded_state(server: StageServer) -> dict:
    """Parameters, held chunks (copies) and step of a replica, read on its worker thread."""
    backend = server.backend

    def read() -> dict:
        shards = backend.optimizer.shards
        return {"params": copy.deepcopy(backend.module.state_dict()), "step": backend.step,
                "chunks": {c: copy.deepcopy(m) for c, m in shards.chunks.items()}, "chunks_step": shards.step}

    return backend.call(read, BACKEND_CALL_TIMEOUT)


def reference_steps(config, rounds: list[list]) -> StageOptimizer:
    """One unsharded StageOptimizer on the same samples, batch by batch."""
    module = build_stage(config, STAGE)
    optimizer = StageOptimizer(module, config.optimizer)
    for batch in rounds:
        for x, y in batch:
            (module(x, y) * x.shape[0]).backward()
            optimizer.add_samples(x.shape[0])
        optimizer.step()
    return optimizer


def assert_moments_match(states: list[dict], reference: StageOptimizer, layout: Layout, replicas: int) -> None:
    """Every chunk is held by min(r, n) replicas, all agreeing with the reference's AdamW state."""
    flat_m = layout.flatten([reference.optimizer.state[p]["exp_avg"] for p in reference.params])
    flat_v = layout.flatten([reference.optimizer.state[p]["exp_avg_sq"] for p in reference.params])
    for c in range(layout.num_chunks):
        start, end = layout.bounds(c)
        holders = [s["chunks"][c] for s in states if c in s["chunks"]]
        assert len(holders) == min(replicas, len(states)), f"chunk {c} is held {len(holders)} times"
        for held in holders:
            assert held.steps == reference.step_count
            torch.testing.assert_close(held.exp_avg, flat_m[start:end], atol=1e-7, rtol=1e-4)
            torch.testing.assert_close(held.exp_avg_sq, flat_v[start:end], atol=1e-9, rtol=1e-4)


@pytest.mark.parametrize("replicas", [1, 2])
def test_sharded_steps_equal_one_unsharded_optimizer_and_each_server_holds_r_over_n(replicas):
    config = zero_config(f"zero-exact-{replicas}", replicas)
    rounds = [[[micro_batch(config, 10 * step + i)] for i in range(SERVERS)] for step in range(STEPS)]
    rounds[0][0].append(rounds[0][-1].pop())  # 8 samples on one, none on another: weighed by count
    with running_peers(config.run_id, SERVERS) as peers, \
            stage_servers(config, peers, [STAGE] * SERVERS) as servers:
        for batches in rounds:
            run_round(servers, batches)
        states = [sharded_state(s) for s in servers]
        layout = servers[0].averager.round.layout
        reference = reference_steps(config, [[b for mine in batches for b in mine] for batches in rounds])

        for state in states:
            assert state["step"] == STEPS
            for name, tensor in reference.module.state_dict().items():
                torch.testing.assert_close(state["params"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
        assert_moments_match(states, reference, layout, replicas)
        full = 8 * layout.numel
        share = replicas / SERVERS
        most = share + BALANCE_SIGMAS * math.sqrt(share * (1 - share) / layout.num_chunks) + 1 / layout.num_chunks
        for server, state in zip(servers, states):
            held = sum(m.nbytes for m in state["chunks"].values())
            assert held <= most * full, f"{held} bytes of moments, {full} unsharded"
            labels = {"stage": str(STAGE)}
            assert server.registry.get_sample_value("swarm_optimizer_state_bytes", labels) == held
            assert server.registry.get_sample_value("swarm_zero_chunks_owned", labels) == len(state["chunks"])


def vanish(peer, server: StageServer) -> None:
    """SIGKILL everything that makes `server` reachable (its DHT process, p2p daemon, averaging process),
    as if its machine died: nothing of it leaves cleanly."""
    for pid in [*descendants(peer.dht.pid), peer.dht.pid, server.averager.process_id]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


@pytest.mark.swarms  # (about 25 s of killing and rejoining: make test-swarms and make test-repeat, not make test)
@pytest.mark.repeated
def test_a_sigkilled_member_loses_no_moment_and_a_joiner_takes_over_its_chunks():
    config = zero_config("zero-churn", 2)
    batches = [[[micro_batch(config, 10 * step + i)] for i in range(SERVERS)] for step in range(3)]
    with running_peers(config.run_id, SERVERS + 1) as peers, \
            stage_servers(config, peers[:SERVERS], [STAGE] * SERVERS) as servers:
        run_round(servers, batches[0])
        vanish(peers[SERVERS - 1], servers[-1])
        survivors = servers[:-1]
        batches[1][0] += batches[1].pop()  # (a batch is 16 samples)
        run_round(survivors, batches[1])  # once the others stopped counting it (its record expired)
        with stage_servers(config, [peers[SERVERS]], [STAGE]) as (joiner,):
            live = [*survivors, joiner]
            run_round(live, batches[2])
            states = [sharded_state(s) for s in live]
            layout = joiner.averager.round.layout
            reference = reference_steps(config, [[b for mine in step for b in mine] for step in batches])
            for state in states:
                assert state["step"] == 3
                for name, tensor in reference.module.state_dict().items():
                    torch.testing.assert_close(state["params"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
            assert_moments_match(states, reference, layout, 2)  # every chunk: 2 live owners, none lost
            members = [s.peer_id for s in live]
            for c in range(layout.num_chunks):  # ...and they are the chunk's targets among the live members
                owners = {s.peer_id for s, state in zip(live, states) if c in state["chunks"]}
                assert owners == set(targets(layout.hash, c, members, 2)), f"chunk {c}"
            labels = {"stage": str(STAGE)}
            moved = sum(s.registry.get_sample_value("swarm_zero_chunk_transfers_total",
                                                    {**labels, "direction": "received"}) for s in live)
            assert moved > 0 and joiner.registry.get_sample_value("swarm_zero_chunks_owned", labels) > 0
            assert all(s.registry.get_sample_value("swarm_zero_chunks_reinitialized_total", labels) == 0 for s in live)
    gc.collect()  # the vanished peer's objects are finalized here, not in the middle of a later test


def test_a_primary_that_sends_wrong_updates_leaves_its_chunks_as_they_were_and_is_logged(caplog):
    # 3 servers, r = 2: every chunk has a co-owner, who reduces and steps it too; the liar adds 0.5 to every
    # update it sends (what it applies itself is its own business)
    config = zero_config("zero-liar", 2)
    config.optimizer.batch_size = 3 * MICRO
    config = config.validate()
    batches = [[[micro_batch(config, 10 * step + i)] for i in range(3)] for step in range(2)]
    with running_peers(config.run_id, 3) as peers, stage_servers(config, peers, [STAGE] * 3) as servers:
        run_round(servers, batches[0])  # an honest round: every owner now holds its chunks' moments
        liar, honest = servers[1], [servers[0], servers[2]]
        liar.averager.round.mailbox.outbound = lambda items: [
            dataclasses.replace(item, tensors=(item.tensors[0] + 0.5,)) if item.kind == "update" else item
            for item in items]
        before = [sharded_state(s) for s in honest]
        with caplog.at_level(logging.WARNING, logger="swarm.averaging"):
            run_round(servers, batches[1])
        after = [sharded_state(s) for s in honest]
        layout = liar.averager.round.layout
        reference = reference_steps(config, [[b for mine in step for b in mine] for step in batches])

    lied = [c for c in range(layout.num_chunks) if targets(layout.hash, c, [s.peer_id for s in servers], 2)[0]
            == liar.peer_id]  # (every member held its chunks: the best-ranked target is the primary)
    assert 0 < len(lied) < layout.num_chunks
    names = [n for n, _ in reference.module.named_parameters()]
    stepped = layout.flatten([reference.module.state_dict()[n] for n in names])
    for state, old in zip(after, before):
        assert state["step"] == 2
        now, was = (layout.flatten([s["params"][n] for n in names]) for s in (state, old))
        for c in range(layout.num_chunks):
            start, end = layout.bounds(c)
            if c in lied:  # exactly as before the round (not even weight decay), moments too
                assert torch.equal(now[start:end], was[start:end]), f"chunk {c}"
                if c in state["chunks"]:
                    assert torch.equal(state["chunks"][c].exp_avg, old["chunks"][c].exp_avg)
                    assert state["chunks"][c].steps == 1
            else:  # as one optimizer's two steps
                torch.testing.assert_close(now[start:end], stepped[start:end], atol=1e-6, rtol=1e-5)
    assert torch.equal(layout.flatten([after[0]["params"][n] for n in names]),
                       layout.flatten([after[1]["params"][n] for n in names]))  # the honest replicas stay equal
    # each honest server names the liar for each of its chunks, once (a line per co-owner that contradicted it)
    logged = [r.getMessage() for r in caplog.records if f"primary {liar.peer_id}" in r.getMessage()]
    assert all("dropped from this round" in line for line in logged), logged
    assert sum(int(re.search(r"(\d+) chunks:", line).group(1)) for line in logged) == 2 * len(lied), logged
