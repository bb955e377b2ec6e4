"""The single-process reference trainer: the baseline every swarm run is compared with.

It does what a swarm does, minus the network: the model is split into the same stage modules, each
stage has its own :class:`~swarm.optim.StageOptimizer` (own gradient clipping, sample-sum
accumulation), and micro-batches flow through the stages in order. A swarm run with one server
per stage and one trainer should therefore follow this trainer's loss curve closely.

With ``model.moe``, each micro-batch of ``n`` samples backpropagates
``(CE + aux_loss_weight * sum of the MoE layers' aux losses) * n``; the reported ``loss`` stays the
cross-entropy, comparable with dense runs, and ``aux_loss`` (the sum over layers, before weighting)
and ``dropped`` (the share of top-k slots over capacity) are reported beside it.

With ``model.moe.expert_servers``, the experts are kept apart from the stages, as expert servers
keep them: each expert has its own optimizer (own clipping, its own sample count, stepping with
the stages), exactly what :class:`swarm.experts.ExpertHost` does for the experts it hosts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.backend import autocast, resolve_compute_dtype
from swarm.config import RunConfig
from swarm.data import BatchSampler, DataError, eval_batches, load_tokenizer, load_tokens, sampler_seed
from swarm.model import build_stages, make_expert, record_moe, total_aux_loss
from swarm.model.moe import LocalExperts, MoEFeedForward
from swarm.optim import StageOptimizer

FINAL_LOSS_WINDOW = 5  # final_loss averages this many last steps, so one noisy batch doesn't decide it
EVAL_BATCHES = 20


class ReferenceTrainer:
    """Trains all stages of one run in this process, the way a swarm would."""

    def __init__(self, config: RunConfig, trainer_index: int = 0, device: str | torch.device = "cpu",
                 trainers: int = 1, order_seed: int | None = None):
        """`trainers`: draw micro-batches in turn from the windows of that many trainers (indices from
        `trainer_index` on), as a swarm of them takes its samples: a comparison with that swarm then trains on
        the same windows (other windows alone move tiny.yaml's loss by up to 6%; bench/convergence.py).
        `order_seed`: the next micro-batch's trainer drawn at random instead (seeded), so micro-batches fall into
        other steps, as in a swarm whose trainers are not in lockstep."""
        self.config = config
        self.device = torch.device(device)
        self.compute_dtype = resolve_compute_dtype(config.stages.compute_dtype, self.device)  # as a server's
        tokenizer = load_tokenizer(config.data)
        if tokenizer.vocab_size > config.model.vocab_size:
            raise DataError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{config.model.vocab_size}; raise model.vocab_size"
            )
        self.stages = [stage.to(self.device) for stage in build_stages(config)]
        self.optimizers = [StageOptimizer(stage, config.optimizer) for stage in self.stages]
        self.experts: list[torch.nn.Module] = []
        moe = config.model.moe
        if moe is not None and moe.expert_servers:  # the experts, as expert servers hold them
            experts = {layer: [make_expert(config.model, layer, e).to(self.device) for e in range(moe.num_experts)]
                       for layer in config.model.moe_layers()}
            runner = LocalExperts(experts)
            for stage in self.stages:
                for module in stage.modules():
                    if isinstance(module, MoEFeedForward):
                        module.runner = runner
            self.experts = [expert for layer in experts.values() for expert in layer]
            self.optimizers += [StageOptimizer(expert, config.optimizer) for expert in self.experts]
        self.train_tokens = load_tokens(config.data, "train", tokenizer)
        self.val_tokens = load_tokens(config.data, "val", tokenizer)
        if trainers < 1:
            raise ValueError(f"trainers must be at least 1, got {trainers}")
        self.samplers = [BatchSampler(self.train_tokens, config.model.seq_len, config.optimizer.micro_batch_size,
                                      seed=sampler_seed(config.data.seed, trainer_index + i)) for i in range(trainers)]
        self.sampler = self.samplers[0]
        self._turn = 0  # the trainer whose micro-batch comes next
        self._order = None if order_seed is None else torch.Generator().manual_seed(order_seed)

    @property
    def step_count(self) -> int:
        return self.optimizers[0].step_count

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one batch through the chained stages, in the run's compute dtype."""
        hidden = x.to(self.device)
        with autocast(self.device, self.compute_dtype):
            for stage in self.stages[:-1]:
                hidden = stage(hidden)
            return self.stages[-1](hidden, targets=y.to(self.device))

    def loss_and_moe(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """(mean cross-entropy, sum of the MoE layers' aux losses or None for a dense model, share of
        top-k slots dropped by capacity) of one batch."""
        with record_moe() as records:
            loss = self.loss(x, y)
        slots = sum(r.plan.status.numel() for r in records)
        dropped = sum(r.plan.dropped() for r in records) / slots if slots else 0.0
        return loss, total_aux_loss(records), dropped

    def train_step(self) -> dict[str, Any]:
        """Accumulate micro-batches until every stage has a full batch, then step every stage (and expert)."""
        for stage in self.stages:
            stage.train()
        moe = self.config.model.moe
        losses, aux_losses, dropped, samples = [], [], [], 0
        while not all(opt.ready for opt in self.optimizers):
            x, y = self.samplers[self._turn].next_batch()
            if self._order is None:
                self._turn = (self._turn + 1) % len(self.samplers)
            else:
                self._turn = int(torch.randint(len(self.samplers), (1,), generator=self._order))
            n = x.shape[0]
            loss, aux, drop_share = self.loss_and_moe(x, y)
            objective = loss if aux is None else loss + moe.aux_loss_weight * aux
            # Sum over samples, as servers do, so the optimizer can divide by the true count.
            (objective * n).backward()
            for opt in self.optimizers:
                opt.add_samples(n)
            losses.append(loss.item())
            if aux is not None:
                aux_losses.append(aux.item())
                dropped.append(drop_share)
            samples += n
        stats = [opt.step() for opt in self.optimizers]
        result = {
            "step": self.step_count,
            "loss": sum(losses) / len(losses),
            "samples": samples,
            "lr": stats[0]["lr"],
            "grad_norms": [s["grad_norm"] for s in stats],
            "skipped": any(s["skipped"] for s in stats),
        }
        if aux_losses:  # MoE runs only, so a dense run's stats are as they were
            result["aux_loss"] = sum(aux_losses) / len(aux_losses)
            result["dropped"] = sum(dropped) / len(dropped)
        return result

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = EVAL_BATCHES) -> float:
        """Mean validation loss over fixed windows (the same windows on every call)."""
        for stage in self.stages:
            stage.eval()
        seq_len, batch_size = self.config.model.seq_len, self.config.optimizer.micro_batch_size
        total, count = 0.0, 0
        try:
            for x, y in eval_batches(self.val_tokens, seq_len, batch_size, max_batches):
                total += self.loss(x, y).item() * x.shape[0]
                count += x.shape[0]
        finally:
            for stage in self.stages:
                stage.train()
        if count == 0:
            raise DataError(
                f"the validation split has {len(self.val_tokens)} tokens, too few for one window of "
                f"seq_len={self.config.model.seq_len}"
            )
        return total / count

    def run(
        self,
        steps: int,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        eval_max_batches: int | None = EVAL_BATCHES,
    ) -> dict[str, Any]:
        """Train ``steps`` steps, then evaluate; returns the summary ``swarm-local`` also writes.

        ``samples_per_second`` counts training time only; ``wall_seconds`` includes the final
        evaluation. ``on_progress`` receives every step's stats dict.
        """
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        start = time.perf_counter()
        losses, aux_losses, samples = [], [], 0
        for _ in range(steps):
            stats = self.train_step()
            losses.append(stats["loss"])
            if "aux_loss" in stats:
                aux_losses.append(stats["aux_loss"])
            samples += stats["samples"]
            if on_progress is not None:
                on_progress(stats)
        train_seconds = time.perf_counter() - start
        val_loss = self.evaluate(eval_max_batches)
        last = losses[-FINAL_LOSS_WINDOW:]
        moe = {}
        if aux_losses:
            moe = {"initial_aux_loss": aux_losses[0],
                   "final_aux_loss": sum(aux_losses[-FINAL_LOSS_WINDOW:]) / len(aux_losses[-FINAL_LOSS_WINDOW:])}
        return {
            "initial_loss": losses[0],
            "final_loss": sum(last) / len(last),
            "val_loss": val_loss,
            "steps": steps,
            "samples": samples,
            "samples_per_second": samples / train_seconds if train_seconds > 0 else 0.0,
            "train_seconds": train_seconds,
            "wall_seconds": time.perf_counter() - start,
            **moe,
        }
