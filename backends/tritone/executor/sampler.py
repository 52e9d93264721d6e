"""Vectorized sampling with per-request parameters and per-request random streams.

It runs where the logits are (the runner, in the first worker under tensor parallelism), on
each request's SamplingState, so that only token ids and log-probabilities leave the runner.
Each sampled request draws one uniform per step from its own generator, inverted through its
row's distribution, so a seeded request yields the same tokens whatever else shares the batch.
Guided requests' logits are first masked to what their grammars allow (a bitmask filled by
tritone.scheduling.grammar in the engine's process), and requests' logit_bias is added (as in vLLM,
before the penalties). The transforms then follow Hugging Face's logits processors, in the
order `generate` applies them: repetition penalty (over prompt and output tokens), presence and
frequency penalties (output tokens, as in vLLM), bad words and min_tokens bans; then, for sampled
rows, temperature, top-k, top-p over what top-k kept, min-p.

On a GPU nothing here waits for the device: every per-request value (temperatures, top-k, rows,
banned ids, counts) is laid out on the host, where every branch is decided, and goes to the
device through pinned staging buffers without a wait (a copy from ordinary memory, or a device
value read on the host, would wait for the step's forward pass).
"""

from __future__ import annotations

import numpy as np
import torch

from tritone.executor.kernels import argmax_rows, sample_rows, top_p_rows
from tritone.executor.sampling_state import SamplingState
from tritone.executor.staging import HostStaging
from tritone.executor.step import TopRows
from tritone.scheduling.grammar import apply_bitmask

_NEG_INF = float("-inf")


class ToDevice:
    """Host arrays to the logits' device: from a pinned staging buffer without a wait on a GPU;
    as they are on a CPU."""

    def __init__(self, staging: HostStaging | None = None):
        self.staging = staging

    def __call__(self, array, device: torch.device, dtype=None) -> torch.Tensor:
        a = np.asarray(array, dtype=dtype)
        if self.staging is None or not self.staging.staged:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return self.staging.to_device(a)


_PLAIN = ToDevice()


def banned_token_ids(request: SamplingState) -> list[int]:
    """Tokens that would complete a bad-word sequence, or end the output before min_tokens."""
    banned = []
    num_tokens = request.num_tokens
    for seq in request.params.bad_token_ids:
        # As in Hugging Face: a bad word may begin in the prompt and end in the output.
        n = len(seq) - 1
        if n == 0 or (n <= num_tokens and request.tokens_slice(num_tokens - n, num_tokens) == list(seq[:-1])):
            banned.append(seq[-1])
    # A guided request ends where its grammar does (its mask then leaves only the stop tokens).
    if request.num_output < request.params.min_tokens and not request.is_guided:
        banned.extend(request.end_ids)
    return banned


def needs_logits(requests: list[SamplingState]) -> bool:
    """False where every request takes the plain greedy token: no penalty, ban, sampling or log
    probabilities, so that the argmax of the raw logits is the answer and the runner may skip
    writing them."""
    for r in requests:
        p = r.params
        if (r.is_guided or not p.is_greedy or p.return_log_probs or _has_penalty(r) or p.bad_token_ids
                or p.logit_bias or p.num_top_log_probs is not None or (r.num_output < p.min_tokens and r.end_ids)):
            return True
    return False


class Sampler:
    def __init__(self, staging: HostStaging | None = None):
        """`staging`: pinned buffers for the per-step values (the runner's on a GPU)."""
        self.staging = staging
        self.to = ToDevice(staging)

    def __call__(self, logits: torch.Tensor, requests: list[SamplingState]) -> tuple[list[int], list[float]]:
        """Returns one token id per row of `logits` [B, V] and its log-probability (under the
        distribution after penalties and bans, before temperature, top-k, top-p and min-p)."""
        token_ids, log_probs = self.sample(logits, requests)
        return token_ids.tolist(), log_probs.tolist() if log_probs is not None else [0.0] * len(requests)

    def sample_step(self, out: torch.Tensor, requests: list[SamplingState], sampling,
                    greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None, TopRows | None]:
        """A runner's step: `out` holds the greedy tokens where `greedy` (needs_logits said no),
        else the logits; `sampling` its SamplingInput. Returns as `sample`, with the top
        log-probabilities of the rows that asked for them, taken from the raw logits."""
        if greedy:
            return out, None, None
        if self.staging is not None:
            self.staging.begin_step()
        raw = raw_log_probs(out, requests, self.to)
        token_ids, log_probs = self.sample(out, requests, sampling.guided_rows, sampling.bitmask)
        top = None if raw is None else top_log_probs(raw, token_ids, requests, self.to)
        if self.staging is not None:
            self.staging.end_step()
        return token_ids, log_probs, top

    def sample(self, logits: torch.Tensor, requests: list[SamplingState], guided_rows: list[int] = (),
               bitmask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `__call__`, as tensors on the logits' device: [B] int64 ids, and [B] float32
        log-probabilities where a request asked for them (else None). `bitmask`: the tokens that
        the rows `guided_rows` may take."""
        logits = logits.float()
        to = self.to
        if guided_rows:
            apply_bitmask(logits, list(guided_rows), bitmask, to)
        apply_logit_bias(logits, requests, to)
        apply_penalties(logits, requests, to)
        apply_bans(logits, requests, to)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if len(sampled_rows) == len(requests):
            # No argmax to overwrite and no copy of the rows (at 128 rows of a 49,152-token
            # vocabulary a 25 MB copy, new pages each step).
            token_ids = self._sample(logits, requests)
        else:
            token_ids = argmax_rows(logits)
            if sampled_rows:
                index = to(sampled_rows, logits.device, np.int64)
                token_ids[index] = self._sample(logits.index_select(0, index), [requests[i] for i in sampled_rows])
        log_probs = None
        if any(r.params.return_log_probs for r in requests):
            log_probs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).flatten()
        return token_ids, log_probs

    def _sample(self, logits: torch.Tensor, requests: list[SamplingState]) -> torch.Tensor:
        # One uniform per row from the request's own generator, inverted through the row's
        # distribution (kernels.sample_rows): a seeded request draws the same whatever else
        # shares the batch. Rows without top-k, top-p or min-p skip `warp` and its sorting;
        # their temperature goes to the kernel.
        device, to = logits.device, self.to
        u = np.array([float(torch.rand((), dtype=torch.float64, generator=r.generator)) for r in requests])
        inv_temperature = np.array([1.0 / r.params.temperature for r in requests], dtype=np.float32)
        warped = [i for i, r in enumerate(requests) if _warps(r.params)]
        if len(warped) == len(requests):
            logits = warp(logits, requests, to)
            inv_temperature[:] = 1.0
        elif warped:
            index = to(warped, device, np.int64)
            logits = logits.clone()
            logits[index] = warp(logits.index_select(0, index), [requests[i] for i in warped], to)
            inv_temperature[warped] = 1.0
        return sample_rows(logits, to(inv_temperature, device), to(u, device))


def raw_log_probs(logits: torch.Tensor, requests: list[SamplingState],
                  to: ToDevice = _PLAIN) -> tuple[list[int], torch.Tensor] | None:
    """The rows that asked for top log-probabilities and their log-softmax of the model's raw
    logits in fp32 (vLLM's default), taken before sampling edits the logits; None where none asked."""
    rows = [i for i, r in enumerate(requests) if r.params.num_top_log_probs is not None]
    if not rows:
        return None
    return rows, torch.log_softmax(logits.index_select(0, to(rows, logits.device, np.int64)).float(), dim=-1)


def top_log_probs(raw: tuple[list[int], torch.Tensor], token_ids: torch.Tensor,
                  requests: list[SamplingState], to: ToDevice = _PLAIN) -> TopRows:
    """The sampled tokens' raw log-probabilities and the most likely tokens', on the device."""
    rows, log_probs = raw
    k = max(requests[i].params.num_top_log_probs for i in rows)
    index = to(rows, log_probs.device, np.int64)
    chosen = log_probs.gather(1, token_ids[index][:, None]).flatten()
    values, ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], torch.zeros_like(log_probs[:, :0]).long())
    return TopRows(rows, [requests[i].params.num_top_log_probs for i in rows], chosen, ids, values)


def score_prompt(logits: torch.Tensor, targets: np.ndarray, k: int) -> TopRows:
    """Prompt scoring: at each scored position, the next prompt token's log-probability under
    the model's raw logits in fp32, and the k most likely tokens' (as top_log_probs)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.from_numpy(targets).to(log_probs.device, non_blocking=True)
    chosen = log_probs.gather(1, index[:, None]).flatten()
    values, ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], torch.zeros_like(log_probs[:, :0]).long())
    n = len(targets)
    return TopRows(list(range(n)), [k] * n, chosen, ids, values)


def apply_logit_bias(logits: torch.Tensor, requests: list[SamplingState], to: ToDevice = _PLAIN) -> None:
    """In place: each request's biases added to its row, in one scatter for the whole batch (the
    indices go to the device without waiting for it)."""
    rows, token_ids, biases = [], [], []
    for i, request in enumerate(requests):
        bias = request.params.logit_bias
        if bias:
            rows.extend([i] * len(bias))
            token_ids.extend(bias.keys())
            biases.extend(bias.values())
    if not rows:
        return
    device = logits.device
    index = to([rows, token_ids], device, np.int64)
    values = to(biases, device, np.float32)
    logits.index_put_((index[0], index[1]), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: list[SamplingState], to: ToDevice = _PLAIN) -> None:
    """In place: repetition penalty on every token seen in the prompt or the output (as Hugging
    Face and vLLM), then frequency and presence penalties on output tokens (as vLLM)."""
    rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    # Counted on the host, where the histories are: one copy of the counts, no wait.
    counts = np.zeros((len(rows), vocab), dtype=np.float32)
    in_prompt = np.zeros((len(rows), vocab), dtype=np.bool_)
    for j, i in enumerate(rows):
        request = requests[i]
        if request.output_ids:
            counts[j] = np.bincount(np.asarray(request.output_ids), minlength=vocab)[:vocab]
        if request.params.repetition_penalty != 1.0:
            in_prompt[j, np.asarray(request.prompt_ids)] = True
    counts, in_prompt = to(counts, device), to(in_prompt, device)
    index = to(rows, device, np.int64)
    sub = logits.index_select(0, index)
    in_output = counts > 0
    rep = to([requests[i].params.repetition_penalty for i in rows], device, np.float32)[:, None]
    # Divide positive logits, multiply negative ones.
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(in_prompt | in_output, penalized, sub)
    freq = to([requests[i].params.frequency_penalty for i in rows], device, np.float32)[:, None]
    pres = to([requests[i].params.presence_penalty for i in rows], device, np.float32)[:, None]
    logits[index] = sub - freq * counts - pres * in_output.float()


def apply_bans(logits: torch.Tensor, requests: list[SamplingState], to: ToDevice = _PLAIN) -> None:
    rows, token_ids = [], []
    for i, request in enumerate(requests):
        banned = banned_token_ids(request)
        rows.extend([i] * len(banned))
        token_ids.extend(banned)
    if rows:
        index = to([rows, token_ids], logits.device, np.int64)
        logits.index_put_((index[0], index[1]), logits.new_full((len(rows),), _NEG_INF))


def warp(logits: torch.Tensor, requests: list[SamplingState], to: ToDevice = _PLAIN) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, as Hugging Face's warpers in that order: the logits
    a sampled row draws from, with the removed tokens at -inf."""
    device, vocab = logits.device, logits.shape[1]
    temperature = to([r.params.temperature for r in requests], device, np.float32)[:, None]
    top_k = np.array([r.params.top_k or vocab for r in requests], dtype=np.int64)
    top_p = np.array([r.params.top_p for r in requests], dtype=np.float32)
    min_p = np.array([r.params.min_p for r in requests], dtype=np.float32)
    out = _mask_top_k_top_p(logits / temperature, top_k, top_p, to)
    if (min_p > 0).any():
        # Min-p relative to the most likely token, which nothing removes: a token stays while
        # its probability is at least min_p times the largest, whatever the normalisation.
        floor = out.max(dim=-1, keepdim=True).values + torch.log(to(min_p, device))[:, None]
        out.masked_fill_(out < floor, _NEG_INF)
    return out


def _warps(params) -> bool:
    return bool(params.top_k) or params.top_p < 1.0 or params.min_p > 0.0


def _has_penalty(request: SamplingState) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _mask_top_k_top_p(logits, top_k: np.ndarray, top_p: np.ndarray, to: ToDevice = _PLAIN):
    """Top-k, then top-p over what top-k kept renormalised, without sorting the vocabulary: a
    sort of 128 rows of a 49,152-token vocabulary took 270 ms here. Rows with top-k take their
    top_k most likely tokens (torch.topk: 6 ms for 50 of them at 128 rows) and apply top-p among
    them; rows with top-p alone go to a native kernel that buckets the row's mass by value and
    ranks only the bucket where top-p falls (kernels.top_p_rows), or to the sort without it."""
    vocab, device = logits.shape[1], logits.device
    limited, nucleus = top_k < vocab, top_p < 1.0

    def top_k_then_top_p(sub, rows):
        k, p = to(top_k[rows], device), to(top_p[rows], device)
        values, index = sub.topk(int(top_k[rows].max()), dim=-1)  # descending; k decided on the host
        ranks = torch.arange(values.shape[1], device=sub.device)[None, :]
        values = values.masked_fill(ranks >= k[:, None], _NEG_INF)
        probs = torch.softmax(values, dim=-1)
        # A token goes when the tokens above it already hold top_p of the mass; the first stays.
        remove = (probs.cumsum(dim=-1) - probs) >= p[:, None]
        remove[:, 0] = False
        return torch.full_like(sub, _NEG_INF).scatter_(1, index, values.masked_fill(remove, _NEG_INF))

    def top_p_alone(sub, rows):
        sub = sub.contiguous()
        p = to(top_p[rows], device)
        return sub if top_p_rows(sub, p) else _mask_top_k_top_p_sorted(sub, to(top_k[rows], device), p)

    out = _on_rows(logits, limited, top_k_then_top_p, to)
    return _on_rows(out, ~limited & nucleus, top_p_alone, to)


def _on_rows(x, selected: np.ndarray, fn, to: ToDevice = _PLAIN):
    """x with fn(x[rows], rows) in the rows `selected` (a host mask) marks (written into x):
    fn(x, all rows), with no copies, where it marks them all; x untouched where it marks none."""
    if not selected.any():
        return x
    if selected.all():
        return fn(x, slice(None))
    rows = np.flatnonzero(selected)
    index = to(rows, x.device, np.int64)
    x[index] = fn(x.index_select(0, index), rows)
    return x


def _mask_top_k_top_p_sorted(logits, top_k, top_p):
    """Top-k and top-p over a sort of the whole vocabulary, where the native kernels are missing."""
    # Ascending, as Hugging Face and vLLM sort, so that ties and rounding fall the same way.
    sorted_logits, sorted_idx = logits.sort(dim=-1)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks < (vocab - top_k)[:, None], _NEG_INF)
    # Top-p over the top-k set renormalised: drop the least likely tokens while their mass stays
    # within 1 - top_p; the most likely token always stays.
    remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
    remove[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
