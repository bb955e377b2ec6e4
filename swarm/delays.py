"""How old the parameters were that each counted sample's gradient was computed on, against the step it counts in.

A sample's gradient counts in some step s of its stage. It is fresh when it was computed on the parameters
step s starts from (made by step s - 1); it is a step behind when computed on those of a step before (its
forward ran before a step it does not count in: pipelining, a round running beside compute, a batch held).
Forwards run ahead (optimizer.lookahead) are on a prediction of the next step's parameters: fresh if they count in
the step after that one.

In one process (configs/tiny.yaml, batch 16), stage 0's gradients a step behind on every sample cost ~10% of the
validation loss at step 50; run on a prediction from half the batch, ~2% (README, Learning). This tells what a
stage's servers really did: `StageBackend.delays`, logged when a server stops and exported as
``swarm_server_gradient_delay_samples_total``.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

MAX_TRACKED = 1024  # kept forwards whose backward is awaited, at most
MAX_LATE = 2  # steps behind counted apart; more are counted as this many


class GradientDelays:
    """Samples counted by (ran ahead, steps behind): steps behind is -1 for a prediction that came true a step early
    (the sample counted in the step it predicted, not the one after), 0 fresh, 1 or more behind."""

    def __init__(self) -> None:
        self.samples: collections.Counter[tuple[bool, int]] = collections.Counter()
        self._ahead: collections.OrderedDict[Hashable, bool] = collections.OrderedDict()

    def forwarded(self, key: Hashable, ahead: bool) -> None:
        """A kept forward ran (on look-ahead parameters, or a prediction, if `ahead`)."""
        self._ahead[key] = ahead
        self._ahead.move_to_end(key)
        while len(self._ahead) > MAX_TRACKED:
            self._ahead.popitem(last=False)

    def ran_ahead(self, key: Hashable | None) -> bool:
        """Whether this server ran the forward of `key` on look-ahead parameters (False too if it did not run it)."""
        return key is not None and self._ahead.get(key, False)

    def counted(self, key: Hashable | None, forward_step: int, ahead_now: bool, step: int, lands: int, n: int) -> None:
        """`n` samples counted at `step` towards the `lands`-th step from now, their forward at `forward_step` (on
        look-ahead parameters if that forward said so, else if `ahead_now`: the last stage runs both in one call)."""
        ahead = self._ahead.pop(key, ahead_now) if key is not None else ahead_now
        made_by = forward_step + (1 if ahead else 0)  # the step whose parameters (or their prediction) it ran on
        behind = step + lands - 1 - made_by
        self.samples[(ahead, max(-1, min(MAX_LATE, behind)))] += n

    def summary(self) -> str:
        total = sum(self.samples.values())
        if not total:
            return "no samples counted"

        def share(ahead: bool | None, behind: int) -> str:
            count = sum(n for (a, b), n in self.samples.items() if b == behind and (ahead is None or a == ahead))
            return f"{100 * count / total:.0f}%"

        return (f"of {total} samples, fresh {share(None, 0)} ({share(True, 0)} on a prediction); a step behind "
                f"{share(False, 1)} on their forward's parameters, {share(True, 1)} on a prediction; two or more "
                f"{share(None, 2)}; a prediction a step early {share(True, -1)}")
