/* dw_general.cu — dwconv2d's general strip kernels: every filter of up to 7x7 (square or not),
   stride 1 to 3 and any dilation, forward, dx and dW, float32 and bf16. They serve the shapes
   the measured kernels (dw_strip.cu, dw_tiled.cu) do not: before them such shapes took the
   plain kernels (one thread per output, a 64-bit division per output, and dW one pass over
   the data per tap), 2-3x slower than PyTorch in a training step (bench_dw_shapes.py on an
   H100). The choice between the families is in depthwise.cu.

   The filter width KW (1..7) and the stride S (1..3) are template arguments; the height
   (up to UT__CUDA_DWCONV2D_GEN_KH) and the dilation are not: the row loop is unrolled to the
   tallest filter and each row is skipped at run time past the real one, so the taps stay in
   registers without an instantiation per height. A dilated filter is d^2 undilated ones over
   the phases of the plane (rows and columns d apart), so an item takes the outputs of one
   phase and walks its input d rows and d columns apart.

     ut__cuda_dwconv2d_gen_forward_kernel<FLIP=false>
                   y = conv(x, w) + bias: an item is R rows x Q columns of outputs; it walks
                   the input rows it touches once, and each loaded row (a window of
                   (Q - 1) S + KW columns) feeds every output of the item that uses it
     ut__cuda_dwconv2d_gen_forward_kernel<FLIP=true>
                   dx at stride 1: go correlated with the rotated filter
     ut__cuda_dwconv2d_gen_tdx_kernel
                   dx at stride > 1: items are numbered by row and column phase (the dx row
                   and column modulo S) so that every lane of a warp meets the same taps; an
                   item is R dx rows S apart, whose taps read R consecutive go rows
     ut__cuda_dwconv2d_gen_dw_kernel
                   dW partials over the forward's items: block (part, c) sums go * x tap by
                   tap over a fixed range of channel c's items; the final kernel of dw_grad.cu
                   adds them in order

   Forward and dx add only taps that meet real input (a padded tap is skipped, not multiplied
   by zero), in the plain kernels' set of taps: a non-finite weight or input lands where the
   plain rule puts it, so these need no rerun. Forward sums each output in the plain kernel's
   order (rows, then columns, from the bias), so its result is the plain kernel's bit for bit;
   dx at stride > 1 too; dx at stride 1 walks the taps in the rotated order. dW multiplies
   padding zeros like the other strip kernels and relies on the final kernel's re-sum of a
   non-finite tap. */
#include "depthwise.cuh"

#include <type_traits>

/* the tallest filter the row loop is unrolled for, and the rows and (forward, dx at stride 1,
   dW) columns of an item */
#define UT__CUDA_DWCONV2D_GEN_KH 7
#define UT__CUDA_DWCONV2D_GEN_R 4
#define UT__CUDA_DWCONV2D_GEN_Q 2

template <typename T>
struct ut__cuda_dwconv2d_gen_params {
  const T* in;       /* forward, dW: x [planes, IH, IW]; dx: go [planes, IH, IW] */
  const float* w;    /* [C, KH, KW] */
  const float* bias; /* [C] or NULL (forward) */
  const T* go;       /* [planes, OH, OW] (dW) */
  T* out;            /* [planes, OH, OW] (forward, dx) */
  float* part;       /* partials [C, parts, KH * KW] (dW) */
  int C, IH, IW, OH, OW, KH, pad_h, pad_w, dil;
  int NX, NS;        /* column groups and strips of a plane */
  int NX1, NS1;      /* column groups and strips of one phase */
  unsigned items;    /* all items (forward, dx) or one channel's (dW) */
  unsigned chunk;    /* items per block (dW) */
  ut__cuda_fastdiv fd_nx, fd_ns, fd_nx1, fd_ns1, fd_c;
};

/* the item `it` of the forward and dW kernels (R rows x Q columns, both `dil` apart: one
   phase of a dilated filter): *ox its first column, *t its plane (forward) or image (dW),
   *oy0 its first row. Columns are numbered by column phase, then column group; strips by
   row phase, then strip. */
template <int R, int Q, typename T>
static __device__ __forceinline__ void ut__cuda_dwconv2d_gen_item(
    const ut__cuda_dwconv2d_gen_params<T>& p, unsigned it, int* ox, unsigned* t, int* oy0) {
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const unsigned xi = it - t1 * (unsigned)p.NX;
  const unsigned px = ut__cuda_fdiv(xi, p.fd_nx1);
  *ox = (int)px + p.dil * Q * (int)(xi - px * (unsigned)p.NX1);
  *t = ut__cuda_fdiv(t1, p.fd_ns);
  const unsigned si = t1 - *t * (unsigned)p.NS;
  const unsigned ph = ut__cuda_fdiv(si, p.fd_ns1);
  *oy0 = (int)ph + p.dil * R * (int)(si - ph * (unsigned)p.NS1);
}

/* channel c's taps, KH x KW of them, into wr[ky * KW + kx] (rotated 180 degrees when FLIP);
   rows past KH stay zero and are never used */
template <int KW, bool FLIP>
static __device__ __forceinline__ void ut__cuda_dwconv2d_gen_load_w(
    const float* w, int c, int kh, float (&wr)[UT__CUDA_DWCONV2D_GEN_KH * KW]) {
  const int nt = kh * KW;
#pragma unroll
  for (int i = 0; i < UT__CUDA_DWCONV2D_GEN_KH * KW; ++i)
    wr[i] = i < nt ? __ldg(w + (size_t)c * nt + (FLIP ? nt - 1 - i : i)) : 0.f;
}

/* whether window column i (of an item of Q columns) meets a tap: at strides above the
   filter width some columns lie between the taps of neighbouring outputs and are not loaded */
template <int KW, int S, int Q>
static __device__ constexpr bool ut__cuda_dwconv2d_gen_col_used(int i) {
  for (int q = 0; q < Q; ++q)
    if (i - q * S >= 0 && i - q * S < KW) return true;
  return false;
}

/* whether input row j of an item (R rows, stride S) meets a filter row: likewise for rows
   when the filter is shorter than the stride */
template <int R, int S>
static __device__ __forceinline__ bool ut__cuda_dwconv2d_gen_row_used(int j, int kh) {
  bool used = false;
#pragma unroll
  for (int r = 0; r < R; ++r) used |= j - r * S >= 0 && j - r * S < kh;
  return used;
}

/* input row j of an item (R rows x Q columns, stride S, rows `d` apart from iyb) into v:
   the window columns that meet a tap, zero elsewhere and outside the plane; true when the
   row lies inside the plane and meets a filter row. A row that meets no filter row (the
   same for every lane) is skipped; the others' loads are predicated, and a kernel issues
   the next row's loads before this row's arithmetic (measured on an H100: dW 2-18% faster;
   predicating the skipped rows too made 1x7 at stride 3 23% slower). */
template <int KW, int S, int R, int Q, typename T>
static __device__ __forceinline__ bool ut__cuda_dwconv2d_gen_row(
    const T* __restrict__ xp, int j, int iyb, int ixb, int d, int ih, int iw, int rows, int kh,
    const bool (&cv)[(Q - 1) * S + KW], float (&v)[(Q - 1) * S + KW]) {
  if (!(j < rows && ut__cuda_dwconv2d_gen_row_used<R, S>(j, kh))) { /* the same in every lane */
#pragma unroll
    for (int i = 0; i < (Q - 1) * S + KW; ++i) v[i] = 0.f;
    return false;
  }
  const int iy = iyb + j * d;
  const bool ok = (unsigned)iy < (unsigned)ih;
  const T* rp = xp + ((ptrdiff_t)iy * iw + ixb);
#pragma unroll
  for (int i = 0; i < (Q - 1) * S + KW; ++i)
    v[i] = (ok && ut__cuda_dwconv2d_gen_col_used<KW, S, Q>(i) && cv[i])
               ? ut__cuda_dwconv2d_ldg(rp + i * d)
               : 0.f;
  return ok;
}

/* the arithmetic of input row j (window v, columns inside the row cv) for each output row r
   of the item whose filter row kr = j - r S lies inside the filter (kh rows), in the order
   rows, columns, taps:
     forward (DW false): a[r][q] += f[kr KW + kx] * v[q S + kx], over the columns inside
     dW      (DW true):  a[kr KW + kx] += f[r][q] * v[q S + kx]  (v is zero outside)
   One walk for both kernels, as ut__cuda_dwconv2d_row_taps is for the square strips. */
template <bool DW, int KW, int S, int R, int Q, typename F, typename A>
static __device__ __forceinline__ void ut__cuda_dwconv2d_gen_taps(
    int j, int kh, const float (&v)[(Q - 1) * S + KW], const bool (&cv)[(Q - 1) * S + KW],
    const F& f, A& a) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int kr = j - r * S;
    if (kr >= 0 && kr < UT__CUDA_DWCONV2D_GEN_KH && kr < kh) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int kx = 0; kx < KW; ++kx) {
          if constexpr (DW)
            a[kr * KW + kx] = fmaf(f[r][q], v[q * S + kx], a[kr * KW + kx]);
          else if (cv[q * S + kx])
            a[r][q] = fmaf(f[kr * KW + kx], v[q * S + kx], a[r][q]);
        }
    }
  }
}

template <int KW, int S, bool FLIP, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_gen_forward_kernel(ut__cuda_dwconv2d_gen_params<T> p) {
  constexpr int R = UT__CUDA_DWCONV2D_GEN_R, Q = UT__CUDA_DWCONV2D_GEN_Q;
  constexpr int KM = UT__CUDA_DWCONV2D_GEN_KH;
  constexpr int JM = (R - 1) * S + KM, NV = (Q - 1) * S + KW;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  int ox0, oy0;
  unsigned plane;
  ut__cuda_dwconv2d_gen_item<R, Q>(p, it, &ox0, &plane, &oy0);
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const int kh = p.KH, d = p.dil;
  float wr[KM * KW];
  ut__cuda_dwconv2d_gen_load_w<KW, FLIP>(p.w, c, kh, wr);
  const float bv = (!FLIP && p.bias) ? __ldg(p.bias + c) : 0.f;
  /* output column ox0 + q d meets window column q S + kx: x column ixb + (q S + kx) d */
  const int ixb = ox0 * S - p.pad_w, iyb = oy0 * S - p.pad_h;
  bool cv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) cv[i] = (unsigned)(ixb + i * d) < (unsigned)p.IW;
  float acc[R][Q];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < Q; ++q) acc[r][q] = bv;
  const T* __restrict__ xp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
  const int rows = (R - 1) * S + kh;
  /* a row outside the plane adds nothing; row j + 1 is loaded before row j is summed */
  float v[NV];
  bool ok = ut__cuda_dwconv2d_gen_row<KW, S, R, Q>(xp, 0, iyb, ixb, d, p.IH, p.IW, rows, kh, cv, v);
#pragma unroll
  for (int j = 0; j < JM; ++j) {
    float vn[NV];
    bool okn = false;
    if (j + 1 < JM)
      okn = ut__cuda_dwconv2d_gen_row<KW, S, R, Q>(xp, j + 1, iyb, ixb, d, p.IH, p.IW, rows, kh,
                                                   cv, vn);
    if (ok) ut__cuda_dwconv2d_gen_taps<false, KW, S, R, Q>(j, kh, v, cv, wr, acc);
    if (j + 1 < JM) {
      ok = okn;
#pragma unroll
      for (int i = 0; i < NV; ++i) v[i] = vn[i];
    }
  }
  T* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + ((size_t)oy0 * p.OW + ox0);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (oy0 + r * d < p.OH) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
        if (ox0 + q * d < p.OW) ut__cuda_st(yp + (size_t)r * d * p.OW + q * d, acc[r][q]);
    }
}

/* dx at stride S > 1 from go (p.in, [planes, IH, IW] = go's rows) into dx (p.out, [planes,
   OH, OW] = dx's rows). Item: column x = px + S * m and rows y0 + S * r (y0 = py + S * R * q),
   numbered column m fastest, then column phase px, then strip q, then row phase py, then
   plane. dx[y][x] sums w[ky][kx] * go[gy][gx] over y + pad_h = gy * S + ky * dil (likewise
   x): for the item's phase a tap either meets go in every row of the strip (at go rows
   gy0 + r) or in none. */
template <int KW, int S, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_gen_tdx_kernel(ut__cuda_dwconv2d_gen_params<T> p) {
  constexpr int R = UT__CUDA_DWCONV2D_GEN_R, KM = UT__CUDA_DWCONV2D_GEN_KH;
  const unsigned it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= p.items) return;
  const unsigned t1 = ut__cuda_fdiv(it, p.fd_nx);
  const unsigned xi = it - t1 * (unsigned)p.NX;
  const unsigned px = ut__cuda_fdiv(xi, p.fd_nx1);
  const int x = (int)px + S * (int)(xi - px * (unsigned)p.NX1);
  const unsigned plane = ut__cuda_fdiv(t1, p.fd_ns);
  const unsigned si = t1 - plane * (unsigned)p.NS;
  const unsigned py = ut__cuda_fdiv(si, p.fd_ns1);
  const int y0 = (int)py + S * R * (int)(si - py * (unsigned)p.NS1);
  if (x >= p.OW) return;
  const int c = (int)(plane - ut__cuda_fdiv(plane, p.fd_c) * (unsigned)p.C);
  const int kh = p.KH, d = p.dil;
  float wr[KM * KW];
  ut__cuda_dwconv2d_gen_load_w<KW, false>(p.w, c, kh, wr);
  /* the go column of each filter column, or -1 where none meets x */
  int gx[KW];
#pragma unroll
  for (int kx = 0; kx < KW; ++kx) {
    const int tx = x + p.pad_w - kx * d;
    gx[kx] = (tx >= 0 && tx % S == 0 && tx / S < p.IW) ? tx / S : -1;
  }
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  const T* __restrict__ gp = p.in + (size_t)plane * ((size_t)p.IH * p.IW);
#pragma unroll
  for (int ky = 0; ky < KM; ++ky) {
    const int ty = y0 + p.pad_h - ky * d;
    if (ky < kh && ty % S == 0) { /* the same for the item's R rows */
      const int gy0 = ty / S;      /* exact, ty being a multiple of S */
#pragma unroll
      for (int kx = 0; kx < KW; ++kx) {
        if (gx[kx] < 0) continue;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int gy = gy0 + r;
          if ((unsigned)gy < (unsigned)p.IH)
            acc[r] = fmaf(wr[ky * KW + kx],
                          ut__cuda_dwconv2d_ldg(gp + ((size_t)gy * p.IW + gx[kx])), acc[r]);
        }
      }
    }
  }
  T* yp = p.out + (size_t)plane * ((size_t)p.OH * p.OW) + ((size_t)y0 * p.OW + x);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (y0 + r * S < p.OH) ut__cuda_st(yp + (size_t)r * S * p.OW, acc[r]);
}

/* dW partials: grid (parts, C); channel c's items (R rows x Q columns) numbered as the
   forward's with the image in place of the plane; part[(c * parts + part) * KH * KW + t] */
template <int KW, int S, typename T>
static __global__ void __launch_bounds__(256)
    ut__cuda_dwconv2d_gen_dw_kernel(ut__cuda_dwconv2d_gen_params<T> p) {
  constexpr int R = UT__CUDA_DWCONV2D_GEN_R, Q = UT__CUDA_DWCONV2D_GEN_Q;
  constexpr int KM = UT__CUDA_DWCONV2D_GEN_KH;
  constexpr int JM = (R - 1) * S + KM, NTM = KM * KW, NV = (Q - 1) * S + KW;
  __shared__ float red[8 * NTM];
  const int c = blockIdx.y, kh = p.KH, d = p.dil;
  float accw[NTM];
#pragma unroll
  for (int i = 0; i < NTM; ++i) accw[i] = 0.f;
  const unsigned e0 = blockIdx.x * p.chunk;
  const unsigned e1 = min(e0 + p.chunk, p.items);
  const size_t in_plane = (size_t)p.IH * p.IW, out_plane = (size_t)p.OH * p.OW;
  const int rows = (R - 1) * S + kh;
  for (unsigned it = e0 + threadIdx.x; it < e1; it += blockDim.x) {
    int ox, oy0;
    unsigned n;
    ut__cuda_dwconv2d_gen_item<R, Q>(p, it, &ox, &n, &oy0);
    if (ox >= p.OW) continue; /* the last group of a column phase may start past the row */
    const size_t plane = (size_t)n * p.C + c;
    const T* __restrict__ xp = p.in + plane * in_plane;
    const T* __restrict__ gp = p.go + plane * out_plane + ((size_t)oy0 * p.OW + ox);
    float g[R][Q];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < Q; ++q)
        g[r][q] = (oy0 + r * d < p.OH && ox + q * d < p.OW)
                      ? ut__cuda_dwconv2d_ldg(gp + (size_t)r * d * p.OW + q * d)
                      : 0.f;
    const int ixb = ox * S - p.pad_w, iyb = oy0 * S - p.pad_h;
    bool cv[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) cv[i] = (unsigned)(ixb + i * d) < (unsigned)p.IW;
    float v[NV];
    bool ok =
        ut__cuda_dwconv2d_gen_row<KW, S, R, Q>(xp, 0, iyb, ixb, d, p.IH, p.IW, rows, kh, cv, v);
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      float vn[NV];
      bool okn = false;
      if (j + 1 < JM)
        okn = ut__cuda_dwconv2d_gen_row<KW, S, R, Q>(xp, j + 1, iyb, ixb, d, p.IH, p.IW, rows,
                                                     kh, cv, vn);
      if (ok) ut__cuda_dwconv2d_gen_taps<true, KW, S, R, Q>(j, kh, v, cv, g, accw);
      if (j + 1 < JM) {
        ok = okn;
#pragma unroll
        for (int i = 0; i < NV; ++i) v[i] = vn[i];
      }
    }
  }
  /* the block's sums: warps, then the warps in order (rows past kh hold zeros, unused) */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int nt = kh * KW;
#pragma unroll
  for (int i = 0; i < NTM; ++i) {
    const float v = ut__cuda_warp_sum(accw[i]);
    if (lane == 0) red[warp * NTM + i] = v;
  }
  __syncthreads();
  const size_t row = (size_t)c * gridDim.x + blockIdx.x;
  for (int i = threadIdx.x; i < nt; i += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += red[w * NTM + i];
    p.part[row * nt + i] = s;
  }
}

/* ---- launches ---- */

static const int UT__CUDA_DWCONV2D_GEN_THREADS = 128;

template <typename T>
static void ut__cuda_dwconv2d_gen_divisors(ut__cuda_dwconv2d_gen_params<T>* p) {
  p->fd_nx = ut__cuda_fastdiv_make((unsigned)p->NX);
  p->fd_ns = ut__cuda_fastdiv_make((unsigned)p->NS);
  p->fd_nx1 = ut__cuda_fastdiv_make((unsigned)(p->NX1 > 0 ? p->NX1 : 1));
  p->fd_ns1 = ut__cuda_fastdiv_make((unsigned)p->NS1);
  p->fd_c = ut__cuda_fastdiv_make((unsigned)p->C);
}

/* the forward's and dW's groups of n outputs (rows: strips of R; columns: groups of Q) over
   `len` outputs `dil` apart: *per_phase per phase, the return value in all (one set per phase
   that has outputs: min(dil, len) of them) */
static int ut__cuda_dwconv2d_gen_groups(int len, int dil, int n, int* per_phase) {
  *per_phase = (int)ut__cuda_cdiv(ut__cuda_cdiv(len, dil), n);
  return (dil < len ? dil : len) * *per_phase;
}

/* f(std::integral_constant<int, KW>()) for the run-time filter width kw (1 to 7): the one
   place the widths are instantiated */
template <typename F>
static int ut__cuda_dwconv2d_gen_by_width(int kw, const F& f) {
  switch (kw) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
  }
  return ut__set_error(UT_ERR_ARG, "dw: no general kernel for filter width %d", kw);
}

template <int S, bool FLIP, typename T>
static int ut__cuda_dwconv2d_gen_forward_launch(const ut__cuda_dwconv2d_gen_params<T>& p, int kw) {
  const int th = UT__CUDA_DWCONV2D_GEN_THREADS;
  const unsigned blocks = (unsigned)ut__cuda_cdiv(p.items, th);
  return ut__cuda_dwconv2d_gen_by_width(kw, [&](auto w) -> int {
    ut__cuda_dwconv2d_gen_forward_kernel<decltype(w)::value, S, FLIP, T>
        <<<blocks, th, 0, ut__cuda_stream>>>(p);
    UT__CUDA_LAUNCHED("depthwise conv (general strips)");
    return UT_OK;
  });
}

template <int S, typename T>
static int ut__cuda_dwconv2d_gen_tdx_launch(const ut__cuda_dwconv2d_gen_params<T>& p, int kw) {
  const int th = UT__CUDA_DWCONV2D_GEN_THREADS;
  const unsigned blocks = (unsigned)ut__cuda_cdiv(p.items, th);
  return ut__cuda_dwconv2d_gen_by_width(kw, [&](auto w) -> int {
    ut__cuda_dwconv2d_gen_tdx_kernel<decltype(w)::value, S, T>
        <<<blocks, th, 0, ut__cuda_stream>>>(p);
    UT__CUDA_LAUNCHED("depthwise dx (general strips)");
    return UT_OK;
  });
}

template <int S, typename T>
static int ut__cuda_dwconv2d_gen_dw_launch(const ut__cuda_dwconv2d_gen_params<T>& p, int kw,
                                           int parts) {
  const dim3 grid((unsigned)parts, (unsigned)p.C);
  return ut__cuda_dwconv2d_gen_by_width(kw, [&](auto w) -> int {
    ut__cuda_dwconv2d_gen_dw_kernel<decltype(w)::value, S, T>
        <<<grid, UT__CUDA_DWCONV2D_GEN_THREADS, 0, ut__cuda_stream>>>(p);
    UT__CUDA_LAUNCHED("depthwise dW (general strips)");
    return UT_OK;
  });
}

/* ---- what depthwise.cu calls ---- */

bool ut__cuda_dwconv2d_gen_fits(const ut__conv_geom* g) {
  if (g->kh < 1 || g->kh > UT__CUDA_DWCONV2D_GEN_KH || g->kw < 1 || g->kw > 7) return false;
  if (g->stride < 1 || g->stride > 3 || g->dil < 1) return false;
  const ut__i64 lim = 0x7fffffffLL, planes = (ut__i64)g->n * g->c;
  const ut__i64 rows = (g->ho > g->h ? g->ho : g->h) + (ut__i64)g->dil * UT__CUDA_DWCONV2D_GEN_R;
  const ut__i64 cols = (g->wo > g->w ? g->wo : g->w) + g->stride + g->dil;
  return planes * rows * cols < lim && g->dil <= 0xffff;
}

template <typename T>
int ut__cuda_dwconv2d_gen_forward_run(const T* in, const float* w, const float* bias, T* out,
                                      const ut__conv_geom* g, bool flip) {
  ut__cuda_dwconv2d_gen_params<T> p = {};
  p.in = in; p.w = w; p.bias = flip ? NULL : bias; p.out = out;
  p.C = g->c; p.KH = g->kh; p.dil = g->dil;
  if (flip) { /* dx at stride 1: go [ho, wo] in, dx [h, w] out */
    p.IH = g->ho; p.IW = g->wo; p.OH = g->h; p.OW = g->w;
    p.pad_h = (g->kh - 1) * g->dil - g->pad;
    p.pad_w = (g->kw - 1) * g->dil - g->pad;
  } else {
    p.IH = g->h; p.IW = g->w; p.OH = g->ho; p.OW = g->wo;
    p.pad_h = p.pad_w = g->pad;
  }
  p.NX = ut__cuda_dwconv2d_gen_groups(p.OW, p.dil, UT__CUDA_DWCONV2D_GEN_Q, &p.NX1);
  p.NS = ut__cuda_dwconv2d_gen_groups(p.OH, p.dil, UT__CUDA_DWCONV2D_GEN_R, &p.NS1);
  p.items = (unsigned)((ut__i64)g->n * g->c * p.NS * p.NX);
  ut__cuda_dwconv2d_gen_divisors(&p);
  if (flip) return ut__cuda_dwconv2d_gen_forward_launch<1, true>(p, g->kw);
  switch (g->stride) {
    case 1: return ut__cuda_dwconv2d_gen_forward_launch<1, false>(p, g->kw);
    case 2: return ut__cuda_dwconv2d_gen_forward_launch<2, false>(p, g->kw);
    case 3: return ut__cuda_dwconv2d_gen_forward_launch<3, false>(p, g->kw);
  }
  return ut__set_error(UT_ERR_ARG, "dw: no general kernel for stride %d", g->stride);
}
template int ut__cuda_dwconv2d_gen_forward_run<float>(const float*, const float*, const float*,
                                                      float*, const ut__conv_geom*, bool);
template int ut__cuda_dwconv2d_gen_forward_run<ut__cuda_bf16>(const ut__cuda_bf16*, const float*,
                                                              const float*, ut__cuda_bf16*,
                                                              const ut__conv_geom*, bool);

template <typename T>
int ut__cuda_dwconv2d_gen_tdx_run(const T* go, const float* w, T* dx, const ut__conv_geom* g) {
  const int R = UT__CUDA_DWCONV2D_GEN_R, S = g->stride;
  ut__cuda_dwconv2d_gen_params<T> p = {};
  p.in = go; p.w = w; p.out = dx;
  p.C = g->c; p.KH = g->kh; p.dil = g->dil;
  p.IH = g->ho; p.IW = g->wo; p.OH = g->h; p.OW = g->w;
  p.pad_h = p.pad_w = g->pad;
  p.NX1 = (int)ut__cuda_cdiv(g->w, S);
  p.NX = S * p.NX1;
  p.NS1 = (int)ut__cuda_cdiv(ut__cuda_cdiv(g->h, S), R);
  p.NS = S * p.NS1;
  p.items = (unsigned)((ut__i64)g->n * g->c * p.NS * p.NX);
  ut__cuda_dwconv2d_gen_divisors(&p);
  switch (S) {
    case 2: return ut__cuda_dwconv2d_gen_tdx_launch<2>(p, g->kw);
    case 3: return ut__cuda_dwconv2d_gen_tdx_launch<3>(p, g->kw);
  }
  return ut__set_error(UT_ERR_ARG, "dw: no general dx kernel for stride %d", S);
}
template int ut__cuda_dwconv2d_gen_tdx_run<float>(const float*, const float*, float*,
                                                  const ut__conv_geom*);
template int ut__cuda_dwconv2d_gen_tdx_run<ut__cuda_bf16>(const ut__cuda_bf16*, const float*,
                                                          ut__cuda_bf16*, const ut__conv_geom*);

/* the parts of one channel's items (one block each) */
int ut__cuda_dwconv2d_gen_dw_parts(const ut__conv_geom* g, unsigned* items, unsigned* chunk) {
  int ns1, nx1;
  const int strips = ut__cuda_dwconv2d_gen_groups(g->ho, g->dil, UT__CUDA_DWCONV2D_GEN_R, &ns1);
  const ut__i64 per_ch =
      (ut__i64)g->n * strips *
      ut__cuda_dwconv2d_gen_groups(g->wo, g->dil, UT__CUDA_DWCONV2D_GEN_Q, &nx1);
  /* an item is Q columns: 4 / Q items per thread keeps the blocks of one-column items */
  const ut__i64 ch = (ut__i64)UT__CUDA_DWCONV2D_GEN_THREADS * (4 / UT__CUDA_DWCONV2D_GEN_Q);
  *items = (unsigned)per_ch;
  *chunk = (unsigned)ch;
  return (int)ut__cuda_cdiv(per_ch, ch);
}

template <typename T>
int ut__cuda_dwconv2d_gen_dw_run(const T* go, const T* x, float* ws, const ut__conv_geom* g) {
  ut__cuda_dwconv2d_gen_params<T> p = {};
  p.in = x; p.go = go; p.part = ws;
  p.C = g->c; p.KH = g->kh; p.dil = g->dil;
  p.IH = g->h; p.IW = g->w; p.OH = g->ho; p.OW = g->wo;
  p.pad_h = p.pad_w = g->pad;
  p.NX = ut__cuda_dwconv2d_gen_groups(p.OW, p.dil, UT__CUDA_DWCONV2D_GEN_Q, &p.NX1);
  p.NS = ut__cuda_dwconv2d_gen_groups(p.OH, p.dil, UT__CUDA_DWCONV2D_GEN_R, &p.NS1);
  const int parts = ut__cuda_dwconv2d_gen_dw_parts(g, &p.items, &p.chunk);
  ut__cuda_dwconv2d_gen_divisors(&p);
  switch (g->stride) {
    case 1: return ut__cuda_dwconv2d_gen_dw_launch<1>(p, g->kw, parts);
    case 2: return ut__cuda_dwconv2d_gen_dw_launch<2>(p, g->kw, parts);
    case 3: return ut__cuda_dwconv2d_gen_dw_launch<3>(p, g->kw, parts);
  }
  return ut__set_error(UT_ERR_ARG, "dw: no general dW kernel for stride %d", g->stride);
}
template int ut__cuda_dwconv2d_gen_dw_run<float>(const float*, const float*, float*,
                                                 const ut__conv_geom*);
template int ut__cuda_dwconv2d_gen_dw_run<ut__cuda_bf16>(const ut__cuda_bf16*,
                                                         const ut__cuda_bf16*, float*,
                                                         const ut__conv_geom*);
