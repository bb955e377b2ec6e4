"""swarm.protocol: the stage RPCs between trainers and stage servers, shared by both sides.

Layers, bottom up:

- ``errors``    every exception of the package (all subclass StageRPCError) and the error-reply codes
- ``codec``     torch.Tensor <-> hivemind ``runtime_pb2.Tensor`` in the run's wire dtype, strictly checked
- ``framing``   one message = msgpack metadata + tensors, streamed as ExpertRequest/ExpertResponse
                frames in parts under ``WireLimits``
- ``messages``  StageRequest / StageReply: what forward and backward carry, built and parsed with checks
- ``limits``    ``RequestLimits``: how large a run's stage and expert requests may be, computed once from its
                config for both sides of the contract (``stage_wire_limits`` underneath)
- ``slots``     ``CallerSlots``: slots under a global, a per-caller and a newcomers' cap
- ``service``   server side: ``StageService`` (a hivemind ServicerBase) delegating to a ``StageHandler``;
                ``register(p2p, handler, namespace)``; request slots shared per caller, each with
                deadlines for its first frame, every next one and the last
- ``client``    trainer side: ``StageClient.forward`` / ``.backward`` with a timeout on every call

Both RPCs are stream-in, stream-out, so tensors of any size under the limits cross hivemind's 4 MiB
message cap. One P2P can serve several stages: each registers under its own ``stage_namespace``.
"""

from swarm.protocol.client import DEFAULT_CALL_TIMEOUT, StageClient
from swarm.protocol.codec import MAX_TENSOR_ELEMENTS, MAX_TENSOR_RANK, decode_tensor, encode_tensor
from swarm.protocol.errors import (
    BAD_REQUEST,
    BUSY,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    DialHeldOff,
    ProtocolError,
    RemoteStageError,
    RequestRejected,
    StageRPCError,
    StageUnavailable,
)
from swarm.protocol.framing import DEFAULT_LIMITS, WireLimits
from swarm.protocol.limits import RequestLimits, stage_wire_limits
from swarm.protocol.messages import (
    BACKWARD,
    FORWARD,
    StageReply,
    StageRequest,
    experts_namespace,
    parse_reply,
    parse_request,
    receive_reply,
    receive_request,
    reply_frames,
    request_frames,
    stage_namespace,
)
from swarm.protocol.service import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_RECEIVE_TIMEOUT,
    Admission,
    StageHandler,
    StageService,
    register,
)
from swarm.protocol.slots import CallerSlots

__all__ = [
    "BACKWARD",
    "BAD_REQUEST",
    "BUSY",
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_FIRST_BYTE_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_RECEIVE_TIMEOUT",
    "FORWARD",
    "INTERNAL",
    "MAX_TENSOR_ELEMENTS",
    "MAX_TENSOR_RANK",
    "NOT_READY",
    "WRONG_STAGE",
    "Admission",
    "CallerSlots",
    "ProtocolError",
    "RemoteStageError",
    "RequestRejected",
    "StageClient",
    "StageHandler",
    "StageRPCError",
    "StageReply",
    "StageRequest",
    "StageService",
    "DialHeldOff",
    "StageUnavailable",
    "WireLimits",
    "decode_tensor",
    "encode_tensor",
    "parse_reply",
    "parse_request",
    "receive_reply",
    "receive_request",
    "register",
    "reply_frames",
    "request_frames",
    "experts_namespace",
    "stage_namespace",
    "RequestLimits",
    "stage_wire_limits",
]
