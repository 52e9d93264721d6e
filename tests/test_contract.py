"""The ensemble's request contract against a real tritonserver: exact streamed text at high
temperature, text stop words, bad words, chat messages, echo and special tokens, old and new names."""

import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from test_integration import QUESTION, grpc_inputs, metric_values, post, sse_events
from tritone_client import TritoneClient

pytestmark = pytest.mark.integration

# Raw continuations (no chat template) that a small model, sampled hot, answers with characters
# of several bytes split over byte-level tokens: CJK, emoji with a ZWJ, and with these seeds also
# a lead byte that no continuation byte follows (a U+FFFD in the full decode itself).
HOT_PROMPTS = [("东京是日本的首都，也是", 2), ("Emoji story: 🐶🐱🐭🐹🐰🦊", 1)]
HOT = dict(max_tokens=32, temperature=1.3, apply_chat_template=False)


@pytest.fixture(scope="module")
def grpc(server):
    with TritoneClient(f"{server.args.host}:{server.args.grpc_port}", "grpc") as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    return TritoneClient(server.http_url, "http")


def llm_token_ids(server, prompt_ids: list[int], **params) -> list[int]:
    """The generated ids, from the llm model itself, for the same request."""
    client = grpcclient.InferenceServerClient(f"{server.args.host}:{server.args.grpc_port}")
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer("llm", grpc_inputs(
        ("INPUT_IDS", np.array([prompt_ids], dtype=np.int32), "INT32"),
        ("MAX_TOKENS", np.array([[params["max_tokens"]]], dtype=np.int32), "INT32"),
        ("TEMPERATURE", np.array([[params["temperature"]]], dtype=np.float32), "FP32"),
        ("SEED", np.array([[params["seed"]]], dtype=np.uint64), "UINT64")))
    client.stop_stream()
    client.close()
    (result, error), = results
    assert error is None, error
    return result.as_numpy("TOKEN_IDS").reshape(-1).tolist()


@pytest.fixture(scope="module")
def hot_answers(server, grpc, http, tokenizer):
    """For each hot prompt: (streamed over gRPC, whole over HTTP, decode of the llm model's ids)."""
    answers = []
    for prompt, seed in HOT_PROMPTS:
        streamed = "".join(c.text for c in grpc.generate(prompt, stream=True, seed=seed, **HOT))
        whole = http.complete(prompt, seed=seed, **HOT)
        ids = llm_token_ids(server, tokenizer(prompt).input_ids, seed=seed, **HOT)
        answers.append((streamed, whole, tokenizer.decode(ids, skip_special_tokens=True)))
    return answers


def test_hot_sampled_stream_equals_the_whole_answer_and_the_full_decode(hot_answers):
    for streamed, whole, full_decode in hot_answers:
        assert streamed == whole.text == full_decode
        assert whole.num_output_tokens == 32 and whole.finish_reason == "length"
        assert streamed.count("\ufffd") == full_decode.count("\ufffd")
    # The answers did hold characters of several bytes, where a split character would show.
    assert sum(ord(c) > 0x7FF for streamed, _, _ in hot_answers for c in streamed) >= 3


def test_a_stop_word_from_the_middle_of_the_answer_cuts_it_right_before(grpc, http, hot_answers):
    for (prompt, seed), (_, whole, _) in zip(HOT_PROMPTS, hot_answers):
        middle = len(whole.text) // 2
        word = whole.text[middle:middle + 4]
        expected = whole.text[:whole.text.find(word)]
        chunks = list(grpc.generate(prompt, stream=True, seed=seed, stop_words=[word], **HOT))
        assert "".join(c.text for c in chunks) == expected
        assert chunks[-1].finish_reason == "stop"
        assert chunks[-1].num_output_tokens < whole.num_output_tokens
        cut = http.complete(prompt, seed=seed, stop_words=["never in it", word], **HOT)
        assert cut.text == expected and cut.finish_reason == "stop"
        assert cut.num_output_tokens == chunks[-1].num_output_tokens


def test_http_streaming_stops_at_a_stop_word_too(server):
    body = {"text_input": QUESTION, "max_tokens": 24}
    _, whole = post(server, "generate", body)
    text = json.loads(whole)["text_output"]
    word = text[text.index("France"):][:9]  # "France is", across tokens
    status, streamed = post(server, "generate_stream", {**body, "stream": True, "stop_words": [word]})
    assert status == 200, streamed
    events = sse_events(streamed)
    assert "".join(e["text_output"] for e in events) == text[:text.index(word)]
    assert events[-1]["finish_reason"] == "stop"


def test_a_stopped_request_leaves_the_engine_at_once(server, grpc):
    prompt = "Count to one hundred:"
    head = grpc.complete(prompt, max_tokens=12, end_id=-1).text
    word = head[len(head) // 2:][:2]
    # Without its abort, the engine would go on for 400 tokens, far longer than the wait below.
    answer = grpc.complete(prompt, max_tokens=400, end_id=-1, stop_words=[word])
    assert answer.finish_reason == "stop" and answer.num_output_tokens <= 12
    time.sleep(2.5)  # the engine reports once a second
    values = metric_values(server)
    assert values["tritone_num_requests_running"] == 0 and values["tritone_kv_blocks_used"] == 0


def test_bad_words_never_appear(grpc):
    assert "Paris" in grpc.complete(QUESTION, max_tokens=24).text
    for bad_words in (["Paris"], ["Paris", "capital"]):
        answer = grpc.complete(QUESTION, max_tokens=24, bad_words=bad_words).text
        assert answer and not any(w in answer for w in bad_words), answer  # case-sensitive, as in TensorRT-LLM


def test_chat_messages_are_put_in_the_chat_template(server, grpc, http):
    messages = [{"role": "user", "content": QUESTION}]
    as_text = grpc.complete(QUESTION, max_tokens=12)
    as_chat = http.complete(messages, max_tokens=12)
    assert as_chat.text == as_text.text and as_chat.num_input_tokens == as_text.num_input_tokens
    system = grpc.complete([{"role": "system", "content": "You only answer in French."}] + messages, max_tokens=12)
    assert system.num_input_tokens != as_text.num_input_tokens


def test_malformed_messages_fail_with_a_clear_error(server, grpc):
    status, body = post(server, "generate", {"messages": "[{\"role\": \"user\"", "max_tokens": 4})
    assert status == 400 and "messages is not valid JSON" in body
    status, body = post(server, "generate", {"messages": "[{\"role\": \"user\"}]", "max_tokens": 4})
    assert status == 400 and "messages[0]" in body
    status, body = post(server, "generate", {"max_tokens": 4})
    assert status == 400 and "text_input is missing" in body
    with pytest.raises(RuntimeError, match="stop_words holds an empty string"):
        grpc.complete(QUESTION, max_tokens=4, stop_words=[""])
    assert "Paris" in grpc.complete(QUESTION, max_tokens=24).text


def test_echo_and_special_tokens_are_per_request(grpc):
    plain = grpc.complete(QUESTION, max_tokens=4)
    echoed = grpc.complete(QUESTION, max_tokens=4, exclude_input_in_output=False)
    raw = grpc.complete(QUESTION, max_tokens=4, exclude_input_in_output=False, skip_special_tokens=False)
    assert QUESTION not in plain.text
    assert QUESTION in echoed.text and echoed.text.endswith(plain.text) and "<|im_start|>" not in echoed.text
    assert raw.text.startswith("<|im_start|>") and raw.text.endswith(plain.text)
    assert plain.num_output_tokens == echoed.num_output_tokens == raw.num_output_tokens == 4


def test_old_and_new_names_do_the_same(grpc):
    for name in ("min_tokens", "min_length"):
        answer = grpc.complete(QUESTION, max_tokens=24, **{name: 16})
        assert answer.num_output_tokens >= 16, name
    new = grpc.complete("Tell me a story.", max_tokens=8, temperature=1.0, seed=11)
    old = grpc.complete("Tell me a story.", max_tokens=8, temperature=1.0, random_seed=11)
    assert new.text == old.text
