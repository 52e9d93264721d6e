"""The engine core: schedule, run the model, sample, update, one step at a time (the threads that
drive it are in tritone.engine.async_engine)."""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import GenerationConfig

from tritone.config import EngineConfig
from tritone.engine.sampler import Sampler, needs_logits
from tritone.executor import make_runner
from tritone.executor.step import PendingTokens
from tritone.scheduling.block_manager import BlockManager
from tritone.scheduling.grammar import Grammars
from tritone.scheduling.request import PENDING_TOKEN, FinishReason, Request, RequestOutput, SamplingParams
from tritone.scheduling.scheduler import Scheduler


# Where a step's time goes, in order: the engine thread's phases, then the sender thread's
# (building and sending the step's responses, which overlaps the next step).
PHASES = ("schedule", "prepare", "forward", "sample", "update", "send")
# A guided request waits this long at most for its grammar (compiled on another thread, behind
# other requests' grammars): a guide that compiles for longer fails, naming the field.
GUIDE_COMPILE_SECONDS = 60.0


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
    def __init__(self, config: EngineConfig, engine_index: int = 0):
        """`engine_index`: which of the data-parallel engines this is (its devices)."""
        self.config = config
        self.runner = make_runner(config, engine_index)
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
        future = request.grammar_future
        if future is not None and not any(r.grammar_future is future and not r.is_finished
                                          for r in self._compiling if r is not request):
            future.cancel()  # not started yet: no other request waits for it, so it never runs
        self.scheduler.finish(request, reason)
        output = self._output(request, [], [])
        output.error = error
        return output

    def shutdown(self) -> None:
        """Stops the model's worker processes, where it has any."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

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
                if time.monotonic() - request.arrival_time > GUIDE_COMPILE_SECONDS:
                    # The compile runs on (it cannot be stopped, and another request may share
                    # it), but this request no longer waits for it, nor holds its place.
                    outputs.append(self.abort_request(
                        request.request_id, FinishReason.ERROR,
                        f"guided_decoding_guide took over {GUIDE_COMPILE_SECONDS:.0f} s to compile"))
                    continue
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
