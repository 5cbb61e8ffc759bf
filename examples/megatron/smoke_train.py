#!/usr/bin/env python
"""Smoke test of the Megatron learner: a few Sparse-RL training steps per TP x PP layout, loss and timing.

    python examples/megatron/smoke_train.py              # tiny random Qwen2: 1x1 (+ 2x1 and 1x2 with 2 GPUs)
    python examples/megatron/smoke_train.py --hf-dir Qwen2.5-0.5B --layouts 1x1 2x1 1x2 --steps 5 --bf16
    python examples/megatron/smoke_train.py --bf16 --enable-fp32-lm-head   # the output layer as an fp32 GEMM

A layout "TxP" runs T x P processes (tensor x pipeline parallel, one replica). On GPUs it exercises
Megatron's DDP, distributed optimizer and forward/backward schedules (NCCL, one process per GPU);
without GPUs the same script runs on CPU over gloo (torch AdamW), which is how it was checked on
CI-class machines. Each step: dense recompute of pi_old and pi_ref, then one optimizer
step of the Sparse-RL loss on random tokens with random advantages and sparsity weights.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def make_tiny_qwen2(path: str, *, hidden: int, layers: int, vocab: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(2, hidden // 64), num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def worker(rank: int, world_size: int, hf_dir: str, args: argparse.Namespace, tp: int, pp: int) -> None:
    from slime_sparse.algo import LossConfig
    from slime_sparse.backends.base import TrainBatch
    from slime_sparse.backends.batching import MicroBatching
    from slime_sparse.backends.megatron import MegatronConfig, MegatronLearner, OptimConfig
    from slime_sparse.backends.megatron.model_config import read_hf_config
    from slime_sparse.backends.megatron.parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(tp, pp), seed=args.seed)
    name = f"TP={tp} PP={pp}"
    hf_config = read_hf_config(hf_dir)
    loss_cfg = LossConfig(eps_clip=0.2, use_kl_loss=True, kl_loss_coef=1e-4, kl_loss_type="k3")
    learner = MegatronLearner(
        hf_config, loss_cfg, hf_dir=hf_dir, megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        optim=OptimConfig(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98)), batching=MicroBatching(args.max_tokens),
        temperature=1.0, need_ref=True, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        fp32_lm_head=args.enable_fp32_lm_head,
    )
    if rank == 0:
        from slime_sparse.backends.megatron.kernels import kernel_choice

        print(f"{name}: {kernel_choice().describe()}; LM head {'fp32' if args.enable_fp32_lm_head else 'model dtype'}",
              flush=True)
    g = torch.Generator().manual_seed(args.seed)  # same data on every rank (one data-parallel group)
    vocab = int(hf_config["vocab_size"])
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.prompt_len + args.response_len), generator=g).tolist()
        rlens = [args.response_len] * args.batch
        t0 = time.perf_counter()
        old = learner.compute_logprobs(tokens, rlens)
        ref = learner.compute_logprobs(tokens, rlens, ref=True)
        t1 = time.perf_counter()
        batch = TrainBatch(
            tokens=tokens, response_lens=rlens, advantages=torch.randn(args.batch, generator=g),
            loss_masks=[torch.ones(r) for r in rlens], old_logprobs=old, ref_logprobs=ref,
            weights=[0.8 + 0.4 * torch.rand(r, generator=g) for r in rlens],
        )
        metrics = learner.train_step(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if rank == 0:
            ntok = args.batch * (args.prompt_len + args.response_len)
            print(f"{name} step {step}: loss {metrics['train/loss']:+.5f} grad_norm {metrics['train/grad_norm']:.4f} "
                  f"recompute {t1 - t0:.3f}s train {t2 - t1:.3f}s ({ntok / (t2 - t1):.0f} tok/s)", flush=True)
    n_weights = sum(1 for _ in learner.named_weights())  # gathered export, as the weight sync would stream it
    if rank == 0:
        print(f"{name}: exported {n_weights} HF tensors", flush=True)


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--layouts: expected TPxPP such as 2x1, got {text!r}") from None
    if tp < 1 or pp < 1:
        raise SystemExit(f"--layouts: sizes must be >= 1, got {text!r}")
    return tp, pp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", default="", help="HF Qwen2/Llama directory (default: a tiny random Qwen2)")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="TxP",
                        help="TP x PP layouts to run (default: 1x1, plus 2x1 and 1x2 with >= 2 GPUs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4096, help="micro-batch budget in padded tokens")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--enable-fp32-lm-head", action="store_true", help="the output layer in fp32 (utils.lm_head)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-hidden", type=int, default=256)
    parser.add_argument("--tiny-layers", type=int, default=4)
    args = parser.parse_args(argv)

    from slime_sparse.backends.megatron.parallel import spawn

    gpus = torch.cuda.device_count()
    layouts = [parse_layout(x) for x in (args.layouts or (["1x1", "2x1", "1x2"] if gpus >= 2 else ["1x1"]))]
    hf_dir = args.hf_dir
    if not hf_dir:
        hf_dir = tempfile.mkdtemp(prefix="mcore_smoke_")
        make_tiny_qwen2(hf_dir, hidden=args.tiny_hidden, layers=args.tiny_layers, vocab=8192)
    print(f"device: {'%d GPU(s), %s' % (gpus, torch.cuda.get_device_name(0)) if gpus else 'CPU (gloo)'}; model {hf_dir}")
    for tp, pp in layouts:
        if gpus and tp * pp > gpus:
            print(f"TP={tp} PP={pp}: skipped, only {gpus} GPU(s)")
            continue
        start = time.perf_counter()
        spawn(worker, tp * pp, hf_dir, args, tp, pp)
        print(f"TP={tp} PP={pp}: done in {time.perf_counter() - start:.1f}s (including start-up)")


if __name__ == "__main__":
    main()
