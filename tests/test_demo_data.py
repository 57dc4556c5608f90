"""The demo corpus: stdlib discovery, determinism, the train/validation split, batches, errors, entropy."""

from __future__ import annotations

import math

import pytest
import torch

from optstack.demo.data import load_corpus, unigram_entropy


def test_stdlib_corpus_is_deterministic_and_capped() -> None:
    a = load_corpus(max_bytes=200_000)
    b = load_corpus(max_bytes=200_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.dtype == torch.uint8
    assert a.train.numel() + a.val.numel() == 200_000
    assert a.num_files > 1
    text = bytes(a.train[:2000].tolist()).decode("utf-8", errors="replace")
    assert text.startswith("# file: ") and "site-packages" not in text
    # a larger cap extends the same byte stream
    c = load_corpus(max_bytes=300_000)
    assert torch.equal(torch.cat([c.train, c.val])[:150_000], torch.cat([a.train, a.val])[:150_000])


def test_split_is_at_a_file_boundary_near_the_fraction() -> None:
    c = load_corpus(max_bytes=500_000, val_fraction=0.1)
    total = c.train.numel() + c.val.numel()
    assert 0.05 * total <= c.val.numel() <= 0.1 * total
    assert bytes(c.val[:8].tolist()) == b"# file: "


def test_user_file_and_folder(tmp_path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("hello world\n" * 100)
    c = load_corpus(f, val_fraction=0.1)
    assert c.train.numel() + c.val.numel() == 1200 and c.val.numel() == 120  # one file: exact byte split
    assert bytes(c.train[:5].tolist()) == b"hello"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "two.md").write_text("# two\n" * 50)
    (tmp_path / "image.png").write_bytes(b"\x89PNG")  # not text: ignored
    d = load_corpus(tmp_path)
    assert d.num_files == 2
    assert b"PNG" not in bytes(torch.cat([d.train, d.val]).tolist())


def test_bad_paths_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(tmp_path / "folder")
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(val_fraction=1.5)


def test_get_batch_is_deterministic_given_the_generator() -> None:
    c = load_corpus(max_bytes=50_000)
    x1, y1 = c.get_batch("train", 4, 16, torch.Generator().manual_seed(3))
    x2, y2 = c.get_batch("train", 4, 16, torch.Generator().manual_seed(3))
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.long
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    x3, _ = c.get_batch("train", 4, 16, torch.Generator().manual_seed(4))
    assert not torch.equal(x1, x3)
    with pytest.raises(ValueError, match="split"):
        c.get_batch("test", 4, 16, torch.Generator())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len"):
        c.get_batch("val", 1, c.val.numel(), torch.Generator())


def test_unigram_entropy() -> None:
    uniform = torch.arange(256, dtype=torch.uint8).repeat(4)
    e = unigram_entropy(uniform)
    assert math.isclose(e.bits, 8.0, rel_tol=1e-9) and math.isclose(e.nats, math.log(256), rel_tol=1e-9)
    assert unigram_entropy(torch.full((10,), 7, dtype=torch.uint8)).nats == 0.0
    # cross-entropy under a smoothed reference is finite for unseen bytes and above the data's own entropy
    data = torch.tensor([1, 2, 3, 3], dtype=torch.uint8)
    cross = unigram_entropy(data, reference=torch.tensor([3, 3, 3], dtype=torch.uint8))
    assert math.isfinite(cross.nats) and cross.nats > unigram_entropy(data).nats
