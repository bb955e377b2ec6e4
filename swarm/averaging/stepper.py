"""What a stage backend needs from whatever decides when and how its parameters change."""

from __future__ import annotations

from typing import Any, Protocol


class StageStepper(Protocol):
    """Counts samples, says when the stage should step, and steps.

    The backend calls every method on its single worker thread, right after the backward that
    accumulated the samples into ``param.grad`` (sums over samples, never means). Implementations:

    - :class:`swarm.optim.StageOptimizer`: one server alone; steps on its own full batch.
    - :class:`swarm.averaging.StageAverager`: the servers of a stage together; steps when the stage
      as a whole has a full batch, on the gradient averaged over all of them.
    """

    @property
    def step_count(self) -> int:
        """Optimizer steps this replica of the stage has taken (or adopted from its peers)."""
        ...

    def add_samples(self, n: int) -> None:
        """Gradients of ``n`` more samples were summed into ``param.grad``."""
        ...

    @property
    def ready(self) -> bool:
        """Whether :meth:`step` has something to do now."""
        ...

    def step(self) -> dict[str, Any] | None:
        """Step the stage; stats of the step (``step, lr, grad_norm, samples, skipped``, ...), or None
        if the parameters changed without a step of this replica's own (e.g. it caught up with its peers)."""
        ...
