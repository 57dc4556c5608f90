"""8-bit block-quantized optimizer state (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2021).

A state tensor of ``n`` elements is held as ``n`` uint8 codes and ``ceil(n / block_size)`` fp32 scales: each
block of ``block_size`` consecutive (flat) elements is divided by its absolute maximum (its scale) and every
value is replaced by the index of the nearest entry of a 256-entry *dynamic* map: a decimal exponent
(1e-6 ... 1) and a linear fraction whose resolution grows with the exponent, so small values keep their
relative precision far better than a linear int8 grid (values above 1e-7 of the block maximum survive).

- Signed map (``exp_avg``): 0, +-1 and 127 magnitudes per sign; nearest-value rounding error at most half a
  gap (about 0.7% of the block maximum at the top decade, ten times less per decade below).
- Unsigned map (``exp_avg_sq``): 0, 1 and 254 values in [1e-7, 1). The second moment is stored in *sqrt space*
  (codes of ``sqrt(v)``): ``sqrt(v)`` has the range of ``|g|``, as ``exp_avg`` does, so an element whose
  ``exp_avg`` survives quantization does not see its denominator rounded to 0 (which would divide a live
  first moment by ``eps``: the instability bitsandbytes works around by keeping embeddings in 32 bits).

Both maps hold the block maximum exactly (+-1), so dequantizing and quantizing again gives the same codes
and scales: a quantized state saved as fp32 loads back bit for bit.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["DEFAULT_BLOCK", "Q8", "blocks_of", "dequantize_", "dynamic_map", "infer_block", "quantize_", "zero_code",
           "zeros_q8"]

DEFAULT_BLOCK = 256


class Q8(NamedTuple):
    """One quantized state tensor: ``codes`` (uint8, the state's shape), ``scales`` (fp32, one per ``block``
    consecutive flat codes; the last block may be short); ``sqrt``: the codes encode the value's square root."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int
    sqrt: bool

    def split(self, size: int) -> list[Q8]:
        """Flat pieces of ``size`` elements (a multiple of ``block``), each with its blocks' scales."""
        codes = self.codes.reshape(-1).split(size)
        scales = self.scales.split(size // self.block)
        return [Q8(c, s, self.block, self.sqrt) for c, s in zip(codes, scales, strict=True)]


def blocks_of(numel: int, block: int) -> int:
    """Blocks of ``block`` elements that ``numel`` elements take (the last one may be short)."""
    return -(-numel // block)


def zeros_q8(like: torch.Tensor, block: int, *, sqrt: bool) -> Q8:
    """A zero state shaped like ``like`` (the code of 0.0, scales 0)."""
    codes = torch.full(like.shape, zero_code(sqrt), dtype=torch.uint8, device=like.device)
    return Q8(codes, torch.zeros(blocks_of(like.numel(), block), dtype=torch.float32, device=like.device), block,
              sqrt)


@functools.cache
def dynamic_map(signed: bool) -> tuple[float, ...]:
    """The 256 sorted values of the dynamic map (see the module docstring), as Python floats."""
    values: list[float] = [0.0, 1.0]
    decades = 7
    for i in range(decades):  # decade i covers [0.1, 1] * 10**(i - 6) with 2**i (signed) or 2**(i+1) values
        count = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float64)
        values += ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - decades + 1)).tolist()
    if signed:  # mirrored, with the largest negative magnitude made exactly -1 (a block maximum)
        negative = sorted(-v for v in values if v not in (0.0, 1.0))
        values += [-1.0] + negative[1:]
    values.sort()
    assert len(values) == 256 and len(set(values)) == 256
    return tuple(values)


def zero_code(sqrt: bool) -> int:
    """The code of 0.0 in the map that ``sqrt`` (unsigned) or not (signed) uses."""
    return dynamic_map(not sqrt).index(0.0)


def infer_block(numel: int, blocks: int) -> int:
    """The power-of-two block size that cuts ``numel`` elements into ``blocks`` blocks (a state saved by an
    optimizer with another block size); any such size reads the same values. ValueError if none does."""
    block = 1
    while blocks_of(numel, block) > blocks and block < max(numel, 1):
        block *= 2
    if blocks_of(numel, block) != blocks:
        raise ValueError(f"{blocks} scales do not fit {numel} codes in power-of-two blocks")
    return block


@functools.cache
def _tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map (fp32), its midpoints (fp32, +inf appended) and a lookup of the nearest code by the top 16 bits
    of an fp32 value (int32, 65536 entries) on ``device``.

    The nearest code of ``y`` is the number of midpoints below it (a binary search over 255 midpoints: slow
    on CPU). All fp32 values that share their top 16 bits lie in a range narrower than any gap between
    midpoints in [-1, 1] (checked here), so that count is the range's lower end's count, or one more: the
    lookup holds the former, and one comparison with the next midpoint decides."""
    table = torch.tensor(dynamic_map(signed), dtype=torch.float64)
    mids = ((table[1:] + table[:-1]) / 2).float()
    patterns = torch.arange(1 << 16, dtype=torch.int32) - (1 << 15)  # every top half, as a signed int16 value
    ends = torch.stack([(patterns << 16).view(torch.float32), ((patterns << 16) | 0xFFFF).view(torch.float32)])
    low, high = ends.min(0).values, ends.max(0).values
    lookup = torch.bucketize(low, mids, right=True).int()  # midpoints <= low
    inside = (low >= -1) & (high <= 1)  # (NaN patterns compare False)
    assert bool((torch.bucketize(high, mids, right=True) - lookup <= 1)[inside].all())
    lookup = torch.roll(lookup, -(1 << 15))  # indexed by the pattern's unsigned 16 bits
    mids = torch.cat([mids, torch.tensor([float("inf")])])
    return table.float().to(device), mids.to(device), lookup.to(device)


def dequantize_(state: Q8, out: torch.Tensor) -> torch.Tensor:
    """Write the values of ``state`` into fp32 ``out`` (flat, at least the state's numel rounded up to a
    whole block; the padding is zeroed). Returns ``out[:numel]``."""
    numel, block = state.codes.numel(), state.block
    table, _, _ = _tables(not state.sqrt, out.device)
    values = out[:numel]
    torch.index_select(table, 0, state.codes.reshape(-1).int(), out=values)
    padded = out[: state.scales.numel() * block]
    padded[numel:].zero_()
    padded.view(-1, block).mul_(state.scales.unsqueeze(1))
    if state.sqrt:
        values.square_()
    return values


def quantize_(state: Q8, values: torch.Tensor) -> None:
    """Encode fp32 ``values`` (flat, padded with zeros to whole blocks as ``dequantize_`` leaves them; used as
    scratch) into ``state``'s scales and codes in place."""
    numel, block = state.codes.numel(), state.block
    padded = values[: state.scales.numel() * block]
    if state.sqrt:
        padded.sqrt_()
    blocks = padded.view(-1, block)
    torch.amax(blocks.abs(), dim=1, out=state.scales)
    blocks.div_(state.scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    _, mids, lookup = _tables(not state.sqrt, values.device)
    normalized = padded[:numel]
    top = normalized.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
    codes = torch.index_select(lookup, 0, top)  # (index_select: ~5x faster than advanced indexing on CPU)
    codes += normalized > torch.index_select(mids, 0, codes)  # the nearest entry (a tie goes to the lower one)
    state.codes.view(-1).copy_(codes)
