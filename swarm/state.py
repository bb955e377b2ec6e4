"""StageState: the one owner of a stage replica's state, read and written as a flat dict of tensors.

A replica's state is its module's ``state_dict`` (parameters and buffers), the optimizer's AdamW
moments, its step, and which averaging round made it. Joining a stage, catching up with it,
checkpoints and export all go through :meth:`StageState.state_dict` and
:meth:`StageState.load_state_dict` (torchtitan's Stateful idea); nothing else reaches into the
module or the optimizer to copy state.

The tensors are flat and named, so they go as they are into safetensors (checkpoints) or, in key
order, into hivemind's state download:

- ``param/<name>``: every entry of the module's ``state_dict()``;
- ``optim/<i>/<slot>``: the AdamW state of the i-th trainable parameter (none before the first step).

Every state that comes from elsewhere is untrusted: :meth:`StageState.check` refuses it unless its
names, shapes and dtypes are exactly this replica's, every value is finite, and it says which
stage, step and round it is. A refused state changes nothing. Pure torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarm.optim import ADAMW_SLOTS, StageOptimizer

PARAM = "param/"
OPTIM = "optim/"
STATE_FORMAT = 2  # bump when the layout changes


class StateRejected(ValueError):
    """A state from elsewhere does not fit this replica, or its content is not believable."""


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


class StageState:
    """A stage replica's parameters, optimizer state, step and round identity, behind one interface.

    Not thread-safe by itself: call it where the replica's parameters cannot change meanwhile (the
    stage's compute thread, or under the averager's state lock).
    """

    def __init__(self, module: nn.Module, optimizer: StageOptimizer, stage: int, round_id: str, group: int = 1):
        self.module, self.optimizer, self.stage = module, optimizer, stage
        self.round_id, self.group = round_id, group

    @property
    def step(self) -> int:
        return self.optimizer.step_count

    @property
    def info(self) -> StateInfo:
        return StateInfo(self.stage, self.step, self.round_id, self.group)

    def state_dict(self) -> tuple[StateInfo, dict[str, torch.Tensor]]:
        """Copies of every tensor of the state (CPU, contiguous), by name, and what the state is."""
        tensors = {PARAM + name: _copy(t) for name, t in self.module.state_dict().items()}
        tensors.update({OPTIM + key: _copy(t) for key, t in self.optimizer.moments().items()})
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
        moments = sorted(names - set(own))
        expected_moments: dict[str, torch.Tensor] = {}
        for key in moments:
            index, slot = _moment_key(key, len(params))
            expected_moments[key] = torch.zeros(()) if slot == "step" else params[index]  # (torch keeps `step` so)
        indices = {_moment_key(key, len(params))[0] for key in moments}
        for index in indices:  # a parameter's moments come whole or not at all
            for slot in ADAMW_SLOTS:
                if f"{OPTIM}{index}/{slot}" not in names:
                    raise StateRejected(f"the state has moments of parameter {index} without its {slot}")
        for name, reference in {**own, **expected_moments}.items():
            _check_tensor(name, tensors[name], reference)

    def load_state_dict(self, info: StateInfo, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace this replica's state with `tensors` (checked first); gradients being accumulated are kept."""
        self.check(info, tensors)
        with torch.no_grad():
            self.module.load_state_dict({name[len(PARAM):]: t for name, t in tensors.items() if name.startswith(PARAM)})
        self.optimizer.load_moments({name[len(OPTIM):]: t for name, t in tensors.items() if name.startswith(OPTIM)},
                                    info.step)
        self.round_id, self.group = info.round_id, info.group

    def nbytes(self) -> int:
        """Bytes of the whole state once the optimizer has stepped (parameters, buffers, two moments each)."""
        module = sum(t.numel() * t.element_size() for t in self.module.state_dict().values())
        return module + sum(2 * p.numel() * p.element_size() + 8 for p in self.optimizer.params)

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
    if len(keys) != len(tensors):
        raise StateRejected(f"the state names {len(keys)} tensors but has {len(tensors)}")
    return info, dict(zip(keys, tensors))


def _check_tensor(name: str, tensor: Any, reference: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise StateRejected(f"{name} is a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != tuple(reference.shape):
        raise StateRejected(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)}")
    if tensor.dtype != reference.dtype:
        raise StateRejected(f"{name} has dtype {tensor.dtype}, expected {reference.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise StateRejected(f"{name} has non-finite values")


def _moment_key(key: str, num_params: int) -> tuple[int, str]:
    parts = key.split("/")
    if len(parts) != 3 or parts[0] + "/" != OPTIM or not parts[1].isdigit() or parts[2] not in ADAMW_SLOTS:
        raise StateRejected(f"unexpected tensor {key!r} in the state")
    index = int(parts[1])
    if index >= num_params:
        raise StateRejected(f"{key}: the stage has {num_params} trainable parameters")
    return index, parts[2]


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
