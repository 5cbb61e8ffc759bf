"""The Megatron learner's shadow forward (CPU, gloo, TP=2: each rank holds one KV head of a per-head record)
against the sampler's log-probs and the embedded learner's --loss-type shadow step on the same rollout."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from slime_sparse.algo import CorrectionConfig, LossConfig  # noqa: E402
from slime_sparse.backends.batching import MicroBatching  # noqa: E402
from slime_sparse.backends.embedded.learner import EmbeddedLearner  # noqa: E402
from slime_sparse.backends.megatron.parallel import spawn  # noqa: E402
from slime_sparse.backends.optimizer import OptimConfig  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout.pipeline import prepare_rollout  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402
from slime_sparse.types import Sample  # noqa: E402
from slime_sparse.rollout.base_types import RolloutPlan  # noqa: E402

pytestmark = pytest.mark.megatron

TEMPERATURE = 0.8
LOSS = LossConfig(loss_type="shadow", eps_clip=0.2)
OPTIM = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.98), clip_grad=0.0)
MAX_TOKENS = 60  # several micro-batches
PROMPTS = [[5, 17, 3, 9, 44, 2], [11, 4, 90], [99, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]


def _worker(rank: int, world_size: int, hf_dir: str, batch, records) -> dict:
    from slime_sparse.backends.megatron import MegatronConfig, MegatronLearner
    from slime_sparse.backends.megatron.hf_io import export_hf_weights
    from slime_sparse.backends.megatron.model_config import read_hf_config
    from slime_sparse.backends.megatron.parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(2, 1))
    learner = MegatronLearner(read_hf_config(hf_dir), LOSS, hf_dir=hf_dir, megatron=MegatronConfig(2, 1),
                              optim=OptimConfig(**OPTIM), batching=MicroBatching(MAX_TOKENS), temperature=TEMPERATURE)
    out = {"shadow": learner.compute_logprobs(batch.tokens, batch.response_lens, shadow=records),
           "dense": learner.compute_logprobs(batch.tokens, batch.response_lens)}
    out["metrics"] = learner.train_step(batch)
    out["grads"] = dict(export_hf_weights(learner.module, learner.spec, grads=True))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_shadow")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    hf_dir = str(root / "hf")
    model.save_pretrained(hf_dir)
    engine = EmbeddedEngine(model, KVCompressConfig(method="rkv", budget=8, buffer=4, window=2, kernel_size=3))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=TEMPERATURE, max_new_tokens=16, ignore_eos=True), seed=5)
    samples = [Sample(prompt_index=0, prompt_ids=o.prompt_ids, response_ids=o.response_ids, rollout_logprobs=o.logprobs,
                      finish_reason=o.finish_reason, reward=r, kv=o.kv, evictions=o.evictions)
               for o, r in zip(outs, [1.0, 0.0, 0.5])]
    embedded = EmbeddedLearner(model, LOSS, optim=OptimConfig(**OPTIM), batching=MicroBatching(MAX_TOKENS),
                               temperature=TEMPERATURE)
    batch = prepare_rollout(samples, embedded, CorrectionConfig(), plan=RolloutPlan(trains_shadow=True)).batch
    reference = {"sampler": [torch.tensor(o.logprobs) for o in outs], "metrics": embedded.train_step(batch),
                 "grads": {n: p.grad.clone() for n, p in embedded.model.named_parameters()}}
    per_rank = spawn(_worker, 2, hf_dir, batch, [o.evictions for o in outs], result_dir=str(root), timeout_s=560)
    return per_rank, reference


def test_megatron_shadow_recompute_equals_sampler(setup):
    per_rank, ref = setup
    for out in per_rank:
        for shadow, dense, sampler in zip(out["shadow"], out["dense"], ref["sampler"]):
            torch.testing.assert_close(shadow, sampler, rtol=0, atol=1e-5)
            assert (dense - sampler).abs().max() > 1e-3  # the records do matter


def test_megatron_shadow_step_matches_embedded(setup):
    per_rank, ref = setup
    for out in per_rank:
        assert out["metrics"]["train/loss"] == pytest.approx(ref["metrics"]["train/loss"], rel=1e-4, abs=1e-7)
        for name, grad in out["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
