"""The runner's typed seams: one step's model inputs, what sampling needs to know of it, the
tokens it takes from the step before, and the handle of its sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tritone.scheduling.request import TopLogProbs


@dataclass(slots=True)
class StepInput:
    """A step's model inputs as host arrays (Runner.prepare), S sequences of T tokens in all."""

    ids: np.ndarray  # [T] int64 token ids
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: where each token's KV goes in the paged cache
    tables: np.ndarray  # [S, blocks] int32: each sequence's block table
    query_start: np.ndarray  # [S + 1] int32: where each sequence's tokens start in ids
    seq_lens: np.ndarray  # [S] int32: each sequence's length after this step
    logits_indices: np.ndarray  # [R + P]: the token whose logits each sampling row takes, then each scored one
    num_decodes: int  # the leading sequences with a one-token query
    # Prompt scoring: the next prompt token of each of the P scored positions (the last P rows of
    # logits_indices), and the most likely tokens to return at each (the largest k asked).
    score_targets: np.ndarray | None = None
    score_k: int = 0
    # [S] int32: each sequence's LoRA adapter (0: the base model), or None where all are the base's.
    lora_ids: np.ndarray | None = None


@dataclass(slots=True, frozen=True)
class NewRequest:
    """What sampling needs of a request, sent once, when it is first scheduled: the runner keeps
    its state (generator, output tokens) until the request finishes."""

    request_id: str
    prompt_ids: list[int]
    params: object  # tritone.scheduling.request.SamplingParams (its guide is not read here)
    seed: int
    end_ids: frozenset[int]
    is_guided: bool


@dataclass(slots=True)
class SamplingInput:
    """A step's sampling: the requests the runner meets for the first time, those it may forget,
    and which request each sampled row belongs to. Guided rows come with their grammar's mask,
    filled where the grammars live (the engine's process)."""

    # Dropped before `new` is read, so that an id reused after its request ended starts afresh.
    finished_ids: list[str] = field(default_factory=list)
    new: list[NewRequest] = field(default_factory=list)
    # Row r of the step's logits samples for request sample_ids[r].
    sample_ids: list[str] = field(default_factory=list)
    # Rows of sample_ids that a grammar constrains, and their allowed tokens ([rows, words] int32
    # bitmask, xgrammar's layout; a host array, as every input here), or None.
    guided_rows: list[int] = field(default_factory=list)
    bitmask: np.ndarray | None = None


@dataclass(slots=True)
class PendingTokens:
    """Tokens that the step in flight sampled and this step reads (async scheduling): they stay on
    the device, and `ids[dst] = token_ids[src]` is done there."""

    token_ids: torch.Tensor  # the step in flight's sampled ids, on the device
    src: np.ndarray  # rows of token_ids
    dst: np.ndarray  # places in this step's ids

    def patch(self, ids: np.ndarray) -> np.ndarray:
        """A copy of host ids with the pending tokens in place (this copies them to the host)."""
        ids = ids.copy()
        ids[self.dst] = self.token_ids.cpu().numpy()[self.src]
        return ids


@dataclass(slots=True)
class TopRows:
    """The top log-probabilities of the rows that asked for them, on the device: `ids` and
    `log_probs` [len(rows), max k], most likely first; `chosen` [len(rows)]: the sampled tokens'."""

    rows: list[int]
    ks: list[int]
    chosen: torch.Tensor
    ids: torch.Tensor
    log_probs: torch.Tensor

    def by_row(self) -> dict[int, TopLogProbs]:
        """On the host (a wait for the step, only for requests that asked)."""
        chosen, ids, log_probs = self.chosen.tolist(), self.ids.tolist(), self.log_probs.tolist()
        return {row: TopLogProbs(chosen[j], ids[j][:k], log_probs[j][:k])
                for j, (row, k) in enumerate(zip(self.rows, self.ks))}


class ReadyRows(dict):
    """TopRows already on the host, by row (from a worker process)."""

    def by_row(self) -> dict[int, TopLogProbs]:
        return self


class StepHandle:
    """A launched step's sampled ids and log-probabilities: on the device (where the next step's
    inputs read them) and, once `result()` returns, on the host. On CUDA the copy to the host is
    queued behind the step, so launching costs no wait."""

    def __init__(self, token_ids: torch.Tensor | None, log_probs: torch.Tensor | None, num_rows: int):
        self.token_ids, self.num_rows = token_ids, num_rows
        # Set by the runner where a row asked for top log-probabilities, and where the step
        # scored prompt positions (rows in StepInput.score_targets' order).
        self.top: TopRows | ReadyRows | None = None
        self.scores: TopRows | ReadyRows | None = None
        self._event = None
        self._host_ids, self._host_log_probs = token_ids, log_probs
        if token_ids is not None and token_ids.is_cuda:
            self._host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host_ids.copy_(token_ids, non_blocking=True)
            if log_probs is not None:
                self._host_log_probs = torch.empty(log_probs.shape, dtype=log_probs.dtype, pin_memory=True)
                self._host_log_probs.copy_(log_probs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        if self._host_ids is None:
            return [], []
        log_probs = self._host_log_probs.tolist() if self._host_log_probs is not None else [0.0] * self.num_rows
        return self._host_ids.tolist(), log_probs
