"""The executor on a CUDA device, in one prepared run (a few minutes):

1. greedy parity: the default model in fp32 on the GPU through Tritone's engine against Hugging
   Face `generate` on the same device, token for token, for a few prompts batched together, with
   the attention chosen at start and CUDA graphs, then with the Triton kernel named, then eager;
2. decode-step time of a Llama-3-8B-shaped model (random weights, bf16, the default model's
   vocabulary so that its tokenizer serves it) at batch 1, 64 and 256 with 512 tokens of context
   each, in-process, replayed from CUDA graphs and eagerly;
3. that model served: scripts/benchmark at concurrency 1 and 256 (output tok/s, latencies and
   forward-busy), unless --no-serve;
4. where two GPUs or more are visible (it says so where not): tensor parallelism at 2 (the
   default model's greedy tokens at TP=2 against TP=1 on the GPUs, NCCL; the 8B-shaped model's
   decode-step time at TP=2 against TP=1, through the worker processes) and data parallelism at
   2 (the 8B-shaped model served at concurrency 256, DP=2 against DP=1), unless --no-serve.

It has not yet run on a GPU: no GPU was available where it was written. Report its output.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def parity(max_tokens: int) -> dict[str, bool]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine
    from tritone.checkpoints import prepare_default_model
    from tritone.scheduling.request import SamplingParams

    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    ids = [tokenizer(p).input_ids for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    refs = []
    for p in ids:
        with torch.inference_mode():
            refs.append(hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist())
    del hf
    results = {}
    for label, overrides in (("auto", {}), ("triton", {"attention": "triton"}), ("eager", {"cuda_graphs": "off"})):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 30,
                                        **overrides))
        graphs = engine.runner.graphs
        print(f"parity [{label}]: attention {engine.runner.attention.name}, CUDA graphs "
              f"{'%d sizes in %.1f s' % (len(graphs.sizes), graphs.capture_seconds) if graphs else 'off'}", flush=True)
        for i, p in enumerate(ids):
            engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, end_id=-1))
        got = {str(i): [] for i in range(len(ids))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        same = [refs[i] == got[str(i)] for i in range(len(ids))]
        results[label] = all(same)
        print(f"parity [{label}]: " + ", ".join(f"prompt {i} {'equal' if s else 'DIFFERENT'}"
                                                for i, s in enumerate(same)), flush=True)
        del engine
        torch.cuda.empty_cache()
    return results


def build_8b_shaped(path: pathlib.Path) -> None:
    """Random bf16 weights in Llama-3-8B's shape, with the default model's tokenizer and vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritone.checkpoints import prepare_default_model

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=49152, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=1,
                         eos_token_id=2)
    with torch.device("cuda"):
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    default = prepare_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (default / name).exists():
            shutil.copy(default / name, path / name)
    torch.cuda.empty_cache()


def step_times(model_dir: pathlib.Path, batches: list[int], context: int) -> dict[str, dict[int, float]]:
    from tritone.config import EngineConfig
    from tritone.executor import ModelRunner
    from tritone.executor.step import StepInput

    runner = ModelRunner(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", kv_cache_fraction=0.5,
                                      max_num_seqs=max(batches)))
    graphs = runner.graphs
    print(f"8B-shaped: attention {runner.attention.name}, CUDA graphs "
          f"{'%d sizes in %.1f s' % (len(graphs.sizes), graphs.capture_seconds) if graphs else 'off'}", flush=True)
    times = {"graphs": {}, "eager": {}}
    for batch in batches:
        bs = runner.block_size
        blocks = -(-context // bs)
        tables = (np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) % runner.num_blocks)
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
            times[mode][batch] = (time.perf_counter() - t0) / 10
            print(f"decode step, batch {batch}, context {context}, {mode}: {1000 * times[mode][batch]:.2f} ms "
                  f"({batch / times[mode][batch]:.0f} tok/s)", flush=True)
    del runner
    torch.cuda.empty_cache()
    return times


def serve(model_dir: pathlib.Path, json_path: pathlib.Path, concurrency=("1", "256"), extra: str = "") -> dict:
    """scripts/benchmark against the 8B-shaped model served on the GPU: its own report, printed."""
    cmd = [str(ROOT / "scripts" / "benchmark"), "--model", str(model_dir), "--concurrency", *concurrency,
           "--hf-batches", "--dtype", "bfloat16", "--output-len", "128", "--json", str(json_path),
           "--server-args", f"--device cuda --max-num-seqs 256 --openai-port 0 {extra}".strip()]
    print("served: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(json_path.read_text())["tritone"]


def tp_parity(max_tokens: int) -> bool:
    """The default model's greedy tokens in fp32 at TP=2 against TP=1, batched, on the GPUs."""
    from tritone.config import EngineConfig
    from tritone.engine.core import LLMEngine
    from tritone.checkpoints import prepare_default_model
    from tritone.scheduling.request import SamplingParams

    model_dir = prepare_default_model()
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 140)), [42] * 7]
    got = {}
    for tp in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 30,
                                        tensor_parallel_size=tp))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, end_id=-1))
        out = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        got[tp] = out
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    same = got[1] == got[2]
    print(f"TP=2 parity: greedy tokens {'equal to' if same else 'DIFFERENT from'} TP=1", flush=True)
    return same


def tp_step_times(model_dir: pathlib.Path, batches: list[int], context: int) -> dict[int, dict[int, float]]:
    """Decode-step time of the model at TP=1 and TP=2, each through the worker processes (the step
    sent to every rank, the greedy tokens back), so that the two differ only by the split."""
    from tritone.config import EngineConfig
    from tritone.executor.multiproc import RemoteRunner
    from tritone.executor.step import StepInput

    times = {}
    for tp in (1, 2):
        # data_parallel_size 2 at TP=1 puts the model in a worker too; only engine 0 is built.
        runner = RemoteRunner(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                                           kv_cache_fraction=0.5, max_num_seqs=max(batches), tensor_parallel_size=tp,
                                           data_parallel_size=2 if tp == 1 else 1))
        times[tp] = {}
        for batch in batches:
            bs = runner.block_size
            blocks = -(-context // bs)
            tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) % runner.num_blocks
            slots = tables[:, (context - 1) // bs].astype(np.int64) * bs + (context - 1) % bs
            step = StepInput(np.zeros(batch, np.int64), np.full(batch, context - 1, np.int64), slots, tables,
                             np.arange(batch + 1, dtype=np.int32), np.full(batch, context, np.int32),
                             np.arange(batch), batch)
            runner.execute(step, greedy=True)
            t0 = time.perf_counter()
            for _ in range(10):
                runner.execute(step, greedy=True)
            times[tp][batch] = (time.perf_counter() - t0) / 10
            print(f"TP={tp} decode step, batch {batch}, context {context}: {1000 * times[tp][batch]:.2f} ms", flush=True)
        runner.shutdown()
    return times


def multi_gpu(args, model_dir: pathlib.Path, tmp: str) -> dict:
    count = torch.cuda.device_count()
    if count < 2:
        print(f"multi-GPU part: skipped, {count} GPU visible (tensor and data parallelism need 2)", flush=True)
        return {"skipped": f"{count} GPU visible"}
    figures = {"tp_parity": tp_parity(args.max_tokens),
               "tp_step_seconds": tp_step_times(model_dir, args.batches, args.context)}
    if not args.no_serve:
        figures["dp_served"] = {dp: serve(model_dir, pathlib.Path(tmp) / f"dp{dp}.json", ("256",),
                                          f"--data-parallel-size {dp}") for dp in (1, 2)}
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--no-serve", action="store_true", help="skip the served benchmark")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    figures = {"parity": parity(args.max_tokens)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(tmp) / "llama-8b-shaped"
        build_8b_shaped(model_dir)
        figures["step_seconds"] = step_times(model_dir, args.batches, args.context)
        if not args.no_serve:
            figures["served"] = serve(model_dir, pathlib.Path(tmp) / "served.json")
        figures["multi_gpu"] = multi_gpu(args, model_dir, tmp)
    print(f"gpu_check done in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0 if all(figures["parity"].values()) and figures["multi_gpu"].get("tp_parity", True) else 1


if __name__ == "__main__":
    sys.exit(main())
