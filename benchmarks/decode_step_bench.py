"""One decode step of the embedded engine, by how it runs (#43 item 3): operations, bytes and time.

--count (any machine, nothing is run on data: the meta device): per decode step, the operations dispatched (about one
kernel launch each on a GPU) and the bytes they read + write (inputs + outputs of every operation, views excluded), at
a --shape, --batch rows and a --context of slots per row, for the engine of commit --before (HF's modules, inverse-CDF
sampler, SDPA under a mask) and this checkout's (our decode body: fused qkv and gate/up, one-op RMSNorm, RoPE from a
table; the Gumbel sampler; SDPA or the length-reading Triton kernel). The Triton kernels run on CUDA only, so their
bytes are arithmetic: the attention kernel reads each row's keys and values up to its length (--mean-length, counted
as that share of the span the SDPA path reads), the sampler kernel reads the logits once (it replaces the torch
sampler's operations from the division by T onwards).

--time (a GPU): tokens/s of generate() at --batch x --prompt + --new tokens (EOS ignored, dense cache), each variant
warmed at the timed length first (the timed calls capture nothing), interleaved repeats, medians, and the ratio to the
first variant (the engine of --before when given).

    python benchmarks/decode_step_bench.py --count --before 0192e6e                         # CPU, ~1 min
    python benchmarks/decode_step_bench.py --time --device cuda --dtype bf16 --before 0192e6e  # GPU, ~3 min
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.rollout_runs import DTYPES, PRESETS, build_model, load_before, make_prompts, RowSpec, sync  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402
from slime_sparse.utils.op_audit import OpCounter, runs_kernel  # noqa: E402

META = torch.device("meta")
ATTENTION_OP = "slime_sparse.decode_attention_lengths"
SAMPLER_OP = "slime_sparse.gumbel_sample"
# (label, our decode body, attention, step mode): the variants --time runs
VARIANTS = [("hf modules + sdpa, graphs", False, "sdpa", "cuda_graph"),
            ("body + sdpa, graphs", True, "sdpa", "cuda_graph"),
            ("body + triton, graphs", True, "triton", "cuda_graph"),
            ("body + sdpa, compiled graphs", True, "sdpa", "cuda_graph_compile"),
            ("body + triton, compiled graphs", True, "triton", "cuda_graph_compile")]


# gathers and scatters move what they return or write (and their indices), not the whole tensor they index
GATHERS = {"aten.embedding", "aten.index", "aten.gather", "aten.index_select"}
SCATTERS = {"aten.index_put_", "aten.index_put", "aten.index_copy_", "aten.index_copy", "aten.scatter_"}


class ByteCounter(TorchDispatchMode):
    """Bytes of the tensors every operation takes and returns (views excluded; a gather its output and indices, a
    scatter the values it writes and its indices): a step's memory traffic, as if no operation found its inputs in a
    cache. `kv_share` scales the key / value inputs of the length-reading attention op (it reads each row up to its
    length, not the span its inputs are views of)."""

    def __init__(self, kv_share: float = 1.0) -> None:
        super().__init__()
        self.total, self.kv_share, self.ops = 0, kv_share, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not runs_kernel(func, args, out):
            return out
        name = str(getattr(func, "overloadpacket", func))
        ins = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        size = [t.numel() * t.element_size() for t in ins]
        if name == ATTENTION_OP:
            size[1:3] = [b * self.kv_share for b in size[1:3]]
        if name in GATHERS:
            size = size[1:]  # the indices; the rows read are the output's size
        elif name in SCATTERS:
            size = size[1:] + size[-1:]  # indices and values, the values written again
            outs = []
        self.total += sum(size) + sum(t.numel() * t.element_size() for t in outs)
        self.ops += 1
        return out


def meta_model(shape: str, context: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, cfg = PRESETS[shape]
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    with torch.device(META):
        model = model_cls(config_cls(**cfg, max_position_embeddings=context + 1, tie_word_embeddings=True))
    return model.to(dtype).eval()


def count_step(pkg, model, args, body: bool, attention: str, sampler_kernel: bool) -> tuple[int, float]:
    """(operations, bytes) of one decode step of `pkg`'s engine over args.batch rows of args.context slots."""
    def sub(name: str):
        return importlib.import_module(f"{pkg.__name__}.{name}")

    layers = model.config.num_hidden_layers
    runner_module, head = sub("rollout.embedded.runner"), model.get_output_embeddings().weight
    runner_args = {}
    if body or attention != "sdpa":  # this checkout's engine (the --before one has neither)
        runner_args = dict(decode_body=sub("rollout.embedded.decode_body").DecodeBody(model) if body else None,
                           decode_attention=attention)
    shape = runner_module.RunnerShape(sub("kv").KVCompressConfig(), args.batch, args.context, "eager", 1)
    runner = runner_module.ModelRunner(model, shape, (args.context,) * layers, META,
                                       lambda h: sub("utils.lm_head").lm_head_logits(h, head, fp32=False),
                                       **runner_args)
    params = sub("rollout.sampling").SamplingParams(temperature=1.0)
    kv_share = args.mean_length / args.context
    step = getattr(runner, "decode", runner.step)  # a --before engine's runner.decode(...) is today's runner.step(...)
    with torch.inference_mode(), sub("rollout.embedded.attention").budget_attention_installed(model):
        step(args.batch, (args.context,) * layers, params)  # the first call may build constants
        with OpCounter() as ops, ByteCounter(kv_share) as nbytes:
            step(args.batch, (args.context,) * layers, params)
    total_ops, total_bytes = ops.total, nbytes.total
    if sampler_kernel:  # the kernel replaces the torch sampler: measured apart and swapped in by arithmetic
        logits = torch.empty(args.batch, model.config.vocab_size, device=META)
        with OpCounter() as sampler_ops, ByteCounter() as sampler_bytes:
            sub("rollout.sampling").sample_tokens(logits, params, torch.zeros(args.batch, dtype=torch.int64, device=META),
                                               torch.zeros(args.batch, dtype=torch.int64, device=META))
        total_ops += 1 - sampler_ops.total
        total_bytes += logits.numel() * 4 + args.batch * 12 - sampler_bytes.total
    return total_ops, total_bytes


def count_table(args, before) -> list[str]:
    dtype = DTYPES[args.dtype]
    import slime_sparse

    rows = [("before", before, False, "sdpa", False)] if before is not None else []
    rows += [("after: hf modules + sdpa", slime_sparse, False, "sdpa", False),
             ("after: body + sdpa", slime_sparse, True, "sdpa", False),
             ("after: body + sdpa + sampler kernel", slime_sparse, True, "sdpa", True),
             ("after: body + triton + sampler kernel", slime_sparse, True, "triton", True)]
    lines = ["| shape | batch | slots | engine | ops / step | x first | GB read + written / step | x first |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for shape in args.shapes:
        first = None
        for label, pkg, body, attention, kernel in rows:
            ops, nbytes = count_step(pkg, meta_model(shape, args.context, dtype), args, body, attention, kernel)
            first = first or (ops, nbytes)
            lines.append(f"| {shape} | {args.batch} | {args.context} | {label} | {ops} | {ops / first[0]:.2f} | "
                         f"{nbytes / 1e9:.3f} | {nbytes / first[1]:.2f} |")
            print(lines[-1], flush=True)
    return lines


def time_table(args, before) -> list[str]:
    model = build_model(args.shapes[0], args.prompt + args.new + 1, dtype=args.dtype, device=args.device, seed=0)
    prompts = make_prompts(RowSpec(args.shapes[0], args.batch, args.prompt, args.new), model.config.vocab_size, 0)
    engines = []
    if before is not None:
        engines.append(("before (graphs)", before.rollout.embedded.EmbeddedEngine(
            model, max_batch_size=args.batch, device=args.device), before.rollout.SamplingParams))
    for label, body, attention, mode in VARIANTS:
        engines.append((label, EmbeddedEngine(model, max_batch_size=args.batch, device=args.device, step_mode=mode,
                                              decode_attention=attention, hf_decode=not body), SamplingParams))
    times: dict[str, list[float]] = {label: [] for label, _, _ in engines}
    for repeat in range(args.repeats + 1):  # the first round warms every engine at the timed length
        for label, engine, params_cls in engines:
            params = params_cls(temperature=1.0, max_new_tokens=args.new, ignore_eos=True)
            sync(args.device)
            t0 = time.perf_counter()
            engine.generate(prompts, params, seed=repeat)
            sync(args.device)
            if repeat:
                times[label].append(time.perf_counter() - t0)
                captured = getattr(getattr(engine, "last_stats", None), "captures", 0)
                if captured:
                    print(f"# {label}: {captured} graphs captured in a timed call")
    lines = ["| variant | tok/s | x first | ms / step |", "|---|---|---|---|"]
    rates = {label: args.batch * args.new / statistics.median(times[label]) for label, _, _ in engines}
    first = next(iter(rates.values()))
    for label, tps in rates.items():
        lines.append(f"| {label} | {tps:.0f} | {tps / first:.2f} | {1000 * args.batch / tps:.2f} |")
    best = max(rates, key=rates.get)
    lines.append(f"decode step: fastest {best}, {rates[best]:.0f} tok/s = {rates[best] / first:.2f}x {next(iter(rates))}"
                 + (f"; #43 target 16,000 tok/s (dense, batch 64, +128): {'met' if rates[best] >= 16000 else 'missed'}"
                    if (args.shapes[0], args.batch, args.new) == ("qwen2.5-1.5b", 64, 128) else ""))
    print("\n".join(lines), flush=True)
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", action="store_true", help="ops and bytes per decode step (meta device)")
    p.add_argument("--time", action="store_true", help="tok/s of each way of running the step (GPU)")
    p.add_argument("--before", default=None, metavar="REV", help="also the engine of this git commit")
    p.add_argument("--shapes", nargs="+", default=None, choices=sorted(PRESETS),
                   help="model shapes (default: tiny and qwen2.5-1.5b for --count, qwen2.5-1.5b for --time)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="--count: slots per row (the span a step reads)")
    p.add_argument("--mean-length", type=float, default=192.0,
                   help="--count: mean slots a row holds (prompt 128 + half of 128 new: a wave's mean)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args(argv)
    if not (args.count or args.time):
        p.error("give --count and/or --time")
    if args.shapes is None:
        args.shapes = ["tiny", "qwen2.5-1.5b"] if args.count else ["qwen2.5-1.5b"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, GPU {gpu}, {args.dtype}, batch {args.batch}; "
          f"load average {os.getloadavg()[0]:.1f}; before = {args.before or '-'}")
    before = load_before(args.before) if args.before else None
    try:
        return (count_table(args, before) if args.count else []) + (time_table(args, before) if args.time else [])
    finally:
        if before is not None:
            shutil.rmtree(before.__bench_tmp__, ignore_errors=True)


if __name__ == "__main__":
    main()
