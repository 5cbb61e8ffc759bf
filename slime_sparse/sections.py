"""The run's own config sections: what to train (train), evaluation (eval), logging (log) and where the learner
and engines run (cluster). The components' sections live with them (`RolloutConfig` in rollout, `LossConfig` in
algo, `KVCompressConfig` in kv, ...); slime_sparse.config composes them all into RunConfig.

Each section checks its values in `validate` (pure: run once when the config is built) and, where its values
name files or modules, those in `check_inputs` (at start-up, by slime_sparse.startup: building a config touches
no file and imports no user module).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from slime_sparse.backends.megatron.config import MEGATRON_LM_TRACKER  # no megatron-core import
from slime_sparse.flags import choice, flag, non_negative, positive
from slime_sparse.kv.config import METHODS as KV_METHODS
from slime_sparse.utils.checkpoint import STATE_FILE
from slime_sparse.utils.lm_head import FP32_LM_HEAD_HELP

TRAIN_BACKENDS = ("embedded", "megatron")
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
        "micro-batches of similar length up to --max-tokens-per-gpu (padded) tokens, as in slime; off: "
        "--micro-batch-size samples each. Default: on unless --micro-batch-size is given (slime: off, i.e. one "
        "sample per micro-batch; here on because packing gives the same gradients with fewer forward passes)")})
    max_tokens_per_gpu: int = field(default=16384, metadata={"help": (
        "token budget of a micro-batch under dynamic batching, counted padded (rows x longest row: our learners "
        "pad, slime packs); also bounds the dense log-prob recompute (slime's --log-probs-max-tokens-per-gpu "
        "default). slime has no default (it is required there); 16384 here fits the CPU default and a 0.5B model")})
    micro_batch_size: int | None = field(default=None, metadata={"help": (
        "samples per micro-batch without dynamic batching (slime's default 1); ignored under "
        "--use-dynamic-batch-size, as in slime")})
    recompute_granularity: str | None = field(default=None, metadata={"help": (
        "activation recompute, Megatron's (and slime's) flag: full keeps only each layer's input for backward and "
        "recomputes the rest (the embedded learner: torch's checkpoint per decoder layer; Megatron: by "
        "--recompute-method); selective (Megatron only) recomputes the core attention. Unset: none. "
        "tools/plan_memory.py shows what each saves")})
    recompute_method: str | None = field(default=None, metadata={"help": (
        "with --recompute-granularity full: uniform (every layer's input kept, Megatron's chunks of "
        "--recompute-num-layers layers; the embedded learner: chunks of 1) | block (only the first "
        "--recompute-num-layers layers recomputed, the rest keep everything). Default uniform")})
    recompute_num_layers: int | None = field(default=None, metadata={"help": (
        "layers per recomputed chunk (uniform) or recomputed layers (block); default 1 with full")})
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
    threads: int | None = field(default=None, metadata={"help": (
        "torch's CPU threads for training and evaluation; unset: one per 50M parameters of --hf-checkpoint, within "
        "[1, the cores this process may use] (slime_sparse/utils/threads.py), written into config.yaml as resolved "
        "so that a saved config reruns at the same speed")})
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
        choice(self, "train_backend", TRAIN_BACKENDS)
        choice(self, "device", ("auto", "cpu", "cuda"))
        choice(self, "lr_decay_style", LR_DECAY_STYLES)
        positive(self, "num_rollout", "global_batch_size", "max_tokens_per_gpu", "keep_last", "lr")
        non_negative(self, "weight_decay", "clip_grad", "lr_warmup_iters", "save_interval", "eval_interval", "min_lr")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{flag(self, name)}={getattr(self, name)} is invalid: must lie in [0, 1)")
        if self.micro_batch_size is not None:
            positive(self, "micro_batch_size")
        if self.threads is not None:
            positive(self, "threads")
        self._validate_schedule()
        self._validate_recompute()

    def _validate_schedule(self) -> None:
        if self.lr_decay_style == "constant":
            if self.min_lr:
                raise ValueError(f"{flag(self, 'min_lr')}={self.min_lr} has no effect with "
                                 f"{flag(self, 'lr_decay_style')} constant: choose linear or cosine")
            return
        if self.min_lr >= self.lr:
            raise ValueError(f"{flag(self, 'min_lr')}={self.min_lr} must be below {flag(self, 'lr')}={self.lr}")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(f"{flag(self, 'lr_decay_iters')}={self.lr_decay_iters} must exceed "
                             f"{flag(self, 'lr_warmup_iters')}={self.lr_warmup_iters} (decay follows warm-up)")

    def _validate_recompute(self) -> None:
        granularity = self.recompute_granularity
        if granularity is None:
            unused = [flag(self, n) for n in ("recompute_method", "recompute_num_layers") if getattr(self, n) is not None]
            if unused:
                raise ValueError(f"{', '.join(unused)} need {flag(self, 'recompute_granularity')} full")
            return
        choice(self, "recompute_granularity", ("full", "selective"))
        if granularity == "selective" and (self.recompute_method or self.recompute_num_layers):
            raise ValueError(f"{flag(self, 'recompute_method')} / {flag(self, 'recompute_num_layers')} go with "
                             f"{flag(self, 'recompute_granularity')} full (selective recomputes the core attention)")
        if self.recompute_method is not None:
            choice(self, "recompute_method", ("uniform", "block"))
        if self.recompute_num_layers is not None:
            positive(self, "recompute_num_layers")
        if self.train_backend == "embedded":
            if granularity == "selective":
                raise ValueError(f"{flag(self, 'recompute_granularity')} selective is Megatron's (its core "
                                 "attention); the embedded learner recomputes whole layers: use full")
            if (self.recompute_method or "uniform") == "uniform" and (self.recompute_num_layers or 1) != 1:
                raise ValueError(f"{flag(self, 'recompute_num_layers')}={self.recompute_num_layers} with uniform "
                                 "recompute: the embedded learner checkpoints every decoder layer on its own (1)")

    def check_inputs(self) -> None:
        """--hf-checkpoint is a local directory; --load is our training checkpoint (or a directory of them), or a
        directory with none yet (a fresh start)."""
        if self.hf_checkpoint and not os.path.isdir(self.hf_checkpoint):
            raise ValueError(f"{flag(self, 'hf_checkpoint')}={self.hf_checkpoint!r} is not a local directory")
        if not self.load:
            return
        load = flag(self, "load")
        if os.path.exists(self.load) and not os.path.isdir(self.load):
            raise ValueError(f"{load}={self.load!r} is not a directory")
        if os.path.isfile(os.path.join(self.load, MEGATRON_LM_TRACKER)):
            raise ValueError(f"{load}={self.load!r} is a Megatron-LM checkpoint: we resume only our own training "
                             f"checkpoints (a run starts from {flag(self, 'hf_checkpoint')})")
        if os.path.isfile(os.path.join(self.load, "config.json")) and not os.path.isfile(
                os.path.join(self.load, STATE_FILE)):
            raise ValueError(f"{load}={self.load!r} is a Hugging Face model, not a training checkpoint: start from it "
                             f"with {flag(self, 'hf_checkpoint')}")

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
        positive(self, "n_samples_per_eval_prompt")
        data_flag = flag(self, "eval_prompt_data")
        if len(self.eval_prompt_data) > 1 and len(self.eval_prompt_data) % 2:
            raise ValueError(f"{data_flag} takes one PATH or NAME PATH pairs, got {len(self.eval_prompt_data)} values: "
                             f"{' '.join(self.eval_prompt_data)}")
        names = [name for name, _ in self.datasets]
        if len(set(names)) < len(names):
            raise ValueError(f"{data_flag} names each set once, got {names}")
        for name, path in self.datasets:
            if "/" in name or name.startswith("-"):
                raise ValueError(f"{data_flag}: {name!r} is not a set name (NAME PATH pairs: the name comes first)")
        if self.eval_kv_method:
            choice(self, "eval_kv_method", KV_METHODS[1:])  # "none" is no sparse evaluation: leave it empty
        if self.eval_max_response_len is not None:
            positive(self, "eval_max_response_len")
        if self.eval_top_p is not None and not 0.0 < self.eval_top_p <= 1.0:
            raise ValueError(f"{flag(self, 'eval_top_p')}={self.eval_top_p} must lie in (0, 1]")

    def check_inputs(self) -> None:
        for name, path in self.datasets:
            if not os.path.exists(path):
                named = f"{name} " if name else ""
                raise ValueError(f"{flag(self, 'eval_prompt_data')} {named}{path!r}: file does not exist")


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
            raise ValueError(f"{flag(self, 'run_dir')} must not be empty")
        non_negative(self, "mismatch_metrics_interval")
        if self.wandb_mode is not None:
            choice(self, "wandb_mode", WANDB_MODES)
        if not self.use_wandb:
            unused = [flag(self, n) for n in ("wandb_team", "wandb_group", "wandb_run_name", "wandb_mode", "wandb_host")
                      if getattr(self, n) is not None]
            if unused:
                raise ValueError(f"{', '.join(unused)} need {flag(self, 'use_wandb')}")


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
    offload_rollout: bool | None = field(default=None, metadata={"help": (
        "the engines give back their KV cache and CUDA graphs (SGLang: its memory saver's regions) while the "
        "learner recomputes, trains and updates their weights, and take them again before generating (slime's). "
        "Default: on where learner and engines share devices (--colocate, as slime turns it on, or the embedded "
        "engine without --use-ray)")})
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
        positive(self, "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine",
                  "update_weight_buffer_size")
        if self.rollout_num_gpus is not None:
            positive(self, "rollout_num_gpus")
        if self.rollout_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"{flag(self, 'rollout_num_gpus')}={self.rollout_gpus} must be a multiple of "
                f"{flag(self, 'rollout_num_gpus_per_engine')}={self.rollout_num_gpus_per_engine}"
            )
        positive(self, "ray_cpus_per_actor", "ray_timeout_s")
        non_negative(self, "rollout_max_restarts")
        choice(self, "update_weight_mode", UPDATE_WEIGHT_MODES)
