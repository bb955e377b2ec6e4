"""Corpus resolution, the train/val split, tokenizers and deterministic sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.config import DataConfig
from swarm.data import (
    BatchSampler,
    ByteTokenizer,
    DataError,
    HFTokenizer,
    corpus_files,
    eval_batches,
    load_tokenizer,
    load_tokens,
    sampler_seed,
    split_files,
    volunteer_data,
)

pytestmark = pytest.mark.timeout(120)


def make_corpus(root: Path, n_files: int = 40) -> Path:
    for i in range(n_files):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # café\n" * 20)
    return root


def stream(n: int = 5000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32) % 251


def test_same_seed_same_batches_and_different_seeds_differ():
    a, b, c = (BatchSampler(stream(), 16, 4, seed=s) for s in (7, 7, 8))
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.next_batch()[0], c.next_batch()[0])


def test_sampler_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    BatchSampler(stream(), 16, 4, seed=1).next_batch()
    assert torch.equal(torch.rand(3), expected)


def test_targets_are_inputs_shifted_by_one():
    x, y = next(iter(BatchSampler(stream(), 16, 4, seed=0)))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 251)


def test_sampler_seeds_differ_per_trainer_and_data_seed():
    seeds = {sampler_seed(d, t) for d in range(3) for t in range(4)}
    assert len(seeds) == 12
    assert sampler_seed(0, 1) == sampler_seed(0, 1)


def test_eval_batches_are_fixed_and_non_overlapping():
    tokens = torch.arange(1000, dtype=torch.int32)
    first = list(eval_batches(tokens, 10, 4, max_batches=5))
    assert len(first) == 5
    again = list(eval_batches(tokens, 10, 4, max_batches=5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    starts = torch.cat([x[:, 0] for x, _ in first]).tolist()
    assert len(set(starts)) == 20 and all(s % 10 == 0 for s in starts)
    assert sum(len(x) for x, _ in eval_batches(tokens, 10, 4)) == 99  # everything when uncapped


def test_stdlib_split_is_disjoint_non_empty_and_stable():
    root, files = corpus_files("stdlib")
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    train, val = split_files(root, files, 5.0)
    assert train and val and not set(train) & set(val)
    assert len(train) + len(val) == len(files)
    assert (train, val) == split_files(root, files, 5.0)
    assert corpus_files("stdlib") == (root, files)


def test_split_uses_paths_relative_to_root(tmp_path):
    a = corpus_files(str(make_corpus(tmp_path / "a")))
    b = corpus_files(str(make_corpus(tmp_path / "elsewhere" / "b")))
    train_a, val_a = split_files(*a, 20.0)
    train_b, val_b = split_files(*b, 20.0)
    rel = lambda root, fs: [f.relative_to(root).as_posix() for f in fs]  # noqa: E731
    assert rel(a[0], val_a) == rel(b[0], val_b) and rel(a[0], train_a) == rel(b[0], train_b)


def test_glob_root_is_its_fixed_prefix_and_empty_glob_fails(tmp_path):
    make_corpus(tmp_path)
    root, files = corpus_files(str(tmp_path / "pkg*" / "*.py"))
    assert root == tmp_path and len(files) == 40
    with pytest.raises(DataError, match="matches no files"):
        corpus_files(str(tmp_path / "*.nothing"))
    with pytest.raises(DataError, match="does not exist"):
        corpus_files(str(tmp_path / "missing.txt"))


def test_single_file_cannot_be_split_by_files(tmp_path):
    (tmp_path / "one.txt").write_text("hello")
    with pytest.raises(DataError, match="split"):
        split_files(*corpus_files(str(tmp_path / "one.txt")), 5.0)


def test_single_file_corpus_splits_by_position_at_a_line_start(tmp_path):
    lines = [f"line {i}\n" for i in range(1000)]
    (tmp_path / "one.txt").write_text("".join(lines))
    cfg = DataConfig(corpus=str(tmp_path / "one.txt"), val_percent=10.0)
    train, val = bytes(load_tokens(cfg, "train").tolist()), bytes(load_tokens(cfg, "val").tolist())
    assert train + val == "".join(lines).encode()
    assert train.endswith(b"\n") and 0.08 < len(val) / (len(train) + len(val)) < 0.12
    (tmp_path / "tiny.txt").write_text("x")
    with pytest.raises(DataError, match="too small"):
        load_tokens(DataConfig(corpus=str(tmp_path / "tiny.txt")), "val")


def test_load_tokens_bytes_capped_and_undecodable_files(tmp_path):
    make_corpus(tmp_path)
    (tmp_path / "pkg0" / "bad.py").write_bytes(b"ok \xff\xfe end\n" * 50)
    cfg = DataConfig(corpus=str(tmp_path), val_percent=20.0)
    train = load_tokens(cfg, "train")
    val = load_tokens(cfg, "val")
    assert train.dtype == torch.uint8 and train.dim() == 1 and len(train) > len(val) > 0
    everything = bytes(torch.cat([train, val]).tolist())
    assert b"\xef\xbf\xbd end" in everything and b"\xff" not in everything  # replaced, still UTF-8
    capped = load_tokens(DataConfig(corpus=str(tmp_path), val_percent=20.0, max_bytes=1000), "train")
    assert torch.equal(capped, train[:1000])
    with pytest.raises(ValueError):
        load_tokens(cfg, "test")


def train_tiny_bpe(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["def f(x):\n    return x * 2\n", "import os\nprint(os.getcwd())\n"] * 10
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_file_loads_and_encodes(tmp_path):
    path = train_tiny_bpe(tmp_path / "tok.json")
    make_corpus(tmp_path / "corpus")
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), tokenizer=str(path), val_percent=20.0)
    tok = load_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size > 1
    ids = tok.encode("def f(x):\n    return x\n")
    assert ids and tok.decode(ids) == "def f(x):\n    return x\n"
    tokens = load_tokens(cfg, "train", tok)
    assert tokens.dim() == 1 and len(tokens) > 0 and int(tokens.max()) < tok.vocab_size


def test_bad_tokenizer_files_give_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        HFTokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid"):
        HFTokenizer(tmp_path / "bad.json")
    assert isinstance(load_tokenizer(DataConfig()), ByteTokenizer)


def test_a_run_config_reads_only_the_embedded_corpus_or_under_the_volunteers_data_dir(tmp_path):
    data = make_corpus(tmp_path / "data", n_files=4)
    (tmp_path / "secret.txt").write_text("private")
    (data / "escape").symlink_to(tmp_path)
    stdlib = DataConfig()
    assert volunteer_data(stdlib, None) == stdlib
    assert volunteer_data(stdlib, str(data)).corpus == str(data)  # the volunteer's own corpus
    assert volunteer_data(DataConfig(corpus="pkg0/*.py"), str(data)).corpus == str(data.resolve() / "pkg0/*.py")
    inside = str(data.resolve() / "pkg1")
    assert volunteer_data(DataConfig(corpus=inside), str(data)).corpus == inside  # absolute, but inside
    own = data / "pkg0" / "mod0.py"
    assert volunteer_data(DataConfig(corpus="/anything"), str(own)).corpus == str(own)  # a file: it is the corpus
    for corpus, data_dir, error in [
        ("pkg0", None, "only the embedded corpus"),
        (str(tmp_path / "secret.txt"), str(data), "outside"),
        ("~/.ssh", str(data), "outside"),
        ("../secret.txt", str(data), "outside"),
        ("pkg0/../../secret.txt", str(data), "outside"),
        ("pkg0/../pkg1", str(data), "outside"),  # inside after all, but `..` is refused outright
        ("escape/secret.txt", str(data), "outside"),  # a symlink out of the directory
        ("escape/*", str(data), "outside"),
    ]:
        with pytest.raises(DataError, match=error):
            volunteer_data(DataConfig(corpus=corpus), data_dir)
    with pytest.raises(DataError, match="data.tokenizer"):
        volunteer_data(DataConfig(tokenizer="/etc/passwd"), str(data))
    with pytest.raises(DataError, match="data.tokenizer"):
        volunteer_data(DataConfig(tokenizer="tok.json"), None)
