"""What the embedded engine assumes about transformers, checked by running it (the SGLang plugin's contract.py reads
SGLang's source; transformers is installed wherever the engine runs, so here each assumption is exercised on a tiny
model built from a config).

The engine forks no model code. It relies on this surface of transformers' Qwen2 / Llama implementations:
- the attention function is looked up by name in `AttentionInterface` on every forward, from
  `config._attn_implementation` (a private attribute the engine flips for the length of a generate() call);
- the decoder body is `model.base_model` (Qwen2Model / LlamaModel; `get_decoder()` answers None for them in 4.56), it
  takes the cache under the keyword `cache` (transformers >= 5.x) or
  `past_key_values`, calls `cache.update(k, v, layer_idx)` once per layer with post-RoPE keys [B, Hkv, T, d], and
  passes unknown keyword arguments through to the attention function (how the cache reaches ours);
- with an attention function registered in `AttentionInterface` only (not in `AttentionMaskInterface`), a forward
  with `attention_mask=None` builds no mask (masking_utils' early exit for custom attention; ours reads its mask from
  the cache);
- RoPE takes explicit `position_ids` (the engine's logical positions: keys are never re-rotated after eviction);
- a `Cache` subclass may be built with `layers=[]` and keep its own tensors;
- the model sets `_supports_attention_backend` (`check_model`, which the engine runs on every model it is given,
  refuses models that do not, and models with other than full attention layers);
- our decode body (decode_body.py: Qwen2 / Llama modules and weights read directly, fused projections, RoPE from a
  table) computes what the model's own forward computes: `decode_body_error`, fp32, after a prefill through HF's body.

    python -m slime_sparse.rollout.embedded.contract      # the installed transformers: one line per assumption
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from .attention import NO_MASK, cache_keyword

ARCHITECTURES = ("qwen2", "llama")
PROBE_ATTENTION = "slime_sparse_contract_probe"  # registered by `check` only, when it runs


@dataclass(frozen=True)
class Finding:
    architecture: str
    assumption: str
    ok: bool
    detail: str = ""


class _RecordingCache(Cache):
    """Records what the model hands `update` and returns the new keys/values as the whole cache (a plain forward)."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.updates: list[tuple[int, tuple[int, ...]]] = []
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updates.append((layer_idx, tuple(key_states.shape)))
        self.keys[layer_idx] = key_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


_SEEN: dict[str, object] = {}


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _SEEN.update(mask=attention_mask, marker=kwargs.get("contract_marker"), query=query.shape)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(query.shape[1] // key.shape[1], 1),
        value.repeat_interleave(query.shape[1] // key.shape[1], 1), is_causal=query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2).contiguous(), None



def check_model(model: torch.nn.Module) -> None:
    """The engine relies on full attention dispatched through transformers' AttentionInterface."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} is not supported: the engine needs a transformers causal LM whose attention "
            "uses the AttentionInterface (Qwen2/Qwen2.5, Llama, ...)"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"{cfg.model_type}: layer types {other} are not supported (full attention only)")
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        if getattr(cfg, name, None) is None:
            raise ValueError(f"{cfg.model_type}: config has no {name}")


def eos_ids(model: torch.nn.Module) -> set[int]:
    """EOS ids from the generation config (what generate() stops on), else from the model config."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return set()


def tiny_model(architecture: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        architecture]
    torch.manual_seed(0)
    return model_cls(config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()


def check(architecture: str) -> list[Finding]:
    """Exercise every assumption on a tiny model of `architecture`; one Finding each."""
    model = tiny_model(architecture)
    body = model.base_model
    params = inspect.signature(body.forward).parameters
    kwarg = cache_keyword(body)
    found = [Finding(architecture, "the decoder body (base_model) takes the cache as `cache` or `past_key_values`",
                     body is not model and kwarg in params, f"{type(body).__name__}, keyword {kwarg!r}"),
             Finding(architecture, "the model supports the AttentionInterface",
                     bool(getattr(model, "_supports_attention_backend", False)))]
    cache = _RecordingCache()
    ids, n_layers = torch.tensor([[3, 5, 7, 9]]), model.config.num_hidden_layers
    previous = model.config._attn_implementation
    AttentionInterface.register(PROBE_ATTENTION, _probe_attention)  # idempotent; never at import
    model.config._attn_implementation = PROBE_ATTENTION
    _SEEN.clear()
    try:
        with torch.no_grad():
            body(input_ids=ids, position_ids=torch.arange(4)[None] + 10, attention_mask=NO_MASK, use_cache=True,
                 contract_marker="through", **{kwarg: cache})
        seen = dict(_SEEN)
        rotated = _rotated(body, kwarg)
    except Exception as err:  # any failure here is a broken assumption, reported rather than raised
        return found + [Finding(architecture, "a forward through our attention and cache, with no mask, runs", False,
                                f"{type(err).__name__}: {err}")]
    finally:
        model.config._attn_implementation = previous
    heads, head_dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    found += [
        Finding(architecture, "the attention function is looked up from config._attn_implementation per forward",
                "query" in seen),
        Finding(architecture, "unknown forward keywords reach the attention function",
                seen.get("marker") == "through"),
        Finding(architecture, "a custom attention function gets no mask built by the model",
                "mask" in seen and seen["mask"] is None),
        Finding(architecture, "cache.update(k, v, layer) once per layer with keys [B, Hkv, T, d]",
                cache.updates == [(layer, (1, heads, 4, head_dim)) for layer in range(n_layers)], str(cache.updates)),
        Finding(architecture, "RoPE follows explicit position_ids (keys arrive rotated)", rotated),
    ]
    try:
        err = decode_body_error(model)
        found.append(Finding(architecture, "our decode body equals the model's forward (fp32, 1e-5)", err <= 1e-5,
                             f"max |difference| {err:.2e}"))
    except Exception as exc:  # the body could not be built or run: a broken assumption
        found.append(Finding(architecture, "our decode body equals the model's forward (fp32, 1e-5)", False,
                             f"{type(exc).__name__}: {exc}"))
    return found


def decode_body_error(model: torch.nn.Module, prompt: tuple[int, ...] = (3, 5, 7, 9, 11),
                      tokens: tuple[int, ...] = (13, 2, 8)) -> float:
    """Max |final hidden state of our decode body - of the model's own forward| over decode steps of `tokens` after
    `prompt` (prefilled through HF's body into our cache, as the engine does). The model's parameters are fused by
    the body (decode_body.py), which changes no value."""
    from slime_sparse.kv import KVCompressConfig

    from .attention import budget_attention_installed
    from .cache import DecodeView
    from .decode_body import DecodeBody
    from .runner import ModelRunner, RunnerShape

    layers, capacity = model.config.num_hidden_layers, len(prompt) + len(tokens)
    with torch.inference_mode():
        want = model.base_model(input_ids=torch.tensor([list(prompt) + list(tokens)])).last_hidden_state[0]
        body = DecodeBody(model)
        runner = ModelRunner(model, RunnerShape(KVCompressConfig(), 1, capacity, "eager", 1), (capacity,) * layers,
                             torch.device("cpu"), lambda h: h, body)
        errors = []
        with budget_attention_installed(model):
            runner.prefill(0, [list(prompt)], [0], [[0]] * layers)
            for i, token in enumerate(tokens):
                position = torch.tensor([len(prompt) + i])
                runner.cache.begin(DecodeView(1, (capacity,) * layers, position))
                got = body(torch.tensor([token]), position, runner.cache)
                runner.cache.end_decode()
                errors.append(float((got[0] - want[len(prompt) + i]).abs().max()))
    return max(errors)


def _rotated(body, kwarg: str) -> bool:
    """The same token at two positions gives two different keys, and the same key at the same position twice."""
    keys = []
    for offset in (0, 0, 7):
        cache = _RecordingCache()
        with torch.no_grad():
            body(input_ids=torch.tensor([[3]]), position_ids=torch.tensor([[offset]]), attention_mask=NO_MASK,
                 use_cache=True, **{kwarg: cache})
        keys.append(cache.keys[0])
    return torch.equal(keys[0], keys[1]) and not torch.allclose(keys[0], keys[2])


def main() -> int:
    import transformers

    findings = [f for arch in ARCHITECTURES for f in check(arch)]
    print(f"transformers {transformers.__version__}")
    for f in findings:
        print(f"{'ok ' if f.ok else 'BROKEN'} {f.architecture:6} {f.assumption}" + (f"  [{f.detail}]" if f.detail else ""))
    return 0 if all(f.ok for f in findings) else 1


if __name__ == "__main__":
    raise SystemExit(main())
