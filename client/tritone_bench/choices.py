"""What n choices cost against n separate requests: `python -m tritone_bench.choices`.

Starts a server (or uses `--url`, a running tritone-openai), then for each round sends one
completion with `n` choices and, apart, `n` single completions at once, same prompt and lengths,
and reports each form's wall time and the prompt tokens the engine computed for it (its
`tritone_prompt_tokens` counter; a prefix-cache hit is not computed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time


def prompt_tokens_computed(metrics_url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tritone_prompt_tokens_total"):
                return float(line.split()[-1])
    return float("nan")


def measure(client, model: str, metrics_url: str, prompt: str, n: int, max_tokens: int, together: bool) -> tuple:
    before, t0 = prompt_tokens_computed(metrics_url), time.perf_counter()
    kwargs = dict(model=model, max_tokens=max_tokens, temperature=1.0, extra_body={"ignore_eos": True})
    if together:
        answer = client.completions.create(prompt=prompt, n=n, **kwargs)
        assert len(answer.choices) == n
    else:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda _: client.completions.create(prompt=prompt, **kwargs), range(n)))
    seconds = time.perf_counter() - t0
    time.sleep(2.5)  # the engine reports its counters once a second
    return seconds, prompt_tokens_computed(metrics_url) - before


def main(argv: list[str] | None = None) -> int:
    import openai

    p = argparse.ArgumentParser(prog="python -m tritone_bench.choices", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=400, help="words of the prompt (default 400)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-args", default="", help="extra scripts/serve options, quoted")
    args = p.parse_args(argv)
    from tritone.launcher import temporary_server
    from tritone.processes import free_port
    from tritone_bench.results import RUNS

    prompt_base = " ".join(f"word{i % 97}" for i in range(args.prompt_words))
    RUNS.mkdir(parents=True, exist_ok=True)
    with temporary_server(RUNS / "choices-server.log", "--openai-port", str(free_port()), *args.server_args.split()) as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0, timeout=600)
        metrics_url = f"http://{server.args.host}:{server.args.metrics_port}/metrics"
        model = server.model_dir.name
        for r in range(args.rounds):
            for together in (True, False):
                # A prompt of its own each time, so that neither form finds the other's blocks.
                prompt = f"Round {r}, {'together' if together else 'apart'}: {prompt_base}"
                seconds, computed = measure(client, model, metrics_url, prompt, args.n, args.max_tokens, together)
                form = f"n={args.n}" if together else f"{args.n} requests"
                print(f"round {r}, {form}: {seconds:.2f} s, {computed:.0f} prompt tokens computed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
