"""Partial rollouts (slime's --partial-rollout): a rollout stops generating once it holds the groups it needs; the
unfinished samples are aborted, carried to the next rollout and continued there.

- `PartialSpec`, what an engine's generate() takes: each prompt's group, how many groups must finish before the rest
  is aborted (`GroupStop`), and which prompts continue an aborted output. An aborted output (finish_reason "abort")
  holds its tokens, log-probs, KV accounting, eviction record and random stream key; its continuation prefills the
  prompt and those tokens, replaying the record's compressions where they happened, so the record of the finished
  sample says what every one of its tokens saw, across the break (the shadow recompute reproduces them all), and the
  random stream goes on where it stopped (under unchanged weights: the tokens of an uninterrupted run).
- `PartialBuffer`, what the rollout function keeps between rollouts: the groups it did not train, each member with
  its output so far and the policy version (rollouts trained) that wrote each stretch of it (`Sample.segments`). Its
  state is part of a checkpoint's data state, so a resumed run continues them: every sample is trained once.
- `partial_round`: one generation round of the rollout function under --partial-rollout.
"""
from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slime_sparse.kv.record import EvictionRecord
from slime_sparse.types import GenerationOutput, KVStats, Sample

FINISHED = ("stop", "length", "skipped")


class GroupStop:
    """The stop rule of one call: `target` groups (`groups[i]`: the group of prompt i) whose every prompt finished."""

    def __init__(self, groups: list[int], target: int) -> None:
        self.groups, self.target = groups, target
        self.left: dict[int, int] = {}
        for g in groups:
            self.left[g] = self.left.get(g, 0) + 1
        self.done = 0

    def finished(self, index: int) -> None:
        g = self.groups[index]
        self.left[g] -= 1
        self.done += self.left[g] == 0

    @property
    def reached(self) -> bool:
        return self.done >= self.target


@dataclass(frozen=True)
class PartialSpec:
    """groups[i]: the group of prompt i (a group's prompts contiguous); stop_after_groups: abort the rest once this
    many groups finished (None: run every prompt to its end); resume[i]: the aborted output prompt i continues."""

    groups: tuple[int, ...]
    stop_after_groups: int | None = None
    resume: tuple[GenerationOutput | None, ...] = ()

    def check(self, prompts: list[list[int]]) -> "PartialSpec":
        resume = self.resume or (None,) * len(prompts)
        if len(self.groups) != len(prompts) or len(resume) != len(prompts):
            raise ValueError(f"partial rollout: {len(self.groups)} groups and {len(resume)} continuations for "
                             f"{len(prompts)} prompts")
        runs = [g for i, g in enumerate(self.groups) if i == 0 or g != self.groups[i - 1]]
        if len(runs) != len(set(runs)):
            raise ValueError("partial rollout: a group's prompts must be contiguous")
        for i, out in enumerate(resume):
            if out is None:
                continue
            if out.finish_reason != "abort" or out.stream_key is None:
                raise ValueError(f"partial rollout: prompt {i} continues an output that was not aborted "
                                 f"(finish_reason {out.finish_reason!r}) or has no random stream key")
            if list(out.prompt_ids) != [int(t) for t in prompts[i]]:
                raise ValueError(f"partial rollout: prompt {i} differs from the prompt of the output it continues")
        return PartialSpec(tuple(self.groups), self.stop_after_groups, tuple(resume))

    def stop(self, accepted: list[int]) -> GroupStop | None:
        """The call's stop rule; prompts not `accepted` (skipped) count as finished."""
        if self.stop_after_groups is None:
            return None
        rule = GroupStop(list(self.groups), self.stop_after_groups)
        for i in sorted(set(range(len(self.groups))) - set(accepted)):
            rule.finished(i)
        return rule

    def shards(self, count: int) -> list[tuple[range, "PartialSpec"]]:
        """Split over `count` engines at group boundaries, each shard stopping after its share of the target
        (rounded up: together at least the target)."""
        bounds = [0] + [i for i in range(1, len(self.groups)) if self.groups[i] != self.groups[i - 1]]
        n_groups = len(bounds)
        out, first = [], 0
        for k in range(count):
            last = first + n_groups // count + (k < n_groups % count)
            start, end = bounds[first] if first < n_groups else len(self.groups), \
                bounds[last] if last < n_groups else len(self.groups)
            target = None if self.stop_after_groups is None else \
                math.ceil(self.stop_after_groups * (last - first) / max(n_groups, 1))
            out.append((range(start, end), PartialSpec(self.groups[start:end], target, self.resume[start:end])))
            first = last
        return out


# ------------------------------------------------------------------------------------------------ the buffer
@dataclass
class Member:
    """One sample of a carried group: its output so far and (first token, policy version) of each stretch."""

    output: GenerationOutput
    segments: list[tuple[int, int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason in FINISHED

    def trained_versions(self, mask_offpolicy: bool) -> list[int]:
        """Policy versions of the stretches that carry a gradient (the last one only under
        --mask-offpolicy-in-partial-rollout)."""
        versions = [v for _, v in self.segments]
        return versions[-1:] if mask_offpolicy else versions


@dataclass
class PartialGroup:
    record: Any  # the PromptRecord of its prompt
    members: list[Member]

    @property
    def complete(self) -> bool:
        return all(m.finished for m in self.members)

    def samples(self) -> list[Sample]:
        return [Sample(prompt_index=self.record.index, prompt_ids=list(m.output.prompt_ids),
                       response_ids=list(m.output.response_ids), rollout_logprobs=list(m.output.logprobs),
                       finish_reason=m.output.finish_reason, label=self.record.label, kv=m.output.kv,
                       weight_version=m.output.weight_version, evictions=m.output.evictions,
                       segments=list(m.segments)) for m in self.members]


class PartialBuffer:
    """The groups carried from one rollout to the next, oldest first (see the module docstring)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.groups: list[PartialGroup] = []

    def take(self, count: int) -> list[PartialGroup]:
        taken, self.groups = self.groups[:count], self.groups[count:]
        return taken

    def carry(self, groups: list[PartialGroup]) -> None:
        self.groups = groups + self.groups

    def state_dict(self) -> list[dict]:
        return [{"index": g.record.index, "members": [_member_state(m) for m in g.members]} for g in self.groups]

    def load_state_dict(self, state: list[dict] | None) -> None:
        self.groups = [PartialGroup(_record_at(self.stream, int(g["index"])),
                                    [_member_from(m, _record_at(self.stream, int(g["index"])).prompt_ids)
                                     for m in g["members"]]) for g in state or []]


def _record_at(stream, index: int):
    """The stream's record of prompt `index` (its position in the stream, as next_batch handed it out)."""
    from slime_sparse.data.stream import record_of

    epoch, pos = divmod(index, len(stream.dataset))
    return record_of(stream.dataset[int(stream.epoch_order(epoch)[pos])], index=index, epoch=epoch)


def _member_state(m: Member) -> dict:
    out, ev = m.output, m.output.evictions
    return {"response_ids": list(out.response_ids), "logprobs": list(out.logprobs),
            "finish_reason": out.finish_reason, "weight_version": out.weight_version, "stream_key": out.stream_key,
            "kv": [out.kv.dense_kv_tokens, out.kv.kept_kv_tokens, out.kv.peak_kv_tokens, out.kv.compressions],
            "segments": [list(s) for s in m.segments],
            "evictions": None if ev is None else {
                "starts": ev.starts.tolist(), "bits": base64.b64encode(ev.keep_bits.numpy().tobytes()).decode(),
                "shape": list(ev.shape), "budgets": None if ev.budgets is None else list(ev.budgets)}}


def _member_from(state: dict, prompt_ids: list[int]) -> Member:
    ev = state["evictions"]
    record = None if ev is None else EvictionRecord(
        starts=torch.tensor(ev["starts"], dtype=torch.int64),
        keep_bits=torch.from_numpy(np.frombuffer(base64.b64decode(ev["bits"]), dtype=np.uint8).copy()),
        shape=tuple(ev["shape"]), budgets=None if ev["budgets"] is None else tuple(ev["budgets"]))
    out = GenerationOutput(prompt_ids=list(prompt_ids), response_ids=list(state["response_ids"]),
                           logprobs=[float(x) for x in state["logprobs"]], finish_reason=state["finish_reason"],
                           kv=KVStats(*state["kv"]), weight_version=int(state["weight_version"]), evictions=record,
                           stream_key=state["stream_key"])
    return Member(out, [tuple(s) for s in state["segments"]])


# ------------------------------------------------------------------------------------------------ one round
@dataclass
class PartialRound:
    """What one round made: the complete groups (in judging order: carried ones first, then fresh ones in stream
    order) and the incomplete ones, which go back to the buffer with the complete ones the batch did not need."""

    complete: list[PartialGroup]
    incomplete: list[PartialGroup]
    metrics: dict[str, float]
    generate_s: float

    def carry(self, buffer: PartialBuffer, judged: int) -> None:
        buffer.carry(self.complete[judged:] + self.incomplete)


def partial_round(cfg, data_source, rollout_id: int, size: int, need: int, seed: int) -> PartialRound:
    """Up to `size` groups, carried ones first, generated until `need` of them are complete; the others aborted.

    A carried group whose gradient-carrying tokens would be more than --max-staleness versions old when this rollout
    is trained (at policy version `rollout_id`) is regenerated from scratch instead (`rollout/partial_regenerated`)."""
    n = cfg.rollout.n_samples_per_prompt
    buffer, version = data_source.partial, data_source.policy_version
    overlap = cfg.overlap
    carried, regenerated = [], 0
    for group in buffer.take(size):
        versions = [v for m in group.members for v in m.trained_versions(overlap.mask_offpolicy_in_partial_rollout)]
        if overlap.max_staleness is not None and versions and rollout_id - min(versions) > overlap.max_staleness:
            regenerated += 1
            group = PartialGroup(group.record, [])  # its prompt, drawn anew
        carried.append(group)
    fresh = [PartialGroup(r, []) for r in data_source.stream.next_batch(size - len(carried))] if size > len(carried) \
        else []
    groups = carried + fresh
    prompts, ids, resume, where = [], [], [], []
    for g, group in enumerate(groups):
        members = group.members or [None] * n
        for j, m in enumerate(members):
            if m is None or not m.finished:
                prompts.append(group.record.prompt_ids)
                ids.append(g)
                resume.append(None if m is None else m.output)
                where.append((g, j))
    complete_before = sum(1 for group in groups if group.members and group.complete)
    t0 = time.perf_counter()
    outputs = data_source.engine.generate(prompts, cfg.sampling, seed=seed, partial=PartialSpec(
        tuple(ids), max(need - complete_before, 0), tuple(resume))) if prompts else []
    generate_s = time.perf_counter() - t0
    continued = aborted = new_tokens = 0
    for (g, j), out, before in zip(where, outputs, resume):
        group = groups[g]
        if not group.members:
            group.members = [None] * n  # type: ignore[list-item]
        old = group.members[j]
        start = 0 if before is None else len(before.response_ids)
        segments = [] if old is None else list(old.segments)
        if len(out.response_ids) > start and (not segments or segments[-1][1] != version):
            segments.append((start, version))  # a stretch per version: a later round of one rollout extends it
        continued += before is not None
        aborted += out.finish_reason == "abort"
        new_tokens += len(out.response_ids) - start
        group.members[j] = Member(out, segments)
    complete = [group for group in groups if group.complete]
    incomplete = [group for group in groups if not group.complete]
    metrics = {"rollout/partial_continued": float(continued), "rollout/partial_aborted": float(aborted),
               "rollout/partial_regenerated": float(regenerated), "rollout/partial_new_tokens": float(new_tokens)}
    return PartialRound(complete, incomplete, metrics, generate_s)
