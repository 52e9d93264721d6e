"""tritone-openai: OpenAI's completions and chat API in front of the `ensemble`, as a process of
its own (so the engine's process does no HTTP work). `tritone-openai --help`.

The layout: `routes` (the HTTP API) over `backend` (tritonserver over gRPC), with `protocol` and
`guides` (request bodies and what they become as ensemble inputs), `formats` (response bodies),
`errors` (what a client is told), `tools` (tool calls) and `guard` (the key and the body's size).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tritone.config import parse_lora_modules
from tritone.openai.guard import DEFAULT_MAX_BODY_BYTES
from tritone.openai.routes import OpenAIServer
from tritone.openai.tools import PARSERS
from tritone.text import reasoning


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritone-openai",
                                description="OpenAI-compatible API (completions, chat) in front of Tritone's ensemble.")
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address (default 127.0.0.1:8001)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind to (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model-name", default="ensemble",
                   help="the model name clients send and /v1/models lists (scripts/serve: the model directory's name)")
    p.add_argument("--api-key", default=os.environ.get("TRITONE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TRITONE_API_KEY; none: open)")
    p.add_argument("--tool-call-parser", default="hermes", choices=PARSERS,
                   help="the model's tool-call syntax (default hermes: <tool_call> blocks, as Qwen 2.5 / 3 write "
                        "them; llama3_json: Llama 3.x JSON); scripts/serve picks it from the chat template")
    p.add_argument("--reasoning-parser", default=None, choices=reasoning.PARSERS,
                   help="the model's thinking syntax (deepseek_r1: the chat template opens <think>; qwen3: the model "
                        "opens it, or does not think): chat answers carry the thinking as reasoning_content, apart "
                        "from the content (default none: the whole text is content)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"refuse a request body larger than this with 413, before reading it "
                        f"(default {DEFAULT_MAX_BODY_BYTES}: 4 MiB)")
    p.add_argument("--lora-modules", default="",
                   help="the server's LoRA adapters as name=path,name=path (scripts/serve's --lora-modules): a request "
                        "whose model is an adapter's name gets that adapter (the ensemble's lora_task_id)")
    p.add_argument("--pipeline", default="ensemble", choices=["ensemble", "inline"],
                   help="what serves the model 'ensemble' (scripts/serve passes its --pipeline): ensemble, whose "
                        "engine Triton does not tell of a dropped stream (server issue #6739), so an abort request "
                        "goes to the llm model; inline, the engine's own model, which sees the stream dropped")
    p.add_argument("--log-level", default="warning")
    return p


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="tritone-openai: %(message)s")
    # The control key by environment only, out of the process list.
    server = OpenAIServer(args.grpc_url, args.model_name, args.api_key, args.tool_call_parser,
                          max_body_bytes=args.max_body_bytes, reasoning_parser=args.reasoning_parser,
                          control_key=os.environ.get("TRITONE_CONTROL_KEY") or None,
                          sends_aborts=args.pipeline == "ensemble",
                          adapters=[name for name, _ in parse_lora_modules(args.lora_modules)])
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
