"""Reasoning output: the thinking a model writes between think tags, apart from its answer.

As vLLM's and SGLang's `--reasoning-parser`:
- `deepseek_r1`: the chat template opens the thinking (its generation prompt ends in `<think>`),
  so the text up to `</think>` is reasoning and the rest content; a `<think>` the model writes
  itself at the start is dropped; without `</think>` the whole text is reasoning (the model was
  still thinking when it stopped).
- `qwen3`: the model opens its thinking itself, and may not think at all (thinking switched off
  in the template): the text is reasoning only from a `<think>` at its start to `</think>`, else
  all content.

`ReasoningStream` splits text as it streams, holding back only what could still be the start of a
tag, so that the streamed pieces join to what `split` gives for the whole text.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return name


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a part that is absent."""
    stream = ReasoningStream(parser)
    parts = [stream.feed(text), stream.finish()]
    reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
    return (reasoning if stream.has_reasoning else None), (content or None)


class ReasoningStream:
    """Splits text fed piece by piece: `feed` and, at the end, `finish` return the (reasoning,
    content) pieces that are final."""

    def __init__(self, parser: str):
        self.parser = check_parser(parser)
        self.has_reasoning = False
        self._held = ""
        self._state = "start"  # start: a <think> may open; thinking; closed: </think> seen; answering

    @property
    def is_answering(self) -> bool:
        """Whether what comes now is content (tool calls and structured outputs apply to it)."""
        return self._state in ("closed", "answering")

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        if self._state == "start":
            stripped = text.lstrip()
            if len(stripped) < len(START) and START.startswith(stripped):
                self._held = text  # a <think> may still be coming
                return "", ""
            opened = stripped.startswith(START)
            if opened:
                text = stripped[len(START):]
            self._state = "thinking" if opened or self.parser == "deepseek_r1" else "answering"
            self.has_reasoning = self._state == "thinking"
        if self._state == "thinking":
            end = text.find(END)
            if end < 0:
                keep = _partial_suffix(text, END)
                self._held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            self._state = "closed"
            reasoning, text = text[:end], text[end + len(END):]
        else:
            reasoning = ""
        if self._state == "closed":  # the newlines between the tag and the answer are neither
            text = text.lstrip("\n")
            if text:
                self._state = "answering"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text has ended."""
        text, self._held = self._held, ""
        if self._state == "thinking":
            return text, ""
        if self._state == "start" and text and self.parser == "deepseek_r1":
            self.has_reasoning = True
            return text, ""
        return "", text


def _partial_suffix(text: str, tag: str) -> int:
    """How many of text's last characters are a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
