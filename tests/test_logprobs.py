"""Log-probabilities: the top ones of each generated token and the prompt's scores (echo), the
engine's against Hugging Face's log_softmax of the raw logits (fp32, greedy), what the llm model
and postprocessing make of them, and OpenAI's shapes through the real server, the ensemble over
gRPC and the real `openai` client."""

import json

import numpy as np
import openai
import pytest
import torch

from test_engine import make_engine
from test_openai_guard import chat, post, served
from tritone.scheduling.request import SamplingParams, TopLogProbs
from tritone.serving.responses import prompt_log_prob_tensors, top_log_prob_tensors

PROMPT = "The capital of France is"
# Long enough to span several prefill chunks of 16 tokens and a full KV block.
LONG_PROMPT = ("Tritone serves language models on Triton: a tokenizer, an engine and a detokenizer, each in its "
               "own processes, chained by an ensemble. The capital of France is")


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


def hf_prompt_scores(hf_model, prompt_ids):
    """Row p: the fp32 log_softmax of the raw logits at position p, which token p + 1 is drawn from."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def assert_scores_match(log_probs, prompt_ids, scores, k):
    assert len(scores) == len(prompt_ids) - 1
    for p, entry in enumerate(scores):
        assert abs(entry.log_prob - float(log_probs[p, prompt_ids[p + 1]])) < 1e-4
        values, ids = log_probs[p].topk(k)
        assert entry.token_ids == ids.tolist()
        np.testing.assert_allclose(entry.log_probs, values.tolist(), atol=1e-4)


def test_the_engine_scores_the_prompt_in_chunks_and_past_the_prefix_cache(model_dir, tokenizer, hf_model):
    prompt_ids = tokenizer(LONG_PROMPT).input_ids
    assert len(prompt_ids) > 32
    expected = hf_prompt_scores(hf_model, prompt_ids)
    # Chunks of 16 tokens; block size 16, so the second request finds the first's blocks cached.
    engine = make_engine(model_dir, max_num_batched_tokens=16, block_size=16)
    outputs = {}

    def run(request_id, params):
        engine.add_request(request_id, prompt_ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)

    run("plain", SamplingParams(max_tokens=2))
    run("scored", SamplingParams(max_tokens=2, prompt_log_probs=3))
    run("scored-0", SamplingParams(max_tokens=1, prompt_log_probs=0))
    assert all(o.prompt_top_log_probs is None for o in outputs["plain"])
    first, *rest = outputs["scored"]
    assert_scores_match(expected, prompt_ids, first.prompt_top_log_probs, 3)
    assert first.new_token_ids and all(o.prompt_top_log_probs is None for o in rest)
    assert [o.new_token_ids for o in outputs["scored"]] == [o.new_token_ids for o in outputs["plain"]]
    assert_scores_match(expected, prompt_ids, outputs["scored-0"][0].prompt_top_log_probs, 0)


def test_prompt_scores_travel_flat_and_postprocessing_names_every_prompt_token(tokenizer):
    from tritone.serving.processing import Postprocessor
    from tritone.text import Detokenizer

    scores = [TopLogProbs(-1.25, [9, 4], [-0.5, -0.75]), TopLogProbs(-3.0, [5], [-0.25])]
    tensors = prompt_log_prob_tensors([11, 7, 3], scores, 2)
    assert tensors["PROMPT_IDS"].tolist() == [11, -1, -1, 7, 9, 4, 3, 5, -1]
    entries = json.loads(Postprocessor(Detokenizer(tokenizer)).prompt_log_probs(
        tensors["PROMPT_LOG_PROBS"], tensors["PROMPT_IDS"], 3))
    decode = lambda t: tokenizer.decode([t])
    assert entries == [[decode(11), None, []],
                       [decode(7), -1.25, [[decode(9), -0.5], [decode(4), -0.75]]],
                       [decode(3), -3.0, [[decode(5), -0.25]]]]


def test_max_tokens_0_is_echos_alone():
    app, backend = served()
    response = post(app, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 0})
    assert response.status == 400 and response.error["param"] == "max_tokens" and backend.calls == []


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
def server(openai_server):
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


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


def _expected_echo(tokenizer, hf_model, prompt, k):
    prompt_ids = tokenizer(prompt).input_ids
    log_probs = hf_prompt_scores(hf_model, prompt_ids)
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    values = [None] + [float(log_probs[p, prompt_ids[p + 1]]) for p in range(len(prompt_ids) - 1)]
    tops = [None] + [{tokenizer.decode([int(i)]): float(v) for v, i in zip(*log_probs[p].topk(k))}
                     for p in range(len(prompt_ids) - 1)]
    return tokens, values, tops


def _assert_echo_scores(logprobs, tokens, values, tops):
    assert logprobs.tokens[:len(tokens)] == tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(logprobs.token_logprobs[1:len(values)], values[1:], atol=1e-4)
    for got, want in zip(logprobs.top_logprobs[1:len(tops)], tops[1:]):
        assert got.keys() == want.keys() and all(abs(got[t] - v) < 1e-4 for t, v in want.items())
    assert logprobs.text_offset[:len(tokens)] == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.integration
def test_echo_with_max_tokens_0_scores_the_prompt_as_hugging_face(server, client, tokenizer, hf_model):
    tokens, values, tops = _expected_echo(tokenizer, hf_model, LONG_PROMPT, 2)
    answer = client.completions.create(model=server.model_dir.name, prompt=[LONG_PROMPT, PROMPT], max_tokens=0,
                                       echo=True, logprobs=2, temperature=0)
    first, second = answer.choices
    assert first.text == LONG_PROMPT and second.text == PROMPT
    assert first.logprobs.tokens == tokens and first.finish_reason == "length"
    _assert_echo_scores(first.logprobs, tokens, values, tops)
    assert answer.usage.completion_tokens == 0
    assert answer.usage.prompt_tokens == len(tokens) + len(tokenizer(PROMPT).input_ids)


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_scored_prompt_before_the_completion(server, client, tokenizer, hf_model, stream):
    tokens, values, tops = _expected_echo(tokenizer, hf_model, PROMPT, 3)
    steps = hf_steps(hf_model, tokenizer(PROMPT).input_ids, 3)
    kwargs = dict(model=server.model_dir.name, prompt=PROMPT, max_tokens=3, echo=True, logprobs=3, temperature=0)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.text for c in chunks)
        parts = [c.logprobs for c in chunks if c.logprobs and c.logprobs.tokens]
        logprobs = parts[0]
        for part in parts[1:]:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(part, name))
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs
    generated = [tokenizer.decode([t]) for t, _ in steps]
    assert text == PROMPT + "".join(generated)
    assert logprobs.tokens == tokens + generated
    _assert_echo_scores(logprobs, tokens, values, tops)
    for (token, log_probs), value in zip(steps, logprobs.token_logprobs[len(tokens):]):
        assert abs(value - float(log_probs[token])) < 1e-4


@pytest.mark.integration
def test_the_ensemble_returns_prompt_log_probs_once(server, tokenizer):
    from tritone_client.client import TritoneClient

    with TritoneClient(f"{server.args.host}:{server.args.grpc_port}", "grpc") as client:
        chunks = list(client.generate(PROMPT, max_tokens=3, stream=True, num_prompt_log_probs=1,
                                      apply_chat_template=False))
    scored = [c for c in chunks if c.prompt_log_probs]
    assert len(scored) == 1 and chunks[0] is scored[0]
    entries = scored[0].prompt_log_probs
    assert [e[0] for e in entries] == [tokenizer.decode([t]) for t in tokenizer(PROMPT).input_ids]
    assert entries[0][1] is None and all(e[1] < 0 and len(e[2]) == 1 for e in entries[1:])


@pytest.mark.integration
def test_a_prompt_of_token_ids_is_served_as_its_text(server, client, tokenizer, hf_model):
    prompt_ids = tokenizer(PROMPT).input_ids
    kwargs = dict(model=server.model_dir.name, max_tokens=4, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    by_ids = client.completions.create(prompt=[prompt_ids, prompt_ids[:-1]], **kwargs)
    assert by_ids.choices[0].text == by_text and by_ids.choices[1].text
    tokens, values, tops = _expected_echo(tokenizer, hf_model, PROMPT, 1)
    echoed = client.completions.create(prompt=prompt_ids, echo=True, logprobs=1, **{**kwargs, "max_tokens": 0})
    choice = echoed.choices[0]
    assert choice.text == "".join(tokens) and echoed.usage.prompt_tokens == len(prompt_ids)
    _assert_echo_scores(choice.logprobs, tokens, values, tops)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(prompt=[10**8], **kwargs)
    assert "vocabulary" in str(refused.value) or "input_ids" in str(refused.value)


def _lm_eval_tasks(directory) -> "object":
    """The log-likelihood and generation tasks of tests/lm_eval_tasks, their data file's path made
    absolute (lm-evaluation-harness reads it from the working directory)."""
    import pathlib

    from lm_eval.tasks import TaskManager

    source = pathlib.Path(__file__).parent / "lm_eval_tasks"
    data = source / "capitals.jsonl"
    for task in source.glob("*.yaml"):
        (directory / task.name).write_text(task.read_text().replace("test: capitals.jsonl", f"test: {data}"))
    return TaskManager(include_path=str(directory))


@pytest.mark.integration
def test_lm_evaluation_harness_scores_as_its_hugging_face_backend(server, model_dir, tmp_path):
    import lm_eval

    tasks = ["tritone_capitals", "tritone_complete"]
    manager = _lm_eval_tasks(tmp_path)
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=tasks, task_manager=manager, log_samples=True,
        model_args=f"model={model_dir.name},base_url={server.openai_url}/completions,tokenizer={model_dir},"
                   f"num_concurrent=4,max_retries=1")
    reference = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32", tasks=tasks,
                                        task_manager=manager, log_samples=True, batch_size=4, device="cpu")
    for task, metrics in (("tritone_capitals", ("acc,none", "acc_norm,none")),
                          ("tritone_complete", ("exact_match,none",))):
        for metric in metrics:
            assert served["results"][task][metric] == pytest.approx(reference["results"][task][metric], abs=1e-3)
    # Beyond the scores: every choice's log-likelihood, and every generation.
    for ours, theirs in zip(served["samples"]["tritone_capitals"], reference["samples"]["tritone_capitals"]):
        got = [float(r[0][0]) for r in ours["resps"]]
        want = [float(r[0][0]) for r in theirs["resps"]]
        np.testing.assert_allclose(got, want, atol=1e-3)
    assert [s["resps"] for s in served["samples"]["tritone_complete"]] == \
        [s["resps"] for s in reference["samples"]["tritone_complete"]]
    assert served["results"]["tritone_capitals"]["acc,none"] > 0.5  # the task discriminates: not all wrong
