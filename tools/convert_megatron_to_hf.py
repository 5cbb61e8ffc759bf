#!/usr/bin/env python
"""Convert a Megatron distributed checkpoint (written by convert_hf_to_megatron.py or the Megatron
learner) back into a Hugging Face directory (config.json, safetensors, tokenizer files).

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/qwen7b_mcore --out-dir Qwen2.5-7B-rl

The checkpoint may have been saved at any TP / PP layout; `--tp/--pp` only choose how many local CPU
processes (gloo) load it. See slime_sparse/backends/megatron/README.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    from slime_sparse.backends.megatron.convert import converter_parser, hide_gpus, megatron_to_hf

    args = converter_parser(__doc__, "--megatron-dir", "Megatron checkpoint directory", "to load with",
                            "dtype of the written weights").parse_args(argv)
    hide_gpus()
    dtype = megatron_to_hf(args.megatron_dir, args.out_dir, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"wrote HF checkpoint ({dtype}) to {args.out_dir}")


if __name__ == "__main__":
    main()
