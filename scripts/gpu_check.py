"""The executor on a CUDA device, in one short run (a few minutes):

1. greedy parity: the default model in fp32 on the GPU through Tritone's engine against Hugging
   Face `generate` on the same device, token for token, for a few prompts batched together;
2. decode-step time of a Llama-3-8B-shaped model (random weights, bf16, built in memory) at
   batch 1, 64 and 256 with 512 tokens of context each, in-process.

It has not yet run on a GPU: no GPU was available where it was written. Report its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np
import torch


def parity(max_tokens: int) -> bool:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tritone.config import EngineConfig
    from tritone.engine import LLMEngine
    from tritone.models import prepare_default_model
    from tritone.request import SamplingParams

    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    ids = [tokenizer(p).input_ids for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 30))
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, end_id=-1))
    got = {str(i): [] for i in range(len(ids))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ok = True
    for i, p in enumerate(ids):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
        same = ref == got[str(i)]
        ok &= same
        print(f"parity prompt {i}: {'equal' if same else 'DIFFERENT'}", flush=True)
    return ok


def step_times(batches: list[int], context: int) -> dict[int, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritone.config import EngineConfig
    from tritone.executor import ModelRunner

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with tempfile.TemporaryDirectory() as tmp:
        with torch.device("cuda"):
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        torch.cuda.empty_cache()
        runner = ModelRunner(EngineConfig(model=tmp, device="cuda", dtype="bfloat16", kv_cache_fraction=0.5))
    times = {}
    for batch in batches:
        bs = runner.block_size
        blocks = -(-context // bs)
        tables = (np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) % runner.num_blocks)
        args = (np.zeros(batch, np.int64), np.full(batch, context - 1, np.int64),
                np.full(batch, runner.spare_slot, np.int64), tables, np.arange(batch + 1, dtype=np.int32),
                np.full(batch, context, np.int32), np.arange(batch), batch)
        runner._forward(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            runner._forward(*args)
        torch.cuda.synchronize()
        times[batch] = (time.perf_counter() - t0) / 10
        print(f"decode step, batch {batch}, context {context}: {1000 * times[batch]:.1f} ms "
              f"({batch / times[batch]:.0f} tok/s)", flush=True)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ok = parity(args.max_tokens)
    times = step_times(args.batches, args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parity": ok, "step_seconds": times}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
