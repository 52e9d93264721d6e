"""Continuous batching to a token budget per step.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: each scheduled request
computes `min(num_tokens - num_computed_tokens, budget left)` tokens. Running requests go first
(FCFS); when blocks run out the newest running request is preempted by recompute; waiting
requests are admitted in arrival order while blocks last and nobody was preempted this step
(passing over guided requests whose grammar is still compiling).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tritone.config import EngineConfig
from tritone.scheduling.block_manager import BlockManager
from tritone.scheduling.request import FinishReason, Request, RequestStatus


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

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
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
        return out

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request on any path (done, stop, cancel, error) and frees its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # A guided request whose grammar is still compiling keeps its place in the queue without
        # holding back the requests behind it.
        compiling = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.grammar_future is not None:
                compiling.append(self.waiting.popleft())
                continue
            cached = self.block_manager.find_cached_blocks(request)
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
        self.waiting.extendleft(reversed(compiling))

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
