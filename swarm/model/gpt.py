"""A GPT-style decoder assembled from parts that can be built one at a time.

The model has three kinds of part: an :class:`Embedding` (tokens plus learned positions),
``n_layer`` pre-norm :class:`Block` s, and a :class:`Head` (final norm, LM head, loss). Each part
is made by a ``make_*`` function that initializes it from its own random generator, seeded by
(model seed, part, index). A pipeline stage can therefore build only its own parts and still equal
the same slice of a full model. Nothing here touches the global RNG.

With ``model.moe`` set, the blocks ``ModelConfig.is_moe_layer`` selects have a
:class:`~swarm.model.moe.MoEFeedForward` as their ``mlp``. Each expert is a part of its own
(:func:`make_expert`, generator (seed, "expert", layer * num_experts + e)), so its initial weights
do not depend on whether a block or an expert host builds it.

The LM head is not tied to the token embedding: they live on different pipeline stages.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from swarm.config import ModelConfig
from swarm.model.moe import Expert, MoEFeedForward

INIT_STD = 0.02  # GPT-2's std for every Linear and Embedding weight

M = TypeVar("M", bound=nn.Module)


class Embedding(nn.Module):
    """Token plus learned position embedding: token ids [B, T] -> hidden states [B, T, D]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        # [B, T, D] -> [B, heads, T, head_dim], the layout scaled_dot_product_attention expects
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.drop(self.out(y.transpose(1, 2).reshape(B, T, D)))


class MLP(nn.Module):
    """Position-wise feed-forward network: D -> mlp_ratio * D -> GELU -> D."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).

    ``mlp`` is the dense :class:`MLP` unless given (an :class:`MoEFeedForward` for an MoE block).
    """

    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg) if mlp is None else mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def residual_projections(self) -> tuple[nn.Linear, ...]:
        """The layers whose outputs are added to the residual stream (their init is scaled down).

        An MoE block's experts are parts of their own and scale their down projections themselves.
        """
        if isinstance(self.mlp, MLP):
            return self.attn.out, self.mlp.down
        return (self.attn.out,)


class Head(nn.Module):
    """Final LayerNorm and LM head: hidden [B, T, D] -> logits [B, T, V], or the mean loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.proj(self.ln(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_embedding(cfg: ModelConfig) -> Embedding:
    """The token and position embeddings, initialized from the generator of (seed, "embed")."""
    return _materialize(lambda: Embedding(cfg), cfg, "embed", 0)


def make_block(cfg: ModelConfig, index: int) -> Block:
    """Block `index` of the model, initialized from the generator of (seed, "block", index).

    An MoE block's router draws from that generator too (after the attention and norms); each of its
    experts from its own, exactly as :func:`make_expert` builds it.
    """
    if not 0 <= index < cfg.n_layer:
        raise ValueError(f"block index must be in 0..{cfg.n_layer - 1}, got {index}")
    if not cfg.is_moe_layer(index):
        return _materialize(lambda: Block(cfg), cfg, "block", index)
    block = _materialize(lambda: Block(cfg, _moe_ffn(cfg, index)), cfg, "block", index, skip=Expert)
    for e, expert in enumerate(block.mlp.experts or ()):  # none with model.moe.expert_servers
        _initialize(expert, cfg, "expert", _expert_part(cfg, index, e))
    return block


def make_expert(cfg: ModelConfig, layer: int, expert: int) -> Expert:
    """Expert `expert` of MoE block `layer`, from the generator of (seed, "expert", layer * num_experts + expert)."""
    if not cfg.is_moe_layer(layer):
        raise ValueError(f"block {layer} is not a mixture of experts (model.moe selects blocks {cfg.moe_layers()})")
    if not 0 <= expert < cfg.moe.num_experts:
        raise ValueError(f"expert index must be in 0..{cfg.moe.num_experts - 1}, got {expert}")
    return _materialize(lambda: Expert(cfg.d_model, cfg.expert_hidden), cfg, "expert",
                        _expert_part(cfg, layer, expert))


def _moe_ffn(cfg: ModelConfig, index: int) -> MoEFeedForward:
    moe = cfg.moe
    # On expert servers, the block holds the router only: its experts are built there (make_expert).
    experts = moe.num_experts if moe.expert_servers else [Expert(cfg.d_model, cfg.expert_hidden)
                                                          for _ in range(moe.num_experts)]
    return MoEFeedForward(cfg.d_model, experts, moe.top_k, moe.capacity_factor, layer=index, dropout=cfg.dropout)


def _expert_part(cfg: ModelConfig, layer: int, expert: int) -> int:
    return layer * cfg.moe.num_experts + expert


def make_head(cfg: ModelConfig) -> Head:
    """The final norm and LM head, initialized from the generator of (seed, "head")."""
    return _materialize(lambda: Head(cfg), cfg, "head", 0)


class GPT(nn.Module):
    """The whole decoder in one process: ``embed``, ``blocks``, ``head``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.embed = make_embedding(cfg)
        self.blocks = nn.ModuleList(make_block(cfg, k) for k in range(cfg.n_layer))
        self.head = make_head(cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy loss over all tokens if `targets` is given, else logits [B, T, V]."""
        check_tokens(idx, self.config)
        if targets is not None:
            check_targets(targets, idx.shape[0], idx.shape[1], self.config)
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets)


def _part_seed(seed: int, part: str, index: int) -> int:
    # A hash rather than arithmetic on the seed: no two (seed, part, index) can collide, and the
    # value is the same in every process (unlike Python's salted hash()).
    digest = hashlib.sha256(f"swarm-init/{seed}/{part}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _materialize(build: Callable[[], M], cfg: ModelConfig, part: str, index: int,
                 skip: type[nn.Module] | None = None) -> M:
    # Construct on the meta device so PyTorch's default init draws nothing from the global RNG,
    # then fill every parameter from this part's own generator, in registration order.
    with torch.device("meta"):
        module = build()
    module.to_empty(device="cpu")
    _initialize(module, cfg, part, index, skip)
    return module


def _initialize(module: nn.Module, cfg: ModelConfig, part: str, index: int,
                skip: type[nn.Module] | None = None) -> None:
    # Submodules of type `skip` (with all they hold) are parts of their own, left for their own generator.
    gen = torch.Generator().manual_seed(_part_seed(cfg.seed, part, index))
    residual = module.residual_projections() if isinstance(module, (Block, Expert)) else ()
    residual_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
    skipped = set()
    if skip is not None:
        skipped = {id(m) for outer in module.modules() if isinstance(outer, skip) for m in outer.modules()}
    with torch.no_grad():
        for m in module.modules():
            if id(m) in skipped:
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                std = residual_std if any(m is r for r in residual) else INIT_STD
                m.weight.normal_(0.0, std, generator=gen)
            elif isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()


def check_tokens(x: object, cfg: ModelConfig, what: str = "token ids") -> None:
    """Raise ValueError unless `x` is an int64 tensor [B, T], B > 0, T in 1..seq_len, ids in vocab."""
    x = _check_layout(x, 2, "[batch, seq]", cfg, what)
    if x.dtype != torch.int64:
        raise ValueError(f"{what} must have dtype torch.int64 (long), got {x.dtype}")
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"{what} must lie in [0, {cfg.vocab_size}) (vocab_size), got values in [{lo}, {hi}]")


def check_targets(targets: torch.Tensor, batch: int, seq: int, cfg: ModelConfig) -> None:
    """Raise ValueError unless `targets` are valid token ids of shape [batch, seq]."""
    check_tokens(targets, cfg, "targets")
    if tuple(targets.shape) != (batch, seq):
        raise ValueError(f"targets must have the input's shape [{batch}, {seq}], got {list(targets.shape)}")


def check_hidden(x: object, cfg: ModelConfig) -> None:
    """Raise ValueError unless `x` is a finite float tensor [B, T, d_model], B > 0, T in 1..seq_len."""
    x = _check_layout(x, 3, "[batch, seq, d_model]", cfg, "hidden states")
    if not x.dtype.is_floating_point:
        raise ValueError(f"hidden states must be a floating-point tensor, got {x.dtype}")
    if x.shape[2] != cfg.d_model:
        raise ValueError(f"hidden states must have last dimension d_model={cfg.d_model}, got {x.shape[2]}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("hidden states contain NaN or infinite values")


def _check_layout(x: object, rank: int, layout: str, cfg: ModelConfig, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{what} must be {rank}-D {layout}, got shape {list(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"{what} must have a batch size of at least 1, got shape {list(x.shape)}")
    if not 1 <= x.shape[1] <= cfg.seq_len:
        raise ValueError(f"{what} sequence length must be in 1..{cfg.seq_len} (seq_len), got {x.shape[1]}")
    return x
