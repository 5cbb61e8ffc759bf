"""Quick batched sampling and scoring for the task assets (warm start checks, sizing experiments).

Not the rollout engine: a plain HF forward with a KV cache and an explicit 4D attention mask.
The mask can restrict every generated token to the first `n_sink` tokens + the last `window`
tokens (StreamingLLM's cache, with a dense prefill), or to the whole prompt + the last `window`
tokens (an oracle that keeps exactly the prompt). Comparing the two shows whether a task depends
on far-back context and how much a good KV selection can recover under a small budget.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from slime_sparse.tasks.repeated_add import task_reward


@dataclass
class Generation:
    text: str  # decoded response, special tokens removed
    token_ids: list[int]  # response ids, the final EOS included when it was sampled
    finish_reason: str  # "stop" (EOS) or "length"


def sink_window_mask(valid: torch.Tensor, n_sink: int | torch.Tensor, window: int | None) -> torch.Tensor:
    """Which cache slots the newest token may attend to, shape (batch, slots).

    valid: (batch, slots) bool, False on left padding; the newest token occupies the last slot.
    The first `n_sink` real tokens (an int, or a (batch,) tensor of per-row counts) and the last
    `window` slots (the newest token included) stay visible.
    """
    if window is None:
        return valid
    rank = valid.long().cumsum(dim=1) - 1  # index of each real token within its sequence
    slots = valid.size(1)
    recent = torch.arange(slots, device=valid.device) >= slots - window
    n_sink = torch.as_tensor(n_sink, device=valid.device).reshape(-1, 1)
    return valid & ((rank < n_sink) | recent)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (batch, q, k) mask -> additive (batch, 1, q, k) float mask for any attention kernel."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    window: int | None = None,
    n_sink: int = 2,
    batch_size: int = 64,
    keep_prompt: bool = False,
) -> list[Generation]:
    """Sample a response per prompt (temperature 0 = greedy); the prompt is prefilled densely.

    window: None for full attention, else decode attends to `n_sink` first tokens + the last
    `window` tokens; with keep_prompt, to the whole prompt (<s> included) + the last `window`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 or None")
    generator = torch.Generator().manual_seed(seed)
    out: list[Generation] = []
    for start in range(0, len(prompts), batch_size):
        out.extend(
            _generate_batch(
                model, tokenizer, prompts[start : start + batch_size], max_new_tokens,
                temperature, generator, window, n_sink, keep_prompt,
            )
        )
    return out


def _generate_batch(model, tokenizer, prompts, max_new_tokens, temperature, generator, window, n_sink, keep_prompt):
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    encoded = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    if keep_prompt:
        n_sink = torch.tensor([len(e) for e in encoded])
    batch, width = len(encoded), max(len(e) for e in encoded)
    input_ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
    valid = torch.zeros((batch, width), dtype=torch.bool)
    for i, ids in enumerate(encoded):  # left padding: every prompt ends at the same slot
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        valid[i, width - len(ids) :] = True
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    input_ids, valid, positions = input_ids.to(device), valid.to(device), positions.to(device)

    # Dense causal prefill over real tokens; padded rows see themselves only (avoids all -inf rows).
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=device))
    allowed = causal[None] & valid[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool, device=device)[None]
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=input_ids, attention_mask=_additive(allowed, dtype), position_ids=positions,
        past_key_values=cache, use_cache=True,
    ).logits[:, -1]

    next_pos = positions[:, -1] + 1
    responses: list[list[int]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool)
    for _ in range(max_new_tokens):
        if temperature == 0:
            token = logits.argmax(dim=-1).cpu()
        else:  # sample on the CPU so one seeded generator serves every device
            probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        for i in range(batch):
            if not done[i]:
                responses[i].append(int(token[i]))
        done |= token == tokenizer.eos_token_id
        if bool(done.all()):
            break
        valid = torch.cat([valid, torch.ones((batch, 1), dtype=torch.bool, device=device)], dim=1)
        allowed = sink_window_mask(valid, n_sink, window)[:, None, :]
        logits = model(
            input_ids=token[:, None].to(device), attention_mask=_additive(allowed, dtype),
            position_ids=next_pos[:, None],
            past_key_values=cache, use_cache=True,
        ).logits[:, -1]
        next_pos = next_pos + 1

    return [
        Generation(
            text=tokenizer.decode(ids, skip_special_tokens=True),
            token_ids=ids,
            finish_reason="stop" if ids and ids[-1] == tokenizer.eos_token_id else "length",
        )
        for ids in responses
    ]


@dataclass
class EvalResult:
    accuracy: float  # mean task reward
    n: int
    truncated: float  # fraction that hit max_new_tokens
    mean_response_tokens: float  # EOS included
    min_response_tokens: int
    max_response_tokens: int


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    window: int | None = None,
    n_sink: int = 2,
    batch_size: int = 64,
    keep_prompt: bool = False,
    reward_fn: Callable[..., float] = task_reward,
) -> EvalResult:
    """Mean reward of sampled responses on rows with "prompt" and "label" (arguments as in `generate`)."""
    if not rows:
        raise ValueError("rows is empty")
    gens = generate(
        model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, temperature, seed, window, n_sink,
        batch_size, keep_prompt,
    )
    rewards = [reward_fn(g.text, r["label"], finish_reason=g.finish_reason) for g, r in zip(gens, rows)]
    lengths = [len(g.token_ids) for g in gens]
    return EvalResult(
        accuracy=sum(rewards) / len(rewards),
        n=len(rows),
        truncated=sum(g.finish_reason == "length" for g in gens) / len(gens),
        mean_response_tokens=statistics.fmean(lengths),
        min_response_tokens=min(lengths),
        max_response_tokens=max(lengths),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Budget-sensitivity table: accuracy with full attention, with sinks + window, with prompt + window."""
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_sparse.tasks.repeated_add import read_jsonl

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model_dir", help="HF model directory (with its tokenizer)")
    parser.add_argument("data", help="jsonl with 'prompt' and 'label'")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    parser.add_argument("--windows", default="16,32", help="comma-separated recent-window sizes")
    parser.add_argument("--n-sink", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rows = read_jsonl(args.data)[: args.num_samples]
    modes: list[tuple[str, dict]] = [("full", {})]
    for w in (int(x) for x in args.windows.split(",") if x):
        modes.append((f"{args.n_sink} sinks + last {w}", {"window": w, "n_sink": args.n_sink}))
        modes.append((f"prompt + last {w}", {"window": w, "keep_prompt": True}))
    print(f"{'attention':<22} {'temp':>4} {'accuracy':>8} {'truncated':>9} {'len mean/min/max':>18}")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for name, kwargs in modes:
            r = evaluate(model, tokenizer, rows, args.max_new_tokens, temperature, args.seed, **kwargs)
            lengths = f"{r.mean_response_tokens:.1f}/{r.min_response_tokens}/{r.max_response_tokens}"
            print(f"{name:<22} {temperature:>4g} {r.accuracy:>8.3f} {r.truncated:>9.3f} {lengths:>18}")


if __name__ == "__main__":
    main()
