"""slime's flags in whole (tiny) training runs: --load resumes another directory's checkpoint, named
--eval-prompt-data sets are logged under their names, --use-wandb --wandb-mode offline writes the run config and the
metrics into the run's W&B files with no network, TensorBoard gets the config as text, and a cosine schedule
continues where a resumed run stopped."""
from __future__ import annotations

import glob
import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from slime_sparse.train import main
from tests.helpers.tiny_runs import read_metrics, rollout_rows
from tests.helpers.tiny_runs import run_args as args


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def final_weights(save_dir, step):
    return load_file(str(save_dir / f"rollout_{step:06d}" / "model" / "model.safetensors"))


def test_load_resumes_from_another_directory(assets, tmp_path):
    straight, first, second = tmp_path / "straight", tmp_path / "first", tmp_path / "second"
    assert main(args(assets, straight, 3)) == 0
    assert main(args(assets, first, 2)) == 0
    # a new run directory and --save, resumed from the first run's checkpoints, as slime's --load
    assert main(args(assets, second, 3, "--load", str(first / "checkpoints"))) == 0
    assert [r["step"] for r in rollout_rows(second)] == [3]  # it started after the loaded rollout 2
    assert sorted(os.listdir(second / "checkpoints")) == ["latest", "rollout_000003"]
    assert "rollout_000003" not in os.listdir(first / "checkpoints")  # the loaded directory is left alone
    a, b = final_weights(straight / "checkpoints", 3), final_weights(second / "checkpoints", 3)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert rollout_rows(second)[0]["rollout/reward_mean"] == rollout_rows(straight)[2]["rollout/reward_mean"]

    # one checkpoint directory itself, and a directory without any: a fresh start
    third = tmp_path / "third"
    assert main(args(assets, third, 3, "--load", str(first / "checkpoints" / "rollout_000002"))) == 0
    assert [r["step"] for r in rollout_rows(third)] == [3]
    fresh = tmp_path / "fresh"
    assert main(args(assets, fresh, 1, "--load", str(tmp_path / "nothing_yet"))) == 0
    assert [r["step"] for r in rollout_rows(fresh)] == [1]


def test_named_eval_sets_are_logged_under_their_names(assets, tmp_path):
    other = tmp_path / "other.jsonl"
    shutil.copy(assets.test_path, other)
    run = tmp_path / "run"
    assert main(args(assets, run, 1, "--eval-prompt-data", "tiny", str(assets.test_path), "copy", str(other),
                     "--eval-max-prompts", "2")) == 0
    evals = [r for r in read_metrics(run) if any(k.startswith("eval_") for k in r)]
    keys = set().union(*evals)
    for mode in ("dense", "sparse"):
        for name in ("tiny", "copy"):
            assert f"eval_{mode}/{name}/pass@1" in keys and f"eval_{mode}/{name}/n_prompts" in keys
    assert not any(k.startswith("eval_dense/pass@1") for k in keys)
    rows = {k: r[k] for r in evals for k in r if k.startswith("eval_")}
    # the same prompts, greedy: the two sets score alike (the last evaluation of each)
    assert rows["eval_dense/tiny/reward_mean"] == rows["eval_dense/copy/reward_mean"]
    assert rows["eval_dense/tiny/n_prompts"] == 2.0
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["evals"]["1"]) == {"dense/tiny", "dense/copy", "sparse/tiny", "sparse/copy"}

    bare = tmp_path / "bare"  # one bare path: the keys as before
    assert main(args(assets, bare, 1, "--eval-prompt-data", str(assets.test_path), "--eval-max-prompts", "2")) == 0
    assert any("eval_dense/pass@1" in r for r in read_metrics(bare))


def wandb_records(run_dir) -> list:
    """The records of the offline W&B run under `run_dir` (its .wandb file: LevelDB-style log blocks of protobuf
    Records after a 7-byte header; read here because wandb ships no Python reader for it)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(path, "rb").read()
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
        elif kind == 0 and length == 0:
            buf = b""
    return records


def test_wandb_offline_run_holds_the_config_and_the_metrics(assets, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    assert main(args(assets, run, 2, "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "proj",
                     "--wandb-group", "grp", "--wandb-run-name", "name-1", "--use-tensorboard")) == 0
    import wandb

    wandb.teardown()  # W&B's service writes the run file on its own time; a process exit waits for it, so do we
    records = wandb_records(run)
    kinds = [r.WhichOneof("record_type") for r in records]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 1, kinds
    (meta,) = runs
    assert (meta.project, meta.run_group, meta.display_name) == ("proj", "grp", "name-1")
    config = {item.key: json.loads(item.value_json) for item in meta.config.update}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    assert config["train"]["lr"] == 1e-3 and config["kv"]["method"] == "rkv"
    assert config["correction"]["preset"] == "mis" and config["log"]["wandb_group"] == "grp"
    history = [{item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                for item in r.history.item} for r in records if r.WhichOneof("record_type") == "history"]
    logged = {h["_step"]: h for h in history if "rollout/reward_mean" in h}
    rows = rollout_rows(run)
    assert sorted(logged) == [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("rollout/reward_mean", "train/loss", "kv/savings"):
            assert logged[row["step"]][key] == pytest.approx(row[key]), key

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    (text,) = acc.Tensors("config/text_summary")
    assert "lr: 0.001" in text.tensor_proto.string_val[0].decode() and "method: rkv" in text.tensor_proto.string_val[0].decode()


def test_a_cosine_schedule_continues_where_the_resumed_run_stopped(assets, tmp_path, capsys):
    # one optimizer step per rollout (--global-batch-size = 2 prompts x 4 samples), 2 warm-up steps, decay over 5
    schedule = ["--global-batch-size", "8", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--lr-warmup-iters",
                "2", "--lr-decay-iters", "5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(assets, straight, 4, *schedule)) == 0
    assert main(args(assets, resumed, 2, *schedule)) == 0
    assert main(args(assets, resumed, 4, *schedule)) == 0
    lrs = [r["train/lr"] for r in rollout_rows(straight)]
    assert [r["train/lr"] for r in rollout_rows(resumed)] == lrs
    import math

    cosine = [1e-4 + 0.5 * (1 + math.cos(math.pi * (k - 2) / 3)) * (1e-3 - 1e-4) for k in (2, 3)]
    assert lrs == pytest.approx([0.0, 0.5e-3, *cosine])  # warm-up from 0, then Megatron's cosine
    capsys.readouterr()
    assert main(args(assets, resumed, 5, *schedule[:-2], "--lr-decay-iters", "9")) == 2  # refused, in one line
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "another lr schedule (--lr-decay-iters 5 -> 9)" in error
