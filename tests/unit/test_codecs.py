"""Averaging codecs: accuracy, wire formats, malformed input, and hivemind's registry."""

from __future__ import annotations

import asyncio
import math
import struct

import numpy
import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.averaging.codecs import (
    BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    BFloat16Codec,
    Blockwise8BitCodec,
    Float8Codec,
    Float16Codec,
    codecs_installed,
    compression_for,
    float8_grid,
    install_codecs,
)
from swarm.config import COMPRESSIONS

pytestmark = pytest.mark.timeout(60)

CODECS = (Float16Codec(), BFloat16Codec(), Blockwise8BitCodec(), Float8Codec())
SHAPES = ((), (1,), (7,), (BLOCK_SIZE - 1,), (BLOCK_SIZE,), (BLOCK_SIZE + 1,), (3, 5, 7), (129, 65), (3, 10_000))
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def l2_bound(codec) -> float:
    """The relative L2 error a codec keeps to on normal values: float8's 4 significant bits round each value
    within 2**-5 of itself, ~2.7e-2 in L2 (measured); the others' (above) 1e-2."""
    return 3.5e-2 if isinstance(codec, Float8Codec) else 1.2e-2


def roundtrip(codec, tensor: torch.Tensor) -> torch.Tensor:
    return codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def relative_l2(decoded: torch.Tensor, original: torch.Tensor) -> float:
    return ((decoded.double() - original.double()).norm() / original.double().norm()).item()


@pytest.fixture
def isolated_registry(monkeypatch):
    """A stock copy of hivemind's registry for the test to install into; the real one is restored after."""
    stock = (
        NoCompression,
        ScaledFloat16Compression,
        Float16Compression,
        Quantile8BitQuantization,
        Uniform8BitQuantization,
        BlockwiseQuantization,
    )
    registry = {runtime_pb2.CompressionType.Name(c.compression_type): c() for c in stock}
    monkeypatch.setattr(hivemind_serialization, "_BASE_COMPRESSION_TYPES", registry)
    return registry


# --- accuracy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_float16_roundtrip_error(shape):
    original = randn(*shape)
    decoded = roundtrip(Float16Codec(), original)
    # float16 keeps 11 significant bits: half an ulp is 2**-11 relative; subnormals (< 6e-5) lose
    # relative precision but never more than half the smallest subnormal step, 2**-25.
    assert torch.all((decoded - original).abs() <= original.abs() * 2**-11 + 2**-25)
    if original.numel() > 1:
        assert relative_l2(decoded, original) <= 1e-3


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_roundtrip_error(shape):
    original = randn(*shape)
    decoded = roundtrip(BFloat16Codec(), original)
    # bfloat16 keeps 8 significant bits: at most 2**-8 relative error per value, ~1.7e-3 in L2.
    assert torch.all((decoded - original).abs() <= original.abs() * 2**-8)
    if original.numel() > 1:
        assert relative_l2(decoded, original) <= 8e-3


@pytest.mark.parametrize("shape", SHAPES)
def test_blockwise8bit_roundtrip_error(shape):
    original = randn(*shape)
    decoded = roundtrip(Blockwise8BitCodec(), original)
    flat, error = original.reshape(-1), (decoded - original).reshape(-1).abs()
    for start in range(0, flat.numel(), BLOCK_SIZE):
        absmax = flat[start : start + BLOCK_SIZE].abs().max()
        # rounding to the nearest of 255 evenly spaced levels: at most half a step, absmax / 254
        assert error[start : start + BLOCK_SIZE].max() <= absmax / 254 * (1 + 1e-5)
    if original.numel() >= 1000:
        # uniform rounding error has rms step / sqrt(12); a block of 4096 normal values has absmax
        # ~3.8 sigma, so the relative L2 error is ~3.8 / 127 / sqrt(12) ~= 8.6e-3 (measured 8.4-8.7e-3)
        assert relative_l2(decoded, original) <= 1e-2


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("dtype", FLOATS)
def test_low_and_high_precision_inputs_keep_their_dtype(codec, dtype):
    original = randn(5, 300).to(dtype)
    decoded = roundtrip(codec, original)
    assert decoded.dtype == dtype and decoded.shape == original.shape
    assert relative_l2(decoded, original) <= l2_bound(codec)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)])
def test_empty_tensors(codec, shape):
    decoded = roundtrip(codec, torch.empty(shape))
    assert decoded.shape == shape and decoded.dtype == torch.float32


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("allow_inplace", [False, True])
def test_input_is_not_modified(codec, allow_inplace):
    original = randn(2, BLOCK_SIZE + 3) * 1e5
    original[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    before = original.clone()
    codec.compress(original, CompressionInfo.from_tensor(original), allow_inplace=allow_inplace)
    assert torch.equal(original.nan_to_num(), before.nan_to_num()) and original[0, 2].isnan()


def test_requires_grad_survives():
    original = randn(10).requires_grad_()
    for codec in CODECS:
        assert roundtrip(codec, original).requires_grad


# --- saturation and non-finite values ---------------------------------------------------------


def test_float16_saturates_large_values_and_keeps_nonfinite():
    fp16_max = torch.finfo(torch.float16).max
    original = torch.tensor([1e6, -1e6, 70_000.0, fp16_max, 1.0, math.inf, -math.inf, math.nan])
    decoded = roundtrip(Float16Codec(), original)
    expected = torch.tensor([fp16_max, -fp16_max, fp16_max, fp16_max, 1.0, math.inf, -math.inf, math.nan])
    assert torch.equal(decoded[:-1], expected[:-1]) and decoded[-1].isnan()
    assert torch.equal(
        roundtrip(Float16Codec(), torch.tensor([1e300], dtype=torch.float64)), torch.tensor([fp16_max]).double()
    )


def test_bfloat16_saturates_instead_of_rounding_to_inf():
    float32_max = torch.finfo(torch.float32).max  # rounds up to inf in a plain bfloat16 cast
    decoded = roundtrip(BFloat16Codec(), torch.tensor([float32_max, -float32_max, math.inf, math.nan]))
    bf16_max = torch.finfo(torch.bfloat16).max
    assert decoded[0] == bf16_max and decoded[1] == -bf16_max and decoded[2] == math.inf and decoded[3].isnan()


def test_blockwise8bit_nonfinite_values_become_nan_without_spoiling_their_block():
    original = randn(2 * BLOCK_SIZE)
    original[[5, 6, 7]] = torch.tensor([math.nan, math.inf, -math.inf])
    decoded = roundtrip(Blockwise8BitCodec(), original)
    assert decoded[[5, 6, 7]].isnan().all() and decoded.isnan().sum() == 3
    finite = original.isfinite()
    absmax = original[:BLOCK_SIZE][finite[:BLOCK_SIZE]].abs().max()
    assert (decoded - original)[finite].abs().max() <= absmax / 254 * (1 + 1e-5)


def test_blockwise8bit_zero_blocks_decode_exactly():
    original = torch.cat([torch.zeros(BLOCK_SIZE), randn(100), torch.zeros(BLOCK_SIZE + 5)])
    decoded = roundtrip(Blockwise8BitCodec(), original)
    assert torch.equal(decoded[:BLOCK_SIZE], original[:BLOCK_SIZE])
    assert torch.equal(decoded[BLOCK_SIZE + 100 :], original[BLOCK_SIZE + 100 :])
    assert torch.equal(roundtrip(Blockwise8BitCodec(), torch.zeros(7)), torch.zeros(7))


def test_blockwise8bit_tiny_and_huge_scales():
    for scale in (1e-40, 1e-30, 1e30, 3e38):
        original = randn(1000) / randn(1000).abs().max() * scale  # |values| <= scale, no overflow
        decoded = roundtrip(Blockwise8BitCodec(), original)
        assert decoded.isfinite().all()
        assert (decoded - original).abs().max() <= original.abs().max() / 254 * (1 + 1e-5) + 1e-44


# --- size on the wire -------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compression_ratio_estimate_matches_buffer(codec, dtype):
    original = randn(100_000).to(dtype)
    info = CompressionInfo.from_tensor(original)
    message = codec.compress(original, info)
    estimate = codec.estimate_compression_ratio(info) * original.numel() * dtype.itemsize
    assert estimate <= len(message.buffer) <= estimate + 64  # the estimate leaves out a fixed header


async def serialized_parts(container: TensorPartContainer) -> list[runtime_pb2.Tensor]:
    try:
        return [part async for part in container.iterate_input_parts_for(0)]
    finally:
        container.finalize()


def test_hivemind_part_sizing_with_our_estimate():
    """hivemind's all-reduce splits tensors into parts using estimate_compression_ratio."""
    part_size_bytes = 64 * 1024
    tensors = [randn(100_000), randn(3, 7000, seed=1)]
    for codec in CODECS:
        container = TensorPartContainer(tensors, [1.0], compression=codec, part_size_bytes=part_size_bytes)
        parts = asyncio.run(serialized_parts(container))
        assert all(len(part.buffer) <= part_size_bytes + 64 for part in parts)
        ratio = codec.estimate_compression_ratio(CompressionInfo.from_tensor(tensors[0]))
        assert len(parts) == sum(math.ceil(t.numel() * 4 * ratio / part_size_bytes) for t in tensors)


# --- malformed messages -----------------------------------------------------------------------


def message_for(codec, shape=(3, BLOCK_SIZE + 1)) -> runtime_pb2.Tensor:
    original = randn(*shape)
    return codec.compress(original, CompressionInfo.from_tensor(original))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_truncated_buffers_are_rejected(codec):
    message = message_for(codec)
    for length in (len(message.buffer) - 1, len(message.buffer) // 2, 10, 0):
        broken = runtime_pb2.Tensor()
        broken.CopyFrom(message)
        broken.buffer = message.buffer[:length]
        with pytest.raises(ValueError):
            codec.extract(broken)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("size", [[3, BLOCK_SIZE], [3, BLOCK_SIZE + 2], [4, BLOCK_SIZE + 1], []])
def test_wrong_declared_shape_is_rejected(codec, size):
    message = message_for(codec)
    del message.size[:]
    message.size.extend(size)
    with pytest.raises(ValueError):
        codec.extract(message)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("dtype", ["int32", "complex64", "", "float8"])
def test_unknown_declared_dtype_is_rejected(codec, dtype):
    message = message_for(codec, shape=(10,))
    message.dtype = dtype
    with pytest.raises(ValueError, match="dtype"):
        codec.extract(message)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_integer_tensors_are_refused(codec):
    with pytest.raises(ValueError, match="int64"):
        codec.compress(torch.arange(5), CompressionInfo.from_tensor(torch.arange(5)))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_foreign_layouts_are_rejected_in_our_slots():
    # stock hivemind's 8-bit layout: int64 counts first, then float32 tables, then uint8 codes
    stock_like = runtime_pb2.Tensor(
        buffer=struct.pack("<qq", 1, 256) + bytes(4 + 1024 + 10), size=[10], dtype="float32"
    )
    for codec in (BFloat16Codec(), Blockwise8BitCodec(), Float8Codec()):
        with pytest.raises(ValueError, match="not a swarm peer"):
            codec.extract(stock_like)
    stock_uniform = Uniform8BitQuantization().compress(randn(10), CompressionInfo.from_tensor(randn(10)))
    for codec in (BFloat16Codec(), Float8Codec()):  # (Float8Codec took the stock UNIFORM_8BIT slot)
        with pytest.raises(ValueError):
            codec.extract(stock_uniform)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 1e-6, 3e4])
def test_float8_roundtrip_error(shape, scale):
    original = randn(*shape) * scale
    decoded = roundtrip(Float8Codec(), original)
    if original.numel() == 0 or not original.abs().max() > 0:
        return
    # the scale 2**e puts absmax in (224, 448]; values keep 4 significant bits (half an ulp: 2**-4 relative)
    # down to float8's smallest normal, 2**-6 of the scale, and are within half its subnormal step below
    e = math.ceil(math.log2(float(original.abs().max()) / 448))
    assert torch.all((decoded - original).abs() <= original.abs() * 2**-4 + 2.0 ** (e - 10))
    if original.numel() >= 1000:
        assert relative_l2(decoded, original) <= 3.5e-2


def test_float8_grid_goes_through_unchanged_whole_and_in_any_parts():
    """What error feedback rests on: a tensor rounded by float8_grid is on the grid of each of its parts, as
    hivemind's all-reduce cuts them (each part's scale is no larger than the whole's)."""
    codec = Float8Codec()
    g = torch.Generator().manual_seed(3)
    original = torch.randn(50_000, generator=g) * torch.logspace(-6, 0, 50_000)  # magnitudes across six decades
    grid = float8_grid(original)
    assert torch.equal(roundtrip(codec, original), grid)
    for size in (1, 7, 1000, 4096, 12_345):
        for part in grid.split(size):
            assert torch.equal(roundtrip(codec, part), part)
    container = TensorPartContainer([grid], [0.3, 0.7], compression=codec, part_size_bytes=8000)
    parts = asyncio.run(serialized_parts(container))
    assert torch.equal(torch.cat([codec.extract(part) for part in parts]), grid[: sum(p.size[0] for p in parts)])


def test_float8_nonfinite_values_become_nan_and_finite_ones_stay_finite():
    original = torch.tensor([1.0, math.inf, -math.inf, math.nan, -2.0, 3.4e38, -3.4e38, 1e-42])
    decoded = roundtrip(Float8Codec(), original)
    assert decoded[1:4].isnan().all()
    assert decoded[[0, 4, 5, 6, 7]].isfinite().all()
    only_nonfinite = roundtrip(Float8Codec(), torch.tensor([math.nan, math.inf]))
    assert only_nonfinite.isnan().all()
    assert torch.equal(roundtrip(Float8Codec(), torch.zeros(9)), torch.zeros(9))


@pytest.mark.parametrize("exponent", [-127, 128, -(2**31), 2**31 - 1])
def test_float8_rejects_an_exponent_out_of_range(exponent):
    message = message_for(Float8Codec(), shape=(10,))
    magic, numel, _ = Float8Codec.HEADER.unpack_from(message.buffer)
    message.buffer = Float8Codec.HEADER.pack(magic, numel, exponent) + message.buffer[Float8Codec.HEADER.size:]
    with pytest.raises(ValueError, match="exponent"):
        Float8Codec().extract(message)


def test_blockwise8bit_rejects_bad_scales():
    message = message_for(Blockwise8BitCodec(), shape=(10,))
    header = Blockwise8BitCodec.HEADER.size
    message.buffer = message.buffer[:header] + struct.pack("<f", math.nan) + message.buffer[header + 4 :]
    with pytest.raises(ValueError, match="scales"):
        Blockwise8BitCodec().extract(message)


def with_block_size(message: runtime_pb2.Tensor, block_size: int) -> runtime_pb2.Tensor:
    """A copy of a Blockwise8BitCodec message whose header declares `block_size`."""
    header = Blockwise8BitCodec.HEADER
    magic, numel, _ = header.unpack_from(message.buffer)
    forged = runtime_pb2.Tensor()
    forged.CopyFrom(message)
    forged.buffer = header.pack(magic, numel, block_size) + message.buffer[header.size:]
    return forged


@pytest.mark.parametrize("block_size", [0, MAX_BLOCK_SIZE + 1, 2**28, 2**40, 2**64 - 1])
def test_blockwise8bit_refuses_a_huge_block_size_before_allocating(block_size):
    # 10 values in one block: every block size above passes the length check, and 2**28 once made
    # the decoder spread the block's scale over 2**28 floats (1 GiB) for a 10-value message
    message = with_block_size(message_for(Blockwise8BitCodec(), shape=(10,)), block_size)
    with pytest.raises(ValueError, match=f"block size {block_size}, outside 1..{MAX_BLOCK_SIZE}"):
        Blockwise8BitCodec().extract(message)


def test_blockwise8bit_block_wider_than_the_message_decodes_within_its_values():
    message = message_for(Blockwise8BitCodec(), shape=(10,))
    widest = with_block_size(message, MAX_BLOCK_SIZE)
    assert torch.equal(Blockwise8BitCodec().extract(widest), Blockwise8BitCodec().extract(message))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_a_shape_larger_than_the_buffer_is_refused_from_the_header(codec):
    """The declared shape never decides an allocation: it is checked against the bytes received first."""
    message = message_for(codec, shape=(10,))
    del message.size[:]
    message.size.extend([2**31, 2**31])  # 2**62 values in a buffer of a few dozen bytes
    if isinstance(codec, (BFloat16Codec, Blockwise8BitCodec)):  # keep the header consistent with the shape
        magic, _, *rest = codec.HEADER.unpack_from(message.buffer)
        message.buffer = codec.HEADER.pack(magic, 2**62, *rest) + message.buffer[codec.HEADER.size:]
    with pytest.raises(ValueError, match=r"declares 4611686018427387904 values, more than the \d+ bytes"):
        codec.extract(message)


# --- hivemind interplay -----------------------------------------------------------------------


def test_float16_is_byte_compatible_with_stock_hivemind():
    original = randn(3, 100)
    info = CompressionInfo.from_tensor(original)
    ours, stock = Float16Codec().compress(original, info), Float16Compression().compress(original, info)
    assert ours.buffer == stock.buffer and ours.dtype == stock.dtype and ours.compression == stock.compression
    assert torch.equal(Float16Compression().extract(ours), Float16Codec().extract(stock))


def test_install_routes_hivemind_serialization_through_our_codecs(isolated_registry):
    assert not codecs_installed()
    install_codecs()
    installed = dict(isolated_registry)
    install_codecs()
    assert codecs_installed() and all(isolated_registry[k] is v for k, v in installed.items())
    original = randn(2, BLOCK_SIZE + 17)
    for codec in CODECS:
        message = serialize_torch_tensor(original, codec.compression_type)
        assert message.buffer == codec.compress(original, CompressionInfo.from_tensor(original)).buffer
        # the way the all-reduce receives a part: streamed in chunks, reassembled, decoded by enum
        streamed = combine_from_streaming(split_for_streaming(message, chunk_size_bytes=1000))
        decoded = deserialize_torch_tensor(streamed)
        assert torch.equal(decoded, codec.extract(message))
        assert relative_l2(decoded, original) <= l2_bound(codec)
    bf16 = serialize_torch_tensor(original.bfloat16(), runtime_pb2.CompressionType.FLOAT16)
    assert deserialize_torch_tensor(bf16).dtype == torch.bfloat16


def test_compression_for_covers_config_names():
    assert set(COMPRESSIONS) == {"none", "float16", "bfloat16", "blockwise8bit", "float8"}
    assert isinstance(compression_for("none"), NoCompression)
    assert isinstance(compression_for("float16"), Float16Codec)
    assert isinstance(compression_for("bfloat16"), BFloat16Codec)
    assert isinstance(compression_for("blockwise8bit"), Blockwise8BitCodec)
    assert isinstance(compression_for("float8"), Float8Codec)
    with pytest.raises(ValueError, match="blockwise8bit"):
        compression_for("int4")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.skipif(int(numpy.__version__.split(".")[0]) < 2, reason="the stock codec works under numpy 1")
def test_stock_uniform8bit_cannot_decode_under_numpy2_which_is_why_these_codecs_exist():
    """Fails once hivemind's fix ships: then the stock 8-bit codecs may be worth revisiting."""
    original = randn(100)
    message = Uniform8BitQuantization().compress(original, CompressionInfo.from_tensor(original))
    with pytest.raises(TypeError, match="0-dimensional"):
        Uniform8BitQuantization().extract(message)
