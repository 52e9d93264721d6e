"""`llm_inline`, the engine's process doing the text work too (--pipeline inline, the default where
the engine runs on the CPU): rendered as the model "ensemble" when asked, and it answers as the
three-process ensemble does (that from the session server, llm_inline from a server of its own)."""

import json
import pathlib

import numpy as np
import pytest

from conftest import start_server
from tritone.launcher import ENSEMBLE_MODELS, INLINE_MODELS, build_parser, render_repository, template_values
from tritone.launcher.options import resolve_pipeline
from tritone.serving.inline import InlineText
from tritone_client import TritoneClient, infer_inputs


def test_the_launcher_renders_only_the_selected_models(tmp_path):
    values = {**template_values(build_parser().parse_args([]), pathlib.Path("M")), "flow_board": "F",
              "shutdown_file": "S"}
    assert sorted(p.name for p in render_repository(tmp_path / "a", values).iterdir()) == sorted(ENSEMBLE_MODELS)
    rendered = render_repository(tmp_path / "b", values, INLINE_MODELS)
    assert [p.name for p in rendered.iterdir()] == ["ensemble"]  # every client of the ensemble calls it
    config = (rendered / "ensemble" / "config.pbtxt").read_text()
    assert 'string_value: "M"' in config and '\nname: "ensemble"\n' in config and "llm_inline\"" not in config


def test_the_pipeline_is_inline_on_the_cpu_and_the_ensemble_on_a_gpu_unless_asked():
    parse = build_parser().parse_args
    assert resolve_pipeline(parse(["--device", "cpu"])) == "inline"
    assert resolve_pipeline(parse(["--device", "cuda:1"])) == "ensemble"
    assert resolve_pipeline(parse(["--device", "cpu", "--pipeline", "ensemble"])) == "ensemble"
    assert resolve_pipeline(parse(["--device", "cuda", "--pipeline", "inline"])) == "inline"
    import torch
    assert resolve_pipeline(parse([])) == ("ensemble" if torch.cuda.is_available() else "inline")


def test_inline_text_parses_ensemble_inputs_and_names_bad_fields(model_dir, tokenizer):
    text = InlineText({"model_dir": str(model_dir), "chat_template": "never"})
    good = {"text_input": np.array([b"Hello there"], dtype=object), "max_tokens": np.array([5], dtype=np.int32)}
    bad = {"text_input": np.array([b"Hi"], dtype=object), "max_tokens": np.array([5], dtype=np.int32),
           "messages": np.array([b"[]"], dtype=object)}
    parsed, error = text.parse([good.get, bad.get])
    assert parsed.prompt_ids == tokenizer("Hello there").input_ids and parsed.params.max_tokens == 5
    assert isinstance(error, ValueError) and "text_input" in str(error) and "messages" in str(error)


@pytest.fixture(scope="module")
def inline_server(request, model_dir, tmp_path_factory):
    """llm_inline served as `ensemble`: the session's OpenAI server where the pipeline it runs by
    default is that one (on a CPU), else a server of its own (a server start is most of a module's
    time)."""
    shared = request.getfixturevalue("openai_server")
    if shared.pipeline == "inline":
        yield shared
        return
    srv, log = start_server(tmp_path_factory, "tritonserver-inline", "--kv-cache-bytes", str(256 << 20), "--pipeline", "inline")
    try:
        yield srv
    finally:
        code = srv.stop()
        log.close()
    assert code == 0, (srv.run_dir / "server.log").read_text()[-3000:]


@pytest.mark.integration
def test_llm_inline_answers_as_the_ensemble(server, inline_server):
    prompt = "Write a haiku about the sea, then explain it."
    ensemble = TritoneClient(f"127.0.0.1:{server.args.grpc_port}")
    inline = TritoneClient(f"127.0.0.1:{inline_server.args.grpc_port}", model="ensemble")
    with ensemble, inline:
        expected = ensemble.complete(prompt, max_tokens=40)
        assert inline.complete(prompt, max_tokens=40) == expected
        chunks = list(inline.generate(prompt, max_tokens=40, stream=True))
        assert len(chunks) > 1 and "".join(c.text for c in chunks) == expected.text
        assert chunks[-1].num_output_tokens == expected.num_output_tokens
        assert chunks[-1].finish_reason == expected.finish_reason
        stopped = inline.complete(prompt, max_tokens=40, stop_words=[expected.text.split()[2]])
        assert stopped == ensemble.complete(prompt, max_tokens=40, stop_words=[expected.text.split()[2]])
        # Bad input fails that request alone, with the same message as through the ensemble.
        with pytest.raises(RuntimeError, match="messages is not valid JSON"):
            list(inline._grpc_stream(_bad_messages(inline)))
        assert inline.complete(prompt, max_tokens=40) == expected


def _bad_messages(client):
    return infer_inputs(client._triton, (("messages", np.array([[b"{not json"]], dtype=object)),
                                         ("max_tokens", np.array([[4]], dtype=np.int32))))


@pytest.mark.integration
def test_http_generate_and_generate_stream_answer_inline_as_through_the_ensemble(server, inline_server):
    from test_integration import QUESTION, post, sse_events

    request = {"text_input": QUESTION, "max_tokens": 24}
    _, expected = post(server, "generate", request)
    status, whole = post(inline_server, "generate", request)
    assert status == 200 and json.loads(whole)["text_output"] == json.loads(expected)["text_output"]
    assert json.loads(whole)["model_name"] == "ensemble"
    status, body = post(inline_server, "generate_stream", {**request, "stream": True})
    events = sse_events(body)
    assert status == 200 and len(events) > 3
    assert "".join(e["text_output"] for e in events) == json.loads(expected)["text_output"]
    assert events[-1]["finish_reason"] == json.loads(expected)["finish_reason"]
