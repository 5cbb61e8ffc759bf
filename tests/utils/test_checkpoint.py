"""Training checkpoints: exact resume (weights, optimizer, scheduler, RNG, data position), atomicity, pruning."""
from __future__ import annotations

import copy
import json
import os
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

import slime_sparse.utils.checkpoint as ckpt
from slime_sparse.utils.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_training_state,
    save_hf,
    save_training_state,
)
from slime_sparse.utils.seed import get_rng_state, set_rng_state, set_seed

VOCAB = 24


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,  # exercises the tied-weight path of the loader
    )
    return AutoModelForCausalLM.from_config(cfg)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{str(i): i + 1 for i in range(10)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def make_run(seed: int):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))  # warmup: lr changes per step
    return model, opt, sched


def train_step(model, opt, sched) -> None:
    """One step on a batch drawn from the global torch RNG, so an unrestored RNG changes the result."""
    tokens = torch.randint(0, VOCAB, (2, 6))
    loss = model(input_ids=tokens, labels=tokens).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save(path, model, opt, sched, step, **kw):
    return save_training_state(
        str(path), model=model, optimizer=opt, scheduler=sched, step=step, data_state={"consumed": 3 * step}, **kw
    )


def test_resume_continues_bit_exactly(tmp_path):
    set_seed(0)
    model, opt, sched = make_run(seed=0)
    for _ in range(2):
        train_step(model, opt, sched)
    path = save(tmp_path / "ckpt" / "step_2", model, opt, sched, 2, extra={"learner_step": 8})
    saved_params, saved_opt, saved_sched = params(model), copy.deepcopy(opt.state_dict()), sched.state_dict()
    for _ in range(2):
        train_step(model, opt, sched)
    straight = params(model)

    model2, opt2, sched2 = make_run(seed=1)  # different init: everything must come from the checkpoint
    state = load_training_state(path, model2, opt2, sched2)

    assert state == {"step": 2, "data_state": {"consumed": 6}, "extra": {"learner_step": 8}}
    for k, v in params(model2).items():
        assert torch.equal(v, saved_params[k]), k
    loaded_opt = opt2.state_dict()
    assert loaded_opt["param_groups"] == saved_opt["param_groups"]
    for pid, st in saved_opt["state"].items():
        for name, value in st.items():
            assert torch.equal(loaded_opt["state"][pid][name], value), (pid, name)
    assert sched2.state_dict() == saved_sched and sched2.get_last_lr() == [pytest.approx(1e-2)]
    for _ in range(2):
        train_step(model2, opt2, sched2)
    for k, v in params(model2).items():
        assert torch.equal(v, straight[k]), k


def test_rng_states_are_restored(tmp_path):
    set_seed(123)
    model, opt, sched = make_run(seed=0)
    path = save(tmp_path / "c" / "s1", model, opt, sched, 1)
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2).tolist())
    random.random(), np.random.rand(5), torch.rand(7)  # move every stream on

    load_training_state(path, model, opt, sched)
    again = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2).tolist())
    assert again == draws


def test_set_seed_and_rng_state_helpers():
    set_seed(5)
    a = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    set_seed(5)
    state = get_rng_state()
    b = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    set_seed(6)
    c = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    set_rng_state(state)
    d = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    assert a == b == d
    assert a[0] != c[0] and a[1] != c[1] and a[2] != c[2]
    with pytest.raises(ValueError, match="seed"):
        set_seed(-1)


def test_checkpoint_model_dir_and_save_hf_load_with_from_pretrained(tmp_path):
    model, opt, sched = make_run(seed=0)
    tok = tiny_tokenizer()
    path = save(tmp_path / "c" / "s1", model, opt, sched, 1, tokenizer=tok)
    exported = save_hf(model, tok, str(tmp_path / "export"))

    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    for directory in (os.path.join(path, "model"), exported):
        assert any(f.endswith(".safetensors") for f in os.listdir(directory))
        reloaded = AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            assert torch.equal(reloaded(input_ids=tokens).logits, expected)
        assert AutoTokenizer.from_pretrained(directory)("3 4")["input_ids"] == [4, 5]


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpts"
    model, opt, sched = make_run(seed=0)
    first = save(save_dir / "step_1", model, opt, sched, 1)
    train_step(model, opt, sched)

    def crash(*args, **kwargs):  # fails after model/ and optimizer.pt were written into the tmp dir
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "get_rng_state", crash)
    with pytest.raises(OSError, match="disk full"):
        save(save_dir / "step_2", model, opt, sched, 2)

    assert sorted(os.listdir(save_dir)) == ["latest", "step_1"]  # no step_2, tmp dir removed
    assert latest_checkpoint(str(save_dir)) == first
    model2, opt2, sched2 = make_run(seed=1)
    assert load_training_state(first, model2, opt2, sched2)["step"] == 1


def test_hard_crash_leftover_is_invisible_and_cleaned(tmp_path):
    save_dir = tmp_path / "ckpts"
    model, opt, sched = make_run(seed=0)
    first = save(save_dir / "step_1", model, opt, sched, 1)
    # What a killed process leaves: a tmp dir with part of the files, even a trainer_state.json.
    partial = save_dir / "tmp-step_2"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "model.safetensors").write_bytes(b"\x00" * 10)
    (partial / "trainer_state.json").write_text(json.dumps({"format_version": 1, "step": 2}))

    assert latest_checkpoint(str(save_dir)) == first
    assert [step for step, _ in list_checkpoints(str(save_dir))] == [1]
    save(save_dir / "step_3", model, opt, sched, 3)
    assert sorted(os.listdir(save_dir)) == ["latest", "step_1", "step_3"]


def test_latest_marker_and_fallback(tmp_path):
    save_dir = tmp_path / "ckpts"
    model, opt, sched = make_run(seed=0)
    assert latest_checkpoint(str(save_dir)) is None
    save(save_dir / "rollout_000010", model, opt, sched, 10)
    save(save_dir / "rollout_000005", model, opt, sched, 5)  # the marker follows the last save, not the name
    assert (save_dir / "latest").read_text().strip() == "rollout_000005"
    assert latest_checkpoint(str(save_dir)).endswith("rollout_000005")

    (save_dir / "latest").write_text("gone\n")  # marker pointing at a missing dir: newest step wins
    assert latest_checkpoint(str(save_dir)).endswith("rollout_000010")
    os.remove(save_dir / "latest")
    assert latest_checkpoint(str(save_dir)).endswith("rollout_000010")


def test_keep_last_prunes_oldest(tmp_path):
    save_dir = tmp_path / "ckpts"
    model, opt, sched = make_run(seed=0)
    for step in range(1, 5):
        save(save_dir / f"step_{step}", model, opt, sched, step, keep_last=2)
    assert sorted(os.listdir(save_dir)) == ["latest", "step_3", "step_4"]
    assert latest_checkpoint(str(save_dir)).endswith("step_4")


def test_resaving_a_name_replaces_it(tmp_path):
    save_dir = tmp_path / "ckpts"
    model, opt, sched = make_run(seed=0)
    save(save_dir / "final", model, opt, sched, 1)
    train_step(model, opt, sched)
    path = save(save_dir / "final", model, opt, sched, 2)
    assert sorted(os.listdir(save_dir)) == ["final", "latest"]
    model2, opt2, sched2 = make_run(seed=1)
    assert load_training_state(path, model2, opt2, sched2)["step"] == 2
    assert all(torch.equal(v, params(model)[k]) for k, v in params(model2).items())


def test_plain_module_with_shared_weights_round_trips(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        net[2].weight = net[0].weight  # shared parameter, stored once
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    net, opt = build(0)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = save_training_state(str(tmp_path / "c" / "s"), model=net, optimizer=opt, step=1, data_state={})
    net2, opt2 = build(1)
    load_training_state(path, net2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), net2.state_dict().values()))
    assert net2[2].weight is net2[0].weight  # still tied after loading
    momentum = lambda o: o.state_dict()["state"][0]["momentum_buffer"]  # noqa: E731
    assert torch.equal(momentum(opt2), momentum(opt))


def test_bad_inputs_are_rejected_before_writing(tmp_path):
    model, opt, sched = make_run(seed=0)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_training_state(str(tmp_path / "c" / "s"), model=model, optimizer=opt, step=1, data_state={"x": object()})
    with pytest.raises(ValueError, match="step"):
        save_training_state(str(tmp_path / "c" / "s"), model=model, optimizer=opt, step=-1, data_state={})
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match="not a complete training checkpoint"):
        load_training_state(str(tmp_path), model, opt)
    with pytest.raises(ValueError, match="tmp-"):
        save_hf(model, None, str(tmp_path / "tmp-export"))


def test_loading_into_a_different_architecture_fails_clearly(tmp_path):
    model, opt, sched = make_run(seed=0)
    path = save(tmp_path / "c" / "s1", model, opt, sched, 1)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="weights not in the model"):
        load_training_state(path, other)


def test_cuda_rng_state_from_another_machine_is_skipped_with_a_warning(caplog):
    state = get_rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)  # a device count we lack
    expected = torch.rand(2)
    with caplog.at_level("WARNING", logger="slime_sparse.utils.seed"):
        set_rng_state(state)
    assert torch.equal(torch.rand(2), expected)  # the CPU stream was still restored
    assert "CUDA RNG state for" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_and_optimizer_state_round_trip(tmp_path):
    model, opt, sched = make_run(seed=0)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (2, 6), device="cuda")
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    path = save_training_state(str(tmp_path / "c" / "s"), model=model, optimizer=opt, step=1, data_state={})
    draws = torch.rand(4, device="cuda")

    model2 = tiny_model(seed=1).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    load_training_state(path, model2, opt2)
    assert torch.equal(torch.rand(4, device="cuda"), draws)
    assert opt2.state_dict()["state"][0]["exp_avg"].device.type == "cuda"
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
