#!/usr/bin/env python
"""Convert a Megatron distributed checkpoint (written by convert_hf_to_megatron.py or the Megatron
learner) back into a Hugging Face directory (config.json, safetensors, tokenizer files).

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/qwen7b_mcore --out-dir Qwen2.5-7B-rl

The checkpoint may have been saved at any TP / PP layout; `--tp/--pp` only choose how many local CPU
processes (gloo) load it. See slime_sparse/backends/megatron/README.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-dir", required=True, help="Megatron checkpoint directory")
    parser.add_argument("--out-dir", required=True, help="where to write the HF directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size to load with")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size to load with")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the written weights: float32, bfloat16 or float16")
    args = parser.parse_args(argv)

    from slime_sparse.backends.megatron.convert import hide_gpus, megatron_to_hf

    hide_gpus()
    megatron_to_hf(args.megatron_dir, args.out_dir, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"wrote HF checkpoint ({args.dtype}) to {args.out_dir}")


if __name__ == "__main__":
    main()
