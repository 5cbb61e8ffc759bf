"""The command-line name of every run-config field: `--<section prefix><field>`, or slime's spelling where slime
has one (`--rollout-batch-size`, `--n-samples-per-prompt`, ...).

The parser (slime_sparse.config) is built from these names, and section validators name the offending flag with
`flag_for`, so an error always shows the flag a user types. No imports: any section's module may use it.
"""
from __future__ import annotations

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
}

# fields that no flag sets (filled from --hf-checkpoint, or by the `--sglang-*` pass-through)
NO_FLAG = {"sglang.model_path", "sglang.extra_args"}
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
    "reward.timeout_s": "--rm-timeout",
    "reward.num_workers": "--rm-num-workers",
    "log.progress": "--progress-bar",
    "cluster.ray_timeout_s": "--ray-timeout",
    "megatron.load": "--megatron-load",  # Megatron-LM's --load; ours is the resume directory (--save)
    "megatron.vocab_divisible_by": "--make-vocab-size-divisible-by",
}


def flag_for(section: str, name: str) -> str:
    """The flag that sets field `name` of config section `section`."""
    prefix = SECTION_PREFIXES[section]
    return FLAG_ALIASES.get(f"{section}.{name}", "--" + prefix + name.replace("_", "-").removeprefix(prefix))
