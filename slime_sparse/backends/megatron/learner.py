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
`calculate_per_token_loss` keeps the schedule from rescaling our globally-normalised loss. What differs
by device is the optimizer step:
- GPU: Megatron's DistributedDataParallel and distributed optimizer (Adam); its finalize hook reduces
  the gradients (DP summed, not averaged, for the same reason; tied embeddings across stages).
- CPU (gloo, tests): the schedule runs under the CPU shim; gradients are summed over the DP group (and
  the tied embedding over the first/last stages) by hand, clipped with a TP/PP-aware global norm, and a
  torch AdamW steps the model.

Training checkpoints (`save_checkpoint` / `load_checkpoint`, collective) use the layout of
`slime_sparse.utils.checkpoint`, so `latest_checkpoint`, `list_checkpoints` and pruning work unchanged:

    <save_dir>/<name>/
        model/               HF export (config, safetensors, tokenizer): the weights, loadable anywhere
        optim/               optimizer state: CPU one torch file per rank; GPU a distributed checkpoint
        rng/rank*.pt         each rank's RNG streams, Megatron's tensor-parallel tracker included
        trainer_state.json   step, data_state, extra (+ learner_step and the saving layout); written last
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from slime_sparse.algo import LossConfig
from slime_sparse.backends.base import TrainBatch, microbatch_loss, sum_metrics
from slime_sparse.backends.batching import pack_by_tokens
from slime_sparse.backends.logprobs import pad_right
from slime_sparse.backends.optimizer import OptimConfig, adamw, lr_at
from slime_sparse.utils.checkpoint import MODEL_DIR, STATE_FILE, read_trainer_state, training_checkpoint_dir
from slime_sparse.utils.seed import get_rng_state, set_rng_state

from . import checkpoint as ckpt
from .config import MegatronConfig
from .hf_io import HFWeights, bucketed, export_hf_weights, load_hf_weights, save_hf_checkpoint
from .logprobs import check_rows, forward_logits, logprobs_from_logits
from .model_config import ModelSpec, build_gpt_model, read_hf_config

# Inside a training checkpoint (besides utils.checkpoint's model/ and trainer_state.json):
OPTIM_DIR = "optim"  # optimizer state
RNG_DIR = "rng"  # one RNG file per rank
LAYOUT_KEY = "megatron_layout"  # key in trainer_state.json's extra: the layout the per-rank files belong to


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
        max_tokens: int = 16384,
        temperature: float = 1.0,
        need_ref: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ):
        megatron.validate()
        if hf_dir is None and not megatron.load:
            raise ValueError("the Megatron learner needs --hf-checkpoint or --megatron-load to get its initial weights")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.hf_config = hf_config
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.loss_cfg = loss_cfg
        self.megatron = megatron
        self.optim = optim
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.hf_dir = hf_dir
        self.params_dtype = params_dtype
        self.on_gpu = torch.cuda.is_available()
        self.step = 0
        self.owns_process_group = False  # set by build_megatron_learner when it initialised torch.distributed

        self.model = self._build_and_load(hf_dir)
        self.model.config.calculate_per_token_loss = True  # our loss is already normalised by the step's global counts
        self.ref_model = None
        if need_ref:  # frozen copy of the starting policy for the KL term
            self.ref_model = self._build_and_load(hf_dir).eval().requires_grad_(False)
        if self.on_gpu:
            self._setup_gpu_training()
        else:
            self.optimizer = adamw(self.model.named_parameters(), lr=lr_at(0, optim), betas=optim.betas,
                                   weight_decay=optim.weight_decay)

    # ---- model -------------------------------------------------------------------------------
    def _build_and_load(self, hf_dir: str | None) -> torch.nn.Module:
        model = build_gpt_model(
            self.spec,
            params_dtype=self.params_dtype,
            use_te=self.megatron.use_te,
            sequence_parallel=self.megatron.sequence_parallel,
            vocab_divisible_by=self.megatron.vocab_divisible_by,
            recompute_activations=self.megatron.recompute_activations,
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

    def _setup_gpu_training(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = self.model.config
        # Megatron's finalize would divide by the schedule's token count: keep its grad sync, drop the scaling.
        config.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(models, num_tokens=None, **kw)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.megatron.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=self.model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.optim.lr,
            weight_decay=self.optim.weight_decay,
            adam_beta1=self.optim.betas[0],
            adam_beta2=self.optim.betas[1],
            clip_grad=self.optim.clip_grad if self.optim.clip_grad > 0 else 0.0,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=self.megatron.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    # ---- Megatron's forward / backward schedule ------------------------------------------------
    def _run_schedule(self, model: torch.nn.Module, micro: list[list[list[int]]],
                      on_last_stage: Callable[..., Any], *, forward_only: bool) -> None:
        """Run micro-batches (token rows each) through megatron-core's schedule: 1F1B across the
        pipeline stages, a plain loop at PP=1, backward included unless `forward_only`.

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
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *, ref: bool = False) -> list[torch.Tensor]:
        """Dense log-probs of each response (CPU fp32 rows), on every rank. Collective."""
        model = self.ref_model if ref else self.model
        if model is None:
            raise ValueError("reference log-probs requested but the learner was built without a reference model")
        check_rows(tokens, response_lens)
        groups = pack_by_tokens([len(t) for t in tokens], self.max_tokens)
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
                self._run_schedule(model, [[tokens[i] for i in g] for g in groups], keep, forward_only=True)
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
        num_seqs, num_tokens = batch.checked_normalisers(needs_ref=self.loss_cfg.use_kl_loss)
        micro = [batch.select(idx) for idx in pack_by_tokens([len(t) for t in batch.tokens], self.max_tokens)]
        if self.on_gpu and not micro:  # Megatron's DDP joins the gradient all-reduce only from its schedule
            raise ValueError("a data-parallel rank got no samples: --global-batch-size must be at least the "
                             "data-parallel size (learner ranks / (--tensor-model-parallel-size x "
                             "--pipeline-model-parallel-size))")
        lr = lr_at(self.step, self.optim)
        self.model.train()
        if self.on_gpu:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reported: list[dict] = []

        def loss_func(index: int, logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor):
            loss, metrics = self._policy_loss(logits, input_ids, lengths, micro[index], num_seqs, num_tokens)
            reported.append({**metrics, "train/loss": loss.detach()})
            # (loss, token count, reported): with calculate_per_token_loss the schedule does not rescale it
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        if micro:
            self._run_schedule(self.model, [mb.tokens for mb in micro], loss_func, forward_only=False)
        grad_norm = self._optimizer_step(lr)
        self.step += 1
        totals = {"train/loss": 0.0, **sum_metrics(reported)}
        return {**self._from_last_stage(totals), "train/grad_norm": grad_norm, "train/lr": lr}

    def _optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.on_gpu:  # the schedule's finalize_model_grads already reduced the gradients (DP, tied embeddings)
            _, grad_norm, _ = self.optimizer.step()
            return float(grad_norm if grad_norm is not None else float("nan"))
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # every rank joins every all-reduce, whatever its micro-batches touched
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ps = _groups()
        if ps.get_data_parallel_world_size() > 1:  # loss normalised globally: summing shard grads = full grad
            for p in params:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        tied = self.module.shared_embedding_or_output_weight() if self.spec.tie_word_embeddings else None
        if tied is not None and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
            # the first and last stages each hold a copy of the tied embedding: both apply the summed gradient
            dist.all_reduce(tied.grad, group=ps.get_embedding_group())
        grad_norm = clip_grad_norm_tp(params, self.optim.clip_grad)
        self.optimizer.step()
        return grad_norm

    # ---- weights & state -------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names (TP shards gathered). Collective: every rank must consume it."""
        yield from export_hf_weights(self.module, self.spec)

    def weight_buckets(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`named_weights` grouped into buckets of about `bucket_bytes`, for streaming to rollout engines."""
        yield from bucketed(self.named_weights(), bucket_bytes)

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict | None = None,
                        tokenizer: Any = None, keep_last: int | None = None) -> str:
        """Collective, atomic training checkpoint at `path` (layout in the module docstring).

        Rank 0 stages a tmp directory (utils.checkpoint.training_checkpoint_dir), every rank writes its part
        into it, and once all are done rank 0 writes trainer_state.json, renames the directory to `path`,
        updates `latest` and prunes to `keep_last`. A crash before that leaves only a tmp-* directory.
        """
        rank = dist.get_rank()
        state_extra = {**(extra or {}), "learner_step": self.step, LAYOUT_KEY: self._layout()}
        with contextlib.ExitStack() as stack:
            staged, error = None, None
            if rank == 0:
                try:
                    staged = stack.enter_context(training_checkpoint_dir(
                        path, step=step, data_state=data_state, extra=state_extra, keep_last=keep_last))
                except Exception as exc:  # e.g. data_state not JSON: the other ranks must not wait for rank 0
                    error = exc
            message = [staged, None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(message, src=0)
            staged, failure = message
            if error is not None:
                raise error
            if failure is not None:
                raise RuntimeError(f"checkpoint {path}: rank 0 could not stage it ({failure})")
            self._write_checkpoint_files(staged, tokenizer)
            dist.barrier()  # every rank's files are written before rank 0 commits (leaving this block)
        dist.barrier()  # the commit is visible to every rank before any returns
        return path

    def load_checkpoint(self, path: str) -> dict:
        """Collective: restore weights, optimizer, step and RNG written by `save_checkpoint`.

        Returns {"step", "data_state", "extra"}. The saving layout (world size, TP, PP) must be this one:
        optimizer and RNG states are per rank. To continue at another layout, start a new run from the
        checkpoint's model/ directory (--hf-checkpoint), which carries the weights but not the moments.
        """
        state = read_trainer_state(path)
        saved = state["extra"].get(LAYOUT_KEY)
        if saved is None:
            raise ValueError(f"{path}: not written by the Megatron learner (no {LAYOUT_KEY!r} in its {STATE_FILE}); "
                             f"start from its weights with --hf-checkpoint {os.path.join(path, MODEL_DIR)}")
        if saved != self._layout():
            raise ValueError(f"{path} was saved with layout {saved}, this run has {self._layout()}: resume with the "
                             "same world size and --tensor-model-parallel-size (or start from its model/ directory)")
        # The HF export reshards through the same mapping as the initial load: each rank reads its slices.
        load_hf_weights(self.module, self.spec, HFWeights(os.path.join(path, MODEL_DIR)))
        self._load_optimizer(os.path.join(path, OPTIM_DIR))
        rng = torch.load(self._rank_file(os.path.join(path, RNG_DIR)), map_location="cpu", weights_only=True)
        set_rng_state(rng["host"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tensor_parallel"])
        self.step = int(state["extra"]["learner_step"])
        return state

    def _layout(self) -> dict:
        """What the per-rank files of a checkpoint depend on."""
        ps = _groups()
        return {
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "optimizer": "megatron" if self.on_gpu else "torch-adamw",
        }

    @staticmethod
    def _rank_file(directory: str) -> str:
        return os.path.join(directory, f"rank{dist.get_rank():05d}.pt")

    def _write_checkpoint_files(self, directory: str, tokenizer: Any) -> None:
        """Collective: fill a staged checkpoint directory (HF export by rank 0, per-rank optimizer and RNG)."""
        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(os.path.join(directory, OPTIM_DIR))
            os.makedirs(os.path.join(directory, RNG_DIR))
        dist.barrier()  # the directories exist before any rank writes into them
        weights = self.named_weights()  # collective (TP all-gather): every rank iterates, rank 0 writes
        if rank == 0:
            model_dir = os.path.join(directory, MODEL_DIR)
            save_hf_checkpoint(weights, model_dir, self.hf_config)
            side_files = self.hf_dir or os.path.join(self.megatron.load, ckpt.HF_EXTRA_DIR)
            if os.path.isdir(side_files):  # generation config, tokenizer files
                ckpt.copy_hf_side_files(side_files, model_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(model_dir)
        else:
            for _ in weights:
                pass
        self._save_optimizer(os.path.join(directory, OPTIM_DIR))
        from megatron.core import tensor_parallel

        rng = {"host": get_rng_state(), "tensor_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}
        torch.save(rng, self._rank_file(os.path.join(directory, RNG_DIR)))

    def _save_optimizer(self, directory: str) -> None:
        if self.on_gpu:  # Megatron's (distributed) optimizer: a collective distributed checkpoint
            from megatron.core import dist_checkpointing

            dist_checkpointing.save(self.optimizer.sharded_state_dict(self.module.sharded_state_dict()), directory)
        else:
            torch.save(self.optimizer.state_dict(), self._rank_file(directory))

    def _load_optimizer(self, directory: str) -> None:
        if self.on_gpu:
            from megatron.core import dist_checkpointing

            sharded = self.optimizer.sharded_state_dict(self.module.sharded_state_dict(), is_loading=True)
            self.optimizer.load_state_dict(dist_checkpointing.load(sharded, directory))
        else:
            state = torch.load(self._rank_file(directory), map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state)

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


def clip_grad_norm_tp(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global gradient L2 norm over the model-parallel group (TP-sharded parameters counted on every rank,
    TP-replicated ones and the last stage's copy of a tied embedding once), then scale gradients so the norm
    is at most `max_norm` (0 = no clipping)."""
    from megatron.core.transformer.module import param_is_not_shared
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    ps = _groups()
    grads = [p.grad for p in params
             if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.detach().double().pow(2).sum().cpu()
    group = ps.get_model_parallel_group()  # TP x PP
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(float(sq))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def build_megatron_learner(hf_dir: str | None, loss_cfg: LossConfig, megatron: MegatronConfig, optim: OptimConfig, *,
                           seed: int = 0, max_tokens: int = 16384, temperature: float = 1.0,
                           params_dtype: torch.dtype = torch.float32) -> MegatronLearner:
    """The learner with its weights from `hf_dir` (else `megatron.load`), a frozen reference copy when the loss
    has a KL term, and Megatron's process groups, initialised here unless the caller (a launcher, Ray) did."""
    from .parallel import ParallelConfig, init_parallel

    owns_process_group = init_parallel(
        ParallelConfig(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size), seed=seed)
    hf_config = read_hf_config(hf_dir) if hf_dir else ckpt.read_meta(megatron.load)["hf_config"]
    learner = MegatronLearner(hf_config, loss_cfg, hf_dir=hf_dir, megatron=megatron, optim=optim, max_tokens=max_tokens,
                              temperature=temperature, need_ref=loss_cfg.use_kl_loss, params_dtype=params_dtype)
    learner.owns_process_group = owns_process_group
    return learner
