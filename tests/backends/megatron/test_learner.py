"""The Megatron learner on 2 ranks (CPU, gloo) at TP=2 and at PP=2 against the embedded learner on the same
batch and weights.

Same Sparse-RL loss (sparsity weights, rejected tokens, KL to pi_ref, entropy bonus), so the dense
recompute, the loss, every gradient (mapped back to HF names), the gradient norm and the weights after
one AdamW step must agree. At PP=2 the micro-batches go through megatron-core's 1F1B schedule between the
two stages and the tied embedding has a copy on each stage, whose gradients must be summed. The pad token (id 0) appears as an input, so the pad-row gradient rule of HF's
embedding is exercised. save_checkpoint / load_checkpoint (collective, atomic) must restore model,
optimizer and step, and the checkpoint's model/ must be the HF export of the weights.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from slime_sparse.algo import LossConfig  # noqa: E402
from slime_sparse.backends.base import TrainBatch  # noqa: E402
from slime_sparse.backends.batching import MicroBatching  # noqa: E402
from slime_sparse.backends.optimizer import OptimConfig  # noqa: E402
from slime_sparse.backends.embedded.learner import EmbeddedLearner  # noqa: E402
from slime_sparse.backends.megatron.parallel import spawn  # noqa: E402
from slime_sparse.config import RunConfig, TrainConfig  # noqa: E402
from slime_sparse.rollout.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.megatron

TEMPERATURE = 0.8
LOSS = LossConfig(eps_clip=0.2, eps_clip_high=0.28, loss_agg_mode="seq-mean-token-mean", use_kl_loss=True,
                  kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01)
OPTIM = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98), warmup_iters=0, clip_grad=1e9)
MAX_TOKENS = 24  # several micro-batches
TOKENS = [[5, 17, 3, 9, 44, 2, 8, 61, 7], [11, 4, 90, 33, 12], [99, 0, 1, 2, 3, 4, 5], [7, 7, 8, 21, 30, 31]]
RESPONSE_LENS = [4, 2, 5, 3]
DATA_STATE = {"epoch": 0, "offset": 12}


def make_batch(logp_now: list[torch.Tensor]) -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    masks = [torch.ones(r) for r in RESPONSE_LENS]
    masks[2][1] = 0.0  # a token rejected by the sparsity correction
    masks[3].zero_()  # a whole sequence vetoed
    return TrainBatch(
        tokens=TOKENS, response_lens=RESPONSE_LENS, advantages=torch.tensor([1.0, -0.5, 0.7, 0.3]), loss_masks=masks,
        old_logprobs=[lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in logp_now],  # some ratios clip
        ref_logprobs=[lp.clone() for lp in logp_now],
        weights=[0.5 + torch.rand(lp.shape, generator=g) for lp in logp_now],
    )


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}  # (TP, PP) on 2 ranks
# TP=2 in the default set (what CI runs), PP=2 in the slow set
LAYOUT_PARAMS = [pytest.param("pp2", marks=pytest.mark.slow), "tp2"]


def _learner_worker(rank: int, world_size: int, hf_dir: str, batch: TrainBatch, ckpt_dir: str, tp: int, pp: int) -> dict:
    from slime_sparse.backends.megatron.hf_io import export_hf_weights
    from slime_sparse.backends.megatron import MegatronConfig, MegatronLearner
    from slime_sparse.backends.megatron.optimizer import clip_grad_norm_tp
    from slime_sparse.backends.megatron.model_config import read_hf_config
    from slime_sparse.backends.megatron.parallel import ParallelConfig, init_parallel
    from slime_sparse.factory import LearnerSpec, build_learner

    layout = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    init_parallel(ParallelConfig(tp, pp))

    def build():
        return MegatronLearner(read_hf_config(hf_dir), LOSS, hf_dir=hf_dir, megatron=layout,
                               optim=OptimConfig(**OPTIM), batching=MicroBatching(MAX_TOKENS), temperature=TEMPERATURE,
                               need_ref=True)

    learner = build()
    out = {
        "logp": learner.compute_logprobs(batch.tokens, batch.response_lens),
        "ref_logp": learner.compute_logprobs(batch.tokens, batch.response_lens, ref=True),
    }
    # The entry point `--train-backend megatron` uses: reads train / loss / sampling / megatron from a RunConfig.
    run_cfg = RunConfig(train=TrainConfig(hf_checkpoint=hf_dir, train_backend="megatron", lr=1e-3,
                                          max_tokens_per_gpu=MAX_TOKENS),
                        loss=LOSS, sampling=SamplingParams(temperature=TEMPERATURE), megatron=layout)
    built = build_learner(LearnerSpec.from_run(run_cfg))
    out["built"] = (built.compute_logprobs(batch.tokens, batch.response_lens), built.temperature, built.optim.lr,
                    built.ref_model is not None)
    del built
    out["metrics"] = learner.train_step(batch)
    out["grads"] = dict(export_hf_weights(learner.module, learner.spec, grads=True))
    out["weights"] = dict(learner.named_weights())
    try:  # rank 0 cannot stage it (NaN is not JSON): every rank must fail, none may wait for the others
        learner.save_checkpoint(os.path.join(ckpt_dir, "bad"), step=1, data_state={"x": float("nan")})
    except (ValueError, RuntimeError) as exc:
        out["bad_save"] = type(exc).__name__
    path = learner.save_checkpoint(os.path.join(ckpt_dir, "rollout_000007"), step=7, data_state=DATA_STATE,
                                   extra={"rollout": 7}, keep_last=2)

    restored = build()
    out["state"] = restored.load_checkpoint(path)
    out["restored_step"] = restored.step
    out["restored_weights"] = dict(restored.named_weights())
    # The same second step from the original and the restored learner (optimizer moments restored too).
    out["second"] = learner.train_step(batch)["train/loss"], restored.train_step(batch)["train/loss"]
    out["after_second"] = (dict(learner.named_weights()), dict(restored.named_weights()))

    params = list(learner.module.parameters())
    norm = clip_grad_norm_tp(params, max_norm=0.0)
    clip_grad_norm_tp(params, max_norm=0.5 * norm)
    out["norm_before_clip"] = norm
    out["clipped_grads"] = dict(export_hf_weights(learner.module, learner.spec, grads=True))
    return out


@pytest.fixture(scope="module", params=LAYOUT_PARAMS)
def setup(request, tmp_path_factory):
    tp, pp = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"mcore_learner_{request.param}")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
    hf_dir = str(root / "hf")
    model.save_pretrained(hf_dir)
    embedded = EmbeddedLearner(model, LOSS, optim=OptimConfig(**OPTIM), batching=MicroBatching(MAX_TOKENS),
                               temperature=TEMPERATURE, need_ref=True)
    logp_now = embedded.compute_logprobs(TOKENS, RESPONSE_LENS)
    batch = make_batch(logp_now)
    reference = {"logp": logp_now, "ref_logp": embedded.compute_logprobs(batch.tokens, batch.response_lens, ref=True)}
    reference["metrics"] = embedded.train_step(batch)
    reference["grads"] = {n: p.grad.clone() for n, p in embedded.model.named_parameters()}
    reference["weights"] = {n: p.detach().clone() for n, p in embedded.model.named_parameters()}
    per_rank = spawn(_learner_worker, 2, hf_dir, batch, str(root / "ckpt"), tp, pp, result_dir=str(root),
                     timeout_s=560)
    return per_rank, reference, root / "ckpt", (tp, pp)


def test_dense_recompute_matches_embedded(setup):
    per_rank, ref, _, _ = setup
    for out in per_rank:
        for key in ("logp", "ref_logp"):
            for got, want in zip(out[key], ref[key]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_build_from_run_config(setup):
    per_rank, ref, _, _ = setup
    for out in per_rank:
        logp, temperature, lr, has_ref = out["built"]
        assert (temperature, lr, has_ref) == (TEMPERATURE, 1e-3, True)
        for got, want in zip(logp, ref["logp"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_loss_and_metrics_match_embedded(setup):
    per_rank, ref, _, _ = setup
    want = ref["metrics"]
    for out in per_rank:
        got = out["metrics"]
        assert set(want) <= set(got)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert want["train/loss"] != 0.0


def test_gradients_match_embedded(setup):
    per_rank, ref, _, _ = setup
    grads = ref["grads"]
    for out in per_rank:
        for name, grad in out["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
        assert "lm_head.weight" not in out["grads"]  # tied: one embedding receives both gradients


def test_adamw_step_matches_embedded(setup):
    per_rank, ref, _, _ = setup
    for out in per_rank:
        for name, weight in out["weights"].items():
            torch.testing.assert_close(weight, ref["weights"][name], rtol=0, atol=2e-5, msg=name)


def test_checkpoint_layout_and_hf_export(setup):
    per_rank, _, ckpt_dir, (tp, pp) = setup
    assert [out["bad_save"] for out in per_rank] == ["ValueError", "RuntimeError"]
    assert sorted(os.listdir(ckpt_dir)) == ["latest", "rollout_000007"]  # no leftovers of the failed save
    assert (ckpt_dir / "latest").read_text().strip() == "rollout_000007"
    path = ckpt_dir / "rollout_000007"
    assert sorted(os.listdir(path / "optim")) == sorted(os.listdir(path / "rng")) == ["rank00000.pt", "rank00001.pt"]
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == 7 and state["data_state"] == DATA_STATE
    assert state["extra"]["megatron_layout"] == {"world_size": 2, "tensor_model_parallel_size": tp,
                                                 "pipeline_model_parallel_size": pp, "optimizer": "torch-adamw"}
    exported = load_file(str(path / "model" / "model.safetensors"))
    assert exported.keys() == per_rank[0]["weights"].keys()
    for name, w in per_rank[0]["weights"].items():  # the HF export is the learner's weights, bit for bit
        assert torch.equal(exported[name], w), name
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path / "model"))
    assert torch.equal(hf.state_dict()["model.embed_tokens.weight"], exported["model.embed_tokens.weight"])


def test_save_load_restores_model_optimizer_and_step(setup):
    per_rank, _, _, _ = setup
    for out in per_rank:
        state = out["state"]
        assert state["step"] == 7 and state["data_state"] == DATA_STATE and state["extra"]["rollout"] == 7
        assert out["restored_step"] == 1
        for name, w in out["weights"].items():
            assert torch.equal(out["restored_weights"][name], w), name
        loss_a, loss_b = out["second"]
        assert loss_a == loss_b
        after_a, after_b = out["after_second"]
        for name in after_a:
            assert torch.equal(after_a[name], after_b[name]), name


def test_tp_aware_grad_clipping(setup):
    per_rank, ref, _, _ = setup
    ref_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref["grads"].values())).item()
    for out in per_rank:
        # the norm after the *second* step's backward; just check it is the full-model norm of those grads
        full = torch.sqrt(sum(g.double().pow(2).sum() for g in out["clipped_grads"].values())).item()
        assert full == pytest.approx(0.5 * out["norm_before_clip"], rel=1e-5)
    assert per_rank[0]["metrics"]["train/grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
