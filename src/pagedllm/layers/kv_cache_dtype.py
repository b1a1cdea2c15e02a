"""The KV cache's storage dtype (`--kv-cache-dtype`, vLLM's names) and the torch-side conversions into it.

| name                 | storage                   | bytes | largest finite |
| auto                 | the model dtype           | 4 / 2 |                |
| bfloat16             | torch.bfloat16            | 2     | 3.39e38        |
| fp8, fp8_e4m3        | torch.float8_e4m3fn (OCP) | 1     | 448            |
| fp8_e5m2             | torch.float8_e5m2 (OCP)   | 1     | 57344          |

`fp8` means E4M3, as in vLLM on CUDA ("fp8 (=fp8_e4m3)").

Scales, as vLLM's `k_scale` / `v_scale`: each attention layer has one for K and one for V; a stored code c stands
for c * scale, so the write stores x / scale. They are 1.0 unless `--calculate-kv-scales` (fp8 caches only) sets
them once at load from a fixed calibration text (worker/kv_scales.py): never from live requests, so a request's
tokens do not depend on which others ran. Every scale is a power of two, so x / scale and c * scale are exact and
the attention folds k_scale into its softmax scale and v_scale into its output with the same result as scaling
every value; only where the format's range sits moves (its subnormals and its largest finite value).
The same calibration sets error-feedback rounding for K (`to_cache_dtype_compensated`): what is stored changes, not
how it is read.

Writes round to nearest, ties to even, and saturate at the largest finite value (infinities too); NaN stays NaN.
Attention converts the stored values back to the model dtype as it reads them (exact: every stored value is
a float32 value), so DESIGN invariant 2 holds within one KV dtype.
"""

from __future__ import annotations

import math

import torch

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The storage dtype for `--kv-cache-dtype name`. Raises ValueError when this device cannot store or read it,
    so the engine fails at start-up rather than falling back to another dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported; choose one of auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}.")
    dtype = KV_CACHE_DTYPES[name]
    if dtype == torch.float32 and model_dtype != torch.float32:
        raise ValueError(f"--kv-cache-dtype float32 needs a float32 model (--dtype float32); this one runs in "
                         f"{str(model_dtype).removeprefix('torch.')}.")
    try:  # the conversions the cache write and the attention do, on this device
        probe = torch.tensor([1.0, -0.5], device=device)
        back = to_cache_dtype(probe, dtype).to(model_dtype)
        index_copy(torch.zeros(4, dtype=dtype, device=device), torch.tensor([1, 2], device=device),
                   to_cache_dtype(probe, dtype))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--kv-cache-dtype {name}: {device} cannot store or read a {dtype} KV cache with this "
                         f"torch build ({e}).") from e
    if not torch.equal(back.float().cpu(), torch.tensor([1.0, -0.5])):
        raise ValueError(f"--kv-cache-dtype {name}: {device} converts {dtype} incorrectly ({back.tolist()}).")
    return dtype


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale in the cache's dtype, rounded to nearest even and saturated at the dtype's largest finite value, as
    the native write does (torch's own float8_e5m2 and bfloat16 conversions overflow to inf; float8_e4m3fn
    saturates). scale: a power of two (1.0 unless the cache is fp8)."""
    if x.dtype == dtype and scale == 1.0:
        return x
    limit = torch.finfo(dtype).max
    x = x.float()
    if scale != 1.0:
        x = x * (1.0 / scale)  # exact: a power of two, as the native write's x * (1 / scale)
    return x.clamp(-limit, limit).to(dtype)


def to_cache_dtype_compensated(x: torch.Tensor, dtype: torch.dtype, scale: float, w: torch.Tensor) -> torch.Tensor:
    """K rows x [T, Hkv, D] in an fp8 cache dtype, rounded with error feedback as the native write does
    (kernels/kv_dtype_cpu.h, kv_store_row_compensated): value i of each head is stored as to_cache_dtype would, and
    its error e_i = r_i - stored_i * scale is carried into the values after it, r_j -= e_i * w[h, i, j], the carry
    computed in float64 from float32 operands and rounded back to float32. w: [Hkv, D, D] float32."""
    r = x.float().clone()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    wd = w.double()
    for i in range(x.shape[-1]):
        code = to_cache_dtype(r[..., i], dtype, scale)  # [T, Hkv]
        out[..., i] = code
        e = r[..., i] - code.float() * scale
        r[..., i + 1:] = (r[..., i + 1:].double() - e.double()[..., None] * wd[None, :, i, i + 1:]).float()
    return out


def power_of_two_scale(amax: float, target: float) -> float:
    """The smallest power of two s with amax / s <= target (1.0 for amax 0 or not finite): vLLM's calculated scale
    amax / target, rounded up to a power of two so that scaling is exact."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    return math.ldexp(1.0, math.ceil(math.log2(amax / target)))


def index_copy(cache: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """cache.index_copy_(0, index, values) for any cache dtype (torch has no index_copy_ for float8 on the CPU: the
    bytes are copied as uint8)."""
    if cache.dtype.itemsize == 1 and cache.dtype != torch.uint8:
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.index_copy_(0, index, values)
