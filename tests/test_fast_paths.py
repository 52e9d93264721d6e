"""Every forward path this machine can run, against Hugging Face in the same dtype on the default
model; the start-up check that drops a path disagreeing with the eager reference; and seeds that
mean one text on every path (DESIGN.md, invariants 3, 7 and 8)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import PROMPTS, hf_greedy
from test_engine import run_staggered
from tritone.config import EngineConfig
from tritone.engine.core import LLMEngine
from tritone.executor import attention, compiler, kernels, llama, native, verify
from tritone.scheduling.request import SamplingParams

MAX_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# (forward, compile, dtype[, gemm]): every path; the native bf16 forward where its GEMM runs
# (AVX512-BF16), and on AMX tiles where the CPU has them.
PATHS = [("native", "off", "float32"), ("native", "off", "bfloat16"), ("native", "off", "bfloat16", "amx"),
         ("torch", "off", "float32"), ("torch", "on", "float32"), ("torch", "off", "bfloat16"),
         ("torch", "on", "bfloat16")]


def path_id(path):
    forward, mode, dtype, *gemm = path
    name = f"{forward}-{'compiled' if mode == 'on' else 'eager'}-{dtype}" if forward == "torch" else f"native-{dtype}"
    return "-".join([name, *gemm])


def skip_unrunnable(forward, dtype, gemm="auto"):
    if forward == "native" and dtype == "bfloat16" and not kernels.bf16_gemm_supported():
        pytest.skip("the native bf16 forward needs a CPU with AVX512-BF16")
    if gemm == "amx" and not kernels.amx_gemm_supported():
        pytest.skip("this CPU has no AMX-BF16 (or Linux denied this process the AMX tiles)")


def make_engine(model_dir, forward, mode, dtype, **overrides):
    config = dict(model=str(model_dir), forward=forward, compile=mode, dtype=dtype, kv_cache_bytes=64 << 20,
                  block_size=16, max_num_batched_tokens=128)
    config.update(overrides)
    engine = LLMEngine(EngineConfig(**config))
    runner = engine.runner
    # The path asked for is the path that serves: nothing fell back without the test knowing.
    assert (runner.native is not None) == (forward == "native")
    assert compiler.is_compiled(runner.model) == (mode == "on")
    assert runner.dtype == getattr(torch, dtype)
    return engine


def run(engine, prompts_ids, params_for, every=1):
    """Requests joining one after another (one each `every` steps); their tokens by request, and
    every KV block free again."""
    got = run_staggered(engine, prompts_ids, params_for, every)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    chat = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return [tokenizer(p).input_ids for p in PROMPTS[:4]] + [tokenizer(chat, add_special_tokens=False).input_ids]


@pytest.fixture(scope="module")
def hf_bf16(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module", params=PATHS, ids=path_id)
def path_engine(request, model_dir):
    """One engine per path, shared by that path's tests: building one compiles and checks its path.
    Module-scoped and parametrized, so pytest runs each path's tests together and frees its engine
    (about a gigabyte) before the next path's is built."""
    path = request.param
    skip_unrunnable(path[0], path[2], *path[3:])
    engine = make_engine(model_dir, *path[:3], **({"gemm": path[3]} if len(path) > 3 else {}))
    if len(path) > 3:  # the kernel asked for is the one that serves, in the native forward too
        assert engine.runner.native.model.bf16 == 2
    yield path, engine
    engine.shutdown()


def test_each_path_answers_as_hugging_face_in_its_dtype(prompt_ids, hf_model, hf_bf16, path_engine):
    path, engine = path_engine
    dtype = path[2]
    got = run(engine, prompt_ids, lambda i: SamplingParams(max_tokens=MAX_TOKENS))
    if dtype == "float32":  # the same arithmetic as Hugging Face's, token for token
        assert got == [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]
    else:  # bf16 rounding may flip a near-tie: then each token is in the other's top 5
        assert_close_to(hf_bf16, prompt_ids, got)


def assert_close_to(hf, prompt_ids, got, end_id=2):
    """assert_greedy_close where either side may end early: the end token counts as a token."""
    for prompt, ours in zip(prompt_ids, got):
        theirs = hf_greedy(hf, prompt, MAX_TOKENS)
        ours_ended = ours + [end_id] * (len(ours) < MAX_TOKENS)
        theirs_ended = theirs + [end_id] * (len(theirs) < MAX_TOKENS)
        for step, (a, b) in enumerate(zip(ours_ended, theirs_ended)):
            if a != b:
                with torch.inference_mode():
                    logits = hf(torch.tensor([prompt + theirs[:step]])).logits[0, -1]
                assert a in logits.topk(5).indices.tolist(), (prompt, step)
                break
        else:
            assert len(ours_ended) == len(theirs_ended)


def test_a_seed_means_one_text_alone_batched_and_after_a_prefix_hit(tokenizer, prompt_ids, path_engine):
    engine = path_engine[1]
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, seed=11, end_id=-1)
    prompt = tokenizer(PROMPTS[6]).input_ids  # a prompt no other test of the engine has sent
    alone = run(engine, [prompt], lambda i: seeded)[0]
    # Again: its prompt's blocks are cached now, so its tail is a shorter chunk.
    assert run(engine, [prompt], lambda i: seeded)[0] == alone
    # Beside other requests that join and leave, its tail prefilled in one step with their prompts.
    others = lambda i: seeded if i == 2 else SamplingParams(max_tokens=MAX_TOKENS - i, temperature=0.9, seed=i)
    assert run(engine, prompt_ids[:2] + [prompt] + prompt_ids[4:] + prompt_ids[:2], others, every=1)[2] == alone
    assert len(alone) == MAX_TOKENS


@pytest.fixture
def own_verdicts(tmp_path, monkeypatch):
    """A cache of verdicts of this test's own: a path patched to be wrong is checked, not read."""
    monkeypatch.setattr(verify, "verdicts_path", lambda: tmp_path / "fast-paths.json")
    return tmp_path / "fast-paths.json"


def wrong_layer(layer, x, residual, cos, sin):
    x, residual = llama.DecoderLayer.forward(layer, x, residual, cos, sin)
    return x * 1.5, residual  # what a miscompiled graph might do


def test_a_wrong_compiled_forward_is_dropped_and_named(model_dir, prompt_ids, hf_model, own_verdicts, monkeypatch,
                                                      caplog):
    def compile_wrongly(model):
        model.layer_forward = wrong_layer
        return True

    monkeypatch.setattr(compiler, "compile_model", compile_wrongly)
    with caplog.at_level(logging.INFO, logger="tritone"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), forward="torch", compile="auto", dtype="float32",
                                        kv_cache_bytes=64 << 20))
    assert not compiler.is_compiled(engine.runner.model)
    dropped = [r.getMessage() for r in caplog.records if "fast path compiled forward: dropped" in r.getMessage()]
    assert dropped and "logits off the reference's by" in dropped[0]
    assert any("fast path eager forward" in r.getMessage() and "passed" in r.getMessage() for r in caplog.records)
    greedy = lambda i: SamplingParams(max_tokens=MAX_TOKENS)
    assert run(engine, prompt_ids[:2], greedy) == [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids[:2]]
    # Asked for by flag, it refuses to start, naming the flag.
    with pytest.raises(ValueError, match="--compile on: the compiled forward disagrees"):
        LLMEngine(EngineConfig(model=str(model_dir), forward="torch", compile="on", dtype="float32",
                               kv_cache_bytes=64 << 20))


def test_a_wrong_native_forward_is_dropped_and_a_verdict_is_cached(model_dir, own_verdicts, monkeypatch, caplog):
    config = EngineConfig(model=str(model_dir), forward="auto", compile="off", dtype="float32", kv_cache_bytes=64 << 20)
    with caplog.at_level(logging.INFO, logger="tritone"):
        assert LLMEngine(config).runner.native is not None  # right: it serves
    assert any("fast path native forward: passed" in r.getMessage() and "(checked" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tritone"):
        assert LLMEngine(config).runner.native is not None
    assert any("fast path native forward: passed" in r.getMessage() and "(cached" in r.getMessage()
               for r in caplog.records)
    real = native.NativeForward.__call__
    monkeypatch.setattr(native.NativeForward, "__call__", lambda self, *a, **k: real(self, *a, **k) * 0.5)
    monkeypatch.setattr(verify, "_source_digest", lambda: "patched")  # another build: checked again
    assert LLMEngine(config).runner.native is None
    with pytest.raises(ValueError, match="--forward native: the native forward disagrees"):
        LLMEngine(EngineConfig(model=str(model_dir), forward="native", dtype="float32", kv_cache_bytes=64 << 20))


def test_a_wrong_attention_kernel_is_dropped_or_refused(model_dir, monkeypatch):
    real = attention.NativeCPUAttention.forward
    monkeypatch.setattr(attention.NativeCPUAttention, "forward",
                        lambda self, q, k, v, meta, scale: real(self, q, k, v, meta, scale).flip(0))
    config = dict(model=str(model_dir), forward="torch", compile="off", dtype="float32", kv_cache_bytes=64 << 20)
    assert LLMEngine(EngineConfig(**config)).runner.attention.name == "sdpa"
    with pytest.raises(ValueError, match="--attention cpu-native: disagrees with SDPA"):
        LLMEngine(EngineConfig(**config, attention="cpu-native"))
