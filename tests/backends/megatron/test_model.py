"""megatron-core GPTModel built from HF Qwen2 / Llama configs + our weight mapping, on CPU (gloo, 2 ranks).

Reference: the HF model itself (transformers' Qwen2/Llama forward) and the embedded backend's log-prob
function, on the same weights. One spawn of 2 processes runs TP=1 (two data-parallel replicas) and
then TP=2 for both architectures, to pay megatron-core's import once.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from slime_sparse.backends.logprobs import response_logprobs as hf_response_logprobs  # noqa: E402
from slime_sparse.backends.megatron.parallel import spawn  # noqa: E402

pytestmark = pytest.mark.megatron

TEMPERATURE = 0.7


def make_tiny_hf(path: str, arch: str, seed: int = 0) -> torch.nn.Module:
    """Tiny random Qwen2 (QKV bias, tied embeddings, rope_theta 1e6) or Llama (untied, llama3 RoPE scaling)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=256))
    else:
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope, max_position_embeddings=16384))
    with torch.no_grad():  # non-trivial norms and biases, so a layout slip cannot hide behind ones / zeros
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model.eval()


def _model_worker(rank: int, world_size: int, dirs: dict, batch: dict) -> dict:
    from megatron.core import parallel_state as ps

    from slime_sparse.backends.megatron import weight_mapping as wm
    from slime_sparse.backends.megatron.hf_io import HFWeights, export_hf_weights, load_hf_weights
    from slime_sparse.backends.megatron.logprobs import forward_logits, response_logprobs
    from slime_sparse.backends.megatron.model_config import ModelSpec, build_gpt_model
    from slime_sparse.backends.megatron.parallel import ParallelConfig, init_parallel

    out = {}
    for tp in (1, 2):
        init_parallel(ParallelConfig(tp))
        for arch, path in dirs.items():
            spec = ModelSpec.from_hf_dir(path)
            model = build_gpt_model(spec).eval()
            load_hf_weights(model, spec, HFWeights(path))
            with torch.no_grad():
                shard = forward_logits(model, batch["input_ids"])
                parts = [torch.empty_like(shard) for _ in range(tp)]
                torch.distributed.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
                logp, ent = response_logprobs(model, batch["tokens"], batch["response_lens"], vocab_size=spec.vocab_size,
                                              temperature=TEMPERATURE, with_entropy=True)
            rules = wm.rules_by_name(spec)
            out[(arch, tp)] = {
                # megatron-core's grad clipping / optimizer read this mark; it must match our mapping's kinds
                "tp_marks": {n: (bool(getattr(p, "tensor_model_parallel", False)), rules[n].kind != "replicated")
                             for n, p in model.named_parameters()},
                "logits": torch.cat(parts, dim=-1),
                "logp": logp,
                "entropy": ent,
                "export": dict(export_hf_weights(model, spec)),
            }
        out[("fp32_head", tp)] = _bf16_output_layer(dirs["llama"], batch["input_ids"])
        ps.destroy_model_parallel()
    return out


def _bf16_output_layer(path: str, input_ids: torch.Tensor) -> dict:
    """A bf16 Llama (untied head), with and without --enable-fp32-lm-head: this rank's logits, what the output layer
    saw, and the head weight's gradient of logits.sum() (every row = the sum of the hidden states it saw)."""
    from slime_sparse.backends.megatron.hf_io import HFWeights, load_hf_weights
    from slime_sparse.backends.megatron.logprobs import forward_logits
    from slime_sparse.backends.megatron.model_config import ModelSpec, build_gpt_model

    spec = ModelSpec.from_hf_dir(path)
    out = {}
    for fp32 in (False, True):
        model = build_gpt_model(spec, params_dtype=torch.bfloat16, fp32_lm_head=fp32)
        load_hf_weights(model, spec, HFWeights(path))
        seen = {}
        hook = model.output_layer.register_forward_hook(lambda m, args, res: seen.update(hidden=args[0].detach()))
        logits = forward_logits(model, input_ids)
        hook.remove()
        logits.sum().backward()
        weight = model.output_layer.weight
        out[fp32] = {"logits": logits.detach(), "hidden": seen["hidden"], "weight": weight.detach().clone(),
                     "grad": weight.grad.clone()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_model")
    dirs, refs = {}, {}
    tokens = [[5, 17, 3, 9, 44, 2, 8, 61, 7], [11, 4, 90, 33, 12], [99, 0, 1, 2, 3, 4, 5]]
    response_lens = [4, 2, 5]
    input_ids = torch.tensor([[5, 17, 3, 9, 44, 2, 8, 61], [11, 4, 90, 33, 12, 6, 7, 8]])
    for arch in ("qwen2", "llama"):
        dirs[arch] = str(root / arch)
        hf = make_tiny_hf(dirs[arch], arch)
        with torch.no_grad():
            logp, ent = hf_response_logprobs(hf, tokens, response_lens, temperature=TEMPERATURE, with_entropy=True)
            refs[arch] = {"logits": hf(input_ids).logits, "logp": logp, "entropy": ent,
                          "state": {k: v.clone() for k, v in hf.state_dict().items()}, "tied": hf.config.tie_word_embeddings}
    batch = {"input_ids": input_ids, "tokens": tokens, "response_lens": response_lens}
    per_rank = spawn(_model_worker, 2, dirs, batch, result_dir=str(root), timeout_s=540)
    return per_rank, refs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_hf(results, arch, tp):
    per_rank, refs = results
    ref = refs[arch]["logits"]
    for rank_out in per_rank:
        logits = rank_out[(arch, tp)]["logits"]
        assert logits.shape[-1] >= 128  # padded vocabulary
        torch.testing.assert_close(logits[..., :100], ref, rtol=0, atol=1e-5)
        assert torch.count_nonzero(logits[..., 100:]) == 0  # zero rows of the padded output layer


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_logprobs_and_entropy_match_hf(results, arch, tp):
    per_rank, refs = results
    for rank_out in per_rank:
        got = rank_out[(arch, tp)]
        torch.testing.assert_close(got["logp"], refs[arch]["logp"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["entropy"], refs[arch]["entropy"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_export_round_trip_is_exact(results, arch, tp):
    per_rank, refs = results
    expected = dict(refs[arch]["state"])
    if refs[arch]["tied"]:
        expected.pop("lm_head.weight")  # tied: HF saves only the embedding
    for rank_out in per_rank:
        exported = rank_out[(arch, tp)]["export"]
        assert set(exported) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), name


def test_tensor_parallel_marks_match_mapping(results):
    per_rank, _ = results
    for rank_out in per_rank:
        for key, result in rank_out.items():
            if key[0] == "fp32_head":
                continue
            for name, (marked, sharded) in result["tp_marks"].items():
                assert marked == sharded, (key, name)


def test_tp2_ranks_agree(results):
    per_rank, _ = results
    for key in per_rank[0]:
        if key[0] != "fp32_head":
            assert torch.equal(per_rank[0][key]["logp"], per_rank[1][key]["logp"]), key



@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_lm_head_makes_the_output_layer_an_fp32_gemm(results, tp):
    """--enable-fp32-lm-head in the Megatron learner: the vocab-parallel output layer of a bf16 model computes
    hidden.float() @ W.float()^T (utils.lm_head.lm_head_logits), not bf16 logits; its weight still gets a bf16
    gradient through the cast (every row of d logits.sum() / dW is the sum of the hidden states)."""
    per_rank, _ = results
    for rank_out in per_rank:
        got = rank_out[("fp32_head", tp)]
        for fp32, res in got.items():
            exact = torch.einsum("sbh,vh->bsv", res["hidden"].float(), res["weight"].float())
            logits = res["logits"]
            assert logits.shape == exact.shape
            if fp32:
                assert logits.dtype == torch.float32
                torch.testing.assert_close(logits, exact, rtol=1e-6, atol=1e-6)
                real = res["weight"].abs().sum(1) > 0  # at TP=2 rank 1 holds only padded vocabulary rows (zeros)
                if real.any():
                    assert not torch.equal(logits[..., real], logits[..., real].bfloat16().float())  # not bf16-rounded
            else:  # Megatron's own bf16 GEMM (the learner casts to fp32 before its log-softmax)
                assert logits.dtype == torch.bfloat16
                torch.testing.assert_close(logits.float(), exact, rtol=1e-2, atol=1e-2)
            grad = res["grad"]
            assert grad.dtype == torch.bfloat16
            row = res["hidden"].float().sum((0, 1))
            torch.testing.assert_close(grad.float(), row.expand_as(grad), rtol=2e-2, atol=1e-2)
