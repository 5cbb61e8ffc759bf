"""`--rollout-engine sglang --use-ray` on a local CPU Ray cluster, against fake SGLang servers.

Each fake server is its own process (tests/helpers/sglang_fakes.py), attached with --sglang-server-urls: it joins the
weight-sync group with SGLang's own steps (init_custom_process_group over a real gloo group) and receives the
broadcast buckets as SGLang's update_weights_from_distributed does. References: the learner's exported weights
(what must arrive, bit for bit), the flat plan re-derived from them, the fakes' token formula and derive_seed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from tests.helpers.sglang_fakes import fake_server_processes, fetch_state  # noqa: E402

from slime_sparse.backends.base import TrainBatch  # noqa: E402
from slime_sparse.config_loader import load_config  # noqa: E402
from slime_sparse.factory import EngineSpec  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.ray.build import build_ray_backends  # noqa: E402
from slime_sparse.ray.layout import ClusterLayout  # noqa: E402
from slime_sparse.ray.placement import RayCluster  # noqa: E402
from slime_sparse.ray.rollout_group import RayRolloutGroup, bundle_gpu_ids, engine_gpu_ids  # noqa: E402
from slime_sparse.utils.weight_sync import flat_plan  # noqa: E402
from slime_sparse.rollout.sampling import SamplingParams, derive_seed  # noqa: E402
from slime_sparse.rollout.sglang.client import DENSE_REQUEST_PARAM  # noqa: E402
from slime_sparse.rollout.sglang.worker import SGLangEngineWorker, check_ray_layout, engine_config  # noqa: E402

pytestmark = pytest.mark.ray
TIMEOUT_S = 120.0
CPUS = 0.2
BUCKET_BYTES = 20000

# Engine actors defined here are shipped to Ray workers by value (tests/ is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def flags(assets, urls, *extra):
    return [
        "--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path), "--use-ray",
        "--device", "cpu", "--rollout-engine", "sglang", "--sglang-server-urls", ",".join(urls),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--ray-cpus-per-actor", str(CPUS),
        "--ray-timeout", str(TIMEOUT_S), "--update-weight-buffer-size", str(BUCKET_BYTES), "--lr", "1e-3",
        "--kv-method", "rkv", "--kv-budget", "12", "--kv-buffer", "4", "--kv-window", "4",
        "--kv-granularity", "model", *extra,
    ]


def expected_tokens(prompt, seed, index, n):
    """The fakes' tokens for sample `index` of a call seeded `seed` (their formula, re-derived)."""
    base = sum(prompt) + derive_seed(seed, index) % 1000
    return [(base + k) % 50 for k in range(n)]


def train_once(learner, seed: int) -> None:
    """One optimizer step on random samples, so the learner's weights move."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, 20, (9,), generator=g).tolist() for _ in range(4)]
    rlens = [4] * 4
    batch = TrainBatch(tokens=tokens, response_lens=rlens, advantages=torch.randn(4, generator=g),
                       loss_masks=[torch.ones(4) for _ in rlens])
    batch.old_logprobs = learner.compute_logprobs(tokens, rlens)
    batch.ref_logprobs = batch.old_logprobs
    learner.train_step(batch)


# ------------------------------------------------------------------------------------ pure pieces (no actors)


def test_ray_layout_checks_name_the_flags(tiny_assets):
    assets = tiny_assets(n_train=16)
    cfg = EngineSpec.from_run(load_config(flags(assets, ["http://a:1", "http://b:2"])))
    check_ray_layout(cfg, num_engines=2, servers_per_engine=1, colocate=False, use_gpu=False)
    with pytest.raises(ValueError, match="--sglang-server-urls lists 2 servers.*2 engines of 2 servers = 4"):
        check_ray_layout(cfg, num_engines=2, servers_per_engine=2, colocate=False, use_gpu=False)
    launching = dataclasses.replace(cfg, sglang=dataclasses.replace(cfg.sglang, server_urls=()))
    with pytest.raises(ValueError, match="has none.*--sglang-server-urls"):
        check_ray_layout(launching, num_engines=2, servers_per_engine=1, colocate=False, use_gpu=False)
    with pytest.raises(ValueError, match="--sglang-enable-memory-saver"):
        check_ray_layout(launching, num_engines=2, servers_per_engine=1, colocate=True, use_gpu=True)
    three = dataclasses.replace(launching, sglang=dataclasses.replace(launching.sglang, num_servers=3))
    with pytest.raises(ValueError, match="--sglang-num-servers=3"):
        check_ray_layout(three, num_engines=2, servers_per_engine=2, colocate=False, use_gpu=True)

    # engine 1 of 2 x 2 servers: its own URLs; launching, ports past engine 0's and its GPUs
    four = dataclasses.replace(cfg, sglang=dataclasses.replace(cfg.sglang, server_urls=("http://a:1", "http://b:2",
                                                                                        "http://c:3", "http://d:4")))
    assert engine_config(four, 1, 2, None).server_urls == ("http://c:3", "http://d:4")
    sg = engine_config(launching, 1, 2, [5, 6])
    assert (sg.num_servers, sg.gpu_ids, sg.base_port, sg.router_port, sg.router_enabled) == (2, (5, 6), 30002, 30101,
                                                                                             True)
    assert sg.model_path == str(assets.model_dir)


def test_engine_gpus_must_share_a_node():
    assert engine_gpu_ids([("n1", [3]), ("n1", [1])], engine=0) == [3, 1]
    with pytest.raises(ValueError, match="--rollout-num-gpus-per-engine must divide"):
        engine_gpu_ids([("n1", [3]), ("n2", [0])], engine=4)


# ------------------------------------------------------------------------------------ on a local Ray cluster


@pytest.fixture(scope="module")
def local_ray():
    # two pretend GPUs for the bundle probe; the runs below use --device cpu, i.e. CPU bundles
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=16)


@pytest.fixture(scope="module")
def servers():
    with fake_server_processes(2) as urls:
        yield urls


@pytest.fixture(scope="module")
def backends(local_ray, assets, servers):
    """1 learner rank + 2 SGLang engines of 1 (fake) server each."""
    parts = build_ray_backends(load_config(flags(assets, servers)))
    yield parts
    parts.close()


def test_bundle_probe_reports_each_bundles_gpu(local_ray):
    cluster = RayCluster(ClusterLayout(learner_ranks=0, num_engines=1, bundles_per_engine=2, use_gpu=True,
                                       cpus_per_bundle=0.1), timeout_s=TIMEOUT_S)
    try:
        per_bundle = bundle_gpu_ids(cluster, cluster.layout.engine_bundles()[0], TIMEOUT_S)
    finally:
        cluster.close()
    assert sorted(engine_gpu_ids(per_bundle, 0)) == [0, 1]  # one distinct GPU per bundle, on this node


def test_broadcast_sync_puts_the_learners_exact_weights_into_every_server(backends, servers):
    engine, learner = backends.engine, backends.learner
    assert engine.mode == "broadcast" and engine.num_engines == 2
    version = engine.sync_from(learner)
    target = dict(learner.named_weights())
    plan = flat_plan([(n, tuple(t.shape), t.dtype) for n, t in target.items()], BUCKET_BYTES)
    assert len(plan.buckets) > 1  # several buckets, so their order matters
    states = [fetch_state(url) for url in servers]
    # one group of 1 + 2 servers (not actors): the servers are ranks 1 and 2 of the same group
    joined = [s.joined[-1] for s in states]
    assert sorted(j["rank_offset"] for j in joined) == [1, 2]
    assert {j["world_size"] for j in joined} == {3} and len({j["group_name"] for j in joined}) == 1
    for state in states:
        assert state.weights.keys() == target.keys()  # HF names
        for name, t in target.items():
            assert state.weights[name].dtype == t.dtype and torch.equal(state.weights[name], t), name
        assert state.weight_version == str(version) == "1"
        updates = state.requests_to("/update_weights_from_distributed")
        assert [u["names"] for u in updates] == [[s.name for s in b.slots] for b in plan.buckets]
        assert [u["shapes"] for u in updates] == [[list(s.shape) for s in b.slots] for b in plan.buckets]
        assert {(u["load_format"], u["weight_version"]) for u in updates} == {("flattened_bucket", "1")}
        assert state.calls == ["/init_weights_update_group", "/pause_generation",
                               *["/update_weights_from_distributed"] * len(plan.buckets), "/flush_cache",
                               "/continue_generation"]
    assert engine.engine_versions() == [version, version]

    # after a train step the same group carries the new weights
    train_once(learner, seed=1)
    new_target = dict(learner.named_weights())
    assert any(not torch.equal(new_target[n], t) for n, t in target.items())
    version = engine.sync_from(learner)
    for url in servers:
        state = fetch_state(url)
        assert len(state.joined) == 1 and state.weight_version == str(version) == "2"
        assert all(torch.equal(state.weights[n], t) for n, t in new_target.items())


def test_tensor_mode_hands_the_weights_to_every_server(backends, servers):
    engine, learner = backends.engine, backends.learner
    train_once(learner, seed=2)
    engine.mode = "tensor"  # the colocated default: each engine fetches rank 0's weights from the object store
    try:
        version = engine.sync_from(learner)
    finally:
        engine.mode = "broadcast"
    target = dict(learner.named_weights())
    for url in servers:
        state = fetch_state(url)
        assert state.weight_version == str(version)
        assert all(torch.equal(state.weights[n], t) for n, t in target.items())
        assert state.requests_to("/update_weights_from_tensor")[-1]["weight_version"] == str(version)


def test_rollout_over_engines_keeps_order_and_global_seeds(backends, servers):
    engine = backends.engine
    prompts = [[1, 5, 6], [2, 9], [3, 3, 3, 10], [4, 7], [5, 12, 13]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    before = [len(fetch_state(u).requests_to("/generate")) for u in servers]
    outs = engine.generate(prompts, params, seed=9)
    assert [o.prompt_ids for o in outs] == prompts
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.response_ids == expected_tokens(prompt, 9, i, 6)
        assert out.weight_version == engine.weight_version
    # contiguous shards: engine 0 (one server) got samples 0-2, engine 1 samples 3-4, seeded by global index
    seen = [{tuple(r["input_ids"]): r["sampling_params"]["sampling_seed"]
             for r in fetch_state(u).requests_to("/generate")[n:]} for u, n in zip(servers, before)]
    assert seen[0] == {tuple(prompts[i]): derive_seed(9, i) for i in range(3)}
    assert seen[1] == {tuple(prompts[i]): derive_seed(9, i) for i in range(3, 5)}


def test_dense_evaluation_view_asks_the_servers_to_skip_compression(backends, servers):
    engine = backends.engine
    before = [len(fetch_state(u).requests_to("/generate")) for u in servers]
    outs = engine.with_kv(KVCompressConfig(method="none")).generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=3),
                                                                     seed=4)
    assert len(outs) == 2
    for url, n in zip(servers, before):
        (req,) = fetch_state(url).requests_to("/generate")[n:]
        assert req["sampling_params"]["custom_params"] == {DENSE_REQUEST_PARAM: True}
    other = KVCompressConfig(method="snapkv", budget=10, buffer=2, window=2, granularity="model")
    with pytest.raises(ray.exceptions.RayTaskError, match="--kv-method=snapkv"):
        engine.with_kv(other).generate([[1, 2]], SamplingParams(max_new_tokens=3), seed=4)


class CrashOnceSGLang(SGLangEngineWorker):
    """Dies (the whole actor process) in the middle of a generate() call while its marker file exists."""

    marker_dir = ""  # set by the test before the actors are created (the class is shipped by value)

    def generate(self, prompts, params, seed, index_offset, kv=None):
        marker = os.path.join(self.marker_dir, f"crash-{self.index}")
        if os.path.exists(marker):
            os.remove(marker)
            self.engine.generate(prompts[:1], params, seed, index_offset)  # work under way when it dies
            os._exit(1)
        return super().generate(prompts, params, seed, index_offset, kv)


def test_engine_killed_mid_rollout_is_restarted_and_its_prompts_resent(backends, assets, tmp_path, monkeypatch):
    monkeypatch.setattr(CrashOnceSGLang, "marker_dir", str(tmp_path))
    learner = backends.learner
    cluster = RayCluster(ClusterLayout(learner_ranks=0, num_engines=2, cpus_per_bundle=CPUS), timeout_s=TIMEOUT_S)
    group = None
    with fake_server_processes(2) as urls:
        try:
            group = RayRolloutGroup(EngineSpec.from_run(load_config(flags(assets, urls))), cluster,
                                    actor_cls=CrashOnceSGLang)
            version = group.sync_from(learner)  # the restarted engine must bring its server these weights back
            (tmp_path / "crash-1").write_text("")
            prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
            params = SamplingParams(temperature=1.0, max_new_tokens=5)
            outs = group.generate(prompts, params, seed=3)
            assert group.num_restarts == 1 and not (tmp_path / "crash-1").exists()
            assert [o.response_ids for o in outs] == [expected_tokens(p, 3, i, 5) for i, p in enumerate(prompts)]
            assert group.engine_versions() == [version, version]
            resent = fetch_state(urls[1]).requests_to("/update_weights_from_tensor")
            assert [r["weight_version"] for r in resent] == [str(version)] * len(resent) and resent

            # the next broadcast rebuilds the group around the new actor: both servers get the new weights
            train_once(learner, seed=3)
            version = group.sync_from(learner)
            target = dict(learner.named_weights())
            for url in urls:
                state = fetch_state(url)
                assert state.weight_version == str(version) and len(state.joined) == 2
                assert all(torch.equal(state.weights[n], t) for n, t in target.items())
            # both servers left the replaced group: the surviving engine's through its actor, the restarted engine's
            # (attached, so it outlived the actor that joined it) through the replacement actor
            first_group = fetch_state(urls[0]).joined[0]
            for url in urls:
                left = fetch_state(url).requests_to("/destroy_weights_update_group")
                assert [r["group_name"] for r in left] == [first_group["group_name"]], url
        finally:
            if group is not None:
                group.close()
            cluster.close()



# ------------------------------------------------------------------------------------ the training loop end to end


def digit_share_reward(response: str, label, **kwargs) -> float:
    """Share of digits in the response: differs between the fakes' samples, so advantages (and updates) are not 0."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def test_training_loop_on_sglang_engines_syncs_evaluates_and_resumes(local_ray, assets, tmp_path):
    """slime_sparse.train.main with --rollout-engine sglang --use-ray on two attached fake servers: every rollout's
    weights reach both servers by broadcast (their final weights are the last checkpoint's, bit for bit), dense
    evaluation runs on the same servers with the opt-out, and rerunning the command resumes where it stopped."""
    from safetensors.torch import load_file

    from slime_sparse.train import main

    run = tmp_path / "run"
    with fake_server_processes(2) as urls:
        def command(num_rollout: int) -> list[str]:
            return [*flags(assets, urls), "--prompt-data", str(assets.train_path), "--run-dir", str(run),
                    "--eval-prompt-data", str(assets.test_path), "--eval-interval", "2", "--save-interval", "1",
                    "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                    "--rollout-max-response-len", "6", "--num-rollout", str(num_rollout), "--rm-num-workers", "0",
                    "--custom-rm-path", f"{__name__}:digit_share_reward", "--no-use-tensorboard", "--no-progress-bar"]

        assert main(command(2)) == 0
        assert main(command(3)) == 0  # resumed from rollout 2's checkpoint, one more rollout

        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rollouts = [r for r in rows if "rollout/reward_mean" in r]
        assert [r["step"] for r in rollouts] == [1, 2, 3]
        assert all(0 < r["kv/savings"] < 1 for r in rollouts)  # the servers' sparse_kv_kept accounting came back
        assert any("eval_dense/pass@1" in r for r in rows) and any("eval_sparse/pass@1" in r for r in rows)

        final = load_file(str(run / "checkpoints" / "rollout_000003" / "model" / "model.safetensors"))
        for url in urls:
            state = fetch_state(url)
            # the checkpoint stores a tied lm_head once; the sync sends the model's full state dict
            assert set(state.weights) - set(final) <= {"lm_head.weight"} and set(final) <= set(state.weights)
            final.setdefault("lm_head.weight", final["model.embed_tokens.weight"])
            assert all(torch.equal(state.weights[n], final[n]) for n in state.weights), url
            generate = state.requests_to("/generate")
            dense = [r for r in generate if (r["sampling_params"].get("custom_params") or {}).get(DENSE_REQUEST_PARAM)]
            assert dense and len(dense) < len(generate)  # evaluation opted out; rollouts did not
