"""Soak: a mix of requests for --minutes against a real server, watching errors and memory.

Each worker loops over random requests: gRPC streamed and not, HTTP generate, streams it
cancels after a few chunks, and (now and then) a bad request that must fail. It reports requests
done, unexpected errors apart from the expected ones (cancellations, refused bad input), the
resident memory of tritonserver and its model processes over time, and whether the KV cache is
idle at the end. Run it with scripts/soak.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import tritonclient.grpc as grpcclient

from tritone.launcher import temporary_server
from tritone_bench.metrics import ServerMetrics
from tritone_bench.results import RUNS
from tritone_client import infer_inputs

PROMPTS = ["The quick brown fox", "Write a haiku about the sea.", "def fibonacci(n):\n    ",
           "Explain why the sky is blue.", "1, 2, 3, 4, 5,", "What is the capital of France?",
           "List three uses of copper and explain each one in a sentence or two. " * 3,
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


def rss_kib(root_pid: int) -> int:
    """Resident memory of a process and its children (tritonserver and its model stubs)."""
    pids = {root_pid}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == root_pid:
                pids.add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    total = 0
    for pid in pids:
        try:
            for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def inputs_for(prompt, max_tokens, stream, **extra):
    tensors = [("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
               ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
               ("stream", np.array([[stream]]), "BOOL")]
    tensors += [(name, np.array([[value]], dtype=np.float32), "FP32") for name, value in extra.items()]
    return infer_inputs(grpcclient, tensors)


class Soak:
    def __init__(self, grpc_url: str, http_url: str, deadline: float, seed: int):
        self.grpc_url, self.http_url, self.deadline = grpc_url, http_url, deadline
        self.counts: Counter = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.seed = seed

    def count(self, kind: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if error is not None:
                self.unexpected.append(f"{kind}: {error}")

    def worker(self, index: int) -> None:
        rng = random.Random(self.seed + index)
        client = grpcclient.InferenceServerClient(self.grpc_url)
        while time.monotonic() < self.deadline:
            kind = rng.choices(["grpc-stream", "grpc", "http", "cancel", "bad"], [40, 20, 20, 15, 5])[0]
            prompt, max_tokens = rng.choice(PROMPTS), rng.choice([1, 8, 32, 64, 128])
            try:
                getattr(self, kind.replace("-", "_"))(client, rng, prompt, max_tokens)
            except Exception as exc:  # noqa: BLE001 - anything unplanned is what a soak looks for
                self.count(kind, repr(exc))
        client.close()

    def _stream(self, client, inputs, cancel_after: int | None = None):
        responses, errors, done = [], [], threading.Event()

        def on_response(result, error):
            (errors if error else responses).append(error or result)
            if error or result.as_numpy("finish_reason") is not None:
                done.set()
        client.start_stream(callback=on_response)
        client.async_stream_infer("ensemble", inputs)
        if cancel_after is not None:
            while len(responses) < cancel_after and not done.wait(0.01):
                pass
            client.stop_stream(cancel_requests=True)
        else:
            client.stop_stream()
        return responses, errors

    def grpc_stream(self, client, rng, prompt, max_tokens):
        extra = {"temperature": 0.8, "top_p": 0.95} if rng.random() < 0.5 else {}
        responses, errors = self._stream(client, inputs_for(prompt, max_tokens, True, **extra))
        ok = not errors and responses and responses[-1].as_numpy("finish_reason") is not None
        self.count("grpc-stream", None if ok else f"{errors or 'no final response'}")

    def grpc(self, client, rng, prompt, max_tokens):
        responses, errors = self._stream(client, inputs_for(prompt, max_tokens, False))
        self.count("grpc", None if not errors and len(responses) == 1 else f"{errors} {len(responses)} responses")

    def http(self, client, rng, prompt, max_tokens):
        body = json.dumps({"text_input": prompt, "max_tokens": max_tokens}).encode()
        request = urllib.request.Request(f"http://{self.http_url}/v2/models/ensemble/generate", data=body)
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
        self.count("http", None if answer.get("finish_reason") in ("stop", "length") else str(answer))

    def cancel(self, client, rng, prompt, max_tokens):
        responses, errors = self._stream(client, inputs_for(prompt, 128, True), cancel_after=rng.randint(1, 4))
        finished = responses and responses[-1].as_numpy("finish_reason") is not None
        unexpected = [e for e in errors if "cancel" not in str(e).lower()]
        self.count("cancel", f"{unexpected}" if unexpected else None)
        if not unexpected:
            self.count("cancel-finished-first" if finished and not errors else "cancel-cancelled")

    def bad(self, client, rng, prompt, max_tokens):
        responses, errors = self._stream(client, inputs_for(prompt, max_tokens, False, temperature=-1.0))
        self.count("bad", None if len(errors) == 1 and "temperature" in str(errors[0]) and not responses
                   else f"{errors} {len(responses)} responses")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0],
                                epilog="Other options go to the server, as scripts/serve takes them.")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16, help="workers sending requests at once")
    p.add_argument("--sample-seconds", type=float, default=30.0, help="how often memory is reported")
    p.add_argument("--port", type=int, default=19050, help="HTTP port; gRPC and metrics take the next two")
    p.add_argument("--seed", type=int, default=0)
    args, server_args = p.parse_known_args(argv)
    ports = ["--http-port", str(args.port), "--grpc-port", str(args.port + 1), "--metrics-port", str(args.port + 2)]
    RUNS.mkdir(parents=True, exist_ok=True)
    with temporary_server(RUNS / "soak-server.log", *ports, *server_args) as server:
        return run(args, server)


def run(args, server) -> int:
    a = server.args
    start = time.monotonic()
    soak = Soak(f"{a.host}:{a.grpc_port}", f"{a.host}:{a.http_port}", start + args.minutes * 60, args.seed)
    workers = [threading.Thread(target=soak.worker, args=(i,), daemon=True) for i in range(args.concurrency)]
    for w in workers:
        w.start()
    samples = []
    print(f"{'minute':>7} {'requests':>9} {'unexpected':>10} {'rss MiB':>8}", flush=True)
    while any(w.is_alive() for w in workers):
        time.sleep(min(args.sample_seconds, max(0.1, soak.deadline - time.monotonic() + 0.5)))
        rss = rss_kib(server.process.pid) / 1024
        samples.append(rss)
        done = sum(v for k, v in soak.counts.items() if not k.startswith("cancel-"))
        print(f"{(time.monotonic() - start) / 60:7.1f} {done:9d} {len(soak.unexpected):10d} {rss:8.0f}", flush=True)
    for w in workers:
        w.join()
    time.sleep(3)  # the engine reports its metrics once a second
    deadline = time.monotonic() + 120  # cancelled ensemble streams run on to their max_tokens
    while True:
        values = ServerMetrics.of(server).read()
        if values["tritone_kv_blocks_used"] == 0 and values["tritone_num_requests_running"] == 0 \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    done = sum(v for k, v in soak.counts.items() if not k.startswith("cancel-"))
    print(f"\nrequests done: {done} in {args.minutes:g} min ({dict(sorted(soak.counts.items()))})")
    print(f"expected errors: {soak.counts['cancel-cancelled']} cancellations, {soak.counts['bad']} refused bad inputs")
    print(f"unexpected errors: {len(soak.unexpected)}")
    for line in soak.unexpected[:20]:
        print("  " + line)
    print(f"server RSS (tritonserver + model processes): first sample {samples[0]:.0f} MiB, "
          f"last {samples[-1]:.0f} MiB, max {max(samples):.0f} MiB")
    print(f"at the end: KV blocks used {values['tritone_kv_blocks_used']:.0f}, "
          f"requests running {values['tritone_num_requests_running']:.0f}, "
          f"preemptions {values['tritone_preemptions_total']:.0f}")
    return 1 if soak.unexpected or values["tritone_kv_blocks_used"] else 0


if __name__ == "__main__":
    sys.exit(main())
