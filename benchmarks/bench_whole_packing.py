"""How whole-shard buffers pack matrices into shards: by elements (optstack's default: least padding) or by
Newton-Schulz cost (``Bucketing(whole_balance="cost")``, Megatron current main's rule, which the Megatron face
uses). Pure layout arithmetic on shapes, no tensors: padding of the buffer and owner balance (max / mean cost over
ranks holding work).

Run: .venv/bin/python benchmarks/bench_whole_packing.py [--dp 8,64] [--bucket-size 4000000]

The model is a Llama-like layer mix (q, k, v, o, gate, up, down of a 1024-wide model with 8:1 grouped KV), 32
layers, as in tests/test_plan.py.
"""

from __future__ import annotations

import argparse

from optstack.layout import Bucketing, BufferLayout, newton_schulz_cost


def _mix(layers: int = 32) -> list[tuple[str, tuple[int, int]]]:
    shapes = {"q": (1024, 1024), "k": (128, 1024), "v": (128, 1024), "o": (1024, 1024), "g": (3584, 1024),
              "u": (3584, 1024), "d": (1024, 3584)}
    return [(f"{i}.{n}", s) for i in range(layers) for n, s in shapes.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="8,64")
    parser.add_argument("--bucket-size", type=int, default=4_000_000)
    args = parser.parse_args()
    params = list(reversed(_mix()))  # backward order
    numel = sum(m * n for _, (m, n) in params)
    print(f"{'dp':>5} {'packing':>9} {'padding':>8} {'balance':>8} {'buckets':>8}")
    for dp in (int(x) for x in args.dp.split(",")):
        for mode in ("elements", "cost"):
            layout = BufferLayout.plan(params, dp_size=dp, bucket_size=args.bucket_size, whole=True,
                                       bucketing=Bucketing(whole_balance=mode))
            work = [0.0] * dp
            for name, shape in params:
                work[layout.owner_of(name)] += newton_schulz_cost(shape)
            held = [w for w in work if w > 0]
            print(f"{dp:>5} {mode:>9} {100 * (1 - numel / layout.numel):>7.1f}% "
                  f"{max(work) / (sum(held) / len(held)):>8.2f} {len(layout.buckets):>8}")


if __name__ == "__main__":
    main()
