"""An llm response's tensors: built from the engine's outputs in the llm model, with stop words
matched on the text, and read back by postprocessing."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import numpy as np

from tritone.scheduling.request import FinishReason, RequestOutput
from tritone.serving.flow import ChunkWatch, FlowBoard
from tritone.serving.inputs import LLMRequest
from tritone.text import Detokenizer, StopMatcher


# finish_reason codes in STATE: 0 while the request runs.
FINISH_REASONS = ("",) + tuple(reason.value for reason in FinishReason)


class ResponseState(NamedTuple):
    """An llm response's scalars, packed into one int64 tensor `STATE` in this order and followed
    by the ids of the chunk's decoding context (its log probabilities, when asked for, go into
    one float32 tensor `LOG_PROBS`, the cumulative one first): every tensor is work for the Python
    backend, tritonserver and postprocessing, once per response."""

    is_final: bool
    skip_special_tokens: bool
    num_dropped_chars: int
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str
    # The stream's flow-board key (0: none), which postprocessing marks.
    request_key: int
    # The stream's chunk number, and the chunk's place among every stream's chunks in the order
    # they were sent: what postprocessing marks on the flow board (tritone.serving.flow).
    chunk_seq: int
    send_seq: int

    @classmethod
    def read(cls, state: np.ndarray) -> "ResponseState":
        v = state.reshape(-1)[:len(cls._fields)].tolist()
        return cls(bool(v[0]), bool(v[1]), v[2], v[3], v[4], FINISH_REASONS[v[5]], *v[6:])

    @classmethod
    def context_ids(cls, state: np.ndarray) -> list[int]:
        return state.reshape(-1)[len(cls._fields):].tolist()

    def tensor(self, context_ids: list[int] = ()) -> np.ndarray:
        return np.array([*self._replace(finish_reason=FINISH_REASONS.index(self.finish_reason)), *context_ids],
                        dtype=np.int64)


@dataclass(slots=True)
class ResponseStream:
    """One request's output side in the `llm` model: turns engine outputs into responses.

    It runs in the engine's sender thread. Every response carries the ids not sent before and
    the context a stateless postprocessing needs to decode them. With stop words it also decodes
    the ids itself, holds back those whose text could begin a stop word, and on a match sends the
    final response early (the caller then aborts the engine's request with reason "stop"). With a
    flow board (a stream of the ensemble), a chunk waits while the last one has not reached
    postprocessing: its tokens go out with the next one (tritone.serving.flow).
    """

    request: LLMRequest
    detokenizer: Detokenizer
    # A streamed response carries at least this many new tokens, except the first and the final
    # one: fewer responses, each with more text (vLLM's --stream-interval).
    stream_interval: int = 1
    # The stream's key on the flow board (tritone.serving.flow.new_key); 0 without one.
    key: int = 0
    # Ids the client sees: the prompt first when it asked for it, then the generated ids.
    ids: list[int] = field(default_factory=list)
    num_prompt_ids: int = 0
    log_probs: list[float] = field(default_factory=list)
    # Where the request asked for num_top_log_probs: one TopLogProbs per generated token.
    top_log_probs: list = field(default_factory=list)
    # Where it asked for num_prompt_log_probs: the prompt's scores until a response carries them.
    prompt_top_log_probs: list | None = None
    num_sent: int = 0
    stop: StopMatcher | None = None
    is_finished: bool = False
    flow: FlowBoard | None = None
    # Numbers every chunk of every stream in the order sent (one counter for the llm model).
    sends: Iterator[int] = field(default_factory=itertools.count)
    # The last chunk sent, until the stream's final one.
    in_flight: ChunkWatch | None = None
    # Which of its request's num_return_sequences this stream is (None: the only one).
    sequence_index: int | None = None

    def __post_init__(self):
        if not self.request.exclude_input_in_output:
            self.ids.extend(self.request.prompt_ids)
            self.num_prompt_ids = len(self.ids)
        if self.request.stop_words:
            self.stop = StopMatcher(self.detokenizer, self.request.stop_words, self.request.skip_special_tokens,
                                    self.ids)

    def on_output(self, output: RequestOutput) -> dict[str, np.ndarray] | None:
        """The response tensors for this output (which may carry several new tokens), or None
        while there is nothing to send; None for anything after the final response."""
        if self.is_finished:
            return None
        self.ids.extend(output.new_token_ids)
        self.log_probs.extend(output.new_log_probs)
        self.top_log_probs.extend(output.new_top_log_probs or ())
        if output.prompt_top_log_probs is not None:
            self.prompt_top_log_probs = output.prompt_top_log_probs
        end, num_dropped, reason = len(self.ids), 0, output.finish_reason
        if self.stop is not None:
            stop_start = self.stop.feed(self.ids, output.finished)
            if stop_start is not None:
                end, num_dropped = self.stop.cut(self.ids, stop_start, self.num_sent)
                reason = FinishReason.STOP
            elif not output.finished:
                end = self.stop.num_safe_ids()
        final = output.finished or reason == FinishReason.STOP
        if not final and (not self.request.stream or end == self.num_sent
                          or (self.num_sent > self.num_prompt_ids and end - self.num_sent < self.stream_interval)
                          or self.is_held()):
            return None
        return self._response(end, final, reason, num_dropped)

    def failed(self, message: str) -> dict[str, np.ndarray]:
        """The final chunk of a stream of the ensemble that failed: no new tokens, finish reason
        "error", and `message` in ERROR, which postprocessing turns into the error response.

        Triton 2.51's ensemble stops counting its steps' final responses once one step has
        failed, so an error sent by the llm step while postprocessing still holds one of the
        stream's chunks leaves the ensemble request in flight for good, and the server can never
        exit cleanly. Sent as a chunk, the error follows the stream's other chunks through
        postprocessing (preserve_ordering), and fails the ensemble only after the last of them."""
        tensors = self._response(self.num_sent, True, FinishReason.ERROR, 0)
        tensors["ERROR"] = np.array([message.encode("utf-8", "replace")], dtype=np.object_)
        return tensors

    def is_held(self) -> bool:
        """Whether the last chunk is still on its way to postprocessing."""
        watch = self.in_flight
        return watch is not None and not self.flow.is_received(watch.key, watch.seq)

    def _response(self, end: int, final: bool, reason: FinishReason | None,
                  num_dropped: int) -> dict[str, np.ndarray]:
        skip = self.request.skip_special_tokens
        context = self.detokenizer.context(self.ids, self.num_sent, skip)
        new_ids = self.ids[self.num_sent:end]
        first, last = max(0, self.num_sent - self.num_prompt_ids), end - self.num_prompt_ids
        self.num_sent, self.is_finished = end, final
        seq, sent = (self.in_flight.seq + 1 if self.in_flight else 1), next(self.sends)
        if self.flow is not None:
            self.flow.sending(self.key, sent)
        self.in_flight = None if final or self.flow is None else ChunkWatch(self.key, seq, sent, time.monotonic_ns())
        # num_output_tokens: generated tokens sent so far; after a stop word, up to the one where it starts.
        state = ResponseState(final, skip, num_dropped, len(self.request.prompt_ids), last,
                              reason.value if final and reason else "", self.key, seq, sent)
        tensors = {"TOKEN_IDS": np.array(new_ids, dtype=np.int32), "STATE": state.tensor(context)}
        if self.sequence_index is not None:
            tensors["SEQUENCE_INDEX"] = np.array([self.sequence_index], dtype=np.int32)
        if self.request.params.return_log_probs:
            tensors["LOG_PROBS"] = np.array([sum(self.log_probs[:last])] + self.log_probs[first:last], dtype=np.float32)
        k = self.request.params.num_top_log_probs
        if k is not None:
            tensors.update(top_log_prob_tensors(self.top_log_probs[first:last], k))
        if self.prompt_top_log_probs is not None:
            tensors.update(prompt_log_prob_tensors(self.request.prompt_ids, self.prompt_top_log_probs,
                                                   self.request.params.prompt_log_probs))
            self.prompt_top_log_probs = None
        return tensors


def top_log_prob_tensors(top: list, k: int) -> dict[str, np.ndarray]:
    """TOP_LOG_PROBS [n, k + 1]: each generated token's raw log-probability, then the k most likely
    tokens'; TOP_IDS [n, k]: those tokens. Rows are padded with -inf and -1 where the vocabulary
    holds fewer than k tokens."""
    log_probs = np.full((len(top), k + 1), -np.inf, dtype=np.float32)
    ids = np.full((len(top), k), -1, dtype=np.int32)
    for i, entry in enumerate(top):
        log_probs[i, 0] = entry.log_prob
        log_probs[i, 1:1 + len(entry.log_probs)] = entry.log_probs
        ids[i, :len(entry.token_ids)] = entry.token_ids
    return {"TOP_LOG_PROBS": log_probs.reshape(-1), "TOP_IDS": ids.reshape(-1)}


def error_message(output: RequestOutput) -> str | None:
    if output.finish_reason == FinishReason.ERROR:
        return output.error or "request failed"
    return None


def prompt_log_prob_tensors(prompt_ids: list[int], scores: list, k: int) -> dict[str, np.ndarray]:
    """PROMPT_LOG_PROBS [n, k + 1]: each prompt token's log-probability given the tokens before it
    (NaN for the first, which has none), then the k most likely tokens' at its place; PROMPT_IDS
    [n, k + 1]: the prompt token, then those tokens (-1 pads, as TOP_IDS)."""
    n = len(prompt_ids)
    log_probs = np.full((n, k + 1), -np.inf, dtype=np.float32)
    ids = np.full((n, k + 1), -1, dtype=np.int32)
    ids[:, 0] = prompt_ids
    log_probs[0, 0] = np.nan
    for i, entry in enumerate(scores[:n - 1], start=1):
        log_probs[i, 0] = entry.log_prob
        log_probs[i, 1:1 + len(entry.log_probs)] = entry.log_probs
        ids[i, 1:1 + len(entry.token_ids)] = entry.token_ids
    return {"PROMPT_LOG_PROBS": log_probs.reshape(-1), "PROMPT_IDS": ids.reshape(-1)}
