"""Small AVX2 CPU kernels, built on first use, for what torch does slowly at decode sizes.

int8_linear:  y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]
              x: float32 [M, K], q: int8 [N, K], scale: float32 [N]
add_rmsnorm:  x += delta (in place, when given); out = x * rsqrt(mean(x^2) + eps) * w
              one call instead of torch's ~6 kernel launches per norm, per layer, per token

torch's own int8 kernel (`_weight_int8pack_mm`) is slow on CPUs without AVX-512 and wants
bfloat16 activations; this one reads each weight byte once and accumulates in float32. It is
plain C compiled with the system compiler into a shared library and called through ctypes;
it links the libgomp that torch already loaded, so both share one OpenMP thread team.
`load()` returns None (callers fall back to torch) where there is no AVX2/FMA or no compiler.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine.cpu_kernels")

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* K must be a multiple of 32. Rows of q are split across the OpenMP team. */
void int8_linear(const float *x, const int8_t *q, const float *scale, float *y,
                 int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *w = q + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                __m128i b0 = _mm_loadu_si128((const __m128i *)(w + k));
                __m128i b1 = _mm_loadu_si128((const __m128i *)(w + k + 16));
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
                a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr + k), a0);
                a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + k + 8), a1);
                a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + k + 16), a2);
                a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + k + 24), a3);
            }
            y[m * N + n] = scale[n] * hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
    }
}

/* x: [M, K] (updated in place with delta when delta != 0), w: [K], out: [M, K]. K % 8 == 0. */
void add_rmsnorm(float *x, const float *delta, const float *w, float *out,
                 int64_t M, int64_t K, float eps) {
    #pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        float *xr = x + m * K;
        float *o = out + m * K;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            if (delta) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(delta + m * K + k));
                _mm256_storeu_ps(xr + k, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        float r = 1.0f / sqrtf(hsum(ss) / (float)K + eps);
        __m256 rv = _mm256_set1_ps(r);
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + k), rv);
            _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), v));
        }
    }
}
"""

_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build(cache_dir: Path) -> Path:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    so = cache_dir / f"tokenserve_kernels_{digest}.so"
    if so.is_file():
        return so
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(_SOURCE)
        out = Path(tmp) / so.name
        # Link torch's own libgomp when it ships one, so there is a single OpenMP runtime.
        gomp = ["-L", str(torch_lib), f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out), *gomp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        out.replace(so)  # atomic: concurrent builders never see a half-written library
    return so


def load(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here (then use torch)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not _cpu_has_avx2_fma():
        log.info("cpu_kernels_unavailable", reason="cpu lacks avx2/fma")
        return None
    try:
        so = _build(cache_dir or Path.home() / ".cache" / "tokenserve" / "kernels")
        lib = ctypes.CDLL(str(so))
        lib.int8_linear.restype = None
        lib.int8_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        lib.add_rmsnorm.restype = None
        lib.add_rmsnorm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        _lib = lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("cpu_kernels_unavailable", reason=f"{type(e).__name__}: {e}"[:300])
    return _lib


def int8_linear(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: float32 [M, K] (made contiguous), q: int8 [N, K], scale: float32 [N] -> [M, N]."""
    x = x.contiguous()
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    lib.int8_linear(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)
    return y


def add_rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                eps: float) -> torch.Tensor:
    """x: float32 contiguous [M, K], updated in place to x + delta; returns rmsnorm(x) * w."""
    m, k = x.shape
    out = torch.empty_like(x)
    lib.add_rmsnorm(x.data_ptr(), 0 if delta is None else delta.contiguous().data_ptr(), w.data_ptr(),
                    out.data_ptr(), m, k, eps)
    return out
