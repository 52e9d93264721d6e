"""The engine core: schedule, run and sample (the runner), update (the scheduler), one step at a
time (the threads that drive it are in tritone.engine.async_engine)."""

from __future__ import annotations

import dataclasses
import time
from concurrent import futures

import numpy as np
import torch
from transformers import GenerationConfig

from tritone.config import EngineConfig, parse_lora_modules
from tritone.executor import Runner, make_runner
from tritone.executor.step import NewRequest, PendingTokens, SamplingInput
from tritone.scheduling.block_manager import BlockManager
from tritone.scheduling.grammar import Grammars
from tritone.scheduling.request import FinishReason, Request, RequestOutput, SamplingParams, request_output
from tritone.scheduling.scheduler import LaunchedStep, Scheduler, SchedulerOutput
from tritone.scheduling.stats import PHASES, EngineStats

__all__ = ["PHASES", "EngineStats", "LLMEngine", "model_end_ids"]

# A guided request waits this long at most for its grammar (compiled on another thread, behind
# other requests' grammars): a guide that compiles for longer fails, naming the field.
GUIDE_COMPILE_SECONDS = 60.0


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
        self.runner: Runner = make_runner(config, engine_index)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.stats = EngineStats()
        self.scheduler = Scheduler(config, self.block_manager, self.runner.max_model_len, self.stats)
        self.default_end_ids = model_end_ids(config.model, self.runner.hf_config)
        self.num_adapters = len(parse_lora_modules(config.lora_modules))
        self.grammars = Grammars(config.model, self.vocab_size, list(self.default_end_ids))
        # Guided requests whose grammar is still compiling.
        self._compiling: list[Request] = []
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        # Overlap the host's work for step N + 1 with the device's for step N: where the device
        # runs asynchronously (CUDA), unless configured off; `on` elsewhere runs the same logic.
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.device.type == "cuda")
        self._in_flight: LaunchedStep | None = None

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def validate(self, prompt_ids: list[int], params: SamplingParams, num_queued: int = 0) -> None:
        """Raises ValueError naming the field when the request can never be served, and
        RuntimeError when the queue (waiting requests, plus `num_queued` not yet added) is full.
        Once per request, where it enters (AsyncEngine.submit, or add_request called directly)."""
        params.validate(self.vocab_size)
        if params.guide is not None:
            params.guide.check()
        if params.lora_id > self.num_adapters:
            raise ValueError(f"lora_task_id {params.lora_id} names no adapter: this server has {self.num_adapters} "
                             f"(--lora-modules)")
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

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    validated: bool = False) -> Request:
        """Adds a request; `validated`: the caller ran `validate` on it already."""
        if not validated:
            self.validate(prompt_ids, params)
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        if params.end_id == -1:
            end_ids = frozenset()
        elif params.end_id is not None:
            end_ids = frozenset([params.end_id])
        else:
            end_ids = self.default_end_ids
        request = Request(request_id, list(prompt_ids), params, arrival_time=time.monotonic(), seed=seed,
                          end_ids=end_ids)
        self.scheduler.add(request)
        if params.guide is not None:
            request.grammar_future = self.grammars.compile(params.guide)
            self._compiling.append(request)
        return request

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED,
                      error: str | None = None) -> RequestOutput | None:
        """Ends a request that is still in the engine, freeing its blocks, and returns its final
        output (None for one that has finished already)."""
        request = self.scheduler.abort(request_id, reason)
        if request is None:
            return None
        future = request.grammar_future
        if future is not None and not any(r.grammar_future is future and not r.is_finished
                                          for r in self._compiling if r is not request):
            future.cancel()  # not started yet: no other request waits for it, so it never runs
        return request_output(request, [], [], error)

    def shutdown(self) -> None:
        """Stops the model's worker processes, where it has any, and the grammars' compile thread."""
        self.runner.shutdown()
        self.grammars.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Runs one step and returns its outputs. With async scheduling, it launches this step and
        returns the previous one's outputs: the device computes step N while the host schedules
        and prepares N + 1 and then updates N (see `_launch`)."""
        failed = self._resolve_grammars() if self._compiling else []
        if not self.async_scheduling:
            launched = self._launch()
            return failed + self._collect(launched) if launched is not None else failed
        outputs = failed
        if self._in_flight is not None and any(r.matcher is not None for r in self._in_flight.requests):
            # A grammar's mask for the next token needs the token in flight: take it first.
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

    def _launch(self) -> LaunchedStep | None:
        """Schedules, prepares and starts a step: its forward pass and sampling are queued on the
        device (done by return on CPU), its sampled tokens stand in each request's output as
        placeholders until `_collect`. A token still in flight from the step before enters this
        step's inputs on the device, never through the host."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return None
        t1 = time.perf_counter()
        model_input = self.runner.prepare(batch, batch.sample_rows)
        prev = self._pending_inputs(batch, model_input.query_start) if self._in_flight is not None else None
        t2 = time.perf_counter()
        sampling = self._sampling_input(batch)
        t3 = time.perf_counter()
        handle = self.runner.execute_model(model_input, sampling, prev)
        t4 = time.perf_counter()
        launched = self.scheduler.launched(batch, handle)
        phases = self.stats.phase_seconds
        phases["schedule"] += t1 - t0
        phases["prepare"] += t2 - t1
        phases["forward"] += t4 - t3
        phases["sample"] += t3 - t2 + time.perf_counter() - t4
        return launched

    def _sampling_input(self, batch: SchedulerOutput) -> SamplingInput:
        """What the runner needs to sample the step: new requests' parameters (once), the ids it
        may forget, each row's request, and guided rows' grammar masks."""
        requests = [batch.scheduled[i].request for i in batch.sample_rows]
        guided = [row for row, r in enumerate(requests) if r.matcher is not None]
        new = [NewRequest(r.request_id, r.prompt_ids, dataclasses.replace(r.params, guide=None), r.seed, r.end_ids,
                          r.params.guide is not None) for r in batch.new_requests]
        bitmask = self.grammars.fill_bitmask([requests[row].matcher for row in guided]) if guided else None
        return SamplingInput(batch.finished_ids, new, [r.request_id for r in requests], guided, bitmask)

    def _pending_inputs(self, batch: SchedulerOutput, query_start) -> PendingTokens | None:
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

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Waits for a launched step's tokens and has the scheduler apply them."""
        t0 = time.perf_counter()
        token_ids, log_probs = launched.handle.result()
        t1 = time.perf_counter()
        handle = launched.handle
        top = handle.top.by_row() if handle.top is not None else None
        scores = handle.scores.by_row() if handle.scores is not None else None
        outputs = self.scheduler.update_from_output(launched, token_ids, log_probs, top, scores)
        t2 = time.perf_counter()
        self.stats.num_steps += 1
        self.stats.phase_seconds["forward"] += t1 - t0  # the device's time not hidden behind the host's
        self.stats.phase_seconds["update"] += t2 - t1
        return outputs
