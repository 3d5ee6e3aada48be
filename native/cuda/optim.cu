/* optim.cu — sgd (weight decay, dampening, Nesterov), adam (L2 or decoupled weight decay), and
   the many-tensor sgd and fill. The files and the naming: common.cuh. */
#include "common.cuh"

/* ============================================================================================
   Optimizers
   ============================================================================================ */

/* one element's update: the single and the many-tensor kernels share it, so both round alike
   (and as the CPU's ut__cpu_sgd_range: the plain case keeps the seed's expression) */
static __device__ __forceinline__ void ut__cuda_sgd_one(float* __restrict__ p,
                                                        const float* __restrict__ g,
                                                        float* __restrict__ v, ut__i64 i,
                                                        const ut__sgd_hp& h) {
  float d = g[i];
  if (h.weight_decay != 0.f) d = d + h.weight_decay * p[i];
  if (v) {
    float vi = h.dampening != 0.f ? h.momentum * v[i] + (1.f - h.dampening) * d
                                  : h.momentum * v[i] + d;
    v[i] = vi;
    d = h.nesterov ? d + h.momentum * vi : vi;
  }
  p[i] -= h.lr * d;
}

static __global__ void ut__cuda_sgd_kernel(float* __restrict__ p, const float* __restrict__ g,
                                           float* __restrict__ v, ut__i64 n, ut__sgd_hp h) {
  UT__CUDA_GRID_STRIDE(i, n) ut__cuda_sgd_one(p, g, v, i, h);
}

int ut__cuda_sgd(float* p, const float* g, float* v, ut__i64 n, ut__sgd_hp h) {
  if (n <= 0) return UT_OK;
  ut__cuda_sgd_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(p, g, v, n, h);
  UT__CUDA_LAUNCHED("sgd");
  return UT_OK;
}

/* Many tensors per launch (an optimizer step or zero_grad over a whole network): their
   pointers travel in the kernel's parameters, UT__CUDA_MANY at a time; blockIdx.y picks the
   tensor and the x blocks stride over its elements. */
#define UT__CUDA_MANY 40
struct ut__cuda_many {
  float* p[UT__CUDA_MANY];
  const float* g[UT__CUDA_MANY];
  float* v[UT__CUDA_MANY];
  ut__i64 n[UT__CUDA_MANY];
};

static __global__ void ut__cuda_sgd_many_kernel(const ut__cuda_many m, ut__sgd_hp h) {
  const int t = blockIdx.y;
  UT__CUDA_GRID_STRIDE(i, m.n[t]) ut__cuda_sgd_one(m.p[t], m.g[t], m.v[t], i, h);
}

static __global__ void ut__cuda_fill_many_kernel(const ut__cuda_many m, float value) {
  const int t = blockIdx.y;
  float* __restrict__ x = m.p[t];
  UT__CUDA_GRID_STRIDE(i, m.n[t]) x[i] = value;
}

/* g, v may be NULL (fill: both; sgd without momentum: v) */
static int ut__cuda_many_launch(float* const* p, const float* const* g, float* const* v,
                                const ut__i64* n, int count, float value, ut__sgd_hp h,
                                bool fill) {
  for (int t0 = 0; t0 < count; t0 += UT__CUDA_MANY) {
    ut__cuda_many m;
    int k = count - t0 < UT__CUDA_MANY ? count - t0 : UT__CUDA_MANY;
    ut__i64 most = 0;
    for (int t = 0; t < k; ++t) {
      m.p[t] = p[t0 + t];
      m.g[t] = g ? g[t0 + t] : NULL;
      m.v[t] = v ? v[t0 + t] : NULL;
      m.n[t] = n[t0 + t];
      if (m.n[t] > most) most = m.n[t];
    }
    if (most <= 0) continue;
    dim3 grid(ut__cuda_grid_for(most, 256), (unsigned)k);
    if (fill) ut__cuda_fill_many_kernel<<<grid, 256, 0, ut__cuda_stream>>>(m, value);
    else ut__cuda_sgd_many_kernel<<<grid, 256, 0, ut__cuda_stream>>>(m, h);
    UT__CUDA_LAUNCHED(fill ? "fill_many" : "sgd_many");
  }
  return UT_OK;
}

int ut__cuda_sgd_many(float* const* p, const float* const* g, float* const* v, const ut__i64* n,
                      int count, ut__sgd_hp h) {
  return ut__cuda_many_launch(p, g, v, n, count, 0.f, h, false);
}

int ut__cuda_fill_many(float* const* x, const ut__i64* n, int count, float value) {
  ut__sgd_hp none = {0.f, 0.f, 0.f, 0.f, false};
  return ut__cuda_many_launch(x, NULL, NULL, n, count, value, none, true);
}

/* m = lerp(m, g, w) as PyTorch's lerp_ computes it (the exp_avg update) */
static __device__ __forceinline__ float ut__cuda_lerp1(float m, float g, float w) {
  float d = g - m;
  return fabsf(w) < 0.5f ? m + w * d : g - d * (1.f - w);
}

static __global__ void ut__cuda_adam_kernel(float* __restrict__ p, const float* __restrict__ g,
                                            float* __restrict__ m, float* __restrict__ v, ut__i64 n,
                                            ut__adam_hp h) {
  UT__CUDA_GRID_STRIDE(i, n) {
    float pi = p[i];
    if (h.decay != 1.f) pi *= h.decay; /* AdamW: decoupled decay first, as PyTorch's mul_ */
    float gi = h.weight_decay != 0.f ? g[i] + h.weight_decay * pi : g[i];
    float mi = ut__cuda_lerp1(m[i], gi, h.omb1);
    float vi = h.b2 * v[i] + h.omb2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    /* PyTorch's order: no v/bc2 or lr*m that could overflow on its own */
    p[i] = pi - h.step_size * (mi / (sqrtf(vi) / h.sqrt_bc2 + h.eps));
  }
}

int ut__cuda_adam(float* p, const float* g, float* m, float* v, ut__i64 n, ut__adam_hp h) {
  if (n <= 0) return UT_OK;
  ut__cuda_adam_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(p, g, m, v, n, h);
  UT__CUDA_LAUNCHED("adam");
  return UT_OK;
}
