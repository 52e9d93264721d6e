"""Structured outputs and tool calling through a real tritonserver: the ensemble's TensorRT-LLM
inputs with tritonclient, and the OpenAI API with the real `openai` client."""

import json
import re

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from conftest import start_server
from test_grammar import COLORS, PERSON, PHONE, TOOLS
from tritone.launcher import free_port
from tritone_client import TritoneClient

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Describe a person who lives in a city."}]


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


@pytest.fixture(scope="module")
def model(openai_server):
    return openai_server.model_dir.name


def answer(client, model, stream=False, **kwargs):
    kwargs = {"model": model, "messages": QUESTION, "max_tokens": 64, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_openai_outputs_follow_their_constraints(client, model, stream, sampling):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    jsonschema.validate(json.loads(answer(client, model, stream, response_format=schema, **sampling)), PERSON)
    # Any object: sampled, it may run to max_tokens; what it wrote by then must still be an object's start.
    text = answer(client, model, stream, response_format={"type": "json_object"}, max_tokens=128, **sampling)
    try:
        assert isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        assert text.startswith("{") and sampling["temperature"] > 0, text
    assert re.fullmatch(PHONE, answer(client, model, stream, extra_body={"guided_regex": PHONE}, **sampling))
    choices = ["Paris", "Rome", "Oslo"]
    assert answer(client, model, stream, extra_body={"guided_choice": choices}, **sampling) in choices
    assert answer(client, model, stream, extra_body={"guided_grammar": COLORS}, **sampling) in ("red", "green", "blue")
    assert answer(client, model, stream, extra_body={"structured_outputs": {"regex": r"[a-z]{3}"}}, **sampling) \
        .isalpha()
    # Completions take the same extras.
    text = client.completions.create(model=model, prompt="A person: ", max_tokens=64,
                                     extra_body={"guided_json": PERSON}, **sampling).choices[0].text
    jsonschema.validate(json.loads(text), PERSON)


def test_constrained_and_free_requests_batched_together(client, model):
    import concurrent.futures

    def one(i):
        if i % 2:
            return None, answer(client, model, max_tokens=24, temperature=0)
        return PERSON, answer(client, model, temperature=0.8, seed=i,
                              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    free = [text for schema, text in results if schema is None]
    assert len(set(free)) == 1  # greedy free rows alike, whatever the guided rows beside them
    for schema, text in results:
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kwargs, field, words", [
    ({"extra_body": {"guided_regex": "("}}, "guided_regex", "parenthesis is not closed"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "'not'"),
    ({"extra_body": {"guided_grammar": "start ::= \"a\""}}, "guided_grammar", "root"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice", "one output constraint"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
])
def test_bad_constraints_are_400_naming_the_field_and_the_server_goes_on(client, model, kwargs, field, words):
    with pytest.raises(openai.BadRequestError) as caught:
        answer(client, model, **kwargs)
    assert caught.value.body["param"] == field and words in caught.value.body["message"], caught.value.body
    assert answer(client, model, max_tokens=4)


def test_the_ensemble_takes_tensorrt_llm_guided_decoding_inputs(openai_server):
    with TritoneClient(f"127.0.0.1:{openai_server.args.grpc_port}") as triton:
        chunks = list(triton.generate(QUESTION, max_tokens=64, stream=True, guided_decoding_guide_type="json_schema",
                                      guided_decoding_guide=json.dumps(PERSON)))
        jsonschema.validate(json.loads("".join(c.text for c in chunks)), PERSON)
        assert chunks[-1].finish_reason == "stop"
        text = triton.complete("Your phone number:", max_tokens=32, guided_decoding_guide_type="regex",
                               guided_decoding_guide=PHONE).text
        assert re.fullmatch(PHONE, text)
        with pytest.raises(RuntimeError, match="guided_decoding_guide is not a valid regex"):
            triton.complete("x", max_tokens=4, guided_decoding_guide_type="regex", guided_decoding_guide="(")


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_round_trip_on_the_default_model(client, model, stream):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    call = tool_call(client, model, messages, stream, tool_choice="required")
    assert call["function"]["name"] in ("get_weather", "add")
    json.loads(call["function"]["arguments"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "-3 C and snowing"}]
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=24, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def tool_call(client, model, messages, stream, **kwargs):
    kwargs = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 64, "temperature": 0, **kwargs}
    if not stream:
        response = client.chat.completions.create(**kwargs)
        assert response.choices[0].finish_reason == "tool_calls"
        return response.choices[0].message.tool_calls[0].model_dump()
    calls, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and calls
    call = calls[0].model_dump(exclude_none=True)
    call.pop("index")
    return call


# Qwen 2.5's way of writing tools, calls and tool answers, cut down to what these tests send.
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def qwen_srv(model_dir, tmp_path_factory):
    """A tiny random Qwen2 model (biases and all) with a Qwen-style tool template."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(path)
    server, log = start_server(tmp_path_factory, "tiny-qwen2", "--model", str(path), "--kv-cache-bytes",
                               str(64 << 20), "--openai-port", str(free_port()))
    yield server
    server.stop()
    log.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_on_a_qwen_template_model(qwen_srv, stream):
    client = openai.OpenAI(base_url=qwen_srv.openai_url, api_key="none", max_retries=0)
    model = qwen_srv.model_dir.name
    # Random weights write whatever the grammar leaves open: a bounded schema ends the call soon.
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}}}]
    messages = [{"role": "user", "content": "Pick a number."}]
    named = {"type": "function", "function": {"name": "pick"}}
    call = tool_call(client, model, messages, stream, tool_choice=named, tools=tools)
    assert call["function"]["name"] == "pick"
    jsonschema.validate(json.loads(call["function"]["arguments"]), tools[0]["function"]["parameters"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    final = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=8,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritone_client_constrains_from_the_command_line(openai_server, capsys, protocol):
    from tritone_client.cli import main

    port = openai_server.args.grpc_port if protocol == "grpc" else openai_server.args.http_port
    assert main(["generate", "--url", f"127.0.0.1:{port}", "--protocol", protocol, "--max-tokens", "32",
                 "--regex", PHONE, "Your phone number:"]) == 0
    assert re.fullmatch(PHONE, capsys.readouterr().out.strip())
