"""Stage averaging without processes: what progress records mean, moving a replica's state, the backend seam."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from swarm.averaging.progress import (
    MAX_STEP_LEAD,
    ProgressRecord,
    fingerprints_differ,
    param_fingerprint,
    plausible,
    round_of,
    sharing_priority,
    stage_view,
    step_bound,
)
from swarm.backend import StageBackend
from swarm.config import RunConfig
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState, StateInfo, StateRejected, flatten, unflatten

pytestmark = pytest.mark.timeout(60)


def record(peer: str, step: int, samples: int = 0, members: tuple[str, ...] | None = None,
           fingerprint: list[float] | None = None, averaging: bool = False) -> ProgressRecord:
    """A server's record; its state came from a round over `members` (default: a lone step of its own)."""
    members = members or (peer,)
    made_by = round_of(step, members)
    return ProgressRecord(peer_id=peer, step=step, samples=samples, round_id=made_by, group=len(members),
                          priority=sharing_priority(step, len(members), made_by, peer), fingerprint=fingerprint,
                          averaging=averaging)


def test_only_samples_at_this_servers_step_count_but_servers_behind_are_expected():
    group = ("me", "a", "c")
    others = [record("a", 3, 5, group), record("b", 2, 100), record("c", 3, 0, group)]
    view = stage_view(record("me", 3, 4, group), others)
    assert view.samples == 9  # b's samples belong to step 2
    assert view.group_size == 4  # b catches up and joins
    assert not view.needs_state


def test_samples_taken_while_a_round_runs_count_towards_the_step_after_it():
    # a averages step 3 -> 4 beside compute; its new samples make step 5, as b's do after b's own round
    a = record("a", 3, 6, averaging=True)
    b = record("b", 4, 5, members=("b", "c"))
    view = stage_view(b, [a, record("c", 4, 2, members=("b", "c"))])
    assert view.samples == 13 and not view.closed and not view.needs_state
    view_a = stage_view(a, [b])
    assert view_a.samples == 11 and not view_a.behind  # a's round takes it to step 4, where b is
    assert stage_view(a, [record("b", 5)]).behind  # b is past where a's round takes it


def test_a_batch_another_server_closed_is_full_for_this_one_too():
    # b closed step 4's batch and began its round: a, still counting towards step 4, joins at once
    # (its count alone would say "not yet", and it would go on adding samples to that step)
    a = record("a", 3, 4)
    assert stage_view(a, [record("b", 3, 0, averaging=True)]).closed
    assert not stage_view(a, [record("b", 3, 9)]).closed
    # a still averages step 3 -> 4; b, already at 4, closed step 5's batch: the batch a counts towards
    a_in_round = record("a", 3, 4, averaging=True)
    assert stage_view(a_in_round, [record("b", 4, 0, averaging=True)]).closed
    assert not stage_view(a_in_round, [record("b", 4, 3)]).closed
    # a round's own group: every server not ahead, those still in the round before included
    assert stage_view(record("b", 4, 0, averaging=True), [a_in_round]).group_size == 2


def test_a_server_behind_its_stage_needs_the_state_and_rounds_give_up_on_nobody():
    view = stage_view(record("me", 3, 4), [record("a", 4)])
    assert view.behind and view.needs_state and view.group_size == 1


def test_replicas_of_one_round_agree_and_lone_steps_converge_on_the_best_ranked():
    group = ("p1", "p2", "p3")
    together = [record(p, 5, members=group) for p in group]
    assert not any(stage_view(r, [o for o in together if o is not r]).diverged for r in together)

    alone = [record(p, 5) for p in group]  # a failed round: each stepped on its own
    diverged = [stage_view(r, [o for o in alone if o is not r]).diverged for r in alone]
    assert sum(diverged) == 2  # all but the best-ranked download, and all from the same one

    pair = [record(p, 5, members=("p1", "p2")) for p in ("p1", "p2")]  # a group that formed without p3
    assert stage_view(alone[2], pair).diverged and not stage_view(pair[0], [pair[1], alone[2]]).diverged


def test_replicas_of_one_round_whose_parameters_differ_converge_on_the_best_ranked():
    group = ("p1", "p2", "p3")  # an all-reduce that lost a member partway: each kept its own values there
    apart = [record(p, 5, members=group, fingerprint=[1.0 + i, 2.0]) for i, p in enumerate(group)]
    diverged = [stage_view(r, [o for o in apart if o is not r]).diverged for r in apart]
    assert sum(diverged) == 2
    best = max(apart, key=lambda r: (r.priority, r.peer_id))
    assert not diverged[apart.index(best)]

    close = [record(p, 5, members=group, fingerprint=[1.0 + 1e-9 * i, 2.0]) for i, p in enumerate(group)]
    assert not any(stage_view(r, [o for o in close if o is not r]).diverged for r in close)  # rounding, not drift
    unknown = [record(p, 5, members=group) for p in group]  # peers of a version that publishes none
    assert not any(stage_view(r, [o for o in unknown if o is not r]).diverged for r in unknown)


def test_param_fingerprint_tells_apart_parameters_that_differ_slightly():
    params = [torch.randn(64, 64), torch.randn(64)]
    moved = [params[0].clone(), params[1].clone()]
    moved[0][3, 5] += 1e-3  # one weight, one Adam step of lr 1e-3 apart
    assert fingerprints_differ(param_fingerprint(params), param_fingerprint(moved))
    assert not fingerprints_differ(param_fingerprint(params), param_fingerprint([p.clone() for p in params]))
    assert not fingerprints_differ(param_fingerprint(params), None)


def test_sharing_priority_orders_by_step_then_group_size_then_round():
    assert sharing_priority(6, 1, "x") > sharing_priority(5, 8, "y")
    assert sharing_priority(5, 3, "x") > sharing_priority(5, 2, "y")
    assert sharing_priority(5, 2, "x") == sharing_priority(5, 2, "x") != sharing_priority(5, 2, "y")
    assert sharing_priority(5, 10**6, "x") < 6


def test_progress_record_parses_tolerantly():
    wire = {**record("a", 1, 2).to_wire(), "from_a_newer_version": 1}
    assert ProgressRecord.from_wire(wire).samples == 2
    older = {k: v for k, v in wire.items() if k != "averaging"}  # a peer from before rounds ran beside compute
    assert ProgressRecord.from_wire(older).averaging is False
    assert ProgressRecord.from_wire({**wire, "averaging": 1}) is None
    assert ProgressRecord.from_wire({**wire, "step": -1}) is None
    assert ProgressRecord.from_wire("garbage") is None


def tiny_config() -> RunConfig:
    return RunConfig.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8},
        "stages": {"num_stages": 2},
        "optimizer": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 0},
    })


def trained_replica(config: RunConfig, seed: int, steps: int) -> StageOptimizer:
    torch.manual_seed(seed)
    module = build_stage(config, 1)
    optimizer = StageOptimizer(module, config.optimizer)
    for _ in range(steps):
        x = torch.randn(4, 8, 16)
        y = torch.randint(0, 256, (4, 8))
        (module(x, y) * 4).backward()
        optimizer.add_samples(4)
        optimizer.step()
    return optimizer


def replica_state(optimizer: StageOptimizer, round_id: str = "r", group: int = 2) -> StageState:
    return StageState(optimizer.module, optimizer, 1, round_id, group)


def test_state_moves_parameters_moments_and_step_and_keeps_gradients():
    config = tiny_config()
    source, target = trained_replica(config, 1, steps=3), trained_replica(config, 2, steps=1)
    param = target.params[0]
    param.grad = torch.ones_like(param)
    target.add_samples(2)
    info, tensors = replica_state(source).state_dict()
    mine = replica_state(target, "other", 1)

    mine.load_state_dict(*unflatten(*flatten(info, tensors)))  # as it crosses hivemind's state download

    assert target.step_count == 3 and target.samples == 2 and torch.equal(param.grad, torch.ones_like(param))
    assert (mine.round_id, mine.group) == ("r", 2)
    for (name, value), theirs in zip(target.module.state_dict().items(), source.module.state_dict().values()):
        assert torch.equal(value, theirs), name
    for index, slots in source.optimizer.state_dict()["state"].items():
        for key, value in slots.items():
            assert torch.equal(target.optimizer.state_dict()["state"][index][key], value), (index, key)


def test_a_state_before_the_first_step_has_no_moments_and_clears_them():
    config = tiny_config()
    fresh, target = trained_replica(config, 1, steps=0), trained_replica(config, 2, steps=2)
    info, tensors = replica_state(fresh).state_dict()
    assert not any(key.startswith("optim/") for key in tensors)
    replica_state(target).load_state_dict(info, tensors)
    assert target.step_count == 0 and not target.optimizer.state


@pytest.mark.parametrize("damage", ["stage", "shape", "missing", "moment", "dtype", "nan", "unknown", "half-moment"])
def test_a_state_that_does_not_fit_is_rejected_and_changes_nothing(damage):
    config = tiny_config()
    source, target = trained_replica(config, 1, steps=2), trained_replica(config, 2, steps=1)
    info, tensors = replica_state(source).state_dict()
    first = next(iter(tensors))
    if damage == "stage":
        info = StateInfo(0, info.step, info.round_id, info.group)
    elif damage == "shape":
        tensors[first] = torch.zeros(3)
    elif damage == "missing":
        del tensors[first]
    elif damage == "moment":
        tensors["optim/0/step"] = torch.zeros(7, 7)  # a scalar
    elif damage == "dtype":
        tensors[first] = tensors[first].double()
    elif damage == "nan":
        tensors[first][..., 0] = float("nan")
    elif damage == "unknown":
        tensors["optim/999/exp_avg"] = torch.zeros(1)
    else:
        del tensors["optim/0/exp_avg_sq"]
    before = {k: v.clone() for k, v in target.module.state_dict().items()}

    with pytest.raises(StateRejected):
        replica_state(target).load_state_dict(info, tensors)

    assert target.step_count == 1
    assert all(torch.equal(before[k], v) for k, v in target.module.state_dict().items())


@pytest.mark.parametrize("metadata", [None, {"format": 1}, {"format": 2, "stage": 1, "step": -1, "round_id": "r",
                                                             "group": 1, "keys": []},
                                      {"format": 2, "stage": 1, "step": True, "round_id": "r", "group": 1, "keys": []},
                                      {"format": 2, "stage": 1, "step": 3, "round_id": "r", "group": 1, "keys": ["a"]}])
def test_malformed_state_metadata_from_a_peer_is_rejected(metadata):
    with pytest.raises(StateRejected):
        unflatten(metadata, [])


def test_a_step_claimed_by_a_minority_is_not_believed():
    assert step_bound([]) is None
    assert step_bound([10, 10, 10**9]) == 10 + MAX_STEP_LEAD
    assert step_bound([10, 10**9]) == 10 + MAX_STEP_LEAD
    honest, liar = record("a", 10, 0), record("b", 10**9, 0)
    assert plausible([honest, record("c", 11, 0), liar]) == [honest, record("c", 11, 0)]


class FakeStepper:
    """Steps when told to, for the backend seam: its step may also report that nothing stepped."""

    def __init__(self):
        self.step_count, self.samples, self.ready, self.result = 0, 0, False, None
        self.closes_batch = False  # (what it steps on is not a batch of its own)
        self.stepped = threading.Event()

    def accumulate(self, grads, n: int, awaited: bool = False, predicted: bool = False) -> int:
        self.samples += n
        return 1

    def step(self):
        self.stepped.set()
        return self.result

    def samples_to_step(self):
        return None  # (it cannot say: nothing runs ahead)


def test_backend_steps_through_its_stepper_and_on_request():
    config = tiny_config()
    module = build_stage(config, 1)
    stepper, seen = FakeStepper(), []
    backend = StageBackend(module, StageOptimizer(module, config.optimizer), on_step=seen.append, stepper=stepper)
    try:
        x, y = torch.randn(2, 8, 16), torch.randint(0, 256, (2, 8))
        assert backend.backward(x, targets=y).step_stats is None and stepper.samples == 2

        stepper.ready = True  # a stepper that learns from the network that the stage's batch is full
        backend.request_step().result(10)
        assert stepper.stepped.is_set() and seen == []  # its step reported nothing stepped: no stats

        stepper.result = {"step": 1, "skipped": False}
        stepper.step_count = 1
        assert backend.backward(x, targets=y).step_stats == stepper.result and backend.step == 1
        assert seen == [stepper.result]
    finally:
        backend.shutdown()


def test_an_all_reduce_that_lost_part_of_the_vector_is_a_failed_round(monkeypatch):
    from concurrent.futures import Future
    from types import SimpleNamespace

    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.partition import TensorPartContainer

    from swarm.averaging.process import AveragingProcess, PartialRound

    async def finished(self, group_info, min_vector_size, **kwargs):
        return {"peer": {"step": 1}}

    monkeypatch.setattr(DecentralizedAverager, "_aggregate_with_group", finished)
    process = AveragingProcess.__new__(AveragingProcess)  # only the round bookkeeping is used
    process._parent_pid = None  # (what its __del__ looks at)
    process._all_reduce = True
    group = SimpleNamespace(group_id=b"g")

    def registered(failed: int) -> None:
        runner = Future()
        runner.set_result(SimpleNamespace(tensor_part_container=SimpleNamespace(failed_size=failed, total_size=40),
                                          tensor_part_reducer=SimpleNamespace(sender_weights=[7.0]),
                                          sender_peer_ids=["peer"]))
        process._running_groups = {b"g": runner}

    registered(0)  # (a round armed ahead: a member's samples are the weight its reducer counted)
    assert asyncio.run(process._aggregate_with_group(group, 0)) == {"peer": {"step": 1, "samples": 7}}
    registered(10)
    with pytest.raises(PartialRound, match="75.0%"):
        asyncio.run(process._aggregate_with_group(group, 0))
    # what the check reads is hivemind's own bookkeeping: fail here if a new hivemind renames it
    container = TensorPartContainer([torch.zeros(8)], peer_fractions=(1.0,))
    assert container.failed_size == 0 and container.total_size == 8
