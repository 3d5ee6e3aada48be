/* elementwise.cu — fill, copy, cast, axpy, scale, relu; transpose, bias_add and the depthwise
   multiplier's chan_repeat / chan_group_sum; global_avgpool2d (row_mean); mse_loss and
   cross_entropy. The files and the naming: common.cuh.

   The activation ops are templates over the element type T (float or ut__cuda_bf16, see
   common.cuh "bf16 activations"): float32 arithmetic either way, a bf16 store rounds to nearest
   even; each table function switches on its ut_dtype to the T it instantiates. The streaming
   ones (cast, axpy, scale, relu, bias_add) move bf16 8 values per 16-byte access when every
   buffer they touch is 16-byte aligned (the rest, and unaligned buffers, one value at a time):
   bf16 is there to halve the bytes, so the accesses must stay wide. */
#include "common.cuh"

#include <type_traits>

/* ============================================================================================
   bf16 streaming: 8 values per 16-byte access
   ============================================================================================ */

static __device__ __forceinline__ void ut__cuda_ld8(const ut__cuda_bf16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) { /* little endian: the lower half is the first value */
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
static __device__ __forceinline__ void ut__cuda_ld8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
static __device__ __forceinline__ unsigned ut__cuda_bf16_pack2(float lo, float hi) {
  return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
static __device__ __forceinline__ void ut__cuda_st8(ut__cuda_bf16* p, const float (&f)[8]) {
  uint4 u;
  u.x = ut__cuda_bf16_pack2(f[0], f[1]);
  u.y = ut__cuda_bf16_pack2(f[2], f[3]);
  u.z = ut__cuda_bf16_pack2(f[4], f[5]);
  u.w = ut__cuda_bf16_pack2(f[6], f[7]);
  *reinterpret_cast<uint4*>(p) = u;
}
static __device__ __forceinline__ void ut__cuda_st8(float* p, const float (&f)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

static inline bool ut__cuda_aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* 8-value groups of a streaming op over n values: n / 8 when the buffers allow it (only bf16
   ones are vectorized: float32 keeps its one-value-per-thread kernels, to the bit as before) */
template <typename T>
static inline ut__i64 ut__cuda_groups8(ut__i64 n, bool aligned) {
  return std::is_same<T, float>::value || !aligned ? 0 : n / 8;
}

/* blocks for a streaming op: one thread per group, or per value when there are none */
static inline unsigned ut__cuda_grid_stream(ut__i64 n, ut__i64 nv) {
  return ut__cuda_grid_for(nv > 0 ? nv : n, 256);
}

/* y[i] = f(x[i]) for i < n (y may be x). nv groups of 8 first (0: none), then the values from
   8 nv on, one at a time. */
template <typename Tx, typename Ty, class F>
static __global__ void ut__cuda_map1_kernel(const Tx* x, Ty* y, ut__i64 n, ut__i64 nv, F f) {
  const ut__i64 start = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x;
  const ut__i64 step = (ut__i64)gridDim.x * blockDim.x;
  if constexpr (!std::is_same<Tx, float>::value || !std::is_same<Ty, float>::value) {
    for (ut__i64 v = start; v < nv; v += step) {
      float a[8];
      ut__cuda_ld8(x + v * 8, a);
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = f(a[j]);
      ut__cuda_st8(y + v * 8, a);
    }
  }
  for (ut__i64 i = nv * 8 + start; i < n; i += step) ut__cuda_st(y + i, f(ut__cuda_ld(x + i)));
}

/* y[i] = f(a[i], b[i]) for i < n (y may be a or b); groups as ut__cuda_map1_kernel */
template <typename T, class F>
static __global__ void ut__cuda_map2_kernel(const T* a, const T* b, T* y, ut__i64 n, ut__i64 nv,
                                            F f) {
  const ut__i64 start = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x;
  const ut__i64 step = (ut__i64)gridDim.x * blockDim.x;
  if constexpr (!std::is_same<T, float>::value) {
    for (ut__i64 v = start; v < nv; v += step) {
      float fa[8], fb[8];
      ut__cuda_ld8(a + v * 8, fa);
      ut__cuda_ld8(b + v * 8, fb);
#pragma unroll
      for (int j = 0; j < 8; ++j) fa[j] = f(fa[j], fb[j]);
      ut__cuda_st8(y + v * 8, fa);
    }
  }
  for (ut__i64 i = nv * 8 + start; i < n; i += step)
    ut__cuda_st(y + i, f(ut__cuda_ld(a + i), ut__cuda_ld(b + i)));
}

template <typename Tx, typename Ty, class F>
static int ut__cuda_map1(const Tx* x, Ty* y, ut__i64 n, F f, const char* what) {
  if (n <= 0) return UT_OK;
  const ut__i64 nv = std::is_same<Tx, float>::value && std::is_same<Ty, float>::value
                         ? 0
                         : ut__cuda_aligned16(x) && ut__cuda_aligned16(y) ? n / 8 : 0;
  ut__cuda_map1_kernel<<<ut__cuda_grid_stream(n, nv), 256, 0, ut__cuda_stream>>>(x, y, n, nv, f);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

template <typename T, class F>
static int ut__cuda_map2(const T* a, const T* b, T* y, ut__i64 n, F f, const char* what) {
  if (n <= 0) return UT_OK;
  const ut__i64 nv = ut__cuda_groups8<T>(
      n, ut__cuda_aligned16(a) && ut__cuda_aligned16(b) && ut__cuda_aligned16(y));
  ut__cuda_map2_kernel<<<ut__cuda_grid_stream(n, nv), 256, 0, ut__cuda_stream>>>(a, b, y, n, nv,
                                                                                 f);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

/* ============================================================================================
   Elementwise
   ============================================================================================ */

/* the ops, one value at a time (float32 in, float32 out; the kernels above load and store) */
struct ut__cuda_cast_fn {
  __device__ float operator()(float v) const { return v; }
};
struct ut__cuda_axpy_fn { /* (y, x) -> y + a x */
  float a;
  __device__ float operator()(float y, float x) const { return y + a * x; }
};
struct ut__cuda_scale_fn {
  float a;
  __device__ float operator()(float x) const { return x * a; }
};
struct ut__cuda_relu_fn {
  float cap;
  __device__ float operator()(float v) const {
    v = v > 0.f ? v : 0.f;
    if (cap > 0.f && v > cap) v = cap;
    return v;
  }
};
struct ut__cuda_relu_backward_fn { /* (go, x) -> gi */
  float cap;
  __device__ float operator()(float go, float v) const {
    bool stop = v <= 0.f || (cap > 0.f && v >= cap); /* false for NaN: passes go, like PyTorch */
    bool pass = !stop;
    return pass ? go : 0.f;
  }
};

__global__ void ut__cuda_fill_kernel(float* __restrict__ x, ut__i64 n, float v) {
  UT__CUDA_GRID_STRIDE(i, n) x[i] = v;
}

/* x[i] = v (bits: v rounded to bf16) for i < n, 8 per store in the first nv groups */
static __global__ void ut__cuda_fill_bf16_kernel(ut__cuda_bf16* __restrict__ x, ut__i64 n,
                                                 ut__i64 nv, unsigned short bits) {
  const ut__i64 start = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x;
  const ut__i64 step = (ut__i64)gridDim.x * blockDim.x;
  const unsigned w = (unsigned)bits | ((unsigned)bits << 16);
  for (ut__i64 v = start; v < nv; v += step)
    reinterpret_cast<uint4*>(x)[v] = make_uint4(w, w, w, w);
  for (ut__i64 i = nv * 8 + start; i < n; i += step) x[i] = __ushort_as_bfloat16(bits);
}

/* the two fills by type (depthwise.cu calls them by these names) */
static int ut__cuda_fill_f32(float* x, ut__i64 n, float v) {
  if (n <= 0) return UT_OK;
  ut__cuda_fill_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(x, n, v);
  UT__CUDA_LAUNCHED("fill");
  return UT_OK;
}

static int ut__cuda_fill_bf16(void* x, ut__i64 n, float v) {
  if (n <= 0) return UT_OK;
  const ut__i64 nv = ut__cuda_aligned16(x) ? n / 8 : 0;
  const unsigned short bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  ut__cuda_fill_bf16_kernel<<<ut__cuda_grid_stream(n, nv), 256, 0, ut__cuda_stream>>>(
      (ut__cuda_bf16*)x, n, nv, bits);
  UT__CUDA_LAUNCHED("fill_bf16");
  return UT_OK;
}

int ut__cuda_fill(ut_dtype dt, void* x, ut__i64 n, float v) {
  switch (dt) {
    case UT_F32: return ut__cuda_fill_f32((float*)x, n, v);
    case UT_BF16: return ut__cuda_fill_bf16(x, n, v);
  }
  return ut__cuda_no_dtype("fill", dt);
}

int ut__cuda_copy(float* dst, const float* src, ut__i64 n) {
  if (n <= 0 || dst == src) return UT_OK;
  UT__CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice,
                                 ut__cuda_stream),
                 "copy");
  return UT_OK;
}

int ut__cuda_copy2d(ut_dtype dt, const void* src, ut__i64 src_ld, void* dst, ut__i64 dst_ld,
                    int rows, ut__i64 cols) {
  if (dt != UT_F32 && dt != UT_BF16) return ut__cuda_no_dtype("copy2d", dt);
  if (rows <= 0 || cols <= 0) return UT_OK;
  const size_t es = dt == UT_F32 ? sizeof(float) : sizeof(ut__cuda_bf16);
  UT__CUDA_CHECK(cudaMemcpy2DAsync(dst, (size_t)dst_ld * es, src, (size_t)src_ld * es,
                                   (size_t)cols * es, (size_t)rows, cudaMemcpyDeviceToDevice,
                                   ut__cuda_stream),
                 "copy2d");
  return UT_OK;
}

int ut__cuda_cast(ut_dtype src_dt, ut_dtype dst_dt, const void* src, void* dst, ut__i64 n) {
  if ((src_dt != UT_F32 && src_dt != UT_BF16) || (dst_dt != UT_F32 && dst_dt != UT_BF16))
    return ut__set_error(UT_ERR_ARG, "cast: invalid dtype (%d -> %d)", (int)src_dt, (int)dst_dt);
  if (n <= 0) return UT_OK;
  if (src_dt == dst_dt) {
    if (src == dst) return UT_OK;
    size_t bytes = (size_t)n * (src_dt == UT_BF16 ? sizeof(ut__cuda_bf16) : sizeof(float));
    UT__CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ut__cuda_stream),
                   "cast");
    return UT_OK;
  }
  if (src_dt == UT_F32)
    return ut__cuda_map1((const float*)src, (ut__cuda_bf16*)dst, n, ut__cuda_cast_fn{},
                         "cast to bf16");
  return ut__cuda_map1((const ut__cuda_bf16*)src, (float*)dst, n, ut__cuda_cast_fn{},
                       "cast to float32");
}

int ut__cuda_axpy(ut_dtype dt, void* y, const void* x, ut__i64 n, float alpha) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_map2<float>((const float*)y, (const float*)x, (float*)y, n,
                                  ut__cuda_axpy_fn{alpha}, "axpy");
    case UT_BF16:
      return ut__cuda_map2<ut__cuda_bf16>((const ut__cuda_bf16*)y, (const ut__cuda_bf16*)x,
                                          (ut__cuda_bf16*)y, n, ut__cuda_axpy_fn{alpha},
                                          "axpy_bf16");
  }
  return ut__cuda_no_dtype("axpy", dt);
}

int ut__cuda_scale(ut_dtype dt, void* x, ut__i64 n, float alpha) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_map1<float, float>((const float*)x, (float*)x, n,
                                         ut__cuda_scale_fn{alpha}, "scale");
    case UT_BF16:
      return ut__cuda_map1<ut__cuda_bf16, ut__cuda_bf16>(
          (const ut__cuda_bf16*)x, (ut__cuda_bf16*)x, n, ut__cuda_scale_fn{alpha}, "scale_bf16");
  }
  return ut__cuda_no_dtype("scale", dt);
}

int ut__cuda_relu_fwd(ut_dtype dt, const void* x, void* y, ut__i64 n, float cap) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_map1<float, float>((const float*)x, (float*)y, n, ut__cuda_relu_fn{cap},
                                         "relu");
    case UT_BF16:
      return ut__cuda_map1<ut__cuda_bf16, ut__cuda_bf16>(
          (const ut__cuda_bf16*)x, (ut__cuda_bf16*)y, n, ut__cuda_relu_fn{cap}, "relu_bf16");
  }
  return ut__cuda_no_dtype("relu_fwd", dt);
}

int ut__cuda_relu_bwd(ut_dtype dt, const void* go, const void* x, void* gi, ut__i64 n,
                      float cap) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_map2<float>((const float*)go, (const float*)x, (float*)gi, n,
                                  ut__cuda_relu_backward_fn{cap}, "relu_bwd");
    case UT_BF16:
      return ut__cuda_map2<ut__cuda_bf16>((const ut__cuda_bf16*)go, (const ut__cuda_bf16*)x,
                                          (ut__cuda_bf16*)gi, n, ut__cuda_relu_backward_fn{cap},
                                          "relu_bwd_bf16");
  }
  return ut__cuda_no_dtype("relu_bwd", dt);
}

/* ============================================================================================
   Transpose and bias
   ============================================================================================ */

/* in: [outer, d0, mid, d1, inner] -> out: [outer, d1, mid, d0, inner], a move (no rounding),
   so the kernel moves units U of whole elements, not values: the widest unit (16, 8, 4 or 2
   bytes) that divides a row of `inner` elements and both buffers' alignment, one thread per
   unit. Indexed with I = 32-bit integers when the units allow: the index's four divisions are
   the kernel's main cost, and in 64 bits they cost several times more. */
template <typename U, typename I>
static __global__ void ut__cuda_transpose_kernel(const U* __restrict__ in, U* __restrict__ out,
                                                 I total, I d0, I mid, I d1, I inner) {
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {
    I t = i;
    I e = t % inner; t /= inner;
    I i0 = t % d0; t /= d0;
    I m = t % mid; t /= mid;
    I i1 = t % d1;
    I o = t / d1;
    out[i] = in[(((o * d0 + i0) * mid + m) * d1 + i1) * inner + e];
  }
}

template <typename U>
static void ut__cuda_transpose_units(const void* in, void* out, ut__i64 total, int d0, int mid,
                                     int d1, ut__i64 inner) {
  const unsigned blocks = ut__cuda_grid_for(total, 256);
  if (total <= (ut__i64)UINT_MAX)
    ut__cuda_transpose_kernel<U, unsigned><<<blocks, 256, 0, ut__cuda_stream>>>(
        (const U*)in, (U*)out, (unsigned)total, (unsigned)d0, (unsigned)mid, (unsigned)d1,
        (unsigned)inner);
  else
    ut__cuda_transpose_kernel<U, ut__i64><<<blocks, 256, 0, ut__cuda_stream>>>(
        (const U*)in, (U*)out, total, d0, mid, d1, inner);
}

template <typename T>
static int ut__cuda_transpose_t(const T* in, T* out, int outer, int d0, int mid, int d1,
                                int inner, const char* what) {
  ut__i64 total = (ut__i64)outer * d0 * mid * d1 * inner;
  if (total <= 0) return UT_OK;
  const ut__i64 row = (ut__i64)inner * sizeof(T); /* bytes */
  const uintptr_t any = (uintptr_t)in | (uintptr_t)out;
  const ut__i64 rows = total / inner;
  if (row % 16 == 0 && any % 16 == 0)
    ut__cuda_transpose_units<uint4>(in, out, rows * (row / 16), d0, mid, d1, row / 16);
  else if (row % 8 == 0 && any % 8 == 0)
    ut__cuda_transpose_units<uint2>(in, out, rows * (row / 8), d0, mid, d1, row / 8);
  else if (row % 4 == 0 && any % 4 == 0)
    ut__cuda_transpose_units<unsigned>(in, out, rows * (row / 4), d0, mid, d1, row / 4);
  else
    ut__cuda_transpose_units<T>(in, out, total, d0, mid, d1, inner);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}
int ut__cuda_transpose(ut_dtype dt, const void* in, void* out, int outer, int d0, int mid,
                       int d1, int inner) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_transpose_t((const float*)in, (float*)out, outer, d0, mid, d1, inner,
                                  "transpose");
    case UT_BF16:
      return ut__cuda_transpose_t((const ut__cuda_bf16*)in, (ut__cuda_bf16*)out, outer, d0, mid,
                                  d1, inner, "transpose_bf16");
  }
  return ut__cuda_no_dtype("transpose", dt);
}

/* x: [n, c, inner]; x[i, j, :] += bias[j] (bias float32). bf16: nv groups of 8 values first,
   each walking its channel index on from the first value's (inner need not be a multiple of
   8), then the rest one at a time. */
template <typename T>
static __global__ void ut__cuda_bias_add_kernel(T* __restrict__ x, const float* __restrict__ bias,
                                                ut__i64 total, ut__i64 nv, int c,
                                                ut__i64 inner) {
  const ut__i64 start = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x;
  const ut__i64 step = (ut__i64)gridDim.x * blockDim.x;
  if constexpr (!std::is_same<T, float>::value) {
    for (ut__i64 v = start; v < nv; v += step) {
      const ut__i64 i0 = v * 8;
      ut__i64 row = i0 / inner, e = i0 - row * inner;
      float b = bias[row % c];
      float f[8];
      ut__cuda_ld8(x + i0, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        f[j] += b;
        if (++e == inner) {
          e = 0;
          b = bias[++row % c]; /* past the last row only when j == 7: an index still < c */
        }
      }
      ut__cuda_st8(x + i0, f);
    }
  }
  for (ut__i64 i = nv * 8 + start; i < total; i += step)
    ut__cuda_st(x + i, ut__cuda_ld(x + i) + bias[(i / inner) % c]);
}

template <typename T>
static int ut__cuda_bias_add_t(T* x, const float* bias, int n, int c, ut__i64 inner,
                               const char* what) {
  ut__i64 total = (ut__i64)n * c * inner;
  if (total <= 0) return UT_OK;
  const ut__i64 nv = ut__cuda_groups8<T>(total, ut__cuda_aligned16(x));
  ut__cuda_bias_add_kernel<T><<<ut__cuda_grid_stream(total, nv), 256, 0, ut__cuda_stream>>>(
      x, bias, total, nv, c, inner);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}
int ut__cuda_bias_add(ut_dtype dt, void* x, const float* bias, int n, int c, ut__i64 inner) {
  switch (dt) {
    case UT_F32: return ut__cuda_bias_add_t((float*)x, bias, n, c, inner, "bias_add");
    case UT_BF16:
      return ut__cuda_bias_add_t((ut__cuda_bf16*)x, bias, n, c, inner, "bias_add_bf16");
  }
  return ut__cuda_no_dtype("bias_add", dt);
}

/* The depthwise channel multiplier's repeat and its adjoint (see ut__dw_repeat in utensil.h):
   [n, c, inner] <-> [n, c*m, inner]; the sum adds the m copies in order, deterministic. */
template <typename T>
static __global__ void ut__cuda_chan_repeat_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                   ut__i64 total, int m, ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, total) { /* i indexes y */
    ut__i64 row = i / inner;
    y[i] = __ldg(x + (row / m) * inner + (i - row * inner));
  }
}
template <typename T>
static __global__ void ut__cuda_chan_group_sum_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                      ut__i64 total, int m, ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, total) { /* i indexes y */
    ut__i64 row = i / inner;
    const T* p = x + row * m * inner + (i - row * inner);
    float s = ut__cuda_ld(p);
    for (int k = 1; k < m; k++) s += ut__cuda_ld(p + k * inner);
    ut__cuda_st(y + i, s);
  }
}
template <typename T>
static int ut__cuda_chan_repeat_t(const T* x, T* y, int n, int c, int m, ut__i64 inner,
                                  const char* what) {
  ut__i64 total = (ut__i64)n * c * m * inner;
  if (total <= 0) return UT_OK;
  ut__cuda_chan_repeat_kernel<T><<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      x, y, total, m, inner);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}
template <typename T>
static int ut__cuda_chan_group_sum_t(const T* x, T* y, int n, int c, int m, ut__i64 inner,
                                     const char* what) {
  ut__i64 total = (ut__i64)n * c * inner;
  if (total <= 0) return UT_OK;
  ut__cuda_chan_group_sum_kernel<T><<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      x, y, total, m, inner);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}
int ut__cuda_chan_repeat(ut_dtype dt, const void* x, void* y, int n, int c, int m,
                         ut__i64 inner) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_chan_repeat_t((const float*)x, (float*)y, n, c, m, inner, "chan_repeat");
    case UT_BF16:
      return ut__cuda_chan_repeat_t((const ut__cuda_bf16*)x, (ut__cuda_bf16*)y, n, c, m, inner,
                                    "chan_repeat_bf16");
  }
  return ut__cuda_no_dtype("chan_repeat", dt);
}
int ut__cuda_chan_group_sum(ut_dtype dt, const void* x, void* y, int n, int c, int m,
                            ut__i64 inner) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_chan_group_sum_t((const float*)x, (float*)y, n, c, m, inner,
                                       "chan_group_sum");
    case UT_BF16:
      return ut__cuda_chan_group_sum_t((const ut__cuda_bf16*)x, (ut__cuda_bf16*)y, n, c, m, inner,
                                       "chan_group_sum_bf16");
  }
  return ut__cuda_no_dtype("chan_group_sum", dt);
}

/* ============================================================================================
   Pooling: global_avgpool2d (a mean over each row of [n*c, h*w])
   ============================================================================================ */

/* x: [rows, cols] -> y[r] = mean of row r; G threads per row (ut__cuda_row_group), W
   elements per load (ut__cuda_vec); each row's order of additions is fixed by (G, W) */
template <int G, int W, typename T>
static __global__ void ut__cuda_global_avgpool2d_kernel(const T* __restrict__ x,
                                                        T* __restrict__ y, int rows,
                                                        ut__i64 cols) {
  static_assert(G == 32 || G == 256, "a warp or the block of 256 per row");
  __shared__ float sh[32];
  const ut__i64 r = (ut__i64)blockIdx.x * (256 / G) + threadIdx.x / G;
  const int lane = threadIdx.x % G;
  float acc = 0.f;
  if (r < rows) {
    const T* row = x + r * cols;
#pragma unroll 4
    for (ut__i64 k = (ut__i64)lane * W; k < cols; k += (ut__i64)G * W) {
      float e[W];
      ut__cuda_vec<W, T>::load(row + k, e);
#pragma unroll
      for (int u = 0; u < W; ++u) acc += e[u];
    }
  }
  acc = ut__cuda_group_sum<G>(acc, sh);
  if (lane == 0 && r < rows) ut__cuda_st(y + r, acc / (float)cols);
}

/* dx[r, :] = go[r] / cols, the quotient taken once per row (in double, as it always was) */
template <int G, int W, typename T>
static __global__ void ut__cuda_global_avgpool2d_backward_kernel(const T* __restrict__ go,
                                                                 T* __restrict__ dx, int rows,
                                                                 ut__i64 cols) {
  const ut__i64 r = (ut__i64)blockIdx.x * (256 / G) + threadIdx.x / G;
  if (r >= rows) return;
  float e[W];
  const float v = (float)((double)ut__cuda_ld(go + r) / (double)cols);
#pragma unroll
  for (int u = 0; u < W; ++u) e[u] = v;
  T* row = dx + r * cols;
  for (ut__i64 k = (ut__i64)(threadIdx.x % G) * W; k < cols; k += (ut__i64)G * W)
    ut__cuda_vec<W, T>::store(row + k, e);
}

/* the row kernels' launch: G and W chosen for the shape and the pointers' alignment */
template <bool BWD, int G, int W, typename T>
static void ut__cuda_row_mean_launch_gw(const T* a, T* b, int rows, ut__i64 cols) {
  const unsigned blocks = (unsigned)ut__cuda_cdiv(rows, 256 / G);
  if (BWD)
    ut__cuda_global_avgpool2d_backward_kernel<G, W, T><<<blocks, 256, 0, ut__cuda_stream>>>(
        a, b, rows, cols);
  else
    ut__cuda_global_avgpool2d_kernel<G, W, T><<<blocks, 256, 0, ut__cuda_stream>>>(a, b, rows,
                                                                                    cols);
}
template <bool BWD, int G, typename T>
static void ut__cuda_row_mean_launch_g(const T* a, T* b, int rows, ut__i64 cols, int w) {
  if (w == 8) ut__cuda_row_mean_launch_gw<BWD, G, 8, T>(a, b, rows, cols);
  else if (w == 4) ut__cuda_row_mean_launch_gw<BWD, G, 4, T>(a, b, rows, cols);
  else ut__cuda_row_mean_launch_gw<BWD, G, 1, T>(a, b, rows, cols);
}
template <bool BWD, typename T>
static int ut__cuda_row_mean_launch(const T* a, T* b, int rows, ut__i64 cols, const char* what) {
  /* the forward's y and the backward's go hold one value per row: only the side with rows of
     cols elements needs aligning */
  const int w = ut__cuda_vec_width<T>(cols, BWD ? (const void*)b : (const void*)a, NULL, NULL);
  if (ut__cuda_row_group(rows, cols) == 256)
    ut__cuda_row_mean_launch_g<BWD, 256, T>(a, b, rows, cols, w);
  else
    ut__cuda_row_mean_launch_g<BWD, 32, T>(a, b, rows, cols, w);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

int ut__cuda_row_mean(ut_dtype dt, const void* x, void* y, int rows, ut__i64 cols) {
  if (dt != UT_F32 && dt != UT_BF16) return ut__cuda_no_dtype("row_mean", dt);
  if (rows <= 0) return UT_OK;
  if (cols <= 0) return ut__cuda_fill(dt, y, rows, 0.f);
  if (dt == UT_F32)
    return ut__cuda_row_mean_launch<false>((const float*)x, (float*)y, rows, cols, "row_mean");
  return ut__cuda_row_mean_launch<false>((const ut__cuda_bf16*)x, (ut__cuda_bf16*)y, rows, cols,
                                         "row_mean_bf16");
}

int ut__cuda_row_mean_bwd(ut_dtype dt, const void* go, void* dx, int rows, ut__i64 cols) {
  if (dt != UT_F32 && dt != UT_BF16) return ut__cuda_no_dtype("row_mean_bwd", dt);
  if (rows <= 0 || cols <= 0) return UT_OK;
  if (dt == UT_F32)
    return ut__cuda_row_mean_launch<true>((const float*)go, (float*)dx, rows, cols,
                                          "row_mean_bwd");
  return ut__cuda_row_mean_launch<true>((const ut__cuda_bf16*)go, (ut__cuda_bf16*)dx, rows, cols,
                                        "row_mean_bwd_bf16");
}

/* ============================================================================================
   Losses
   ============================================================================================ */

/* a fixed number of blocks (a function of n only) each write a partial sum of (p - t)^2 */
static __global__ void ut__cuda_mse_loss_partial_kernel(const float* __restrict__ p,
                                                        const float* __restrict__ t, ut__i64 n,
                                                        float* __restrict__ ws) {
  __shared__ float sh[32];
  float a[1] = {0.f};
  UT__CUDA_GRID_STRIDE(i, n) {
    float d = p[i] - t[i];
    a[0] += d * d;
  }
  ut__cuda_block_sum<1>(a, sh);
  if (threadIdx.x == 0) ws[blockIdx.x] = a[0];
}

/* out[0] = scale * sum of ws[0..parts) in a fixed order (one block of 256) */
static __global__ void ut__cuda_loss_sum_final_kernel(const float* __restrict__ ws, int parts,
                                                      float* __restrict__ out, double scale) {
  __shared__ double sh[256];
  double s = 0.0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) s += ws[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = (float)(sh[0] * scale);
}

int ut__cuda_mse_fwd(const float* p, const float* t, float* out, ut__i64 n) {
  if (n <= 0) return ut__cuda_fill(UT_F32, out, 1, 0.f);
  ut__i64 blocks = ut__cuda_cdiv(n, 256 * 8);
  if (blocks > 1024) blocks = 1024;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)blocks * sizeof(float), &ws);
  if (st) return st;
  ut__cuda_mse_loss_partial_kernel<<<(unsigned)blocks, 256, 0, ut__cuda_stream>>>(p, t, n, ws);
  UT__CUDA_LAUNCHED("mse_fwd");
  ut__cuda_loss_sum_final_kernel<<<1, 256, 0, ut__cuda_stream>>>(
      ws, (int)blocks, out, 1.0 / (double)n);
  UT__CUDA_LAUNCHED("mse_fwd final");
  return UT_OK;
}

static __global__ void ut__cuda_mse_loss_backward_kernel(const float* __restrict__ p,
                                                         const float* __restrict__ t,
                                                         float* __restrict__ g, ut__i64 n,
                                                         float scale) {
  UT__CUDA_GRID_STRIDE(i, n) g[i] = scale * (p[i] - t[i]);
}

int ut__cuda_mse_bwd(const float* p, const float* t, float* g, ut__i64 n) {
  if (n <= 0) return UT_OK;
  ut__cuda_mse_loss_backward_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(
      p, t, g, n, 2.0f / (float)n);
  UT__CUDA_LAUNCHED("mse_bwd");
  return UT_OK;
}

/* label as a class index, or -1 when it is not an integer in [0, k) */
static __device__ __forceinline__ int ut__cuda_cross_entropy_label(float l, int k) {
  if (!(l >= 0.f && (double)l < (double)k) || l != floorf(l)) return -1;
  return (int)l;
}

/* one block per row: loss[r] = logsumexp(row) - row[label]; with label smoothing eps,
   logsumexp(row) - (1 - eps) row[label] - eps mean(row) */
static __global__ void ut__cuda_cross_entropy_rows_kernel(const float* __restrict__ logits,
                                                          const float* __restrict__ labels,
                                                          float* __restrict__ loss, int k,
                                                          float eps) {
  __shared__ float sh[64]; /* block_sum<2>: 32 * 2 */
  const ut__i64 r = blockIdx.x;
  const float* x = logits + r * k;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < k; i += blockDim.x) mx = fmaxf(mx, x[i]);
  mx = ut__cuda_block_max(mx, sh);
  float a[2] = {0.f, 0.f};
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    a[0] += expf(x[i] - mx);
    if (eps != 0.f) a[1] += x[i] - mx;
  }
  ut__cuda_block_sum<2>(a, sh); /* a[1] stays 0 without smoothing; a[0] sums alike either way */
  if (threadIdx.x == 0) {
    int lab = ut__cuda_cross_entropy_label(labels[r], k);
    /* x[lab] - mx first: logf(a) + mx would lose logf(a) beside a large mx (1e30 + 1.8) */
    float l = eps != 0.f ? logf(a[0]) - (1.f - eps) * (x[lab] - mx) - eps * (a[1] / (float)k)
                         : logf(a[0]) - (x[lab] - mx);
    loss[r] = lab < 0 ? NAN : l;
  }
}

int ut__cuda_ce_fwd(const float* logits, const float* labels, float* out, int n, int k,
                    float eps) {
  if (n <= 0 || k <= 0) return ut__cuda_fill(UT_F32, out, 1, n > 0 ? NAN : 0.f);
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)n * sizeof(float), &ws);
  if (st) return st;
  ut__cuda_cross_entropy_rows_kernel<<<(unsigned)n, ut__cuda_row_threads(k), 0, ut__cuda_stream>>>(
      logits, labels, ws, k, eps);
  UT__CUDA_LAUNCHED("ce_fwd");
  ut__cuda_loss_sum_final_kernel<<<1, 256, 0, ut__cuda_stream>>>(ws, n, out, 1.0 / (double)n);
  UT__CUDA_LAUNCHED("ce_fwd final");
  return UT_OK;
}

static __global__ void ut__cuda_cross_entropy_backward_kernel(const float* __restrict__ logits,
                                                              const float* __restrict__ labels,
                                                              float* __restrict__ g, int k,
                                                              float inv_n, float eps) {
  __shared__ float sh[32];
  const ut__i64 r = blockIdx.x;
  const float* x = logits + r * k;
  float* gr = g + r * k;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < k; i += blockDim.x) mx = fmaxf(mx, x[i]);
  mx = ut__cuda_block_max(mx, sh);
  float a[1] = {0.f};
  for (int i = threadIdx.x; i < k; i += blockDim.x) a[0] += expf(x[i] - mx);
  ut__cuda_block_sum<1>(a, sh);
  const int lab = ut__cuda_cross_entropy_label(labels[r], k);
  const float inv = 1.f / a[0];
  /* the smoothed target: (1 - eps) onehot + eps / K (eps 0: onehot) */
  const float on = 1.f - eps, off = eps / (float)k;
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    float v = eps != 0.f ? expf(x[i] - mx) * inv - off - (i == lab ? on : 0.f)
                         : expf(x[i] - mx) * inv - (i == lab ? 1.f : 0.f);
    gr[i] = lab < 0 ? NAN : v * inv_n;
  }
}

int ut__cuda_ce_bwd(const float* logits, const float* labels, float* g, int n, int k,
                    float eps) {
  if (n <= 0 || k <= 0) return UT_OK;
  ut__cuda_cross_entropy_backward_kernel
      <<<(unsigned)n, ut__cuda_row_threads(k), 0, ut__cuda_stream>>>(
      logits, labels, g, k, 1.f / (float)n, eps);
  UT__CUDA_LAUNCHED("ce_bwd");
  return UT_OK;
}
