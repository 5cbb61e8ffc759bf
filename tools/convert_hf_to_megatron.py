#!/usr/bin/env python
"""Convert a Hugging Face Qwen2 / Qwen2.5 / Llama directory into a Megatron distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out-dir ckpt/qwen7b_mcore --tp 2 --pp 1

Runs `tp * pp` local CPU processes (gloo); GPUs are not used. The checkpoint (torch_dist format) can be
loaded at another TP / PP layout; tokenizer files are kept beside it for the way back
(tools/convert_megatron_to_hf.py). See slime_sparse/backends/megatron/README.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--out-dir", required=True, help="where to write the Megatron checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size to save at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size to save at")
    parser.add_argument("--dtype", default="bfloat16", help="parameter dtype: float32, bfloat16 or float16")
    args = parser.parse_args(argv)

    from slime_sparse.backends.megatron.convert import hf_to_megatron, hide_gpus

    hide_gpus()
    hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"wrote Megatron checkpoint (TP={args.tp}, PP={args.pp}, {args.dtype}) to {args.out_dir}")


if __name__ == "__main__":
    main()
