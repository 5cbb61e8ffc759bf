"""Ray execution on a local CPU cluster: data-parallel learner ranks, engine actors, weight sync, faults.

References are independent of the code under test: a single-process EmbeddedLearner / EmbeddedEngine
on the same checkpoint and inputs, hand-computed layouts and metric merges, tensors round-tripped
through a real gloo group.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

ray = pytest.importorskip("ray")

from slime_sparse.backends.base import TrainBatch  # noqa: E402
from slime_sparse.factory import EngineSpec, LearnerSpec, build_engine, build_learner  # noqa: E402
from slime_sparse.config import ClusterConfig  # noqa: E402
from slime_sparse.config_loader import load_config  # noqa: E402
from slime_sparse.ray.build import build_ray_backends  # noqa: E402
from slime_sparse.ray.layout import ClusterLayout, order_by_node, split_contiguous  # noqa: E402
from slime_sparse.ray.learner_group import LearnerFailure, RayLearnerGroup  # noqa: E402
from slime_sparse.ray.placement import RayCluster  # noqa: E402
from slime_sparse.ray.rollout_group import EngineWorker, RayRolloutGroup  # noqa: E402
from slime_sparse.ray.utils import get  # noqa: E402
from slime_sparse.utils.weight_sync import (  # noqa: E402
    ALIGN, new_group, pack, plan_buckets, receive_weights, send_weights, unpack,
)
from slime_sparse.rollout.sampling import SamplingParams  # noqa: E402
from slime_sparse.utils.checkpoint import latest_checkpoint, load_training_state  # noqa: E402

pytestmark = pytest.mark.ray
TIMEOUT_S = 120.0  # every Ray wait in these tests
CPUS = 0.2  # per bundle: the module's groups and one extra group fit in ray.init(num_cpus=2)

# Engine actors defined here are shipped to Ray workers by value (tests/ is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------------------ pure pieces (no actors)


def test_layout_disaggregated_and_colocated():
    dis = ClusterLayout(learner_ranks=2, num_engines=3, cpus_per_bundle=0.5)
    assert dis.num_bundles == 5
    assert dis.learner_bundles() == [0, 1] and dis.engine_bundles() == [[2], [3], [4]]
    assert dis.bundle() == {"CPU": 0.5} and dis.actor_resources() == {"num_cpus": 0.5}

    col = ClusterLayout(learner_ranks=2, num_engines=3, colocate=True, use_gpu=True)
    assert col.num_bundles == 3  # max(2 learner, 3 engine devices), shared from bundle 0
    assert col.learner_bundles() == [0, 1] and col.engine_bundles() == [[0], [1], [2]]
    assert col.bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert col.actor_resources() == {"num_cpus": 0.5, "num_gpus": 0.5}  # two actors share a bundle

    tp = ClusterLayout(learner_ranks=1, num_engines=2, bundles_per_engine=2)  # e.g. SGLang TP=2 engines
    assert tp.num_bundles == 5 and tp.engine_bundles() == [[1, 2], [3, 4]]


def test_layout_from_slime_flags():
    cluster = ClusterConfig(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=8,
                            rollout_num_gpus_per_engine=2, ray_cpus_per_actor=3)
    layout = ClusterLayout.from_config(cluster, use_gpu=True)
    assert (layout.learner_ranks, layout.num_engines, layout.bundles_per_engine) == (8, 4, 2)
    assert layout.num_bundles == 16 and layout.bundle() == {"CPU": 3.0, "GPU": 1.0}


@pytest.mark.parametrize("flags, flag", [
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus"),
    (["--actor-num-nodes", "0"], "--actor-num-nodes"),
    (["--ray-cpus-per-actor", "0"], "--ray-cpus-per-actor"),
    (["--update-weight-mode", "carrier-pigeon"], "--update-weight-mode"),
    (["--ray-timeout", "-1"], "--ray-timeout"),
    (["--rollout-max-restarts", "-1"], "--rollout-max-restarts"),
])
def test_bad_cluster_flags_name_the_flag(tmp_path, flags, flag):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 2=", "label": "3"}\n')
    (tmp_path / "model").mkdir()
    with pytest.raises(ValueError, match=flag):
        load_config(["--prompt-data", str(data), "--hf-checkpoint", str(tmp_path / "model"), "--use-ray", *flags])


def test_ray_stays_optional():
    """Without ray importable, the package, the config and the embedded loop still import."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import slime_sparse.components, slime_sparse.train, slime_sparse.ray.layout, slime_sparse.utils.weight_sync")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_split_contiguous_and_node_order():
    parts = split_contiguous(7, 3)
    assert [list(p) for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(p) for p in split_contiguous(2, 4)] == [1, 1, 0, 0]
    assert order_by_node(["b", "a", "b", "a"]) == [0, 2, 1, 3]


def test_bucket_plan_packs_every_dtype_bit_exactly():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randint(-9, 9, (2, 2), generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "big": torch.randn(64, generator=g),  # 256 bytes: over the limit, a bucket of its own
        "empty": torch.zeros(0, 4),
    }
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], bucket_bytes=100)
    assert [[s.name for s in b.slots] for b in plan] == [["a", "b"], ["c", "scalar"], ["big", "empty"]]
    for bucket in plan:
        assert all(s.offset % ALIGN == 0 for s in bucket.slots)
        assert bucket.nbytes <= 100 or len([s for s in bucket.slots if s.nbytes]) == 1
    out = {}
    for bucket in plan:
        out.update(unpack(bucket, pack(bucket, tensors, torch.device("cpu")).clone()))
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _gloo_pair(fn_source, fn_engine):
    """Run a sync-group source and one engine in two threads over a real gloo group."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=30))
    results, errors = {}, {}

    def run(rank, s, fn):
        try:
            results[rank] = fn(new_group(s, rank, 2, "gloo", 30, prefix="t"))
        except Exception as exc:  # noqa: BLE001 - surfaced by the caller
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(0, store, fn_source)),
               threading.Thread(target=run, args=(1, client, fn_engine))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_gloo_sync_roundtrip_and_version_check():
    tensors = {"w": torch.randn(10, 3), "h": torch.randn(5).to(torch.bfloat16)}
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], bucket_bytes=64)
    assert len(plan) == 2
    results, errors = _gloo_pair(lambda pg: send_weights(pg, tensors, plan, 4, "gloo"),
                                 lambda pg: receive_weights(pg, plan, 4, "gloo"))
    assert not errors and results[0] == 4
    assert all(torch.equal(results[1][n], t) for n, t in tensors.items())
    # an engine told to expect another version refuses the weights (after draining the buckets)
    results, errors = _gloo_pair(lambda pg: send_weights(pg, tensors, plan, 5, "gloo"),
                                 lambda pg: receive_weights(pg, plan, 4, "gloo"))
    assert 0 in results and isinstance(errors.get(1), RuntimeError) and "version 5" in str(errors[1])


# ------------------------------------------------------------------------------------ on a local Ray cluster


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=16)


def run_config(assets, *flags):
    return load_config([
        "--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path), "--use-ray",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--ray-cpus-per-actor", str(CPUS),
        "--ray-timeout", str(TIMEOUT_S), "--update-weight-buffer-size", "20000", "--lr", "1e-3", "--clip-grad", "0",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kv-method", "rkv", "--kv-budget", "12", "--kv-buffer", "4",
        "--kv-window", "4", "--max-tokens-per-gpu", "64", *flags,
    ])


@pytest.fixture(scope="module")
def backends(local_ray, assets):
    """2 learner ranks + 2 engines in one placement group (disaggregated), shared by the tests below."""
    parts = build_ray_backends(run_config(assets))
    yield parts
    parts.close()


def make_batch(n: int = 7, seed: int = 0) -> TrainBatch:
    """Ragged samples over the tiny vocabulary; sample 3 is fully rejected (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    tokens, rlens = [], []
    for i in range(n):
        p, r = 4 + i % 3, 3 + (i * 5) % 9
        tokens.append(torch.randint(3, 20, (p + r,), generator=g).tolist())
        rlens.append(r)
    masks = [torch.ones(r) for r in rlens]
    masks[3].zero_()
    return TrainBatch(tokens=tokens, response_lens=rlens, advantages=torch.randn(n, generator=g), loss_masks=masks,
                      weights=[0.5 + torch.rand(r, generator=g) for r in rlens])


def test_two_learner_ranks_match_one_process(backends, assets):
    cfg = run_config(assets)
    local = build_learner(LearnerSpec.from_run(cfg))  # the embedded learner, in this process, on the same checkpoint
    initial = {k: v.clone() for k, v in local.model.state_dict().items()}
    group = backends.learner
    assert group.world_size == 2
    batch = make_batch()

    old = group.compute_logprobs(batch.tokens, batch.response_lens)
    ref_old = local.compute_logprobs(batch.tokens, batch.response_lens)
    assert len(old) == len(batch)
    for a, b in zip(old, ref_old):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    batch.old_logprobs = [t - 0.05 for t in ref_old]  # off-policy enough for the ratio to matter
    batch.ref_logprobs = local.compute_logprobs(batch.tokens, batch.response_lens, ref=True)

    got = group.train_step(batch)
    want = local.train_step(batch)
    for key in ("train/loss", "train/grad_norm", "pg_clipfrac", "kl_loss", "train/lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    weights = dict(group.named_weights())
    lr = cfg.train.lr
    for name, t in local.model.state_dict().items():
        # Adam moves every element by ~lr whatever |g|; where g ~ 0 the summation order of the all-reduce
        # can flip that move, so compare to a small fraction of one step rather than to float epsilon
        torch.testing.assert_close(weights[name], t, atol=0.05 * lr, rtol=1e-5)
        assert not torch.equal(t, initial[name]), name  # the step moved it: the comparison is not vacuous
    assert group.step == local.step == 1


def test_broadcast_sync_makes_every_engine_equal_the_learner_bit_for_bit(backends):
    engine, learner = backends.engine, backends.learner
    assert engine.mode == "broadcast"
    learner.train_step(_prepared(learner, make_batch(seed=1)))  # weights now differ from the engines'
    before = engine.engine_state_dict(0)
    target = dict(learner.named_weights())
    assert any(not torch.equal(before[k], target[k]) for k in target)

    version = engine.sync_from(learner)
    assert engine.engine_versions() == [version, version] and engine.weight_version == version
    for i in range(engine.num_engines):
        got = engine.engine_state_dict(i)
        assert got.keys() == target.keys()
        for name, t in target.items():
            assert torch.equal(got[name], t), (i, name)


def test_tensor_handoff_and_version_checks(backends):
    engine, learner = backends.engine, backends.learner
    learner.train_step(_prepared(learner, make_batch(seed=2)))
    engine.mode = "tensor"  # the colocated default: engines fetch rank 0's weights from the object store
    try:
        version = engine.sync_from(learner)
    finally:
        engine.mode = "broadcast"
    target = dict(learner.named_weights())
    for i in range(engine.num_engines):
        assert all(torch.equal(engine.engine_state_dict(i)[k], t) for k, t in target.items())
    with pytest.raises(ValueError, match="not newer"):
        engine.update_weights(target, version=version)  # driver side refuses a stale version
    with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):
        get(engine.engines[0].load_weights.remote(target, version), "stale load", TIMEOUT_S)  # engine side too


def _prepared(learner, batch: TrainBatch) -> TrainBatch:
    batch.old_logprobs = learner.compute_logprobs(batch.tokens, batch.response_lens)
    batch.ref_logprobs = learner.compute_logprobs(batch.tokens, batch.response_lens, ref=True)
    return batch


PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 4], [1, 3, 3, 3, 10, 11], [1, 7], [1, 12, 13, 5], [1, 6, 6]]


def _local_engine(assets, weights):
    engine = build_engine(EngineSpec.from_run(run_config(assets)))  # the embedded engine in this process
    engine.update_weights(weights)
    return engine


def test_rollout_spread_over_engines_equals_one_engine(backends, assets):
    engine = backends.engine
    engine.sync_from(backends.learner)
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    got = engine.generate(PROMPTS, params, seed=123)
    want = _local_engine(assets, dict(backends.learner.named_weights())).generate(PROMPTS, params, seed=123)
    assert [o.response_ids for o in got] == [o.response_ids for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
        assert a.kv == b.kv and a.weight_version == engine.weight_version
    assert any(o.kv.compressions > 0 for o in got)  # the sparse path ran


class CrashOnceEngine(EngineWorker):
    """Dies (the whole actor process) in the middle of a generate() call while its marker file exists."""

    marker_dir = ""  # set by the test before the actors are created (the class is shipped by value)

    def generate(self, prompts, params, seed, index_offset, kv=None):
        marker = os.path.join(self.marker_dir, f"crash-{self.index}")
        if os.path.exists(marker):
            os.remove(marker)
            self.engine.generate(prompts[:1], params, seed=seed)  # work under way when it dies
            os._exit(1)
        return super().generate(prompts, params, seed, index_offset, kv)


def test_engine_killed_mid_rollout_is_restarted_and_its_prompts_resent(backends, assets, tmp_path, monkeypatch):
    monkeypatch.setattr(CrashOnceEngine, "marker_dir", str(tmp_path))
    learner = backends.learner
    cluster = RayCluster(ClusterLayout(learner_ranks=0, num_engines=2, cpus_per_bundle=CPUS), timeout_s=TIMEOUT_S)
    group = None
    try:
        group = RayRolloutGroup(EngineSpec.from_run(run_config(assets)), cluster, actor_cls=CrashOnceEngine)
        version = group.sync_from(learner)  # a restarted engine must get these weights, not the checkpoint's
        (tmp_path / "crash-1").write_text("")
        params = SamplingParams(temperature=1.0, max_new_tokens=16)
        got = group.generate(PROMPTS, params, seed=7)
        assert group.num_restarts == 1 and not (tmp_path / "crash-1").exists()
        want = _local_engine(assets, dict(learner.named_weights())).generate(PROMPTS, params, seed=7)
        assert [o.response_ids for o in got] == [o.response_ids for o in want]
        assert group.engine_versions() == [version, version]

        # the next sync rebuilds the broadcast group around the new actor
        learner.train_step(_prepared(learner, make_batch(seed=3)))
        version = group.sync_from(learner)
        target = dict(learner.named_weights())
        for i in range(group.num_engines):
            assert all(torch.equal(group.engine_state_dict(i)[k], t) for k, t in target.items())

        (tmp_path / "crash-0").write_text("")
        group.max_restarts = 0
        with pytest.raises(RuntimeError, match="--rollout-max-restarts=0"):
            group.generate(PROMPTS, params, seed=7)
    finally:
        if group is not None:
            group.close()
        cluster.close()


def test_learner_rank_death_stops_the_run_and_keeps_the_checkpoint(local_ray, assets, tmp_path):
    cfg = run_config(assets)
    cluster = RayCluster(ClusterLayout(learner_ranks=2, num_engines=0, cpus_per_bundle=CPUS), timeout_s=TIMEOUT_S)
    group = None
    try:
        group = RayLearnerGroup(LearnerSpec.from_run(cfg), cluster)
        batch = _prepared(group, make_batch())
        group.train_step(batch)
        ckpt = group.save_checkpoint(str(tmp_path / "ckpt" / "rollout_000001"), step=1, data_state={"pos": 3},
                                     extra={"learner_step": 1})
        saved = dict(group.named_weights())
        ray.kill(group.workers[1], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(LearnerFailure, match="rank 1 died.*rerun the same command"):
            group.train_step(batch)
        assert time.monotonic() - t0 < TIMEOUT_S / 2  # fails fast, not at the collective's timeout
    finally:
        if group is not None:
            group.close()
        cluster.close()
    assert latest_checkpoint(str(tmp_path / "ckpt")) == ckpt
    model = build_learner(LearnerSpec.from_run(cfg)).model
    state = load_training_state(ckpt, model, restore_rng=False)
    assert state["step"] == 1 and state["data_state"] == {"pos": 3}
    assert all(torch.equal(t, saved[n]) for n, t in model.state_dict().items())
