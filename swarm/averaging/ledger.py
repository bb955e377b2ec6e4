"""The ledger of a stage replica's samples that are not simply part of the batch it accumulates: pure, no I/O.

- late: samples accumulated while a round ran; they count towards the step after it (one step late), and
  the step's stats say how many of its samples were (``own_late``);
- held: samples that came while a batch was due (full, its round not started yet): they would make that
  batch larger, so their gradient sums are held apart and start the next batch once the round takes the
  due one.

What happens to them: a round starts (the late samples become the round's, the held ones are released
into the accumulation), the round fails (its batch goes back, and so do its late samples), or a state
from elsewhere replaces the replica's (what was computed on the replaced state goes with it).
StageAverager owns one and calls it from the compute thread (under the state's lock where the
accumulation changes with it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SampleLedger:
    def __init__(self):
        self.late = 0  # samples accumulated while the last round ran
        self.late_in_round = 0  # ...and those of the batch the round now under way averages
        self._held: list[torch.Tensor | None] | None = None
        self.held_samples = 0

    def count_late(self, n: int) -> None:
        """`n` samples were accumulated while a round ran."""
        self.late += n

    def hold(self, grads: Sequence[torch.Tensor | None], n: int) -> None:
        """Keep the gradient sums of `n` samples apart (summed in place into what is held already)."""
        if self._held is None:
            self._held = list(grads)
        else:
            for i, grad in enumerate(grads):
                if grad is not None:
                    held = self._held[i]
                    self._held[i] = grad if held is None else held.add_(grad)
        self.held_samples += n

    def start_round(self) -> tuple[list[torch.Tensor | None] | None, int]:
        """A round takes the due batch: the late samples become that round's; returns what was held (None,
        0 if nothing), which starts the next batch."""
        self.late_in_round, self.late = self.late, 0
        held, samples = self._held, self.held_samples
        self._held, self.held_samples = None, 0
        return held, samples

    def round_failed(self) -> None:
        """The round's batch goes back to the accumulation: its late samples are late again."""
        self.late += self.late_in_round

    def own_late(self, own: int) -> int:
        """Of `own` samples of this server in the round's step, how many came while the round before ran."""
        return min(self.late_in_round, own)

    def state_replaced(self) -> int:
        """A state from elsewhere replaced the replica's: forget what was computed on the old one; returns
        how many held samples were dropped."""
        dropped = self.held_samples
        self.late = 0
        self._held, self.held_samples = None, 0
        return dropped
