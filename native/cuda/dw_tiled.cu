/* dw_tiled.cu — dwconv2d's tiled kernel (v2): a persistent grid, each block copying its next
   unit's input rows into shared memory with cp.async while it computes the current one; the
   four modes (forward, rotated filter for dx at stride 1, transposed dx, dW partials), the
   plan of units and the launch. The overview, the modes and the shared helpers:
   depthwise.cuh. */
#include "depthwise.cuh"

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

  /* the filter taps and, at the end, the dW block's sums are written out here rather than
     through ut__cuda_dwconv2d_load_w and ut__cuda_dwconv2d_dw_block_store (depthwise.cuh):
     through them this kernel's PTX changed (the order of its parameter loads, hoisting out of
     the persistent loop), and it is kept as it was measured */
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
      ut__cuda_dwconv2d_cols_in<KW>(ixb, p.IW, cv);

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
          if constexpr (MODE == UT__CUDA_DWCONV2D_DW)
            ut__cuda_dwconv2d_row_taps<true, KH, KW, S, R, 1, 0>(j, v, g, accw);
          else
            ut__cuda_dwconv2d_row_taps<false, KH, KW, S, R, 1, 0>(j, v, wr, acc);
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

/* ---- the plan and the launch ---- */

/* tunables (the self-check harness sweeps them) */
static int ut__cuda_dwconv2d_tile_tune_tin = 4096; /* input floats per unit to aim for */
static int ut__cuda_dwconv2d_tile_tune_threads = 128;
static const int UT__CUDA_DWCONV2D_TILE_R = 4; /* outputs per strip */
static const size_t UT__CUDA_DWCONV2D_TILE_SMEM_MAX = 96 * 1024;

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
bool ut__cuda_dwconv2d_tile_plan_for(int mode, int N, int C, int IH, int IW, int OH, int OW,
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

/* the kernel for the filter shape (the shapes: ut__cuda_dwconv2d_tile_shape, depthwise.cu) */
template <int MODE, typename T>
int ut__cuda_dwconv2d_tile_dispatch(const ut__cuda_dwconv2d_tile_params<T>& p,
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

#define UT__CUDA_DWCONV2D_TILE_INST(MODE, T)                                                   \
  template int ut__cuda_dwconv2d_tile_dispatch<MODE, T>(                                       \
      const ut__cuda_dwconv2d_tile_params<T>& p, const ut__cuda_dwconv2d_tile_plan& pl, int k, \
      int s);
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_FWD, float)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_FLIP, float)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_TDX, float)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_DW, float)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_FWD, ut__cuda_bf16)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_FLIP, ut__cuda_bf16)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_TDX, ut__cuda_bf16)
UT__CUDA_DWCONV2D_TILE_INST(UT__CUDA_DWCONV2D_DW, ut__cuda_bf16)
#undef UT__CUDA_DWCONV2D_TILE_INST
