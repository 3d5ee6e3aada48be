/* scale.cu — the per-channel scales of squeeze-and-excitation and ConvNeXt, and LayerNorm over
   the channels of an NCHW tensor (ConvNeXt's LayerNorm2d); issue 30. Slots (utensil.h, BACKEND
   INTERFACE): chan_scale, chan_dot, ln2d_fwd, ln2d_bwd, each switching on the activations'
   type (float32, bf16) to a template over it; statistics, parameters and sums are float32.

   Reductions are deterministic (common.cuh): chan_dot and the LayerNorm2d parameter gradients
   sum each (sample, channel) row in one warp or block (a fixed order for the shape), and a
   second kernel sums the rows of a channel over the samples in order, in double.

   LayerNorm2d works on NCHW directly: a lane per position walks (its share of) the C channels
   at stride H*W, and adjacent lanes read adjacent positions of one channel, so every access is
   coalesced without moving data. The alternative, the rows layernorm between NCHW<->NHWC
   transposes (two in forward, three in backward), reads and writes the whole tensor twice more
   per direction and would need a bf16 rows layernorm too. The walk reads x three times (the
   mean, then the spread around it: no sum-of-squares cancellation, then the output), the last
   two mostly from L1/L2. */
#include "common.cuh"

/* ---- chan_scale: y[i, j, :] = x[i, j, :] * s[i*c + j] (shared: s[j]) ----
   Row kernels (common.cuh, ut__cuda_row_group): G threads per (sample, channel) row, so s is
   read once per row and the element's row costs no division. */
template <int G, int W, typename T, typename S>
static __global__ void ut__cuda_channel_scale_kernel(const T* __restrict__ x,
                                                     const S* __restrict__ s, T* __restrict__ y,
                                                     ut__i64 rows, int c, ut__i64 inner,
                                                     bool shared) {
  const ut__i64 r = (ut__i64)blockIdx.x * (256 / G) + threadIdx.x / G;
  if (r >= rows) return;
  const float sv = ut__cuda_ld(s + (shared ? r % c : r));
  const T* xr = x + r * inner;
  T* yr = y + r * inner;
#pragma unroll 4
  for (ut__i64 k = (ut__i64)(threadIdx.x % G) * W; k < inner; k += (ut__i64)G * W) {
    float e[W];
    ut__cuda_vec<W, T>::load(xr + k, e);
#pragma unroll
    for (int u = 0; u < W; ++u) e[u] *= sv;
    ut__cuda_vec<W, T>::store(yr + k, e);
  }
}

template <int G, int W, typename T, typename S>
static void ut__cuda_chan_scale_gw(const T* x, const S* s, T* y, ut__i64 rows, int c,
                                   ut__i64 inner, bool shared) {
  ut__cuda_channel_scale_kernel<G, W, T, S>
      <<<(unsigned)ut__cuda_cdiv(rows, 256 / G), 256, 0, ut__cuda_stream>>>(x, s, y, rows, c,
                                                                            inner, shared);
}
template <int G, typename T, typename S>
static void ut__cuda_chan_scale_g(const T* x, const S* s, T* y, ut__i64 rows, int c,
                                  ut__i64 inner, bool shared, int w) {
  if (w == 8) ut__cuda_chan_scale_gw<G, 8, T, S>(x, s, y, rows, c, inner, shared);
  else if (w == 4) ut__cuda_chan_scale_gw<G, 4, T, S>(x, s, y, rows, c, inner, shared);
  else ut__cuda_chan_scale_gw<G, 1, T, S>(x, s, y, rows, c, inner, shared);
}

template <typename T, typename S>
static int ut__cuda_chan_scale_t(const void* x, const void* s, void* y, int n, int c,
                                 ut__i64 inner, bool shared, const char* what) {
  const ut__i64 rows = (ut__i64)n * c;
  if (rows <= 0 || inner <= 0) return UT_OK;
  const int w = ut__cuda_vec_width<T>(inner, x, y, NULL);
  if (ut__cuda_row_group(rows, inner) == 256)
    ut__cuda_chan_scale_g<256>((const T*)x, (const S*)s, (T*)y, rows, c, inner, shared, w);
  else
    ut__cuda_chan_scale_g<32>((const T*)x, (const S*)s, (T*)y, rows, c, inner, shared, w);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

int ut__cuda_chan_scale(ut_dtype dt, ut_dtype s_dt, const void* x, const void* s, void* y, int n,
                        int c, ut__i64 inner, bool shared) {
  if (dt == UT_F32 && s_dt == UT_F32)
    return ut__cuda_chan_scale_t<float, float>(x, s, y, n, c, inner, shared, "chan_scale");
  if (dt == UT_BF16 && s_dt == UT_BF16)
    return ut__cuda_chan_scale_t<ut__cuda_bf16, ut__cuda_bf16>(x, s, y, n, c, inner, shared,
                                                              "chan_scale bf16");
  if (dt == UT_BF16 && s_dt == UT_F32)
    return ut__cuda_chan_scale_t<ut__cuda_bf16, float>(x, s, y, n, c, inner, shared,
                                                      "chan_scale bf16 x float32 s");
  return ut__cuda_no_dtype("chan_scale", dt == UT_F32 ? s_dt : dt);
}

/* ---- chan_dot ---- */
/* G threads per row r of [rows, inner] (as chan_scale): dst[r] = sum_k a[r, k] b[r, k]
   (to_ws), else dst[r] = beta * dst[r] + that sum */
template <int G, int W, typename T>
static __global__ void ut__cuda_channel_dot_rows_kernel(const T* __restrict__ a,
                                                        const T* __restrict__ b,
                                                        float* __restrict__ dst, ut__i64 rows,
                                                        ut__i64 inner, bool to_ws, float beta) {
  __shared__ float sh[32];
  const ut__i64 r = (ut__i64)blockIdx.x * (256 / G) + threadIdx.x / G;
  const int lane = threadIdx.x % G;
  float v = 0.f;
  if (r < rows) {
    const T* ar = a + r * inner;
    const T* br = b + r * inner;
#pragma unroll 4
    for (ut__i64 k = (ut__i64)lane * W; k < inner; k += (ut__i64)G * W) {
      float ea[W], eb[W];
      ut__cuda_vec<W, T>::load(ar + k, ea);
      ut__cuda_vec<W, T>::load(br + k, eb);
#pragma unroll
      for (int u = 0; u < W; ++u) v += ea[u] * eb[u];
    }
  }
  v = ut__cuda_group_sum<G>(v, sh);
  if (lane == 0 && r < rows) dst[r] = (to_ws || beta == 0.f) ? v : dst[r] + v;
}

template <int G, int W, typename T>
static void ut__cuda_chan_dot_rows_gw(const T* a, const T* b, float* dst, ut__i64 rows,
                                      ut__i64 inner, bool to_ws, float beta) {
  ut__cuda_channel_dot_rows_kernel<G, W, T>
      <<<(unsigned)ut__cuda_cdiv(rows, 256 / G), 256, 0, ut__cuda_stream>>>(a, b, dst, rows,
                                                                            inner, to_ws, beta);
}
template <int G, typename T>
static void ut__cuda_chan_dot_rows_g(const T* a, const T* b, float* dst, ut__i64 rows,
                                     ut__i64 inner, bool to_ws, float beta, int w) {
  if (w == 8) ut__cuda_chan_dot_rows_gw<G, 8, T>(a, b, dst, rows, inner, to_ws, beta);
  else if (w == 4) ut__cuda_chan_dot_rows_gw<G, 4, T>(a, b, dst, rows, inner, to_ws, beta);
  else ut__cuda_chan_dot_rows_gw<G, 1, T>(a, b, dst, rows, inner, to_ws, beta);
}
template <typename T>
static void ut__cuda_chan_dot_rows(const T* a, const T* b, float* dst, ut__i64 rows,
                                   ut__i64 inner, bool to_ws, float beta) {
  const int w = ut__cuda_vec_width<T>(inner, a, b, NULL);
  if (ut__cuda_row_group(rows, inner) == 256)
    ut__cuda_chan_dot_rows_g<256>(a, b, dst, rows, inner, to_ws, beta, w);
  else
    ut__cuda_chan_dot_rows_g<32>(a, b, dst, rows, inner, to_ws, beta, w);
}

/* out[j] = beta * out[j] + sum over i in order of ws[i*c + j] (in double) */
static __global__ void ut__cuda_channel_dot_final_kernel(const float* __restrict__ ws,
                                                         float* __restrict__ out, int n, int c,
                                                         float beta) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  double t = 0.0;
  for (int i = 0; i < n; ++i) t += ws[(ut__i64)i * c + j];
  out[j] = beta == 0.f ? (float)t : out[j] + (float)t;
}

template <typename T>
static int ut__cuda_chan_dot_t(const void* a, const void* b, float* out, int n, int c,
                               ut__i64 inner, bool shared, float beta, const char* what) {
  const ut__i64 rows = (ut__i64)n * c;
  if (rows <= 0) return UT_OK;
  if (!shared) {
    ut__cuda_chan_dot_rows((const T*)a, (const T*)b, out, rows, inner, false, beta);
    UT__CUDA_LAUNCHED(what);
    return UT_OK;
  }
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)rows * sizeof(float), &ws);
  if (st) return st;
  ut__cuda_chan_dot_rows((const T*)a, (const T*)b, ws, rows, inner, true, 0.f);
  UT__CUDA_LAUNCHED(what);
  ut__cuda_channel_dot_final_kernel<<<(unsigned)ut__cuda_cdiv(c, 256), 256, 0,
                                      ut__cuda_stream>>>(ws, out, n, c, beta);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

int ut__cuda_chan_dot(ut_dtype dt, const void* a, const void* b, float* out, int n, int c,
                      ut__i64 inner, bool shared, float beta) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_chan_dot_t<float>(a, b, out, n, c, inner, shared, beta, "chan_dot");
    case UT_BF16:
      return ut__cuda_chan_dot_t<ut__cuda_bf16>(a, b, out, n, c, inner, shared, beta,
                                                "chan_dot bf16");
  }
  return ut__cuda_no_dtype("chan_dot", dt);
}

/* ---- LayerNorm2d: blocks of (32 positions) x (g channel groups) over [n, c, inner] ----
   Lane threadIdx.x owns position p = 32 blockIdx.x + threadIdx.x of the n*inner positions;
   group threadIdx.y walks the channels j = y, y + g, y + 2g, ... of it. For one j the 32 lanes
   read 32 consecutive positions (coalesced); the g groups multiply the threads of a small
   plane (ConvNeXt's 7x7 stage: n*49 positions) without giving that up. The groups' partial
   sums meet in shared memory and are added in group order (deterministic). */
#define UT__CUDA_LN2D_MAX_GROUPS 32

/* every thread of the block: the sum over the groups of v at this thread's position */
static __device__ __forceinline__ float ut__cuda_ln2d_group_sum(float v, float (*sh)[33]) {
  __syncthreads(); /* sh may still be read by the previous sum */
  sh[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  float t = 0.f;
  for (int q = 0; q < (int)blockDim.y; ++q) t += sh[q][threadIdx.x];
  return t;
}

template <typename T>
static __global__ void ut__cuda_layernorm2d_forward_kernel(
    const T* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ beta,
    T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, int n, int c,
    ut__i64 inner, float eps) {
  __shared__ float sh[UT__CUDA_LN2D_MAX_GROUPS][33];
  const int g = (int)blockDim.y;
  const ut__i64 p = (ut__i64)blockIdx.x * 32 + threadIdx.x;
  const bool live = p < (ut__i64)n * inner;
  const ut__i64 i = live ? p / inner : 0;
  const ut__i64 off = live ? i * c * inner + (p - i * inner) : 0;
  /* sums of x - pivot (the position's first channel): near a large common offset those
     differences are exact, where float32 sums of x itself would round the mean by more than
     the spread (x near 1000 spread by 0.01: 1% of the normalised output) */
  const float pivot = live ? ut__cuda_ld(x + off) : 0.f;
  float s = 0.f;
  if (live)
    for (int j = threadIdx.y; j < c; j += g) s += ut__cuda_ld(x + off + j * inner) - pivot;
  const float delta = ut__cuda_ln2d_group_sum(s, sh) / (float)c; /* mean = pivot + delta */
  float q = 0.f;
  if (live)
    for (int j = threadIdx.y; j < c; j += g) {
      const float d = (ut__cuda_ld(x + off + j * inner) - pivot) - delta;
      q += d * d;
    }
  const float rs = 1.0f / sqrtf(ut__cuda_ln2d_group_sum(q, sh) / (float)c + eps);
  if (!live) return; /* after the block's last __syncthreads */
  if (threadIdx.y == 0) {
    mean[p] = pivot + delta;
    rstd[p] = rs;
  }
  for (int j = threadIdx.y; j < c; j += g)
    ut__cuda_st(y + off + j * inner,
                ((ut__cuda_ld(x + off + j * inner) - pivot) - delta) * rs * gamma[j] + beta[j]);
}

/* dx = rstd (g - mean_j(g) - xhat mean_j(g xhat)), g = go gamma */
template <typename T>
static __global__ void ut__cuda_layernorm2d_dx_kernel(
    const T* __restrict__ go, const T* __restrict__ x, const float* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx, int n,
    int c, ut__i64 inner) {
  __shared__ float sh[UT__CUDA_LN2D_MAX_GROUPS][33];
  const int g = (int)blockDim.y;
  const ut__i64 p = (ut__i64)blockIdx.x * 32 + threadIdx.x;
  const bool live = p < (ut__i64)n * inner;
  const ut__i64 i = live ? p / inner : 0;
  const ut__i64 off = live ? i * c * inner + (p - i * inner) : 0;
  const float mu = live ? mean[p] : 0.f, rs = live ? rstd[p] : 0.f;
  float s1 = 0.f, s2 = 0.f;
  if (live)
    for (int j = threadIdx.y; j < c; j += g) {
      const float gv = ut__cuda_ld(go + off + j * inner) * gamma[j];
      s1 += gv;
      s2 += gv * ((ut__cuda_ld(x + off + j * inner) - mu) * rs);
    }
  const float m1 = ut__cuda_ln2d_group_sum(s1, sh) / (float)c;
  const float m2 = ut__cuda_ln2d_group_sum(s2, sh) / (float)c;
  if (!live) return; /* after the block's last __syncthreads */
  for (int j = threadIdx.y; j < c; j += g) {
    const float gv = ut__cuda_ld(go + off + j * inner) * gamma[j];
    const float xh = (ut__cuda_ld(x + off + j * inner) - mu) * rs;
    ut__cuda_st(dx + off + j * inner, rs * (gv - m1 - xh * m2));
  }
}

/* The launch shape for pos positions of c channels: 32 positions a block and the groups per
   block, at least 4 (128 threads), doubled up to 32 while the grid has fewer than about 32
   warps per multiprocessor, and never more than the channels. */
static dim3 ut__cuda_ln2d_block(ut__i64 pos, int c, unsigned* blocks) {
  const ut__i64 b = ut__cuda_cdiv(pos, 32);
  const ut__i64 want = ut__cuda_cdiv((ut__i64)ut__cuda_sms * 32, b);
  int g = 4;
  while (g < UT__CUDA_LN2D_MAX_GROUPS && g < want) g *= 2;
  if (g > c) g = c;
  *blocks = (unsigned)b;
  return dim3(32, (unsigned)g);
}

/* one block per row r = (i, j): ws[2r] = sum_k go xhat, ws[2r + 1] = sum_k go */
template <typename T>
static __global__ void ut__cuda_layernorm2d_params_rows_kernel(
    const T* __restrict__ go, const T* __restrict__ x, const float* __restrict__ mean,
    const float* __restrict__ rstd, float* __restrict__ ws, int c, ut__i64 inner) {
  __shared__ float sh[64];
  const ut__i64 r = blockIdx.x, i = r / c;
  const T* gr = go + r * inner;
  const T* xr = x + r * inner;
  const float* m = mean + i * inner;
  const float* rs = rstd + i * inner;
  float v[2] = {0.f, 0.f};
  for (ut__i64 k = threadIdx.x; k < inner; k += blockDim.x) {
    const float g = ut__cuda_ld(gr + k);
    v[0] += g * ((ut__cuda_ld(xr + k) - m[k]) * rs[k]);
    v[1] += g;
  }
  ut__cuda_block_sum<2>(v, sh);
  if (threadIdx.x == 0) {
    ws[2 * r] = v[0];
    ws[2 * r + 1] = v[1];
  }
}

static __global__ void ut__cuda_layernorm2d_params_final_kernel(const float* __restrict__ ws,
                                                                float* __restrict__ dgamma,
                                                                float* __restrict__ dbeta, int n,
                                                                int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  double sg = 0.0, sb = 0.0;
  for (int i = 0; i < n; ++i) {
    sg += ws[2 * ((ut__i64)i * c + j)];
    sb += ws[2 * ((ut__i64)i * c + j) + 1];
  }
  if (dgamma) dgamma[j] += (float)sg;
  if (dbeta) dbeta[j] += (float)sb;
}

template <typename T>
static int ut__cuda_ln2d_fwd_t(const void* x, const float* gamma, const float* beta, void* y,
                               float* mean, float* rstd, int n, int c, ut__i64 inner, float eps,
                               const char* what) {
  const ut__i64 pos = (ut__i64)n * inner;
  if (pos <= 0 || c <= 0) return UT_OK;
  unsigned blocks;
  const dim3 block = ut__cuda_ln2d_block(pos, c, &blocks);
  ut__cuda_layernorm2d_forward_kernel<T><<<blocks, block, 0, ut__cuda_stream>>>(
      (const T*)x, gamma, beta, (T*)y, mean, rstd, n, c, inner, eps);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

template <typename T>
static int ut__cuda_ln2d_bwd_t(const void* go, const void* x, const float* gamma,
                               const float* mean, const float* rstd, void* dx, float* dgamma,
                               float* dbeta, int n, int c, ut__i64 inner, const char* what) {
  const ut__i64 pos = (ut__i64)n * inner, rows = (ut__i64)n * c;
  if (pos <= 0 || c <= 0) return UT_OK;
  if (dx) {
    unsigned blocks;
    const dim3 block = ut__cuda_ln2d_block(pos, c, &blocks);
    ut__cuda_layernorm2d_dx_kernel<T><<<blocks, block, 0, ut__cuda_stream>>>(
        (const T*)go, (const T*)x, gamma, mean, rstd, (T*)dx, n, c, inner);
    UT__CUDA_LAUNCHED(what);
  }
  if (!dgamma && !dbeta) return UT_OK;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)rows * 2 * sizeof(float), &ws);
  if (st) return st;
  ut__cuda_layernorm2d_params_rows_kernel<T>
      <<<(unsigned)rows, ut__cuda_row_threads(inner), 0, ut__cuda_stream>>>(
          (const T*)go, (const T*)x, mean, rstd, ws, c, inner);
  UT__CUDA_LAUNCHED(what);
  ut__cuda_layernorm2d_params_final_kernel<<<(unsigned)ut__cuda_cdiv(c, 256), 256, 0,
                                             ut__cuda_stream>>>(ws, dgamma, dbeta, n, c);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

int ut__cuda_ln2d_fwd(ut_dtype dt, const void* x, const float* gamma, const float* beta, void* y,
                      float* mean, float* rstd, int n, int c, ut__i64 inner, float eps) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_ln2d_fwd_t<float>(x, gamma, beta, y, mean, rstd, n, c, inner, eps,
                                        "ln2d_fwd");
    case UT_BF16:
      return ut__cuda_ln2d_fwd_t<ut__cuda_bf16>(x, gamma, beta, y, mean, rstd, n, c, inner, eps,
                                                "ln2d_fwd bf16");
  }
  return ut__cuda_no_dtype("ln2d_fwd", dt);
}

int ut__cuda_ln2d_bwd(ut_dtype dt, const void* go, const void* x, const float* gamma,
                      const float* mean, const float* rstd, void* dx, float* dgamma,
                      float* dbeta, int n, int c, ut__i64 inner) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_ln2d_bwd_t<float>(go, x, gamma, mean, rstd, dx, dgamma, dbeta, n, c, inner,
                                        "ln2d_bwd");
    case UT_BF16:
      return ut__cuda_ln2d_bwd_t<ut__cuda_bf16>(go, x, gamma, mean, rstd, dx, dgamma, dbeta, n,
                                                c, inner, "ln2d_bwd bf16");
  }
  return ut__cuda_no_dtype("ln2d_bwd", dt);
}
