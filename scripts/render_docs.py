"""Renders benchmark figures into the docs from the JSON the benchmarks wrote, between markers:

    <!-- render: structured scripts/results/structured.json -->
    ... (generated; edits are overwritten)
    <!-- end render -->

`scripts/render_docs` rewrites every marked block of README.md and docs/*.md; `--check` only says
which blocks differ from their JSON (tests/test_docs.py runs it), so no figure is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from tritone_client.machine import describe

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- render: (\S+) (\S+) -->\n)(.*?)(<!-- end render -->)", re.DOTALL)


def structured_table(results: dict) -> str:
    """`scripts/benchmark --structured`: each stack free and with every request under one JSON
    schema, and the first token of a new schema against a cached one."""
    lines = ["| stack | concurrency | free tok/s | JSON schema tok/s | schema / free | first token, new schema (s) "
             "| first token, cached schema (s) |", "|---|---|---|---|---|---|---|"]
    for name, free_key, key, ttft_key in (("Tritone", "tritone", "tritone_structured", "schema_ttft"),
                                          ("vLLM CPU", "peer", "peer_structured", "peer_schema_ttft")):
        ttft = results.get(ttft_key) or {}
        for c, constrained in (results.get(key) or {}).items():
            free = results[free_key][c]
            lines.append(f"| {name} | {c} | {free['output_tokens_per_s']:.1f} | {constrained['output_tokens_per_s']:.1f} "
                         f"| {constrained['output_tokens_per_s'] / free['output_tokens_per_s']:.2f}x "
                         f"| {ttft.get('new_schema_ttft_s', float('nan')):.3f} "
                         f"| {ttft.get('cached_schema_ttft_s', float('nan')):.3f} |")
    tr, peer = results.get("tritone_structured") or {}, results.get("peer_structured") or {}
    ratios = [f"concurrency {c}: {tr[c]['output_tokens_per_s'] / peer[c]['output_tokens_per_s']:.2f}x"
              for c in tr if c in peer]
    if ratios:
        lines += ["", "Tritone / vLLM, every request under the schema: " + ", ".join(ratios) + "."]
    return "\n".join(lines)


RENDERERS = {"structured": structured_table}


def render(name: str, results: dict) -> str:
    config = results.get("config", {})
    head = (f"Measured on a {describe(results['machine'])}" if "machine" in results else "Machine not recorded")
    if config:
        head += (f"; {config.get('prompt_len')}-token prompts, {config.get('output_len')} output tokens, "
                 f"Tritone {results.get('tritone_dtype')}"
                 + (f", vLLM {results['peer_dtype']} on {results['peer_threads']} engine thread(s)"
                    if results.get("peer_dtype") else ""))
    return f"{head}:\n\n{RENDERERS[name](results)}\n"


def rendered(text: str) -> str:
    def block(m):
        name, source = m.group(2), m.group(3)
        results = json.loads((ROOT / source).read_text())
        return m.group(1) + render(name, results) + m.group(5)

    return BLOCK.sub(block, text)


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def stale() -> list[str]:
    """The documents whose rendered blocks differ from their JSON."""
    return [str(p.relative_to(ROOT)) for p in documents() if rendered(p.read_text()) != p.read_text()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/render_docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only report the documents that are out of date")
    args = p.parse_args(argv)
    if args.check:
        out = stale()
        for path in out:
            print(f"{path}: rendered figures differ from their JSON (run scripts/render_docs)")
        return 1 if out else 0
    for path in documents():
        text = path.read_text()
        new = rendered(text)
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
