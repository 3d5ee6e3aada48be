/* depthwise.cuh — what the files of dwconv2d (forward, dx, dW) share: the device helpers, the
   row walk of the forward and dW kernels, the parameter blocks, and what each file gives the
   others (measurements and history: CUDA_NOTES.md; the backend's naming: common.cuh).

   Files
     depthwise.cu      the entry points (float32 and bf16), the choice of kernel by shape,
                       and the strip kernels' shape tables (rows, columns, threads, tunables)
     dw_tiled.cu       the tiled kernel (v2): persistent, cp.async double buffer, all four
                       modes (forward, rotated filter, transposed dx, dW partials); its plan
     dw_strip.cu       forward and dx strip kernels (v3): one column per item (float32 and
                       bf16), and the bf16 pair (strip2) and wide (stripw) variants
     dw_grad.cu        dW: the strip, pair and wide partial kernels, the plain per-tap
                       reduction, and the final kernel that adds the partials in order (and
                       re-sums a non-finite tap over real input only)
     dw_general.cu     the general strip kernels: every filter up to 7x7 (square or not),
                       stride 1 to 3, any dilation; forward, dx and dW
     dw_exact.cu       the plain kernels (any geometry, dilation) for forward and dx, and
                       the exact reruns after a fast kernel for channels with non-finite weights

   The kernels

   3x3 filters at stride 1 or 2 and 5x5 at stride 1 take the strip kernels
   (ut__cuda_dwconv2d_strip_*), which were faster on every measured shape. The tiled path
   (ut__cuda_dwconv2d_tile_kernel) covers the other square 3x3, 5x5 and 7x7 filters at stride
   1 or 2 whose tiles fit in shared memory. A unit of work
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

   Every other filter up to 7x7 (square or not, stride 1 to 3, any dilation, and those planes
   too wide for the tiled kernel) takes the general strip kernels (dw_general.cu: the strip walk
   with the filter height and the dilation at run time). What remains (larger filters or
   strides, 32-bit item numbers exceeded) takes plain kernels: one thread per output (gather
   form for dx), and for dW a per-channel, per-chunk block reduction tap by tap, with the same
   deterministic second stage.

   bf16 activations (the entry points ut__cuda_dw_fwd, _dw_bwd_dx and _dw_bwd_dw switch on the
   type): every kernel is a template over the activation type T (float or ut__cuda_bf16) that
   reads x and go through ut__cuda_dwconv2d_ldg and writes y and dx through ut__cuda_st; w, bias, the dW partials
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

   Without relocatable device code each file launches only its own kernels: a file gives the
   others host functions (declared at the end of this header; templates over the activation
   type are instantiated for float and ut__cuda_bf16 in the file that defines them), and the
   device helpers here are force-inlined into each kernel. */
#ifndef UT__CUDA_DEPTHWISE_CUH
#define UT__CUDA_DEPTHWISE_CUH

#include "common.cuh"

/* Read-only loads of activations: __ldg as the float32 kernels always did (the read-only
   path), converted to float for bf16. */
static __device__ __forceinline__ float ut__cuda_dwconv2d_ldg(const float* p) { return __ldg(p); }
static __device__ __forceinline__ float ut__cuda_dwconv2d_ldg(const ut__cuda_bf16* p) {
  return __bfloat162float(__ldg(p));
}

/* ---- a BatchNorm folded into the loads (ut_batchnorm2d_dwconv2d_forward; dw_fwd_bn and
   dw_bwd_dw_bn) ----
   Each input value of channel c is read as act(z), z = (v - mean) gamma rstd + beta, computed
   as norm.cu's apply kernel computes it (common.cuh's helpers) and, for bf16, rounded as the
   apply kernel stores it: the kernels see act(bn(x)) to the bit, never written. Padding stays
   zero (the fold applies to values inside the plane only). The kernels take it as a template
   flag BN; mean == NULL: none (the plain kernels and reruns test it at run time). */
struct ut__cuda_dw_bnp {
  const float *mean, *var, *gamma, *beta; /* [C] */
  float eps, cap;                         /* cap: -1 no activation, 0 relu, 6 relu6 */
};
/* channel c's numbers */
struct ut__cuda_dw_bnq {
  float m, sc, bt, cap;
};
static __device__ __forceinline__ ut__cuda_dw_bnq ut__cuda_dw_bn_at(const ut__cuda_dw_bnp& p,
                                                                  int c) {
  ut__cuda_dw_bnq q;
  q.m = __ldg(p.mean + c);
  q.sc = ut__cuda_bn_rstd(__ldg(p.var + c), p.eps) * __ldg(p.gamma + c);
  q.bt = __ldg(p.beta + c);
  q.cap = p.cap;
  return q;
}
template <typename T>
static __device__ __forceinline__ float ut__cuda_dw_bn_value(float v,
                                                            const ut__cuda_dw_bnq& q) {
  float z = ut__cuda_bn_z(v, q.m, q.sc, q.bt);
  if (q.cap >= 0.f) z = ut__cuda_bn_relu(z, q.cap);
  if constexpr (sizeof(T) == 2) z = __bfloat162float(__float2bfloat16_rn(z));
  return z;
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

static inline ut__cuda_fastdiv ut__cuda_fastdiv_make(unsigned d) {
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

/* ---- parameter blocks ---- */

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

/* the tiled kernel's units of work, sized on the host (dw_tiled.cu) */
struct ut__cuda_dwconv2d_tile_plan {
  int P, NG, BH, NB, NS, SQ, threads;
  size_t smem;
  ut__i64 units;
};

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
  ut__cuda_dw_bnp bn; /* the forward and dW kernels with BN: in's normalization */
  int vec2;          /* ut__cuda_dwconv2d_strip_tdx_kernel with S == 2: rows of out are aligned
                        to two elements (8 bytes float, 4 bytes bf16) and W is even */
  ut__cuda_fastdiv fd_nx, fd_ns, fd_c;
};

/* ---- the row walk (forward, dx at stride 1 and dW; strip, pair, wide and tiled kernels) ----
   An item is R output rows (stride S) x Q output columns of one plane; the kernel walks the
   input rows j it touches, loads each once into v[0 .. NV) (zeros outside the input), and
   hands it to ut__cuda_dwconv2d_row_taps, which feeds it to every output (r, q) that row j
   meets (filter row kr = j - r * S) through each filter column kx, in that order:
     forward (DW false): a(r, q) += f[kr * KW + kx] * v[PO + q * S + kx]   (f: the filter taps)
     dW      (DW true):  a[kr * KW + kx] += f(r, q) * v[PO + q * S + kx]   (f: go of the item)
   One walk and one order for both; each kernel keeps only its loop over j and its row load
   (ut__cuda_dwconv2d_strip_row, _strip2_row, _wide_row, or shared memory in the tiled kernel).
   Why that split, arrays by reference and no callback: with the row loop inside the helper,
   or a lambda for the taps, the arithmetic was the same but the PTX numbered the accumulators
   differently and ptxas allocated some kernels differently (more registers, or a spill). */

/* element (r, q) of an item's per-output array: [R] for one-column items (q is 0), or [R][Q] */
template <int R>
static __device__ __forceinline__ float& ut__cuda_dwconv2d_at(float (&a)[R], int r, int) {
  return a[r];
}
template <int R, int Q>
static __device__ __forceinline__ float& ut__cuda_dwconv2d_at(float (&a)[R][Q], int r, int q) {
  return a[r][q];
}
template <int R>
static __device__ __forceinline__ float ut__cuda_dwconv2d_at(const float (&a)[R], int r, int) {
  return a[r];
}
template <int R, int Q>
static __device__ __forceinline__ float ut__cuda_dwconv2d_at(const float (&a)[R][Q], int r,
                                                            int q) {
  return a[r][q];
}

template <bool DW, int KH, int KW, int S, int R, int Q, int PO, int NV, typename F, typename A>
static __device__ __forceinline__ void ut__cuda_dwconv2d_row_taps(int j, const float (&v)[NV],
                                                                  const F& f, A& a) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int kr = j - r * S;
    if (kr >= 0 && kr < KH) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int kx = 0; kx < KW; ++kx) {
          if constexpr (DW)
            a[kr * KW + kx] =
                fmaf(ut__cuda_dwconv2d_at(f, r, q), v[PO + q * S + kx], a[kr * KW + kx]);
          else
            ut__cuda_dwconv2d_at(a, r, q) =
                fmaf(f[kr * KW + kx], v[PO + q * S + kx], ut__cuda_dwconv2d_at(a, r, q));
        }
    }
  }
}

/* the item `it` of a strip kernel, numbered column group fastest (NX per row), then strip (NS
   per plane), then plane (forward, dx) or image (dW): *x0 the first column (CW columns per
   group), *t the plane or image, *y0 the first row (R rows per strip) */
template <int R, int CW, typename T>
static __device__ __forceinline__ void ut__cuda_dwconv2d_strip_item(
    const ut__cuda_dwconv2d_strip_params<T>& p, unsigned it, int* x0, unsigned* t, int* y0) {
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  *x0 = CW * (int)(it - t1 * (unsigned)p.NX);
  *t = ut__cuda_fdiv(t1, p.fd_ns);
  *y0 = (int)(t1 - *t * (unsigned)p.NS) * R;
}

/* the channel of plane n * C + c */
template <typename T>
static __device__ __forceinline__ int ut__cuda_dwconv2d_strip_channel(
    const ut__cuda_dwconv2d_strip_params<T>& p, unsigned plane) {
  return (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
}

/* channel c's NT filter taps (w: [C, NT]) into registers, rotated 180 degrees when FLIP */
template <int NT, bool FLIP, typename I>
static __device__ __forceinline__ void ut__cuda_dwconv2d_load_w(const float* w, I c,
                                                                float (&wr)[NT]) {
#pragma unroll
  for (int i = 0; i < NT; ++i) wr[i] = __ldg(w + c * NT + (FLIP ? NT - 1 - i : i));
}

/* which of the N columns x0 .. x0 + N lie inside a row of `iw` */
template <int N>
static __device__ __forceinline__ void ut__cuda_dwconv2d_cols_in(int x0, int iw, bool (&cv)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cv[i] = (unsigned)(x0 + i) < (unsigned)iw;
}

/* one input row of a one-column strip item: v[kx] = x[iy][ixb + kx], zero outside the plane
   (cv: ut__cuda_dwconv2d_cols_in) */
template <int K, typename T, bool BN = false>
static __device__ __forceinline__ void ut__cuda_dwconv2d_strip_row(const T* __restrict__ xp,
                                                                   int iy, int ixb, int ih,
                                                                   int iw, const bool (&cv)[K],
                                                                   float (&v)[K],
                                                                   const ut__cuda_dw_bnq& q = {}) {
  const bool rv = (unsigned)iy < (unsigned)ih;
  const T* rp = xp + (iy * iw + ixb);
#pragma unroll
  for (int kx = 0; kx < K; ++kx) {
    float e = (rv && cv[kx]) ? ut__cuda_dwconv2d_ldg(rp + kx) : 0.f;
    if constexpr (BN) e = (rv && cv[kx]) ? ut__cuda_dw_bn_value<T>(e, q) : 0.f;
    v[kx] = e;
  }
}

/* the end of a dW block: its NT sums, warp by warp, then the warps' in order into
   part[row * NT + t] (red: NT shared floats per warp of the block) */
template <int NT, typename I>
static __device__ __forceinline__ void ut__cuda_dwconv2d_dw_block_store(const float (&accw)[NT],
                                                                        float* red, float* part,
                                                                        I row) {
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
    part[row * NT + i] = s;
  }
}

/* ---- bf16 pair kernels (ut__cuda_dwconv2d_strip2_*): reading rows as bf16 pairs ----
   The float32 strip kernels are bound by load instructions, not bytes (the overlap is served
   by L1), so bf16 with one column per thread gains nothing (measured slower on an H200: each
   2-byte load costs an instruction like a 4-byte one, plus its conversion). The pair kernels
   take an item of R rows x 2 columns and read each input row as aligned bf16 pairs (4-byte
   loads): with IW even and the plane 4-byte aligned, every pair lies wholly inside the row or
   wholly outside it, so one test per pair replaces the per-column bounds. The window of a pair
   of outputs, columns ixb .. ixb + S + K - 1 with ixb = 2 gx S - pad, starts PO = pad & 1
   columns after an even column. Each output's sum runs over the same rows and taps in the
   same order as in ut__cuda_dwconv2d_strip_forward_kernel, so forward and dx are the float32
   kernel's numbers rounded once; the dW kernel's partial sums are grouped differently (an
   item holds two columns), so its float32 sums may differ in the last bits. */
template <int K, int S, int PO>
struct ut__cuda_dwconv2d_strip2_window {
  static constexpr int NW = (PO + S + K + 1) / 2; /* bf16 pairs per input row */
};

/* one input row of a pair item: v[0 .. 2 NW) = columns a0 .. a0 + 2 NW, zero outside */
template <int NW, bool BN = false>
static __device__ __forceinline__ void ut__cuda_dwconv2d_strip2_row(const ut__cuda_bf16* rowp,
                                                                    int a0, int iw, bool rv,
                                                                    float (&v)[2 * NW],
                                                                    const ut__cuda_dw_bnq& q = {}) {
  const __nv_bfloat162* rp = reinterpret_cast<const __nv_bfloat162*>(rowp + a0);
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    float2 f = make_float2(0.f, 0.f);
    const bool in = rv && (unsigned)(a0 + 2 * i) < (unsigned)iw;
    if (in) f = __bfloat1622float2(__ldg(rp + i));
    if constexpr (BN) {
      if (in) {
        f.x = ut__cuda_dw_bn_value<ut__cuda_bf16>(f.x, q);
        f.y = ut__cuda_dw_bn_value<ut__cuda_bf16>(f.y, q);
      }
    }
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

/* ---- bf16 wide kernels (ut__cuda_dwconv2d_stripw_*): CW output columns per thread from 8-
   and 16-byte loads ----
   The pair kernels still issue one load instruction per two input columns. The wide kernels
   take an item of R rows x CW columns (forward and dW: CW = 8 at stride 1, 4 at stride 2, so
   that an item's input window starts at the same column modulo 8; dx at stride 2: 8 dx
   columns) and read each row of the window as aligned chunks of G bf16 (G = 8: 16-byte loads
   of x or of go at stride 1; G = 4: 8-byte loads of go for dx at stride 2). With the row width
   a multiple of G and the tensor aligned to 2 G bytes, every chunk lies wholly inside the row
   or wholly outside it, so one test per chunk replaces the per-column bounds. PO, the window's
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
template <int G, int NW, bool PF, int RAW, bool BN = false>
static __device__ __forceinline__ void ut__cuda_dwconv2d_wide_row(
    const typename ut__cuda_dwconv2d_chunk<G>::type (&raw)[RAW][NW], int j,
    const ut__cuda_bf16* rowp, int a0, int iw, bool rv, float (&v)[G * NW],
    const ut__cuda_dw_bnq& q = {}) {
  typename ut__cuda_dwconv2d_chunk<G>::type u[NW];
  if constexpr (PF) {
#pragma unroll
    for (int i = 0; i < NW; ++i) u[i] = raw[j][i];
  } else {
    ut__cuda_dwconv2d_wide_load<G, NW>(rowp, a0, iw, rv, u);
  }
#pragma unroll
  for (int i = 0; i < NW; ++i) ut__cuda_dwconv2d_unpack(u[i], v + G * i);
  if constexpr (BN) {
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      const bool in = rv && (unsigned)(a0 + G * i) < (unsigned)iw;
#pragma unroll
      for (int e = 0; e < G; ++e)
        v[G * i + e] = in ? ut__cuda_dw_bn_value<ut__cuda_bf16>(v[G * i + e], q) : 0.f;
    }
  }
}

/* the wide kernels' window offset in its first 8-column chunk, for a padding */
static inline int ut__cuda_dwconv2d_stripw_po(int pad) { return ((-pad) % 8 + 8) % 8; }

/* dx at stride 2, wide: go's rows read as chunks of four (8 bytes), 8 dx columns per item */
static const int UT__CUDA_DWCONV2D_TDXW_CX = 8;

/* ============================================================================================
   What one file gives another (host functions; each launches its own file's kernels on
   ut__cuda_stream and returns UT_OK or the error it set). The *_start functions launch one
   kernel family at run-time R (rows per item), k, s and the template choices below them.
   ============================================================================================ */

/* dw_tiled.cu: the plan of ut__cuda_dwconv2d_tile_kernel (false: no plan fits in shared
   memory), and its launch for MODE (instantiated for every mode, float and bf16) */
bool ut__cuda_dwconv2d_tile_plan_for(int mode, int N, int C, int IH, int IW, int OH, int OW,
                                     int KH, int S, int T, ut__cuda_dwconv2d_tile_plan* pl);
template <int MODE, typename T>
int ut__cuda_dwconv2d_tile_dispatch(const ut__cuda_dwconv2d_tile_params<T>& p,
                                    const ut__cuda_dwconv2d_tile_plan& pl, int k, int s);

/* dw_strip.cu: forward (flip: dx at stride 1) and dx at stride 2; one column per item (float
   and bf16), bf16 pairs, bf16 wide items */
template <typename T>
int ut__cuda_dwconv2d_strip_forward_start(const ut__cuda_dwconv2d_strip_params<T>& p, int R,
                                          bool flip, int k, int s, int threads);
template <typename T>
int ut__cuda_dwconv2d_strip_tdx_start(const ut__cuda_dwconv2d_strip_params<T>& p, int R, int k,
                                      int d, int threads);
int ut__cuda_dwconv2d_strip2_forward_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                           int R, bool flip, int k, int s, int threads);
int ut__cuda_dwconv2d_stripw_forward_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                           int R, bool flip, int k, int s, int threads);
int ut__cuda_dwconv2d_stripw_tdx_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                       int R, int d, int po, int threads);

/* dw_grad.cu: dW partials of the strip kernels into p.part (grid (parts, C)); the plain
   per-tap reduction into ws; the final kernel that adds a channel's partials in order into
   dw (go == NULL: the partials came from the plain kernel and are exact) */
template <typename T>
int ut__cuda_dwconv2d_strip_dw_start(const ut__cuda_dwconv2d_strip_params<T>& p, int R, int k,
                                     int s, int parts, int threads);
int ut__cuda_dwconv2d_strip2_dw_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                      int R, int k, int s, int parts, int threads);
int ut__cuda_dwconv2d_stripw_dw_start(const ut__cuda_dwconv2d_strip_params<ut__cuda_bf16>& p,
                                      int R, int k, int s, int parts, int threads);
template <typename T>
int ut__cuda_dwconv2d_direct_dw_start(const T* go, const T* x, const ut__conv_geom* g,
                                      ut__i64 chunk, int parts, float* ws);
template <typename T>
int ut__cuda_dwconv2d_dw_final_start(const float* ws, float* dw, int C, int NT, int parts,
                                     const T* go, const T* x, const ut__conv_geom* g,
                                     const ut__cuda_dw_bnp& bn = {});

/* dw_general.cu: the general strip kernels (filters up to 7x7, square or not, stride 1 to 3,
   any dilation): whether they fit the geometry (32-bit item numbers); forward (flip: dx at
   stride 1, from go), dx at stride > 1, and dW partials into ws ([C, parts, KH * KW], parts
   from ut__cuda_dwconv2d_gen_dw_parts) */
bool ut__cuda_dwconv2d_gen_fits(const ut__conv_geom* g);
template <typename T>
int ut__cuda_dwconv2d_gen_forward_run(const T* in, const float* w, const float* bias, T* out,
                                      const ut__conv_geom* g, bool flip);
template <typename T>
int ut__cuda_dwconv2d_gen_tdx_run(const T* go, const float* w, T* dx, const ut__conv_geom* g);
int ut__cuda_dwconv2d_gen_dw_parts(const ut__conv_geom* g, unsigned* items, unsigned* chunk);
template <typename T>
int ut__cuda_dwconv2d_gen_dw_run(const T* go, const T* x, float* ws, const ut__conv_geom* g);

/* dw_exact.cu: the plain kernels over the whole output (forward) or input (dx), and the
   exact rerun (DX: of dx) for channels whose weights are not all finite */
template <typename T>
int ut__cuda_dwconv2d_direct_forward_run(const T* x, const float* w, const float* bias, T* y,
                                         const ut__conv_geom* g);
template <typename T>
int ut__cuda_dwconv2d_direct_dx_run(const T* go, const float* w, T* dx, const ut__conv_geom* g);
template <typename T, bool DX>
int ut__cuda_dwconv2d_exact_run(const T* in, const float* w, const float* bias, T* out,
                                const ut__conv_geom* g, const ut__cuda_dw_bnp& bn = {});

#endif /* UT__CUDA_DEPTHWISE_CUH */
