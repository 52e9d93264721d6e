"""Grammar-constrained decoding with xgrammar: guides, their checks, compilation off the engine's
thread, and the per-step token bitmask.

A request's guide is checked when it arrives (a bad schema, regex or grammar fails that request
alone, naming the field and xgrammar's message), compiled against the model's tokenizer on a
worker thread and cached by (type, text), and then drives a matcher: each step fills the bitmask
rows of the constrained requests in one call and masks their logits in one operation; each token
the engine keeps advances the matcher. Requests without a guide never touch this module.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the text processes import this module for Guide; they need not load torch
    import torch

logger = logging.getLogger(__name__)

# TensorRT-LLM's guided_decoding_guide_type values: `json` is any JSON object, the others take the
# schema, regex, EBNF grammar (GBNF, as llama.cpp and xgrammar write it) or xgrammar structural
# tag (JSON) in guided_decoding_guide.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
MAX_GUIDE_BYTES = 1 << 20
# Compiled grammars kept (each holds per-state token masks: tens of KB to a few MB).
CACHE_ENTRIES = 256

# JSON Schema keywords xgrammar 0.2 parses but does not enforce (each checked against its matcher):
# a schema that uses one is refused, since output that ignores part of the schema is not what the
# client asked for.
_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "dependencies", "uniqueItems", "contains", "minContains", "maxContains")
_ENFORCED_FORMATS = frozenset(("email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6",
                               "hostname", "uri", "uri-reference", "json-pointer"))
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


class GuideError(ValueError):
    """A guide that cannot be used; the message names the field."""


@dataclass(frozen=True, slots=True)
class Guide:
    type: str
    text: str = ""

    def check(self):
        """Parses the guide without the tokenizer (milliseconds), returning xgrammar's Grammar;
        raises GuideError naming the field, with xgrammar's own message. Once per guide: the
        request is checked when submitted, again as the engine takes it, and its grammar compiled
        from the parse, and the engine's thread should not parse."""
        return _parsed(self.type, self.text)

    def _parse(self):
        if self.type not in GUIDE_TYPES:
            raise GuideError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {self.type!r}")
        if self.type != "json" and not self.text:
            raise GuideError(f"guided_decoding_guide is required with guided_decoding_guide_type {self.type}")
        if len(self.text) > MAX_GUIDE_BYTES:
            raise GuideError(f"guided_decoding_guide is over the limit of {MAX_GUIDE_BYTES} bytes")
        xgr = _xgrammar()
        try:
            # JSON with single spaces after separators and no other whitespace: with free
            # whitespace a small model can emit newlines until max_tokens inside valid JSON.
            if self.type == "json":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if self.type == "json_schema":
                check_json_schema(_json(self.text, "a JSON schema"))
                return xgr.Grammar.from_json_schema(self.text, any_whitespace=False)
            if self.type == "regex":
                return xgr.Grammar.from_regex(self.text)
            if self.type == "ebnf_grammar":
                return xgr.Grammar.from_ebnf(self.text)
            return xgr.Grammar.from_structural_tag(self.text)
        except GuideError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
            raise GuideError(f"guided_decoding_guide is not a valid {self.type}: {_xgrammar_message(exc)}") from None


@functools.lru_cache(maxsize=64)
def _parsed(type_: str, text: str):
    # Errors are not cached: a bad guide fails when it is submitted and goes no further.
    return Guide(type_, text)._parse()


def check_json_schema(schema, path: str = "#") -> None:
    """Refuses the parts of a JSON schema that xgrammar would let pass unenforced."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_json_schema(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key in _UNENFORCED_KEYWORDS:
        if key in schema:
            raise GuideError(f"guided_decoding_guide: JSON schema keyword {key!r} at {path} is not supported "
                             f"by the grammar engine (it would not be enforced)")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _ENFORCED_FORMATS:
        raise GuideError(f"guided_decoding_guide: string format {fmt!r} at {path} is not supported "
                         f"(supported: {', '.join(sorted(_ENFORCED_FORMATS))})")
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise GuideError(f"guided_decoding_guide: multipleOf at {path} is supported on integers only")
    if len(schema.get("allOf") or ()) > 1:
        raise GuideError(f"guided_decoding_guide: allOf with more than one schema at {path} is not supported")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
        raise GuideError(f"guided_decoding_guide: pattern {pattern!r} at {path} uses a lookaround, "
                         f"which the grammar engine does not support")
    for key, value in schema.items():
        if key not in ("enum", "const", "default", "examples", "description", "title"):
            check_json_schema(value, f"{path}/{key}")


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GuideError(f"guided_decoding_guide is not {what}: invalid JSON ({exc})") from None


def _xgrammar_message(exc: Exception) -> str:
    # xgrammar prefixes "[time] /path/file.cc:line: "; the rest is the user's part.
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def _xgrammar():
    # Imported on first use: it takes seconds, which servers that never constrain do not pay.
    import xgrammar

    return xgrammar


class Grammars:
    """Compiles guides on one worker thread (never the engine's), cached by (type, text); the
    tokenizer's description is built there too, at the first guide."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer_dir, self.vocab_size, self.stop_token_ids = tokenizer_dir, vocab_size, sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritone-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = None
        self._bitmask: torch.Tensor | None = None

    def compile(self, guide: Guide) -> Future:
        """A future of the guide's compiled grammar (already done for a cached one)."""
        key = (guide.type, guide.text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.cancelled() or (future.done() and future.exception() is not None)):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, guide)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _compile(self, guide: Guide):
        xgr = _xgrammar()
        if self._compiler is None:
            from tritone.text import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            # One compile thread: on a host with few cores the engine's forward pass needs the rest.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(guide.check())

    def matcher(self, compiled):
        return _xgrammar().GrammarMatcher(compiled, terminate_without_stop_token=False)

    def fill_bitmask(self, matchers: list) -> np.ndarray:
        """The tokens each matcher allows next: a [len(matchers), words] int32 bitmask (xgrammar's
        layout), filled in one call, for the runner to mask its logits with (apply_bitmask)."""
        xgr = _xgrammar()
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(max(len(matchers), 64), self.vocab_size)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        bitmask = self._bitmask[:len(matchers)]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask.numpy().copy()

    def close(self) -> None:
        """Stops the compile thread (a compile under way runs to its end): an engine that is
        rebuilt after its workers died leaves no thread behind."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray, to) -> None:
    """Masks, in place, the logits rows `rows` [B, V] to the tokens that `bitmask` (one row per
    entry of `rows`, from Grammars.fill_bitmask) allows: one masking operation. `to(array,
    device, dtype)`: how host arrays reach the logits' device (the sampler's ToDevice)."""
    index = to(rows, logits.device, np.int64)
    sub = logits.index_select(0, index)
    _xgrammar().apply_token_bitmask_inplace(sub, to(bitmask, logits.device),
                                            vocab_size=min(logits.shape[1], bitmask.shape[1] * 32))
    logits[index] = sub
