"""StageState: the one owner of a stage replica's state, read and written as a flat dict of tensors.

A replica's state is its module's ``state_dict`` (parameters and buffers), the optimizer's AdamW
moments, its step, and which averaging round made it. Joining a stage, catching up with it,
checkpoints and export all go through :meth:`StageState.state_dict` and
:meth:`StageState.load_state_dict` (torchtitan's Stateful idea); nothing else reaches into the
module or the optimizer to copy state.

The tensors are flat and named, so they go as they are into safetensors (checkpoints) or, in key
order, into hivemind's state download:

- ``param/<name>``: every entry of the module's ``state_dict()``;
- ``optim/<i>/<slot>``: the AdamW state of the i-th trainable parameter (none before the first step);
- ``zero/<c>/<slot>``: with sharded moments (averaging.zero), those of each chunk c this replica holds
  (``exp_avg``, ``exp_avg_sq``, ``steps``), and ``zero/chunk_elements``: the chunks' size;
- ``outer/<i>/momentum``, ``outer/step``: in the low-communication mode (averaging.mode local,
  swarm.averaging.local), the outer Nesterov momentum of the i-th trainable parameter, and the optimizer
  step the slow weights stand at. The state's parameters are then the stage's slow weights, and its step
  counts outer steps: what every server of the stage shares, not the weights this replica has drifted to
  since (a newcomer, a checkpoint and an export take the slow weights).

A state of either kind loads into a replica of either kind: full moments given to a sharded replica
become every chunk (the next round hands each to its owners and drops the rest); chunks given to an
unsharded replica become full moments, zeros where no chunk was given (with a warning).

Every state that comes from elsewhere is untrusted: :meth:`StageState.check` refuses it unless its
names, shapes and dtypes are exactly this replica's, every value is finite, and it says which
stage, step and round it is. A refused state changes nothing. Pure torch, no I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarm.optim import ADAMW_SLOTS, SLOTS, StageOptimizer
from swarm.threads import Owner
from swarm.zero import MAX_CHUNK_ELEMENTS, ChunkMoments, Layout

log = logging.getLogger(__name__)

PARAM = "param/"
OPTIM = "optim/"
OUTER = "outer/"
OUTER_STEP = OUTER + "step"
ZERO = "zero/"
CHUNK_ELEMENTS = ZERO + "chunk_elements"
CHUNK_SLOTS = ("exp_avg", "exp_avg_sq", "steps")
STATE_FORMAT = 2  # bump when the layout changes


class StateRejected(ValueError):
    """A state from elsewhere does not fit this replica, or its content is not believable."""


class StateUnbacked(StateRejected):
    """The stage's records do not back the state (its step or parameters): a verdict of the moment, which the
    stage's next records may change (a dead server's record expiring, a round ending), unlike bad bytes."""


class StateIncomplete(StateRejected):
    """Fewer tensors came than the state names: the download's stream ended early (on loaded cores a
    libp2p stream between healthy peers sometimes does), or the sender cut it."""


@dataclass(frozen=True)
class StateInfo:
    """What a state says about itself."""

    stage: int
    step: int
    round_id: str  # the averaging round that made it
    group: int  # how many servers that round averaged

    def to_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "stage": self.stage, "step": self.step, "round_id": self.round_id,
                "group": self.group}

    @classmethod
    def from_dict(cls, data: Any) -> StateInfo:
        """Parse what a peer sent; StateRejected unless every field has its type."""
        if not isinstance(data, Mapping) or data.get("format") != STATE_FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise StateRejected(f"unknown state format {found!r} (expected {STATE_FORMAT})")
        stage, step, round_id, group = (data.get(k) for k in ("stage", "step", "round_id", "group"))
        if not _is_int(stage) or not _is_int(step) or stage < 0 or step < 0:
            raise StateRejected(f"bad stage or step in the state: {stage!r}, {step!r}")
        if not isinstance(round_id, str) or not 0 < len(round_id) <= 64 or not _is_int(group) or group < 1:
            raise StateRejected("the state does not say which round made it")
        return cls(stage, step, round_id, group)


class OuterState:
    """The low-communication mode's own state: the slow weights every server of the stage shares, their
    outer momentum, the outer steps that made them, and the optimizer step they stand at (swarm.averaging.local).
    On the parameters' device."""

    def __init__(self, params: Sequence[torch.Tensor], inner_step: int = 0):
        with torch.no_grad():
            self.slow = [p.detach().clone() for p in params]
            self.momentum = [torch.zeros_like(s) for s in self.slow]
        self.rounds = 0  # outer steps: the stage's step in this mode
        self.inner_step = inner_step  # the optimizer steps (inner steps) the slow weights stand at: the schedule's step


class StageState:
    """A stage replica's parameters, optimizer state, step and round identity, behind one interface.

    Who may touch it: `lock` is held while parameters, moments, the step or the round change, and by whoever
    reads them from another thread (a peer's download, a progress record); `owner` is the thread that may
    change them (the stage's compute thread once the server serves, swarm.threads): every mutator here
    (load_state_dict, set_round, enter_look_ahead, leave_look_ahead) and the optimizer's checks it.
    """

    def __init__(self, module: nn.Module, optimizer: StageOptimizer, stage: int, round_id: str, group: int = 1,
                 local_steps: int | None = None):
        self.module, self.optimizer, self.stage = module, optimizer, stage
        # the low-communication mode's slow weights and outer momentum, given its local_steps (None: the stage
        # averages every step)
        self.outer = OuterState(optimizer.params, optimizer.step_count) if local_steps is not None else None
        self.local_steps = local_steps
        self.round_id, self.group = round_id, group
        # While the module runs on look-ahead parameters (a round under way), the parameters the state
        # really is at, in optimizer.params order: what a snapshot holds (enter_look_ahead)
        self.lookahead_base: list[torch.Tensor] | None = None
        self.lock = threading.Lock()
        self.owner = Owner(f"stage {stage} state")
        optimizer.owner = self.owner  # the optimizer is math inside the state: its mutators check the same owner

    def set_round(self, round_id: str, group: int) -> None:
        """The averaging round that made the state now, and how many servers it averaged."""
        self.owner.check("set_round")
        self.round_id, self.group = round_id, group

    def enter_look_ahead(self, values: Sequence[torch.Tensor]) -> None:
        """Run on `values` (the parameters the next step is predicted to make, in optimizer.params order) while
        snapshots keep the parameters the state is at."""
        self.owner.check("enter_look_ahead")
        with torch.no_grad():
            self.lookahead_base = [p.detach().clone() for p in self.optimizer.params]
            for param, value in zip(self.optimizer.params, values):
                param.copy_(value)

    def leave_look_ahead(self) -> None:
        """The parameters the state is at, back in place of the look-ahead ones (if it ran ahead)."""
        self.owner.check("leave_look_ahead")
        base, self.lookahead_base = self.lookahead_base, None
        if base is not None:
            with torch.no_grad():
                for param, value in zip(self.optimizer.params, base):
                    param.copy_(value)

    def outer_step(self, mean_delta: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor], lr: float,
                   momentum: float) -> float:
        """The low-communication mode's outer step, the same on every server of the stage: Nesterov momentum on
        the stage's mean pseudo-gradient `mean_delta` (slow weights minus each server's weights at `snapshot`)
        moves the slow weights, which stand local_steps optimizer steps further on; this replica's own steps since
        the snapshot stay on top of them (they go into the next pseudo-gradient). Returns the update's norm."""
        self.owner.check("outer_step")
        outer, steps = self.outer, self.local_steps
        if outer is None or steps is None:
            raise RuntimeError("outer_step on a stage that averages every step")
        norm = 0.0
        with torch.no_grad():
            for param, slow, m, delta, snap in zip(self.optimizer.params, outer.slow, outer.momentum, mean_delta,
                                                   snapshot):
                delta = delta.to(device=slow.device, dtype=slow.dtype)
                m.mul_(momentum).add_(delta)
                update = delta.add(m, alpha=momentum)  # Nesterov: the gradient plus the momentum it leads to
                norm += float(update.pow(2).sum())
                slow.sub_(update, alpha=lr)
                param.add_(slow - snap.to(device=param.device, dtype=param.dtype))  # = slow + (param - snap)
        ahead = self.optimizer.step_count - outer.inner_step  # own steps taken since the slow weights' step
        outer.rounds += 1
        outer.inner_step += steps
        self.optimizer.step_count = outer.inner_step + max(0, ahead - steps)
        return norm ** 0.5

    def pseudo_gradient(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of (slow weights minus this replica's weights, this replica's weights): a round's input."""
        outer = self.outer
        if outer is None:
            raise RuntimeError("no slow weights: the stage averages every step")
        with torch.no_grad():
            snapshot = [p.detach().clone() for p in self.optimizer.params]
            return [(s - p).float().cpu() for s, p in zip(outer.slow, snapshot)], snapshot

    def drift(self) -> float:
        """How far this replica's weights are from the slow weights, relative to them (0 without any)."""
        if self.outer is None:
            return 0.0
        with torch.no_grad():
            apart = sum(float((p - s).pow(2).sum()) for p, s in zip(self.optimizer.params, self.outer.slow))
            size = sum(float(s.pow(2).sum()) for s in self.outer.slow)
        return (apart / size) ** 0.5 if size > 0 else 0.0

    @property
    def shared_params(self) -> list[torch.Tensor]:
        """The parameters every server of the stage holds alike: the slow weights in the low-communication mode,
        else the parameters (what progress records fingerprint)."""
        return self.outer.slow if self.outer is not None else self.optimizer.params

    @property
    def step(self) -> int:
        """The state's step: the optimizer's, or in the low-communication mode the outer steps taken."""
        return self.outer.rounds if self.outer is not None else self.optimizer.step_count

    @property
    def info(self) -> StateInfo:
        return StateInfo(self.stage, self.step, self.round_id, self.group)

    def state_dict(self, shards: bool = True) -> tuple[StateInfo, dict[str, torch.Tensor]]:
        """Copies of every tensor of the state (CPU, contiguous), by name, and what the state is.

        `shards`: include the sharded moments this replica holds (a checkpoint does; a peer joining
        the stage does not need them: its rounds bring it the chunks it owns).
        """
        tensors = {PARAM + name: _copy(t) for name, t in self.module.state_dict().items()}
        base = self.lookahead_base if self.outer is None else self.outer.slow
        if base is not None:
            names = {id(p): name for name, p in self.module.named_parameters()}
            for param, value in zip(self.optimizer.params, base):
                tensors[PARAM + names[id(param)]] = _copy(value)
        if self.outer is not None:
            tensors.update({f"{OUTER}{i}/momentum": _copy(m) for i, m in enumerate(self.outer.momentum)})
            tensors[OUTER_STEP] = torch.tensor(self.outer.inner_step, dtype=torch.int64)
        tensors.update({OPTIM + key: _copy(t) for key, t in self.optimizer.moments().items()})
        held = self.optimizer.shards
        if shards and held is not None and held.step == self.step and held.chunks:
            tensors[CHUNK_ELEMENTS] = torch.tensor(held.layout.chunk_elements)
            for chunk, moments in held.chunks.items():
                tensors[f"{ZERO}{chunk}/exp_avg"] = _copy(moments.exp_avg)
                tensors[f"{ZERO}{chunk}/exp_avg_sq"] = _copy(moments.exp_avg_sq)
                tensors[f"{ZERO}{chunk}/steps"] = torch.tensor(moments.steps)
        return self.info, tensors

    def check(self, info: StateInfo, tensors: Mapping[str, Any]) -> None:
        """Raise StateRejected unless `tensors` can replace this replica's state as they are."""
        if info.stage != self.stage:
            raise StateRejected(f"the state is of stage {info.stage}, not {self.stage}")
        own = {PARAM + name: t for name, t in self.module.state_dict().items()}
        names = set(tensors)
        if not names.issuperset(own):
            missing = sorted(set(own) - names)
            raise StateRejected(f"the state lacks {len(missing)} tensors of this stage, e.g. {missing[0]}")
        params = self.optimizer.params
        chunks = self._check_chunks(tensors)
        outer = self._check_outer(info, tensors)
        moments = sorted(names - set(own) - set(chunks) - set(outer))
        expected_moments: dict[str, torch.Tensor] = {}
        slots, name = self.optimizer.slots, self.optimizer.config.name
        for key in moments:
            index, slot = _moment_key(key, len(params), slots, name)
            # (torch keeps the step and NAdam's momentum product as 0-d float tensors)
            expected_moments[key] = params[index] if slot.startswith("exp_avg") else torch.zeros(())
        indices = {_moment_key(key, len(params), slots, name)[0] for key in moments}
        for index in indices:  # a parameter's moments come whole or not at all
            for slot in slots:
                if f"{OPTIM}{index}/{slot}" not in names:
                    raise StateRejected(f"the state has moments of parameter {index} without its {slot}"
                                        + (f" (a state of another optimizer: this run's is {name})"
                                           if slot not in ADAMW_SLOTS else ""))
        for name, reference in {**own, **expected_moments}.items():
            _check_tensor(name, tensors[name], reference)

    def _check_outer(self, info: StateInfo, tensors: Mapping[str, Any]) -> list[str]:
        """The names of the low-communication mode's tensors in `tensors`, each checked (a momentum against its
        parameter; the inner step at most local_steps per outer step, and one more: a sender's word on this
        replica's learning rate goes no further). A replica of either mode takes them: one averaging every step
        ignores them (its step is the state's), one in the local mode starts from zero momentum for any not
        given (a checkpoint of a run that averaged every step)."""
        names = [name for name in tensors if name.startswith(OUTER)]
        params = self.optimizer.params
        for name in names:
            if name == OUTER_STEP:
                _check_tensor(name, tensors[name], torch.zeros((), dtype=torch.int64))
                inner = int(tensors[name])
                if inner < 0:
                    raise StateRejected(f"{name} is negative")
                if self.local_steps is not None and inner > (info.step + 1) * self.local_steps:
                    raise StateRejected(f"{name} ({inner}) is beyond {info.step} outer steps of {self.local_steps}")
                continue
            parts = name.split("/")
            if len(parts) != 3 or not parts[1].isdigit() or parts[2] != "momentum" or not int(parts[1]) < len(params):
                raise StateRejected(f"unexpected tensor {name!r} in the state")
            param = params[int(parts[1])]
            _check_tensor(name, tensors[name], torch.empty(param.shape, dtype=param.dtype))
        return names

    def _check_chunks(self, tensors: Mapping[str, Any]) -> list[str]:
        """The names of sharded moments in `tensors`, checked against the layout they say they have."""
        names = [name for name in tensors if name.startswith(ZERO)]
        if not names:
            return []
        if self.optimizer.config.name != "adamw":
            raise StateRejected("the state holds sharded moments (averaging.zero), which are AdamW's: this run's "
                                f"optimizer is {self.optimizer.config.name}")
        size = tensors.get(CHUNK_ELEMENTS)
        if not isinstance(size, torch.Tensor) or size.dim() != 0 or size.is_floating_point() or \
                not 0 < int(size) <= MAX_CHUNK_ELEMENTS:
            raise StateRejected("the state's sharded moments do not say their chunk size (or it is out of range)")
        layout = Layout([p.shape for p in self.optimizer.params], int(size))
        chunks = set()
        for name in names:
            if name == CHUNK_ELEMENTS:
                continue
            parts = name.split("/")
            if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in CHUNK_SLOTS or \
                    not int(parts[1]) < layout.num_chunks:
                raise StateRejected(f"unexpected tensor {name!r} in the state")
            chunks.add(int(parts[1]))
        for chunk in chunks:
            for slot in CHUNK_SLOTS:
                name = f"{ZERO}{chunk}/{slot}"
                if name not in tensors:
                    raise StateRejected(f"the state has moments of chunk {chunk} without its {slot}")
                reference = torch.zeros((), dtype=torch.int64) if slot == "steps" else \
                    torch.zeros(layout.chunk_numel(chunk))
                _check_tensor(name, tensors[name], reference)
            if int(tensors[f"{ZERO}{chunk}/steps"]) < 0 or bool((tensors[f"{ZERO}{chunk}/exp_avg_sq"] < 0).any()):
                raise StateRejected(f"chunk {chunk} has a negative step count or second moment")
        return names

    def load_state_dict(self, info: StateInfo, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace this replica's state with `tensors` (checked first); gradients being accumulated are kept."""
        self.owner.check("load_state_dict")
        self.check(info, tensors)
        self.lookahead_base = None  # (the parameters a look-ahead would go back to are replaced too)
        with torch.no_grad():
            self.module.load_state_dict({name[len(PARAM):]: t for name, t in tensors.items() if name.startswith(PARAM)})
        moments = {name[len(OPTIM):]: t for name, t in tensors.items() if name.startswith(OPTIM)}
        chunks = _chunks_of(tensors)
        shards = self.optimizer.shards
        if shards is None:
            if chunks is not None:
                chunk_elements, given = chunks
                moments = self._full_moments(Layout([p.shape for p in self.optimizer.params], chunk_elements),
                                             given, info.step)
            self.optimizer.load_moments(moments, info.step)
        else:
            self.optimizer.load_moments({}, info.step)
            if moments:
                shards.replace(self._chunked(moments, shards.layout), info.step)
            elif chunks is not None:
                shards.replace(_rechunk(*chunks, shards.layout), info.step)
        outer = self.outer
        if outer is not None:
            with torch.no_grad():
                for i, (param, slow, momentum) in enumerate(zip(self.optimizer.params, outer.slow, outer.momentum)):
                    slow.copy_(param)  # (the state's parameters are the slow weights: this replica starts there)
                    given = tensors.get(f"{OUTER}{i}/momentum")
                    if given is None:
                        momentum.zero_()
                    else:
                        momentum.copy_(given)
            outer.rounds = info.step
            given_step = tensors.get(OUTER_STEP)  # (none in a state of a stage that averaged every step: its own)
            outer.inner_step = int(given_step) if given_step is not None else info.step
            self.optimizer.step_count = outer.inner_step
        self.round_id, self.group = info.round_id, info.group

    def _chunked(self, moments: Mapping[str, torch.Tensor], layout: Layout) -> dict[int, ChunkMoments]:
        """Full AdamW moments (``<i>/<slot>``) cut into every chunk of `layout`."""
        params = self.optimizer.params
        flat = {slot: layout.flatten([moments.get(f"{i}/{slot}") for i in range(len(params))])
                for slot in ("exp_avg", "exp_avg_sq")}
        steps = [int(t) for key, t in moments.items() if key.endswith("/step")]
        chunk_steps = max(steps, default=0)
        return {c: ChunkMoments(flat["exp_avg"][slice(*layout.bounds(c))].clone(),
                                flat["exp_avg_sq"][slice(*layout.bounds(c))].clone(), chunk_steps)
                for c in range(layout.num_chunks)}

    def _full_moments(self, layout: Layout, chunks: dict[int, ChunkMoments], step: int) -> dict[str, torch.Tensor]:
        """Chunks' moments as full AdamW moments (``<i>/<slot>``); zeros where no chunk was given."""
        missing = layout.num_chunks - len(chunks)
        if missing:
            log.warning("stage %d: the state holds the moments of %d of %d chunks; the other %d start from zero",
                        self.stage, len(chunks), layout.num_chunks, missing)
        flat = {slot: torch.zeros(layout.numel) for slot in ("exp_avg", "exp_avg_sq")}
        for c, moments in chunks.items():
            flat["exp_avg"][slice(*layout.bounds(c))] = moments.exp_avg
            flat["exp_avg_sq"][slice(*layout.bounds(c))] = moments.exp_avg_sq
        views = {slot: layout.views(flat[slot]) for slot in flat}
        return {f"{i}/{slot}": (torch.tensor(float(step)) if slot == "step" else views[slot][i].clone())
                for i in range(len(layout.sizes)) for slot in ADAMW_SLOTS}

    def nbytes(self) -> int:
        """Bytes of the whole state once the optimizer has stepped (parameters, buffers, two moments each)."""
        module = sum(t.numel() * t.element_size() for t in self.module.state_dict().values())
        slots = 3 if self.outer is not None else 2  # (the outer momentum)
        return module + sum(slots * p.numel() * p.element_size() + 8 for p in self.optimizer.params)

    def params_of(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The trainable parameters in `tensors`, in this replica's order (to fingerprint a state)."""
        names = [name for name, p in self.module.named_parameters() if p.requires_grad]
        return [tensors[PARAM + name] for name in names]


def flatten(info: StateInfo, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(metadata, tensors in key order): the form hivemind's state download carries."""
    keys = sorted(tensors)
    return {**info.to_dict(), "keys": keys}, [tensors[key] for key in keys]


def unflatten(metadata: Any, tensors: Sequence[Any]) -> tuple[StateInfo, dict[str, Any]]:
    """The inverse of :func:`flatten`, for what a peer sent; StateRejected if it does not add up."""
    info = StateInfo.from_dict(metadata)
    keys = metadata.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise StateRejected("the state's list of tensor names is malformed")
    if len(keys) > len(tensors):
        raise StateIncomplete(f"the state names {len(keys)} tensors but only {len(tensors)} came")
    if len(keys) != len(tensors):
        raise StateRejected(f"the state names {len(keys)} tensors but has {len(tensors)}")
    return info, dict(zip(keys, tensors))


def _chunks_of(tensors: Mapping[str, torch.Tensor]) -> tuple[int, dict[int, ChunkMoments]] | None:
    """The chunk size and the sharded moments of a checked state; None if it has none."""
    if CHUNK_ELEMENTS not in tensors:
        return None
    chunks: dict[int, ChunkMoments] = {}
    for name, tensor in tensors.items():
        parts = name.split("/")
        if name.startswith(ZERO) and len(parts) == 3 and parts[2] == "steps":
            c = int(parts[1])
            chunks[c] = ChunkMoments(tensors[f"{ZERO}{c}/exp_avg"], tensors[f"{ZERO}{c}/exp_avg_sq"], int(tensor))
    return int(tensors[CHUNK_ELEMENTS]), chunks


def _rechunk(chunk_elements: int, chunks: dict[int, ChunkMoments], layout: Layout) -> dict[int, ChunkMoments]:
    """Chunks cut with `chunk_elements` as chunks of `layout` (those wholly covered; all when the sizes match)."""
    if chunk_elements == layout.chunk_elements:
        return dict(chunks)
    source = Layout(layout.shapes, chunk_elements)
    covered = torch.zeros(layout.numel, dtype=torch.bool)
    flat = {slot: torch.zeros(layout.numel) for slot in ("exp_avg", "exp_avg_sq")}
    steps = 0
    for c, moments in chunks.items():
        start, end = source.bounds(c)
        covered[start:end] = True
        flat["exp_avg"][start:end], flat["exp_avg_sq"][start:end] = moments.exp_avg, moments.exp_avg_sq
        steps = max(steps, moments.steps)
    return {c: ChunkMoments(flat["exp_avg"][slice(*layout.bounds(c))].clone(),
                            flat["exp_avg_sq"][slice(*layout.bounds(c))].clone(), steps)
            for c in range(layout.num_chunks) if bool(covered[slice(*layout.bounds(c))].all())}


def _check_tensor(name: str, tensor: Any, reference: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise StateRejected(f"{name} is a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != tuple(reference.shape):
        raise StateRejected(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)}")
    if tensor.dtype != reference.dtype:
        raise StateRejected(f"{name} has dtype {tensor.dtype}, expected {reference.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise StateRejected(f"{name} has non-finite values")


def _moment_key(key: str, num_params: int, slots: tuple[str, ...], optimizer: str) -> tuple[int, str]:
    parts = key.split("/")
    if len(parts) == 3 and parts[0] + "/" == OPTIM and parts[2] not in slots and \
            any(parts[2] in other for other in SLOTS.values()):
        raise StateRejected(f"the state holds {parts[2]!r}, a moment of another optimizer: this run's is {optimizer} "
                            "(optimizer.name)")
    if len(parts) != 3 or parts[0] + "/" != OPTIM or not parts[1].isdigit() or parts[2] not in slots:
        raise StateRejected(f"unexpected tensor {key!r} in the state")
    index = int(parts[1])
    if index >= num_params:
        raise StateRejected(f"{key}: the stage has {num_params} trainable parameters")
    return index, parts[2]


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
