"""LoRA adapters: PEFT checkpoints built here on the default model, served beside the base model
and each other in one batch, against Hugging Face with the adapter merged (fp32, greedy); their
errors; and through the real server with the real `openai` client and the ensemble's
lora_task_id."""

import concurrent.futures

import openai
import pytest
import torch

from conftest import hf_greedy, start_server
from test_engine import make_engine
from tritone.launcher import free_port
from tritone.scheduling.request import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, there was a little"]
MAX_TOKENS = 8


def build_adapter(model_dir, path, rank: int, targets: list[str], seed: int, std: float):
    """A PEFT LoRA adapter with random B (PEFT starts B at zero, which would change nothing),
    saved at `path`; returns Hugging Face's model with it merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)  # PEFT draws A from the global generator
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory, tokenizer):
    """Two adapters (every projection at rank 8; q, v and down at rank 4), and each one's
    greedy answers to PROMPTS as Hugging Face gives them with the adapter merged."""
    root = tmp_path_factory.mktemp("adapters")
    built = {}
    for name, rank, targets, seed, std in (("every", 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"], 1, 0.05),
                                      ("some", 4, ["q_proj", "v_proj", "down_proj"], 2, 0.1)):
        merged = build_adapter(model_dir, root / name, rank, targets, seed, std)
        built[name] = [hf_greedy(merged, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS]
        del merged
    return root, built


@pytest.mark.parametrize("forward", ["native", "torch"])
def test_adapters_and_the_base_model_share_a_batch_each_as_hugging_face_merged(model_dir, tokenizer, hf_model,
                                                                              adapters, forward):
    root, built = adapters
    expected = {**built, "base": [hf_greedy(hf_model, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS]}
    assert expected["every"] != expected["base"] and expected["some"] != expected["base"]
    engine = make_engine(model_dir, lora_modules=f"every={root / 'every'},some={root / 'some'}", max_lora_rank=8,
                         forward=forward)
    assert (engine.runner.native is not None) == (forward == "native")
    lora_ids = {"base": 0, "every": 1, "some": 2}
    outputs = {}
    for name, lora_id in lora_ids.items():  # one batch: every request is in before the first step
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{name}-{i}", tokenizer(prompt).input_ids,
                               SamplingParams(max_tokens=MAX_TOKENS, lora_id=lora_id))
            outputs[f"{name}-{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    for name in lora_ids:
        assert [outputs[f"{name}-{i}"] for i in range(len(PROMPTS))] == expected[name], name


def test_a_base_model_request_beside_adapters_is_the_base_models_bit_for_bit(model_dir, tokenizer, adapters):
    """In the serving dtype (bf16 where the CPU has it), whatever forward is chosen: a row of the
    base model gets exactly +0 from the adapters' products."""
    root, _ = adapters
    prompt_ids = tokenizer(PROMPTS[1]).input_ids

    def answers(**options):
        engine = make_engine(model_dir, dtype="auto", **options)
        engine.add_request("base", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, return_log_probs=True))
        if options:
            engine.add_request("adapted", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, lora_id=1))
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                ids, lps = out.setdefault(o.request_id, ([], []))
                ids.extend(o.new_token_ids)
                lps.extend(o.new_log_probs)
        return out

    with_adapters = answers(lora_modules=f"every={root / 'every'}")
    assert with_adapters["base"] == answers()["base"]
    assert with_adapters["adapted"][0] != with_adapters["base"][0]


def test_a_bad_adapter_or_id_is_refused_naming_its_field(model_dir, tmp_path, adapters):
    root, _ = adapters
    with pytest.raises(ValueError, match="--lora-modules"):
        make_engine(model_dir, lora_modules=f"missing={tmp_path}")
    with pytest.raises(ValueError, match="--max-lora-rank 4"):
        make_engine(model_dir, lora_modules=f"every={root / 'every'}", max_lora_rank=4)
    with pytest.raises(ValueError, match="lora_modules"):
        make_engine(model_dir, lora_modules="no-path-given")
    with pytest.raises(ValueError, match="--forward native: --max-loras"):
        make_engine(model_dir, lora_modules=f"every={root / 'every'}", forward="native", max_loras=64, max_lora_rank=16)
    engine = make_engine(model_dir, lora_modules=f"every={root / 'every'}")
    with pytest.raises(ValueError, match="lora_task_id 2"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2, lora_id=2))


def test_adapters_read_their_own_prefix_cache(model_dir, tokenizer, adapters):
    """The same prompt under the base model, then an adapter, then the base again: the adapter's
    answer is its own (no KV of the base model's reused), the base's second answer a cache hit."""
    root, expected = adapters
    engine = make_engine(model_dir, lora_modules=f"every={root / 'every'}", block_size=4)
    prompt_ids = tokenizer(PROMPTS[0]).input_ids

    def run(request_id, lora_id):
        engine.add_request(request_id, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, lora_id=lora_id))
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
        return tokens

    base = run("base", 0)
    stats = engine.block_manager.prefix_stats
    hits = stats.num_hit
    assert run("every", 1) == expected["every"][0] and stats.num_hit == hits
    assert run("base-again", 0) == base and stats.num_hit > hits


# ---- through the server ----

@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, adapters):
    root, _ = adapters
    srv, log = start_server(tmp_path_factory, "lora_server", "--kv-cache-bytes", str(256 << 20),
                            "--openai-port", str(free_port()), "--max-lora-rank", "8",
                            "--lora-modules", f"every={root / 'every'},some={root / 'some'}")
    yield srv
    srv.stop()
    log.close()


@pytest.mark.integration
def test_the_openai_model_name_picks_the_adapter_in_a_mixed_batch(server, model_dir, tokenizer, hf_model, adapters):
    _, expected = adapters
    expected = {**expected, model_dir.name: [hf_greedy(hf_model, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS]}
    client = openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_dir.name, "every", "some"]

    def ask(model, prompt):
        return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text

    jobs = [(model, i) for model in expected for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: ask(job[0], PROMPTS[job[1]]), jobs))
    for (model, i), text in zip(jobs, texts):
        assert text == tokenizer.decode(expected[model][i]), model
    with pytest.raises(openai.NotFoundError):
        ask("nobody", PROMPTS[0])


@pytest.mark.integration
def test_the_ensembles_lora_task_id_picks_the_adapter(server, tokenizer, adapters):
    from tritone_client.client import TritoneClient

    _, expected = adapters
    with TritoneClient(f"{server.args.host}:{server.args.grpc_port}", "grpc") as client:
        chunk = client.complete(PROMPTS[1], max_tokens=MAX_TOKENS, lora_task_id=2, apply_chat_template=False)
        assert chunk.text == tokenizer.decode(expected["some"][1])
        with pytest.raises(Exception, match="lora_task_id 3"):
            client.complete(PROMPTS[1], max_tokens=2, lora_task_id=3)
    assert "LoRA adapters: every (rank 8, " in \
        (server.run_dir / "server.log").read_text()
