"""Corpora, tokenization and deterministic batch sampling.

A corpus is a list of text files under a root directory. Files (not bytes) are split into train and
validation by a hash of their path relative to the root, so every machine that holds the same
corpus agrees on the split without talking to anyone. Token streams are flat 1-D tensors; samplers
draw windows from them with their own ``torch.Generator`` and never touch the global RNG.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from swarm.config import DataConfig

STDLIB = "stdlib"
_GLOB_CHARS = "*?["
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


class DataError(ValueError):
    """The corpus or tokenizer cannot be used; the message says what to fix."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download or train."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` JSON file (e.g. a trained BPE)."""

    def __init__(self, path: str | Path):
        import tokenizers  # only runs that use a tokenizer file pay for the import

        path = Path(path).expanduser()
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist (set data.tokenizer to a JSON file)")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust binding raises a bare Exception for any parse error
            raise DataError(f"tokenizer file {path} is not a valid tokenizers JSON file: {e}") from None
        self.path = path
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (parallel inside the Rust library)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids))


def volunteer_data(data_cfg: DataConfig, data_dir: str | None) -> DataConfig:
    """The data settings a volunteer's trainer uses: the run config's, confined to what the volunteer allows.

    A run config comes from the network, so its paths are not to be trusted: ``data.corpus`` may name
    the embedded corpus ("stdlib") or a relative path (or glob) under the volunteer's `data_dir`,
    and ``data.tokenizer`` a file under `data_dir`; anything else, absolute paths and ``..`` included,
    raises DataError. A `data_dir` given with an embedded corpus is the volunteer's own corpus, as
    is a `data_dir` that is a file or a glob.
    """
    root = data_dir if data_dir is not None and Path(data_dir).expanduser().is_dir() else None
    corpus = data_cfg.corpus
    if data_dir is not None and (corpus == STDLIB or root is None):
        corpus = data_dir  # the volunteer's own corpus
    elif corpus != STDLIB:
        corpus = _confined(corpus, root, "data.corpus")
    tokenizer = _confined(data_cfg.tokenizer, root, "data.tokenizer")
    return DataConfig(**{**vars(data_cfg), "corpus": corpus, "tokenizer": tokenizer})


def _confined(spec: str | None, data_dir: str | None, what: str) -> str | None:
    """`spec` (relative to `data_dir`, or absolute) if it stays inside `data_dir`; DataError otherwise."""
    if spec is None:
        return None
    if data_dir is None:
        raise DataError(f"the run config's {what} is {spec!r}: this peer reads only the embedded corpus unless "
                        "you pass --data DIR, a directory of yours to resolve it under")
    root = Path(data_dir).expanduser().resolve()
    path = root / Path(spec).expanduser()  # an absolute spec replaces the root
    # the part before any wildcard must stay inside the root once symlinks and `..` are resolved
    fixed = Path(str(path).split("*")[0].split("?")[0].split("[")[0])
    if ".." in Path(spec).parts or not fixed.resolve().is_relative_to(root):
        raise DataError(f"the run config's {what} {spec!r} is outside this peer's --data directory ({data_dir})")
    return str(path)


def load_tokenizer(data_cfg: DataConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer named by ``data.tokenizer``; None means bytes."""
    return ByteTokenizer() if data_cfg.tokenizer is None else HFTokenizer(data_cfg.tokenizer)


def corpus_files(spec: str) -> tuple[Path, list[Path]]:
    """Resolve a corpus spec to ``(root, files)`` in a deterministic order.

    ``"stdlib"`` is this Python's standard-library ``*.py`` sources (no site-packages); otherwise
    a file, a directory (every file under it) or a glob (its root is the part before the first
    wildcard). Files are sorted by their path relative to the root.
    """
    if spec == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if not _EXCLUDED_DIRS & set(p.relative_to(root).parts)]
    else:
        path = Path(spec).expanduser()
        if path.is_file():
            root, files = path.parent, [path]
        elif path.is_dir():
            root, files = path, [p for p in path.rglob("*") if p.is_file()]
        elif any(c in spec for c in _GLOB_CHARS):
            root = _glob_root(str(path))
            files = [Path(p) for p in glob.glob(str(path), recursive=True) if os.path.isfile(p)]
        else:
            raise DataError(f"corpus {spec!r} does not exist (use 'stdlib', a file, a directory or a glob)")
    if not files:
        raise DataError(f"corpus {spec!r} matches no files")
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, files


def _glob_root(pattern: str) -> Path:
    # The fixed prefix of the pattern, so the split does not depend on which files happen to match.
    parts = Path(pattern).parts
    fixed = []
    for part in parts:
        if any(c in part for c in _GLOB_CHARS):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def is_validation(relative_path: str, val_percent: float) -> bool:
    """Whether a file (by its posix path relative to the corpus root) belongs to validation."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % 10000 < val_percent * 100


def split_files(root: Path, files: list[Path], val_percent: float) -> tuple[list[Path], list[Path]]:
    """Split files into ``(train, val)`` by a hash of each relative path; both sides non-empty."""
    train, val = [], []
    for f in files:
        (val if is_validation(f.relative_to(root).as_posix(), val_percent) else train).append(f)
    if not train or not val:
        empty = "training" if not train else "validation"
        raise DataError(
            f"the {empty} split of {len(files)} corpus file(s) under {root} is empty at "
            f"data.val_percent={val_percent}; use a corpus with more files or change data.val_percent"
        )
    return train, val


def load_tokens(data_cfg: DataConfig, split: str, tokenizer: Tokenizer | None = None) -> torch.Tensor:
    """All tokens of one split (``"train"`` or ``"val"``) as a flat 1-D tensor.

    Files are read in corpus order and concatenated, up to ``data.max_bytes`` bytes of UTF-8 text
    per split when that is positive. Storage is ``torch.uint8`` when the vocabulary fits in a
    byte (the byte tokenizer: a quarter of int32's memory) and ``torch.int32`` otherwise; callers
    convert windows to int64 when they sample them.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(data_cfg)
    root, files = corpus_files(data_cfg.corpus)
    if len(files) == 1:
        blobs = [_single_file_split(files[0], split, data_cfg.val_percent, data_cfg.max_bytes)]
    else:
        train, val = split_files(root, files, data_cfg.val_percent)
        blobs = _read_capped(train if split == "train" else val, data_cfg.max_bytes)
    if isinstance(tokenizer, ByteTokenizer):
        # Bytes are already tokens: skip the per-character Python round trip.
        return torch.frombuffer(bytearray().join(blobs), dtype=torch.uint8) if blobs else _empty()
    texts = [b.decode("utf-8", errors="ignore") for b in blobs]  # a cap may cut a character
    if isinstance(tokenizer, HFTokenizer):
        ids = [i for chunk in tokenizer.encode_batch(texts) for i in chunk]
    else:
        ids = [i for text in texts for i in tokenizer.encode(text)]
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    return torch.tensor(ids, dtype=dtype)


def _single_file_split(path: Path, split: str, val_percent: float, max_bytes: int) -> bytes:
    """A one-file corpus splits by position: validation is its last `val_percent`, from a line start."""
    data = _read_capped([path], 0)[0]
    cut = int(len(data) * (1 - val_percent / 100))
    newline = data.find(b"\n", cut)
    cut = newline + 1 if 0 <= newline < len(data) - 1 else cut
    train, val = data[:cut], data[cut:]
    part = train if split == "train" else val
    if not train or not val:
        raise DataError(f"{path} is too small to hold out {val_percent}% for validation")
    return part[:max_bytes] if max_bytes > 0 else part


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.uint8)


def _read_capped(files: list[Path], max_bytes: int) -> list[bytes]:
    # Every blob is valid UTF-8 (undecodable bytes become U+FFFD), so byte tokens and text agree.
    blobs, total = [], 0
    for f in files:
        data = f.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            data = data.decode("utf-8", errors="replace").encode("utf-8")
        if max_bytes > 0 and total + len(data) >= max_bytes:
            blobs.append(data[: max_bytes - total])
            break
        blobs.append(data)
        total += len(data)
    return blobs


def sampler_seed(data_seed: int, trainer_index: int, run_step: int = 0) -> int:
    """A seed for one trainer's sampler, distinct per (data seed, trainer) pair.

    A trainer that joins a run already at `run_step` > 0 (say, restarted after a crash) draws with
    another seed, so it does not replay the windows it drew before.
    """
    resumed = f":{run_step}" if run_step else ""
    digest = hashlib.sha256(f"swarm-sampler:{data_seed}:{trainer_index}{resumed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class BatchSampler:
    """Endless random windows of a token stream; the same seed gives the same batches."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if len(tokens) < seq_len + 1:
            raise DataError(f"{len(tokens)} tokens are too few for windows of seq_len={seq_len} (+1 target)")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, both int64 ``[batch_size, seq_len]``, where y is x shifted left by one."""
        high = len(self.tokens) - self.seq_len  # last valid start leaves room for the target token
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return _windows(self.tokens, starts, self.seq_len, self._offsets)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()


def eval_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, non-overlapping windows spread evenly over the stream, in batches (the last may be short)."""
    available = (len(tokens) - 1) // seq_len
    wanted = available if max_batches is None else min(available, max_batches * batch_size)
    if wanted <= 0:
        return
    # Spread the windows over the whole split rather than taking its first files only.
    starts = (torch.arange(wanted) * available // wanted) * seq_len
    offsets = torch.arange(seq_len + 1)
    for i in range(0, wanted, batch_size):
        yield _windows(tokens, starts[i : i + batch_size], seq_len, offsets)


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, seq_len: int, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = tokens[starts[:, None] + offsets].long()
    return chunk[:, :seq_len], chunk[:, 1:]
