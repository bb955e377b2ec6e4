"""Pipeline stages: contiguous slices of the GPT that servers host one at a time.

With S stages over n_layer blocks, stage i holds blocks [i * n_layer/S, (i+1) * n_layer/S); stage 0
also holds the embedding and stage S-1 also holds the head (a single stage holds everything).

Parameter names in ``StageModule.state_dict()`` are ``embed.*`` (first stage only),
``blocks.<j>.*`` with ``j`` counted from 0 *within the stage*, and ``head.*`` (last stage only).
:meth:`StageModule.full_model_name` maps them to the names of the unsplit :class:`GPT`. An MoE
block's ``mlp`` holds ``router.weight`` and ``experts.<e>.{up,down}.{weight,bias}``.

With ``model.moe``, an MoE block is either the last block of a non-last stage or in the last stage
(:func:`swarm.config.check_moe_placement`, enforced when a stage is assembled). A stage's MoE
layers report their aux losses through :func:`swarm.model.moe.record_moe`, not its output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from swarm.config import ModelConfig, RunConfig, check_moe_placement
from swarm.model.gpt import (
    GPT,
    Block,
    Embedding,
    Head,
    check_hidden,
    check_targets,
    check_tokens,
    make_block,
    make_embedding,
    make_head,
)


def stage_layers(n_layer: int, num_stages: int, index: int) -> range:
    """Global indices of the blocks stage `index` holds; ValueError if the split is impossible."""
    _check_split(n_layer, num_stages)
    if not 0 <= index < num_stages:
        raise ValueError(f"stage index must be in 0..{num_stages - 1}, got {index}")
    per_stage = n_layer // num_stages
    return range(index * per_stage, (index + 1) * per_stage)


class StageModule(nn.Module):
    """One pipeline stage: tokens or hidden states in; hidden states, or the loss on the last stage, out."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        num_stages: int,
        blocks: list[Block],
        embed: Embedding | None = None,
        head: Head | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.index = index
        self.num_stages = num_stages
        self.layers = stage_layers(cfg.n_layer, num_stages, index)
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        if (embed is not None) != self.is_first:
            raise ValueError(f"stage {index}: the embedding belongs to the first stage and only to it")
        if (head is not None) != self.is_last:
            raise ValueError(f"stage {index}: the head belongs to the last stage and only to it")
        if len(blocks) != len(self.layers):
            raise ValueError(f"stage {index} must hold {len(self.layers)} blocks, got {len(blocks)}")
        # Registration order fixes state_dict order: embed, blocks, head.
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    @property
    def expects_tokens(self) -> bool:
        """True if the input is token ids [B, T] (int64), False if hidden states [B, T, d_model]."""
        return self.is_first

    @property
    def needs_targets(self) -> bool:
        """True if forward needs targets [B, T] and returns the loss."""
        return self.is_last

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Raise ValueError, saying what is wrong, unless (x, targets) is a valid request for this stage."""
        if self.expects_tokens:
            check_tokens(x, self.config)
        else:
            check_hidden(x, self.config)
        if self.needs_targets:
            if targets is None:
                raise ValueError(
                    f"stage {self.index} of {self.num_stages} is the last stage: it computes the loss "
                    "and needs targets [batch, seq]"
                )
            check_targets(targets, x.shape[0], x.shape[1], self.config)
        elif targets is not None:
            raise ValueError(f"stage {self.index} of {self.num_stages} is not the last: it takes no targets")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Validate the input, then return hidden states [B, T, D], or the mean loss on the last stage."""
        self.check_input(x, targets)
        if self.is_first:
            h = self.embed(x)
        else:
            # Activations may arrive in a narrower wire dtype; compute in the parameters' dtype.
            h = x.to(self.blocks[0].ln1.weight.dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets) if self.is_last else h

    @property
    def moe_layers(self) -> list[int]:
        """Global indices of this stage's MoE blocks (each adds an aux loss to the stage's objective)."""
        return [k for k in self.layers if self.config.is_moe_layer(k)]

    def full_model_name(self, name: str) -> str:
        """The name in the unsplit GPT of this stage's parameter `name` (``blocks.j`` -> global index)."""
        parts = name.split(".")
        if parts[0] == "blocks":
            parts[1] = str(self.layers[int(parts[1])])
        return ".".join(parts)

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}, blocks {self.layers.start}..{self.layers.stop - 1}"


def split_model(model: GPT, num_stages: int) -> list[StageModule]:
    """Cut a full model into `num_stages` stages that share (not copy) its modules."""
    cfg = model.config
    _check_split(cfg.n_layer, num_stages)
    return [
        _assemble(cfg, i, num_stages, lambda: model.embed, model.blocks.__getitem__, lambda: model.head)
        for i in range(num_stages)
    ]


def build_stage(config: RunConfig, index: int) -> StageModule:
    """Build only stage `index`; equal, parameter for parameter, to that slice of ``GPT(config.model)``."""
    cfg = config.model
    cfg.validate()
    return _assemble(
        cfg,
        index,
        config.stages.num_stages,
        partial(make_embedding, cfg),
        partial(make_block, cfg),
        partial(make_head, cfg),
    )


def build_stages(config: RunConfig) -> list[StageModule]:
    """All stages of the run, each built on its own (as separate servers would)."""
    return [build_stage(config, i) for i in range(config.stages.num_stages)]


def _assemble(
    cfg: ModelConfig,
    index: int,
    num_stages: int,
    embed: Callable[[], Embedding],
    block: Callable[[int], Block],
    head: Callable[[], Head],
) -> StageModule:
    # The one place that decides which parts a stage holds; the callables either build a part
    # (build_stage) or hand over an existing one (split_model), and are called only when needed.
    layers = stage_layers(cfg.n_layer, num_stages, index)
    check_moe_placement(cfg, num_stages)
    return StageModule(
        cfg,
        index,
        num_stages,
        blocks=[block(k) for k in layers],
        embed=embed() if index == 0 else None,
        head=head() if index == num_stages - 1 else None,
    )


def _check_split(n_layer: int, num_stages: int) -> None:
    if num_stages < 1 or n_layer % num_stages:
        raise ValueError(
            f"num_stages ({num_stages}) must be a positive divisor of n_layer ({n_layer}) "
            "so every stage holds the same number of blocks"
        )
