"""What the engine knows about one request: its parameters, its tokens and its progress."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from tritone.scheduling.grammar import Guide


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


# As in vLLM: a lower temperature is greedy, since dividing logits by it overflows to inf and NaN.
MIN_TEMPERATURE = 1e-5
# OpenAI's and vLLM's range for presence and frequency penalties.
MAX_ABS_ADDITIVE_PENALTY = 2.0
# OpenAI's limits on logit_bias: a bias in [-100, 100] for each of at most 300 tokens.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
# OpenAI's most top_logprobs (chat: 20; completions' logprobs allow 5).
MAX_TOP_LOG_PROBS = 20


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    # Below MIN_TEMPERATURE (0 included) means greedy; so does top_k == 1.
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    # None: stop on the model's end-of-sequence ids; -1: never stop on one (benchmarks).
    end_id: int | None = None
    seed: int | None = None
    bad_token_ids: list[list[int]] = field(default_factory=list)
    return_log_probs: bool = False
    # The most likely tokens to return with each sampled one (None: none), with the sampled
    # token's: log-probabilities of the model's raw logits (vLLM's default), before any transform.
    num_top_log_probs: int | None = None
    # Where set, each prompt token's log-probability given the tokens before it (the first has
    # none) and this many most likely tokens' at its place, computed in the prefill (vLLM's
    # prompt_logprobs): prompt scoring. Such a request computes its whole prompt, prefix cache
    # or not.
    prompt_log_probs: int | None = None
    # The LoRA adapter to apply: its place in --lora-modules, from 1 (0: the base model).
    lora_id: int = 0
    # Token id -> what is added to its logit before anything else (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Constrains the output to a JSON schema, regex, grammar or structural tag
    # (tritone.scheduling.grammar).
    guide: "Guide | None" = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the offending field."""
        # NaN passes every comparison below, and inf makes NaN logits: refuse both first.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > MAX_ABS_ADDITIVE_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}], "
                                 f"got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.end_id is not None and self.end_id != -1 and not 0 <= self.end_id < vocab_size:
            raise ValueError(f"end_id must be -1 or in [0, {vocab_size}), got {self.end_id}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        self._validate_logit_bias(vocab_size)
        if self.lora_id < 0:
            raise ValueError(f"lora_task_id must be >= 0, got {self.lora_id}")
        for name in ("num_top_log_probs", "prompt_log_probs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOG_PROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOG_PROBS}], got {k}")
        for seq in self.bad_token_ids:
            if not seq or any(not 0 <= t < vocab_size for t in seq):
                raise ValueError("bad_token_ids holds an empty or out-of-vocabulary sequence")


    def _validate_logit_bias(self, vocab_size: int) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias holds {len(self.logit_bias)} tokens, over the limit of {MAX_LOGIT_BIAS_TOKENS}")
        for token_id, bias in self.logit_bias.items():
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias names token {token_id}, outside the vocabulary [0, {vocab_size})")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias of token {token_id} must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")


# Stands in output_ids for a token that the device has sampled and the host not yet seen.
PENDING_TOKEN = -1


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens whose KV is in the cache; it catches up with num_tokens (prefill, chunks, decode).
    num_computed_tokens: int = 0
    # Tokens whose KV came from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this request's full blocks, in order; extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of block_ids already offered to the prefix cache, so each step looks only
    # at blocks completed since (per-step work does not grow with the context).
    num_published_blocks: int = 0
    num_preemptions: int = 0
    # The seed of its random draws: its generator lives where it is sampled (the runner).
    seed: int = 0
    end_ids: frozenset[int] = frozenset()
    first_token_time: float | None = None
    last_token_time: float = 0.0
    # Output tokens launched but not yet back from the device (async scheduling): their places
    # in output_ids hold PENDING_TOKEN.
    num_pending_tokens: int = 0
    # The runner's block-table row while it runs (-1: none yet).
    block_table_row: int = -1
    # A guided request's compiled grammar on its way (a Future; the scheduler does not admit the
    # request until it is done), then its matcher, advanced by every token the engine keeps.
    grammar_future: object = None
    matcher: object = None
    # Whether the runner has its sampling state (it gets it when the request is first scheduled).
    in_runner: bool = False
    # With params.prompt_log_probs: prompt positions whose next token's log-probability has been
    # launched (a recompute after preemption does not score them again), and the scores back.
    num_prompt_scored: int = 0
    prompt_top_log_probs: list["TopLogProbs"] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has (placeholders of tokens still on the device not counted)."""
        return len(self.output_ids) - self.num_pending_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def tokens_slice(self, start: int, end: int) -> list[int]:
        return tokens_slice(self.prompt_ids, self.output_ids, start, end)


def tokens_slice(prompt_ids: list[int], output_ids: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of a sequence held as its prompt and its output, without joining them."""
    n = len(prompt_ids)
    if end <= n:
        return prompt_ids[start:end]
    if start >= n:
        return output_ids[start - n:end - n]
    return prompt_ids[start:] + output_ids[:end - n]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the engine's only output type."""

    request_id: str
    new_token_ids: list[int]
    new_log_probs: list[float]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Where the request asked for num_top_log_probs: one TopLogProbs per new token.
    new_top_log_probs: list["TopLogProbs"] | None = None
    # Where it asked for prompt_log_probs, with its first token: one TopLogProbs per prompt token
    # after the first, in order.
    prompt_top_log_probs: list["TopLogProbs"] | None = None


@dataclass(slots=True)
class TopLogProbs:
    """A sampled token's raw log-probability and the most likely tokens' (ids, log-probabilities),
    most likely first."""

    log_prob: float
    token_ids: list[int]
    log_probs: list[float]


def request_output(request: Request, new_ids: list[int], new_lps: list[float], error: str | None = None,
                   new_top: list[TopLogProbs] | None = None,
                   prompt_top: list[TopLogProbs] | None = None) -> RequestOutput:
    return RequestOutput(request_id=request.request_id, new_token_ids=new_ids, new_log_probs=new_lps,
                         num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                         finished=request.is_finished, finish_reason=request.finish_reason, error=error,
                         new_top_log_probs=new_top, prompt_top_log_probs=prompt_top)
