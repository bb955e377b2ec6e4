"""Stage requests and replies: what a trainer asks of a stage server, and what it gets back.

Request metadata: `kind` ("forward" | "backward"), `stage`, `request_id`, `wire_dtype` (the dtype
float tensors travel in, both ways) and `has_targets` (last stage only). Its tensors, in order:

    forward                     [inputs]                  -> reply [outputs]
    forward, last stage         [inputs, targets]         -> reply [loss] (0-dim)
    backward                    [inputs, grad_outputs]    -> reply [grad_inputs] ([] for stage 0)
    backward, last stage        [inputs, targets]         -> reply [grad_inputs]

The last stage's backward has no grad_outputs: the gradient of the loss is implicitly 1.
A backward may carry `forward_step`: the step the stage reported in its forward reply, so the
server can tell how many of its own steps the micro-batch's gradient is stale by. A forward may
carry `backward_follows: true`: the caller will send this micro-batch's backward (same request
id), so the server may keep the forward's graph for it instead of recomputing the forward then.
A request may carry `patient: true`: its caller knows no other server of the stage (or the call is a backward
that belongs on this server), so a server refusing by time (its max_wait) takes it however long it waits; a full
queue still refuses it.

Expert servers (model.moe.expert_servers) take the same messages under their own namespace
(`experts_namespace`): `stage` is then the MoE block's index, `inputs` the tokens [rows, d_model]
of each expert in turn, and `experts` says which: `[[expert, rows], ...]`, the rows adding up to
the tensor's. A backward carries `grad_outputs` of the same shape and `samples`, the sequences of
the micro-batch (an expert counts them toward its batch even when it got no token of it), and
may carry `stage_step`, the calling stage's step (an expert behind it ends its batch there).
An MoE stage's forward reply may name the experts that did not answer, `moe_lost`
(`[[block, [expert, ...]], ...]`); the trainer sends it back with that micro-batch's backward, so
the backward leaves out exactly the experts the forward did.
Reply metadata: `{"ok": true, "server_step": N, ...}` or `{"ok": false, "code": C, "error": MESSAGE}`.
Fields a reader does not know are ignored, so newer peers can add some.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from swarm.config import WIRE_DTYPES
from swarm.protocol.codec import encode_tensor
from swarm.protocol.errors import INTERNAL, ProtocolError, RemoteStageError
from swarm.protocol.framing import DEFAULT_LIMITS, WireLimits, encode_metadata, gather_frames, to_frames

FORWARD, BACKWARD = "forward", "backward"
KINDS = (FORWARD, BACKWARD)
MAX_REQUEST_ID_CHARS = 256
MAX_ERROR_CHARS = 2000  # error replies are for logs and people, not for shipping tracebacks
MAX_EXPERT_ENTRIES = 1024  # experts one request may name (a run has far fewer per block)
MAX_MOE_BLOCKS = 256  # MoE blocks a `moe_lost` may name


def experts_namespace(run_id: str) -> str:
    """The P2P handler namespace of a run's expert servers (one per peer, every MoE block)."""
    return f"swarm/{run_id}/experts"


def stage_namespace(run_id: str, stage: int) -> str:
    """The P2P handler namespace of one stage of one run: lets a peer host several stages."""
    return f"swarm/{run_id}/stage{stage}"


@dataclass
class StageRequest:
    """One forward or backward call for one micro-batch on one stage; validated on construction."""

    kind: str
    stage: int
    request_id: str
    inputs: torch.Tensor
    targets: torch.Tensor | None = None  # last stage only
    grad_outputs: torch.Tensor | None = None  # backward on every stage but the last
    wire_dtype: str = "float32"
    forward_step: int | None = None  # backward: the step this stage reported when it ran the forward
    backward_follows: bool = False  # forward: the caller will send the backward of this micro-batch
    patient: bool = False  # the caller has no other server to go to: not refused by time (max_wait)
    experts: list[tuple[int, int]] | None = None  # expert calls: (expert, rows of inputs) in order
    samples: int | None = None  # expert backward: sequences of the micro-batch the tokens come from
    stage_step: int | None = None  # expert backward: the calling stage's optimizer step
    moe_lost: list[tuple[int, list[int]]] | None = None  # MoE stage backward: experts its forward went without
    caller: str | None = None  # the peer the request came from (set by the receiving side, never sent)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ProtocolError(f"request kind must be one of {KINDS}, got {self.kind!r}")
        if not _is_int(self.stage) or self.stage < 0:
            raise ProtocolError(f"stage must be a non-negative integer, got {self.stage!r}")
        if not isinstance(self.request_id, str) or len(self.request_id) > MAX_REQUEST_ID_CHARS:
            raise ProtocolError(f"request_id must be a string of at most {MAX_REQUEST_ID_CHARS} characters")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ProtocolError(f"wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if self.forward_step is not None and (not _is_int(self.forward_step) or self.forward_step < 0):
            raise ProtocolError(f"forward_step must be a non-negative integer, got {self.forward_step!r}")
        if not isinstance(self.backward_follows, bool):
            raise ProtocolError(f"backward_follows must be a boolean, got {self.backward_follows!r}")
        if not isinstance(self.patient, bool):
            raise ProtocolError(f"patient must be a boolean, got {self.patient!r}")
        if self.targets is not None and (self.targets.is_floating_point() or self.targets.is_complex()):
            raise ProtocolError(f"targets must be integer token ids, got {self.targets.dtype}")
        if self.grad_outputs is not None and not self.grad_outputs.is_floating_point():
            raise ProtocolError(f"grad_outputs must be a float tensor, got {self.grad_outputs.dtype}")
        if self.kind == FORWARD and self.grad_outputs is not None:
            raise ProtocolError("a forward request carries no grad_outputs")
        if self.kind == BACKWARD and (self.targets is None) == (self.grad_outputs is None):
            raise ProtocolError("a backward request carries either targets (last stage) or grad_outputs")
        if self.experts is not None:
            self.experts = _expert_rows(self.experts, self.inputs)
        if self.samples is not None and (not _is_int(self.samples) or self.samples < 1):
            raise ProtocolError(f"samples must be a positive integer, got {self.samples!r}")
        if self.stage_step is not None and (not _is_int(self.stage_step) or self.stage_step < 0):
            raise ProtocolError(f"stage_step must be a non-negative integer, got {self.stage_step!r}")
        if self.moe_lost is not None:
            self.moe_lost = check_moe_lost(self.moe_lost)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors in wire order."""
        second = self.targets if self.targets is not None else self.grad_outputs
        return [self.inputs] if second is None else [self.inputs, second]

    def metadata(self) -> dict[str, Any]:
        meta = dict(
            kind=self.kind,
            stage=self.stage,
            request_id=self.request_id,
            wire_dtype=self.wire_dtype,
            has_targets=self.targets is not None,
        )
        if self.forward_step is not None:
            meta["forward_step"] = self.forward_step
        if self.backward_follows:
            meta["backward_follows"] = True
        if self.patient:
            meta["patient"] = True
        for name in ("experts", "samples", "stage_step", "moe_lost"):
            if getattr(self, name) is not None:
                meta[name] = getattr(self, name)
        return meta


@dataclass
class StageReply:
    """A successful answer: output tensors plus the server's optimizer step and any extra fields."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    server_step: int | None = None
    info: dict[str, Any] = field(default_factory=dict)  # other metadata fields, passed through
    server: str | None = None  # the peer that answered (set by the receiving side, never sent)

    def metadata(self) -> dict[str, Any]:
        meta = dict(self.info)
        meta.update(ok=True, server_step=self.server_step)
        return meta


def request_frames(request: StageRequest, limits: WireLimits = DEFAULT_LIMITS) -> Iterator:
    """Encode a request into `ExpertRequest` frames; ProtocolError now if it breaks `limits`."""
    encoded = [encode_tensor(tensor, request.wire_dtype) for tensor in request.tensors]
    return to_frames(request.metadata(), encoded, runtime_pb2.ExpertRequest, limits)


def parse_request(meta: dict, tensors: list[torch.Tensor]) -> StageRequest:
    """Build a StageRequest from received metadata and tensors; ProtocolError if they do not fit."""
    kind, has_targets = meta.get("kind"), meta.get("has_targets", False)
    if kind not in KINDS:
        raise ProtocolError(f"request kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(has_targets, bool):
        raise ProtocolError(f"has_targets must be a boolean, got {has_targets!r}")
    expected = 2 if (has_targets or kind == BACKWARD) else 1
    if len(tensors) != expected:
        raise ProtocolError(
            f"a {kind} request {'with' if has_targets else 'without'} targets carries {expected} "
            f"tensor(s), got {len(tensors)}"
        )
    second = tensors[1] if expected == 2 else None
    return StageRequest(
        kind=kind,
        stage=meta.get("stage"),
        request_id=meta.get("request_id"),
        inputs=tensors[0],
        targets=second if has_targets else None,
        grad_outputs=None if has_targets else second,
        wire_dtype=meta.get("wire_dtype", "float32"),
        forward_step=meta.get("forward_step"),
        backward_follows=meta.get("backward_follows", False),
        patient=meta.get("patient", False),
        experts=meta.get("experts"),
        samples=meta.get("samples"),
        stage_step=meta.get("stage_step"),
        moe_lost=meta.get("moe_lost"),
    )


async def receive_request(
    stream: AsyncIterator,
    limits: WireLimits = DEFAULT_LIMITS,
    on_metadata: Callable[[dict], None] | None = None,
) -> StageRequest:
    """Read and validate one request from a stream of `ExpertRequest` frames.

    `on_metadata` sees the metadata before any tensor is read, and may raise to refuse the request
    without buffering it (a server whose queue is full does).
    """
    return parse_request(*await gather_frames(stream, limits, on_metadata))


def reply_frames(reply: StageReply, wire_dtype: str, limits: WireLimits = DEFAULT_LIMITS) -> Iterator:
    """Encode a reply into `ExpertResponse` frames, floats in `wire_dtype`."""
    encoded = [encode_tensor(tensor, wire_dtype) for tensor in reply.tensors]
    return to_frames(reply.metadata(), encoded, runtime_pb2.ExpertResponse, limits)


def error_frames(code: str, message: str) -> list[runtime_pb2.ExpertResponse]:
    """The single frame of an error reply."""
    meta = dict(ok=False, code=str(code), error=str(message)[:MAX_ERROR_CHARS])
    return [runtime_pb2.ExpertResponse(metadata=encode_metadata(meta))]


def raise_if_error(meta: dict) -> None:
    """Raise RemoteStageError for an error reply, ProtocolError for metadata that is not a reply."""
    ok = meta.get("ok")
    if ok is True:
        return
    if ok is not False:
        raise ProtocolError(f"reply metadata must have a boolean 'ok', got {ok!r}")
    code, message = meta.get("code", INTERNAL), meta.get("error", "")
    raise RemoteStageError(str(code), str(message)[:MAX_ERROR_CHARS])


def parse_reply(meta: dict, tensors: list[torch.Tensor]) -> StageReply:
    """Build a StageReply from received metadata and tensors (RemoteStageError for error replies)."""
    raise_if_error(meta)
    step = meta.get("server_step")
    if step is not None and not _is_int(step):
        raise ProtocolError(f"server_step must be an integer or absent, got {step!r}")
    info = {key: value for key, value in meta.items() if key not in ("ok", "server_step")}
    return StageReply(tensors=tensors, server_step=step, info=info)


async def receive_reply(stream: AsyncIterator, limits: WireLimits = DEFAULT_LIMITS) -> StageReply:
    """Read one reply; an error reply raises as soon as its metadata arrives."""
    return parse_reply(*await gather_frames(stream, limits, on_metadata=raise_if_error))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expert_rows(entries: object, inputs: torch.Tensor) -> list[tuple[int, int]]:
    """`experts` checked: distinct non-negative expert indices with row counts adding up to the inputs' rows."""
    if not isinstance(entries, (list, tuple)) or len(entries) > MAX_EXPERT_ENTRIES:
        raise ProtocolError(f"experts must be a list of at most {MAX_EXPERT_ENTRIES} [expert, rows] pairs")
    rows = []
    for entry in entries:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 2 or not all(_is_int(v) for v in entry)
                or min(entry) < 0):
            raise ProtocolError(f"an experts entry must be [expert, rows] of non-negative integers, got {entry!r}")
        rows.append((entry[0], entry[1]))
    if len({expert for expert, _ in rows}) != len(rows):
        raise ProtocolError("experts names an expert twice")
    total = sum(count for _, count in rows)
    if inputs.dim() != 2 or inputs.shape[0] != total:
        raise ProtocolError(f"experts account for {total} rows, but the inputs have shape {list(inputs.shape)} "
                            "(expected [rows, d_model])")
    return rows


def check_moe_lost(entries: object) -> list[tuple[int, list[int]]]:
    """`moe_lost` checked: [[block, [expert, ...]], ...] of non-negative integers, bounded."""
    if not isinstance(entries, (list, tuple)) or len(entries) > MAX_MOE_BLOCKS:
        raise ProtocolError(f"moe_lost must be a list of at most {MAX_MOE_BLOCKS} [block, [experts]] pairs")
    lost = []
    for entry in entries:
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and _is_int(entry[0]) and entry[0] >= 0
        experts = entry[1] if ok else None
        if not (ok and isinstance(experts, (list, tuple)) and len(experts) <= MAX_EXPERT_ENTRIES
                and all(_is_int(e) and e >= 0 for e in experts)):
            raise ProtocolError(f"a moe_lost entry must be [block, [expert, ...]] of non-negative integers, "
                                f"got {entry!r}"[:300])
        lost.append((entry[0], list(experts)))
    return lost
