"""Continuous batching to a token budget per step.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: each scheduled request
computes `min(num_tokens - num_computed_tokens, budget left)` tokens. Running requests go first
(FCFS); when blocks run out the newest running request is preempted by recompute; waiting
requests are admitted in arrival order while blocks last and nobody was preempted this step
(passing over guided requests whose grammar is still compiling).

The scheduler owns each request's life, as vLLM's: `add`, `schedule()` (what to run), `launched`
(what the runner was given), `update_from_output` (its tokens applied, stop checks, finishing)
and `finish` (on every path, freeing the blocks); its `requests` table holds every request from
`add` until it finishes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tritone.config import EngineConfig
from tritone.scheduling.block_manager import BlockManager
from tritone.scheduling.request import PENDING_TOKEN, FinishReason, Request, RequestOutput, RequestStatus, \
    TopLogProbs, request_output
from tritone.scheduling.stats import EngineStats


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    # Tokens to compute this step, starting at request.num_computed_tokens.
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first, then prefills: the runner batches the one-token queries together.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that lost their blocks this step and will recompute.
    preempted: list[Request] = field(default_factory=list)
    # Rows of `scheduled` whose tokens reach the request's end: they sample a token (unfinished
    # prompt chunks only fill the cache).
    sample_rows: list[int] = field(default_factory=list)
    # Scheduled requests the runner has not met: it takes their sampling parameters once.
    new_requests: list[Request] = field(default_factory=list)
    # Requests that ended since the runner last heard: it may forget them.
    finished_ids: list[str] = field(default_factory=list)
    # Prompt scoring (params.prompt_log_probs): (row of `scheduled`, first position, count) of
    # the prompt positions whose next token's log-probability this step computes.
    prompt_scores: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class LaunchedStep:
    """A step given to the runner, until its tokens are applied."""

    handle: object  # the runner's StepHandle: sampled ids on the device, and `result()`
    scheduled: list[ScheduledRequest]
    requests: list[Request]  # the requests that sample, in the handle's row order
    indices: list[int]  # where each one's placeholder stands in its output_ids
    row_of: dict[int, int]  # id(request) -> its row in the handle
    # The requests whose prompt positions the step scores and how many, in the handle's order.
    scored: list[tuple[Request, int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 stats: EngineStats | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.stats = stats if stats is not None else EngineStats()
        # Every request from `add` until it finishes, by id.
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = []
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or (request.num_pending_tokens and len(request.output_ids) >= request.params.max_tokens):
                # (Or its last token is still on the device: it ends when that comes back.)
                running.append(request)
                continue
            while not self.block_manager.allocate(request, num_new):
                victim = self._newest_running(exclude=out.preempted)
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                running.append(request)
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        # Victims are taken newest first and never older than the request that needs the
        # blocks, so no request in `running` (nor in out.scheduled) was preempted after it was
        # put there: the newer ones this loop reaches later are the ones that may have been.
        self.running = running
        if not out.preempted:
            self._admit(out, budget)
        out.scheduled.sort(key=lambda s: s.num_tokens != 1)
        out.sample_rows = [i for i, s in enumerate(out.scheduled)
                           if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens]
        out.new_requests = [s.request for s in out.scheduled if not s.request.in_runner]
        out.finished_ids = list(self._finished_ids)
        out.prompt_scores = self._prompt_scores(out.scheduled)
        return out

    @staticmethod
    def _prompt_scores(scheduled: list[ScheduledRequest]) -> list[tuple[int, int, int]]:
        """Positions p of each scoring request's chunk whose next token p + 1 is in the prompt, and
        not scored before (a recompute after preemption scores nothing twice)."""
        spans = []
        for i, item in enumerate(scheduled):
            request = item.request
            if request.params.prompt_log_probs is None:
                continue
            first = max(request.num_computed_tokens, request.num_prompt_scored)
            end = min(request.num_computed_tokens + item.num_tokens, request.num_prompt_tokens - 1)
            if end > first:
                spans.append((i, first, end - first))
        return spans

    def launched(self, out: SchedulerOutput, handle) -> LaunchedStep:
        """Records that the runner took the step: its tokens count as computed (whatever reads
        their KV runs after them on the device), and each sampled token stands in its request's
        output as a placeholder until `update_from_output`."""
        for request in out.new_requests:
            request.in_runner = True
        del self._finished_ids[:len(out.finished_ids)]
        for item in out.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            self.stats.num_prompt_tokens += max(0, min(start + item.num_tokens, request.num_prompt_tokens) - start)
            request.num_computed_tokens += item.num_tokens
        scored = []
        for i, first, count in out.prompt_scores:
            request = out.scheduled[i].request
            request.num_prompt_scored = first + count
            scored.append((request, count))
        requests = [out.scheduled[i].request for i in out.sample_rows]
        indices = []
        for request in requests:
            indices.append(len(request.output_ids))
            request.output_ids.append(PENDING_TOKEN)
            request.output_log_probs.append(0.0)
            request.num_pending_tokens += 1
        return LaunchedStep(handle, out.scheduled, requests, indices, {id(r): row for row, r in enumerate(requests)},
                            scored)

    def update_from_output(self, step: LaunchedStep, token_ids: list[int], log_probs: list[float],
                           top: dict[int, TopLogProbs] | None = None,
                           scores: dict[int, TopLogProbs] | None = None) -> list[RequestOutput]:
        """Applies a launched step's tokens: the one loop over a step's sampled tokens (fill the
        placeholder, advance the grammar, check stop conditions, finish). `top`: by row, the top
        log-probabilities of the rows whose requests asked for them; `scores`: by row, the scored
        prompt positions' (step.scored's requests in turn). A scoring request's prompt scores go
        out with its first token."""
        if step.scored:
            row = 0
            for request, count in step.scored:
                k = request.params.prompt_log_probs
                for j in range(row, row + count):
                    entry = scores[j]
                    request.prompt_top_log_probs.append(
                        TopLogProbs(entry.log_prob, entry.token_ids[:k], entry.log_probs[:k]))
                row += count
        for item in step.scheduled:
            if not item.request.is_finished:
                self.block_manager.cache_computed_blocks(item.request)  # its KV is written now
        outputs = []
        now = time.monotonic()
        for row, (request, index, token_id, log_prob) in enumerate(zip(step.requests, step.indices, token_ids,
                                                                      log_probs)):
            if request.is_finished:
                continue  # aborted, or ended by its previous token: this one is dropped
            request.num_pending_tokens -= 1
            request.output_ids[index] = token_id
            request.output_log_probs[index] = log_prob
            # The matcher sees only tokens the engine keeps: nothing accepted is ever dropped,
            # so it never rolls back.
            if request.matcher is not None and not request.matcher.accept_token(token_id):
                self._truncate(request, index)
                self.finish(request, FinishReason.ERROR)
                outputs.append(request_output(request, [], [],
                                              f"engine error: token {token_id} broke the request's grammar"))
                continue
            self._record_latency(request, now)
            new_ids, new_lps = [token_id], [log_prob]
            reason = self._stop_reason(request, index + 1)
            if reason is not None:
                # The end id is not part of the output (stop words are text-level, matched by
                # the llm model's ResponseStream); a token launched after this one is dropped.
                if reason == FinishReason.STOP:
                    new_ids, new_lps = [], []
                self._truncate(request, index if reason == FinishReason.STOP else index + 1)
                self.finish(request, reason)
            new_top = None
            if request.params.num_top_log_probs is not None:
                new_top = [top[row]] if new_ids and top and row in top else []
            prompt_top = None
            if index == 0 and request.params.prompt_log_probs is not None:
                prompt_top = request.prompt_top_log_probs
            outputs.append(request_output(request, new_ids, new_lps, new_top=new_top, prompt_top=prompt_top))
        return outputs

    def abort(self, request_id: str, reason: FinishReason) -> Request | None:
        """Ends a request that is still here (None for one that has finished already)."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, reason)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request on any path (done, stop, cancel, error) and frees its blocks."""
        if request.is_finished:
            return
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
            self._finished_ids.append(request.request_id)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    @staticmethod
    def _truncate(request: Request, keep: int) -> None:
        del request.output_ids[keep:]
        del request.output_log_probs[keep:]
        request.num_pending_tokens = 0

    def _record_latency(self, request: Request, now: float) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            self.stats.time_to_first_token.append(now - request.arrival_time)
        else:
            self.stats.inter_token_latency.append(now - request.last_token_time)
        request.last_token_time = now
        self.stats.num_generation_tokens += 1

    @staticmethod
    def _stop_reason(request: Request, num_output: int) -> FinishReason | None:
        """Why the request ends at its output token number `num_output` (its last one resolved)."""
        if num_output >= request.params.min_tokens and request.output_ids[num_output - 1] in request.end_ids:
            return FinishReason.STOP
        if request.matcher is not None and request.matcher.is_terminated():
            return FinishReason.STOP  # the grammar is complete and its stop token taken
        if num_output >= request.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _prefix_in_flight(self, request: Request, num_cached: int) -> bool:
        """Whether a running request is computing the block that would extend this one's cached
        prefix: this one then waits for it to be published (a step or a few) rather than compute
        it again, so that requests sent together with one prompt (n choices, best_of, a batch of
        one prompt) compute its full blocks once."""
        hashes = request.block_hashes
        if not self.block_manager.enable_prefix_caching or num_cached >= len(hashes):
            return False
        wanted = hashes[num_cached]
        for other in self.running:
            if other.num_published_blocks <= num_cached < len(other.block_hashes) and \
                    other.block_hashes[num_cached] == wanted and other.num_computed_tokens < other.num_prompt_tokens:
                return True
        return False

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # A guided request whose grammar is still compiling keeps its place in the queue without
        # holding back the requests behind it.
        compiling, deferred = [], []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.grammar_future is not None:
                compiling.append(self.waiting.popleft())
                continue
            cached = self.block_manager.find_cached_blocks(request)
            if request.params.prompt_log_probs is not None:  # positions to score are computed, not reused
                cached = cached[:request.num_prompt_scored // self.block_manager.block_size]
            elif self._prefix_in_flight(request, len(cached)):
                deferred.append(self.waiting.popleft())
                continue
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:  # each prompt counts once in the hit rate
                self.block_manager.prefix_stats.record(request.num_prompt_tokens, num_cached)
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling + deferred))

    def _newest_running(self, exclude: list[Request]) -> Request:
        for request in reversed(self.running):
            if request not in exclude:
                return request
        raise AssertionError("no running request to preempt")

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
