"""Throughput at the same total device memory (`rollout_bench.py --same-memory-gib G`, #43): dense against each
compression, every engine given the trainer's `--rollout-kv-cache-gib G` alone and admitting the rows that fit (its
own admission: KV and the working sets it counts, capacity rounding included). Compression turns memory into rows.

Two workloads per config, each timed after a warm-up call identical to it (same prompts, seed and lengths, so the
timed call replays the graphs the warm-up captured: the `captures` column reads 0 when it is warm):
- fixed: one wave of as many sequences as fit (at most --same-memory-max-prompts), every one decoding exactly
  NEW tokens: throughput with every row busy;
- mix: --mix-prompts sequences (a rollout's batch, the same for every config) whose responses end at sampled lengths,
  so that continuous batching matters (a dense engine refills its fewer rows, a compressed one drains its many).
  How the lengths are sampled: the model's final norm is zeroed, so its logits are 0 whatever the context and each
  token is drawn uniformly by the sample's own counter-based stream; a response stops at any of k stop ids (k = vocab /
  --mix-mean-new), so its length is geometric with that mean, capped at NEW. The lengths depend on (seed, sample)
  only, never on the cache: every config generates exactly the same tokens, which the table checks. Compute does not
  depend on weight values (these presets are random weights already).

Per row: rows admitted, sequences, mean response, tok/s, x dense (same workload), compaction share, graphs captured in
the timed call, and the memory: the admission's bytes for the rows it admitted beside, on CUDA, the peak read back from
torch's allocator over warm-up and timed call (allocated, and reserved: CUDA graph pools are reserved, not allocated,
while graphs replay), less what was allocated before the engine was built (the weights).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.rollout_runs import (DTYPES, RowSpec, build_model, compressions, make_prompts,  # noqa: E402
                                     model_config, our_engine, sync)
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402
from slime_sparse.rollout.embedded.runner import row_bytes  # noqa: E402

FIT_HEADER = ("| model | prompt | new | memory GiB | KV | slots per sequence | sequences that fit | x dense |\n"
              + "|---" * 8 + "|")
RUN_HEADER = ("| model | prompt | new | memory GiB | KV | workload | rows | sequences | mean new | tok/s | x dense "
              "| compress % | captures | admitted GiB | peak allocated GiB | peak reserved GiB |\n" + "|---" * 16 + "|")


def kv_name(kv: KVCompressConfig) -> str:
    return "dense" if not kv.enabled else f"{kv.method} B={kv.budget}+{kv.buffer}"


def configs(row: RowSpec, args) -> list[KVCompressConfig]:
    return [KVCompressConfig()] + compressions(row, args)


def fit_rows(row: RowSpec, args) -> list[dict]:
    """Sequences of this row that fit in --same-memory-gib, dense vs each compression, by the engine's own admission
    (`EmbeddedEngine.rows_for`) on a weightless model (the meta device: nothing is allocated). Its step mode rounds
    capacity as the device's would (graphs on CUDA: compile stands in for it, which rounds the same way)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(row.model, args)).to(DTYPES[args.dtype])
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, row.prompt_len + row.new_tokens)
    mode = "compile" if torch.device(args.device).type == "cuda" else "eager"
    records, dense = [], None
    for kv in configs(row, args):
        engine = EmbeddedEngine(model, kv, device="meta", step_mode=mode, kv_cache_gib=args.same_memory_gib)
        longest = row.prompt_len + row.new_tokens
        fit = engine.rows_for(kv, longest)
        dense = dense or fit
        records.append({"table": "same_memory_fit", "model": row.model, "prompt": row.prompt_len,
                        "new": row.new_tokens, "memory_gib": args.same_memory_gib, "kv": kv_name(kv),
                        # the slots a row gets, the engine's rounding included (its private sizing: no public one)
                        "slots": engine._runner_shape(kv, longest, fit).capacity, "fit": fit, "x_dense": fit / dense})
    return records


def format_fit(r: dict) -> str:
    return (f"| {r['model']} | {r['prompt']} | {r['new']} | {r['memory_gib']:g} | {r['kv']} | {r['slots']} | {r['fit']} "
            f"| {r['x_dense']:.2f} |")


@dataclass
class Workload:
    name: str  # fixed | mix
    prompts: list[list[int]]
    params: SamplingParams


def mix_params(vocab: int, new_tokens: int, mean_new: int) -> SamplingParams:
    """Uniform tokens (the zeroed norm) stopping at k = vocab / mean ids: geometric lengths of that mean, capped."""
    k = max(1, min(vocab - 1, round(vocab / mean_new)))
    return SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                          stop_token_ids=tuple(range(vocab - k, vocab)))


def measured_rows(row: RowSpec, args) -> list[dict]:
    """Each config's engine at --same-memory-gib: the mix, then one fixed wave, each warmed by an identical call."""
    model = build_model(row.model, row.prompt_len + row.new_tokens + 1, dtype=args.dtype, device=args.device,
                        seed=args.seed, model_dirs=args.model_dirs)
    with torch.no_grad():
        model.model.norm.weight.zero_()  # logits 0 whatever the context: lengths from the samples' streams alone
    vocab, longest = model.config.vocab_size, row.prompt_len + row.new_tokens
    mean_new = args.mix_mean_new or max(1, row.new_tokens // 3)
    mix = Workload("mix", make_prompts(RowSpec(row.model, args.mix_prompts, row.prompt_len, row.new_tokens), vocab,
                                       args.seed), mix_params(vocab, row.new_tokens, mean_new))
    cuda = torch.device(args.device).type == "cuda"
    records, dense, tokens_of = [], {}, {}
    for kv in configs(row, args):
        _free(cuda)
        base = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if cuda else (0, 0)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        run = our_engine(EmbeddedEngine, SamplingParams, model, kv, args, None, kv_cache_gib=args.same_memory_gib)
        engine = run.engine
        fit = engine.rows_for(kv, longest)
        wave = min(fit, args.same_memory_max_prompts)
        fixed = Workload("fixed", make_prompts(RowSpec(row.model, wave, row.prompt_len, row.new_tokens), vocab,
                                               args.seed),
                         SamplingParams(temperature=1.0, max_new_tokens=row.new_tokens, ignore_eos=True))
        for work in (mix, fixed):
            run(work.prompts, work.params)  # the warm-up: the very call that is timed next
            res = run(work.prompts, work.params)
            generated = sum(len(t) for t in res.tokens)
            tokens_of.setdefault(work.name, res.tokens)
            same = res.tokens == tokens_of[work.name] if work.name == "mix" else True
            tps = generated / res.seconds
            dense.setdefault(work.name, tps)
            peak = ((torch.cuda.max_memory_allocated() - base[0]) / 2**30,
                    (torch.cuda.max_memory_reserved() - base[1]) / 2**30) if cuda else (None, None)
            records.append({
                "table": "same_memory", "model": row.model, "prompt": row.prompt_len, "new": row.new_tokens,
                "memory_gib": args.same_memory_gib, "kv": kv_name(kv), "workload": work.name, "rows": res.rows,
                "sequences": len(work.prompts), "mean_new": generated / len(work.prompts), "tok_s": tps,
                "x_dense": tps / dense[work.name], "compress_pct": 100 * res.compress_s / res.seconds if kv.enabled
                else None, "captures": res.captures, "same_tokens": same,
                "admitted_gib": res.rows * row_bytes(model.config, kv, engine.last_stats.slots, model.dtype) / 2**30,
                "peak_allocated_gib": peak[0], "peak_reserved_gib": peak[1]})
            print(format_run(records[-1]), flush=True)
        del run, engine
    del model
    _free(cuda)
    return records


def format_run(r: dict) -> str:
    def gib(x):
        return "-" if x is None else f"{x:.3g}"
    compress = "-" if r["compress_pct"] is None else f"{r['compress_pct']:.1f}"
    mean = f"{r['mean_new']:.0f}" + ("" if r["same_tokens"] else " (tokens differ!)")
    return (f"| {r['model']} | {r['prompt']} | {r['new']} | {r['memory_gib']:g} | {r['kv']} | {r['workload']} | "
            f"{r['rows']} | {r['sequences']} | {mean} | {r['tok_s']:.1f} | {r['x_dense']:.2f} | {compress} | "
            f"{r['captures']} | {gib(r['admitted_gib'])} | {gib(r['peak_allocated_gib'])} | "
            f"{gib(r['peak_reserved_gib'])} |")


def _free(cuda: bool) -> None:
    import gc

    gc.collect()
    if cuda:
        sync("cuda")
        torch.cuda.empty_cache()
