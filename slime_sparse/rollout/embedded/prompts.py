"""What `EmbeddedEngine.generate` accepts as prompts: token ids inside the vocabulary, at least one token, and room
for one response token in the model's context (else, by the engine's policy, an error naming the prompt or a
"skipped" output)."""
from __future__ import annotations

from slime_sparse.types import GenerationOutput, KVStats

LONG_PROMPT_POLICIES = ("error", "skip")


def check_prompts(prompts: list[list[int]], outputs: list[GenerationOutput | None], *, vocab: int, context: int,
                  max_prompt_len: int | None, on_long_prompt: str, weight_version: int) -> list[int]:
    """Indices of the prompts to generate for; a skipped one (too long, on_long_prompt "skip") gets its output here."""
    accepted = []
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = [int(t) for t in prompt if not 0 <= t < vocab]
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        limit = min(context - 1, max_prompt_len or context)  # leave room for one response token
        if len(prompt) <= limit:
            accepted.append(i)
        elif on_long_prompt == "error":
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens, over the limit of {limit} "
                f"(max_prompt_len={max_prompt_len}, model context max_position_embeddings={context} "
                f"minus one response token); construct the engine with on_long_prompt='skip' to skip it"
            )
        else:
            outputs[i] = GenerationOutput(prompt_ids=list(prompt), response_ids=[], logprobs=[],
                                          finish_reason="skipped", kv=KVStats(), weight_version=weight_version)
    return accepted
