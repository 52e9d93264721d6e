"""Tokenization helpers and the stateless incremental detokenizer, with the default model's
tokenizer (byte-level BPE) and with tokenizers built here: SentencePiece-style BPE with byte
fallback (as Llama 2 and Mistral) and WordPiece with clean-up (as BERT)."""

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tritone.text import Detokenizer, PromptEncoder, StopMatcher, from_word_list_tensor, to_word_list_tensor

# Pieces of text in many scripts: CJK, emoji with ZWJ sequences, skin tones and flags, Arabic,
# Devanagari and Thai with combining marks, Korean, accents, and code with runs of spaces and tabs.
PIECES = [
    "a", "b", "xyz", " ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "{", "}", "()", "=", ";", ".", ",", "'", "!",
    " the", " is", "don't", " n't", " 's", " do not", "é", "ü", "ñ", "ß", "中文", "日本語", "漢", "字", "한국어",
    "😀", "👨\u200d👩\u200d👧", "👍🏽", "🇫🇷", "🏳️\u200d🌈", "مرحبا", " بالعالم", "नमस्ते", "क्षि", "ภาษาไทย",
    "def f(x):\n    return x", "\tif x:\n\t\tpass", "\u00a0", "\ufffd",
]
TEXTS = st.one_of(st.lists(st.sampled_from(PIECES), min_size=1, max_size=24).map("".join),
                  st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24))
CHUNKS = st.lists(st.integers(1, 5), max_size=60)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't stop, it's fine!",
    "def fibonacci(n):\n    if n < 2:\n        return n\n\treturn fibonacci(n - 1) + fibonacci(n - 2)",
    "中文 日本語 한국어 مرحبا بالعالم नमस्ते दुनिया ภาษาไทย café naïve Straße",
] * 20


def sentencepiece_byte_fallback() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE on '▁'-joined text, unknown characters as <0xXX> bytes."""
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS, trainer)
    vocab = trained.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def wordpiece() -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer: its decoder joins words with spaces and cleans up punctuation."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module", params=["default", "sentencepiece", "wordpiece"])
def detokenizer(request, tokenizer):
    built = {"default": lambda: tokenizer, "sentencepiece": sentencepiece_byte_fallback, "wordpiece": wordpiece}
    return Detokenizer(built[request.param]())


def stream_text(detok: Detokenizer, ids: list[int], chunk_sizes: list[int], skip: bool = True) -> str:
    """What postprocessing emits for `ids` sent in chunks, each with the context the llm model sends."""
    pieces, sent = [], 0
    sizes = iter(chunk_sizes)
    while sent < len(ids):
        end = min(len(ids), sent + max(1, next(sizes, 1)))
        context = detok.context(ids, sent, skip)
        pieces.append(detok.delta(context, ids[sent:end], end == len(ids), skip))
        sent = end
    return "".join(pieces)


SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(text=TEXTS, chunks=CHUNKS)
def test_streamed_text_equals_full_decode(detokenizer, text, chunks):
    ids = detokenizer.tokenizer(text, add_special_tokens=False).input_ids
    assert stream_text(detokenizer, ids, chunks) == detokenizer.tokenizer.decode(ids, skip_special_tokens=True)


@SETTINGS
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans())
def test_random_ids_stream_to_the_full_decode(detokenizer, data, chunks, skip):
    tokenizer = detokenizer.tokenizer
    # Single bytes and characters, and special tokens, drawn often: the hard cases are runs of them.
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    short = [i for i, t in enumerate(tokens) if len(t) == 1 or re.fullmatch(r"<0x..>", t)]
    special = sorted(tokenizer.added_tokens_decoder)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(short), st.sampled_from(short), st.sampled_from(special),
                                       st.integers(0, len(tokenizer) - 1)), min_size=1, max_size=60))
    expected = detokenizer.tokenizer.decode(ids, skip_special_tokens=skip)
    assert stream_text(detokenizer, ids, chunks, skip) == expected


@SETTINGS
@given(text=TEXTS)
def test_every_prefix_shows_only_text_that_stays(detokenizer, text):
    ids = detokenizer.tokenizer(text, add_special_tokens=False).input_ids
    full = detokenizer.decode(ids)
    for n in range(len(ids) + 1):
        assert full.startswith(detokenizer.final_text(ids[:n]))


def test_no_partial_character_is_emitted_before_it_completes(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    assert len(ids) > 1  # byte-level BPE splits the emoji
    assert detok.delta([], ids[:1], is_final=False) == ""
    assert detok.delta(ids[:1], ids[1:], is_final=True) == "😀"


def test_a_byte_run_is_held_back_until_it_cannot_turn_invalid():
    detok = Detokenizer(sentencepiece_byte_fallback())
    byte = {b: detok.tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    zhong = [byte[b] for b in "中".encode()]
    # "中" then an invalid byte decodes to four U+FFFD, not "中�": the run is not final yet.
    assert detok.tokenizer.decode(zhong + [byte[0xFF]]) == "\ufffd" * 4
    assert detok.final_text(zhong) == ""
    word = detok.tokenizer("a", add_special_tokens=False).input_ids
    assert detok.final_text(zhong + word) == "中 a"


def test_text_that_clean_up_may_still_rewrite_is_held_back():
    detok = Detokenizer(wordpiece())
    ids = detok.tokenizer("one two three four five six seven eight nine ten .", add_special_tokens=False).input_ids
    full = detok.tokenizer.decode(ids)
    assert full.endswith(" ten.")
    # " ten" loses its space once "." follows; text far enough back is shown.
    shown = detok.final_text(ids[:-1])
    assert full.startswith(shown) and 0 < len(shown) < len(full) - len(" ten.")


@SETTINGS
@given(text=TEXTS, data=st.data(), chunks=CHUNKS)
def test_stop_matcher_finds_the_first_stop_word_and_never_sends_its_start(detokenizer, text, data, chunks):
    ids = detokenizer.tokenizer(text, add_special_tokens=False).input_ids
    full = detokenizer.decode(ids)
    if not full:
        return
    i = data.draw(st.integers(0, len(full) - 1))
    word = full[i:data.draw(st.integers(i + 1, min(len(full), i + 6)))]
    matcher, fed, sizes = StopMatcher(detokenizer, [word], True), 0, iter(chunks)
    while True:
        fed = min(len(ids), fed + max(1, next(sizes, 1)))
        start = matcher.feed(ids[:fed], fed == len(ids))
        if start is not None:
            break
        # The text of the ids it lets through is final and holds no start of the stop word.
        shown = matcher.ends[matcher.num_safe_ids() - 1] if matcher.num_safe_ids() else 0
        assert shown <= full.find(word)
        assert fed < len(ids), "the stop word was never found"
    assert start == full.find(word)
    end, drop = matcher.cut(ids[:fed], start, 0)
    text_sent = detokenizer.decode(ids[:end])
    assert text_sent[:len(text_sent) - drop] == full[:start]
    # The last id sent is the one where the stop word starts, not a later one.
    assert len(detokenizer.final_text(ids[:end - 1])) <= start


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


def test_chat_messages_go_through_the_template(model_dir, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (ids,) = PromptEncoder(str(model_dir), "never").encode([messages])
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert ids == expected


def test_bad_words_cover_the_spelling_after_a_space(model_dir, tokenizer):
    encoded = PromptEncoder(str(model_dir)).encode_bad_words(["Paris"])
    assert tokenizer("Paris", add_special_tokens=False).input_ids in encoded
    assert tokenizer(" Paris", add_special_tokens=False).input_ids in encoded


def test_the_text_processes_load_their_tokenizer_and_limits_without_torch(model_dir):
    # A preprocessing or postprocessing instance that imported torch started about 2.5 s later
    # and held it in memory for nothing: checked in a fresh interpreter, as a model process starts.
    import subprocess
    import sys

    code = ("import sys\n"
            "from tritone.serving.processing import Postprocessor, Preprocessor\n"
            f"pre = Preprocessor({{'model_dir': {str(model_dir)!r}}})\n"
            f"post = Postprocessor.from_parameters({{'model_dir': {str(model_dir)!r}}})\n"
            "print(pre.max_input_len, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["8192", "False"]


def test_a_plain_fast_tokenizer_loads_as_autotokenizer_loads_it(model_dir):
    from transformers import AutoTokenizer

    from tritone.text import load_tokenizer

    ours, auto = load_tokenizer(str(model_dir)), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    text = "Hello, world!<|im_end|>\n  x\u00e9 " + "".join(PIECES)
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)
