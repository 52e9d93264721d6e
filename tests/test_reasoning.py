"""The reasoning parsers: think tags split into reasoning and content, whole or streamed in any
pieces (the streamed pieces join to the whole text's split)."""

import pytest
from hypothesis import given, settings, strategies as st

from tritone.text.reasoning import ReasoningStream, split

CASES = [
    # (parser, text, reasoning, content)
    ("deepseek_r1", "Let me think.</think>\n\nParis.", "Let me think.", "Paris."),
    ("deepseek_r1", "<think>Hmm</think>Paris.", "Hmm", "Paris."),
    ("deepseek_r1", "still thinking when it stopped", "still thinking when it stopped", None),
    ("deepseek_r1", "</think>Paris.", "", "Paris."),
    ("deepseek_r1", "a < b and </thi", "a < b and </thi", None),
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "<think>no end", "no end", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, None),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_a_whole_answer_splits_at_the_think_tags(parser, text, reasoning, content):
    assert split(parser, text) == (reasoning, content)


def _streamed(parser, pieces):
    stream = ReasoningStream(parser)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streamed_one_character_at_a_time_gives_the_same(parser, text, reasoning, content):
    assert _streamed(parser, list(text)) == (reasoning or "", content or "")


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]),
       text=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "\n", " ", "Paris"]),
                     max_size=12).map("".join),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_any_pieces_join_to_the_whole_split(parser, text, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c < len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    reasoning, content = split(parser, text)
    assert _streamed(parser, pieces) == (reasoning or "", content or "")


def test_an_unknown_parser_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--reasoning-parser must be one of deepseek_r1, qwen3"):
        ReasoningStream("granite")
