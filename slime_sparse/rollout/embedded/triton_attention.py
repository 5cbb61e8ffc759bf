"""Split-KV decode attention in Triton that reads each row's length (the kernel shape of SGLang's triton decode backend
and of FlashDecoding): one new query token per row, GQA, over a cache laid out [rows, kv heads, slots, head dim].

Stage 1, one program per (row, KV head, split of the span): the group's query heads ride together as the rows of one
tile (so each key is loaded once per group), the split's slots below the row's length are streamed in blocks with an
online softmax, and the program writes its normalised partial output and log-sum-exp. Stage 2, one program per (row,
query head): the partials are merged by their log-sum-exps. Slots at or past a row's length are never read, so the
work follows what each row holds rather than the padded span, and a split that lies wholly past it does nothing.
Shapes and the split count depend on (rows, span) only: a captured step replays it unchanged.

Triton >= 3.0 language only (the GPU image has 3.6). The kernels are built on first use, so that a test can build them
under TRITON_INTERPRET=1 (read when a function is decorated) and run them on CPU tensors.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK_N = 64  # slots per inner block
SPLIT_SLOTS = 256  # about this many slots per split ...
MAX_SPLITS = 16  # ... and at most this many splits


_KERNELS = None  # (split kernel, merge kernel), built by `load` outside any compiled or captured region


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def load() -> None:
    """Build the kernels (once per process; TRITON_INTERPRET is read now)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = build()


def num_splits(span: int) -> int:
    return max(1, min(MAX_SPLITS, math.ceil(span / SPLIT_SLOTS)))


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def build():
    """The two kernels, freshly decorated (a test builds them under TRITON_INTERPRET=1 and passes them in)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, lse_ptr, scale, split_len,
                     s_qb, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_os, s_lb, s_lh,
                     GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        head_ok, dim_ok = heads < GROUP, dims < HEAD_DIM
        q_heads = kv_head * GROUP + heads
        q = tl.load(q_ptr + row * s_qb + q_heads[:, None] * s_qh + dims[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
        length = tl.load(len_ptr + row)
        start = split * split_len
        end = tl.minimum(start + split_len, length)
        k_base = k_ptr + row * s_kb + kv_head * s_kh
        v_base = v_ptr + row * s_vb + kv_head * s_vh
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for first in range(start, end, BLOCK_N):
            slots = first + tl.arange(0, BLOCK_N)
            slot_ok = slots < end
            kv_mask = slot_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + slots[:, None] * s_ks + dims[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(slot_ok[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * s_vs + dims[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        live = total > 0
        lse = tl.where(live, m + tl.log(tl.where(live, total, 1.0)), float("-inf"))
        out = tl.where(live[:, None], acc / tl.where(live, total, 1.0)[:, None], 0.0)
        tl.store(out_ptr + row * s_ob + q_heads[:, None] * s_oh + split * s_os + dims[None, :], out,
                 mask=head_ok[:, None] & dim_ok[None, :])
        tl.store(lse_ptr + row * s_lb + q_heads * s_lh + split, lse, mask=head_ok)

    @triton.jit
    def merge_kernel(part_ptr, lse_ptr, out_ptr, s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh,
                     SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        split_ok, dim_ok = splits < SPLITS, dims < HEAD_DIM
        lse = tl.load(lse_ptr + row * s_lb + head * s_lh + splits, mask=split_ok, other=float("-inf"))
        top = tl.max(lse, 0)
        weight = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
        parts = tl.load(part_ptr + row * s_pb + head * s_ph + splits[:, None] * s_ps + dims[None, :],
                        mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
        out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + row * s_ob + head * s_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    return split_kernel, merge_kernel


def decode_attention_lengths(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scale: float,
                             kernels=None) -> Tensor:
    """Attention of one query token per row over the first lengths[b] slots of its row.

    query [n, Hq, d], key / value [n, Hkv, S, d] (any strides but a unit last one), lengths [n] integers in [1, S].
    Returns [n, Hq, d] in the query's dtype; float32 inputs multiply in IEEE float32 (no TF32). `kernels`: `build()`'s
    pair (default: the process's, `load`)."""
    n, n_q_heads, head_dim = query.shape
    n_kv_heads, span = key.shape[1], key.shape[2]
    group = n_q_heads // n_kv_heads
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("decode_attention_lengths needs a unit stride on the head dimension")
    split_kernel, merge_kernel = kernels or _KERNELS
    splits = num_splits(span)
    split_len = math.ceil(math.ceil(span / splits) / BLOCK_N) * BLOCK_N  # slots per split, a multiple of BLOCK_N
    parts = torch.empty(n, n_q_heads, splits, head_dim, device=query.device, dtype=torch.float32)
    lse = torch.empty(n, n_q_heads, splits, device=query.device, dtype=torch.float32)
    block_d = max(16, _pow2(head_dim))
    split_kernel[(n, n_kv_heads, splits)](
        query, key, value, lengths, parts, lse, scale, split_len,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_H=max(16, _pow2(group)), BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
        BLOCK_D=block_d, IEEE=query.dtype == torch.float32)
    out = torch.empty(n, n_q_heads, head_dim, device=query.device, dtype=query.dtype)
    merge_kernel[(n, n_q_heads)](
        parts, lse, out, parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLITS=splits, BLOCK_S=max(2, _pow2(splits)), HEAD_DIM=head_dim, BLOCK_D=block_d)
    return out


def self_check(device: torch.device) -> str | None:
    """Build the kernels and compare them with SDPA on a small random problem (fp32 and bf16, ragged lengths, a
    grouped and an ungrouped head layout) on `device`; None when they agree, else why not."""
    import torch.nn.functional as F

    try:
        load()
        gen = torch.Generator(device="cpu").manual_seed(0)
        for dtype, tol, (n, hq, hkv, span, d) in ((torch.float32, 1e-4, (3, 12, 2, 600, 128)),
                                                  (torch.bfloat16, 2e-2, (2, 4, 4, 300, 64))):
            q, k, v = (torch.randn(shape, generator=gen).to(device, dtype)
                       for shape in ((n, hq, d), (n, hkv, span, d), (n, hkv, span, d)))
            lengths = torch.tensor([span, 1, span // 3][:n], dtype=torch.int32, device=device)
            got = decode_attention_lengths(q, k, v, lengths, d ** -0.5).float()
            mask = (torch.arange(span, device=device)[None] < lengths[:, None])[:, None, None]
            want = F.scaled_dot_product_attention(q.float().view(n, hkv, hq // hkv, d), k.float(), v.float(),
                                                  attn_mask=mask, scale=d ** -0.5).view(n, hq, d)
            err = float((got - want).abs().max())
            if not err <= tol:
                return f"{dtype}: max error {err:.3g} against SDPA (tolerance {tol})"
    except Exception as exc:  # a kernel that does not build or run here: the caller falls back to SDPA
        return f"{type(exc).__name__}: {exc}"
    return None


@torch.library.custom_op("slime_sparse::decode_attention_lengths", mutates_args=())
def decode_attention_op(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """`decode_attention_lengths` as one opaque op: torch.compile calls it as it is (no tracing into the launch), and
    an operation count sees one operation."""
    return decode_attention_lengths(query, key, value, lengths, scale)


@decode_attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scale: float) -> Tensor:
    return query.new_empty(query.shape)
