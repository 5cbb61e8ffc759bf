"""Typed run configuration: one dataclass per concern, YAML + command line, validated at load time.

Each component owns its config section (``LossConfig`` in ``algo``, ``KVCompressConfig`` in ``kv``, ...);
this module only composes them. Every field has a flag (``slime_sparse.flags``): slime's name where slime has
one (``--rollout-batch-size``, ``--eps-clip``, ``--kl-loss-type``, ...), else ``--<section prefix><field>``.
Precedence: dataclass defaults < preset < YAML (``--config``) < flags. Loading is one uniform path:
every source becomes ``{section: {field: value}}``, the layers are merged field by field, every section builds
itself from its dict (``build_section``), ``RunConfig.derived`` fills what one section takes from another, and
``RunConfig.validate`` checks each section and the rules between them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

import yaml

from slime_sparse.algo.correction import CorrectionConfig
from slime_sparse.algo.loss import LossConfig
from slime_sparse.backends.megatron.config import MegatronConfig  # megatron-core itself is imported only when used
from slime_sparse.data.prompt_dataset import DataConfig
from slime_sparse.flags import NO_FLAG, PASSTHROUGH_FIELD, SECTION_PREFIXES, flag_for
from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.reward import RewardConfig
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.rollout.sglang.config import SGLangEngineConfig, split_passthrough

TRAIN_BACKENDS = ("embedded", "megatron")
ROLLOUT_ENGINES = ("embedded", "sglang")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")


@dataclass(frozen=True)
class RolloutConfig:
    SECTION: ClassVar[str] = "rollout"

    rollout_batch_size: int = 128  # prompts per rollout
    n_samples_per_prompt: int = 8
    engine: str = "embedded"
    max_batch_size: int = 64  # sequences decoded at once per engine
    advantage_estimator: str = "grpo"  # grpo: (R - mean) / (std + eps); dr_grpo: R - mean

    def validate(self) -> None:
        _positive(self, "rollout_batch_size", "n_samples_per_prompt", "max_batch_size")
        _choice(self, "engine", ROLLOUT_ENGINES)
        _choice(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)


@dataclass(frozen=True)
class TrainConfig:
    SECTION: ClassVar[str] = "train"

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
        _choice(self, "train_backend", TRAIN_BACKENDS)
        _choice(self, "device", ("auto", "cpu", "cuda"))
        _positive(self, "num_rollout", "global_batch_size", "max_tokens_per_gpu", "keep_last", "lr")
        _non_negative(self, "weight_decay", "clip_grad", "lr_warmup_iters", "save_interval", "eval_interval")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{_flag(self, name)}={getattr(self, name)} is invalid: must lie in [0, 1)")
        if self.hf_checkpoint and not os.path.isdir(self.hf_checkpoint):
            raise ValueError(f"{_flag(self, 'hf_checkpoint')}={self.hf_checkpoint!r} is not a local directory")


@dataclass(frozen=True)
class EvalConfig:
    SECTION: ClassVar[str] = "eval"

    eval_prompt_data: str = ""  # local jsonl/parquet; empty: no evaluation
    n_samples_per_eval_prompt: int = 1
    eval_max_prompts: int = 0  # 0: all
    eval_temperature: float = 0.0  # greedy by default; evaluated densely and, if on, under the rollout's compression

    def validate(self) -> None:
        _positive(self, "n_samples_per_eval_prompt")
        if self.eval_prompt_data and not os.path.exists(self.eval_prompt_data):
            raise ValueError(f"{_flag(self, 'eval_prompt_data')}={self.eval_prompt_data!r} does not exist")


@dataclass(frozen=True)
class LogConfig:
    SECTION: ClassVar[str] = "log"

    run_dir: str = "runs/default"
    use_tensorboard: bool = True
    use_wandb: bool = False
    wandb_project: str = "slime_sparse"
    progress: bool = True

    def validate(self) -> None:
        if not self.run_dir:
            raise ValueError(f"{_flag(self, 'run_dir')} must not be empty")


UPDATE_WEIGHT_MODES = ("auto", "broadcast", "tensor")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the loop's learner and engines run: in this process (default) or as Ray actors (`--use-ray`).

    Layout flags are slime's. On a cluster without GPUs every "GPU" below is a CPU bundle of
    `ray_cpus_per_actor` CPUs, so `--actor-num-gpus-per-node 2` means two learner ranks per node.
    """

    SECTION: ClassVar[str] = "cluster"

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
        _positive(self, "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus",
                  "rollout_num_gpus_per_engine", "update_weight_buffer_size")
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"{_flag(self, 'rollout_num_gpus')}={self.rollout_num_gpus} must be a multiple of "
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
        _check_sections(sections, source)
        return cls(**{name: build_section(name, sections.get(name, {}), source) for name in SECTIONS})

    def derived(self) -> "RunConfig":
        """This config with what one section takes from another (or from the model directory) filled in, once, at
        load time, so that nothing downstream rewrites the config:
        - Dr.GRPO's constant normaliser (`--loss-agg-mode seq-mean-token-sum-norm` without a norm_len): the
          generation budget, --rollout-max-response-len;
        - no --rollout-stop-token-ids: stop at the EOS of the tokenizer in --hf-checkpoint."""
        loss, sampling = self.loss, self.sampling
        if loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.norm_len is None:
            loss = dataclasses.replace(loss, norm_len=sampling.max_new_tokens)
        if not sampling.stop_token_ids:
            eos = tokenizer_eos_id(self.train.hf_checkpoint)
            if eos is not None:
                sampling = dataclasses.replace(sampling, stop_token_ids=(eos,))
        return dataclasses.replace(self, loss=loss, sampling=sampling)

    def validate(self) -> None:
        for section in SECTIONS:
            getattr(self, section).validate()
        if not self.data.prompt_data:
            raise ValueError(f"{flag_for('data', 'prompt_data')} is required: a local jsonl or parquet file of prompts")
        if not self.train.hf_checkpoint:
            raise ValueError(f"{flag_for('train', 'hf_checkpoint')} is required: a local Hugging Face model directory")
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.global_batch_size:
            raise ValueError(
                f"{flag_for('train', 'global_batch_size')}={self.train.global_batch_size} must divide "
                f"{flag_for('rollout', 'rollout_batch_size')} x {flag_for('rollout', 'n_samples_per_prompt')} = "
                f"{samples}"
            )

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


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _tuple_type(tp: Any) -> bool:
    """`tp` is a tuple annotation, or an optional one."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_tuple_type(a) for a in typing.get_args(tp))
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
    typed = {key: tuple(val) if isinstance(val, list) and _tuple_type(_field_type(cls, key)) else val
             for key, val in values.items()}
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(typed) if from_dict is not None else cls(**typed)


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
    seen: dict[str, str] = {}
    for section in SECTIONS:
        cls = SECTION_TYPES[section]
        for f in fields(cls):
            if f"{section}.{f.name}" in NO_FLAG:
                continue
            flag = flag_for(section, f.name)
            if flag in seen:
                raise RuntimeError(f"flag {flag} is claimed by {seen[flag]} and {section}.{f.name}")
            seen[flag] = f"{section}.{f.name}"
            tp = _field_type(cls, f.name)
            helptext = f.metadata.get("help")
            if tp is bool:
                parser.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction,
                                    help=helptext)
            else:
                parser.add_argument(flag, dest=f"{section}.{f.name}", metavar=_metavar(tp), help=helptext)
    return parser


def _metavar(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).upper().replace(" ", "")


def _check_sections(raw: Mapping, source: str) -> Mapping[str, Mapping[str, Any]]:
    """`raw` is {section: {field: value}} over known sections."""
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ValueError(f"{source}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: section {section!r} must be a mapping")
    return raw


def _read_yaml(path: str) -> Mapping[str, Mapping[str, Any]]:
    if not os.path.isfile(path):
        raise ValueError(f"--config={path!r} does not exist")
    with open(path, encoding="utf-8") as fh:
        return _check_sections(yaml.safe_load(fh) or {}, path)


def _flag_values(args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{section: {field: typed value}} of the parsed flags (dest "section.field")."""
    out: dict[str, dict[str, Any]] = {}
    for dest, raw in args.items():
        section, name = dest.split(".", 1)
        tp = _field_type(SECTION_TYPES[section], name)
        out.setdefault(section, {})[name] = raw if isinstance(raw, bool) else _parse_value(tp, raw, flag_for(section, name))
    return out


def load_config(argv: list[str] | None = None, *, base: dict | None = None) -> RunConfig:
    """Parse flags (and the YAML they name) into a validated RunConfig. `base` is a preset dict of sections."""
    parser = build_parser()
    # like slime: any --sglang-X that is not ours goes to every SGLang server as --X
    argv, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv),
                                          {o for a in parser._actions for o in a.option_strings})
    args = vars(parser.parse_args(argv))
    layers = [_check_sections(base or {}, "preset")]
    if "config" in args:
        layers.append(_read_yaml(args.pop("config")))
    layers.append(_flag_values(args))
    if passthrough:
        section, name = PASSTHROUGH_FIELD.split(".")
        layers.append({section: {name: tuple(passthrough)}})
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:  # later layers win, field by field
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    cfg = RunConfig.from_dict(merged).derived()
    cfg.validate()
    return cfg


def save_config(cfg: RunConfig, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)


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
