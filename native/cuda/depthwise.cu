/* depthwise.cu — dwconv2d: forward, dx and dW (measurements and history: CUDA_NOTES.md). The
   files and the naming: common.cuh. */
#include "common.cuh"

/* ============================================================================================
   Depthwise convolution

   3x3 filters at stride 1 or 2 and 5x5 at stride 1 take the strip kernels
   (ut__cuda_dwconv2d_strip_*), which were faster on
   every measured shape. The tiled path (ut__cuda_dwconv2d_tile_kernel) covers the other square
   3x3, 5x5 and 7x7 filters at stride 1 or 2 whose tiles fit in shared memory. A unit of work
   is one channel c, a group of P images and a band of BH output rows of each of their planes
   (P > 1 only when whole planes are small; BH < OH only when P == 1). The grid is persistent:
   each block takes every gridDim.x-th unit and, while it computes one, copies the next unit's
   input rows into its second shared buffer with cp.async (per plane a contiguous run of
   memory, 16-byte copies for the body, 4-byte ones for unaligned heads and tails; each plane's
   copy keeps its address modulo 16). Each thread then takes vertical strips of R outputs at
   one column: it walks the input rows the strip touches once, and every row value it reads
   feeds each output of the strip that uses it. Padding is handled by bounds checks, not by
   stored zeros. Filter taps live in registers.

     UT__CUDA_DWCONV2D_FWD   y = conv(x, w) + bias                     (in = x, out = y)
     UT__CUDA_DWCONV2D_FLIP  the same with the filter rotated 180 degrees: the input gradient
                             at stride 1 is exactly that, with go as input and padding kh-1-pad
     UT__CUDA_DWCONV2D_TDX   the input gradient at stride > 1 (transposed convolution): go's
                             rows in shared memory, each dx element gathers the taps whose
                             stride phase matches
     UT__CUDA_DWCONV2D_DW    dw partials: for each unit the KH*KW sums of go * x over its
                             outputs, reduced in registers, then across the block, and written
                             to ws[unit]; a second kernel (ut__cuda_dwconv2d_dw_final_kernel)
                             adds each channel's partials in a fixed order into dw.

   Everything else (other filter shapes, planes too wide for shared memory) takes plain
   kernels: one thread per output (gather form for dx), and for dW a per-channel, per-chunk
   block reduction tap by tap, with the same deterministic second stage.

   bf16 activations (the *_bf16 entry points at the end): every kernel is a template over the
   activation type T (float or ut__cuda_bf16) that reads x and go through
   ut__cuda_dwconv2d_ldg and writes y and dx through ut__cuda_st; w, bias, the dW partials
   and dW stay float32, and the arithmetic, its order and the choice of kernel are the float32
   ones, so a bf16 result is the float32 result on the same (bf16) inputs, rounded once when
   stored. Where the float32 code moves several floats at once the bf16 code has its own
   equivalent: the tiled kernels stage bf16 in shared memory as it is (8-byte cp.async, 2-byte
   copies for unaligned heads and tails); the stride-2 dx strip kernel stores bf16 pairs where
   float32 stores float2. The strip kernels are bound by load instructions rather than bytes,
   so halving the bytes alone gains little: when the rows start at multiples of 8 columns
   (16-byte aligned), the forward, stride-1 dx and dW strip kernels take 8 output columns per
   thread at stride 1 and 4 at stride 2, read as 16-byte chunks, and dx at stride 2 takes 8 dx
   columns per thread from 8-byte chunks of go (ut__cuda_dwconv2d_stripw_*); other even
   widths take two columns per thread read as 4-byte pairs (ut__cuda_dwconv2d_strip2_*). All
   keep each output's float32 sum order (forward and dx are the float32 result rounded once);
   only the dW partial sums are grouped differently.
   Measured on an H200 (fwd + dx + dW through the entry points, each with its non-finite
   check and gated rerun, bf16 over float32): 32x32x112x112 3x3 s1 1.79x, 32x96x112x112 s2
   1.75x, 32x144x56x56 s1 1.76x, s2 1.55x, 32x128x56x56 s1 1.70x (the pair kernels before:
   1.28x, 1.48x, 1.26x, 1.30x); 32x384x14x14 (width 14: pairs) 1.10x, 5x5 on 28x28 (pairs)
   1.28x; 5x5 s2 and 7x7 (tiled) 0.96x.
   ============================================================================================ */

/* Read-only loads of activations: __ldg as the float32 kernels always did (the read-only
   path), converted to float for bf16. */
static __device__ __forceinline__ float ut__cuda_dwconv2d_ldg(const float* p) { return __ldg(p); }
static __device__ __forceinline__ float ut__cuda_dwconv2d_ldg(const ut__cuda_bf16* p) {
  return __bfloat162float(__ldg(p));
}

enum {
  UT__CUDA_DWCONV2D_FWD = 0,
  UT__CUDA_DWCONV2D_FLIP = 1,
  UT__CUDA_DWCONV2D_DW = 2,
  UT__CUDA_DWCONV2D_TDX = 3
};

/* n / d for 0 <= n < 2^31 with a multiply and a shift (d >= 1) */
struct ut__cuda_fastdiv {
  unsigned d, m, s;
};

static ut__cuda_fastdiv ut__cuda_fastdiv_make(unsigned d) {
  ut__cuda_fastdiv f;
  f.d = d;
  unsigned s = 0;
  while (s < 32 && (1ull << s) < d) ++s;
  f.s = s;
  f.m = (unsigned)(((1ull << 32) * ((1ull << s) - d)) / d + 1);
  return f;
}

static __device__ __forceinline__ unsigned ut__cuda_fdiv(unsigned n, const ut__cuda_fastdiv& f) {
  return (__umulhi(n, f.m) + n) >> f.s;
}

template <typename T>
struct ut__cuda_dwconv2d_tile_params {
  const T* in;       /* [N, C, IH, IW] */
  const float* w;    /* [C, KH, KW] */
  const float* bias; /* [C] or NULL (UT__CUDA_DWCONV2D_FWD) */
  const T* go;       /* [N, C, OH, OW] (UT__CUDA_DWCONV2D_DW) */
  T* out;            /* [N, C, OH, OW] (not UT__CUDA_DWCONV2D_DW) */
  float* part;       /* partials [units, KH*KW] (UT__CUDA_DWCONV2D_DW) */
  int N, C, IH, IW, OH, OW, pad_h, pad_w;
  int P, NG, BH, NB, NS; /* images per unit, image groups, rows per band, bands, strips/band */
  int SQ;                /* shared elements (T) per plane */
  int BUF;               /* shared elements per buffer (P * SQ, a multiple of 4) */
  int units;             /* C * NG * NB */
  ut__cuda_fastdiv fd_ow, fd_ns;
};

/* one unit of work: channel c, images [n0, n0 + np), output rows [oy0, oy0 + bh), and the
   input rows [iy_lo, iy_lo + L / IW) they read */
struct ut__cuda_dwconv2d_unit {
  int c, n0, np, oy0, bh, iy_lo, L;
};

template <int MODE, int KH, int S, typename T>
static __device__ __forceinline__ ut__cuda_dwconv2d_unit
ut__cuda_dwconv2d_unit_at(const ut__cuda_dwconv2d_tile_params<T>& p, int unit) {
  ut__cuda_dwconv2d_unit u;
  const int b = unit % p.NB;
  const int t1 = unit / p.NB;
  const int grp = t1 % p.NG;
  u.c = t1 / p.NG;
  u.n0 = grp * p.P;
  u.np = min(p.P, p.N - u.n0);
  u.oy0 = b * p.BH;
  u.bh = min(p.BH, p.OH - u.oy0);
  int hi;
  if constexpr (MODE == UT__CUDA_DWCONV2D_TDX) {
    /* output row y reads input rows (y + pad - ky) / S for the ky that divide evenly */
    const int tlo = u.oy0 + p.pad_h - (KH - 1);
    u.iy_lo = tlo <= 0 ? 0 : (tlo + S - 1) / S;
    hi = min(p.IH - 1, (u.oy0 + u.bh - 1 + p.pad_h) / S);
  } else {
    u.iy_lo = max(0, u.oy0 * S - p.pad_h);
    hi = min(p.IH - 1, (u.oy0 + u.bh - 1) * S - p.pad_h + KH - 1);
  }
  u.L = hi >= u.iy_lo ? (hi - u.iy_lo + 1) * p.IW : 0;
  return u;
}

static __device__ __forceinline__ void ut__cuda_cp_async16(float* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
#else
  *reinterpret_cast<float4*>(dst) = __ldg(reinterpret_cast<const float4*>(src));
#endif
}

static __device__ __forceinline__ void ut__cuda_cp_async4(float* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
#else
  *dst = __ldg(src);
#endif
}

/* 8 bytes: four bf16 (ut__cuda_dwconv2d_tile_issue); .ca, since .cg takes only 16 */
static __device__ __forceinline__ void ut__cuda_cp_async8(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(src));
#else
  *reinterpret_cast<uint2*>(dst) = __ldg(reinterpret_cast<const uint2*>(src));
#endif
}

static __device__ __forceinline__ void ut__cuda_cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

/* wait until at most one group (the newest) is pending */
static __device__ __forceinline__ void ut__cuda_cp_async_wait1() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::);
#endif
}

/* Where a plane's run of input starts in its shared slot: the copy keeps the source's address
   modulo 16 bytes for float (four floats) and modulo 8 bytes for bf16 (four bf16), so the
   body goes in whole aligned chunks of four elements. */
static __device__ __forceinline__ int ut__cuda_dwconv2d_tile_skew(const float* src) {
  return (int)((reinterpret_cast<uintptr_t>(src) >> 2) & 3);
}
static __device__ __forceinline__ int ut__cuda_dwconv2d_tile_skew(const ut__cuda_bf16* src) {
  return (int)((reinterpret_cast<uintptr_t>(src) >> 1) & 3);
}

/* start copying a unit's input rows into a shared buffer: per plane a contiguous run of L
   elements, placed at ut__cuda_dwconv2d_tile_skew so that chunks of four elements are aligned
   on both sides: float 16-byte body, 4-byte head and tail; bf16 8-byte body, and the head and
   tail elements copied by plain 2-byte loads and stores (cp.async moves 4 bytes at least;
   only a band whose start or length is not a multiple of four elements has them) */
template <int MODE, int KH, int S, typename T>
static __device__ __forceinline__ void ut__cuda_dwconv2d_tile_issue(
    const ut__cuda_dwconv2d_tile_params<T>& p, int unit, T* buf) {
  const ut__cuda_dwconv2d_unit u = ut__cuda_dwconv2d_unit_at<MODE, KH, S>(p, unit);
  const ut__i64 in_plane = (ut__i64)p.IH * p.IW;
  const int nv = (u.L + 6) >> 2;
  const int slots = u.np * nv;
  for (int idx = threadIdx.x; idx < slots; idx += blockDim.x) {
    const int q = idx / nv, v = idx - q * nv;
    const T* src =
        p.in + ((ut__i64)(u.n0 + q) * p.C + u.c) * in_plane + (ut__i64)u.iy_lo * p.IW;
    const int off = ut__cuda_dwconv2d_tile_skew(src);
    const int e = 4 * v - off;
    T* dst = buf + q * p.SQ + 4 * v;
    if constexpr (sizeof(T) == 4) {
      if (e >= 0 && e + 3 < u.L) {
        ut__cuda_cp_async16(dst, src + e);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (e + k >= 0 && e + k < u.L) ut__cuda_cp_async4(dst + k, src + e + k);
      }
    } else {
      if (e >= 0 && e + 3 < u.L) {
        ut__cuda_cp_async8(dst, src + e);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (e + k >= 0 && e + k < u.L) dst[k] = src[e + k];
      }
    }
  }
}

/* compute one unit from its shared buffer */
template <int MODE, int KH, int KW, int S, int R, typename T>
static __device__ __forceinline__ void ut__cuda_dwconv2d_tile_compute(
    const ut__cuda_dwconv2d_tile_params<T>& p, int unit, const T* sm, float* red) {
  constexpr int NT = KH * KW;
  constexpr int ROWS = (R - 1) * S + KH; /* input rows a forward strip can touch */
  const ut__cuda_dwconv2d_unit u = ut__cuda_dwconv2d_unit_at<MODE, KH, S>(p, unit);
  const ut__i64 in_plane = (ut__i64)p.IH * p.IW;
  const ut__i64 out_plane = (ut__i64)p.OH * p.OW;

  float wr[NT];
  float bv = 0.f;
  if constexpr (MODE != UT__CUDA_DWCONV2D_DW) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
      wr[i] = __ldg(p.w + (ut__i64)u.c * NT + (MODE == UT__CUDA_DWCONV2D_FLIP ? NT - 1 - i : i));
    if (MODE == UT__CUDA_DWCONV2D_FWD && p.bias) bv = __ldg(p.bias + u.c);
  }
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;

  /* vertical strips of R outputs: item = (q * NS + strip) * OW + ox */
  const int items = u.np * p.NS * p.OW;
  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    const int t2 = (int)ut__cuda_fdiv((unsigned)it, p.fd_ow);
    const int ox = it - t2 * p.OW;
    const int q = (int)ut__cuda_fdiv((unsigned)t2, p.fd_ns);
    const int s = t2 - q * p.NS;
    const int oys = u.oy0 + s * R;
    const int nr = min(R, u.oy0 + u.bh - oys);
    if (nr <= 0) continue; /* a strip past the end of a short last band */
    const ut__i64 plane_idx = (ut__i64)(u.n0 + q) * p.C + u.c;
    const T* src = p.in + plane_idx * in_plane + (ut__i64)u.iy_lo * p.IW;
    const int base = q * p.SQ + ut__cuda_dwconv2d_tile_skew(src) -
                     u.iy_lo * p.IW; /* + iy * IW + ix: the input element (iy, ix) */

    if constexpr (MODE == UT__CUDA_DWCONV2D_TDX) {
      /* dx[y][x] = sum over (ky, kx) with y + pad = oy*S + ky, x + pad = ox*S + kx of
         go[oy][ox] * w[ky][kx] */
      bool okx[KW];
      int cx[KW];
#pragma unroll
      for (int kx = 0; kx < KW; ++kx) {
        const int tx = ox + p.pad_w - kx;
        cx[kx] = tx / S;
        okx[kx] = tx >= 0 && tx % S == 0 && tx / S < p.IW;
      }
      T* yp = p.out + plane_idx * out_plane + (ut__i64)oys * p.OW + ox;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < nr) {
          float a = 0.f;
#pragma unroll
          for (int ky = 0; ky < KH; ++ky) {
            const int ty = oys + r + p.pad_h - ky;
            if (ty >= 0 && ty % S == 0 && ty / S < p.IH) {
              const int rb = base + (ty / S) * p.IW;
#pragma unroll
              for (int kx = 0; kx < KW; ++kx)
                if (okx[kx]) a = fmaf(wr[ky * KW + kx], ut__cuda_ld(sm + rb + cx[kx]), a);
            }
          }
          ut__cuda_st(yp + (ut__i64)r * p.OW, a);
        }
      }
    } else {
      const int ixb = ox * S - p.pad_w;
      const int iyb = oys * S - p.pad_h;
      const int jmax = (nr - 1) * S + KH;
      bool cv[KW];
#pragma unroll
      for (int cc = 0; cc < KW; ++cc) cv[cc] = (unsigned)(ixb + cc) < (unsigned)p.IW;

      float g[R];   /* UT__CUDA_DWCONV2D_DW: the strip's output gradients */
      float acc[R]; /* otherwise: the strip's outputs */
      if constexpr (MODE == UT__CUDA_DWCONV2D_DW) {
        const T* gp = p.go + plane_idx * out_plane + (ut__i64)oys * p.OW + ox;
#pragma unroll
        for (int r = 0; r < R; ++r)
          g[r] = r < nr ? ut__cuda_dwconv2d_ldg(gp + (ut__i64)r * p.OW) : 0.f;
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = bv;
      }

#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        const int iy = iyb + j;
        if (j < jmax && (unsigned)iy < (unsigned)p.IH) {
          const int rb = base + iy * p.IW + ixb;
          float v[KW];
#pragma unroll
          for (int cc = 0; cc < KW; ++cc) v[cc] = cv[cc] ? ut__cuda_ld(sm + rb + cc) : 0.f;
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const int kr = j - r * S;
            if (kr >= 0 && kr < KH) {
#pragma unroll
              for (int cc = 0; cc < KW; ++cc) {
                if constexpr (MODE == UT__CUDA_DWCONV2D_DW)
                  accw[kr * KW + cc] = fmaf(g[r], v[cc], accw[kr * KW + cc]);
                else
                  acc[r] = fmaf(wr[kr * KW + cc], v[cc], acc[r]);
              }
            }
          }
        }
      }
      if constexpr (MODE != UT__CUDA_DWCONV2D_DW) {
        T* yp = p.out + plane_idx * out_plane + (ut__i64)oys * p.OW + ox;
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (r < nr) ut__cuda_st(yp + (ut__i64)r * p.OW, acc[r]);
      }
    }
  }

  if constexpr (MODE == UT__CUDA_DWCONV2D_DW) {
    /* the unit's NT sums: warps, then warp partials in order -> part[unit] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      float v = ut__cuda_warp_sum(accw[i]);
      if (lane == 0) red[warp * NT + i] = v;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NT; i += blockDim.x) {
      float s = 0.f;
      for (int w = 0; w < nw; ++w) s += red[w * NT + i];
      p.part[(ut__i64)unit * NT + i] = s;
    }
  }
}

/* A persistent grid: block b takes units b, b + gridDim.x, ...; while it computes one unit
   the copy of its next unit's input is in flight (two shared buffers, cp.async). */
template <int MODE, int KH, int KW, int S, int R, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_tile_kernel(ut__cuda_dwconv2d_tile_params<T> p) {
  extern __shared__ float4 smem4[];
  T* sm = reinterpret_cast<T*>(smem4);
  float* red = reinterpret_cast<float*>(sm + 2 * p.BUF); /* BUF % 4 == 0: 16-byte aligned */
  int unit = blockIdx.x;
  if (unit >= p.units) return;
  ut__cuda_dwconv2d_tile_issue<MODE, KH, S>(p, unit, sm);
  ut__cuda_cp_async_commit();
  int buf = 0;
  for (; unit < p.units; unit += gridDim.x) {
    const int next = unit + gridDim.x;
    if (next < p.units) ut__cuda_dwconv2d_tile_issue<MODE, KH, S>(p, next, sm + (buf ^ 1) * p.BUF);
    ut__cuda_cp_async_commit();
    ut__cuda_cp_async_wait1();
    __syncthreads();
    ut__cuda_dwconv2d_tile_compute<MODE, KH, KW, S, R>(p, unit, sm + buf * p.BUF, red);
    __syncthreads(); /* before this buffer is refilled */
    buf ^= 1;
  }
}

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
     ut__cuda_dwconv2d_strip_dw_kernel
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

template <typename T>
struct ut__cuda_dwconv2d_strip_params {
  const T* in;       /* [planes, IH, IW] */
  const float* w;    /* [C, K, K] */
  const float* bias; /* [C] or NULL */
  const T* go;       /* [planes, OH, OW] (ut__cuda_dwconv2d_strip_dw_kernel) */
  T* out;            /* [planes, OH, OW] (not ut__cuda_dwconv2d_strip_dw_kernel) */
  float* part;       /* partials (ut__cuda_dwconv2d_strip_dw_kernel) */
  int C, IH, IW, OH, OW, pad;
  int NX, NS;        /* column groups per row, strips per plane */
  unsigned items;    /* all items (ut__cuda_dwconv2d_strip_forward_kernel,
                        ut__cuda_dwconv2d_strip_tdx_kernel) or one channel's items
                        (ut__cuda_dwconv2d_strip_dw_kernel) */
  unsigned chunk;    /* items per block (ut__cuda_dwconv2d_strip_dw_kernel) */
  int vec2;          /* ut__cuda_dwconv2d_strip_tdx_kernel with S == 2: rows of out are aligned
                        to two elements (8 bytes float, 4 bytes bf16) and W is even */
  ut__cuda_fastdiv fd_nx, fd_ns, fd_c;
};

template <int K, int S, int R, bool FLIP, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip_forward_kernel(ut__cuda_dwconv2d_strip_params<T> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const int ox = (int)(it - t1 * (unsigned)p.NX);
  const unsigned plane = ut__cuda_fdiv(t1, p.fd_ns);
  const int oy0 = (int)(t1 - plane * (unsigned)p.NS) * R;
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const T* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) wr[i] = __ldg(p.w + c * NT + (FLIP ? NT - 1 - i : i));
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  const int ixb = ox * S - p.pad, iyb = oy0 * S - p.pad;
  bool cv[K];
#pragma unroll
  for (int kx = 0; kx < K; ++kx) cv[kx] = (unsigned)(ixb + kx) < (unsigned)p.IW;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = bv;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int iy = iyb + j;
    const bool rv = (unsigned)iy < (unsigned)p.IH;
    const T* rp = xp + (iy * p.IW + ixb);
    float v[K];
#pragma unroll
    for (int kx = 0; kx < K; ++kx) v[kx] = (rv && cv[kx]) ? ut__cuda_dwconv2d_ldg(rp + kx) : 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int kr = j - r * S;
      if (kr >= 0 && kr < K) {
#pragma unroll
        for (int kx = 0; kx < K; ++kx) acc[r] = fmaf(wr[kr * K + kx], v[kx], acc[r]);
      }
    }
  }
  T* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (oy0 * p.OW + ox);
  const int nr = min(R, p.OH - oy0);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nr) ut__cuda_st(yp + r * p.OW, acc[r]);
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
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const int x0 = (int)(it - t1 * (unsigned)p.NX) * S;
  const unsigned plane = ut__cuda_fdiv(t1, p.fd_ns);
  const int y0 = (int)(t1 - plane * (unsigned)p.NS) * R;
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const T* __restrict__ gp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) wr[i] = __ldg(p.w + c * NT + i);
  const int gy0 = (y0 + p.pad - E) / S, gx0 = (x0 + p.pad - E) / S;
  bool cv[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) cv[m] = (unsigned)(gx0 + m) < (unsigned)p.IW;
  float acc[R][S];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < S; ++q) acc[r][q] = 0.f;
#pragma unroll
  for (int j = 0; j < JR; ++j) {
    const int gy = gy0 + j;
    const bool rv = (unsigned)gy < (unsigned)p.IH;
    const T* rp = gp + (gy * p.IW + gx0);
    float v[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) v[m] = (rv && cv[m]) ? ut__cuda_dwconv2d_ldg(rp + m) : 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int ky = E + r - j * S;
      if (ky >= 0 && ky < K) {
#pragma unroll
        for (int q = 0; q < S; ++q)
#pragma unroll
          for (int m = 0; m < MR; ++m) {
            const int kx = E + q - m * S;
            if (kx >= 0 && kx < K) acc[r][q] = fmaf(wr[ky * K + kx], v[m], acc[r][q]);
          }
      }
    }
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

/* in = x [planes, IH, IW], go [planes, OH, OW]; grid (parts, C); items of channel c are
   numbered column fastest, then strip, then image */
template <int K, int S, int R, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip_dw_kernel(ut__cuda_dwconv2d_strip_params<T> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  __shared__ float red[8 * NT];
  const int c = blockIdx.y;
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
    const int ox = (int)(it - t1 * (unsigned)p.NX);
    const unsigned n = ut__cuda_fdiv(t1, p.fd_ns);
    const int oy0 = (int)(t1 - n * (unsigned)p.NS) * R;
    const size_t plane = (size_t)n * p.C + c;
    const T* __restrict__ xp = p.in + plane * in_plane;
    const T* __restrict__ gp = p.go + plane * out_plane + (oy0 * p.OW + ox);
    const int nr = min(R, p.OH - oy0);
    float g[R];
#pragma unroll
    for (int r = 0; r < R; ++r) g[r] = r < nr ? ut__cuda_dwconv2d_ldg(gp + r * p.OW) : 0.f;
    const int ixb = ox * S - p.pad, iyb = oy0 * S - p.pad;
    bool cv[K];
#pragma unroll
    for (int kx = 0; kx < K; ++kx) cv[kx] = (unsigned)(ixb + kx) < (unsigned)p.IW;
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int iy = iyb + j;
      const bool rv = (unsigned)iy < (unsigned)p.IH;
      const T* rp = xp + (iy * p.IW + ixb);
      float v[K];
#pragma unroll
      for (int kx = 0; kx < K; ++kx) v[kx] = (rv && cv[kx]) ? ut__cuda_dwconv2d_ldg(rp + kx) : 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int kr = j - r * S;
        if (kr >= 0 && kr < K) {
#pragma unroll
          for (int kx = 0; kx < K; ++kx) accw[kr * K + kx] = fmaf(g[r], v[kx], accw[kr * K + kx]);
        }
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const float v = ut__cuda_warp_sum(accw[i]);
    if (lane == 0) red[warp * NT + i] = v;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NT; i += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += red[w * NT + i];
    p.part[((size_t)c * gridDim.x + blockIdx.x) * NT + i] = s;
  }
}

/* ---- bf16 strip kernels, two output columns per thread ----
   The float32 strip kernels are bound by load instructions, not bytes (the overlap is served
   by L1), so bf16 with one column per thread gains nothing (measured slower on an H200: each
   2-byte load costs an instruction like a 4-byte one, plus its conversion). These take an
   item of R rows x 2 columns and read each input row as aligned bf16 pairs (4-byte loads):
   with IW even and the plane 4-byte aligned, every pair lies wholly inside the row or wholly
   outside it, so one test per pair replaces the per-column bounds. The window of a pair of
   outputs, columns ixb .. ixb + S + K - 1 with ixb = 2 gx S - pad, starts PO = pad & 1
   columns after an even column. Each output's sum runs over the same rows and taps in the
   same order as in ut__cuda_dwconv2d_strip_forward_kernel, so forward and dx are the float32
   kernel's numbers rounded once; the dW kernel's partial sums are grouped differently (an
   item holds two columns), so its float32 sums may differ in the last bits. */
template <int K, int S, int PO>
struct ut__cuda_dwconv2d_strip2_window {
  static constexpr int NW = (PO + S + K + 1) / 2; /* bf16 pairs per input row */
};

/* one input row of a pair item: v[0 .. 2 NW) = columns a0 .. a0 + 2 NW, zero outside */
template <int NW>
static __device__ __forceinline__ void ut__cuda_dwconv2d_strip2_row(const ut__cuda_bf16* rowp,
                                                                    int a0, int iw, bool rv,
                                                                    float (&v)[2 * NW]) {
  const __nv_bfloat162* rp = reinterpret_cast<const __nv_bfloat162*>(rowp + a0);
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    float2 f = make_float2(0.f, 0.f);
    if (rv && (unsigned)(a0 + 2 * i) < (unsigned)iw) f = __bfloat1622float2(__ldg(rp + i));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

/* y = conv(x, w) + bias (FLIP: dx at stride 1, go correlated with the rotated filter); the
   items are numbered as in ut__cuda_dwconv2d_strip_forward_kernel with NX = ceil(OW / 2) */
template <int K, int S, int R, bool FLIP, int PO>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip2_forward_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = ut__cuda_dwconv2d_strip2_window<K, S, PO>::NW;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const int ox = 2 * (int)(it - t1 * (unsigned)p.NX);
  const unsigned plane = ut__cuda_fdiv(t1, p.fd_ns);
  const int oy0 = (int)(t1 - plane * (unsigned)p.NS) * R;
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const ut__cuda_bf16* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) wr[i] = __ldg(p.w + c * NT + (FLIP ? NT - 1 - i : i));
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  const int a0 = ox * S - p.pad - PO, iyb = oy0 * S - p.pad;
  float acc[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = bv;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int iy = iyb + j;
    float v[2 * NW];
    ut__cuda_dwconv2d_strip2_row<NW>(xp + iy * p.IW, a0, p.IW, (unsigned)iy < (unsigned)p.IH, v);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int kr = j - r * S;
      if (kr >= 0 && kr < K) {
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
          for (int kx = 0; kx < K; ++kx)
            acc[r][q] = fmaf(wr[kr * K + kx], v[PO + q * S + kx], acc[r][q]);
      }
    }
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

/* dw partials as ut__cuda_dwconv2d_strip_dw_kernel, an item being R rows x 2 columns; go is
   read in pairs too (OW even, go 4-byte aligned) */
template <int K, int S, int R, int PO>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_strip2_dw_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = ut__cuda_dwconv2d_strip2_window<K, S, PO>::NW;
  __shared__ float red[8 * NT];
  const int c = blockIdx.y;
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
    const int ox = 2 * (int)(it - t1 * (unsigned)p.NX);
    const unsigned n = ut__cuda_fdiv(t1, p.fd_ns);
    const int oy0 = (int)(t1 - n * (unsigned)p.NS) * R;
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
      ut__cuda_dwconv2d_strip2_row<NW>(xp + iy * p.IW, a0, p.IW, (unsigned)iy < (unsigned)p.IH,
                                       v);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int kr = j - r * S;
        if (kr >= 0 && kr < K) {
#pragma unroll
          for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int kx = 0; kx < K; ++kx)
              accw[kr * K + kx] = fmaf(g[r][q], v[PO + q * S + kx], accw[kr * K + kx]);
        }
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const float v = ut__cuda_warp_sum(accw[i]);
    if (lane == 0) red[warp * NT + i] = v;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NT; i += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += red[w * NT + i];
    p.part[((size_t)c * gridDim.x + blockIdx.x) * NT + i] = s;
  }
}

/* ---- bf16 wide strip kernels: CW output columns per thread from 8- and 16-byte loads ----
   The pair kernels above still issue one load instruction per two input columns. These take
   an item of R rows x CW columns (forward and dW: CW = 8 at stride 1, 4 at stride 2, so that
   an item's input window starts at the same column modulo 8; dx at stride 2: 8 dx columns)
   and read each row of the window as aligned chunks of G bf16 (G = 8: 16-byte loads of x or
   of go at stride 1; G = 4: 8-byte loads of go for dx at stride 2). With the row width a
   multiple of G and the tensor aligned to 2 G bytes, every chunk lies wholly inside the row or
   wholly outside it, so one test per chunk replaces the per-column bounds. PO, the window's
   offset in its first chunk, is a template argument. Each output's sum runs over the same
   taps in the same order as in the float32 strip kernels (forward, stride-1 dx: rows, then
   columns; stride-2 dx: go rows, then go columns, both ascending), so forward and dx stay the
   float32 numbers rounded once; dW sums group differently. Outputs are stored as CW bf16 at
   once when the output rows allow it (vec2), else one by one. */
template <int G>
struct ut__cuda_dwconv2d_chunk;
template <>
struct ut__cuda_dwconv2d_chunk<8> {
  typedef uint4 type;
};
template <>
struct ut__cuda_dwconv2d_chunk<4> {
  typedef uint2 type;
};

/* bf16 -> float is the 16 bits moved to the top: element 2i is the low half of word i */
static __device__ __forceinline__ void ut__cuda_dwconv2d_unpack(unsigned u, float* f) {
  f[0] = __uint_as_float(u << 16);
  f[1] = __uint_as_float(u & 0xffff0000u);
}
static __device__ __forceinline__ void ut__cuda_dwconv2d_unpack(const uint4& u, float* f) {
  ut__cuda_dwconv2d_unpack(u.x, f);
  ut__cuda_dwconv2d_unpack(u.y, f + 2);
  ut__cuda_dwconv2d_unpack(u.z, f + 4);
  ut__cuda_dwconv2d_unpack(u.w, f + 6);
}
static __device__ __forceinline__ void ut__cuda_dwconv2d_unpack(const uint2& u, float* f) {
  ut__cuda_dwconv2d_unpack(u.x, f);
  ut__cuda_dwconv2d_unpack(u.y, f + 2);
}

/* two floats rounded to nearest even and packed as a bf16 pair (a in the low half) */
static __device__ __forceinline__ unsigned ut__cuda_dwconv2d_pack2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return (unsigned)__bfloat16_as_ushort(h.x) | ((unsigned)__bfloat16_as_ushort(h.y) << 16);
}

/* one input row's chunks: columns a0 .. a0 + G NW (a0 a multiple of G), zero outside */
template <int G, int NW>
static __device__ __forceinline__ void ut__cuda_dwconv2d_wide_load(
    const ut__cuda_bf16* rowp, int a0, int iw, bool rv,
    typename ut__cuda_dwconv2d_chunk<G>::type (&u)[NW]) {
  typedef typename ut__cuda_dwconv2d_chunk<G>::type V;
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    u[i] = V{};
    if (rv && (unsigned)(a0 + G * i) < (unsigned)iw)
      u[i] = __ldg(reinterpret_cast<const V*>(rowp + a0 + G * i));
  }
}

/* row j of an item as floats, v[0 .. G NW): with PF from the chunks loaded before (raw[j]),
   else loaded now */
template <int G, int NW, bool PF, int RAW>
static __device__ __forceinline__ void ut__cuda_dwconv2d_wide_row(
    const typename ut__cuda_dwconv2d_chunk<G>::type (&raw)[RAW][NW], int j,
    const ut__cuda_bf16* rowp, int a0, int iw, bool rv, float (&v)[G * NW]) {
  typename ut__cuda_dwconv2d_chunk<G>::type u[NW];
  if constexpr (PF) {
#pragma unroll
    for (int i = 0; i < NW; ++i) u[i] = raw[j][i];
  } else {
    ut__cuda_dwconv2d_wide_load<G, NW>(rowp, a0, iw, rv, u);
  }
#pragma unroll
  for (int i = 0; i < NW; ++i) ut__cuda_dwconv2d_unpack(u[i], v + G * i);
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
template <int K, int S, int R, int CW, int PO, bool FLIP, bool PF>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_stripw_forward_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int G = 8;
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = (PO + (CW - 1) * S + K + G - 1) / G;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const int ox = CW * (int)(it - t1 * (unsigned)p.NX);
  const unsigned plane = ut__cuda_fdiv(t1, p.fd_ns);
  const int oy0 = (int)(t1 - plane * (unsigned)p.NS) * R;
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const ut__cuda_bf16* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) wr[i] = __ldg(p.w + c * NT + (FLIP ? NT - 1 - i : i));
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  const int a0 = ox * S - p.pad - PO, iyb = oy0 * S - p.pad;
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
    ut__cuda_dwconv2d_wide_row<G, NW, PF>(raw, j, xp + iy * p.IW, a0, p.IW,
                                          (unsigned)iy < (unsigned)p.IH, v);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int kr = j - r * S;
      if (kr >= 0 && kr < K) {
#pragma unroll
        for (int q = 0; q < CW; ++q)
#pragma unroll
          for (int kx = 0; kx < K; ++kx)
            acc[r][q] = fmaf(wr[kr * K + kx], v[PO + q * S + kx], acc[r][q]);
      }
    }
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
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const int x0 = (int)(it - t1 * (unsigned)p.NX) * CX;
  const unsigned plane = ut__cuda_fdiv(t1, p.fd_ns);
  const int y0 = (int)(t1 - plane * (unsigned)p.NS) * R;
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const ut__cuda_bf16* __restrict__ gp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  float wr[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) wr[i] = __ldg(p.w + c * NT + i);
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
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int ky = E + r - j * S;
      if (ky >= 0 && ky < K) {
#pragma unroll
        for (int q = 0; q < CX; ++q)
#pragma unroll
          for (int m = 0; m < MR; ++m) {
            const int kx = E + q - m * S;
            if (kx >= 0 && kx < K) acc[r][q] = fmaf(wr[ky * K + kx], v[PO + m], acc[r][q]);
          }
      }
    }
  }
  ut__cuda_bf16* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + (y0 * p.OW + x0);
  const int nr = min(R, p.OH - y0), nq = min(CX, p.OW - x0);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nr) ut__cuda_dwconv2d_wide_store<CX>(yp + r * p.OW, acc[r], p.vec2, nq);
}

/* dw partials as ut__cuda_dwconv2d_strip_dw_kernel, an item being R rows x CW columns (OW a
   multiple of CW); go is read as CW bf16 at once */
template <int K, int S, int R, int CW, int PO, bool PF>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_stripw_dw_kernel(ut__cuda_dwconv2d_strip_params<ut__cuda_bf16> p) {
  constexpr int G = 8;
  constexpr int NT = K * K;
  constexpr int ROWS = (R - 1) * S + K;
  constexpr int NW = (PO + (CW - 1) * S + K + G - 1) / G;
  typedef typename ut__cuda_dwconv2d_chunk<CW>::type VG;
  __shared__ float red[8 * NT];
  const int c = blockIdx.y;
  float accw[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
    const int ox = CW * (int)(it - t1 * (unsigned)p.NX);
    const unsigned n = ut__cuda_fdiv(t1, p.fd_ns);
    const int oy0 = (int)(t1 - n * (unsigned)p.NS) * R;
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
      ut__cuda_dwconv2d_wide_row<G, NW, PF>(raw, j, xp + iy * p.IW, a0, p.IW,
                                            (unsigned)iy < (unsigned)p.IH, v);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int kr = j - r * S;
        if (kr >= 0 && kr < K) {
#pragma unroll
          for (int q = 0; q < CW; ++q)
#pragma unroll
            for (int kx = 0; kx < K; ++kx)
              accw[kr * K + kx] = fmaf(g[r][q], v[PO + q * S + kx], accw[kr * K + kx]);
        }
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const float v = ut__cuda_warp_sum(accw[i]);
    if (lane == 0) red[warp * NT + i] = v;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NT; i += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += red[w * NT + i];
    p.part[((size_t)c * gridDim.x + blockIdx.x) * NT + i] = s;
  }
}

/* the bf16 pair kernels serve an input whose rows start at even columns: IW even, the
   tensor 4-byte aligned */
static bool ut__cuda_dwconv2d_strip2_fits(const ut__cuda_bf16* in, int iw) {
  return iw % 2 == 0 && (reinterpret_cast<uintptr_t>(in) & 3) == 0;
}

/* the wide bf16 kernels' shapes (their tunables and choice are further down) */
static int ut__cuda_dwconv2d_stripw_cols(int s);
static int ut__cuda_dwconv2d_stripw_po(int pad);
static bool ut__cuda_dwconv2d_stripw_po_ok(int k, int s, int po);
static bool ut__cuda_dwconv2d_stripw_in_fits(const void* in, int iw);

/* output columns per item of the dW strip kernel: 8 or 4 (ut__cuda_dwconv2d_stripw_dw_kernel)
   for bf16 when x reads in 16-byte chunks and go in whole items, else 2
   (ut__cuda_dwconv2d_strip2_dw_kernel) when x and go both read in pairs, else 1 */
static int ut__cuda_dwconv2d_strip2_dw_cols(const float*, const float*, const ut__conv_geom*) {
  return 1;
}
static int ut__cuda_dwconv2d_strip2_dw_cols(const ut__cuda_bf16* go, const ut__cuda_bf16* x,
                                            const ut__conv_geom* g) {
  const int cw = ut__cuda_dwconv2d_stripw_cols(g->stride);
  if (ut__cuda_dwconv2d_stripw_in_fits(x, g->w) &&
      ut__cuda_dwconv2d_stripw_po_ok(g->kh, g->stride, ut__cuda_dwconv2d_stripw_po(g->pad)) &&
      g->wo % cw == 0 && (reinterpret_cast<uintptr_t>(go) & (2 * cw - 1)) == 0)
    return cw;
  return ut__cuda_dwconv2d_strip2_fits(x, g->w) && ut__cuda_dwconv2d_strip2_fits(go, g->wo) ? 2
                                                                                            : 1;
}

template <int K, int S, int R, bool FLIP, int PO>
static int ut__cuda_dwconv2d_strip2_forward_launch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int threads) {
  ut__cuda_dwconv2d_strip2_forward_kernel<K, S, R, FLIP, PO>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv (bf16 strips)");
  return UT_OK;
}

template <int R, bool FLIP>
static int ut__cuda_dwconv2d_strip2_forward_dispatch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int k, int s, int threads) {
  const int po = p.pad & 1;
  switch ((k * 10 + s) * 2 + po) {
    case 62: return ut__cuda_dwconv2d_strip2_forward_launch<3, 1, R, FLIP, 0>(p, threads);
    case 63: return ut__cuda_dwconv2d_strip2_forward_launch<3, 1, R, FLIP, 1>(p, threads);
    case 102: return ut__cuda_dwconv2d_strip2_forward_launch<5, 1, R, FLIP, 0>(p, threads);
    case 103: return ut__cuda_dwconv2d_strip2_forward_launch<5, 1, R, FLIP, 1>(p, threads);
    default: break;
  }
  if constexpr (!FLIP) { /* FLIP serves dx at stride 1 only */
    switch ((k * 10 + s) * 2 + po) {
      case 64: return ut__cuda_dwconv2d_strip2_forward_launch<3, 2, R, FLIP, 0>(p, threads);
      case 65: return ut__cuda_dwconv2d_strip2_forward_launch<3, 2, R, FLIP, 1>(p, threads);
      default: break;
    }
  }
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 strip kernel for %dx%d stride %d", k, k, s);
}

template <int K, int S, int R, int PO>
static int ut__cuda_dwconv2d_strip2_dw_launch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                              int parts, int threads) {
  ut__cuda_dwconv2d_strip2_dw_kernel<K, S, R, PO>
      <<<dim3((unsigned)parts, (unsigned)p.C), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise dW (bf16 strips)");
  return UT_OK;
}

template <int R>
static int ut__cuda_dwconv2d_strip2_dw_dispatch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                                int k, int s, int parts, int threads) {
  switch ((k * 10 + s) * 2 + (p.pad & 1)) {
    case 62: return ut__cuda_dwconv2d_strip2_dw_launch<3, 1, R, 0>(p, parts, threads);
    case 63: return ut__cuda_dwconv2d_strip2_dw_launch<3, 1, R, 1>(p, parts, threads);
    case 102: return ut__cuda_dwconv2d_strip2_dw_launch<5, 1, R, 0>(p, parts, threads);
    case 103: return ut__cuda_dwconv2d_strip2_dw_launch<5, 1, R, 1>(p, parts, threads);
    case 64: return ut__cuda_dwconv2d_strip2_dw_launch<3, 2, R, 0>(p, parts, threads);
    case 65: return ut__cuda_dwconv2d_strip2_dw_launch<3, 2, R, 1>(p, parts, threads);
    default:
      return ut__set_error(UT_ERR_ARG, "dw: no bf16 strip dW kernel for %dx%d stride %d", k, k, s);
  }
}

/* tunables of the strip kernels (the self-check harness sets them; 0: automatic) and the
   choice between them and the tiled kernels: -1 automatic, 0 tiled, 1 strips */
static int ut__cuda_dwconv2d_strip_tune_impl = -1;
static int ut__cuda_dwconv2d_strip_tune_R = 0;
static int ut__cuda_dwconv2d_strip_tune_threads = 0;
/* items per thread of ut__cuda_dwconv2d_strip_dw_kernel */
static int ut__cuda_dwconv2d_strip_tune_ipt = 4;

/* The filter shapes whose strip kernels were measured faster than the tiled kernels on an
   H200 (3x3 at stride 1 and 2, 5x5 at stride 1; see CUDA_NOTES.md). 7x7 and 5x5 at stride 2
   keep the tiled kernels until they are measured. */
static bool ut__cuda_dwconv2d_strip_shape(int kh, int kw, int s) {
  return kh == kw && ((kh == 3 && (s == 1 || s == 2)) || (kh == 5 && s == 1));
}

/* Rows per strip, from the H200 measurements: the forward pass at stride 1 with at least 24
   output rows and dx at stride 1 with at least 12 rows take 8 (more reuse of each loaded row);
   strided and small planes take 4 (more items in flight). dW takes 8 at stride 2, else 4. */
static int ut__cuda_dwconv2d_strip_rows(int mode, int s, int oh) {
  if (ut__cuda_dwconv2d_strip_tune_R) return ut__cuda_dwconv2d_strip_tune_R;
  switch (mode) {
    case UT__CUDA_DWCONV2D_FWD: return (s == 1 && oh >= 24) ? 8 : 4;
    case UT__CUDA_DWCONV2D_FLIP: return oh >= 12 ? 8 : 4;
    case UT__CUDA_DWCONV2D_TDX: return 8;
    default: return s == 2 ? 8 : 4;
  }
}

static int ut__cuda_dwconv2d_strip_threads() {
  return ut__cuda_dwconv2d_strip_tune_threads ? ut__cuda_dwconv2d_strip_tune_threads : 128;
}

/* ---- the wide bf16 kernels' choice and launches ---- */

/* rows per item of the wide kernels (0: automatic; the self-check harness sets it) */
static int ut__cuda_dwconv2d_stripw_tune_R = 0;
/* items per thread of ut__cuda_dwconv2d_stripw_dw_kernel (0: automatic) */
static int ut__cuda_dwconv2d_stripw_tune_ipt = 0;

/* Rows per item and items per dW thread, from the H200 measurements (32 images of 32x112x112,
   96x112x112, 144x56x56 and 128x56x56): 4 rows at stride 1 (8 rows: 6-20% slower), 8 at
   stride 2 and for dx at stride 2; dW takes 2 items per thread at stride 1, 1 at stride 2.
   The kernels issue every load of an item before its first use (PF) at stride 1, where that
   was up to 8% faster, and load row by row at stride 2, where the longer items made PF up to
   11% slower. */
static int ut__cuda_dwconv2d_stripw_ipt(int s) {
  if (ut__cuda_dwconv2d_stripw_tune_ipt) return ut__cuda_dwconv2d_stripw_tune_ipt;
  return s == 1 ? 2 : 1;
}

static int ut__cuda_dwconv2d_stripw_rows(int mode, int s) {
  if (ut__cuda_dwconv2d_stripw_tune_R) return ut__cuda_dwconv2d_stripw_tune_R;
  switch (mode) {
    case UT__CUDA_DWCONV2D_TDX: return 8;
    default: return s == 2 ? 8 : 4;
  }
}

/* columns per item: 8 at stride 1, 4 at stride 2 (the window then starts at the same column
   modulo 8 in every item) */
static int ut__cuda_dwconv2d_stripw_cols(int s) { return s == 1 ? 8 : 4; }

/* the window's offset in its first 8-column chunk, for a padding; the instantiated ones */
static int ut__cuda_dwconv2d_stripw_po(int pad) { return ((-pad) % 8 + 8) % 8; }
static bool ut__cuda_dwconv2d_stripw_po_ok(int k, int s, int po) {
  if (k == 3 && s == 2) return po == 0 || po == 7;
  return (k == 3 || k == 5) && s == 1 && (po == 0 || po == 6 || po == 7);
}

/* an input of rows that start at multiples of 8 columns, in 16-byte aligned memory */
static bool ut__cuda_dwconv2d_stripw_in_fits(const void* in, int iw) {
  return iw % 8 == 0 && (reinterpret_cast<uintptr_t>(in) & 15) == 0;
}

template <int K, int S, int R, int CW, int PO, bool FLIP>
static int ut__cuda_dwconv2d_stripw_forward_launch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int threads) {
  ut__cuda_dwconv2d_stripw_forward_kernel<K, S, R, CW, PO, FLIP, S == 1>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv (bf16 wide strips)");
  return UT_OK;
}

template <int K, int S, int R, bool FLIP>
static int ut__cuda_dwconv2d_stripw_forward_po(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                               int po, int threads) {
  constexpr int CW = S == 1 ? 8 : 4;
  switch (po) {
    case 0: return ut__cuda_dwconv2d_stripw_forward_launch<K, S, R, CW, 0, FLIP>(p, threads);
    case 7: return ut__cuda_dwconv2d_stripw_forward_launch<K, S, R, CW, 7, FLIP>(p, threads);
    default: break;
  }
  if constexpr (S == 1)
    if (po == 6) return ut__cuda_dwconv2d_stripw_forward_launch<K, S, R, CW, 6, FLIP>(p, threads);
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip kernel for offset %d", po);
}

template <int R, bool FLIP>
static int ut__cuda_dwconv2d_stripw_forward_dispatch(
    const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p, int k, int s, int threads) {
  const int po = ut__cuda_dwconv2d_stripw_po(p.pad);
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_stripw_forward_po<3, 1, R, FLIP>(p, po, threads);
    case 51: return ut__cuda_dwconv2d_stripw_forward_po<5, 1, R, FLIP>(p, po, threads);
    default: break;
  }
  if constexpr (!FLIP) /* FLIP serves dx at stride 1 only */
    if (k * 10 + s == 32) return ut__cuda_dwconv2d_stripw_forward_po<3, 2, R, FLIP>(p, po, threads);
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip kernel for %dx%d stride %d", k, k, s);
}

/* dx at stride 2, wide: go's rows read as chunks of four (8 bytes), 8 dx columns per item */
static const int UT__CUDA_DWCONV2D_TDXW_CX = 8;

/* go's column offset in its first chunk of four, for the phase D (see the tdx kernels) */
static int ut__cuda_dwconv2d_stripw_tdx_po(int k, int pad, int d) {
  const int off = (pad - (k - 1 + d)) / 2; /* exact: pad - E is even */
  return (off % 4 + 4) % 4;
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

/* the wide dx kernel at stride 2 serves 3x3 filters and go rows that start at multiples of
   four columns in 8-byte aligned memory */
static bool ut__cuda_dwconv2d_stripw_tdx_fits(const void* go, const ut__conv_geom* g) {
  return g->kh == 3 && g->stride == 2 && g->wo % 4 == 0 &&
         (reinterpret_cast<uintptr_t>(go) & 7) == 0;
}

template <int K, int S, int R, int CW, int PO>
static int ut__cuda_dwconv2d_stripw_dw_launch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                              int parts, int threads) {
  ut__cuda_dwconv2d_stripw_dw_kernel<K, S, R, CW, PO, S == 1>
      <<<dim3((unsigned)parts, (unsigned)p.C), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise dW (bf16 wide strips)");
  return UT_OK;
}

template <int K, int S, int R>
static int ut__cuda_dwconv2d_stripw_dw_po(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                          int po, int parts, int threads) {
  constexpr int CW = S == 1 ? 8 : 4;
  switch (po) {
    case 0: return ut__cuda_dwconv2d_stripw_dw_launch<K, S, R, CW, 0>(p, parts, threads);
    case 7: return ut__cuda_dwconv2d_stripw_dw_launch<K, S, R, CW, 7>(p, parts, threads);
    default: break;
  }
  if constexpr (S == 1)
    if (po == 6) return ut__cuda_dwconv2d_stripw_dw_launch<K, S, R, CW, 6>(p, parts, threads);
  return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip dW kernel for offset %d", po);
}

template <int R>
static int ut__cuda_dwconv2d_stripw_dw_dispatch(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                                int k, int s, int parts, int threads) {
  const int po = ut__cuda_dwconv2d_stripw_po(p.pad);
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_stripw_dw_po<3, 1, R>(p, po, parts, threads);
    case 51: return ut__cuda_dwconv2d_stripw_dw_po<5, 1, R>(p, po, parts, threads);
    case 32: return ut__cuda_dwconv2d_stripw_dw_po<3, 2, R>(p, po, parts, threads);
    default:
      return ut__set_error(UT_ERR_ARG, "dw: no bf16 wide strip dW kernel for %dx%d stride %d", k,
                           k, s);
  }
}

template <int K, int S, int R, bool FLIP, typename T>
static int ut__cuda_dwconv2d_strip_forward_launch(ut__cuda_dwconv2d_strip_params<T> p,
                                                  int threads) {
  ut__cuda_dwconv2d_strip_forward_kernel<K, S, R, FLIP, T>
      <<<(unsigned)ut__cuda_cdiv(p.items, threads), threads, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv (strips)");
  return UT_OK;
}

template <int R, bool FLIP, typename T>
static int ut__cuda_dwconv2d_strip_forward_dispatch(const ut__cuda_dwconv2d_strip_params<T>& p,
                                                    int k, int s, int threads) {
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_strip_forward_launch<3, 1, R, FLIP>(p, threads);
    case 51: return ut__cuda_dwconv2d_strip_forward_launch<5, 1, R, FLIP>(p, threads);
    default: break;
  }
  if constexpr (!FLIP) { /* FLIP serves dx at stride 1 only */
    if (k * 10 + s == 32) return ut__cuda_dwconv2d_strip_forward_launch<3, 2, R, FLIP>(p, threads);
  }
  return ut__set_error(UT_ERR_ARG, "dw: no strip kernel for %dx%d stride %d", k, k, s);
}

/* y = conv(in, w) (+ bias) over [planes, ih, iw] -> [planes, oh, ow] with the strip kernel;
   false when the sizes do not fit its 32-bit item numbering */
static bool ut__cuda_dwconv2d_strip_fits(ut__i64 planes, int ih, int iw, int oh, int ow) {
  const ut__i64 lim = 0x7fffffffLL;
  const int rows = oh > ih ? oh : ih, cols = ow > iw ? ow : iw; /* dx swaps the roles */
  return planes * ut__cuda_cdiv(rows, 4) * cols < lim && planes < lim &&
         (ut__i64)(ih + 16) * (iw + 16) < lim && (ut__i64)(oh + 16) * (ow + 16) < lim;
}

/* true: the strip kernels serve this call (mode UT__CUDA_DWCONV2D_FWD, UT__CUDA_DWCONV2D_FLIP,
   UT__CUDA_DWCONV2D_TDX or UT__CUDA_DWCONV2D_DW) */
static bool ut__cuda_dwconv2d_strip_pick(int mode, const ut__conv_geom* g) {
  if (ut__cuda_dwconv2d_strip_tune_impl == 0 ||
      !ut__cuda_dwconv2d_strip_shape(g->kh, g->kw, g->stride))
    return false;
  if (mode == UT__CUDA_DWCONV2D_TDX && g->stride != 2) return false;
  if (!ut__cuda_dwconv2d_strip_fits((ut__i64)g->n * g->c, g->h, g->w, g->ho, g->wo)) return false;
  return true;
}

template <typename T>
static int ut__cuda_dwconv2d_strip_forward_run(const T* in, const float* w, const float* bias,
                                               T* out, int n, int c, int ih, int iw, int oh,
                                               int ow, int k, int s, int pad, bool flip) {
  const int R =
      ut__cuda_dwconv2d_strip_rows(flip ? UT__CUDA_DWCONV2D_FLIP : UT__CUDA_DWCONV2D_FWD, s, oh);
  const int threads = ut__cuda_dwconv2d_strip_threads();
  ut__cuda_dwconv2d_strip_params<T> p = {};
  p.in = in; p.w = w; p.bias = bias; p.out = out;
  p.C = c; p.IH = ih; p.IW = iw; p.OH = oh; p.OW = ow; p.pad = pad;
  if constexpr (sizeof(T) == 2) {
    if (ut__cuda_dwconv2d_stripw_in_fits(in, iw) &&
        ut__cuda_dwconv2d_stripw_po_ok(k, s, ut__cuda_dwconv2d_stripw_po(pad))) {
      /* CW columns per item from 16-byte loads */
      const int RW =
          ut__cuda_dwconv2d_stripw_rows(flip ? UT__CUDA_DWCONV2D_FLIP : UT__CUDA_DWCONV2D_FWD, s);
      const int cw = ut__cuda_dwconv2d_stripw_cols(s);
      p.NX = (int)ut__cuda_cdiv(ow, cw); p.NS = (int)ut__cuda_cdiv(oh, RW);
      p.items = (unsigned)((ut__i64)n * c * p.NS * p.NX);
      p.vec2 = ow % cw == 0 && (reinterpret_cast<uintptr_t>(out) & (2 * cw - 1)) == 0;
      p.fd_nx = ut__cuda_fastdiv_make((unsigned)p.NX);
      p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
      p.fd_c = ut__cuda_fastdiv_make((unsigned)c);
      if (RW == 4)
        return flip ? ut__cuda_dwconv2d_stripw_forward_dispatch<4, true>(p, k, s, threads)
                    : ut__cuda_dwconv2d_stripw_forward_dispatch<4, false>(p, k, s, threads);
      return flip ? ut__cuda_dwconv2d_stripw_forward_dispatch<8, true>(p, k, s, threads)
                  : ut__cuda_dwconv2d_stripw_forward_dispatch<8, false>(p, k, s, threads);
    }
    if (ut__cuda_dwconv2d_strip2_fits(in, iw)) { /* two columns per item */
      p.NX = (int)ut__cuda_cdiv(ow, 2); p.NS = (int)ut__cuda_cdiv(oh, R);
      p.items = (unsigned)((ut__i64)n * c * p.NS * p.NX);
      p.vec2 = ow % 2 == 0 && (reinterpret_cast<uintptr_t>(out) & 3) == 0;
      p.fd_nx = ut__cuda_fastdiv_make((unsigned)p.NX);
      p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
      p.fd_c = ut__cuda_fastdiv_make((unsigned)c);
      if (R == 4)
        return flip ? ut__cuda_dwconv2d_strip2_forward_dispatch<4, true>(p, k, s, threads)
                    : ut__cuda_dwconv2d_strip2_forward_dispatch<4, false>(p, k, s, threads);
      return flip ? ut__cuda_dwconv2d_strip2_forward_dispatch<8, true>(p, k, s, threads)
                  : ut__cuda_dwconv2d_strip2_forward_dispatch<8, false>(p, k, s, threads);
    }
  }
  p.NX = ow; p.NS = (int)ut__cuda_cdiv(oh, R);
  p.items = (unsigned)((ut__i64)n * c * p.NS * ow);
  p.fd_nx = ut__cuda_fastdiv_make((unsigned)p.NX);
  p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
  p.fd_c = ut__cuda_fastdiv_make((unsigned)c);
  if (R == 4)
    return flip ? ut__cuda_dwconv2d_strip_forward_dispatch<4, true>(p, k, s, threads)
                : ut__cuda_dwconv2d_strip_forward_dispatch<4, false>(p, k, s, threads);
  return flip ? ut__cuda_dwconv2d_strip_forward_dispatch<8, true>(p, k, s, threads)
              : ut__cuda_dwconv2d_strip_forward_dispatch<8, false>(p, k, s, threads);
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

/* dx at stride 2 from go [n*c, ho, wo] into dx [n*c, h, w] */
template <typename T>
static int ut__cuda_dwconv2d_strip_tdx_run(const T* go, const float* w, T* dx,
                                           const ut__conv_geom* g) {
  const int R = ut__cuda_dwconv2d_strip_rows(UT__CUDA_DWCONV2D_TDX, 2, g->h);
  const int threads = ut__cuda_dwconv2d_strip_threads();
  ut__cuda_dwconv2d_strip_params<T> p = {};
  p.in = go; p.w = w; p.out = dx;
  p.C = g->c; p.IH = g->ho; p.IW = g->wo; p.OH = g->h; p.OW = g->w; p.pad = g->pad;
  const int d = ((g->pad - g->kh + 1) % 2 + 2) % 2;
  if constexpr (sizeof(T) == 2) {
    if (ut__cuda_dwconv2d_stripw_tdx_fits(go, g)) { /* 8 dx columns per item, 8-byte loads */
      const int RW = ut__cuda_dwconv2d_stripw_rows(UT__CUDA_DWCONV2D_TDX, 2);
      const int cx = UT__CUDA_DWCONV2D_TDXW_CX;
      p.NX = (int)ut__cuda_cdiv(g->w, cx); p.NS = (int)ut__cuda_cdiv(g->h, RW);
      p.items = (unsigned)((ut__i64)g->n * g->c * p.NS * p.NX);
      p.vec2 = g->w % cx == 0 && (reinterpret_cast<uintptr_t>(dx) & (2 * cx - 1)) == 0;
      p.fd_nx = ut__cuda_fastdiv_make((unsigned)p.NX);
      p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
      p.fd_c = ut__cuda_fastdiv_make((unsigned)g->c);
      const int po = ut__cuda_dwconv2d_stripw_tdx_po(g->kh, g->pad, d);
      if (RW == 4) return ut__cuda_dwconv2d_stripw_tdx_dispatch<4>(p, d, po, threads);
      return ut__cuda_dwconv2d_stripw_tdx_dispatch<8>(p, d, po, threads);
    }
  }
  p.NX = (int)ut__cuda_cdiv(g->w, 2); p.NS = (int)ut__cuda_cdiv(g->h, R);
  p.items = (unsigned)((ut__i64)g->n * g->c * p.NS * p.NX);
  p.vec2 = (g->w % 2 == 0) && ((reinterpret_cast<uintptr_t>(dx) & (2 * sizeof(T) - 1)) == 0);
  p.fd_nx = ut__cuda_fastdiv_make((unsigned)p.NX);
  p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
  p.fd_c = ut__cuda_fastdiv_make((unsigned)g->c);
  if (R == 4) return ut__cuda_dwconv2d_strip_tdx_dispatch<4>(p, g->kh, d, threads);
  return ut__cuda_dwconv2d_strip_tdx_dispatch<8>(p, g->kh, d, threads);
}

template <int K, int S, int R, typename T>
static int ut__cuda_dwconv2d_strip_dw_launch(ut__cuda_dwconv2d_strip_params<T> p, int parts,
                                             int threads) {
  ut__cuda_dwconv2d_strip_dw_kernel<K, S, R, T>
      <<<dim3((unsigned)parts, (unsigned)p.C), threads, 0, ut__cuda_stream>>>(
      p);
  UT__CUDA_LAUNCHED("depthwise dW (strips)");
  return UT_OK;
}

template <int R, typename T>
static int ut__cuda_dwconv2d_strip_dw_dispatch(const ut__cuda_dwconv2d_strip_params<T>& p, int k,
                                               int s, int parts, int threads) {
  switch (k * 10 + s) {
    case 31: return ut__cuda_dwconv2d_strip_dw_launch<3, 1, R>(p, parts, threads);
    case 51: return ut__cuda_dwconv2d_strip_dw_launch<5, 1, R>(p, parts, threads);
    case 32: return ut__cuda_dwconv2d_strip_dw_launch<3, 2, R>(p, parts, threads);
    default:
      return ut__set_error(UT_ERR_ARG, "dw: no strip dW kernel for %dx%d stride %d", k, k, s);
  }
}

/* parts of one channel's items for ut__cuda_dwconv2d_strip_dw_kernel */
/* (cols: output columns per item, 2 for ut__cuda_dwconv2d_strip2_dw_kernel) */
static int ut__cuda_dwconv2d_strip_dw_parts(const ut__conv_geom* g, int cols, unsigned* items,
                                            unsigned* chunk) {
  const int R = cols > 2 ? ut__cuda_dwconv2d_stripw_rows(UT__CUDA_DWCONV2D_DW, g->stride)
                         : ut__cuda_dwconv2d_strip_rows(UT__CUDA_DWCONV2D_DW, g->stride, g->ho);
  const int threads = ut__cuda_dwconv2d_strip_threads();
  const ut__i64 per_ch = (ut__i64)g->n * ut__cuda_cdiv(g->ho, R) * ut__cuda_cdiv(g->wo, cols);
  /* an item of two columns is twice the work: half as many per block keeps the float32 kernel's
     number of blocks (measured: 0.90x of float32 on 32x144x56x56 stride 2 without this) */
  ut__i64 ch = cols > 2 ? (ut__i64)threads * ut__cuda_dwconv2d_stripw_ipt(g->stride)
                        : (ut__i64)threads * ut__cuda_dwconv2d_strip_tune_ipt / cols;
  if (ch < threads) ch = threads;
  *items = (unsigned)per_ch;
  *chunk = (unsigned)ch;
  return (int)ut__cuda_cdiv(per_ch, ch);
}

template <typename T>
static int ut__cuda_dwconv2d_strip_dw_run(const T* go, const T* x, float* ws,
                                          const ut__conv_geom* g) {
  const int cols = ut__cuda_dwconv2d_strip2_dw_cols(go, x, g);
  const int R = cols > 2 ? ut__cuda_dwconv2d_stripw_rows(UT__CUDA_DWCONV2D_DW, g->stride)
                         : ut__cuda_dwconv2d_strip_rows(UT__CUDA_DWCONV2D_DW, g->stride, g->ho);
  const int threads = ut__cuda_dwconv2d_strip_threads();
  ut__cuda_dwconv2d_strip_params<T> p = {};
  p.in = x; p.go = go; p.part = ws;
  p.C = g->c; p.IH = g->h; p.IW = g->w; p.OH = g->ho; p.OW = g->wo; p.pad = g->pad;
  p.NX = (int)ut__cuda_cdiv(g->wo, cols); p.NS = (int)ut__cuda_cdiv(g->ho, R);
  const int parts = ut__cuda_dwconv2d_strip_dw_parts(g, cols, &p.items, &p.chunk);
  p.fd_nx = ut__cuda_fastdiv_make((unsigned)p.NX);
  p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
  p.fd_c = ut__cuda_fastdiv_make((unsigned)g->c);
  if constexpr (sizeof(T) == 2) {
    if (cols > 2) {
      if (R == 4)
        return ut__cuda_dwconv2d_stripw_dw_dispatch<4>(p, g->kh, g->stride, parts, threads);
      return ut__cuda_dwconv2d_stripw_dw_dispatch<8>(p, g->kh, g->stride, parts, threads);
    }
    if (cols == 2) {
      if (R == 4)
        return ut__cuda_dwconv2d_strip2_dw_dispatch<4>(p, g->kh, g->stride, parts, threads);
      return ut__cuda_dwconv2d_strip2_dw_dispatch<8>(p, g->kh, g->stride, parts, threads);
    }
  }
  if (R == 4) return ut__cuda_dwconv2d_strip_dw_dispatch<4>(p, g->kh, g->stride, parts, threads);
  return ut__cuda_dwconv2d_strip_dw_dispatch<8>(p, g->kh, g->stride, parts, threads);
}

/* tunables (the self-check harness sweeps them) */
static int ut__cuda_dwconv2d_tile_tune_tin = 4096; /* input floats per unit to aim for */
static int ut__cuda_dwconv2d_tile_tune_threads = 128;
static const int UT__CUDA_DWCONV2D_TILE_R = 4; /* outputs per strip */
static const size_t UT__CUDA_DWCONV2D_TILE_SMEM_MAX = 96 * 1024;

struct ut__cuda_dwconv2d_tile_plan {
  int P, NG, BH, NB, NS, SQ, threads;
  size_t smem;
  ut__i64 units;
};

static bool ut__cuda_dwconv2d_tile_plan_tin(int mode, int N, int C, int IH, int IW, int OH, int OW,
                                            int KH, int S, int T, int tin,
                                            ut__cuda_dwconv2d_tile_plan* pl) {
  const int R = UT__CUDA_DWCONV2D_TILE_R;
  const ut__i64 plane_in = (ut__i64)IH * IW;
  if (plane_in * 2 > tin || N == 1) {
    pl->P = 1;
    pl->NG = N;
    int rows_in = tin / IW;
    if (rows_in < 1) rows_in = 1;
    int bh;
    if (mode == UT__CUDA_DWCONV2D_TDX) bh = rows_in > 2 ? (rows_in - 2) * S + 1 : 1;
    else bh = rows_in >= KH ? (rows_in - KH) / S + 1 : 1;
    if (bh > R) bh = (int)ut__cuda_cdiv(bh, R) * R;
    if (bh > OH) bh = OH;
    int nb = (int)ut__cuda_cdiv(OH, bh);
    bh = (int)ut__cuda_cdiv(OH, nb);
    if (bh > R) bh = (int)ut__cuda_cdiv(bh, R) * R;
    pl->BH = bh;
    pl->NB = (int)ut__cuda_cdiv(OH, bh);
  } else {
    int pmax = (int)(tin / plane_in);
    if (pmax > N) pmax = N;
    if (pmax < 1) pmax = 1;
    pl->NG = (int)ut__cuda_cdiv(N, pmax);
    pl->P = (int)ut__cuda_cdiv(N, pl->NG);
    pl->BH = OH;
    pl->NB = 1;
  }
  pl->NS = (int)ut__cuda_cdiv(pl->BH, R);
  ut__i64 rows = mode == UT__CUDA_DWCONV2D_TDX ? (ut__i64)(pl->BH + KH - 2) / S + 2
                                               : (ut__i64)(pl->BH - 1) * S + KH;
  if (rows > IH) rows = IH;
  ut__i64 lmax = rows * IW;
  pl->SQ = (int)(ut__cuda_cdiv(lmax + 6, 4) * 4);
  ut__i64 items = (ut__i64)pl->P * pl->NS * OW;
  ut__i64 th = ut__cuda_cdiv(items, 32) * 32;
  if (th > ut__cuda_dwconv2d_tile_tune_threads) th = ut__cuda_dwconv2d_tile_tune_threads;
  if (th < 32) th = 32;
  pl->threads = (int)th;
  /* float buffers: bf16 needs half of them, but takes the plan that float would (the same
     kernel on the same geometry; ut__cuda_dwconv2d_tile_launch asks for what it uses) */
  pl->smem = (2 * (size_t)pl->P * pl->SQ + (size_t)(th / 32) * T) * sizeof(float);
  pl->units = (ut__i64)C * pl->NG * pl->NB;
  return pl->smem <= UT__CUDA_DWCONV2D_TILE_SMEM_MAX && pl->units < 0x7fffffff &&
         items < 0x7fffffff;
}

/* Plans the units of ut__cuda_dwconv2d_tile_kernel (false: no plan fits in shared memory). Units
   shrink until there are enough of them to spread over the multiprocessors. */
static bool ut__cuda_dwconv2d_tile_plan_for(int mode, int N, int C, int IH, int IW, int OH, int OW,
                                            int KH, int S, int T, ut__cuda_dwconv2d_tile_plan* pl) {
  int tin = ut__cuda_dwconv2d_tile_tune_tin;
  if (!ut__cuda_dwconv2d_tile_plan_tin(mode, N, C, IH, IW, OH, OW, KH, S, T, tin, pl)) return false;
  while (pl->units < (ut__i64)ut__cuda_sms * 12 && tin > 1024) {
    ut__cuda_dwconv2d_tile_plan q;
    tin /= 2;
    if (ut__cuda_dwconv2d_tile_plan_tin(mode, N, C, IH, IW, OH, OW, KH, S, T, tin, &q) &&
        q.units > pl->units)
      *pl = q;
  }
  return true;
}

template <int MODE, int K, int S, typename T>
static int ut__cuda_dwconv2d_tile_launch(ut__cuda_dwconv2d_tile_params<T> p,
                                         const ut__cuda_dwconv2d_tile_plan& pl) {
  auto kern = ut__cuda_dwconv2d_tile_kernel<MODE, K, K, S, UT__CUDA_DWCONV2D_TILE_R, T>;
  /* the plan counts float buffers; bf16 ones are half as large */
  const size_t smem = pl.smem - 2 * (size_t)pl.P * pl.SQ * (sizeof(float) - sizeof(T));
  static std::once_flag once;
  static cudaError_t attr_err = cudaSuccess;
  std::call_once(once, [&] {
    attr_err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)UT__CUDA_DWCONV2D_TILE_SMEM_MAX);
  });
  UT__CUDA_CHECK(attr_err, "depthwise conv: shared memory limit");
  int per_sm = 0;
  UT__CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, pl.threads, smem),
                 "depthwise conv: occupancy");
  if (per_sm < 1) per_sm = 1;
  ut__i64 grid = (ut__i64)per_sm * ut__cuda_sms;
  if (grid > pl.units) grid = pl.units;
  p.P = pl.P; p.NG = pl.NG; p.BH = pl.BH; p.NB = pl.NB; p.NS = pl.NS; p.SQ = pl.SQ;
  p.BUF = pl.P * pl.SQ;
  p.units = (int)pl.units;
  p.fd_ow = ut__cuda_fastdiv_make((unsigned)p.OW);
  p.fd_ns = ut__cuda_fastdiv_make((unsigned)p.NS);
  kern<<<(unsigned)grid, pl.threads, smem, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("depthwise conv");
  return UT_OK;
}

/* the filter shapes with a tiled kernel */
static bool ut__cuda_dwconv2d_tile_shape(int kh, int kw, int s) {
  return kh == kw && (kh == 3 || kh == 5 || kh == 7) && (s == 1 || s == 2);
}

template <int MODE, typename T>
static int ut__cuda_dwconv2d_tile_dispatch(const ut__cuda_dwconv2d_tile_params<T>& p,
                                           const ut__cuda_dwconv2d_tile_plan& pl, int k, int s) {
  if constexpr (MODE != UT__CUDA_DWCONV2D_TDX) {
    switch (k * 10 + s) {
      case 31: return ut__cuda_dwconv2d_tile_launch<MODE, 3, 1>(p, pl);
      case 51: return ut__cuda_dwconv2d_tile_launch<MODE, 5, 1>(p, pl);
      case 71: return ut__cuda_dwconv2d_tile_launch<MODE, 7, 1>(p, pl);
      default: break;
    }
  }
  /* the rotated filter serves stride 1, TDX the rest */
  if constexpr (MODE != UT__CUDA_DWCONV2D_FLIP) {
    switch (k * 10 + s) {
      case 32: return ut__cuda_dwconv2d_tile_launch<MODE, 3, 2>(p, pl);
      case 52: return ut__cuda_dwconv2d_tile_launch<MODE, 5, 2>(p, pl);
      case 72: return ut__cuda_dwconv2d_tile_launch<MODE, 7, 2>(p, pl);
      default: break;
    }
  }
  return ut__set_error(UT_ERR_ARG, "dw: no tiled kernel for %dx%d stride %d", k, k, s);
}

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
                                                                 ut__i64 pl, int c, int oy, int ox) {
  const T* xp = x + pl * g.h * (ut__i64)g.w;
  const float* wp = w + (ut__i64)c * g.kh * g.kw;
  float s = bias ? bias[c] : 0.f;
  for (int ky = 0; ky < g.kh; ++ky) {
    int iy = oy * g.stride - g.pad + ky * g.dil;
    if (iy < 0 || iy >= g.h) continue;
    for (int kx = 0; kx < g.kw; ++kx) {
      int ix = ox * g.stride - g.pad + kx * g.dil;
      if (ix < 0 || ix >= g.w) continue;
      s = fmaf(wp[ky * g.kw + kx], ut__cuda_dwconv2d_ldg(xp + (ut__i64)iy * g.w + ix), s);
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

/* one tap's dW over outputs [e0, e1) of channel c (output e is image e / (ho*wo), position
   e % (ho*wo)), strided by `step` from e0 + first: real input only */
template <typename T>
static __device__ __forceinline__ float ut__cuda_dwconv2d_plain_dw(const T* __restrict__ go,
                                                                  const T* __restrict__ x,
                                                                  const ut__conv_geom& g, int c,
                                                                  int ky, int kx, ut__i64 e,
                                                                  ut__i64 e1, int step) {
  const ut__i64 hw = (ut__i64)g.ho * g.wo;
  float s = 0.f;
  for (; e < e1; e += step) {
    ut__i64 ni = e / hw;
    int pos = (int)(e - ni * hw);
    int oy = pos / g.wo, ox = pos % g.wo;
    int iy = oy * g.stride - g.pad + ky * g.dil, ix = ox * g.stride - g.pad + kx * g.dil;
    if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
    ut__i64 pl = ni * g.c + c;
    s += ut__cuda_dwconv2d_ldg(go + pl * hw + pos) *
         ut__cuda_dwconv2d_ldg(x + (pl * g.h + iy) * (ut__i64)g.w + ix);
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
                                                      T* __restrict__ out, ut__conv_geom g) {
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
                   : ut__cuda_dwconv2d_plain_y(in, w, bias, g, pl, c, pos / ow, pos % ow);
      ut__cuda_st(out + pl * hw + pos, v);
    }
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
                                                         ut__conv_geom g) {
  const ut__i64 gw = ((ut__i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= (ut__i64)C * NT) return;
  const int c = (int)(gw / NT), t = (int)(gw % NT);
  float s = 0.f;
  for (int i = lane; i < parts; i += 32) s += ws[((ut__i64)c * parts + i) * NT + t];
  s = ut__cuda_warp_sum(s);
  if (go && !isfinite(s)) /* the whole warp: s is the same in every lane */
    s = ut__cuda_warp_sum(ut__cuda_dwconv2d_plain_dw(go, x, g, c, t / g.kw, t % g.kw, lane,
                                                     (ut__i64)g.n * g.ho * g.wo, 32));
  if (lane == 0) dw[gw] += s;
}

/* The plain kernels over the whole output (forward) or input (dx): any geometry, dilation
   included. */
template <typename T>
static int ut__cuda_dwconv2d_direct_forward_run(const T* x, const float* w, const float* bias,
                                                T* y, const ut__conv_geom* g) {
  ut__i64 total = (ut__i64)g->n * g->c * g->ho * g->wo;
  ut__cuda_dwconv2d_direct_forward_kernel
      <<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(x, w, bias, y, *g, total);
  UT__CUDA_LAUNCHED("dw_fwd");
  return UT_OK;
}
template <typename T>
static int ut__cuda_dwconv2d_direct_dx_run(const T* go, const float* w, T* dx,
                                           const ut__conv_geom* g) {
  ut__i64 total = (ut__i64)g->n * g->c * g->h * g->w;
  ut__cuda_dwconv2d_direct_dx_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      go, w, dx, *g, total);
  UT__CUDA_LAUNCHED("dw_bwd_dx");
  return UT_OK;
}
/* the rerun after a fast kernel (see above): about 16 blocks per SM in all when every
   weight is finite, as many per channel as fill the device when one is not */
template <typename T, bool DX>
static int ut__cuda_dwconv2d_exact_run(const T* in, const float* w, const float* bias, T* out,
                                       const ut__conv_geom* g) {
  const ut__i64 m = (ut__i64)g->n * (DX ? (ut__i64)g->h * g->w : (ut__i64)g->ho * g->wo);
  const int cy = g->c < 65535 ? g->c : 65535;
  ut__i64 qx = ut__cuda_cdiv((ut__i64)ut__cuda_sms * 16, cy);
  ut__i64 need = ut__cuda_cdiv(m, 256);
  if (qx > need) qx = need;
  if (qx < 1) qx = 1;
  ut__cuda_dwconv2d_exact_kernel<T, DX>
      <<<dim3((unsigned)qx, (unsigned)cy), 256, 0, ut__cuda_stream>>>(in, w, bias, out, *g);
  UT__CUDA_LAUNCHED(DX ? "dw_bwd_dx exact" : "dw_fwd exact");
  return UT_OK;
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

template <typename T>
static void ut__cuda_dwconv2d_tile_params_set(ut__cuda_dwconv2d_tile_params<T>* p, const T* in,
                                              const float* w, const float* bias, const T* go,
                                              T* out, float* part, int n, int c, int ih, int iw,
                                              int oh, int ow, int pad_h, int pad_w) {
  p->in = in; p->w = w; p->bias = bias; p->go = go; p->out = out; p->part = part;
  p->N = n; p->C = c; p->IH = ih; p->IW = iw; p->OH = oh; p->OW = ow;
  p->pad_h = pad_h; p->pad_w = pad_w;
}

/* dx when no output reads it: zeros (bf16 zero is all-zero bits, but the fill keeps to the
   backend's own op) */
static int ut__cuda_dwconv2d_zero(float* x, ut__i64 n) { return ut__cuda_fill(x, n, 0.f); }
static int ut__cuda_dwconv2d_zero(ut__cuda_bf16* x, ut__i64 n) {
  return ut__cuda_fill_bf16(x, n, 0.f);
}

/* The fastest kernel for the geometry; *exact tells whether that was the plain kernel, which
   sums real input only (then a non-finite weight needs no second pass). */
template <typename T>
static int ut__cuda_dwconv2d_forward_fast(const T* x, const float* w, const float* bias, T* y,
                                          const ut__conv_geom* g, bool* exact) {
  ut__i64 total = (ut__i64)g->n * g->c * g->ho * g->wo;
  *exact = false;
  if (total <= 0) return UT_OK;
  *exact = true;
  if (g->dil > 1) return ut__cuda_dwconv2d_direct_forward_run(x, w, bias, y, g);
  *exact = false;
  if (ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_FWD, g))
    return ut__cuda_dwconv2d_strip_forward_run(x, w, bias, y, g->n, g->c, g->h, g->w, g->ho, g->wo,
                                               g->kh, g->stride, g->pad, false);
  ut__cuda_dwconv2d_tile_plan pl;
  if (ut__cuda_dwconv2d_tile_shape(g->kh, g->kw, g->stride) &&
      ut__cuda_dwconv2d_tile_plan_for(UT__CUDA_DWCONV2D_FWD, g->n, g->c, g->h, g->w, g->ho, g->wo,
                                      g->kh, g->stride, g->kh * g->kw, &pl)) {
    ut__cuda_dwconv2d_tile_params<T> p;
    ut__cuda_dwconv2d_tile_params_set<T>(&p, x, w, bias, NULL, y, NULL, g->n, g->c, g->h, g->w,
                                         g->ho, g->wo, g->pad, g->pad);
    return ut__cuda_dwconv2d_tile_dispatch<UT__CUDA_DWCONV2D_FWD>(p, pl, g->kh, g->stride);
  }
  *exact = true;
  return ut__cuda_dwconv2d_direct_forward_run(x, w, bias, y, g);
}

template <typename T>
static int ut__cuda_dwconv2d_backward_dx_fast(const T* go, const float* w, T* dx,
                                              const ut__conv_geom* g, bool* exact) {
  ut__i64 total = (ut__i64)g->n * g->c * g->h * g->w;
  *exact = true; /* nothing multiplied, or the plain kernel */
  if (total <= 0) return UT_OK;
  if (g->ho <= 0 || g->wo <= 0) return ut__cuda_dwconv2d_zero(dx, total);
  if (g->dil > 1) return ut__cuda_dwconv2d_direct_dx_run(go, w, dx, g);
  *exact = false;
  /* stride 1: go correlated with the rotated filter */
  if (g->stride == 1 && ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_FLIP, g))
    return ut__cuda_dwconv2d_strip_forward_run(go, w, NULL, dx, g->n, g->c, g->ho, g->wo, g->h,
                                               g->w, g->kh, 1, g->kh - 1 - g->pad, true);
  if (g->stride == 2 && ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_TDX, g))
    return ut__cuda_dwconv2d_strip_tdx_run(go, w, dx, g);
  ut__cuda_dwconv2d_tile_plan pl;
  if (ut__cuda_dwconv2d_tile_shape(g->kh, g->kw, g->stride) && g->stride == 1 &&
      ut__cuda_dwconv2d_tile_plan_for(UT__CUDA_DWCONV2D_FLIP, g->n, g->c, g->ho, g->wo, g->h, g->w,
                                      g->kh, 1, g->kh * g->kw, &pl)) {
    /* stride 1: dx = go correlated with the rotated filter, padding kh-1-pad */
    ut__cuda_dwconv2d_tile_params<T> p;
    ut__cuda_dwconv2d_tile_params_set<T>(&p, go, w, NULL, NULL, dx, NULL, g->n, g->c, g->ho,
                                         g->wo, g->h, g->w, g->kh - 1 - g->pad,
                                         g->kw - 1 - g->pad);
    return ut__cuda_dwconv2d_tile_dispatch<UT__CUDA_DWCONV2D_FLIP>(p, pl, g->kh, 1);
  }
  if (ut__cuda_dwconv2d_tile_shape(g->kh, g->kw, g->stride) && g->stride > 1 &&
      ut__cuda_dwconv2d_tile_plan_for(UT__CUDA_DWCONV2D_TDX, g->n, g->c, g->ho, g->wo, g->h, g->w,
                                      g->kh, g->stride, g->kh * g->kw, &pl)) {
    /* larger strides: the transposed convolution, gathering from go's tile */
    ut__cuda_dwconv2d_tile_params<T> p;
    ut__cuda_dwconv2d_tile_params_set<T>(&p, go, w, NULL, NULL, dx, NULL, g->n, g->c, g->ho,
                                         g->wo, g->h, g->w, g->pad, g->pad);
    return ut__cuda_dwconv2d_tile_dispatch<UT__CUDA_DWCONV2D_TDX>(p, pl, g->kh, g->stride);
  }
  *exact = true;
  return ut__cuda_dwconv2d_direct_dx_run(go, w, dx, g);
}

template <typename T>
static int ut__cuda_dwconv2d_backward_dw_run(const T* go, const T* x, float* dw,
                                             const ut__conv_geom* g) {
  const int NT = g->kh * g->kw;
  if ((ut__i64)g->c * NT <= 0) return UT_OK;
  if ((ut__i64)g->n * g->ho * g->wo <= 0) return UT_OK; /* nothing to add */
  ut__cuda_dwconv2d_tile_plan pl;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  int st;
  float* ws;
  int parts;
  bool plain = false; /* the plain kernel ran: real input only, its sums need no check */
  if (g->dil == 1 && ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_DW, g)) {
    unsigned items, chunk;
    parts = ut__cuda_dwconv2d_strip_dw_parts(g, ut__cuda_dwconv2d_strip2_dw_cols(go, x, g), &items,
                                             &chunk);
    st = ut__cuda_workspace_acquire((size_t)g->c * parts * NT * sizeof(float), &ws);
    if (st) return st;
    st = ut__cuda_dwconv2d_strip_dw_run(go, x, ws, g);
    if (st) return st;
  } else if (g->dil == 1 && ut__cuda_dwconv2d_tile_shape(g->kh, g->kw, g->stride) &&
             ut__cuda_dwconv2d_tile_plan_for(UT__CUDA_DWCONV2D_DW, g->n, g->c, g->h, g->w, g->ho,
                                             g->wo, g->kh, g->stride, NT, &pl)) {
    parts = pl.NG * pl.NB;
    st = ut__cuda_workspace_acquire((size_t)pl.units * NT * sizeof(float), &ws);
    if (st) return st;
    ut__cuda_dwconv2d_tile_params<T> p;
    ut__cuda_dwconv2d_tile_params_set<T>(&p, x, NULL, NULL, go, NULL, ws, g->n, g->c, g->h, g->w,
                                         g->ho, g->wo, g->pad, g->pad);
    st = ut__cuda_dwconv2d_tile_dispatch<UT__CUDA_DWCONV2D_DW>(p, pl, g->kh, g->stride);
    if (st) return st;
  } else {
    ut__i64 m = (ut__i64)g->n * g->ho * g->wo;
    ut__i64 chunk;
    parts = ut__cuda_channel_chunks(g->c, m, &chunk);
    st = ut__cuda_workspace_acquire((size_t)g->c * parts * NT * sizeof(float), &ws);
    if (st) return st;
    ut__cuda_dwconv2d_direct_dw_kernel
        <<<(unsigned)((ut__i64)g->c * parts), 256, 0, ut__cuda_stream>>>(go, x, *g, chunk, parts,
                                                                          ws);
    UT__CUDA_LAUNCHED("dw_bwd_dw");
    plain = true;
  }
  ut__i64 warps = (ut__i64)g->c * NT;
  ut__cuda_dwconv2d_dw_final_kernel<T>
      <<<(unsigned)ut__cuda_cdiv(warps * 32, 256), 256, 0, ut__cuda_stream>>>(
      ws, dw, g->c, NT, parts, plain ? NULL : go, x, *g);
  UT__CUDA_LAUNCHED("dw_bwd_dw final");
  return UT_OK;
}

template <typename T>
static int ut__cuda_dwconv2d_forward_run(const T* x, const float* w, const float* bias, T* y,
                                         const ut__conv_geom* g) {
  ut__i64 total = (ut__i64)g->n * g->c * g->ho * g->wo;
  if (total <= 0) return UT_OK;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  bool exact;
  int st = ut__cuda_dwconv2d_forward_fast(x, w, bias, y, g, &exact);
  if (st || exact) return st;
  return ut__cuda_dwconv2d_exact_run<T, false>(x, w, bias, y, g);
}

template <typename T>
static int ut__cuda_dwconv2d_backward_dx_run(const T* go, const float* w, T* dx,
                                             const ut__conv_geom* g) {
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  bool exact;
  int st = ut__cuda_dwconv2d_backward_dx_fast(go, w, dx, g, &exact);
  if (st || exact) return st;
  return ut__cuda_dwconv2d_exact_run<T, true>(go, w, NULL, dx, g);
}

/* The entry points: float32, and bf16 activations (the same kernels on ut__cuda_bf16; see the
   top of this file). */
int ut__cuda_dwconv2d_forward(const float* x, const float* w, const float* bias, float* y,
                              const ut__conv_geom* g) {
  return ut__cuda_dwconv2d_forward_run<float>(x, w, bias, y, g);
}
int ut__cuda_dwconv2d_backward_dx(const float* go, const float* w, float* dx,
                                  const ut__conv_geom* g) {
  return ut__cuda_dwconv2d_backward_dx_run<float>(go, w, dx, g);
}
int ut__cuda_dwconv2d_backward_dw(const float* go, const float* x, float* dw,
                                  const ut__conv_geom* g) {
  return ut__cuda_dwconv2d_backward_dw_run<float>(go, x, dw, g);
}

int ut__cuda_dwconv2d_forward_bf16(const void* x, const float* w, const float* bias, void* y,
                                   const ut__conv_geom* g) {
  return ut__cuda_dwconv2d_forward_run<ut__cuda_bf16>(static_cast<const ut__cuda_bf16*>(x), w,
                                                      bias, static_cast<ut__cuda_bf16*>(y), g);
}
int ut__cuda_dwconv2d_backward_dx_bf16(const void* go, const float* w, void* dx,
                                       const ut__conv_geom* g) {
  return ut__cuda_dwconv2d_backward_dx_run<ut__cuda_bf16>(static_cast<const ut__cuda_bf16*>(go),
                                                          w, static_cast<ut__cuda_bf16*>(dx), g);
}
int ut__cuda_dwconv2d_backward_dw_bf16(const void* go, const void* x, float* dw,
                                       const ut__conv_geom* g) {
  return ut__cuda_dwconv2d_backward_dw_run<ut__cuda_bf16>(static_cast<const ut__cuda_bf16*>(go),
                                                          static_cast<const ut__cuda_bf16*>(x),
                                                          dw, g);
}
