"""tritone-openai against a real tritonserver, with the real `openai` client; and cancellation
that reaches the engine from every kind of client (OpenAI SSE, HTTP generate_stream, gRPC)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from conftest import open_http_generate_stream, start_server
from test_integration import metric_values
from tritone.launcher import free_port
from tritone_client import TritoneClient
from tritone_client.client import infer_inputs

pytestmark = pytest.mark.integration

API_KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A request long enough to be still running when its client goes away (about 2 minutes here).
LONG_TOKENS = 2000


OAI_OPTIONS = ("--kv-cache-bytes", str(256 << 20), "--api-key", API_KEY, "--max-num-seqs", "1", "--max-queue-len", "1")


@pytest.fixture(scope="module")
def oai_server(model_dir, tmp_path_factory):
    # One sequence at a time and a queue of one, so that a third request at once is refused.
    srv, log = start_server(tmp_path_factory, "openai_server", *OAI_OPTIONS, "--openai-port", str(free_port()))
    yield srv
    # Not asserted: Triton 2.51 keeps ensemble requests that a client cancelled counted in flight,
    # so this server's exit waits out its exit timeout (docs/operations.md, Cancellation).
    srv.stop()
    log.close()


@pytest.fixture(scope="module")
def inline_oai_server(model_dir, tmp_path_factory):
    """As oai_server, with the text work in the engine's process (--pipeline inline): no llm model
    to send aborts to, so a client's leaving must reach the engine through its own stream."""
    srv, log = start_server(tmp_path_factory, "openai_inline", *OAI_OPTIONS, "--openai-port", str(free_port()),
                            "--pipeline", "inline")
    yield srv
    srv.stop()
    log.close()


@pytest.fixture(params=["ensemble", "inline"])
def any_server(request):
    return request.getfixturevalue("oai_server" if request.param == "ensemble" else "inline_oai_server")


@pytest.fixture(scope="module")
def client(oai_server):
    return openai.OpenAI(base_url=oai_server.openai_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(oai_server):
    return oai_server.model_dir.name


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_completion_and_chat_answer_with_usage(client, model):
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-") and completion.created
    assert completion.choices[0].text.strip() and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8 and completion.usage.prompt_tokens == 5

    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_usage_equals_the_servers_token_counts(oai_server, client, model):
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0.8, seed=5)
    with TritoneClient(f"127.0.0.1:{oai_server.args.grpc_port}", "grpc") as tc:
        direct = tc.complete(QUESTION, max_tokens=20, temperature=0.8, seed=5)
    assert chat.choices[0].message.content == direct.text
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (direct.num_input_tokens, direct.num_output_tokens)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_pieces_join_to_the_whole_answer_for_the_same_seed(client, model, kind):
    if kind == "completion":
        def create(**kw):
            return client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, seed=7, **kw)

        def piece(chunk):
            return chunk.choices[0].text if chunk.choices else ""
        whole = create()
        whole_text = whole.choices[0].text
    else:
        def create(**kw):
            return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                                  max_tokens=40, seed=7, **kw)

        def piece(chunk):
            return (chunk.choices[0].delta.content or "") if chunk.choices else ""
        whole = create()
        whole_text = whole.choices[0].message.content
    chunks = list(create(stream=True, stream_options={"include_usage": True}))
    assert "".join(piece(c) for c in chunks) == whole_text
    assert len([c for c in chunks if piece(c)]) > 5  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    # include_usage: a last chunk with no choices and the usage; the others carry usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_cuts_the_text_streamed_and_not(client, model):
    def ask(**kw):
        return client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, **kw)

    text = ask().choices[0].text
    assert " 9," in text, text
    cut = ask(stop=[" 9,", "never"])
    assert cut.choices[0].text == text[:text.index(" 9,")] and cut.choices[0].finish_reason == "stop"
    streamed = list(ask(stop=" 9,", stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_extras_and_logprobs(client, model):
    chat = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, logprobs=True, presence_penalty=0.1, frequency_penalty=0.1,
        top_p=0.9, seed=1,
        extra_body={"top_k": 20, "min_p": 0.01, "min_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.1})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    values = [entry.logprob for entry in chat.choices[0].logprobs.content]
    assert len(values) == 6 and all(v <= 0 for v in values)
    completion = client.completions.create(model=model, prompt="Hello", max_tokens=4, logprobs=1, temperature=0)
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


def test_logit_bias_forces_and_bans_tokens_on_both_endpoints(client, model, tokenizer):
    (paris,) = tokenizer.encode(" Paris")
    forced = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, logit_bias={str(paris): 100})
    assert forced.choices[0].text == tokenizer.decode([paris] * 5)
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0,
                                          logit_bias={str(paris): 100})
    assert chat.choices[0].message.content == tokenizer.decode([paris] * 4)
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0)
    (greedy,) = tokenizer.encode(plain.choices[0].text)
    banned = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, logit_bias={str(greedy): -100})
    assert greedy not in tokenizer.encode(banned.choices[0].text)
    error = error_of(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                                       logit_bias={"10000000": 5}))
    assert error.status_code == 400 and error.body["message"].startswith("logit_bias"), error.body


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("kwargs, status, field", [
    ({"temperature": -1.0}, 400, "temperature"),              # the engine's own message
    ({"max_tokens": 0}, 400, "max_tokens"),                   # the engine's own message
    ({"max_tokens": 10_000_000}, 400, "max_tokens"),          # the engine's own message
    ({"n": 9}, 400, "n"),
    ({"functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400, "tools[0]"),
    ({"top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"extra_body": {"max_tokens": "many"}}, 400, "max_tokens"),
    ({"extra_body": {"no_such_option": 1}}, 400, "no_such_option"),
    ({"model": "gpt-4"}, 404, "model"),
])
def test_errors_have_their_status_and_name_the_field(client, model, kwargs, status, field):
    kwargs = {"model": model, "messages": QUESTION, "max_tokens": 4, **kwargs}
    error = error_of(lambda: client.chat.completions.create(**kwargs))
    assert error.status_code == status
    assert field in error.body["message"], error.body
    assert error.body["type"] and "param" in error.body


def test_an_unknown_model_is_404_in_completions_too(client):
    error = error_of(lambda: client.completions.create(model="nope", prompt="Hi", max_tokens=2))
    assert error.status_code == 404 and "nope" in error.body["message"]


def test_the_api_key_is_enforced(oai_server, model):
    for key in ("wrong", f"{API_KEY}x"):
        bad = openai.OpenAI(base_url=oai_server.openai_url, api_key=key, max_retries=0)
        error = error_of(lambda: bad.models.list())
        assert error.status_code == 401 and "API key" in error.body["message"]
    request = urllib.request.Request(f"{oai_server.openai_url}/chat/completions", method="POST",
                                     data=json.dumps({"model": model, "messages": QUESTION}).encode())
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 401 and json.load(caught.value)["error"]["type"] == "authentication_error"


def test_a_full_queue_is_503_and_the_rest_are_served(oai_server, model):
    # One runs, one waits, the others find the queue (of one) full.
    async def burst():
        aclient = openai.AsyncOpenAI(base_url=oai_server.openai_url, api_key=API_KEY, max_retries=0)
        calls = [aclient.completions.create(model=model, prompt="Count:", max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True}) for _ in range(5)]
        try:
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await aclient.close()

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert refused and all(r.status_code == 503 and "server busy" in r.body["message"] for r in refused), results
    assert len(served) + len(refused) == 5 and len(served) >= 2
    assert all(r.usage.completion_tokens == 24 for r in served)


# ---- a client that goes away: the engine stops and frees its KV blocks within a second ----

def kv_blocks_used(server) -> float:
    return metric_values(server)["tritone_kv_blocks_used"]


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def drop_openai_stream(server, model):
    client = openai.OpenAI(base_url=server.openai_url, api_key=API_KEY, max_retries=0)
    stream = client.completions.create(model=model, prompt="Count to one thousand:", max_tokens=LONG_TOKENS,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    return stream.close


def drop_http_generate_stream(server, model):
    return open_http_generate_stream(server, LONG_TOKENS).close


def cancel_grpc_ensemble_stream(server, model):
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.args.grpc_port}")
    received = threading.Event()
    count = []

    def on_response(result, error):
        count.append(error)
        if len(count) >= 3:
            received.set()

    grpc.start_stream(callback=on_response)
    inputs = infer_inputs(grpcclient, (("text_input", np.array([[b"Count to one thousand:"]], dtype=object)),
                                       ("max_tokens", np.array([[LONG_TOKENS]], dtype=np.int32)),
                                       ("end_id", np.array([[-1]], dtype=np.int32)),
                                       ("stream", np.array([[True]]))))
    grpc.async_stream_infer("ensemble", inputs)
    assert received.wait(60) and count[0] is None, count

    def cancel():
        grpc.stop_stream(cancel_requests=True)
        grpc.close()
    return cancel


@pytest.mark.parametrize("leave", [drop_openai_stream, drop_http_generate_stream, cancel_grpc_ensemble_stream],
                         ids=["openai-sse", "http-generate-stream", "grpc-ensemble"])
def test_a_client_that_goes_away_frees_the_engine_within_a_second(any_server, model, leave):
    assert wait_for(lambda: kv_blocks_used(any_server) == 0, 30)
    before = metric_values(any_server)["tritone_generation_tokens_total"]
    go_away = leave(any_server, model)
    # The gauge trails the engine by a quarter second at most: it has seen the request.
    assert wait_for(lambda: kv_blocks_used(any_server) > 0, 5)
    start = time.monotonic()
    go_away()
    assert wait_for(lambda: kv_blocks_used(any_server) == 0, 1.0), \
        f"KV blocks still in use {time.monotonic() - start:.2f} s after the client left"
    values = metric_values(any_server)
    assert values["tritone_num_requests_running"] == 0 and values["tritone_num_requests_waiting"] == 0
    assert values["tritone_generation_tokens_total"] - before < 200
    # And the server goes on serving.
    client = openai.OpenAI(base_url=any_server.openai_url, api_key=API_KEY, max_retries=0)
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in answer.choices[0].message.content


def test_a_queued_request_whose_client_leaves_is_dropped_from_the_engine(any_server, model):
    # The server runs one sequence at a time: B waits behind A and has sent nothing back, so no
    # postprocessing step can see its cancellation: through the ensemble the front end tells the
    # engine directly; inline, the engine's own model sees B's stream cancelled.
    cancel_a = cancel_grpc_ensemble_stream(any_server, model)
    try:
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 50, "stream": True}).encode()
        b = socket.create_connection((any_server.args.host, int(any_server.openai_url.split(":")[2].split("/")[0])))
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tritone\r\nAuthorization: Bearer %s\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (API_KEY.encode(), len(body), body))
        assert wait_for(lambda: metric_values(any_server)["tritone_num_requests_waiting"] == 1, 5)
        b.close()
        assert wait_for(lambda: metric_values(any_server)["tritone_num_requests_waiting"] == 0, 1.0)
        assert metric_values(any_server)["tritone_num_requests_running"] == 1  # A goes on
    finally:
        cancel_a()
    assert wait_for(lambda: kv_blocks_used(any_server) == 0, 1.0)
