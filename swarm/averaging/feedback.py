"""ErrorFeedback: what the codec rounds off a server's pseudo-gradients, kept and sent with the next one.

A server in the low-communication mode sends its pseudo-gradient through a lossy codec (float8: 1 byte a value).
Rounded as it is, what each value loses is lost for good, the same way round after round. With error feedback
(Streaming DiLoCo and SparseLoCo do this) the server rounds its pseudo-gradient itself, onto the codec's grid
(swarm.averaging.codecs.grid_for), before the round: the rounded tensor goes through the codec unchanged, and
what was rounded off (the residual) is added to the server's next pseudo-gradient. Every value then arrives in
full over the rounds, some of it a round late.

Rounding in advance matters with hivemind's all-reduce: a member gets its own contribution back exactly and
the others' through the codec, so without it each member would apply its own rounding error alone and the
members' slow weights would part by it; with it, the reducers average the same values every member sent. The
mean then comes back rounded once more: with float8, each reducer rounds its part of the mean once and every
member takes that value (swarm.hivemind_internals.PolicyAllReduceRunner), so the members agree to the bit; with
the 16-bit codecs each member gets its own difference from the mean, rounded, and they agree to that rounding.

Pure tensors, no threads: the caller (LocalAverager, under the state's lock) says when a round took the
rounded tensor (commit), when it did not (discard: the residual waits for the next try), and when the
server's state was replaced (reset).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class ErrorFeedback:
    """The residual of one server's pseudo-gradients; `grid` rounds a tensor as the round's codec sends it (None:
    a lossless codec, nothing to keep)."""

    def __init__(self, grid: Callable[[torch.Tensor], torch.Tensor] | None):
        self.grid = grid
        self.residual: list[torch.Tensor] | None = None  # what earlier rounds' rounding left out, per parameter
        self._pending: list[torch.Tensor] | None = None  # the residual if the round being prepared takes place

    def prepare(self, delta: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(whole, sent) for a pseudo-gradient `delta` (its tensors are taken over and added to in place): whole is
        delta plus the residual (this server's pseudo-gradient with nothing left out, for an outer step taken
        alone), sent is whole rounded onto the grid (what goes to the round). The new residual, whole - sent, is
        kept until commit() or discard().

        A non-finite pseudo-gradient goes as it is and leaves the residual alone (the mean will not be finite: no
        member steps on it).
        """
        whole = list(delta)
        if self.residual is not None:
            with torch.no_grad():
                for w, r in zip(whole, self.residual):
                    w.add_(r)
        self._pending = None
        if self.grid is None or not all(bool(torch.isfinite(w).all()) for w in whole):
            return whole, whole
        sent = [self.grid(w).to(w.dtype) for w in whole]
        self._pending = [w - s for w, s in zip(whole, sent)]
        return whole, sent

    def commit(self) -> None:
        """The round took what prepare() sent: its residual is now what the next pseudo-gradient carries."""
        if self._pending is not None:
            self.residual, self._pending = self._pending, None

    def discard(self) -> None:
        """The round did not take it (failed, or no member stepped): the residual stays as it was."""
        self._pending = None

    def reset(self) -> None:
        """Nothing is owed: the whole pseudo-gradient went into an outer step, or the state was replaced."""
        self.residual, self._pending = None, None

    def norm(self) -> float:
        """The residual's L2 norm (0 when none is kept)."""
        if self.residual is None:
            return 0.0
        return float(torch.sqrt(sum((r.double() ** 2).sum() for r in self.residual)))
