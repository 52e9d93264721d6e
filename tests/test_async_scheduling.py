"""Async scheduling: the host schedules and prepares step N + 1 while the device computes step N,
and applies N's tokens after launching N + 1.

The device is a deliberately slow fake: each step's tokens are a fixed function of its input
tokens and positions (or, for sampled requests, logits drawn from them), computed at launch,
and the step's handle gives them back only once the fake device, which runs one step at a time,
would have finished it. Its inputs must never hold a placeholder: a token still on the device
enters the next step's inputs from the handle, as on CUDA. Outputs must equal those of the same
engine run step by step: greedy, seeded sampling, end ids and min_tokens, penalties, staggered
arrivals, cancellation mid-stream and preemption."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from test_executor import build_tiny, hf_greedy, prompts, MAX_TOKENS
from tritone.config import EngineConfig
from tritone.engine.core import LLMEngine
from tritone.scheduling.request import PENDING_TOKEN, FinishReason, SamplingParams

VOCAB = 384
DEVICE_SECONDS = 0.04


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny("llama3", tmp_path_factory.mktemp("llama3"))[1]


class FakeDevice:
    """Replaces the runner's forward (run_model) and finish_step; records what the engine launched."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.busy_until = 0.0
        self.sampled = {}  # request id -> rows it sampled
        self.schedules_while_busy = 0
        self.schedules = 0
        engine.runner.run_model = self.run_model
        engine.runner.finish_step = self.finish_step
        schedule = engine.scheduler.schedule

        def counting_schedule():
            self.schedules += 1
            self.schedules_while_busy += time.monotonic() < self.busy_until
            return schedule()

        engine.scheduler.schedule = counting_schedule

    def run_model(self, model_input, greedy=False, prev=None):
        ids, positions, logits_indices = model_input.ids.copy(), model_input.positions, model_input.logits_indices
        if prev is not None:
            ids[prev.dst] = prev.token_ids.numpy()[prev.src]
        assert not (ids == PENDING_TOKEN).any(), "a placeholder reached the device"
        last, pos = ids[logits_indices], positions[logits_indices]
        if greedy:
            return torch.from_numpy((last * 31 + pos * 7 + 11) % VOCAB)
        rows = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(int(t) * 1000 + int(p))) * 3
                for t, p in zip(last, pos)]
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)

    def finish_step(self, token_ids, log_probs, num_rows):
        # One step at a time: it starts when launched or when the step before it ends.
        self.busy_until = max(time.monotonic(), self.busy_until) + DEVICE_SECONDS
        return _Handle(token_ids, log_probs, num_rows, self.busy_until)


class _Handle:
    def __init__(self, token_ids, log_probs, num_rows, ready_at):
        self.token_ids, self.log_probs, self.num_rows, self.ready_at = token_ids, log_probs, num_rows, ready_at

    def result(self):
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        ids = self.token_ids.tolist() if self.token_ids is not None else []
        lps = self.log_probs.tolist() if self.log_probs is not None else [0.0] * self.num_rows
        return ids, lps


def run(path, mode: str, requests: list[tuple[int, list[int], SamplingParams]], kv_cache_bytes=8 << 20,
        cancel: tuple[str, int] | None = None):
    """Runs requests (arrival step, prompt, params) on the fake device; returns per request
    (tokens, finish reason, the output count of its final response), and the fake device."""
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=kv_cache_bytes, block_size=4,
                                    max_num_batched_tokens=32, async_scheduling=mode))
    assert engine.async_scheduling == (mode == "on")
    device = FakeDevice(engine)
    got, reasons, counts = {}, {}, {}
    step = 0
    pending = sorted(enumerate(requests), key=lambda x: x[1][0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
            got[str(i)] = []
        if cancel is not None and step == cancel[1]:
            out = engine.abort_request(cancel[0])
            reasons[out.request_id], counts[out.request_id] = out.finish_reason, out.num_output_tokens
        for out in engine.step():
            assert out.request_id not in reasons, "an output after the request's final one"
            got[out.request_id].extend(out.new_token_ids)
            assert out.num_output_tokens == len(got[out.request_id])
            if out.finished:
                reasons[out.request_id], counts[out.request_id] = out.finish_reason, out.num_output_tokens
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.requests
    return {k: (got[k], reasons[k], counts[k]) for k in got}, device


def workload(end_id: int | None = None):
    ids = prompts(4) + prompts(2)
    greedy = lambda n, **kw: SamplingParams(max_tokens=n, end_id=-1 if end_id is None else end_id, **kw)
    return [
        (0, ids[0], greedy(12)),
        (0, ids[1], greedy(5)),
        (2, ids[2], greedy(9, min_tokens=4)),
        (3, ids[3], SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, end_id=-1)),
        (3, ids[4], greedy(1)),
        (5, ids[5], SamplingParams(max_tokens=8, temperature=1.0, seed=3, return_log_probs=True, end_id=-1)),
    ]


def test_outputs_equal_step_by_step(tiny_path):
    sync, _ = run(tiny_path, "off", workload())
    overlapped, device = run(tiny_path, "on", workload())
    assert overlapped == sync
    # End ids that the greedy requests meet mid-way (one before min_tokens lets it end).
    end_id = sync["0"][0][3]
    sync, _ = run(tiny_path, "off", workload(end_id))
    assert sync["0"][1] == FinishReason.STOP
    overlapped, _ = run(tiny_path, "on", workload(end_id))
    assert overlapped == sync


def test_host_work_overlaps_the_device_and_finished_requests_are_not_scheduled(tiny_path):
    _, sync_device = run(tiny_path, "off", workload())
    overlapped, device = run(tiny_path, "on", workload())
    # Step by step, the host schedules only once the device is done; overlapped, it schedules
    # step N + 1 while step N computes (all but the first schedule, bar a stall of this machine).
    assert sync_device.schedules_while_busy == 0
    assert device.schedules_while_busy >= 0.8 * (device.schedules - 1), (device.schedules_while_busy, device.schedules)
    # A request that reached max_tokens with its last token in flight is not scheduled again.
    for i, (_, prompt, params) in enumerate(workload()):
        tokens, reason, count = overlapped[str(i)]
        assert reason == FinishReason.LENGTH and count == len(tokens) == params.max_tokens


def test_penalties_and_bad_words_read_real_tokens(tiny_path):
    ids = prompts(3)
    reqs = [(0, ids[0], SamplingParams(max_tokens=10, repetition_penalty=1.3, end_id=-1)),
            (0, ids[1], SamplingParams(max_tokens=10, bad_token_ids=[[5, 6]], end_id=-1)),
            (1, ids[2], SamplingParams(max_tokens=10, frequency_penalty=0.5, temperature=0.7, seed=1, end_id=-1))]
    assert run(tiny_path, "on", reqs)[0] == run(tiny_path, "off", reqs)[0]


def test_cancellation_mid_stream(tiny_path):
    sync, _ = run(tiny_path, "off", workload(), cancel=("0", 6))
    overlapped, _ = run(tiny_path, "on", workload(), cancel=("0", 6))
    assert sync["0"][1] == overlapped["0"][1] == FinishReason.CANCELLED
    # Overlapped, the cancelled request's token in flight is dropped: it has one token fewer.
    assert overlapped["0"][0] == sync["0"][0][:len(overlapped["0"][0])]
    assert len(sync["0"][0]) - len(overlapped["0"][0]) in (0, 1)
    assert {k: v for k, v in overlapped.items() if k != "0"} == {k: v for k, v in sync.items() if k != "0"}


def test_preemption(tiny_path):
    # A cache of 24 blocks of 4 tokens for prompts of up to 40 tokens and 12 outputs each.
    small = 24 * 4 * 2 * 2 * 2 * 16 * 4
    sync, sync_device = run(tiny_path, "off", workload(), kv_cache_bytes=small)
    overlapped, device = run(tiny_path, "on", workload(), kv_cache_bytes=small)
    assert sync_device.engine.scheduler.num_preemptions > 0 and device.engine.scheduler.num_preemptions > 0
    assert overlapped == sync


def test_real_model_overlapped_equals_hugging_face(tiny_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    for forward in ("auto", "torch"):
        engine = LLMEngine(EngineConfig(model=str(tiny_path), dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                                        max_num_batched_tokens=32, async_scheduling="on", forward=forward,
                                        compile="off"))
        ids = prompts()
        for i, p in enumerate(ids):
            engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, end_id=-1))
        got = {str(i): [] for i in range(len(ids))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        assert [got[str(i)] for i in range(len(ids))] == [hf_greedy(hf, p) for p in ids]
