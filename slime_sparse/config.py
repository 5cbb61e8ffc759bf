"""Typed run configuration: one dataclass per concern, composed into RunConfig and validated at load time.

Each component owns its config section (``LossConfig`` in ``algo``, ``KVCompressConfig`` in ``kv``, ...);
this module only composes them. Every field has a flag (``slime_sparse.flags``): slime's name where slime has
one (``--rollout-batch-size``, ``--eps-clip``, ``--kl-loss-type``, ...), else ``--<section prefix><field>``.
Precedence: dataclass defaults < preset < YAML (``--config``) < flags. Loading is one uniform path:
every source becomes ``{section: {field: value}}``, the layers are merged field by field, every section builds
itself from its dict (``build_section``), ``RunConfig.derived`` fills what one section takes from another, and
``RunConfig.validate`` checks each section and the rules between them. Reading flags and YAML (``load_config``,
``build_parser``, ``save_config``): ``slime_sparse.config_loader``.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from slime_sparse.algo.correction import CorrectionConfig
from slime_sparse.algo.loss import LossConfig
from slime_sparse.backends.megatron.config import MEGATRON_LM_TRACKER, MegatronConfig  # no megatron-core import
from slime_sparse.data.prompt_dataset import DataConfig
from slime_sparse.flags import SECTION_PREFIXES, flag_for
from slime_sparse.kv.config import METHODS as KV_METHODS, KVCompressConfig
from slime_sparse.reward import RewardConfig
from slime_sparse.rollout.filter_hub import load_filters
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.rollout.sglang.config import SGLangEngineConfig
from slime_sparse.utils.checkpoint import STATE_FILE
from slime_sparse.utils.lm_head import FP32_LM_HEAD_HELP

TRAIN_BACKENDS = ("embedded", "megatron")
ROLLOUT_ENGINES = ("embedded", "sglang")
ADVANTAGE_ESTIMATORS = ("grpo",)
# our former estimator name, kept as a spelling of slime's --disable-grpo-std-normalization
DR_GRPO = "dr_grpo"


@dataclass(frozen=True)
class RolloutConfig:
    SECTION: ClassVar[str] = "rollout"

    rollout_batch_size: int = field(default=128, metadata={"help": (
        "prompts per rollout (slime: required); 128 here, the paper's")})
    n_samples_per_prompt: int = field(default=8, metadata={"help": (
        "samples of each prompt, the GRPO group (slime's default 1); 8 here, the paper's")})
    engine: str = field(default="embedded", metadata={"help": (
        "embedded (pure PyTorch, in process or a Ray actor) | sglang (patched SGLang servers)")})
    max_batch_size: int = field(default=64, metadata={"help": (
        "sequences decoded at once per engine (embedded; with --rollout-kv-cache-gib, at most this many)")})
    kv_cache_gib: float | None = field(default=None, metadata={"help": (
        "embedded engine: KV memory for its cache; it decodes as many sequences at once as rows of the KV config's "
        "size fit (a compressed row holds --kv-budget + --kv-buffer slots, a dense one the whole sequence), at most "
        "--rollout-max-batch-size (SGLang's --mem-fraction-static with --max-running-requests)")})
    cuda_graph: bool = field(default=True, metadata={"help": (
        "embedded engine on CUDA: decode steps replay CUDA graphs (one per padded batch size, captured on first use); "
        "--disable-cuda-graph (SGLang's name) runs them eagerly. SGLang servers: --sglang-cuda-graph")})
    advantage_estimator: str = field(default="grpo", metadata={"help": (
        "grpo: A = (R - mean) / (std + 1e-6) over a prompt's samples; dr_grpo is accepted as the spelling of "
        "grpo with --disable-grpo-std-normalization")})
    grpo_std_normalization: bool = field(default=True, metadata={"help": (
        "divide GRPO advantages by the group's std; --disable-grpo-std-normalization: A = R - mean (Dr.GRPO)")})
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

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RolloutConfig":
        values = dict(values)
        if isinstance(values.get("dynamic_sampling_filter_path"), str):  # one path (YAML)
            values["dynamic_sampling_filter_path"] = (values["dynamic_sampling_filter_path"],)
        if values.get("advantage_estimator") == DR_GRPO:
            values.update(advantage_estimator="grpo", grpo_std_normalization=False)
        return cls(**values)

    @property
    def sampling_batch_size(self) -> int:
        """--over-sampling-batch-size as resolved: prompts the first generation round draws."""
        return self.over_sampling_batch_size or self.rollout_batch_size

    def validate(self) -> None:
        _positive(self, "rollout_batch_size", "n_samples_per_prompt", "max_batch_size", "dynamic_sampling_max_rounds")
        _non_negative(self, "dynamic_sampling_min_kept_samples")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"{_flag(self, 'kv_cache_gib')}={self.kv_cache_gib} must be > 0 (GiB of KV memory)")
        _choice(self, "engine", ROLLOUT_ENGINES)
        _choice(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)
        if self.n_samples_per_prompt == 1:
            # Refused, not warned: every advantage would be 0 and the run would train nothing (slime's std of one
            # sample is NaN; verl quietly drops the baseline and trains on the raw reward instead).
            raise ValueError(f"{_flag(self, 'n_samples_per_prompt')}=1 is invalid with "
                             f"{_flag(self, 'advantage_estimator')}={self.advantage_estimator}: its baseline is the "
                             "mean reward of each prompt's samples, so one sample per prompt gets advantage 0 and "
                             "nothing is learned; use >= 2")
        if self.sampling_batch_size < self.rollout_batch_size:
            raise ValueError(f"{_flag(self, 'over_sampling_batch_size')}={self.over_sampling_batch_size} must be >= "
                             f"{_flag(self, 'rollout_batch_size')}={self.rollout_batch_size} (slime's rule)")
        if self.dynamic_sampling_min_kept_samples > self.n_samples_per_prompt:
            raise ValueError(f"{_flag(self, 'dynamic_sampling_min_kept_samples')}={self.dynamic_sampling_min_kept_samples}"
                             f" exceeds {_flag(self, 'n_samples_per_prompt')}={self.n_samples_per_prompt}: every "
                             "group would be dropped")
        load_filters(self.dynamic_sampling_filter_path)  # a path that does not import fails here, naming the flag


LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    SECTION: ClassVar[str] = "train"

    hf_checkpoint: str = field(default="", metadata={"help": (
        "local Hugging Face model directory (weights + tokenizer); required")})
    train_backend: str = field(default="embedded", metadata={"help": (
        "embedded (plain PyTorch on the HF model) | megatron (megatron-core, tensor/pipeline parallel)")})
    num_rollout: int = field(default=100, metadata={"help": (
        "rollouts of the run (slime: computed from --num-epoch when unset); 100 here, the paper's")})
    global_batch_size: int = field(default=256, metadata={"help": (
        "samples per optimizer step; rollout samples / this = steps per rollout (slime: required); 256 here, the "
        "paper's")})
    use_dynamic_batch_size: bool | None = field(default=None, metadata={"help": (
        "micro-batches packed up to --max-tokens-per-gpu (padded) tokens, as in slime; off: --micro-batch-size "
        "samples each. Default: on unless --micro-batch-size is given (slime: off, i.e. one sample per micro-batch; "
        "here on because packing gives the same gradients with fewer forward passes)")})
    max_tokens_per_gpu: int = field(default=16384, metadata={"help": (
        "token budget of a micro-batch under dynamic batching, counted padded (rows x longest row: our learners "
        "pad, slime packs); also bounds the dense log-prob recompute (slime's --log-probs-max-tokens-per-gpu "
        "default). slime has no default (it is required there); 16384 here fits the CPU default and a 0.5B model")})
    micro_batch_size: int | None = field(default=None, metadata={"help": (
        "samples per micro-batch without dynamic batching (slime's default 1); ignored under "
        "--use-dynamic-batch-size, as in slime")})
    lr: float = field(default=1e-6, metadata={"help": "Adam learning rate (the paper's 1e-6)"})
    lr_decay_style: str = field(default="constant", metadata={"help": (
        "constant | linear | cosine, Megatron's schedules (from transformers on the embedded learner, Megatron's "
        "OptimizerParamScheduler on the Megatron one). slime inherits Megatron's default linear (to --min-lr over "
        "the run); constant here: the paper's setting, and what every slime RL script passes")})
    min_lr: float = field(default=0.0, metadata={"help": "the lr that linear / cosine decay ends at (Megatron's)"})
    lr_decay_iters: int | None = field(default=None, metadata={"help": (
        "optimizer steps over which linear / cosine decays (then --min-lr); default: all steps of the run, "
        "--num-rollout x steps per rollout, as slime")})
    lr_warmup_iters: int = field(default=0, metadata={"help": (
        "optimizer steps of linear warm-up from 0 to --lr (Megatron's: the first step runs at lr 0)")})
    weight_decay: float = field(default=0.1, metadata={"help": (
        "AdamW weight decay, not on biases and norms (Megatron's default 0.01); 0.1 here, the paper's and slime's "
        "scripts'")})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam beta1"})
    adam_beta2: float = field(default=0.98, metadata={"help": (
        "(Megatron's default 0.999); 0.98 here, the paper's and slime's scripts'")})
    clip_grad: float = field(default=1.0, metadata={"help": "gradient-norm clip, 0: none"})
    bf16: bool = field(default=False, metadata={"help": "bf16 weights and compute on the learner (fp32 otherwise)"})
    enable_fp32_lm_head: bool = field(default=False, metadata={"help": FP32_LM_HEAD_HELP})
    device: str = field(default="auto", metadata={"help": "auto (cuda when available) | cpu | cuda"})
    seed: int = field(default=42, metadata={"help": (
        "seed of initialisation, sampling and data order (slime's default 1234); 42 here, the seed of the results "
        "this repository reports")})
    load: str = field(default="", metadata={"help": (
        "resume from the newest checkpoint in this directory (or from this checkpoint directory itself), as "
        "slime's --load; a directory without a checkpoint starts a fresh run. Default: --save's directory, so a "
        "rerun command resumes (slime starts fresh without --load)")})
    save: str = field(default="", metadata={"help": "checkpoint directory; unset: <run-dir>/checkpoints"})
    save_interval: int = field(default=0, metadata={"help": (
        "rollouts between checkpoints, 0: only at the end (slime: unset, no checkpoints); here every run can resume")})
    keep_last: int = field(default=2, metadata={"help": "checkpoints kept (older ones are deleted)"})
    allow_config_change: bool = field(default=False, metadata={"help": (
        "resume a checkpoint although model, data, sampling, kv, loss or correction settings differ from its own "
        "(refused otherwise; schedule and logging flags may always change)")})
    eval_interval: int = field(default=0, metadata={"help": (
        "rollouts between evaluations, 0: only before and after training (slime: unset, no evaluation); with "
        "--eval-prompt-data here a run is always evaluated at both ends")})

    def validate(self) -> None:
        _choice(self, "train_backend", TRAIN_BACKENDS)
        _choice(self, "device", ("auto", "cpu", "cuda"))
        _choice(self, "lr_decay_style", LR_DECAY_STYLES)
        _positive(self, "num_rollout", "global_batch_size", "max_tokens_per_gpu", "keep_last", "lr")
        _non_negative(self, "weight_decay", "clip_grad", "lr_warmup_iters", "save_interval", "eval_interval", "min_lr")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{_flag(self, name)}={getattr(self, name)} is invalid: must lie in [0, 1)")
        if self.hf_checkpoint and not os.path.isdir(self.hf_checkpoint):
            raise ValueError(f"{_flag(self, 'hf_checkpoint')}={self.hf_checkpoint!r} is not a local directory")
        if self.micro_batch_size is not None:
            _positive(self, "micro_batch_size")
        self._validate_schedule()
        if self.load:
            self._validate_load()

    def _validate_schedule(self) -> None:
        if self.lr_decay_style == "constant":
            if self.min_lr:
                raise ValueError(f"{_flag(self, 'min_lr')}={self.min_lr} has no effect with "
                                 f"{_flag(self, 'lr_decay_style')} constant: choose linear or cosine")
            return
        if self.min_lr >= self.lr:
            raise ValueError(f"{_flag(self, 'min_lr')}={self.min_lr} must be below {_flag(self, 'lr')}={self.lr}")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(f"{_flag(self, 'lr_decay_iters')}={self.lr_decay_iters} must exceed "
                             f"{_flag(self, 'lr_warmup_iters')}={self.lr_warmup_iters} (decay follows warm-up)")

    def _validate_load(self) -> None:
        """--load is our training checkpoint (or a directory of them), or a directory with none yet (fresh start)."""
        flag = _flag(self, "load")
        if os.path.exists(self.load) and not os.path.isdir(self.load):
            raise ValueError(f"{flag}={self.load!r} is not a directory")
        if os.path.isfile(os.path.join(self.load, MEGATRON_LM_TRACKER)):
            raise ValueError(f"{flag}={self.load!r} is a Megatron-LM checkpoint: we resume only our own training "
                             f"checkpoints (a run starts from {_flag(self, 'hf_checkpoint')})")
        if os.path.isfile(os.path.join(self.load, "config.json")) and not os.path.isfile(
                os.path.join(self.load, STATE_FILE)):
            raise ValueError(f"{flag}={self.load!r} is a Hugging Face model, not a training checkpoint: start from it "
                             f"with {_flag(self, 'hf_checkpoint')}")

    @property
    def dynamic_batching(self) -> bool:
        """--use-dynamic-batch-size as resolved: on unless --micro-batch-size is given alone."""
        if self.use_dynamic_batch_size is not None:
            return self.use_dynamic_batch_size
        return self.micro_batch_size is None


@dataclass(frozen=True)
class EvalConfig:
    SECTION: ClassVar[str] = "eval"

    eval_prompt_data: tuple[str, ...] = field(default=(), metadata={"help": (
        "evaluation sets as slime's NAME PATH [NAME PATH ...] (each logged as eval_<mode>/<NAME>/...), or one "
        "bare PATH (logged as eval_<mode>/...); local jsonl / parquet; none: no evaluation")})
    n_samples_per_eval_prompt: int = field(default=1, metadata={"help": (
        "samples of each evaluation prompt (k of avg@k and pass@k)")})
    eval_max_prompts: int = field(default=0, metadata={"help": "first prompts of each evaluation set used, 0: all"})
    eval_temperature: float = field(default=0.0, metadata={"help": (
        "sampling temperature of evaluation; slime's default is the rollout's, here 0 (greedy) so that pass@1 "
        "is deterministic. Evaluated densely and, if on, under the rollout's compression")})
    eval_top_p: float | None = field(default=None, metadata={"help": "top-p of evaluation; unset: --rollout-top-p"})
    eval_top_k: int | None = field(default=None, metadata={"help": "top-k of evaluation; unset: --rollout-top-k"})
    eval_max_response_len: int | None = field(default=None, metadata={"help": (
        "response budget of evaluation; unset: --rollout-max-response-len")})
    eval_kv_method: str = field(default="", metadata={"help": (
        "evaluate \"sparse\" with this KV compression method and the --kv-* knobs even when rollouts are dense "
        "(a dense-trained policy under compressed inference); empty: the rollout's own compression")})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "EvalConfig":
        values = dict(values)
        if isinstance(values.get("eval_prompt_data"), str):  # one bare path (YAML, older configs)
            values["eval_prompt_data"] = (values["eval_prompt_data"],) if values["eval_prompt_data"] else ()
        return cls(**values)

    @property
    def datasets(self) -> list[tuple[str, str]]:
        """(name, path) of each evaluation set; a bare path has the name "" (its metrics keep the plain keys)."""
        data = self.eval_prompt_data
        if len(data) == 1:
            return [("", data[0])]
        return list(zip(data[::2], data[1::2]))

    def validate(self) -> None:
        _positive(self, "n_samples_per_eval_prompt")
        flag = _flag(self, "eval_prompt_data")
        if len(self.eval_prompt_data) > 1 and len(self.eval_prompt_data) % 2:
            raise ValueError(f"{flag} takes one PATH or NAME PATH pairs, got {len(self.eval_prompt_data)} values: "
                             f"{' '.join(self.eval_prompt_data)}")
        names = [name for name, _ in self.datasets]
        if len(set(names)) < len(names):
            raise ValueError(f"{flag} names each set once, got {names}")
        for name, path in self.datasets:
            if "/" in name or name.startswith("-"):
                raise ValueError(f"{flag}: {name!r} is not a set name (NAME PATH pairs: the name comes first)")
            if not os.path.exists(path):
                raise ValueError(f"{flag} {name + ' ' if name else ''}{path!r}: file does not exist")
        if self.eval_kv_method:
            _choice(self, "eval_kv_method", KV_METHODS[1:])  # "none" is no sparse evaluation: leave it empty
        if self.eval_max_response_len is not None:
            _positive(self, "eval_max_response_len")
        if self.eval_top_p is not None and not 0.0 < self.eval_top_p <= 1.0:
            raise ValueError(f"{_flag(self, 'eval_top_p')}={self.eval_top_p} must lie in (0, 1]")


WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class LogConfig:
    SECTION: ClassVar[str] = "log"

    run_dir: str = field(default="runs/default", metadata={"help": (
        "where config.yaml, metrics.jsonl, summary.json, TensorBoard events and (by default) checkpoints go")})
    use_tensorboard: bool = field(default=True, metadata={"help": (
        "TensorBoard events (and the run config as text) under <run-dir>/tensorboard; slime: off by default, here "
        "on so that every run's curves can be looked at (--no-use-tensorboard turns it off)")})
    use_wandb: bool = field(default=False, metadata={"help": "log to Weights & Biases"})
    wandb_project: str = field(default="slime_sparse", metadata={"help": "W&B project (slime: none, W&B's default)"})
    wandb_team: str | None = field(default=None, metadata={"help": "W&B entity"})
    wandb_group: str | None = field(default=None, metadata={"help": "W&B group of the run"})
    wandb_run_name: str | None = field(default=None, metadata={"help": (
        "W&B display name (slime names the run after --wandb-group)")})
    wandb_mode: str | None = field(default=None, metadata={"help": (
        "online | offline | disabled; unset: W&B's own (the WANDB_MODE variable, else online). offline writes "
        "the run under <run-dir>/wandb with no network (upload later with `wandb sync`)")})
    wandb_host: str | None = field(default=None, metadata={"help": (
        "W&B server URL (e.g. a local server); the API key comes from WANDB_API_KEY")})
    progress: bool = field(default=True, metadata={"help": "a progress bar over rollouts on stderr"})
    mismatch_metrics_interval: int = field(default=10, metadata={"help": (
        "rollouts between the mismatch diagnostics that cost an extra forward, from the first rollout on (0: "
        "never): the split of the mismatch into its sparsity and numeric parts (mismatch/sparsity/*, "
        "mismatch/numeric/*: one shadow forward under --loss-type sparse_rl, every rollout and free under shadow / "
        "smd) and, under --correction-bypass-mode without a rejection rule, the dense recompute itself "
        "(mismatch/*). That forward costs a fifth to a quarter of a step (benchmarks/mismatch_split_cost.py), so "
        "every 10th rollout: 2-3 percent on average. slime's --get-mismatch-metrics is 1")})

    def validate(self) -> None:
        if not self.run_dir:
            raise ValueError(f"{_flag(self, 'run_dir')} must not be empty")
        _non_negative(self, "mismatch_metrics_interval")
        if self.wandb_mode is not None:
            _choice(self, "wandb_mode", WANDB_MODES)
        if not self.use_wandb:
            unused = [_flag(self, n) for n in ("wandb_team", "wandb_group", "wandb_run_name", "wandb_mode", "wandb_host")
                      if getattr(self, n) is not None]
            if unused:
                raise ValueError(f"{', '.join(unused)} need {_flag(self, 'use_wandb')}")


UPDATE_WEIGHT_MODES = ("auto", "broadcast", "tensor")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the loop's learner and engines run: in this process (default) or as Ray actors (`--use-ray`).

    Layout flags are slime's. On a cluster without GPUs every "GPU" below is a CPU bundle of
    `ray_cpus_per_actor` CPUs, so `--actor-num-gpus-per-node 2` means two learner ranks per node.
    """

    SECTION: ClassVar[str] = "cluster"

    use_ray: bool = field(default=False, metadata={"help": "run the learner ranks and the engines as Ray actors"})
    ray_address: str = field(default="", metadata={"help": (
        "as ray.init(address=): unset finds a running cluster or starts one; local; host:port")})
    actor_num_nodes: int = field(default=1, metadata={"help": "nodes of learner ranks"})
    actor_num_gpus_per_node: int = field(default=1, metadata={"help": (
        "data-parallel learner ranks per node (slime's default 8); 1 here, which fits any machine")})
    rollout_num_gpus: int | None = field(default=None, metadata={"help": (
        "devices (bundles) for all rollout engines together; unset: the learner's with --colocate (slime's rule), "
        "else 1 (slime requires it then)")})
    rollout_num_gpus_per_engine: int = field(default=1, metadata={"help": "devices (bundles) of one rollout engine"})
    colocate: bool = field(default=False, metadata={"help": (
        "learner and engines share devices (engines release memory while the learner trains)")})
    ray_cpus_per_actor: float = field(default=1.0, metadata={"help": "CPUs in each bundle"})
    update_weight_mode: str = field(default="auto", metadata={"help": (
        "broadcast (torch.distributed) | tensor (object store) | auto: tensor iff --colocate")})
    update_weight_buffer_size: int = field(default=512 * 1024**2, metadata={"help": (
        "bytes per weight-broadcast bucket (slime's flag and default)")})
    ray_timeout_s: float = field(default=600.0, metadata={"help": (
        "seconds bounding every Ray call (placement, a whole rollout, a train step)")})
    rollout_max_restarts: int = field(default=3, metadata={"help": (
        "engine actors restarted per rollout before the run fails")})

    @property
    def num_learner_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        """--rollout-num-gpus as resolved."""
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.num_learner_ranks if self.colocate else 1

    @property
    def num_engines(self) -> int:
        return self.rollout_gpus // self.rollout_num_gpus_per_engine

    def validate(self) -> None:
        _positive(self, "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine",
                  "update_weight_buffer_size")
        if self.rollout_num_gpus is not None:
            _positive(self, "rollout_num_gpus")
        if self.rollout_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"{_flag(self, 'rollout_num_gpus')}={self.rollout_gpus} must be a multiple of "
                f"{_flag(self, 'rollout_num_gpus_per_engine')}={self.rollout_num_gpus_per_engine}"
            )
        _positive(self, "ray_cpus_per_actor", "ray_timeout_s")
        _non_negative(self, "rollout_max_restarts")
        _choice(self, "update_weight_mode", UPDATE_WEIGHT_MODES)


@dataclass(frozen=True)
class RunConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv: KVCompressConfig = field(default_factory=KVCompressConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    @classmethod
    def from_dict(cls, sections: Mapping[str, Mapping[str, Any]], source: str = "config") -> "RunConfig":
        """Every section built from its dict ({section: {field: value}}; a section left out keeps its defaults)."""
        check_sections(sections, source)
        return cls(**{name: build_section(name, sections.get(name, {}), source) for name in SECTIONS})

    def derived(self) -> "RunConfig":
        """This config with what one section takes from another (or from the model directory) filled in, once, at
        load time, so that nothing downstream rewrites the config:
        - Dr.GRPO's constant normaliser (`--loss-agg-mode seq-mean-token-sum-norm` without a norm_len): the
          generation budget, --rollout-max-response-len;
        - no --rollout-stop-token-ids: stop at the EOS of the tokenizer in --hf-checkpoint;
        - no --lr-decay-iters: every optimizer step of the run, --num-rollout x steps per rollout (slime's rule)."""
        loss, sampling, train = self.loss, self.sampling, self.train
        if loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.norm_len is None:
            loss = dataclasses.replace(loss, norm_len=sampling.max_new_tokens)
        if not sampling.stop_token_ids:
            eos = tokenizer_eos_id(self.train.hf_checkpoint)
            if eos is not None:
                sampling = dataclasses.replace(sampling, stop_token_ids=(eos,))
        if train.lr_decay_iters is None:
            train = dataclasses.replace(train, lr_decay_iters=train.num_rollout * self.steps_per_rollout)
        return dataclasses.replace(self, loss=loss, sampling=sampling, train=train)

    def validate(self) -> None:
        for section in SECTIONS:
            getattr(self, section).validate()
        if not self.data.prompt_data:
            raise ValueError(f"{flag_for('data', 'prompt_data')} is required: a local jsonl or parquet file of prompts")
        if not self.train.hf_checkpoint:
            raise ValueError(f"{flag_for('train', 'hf_checkpoint')} is required: a local Hugging Face model directory")
        if self.loss.distills and self.train.train_backend != "embedded":
            raise ValueError(f"{flag_for('loss', 'loss_type')} smd needs {flag_for('train', 'train_backend')} embedded "
                             "(a dense and a shadow forward per micro-batch; Megatron's learner runs shadow only)")
        if self.correction.bypass_mode and self.loss.trains_shadow:
            raise ValueError(f"{flag_for('correction', 'bypass_mode')} with {flag_for('loss', 'loss_type')} "
                             f"{self.loss.loss_type}: its PPO anchor is already the sampler's own policy (pi_shadow)")
        if self.megatron.load and self.train.train_backend != "megatron":
            raise ValueError(f"{flag_for('megatron', 'load')} (a Megatron checkpoint) needs "
                             f"{flag_for('train', 'train_backend')} megatron: the embedded learner starts from "
                             f"{flag_for('train', 'hf_checkpoint')}")
        if self.eval.eval_kv_method:  # the --kv-* knobs must fit the evaluation's method even when rollouts are dense
            dataclasses.replace(self.kv, method=self.eval.eval_kv_method).validate()
        self._validate_engine_kv()
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.global_batch_size:
            raise ValueError(
                f"{flag_for('train', 'global_batch_size')}={self.train.global_batch_size} must divide "
                f"{flag_for('rollout', 'rollout_batch_size')} x {flag_for('rollout', 'n_samples_per_prompt')} = "
                f"{samples}"
            )

    def _validate_engine_kv(self) -> None:
        """What the chosen rollout engine can express of the --kv-* settings (the embedded engine: all of them)."""
        if self.rollout.engine == "sglang":
            from sglang_patches.settings import check_sglang_kv_config  # no SGLang import: pure settings

            check_sglang_kv_config(self.kv)

    @property
    def steps_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt // self.train.global_batch_size

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(RunConfig))
if SECTIONS != tuple(SECTION_PREFIXES):
    raise RuntimeError(f"slime_sparse.flags.SECTION_PREFIXES {tuple(SECTION_PREFIXES)} must list {SECTIONS}")
SECTION_TYPES: dict[str, type] = {name: typing.get_type_hints(RunConfig)[name] for name in SECTIONS}
# files of a tokenizer saved by save_pretrained (one of them is enough for AutoTokenizer)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def tokenizer_eos_id(model_dir: str) -> int | None:
    """EOS id of the tokenizer in `model_dir`; None when the directory holds no tokenizer (a run cannot start
    there anyway: it loads the same tokenizer first)."""
    if not model_dir or not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    return None if eos is None else int(eos)


def field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def tuple_type(tp: Any) -> bool:
    """`tp` is a tuple annotation, or an optional one."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(tuple_type(a) for a in typing.get_args(tp))
    return typing.get_origin(tp) is tuple


def build_section(section: str, values: Mapping[str, Any], source: str = "config") -> Any:
    """Config section `section` from a dict of its fields, the same way for every section: unknown fields are an
    error, lists become tuples where the field is a tuple, and a section with its own `from_dict` (e.g. the
    correction, which starts from a preset) builds itself with it."""
    cls = SECTION_TYPES[section]
    names = {f.name for f in fields(cls)}
    for key in values:
        if key not in names:
            raise ValueError(f"{source}: unknown field {section}.{key}; allowed: {', '.join(sorted(names))}")
    typed = {key: tuple(val) if isinstance(val, list) and tuple_type(field_type(cls, key)) else val
             for key, val in values.items()}
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(typed) if from_dict is not None else cls(**typed)


def check_sections(raw: Mapping, source: str) -> Mapping[str, Mapping[str, Any]]:
    """`raw` is {section: {field: value}} over known sections."""
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ValueError(f"{source}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: section {section!r} must be a mapping")
    return raw


def _flag(section_obj: Any, name: str) -> str:
    """The flag of field `name` of a section defined here."""
    return flag_for(section_obj.SECTION, name)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{_flag(obj, name)}={getattr(obj, name)} is invalid: must be > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"{_flag(obj, name)}={getattr(obj, name)} is invalid: must be >= 0")


def _choice(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(obj, name) not in allowed:
        raise ValueError(f"{_flag(obj, name)}={getattr(obj, name)!r} is invalid: choose one of {allowed}")
