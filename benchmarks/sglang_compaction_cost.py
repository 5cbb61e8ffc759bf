"""Step cost model of the SGLang plugin's compaction: eager ops and host syncs per compaction, the per-request loop the
plugin ran before #37 (tests/helpers/sglang_reference.py) against the batched call (sglang_patches.runtime), at 1, 16 and 256
requests due in one decode step.

On SGLang's stand-in pools (tests/helpers/sglang_pools.py: the layout of ReqToTokenPool / MHATokenToKVPool /
TokenToKVPoolAllocator, page_size 1), counted by `slime_sparse.utils.op_audit.OpCounter`: an eager op is about one
kernel launch on a GPU, a host sync a point where the scheduler waits for the device. The counts depend on the
number of layers (keys are gathered per layer: SGLang keeps one K buffer per layer), not on head dim or budget, so
the default shape is Qwen2.5-7B's layers and heads with a small head dim and budget.

    python benchmarks/sglang_compaction_cost.py                        # the table of benchmarks/README.md
    python benchmarks/sglang_compaction_cost.py --time --clock cpu     # + ms per compaction (this process's CPU)
    python benchmarks/sglang_compaction_cost.py --device cuda --dtype bfloat16 --time --check \
        --budget 512 --buffer 128 --head-dim 128                       # a GPU: + CUDA syncs, ms, graph replay

On CPU a device-to-host copy is no copy, so the loop's `kept.to("cpu")` (one more wait per request on a GPU) is not
in its sync column; on CUDA the column counts what `torch.cuda.set_sync_debug_mode` reports instead. --check: the
loop and the batched call leave the same kept slots, free list and eviction records on twin scenes, and (CUDA) the batched compaction
captured in a CUDA graph and replayed does what it does eagerly.
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/...` from a checkout; the stand-ins live with the tests
    sys.path.insert(0, str(REPO))

from sglang_patches.runtime import EVICTED_ATTR, SparseKVRuntime  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.utils.op_audit import OpCounter  # noqa: E402
from tests.helpers.sglang_pools import replica_pools  # noqa: E402
from tests.helpers.sglang_reference import compact_batch_per_request  # noqa: E402


def scene(cfg: KVCompressConfig, due: int, args: argparse.Namespace, seed: int = 0):
    """A decode batch of `due` requests, each at its trigger (budget + buffer slots, some tokens evicted before)."""
    n = cfg.budget + cfg.buffer
    gc.collect()  # the previous scene's pools go before this one's are allocated
    g = torch.Generator(device=args.device).manual_seed(seed)
    pools = replica_pools(due, due * n, args.layers, args.kv_heads, args.head_dim, n + 1, device=args.device,
                          dtype=DTYPES[args.dtype])
    req_to_token_pool, kv_pool, allocator = pools
    runtime = SparseKVRuntime.allocate(cfg, *pools, num_q_heads=args.q_heads, dtype=DTYPES[args.dtype]).attach()
    runtime.rings.normal_(generator=g)
    for buf in kv_pool.k_buffer:
        buf.normal_(generator=g)
    taken = allocator.alloc(due * n)
    req_to_token_pool.req_to_token[1:, :n] = taken.view(due, n).to(torch.int32)
    reqs = [SimpleNamespace(rid=f"r{i}", origin_input_ids=[0] * 64, output_ids=[0] * 300, req_pool_idx=i + 1,
                            kv_committed_len=n, kv_allocated_len=n, customized_info=None,
                            sampling_params=SimpleNamespace(custom_params=None), **{EVICTED_ATTR: 300 + 63 - n})
            for i in range(due)]
    lens = torch.full((due,), n, dtype=torch.int64)
    batch = SimpleNamespace(reqs=reqs, seq_lens=lens.to(args.device), seq_lens_cpu=lens, seq_lens_sum=due * n,
                            req_to_token_pool=req_to_token_pool)
    return runtime, batch


VARIANTS = {"loop": compact_batch_per_request, "batched": lambda runtime, batch: runtime.compact_batch(batch)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cuda_syncs(fn) -> int:
    """How many times fn made the host wait for the GPU (torch.cuda's sync debug mode, one warning each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(cfg: KVCompressConfig, due: int, variant: str, args: argparse.Namespace) -> dict:
    """Ops and syncs of one compaction (after a warm-up on its own scene), and its median time if asked."""
    run = VARIANTS[variant]
    with torch.no_grad():  # SGLang's scheduler runs under no_grad
        run(*scene(cfg, due, args))  # warm-up: device constants, allocator
        runtime, batch = scene(cfg, due, args)
        with OpCounter() as counter:
            assert run(runtime, batch) == due
        out = {"ops": counter.total, "syncs": counter.syncs}
        if args.device.startswith("cuda"):
            runtime, batch = scene(cfg, due, args)
            sync(args.device)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out["syncs"] = cuda_syncs(lambda: run(runtime, batch))
            out["peak"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        if args.time:
            times = []
            for r in range(args.repeats):
                runtime, batch = scene(cfg, due, args, seed=r)
                sync(args.device)
                t0 = time.process_time() if args.clock == "cpu" else time.perf_counter()
                run(runtime, batch)
                sync(args.device)
                times.append((time.process_time() if args.clock == "cpu" else time.perf_counter()) - t0)
            out["ms"] = 1e3 * statistics.median(times)
    return out


def check(cfg: KVCompressConfig, due: int, args: argparse.Namespace) -> str:
    """Loop and batched on twin scenes: same kept slots, free list and records? On CUDA: the batched device part captured
    in a CUDA graph, replayed from the same state, equal to its eager run?"""
    with torch.no_grad():
        (rt_a, a), (rt_b, b) = scene(cfg, due, args), scene(cfg, due, args)
        compact_batch_per_request(rt_a, a)
        rt_b.compact_batch(b)
        same = (torch.equal(rt_a.req_to_token, rt_b.req_to_token)
                and torch.equal(rt_a.allocator.free_pages, rt_b.allocator.free_pages)
                and [pickle.loads(pickle.dumps(r.customized_info)) for r in b.reqs]  # records, as SGLang ships them
                == [r.customized_info for r in a.reqs])
        verdict = f"loop == batched: {same}"
        if not args.device.startswith("cuda"):
            return verdict
        runtime, batch = scene(cfg, due, args)
        n = cfg.budget + cfg.buffer
        reqs = batch.reqs[: runtime.rows_per_call(n)]  # one call's worth: what one graph would hold
        table = torch.tensor([[r.req_pool_idx for r in reqs], [n + getattr(r, EVICTED_ATTR) for r in reqs],
                              list(range(len(reqs)))], device=args.device)
        before = runtime.req_to_token.clone(), batch.seq_lens.clone()

        def restore():
            runtime.req_to_token.copy_(before[0])
            batch.seq_lens.copy_(before[1])

        eager = runtime.compact_on_device(table, n, batch.seq_lens)
        eager_rows = runtime.req_to_token.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
            restore()
            runtime.compact_on_device(table, n, batch.seq_lens)
        torch.cuda.current_stream().wait_stream(side)
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = runtime.compact_on_device(table, n, batch.seq_lens)
        restore()
        graph.replay()
        torch.cuda.synchronize()
        replayed = (torch.equal(runtime.req_to_token, eager_rows)
                    and torch.equal(captured.freed, eager.freed) and torch.equal(captured.packed, eager.packed)
                    and bool((batch.seq_lens[: len(reqs)] == cfg.budget).all()))
        return f"{verdict}; CUDA graph of one call ({len(reqs)} requests) replayed == eager: {replayed}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["rkv", "snapkv", "streaming"])
    parser.add_argument("--due", nargs="+", type=int, default=[1, 16, 256], help="requests due in one step")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--q-heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--buffer", type=int, default=8)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--time", action="store_true", help="also time each compaction (median of --repeats)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (a loaded machine's waits not counted)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="loop == batched; on CUDA also a graph replay")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = "n/a" if not hasattr(os, "getloadavg") else " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {args.threads} thread(s), torch {torch.__version__}, {args.device} {args.dtype}; {args.layers} layers, "
          f"{args.q_heads}/{args.kv_heads} heads, head dim {args.head_dim}; budget {args.budget} + buffer "
          f"{args.buffer}, window {args.window}; {args.clock} clock; load average {load}\n")
    timed = " loop ms | batched ms | speed-up |" if args.time else ""
    cuda = args.device.startswith("cuda")
    memory = " loop peak GiB | batched peak GiB | batched calls |" if cuda else ""
    print(f"| method | due requests | loop ops | loop syncs | batched ops | batched syncs | ops ratio |{timed}{memory}")
    print("|---" * (7 + 3 * args.time + 3 * cuda) + "|")
    for method in args.methods:
        cfg = KVCompressConfig(method=method, budget=args.budget, buffer=args.buffer, window=args.window,
                               granularity="model")
        for due in args.due:
            loop, batched = (measure(cfg, due, v, args) for v in ("loop", "batched"))
            row = (f"| {method} | {due} | {loop['ops']} | {loop['syncs']} | {batched['ops']} | {batched['syncs']} | "
                   f"{loop['ops'] / batched['ops']:.1f}x |")
            if args.time:
                row += f" {loop['ms']:.2f} | {batched['ms']:.2f} | {loop['ms'] / batched['ms']:.1f}x |"
            if cuda:
                rows = scene(cfg, 1, args)[0].rows_per_call(cfg.budget + cfg.buffer)
                row += f" {loop['peak']:.2f} | {batched['peak']:.2f} | {-(-due // rows)} |"
            print(row, flush=True)
    if args.check:
        print()
        for method in args.methods:
            cfg = KVCompressConfig(method=method, budget=args.budget, buffer=args.buffer, window=args.window,
                                   granularity="model")
            for due in args.due:
                print(f"- {method}, {due} due: {check(cfg, due, args)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
