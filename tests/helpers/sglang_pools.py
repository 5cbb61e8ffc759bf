"""SGLang's KV pools on CPU for the plugin's tests and benchmark: layout-identical stand-ins (fast), or SGLang's own
ReqToTokenPool / MHATokenToKVPool / TokenToKVPoolAllocator imported from the pinned wheel (slow: builds
.cache/sglang-deps once, see sglang_patches/source.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


class FreeListAllocator:
    """Same state and semantics as SGLang's TokenToKVPoolAllocator with page_size 1 and need_sort False."""

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        self.size, self.device = size, torch.device(device)
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)  # slot 0: padding

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, need: int) -> torch.Tensor | None:
        if need > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:need], self.free_pages[need:]
        return out

    def free(self, index: torch.Tensor) -> None:
        if index.numel():
            self.free_pages = torch.cat((self.free_pages, index))


def replica_pools(rows: int, size: int, layers: int, kv_heads: int, head_dim: int, max_len: int,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(req_to_token pool, KV pool, allocator) with SGLang's layout: rows + 1 req_to_token rows (row 0 padding),
    size + 1 KV slots per layer (slot 0 padding)."""
    req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(rows + 1, max_len, dtype=torch.int32, device=device))
    k_buffer = [torch.zeros(size + 1, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    v_buffer = [torch.zeros(size + 1, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    kv_pool = SimpleNamespace(
        k_buffer=k_buffer, v_buffer=v_buffer, layer_num=layers, head_num=kv_heads, head_dim=head_dim, start_layer=0,
        get_key_buffer=lambda layer: k_buffer[layer], get_value_buffer=lambda layer: v_buffer[layer],
    )
    return req_to_token_pool, kv_pool, FreeListAllocator(size, device)


def sglang_pools(rows: int, size: int, layers: int, kv_heads: int, head_dim: int, max_len: int):
    """The same from SGLang's own classes (CPU, float32)."""
    from sglang_patches.source import activate_cpu_import_env, prepare_cpu_import_env

    activate_cpu_import_env(prepare_cpu_import_env())
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    req_to_token_pool = ReqToTokenPool(size=rows, max_context_len=max_len, device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=kv_heads, head_dim=head_dim,
                               layer_num=layers, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=size, dtype=torch.float32, device="cpu", kvcache=kv_pool, need_sort=False)
    return req_to_token_pool, kv_pool, allocator
