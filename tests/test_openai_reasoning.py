"""--reasoning-parser in tritone-openai, in process over a scripted backend: chat answers split
into reasoning_content and content, whole and streamed, tool calls read from the content only,
an output constraint moved past the thinking, and completions left whole."""

from __future__ import annotations

import json

import pytest

from test_openai_guard import FakeBackend, chunk_result, chat, post, served
from tritone.openai.server import build_parser
from tritone.text.reasoning import split

THOUGHT = "The user asks for a capital.</think>\n\nParis."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def scripted(*pieces: str) -> FakeBackend:
    return FakeBackend([(chunk_result(p, "stop" if i == len(pieces) - 1 else ""), None) for i, p in enumerate(pieces)])


def events(response) -> list[dict]:
    assert response.status == 200, response.body
    lines = [line.removeprefix(b"data: ") for line in response.body.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_parts(response) -> tuple[str, str, list[dict]]:
    deltas = [e["choices"][0]["delta"] for e in events(response) if e["choices"]]
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas),
            deltas)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", [THOUGHT, "<think>" + THOUGHT, "Paris.", "still thinking", ""])
def test_a_whole_answer_is_split_as_the_parser_splits_it(parser, text):
    app, _ = served(scripted(text), reasoning_parser=parser)
    message = post(app, "/v1/chat/completions", chat()).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == split(parser, text)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("cut", [(3, 20), (28, 30), (29, 33), (31, 37), (40, 44)])
def test_streamed_pieces_join_to_the_whole_split_wherever_the_tags_are_cut(parser, cut):
    text = "<think>" + THOUGHT
    pieces = [text[:cut[0]], text[cut[0]:cut[1]], text[cut[1]:]]
    reasoning, content, deltas = streamed_parts(post(served(scripted(*pieces), reasoning_parser=parser)[0],
                                                     "/v1/chat/completions", chat(stream=True)))
    assert (reasoning or None, content or None) == split(parser, text)
    assert all("<think>" not in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


def test_without_a_parser_the_thinking_stays_in_the_content():
    app, _ = served(scripted(THOUGHT))
    message = post(app, "/v1/chat/completions", chat()).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT}
    _, content, deltas = streamed_parts(post(served(scripted(THOUGHT))[0], "/v1/chat/completions", chat(stream=True)))
    assert content == THOUGHT and not any("reasoning_content" in d for d in deltas)


def test_completions_are_not_split():
    # As in vLLM: the parser reads chat answers only.
    app, _ = served(scripted(THOUGHT), reasoning_parser="deepseek_r1")
    choice = post(app, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4}).json()["choices"][0]
    assert choice["text"] == THOUGHT and "reasoning_content" not in choice


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_from_the_content_not_the_thinking(stream):
    # A call written while thinking is part of the thinking; the one in the answer is the call.
    thought = "Maybe " + CALL.replace("Oslo", "Rome") + " or not.</think>\n\n"
    pieces = [thought[:10], thought[10:], "Let me look.\n", CALL[:9], CALL[9:]]
    app, _ = served(scripted(*pieces), reasoning_parser="deepseek_r1")
    response = post(app, "/v1/chat/completions", chat(stream=stream, tools=TOOLS))
    if stream:
        reasoning, content, deltas = streamed_parts(response)
        (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        finish = [e["choices"][0]["finish_reason"] for e in events(response) if e["choices"][0]["finish_reason"]]
        assert (content, finish) == ("Let me look.\n", ["tool_calls"])
    else:
        choice = response.json()["choices"][0]
        reasoning, calls = choice["message"]["reasoning_content"], choice["message"]["tool_calls"]
        assert (choice["message"]["content"], choice["finish_reason"]) == ("Let me look.", "tool_calls")
    assert reasoning == thought.removesuffix("</think>\n\n")
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def guide_of(backend: FakeBackend) -> tuple[str, dict]:
    inputs = backend.calls[0]
    return (inputs["guided_decoding_guide_type"][0][0].decode(),
            json.loads(inputs["guided_decoding_guide"][0][0].decode()))


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [1, 2]}}}},
    {"guided_regex": "[0-9]+"},
    {"guided_choice": ["yes", "no"]},
    {"structured_outputs": {"structural_tag": {"type": "structural_tag",
                                               "format": {"type": "const_string", "value": "ok"}}}},
    {"tools": TOOLS, "tool_choice": "required"},
])
def test_an_output_constraint_applies_after_the_thinking(parser, fields):
    # As vLLM applies the grammar once the reasoning has ended: free text up to </think>, then
    # the request's constraint. The grammar itself is checked against xgrammar in test_grammar.
    app, backend = served(scripted("x</think>\n\n" + '{"n": 1}'), reasoning_parser=parser)
    assert post(app, "/v1/chat/completions", chat(**fields)).status == 200
    guide_type, tag = guide_of(backend)
    thinking, answer = tag["format"]["elements"]
    if parser == "qwen3":
        assert thinking["type"] == "optional" and thinking["content"]["begin"] == "<think>"
        thinking = thinking["content"]
    assert guide_type == "structural_tag" and thinking["content"] == {"type": "any_text"}
    assert thinking["end"][0] == "</think>"
    if "structured_outputs" in fields:
        assert answer == {"type": "const_string", "value": "ok"}


def test_the_wrapped_grammar_leaves_the_thinking_free_and_holds_the_answer():
    import xgrammar as xgr

    app, backend = served(scripted("x"), reasoning_parser="deepseek_r1")
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    post(app, "/v1/chat/completions", chat(response_format={"type": "json_schema",
                                                            "json_schema": {"name": "n", "schema": schema}}))
    grammar = xgr.Grammar.from_structural_tag(json.dumps(guide_of(backend)[1]))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar))
        return matcher.accept_string(text)

    assert accepts('Any {"n": 7} <tool_call> thought.</think>\n\n{"n": 1}')
    assert not accepts('x</think>\n\n{"n": 7}') and not accepts("x</think>\n\nParis")


def test_a_bad_constraint_is_refused_naming_its_field():
    app, backend = served(scripted("x"), reasoning_parser="qwen3")
    response = post(app, "/v1/chat/completions", chat(guided_regex="("))
    assert response.status == 400 and response.error["param"] == "guided_regex", response.body
    assert response.error["message"].startswith("guided_regex is not a valid regex") and not backend.calls


def test_the_cli_takes_the_parser():
    assert build_parser().parse_args([]).reasoning_parser is None
    assert build_parser().parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "o1"])


@pytest.mark.parametrize("flag", [[], ["--reasoning-parser", "deepseek_r1"]])
def test_the_launcher_passes_the_parser_to_the_front_end(model_dir, monkeypatch, flag):
    import tritone.launcher.server as launcher
    from tritone.launcher import Server, build_parser as launcher_parser

    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda command, **_: started.append(command))
    Server(launcher_parser().parse_args(["--model", str(model_dir), *flag]))._start_frontend(None)
    (command,) = started
    parsed = build_parser().parse_args(command[command.index("tritone.openai") + 1:])
    assert parsed.reasoning_parser == (flag[1] if flag else None)


# ---- through a real server and the real openai client ----

THINKER_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def thinker(model_dir, tmp_path_factory):
    """A tiny random Qwen2 model that thinks as DeepSeek-R1 does: its template opens <think>, and,
    as in Qwen3's and DeepSeek-R1's tokenizers, <think> and </think> are tokens of their own.
    Random weights would almost never write </think>, so one direction of the residual stream is
    made constant (every embedding's first value is 1) and the </think> row of the output layer
    reads it: </think> gets about 6% of every sampled step, so a seeded answer thinks for a few
    dozen tokens, closes its thinking and goes on with an answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from conftest import start_server
    from tritone.launcher import free_port

    path = tmp_path_factory.mktemp("tiny-thinker")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKER_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("</think>"), 0] = 1.05
    model.save_pretrained(path)
    server, log = start_server(tmp_path_factory, "tiny-thinker", "--model", str(path), "--kv-cache-bytes",
                               str(64 << 20), "--openai-port", str(free_port()), "--reasoning-parser", "deepseek_r1")
    yield server
    server.stop()
    log.close()


@pytest.fixture(scope="module")
def raw_answer(thinker) -> tuple[int, str]:
    """(a seed, the ensemble's unsplit answer with it) where the answer has both parts: the
    ensemble is the same server's text without the front end's parser."""
    from tritone_client import TritoneClient

    with TritoneClient(f"127.0.0.1:{thinker.args.grpc_port}") as triton:
        for seed in range(32):
            text = triton.complete(QUESTION, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed).text
            if all(split("deepseek_r1", text)):
                return seed, text
    pytest.fail("no seed of 32 gave an answer that closes its thinking and goes on")


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_a_served_answer_is_split_into_reasoning_and_content(thinker, raw_answer, stream):
    import openai

    seed, raw = raw_answer
    client = openai.OpenAI(base_url=thinker.openai_url, api_key="none", max_retries=0)
    kwargs = {"model": thinker.model_dir.name, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 1.0,
              "seed": seed}
    if stream:
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert "</think>" in raw and (reasoning, content) == split("deepseek_r1", raw)
    assert reasoning and content


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_a_served_schema_holds_the_answer_and_leaves_the_thinking_free(thinker, raw_answer, stream):
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=thinker.openai_url, api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    kwargs = {"model": thinker.model_dir.name, "messages": QUESTION, "max_tokens": 96, "temperature": 1.0,
              "seed": raw_answer[0], "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "n", "schema": schema}}}
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        reasoning = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
        content, finish = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        reasoning, content, finish = choice.message.reasoning_content, choice.message.content, choice.finish_reason
    # Random text while thinking (the schema would allow none), then an answer the schema holds.
    assert finish == "stop" and reasoning and not reasoning.lstrip().startswith("{")
    jsonschema.validate(json.loads(content), schema)
