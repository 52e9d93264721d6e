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
