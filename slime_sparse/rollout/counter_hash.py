"""The 64-bit constants of the counter-based sampler's hash (splitmix64's golden gamma and finaliser multipliers, and
the vocabulary step), as the int64s with the same bits: shared by the torch path (`sampling.py`) and the Triton kernel
(`sampling_kernel.py`)."""
from __future__ import annotations


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MIX1, MIX2, VOCAB_STEP = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                                         0xD1B54A32D192ED03))
