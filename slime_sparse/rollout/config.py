"""The `rollout` section of the run config: how many prompts and samples a rollout takes, which engine generates
them, how advantages are normalised, dynamic sampling, and the rollout function (--rollout-function-path).
Checked like every section (slime_sparse.sections): values in `validate`, the modules it names in `check_inputs`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from slime_sparse.algo.advantages import ADVANTAGE_ESTIMATORS, WHITENED_ESTIMATORS, AdvantageSpec
from slime_sparse.flags import choice, flag, non_negative, positive
from slime_sparse.rollout.filter_hub import load_filters
from slime_sparse.utils.imports import load_function

ROLLOUT_ENGINES = ("embedded", "sglang")
# our former estimator name, kept as a spelling of slime's --disable-grpo-std-normalization
DR_GRPO = "dr_grpo"
DEFAULT_ROLLOUT_FUNCTION = "slime_sparse.rollout.sparse_rollout.generate_rollout"


@dataclass(frozen=True)
class RolloutConfig:
    SECTION: ClassVar[str] = "rollout"

    rollout_batch_size: int = field(default=128, metadata={"help": (
        "prompts per rollout (slime: required); 128 here, the paper's")})
    n_samples_per_prompt: int = field(default=8, metadata={"help": (
        "samples of each prompt, the GRPO group (slime's default 1); 8 here, the paper's")})
    engine: str = field(default="embedded", metadata={"help": (
        "embedded (pure PyTorch, in process or a Ray actor) | sglang (patched SGLang servers)")})
    max_batch_size: int | None = field(default=None, metadata={"help": (
        "sequences decoded at once per engine at most (embedded). Default: 64 without a memory size; none with "
        "--rollout-kv-cache-gib or --rollout-mem-fraction, which then admit what fits (as SGLang's "
        "--max-running-requests defaults from its memory)")})
    kv_cache_gib: float | None = field(default=None, metadata={"help": (
        "embedded engine: memory for its KV cache and every working set; it decodes as many sequences at once as fit "
        "with them: each row's KV (a compressed row holds --kv-budget + --kv-buffer slots, a dense one the whole "
        "sequence) and state, plus a decode step's logits and sampler, a prefill's activations and a compaction's "
        "bounded workspace (slime_sparse/kv/engine_memory.py; tools/plan_memory.py prints the same count), at most "
        "--rollout-max-batch-size if given (SGLang's --mem-fraction-static with --max-running-requests)")})
    mem_fraction: float | None = field(default=None, metadata={"help": (
        "embedded engine: --rollout-kv-cache-gib as this fraction of the device memory free when the engine is "
        "built, after the learner's and the engine's weights are loaded (CUDA: torch.cuda.mem_get_info; CPU: "
        "MemAvailable of /proc/meminfo). The rest must hold what the learner allocates later (optimizer state, "
        "activations: tools/plan_memory.py). SGLang's --mem-fraction-static, of free memory rather than of the total "
        "(here the learner's weights stay resident)")})
    cuda_graph: bool = field(default=True, metadata={"help": (
        "embedded engine on CUDA: decode steps replay CUDA graphs (one per padded batch size, captured on first use); "
        "--disable-cuda-graph (SGLang's name) runs them eagerly. SGLang servers: --sglang-cuda-graph")})
    advantage_estimator: str = field(default="grpo", metadata={"help": (
        "grpo: A = (R - mean) / (std + 1e-6) over a prompt's samples | gspo: grpo's A with GSPO's sequence-level "
        "PPO ratio | rloo: A = R - mean of the other samples | reinforce_plus_plus_baseline: R - mean, whitened over "
        "the batch | reinforce_plus_plus: R whitened over the batch (slime's names; rloo is verl's; "
        "docs/algorithm.md). dr_grpo is accepted as the spelling of grpo with --disable-grpo-std-normalization")})
    grpo_std_normalization: bool = field(default=True, metadata={"help": (
        "divide grpo / gspo advantages by the group's std; --disable-grpo-std-normalization: A = R - mean "
        "(Dr.GRPO)")})
    normalize_advantages: bool | None = field(default=None, metadata={"help": (
        "whiten the advantages over the rollout's response tokens, (A - mean) / std (slime's; it requires it for "
        "both REINFORCE++ estimators). Default: on for those, off for the others (slime: off)")})
    over_sampling_batch_size: int | None = field(default=None, metadata={"help": (
        "prompts the first generation round draws (slime's; default --rollout-batch-size): rounds repeat until the "
        "batch holds --rollout-batch-size groups that pass --dynamic-sampling-filter-path. Later rounds draw what is "
        "still needed over the pass rate so far, at most this many (slime: this many each time, but it aborts what "
        "it does not need); groups a round made but the batch did not need go back to the prompt stream (slime "
        "drops them)")})
    dynamic_sampling_filter_path: tuple[str, ...] = field(default=(), metadata={"help": (
        "dynamic-sampling filters (DAPO), each 'package.module.function' (slime's) or 'package.module:function', "
        "fn(cfg, samples) -> DynamicFilterOutput | bool per group; a group must pass each. Built in: "
        "check_reward_nonzero_std (drop groups of equal rewards), check_reward_nonzero_std_with_fallback, "
        "check_min_kept_samples (drop groups with fewer than --dynamic-sampling-min-kept-samples samples the "
        "sparsity correction kept); see slime_sparse/rollout/filter_hub.py")})
    dynamic_sampling_min_kept_samples: int = field(default=1, metadata={"help": (
        "check_min_kept_samples: the fewest samples of a group the sparsity correction must keep (not in slime)")})
    dynamic_sampling_max_rounds: int = field(default=10, metadata={"help": (
        "generation rounds per rollout, the first included (verl's max_num_gen_batches; slime has no bound): when "
        "they are spent the rollout trains on the groups it has, with a warning and "
        "rollout/dynamic_sampling_exhausted = 1")})
    rollout_function_path: str = field(default=DEFAULT_ROLLOUT_FUNCTION, metadata={"help": (
        "the function that generates a rollout, 'package.module.function' or 'package.module:function', with "
        "slime's signature fn(cfg, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | "
        "list[list[Sample]] (slime_sparse/rollout/base_types.py); data_source holds the prompt stream, the engine, "
        "the reward function and the learner. The default draws, generates, scores and filters in rounds "
        "(dynamic sampling, over-sampling)")})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RolloutConfig":
        values = dict(values)
        if isinstance(values.get("dynamic_sampling_filter_path"), str):  # one path (YAML)
            values["dynamic_sampling_filter_path"] = (values["dynamic_sampling_filter_path"],)
        if values.get("advantage_estimator") == DR_GRPO:
            values.update(advantage_estimator="grpo", grpo_std_normalization=False)
        return cls(**values)

    @property
    def advantage_spec(self) -> AdvantageSpec:
        """How the rollout's rewards become advantages (`algo.advantages`)."""
        whiten = self.advantage_estimator in WHITENED_ESTIMATORS if self.normalize_advantages is None \
            else self.normalize_advantages
        return AdvantageSpec(self.advantage_estimator, self.grpo_std_normalization, whiten)

    @property
    def sampling_batch_size(self) -> int:
        """--over-sampling-batch-size as resolved: prompts the first generation round draws."""
        return self.over_sampling_batch_size or self.rollout_batch_size

    def validate(self) -> None:
        positive(self, "rollout_batch_size", "n_samples_per_prompt", "dynamic_sampling_max_rounds")
        non_negative(self, "dynamic_sampling_min_kept_samples")
        if self.max_batch_size is not None:
            positive(self, "max_batch_size")
        choice(self, "engine", ROLLOUT_ENGINES)
        self._validate_memory()
        choice(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)
        self.advantage_spec.validate()
        if self.n_samples_per_prompt == 1 and self.advantage_estimator != "reinforce_plus_plus":
            # Refused, not warned: every advantage would be 0 and the run would train nothing (slime's std of one
            # sample is NaN; verl quietly drops the baseline and trains on the raw reward instead).
            raise ValueError(f"{flag(self, 'n_samples_per_prompt')}=1 is invalid with "
                             f"{flag(self, 'advantage_estimator')}={self.advantage_estimator}: its baseline is the "
                             "mean reward of each prompt's samples, so one sample per prompt gets advantage 0 and "
                             "nothing is learned; use >= 2")
        if self.sampling_batch_size < self.rollout_batch_size:
            raise ValueError(f"{flag(self, 'over_sampling_batch_size')}={self.over_sampling_batch_size} must be >= "
                             f"{flag(self, 'rollout_batch_size')}={self.rollout_batch_size} (slime's rule)")
        if self.dynamic_sampling_min_kept_samples > self.n_samples_per_prompt:
            raise ValueError(f"{flag(self, 'dynamic_sampling_min_kept_samples')}={self.dynamic_sampling_min_kept_samples}"
                             f" exceeds {flag(self, 'n_samples_per_prompt')}={self.n_samples_per_prompt}: every "
                             "group would be dropped")

    def _validate_memory(self) -> None:
        gib, fraction = flag(self, "kv_cache_gib"), flag(self, "mem_fraction")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"{gib}={self.kv_cache_gib} is invalid: must be > 0 (GiB for the KV cache and working "
                             "sets)")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"{fraction}={self.mem_fraction} is invalid: must lie in (0, 1)")
        if self.kv_cache_gib is not None and self.mem_fraction is not None:
            raise ValueError(f"{gib} and {fraction} both size the rollout engine's memory: give one")
        if self.engine == "sglang":
            given = [flag(self, n) for n in ("kv_cache_gib", "mem_fraction") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} size the embedded engine; with {flag(self, 'engine')} sglang "
                                 "the servers size themselves: --sglang-mem-fraction-static")

    def check_inputs(self) -> None:
        """The filters and the rollout function import (a path that does not fails naming its flag)."""
        load_filters(self.dynamic_sampling_filter_path)
        load_function(self.rollout_function_path, flag(self, "rollout_function_path"))
