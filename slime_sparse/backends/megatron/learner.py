"""The Megatron learner: megatron-core GPTModel (TP x PP x DP), dense recompute of pi_old / pi_ref, Sparse-RL loss.

Every rank of the learner group builds one `MegatronLearner` after `init_parallel` and calls the same
methods in the same order (they contain collectives). The batch a rank receives is its data-parallel
shard, identical on all TP / PP ranks of one replica, with the step's *global* normalisers
(`num_seqs` / `num_tokens`), exactly as for the embedded learner; the loss is
`slime_sparse.algo.policy_loss`, the one implementation every backend shares.

Forward and backward always go through megatron-core's schedule (`get_forward_backward_func`): 1F1B
over the pipeline stages when PP > 1, a plain micro-batch loop otherwise. Only the last stage has
logits; it computes log-probs and the loss inside the schedule's loss function, and broadcasts the
recomputed log-probs and the step's metrics to the other stages, so every rank returns the same.
`calculate_per_token_loss` keeps the schedule from rescaling our globally-normalised loss.

Around it, each in its own module: the optimizer step (optimizer.py: Megatron's distributed optimizer on GPU,
gradients reduced and clipped by hand for a torch AdamW on CPU, chosen once), the learning rate of each step
(Megatron's OptimizerParamScheduler, `backends.optimizer.megatron_lr_scheduler`: the embedded learner's schedule
too, from transformers), and training checkpoints in the layout of `slime_sparse.utils.checkpoint` (checkpoint.py).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from slime_sparse.algo import LossConfig
from slime_sparse.backends.base import TrainBatch, microbatch_loss
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.logprobs import pad_right
from slime_sparse.backends.metrics import step_metrics
from slime_sparse.backends.optimizer import OptimConfig, check_resumed_schedule, megatron_lr_scheduler
from slime_sparse.backends.recompute import Recompute
from slime_sparse.backends.shadow_attention import ShadowMask
from slime_sparse.kv.record import EvictionRecord
from slime_sparse.utils.checkpoint import read_trainer_state

from . import checkpoint as ckpt
from .config import MegatronConfig
from .hf_io import HFWeights, bucketed, export_hf_weights, load_hf_weights
from .logprobs import check_rows, forward_logits, logprobs_from_logits
from .model_config import ModelSpec, build_gpt_model, read_hf_config
from .optimizer import build_optimizer
from .shadow import shadow_masks_installed


def _groups():
    from megatron.core import parallel_state as ps

    return ps


class MegatronLearner:
    def __init__(
        self,
        hf_config: dict,
        loss_cfg: LossConfig,
        *,
        hf_dir: str | None = None,
        megatron: MegatronConfig = MegatronConfig(),
        optim: OptimConfig = OptimConfig(),
        batching: MicroBatching = MicroBatching(),
        temperature: float = 1.0,
        need_ref: bool = False,
        params_dtype: torch.dtype = torch.float32,
        fp32_lm_head: bool = False,
        recompute: Recompute | None = None,
    ):
        megatron.validate()
        if hf_dir is None and not megatron.load:
            raise ValueError("the Megatron learner needs --hf-checkpoint or --ref-load to get its initial weights")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.hf_config = hf_config
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.loss_cfg = loss_cfg
        self.megatron = megatron
        self.optim = optim
        self.batching = batching
        self.temperature = temperature
        self.hf_dir = hf_dir
        self.params_dtype = params_dtype
        self.fp32_lm_head = fp32_lm_head  # --enable-fp32-lm-head: the sampler's head arithmetic (utils.lm_head)
        self.recompute = recompute  # --recompute-granularity / -method / -num-layers (backends.recompute)
        self.step = 0
        self.owns_process_group = False  # set by build_megatron_learner when it initialised torch.distributed

        self.model = self._build_and_load(hf_dir)
        self.model.config.calculate_per_token_loss = True  # our loss is already normalised by the step's global counts
        self.ref_model = None
        if need_ref:  # frozen copy of the starting policy for the KL term
            self.ref_model = self._build_and_load(hf_dir).eval().requires_grad_(False)
        # the optimizer regime of this process (Megatron's on GPU, torch AdamW on CPU), chosen once
        self.optimizer = build_optimizer(optim, megatron, tied_embeddings=self.spec.tie_word_embeddings)
        self.model = self.optimizer.wrap(self.model)  # GPU: inside Megatron's DistributedDataParallel
        self.scheduler = megatron_lr_scheduler(self.optimizer.optimizer, optim)  # sets the lr of step 0

    # ---- model -------------------------------------------------------------------------------
    def _build_and_load(self, hf_dir: str | None) -> torch.nn.Module:
        model = build_gpt_model(
            self.spec,
            params_dtype=self.params_dtype,
            use_te=self.megatron.use_te,
            sequence_parallel=self.megatron.sequence_parallel,
            vocab_divisible_by=self.megatron.vocab_divisible_by,
            recompute=self.recompute,
            fp32_lm_head=self.fp32_lm_head,
        )
        if self.megatron.load:
            ckpt.load_model(model, self.megatron.load)
        else:
            load_hf_weights(model, self.spec, HFWeights(hf_dir))
        mirror_hf_padding_idx(model, self.hf_config.get("pad_token_id"))
        return model

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (unwrapped from Megatron's DDP on GPU)."""
        return getattr(self.model, "module", self.model)

    @property
    def data_parallel_rank(self) -> int:
        """Which data shard this rank trains on (all TP ranks of one model replica share it)."""
        return _groups().get_data_parallel_rank()

    @property
    def data_parallel_size(self) -> int:
        return _groups().get_data_parallel_world_size()

    # ---- Megatron's forward / backward schedule ------------------------------------------------
    def _run_schedule(self, model: torch.nn.Module, micro: list[list[list[int]]],
                      on_last_stage: Callable[..., Any], *, forward_only: bool,
                      shadow: list[list[EvictionRecord | None]] | None = None) -> None:
        """Run micro-batches (token rows each) through megatron-core's schedule: 1F1B across the
        pipeline stages, a plain loop at PP=1, backward included unless `forward_only`. With `shadow` (the
        eviction records of each micro-batch's rows) every forward is the shadow forward (`shadow.py`).

        Every stage walks the same micro-batches (the schedule sets a later stage's input to the previous
        stage's output); only the last stage has logits, and it calls `on_last_stage(index, logits,
        input_ids, lengths)`, which returns the micro-batch's loss (training) or anything (forward only).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = next(self.module.parameters()).device

        def forward_step(data_iterator, model):
            index, tokens = next(data_iterator)
            input_ids = pad_right(tokens, device=device)
            lengths = torch.tensor([len(t) for t in tokens], device=device)

            def loss_func(logits, non_loss_data=False):
                return on_last_stage(index, logits, input_ids, lengths)

            if shadow is None:
                return forward_logits(model, input_ids), loss_func
            cfg = self.hf_config
            mask = ShadowMask(shadow[index], [len(t) for t in tokens], cfg["num_hidden_layers"],
                              cfg.get("num_key_value_heads") or cfg["num_attention_heads"], cfg["num_attention_heads"],
                              device)
            with shadow_masks_installed(model, mask):
                return forward_logits(model, input_ids), loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(enumerate(micro)), model=[model],
            num_microbatches=len(micro), seq_length=max(len(row) for rows in micro for row in rows),
            micro_batch_size=max(len(rows) for rows in micro), forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    def _from_last_stage(self, obj: Any) -> Any:
        """`obj` as the last pipeline stage has it, on every stage (a collective over the pipeline group)."""
        ps = _groups()
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ---- dense recompute -------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *, ref: bool = False,
                         shadow: list[EvictionRecord | None] | None = None) -> list[torch.Tensor]:
        """Dense log-probs of each response (CPU fp32 rows), on every rank; with `shadow` (one eviction record per
        row) the shadow policy's. Collective."""
        model = self.ref_model if ref else self.model
        if model is None:
            raise ValueError("reference log-probs requested but the learner was built without a reference model")
        check_rows(tokens, response_lens)
        groups = self.batching.split([len(t) for t in tokens])
        out: list[torch.Tensor] = [torch.empty(0)] * len(tokens)

        def keep(index: int, logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            rows = groups[index]
            logp, _ = logprobs_from_logits(logits, input_ids, lengths, [response_lens[i] for i in rows],
                                           vocab_size=self.spec.vocab_size, temperature=self.temperature)
            for j, i in enumerate(rows):
                out[i] = logp[j, : response_lens[i]].float().cpu()
            return logp

        was_training = model.training
        model.eval()
        try:
            if groups:
                self._run_schedule(model, [[tokens[i] for i in g] for g in groups], keep, forward_only=True,
                                   shadow=None if shadow is None else [[shadow[i] for i in g] for g in groups])
        finally:
            model.train(was_training)
        return self._from_last_stage(out)

    # ---- update ----------------------------------------------------------------------------
    def _policy_loss(self, logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, mb: TrainBatch,
                     num_seqs: float, num_tokens: float):
        logp, entropy = logprobs_from_logits(
            logits, input_ids, lengths, mb.response_lens, vocab_size=self.spec.vocab_size,
            temperature=self.temperature, with_entropy=self.loss_cfg.entropy_coef != 0,
        )
        return microbatch_loss(logp, entropy, mb, self.loss_cfg, num_seqs, num_tokens)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's DP shard; the same on every TP / PP rank of its
        replica). Collective; every rank returns the same metrics."""
        cfg = self.loss_cfg
        if cfg.distills:  # RunConfig.validate refuses it; this guards direct use
            raise ValueError("--loss-type smd needs --train-backend embedded: the Megatron learner runs one forward "
                             "per micro-batch (its schedule), SMD needs a dense and a shadow one")
        num_seqs, num_tokens = batch.checked_normalisers(needs_ref=cfg.needs_ref,
                                                         needs_shadow=cfg.trains_shadow)
        micro = [batch.select(idx) for idx in self.batching.split([len(t) for t in batch.tokens])]
        if self.optimizer.reduces_in_schedule and not micro:
            raise ValueError("a data-parallel rank got no samples: --global-batch-size must be at least the "
                             "data-parallel size (learner ranks / (--tensor-model-parallel-size x "
                             "--pipeline-model-parallel-size))")
        lr = self.scheduler.get_lr(self.optimizer.optimizer.param_groups[0])  # this step's (the scheduler set it)
        self.model.train()
        self.optimizer.zero_grad()
        reported: list[dict] = []

        def loss_func(index: int, logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor):
            loss, metrics = self._policy_loss(logits, input_ids, lengths, micro[index], num_seqs, num_tokens)
            reported.append({**metrics, "train/loss": loss.detach()})
            # (loss, token count, reported): with calculate_per_token_loss the schedule does not rescale it
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        if micro:
            self._run_schedule(self.model, [mb.tokens for mb in micro], loss_func, forward_only=False,
                               shadow=[mb.evictions for mb in micro] if cfg.trains_shadow else None)
        grad_norm = self.optimizer.step()
        self.scheduler.step(1)
        self.step += 1
        return {**self._from_last_stage(step_metrics(reported)), "train/grad_norm": grad_norm, "train/lr": lr}

    # ---- weights & state -------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names (TP shards gathered). Collective: every rank must consume it."""
        yield from export_hf_weights(self.module, self.spec)

    def weight_buckets(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`named_weights` grouped into buckets of about `bucket_bytes`, for streaming to rollout engines."""
        yield from bucketed(self.named_weights(), bucket_bytes)

    # ---- checkpoints (layout and atomicity: checkpoint.py) ----------------------------------------
    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict | None = None,
                        tokenizer: Any = None, keep_last: int | None = None) -> str:
        """Collective, atomic training checkpoint at `path` (checkpoint.save_training_checkpoint)."""
        return ckpt.save_training_checkpoint(
            path, model=self.module, spec=self.spec, optimizer=self.optimizer, hf_config=self.hf_config,
            side_files=self.hf_dir or os.path.join(self.megatron.load, ckpt.HF_EXTRA_DIR), tokenizer=tokenizer,
            step=step, data_state=data_state, keep_last=keep_last,
            extra={**(extra or {}), "learner_step": self.step, "lr_schedule": self.optim.schedule,
                   "lr_scheduler": self.scheduler.state_dict()})

    def load_checkpoint(self, path: str) -> dict:
        """Collective: restore weights, optimizer, the lr scheduler's position, step and RNG written by
        `save_checkpoint` (the schedule must be the checkpoint's); returns {"step", "data_state", "extra"}."""
        check_resumed_schedule(read_trainer_state(path)["extra"].get("lr_schedule"), self.optim)
        state = ckpt.load_training_checkpoint(path, model=self.module, spec=self.spec, optimizer=self.optimizer)
        self.step = int(state["extra"]["learner_step"])
        if "lr_scheduler" in state["extra"]:
            self.scheduler.load_state_dict(state["extra"]["lr_scheduler"])
        else:  # a checkpoint from before the scheduler was saved: its position is the step count
            self.scheduler.step(self.step)
        return state

    def close(self) -> None:
        """Destroy the process groups if `build_megatron_learner` created them (a single-process run), so a
        later learner in this process starts afresh. Idempotent; groups made by a launcher are left alone."""
        if self.owns_process_group:
            from .parallel import destroy_parallel

            destroy_parallel()
            self.owns_process_group = False



def mirror_hf_padding_idx(model: torch.nn.Module, pad_token_id: int | None) -> None:
    """Give the pad token's embedding row no gradient from its use as an *input*, as HF does.

    HF's Qwen2 / Llama embed with `nn.Embedding(padding_idx=pad_token_id)`, so a pad token fed to the
    model (e.g. one the policy sampled) sends no gradient to its row; as an output class it still does,
    through a tied LM head. Megatron's embedding has no such rule. Detaching the embedding output at pad
    positions reproduces it, so both learners optimise the same function. Most released checkpoints set
    no pad_token_id, and then nothing changes.
    """
    embedding = getattr(model, "embedding", None)  # only the first pipeline stage embeds
    if pad_token_id is None or embedding is None:
        return

    def detach_pad_positions(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        is_pad = args[0] == pad_token_id  # [b, s]
        if module.reduce_scatter_embeddings:  # sequence parallel: this rank holds [s / tp, b, h]
            is_pad = is_pad.t().chunk(module.tp_group.size(), dim=0)[module.tp_group.rank()]
        return torch.where(is_pad[..., None], output.detach(), output)

    embedding.word_embeddings.register_forward_hook(detach_pad_positions)


def build_megatron_learner(hf_dir: str | None, loss_cfg: LossConfig, megatron: MegatronConfig, optim: OptimConfig, *,
                           seed: int = 0, batching: MicroBatching = MicroBatching(), temperature: float = 1.0,
                           params_dtype: torch.dtype = torch.float32, fp32_lm_head: bool = False,
                           recompute: Recompute | None = None) -> MegatronLearner:
    """The learner with its weights from `hf_dir` (else `megatron.load`), a frozen reference copy when the loss
    has a KL term, and Megatron's process groups, initialised here unless the caller (a launcher, Ray) did."""
    from .parallel import ParallelConfig, init_parallel

    owns_process_group = init_parallel(
        ParallelConfig(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size), seed=seed)
    hf_config = read_hf_config(hf_dir) if hf_dir else ckpt.read_meta(megatron.load)["hf_config"]
    learner = MegatronLearner(hf_config, loss_cfg, hf_dir=hf_dir, megatron=megatron, optim=optim, batching=batching,
                              temperature=temperature, need_ref=loss_cfg.needs_ref, params_dtype=params_dtype,
                              fp32_lm_head=fp32_lm_head, recompute=recompute)
    learner.owns_process_group = owns_process_group
    return learner
