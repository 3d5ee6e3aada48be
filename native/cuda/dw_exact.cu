/* dw_exact.cu — dwconv2d's plain kernels (one thread per output, gather form for dx; any
   geometry, dilation included) for forward and dx, and the exact reruns after a fast kernel
   for channels whose weights are not all finite. dW's plain reduction and its non-finite
   re-sum are in dw_grad.cu. */
#include "depthwise.cuh"

/* ---- plain kernels for the remaining cases, and the exact reruns ----
   The plain kernels sum real input only, which is the CPU backend's rule for non-finite data:
   a padded tap adds nothing, where the fast kernels multiply its weight by a stored or implied
   zero (NaN for an inf or NaN weight). So after a fast kernel, a channel whose own weights are
   not all finite is computed again by the plain rule. The check is part of the rerun kernel:
   each block reads its channel's kh*kw weights and returns at once when they are finite, so a
   step with finite weights pays one launch of early-exiting blocks, with no flag to clear, no
   check kernel and no host round trip. */

/* one output of the forward: bias + the sum of w * x over the taps inside the input */
template <typename T>
static __device__ __forceinline__ float ut__cuda_dwconv2d_plain_y(const T* __restrict__ x,
                                                                 const float* __restrict__ w,
                                                                 const float* __restrict__ bias,
                                                                 const ut__conv_geom& g,
                                                                 ut__i64 pl, int c, int oy, int ox,
                                                                 const ut__cuda_dw_bnp& bn = {}) {
  const T* xp = x + pl * g.h * (ut__i64)g.w;
  ut__cuda_dw_bnq q = {};
  if (bn.mean) q = ut__cuda_dw_bn_at(bn, c);
  const float* wp = w + (ut__i64)c * g.kh * g.kw;
  float s = bias ? bias[c] : 0.f;
  for (int ky = 0; ky < g.kh; ++ky) {
    int iy = oy * g.stride - g.pad + ky * g.dil;
    if (iy < 0 || iy >= g.h) continue;
    for (int kx = 0; kx < g.kw; ++kx) {
      int ix = ox * g.stride - g.pad + kx * g.dil;
      if (ix < 0 || ix >= g.w) continue;
      float xv = ut__cuda_dwconv2d_ldg(xp + (ut__i64)iy * g.w + ix);
      if (bn.mean) xv = ut__cuda_dw_bn_value<T>(xv, q);
      s = fmaf(wp[ky * g.kw + kx], xv, s);
    }
  }
  return s;
}

/* one input gradient: the sum of w * go over the outputs that read input (iy, ix) */
template <typename T>
static __device__ __forceinline__ float ut__cuda_dwconv2d_plain_dx(const T* __restrict__ go,
                                                                  const float* __restrict__ w,
                                                                  const ut__conv_geom& g,
                                                                  ut__i64 pl, int c, int iy, int ix) {
  const T* gp = go + pl * g.ho * (ut__i64)g.wo;
  const float* wp = w + (ut__i64)c * g.kh * g.kw;
  float s = 0.f;
  for (int ky = 0; ky < g.kh; ++ky) {
    int ty = iy + g.pad - ky * g.dil;
    if (ty < 0 || ty % g.stride) continue;
    int oy = ty / g.stride;
    if (oy >= g.ho) continue;
    for (int kx = 0; kx < g.kw; ++kx) {
      int tx = ix + g.pad - kx * g.dil;
      if (tx < 0 || tx % g.stride) continue;
      int ox = tx / g.stride;
      if (ox >= g.wo) continue;
      s = fmaf(wp[ky * g.kw + kx], ut__cuda_dwconv2d_ldg(gp + (ut__i64)oy * g.wo + ox), s);
    }
  }
  return s;
}

template <typename T>
static __global__ void ut__cuda_dwconv2d_direct_forward_kernel(const T* __restrict__ x,
                                                               const float* __restrict__ w,
                                                               const float* __restrict__ bias,
                                                               T* __restrict__ y,
                                                               ut__conv_geom g, ut__i64 total) {
  UT__CUDA_GRID_STRIDE(i, total) {
    int ox = (int)(i % g.wo);
    ut__i64 t = i / g.wo;
    int oy = (int)(t % g.ho);
    ut__i64 pl = t / g.ho; /* n*C + c */
    ut__cuda_st(y + i, ut__cuda_dwconv2d_plain_y(x, w, bias, g, pl, (int)(pl % g.c), oy, ox));
  }
}

template <typename T>
static __global__ void ut__cuda_dwconv2d_direct_dx_kernel(const T* __restrict__ go,
                                                          const float* __restrict__ w,
                                                          T* __restrict__ dx, ut__conv_geom g,
                                                          ut__i64 total) {
  UT__CUDA_GRID_STRIDE(i, total) {
    int ix = (int)(i % g.w);
    ut__i64 t = i / g.w;
    int iy = (int)(t % g.h);
    ut__i64 pl = t / g.h;
    ut__cuda_st(dx + i, ut__cuda_dwconv2d_plain_dx(go, w, g, pl, (int)(pl % g.c), iy, ix));
  }
}

/* whether channel c's filter holds a NaN or an inf (every thread reads the same few weights) */
static __device__ __forceinline__ bool ut__cuda_dwconv2d_weights_nonfinite(const float* w,
                                                                          const ut__conv_geom& g,
                                                                          int c) {
  const float* wp = w + (ut__i64)c * g.kh * g.kw;
  bool bad = false;
  for (int t = 0; t < g.kh * g.kw; ++t) bad |= !isfinite(wp[t]);
  return bad;
}

/* The exact reruns: blocks (q, c) for channels c in steps of gridDim.y; a channel with a
   non-finite weight has its planes (outputs for the forward, inputs for dx) recomputed by
   the blocks q in steps of gridDim.x. */
template <typename T, bool DX>
static __global__ void ut__cuda_dwconv2d_exact_kernel(const T* __restrict__ in,
                                                      const float* __restrict__ w,
                                                      const float* __restrict__ bias,
                                                      T* __restrict__ out, ut__conv_geom g,
                                                      ut__cuda_dw_bnp bn) {
  const int oh = DX ? g.h : g.ho, ow = DX ? g.w : g.wo;
  const ut__i64 hw = (ut__i64)oh * ow, m = (ut__i64)g.n * hw;
  for (int c = blockIdx.y; c < g.c; c += gridDim.y) {
    if (!ut__cuda_dwconv2d_weights_nonfinite(w, g, c)) continue;
    for (ut__i64 j = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x; j < m;
         j += (ut__i64)gridDim.x * blockDim.x) {
      ut__i64 ni = j / hw;
      int pos = (int)(j - ni * hw);
      ut__i64 pl = ni * g.c + c;
      float v = DX ? ut__cuda_dwconv2d_plain_dx(in, w, g, pl, c, pos / ow, pos % ow)
                   : ut__cuda_dwconv2d_plain_y(in, w, bias, g, pl, c, pos / ow, pos % ow, bn);
      ut__cuda_st(out + pl * hw + pos, v);
    }
  }
}

/* The plain kernels over the whole output (forward) or input (dx): any geometry, dilation
   included. */
template <typename T>
int ut__cuda_dwconv2d_direct_forward_run(const T* x, const float* w, const float* bias, T* y,
                                         const ut__conv_geom* g) {
  ut__i64 total = (ut__i64)g->n * g->c * g->ho * g->wo;
  ut__cuda_dwconv2d_direct_forward_kernel
      <<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(x, w, bias, y, *g, total);
  UT__CUDA_LAUNCHED("dw_fwd");
  return UT_OK;
}

template <typename T>
int ut__cuda_dwconv2d_direct_dx_run(const T* go, const float* w, T* dx, const ut__conv_geom* g) {
  ut__i64 total = (ut__i64)g->n * g->c * g->h * g->w;
  ut__cuda_dwconv2d_direct_dx_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      go, w, dx, *g, total);
  UT__CUDA_LAUNCHED("dw_bwd_dx");
  return UT_OK;
}

/* the rerun after a fast kernel (see above): about 16 blocks per SM in all when every
   weight is finite, as many per channel as fill the device when one is not */
template <typename T, bool DX>
int ut__cuda_dwconv2d_exact_run(const T* in, const float* w, const float* bias, T* out,
                                const ut__conv_geom* g, const ut__cuda_dw_bnp& bn) {
  const ut__i64 m = (ut__i64)g->n * (DX ? (ut__i64)g->h * g->w : (ut__i64)g->ho * g->wo);
  const int cy = g->c < 65535 ? g->c : 65535;
  ut__i64 qx = ut__cuda_cdiv((ut__i64)ut__cuda_sms * 16, cy);
  ut__i64 need = ut__cuda_cdiv(m, 256);
  if (qx > need) qx = need;
  if (qx < 1) qx = 1;
  ut__cuda_dwconv2d_exact_kernel<T, DX>
      <<<dim3((unsigned)qx, (unsigned)cy), 256, 0, ut__cuda_stream>>>(in, w, bias, out, *g, bn);
  UT__CUDA_LAUNCHED(DX ? "dw_bwd_dx exact" : "dw_fwd exact");
  return UT_OK;
}

template int ut__cuda_dwconv2d_direct_forward_run<float>(const float* x, const float* w,
                                                         const float* bias, float* y,
                                                         const ut__conv_geom* g);
template int ut__cuda_dwconv2d_direct_forward_run<ut__cuda_bf16>(const ut__cuda_bf16* x,
                                                                 const float* w,
                                                                 const float* bias,
                                                                 ut__cuda_bf16* y,
                                                                 const ut__conv_geom* g);
template int ut__cuda_dwconv2d_direct_dx_run<float>(const float* go, const float* w, float* dx,
                                                    const ut__conv_geom* g);
template int ut__cuda_dwconv2d_direct_dx_run<ut__cuda_bf16>(const ut__cuda_bf16* go,
                                                            const float* w, ut__cuda_bf16* dx,
                                                            const ut__conv_geom* g);
template int ut__cuda_dwconv2d_exact_run<float, false>(const float* in, const float* w,
                                                       const float* bias, float* out,
                                                       const ut__conv_geom* g,
                                                       const ut__cuda_dw_bnp& bn);
template int ut__cuda_dwconv2d_exact_run<float, true>(const float* in, const float* w,
                                                      const float* bias, float* out,
                                                      const ut__conv_geom* g,
                                                      const ut__cuda_dw_bnp& bn);
template int ut__cuda_dwconv2d_exact_run<ut__cuda_bf16, false>(const ut__cuda_bf16* in,
                                                               const float* w, const float* bias,
                                                               ut__cuda_bf16* out,
                                                               const ut__conv_geom* g,
                                                               const ut__cuda_dw_bnp& bn);
template int ut__cuda_dwconv2d_exact_run<ut__cuda_bf16, true>(const ut__cuda_bf16* in,
                                                              const float* w, const float* bias,
                                                              ut__cuda_bf16* out,
                                                              const ut__conv_geom* g,
                                                              const ut__cuda_dw_bnp& bn);
