#!/usr/bin/env python
"""Convert a Hugging Face Qwen2 / Qwen2.5 / Llama directory into a Megatron distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out-dir ckpt/qwen7b_mcore --tp 2 --pp 1

Runs `tp * pp` local CPU processes (gloo); GPUs are not used. The checkpoint (torch_dist format) can be
loaded at another TP / PP layout; tokenizer files are kept beside it for the way back
(tools/convert_megatron_to_hf.py). See slime_sparse/backends/megatron/README.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    from slime_sparse.backends.megatron.convert import converter_parser, hf_to_megatron, hide_gpus

    args = converter_parser(__doc__, "--hf-dir", "HF model directory (config.json + safetensors)", "to save at",
                            "parameter dtype").parse_args(argv)
    hide_gpus()
    dtype = hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"wrote Megatron checkpoint (TP={args.tp}, PP={args.pp}, {dtype}) to {args.out_dir}")


if __name__ == "__main__":
    main()
