"""Two users of one rule must agree: the rows the in-process engine admits in --rollout-kv-cache-gib
(`EmbeddedEngine.rows_for`, through `kv.engine_memory.max_rows`) and the rows `tools/plan_memory.py
--rollout-kv-cache-gib` prints for the same model, KV config and lengths. Both count on a GPU with CUDA graphs: the
engine is asked its arithmetic as it would run there (no allocation happens in `rows_for`)."""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.embedded import EmbeddedEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import plan_memory  # noqa: E402

MODEL = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
KNOBS = dict(budget=64, buffer=16, window=8)
GIB = 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    Qwen2Config(**MODEL).save_pretrained(path)
    return path


def planner_rows(model_dir: Path, method: str, prompt: int, new: int) -> dict[str, int]:
    """{row label: rows} of plan_memory's admission table."""
    argv = ["--hf-config", str(model_dir), "--dtype", "float32", "--prompt-len", str(prompt), "--max-new-tokens",
            str(new), "--kv-method", method, *[f"--kv-{k}={v}" for k, v in KNOBS.items()],
            "--rollout-kv-cache-gib", str(GIB)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_memory.main(argv)
    table = out.getvalue().split("the in-process engine in --rollout-kv-cache-gib")[1].splitlines()[2:4]
    return {line.split()[0]: int(line.split()[1].replace(",", "")) for line in table}


def engine_rows(kv: KVCompressConfig, prompt: int, new: int) -> int:
    torch.manual_seed(0)
    engine = EmbeddedEngine(Qwen2ForCausalLM(Qwen2Config(**MODEL)).eval(), kv, max_batch_size=None,
                            kv_cache_gib=GIB, readback_interval=8)
    # its count as on a GPU: graphs, the one-kernel sampler and the Triton decode attention (what the planner plans)
    engine.device, engine.step_mode = torch.device("cuda"), "cuda_graph"
    engine.fused_sampler, engine.decode_attention = True, "triton"
    return engine.rows_for(kv, prompt + new, prompt)


@pytest.mark.parametrize("method", ["rkv", "snapkv", "h2o"])
@pytest.mark.parametrize("prompt,new", [(100, 412), (100, 300)])
def test_the_planner_prints_the_rows_the_engine_admits(model_dir, method, prompt, new):
    kv = KVCompressConfig(method=method, granularity="model", **KNOBS)
    planned = planner_rows(model_dir, method, prompt, new)
    assert planned[method] == engine_rows(kv, prompt, new) > 0
    assert planned["dense"] < planned[method]  # the table is not empty or constant: compression admits more


def test_dense_rows_agree_at_a_span_multiple(model_dir):
    assert planner_rows(model_dir, "rkv", 100, 412)["dense"] == engine_rows(KVCompressConfig(), 100, 412) > 0


def test_dense_rows_agree_between_span_multiples(model_dir):
    assert planner_rows(model_dir, "rkv", 100, 300)["dense"] == engine_rows(KVCompressConfig(), 100, 300)
