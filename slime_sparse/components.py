"""The pieces of a run, built from its config: tokenizer, data stream, evaluation set, rollout function, reward,
learner, engine. The user's functions (rollout function, dynamic-sampling filters, reward) are resolved here, once
per run, by the builders (start-up, `slime_sparse.startup`, only checked that they import).

The loop in `train.py` only calls the `Components` methods. Where the learner and the engine live is decided once,
in `build_backends`: in this process (`factory.py`) or as Ray actors (`ray/build.py`, --use-ray); either way they
answer the same protocols, so nothing downstream asks which.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from slime_sparse.config import RunConfig
from slime_sparse.data.prompt_dataset import PromptDataset, PromptStream
from slime_sparse.eval import eval_kv, load_eval_sets, sparse_eval_kv
from slime_sparse.factory import EngineSpec, LearnerSpec, build_engine, build_learner
from slime_sparse.utils.hf import load_tokenizer
from slime_sparse.resume import CONFIG_KEY, checkpoint_config
from slime_sparse.flags import flag_for
from slime_sparse.reward import get_reward_fn
from slime_sparse.rollout.filter_hub import load_filters
from slime_sparse.rollout.offload import OffloadingEngine
from slime_sparse.rollout.partial import PartialBuffer
from slime_sparse.utils.imports import load_function
from slime_sparse.utils.logging import progress_bar


@dataclass
class Components:
    cfg: RunConfig
    tokenizer: Any
    stream: PromptStream
    reward_fn: Callable
    learner: Any
    engine: Any
    rollout_fn: Callable | None = None  # --rollout-function-path (slime's signature: rollout/base_types.py)
    filters: list = field(default_factory=list)  # --dynamic-sampling-filter-path (rollout/filter_hub.py)
    eval_sets: dict = field(default_factory=dict)  # {name: records} of each --eval-prompt-data set
    placement: Any = None  # what holds the learner and engine besides themselves (Ray: actors' placement group)
    partial: Any = None  # --partial-rollout: the unfinished groups a rollout carries to the next (rollout/partial.py)
    policy_version: int = 0  # rollouts trained into the weights the engine holds (the loop sets it at each sync)
    _eval_engines: dict = field(default_factory=dict)

    def progress(self, iterable, **kw):
        return progress_bar(iterable, enabled=self.cfg.log.progress, **kw)

    def eval_engine(self, mode: str):
        """Engine for evaluation under `mode` ("dense" or "sparse"), sharing the rollout engine's weights."""
        if mode == "sparse" and sparse_eval_kv(self.cfg) == self.cfg.kv:
            return self.engine
        if mode not in self._eval_engines:
            self._eval_engines[mode] = self.engine.with_kv(eval_kv(self.cfg, mode))
        return self._eval_engines[mode]

    def data_state(self) -> dict:
        """Where the data stands now: the prompt stream's position, and the partial groups carried to the next
        rollout (--partial-rollout only). What a checkpoint stores."""
        state = self.stream.state_dict()
        return state if self.partial is None else {**state, "partial": self.partial.state_dict()}

    def save_checkpoint(self, save_dir: str, step: int, data_state: dict | None = None,
                        extra: dict | None = None) -> str:
        """Checkpoint rollout `step` at the data position `data_state` (None: where it is now); `extra`: more of the
        loop's state (JSON), kept in trainer_state.json."""
        path = os.path.join(save_dir, f"rollout_{step:06d}")
        # the learner owns its state (Ray: rank 0 writes it); the loop adds the data position
        # the run config too: a resume under other experiment settings is refused (resume.py)
        extra = {CONFIG_KEY: checkpoint_config(self.cfg), **(extra or {})}
        self.learner.save_checkpoint(path, step=step, data_state=data_state or self.data_state(), extra=extra,
                                     tokenizer=self.tokenizer, keep_last=self.cfg.train.keep_last)
        return path

    def load_checkpoint(self, path: str) -> int:
        state = self.learner.load_checkpoint(path)  # Ray: every rank restores itself
        self.stream.load_state_dict(state["data_state"])
        if self.partial is not None:
            self.partial.load_state_dict(state["data_state"].get("partial"))
        self.sync_weights()
        self.policy_version = int(state["step"])
        return int(state["step"])

    def sync_weights(self) -> None:
        """Give the rollout engine the learner's current weights (Ray: learner rank 0 -> engine actors directly)."""
        self.engine.sync_from(self.learner)

    def close(self) -> None:
        # engines before the learner: under Ray they drop their weight-sync group with learner rank 0
        for obj in (self.reward_fn, self.engine, self.learner, self.placement):
            close = getattr(obj, "close", None)
            if callable(close):
                close()


def build_backends(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """(learner, rollout engine, their placement or None): in this process, or as Ray actors with --use-ray."""
    if cfg.cluster.use_ray:  # learner ranks and engines as Ray actors (slime_sparse/ray)
        from slime_sparse.ray.build import build_ray_backends

        ray_backends = build_ray_backends(cfg)
        return ray_backends.learner, ray_backends.engine, ray_backends
    return build_learner(LearnerSpec.from_run(cfg)), build_engine(EngineSpec.from_run(cfg)), None


def colocated(engine: Any, cfg: RunConfig) -> Any:
    """The engine as the loop sees it: holding its KV cache and graphs only while it generates under
    --offload-rollout (on by default where it shares devices with the learner)."""
    return OffloadingEngine(engine) if cfg.offloads_rollout else engine


def build_components(cfg: RunConfig) -> Components:
    tokenizer = load_tokenizer(cfg.train.hf_checkpoint)
    dataset = PromptDataset(cfg.data, tokenizer)
    stream = PromptStream(dataset, cfg.rollout.rollout_batch_size)
    if stream.num_batches < cfg.train.num_rollout:
        raise ValueError(
            f"--num-rollout={cfg.train.num_rollout} needs {cfg.train.num_rollout} batches of --rollout-batch-size="
            f"{cfg.rollout.rollout_batch_size} prompts, but {len(dataset)} prompts x --num-epoch={cfg.data.num_epochs} "
            f"give only {stream.num_batches}"
        )
    eval_sets = load_eval_sets(cfg, tokenizer)
    rollout_fn = load_function(cfg.rollout.rollout_function_path, flag_for("rollout", "rollout_function_path"))
    filters = load_filters(cfg.rollout.dynamic_sampling_filter_path)
    reward_fn = get_reward_fn(cfg.reward)
    try:
        learner, engine, placement = build_backends(cfg)
    except BaseException:
        getattr(reward_fn, "close", lambda: None)()
        raise
    components = Components(cfg=cfg, tokenizer=tokenizer, stream=stream, reward_fn=reward_fn, learner=learner,
                            engine=colocated(engine, cfg), rollout_fn=rollout_fn, filters=filters, eval_sets=eval_sets,
                            placement=placement, partial=PartialBuffer(stream) if cfg.overlap.partial_rollout else None)
    try:
        components.sync_weights()
    except BaseException:
        components.close()  # actors and reward workers must not outlive a failed start
        raise
    return components
