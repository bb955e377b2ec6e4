"""A stage's compute: forward, backward (from a kept graph, or by recomputation), gradient
accumulation, optimizer steps.

No networking here. Every task runs on one worker thread owned by the backend, so torch work never
blocks an event loop and the module, its gradients and its optimizer are only touched by that
thread (swarm.worker.Worker). At most `max_queue` tasks may wait; more are refused at once with
:class:`Overloaded`, so a flood of requests cannot grow memory without bound.

Mixed precision: the stage computes under autocast in its compute dtype (bfloat16 on a GPU by
default) while its parameters, their gradients and the optimizer state stay float32. On CUDA,
TF32 is allowed for what stays float32, inputs and outputs cross to and from the device through
pinned buffers on a copy stream, and nothing waits for the device but the copy of a reply.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from swarm.activations import ActivationCache, CachedForward, SavedBytes, StaleGraph
from swarm.delays import GradientDelays
from swarm.drain import BatchDrain, InFlight
from swarm.model import StageModule
from swarm.model.moe import MoERecord, record_moe, total_aux_loss
from swarm.optim import StageOptimizer
from swarm.worker import Overloaded, Worker

if TYPE_CHECKING:
    from swarm.averaging.stepper import StageStepper

log = logging.getLogger(__name__)


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_compute_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a stage computes in on `device`: "auto" is bfloat16 on a CUDA device that has it, else float32."""
    if isinstance(name, torch.dtype):
        dtype = name
    elif name == "auto":
        device = torch.device(device)
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    elif name in COMPUTE_DTYPES:
        dtype = COMPUTE_DTYPES[name]
    else:
        raise ValueError(f"unknown compute dtype {name!r}; expected auto or one of {', '.join(COMPUTE_DTYPES)}")
    if dtype not in COMPUTE_DTYPES.values():
        raise ValueError(f"a stage cannot compute in {dtype}: float16 would need loss scaling; use bfloat16")
    return dtype


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`, or nothing for float32 (the parameters' own dtype)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


MAX_TRACKED = 1024  # forwards whose backward is awaited, at most (forwards ahead)


def _bound(tracked: OrderedDict, limit: int) -> None:
    while len(tracked) > limit:
        tracked.popitem(last=False)


@dataclass
class BackwardResult:
    grad_input: torch.Tensor | None  # None on the first stage (its input is token ids)
    loss: float | None  # the micro-batch's mean loss, on the last stage
    step: int  # the stage's optimizer step after this task
    step_stats: dict[str, Any] | None  # set when this task completed a batch and the stage stepped
    staleness: int | None = None  # steps the stage took between the micro-batch's forward and this backward
    stashed: bool = False  # the gradient was computed on the parameters the forward used, kept from before a step
    cached: bool = False  # the forward's graph was kept: no recomputation
    ahead: bool = False  # computed on predicted parameters (look-ahead), not those of `step`: see Forwarded


class Forwarded(tuple):
    """What forward_at returns: (output, step), and `ahead`: whether the output was computed on a prediction
    of the next step's parameters (a forward ahead, or any forward while a round runs on look-ahead ones),
    not on those of `step`. Replicas at the same step predict from different shares of the batch, so early in a
    run their outputs can differ by more than a spot check tolerates: the reply says so (swarm.routing.spot_checks
    then treats the two as answers of different moments)."""

    ahead: bool

    def __new__(cls, output: torch.Tensor, step: int, ahead: bool = False) -> Forwarded:
        made = super().__new__(cls, (output, step))
        made.ahead = ahead
        return made


class StageBackend(Worker):
    """Runs one stage module and its optimizer on a device, one task at a time."""

    def __init__(
        self,
        module: StageModule,
        optimizer: StageOptimizer,
        device: str | torch.device = "cpu",
        max_queue: int = 64,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        stepper: StageStepper | None = None,
        stash_weights: bool = True,
        compute_dtype: str | torch.dtype = "auto",
        cache: ActivationCache | None = None,
        slowdown: float = 1.0,
    ):
        self.device = torch.device(device)
        self.compute_dtype = resolve_compute_dtype(compute_dtype, self.device)
        self.module = module.to(self.device)
        self.optimizer = optimizer
        self.stepper = optimizer if stepper is None else stepper  # decides when and how the stage steps
        Worker.__init__(self, f"stage {module.index}", max_queue, slowdown)
        self.on_step = on_step
        self.samples_processed = 0
        # Weight stashing: a copy of the parameters from before the last step, so a micro-batch whose
        # forward ran before that step gets its gradient from the parameters that forward used. The
        # last stage runs forward and backward in one call and needs none.
        self.stash_weights = stash_weights and not module.is_last
        self._param_names = [name for name, p in module.named_parameters() if p.requires_grad]
        self._stash: list[torch.Tensor] | None = None
        self._stash_step: int | None = None  # the step whose parameters _stash holds
        # With stashing, a kept forward runs on a frozen copy of the parameters (made anew once they change),
        # not on the module's own, which a step changes in place; at the step that copy becomes the stash. A
        # backward one step late then starts from its forward's graph, which the step left intact, instead of
        # running the forward again on the stash: the same gradient, one forward fewer. (One more copy of the
        # parameters is held: the frozen one beside the stash.)
        self._frozen: list[torch.Tensor] | None = None
        self._frozen_versions: tuple[int, ...] | None = None  # the parameters' versions it was copied at
        # Forwards ahead (optimizer.lookahead): a forward whose backward will come after the stage's next
        # step (the samples in flight before it fill the batch) runs on the parameters that step is
        # predicted to make, kept for its backward: its gradient, applied at the step after, is then
        # nearly fresh instead of a step stale (README, Learning).
        # The last stage runs forward and backward in one call: one that comes while the batch is due (its
        # samples are held for the step after) runs ahead the same way.
        self.ahead = optimizer.config.lookahead and (self.stash_weights or module.is_last)
        self.in_flight = InFlight(MAX_TRACKED)  # forwards whose backward is to come (forwards wait on it: drain.py)
        self._predicted: dict[int, list[torch.Tensor]] = {}  # step t: the parameters step t+1 is predicted at
        self._ahead_of: OrderedDict[Hashable, int] = OrderedDict()  # key of a forward ahead: its step t
        self.forwards_ahead = 0
        self.delays = GradientDelays()  # how old the parameters of each counted sample's gradient were
        # A due batch waits (briefly) for the backwards of forwards run on its parameters (optimizer.drain_seconds)
        drain = optimizer.config.drain_seconds
        self.drain = BatchDrain(drain, self.request_step) if drain > 0 and not module.is_last else None
        # Whether the module's parameters are look-ahead ones now (a round under way, optimizer.lookahead), and the
        # parameters the state is at meanwhile: set by the server that owns the stage's state (StageState.
        # lookahead_base); replies say so (Forwarded)
        self.in_look_ahead: Callable[[], bool] = lambda: False
        self.base_params: Callable[[], list[torch.Tensor] | None] = lambda: None
        # Forward graphs kept for their backward (never for the last stage: it runs both in one call)
        # ... nor for a stage with MoE blocks: their aux loss is a second root of the backward, which a
        # kept graph does not hold (the backward recomputes the forward instead).
        self.cache = None if module.is_last or module.moe_layers or cache is None or cache.max_bytes == 0 else cache
        self.aux_loss_weight = module.config.moe.aux_loss_weight if module.moe_layers else 0.0
        # Per MoE block of this stage, over the micro-batches trained: tokens each expert processed, and
        # top-k slots dropped for being over an expert's capacity (metrics; counted once, in the backward).
        experts = module.config.moe.num_experts if module.moe_layers else 0
        self.expert_tokens = {layer: [0] * experts for layer in module.moe_layers}
        self.dropped_slots = dict.fromkeys(module.moe_layers, 0)
        self._copy_stream = None
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # what stays float32 may use tensor cores
            torch.backends.cudnn.allow_tf32 = True
            self._copy_stream = torch.cuda.Stream(self.device)

    @property
    def step(self) -> int:
        return self.stepper.step_count

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Stage output for `x` (the mean loss on the last stage); no gradients are kept."""
        return self.forward_at(x, targets)[0]

    def forward_at(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, keep: Hashable | None = None,
    ) -> Forwarded:
        """forward(), and the step whose parameters it used (what a trainer sends back with the backward).

        With `keep` (the caller's key for this micro-batch), the graph is kept in the activation
        cache so the backward under the same key need not recompute the forward.
        """
        module = self.module
        x = self._to_device(x)
        targets = self._to_device(targets)
        ahead = keep is not None and self.ahead and not module.is_last  # (the last stage's call is its backward)
        predicted = self._ahead_for(keep, x.shape[0]) if ahead else None
        if predicted is not None:
            with torch.no_grad(), self._autocast():
                out = functional_call(module, dict(zip(self._param_names, predicted)), (x, targets))
        elif keep is not None and self.cache is not None:
            if not module.is_first:  # before .float(), which would pass integers off as hidden states
                module.check_input(x, targets)
            inputs = x if module.is_first else x.detach().float().requires_grad_(True)
            versions = self._param_versions()
            leaves = self._frozen_for(versions) if self.stash_weights else None
            with SavedBytes(self.optimizer.params + (leaves or [])) as saved, self._autocast():
                if leaves is None:
                    out = module(inputs, targets)
                else:
                    out = functional_call(module, dict(zip(self._param_names, leaves)), (inputs, targets))
            nbytes = saved.nbytes + out.untyped_storage().nbytes()
            self.cache.put(keep, inputs, out, self.step, versions, nbytes, leaves)
        else:
            with torch.no_grad(), self._autocast():
                out = module(x, targets)
        self.samples_processed += x.shape[0]
        if keep is not None:
            self.delays.forwarded(keep, predicted is not None or self.in_look_ahead())
        if keep is not None and self.drain is not None and predicted is None:
            self.drain.forwarded(keep, self.step, self.in_look_ahead())
        return Forwarded(self._to_host(out.detach().float() if out.dim() == 0 else out.detach()), self.step,
                         ahead=predicted is not None or self.in_look_ahead())

    def backward(
        self, x: torch.Tensor, grad_output: torch.Tensor | None = None, targets: torch.Tensor | None = None,
        forward_step: int | None = None, key: Hashable | None = None, weight: float = 1.0,
    ) -> BackwardResult:
        """Backward from the forward's kept graph, or recompute the forward from `x`; hand the parameter
        gradients to the stepper, step when it is ready.

        Gradients are of the SUM of per-sample losses (the last stage scales its mean loss by the
        micro-batch size), so the optimizer can average over however many samples arrived.
        `forward_step`, the step at which this stage ran the micro-batch's forward, tells how stale
        the gradient is: `grad_output` came from activations of then. If the stage has stepped once since,
        the gradient is of the stashed parameters of then, so it is consistent (one step old): from the
        graph kept under `key` when it was built on the stash (with stashing, kept forwards run on the frozen
        copy that becomes the stash), else by recomputing the forward on the stash. Otherwise a kept graph
        is used only if it was built on the parameters of now from the same `x`, and the forward is
        recomputed on the parameters of now if not (also when the stage stepped more than once).
        `weight` is the share of the micro-batch the parameters' gradient counts for: round(weight x n)
        samples, its gradient scaled by that over n, so the batch's gradient is a weighted mean (0: it does
        not count; the gradient of the input is returned as ever).
        """
        staleness = None if forward_step is None else max(0, self.step - forward_step)
        predicted = None
        module = self.module
        if self.ahead and module.is_last:
            if self.stepper.samples_to_step() == 0 and self.optimizer.shards is None:
                predicted = self._prediction()  # the batch is due: these samples count towards the step after
                self.forwards_ahead += 1
        elif key is not None and self.ahead:
            self.in_flight.returned(key)
            ahead_step = self._ahead_of.pop(key, None)
            if ahead_step is not None and ahead_step == forward_step:
                predicted = self._predicted.get(ahead_step)
        on_stash = bool(staleness) and forward_step == self._stash_step and self._stash is not None
        awaited = self.drain is not None and key is not None and self.drain.returned(key)
        n = x.shape[0]
        look_ahead = self.in_look_ahead()  # (read before stepping: a step here ends any look-ahead)
        x = self._to_device(x)
        targets = self._to_device(targets)
        if not module.is_first:
            module.check_input(x, targets)  # before .float(), which would pass integers off as hidden states
        entry = self.cache.take(key) if self.cache is not None and key is not None else None
        params = self.optimizer.params
        kept = [p.grad for p in params]  # this micro-batch's gradients are computed apart, then handed over
        stashed = False
        try:
            for p in params:
                p.grad = None
            usable = predicted is None and entry is not None and self._usable(entry, x, forward_step, on_stash)
            result = self._backward_cached(entry, grad_output) if usable else None
            cached = result is not None
            stashed = cached and bool(staleness)  # (a graph built on the frozen copy of then)
            # (a forward of this step run elsewhere, on the parameters of the step: not on this one's look-ahead)
            on_base = not cached and predicted is None and look_ahead and forward_step == self.step and \
                not self.delays.ran_ahead(key)
            if not cached:  # on the parameters its forward ran on (or, last, runs on): predicted, stashed or now's
                stashed = on_stash if predicted is None else not module.is_last
                on = predicted if predicted is not None else self._stash if stashed else \
                    self.base_params() if on_base else None
                result = self._backward_recomputed(x, grad_output, targets, n, on)
            grads, loss, grad_input = result
        finally:  # a request that fails changes nothing
            for p, grad in zip(params, kept):
                p.grad = grad
        if self.cache is not None:
            if cached:
                self.cache.hits += 1
            else:
                self.cache.misses += 1
        if weight > 0:  # (0: the gradient of the input is all the caller gets; the parameters' is dropped)
            counted = n
            if weight != 1:  # it counts as round(weight x n) of the batch's samples, its gradient scaled alike
                counted = max(1, round(weight * n))
                with torch.no_grad():
                    for g in grads:
                        if g is not None:
                            g.mul_(counted / n)
            step = self.step
            # (a prediction of the step not taken yet: a step early if counted in it; the stepper is told, see there)
            early = predicted is not None and (module.is_last or forward_step == step)
            lands = self.stepper.accumulate(grads, counted, awaited=awaited, predicted=early)
            self.delays.counted(key, step if forward_step is None else forward_step,
                                predicted is not None or (look_ahead and not on_base), step, lands, counted)
        self.samples_processed += n
        stats = self._step_if_ready()
        grad_input = None if grad_input is None else self._to_host(grad_input)
        return BackwardResult(grad_input, loss, self.step, stats, staleness, stashed, cached,
                              ahead=predicted is not None or (look_ahead and not on_base))

    def _usable(self, entry: CachedForward, x: torch.Tensor, forward_step: int | None, on_stash: bool) -> bool:
        """Whether a kept graph gives this backward's gradient (its forward's parameters, same input): one on a frozen
        copy whatever a step or a look-ahead did to the module's own since (recomputed on those, the gradient is not
        of the output the next stage saw: worse than a step stale); else while they are unchanged (no state loaded)."""
        if forward_step is not None and entry.step != forward_step:
            return False
        if entry.leaves is None or (entry.step == self.step and not self.in_look_ahead()):
            if on_stash or entry.step != self.step or entry.versions != self._param_versions():
                return False
        seen = entry.inputs.detach()
        return seen.shape == x.shape and bool((seen == x).all())

    def _backward_cached(self, entry: CachedForward, grad_output: torch.Tensor | None):
        """(gradients, None, grad of the input) from a kept graph; None if its tensors changed since."""
        out = entry.output
        _check_grad_output(grad_output, out)
        leaves = self.optimizer.params if entry.leaves is None else entry.leaves
        try:
            out.backward(self._to_device(grad_output).to(out.dtype))
        except StaleGraph as e:  # the step check above should make this unreachable; recompute if not
            log.warning("stage %d: a kept forward graph was stale (%s); recomputing", self.module.index, e)
            for leaf in leaves:
                leaf.grad = None
            return None
        grads = [leaf.grad for leaf in leaves]
        if entry.leaves is not None:  # (a frozen copy is shared by graphs: the next one's gradient must be its own)
            for leaf in entry.leaves:
                leaf.grad = None
        grad_input = None if self.module.is_first else entry.inputs.grad.detach()
        return grads, None, grad_input

    def _backward_recomputed(self, x: torch.Tensor, grad_output: torch.Tensor | None, targets: torch.Tensor | None,
                             n: int, kept: list[torch.Tensor] | None):
        """(gradients, loss on the last stage, grad of the input) by running the forward again: on the
        parameters of now, or on `kept` ones (stashed from before a step, or predicted ahead)."""
        module = self.module
        if not module.is_first:
            x = x.detach().float().requires_grad_(True)
        with self._autocast(), record_moe() as routed:
            if kept is not None:  # fresh leaves each time, so their gradients are this micro-batch's alone
                leaves = [t.detach().requires_grad_(True) for t in kept]
                out = functional_call(module, dict(zip(self._param_names, leaves)), (x, targets))
            else:
                leaves = self.optimizer.params
                out = module(x, targets)  # validates x and targets
        # The objective is (cross-entropy + alpha * the MoE blocks' load-balancing losses) summed over
        # samples, as the reference's; each stage adds the aux losses of its own MoE blocks.
        aux = total_aux_loss(routed)
        self._count_routing(routed)
        if module.is_last:
            loss = float(out.detach())  # the cross-entropy alone, comparable with dense runs
            ((out if aux is None else out + self.aux_loss_weight * aux) * n).backward()
        else:
            loss = None
            _check_grad_output(grad_output, out)
            grad = self._to_device(grad_output).to(out.dtype)
            if aux is None:
                out.backward(grad)
            else:
                torch.autograd.backward([out, aux], [grad, aux.new_tensor(self.aux_loss_weight * n)])
        grad_input = None if module.is_first else x.grad.detach()
        return [leaf.grad for leaf in leaves], loss, grad_input

    def _ahead_for(self, key: Hashable, n: int) -> list[torch.Tensor] | None:
        """The parameters a forward of `n` samples runs on if its backward will come after the stage's next
        step (None: the parameters of now); it is counted in flight until its backward."""
        step = self.step
        ahead_of = self.in_flight.add(key, n, step)
        needed = self.stepper.samples_to_step()
        if needed is None or ahead_of < needed or self.optimizer.shards is not None:
            return None  # (sharded moments: no one server can predict the step)
        self._ahead_of[key] = step
        _bound(self._ahead_of, MAX_TRACKED)
        self.forwards_ahead += 1
        return self._prediction()

    def _prediction(self) -> list[torch.Tensor]:
        """The parameters the stage's next step is predicted to make (once a step): the optimizer's step on
        this server's gradient so far (its moments alone, before any)."""
        step = self.step
        if step not in self._predicted:
            self._predicted = {t: p for t, p in self._predicted.items() if t == step - 1}  # (backwards to come)
            self._predicted[step] = self._predict()
        return self._predicted[step]

    def _predict(self) -> list[torch.Tensor]:
        optimizer = self.optimizer
        grads, samples = [p.grad for p in optimizer.params], optimizer.samples
        if samples <= 0:
            grads, samples = [torch.zeros_like(p) for p in optimizer.params], 1
        return optimizer.preview(grads, samples)

    def _count_routing(self, routed: list[MoERecord]) -> None:
        for record in routed:
            plan = record.plan
            done = plan.experts[plan.processed].bincount(minlength=len(self.expert_tokens[record.layer])).tolist()
            self.expert_tokens[record.layer] = [a + b for a, b in zip(self.expert_tokens[record.layer], done)]
            self.dropped_slots[record.layer] += plan.dropped()

    def _frozen_for(self, versions: tuple[int, ...]) -> list[torch.Tensor]:
        """The frozen copy of the parameters as they are now (at `versions`), made anew once they changed."""
        if self._frozen is None or self._frozen_versions != versions:
            if self.cache is not None:  # graphs on copies of two steps before or more serve no backward: free them
                oldest = self.step - 1  # (those of the step before serve its backwards, on whichever copy they ran)
                self.cache.drop_where(lambda entry: entry.leaves is not None and entry.step < oldest)
            self._frozen = [p.detach().clone().requires_grad_(True) for p in self.optimizer.params]
            self._frozen_versions = versions
        return self._frozen

    def _stash_now(self) -> list[torch.Tensor]:
        """The parameters to stash at a step: the frozen copy kept graphs run on while it is still theirs."""
        if self._frozen is not None and self._frozen_versions == self._param_versions():
            return self._frozen
        return [p.detach().clone() for p in self.optimizer.params]

    def _param_versions(self) -> tuple[int, ...]:
        """Every in-place change of a parameter (a step, a state loaded, a repair) bumps its version."""
        return tuple(p._version for p in self.optimizer.params)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.compute_dtype)

    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """`t` on the stage's device; from the host through a pinned buffer on the copy stream (CUDA)."""
        if t is None or t.device == self.device:
            return t
        if self._copy_stream is None or t.device.type != "cpu":
            return t.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            moved = t.pin_memory().to(self.device, non_blocking=True)
        compute.wait_stream(self._copy_stream)  # the compute waits for the copy, not the host
        moved.record_stream(compute)
        return moved

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the host; from a CUDA device into a pinned buffer on the copy stream, waiting for that copy only."""
        if t.device.type == "cpu":
            return t
        if self._copy_stream is None:
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self._copy_stream)
        self._copy_stream.synchronize()
        return host

    def _step_if_ready(self) -> dict[str, Any] | None:
        if not self.stepper.ready:
            return None
        if self.drain is not None and self.stepper.closes_batch and self.drain.hold(self.step) is not None:
            return None  # (the drain asks again when its wait ends)
        step = self.step
        before = self._stash_now() if self.stash_weights else None
        stats = self.stepper.step()
        if self.step != step:  # the parameters moved on (a step, or a catch-up with the stage)
            self._stash, self._stash_step = before, step
        if stats is None:  # nothing stepped here (e.g. the stage caught up with its peers)
            return None
        if stats["skipped"]:
            log.warning("stage %d skipped a step: non-finite gradient norm", self.module.index)
        if self.on_step is not None:
            self.on_step(stats)
        return stats

    def request_step(self) -> Future | None:
        """Queue a step for when the worker is free, if the stepper is ready by then.

        For steppers that learn from the network that the stage's batch is full. None if it could
        not be queued (full queue: the queued tasks check readiness themselves; or shut down).
        """
        try:
            future = self.submit(self._step_if_ready)
        except (Overloaded, RuntimeError):
            return None
        future.add_done_callback(_log_failure)
        return future


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a requested optimizer step failed", exc_info=future.exception())


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _check_grad_output(grad_output: torch.Tensor | None, out: torch.Tensor) -> None:
    if grad_output is None:
        raise ValueError("backward of a non-last stage needs the gradient of its output")
    if not isinstance(grad_output, torch.Tensor) or not grad_output.is_floating_point():
        raise ValueError("the gradient of the output must be a floating-point tensor")
    if tuple(grad_output.shape) != tuple(out.shape):
        raise ValueError(f"gradient shape {tuple(grad_output.shape)} != output shape {tuple(out.shape)}")
    if not torch.isfinite(grad_output).all():
        raise ValueError("the gradient of the output has non-finite values")
