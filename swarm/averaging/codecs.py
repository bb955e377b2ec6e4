"""Pure-torch tensor codecs for averaging, pluggable into hivemind's serialization.

Why: under numpy 2, hivemind 1.1.12's 8-bit codecs cannot decode, its blockwise codec needs
bitsandbytes, and its float16 codec rejects bfloat16. The codecs below replace them.

How hivemind finds a codec: a receiving peer decodes a `runtime_pb2.Tensor` by its
`CompressionType` enum value, looked up in hivemind's registry. That enum is closed (its `Name()`
rejects values it does not list), so each codec takes over an existing slot. `install_codecs()`
puts them there; our averaging code calls it once at start (nothing happens at import):

  FLOAT16        <- Float16Codec. Same bytes as hivemind's own for float16/float32/float64
                    inputs, so stock and swarm peers interoperate; bfloat16 inputs are new (their
                    dtype field says "bfloat16", which a stock peer rejects loudly).
  QUANTILE_8BIT  <- BFloat16Codec. No slot means "bfloat16", and MEANSTD_16BIT is a working,
                    different format. The two stock 8-bit slots cannot decode under numpy 2;
                    QUANTILE_8BIT is the costlier of the two and the less likely to be revived.
  BLOCKWISE_8BIT <- Blockwise8BitCodec. Stock needs bitsandbytes and another byte layout.
  UNIFORM_8BIT   <- Float8Codec. The other stock 8-bit slot (see QUANTILE_8BIT).

Cross-version consequence: a peer that has not installed these codecs cannot read QUANTILE_8BIT,
BLOCKWISE_8BIT or UNIFORM_8BIT messages from one that has, and vice versa. Our new formats start with an 8-byte
magic that a stock decoder reads as an absurd element count, so it fails instead of returning
garbage, and our decoders reject stock layouts with a ValueError. All swarm peers install ours. A
clean slot would need a new enum value plus patched hivemind (de)serializers; we avoid that.

Non-finite values: finite values never become non-finite (16-bit codecs saturate at the target
format's largest finite value), and NaN/±inf stay non-finite, so a broken gradient is still visible
after averaging. Blockwise 8-bit cannot keep the sign of inf: NaN and ±inf all decode as NaN.
They are left out of their block's scale, so the rest of the block keeps its precision. Float8 cannot
either (float8_e4m3fn has no inf): NaN and +-inf decode as NaN, left out of the scale.

A sender can round a tensor onto a codec's grid in advance (:func:`grid_for`; :func:`float8_grid`): the
rounded tensor then goes through the codec unchanged, whole or cut into the parts hivemind's all-reduce
sends. That is what error feedback needs (swarm.averaging.feedback): what the codec would round off stays
with the sender instead of being lost on the way. The 16-bit codecs round each value alone, and Float8Codec's
power-of-two scale nests, so all three have such a grid; Blockwise8BitCodec does not (its blocks start
wherever a part starts).

Byte order is the host's (little-endian on every platform we run), as in hivemind.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

BLOCK_SIZE = 4096  # values that share one float32 scale in Blockwise8BitCodec
MAX_BLOCK_SIZE = 2**20  # the largest block size a Blockwise8BitCodec message may declare
_FLOAT_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}
_FP16_MAX = torch.finfo(torch.float16).max
_BF16_MAX = torch.finfo(torch.bfloat16).max
_FP32_MAX = torch.finfo(torch.float32).max
_NONFINITE_CODE = -128  # symmetric 8-bit codes only use -127..127; the spare one marks NaN/inf


class _SwarmCodec(CompressionBase):
    def __repr__(self) -> str:
        return f"swarm.{type(self).__name__}()"


class Float16Codec(_SwarmCodec):
    """Any float tensor -> float16 on the wire -> the original dtype. Byte-compatible with hivemind."""

    compression_type = runtime_pb2.CompressionType.FLOAT16

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype_name = _float_dtype_name(tensor, self)
        wire = _saturate(tensor.detach(), _FP16_MAX).to(torch.float16)
        return _message(self, tensor, dtype_name, _to_bytes(wire))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        dtype, shape, numel = _declared(serialized_tensor, self)
        _check_length(serialized_tensor, numel * 2, self)
        values = _from_bytes(serialized_tensor.buffer, 0, numel, torch.float16)
        return _finish(values, dtype, shape, serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2 / info.descriptor.dtype.itemsize


class BFloat16Codec(_SwarmCodec):
    """Any float tensor -> bfloat16 bits on the wire -> the original dtype."""

    compression_type = runtime_pb2.CompressionType.QUANTILE_8BIT
    MAGIC = b"swarmBF\x01"
    HEADER = struct.Struct("<8sQ")  # magic, element count

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype_name = _float_dtype_name(tensor, self)
        wire = _saturate(tensor.detach(), _BF16_MAX).to(torch.bfloat16)
        header = self.HEADER.pack(self.MAGIC, wire.numel())
        return _message(self, tensor, dtype_name, header + _to_bytes(wire))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        dtype, shape, numel = _declared(serialized_tensor, self)
        _read_header(serialized_tensor, self.HEADER, self.MAGIC, numel, self)
        _check_length(serialized_tensor, self.HEADER.size + numel * 2, self)
        values = _from_bytes(serialized_tensor.buffer, self.HEADER.size, numel, torch.bfloat16)
        return _finish(values, dtype, shape, serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2 / info.descriptor.dtype.itemsize


class Blockwise8BitCodec(_SwarmCodec):
    """Blockwise absmax 8-bit quantization: int8 codes plus one float32 absmax per BLOCK_SIZE values.

    A value x in a block with absmax m is sent as round(127 * x / m), so it decodes within m / 254.
    All-zero blocks decode exactly; non-finite values decode as NaN (see the module docstring).
    """

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    MAGIC = b"swarmB8\x01"
    HEADER = struct.Struct("<8sQQ")  # magic, element count, block size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype_name = _float_dtype_name(tensor, self)
        flat = tensor.detach().reshape(-1).to(torch.float32)
        numel, num_blocks = flat.numel(), math.ceil(flat.numel() / BLOCK_SIZE)
        blocks = torch.nn.functional.pad(flat, (0, num_blocks * BLOCK_SIZE - numel)).view(num_blocks, BLOCK_SIZE)
        finite = blocks.isfinite()
        blocks = blocks.masked_fill(~finite, 0.0)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        codes = torch.round(blocks / torch.where(absmax > 0, absmax, 1.0) * 127).to(torch.int8)
        codes.masked_fill_(~finite, _NONFINITE_CODE)
        header = self.HEADER.pack(self.MAGIC, numel, BLOCK_SIZE)
        buffer = header + _to_bytes(absmax) + _to_bytes(codes.view(-1)[:numel])
        return _message(self, tensor, dtype_name, buffer)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        dtype, shape, numel = _declared(serialized_tensor, self)
        (block_size,) = _read_header(serialized_tensor, self.HEADER, self.MAGIC, numel, self)
        if not 0 < block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"{self!r}: header declares block size {block_size}, outside 1..{MAX_BLOCK_SIZE}")
        num_blocks = -(-numel // block_size)  # integer ceil: no float rounding of huge counts
        _check_length(serialized_tensor, self.HEADER.size + 4 * num_blocks + numel, self)
        absmax = _from_bytes(serialized_tensor.buffer, self.HEADER.size, num_blocks, torch.float32)
        if not (absmax.isfinite().all() and (absmax >= 0).all()):
            raise ValueError(f"{self!r}: block scales must be finite and non-negative")
        codes = _from_bytes(serialized_tensor.buffer, self.HEADER.size + 4 * num_blocks, numel, torch.int8)
        # one scale per value, never more: a block wider than the message repeats its scale numel times
        scales = absmax.repeat_interleave(min(block_size, numel))[:numel]
        values = codes.to(torch.float32).div_(127).mul_(scales)
        values.masked_fill_(codes == _NONFINITE_CODE, math.nan)
        return _finish(values, dtype, shape, serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (1 + 4 / BLOCK_SIZE) / info.descriptor.dtype.itemsize


class Float8Codec(_SwarmCodec):
    """float8 (e4m3) codes times one power-of-two scale per message: 1 byte a value.

    The scale is the smallest power of two 2**e with absmax / 2**e <= 448 (float8_e4m3fn's largest value),
    so each value keeps 4 significant bits (within 2**-4 of itself, relative) down to 2**-6 of the scale
    and decodes within 2**-10 of the scale below that. A power of two makes the format nest: a tensor on the grid
    of its own scale (float8_grid) is on the grid of any part of it, whose scale can only be smaller, so
    it goes through unchanged however the all-reduce cuts it.
    """

    compression_type = runtime_pb2.CompressionType.UNIFORM_8BIT
    MAGIC = b"swarmF8\x01"
    HEADER = struct.Struct("<8sQi")  # magic, element count, the scale's exponent

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype_name = _float_dtype_name(tensor, self)
        flat = tensor.detach().reshape(-1).to(torch.float32)
        exponent = _float8_exponent(flat)
        codes = _float8_codes(flat, exponent)
        header = self.HEADER.pack(self.MAGIC, flat.numel(), exponent)
        return _message(self, tensor, dtype_name, header + _to_bytes(codes))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        dtype, shape, numel = _declared(serialized_tensor, self)
        (exponent,) = _read_header(serialized_tensor, self.HEADER, self.MAGIC, numel, self)
        if not FLOAT8_MIN_EXPONENT <= exponent <= FLOAT8_MAX_EXPONENT:
            raise ValueError(f"{self!r}: scale exponent {exponent} outside "
                             f"{FLOAT8_MIN_EXPONENT}..{FLOAT8_MAX_EXPONENT}")
        _check_length(serialized_tensor, self.HEADER.size + numel, self)
        codes = _from_bytes(serialized_tensor.buffer, self.HEADER.size, numel, torch.float8_e4m3fn)
        return _finish(_float8_values(codes, exponent), dtype, shape, serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1 / info.descriptor.dtype.itemsize


FLOAT8_MAX = 448.0  # float8_e4m3fn's largest finite value
# the scale's exponent stays where 2**e and every code times it are float32 values exactly (2**-9 codes
# times 2**-126: 2**-135, a float32 subnormal)
FLOAT8_MIN_EXPONENT, FLOAT8_MAX_EXPONENT = -126, 127


def _float8_exponent(flat: torch.Tensor) -> int:
    """The smallest e with max|finite values| / 2**e <= FLOAT8_MAX (within the exponent's range)."""
    finite = flat[flat.isfinite()]
    absmax = float(finite.abs().max()) if finite.numel() else 0.0
    if absmax == 0.0:
        return FLOAT8_MIN_EXPONENT
    mantissa, exponent = math.frexp(absmax / FLOAT8_MAX)  # absmax / 448 = mantissa * 2**exponent, 0.5 <= m < 1
    if mantissa == 0.5:
        exponent -= 1  # an exact power of two is its own bound
    return min(max(exponent, FLOAT8_MIN_EXPONENT), FLOAT8_MAX_EXPONENT)


def float8_grid(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded as Float8Codec sends it (float32, same shape): what the codec then sends of it unchanged,
    whole or in any parts. Non-finite values become NaN."""
    flat = tensor.detach().reshape(-1).to(torch.float32)
    exponent = _float8_exponent(flat)
    return _float8_values(_float8_codes(flat, exponent), exponent).reshape(tensor.shape)


def _float8_codes(flat: torch.Tensor, exponent: int) -> torch.Tensor:
    scaled = torch.ldexp(flat, torch.tensor(-exponent, dtype=torch.float32))
    # (the cast would saturate inf to a finite code)
    return torch.where(flat.isfinite(), scaled, math.nan).to(torch.float8_e4m3fn)


def _float8_values(codes: torch.Tensor, exponent: int) -> torch.Tensor:
    values = torch.ldexp(codes.to(torch.float32), torch.tensor(exponent, dtype=torch.float32))
    # a code just under float32's largest value, times its scale, can round past it: finite stays finite
    return torch.where(values.isinf(), values.sign() * _FP32_MAX, values)


_CODECS_BY_NAME = {
    "none": NoCompression,
    "float16": Float16Codec,
    "bfloat16": BFloat16Codec,
    "blockwise8bit": Blockwise8BitCodec,
    "float8": Float8Codec,
}
_INSTALLED = (Float16Codec, BFloat16Codec, Blockwise8BitCodec, Float8Codec)


def compression_for(name: str) -> CompressionBase:
    """The codec for a run config's `averaging.compression` name."""
    if name not in _CODECS_BY_NAME:
        raise ValueError(f"unknown averaging compression {name!r}; choose one of {sorted(_CODECS_BY_NAME)}")
    return _CODECS_BY_NAME[name]()


def grid_for(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a codec of fixed grid, the function that rounds a tensor as that codec sends it (whole or in any parts:
    the result goes through unchanged); None for "none", which rounds nothing. ValueError for blockwise8bit,
    whose grid depends on where the all-reduce cuts the tensor."""
    if name == "none":
        return None
    if name == "float8":
        return float8_grid
    if name in ("float16", "bfloat16"):
        limit, wire = (_FP16_MAX, torch.float16) if name == "float16" else (_BF16_MAX, torch.bfloat16)
        return lambda tensor: _saturate(tensor.detach(), limit).to(wire).to(torch.float32)
    raise ValueError(f"the {name!r} codec has no fixed grid to round onto in advance; choose one of "
                     "float8, float16, bfloat16, none")


def installed_compression(name: str) -> CompressionBase:
    """compression_for(name), with our codecs installed into hivemind first (before an averaging process
    forks, so it decodes with them too)."""
    install_codecs()
    return compression_for(name)


def install_codecs() -> None:
    """Make hivemind (de)serialize FLOAT16, QUANTILE_8BIT, BLOCKWISE_8BIT and UNIFORM_8BIT with our codecs.
    Idempotent."""
    registry = _hivemind_registry()
    for codec_class in _INSTALLED:
        slot = runtime_pb2.CompressionType.Name(codec_class.compression_type)
        if type(registry.get(slot)) is not codec_class:
            registry[slot] = codec_class()


def codecs_installed() -> bool:
    """Whether hivemind currently decodes our slots with our codecs."""
    registry = _hivemind_registry()
    return all(type(registry.get(runtime_pb2.CompressionType.Name(c.compression_type))) is c for c in _INSTALLED)


def _hivemind_registry() -> dict[str, CompressionBase]:
    registry = getattr(hivemind_serialization, "_BASE_COMPRESSION_TYPES", None)
    if not isinstance(registry, dict):
        raise RuntimeError(
            "hivemind.compression.serialization has no _BASE_COMPRESSION_TYPES dict: swarm's codecs target "
            "hivemind 1.1.12; install that version or port install_codecs() to the new registry"
        )
    return registry


def _float_dtype_name(tensor: torch.Tensor, codec: CompressionBase) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _FLOAT_DTYPES:
        raise ValueError(f"{codec!r} encodes only {sorted(_FLOAT_DTYPES)} tensors, got {tensor.dtype}")
    return name


def _saturate(tensor: torch.Tensor, limit: float) -> torch.Tensor:
    """A float32/float64 copy with finite values clamped to [-limit, limit]; NaN and inf kept."""
    wide = tensor.to(torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    return torch.where(wide.isinf(), wide, wide.clamp(-limit, limit))


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(buffer: bytes, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A writable 1-D tensor of `count` values of `dtype` copied from `buffer` at `offset`."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    chunk = bytearray(memoryview(buffer)[offset : offset + count * dtype.itemsize])
    return torch.frombuffer(chunk, dtype=dtype)


def _message(codec: CompressionBase, source: torch.Tensor, dtype_name: str, buffer: bytes) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        compression=codec.compression_type,
        buffer=buffer,
        size=source.shape,
        dtype=dtype_name,
        requires_grad=source.requires_grad,
    )


def _declared(message: runtime_pb2.Tensor, codec: CompressionBase) -> tuple[torch.dtype, tuple[int, ...], int]:
    """The original dtype, shape and element count a message declares, checked before anything is allocated.

    Every codec here spends at least one byte a value, so a shape of more values than the buffer has
    bytes is a lie (a peer's header must never decide how much we allocate; the bytes received do).
    """
    if message.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{codec!r} cannot decode to dtype {message.dtype!r}; expected one of {sorted(_FLOAT_DTYPES)}")
    shape = tuple(message.size)
    numel = math.prod(shape)  # Python ints: no overflow however absurd the declared shape
    if numel > len(message.buffer):
        raise ValueError(f"{codec!r}: shape {list(shape)} declares {numel} values, more than the "
                         f"{len(message.buffer)} bytes received can hold")
    return _FLOAT_DTYPES[message.dtype], shape, numel


def _read_header(
    message: runtime_pb2.Tensor, header: struct.Struct, magic: bytes, numel: int, codec: CompressionBase
) -> tuple[int, ...]:
    """Check the magic and element count in the buffer's header; return the remaining header fields."""
    if len(message.buffer) < header.size:
        raise ValueError(f"{codec!r}: buffer of {len(message.buffer)} bytes is shorter than its header")
    found_magic, found_numel, *rest = header.unpack_from(message.buffer)
    if found_magic != magic:
        raise ValueError(
            f"{codec!r}: buffer starts with {found_magic!r}, not {magic!r}; the sender is not a swarm peer "
            "with the same codecs (stock hivemind uses another layout for this compression type)"
        )
    if found_numel != numel:
        raise ValueError(f"{codec!r}: header holds {found_numel} values but the declared shape holds {numel}")
    return tuple(rest)


def _check_length(message: runtime_pb2.Tensor, expected: int, codec: CompressionBase) -> None:
    if len(message.buffer) != expected:
        raise ValueError(
            f"{codec!r}: buffer has {len(message.buffer)} bytes, expected {expected} for shape "
            f"{tuple(message.size)} (truncated or mislabelled message)"
        )


def _finish(values: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], message: runtime_pb2.Tensor):
    """The decoded values in their original dtype and shape."""
    return values.to(dtype).reshape(shape).requires_grad_(message.requires_grad)
