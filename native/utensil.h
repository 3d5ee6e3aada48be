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
     Independent tensors may be used from several threads at once. The error message is
     thread-local; the RNG and the CUDA context are shared and locked. The CPU backend runs each
     op on ut_get_num_threads() threads (default: the cores present).
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
int ut_cuda_mem_info(size_t* free_bytes, size_t* total_bytes); /* status; error without GPU */
/* Layout of public structs as the C compiler sees them (for binding checks); -1 if unknown. */
long long ut_type_size(const char* type_name);
long long ut_field_offset(const char* type_name, const char* field_name);

/* ---- tensors ------------------------------------------------------------------------------ */
ut_shape ut_shape_new(int ndim, const int* shape); /* nelem = 0 if invalid (see ut_last_error) */
ut_tensor* ut_alloc(int ndim, const int* shape, ut_dev dev);   /* zero-filled */
ut_tensor* ut_from_data(int ndim, const int* shape, const float* data, ut_dev dev); /* copies */
ut_tensor* ut_randn(int ndim, const int* shape, float mean, float std, ut_dev dev);
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
   forward(l, x, cache_or_NULL): with a cache the inputs backward needs are retained in it.
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
