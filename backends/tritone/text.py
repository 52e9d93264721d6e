"""Tokenization for preprocessing and stateless incremental detokenization for postprocessing."""

from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

# Generated ids sent before each streamed chunk so that a stateless detokenizer can decode the
# chunk in context: enough to span any character split over byte tokens (4 bytes) plus the
# tokens a tokenizer's decoder looks back at for spacing.
NUM_CONTEXT_IDS = 8

_REPLACEMENT = "\ufffd"


def load_tokenizer(model_dir: str):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.is_fast:
        raise ValueError(f"{model_dir} has no fast (tokenizers) tokenizer; Tritone needs one")
    return tokenizer


class PromptEncoder:
    """Turns request text into engine inputs, many requests per call."""

    def __init__(self, model_dir: str, chat_template: str = "auto"):
        if chat_template not in ("auto", "never"):
            raise ValueError(f"chat_template must be auto or never, got {chat_template!r}")
        self.tokenizer = load_tokenizer(model_dir)
        # An instruct model answers a bare prompt well only inside its chat template.
        self.use_chat_template = chat_template == "auto" and bool(self.tokenizer.chat_template)

    def encode(self, texts: list[str], apply_chat_template: list[bool | None] | None = None) -> list[list[int]]:
        flags = apply_chat_template or [None] * len(texts)
        templated = [self.use_chat_template if f is None else f for f in flags]
        if any(templated) and not self.tokenizer.chat_template:
            raise ValueError("apply_chat_template: the model has no chat template")
        plain = [t for t, use in zip(texts, templated) if not use]
        chat = [self.render_chat([{"role": "user", "content": t}]) for t, use in zip(texts, templated) if use]
        # The template already holds the special tokens the model expects.
        plain_ids = iter(self.tokenizer(plain).input_ids if plain else [])
        chat_ids = iter(self.tokenizer(chat, add_special_tokens=False).input_ids if chat else [])
        return [next(chat_ids) if use else next(plain_ids) for use in templated]

    def render_chat(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_words(self, words: list[str]) -> list[list[int]]:
        if not words:
            return []
        return self.tokenizer(list(words), add_special_tokens=False).input_ids


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


def _final_text(text: str, is_final: bool) -> str:
    # A trailing U+FFFD may be a character whose remaining bytes are in tokens not yet seen.
    return text if is_final else text.rstrip(_REPLACEMENT)


def decode_delta(tokenizer, context_ids: list[int], new_ids: list[int], is_final: bool,
                 skip_special_tokens: bool = True) -> str:
    """Text that `new_ids` add after `context_ids`, counting only text that later tokens cannot
    change. Stateless: the previous chunk emitted exactly `_final_text(decode(its context + ids))`,
    and decoding the shared tail in a shorter context gives the same tail."""
    before = _final_text(tokenizer.decode(context_ids, skip_special_tokens=skip_special_tokens), False)
    after = _final_text(tokenizer.decode(context_ids + new_ids, skip_special_tokens=skip_special_tokens), is_final)
    if after.startswith(before):
        return after[len(before):]
    common = 0
    for a, b in zip(before, after):
        if a != b:
            break
        common += 1
    return after[common:]


def context_window(ids: list[int], num_new: int) -> list[int]:
    """The ids just before the last `num_new` ones, for `decode_delta`."""
    end = len(ids) - num_new
    return ids[max(0, end - NUM_CONTEXT_IDS):end]
