"""Parsing and validation of the models' inputs, and the responses the llm model builds, run
through the postprocessing they feed, with the default model's tokenizer."""

import json
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tritone.scheduling.request import FinishReason, RequestOutput
from tritone.serving.flow import FlowBoard, new_key
from tritone.serving.inputs import parse_llm_request, parse_messages, stream_interval, text_list
from tritone.serving.lifecycle import Drain
from tritone.serving.processing import Postprocessor, Preprocessor
from tritone.serving.responses import ResponseState, ResponseStream
from tritone.text import Detokenizer


def getter(**inputs):
    arrays = {k.upper(): np.asarray(v) for k, v in inputs.items()}
    return lambda name: arrays.get(name)


@pytest.fixture(scope="module")
def detokenizer(tokenizer):
    return Detokenizer(tokenizer)


def test_defaults_are_greedy_and_exclude_the_prompt():
    req = parse_llm_request(getter(input_ids=np.array([1, 2], dtype=np.int32), max_tokens=[5]))
    assert req.params.is_greedy and req.params.max_tokens == 5
    assert req.exclude_input_in_output and not req.stream and req.params.end_id is None
    assert req.skip_special_tokens and req.stop_words == []


def test_old_and_new_names_both_work():
    old = parse_llm_request(getter(input_ids=[1], max_tokens=[5], min_length=[3], random_seed=np.array([9], np.uint64)))
    new = parse_llm_request(getter(input_ids=[1], max_tokens=[5], min_tokens=[3], seed=np.array([9], np.uint64)))
    assert (old.params.min_tokens, old.params.seed) == (new.params.min_tokens, new.params.seed) == (3, 9)


def test_top_k_alone_turns_sampling_on():
    req = parse_llm_request(getter(input_ids=[1], max_tokens=[5], top_k=[40]))
    assert not req.params.is_greedy


def test_missing_max_tokens_names_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        parse_llm_request(getter(input_ids=[1]))


def test_stop_words_arrive_as_text():
    words = np.array([b"\n\n", "é".encode()], object)
    req = parse_llm_request(getter(input_ids=[1], max_tokens=[5], stop_words=words))
    assert req.stop_words == ["\n\n", "é"]


def test_text_list_refuses_empty_and_invalid_words():
    with pytest.raises(ValueError, match="stop_words holds an empty"):
        text_list(getter(stop_words=np.array([b""], dtype=object)), "STOP_WORDS")
    with pytest.raises(ValueError, match="stop_words holds bytes that are not valid UTF-8"):
        text_list(getter(stop_words=np.array([b"\xff"], dtype=object)), "STOP_WORDS")


@pytest.mark.parametrize("raw, message", [
    (b"[{\"role\": \"user\"", "messages is not valid JSON"),
    (b"{\"role\": \"user\", \"content\": \"hi\"}", "messages must be a non-empty JSON list"),
    (b"[]", "messages must be a non-empty JSON list"),
    (b"[{\"role\": \"user\", \"content\": 3}]", r"messages\[0\] must be an object"),
    (b"\xff", "messages is not valid UTF-8"),
])
def test_malformed_messages_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_messages(raw)


def test_preprocessing_fails_each_bad_request_alone(model_dir, tokenizer):
    pre = Preprocessor({"model_dir": str(model_dir)})
    chat = json.dumps([{"role": "user", "content": "Hi"}]).encode()
    results = pre([
        getter(text_input=np.array([b"Hi"], object)),
        getter(messages=np.array([b"not json"], object)),
        getter(messages=np.array([chat], object)),
        getter(text_input=np.array([b"Hi"], object), messages=np.array([chat], object)),
        getter(messages=np.array([chat], object), apply_chat_template=[False]),
        getter(),
    ])
    assert results[0]["INPUT_IDS"].tolist() == results[2]["INPUT_IDS"].tolist()
    assert tokenizer.decode(results[2]["INPUT_IDS"]).startswith("<|im_start|>")
    assert "messages is not valid JSON" in str(results[1])
    assert "not both" in str(results[3])
    assert "messages always go through the chat template" in str(results[4])
    assert "text_input is missing" in str(results[5])


def output(ids, finished=False, reason=None, n_out=0):
    return RequestOutput("r", list(ids), [-0.5] * len(ids), 3, n_out, finished, reason)


def state(tensors) -> ResponseState:
    return ResponseState.read(tensors["STATE"])


def run(stream: ResponseStream, detok: Detokenizer, outputs: list[RequestOutput]):
    """Feeds engine outputs to the stream and its responses to postprocessing, as the ensemble
    does; returns the texts the client receives and the last response's tensors."""
    post, texts, last = Postprocessor(detok), [], None
    for out in outputs:
        tensors = stream.on_output(out)
        if tensors is not None:
            assert last is None or not state(last).is_final, "a response after the final one"
            texts.append(post([tensors.get])[0]["TEXT_OUTPUT"][0].decode())
            last = tensors
    return texts, last


def test_streamed_responses_carry_context_and_the_final_flag(detokenizer):
    req = parse_llm_request(getter(input_ids=[1, 2, 3], max_tokens=[3], stream=[True], return_log_probs=[True]))
    stream = ResponseStream(req, detokenizer)
    first = stream.on_output(output([10], n_out=1))
    second = stream.on_output(output([11, 12], n_out=3))  # the sender may merge two steps' outputs
    last = stream.on_output(output([], finished=True, reason=FinishReason.LENGTH, n_out=3))

    def context(tensors):
        return ResponseState.context_ids(tensors["STATE"])
    assert first["TOKEN_IDS"].tolist() == [10] and context(first) == []
    assert second["TOKEN_IDS"].tolist() == [11, 12] and context(second) == [10]
    assert not state(second).is_final and state(second).num_output_tokens == 3
    assert second["LOG_PROBS"].tolist() == [-1.5, -0.5, -0.5]  # cumulative, then each token's
    assert state(last).is_final and state(last).finish_reason == "length"
    assert context(last) == [10, 11, 12] and last["LOG_PROBS"].tolist() == [-1.5]
    # Numbered per stream and across streams, in the order sent.
    assert [state(t).chunk_seq for t in (first, second, last)] == [1, 1, 1]  # no flow board: not counted
    assert [state(t).send_seq for t in (first, second, last)] == [0, 1, 2]


def test_log_probs_only_when_asked(detokenizer):
    stream = ResponseStream(parse_llm_request(getter(input_ids=[1], max_tokens=[1])), detokenizer)
    final = stream.on_output(output([10], finished=True, reason=FinishReason.LENGTH, n_out=1))
    assert "LOG_PROBS" not in final
    result = Postprocessor(detokenizer)([final.get])[0]
    assert "OUT_CUM_LOG_PROBS" not in result and result["OUT_FINISH_REASON"][0] == b"length"


def test_a_failed_stream_s_last_chunk_becomes_its_error_and_is_still_marked(detokenizer, tmp_path):
    board = FlowBoard(tmp_path / "flow")
    key = new_key(5)
    board.register(key)
    stream = ResponseStream(parse_llm_request(getter(input_ids=[1, 2], max_tokens=[8], stream=[True])), detokenizer,
                            key=key, flow=board)
    chunk = stream.on_output(output([10], n_out=1))
    failed = stream.failed("model worker 0 of engine 0 failed while running a step")
    results = Postprocessor(detokenizer, board)([chunk.get, failed.get])
    assert results[0]["OUT_NUM_OUTPUT_TOKENS"].tolist() == [1]
    assert isinstance(results[1], RuntimeError) and str(results[1]) == \
        "model worker 0 of engine 0 failed while running a step"
    assert board.is_received(key, state(failed).chunk_seq)
    assert stream.on_output(output([11], n_out=2)) is None  # nothing after the final chunk


def test_the_prompt_count_comes_first_and_last_and_the_finish_reason_last(detokenizer):
    stream = ResponseStream(parse_llm_request(getter(input_ids=[1, 2], max_tokens=[3], stream=[True])), detokenizer)
    chunks = [stream.on_output(output([10 + i], finished=i == 2, reason=FinishReason.LENGTH, n_out=i + 1))
              for i in range(3)]
    results = Postprocessor(detokenizer)([c.get for c in chunks])
    assert [r.get("OUT_NUM_INPUT_TOKENS", [None])[0] for r in results] == [2, None, 2]
    assert [r.get("OUT_FINISH_REASON", [None])[0] for r in results] == [None, None, b"length"]
    assert [r["OUT_NUM_OUTPUT_TOKENS"][0] for r in results] == [1, 2, 3]


@pytest.mark.parametrize("exclude_input", [True, False])
def test_stream_interval_sends_the_first_token_then_every_nth_and_the_same_text(detokenizer, tokenizer,
                                                                                 exclude_input):
    ids = tokenizer(ANSWERS[2], add_special_tokens=False).input_ids[:10]
    outputs = [output([t], i == len(ids) - 1, FinishReason.LENGTH, i + 1) for i, t in enumerate(ids)]
    texts = {}
    for interval in (1, 4):
        req = parse_llm_request(getter(input_ids=[1, 2], max_tokens=[len(ids)], stream=[True],
                                       exclude_input_in_output=[exclude_input], return_log_probs=[True]))
        stream = ResponseStream(req, detokenizer, stream_interval=interval)
        sizes = [len(r["TOKEN_IDS"]) - (0 if exclude_input or k else 2)
                 for k, r in enumerate(filter(None, map(stream.on_output, outputs)))]
        texts[interval], last = run(ResponseStream(req, detokenizer, stream_interval=interval), detokenizer, outputs)
        assert sizes == ([1] * 10 if interval == 1 else [1, 4, 4, 1])
        assert state(last).num_output_tokens == 10 and len(last["LOG_PROBS"]) == 1 + sizes[-1]
    assert "".join(texts[4]) == "".join(texts[1])


def test_stream_interval_parameter_is_checked():
    assert stream_interval({}) == 1 and stream_interval({"stream_interval": "${stream_interval}"}) == 1
    assert stream_interval({"stream_interval": "4"}) == 4
    with pytest.raises(ValueError, match="stream_interval"):
        stream_interval({"stream_interval": "0"})


def test_non_streamed_request_gets_one_response_with_everything(detokenizer):
    req = parse_llm_request(getter(input_ids=[1, 2, 3], max_tokens=[2], exclude_input_in_output=[False],
                                   return_log_probs=[True]))
    stream = ResponseStream(req, detokenizer)
    assert stream.on_output(output([10], n_out=1)) is None
    final = stream.on_output(output([11], finished=True, reason=FinishReason.LENGTH, n_out=2))
    assert final["TOKEN_IDS"].tolist() == [1, 2, 3, 10, 11]
    assert state(final).num_output_tokens == 2 and state(final).num_input_tokens == 3
    assert final["LOG_PROBS"].tolist() == [-1.0, -0.5, -0.5]


ANSWERS = ["The capital of France is Paris. It is known as the city of light.",
           "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))",
           "東京は日本の首都です。🇯🇵 人口は約1400万人 👨‍👩‍👧 مرحبا नमस्ते"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=st.sampled_from(ANSWERS), data=st.data(), stream=st.booleans(),
       steps=st.lists(st.integers(1, 4), max_size=80), interval=st.integers(1, 5))
def test_a_stop_word_ends_the_answer_right_before_it(detokenizer, tokenizer, answer, data, stream, steps, interval):
    ids = tokenizer(answer, add_special_tokens=False).input_ids
    full = tokenizer.decode(ids)
    start = data.draw(st.integers(0, len(full) - 1))
    word = full[start:start + data.draw(st.integers(1, 6))]
    req = parse_llm_request(getter(input_ids=[1, 2], max_tokens=[len(ids)], stream=[stream],
                                   stop_words=np.array([b"\x00never", word.encode()], object), return_log_probs=[True]))
    outputs, sent, sizes = [], 0, iter(steps)
    while sent < len(ids):  # the engine's outputs, several tokens each when the sender merges them
        n = min(len(ids) - sent, next(sizes, 1))
        outputs.append(output(ids[sent:sent + n], sent + n == len(ids), FinishReason.LENGTH, sent + n))
        sent += n
    stream_ = ResponseStream(req, detokenizer, stream_interval=interval)
    texts, last = run(stream_, detokenizer, outputs)
    expected = full[:full.find(word)]
    assert "".join(texts) == expected
    # Streamed text never shows a start of the stop word that is taken back later.
    for k in range(len(texts)):
        assert expected.startswith("".join(texts[:k + 1]))
    assert state(last).is_final and state(last).finish_reason == "stop"
    # Counted up to and including the token where the stop word starts (its first character completes).
    n_out = state(last).num_output_tokens
    assert len(detokenizer.final_text(ids[:n_out - 1])) <= full.find(word) < len(detokenizer.final_text(ids[:n_out]))
    assert len(last["LOG_PROBS"]) == 1 + (n_out if not stream else len(last["TOKEN_IDS"]))
    assert stream_.on_output(output(ids[:1], n_out=len(ids) + 1)) is None


def test_a_started_stop_word_that_never_completes_is_released_at_the_end(detokenizer, tokenizer):
    ids = tokenizer("The capital of France is Paris.", add_special_tokens=False).input_ids
    req = parse_llm_request(getter(input_ids=[1], max_tokens=[len(ids)], stream=[True],
                                   stop_words=np.array([b"Paris!"], object)))
    outputs = [output([t], i == len(ids) - 1, FinishReason.LENGTH) for i, t in enumerate(ids)]
    texts, last = run(ResponseStream(req, detokenizer), detokenizer, outputs)
    assert "".join(texts) == tokenizer.decode(ids)
    assert "Paris" in texts[-1]  # held back while it could still become "Paris!"
    assert state(last).finish_reason == "length" and state(last).num_output_tokens == len(ids)


def test_stop_words_are_not_looked_for_in_an_echoed_prompt(detokenizer, tokenizer):
    prompt = tokenizer("Say Paris twice:", add_special_tokens=False).input_ids
    answer = tokenizer(" Paris, Paris", add_special_tokens=False).input_ids
    req = parse_llm_request(getter(input_ids=prompt, max_tokens=[9], stream=[True], exclude_input_in_output=[False],
                                   stop_words=np.array([b"Paris"], object)))
    outputs = [output([t], False) for t in answer]
    texts, last = run(ResponseStream(req, detokenizer), detokenizer, outputs)
    assert "".join(texts) == "Say Paris twice: "
    assert state(last).num_output_tokens == 1 and state(last).finish_reason == "stop"


def test_drain_reports_the_engine_idle_only_once_asked_and_after_a_quiet_period(tmp_path):
    path = tmp_path / "shutting_down"
    busy, stopping = [True], threading.Event()
    drain = Drain(str(path), quiet_seconds=0.2, poll_seconds=0.01)
    drain.watch(lambda: not busy[0], stopping)
    try:
        busy[0] = False
        time.sleep(0.4)
        assert not drain.requested() and not os.path.exists(drain.done_path)  # idle, but nobody asked
        busy[0] = True
        path.touch()
        assert drain.requested()
        time.sleep(0.4)
        assert not os.path.exists(drain.done_path)  # asked, but still busy
        busy[0] = False
        asked = time.monotonic()
        while not os.path.exists(drain.done_path):
            assert time.monotonic() - asked < 5
            time.sleep(0.01)
        assert time.monotonic() - asked >= 0.2
    finally:
        stopping.set()


def test_an_unset_drain_file_is_never_asked_for():
    drain = Drain("${shutdown_file}")
    assert drain.path is None and not drain.requested()
    drain.watch(lambda: True, threading.Event())  # nothing to watch, no thread
