"""A real tritonserver started as a new user starts it: every flag at its default, so the dtype,
GEMM kernels, attention and forward path are what this machine's measurements and start-up checks
chose. Its greedy answers are Hugging Face's in the served dtype, its start-up log gives each fast
path's verdict, and a seed means one text streamed or not, alone or batched (DESIGN.md,
invariants 3, 7 and 8)."""

from __future__ import annotations

import os
import pathlib
import re
import threading

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import PROMPTS, start_server
from test_fast_paths import MAX_TOKENS, QUESTION, assert_close_to
from tritone.launcher import free_port
from tritone_client import TritoneClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_server(model_dir, tmp_path_factory):
    # start_server serves float32 for token-for-token comparisons; here the dtype is the machine's.
    srv, log = start_server(tmp_path_factory, "default_server", "--dtype", "auto", "--openai-port", str(free_port()))
    yield srv
    srv.stop()
    log.close()


@pytest.fixture(scope="module")
def start_log(default_server):
    return (default_server.run_dir / "server.log").read_text()


@pytest.fixture(scope="module")
def served_hf(model_dir, start_log):
    dtype = re.search(r"on cpu in torch\.(\w+)", start_log).group(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


@pytest.fixture(scope="module")
def grpc(default_server):
    with TritoneClient(f"{default_server.args.host}:{default_server.args.grpc_port}", "grpc") as client:
        yield client


def test_the_start_up_log_gives_each_fast_paths_verdict(start_log):
    assert re.search(r"GEMMs \((measured|cached)", start_log)
    # The CPU attention kernel that serves, checked against SDPA (where two pass, the faster).
    assert re.search(r"attention (cpu-native|cpu-amx)(: passed its probe|: the fastest here| dropped)", start_log)
    # The forward that serves: native or compiled or eager, each checked against the reference.
    verdicts = re.findall(r"fast path (native forward|compiled forward|eager forward[^:]*): (passed|dropped)", start_log)
    assert verdicts and verdicts[-1][1] == "passed", start_log[-3000:]


def test_greedy_answers_are_hugging_faces_in_the_served_dtype(grpc, tokenizer, served_hf, default_server):
    # Prompts that do not end in whitespace, which a continuation's first token may absorb.
    texts = [p for p in PROMPTS if not p[-1].isspace()][:4]
    got = [continuation(tokenizer, p, grpc.complete(p, max_tokens=MAX_TOKENS, apply_chat_template=False).text)
           for p in texts]
    assert_close_to(served_hf, [tokenizer(p).input_ids for p in texts], got)
    # The OpenAI API, in the model's chat template.
    client = openai.OpenAI(base_url=default_server.openai_url, api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=default_server.model_dir.name, messages=QUESTION,
                                           max_tokens=MAX_TOKENS, temperature=0)
    chat = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert_close_to(served_hf, [chat_ids], [continuation(tokenizer, chat, reply.choices[0].message.content)])


def continuation(tokenizer, prompt: str, text: str) -> list[int]:
    """The served text's tokens after the prompt's, tokenized in context as the model made them."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    ids = tokenizer(prompt + text, add_special_tokens=False).input_ids
    assert ids[:len(prompt_ids)] == prompt_ids
    return ids[len(prompt_ids):]


def test_a_seed_means_one_text_streamed_or_not_alone_or_batched(grpc, default_server):
    prompt, seeds = "Tell me a story about a lighthouse.", (1, 2, 3, 4)
    sample = dict(max_tokens=24, temperature=1.3)
    alone = {s: grpc.complete(prompt, seed=s, **sample).text for s in seeds}
    streamed = {s: "".join(c.text for c in grpc.generate(prompt, stream=True, seed=s, **sample)) for s in seeds}
    assert streamed == alone
    assert len(set(alone.values())) == len(seeds)
    # All at once, beside unseeded requests of other lengths: one batch, other row counts.
    batched, errors = {}, []

    def send(seed):
        try:
            with TritoneClient(f"{default_server.args.host}:{default_server.args.grpc_port}", "grpc") as client:
                if seed is None:
                    client.complete(PROMPTS[6], max_tokens=40, temperature=0.8)
                else:
                    batched[seed] = client.complete(prompt, seed=seed, **sample).text
        except Exception as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(s,)) for s in (None, *seeds, None)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and batched == alone


def _threads_nice_and_cpu(pid: int) -> list[tuple[int, int]]:
    """(nice, user + system ticks) of each thread of `pid`."""
    found = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found.append((int(fields[16]), int(fields[11]) + int(fields[12])))
    return found


def test_the_text_work_yields_the_cores_to_the_engines_forward(default_server):
    """--text-nice, at its default on a CPU beside the ensemble's processes (auto: 10; 19 inline):
    tritonserver, tritone-openai and the text models run 10 nicer than the engine's forward
    threads, and so does the engine's response sender."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nicer = min(19, base + 10)
    stubs = {pid: pathlib.Path(f"/proc/{pid}/cmdline").read_bytes() for pid in default_server.stub_pids()}
    text = [default_server.process.pid, default_server.frontend.pid]
    text += [pid for pid, command in stubs.items() if b"/llm/1/model.py" not in command]
    assert len(text) >= 4  # tritonserver, tritone-openai, preprocessing and postprocessing
    for pid in text:
        assert {nice for nice, _ in _threads_nice_and_cpu(pid)} == {nicer}, pid
    [llm] = [pid for pid, command in stubs.items() if b"/llm/1/model.py" in command]
    threads = _threads_nice_and_cpu(llm)
    busiest_nice, _ = max(threads, key=lambda thread: thread[1])
    assert busiest_nice == base  # the engine's thread: it loaded the model and runs the forward
    assert nicer in {nice for nice, _ in threads}  # the response sender
