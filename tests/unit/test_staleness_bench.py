"""bench/staleness.py's DC-ASGD term, against a hand computation (the swarm itself does not use it: README)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

SPEC = importlib.util.spec_from_file_location("staleness_bench", Path(__file__).parents[2] / "bench" / "staleness.py")
staleness = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = staleness  # (its dataclasses look their module up there)
SPEC.loader.exec_module(staleness)


class One(torch.nn.Module):
    def __init__(self, values: list[float]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(values))


def test_dc_asgd_adds_lambda_g_g_times_the_parameters_moved_scaled_by_the_gradients_rms():
    sums = [[torch.tensor([2.0, -4.0])]]  # gradient sums of 2 samples: the mean gradient is [1, -2]
    now, used = [One([1.5, 0.3])], [One([1.0, 0.2])]  # the parameters moved by [0.5, 0.1] since they were used
    staleness.compensate(sums, 2, now, used, lam=2.0)
    scale = 2.0 / math.sqrt((1.0 + 4.0) / 2)  # lambda_0 / rms(mean gradient)
    expected = [2.0 + 1.0 * 0.5 * scale * 2, -4.0 + 4.0 * 0.1 * scale * 2]  # sums + n * g*g*(w_now - w_used) * scale
    torch.testing.assert_close(sums[0][0], torch.tensor(expected))


def test_dc_asgd_changes_nothing_where_the_parameters_did_not_move():
    sums = [[torch.tensor([3.0, 1.0])]]
    staleness.compensate(sums, 4, [One([0.7, -0.2])], [One([0.7, -0.2])], lam=2.0)
    torch.testing.assert_close(sums[0][0], torch.tensor([3.0, 1.0]))
