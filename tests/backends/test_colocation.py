"""What lets a step share one GPU: activation recompute (Megatron's flags, both learners), the engine giving back
its memory while the learner works (--offload-rollout), and the weight update in place."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.algo import LossConfig
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.backends.recompute import Recompute
from slime_sparse.config_loader import load_config
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.offload import OffloadingEngine
from slime_sparse.rollout.sampling import SamplingParams


def test_recompute_flags_resolve_like_megatrons(base_args):
    cfg = load_config(base_args + ["--recompute-granularity", "full"]).train
    assert Recompute.from_flags(cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == \
        Recompute("full", "uniform", 1)
    mega = load_config(base_args + ["--train-backend", "megatron", "--recompute-granularity", "full",
                                    "--recompute-method", "block", "--recompute-num-layers", "3"]).train
    assert Recompute.from_flags(mega.recompute_granularity, mega.recompute_method, mega.recompute_num_layers
                                ).megatron_kwargs() == {"recompute_granularity": "full", "recompute_method": "block",
                                                        "recompute_num_layers": 3}
    # Megatron-LM's --recompute-activations is its selective recompute
    assert load_config(base_args + ["--train-backend", "megatron", "--recompute-activations"]
                       ).train.recompute_granularity == "selective"


@pytest.mark.parametrize("extra,message", [
    (["--recompute-granularity", "selective"], "selective is Megatron's"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"], "every decoder layer on its own"),
    (["--recompute-method", "block"], "need --recompute-granularity full"),
    (["--recompute-granularity", "partial"], "--recompute-granularity='partial' is invalid"),
    (["--train-backend", "megatron", "--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "go with --recompute-granularity full"),
    (["--recompute-granularity", "full", "--loss-type", "shadow"], "without the samples' eviction masks"),
])
def test_bad_recompute_settings_name_the_flag(base_args, extra, message):
    with pytest.raises(ValueError, match=message):
        load_config(base_args + extra)


def test_offload_rollout_defaults_on_where_engine_and_learner_share_devices(base_args):
    assert load_config(base_args).offloads_rollout  # the embedded engine in this process: the learner's device
    assert not load_config(base_args + ["--use-ray"]).offloads_rollout  # engines on their own GPUs
    assert load_config(base_args + ["--use-ray", "--colocate"]).offloads_rollout  # slime: --colocate turns it on
    assert not load_config(base_args + ["--no-offload-rollout"]).offloads_rollout
    # SGLang servers of their own in this process: not colocated; offloading them needs SGLang's memory saver
    assert not load_config(base_args + ["--rollout-engine", "sglang"]).offloads_rollout
    with pytest.raises(ValueError, match="--sglang-enable-memory-saver"):
        load_config(base_args + ["--rollout-engine", "sglang", "--offload-rollout"])


class _Engine:
    """An engine that records the order of the calls that matter here."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.weight_version = 3

    def generate(self, prompts, params, seed=None, index_offset=0, *, kv=None):  # the RolloutEngine protocol
        self.calls.append(f"generate kv={kv}")
        return ["out"] * len(prompts)

    def release_memory(self):
        self.calls.append("release")

    def resume_memory(self):
        self.calls.append("resume")

    def with_kv(self, kv):
        self.calls.append("with_kv")

    def sync_from(self, learner):
        self.calls.append("sync")


def test_offloading_engine_holds_memory_only_while_generating():
    inner = _Engine()
    engine = OffloadingEngine(inner)
    assert inner.calls == ["release"]  # what it allocated when built goes back at once
    assert engine.generate([[1], [2]], SamplingParams(), seed=1) == ["out", "out"]
    engine.sync_from(object())  # weights stay resident: no resume for an update
    engine.with_kv("dense").generate([[1]], SamplingParams(), seed=2)  # evaluation goes through it too
    assert inner.calls == ["release", "resume", "generate kv=None", "release", "sync", "with_kv", "resume",
                           "generate kv=dense", "release"]
    assert engine.weight_version == 3


def test_weight_update_copies_the_learners_tensors_in_place():
    """The embedded learner hands the engine its own tensors (no copy), and the engine copies them into its
    weights in place: no second full copy of the model exists at any time of the update."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    learner = EmbeddedLearner(Qwen2ForCausalLM(cfg), LossConfig(), optim=OptimConfig())
    engine_model = Qwen2ForCausalLM(cfg).eval()
    engine = EmbeddedEngine(engine_model, KVCompressConfig(), max_batch_size=2)
    before = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
    params = {p.data_ptr() for p in learner.model.parameters()}
    assert all(t.data_ptr() in params for _, t in learner.named_weights())  # views of the parameters themselves
    engine.sync_from(learner)
    assert {n: p.data_ptr() for n, p in engine_model.named_parameters()} == before  # written in place
    for (name, mine), theirs in zip(learner.model.named_parameters(), engine_model.parameters()):
        assert torch.equal(mine, theirs), name


@pytest.mark.megatron
def test_megatron_recompute_leaves_the_update_unchanged(tmp_path, monkeypatch):
    """Megatron's own recompute (full uniform / block, selective) through the learner, on CPU: the same step as
    without (bit for bit here), and recompute really ran (its checkpoint saved the generator states)."""
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel import random as mrandom

    from slime_sparse.backends.base import TrainBatch
    from slime_sparse.backends.batching import MicroBatching
    from slime_sparse.backends.megatron import MegatronConfig
    from slime_sparse.backends.megatron.learner import build_megatron_learner

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=128)).save_pretrained(tmp_path)
    lens = (20, 30, 16, 24)
    tokens = [torch.randint(0, 100, (n + 10,)).tolist() for n in lens]
    batch = TrainBatch(tokens=tokens, response_lens=list(lens), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       loss_masks=[torch.ones(n) for n in lens], old_logprobs=[torch.full((n,), -4.6) for n in lens])
    saved_states = []
    original = mrandom._get_all_rng_states
    monkeypatch.setattr(mrandom, "_get_all_rng_states", lambda: saved_states.append(1) or original())
    results = {}
    for recompute in (None, Recompute("full"), Recompute("full", "block", 1), Recompute("selective")):
        saved_states.clear()
        learner = build_megatron_learner(str(tmp_path), LossConfig(), MegatronConfig(), OptimConfig(lr=1e-3),
                                         batching=MicroBatching(64), recompute=recompute)
        try:
            metrics = learner.train_step(batch.as_step())
            results[recompute] = ({n: w.clone() for n, w in learner.named_weights()}, metrics["train/grad_norm"])
        finally:
            learner.close()
        assert bool(saved_states) == (recompute is not None), recompute
    plain, norm = results.pop(None)
    for recompute, (weights, grad_norm) in results.items():
        assert grad_norm == norm, recompute
        for name in plain:
            torch.testing.assert_close(weights[name], plain[name], rtol=0, atol=0, msg=f"{recompute} {name}")
