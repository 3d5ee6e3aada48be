"""bf16_round: the tests' own bfloat16 rounding, written from the bit patterns and independent of
the library: float32 -> the nearest bfloat16 (ties to even), as float32; NaN stays NaN and
values past bfloat16's largest go to infinity, as PyTorch and the library round."""

import numpy as np


def bf16_round(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF
    out = r.astype(np.uint32).view(np.float32).copy()
    out[np.isnan(a)] = np.nan
    return out.reshape(a.shape)
