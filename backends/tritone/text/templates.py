"""Chat templates and tool prompts: where a model's template is found, whether it renders tools
itself, and the Hermes tool syntax for one that does not.

The Hermes syntax is defined here only: preprocessing writes it into prompts, and the OpenAI
front end parses the model's answers by the same tags.
"""

from __future__ import annotations

import json
import pathlib

# A Hermes tool call: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block
# per call, as Qwen 2.5 / 3 and Hermes write them.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# Qwen 2.5's system prompt for tools, word for word: small models follow the text they were tuned on.
HERMES_TOOL_PROMPT = f"""# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{{tools}}
</tools>

For each function call, return a json object with function name and arguments within \
{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:
{TOOL_CALL_OPEN}
{{{{"name": <function-name>, "arguments": <args-json-object>}}}}
{TOOL_CALL_CLOSE}"""


def chat_template_text(model_dir: pathlib.Path) -> str:
    """The model's chat template as written in its directory (empty where it has none)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template") or ""
    except (OSError, ValueError):
        return ""
    return template if isinstance(template, str) else json.dumps(template)


def template_takes_tools(chat_template) -> bool:
    """Whether a chat template renders `tools` itself (Qwen 2.5 / 3, Llama 3.1+, Hermes...)."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template)
    return "tools" in text


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def hermes_tool_call(name: str, arguments) -> str:
    """One call as a Hermes block; `arguments` an object (or text that is not JSON, kept as it is)."""
    return f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": name, "arguments": arguments}) + f"\n{TOOL_CALL_CLOSE}"


def hermes_tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a chat template that knows nothing of tools, written as Qwen 2.5's template
    writes them: the tools in the system message, calls as <tool_call> blocks, tool answers as
    <tool_response> blocks in a user turn."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if message.get("tool_calls"):
            calls = [hermes_tool_call(*_name_and_arguments(call)) for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        system = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _name_and_arguments(call: dict) -> tuple[str | None, object]:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return function.get("name"), arguments


def parser_for_template(chat_template) -> str:
    """The tool-call syntax a model writes, read from its chat template: Llama 3.x's bare JSON
    where the template speaks of ipython, else Hermes."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    return "llama3_json" if ("<|python_tag|>" in text or "ipython" in text) else "hermes"
