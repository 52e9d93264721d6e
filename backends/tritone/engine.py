"""The engine: schedule, run the model, sample, update; and the thread that drives it."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from concurrent import futures
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import GenerationConfig

from tritone.block_manager import BlockManager
from tritone.config import EngineConfig
from tritone.executor import ModelRunner
from tritone.executor.step import PendingTokens
from tritone.grammar import Grammars
from tritone.request import PENDING_TOKEN, FinishReason, Request, RequestOutput, SamplingParams
from tritone.sampler import Sampler, needs_logits
from tritone.scheduler import Scheduler

logger = logging.getLogger(__name__)


# Where a step's time goes, in order: the engine thread's phases, then the sender thread's
# (building and sending the step's responses, which overlaps the next step).
PHASES = ("schedule", "prepare", "forward", "sample", "update", "send")


@dataclass(slots=True)
class EngineStats:
    """Running totals, read by the metrics reporter from another thread (plain ints and floats,
    and lists it swaps out, so no lock is needed under the GIL)."""

    num_steps: int = 0
    # Seconds per phase (PHASES), summed over steps.
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # The engine thread's seconds waiting for work (no request running).
    idle_seconds: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)

    @property
    def forward_seconds(self) -> float:
        return self.phase_seconds["forward"]

    def take_latencies(self) -> tuple[list[float], list[float]]:
        ttft, self.time_to_first_token = self.time_to_first_token, []
        itl, self.inter_token_latency = self.inter_token_latency, []
        return ttft, itl


def model_end_ids(model_dir: str, hf_config) -> frozenset[int]:
    ids = []
    try:
        ids.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass
    ids.append(hf_config.get_text_config().eos_token_id)
    flat = set()
    for item in ids:
        if isinstance(item, int):
            flat.add(item)
        elif item:
            flat.update(item)
    return frozenset(flat)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.runner.max_model_len)
        self.default_end_ids = model_end_ids(config.model, self.runner.hf_config)
        self.grammars = Grammars(config.model, self.vocab_size, list(self.default_end_ids))
        self.sampler = Sampler(self.grammars)
        # Guided requests whose grammar is still compiling.
        self._compiling: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        # Overlap the host's work for step N + 1 with the device's for step N: where the device
        # runs asynchronously (CUDA), unless configured off; `on` elsewhere runs the same logic.
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.device.type == "cuda")
        self._in_flight: _InFlight | None = None

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def validate(self, prompt_ids: list[int], params: SamplingParams, num_queued: int = 0) -> None:
        """Raises ValueError naming the field when the request can never be served, and
        RuntimeError when the queue (waiting requests, plus `num_queued` not yet added) is full."""
        params.validate(self.vocab_size)
        if params.guide is not None:
            params.guide.check()
        if not prompt_ids:
            raise ValueError("input_ids is empty: the prompt must have at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"input_ids holds ids outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds the model's limit of {self.max_model_len} tokens")
        if self.block_manager.num_blocks_for(total) > self.block_manager.num_blocks:
            raise ValueError(f"prompt plus max_tokens ({total} tokens) exceeds the KV cache "
                             f"({self.block_manager.num_blocks * self.config.block_size} tokens)")
        if self.config.max_queue_len and len(self.scheduler.waiting) + num_queued >= self.config.max_queue_len:
            raise RuntimeError("server busy: the request queue is full, retry later")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        # On the host whatever the device: a draw from it is no device sync.
        generator = torch.Generator().manual_seed(seed)
        if params.end_id == -1:
            end_ids = frozenset()
        elif params.end_id is not None:
            end_ids = frozenset([params.end_id])
        else:
            end_ids = self.default_end_ids
        request = Request(request_id, list(prompt_ids), params, arrival_time=time.monotonic(),
                          generator=generator, end_ids=end_ids)
        if params.guide is not None:
            request.grammar_future = self.grammars.compile(params.guide)
            self._compiling.append(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED,
                      error: str | None = None) -> RequestOutput | None:
        """Ends a request that is still in the engine, freeing its blocks, and returns its final
        output (None for one that has finished already)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, reason)
        output = self._output(request, [], [])
        output.error = error
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @torch.inference_mode()  # the runner's logits are inference tensors, and the sampler edits them
    def step(self) -> list[RequestOutput]:
        """Runs one step and returns its outputs. With async scheduling, it launches this step and
        returns the previous one's outputs: the device computes step N while the host schedules
        and prepares N + 1 and then updates N (see `_launch`)."""
        failed = self._resolve_grammars() if self._compiling else []
        if not self.async_scheduling:
            launched = self._launch()
            return failed + self._collect(launched) if launched is not None else failed
        outputs = failed
        if self._in_flight is not None and any(_reads_history(r) for r in self._in_flight.requests):
            # Penalties and bad words read the tokens that are still on the device: take them first.
            outputs = outputs + self._collect(self._in_flight)
            self._in_flight = None
        launched = self._launch()
        if self._in_flight is not None:
            outputs = outputs + self._collect(self._in_flight)
        self._in_flight = launched
        return outputs

    def _resolve_grammars(self) -> list[RequestOutput]:
        """Gives each guided request whose grammar has compiled its matcher (the scheduler admits
        it from then on), and fails those whose grammar could not compile. Where nothing else can
        run, waits a little for a compile rather than spinning."""
        if not self.scheduler.running and not any(r.grammar_future is None for r in self.scheduler.waiting):
            futures.wait([r.grammar_future for r in self._compiling], timeout=0.005,
                         return_when=futures.FIRST_COMPLETED)
        outputs, compiling = [], []
        for request in self._compiling:
            future = request.grammar_future
            if request.is_finished:
                continue
            if not future.done():
                compiling.append(request)
                continue
            request.grammar_future = None
            try:
                request.matcher = self.grammars.matcher(future.result())
            except Exception as exc:
                outputs.append(self.abort_request(request.request_id, FinishReason.ERROR, str(exc)))
        self._compiling = compiling
        return [o for o in outputs if o is not None]

    def drop_in_flight(self) -> None:
        """Forgets the step in flight (after its requests were all aborted)."""
        self._in_flight = None

    def _launch(self) -> "_InFlight | None":
        """Schedules, prepares and starts a step: its forward pass and sampling are queued on the
        device (done by return on CPU), its sampled tokens stand in each request's output as
        placeholders until `_collect`. A token still in flight from the step before enters this
        step's inputs on the device, never through the host."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return None
        # Requests whose scheduled tokens reach their end sample a token; unfinished prompt
        # chunks only fill the cache.
        sample_rows = [i for i, s in enumerate(batch.scheduled)
                       if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens]
        t1 = time.perf_counter()
        model_input = self.runner.prepare(batch, sample_rows)
        prev = self._pending_inputs(batch, model_input.query_start) if self._in_flight is not None else None
        t2 = time.perf_counter()
        sample_requests = [batch.scheduled[i].request for i in sample_rows]
        greedy = bool(sample_requests) and not needs_logits(sample_requests)
        out = self.runner.execute(model_input, greedy, prev)
        t3 = time.perf_counter()
        if greedy or not sample_requests:
            token_ids, log_probs = out, None
        else:
            token_ids, log_probs = self.sampler.sample(out, sample_requests)
        handle = self.runner.finish_step(token_ids, log_probs, len(sample_requests))
        for item in batch.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            self.stats.num_prompt_tokens += max(0, min(start + item.num_tokens, request.num_prompt_tokens) - start)
            # Counted as computed now: whatever reads this KV runs after it on the device.
            request.num_computed_tokens += item.num_tokens
        indices = []
        for request in sample_requests:
            indices.append(len(request.output_ids))
            request.output_ids.append(PENDING_TOKEN)
            request.output_log_probs.append(0.0)
            request.num_pending_tokens += 1
        t4 = time.perf_counter()
        phases = self.stats.phase_seconds
        phases["schedule"] += t1 - t0
        phases["prepare"] += t2 - t1
        phases["forward"] += t3 - t2
        phases["sample"] += t4 - t3
        return _InFlight(handle, batch.scheduled, sample_requests, indices,
                         {id(r): row for row, r in enumerate(sample_requests)})

    def _pending_inputs(self, batch, query_start) -> PendingTokens | None:
        """The step in flight's sampled tokens that are inputs of this step: for each request whose
        last token is still on the device."""
        row_of = self._in_flight.row_of
        src, dst = [], []
        for i, item in enumerate(batch.scheduled):
            request = item.request
            row = row_of.get(id(request))
            if row is None or request.num_pending_tokens == 0:
                continue
            position = request.num_tokens - 1  # the placeholder is the last token
            start = request.num_computed_tokens
            if start <= position < start + item.num_tokens:
                src.append(row)
                dst.append(int(query_start[i]) + position - start)
        if not src:
            return None
        return PendingTokens(self._in_flight.handle.token_ids, np.asarray(src, dtype=np.int64),
                             np.asarray(dst, dtype=np.int64))

    def _collect(self, launched: "_InFlight") -> list[RequestOutput]:
        """Waits for a launched step's tokens and applies them: the one loop over a step's
        sampled tokens (fill the placeholder, check stop conditions, finish)."""
        t0 = time.perf_counter()
        token_ids, log_probs = launched.handle.result()
        t1 = time.perf_counter()
        for item in launched.scheduled:
            if not item.request.is_finished:
                self.block_manager.cache_computed_blocks(item.request)  # its KV is written now
        outputs = []
        now = time.monotonic()
        for request, index, token_id, log_prob in zip(launched.requests, launched.indices, token_ids, log_probs):
            if request.is_finished:
                continue  # aborted, or ended by its previous token: this one is dropped
            request.num_pending_tokens -= 1
            request.output_ids[index] = token_id
            request.output_log_probs[index] = log_prob
            # The matcher sees only tokens the engine keeps: nothing accepted is ever dropped,
            # so it never rolls back.
            if request.matcher is not None and not request.matcher.accept_token(token_id):
                self.scheduler.finish(request, FinishReason.ERROR)
                del request.output_ids[index:]
                del request.output_log_probs[index:]
                request.num_pending_tokens = 0
                del self.requests[request.request_id]
                output = self._output(request, [], [])
                output.error = f"engine error: token {token_id} broke the request's grammar"
                outputs.append(output)
                continue
            if request.first_token_time is None:
                request.first_token_time = now
                self.stats.time_to_first_token.append(now - request.arrival_time)
            else:
                self.stats.inter_token_latency.append(now - request.last_token_time)
            request.last_token_time = now
            self.stats.num_generation_tokens += 1
            new_ids, new_lps = [token_id], [log_prob]
            reason = self._stop_reason(request, index + 1)
            if reason is not None:
                # The end id is not part of the output (stop words are text-level, matched by
                # the llm model's ResponseStream); a token launched after this one is dropped.
                keep = index if reason == FinishReason.STOP else index + 1
                if reason == FinishReason.STOP:
                    new_ids, new_lps = [], []
                del request.output_ids[keep:]
                del request.output_log_probs[keep:]
                request.num_pending_tokens = 0
                self.scheduler.finish(request, reason)
                del self.requests[request.request_id]
            outputs.append(self._output(request, new_ids, new_lps))
        t2 = time.perf_counter()
        self.stats.num_steps += 1
        self.stats.phase_seconds["forward"] += t1 - t0  # the device's time not hidden behind the host's
        self.stats.phase_seconds["update"] += t2 - t1
        return outputs

    def _stop_reason(self, request: Request, num_output: int) -> FinishReason | None:
        """Why the request ends at its output token number `num_output` (its last one resolved)."""
        if num_output >= request.params.min_tokens and request.output_ids[num_output - 1] in request.end_ids:
            return FinishReason.STOP
        if request.matcher is not None and request.matcher.is_terminated():
            return FinishReason.STOP  # the grammar is complete and its stop token taken
        if num_output >= request.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _output(self, request: Request, new_ids: list[int], new_lps: list[float]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_log_probs=new_lps,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
        )


@dataclass(slots=True)
class _InFlight:
    """A launched step, until its tokens are collected."""

    handle: object  # the runner's StepHandle: sampled ids on the device, and `result()`
    scheduled: list
    requests: list[Request]  # the requests that sample, in the handle's row order
    indices: list[int]  # where each one's placeholder stands in its output_ids
    row_of: dict[int, int]  # id(request) -> its row in the handle


def _reads_history(request: Request) -> bool:
    """Whether sampling the request reads its earlier output tokens (penalties, bad words)."""
    p = request.params
    return request.matcher is not None or bool(p.bad_token_ids) or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 \
        or p.frequency_penalty != 0.0


@dataclass(slots=True)
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str
    reason: FinishReason = FinishReason.CANCELLED
    error: str | None = None


@dataclass(slots=True)
class _Flushed:
    """Put in the outbox behind a dying engine's last outputs: set once they have been sent."""

    event: threading.Event = field(default_factory=threading.Event)


@dataclass
class AsyncEngine:
    """Runs an LLMEngine in its own thread: callers submit and abort from any thread, and
    outputs go to `on_output` from a separate sender thread, so sending never holds up a step.

    Every request gets exactly one final output. A failed step, add or abort fails the requests
    the engine holds and the engine goes on. If a thread dies all the same (the failure path
    itself failed), the engine is dead: `submit` refuses, every request it held is failed, and
    `on_fatal(message)` is called, which the llm model answers by ending its process, so that
    the launcher restarts the server as it does for any dead model process."""

    engine: LLMEngine
    on_output: Callable[[RequestOutput], None]
    on_fatal: Callable[[str], None] = lambda message: None
    _inbox: "queue.Queue" = field(default_factory=queue.Queue)
    _outbox: "queue.Queue" = field(default_factory=queue.Queue)
    _stopping: threading.Event = field(default_factory=threading.Event)
    # Held while submitting and while the engine is declared dead, so that no request slips
    # into the inbox of a dead engine unanswered.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Why the engine is dead; None while it is alive.
    dead: str | None = None
    # Requests whose final error the sender sent after a failed send (sender thread only).
    _failed: set[str] = field(default_factory=set)
    # Submitted (caller's thread) and added (engine thread), each counted by its own thread only:
    # requests still in the inbox count against the queue limit, or a burst would slip past it.
    _num_submitted: int = 0
    _num_added: int = 0

    def start(self) -> None:
        self._engine_thread = threading.Thread(target=self._engine_loop, name="tritone-engine", daemon=True)
        self._sender_thread = threading.Thread(target=self._sender_loop, name="tritone-sender", daemon=True)
        self._engine_thread.start()
        self._sender_thread.start()

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine], on_output: Callable[[RequestOutput], None],
               on_fatal: Callable[[str], None] = lambda message: None) -> "AsyncEngine":
        """Builds the engine with `build()` on the thread that then runs it, and starts it;
        raises what `build` raised.

        OpenMP keeps a team of worker threads for each thread that runs parallel work. Loading
        and warming up the model on the caller's thread and stepping it on another would leave
        two teams, more OpenMP threads than cores, and libgomp then parks its workers after
        almost every parallel region instead of letting them spin."""
        async_engine = cls(None, on_output, on_fatal)  # its engine comes from `build`, on the engine thread
        failure: list[BaseException] = []
        ready = threading.Event()

        def run():
            try:
                async_engine.engine = build()
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                ready.set()
            async_engine._engine_loop()

        async_engine._engine_thread = threading.Thread(target=run, name="tritone-engine", daemon=True)
        async_engine._engine_thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        async_engine._sender_thread = threading.Thread(target=async_engine._sender_loop, name="tritone-sender",
                                                       daemon=True)
        async_engine._sender_thread.start()
        return async_engine

    @property
    def num_steps(self) -> int:
        return self.engine.stats.num_steps

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._engine_thread.is_alive() and self._sender_thread.is_alive()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validates at once (raising ValueError naming the field) and enqueues; raises
        RuntimeError when the engine is dead."""
        self.engine.validate(prompt_ids, params, num_queued=self._num_submitted - self._num_added)
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(f"the engine is not running ({self.dead}); the server restarts, retry later")
            self._num_submitted += 1
            self._inbox.put(_Submit(request_id, prompt_ids, params))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        self._inbox.put(_Abort(request_id, reason, error))

    def stop(self, timeout: float = 30.0) -> None:
        """Lets in-flight requests finish for up to `timeout` seconds, then cancels the rest."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished_requests() and self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stopping.set()
        self._inbox.put(None)
        self._engine_thread.join()
        self._outbox.put(None)
        self._sender_thread.join()

    def _engine_loop(self) -> None:
        try:
            while self._engine_iteration():
                pass
            outputs = [self.engine.abort_request(request_id) for request_id in list(self.engine.requests)]
            self._outbox.put(outputs + self._refuse_inbox("the engine stopped before it took the request in"))
        except BaseException as exc:
            logger.exception("the engine thread died")
            self._die(f"engine thread died: {exc!r}", send=True)

    def _engine_iteration(self) -> bool:
        """One drain of the inbox and one step; False once asked to stop."""
        try:
            if not self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                return False
            outputs = self.engine.step()
        except Exception as exc:  # a failed step fails its requests, not the server
            logger.exception("engine step failed")
            outputs = self._fail_all(f"engine error: {exc}")
        if outputs:
            self._outbox.put(outputs)
        return True

    def _drain_inbox(self, block: bool) -> bool:
        try:
            if block:
                t0 = time.perf_counter()
                try:
                    item = self._inbox.get()
                finally:
                    self.engine.stats.idle_seconds += time.perf_counter() - t0
            else:
                item = self._inbox.get_nowait()
            while True:
                if item is None:
                    return False
                self._apply(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, item) -> None:
        if isinstance(item, _Abort):
            output = self.engine.abort_request(item.request_id, item.reason, item.error)
            if output is not None:
                self._outbox.put([output])
            return
        self._num_added += 1
        try:
            self.engine.add_request(item.request_id, item.prompt_ids, item.params)
        except (ValueError, RuntimeError) as exc:  # refused: nothing of it entered the engine
            self._outbox.put([_error_output(item, str(exc))])
        except Exception as exc:
            logger.exception("adding request %s failed", item.request_id)
            output = self.engine.abort_request(item.request_id, FinishReason.ERROR, f"engine error: {exc}")
            self._outbox.put([output or _error_output(item, f"engine error: {exc}")])

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outputs = [self.engine.abort_request(request_id, FinishReason.ERROR, message)
                   for request_id in list(self.engine.requests)]
        self.engine.drop_in_flight()
        return outputs

    def _die(self, message: str, send: bool) -> None:
        """Fails every request the engine holds or has not yet taken in, without trusting the
        engine's state; `send`: the sender still works, so wait (a little) for them to go out."""
        with self._lock:
            self.dead = message
        outputs = []
        for request in list(self.engine.requests.values()):
            try:
                self.engine.scheduler.finish(request, FinishReason.ERROR)
            except Exception:
                logger.exception("freeing the blocks of request %s failed", request.request_id)
            outputs.append(RequestOutput(request.request_id, [], [], request.num_prompt_tokens,
                                         request.num_output_tokens, True, FinishReason.ERROR, error=message))
        self.engine.requests.clear()
        outputs += self._refuse_inbox(message)
        if send:
            flushed = _Flushed()
            self._outbox.put(outputs)
            self._outbox.put(flushed)
            flushed.event.wait(timeout=10.0)
        self.on_fatal(message)

    def _refuse_inbox(self, message: str) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if isinstance(item, _Submit):
                outputs.append(_error_output(item, message))

    def _sender_loop(self) -> None:
        try:
            self._send_until_stopped()
        except BaseException as exc:
            logger.exception("the sender thread died")
            # Nothing can be sent any more: the requests end when the model's process does.
            self._die(f"sender thread died: {exc!r}", send=False)

    def _send_until_stopped(self) -> None:
        stopping = False
        while not stopping:
            outputs = self._outbox.get()
            if outputs is None:
                return
            if isinstance(outputs, _Flushed):
                outputs.event.set()
                continue
            outputs = list(outputs)
            flushed = []
            # Steps that finished while the last responses went out are sent together: one
            # response per request however many steps it spans, so when sending falls behind
            # the engine, it catches up instead of falling further behind.
            while True:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                if isinstance(more, _Flushed):
                    flushed.append(more)
                    continue
                outputs.extend(more)
            t0 = time.perf_counter()
            for output in merge_outputs(outputs):
                self._send(output)
            self.engine.stats.phase_seconds["send"] += time.perf_counter() - t0
            for item in flushed:
                item.event.set()

    def _send(self, output: RequestOutput) -> None:
        """Sends one output. When that fails, the request's final output is an error sent at
        once, and the engine ends the request (freeing its blocks) after: what it still sends
        for the request, up to and including its own final output, is dropped here."""
        if output.request_id in self._failed:
            if output.finished:
                self._failed.discard(output.request_id)
            return
        try:
            self.on_output(output)
            return
        except Exception as exc:
            logger.exception("sending output of request %s failed", output.request_id)
            message = f"sending a response failed: {exc}"
        if not output.finished:
            self._failed.add(output.request_id)
            self.abort(output.request_id, FinishReason.ERROR, message)
        try:
            self.on_output(dataclasses.replace(output, new_token_ids=[], new_log_probs=[], finished=True,
                                               finish_reason=FinishReason.ERROR, error=message))
        except Exception:
            logger.exception("request %s could not be sent its final error either", output.request_id)


def _error_output(item: _Submit, message: str) -> RequestOutput:
    return RequestOutput(item.request_id, [], [], len(item.prompt_ids), 0, True, FinishReason.ERROR, error=message)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Joins each request's consecutive outputs into one, in order of first appearance."""
    merged: dict[str, RequestOutput] = {}
    for output in outputs:
        prev = merged.get(output.request_id)
        if prev is None:
            merged[output.request_id] = output
            continue
        merged[output.request_id] = dataclasses.replace(
            output, new_token_ids=prev.new_token_ids + output.new_token_ids,
            new_log_probs=prev.new_log_probs + output.new_log_probs)
    return list(merged.values())
