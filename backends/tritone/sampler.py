"""Vectorized sampling with per-request parameters and per-request random streams.

Each sampled request draws its noise from its own generator, one row per step, so a seeded
request yields the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from tritone.request import Request

_NEG_INF = float("-inf")


def banned_token_ids(request: Request) -> list[int]:
    """Tokens that would complete a bad-word sequence, or end the output before min_tokens."""
    banned = []
    output = request.output_ids
    for seq in request.params.bad_token_ids:
        prefix = seq[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            banned.append(seq[-1])
    if len(output) < request.params.min_tokens:
        banned.extend(request.end_ids)
    return banned


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[float]]:
        """Returns one token id per row of `logits` [B, V] and its log-probability."""
        logits = logits.float()
        self._apply_penalties(logits, requests)
        self._apply_bans(logits, requests)
        greedy = torch.tensor([r.params.is_greedy for r in requests])
        token_ids = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled_rows = (~greedy).nonzero().flatten().tolist()
            sampled = self._sample(logits[sampled_rows], [requests[i] for i in sampled_rows])
            token_ids[sampled_rows] = sampled
        if any(r.params.return_log_probs for r in requests):
            log_probs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).flatten().tolist()
        else:
            log_probs = [0.0] * len(requests)
        return token_ids.tolist(), log_probs

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
        if not rows:
            return
        vocab = logits.shape[1]
        counts = torch.zeros(len(rows), vocab, device=logits.device)
        for j, i in enumerate(rows):
            ids = requests[i].output_ids
            if ids:
                counts[j].index_add_(0, torch.tensor(ids, device=logits.device), torch.ones(len(ids), device=logits.device))
        sub = logits[rows]
        rep = torch.tensor([requests[i].params.repetition_penalty for i in rows], device=logits.device)[:, None]
        seen = counts > 0
        # As in Hugging Face and vLLM: divide positive logits, multiply negative ones.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        freq = torch.tensor([requests[i].params.frequency_penalty for i in rows], device=logits.device)[:, None]
        pres = torch.tensor([requests[i].params.presence_penalty for i in rows], device=logits.device)[:, None]
        sub = sub - freq * counts - pres * seen.float()
        logits[rows] = sub

    def _apply_bans(self, logits: torch.Tensor, requests: list[Request]) -> None:
        for i, request in enumerate(requests):
            banned = banned_token_ids(request)
            if banned:
                logits[i, banned] = _NEG_INF

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in requests], device=device)[:, None]
        logits = logits / temperature
        top_k = torch.tensor([r.params.top_k or logits.shape[1] for r in requests], device=device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=device)
        min_p = torch.tensor([r.params.min_p for r in requests], device=device)
        logits = _mask_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs)
        for i, request in enumerate(requests):
            noise[i].exponential_(generator=request.generator)
        return (probs / noise).argmax(dim=-1)


def _has_penalty(request: Request) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _mask_top_k_top_p_min_p(logits, top_k, top_p, min_p):
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before >= top_p[:, None]
    remove |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
