"""Weights into SGLang servers: the learner-side plan and group against SGLang's own receiving code.

Independent references: SGLang's FlattenedTensorBucket and SafeUnpickler, run from the pinned wheel's source
(downloaded once into .cache/, as the contract tests do; only their own few imports are needed), and the fake
server's receiving side (tests/helpers/sglang_fakes.py), which joins its group with SGLang's init_custom_process_group steps.
"""
from __future__ import annotations

import ast
import base64
import io
import pickle
import runpy
import shutil
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tests.helpers.sglang_fakes import FakeSGLang, join_like_sglang, receive_flattened_bucket

from sglang_patches.source import fetch_sglang_source
from slime_sparse.utils.weight_sync import (
    FlatPlan,
    flat_plan,
    layout_of,
    new_group,
    open_store,
    pack,
    plan_buckets,
    send_weights,
)
from slime_sparse.rollout.sglang import DistributedWeightSync, SGLangRolloutEngine, serialize_named_tensors


def layout(tensors: dict[str, torch.Tensor]):
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(5, 3, generator=g),
        "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: the next fp32 is misaligned
        "lm_head.weight": torch.randn(4, 3, generator=g),
        "counts": torch.randint(-5, 5, (3,), generator=g),
        "empty": torch.zeros(0, 2),
        "big": torch.randn(40, generator=g),  # 160 bytes > the 100-byte limit below: a bucket of its own
    }


@pytest.fixture(scope="module")
def pinned():
    return fetch_sglang_source() / "sglang"


def test_flat_plan_packs_back_to_back_and_splits_where_sglang_could_not_view(pinned):
    tensors = mixed_tensors()
    plan = flat_plan(layout(tensors), bucket_bytes=100)
    names = [[s.name for s in b.slots] for b in plan.buckets]
    # 60 fp32 bytes, then 6 bf16 bytes; lm_head (fp32) at offset 66 would not be 4-aligned -> new bucket;
    # 48 + 24 int64 + 0; big alone
    assert names == [["model.embed_tokens.weight", "model.norm.weight"], ["lm_head.weight", "counts", "empty"],
                     ["big"]]
    for bucket in plan.buckets:
        offsets = [s.offset for s in bucket.slots]
        assert offsets == [sum(s.nbytes for s in bucket.slots[:i]) for i in range(len(bucket.slots))]  # no padding
        assert bucket.nbytes == sum(s.nbytes for s in bucket.slots)
    assert layout_of(plan) == layout(tensors) == layout_of(plan_buckets(layout(tensors), 100))

    # SGLang's own FlattenedTensorBucket, from the pinned source: the same buffer, and it rebuilds our tensors
    tb = runpy.run_path(str(pinned / "srt" / "weight_sync" / "tensor_bucket.py"))
    for bucket in plan.buckets:
        ours = pack(bucket, tensors, torch.device("cpu"))
        theirs = tb["FlattenedTensorBucket"](named_tensors=[(s.name, tensors[s.name]) for s in bucket.slots])
        assert torch.equal(ours, theirs.get_flattened_tensor())
        rebuilt = tb["FlattenedTensorBucket"](flattened_tensor=ours, metadata=theirs.get_metadata())
        for name, t in rebuilt.reconstruct_tensors():
            assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name]), name


def test_tensor_payload_passes_sglangs_safe_unpickler(pinned):
    """update_weights_from_tensor reads the payload with MultiprocessingSerializer.deserialize, i.e. base64 then
    SafeUnpickler (allow-listed modules only); our by-value pickle must get through it intact."""
    source = (pinned / "srt" / "utils" / "common.py").read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler"]
    namespace = {"pickle": pickle}
    exec(ast.get_source_segment(source, cls), namespace)  # noqa: S102 - the pinned SGLang's own class
    tensors = mixed_tensors()
    view = torch.arange(20.0).reshape(4, 5)[:, 2]  # a strided view of a larger storage
    payload = serialize_named_tensors([*tensors.items(), ("view", view)])
    named = namespace["SafeUnpickler"](io.BytesIO(base64.b64decode(payload, validate=True))).load()
    assert [n for n, _ in named] == [*tensors, "view"]
    for (name, got), want in zip(named, [*tensors.values(), view]):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert named[-1][1].untyped_storage().nbytes() == 4 * 4  # the view's 4 values, not its base's 20

    class Evil:
        def __reduce__(self):
            return (shutil.which, ("sh",))  # any module off the allow-list

    with pytest.raises(RuntimeError, match="Blocked"):  # the reference really filters
        namespace["SafeUnpickler"](io.BytesIO(pickle.dumps(Evil()))).load()


def run_pair(source, member):
    """`source(store)` as rank 0 (ours) and `member(port)` as rank 1 (SGLang's way) in two threads."""
    store = open_store("127.0.0.1", 2, timeout_s=30)
    results, errors = {}, {}

    def run(key, fn, arg):
        try:
            results[key] = fn(arg)
        except Exception as exc:  # noqa: BLE001 - surfaced by the caller
            errors[key] = exc

    threads = [threading.Thread(target=run, args=("member", member, store.port)),
               threading.Thread(target=run, args=("source", source, store))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_our_group_and_sglangs_form_one_group_and_flat_buckets_arrive_exactly():
    tensors = mixed_tensors()
    plan = flat_plan(layout(tensors), bucket_bytes=100)

    def source(store):
        group = new_group(store, 0, 2, "gloo", 30, prefix="weights-a")
        return send_weights(group, tensors, plan, 7, "gloo")  # no header: the member receives buckets only

    def member(port):
        group = join_like_sglang("127.0.0.1", port, 1, 2, "weights-a", "gloo")
        got = {}
        for bucket in plan.buckets:
            got.update(receive_flattened_bucket(group, [s.name for s in bucket.slots],
                                                [str(s.dtype).removeprefix("torch.") for s in bucket.slots],
                                                [list(s.shape) for s in bucket.slots]))
        return got

    results = run_pair(source, member)
    assert results["source"] == 7
    assert results["member"].keys() == tensors.keys()
    for name, t in tensors.items():
        assert results["member"][name].dtype == t.dtype and torch.equal(results["member"][name], t), name


def test_distributed_weight_sync_into_a_server_end_to_end():
    """This process as rank 0, the fake server as rank 1 of one gloo group (world = 1 + servers): exact weights under
    their names, pause -> one update per bucket -> flush -> continue, and the version the server then reports."""
    tensors = mixed_tensors()
    with FakeSGLang() as fake:
        sync = DistributedWeightSync(group_name="w-e2e", bucket_bytes=100, timeout_s=30)
        engine = SGLangRolloutEngine([fake.url], None, weight_sync=sync, timeout_s=30)
        sync.init(engine.clients, "127.0.0.1", backend="gloo")
        (joined,) = fake.joined
        assert (joined["rank_offset"], joined["world_size"], joined["group_name"], joined["backend"]) == \
            (1, 2, "w-e2e", "gloo")
        engine.update_weights(tensors)
        for name, t in tensors.items():
            assert fake.weights[name].dtype == t.dtype and torch.equal(fake.weights[name], t), name
        plan = flat_plan(layout(tensors), 100)
        updates = [r for r in fake.requests if r["path"] == "/update_weights_from_distributed"]
        assert [u["names"] for u in updates] == [[s.name for s in b.slots] for b in plan.buckets]
        assert updates[0]["dtypes"] == ["float32", "bfloat16"] and updates[1]["shapes"] == [[4, 3], [3], [0, 2]]
        assert {(u["load_format"], u["weight_version"], u["group_name"], u["flush_cache"]) for u in updates} == \
            {("flattened_bucket", "1", "w-e2e", False)}
        control = [c for c in fake.calls if c != "/update_weights_from_distributed"]
        assert control == ["/init_weights_update_group", "/pause_generation", "/flush_cache", "/continue_generation"]
        assert fake.weight_version == "1"

        # a second sync reuses the group: new values arrive, no new join
        tensors2 = {n: (t + 1 if t.is_floating_point() else t - 1) for n, t in tensors.items()}
        engine.update_weights(tensors2)
        assert len(fake.joined) == 1 and fake.weight_version == "2"
        assert all(torch.equal(fake.weights[n], t) for n, t in tensors2.items())


def test_flat_plan_is_what_a_framed_plan_carries():
    """The driver turns the learner's (framed) plan into the flat one: same tensors, same order."""
    tensors = mixed_tensors()
    framed = plan_buckets(layout(tensors), 64)
    flat = flat_plan(layout_of(framed), 64)
    assert isinstance(flat, FlatPlan) and layout_of(flat) == layout(tensors)
    assert all(b.nbytes <= 64 or len(b.slots) == 1 for b in flat.buckets)


def test_new_group_refuses_an_unknown_backend():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(ValueError, match="'mpi' is invalid"):
        new_group(store, 0, 1, "mpi", 5, prefix="x")
