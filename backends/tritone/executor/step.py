"""The runner's typed seams: one step's model inputs, and the tokens it takes from the step before."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepInput:
    """A step's model inputs as host arrays (ModelRunner.prepare), S sequences of T tokens in all."""

    ids: np.ndarray  # [T] int64 token ids
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: where each token's KV goes in the paged cache
    tables: np.ndarray  # [S, blocks] int32: each sequence's block table
    query_start: np.ndarray  # [S + 1] int32: where each sequence's tokens start in ids
    seq_lens: np.ndarray  # [S] int32: each sequence's length after this step
    logits_indices: np.ndarray  # [R]: the token whose logits each sampling row takes
    num_decodes: int  # the leading sequences with a one-token query


@dataclass(slots=True)
class PendingTokens:
    """Tokens that the step in flight sampled and this step reads (async scheduling): they stay on
    the device, and `ids[dst] = token_ids[src]` is done there."""

    token_ids: torch.Tensor  # the step in flight's sampled ids, on the device
    src: np.ndarray  # rows of token_ids
    dst: np.ndarray  # places in this step's ids
