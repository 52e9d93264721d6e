"""The preprocessing and postprocessing models' work on a batch of requests: prompts to token
ids, and llm responses to text."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from tritone.config import parameter
from tritone.serving.flow import FlowBoard
from tritone.serving.inputs import Getter, decode_text, parse_messages, parse_tools, scalar, text_list
from tritone.serving.responses import ResponseState
from tritone.text import Detokenizer


class Preprocessor:
    """The `preprocessing` model's work for a batch of requests: one tokenizer call for all."""

    def __init__(self, params: dict[str, str]):
        from tritone.text import PromptEncoder

        self.encoder = PromptEncoder(params["model_dir"], parameter(params, "chat_template"))
        self.max_input_len = parameter(params, "max_input_len") or parameter(params, "max_model_len") \
            or _model_context(params["model_dir"])
        # Prompt text is tokenized before its token count can be checked; this bounds that work.
        self.max_input_bytes = parameter(params, "max_input_bytes")

    def __call__(self, getters: list[Getter]) -> list["dict[str, np.ndarray] | ValueError"]:
        from tritone.text import to_word_list_tensor

        results: list = [None] * len(getters)
        prepared, index = [], []
        for i, get in enumerate(getters):
            name = "text_input"
            if get("PROMPT_TOKEN_IDS") is not None:  # a prompt already in tokens: nothing to prepare
                results[i] = self._given_ids(get)
                continue
            try:
                name, prompt = self._prompt(get)
                flag = scalar(get, "APPLY_CHAT_TEMPLATE")
                tools = get("TOOLS")
                tools = None if tools is None else parse_tools(tools.reshape(-1)[0], self.max_input_bytes)
                text = self.encoder.prepare(prompt, None if flag is None else bool(flag), tools)
                bad_words = self.encoder.encode_bad_words(text_list(get, "BAD_WORDS"))
            except ValueError as exc:
                results[i] = exc
                continue
            except Exception as exc:  # an input no check foresaw fails its own request, not the batch
                results[i] = ValueError(f"{name} cannot be prepared: {type(exc).__name__}: {exc}")
                continue
            results[i] = {"BAD_WORDS_IDS": to_word_list_tensor(bad_words)}
            prepared.append(text)
            index.append((i, name))
        for (i, name), ids in zip(index, self._tokenize(prepared, [name for _, name in index])):
            if isinstance(ids, Exception):
                results[i] = ids
            elif self.max_input_len and len(ids) > self.max_input_len:
                results[i] = ValueError(f"{name} is {len(ids)} tokens long, over the limit of "
                                        f"{self.max_input_len} tokens")
            else:
                results[i]["INPUT_IDS"] = np.array(ids, dtype=np.int32)
        return results

    def _given_ids(self, get: Getter) -> "dict[str, np.ndarray] | ValueError":
        """A prompt sent as token ids (prompt_token_ids), checked for length here and against the
        vocabulary by the llm model."""
        from tritone.text import to_word_list_tensor

        if get("TEXT_INPUT") is not None or get("MESSAGES") is not None:
            return ValueError("give one of text_input, messages and prompt_token_ids")
        ids = get("PROMPT_TOKEN_IDS").reshape(-1)
        if not ids.size:
            return ValueError("prompt_token_ids is empty")
        if self.max_input_len and ids.size > self.max_input_len:
            return ValueError(f"prompt_token_ids is {ids.size} tokens long, over the limit of "
                              f"{self.max_input_len} tokens")
        try:
            bad_words = self.encoder.encode_bad_words(text_list(get, "BAD_WORDS"))
        except ValueError as exc:
            return exc
        return {"INPUT_IDS": ids.astype(np.int32), "BAD_WORDS_IDS": to_word_list_tensor(bad_words)}

    def _tokenize(self, prepared: list, names: list[str]) -> list:
        """One tokenizer call for the batch; if it fails, one call per prompt, so that the prompt
        at fault fails alone."""
        if not prepared:
            return []
        try:
            return self.encoder.tokenize(prepared)
        except Exception:
            pass
        out = []
        for item, name in zip(prepared, names):
            try:
                out.append(self.encoder.tokenize([item])[0])
            except Exception as exc:
                out.append(ValueError(f"{name} cannot be tokenized: {type(exc).__name__}: {exc}"))
        return out

    def _prompt(self, get: Getter) -> tuple[str, str | list[dict]]:
        text, messages = get("TEXT_INPUT"), get("MESSAGES")
        if text is not None and messages is not None:
            raise ValueError("give either text_input or messages, not both")
        if messages is not None:
            return "messages", parse_messages(messages.reshape(-1)[0], self.max_input_bytes)
        if text is None:
            raise ValueError("text_input is missing (or send chat messages as messages)")
        return "text_input", decode_text(text.reshape(-1)[0], max_bytes=self.max_input_bytes)


def _model_context(model_dir: str) -> int:
    """The model's own context length, so that an over-long prompt fails here, naming its field.
    Read straight from config.json where it is there in plain sight: AutoConfig imports torch,
    which this process otherwise never needs (about 2.5 s of every instance's start)."""
    try:
        plain = json.loads((pathlib.Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        plain = {}
    if isinstance(plain.get("max_position_embeddings"), int) and not any("config" in k for k in plain):
        return plain["max_position_embeddings"]
    from transformers import AutoConfig

    from tritone.model_limits import context_length

    try:
        return context_length(AutoConfig.from_pretrained(model_dir))
    except (OSError, ValueError):
        return 0


class Postprocessor:
    """The `postprocessing` model's work: text deltas for a batch of llm responses."""

    def __init__(self, detokenizer: Detokenizer, flow: FlowBoard | None = None):
        self.detokenizer, self.flow = detokenizer, flow
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_parameters(cls, params: dict[str, str], flow: FlowBoard | None = None) -> "Postprocessor":
        from tritone.text import load_tokenizer

        return cls(Detokenizer(load_tokenizer(params["model_dir"])), flow)

    def __call__(self, getters: list[Getter]) -> list["dict[str, np.ndarray] | Exception"]:
        # A public model: a malformed request (from a direct caller) fails alone.
        raw = [get("STATE") for get in getters]
        states = [_read_state(r) for r in raw]
        if self.flow is not None:  # first of all: the llm model holds these streams until then
            self.flow.received([(s.request_key, s.chunk_seq, s.send_seq) for s in states
                                if not isinstance(s, Exception)])
        try:
            return [state if isinstance(state, Exception) else self._checked(get, state, r)
                    for get, state, r in zip(getters, states, raw)]
        finally:
            if self.flow is not None:
                self.flow.done()

    def _checked(self, get: Getter, state: ResponseState, raw: np.ndarray):
        error = get("ERROR")
        if error is not None:  # the stream failed in the engine (ResponseStream.failed)
            return RuntimeError(_text(error))
        try:
            return self._one(get, state, ResponseState.context_ids(raw))
        except Exception as exc:
            return ValueError(f"token_ids cannot be decoded: {type(exc).__name__}: {exc}")

    def _one(self, get: Getter, state: ResponseState, context_ids: list[int]) -> dict[str, np.ndarray]:
        # Every output tensor is work for this process and tritonserver on every response: the
        # prompt's count comes with the first and the final one, the finish reason with the final.
        new_ids = get("TOKEN_IDS").tolist()
        result = {
            "TEXT_OUTPUT": np.array([self.text(new_ids, context_ids, state).encode()], np.object_),
            "OUT_NUM_OUTPUT_TOKENS": np.array([state.num_output_tokens], dtype=np.int32),
        }
        if state.is_final or state.num_output_tokens <= len(new_ids):  # all so far: the first
            result["OUT_NUM_INPUT_TOKENS"] = np.array([state.num_input_tokens], dtype=np.int32)
        if state.is_final:
            result["OUT_FINISH_REASON"] = np.array([state.finish_reason.encode()], dtype=np.object_)
        log_probs = get("LOG_PROBS")
        if log_probs is not None:  # only for requests that asked for them
            result["OUT_CUM_LOG_PROBS"] = log_probs[:1]
            result["OUT_OUTPUT_LOG_PROBS"] = log_probs[1:]
        top = get("TOP_LOG_PROBS")
        if top is not None:  # only for requests that asked for num_top_log_probs
            result["OUT_TOP_LOG_PROBS"] = np.array([self.top_log_probs(new_ids, top, get("TOP_IDS")).encode()],
                                                   np.object_)
        sequence = get("SEQUENCE_INDEX")
        if sequence is not None:  # only for requests of several sequences
            result["OUT_SEQUENCE_INDEX"] = sequence.reshape(-1)[:1].astype(np.int32)
        prompt = get("PROMPT_LOG_PROBS")
        if prompt is not None:  # only for requests that asked for num_prompt_log_probs, once
            result["OUT_PROMPT_LOG_PROBS"] = np.array(
                [self.prompt_log_probs(prompt, get("PROMPT_IDS"), state.num_input_tokens).encode()], np.object_)
        return result

    def prompt_log_probs(self, log_probs: np.ndarray, ids: np.ndarray | None, num_prompt: int) -> str:
        """JSON: for each prompt token, [its text, its log-probability given the tokens before it
        (null for the first), [[text, log-probability] of the k most likely tokens at its place]]."""
        if ids is None or ids.size != log_probs.size or not num_prompt or ids.size % num_prompt:
            raise ValueError("prompt_log_probs and prompt_ids do not match the prompt")
        width = ids.size // num_prompt
        rows, ids = log_probs.reshape(num_prompt, width).tolist(), ids.reshape(num_prompt, width).tolist()
        entries = []
        for i, (row, row_ids) in enumerate(zip(rows, ids)):
            alternatives = [[self.token_text(t), lp] for t, lp in zip(row_ids[1:], row[1:]) if t >= 0]
            entries.append([self.token_text(row_ids[0]), None if i == 0 else row[0], alternatives])
        return json.dumps(entries)

    def top_log_probs(self, new_ids: list[int], top: np.ndarray, top_ids: np.ndarray | None) -> str:
        """JSON: for each generated token of the chunk, [its text, its log-probability, [[text,
        log-probability] of the k most likely tokens]]; each token's text decoded alone, as vLLM
        names tokens in log-probabilities."""
        top_ids = np.zeros(0, np.int32) if top_ids is None else top_ids.reshape(-1)
        n = top.size - top_ids.size
        if n < 0 or n > len(new_ids) or (n and top_ids.size % n):
            raise ValueError("top_log_probs and top_ids do not match token_ids")
        k = top_ids.size // n if n else 0
        rows, ids = top.reshape(n, k + 1).tolist(), top_ids.reshape(n, k).tolist()
        entries = []
        for token_id, row, alternatives in zip(new_ids[len(new_ids) - n:], rows, ids):
            entries.append([self.token_text(token_id), row[0],
                            [[self.token_text(t), lp] for t, lp in zip(alternatives, row[1:]) if t >= 0]])
        return json.dumps(entries)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.detokenizer.tokenizer.decode([token_id])
        return text

    def text(self, new_ids: list[int], context_ids: list[int], state: ResponseState) -> str:
        text = self.detokenizer.delta(context_ids, new_ids, is_final=state.is_final,
                                      skip_special_tokens=state.skip_special_tokens)
        # A stop word begins inside this chunk's text: it ends right before it.
        return text[:max(0, len(text) - state.num_dropped_chars)]


def _text(tensor: np.ndarray) -> str:
    value = tensor.reshape(-1)[0] if tensor.size else b""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _read_state(raw: np.ndarray | None) -> "ResponseState | ValueError":
    if raw is None or raw.size < len(ResponseState._fields):
        return ValueError("state is missing or too short")
    try:
        state = ResponseState.read(raw)
    except (IndexError, ValueError, TypeError) as exc:
        return ValueError(f"state is malformed: {exc}")
    return state
