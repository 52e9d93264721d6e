"""`python -m tritone.launcher` (what `scripts/serve` runs): serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import time

from tritone.launcher.options import build_parser
from tritone.launcher.server import Server


def _print_usage(server: Server) -> None:
    a = server.args
    print(f"""
Tritone is serving {server.model_dir.name} as model "ensemble".
  curl -s -X POST http://{a.host}:{a.http_port}/v2/models/ensemble/generate \\
       -d '{{"text_input": "What is the capital of France?", "max_tokens": 24}}'
  curl -s -N -X POST http://{a.host}:{a.http_port}/v2/models/ensemble/generate_stream \\
       -d '{{"text_input": "What is the capital of France?", "max_tokens": 24, "stream": true}}'
  tritone-client generate --url {a.host}:{a.grpc_port} "What is the capital of France?"
Metrics: http://{a.host}:{a.metrics_port}/metrics    Stop: Ctrl-C
""", flush=True)
    if server.openai_url:
        key = "$TRITONE_API_KEY" if a.api_key else "none"
        print(f"""OpenAI-compatible API: {server.openai_url} (model "{server.model_dir.name}")
  curl -s {server.openai_url}/chat/completions -H "Authorization: Bearer {key}" -H 'Content-Type: application/json' \\
       -d '{{"model": "{server.model_dir.name}", "messages": [{{"role": "user", "content": "Hi!"}}], "max_tokens": 24}}'
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.api_key = args.api_key or os.environ.get("TRITONE_API_KEY")
    server = Server(args)
    started = time.monotonic()
    try:
        server.start()
    except ValueError as exc:  # an option that cannot be honoured, named in the message
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C or SIGTERM: new requests are refused, those in flight finish (up to the exit
    # timeout), then tritonserver exits; a second Ctrl-C cuts the wait short.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    print(f"Ready in {time.monotonic() - started:.1f} s.", flush=True)
    _print_usage(server)
    return server.supervise()


if __name__ == "__main__":
    sys.exit(main())
