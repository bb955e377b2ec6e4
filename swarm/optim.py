"""AdamW for one pipeline stage: warmup + cosine schedule, sample-sum gradient accumulation.

Every stage steps on its own, exactly as a swarm server does: callers backprop ``loss * n`` for
each micro-batch of ``n`` samples and report ``add_samples(n)``; at step time the summed gradient
is divided by the number of samples, so micro-batches of any size (and from any number of
trainers) add up to the same mean gradient a single big batch would give.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swarm.config import OptimizerConfig

if TYPE_CHECKING:
    from swarm.threads import Owner
    from swarm.zero import ShardedMoments

ADAMW_SLOTS = ("exp_avg", "exp_avg_sq", "step")  # AdamW's state of each parameter, once it stepped
# each optimizer's state of a parameter (NAdam also keeps the product of its momentum schedule)
SLOTS = {"adamw": ADAMW_SLOTS, "nadamw": (*ADAMW_SLOTS, "mu_product")}


class OptimizerError(RuntimeError):
    """The optimizer was used out of order (e.g. stepped with no accumulated samples)."""


def lr_at(step: int, opt_cfg: OptimizerConfig) -> float:
    """Learning rate for the step after ``step`` steps were taken.

    Linear warmup from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps`` steps, then
    cosine decay to ``min_lr`` at ``total_steps``, and ``min_lr`` afterwards.
    """
    warmup, total = opt_cfg.warmup_steps, opt_cfg.total_steps
    if step < warmup:
        return opt_cfg.lr * (step + 1) / warmup
    if step >= total:
        return opt_cfg.min_lr
    progress = (step - warmup) / (total - warmup)
    return opt_cfg.min_lr + 0.5 * (opt_cfg.lr - opt_cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices (dim >= 2, embeddings included, as in GPT-2) decay;
    vectors (biases, norm weights) don't, since shrinking them only distorts scale and offset."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_torch_optimizer(groups: list[dict[str, Any]], opt_cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer `opt_cfg.name` names; its learning rate is set before every step."""
    betas = (opt_cfg.beta1, opt_cfg.beta2)
    if opt_cfg.name == "nadamw":  # weight decay as AdamW's, apart from the moments
        return torch.optim.NAdam(groups, lr=lr_at(0, opt_cfg), betas=betas, eps=opt_cfg.eps,
                                 decoupled_weight_decay=True)
    return torch.optim.AdamW(groups, lr=lr_at(0, opt_cfg), betas=betas, eps=opt_cfg.eps)


class StageOptimizer:
    """AdamW over one stage's parameters, stepping once per ``batch_size`` accumulated samples."""

    def __init__(self, module: nn.Module, opt_cfg: OptimizerConfig):
        self.module = module
        self.config = opt_cfg
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = make_torch_optimizer(param_groups(module, opt_cfg.weight_decay), opt_cfg)
        self.slots = SLOTS[opt_cfg.name]
        self.step_count = 0
        self.samples = 0  # accumulated since the last step
        self.shards: ShardedMoments | None = None  # the moments, when sharded among the stage's servers
        self.owner: Owner | None = None  # the thread that may change it, when it is a StageState's (swarm.threads)

    def _mutating(self, what: str) -> None:
        if self.owner is not None:
            self.owner.check(what)

    def add_samples(self, n: int) -> None:
        """Record that gradients of ``n`` more samples were summed into ``.grad``."""
        self._mutating("add_samples")
        if n <= 0:
            raise ValueError(f"sample count must be positive, got {n}")
        self.samples += n

    def accumulate(self, grads: Sequence[torch.Tensor | None], n: int, awaited: bool = False,
                   predicted: bool = False) -> int:
        """Add the gradient sums of ``n`` more samples, one tensor per parameter (None: no gradient); returns the
        step they count towards, always the next (`awaited` and `predicted`: StageStepper's; a server alone adds
        every sample to its batch until it steps)."""
        self._mutating("accumulate")
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        if n <= 0:
            raise ValueError(f"sample count must be positive, got {n}")
        self.add_samples(n)
        with torch.no_grad():
            for param, grad in zip(self.params, grads):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        return 1

    def samples_to_step(self) -> int | None:
        """Samples this batch still needs (StageStepper)."""
        return max(0, self.config.batch_size - self.samples)

    @property
    def ready(self) -> bool:
        """Whether the stage has accumulated a full batch."""
        return self.samples >= self.config.batch_size

    @property
    def closes_batch(self) -> bool:
        """StageStepper's: a step here always closes a batch."""
        return True

    def step(self) -> dict[str, Any]:
        """Average, clip, step AdamW and zero grads; skips (and says so) on non-finite gradients."""
        if self.samples <= 0:
            raise OptimizerError("step() with no accumulated samples; call add_samples(n) after backward")
        grads, samples = self.take_gradients()
        with torch.no_grad():
            for g in grads:
                if g is not None:
                    g.div_(samples)
        return self.step_with(grads, samples)

    def take_gradients(self) -> tuple[list[torch.Tensor | None], int]:
        """Hand over the accumulated gradient sums and their sample count; accumulation starts afresh.

        For steppers that step later, on another thread's schedule, while new samples accumulate.
        """
        self._mutating("take_gradients")
        grads, samples = [p.grad for p in self.params], self.samples
        self.zero_grad()
        return grads, samples

    def step_with(self, mean_grads: Sequence[torch.Tensor | None], samples: int) -> dict[str, Any]:
        """Clip and step AdamW on `mean_grads` (one per parameter, None: none), the mean over `samples`.

        The gradients being accumulated meanwhile are left as they are. The tensors given may be
        changed in place (clipping).
        """
        self._mutating("step_with")
        if len(mean_grads) != len(self.params):
            raise ValueError(f"got {len(mean_grads)} gradients for {len(self.params)} parameters")
        grads = [g for g in mean_grads if g is not None]
        grad_norm = _total_norm(grads)
        lr = self.learning_rate(samples)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            if self.config.grad_clip > 0 and grad_norm > self.config.grad_clip:
                scale = self.config.grad_clip / (grad_norm + 1e-6)
                for g in grads:
                    g.mul_(scale)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            accumulating = [p.grad for p in self.params]
            for param, grad in zip(self.params, mean_grads):  # AdamW reads .grad
                param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
            try:
                self.optimizer.step()
            finally:
                for param, grad in zip(self.params, accumulating):
                    param.grad = grad
            self.step_count += 1
        return {
            "step": self.step_count,
            "lr": lr,
            "grad_norm": grad_norm,
            "samples": samples,
            "skipped": skipped,
        }

    def learning_rate(self, samples: int | None = None) -> float:
        """The next step's learning rate: the schedule's, by steps taken. `samples`: how many samples that step
        averages (None: not known yet, as at a preview); the schedule does not depend on it, but a variant
        may (bench/staleness.py's `+sqrt` and `+bysamples`)."""
        return lr_at(self.step_count, self.config)

    def preview(self, grads: Sequence[torch.Tensor | None], samples: int = 1) -> list[torch.Tensor]:
        """The parameters :meth:`step_with` would make from the mean gradient ``grads / samples``, changing
        nothing (look-ahead; `grads` are not changed either).

        The same clipping, learning rate, weight decay, moments and bias corrections as the step; one
        parameter-sized tensor per parameter is made (those without a gradient are returned as they are).
        """
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        cfg = self.config
        norm = _total_norm([g for g in grads if g is not None]) / samples
        if not math.isfinite(norm):
            return [p.detach().clone() for p in self.params]  # the step will be skipped: nothing moves
        clip = cfg.grad_clip / (norm + 1e-6) if cfg.grad_clip > 0 and norm > cfg.grad_clip else 1.0
        clip /= samples
        mean_grads = grads
        lr, (beta1, beta2) = self.learning_rate(), (cfg.beta1, cfg.beta2)
        decay = {id(p): group["weight_decay"] for group in self.optimizer.param_groups for p in group["params"]}
        ahead = []
        with torch.no_grad():
            for param, grad in zip(self.params, mean_grads):
                if grad is None:
                    ahead.append(param.detach().clone())
                    continue
                g = grad.to(device=param.device, dtype=torch.float32) * clip
                state = self.optimizer.state.get(param, {})
                t = float(state["step"]) + 1 if "step" in state else 1.0
                m = state["exp_avg"] * beta1 + g * (1 - beta1) if "exp_avg" in state else g * (1 - beta1)
                v = state["exp_avg_sq"] * beta2 + g * g * (1 - beta2) if "exp_avg_sq" in state else \
                    g * g * (1 - beta2)
                w = param.detach().float() * (1 - lr * decay[id(param)])
                if cfg.name == "nadamw":
                    mu, mu_next = _nadam_mu(beta1, t), _nadam_mu(beta1, t + 1)
                    product = float(state.get("mu_product", 1.0)) * mu
                    denom = (v / (1 - beta2**t)).sqrt_().add_(cfg.eps)
                    w -= g / denom * (lr * (1 - mu) / (1 - product))
                    w -= m / denom * (lr * mu_next / (1 - product * mu_next))
                else:
                    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(cfg.eps)
                    w -= m / denom * (lr / (1 - beta1**t))
                ahead.append(w.to(param.dtype))
        return ahead

    def step_sharded(self, update: torch.Tensor, samples: int, grad_norm: float) -> dict[str, Any]:
        """Apply a sharded round's AdamW update (flat, in ``params`` order; swarm.zero):
        ``p = p * (1 - lr * weight_decay) - lr * u``, as torch.optim.AdamW does (zero runs AdamW only)."""
        self._mutating("step_sharded")
        lr = lr_at(self.step_count, self.config)
        decay = {id(p): group["weight_decay"] for group in self.optimizer.param_groups for p in group["params"]}
        sizes = [p.numel() for p in self.params]
        if update.numel() != sum(sizes):
            raise ValueError(f"an update of {update.numel()} elements for {sum(sizes)} parameters")
        with torch.no_grad():
            for param, part in zip(self.params, update.split(sizes)):
                if decay[id(param)]:
                    param.mul_(1 - lr * decay[id(param)])
                param.add_(part.view(param.shape).to(device=param.device, dtype=param.dtype), alpha=-lr)
        self.step_count += 1
        return {"step": self.step_count, "lr": lr, "grad_norm": grad_norm, "samples": samples, "skipped": False}

    def state_bytes(self) -> int:
        """Bytes of AdamW moments this replica holds in torch's optimizer (not sharded ones)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)

    def zero_grad(self) -> None:
        """Drop accumulated gradients and the sample count (e.g. after a failed round)."""
        self._mutating("zero_grad")
        self.optimizer.zero_grad(set_to_none=True)
        self.samples = 0

    def moments(self) -> dict[str, torch.Tensor]:
        """AdamW's state by ``<parameter index>/<slot>`` (the tensors themselves, not copies)."""
        state = self.optimizer.state
        return {f"{i}/{slot}": torch.as_tensor(state[p][slot]) for i, p in enumerate(self.params) if p in state
                for slot in self.slots}

    def load_moments(self, moments: dict[str, torch.Tensor], step_count: int) -> None:
        """Replace the optimizer's state with `moments` (as :meth:`moments` names them) and the step count.

        Gradients being accumulated and the sample count are kept. The caller checks names and shapes.
        """
        self._mutating("load_moments")
        # torch numbers parameters in param-group order; ours are in module order
        order = {id(p): k for k, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in moments.items():
            index, slot = key.split("/")
            state.setdefault(order[id(self.params[int(index)])], {})[slot] = tensor
        if "mu_product" in self.slots:  # NAdam's is a function of the step: taken as sent only where it is that
            for slots in state.values():  # (to float32's rounding, which torch accumulates it in)
                if "step" in slots:
                    expected = nadam_mu_product(self.config.beta1, max(0, int(float(slots["step"]))))
                    sent = slots.get("mu_product")
                    if sent is None or not math.isclose(float(sent), expected, rel_tol=1e-4, abs_tol=1e-30):
                        slots["mu_product"] = torch.tensor(expected, dtype=torch.float32)
        groups = self.optimizer.state_dict()["param_groups"]
        # torch casts each moment to its parameter's device and dtype (and keeps `step` as it is)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.step_count = int(step_count)

    def state_dict(self) -> dict[str, Any]:
        """Step count and AdamW state; parameters travel with the module's own state_dict."""
        return {"step_count": self.step_count, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mutating("load_state_dict")
        self.step_count = int(state["step_count"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.zero_grad()


NADAM_MOMENTUM_DECAY = 4e-3  # torch.optim.NAdam's default psi, which StageOptimizer uses


def _nadam_mu(beta1: float, t: float) -> float:
    """NAdam's momentum coefficient at step t (Dozat's schedule, as torch.optim.NAdam computes it)."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (t * NADAM_MOMENTUM_DECAY))


def nadam_mu_product(beta1: float, steps: int) -> float:
    """The product of NAdam's momentum coefficients over its first `steps` steps (what torch keeps as mu_product)."""
    product = 1.0
    for t in range(1, int(steps) + 1):  # each factor is below 0.6 for the first thousand steps: the product is
        product *= _nadam_mu(beta1, t)  # below 1e-30 (1 - it is 1 exactly) within ~150, however large `steps` is
        if product < 1e-30:
            return 0.0
    return product


def _total_norm(grads: list[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
    return float(torch.linalg.vector_norm(norms))
