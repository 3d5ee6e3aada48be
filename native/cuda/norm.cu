/* norm.cu — per-channel reductions (channel_sum, the bias gradient and batchnorm2d's backward
   share one kernel; batchnorm2d's statistics have their own one-pass kernel), batchnorm2d and
   layernorm. The files and the naming:
   common.cuh.

   bf16 activations: channel_sum and batchnorm2d's kernels are templates over the activation
   element type T (float or ut__cuda_bf16, common.cuh), instantiated for both; each table
   function switches on its ut_dtype to one ut__cuda_<slot>_impl<T>. x, y, go and dx are T;
   statistics, sums, parameters and their gradients are float32 in both. The arithmetic, the
   element-to-thread walk and the workspace are the same for both types, so a bf16 call gives
   bit for bit what the float32 call gives on the same values widened to float (up to the
   rounding of the bf16 outputs). What differs is the width of the loads: see ut__cuda_vec and
   ut__cuda_reduce_width. */
#include "common.cuh"

/* ============================================================================================
   Per-channel reductions
   ============================================================================================ */

/* ---- per-channel reductions over x: [n, c, inner] ----
   Stage 1: c * chunks blocks; block j * chunks + chunk reduces elements [e0, e1) of channel j's
   n*inner elements (element e is x[(e / inner) * c + j][e % inner]) into NV partial sums at
   ws[(j * chunks + chunk) * NV + v]. Stage 2 sums the chunks of each channel in order. */
enum { UT__CUDA_CHANNEL_SUM = 0, UT__CUDA_CHANNEL_BATCHNORM2D_BWD = 1 };

/* ut__cuda_bn_z and ut__cuda_bn_relu, the apply's values: common.cuh (the depthwise kernels
   normalize their loads with them too) */
static __device__ __forceinline__ float ut__cuda_bn_relu_grad(float g, float z, float act) {
  bool stop = z <= 0.f || (act > 0.f && z >= act); /* false for NaN: passes g, like PyTorch */
  return stop ? 0.f : g;
}

/* The fused activation as the elementwise kernels take it. The kernels are templates over
   GEN: false for NONE, RELU and RELU6, the kernels these have always had (cap: -1 none, 0
   relu, 6 relu6, compared per element); true for the kinds from SILU on, through the formulas
   the CPU backend and activation.cu share (ut__act_value, ut__act_grad), switching on kind
   once per group of W values (the same kind for the whole grid: no divergence), each case one
   formula unrolled over the group. Kind is not a template argument: that would be nine times
   the instantiations of these kernels, for a branch per group. */
struct ut__cuda_bn_act {
  float cap;
  int kind;
};
static inline ut__cuda_bn_act ut__cuda_bn_act_of(int act) {
  ut__cuda_bn_act a;
  a.cap = act == UT_ACT_RELU6 ? 6.f : act == UT_ACT_RELU ? 0.f : -1.f;
  a.kind = act;
  return a;
}
static inline bool ut__cuda_bn_gen(ut__cuda_bn_act a) { return a.kind >= UT_ACT_SILU; }
/* whether backward needs z (the pre-activation) to weigh go */
template <bool GEN>
static __device__ __forceinline__ bool ut__cuda_bn_act_on(ut__cuda_bn_act a) {
  return GEN || a.cap >= 0.f;
}
/* GEN: z[u] = f(z[u]) and g[u] = g[u] f'(z[u]) over a group, A a constant */
template <int A, int W>
static __device__ __forceinline__ void ut__cuda_bn_values_as(float* z) {
#pragma unroll
  for (int u = 0; u < W; ++u) z[u] = ut__act_value(A, z[u]);
}
template <int A, int W>
static __device__ __forceinline__ void ut__cuda_bn_grads_as(float* g, const float* z) {
#pragma unroll
  for (int u = 0; u < W; ++u) g[u] = ut__act_grad(A, g[u], z[u]);
}
template <int W>
static __device__ __forceinline__ void ut__cuda_bn_gen_values(float* z, int kind) {
  switch (kind) {
    case UT_ACT_SILU: ut__cuda_bn_values_as<UT_ACT_SILU, W>(z); break;
    case UT_ACT_HARDSWISH: ut__cuda_bn_values_as<UT_ACT_HARDSWISH, W>(z); break;
    case UT_ACT_HARDSIGMOID: ut__cuda_bn_values_as<UT_ACT_HARDSIGMOID, W>(z); break;
    case UT_ACT_SIGMOID: ut__cuda_bn_values_as<UT_ACT_SIGMOID, W>(z); break;
    case UT_ACT_GELU: ut__cuda_bn_values_as<UT_ACT_GELU, W>(z); break;
    case UT_ACT_GELU_TANH: ut__cuda_bn_values_as<UT_ACT_GELU_TANH, W>(z); break;
  }
}
template <int W>
static __device__ __forceinline__ void ut__cuda_bn_gen_grads(float* g, const float* z,
                                                             int kind) {
  switch (kind) {
    case UT_ACT_SILU: ut__cuda_bn_grads_as<UT_ACT_SILU, W>(g, z); break;
    case UT_ACT_HARDSWISH: ut__cuda_bn_grads_as<UT_ACT_HARDSWISH, W>(g, z); break;
    case UT_ACT_HARDSIGMOID: ut__cuda_bn_grads_as<UT_ACT_HARDSIGMOID, W>(g, z); break;
    case UT_ACT_SIGMOID: ut__cuda_bn_grads_as<UT_ACT_SIGMOID, W>(g, z); break;
    case UT_ACT_GELU: ut__cuda_bn_grads_as<UT_ACT_GELU, W>(g, z); break;
    case UT_ACT_GELU_TANH: ut__cuda_bn_grads_as<UT_ACT_GELU_TANH, W>(g, z); break;
  }
}

/* The reductions' walk: channel j's m = n * inner elements in groups of W consecutive
   elements of one row, each group one vector load (ut__cuda_vec). W = 8 where rows are a
   multiple of 8 long, 4 where a multiple of 4, else 1, and the same W for float32 and bf16 (a
   float32 group of 8 is two float4), so both types visit and add the elements in the same
   order. Wide loads matter twice over here: a load of one bf16 moves 64 bytes per warp, and
   the walk's 64-bit index arithmetic, paid per group, was paid per element. */
template <typename T>
static inline int ut__cuda_reduce_width(ut__i64 inner, const void* a, const void* b) {
  const uintptr_t any = (uintptr_t)a | (uintptr_t)b;
  if (inner % 8 == 0 && any % 16 == 0) return 8;
  if (inner % 4 == 0 && any % (4 * sizeof(T)) == 0) return 4;
  return 1;
}
/* Groups per trip of a thread: 32 bytes of each tensor (at least one group), loaded during
   the trip before, so that much stays in flight while the thread adds. A trip only batches
   the thread's groups, which it visits in the same order whatever the trip, so float32 and
   bf16 (different trips) still add the same values in the same order. */
template <int W, typename T>
static __host__ __device__ constexpr int ut__cuda_trip() {
  return W * (int)sizeof(T) >= 32 ? 1 : 32 / (W * (int)sizeof(T));
}

/* The chunks of a reduction over [n, c, inner] walked W elements at a time: as
   ut__cuda_channel_chunks, with every chunk a whole number of groups */
static inline int ut__cuda_reduce_chunks(int c, ut__i64 m, int w, ut__i64* chunk) {
  ut__cuda_channel_chunks(c, m, chunk);
  *chunk = ut__cuda_cdiv(*chunk, (ut__i64)w) * w;
  return (int)ut__cuda_cdiv(m, *chunk);
}

/* Where a thread's groups lie: group q of channel j (q < m / W) starts at element
   ((q / rg) * c + j) * inner + (q % rg) * W, rg = inner / W groups per row. The thread's next
   group is bd groups on: (row, column) advance by (bd / rg, bd % rg) with one carry. */
struct ut__cuda_walk {
  ut__i64 i, k, si, sk, rg;
  __device__ __forceinline__ ut__cuda_walk(ut__i64 q, ut__i64 bd, ut__i64 rg_)
      : i(q / rg_), k(q % rg_), si(bd / rg_), sk(bd % rg_), rg(rg_) {}
  __device__ __forceinline__ ut__i64 at(int c, int j, ut__i64 inner, int w) const {
    return (i * c + j) * inner + k * w;
  }
  __device__ __forceinline__ void next() {
    i += si;
    k += sk;
    if (k >= rg) { k -= rg; ++i; }
  }
};

/* Where a per-channel reduction's totals go, written by the last block of each channel
   (ut__cuda_last_block) from the chunks' partials added in order in double:
     UT__CUDA_CHANNEL_SUM              out[j] = beta * out[j] + sum (beta 0: out not read)
     UT__CUDA_CHANNEL_BATCHNORM2D_BWD  sums[2j] = sum go, sums[2j+1] = sum go*xhat, dbeta[j] and
                                       dgamma[j] += them (when not NULL); sums[2c] = count when
                                       count > 0 (bn_bwd_sums: the count travels along) */
struct ut__cuda_channel_out {
  unsigned* counters;
  float* out;
  float beta;
  float* sums;
  float* dgamma;
  float* dbeta;
  float count;
};

template <int KIND>
static __device__ void ut__cuda_channel_final(const float* ws, const ut__cuda_channel_out& o,
                                              int j, int c, int chunks) {
  constexpr int NV = KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD ? 2 : 1;
  double s[NV];
#pragma unroll
  for (int v = 0; v < NV; ++v) s[v] = 0.0;
  for (int q = 0; q < chunks; ++q) {
#pragma unroll
    for (int v = 0; v < NV; ++v) s[v] += (double)__ldcg(ws + ((ut__i64)j * chunks + q) * NV + v);
  }
  if (KIND == UT__CUDA_CHANNEL_SUM) {
    float r = (float)s[0];
    o.out[j] = o.beta != 0.f ? o.beta * o.out[j] + r : r;
  } else {
    if (j == 0 && o.count > 0.f) o.sums[2 * c] = o.count;
    o.sums[2 * j + 0] = (float)s[0];
    o.sums[2 * j + 1] = (float)s[NV - 1];
    if (o.dgamma) o.dgamma[j] += (float)s[NV - 1];
    if (o.dbeta) o.dbeta[j] += (float)s[0];
  }
}

template <int KIND, int W, typename T, bool GEN>
static __global__ void __launch_bounds__(256)
    ut__cuda_channel_partial_kernel(const T* __restrict__ x, const T* __restrict__ go,
                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                    const float* __restrict__ gamma,
                                    const float* __restrict__ beta, ut__cuda_bn_act act, int c,
                                    ut__i64 inner, ut__i64 m, ut__i64 chunk, int chunks,
                                    float* __restrict__ ws, ut__cuda_channel_out o) {
  constexpr int NV = KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD ? 2 : 1;
  constexpr int R = ut__cuda_trip<W, T>();
  __shared__ float sh[32 * NV];
  const int j = blockIdx.x / chunks;
  const ut__i64 g0 = (ut__i64)(blockIdx.x % chunks) * (chunk / W);
  const ut__i64 g1 = g0 + chunk / W < m / W ? g0 + chunk / W : m / W;
  const float mu = (KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) ? mean[j] : 0.f;
  const float rs = (KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) ? rstd[j] : 0.f;
  /* the activation's derivative at z, z recomputed as the apply kernel computes it: relu's
     mask per element (masked), GEN's per group */
  const bool on = KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD && ut__cuda_bn_act_on<GEN>(act);
  const bool masked = on && !GEN;
  const float sc = on ? rs * (gamma ? gamma[j] : 1.f) : 0.f;
  const float bt = on && beta ? beta[j] : 0.f;
  const ut__i64 bd = blockDim.x;
  float acc[NV];
#pragma unroll
  for (int v = 0; v < NV; ++v) acc[v] = 0.f;

  /* a trip's groups are loaded during the trip before (ut__cuda_vec's fetch/unpack): the
     loads stay in flight while the thread adds, with the same groups in the same order. A slot
     past the thread's last group is unpacked but never added. */
  typedef ut__cuda_vec<W, T> V;
  typename V::raw xr[R], gr[R];
  ut__i64 q = g0 + threadIdx.x;
  ut__cuda_walk walk(q, bd, inner / W);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (q + r * bd < g1) {
      const ut__i64 at = walk.at(c, j, inner, W);
      xr[r] = V::fetch(x + at);
      if (KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) gr[r] = V::fetch(go + at);
    }
    walk.next();
  }
  for (; q < g1; q += R * bd) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xv[W], gv[W];
      V::unpack(xr[r], xv);
      if (KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) V::unpack(gr[r], gv);
      if (q + (R + r) * bd < g1) { /* the next trip's group r */
        const ut__i64 at = walk.at(c, j, inner, W);
        xr[r] = V::fetch(x + at);
        if (KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) gr[r] = V::fetch(go + at);
      }
      walk.next();
      if (q + r * bd >= g1) continue;
      if (GEN && KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) {
        float z[W];
#pragma unroll
        for (int u = 0; u < W; ++u) z[u] = ut__cuda_bn_z(xv[u], mu, sc, bt);
        ut__cuda_bn_gen_grads<W>(gv, z, act.kind);
      }
#pragma unroll
      for (int u = 0; u < W; ++u) {
        if (KIND == UT__CUDA_CHANNEL_SUM) {
          acc[0] += xv[u];
        } else {
          float g = masked ? ut__cuda_bn_relu_grad(gv[u], ut__cuda_bn_z(xv[u], mu, sc, bt),
                                                   act.cap)
                           : gv[u];
          acc[0] += g;
          acc[NV - 1] += g * ((xv[u] - mu) * rs);
        }
      }
    }
  }
  ut__cuda_block_sum<NV>(acc, sh);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int v = 0; v < NV; ++v) ws[(ut__i64)blockIdx.x * NV + v] = acc[v];
  }
  if (ut__cuda_last_block(o.counters, j, (unsigned)chunks) && threadIdx.x == 0)
    ut__cuda_channel_final<KIND>(ws, o, j, c, chunks);
}

/* chunks and chunk from ut__cuda_reduce_chunks with the same w */
template <int KIND, typename T>
static int ut__cuda_channel_partial_launch(const T* x, const T* go, const float* mean,
                                           const float* rstd, int n, int c, ut__i64 inner,
                                           float* ws, int chunks, ut__i64 chunk, int w,
                                           ut__cuda_channel_out o, const float* gamma = NULL,
                                           const float* beta = NULL,
                                           ut__cuda_bn_act act = ut__cuda_bn_act_of(UT_ACT_NONE)) {
  int st = ut__cuda_counters_acquire(c, &o.counters);
  if (st) return st;
  const unsigned blocks = (unsigned)((ut__i64)c * chunks);
  const ut__i64 m = (ut__i64)n * inner;
  /* GEN only where an activation from SILU on weighs go (channel_sum has none) */
  if constexpr (KIND == UT__CUDA_CHANNEL_BATCHNORM2D_BWD) {
    if (ut__cuda_bn_gen(act)) {
      if (w == 8)
        ut__cuda_channel_partial_kernel<KIND, 8, T, true><<<blocks, 256, 0, ut__cuda_stream>>>(
            x, go, mean, rstd, gamma, beta, act, c, inner, m, chunk, chunks, ws, o);
      else if (w == 4)
        ut__cuda_channel_partial_kernel<KIND, 4, T, true><<<blocks, 256, 0, ut__cuda_stream>>>(
            x, go, mean, rstd, gamma, beta, act, c, inner, m, chunk, chunks, ws, o);
      else
        ut__cuda_channel_partial_kernel<KIND, 1, T, true><<<blocks, 256, 0, ut__cuda_stream>>>(
            x, go, mean, rstd, gamma, beta, act, c, inner, m, chunk, chunks, ws, o);
      UT__CUDA_LAUNCHED("channel reduction");
      return UT_OK;
    }
  }
  if (w == 8)
    ut__cuda_channel_partial_kernel<KIND, 8, T, false><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, go, mean, rstd, gamma, beta, act, c, inner, m, chunk, chunks, ws, o);
  else if (w == 4)
    ut__cuda_channel_partial_kernel<KIND, 4, T, false><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, go, mean, rstd, gamma, beta, act, c, inner, m, chunk, chunks, ws, o);
  else
    ut__cuda_channel_partial_kernel<KIND, 1, T, false><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, go, mean, rstd, gamma, beta, act, c, inner, m, chunk, chunks, ws, o);
  UT__CUDA_LAUNCHED("channel reduction");
  return UT_OK;
}

template <typename T>
static int ut__cuda_channel_sum_impl(const T* x, float* out, int n, int c, ut__i64 inner,
                                     float beta) {
  if (c <= 0) return UT_OK;
  ut__i64 m = (ut__i64)n * inner;
  if (m <= 0) {
    if (beta == 0.f) return ut__cuda_fill(UT_F32, out, c, 0.f);
    return UT_OK;
  }
  ut__i64 chunk;
  const int w = ut__cuda_reduce_width<T>(inner, x, NULL);
  int chunks = ut__cuda_reduce_chunks(c, m, w, &chunk);
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)c * chunks * sizeof(float), &ws);
  if (st) return st;
  ut__cuda_channel_out o = {};
  o.out = out;
  o.beta = beta;
  return ut__cuda_channel_partial_launch<UT__CUDA_CHANNEL_SUM, T>(x, NULL, NULL, NULL, n, c, inner,
                                                                 ws, chunks, chunk, w, o);
}

int ut__cuda_channel_sum(ut_dtype dt, const void* x, float* out, int n, int c, ut__i64 inner,
                         float beta) {
  switch (dt) {
    case UT_F32: return ut__cuda_channel_sum_impl<float>((const float*)x, out, n, c, inner, beta);
    case UT_BF16:
      return ut__cuda_channel_sum_impl<ut__cuda_bf16>((const ut__cuda_bf16*)x, out, n, c, inner,
                                                      beta);
  }
  return ut__cuda_no_dtype("channel_sum", dt);
}

/* ============================================================================================
   Layer norm (one block per row) and batch norm (per-channel reductions above)
   ============================================================================================ */

static __global__ void ut__cuda_layernorm_forward_kernel(
    const float* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ beta,
    float* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, int dim, float eps) {
  __shared__ float sh[32];
  const ut__i64 r = blockIdx.x;
  const float* xr = x + r * dim;
  float* yr = y + r * dim;
  float a[1] = {0.f};
  for (int i = threadIdx.x; i < dim; i += blockDim.x) a[0] += xr[i];
  ut__cuda_block_sum<1>(a, sh);
  const float mu = a[0] / (float)dim;
  a[0] = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float d = xr[i] - mu;
    a[0] += d * d;
  }
  ut__cuda_block_sum<1>(a, sh);
  const float rs = 1.0f / sqrtf(a[0] / (float)dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = (xr[i] - mu) * rs;
    if (gamma) v *= gamma[i];
    if (beta) v += beta[i];
    yr[i] = v;
  }
  if (threadIdx.x == 0) {
    if (mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}

int ut__cuda_layernorm_fwd(const float* x, const float* gamma, const float* beta, float* y,
                           float* mean, float* rstd, int rows, int dim, float eps) {
  if (rows <= 0 || dim <= 0) return UT_OK;
  ut__cuda_layernorm_forward_kernel
      <<<(unsigned)rows, ut__cuda_row_threads(dim), 0, ut__cuda_stream>>>(
      x, gamma, beta, y, mean, rstd, dim, eps);
  UT__CUDA_LAUNCHED("layernorm_fwd");
  return UT_OK;
}

/* dx = rstd (g - mean(g) - xhat mean(g xhat)), g = go * gamma */
static __global__ void ut__cuda_layernorm_dx_kernel(const float* __restrict__ go,
                                                    const float* __restrict__ x,
                                                    const float* __restrict__ gamma,
                                                    const float* __restrict__ mean,
                                                    const float* __restrict__ rstd,
                                                    float* __restrict__ dx, int dim) {
  __shared__ float sh[64];
  const ut__i64 r = blockIdx.x;
  const float* gr = go + r * dim;
  const float* xr = x + r * dim;
  const float mu = mean[r], rs = rstd[r];
  float a[2] = {0.f, 0.f};
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float gv = gr[i] * (gamma ? gamma[i] : 1.f);
    a[0] += gv;
    a[1] += gv * ((xr[i] - mu) * rs);
  }
  ut__cuda_block_sum<2>(a, sh);
  const float m1 = a[0] / (float)dim, m2 = a[1] / (float)dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float gv = gr[i] * (gamma ? gamma[i] : 1.f);
    float xh = (xr[i] - mu) * rs;
    dx[r * dim + i] = rs * (gv - m1 - xh * m2);
  }
}

/* grid (ceil(dim/256), chunks): column sums of go*xhat and go over a chunk of rows */
static __global__ void ut__cuda_layernorm_cols_kernel(const float* __restrict__ go,
                                                      const float* __restrict__ x,
                                                      const float* __restrict__ mean,
                                                      const float* __restrict__ rstd, int rows,
                                                      int dim, int rchunk, float* __restrict__ ws) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const int r0 = blockIdx.y * rchunk;
  const int r1 = min(rows, r0 + rchunk);
  float sg = 0.f, sb = 0.f;
  for (int r = r0; r < r1; ++r) {
    float gv = go[(ut__i64)r * dim + j];
    sg += gv * ((x[(ut__i64)r * dim + j] - mean[r]) * rstd[r]);
    sb += gv;
  }
  ws[((ut__i64)blockIdx.y * dim + j) * 2 + 0] = sg;
  ws[((ut__i64)blockIdx.y * dim + j) * 2 + 1] = sb;
}

static __global__ void ut__cuda_layernorm_cols_final_kernel(const float* __restrict__ ws,
                                                            float* __restrict__ dgamma,
                                                            float* __restrict__ dbeta, int dim,
                                                            int chunks) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  double sg = 0.0, sb = 0.0;
  for (int q = 0; q < chunks; ++q) {
    sg += ws[((ut__i64)q * dim + j) * 2 + 0];
    sb += ws[((ut__i64)q * dim + j) * 2 + 1];
  }
  if (dgamma) dgamma[j] += (float)sg;
  if (dbeta) dbeta[j] += (float)sb;
}

int ut__cuda_layernorm_bwd(const float* go, const float* x, const float* gamma,
                           const float* mean, const float* rstd, float* dx, float* dgamma,
                           float* dbeta, int rows, int dim) {
  if (rows <= 0 || dim <= 0) return UT_OK;
  if (dx) {
    ut__cuda_layernorm_dx_kernel<<<(unsigned)rows, ut__cuda_row_threads(dim), 0, ut__cuda_stream>>>(
        go, x, gamma, mean, rstd, dx, dim);
    UT__CUDA_LAUNCHED("layernorm_bwd dx");
  }
  if (!dgamma && !dbeta) return UT_OK;
  const int cblocks = (int)ut__cuda_cdiv(dim, 256);
  ut__i64 chunks = ut__cuda_cdiv((ut__i64)ut__cuda_sms * 4, cblocks);
  if (chunks > rows) chunks = rows;
  if (chunks > 1024) chunks = 1024;
  if (chunks < 1) chunks = 1;
  const int rchunk = (int)ut__cuda_cdiv(rows, chunks);
  chunks = ut__cuda_cdiv(rows, rchunk);
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)chunks * dim * 2 * sizeof(float), &ws);
  if (st) return st;
  dim3 grid((unsigned)cblocks, (unsigned)chunks);
  ut__cuda_layernorm_cols_kernel<<<grid, 256, 0, ut__cuda_stream>>>(
      go, x, mean, rstd, rows, dim, rchunk, ws);
  UT__CUDA_LAUNCHED("layernorm_bwd columns");
  ut__cuda_layernorm_cols_final_kernel<<<(unsigned)cblocks, 256, 0, ut__cuda_stream>>>(
      ws, dgamma, dbeta, dim, (int)chunks);
  UT__CUDA_LAUNCHED("layernorm_bwd final");
  return UT_OK;
}

/* ---- batchnorm2d's statistics in one read of x ----
   Each thread keeps a running (count, mean, M2) over the elements it visits (the same walk as
   ut__cuda_channel_partial_kernel): each group's own mean and M2, merged into it with Chan's
   formula (Welford's update when W = 1); threads, warps and then the chunks of a channel are
   merged with Chan's formula in a fixed order (deterministic), the last stage in double. A
   two-pass mean-then-deviation costs a second read of every BatchNorm input per step; Welford
   keeps its accuracy (no sum of squares minus square of sum). Non-finite input gives what the
   sums would: a mean of +-inf (NaN when both infinities or a NaN meet) and a NaN variance. */
struct ut__cuda_moments {
  float n, mean, m2;
};
static __device__ __forceinline__ ut__cuda_moments ut__cuda_moments_merge(ut__cuda_moments a,
                                                                         ut__cuda_moments b) {
  float n = a.n + b.n;
  if (n == 0.f) return a;
  ut__cuda_moments r;
  r.n = n;
  if (!isfinite(a.mean) || !isfinite(b.mean)) { /* as a sum would: inf stays, inf - inf is NaN */
    r.mean = a.mean + b.mean;
    r.m2 = NAN;
    return r;
  }
  float d = b.mean - a.mean, f = b.n / n;
  r.mean = a.mean + d * f;
  r.m2 = a.m2 + b.m2 + d * d * a.n * f;
  return r;
}
static __device__ __forceinline__ ut__cuda_moments ut__cuda_moments_shfl(ut__cuda_moments v,
                                                                        int o) {
  ut__cuda_moments r;
  r.n = __shfl_down_sync(0xffffffffu, v.n, o);
  r.mean = __shfl_down_sync(0xffffffffu, v.mean, o);
  r.m2 = __shfl_down_sync(0xffffffffu, v.m2, o);
  return r;
}

/* mean[j], var[j] (biased) from channel j's chunks, merged in order in double (by the last
   block of the channel's moments kernel) */
static __device__ void ut__cuda_moments_final(const float* ws, float* mean, float* var, int j,
                                              int chunks, ut__i64 chunk, ut__i64 m) {
  double n = 0.0, mu = 0.0, m2 = 0.0;
  for (int q = 0; q < chunks; ++q) {
    ut__i64 e0 = (ut__i64)q * chunk, e1 = e0 + chunk < m ? e0 + chunk : m;
    double nb = (double)(e1 - e0);
    if (nb <= 0.0) continue;
    double mb = __ldcg(ws + ((ut__i64)j * chunks + q) * 2 + 0);
    double m2b = __ldcg(ws + ((ut__i64)j * chunks + q) * 2 + 1);
    if (!isfinite(mu) || !isfinite(mb)) { /* as in ut__cuda_moments_merge */
      mu += mb;
      m2 = NAN;
      n += nb;
      continue;
    }
    double nn = n + nb, d = mb - mu;
    mu += d * (nb / nn);
    m2 += m2b + d * d * n * (nb / nn);
    n = nn;
  }
  mean[j] = (float)mu;
  var[j] = (float)(n > 0.0 ? m2 / n : 0.0);
}

template <int W, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_batchnorm2d_moments_kernel(const T* __restrict__ x, int c, ut__i64 inner,
                                        ut__i64 m, ut__i64 chunk, int chunks,
                                        float* __restrict__ ws, unsigned* __restrict__ counters,
                                        float* __restrict__ mean, float* __restrict__ var) {
  constexpr int R = ut__cuda_trip<W, T>();
  __shared__ ut__cuda_moments sh[32];
  const int j = blockIdx.x / chunks;
  const ut__i64 g0 = (ut__i64)(blockIdx.x % chunks) * (chunk / W);
  const ut__i64 g1 = g0 + chunk / W < m / W ? g0 + chunk / W : m / W;
  const ut__i64 bd = blockDim.x;
  ut__cuda_moments acc = {0.f, 0.f, 0.f};
  /* loads a trip ahead, as ut__cuda_channel_partial_kernel's */
  typedef ut__cuda_vec<W, T> V;
  typename V::raw xr[R];
  ut__i64 q = g0 + threadIdx.x;
  ut__cuda_walk walk(q, bd, inner / W);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (q + r * bd < g1) xr[r] = V::fetch(x + walk.at(c, j, inner, W));
    walk.next();
  }
  for (; q < g1; q += R * bd) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xv[W];
      V::unpack(xr[r], xv);
      if (q + (R + r) * bd < g1) xr[r] = V::fetch(x + walk.at(c, j, inner, W));
      walk.next();
      if (q + r * bd >= g1) continue;
      /* the group's own mean and squared deviations, then one merge (one division per group,
         where a per-element Welford step divides per element) */
      float s = 0.f; /* scaled first (exactly: W is a power of 2), so no sum overflows */
#pragma unroll
      for (int u = 0; u < W; ++u) s += xv[u] * (1.f / W);
      ut__cuda_moments grp = {(float)W, s, 0.f};
#pragma unroll
      for (int u = 0; u < W; ++u) {
        float d = xv[u] - grp.mean;
        grp.m2 += d * d;
      }
      acc = ut__cuda_moments_merge(acc, grp);
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc = ut__cuda_moments_merge(acc, ut__cuda_moments_shfl(acc, o));
  if (lane == 0) sh[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < nw ? sh[lane] : ut__cuda_moments{0.f, 0.f, 0.f};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      acc = ut__cuda_moments_merge(acc, ut__cuda_moments_shfl(acc, o));
    if (lane == 0) {
      ws[(ut__i64)blockIdx.x * 2 + 0] = acc.mean;
      ws[(ut__i64)blockIdx.x * 2 + 1] = acc.m2;
    }
  }
  if (ut__cuda_last_block(counters, j, (unsigned)chunks) && threadIdx.x == 0)
    ut__cuda_moments_final(ws, mean, var, j, chunks, chunk, m);
}

template <typename T>
static int ut__cuda_bn_stats_impl(const T* x, float* mean, float* var, int n, int c,
                                  ut__i64 inner) {
  if (c <= 0) return UT_OK;
  ut__i64 m = (ut__i64)n * inner;
  if (m <= 0) {
    int st = ut__cuda_fill(UT_F32, mean, c, 0.f);
    return st ? st : ut__cuda_fill(UT_F32, var, c, 0.f);
  }
  ut__i64 chunk;
  const int w = ut__cuda_reduce_width<T>(inner, x, NULL);
  int chunks = ut__cuda_reduce_chunks(c, m, w, &chunk);
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)c * chunks * 2 * sizeof(float), &ws);
  if (st) return st;
  unsigned* counters;
  st = ut__cuda_counters_acquire(c, &counters);
  if (st) return st;
  const unsigned blocks = (unsigned)((ut__i64)c * chunks);
  if (w == 8)
    ut__cuda_batchnorm2d_moments_kernel<8, T><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, c, inner, m, chunk, chunks, ws, counters, mean, var);
  else if (w == 4)
    ut__cuda_batchnorm2d_moments_kernel<4, T><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, c, inner, m, chunk, chunks, ws, counters, mean, var);
  else
    ut__cuda_batchnorm2d_moments_kernel<1, T><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, c, inner, m, chunk, chunks, ws, counters, mean, var);
  UT__CUDA_LAUNCHED("bn_stats moments");
  return UT_OK;
}

int ut__cuda_bn_stats(ut_dtype dt, const void* x, float* mean, float* var, int n, int c,
                      ut__i64 inner) {
  switch (dt) {
    case UT_F32: return ut__cuda_bn_stats_impl<float>((const float*)x, mean, var, n, c, inner);
    case UT_BF16:
      return ut__cuda_bn_stats_impl<ut__cuda_bf16>((const ut__cuda_bf16*)x, mean, var, n, c,
                                                   inner);
  }
  return ut__cuda_no_dtype("bn_stats", dt);
}

static __global__ void ut__cuda_batchnorm2d_running_kernel(float* __restrict__ rm,
                                                           float* __restrict__ rv,
                                                           const float* __restrict__ mean,
                                                           const float* __restrict__ var, int c,
                                                           float momentum, float unbias) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  rm[j] = (1.f - momentum) * rm[j] + momentum * mean[j];
  rv[j] = (1.f - momentum) * rv[j] + momentum * (var[j] * unbias);
}

int ut__cuda_bn_update_running(float* running_mean, float* running_var, const float* mean,
                               const float* var, int c, float momentum, float unbias) {
  if (c <= 0) return UT_OK;
  ut__cuda_batchnorm2d_running_kernel<<<(unsigned)ut__cuda_cdiv(c, 128), 128, 0, ut__cuda_stream>>>(
      running_mean, running_var, mean, var, c, momentum, unbias);
  UT__CUDA_LAUNCHED("bn_update_running");
  return UT_OK;
}

static __global__ void ut__cuda_batchnorm2d_rstd_kernel(const float* __restrict__ var,
                                                        float* __restrict__ rstd, int c,
                                                        float eps) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < c) rstd[j] = ut__cuda_bn_rstd(var[j], eps);
}


template <int W, typename I, typename T, bool GEN>
static __global__ void ut__cuda_batchnorm2d_apply_kernel(
    const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ mean,
    const float* __restrict__ var, float* __restrict__ rstd, const float* __restrict__ gamma,
    const float* __restrict__ beta, I groups, I row_groups, int c, float eps,
    ut__cuda_bn_act act) {
  for (I v = (I)blockIdx.x * blockDim.x + threadIdx.x; v < groups; v += (I)gridDim.x * blockDim.x) {
    const I row = v / row_groups;
    const int j = (int)(row % (I)c);
    const float rs = ut__cuda_bn_rstd(var[j], eps);
    /* rstd for backward, once per channel: by the first group of the first image's row */
    if (rstd && row < (I)c && v == row * row_groups) rstd[j] = rs;
    const float sc = rs * (gamma ? gamma[j] : 1.f), m = mean[j], bt = beta ? beta[j] : 0.f;
    float e[W];
    ut__cuda_vec<W, T>::load(x + (ut__i64)v * W, e);
#pragma unroll
    for (int u = 0; u < W; ++u) {
      float z = ut__cuda_bn_z(e[u], m, sc, bt); /* bf16: rounded only after act, as y */
      e[u] = GEN || act.cap < 0.f ? z : ut__cuda_bn_relu(z, act.cap);
    }
    if (GEN) ut__cuda_bn_gen_values<W>(e, act.kind);
    ut__cuda_vec<W, T>::store(y + (ut__i64)v * W, e);
  }
}

template <int W, typename T, bool GEN>
static void ut__cuda_bn_apply_launch_g(const T* x, T* y, const float* mean, const float* var,
                                       float* rstd, const float* gamma, const float* beta,
                                       ut__i64 total, ut__i64 inner, int c, float eps,
                                       ut__cuda_bn_act act) {
  const ut__i64 groups = total / W, row_groups = inner / W;
  const unsigned blocks = ut__cuda_grid_for(groups, 256);
  if (total < INT_MAX)
    ut__cuda_batchnorm2d_apply_kernel<W, unsigned, T, GEN><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, y, mean, var, rstd, gamma, beta, (unsigned)groups, (unsigned)row_groups, c, eps, act);
  else
    ut__cuda_batchnorm2d_apply_kernel<W, ut__i64, T, GEN><<<blocks, 256, 0, ut__cuda_stream>>>(
        x, y, mean, var, rstd, gamma, beta, groups, row_groups, c, eps, act);
}
template <int W, typename T>
static void ut__cuda_bn_apply_launch(const T* x, T* y, const float* mean, const float* var,
                                     float* rstd, const float* gamma, const float* beta,
                                     ut__i64 total, ut__i64 inner, int c, float eps,
                                     ut__cuda_bn_act act) {
  if (ut__cuda_bn_gen(act))
    ut__cuda_bn_apply_launch_g<W, T, true>(x, y, mean, var, rstd, gamma, beta, total, inner, c,
                                           eps, act);
  else
    ut__cuda_bn_apply_launch_g<W, T, false>(x, y, mean, var, rstd, gamma, beta, total, inner, c,
                                            eps, act);
}

template <typename T>
static int ut__cuda_bn_apply_impl(const T* x, T* y, const float* mean, const float* var,
                                  const float* gamma, const float* beta, float* rstd, int n, int c,
                                  ut__i64 inner, float eps, ut__cuda_bn_act act) {
  if (c <= 0) return UT_OK;
  ut__i64 total = (ut__i64)n * c * inner;
  if (total <= 0) { /* nothing to apply: rstd alone, for the caller's cache */
    if (rstd) {
      ut__cuda_batchnorm2d_rstd_kernel<<<(unsigned)ut__cuda_cdiv(c, 128), 128, 0,
                                         ut__cuda_stream>>>(var, rstd, c, eps);
      UT__CUDA_LAUNCHED("bn_apply rstd");
    }
    return UT_OK;
  }
  const int w = ut__cuda_vec_width<T>(inner, x, y, NULL);
  if constexpr (sizeof(T) == 2) {
    if (w == 8)
      ut__cuda_bn_apply_launch<8, T>(x, y, mean, var, rstd, gamma, beta, total, inner, c, eps, act);
    else if (w == 4)
      ut__cuda_bn_apply_launch<4, T>(x, y, mean, var, rstd, gamma, beta, total, inner, c, eps, act);
    else
      ut__cuda_bn_apply_launch<1, T>(x, y, mean, var, rstd, gamma, beta, total, inner, c, eps, act);
  } else {
    if (w == 4)
      ut__cuda_bn_apply_launch<4, T>(x, y, mean, var, rstd, gamma, beta, total, inner, c, eps, act);
    else
      ut__cuda_bn_apply_launch<1, T>(x, y, mean, var, rstd, gamma, beta, total, inner, c, eps, act);
  }
  UT__CUDA_LAUNCHED("bn_apply");
  return UT_OK;
}

/* ut_batchnorm2d_dwconv2d_forward's numbers in one launch: rstd (the apply kernel's value) and
   st = [mean; var; gamma; beta] */
static __global__ void ut__cuda_bn_fold_pack_kernel(const float* __restrict__ mean,
                                                    const float* __restrict__ var,
                                                    const float* __restrict__ gamma,
                                                    const float* __restrict__ beta,
                                                    float* __restrict__ rstd,
                                                    float* __restrict__ st, int c, float eps) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  rstd[j] = ut__cuda_bn_rstd(var[j], eps);
  st[j] = mean[j];
  st[c + j] = var[j];
  st[2 * c + j] = gamma[j];
  st[3 * c + j] = beta[j];
}

int ut__cuda_bn_fold_pack(const float* mean, const float* var, const float* gamma,
                          const float* beta, float* rstd, float* st, int c, float eps) {
  if (c <= 0) return UT_OK;
  ut__cuda_bn_fold_pack_kernel<<<(unsigned)ut__cuda_cdiv(c, 128), 128, 0, ut__cuda_stream>>>(
      mean, var, gamma, beta, rstd, st, c, eps);
  UT__CUDA_LAUNCHED("bn_fold_pack");
  return UT_OK;
}

int ut__cuda_bn_apply(ut_dtype dt, const void* x, void* y, const float* mean, const float* var,
                      const float* gamma, const float* beta, float* rstd, int n, int c,
                      ut__i64 inner, float eps, int act) {
  const ut__cuda_bn_act a = ut__cuda_bn_act_of(act);
  switch (dt) {
    case UT_F32:
      return ut__cuda_bn_apply_impl<float>((const float*)x, (float*)y, mean, var, gamma, beta,
                                           rstd, n, c, inner, eps, a);
    case UT_BF16:
      return ut__cuda_bn_apply_impl<ut__cuda_bf16>((const ut__cuda_bf16*)x, (ut__cuda_bf16*)y,
                                                   mean, var, gamma, beta, rstd, n, c, inner,
                                                   eps, a);
  }
  return ut__cuda_no_dtype("bn_apply", dt);
}

template <int W, typename I, typename T, bool GEN>
static __global__ void ut__cuda_batchnorm2d_dx_kernel(
    const T* __restrict__ go, const T* __restrict__ x, const float* __restrict__ mean,
    const float* __restrict__ rstd, const float* __restrict__ gamma,
    const float* __restrict__ beta, const float* __restrict__ sums, T* __restrict__ dx,
    I groups, I row_groups, int c, float inv_m, int training, ut__cuda_bn_act act) {
  if (training == 2) inv_m = 1.f / sums[2 * c]; /* bn_bwd_dx: the summed count */
  for (I v = (I)blockIdx.x * blockDim.x + threadIdx.x; v < groups; v += (I)gridDim.x * blockDim.x) {
    const int j = (int)((v / row_groups) % (I)c);
    const float rs = rstd[j], gm = gamma ? gamma[j] : 1.f, m = mean[j];
    const float sc = rs * gm, bt = beta ? beta[j] : 0.f; /* as the apply kernel */
    const float mg = training ? sums[2 * j] * inv_m : 0.f;
    const float mgx = training ? sums[2 * j + 1] * inv_m : 0.f;
    float g[W], xv[W];
    ut__cuda_vec<W, T>::load(go + (ut__i64)v * W, g);
    if (training || ut__cuda_bn_act_on<GEN>(act))
      ut__cuda_vec<W, T>::load(x + (ut__i64)v * W, xv);
    if (GEN) {
      float z[W];
#pragma unroll
      for (int u = 0; u < W; ++u) z[u] = ut__cuda_bn_z(xv[u], m, sc, bt);
      ut__cuda_bn_gen_grads<W>(g, z, act.kind);
    }
#pragma unroll
    for (int u = 0; u < W; ++u) {
      float gu = !GEN && act.cap >= 0.f
                     ? ut__cuda_bn_relu_grad(g[u], ut__cuda_bn_z(xv[u], m, sc, bt), act.cap)
                     : g[u];
      if (training) {
        float xh = (xv[u] - m) * rs;
        gu = gu - mg - xh * mgx;
      }
      g[u] = gm * rs * gu;
    }
    ut__cuda_vec<W, T>::store(dx + (ut__i64)v * W, g);
  }
}

/* the per-channel sums [2c] (and count at sums[2c] when count > 0) into sums */
template <typename T>
static int ut__cuda_bn_sums(const T* go, const T* x, const float* mean, const float* rstd,
                            const float* gamma, const float* beta, float* sums, float* ws,
                            float* dgamma, float* dbeta, int n, int c, ut__i64 inner, int chunks,
                            ut__i64 chunk, int w, ut__cuda_bn_act act, float count) {
  ut__cuda_channel_out o = {};
  o.sums = sums;
  o.dgamma = dgamma;
  o.dbeta = dbeta;
  o.count = count;
  return ut__cuda_channel_partial_launch<UT__CUDA_CHANNEL_BATCHNORM2D_BWD, T>(
      x, go, mean, rstd, n, c, inner, ws, chunks, chunk, w, o, gamma, beta, act);
}

template <int W, typename T, bool GEN>
static void ut__cuda_bn_dx_launch_g(const T* go, const T* x, const float* mean,
                                    const float* rstd, const float* gamma, const float* beta,
                                    const float* sums, T* dx, ut__i64 total, ut__i64 inner, int c,
                                    float inv_m, int tr, ut__cuda_bn_act act) {
  const ut__i64 groups = total / W, row_groups = inner / W;
  const unsigned blocks = ut__cuda_grid_for(groups, 256);
  if (total < INT_MAX)
    ut__cuda_batchnorm2d_dx_kernel<W, unsigned, T, GEN><<<blocks, 256, 0, ut__cuda_stream>>>(
        go, x, mean, rstd, gamma, beta, sums, dx, (unsigned)groups, (unsigned)row_groups, c,
        inv_m, tr, act);
  else
    ut__cuda_batchnorm2d_dx_kernel<W, ut__i64, T, GEN><<<blocks, 256, 0, ut__cuda_stream>>>(
        go, x, mean, rstd, gamma, beta, sums, dx, groups, row_groups, c, inv_m, tr, act);
}
template <int W, typename T>
static void ut__cuda_bn_dx_launch(const T* go, const T* x, const float* mean, const float* rstd,
                                  const float* gamma, const float* beta, const float* sums, T* dx,
                                  ut__i64 total, ut__i64 inner, int c, float inv_m, int tr,
                                  ut__cuda_bn_act act) {
  if (ut__cuda_bn_gen(act))
    ut__cuda_bn_dx_launch_g<W, T, true>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner, c,
                                        inv_m, tr, act);
  else
    ut__cuda_bn_dx_launch_g<W, T, false>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner,
                                         c, inv_m, tr, act);
}

/* dx; training: 0 eval, 1 training (count n inner), 2 training with the count at sums[2c] */
template <typename T>
static void ut__cuda_bn_dx(const T* go, const T* x, const float* mean, const float* rstd,
                           const float* gamma, const float* beta, const float* sums, T* dx,
                           int n, int c, ut__i64 inner, int tr, ut__cuda_bn_act act) {
  const ut__i64 m = (ut__i64)n * inner, total = m * c;
  const int w = ut__cuda_vec_width<T>(inner, go, x, dx);
  const float inv_m = 1.f / (float)m;
  if constexpr (sizeof(T) == 2) {
    if (w == 8)
      ut__cuda_bn_dx_launch<8, T>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner, c,
                                  inv_m, tr, act);
    else if (w == 4)
      ut__cuda_bn_dx_launch<4, T>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner, c,
                                  inv_m, tr, act);
    else
      ut__cuda_bn_dx_launch<1, T>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner, c,
                                  inv_m, tr, act);
  } else {
    if (w == 4)
      ut__cuda_bn_dx_launch<4, T>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner, c,
                                  inv_m, tr, act);
    else
      ut__cuda_bn_dx_launch<1, T>(go, x, mean, rstd, gamma, beta, sums, dx, total, inner, c,
                                  inv_m, tr, act);
  }
}

template <typename T>
static int ut__cuda_bn_bwd_impl(const T* go, const T* x, const float* mean, const float* rstd,
                                const float* gamma, const float* beta, T* dx, float* dgamma,
                                float* dbeta, int n, int c, ut__i64 inner, bool training,
                                ut__cuda_bn_act act) {
  if (c <= 0) return UT_OK;
  const ut__i64 m = (ut__i64)n * inner;
  if (m <= 0) return UT_OK;
  const bool need_sums = training || dgamma || dbeta;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws = NULL;
  float* sums = NULL;
  if (need_sums) {
    ut__i64 chunk;
    const int w = ut__cuda_reduce_width<T>(inner, go, x);
    int chunks = ut__cuda_reduce_chunks(c, m, w, &chunk);
    int st =
        ut__cuda_workspace_acquire(((size_t)c * chunks * 2 + (size_t)c * 2) * sizeof(float), &ws);
    if (st) return st;
    sums = ws + (size_t)c * chunks * 2;
    st = ut__cuda_bn_sums<T>(go, x, mean, rstd, gamma, beta, sums, ws, dgamma, dbeta, n, c, inner,
                             chunks, chunk, w, act, 0.f);
    if (st) return st;
  }
  if (dx) {
    ut__cuda_bn_dx<T>(go, x, mean, rstd, gamma, beta, sums, dx, n, c, inner, training ? 1 : 0,
                      act);
    UT__CUDA_LAUNCHED("bn_bwd dx");
  }
  return UT_OK;
}

int ut__cuda_bn_bwd(ut_dtype dt, const void* go, const void* x, const float* mean,
                    const float* rstd, const float* gamma, const float* beta, void* dx,
                    float* dgamma, float* dbeta, int n, int c, ut__i64 inner, bool training,
                    int act) {
  const ut__cuda_bn_act a = ut__cuda_bn_act_of(act);
  switch (dt) {
    case UT_F32:
      return ut__cuda_bn_bwd_impl<float>((const float*)go, (const float*)x, mean, rstd, gamma,
                                         beta, (float*)dx, dgamma, dbeta, n, c, inner, training,
                                         a);
    case UT_BF16:
      return ut__cuda_bn_bwd_impl<ut__cuda_bf16>(
          (const ut__cuda_bf16*)go, (const ut__cuda_bf16*)x, mean, rstd, gamma, beta,
          (ut__cuda_bf16*)dx, dgamma, dbeta, n, c, inner, training, a);
  }
  return ut__cuda_no_dtype("bn_bwd", dt);
}

template <typename T>
static int ut__cuda_bn_bwd_sums_impl(const T* go, const T* x, const float* mean,
                                     const float* rstd, const float* gamma, const float* beta,
                                     float* sums, float* dgamma, float* dbeta, int n, int c,
                                     ut__i64 inner, ut__cuda_bn_act act) {
  const ut__i64 m = (ut__i64)n * inner;
  if (c <= 0 || m <= 0) return UT_OK;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  ut__i64 chunk;
  const int w = ut__cuda_reduce_width<T>(inner, go, x);
  int chunks = ut__cuda_reduce_chunks(c, m, w, &chunk);
  float* ws = NULL;
  int st = ut__cuda_workspace_acquire((size_t)c * chunks * 2 * sizeof(float), &ws);
  if (st) return st;
  return ut__cuda_bn_sums<T>(go, x, mean, rstd, gamma, beta, sums, ws, dgamma, dbeta, n, c, inner,
                             chunks, chunk, w, act, (float)m);
}

int ut__cuda_bn_bwd_sums(ut_dtype dt, const void* go, const void* x, const float* mean,
                         const float* rstd, const float* gamma, const float* beta, float* sums,
                         float* dgamma, float* dbeta, int n, int c, ut__i64 inner, int act) {
  const ut__cuda_bn_act a = ut__cuda_bn_act_of(act);
  switch (dt) {
    case UT_F32:
      return ut__cuda_bn_bwd_sums_impl<float>((const float*)go, (const float*)x, mean, rstd,
                                              gamma, beta, sums, dgamma, dbeta, n, c, inner, a);
    case UT_BF16:
      return ut__cuda_bn_bwd_sums_impl<ut__cuda_bf16>(
          (const ut__cuda_bf16*)go, (const ut__cuda_bf16*)x, mean, rstd, gamma, beta, sums,
          dgamma, dbeta, n, c, inner, a);
  }
  return ut__cuda_no_dtype("bn_bwd_sums", dt);
}

template <typename T>
static int ut__cuda_bn_bwd_dx_impl(const T* go, const T* x, const float* mean, const float* rstd,
                                   const float* gamma, const float* beta, const float* sums, T* dx,
                                   int n, int c, ut__i64 inner, ut__cuda_bn_act act) {
  if (c <= 0 || (ut__i64)n * inner <= 0) return UT_OK;
  ut__cuda_bn_dx<T>(go, x, mean, rstd, gamma, beta, sums, dx, n, c, inner, 2, act);
  UT__CUDA_LAUNCHED("bn_bwd_dx");
  return UT_OK;
}

int ut__cuda_bn_bwd_dx(ut_dtype dt, const void* go, const void* x, const float* mean,
                       const float* rstd, const float* gamma, const float* beta, const float* sums,
                       void* dx, int n, int c, ut__i64 inner, int act) {
  const ut__cuda_bn_act a = ut__cuda_bn_act_of(act);
  switch (dt) {
    case UT_F32:
      return ut__cuda_bn_bwd_dx_impl<float>((const float*)go, (const float*)x, mean, rstd, gamma,
                                            beta, sums, (float*)dx, n, c, inner, a);
    case UT_BF16:
      return ut__cuda_bn_bwd_dx_impl<ut__cuda_bf16>(
          (const ut__cuda_bf16*)go, (const ut__cuda_bf16*)x, mean, rstd, gamma, beta, sums,
          (ut__cuda_bf16*)dx, n, c, inner, a);
  }
  return ut__cuda_no_dtype("bn_bwd_dx", dt);
}

/* synchronized batchnorm's statistics (the core's order: pack, sum, pack, sum, unpack) */
static __global__ void ut__cuda_bn_sync_pack_kernel(const float* __restrict__ mean,
                                                    const float* __restrict__ var,
                                                    const float* __restrict__ a,
                                                    float* __restrict__ out, int c, float count) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j == c) out[c] = count;
  if (j >= c) return;
  if (!a) {
    out[j] = count * mean[j];
  } else {
    float d = mean[j] - a[j] / a[c];
    out[j] = count * (var[j] + d * d);
  }
}

int ut__cuda_bn_sync_pack(const float* mean, const float* var, const float* a, float* out, int c,
                          float count) {
  ut__cuda_bn_sync_pack_kernel<<<(unsigned)ut__cuda_cdiv(c + 1, 128), 128, 0, ut__cuda_stream>>>(
      mean, var, a, out, c, count);
  UT__CUDA_LAUNCHED("bn_sync_pack");
  return UT_OK;
}

static __global__ void ut__cuda_bn_sync_unpack_kernel(const float* __restrict__ a,
                                                      const float* __restrict__ b,
                                                      float* __restrict__ mean,
                                                      float* __restrict__ var,
                                                      float* __restrict__ rm,
                                                      float* __restrict__ rv, int c,
                                                      float momentum) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  const float n = a[c], unbias = (float)((double)n / ((double)n - 1.0));
  const float m = a[j] / n, v = b[j] / n;
  mean[j] = m;
  var[j] = v;
  rm[j] = (1.f - momentum) * rm[j] + momentum * m;
  rv[j] = (1.f - momentum) * rv[j] + momentum * (v * unbias);
}

int ut__cuda_bn_sync_unpack(const float* a, const float* b, float* mean, float* var,
                            float* running_mean, float* running_var, int c, float momentum) {
  ut__cuda_bn_sync_unpack_kernel<<<(unsigned)ut__cuda_cdiv(c, 128), 128, 0, ut__cuda_stream>>>(
      a, b, mean, var, running_mean, running_var, c, momentum);
  UT__CUDA_LAUNCHED("bn_sync_unpack");
  return UT_OK;
}
