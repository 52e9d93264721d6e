"""Tensor and data parallelism served: a real tritonserver with the real model repository and the
default model, its llm model's engine in worker processes (gloo on CPU), called through the
ensemble with tritonclient. A killed worker ends the requests its engine held with an error, the
engine restarts, and the server serves again."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import threading
import time
import urllib.request

import pytest

from conftest import hf_greedy, processes_mentioning, start_server
from tritone_client import TritoneClient

pytestmark = pytest.mark.integration

PROMPTS = ("The quick brown fox", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,")


def workers(srv) -> dict[tuple[int, int], int]:
    """(engine, rank) -> pid of the server's model workers."""
    found = {}
    for pid in processes_mentioning("tritone.executor.worker"):
        try:
            argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        spec = json.loads(argv[argv.index(b"tritone.executor.worker") + 1])
        if str(srv.model_dir) in spec["config"]["model"] and _descends_from(pid, srv.process.pid):
            found[(spec["engine"], spec["rank"])] = pid
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def engine_metrics(srv) -> dict[tuple[str, str], float]:
    """(metric, engine label) -> value."""
    with urllib.request.urlopen(f"http://{srv.args.host}:{srv.args.metrics_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    values = {}
    for line in lines:
        match = re.match(r'(tritone_\w+)\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', line)
        if match and 'phase="' not in line:
            values[(match.group(1), match.group(2))] = float(match.group(3))
    return values


def greedy_matches_hugging_face(client, tokenizer, hf_model):
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        expected = tokenizer.decode(hf_greedy(hf_model, ids, 16), skip_special_tokens=True)
        assert client.complete(prompt, max_tokens=16, apply_chat_template=False).text == expected


def served(tmp_path_factory, name: str, *flags: str):
    """A server with `flags`, stopped cleanly at the end with no worker left behind."""
    srv, log = start_server(tmp_path_factory, name, *flags, "--kv-cache-bytes", str(256 << 20))
    try:
        yield srv
    finally:
        code = srv.stop()
        log.close()
    assert code == 0
    assert not workers(srv)


def test_tensor_parallel_serves_the_same_greedy_text_as_hugging_face(model_dir, tmp_path_factory, tokenizer,
                                                                     hf_model):
    # Its own server, stopped before the data-parallel one starts: two servers of two engine
    # processes each beside the test process come close to the memory of a 24 GiB machine.
    with contextlib.contextmanager(served)(tmp_path_factory, "tp2", "--tensor-parallel-size", "2") as tp_server:
        assert sorted(workers(tp_server)) == [(0, 0), (0, 1)]
        with TritoneClient(f"{tp_server.args.host}:{tp_server.args.grpc_port}", "grpc") as client:
            greedy_matches_hugging_face(client, tokenizer, hf_model)
            chunks = list(client.generate("Write a haiku about the sea.", max_tokens=24, stream=True))
            assert len(chunks) > 3 and chunks[-1].num_output_tokens == 24 or chunks[-1].finish_reason == "stop"


@pytest.fixture(scope="module")
def dp_server(model_dir, tmp_path_factory):
    yield from served(tmp_path_factory, "dp2", "--data-parallel-size", "2")


def test_data_parallel_engines_both_serve_and_report_metrics(dp_server, tokenizer, hf_model):
    assert sorted(workers(dp_server)) == [(0, 0), (1, 0)]
    url = f"{dp_server.args.host}:{dp_server.args.grpc_port}"
    with TritoneClient(url, "grpc") as client:
        greedy_matches_hugging_face(client, tokenizer, hf_model)
    results = {}

    def ask(i):
        with TritoneClient(url, "grpc") as c:
            results[i] = c.complete(f"Story number {i}: once upon a time", max_tokens=12, apply_chat_template=False)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.num_output_tokens == 12 for r in results.values())
    time.sleep(1.0)  # a metrics report or two
    values = engine_metrics(dp_server)
    for engine in ("0", "1"):
        assert values[("tritone_generation_tokens_total", engine)] > 0
        assert values[("tritone_kv_blocks_used", engine)] == 0


def test_a_killed_worker_fails_its_engines_requests_and_the_server_serves_again(dp_server, tokenizer, hf_model):
    url = f"{dp_server.args.host}:{dp_server.args.grpc_port}"
    outcome, started = {}, threading.Semaphore(0)

    def stream(i):
        got = 0
        try:
            with TritoneClient(url, "grpc") as c:
                # Prompts that differ in their first block: no prefix keeps them together.
                for chunk in c.generate(f"Run {i}: count to a thousand.", max_tokens=400, stream=True, end_id=-1,
                                        apply_chat_template=False):
                    got += chunk.num_output_tokens and 1
                    if got == 2:
                        started.release()
            outcome[i] = "done"
        except RuntimeError as exc:
            outcome[i] = str(exc)
            started.release()

    # Enough streams that some chunks are in postprocessing when the worker dies: an error sent
    # past them would leave their ensemble requests in flight, and the server's exit unclean
    # (tritone.serving.responses.ResponseStream.failed); the fixture's teardown checks the exit.
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    os.kill(workers(dp_server)[(0, 0)], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    errors = [o for o in outcome.values() if o != "done"]
    assert len(outcome) == 12 and errors and len(errors) < 12, outcome  # engine 1's requests went on
    assert all("model worker 0 of engine 0" in e for e in errors), errors
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and engine_metrics(dp_server).get(("tritone_engine_restarts_total", "0")) != 1:
        time.sleep(0.5)
    assert engine_metrics(dp_server)[("tritone_engine_restarts_total", "0")] == 1
    with TritoneClient(url, "grpc") as client:
        greedy_matches_hugging_face(client, tokenizer, hf_model)
    assert sorted(workers(dp_server)) == [(0, 0), (1, 0)]
    deadline = time.monotonic() + 10  # the gauges trail the engines by a report
    while time.monotonic() < deadline:
        values = engine_metrics(dp_server)
        if values[("tritone_kv_blocks_used", "0")] == 0 and values[("tritone_kv_blocks_used", "1")] == 0:
            break
        time.sleep(0.25)
    assert values[("tritone_kv_blocks_used", "0")] == 0 and values[("tritone_kv_blocks_used", "1")] == 0
