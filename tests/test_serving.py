"""Parsing and validation of the llm model's inputs, and the responses it builds."""

import numpy as np
import pytest

from tritone.request import FinishReason, RequestOutput
from tritone.serving import ResponseStream, parse_llm_request, text_list
from tritone.text import to_word_list_tensor


def getter(**inputs):
    arrays = {k.upper(): np.asarray(v) for k, v in inputs.items()}
    return lambda name: arrays.get(name)


def test_defaults_are_greedy_and_exclude_the_prompt():
    req = parse_llm_request(getter(input_ids=np.array([1, 2], dtype=np.int32), max_tokens=[5]))
    assert req.params.is_greedy and req.params.max_tokens == 5
    assert req.exclude_input_in_output and not req.stream and req.params.end_id is None


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


def test_stop_words_arrive_as_id_sequences():
    req = parse_llm_request(getter(input_ids=[1], max_tokens=[5], stop_words_ids=to_word_list_tensor([[4, 5], [6]])))
    assert req.params.stop_token_ids == [[4, 5], [6]]


def test_text_list_refuses_empty_and_invalid_words():
    with pytest.raises(ValueError, match="empty"):
        text_list(getter(stop_words=np.array([b""], dtype=object)), "STOP_WORDS")
    with pytest.raises(ValueError, match="UTF-8"):
        text_list(getter(stop_words=np.array([b"\xff"], dtype=object)), "STOP_WORDS")


def out(ids, finished=False, n_out=0):
    return RequestOutput("r", ids, [0.0] * len(ids), 3, n_out, finished, FinishReason.LENGTH if finished else None)


def test_streamed_responses_carry_context_and_the_final_flag():
    req = parse_llm_request(getter(input_ids=[1, 2, 3], max_tokens=[3], stream=[True]))
    stream = ResponseStream(req)
    first = stream.on_output(out([10], n_out=1))
    second = stream.on_output(out([11], n_out=2))
    last = stream.on_output(out([12], finished=True, n_out=3))
    assert first["TOKEN_IDS"].tolist() == [10] and first["CONTEXT_IDS"].tolist() == []
    assert second["CONTEXT_IDS"].tolist() == [10] and not second["IS_FINAL"][0]
    assert last["IS_FINAL"][0] and last["FINISH_REASON"][0] == b"length"


def test_non_streamed_request_gets_one_response_with_everything():
    req = parse_llm_request(getter(input_ids=[1, 2, 3], max_tokens=[2], exclude_input_in_output=[False]))
    stream = ResponseStream(req)
    assert stream.on_output(out([10], n_out=1)) is None
    final = stream.on_output(out([11], finished=True, n_out=2))
    assert final["TOKEN_IDS"].tolist() == [1, 2, 3, 10, 11]
    assert final["NUM_OUTPUT_TOKENS"].tolist() == [2]
