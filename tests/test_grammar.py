"""Grammar-constrained decoding in the engine (real default model, in process), and the tool-call
syntax: rendering, grammar and parsing."""

import json
import re
import time
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from transformers import AutoConfig

from test_engine import make_engine, run_staggered
from tritone.executor import kv_bytes_per_token
from tritone.openai.tools import ToolStream, parse_tool_calls, tool_guide
from tritone.text.templates import parser_for_template
from tritone.scheduling.grammar import Guide, GuideError
from tritone.scheduling.request import FinishReason, SamplingParams
from tritone.text import hermes_tool_messages

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
}, "required": ["name", "age", "city"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLORS = 'root ::= "red" | "green" | "blue"'


@pytest.fixture(scope="module")
def chat_ids(tokenizer):
    def ids(question):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             return_dict=False)
    return ids


def check(kind, text):
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "ebnf_grammar":
        assert text in ("red", "green", "blue"), text
    else:
        assert isinstance(json.loads(text), dict), text


GUIDES = [Guide("json_schema", json.dumps(PERSON)), Guide("regex", PHONE), Guide("ebnf_grammar", COLORS),
          Guide("json")]


@pytest.mark.parametrize("sampled", [False, True])
def test_guided_rows_follow_their_grammar_batched_with_free_rows_which_are_unchanged(model_dir, tokenizer, chat_ids,
                                                                                      sampled):
    questions = ["Describe a person.", "What is your phone number?", "Name a color.", "Give me some data.",
                 "Tell me about Paris.", "Write a haiku."]
    prompts = [chat_ids(q) for q in questions]
    guides = GUIDES + [None, None]

    def params(i):
        return SamplingParams(max_tokens=48, guide=guides[i], temperature=0.9 if sampled else 0.0, seed=i)

    engine = make_engine(model_dir)
    got = run_staggered(engine, prompts, params, every=1)
    for guide, ids in zip(guides, got):
        if guide is not None:
            check(guide.type, tokenizer.decode(ids))
    # The free rows are what they are alone: the masks touch only the guided rows.
    alone = make_engine(model_dir)
    assert run_staggered(alone, prompts[4:], lambda i: params(i + 4)) == got[4:]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_guided_rows_sampled_in_a_worker_draw_what_they_draw_in_the_engines_process(model_dir, tokenizer, chat_ids):
    # The grammars' masks are filled in the engine's process and go with the step to the worker
    # that samples (a data-parallel engine's), beside the free rows.
    prompts = [chat_ids(q) for q in ("Describe a person.", "What is your phone number?", "Tell me about Paris.")]
    guides = [GUIDES[0], GUIDES[1], None]

    def params(i):
        return SamplingParams(max_tokens=32, guide=guides[i], temperature=0.9, seed=i)

    want = run_staggered(make_engine(model_dir, num_threads=1), prompts, params, every=1)
    engine = make_engine(model_dir, num_threads=1, data_parallel_size=2)
    try:
        got = run_staggered(engine, prompts, params, every=1)
    finally:
        engine.shutdown()
    assert got == want
    for guide, ids in zip(guides, got):
        if guide is not None:
            check(guide.type, tokenizer.decode(ids))


def test_guided_requests_keep_their_grammar_through_preemption(model_dir, tokenizer, chat_ids):
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), torch.float32)
    engine = make_engine(model_dir, block_size=4, kv_cache_bytes=40 * 4 * per_token)
    prompts = [chat_ids(f"Describe person number {i}.") for i in range(8)]
    got = run_staggered(engine, prompts, lambda i: SamplingParams(max_tokens=40, guide=GUIDES[0]), every=1)
    assert engine.scheduler.num_preemptions > 0
    for ids in got:
        check("json_schema", tokenizer.decode(ids))
    # With the prefix cache warm, the same requests again: the same answers.
    assert run_staggered(engine, prompts, lambda i: SamplingParams(max_tokens=40, guide=GUIDES[0]), every=1) == got


def test_a_guided_request_ends_where_its_grammar_does_even_when_told_to_ignore_the_end_id(model_dir, chat_ids):
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=40, end_id=-1, min_tokens=30, guide=Guide("ebnf_grammar", COLORS))
    engine.add_request("a", chat_ids("Name a color."), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].num_output_tokens <= 3


def test_grammars_compile_once_per_guide_and_off_the_engine_thread(model_dir):
    engine = make_engine(model_dir)
    guide = Guide("json_schema", json.dumps(PERSON))
    first = engine.grammars.compile(guide)
    assert engine.grammars.compile(Guide("json_schema", json.dumps(PERSON))) is first
    first.result(timeout=60)
    assert engine.grammars._pool._threads and all(t.name.startswith("tritone-grammar")
                                                  for t in engine.grammars._pool._threads)


def test_a_request_waiting_for_its_grammar_does_not_hold_back_the_queue(model_dir, chat_ids):
    engine = make_engine(model_dir)
    slow = Future()  # a grammar that never finishes compiling
    engine.grammars.compile = lambda guide: slow
    engine.add_request("guided", chat_ids("Describe a person."), SamplingParams(max_tokens=4, guide=GUIDES[0]))
    engine.add_request("free", chat_ids("Hello"), SamplingParams(max_tokens=4))
    finished = []
    deadline = time.monotonic() + 60
    while "free" not in finished and time.monotonic() < deadline:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert "free" in finished and "guided" in engine.scheduler.requests
    assert engine.scheduler.requests["guided"].block_ids == []  # never admitted
    engine.abort_request("guided")
    assert slow.cancelled()  # no one else waits for it: it never runs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_grammar_that_compiles_too_long_fails_its_request_naming_the_field(model_dir, chat_ids, monkeypatch):
    from tritone.engine import core

    monkeypatch.setattr(core, "GUIDE_COMPILE_SECONDS", 0.5)
    engine = make_engine(model_dir)
    slow = Future()
    slow.set_running_or_notify_cancel()  # compiling already: it cannot be cancelled
    engine.grammars.compile = lambda guide: slow
    engine.add_request("guided", chat_ids("Describe a person."), SamplingParams(max_tokens=4, guide=GUIDES[0]))
    outputs, deadline = [], time.monotonic() + 30
    while not outputs and time.monotonic() < deadline:
        outputs = [o for o in engine.step() if o.finished]
    assert outputs[0].finish_reason == FinishReason.ERROR and "guided_decoding_guide took over" in outputs[0].error
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("guide, message", [
    (Guide("yaml", "x"), "guided_decoding_guide_type must be one of"),
    (Guide("regex", "("), "guided_decoding_guide is not a valid regex: Regex parsing error"),
    (Guide("json_schema", "{"), "guided_decoding_guide is not a JSON schema"),
    (Guide("json_schema", '{"type": "foo"}'), "guided_decoding_guide is not a valid json_schema"),
    (Guide("json_schema", '{"not": {"type": "string"}}'), "'not' at # is not supported"),
    (Guide("json_schema", '{"type": "string", "format": "iri"}'), "string format 'iri'"),
    (Guide("json_schema", '{"type": "number", "multipleOf": 0.5}'), "multipleOf"),
    (Guide("json_schema", '{"type": "string", "pattern": "(?=a)b"}'), "lookaround"),
    (Guide("ebnf_grammar", "start ::= \"a\""), "guided_decoding_guide is not a valid ebnf_grammar"),
    (Guide("regex", ""), "guided_decoding_guide is required"),
])
def test_bad_guides_are_refused_naming_the_field_and_the_engine_goes_on(model_dir, chat_ids, guide, message):
    with pytest.raises(GuideError, match=re.escape(message)):
        guide.check()
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", chat_ids("Hi"), SamplingParams(max_tokens=4, guide=guide))
    assert not engine.scheduler.requests


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_calls_forced_by_grammar_parse_back_into_the_named_tools(model_dir, tokenizer, chat_ids, parser, choice):
    engine = make_engine(model_dir)
    guide = Guide("structural_tag", tool_guide(TOOLS, choice, parser))
    engine.add_request("t", chat_ids("What is the weather in Oslo?"), SamplingParams(max_tokens=60, guide=guide))
    ids = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            ids += output.new_token_ids
    text = tokenizer.decode(ids)
    content, calls = parse_tool_calls(text, parser)
    assert calls, text
    for call in calls:
        assert call.name in ("get_weather", "add") and isinstance(json.loads(call.arguments), dict)
        if isinstance(choice, dict):
            assert call.name == "add"


def test_tool_syntaxes_parse_and_stream():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls("no calls here", "hermes") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes")[1] == []
    _, calls = parse_tool_calls('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}',
                                "llama3_json")
    assert [json.loads(c.arguments)["a"] for c in calls] == [1, 2]
    assert parse_tool_calls("Plain answer.", "llama3_json") == ("Plain answer.", [])
    assert parse_tool_calls("{\"name\": \"add\", \"parameters\": {}}\n\nDone.", "llama3_json")[0] == "Done."
    # Streamed: text goes out until a call may begin (a partial tag is held back), calls at the end.
    stream = ToolStream("hermes")
    pieces = [stream.feed(p) for p in ["Let me", " look.\n<tool", "_call>\n{\"name\": \"add\", ",
                                       "\"arguments\": {}}\n</tool_call>"]]
    assert pieces == ["Let me", " look.\n", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and calls[0].name == "add"
    plain = ToolStream("hermes")
    assert "".join(plain.feed(p) for p in ["a <", "b"]) + plain.finish()[0] == "a <b"


def test_tools_render_for_templates_with_and_without_tools():
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    rendered = hermes_tool_messages(messages, TOOLS)
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo"}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
