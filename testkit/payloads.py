"""Synthetic data that tests and benchmarks send: reproducible from a seed."""

from __future__ import annotations

import random


def text(size: int, seed: int) -> bytes:
    """Text-like blocks: random lines from a pool, so a stream's history and a slow codec pay off."""
    r = random.Random(seed)
    vocab = [bytes(r.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9))) for _ in range(3000)]
    lines = [b" ".join(r.choices(vocab, k=r.randint(4, 14))) + b"\n" for _ in range(4000)]
    out = bytearray()
    while len(out) < size:
        out += b"".join(r.choices(lines, k=64))
    return bytes(out[:size])
