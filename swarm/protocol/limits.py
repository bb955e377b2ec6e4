"""How large a stage message of a given run may be: the WireLimits a stage server takes in.

The defaults in `framing.DEFAULT_LIMITS` fit any model, which makes them loose: 256 MiB a request
lets a handful of peers hold gigabytes of a small server's memory. A server knows its run's model,
so it takes no more than its largest honest request.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import ModelConfig, RunConfig
from swarm.protocol.framing import DEFAULT_LIMITS, WireLimits

STAGE_TENSORS = 2  # the most a stage request carries: inputs plus targets or grad_outputs
FLOAT_BYTES = 4  # float32, the widest wire dtype of hidden states and their gradients
INT_BYTES = 8  # int64, the widest encoding of token ids and targets


def stage_wire_limits(model: ModelConfig, max_batch: int) -> WireLimits:
    """The limits of a stage server of `model` that takes micro-batches of up to `max_batch` samples.

    The largest tensor a stage exchanges is hidden states (or their gradient) of
    [max_batch, seq_len, d_model] in float32; token ids and targets [max_batch, seq_len] are
    smaller unless d_model is 1 (int64 is 8 bytes). A request carries two such tensors at most,
    plus its metadata.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    positions = max_batch * model.seq_len
    tensor_bytes = positions * max(FLOAT_BYTES * model.d_model, INT_BYTES)
    return WireLimits(
        max_message_bytes=STAGE_TENSORS * tensor_bytes + DEFAULT_LIMITS.max_metadata_bytes,
        max_tensor_elements=positions * model.d_model,
        max_tensors=STAGE_TENSORS,
        max_metadata_bytes=DEFAULT_LIMITS.max_metadata_bytes,
        part_bytes=DEFAULT_LIMITS.part_bytes,
    )


@dataclass(frozen=True)
class RequestLimits:
    """How large a request of a run may be, computed once from its config and shared by both sides of the
    wire contract: callers take replies within these limits, servers refuse requests beyond them.

    `samples`: the samples a stage request carries (the run's micro-batch, unless a server says otherwise);
    an expert request holds at most top_k slots of each token of such a micro-batch.
    """

    model: ModelConfig
    samples: int
    top_k: int = 0  # the run's MoE top_k (0: no experts)

    @classmethod
    def of(cls, config: RunConfig, max_batch: int | None = None) -> RequestLimits:
        moe = config.model.moe
        return cls(config.model, max_batch if max_batch is not None else config.optimizer.micro_batch_size,
                   moe.top_k if moe is not None else 0)

    @property
    def stage(self) -> WireLimits:
        """A stage call's request (server side) or reply (caller side)."""
        return stage_wire_limits(self.model, self.samples)

    @property
    def expert(self) -> WireLimits:
        """An expert call's: top_k slots of each token of a micro-batch."""
        if self.top_k < 1:
            raise ValueError("the run has no mixture-of-experts blocks: expert calls have no limits")
        return stage_wire_limits(self.model, self.samples * self.top_k)
