"""Top log-probabilities: the engine's against Hugging Face's log_softmax of the raw logits (fp32,
greedy), what the llm model and postprocessing make of them, and OpenAI's shapes through the real
server and the real `openai` client."""

import json

import numpy as np
import openai
import pytest
import torch

from conftest import start_server
from test_engine import make_engine
from test_openai_guard import chat, post, served
from tritone.launcher import free_port
from tritone.scheduling.request import SamplingParams, TopLogProbs
from tritone.serving.responses import top_log_prob_tensors

PROMPT = "The capital of France is"


def hf_steps(hf_model, prompt_ids, max_tokens):
    """Greedy tokens, and the fp32 log_softmax of the raw logits at each step."""
    ids, steps = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(log_probs.argmax())
            steps.append((token, log_probs))
            ids.append(token)
    return steps


def assert_matches_hf(steps, tokens, tops, k):
    assert tokens == [t for t, _ in steps]
    for (token, log_probs), top in zip(steps, tops):
        values, ids = log_probs.topk(k)
        assert top.token_ids == ids.tolist()
        np.testing.assert_allclose(top.log_probs, values.tolist(), atol=1e-4)
        assert abs(top.log_prob - float(log_probs[token])) < 1e-4


def test_the_engine_returns_hugging_faces_raw_top_log_probs_whatever_the_penalties(model_dir, tokenizer,
                                                                                   hf_model):
    prompt_ids = tokenizer(PROMPT).input_ids
    steps = hf_steps(hf_model, prompt_ids, 6)
    engine = make_engine(model_dir)
    engine.add_request("top", prompt_ids, SamplingParams(max_tokens=6, num_top_log_probs=5))
    # A neighbour without top log-probabilities, and one whose penalty changes its sampling but
    # not its raw log-probabilities.
    engine.add_request("plain", prompt_ids, SamplingParams(max_tokens=6))
    engine.add_request("penalized", prompt_ids, SamplingParams(max_tokens=1, num_top_log_probs=3,
                                                              repetition_penalty=1.5))
    outputs = {"top": ([], []), "plain": ([], []), "penalized": ([], [])}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id][0].extend(out.new_token_ids)
            outputs[out.request_id][1].extend(out.new_top_log_probs or [])
    assert_matches_hf(steps, *outputs["top"], k=5)
    assert outputs["plain"] == ([t for t, _ in steps], [])
    (top,) = outputs["penalized"][1]
    values, ids = steps[0][1].topk(3)
    assert top.token_ids == ids.tolist()
    np.testing.assert_allclose(top.log_probs, values.tolist(), atol=1e-4)


def test_the_llm_model_sends_them_flat_and_postprocessing_names_the_tokens(tokenizer):
    from tritone.serving.processing import Postprocessor
    from tritone.text import Detokenizer

    top = [TopLogProbs(-0.5, [7, 9], [-0.5, -1.5]), TopLogProbs(-2.0, [3], [-0.1])]
    tensors = top_log_prob_tensors(top, 2)
    assert tensors["TOP_IDS"].tolist() == [7, 9, 3, -1]
    post_ = Postprocessor(Detokenizer(tokenizer))
    entries = json.loads(post_.top_log_probs([11, 7, 3], tensors["TOP_LOG_PROBS"], tensors["TOP_IDS"]))
    decode = lambda t: tokenizer.decode([t])
    assert entries == [[decode(7), -0.5, [[decode(7), -0.5], [decode(9), -1.5]]],
                       [decode(3), -2.0, [[decode(3), pytest.approx(-0.1)]]]]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs")])
def test_more_alternatives_than_openai_allows_are_400(path, fields, param):
    app, backend = served()
    body = chat(**fields) if "chat" in path else {"model": "tiny", "prompt": "Hi", **fields}
    response = post(app, path, body)
    assert response.status == 400 and response.error["param"] == param and backend.calls == []


# ---- through the server ----

@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv, log = start_server(tmp_path_factory, "top_logprobs_server", "--kv-cache-bytes", str(256 << 20),
                            "--openai-port", str(free_port()))
    yield srv
    srv.stop()
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_completions_top_logprobs_are_hugging_faces(server, client, tokenizer, hf_model, stream):
    steps = hf_steps(hf_model, tokenizer(PROMPT).input_ids, 5)
    kwargs = dict(model=server.model_dir.name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=5)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        logprobs = [c.logprobs for c in chunks if c.logprobs and c.logprobs.tokens]
        tokens = sum((lp.tokens for lp in logprobs), [])
        token_logprobs = sum((lp.token_logprobs for lp in logprobs), [])
        top = sum((lp.top_logprobs for lp in logprobs), [])
        offsets = sum((lp.text_offset for lp in logprobs), [])
        text = "".join(c.text for c in chunks)
    else:
        choice = client.completions.create(**kwargs).choices[0]
        tokens, token_logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        top, offsets, text = choice.logprobs.top_logprobs, choice.logprobs.text_offset, choice.text
    assert tokens == [tokenizer.decode([t]) for t, _ in steps] and "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for (token, log_probs), value, alternatives in zip(steps, token_logprobs, top):
        assert abs(value - float(log_probs[token])) < 1e-4
        values, ids = log_probs.topk(5)
        expected = {tokenizer.decode([int(i)]): float(v) for i, v in zip(ids, values)}
        assert alternatives.keys() == expected.keys()
        assert all(abs(alternatives[t] - v) < 1e-4 for t, v in expected.items())


@pytest.mark.integration
def test_chat_top_logprobs_are_hugging_faces(server, client, tokenizer, hf_model):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    steps = hf_steps(hf_model, prompt_ids, 4)
    answer = client.chat.completions.create(model=server.model_dir.name, messages=question, max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=20)
    content = answer.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t, _ in steps]
    for (token, log_probs), entry in zip(steps, content):
        assert abs(entry.logprob - float(log_probs[token])) < 1e-4
        assert entry.bytes == list(entry.token.encode())
        values, ids = log_probs.topk(20)
        assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in ids]
        np.testing.assert_allclose([a.logprob for a in entry.top_logprobs], values.tolist(), atol=1e-4)
    plain = client.chat.completions.create(model=server.model_dir.name, messages=question, max_tokens=2,
                                           temperature=0, logprobs=True)
    assert [c.top_logprobs for c in plain.choices[0].logprobs.content] == [[], []]
