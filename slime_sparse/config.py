"""Typed run configuration: one dataclass per concern, YAML + command line, validated at load time.

Each component owns its config dataclass (``LossConfig`` in ``algo``, ``KVCompressConfig`` in ``kv``, ...);
this module only composes them and maps their fields to command-line flags. Flags follow slime where
slime has a name (``--rollout-batch-size``, ``--eps-clip``, ``--kl-loss-type``, ...); the rest are
``--<section prefix><field>``. Precedence: dataclass defaults < preset < YAML (``--config``) < flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from slime_sparse.algo.correction import CorrectionConfig
from slime_sparse.algo.loss import LossConfig
from slime_sparse.backends.megatron.learner import MegatronConfig  # megatron-core itself is imported only when used
from slime_sparse.data.prompt_dataset import DataConfig
from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.reward import RewardConfig
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.rollout.sglang.config import SGLangEngineConfig, split_passthrough

TRAIN_BACKENDS = ("embedded", "megatron")
ROLLOUT_ENGINES = ("embedded", "sglang")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int = 128  # prompts per rollout
    n_samples_per_prompt: int = 8
    engine: str = "embedded"
    max_batch_size: int = 64  # sequences decoded at once per engine
    advantage_estimator: str = "grpo"  # grpo: (R - mean) / (std + eps); dr_grpo: R - mean

    def validate(self) -> None:
        _positive(self, "rollout_batch_size", "--rollout-batch-size")
        _positive(self, "n_samples_per_prompt", "--n-samples-per-prompt")
        _positive(self, "max_batch_size", "--rollout-max-batch-size")
        _choice(self.engine, ROLLOUT_ENGINES, "--rollout-engine")
        _choice(self.advantage_estimator, ADVANTAGE_ESTIMATORS, "--advantage-estimator")


@dataclass(frozen=True)
class TrainConfig:
    hf_checkpoint: str = ""  # local HF model directory (weights + tokenizer)
    train_backend: str = "embedded"
    num_rollout: int = 100
    global_batch_size: int = 256  # samples per optimizer step; rollout samples / this = steps per rollout
    max_tokens_per_gpu: int = 16384  # micro-batch budget in (padded) tokens
    lr: float = 1e-6
    lr_warmup_iters: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    bf16: bool = False
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 42
    save: str = ""  # checkpoint directory; default <run_dir>/checkpoints
    save_interval: int = 0  # rollouts between checkpoints (0: only at the end)
    keep_last: int = 2
    eval_interval: int = 0  # rollouts between evaluations (0: only before and after)

    def validate(self) -> None:
        _choice(self.train_backend, TRAIN_BACKENDS, "--train-backend")
        _choice(self.device, ("auto", "cpu", "cuda"), "--device")
        for name, flag in [("num_rollout", "--num-rollout"), ("global_batch_size", "--global-batch-size"),
                           ("max_tokens_per_gpu", "--max-tokens-per-gpu"), ("keep_last", "--keep-last")]:
            _positive(self, name, flag)
        if self.lr <= 0:
            raise ValueError(f"--lr={self.lr} is invalid: must be > 0")
        for name, flag in [("weight_decay", "--weight-decay"), ("clip_grad", "--clip-grad"),
                           ("lr_warmup_iters", "--lr-warmup-iters"), ("save_interval", "--save-interval"),
                           ("eval_interval", "--eval-interval")]:
            if getattr(self, name) < 0:
                raise ValueError(f"{flag}={getattr(self, name)} is invalid: must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} is invalid: must lie in [0, 1)")
        if self.hf_checkpoint and not os.path.isdir(self.hf_checkpoint):
            raise ValueError(f"--hf-checkpoint={self.hf_checkpoint!r} is not a local directory")


@dataclass(frozen=True)
class EvalConfig:
    eval_prompt_data: str = ""  # local jsonl/parquet; empty: no evaluation
    n_samples_per_eval_prompt: int = 1
    eval_max_prompts: int = 0  # 0: all
    eval_temperature: float = 0.0  # greedy by default; evaluated densely and, if on, under the rollout's compression

    def validate(self) -> None:
        _positive(self, "n_samples_per_eval_prompt", "--n-samples-per-eval-prompt")
        if self.eval_prompt_data and not os.path.exists(self.eval_prompt_data):
            raise ValueError(f"--eval-prompt-data={self.eval_prompt_data!r} does not exist")


@dataclass(frozen=True)
class LogConfig:
    run_dir: str = "runs/default"
    use_tensorboard: bool = True
    use_wandb: bool = False
    wandb_project: str = "slime_sparse"
    progress: bool = True

    def validate(self) -> None:
        if not self.run_dir:
            raise ValueError("--run-dir must not be empty")


UPDATE_WEIGHT_MODES = ("auto", "broadcast", "tensor")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the loop's learner and engines run: in this process (default) or as Ray actors (`--use-ray`).

    Layout flags are slime's. On a cluster without GPUs every "GPU" below is a CPU bundle of
    `ray_cpus_per_actor` CPUs, so `--actor-num-gpus-per-node 2` means two learner ranks per node.
    """

    use_ray: bool = False
    ray_address: str = ""  # as ray.init(address=): "" finds a running cluster or starts one; "local"; "host:port"
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1  # data-parallel learner ranks per node
    rollout_num_gpus: int = 1  # devices (bundles) for all rollout engines together
    rollout_num_gpus_per_engine: int = 1
    colocate: bool = False  # learner and engines share devices (engines release memory while the learner trains)
    ray_cpus_per_actor: float = 1.0  # CPUs in each bundle
    update_weight_mode: str = "auto"  # broadcast (torch.distributed) | tensor (object store) | auto: tensor iff colocated
    update_weight_buffer_size: int = 512 * 1024**2  # bytes per broadcast bucket (slime's flag and default)
    ray_timeout_s: float = 600.0  # bound on every Ray call (placement, a whole rollout, a train step)
    rollout_max_restarts: int = 3  # engine actors restarted per generate() call before the run fails

    @property
    def num_learner_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine

    def validate(self) -> None:
        for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine",
                     "update_weight_buffer_size"):
            _positive(self, name, flag_for("cluster", name))
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"--rollout-num-gpus={self.rollout_num_gpus} must be a multiple of "
                f"--rollout-num-gpus-per-engine={self.rollout_num_gpus_per_engine}"
            )
        _positive(self, "ray_cpus_per_actor", "--ray-cpus-per-actor")
        _positive(self, "ray_timeout_s", "--ray-timeout")
        if self.rollout_max_restarts < 0:
            raise ValueError(f"--rollout-max-restarts={self.rollout_max_restarts} is invalid: must be >= 0")
        _choice(self.update_weight_mode, UPDATE_WEIGHT_MODES, "--update-weight-mode")


@dataclass(frozen=True)
class RunConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv: KVCompressConfig = field(default_factory=KVCompressConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(prompt_data=""))
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    def validate(self) -> None:
        for section in SECTIONS:
            getattr(self, section).validate()
        if not self.data.prompt_data:
            raise ValueError("--prompt-data is required: a local jsonl or parquet file of prompts")
        if not self.train.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: a local Hugging Face model directory")
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.global_batch_size:
            raise ValueError(
                f"--global-batch-size={self.train.global_batch_size} must divide --rollout-batch-size x "
                f"--n-samples-per-prompt = {samples}"
            )

    @property
    def steps_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt // self.train.global_batch_size

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


# section name -> flag prefix for fields without an explicit alias
SECTIONS: dict[str, str] = {
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
# fields that no flag sets (filled by the loop or by `--sglang-*` pass-through)
NO_FLAG = {"correction.preset", "sglang.model_path", "sglang.extra_args"}

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
    return FLAG_ALIASES.get(f"{section}.{name}", "--" + SECTIONS[section] + name.replace("_", "-").removeprefix(
        SECTIONS[section]))


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _parse_value(tp: Any, raw: str, flag: str) -> Any:
    """Turn a command-line string into a value of annotation `tp` (int, float, str, bool, Optional, tuple)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            return None
        return _parse_value(args[0], raw, flag)
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        return tuple(_parse_value(elem, x, flag) for x in raw.replace(",", " ").split())
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{flag}={raw!r} is not a boolean")
    try:
        return tp(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}={raw!r} is not a valid {getattr(tp, '__name__', tp)}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-sparse-train", description="Sparse-RL training (GRPO on compressed-KV rollouts)",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file: {section: {field: value}} (sections: %s)" % ", ".join(SECTIONS))
    parser.add_argument("--correction-preset", help="none | paper | mis (knobs set by other --correction-* flags win)")
    seen: dict[str, str] = {}
    default = RunConfig.__dataclass_fields__
    for section in SECTIONS:
        cls = default[section].default_factory().__class__
        for f in fields(cls):
            if f"{section}.{f.name}" in NO_FLAG:
                continue
            flag = flag_for(section, f.name)
            if flag in seen:
                raise RuntimeError(f"flag {flag} is claimed by {seen[flag]} and {section}.{f.name}")
            seen[flag] = f"{section}.{f.name}"
            tp = _field_type(cls, f.name)
            if tp is bool:
                parser.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction)
            else:
                parser.add_argument(flag, dest=f"{section}.{f.name}", metavar=_metavar(tp))
    return parser


def _metavar(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).upper().replace(" ", "")


def _section_values(raw: dict, source: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, values in (raw or {}).items():
        if section == "correction_preset":
            out.setdefault("correction", {})["preset"] = values
            continue
        if section not in SECTIONS:
            raise ValueError(f"{source}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"{source}: section {section!r} must be a mapping")
        out[section] = dict(values)
    return out


def _build_section(section: str, cls: type, values: dict[str, Any], source: str) -> Any:
    names = {f.name for f in fields(cls)}
    for key in values:
        if key not in names:
            raise ValueError(f"{source}: unknown field {section}.{key}; allowed: {', '.join(sorted(names))}")
    if section == "correction":
        values = dict(values)
        preset = values.pop("preset", "none")
        return CorrectionConfig.from_preset(preset, **values)
    typed = {}
    for key, val in values.items():
        tp = _field_type(cls, key)
        if typing.get_origin(tp) is tuple and isinstance(val, list):
            val = tuple(val)
        typed[key] = val
    return cls(**typed)


def load_config(argv: list[str] | None = None, *, base: dict | None = None) -> RunConfig:
    """Parse flags (and the YAML they name) into a validated RunConfig. `base` is a preset dict of sections."""
    parser = build_parser()
    # like slime: any --sglang-X that is not ours goes to every SGLang server as --X
    argv, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv),
                                          {o for a in parser._actions for o in a.option_strings})
    args = vars(parser.parse_args(argv))
    merged = _section_values(base or {}, "preset")
    if "config" in args:
        path = args.pop("config")
        if not os.path.isfile(path):
            raise ValueError(f"--config={path!r} does not exist")
        with open(path, encoding="utf-8") as fh:
            for section, values in _section_values(yaml.safe_load(fh) or {}, path).items():
                merged.setdefault(section, {}).update(values)
    if "correction_preset" in args:
        merged.setdefault("correction", {})["preset"] = args.pop("correction_preset")
    if passthrough:
        merged.setdefault("sglang", {})["extra_args"] = tuple(passthrough)
    defaults = RunConfig()
    for dest, raw in args.items():
        section, name = dest.split(".", 1)
        cls = type(getattr(defaults, section))
        value = raw if isinstance(raw, bool) else _parse_value(_field_type(cls, name), raw, flag_for(section, name))
        merged.setdefault(section, {})[name] = value
    built = {}
    for section in SECTIONS:
        cls = type(getattr(defaults, section))
        values = merged.get(section, {})
        if section == "data":
            values = {"prompt_data": "", **values}
        built[section] = _build_section(section, cls, values, "config") if values else getattr(defaults, section)
    if built["loss"].loss_agg_mode == "seq-mean-token-sum-norm" and built["loss"].norm_len is None:
        # Dr.GRPO's constant normaliser: the generation budget
        built["loss"] = dataclasses.replace(built["loss"], norm_len=built["sampling"].max_new_tokens)
    cfg = RunConfig(**built)
    cfg.validate()
    return cfg


def save_config(cfg: RunConfig, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)


def _positive(obj: Any, name: str, flag: str) -> None:
    if getattr(obj, name) <= 0:
        raise ValueError(f"{flag}={getattr(obj, name)} is invalid: must be > 0")


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> None:
    if value not in allowed:
        raise ValueError(f"{flag}={value!r} is invalid: choose one of {allowed}")
