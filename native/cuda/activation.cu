/* activation.cu — the act_fwd / act_bwd slots: SiLU, Hardswish, Hardsigmoid, Sigmoid, GELU
   (erf and tanh forms), forward and backward (issue 30). The files and the naming: common.cuh.

   The formulas are not here: ut__act_value and ut__act_grad in utensil.h (BACKEND INTERFACE)
   are __host__ __device__ under nvcc, so this file and the CPU backend evaluate the same
   expressions in the same order (PyTorch's), NaN, infinities and the kinks included; only the
   device's expf / erfcf / tanhf differ from the host's (a few ulp).

   One kernel template over the element type T (float, ut__cuda_bf16: float32 arithmetic
   either way, a bf16 store rounds to nearest even), the kind ACT and the direction, so each
   instantiation is one formula with the switch folded away; the table functions switch on
   dt and act at run time. Streaming: 16 bytes per access (4 float32 or 8 bf16 values) when
   every buffer is 16-byte aligned, one value at a time for the rest. */
#include "common.cuh"

/* 16 bytes of T as float32 values, and back (little endian: the lower bf16 half comes first) */
static __device__ __forceinline__ void ut__cuda_act_ld(const float* p, float (&f)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
}
static __device__ __forceinline__ void ut__cuda_act_st(float* p, const float (&f)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}
static __device__ __forceinline__ void ut__cuda_act_ld(const ut__cuda_bf16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
static __device__ __forceinline__ unsigned ut__cuda_act_pack2(float lo, float hi) {
  return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
static __device__ __forceinline__ void ut__cuda_act_st(ut__cuda_bf16* p, const float (&f)[8]) {
  uint4 u;
  u.x = ut__cuda_act_pack2(f[0], f[1]);
  u.y = ut__cuda_act_pack2(f[2], f[3]);
  u.z = ut__cuda_act_pack2(f[4], f[5]);
  u.w = ut__cuda_act_pack2(f[6], f[7]);
  *reinterpret_cast<uint4*>(p) = u;
}

/* BWD false: y = f(x) (go unused); true: y = go f'(x). nv 16-byte groups first (0: none), then
   the values from nv V on, one at a time. */
template <typename T, int ACT, bool BWD>
static __global__ void ut__cuda_act_kernel(const T* __restrict__ x, const T* __restrict__ go,
                                           T* __restrict__ y, ut__i64 n, ut__i64 nv) {
  constexpr int V = 16 / (int)sizeof(T);
  const ut__i64 start = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x;
  const ut__i64 step = (ut__i64)gridDim.x * blockDim.x;
  for (ut__i64 v = start; v < nv; v += step) {
    float a[V], g[V];
    ut__cuda_act_ld(x + v * V, a);
    if (BWD) ut__cuda_act_ld(go + v * V, g);
#pragma unroll
    for (int j = 0; j < V; ++j)
      a[j] = BWD ? ut__act_grad(ACT, g[j], a[j]) : ut__act_value(ACT, a[j]);
    ut__cuda_act_st(y + v * V, a);
  }
  for (ut__i64 i = nv * V + start; i < n; i += step) {
    const float a = ut__cuda_ld(x + i);
    ut__cuda_st(y + i, BWD ? ut__act_grad(ACT, ut__cuda_ld(go + i), a) : ut__act_value(ACT, a));
  }
}

static inline bool ut__cuda_act_aligned(const void* p) { return ((uintptr_t)p & 15) == 0; }

template <typename T, int ACT, bool BWD>
static int ut__cuda_act_launch(const void* x, const void* go, void* y, ut__i64 n,
                               const char* what) {
  if (n <= 0) return UT_OK;
  constexpr int V = 16 / (int)sizeof(T);
  const bool aligned = ut__cuda_act_aligned(x) && ut__cuda_act_aligned(y) &&
                       (!BWD || ut__cuda_act_aligned(go));
  const ut__i64 nv = aligned ? n / V : 0;
  ut__cuda_act_kernel<T, ACT, BWD><<<ut__cuda_grid_for(nv > 0 ? nv : n, 256), 256, 0,
                                     ut__cuda_stream>>>((const T*)x, (const T*)go, (T*)y, n, nv);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

/* the kind, a run-time int, as the template's constant */
template <typename T, bool BWD>
static int ut__cuda_act_t(int act, const void* x, const void* go, void* y, ut__i64 n) {
  const char* what = BWD ? "act_bwd" : "act_fwd";
  switch (act) {
    case UT_ACT_SILU: return ut__cuda_act_launch<T, UT_ACT_SILU, BWD>(x, go, y, n, what);
    case UT_ACT_HARDSWISH:
      return ut__cuda_act_launch<T, UT_ACT_HARDSWISH, BWD>(x, go, y, n, what);
    case UT_ACT_HARDSIGMOID:
      return ut__cuda_act_launch<T, UT_ACT_HARDSIGMOID, BWD>(x, go, y, n, what);
    case UT_ACT_SIGMOID: return ut__cuda_act_launch<T, UT_ACT_SIGMOID, BWD>(x, go, y, n, what);
    case UT_ACT_GELU: return ut__cuda_act_launch<T, UT_ACT_GELU, BWD>(x, go, y, n, what);
    case UT_ACT_GELU_TANH:
      return ut__cuda_act_launch<T, UT_ACT_GELU_TANH, BWD>(x, go, y, n, what);
  }
  return ut__set_error(UT_ERR_ARG, "cuda %s: activation %d has no kernel here", what, act);
}

int ut__cuda_act_fwd(ut_dtype dt, int act, const void* x, void* y, ut__i64 n) {
  switch (dt) {
    case UT_F32: return ut__cuda_act_t<float, false>(act, x, NULL, y, n);
    case UT_BF16: return ut__cuda_act_t<ut__cuda_bf16, false>(act, x, NULL, y, n);
  }
  return ut__cuda_no_dtype("act_fwd", dt);
}

int ut__cuda_act_bwd(ut_dtype dt, int act, const void* go, const void* x, void* gi, ut__i64 n) {
  switch (dt) {
    case UT_F32: return ut__cuda_act_t<float, true>(act, x, go, gi, n);
    case UT_BF16: return ut__cuda_act_t<ut__cuda_bf16, true>(act, x, go, gi, n);
  }
  return ut__cuda_no_dtype("act_bwd", dt);
}
