"""What an expert server computes: the experts it hosts, in every MoE block, with their optimizers.

No networking here (swarm/serving/expert.py serves it). Each hosted expert is built as the reference builds
it (:func:`swarm.model.make_expert`, its own seeded generator) and has its own
:class:`~swarm.optim.StageOptimizer`: its own gradient clipping and sample count. A stage server
sends every micro-batch's backward to every expert of its block, also those it routed no token to
(zero rows), with the micro-batch's sample count, so every expert reaches ``batch_size`` samples,
and steps, exactly when the stages do; an expert with no token in a whole batch has no gradient,
and AdamW leaves it alone, as in the reference.

Every task runs on one worker thread (:class:`~swarm.worker.Worker`: the experts, their gradients
and optimizers are only touched there); at most ``max_queue`` wait, more are refused with
:class:`~swarm.worker.Overloaded`.
Inputs are checked before any compute: the block and experts must be hosted here, the rows
``[n, d_model]`` floats, finite, at most ``max_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarm.config import RunConfig
from swarm.model import make_expert
from swarm.optim import StageOptimizer
from swarm.state import StateInfo, StateRejected
from swarm.threads import Owner
from swarm.worker import Worker


class ExpertHost(Worker):
    """The experts `experts` (indices) of every MoE block of the run, on `device`."""

    def __init__(self, config: RunConfig, experts: Sequence[int], device: str | torch.device = "cpu",
                 max_queue: int = 64, max_rows: int | None = None, slowdown: float = 1.0):
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
        super().__init__("the expert server", max_queue, slowdown)
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
        self.check_expert(layer, expert, meta, tensors)
        self._apply_expert(layer, expert, meta, tensors)

    def check_expert(self, layer: int, expert: int, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """ValueError unless (meta, tensors) is a state :meth:`import_expert` can take for this expert."""
        key = (layer, expert)
        if key not in self.modules:
            raise ValueError(f"expert {expert} of block {layer} is not hosted here")
        total = sum(p.numel() for p in self.optimizers[key].params)
        if len(tensors) != 4:
            raise ValueError(f"an expert's state is 4 tensors, got {len(tensors)}")
        for name, t, sizes in zip(SLOTS, tensors, ((total,), (0, total), (0, total), (0, total))):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 \
                    or t.numel() not in sizes:
                found = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"the expert's {name} must be flat float32 of {' or '.join(map(str, sizes))} "
                                 f"elements, got {found}")
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

    def _apply_expert(self, layer: int, expert: int, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        optimizer = self.optimizers[layer, expert]
        params = optimizer.params
        sizes = [p.numel() for p in params]
        with torch.no_grad():
            for p, part in zip(params, tensors[0].split(sizes)):
                p.copy_(part.view_as(p))
            if tensors[1].numel():
                moments = {}
                for i, (p, avg, sq) in enumerate(zip(params, tensors[1].split(sizes), tensors[2].split(sizes))):
                    moments.update({f"{i}/exp_avg": avg.view_as(p).clone(), f"{i}/exp_avg_sq": sq.view_as(p).clone(),
                                    f"{i}/step": torch.tensor(float(meta["adam_step"]))})
                optimizer.load_moments(moments, meta["step_count"])
            optimizer.step_count = meta["step_count"]
            for p, part in zip(params, tensors[3].split(sizes) if tensors[3].numel() else [None] * len(params)):
                p.grad = None if part is None else part.view_as(p).clone()
            optimizer.samples = meta["samples"]


SLOTS = ("parameters", "exp_avg", "exp_avg_sq", "gradient")  # the tensors of export_expert, in order
REPLICA_ROUND = "expert"  # the round id an expert's state says made it (its hosts' averaging has no round ids)


class ExpertState:
    """One expert of an ExpertHost, in every MoE block: what its checkpoints hold (a StageKeeper keeps them,
    with part "expert") and what a host joining it downloads. The same interface as swarm.state.StageState:
    `stage` (here the expert's index), `step`, `state_dict`, `load_state_dict`, `nbytes`.

    Tensors, for each MoE block L: ``L.parameters``, ``L.exp_avg``, ``L.exp_avg_sq``, ``L.gradient`` (flat
    float32, as export_expert gives them), ``L.counts`` (int64: step count, samples) and ``L.adam_step``
    (float64). Read and replaced on the host's worker thread (its optimizers check it, swarm.threads).
    """

    def __init__(self, host: ExpertHost, expert: int):
        if expert not in host.experts:
            raise ValueError(f"expert {expert} is not hosted here (this host has {host.experts})")
        self.host = host
        self.stage = expert

    @property
    def step(self) -> int:
        """Optimizer steps this expert took in every MoE block."""
        return min(self.host.optimizers[layer, self.stage].step_count for layer in self.host.layers)

    def state_dict(self) -> tuple[StateInfo, dict[str, torch.Tensor]]:
        """A copy of the expert's whole state (read between two tasks on the host's worker thread)."""
        tensors = {}
        for layer in self.host.layers:
            meta, flat = self.host.export_expert(layer, self.stage)
            tensors.update({f"{layer}.{slot}": t for slot, t in zip(SLOTS, flat)})  # flat copies already
            tensors[f"{layer}.counts"] = torch.tensor([meta["step_count"], meta["samples"]], dtype=torch.int64)
            tensors[f"{layer}.adam_step"] = torch.tensor(float(meta["adam_step"]), dtype=torch.float64)
        return StateInfo(self.stage, self.step, REPLICA_ROUND, 1), tensors

    def load_state_dict(self, info: StateInfo, tensors: Mapping[str, Any]) -> None:
        """Replace the expert's state with `tensors` (as :meth:`state_dict` names them); StateRejected, and
        nothing changed, unless every block's part fits this expert exactly."""
        if info.stage != self.stage:
            raise StateRejected(f"the state is of expert {info.stage}, not {self.stage}")
        expected = {f"{layer}.{name}" for layer in self.host.layers for name in (*SLOTS, "counts", "adam_step")}
        if set(tensors) != expected:
            raise StateRejected(f"the expert's state must hold exactly {sorted(expected)}; missing "
                                f"{sorted(expected - set(tensors))[:4]}, unknown {sorted(set(tensors) - expected)[:4]}")
        states = {}
        for layer in self.host.layers:
            counts, adam_step = tensors[f"{layer}.counts"], tensors[f"{layer}.adam_step"]
            if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or tuple(counts.shape) != (2,):
                raise StateRejected(f"{layer}.counts must be 2 int64 numbers (step count, samples)")
            if not isinstance(adam_step, torch.Tensor) or adam_step.dtype != torch.float64 or adam_step.numel() != 1:
                raise StateRejected(f"{layer}.adam_step must be one float64 number")
            meta = {"step_count": int(counts[0]), "samples": int(counts[1]), "adam_step": float(adam_step)}
            flat = [tensors[f"{layer}.{slot}"] for slot in SLOTS]
            try:
                self.host.check_expert(layer, self.stage, meta, flat)
            except ValueError as e:
                raise StateRejected(f"block {layer}: {e}") from None
            states[layer] = (meta, flat)
        if min(meta["step_count"] for meta, _ in states.values()) != info.step:  # a block may be one step ahead
            raise StateRejected(f"the state says step {info.step}, but its blocks' least step count differs")
        for layer, (meta, flat) in states.items():
            self.host._apply_expert(layer, self.stage, meta, flat)

    def nbytes(self) -> int:
        """Bytes of a whole state: 4 flat float32 tensors of the expert's parameters per block, and the numbers."""
        params = sum(p.numel() for p in self.host.optimizers[self.host.layers[0], self.stage].params)
        return len(self.host.layers) * (4 * 4 * params + 2 * 8 + 8)

    def parameters(self) -> list[torch.Tensor]:
        """The expert's parameters, block by block in the host's order (the tensors themselves)."""
        return [p for layer in self.host.layers for p in self.host.optimizers[layer, self.stage].params]


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
