"""A slime user's command line runs as-is: slime's flags parse into the settings a slime user means (one test per
flag), combinations that make no sense here are refused with one line, and the Qwen2.5 GRPO example's argument
list parses into the expected config.

Names and meanings are read against slime's HEAD (2026-08) `slime/utils/arguments.py` and
`scripts/run-qwen2.5-0.5B-reproducibility.sh`, and Megatron-LM's `megatron/training/config/training_config.py`.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from slime_sparse.algo.correction import CorrectionConfig
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.config import RunConfig
from slime_sparse.config_loader import load_config
from slime_sparse.factory import LearnerSpec


@pytest.fixture
def paths(tmp_path):
    """Test fixtures standing in for the script's model and data paths (parsing only reads that they exist)."""
    model = tmp_path / "Qwen2.5-0.5B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_05B))  # what slime's MODEL_ARGS are checked against
    train = tmp_path / "gsm8k_train.jsonl"
    train.write_text('{"messages": [{"role": "user", "content": "1 + 2 ="}], "label": "3"}\n')
    test = tmp_path / "gsm8k_test.jsonl"
    test.write_text('{"messages": [{"role": "user", "content": "2 + 2 ="}], "label": "4"}\n')
    return dataclasses.make_dataclass("Paths", ["model", "train", "test"])(str(model), str(train), str(test))


@pytest.fixture
def base(paths):
    return ["--hf-checkpoint", paths.model, "--prompt-data", paths.train]


def parse(base: list[str], *flags: str) -> RunConfig:
    return load_config([*base, *flags])


def refused(base: list[str], *flags: str, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        parse(base, *flags)
    message = str(err.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------- the Qwen2.5 GRPO example

# scripts/run-qwen2.5-0.5B-reproducibility.sh at slime HEAD, in its own groups and order, with the model and data
# paths replaced by fixtures. Dropped, and why:
DROPPED = {
    # GPU-only: deterministic CUDA kernels / NCCL, fused-kernel and attention-kernel choices of Megatron-LM
    "--deterministic-mode": 0, "--attention-softmax-in-fp32": 0, "--attention-backend": 1,
    # Megatron-LM model options: our Megatron learner builds with dropout 0 and reduces gradients in fp32 always;
    # the embedded learner takes dropout from config.json
    "--attention-dropout": 1, "--hidden-dropout": 1, "--accumulate-allreduce-grads-in-fp32": 0,
}
# MODEL_ARGS (scripts/models/qwen2.5-0.5B.sh), Megatron-LM's architecture flags, are ours since they are checked
# against --hf-checkpoint's config.json (both learners read the architecture from there): the fixture's, Qwen2.5-0.5B-
# Instruct's own
QWEN25_05B = {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
              "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768}
# Ours, but its value is not: a Megatron-LM torch_dist checkpoint made by slime's converter. Both learners start from
# --hf-checkpoint here; our --ref-load takes tools/convert_hf_to_megatron.py's output (--train-backend megatron), and
# refuses slime's (test_ref_load_*).
DROPPED_VALUE = {"--ref-load": 1}
QWEN25_GRPO = {
    "MODEL_ARGS": ["--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
                   "--num-attention-heads", "14", "--use-rotary-position-embeddings", "--disable-bias-linear",
                   "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "1000000",
                   "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "151936"],
    "top": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", "--calculate-per-token-loss"],
    "CKPT_ARGS": ["--hf-checkpoint", "{model}", "--ref-load", "/root/Qwen2.5-0.5B-Instruct_torch_dist/"],
    "ROLLOUT_ARGS": [
        "--prompt-data", "{train}", "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
        "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "100", "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8", "--rollout-max-response-len", "1024", "--rollout-temperature", "1",
        "--global-batch-size", "256"],
    "EVAL_ARGS": ["--eval-interval", "20", "--eval-prompt-data", "gsm8k", "{test}", "--n-samples-per-eval-prompt", "1",
                  "--eval-max-response-len", "1024", "--eval-top-k", "1"],
    "PERF_ARGS": ["--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
                  "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
                  "--expert-tensor-parallel-size", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"],
    "GRPO_ARGS": ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type",
                  "low_var_kl", "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high",
                  "0.28"],
    "OPTIMIZER_ARGS": ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
                       "--adam-beta1", "0.9", "--adam-beta2", "0.98"],
    "WANDB_ARGS": ["--use-wandb", "--wandb-host", "https://wandb.ai/", "--wandb-team", "glm-zero", "--wandb-project",
                   "slime-dev", "--wandb-group", "qwen2.5-0.5B-gsm8k-deterministic"],
    "SGLANG_ARGS": ["--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
                    "--sglang-enable-deterministic-inference", "--sglang-attention-backend", "flashinfer",
                    "--deterministic-mode"],
    "MISC_ARGS": ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
                  "--attention-softmax-in-fp32", "--attention-backend", "flash"],
}


def without_dropped(argv: list[str]) -> list[str]:
    out, i, dropped = [], 0, {**DROPPED, **DROPPED_VALUE}
    while i < len(argv):
        if argv[i] in dropped:
            i += 1 + dropped[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def test_the_qwen25_grpo_example_parses_into_the_config_it_means(paths):
    argv = [a.format(model=paths.model, train=paths.train, test=paths.test) for g in QWEN25_GRPO.values() for a in g]
    cfg = load_config(without_dropped(argv))

    assert (cfg.cluster.actor_num_nodes, cfg.cluster.actor_num_gpus_per_node, cfg.cluster.colocate) == (1, 8, True)
    assert cfg.loss.loss_agg_mode == "token-mean"  # --calculate-per-token-loss
    assert cfg.train.hf_checkpoint == paths.model and cfg.megatron.load == ""
    data = cfg.data
    assert (data.prompt_data, data.input_key, data.label_key, data.apply_chat_template, data.shuffle) == (
        paths.train, "messages", "label", True, True)
    assert cfg.reward.rm_type == "math"
    assert (cfg.train.num_rollout, cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt) == (100, 32, 8)
    assert (cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.train.global_batch_size) == (1024, 1.0, 256)
    assert cfg.steps_per_rollout == 1
    ev = cfg.eval
    assert (cfg.train.eval_interval, ev.datasets, ev.n_samples_per_eval_prompt) == (20, [("gsm8k", paths.test)], 1)
    assert (ev.eval_max_response_len, ev.eval_top_k) == (1024, 1)
    mg = cfg.megatron
    assert (mg.tensor_model_parallel_size, mg.sequence_parallel, mg.pipeline_model_parallel_size) == (1, True, 1)
    assert LearnerSpec.from_run(cfg).batching == MicroBatching(max_tokens=9216)
    assert (cfg.rollout.advantage_estimator, cfg.rollout.grpo_std_normalization) == ("grpo", True)
    loss = cfg.loss
    assert (loss.use_kl_loss, loss.kl_loss_coef, loss.kl_loss_type, loss.entropy_coef) == (True, 0.0, "low_var_kl", 0.0)
    assert not loss.needs_ref  # the KL term weighs 0: no reference model is kept or run
    assert (loss.eps_low, loss.eps_high) == (0.2, 0.28)
    optim = LearnerSpec.from_run(cfg).optim
    assert (optim.lr, optim.decay_style, optim.weight_decay, optim.betas) == (1e-6, "constant", 0.1, (0.9, 0.98))
    log = cfg.log
    assert (log.use_wandb, log.wandb_host, log.wandb_team, log.wandb_project, log.wandb_group) == (
        True, "https://wandb.ai/", "glm-zero", "slime-dev", "qwen2.5-0.5B-gsm8k-deterministic")
    assert (cfg.cluster.rollout_num_gpus_per_engine, cfg.cluster.num_engines) == (1, 8)  # colocated: the 8 GPUs
    assert (cfg.sglang.mem_fraction_static, cfg.sglang.attention_backend) == (0.7, "flashinfer")
    assert cfg.sglang.extra_args == ("--enable-deterministic-inference",)  # the --sglang-* pass-through
    assert cfg.correction == CorrectionConfig()  # no --use-tis: no correction, as in slime


def test_the_dropped_flags_are_not_ours(paths):
    """The list above drops only flags this parser does not know (nothing it would have read is thrown away)."""
    argv = [a.format(model=paths.model, train=paths.train, test=paths.test) for g in QWEN25_GRPO.values() for a in g]
    kept = without_dropped(argv)
    for flag in DROPPED:
        assert flag in argv, flag  # every dropped flag is in the script
        with pytest.raises(SystemExit):
            load_config([*kept, flag, *(["1"] * DROPPED[flag])])


@pytest.mark.parametrize("flags, message", [
    (["--num-layers", "28"], "--num-layers 28 disagrees with .*config.json \\(num_hidden_layers implies 24\\)"),
    (["--num-query-groups", "14"], "--num-query-groups 14 disagrees .*num_key_value_heads implies 2"),
    (["--rotary-base", "10000"], "--rotary-base 10000.0 disagrees .*rope_theta implies 1000000.0"),
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights disagrees .*tie_word_embeddings"),
    (["--qk-layernorm"], "--qk-layernorm disagrees .*model_type says otherwise"),
])
def test_model_args_that_disagree_with_config_json_are_refused(base, flags, message):
    """slime's architecture flags are accepted where config.json agrees (the example above) and refused, one line
    naming the flag and config.json's value, where it does not: a Qwen2.5-7B script against the 0.5B model."""
    refused(base, *QWEN25_GRPO["MODEL_ARGS"], *flags, match=message)
    parse(base, *QWEN25_GRPO["MODEL_ARGS"], "--kv-channels", "64", "--max-position-embeddings", "32768")


# ------------------------------------------------------------------------------------------ one test per flag


def make_checkpoint(directory, step: int = 3) -> str:
    """A complete training checkpoint as utils.checkpoint writes it (only trainer_state.json is read here)."""
    directory.mkdir(parents=True)
    (directory / "trainer_state.json").write_text(
        '{"format_version": 1, "step": %d, "data_state": {}, "extra": {}}' % step)
    return str(directory)


def test_load_names_the_resume_directory(base, tmp_path):
    assert parse(base).train.load == ""  # default: resume from --save's directory
    assert parse(base, "--load", str(tmp_path / "not_yet")).train.load == str(tmp_path / "not_yet")  # fresh start
    ckpt = make_checkpoint(tmp_path / "ckpts" / "rollout_000003")
    assert parse(base, "--load", ckpt).train.load == ckpt
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    refused(base, "--load", str(hf), match="--load=.*Hugging Face model.*--hf-checkpoint")
    mlm = tmp_path / "torch_dist"
    mlm.mkdir()
    (mlm / "latest_checkpointed_iteration.txt").write_text("release")
    refused(base, "--load", str(mlm), match="--load=.*Megatron-LM checkpoint")
    refused(base, "--load", paths_file(tmp_path), match="--load=.*not a directory")


def paths_file(tmp_path) -> str:
    path = tmp_path / "a_file"
    path.write_text("x")
    return str(path)


def test_ref_load_is_the_megatron_learners_starting_checkpoint(base, tmp_path):
    converted = tmp_path / "q_mcore"
    converted.mkdir()
    cfg = parse(base, "--train-backend", "megatron", "--ref-load", str(converted))
    assert cfg.megatron.load == str(converted)
    refused(base, "--ref-load", str(converted), match="--ref-load .*needs --train-backend megatron")
    (converted / "latest_checkpointed_iteration.txt").write_text("release")  # slime's converter's layout
    refused(base, "--train-backend", "megatron", "--ref-load", str(converted), match="Megatron-LM checkpoint")
    with pytest.raises(SystemExit):
        parse(base, "--megatron-load", str(converted))  # the old name is gone


def test_use_tis_is_the_correction_knobs_spelled_as_slime(base):
    tis = parse(base, "--use-tis").correction
    assert tis == parse(base, "--correction-is-weight", "--correction-is-upper", "2.0").correction
    assert (tis.is_weight, tis.is_upper, tis.is_lower, tis.token_mask_low, tis.seq_veto) == (True, 2.0, 0.0, None, None)


def test_tis_clip_and_tis_clip_low_are_the_truncation_bounds(base):
    tis = parse(base, "--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.25").correction
    assert tis == parse(base, "--correction-is-weight", "--correction-is-upper", "1.5",
                        "--correction-is-lower", "0.25").correction
    assert (tis.is_upper, tis.is_lower) == (1.5, 0.25)
    # on top of a preset, like every knob
    assert parse(base, "--correction-preset", "mis", "--use-tis").correction == parse(
        base, "--correction-preset", "mis", "--correction-is-upper", "2.0").correction
    refused(base, "--tis-clip", "1.5", match="^--tis-clip has no effect without --use-tis$")
    refused(base, "--tis-clip-low", "0.1", match="--tis-clip-low has no effect without --use-tis")
    refused(base, "--use-tis", "--correction-is-upper", "3", match="--use-tis sets --correction-is-upper=2.0")
    refused(base, "--use-tis", "--tis-clip-low", "3", match="--correction-is-lower")  # low >= clip


def test_disable_grpo_std_normalization(base):
    assert parse(base).rollout.grpo_std_normalization is True
    off = parse(base, "--disable-grpo-std-normalization").rollout
    assert (off.advantage_estimator, off.grpo_std_normalization) == ("grpo", False)
    assert parse(base, "--advantage-estimator", "dr_grpo").rollout == off  # our former name, kept as its spelling
    assert parse(base, "--advantage-estimator", "cispo").loss.policy_loss_mode == "cispo"  # slime's #2067
    refused(base, "--advantage-estimator", "ppo", match="--advantage-estimator='ppo' is invalid")  # needs a critic


def test_advantage_estimators_and_normalize_advantages(base):
    """slime's estimators by its names; REINFORCE++ whitens (slime requires --normalize-advantages: implied
    here, refused when turned off); GSPO sets the loss's sequence ratio; --gamma only at 1."""
    for name in ("gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        cfg = parse(base, "--advantage-estimator", name)
        assert cfg.rollout.advantage_estimator == name
        assert cfg.rollout.advantage_spec.whiten == name.startswith("reinforce")
        assert cfg.loss.ratio_level == ("sequence" if name == "gspo" else "token")
    assert parse(base, "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages").rollout.advantage_spec \
        == parse(base, "--advantage-estimator", "reinforce_plus_plus").rollout.advantage_spec
    assert parse(base, "--normalize-advantages").rollout.advantage_spec.whiten is True  # grpo whitened, as slime
    refused(base, "--advantage-estimator", "reinforce_plus_plus", "--no-normalize-advantages",
            match="--advantage-estimator=reinforce_plus_plus needs --normalize-advantages")
    assert parse(base, "--gamma", "1.0").rollout == parse(base).rollout
    refused(base, "--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.99", match="--gamma")


def test_calculate_per_token_loss_is_token_mean(base):
    assert parse(base).loss.loss_agg_mode == "seq-mean-token-mean"  # slime's default reduction
    assert parse(base, "--calculate-per-token-loss").loss == parse(base, "--loss-agg-mode", "token-mean").loss
    refused(base, "--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-mean",
            match="--calculate-per-token-loss sets --loss-agg-mode='token-mean'")


def test_lr_decay_style_min_lr_decay_and_warmup_iters(base):
    spec = LearnerSpec.from_run(parse(base, "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
                                      "--lr-decay-iters", "40", "--lr-warmup-iters", "5"))
    assert (spec.optim.decay_style, spec.optim.min_lr, spec.optim.decay_iters, spec.optim.warmup_iters) == (
        "cosine", 1e-6, 40, 5)
    # --lr-decay-iters defaults to every optimizer step of the run (slime): 100 rollouts x 1024/256 steps
    assert parse(base, "--lr-decay-style", "linear").train.lr_decay_iters == 100 * 4
    assert parse(base).train.lr_decay_style == "constant"
    refused(base, "--lr-decay-style", "WSD", match="--lr-decay-style='WSD' is invalid")
    refused(base, "--min-lr", "1e-7", match="--min-lr=1e-07 has no effect with --lr-decay-style constant")
    refused(base, "--lr-decay-style", "linear", "--min-lr", "1e-5", match="--min-lr=1e-05 must be below --lr")
    refused(base, "--lr-decay-style", "cosine", "--lr-decay-iters", "5", "--lr-warmup-iters", "5",
            match="--lr-decay-iters=5 must exceed --lr-warmup-iters=5")


def test_eval_prompt_data_named_sets_and_one_bare_path(base, paths, tmp_path):
    other = tmp_path / "math500.jsonl"
    other.write_text(open(paths.test).read())
    named = parse(base, "--eval-prompt-data", "gsm8k", paths.test, "math500", str(other)).eval
    assert named.datasets == [("gsm8k", paths.test), ("math500", str(other))]
    assert parse(base, "--eval-prompt-data", paths.test).eval.datasets == [("", paths.test)]
    assert parse(base).eval.datasets == []
    refused(base, "--eval-prompt-data", "gsm8k", paths.test, "math500", match="NAME PATH pairs, got 3 values")
    refused(base, "--eval-prompt-data", "a", paths.test, "a", str(other), match="names each set once")
    refused(base, "--eval-prompt-data", paths.test, str(other), match="is not a set name")
    refused(base, "--eval-prompt-data", "gsm8k", str(tmp_path / "none.jsonl"), match="gsm8k .* does not exist")


def test_eval_sampling_flags(base):
    from slime_sparse.eval import eval_sampling

    cfg = parse(base, "--rollout-top-p", "0.9", "--rollout-max-response-len", "64")
    assert (eval_sampling(cfg).temperature, eval_sampling(cfg).top_p, eval_sampling(cfg).max_new_tokens) == (
        0.0, 0.9, 64)  # greedy by default; the rest is the rollout's
    ev = eval_sampling(parse(base, "--eval-temperature", "0.6", "--eval-top-p", "0.95", "--eval-top-k", "20",
                             "--eval-max-response-len", "128"))
    assert (ev.temperature, ev.top_p, ev.top_k, ev.max_new_tokens) == (0.6, 0.95, 20, 128)
    refused(base, "--eval-max-response-len", "0", match="--eval-max-response-len=0 is invalid")


@pytest.mark.parametrize("flags, batching", [
    ([], MicroBatching(max_tokens=16384)),  # ours: dynamic by default
    (["--max-tokens-per-gpu", "4096"], MicroBatching(max_tokens=4096)),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"], MicroBatching(max_tokens=9216)),
    (["--micro-batch-size", "4"], MicroBatching(max_tokens=None, micro_batch_size=4)),  # slime: fixed micro-batches
    (["--no-use-dynamic-batch-size"], MicroBatching(max_tokens=None, micro_batch_size=1)),  # slime's default
    (["--use-dynamic-batch-size", "--micro-batch-size", "4"], MicroBatching(max_tokens=16384, micro_batch_size=4)),
])
def test_micro_batch_size_and_dynamic_batch_size(base, flags, batching):
    """slime's two modes: --micro-batch-size samples per micro-batch, or (--use-dynamic-batch-size) packs of at most
    --max-tokens-per-gpu tokens, --micro-batch-size then ignored as in slime."""
    assert LearnerSpec.from_run(parse(base, *flags)).batching == batching


def test_micro_batching_splits(base):
    lengths = [5, 9, 3, 7, 4]
    assert MicroBatching(max_tokens=None, micro_batch_size=2).split(lengths) == [[0, 1], [2, 3], [4]]
    # by length, each within 18 padded tokens (rows x longest), cut where that saves more padding than 18 / 64
    assert MicroBatching(max_tokens=18).split(lengths) == [[2], [4], [0], [3], [1]]
    assert MicroBatching(max_tokens=1024).split([40, 41, 90, 91]) == [[0, 1], [2, 3]]
    assert MicroBatching(max_tokens=None).split(lengths) == [[0], [1], [2], [3], [4]]
    refused(base, "--micro-batch-size", "0", match="--micro-batch-size=0 is invalid")


def test_wandb_flags(base):
    log = parse(base, "--use-wandb", "--wandb-project", "p", "--wandb-team", "t", "--wandb-group", "g",
                "--wandb-run-name", "n", "--wandb-mode", "offline", "--wandb-host", "http://localhost:8080").log
    assert (log.use_wandb, log.wandb_project, log.wandb_team, log.wandb_group, log.wandb_run_name, log.wandb_mode,
            log.wandb_host) == (True, "p", "t", "g", "n", "offline", "http://localhost:8080")
    refused(base, "--use-wandb", "--wandb-mode", "cloud", match="--wandb-mode='cloud' is invalid")
    refused(base, "--wandb-group", "g", "--wandb-mode", "offline", match="--wandb-group, --wandb-mode need --use-wandb")


def test_use_tensorboard_is_on_unless_turned_off(base):
    assert parse(base).log.use_tensorboard is True
    assert parse(base, "--use-tensorboard").log.use_tensorboard is True  # slime's switch
    assert parse(base, "--no-use-tensorboard").log.use_tensorboard is False


def test_rollout_shuffle_is_on_unless_turned_off(base):
    assert parse(base).data.shuffle is True
    assert parse(base, "--rollout-shuffle").data.shuffle is True  # slime's switch
    assert parse(base, "--no-rollout-shuffle").data.shuffle is False


def test_kl_loss_type(base):
    assert parse(base).loss.kl_loss_type == "low_var_kl"
    assert parse(base, "--kl-loss-type", "k1").loss.kl_loss_type == "k1"  # slime's default, one flag away


def test_rollout_num_gpus_follows_slime_under_colocate(base):
    assert parse(base).cluster.num_engines == 1
    assert parse(base, "--colocate", "--actor-num-gpus-per-node", "4").cluster.num_engines == 4  # the learner's
    assert parse(base, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2").cluster.num_engines == 2


def test_tuple_flags_take_several_arguments(base):
    """slime's nargs="+" flags: --rollout-stop-token-ids 1 2 (the comma form keeps working)."""
    assert parse(base, "--rollout-stop-token-ids", "7", "9").sampling.stop_token_ids == (7, 9)
    assert parse(base, "--rollout-stop-token-ids", "7,9").sampling.stop_token_ids == (7, 9)
    urls = ("http://a:1", "http://b:2")
    assert parse(base, "--sglang-server-urls", *urls).sglang.server_urls == urls
    assert parse(base, "--sglang-server-urls", ",".join(urls)).sglang.server_urls == urls


@pytest.mark.parametrize("flag, value, other", [
    ("--optimizer", "adam", "sgd"),
    ("--kl-coef", "0.00", "0.01"),
    ("--context-parallel-size", "1", "2"),
    ("--expert-model-parallel-size", "1", "2"),
    ("--expert-tensor-parallel-size", "1", "2"),
])
def test_flags_taken_at_one_value(base, flag, value, other):
    """slime flags that describe what we always do: accepted at that value, refused at any other."""
    assert parse(base, flag, value) == parse(base)
    refused(base, flag, other, match=f"^{flag}={other} is not supported")


# slime's defaults at HEAD (slime/utils/arguments.py; Megatron-LM's own where slime keeps them, from
# megatron/training/config/training_config.py and megatron/training/arguments.py). REQUIRED: no default.
REQUIRED = object()
SLIME_DEFAULTS = {
    "--hf-checkpoint": None, "--prompt-data": None, "--input-key": "input", "--label-key": None,
    "--metadata-key": "metadata", "--apply-chat-template": False, "--rollout-shuffle": False, "--rollout-seed": 42,
    "--num-rollout": None, "--num-epoch": None, "--rollout-batch-size": REQUIRED, "--n-samples-per-prompt": 1,
    "--global-batch-size": None, "--micro-batch-size": 1, "--use-dynamic-batch-size": False,
    "--max-tokens-per-gpu": None, "--rollout-temperature": 1.0, "--rollout-top-p": 1.0, "--rollout-top-k": -1,
    "--rollout-max-response-len": None, "--rollout-max-prompt-len": None, "--rollout-stop-token-ids": None,
    "--rm-type": None, "--custom-rm-path": None, "--eval-interval": None, "--eval-prompt-data": None,
    "--n-samples-per-eval-prompt": 1, "--eval-temperature": None, "--eval-top-p": None, "--eval-top-k": None,
    "--eval-max-response-len": None, "--load": None, "--save": None, "--save-interval": None, "--ref-load": None,
    "--seed": 1234, "--lr": 1e-6, "--min-lr": 0.0, "--lr-decay-style": "linear", "--lr-decay-iters": None,
    "--lr-warmup-iters": 0, "--weight-decay": 0.01, "--adam-beta1": 0.9, "--adam-beta2": 0.999, "--clip-grad": 1.0,
    "--eps-clip": 0.2, "--eps-clip-high": None, "--eps-clip-c": None, "--use-kl-loss": False, "--kl-loss-coef": 0.0,
    "--kl-loss-type": "k1", "--entropy-coef": 0.0, "--advantage-estimator": "grpo",
    "--disable-grpo-std-normalization": True,  # (the field it clears: grpo_std_normalization)
    "--use-wandb": False, "--wandb-project": None, "--wandb-team": None, "--wandb-group": None, "--wandb-mode": None,
    "--wandb-host": None, "--use-tensorboard": False, "--actor-num-nodes": 1, "--actor-num-gpus-per-node": 8,
    "--rollout-num-gpus": None, "--rollout-num-gpus-per-engine": 1, "--colocate": False,
    "--update-weight-buffer-size": 512 * 1024**2, "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1, "--sequence-parallel": False, "--use-distributed-optimizer": False,
    "--make-vocab-size-divisible-by": 128, "--recompute-granularity": None, "--recompute-method": None,
    "--recompute-num-layers": None, "--offload-rollout": None, "--bf16": False,
    "--over-sampling-batch-size": None, "--dynamic-sampling-filter-path": None,
    # passed through to SGLang by slime, so SGLang's own (automatic) choice
    "--sglang-mem-fraction-static": None, "--sglang-attention-backend": None,
}


def test_every_default_that_differs_from_slimes_says_so_in_its_help():
    from dataclasses import MISSING, fields

    from slime_sparse.config import SECTION_TYPES, SECTIONS
    from slime_sparse.flags import flag_for

    ours = {}
    for section in SECTIONS:
        for f in fields(SECTION_TYPES[section]):
            default = f.default if f.default is not MISSING else f.default_factory()
            ours[flag_for(section, f.name)] = (None if default in ("", ()) else default, f.metadata.get("help", ""))
    differ = []
    for flag, slime_default in SLIME_DEFAULTS.items():
        assert flag in ours, flag  # slime's name is ours
        default, helptext = ours[flag]
        if default != slime_default:
            differ.append(flag)
            assert "slime" in helptext or "Megatron" in helptext, (flag, default, slime_default)
    # the two the issue names are among them
    assert {"--rollout-shuffle", "--kl-loss-type"} <= set(differ)


def test_use_opsm_and_opsm_delta_are_the_correction_s_opsm(base):
    opsm = parse(base, "--use-opsm").correction
    assert opsm.opsm_delta == 1e-4 and opsm == parse(base, "--correction-opsm-delta", "1e-4").correction
    assert parse(base, "--use-opsm", "--opsm-delta", "0.01").correction.opsm_delta == 0.01
    refused(base, "--opsm-delta", "0.01", match="^--opsm-delta has no effect without --use-opsm$")
    refused(base, "--use-opsm", "--correction-opsm-delta", "0.5", match="--use-opsm sets --correction-opsm-delta=0.0001")


def test_use_rollout_logprobs_is_bypass_mode(base):
    cfg = parse(base, "--use-rollout-logprobs").correction
    assert cfg.bypass_mode and cfg == parse(base, "--correction-bypass-mode").correction
    assert cfg.preset == "bypass_ppo_clip"
    refused(base, "--use-rollout-logprobs", "--use-tis", match="--correction-bypass-mode=True is invalid: the PPO ratio")
    refused(base, "--use-rollout-logprobs", "--loss-type", "shadow",
            match="--correction-bypass-mode with --loss-type shadow")


def test_get_mismatch_metrics_computes_them_every_rollout(base):
    assert parse(base, "--get-mismatch-metrics").log.mismatch_metrics_interval == 1
    assert parse(base, "--get-mismatch-metrics", "--mismatch-metrics-interval", "1").log.mismatch_metrics_interval == 1
    refused(base, "--get-mismatch-metrics", "--mismatch-metrics-interval", "5",
            match="--get-mismatch-metrics sets --mismatch-metrics-interval=1")
