/* depthwise.cu — dwconv2d: forward, dx and dW. The entry points (float32 and bf16), and the
   choice of kernel by filter shape, stride, dilation, plane size and alignment: the strip
   kernels (dw_strip.cu, dw_grad.cu) and the tiled kernel (dw_tiled.cu) for the measured
   undilated shapes, each followed by its non-finite rerun; the general strip kernels
   (dw_general.cu) for every other filter up to 7x7 at stride 1 to 3; the plain kernels
   (dw_exact.cu, dw_grad.cu) for what remains. The kernels,
   the files and the shared helpers: depthwise.cuh; measurements and history: CUDA_NOTES.md;
   the backend's naming: common.cuh. */
#include "depthwise.cuh"

/* ---- the strip kernels' shapes ---- */

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

/* ---- the wide bf16 kernels' shapes ---- */

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

/* the instantiated window offsets (ut__cuda_dwconv2d_stripw_po, depthwise.cuh) */
static bool ut__cuda_dwconv2d_stripw_po_ok(int k, int s, int po) {
  if (k == 3 && s == 2) return po == 0 || po == 7;
  return (k == 3 || k == 5) && s == 1 && (po == 0 || po == 6 || po == 7);
}

/* an input of rows that start at multiples of 8 columns, in 16-byte aligned memory */
static bool ut__cuda_dwconv2d_stripw_in_fits(const void* in, int iw) {
  return iw % 8 == 0 && (reinterpret_cast<uintptr_t>(in) & 15) == 0;
}

/* go's column offset in its first chunk of four, for the phase D (see the tdx kernels) */
static int ut__cuda_dwconv2d_stripw_tdx_po(int k, int pad, int d) {
  const int off = (pad - (k - 1 + d)) / 2; /* exact: pad - E is even */
  return (off % 4 + 4) % 4;
}

/* the wide dx kernel at stride 2 serves 3x3 filters and go rows that start at multiples of
   four columns in 8-byte aligned memory */
static bool ut__cuda_dwconv2d_stripw_tdx_fits(const void* go, const ut__conv_geom* g) {
  return g->kh == 3 && g->stride == 2 && g->wo % 4 == 0 &&
         (reinterpret_cast<uintptr_t>(go) & 7) == 0;
}

/* the bf16 pair kernels serve an input whose rows start at even columns: IW even, the
   tensor 4-byte aligned */
static bool ut__cuda_dwconv2d_strip2_fits(const ut__cuda_bf16* in, int iw) {
  return iw % 2 == 0 && (reinterpret_cast<uintptr_t>(in) & 3) == 0;
}

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

/* ---- the strip kernels: parameters and launch ---- */

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

/* the strip kernels' fast divisions: by NX, NS and C (set them first) */
template <typename T>
static void ut__cuda_dwconv2d_strip_divisors(ut__cuda_dwconv2d_strip_params<T>* p) {
  p->fd_nx = ut__cuda_fastdiv_make((unsigned)p->NX);
  p->fd_ns = ut__cuda_fastdiv_make((unsigned)p->NS);
  p->fd_c = ut__cuda_fastdiv_make((unsigned)p->C);
}

template <typename T>
static int ut__cuda_dwconv2d_strip_forward_run(const T* in, const float* w, const float* bias,
                                               T* out, int n, int c, int ih, int iw, int oh,
                                               int ow, int k, int s, int pad, bool flip,
                                               const ut__cuda_dw_bnp* bn = nullptr) {
  const int R =
      ut__cuda_dwconv2d_strip_rows(flip ? UT__CUDA_DWCONV2D_FLIP : UT__CUDA_DWCONV2D_FWD, s, oh);
  const int threads = ut__cuda_dwconv2d_strip_threads();
  ut__cuda_dwconv2d_strip_params<T> p = {};
  p.in = in; p.w = w; p.bias = bias; p.out = out;
  p.C = c; p.IH = ih; p.IW = iw; p.OH = oh; p.OW = ow; p.pad = pad;
  if (bn) p.bn = *bn;
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
      ut__cuda_dwconv2d_strip_divisors(&p);
      return ut__cuda_dwconv2d_stripw_forward_start(p, RW, flip, k, s, threads);
    }
    if (ut__cuda_dwconv2d_strip2_fits(in, iw)) { /* two columns per item */
      p.NX = (int)ut__cuda_cdiv(ow, 2); p.NS = (int)ut__cuda_cdiv(oh, R);
      p.items = (unsigned)((ut__i64)n * c * p.NS * p.NX);
      p.vec2 = ow % 2 == 0 && (reinterpret_cast<uintptr_t>(out) & 3) == 0;
      ut__cuda_dwconv2d_strip_divisors(&p);
      return ut__cuda_dwconv2d_strip2_forward_start(p, R, flip, k, s, threads);
    }
  }
  p.NX = ow; p.NS = (int)ut__cuda_cdiv(oh, R);
  p.items = (unsigned)((ut__i64)n * c * p.NS * ow);
  ut__cuda_dwconv2d_strip_divisors(&p);
  return ut__cuda_dwconv2d_strip_forward_start(p, R, flip, k, s, threads);
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
      ut__cuda_dwconv2d_strip_divisors(&p);
      const int po = ut__cuda_dwconv2d_stripw_tdx_po(g->kh, g->pad, d);
      return ut__cuda_dwconv2d_stripw_tdx_start(p, RW, d, po, threads);
    }
  }
  p.NX = (int)ut__cuda_cdiv(g->w, 2); p.NS = (int)ut__cuda_cdiv(g->h, R);
  p.items = (unsigned)((ut__i64)g->n * g->c * p.NS * p.NX);
  p.vec2 = (g->w % 2 == 0) && ((reinterpret_cast<uintptr_t>(dx) & (2 * sizeof(T) - 1)) == 0);
  ut__cuda_dwconv2d_strip_divisors(&p);
  return ut__cuda_dwconv2d_strip_tdx_start(p, R, g->kh, d, threads);
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
                                          const ut__conv_geom* g,
                                          const ut__cuda_dw_bnp* bn = nullptr) {
  const int cols = ut__cuda_dwconv2d_strip2_dw_cols(go, x, g);
  const int R = cols > 2 ? ut__cuda_dwconv2d_stripw_rows(UT__CUDA_DWCONV2D_DW, g->stride)
                         : ut__cuda_dwconv2d_strip_rows(UT__CUDA_DWCONV2D_DW, g->stride, g->ho);
  const int threads = ut__cuda_dwconv2d_strip_threads();
  ut__cuda_dwconv2d_strip_params<T> p = {};
  p.in = x; p.go = go; p.part = ws;
  if (bn) p.bn = *bn;
  p.C = g->c; p.IH = g->h; p.IW = g->w; p.OH = g->ho; p.OW = g->wo; p.pad = g->pad;
  p.NX = (int)ut__cuda_cdiv(g->wo, cols); p.NS = (int)ut__cuda_cdiv(g->ho, R);
  const int parts = ut__cuda_dwconv2d_strip_dw_parts(g, cols, &p.items, &p.chunk);
  ut__cuda_dwconv2d_strip_divisors(&p);
  if constexpr (sizeof(T) == 2) {
    if (cols > 2) return ut__cuda_dwconv2d_stripw_dw_start(p, R, g->kh, g->stride, parts, threads);
    if (cols == 2) return ut__cuda_dwconv2d_strip2_dw_start(p, R, g->kh, g->stride, parts, threads);
  }
  return ut__cuda_dwconv2d_strip_dw_start(p, R, g->kh, g->stride, parts, threads);
}

/* ---- the choice of kernel and the entry points ---- */

/* the filter shapes with a tiled kernel */
static bool ut__cuda_dwconv2d_tile_shape(int kh, int kw, int s) {
  return kh == kw && (kh == 3 || kh == 5 || kh == 7) && (s == 1 || s == 2);
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
static int ut__cuda_dwconv2d_zero(float* x, ut__i64 n) { return ut__cuda_fill(UT_F32, x, n, 0.f); }
static int ut__cuda_dwconv2d_zero(ut__cuda_bf16* x, ut__i64 n) {
  return ut__cuda_fill(UT_BF16, x, n, 0.f);
}

/* The fastest kernel for the geometry; *exact tells whether that was the plain kernel, which
   sums real input only (then a non-finite weight needs no second pass). */
template <typename T>
static int ut__cuda_dwconv2d_forward_fast(const T* x, const float* w, const float* bias, T* y,
                                          const ut__conv_geom* g, bool* exact) {
  ut__i64 total = (ut__i64)g->n * g->c * g->ho * g->wo;
  *exact = false;
  if (total <= 0) return UT_OK;
  if (g->dil == 1 && ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_FWD, g))
    return ut__cuda_dwconv2d_strip_forward_run(x, w, bias, y, g->n, g->c, g->h, g->w, g->ho, g->wo,
                                               g->kh, g->stride, g->pad, false);
  ut__cuda_dwconv2d_tile_plan pl;
  if (g->dil == 1 && ut__cuda_dwconv2d_tile_shape(g->kh, g->kw, g->stride) &&
      ut__cuda_dwconv2d_tile_plan_for(UT__CUDA_DWCONV2D_FWD, g->n, g->c, g->h, g->w, g->ho, g->wo,
                                      g->kh, g->stride, g->kh * g->kw, &pl)) {
    ut__cuda_dwconv2d_tile_params<T> p;
    ut__cuda_dwconv2d_tile_params_set<T>(&p, x, w, bias, NULL, y, NULL, g->n, g->c, g->h, g->w,
                                         g->ho, g->wo, g->pad, g->pad);
    return ut__cuda_dwconv2d_tile_dispatch<UT__CUDA_DWCONV2D_FWD>(p, pl, g->kh, g->stride);
  }
  *exact = true; /* the general and the plain kernels sum real input only */
  if (ut__cuda_dwconv2d_gen_fits(g))
    return ut__cuda_dwconv2d_gen_forward_run(x, w, bias, y, g, false);
  return ut__cuda_dwconv2d_direct_forward_run(x, w, bias, y, g);
}

/* dx by the general strip kernels where they fit, else the plain kernel; both sum real
   input only */
template <typename T>
static int ut__cuda_dwconv2d_backward_dx_general(const T* go, const float* w, T* dx,
                                                 const ut__conv_geom* g) {
  if (!ut__cuda_dwconv2d_gen_fits(g)) return ut__cuda_dwconv2d_direct_dx_run(go, w, dx, g);
  if (g->stride == 1) return ut__cuda_dwconv2d_gen_forward_run(go, w, NULL, dx, g, true);
  return ut__cuda_dwconv2d_gen_tdx_run(go, w, dx, g);
}

template <typename T>
static int ut__cuda_dwconv2d_backward_dx_fast(const T* go, const float* w, T* dx,
                                              const ut__conv_geom* g, bool* exact) {
  ut__i64 total = (ut__i64)g->n * g->c * g->h * g->w;
  *exact = true; /* nothing multiplied, or the plain kernel */
  if (total <= 0) return UT_OK;
  if (g->ho <= 0 || g->wo <= 0) return ut__cuda_dwconv2d_zero(dx, total);
  if (g->dil > 1) return ut__cuda_dwconv2d_backward_dx_general(go, w, dx, g);
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
  return ut__cuda_dwconv2d_backward_dx_general(go, w, dx, g);
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
  } else if (ut__cuda_dwconv2d_gen_fits(g)) {
    unsigned items, chunk;
    parts = ut__cuda_dwconv2d_gen_dw_parts(g, &items, &chunk);
    st = ut__cuda_workspace_acquire((size_t)g->c * parts * NT * sizeof(float), &ws);
    if (st) return st;
    st = ut__cuda_dwconv2d_gen_dw_run(go, x, ws, g);
    if (st) return st;
  } else {
    ut__i64 m = (ut__i64)g->n * g->ho * g->wo;
    ut__i64 chunk;
    parts = ut__cuda_channel_chunks(g->c, m, &chunk);
    st = ut__cuda_workspace_acquire((size_t)g->c * parts * NT * sizeof(float), &ws);
    if (st) return st;
    st = ut__cuda_dwconv2d_direct_dw_start(go, x, g, chunk, parts, ws);
    if (st) return st;
    plain = true;
  }
  return ut__cuda_dwconv2d_dw_final_start<T>(ws, dw, g->c, NT, parts, plain ? NULL : go, x, g);
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

/* The table's slots: float32, and bf16 activations (the same kernels on ut__cuda_bf16; see the
   top of this file). */
int ut__cuda_dw_fwd(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                    const ut__conv_geom* g) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_dwconv2d_forward_run<float>(static_cast<const float*>(x), w, bias,
                                                  static_cast<float*>(y), g);
    case UT_BF16:
      return ut__cuda_dwconv2d_forward_run<ut__cuda_bf16>(static_cast<const ut__cuda_bf16*>(x),
                                                          w, bias,
                                                          static_cast<ut__cuda_bf16*>(y), g);
  }
  return ut__cuda_no_dtype("dw_fwd", dt);
}

int ut__cuda_dw_bwd_dx(ut_dtype dt, const void* go, const float* w, void* dx,
                       const ut__conv_geom* g) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_dwconv2d_backward_dx_run<float>(static_cast<const float*>(go), w,
                                                      static_cast<float*>(dx), g);
    case UT_BF16:
      return ut__cuda_dwconv2d_backward_dx_run<ut__cuda_bf16>(
          static_cast<const ut__cuda_bf16*>(go), w, static_cast<ut__cuda_bf16*>(dx), g);
  }
  return ut__cuda_no_dtype("dw_bwd_dx", dt);
}

int ut__cuda_dw_bwd_dw(ut_dtype dt, const void* go, const void* x, float* dw,
                       const ut__conv_geom* g) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_dwconv2d_backward_dw_run<float>(static_cast<const float*>(go),
                                                      static_cast<const float*>(x), dw, g);
    case UT_BF16:
      return ut__cuda_dwconv2d_backward_dw_run<ut__cuda_bf16>(
          static_cast<const ut__cuda_bf16*>(go), static_cast<const ut__cuda_bf16*>(x), dw, g);
  }
  return ut__cuda_no_dtype("dw_bwd_dw", dt);
}

/* ---- a BatchNorm folded into the loads (ut_batchnorm2d_dwconv2d_forward) ----
   The strip kernels' shapes take it (the forward and dW kernels with BN; the forward's rerun for
   non-finite weights and dW's re-sum of a non-finite tap normalize as they load too); every
   other geometry, and the activations past RELU6, return 1 and the core runs the two layers. */
static bool ut__cuda_dw_bnp_of(const ut__dw_bn* bn, ut__cuda_dw_bnp* p) {
  if (bn->act != UT_ACT_NONE && bn->act != UT_ACT_RELU && bn->act != UT_ACT_RELU6) return false;
  p->mean = bn->mean; p->var = bn->var; p->gamma = bn->gamma; p->beta = bn->beta;
  p->eps = bn->eps;
  p->cap = bn->act == UT_ACT_RELU6 ? 6.f : bn->act == UT_ACT_RELU ? 0.f : -1.f;
  return true;
}

template <typename T>
static int ut__cuda_dwconv2d_forward_bn_run(const T* x, const float* w, const float* bias, T* y,
                                            const ut__conv_geom* g, const ut__dw_bn* bn) {
  ut__cuda_dw_bnp p = {};
  if (!ut__cuda_dw_bnp_of(bn, &p) || g->dil != 1 ||
      !ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_FWD, g))
    return 1;
  if ((ut__i64)g->n * g->c * g->ho * g->wo <= 0) return UT_OK;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  int st = ut__cuda_dwconv2d_strip_forward_run(x, w, bias, y, g->n, g->c, g->h, g->w, g->ho,
                                               g->wo, g->kh, g->stride, g->pad, false, &p);
  if (st) return st;
  return ut__cuda_dwconv2d_exact_run<T, false>(x, w, bias, y, g, p);
}

template <typename T>
static int ut__cuda_dwconv2d_backward_dw_bn_run(const T* go, const T* x, float* dw,
                                                const ut__conv_geom* g, const ut__dw_bn* bn) {
  ut__cuda_dw_bnp p = {};
  if (!ut__cuda_dw_bnp_of(bn, &p) || g->dil != 1 ||
      !ut__cuda_dwconv2d_strip_pick(UT__CUDA_DWCONV2D_DW, g))
    return 1;
  const int NT = g->kh * g->kw;
  if ((ut__i64)g->c * NT <= 0 || (ut__i64)g->n * g->ho * g->wo <= 0) return UT_OK;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  unsigned items, chunk;
  const int parts = ut__cuda_dwconv2d_strip_dw_parts(
      g, ut__cuda_dwconv2d_strip2_dw_cols(go, x, g), &items, &chunk);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)g->c * parts * NT * sizeof(float), &ws);
  if (st) return st;
  st = ut__cuda_dwconv2d_strip_dw_run(go, x, ws, g, &p);
  if (st) return st;
  return ut__cuda_dwconv2d_dw_final_start<T>(ws, dw, g->c, NT, parts, go, x, g, p);
}

int ut__cuda_dw_fwd_bn(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                       const ut__conv_geom* g, const ut__dw_bn* bn) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_dwconv2d_forward_bn_run<float>(static_cast<const float*>(x), w, bias,
                                                     static_cast<float*>(y), g, bn);
    case UT_BF16:
      return ut__cuda_dwconv2d_forward_bn_run<ut__cuda_bf16>(
          static_cast<const ut__cuda_bf16*>(x), w, bias, static_cast<ut__cuda_bf16*>(y), g, bn);
  }
  return ut__cuda_no_dtype("dw_fwd_bn", dt);
}

int ut__cuda_dw_bwd_dw_bn(ut_dtype dt, const void* go, const void* x, float* dw,
                          const ut__conv_geom* g, const ut__dw_bn* bn) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_dwconv2d_backward_dw_bn_run<float>(static_cast<const float*>(go),
                                                         static_cast<const float*>(x), dw, g, bn);
    case UT_BF16:
      return ut__cuda_dwconv2d_backward_dw_bn_run<ut__cuda_bf16>(
          static_cast<const ut__cuda_bf16*>(go), static_cast<const ut__cuda_bf16*>(x), dw, g, bn);
  }
  return ut__cuda_no_dtype("dw_bwd_dw_bn", dt);
}
