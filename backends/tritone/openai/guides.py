"""Structured outputs: OpenAI's `response_format` and vLLM's guided_* extras, as the ensemble's
`guided_decoding_guide_type` / `guided_decoding_guide` (TensorRT-LLM's names)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tritone.openai.errors import RequestError


def add_guide(inputs: dict[str, np.ndarray], guide_type: str, guide: str) -> None:
    """Puts a guide into the ensemble's inputs (no guide text for the bare json type)."""
    inputs["guided_decoding_guide_type"] = np.array([[guide_type.encode()]], dtype=object)
    if guide:
        inputs["guided_decoding_guide"] = np.array([[guide.encode()]], dtype=object)


def response_format_guide(response_format: dict) -> list[tuple[str, str, Any]]:
    """OpenAI's response_format as (field, kind, value) constraints: none for text."""
    kind = response_format.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json", "")]
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                               "response_format.json_schema.schema")
        # strict or not, the schema is enforced: xgrammar either enforces a keyword or the
        # engine refuses the schema.
        return [("response_format", "json_schema", schema)]
    raise RequestError('response_format.type must be "text", "json_object" or "json_schema"', "response_format.type")


def guide_text(field: str, kind: str, value) -> tuple[str, str]:
    """(guide type, guide text) for the ensemble."""
    if kind == "json_schema":
        if isinstance(value, str):
            return kind, value
        if not isinstance(value, dict):
            raise RequestError(f"{field} must be a JSON schema object", field)
        return kind, json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(f"{field} must be a non-empty list of non-empty strings", field)
        # An EBNF of the literal choices: no regex escaping to get wrong.
        return "ebnf_grammar", "root ::= " + " | ".join(json.dumps(c) for c in value)
    if kind == "json":
        return kind, ""
    if kind == "structural_tag" and not isinstance(value, str):
        return kind, json.dumps(value)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field} must be a non-empty string", field)
    return kind, value


# The newlines a model writes between </think> and its answer, which the reasoning parser takes
# as neither part: the answer's grammar starts after them.
_THINK_ENDS = ["</think>", "</think>\n", "</think>\n\n"]


def constrain_after_reasoning(inputs: dict[str, np.ndarray], parser: str, field: str) -> None:
    """With a reasoning parser, a request's guide (the ensemble inputs' own, from `field`) is made
    to constrain only the answer, as vLLM does: a structural tag of free text up to `</think>`
    (deepseek_r1: the template opened the thinking; qwen3: a `<think>` block the model may leave
    out), then the guide. Unlike vLLM, the model cannot end while it thinks: end of sequence is
    allowed only where the guide is complete."""
    from tritone.scheduling.grammar import Guide, GuideError

    guide_type = inputs["guided_decoding_guide_type"][0][0].decode()
    text = inputs["guided_decoding_guide"][0][0].decode() if "guided_decoding_guide" in inputs else ""
    try:
        # Checked here, with the engine's own checks, so that an error names the client's field
        # rather than the structural tag it becomes.
        grammar = Guide(guide_type, text).check()
    except GuideError as exc:
        message = str(exc).removeprefix("guided_decoding_guide_type").removeprefix("guided_decoding_guide")
        raise RequestError(field + message, field) from None
    # A structural tag nests as it is (xgrammar's older form, without "format", as its grammar).
    answer = (json.loads(text) if guide_type == "structural_tag" else {}).get("format") \
        or {"type": "grammar", "grammar": str(grammar)}
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": _THINK_ENDS}
    if parser == "qwen3":
        thinking = {"type": "optional", "content": {**thinking, "begin": "<think>"}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [thinking, answer]}}
    add_guide(inputs, "structural_tag", json.dumps(tag))
