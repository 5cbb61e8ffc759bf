"""The host side of one generate() call: which sequence sits in which cache row, what every row holds, when a row
compresses and when a sequence ends (nano-vllm's Scheduler, without pages).

- The scheduler decides; the device work it needs goes out as work orders (orders.py), which the engine's step loop
  runs on the runner and hands back: `schedule`, run, `postprocess` (the plan of a call is one generator, `_run`,
  each `yield` an order). Every per-row quantity has one owner, `rows.Rows`: the scheduler reads its host table and
  changes a row only through it. The device never tells the host any of it.
- Continuous batching: running sequences occupy rows [0, n); when one finishes, the last running row moves into its
  place and waiting prompts are admitted at the end, then prefilled (eagerly; in chunks when the cache bound demands
  it, with compressions in between).
- Decoding runs in windows of `readback` steps; between steps, every row due (`kv.should_compress`, the one trigger
  rule) is compressed in one batched `Compact`; a window's tokens come back without waiting (on CUDA the previous
  window is handed out while this one runs), so the host learns a sequence ended up to two windows late.
- Partial rollouts: once `stop` holds, the rest is aborted as it stands; continuations: continuation.py.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import numpy as np

from slime_sparse.kv import KVCompressConfig, should_compress
from slime_sparse.kv.engine_memory import FIRST_TOKEN_ROWS, PREFILL_TOKENS
from slime_sparse.rollout.partial import GroupStop
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.types import GenerationOutput
from slime_sparse.utils.faults import fault_point

from .continuation import replay_and_resume
from .orders import Compact, Decode, Prefill, ReadTokens, SampleFirst, WorkOrder
from .rows import Rows
from .sequence import KVTraceRecord, Readback, Sequence, held_trace, prompt_groups
from .stats import GenerateStats
from .step import StepShape, bucket_for

Plan = Generator[WorkOrder, Any, None]


@dataclass(frozen=True)
class SchedulerConfig:
    """What one generate() call is scheduled under."""

    kv: KVCompressConfig
    params: SamplingParams
    budgets: tuple[int, ...]  # per layer: slots kept after a compression
    capacity: int  # slots a row may fill before it must compress (during a chunked prefill too)
    context: int  # the model's max_position_embeddings
    stop_ids: frozenset[int]
    weight_version: int
    max_running: int  # sequences decoded at once (at most the cache's rows)


@dataclass
class Scheduler:
    config: SchedulerConfig
    rows: Rows
    shape: StepShape  # the runner's step geometry: row buckets, span granularity, readback window, eviction record
    waiting: deque[Sequence]
    outputs: list[GenerationOutput | None]
    stats: GenerateStats
    trace: Callable[[KVTraceRecord], None] | None = None
    stop: GroupStop | None = None  # --partial-rollout: abort the rest once this many groups finished
    running: list[Sequence] = field(default_factory=list)  # running[r] lives in cache row r
    pending: deque[Readback] = field(default_factory=deque)

    def __post_init__(self) -> None:
        cfg = self.config
        self.kv, self.params, self.capacity, self.context = cfg.kv, cfg.params, cfg.capacity, cfg.context
        self.table = self.rows.table
        self.readback = 1 if self.trace is not None else self.shape.readback  # tracing reads every step
        self._budgets = np.array(cfg.budgets, dtype=np.int64)
        self._plan, self._next = None, None  # the plan (a generator) and the order it awaits a result for

    # ---- the step loop's side (engine.py) ----
    def schedule(self) -> WorkOrder | None:
        """The next work order (None: the call is done, every output handed out)."""
        if self._plan is None:
            self._plan = self._run()
            self.postprocess(None, None)  # runs the plan up to its first order
        return self._next

    def postprocess(self, order: WorkOrder | None, result: Any) -> None:
        """`order`'s result, as the runner returned it: the scheduler goes on to its next order."""
        assert order is self._next, "postprocess of another order than the one scheduled"
        try:
            self._next = self._plan.send(result)
        except StopIteration:
            self._next = None

    # ---- the plan of a call ----
    def _run(self) -> Plan:
        rows = self.table.fill.shape[1]
        for row in range(rows):
            self.rows.park(row)
        rows = min(rows, self.config.max_running)
        while (self.waiting or self.running) and not (self.stop is not None and self.stop.reached):
            admitted: list[Sequence] = []
            while self.waiting and len(self.running) + len(admitted) < rows:
                admitted.append(self.waiting.popleft())
            if admitted:
                yield from self._admit(admitted)
                self._retire()
            if self.running:
                yield from self._decode_window()
                self._retire()
        if self.waiting or self.running:  # the stop rule was met (--partial-rollout)
            self._abort()

    # ---- prefill ----
    def _admit(self, admitted: list[Sequence]) -> Plan:
        """Prefill the admitted prompts, each distinct prompt once (GRPO's n samples of a prompt share it), and sample
        their first tokens.

        The first sample of each prompt (its leader) is prefilled in a row of its own; the others (followers) get a copy
        of that row once the prompt is done, before any decode-time compression, so they continue from the very cache
        they would have built themselves. Leaders fill rows [first, first + n_leaders), followers the rows after.
        """
        first = len(self.running)
        leaders, followers, rows_of = prompt_groups(admitted, first)
        self.running += leaders + followers
        for row in range(first, len(self.running)):
            self.rows.reset(row)
        prefill = sum(len(s.prefill_tokens) for s in leaders)
        self.stats.prefill_tokens += prefill
        self.stats.prefill_tokens_saved += sum(len(s.prefill_tokens) for s in admitted) - prefill
        # at most PREFILL_TOKENS prompt tokens per forward (whole rows, each chunk padded to the widest): a bounded,
        # counted working set (kv/engine_memory.py) however many rows are admitted at once
        per_forward = max(1, PREFILL_TOKENS // max(min(len(s.prefill_tokens), self.capacity) for s in leaders))
        for start in range(0, len(leaders), per_forward):
            yield from self._prefill(leaders[start : start + per_forward], first + start, rows_of)

    def _prefill(self, leaders: list[Sequence], first: int, rows_of: dict[int, list[int]]) -> Plan:
        """Prefill the prompts of `leaders` in rows [first, first + len(leaders)) (in chunks when the cache bound
        demands it, with compressions in between), then start their groups decoding."""
        table = self.table
        lead_rows = list(range(first, first + len(leaders)))
        while any(s.processed < len(s.prefill_tokens) for s in leaders):
            room = [self.capacity - int(table.fill[:, r].max()) for r in lead_rows]
            chunks = [s.pending_prompt(r) for s, r in zip(leaders, room)]
            fault_point("engine.step")  # chaos tests: a kill mid-rollout (prefill or decode)
            logits = yield Prefill(first, chunks, [s.processed for s in leaders],
                                   table.fill[:, first : first + len(leaders)].tolist())
            self.stats.forwards += 1
            done, cut = [], []  # leaders whose prompt ended in this chunk; rows that must compress before the next
            for b, (seq, row, chunk) in enumerate(zip(leaders, lead_rows, chunks)):
                if not chunk:
                    continue  # prompt already done: this row only rode along
                seq.processed += len(chunk)
                self.rows.prefilled(row, len(chunk))
                seq.prefill_peak = max(seq.prefill_peak, int(table.fill[:, row].max()))
                group = [self.running[r] for r in rows_of[id(seq)]]
                self._trace(row, group, range(seq.processed - len(chunk), seq.processed))
                if seq.resumed_at:  # a continuation compresses where its record says, and only there
                    replay_and_resume(self.rows, seq, row, self.params, self.context)
                elif seq.processed < len(seq.prompt):
                    if should_compress(int(table.fill[:, row].max()), self.kv):  # a long prompt, in chunks
                        cut.append((row, [seq]))
                else:
                    done.append((b, seq, group))
            if cut:
                yield from self._compress(cut)
            if done:
                yield from self._start_decoding(done, logits, rows_of)

    def _start_decoding(self, done: list[tuple[int, Sequence, list[Sequence]]], logits,
                        rows_of: dict[int, list[int]]) -> Plan:
        """Prompts prefilled (done: (batch index, leader, group)): sample every group member's first token from its
        prompt's logits, cut the prompts that a method compressing after prefill cuts, and copy each leader's row to its
        followers."""
        members = [(member, row, rows_of[id(seq)][0], b)
                   for b, seq, group in done for member, row in zip(group, rows_of[id(seq)])]
        for member, _, lead_row, _ in members:
            leader = self.running[lead_row]
            member.processed, member.prefill_peak = leader.processed, leader.prefill_peak
            member.evictions = list(leader.evictions)
        tokens, logprobs = [], []
        for start in range(0, len(members), FIRST_TOKEN_ROWS):  # a bounded sampler working set (engine_memory.py)
            part = members[start : start + FIRST_TOKEN_ROWS]
            drawn = yield SampleFirst([row for _, row, _, _ in part], logits, [b for *_, b in part], self.params,
                                      [len(m.prompt) for m, *_ in part], [m.key for m, *_ in part])
            tokens, logprobs = tokens + drawn[0], logprobs + drawn[1]
        for (member, row, lead_row, _), token, logprob in zip(members, tokens, logprobs):
            self._append(member, token, logprob)
            self.rows.started(row, min(self.params.max_new_tokens, self.context - len(member.prompt)), lead_row)
        cut = []
        for _, seq, group in done:
            live = [s for s in group if not s.finished]
            lead_row = rows_of[id(seq)][0]
            if live and should_compress(int(self.table.fill[:, lead_row].max()), self.kv, first_decode=True):
                cut.append((lead_row, live))
        if cut:
            yield from self._compress(cut)
        for _, seq, group in done:
            lead_row, *follower_rows = rows_of[id(seq)]
            for member, row in zip(group[1:], follower_rows):
                if not member.finished:
                    self.rows.share(lead_row, row)

    def _abort(self) -> None:
        """Hand out every unfinished sequence as it stands (finish_reason "abort"), every token read back."""
        while self.pending:
            self._process(self.pending.popleft())
        self._retire()
        for row, seq in [*enumerate(self.running), *((None, seq) for seq in self.waiting)]:
            self.outputs[seq.index] = self._output(row, seq, aborted=True)
        self.running, self.waiting = [], deque()

    def _output(self, row: int | None, seq: Sequence, aborted: bool = False) -> GenerationOutput:
        """What `seq` in `row` (None: never admitted) hands out (KV logs: this call's tokens)."""
        a, n, t, shape = seq.resumed_at, len(seq.response), self.table, self.shape
        kept, peak = ([], []) if row is None else (t.kept_log[row, a:n].tolist(), t.peak_log[row, a:n].tolist())
        return seq.output(self.config.weight_version, kept, peak, t.fill.shape[0], shape.record_shape,
                          shape.record_budgets, aborted)

    # ---- decode ----
    def _decode_window(self) -> Plan:
        """Up to `readback` decode steps over the running rows, then their tokens are read back (on CUDA without
        waiting: the window before this one is processed instead, so the GPU always has the next steps queued)."""
        n = len(self.running)
        table, shape = self.table, self.shape
        live = table.live(n)
        steps = min(self.readback, int((table.limit[:n] - table.issued[:n])[live].max(initial=0)))
        for _ in range(steps):
            fault_point("engine.step")
            bucket = bucket_for(n, shape.buckets)
            # parked rows of the bucket need no span: they only overwrite their own last slot, whatever the others read
            yield Decode(bucket, table.spans(n, shape.span_granularity, self.rows.capacity), self.params)
            rows = self.rows.decoded(bucket)  # live rows of [0, bucket) are live rows of [0, n): the rest are parked
            self.stats.forwards += 1
            for row in rows if self.trace is not None else ():
                seq = self.running[row]
                self._trace(row, [seq], [len(seq.prompt) + int(table.issued[row]) - 2])
            # every running row whose cache reached the trigger, in one batched call. Rows the host knows have ended
            # are left alone; one that ended unseen still compresses (its record drops it)
            due = np.flatnonzero(should_compress(table.fill[:, :n].max(axis=0), self.kv) & table.live(n))
            if len(due):
                yield from self._compress([(row, [self.running[row]]) for row in due], decode=True)
        if steps:
            self.pending.append(Readback(list(self.running), *(yield ReadTokens(n, steps))))
        while self.pending and (len(self.pending) > 1 or steps == 0 or self.readback == 1):
            self._process(self.pending.popleft())
        self.rows.check(n)  # the debug mode: host and device agree (a host sync; a no-op otherwise)

    def _compress(self, cut: list[tuple[int, list[Sequence]]], decode: bool = False) -> Plan:
        """Compress rows to their layer budgets; cut[i] = (row, the sequences that record its compression). Rows that
        hold the same slots per layer and have seen the same queries compress in one batched call."""
        table = self.table
        by_shape: dict[tuple, list[tuple[int, list[Sequence]]]] = {}
        for row, owners in cut:
            key = (tuple(int(f) for f in table.fill[:, row]), int(min(self.kv.window, table.seen[row])))
            by_shape.setdefault(key, []).append((row, owners))
        for (sizes, m), entries in by_shape.items():
            rows = [row for row, _ in entries]
            bucket = bucket_for(len(rows), self.shape.buckets) if decode else None
            packed = yield Compact(rows, sizes, m, bucket)
            self.rows.compacted(rows, self._budgets)
            for i, (row, owners) in enumerate(entries):
                # tokens run before it: while prefilling, the prompt tokens so far; after, all but the last sampled one
                start = len(owners[0].prompt) + int(table.issued[row]) - 1 if table.issued[row] else owners[0].processed
                for seq in owners:
                    seq.evictions.append((start, packed, i))
            self.stats.compressions += len(rows)
            self.stats.compaction_calls += 1

    def _process(self, readback: Readback) -> None:
        """Hand the tokens of a readback window to their sequences, stopping each at its end."""
        for seq, token, logprob in readback.hand_out():
            self._append(seq, token, logprob)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.append(token, logprob)
        if token in self.config.stop_ids:
            seq.finish_reason = "stop"
        elif len(seq.response) >= self.params.max_new_tokens or seq.length >= self.context:
            seq.finish_reason = "length"

    def _trace(self, row: int, seqs: list[Sequence], positions) -> None:
        if self.trace is not None:
            held = self.rows.held_positions(row)
            for record in held_trace(held, seqs, positions):
                self.trace(record)

    # ---- rows ----
    def _retire(self) -> None:
        """Hand out finished sequences; keep the running ones in rows [0, n) by moving the last row down."""
        for row in range(len(self.running) - 1, -1, -1):
            seq = self.running[row]
            if not seq.finished:
                continue
            self.outputs[seq.index] = self._output(row, seq)
            if self.stop is not None:
                self.stop.finished(seq.index)
            last = len(self.running) - 1
            if row != last:
                self.rows.move(last, row)
                self.running[row] = self.running[last]
            self.running.pop()
            self.rows.park(last)
