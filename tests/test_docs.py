"""The figures in README.md and docs/ are what their benchmark JSON says (scripts/render_docs)."""

import copy
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import render_docs  # noqa: E402


def test_every_rendered_block_matches_its_json():
    assert render_docs.stale() == []
    assert any("<!-- render:" in p.read_text() for p in render_docs.documents())


def test_a_changed_figure_makes_its_document_stale(tmp_path, monkeypatch):
    results = json.loads((ROOT / "scripts/results/structured.json").read_text())
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
