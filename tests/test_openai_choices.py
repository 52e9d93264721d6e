"""Several choices per request: a completion of a list of prompts answers one choice per prompt, in
order, whole or streamed (each chunk with its choice's index)."""

import json

import openai
import pytest

from test_openai_guard import FakeBackend, chunk_result, post, served
from test_logprobs import client, server  # noqa: F401 (the session's OpenAI server)

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
    backend = FakeBackend([(chunk_result("Par", ""), None), (chunk_result("is.", "stop"), None)])
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


def test_n_sequences_draw_from_seed_plus_their_index():
    app, backend = served()
    response = post(app, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                  "n": 3, "seed": 7})
    body = response.json()
    assert response.status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [int(t["seed"][0, 0]) for t in backend.calls] == [7, 8, 9]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
    post(app, "/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 2, "seed": 2**64 - 1})
    assert [int(t["seed"][0, 0]) for t in backend.calls[3:]] == [2**64 - 1, 0, 2**64 - 1, 0]


def test_best_of_keeps_the_n_most_likely_sequences():
    from tritone.openai.choices import best
    from tritone_client.client import Chunk

    answers = [Chunk(str(i), 3, 1, lp, [], "stop") for i, lp in enumerate([-3.0, -1.0, -2.0, -0.5, -9.0, -4.0])]
    assert [a.text for a in best(answers, 3, 2)] == ["1", "2", "3", "5"]
    app, backend = served()
    response = post(app, "/v1/completions", {"model": "tiny", "prompt": "Hi", "n": 1, "best_of": 3})
    assert response.status == 200 and len(response.json()["choices"]) == 1 and len(backend.calls) == 3
    assert all(bool(t["return_log_probs"][0, 0]) for t in backend.calls)


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"n": 9}, "n"), ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"best_of": 9}, "best_of"), ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
    ("/v1/chat/completions", {"n": 0}, "n")])
def test_n_and_best_of_are_bounded(path, fields, param):
    app, backend = served()
    body = {"model": "tiny", **({"prompt": "Hi"} if "chat" not in path else
                                {"messages": [{"role": "user", "content": "Hi"}]}), **fields}
    response = post(app, path, body)
    assert response.status == 400 and response.error["param"] == param and backend.calls == []


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_choices_equal_single_requests_with_seeds_s_to_s_plus_2(server, client, stream):  # noqa: F811
    kwargs = dict(model=server.model_dir.name, max_tokens=8, temperature=1.0)
    alone = [client.completions.create(prompt=PROMPTS[0], seed=11 + i, **kwargs).choices[0].text for i in range(3)]
    assert len(set(alone)) > 1  # the seeds differ, and so do their texts
    if stream:
        texts = ["", "", ""]
        for chunk in client.completions.create(prompt=PROMPTS[0], seed=11, n=3, stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    else:
        texts = [c.text for c in client.completions.create(prompt=PROMPTS[0], seed=11, n=3, **kwargs).choices]
    assert texts == alone
    question = [{"role": "user", "content": "Name a colour."}]
    chat_alone = [client.chat.completions.create(model=server.model_dir.name, messages=question, max_tokens=8,
                                                 seed=11 + i).choices[0].message.content for i in range(3)]
    chat = client.chat.completions.create(model=server.model_dir.name, messages=question, max_tokens=8, seed=11, n=3)
    assert [c.message.content for c in chat.choices] == chat_alone


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_the_ensembles_num_return_sequences_equal_seeded_single_requests(server, stream):  # noqa: F811
    from tritone_client.client import TritoneClient

    kwargs = dict(max_tokens=8, temperature=1.0, apply_chat_template=False)
    with TritoneClient(f"{server.args.host}:{server.args.grpc_port}", "grpc") as client:
        alone = [client.complete(PROMPTS[0], seed=11 + i, **kwargs).text for i in range(3)]
        texts, finished = ["", "", ""], set()
        for chunk in client.generate(PROMPTS[0], seed=11, num_return_sequences=3, stream=stream, **kwargs):
            texts[chunk.sequence_index] += chunk.text
            if chunk.finish_reason:
                finished.add(chunk.sequence_index)
        assert texts == alone and finished == {0, 1, 2}  # every sequence ended before the final flag
        with pytest.raises(RuntimeError, match="num_return_sequences must be in"):
            client.complete(PROMPTS[0], num_return_sequences=9, **kwargs)
