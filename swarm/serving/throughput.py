"""What a server announces as its speed: forward + backward timed on a copy of what it hosts, so the
measurement leaves no gradient behind. Stage servers announce samples/s, expert servers tokens/s."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from swarm.backend import StageBackend, autocast
from swarm.config import RunConfig
from swarm.experts import ExpertHost
from swarm.model.moe import MoEFeedForward


def best_rate(items: int, run: Callable[[], None], repeats: int = 3, device: torch.device | None = None) -> float:
    """`items` per second of the fastest of `repeats` runs of `run`, after one that warms up allocators and
    kernels (and CUDA work waited for, on a GPU)."""
    timings = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        run()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return items / min(timings[1:])


def _no_experts(layer: int, u: torch.Tensor, plan):
    """A stand-in for expert servers while timing the stage alone: outputs 0 (the stage's own compute)."""
    return u.new_zeros(*plan.experts.shape, u.shape[-1]) * u.sum(), plan


def stage_throughput(backend: StageBackend, config: RunConfig, repeats: int = 3) -> float:
    """Samples per second of forward + backward on one micro-batch of the stage.

    It times what a request costs: in the backend's compute dtype, and with the forward run once (graph
    kept for the backward) when the backend keeps graphs, twice (recomputed) when it does not.
    """
    module = copy.deepcopy(backend.module)
    for block in module.modules():  # experts on expert servers are not this stage's compute
        if isinstance(block, MoEFeedForward) and block.experts is None:
            block.runner = _no_experts
    n, t = config.optimizer.micro_batch_size, config.model.seq_len
    if module.is_first:
        x = torch.randint(0, config.model.vocab_size, (n, t), device=backend.device)
    else:
        x = torch.randn(n, t, config.model.d_model, device=backend.device)
    targets = torch.randint(0, config.model.vocab_size, (n, t), device=backend.device) if module.is_last else None
    recompute = backend.cache is None and not module.is_last

    def run() -> None:
        with autocast(backend.device, backend.compute_dtype):
            if recompute:
                with torch.no_grad():
                    module(x, targets)
            x_grad = x.float().requires_grad_(True) if not module.is_first else x
            out = module(x_grad, targets)
        out.sum().backward() if out.dim() == 0 else out.backward(torch.ones_like(out))

    return best_rate(n, run, repeats, backend.device)


def expert_throughput(host: ExpertHost, config: RunConfig, repeats: int = 3) -> float:
    """Tokens per second one hosted expert runs forward and backward on (an expert's share of a micro-batch)."""
    moe = config.model.moe
    rows = max(1, config.optimizer.micro_batch_size * config.model.seq_len * moe.top_k // moe.num_experts)
    module = copy.deepcopy(next(iter(host.modules.values())))
    x = torch.randn(rows, config.model.d_model, device=host.device)

    def run() -> None:
        leaf = x.detach().requires_grad_(True)
        module(leaf).sum().backward()

    return best_rate(rows, run, repeats, torch.device(host.device))
