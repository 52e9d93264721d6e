"""Against a real tritonserver serving the real model repository and default model."""

import json
import pathlib
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import hf_greedy
from tritone_client import TritoneClient, infer_inputs

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


def post(server, endpoint, body):
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/{endpoint}",
                                     data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def grpc_inputs(*tensors):
    """tritonclient inputs from (name, array, Triton dtype) triples."""
    return infer_inputs(grpcclient, tensors)


def sse_events(text):
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


@pytest.fixture(scope="module")
def grpc(server):
    with TritoneClient(f"{server.args.host}:{server.args.grpc_port}", "grpc") as client:
        yield client


def test_http_generate_answers(server):
    status, body = post(server, "generate", {"text_input": QUESTION, "max_tokens": 24})
    assert status == 200, body
    answer = json.loads(body)
    assert "Paris" in answer["text_output"]
    assert answer["finish_reason"] == "stop"
    assert answer["num_output_tokens"] > 0 and answer["num_input_tokens"] > 0


def test_http_generate_stream_streams_the_same_text_in_pieces(server):
    _, whole = post(server, "generate", {"text_input": QUESTION, "max_tokens": 24})
    status, body = post(server, "generate_stream", {"text_input": QUESTION, "max_tokens": 24, "stream": True})
    assert status == 200, body
    events = sse_events(body)
    pieces = [e["text_output"] for e in events]
    assert len([p for p in pieces if p]) > 3
    assert "".join(pieces) == json.loads(whole)["text_output"]
    assert events[-1]["finish_reason"] == "stop"


def test_grpc_streaming_and_not_agree(grpc):
    chunks = list(grpc.generate(QUESTION, max_tokens=24, stream=True))
    whole = list(grpc.generate(QUESTION, max_tokens=24, stream=False))
    assert len(chunks) > 3 and len(whole) == 1
    assert "".join(c.text for c in chunks) == whole[0].text
    assert "Paris" in whole[0].text
    assert chunks[-1].num_output_tokens == whole[0].num_output_tokens


def test_http_and_grpc_give_the_same_answer(server, grpc):
    http = TritoneClient(server.http_url, "http")
    assert http.complete(QUESTION, max_tokens=24).text == grpc.complete(QUESTION, max_tokens=24).text


def test_greedy_equals_hugging_face(grpc, tokenizer, hf_model):
    for prompt in ("The quick brown fox", "def fibonacci(n):\n    "):
        ids = tokenizer(prompt).input_ids
        expected = tokenizer.decode(hf_greedy(hf_model, ids, 20), skip_special_tokens=True)
        got = grpc.complete(prompt, max_tokens=20, apply_chat_template=False)
        assert got.text == expected
        assert got.num_input_tokens == len(ids)


def test_greedy_with_repetition_penalty_equals_hugging_face(grpc, tokenizer, hf_model):
    # The penalty covers the prompt's tokens too, as in Hugging Face and vLLM: "1, 2, 3," repeats
    # its prompt, so a penalty of output tokens alone answers differently.
    for prompt in ("1, 2, 3, 4, 5,", "def fibonacci(n):\n    "):
        ids = tokenizer(prompt).input_ids
        hf_ids = hf_greedy(hf_model, ids, 24, repetition_penalty=1.3)
        got = grpc.complete(prompt, max_tokens=24, apply_chat_template=False, repetition_penalty=1.3)
        assert got.text == tokenizer.decode(hf_ids, skip_special_tokens=True)
        assert got.num_output_tokens == len(hf_ids)


def test_chat_template_is_applied_like_hugging_face(grpc, tokenizer, hf_model):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    expected = tokenizer.decode(hf_greedy(hf_model, ids, 24), skip_special_tokens=True)
    got = grpc.complete(QUESTION, max_tokens=24)
    assert got.text == expected and got.num_input_tokens == len(ids)


@pytest.mark.parametrize("max_tokens", [1, 7, 33])
def test_max_tokens_is_honoured_exactly(grpc, max_tokens):
    chunks = list(grpc.generate("Count to one hundred:", max_tokens=max_tokens, stream=True, end_id=-1))
    assert chunks[-1].num_output_tokens == max_tokens
    assert chunks[-1].finish_reason == "length"
    whole = grpc.complete("Count to one hundred:", max_tokens=max_tokens, end_id=-1)
    assert whole.num_output_tokens == max_tokens


def test_declared_outputs_are_present_with_their_dtypes(server):
    client = grpcclient.InferenceServerClient(f"{server.args.host}:{server.args.grpc_port}")
    config = client.get_model_config("ensemble", as_json=True)["config"]
    declared = {o["name"]: o["data_type"] for o in config["output"]}
    assert set(declared) >= {"text_output", "num_input_tokens", "num_output_tokens", "cum_log_probs",
                             "output_log_probs", "finish_reason"}
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer("ensemble", grpc_inputs(("text_input", np.array([[b"Hello"]], dtype=object), "BYTES"),
                                                      ("max_tokens", np.array([[4]], dtype=np.int32), "INT32"),
                                                      ("return_log_probs", np.array([[True]]), "BOOL"),
                                                      # top_log_probs and prompt_log_probs come only
                                                      # when asked for
                                                      ("num_top_log_probs", np.array([[2]], dtype=np.int32),
                                                       "INT32"),
                                                      ("num_prompt_log_probs", np.array([[1]], dtype=np.int32),
                                                       "INT32")))
    client.stop_stream()
    client.close()
    (result, error), = results
    assert error is None
    numpy_of = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32}
    for name, dtype in declared.items():
        if name == "sequence_index":  # only with num_return_sequences (test_openai_choices.py)
            continue
        array = result.as_numpy(name)
        assert array is not None, name
        assert array.dtype == numpy_of[dtype], name
    log_probs = result.as_numpy("output_log_probs").reshape(-1)
    assert len(log_probs) == result.as_numpy("num_output_tokens").item()
    assert np.all(log_probs <= 0) and np.isclose(log_probs.sum(), result.as_numpy("cum_log_probs").item(), atol=1e-4)


def test_seeded_sampling_is_reproducible(grpc):
    a = grpc.complete("Tell me a story.", max_tokens=24, temperature=1.0, seed=7)
    b = grpc.complete("Tell me a story.", max_tokens=24, temperature=1.0, seed=7)
    c = grpc.complete("Tell me a story.", max_tokens=24, temperature=1.0, seed=8)
    assert a.text == b.text and a.text != c.text


def test_bad_input_fails_alone_and_the_server_keeps_serving(server, grpc):
    status, body = post(server, "generate", {"text_input": QUESTION, "max_tokens": 0})
    assert status == 400 and "max_tokens" in body
    with pytest.raises(RuntimeError, match="temperature"):
        grpc.complete(QUESTION, max_tokens=4, temperature=-1.0)
    with pytest.raises(RuntimeError, match="text_input"):
        grpc.complete("", max_tokens=4)
    assert "Paris" in grpc.complete(QUESTION, max_tokens=24).text


def metric_values(server):
    url = f"http://{server.args.host}:{server.args.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    values = {}
    for line in lines:
        if line.startswith("tritone_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
            if (phase := re.search(r'phase="(\w+)"', name)) is not None:
                values[f"phase:{phase.group(1)}"] = float(value)
    return values


def test_tritonserver_and_its_model_processes_run_on_the_preloaded_allocator(server):
    # --malloc auto, the default, finds mimalloc in Tritone's own environment.
    tritonserver = server.process.pid
    children = [int(stat.parent.name) for stat in pathlib.Path("/proc").glob("[0-9]*/stat")
                if _parent(stat) == tritonserver]
    assert len(children) >= 4  # preprocessing x2, llm, postprocessing
    for pid in (tritonserver, *children):
        assert "libmimalloc" in pathlib.Path(f"/proc/{pid}/maps").read_text(), pid
    log = (server.run_dir / "server.log").read_text()
    assert "tritonserver and its model processes allocate with" in log and "libmimalloc" in log


def _parent(stat: pathlib.Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_engine_metrics_are_served_and_the_cache_is_idle_after_requests(server, grpc):
    grpc.complete(QUESTION, max_tokens=8)
    time.sleep(2.5)  # the engine reports once a second
    values = metric_values(server)
    assert values["tritone_generation_tokens_total"] > 0
    assert values["tritone_prompt_tokens_total"] > 0
    assert values["tritone_kv_blocks_used"] == 0 and values["tritone_kv_blocks_free"] > 0
    assert values["tritone_num_requests_running"] == 0 and values["tritone_num_requests_waiting"] == 0
    assert values["tritone_time_to_first_token_seconds_count"] > 0
    assert "tritone_forward_busy_fraction" in values and "tritone_preemptions_total" in values
    # Where the steps' time went, phase by phase; the forward pass is most of it.
    phases = {p: values[f"phase:{p}"] for p in ("schedule", "prepare", "forward", "sample", "update", "send")}
    assert values["tritone_steps_total"] >= 8 and all(v > 0 for v in phases.values())
    assert phases["forward"] == max(phases.values())


def test_cancelled_llm_stream_frees_its_blocks_and_others_go_on(server, grpc, tokenizer):
    # Triton 2.51 does not pass a client's cancellation into an ensemble step that is already
    # running, so this cancels a stream of the llm model itself.
    client = grpcclient.InferenceServerClient(f"{server.args.host}:{server.args.grpc_port}")
    received = []
    client.start_stream(callback=lambda result, error: received.append(error))
    prompt_ids = np.array([tokenizer("Count to one thousand:").input_ids], dtype=np.int32)
    client.async_stream_infer("llm", grpc_inputs(("INPUT_IDS", prompt_ids, "INT32"),
                                                 ("MAX_TOKENS", np.array([[2000]], dtype=np.int32), "INT32"),
                                                 ("END_ID", np.array([[-1]], dtype=np.int32), "INT32"),
                                                 ("STREAM", np.array([[True]]), "BOOL")))
    deadline = time.monotonic() + 60
    while len(received) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(received) >= 5 and not any(received)
    client.stop_stream(cancel_requests=True)
    client.close()
    assert "Paris" in grpc.complete(QUESTION, max_tokens=24).text
    time.sleep(2.5)
    values = metric_values(server)
    assert values["tritone_kv_blocks_used"] == 0
    assert values["tritone_num_requests_running"] == 0
