"""The streams a benchmark sends, one class per protocol, each filling a `stats.Record` the same way.

A sender is an async context manager (it opens its connection inside the load's event loop)
that yields `send(record, text)`: one streamed request, end of sequence ignored, with the
arrival time and output-token count of each response written into `record`.
"""

from __future__ import annotations

import itertools
import json
import time

import numpy as np

from tritone_bench.stats import Record
from tritone_client import infer_inputs


class GrpcStreams:
    """Tritone's `ensemble` (or `llm_inline`) over gRPC streaming; the prompt goes without the
    chat template, so that its length is what the workload says."""

    def __init__(self, url: str, model: str = "ensemble", temperature: float = 0.0, top_p: float = 1.0,
                 schema: dict | None = None, lora_ids: list[int] | None = None):
        """`lora_ids`: LoRA adapters (lora_task_id) the requests take in turn; none: the base model."""
        self.url, self.model, self.schema = url, model, schema
        self.sampling = {"temperature": temperature, "top_p": top_p}
        self.lora_ids = itertools.cycle(lora_ids) if lora_ids else None

    def _inputs(self, grpcaio, text: str, max_tokens: int) -> list:
        tensors = [("text_input", np.array([[text.encode()]], dtype=object)),
                   ("max_tokens", np.array([[max_tokens]], dtype=np.int32)),
                   ("end_id", np.array([[-1]], dtype=np.int32)),
                   ("temperature", np.array([[self.sampling["temperature"]]], dtype=np.float32)),
                   ("top_p", np.array([[self.sampling["top_p"]]], dtype=np.float32)),
                   ("stream", np.array([[True]])),
                   ("apply_chat_template", np.array([[False]]))]
        if self.lora_ids is not None:
            tensors.append(("lora_task_id", np.array([[next(self.lora_ids)]], dtype=np.uint64)))
        if self.schema is not None:
            tensors += [("guided_decoding_guide_type", np.array([[b"json_schema"]], dtype=object)),
                        ("guided_decoding_guide", np.array([[json.dumps(self.schema).encode()]], dtype=object))]
        return infer_inputs(grpcaio, tensors)

    async def __aenter__(self):
        import tritonclient.grpc.aio as grpcaio

        self.client = grpcaio.InferenceServerClient(self.url)

        async def send(record: Record, text: str) -> None:
            inputs = self._inputs(grpcaio, text, record.max_tokens)

            async def requests():
                yield {"model_name": self.model, "inputs": inputs}

            stream = self.client.stream_infer(requests())
            try:
                async for result, error in stream:
                    now = time.perf_counter()
                    if error is not None:
                        record.error, record.end = str(error), now
                        return
                    record.add(now, int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
                    if result.as_numpy("finish_reason") is not None:  # the final response's
                        # Read on until the server ends the stream: leaving it at the last response
                        # cancels the call, and may do so before the ensemble has closed the request.
                        record.end = now
            finally:
                if record.end is None:  # cancelled after the drain timeout: the server aborts it
                    stream.cancel()

        return send

    async def __aexit__(self, *exc) -> None:
        await self.client.close()


class OpenAIStreams:
    """A streamed `/v1/completions` (tritone-openai, or a peer such as vLLM) at `base_url` (ending
    in /v1). Tokens per chunk come from `continuous_usage_stats`, since a server may merge the
    tokens of several steps into one chunk when it falls behind; without usage, each chunk with
    text counts one token. A prompt the server counts otherwise than the workload is an error."""

    def __init__(self, base_url: str, model: str, temperature: float = 0.0, top_p: float = 1.0,
                 extra: dict | None = None):
        self.url, self.model = f"{base_url.rstrip('/')}/completions", model
        self.body = {"temperature": temperature, "top_p": top_p, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **(extra or {})}

    async def __aenter__(self):
        import aiohttp

        # No connection limit but the load's own concurrency; no timeout, as a request at high
        # concurrency on two cores takes minutes.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))

        async def send(record: Record, text: str) -> None:
            body = {"model": self.model, "prompt": text, "max_tokens": record.max_tokens,
                    "min_tokens": record.max_tokens, **self.body}
            async with self.session.post(self.url, json=body) as response:
                if response.status != 200:
                    record.error, record.end = f"{response.status}: {await response.text()}", time.perf_counter()
                    return
                prompt_tokens = None
                async for line in response.content:
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    now, chunk = time.perf_counter(), json.loads(line[5:])
                    usage = chunk.get("usage") or {}
                    prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                    if chunk.get("choices"):  # not the closing usage-only chunk
                        text_seen = bool(chunk["choices"][0].get("text"))
                        record.add(now, usage.get("completion_tokens", record.num_output_tokens + text_seen))
            record.end = time.perf_counter()
            if record.prompt_tokens and prompt_tokens not in (None, record.prompt_tokens):
                record.error = f"the server counted {prompt_tokens} prompt tokens, not {record.prompt_tokens}"

        return send

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
