"""What a stage backend needs from whatever decides when and how its parameters change."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class StageStepper(Protocol):
    """Counts samples, says when the stage should step, and steps.

    The backend calls every method on its single worker thread; after each backward it hands over
    that micro-batch's gradients (sums over its samples, never means). Implementations:

    - :class:`swarm.optim.StageOptimizer`: one server alone; steps on its own full batch.
    - :class:`swarm.averaging.StageAverager`: the servers of a stage together; steps when the stage
      as a whole has a full batch, on the gradient averaged over all of them.
    """

    @property
    def step_count(self) -> int:
        """Optimizer steps this replica of the stage has taken (or adopted from its peers)."""
        ...

    def accumulate(self, grads: Sequence[torch.Tensor | None], n: int, awaited: bool = False,
                   predicted: bool = False) -> int:
        """Take the gradient sums of ``n`` more samples (one tensor per parameter, None: no gradient); `awaited`:
        the batch due now waited for them (swarm.drain), so they count towards it even though it is full;
        `predicted`: computed on a prediction of the next step's parameters (counted in the next step, they are a
        step early; holding them for the step after made steps larger than a stage's replicas allow: not done).
        Returns the step they count towards, from now: 1 the next, 2 the one after (a round runs, or the batch
        due holds them for the next)."""
        ...

    @property
    def closes_batch(self) -> bool:
        """Whether :meth:`step` would now close a batch (the backend may first wait for backwards on their way,
        swarm.drain), rather than apply or await what a round or a download brought."""
        ...

    @property
    def ready(self) -> bool:
        """Whether :meth:`step` has something to do now."""
        ...

    def step(self) -> dict[str, Any] | None:
        """Step the stage, or move a step on (e.g. hand the batch to a round that runs elsewhere, or
        apply one that ended); never waits on the network. Stats of a step taken now (``step, lr,
        grad_norm, samples, skipped``, ...), or None if none was (a round began, or the parameters
        changed without a step of this replica's own: it caught up with its peers)."""
        ...

    def samples_to_step(self) -> int | None:
        """Samples the stage still needs before its next step starts, as far as this replica knows; None
        when it cannot say, or when the parameters its compute runs on are already a look-ahead (a round
        runs): the backend then predicts nothing (:class:`swarm.backend.StageBackend`, forwards ahead)."""
        ...
