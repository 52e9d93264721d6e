"""README.md and docs/ say what their sources say (scripts/render_docs): figures from the
benchmarks' result files, options from the launcher's parser; and every relative link in them resolves."""

import copy
import json
import pathlib
import re

import pytest

from tritone.launcher import build_parser
from tritone_bench import report as render_docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRUCTURED = ROOT / "bench_results/structured-avx2.json"


@pytest.fixture
def benchmark_results():
    """A `scripts/benchmark --peer vllm` result, from the structured-outputs run's free levels
    (the same "tritone" and "peer" layout as bench_results/benchmark-avx2.json)."""
    results = json.loads(STRUCTURED.read_text())
    keep = ("config", "machine", "commit", "date", "tritone", "peer", "hf_generate", "tritone_dtype", "peer_dtype",
            "peer_threads")
    return copy.deepcopy({key: results[key] for key in keep if key in results})


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the table rows whose first cell is `first_cell` (or, ending in `*`, starts with
    what comes before it)."""
    prefix = f"| {first_cell[:-1]}" if first_cell.endswith("*") else f"| {first_cell} "
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(prefix)]


def test_every_rendered_block_matches_its_source():
    assert render_docs.stale() == []
    texts = [p.read_text() for p in render_docs.documents()]
    for name in ("structured", "headline", "benchmark", "serve-options", "openai-throughput", "bench-suite"):
        assert any(f"<!-- render: {name} " in text for text in texts), name


def test_a_changed_figure_makes_its_document_stale(tmp_path, monkeypatch):
    results = json.loads(STRUCTURED.read_text())
    changed = copy.deepcopy(results)
    changed["tritone_structured"]["32"]["output_tokens_per_s"] *= 2
    source = tmp_path / "structured.json"
    source.write_text(json.dumps(changed))
    doc = tmp_path / "doc.md"
    block = "<!-- render: structured {} -->\n{}<!-- end render -->\n"
    doc.write_text(block.format(source, render_docs.render("structured", results)))
    monkeypatch.setattr(render_docs, "ROOT", pathlib.Path("/"))
    monkeypatch.setattr(render_docs, "documents", lambda: [doc])
    assert render_docs.stale() == [str(doc.relative_to("/"))]
    text = render_docs.rendered(doc.read_text())
    assert f"{2 * results['tritone_structured']['32']['output_tokens_per_s']:.1f}" in text
    assert "-core " in text  # the machine, described from the JSON
    assert f"at commit {results['commit'][:12]} on {results['date'][:10]}" in text  # and where it came from


def test_headline_compares_the_stacks_level_by_level(benchmark_results):
    text = render_docs.render("headline", benchmark_results)
    assert text.startswith("Measured on a 2-core ")  # the machine is named
    [row] = table_rows(text, "32")
    tr, peer = benchmark_results["tritone"]["32"], benchmark_results["peer"]["32"]
    assert row[1] == f"{tr['output_tokens_per_s']:.1f}" and row[2] == f"{peer['output_tokens_per_s']:.1f}"
    assert row[3] == f"{tr['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}x"
    assert row[4] == f"{1000 * tr['itl_s']['mean']:.1f} / {1000 * peer['itl_s']['mean']:.1f}"
    assert row[5] == f"{tr['ttft_s']['mean']:.2f} / {peer['ttft_s']['mean']:.2f}"
    front_end = peer["cpu_ms_per_token"]["vllm api server"] + peer["cpu_ms_per_token"]["vllm engine core"]
    assert row[6] == f"{tr['cpu_ms_per_token']['text path']:.3f} / {front_end:.3f}"


def test_headline_says_how_the_stacks_took_turns(benchmark_results):
    benchmark_results["config"]["interleave"] = False
    assert "one stack after the other" in render_docs.render("headline", benchmark_results)
    benchmark_results["config"]["interleave"] = True
    text = render_docs.render("headline", benchmark_results)
    assert "taking turns level by level" in text and "one stack after the other" not in text


def test_interleave_needs_the_peer_and_runs_alone():
    from tritone_bench import benchmark

    for argv in (["--interleave"], ["--interleave", "--peer", "vllm", "--structured", "json-schema"],
                 ["--interleave", "--peer", "vllm", "--lora-mix", "2"]):
        with pytest.raises(SystemExit, match="--interleave needs --peer vllm"):
            benchmark.main([*argv, "--hf-batches"])


def test_headline_levels_in_numeric_order_and_missing_figures_as_na(benchmark_results):
    results = benchmark_results
    results["tritone"]["128"] = {"output_tokens_per_s": 300.0}  # no latencies, no CPU figures
    results["tritone"]["4"] = copy.deepcopy(results["tritone"]["32"])
    del results["tritone"]["4"]["cpu_ms_per_token"]["text path"]
    results["peer"]["32"]["itl_s"]["mean"] = float("nan")
    text = render_docs.render("headline", results)
    levels = [line.split("|")[1].strip() for line in text.splitlines() if re.match(r"\| \d", line)]
    assert levels == ["4", "32", "128"]
    [row] = table_rows(text, "128")
    assert row[1:] == ["300.0", "n/a", "n/a", "n/a / n/a", "n/a / n/a", "n/a / n/a"]
    [row] = table_rows(text, "4")
    assert row[2] == "n/a" and row[6].startswith("n/a / ")  # no peer level, no text path figure
    [row] = table_rows(text, "32")
    assert row[4].endswith(" / n/a")
    del results["machine"], results["peer"]
    assert render_docs.render("headline", results).startswith("Machine not recorded")


def test_benchmark_tables_take_every_level_phase_and_process(benchmark_results):
    text = render_docs.render("benchmark", benchmark_results)
    assert len(table_rows(text, "Tritone")) == 2  # the level, and its CPU per process
    assert len(table_rows(text, "vLLM CPU")) == 2
    for role in ("tritonserver", "postprocessing", "text path", "vllm api server", "vllm worker"):
        assert f" {role} |" in text
    assert f"{benchmark_results['tritone']['32']['step_ms']['forward']:.2f}" in text
    del benchmark_results["tritone"]["32"]["step_ms"], benchmark_results["peer"]["32"]["cpu_ms_per_token"]
    text = render_docs.render("benchmark", benchmark_results)
    assert "by phase" not in text and len(table_rows(text, "vLLM CPU")) == 1


def test_openai_throughput_table():
    levels = [{"concurrency": 32, "ratio": 1.1, "round_ratios": [1.05, 1.15],
             "grpc": {"output_tokens_per_s": 100.0, "ttft_s": {"p50": 0.5}, "itl_s": {"p50": 0.15}},
             "openai": {"output_tokens_per_s": 110.0, "ttft_s": {"p50": 0.4}, "itl_s": {"p50": 0.14},
                        "cpu_ms_per_token": {"openai front end": 0.2514, "tritonserver": 0.2}}},
            {"concurrency": 128, "grpc": {}, "openai": {"output_tokens_per_s": 140.0}}]
    text = render_docs.render("openai-throughput", {"levels": levels})
    assert table_rows(text, "32") == [["32", "100.0", "110.0", "1.10x", "1.05, 1.15", "0.251", "0.500 / 0.400",
                                       "150.0 / 140.0"]]
    assert table_rows(text, "128") == [["128", "n/a", "140.0", "n/a", "n/a", "n/a", "n/a / n/a", "n/a / n/a"]]


def test_a_source_not_yet_written_says_which_command_writes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(render_docs, "ROOT", tmp_path)
    doc = "<!-- render: headline results/benchmark.json -->\nold figures\n<!-- end render -->\n"
    text = render_docs.rendered(doc)
    assert "Not measured yet" in text and "--json results/benchmark.json" in text
    assert "old figures" not in text
    (tmp_path / "results").mkdir()
    (tmp_path / "results/benchmark.json").write_text(json.dumps({"tritone": {"1": {"output_tokens_per_s": 5.0}}}))
    assert "| 1 | 5.0 | n/a |" in render_docs.rendered(text)
    with pytest.raises(ValueError, match="no renderer 'nonesuch'"):
        render_docs.rendered("<!-- render: nonesuch x.json -->\n<!-- end render -->")


def test_serve_options_follow_the_launchers_parser():
    source = "backends/tritone/launcher/options.py"
    path = render_docs.load("serve-options", source)
    assert path == render_docs.ROOT / source  # a code source is handed over, not parsed as JSON
    text = render_docs.render("serve-options", path)
    options = [action for action in build_parser()._actions if action.option_strings and action.dest != "help"]
    rows = table_rows(text, "`--*")
    assert [row[0] for row in rows] == [", ".join(f"`{o}`" for o in action.option_strings) for action in options]
    assert "`-h`" not in text and "`--help`" not in text
    by_option = {row[0]: row for row in rows}
    assert by_option["`--http-port`"][1] == "`8000`"
    assert by_option["`--host`"][2].startswith("address to bind")  # the parser's own help
    assert by_option["`--pipeline`"][1] == "`auto`" and by_option["`--api-key`"][1] == "none"
    assert "one of `auto`, `native`, `torch`" in by_option["`--forward`"][2]
    assert all(row[2] for row in rows)  # every option says what it does


def test_options_table_takes_a_new_option_and_escapes_pipes():
    parser = build_parser()
    parser.add_argument("--frobnicate", default="a|b", help="split on | marks")
    assert "| `--frobnicate` | `a\\|b` | split on \\| marks |" in render_docs.options_table(parser)


def test_every_relative_link_resolves():
    """Every `[text](target)` of README.md and docs/ outside code blocks names a file of the
    checkout, and a `#fragment` a heading of that file."""

    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    def headings(path: pathlib.Path) -> set[str]:
        prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
        return {slug(line.lstrip("#")) for line in prose.splitlines() if line.startswith("#")}

    broken = []
    for doc in render_docs.documents():
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists() or (fragment and resolved.suffix == ".md" and fragment not in headings(resolved)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
