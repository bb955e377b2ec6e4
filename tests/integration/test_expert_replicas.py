"""Experts survive their hosts and their replicas stay equal (swarm.serving.replicas, swarm.checkpoint).

Real peers on 127.0.0.1, each with its own DHT node, in this process: expert servers, and for the
checkpoint test stage servers, a trainer and the coordinator's archive.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch

from coordinator.archive import RunArchive
from swarm.export import load_exported
from swarm.export import main as export_main
from swarm.model import make_expert
from swarm.serving import ExpertServer
from tests.helpers import wait_until
from tests.integration.inproc import (
    BACKEND_CALL_TIMEOUT,
    running_peers,
)
from tests.integration.test_moe_experts import (
    expert_servers,
    expert_state,
    moe_config,
    one_batch_with_one_host,
)

pytestmark = pytest.mark.timeout(240)

PULL_TIMEOUT = 60.0
ROUND_TIMEOUT = 60.0
LAYERS = (0, 1)


def parameters(server: ExpertServer, expert: int) -> list[torch.Tensor]:
    return server.host.submit(lambda: [p.detach().clone() for p in server.states[expert].parameters()]
                              ).result(BACKEND_CALL_TIMEOUT)


def test_an_expert_whose_hosts_are_all_gone_resumes_from_its_dht_announced_checkpoint(tmp_path: Path, caplog):
    """The only host of experts 0-3 leaves; a new host on another disk resumes 1 and 3 from the checkpoints the
    coordinator pulled from it and announces (not from their initial weights). The coordinator's run checkpoint
    holds the experts too, and swarm-export puts them in the model it writes."""
    caplog.set_level(logging.INFO)
    config = moe_config("expertresume")
    config.checkpoint.every_steps = 1
    with running_peers(config.run_id, 6) as (coordinator, trainer_peer, *peers), contextlib.ExitStack() as stack:
        archive = RunArchive(config, tmp_path / "coordinator", coordinator.records, coordinator.loop,
                             coordinator.peer_id, max_stage_bytes=2**30)
        archive.start(coordinator.p2p())
        stack.callback(archive.close)
        first = one_batch_with_one_host(config, stack, trainer_peer, peers, tmp_path / "first", tmp_path / "stages")
        saved = {(layer, e): expert_state(first, layer, e) for layer in LAYERS for e in (1, 3)}
        for (layer, e), state in saved.items():  # trained: resuming from the initial weights would show
            initial = make_expert(config.model, layer, e).state_dict()
            assert any(not torch.equal(state[name], initial[name]) for name in state), (layer, e)
        moments = {(layer, e): first.host.optimizers[layer, e].moments() for layer in LAYERS for e in (1, 3)}
        # the archive pulls each expert's checkpoint once the host has been established for min_tenure
        wait_until(lambda: archive.poll() or all(archive.experts[e].newest_intact() for e in (1, 3)), PULL_TIMEOUT,
                   interval=0.3, what="the coordinator pulling the experts' checkpoints")

        def run_with_experts() -> bool:
            archive.poll()
            found = archive.runs.newest_verified()
            return found is not None and [e.stage for e in found[0].manifest.experts] == [0, 1, 2, 3]

        wait_until(run_with_experts, PULL_TIMEOUT, interval=0.3,
                   what="a run checkpoint of both stages and every expert")
        export_main(["--checkpoint-dir", str(tmp_path / "coordinator"), "--out", str(tmp_path / "model")])
        exported = load_exported(tmp_path / "model").state_dict()
        for (layer, e), state in saved.items():
            for name, tensor in state.items():
                torch.testing.assert_close(exported[f"blocks.{layer}.mlp.experts.{e}.{name}"], tensor, rtol=0, atol=0)
        first.shutdown()  # announces OFFLINE: no live host of any expert is left, and its disk is not the new one's
        with expert_servers(config, peers[3:4], [[1, 3]], tmp_path / "second") as (second,):
            assert second.host.step == 1
            for layer in LAYERS:
                for e in (1, 3):
                    torch.testing.assert_close(expert_state(second, layer, e), saved[layer, e], rtol=0, atol=0)
                    restored = second.host.optimizers[layer, e].moments()
                    assert restored.keys() == moments[layer, e].keys() and restored
                    for key, value in moments[layer, e].items():
                        torch.testing.assert_close(restored[key].float(), value.float(), rtol=0, atol=0)
            # fetched from the coordinator, installed on the new host's own disk, and announced by it in turn
            assert any(f"fetched the checkpoint of step 1 from {coordinator.peer_id}" in r.getMessage()
                       for r in caplog.records if r.getMessage().startswith("expert 1:"))
            assert [p.name for p in second.keepers[3].store.entries()] == ["step0000000001"]


def test_two_hosts_of_an_expert_that_took_different_backwards_end_equal_after_their_next_round():
    config = moe_config("expertreplicas")
    config.averaging.expert_replica_period = 2.0
    samples = config.optimizer.batch_size  # a whole batch in one backward: the expert steps on it
    d_model, rows = config.model.d_model, 6
    with running_peers(config.run_id, 2) as peers, expert_servers(config, peers, [[0, 2], [2, 3]]) as hosts:
        apart = []
        for seed, server in enumerate(hosts):  # each host takes a backward the other never sees
            generator = torch.Generator().manual_seed(seed)
            inputs, grad = (torch.randn(rows, d_model, generator=generator) for _ in range(2))
            host = server.host
            host.submit(host.backward, 0, [(2, rows)], inputs, grad, samples).result(BACKEND_CALL_TIMEOUT)
            apart.append(parameters(server, 2))
        assert all(h.host.optimizers[0, 2].step_count == 1 for h in hosts)
        assert not torch.allclose(apart[0][0], apart[1][0])

        def equal() -> bool:
            return all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*(parameters(h, 2) for h in hosts)))

        wait_until(equal, ROUND_TIMEOUT, interval=0.2, what="expert 2's hosts ending equal")
        assert all(h.replicas[2].rounds["succeeded"] >= 1 for h in hosts)
        # at the mean of the two, however the rounds fell around the backwards: a round moves each host by what the
        # mean moved its snapshot, so the hosts' sum is what their backwards made it
        for mine, expected in zip(parameters(hosts[0], 2), [(a + b) / 2 for a, b in zip(*apart)]):
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)
        # an expert hosted once is averaged with nobody
        assert hosts[0].replicas[0].rounds == {"succeeded": 0, "failed": 0}


def test_hosts_of_an_expert_meet_again_after_one_skipped_a_period_it_saw_the_other_in():
    """A host that sits out one period (it did not see the other host in the DHT yet) while the other looks for a
    group in it: their rounds still fall in the same period afterwards. Rounds whose matchmaking outlasted the period
    (matchmaking_timeout 10 s, the period 2 s) used to start a period apart from then on, in turn, and the hosts
    missed each other for a minute and more."""
    config = moe_config("expertskip")
    config.averaging.expert_replica_period = 2.0
    samples = config.optimizer.batch_size
    d_model, rows = config.model.d_model, 6
    with running_peers(config.run_id, 2) as peers, expert_servers(config, peers, [[2], [2]]) as hosts:
        replicas = hosts[1].replicas[2]
        seen, real = [], replicas.other_hosts

        def late_to_see() -> list[str]:
            others = real()
            seen.append(bool(others))
            return [] if seen.count(True) == 1 and others else others  # the first period with the other: sat out

        replicas.other_hosts = late_to_see
        for seed, server in enumerate(hosts):
            generator = torch.Generator().manual_seed(seed)
            inputs, grad = (torch.randn(rows, d_model, generator=generator) for _ in range(2))
            server.host.submit(server.host.backward, 0, [(2, rows)], inputs, grad, samples).result(BACKEND_CALL_TIMEOUT)

        def equal() -> bool:
            return all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*(parameters(h, 2) for h in hosts)))

        wait_until(lambda: seen.count(True) >= 1, ROUND_TIMEOUT, interval=0.1, what="the second host seeing the first")
        # within two matchmaking timeouts of the period it sat out, plus a few periods for loaded machines
        wait_until(equal, 2 * config.averaging.matchmaking_timeout + 5 * 2.0, interval=0.2,
                   what="expert 2's hosts ending equal after one sat out a period")
        assert all(h.replicas[2].rounds["succeeded"] >= 1 for h in hosts)
