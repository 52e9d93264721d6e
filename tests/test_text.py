"""Tokenization helpers and the stateless incremental detokenizer."""

import numpy as np
from hypothesis import given, settings, strategies as st

from tritone.text import PromptEncoder, context_window, decode_delta, from_word_list_tensor, to_word_list_tensor


def stream_text(tokenizer, ids, chunk_sizes):
    """What postprocessing emits for `ids` sent in chunks, as the llm model sends them."""
    pieces, sent = [], []
    sizes = iter(chunk_sizes)
    while len(sent) < len(ids):
        n = max(1, next(sizes, 1))
        new = ids[len(sent):len(sent) + n]
        sent.extend(new)
        pieces.append(decode_delta(tokenizer, context_window(sent, len(new)), new, is_final=len(sent) == len(ids)))
    return "".join(pieces)


PIECES = list("abc xyz\t\n{}()") + ["é", "中文", "日本語", "😀", "👨‍👩‍👧", "مرحبا", "नमस्ते", "ü", "    "]
TEXTS = st.lists(st.sampled_from(PIECES), min_size=1, max_size=30).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=TEXTS, chunks=st.lists(st.integers(1, 4), max_size=40))
def test_streamed_text_equals_full_decode(tokenizer, text, chunks):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert stream_text(tokenizer, ids, chunks) == tokenizer.decode(ids)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=30), chunks=st.lists(st.integers(1, 3), max_size=30))
def test_random_ids_stream_to_the_full_decode(tokenizer, ids, chunks):
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert stream_text(tokenizer, ids, chunks) == expected


def test_no_partial_character_is_emitted_before_it_completes(tokenizer):
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    assert len(ids) > 1  # byte-level BPE splits the emoji
    first = decode_delta(tokenizer, [], ids[:1], is_final=False)
    assert "\ufffd" not in first


def test_word_list_tensor_round_trip():
    seqs = [[5, 6], [7], [8, 9, 10]]
    tensor = to_word_list_tensor(seqs)
    assert tensor.shape == (2, 6) and tensor.dtype == np.int32
    assert from_word_list_tensor(tensor) == seqs
    assert from_word_list_tensor(to_word_list_tensor([])) == []


def test_prompt_encoder_templates_only_when_asked(model_dir, tokenizer):
    encoder = PromptEncoder(str(model_dir))
    templated, raw = encoder.encode(["Hi", "Hi"], [None, False])
    assert raw == tokenizer("Hi").input_ids
    assert tokenizer.decode(templated).startswith("<|im_start|>") and len(templated) > len(raw)
    assert PromptEncoder(str(model_dir), "never").encode(["Hi"]) == [raw]
