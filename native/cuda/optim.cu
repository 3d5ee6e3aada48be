/* optim.cu — sgd and adam. The files and the naming: common.cuh. */
#include "common.cuh"

/* ============================================================================================
   Optimizers
   ============================================================================================ */

static __global__ void ut__cuda_sgd_kernel(float* __restrict__ p, const float* __restrict__ g,
                                           float* __restrict__ v, ut__i64 n, float lr,
                                           float momentum) {
  UT__CUDA_GRID_STRIDE(i, n) {
    float d = g[i];
    if (v) {
      d = momentum * v[i] + d;
      v[i] = d;
    }
    p[i] -= lr * d;
  }
}

int ut__cuda_sgd(float* p, const float* g, float* v, ut__i64 n, float lr, float momentum) {
  if (n <= 0) return UT_OK;
  ut__cuda_sgd_kernel<<<ut__cuda_grid_for(n, 256), 256>>>(p, g, v, n, lr, momentum);
  UT__CUDA_LAUNCHED("sgd");
  return UT_OK;
}

static __global__ void ut__cuda_adam_kernel(float* __restrict__ p, const float* __restrict__ g,
                                            float* __restrict__ m, float* __restrict__ v, ut__i64 n,
                                            float lr, float b1, float b2, float eps, float bc1,
                                            float bc2) {
  UT__CUDA_GRID_STRIDE(i, n) {
    float gi = g[i];
    float mi = b1 * m[i] + (1.f - b1) * gi;
    float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    /* PyTorch's order: no v/bc2 or lr*m that could overflow on its own */
    p[i] -= (lr / bc1) * (mi / (sqrtf(vi) / sqrtf(bc2) + eps));
  }
}

int ut__cuda_adam(float* p, const float* g, float* m, float* v, ut__i64 n, float lr, float b1,
                  float b2, float eps, float bc1, float bc2) {
  if (n <= 0) return UT_OK;
  ut__cuda_adam_kernel<<<ut__cuda_grid_for(n, 256), 256>>>(p, g, m, v, n, lr, b1, b2, eps, bc1,
                                                           bc2);
  UT__CUDA_LAUNCHED("adam");
  return UT_OK;
}
