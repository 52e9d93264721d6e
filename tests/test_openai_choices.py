"""Several choices per request: a completion of a list of prompts answers one choice per prompt, in
order, whole or streamed (each chunk with its choice's index)."""

import json

import openai
import pytest

from test_openai_guard import FakeBackend, FakeResult, post, served
from test_top_logprobs import client, server  # noqa: F401 (a server of this module's own)

PROMPTS = ["The capital of France is", "One, two, three,", "Hello"]


def test_a_list_of_prompts_gets_one_choice_each_in_order():
    app, backend = served()
    response = post(app, "/v1/completions", {"model": "tiny", "prompt": PROMPTS, "max_tokens": 3})
    body = response.json()
    assert response.status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["Paris."] * 3
    assert [t["text_input"].tolist() for t in backend.calls] == [[[p.encode()]] for p in PROMPTS]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def test_streamed_choices_carry_their_index():
    backend = FakeBackend([(FakeResult("Par", ""), None), (FakeResult("is.", "stop"), None)])
    app, _ = served(backend)
    response = post(app, "/v1/completions", {"model": "tiny", "prompt": PROMPTS[:2], "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = [line.removeprefix(b"data: ") for line in response.body.split(b"\n\n") if line]
    assert response.status == 200 and events[-1] == b"[DONE]"
    bodies = [json.loads(e) for e in events[1:-1]]
    texts = {0: "", 1: ""}
    for body in bodies[:-1]:
        (choice,) = body["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "Paris.", 1: "Paris."} and bodies[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("prompt", [[], ["x"] * 65])
def test_a_list_of_prompts_is_bounded(prompt):
    app, backend = served()
    response = post(app, "/v1/completions", {"model": "tiny", "prompt": prompt})
    assert response.status == 400 and response.error["param"] == "prompt" and backend.calls == []


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_each_prompts_choice_equals_its_own_request(server, client, stream):  # noqa: F811
    kwargs = dict(model=server.model_dir.name, max_tokens=6, temperature=0)
    alone = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in PROMPTS]
    if stream:
        texts = ["", "", ""]
        for chunk in client.completions.create(prompt=PROMPTS, stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    else:
        answer = client.completions.create(prompt=PROMPTS, **kwargs)
        assert [c.index for c in answer.choices] == [0, 1, 2]
        texts = [c.text for c in answer.choices]
    assert texts == alone
