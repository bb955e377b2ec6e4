"""Writing a safetensors file in one pass, hashing its bytes as they go out.

``safetensors.torch.save_file`` then a sha256 of the file reads every byte back (about as long as
writing it). Here the file is laid out as the safetensors format says (an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range, then the tensors'
bytes back to back) and every piece is hashed on a second thread while this one writes it, so a
checkpoint costs about what copying its bytes costs. Reading stays with the safetensors library.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
PIECE = 8 << 20  # bytes written (and hashed) at a time


def save_hashed(tensors: dict[str, torch.Tensor], file: Path) -> tuple[str, int]:
    """Write `tensors` (contiguous, on the CPU) to `file` as safetensors; its (sha256, size). Not fsynced."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be saved")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset,
                                                                                                    offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors' bytes start 8-aligned
    digest = hashlib.sha256()
    written = 0
    with open(file, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        for piece in _pieces(struct.pack("<Q", len(encoded)) + encoded, tensors):
            hashing = hasher.submit(digest.update, piece)  # (hashlib and file writes both release the GIL)
            f.write(piece)
            written += len(piece)
            hashing.result()  # the piece must outlive its hashing; one at a time keeps the order
    return digest.hexdigest(), written


def _pieces(head: bytes, tensors: dict[str, torch.Tensor]):
    yield memoryview(head)
    for tensor in tensors.values():
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        for start in range(0, len(data), PIECE):
            yield data[start:start + PIECE]
