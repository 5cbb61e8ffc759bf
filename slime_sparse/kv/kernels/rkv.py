"""R-KV's near-duplicate search as two Triton kernels that never write the n x n similarity.

`rkv_redundancy` (kv/methods/rkv.py) needs, per (layer, row, KV head) entry of unit keys u [n, d], for every slot i
the newest near-duplicate j*(i) = max{j != i : S[i, j] > threshold} (0 when there is none: R-KV's fallback) and
S[i, j*(i)], then subtracts from each column j the values of the rows whose j* is j. The PyTorch path writes S block
by block and passes over it several times (`>`, a cast, a multiply, `amax`, a gather) and charges the columns with
`scatter_add_` (atomics on CUDA: the last bit depends on the schedule).

- `_newest_kernel`, one program per (entry, block of rows i): for each block of columns j, S = u_i u_j^T on tensor
  cores, in the search dtype as the PyTorch path computes it (bf16 / fp16 caches: inputs cast to it and S rounded
  to it; fp32: IEEE fp32), the diagonal zeroed, and the largest j over the threshold kept in registers. Then
  S[i, j*] from the fp32 unit keys (0 on the diagonal), as the PyTorch path's half-precision branch computes it.
- `_charge_kernel`, one program per (entry, block of columns j): sums value[i] over the rows with j*(i) = j in a fixed
  order (blocks of i, each reduced as a tree): deterministic, no atomics, no n x n buffer.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported: the tests).
"""
from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

SEARCH_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: torch's rounding. By hand because Triton's
    interpreter truncates in `.to(tl.bfloat16)` (a GPU rounds to nearest even; this is exact on both)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # shifts keep uint32 (a 0xFFFF0000 mask is int64)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _search_values(x, SEARCH: tl.constexpr):
    """fp32 values rounded to the search dtype (still fp32): what the PyTorch path's cast of the unit keys and its
    similarity in that dtype hold."""
    if SEARCH == 1:
        x = _round_bf16(x)
    elif SEARCH == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _newest_kernel(unit, newest_out, value_out, n, d, threshold, SEARCH: tl.constexpr, INTERPRET: tl.constexpr,
                   BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    dims = tl.arange(0, BLOCK_D)
    base = unit + entry * n * d
    rows = base + i[:, None] * d + dims[None, :]
    row_mask = (i[:, None] < n) & (dims[None, :] < d)
    a = _search_values(tl.load(rows, mask=row_mask, other=0.0), SEARCH)
    newest = tl.zeros([BLOCK_I], dtype=tl.int32)
    for start in range(0, n, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        u_j = tl.load(base + j[:, None] * d + dims[None, :], mask=(j[:, None] < n) & (dims[None, :] < d), other=0.0)
        b = _search_values(u_j, SEARCH)
        # half-precision products are exact in fp32, so an fp32 dot of the rounded values is the tensor cores' sum
        # (fp32 accumulation); the interpreter's dot of bf16 operands is wrong (Triton 3.9), so it takes that path
        if SEARCH == 0 or INTERPRET:
            sim = tl.dot(a, tl.trans(b), input_precision="ieee")
        elif SEARCH == 1:
            sim = tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
        else:
            sim = tl.dot(a.to(tl.float16), tl.trans(b.to(tl.float16)))
        sim = tl.where(i[:, None] == j[None, :], 0.0, _search_values(sim, SEARCH))
        hit = (sim > threshold) & (j[None, :] < n)
        newest = tl.maximum(newest, tl.max(tl.where(hit, j[None, :], 0), axis=1))
    # S[i, j*] in fp32 from the unit keys (loaded again: the fp32 rows need not stay in registers through the loop)
    u_i = tl.load(rows, mask=row_mask, other=0.0)
    u_new = tl.load(base + newest[:, None] * d + dims[None, :], mask=row_mask, other=0.0)
    value = tl.where(newest == i, 0.0, tl.sum(u_i * u_new, axis=1))
    tl.store(newest_out + entry * n + i, newest, mask=i < n)
    tl.store(value_out + entry * n + i, value, mask=i < n)


@triton.jit
def _charge_kernel(newest, value, columns, out, n, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    charged = tl.zeros([BLOCK_J], dtype=tl.float32)
    for start in range(0, n, BLOCK_I):
        i = start + tl.arange(0, BLOCK_I)
        target = tl.load(newest + entry * n + i, mask=i < n, other=-1)
        v = tl.load(value + entry * n + i, mask=i < n, other=0.0)
        charged += tl.sum(tl.where(target[:, None] == j[None, :], v[:, None], 0.0), axis=0)
    c = tl.load(columns + entry * n + j, mask=j < n, other=0.0)
    tl.store(out + entry * n + j, c - charged, mask=j < n)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def rounded_threshold(threshold: float, dtype: torch.dtype) -> float:
    """The threshold as `sim > threshold` compares it with a tensor of `dtype`: torch rounds the Python scalar to the
    tensor's dtype (round to nearest even). Pure Python: no tensor, nothing for a CUDA graph to bake in."""
    single = struct.unpack("<I", struct.pack("<f", threshold))[0]
    if dtype == torch.bfloat16:
        single = ((single + 0x7FFF + ((single >> 16) & 1)) >> 16) << 16
        return struct.unpack("<f", struct.pack("<I", single))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", threshold))[0]
    return struct.unpack("<f", struct.pack("<f", threshold))[0]


def _blocks(d: int) -> tuple[int, int, int]:
    """(rows i, columns j, head dim) per program: small on the interpreter (numpy per program), a tensor-core tile
    on a GPU."""
    block_d = max(16, triton.next_power_of_2(d))
    return (32, 64, block_d) if interpreting() else (64, 64, block_d)


def newest_and_value(unit: Tensor, threshold: float, search: torch.dtype) -> tuple[Tensor, Tensor]:
    """j*(i) [E, n] int32 and S[i, j*(i)] [E, n] fp32 of unit keys [E, n, d] (fp32); `search`: the dtype the
    similarity is compared in (the cache's)."""
    if unit.device.type != "cuda" and not interpreting():
        raise RuntimeError("the Triton R-KV kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1 (set before "
                           "triton is imported)")
    unit = unit.contiguous()
    entries, n, d = unit.shape
    block_i, block_j, block_d = _blocks(d)
    newest = torch.empty(entries, n, dtype=torch.int32, device=unit.device)
    value = torch.empty(entries, n, dtype=torch.float32, device=unit.device)
    _newest_kernel[(entries, triton.cdiv(n, block_i))](
        unit, newest, value, n, d, rounded_threshold(threshold, search), SEARCH=SEARCH_CODES[search],
        INTERPRET=interpreting(), BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_D=block_d)
    return newest, value


def charged_columns(unit: Tensor, columns: Tensor, threshold: float, search: torch.dtype) -> Tensor:
    """columns [E, n] minus, in each column j, S[i, j] of the rows i whose newest near-duplicate is j: both kernels
    over unit keys [E, n, d] (fp32)."""
    newest, value = newest_and_value(unit, threshold, search)
    n = unit.shape[1]
    block_i, block_j, _ = _blocks(unit.shape[2])
    out = torch.empty_like(columns)
    _charge_kernel[(unit.shape[0], triton.cdiv(n, block_j))](newest, value, columns.contiguous(), out, n,
                                                             BLOCK_I=block_i, BLOCK_J=block_j)
    return out
