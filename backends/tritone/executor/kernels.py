"""Native CPU kernels from `csrc/` (paged attention, fp32 GEMM, row argmax, the Llama family's
whole forward pass), compiled with the system C compiler at first use into one library.

The shared library is cached under the Tritone cache directory, keyed by the source, the flags
and the CPU's feature flags (it is built with -march=native). Where no compiler is found or the
build fails, `native_library()` returns None and the model, attention, linears and argmax take
their torch paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import pathlib
import subprocess
import tempfile
import time

import torch

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.c"))
# Every file, not a list: a header a list missed would leave a stale library in the cache, a source
# a list missed an undefined symbol.
_HEADERS = sorted(_CSRC.glob("*.h"))
# Reassociation lets the compiler vectorize the dot products; no full -ffast-math, so that
# infinities and NaNs keep their meaning.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp", "-pthread", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_loaded = False
_missing = ""  # why the kernels did not build


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> ctypes.CDLL:
    from tritone.cache import cache_root

    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"tritone-kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        compiler = os.environ.get("CC", "cc")
        # Build beside the target and rename: processes that start together never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            t0 = time.perf_counter()
            subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
            logger.info("built the native kernels in %.1f s (cache: %s)", time.perf_counter() - t0, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    # ctypes cannot read csrc/kernels.h: _SIGNATURES restates its declarations.
    for name, (restype, argtypes) in _SIGNATURES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# Each exported function of csrc/: (return type, argument types), as kernels.h declares them.
# llama_forward(model, batch, scratch, logits, greedy_ids, threads) and the other llama_* take
# the structures of native.py.
_SIGNATURES = {
    "paged_attention": (_I, [_P] * 8 + [_I] * 6 + [ctypes.c_float, _I, _I, _I]),
    "paged_attention_amx_supported": (_I, [_I] * 4),
    "gemm_f32": (None, [_P] * 4 + [_I] * 4),
    "gemm_f32_argmax": (_I, [_P] * 3 + [_I] * 4),
    "gemm_bf16_supported": (_I, []),
    "gemm_bf16": (None, [_P] * 4 + [_I] * 4),
    "gemm_bf16_argmax": (_I, [_P] * 3 + [_I] * 4),
    "gemm_bf16_amx_supported": (_I, []),
    "gemm_bf16_amx": (None, [_P] * 4 + [_I] * 4),
    "gemm_bf16_amx_argmax": (_I, [_P] * 3 + [_I] * 4),
    "to_bf16_rows": (None, [_P] * 2 + [_I] * 3),
    "sample_rows": (_I, [_P, _I64, _I64] + [_P] * 3 + [_I]),
    "top_p_rows": (_I, [_P, _I64, _I64, _P, _I]),
    "argmax_rows": (None, [_P, _I64, _I64, _P, _I]),
    "pool_warm_begin": (None, []),
    "pool_warm_end": (None, []),
    "llama_forward": (_I, [_P] * 5 + [_I]),
    "llama_scratch_floats": (ctypes.c_size_t, [_P, _I]),
    "llama_struct_sizes": (None, [_P]),
    "shm_comm_bytes": (ctypes.c_size_t, [_I, _I64]),
    "shm_comm_init": (None, [_P, _P, _I, _I, _I64]),
    "shm_all_reduce": (None, [_P, _P, _I64]),
}


def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built (logged once)."""
    global _lib, _loaded, _missing
    if not _loaded:
        _loaded = True
        try:
            _lib = _build()
        except FileNotFoundError:
            _missing = f"no C compiler: {os.environ.get('CC', 'cc')} was not found (install gcc, or set CC)"
        except (OSError, subprocess.SubprocessError) as exc:
            _missing = f"the C compiler failed: {str(getattr(exc, 'stderr', '') or exc).strip()[-2000:]}"
        if _lib is None:
            logger.warning("native CPU kernels unavailable, using torch's attention and GEMMs: %s", _missing)
    return _lib


@contextlib.contextmanager
def pool_threads():
    """The kernels called inside run on the pool's own threads, as within a native forward pass
    (csrc/pool.c), not on OpenMP's team: for the sampler's kernels between two native forward
    passes, where the pool's workers are awake and OpenMP's, woken for one call, would spin on
    through the next forward pass beside them (2-3% of a step's CPU at 128 sampled rows)."""
    lib = native_library()
    if lib is None:
        yield
        return
    lib.pool_warm_begin()
    try:
        yield
    finally:
        lib.pool_warm_end()


def require(what: str) -> ctypes.CDLL:
    """The compiled kernels for `what` (a flag and its value, as the user gave them), or a
    ValueError that names it and says why they are missing."""
    lib = native_library()
    if lib is None:
        raise ValueError(f"{what} needs Tritone's native CPU kernels, which could not be built: {_missing}")
    return lib


def missing_reason() -> str:
    """Why the kernels did not build ('' when they did, or before anything asked for them)."""
    return _missing


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                    out: torch.Tensor, amx: bool = False) -> None:
    """Causal attention of each sequence's new tokens over its paged context, into `out`.

    q, out: [num_tokens, num_heads, head_dim] float32, contiguous; caches: [num_slots,
    num_kv_heads, head_dim] float32 or bfloat16; block_tables: [num_seqs, max_blocks] int32;
    query_start: [num_seqs + 1] int32; seq_lens: [num_seqs] int32. `amx`: scores on AMX tiles,
    the queries rounded to bf16 (a bf16 cache where `amx_attention_supported`).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    rc = native_library().paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), query_start.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), None, seq_lens.shape[0], num_heads, k_cache.shape[1], head_dim,
        block_size, block_tables.shape[1], scale, int(k_cache.dtype == torch.bfloat16), int(amx),
        torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"paged_attention supports head sizes that are multiples of 8 up to 256, not {head_dim}")
    if rc == -3:
        raise ValueError(f"paged_attention on AMX needs {AMX_ATTENTION_NEEDS}")
    if rc != 0:
        raise MemoryError("paged_attention could not allocate its scratch space")


AMX_ATTENTION_NEEDS = ("a CPU with AMX, a bf16 cache, head sizes that are multiples of 32, groups of up to 16 query "
                       "heads and block sizes that are multiples of 16")


def amx_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether `paged_attention(amx=True)` runs here for this shape (see its error for the rules)."""
    lib = native_library()
    return lib is not None and bool(lib.paged_attention_amx_supported(num_heads, num_kv_heads, head_dim, block_size))


def pack_f32(weight_t: torch.Tensor) -> torch.Tensor:
    """`weight_t` ([in, out] float32) in the column panels that `gemm_f32` reads: panel p holds
    columns [16p, 16p + 16) as `in` rows of 16, zero padded."""
    k, n = weight_t.shape
    padded = torch.zeros(k, -(-n // 16) * 16, dtype=torch.float32)
    padded[:, :n] = weight_t
    return padded.view(k, -1, 16).transpose(0, 1).contiguous()


def _gemm(fn, a: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
          out_features: int) -> torch.Tensor:
    """fn (gemm_f32 or gemm_bf16) on a, x's rows as that kernel reads them."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        fn(a.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
           x.shape[1], out_features, torch.get_num_threads())
    return out


def _gemm_argmax(fn, a: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """fn (gemm_f32_argmax or gemm_bf16_argmax) on a, x's rows as that kernel reads them."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and fn(a.data_ptr(), panels.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], out_features,
                         torch.get_num_threads()):
        raise MemoryError(f"{fn.__name__} could not allocate its scratch space")
    return out


def gemm_f32(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ weight (+ bias) on `pack_f32`'s panels; x [rows, in] float32."""
    x = x.contiguous()
    return _gemm(native_library().gemm_f32, x, x, panels, bias, out_features)


def gemm_f32_argmax(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """(x @ weight).argmax(dim=-1) on `pack_f32`'s panels without writing the product: the
    same values as `gemm_f32`'s, ties to the lowest index; x [rows, in] float32."""
    x = x.contiguous()
    return _gemm_argmax(native_library().gemm_f32_argmax, x, x, panels, out_features)


def bf16_gemm_supported() -> bool:
    """Whether the native bf16 GEMM runs here (the kernels were built for a CPU with
    AVX512-BF16)."""
    lib = native_library()
    return lib is not None and bool(lib.gemm_bf16_supported())


def pack_bf16(weight_t: torch.Tensor) -> torch.Tensor:
    """`weight_t` ([in, out]) in the bf16 panels that `gemm_bf16` reads: panel p holds columns
    [32p, 32p + 32) as ceil(in / 2) rows of 32 pairs (W[2k, j], W[2k + 1, j]), zero padded."""
    k, n = weight_t.shape
    padded = torch.zeros(-(-k // 2) * 2, -(-n // 32) * 32, dtype=torch.bfloat16)
    padded[:k, :n] = weight_t
    return padded.view(-1, 2, padded.shape[1] // 32, 32).permute(2, 0, 3, 1).contiguous()


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as gemm_bf16's A: bf16 rows padded to an even length (torch rounds as the
    native conversion does)."""
    rows, k = x.shape
    out = torch.zeros(rows, k + k % 2, dtype=torch.bfloat16)
    out[:, :k] = x
    return out


def gemm_bf16(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ weight (+ bias) on `pack_bf16`'s panels, x rounded to bf16, sums in float32; returns
    float32 [rows, out_features]. bias: float32 or None."""
    return _gemm(native_library().gemm_bf16, _bf16_rows(x), x, panels, bias, out_features)


def gemm_bf16_argmax(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """(x @ weight).argmax(dim=-1) on `pack_bf16`'s panels without writing the product, as
    `gemm_f32_argmax`."""
    return _gemm_argmax(native_library().gemm_bf16_argmax, _bf16_rows(x), x, panels, out_features)


def amx_gemm_supported() -> bool:
    """Whether `gemm_bf16_amx` runs on AMX tiles here: kernels built for a CPU with AMX-BF16, and
    this process allowed to use the tiles."""
    lib = native_library()
    return lib is not None and bool(lib.gemm_bf16_amx_supported())


def gemm_bf16_amx(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`gemm_bf16` on AMX tiles, same panels (its own kernel where `in` is not a multiple of 32)."""
    return _gemm(native_library().gemm_bf16_amx, _bf16_rows(x), x, panels, bias, out_features)


def gemm_bf16_amx_argmax(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """`gemm_bf16_argmax` on AMX tiles."""
    return _gemm_argmax(native_library().gemm_bf16_amx_argmax, _bf16_rows(x), x, panels, out_features)


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """`weight_t` ([in, out]) in the panels of the native GEMM of its dtype (bf16 or float32)."""
    return pack_bf16(weight_t) if weight_t.dtype == torch.bfloat16 else pack_f32(weight_t)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [rows, n] float32 CPU tensor: the lowest index of each row's
    maximum, as torch's; falls back to torch where the native kernels are missing."""
    # The device first: on a GPU the native library is never built, nor waited for.
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.shape[1] or native_library() is None:
        return x.argmax(dim=-1)
    lib = native_library()
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def sample_rows(x: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of x [rows, n] float32, drawn from softmax(x * inv_temperature[row]) by
    inverting its cumulative sum at u[row] (uniform in [0, 1), float64): the first token whose
    running sum exceeds u times the total. Tokens at -inf are never drawn."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or native_library() is None:
        inv_temperature, u = inv_temperature.to(x.device, torch.float64), u.to(x.device, torch.float64)
        probs = torch.softmax(x.double() * inv_temperature[:, None], dim=-1)
        cdf = probs.cumsum(dim=-1)
        ids = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)
        return ids.flatten().clamp_(max=x.shape[1] - 1)
    lib = native_library()
    x = x.contiguous()
    inv_temperature = inv_temperature.to(torch.float32).contiguous()
    u = u.to(torch.float64).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and lib.sample_rows(x.data_ptr(), x.shape[0], x.shape[1], inv_temperature.data_ptr(),
                                      u.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"sample_rows: no memory for the span sums of {x.shape[0]} rows of {x.shape[1]}")
    return out


def top_p_rows(x: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Top-p of each row of x [rows, n] (float32, contiguous, CPU) in place: a token stays while
    the more likely tokens hold less than top_p[row] of the row's mass. False where the native
    kernels are missing or x is elsewhere (nothing done)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous() or native_library() is None:
        return False
    lib = native_library()
    top_p = top_p.to(torch.float32).contiguous()
    if x.shape[0] and lib.top_p_rows(x.data_ptr(), x.shape[0], x.shape[1], top_p.data_ptr(), torch.get_num_threads()):
        raise MemoryError("top_p_rows could not allocate its scratch space")
    return True
