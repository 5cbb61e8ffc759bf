"""A synthetic task for timing whole RL steps (benchmarks/rl_step_bench.py): prompts of a fixed length, answers
that always run to the response budget (the benchmark ignores EOS and sets no stop token), and a reward that costs
nothing, so a step's time is the framework's and not a grader's.

The reward is the parity of a checksum of the decoded answer: a deterministic coin, so about half of every group of
samples is rewarded and GRPO's advantages are not all zero (the learner's work does not depend on them anyway).
"""
from __future__ import annotations

import random
import string
import zlib
from pathlib import Path

from slime_sparse.tasks.repeated_add import write_jsonl

ALPHABET = string.ascii_lowercase + string.digits  # characters the character tokenizer knows (tasks/tokenizer.py)


def write_prompts(path: str | Path, n_prompts: int, prompt_len: int, seed: int = 0) -> Path:
    """`n_prompts` distinct random prompts of `prompt_len` tokens under the character tokenizer (which prepends
    <s>: `prompt_len` - 1 characters), one jsonl row each ({"prompt", "label"})."""
    if n_prompts < 1 or prompt_len < 2:
        raise ValueError(f"need n_prompts >= 1 and prompt_len >= 2, got {n_prompts}, {prompt_len}")
    rng = random.Random(seed)
    rows = [{"prompt": "".join(rng.choice(ALPHABET) for _ in range(prompt_len - 1)), "label": str(i)}
            for i in range(n_prompts)]
    return write_jsonl(path, rows)


def reward(response: str, label, finish_reason: str = "length", **_) -> float:
    """1.0 or 0.0 by the parity of the answer's CRC-32 (a few microseconds per answer)."""
    return float(zlib.crc32(response.encode("utf-8", "replace")) & 1)
