/* recipe.cu — the training recipe's ops (issue 30): Dropout's mask drawn on the device
   (rng_mask), Dropout's and StochasticDepth's mask_scale, x[i] *= s[i / inner] (x float32 or bf16 through ut__cuda_ld / ut__cuda_st, the
   mask float32), and the EMA of weights' lerp (float32). The files and the naming: common.cuh. */
#include "common.cuh"

/* ---- Dropout's mask from a counter-based stream ------------------------------------------------
   Element i of a draw is a hash of (key, counter + i): no state per thread, so any grid draws the
   same mask. The counter lives in device memory and a one-thread kernel after the draw advances
   it, both on the library's stream: a CUDA graph that recorded the two launches reads the
   counter its previous replay left, so each replay draws a new mask. */
struct ut__cuda_rng_state {
  unsigned long long key, counter;
};
static __device__ ut__cuda_rng_state ut__cuda_rng;
static unsigned long long ut__cuda_rng_epoch_seen; /* the ut_seed epoch the device holds */

static __device__ __forceinline__ unsigned long long ut__cuda_mix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ULL; /* splitmix64's finalizer */
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static __global__ void ut__cuda_rng_reset_kernel(unsigned long long key) {
  ut__cuda_rng.key = key;
  ut__cuda_rng.counter = 0;
}

static __global__ void ut__cuda_rng_mask_kernel(float* __restrict__ out, ut__i64 n, double keep,
                                                float scale) {
  const unsigned long long key = ut__cuda_rng.key, base = ut__cuda_rng.counter;
  UT__CUDA_GRID_STRIDE(i, n) {
    unsigned long long h = ut__cuda_mix64(key ^ ut__cuda_mix64(base + (unsigned long long)i));
    double u = (double)((h >> 11) + 1) * 0x1p-53; /* uniform in (0, 1], as the host's */
    out[i] = u <= keep ? scale : 0.f;
  }
}

static __global__ void ut__cuda_rng_advance_kernel(ut__i64 n) { ut__cuda_rng.counter += n; }

int ut__cuda_rng_mask(float* out, ut__i64 n, double keep, float scale, unsigned long long key,
                      unsigned long long epoch, bool recording) {
  if (epoch != ut__cuda_rng_epoch_seen && !recording) {
    ut__cuda_rng_reset_kernel<<<1, 1, 0, ut__cuda_stream>>>(key);
    UT__CUDA_LAUNCHED("rng_reset");
    ut__cuda_rng_epoch_seen = epoch;
  }
  if (n <= 0) return UT_OK;
  ut__cuda_rng_mask_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(out, n, keep,
                                                                                   scale);
  UT__CUDA_LAUNCHED("rng_mask");
  ut__cuda_rng_advance_kernel<<<1, 1, 0, ut__cuda_stream>>>(n);
  UT__CUDA_LAUNCHED("rng_advance");
  return UT_OK;
}

template <typename T>
static __global__ void ut__cuda_mask_scale_kernel(T* __restrict__ x, const float* __restrict__ s,
                                                  ut__i64 n, ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, n) ut__cuda_st(x + i, ut__cuda_ld(x + i) * s[i / inner]);
}

int ut__cuda_mask_scale(ut_dtype dt, void* x, const float* s, ut__i64 n, ut__i64 inner) {
  if (n <= 0) return UT_OK;
  switch (dt) {
    case UT_F32:
      ut__cuda_mask_scale_kernel<float>
          <<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>((float*)x, s, n, inner);
      UT__CUDA_LAUNCHED("mask_scale");
      return UT_OK;
    case UT_BF16:
      ut__cuda_mask_scale_kernel<ut__cuda_bf16><<<ut__cuda_grid_for(n, 256), 256, 0,
                                                  ut__cuda_stream>>>((ut__cuda_bf16*)x, s, n,
                                                                     inner);
      UT__CUDA_LAUNCHED("mask_scale_bf16");
      return UT_OK;
  }
  return ut__cuda_no_dtype("mask_scale", dt);
}

/* PyTorch's lerp_: a + w (b - a) for w < 0.5, else b - (b - a)(1 - w) */
static __global__ void ut__cuda_lerp_kernel(float* __restrict__ a, const float* __restrict__ b,
                                            ut__i64 n, float w) {
  UT__CUDA_GRID_STRIDE(i, n) {
    float ai = a[i], bi = b[i];
    a[i] = w < 0.5f ? ai + w * (bi - ai) : bi - (bi - ai) * (1.f - w);
  }
}

int ut__cuda_lerp(float* a, const float* b, ut__i64 n, float w) {
  if (n <= 0) return UT_OK;
  ut__cuda_lerp_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(a, b, n, w);
  UT__CUDA_LAUNCHED("lerp");
  return UT_OK;
}
