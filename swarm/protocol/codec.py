"""Tensors to and from hivemind's `runtime_pb2.Tensor`, with strict checks on what arrives.

Float tensors travel in the run's wire dtype (float32, float16 or bfloat16) and always decode to
float32; integer tensors (token ids, targets) travel losslessly as int32 when their values fit, else
int64, and always decode to int64. float32 and int use hivemind's `NONE` codec and float16 its
`FLOAT16` codec (which saturates at the float16 range instead of overflowing to inf). bfloat16 has
its own path: hivemind's `FLOAT16` codec rejects bf16, and its `NONE` codec sends bf16 as float32
bytes unless the environment variable USE_LEGACY_BFLOAT16=0 was set before import. We send the raw
bf16 bits as an int16 view under dtype "bfloat16", the layout hivemind's non-legacy mode uses, so
hivemind's own decoder reads our tensors too.
"""

from __future__ import annotations

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.config import WIRE_DTYPES
from swarm.protocol.errors import ProtocolError

MAX_TENSOR_RANK = 4  # batch x sequence x hidden is the largest shape a stage exchanges
MAX_TENSOR_ELEMENTS = 2**26  # 256 MiB as float32: refuse to even look at larger declared shapes

_NONE = runtime_pb2.CompressionType.NONE
_FLOAT16 = runtime_pb2.CompressionType.FLOAT16
_INT32_RANGE = (torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max)

# (compression, declared dtype) -> bytes per element in the buffer. Anything else is refused.
_BYTES_PER_ELEMENT = {
    (_NONE, "float32"): 4,
    (_NONE, "float16"): 2,
    (_NONE, "bfloat16"): 2,
    (_NONE, "int32"): 4,
    (_NONE, "int64"): 8,
    # FLOAT16 declares the sender's original dtype, but the buffer always holds float16
    (_FLOAT16, "float32"): 2,
    (_FLOAT16, "float16"): 2,
}


def encode_tensor(tensor: torch.Tensor, wire_dtype: str) -> runtime_pb2.Tensor:
    """Serialize `tensor` for the wire: floats in `wire_dtype`, integers losslessly (int32 or int64).

    0-dim float tensors (losses, scales) always travel as float32: they are a few bytes and
    rounding a loss to bf16 would make it useless for reporting.
    """
    if wire_dtype not in WIRE_DTYPES:
        raise ProtocolError(f"unknown wire dtype {wire_dtype!r}; expected one of {WIRE_DTYPES}")
    tensor = tensor.detach().cpu()
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise ProtocolError(f"cannot send a {tensor.dtype} tensor: only float and integer tensors travel")
    if not tensor.is_floating_point():
        return serialize_torch_tensor(_compact_integers(tensor), _NONE)
    if tensor.dim() == 0 or wire_dtype == "float32":
        return serialize_torch_tensor(tensor.float(), _NONE)
    if wire_dtype == "float16":
        # no allow_inplace: hivemind would clamp the caller's own float32 tensor in place
        return serialize_torch_tensor(tensor.float(), _FLOAT16)
    bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16)
    return runtime_pb2.Tensor(compression=_NONE, buffer=bits.numpy().tobytes(), size=tensor.shape, dtype="bfloat16")


def _compact_integers(tensor: torch.Tensor) -> torch.Tensor:
    """int32 when every value fits (halves the bytes of token ids), int64 otherwise."""
    if tensor.numel() == 0 or (tensor.min() >= _INT32_RANGE[0] and tensor.max() <= _INT32_RANGE[1]):
        return tensor.to(torch.int32)
    return tensor.to(torch.int64)


def expected_buffer_bytes(serialized: runtime_pb2.Tensor, max_elements: int = MAX_TENSOR_ELEMENTS) -> int:
    """Check a tensor header (codec, dtype, rank, element count); return the buffer size it implies.

    Works on the first part of a streamed tensor too, so a receiver can refuse an oversized tensor
    before its parts arrive.
    """
    key = (serialized.compression, serialized.dtype)
    if key not in _BYTES_PER_ELEMENT:
        codec = serialized.compression
        if codec in runtime_pb2.CompressionType.values():
            codec = runtime_pb2.CompressionType.Name(codec)
        raise ProtocolError(f"unsupported tensor encoding: codec {codec}, dtype {serialized.dtype!r}")
    shape = list(serialized.size)
    if len(shape) > MAX_TENSOR_RANK:
        raise ProtocolError(f"tensor rank {len(shape)} exceeds the limit of {MAX_TENSOR_RANK}")
    numel = 1
    for dim in shape:
        numel *= dim  # Python ints: no overflow however absurd the declared shape
    if numel > max_elements:
        raise ProtocolError(f"tensor of shape {shape} has {numel} elements, over the limit of {max_elements}")
    return numel * _BYTES_PER_ELEMENT[key]


def decode_tensor(serialized: runtime_pb2.Tensor, max_elements: int = MAX_TENSOR_ELEMENTS) -> torch.Tensor:
    """Validate and deserialize one complete tensor: float32 for floats, int64 for integers.

    Raises ProtocolError for anything malformed; never allocates more than the buffer that arrived.
    """
    expected = expected_buffer_bytes(serialized, max_elements)
    if len(serialized.buffer) != expected:
        raise ProtocolError(
            f"tensor of shape {list(serialized.size)} and dtype {serialized.dtype} needs {expected} bytes, "
            f"got {len(serialized.buffer)}"
        )
    try:
        tensor = deserialize_torch_tensor(serialized).detach()
    except Exception as e:  # checks above should make this unreachable; never let a peer crash us
        raise ProtocolError(f"could not decode tensor: {type(e).__name__}: {e}") from e
    return tensor.float() if tensor.is_floating_point() else tensor.long()
