"""Tool calling in the OpenAI front end: the model's tool-call syntax, the grammar that enforces
it, and the parser that turns the generated text back into OpenAI `tool_calls`.

Two syntaxes, as vLLM's parsers of the same names read them:
- hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call
  (Qwen 2.5 / 3, Hermes; and what the preprocessing renders for a template without tools, from
  the same tags: tritone.text.templates);
- llama3_json: `{"name": ..., "parameters": {...}}` (Llama 3.1+), calls separated by `;`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from tritone.text.templates import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

PARSERS = ("hermes", "llama3_json")
# xgrammar's built-in structural tag of each syntax (tool call tags with the tools' parameter
# schemas as their contents).
_XGRAMMAR_FORMATS = {"hermes": "qwen_3", "llama3_json": "llama"}
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def tool_guide(tools: list[dict], tool_choice, parser: str) -> str:
    """The structural tag (xgrammar JSON) that holds the model's tool calls to the tools' names
    and parameter schemas: `auto` lets the model write text or calls, `required` demands at least
    one call, a named function exactly that one. At most one whitespace character in a row
    inside the arguments: with free whitespace a small model can write it until max_tokens."""
    import xgrammar

    if isinstance(tool_choice, dict):
        tool_choice = {"type": "function", "function": {"name": tool_choice["function"]["name"]}}
    tag = xgrammar.get_model_structural_tag(_XGRAMMAR_FORMATS[parser], tools=tools, tool_choice=tool_choice,
                                            reasoning=False, max_whitespace_cnt=1)
    return tag.model_dump_json()


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{secrets.token_hex(12)}"

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(the text that is not a call, or None where nothing else was written; the calls). Text
    that does not parse as calls stays text."""
    if parser == "hermes":
        calls = []
        for match in _HERMES_CALL.finditer(text):
            call = _call(match.group(1))
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = _HERMES_CALL.sub("", text).strip()
        return content or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    parts, rest = _split_json_objects(body)
    calls = [_call(part) for part in parts]
    if not calls or None in calls:
        return text, []
    return rest.strip() or None, calls


def _call(raw: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _split_json_objects(body: str) -> tuple[list[str], str]:
    """`{...}; {...} rest` -> (the leading objects' texts, separated by `;` or whitespace; the
    text after them)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(body):
        j = i
        while j < len(body) and body[j] in "; \n\t":
            j += 1
        if j >= len(body) or body[j] != "{":
            break
        try:
            _, end = decoder.raw_decode(body, j)
        except json.JSONDecodeError:
            break
        parts.append(body[j:end])
        i = end
    return parts, body[i:]


class ToolStream:
    """A streamed answer's text split into content deltas and tool calls. Text goes out as it
    comes until it may be the start of a call; from there it is held, and the calls go out as
    whole `tool_calls` deltas once their text is complete (at the end of the answer)."""

    def __init__(self, parser: str):
        self.parser, self.text, self.sent, self.holding = parser, "", 0, False

    def feed(self, delta: str) -> str:
        """The content to send now for this much more text."""
        self.text += delta
        if self.holding:
            return ""
        start = self._call_start()
        if start is not None:
            self.holding = True
            out, self.sent = self.text[self.sent:start], start
            return out
        # Keep back a tail that may be the beginning of the opening tag.
        safe = len(self.text) - (_partial_prefix(self.text, TOOL_CALL_OPEN) if self.parser == "hermes" else 0)
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still to send, the calls) at the end of the answer."""
        rest = self.text[self.sent:]
        if not self.holding:
            return rest, []
        content, calls = parse_tool_calls(rest, self.parser)
        if not calls:
            return rest, []
        return content or "", calls

    def _call_start(self) -> int | None:
        if self.parser == "hermes":
            i = self.text.find(TOOL_CALL_OPEN, self.sent)
            return None if i < 0 else i
        stripped = self.text.lstrip()
        if self.sent == 0 and (stripped.startswith("{") or stripped.startswith("<|python_tag|>")):
            return 0
        return None


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
