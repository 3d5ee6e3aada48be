/* dw_strip.cu — dwconv2d's forward and dx strip kernels (v3): straight from global memory, no
   shared tiles. One column per item (float32 and bf16), and for bf16 the pair (strip2) and wide
   (stripw) variants; their launches at run-time rows, filter size, stride and offsets. The dW
   strip kernels are in dw_grad.cu, the row walk they share with these in depthwise.cuh, the
   choice between them in depthwise.cu. */
#include "depthwise.cuh"

/* ---- strip kernels (v3): straight from global memory, no shared tiles ----
   One thread per item; an item is a vertical strip of R outputs at one column of one plane
   (items are numbered column fastest, then strip, then plane, so a warp's lanes hit
   consecutive columns and, for small planes, several planes at once). The thread walks the
   (R - 1) * S + K input rows the strip touches once; every value it loads feeds each output
   of the strip that uses it (a register window), so each input element is loaded K times
   per strip (once per column tap) instead of K * K times; the overlap between neighbouring
   lanes and strips is served by L1. All loads of a strip are independent, so many bytes are
   in flight per thread, and index arithmetic (three fast divisions) is paid once per strip.

     ut__cuda_dwconv2d_strip_forward_kernel<FLIP=false>
                     y = conv(x, w) + bias
     ut__cuda_dwconv2d_strip_forward_kernel<FLIP=true>
                     dx at stride 1: go correlated with the rotated filter
     ut__cuda_dwconv2d_strip_tdx_kernel
                     dx at stride > 1: each item is R rows x S columns of dx; with the strip
                     aligned to S, which taps meet which go element depends only on
                     D = (pad - K + 1) mod S, a template argument, so the loop has no phase tests
     ut__cuda_dwconv2d_strip_dw_kernel (dw_grad.cu)
                     dw partials: block (part, c) sums go * x tap by tap over a fixed range of
                     channel c's items, warp sums then warps in order into
                     ws[(c * parts + part) * T + t]; ut__cuda_dwconv2d_dw_final_kernel adds the
                     parts in order */

/* two adjacent outputs at once (p aligned to two elements): float2, or a bf16 pair rounded
   each to nearest even */
static __device__ __forceinline__ void ut__cuda_dwconv2d_st2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
static __device__ __forceinline__ void ut__cuda_dwconv2d_st2(ut__cuda_bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

template <int K, int S, int R, bool FLIP, typename T, bool BN>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip_forward_kernel(ut__cuda_dwconv2d_strip_params<T> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  int ox, oy0;
  unsigned plane;
  ut__cuda_dwconv2d_strip_item<R, 1>(p, it, &ox, &plane, &oy0);
  const int c = ut__cuda_dwconv2d_strip_channel(p, plane);
  const T* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
  ut__cuda_dwconv2d_load_w<NT, FLIP>(p.w, c, wr);
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  const int ixb = ox * S - p.pad, iyb = oy0 * S - p.pad;
  ut__cuda_dw_bnq q = {};
  if constexpr (BN) q = ut__cuda_dw_bn_at(p.bn, c);
  bool cv[K];
  ut__cuda_dwconv2d_cols_in<K>(ixb, p.IW, cv);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = bv;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    float v[K];
    ut__cuda_dwconv2d_strip_row<K, T, BN>(xp, iyb + j, ixb, p.IH, p.IW, cv, v, q);
    ut__cuda_dwconv2d_row_taps<false, K, K, S, R, 1, 0>(j, v, wr, acc);
  }
  T* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (oy0 * p.OW + ox);
  const int nr = min(R, p.OH - oy0);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nr) ut__cuda_st(yp + r * p.OW, acc[r]);
}

/* The transposed walk (dx at stride S > 1: the one-column and the wide kernels), one go row
   at a time: an item is R dx rows x Q dx columns; with E = K - 1 + D, go row gy0 + j meets dx
   row r through ky = E + r - j * S, and go column gx0 + m (m < MR) meets dx column q through
   kx = E + q - m * S. For each r, q and m, in that order, whose taps lie inside the filter:
   acc[r][q] += wr[ky * K + kx] * v[PO + m]. */
template <int K, int S, int R, int Q, int E, int MR, int PO, int NV>
static __device__ __forceinline__ void ut__cuda_dwconv2d_row_taps_tdx(int j, const float (&v)[NV],
                                                                      const float (&wr)[K * K],
                                                                      float (&acc)[R][Q]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int ky = E + r - j * S;
    if (ky >= 0 && ky < K) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          const int kx = E + q - m * S;
          if (kx >= 0 && kx < K) acc[r][q] = fmaf(wr[ky * K + kx], v[PO + m], acc[r][q]);
        }
    }
  }
}

/* dx at stride S > 1. in = go [planes, IH = ho, IW = wo], out = dx [planes, OH = h, OW = w].
   An item is dx rows [y0, y0 + R) x columns [x0, x0 + S) with y0 = strip * R, x0 = group * S
   (R a multiple of S). dx[y][x] = sum of go[gy][gx] * w[ky][kx] over y + pad = gy*S + ky,
   x + pad = gx*S + kx. With E = K - 1 + D, go rows gy0 + j (gy0 = (y0 + pad - E) / S, exact)
   meet dx row y0 + r through ky = E + r - j*S, and columns likewise. */
template <int K, int S, int R, int D, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip_tdx_kernel(ut__cuda_dwconv2d_strip_params<T> p) {
  constexpr int NT = K * K;
  constexpr int E = K - 1 + D;
  constexpr int JR = (E + R - 1) / S + 1; /* go rows an item reads */
  constexpr int MR = (E + S - 1) / S + 1; /* go columns an item reads */
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  int x0, y0;
  unsigned plane;
  ut__cuda_dwconv2d_strip_item<R, S>(p, it, &x0, &plane, &y0);
  const int c = ut__cuda_dwconv2d_strip_channel(p, plane);
  const T* __restrict__ gp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
  ut__cuda_dwconv2d_load_w<NT, false>(p.w, c, wr);
  const int gy0 = (y0 + p.pad - E) / S, gx0 = (x0 + p.pad - E) / S;
  bool cv[MR];
  ut__cuda_dwconv2d_cols_in<MR>(gx0, p.IW, cv);
  float acc[R][S];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < S; ++q) acc[r][q] = 0.f;
#pragma unroll
  for (int j = 0; j < JR; ++j) {
    float v[MR];
    ut__cuda_dwconv2d_strip_row<MR>(gp, gy0 + j, gx0, p.IH, p.IW, cv, v);
    ut__cuda_dwconv2d_row_taps_tdx<K, S, R, S, E, MR, 0>(j, v, wr, acc);
  }
  T* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (y0 * p.OW + x0);
  const int nr = min(R, p.OH - y0);
  if (S == 2 && p.vec2) { /* x0 is even and OW is even: x0 + 1 < OW */
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < nr) ut__cuda_dwconv2d_st2(yp + r * p.OW, acc[r][0], acc[r][S - 1]);
  } else {
    const int nq = min(S, p.OW - x0);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < nr) {
#pragma unroll
        for (int q = 0; q < S; ++q)
          if (q < nq) ut__cuda_st(yp + r * p.OW + q, acc[r][q]);
      }
  }
}

/* ---- bf16 pair kernels: R rows x 2 columns per item, rows read as bf16 pairs (why and how:
   depthwise.cuh) ---- */

/* y = conv(x, w) + bias (FLIP: dx at stride 1, go correlated with the rotated filter); the
   items are numbered as in ut__cuda_dwconv2d_strip_forward_kernel with NX = ceil(OW / 2) */
template <int K, int S, int R, bool FLIP, int PO, bool BN>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip2_forward_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = ut__cuda_dwconv2d_strip2_window<K, S, PO>::NW;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  int ox, oy0;
  unsigned plane;
  ut__cuda_dwconv2d_strip_item<R, 2>(p, it, &ox, &plane, &oy0);
  const int c = ut__cuda_dwconv2d_strip_channel(p, plane);
  const ut__cuda_bf16* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
  ut__cuda_dwconv2d_load_w<NT, FLIP>(p.w, c, wr);
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  const int a0 = ox * S - p.pad - PO, iyb = oy0 * S - p.pad;
  ut__cuda_dw_bnq q = {};
  if constexpr (BN) q = ut__cuda_dw_bn_at(p.bn, c);
  float acc[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = bv;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int iy = iyb + j;
    float v[2 * NW];
    ut__cuda_dwconv2d_strip2_row<NW, BN>(xp + iy * p.IW, a0, p.IW,
                                         (unsigned)iy < (unsigned)p.IH, v, q);
    ut__cuda_dwconv2d_row_taps<false, K, K, S, R, 2, PO>(j, v, wr, acc);
  }
  ut__cuda_bf16* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (oy0 * p.OW + ox);
  const int nr = min(R, p.OH - oy0);
  if (p.vec2) { /* OW even and rows 4-byte aligned: ox + 1 < OW */
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < nr) ut__cuda_dwconv2d_st2(yp + r * p.OW, acc[r][0], acc[r][1]);
  } else {
    const bool second = ox + 1 < p.OW;
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < nr) {
        ut__cuda_st(yp + r * p.OW, acc[r][0]);
        if (second) ut__cuda_st(yp + r * p.OW + 1, acc[r][1]);
      }
  }
}

/* ---- bf16 wide kernels: R rows x CW columns per item from 8- and 16-byte loads (why and how:
   depthwise.cuh) ---- */

/* two floats rounded to nearest even and packed as a bf16 pair (a in the low half) */
static __device__ __forceinline__ unsigned ut__cuda_dwconv2d_pack2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return (unsigned)__bfloat16_as_ushort(h.x) | ((unsigned)__bfloat16_as_ushort(h.y) << 16);
}

/* one output row of an item: CW values, as one 8- or 16-byte store when vec, else those of
   the nq columns inside the row */
template <int CW>
static __device__ __forceinline__ void ut__cuda_dwconv2d_wide_store(ut__cuda_bf16* yp,
                                                                    const float (&a)[CW],
                                                                    bool vec, int nq) {
  if (vec) {
    if constexpr (CW == 8) {
      *reinterpret_cast<uint4*>(yp) =
          make_uint4(ut__cuda_dwconv2d_pack2(a[0], a[1]), ut__cuda_dwconv2d_pack2(a[2], a[3]),
                     ut__cuda_dwconv2d_pack2(a[4], a[5]), ut__cuda_dwconv2d_pack2(a[6], a[7]));
    } else {
      static_assert(CW == 4, "wide items are 4 or 8 columns");
      *reinterpret_cast<uint2*>(yp) =
          make_uint2(ut__cuda_dwconv2d_pack2(a[0], a[1]), ut__cuda_dwconv2d_pack2(a[2], a[3]));
    }
  } else {
#pragma unroll
    for (int q = 0; q < CW; ++q)
      if (q < nq) ut__cuda_st(yp + q, a[q]);
  }
}

/* y = conv(x, w) + bias (FLIP: dx at stride 1); items numbered as in
   ut__cuda_dwconv2d_strip_forward_kernel with NX = ceil(OW / CW) */
template <int K, int S, int R, int CW, int PO, bool FLIP, bool PF, bool BN>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_stripw_forward_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int G = 8;
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = (PO + (CW - 1) * S + K + G - 1) / G;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  int ox, oy0;
  unsigned plane;
  ut__cuda_dwconv2d_strip_item<R, CW>(p, it, &ox, &plane, &oy0);
  const int c = ut__cuda_dwconv2d_strip_channel(p, plane);
  const ut__cuda_bf16* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
  ut__cuda_dwconv2d_load_w<NT, FLIP>(p.w, c, wr);
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  const int a0 = ox * S - p.pad - PO, iyb = oy0 * S - p.pad;
  ut__cuda_dw_bnq q = {};
  if constexpr (BN) q = ut__cuda_dw_bn_at(p.bn, c);
  float acc[R][CW];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < CW; ++q) acc[r][q] = bv;
  typename ut__cuda_dwconv2d_chunk<G>::type raw[PF ? ROWS : 1][NW];
  if constexpr (PF) { /* every load of the item in flight before the first use */
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      ut__cuda_dwconv2d_wide_load<G, NW>(xp + (iyb + j) * p.IW, a0, p.IW,
                                         (unsigned)(iyb + j) < (unsigned)p.IH, raw[j]);
  }
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int iy = iyb + j;
    float v[G * NW];
    ut__cuda_dwconv2d_wide_row<G, NW, PF, PF ? ROWS : 1, BN>(raw, j, xp + iy * p.IW, a0, p.IW,
                                                             (unsigned)iy < (unsigned)p.IH, v, q);
    ut__cuda_dwconv2d_row_taps<false, K, K, S, R, CW, PO>(j, v, wr, acc);
  }
  ut__cuda_bf16* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (oy0 * p.OW + ox);
  const int nr = min(R, p.OH - oy0), nq = min(CW, p.OW - ox);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nr) ut__cuda_dwconv2d_wide_store<CW>(yp + r * p.OW, acc[r], p.vec2, nq);
}

/* dx at stride S = 2 as ut__cuda_dwconv2d_strip_tdx_kernel, an item being R rows x CX
   columns of dx; go's rows are read as chunks of four (8 bytes) */
template <int K, int S, int R, int D, int CX, int PO, bool PF>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_stripw_tdx_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int G = 4;
  constexpr int NT = K * K;
  constexpr int E = K - 1 + D;
  constexpr int JR = (E + R - 1) / S + 1;  /* go rows an item reads */
  constexpr int MR = (E + CX - 1) / S + 1; /* go columns an item reads */
  constexpr int NW = (PO + MR + G - 1) / G;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  int x0, y0;
  unsigned plane;
  ut__cuda_dwconv2d_strip_item<R, CX>(p, it, &x0, &plane, &y0);
  const int c = ut__cuda_dwconv2d_strip_channel(p, plane);
  const ut__cuda_bf16* __restrict__ gp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
  ut__cuda_dwconv2d_load_w<NT, false>(p.w, c, wr);
  const int gy0 = (y0 + p.pad - E) / S, gx0 = (x0 + p.pad - E) / S;
  const int a0 = gx0 - PO;
  float acc[R][CX];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < CX; ++q) acc[r][q] = 0.f;
  typename ut__cuda_dwconv2d_chunk<G>::type raw[PF ? JR : 1][NW];
  if constexpr (PF) {
#pragma unroll
    for (int j = 0; j < JR; ++j)
      ut__cuda_dwconv2d_wide_load<G, NW>(gp + (gy0 + j) * p.IW, a0, p.IW,
                                         (unsigned)(gy0 + j) < (unsigned)p.IH, raw[j]);
  }
#pragma unroll
  for (int j = 0; j < JR; ++j) {
    const int gy = gy0 + j;
    float v[G * NW];
    ut__cuda_dwconv2d_wide_row<G, NW, PF>(raw, j, gp + gy * p.IW, a0, p.IW,
                                          (unsigned)gy < (unsigned)p.IH, v);
    ut__cuda_dwconv2d_row_taps_tdx<K, S, R, CX, E, MR, PO>(j, v, wr, acc);
  }
  ut__cuda_bf16* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (y0 * p.OW + x0);
  const int nr = min(R, p.OH - y0), nq = min(CX, p.OW - x0);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nr) ut__cuda_dwconv2d_wide_store<CX>(yp + r * p.OW, acc[r], p.vec2, nq);
}

/* ---- launches ---- */

template <int K, int S, int R, bool FLIP, int PO, bool BN>
static int ut__cuda_dwconv2d_strip2_forward_launch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int threads) {
  ut__cuda_dwconv2d_strip2_forward_kernel<K, S, R, FLIP, PO, BN>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv (bf16 strips)");
  return UT_OK;
}

template <int R, bool FLIP, bool BN>
static int ut__cuda_dwconv2d_strip2_forward_dispatch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int k, int s, int threads) {
  const int po = p.pad & 1;
  switch ((k * 10 + s) * 2 + po) {
    case 62: return ut__cuda_dwconv2d_strip2_forward_launch<3, 1, R, FLIP, 0, BN>(p, threads);
    case 63: return ut__cuda_dwconv2d_strip2_forward_launch<3, 1, R, FLIP, 1, BN>(p, threads);
    case 102: return ut__cuda_dwconv2d_strip2_forward_launch<5, 1, R, FLIP, 0, BN>(p, threads);
    case 103: return ut__cuda_dwconv2d_strip2_forward_launch<5, 1, R, FLIP, 1, BN>(p, threads);
    default: break;
  }
  if constexpr (!FLIP) { /* FLIP serves dx at stride 1 only */
    switch ((k * 10 + s) * 2 + po) {
      case 64: return ut__cuda_dwconv2d_strip2_forward_launch<3, 2, R, FLIP, 0, BN>(p, threads);
      case 65: return ut__cuda_dwconv2d_strip2_forward_launch<3, 2, R, FLIP, 1, BN>(p, threads);
      default: break;
    }
  }
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 strip kernel for %dx%d stride %d", k, k, s);
}

template <int K, int S, int R, int CW, int PO, bool FLIP, bool BN>
static int ut__cuda_dwconv2d_stripw_forward_launch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int threads) {
  ut__cuda_dwconv2d_stripw_forward_kernel<K, S, R, CW, PO, FLIP, S == 1, BN>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv (bf16 wide strips)");
  return UT_OK;
}

template <int K, int S, int R, bool FLIP, bool BN>
static int ut__cuda_dwconv2d_stripw_forward_po(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                               int po, int threads) {
  constexpr int CW = S == 1 ? 8 : 4;
  switch (po) {
    case 0: return ut__cuda_dwconv2d_stripw_forward_launch<K, S, R, CW, 0, FLIP, BN>(p, threads);
    case 7: return ut__cuda_dwconv2d_stripw_forward_launch<K, S, R, CW, 7, FLIP, BN>(p, threads);
    default: break;
  }
  if constexpr (S == 1)
    if (po == 6) return ut__cuda_dwconv2d_stripw_forward_launch<K, S, R, CW, 6, FLIP, BN>(p, threads);
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip kernel for offset %d", po);
}

template <int R, bool FLIP, bool BN>
static int ut__cuda_dwconv2d_stripw_forward_dispatch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int k, int s, int threads) {
  const int po = ut__cuda_dwconv2d_stripw_po(p.pad);
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_stripw_forward_po<3, 1, R, FLIP, BN>(p, po, threads);
    case 51: return ut__cuda_dwconv2d_stripw_forward_po<5, 1, R, FLIP, BN>(p, po, threads);
    default: break;
  }
  if constexpr (!FLIP) /* FLIP serves dx at stride 1 only */
    if (k * 10 + s == 32) return ut__cuda_dwconv2d_stripw_forward_po<3, 2, R, FLIP, BN>(p, po, threads);
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip kernel for %dx%d stride %d", k, k, s);
}

template <int R, int D, int PO>
static int ut__cuda_dwconv2d_stripw_tdx_launch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int threads) {
  ut__cuda_dwconv2d_stripw_tdx_kernel<3, 2, R, D, UT__CUDA_DWCONV2D_TDXW_CX, PO, false>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise dx (bf16 wide strips)");
  return UT_OK;
}

template <int R>
static int ut__cuda_dwconv2d_stripw_tdx_dispatch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int d, int po, int threads) {
  switch (d * 4 + po) {
    case 0: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 0, 0>(p, threads);
    case 1: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 0, 1>(p, threads);
    case 2: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 0, 2>(p, threads);
    case 3: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 0, 3>(p, threads);
    case 4: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 1, 0>(p, threads);
    case 5: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 1, 1>(p, threads);
    case 6: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 1, 2>(p, threads);
    case 7: return ut__cuda_dwconv2d_stripw_tdx_launch<R, 1, 3>(p, threads);
    default: return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip dx kernel");
  }
}

template <int K, int S, int R, bool FLIP, bool BN, typename T>
static int ut__cuda_dwconv2d_strip_forward_launch(ut__cuda_dwconv2d_strip_params<T> p,
                                                  int threads) {
  ut__cuda_dwconv2d_strip_forward_kernel<K, S, R, FLIP, T, BN>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv (strips)");
  return UT_OK;
}

template <int R, bool FLIP, bool BN, typename T>
static int ut__cuda_dwconv2d_strip_forward_dispatch(const ut__cuda_dwconv2d_strip_params<T>& p,
                                                    int k, int s, int threads) {
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_strip_forward_launch<3, 1, R, FLIP, BN>(p, threads);
    case 51: return ut__cuda_dwconv2d_strip_forward_launch<5, 1, R, FLIP, BN>(p, threads);
    default: break;
  }
  if constexpr (!FLIP) { /* FLIP serves dx at stride 1 only */
    if (k * 10 + s == 32) return ut__cuda_dwconv2d_strip_forward_launch<3, 2, R, FLIP, BN>(p, threads);
  }
  return ut__set_error(UT_ERR_ARG, "dw: no strip kernel for %dx%d stride %d", k, k, s);
}

template <int K, int R, int D, typename T>
static int ut__cuda_dwconv2d_strip_tdx_launch(ut__cuda_dwconv2d_strip_params<T> p, int threads) {
  ut__cuda_dwconv2d_strip_tdx_kernel<K, 2, R, D, T>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise dx (strips)");
  return UT_OK;
}

template <int R, typename T>
static int ut__cuda_dwconv2d_strip_tdx_dispatch(const ut__cuda_dwconv2d_strip_params<T>& p, int k,
                                                int d, int threads) {
  switch (k * 10 + d) {
    case 30: return ut__cuda_dwconv2d_strip_tdx_launch<3, R, 0>(p, threads);
    case 31: return ut__cuda_dwconv2d_strip_tdx_launch<3, R, 1>(p, threads);
    default: return ut__set_error(UT_ERR_ARG, "dw: no strip dx kernel for %dx%d", k, k);
  }
}

/* ---- what depthwise.cu calls: the kernels at run-time rows per item (4 or 8) ---- */

template <typename T>
int ut__cuda_dwconv2d_strip_forward_start(const ut__cuda_dwconv2d_strip_params<T>& p, int R,
                                          bool flip, int k, int s, int threads) {
  if (p.bn.mean) /* the forward on act(bn(in)) (never with flip) */
    return R == 4 ? ut__cuda_dwconv2d_strip_forward_dispatch<4, false, true>(p, k, s, threads)
                  : ut__cuda_dwconv2d_strip_forward_dispatch<8, false, true>(p, k, s, threads);
  if (R == 4)
    return flip ? ut__cuda_dwconv2d_strip_forward_dispatch<4, true, false>(p, k, s, threads)
                : ut__cuda_dwconv2d_strip_forward_dispatch<4, false, false>(p, k, s, threads);
  return flip ? ut__cuda_dwconv2d_strip_forward_dispatch<8, true, false>(p, k, s, threads)
              : ut__cuda_dwconv2d_strip_forward_dispatch<8, false, false>(p, k, s, threads);
}
template int ut__cuda_dwconv2d_strip_forward_start<float>(
    const ut__cuda_dwconv2d_strip_params<float>& p, int R, bool flip, int k, int s, int threads);
template int ut__cuda_dwconv2d_strip_forward_start<ut__cuda_bf16>(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int R, bool flip, int k, int s,
    int threads);

template <typename T>
int ut__cuda_dwconv2d_strip_tdx_start(const ut__cuda_dwconv2d_strip_params<T>& p, int R, int k,
                                      int d, int threads) {
  if (R == 4) return ut__cuda_dwconv2d_strip_tdx_dispatch<4>(p, k, d, threads);
  return ut__cuda_dwconv2d_strip_tdx_dispatch<8>(p, k, d, threads);
}
template int ut__cuda_dwconv2d_strip_tdx_start<float>(
    const ut__cuda_dwconv2d_strip_params<float>& p, int R, int k, int d, int threads);
template int ut__cuda_dwconv2d_strip_tdx_start<ut__cuda_bf16>(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int R, int k, int d, int threads);

int ut__cuda_dwconv2d_strip2_forward_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                           int R, bool flip, int k, int s, int threads) {
  if (p.bn.mean) /* the forward on act(bn(in)) (never with flip) */
    return R == 4 ? ut__cuda_dwconv2d_strip2_forward_dispatch<4, false, true>(p, k, s, threads)
                  : ut__cuda_dwconv2d_strip2_forward_dispatch<8, false, true>(p, k, s, threads);
  if (R == 4)
    return flip ? ut__cuda_dwconv2d_strip2_forward_dispatch<4, true, false>(p, k, s, threads)
                : ut__cuda_dwconv2d_strip2_forward_dispatch<4, false, false>(p, k, s, threads);
  return flip ? ut__cuda_dwconv2d_strip2_forward_dispatch<8, true, false>(p, k, s, threads)
              : ut__cuda_dwconv2d_strip2_forward_dispatch<8, false, false>(p, k, s, threads);
}

int ut__cuda_dwconv2d_stripw_forward_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                           int R, bool flip, int k, int s, int threads) {
  if (p.bn.mean) /* the forward on act(bn(in)) (never with flip) */
    return R == 4 ? ut__cuda_dwconv2d_stripw_forward_dispatch<4, false, true>(p, k, s, threads)
                  : ut__cuda_dwconv2d_stripw_forward_dispatch<8, false, true>(p, k, s, threads);
  if (R == 4)
    return flip ? ut__cuda_dwconv2d_stripw_forward_dispatch<4, true, false>(p, k, s, threads)
                : ut__cuda_dwconv2d_stripw_forward_dispatch<4, false, false>(p, k, s, threads);
  return flip ? ut__cuda_dwconv2d_stripw_forward_dispatch<8, true, false>(p, k, s, threads)
              : ut__cuda_dwconv2d_stripw_forward_dispatch<8, false, false>(p, k, s, threads);
}

int ut__cuda_dwconv2d_stripw_tdx_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                       int R, int d, int po, int threads) {
  if (R == 4) return ut__cuda_dwconv2d_stripw_tdx_dispatch<4>(p, d, po, threads);
  return ut__cuda_dwconv2d_stripw_tdx_dispatch<8>(p, d, po, threads);
}
