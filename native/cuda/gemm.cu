/* gemm.cu — the GEMM engine (matmul, linear and conv2d run on it), conv2d's im2col and
   col2im, and the exact pass after a padded conv2d's GEMM. Every GEMM goes to cuBLAS first
   (blas.cu); the kernels here run the ones it declines, all of them when cuBLAS is absent or
   off. The files and the naming: common.cuh. */
#include "common.cuh"

/* ============================================================================================
   GEMM: shared-memory tiles of BM x BN over k-steps of 8, each thread a TM x TN register block
   (two 4-wide groups per dimension for 8x8, so shared reads are conflict-free float4s). Tiles
   are double-buffered in shared memory with the next tile prefetched into registers during the
   current tile's arithmetic. blockIdx.z runs over batch items (and k-splits); with sum_batch the
   k-loop runs over the tiles of all batch items. Edges are handled by zero-filled loads and
   guarded stores. With splits > 1 each split writes raw partial sums to a workspace and a second
   kernel adds them in a fixed order (deterministic).
   ============================================================================================ */

struct ut__cuda_gemm_params {
  const float* a;
  const float* b;
  float* c;
  float* ws;
  ut__i64 sa, sb, sc;
  int m, n, k, lda, ldb, ldc;
  int batch;   /* items in this launch */
  int splits;  /* k-splits per output tile */
  int ktiles;  /* k-steps per batch item */
  ut__i64 tps; /* k-steps per split */
  float alpha, beta;
  int sum_batch;
};

template <int BM, int BN, int TM, int TN, bool TA, bool TB, int MINB>
static __global__ void __launch_bounds__((BM / TM) * (BN / TN), MINB)
    ut__cuda_gemm_kernel(ut__cuda_gemm_params p) {
  constexpr int BK = 8;
  constexpr int NT = (BM / TM) * (BN / TN);
  constexpr int LA = BM * BK / NT, LB = BN * BK / NT;
  constexpr int GM = TM / 4, GN = TN / 4;      /* 4-wide groups per thread */
  constexpr int SM_ = BM / GM, SN_ = BN / GN;  /* distance between a thread's groups */
  __shared__ __align__(16) float As[2][BK][BM + 4];
  __shared__ __align__(16) float Bs[2][BK][BN + 4];

  const int tid = threadIdx.x;
  const int tx = tid % (BN / TN), ty = tid / (BN / TN);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int z = blockIdx.z;
  const int item = p.sum_batch ? 0 : z / p.splits;
  const int split = p.sum_batch ? z : z % p.splits;
  const ut__i64 total = p.sum_batch ? (ut__i64)p.batch * p.ktiles : (ut__i64)p.ktiles;
  const ut__i64 t0 = (ut__i64)split * p.tps;
  const ut__i64 t1 = t0 + p.tps < total ? t0 + p.tps : total;

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

  float ra[LA], rb[LB];

  auto load = [&](ut__i64 t) {
    int bi = p.sum_batch ? (int)(t / p.ktiles) : item;
    int k0 = (int)(p.sum_batch ? t % p.ktiles : t) * BK;
    const float* A = p.a + bi * p.sa;
    const float* B = p.b + bi * p.sb;
#pragma unroll
    for (int q = 0; q < LA; ++q) {
      int idx = tid + q * NT;
      int gm, gk;
      if (!TA) { gm = m0 + idx / BK; gk = k0 + idx % BK; }
      else { gk = k0 + idx / BM; gm = m0 + idx % BM; }
      bool ok = gm < p.m && gk < p.k;
      ra[q] = ok ? __ldg(TA ? A + (ut__i64)gk * p.lda + gm : A + (ut__i64)gm * p.lda + gk) : 0.f;
    }
#pragma unroll
    for (int q = 0; q < LB; ++q) {
      int idx = tid + q * NT;
      int gn, gk;
      if (!TB) { gk = k0 + idx / BN; gn = n0 + idx % BN; }
      else { gn = n0 + idx / BK; gk = k0 + idx % BK; }
      bool ok = gn < p.n && gk < p.k;
      rb[q] = ok ? __ldg(TB ? B + (ut__i64)gn * p.ldb + gk : B + (ut__i64)gk * p.ldb + gn) : 0.f;
    }
  };
  auto store = [&](int buf) {
#pragma unroll
    for (int q = 0; q < LA; ++q) {
      int idx = tid + q * NT;
      if (!TA) As[buf][idx % BK][idx / BK] = ra[q];
      else As[buf][idx / BM][idx % BM] = ra[q];
    }
#pragma unroll
    for (int q = 0; q < LB; ++q) {
      int idx = tid + q * NT;
      if (!TB) Bs[buf][idx / BN][idx % BN] = rb[q];
      else Bs[buf][idx % BK][idx / BK] = rb[q];
    }
  };

  if (t0 < t1) {
    load(t0);
    store(0);
    __syncthreads();
    int buf = 0;
    for (ut__i64 t = t0; t < t1; ++t) {
      const bool more = t + 1 < t1;
      if (more) load(t + 1);
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        float fa[TM], fb[TN];
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          float4 v = *reinterpret_cast<const float4*>(&As[buf][kk][g * SM_ + ty * 4]);
          fa[g * 4 + 0] = v.x; fa[g * 4 + 1] = v.y; fa[g * 4 + 2] = v.z; fa[g * 4 + 3] = v.w;
        }
#pragma unroll
        for (int g = 0; g < GN; ++g) {
          float4 v = *reinterpret_cast<const float4*>(&Bs[buf][kk][g * SN_ + tx * 4]);
          fb[g * 4 + 0] = v.x; fb[g * 4 + 1] = v.y; fb[g * 4 + 2] = v.z; fb[g * 4 + 3] = v.w;
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(fa[i], fb[j], acc[i][j]);
      }
      if (more) store(buf ^ 1);
      __syncthreads();
      buf ^= 1;
    }
  }

  float* C = p.c + (p.sum_batch ? 0 : item * p.sc);
  float* W = p.ws + (ut__i64)z * p.m * p.n;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    int row = m0 + (i / 4) * SM_ + ty * 4 + (i % 4);
    if (row >= p.m) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      int col = n0 + (j / 4) * SN_ + tx * 4 + (j % 4);
      if (col >= p.n) continue;
      if (p.splits == 1) {
        float* cp = C + (ut__i64)row * p.ldc + col;
        float v = p.alpha * acc[i][j];
        if (p.beta != 0.f) v += p.beta * *cp;
        *cp = v;
      } else {
        W[(ut__i64)row * p.n + col] = acc[i][j];
      }
    }
  }
}

/* C = alpha * (sum over splits, in order) + beta * C */
static __global__ void ut__cuda_gemm_split_reduce_kernel(ut__cuda_gemm_params p, ut__i64 total) {
  const ut__i64 mn = (ut__i64)p.m * p.n;
  UT__CUDA_GRID_STRIDE(i, total) {
    ut__i64 item = i / mn, rc = i % mn;
    int row = (int)(rc / p.n), col = (int)(rc % p.n);
    float s = 0.f;
    const float* w = p.ws + item * p.splits * mn + rc;
    for (int q = 0; q < p.splits; ++q) s += w[(ut__i64)q * mn];
    float* cp = p.c + (p.sum_batch ? 0 : item * p.sc) + (ut__i64)row * p.ldc + col;
    float v = p.alpha * s;
    if (p.beta != 0.f) v += p.beta * *cp;
    *cp = v;
  }
}

template <int BM, int BN, int TM, int TN, int MINB>
static int ut__cuda_gemm_launch(const ut__cuda_gemm_params& p, bool ta, bool tb, dim3 grid) {
  const int nt = (BM / TM) * (BN / TN);
  if (!ta && !tb) ut__cuda_gemm_kernel<BM, BN, TM, TN, false, false, MINB>
      <<<grid, nt, 0, ut__cuda_stream>>>(
      p);
  else if (!ta && tb) ut__cuda_gemm_kernel<BM, BN, TM, TN, false, true, MINB>
      <<<grid, nt, 0, ut__cuda_stream>>>(
      p);
  else if (ta && !tb) ut__cuda_gemm_kernel<BM, BN, TM, TN, true, false, MINB>
      <<<grid, nt, 0, ut__cuda_stream>>>(
      p);
  else ut__cuda_gemm_kernel<BM, BN, TM, TN, true, true, MINB><<<grid, nt, 0, ut__cuda_stream>>>(p);
  UT__CUDA_LAUNCHED("gemm");
  return UT_OK;
}

/* 1: the 128x128 kernel may use all registers it wants (one block per multiprocessor);
   2: it is held to 128 registers for two blocks (the harness times both) */
static int ut__cuda_gemm_min_blocks = 2;

static int ut__cuda_gemm_dispatch(const ut__cuda_gemm_params& p, bool big, bool ta, bool tb,
                                  dim3 grid) {
  if (!big) return ut__cuda_gemm_launch<64, 64, 4, 4, 1>(p, ta, tb, grid);
  if (ut__cuda_gemm_min_blocks == 2)
    return ut__cuda_gemm_launch<128, 128, 8, 8, 2>(p, ta, tb, grid);
  return ut__cuda_gemm_launch<128, 128, 8, 8, 1>(p, ta, tb, grid);
}

/* k = 0: C_i = beta C_i (C bf16; with beta == 0 C is not read) */
template <typename T>
static __global__ void ut__cuda_gemm_beta_kernel(T* __restrict__ c, int n, int ldc, ut__i64 sc,
                                                 ut__i64 mn, ut__i64 total, float beta) {
  UT__CUDA_GRID_STRIDE(i, total) {
    ut__i64 item = i / mn, rc = i % mn;
    T* cp = c + item * sc + (rc / n) * ldc + rc % n;
    ut__cuda_st(cp, beta != 0.f ? beta * ut__cuda_ld(cp) : 0.f);
  }
}

/* A GEMM with bf16 operands that cuBLAS did not take: k = 0 is C = beta C; anything else is
   an error, since the kernels above are float32 only (they would read bf16 as float). */
static int ut__cuda_gemm_bf16_declined(ut_dtype c_dt, const ut__gemm_args* g) {
  if (g->k <= 0) {
    const ut__i64 items = g->sum_batch ? 1 : g->batch, mn = (ut__i64)g->m * g->n;
    const ut__i64 total = items * mn;
    if (c_dt == UT_BF16)
      ut__cuda_gemm_beta_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
          (ut__cuda_bf16*)g->c, g->n, g->ldc, g->stride_c, mn, total, g->beta);
    else
      ut__cuda_gemm_beta_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
          (float*)g->c, g->n, g->ldc, g->stride_c, mn, total, g->beta);
    UT__CUDA_LAUNCHED("gemm_bf16 (k = 0)");
    return UT_OK;
  }
  if (ut__cuda_blas_active())
    return ut__set_error(UT_ERR_DEVICE,
                         "gemm: bf16 matrix products on the GPU need cuBLAS (utensil's own GEMM "
                         "kernels are float32 only), and cuBLAS cannot take this one: m %d, n "
                         "%d, k %d with lda %d, ldb %d, ldc %d",
                         g->m, g->n, g->k, g->lda, g->ldb, g->ldc);
  return ut__set_error(UT_ERR_DEVICE,
                       "gemm: bf16 matrix products on the GPU need cuBLAS (utensil's own GEMM "
                       "kernels are float32 only), and it is not in use: %s. Load it "
                       "(ut_cublas_load, ut_cublas_enable) or keep these activations float32",
                       ut__cuda_blas_info());
}

int ut__cuda_gemm(ut_dtype ab_dt, ut_dtype c_dt, const ut__gemm_args* g) {
  if (!g) return ut__set_error(UT_ERR_ARG, "gemm: NULL arguments");
  const bool bf16 = ab_dt != UT_F32 || c_dt != UT_F32;
  /* the pairs there are: float32 throughout, bf16 A and B into a bf16 or a float32 C */
  if (bf16 && (ab_dt != UT_BF16 || (c_dt != UT_F32 && c_dt != UT_BF16)))
    return ut__set_error(UT_ERR_ARG, "gemm: A and B of type %d with C of type %d are not supported",
                         (int)ab_dt, (int)c_dt);
  if (g->m <= 0 || g->n <= 0 || g->batch <= 0) return UT_OK;
  int blas = ut__cuda_blas_gemm(ab_dt, c_dt, g);
  if (blas != UT__CUDA_BLAS_DECLINED) return blas;
  if (bf16) return ut__cuda_gemm_bf16_declined(c_dt, g);
  ut__cuda_gemm_params p; /* float32 from here on */
  p.a = (const float*)g->a; p.b = (const float*)g->b; p.c = (float*)g->c; p.ws = NULL;
  p.sa = g->stride_a; p.sb = g->stride_b; p.sc = g->stride_c;
  p.m = g->m; p.n = g->n; p.k = g->k > 0 ? g->k : 0;
  p.lda = g->lda; p.ldb = g->ldb; p.ldc = g->ldc;
  p.alpha = g->alpha; p.beta = g->beta;
  p.sum_batch = g->sum_batch ? 1 : 0;
  p.ktiles = (int)ut__cuda_cdiv(p.k, 8);

  const ut__i64 items = p.sum_batch ? 1 : g->batch;
  const bool big = ut__cuda_cdiv(p.m, 128) * ut__cuda_cdiv(p.n, 128) * items >= ut__cuda_sms;
  const int bm = big ? 128 : 64, bn = big ? 128 : 64;
  const ut__i64 tiles_mn = ut__cuda_cdiv(p.m, bm) * ut__cuda_cdiv(p.n, bn);
  const ut__i64 ktotal = p.sum_batch ? (ut__i64)g->batch * p.ktiles : p.ktiles;
  ut__i64 splits = 1;
  if (tiles_mn * items < ut__cuda_sms && ktotal >= 32) {
    splits = ut__cuda_cdiv(2 * ut__cuda_sms, tiles_mn * items);
    if (splits > ktotal / 16) splits = ktotal / 16;
    if (splits > 64) splits = 64;
    if (splits < 1) splits = 1;
  }
  if (items * splits > 65535) splits = 1;
  p.tps = ktotal > 0 ? ut__cuda_cdiv(ktotal, splits) : 1;
  if (ktotal > 0) splits = ut__cuda_cdiv(ktotal, p.tps);
  p.splits = (int)splits;

  dim3 grid((unsigned)ut__cuda_cdiv(p.n, bn), (unsigned)ut__cuda_cdiv(p.m, bm), 1);
  if (grid.y > 65535) return ut__set_error(UT_ERR_SHAPE, "gemm: m = %d is too large", p.m);

  if (splits == 1) {
    /* items beyond gridDim.z's limit go in several launches */
    const int zmax = 65535;
    for (ut__i64 b0 = 0; b0 < items; b0 += zmax) {
      ut__cuda_gemm_params q = p;
      ut__i64 nb = items - b0 < zmax ? items - b0 : zmax;
      q.a += b0 * p.sa; q.b += b0 * p.sb; q.c += b0 * p.sc;
      q.batch = p.sum_batch ? g->batch : (int)nb;
      grid.z = (unsigned)(p.sum_batch ? 1 : nb);
      int st = ut__cuda_gemm_dispatch(q, big, g->trans_a, g->trans_b, grid);
      if (st) return st;
    }
    return UT_OK;
  }
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)(items * splits) * p.m * p.n * sizeof(float), &ws);
  if (st) return st;
  p.ws = ws;
  p.batch = g->batch;
  grid.z = (unsigned)(items * splits);
  st = ut__cuda_gemm_dispatch(p, big, g->trans_a, g->trans_b, grid);
  if (st) return st;
  ut__i64 total = items * p.m * p.n;
  ut__cuda_gemm_split_reduce_kernel<<<ut__cuda_grid_for(total, 256), 256, 0, ut__cuda_stream>>>(
      p, total);
  UT__CUDA_LAUNCHED("gemm split reduce");
  return UT_OK;
}

/* ============================================================================================
   conv2d: im2col / col2im
   ============================================================================================ */

/* One thread per W consecutive columns of one row of col [n, c*kh*kw, ho*wo] (W divides
   ho*wo), stored as one vector of W * sizeof(T) bytes (16 or 8; W = 1 stores one element).
   Indexed with I = 32-bit integers when col allows: the divisions that find a group's image,
   row and output position are the kernel's main cost, and in 64 bits they cost several times
   more. A move: bf16 values are copied, not rounded. */
template <int W, typename T>
struct ut__cuda_units {
  static_assert(W == 1, "no vector unit of this width for this type");
  typedef T type;
};
template <>
struct ut__cuda_units<8, ut__cuda_bf16> {
  typedef uint4 type;
};
template <>
struct ut__cuda_units<4, ut__cuda_bf16> {
  typedef uint2 type;
};
template <>
struct ut__cuda_units<4, float> {
  typedef uint4 type;
};

template <int W, typename T, typename I>
static __global__ void ut__cuda_conv2d_im2col_kernel(const T* __restrict__ x,
                                                     T* __restrict__ col, ut__conv_geom g,
                                                     I groups) {
  typedef typename ut__cuda_units<W, T>::type unit;
  const I hw = (I)g.ho * g.wo;
  const int K = g.c * g.kh * g.kw, rows = g.kp ? g.kp : K;
  for (I v = (I)blockIdx.x * blockDim.x + threadIdx.x; v < groups; v += (I)gridDim.x * blockDim.x) {
    const I i = v * W;
    const I t = i / hw;
    const int pos = (int)(i - t * hw);
    const int row = (int)(t % rows);
    const I ni = t / rows;
    union {
      unit u;
      T e[W];
    } out;
    if (row >= K) { /* the rows that round K up for the GEMM (ut__conv_col_rows) */
#pragma unroll
      for (int u = 0; u < W; ++u) out.e[u] = T(0.f);
      *reinterpret_cast<unit*>(col + i) = out.u;
      continue;
    }
    const int kx = row % g.kw, ky = (row / g.kw) % g.kh, ci = row / (g.kw * g.kh);
    const T* xp = x + (ni * g.c + ci) * (I)g.h * g.w;
    int oy = pos / g.wo, ox = pos % g.wo;
#pragma unroll
    for (int u = 0; u < W; ++u) {
      const int iy = oy * g.stride - g.pad + ky, ix = ox * g.stride - g.pad + kx;
      out.e[u] = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w ? xp[iy * g.w + ix] : T(0.f);
      if (++ox == g.wo) {
        ox = 0;
        ++oy;
      }
    }
    *reinterpret_cast<unit*>(col + i) = out.u;
  }
}

/* the adjoint of im2col as a gather: one thread per dx element sums the columns that read it
   (in float32; a bf16 dx is rounded once, at the store) */
/* Each dx element sums the column entries of the windows that cover it. Indexed with I =
   32-bit integers when both buffers allow: the index's divisions are most of the kernel's
   work, and in 64 bits they cost several times more (a ConvNeXt downsampling's col2im took
   450 us for 77 MB). */
template <typename T, typename I>
static __global__ void ut__cuda_conv2d_col2im_kernel(const T* __restrict__ col,
                                                     T* __restrict__ dx, ut__conv_geom g,
                                                     I total) {
  const I hw = (I)g.ho * (I)g.wo;
  const I rows = g.kp ? (I)g.kp : (I)g.c * g.kh * g.kw;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {
    int ix = (int)(i % (I)g.w);
    I t = i / (I)g.w;
    int iy = (int)(t % (I)g.h);
    t /= (I)g.h;
    int ci = (int)(t % (I)g.c);
    I ni = t / (I)g.c;
    float s = 0.f;
    for (int ky = 0; ky < g.kh; ++ky) {
      int ty = iy + g.pad - ky;
      if (ty < 0 || ty % g.stride) continue;
      int oy = ty / g.stride;
      if (oy >= g.ho) continue;
      for (int kx = 0; kx < g.kw; ++kx) {
        int tx = ix + g.pad - kx;
        if (tx < 0 || tx % g.stride) continue;
        int ox = tx / g.stride;
        if (ox >= g.wo) continue;
        s += ut__cuda_ld(col + (ni * rows + (I)((ci * g.kh + ky) * g.kw + kx)) * hw +
                         (I)oy * g.wo + ox);
      }
    }
    ut__cuda_st(dx + i, s);
  }
}

template <typename T>
static int ut__cuda_im2col_t(const T* x, T* col, const ut__conv_geom* g, const char* what) {
  const ut__i64 rows = g->kp ? g->kp : (ut__i64)g->c * g->kh * g->kw;
  ut__i64 total = (ut__i64)g->n * rows * g->ho * g->wo;
  if (total <= 0) return UT_OK;
  const ut__i64 hw = (ut__i64)g->ho * g->wo;
  const int w = hw % 8 == 0 && (uintptr_t)col % 16 == 0 ? 16 / (int)sizeof(T)
                : hw % 4 == 0 && (uintptr_t)col % (4 * sizeof(T)) == 0 ? 4 : 1;
  const unsigned blocks = ut__cuda_grid_for(total / w, 256);
  const bool narrow = total <= (ut__i64)UINT_MAX;
  if (w == 8) {
    /* bf16 only (16 bytes); a float32 group of 16 bytes is w = 4 */
    if constexpr (sizeof(T) == 2) {
      if (narrow)
        ut__cuda_conv2d_im2col_kernel<8, T, unsigned><<<blocks, 256, 0, ut__cuda_stream>>>(
            x, col, *g, (unsigned)(total / 8));
      else
        ut__cuda_conv2d_im2col_kernel<8, T, ut__i64><<<blocks, 256, 0, ut__cuda_stream>>>(
            x, col, *g, total / 8);
    }
  } else if (w == 4) {
    if (narrow)
      ut__cuda_conv2d_im2col_kernel<4, T, unsigned><<<blocks, 256, 0, ut__cuda_stream>>>(
          x, col, *g, (unsigned)(total / 4));
    else
      ut__cuda_conv2d_im2col_kernel<4, T, ut__i64><<<blocks, 256, 0, ut__cuda_stream>>>(
          x, col, *g, total / 4);
  } else {
    if (narrow)
      ut__cuda_conv2d_im2col_kernel<1, T, unsigned><<<blocks, 256, 0, ut__cuda_stream>>>(
          x, col, *g, (unsigned)total);
    else
      ut__cuda_conv2d_im2col_kernel<1, T, ut__i64><<<blocks, 256, 0, ut__cuda_stream>>>(
          x, col, *g, total);
  }
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

template <typename T>
static int ut__cuda_col2im_t(const T* col, T* dx, const ut__conv_geom* g, const char* what) {
  ut__i64 total = (ut__i64)g->n * g->c * g->h * g->w;
  if (total <= 0) return UT_OK;
  const ut__i64 col_total =
      (ut__i64)g->n * (g->kp ? g->kp : (ut__i64)g->c * g->kh * g->kw) * g->ho * g->wo;
  const unsigned blocks = ut__cuda_grid_for(total, 256);
  if (total <= (ut__i64)UINT_MAX && col_total <= (ut__i64)UINT_MAX)
    ut__cuda_conv2d_col2im_kernel<T, unsigned><<<blocks, 256, 0, ut__cuda_stream>>>(
        col, dx, *g, (unsigned)total);
  else
    ut__cuda_conv2d_col2im_kernel<T, ut__i64><<<blocks, 256, 0, ut__cuda_stream>>>(col, dx, *g,
                                                                                  total);
  UT__CUDA_LAUNCHED(what);
  return UT_OK;
}

int ut__cuda_im2col(ut_dtype dt, const void* x, void* col, const ut__conv_geom* g) {
  switch (dt) {
    case UT_F32: return ut__cuda_im2col_t((const float*)x, (float*)col, g, "im2col");
    case UT_BF16:
      return ut__cuda_im2col_t((const ut__cuda_bf16*)x, (ut__cuda_bf16*)col, g, "im2col_bf16");
  }
  return ut__cuda_no_dtype("im2col", dt);
}

int ut__cuda_col2im(ut_dtype dt, const void* col, void* dx, const ut__conv_geom* g) {
  switch (dt) {
    case UT_F32: return ut__cuda_col2im_t((const float*)col, (float*)dx, g, "col2im");
    case UT_BF16:
      return ut__cuda_col2im_t((const ut__cuda_bf16*)col, (ut__cuda_bf16*)dx, g, "col2im_bf16");
  }
  return ut__cuda_no_dtype("col2im", dt);
}

/* ============================================================================================
   conv2d: the exact pass after the GEMM of a padded convolution (the conv_exact slot)
   ============================================================================================
   The GEMM multiplies the columns' padding zeros too: a non-finite weight (forward) or
   grad_out (dW) turns those products into NaN, where the sum over real input only (PyTorch's,
   the CPU backend's) keeps the value. As dwconv2d's reruns (dw_exact.cu), the check is part
   of the pass, so finite data costs one launch of early-exiting blocks and no host round
   trip: a forward block reads its output channel's weights, a dW block its row of the GEMM's
   part (only a NaN there can have met padding). */

/* blocks (q, o): output channel o in steps of gridDim.y; a channel with a non-finite weight
   has its outputs recomputed by the blocks q in steps of gridDim.x */
template <typename T>
static __global__ void ut__cuda_conv2d_exact_y_kernel(const T* __restrict__ x,
                                                      const T* __restrict__ w,
                                                      const float* __restrict__ bias,
                                                      T* __restrict__ y, ut__conv_geom g,
                                                      int out_c) {
  const int taps = g.kh * g.kw, K = g.c * taps;
  const ut__i64 hw = (ut__i64)g.ho * g.wo, m = (ut__i64)g.n * hw, plane = (ut__i64)g.h * g.w;
  for (int o = blockIdx.y; o < out_c; o += gridDim.y) {
    const T* wo = w + (ut__i64)o * K;
    int bad = 0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) bad |= !isfinite(ut__cuda_ld(wo + k));
    if (!__syncthreads_or(bad)) continue;
    for (ut__i64 j = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x; j < m;
         j += (ut__i64)gridDim.x * blockDim.x) {
      const ut__i64 ni = j / hw;
      const int pos = (int)(j - ni * hw), oy = pos / g.wo, ox = pos % g.wo;
      float s = bias ? bias[o] : 0.f;
      for (int ci = 0; ci < g.c; ++ci) {
        const T* xp = x + (ni * g.c + ci) * plane;
        for (int ky = 0; ky < g.kh; ++ky) {
          const int iy = oy * g.stride - g.pad + ky * g.dil;
          if (iy < 0 || iy >= g.h) continue;
          for (int kx = 0; kx < g.kw; ++kx) {
            const int ix = ox * g.stride - g.pad + kx * g.dil;
            if (ix < 0 || ix >= g.w) continue;
            s = fmaf(ut__cuda_ld(wo + ci * taps + ky * g.kw + kx),
                     ut__cuda_ld(xp + (ut__i64)iy * g.w + ix), s);
          }
        }
      }
      ut__cuda_st(y + (ni * out_c + o) * hw + pos, s);
    }
  }
}

/* one block per row o of dw (in steps of gridDim.x): dw[o, :] += part[o, :], and each NaN of
   part summed again, by the whole block, over the outputs whose input is real (in double, as
   the CPU's) */
template <typename T>
static __global__ void ut__cuda_conv2d_exact_dw_kernel(const T* __restrict__ x,
                                                       const T* __restrict__ go,
                                                       const float* __restrict__ part,
                                                       float* __restrict__ dw, ut__conv_geom g,
                                                       int out_c) {
  __shared__ double sums[256];
  const int taps = g.kh * g.kw, K = g.c * taps;
  const ut__i64 hw = (ut__i64)g.ho * g.wo, m = (ut__i64)g.n * hw, plane = (ut__i64)g.h * g.w;
  for (int o = blockIdx.x; o < out_c; o += gridDim.x) {
    const float* po = part + (ut__i64)o * K;
    float* dwo = dw + (ut__i64)o * K;
    int nan = 0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      const float v = po[k];
      if (v != v) nan = 1;
      else dwo[k] += v;
    }
    if (!__syncthreads_or(nan)) continue;
    for (int k = 0; k < K; ++k) {
      if (po[k] == po[k]) continue; /* the same in every thread */
      const int ci = k / taps, ky = (k % taps) / g.kw, kx = k % g.kw;
      double s = 0.0;
      for (ut__i64 j = threadIdx.x; j < m; j += blockDim.x) {
        const ut__i64 ni = j / hw;
        const int pos = (int)(j - ni * hw), oy = pos / g.wo, ox = pos % g.wo;
        const int iy = oy * g.stride - g.pad + ky * g.dil, ix = ox * g.stride - g.pad + kx * g.dil;
        if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
        s += (double)ut__cuda_ld(go + (ni * out_c + o) * hw + pos) *
             ut__cuda_ld(x + (ni * g.c + ci) * plane + (ut__i64)iy * g.w + ix);
      }
      sums[threadIdx.x] = s;
      __syncthreads();
      for (int h = blockDim.x / 2; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) sums[threadIdx.x] += sums[threadIdx.x + h];
        __syncthreads();
      }
      if (threadIdx.x == 0) dwo[k] += (float)sums[0];
      __syncthreads();
    }
  }
}

template <typename T>
static int ut__cuda_conv_exact_t(ut__conv_dir dir, const T* x, const T* go, const T* w,
                                 const float* bias, const float* part, void* dst, int out_c,
                                 const ut__conv_geom* g) {
  const int cy = out_c < 65535 ? out_c : 65535;
  if (dir == UT__CONV_Y) {
    const ut__i64 m = (ut__i64)g->n * g->ho * g->wo;
    ut__i64 qx = ut__cuda_cdiv((ut__i64)ut__cuda_sms * 16, cy), need = ut__cuda_cdiv(m, 256);
    if (qx > need) qx = need;
    if (qx < 1) qx = 1;
    ut__cuda_conv2d_exact_y_kernel<T><<<dim3((unsigned)qx, (unsigned)cy), 256, 0,
                                        ut__cuda_stream>>>(x, w, bias, (T*)dst, *g, out_c);
    UT__CUDA_LAUNCHED("conv_exact y");
    return UT_OK;
  }
  if (dir != UT__CONV_DW) return ut__set_error(UT_ERR_ARG, "cuda conv_exact: no dx pass");
  ut__cuda_conv2d_exact_dw_kernel<T><<<(unsigned)cy, 256, 0, ut__cuda_stream>>>(
      x, go, part, (float*)dst, *g, out_c);
  UT__CUDA_LAUNCHED("conv_exact dw");
  return UT_OK;
}

int ut__cuda_conv_exact(ut_dtype dt, ut__conv_dir dir, const void* x, const void* go,
                        const void* w, const float* bias, const float* part, void* dst,
                        int out_c, const ut__conv_geom* g) {
  switch (dt) {
    case UT_F32:
      return ut__cuda_conv_exact_t(dir, (const float*)x, (const float*)go, (const float*)w, bias,
                                   part, dst, out_c, g);
    case UT_BF16:
      return ut__cuda_conv_exact_t(dir, (const ut__cuda_bf16*)x, (const ut__cuda_bf16*)go,
                                   (const ut__cuda_bf16*)w, bias, part, dst, out_c, g);
  }
  return ut__cuda_no_dtype("conv_exact", dt);
}
