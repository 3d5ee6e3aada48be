/* dw_grad.cu — dwconv2d's weight gradient: the strip kernels' partial sums (one column per
   item, and the bf16 pair and wide variants), the plain per-tap block reduction for the other
   shapes, and the final kernel that adds each channel's partials in a fixed order into dW
   (re-summing a tap whose sum is not finite over real input only). The tiled kernel's dW mode
   is in dw_tiled.cu; the row walk these share with the forward kernels, and the block's end,
   in depthwise.cuh. Deterministic: fixed grids and orders, no atomics. */
#include "depthwise.cuh"

/* ---- strip partials: grid (parts, C), block (part, c) sums go * x tap by tap over a fixed
   range of channel c's items into part[(c * parts + part) * NT + t] ---- */

/* in = x [planes, IH, IW], go [planes, OH, OW]; grid (parts, C); items of channel c are
   numbered column fastest, then strip, then image */
template <int K, int S, int R, typename T, bool BN>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip_dw_kernel(ut__cuda_dwconv2d_strip_params<T> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  __shared__ float red[8 * NT];
  const int c = blockIdx.y;
  ut__cuda_dw_bnq q = {};
  if constexpr (BN) q = ut__cuda_dw_bn_at(p.bn, c);
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    int ox, oy0;
    unsigned n;
    ut__cuda_dwconv2d_strip_item<R, 1>(p, it, &ox, &n, &oy0);
    const size_t plane = (size_t)n * p.C + c;
    const T* __restrict__ xp = p.in + plane * in_plane;
    const T* __restrict__ gp = p.go + plane * out_plane + (oy0 * p.OW + ox);
    const int nr = min(R, p.OH - oy0);
    float g[R];
#pragma unroll
    for (int r = 0; r < R; ++r) g[r] = r < nr ? ut__cuda_dwconv2d_ldg(gp + r * p.OW) : 0.f;
    const int ixb = ox * S - p.pad, iyb = oy0 * S - p.pad;
    bool cv[K];
    ut__cuda_dwconv2d_cols_in<K>(ixb, p.IW, cv);
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      float v[K];
      ut__cuda_dwconv2d_strip_row<K, T, BN>(xp, iyb + j, ixb, p.IH, p.IW, cv, v, q);
      ut__cuda_dwconv2d_row_taps<true, K, K, S, R, 1, 0>(j, v, g, accw);
    }
  }
  ut__cuda_dwconv2d_dw_block_store<NT>(accw, red, p.part, (size_t)c * gridDim.x + blockIdx.x);
}

/* dw partials as ut__cuda_dwconv2d_strip_dw_kernel, an item being R rows x 2 columns; go is
   read in pairs too (OW even, go 4-byte aligned) */
template <int K, int S, int R, int PO, bool BN>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip2_dw_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = ut__cuda_dwconv2d_strip2_window<K, S, PO>::NW;
  __shared__ float red[8 * NT];
  const int c = blockIdx.y;
  ut__cuda_dw_bnq q = {};
  if constexpr (BN) q = ut__cuda_dw_bn_at(p.bn, c);
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    int ox, oy0;
    unsigned n;
    ut__cuda_dwconv2d_strip_item<R, 2>(p, it, &ox, &n, &oy0);
    const size_t plane = (size_t)n * p.C + c;
    const ut__cuda_bf16* __restrict__ xp = p.in + plane * in_plane;
    const __nv_bfloat162* __restrict__ gp =
        reinterpret_cast<const __nv_bfloat162*>(p.go + plane * out_plane + (oy0 * p.OW + ox));
    const int nr = min(R, p.OH - oy0);
    float g[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float2 f = make_float2(0.f, 0.f);
      if (r < nr) f = __bfloat1622float2(__ldg(gp + r * (p.OW >> 1)));
      g[r][0] = f.x;
      g[r][1] = f.y;
    }
    const int a0 = ox * S - p.pad - PO, iyb = oy0 * S - p.pad;
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int iy = iyb + j;
      float v[2 * NW];
      ut__cuda_dwconv2d_strip2_row<NW, BN>(xp + iy * p.IW, a0, p.IW,
                                           (unsigned)iy < (unsigned)p.IH, v, q);
      ut__cuda_dwconv2d_row_taps<true, K, K, S, R, 2, PO>(j, v, g, accw);
    }
  }
  ut__cuda_dwconv2d_dw_block_store<NT>(accw, red, p.part, (size_t)c * gridDim.x + blockIdx.x);
}

/* dw partials as ut__cuda_dwconv2d_strip_dw_kernel, an item being R rows x CW columns (OW a
   multiple of CW); go is read as CW bf16 at once */
template <int K, int S, int R, int CW, int PO, bool PF, bool BN>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_stripw_dw_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int G = 8;
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = (PO + (CW - 1) * S + K + G - 1) / G;
  typedef typename ut__cuda_dwconv2d_chunk<CW>::type VG;
  __shared__ float red[8 * NT];
  const int c = blockIdx.y;
  ut__cuda_dw_bnq q = {};
  if constexpr (BN) q = ut__cuda_dw_bn_at(p.bn, c);
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    int ox, oy0;
    unsigned n;
    ut__cuda_dwconv2d_strip_item<R, CW>(p, it, &ox, &n, &oy0);
    const size_t plane = (size_t)n * p.C + c;
    const ut__cuda_bf16* __restrict__ xp = p.in + plane * in_plane;
    const ut__cuda_bf16* __restrict__ gp = p.go + plane * out_plane + (oy0 * p.OW + ox);
    const int nr = min(R, p.OH - oy0);
    float g[R][CW];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      VG u = {};
      if (r < nr) u = __ldg(reinterpret_cast<const VG*>(gp + r * p.OW));
      ut__cuda_dwconv2d_unpack(u, g[r]);
    }
    const int a0 = ox * S - p.pad - PO, iyb = oy0 * S - p.pad;
    typename ut__cuda_dwconv2d_chunk<G>::type raw[PF ? ROWS : 1][NW];
    if constexpr (PF) {
#pragma unroll
      for (int j = 0; j < ROWS; ++j)
        ut__cuda_dwconv2d_wide_load<G, NW>(xp + (iyb + j) * p.IW, a0, p.IW,
                                           (unsigned)(iyb + j) < (unsigned)p.IH, raw[j]);
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int iy = iyb + j;
      float v[G * NW];
      ut__cuda_dwconv2d_wide_row<G, NW, PF, PF ? ROWS : 1, BN>(
          raw, j, xp + iy * p.IW, a0, p.IW, (unsigned)iy < (unsigned)p.IH, v, q);
      ut__cuda_dwconv2d_row_taps<true, K, K, S, R, CW, PO>(j, v, g, accw);
    }
  }
  ut__cuda_dwconv2d_dw_block_store<NT>(accw, red, p.part, (size_t)c * gridDim.x + blockIdx.x);
}

/* ---- the plain reduction and the final stage ---- */

/* one tap's dW over outputs [e0, e1) of channel c (output e is image e / (ho*wo), position
   e % (ho*wo)), strided by `step` from e0 + first: real input only */
template <typename T>
static __device__ __forceinline__ float ut__cuda_dwconv2d_plain_dw(const T* __restrict__ go,
                                                                  const T* __restrict__ x,
                                                                  const ut__conv_geom& g, int c,
                                                                  int ky, int kx, ut__i64 e,
                                                                  ut__i64 e1, int step,
                                                                  const ut__cuda_dw_bnp& bn = {}) {
  ut__cuda_dw_bnq q = {};
  if (bn.mean) q = ut__cuda_dw_bn_at(bn, c);
  const ut__i64 hw = (ut__i64)g.ho * g.wo;
  float s = 0.f;
  for (; e < e1; e += step) {
    ut__i64 ni = e / hw;
    int pos = (int)(e - ni * hw);
    int oy = pos / g.wo, ox = pos % g.wo;
    int iy = oy * g.stride - g.pad + ky * g.dil, ix = ox * g.stride - g.pad + kx * g.dil;
    if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
    ut__i64 pl = ni * g.c + c;
    float xv = ut__cuda_dwconv2d_ldg(x + (pl * g.h + iy) * (ut__i64)g.w + ix);
    if (bn.mean) xv = ut__cuda_dw_bn_value<T>(xv, q);
    s += ut__cuda_dwconv2d_ldg(go + pl * hw + pos) * xv;
  }
  return s;
}

/* C * chunks blocks: block c * chunks + q sums go * x tap by tap over outputs [e0, e1) of channel c
   -> ws[(c*chunks + q)*T + tap] */
template <typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_direct_dw_kernel(const T* __restrict__ go, const T* __restrict__ x,
                                       ut__conv_geom g, ut__i64 chunk, int chunks,
                                       float* __restrict__ ws) {
  __shared__ float sh[32];
  const int c = blockIdx.x / chunks;
  const int NT = g.kh * g.kw;
  const ut__i64 m = (ut__i64)g.n * g.ho * g.wo;
  const ut__i64 e0 = (ut__i64)(blockIdx.x % chunks) * chunk;
  const ut__i64 e1 = e0 + chunk < m ? e0 + chunk : m;
  for (int tap = 0; tap < NT; ++tap) {
    float acc[1] = {ut__cuda_dwconv2d_plain_dw(go, x, g, c, tap / g.kw, tap % g.kw,
                                               e0 + threadIdx.x, e1, blockDim.x)};
    ut__cuda_block_sum<1>(acc, sh);
    if (threadIdx.x == 0) ws[(ut__i64)blockIdx.x * NT + tap] = acc[0];
  }
}

/* dW's second stage: warp (c, t) adds channel c's partial sums of tap t, in a fixed order, into
   dw. From a fast kernel (go != NULL) a sum that is not finite is replaced: a non-finite input
   reaches every sum it takes part in, padding products included, so a finite sum met none and
   is exact, and a tap whose sum is not finite is summed again by the same warp over real input
   only (the CPU backend's rule). Non-finite data is rare, so that warp's long walk costs
   nothing in ordinary steps, and no scan of go and x, flag or further launch is needed. From
   the plain kernel (go == NULL) the sums are exact and added whatever they are. */
template <typename T>
static __global__ void ut__cuda_dwconv2d_dw_final_kernel(const float* __restrict__ ws,
                                                         float* __restrict__ dw, int C, int NT,
                                                         int parts, const T* __restrict__ go,
                                                         const T* __restrict__ x,
                                                         ut__conv_geom g, ut__cuda_dw_bnp bn) {
  const ut__i64 gw = ((ut__i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= (ut__i64)C * NT) return;
  const int c = (int)(gw / NT), t = (int)(gw % NT);
  float s = 0.f;
  for (int i = lane; i < parts; i += 32) s += ws[((ut__i64)c * parts + i) * NT + t];
  s = ut__cuda_warp_sum(s);
  if (go && !isfinite(s)) /* the whole warp: s is the same in every lane */
    s = ut__cuda_warp_sum(ut__cuda_dwconv2d_plain_dw(go, x, g, c, t / g.kw, t % g.kw, lane,
                                                     (ut__i64)g.n * g.ho * g.wo, 32, bn));
  if (lane == 0) dw[gw] += s;
}

/* ---- launches ---- */

template <int K, int S, int R, bool BN, typename T>
static int ut__cuda_dwconv2d_strip_dw_launch(ut__cuda_dwconv2d_strip_params<T> p, int parts,
                                             int threads) {
  ut__cuda_dwconv2d_strip_dw_kernel<K, S, R, T, BN>
      <<<dim3((unsigned)parts, (unsigned)p.C), threads, 0, ut__cuda_stream>>>(
      p);
  UT__CUDA_LAUNCHED("depthwise dW (strips)");
  return UT_OK;
}

template <int R, bool BN, typename T>
static int ut__cuda_dwconv2d_strip_dw_dispatch(const ut__cuda_dwconv2d_strip_params<T>& p, int k,
                                               int s, int parts, int threads) {
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_strip_dw_launch<3, 1, R, BN>(p, parts, threads);
    case 51: return ut__cuda_dwconv2d_strip_dw_launch<5, 1, R, BN>(p, parts, threads);
    case 32: return ut__cuda_dwconv2d_strip_dw_launch<3, 2, R, BN>(p, parts, threads);
    default:
      return ut__set_error(UT_ERR_ARG, "dw: no strip dW kernel for %dx%d stride %d", k, k, s);
  }
}

template <int K, int S, int R, int PO, bool BN>
static int ut__cuda_dwconv2d_strip2_dw_launch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                              int parts, int threads) {
  ut__cuda_dwconv2d_strip2_dw_kernel<K, S, R, PO, BN>
      <<<dim3((unsigned)parts, (unsigned)p.C), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise dW (bf16 strips)");
  return UT_OK;
}

template <int R, bool BN>
static int ut__cuda_dwconv2d_strip2_dw_dispatch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                                int k, int s, int parts, int threads) {
  switch ((k * 10 + s) * 2 + (p.pad & 1)) {
    case 62: return ut__cuda_dwconv2d_strip2_dw_launch<3, 1, R, 0, BN>(p, parts, threads);
    case 63: return ut__cuda_dwconv2d_strip2_dw_launch<3, 1, R, 1, BN>(p, parts, threads);
    case 102: return ut__cuda_dwconv2d_strip2_dw_launch<5, 1, R, 0, BN>(p, parts, threads);
    case 103: return ut__cuda_dwconv2d_strip2_dw_launch<5, 1, R, 1, BN>(p, parts, threads);
    case 64: return ut__cuda_dwconv2d_strip2_dw_launch<3, 2, R, 0, BN>(p, parts, threads);
    case 65: return ut__cuda_dwconv2d_strip2_dw_launch<3, 2, R, 1, BN>(p, parts, threads);
    default:
      return ut__set_error(UT_ERR_ARG, "dw: no bf16 strip dW kernel for %dx%d stride %d", k, k, s);
  }
}

template <int K, int S, int R, int CW, int PO, bool BN>
static int ut__cuda_dwconv2d_stripw_dw_launch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                              int parts, int threads) {
  ut__cuda_dwconv2d_stripw_dw_kernel<K, S, R, CW, PO, S == 1, BN>
      <<<dim3((unsigned)parts, (unsigned)p.C), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise dW (bf16 wide strips)");
  return UT_OK;
}

template <int K, int S, int R, bool BN>
static int ut__cuda_dwconv2d_stripw_dw_po(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                          int po, int parts, int threads) {
  constexpr int CW = S == 1 ? 8 : 4;
  switch (po) {
    case 0: return ut__cuda_dwconv2d_stripw_dw_launch<K, S, R, CW, 0, BN>(p, parts, threads);
    case 7: return ut__cuda_dwconv2d_stripw_dw_launch<K, S, R, CW, 7, BN>(p, parts, threads);
    default: break;
  }
  if constexpr (S == 1)
    if (po == 6) return ut__cuda_dwconv2d_stripw_dw_launch<K, S, R, CW, 6, BN>(p, parts, threads);
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip dW kernel for offset %d", po);
}

template <int R, bool BN>
static int ut__cuda_dwconv2d_stripw_dw_dispatch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                                int k, int s, int parts, int threads) {
  const int po = ut__cuda_dwconv2d_stripw_po(p.pad);
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_stripw_dw_po<3, 1, R, BN>(p, po, parts, threads);
    case 51: return ut__cuda_dwconv2d_stripw_dw_po<5, 1, R, BN>(p, po, parts, threads);
    case 32: return ut__cuda_dwconv2d_stripw_dw_po<3, 2, R, BN>(p, po, parts, threads);
    default:
      return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip dW kernel for %dx%d stride %d", k,
                           k, s);
  }
}

/* ---- what depthwise.cu calls ---- */

template <typename T>
int ut__cuda_dwconv2d_strip_dw_start(const ut__cuda_dwconv2d_strip_params<T>& p, int R, int k,
                                     int s, int parts, int threads) {
  if (p.bn.mean) /* on act(bn(x)) */
    return R == 4 ? ut__cuda_dwconv2d_strip_dw_dispatch<4, true>(p, k, s, parts, threads)
                  : ut__cuda_dwconv2d_strip_dw_dispatch<8, true>(p, k, s, parts, threads);
  if (R == 4) return ut__cuda_dwconv2d_strip_dw_dispatch<4, false>(p, k, s, parts, threads);
  return ut__cuda_dwconv2d_strip_dw_dispatch<8, false>(p, k, s, parts, threads);
}
template int ut__cuda_dwconv2d_strip_dw_start<float>(const ut__cuda_dwconv2d_strip_params<float>& p,
                                                     int R, int k, int s, int parts, int threads);
template int ut__cuda_dwconv2d_strip_dw_start<ut__cuda_bf16>(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int R, int k, int s, int parts,
    int threads);

int ut__cuda_dwconv2d_strip2_dw_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                      int R, int k, int s, int parts, int threads) {
  if (p.bn.mean) /* on act(bn(x)) */
    return R == 4 ? ut__cuda_dwconv2d_strip2_dw_dispatch<4, true>(p, k, s, parts, threads)
                  : ut__cuda_dwconv2d_strip2_dw_dispatch<8, true>(p, k, s, parts, threads);
  if (R == 4) return ut__cuda_dwconv2d_strip2_dw_dispatch<4, false>(p, k, s, parts, threads);
  return ut__cuda_dwconv2d_strip2_dw_dispatch<8, false>(p, k, s, parts, threads);
}

int ut__cuda_dwconv2d_stripw_dw_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                      int R, int k, int s, int parts, int threads) {
  if (p.bn.mean) /* on act(bn(x)) */
    return R == 4 ? ut__cuda_dwconv2d_stripw_dw_dispatch<4, true>(p, k, s, parts, threads)
                  : ut__cuda_dwconv2d_stripw_dw_dispatch<8, true>(p, k, s, parts, threads);
  if (R == 4) return ut__cuda_dwconv2d_stripw_dw_dispatch<4, false>(p, k, s, parts, threads);
  return ut__cuda_dwconv2d_stripw_dw_dispatch<8, false>(p, k, s, parts, threads);
}

/* C * parts blocks of 256 threads, each reducing `chunk` outputs of its channel */
template <typename T>
int ut__cuda_dwconv2d_direct_dw_start(const T* go, const T* x, const ut__conv_geom* g,
                                      ut__i64 chunk, int parts, float* ws) {
  ut__cuda_dwconv2d_direct_dw_kernel
      <<<(unsigned)((ut__i64)g->c * parts), 256, 0, ut__cuda_stream>>>(go, x, *g, chunk, parts,
                                                                        ws);
  UT__CUDA_LAUNCHED("dw_bwd_dw");
  return UT_OK;
}
template int ut__cuda_dwconv2d_direct_dw_start<float>(const float* go, const float* x,
                                                      const ut__conv_geom* g, ut__i64 chunk,
                                                      int parts, float* ws);
template int ut__cuda_dwconv2d_direct_dw_start<ut__cuda_bf16>(const ut__cuda_bf16* go,
                                                              const ut__cuda_bf16* x,
                                                              const ut__conv_geom* g,
                                                              ut__i64 chunk, int parts, float* ws);

/* one warp per (channel, tap), 256 threads per block */
template <typename T>
int ut__cuda_dwconv2d_dw_final_start(const float* ws, float* dw, int C, int NT, int parts,
                                     const T* go, const T* x, const ut__conv_geom* g,
                                     const ut__cuda_dw_bnp& bn) {
  ut__i64 warps = (ut__i64)C * NT;
  ut__cuda_dwconv2d_dw_final_kernel<T>
      <<<(unsigned)ut__cuda_cdiv(warps * 32, 256), 256, 0, ut__cuda_stream>>>(
      ws, dw, C, NT, parts, go, x, *g, bn);
  UT__CUDA_LAUNCHED("dw_bwd_dw final");
  return UT_OK;
}
template int ut__cuda_dwconv2d_dw_final_start<float>(const float* ws, float* dw, int C, int NT,
                                                     int parts, const float* go, const float* x,
                                                     const ut__conv_geom* g,
                                                     const ut__cuda_dw_bnp& bn);
template int ut__cuda_dwconv2d_dw_final_start<ut__cuda_bf16>(const float* ws, float* dw, int C,
                                                             int NT, int parts,
                                                             const ut__cuda_bf16* go,
                                                             const ut__cuda_bf16* x,
                                                             const ut__conv_geom* g,
                                                             const ut__cuda_dw_bnp& bn);
