"""Paged attention as one call per layer for the whole packed batch.

Every layer's attention goes through the custom op `tritone::paged_attention`, which writes the
step's new keys and values into the layer's paged cache and attends each sequence's new tokens
(decodes, prompt chunks, tails after prefix hits alike) over its context. The op is opaque to
`torch.compile`: the compiled graph holds the model's arithmetic, and the cache and the step's
metadata reach the op through a forward context that the runner sets around each forward pass,
as vLLM does, so that neither the cache nor the block tables become graph inputs.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritone.executor import hardware, kernels

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer; built once per step by the runner."""

    # [num_padded_tokens] int64: where each new token's K/V goes; padding rows go to a spare
    # slot past the last block, which no block table names.
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32: sequence s owns token rows [qs[s], qs[s+1])
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    # Host copies for the torch path, which loops over sequences.
    query_start_list: list[int]
    seq_lens_list: list[int]
    num_decodes: int  # the first num_decodes sequences have one query token each
    block_size: int
    # The longest query and context (host ints: the CUDA kernels size their grids by them; a
    # captured decode graph fixes them at 1 and the model's limit).
    max_query_len: int = 0
    max_seq_len: int = 0


class NativeCPUAttention:
    """The C kernel: reads the cache in place through block tables, no gather."""

    name = "cpu-native"
    capturable = False
    amx = False

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        qf = q.float().contiguous()
        out = torch.zeros_like(qf)
        kernels.paged_attention(qf, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                                meta.block_size, scale, out, amx=self.amx)
        return out.to(q.dtype)


class NativeAMXAttention(NativeCPUAttention):
    """The C kernel with each token's scores on AMX tiles (its queries rounded to bf16): where the
    CPU has AMX, the cache is bf16 and the shape allows (kernels.amx_attention_supported)."""

    name = "cpu-amx"
    amx = True


class TorchSDPAAttention:
    """Gathers each sequence's context out of the cache, then SDPA: the portable fallback.

    Decodes are attended together in one padded call; prompt chunks one sequence at a time."""

    name = "sdpa"
    capturable = False  # its gathers take their widths from host lists

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
        qs, lens, bs = meta.query_start_list, meta.seq_lens_list, meta.block_size
        nd = meta.num_decodes
        if nd:
            width = max(lens[:nd])
            slots = _context_slots(meta.block_tables[:nd], width, bs)  # [nd, width]
            k = _gather(k_cache, slots).transpose(1, 2)  # [nd, kv_heads, width, D]
            v = _gather(v_cache, slots).transpose(1, 2)
            mask = torch.arange(width, device=q.device)[None, :] < meta.seq_lens[:nd, None]
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                               scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for s in range(nd, len(lens)):
            start, end, ctx = qs[s], qs[s + 1], lens[s]
            slots = _context_slots(meta.block_tables[s:s + 1], ctx, bs)[0]
            k = _gather(k_cache, slots).transpose(0, 1)  # [kv_heads, ctx, D]
            v = _gather(v_cache, slots).transpose(0, 1)
            qp = q[start:end].transpose(0, 1)  # [heads, n, D]
            n = end - start
            if n == ctx:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:  # the queries are the context's last n positions
                mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        return out


def _context_slots(tables: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    n = tables.shape[0]
    offsets = torch.arange(block_size, device=tables.device)
    return (tables.long()[:, :, None] * block_size + offsets).view(n, -1)[:, :width]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # index_select on rows is several times faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:])


class TritonPagedAttention:
    """Tritone's Triton kernel (triton_attention.py): paged, one launch per layer, capturable."""

    name = "triton"
    capturable = True

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from tritone.executor import triton_attention

        return triton_attention.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start,
                                                meta.seq_lens, meta.block_size, meta.max_query_len, scale)


class FlashVarlenAttention:
    """torch's varlen_attn (its bundled FlashAttention) reading the cache as pages through the
    block tables. The cache's rows are viewed as [num_blocks, block_size, kv_heads, D] pages, the
    spare slot past the last block left out."""

    name = "flash-varlen"
    capturable = True

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        bs = meta.block_size
        num_blocks = (k_cache.shape[0] - 1) // bs
        pages = lambda cache: cache[:num_blocks * bs].view(num_blocks, bs, *cache.shape[1:])
        key_start = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return varlen_attn(q, pages(k_cache), pages(v_cache), meta.query_start, key_start, meta.max_query_len,
                           meta.max_seq_len, scale=scale, window_size=(-1, 0),
                           enable_gqa=q.shape[1] != k_cache.shape[1], seqused_k=meta.seq_lens,
                           block_table=meta.block_tables)


# FlashAttention 2, which torch's varlen_attn bundles, reads a paged cache only in pages of a
# multiple of 256 tokens (its flash_api checks it): at smaller blocks it could never pass a probe.
FLASH_PAGE_MULTIPLE = 256


def _flash_block_problem(block_size: int) -> str | None:
    if block_size % FLASH_PAGE_MULTIPLE:
        return (f"its paged FlashAttention takes blocks of a multiple of {FLASH_PAGE_MULTIPLE} tokens, and the KV "
                f"cache's are {block_size} (--block-size {FLASH_PAGE_MULTIPLE} to use it)")
    return None


def _cuda_candidates(block_size: int) -> list:
    candidates = []
    if _has_module("torch.nn.attention.varlen"):
        problem = _flash_block_problem(block_size)
        if problem is None:
            candidates.append(FlashVarlenAttention())
        else:
            logger.info("attention flash-varlen passed over: %s", problem)
    if _has_module("triton"):
        candidates.append(TritonPagedAttention())
    return candidates


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


BACKENDS = {"cpu-native": NativeCPUAttention, "cpu-amx": NativeAMXAttention, "flash-varlen": FlashVarlenAttention,
            "triton": TritonPagedAttention, "sdpa": TorchSDPAAttention}


def select_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, name: str = "auto"):
    """The attention named, or for `auto` the fastest that works here: the native kernel on CPU;
    on CUDA the first paged kernel. Either serves only after it ran and agreed with SDPA on a probe
    batch of this model's shape (logged, with why each one before it was passed over; one named
    by flag that does not refuses to start); SDPA where none does."""
    if name in ("cpu-native", "cpu-amx"):
        kernels.require(f"--attention {name}")
    if name == "cpu-amx" and not (dtype == torch.bfloat16 and kernels.amx_attention_supported(
            num_heads, num_kv_heads, head_dim, block_size)):
        raise ValueError(f"--attention cpu-amx: needs {kernels.AMX_ATTENTION_NEEDS} (--dtype bfloat16)")
    if name == "flash-varlen" and _flash_block_problem(block_size):
        raise ValueError(f"--attention flash-varlen: {_flash_block_problem(block_size)}")
    if name not in ("auto", "sdpa"):  # SDPA is the reference the others are checked against
        backend = BACKENDS[name]()
        problem = probe(backend, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
        if problem is not None:
            raise ValueError(f"--attention {name}: disagrees with SDPA on a probe batch here: {problem}")
        return backend
    if name == "sdpa":
        return TorchSDPAAttention()
    if device.type == "cpu":
        if (dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
                and kernels.native_library() is not None):
            candidates = [NativeCPUAttention()]
            if dtype == torch.bfloat16 and kernels.amx_attention_supported(num_heads, num_kv_heads, head_dim, block_size):
                candidates.append(NativeAMXAttention())
            passed = []
            for backend in candidates:
                problem = probe(backend, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
                if problem is None:
                    passed.append(backend)
                else:
                    logger.warning("attention %s dropped: %s", backend.name, problem)
            if len(passed) > 1:
                return fastest_cpu(passed, num_heads, num_kv_heads, head_dim, block_size)
            if passed:
                logger.info("attention %s: passed its probe against SDPA", passed[0].name)
                return passed[0]
        return TorchSDPAAttention()
    for backend in _cuda_candidates(block_size):
        problem = probe(backend, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
        if problem is None:
            return backend
        logger.info("attention %s passed over: %s", backend.name, problem)
    return TorchSDPAAttention()


# The measured decode batch: sequences of this many tokens, and layers' worth of caches whose keys
# and values together overflow any CPU's last-level cache here, as a step reads them.
_TIMED_SEQS, _TIMED_CONTEXT, _TIMED_BYTES = 64, 256, 96 << 20


def _time_decodes(backends: list, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """Seconds per layer of a decode step of _TIMED_SEQS sequences of _TIMED_CONTEXT tokens for
    each of `backends`, blocks scattered over the cache as the block manager leaves them: the best
    of three passes over the same cold copies of the cache, the kernels taking turns."""
    gen = torch.Generator().manual_seed(0)
    blocks = _TIMED_SEQS * -(-_TIMED_CONTEXT // block_size)
    layer_bytes = 2 * blocks * block_size * num_kv_heads * head_dim * 2
    layers = max(1, min(32, -(-_TIMED_BYTES // layer_bytes)))
    caches = [tuple(torch.randn(blocks * block_size + 1, num_kv_heads, head_dim, generator=gen).bfloat16()
                    for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen).int().view(_TIMED_SEQS, -1)
    seq_lens = torch.full((_TIMED_SEQS,), _TIMED_CONTEXT, dtype=torch.int32)
    query_start = torch.arange(_TIMED_SEQS + 1, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=None, block_tables=tables, query_start=query_start, seq_lens=seq_lens,
                             query_start_list=query_start.tolist(), seq_lens_list=seq_lens.tolist(),
                             num_decodes=_TIMED_SEQS, block_size=block_size)
    q = torch.randn(_TIMED_SEQS, num_heads, head_dim, generator=gen)
    best = {b.name: float("inf") for b in backends}
    for _ in range(3):
        for backend in backends:
            t0 = time.perf_counter()
            for k_cache, v_cache in caches:
                backend.forward(q, k_cache, v_cache, meta, head_dim ** -0.5)
            best[backend.name] = min(best[backend.name], (time.perf_counter() - t0) / layers)
    return best


def fastest_cpu(backends: list, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    """The fastest of the CPU kernels `backends` (each passed its probe) on a decode step of this
    model's shape: measured, cached with the other hardware facts, logged."""
    path = hardware.facts_path("attention")
    # Keyed by the kernels' build too: a changed kernel is timed again.
    build = pathlib.Path(kernels.native_library()._name).stem
    key = f"{num_heads}/{num_kv_heads}/{head_dim}/{block_size} {'/'.join(b.name for b in backends)} {build}"
    cached = hardware.read_facts(path)
    times, how = cached.get(key), "cached"
    if times is None:
        times, quiet = hardware.uncontended(
            lambda: _time_decodes(backends, num_heads, num_kv_heads, head_dim, block_size), "attention")
        how = "measured" if quiet else "measured under contention (not cached)"
        if quiet:
            cached[key] = times
            hardware.write_facts(path, cached)
    chosen = min(backends, key=lambda b: times[b.name])
    logger.info("attention %s: the fastest here (%s; ms a layer for %d decodes of %d tokens: %s), passed its probe "
                "against SDPA", chosen.name, how, _TIMED_SEQS, _TIMED_CONTEXT,
                ", ".join(f"{name} {t * 1e3:.2f}" for name, t in sorted(times.items())))
    return chosen


def probe_batch(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, seed: int = 0):
    """A small packed batch over a scattered paged cache: two decodes, a whole prompt, a later
    chunk after a prefix and a one-token tail; returns (q, k_cache, v_cache, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    layout = [(1, 3 * block_size + 1), (1, 1), (block_size + 3, block_size + 3), (5, 2 * block_size + 7), (1, 9)]
    max_blocks = max(-(-ctx // block_size) for _, ctx in layout)
    num_blocks = sum(-(-ctx // block_size) for _, ctx in layout) + 3
    order = torch.randperm(num_blocks, generator=gen).int()
    tables, used = torch.zeros(len(layout), max_blocks, dtype=torch.int32), 0
    for i, (_, ctx) in enumerate(layout):
        n = -(-ctx // block_size)
        tables[i, :n] = order[used:used + n]
        used += n
    query_start = torch.tensor([0] + [q for q, _ in layout]).cumsum(0).int()
    seq_lens = torch.tensor([ctx for _, ctx in layout], dtype=torch.int32)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)
    k_cache = rand(num_blocks * block_size + 1, num_kv_heads, head_dim)
    v_cache = rand(num_blocks * block_size + 1, num_kv_heads, head_dim)
    q = rand(int(query_start[-1]), num_heads, head_dim)
    meta = AttentionMetadata(slot_mapping=None, block_tables=tables.to(device), query_start=query_start.to(device),
                             seq_lens=seq_lens.to(device), query_start_list=query_start.tolist(),
                             seq_lens_list=seq_lens.tolist(), num_decodes=2, block_size=block_size,
                             max_query_len=max(q for q, _ in layout), max_seq_len=max(c for _, c in layout))
    return q, k_cache, v_cache, meta


def probe(backend, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int) -> str | None:
    """None where `backend` runs on a probe batch and agrees with SDPA in float32; else why not."""
    q, k_cache, v_cache, meta = probe_batch(device, dtype, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    try:
        got = backend.forward(q, k_cache, v_cache, meta, scale).float()
    except Exception as exc:  # a missing build, an unsupported shape or dtype: the next one
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    want = TorchSDPAAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    error = (got - want).abs().max().item()
    if not error <= tolerance:
        return f"differs from SDPA by {error:.3g} (tolerance {tolerance})"
    return None


@dataclass(slots=True)
class _ForwardContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    metadata: AttentionMetadata
    backend: object


_context: _ForwardContext | None = None


@contextlib.contextmanager
def forward_context(kv_caches, metadata: AttentionMetadata, backend):
    global _context
    _context = _ForwardContext(kv_caches, metadata, backend)
    try:
        yield
    finally:
        _context = None


@torch.library.custom_op("tritone::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, D]; k, v: [num_tokens, kv_heads, D]; layer: the layer's index as a
    0-d tensor, an input rather than a constant, so that one compiled graph serves every layer.
    Returns [num_tokens, heads, D]."""
    ctx = _context
    k_cache, v_cache = ctx.kv_caches[int(layer)]
    slots = ctx.metadata.slot_mapping
    k_cache.view(k_cache.shape[0], -1).index_copy_(0, slots, k.reshape(len(slots), -1).to(k_cache.dtype))
    v_cache.view(v_cache.shape[0], -1).index_copy_(0, slots, v.reshape(len(slots), -1).to(v_cache.dtype))
    return ctx.backend.forward(q, k_cache, v_cache, ctx.metadata, scale)


@paged_attention.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)
