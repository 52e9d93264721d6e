"""Shared fixtures: the real default model, a Hugging Face reference, and a real tritonserver."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pathlib
import socket

import pytest
import torch

# Without a GPU, Triton kernels (the CUDA attention) run in Triton's interpreter on CPU tensors.
# Set before anything imports triton: it defines its language's helpers once, at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritone.launcher import free_port
from tritone.checkpoints import prepare_default_model

PROMPTS = [
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The capital of France is",
    "Water boils at a temperature of",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean. "
    "His voyages opened the way for the European exploration and colonization of the Americas. Historians",
    "Roses are red, violets are blue,",
]


@pytest.fixture(autouse=True, scope="module")
def _give_back_a_modules_memory():
    """After each module, what its fixtures held is collected, the objects earlier tests froze
    included (see below)."""
    yield
    gc.unfreeze()
    _give_back()


@pytest.fixture(autouse=True)
def _give_back_memory(_give_back_a_modules_memory):
    """After each test, what it freed goes back to the system: glibc keeps freed heap pages (the
    engines' weights and caches, a gigabyte a model) for reuse, and with the servers the
    integration tests start beside this process, a full run once outgrew a 24 GiB machine.
    What survives a test is then frozen, so that the next test's collection walks only the
    objects made since: a full collection walks the 300,000 to 700,000 objects of the imported
    libraries, half a second after every test, a third of the suite's time."""
    yield
    _give_back()
    gc.freeze()


def _give_back():
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, end_ids=(2,), **generate_kwargs) -> list[int]:
    """Hugging Face greedy tokens, without the end-of-sequence token (Tritone does not return it)."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **generate_kwargs)
    ids = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(ids):
        if t in end_ids:
            return ids[:i]
    return ids


def start_server(tmp_path_factory, name: str, *options: str):
    """A real tritonserver, ready, on free ports: the real model repository and the default model
    in fp32 (so that greedy output can be compared token for token with Hugging Face), the
    three-process ensemble unless `options` name another --pipeline, with extra launcher
    `options`. Returns it and its open log file (server.log in its run directory)."""
    from tritone.launcher import Server, build_parser

    args = build_parser().parse_args([
        "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
        "--dtype", "float32", "--openai-port", "0", "--pipeline", "ensemble", *options,
    ])
    run_dir = tmp_path_factory.mktemp(name)
    log = open(run_dir / "server.log", "w")
    srv = Server(args, run_dir=run_dir)
    srv.start(stdout=log)
    try:
        srv.wait_ready(timeout=300)
    except Exception:
        log.flush()
        print((run_dir / "server.log").read_text()[-5000:])
        srv.stop()
        log.close()
        raise
    return srv, log


def supervised_server(tmp_path_factory, name: str, *options: str):
    """A fixture's body: a server as scripts/serve runs it, restarted by its launcher when a
    process dies, stopped at the end."""
    import threading

    srv, log = start_server(tmp_path_factory, name, *options)
    supervisor = threading.Thread(target=srv.supervise, kwargs={"poll_seconds": 0.2}, daemon=True)
    supervisor.start()
    yield srv
    srv.stop()
    supervisor.join(timeout=60)
    log.close()


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    srv, log = start_server(tmp_path_factory, "tritonserver", "--kv-cache-bytes", str(256 << 20))
    yield srv
    # Every request got its final response, so every model unloads within the exit timeout and
    # no Python stub outlives the server.
    code = srv.stop()
    log.close()
    assert code == 0, (srv.run_dir / "server.log").read_text()[-3000:]
    assert not processes_mentioning(str(srv.run_dir)), "a Python backend stub outlived tritonserver"


@pytest.fixture(scope="session")
def openai_server(model_dir, tmp_path_factory):
    """A server with tritone-openai on a free port, on the pipeline scripts/serve picks here (on a
    CPU, llm_inline served as the ensemble): shared by the modules that call the OpenAI API with the
    default flags (log probabilities, choices, structured outputs)."""
    from tritone.processes import free_port

    srv, log = start_server(tmp_path_factory, "openai_server", "--kv-cache-bytes", str(256 << 20),
                            "--openai-port", str(free_port()), "--pipeline", "auto")
    yield srv
    code = srv.stop()
    log.close()
    assert code == 0, (srv.run_dir / "server.log").read_text()[-3000:]


@pytest.fixture(scope="session")
def openai_client(openai_server):
    import openai

    return openai.OpenAI(base_url=openai_server.openai_url, api_key="none", max_retries=0)


def open_http_generate_stream(server, max_tokens: int, num_events: int = 3) -> socket.socket:
    """A raw HTTP generate_stream of the ensemble, read until its first `num_events` events;
    the caller drops the connection by closing the returned socket."""
    body = json.dumps({"text_input": "Count to one thousand:", "max_tokens": max_tokens, "end_id": -1,
                       "stream": True, "apply_chat_template": False}).encode()
    s = socket.create_connection((server.args.host, server.args.http_port), timeout=60)
    s.sendall(b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: tritone\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    while received.count(b"data:") < num_events:
        chunk = s.recv(4096)
        assert chunk, received
        received += chunk
    return s


def processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: needs a real tritonserver")
