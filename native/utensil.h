/* utensil.h — a small, fast neural-network library in one C11 header.

   USAGE
     In exactly one C file:
         #define UT_IMPLEMENTATION
         #include "utensil.h"
     Everywhere else just #include "utensil.h".
     Build options (define before the implementation include):
         UT_NO_CUDA   build without the CUDA backend (UT_CUDA tensors then run on the CPU)

   TENSORS
     A ut_tensor is a reference-counted, row-major float32 array of up to UT_MAX_DIMS dimensions.
     `data` is a host copy that is always allocated. A tensor tagged UT_CUDA also has a device
     copy in `gpu_buf` when a GPU is present; the two copies form a lazy mirror:
         dirty_cpu  the host copy is stale (the GPU wrote last)   -> ut_sync_cpu() downloads
         dirty_gpu  the device copy is stale (the host wrote last) -> ut_sync_gpu() uploads
     After ut_alloc/ut_from_data/ut_randn and after ut_sync_cpu the host copy is the owner: writes
     through `data` are seen by later ops (the next GPU op uploads them). ut_sync_cpu_readonly()
     downloads without handing ownership to the host, for reading only.
     On a machine without a usable GPU, UT_CUDA tensors keep their tag and run on the CPU paths.

   OPS
     Every op runs on the device of its first tensor argument; all tensor arguments must be on
     the same device. Ops return new tensors (rc = 1, release with ut_free) or a ut_status.
     Backward functions ACCUMULATE parameter gradients into caller-owned tensors (dW += ...,
     db += ...) and return a fresh input gradient; db may be NULL. Gradient tensors are matched
     by element count, so a flat dW works as well as one shaped like the weight.

   ERRORS
     A fallible call returns NULL or a negative ut_status and sets a thread-local message read by
     ut_last_error() (and ut_last_status()). Nothing aborts on bad input. Successful calls do not
     clear the message; call ut_clear_error() first if you need to tell calls apart.

   THREADS
     Independent tensors may be used from several threads at once, and ut_retain/ut_free are
     atomic, so threads may share references to one tensor. Ops that write a tensor, or that move
     its data between host and GPU, must not run on it from two threads at once. The error
     message is thread-local; the RNG is shared and locked; the CUDA context is shared and all
     GPU work is queued on one stream. The CPU backend runs each op on ut_get_num_threads()
     threads (default: the cores present).
*/
#ifndef UTENSIL_H
#define UTENSIL_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Everything from UT_CDEF_BEGIN to UT_CDEF_END is also read by the Python bindings (cffi cdef):
   keep it to plain declarations and integer #defines. */
/* UT_CDEF_BEGIN */
#define UT_VERSION 1
#define UT_MAX_DIMS 8

typedef enum ut_dev { UT_CPU = 0, UT_CUDA = 1 } ut_dev;

typedef enum ut_status {
  UT_OK = 0,
  UT_ERR_ARG = -1,     /* a NULL or out-of-range argument, a closed/invalid object */
  UT_ERR_SHAPE = -2,   /* mismatched or invalid shapes */
  UT_ERR_MEMORY = -3,  /* host or device allocation failed */
  UT_ERR_DEVICE = -4   /* the GPU or its runtime reported an error */
} ut_status;

typedef struct ut_shape {
  int ndim;
  int shape[UT_MAX_DIMS];
  int nelem;
} ut_shape;

typedef struct ut_tensor {
  ut_shape shape;
  float* data;     /* host copy, always allocated */
  ut_dev dev;
  void* gpu_buf;   /* device copy, NULL when none */
  bool dirty_cpu;  /* host copy is stale */
  bool dirty_gpu;  /* device copy is stale */
  int rc;          /* reference count */
  bool borrowed;   /* made by ut_wrap: `data` (UT_CPU) or `gpu_buf` (UT_CUDA) is not ours */
  /* Memory the tensor borrows (ut_wrap): called once, at the last ut_free, instead of freeing
     it. NULL for memory the library owns. */
  void (*release)(void* ctx);
  void* release_ctx;
} ut_tensor;

/* ---- library ---------------------------------------------------------------------------- */
int ut_version(void);                 /* UT_VERSION the library was built from */
const char* ut_last_error(void);      /* this thread's last error message ("" if none) */
ut_status ut_last_status(void);       /* this thread's last error status (UT_OK if none) */
void ut_clear_error(void);
bool ut_cuda_available(void);         /* a GPU is present and the CUDA backend is built in */
const char* ut_backend_name(ut_dev dev); /* "cpu" or "cuda": where ops on dev really run */
void ut_seed(unsigned long long seed);   /* reseeds the shared RNG used by ut_randn */
int ut_set_num_threads(int n);        /* CPU threads per op (n >= 1); returns status */
int ut_get_num_threads(void);
long long ut_live_tensors(void);      /* tensors allocated and not yet freed */
/* Host<->GPU copies the mirror has made since the process started (for tests and profiling). */
void ut_transfer_counts(long long* uploads, long long* downloads);
int ut_cuda_mem_info(size_t* free_bytes, size_t* total_bytes); /* status; error without GPU */
int ut_cuda_synchronize(void);        /* wait for all queued GPU work; no-op without a GPU */
/* Make `waiting` wait for the work queued so far on `signalling` (cudaStream_t handles; NULL is
   the stream the library queues its work on). No-op without a GPU. */
int ut_cuda_stream_wait(void* waiting, void* signalling);
/* Layout of public structs as the C compiler sees them (for binding checks); -1 if unknown. */
long long ut_type_size(const char* type_name);
long long ut_field_offset(const char* type_name, const char* field_name);

/* ---- tensors ------------------------------------------------------------------------------ */
ut_shape ut_shape_new(int ndim, const int* shape); /* nelem = 0 if invalid (see ut_last_error) */
ut_tensor* ut_alloc(int ndim, const int* shape, ut_dev dev);   /* zero-filled */
ut_tensor* ut_from_data(int ndim, const int* shape, const float* data, ut_dev dev); /* copies */
ut_tensor* ut_randn(int ndim, const int* shape, float mean, float std, ut_dev dev);
/* Zero-copy: a tensor over memory someone else owns: host memory for UT_CPU, device memory for
   UT_CUDA (a GPU must be present; the host mirror is allocated and filled on demand). ptr must
   hold nelem floats, contiguous, and stay valid until release(ctx) is called at the last ut_free
   (release may be NULL). On failure release is not called. */
ut_tensor* ut_wrap(int ndim, const int* shape, ut_dev dev, void* ptr, void (*release)(void* ctx),
                   void* ctx);
ut_tensor* ut_retain(ut_tensor* t);   /* rc += 1, returns t */
void ut_free(ut_tensor* t);           /* rc -= 1, frees at 0; NULL is ignored */
void ut_free_n(ut_tensor** ts, int n);
int ut_sync_cpu(ut_tensor* t);        /* host copy current and owner; returns status */
int ut_sync_cpu_readonly(ut_tensor* t); /* host copy current, device copy stays valid */
int ut_sync_gpu(ut_tensor* t);        /* device copy current (no-op without one) */
int ut_to_device(ut_tensor* t, ut_dev dev); /* retag in place, moving data as needed */
ut_tensor* ut_copy(ut_tensor* t);     /* a new tensor with the same shape, device and values */
int ut_copy_into(ut_tensor* dst, ut_tensor* src); /* dst = src (same nelem, same device) */
ut_tensor* ut_reshape(ut_tensor* t, int ndim, const int* shape); /* copy with a new shape */
int ut_fill(ut_tensor* t, float value);
ut_tensor* ut_transpose(ut_tensor* t, int d0, int d1); /* new tensor with dims d0, d1 swapped */

/* ---- elementwise and dense ---------------------------------------------------------------- */
ut_tensor* ut_relu(ut_tensor* x);     /* any shape -> same shape */
ut_tensor* ut_relu6(ut_tensor* x);    /* min(max(x, 0), 6) */
/* grad_out, fwd_input: same shape; gradient passes where 0 < x (relu), 0 < x < 6 (relu6) */
ut_tensor* ut_relu_backward(ut_tensor* grad_out, ut_tensor* fwd_input);
ut_tensor* ut_relu6_backward(ut_tensor* grad_out, ut_tensor* fwd_input);
int ut_add_into(ut_tensor* dst, ut_tensor* src);   /* dst += src, same nelem */
int ut_scale(ut_tensor* t, float alpha);           /* t *= alpha */
ut_tensor* ut_matmul(ut_tensor* a, ut_tensor* b);  /* a: [M,K], b: [K,N] -> [M,N] */
/* x: [N,C,...] (or [N,C]), bias: [C]; in place x[n,c,...] += bias[c] */
int ut_bias_add(ut_tensor* x, ut_tensor* bias);

/* ---- layers ------------------------------------------------------------------------------- */
typedef struct ut_conv2d {
  ut_tensor* weight; /* [out_c, in_c, kh, kw] */
  ut_tensor* bias;   /* [out_c] or NULL */
  int in_c, out_c, kh, kw, stride, pad;
} ut_conv2d;

typedef struct ut_conv2d_cache {
  ut_tensor* input; /* [N, in_c, H, W] */
  ut_tensor* col;   /* [N, in_c*kh*kw, Ho*Wo] (the input itself for 1x1, stride 1, pad 0) */
} ut_conv2d_cache;

typedef struct ut_dwconv2d {
  ut_tensor* weight; /* [C, kh, kw] — one filter per channel, no cross-channel mixing */
  ut_tensor* bias;   /* [C] or NULL */
  int c, kh, kw, stride, pad;
} ut_dwconv2d;

typedef struct ut_dwconv2d_cache {
  ut_tensor* input; /* [N, C, H, W] */
} ut_dwconv2d_cache;

typedef struct ut_linear {
  ut_tensor* weight; /* [out_f, in_f] */
  ut_tensor* bias;   /* [out_f] or NULL */
  int in_f, out_f;
} ut_linear;

typedef struct ut_linear_cache {
  ut_tensor* input; /* [N, in_f] */
} ut_linear_cache;

typedef struct ut_layernorm {
  ut_tensor* weight; /* [D] gain */
  ut_tensor* bias;   /* [D] shift */
  int dim;
  float eps;
} ut_layernorm;

typedef struct ut_layernorm_cache {
  ut_tensor* input; /* [..., D] */
  ut_tensor* mean;  /* [rows] */
  ut_tensor* rstd;  /* [rows] 1/sqrt(var + eps) */
} ut_layernorm_cache;

typedef struct ut_batchnorm2d {
  ut_tensor* weight;       /* [C] gain */
  ut_tensor* bias;         /* [C] shift */
  ut_tensor* running_mean; /* [C] */
  ut_tensor* running_var;  /* [C] unbiased batch variance, averaged */
  int c;
  float eps;
  float momentum;          /* running = (1 - momentum) * running + momentum * batch */
  bool training;           /* true: batch statistics; false: running statistics */
} ut_batchnorm2d;

typedef struct ut_batchnorm2d_cache {
  ut_tensor* input; /* [N, C, H, W] */
  ut_tensor* mean;  /* [C] statistics the forward pass normalized with */
  ut_tensor* rstd;  /* [C] */
  bool training;    /* the mode of that forward pass */
} ut_batchnorm2d_cache;

/* Layer structs are returned by value; on failure weight is NULL and ut_last_error() says why.
   forward(l, x, cache_or_NULL): with a cache the inputs backward needs are retained in it. The
   cache is overwritten, not released (it may be uninitialized), so free a used cache with
   *_cache_free before passing it to forward again.
   backward(l, cache, grad_out, dW, db) -> dx, accumulating dW += ..., db += ... (db may be NULL).
   *_cache_free releases what a forward pass stored; *_free releases the layer's tensors. */

/* x: [N, in_c, H, W] -> [N, out_c, Ho, Wo], Ho = (H + 2*pad - kh)/stride + 1 */
ut_conv2d ut_conv2d_alloc(int in_c, int out_c, int kh, int kw, int stride, int pad, bool bias,
                          ut_dev dev);
ut_tensor* ut_conv2d_forward(ut_conv2d* l, ut_tensor* x, ut_conv2d_cache* cache);
/* grad_out: [N, out_c, Ho, Wo], dW: out_c*in_c*kh*kw elements, db: out_c -> dx [N, in_c, H, W] */
ut_tensor* ut_conv2d_backward(ut_conv2d* l, ut_conv2d_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db);
void ut_conv2d_cache_free(ut_conv2d_cache* c);
void ut_conv2d_free(ut_conv2d* l);

/* x: [N, C, H, W] -> [N, C, Ho, Wo], each channel convolved with its own kh x kw filter */
ut_dwconv2d ut_dwconv2d_alloc(int c, int kh, int kw, int stride, int pad, bool bias, ut_dev dev);
ut_tensor* ut_dwconv2d_forward(ut_dwconv2d* l, ut_tensor* x, ut_dwconv2d_cache* cache);
/* grad_out: [N, C, Ho, Wo], dW: C*kh*kw elements, db: C -> dx [N, C, H, W] */
ut_tensor* ut_dwconv2d_backward(ut_dwconv2d* l, ut_dwconv2d_cache* cache, ut_tensor* grad_out,
                                ut_tensor* dW, ut_tensor* db);
void ut_dwconv2d_cache_free(ut_dwconv2d_cache* c);
void ut_dwconv2d_free(ut_dwconv2d* l);

/* x: [N, in_f] -> [N, out_f], y = x W^T + b */
ut_linear ut_linear_alloc(int in_f, int out_f, bool bias, ut_dev dev);
ut_tensor* ut_linear_forward(ut_linear* l, ut_tensor* x, ut_linear_cache* cache);
/* grad_out: [N, out_f], dW: out_f*in_f, db: out_f -> dx [N, in_f] */
ut_tensor* ut_linear_backward(ut_linear* l, ut_linear_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db);
void ut_linear_cache_free(ut_linear_cache* c);
void ut_linear_free(ut_linear* l);

/* x: [..., D] -> same shape, normalized over the last dimension (weight = 1, bias = 0) */
ut_layernorm ut_layernorm_alloc(int dim, float eps, ut_dev dev);
ut_tensor* ut_layernorm_forward(ut_layernorm* l, ut_tensor* x, ut_layernorm_cache* cache);
/* grad_out: like x, dW: D, db: D -> dx like x */
ut_tensor* ut_layernorm_backward(ut_layernorm* l, ut_layernorm_cache* cache, ut_tensor* grad_out,
                                 ut_tensor* dW, ut_tensor* db);
void ut_layernorm_cache_free(ut_layernorm_cache* c);
void ut_layernorm_free(ut_layernorm* l);

/* x: [N, C, H, W] -> same shape. Training mode normalizes with the batch statistics (biased
   variance) and updates the running statistics; eval mode uses the running statistics. */
ut_batchnorm2d ut_batchnorm2d_alloc(int c, float eps, float momentum, ut_dev dev);
ut_tensor* ut_batchnorm2d_forward(ut_batchnorm2d* l, ut_tensor* x, ut_batchnorm2d_cache* cache);
/* grad_out: [N, C, H, W], dW: C, db: C -> dx [N, C, H, W] */
ut_tensor* ut_batchnorm2d_backward(ut_batchnorm2d* l, ut_batchnorm2d_cache* cache,
                                   ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db);
void ut_batchnorm2d_cache_free(ut_batchnorm2d_cache* c);
void ut_batchnorm2d_free(ut_batchnorm2d* l);

/* x: [N, C, H, W] -> [N, C], the mean over H and W */
ut_tensor* ut_global_avgpool2d_forward(ut_tensor* x);
/* grad_out: [N, C] -> dx [N, C, h, w] */
ut_tensor* ut_global_avgpool2d_backward(ut_tensor* grad_out, int h, int w);

/* ---- losses (scalar results are 1-element tensors, so they stay on the device) ------------ */
/* pred, target: same shape -> [1] mean((pred - target)^2) */
ut_tensor* ut_mse_loss(ut_tensor* pred, ut_tensor* target);
/* -> d loss / d pred = 2 (pred - target) / nelem, shaped like pred */
ut_tensor* ut_mse_loss_backward(ut_tensor* pred, ut_tensor* target);
/* logits: [N, K], labels: [N] class indices stored as floats in [0, K) -> [1] mean over the
   batch of -log softmax(logits)[label]. Labels that are not such an index are an error (checked
   on the host copy when it is current; on the GPU an invalid label makes the result NaN). */
ut_tensor* ut_cross_entropy_loss(ut_tensor* logits, ut_tensor* labels);
/* -> d loss / d logits = (softmax(logits) - onehot(labels)) / N, [N, K] */
ut_tensor* ut_cross_entropy_backward(ut_tensor* logits, ut_tensor* labels);

/* ---- optimizers: update param in place from grad (same nelem, same device) ---------------- */
/* velocity = momentum * velocity + grad; param -= lr * velocity (velocity NULL: plain SGD) */
int ut_sgd_step(ut_tensor* param, ut_tensor* grad, ut_tensor* velocity, float lr, float momentum);
/* Adam with bias correction; step is the 1-based update count; m, v start at zero */
int ut_adam_step(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step, float lr,
                 float beta1, float beta2, float eps);
/* UT_CDEF_END */

#ifndef __cplusplus
/* ut_free_all(a, b, ...): ut_free on each argument; NULL arguments are skipped. */
#define ut_free_all(...)                                             \
  ut_free_n((ut_tensor*[]){__VA_ARGS__},                             \
            (int)(sizeof((ut_tensor*[]){__VA_ARGS__}) / sizeof(ut_tensor*)))
#endif

#ifdef __cplusplus
}
#endif
#endif /* UTENSIL_H */

/* ============================================================================================
   BACKEND INTERFACE (private). Read by the implementation and by the CUDA translation unit
   (native/utensil_cuda.cu, which defines UT_BACKEND_INTERFACE before including this header).
   Plain C that also compiles as C++: no compound literals here.

   A backend is a table of functions over raw buffers of its own memory (host pointers for the
   CPU backend, device pointers for CUDA). The public entry points validate arguments, allocate
   outputs, make inputs current on the backend's side, call one or more of these, and mark which
   side they wrote. Every function returns UT_OK or a negative ut_status after ut__set_error().
   Counts are elements, not bytes. Outputs are fully overwritten unless the comment says "+=".
   ============================================================================================ */
#if defined(UT_IMPLEMENTATION) || defined(UT_BACKEND_INTERFACE)
#ifndef UTENSIL_BACKEND_INTERFACE_H
#define UTENSIL_BACKEND_INTERFACE_H
#ifdef __cplusplus
extern "C" {
#endif

typedef long long ut__i64;

/* A 2-D convolution's geometry: input [n, c, h, w], filter kh x kw, output [n, ?, ho, wo]. */
typedef struct ut__conv_geom {
  int n, c, h, w, kh, kw, stride, pad, ho, wo;
} ut__conv_geom;

/* Row-major batched GEMM: for each i < batch,
     C_i = alpha * op(A_i) * op(B_i) + beta * C_i,   op(A_i): [m, k], op(B_i): [k, n], C_i: [m, n]
   A_i = a + i*stride_a is [m, k] with row stride lda, or [k, m] when trans_a (likewise B).
   With sum_batch the products of all batch items are summed into one C (stride_c ignored):
     C = alpha * sum_i op(A_i) op(B_i) + beta * C.
   beta == 0 means C is not read (it may hold garbage). */
typedef struct ut__gemm_args {
  bool trans_a, trans_b, sum_batch;
  int m, n, k, batch;
  float alpha, beta;
  const float* a;
  int lda;
  ut__i64 stride_a;
  const float* b;
  int ldb;
  ut__i64 stride_b;
  float* c;
  int ldc;
  ut__i64 stride_c;
} ut__gemm_args;

typedef struct ut__backend {
  const char* name;
  /* device memory; NULL for the CPU backend, whose buffers are the tensors' host copies */
  void* (*mem_alloc)(size_t bytes);                    /* NULL + error on failure */
  void (*mem_free)(void* p);
  int (*upload)(void* dst, const float* src, size_t bytes);
  int (*download)(float* dst, const void* src, size_t bytes);
  int (*mem_info)(size_t* free_bytes, size_t* total_bytes);
  int (*synchronize)(void);                            /* wait for all queued work */
  /* make stream `waiting` wait for the work queued so far on `signalling` (NULL: the library's
     stream, the legacy default stream) */
  int (*stream_wait)(void* waiting, void* signalling);

  /* elementwise; cap > 0 clamps at cap (relu6), cap <= 0 is plain relu */
  int (*fill)(float* x, ut__i64 n, float v);
  int (*copy)(float* dst, const float* src, ut__i64 n);
  int (*axpy)(float* y, const float* x, ut__i64 n, float alpha);        /* y += alpha x */
  int (*scale)(float* x, ut__i64 n, float alpha);                       /* x *= alpha */
  int (*relu_fwd)(const float* x, float* y, ut__i64 n, float cap);
  /* gi = go where 0 < x (and x < cap when cap > 0), else 0 */
  int (*relu_bwd)(const float* go, const float* x, float* gi, ut__i64 n, float cap);

  /* in: [outer, d0, mid, d1, inner] -> out: [outer, d1, mid, d0, inner] */
  int (*transpose)(const float* in, float* out, int outer, int d0, int mid, int d1, int inner);
  int (*gemm)(const ut__gemm_args* args);
  /* x: [n, c, inner]; x[i, j, :] += bias[j] */
  int (*bias_add)(float* x, const float* bias, int n, int c, ut__i64 inner);
  /* x: [n, c, inner]; out[j] = beta * out[j] + sum_{i, :} x[i, j, :]  (beta is 0 or 1) */
  int (*channel_sum)(const float* x, float* out, int n, int c, ut__i64 inner, float beta);
  /* x: [rows, cols] -> y: [rows] mean of each row */
  int (*row_mean)(const float* x, float* y, int rows, ut__i64 cols);
  /* go: [rows] -> dx: [rows, cols], dx[r, :] = go[r] / cols */
  int (*row_mean_bwd)(const float* go, float* dx, int rows, ut__i64 cols);

  /* x: [n, c, h, w] -> col: [n, c*kh*kw, ho*wo] (zero where the window hits padding) */
  int (*im2col)(const float* x, float* col, const ut__conv_geom* g);
  /* col: [n, c*kh*kw, ho*wo] -> dx: [n, c, h, w], the adjoint of im2col (overwrites dx) */
  int (*col2im)(const float* col, float* dx, const ut__conv_geom* g);

  /* depthwise: x: [n, c, h, w], w: [c, kh, kw], bias: [c] or NULL -> y: [n, c, ho, wo] */
  int (*dw_fwd)(const float* x, const float* w, const float* bias, float* y, const ut__conv_geom* g);
  /* go: [n, c, ho, wo], w -> dx: [n, c, h, w] (overwrites) */
  int (*dw_bwd_dx)(const float* go, const float* w, float* dx, const ut__conv_geom* g);
  /* go, x -> dw: [c, kh, kw]  += */
  int (*dw_bwd_dw)(const float* go, const float* x, float* dw, const ut__conv_geom* g);

  /* x: [rows, dim] -> y, mean: [rows], rstd: [rows]; y = (x - mean) * rstd * gamma + beta */
  int (*layernorm_fwd)(const float* x, const float* gamma, const float* beta, float* y,
                       float* mean, float* rstd, int rows, int dim, float eps);
  /* -> dx (overwrites); dgamma, dbeta: [dim] += (each may be NULL) */
  int (*layernorm_bwd)(const float* go, const float* x, const float* gamma, const float* mean,
                       const float* rstd, float* dx, float* dgamma, float* dbeta, int rows,
                       int dim);

  /* x: [n, c, inner] -> mean, var: [c], the biased batch statistics per channel */
  int (*bn_stats)(const float* x, float* mean, float* var, int n, int c, ut__i64 inner);
  /* running = (1 - momentum) running + momentum * stat, with var scaled by unbias first */
  int (*bn_update_running)(float* running_mean, float* running_var, const float* mean,
                           const float* var, int c, float momentum, float unbias);
  /* rstd[j] = 1/sqrt(var[j] + eps); y = (x - mean) * rstd * gamma + beta */
  int (*bn_apply)(const float* x, float* y, const float* mean, const float* var,
                  const float* gamma, const float* beta, float* rstd, int n, int c,
                  ut__i64 inner, float eps);
  /* training: dx = gamma rstd (go - mean(go) - xhat mean(go xhat)) per channel;
     eval: dx = gamma rstd go. dgamma += sum(go xhat), dbeta += sum(go) (each may be NULL) */
  int (*bn_bwd)(const float* go, const float* x, const float* mean, const float* rstd,
                const float* gamma, float* dx, float* dgamma, float* dbeta, int n, int c,
                ut__i64 inner, bool training);

  /* out[0] = mean((p - t)^2);  g = 2 (p - t) / n */
  int (*mse_fwd)(const float* p, const float* t, float* out, ut__i64 n);
  int (*mse_bwd)(const float* p, const float* t, float* g, ut__i64 n);
  /* logits: [n, k], labels: [n] -> out[0] = mean -log softmax[label]; g = (softmax - onehot)/n.
     A label that is not an integer in [0, k) gives NaN (the core checks labels on the host). */
  int (*ce_fwd)(const float* logits, const float* labels, float* out, int n, int k);
  int (*ce_bwd)(const float* logits, const float* labels, float* g, int n, int k);

  /* v = momentum v + g; p -= lr v   (v NULL: p -= lr g) */
  int (*sgd)(float* p, const float* g, float* v, ut__i64 n, float lr, float momentum);
  /* m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/bc1) / (sqrt(v/bc2) + eps) */
  int (*adam)(float* p, const float* g, float* m, float* v, ut__i64 n, float lr, float b1,
              float b2, float eps, float bc1, float bc2);
} ut__backend;

/* Set by any part of the library; formats like printf. Returns status for `return ut__fail(...)`. */
int ut__set_error(int status, const char* fmt, ...);

/* The CUDA backend when built in and a GPU is present, else NULL (defined in utensil_cuda.cu). */
const ut__backend* ut__cuda_backend(void);

#ifdef __cplusplus
}
#endif
#endif /* UTENSIL_BACKEND_INTERFACE_H */
#endif /* UT_IMPLEMENTATION || UT_BACKEND_INTERFACE */

/* ============================================================================================
   IMPLEMENTATION
   ============================================================================================ */
#ifdef UT_IMPLEMENTATION
#ifndef UTENSIL_IMPLEMENTATION_DONE
#define UTENSIL_IMPLEMENTATION_DONE

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- errors ------------------------------------------------------------------------------ */
static _Thread_local char ut__err_msg[512];
static _Thread_local int ut__err_status;

int ut__set_error(int status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ut__err_msg, sizeof ut__err_msg, fmt, ap);
  va_end(ap);
  ut__err_status = status;
  return status;
}
const char* ut_last_error(void) { return ut__err_msg; }
ut_status ut_last_status(void) { return (ut_status)ut__err_status; }
void ut_clear_error(void) {
  ut__err_msg[0] = 0;
  ut__err_status = UT_OK;
}
int ut_version(void) { return UT_VERSION; }

/* Early exits for validation: the first failing condition sets the message and returns. */
#define UT__CHECK_NULL(cond, status, ...)    \
  do {                                       \
    if (!(cond)) {                           \
      ut__set_error((status), __VA_ARGS__);  \
      return NULL;                           \
    }                                        \
  } while (0)
#define UT__CHECK(cond, status, ...)               \
  do {                                             \
    if (!(cond)) return ut__set_error((status), __VA_ARGS__); \
  } while (0)
#define UT__TRY(expr)          \
  do {                         \
    int ut__rc_ = (expr);      \
    if (ut__rc_ < 0) return ut__rc_; \
  } while (0)

/* ---- library state ------------------------------------------------------------------------ */
static atomic_llong ut__live = 0;
static atomic_int ut__nthreads = 0; /* 0: not yet set, use the cores present */

int ut_set_num_threads(int n) {
  UT__CHECK(n >= 1 && n <= 4096, UT_ERR_ARG, "ut_set_num_threads: n must be in [1, 4096], got %d", n);
  atomic_store(&ut__nthreads, n);
  return UT_OK;
}
int ut_get_num_threads(void) {
  int n = atomic_load(&ut__nthreads);
  if (n > 0) return n;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return cores > 0 ? (int)cores : 1;
}
long long ut_live_tensors(void) { return atomic_load(&ut__live); }

static atomic_llong ut__uploads = 0, ut__downloads = 0;
void ut_transfer_counts(long long* uploads, long long* downloads) {
  if (uploads) *uploads = atomic_load(&ut__uploads);
  if (downloads) *downloads = atomic_load(&ut__downloads);
}

/* The RNG: xoshiro256** seeded through splitmix64, shared by all threads under a lock. */
static pthread_mutex_t ut__rng_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t ut__rng_s[4];
static bool ut__rng_seeded = false;

static uint64_t ut__splitmix64(uint64_t* x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static void ut__rng_seed_locked(unsigned long long seed) {
  uint64_t x = seed;
  for (int i = 0; i < 4; i++) ut__rng_s[i] = ut__splitmix64(&x);
  ut__rng_seeded = true;
}
void ut_seed(unsigned long long seed) {
  pthread_mutex_lock(&ut__rng_lock);
  ut__rng_seed_locked(seed);
  pthread_mutex_unlock(&ut__rng_lock);
}
static uint64_t ut__rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static uint64_t ut__rng_next_locked(void) {
  uint64_t* s = ut__rng_s;
  uint64_t result = ut__rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = ut__rotl(s[3], 45);
  return result;
}
/* uniform in (0, 1] */
static double ut__rng_uniform_locked(void) {
  return ((double)(ut__rng_next_locked() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}
static void ut__fill_randn(float* out, ut__i64 n, float mean, float std) {
  pthread_mutex_lock(&ut__rng_lock);
  if (!ut__rng_seeded) ut__rng_seed_locked(0x5eed);
  for (ut__i64 i = 0; i < n; i += 2) {
    double r = sqrt(-2.0 * log(ut__rng_uniform_locked()));
    double th = 6.283185307179586 * ut__rng_uniform_locked();
    out[i] = (float)(mean + std * r * cos(th));
    if (i + 1 < n) out[i + 1] = (float)(mean + std * r * sin(th));
  }
  pthread_mutex_unlock(&ut__rng_lock);
}

/* ---- backends ----------------------------------------------------------------------------- */
#if __has_include("utensil_cpu.inc")
#include "utensil_cpu.inc"
#endif

#ifdef UT_NO_CUDA
const ut__backend* ut__cuda_backend(void) { return NULL; }
#endif

static const ut__backend* ut__backend_for(ut_dev dev) {
  if (dev == UT_CUDA) {
    const ut__backend* gpu = ut__cuda_backend();
    if (gpu) return gpu;
  }
  return &ut__cpu_backend;
}
static bool ut__is_device_backend(const ut__backend* be) { return be->mem_alloc != NULL; }

bool ut_cuda_available(void) { return ut__cuda_backend() != NULL; }
const char* ut_backend_name(ut_dev dev) {
  if (dev != UT_CPU && dev != UT_CUDA) return "invalid";
  return ut__backend_for(dev)->name;
}
int ut_cuda_synchronize(void) {
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->synchronize() : UT_OK;
}
int ut_cuda_stream_wait(void* waiting, void* signalling) {
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->stream_wait(waiting, signalling) : UT_OK;
}
int ut_cuda_mem_info(size_t* free_bytes, size_t* total_bytes) {
  UT__CHECK(free_bytes && total_bytes, UT_ERR_ARG, "ut_cuda_mem_info: NULL argument");
  const ut__backend* gpu = ut__cuda_backend();
  UT__CHECK(gpu, UT_ERR_DEVICE, "ut_cuda_mem_info: no CUDA device is available");
  return gpu->mem_info(free_bytes, total_bytes);
}

/* ---- shapes and tensors ------------------------------------------------------------------- */
static int ut__shape_make(ut_shape* s, int ndim, const int* shape, const char* who) {
  memset(s, 0, sizeof *s);
  UT__CHECK(shape || ndim == 0, UT_ERR_ARG, "%s: shape is NULL", who);
  UT__CHECK(ndim >= 1 && ndim <= UT_MAX_DIMS, UT_ERR_SHAPE,
            "%s: ndim must be in [1, %d], got %d", who, UT_MAX_DIMS, ndim);
  long long n = 1;
  for (int i = 0; i < ndim; i++) {
    UT__CHECK(shape[i] >= 1, UT_ERR_SHAPE, "%s: dimension %d must be positive, got %d", who, i,
              shape[i]);
    n *= shape[i];
    UT__CHECK(n <= INT_MAX, UT_ERR_SHAPE, "%s: more than %d elements", who, INT_MAX);
  }
  s->ndim = ndim;
  for (int i = 0; i < ndim; i++) s->shape[i] = shape[i];
  s->nelem = (int)n;
  return UT_OK;
}

ut_shape ut_shape_new(int ndim, const int* shape) {
  ut_shape s;
  ut__shape_make(&s, ndim, shape, "ut_shape_new");
  return s;
}

static bool ut__dev_valid(ut_dev dev) { return dev == UT_CPU || dev == UT_CUDA; }

/* A tensor with uninitialized contents. Its host copy is allocated but not touched, so large
   GPU-resident intermediates cost no host memory until someone reads them. */
static ut_tensor* ut__new(int ndim, const int* shape, ut_dev dev, const char* who) {
  UT__CHECK_NULL(ut__dev_valid(dev), UT_ERR_ARG, "%s: invalid device %d", who, (int)dev);
  ut_shape s;
  if (ut__shape_make(&s, ndim, shape, who) < 0) return NULL;
  size_t bytes = ((size_t)s.nelem * sizeof(float) + 63) & ~(size_t)63;
  ut_tensor* t = (ut_tensor*)calloc(1, sizeof *t);
  float* data = (float*)aligned_alloc(64, bytes);
  if (!t || !data) {
    free(t);
    free(data);
    ut__set_error(UT_ERR_MEMORY, "%s: out of host memory allocating %zu bytes", who, bytes);
    return NULL;
  }
  t->shape = s;
  t->data = data;
  t->dev = dev;
  t->rc = 1;
  const ut__backend* be = ut__backend_for(dev);
  if (ut__is_device_backend(be)) {
    t->gpu_buf = be->mem_alloc(bytes);
    if (!t->gpu_buf) {
      free(data);
      free(t);
      return NULL; /* the backend set the error */
    }
  }
  atomic_fetch_add(&ut__live, 1);
  return t;
}
static ut_tensor* ut__new_like(const ut_tensor* t, const char* who) {
  return ut__new(t->shape.ndim, t->shape.shape, t->dev, who);
}
/* A tensor whose host copy the caller just filled: the host owns the values. */
static void ut__host_wrote(ut_tensor* t) {
  t->dirty_cpu = false;
  t->dirty_gpu = t->gpu_buf != NULL;
}

ut_tensor* ut_alloc(int ndim, const int* shape, ut_dev dev) {
  ut_tensor* t = ut__new(ndim, shape, dev, "ut_alloc");
  if (!t) return NULL;
  memset(t->data, 0, (size_t)t->shape.nelem * sizeof(float));
  ut__host_wrote(t);
  return t;
}

ut_tensor* ut_from_data(int ndim, const int* shape, const float* data, ut_dev dev) {
  UT__CHECK_NULL(data, UT_ERR_ARG, "ut_from_data: data is NULL");
  ut_tensor* t = ut__new(ndim, shape, dev, "ut_from_data");
  if (!t) return NULL;
  memcpy(t->data, data, (size_t)t->shape.nelem * sizeof(float));
  ut__host_wrote(t);
  return t;
}

ut_tensor* ut_randn(int ndim, const int* shape, float mean, float std, ut_dev dev) {
  UT__CHECK_NULL(isfinite(mean) && isfinite(std) && std >= 0, UT_ERR_ARG,
                 "ut_randn: mean and std must be finite and std >= 0");
  ut_tensor* t = ut__new(ndim, shape, dev, "ut_randn");
  if (!t) return NULL;
  ut__fill_randn(t->data, t->shape.nelem, mean, std);
  ut__host_wrote(t);
  return t;
}

ut_tensor* ut_wrap(int ndim, const int* shape, ut_dev dev, void* ptr, void (*release)(void* ctx),
                   void* ctx) {
  const char* who = "ut_wrap";
  UT__CHECK_NULL(ptr, UT_ERR_ARG, "%s: ptr is NULL", who);
  UT__CHECK_NULL(ut__dev_valid(dev), UT_ERR_ARG, "%s: invalid device %d", who, (int)dev);
  const ut__backend* be = ut__backend_for(dev);
  UT__CHECK_NULL(dev == UT_CPU || ut__is_device_backend(be), UT_ERR_DEVICE,
                 "%s: device memory needs a CUDA device, and none is available", who);
  ut_shape s;
  if (ut__shape_make(&s, ndim, shape, who) < 0) return NULL;
  ut_tensor* t = (ut_tensor*)calloc(1, sizeof *t);
  float* host = NULL;
  if (t && dev == UT_CUDA) {
    size_t bytes = ((size_t)s.nelem * sizeof(float) + 63) & ~(size_t)63;
    host = (float*)aligned_alloc(64, bytes);
  }
  if (!t || (dev == UT_CUDA && !host)) {
    free(t);
    ut__set_error(UT_ERR_MEMORY, "%s: out of host memory", who);
    return NULL;
  }
  t->shape = s;
  t->dev = dev;
  t->rc = 1;
  t->borrowed = true;
  t->release = release;
  t->release_ctx = ctx;
  if (dev == UT_CUDA) {
    t->data = host;
    t->gpu_buf = ptr;
    t->dirty_cpu = true; /* the device memory holds the values */
  } else {
    t->data = (float*)ptr;
  }
  atomic_fetch_add(&ut__live, 1);
  return t;
}

/* rc stays a plain int (the bindings declare the struct), updated with atomic builtins so two
   threads may retain and free one tensor at once. */
ut_tensor* ut_retain(ut_tensor* t) {
  if (t) __atomic_fetch_add(&t->rc, 1, __ATOMIC_RELAXED);
  return t;
}

void ut_free(ut_tensor* t) {
  if (!t || __atomic_sub_fetch(&t->rc, 1, __ATOMIC_ACQ_REL) > 0) return;
  bool own_gpu = !(t->borrowed && t->dev == UT_CUDA), own_host = !(t->borrowed && t->dev == UT_CPU);
  if (t->gpu_buf && own_gpu) {
    const ut__backend* gpu = ut__cuda_backend();
    if (gpu) gpu->mem_free(t->gpu_buf);
  }
  if (own_host) free(t->data);
  if (t->release) t->release(t->release_ctx);
  free(t);
  atomic_fetch_sub(&ut__live, 1);
}

void ut_free_n(ut_tensor** ts, int n) {
  if (!ts) return;
  for (int i = 0; i < n; i++) ut_free(ts[i]);
}

static int ut__check_tensor(const ut_tensor* t, const char* who, const char* name) {
  UT__CHECK(t, UT_ERR_ARG, "%s: %s is NULL", who, name);
  UT__CHECK(t->rc >= 1 && t->data && t->shape.ndim >= 1 && t->shape.ndim <= UT_MAX_DIMS &&
                ut__dev_valid(t->dev),
            UT_ERR_ARG, "%s: %s is not a live tensor", who, name);
  return UT_OK;
}
static int ut__check_same_dev(const ut_tensor* a, const ut_tensor* b, const char* who,
                              const char* name) {
  UT__CHECK(a->dev == b->dev, UT_ERR_ARG, "%s: %s is on %s but the op runs on %s", who, name,
            b->dev == UT_CPU ? "cpu" : "cuda", a->dev == UT_CPU ? "cpu" : "cuda");
  return UT_OK;
}
/* t is a live tensor on ref's device (ref NULL: any) with `nelem` elements (-1: any). */
static int ut__check_arg(const ut_tensor* t, const ut_tensor* ref, long long nelem, const char* who,
                         const char* name) {
  UT__TRY(ut__check_tensor(t, who, name));
  if (ref) UT__TRY(ut__check_same_dev(ref, t, who, name));
  UT__CHECK(nelem < 0 || t->shape.nelem == nelem, UT_ERR_SHAPE,
            "%s: %s must have %lld elements, got %d", who, name, nelem, t->shape.nelem);
  return UT_OK;
}
static int ut__check_ndim(const ut_tensor* t, int ndim, const char* who, const char* name) {
  UT__CHECK(t->shape.ndim == ndim, UT_ERR_SHAPE, "%s: %s must be %d-D, got %d-D", who, name, ndim,
            t->shape.ndim);
  return UT_OK;
}
static bool ut__same_shape(const ut_tensor* a, const ut_tensor* b) {
  if (a->shape.ndim != b->shape.ndim) return false;
  for (int i = 0; i < a->shape.ndim; i++)
    if (a->shape.shape[i] != b->shape.shape[i]) return false;
  return true;
}

/* ---- the host/device mirror --------------------------------------------------------------- */
static int ut__download(ut_tensor* t) {
  if (t->gpu_buf && t->dirty_cpu) {
    const ut__backend* gpu = ut__cuda_backend();
    UT__CHECK(gpu, UT_ERR_DEVICE, "ut_sync_cpu: the tensor's GPU copy is unreachable");
    UT__TRY(gpu->download(t->data, t->gpu_buf, (size_t)t->shape.nelem * sizeof(float)));
    atomic_fetch_add(&ut__downloads, 1);
    t->dirty_cpu = false;
  }
  return UT_OK;
}
int ut_sync_cpu(ut_tensor* t) {
  UT__TRY(ut__check_tensor(t, "ut_sync_cpu", "t"));
  UT__TRY(ut__download(t));
  ut__host_wrote(t); /* the caller may now write through data */
  return UT_OK;
}
int ut_sync_cpu_readonly(ut_tensor* t) {
  UT__TRY(ut__check_tensor(t, "ut_sync_cpu_readonly", "t"));
  return ut__download(t);
}
int ut_sync_gpu(ut_tensor* t) {
  UT__TRY(ut__check_tensor(t, "ut_sync_gpu", "t"));
  if (t->gpu_buf && t->dirty_gpu) {
    const ut__backend* gpu = ut__cuda_backend();
    UT__CHECK(gpu, UT_ERR_DEVICE, "ut_sync_gpu: no CUDA device is available");
    UT__TRY(gpu->upload(t->gpu_buf, t->data, (size_t)t->shape.nelem * sizeof(float)));
    atomic_fetch_add(&ut__uploads, 1);
    t->dirty_gpu = false;
  }
  return UT_OK;
}
int ut_to_device(ut_tensor* t, ut_dev dev) {
  UT__TRY(ut__check_tensor(t, "ut_to_device", "t"));
  UT__CHECK(ut__dev_valid(dev), UT_ERR_ARG, "ut_to_device: invalid device %d", (int)dev);
  if (t->dev == dev) return UT_OK;
  UT__CHECK(!t->borrowed, UT_ERR_ARG,
            "ut_to_device: a tensor over borrowed memory (ut_wrap) cannot change device; copy it");
  const ut__backend* be = ut__backend_for(dev);
  if (ut__is_device_backend(be)) {
    size_t bytes = ((size_t)t->shape.nelem * sizeof(float) + 63) & ~(size_t)63;
    void* buf = be->mem_alloc(bytes);
    if (!buf) return ut__err_status;
    t->gpu_buf = buf;
    t->dirty_gpu = true;
    t->dirty_cpu = false;
    UT__TRY(ut_sync_gpu(t));
  } else if (t->gpu_buf) {
    UT__TRY(ut__download(t));
    ut__cuda_backend()->mem_free(t->gpu_buf);
    t->gpu_buf = NULL;
    t->dirty_cpu = t->dirty_gpu = false;
  }
  t->dev = dev;
  return UT_OK;
}

/* Op plumbing: an op picks the backend of its first tensor's device, reads its inputs through
   ut__in (current on that side), and marks each tensor it wrote with ut__wrote. */
static const float* ut__in(ut_tensor* t, const ut__backend* be) {
  if (ut__is_device_backend(be)) {
    if (ut_sync_gpu(t) < 0) return NULL;
    return (const float*)t->gpu_buf;
  }
  if (ut__download(t) < 0) return NULL;
  return t->data;
}
/* A tensor the op reads and then writes (accumulators, in-place updates). */
static float* ut__inout(ut_tensor* t, const ut__backend* be) { return (float*)ut__in(t, be); }
/* A fresh output: nothing to read. */
static float* ut__out(ut_tensor* t, const ut__backend* be) {
  return ut__is_device_backend(be) ? (float*)t->gpu_buf : t->data;
}
static void ut__wrote(ut_tensor* t, const ut__backend* be) {
  if (ut__is_device_backend(be)) {
    t->dirty_cpu = true;
    t->dirty_gpu = false;
  } else {
    t->dirty_cpu = false;
    t->dirty_gpu = t->gpu_buf != NULL;
  }
}
/* Release a tensor and return NULL: for `return ut__drop(out);` on a failure path. */
static ut_tensor* ut__drop(ut_tensor* t) {
  ut_free(t);
  return NULL;
}
/* Run one backend call that wrote `out`: on failure free out and return NULL. */
static ut_tensor* ut__finish(ut_tensor* out, const ut__backend* be, int rc) {
  if (rc < 0) return ut__drop(out);
  ut__wrote(out, be);
  return out;
}

/* ---- whole-tensor utilities --------------------------------------------------------------- */
ut_tensor* ut_copy(ut_tensor* t) {
  if (ut__check_tensor(t, "ut_copy", "t") < 0) return NULL;
  const ut__backend* be = ut__backend_for(t->dev);
  const float* src = ut__in(t, be);
  if (!src) return NULL;
  ut_tensor* out = ut__new_like(t, "ut_copy");
  if (!out) return NULL;
  return ut__finish(out, be, be->copy(ut__out(out, be), src, t->shape.nelem));
}

int ut_copy_into(ut_tensor* dst, ut_tensor* src) {
  UT__TRY(ut__check_tensor(dst, "ut_copy_into", "dst"));
  UT__TRY(ut__check_arg(src, dst, dst->shape.nelem, "ut_copy_into", "src"));
  if (dst == src) return UT_OK;
  const ut__backend* be = ut__backend_for(dst->dev);
  const float* s = ut__in(src, be);
  if (!s) return ut__err_status;
  UT__TRY(be->copy(ut__out(dst, be), s, dst->shape.nelem));
  ut__wrote(dst, be);
  return UT_OK;
}

ut_tensor* ut_reshape(ut_tensor* t, int ndim, const int* shape) {
  if (ut__check_tensor(t, "ut_reshape", "t") < 0) return NULL;
  ut_shape s;
  if (ut__shape_make(&s, ndim, shape, "ut_reshape") < 0) return NULL;
  UT__CHECK_NULL(s.nelem == t->shape.nelem, UT_ERR_SHAPE,
                 "ut_reshape: the new shape has %d elements, the tensor %d", s.nelem,
                 t->shape.nelem);
  ut_tensor* out = ut_copy(t);
  if (out) out->shape = s;
  return out;
}

int ut_fill(ut_tensor* t, float value) {
  UT__TRY(ut__check_tensor(t, "ut_fill", "t"));
  const ut__backend* be = ut__backend_for(t->dev);
  UT__TRY(be->fill(ut__out(t, be), t->shape.nelem, value));
  ut__wrote(t, be);
  return UT_OK;
}

ut_tensor* ut_transpose(ut_tensor* t, int d0, int d1) {
  if (ut__check_tensor(t, "ut_transpose", "t") < 0) return NULL;
  int nd = t->shape.ndim;
  UT__CHECK_NULL(d0 >= 0 && d0 < nd && d1 >= 0 && d1 < nd, UT_ERR_ARG,
                 "ut_transpose: dims (%d, %d) out of range for a %d-D tensor", d0, d1, nd);
  if (d0 == d1) return ut_copy(t);
  if (d0 > d1) {
    int tmp = d0;
    d0 = d1;
    d1 = tmp;
  }
  const int* sh = t->shape.shape;
  int outer = 1, mid = 1, inner = 1;
  for (int i = 0; i < d0; i++) outer *= sh[i];
  for (int i = d0 + 1; i < d1; i++) mid *= sh[i];
  for (int i = d1 + 1; i < nd; i++) inner *= sh[i];
  int oshape[UT_MAX_DIMS];
  memcpy(oshape, sh, sizeof(int) * (size_t)nd);
  oshape[d0] = sh[d1];
  oshape[d1] = sh[d0];
  const ut__backend* be = ut__backend_for(t->dev);
  const float* src = ut__in(t, be);
  if (!src) return NULL;
  ut_tensor* out = ut__new(nd, oshape, t->dev, "ut_transpose");
  if (!out) return NULL;
  return ut__finish(out, be,
                    be->transpose(src, ut__out(out, be), outer, sh[d0], mid, sh[d1], inner));
}

/* ---- elementwise -------------------------------------------------------------------------- */
static ut_tensor* ut__relu_fwd(ut_tensor* x, float cap, const char* who) {
  if (ut__check_tensor(x, who, "x") < 0) return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  if (!xp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  if (!y) return NULL;
  return ut__finish(y, be, be->relu_fwd(xp, ut__out(y, be), x->shape.nelem, cap));
}
ut_tensor* ut_relu(ut_tensor* x) { return ut__relu_fwd(x, 0.f, "ut_relu"); }
ut_tensor* ut_relu6(ut_tensor* x) { return ut__relu_fwd(x, 6.f, "ut_relu6"); }

static ut_tensor* ut__relu_bwd(ut_tensor* go, ut_tensor* x, float cap, const char* who) {
  if (ut__check_tensor(go, who, "grad_out") < 0 || ut__check_arg(x, go, -1, who, "fwd_input") < 0)
    return NULL;
  UT__CHECK_NULL(ut__same_shape(go, x), UT_ERR_SHAPE,
                 "%s: grad_out and fwd_input must have the same shape", who);
  const ut__backend* be = ut__backend_for(go->dev);
  const float* gp = ut__in(go, be);
  const float* xp = gp ? ut__in(x, be) : NULL;
  if (!xp) return NULL;
  ut_tensor* gi = ut__new_like(go, who);
  if (!gi) return NULL;
  return ut__finish(gi, be, be->relu_bwd(gp, xp, ut__out(gi, be), go->shape.nelem, cap));
}
ut_tensor* ut_relu_backward(ut_tensor* grad_out, ut_tensor* fwd_input) {
  return ut__relu_bwd(grad_out, fwd_input, 0.f, "ut_relu_backward");
}
ut_tensor* ut_relu6_backward(ut_tensor* grad_out, ut_tensor* fwd_input) {
  return ut__relu_bwd(grad_out, fwd_input, 6.f, "ut_relu6_backward");
}

int ut_add_into(ut_tensor* dst, ut_tensor* src) {
  UT__TRY(ut__check_tensor(dst, "ut_add_into", "dst"));
  UT__TRY(ut__check_arg(src, dst, dst->shape.nelem, "ut_add_into", "src"));
  const ut__backend* be = ut__backend_for(dst->dev);
  const float* s = ut__in(src, be);
  float* d = s ? ut__inout(dst, be) : NULL;
  if (!d) return ut__err_status;
  UT__TRY(be->axpy(d, s, dst->shape.nelem, 1.f));
  ut__wrote(dst, be);
  return UT_OK;
}

int ut_scale(ut_tensor* t, float alpha) {
  UT__TRY(ut__check_tensor(t, "ut_scale", "t"));
  const ut__backend* be = ut__backend_for(t->dev);
  float* p = ut__inout(t, be);
  if (!p) return ut__err_status;
  UT__TRY(be->scale(p, t->shape.nelem, alpha));
  ut__wrote(t, be);
  return UT_OK;
}

/* ---- dense -------------------------------------------------------------------------------- */
ut_tensor* ut_matmul(ut_tensor* a, ut_tensor* b) {
  const char* who = "ut_matmul";
  if (ut__check_tensor(a, who, "a") < 0 || ut__check_arg(b, a, -1, who, "b") < 0 ||
      ut__check_ndim(a, 2, who, "a") < 0 || ut__check_ndim(b, 2, who, "b") < 0)
    return NULL;
  int M = a->shape.shape[0], K = a->shape.shape[1], N = b->shape.shape[1];
  UT__CHECK_NULL(b->shape.shape[0] == K, UT_ERR_SHAPE,
                 "ut_matmul: a is [%d, %d] but b is [%d, %d]", M, K, b->shape.shape[0], N);
  const ut__backend* be = ut__backend_for(a->dev);
  const float* ap = ut__in(a, be);
  const float* bp = ap ? ut__in(b, be) : NULL;
  if (!bp) return NULL;
  ut_tensor* c = ut__new(2, (int[]){M, N}, a->dev, who);
  if (!c) return NULL;
  ut__gemm_args g = {.m = M, .n = N, .k = K, .batch = 1, .alpha = 1.f, .beta = 0.f,
                     .a = ap, .lda = K, .b = bp, .ldb = N, .c = ut__out(c, be), .ldc = N};
  return ut__finish(c, be, be->gemm(&g));
}

int ut_bias_add(ut_tensor* x, ut_tensor* bias) {
  const char* who = "ut_bias_add";
  UT__TRY(ut__check_tensor(x, who, "x"));
  UT__CHECK(x->shape.ndim >= 2, UT_ERR_SHAPE, "ut_bias_add: x must be at least 2-D ([N, C, ...])");
  int C = x->shape.shape[1];
  UT__TRY(ut__check_arg(bias, x, C, who, "bias"));
  const ut__backend* be = ut__backend_for(x->dev);
  const float* bp = ut__in(bias, be);
  float* xp = bp ? ut__inout(x, be) : NULL;
  if (!xp) return ut__err_status;
  UT__TRY(be->bias_add(xp, bp, x->shape.shape[0], C,
                       (ut__i64)x->shape.nelem / ((ut__i64)x->shape.shape[0] * C)));
  ut__wrote(x, be);
  return UT_OK;
}

/* ---- convolutions ------------------------------------------------------------------------- */
/* x must be [N, c, H, W] and the window must fit the padded input; fills g. */
static int ut__conv_geometry(ut__conv_geom* g, const ut_tensor* x, int c, int kh, int kw,
                             int stride, int pad, const char* who) {
  UT__TRY(ut__check_ndim(x, 4, who, "x"));
  UT__CHECK(x->shape.shape[1] == c, UT_ERR_SHAPE, "%s: x has %d channels, the layer expects %d",
            who, x->shape.shape[1], c);
  UT__CHECK(stride >= 1, UT_ERR_ARG, "%s: stride must be >= 1, got %d", who, stride);
  UT__CHECK(pad >= 0, UT_ERR_ARG, "%s: padding must be >= 0, got %d", who, pad);
  long long H = x->shape.shape[2], W = x->shape.shape[3];
  UT__CHECK(H + 2LL * pad >= kh && W + 2LL * pad >= kw, UT_ERR_SHAPE,
            "%s: the %dx%d kernel is larger than the padded %lldx%lld input", who, kh, kw,
            H + 2LL * pad, W + 2LL * pad);
  long long ho = (H + 2LL * pad - kh) / stride + 1, wo = (W + 2LL * pad - kw) / stride + 1;
  UT__CHECK(ho <= INT_MAX && wo <= INT_MAX, UT_ERR_SHAPE, "%s: output too large", who);
  *g = (ut__conv_geom){.n = x->shape.shape[0], .c = c, .h = (int)H, .w = (int)W, .kh = kh,
                       .kw = kw, .stride = stride, .pad = pad, .ho = (int)ho, .wo = (int)wo};
  return UT_OK;
}

/* A layer's weight and optional bias: live, on one device, with the expected element counts. */
static int ut__check_params(const ut_tensor* w, const ut_tensor* b, long long wn, long long bn,
                            const char* who) {
  UT__TRY(ut__check_arg(w, NULL, wn, who, "the layer's weight"));
  if (b) UT__TRY(ut__check_arg(b, w, bn, who, "the layer's bias"));
  return UT_OK;
}
static int ut__check_kernel_args(int kh, int kw, int stride, int pad, const char* who) {
  UT__CHECK(kh >= 1 && kw >= 1, UT_ERR_ARG, "%s: kernel size must be positive, got %dx%d", who, kh,
            kw);
  UT__CHECK(stride >= 1, UT_ERR_ARG, "%s: stride must be >= 1, got %d", who, stride);
  UT__CHECK(pad >= 0, UT_ERR_ARG, "%s: padding must be >= 0, got %d", who, pad);
  return UT_OK;
}
static long long ut__prod(long long a, long long b, long long c, long long d) {
  long long p = a * b;
  if (p > INT_MAX) return (long long)INT_MAX + 1;
  p *= c;
  if (p > INT_MAX) return (long long)INT_MAX + 1;
  p *= d;
  return p;
}

ut_conv2d ut_conv2d_alloc(int in_c, int out_c, int kh, int kw, int stride, int pad, bool bias,
                          ut_dev dev) {
  ut_conv2d l = {.in_c = in_c, .out_c = out_c, .kh = kh, .kw = kw, .stride = stride, .pad = pad};
  if (ut__check_kernel_args(kh, kw, stride, pad, "ut_conv2d_alloc") < 0) return l;
  if (in_c < 1 || out_c < 1) {
    ut__set_error(UT_ERR_ARG, "ut_conv2d_alloc: channel counts must be positive, got %d -> %d",
                  in_c, out_c);
    return l;
  }
  float std = sqrtf(2.f / (float)((double)in_c * kh * kw));
  ut_tensor* w = ut_randn(4, (int[]){out_c, in_c, kh, kw}, 0.f, std, dev);
  ut_tensor* b = (w && bias) ? ut_alloc(1, (int[]){out_c}, dev) : NULL;
  if (!w || (bias && !b)) {
    ut_free_all(w, b);
    return l;
  }
  l.weight = w;
  l.bias = b;
  return l;
}

static int ut__check_conv2d(const ut_conv2d* l, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__TRY(ut__check_kernel_args(l->kh, l->kw, l->stride, l->pad, who));
  UT__CHECK(l->in_c >= 1 && l->out_c >= 1, UT_ERR_ARG, "%s: invalid channel counts", who);
  return ut__check_params(l->weight, l->bias, ut__prod(l->out_c, l->in_c, l->kh, l->kw), l->out_c,
                          who);
}
/* What every convolution's backward checks: the cached input gives the geometry, grad_out has
   the forward output's shape, dW the weight's element count and db (when used) out_c. */
static int ut__check_conv_backward(ut__conv_geom* g, const ut_tensor* w, bool has_bias,
                                   const ut_tensor* input, int in_c, int out_c, int kh, int kw,
                                   int stride, int pad, const ut_tensor* grad_out,
                                   const ut_tensor* dW, const ut_tensor* db, const char* who) {
  UT__CHECK(input, UT_ERR_ARG, "%s: the cache is empty (run forward with a cache first)", who);
  UT__TRY(ut__check_arg(input, w, -1, who, "cache->input"));
  UT__TRY(ut__conv_geometry(g, input, in_c, kh, kw, stride, pad, who));
  UT__TRY(ut__check_arg(grad_out, w, -1, who, "grad_out"));
  UT__TRY(ut__check_arg(dW, w, w->shape.nelem, who, "dW"));
  if (db && has_bias) UT__TRY(ut__check_arg(db, w, out_c, who, "db"));
  const int* gs = grad_out->shape.shape;
  UT__CHECK(grad_out->shape.ndim == 4 && gs[0] == g->n && gs[1] == out_c && gs[2] == g->ho &&
                gs[3] == g->wo,
            UT_ERR_SHAPE, "%s: grad_out must be [%d, %d, %d, %d]", who, g->n, out_c, g->ho, g->wo);
  return UT_OK;
}

static bool ut__conv_is_pointwise(const ut__conv_geom* g) {
  return g->kh == 1 && g->kw == 1 && g->stride == 1 && g->pad == 0;
}

ut_tensor* ut_conv2d_forward(ut_conv2d* l, ut_tensor* x, ut_conv2d_cache* cache) {
  const char* who = "ut_conv2d_forward";
  ut__conv_geom g;
  if (ut__check_conv2d(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->in_c, l->kh, l->kw, l->stride, l->pad, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  int K = l->in_c * l->kh * l->kw, P = g.ho * g.wo;
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
  if (!wp || (l->bias && !bp)) return NULL;

  ut_tensor* col;
  if (ut__conv_is_pointwise(&g)) {
    col = ut_retain(x); /* a 1x1 window's columns are the input itself */
  } else {
    col = ut__new(3, (int[]){g.n, K, P}, x->dev, who);
    if (!col || !ut__finish(col, be, be->im2col(xp, ut__out(col, be), &g))) return NULL;
  }
  ut_tensor* out = ut__new(4, (int[]){g.n, l->out_c, g.ho, g.wo}, x->dev, who);
  if (!out) return ut__drop(col);
  float* op = ut__out(out, be);
  ut__gemm_args mm = {.m = l->out_c, .n = P, .k = K, .batch = g.n, .alpha = 1.f, .beta = 0.f,
                      .a = wp, .lda = K, .stride_a = 0,
                      .b = ut__in(col, be), .ldb = P, .stride_b = (ut__i64)K * P,
                      .c = op, .ldc = P, .stride_c = (ut__i64)l->out_c * P};
  int rc = be->gemm(&mm);
  if (rc >= 0 && bp) rc = be->bias_add(op, bp, g.n, l->out_c, P);
  if (rc < 0) {
    ut_free(col);
    return ut__drop(out);
  }
  ut__wrote(out, be);
  if (cache) {
    cache->input = ut_retain(x);
    cache->col = col;
  } else {
    ut_free(col);
  }
  return out;
}

ut_tensor* ut_conv2d_backward(ut_conv2d* l, ut_conv2d_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_conv2d_backward";
  ut__conv_geom g;
  if (ut__check_conv2d(l, who) < 0 ||
      ut__check_conv_backward(&g, l->weight, l->bias != NULL, cache ? cache->input : NULL,
                              l->in_c, l->out_c, l->kh, l->kw, l->stride, l->pad, grad_out, dW,
                              db, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(grad_out->dev);
  int K = l->in_c * l->kh * l->kw, P = g.ho * g.wo;
  bool pointwise = ut__conv_is_pointwise(&g);

  ut_tensor* col = cache->col;
  bool own_col = false;
  if (!col || col->shape.nelem != (long long)g.n * K * P || col->dev != grad_out->dev) {
    /* the cache lost its columns: rebuild them from the input */
    own_col = true;
    if (pointwise) {
      col = ut_retain(cache->input);
    } else {
      const float* xp = ut__in(cache->input, be);
      col = xp ? ut__new(3, (int[]){g.n, K, P}, grad_out->dev, who) : NULL;
      if (!col || !ut__finish(col, be, be->im2col(xp, ut__out(col, be), &g))) return NULL;
    }
  }
  ut_tensor *dx = NULL, *dcol = NULL;
  const float* gop = ut__in(grad_out, be);
  const float* colp = gop ? ut__in(col, be) : NULL;
  const float* wp = colp ? ut__in(l->weight, be) : NULL;
  float* dWp = wp ? ut__inout(dW, be) : NULL;
  float* dbp = (dWp && db && l->bias) ? ut__inout(db, be) : NULL;
  int rc = (!dWp || (db && l->bias && !dbp)) ? ut__err_status : UT_OK;
  if (rc >= 0) {
    dx = ut__new(4, cache->input->shape.shape, grad_out->dev, who);
    if (!pointwise && dx) dcol = ut__new(3, (int[]){g.n, K, P}, grad_out->dev, who);
    if (!dx || (!pointwise && !dcol)) rc = ut__err_status;
  }
  if (rc >= 0 && dbp) rc = be->channel_sum(gop, dbp, g.n, l->out_c, P, 1.f);
  if (rc >= 0) {
    /* dW += sum_n grad_out[n] [out_c, P] . col[n]^T [P, K] */
    ut__gemm_args mm = {.trans_b = true, .sum_batch = true, .m = l->out_c, .n = K, .k = P,
                        .batch = g.n, .alpha = 1.f, .beta = 1.f,
                        .a = gop, .lda = P, .stride_a = (ut__i64)l->out_c * P,
                        .b = colp, .ldb = P, .stride_b = (ut__i64)K * P,
                        .c = dWp, .ldc = K};
    rc = be->gemm(&mm);
  }
  if (rc >= 0) {
    /* dcol[n] = W^T [K, out_c] . grad_out[n] [out_c, P]; a 1x1 conv's dcol is dx itself */
    float* dst = pointwise ? ut__out(dx, be) : ut__out(dcol, be);
    ut__gemm_args mm = {.trans_a = true, .m = K, .n = P, .k = l->out_c, .batch = g.n,
                        .alpha = 1.f, .beta = 0.f,
                        .a = wp, .lda = K, .stride_a = 0,
                        .b = gop, .ldb = P, .stride_b = (ut__i64)l->out_c * P,
                        .c = dst, .ldc = P, .stride_c = (ut__i64)K * P};
    rc = be->gemm(&mm);
    if (rc >= 0 && !pointwise) rc = be->col2im(dst, ut__out(dx, be), &g);
  }
  if (own_col) ut_free(col);
  ut_free(dcol);
  if (rc < 0) return ut__drop(dx);
  ut__wrote(dW, be);
  if (dbp) ut__wrote(db, be);
  ut__wrote(dx, be);
  return dx;
}

void ut_conv2d_cache_free(ut_conv2d_cache* c) {
  if (!c) return;
  ut_free_all(c->input, c->col);
  c->input = c->col = NULL;
}
void ut_conv2d_free(ut_conv2d* l) {
  if (!l) return;
  ut_free_all(l->weight, l->bias);
  l->weight = l->bias = NULL;
}

/* ---- depthwise convolution ---------------------------------------------------------------- */
ut_dwconv2d ut_dwconv2d_alloc(int c, int kh, int kw, int stride, int pad, bool bias, ut_dev dev) {
  ut_dwconv2d l = {.c = c, .kh = kh, .kw = kw, .stride = stride, .pad = pad};
  if (ut__check_kernel_args(kh, kw, stride, pad, "ut_dwconv2d_alloc") < 0) return l;
  if (c < 1) {
    ut__set_error(UT_ERR_ARG, "ut_dwconv2d_alloc: channel count must be positive, got %d", c);
    return l;
  }
  float std = sqrtf(2.f / (float)(kh * kw));
  ut_tensor* w = ut_randn(3, (int[]){c, kh, kw}, 0.f, std, dev);
  ut_tensor* b = (w && bias) ? ut_alloc(1, (int[]){c}, dev) : NULL;
  if (!w || (bias && !b)) {
    ut_free_all(w, b);
    return l;
  }
  l.weight = w;
  l.bias = b;
  return l;
}

static int ut__check_dwconv2d(const ut_dwconv2d* l, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__TRY(ut__check_kernel_args(l->kh, l->kw, l->stride, l->pad, who));
  UT__CHECK(l->c >= 1, UT_ERR_ARG, "%s: invalid channel count %d", who, l->c);
  return ut__check_params(l->weight, l->bias, ut__prod(l->c, l->kh, l->kw, 1), l->c, who);
}

ut_tensor* ut_dwconv2d_forward(ut_dwconv2d* l, ut_tensor* x, ut_dwconv2d_cache* cache) {
  const char* who = "ut_dwconv2d_forward";
  ut__conv_geom g;
  if (ut__check_dwconv2d(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->c, l->kh, l->kw, l->stride, l->pad, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
  if (!wp || (l->bias && !bp)) return NULL;
  ut_tensor* out = ut__new(4, (int[]){g.n, g.c, g.ho, g.wo}, x->dev, who);
  if (!out) return NULL;
  out = ut__finish(out, be, be->dw_fwd(xp, wp, bp, ut__out(out, be), &g));
  if (out && cache) cache->input = ut_retain(x);
  return out;
}

ut_tensor* ut_dwconv2d_backward(ut_dwconv2d* l, ut_dwconv2d_cache* cache, ut_tensor* grad_out,
                                ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_dwconv2d_backward";
  ut__conv_geom g;
  if (ut__check_dwconv2d(l, who) < 0 ||
      ut__check_conv_backward(&g, l->weight, l->bias != NULL, cache ? cache->input : NULL, l->c,
                              l->c, l->kh, l->kw, l->stride, l->pad, grad_out, dW, db, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(grad_out->dev);
  const float* gop = ut__in(grad_out, be);
  const float* xp = gop ? ut__in(cache->input, be) : NULL;
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  float* dWp = wp ? ut__inout(dW, be) : NULL;
  float* dbp = (dWp && db && l->bias) ? ut__inout(db, be) : NULL;
  if (!dWp || (db && l->bias && !dbp)) return NULL;
  ut_tensor* dx = ut__new(4, cache->input->shape.shape, grad_out->dev, who);
  if (!dx) return NULL;
  int rc = be->dw_bwd_dw(gop, xp, dWp, &g);
  if (rc >= 0 && dbp) rc = be->channel_sum(gop, dbp, g.n, g.c, (ut__i64)g.ho * g.wo, 1.f);
  if (rc >= 0) rc = be->dw_bwd_dx(gop, wp, ut__out(dx, be), &g);
  if (rc < 0) return ut__drop(dx);
  ut__wrote(dW, be);
  if (dbp) ut__wrote(db, be);
  ut__wrote(dx, be);
  return dx;
}

void ut_dwconv2d_cache_free(ut_dwconv2d_cache* c) {
  if (!c) return;
  ut_free(c->input);
  c->input = NULL;
}
void ut_dwconv2d_free(ut_dwconv2d* l) {
  if (!l) return;
  ut_free_all(l->weight, l->bias);
  l->weight = l->bias = NULL;
}

/* ---- linear ------------------------------------------------------------------------------- */
ut_linear ut_linear_alloc(int in_f, int out_f, bool bias, ut_dev dev) {
  ut_linear l = {.in_f = in_f, .out_f = out_f};
  if (in_f < 1 || out_f < 1) {
    ut__set_error(UT_ERR_ARG, "ut_linear_alloc: feature counts must be positive, got %d -> %d",
                  in_f, out_f);
    return l;
  }
  /* PyTorch's default: U(-1/sqrt(in), 1/sqrt(in)) has std 1/sqrt(3 in) */
  ut_tensor* w = ut_randn(2, (int[]){out_f, in_f}, 0.f, 1.f / sqrtf(3.f * (float)in_f), dev);
  ut_tensor* b = (w && bias) ? ut_alloc(1, (int[]){out_f}, dev) : NULL;
  if (!w || (bias && !b)) {
    ut_free_all(w, b);
    return l;
  }
  l.weight = w;
  l.bias = b;
  return l;
}

static int ut__check_linear(const ut_linear* l, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__CHECK(l->in_f >= 1 && l->out_f >= 1, UT_ERR_ARG, "%s: invalid feature counts", who);
  return ut__check_params(l->weight, l->bias, ut__prod(l->in_f, l->out_f, 1, 1), l->out_f, who);
}
static int ut__check_rows(const ut_tensor* x, int cols, const char* who, const char* name) {
  UT__TRY(ut__check_ndim(x, 2, who, name));
  UT__CHECK(x->shape.shape[1] == cols, UT_ERR_SHAPE, "%s: %s must be [N, %d], got [%d, %d]", who,
            name, cols, x->shape.shape[0], x->shape.shape[1]);
  return UT_OK;
}

ut_tensor* ut_linear_forward(ut_linear* l, ut_tensor* x, ut_linear_cache* cache) {
  const char* who = "ut_linear_forward";
  if (ut__check_linear(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__check_rows(x, l->in_f, who, "x") < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  int N = x->shape.shape[0];
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
  if (!wp || (l->bias && !bp)) return NULL;
  ut_tensor* y = ut__new(2, (int[]){N, l->out_f}, x->dev, who);
  if (!y) return NULL;
  float* yp = ut__out(y, be);
  ut__gemm_args mm = {.trans_b = true, .m = N, .n = l->out_f, .k = l->in_f, .batch = 1,
                      .alpha = 1.f, .beta = 0.f, .a = xp, .lda = l->in_f, .b = wp,
                      .ldb = l->in_f, .c = yp, .ldc = l->out_f};
  int rc = be->gemm(&mm);
  if (rc >= 0 && bp) rc = be->bias_add(yp, bp, N, l->out_f, 1);
  y = ut__finish(y, be, rc);
  if (y && cache) cache->input = ut_retain(x);
  return y;
}

ut_tensor* ut_linear_backward(ut_linear* l, ut_linear_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_linear_backward";
  if (ut__check_linear(l, who) < 0) return NULL;
  UT__CHECK_NULL(cache && cache->input, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  ut_tensor* x = cache->input;
  if (ut__check_arg(x, l->weight, -1, who, "cache->input") < 0 ||
      ut__check_rows(x, l->in_f, who, "cache->input") < 0 ||
      ut__check_arg(grad_out, l->weight, -1, who, "grad_out") < 0 ||
      ut__check_rows(grad_out, l->out_f, who, "grad_out") < 0 ||
      ut__check_arg(dW, l->weight, l->weight->shape.nelem, who, "dW") < 0 ||
      (db && l->bias && ut__check_arg(db, l->weight, l->out_f, who, "db") < 0))
    return NULL;
  int N = x->shape.shape[0];
  UT__CHECK_NULL(grad_out->shape.shape[0] == N, UT_ERR_SHAPE,
                 "%s: grad_out has %d rows, the input had %d", who, grad_out->shape.shape[0], N);
  const ut__backend* be = ut__backend_for(grad_out->dev);
  const float* gop = ut__in(grad_out, be);
  const float* xp = gop ? ut__in(x, be) : NULL;
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  float* dWp = wp ? ut__inout(dW, be) : NULL;
  float* dbp = (dWp && db && l->bias) ? ut__inout(db, be) : NULL;
  if (!dWp || (db && l->bias && !dbp)) return NULL;
  ut_tensor* dx = ut__new(2, (int[]){N, l->in_f}, grad_out->dev, who);
  if (!dx) return NULL;
  /* dW += grad_out^T [out, N] . x [N, in];  dx = grad_out [N, out] . W [out, in] */
  ut__gemm_args dw = {.trans_a = true, .m = l->out_f, .n = l->in_f, .k = N, .batch = 1,
                      .alpha = 1.f, .beta = 1.f, .a = gop, .lda = l->out_f, .b = xp,
                      .ldb = l->in_f, .c = dWp, .ldc = l->in_f};
  ut__gemm_args dxa = {.m = N, .n = l->in_f, .k = l->out_f, .batch = 1, .alpha = 1.f,
                       .beta = 0.f, .a = gop, .lda = l->out_f, .b = wp, .ldb = l->in_f,
                       .c = ut__out(dx, be), .ldc = l->in_f};
  int rc = be->gemm(&dw);
  if (rc >= 0 && dbp) rc = be->channel_sum(gop, dbp, N, l->out_f, 1, 1.f);
  if (rc >= 0) rc = be->gemm(&dxa);
  if (rc < 0) return ut__drop(dx);
  ut__wrote(dW, be);
  if (dbp) ut__wrote(db, be);
  ut__wrote(dx, be);
  return dx;
}

void ut_linear_cache_free(ut_linear_cache* c) {
  if (!c) return;
  ut_free(c->input);
  c->input = NULL;
}
void ut_linear_free(ut_linear* l) {
  if (!l) return;
  ut_free_all(l->weight, l->bias);
  l->weight = l->bias = NULL;
}

/* ---- layer norm --------------------------------------------------------------------------- */
static int ut__check_eps(float eps, const char* who) {
  UT__CHECK(isfinite(eps) && eps > 0.f, UT_ERR_ARG, "%s: eps must be finite and > 0", who);
  return UT_OK;
}

ut_layernorm ut_layernorm_alloc(int dim, float eps, ut_dev dev) {
  ut_layernorm l = {.dim = dim, .eps = eps};
  if (dim < 1) {
    ut__set_error(UT_ERR_ARG, "ut_layernorm_alloc: dim must be positive, got %d", dim);
    return l;
  }
  if (ut__check_eps(eps, "ut_layernorm_alloc") < 0) return l;
  ut_tensor* w = ut_alloc(1, (int[]){dim}, dev);
  ut_tensor* b = w ? ut_alloc(1, (int[]){dim}, dev) : NULL;
  if (!w || !b || ut_fill(w, 1.f) < 0) {
    ut_free_all(w, b);
    return l;
  }
  l.weight = w;
  l.bias = b;
  return l;
}

static int ut__check_layernorm(const ut_layernorm* l, const ut_tensor* x, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__CHECK(l->dim >= 1, UT_ERR_ARG, "%s: invalid dim %d", who, l->dim);
  UT__TRY(ut__check_eps(l->eps, who));
  UT__CHECK(l->bias, UT_ERR_ARG, "%s: the layer's bias is NULL", who);
  UT__TRY(ut__check_params(l->weight, l->bias, l->dim, l->dim, who));
  UT__TRY(ut__check_arg(x, l->weight, -1, who, "x"));
  UT__CHECK(x->shape.shape[x->shape.ndim - 1] == l->dim, UT_ERR_SHAPE,
            "%s: the last dimension of x is %d, the layer normalizes %d", who,
            x->shape.shape[x->shape.ndim - 1], l->dim);
  return UT_OK;
}

ut_tensor* ut_layernorm_forward(ut_layernorm* l, ut_tensor* x, ut_layernorm_cache* cache) {
  const char* who = "ut_layernorm_forward";
  if (ut__check_layernorm(l, x, who) < 0) return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  int rows = x->shape.nelem / l->dim;
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = wp ? ut__in(l->bias, be) : NULL;
  if (!bp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  ut_tensor* mean = y ? ut__new(1, (int[]){rows}, x->dev, who) : NULL;
  ut_tensor* rstd = mean ? ut__new(1, (int[]){rows}, x->dev, who) : NULL;
  int rc = rstd ? be->layernorm_fwd(xp, wp, bp, ut__out(y, be), ut__out(mean, be),
                                    ut__out(rstd, be), rows, l->dim, l->eps)
                : ut__err_status;
  if (rc < 0 || !cache) {
    ut_free_all(mean, rstd);
    if (rc < 0) return ut__drop(y);
    ut__wrote(y, be);
    return y;
  }
  ut__wrote(y, be);
  ut__wrote(mean, be);
  ut__wrote(rstd, be);
  cache->input = ut_retain(x);
  cache->mean = mean;
  cache->rstd = rstd;
  return y;
}

ut_tensor* ut_layernorm_backward(ut_layernorm* l, ut_layernorm_cache* cache, ut_tensor* grad_out,
                                 ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_layernorm_backward";
  UT__CHECK_NULL(cache && cache->input && cache->mean && cache->rstd, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  ut_tensor* x = cache->input;
  if (ut__check_layernorm(l, x, who) < 0 ||
      ut__check_arg(grad_out, x, x->shape.nelem, who, "grad_out") < 0)
    return NULL;
  int rows = x->shape.nelem / l->dim;
  if (ut__check_arg(cache->mean, x, rows, who, "cache->mean") < 0 ||
      ut__check_arg(cache->rstd, x, rows, who, "cache->rstd") < 0 ||
      (dW && ut__check_arg(dW, x, l->dim, who, "dW") < 0) ||
      (db && ut__check_arg(db, x, l->dim, who, "db") < 0))
    return NULL;
  UT__CHECK_NULL(ut__same_shape(grad_out, x), UT_ERR_SHAPE,
                 "%s: grad_out must have the input's shape", who);
  const ut__backend* be = ut__backend_for(x->dev);
  const float* gop = ut__in(grad_out, be);
  const float* xp = gop ? ut__in(x, be) : NULL;
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* mp = wp ? ut__in(cache->mean, be) : NULL;
  const float* rp = mp ? ut__in(cache->rstd, be) : NULL;
  float* dWp = (rp && dW) ? ut__inout(dW, be) : NULL;
  float* dbp = (rp && db) ? ut__inout(db, be) : NULL;
  if (!rp || (dW && !dWp) || (db && !dbp)) return NULL;
  ut_tensor* dx = ut__new_like(x, who);
  if (!dx) return NULL;
  int rc = be->layernorm_bwd(gop, xp, wp, mp, rp, ut__out(dx, be), dWp, dbp, rows, l->dim);
  if (rc < 0) return ut__drop(dx);
  if (dWp) ut__wrote(dW, be);
  if (dbp) ut__wrote(db, be);
  ut__wrote(dx, be);
  return dx;
}

void ut_layernorm_cache_free(ut_layernorm_cache* c) {
  if (!c) return;
  ut_free_all(c->input, c->mean, c->rstd);
  c->input = c->mean = c->rstd = NULL;
}
void ut_layernorm_free(ut_layernorm* l) {
  if (!l) return;
  ut_free_all(l->weight, l->bias);
  l->weight = l->bias = NULL;
}

/* ---- batch norm --------------------------------------------------------------------------- */
ut_batchnorm2d ut_batchnorm2d_alloc(int c, float eps, float momentum, ut_dev dev) {
  ut_batchnorm2d l = {.c = c, .eps = eps, .momentum = momentum, .training = true};
  if (c < 1) {
    ut__set_error(UT_ERR_ARG, "ut_batchnorm2d_alloc: channel count must be positive, got %d", c);
    return l;
  }
  if (ut__check_eps(eps, "ut_batchnorm2d_alloc") < 0) return l;
  if (!(momentum >= 0.f && momentum <= 1.f)) {
    ut__set_error(UT_ERR_ARG, "ut_batchnorm2d_alloc: momentum must be in [0, 1]");
    return l;
  }
  ut_tensor* t[4] = {0};
  for (int i = 0; i < 4; i++) {
    t[i] = ut_alloc(1, (int[]){c}, dev);
    if (!t[i]) {
      ut_free_n(t, 4);
      return l;
    }
  }
  if (ut_fill(t[0], 1.f) < 0 || ut_fill(t[3], 1.f) < 0) {
    ut_free_n(t, 4);
    return l;
  }
  l.weight = t[0];
  l.bias = t[1];
  l.running_mean = t[2];
  l.running_var = t[3];
  return l;
}

static int ut__check_batchnorm2d(const ut_batchnorm2d* l, const ut_tensor* x, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__CHECK(l->c >= 1, UT_ERR_ARG, "%s: invalid channel count %d", who, l->c);
  UT__TRY(ut__check_eps(l->eps, who));
  UT__CHECK(l->momentum >= 0.f && l->momentum <= 1.f, UT_ERR_ARG,
            "%s: momentum must be in [0, 1]", who);
  UT__CHECK(l->bias && l->running_mean && l->running_var, UT_ERR_ARG,
            "%s: the layer's tensors are not allocated", who);
  UT__TRY(ut__check_params(l->weight, l->bias, l->c, l->c, who));
  UT__TRY(ut__check_arg(l->running_mean, l->weight, l->c, who, "running_mean"));
  UT__TRY(ut__check_arg(l->running_var, l->weight, l->c, who, "running_var"));
  UT__TRY(ut__check_arg(x, l->weight, -1, who, "x"));
  UT__TRY(ut__check_ndim(x, 4, who, "x"));
  UT__CHECK(x->shape.shape[1] == l->c, UT_ERR_SHAPE, "%s: x has %d channels, the layer %d", who,
            x->shape.shape[1], l->c);
  return UT_OK;
}

ut_tensor* ut_batchnorm2d_forward(ut_batchnorm2d* l, ut_tensor* x, ut_batchnorm2d_cache* cache) {
  const char* who = "ut_batchnorm2d_forward";
  if (ut__check_batchnorm2d(l, x, who) < 0) return NULL;
  int N = x->shape.shape[0], C = l->c;
  ut__i64 inner = (ut__i64)x->shape.shape[2] * x->shape.shape[3], count = N * inner;
  UT__CHECK_NULL(!l->training || count > 1, UT_ERR_SHAPE,
                 "%s: training needs more than one value per channel (N*H*W = 1)", who);
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = wp ? ut__in(l->bias, be) : NULL;
  if (!bp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  ut_tensor* mean = y ? ut__new(1, (int[]){C}, x->dev, who) : NULL;
  ut_tensor* var = mean ? ut__new(1, (int[]){C}, x->dev, who) : NULL;
  ut_tensor* rstd = var ? ut__new(1, (int[]){C}, x->dev, who) : NULL;
  int rc = rstd ? UT_OK : ut__err_status;
  if (rc >= 0 && l->training) {
    float* rm = ut__inout(l->running_mean, be);
    float* rv = rm ? ut__inout(l->running_var, be) : NULL;
    rc = rv ? be->bn_stats(xp, ut__out(mean, be), ut__out(var, be), N, C, inner) : ut__err_status;
    if (rc >= 0)
      rc = be->bn_update_running(rm, rv, ut__out(mean, be), ut__out(var, be), C, l->momentum,
                                 (float)((double)count / (double)(count - 1)));
    if (rc >= 0) {
      ut__wrote(l->running_mean, be);
      ut__wrote(l->running_var, be);
    }
  } else if (rc >= 0) {
    const float* rm = ut__in(l->running_mean, be);
    const float* rv = rm ? ut__in(l->running_var, be) : NULL;
    rc = rv ? be->copy(ut__out(mean, be), rm, C) : ut__err_status;
    if (rc >= 0) rc = be->copy(ut__out(var, be), rv, C);
  }
  if (rc >= 0)
    rc = be->bn_apply(xp, ut__out(y, be), ut__out(mean, be), ut__out(var, be), wp, bp,
                      ut__out(rstd, be), N, C, inner, l->eps);
  ut_free(var);
  if (rc < 0 || !cache) {
    ut_free_all(mean, rstd);
    if (rc < 0) return ut__drop(y);
    ut__wrote(y, be);
    return y;
  }
  ut__wrote(y, be);
  ut__wrote(mean, be);
  ut__wrote(rstd, be);
  cache->input = ut_retain(x);
  cache->mean = mean;
  cache->rstd = rstd;
  cache->training = l->training;
  return y;
}

ut_tensor* ut_batchnorm2d_backward(ut_batchnorm2d* l, ut_batchnorm2d_cache* cache,
                                   ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_batchnorm2d_backward";
  UT__CHECK_NULL(cache && cache->input && cache->mean && cache->rstd, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  ut_tensor* x = cache->input;
  if (ut__check_batchnorm2d(l, x, who) < 0 ||
      ut__check_arg(grad_out, x, x->shape.nelem, who, "grad_out") < 0 ||
      ut__check_arg(cache->mean, x, l->c, who, "cache->mean") < 0 ||
      ut__check_arg(cache->rstd, x, l->c, who, "cache->rstd") < 0 ||
      (dW && ut__check_arg(dW, x, l->c, who, "dW") < 0) ||
      (db && ut__check_arg(db, x, l->c, who, "db") < 0))
    return NULL;
  UT__CHECK_NULL(ut__same_shape(grad_out, x), UT_ERR_SHAPE,
                 "%s: grad_out must have the input's shape", who);
  int N = x->shape.shape[0], C = l->c;
  ut__i64 inner = (ut__i64)x->shape.shape[2] * x->shape.shape[3];
  const ut__backend* be = ut__backend_for(x->dev);
  const float* gop = ut__in(grad_out, be);
  const float* xp = gop ? ut__in(x, be) : NULL;
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* mp = wp ? ut__in(cache->mean, be) : NULL;
  const float* rp = mp ? ut__in(cache->rstd, be) : NULL;
  float* dWp = (rp && dW) ? ut__inout(dW, be) : NULL;
  float* dbp = (rp && db) ? ut__inout(db, be) : NULL;
  if (!rp || (dW && !dWp) || (db && !dbp)) return NULL;
  ut_tensor* dx = ut__new_like(x, who);
  if (!dx) return NULL;
  int rc = be->bn_bwd(gop, xp, mp, rp, wp, ut__out(dx, be), dWp, dbp, N, C, inner,
                      cache->training);
  if (rc < 0) return ut__drop(dx);
  if (dWp) ut__wrote(dW, be);
  if (dbp) ut__wrote(db, be);
  ut__wrote(dx, be);
  return dx;
}

void ut_batchnorm2d_cache_free(ut_batchnorm2d_cache* c) {
  if (!c) return;
  ut_free_all(c->input, c->mean, c->rstd);
  c->input = c->mean = c->rstd = NULL;
}
void ut_batchnorm2d_free(ut_batchnorm2d* l) {
  if (!l) return;
  ut_free_all(l->weight, l->bias, l->running_mean, l->running_var);
  l->weight = l->bias = l->running_mean = l->running_var = NULL;
}

/* ---- pooling ------------------------------------------------------------------------------ */
ut_tensor* ut_global_avgpool2d_forward(ut_tensor* x) {
  const char* who = "ut_global_avgpool2d_forward";
  if (ut__check_tensor(x, who, "x") < 0 || ut__check_ndim(x, 4, who, "x") < 0) return NULL;
  int N = x->shape.shape[0], C = x->shape.shape[1];
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  if (!xp) return NULL;
  ut_tensor* y = ut__new(2, (int[]){N, C}, x->dev, who);
  if (!y) return NULL;
  return ut__finish(y, be, be->row_mean(xp, ut__out(y, be), N * C,
                                        (ut__i64)x->shape.shape[2] * x->shape.shape[3]));
}

ut_tensor* ut_global_avgpool2d_backward(ut_tensor* grad_out, int h, int w) {
  const char* who = "ut_global_avgpool2d_backward";
  if (ut__check_tensor(grad_out, who, "grad_out") < 0 ||
      ut__check_ndim(grad_out, 2, who, "grad_out") < 0)
    return NULL;
  UT__CHECK_NULL(h >= 1 && w >= 1, UT_ERR_SHAPE, "%s: h and w must be positive, got %d x %d", who,
                 h, w);
  int N = grad_out->shape.shape[0], C = grad_out->shape.shape[1];
  const ut__backend* be = ut__backend_for(grad_out->dev);
  const float* gp = ut__in(grad_out, be);
  if (!gp) return NULL;
  ut_tensor* dx = ut__new(4, (int[]){N, C, h, w}, grad_out->dev, who);
  if (!dx) return NULL;
  return ut__finish(dx, be, be->row_mean_bwd(gp, ut__out(dx, be), N * C, (ut__i64)h * w));
}

/* ---- losses ------------------------------------------------------------------------------- */
static int ut__check_pair(ut_tensor* pred, ut_tensor* target, const char* who) {
  UT__TRY(ut__check_tensor(pred, who, "pred"));
  UT__TRY(ut__check_arg(target, pred, -1, who, "target"));
  UT__CHECK(ut__same_shape(pred, target), UT_ERR_SHAPE,
            "%s: pred and target must have the same shape", who);
  return UT_OK;
}

ut_tensor* ut_mse_loss(ut_tensor* pred, ut_tensor* target) {
  const char* who = "ut_mse_loss";
  if (ut__check_pair(pred, target, who) < 0) return NULL;
  const ut__backend* be = ut__backend_for(pred->dev);
  const float* p = ut__in(pred, be);
  const float* t = p ? ut__in(target, be) : NULL;
  if (!t) return NULL;
  ut_tensor* out = ut__new(1, (int[]){1}, pred->dev, who);
  if (!out) return NULL;
  return ut__finish(out, be, be->mse_fwd(p, t, ut__out(out, be), pred->shape.nelem));
}

ut_tensor* ut_mse_loss_backward(ut_tensor* pred, ut_tensor* target) {
  const char* who = "ut_mse_loss_backward";
  if (ut__check_pair(pred, target, who) < 0) return NULL;
  const ut__backend* be = ut__backend_for(pred->dev);
  const float* p = ut__in(pred, be);
  const float* t = p ? ut__in(target, be) : NULL;
  if (!t) return NULL;
  ut_tensor* g = ut__new_like(pred, who);
  if (!g) return NULL;
  return ut__finish(g, be, be->mse_bwd(p, t, ut__out(g, be), pred->shape.nelem));
}

static int ut__check_ce(ut_tensor* logits, ut_tensor* labels, const char* who) {
  UT__TRY(ut__check_tensor(logits, who, "logits"));
  UT__TRY(ut__check_ndim(logits, 2, who, "logits"));
  int N = logits->shape.shape[0], K = logits->shape.shape[1];
  UT__TRY(ut__check_arg(labels, logits, N, who, "labels"));
  if (!labels->dirty_cpu) { /* the host copy is current: check the labels without a transfer */
    for (int i = 0; i < N; i++) {
      float v = labels->data[i];
      UT__CHECK(v >= 0.f && v < (float)K && v == floorf(v), UT_ERR_ARG,
                "%s: labels[%d] = %g is not a class index in [0, %d)", who, i, (double)v, K);
    }
  }
  return UT_OK;
}

ut_tensor* ut_cross_entropy_loss(ut_tensor* logits, ut_tensor* labels) {
  const char* who = "ut_cross_entropy_loss";
  if (ut__check_ce(logits, labels, who) < 0) return NULL;
  const ut__backend* be = ut__backend_for(logits->dev);
  const float* lp = ut__in(logits, be);
  const float* yp = lp ? ut__in(labels, be) : NULL;
  if (!yp) return NULL;
  ut_tensor* out = ut__new(1, (int[]){1}, logits->dev, who);
  if (!out) return NULL;
  return ut__finish(out, be, be->ce_fwd(lp, yp, ut__out(out, be), logits->shape.shape[0],
                                        logits->shape.shape[1]));
}

ut_tensor* ut_cross_entropy_backward(ut_tensor* logits, ut_tensor* labels) {
  const char* who = "ut_cross_entropy_backward";
  if (ut__check_ce(logits, labels, who) < 0) return NULL;
  const ut__backend* be = ut__backend_for(logits->dev);
  const float* lp = ut__in(logits, be);
  const float* yp = lp ? ut__in(labels, be) : NULL;
  if (!yp) return NULL;
  ut_tensor* g = ut__new_like(logits, who);
  if (!g) return NULL;
  return ut__finish(g, be, be->ce_bwd(lp, yp, ut__out(g, be), logits->shape.shape[0],
                                      logits->shape.shape[1]));
}

/* ---- optimizers --------------------------------------------------------------------------- */
int ut_sgd_step(ut_tensor* param, ut_tensor* grad, ut_tensor* velocity, float lr, float momentum) {
  const char* who = "ut_sgd_step";
  UT__TRY(ut__check_tensor(param, who, "param"));
  UT__TRY(ut__check_arg(grad, param, param->shape.nelem, who, "grad"));
  if (velocity) UT__TRY(ut__check_arg(velocity, param, param->shape.nelem, who, "velocity"));
  UT__CHECK(isfinite(lr) && lr >= 0.f, UT_ERR_ARG, "%s: lr must be finite and >= 0", who);
  UT__CHECK(isfinite(momentum) && momentum >= 0.f, UT_ERR_ARG,
            "%s: momentum must be finite and >= 0", who);
  const ut__backend* be = ut__backend_for(param->dev);
  const float* g = ut__in(grad, be);
  float* p = g ? ut__inout(param, be) : NULL;
  float* v = (p && velocity) ? ut__inout(velocity, be) : NULL;
  if (!p || (velocity && !v)) return ut__err_status;
  UT__TRY(be->sgd(p, g, v, param->shape.nelem, lr, momentum));
  ut__wrote(param, be);
  if (v) ut__wrote(velocity, be);
  return UT_OK;
}

int ut_adam_step(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step, float lr,
                 float beta1, float beta2, float eps) {
  const char* who = "ut_adam_step";
  UT__TRY(ut__check_tensor(param, who, "param"));
  int n = param->shape.nelem;
  UT__TRY(ut__check_arg(grad, param, n, who, "grad"));
  UT__TRY(ut__check_arg(m, param, n, who, "m"));
  UT__TRY(ut__check_arg(v, param, n, who, "v"));
  UT__CHECK(step >= 1, UT_ERR_ARG, "%s: step must be >= 1 (1-based), got %d", who, step);
  UT__CHECK(isfinite(lr) && lr >= 0.f, UT_ERR_ARG, "%s: lr must be finite and >= 0", who);
  UT__CHECK(beta1 >= 0.f && beta1 < 1.f && beta2 >= 0.f && beta2 < 1.f, UT_ERR_ARG,
            "%s: betas must be in [0, 1)", who);
  UT__CHECK(isfinite(eps) && eps >= 0.f, UT_ERR_ARG, "%s: eps must be finite and >= 0", who);
  const ut__backend* be = ut__backend_for(param->dev);
  const float* g = ut__in(grad, be);
  float* p = g ? ut__inout(param, be) : NULL;
  float* mp = p ? ut__inout(m, be) : NULL;
  float* vp = mp ? ut__inout(v, be) : NULL;
  if (!vp) return ut__err_status;
  float bc1 = (float)(1.0 - pow((double)beta1, step)), bc2 = (float)(1.0 - pow((double)beta2, step));
  UT__TRY(be->adam(p, g, mp, vp, n, lr, beta1, beta2, eps, bc1, bc2));
  ut__wrote(param, be);
  ut__wrote(m, be);
  ut__wrote(v, be);
  return UT_OK;
}

/* ---- struct layout, for the bindings' checks ---------------------------------------------- */
typedef struct ut__layout_entry {
  const char* type;
  const char* field; /* NULL: the type's size */
  size_t value;
} ut__layout_entry;

#define UT__SIZE(T) {#T, NULL, sizeof(T)}
#define UT__FIELD(T, f) {#T, #f, offsetof(T, f)}
static const ut__layout_entry ut__layout[] = {
    UT__SIZE(ut_shape), UT__FIELD(ut_shape, ndim), UT__FIELD(ut_shape, shape),
    UT__FIELD(ut_shape, nelem),
    UT__SIZE(ut_tensor), UT__FIELD(ut_tensor, shape), UT__FIELD(ut_tensor, data),
    UT__FIELD(ut_tensor, dev), UT__FIELD(ut_tensor, gpu_buf), UT__FIELD(ut_tensor, dirty_cpu),
    UT__FIELD(ut_tensor, dirty_gpu), UT__FIELD(ut_tensor, rc), UT__FIELD(ut_tensor, borrowed),
    UT__FIELD(ut_tensor, release), UT__FIELD(ut_tensor, release_ctx),
    UT__SIZE(ut_conv2d), UT__FIELD(ut_conv2d, weight), UT__FIELD(ut_conv2d, bias),
    UT__FIELD(ut_conv2d, in_c), UT__FIELD(ut_conv2d, out_c), UT__FIELD(ut_conv2d, kh),
    UT__FIELD(ut_conv2d, kw), UT__FIELD(ut_conv2d, stride), UT__FIELD(ut_conv2d, pad),
    UT__SIZE(ut_conv2d_cache), UT__FIELD(ut_conv2d_cache, input), UT__FIELD(ut_conv2d_cache, col),
    UT__SIZE(ut_dwconv2d), UT__FIELD(ut_dwconv2d, weight), UT__FIELD(ut_dwconv2d, bias),
    UT__FIELD(ut_dwconv2d, c), UT__FIELD(ut_dwconv2d, kh), UT__FIELD(ut_dwconv2d, kw),
    UT__FIELD(ut_dwconv2d, stride), UT__FIELD(ut_dwconv2d, pad),
    UT__SIZE(ut_dwconv2d_cache), UT__FIELD(ut_dwconv2d_cache, input),
    UT__SIZE(ut_linear), UT__FIELD(ut_linear, weight), UT__FIELD(ut_linear, bias),
    UT__FIELD(ut_linear, in_f), UT__FIELD(ut_linear, out_f),
    UT__SIZE(ut_linear_cache), UT__FIELD(ut_linear_cache, input),
    UT__SIZE(ut_layernorm), UT__FIELD(ut_layernorm, weight), UT__FIELD(ut_layernorm, bias),
    UT__FIELD(ut_layernorm, dim), UT__FIELD(ut_layernorm, eps),
    UT__SIZE(ut_layernorm_cache), UT__FIELD(ut_layernorm_cache, input),
    UT__FIELD(ut_layernorm_cache, mean), UT__FIELD(ut_layernorm_cache, rstd),
    UT__SIZE(ut_batchnorm2d), UT__FIELD(ut_batchnorm2d, weight), UT__FIELD(ut_batchnorm2d, bias),
    UT__FIELD(ut_batchnorm2d, running_mean), UT__FIELD(ut_batchnorm2d, running_var),
    UT__FIELD(ut_batchnorm2d, c), UT__FIELD(ut_batchnorm2d, eps),
    UT__FIELD(ut_batchnorm2d, momentum), UT__FIELD(ut_batchnorm2d, training),
    UT__SIZE(ut_batchnorm2d_cache), UT__FIELD(ut_batchnorm2d_cache, input),
    UT__FIELD(ut_batchnorm2d_cache, mean), UT__FIELD(ut_batchnorm2d_cache, rstd),
    UT__FIELD(ut_batchnorm2d_cache, training),
    UT__SIZE(ut_dev), UT__SIZE(ut_status),
};

static long long ut__layout_find(const char* type, const char* field) {
  if (!type) return -1;
  for (size_t i = 0; i < sizeof ut__layout / sizeof ut__layout[0]; i++) {
    const ut__layout_entry* e = &ut__layout[i];
    if (strcmp(e->type, type) != 0) continue;
    if ((field == NULL) != (e->field == NULL)) continue;
    if (field && strcmp(e->field, field) != 0) continue;
    return (long long)e->value;
  }
  return -1;
}
long long ut_type_size(const char* type_name) { return ut__layout_find(type_name, NULL); }
long long ut_field_offset(const char* type_name, const char* field_name) {
  if (!field_name) return -1;
  return ut__layout_find(type_name, field_name);
}

#endif /* UTENSIL_IMPLEMENTATION_DONE */
#endif /* UT_IMPLEMENTATION */
