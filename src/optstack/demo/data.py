"""The demo's training data: bytes of text, a fixed train/validation split, and random batches.

By default the corpus is the Python standard library's own source, found at run time under
``sysconfig.get_paths()["stdlib"]``: every machine that runs optstack has it and nothing is downloaded.
Files are listed recursively (``*.py``; ``site-packages``, ``dist-packages`` and test folders left out: the
tests hold binary-ish fixtures that teach the model little), sorted by relative path, then put in one fixed
pseudo-random order (seed 0) so that a byte cap takes a sample of the whole library rather than its
alphabetical head. Each file is preceded by a one-line header ``# file: <relative path>``. The last
``val_fraction`` of the bytes (cut at a file boundary when there is more than one file) is the validation
split. The same interpreter gives the same bytes on every run; nothing is cached on disk.
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

__all__ = ["Corpus", "Entropy", "load_corpus", "stdlib_root", "unigram_entropy"]

DEFAULT_MAX_BYTES = 4_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
# Text-like suffixes read from a user folder given with --data; anything else there is ignored.
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".json", ".toml", ".yaml",
                  ".yml", ".html", ".css", ".tex", ".csv", ".sh", ".go", ".rs", ".java", ""}


@dataclass(frozen=True)
class Entropy:
    """A per-byte entropy in both units."""

    nats: float
    bits: float


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and validation.

    Attributes:
        train: uint8 tensor of shape (n_train,).
        val: uint8 tensor of shape (n_val,).
        source: where the bytes came from (a path), for the run summary.
        num_files: how many files were read (the last one possibly cut at the byte cap).
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    num_files: int

    def split(self, split: Literal["train", "val"]) -> torch.Tensor:
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def get_batch(
        self, split: Literal["train", "val"], batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``batch_size`` random windows of ``seq_len + 1`` bytes from one split.

        The draw depends only on ``generator``'s state (it is advanced), so a saved generator state gives
        the same batches again.

        Returns:
            ``(inputs, targets)``, int64 of shape (batch_size, seq_len); targets are inputs shifted by one.
        """
        data = self.split(split)
        if data.numel() < seq_len + 1:
            raise ValueError(
                f"the {split} split has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
                "use more data (data.max_bytes, --data) or a shorter model.seq_len"
            )
        starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
        windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def stdlib_root() -> Path:
    """The installed interpreter's standard-library source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path, suffixes: set[str]) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: os.walk then never descends into installed packages or test folders.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(
            Path(dirpath) / f for f in filenames if Path(f).suffix in suffixes and not f.startswith(".")
        )
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_capped(files: list[Path], root: Path | None, max_bytes: int) -> tuple[bytes, list[int], int]:
    """Concatenate files (with headers when there are several) up to ``max_bytes``.

    Returns the bytes, the offset at which each file's chunk starts, and the number of files used.
    """
    chunks: list[bytes] = []
    starts: list[int] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        body = path.read_bytes()
        if not body:
            continue
        header = f"# file: {path.relative_to(root).as_posix()}\n".encode() if root is not None else b""
        chunk = header + body + (b"" if body.endswith(b"\n") else b"\n")
        chunk = chunk[: max_bytes - total]
        starts.append(total)
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks), starts, len(chunks)


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.05,
) -> Corpus:
    """Load the byte corpus.

    Args:
        path: a text file, or a folder read recursively (text-like suffixes, sorted by path); None = the
            Python standard library's source.
        max_bytes: cap on the bytes read (files are taken in order until the cap; the last one is cut).
        val_fraction: share of the bytes, at the end, held out for validation (0 < val_fraction < 1).

    Raises:
        ValueError: the path does not exist, holds no text, or an argument is out of range.
    """
    if not isinstance(max_bytes, int) or max_bytes < 2:
        raise ValueError(f"data.max_bytes must be an integer >= 2, got {max_bytes!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}")
    if path is None:
        root = stdlib_root()
        files = _list_files(root, {".py"})
        random.Random(0).shuffle(files)  # a fixed order that samples the whole library under the cap
        source = f"Python {sysconfig.get_python_version()} standard library ({root})"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise ValueError(
                f"data path {str(path)!r} does not exist; give a text file or a folder of text files"
            )
        if p.is_dir():
            root = p
            files = _list_files(p, _TEXT_SUFFIXES)
            if not files:
                raise ValueError(
                    f"data folder {str(path)!r} holds no text files (looked for "
                    f"{sorted(_TEXT_SUFFIXES - {''})} and files without a suffix)"
                )
        else:
            root, files = None, [p]
        source = str(p)
    data, starts, num_files = _read_capped(files, root if len(files) > 1 else None, max_bytes)
    if len(data) < 2:
        raise ValueError(
            f"data path {source!r} is empty (read {len(data)} bytes); give a non-empty text file"
        )
    cut = _split_point(len(data), starts, val_fraction)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return Corpus(train=tensor[:cut].clone(), val=tensor[cut:].clone(), source=source, num_files=num_files)


def _split_point(total: int, starts: list[int], val_fraction: float) -> int:
    """Where validation starts: the first file boundary at or after (1 - val_fraction) of the bytes, when
    that leaves validation no smaller than half the asked share; else the exact byte position."""
    target = math.floor(total * (1.0 - val_fraction))
    for s in starts[1:]:
        if s >= target and total - s >= (total - target) / 2:
            return s
    return max(1, min(target, total - 1))


def unigram_entropy(data: torch.Tensor, reference: torch.Tensor | None = None) -> Entropy:
    """Per-byte cross-entropy of ``data`` under a unigram (byte-frequency) model.

    Args:
        data: uint8 tensor of bytes to score.
        reference: uint8 bytes to fit the unigram model on (None = ``data`` itself, giving its entropy).
            With a reference, counts get add-one smoothing so unseen bytes have finite cost.

    Returns:
        The entropy in nats and bits per byte: the loss a model that ignores context cannot beat.
    """
    ref = data if reference is None else reference
    counts = torch.bincount(ref.long().flatten(), minlength=256).double()
    if reference is not None:
        counts += 1.0
    logp = torch.log(counts / counts.sum())
    freq = torch.bincount(data.long().flatten(), minlength=256).double()
    nats = float(-(freq * torch.where(freq > 0, logp, 0.0)).sum() / freq.sum())
    return Entropy(nats=nats, bits=nats / math.log(2))
