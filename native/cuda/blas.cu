/* blas.cu — GEMMs on NVIDIA's cuBLAS, loaded at run time with dlopen (never linked, never
   shipped: libutensil.so keeps loading on machines without it, where gemm.cu's own kernels
   run). The files and the naming: common.cuh; the search order: utensil.h, "matrix products on
   the GPU".

   cuBLAS is declared here, not included: the few types and enum values below are cuBLAS's
   stable ABI (cublas_api.h, CUDA 11 to 13), so building needs no cuBLAS headers either. The
   library carries its own static CUDA runtime; it shares the driver's context with ours, and
   its stream 0 is ours, the legacy default stream, so its GEMMs are ordered with our kernels.

   Row-major C [m, n] = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so every call swaps
   the operands. sum_batch (C = sum over items of A_i B_i, conv2d's weight gradient) has no
   cuBLAS call of its own; it becomes one of two plans, whichever moves fewer bytes:
   - concatenate: the items' k-ranges laid end to end make one GEMM with k' = batch * k. An
     operand whose items are k-major rows already is (trans A, plain B); the other kind is
     regrouped by a transpose, [batch, rows, k] -> [rows, batch, k].
   - reduce: a strided batched GEMM writes each item's product to the workspace and a kernel
     sums them in item order (deterministic), in chunks that keep the workspace bounded.
   The choice depends only on the shapes, so results are reproducible run to run.

   bf16 activations (the gemm slot's ab_dt, c_dt): bf16 A and B into a bf16 or a float32 C
   go to the same call with CUDA_R_16BF operands and float32 compute (tensor cores; TF32 is a
   float32 setting and does not apply). The reduce plan keeps its workspace float32, so
   conv2d's float32 dW gets float32 products summed in float32 as on the float32 path. The own
   kernels are float32 only: a bf16 call cuBLAS does not take fails in gemm.cu. */
#include "common.cuh"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <new>

typedef void* ut__cublas_handle;
enum { UT__CUBLAS_OP_N = 0, UT__CUBLAS_OP_T = 1 };
enum { UT__CUDA_R_32F = 0, UT__CUDA_R_16BF = 14 };                /* cudaDataType */
enum { UT__CUBLAS_COMPUTE_32F = 68, UT__CUBLAS_COMPUTE_32F_FAST_TF32 = 77 }; /* cublasComputeType_t */
enum { UT__CUBLAS_GEMM_DEFAULT = -1 };                           /* cublasGemmAlgo_t */

/* One loaded cuBLAS: never freed (a GEMM on another thread may still hold it when a later
   ut_cublas_load replaces it; the library itself is never unloaded either). */
struct ut__cuda_blas {
  void* dl;
  ut__cublas_handle handle;
  int (*gemm_strided_batched)(ut__cublas_handle, int transa, int transb, int m, int n, int k,
                              const void* alpha, const void* a, int a_type, int lda,
                              long long stride_a, const void* b, int b_type, int ldb,
                              long long stride_b, const void* beta, void* c, int c_type, int ldc,
                              long long stride_c, int batch, int compute, int algo);
  const char* (*status_string)(int); /* NULL in old versions */
  int (*set_stream)(ut__cublas_handle, cudaStream_t);
  char info[1200];
};

static std::mutex ut__cuda_blas_lock;
static std::atomic<const ut__cuda_blas*> ut__cuda_blas_current{nullptr};
static std::atomic<bool> ut__cuda_blas_searched{false};
static std::atomic<bool> ut__cuda_blas_on{true};
static char ut__cuda_blas_why[2048] = "cuBLAS not searched for yet";

/* Loads path and makes a handle; on failure writes why to `why` and returns NULL. */
static ut__cuda_blas* ut__cuda_blas_open(const char* path, char* why, size_t why_n) {
  dlerror();
  void* dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    const char* e = dlerror();
    snprintf(why, why_n, "%s", e ? e : "dlopen failed");
    return NULL;
  }
  typedef int (*create_fn)(ut__cublas_handle*);
  typedef int (*version_fn)(ut__cublas_handle, int*);
  typedef int (*destroy_fn)(ut__cublas_handle);
  create_fn create = (create_fn)dlsym(dl, "cublasCreate_v2");
  version_fn version = (version_fn)dlsym(dl, "cublasGetVersion_v2");
  destroy_fn destroy = (destroy_fn)dlsym(dl, "cublasDestroy_v2");
  void* gemm = dlsym(dl, "cublasGemmStridedBatchedEx");
  void* set_stream = dlsym(dl, "cublasSetStream_v2");
  if (!create || !version || !destroy || !gemm || !set_stream) {
    snprintf(why, why_n, "%s is not a usable cuBLAS: it has no %s", path,
             !create ? "cublasCreate_v2" : !version ? "cublasGetVersion_v2"
             : !destroy ? "cublasDestroy_v2" : !gemm ? "cublasGemmStridedBatchedEx"
             : "cublasSetStream_v2");
    dlclose(dl);
    return NULL;
  }
  ut__cuda_blas* b = new (std::nothrow) ut__cuda_blas();
  if (!b) {
    snprintf(why, why_n, "out of host memory");
    return NULL;
  }
  b->dl = dl;
  b->gemm_strided_batched = (decltype(b->gemm_strided_batched))gemm;
  b->status_string = (const char* (*)(int))dlsym(dl, "cublasGetStatusString");
  b->set_stream = (decltype(b->set_stream))set_stream;
  int st = create(&b->handle);
  if (st != 0) {
    /* 1: not initialized (no driver or device for this cuBLAS), 3: allocation failed */
    snprintf(why, why_n, "%s: cublasCreate failed with status %d%s", path, st,
             st == 1 ? " (CUBLAS_STATUS_NOT_INITIALIZED: a driver too old for this cuBLAS?)"
             : st == 3 ? " (CUBLAS_STATUS_ALLOC_FAILED)" : "");
    delete b; /* the library stays loaded: unloading a half-initialized cuBLAS is not safe */
    return NULL;
  }
  int v = 0;
  version(b->handle, &v);
  snprintf(b->info, sizeof b->info, "cuBLAS %d.%d.%d (%s)", v / 10000, v / 100 % 100, v % 100,
           path);
  return b;
}

/* The default search (utensil.h). Caller holds ut__cuda_blas_lock. */
static void ut__cuda_blas_search_locked(void) {
  if (ut__cuda_blas_searched.load()) return;
  char why[1024];
  const char* env = getenv("UTENSIL_CUBLAS_LIB");
  if (env) {
    if (!*env) {
      snprintf(ut__cuda_blas_why, sizeof ut__cuda_blas_why,
               "cuBLAS not loaded (UTENSIL_CUBLAS_LIB is set and empty): GEMMs run on "
               "utensil's own kernels");
    } else if (ut__cuda_blas* b = ut__cuda_blas_open(env, why, sizeof why)) {
      ut__cuda_blas_current.store(b);
    } else {
      snprintf(ut__cuda_blas_why, sizeof ut__cuda_blas_why,
               "cuBLAS not loaded from UTENSIL_CUBLAS_LIB=%s: %s; GEMMs run on utensil's own "
               "kernels", env, why);
    }
    ut__cuda_blas_searched.store(true);
    return;
  }
  char hint[4096];
  ut__cublas_hint_copy(hint, sizeof hint);
  const char* names[] = {hint, "libcublas.so.13", "libcublas.so.12"};
  char tried[1536] = "";
  for (const char* name : names) {
    if (!*name) continue;
    if (ut__cuda_blas* b = ut__cuda_blas_open(name, why, sizeof why)) {
      ut__cuda_blas_current.store(b);
      ut__cuda_blas_searched.store(true);
      return;
    }
    size_t used = strlen(tried);
    snprintf(tried + used, sizeof tried - used, "%s%s", used ? "; " : "", why);
  }
  snprintf(ut__cuda_blas_why, sizeof ut__cuda_blas_why,
           "cuBLAS not found (%s): GEMMs run on utensil's own kernels; the nvidia-cublas wheel "
           "(pip install 'utensil-ffi[cuda]') or UTENSIL_CUBLAS_LIB provides it", tried);
  ut__cuda_blas_searched.store(true);
}

/* the cuBLAS GEMMs use, or NULL for the own kernels */
static const ut__cuda_blas* ut__cuda_blas_use(void) {
  if (!ut__cuda_blas_on.load(std::memory_order_relaxed)) return NULL;
  if (!ut__cuda_blas_searched.load()) {
    std::lock_guard<std::mutex> lk(ut__cuda_blas_lock);
    ut__cuda_blas_search_locked();
  }
  return ut__cuda_blas_current.load();
}

int ut__cuda_blas_load(const char* path) {
  std::lock_guard<std::mutex> lk(ut__cuda_blas_lock);
  if (!path) {
    ut__cuda_blas_search_locked();
    if (ut__cuda_blas_current.load()) return UT_OK;
    return ut__set_error(UT_ERR_DEVICE, "ut_cublas_load: %s", ut__cuda_blas_why);
  }
  char why[1024];
  ut__cuda_blas* b = ut__cuda_blas_open(path, why, sizeof why);
  if (!b) return ut__set_error(UT_ERR_DEVICE, "ut_cublas_load: %s", why);
  ut__cuda_blas_current.store(b);
  ut__cuda_blas_searched.store(true);
  return UT_OK;
}

int ut__cuda_blas_enable(bool on) {
  if (on) {
    std::lock_guard<std::mutex> lk(ut__cuda_blas_lock);
    ut__cuda_blas_search_locked();
    if (!ut__cuda_blas_current.load())
      return ut__set_error(UT_ERR_DEVICE, "ut_cublas_enable: %s", ut__cuda_blas_why);
  }
  ut__cuda_blas_on.store(on);
  return UT_OK;
}

bool ut__cuda_blas_active(void) { return ut__cuda_blas_use() != NULL; }

const char* ut__cuda_blas_info(void) {
  std::lock_guard<std::mutex> lk(ut__cuda_blas_lock);
  ut__cuda_blas_search_locked();
  const ut__cuda_blas* b = ut__cuda_blas_current.load();
  if (!b) return ut__cuda_blas_why;
  if (ut__cuda_blas_on.load()) return b->info;
  static char off[1400];
  snprintf(off, sizeof off, "%s, off (ut_cublas_enable): GEMMs run on utensil's own kernels",
           b->info);
  return off;
}

/* ============================================================================================
   GEMM on cuBLAS
   ============================================================================================ */

/* A GEMM's element types (the gemm slot's ab_dt, c_dt) as cuBLAS sees them. bf16 A and B
   go into a bf16 or a float32 C; the products and sums are float32 (CUBLAS_COMPUTE_32F, alpha
   and beta float), so a float32 C with beta != 0 accumulates in float32 exactly as the float32
   path does. */
struct ut__cuda_blas_types {
  ut_dtype ab, c;
};
static size_t ut__cuda_blas_size(ut_dtype t) {
  return t == UT_BF16 ? sizeof(ut__cuda_bf16) : sizeof(float);
}
static int ut__cuda_blas_cuda_type(ut_dtype t) {
  return t == UT_BF16 ? UT__CUDA_R_16BF : UT__CUDA_R_32F;
}
/* p advanced by `items` strides of `stride` values of type t */
static const void* ut__cuda_blas_at(const void* p, ut_dtype t, ut__i64 items, ut__i64 stride) {
  return (const char*)p + (size_t)(items * stride) * ut__cuda_blas_size(t);
}

/* the calls themselves, on whatever stream the handle is on */
static int ut__cuda_blas_call_on(const ut__cuda_blas* b, ut__cuda_blas_types ty, bool ta, bool tb,
                                 int m, int n, int k, float alpha, const void* a, int lda,
                                 ut__i64 sa, const void* bb, int ldb, ut__i64 sb, float beta,
                                 void* c, int ldc, ut__i64 sc, ut__i64 batch, int compute) {
  const int tab = ut__cuda_blas_cuda_type(ty.ab), tc = ut__cuda_blas_cuda_type(ty.c);
  for (ut__i64 b0 = 0; b0 < batch; b0 += 65535) {
    int nb = (int)(batch - b0 < 65535 ? batch - b0 : 65535);
    int st = b->gemm_strided_batched(
        b->handle, tb ? UT__CUBLAS_OP_T : UT__CUBLAS_OP_N, ta ? UT__CUBLAS_OP_T : UT__CUBLAS_OP_N,
        n, m, k, &alpha, ut__cuda_blas_at(bb, ty.ab, b0, sb), tab, ldb, sb,
        ut__cuda_blas_at(a, ty.ab, b0, sa), tab, lda, sa, &beta,
        (void*)ut__cuda_blas_at(c, ty.c, b0, sc), tc, ldc, sc, nb, compute,
        UT__CUBLAS_GEMM_DEFAULT);
    if (st != 0) {
      const char* s = b->status_string ? b->status_string(st) : NULL;
      return ut__set_error(UT_ERR_DEVICE, "cublas: gemm %dx%dx%d (batch %d%s) failed: %s (%d)", m,
                           n, k, nb, ty.ab == UT_BF16 ? ", bf16" : "", s ? s : "cuBLAS error",
                           st);
    }
  }
  return UT_OK;
}

/* Row-major C = alpha op(A) op(B) + beta C over `batch` items, as cuBLAS's column-major
   C^T = op(B)^T op(A)^T. */
static int ut__cuda_blas_call(const ut__cuda_blas* b, ut__cuda_blas_types ty, bool ta, bool tb,
                              int m, int n, int k, float alpha, const void* a, int lda,
                              ut__i64 sa, const void* bb, int ldb, ut__i64 sb, float beta,
                              void* c, int ldc, ut__i64 sc, ut__i64 batch) {
  /* TF32 is a float32 setting: bf16 operands multiply exactly into float32 sums already */
  const int compute = ty.ab == UT_F32 && ut__matmul_precision() > 0
                          ? UT__CUBLAS_COMPUTE_32F_FAST_TF32
                          : UT__CUBLAS_COMPUTE_32F;
  /* the handle stays on the default stream, except around calls made while a graph is
     recorded (no other thread runs GPU work then) */
  const bool recording = ut__cuda_stream != cudaStreamLegacy;
  if (recording) b->set_stream(b->handle, ut__cuda_stream);
  int rc = ut__cuda_blas_call_on(b, ty, ta, tb, m, n, k, alpha, a, lda, sa, bb, ldb, sb, beta, c,
                                 ldc, sc, batch, compute);
  if (recording) b->set_stream(b->handle, NULL);
  return rc;
}
/* c [m, n] (ldc) = sum over items of ws[item] [m, n] (float32, contiguous) + beta c; the sum
   and beta c in float32, a bf16 c rounded once at the store */
template <typename T>
static __global__ void ut__cuda_gemm_sum_items_kernel(const float* __restrict__ ws, int items,
                                                      int m, int n, T* __restrict__ c, int ldc,
                                                      float beta) {
  const ut__i64 mn = (ut__i64)m * n;
  UT__CUDA_GRID_STRIDE(i, mn) {
    float s = 0.f;
    for (int q = 0; q < items; ++q) s += ws[(ut__i64)q * mn + i];
    T* cp = c + (i / n) * (ut__i64)ldc + i % n;
    ut__cuda_st(cp, beta != 0.f ? s + beta * ut__cuda_ld(cp) : s);
  }
}

/* the reduce plan for sum_batch (see the top of the file). The items' products go to the
   workspace as float32 whatever C's type (so a bf16 C is rounded once, not per chunk of
   items, unless the items need more than one chunk). */
static int ut__cuda_blas_sum_by_reduce(const ut__cuda_blas* b, ut__cuda_blas_types ty,
                                       const ut__gemm_args* g) {
  const ut__i64 mn = (ut__i64)g->m * g->n;
  const ut__i64 cap = (ut__i64)1 << 26; /* workspace floats: 256 MiB */
  const ut__cuda_blas_types to_ws = {ty.ab, UT_F32};
  ut__i64 chunk = cap / mn;
  if (chunk < 1) chunk = 1;
  if (chunk > g->batch) chunk = g->batch;
  std::lock_guard<std::mutex> lk(ut__cuda_workspace_lock);
  float* ws;
  int st = ut__cuda_workspace_acquire((size_t)(chunk * mn) * sizeof(float), &ws);
  for (ut__i64 b0 = 0; st >= 0 && b0 < g->batch; b0 += chunk) {
    ut__i64 nb = g->batch - b0 < chunk ? g->batch - b0 : chunk;
    st = ut__cuda_blas_call(b, to_ws, g->trans_a, g->trans_b, g->m, g->n, g->k, g->alpha,
                            ut__cuda_blas_at(g->a, ty.ab, b0, g->stride_a), g->lda, g->stride_a,
                            ut__cuda_blas_at(g->b, ty.ab, b0, g->stride_b), g->ldb, g->stride_b,
                            0.f, ws, g->n, mn, nb);
    if (st < 0) break;
    float beta = b0 == 0 ? g->beta : 1.f;
    if (ty.c == UT_BF16)
      ut__cuda_gemm_sum_items_kernel<<<ut__cuda_grid_for(mn, 256), 256, 0, ut__cuda_stream>>>(
          ws, (int)nb, g->m, g->n, (ut__cuda_bf16*)g->c, g->ldc, beta);
    else
      ut__cuda_gemm_sum_items_kernel<<<ut__cuda_grid_for(mn, 256), 256, 0, ut__cuda_stream>>>(
          ws, (int)nb, g->m, g->n, (float*)g->c, g->ldc, beta);
    UT__CUDA_LAUNCHED("gemm sum over items");
  }
  return st;
}

/* the concatenate plan for sum_batch; an operand not regrouped is used as it is */
static int ut__cuda_blas_sum_by_concat(const ut__cuda_blas* b, ut__cuda_blas_types ty,
                                       const ut__gemm_args* g, bool regroup_a, bool regroup_b) {
  const ut__i64 kk = (ut__i64)g->batch * g->k;
  const size_t es = ut__cuda_blas_size(ty.ab);
  void* at = NULL;
  void* bt = NULL;
  int st = UT_OK;
  /* no memory for the regrouped copies: the own kernels need none (float32 only: a bf16 call
     then fails in gemm.cu, as out of memory would) */
  if (regroup_a && !(at = ut__cuda_mem_alloc((size_t)(kk * g->m) * es)))
    return UT__CUDA_BLAS_DECLINED;
  if (regroup_b && !(bt = ut__cuda_mem_alloc((size_t)(kk * g->n) * es))) {
    ut__cuda_mem_free(at);
    return UT__CUDA_BLAS_DECLINED;
  }
  /* [batch, rows, k] -> [rows, batch, k] */
  if (at) st = ut__cuda_transpose(ty.ab, g->a, at, 1, g->batch, 1, g->m, g->k);
  if (st >= 0 && bt) st = ut__cuda_transpose(ty.ab, g->b, bt, 1, g->batch, 1, g->n, g->k);
  /* a regrouped A is [m, k'] plain; one used as is is [k', m] transposed (lda = its row
     length); likewise B: regrouped [n, k'] transposed, as is [k', n] plain */
  if (st >= 0)
    st = ut__cuda_blas_call(b, ty, !at, bt != NULL, g->m, g->n, (int)kk, g->alpha,
                            at ? at : g->a, at ? (int)kk : g->lda, 0, bt ? bt : g->b,
                            bt ? (int)kk : g->ldb, 0, g->beta, g->c, g->ldc, 0, 1);
  ut__cuda_mem_free(at);
  ut__cuda_mem_free(bt);
  return st;
}

int ut__cuda_blas_gemm(ut_dtype ab_dt, ut_dtype c_dt, const ut__gemm_args* g) {
  const ut__cuda_blas* b = ut__cuda_blas_use();
  const ut__cuda_blas_types ty = {ab_dt, c_dt};
  /* k = 0 (C = beta C) and leading dimensions cuBLAS would refuse stay with the own kernels,
     and so do type pairs other than float32 throughout and bf16 A, B into bf16 or float32 C */
  if (!b || g->k <= 0 || g->lda < (g->trans_a ? g->m : g->k) ||
      g->ldb < (g->trans_b ? g->k : g->n) || g->ldc < g->n)
    return UT__CUDA_BLAS_DECLINED;
  if (ty.ab == UT_F32 ? ty.c != UT_F32 : ty.ab != UT_BF16 || (ty.c != UT_F32 && ty.c != UT_BF16))
    return UT__CUDA_BLAS_DECLINED;
  if (!g->sum_batch || g->batch == 1)
    return ut__cuda_blas_call(b, ty, g->trans_a, g->trans_b, g->m, g->n, g->k, g->alpha, g->a,
                              g->lda, g->stride_a, g->b, g->ldb, g->stride_b, g->beta, g->c,
                              g->ldc, g->stride_c, g->sum_batch ? 1 : g->batch);

  /* sum_batch: which operands concatenate as they are, which need regrouping, which cannot.
     The plans are compared in bytes moved: a regrouped operand is read and written in its own
     type, the reduce plan's float32 workspace written and read. */
  const ut__i64 batch = g->batch, m = g->m, n = g->n, k = g->k;
  const ut__i64 es = (ut__i64)ut__cuda_blas_size(ty.ab);
  bool a_as_is = g->trans_a && g->stride_a == k * g->lda;
  bool b_as_is = !g->trans_b && g->stride_b == k * g->ldb;
  bool a_regroup = !g->trans_a && g->lda == k && g->stride_a == m * k;
  bool b_regroup = g->trans_b && g->ldb == k && g->stride_b == n * k;
  ut__i64 concat_moves =
      ((a_regroup ? 2 * batch * m * k : 0) + (b_regroup ? 2 * batch * n * k : 0)) * es;
  ut__i64 reduce_moves = 2 * batch * m * n * (ut__i64)sizeof(float);
  bool can_concat = (a_as_is || a_regroup) && (b_as_is || b_regroup) && batch * k <= INT_MAX;
  if (can_concat && concat_moves <= reduce_moves)
    return ut__cuda_blas_sum_by_concat(b, ty, g, a_regroup, b_regroup);
  return ut__cuda_blas_sum_by_reduce(b, ty, g);
}
