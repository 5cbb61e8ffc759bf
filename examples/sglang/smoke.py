"""GPU smoke test of the patched SGLang (needs one GPU, SGLang == sglang_patches.version.SGLANG_VERSION and
slime_sparse installed with its `sglang.srt.plugins` entry point).

A tiny Qwen2 config with random weights (--load-format dummy, fixed seed inside SGLang), token ids in and out
(--skip-tokenizer-init). Checks, each with CUDA graphs on and off:
1. budget >= sequence length: greedy tokens and log-probs identical to the unpatched server;
2. small budget: every request completes, the cache really was compressed (meta_info sparse_kv_kept), each sample
   carries its eviction record (meta_info sparse_kv_evictions, for --loss-type shadow / smd), and the
   allocator returns to full (SGLang's idle leak check made strict: a leak kills the server);
3. the same after a weight update through update_weights_from_tensor (same weights re-sent);
4. dense evaluation on the small-budget server (the per-request opt-out used by `eval_engine("dense")`): greedy
   tokens and log-probs identical to the unpatched server, and those requests are never compressed;
5. CUDA graphs stay on across compactions: with a small budget, greedy tokens and eviction records with decode graphs
   on equal those with graphs off (whenever the unpatched server's tokens agree between the two modes, the control).

    python examples/sglang/smoke.py --out /tmp/sglang_smoke
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.rollout.sglang import SGLangEngineConfig, SGLangRolloutEngine

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}


def write_model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_QWEN2))
    return path


def run(model: Path, kv: KVCompressConfig | None, cuda_graph: bool, log_dir: Path, prompts, params, port: int,
        weight_update: bool = False):
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"  # a leaked slot raises in the scheduler
    cfg = SGLangEngineConfig(model_path=str(model), load_format="dummy", cuda_graph=cuda_graph, base_port=port,
                             mem_fraction_static=0.3, attention_backend="fa3", startup_timeout_s=300)
    engine = SGLangRolloutEngine.launch(cfg, kv, log_dir)
    try:
        if weight_update:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            # the weights of an HF model of the same config: after the update, generation must still work with
            # the budgeted cache (and the cache was flushed in between)
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), torch_dtype=torch.bfloat16).cuda()
            from slime_sparse.rollout.sglang import TensorWeightSync

            engine.weight_sync = TensorWeightSync()
            engine.update_weights(hf.state_dict())
        outs = engine.generate(prompts, params, seed=0)
        dense_view = None
        if kv is not None and not weight_update:  # the same servers, requests opting out of compression
            dense_view = engine.with_kv(KVCompressConfig(method="none")).generate(prompts, params, seed=0)
        time.sleep(5)  # let the scheduler go idle and run its (strict) leak check
        alive = engine.generate_clients[0].health()
        return outs, alive, dense_view
    finally:
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("outputs/sglang_smoke"))
    args = parser.parse_args()
    model = write_model(args.out / "tiny_qwen2")
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(20 + 5 * i)] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=160, ignore_eos=True)
    failures = []
    dense_by_mode, small_by_mode = {}, {}
    for graph in (True, False):
        tag = "graph" if graph else "eager"
        dense, ok_dense, _ = run(model, None, graph, args.out / f"dense-{tag}", prompts, greedy, 31000)
        big = KVCompressConfig(method="rkv", budget=1024, buffer=64, window=8, granularity="model")
        same, ok_same, _ = run(model, big, graph, args.out / f"big-{tag}", prompts, greedy, 31010)
        for a, b in zip(dense, same):
            if a.response_ids != b.response_ids or a.logprobs != b.logprobs:
                failures.append(f"[{tag}] budget >= length differs from the unpatched server")
                break
        small = KVCompressConfig(method="rkv", budget=48, buffer=16, window=8, granularity="model")
        for update in (False, True):
            outs, alive, dense_view = run(model, small, graph, args.out / f"small-{tag}-{update}", prompts,
                                          greedy, 31020, weight_update=update)
            if not alive:
                failures.append(f"[{tag}, update={update}] server died (leak check?) - see its log")
            if any(len(o.response_ids) != 160 for o in outs):
                failures.append(f"[{tag}, update={update}] a request did not complete")
            if not all(o.kv.compressions > 0 and o.kv.peak_kv_tokens <= 48 + 16 for o in outs):
                failures.append(f"[{tag}, update={update}] cache not bounded by budget + buffer")
            if any(o.evictions is None or o.evictions.shape != (1, 1, 48) for o in outs):
                failures.append(f"[{tag}, update={update}] a compressed sample came without its eviction record")
            print(f"[{tag}] update={update} savings:", [round(o.kv.savings, 3) for o in outs])
            if not update:
                small_by_mode[tag] = outs
            if dense_view is not None:
                if any(a.response_ids != b.response_ids or a.logprobs != b.logprobs for a, b in zip(dense, dense_view)):
                    failures.append(f"[{tag}] dense opt-out on the small-budget server differs from the unpatched one")
                if any(o.kv.compressions for o in dense_view):
                    failures.append(f"[{tag}] a dense opt-out request was compressed")
        if not (ok_dense and ok_same):
            failures.append(f"[{tag}] a dense/large-budget server died")
        dense_by_mode[tag] = dense
    control = all(a.response_ids == b.response_ids for a, b in zip(dense_by_mode["graph"], dense_by_mode["eager"]))
    if control:
        for a, b in zip(small_by_mode["graph"], small_by_mode["eager"]):
            same_record = (a.evictions is not None and b.evictions is not None
                           and a.evictions.starts.tolist() == b.evictions.starts.tolist()
                           and a.evictions.keep_bits.tolist() == b.evictions.keep_bits.tolist())
            if a.response_ids != b.response_ids or not same_record:
                failures.append("[graph vs eager] compressed generation differs between decode graphs on and off")
                break
    else:
        print("note: the unpatched server's greedy tokens differ between graphs on and off; graph-vs-eager under "
              "compression not compared")
    for line in failures:
        print("FAIL", line)
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
