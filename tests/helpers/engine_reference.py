"""Independent references for the embedded engine, shared by the tiny-model tests and the real-model tests.

- dense: a teacher-forced full forward of the plain HF model (its own attention, no cache);
- compressed: a full forward through a hand-written attention whose mask, per layer / head / query, is
  exactly the set of positions the engine's cache held when that query ran (logged by the engine's
  opt-in kv_trace hook).
"""
import torch
from transformers import AttentionInterface

from slime_sparse.rollout.embedded import EmbeddedEngine, KVTraceRecord


def dense_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs of `response` under the plain model, full context."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)]


# ------------------------------------------------------------------------------------------------------------
# Reference for compressed decoding: full forward, attention masked to what the cache held per query.
# ------------------------------------------------------------------------------------------------------------
_REFERENCE_MASKS: dict[int, torch.Tensor] = {}  # layer -> [Hq, T, T] bool, set by the test before a forward


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    mask = _REFERENCE_MASKS[module.layer_idx]  # [Hq, T, T]
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask[None], float("-inf"))
    out = torch.softmax(scores.float(), dim=-1).to(value.dtype) @ value
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test_masked_reference", _masked_reference_attention)


def masked_reference_logprobs(model, records: list[KVTraceRecord], prompt, response, temperature):
    """Log-probs of `response` when query q of layer l, KV head h sees exactly the held positions <= q."""
    total = len(prompt) + len(response) - 1  # the last sampled token is never run
    # held_positions: [L, Hkv, n], or one [Hkv, n_l] per layer when the layers hold different numbers of slots
    n_layers, n_kv = len(records[0].held_positions), records[0].held_positions[0].shape[0]
    group = model.config.num_attention_heads // n_kv
    masks = torch.zeros(n_layers, n_kv, total, total, dtype=torch.bool)
    covered = torch.zeros(total, dtype=torch.int)
    for rec in records:
        for q in rec.query_positions:
            covered[q] += 1
            for layer in range(n_layers):
                for h in range(n_kv):
                    held = rec.held_positions[layer][h].long()
                    masks[layer, h, q, held[held <= q]] = True
    assert covered.tolist() == [1] * total, "every position must run through the model exactly once"
    previous = model.config._attn_implementation  # switched for this forward only (no copy of a real model)
    model.config._attn_implementation = "test_masked_reference"
    _REFERENCE_MASKS.clear()
    _REFERENCE_MASKS.update({layer: masks[layer].repeat_interleave(group, dim=0) for layer in range(n_layers)})
    try:
        with torch.no_grad():
            logits = model(torch.tensor([(prompt + response)[:total]])).logits[0].float()
    finally:
        _REFERENCE_MASKS.clear()
        model.config._attn_implementation = previous
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(prompt) - 1, total), torch.tensor(response)]


def traced_engine(model, kv, **kwargs) -> tuple[EmbeddedEngine, dict[int, list[KVTraceRecord]]]:
    """An engine whose kv_trace hook files every record under its sample index."""
    records: dict[int, list[KVTraceRecord]] = {}
    engine = EmbeddedEngine(model, kv, kv_trace=lambda r: records.setdefault(r.sample_index, []).append(r), **kwargs)
    return engine, records
