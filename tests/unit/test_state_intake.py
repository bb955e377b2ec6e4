"""StateIntake: how long a server that sent a bad state, or an incomplete one, is not asked again."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from swarm.averaging import intake
from swarm.averaging.intake import StateIntake
from swarm.averaging.metrics import AveragingMetrics
from swarm.state import StateIncomplete, StateInfo, StateRejected, StateUnbacked, flatten, unflatten

INFO = StateInfo(stage=1, step=3, round_id="init", group=1)


def sent(count: int, of: int) -> tuple[dict, list[torch.Tensor]]:
    metadata, tensors = flatten(INFO, {f"t{i}": torch.zeros(2) for i in range(of)})
    return metadata, tensors[:count]


def test_a_state_with_fewer_tensors_than_it_names_is_incomplete_and_with_more_is_rejected():
    with pytest.raises(StateIncomplete, match="names 5 tensors but only 3 came"):
        unflatten(*sent(3, 5))
    metadata, tensors = sent(5, 5)
    with pytest.raises(StateRejected, match="names 5 tensors but has 6") as more:
        unflatten(metadata, tensors + [torch.zeros(2)])
    assert not isinstance(more.value, StateIncomplete)
    assert unflatten(metadata, tensors)[0] == INFO


class Downloads:
    """Stands in for the averaging process: records which peers each download skipped."""

    def __init__(self):
        self.skipped: list[list[str]] = []
        self.only: list[list[str] | None] = []

    def download_state(self, timeout, stop, exclude, max_bytes, only=None):
        self.skipped.append(sorted(exclude))
        self.only.append(only)
        return None


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(intake.time, "monotonic", lambda: now[0])
    return now


def test_a_sender_of_an_incomplete_state_is_asked_again_soon_and_one_of_a_bad_state_much_later(clock):
    state = type("S", (), {"stage": 1, "nbytes": lambda self: 100})()
    registry = CollectorRegistry()
    process = Downloads()
    taker = StateIntake(state, process, AveragingMetrics(registry, 1), lambda: [], 1e-6, threading.Event(),
                        own=lambda: None, established=lambda: {"cut", "liar", "honest"})
    problem = taker.refuse(({}, [], "cut"), StateIncomplete("the state names 5 tensors but only 3 came"))
    assert isinstance(problem, StateIncomplete)
    taker.refuse(({}, [], "liar"), StateRejected("its step 99 is beyond the stage's"))
    taker.fetch(1.0)
    clock[0] += intake.INCOMPLETE_PEER_SECONDS + 0.1
    taker.fetch(1.0)
    clock[0] += intake.REFUSED_PEER_SECONDS
    taker.fetch(1.0)
    assert process.skipped == [["cut", "liar"], ["liar"], []]
    assert process.only == [["cut", "honest", "liar"]] * 3  # downloads go to established servers only
    assert registry.get_sample_value("swarm_averaging_rejected_states_total", {"stage": "1"}) == 1.0


def test_nothing_is_downloaded_while_no_server_of_the_stage_is_established(clock):
    state = type("S", (), {"stage": 1, "nbytes": lambda self: 100})()
    process = Downloads()
    taker = StateIntake(state, process, AveragingMetrics(CollectorRegistry(), 1), lambda: [], 1e-6,
                        threading.Event(), own=lambda: None, established=set)
    assert taker.fetch(1.0) is None and process.skipped == []


def test_a_sender_the_records_did_not_back_is_asked_again_once_the_records_may_have_changed(clock):
    # (e.g. two survivors of a stage whose third server died: its record contradicts them until it expires)
    state = type("S", (), {"stage": 1, "nbytes": lambda self: 100})()
    process = Downloads()
    taker = StateIntake(state, process, AveragingMetrics(CollectorRegistry(), 1), lambda: [], 1e-6,
                        threading.Event(), own=lambda: None, established=lambda: {"peer", "liar"})
    taker.refuse(({}, [], "peer"), StateUnbacked("no established server besides peer is at step 7"))
    taker.refuse(({}, [], "liar"), StateRejected("blocks.0.ln1.weight has non-finite values"))
    taker.fetch(1.0)
    clock[0] += intake.UNBACKED_PEER_SECONDS + 0.1
    taker.fetch(1.0)
    assert process.skipped == [["liar", "peer"], ["liar"]]


def test_a_download_asks_the_established_servers_best_ranked_first_by_their_signed_records(clock):
    state = type("S", (), {"stage": 1, "nbytes": lambda self: 100})()
    process = Downloads()
    ranks = {"low": 1.0, "high": 3.0, "mid": 2.0}
    records = [type("R", (), {"peer_id": peer, "priority": rank})() for peer, rank in ranks.items()]
    taker = StateIntake(state, process, AveragingMetrics(CollectorRegistry(), 1), lambda: records, 1e-6,
                        threading.Event(), own=lambda: None, established=lambda: {"low", "high", "mid", "silent"})
    taker.fetch(1.0)
    assert process.only == [["high", "mid", "low", "silent"]]  # one with no record (yet) last
