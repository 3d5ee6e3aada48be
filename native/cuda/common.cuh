/* common.cuh — what the files of utensil's CUDA backend share (see utensil.h, BACKEND INTERFACE).

   The backend is one translation unit per op family, each compiled by nvcc on its own and linked
   with utensil.c into one shared library with `-cudart static`, so the library has no load-time
   CUDA dependency: ut__cuda_backend() returns NULL when the runtime finds no driver or no device,
   and the library runs CPU-only. A C program that includes utensil.h gets the GPU by linking
   these objects, with no define (utensil.h, "CUDA BACKEND").

   Files
     common.cuh       this: error checks, launch helpers, block reductions, the reduction
                      workspace, and the declarations of what one file gives another
     backend.cu       ut__cuda_backend(), the table the C core calls (and the element-type
                      switches of depthwise.cu's ops); the device memory cache, copies,
                      synchronization
     elementwise.cu   fill, copy, cast, axpy, scale, relu, transpose, bias_add, chan_repeat,
                      chan_group_sum, global_avgpool2d (row_mean), mse_loss, cross_entropy
     activation.cu    act_fwd / act_bwd: silu, hardswish, hardsigmoid, sigmoid, gelu (their
                      formulas in utensil.h, shared with the CPU backend)
     gemm.cu          gemm (matmul, linear and conv2d run on it): the own kernels, and
                      conv2d's im2col and col2im
     blas.cu          gemm on cuBLAS, loaded at run time (gemm.cu hands it every call first)
     depthwise.cu     dwconv2d: forward, dx, dW (entry points, choice of kernel); its kernels
                      are in dw_tiled.cu, dw_strip.cu, dw_grad.cu, dw_exact.cu around
                      depthwise.cuh (whose top comment lists them)
     norm.cu          per-channel reductions (channel_sum and batchnorm2d share them),
                      batchnorm2d, layernorm
     optim.cu         sgd, adam, and sgd and fill over many tensors per launch
     scale.cu         channel scales (squeeze-and-excitation, layer scale), LayerNorm2d
     recipe.cu        mask_scale (Dropout, StochasticDepth), lerp (the EMA of weights): issue 30
     nccl.cu          ut_dist_*: NCCL loaded at run time (all-reduce, broadcast)

   Naming
     Every file-level name starts with ut__cuda_ (macros and constants: UT__CUDA_), kernels end
     in _kernel. The functions of the backend table carry their slot's name, ut__cuda_<slot>
     (ut__cuda_row_mean, ut__cuda_bn_stats, ut__cuda_im2col), with the slot's signature: one
     function per op that switches on its ut_dtype to the kernels of that element type, so
     `grep -rn row_mean native/` lands on the slot, the CPU kernel and the CUDA one; their
     per-type bodies are ut__cuda_<slot>_t<T> or _impl<T>. Kernels carry the op as the C header
     spells it (dwconv2d, conv2d, gemm, batchnorm2d, layernorm, relu, global_avgpool2d,
     mse_loss, cross_entropy, sgd, adam), so `grep -rn dwconv2d native/` lands on the CUDA
     kernels too. depthwise.cu's entry points are still
     ut__cuda_dw_fwd, ut__cuda_dw_bwd_dx and ut__cuda_dw_bwd_dw, each switching on the type. What a file gives another is
     declared at the end of this header; everything else is static. Without relocatable device
     code a kernel or device function cannot be called across files, so the device helpers
     here are inline and each file launches only its own kernels.

   Conventions
     - Every pointer given to a table function is a device pointer; all work goes to
       ut__cuda_stream, the legacy default stream (the capture stream while a graph is
       recorded), so ops are ordered and no op synchronizes the host (upload and download do,
       being plain cudaMemcpy). Every launch names the stream.
     - Every runtime call and every launch is checked; a failure sets the thread-local error
       (UT_ERR_MEMORY for an allocation failure, UT_ERR_DEVICE otherwise) and returns it.
     - Reductions are deterministic: fixed launch shapes, fixed-order trees, no float atomics.
       Multi-block reductions write partials to a shared workspace (see
       ut__cuda_workspace_acquire) that the last block to finish (ut__cuda_last_block: the
       per-channel ones of norm.cu) or a second small kernel sums in a fixed order. */
#ifndef UT__CUDA_COMMON_CUH
#define UT__CUDA_COMMON_CUH

#define UT_BACKEND_INTERFACE
#include "../utensil.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

/* multiprocessors of the device, read at init (backend.cu) */
extern int ut__cuda_sms;

/* Sets the thread-local error from e (UT_ERR_MEMORY for an allocation failure, else
   UT_ERR_DEVICE) and returns that status. */
int ut__cuda_fail(cudaError_t e, const char* what);

#define UT__CUDA_CHECK(call, what)                             \
  do {                                                         \
    cudaError_t e_ = (call);                                   \
    if (e_ != cudaSuccess) return ut__cuda_fail(e_, what);     \
  } while (0)

/* after every launch */
#define UT__CUDA_LAUNCHED(what) UT__CUDA_CHECK(cudaGetLastError(), what)

static inline ut__i64 ut__cuda_cdiv(ut__i64 a, ut__i64 b) { return (a + b - 1) / b; }

/* blocks for a grid-stride loop over n items */
static inline unsigned ut__cuda_grid_for(ut__i64 n, int threads) {
  ut__i64 b = ut__cuda_cdiv(n, threads);
  ut__i64 cap = (ut__i64)ut__cuda_sms * 16;
  if (b > cap) b = cap;
  if (b < 1) b = 1;
  return (unsigned)b;
}

#define UT__CUDA_GRID_STRIDE(i, n)                                                     \
  for (ut__i64 i = (ut__i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);            \
       i += (ut__i64)gridDim.x * blockDim.x)

/* Workspace for multi-kernel reductions: one device buffer that grows and never shrinks
   (backend.cu). The caller holds ut__cuda_workspace_lock from ut__cuda_workspace_acquire until
   the launches that use it are enqueued; since all work is on the one legacy default stream,
   the next user's kernels run after ours. Growing synchronizes the device before freeing the
   old buffer (rare: only when a larger size is first needed). */
extern std::mutex ut__cuda_workspace_lock;
int ut__cuda_workspace_acquire(size_t bytes, float** out);
/* n arrival counters for reductions that finish in their last block (ut__cuda_last_block):
   zero at every kernel's start, because the last block of each group puts its counter back.
   Held under ut__cuda_workspace_lock as the workspace is. */
int ut__cuda_counters_acquire(int n, unsigned** out);

/* ---- bf16 activations ----
   A kernel that serves float32 and bf16 activations is a template over the element type T
   (float or __nv_bfloat16) that reads through ut__cuda_ld and writes through ut__cuda_st: the
   arithmetic is float32 in both, and a bf16 store rounds to nearest even. */
typedef __nv_bfloat16 ut__cuda_bf16;
static __device__ __forceinline__ float ut__cuda_ld(const float* p) { return *p; }
static __device__ __forceinline__ float ut__cuda_ld(const ut__cuda_bf16* p) {
  return __bfloat162float(*p);
}
static __device__ __forceinline__ void ut__cuda_st(float* p, float v) { *p = v; }
static __device__ __forceinline__ void ut__cuda_st(ut__cuda_bf16* p, float v) {
  *p = __float2bfloat16_rn(v);
}

/* ---- BatchNorm's apply, one expression for every kernel that computes it: the apply kernel
   (norm.cu), backward's recomputed mask, and the depthwise kernels that normalize their input as
   they load it (ut_batchnorm2d_dwconv2d_forward); the same numbers everywhere, to the bit ---- */
static __device__ __forceinline__ float ut__cuda_bn_rstd(float var, float eps) {
  return 1.0f / sqrtf(var + eps);
}
/* the output before its activation (an explicit fma, so the compiler cannot contract the
   places differently) */
static __device__ __forceinline__ float ut__cuda_bn_z(float x, float m, float sc, float bt) {
  return __fmaf_rn(x - m, sc, bt);
}
/* relu_fwd's and relu_bwd's rules at z (act >= 0; act > 0 caps) */
static __device__ __forceinline__ float ut__cuda_bn_relu(float z, float act) {
  float v = z < 0.f ? 0.f : z;
  return act > 0.f && v > act ? act : v;
}

/* ut__cuda_ld through the read-only data cache: these kernels only read x and go, and the
   float32 kernels have always loaded them with __ldg */
static __device__ __forceinline__ float ut__cuda_ldg(const float* p) { return __ldg(p); }
static __device__ __forceinline__ float ut__cuda_ldg(const ut__cuda_bf16* p) {
  return __bfloat162float(__ldg(p));
}

/* Elementwise kernels (batchnorm, pooling, the channel scales) run over groups of W consecutive elements of one row, each
   group loaded and stored as one vector when the rows are a multiple of W long and every buffer
   is aligned to the vector: float32 W = 4 (float4, 16 bytes); bf16 W = 8 (16 bytes) or, where
   rows are a multiple of 4 but not of 8 (14x14 = 196), W = 4 (8 bytes); else W = 1. 16 bytes
   per access keeps a bf16 pass as wide in bytes as a float32 one, so it moves half the bytes
   in about half the time. Indexed with I = 32-bit integers when the tensor allows: the channel
   of a group costs one division, which 64-bit integers make the kernels' largest cost.
   fetch/unpack split load in two: a loop that issues the next groups' loads before it works on
   the current ones holds them as raw (the loaded bits, half the registers of the floats for
   bf16) until their turn; load(p, e) is unpack(fetch(p), e). */
template <int W, typename T>
struct ut__cuda_vec {
  static_assert(W == 1, "no vector load of this width for this type");
  typedef T raw;
  static __device__ __forceinline__ raw fetch(const T* p) { return __ldg(p); }
  static __device__ __forceinline__ void unpack(const raw& r, float* e) {
    e[0] = ut__cuda_ld(&r);
  }
  static __device__ __forceinline__ void load(const T* p, float* e) { unpack(fetch(p), e); }
  static __device__ __forceinline__ void store(T* p, const float* e) { ut__cuda_st(p, e[0]); }
};
template <>
struct ut__cuda_vec<4, float> {
  typedef float4 raw;
  static __device__ __forceinline__ raw fetch(const float* p) {
    return __ldg(reinterpret_cast<const float4*>(p));
  }
  static __device__ __forceinline__ void unpack(const raw& v, float* e) {
    e[0] = v.x; e[1] = v.y; e[2] = v.z; e[3] = v.w;
  }
  static __device__ __forceinline__ void load(const float* p, float* e) { unpack(fetch(p), e); }
  static __device__ __forceinline__ void store(float* p, const float* e) {
    *reinterpret_cast<float4*>(p) = make_float4(e[0], e[1], e[2], e[3]);
  }
};
/* eight floats as two float4: the reductions' walk takes 8 elements per group for both types
   (ut__cuda_reduce_width) */
template <>
struct ut__cuda_vec<8, float> {
  struct raw {
    float4 lo, hi;
  };
  static __device__ __forceinline__ raw fetch(const float* p) {
    return raw{ut__cuda_vec<4, float>::fetch(p), ut__cuda_vec<4, float>::fetch(p + 4)};
  }
  static __device__ __forceinline__ void unpack(const raw& v, float* e) {
    ut__cuda_vec<4, float>::unpack(v.lo, e);
    ut__cuda_vec<4, float>::unpack(v.hi, e + 4);
  }
  static __device__ __forceinline__ void load(const float* p, float* e) { unpack(fetch(p), e); }
  static __device__ __forceinline__ void store(float* p, const float* e) {
    ut__cuda_vec<4, float>::store(p, e);
    ut__cuda_vec<4, float>::store(p + 4, e + 4);
  }
};
/* Two bf16 in 32 bits, the first at the lower address (little-endian). A bf16 is the upper
   half of a float32, so widening is a shift or a mask (exactly ut__cuda_ld's value), and
   narrowing is one cvt.rn.bf16x2.f32 (__floats2bfloat162_rn: each rounded to nearest even,
   exactly ut__cuda_st's value). */
static __device__ __forceinline__ void ut__cuda_bf16x2_unpack(unsigned u, float* e) {
  e[0] = __uint_as_float(u << 16);
  e[1] = __uint_as_float(u & 0xffff0000u);
}
static __device__ __forceinline__ unsigned ut__cuda_bf16x2_pack(const float* e) {
  __nv_bfloat162 h = __floats2bfloat162_rn(e[0], e[1]);
  return (unsigned)__bfloat16_as_ushort(h.x) | (unsigned)__bfloat16_as_ushort(h.y) << 16;
}
template <>
struct ut__cuda_vec<4, ut__cuda_bf16> {
  typedef uint2 raw;
  static __device__ __forceinline__ raw fetch(const ut__cuda_bf16* p) {
    return __ldg(reinterpret_cast<const uint2*>(p));
  }
  static __device__ __forceinline__ void unpack(const raw& v, float* e) {
    ut__cuda_bf16x2_unpack(v.x, e);
    ut__cuda_bf16x2_unpack(v.y, e + 2);
  }
  static __device__ __forceinline__ void load(const ut__cuda_bf16* p, float* e) {
    unpack(fetch(p), e);
  }
  static __device__ __forceinline__ void store(ut__cuda_bf16* p, const float* e) {
    *reinterpret_cast<uint2*>(p) = make_uint2(ut__cuda_bf16x2_pack(e), ut__cuda_bf16x2_pack(e + 2));
  }
};
template <>
struct ut__cuda_vec<8, ut__cuda_bf16> {
  typedef uint4 raw;
  static __device__ __forceinline__ raw fetch(const ut__cuda_bf16* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
  static __device__ __forceinline__ void unpack(const raw& v, float* e) {
    ut__cuda_bf16x2_unpack(v.x, e);
    ut__cuda_bf16x2_unpack(v.y, e + 2);
    ut__cuda_bf16x2_unpack(v.z, e + 4);
    ut__cuda_bf16x2_unpack(v.w, e + 6);
  }
  static __device__ __forceinline__ void load(const ut__cuda_bf16* p, float* e) {
    unpack(fetch(p), e);
  }
  static __device__ __forceinline__ void store(ut__cuda_bf16* p, const float* e) {
    *reinterpret_cast<uint4*>(p) = make_uint4(ut__cuda_bf16x2_pack(e), ut__cuda_bf16x2_pack(e + 2),
                                              ut__cuda_bf16x2_pack(e + 4),
                                              ut__cuda_bf16x2_pack(e + 6));
  }
};

/* W for an elementwise kernel over rows of `inner` elements of T (see ut__cuda_vec); the
   pointers (NULL allowed) must all be aligned to its vector */
template <typename T>
static inline int ut__cuda_vec_width(ut__i64 inner, const void* a, const void* b, const void* c3) {
  uintptr_t any = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c3;
  const int wide = 16 / (int)sizeof(T);
  if (inner % wide == 0 && any % 16 == 0) return wide;
  if (sizeof(T) == 2 && inner % 4 == 0 && any % 8 == 0) return 4; /* bf16's 8-byte vector */
  return 1;
}

/* ---- block reductions (blockDim.x a multiple of 32, at most 1024) ---- */

static __device__ __forceinline__ float ut__cuda_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

static __device__ __forceinline__ float ut__cuda_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Sums NV values over the block; every thread gets the totals. sh: at least 32*NV floats. */
template <int NV>
static __device__ __forceinline__ void ut__cuda_block_sum(float (&v)[NV], float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = ut__cuda_warp_sum(v[i]);
  __syncthreads(); /* sh may still be read by an earlier reduction */
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) sh[warp * NV + i] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float x = lane < nw ? sh[lane * NV + i] : 0.f;
    v[i] = ut__cuda_warp_sum(x);
  }
}

static __device__ __forceinline__ float ut__cuda_block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = ut__cuda_warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float x = lane < nw ? sh[lane] : -INFINITY;
  return ut__cuda_warp_max(x);
}

/* Whether this block is the last of the `blocks` blocks of group g to finish, so that it can do
   the group's final step in the same launch (no second kernel): every block publishes its
   partials (written by thread 0 before the call) with a fence and counts itself on
   counters[g]; the one that counts last sees every partial and resets the counter for the
   next launch. Call from every thread of the block. */
static __device__ __forceinline__ bool ut__cuda_last_block(unsigned* counters, ut__i64 g,
                                                           unsigned blocks) {
  __shared__ bool last;
  if (blocks <= 1) return true;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned t = atomicAdd(counters + g, 1u);
    last = t == blocks - 1;
    if (last) {
      counters[g] = 0u;
      __threadfence();
    }
  }
  __syncthreads();
  return last;
}

/* threads for a block that works on one row of `len` items */
static inline int ut__cuda_row_threads(ut__i64 len) {
  ut__i64 t = ut__cuda_cdiv(len, 32) * 32;
  if (t > 256) t = 256;
  if (t < 32) t = 32;
  return (int)t;
}

/* Row kernels (global average pooling and its backward, the squeeze-and-excitation scale and
   its ds): G threads per row of a [rows, cols] tensor, 256/G rows per block of 256. One block
   per row (G = 256) was the only shape before, and it left a 7x7 or 14x14 plane's row to a
   block of 64 threads that spent more time in the block reduction and in launching blocks than
   in reading: on EfficientNet-B0 (bf16, 224^2, batch 256) those four kernels took 9 ms of a
   38 ms step, several times their bytes at the memory's speed. A warp per row needs no shared
   memory and fills the device whenever there are a few thousand rows (any training batch);
   a block per row stays for few, long rows (batch-1 inference over 112^2 planes). */
static inline int ut__cuda_row_group(ut__i64 rows, ut__i64 cols) {
  return rows < 8192 && cols >= 4096 ? 256 : 32;
}
/* the sum of v over the G threads of each row group; thread `lane` 0 of the group gets it
   (every thread for G = 32). sh: 32 floats. Call from every thread of the block. */
template <int G>
static __device__ __forceinline__ float ut__cuda_group_sum(float v, float* sh) {
  if (G == 32) return ut__cuda_warp_sum(v);
  float a[1] = {v};
  ut__cuda_block_sum<1>(a, sh);
  return a[0];
}

/* chunks per channel of a per-channel reduction (norm.cu, depthwise.cu): about 8 blocks per
   multiprocessor overall, at least 2048 elements each */
static inline int ut__cuda_channel_chunks(int c, ut__i64 m, ut__i64* chunk) {
  ut__i64 ch = ut__cuda_cdiv((ut__i64)ut__cuda_sms * 8, c);
  ut__i64 most = ut__cuda_cdiv(m, 2048);
  if (ch > most) ch = most;
  if (ch > 1024) ch = 1024;
  if (ch < 1) ch = 1;
  *chunk = ut__cuda_cdiv(m, ch);
  return (int)ut__cuda_cdiv(m, *chunk);
}

/* ============================================================================================
   What one file gives another. The table functions have the signatures of the ut__backend
   fields they fill (utensil.h, BACKEND INTERFACE).
   ============================================================================================ */

/* backend.cu: device memory from the cache (NULL + error on failure; free takes NULL) */
void* ut__cuda_mem_alloc(size_t bytes);
void ut__cuda_mem_free(void* p);
/* backend.cu: the stream every launch goes to (the legacy default stream, or the capture
   stream while a graph is recorded), and cudaFree for buffers a graph may use (deferred while
   any graph exists) */
extern cudaStream_t ut__cuda_stream;
void ut__cuda_retire(void* p);

/* blas.cu: gemm on cuBLAS; UT__CUDA_BLAS_DECLINED when the own kernels are to run it (cuBLAS
   absent or off, or a call it cannot take) */
#define UT__CUDA_BLAS_DECLINED 1
int ut__cuda_blas_gemm(ut_dtype ab_dt, ut_dtype c_dt, const ut__gemm_args* g);
int ut__cuda_blas_load(const char* path);
int ut__cuda_blas_enable(bool on);
bool ut__cuda_blas_active(void);
const char* ut__cuda_blas_info(void);

/* nccl.cu: fills the table's dist_* and nccl_info slots */
void ut__cuda_nccl_fill(ut__backend* t);

/* The failure of a table function given an element type it has no kernel for (see utensil.h,
   BACKEND INTERFACE, "Element types"): UT_ERR_ARG, never an abort. */
static inline int ut__cuda_no_dtype(const char* op, ut_dtype dt) {
  return ut__set_error(UT_ERR_ARG, "cuda %s: element type %s (%d) has no kernel here", op,
                       ut_dtype_name(dt), (int)dt);
}

/* elementwise.cu (init launches nothing: it asks the runtime whether ut__cuda_fill_kernel has
   code for the device) */
__global__ void ut__cuda_fill_kernel(float* __restrict__ x, ut__i64 n, float v);
int ut__cuda_fill(ut_dtype dt, void* x, ut__i64 n, float v);
int ut__cuda_copy(float* dst, const float* src, ut__i64 n);
int ut__cuda_copy2d(ut_dtype dt, const void* src, ut__i64 src_ld, void* dst, ut__i64 dst_ld,
                    int rows, ut__i64 cols);
int ut__cuda_cast(ut_dtype src_dt, ut_dtype dst_dt, const void* src, void* dst, ut__i64 n);
int ut__cuda_axpy(ut_dtype dt, void* y, const void* x, ut__i64 n, float alpha);
int ut__cuda_scale(ut_dtype dt, void* x, ut__i64 n, float alpha);
int ut__cuda_relu_fwd(ut_dtype dt, const void* x, void* y, ut__i64 n, float cap);
int ut__cuda_relu_bwd(ut_dtype dt, const void* go, const void* x, void* gi, ut__i64 n,
                      float cap);
/* activation.cu: the activations' slots (issue 30) */
int ut__cuda_act_fwd(ut_dtype dt, int act, const void* x, void* y, ut__i64 n);
int ut__cuda_act_bwd(ut_dtype dt, int act, const void* go, const void* x, void* gi, ut__i64 n);
int ut__cuda_transpose(ut_dtype dt, const void* in, void* out, int outer, int d0, int mid,
                       int d1, int inner);
int ut__cuda_bias_add(ut_dtype dt, void* x, const float* bias, int n, int c, ut__i64 inner);
int ut__cuda_chan_repeat(ut_dtype dt, const void* x, void* y, int n, int c, int m,
                         ut__i64 inner);
int ut__cuda_chan_group_sum(ut_dtype dt, const void* x, void* y, int n, int c, int m,
                            ut__i64 inner);
int ut__cuda_row_mean(ut_dtype dt, const void* x, void* y, int rows, ut__i64 cols);
int ut__cuda_row_mean_bwd(ut_dtype dt, const void* go, void* dx, int rows, ut__i64 cols);
int ut__cuda_mse_fwd(const float* p, const float* t, float* out, ut__i64 n);
int ut__cuda_mse_bwd(const float* p, const float* t, float* g, ut__i64 n);
int ut__cuda_ce_fwd(const float* logits, const float* labels, float* out, int n, int k,
                    float eps);
int ut__cuda_ce_bwd(const float* logits, const float* labels, float* g, int n, int k,
                    float eps);

/* gemm.cu */
int ut__cuda_gemm(ut_dtype ab_dt, ut_dtype c_dt, const ut__gemm_args* g);
int ut__cuda_im2col(ut_dtype dt, const void* x, void* col, const ut__conv_geom* g);
int ut__cuda_col2im(ut_dtype dt, const void* col, void* dx, const ut__conv_geom* g);
int ut__cuda_conv_exact(ut_dtype dt, ut__conv_dir dir, const void* x, const void* go,
                        const void* w, const float* bias, const float* part, void* dst,
                        int out_c, const ut__conv_geom* g);

/* depthwise.cu (its kernel families in dw_*.cu) */
int ut__cuda_dw_fwd(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                    const ut__conv_geom* g);
int ut__cuda_dw_bwd_dx(ut_dtype dt, const void* go, const float* w, void* dx,
                       const ut__conv_geom* g);
int ut__cuda_dw_bwd_dw(ut_dtype dt, const void* go, const void* x, float* dw,
                       const ut__conv_geom* g);
int ut__cuda_dw_fwd_bn(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                       const ut__conv_geom* g, const ut__dw_bn* bn);
int ut__cuda_dw_bwd_dw_bn(ut_dtype dt, const void* go, const void* x, float* dw,
                          const ut__conv_geom* g, const ut__dw_bn* bn);

/* norm.cu */
int ut__cuda_channel_sum(ut_dtype dt, const void* x, float* out, int n, int c, ut__i64 inner,
                         float beta);
int ut__cuda_layernorm_fwd(const float* x, const float* gamma, const float* beta, float* y,
                           float* mean, float* rstd, int rows, int dim, float eps);
int ut__cuda_layernorm_bwd(const float* go, const float* x, const float* gamma,
                           const float* mean, const float* rstd, float* dx, float* dgamma,
                           float* dbeta, int rows, int dim);
int ut__cuda_bn_stats(ut_dtype dt, const void* x, float* mean, float* var, int n, int c,
                      ut__i64 inner);
int ut__cuda_bn_update_running(float* running_mean, float* running_var, const float* mean,
                               const float* var, int c, float momentum, float unbias);
int ut__cuda_bn_fold_pack(const float* mean, const float* var, const float* gamma,
                          const float* beta, float* rstd, float* st, int c, float eps);
int ut__cuda_bn_apply(ut_dtype dt, const void* x, void* y, const float* mean, const float* var,
                      const float* gamma, const float* beta, float* rstd, int n, int c,
                      ut__i64 inner, float eps, int act);
int ut__cuda_bn_bwd(ut_dtype dt, const void* go, const void* x, const float* mean,
                    const float* rstd, const float* gamma, const float* beta, void* dx,
                    float* dgamma, float* dbeta, int n, int c, ut__i64 inner, bool training,
                    int act);
int ut__cuda_bn_bwd_sums(ut_dtype dt, const void* go, const void* x, const float* mean,
                         const float* rstd, const float* gamma, const float* beta, float* sums,
                         float* dgamma, float* dbeta, int n, int c, ut__i64 inner, int act);
int ut__cuda_bn_bwd_dx(ut_dtype dt, const void* go, const void* x, const float* mean,
                       const float* rstd, const float* gamma, const float* beta, const float* sums,
                       void* dx, int n, int c, ut__i64 inner, int act);
int ut__cuda_bn_sync_pack(const float* mean, const float* var, const float* a, float* out, int c,
                          float count);
int ut__cuda_bn_sync_unpack(const float* a, const float* b, float* mean, float* var,
                            float* running_mean, float* running_var, int c, float momentum);

/* scale.cu (issue 30): channel scales (squeeze-and-excitation, layer scale), LayerNorm2d */
int ut__cuda_chan_scale(ut_dtype dt, ut_dtype s_dt, const void* x, const void* s, void* y, int n,
                        int c, ut__i64 inner, bool shared);
int ut__cuda_chan_dot(ut_dtype dt, const void* a, const void* b, float* out, int n, int c,
                      ut__i64 inner, bool shared, float beta);
int ut__cuda_ln2d_fwd(ut_dtype dt, const void* x, const float* gamma, const float* beta, void* y,
                      float* mean, float* rstd, int n, int c, ut__i64 inner, float eps);
int ut__cuda_ln2d_bwd(ut_dtype dt, const void* go, const void* x, const float* gamma,
                      const float* mean, const float* rstd, void* dx, float* dgamma,
                      float* dbeta, int n, int c, ut__i64 inner);

/* optim.cu */
int ut__cuda_sgd_many(float* const* p, const float* const* g, float* const* v, const ut__i64* n,
                      int count, ut__sgd_hp h);
int ut__cuda_fill_many(float* const* x, const ut__i64* n, int count, float value);
int ut__cuda_sgd(float* p, const float* g, float* v, ut__i64 n, ut__sgd_hp h);
int ut__cuda_adam(float* p, const float* g, float* m, float* v, ut__i64 n, ut__adam_hp h);

/* recipe.cu (issue 30: Dropout, StochasticDepth, the EMA of weights) */
int ut__cuda_rng_mask(float* out, ut__i64 n, double keep, float scale, unsigned long long key,
                      unsigned long long epoch, bool recording);
int ut__cuda_mask_scale(ut_dtype dt, void* x, const float* s, ut__i64 n, ut__i64 inner);
int ut__cuda_lerp(float* a, const float* b, ut__i64 n, float w);

#endif /* UT__CUDA_COMMON_CUH */
