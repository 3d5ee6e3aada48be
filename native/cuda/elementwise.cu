/* elementwise.cu — fill, copy, axpy, scale, relu; transpose and bias_add; global_avgpool2d;
   mse_loss and cross_entropy. The files and the naming: common.cuh. */
#include "common.cuh"

/* ============================================================================================
   Elementwise
   ============================================================================================ */

__global__ void ut__cuda_fill_kernel(float* __restrict__ x, ut__i64 n, float v) {
  UT__CUDA_GRID_STRIDE(i, n) x[i] = v;
}

static __global__ void ut__cuda_axpy_kernel(float* __restrict__ y, const float* __restrict__ x,
                                            ut__i64 n, float a) {
  UT__CUDA_GRID_STRIDE(i, n) y[i] += a * x[i];
}

static __global__ void ut__cuda_scale_kernel(float* __restrict__ x, ut__i64 n, float a) {
  UT__CUDA_GRID_STRIDE(i, n) x[i] *= a;
}

static __global__ void ut__cuda_relu_kernel(const float* __restrict__ x, float* __restrict__ y,
                                            ut__i64 n, float cap) {
  UT__CUDA_GRID_STRIDE(i, n) {
    float v = x[i];
    v = v > 0.f ? v : 0.f;
    if (cap > 0.f && v > cap) v = cap;
    y[i] = v;
  }
}

static __global__ void ut__cuda_relu_backward_kernel(const float* __restrict__ go,
                                                     const float* __restrict__ x,
                                                     float* __restrict__ gi, ut__i64 n, float cap) {
  UT__CUDA_GRID_STRIDE(i, n) {
    float v = x[i];
    bool stop = v <= 0.f || (cap > 0.f && v >= cap); /* false for NaN: passes go, like PyTorch */
    bool pass = !stop;
    gi[i] = pass ? go[i] : 0.f;
  }
}

int ut__cuda_fill(float* x, ut__i64 n, float v) {
  if (n <= 0) return UT_OK;
  ut__cuda_fill_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(x, n, v);
  UT__CUDA_LAUNCHED("fill");
  return UT_OK;
}

int ut__cuda_copy(float* dst, const float* src, ut__i64 n) {
  if (n <= 0 || dst == src) return UT_OK;
  UT__CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice,
                                 ut__cuda_stream),
                 "copy");
  return UT_OK;
}

int ut__cuda_axpy(float* y, const float* x, ut__i64 n, float alpha) {
  if (n <= 0) return UT_OK;
  ut__cuda_axpy_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(y, x, n, alpha);
  UT__CUDA_LAUNCHED("axpy");
  return UT_OK;
}

int ut__cuda_scale(float* x, ut__i64 n, float alpha) {
  if (n <= 0) return UT_OK;
  ut__cuda_scale_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(x, n, alpha);
  UT__CUDA_LAUNCHED("scale");
  return UT_OK;
}

int ut__cuda_relu_forward(const float* x, float* y, ut__i64 n, float cap) {
  if (n <= 0) return UT_OK;
  ut__cuda_relu_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(x, y, n, cap);
  UT__CUDA_LAUNCHED("relu");
  return UT_OK;
}

int ut__cuda_relu_backward(const float* go, const float* x, float* gi, ut__i64 n, float cap) {
  if (n <= 0) return UT_OK;
  ut__cuda_relu_backward_kernel<<<ut__cuda_grid_for(n, 256), 256, 0, ut__cuda_stream>>>(
      go, x, gi, n, cap);
  UT__CUDA_LAUNCHED("relu_bwd");
  return UT_OK;
}

/* ============================================================================================
   Transpose and bias
   ============================================================================================ */

/* in: [outer, d0, mid, d1, inner] -> out: [outer, d1, mid, d0, inner]; one thread per output */
static __global__ void ut__cuda_transpose_kernel(const float* __restrict__ in,
                                                 float* __restrict__ out, ut__i64 total, int d0,
                                                 int mid, int d1, ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, total) {
    ut__i64 t = i;
    ut__i64 e = t % inner; t /= inner;
    ut__i64 i0 = t % d0; t /= d0;
    ut__i64 m = t % mid; t /= mid;
    ut__i64 i1 = t % d1;
    ut__i64 o = t / d1;
    out[i] = in[(((o * d0 + i0) * mid + m) * d1 + i1) * inner + e];
  }
}

int ut__cuda_transpose(const float* in, float* out, int outer, int d0, int mid, int d1, int inner) {
  ut__i64 total = (ut__i64)outer * d0 * mid * d1 * inner;
  if (total <= 0) return UT_OK;
  ut__cuda_transpose_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      in, out, total, d0, mid, d1, inner);
  UT__CUDA_LAUNCHED("transpose");
  return UT_OK;
}

static __global__ void ut__cuda_bias_add_kernel(float* __restrict__ x,
                                                const float* __restrict__ bias, ut__i64 total,
                                                int c, ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, total) x[i] += bias[(i / inner) % c];
}

int ut__cuda_bias_add(float* x, const float* bias, int n, int c, ut__i64 inner) {
  ut__i64 total = (ut__i64)n * c * inner;
  if (total <= 0) return UT_OK;
  ut__cuda_bias_add_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      x, bias, total, c, inner);
  UT__CUDA_LAUNCHED("bias_add");
  return UT_OK;
}

/* The depthwise channel multiplier's repeat and its adjoint (see ut__dw_repeat in utensil.h):
   [n, c, inner] <-> [n, c*m, inner]; the sum adds the m copies in order, deterministic. */
static __global__ void ut__cuda_chan_repeat_kernel(const float* __restrict__ x,
                                                   float* __restrict__ y, ut__i64 total, int m,
                                                   ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, total) { /* i indexes y */
    ut__i64 row = i / inner;
    y[i] = __ldg(x + (row / m) * inner + (i - row * inner));
  }
}
static __global__ void ut__cuda_chan_group_sum_kernel(const float* __restrict__ x,
                                                      float* __restrict__ y, ut__i64 total, int m,
                                                      ut__i64 inner) {
  UT__CUDA_GRID_STRIDE(i, total) { /* i indexes y */
    ut__i64 row = i / inner;
    const float* p = x + row * m * inner + (i - row * inner);
    float s = p[0];
    for (int k = 1; k < m; k++) s += p[k * inner];
    y[i] = s;
  }
}
int ut__cuda_chan_repeat(const float* x, float* y, int n, int c, int m, ut__i64 inner) {
  ut__i64 total = (ut__i64)n * c * m * inner;
  if (total <= 0) return UT_OK;
  ut__cuda_chan_repeat_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      x, y, total, m, inner);
  UT__CUDA_LAUNCHED("chan_repeat");
  return UT_OK;
}
int ut__cuda_chan_group_sum(const float* x, float* y, int n, int c, int m, ut__i64 inner) {
  ut__i64 total = (ut__i64)n * c * inner;
  if (total <= 0) return UT_OK;
  ut__cuda_chan_group_sum_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      x, y, total, m, inner);
  UT__CUDA_LAUNCHED("chan_group_sum");
  return UT_OK;
}

/* ============================================================================================
   Pooling: global_avgpool2d (a mean over each row of [n*c, h*w])
   ============================================================================================ */

/* x: [rows, cols] -> y[r] = mean of row r; one block per row */
static __global__ void ut__cuda_global_avgpool2d_kernel(const float* __restrict__ x,
                                                        float* __restrict__ y, ut__i64 cols) {
  __shared__ float sh[32];
  const float* row = x + (ut__i64)blockIdx.x * cols;
  float acc[1] = {0.f};
  for (ut__i64 i = threadIdx.x; i < cols; i += blockDim.x) acc[0] += row[i];
  ut__cuda_block_sum<1>(acc, sh);
  if (threadIdx.x == 0) y[blockIdx.x] = acc[0] / (float)cols;
}

int ut__cuda_global_avgpool2d_forward(const float* x, float* y, int rows, ut__i64 cols) {
  if (rows <= 0) return UT_OK;
  if (cols <= 0) return ut__cuda_fill(y, rows, 0.f);
  ut__cuda_global_avgpool2d_kernel
      <<<(unsigned)rows, ut__cuda_row_threads(cols), 0, ut__cuda_stream>>>(
      x, y, cols);
  UT__CUDA_LAUNCHED("row_mean");
  return UT_OK;
}

static __global__ void ut__cuda_global_avgpool2d_backward_kernel(const float* __restrict__ go,
                                                                 float* __restrict__ dx,
                                                                 ut__i64 total, ut__i64 cols) {
  UT__CUDA_GRID_STRIDE(i, total) dx[i] = (float)((double)go[i / cols] / (double)cols);
}

int ut__cuda_global_avgpool2d_backward(const float* go, float* dx, int rows, ut__i64 cols) {
  ut__i64 total = (ut__i64)rows * cols;
  if (total <= 0) return UT_OK;
  ut__cuda_global_avgpool2d_backward_kernel
      <<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      go, dx, total, cols);
  UT__CUDA_LAUNCHED("row_mean_bwd");
  return UT_OK;
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

int ut__cuda_mse_loss_forward(const float* p, const float* t, float* out, ut__i64 n) {
  if (n <= 0) return ut__cuda_fill(out, 1, 0.f);
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

int ut__cuda_mse_loss_backward(const float* p, const float* t, float* g, ut__i64 n) {
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

/* one block per row: loss[r] = logsumexp(row) - row[label] */
static __global__ void ut__cuda_cross_entropy_rows_kernel(const float* __restrict__ logits,
                                                          const float* __restrict__ labels,
                                                          float* __restrict__ loss, int k) {
  __shared__ float sh[32];
  const ut__i64 r = blockIdx.x;
  const float* x = logits + r * k;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < k; i += blockDim.x) mx = fmaxf(mx, x[i]);
  mx = ut__cuda_block_max(mx, sh);
  float a[1] = {0.f};
  for (int i = threadIdx.x; i < k; i += blockDim.x) a[0] += expf(x[i] - mx);
  ut__cuda_block_sum<1>(a, sh);
  if (threadIdx.x == 0) {
    int lab = ut__cuda_cross_entropy_label(labels[r], k);
    loss[r] = lab < 0 ? NAN : logf(a[0]) + mx - x[lab];
  }
}

int ut__cuda_cross_entropy_forward(const float* logits, const float* labels, float* out, int n,
                                   int k) {
  if (n <= 0 || k <= 0) return ut__cuda_fill(out, 1, n > 0 ? NAN : 0.f);
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)n * sizeof(float), &ws);
  if (st) return st;
  ut__cuda_cross_entropy_rows_kernel<<<(unsigned)n, ut__cuda_row_threads(k), 0, ut__cuda_stream>>>(
      logits, labels, ws, k);
  UT__CUDA_LAUNCHED("ce_fwd");
  ut__cuda_loss_sum_final_kernel<<<1, 256, 0, ut__cuda_stream>>>(ws, n, out, 1.0 / (double)n);
  UT__CUDA_LAUNCHED("ce_fwd final");
  return UT_OK;
}

static __global__ void ut__cuda_cross_entropy_backward_kernel(const float* __restrict__ logits,
                                                              const float* __restrict__ labels,
                                                              float* __restrict__ g, int k,
                                                              float inv_n) {
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
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    float v = expf(x[i] - mx) * inv - (i == lab ? 1.f : 0.f);
    gr[i] = lab < 0 ? NAN : v * inv_n;
  }
}

int ut__cuda_cross_entropy_backward(const float* logits, const float* labels, float* g, int n,
                                    int k) {
  if (n <= 0 || k <= 0) return UT_OK;
  ut__cuda_cross_entropy_backward_kernel
      <<<(unsigned)n, ut__cuda_row_threads(k), 0, ut__cuda_stream>>>(
      logits, labels, g, k, 1.f / (float)n);
  UT__CUDA_LAUNCHED("ce_bwd");
  return UT_OK;
}
