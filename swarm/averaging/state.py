"""A stage replica's full state as (metadata, tensors), the form hivemind's state download carries.

Pure torch, no I/O. The state is the module's ``state_dict`` (parameters and buffers, by name), the
AdamW moments of every parameter that has them, and the optimizer's step count. The learning rate
is not sent: it follows from the step (``swarm.optim.lr_at``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarm.averaging.errors import StateMismatch
from swarm.optim import StageOptimizer

STATE_FORMAT = 1  # bump when the layout below changes


def pack_state(module: nn.Module, optimizer: StageOptimizer, stage: int, round_id: str,
               group: int) -> tuple[dict, list]:
    """Copies of the replica's tensors, and the metadata that says what they are.

    Call it while nothing steps the optimizer (the tensors are copied, so they stay consistent after).
    """
    names, tensors = [], []
    for name, tensor in module.state_dict().items():
        names.append(name)
        tensors.append(tensor.detach().to("cpu", copy=True))
    moments = []
    for index, slots in sorted(optimizer.optimizer.state_dict()["state"].items()):
        keys = sorted(slots)
        moments.append([int(index), keys])
        tensors.extend(torch.as_tensor(slots[key]).detach().to("cpu", copy=True) for key in keys)
    metadata = {
        "format": STATE_FORMAT,
        "stage": stage,
        "step": optimizer.step_count,
        "round_id": round_id,  # which round made this state, and how many servers it averaged
        "group": group,
        "names": names,
        "moments": moments,
    }
    return metadata, tensors


def check_state(module: nn.Module, optimizer: StageOptimizer, stage: int, metadata: Any,
                tensors: Sequence[torch.Tensor]) -> None:
    """Raise StateMismatch unless (metadata, tensors) is a state of this stage's replica."""
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
        raise StateMismatch(f"unknown state format {metadata.get('format') if isinstance(metadata, dict) else None}")
    if metadata.get("stage") != stage:
        raise StateMismatch(f"the state is of stage {metadata.get('stage')}, not {stage}")
    if not isinstance(metadata.get("step"), int) or metadata["step"] < 0:
        raise StateMismatch(f"bad step {metadata.get('step')!r}")
    if not isinstance(metadata.get("round_id"), str) or not isinstance(metadata.get("group"), int) \
            or metadata["group"] < 1:
        raise StateMismatch("the state does not say which round made it")
    own = module.state_dict()
    if metadata.get("names") != list(own):
        raise StateMismatch("the state's tensor names differ from this stage's module")
    moments = metadata.get("moments")
    if not isinstance(moments, list) or not all(
        isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)
        and all(isinstance(key, str) for key in entry[1]) for entry in moments
    ):
        raise StateMismatch("the state's list of optimizer moments is malformed")
    expected = len(own) + sum(len(keys) for _, keys in moments)
    if len(tensors) != expected:
        raise StateMismatch(f"the state has {len(tensors)} tensors, expected {expected}")
    for (name, mine), theirs in zip(own.items(), tensors):
        _check_shape(name, theirs, mine.shape)
    params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    rest = iter(tensors[len(own):])
    for index, keys in moments:
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise StateMismatch(f"moments of parameter {index!r}, which does not exist")
        for key in keys:
            # `step` is a scalar; every other AdamW slot has its parameter's shape
            _check_shape(f"moment {key} of parameter {index}", next(rest),
                         () if key == "step" else params[index].shape)


def _check_shape(what: str, tensor: Any, shape: Sequence[int]) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(shape):
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise StateMismatch(f"{what} has shape {got}, expected {tuple(shape)}")


def apply_state(module: nn.Module, optimizer: StageOptimizer, stage: int, metadata: dict,
                tensors: Sequence[torch.Tensor]) -> None:
    """Load a state made by :func:`pack_state` into this replica; gradients and sample count are kept.

    Checked first (:func:`check_state`), so a mismatching state changes nothing.
    """
    check_state(module, optimizer, stage, metadata, tensors)
    names = metadata["names"]
    rest = iter(tensors[len(names):])
    moments = {index: {key: next(rest) for key in keys} for index, keys in metadata["moments"]}
    param_groups = optimizer.optimizer.state_dict()["param_groups"]
    with torch.no_grad():
        module.load_state_dict(dict(zip(names, tensors)))
    # torch casts the moments to each parameter's device and dtype (and keeps `step` as it is)
    optimizer.optimizer.load_state_dict({"state": moments, "param_groups": param_groups})
    optimizer.step_count = int(metadata["step"])
