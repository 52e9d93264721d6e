"""Tokenization for preprocessing, and incremental detokenization that is exact for any tokenizer:
stateless in postprocessing, and with stop words matched on text in the llm model."""

from __future__ import annotations

import bisect
import json
import re

import numpy as np
from transformers import AutoTokenizer

# Ids sent before each streamed chunk, at least, so that a stateless detokenizer decodes the chunk
# in context; `Detokenizer.context_start` reaches further back where the tokens need it.
NUM_CONTEXT_IDS = 8
# A bound on that reach, met only by runs of hundreds of byte or skipped special tokens.
MAX_CONTEXT_IDS = 256

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The space clean-up of transformers and of the WordPiece decoder rewrites patterns of at most
# 7 characters (" do not", and " n ' t" through two of its rules), each starting at a space.
_CLEANUP_REACH = 8

_ANCHOR, _BYTE, _SPECIAL, _KNOWN = 1, 2, 4, 8


def load_tokenizer(model_dir: str):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.is_fast:
        raise ValueError(f"{model_dir} has no fast (tokenizers) tokenizer; Tritone needs one")
    return tokenizer


class PromptEncoder:
    """Turns request text or chat messages into engine inputs, many requests per call."""

    def __init__(self, model_dir: str, chat_template: str = "auto"):
        if chat_template not in ("auto", "never"):
            raise ValueError(f"chat_template must be auto or never, got {chat_template!r}")
        self.tokenizer = load_tokenizer(model_dir)
        # An instruct model answers a bare prompt well only inside its chat template.
        self.use_chat_template = chat_template == "auto" and bool(self.tokenizer.chat_template)

    def encode(self, prompts: list[str | list[dict]],
               apply_chat_template: list[bool | None] | None = None) -> list[list[int]]:
        flags = apply_chat_template or [None] * len(prompts)
        return self.tokenize([self.prepare(p, f) for p, f in zip(prompts, flags)])

    def prepare(self, prompt: str | list[dict], apply_chat_template: bool | None = None,
                tools: list[dict] | None = None) -> tuple[str, bool]:
        """The text to tokenize for one prompt, and whether it is in the chat template: a text is
        unless its flag or the server says not; chat messages always are."""
        if tools and isinstance(prompt, str):
            raise ValueError("tools: tools come with chat messages, not text_input")
        if not isinstance(prompt, str):
            if apply_chat_template is False:
                raise ValueError("apply_chat_template: messages always go through the chat template")
            return self.render_chat(prompt, tools), True
        use = self.use_chat_template if apply_chat_template is None else apply_chat_template
        return (self.render_chat([{"role": "user", "content": prompt}]), True) if use else (prompt, False)

    def tokenize(self, prepared: list[tuple[str, bool]]) -> list[list[int]]:
        """Ids of many prepared prompts, in two batched tokenizer calls."""
        plain = [text for text, templated in prepared if not templated]
        chat = [text for text, templated in prepared if templated]
        # The template already holds the special tokens the model expects.
        plain_ids = iter(self.tokenizer(plain).input_ids if plain else [])
        chat_ids = iter(self.tokenizer(chat, add_special_tokens=False).input_ids if chat else [])
        return [next(chat_ids) if templated else next(plain_ids) for _, templated in prepared]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError("apply_chat_template: the model has no chat template")
        if (tools or _has_tool_turns(messages)) and not template_takes_tools(self.tokenizer.chat_template):
            messages, tools = hermes_tool_messages(messages, tools), None
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # the template's own checks (roles, order) raise what they like
            raise ValueError(f"messages: the model's chat template refused them: {exc}") from None

    def encode_words(self, words: list[str]) -> list[list[int]]:
        if not words:
            return []
        return self.tokenizer(list(words), add_special_tokens=False).input_ids

    def encode_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it tokenizes at the start of a text and after a space, which most
        tokenizers spell with different ids ("Paris" and " Paris")."""
        variants = [v for w in words for v in (w.lstrip(), " " + w.lstrip()) if v.strip()]
        unique = []
        for ids in self.encode_words(variants):
            if ids and ids not in unique:
                unique.append(ids)
        return unique


def to_word_list_tensor(sequences: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's word-list layout [2, N]: concatenated ids, then end offsets padded with -1."""
    flat = [t for seq in sequences for t in seq]
    offsets = np.cumsum([len(s) for s in sequences]).tolist()
    width = max(len(flat), 1)
    out = np.full((2, width), -1, dtype=np.int32)
    out[0, :len(flat)] = flat
    out[1, :len(offsets)] = offsets
    return out


def from_word_list_tensor(tensor: np.ndarray) -> list[list[int]]:
    tensor = np.asarray(tensor).reshape(2, -1)
    ids, offsets = tensor[0].tolist(), [o for o in tensor[1].tolist() if o >= 0]
    starts = [0] + offsets[:-1]
    return [ids[s:e] for s, e in zip(starts, offsets) if e > s]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the characters byte-level vocabularies use."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in kept:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


def _decoder_types(tokenizer) -> set[str]:
    decoder = tokenizer.backend_tokenizer.decoder
    stack = [json.loads(decoder.__getstate__())] if decoder is not None else []
    types = set()
    while stack:
        node = stack.pop()
        types.add(node.get("type"))
        if node.get("type") == "WordPiece" and node.get("cleanup"):
            types.add("cleanup")
        stack.extend(node.get("decoders") or [])
    return types


class Detokenizer:
    """Incremental detokenization that needs no state between chunks.

    `final_text(ids)` is the part of `decode(ids)` that no later token can change: it leaves out
    an unfinished character (one trailing U+FFFD), a trailing run of byte-fallback tokens (a later
    invalid byte turns the whole run into U+FFFD), and a space that clean-up may still remove. It
    only grows as ids are appended, so a chunk's text is `final_text(context + new)` minus
    `final_text(context)`, given a context that starts where decoding can restart without changing
    what follows (`context_start`). Tokens are classed once: an *anchor* is a token at which
    decoding restarts cleanly (not a byte-fallback byte, not a byte-level token that begins inside
    a character); skipped special tokens and ids outside the vocabulary decode to nothing.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.cleanup = "cleanup" in types or (
            bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
            and type(tokenizer.backend_tokenizer.model).__name__ != "BPE")  # transformers skips BPE
        added = {i for i in tokenizer.added_tokens_decoder}
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        alphabet = _byte_level_alphabet() if "ByteLevel" in types else None
        # A WordPiece word piece ("##ing") joins the token before it; decoded first, it shows "##".
        continuation = self._wordpiece_prefix(tokenizer) if "WordPiece" in types else None
        # Clean-up holds back _CLEANUP_REACH tokens and more: the context must reach beyond them.
        self.num_context_ids = NUM_CONTEXT_IDS + (3 * _CLEANUP_REACH if self.cleanup else 0)
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        flags = bytearray(len(tokens))
        for i, token in enumerate(tokens):
            if token is None:
                continue
            flag = _KNOWN | (_SPECIAL if i in special else 0)
            if i in added:
                flag |= _ANCHOR  # decoded apart from the tokens around it
            elif "ByteFallback" in types and _BYTE_TOKEN.fullmatch(token):
                flag |= _BYTE
            elif alphabet is not None and token and all(c in alphabet for c in token):
                flag |= 0 if 0x80 <= alphabet[token[0]] < 0xC0 else _ANCHOR
            elif continuation and token.startswith(continuation):
                pass
            elif token:
                flag |= _ANCHOR
            flags[i] = flag
        self._flags = bytes(flags)

    @staticmethod
    def _wordpiece_prefix(tokenizer) -> str:
        decoder = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
        nodes = decoder.get("decoders") or [decoder]
        return next((d.get("prefix", "##") for d in nodes if d.get("type") == "WordPiece"), "##")

    def _flag(self, token_id: int) -> int:
        return self._flags[token_id] if 0 <= token_id < len(self._flags) else 0

    def _visible(self, ids: list[int], skip_special_tokens: bool) -> list[int]:
        hidden = _SPECIAL if skip_special_tokens else 0
        return [t for t in ids if self._flag(t) & (_KNOWN | hidden) == _KNOWN]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def final_text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = self._visible(ids, skip_special_tokens)
        end = len(ids)
        while end and self._flag(ids[end - 1]) & _BYTE:
            end -= 1
        text = self.decode(ids[:end], skip_special_tokens)
        if text.endswith(_REPLACEMENT):
            text = text[:-1]
        return self._before_cleanup_reach(ids[:end], text, skip_special_tokens) if self.cleanup else text

    def _before_cleanup_reach(self, ids: list[int], text: str, skip_special_tokens: bool) -> str:
        # Every token brings at least one character before clean-up, so no later token can
        # reach text followed by _CLEANUP_REACH tokens.
        for end in range(len(ids) - _CLEANUP_REACH, 0, -1):
            head = self.decode(ids[:end], skip_special_tokens)
            if text.startswith(head):
                return head
        return ""

    def delta(self, context_ids: list[int], new_ids: list[int], is_final: bool,
              skip_special_tokens: bool = True) -> str:
        """The text that `new_ids` add after `context_ids` (ids from `context_start` on); with
        `is_final`, everything up to the end of the text."""
        before = self.final_text(context_ids, skip_special_tokens)
        ids = context_ids + new_ids
        after = self.decode(ids, skip_special_tokens) if is_final else self.final_text(ids, skip_special_tokens)
        if after.startswith(before):
            return after[len(before):]
        # Not reached with the decoders above; for others, resume after the common part.
        common = 0
        for a, b in zip(before, after):
            if a != b:
                break
            common += 1
        return after[common:]

    def context_start(self, ids: list[int], end: int, skip_special_tokens: bool = True) -> int:
        """Where the context of a chunk starting at `end` begins: at least `num_context_ids`
        decoded ids and two anchors back (or the start), so that decoding from there gives the
        text after the first anchor exactly as decoding from the very start does."""
        hidden = _SPECIAL if skip_special_tokens else 0
        start, num_ids, num_anchors = end, 0, 0
        while start > 0 and end - start < MAX_CONTEXT_IDS and (num_ids < self.num_context_ids or num_anchors < 2):
            start -= 1
            flag = self._flag(ids[start])
            if flag & (_KNOWN | hidden) == _KNOWN:
                num_ids += 1
                num_anchors += bool(flag & _ANCHOR)
        return start

    def context(self, ids: list[int], end: int, skip_special_tokens: bool = True) -> list[int]:
        return ids[self.context_start(ids, end, skip_special_tokens):end]


class StopMatcher:
    """Finds stop words in the text of a growing id sequence, decoding it one id at a time.

    `ends[i]` is the length of the final text once ids[:i + 1] are decoded, which maps a place in
    the text back to the id that brought it. Ids whose text could still begin a stop word are
    held back (`num_safe_ids`), so a streamed prefix of a stop word is never shown.
    """

    def __init__(self, detokenizer: Detokenizer, words: list[str], skip_special_tokens: bool,
                 prefix_ids: list[int] = ()):
        self.detokenizer, self.words, self.skip = detokenizer, list(words), skip_special_tokens
        # Ids sent before the generated ones (an echoed prompt) are decoded but never searched.
        self.text = detokenizer.final_text(list(prefix_ids), skip_special_tokens) if prefix_ids else ""
        self.ends = [len(self.text)] * len(prefix_ids)
        self.search_start = len(self.text)
        self.longest = max(len(w) for w in self.words)

    def feed(self, ids: list[int], is_final: bool) -> int | None:
        """Decodes the ids not seen yet (all of the text when `is_final`); returns where the first
        stop word starts in the text, or None."""
        searched = len(self.text)
        for i in range(len(self.ends), len(ids)):
            context = self.detokenizer.context(ids, i, self.skip)
            self.text += self.detokenizer.delta(context, [ids[i]], False, self.skip)
            self.ends.append(len(self.text))
        if is_final and ids:
            # What final_text held back belongs to the last id.
            context = self.detokenizer.context(ids, len(ids), self.skip)
            self.text += self.detokenizer.delta(context, [], True, self.skip)
            self.ends[-1] = len(self.text)
        start = max(self.search_start, searched - self.longest + 1)
        found = [i for i in (self.text.find(w, start) for w in self.words) if i >= 0]
        return min(found) if found else None

    def num_safe_ids(self) -> int:
        """How many ids can be sent: those whose text ends before any start of a stop word."""
        hold = len(self.text)
        for word in self.words:
            for k in range(min(len(word) - 1, len(self.text) - self.search_start), 0, -1):
                if self.text.endswith(word[:k]):
                    hold = min(hold, len(self.text) - k)
                    break
        return bisect.bisect_right(self.ends, hold)

    def cut(self, ids: list[int], stop_start: int, num_sent: int) -> tuple[int, int]:
        """For a stop word at `stop_start`: how many ids to send in all (up to the one where the
        stop word starts), and how many characters to drop from the end of the last chunk's text
        (sent after `num_sent` ids) so that it ends right before the stop word."""
        end = bisect.bisect_right(self.ends, stop_start) + 1
        context = self.detokenizer.context(ids, num_sent, self.skip)
        text = self.detokenizer.delta(context, ids[num_sent:end], True, self.skip)
        shown = self.ends[num_sent - 1] if num_sent else 0
        return end, max(0, shown + len(text) - stop_start)


def template_takes_tools(chat_template) -> bool:
    """Whether a chat template renders `tools` itself (Qwen 2.5 / 3, Llama 3.1+, Hermes...)."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template)
    return "tools" in text


def _has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


_HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def hermes_tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a chat template that knows nothing of tools, written as Qwen 2.5's template
    writes them: the tools in the system message, calls as <tool_call> blocks, tool answers as
    <tool_response> blocks in a user turn."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function", call)
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass
                calls.append("<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments})
                             + "\n</tool_call>")
            content = "\n".join(([content] if content else []) + calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        system = _HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
