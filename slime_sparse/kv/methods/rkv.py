"""R-KV: attention importance minus key redundancy, for reasoning traces compressed while they are decoded."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops import attention_logits, gqa_reduce, pool1d, scored_length, with_protected
from .base import (KVMethod, ScoreShape, bad_knob, check_gqa, check_pooling, gqa_knob, kernel_knob, knob,
                   pooling_knob, register)

COSINE_EPS = 1e-8  # R-KV's epsilon in k / (||k|| + eps)
# Scratch memory for the similarity blocks of one redundancy call on the PyTorch path (blocks and their temporaries):
# about an L2 cache on CPU, where bigger blocks are memory-bound; on CUDA a few blocks at a small share of the
# compaction's workspace (the compressor bounds the whole of it).
SIM_SCRATCH_BYTES = {"cuda": 256 << 20}
DEFAULT_SIM_SCRATCH_BYTES = 4 << 20
SIM_TEMP_BYTES = 1 + 4 + 4  # per similarity entry beside the block: `sim > t` (bool), its int32 cast, times slot
# The near-duplicate search: "triton" (kv/kernels/rkv.py), "torch" (the reference), or "auto" (the default: Triton on
# CUDA when it is importable).
KERNEL_ENV = "SLIME_SPARSE_RKV_KERNEL"
KERNEL_CHOICES = ("auto", "triton", "torch")


@register
@dataclass(frozen=True)
class RKV(KVMethod):
    """R-KV (Cai et al., arXiv 2505.24133): score = mix_lambda * importance - (1 - mix_lambda) * redundancy over the
    scored slots. Importance: the window queries' attention logits reduced over each KV group (before the softmax,
    as R-KV's `compute_attention_scores`), softmax over the scored slots only, mean over the window, pooled.
    Redundancy: `rkv_redundancy` over every slot (window included), then sliced."""

    name = "rkv"
    needs_queries = True

    kernel_size: int = kernel_knob()
    pooling: str = pooling_knob()
    gqa_reduce: str = gqa_knob()
    mix_lambda: float = knob(0.1, "R-KV: score = lambda x importance - (1 - lambda) x redundancy")
    sim_threshold: float = knob(0.5, "R-KV: the newest near-duplicate (cosine > threshold) is exempt from redundancy")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pooling(self.kernel_size, self.pooling)
        check_gqa(self.gqa_reduce)
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise bad_knob("mix_lambda", self.mix_lambda, "must lie in [0, 1]")

    def importance(self, keys: Tensor, queries: Tensor) -> Tensor:
        """[..., Hkv, m]: of the scored slots [0, m). No causal mask: every query sits after every scored slot."""
        n_kv_heads, n = keys.shape[-3:-1]
        m = scored_length(self.window, n)
        logits = gqa_reduce(attention_logits(keys, queries), n_kv_heads, self.gqa_reduce, dim=-3)[..., :m]
        return pool1d(logits.softmax(dim=-1).mean(dim=-2), self.kernel_size, self.pooling)

    def score(self, keys: Tensor, queries: Tensor, attn_mass: Tensor | None = None) -> Tensor:
        n = keys.shape[-2]
        m = scored_length(self.window, n)
        redundancy = rkv_redundancy(keys, self.sim_threshold)[..., :m]  # its near-duplicates in the keys' dtype
        mixed = self.mix_lambda * self.importance(keys, queries) - (1.0 - self.mix_lambda) * redundancy
        return with_protected(mixed, n, self.sinks)

    def score_bytes(self, s: ScoreShape) -> int:
        """The redundancy's peak (`redundancy_bytes`), or the importance's beside the redundancy it keeps: fp32 copies
        of half keys and queries while the logits are computed, logits and their scaled copy, then the GQA-reduced
        logits and their softmax."""
        logits = 4 * s.entries * s.q_heads * s.queries * s.slots
        queries = s.upcast * s.entries * s.q_heads * s.queries * s.head_dim
        reduced = 4 * s.entries * s.heads * s.queries * s.slots
        importance = queries + max(s.upcast * s.keys + logits, 2 * logits, logits + 2 * reduced)
        return max(redundancy_bytes(s), 4 * s.per_slot + importance)


def rkv_redundancy(keys: Tensor, sim_threshold: float, scratch_bytes: int | None = None,
                   kernel: str | None = None) -> Tensor:
    """R-KV's redundancy of every slot: [..., Hkv, n] float32, a softmax over slots (each head's row sums to 1).

    Per KV head, S = cosine similarity of keys with the diagonal zeroed. In each row i, the entry of the *newest*
    near-duplicate j* = max{j : S[i, j] > sim_threshold} is zeroed, so the newest copy of a repeated pattern is
    not charged for its similarity to the older copies (it survives, the older ones go). Redundancy of slot j is
    the mean of column j (divided by n, the diagonal included), then softmax over j.
    Faithful to R-KV's `cal_similarity`, including its fallback: a row with no near-duplicate marks index 0, so
    that row's similarity to slot 0 is zeroed too (slot 0 looks slightly less redundant).

    Computed without keeping S: a column sum of S is u_j . sum_i u_i - u_j . u_j (u the unit keys, fp32), and only
    j*(i) and S[i, j*(i)] need S itself. The near-duplicates are searched in the keys' dtype when it is half
    precision (bf16 / fp16 caches on a GPU: tensor cores, half the bytes), which is where R-KV's own code finds them
    (its `cal_similarity` runs in the cache's dtype); the values subtracted and the column sums stay fp32. fp32
    keys: everything in fp32. Two ways to search, equal up to fp32 rounding (`kernel`, default `redundancy_kernel`):
    - "triton": kv/kernels/rkv.py, which never writes S and charges the columns without atomics (deterministic);
    - "torch": S in blocks of at most `scratch_bytes` of temporaries (default SIM_SCRATCH_BYTES by device), each
      read twice, the columns charged with `scatter_add_`. The reference.
    """
    unit = keys.float()
    unit = unit / (unit.norm(dim=-1, keepdim=True) + COSINE_EPS)  # the fp32 copy of half keys is freed here
    n, d = unit.shape[-2:]
    flat = unit.reshape(-1, n, d)  # [E, n, d]: one entry per (leading index, head)
    columns = (flat @ flat.sum(dim=1).unsqueeze(-1)).squeeze(-1) - (flat * flat).sum(dim=-1)  # [E, n]
    half = keys.dtype in (torch.bfloat16, torch.float16)
    if (kernel or redundancy_kernel(keys.device)) == "triton":
        from ..kernels.rkv import charged_columns  # Triton is imported only where the kernel runs

        columns = charged_columns(flat, columns, sim_threshold, keys.dtype if half else torch.float32)
        return (columns / n).softmax(dim=-1).reshape(unit.shape[:-1])
    search = flat.to(keys.dtype) if half else flat
    block = sim_block(n, search.element_size(), keys.device, scratch_bytes)
    slots = torch.arange(n, device=keys.device)
    for start in range(0, flat.shape[0], block):
        part = search[start : start + block]
        sim = part @ part.transpose(-1, -2)  # [b, n, n]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        newest = newest_duplicate(sim, sim_threshold)  # [b, n]
        if half:  # S[i, j*] in fp32, from the unit keys (0 on the diagonal, which S never counts)
            own = flat[start : start + block]
            value = (own * own.gather(1, newest.unsqueeze(-1).expand(-1, -1, d))).sum(dim=-1)
            value = value.masked_fill(newest == slots, 0.0)
        else:
            value = sim.gather(-1, newest.unsqueeze(-1)).squeeze(-1)
        columns[start : start + block].scatter_add_(-1, newest, -value)
    return (columns / n).softmax(dim=-1).reshape(unit.shape[:-1])


def sim_block(n: int, element_size: int, device: torch.device, scratch_bytes: int | None = None) -> int:
    """(Entry, head) pairs whose n x n similarity the PyTorch path computes at once: its block and the temporaries
    `newest_duplicate` makes of it (a bool and two int32 per entry) within `scratch_bytes` (default
    SIM_SCRATCH_BYTES by device)."""
    if scratch_bytes is None:
        scratch_bytes = SIM_SCRATCH_BYTES.get(device.type, DEFAULT_SIM_SCRATCH_BYTES)
    return max(1, scratch_bytes // ((element_size + SIM_TEMP_BYTES) * n * n))


def redundancy_bytes(s: ScoreShape) -> int:
    """Peak bytes of `rkv_redundancy` over a call of shape `s`: the unit keys beside the fp32 copy of half keys and
    the norms; the unit keys, x * x and the column sums; then the search: the unit keys, the column sums and (half
    keys) their cast, with either the kernel's three [E, n] outputs or the PyTorch path's block of similarities and
    its temporaries (or, half keys, the block beside two gathers of unit keys for S[i, j*])."""
    unit, per_slot, n = 4 * s.keys, 4 * s.per_slot, s.slots
    prepare = max(s.upcast * s.keys + unit + 2 * per_slot, 2 * unit + 2 * per_slot)
    if redundancy_kernel(torch.device(s.device)) == "triton":
        return max(prepare, unit + 4 * per_slot)
    half = s.dtype_bytes != 4
    search = s.dtype_bytes if half else 4
    block = min(s.entries * s.heads, sim_block(n, search, torch.device(s.device)))
    sims = block * n * n
    temps = max(sims * (search + 8), sims * search + (8 * block * n * s.head_dim if half else 0))
    return max(prepare, unit + per_slot + (s.dtype_bytes * s.keys if half else 0) + 8 * n + temps + 8 * block * n)


def redundancy_kernel(device: torch.device) -> str:
    """Which near-duplicate search `rkv_redundancy` runs on `device`: the env KERNEL_ENV ("triton", "torch"), else
    ("auto") the Triton kernel on CUDA when triton is importable, the PyTorch path otherwise."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r} is invalid: choose one of {KERNEL_CHOICES}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
    return choice


def newest_duplicate(sim: Tensor, threshold: float) -> Tensor:
    """[..., n] long: per row i of sim [..., n, n], the largest j with sim[i, j] > threshold, else 0 (R-KV's fallback).

    Slot numbers are multiplied into the mask as int32 rather than selected from int64 (torch.where): the same
    indices for half the memory traffic of this pass over n x n entries.
    """
    slot = torch.arange(sim.shape[-1], device=sim.device, dtype=torch.int32)
    return ((sim > threshold).to(torch.int32) * slot).amax(dim=-1).long()
