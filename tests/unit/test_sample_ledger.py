"""The ledger of late and held samples (swarm/averaging/ledger.py), by hand."""

from __future__ import annotations

import torch

from swarm.averaging.ledger import SampleLedger


def grads(value: float) -> list[torch.Tensor | None]:
    return [torch.full((2,), value), None, torch.full((3,), value)]


def test_held_samples_are_summed_and_start_the_next_batch_when_a_round_takes_the_due_one():
    ledger = SampleLedger()
    ledger.hold(grads(1.0), 4)
    ledger.hold([torch.full((2,), 2.0), torch.ones(1), None], 3)  # a gradient the first did not have
    held, n = ledger.start_round()
    assert n == 7 and ledger.held_samples == 0
    assert torch.equal(held[0], torch.full((2,), 3.0)) and torch.equal(held[1], torch.ones(1))
    assert torch.equal(held[2], torch.full((3,), 1.0))
    assert ledger.start_round() == (None, 0)  # released once


def test_late_samples_belong_to_the_round_that_takes_them_and_come_back_if_it_fails():
    ledger = SampleLedger()
    ledger.count_late(5)
    ledger.count_late(3)
    ledger.start_round()
    assert (ledger.late, ledger.late_in_round) == (0, 8)
    assert ledger.own_late(6) == 6 and ledger.own_late(20) == 8  # never more than the server's own
    ledger.count_late(2)  # during this round
    ledger.round_failed()  # its batch goes back: late again, with those that came meanwhile
    assert ledger.late == 10
    ledger.start_round()
    assert (ledger.late, ledger.late_in_round) == (0, 10)


def test_a_replaced_state_takes_what_was_computed_on_the_old_one():
    ledger = SampleLedger()
    ledger.count_late(4)
    ledger.hold(grads(1.0), 6)
    assert ledger.state_replaced() == 6
    assert (ledger.late, ledger.held_samples) == (0, 0) and ledger.start_round() == (None, 0)
    assert ledger.state_replaced() == 0
