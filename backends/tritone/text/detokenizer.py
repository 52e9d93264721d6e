"""Incremental detokenization that is exact for any tokenizer and keeps no state between chunks,
so that postprocessing can run as many stateless instances as it likes."""

from __future__ import annotations

import json
import re

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
