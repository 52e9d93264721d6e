"""The CUDA path, checked section by section on whatever GPU machine is at hand.

Runs from the checkout with the machine's own Python (torch with CUDA, transformers, pytest; no
virtual environment, no pip, no tritonserver, no download): models are built in memory or from a
config.json with random weights. Each section runs in a process of its own under a time limit, so
that a CUDA error or a hang in one leaves the others to run, and prints one line:
`PASS|FAIL|SKIPPED section: figures`. Without a GPU every section says SKIPPED and the check exits 0.

Sections: versions and memory; the CUDA tests (pytest); placement (every tensor of a model on the
GPU asked for, and that GPU current); a tiny Llama's greedy tokens against Hugging Face's, with
CUDA graphs and async scheduling on and off; each attention kernel against SDPA and the GB/s it
reads the KV cache at; an 8B-shaped bf16 model (memory, KV blocks, capture time, decode ms at
batch 1/64/256 with graphs and eagerly, prefill ms); sampled decoding and the device syncs per
step; tensor parallelism (skipped on one GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("versions", "tests", "placement", "parity", "attention", "model_8b", "sampling", "tensor_parallel")
# Seconds per section, well inside a GPU machine's few minutes in all.
LIMITS = {"versions": 30, "tests": 150, "placement": 60, "parity": 120, "attention": 60, "model_8b": 180,
          "sampling": 90, "tensor_parallel": 120}


class Skip(Exception):
    """The section cannot run here: its reason is printed."""


def _cuda():
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed for this Python") from None

    if not torch.cuda.is_available():
        raise Skip("no CUDA device visible to torch")
    return torch


def versions() -> dict:
    torch = _cuda()
    free, total = torch.cuda.mem_get_info()
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
           "device": torch.cuda.get_device_name(), "memory_gb": round(total / 2**30, 1),
           "free_gb": round(free / 2**30, 1)}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "missing"
    return out


def tests() -> dict:
    _cuda()
    files = [str(ROOT / "tests" / name) for name in ("test_cuda_path.py", "test_gpu_path.py", "test_attention.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT,
                         capture_output=True, text=True, timeout=LIMITS["tests"] - 10)
    summary = (run.stdout.strip().splitlines() or ["no output"])[-1]
    if run.returncode:
        raise AssertionError(summary + "\n" + run.stdout[-3000:])
    return {"pytest": summary}


def _tiny_llama(path: pathlib.Path, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, architectures=["LlamaForCausalLM"], **overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def placement() -> dict:
    torch = _cuda()
    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine

    index = torch.cuda.device_count() - 1
    with tempfile.TemporaryDirectory() as tmp:
        _tiny_llama(pathlib.Path(tmp))
        engine = LLMEngine(EngineConfig(model=tmp, device=f"cuda:{index}", dtype="float32", kv_cache_bytes=64 << 20,
                                        cuda_graphs="off"))
        runner = engine.runner
        wrong = [n for n, t in [*runner.model.named_parameters(), *runner.model.named_buffers()]
                 if t.device != torch.device(f"cuda:{index}") and not n.endswith("layer_idx")]
        caches = {str(k.device) for k, _ in runner.kv_caches}
        assert not wrong, f"tensors off cuda:{index}: {wrong[:5]}"
        assert caches == {f"cuda:{index}"}, f"KV cache on {caches}"
        assert torch.cuda.current_device() == index, f"current device {torch.cuda.current_device()}, not {index}"
        engine.shutdown()
    return {"device": f"cuda:{index}"}


def _greedy(engine, prompts, max_tokens):
    from tritone.scheduling.request import SamplingParams

    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, end_id=-1))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def parity(max_tokens: int = 24) -> dict:
    torch = _cuda()
    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine

    prompts = [[1, 5, 9, 300], list(range(3, 60)), [7] * 20]
    with tempfile.TemporaryDirectory() as tmp:
        hf = _tiny_llama(pathlib.Path(tmp)).cuda()
        want = []
        for ids in prompts:
            with torch.inference_mode():
                out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False)
            want.append(out[0, len(ids):].tolist())
        del hf
        figures = {}
        for graphs in ("auto", "off"):
            for overlap in ("on", "off"):
                engine = LLMEngine(EngineConfig(model=tmp, device="cuda", dtype="float32", kv_cache_bytes=64 << 20,
                                                cuda_graphs=graphs, async_scheduling=overlap))
                got = _greedy(engine, prompts, max_tokens)
                name = f"graphs-{graphs}/async-{overlap}/{engine.runner.attention.name}"
                figures[name] = got == want
                engine.shutdown()
        assert all(figures.values()), f"greedy tokens differ from Hugging Face's: {figures}"
    return figures


def attention() -> dict:
    torch = _cuda()
    from tritone.executor import attention as attn

    figures = {}
    for backend in (attn.TritonPagedAttention(), attn.FlashVarlenAttention()):
        block = 256 if backend.name == "flash-varlen" else 16
        try:
            problem = attn.probe(backend, torch.device("cuda"), torch.bfloat16, 32, 8, 128, block)
        except Exception as exc:  # a kernel that cannot run here is a finding, not the end of the check
            problem = f"{type(exc).__name__}: {exc}"
        figures[backend.name] = "agrees with SDPA" if problem is None else problem
        if problem is None:
            figures[f"{backend.name} GB/s"] = _attention_bandwidth(backend, block)
    assert any(v == "agrees with SDPA" for v in figures.values()), figures
    return figures


def _attention_bandwidth(backend, block: int, batch: int = 64, context: int = 2048) -> float:
    """GB/s of KV cache read by a decode batch (8 KV heads of 128, bf16)."""
    import torch
    from tritone.executor.attention import AttentionMetadata

    blocks = batch * (context // block)
    k = torch.randn(blocks * block + 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(slot_mapping=None, block_tables=tables, query_start=query_start, seq_lens=seq_lens,
                             query_start_list=list(range(batch + 1)), seq_lens_list=[context] * batch,
                             num_decodes=batch, block_size=block, max_query_len=1, max_seq_len=context)
    for _ in range(3):
        backend.forward(q, k, v, meta, 128 ** -0.5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        backend.forward(q, k, v, meta, 128 ** -0.5)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / 20
    return round(2 * k.element_size() * batch * context * 8 * 128 / seconds / 1e9, 1)


def _llama_8b(path: pathlib.Path) -> None:
    """Llama-3-8B's config.json alone: the engine fills random weights (load_format dummy)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                architectures=["LlamaForCausalLM"]).save_pretrained(path)


def model_8b(batches=(1, 64, 256), context: int = 512) -> dict:
    torch = _cuda()
    import numpy as np
    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine
    from tritone.executor.step import StepInput

    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        _llama_8b(pathlib.Path(tmp))
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=tmp, device="cuda", dtype="bfloat16", load_format="dummy",
                                        max_num_seqs=max(batches)))
        runner = engine.runner
        figures["start_s"] = round(time.perf_counter() - t0, 1)
        figures["memory_gb"] = round(torch.cuda.memory_allocated() / 2**30, 1)
        figures["kv_blocks"] = runner.num_blocks
        graphs = runner.graphs
        figures["capture_s"] = round(graphs.capture_seconds, 1) if graphs else None
        for batch in batches:
            bs = runner.block_size
            blocks = -(-context // bs)
            tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) % runner.num_blocks
            step = StepInput(np.zeros(batch, np.int64), np.full(batch, context - 1, np.int64),
                             np.full(batch, runner.spare_slot, np.int64), tables, np.arange(batch + 1, dtype=np.int32),
                             np.full(batch, context, np.int32), np.arange(batch), batch)
            for mode in ("graphs", "eager") if graphs else ("eager",):
                runner.graphs = graphs if mode == "graphs" else None
                runner._forward(step)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    runner._forward(step)
                torch.cuda.synchronize()
                figures[f"decode_ms_b{batch}_{mode}"] = round(1000 * (time.perf_counter() - t0) / 10, 2)
            runner.graphs = graphs
        prompt = 2048
        step = StepInput(np.zeros(prompt, np.int64), np.arange(prompt, dtype=np.int64),
                         np.full(prompt, runner.spare_slot, np.int64),
                         np.arange(prompt // runner.block_size, dtype=np.int32)[None, :] % runner.num_blocks,
                         np.array([0, prompt], np.int32), np.array([prompt], np.int32), np.array([prompt - 1]), 0)
        runner._forward(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner._forward(step)
        torch.cuda.synchronize()
        figures["prefill_ms_2048"] = round(1000 * (time.perf_counter() - t0), 1)
        engine.shutdown()
    return figures


def sampling(steps: int = 20) -> dict:
    torch = _cuda()
    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine
    from tritone.scheduling.request import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        _tiny_llama(pathlib.Path(tmp))
        engine = LLMEngine(EngineConfig(model=tmp, device="cuda", dtype="float32", kv_cache_bytes=64 << 20))
        for i in range(8):
            engine.add_request(str(i), [1, 2, 3, i + 4], SamplingParams(max_tokens=steps + 10, temperature=0.8,
                                                                        top_p=0.9, top_k=50, seed=i, end_id=-1))
        for _ in range(3):
            engine.step()
        syncs = 0
        torch.cuda.set_sync_debug_mode("warn")
        try:
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    engine.step()
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.shutdown()
    return {"syncs_per_step": round(syncs / steps, 2)}


def tensor_parallel() -> dict:
    torch = _cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU visible; tensor parallelism needs 2")
    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine

    prompts = [[1, 5, 9, 300], list(range(3, 60))]
    with tempfile.TemporaryDirectory() as tmp:
        _tiny_llama(pathlib.Path(tmp))
        got = {}
        for tp in (1, 2):
            engine = LLMEngine(EngineConfig(model=tmp, device="cuda", dtype="float32", kv_cache_bytes=64 << 20,
                                            tensor_parallel_size=tp))
            got[tp] = _greedy(engine, prompts, 16)
            engine.shutdown()
    assert got[1] == got[2], "greedy tokens at TP=2 differ from TP=1"
    return {"tp2_equals_tp1": True}


def run_section(name: str) -> int:
    """In the section's own process: prints one JSON line, {"status", "figures" | "reason"}."""
    sys.path[:0] = [str(ROOT / "backends"), str(ROOT / "client")]
    os.environ.setdefault("TRITONE_CACHE", tempfile.mkdtemp(prefix="tritone-gpu-check-"))
    try:
        result = {"status": "PASS", "figures": globals()[name]()}
    except Skip as skip:
        result = {"status": "SKIPPED", "reason": str(skip)}
    except Exception as exc:
        result = {"status": "FAIL", "reason": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    print("\n" + json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"sections to run (default all): {', '.join(SECTIONS)}")
    p.add_argument("--json", help="write every section's result here")
    p.add_argument("--section", help=argparse.SUPPRESS)  # a section's own process
    args = p.parse_args(argv)
    if args.section:
        return run_section(args.section)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"no section {', '.join(sorted(unknown))} (sections: {', '.join(SECTIONS)})")
    results, t0 = {}, time.perf_counter()
    for name in args.sections or SECTIONS:
        started = time.perf_counter()
        try:
            run = subprocess.run([sys.executable, __file__, "--section", name], capture_output=True, text=True,
                                 timeout=LIMITS[name], cwd=ROOT)
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            result = json.loads(lines[-1]) if lines else {
                "status": "FAIL", "reason": f"exit {run.returncode}: {(run.stderr or run.stdout)[-1500:]}"}
        except subprocess.TimeoutExpired:
            result = {"status": "FAIL", "reason": f"over its {LIMITS[name]} s"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = result
        detail = json.dumps(result["figures"]) if "figures" in result else result["reason"]
        print(f"{result['status']} {name} ({result['seconds']} s): {detail}", flush=True)
    print(f"gpu_check: {sum(r['status'] == 'PASS' for r in results.values())} passed, "
          f"{sum(r['status'] == 'FAIL' for r in results.values())} failed, "
          f"{sum(r['status'] == 'SKIPPED' for r in results.values())} skipped in {time.perf_counter() - t0:.0f} s",
          flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
