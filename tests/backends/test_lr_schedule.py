"""--lr-decay-style / --min-lr / --lr-decay-iters / --lr-warmup-iters: the schedules come from the libraries.

The embedded learner steps transformers' scheduler (backends.optimizer.hf_lr_scheduler), the Megatron learner
Megatron's OptimizerParamScheduler (megatron_lr_scheduler). Checked here: both against the libraries' own values,
built the way each library is used (transformers' get_scheduler; Megatron's scheduler the way slime builds it, in
samples), at every step through warm-up, decay and past its end; the learners report those values; a resumed
learner continues at the checkpoint's position; a checkpoint of another schedule is refused.
"""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, get_scheduler

from slime_sparse.algo import LossConfig
from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.optimizer import OptimConfig, adamw, hf_lr_scheduler

LR, WARMUP, DECAY = 1e-3, 3, 10
STEPS = DECAY + 5  # past the end of the decay
SCHEDULES = [("constant", 0.0), ("linear", 0.0), ("linear", 1e-4), ("cosine", 0.0), ("cosine", 1e-4)]


def optim_config(style: str, min_lr: float, **kw) -> OptimConfig:
    return OptimConfig(**{"lr": LR, "decay_style": style, "min_lr": min_lr, "warmup_iters": WARMUP,
                          "decay_iters": DECAY, **kw})


def one_param_optimizer(lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def stepped(scheduler, steps: int, read, advance) -> list[float]:
    """The lr of each optimizer step: read it, then advance the scheduler (one optimizer step)."""
    out = []
    for _ in range(steps):
        out.append(read(scheduler))
        advance(scheduler)
    return out


def advance_hf(scheduler) -> None:
    scheduler.optimizer.step()  # (no gradients: nothing moves) as a learner does, before its scheduler
    scheduler.step()


def hf_values(optim: OptimConfig) -> list[float]:
    return stepped(hf_lr_scheduler(one_param_optimizer(), optim), STEPS, lambda s: s.get_last_lr()[0],
                   advance_hf)


def transformers_own(style: str, min_lr: float) -> list[float]:
    """transformers' get_scheduler, nothing of ours in between."""
    name, kwargs = {"constant": ("constant_with_warmup", None), "linear": ("polynomial", {"lr_end": min_lr, "power": 1.0}),
                    "cosine": ("cosine_with_min_lr", {"min_lr": min_lr})}[style]
    scheduler = get_scheduler(name, one_param_optimizer(), num_warmup_steps=WARMUP, num_training_steps=DECAY,
                              scheduler_specific_kwargs=kwargs)
    return stepped(scheduler, STEPS, lambda s: s.get_last_lr()[0], advance_hf)


def megatron_as_slime_builds_it(style: str, min_lr: float, global_batch_size: int = 256) -> list[float]:
    """Megatron's OptimizerParamScheduler as slime's get_optimizer_param_scheduler makes it: counted in samples
    (steps x global batch size), lr_warmup_init 0, stepped by the global batch size after each optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = one_param_optimizer()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=min_lr, lr_warmup_steps=WARMUP * global_batch_size,
        lr_decay_steps=DECAY * global_batch_size, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
        wd_incr_steps=DECAY * global_batch_size, wd_incr_style="constant")
    return stepped(scheduler, STEPS, lambda s: optimizer.param_groups[0]["lr"], lambda s: s.step(global_batch_size))


@pytest.mark.parametrize("style, min_lr", SCHEDULES)
def test_embedded_schedule_is_transformers_and_equals_megatrons(style, min_lr):
    pytest.importorskip("megatron.core")
    ours = hf_values(optim_config(style, min_lr))
    own = transformers_own(style, min_lr)
    megatron = megatron_as_slime_builds_it(style, min_lr)
    # transformers' values unchanged up to the end of the decay (ours only holds min_lr after it, as Megatron)
    assert ours[: DECAY + 1] == pytest.approx(own[: DECAY + 1], rel=1e-12, abs=1e-15)
    assert ours == pytest.approx(megatron, rel=1e-9, abs=1e-15)
    # anchors: warm-up from 0 (Megatron's: the first step runs at lr 0), the peak after it, min_lr at and after the end
    assert ours[0] == 0.0 and ours[1] == pytest.approx(LR / WARMUP) and ours[WARMUP] == pytest.approx(LR)
    end = LR if style == "constant" else min_lr
    assert ours[DECAY:] == pytest.approx([end] * (STEPS - DECAY), abs=1e-15)
    if style != "constant":  # strictly decaying in between
        assert all(a > b for a, b in zip(ours[WARMUP:DECAY], ours[WARMUP + 1:DECAY + 1]))


@pytest.mark.parametrize("style, min_lr", SCHEDULES)
def test_megatron_learners_schedule_is_megatrons_in_optimizer_steps(style, min_lr):
    """megatron_lr_scheduler counts optimizer steps; slime counts samples: the same lr at every step."""
    pytest.importorskip("megatron.core")
    from slime_sparse.backends.optimizer import megatron_lr_scheduler

    optimizer = one_param_optimizer()
    ours = stepped(megatron_lr_scheduler(optimizer, optim_config(style, min_lr)), STEPS,
                   lambda s: optimizer.param_groups[0]["lr"], lambda s: s.step(1))
    assert ours == pytest.approx(megatron_as_slime_builds_it(style, min_lr, global_batch_size=64), rel=1e-12)


def test_constant_without_warmup_is_the_peak_throughout():
    assert hf_values(OptimConfig(lr=LR)) == [LR] * STEPS


def test_megatron_scheduler_keeps_weight_decay_off_biases_and_norms():
    """Megatron's scheduler sets every group's weight decay (times its wd_mult): the no-decay group stays at 0."""
    pytest.importorskip("megatron.core")
    from slime_sparse.backends.optimizer import megatron_lr_scheduler

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = adamw(model.named_parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.1)
    scheduler = megatron_lr_scheduler(optimizer, OptimConfig(lr=LR, weight_decay=0.1))
    for _ in range(3):
        scheduler.step(1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


# ----------------------------------------------------------------------------------------------- learners


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


def tiny_batch(learner) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (4, 10), generator=g).tolist()
    lens = [4] * 4
    old = learner.compute_logprobs(tokens, lens)
    return TrainBatch(tokens=tokens, response_lens=lens, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                      loss_masks=[torch.ones(n) for n in lens], old_logprobs=old, ref_logprobs=None, weights=None)


def test_embedded_learner_reports_the_schedule_and_resumes_its_position(tmp_path):
    optim = optim_config("cosine", 1e-4)
    learner = EmbeddedLearner(tiny_model(), LossConfig(), optim=optim)
    batch = tiny_batch(learner)
    first = [learner.train_step(batch)["train/lr"] for _ in range(5)]
    path = learner.save_checkpoint(str(tmp_path / "ckpt" / "rollout_000005"), step=5, data_state={})
    rest = [learner.train_step(batch)["train/lr"] for _ in range(STEPS - 5)]
    assert first + rest == pytest.approx(hf_values(optim), abs=1e-15)

    resumed = EmbeddedLearner(tiny_model(), LossConfig(), optim=optim)
    resumed.load_checkpoint(path)
    assert [resumed.train_step(batch)["train/lr"] for _ in range(STEPS - 5)] == pytest.approx(rest, abs=1e-15)

    other = EmbeddedLearner(tiny_model(), LossConfig(), optim=optim_config("linear", 1e-4))
    with pytest.raises(ValueError, match=r"another lr schedule \(--lr-decay-style cosine -> linear\)"):
        other.load_checkpoint(path)


@pytest.mark.megatron
def test_megatron_learner_reports_megatrons_schedule_and_resumes_its_position(tmp_path):
    pytest.importorskip("megatron.core")
    from slime_sparse.backends.megatron.config import MegatronConfig
    from slime_sparse.backends.megatron.learner import build_megatron_learner

    hf_dir = str(tmp_path / "hf")
    tiny_model().save_pretrained(hf_dir)
    optim = optim_config("linear", 1e-4)

    def build():
        return build_megatron_learner(hf_dir, LossConfig(), MegatronConfig(), optim)

    learner = build()
    try:
        batch = tiny_batch(learner)
        first = [learner.train_step(batch)["train/lr"] for _ in range(4)]
        path = learner.save_checkpoint(str(tmp_path / "ckpt" / "rollout_000004"), step=4, data_state={})
        rest = [learner.train_step(batch)["train/lr"] for _ in range(STEPS - 4)]
    finally:
        learner.close()
    assert first + rest == pytest.approx(megatron_as_slime_builds_it("linear", 1e-4), rel=1e-12)
    assert first + rest == pytest.approx(hf_values(optim), rel=1e-9, abs=1e-15)  # the embedded learner's too

    resumed = build()
    try:
        resumed.load_checkpoint(path)
        assert [resumed.train_step(batch)["train/lr"] for _ in range(STEPS - 4)] == pytest.approx(rest, rel=1e-12)
    finally:
        resumed.close()
