"""Tensor bytes without numpy: ``tensor_bytes`` gives what ``.numpy().tobytes()`` gave, and the checkpoint
fingerprint keeps its hex (checkpoints written before the change must still verify)."""

from __future__ import annotations

import pytest
import torch

from optstack.checkpoint.state import fingerprint as _fingerprint
from optstack.tensor_bytes import tensor_bytes

CASES = [
    torch.randn(5000), torch.randn(30).double(), torch.arange(-5, 5, dtype=torch.int64), torch.tensor(3.5),
    torch.randn(4, 5).t(), torch.randn(100)[::3], torch.tensor([True, False]), torch.empty(0, 3),
    torch.randn(3, requires_grad=True), torch.randn(3, 2, dtype=torch.complex64),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{tuple(t.stride())}")
def test_tensor_bytes_equals_numpy_tobytes(t: torch.Tensor) -> None:
    pytest.importorskip("numpy")
    assert bytes(tensor_bytes(t)) == t.detach().contiguous().numpy().tobytes()


def test_bfloat16_bytes_are_its_bits() -> None:  # numpy has no bfloat16: compare with the int16 view
    t = torch.randn(7).bfloat16()
    assert tensor_bytes(t) == tensor_bytes(t.view(torch.int16))
    assert torch.equal(torch.frombuffer(tensor_bytes(t), dtype=torch.bfloat16), t)


def test_fingerprint_hex_is_unchanged() -> None:
    # Values computed with the numpy implementation it replaced.
    x = torch.arange(3000, dtype=torch.float32)
    assert _fingerprint(x) == "152125d1"
    assert _fingerprint(x.bfloat16()) == "95c781c8"
    assert _fingerprint(torch.arange(10, dtype=torch.float64)[::2]) == "2897388d"
    assert _fingerprint(torch.empty(0)) == "00000000"  # an empty shard
