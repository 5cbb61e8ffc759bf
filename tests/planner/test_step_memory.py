"""The memory planner's learner side (planner/step_memory.py) and its model names (planner/known_models.py), against
independent references: transformers building each named model on the meta device, and torch's own memory tracker
(torch.distributed._tools.mem_tracker) following every tensor a real learner micro-batch allocates on CPU."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.algo import LossConfig
from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.logprobs import response_logprobs
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.backends.recompute import Recompute, checkpoint_hf_layers
from slime_sparse.planner.known_models import KNOWN_MODELS, known_config
from slime_sparse.planner.memory import GIB
from slime_sparse.planner.step_memory import (MicroBatch, StepSpec, largest_micro_batch, phase_peaks, plan_step,
                                              recompute_activation_bytes, train_activation_bytes)
from slime_sparse.rollout.sglang.config import SGLangEngineConfig
from slime_sparse.utils.model_shape import ModelShape

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plan_memory.py"


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_every_known_model_has_transformers_parameter_count(name):
    fields = dict(KNOWN_MODELS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_hf_config(KNOWN_MODELS[name]).num_parameters() == model.num_parameters()


def test_names_match_without_organisation_case_or_suffix():
    assert known_config("Qwen/Qwen2.5-7B-Instruct") == known_config("qwen2.5-7b") == KNOWN_MODELS["Qwen2.5-7B"]
    assert known_config("meta-llama/Meta-Llama-3-8B-Instruct") == KNOWN_MODELS["Llama-3.1-8B"]
    assert known_config("Qwen3-8B-Base")["model_type"] == "qwen3"
    assert known_config("Qwen2.5-8B") is None and known_config("gpt2") is None


# ---------------------------------------------------------------- activations against torch's memory tracker

def _tracked_peak(model: torch.nn.Module, fn) -> int:
    """Peak bytes of everything but the model's parameters and buffers while `fn` runs."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        fn()
    snap = {str(k).rsplit(".", 1)[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    return snap["Total"] - snap["PARAM"] - snap["BUFFER"]


def _model(dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).to(dtype).train()


@pytest.mark.parametrize("dtype,padded", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "fp32-padded"])
@pytest.mark.parametrize("recompute", [None, "full"])
def test_training_micro_batch_activations_match_the_tracker(dtype, padded, recompute):
    """A learner micro-batch (the embedded learner's forward, the LM head on response positions, backward) as the
    planner counts it, within 5 % of what torch tracks. The gradients of a first backward are allocated beforehand,
    as in every micro-batch but a step's first, so the tracked peak is activations alone."""
    model = _model(dtype)
    checkpoint_hf_layers(model, Recompute.from_flags(recompute, None, None))
    prompt, response, rows = 32, 96, 4
    lengths = [prompt + response - (8 * i if padded else 0) for i in range(rows)]
    tokens = [torch.randint(0, 4096, (n,)).tolist() for n in lengths]

    def step():
        logp, _ = response_logprobs(model, tokens, [n - prompt for n in lengths])
        logp.sum().backward()

    step()
    measured = _tracked_peak(model, step)
    mb = MicroBatch(rows * max(lengths), rows * response, max(lengths), padded=padded)
    planned = train_activation_bytes(ModelShape.from_hf_config(model.config.to_dict()), mb,
                                     dtype_bytes=dtype.itemsize, recompute=recompute)
    assert planned == pytest.approx(measured, rel=0.05)


def test_recompute_micro_batch_matches_the_tracker():
    model = _model(torch.bfloat16).eval()
    tokens = torch.randint(0, 4096, (4, 128)).tolist()
    with torch.no_grad():
        measured = _tracked_peak(model, lambda: response_logprobs(model, tokens, [96] * 4))
    planned = recompute_activation_bytes(ModelShape.from_hf_config(model.config.to_dict()),
                                         MicroBatch(512, 384, 128, padded=False), dtype_bytes=2)
    assert planned == pytest.approx(measured, rel=0.05)


def test_block_recompute_keeps_what_the_layers_it_skips_keep():
    """--recompute-method block over the first 2 of 4 layers: between none and full, as many layers as it skips."""
    tokens = torch.randint(0, 4096, (4, 128)).tolist()
    peaks = {}
    for name, recompute in (("none", None), ("block", Recompute("full", "block", 2)), ("full", Recompute("full"))):
        model = _model(torch.bfloat16)
        checkpoint_hf_layers(model, recompute)

        def step():
            response_logprobs(model, tokens, [96] * 4)[0].sum().backward()

        step()
        peaks[name] = _tracked_peak(model, step)
    assert peaks["full"] < peaks["block"] < peaks["none"]


def test_recompute_leaves_the_learners_update_unchanged():
    """The embedded learner under --recompute-granularity full takes the same optimizer step (checkpointing only
    recomputes what backward reads)."""
    torch.manual_seed(1)
    tokens = [torch.randint(0, 4096, (n,)).tolist() for n in (40, 48, 36, 48)]
    batch = TrainBatch(tokens=tokens, response_lens=[20, 30, 16, 24], advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       loss_masks=[torch.ones(n) for n in (20, 30, 16, 24)],
                       old_logprobs=[torch.full((n,), -8.0) for n in (20, 30, 16, 24)])
    weights = []
    for recompute in (None, Recompute("full")):
        learner = EmbeddedLearner(_model(torch.float32), LossConfig(), optim=OptimConfig(lr=1e-3),
                                  batching=MicroBatching(max_tokens=100), recompute=recompute)
        metrics = learner.train_step(batch.as_step())
        weights.append(({n: p.detach().clone() for n, p in learner.model.named_parameters()}, metrics))
    (plain, m_plain), (ckpt, m_ckpt) = weights
    assert m_plain["train/grad_norm"] == pytest.approx(m_ckpt["train/grad_norm"], rel=1e-5)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------- the step plan

def _step(**kw) -> StepSpec:
    base = dict(seqs=256, prompt_len=128, response_len=2048, engine_rows=256, kv_slots=640, kv_window=8,
                max_tokens_per_gpu=16384, recompute="full")
    return StepSpec(**{**base, **kw})


def test_step_plan_by_hand():
    """Qwen2.5-1.5B, the issue's 256 x (128 + 2048) step, bf16, embedded: the rollout phase holds both weight
    copies, the optimizer, gradients and the KV cache; the learner phases no KV under --offload-rollout."""
    shape = ModelShape.from_hf_config(known_config("Qwen2.5-1.5B"))
    p = shape.num_parameters()
    plan = plan_step(shape, _step())
    held = {"engine weights": 2 * p, "learner weights": 2 * p, "optimizer": 4 * p, "gradients": 2 * p}
    # per row: slots x layers x KV heads x (K, V in bf16 + an int32 position) + the query ring + fills and state
    row = 640 * 28 * 2 * (2 * 128 * 2 + 4) + 28 * 8 * 12 * 128 * 2 + 28 * 8 + 3 * 8 + 4 * 8 + 8 * (8 + 4)
    kv = 256 * row + 8 * 640 + 5 * 8 * 28  # + the engine's slot index and per-layer constants
    assert {k: plan["rollout"][k] for k in held} == held and plan["rollout"]["KV cache and row state"] == kv
    assert "KV cache (kept)" not in plan["train"]
    kept = plan_step(shape, _step(offload_rollout=False))
    assert phase_peaks(kept)["train"] == phase_peaks(plan)["train"] + kv
    peaks = phase_peaks(plan)
    assert peaks["train"] < 80 * GIB < phase_peaks(plan_step(shape, _step(recompute=None)))["train"]


def test_largest_micro_batch_is_the_boundary():
    shape = ModelShape.from_hf_config(known_config("Qwen2.5-1.5B"))
    step, seq = _step(), 128 + 2048
    largest = largest_micro_batch(shape, step, 40 * GIB)
    assert largest is not None and largest % seq == 0

    def learner_peak(tokens: int) -> int:
        peaks = phase_peaks(plan_step(shape, _step(max_tokens_per_gpu=tokens)))
        return max(peaks["recompute"], peaks["train"])

    assert learner_peak(largest) <= 40 * GIB < learner_peak(largest + seq)
    assert largest_micro_batch(shape, step, 4 * GIB) is None  # not even the weights fit


def _tool():
    spec = importlib.util.spec_from_file_location("plan_memory", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_cli_plans_a_named_model_with_the_trainers_defaults(capsys):
    """The README's command: a model by name (no config.json), the trainer's memory fraction, the colocated step
    with and without recompute."""
    tool = _tool()
    assert tool.main(["--hf-config", "Qwen2.5-7B", "--prompt-len", "512", "--max-new-tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "7.62B parameters" in out and f"80 GiB x {SGLangEngineConfig.mem_fraction_static}" in out
    for row in ("rollout", "recompute", "train", "weight update", "largest micro-batch"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert "dense/none" in out and "rkv/full" in out
    with pytest.raises(SystemExit, match="neither a known model"):
        tool.main(["--hf-config", "Qwen9-1B", "--prompt-len", "8"])
