"""What an expert server computes: the experts it hosts, in every MoE block, with their optimizers.

No networking here (swarm/serving/expert.py serves it). Each hosted expert is built as the reference builds
it (:func:`swarm.model.make_expert`, its own seeded generator) and has its own
:class:`~swarm.optim.StageOptimizer`: its own gradient clipping and sample count. A stage server
sends every micro-batch's backward to every expert of its block, also those it routed no token to
(zero rows), with the micro-batch's sample count, so every expert reaches ``batch_size`` samples,
and steps, exactly when the stages do; an expert with no token in a whole batch has no gradient,
and AdamW leaves it alone, as in the reference.

Every task runs on one worker thread (:class:`~swarm.backend.Worker`: the experts, their gradients
and optimizers are only touched there); at most ``max_queue`` wait, more are refused with
:class:`~swarm.backend.Overloaded`.
Inputs are checked before any compute: the block and experts must be hosted here, the rows
``[n, d_model]`` floats, finite, at most ``max_rows``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from swarm.backend import Worker
from swarm.config import RunConfig
from swarm.model import make_expert
from swarm.optim import StageOptimizer
from swarm.threads import Owner


class ExpertHost(Worker):
    """The experts `experts` (indices) of every MoE block of the run, on `device`."""

    def __init__(self, config: RunConfig, experts: Sequence[int], device: str | torch.device = "cpu",
                 max_queue: int = 64, max_rows: int | None = None):
        moe = config.model.moe
        if moe is None:
            raise ValueError("the run has no mixture of experts (model.moe): there is nothing to host")
        experts = sorted(set(experts))
        if not experts or not all(0 <= e < moe.num_experts for e in experts):
            raise ValueError(f"experts to host must be a non-empty subset of 0..{moe.num_experts - 1}, got {experts}")
        self.config = config
        self.experts = experts
        self.layers = config.model.moe_layers()
        self.device = torch.device(device)
        self.d_model = config.model.d_model
        micro = config.optimizer.micro_batch_size
        # The most rows one request may carry: every slot of every token of a micro-batch.
        self.max_rows = max_rows if max_rows is not None else moe.top_k * micro * config.model.seq_len
        self.modules = {(layer, e): make_expert(config.model, layer, e).to(self.device)
                        for layer in self.layers for e in experts}
        self.optimizers = {key: StageOptimizer(module, config.optimizer) for key, module in self.modules.items()}
        # the thread that may change the experts' optimizers once handed over (swarm.threads): the worker's
        self.owner = Owner("hosted experts")
        for optimizer in self.optimizers.values():
            optimizer.owner = self.owner
        super().__init__("the expert server", max_queue)
        self.tokens = dict.fromkeys(self.modules, 0)  # rows each expert ran a backward on (its load)
        self.samples = 0  # samples of the backwards taken in, summed over blocks

    @property
    def step(self) -> int:
        """Optimizer steps every hosted expert has taken. The experts of one block step together; a
        block whose backward comes later (an earlier stage's) steps a moment after the others."""
        return min(opt.step_count for opt in self.optimizers.values())

    def check(self, layer: int, rows: Sequence[tuple[int, int]], inputs: torch.Tensor,
              grad: torch.Tensor | None = None) -> None:
        """ValueError unless the request fits what is hosted here (see the module docstring)."""
        if layer not in self.layers:
            raise ValueError(f"block {layer} is not a mixture of experts of this run (MoE blocks: {self.layers})")
        missing = [e for e, _ in rows if (layer, e) not in self.modules]
        if missing:
            raise ValueError(f"experts {missing} are not hosted here (this server hosts {self.experts})")
        if inputs.dim() != 2 or inputs.shape[1] != self.d_model or not inputs.is_floating_point():
            raise ValueError(f"expert inputs must be floats of shape [rows, {self.d_model}], got "
                             f"{inputs.dtype} {list(inputs.shape)}")
        if inputs.shape[0] > self.max_rows:
            raise ValueError(f"a request carries at most {self.max_rows} rows, got {inputs.shape[0]}")
        if not torch.isfinite(inputs).all():
            raise ValueError("expert inputs have non-finite values")
        if grad is not None:
            if tuple(grad.shape) != tuple(inputs.shape) or not grad.is_floating_point():
                raise ValueError(f"the output gradient must be floats of the inputs' shape {list(inputs.shape)}, "
                                 f"got {grad.dtype} {list(grad.shape)}")
            if not torch.isfinite(grad).all():
                raise ValueError("the output gradient has non-finite values")

    @torch.no_grad()
    def forward(self, layer: int, rows: Sequence[tuple[int, int]], inputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for their rows of `inputs`, in the same order; nothing accumulates."""
        self.check(layer, rows, inputs)
        x = inputs.to(self.device, torch.float32)
        chunks = torch.split(x, [count for _, count in rows])
        outputs = [self.modules[layer, e](chunk) for (e, _), chunk in zip(rows, chunks)]
        return torch.cat(outputs).cpu() if outputs else x.cpu()

    def backward(self, layer: int, rows: Sequence[tuple[int, int]], inputs: torch.Tensor, grad: torch.Tensor,
                 samples: int, stage_step: int | None = None) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Recompute each expert on its rows, accumulate its parameter gradient (a sum over the
        micro-batch's `samples` sequences) and count the samples; step an expert whose batch is full.

        An expert whose step is behind `stage_step` (the calling stage's) missed some of the batch's
        micro-batches: it first steps on what it has, so its batches end where the stage's do again
        (once per request: a stage cannot make it skip ahead).

        Returns the gradient of the inputs, and the stats of the steps taken. Gradients of a request
        that fails are discarded: it changes nothing.
        """
        self.check(layer, rows, inputs, grad)
        x = inputs.to(self.device, torch.float32)
        g = grad.to(self.device, torch.float32)
        counts = [count for _, count in rows]
        results = []
        for (e, count), chunk, chunk_grad in zip(rows, torch.split(x, counts), torch.split(g, counts)):
            module = self.modules[layer, e]
            if not count:
                results.append((e, None, chunk))
                continue
            leaf = chunk.detach().requires_grad_(True)
            params = self.optimizers[layer, e].params
            with torch.enable_grad():
                grads = torch.autograd.grad(module(leaf), [leaf, *params], chunk_grad)
            results.append((e, list(grads[1:]), grads[0]))
        stats = []
        for e, grads, _ in results:  # all computed: only now does anything accumulate
            optimizer = self.optimizers[layer, e]
            if stage_step is not None and optimizer.step_count < stage_step and optimizer.samples > 0:
                stats.append(optimizer.step())
            optimizer.accumulate([None] * len(optimizer.params) if grads is None else grads, samples)
            self.tokens[layer, e] += 0 if grads is None else next(c for ex, c in rows if ex == e)
            if optimizer.ready:
                stats.append(optimizer.step())
        self.samples += samples
        grad_inputs = torch.cat([r[2] for r in results]) if results else x
        return grad_inputs.detach().cpu(), stats

    def export_expert(self, layer: int, expert: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """One expert's whole state, for a host joining it: (numbers, [parameters, the optimizer's two moments,
        the gradient being accumulated]), each flat float32 in parameter order (empty: none yet)."""
        key = (layer, expert)
        if key not in self.modules:
            raise ValueError(f"expert {expert} of block {layer} is not hosted here")
        optimizer = self.optimizers[key]
        params = optimizer.params
        moments = optimizer.moments()
        flat = [_flat([p.detach() for p in params])]
        for slot in ("exp_avg", "exp_avg_sq"):
            flat.append(_flat([moments[f"{i}/{slot}"] for i in range(len(params))]) if moments else _flat([]))
        grads = [p.grad for p in params]
        flat.append(_flat([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
                    if any(g is not None for g in grads) else _flat([]))
        meta = {"layer": layer, "expert": expert, "step_count": optimizer.step_count, "samples": optimizer.samples,
                "adam_step": float(moments["0/step"]) if moments else 0.0}
        return meta, flat

    def import_expert(self, layer: int, expert: int, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Take over an expert's state as :meth:`export_expert` gives it; ValueError (and nothing changed)
        if it does not fit this expert exactly."""
        key = (layer, expert)
        if key not in self.modules:
            raise ValueError(f"expert {expert} of block {layer} is not hosted here")
        optimizer = self.optimizers[key]
        params = optimizer.params
        total = sum(p.numel() for p in params)
        if len(tensors) != 4:
            raise ValueError(f"an expert's state is 4 tensors, got {len(tensors)}")
        for name, t, sizes in zip(("parameters", "exp_avg", "exp_avg_sq", "gradient"), tensors,
                                  ((total,), (0, total), (0, total), (0, total))):
            if t.dtype != torch.float32 or t.dim() != 1 or t.numel() not in sizes:
                raise ValueError(f"the expert's {name} must be flat float32 of {' or '.join(map(str, sizes))} "
                                 f"elements, got {t.dtype} {list(t.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"the expert's {name} have non-finite values")
        if (tensors[1].numel() == 0) != (tensors[2].numel() == 0):
            raise ValueError("the expert's state has one AdamW moment without the other")
        numbers = {name: meta.get(name) for name in ("step_count", "samples")}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers.values()):
            raise ValueError(f"step_count and samples must be non-negative integers, got {numbers}")
        adam_step = meta.get("adam_step")
        if isinstance(adam_step, bool) or not isinstance(adam_step, (int, float)) or not 0 <= adam_step < 2**53:
            raise ValueError(f"adam_step must be a non-negative number, got {adam_step!r}")
        sizes = [p.numel() for p in params]
        with torch.no_grad():
            for p, part in zip(params, tensors[0].split(sizes)):
                p.copy_(part.view_as(p))
            if tensors[1].numel():
                moments = {}
                for i, (p, avg, sq) in enumerate(zip(params, tensors[1].split(sizes), tensors[2].split(sizes))):
                    moments.update({f"{i}/exp_avg": avg.view_as(p).clone(), f"{i}/exp_avg_sq": sq.view_as(p).clone(),
                                    f"{i}/step": torch.tensor(float(adam_step))})
                optimizer.load_moments(moments, numbers["step_count"])
            optimizer.step_count = numbers["step_count"]
            for p, part in zip(params, tensors[3].split(sizes) if tensors[3].numel() else [None] * len(params)):
                p.grad = None if part is None else part.view_as(p).clone()
            optimizer.samples = numbers["samples"]


SLOTS = ("parameters", "exp_avg", "exp_avg_sq", "gradient")  # the tensors of export_expert, in order
_CHECKPOINT = re.compile(r"experts-step(\d{10})-([\d.]+)\.safetensors")


def save_experts(states: dict[tuple[int, int], tuple[dict[str, Any], list[torch.Tensor]]], directory: Path,
                 step: int, state_hash: str, keep: int) -> Path:
    """Write hosted experts' states (export_expert's, by (block, expert)) as one safetensors file
    ``experts-step{step}-{e.e...}.safetensors`` in `directory`, named by the experts it holds (servers
    of other experts may share the directory), atomically (a temporary file of this process, fsynced,
    renamed); keep the `keep` newest files of these experts."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"{layer}.{expert}.{slot}": t.contiguous()
               for (layer, expert), (_, flat) in states.items() for slot, t in zip(SLOTS, flat)}
    numbers = {f"{layer}.{expert}": json.dumps({k: meta[k] for k in ("step_count", "samples", "adam_step")})
               for (layer, expert), (meta, _) in states.items()}
    hosted = ".".join(map(str, sorted({expert for _, expert in states})))
    path = directory / f"experts-step{step:010d}-{hosted}.safetensors"
    temp = directory / f".tmp-{os.getpid()}-{path.name}"
    save_file(tensors, str(temp), metadata={"state_hash": state_hash, **numbers})
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    ours = [p for p in expert_checkpoints(directory) if _CHECKPOINT.fullmatch(p.name).group(2) == hosted]
    for old in ours[:-keep or None]:
        old.unlink(missing_ok=True)
    return path


def expert_checkpoints(directory: Path) -> list[Path]:
    """The expert checkpoint files in `directory`, oldest step first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _CHECKPOINT.fullmatch(p.name)),
                  key=lambda p: (_CHECKPOINT.fullmatch(p.name).group(1), p.name))


def load_experts(path: Path, state_hash: str) -> dict[tuple[int, int], tuple[dict[str, Any], list[torch.Tensor]]]:
    """The expert states in a file save_experts wrote; ValueError if it is of another run config or malformed
    (the values themselves are checked by ExpertHost.import_expert)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("state_hash") != state_hash:
                raise ValueError(f"{path} holds experts of another run config")
            states = {}
            for key, text in metadata.items():
                if key == "state_hash":
                    continue
                layer, expert = (int(part) for part in key.split("."))
                meta = json.loads(text)
                states[layer, expert] = (meta, [f.get_tensor(f"{key}.{slot}") for slot in SLOTS])
            return states
    except ValueError:
        raise
    except Exception as e:  # a truncated file, a bad header: safetensors raises several types
        raise ValueError(f"{path} is not a readable expert checkpoint ({type(e).__name__}: {e})") from None


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
