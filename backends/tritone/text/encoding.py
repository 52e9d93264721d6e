"""Prompts to token ids for preprocessing: text or chat messages, stop and bad words, and
TensorRT-LLM's word-list tensors."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from tritone.text.templates import has_tool_turns, hermes_tool_messages, template_takes_tools


# The class names under which transformers saves a plain `tokenizers` tokenizer: the class
# AutoTokenizer resolves them to is PreTrainedTokenizerFast itself.
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str):
    # Here, not at the top: the OpenAI front end, which reads chat templates, need not pay for
    # importing transformers. A plain fast tokenizer is loaded by its class rather than through
    # AutoTokenizer, whose model-config lookup imports torch: each text process would start
    # about 2.5 s later and hold torch in memory for nothing.
    import transformers

    name = None
    config = pathlib.Path(model_dir) / "tokenizer_config.json"
    if config.is_file():
        name = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    if name in _PLAIN_FAST:
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
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
        if (tools or has_tool_turns(messages)) and not template_takes_tools(self.tokenizer.chat_template):
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
