"""Typed run configuration: one dataclass per concern, composed into RunConfig, validated once when it is built.

Each component owns its config section (``RolloutConfig`` in ``rollout``, ``LossConfig`` in ``algo``,
``KVCompressConfig`` in ``kv``, the run's own train / eval / log / cluster in ``slime_sparse.sections``); this
module only composes them. Every
field has a flag (``slime_sparse.flags``): slime's name where slime has one (``--rollout-batch-size``,
``--eps-clip``, ``--kl-loss-type``, ...), else ``--<section prefix><field>``. Precedence: dataclass defaults <
preset < YAML (``--config``) < flags.

Building is one uniform path and pure (it reads no file and imports no user module): every source becomes
``{section: {field: value}}``, each section builds itself from its dict (``build_section``), ``derive`` fills what
one section takes from another, and ``validate`` checks every section and the rules between them, once. What the
values name on disk or as modules (the model directory, data files, user functions, what the engine can run) is
checked at start-up: ``slime_sparse.startup``. Reading flags and YAML (``load_config``, ``build_parser``,
``save_config``): ``slime_sparse.config_loader``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from slime_sparse.algo.advantages import check_composition
from slime_sparse.algo.correction import CorrectionConfig
from slime_sparse.algo.loss import LossConfig
from slime_sparse.backends.megatron.config import MegatronConfig  # no megatron-core import
from slime_sparse.data.prompt_dataset import DataConfig
from slime_sparse.drift_config import DriftConfig
from slime_sparse.flags import SECTION_PREFIXES, flag_for
from slime_sparse.reward import RewardConfig
from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.overlap_config import OverlapConfig
from slime_sparse.rollout.base_types import RolloutPlan
from slime_sparse.rollout.config import RolloutConfig
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.rollout.sglang.config import SGLangEngineConfig
from slime_sparse.sections import ClusterConfig, EvalConfig, LogConfig, TrainConfig

__all__ = ["ClusterConfig", "EvalConfig", "LogConfig", "RolloutConfig", "RunConfig", "SECTIONS", "SECTION_TYPES",
           "TrainConfig", "build_section", "check_sections"]


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
    drift: DriftConfig = field(default_factory=DriftConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)

    @classmethod
    def from_dict(cls, sections: Mapping[str, Mapping[str, Any]], source: str = "config") -> "RunConfig":
        """The validated config of {section: {field: value}} (a section left out keeps its defaults)."""
        check_sections(sections, source)
        cfg = cls(**{name: build_section(name, sections.get(name, {}), source) for name in SECTIONS}).derive()
        cfg.validate()
        return cfg

    def derive(self) -> "RunConfig":
        """This config with what one section takes from another filled in, once, so that nothing downstream
        rewrites the config:
        - Dr.GRPO's constant normaliser (`--loss-agg-mode seq-mean-token-sum-norm` without a norm_len): the
          generation budget, --rollout-max-response-len;
        - no --lr-decay-iters: every optimizer step of the run, --num-rollout x steps per rollout (slime's rule);
        - --advantage-estimator gspo: the loss's PPO ratio is one per sequence (`LossConfig.ratio_level`);
          cispo: the loss is CISPO's (`LossConfig.policy_loss_mode`).
        (What comes from the model directory, the stop ids, is filled at start-up: slime_sparse.startup.)"""
        loss, train = self.loss, self.train
        if loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.norm_len is None:
            loss = dataclasses.replace(loss, norm_len=self.sampling.max_new_tokens)
        if self.rollout.advantage_spec.sequence_ratio:
            loss = dataclasses.replace(loss, ratio_level="sequence")
        loss = dataclasses.replace(loss, policy_loss_mode=self.rollout.advantage_spec.policy_loss_mode)
        if train.lr_decay_iters is None and train.global_batch_size > 0:  # (a bad batch size: validate says so)
            train = dataclasses.replace(train, lr_decay_iters=train.num_rollout * self.steps_per_rollout)
        return dataclasses.replace(self, loss=loss, train=train)

    def validate(self) -> None:
        """Every section's own rules, then the rules between sections (ValueError naming the flag)."""
        for section in SECTIONS:
            getattr(self, section).validate()
        check_composition(self.rollout.advantage_spec, self.loss, self.correction)
        if self.loss.distills and self.train.train_backend != "embedded":
            raise ValueError(f"{flag_for('loss', 'loss_type')} smd needs {flag_for('train', 'train_backend')} embedded "
                             "(a dense and a shadow forward per micro-batch; Megatron's learner runs shadow only)")
        if self.train.recompute_granularity and self.loss.trains_shadow:
            raise ValueError(f"{flag_for('train', 'recompute_granularity')} with {flag_for('loss', 'loss_type')} "
                             f"{self.loss.loss_type}: backward would recompute the attention without the samples' "
                             "eviction masks (they are installed for the forward only); drop one of the two")
        if self.correction.bypass_mode and self.loss.trains_shadow:
            raise ValueError(f"{flag_for('correction', 'bypass_mode')} with {flag_for('loss', 'loss_type')} "
                             f"{self.loss.loss_type}: its PPO anchor is already the sampler's own policy (pi_shadow)")
        if self.megatron.load and self.train.train_backend != "megatron":
            raise ValueError(f"{flag_for('megatron', 'load')} (a Megatron checkpoint) needs "
                             f"{flag_for('train', 'train_backend')} megatron: the embedded learner starts from "
                             f"{flag_for('train', 'hf_checkpoint')}")
        if self.eval.eval_kv_method:  # the --kv-* knobs must fit the evaluation's method even when rollouts are dense
            dataclasses.replace(self.kv, method=self.eval.eval_kv_method).validate()
        if self.offloads_rollout and self.rollout.engine == "sglang" and not self.sglang.enable_memory_saver:
            raise ValueError(f"{flag_for('cluster', 'offload_rollout')} with {flag_for('rollout', 'engine')} sglang "
                             f"needs {flag_for('sglang', 'enable_memory_saver')} (the servers release memory through "
                             "it)")
        self._validate_drift()
        self._validate_overlap()
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.global_batch_size:
            raise ValueError(
                f"{flag_for('train', 'global_batch_size')}={self.train.global_batch_size} must divide "
                f"{flag_for('rollout', 'rollout_batch_size')} x {flag_for('rollout', 'n_samples_per_prompt')} = "
                f"{samples}"
            )

    def _validate_drift(self) -> None:
        """--kv-budget-schedule drift needs the guard's probes; --kv-budget-max goes with it (and not with SGLang,
        whose servers can run a request only at their own budget or dense)."""
        kv, drift, budget_max = self.kv, self.drift, flag_for("drift", "budget_max")
        if drift.budget_max is not None and not kv.adaptive:
            raise ValueError(f"{budget_max}={drift.budget_max} needs {flag_for('kv', 'budget_schedule')} drift")
        if not kv.adaptive:
            return
        schedule = f"{flag_for('kv', 'budget_schedule')} drift"
        if drift.probe_interval == 0:
            raise ValueError(f"{schedule} moves the budget by the drift guard's probes: "
                             f"{flag_for('drift', 'probe_interval')} must be > 0")
        if not (drift.probe_data or self.eval.eval_prompt_data):
            raise ValueError(f"{schedule} needs held-out probe prompts: {flag_for('drift', 'probe_data')} or "
                             f"{flag_for('eval', 'eval_prompt_data')}")
        if drift.budget_max is not None and drift.budget_max <= kv.budget:
            raise ValueError(f"{budget_max}={drift.budget_max} must exceed {flag_for('kv', 'budget')}={kv.budget}")
        if drift.budget_max is not None and self.rollout.engine == "sglang":
            raise ValueError(f"{budget_max} with {flag_for('rollout', 'engine')} sglang: a server keeps the budget it "
                             "started with and a request can only opt out of it, so the budget moves between "
                             f"{flag_for('kv', 'budget')} and dense; leave {budget_max} unset")

    def _validate_overlap(self) -> None:
        """--async and --partial-rollout against the rest of the run."""
        overlap, flag = self.overlap, lambda name: flag_for("overlap", name)
        if overlap.async_train:
            if self.cluster.colocate:
                raise ValueError(f"{flag('async_train')} with {flag_for('cluster', 'colocate')}: the next rollout "
                                 "generates while the learner trains, so they need devices of their own (slime "
                                 "refuses it too)")
            if self.reward.num_workers == 0:
                raise ValueError(f"{flag('async_train')} with {flag_for('reward', 'num_workers')} 0: rewards are "
                                 "graded beside the learner, off the main thread, where --rm-timeout's SIGALRM cannot "
                                 f"reach; use {flag_for('reward', 'num_workers')} >= 1")
            reads_rejection = [p for p in self.rollout.dynamic_sampling_filter_path if "check_min_kept_samples" in p]
            if reads_rejection:
                raise ValueError(f"{flag_for('rollout', 'dynamic_sampling_filter_path')} {reads_rejection[0]} with "
                                 f"{flag('async_train')}: pi_old is recomputed when a rollout is trained, after the "
                                 "filters ran, so they cannot see what the correction rejects")
        if overlap.partial_rollout:
            if self.rollout.engine != "embedded":
                raise ValueError(f"{flag('partial_rollout')} needs {flag_for('rollout', 'engine')} embedded: the "
                                 "continuation replays the eviction record in the engine's own prefill")
            if self.rollout.sampling_batch_size <= self.rollout.rollout_batch_size:
                raise ValueError(f"{flag('partial_rollout')} aborts the groups a rollout does not need, so it needs "
                                 f"{flag_for('rollout', 'over_sampling_batch_size')} > "
                                 f"{flag_for('rollout', 'rollout_batch_size')}={self.rollout.rollout_batch_size}")

    @property
    def offloads_rollout(self) -> bool:
        """--offload-rollout as resolved: on where the learner and the engines share devices."""
        if self.cluster.offload_rollout is not None:
            return self.cluster.offload_rollout
        return self.cluster.colocate or (not self.cluster.use_ray and self.rollout.engine == "embedded")

    @property
    def steps_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt // self.train.global_batch_size

    def rollout_plan(self, rollout_id: int) -> RolloutPlan:
        """What rollout `rollout_id` (0-based) does besides generating and training, decided here once and carried
        by the rollout's output: whether its loss trains the sampler's own policy (--loss-type shadow / smd), and
        whether the mismatch diagnostics that cost an extra forward are due (every --mismatch-metrics-interval
        rollouts from the first; 0: never)."""
        interval = self.log.mismatch_metrics_interval
        return RolloutPlan(trains_shadow=self.loss.trains_shadow,
                           metrics_due=interval > 0 and rollout_id % interval == 0,
                           defer_old=self.overlap.async_train,
                           mask_offpolicy=self.overlap.mask_offpolicy_in_partial_rollout)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(RunConfig))
if SECTIONS != tuple(SECTION_PREFIXES):
    raise RuntimeError(f"slime_sparse.flags.SECTION_PREFIXES {tuple(SECTION_PREFIXES)} must list {SECTIONS}")
SECTION_TYPES: dict[str, type] = {name: typing.get_type_hints(RunConfig)[name] for name in SECTIONS}
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
