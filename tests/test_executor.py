"""Tritone's own model definitions against Hugging Face's, on tiny random checkpoints built here
(Qwen2 with QKV bias, Qwen3 with q/k norm, Llama 3 RoPE scaling, sharded weights), native,
compiled and eager; the Hugging Face fallback for an architecture not covered; a compile that fails; the
measured dtype; the default model in bf16 against Hugging Face bf16."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, Qwen2Config, Qwen3Config

from conftest import PROMPTS
from tritone.config import EngineConfig
from tritone.engine.core import LLMEngine
from tritone.executor import compiler, gemm, hardware, kernels, llama, native
from tritone.executor.hf import HFCausalLM
from tritone.scheduling.request import SamplingParams

MAX_TOKENS = 8
COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
              # Large weights make the logits peaked, so that greedy choices are not near-ties that
              # GEMM rounding could flip.
              initializer_range=0.3)
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON),
    "llama3": lambda: LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "gemma": lambda: GemmaConfig(**COMMON),
}


def build_tiny(name, path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    # Small shards, so that loading walks several files.
    model.save_pretrained(path, max_shard_size="200KB")
    return name, path, model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def prompts(n=4):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 384, (length,), generator=gen).tolist() for length in (5, 17, 40, 3)[:n]]


def hf_greedy(model, ids):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def engine_greedy(model_dir, prompt_ids, **overrides):
    config = dict(model=str(model_dir), dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                  max_num_batched_tokens=32)
    config.update(overrides)
    engine = LLMEngine(EngineConfig(**config))
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS, end_id=-1))
    outputs = {str(i): [] for i in range(len(prompt_ids))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine, [outputs[str(i)] for i in range(len(prompt_ids))]


@pytest.mark.parametrize("forward, mode", [("auto", "auto"), ("torch", "on"), ("torch", "off")])
def test_tiny_models_equal_hugging_face(tiny, forward, mode):
    name, path, hf = tiny
    ids = prompts()
    engine, got = engine_greedy(path, ids, forward=forward, compile=mode)
    model = engine.runner.model
    if name == "gemma":  # (1 + weight) norms: not a Llama-family model, so the fallback serves it
        assert isinstance(model, HFCausalLM) and engine.runner.native is None
    else:
        assert isinstance(model, llama.LlamaForCausalLM)
        # auto: the native forward, in one call per step, and nothing compiled
        assert (engine.runner.native is not None) == (forward == "auto")
        assert (engine.runner.compile_seconds > 0) == (forward == "torch" and mode == "on")
    assert got == [hf_greedy(hf, p) for p in ids]


def test_native_forward_logits_match_the_torch_modules(tiny):
    # Logits, not only greedy choices: the same requests (prompt chunks, decodes, a prefix-cache
    # hit) through the native forward and through the eager torch modules, step by step.
    name, path, _ = tiny
    if name == "gemma":
        return
    logits = {}
    for forward in ("native", "torch"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                                        max_num_batched_tokens=24, forward=forward, compile="off"))
        steps = logits[forward] = []
        run_model = engine.runner.run_model
        engine.runner.run_model = lambda *args: steps.append(run_model(*args)) or steps[-1]
        shared = prompts(1)[0] * 2  # the second request repeats the first's prompt: a prefix hit
        for i, ids in enumerate([shared, prompts(3)[2], shared + [7, 8, 9]]):
            # Log probabilities asked for: the step needs the logits, not only the greedy tokens.
            engine.add_request(str(i), ids, SamplingParams(max_tokens=6, end_id=-1, return_log_probs=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert len(logits["native"]) == len(logits["torch"]) > 5
    for got, want in zip(logits["native"], logits["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)


def test_native_forward_asked_for_where_it_cannot_run(tmp_path):
    _, path, _ = build_tiny("gemma", tmp_path)
    with pytest.raises(ValueError, match="forward native: the model runs on Hugging Face's modules"):
        engine_greedy(path, prompts(1), forward="native")
    _, path, _ = build_tiny("qwen2", tmp_path / "qwen2")
    with pytest.raises(ValueError, match="forward native: it runs float32 or bfloat16, not float16"):
        engine_greedy(path, prompts(1), forward="native", dtype="float16")


def test_native_forward_structures_are_the_size_of_the_headers_structures():
    # native.py restates csrc/kernels.h's structures by hand: a field added on one side only
    # would shift every field after it.
    sizes = (ctypes.c_size_t * 3)()
    kernels.native_library().llama_struct_sizes(sizes)
    assert list(sizes) == [ctypes.sizeof(native._Layer), ctypes.sizeof(native._Model), ctypes.sizeof(native._Batch)]


def test_compile_cache_lies_under_tritones_cache(tmp_path):
    # Inductor writes its own default into the environment once anything asks it for its cache,
    # and loading a model does: Tritone's must be in place before that.
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TRITONE_CACHE"] = str(tmp_path)
    code = ("import os, tritone.executor.compiler\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(cache_dir())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "compile" / "inductor")


def test_failed_compile_falls_back_to_eager(tmp_path, monkeypatch):
    name, path, hf = build_tiny("qwen3", tmp_path)

    def broken(fn, **kwargs):
        def raises(*args):
            raise RuntimeError("inductor exploded")
        return raises

    monkeypatch.setattr(compiler, "_compiled", {})
    monkeypatch.setattr(compiler.torch, "compile", broken)
    ids = prompts(2)
    engine, got = engine_greedy(path, ids, forward="torch", compile="on")
    assert engine.runner.compile_seconds == 0
    assert engine.runner.model.layer_forward is llama.DecoderLayer.forward
    assert got == [hf_greedy(hf, p) for p in ids]


def quiet_machine(monkeypatch, share=0.0):
    """Other processes' CPU during a measurement, as hardware.others_share would report it."""
    monkeypatch.setattr(hardware, "others_share", lambda measure: (measure(), share))
    monkeypatch.setattr(hardware, "uncontended", functools.partial(hardware.uncontended, patience_s=0))


def test_dtype_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONE_CACHE", str(tmp_path))
    quiet_machine(monkeypatch)
    calls = []
    real = hardware.measure_gemm_gflops
    monkeypatch.setattr(hardware, "measure_gemm_gflops", lambda dtype: calls.append(dtype) or real(dtype, 0.02))
    first = hardware.fastest_cpu_dtype()
    assert first in (torch.float32, torch.bfloat16) and len(calls) == 2
    assert hardware.fastest_cpu_dtype() == first and len(calls) == 2  # from the cache
    assert list((tmp_path / "hardware").glob("cpu-*.json"))


# Every kernel that runs float32 (amx multiplies bf16 only: tests/test_amx.py).
F32_KERNELS = tuple(k for k in gemm.KERNELS if k != "amx")
CANDIDATES = [c for kernel in F32_KERNELS for c in gemm.candidate_names(kernel)]


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("choice", CANDIDATES)
def test_linear_on_each_kernel_equals_mm(choice, rows, bias):
    assert gemm.available(torch.float32) == F32_KERNELS, "oneDNN or the native kernels are missing here"
    gen = torch.Generator().manual_seed(rows)
    layer = llama.Linear(50, 83, bias, torch.float32)  # a column count that leaves a partial panel
    torch.nn.init.normal_(layer.weight, generator=gen)
    if bias:
        torch.nn.init.normal_(layer.bias, generator=gen)
    x = torch.randn(rows, 50, generator=gen)
    want = layer(x)
    layer.prepack(choice)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gemm.linear(x, layer.weight, layer.bias, layer.packed), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_check_passes_tritones_kernel_and_drops_a_wrong_or_row_variant_one(dtype):
    if dtype == torch.bfloat16 and not kernels.bf16_gemm_supported():
        dtype = torch.float32
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    assert gemm.check(gemm.PackedLinear(weight, "tritone"), dtype, gen) is None

    class Wrong(gemm.PackedLinear):  # drops the last input feature
        def __call__(self, x, bias):
            return super().__call__(torch.cat([x[:, :-1], x.new_zeros(len(x), 1)], dim=1), bias)

    class RowVariant(gemm.PackedLinear):  # its rounding changes past 32 rows, as MKL's may
        def __call__(self, x, bias):
            y = super().__call__(x, bias)
            return (y.float() * (1 + torch.finfo(y.dtype).eps)).to(y.dtype) if len(x) > 32 else y

    assert gemm.check(Wrong(weight, "tritone"), dtype, gen).startswith("wrong")
    assert gemm.check(RowVariant(weight, "tritone"), dtype, gen).startswith("row-variant")


@pytest.mark.parametrize("rows", [49, 300])
def test_native_gemm_over_blocks_of_rows(rows):
    # 1000 inputs: blocks of 48 rows (192 KB of x each), the last one partial, and panels shared
    # out among threads across blocks.
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(1000, 70, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(rows, 1000, generator=gen)
    got = kernels.gemm_f32(x, kernels.pack_f32(weight), bias, 70)
    torch.testing.assert_close(got, torch.addmm(bias, x, weight), rtol=1e-4, atol=1e-3)


@contextlib.contextmanager
def native_pool():
    """The kernels' sections on their thread pool (csrc/pool.c), as inside a native forward pass,
    rather than on OpenMP's team."""
    lib = kernels.native_library()
    lib.pool_warm_begin()
    try:
        yield
    finally:
        lib.pool_warm_end()


def test_native_kernels_called_from_several_threads_at_once():
    # The kernels' thread pool runs one job at a time; a caller that finds it busy runs its job
    # alone. Each thread's products must stay its own (ctypes lets the calls overlap).
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 130, generator=gen)
    panels = kernels.pack_f32(weight)
    inputs = [torch.randn(40, 300, generator=gen) for _ in range(4)]
    want = [x @ weight for x in inputs]
    failures = []

    def work(i):
        with native_pool():
            for _ in range(50):
                got = kernels.gemm_f32(inputs[i], panels, None, 130)
                if not torch.allclose(got, want[i], rtol=1e-4, atol=1e-3):
                    failures.append(i)
                    return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a kernel call never returned"
    assert not failures


def test_native_kernels_run_in_a_forked_child():
    # A child forked after the pool's workers started has none of them: its kernels must still
    # run (on threads of its own) rather than wait forever for the parent's.
    gen = torch.Generator().manual_seed(6)
    weight, x = torch.randn(200, 90, generator=gen), torch.randn(64, 200, generator=gen)
    # torch's and OpenMP's own threads do not survive a fork: the child uses neither.
    panels, want = kernels.pack_f32(weight), x @ weight
    with native_pool():
        kernels.gemm_f32(x, panels, None, 90)  # the parent's workers start here
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when its product is right
        with native_pool():
            got = kernels.gemm_f32(x, panels, None, 90)
        os._exit(0 if (got - want).abs().max().item() < 1e-3 else 1)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's kernel call never returned")
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("rows,k,n", [(1, 64, 4099), (7, 64, 1000), (300, 64, 5003), (50, 1000, 333)])
def test_native_gemm_argmax_is_the_argmax_of_the_product(rows, k, n):
    # Panels spread over threads in runs, several blocks of rows (300 x 64, 1000-wide x), a
    # partial last panel; then ties, which must go to the lowest column as torch's argmax does.
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(k, n, generator=gen), torch.randn(rows, k, generator=gen)
    panels = kernels.pack_f32(weight)
    assert torch.equal(kernels.gemm_f32_argmax(x, panels, n), kernels.gemm_f32(x, panels, None, n).argmax(dim=-1))
    weight[:, n - 1] = weight[:, 70] = weight[:, 40]  # three equal columns, in different panels and runs
    x[:] = weight[:, 40]  # each row's product is largest at those columns
    assert kernels.gemm_f32_argmax(x, kernels.pack_f32(weight), n).tolist() == [40] * rows


def test_a_contended_measurement_is_retried_and_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONE_CACHE", str(tmp_path))
    quiet_machine(monkeypatch, share=0.6)
    calls = []
    real = hardware.measure_gemm_gflops
    monkeypatch.setattr(hardware, "measure_gemm_gflops", lambda dtype: calls.append(dtype) or real(dtype, 0.02))
    assert hardware.fastest_cpu_dtype() in (torch.float32, torch.bfloat16)
    assert len(calls) == 6  # three attempts of both dtypes
    assert not list((tmp_path / "hardware").glob("cpu-*.json"))
    monkeypatch.setattr(gemm, "_COLD_BYTES", 1 << 20)
    path = tmp_path / "linear.json"
    gemm.choose({(64, 96)}, torch.float32, path)
    assert json.loads(path.read_text()) == {}  # the next start measures again
    quiet_machine(monkeypatch)
    assert hardware.fastest_cpu_dtype() and len(calls) == 8
    gemm.choose({(64, 96)}, torch.float32, path)
    assert list(json.loads(path.read_text()).values())[0].keys() == {"64x96"}


def test_others_share_sees_a_busy_neighbour():
    spin = "import time\nend = time.perf_counter() + 1.5\nwhile time.perf_counter() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        _, busy = hardware.others_share(lambda: time.sleep(0.5))
    finally:
        spinner.wait()
    _, idle = hardware.others_share(lambda: time.sleep(0.5))
    assert busy > hardware.CONTENDED_SHARE > idle


def test_gemm_choice_is_measured_once_and_cached(tmp_path, monkeypatch):
    quiet_machine(monkeypatch)
    calls = []
    real = gemm.measure
    monkeypatch.setattr(gemm, "measure", lambda k, n, dtype: calls.append((k, n)) or real(k, n, dtype))
    monkeypatch.setattr(gemm, "_COLD_BYTES", 1 << 20)
    path = tmp_path / "linear.json"
    first = gemm.choose({(64, 96), (96, 64)}, torch.float32, path)
    assert sorted(calls) == [(64, 96), (96, 64)]
    assert all(choice in CANDIDATES or choice == "mm" for choice in first.values())
    assert gemm.choose({(64, 96), (96, 64)}, torch.float32, path) == first and len(calls) == 2


needs_bf16_gemm = pytest.mark.skipif(not kernels.bf16_gemm_supported(),
                                     reason="the native bf16 GEMM needs a CPU with AVX512-BF16")


@needs_bf16_gemm
@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (7, 577, 70), (13, 1000, 333), (300, 64, 5003)])
def test_native_bf16_gemm_equals_the_product_of_the_rounded_operands(rows, k, n):
    # Row counts under, at and over the 12-row tile and several 192 KB blocks of rows; an odd k
    # (a padded pair); a partial last panel. Sums are fp32 in both, in different orders.
    gen = torch.Generator().manual_seed(rows)
    weight, x, bias = torch.randn(k, n, generator=gen), torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = kernels.pack_bf16(weight)
    want = x.bfloat16().float() @ weight.bfloat16().float() + bias
    torch.testing.assert_close(kernels.gemm_bf16(x, panels, bias, n), want, rtol=1e-4, atol=2e-4)
    assert torch.equal(kernels.gemm_bf16_argmax(x, panels, n), kernels.gemm_bf16(x, panels, None, n).argmax(dim=-1))
    weight[:, n - 1] = weight[:, 40] = weight[:, 33]  # equal columns in different panels: the lowest wins
    x[:] = weight[:, 33]
    assert kernels.gemm_bf16_argmax(x, kernels.pack_bf16(weight), n).tolist() == [33] * rows


@needs_bf16_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_on_tritones_kernel_equals_mm(bias):
    gen = torch.Generator().manual_seed(3)
    layer = llama.Linear(50, 83, bias, torch.bfloat16)
    torch.nn.init.normal_(layer.weight, generator=gen)
    if bias:
        torch.nn.init.normal_(layer.bias, generator=gen)
    x = torch.randn(9, 50, generator=gen).bfloat16()
    want = layer(x)
    layer.prepack("tritone")
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def top_k_ids(logits: torch.Tensor, k: int = 5) -> list[int]:
    return logits.topk(k).indices.tolist()


def assert_greedy_close(hf, prompt_ids, got):
    """vLLM's check_logprobs_close: the greedy sequences may part where bf16 rounding flips a
    near-tie, but at the first step where they differ, each token is in the other's top 5."""
    for prompt, ours in zip(prompt_ids, got):
        theirs = hf_greedy(hf, prompt)
        assert len(ours) == len(theirs)
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                with torch.inference_mode():
                    logits = hf(torch.tensor([prompt + theirs[:step]])).logits[0, -1]
                assert a in top_k_ids(logits), (prompt, step)
                break


@needs_bf16_gemm
def test_native_bf16_forward_is_close_to_hugging_face_bf16(tiny):
    # Prompt chunks of 32 tokens (the 40-token prompt takes two), decodes, several requests a step;
    # the cache holds bf16 keys and values.
    name, path, _ = tiny
    if name == "gemma":
        return
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = prompts()
    engine, got = engine_greedy(path, ids, dtype="bfloat16", forward="native")
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert_greedy_close(hf, ids, got)


class _BothWays:
    """The runner's native forward, each call run with the row work in passes of its own and then
    fused into the kernels (NativeForward's `fused_row_work`), the two results compared bit for bit."""

    def __init__(self, forward):
        self.forward, self.calls = forward, 0

    def __call__(self, *args):
        results = []
        for fused in (0, 1):
            self.forward.model.fused_row_work = fused
            results.append(self.forward(*args))
        assert torch.equal(results[0], results[1]), f"call {self.calls}"
        self.calls += 1
        return results[1]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_gemm)])
@pytest.mark.parametrize("intermediate", [128, 72])
def test_native_row_work_fused_into_the_kernels_gives_the_same_bits(tmp_path, dtype, intermediate):
    # SiLU(gate) * up applied by the gate_up GEMM as it goes, and the attention's output rounded
    # to bf16 by the attention: the same logits, bit for bit, as those steps in passes of their own,
    # over prompt chunks, decodes and several requests a step. An intermediate size of 72 is not
    # whole panels of the GEMM (16 or 32 columns), so the gate_up GEMM takes the passes there.
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "intermediate_size": intermediate})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype=dtype, kv_cache_bytes=8 << 20, block_size=4,
                                    max_num_batched_tokens=24, forward="native"))
    forward = engine.runner.native
    assert forward.model.fused_row_work == 1  # the default
    both = engine.runner.native = _BothWays(forward)
    for i, ids in enumerate(prompts()):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=6, end_id=-1, return_log_probs=i == 0))
    while engine.has_unfinished_requests():
        engine.step()
    assert both.calls > 5


_NO_COMPILER = """
import json, sys, torch
from tritone.config import EngineConfig
from tritone.engine.core import LLMEngine
from tritone.executor import kernels
from tritone.scheduling.request import SamplingParams
path, prompt = sys.argv[1], json.loads(sys.argv[2])
report = {"library": kernels.native_library() is not None}
for attention in ("cpu-native", "auto"):
    try:
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                                        max_num_batched_tokens=32, attention=attention))
    except ValueError as exc:
        report[attention] = str(exc)
        continue
    engine.add_request("0", prompt, SamplingParams(max_tokens=%d, end_id=-1))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    report[attention] = tokens
print(json.dumps(report))
""" % MAX_TOKENS


def test_without_a_c_compiler_the_engine_runs_on_torch_and_a_native_flag_says_why(tmp_path):
    _, path, model = build_tiny("qwen2", tmp_path / "qwen2")
    prompt = prompts(1)[0]
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "TRITONE_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _NO_COMPILER, str(path), str(prompt)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["library"] is False
    assert "--attention cpu-native" in report["cpu-native"] and "no C compiler" in report["cpu-native"]
    assert report["auto"] == hf_greedy(model, prompt)
