"""The mismatch split on a tiny model with the embedded engine and learner: log xi = [log pi_old - log pi_shadow] +
[log pi_shadow - log pi_sparse] per token; in fp32 on CPU the numeric part is ~0 and the sparsity part is the total;
a dense control splits into (0, total). And bypass mode through the pipeline: the sampler's log-prob is the PPO
anchor, the dense recompute runs only when a rule or the metrics need it."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.algo import CorrectionConfig, LossConfig
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.logprobs import pad_right
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.pipeline import correct, prepare_rollout
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.types import Sample
from slime_sparse.rollout.base_types import RolloutPlan

TEMP = 0.9
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
PROMPTS = [[5, 17, 3, 9, 40, 41], [11, 2, 8], [7, 7, 8, 1, 60, 61, 62, 3, 4, 30, 31, 32, 33], [9, 9, 1]]
SAMPLING = SamplingParams(temperature=TEMP, max_new_tokens=30, ignore_eos=True)
PARTS = ("sparsity", "numeric")
STATS = ("k1", "k3", "abs_log_xi", "abs_log_xi_p99", "abs_log_xi_p999", "xi_p5", "chi2_token", "chi2_seq",
         "token_mask_frac", "veto_seq_frac")


class CountingLearner(EmbeddedLearner):
    """The embedded learner, counting its dense and shadow forwards."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def compute_logprobs(self, tokens, response_lens, *, ref=False, shadow=None):
        self.calls.append("ref" if ref else "shadow" if shadow is not None else "dense")
        return super().compute_logprobs(tokens, response_lens, ref=ref, shadow=shadow)


def rollout(kv: KVCompressConfig, seed: int = 0) -> tuple[list[Sample], CountingLearner]:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    outs = EmbeddedEngine(model, kv, max_batch_size=4).generate(PROMPTS, SAMPLING, seed=3)
    samples = [Sample(prompt_index=i // 2, prompt_ids=o.prompt_ids, response_ids=o.response_ids,
                      rollout_logprobs=o.logprobs, finish_reason=o.finish_reason, reward=float(i % 2), kv=o.kv,
                      evictions=o.evictions) for i, o in enumerate(outs)]
    learner = CountingLearner(model, LossConfig(), optim=OptimConfig(lr=1e-3), temperature=TEMP)
    return samples, learner


RKV = KVCompressConfig(method="rkv", budget=8, buffer=4, window=2, kernel_size=3)


def test_the_two_parts_add_up_to_the_total_per_token_and_numeric_is_zero_in_fp32():
    samples, learner = rollout(RKV)
    assert all(s.kv.compressions > 0 and s.evictions is not None for s in samples)
    tokens = [s.prompt_ids + s.response_ids for s in samples]
    lens = [len(s.response_ids) for s in samples]
    pad = lambda xs: pad_right(xs, 0.0, dtype=torch.float32)  # noqa: E731
    old = pad(learner.compute_logprobs(tokens, lens))
    shadow = pad(learner.compute_logprobs(tokens, lens, shadow=[s.evictions for s in samples]))
    sparse = pad([torch.tensor(s.rollout_logprobs) for s in samples])
    mask = pad([torch.ones(n) for n in lens]) > 0
    sparsity, numeric, total = (old - shadow)[mask], (shadow - sparse)[mask], (old - sparse)[mask]
    torch.testing.assert_close(sparsity + numeric, total, rtol=0, atol=1e-6)  # float rounding of one subtraction
    assert numeric.abs().max() <= 1e-5  # fp32 CPU: the shadow recompute reproduces the sampler
    assert total.abs().max() > 1e-2  # the cache did change what the sampler saw

    metrics = prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis")).metrics
    assert metrics["mismatch/numeric/abs_log_xi"] <= 1e-5 and metrics["mismatch/numeric/abs_log_xi_p999"] <= 1e-5
    assert metrics["mismatch/numeric/token_mask_frac"] == 0 and metrics["mismatch/numeric/veto_seq_frac"] == 0
    assert metrics["mismatch/sparsity/k1"] + metrics["mismatch/numeric/k1"] == pytest.approx(metrics["mismatch/k1"],
                                                                                             abs=1e-9)
    for stat in STATS:  # the sparsity part is the whole mismatch
        assert metrics[f"mismatch/sparsity/{stat}"] == pytest.approx(metrics[f"mismatch/{stat}"], rel=1e-4, abs=1e-5), stat
    assert metrics["mismatch/k3"] > 1e-4 and metrics["perf/mismatch_split_s"] >= 0


def test_the_split_costs_one_shadow_forward_and_follows_the_cadence():
    samples, learner = rollout(RKV)
    prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis"), plan=RolloutPlan(metrics_due=True))
    assert learner.calls == ["dense", "shadow"]
    learner.calls.clear()
    metrics = prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis"),
                              plan=RolloutPlan(metrics_due=False)).metrics
    assert learner.calls == ["dense"] and not any(k.startswith(("mismatch/sparsity", "mismatch/numeric")) for k in metrics)
    assert "mismatch/k3" in metrics  # the total needs no extra forward under sparse_rl
    # under shadow the shadow forward is paid for anyway: the split is free, on every rollout
    learner.calls.clear()
    metrics = prepare_rollout(samples, learner, CorrectionConfig(),
                              plan=RolloutPlan(trains_shadow=True, metrics_due=False)).metrics
    assert learner.calls == ["dense", "shadow"] and "mismatch/numeric/k3" in metrics


def test_a_dense_control_splits_into_zero_and_the_total_without_a_forward():
    samples, learner = rollout(KVCompressConfig(method="none"))
    assert all(s.kv.compressions == 0 for s in samples)
    metrics = prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis")).metrics
    assert learner.calls == ["dense"]  # nothing evicted: pi_shadow is pi_old
    for stat in ("k1", "k3", "abs_log_xi", "abs_log_xi_p999", "token_mask_frac", "veto_seq_frac"):
        assert metrics[f"mismatch/sparsity/{stat}"] == 0.0
        assert metrics[f"mismatch/numeric/{stat}"] == metrics[f"mismatch/{stat}"]
    assert metrics["mismatch/abs_log_xi"] < 1e-5  # fp32: the dense sampler is the learner


def test_no_split_when_a_compressed_sample_has_no_record():
    samples, learner = rollout(RKV)
    samples[1].evictions = None  # e.g. an SGLang server without the record-shipping plugin
    metrics = prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis")).metrics
    assert learner.calls == ["dense"] and "mismatch/sparsity/k1" not in metrics and "mismatch/k1" in metrics


# ------------------------------------------------------------------------------------------------ bypass
def test_bypass_anchors_ppo_at_the_sampler_and_skips_the_dense_forward_when_nothing_needs_it():
    samples, learner = rollout(RKV)
    bypass = CorrectionConfig.from_preset("bypass_ppo_clip")
    prepared = prepare_rollout(samples, learner, bypass, plan=RolloutPlan(metrics_due=False))
    assert learner.calls == []  # no dense recompute, no shadow forward
    for got, s in zip(prepared.batch.old_logprobs, samples):
        assert torch.equal(got, torch.tensor(s.rollout_logprobs, dtype=torch.float32))
    assert prepared.batch.weights is None and all(bool(m.all()) for m in prepared.batch.loss_masks)
    assert "mismatch/k1" not in prepared.metrics and prepared.metrics["correction/seq_reject_rate"] == 0
    assert "correction/xi_mean" not in prepared.metrics  # xi was not computed: nothing is claimed about it
    # the first optimizer step is on the sampler's policy: PPO's ratio pi_theta / pi_sparse is the mismatch
    metrics = learner.train_step(prepared.batch)
    assert metrics["ppo_kl"] != 0.0

    learner.calls.clear()
    due = prepare_rollout(samples, learner, bypass, plan=RolloutPlan(metrics_due=True))
    assert learner.calls == ["dense", "shadow"] and "mismatch/k1" in due.metrics and "mismatch/numeric/k1" in due.metrics
    learner.calls.clear()
    rule = CorrectionConfig(bypass_mode=True, rs=("token_k3",), rs_threshold=("1e-4",))
    ruled = prepare_rollout(samples, learner, rule, plan=RolloutPlan(metrics_due=False))
    assert learner.calls == ["dense"]  # the rule reads xi
    assert all(torch.equal(got, torch.tensor(s.rollout_logprobs, dtype=torch.float32))
               for got, s in zip(ruled.batch.old_logprobs, samples))
    assert 0 < ruled.metrics["correction/rs_token_k3_token_frac"] < 1
    assert sum(float(m.sum()) for m in ruled.batch.loss_masks) < sum(len(s.response_ids) for s in samples)


def test_bypass_marks_nonfinite_samples_without_the_dense_forward():
    samples, learner = rollout(RKV)
    samples[2].rollout_logprobs = [float("-inf")] + samples[2].rollout_logprobs[1:]
    assert correct(samples, learner, CorrectionConfig(bypass_mode=True), plan=RolloutPlan(metrics_due=False)).old is None
    assert learner.calls == [] and [s.rejected for s in samples] == [False, False, True, False]
    with pytest.raises(ValueError, match="bypass-mode with --loss-type shadow"):
        prepare_rollout(samples, learner, CorrectionConfig(bypass_mode=True), plan=RolloutPlan(trains_shadow=True))


# ------------------------------------------------------------------------------------------------ in a run
def test_a_runs_metrics_jsonl_holds_the_peer_metrics_and_the_alarms_warn_once(tiny_assets, tmp_path, capsys,
                                                                              monkeypatch):
    """Two rollouts of the tiny training command: every metric of the issue in metrics.jsonl (the split on the
    first rollout only at --mismatch-metrics-interval 2), and each crossed alarm as one `warning:` line."""
    import yaml

    from slime_sparse.algo import metrics as algo_metrics
    from slime_sparse.algo.metrics import Alarm, crossed_alarms
    from slime_sparse.train import main
    from tests.helpers.tiny_runs import rollout_rows, run_args

    # one more alarm, one that any compressed rollout crosses (k3 > 0), so the warning path runs for sure
    tight = Alarm("mismatch/sparsity/k3", -1.0, 0.0, "a test bound")
    monkeypatch.setattr(algo_metrics, "MISMATCH_ALARMS", (*algo_metrics.MISMATCH_ALARMS, tight))
    run = tmp_path / "run"
    assert main(run_args(tiny_assets(n_train=64), run, 2, "--mismatch-metrics-interval", "2", "--use-opsm")) == 0
    first, second = rollout_rows(run)
    for key in ("correction/is_mean", "correction/is_std", "correction/is_ess", "correction/veto_seq_frac",
                "correction/veto_token_frac", "correction/opsm_seq_frac", "correction/mask_low_frac",
                "mismatch/chi2_token", "mismatch/chi2_seq", "mismatch/k1", "mismatch/k3", "mismatch/xi_p5",
                "mismatch/abs_log_xi_p99", "mismatch/abs_log_xi_p999", "mismatch/token_mask_frac",
                "mismatch/veto_seq_frac", *(f"mismatch/{part}/{stat}" for part in PARTS for stat in STATS)):
        assert key in first and first[key] is not None, key
    assert "mismatch/sparsity/k3" not in second and "mismatch/k3" in second  # every 2nd rollout: 1, 3, ...
    assert first["mismatch/numeric/abs_log_xi_p999"] <= 1e-5  # fp32 CPU
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("warning: rollout") and any(b in line for b in (" is outside [", " is < ", " is > "))]
    crossed = {k for row in (first, second) for k, _ in crossed_alarms(row)}
    assert tight.key in crossed and len(lines) == len(crossed)  # each alarm once
    for key in crossed:
        assert sum(f" {key} = " in line for line in lines) == 1, key
    assert any(line.startswith("warning: rollout 1: mismatch/sparsity/k3 = ") for line in lines)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["correction"]["opsm_delta"] == 1e-4 and config["log"]["mismatch_metrics_interval"] == 2
