/* recipe.cu — the training recipe's ops (issue 30): Dropout's and StochasticDepth's
   mask_scale, x[i] *= s[i / inner] (x float32 or bf16 through ut__cuda_ld / ut__cuda_st, the
   mask float32), and the EMA of weights' lerp (float32). The files and the naming: common.cuh. */
#include "common.cuh"

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
