"""The command-line name of every run-config field: `--<section prefix><field>`, or slime's spelling where slime
has one (`--rollout-batch-size`, `--n-samples-per-prompt`, ...).

The parser (slime_sparse.config_loader) is built from these names, and section validators name the offending flag
with `flag_for` (or the checks at the end: `positive`, `non_negative`, `choice`), so an error always shows the flag
a user types. No project imports: any section's module may use it.

Two conventions from slime: a bool field whose flag starts with `--disable-` is a switch that turns it off
(slime's `action="store_false"`); and `SPELLINGS` lists slime flags that have no field of their own but set
fields of ours (`--use-tis`, `--use-opsm` set the correction knobs), so both spellings give the same config; `FIXED` lists
slime flags we accept only at the one value that describes what we do (`--optimizer adam`).
"""
from __future__ import annotations

from typing import Any

# section of the run config -> prefix of its fields' flags (in the order of RunConfig's sections)
SECTION_PREFIXES: dict[str, str] = {
    "train": "",
    "rollout": "rollout-",
    "sampling": "rollout-",
    "kv": "kv-",
    "loss": "",
    "correction": "correction-",
    "data": "",
    "reward": "",
    "eval": "",
    "log": "",
    "cluster": "",
    "sglang": "sglang-",
    "megatron": "",
    "drift": "drift-",
    "overlap": "",
}

# fields that no flag sets (filled from --hf-checkpoint, or by the `--sglang-*` pass-through)
# ratio_level, policy_loss_mode: set by --advantage-estimator
NO_FLAG = {"sglang.model_path", "sglang.extra_args", "loss.ratio_level", "loss.policy_loss_mode"}
# where every `--sglang-X` flag that is not ours goes (as `--X`, to every SGLang server), like slime
PASSTHROUGH_FIELD = "sglang.extra_args"

# slime's spellings (and ours where the generic rule reads badly)
FLAG_ALIASES: dict[str, str] = {
    "rollout.rollout_batch_size": "--rollout-batch-size",
    "rollout.n_samples_per_prompt": "--n-samples-per-prompt",
    "rollout.advantage_estimator": "--advantage-estimator",
    "sampling.max_new_tokens": "--rollout-max-response-len",
    "sampling.stop_token_ids": "--rollout-stop-token-ids",
    "data.max_prompt_len": "--rollout-max-prompt-len",
    "data.shuffle": "--rollout-shuffle",
    "data.seed": "--rollout-seed",
    "data.num_epochs": "--num-epoch",
    "rollout.grpo_std_normalization": "--disable-grpo-std-normalization",
    "rollout.normalize_advantages": "--normalize-advantages",
    "rollout.cuda_graph": "--disable-cuda-graph",
    "rollout.over_sampling_batch_size": "--over-sampling-batch-size",
    "rollout.dynamic_sampling_filter_path": "--dynamic-sampling-filter-path",
    "rollout.dynamic_sampling_min_kept_samples": "--dynamic-sampling-min-kept-samples",
    "rollout.dynamic_sampling_max_rounds": "--dynamic-sampling-max-rounds",
    "reward.timeout_s": "--rm-timeout",
    "reward.num_workers": "--rm-num-workers",
    "reward.memory_limit_mb": "--rm-memory-limit-mb",
    "reward.max_error_rate": "--rm-max-error-rate",
    "log.progress": "--progress-bar",
    "cluster.ray_timeout_s": "--ray-timeout",
    "megatron.load": "--ref-load",  # slime's: the Megatron checkpoint a run starts from (and its KL reference)
    "megatron.vocab_divisible_by": "--make-vocab-size-divisible-by",
    "drift.budget_max": "--kv-budget-max",  # the drift guard's, beside --kv-budget
    "overlap.async_train": "--async",  # slime: the train_async.py entry point (ours too: slime_sparse.train_async)
}

DISABLE_PREFIX = "--disable-"  # a bool field with such a flag: the flag turns it off (slime's store_false)

# The argument of a spelling, where `sets` uses it.
ARG = "<argument>"
# slime flags without a field of their own: flag -> {"sets": {"section.field": value or ARG}, "type": the
# argument's type (absent: a switch), "needs": a spelling without which this one has no effect (then refused),
# "help"}. Applied in this order (a later one overrides an earlier one's value of the same field); a field
# also set by its own flag to another value is refused.
SPELLINGS: dict[str, dict] = {
    "--use-tis": {
        # slime's vanilla TIS: w = clamp(pi_old / pi_rollout, --tis-clip-low, --tis-clip), --tis-clip 2.0 by default
        "sets": {"correction.is_weight": True, "correction.is_upper": 2.0},
        "help": "slime's truncated importance sampling: the same as --correction-is-weight --correction-is-upper 2.0",
    },
    "--tis-clip": {
        "type": float, "sets": {"correction.is_upper": ARG}, "needs": "--use-tis",
        "help": "upper clip of the TIS weight (slime's default 2.0): the same as --correction-is-upper",
    },
    "--tis-clip-low": {
        "type": float, "sets": {"correction.is_lower": ARG}, "needs": "--use-tis",
        "help": "lower clip of the TIS weight (slime's default 0): the same as --correction-is-lower",
    },
    "--sglang-enable-fp32-lm-head": {
        # slime passes it to SGLang alone, leaving its learner's head in bf16: here both sides follow one flag
        "sets": {"train.enable_fp32_lm_head": True},
        "help": "SGLang's flag as slime users pass it: the same as --enable-fp32-lm-head (servers and learner alike)",
    },
    "--use-opsm": {
        # slime's off-policy sequence masking, --opsm-delta 1e-4 by default
        "sets": {"correction.opsm_delta": 1e-4},
        "help": "slime's off-policy sequence masking: the same as --correction-opsm-delta 1e-4",
    },
    "--opsm-delta": {
        "type": float, "sets": {"correction.opsm_delta": ARG}, "needs": "--use-opsm",
        "help": "OPSM's KL bound (slime's default 1e-4): the same as --correction-opsm-delta",
    },
    "--use-rollout-logprobs": {
        "sets": {"correction.bypass_mode": True},
        "help": "slime's: the PPO anchor is the rollout engine's log-prob, the same as --correction-bypass-mode",
    },
    "--get-mismatch-metrics": {
        "sets": {"log.mismatch_metrics_interval": 1},
        "help": "slime's: mismatch metrics on every rollout, also where they cost a forward (under "
                "--use-rollout-logprobs): the same as --mismatch-metrics-interval 1",
    },
    "--recompute-activations": {
        "sets": {"train.recompute_granularity": "selective"},
        "help": "Megatron's: the same as --recompute-granularity selective",
    },
    "--calculate-per-token-loss": {
        "sets": {"loss.loss_agg_mode": "token-mean"},
        "help": "slime's per-token loss (every token of the global batch weighs the same): the same as "
                "--loss-agg-mode token-mean",
    },
}

# slime flags accepted only at the value that says what we always do:
# flag -> (section it is listed under in --help, type, value, why no other)
FIXED: dict[str, tuple[str, type, object, str]] = {
    "--optimizer": ("train", str, "adam", "both learners step Adam with decoupled weight decay (Megatron's adam)"),
    "--kl-coef": ("loss", float, 0.0,
                  "a KL penalty in the reward is not implemented; use --use-kl-loss --kl-loss-coef"),
    "--gamma": ("rollout", float, 1.0, "REINFORCE++'s discount: with an outcome reward and no reward KL its return "
                "is R at every token only for gamma 1; a per-token return is not implemented"),
    "--context-parallel-size": ("megatron", int, 1, "context parallelism is not implemented"),
    "--expert-model-parallel-size": ("megatron", int, 1, "the learners build dense models (no experts)"),
    "--expert-tensor-parallel-size": ("megatron", int, 1, "the learners build dense models (no experts)"),
}


def flag_for(section: str, name: str) -> str:
    """The flag that sets field `name` of config section `section`."""
    prefix = SECTION_PREFIXES[section]
    return FLAG_ALIASES.get(f"{section}.{name}", "--" + prefix + name.replace("_", "-").removeprefix(prefix))


# Checks of a section's values, each a one-line error naming the flag (the section class sets SECTION).
def flag(section_obj: Any, name: str) -> str:
    """The flag of field `name` of a config section object."""
    return flag_for(section_obj.SECTION, name)


def positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{flag(obj, name)}={getattr(obj, name)} is invalid: must be > 0")


def non_negative(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"{flag(obj, name)}={getattr(obj, name)} is invalid: must be >= 0")


def choice(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(obj, name) not in allowed:
        raise ValueError(f"{flag(obj, name)}={getattr(obj, name)!r} is invalid: choose one of {allowed}")
