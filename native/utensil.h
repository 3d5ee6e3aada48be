/* utensil.h — a small, fast neural-network library in one C11 header.

   USAGE
     In exactly one C file:
         #define UT_IMPLEMENTATION
         #include "utensil.h"
     Everywhere else just #include "utensil.h".
     `cc -std=c11 app.c -lm -lpthread` builds a program that runs on the CPU. Linking in the
     CUDA backend's objects (the .cu files of native/cuda/ compiled by nvcc, linked with
     `nvcc -cudart static`) adds the GPU, with no define. That is on GCC and Clang; with other
     compilers define UT_NO_CUDA for a CPU-only build.
     Build options (define before the implementation include):
         UT_NO_CUDA   build without the CUDA backend (UT_CUDA tensors then run on the CPU)

   TENSORS
     A ut_tensor is a reference-counted, row-major float32 array of up to UT_MAX_DIMS dimensions
     (or bfloat16 on the GPU, for mixed-precision activations: see ut_dtype; `data` is float32
     for every tensor). `data` is a host copy that is always allocated. A tensor tagged UT_CUDA also has a device
     copy in `gpu_buf` when a GPU is present; the two copies form a lazy mirror:
         dirty_cpu  the host copy is stale (the GPU wrote last)   -> ut_sync_cpu() downloads
         dirty_gpu  the device copy is stale (the host wrote last) -> ut_sync_gpu() uploads
     After ut_alloc/ut_from_data/ut_randn and after ut_sync_cpu the host copy is the owner: writes
     through `data` are seen by later ops (the next GPU op uploads them). ut_sync_cpu_readonly()
     downloads without handing ownership to the host, for reading only.
     A UT_CUDA tensor whose device memory others see (`shared`: made by ut_wrap, or exported
     through DLPack by the bindings) can be written there without the mirror knowing, so its
     host copy is only a snapshot: every host read downloads again, and after writing through
     `data` the caller pushes the values with ut_sync_gpu() before anyone else reads them.
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
     threads (default: the cores the process may run on), from the library's own thread pool:
     one op at a time uses the pool, an op started meanwhile by another thread runs on that
     thread alone (same result). fork() is safe: the child starts new workers at its first
     parallel op. Build the library with -Wl,-z,nodelete (build.sh does): its workers may be
     parked in its code when the process exits.

   CONTENTS (in this order; each section starts with a banner comment)
     PUBLIC API          types, errors, devices, tensors, every op with its shape comment
                         (elementwise, convolutions, norms, pooling, losses, optimizers),
                         then the GPU's extras (cuBLAS, CUDA graphs, NCCL);
                         UT_CDEF_BEGIN..END is also read by the Python bindings
     BACKEND INTERFACE   the table of functions a backend provides (read by native/cuda/ too)
     IMPLEMENTATION      errors and library state, backend selection, tensors and the
                         host/device mirror, the op entry points (validate, allocate, call the
                         backend), struct layout for the bindings
     CPU BACKEND         its thread pool, its kernels, its table
     ISA VARIANTS        the kernels compiled per instruction set, picked at run time
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
#define UT_VERSION 10
#define UT_MAX_DIMS 8

typedef enum ut_dev { UT_CPU = 0, UT_CUDA = 1 } ut_dev;

typedef enum ut_status {
  UT_OK = 0,
  UT_ERR_ARG = -1,     /* a NULL or out-of-range argument, a closed/invalid object */
  UT_ERR_SHAPE = -2,   /* mismatched or invalid shapes */
  UT_ERR_MEMORY = -3,  /* host or device allocation failed */
  UT_ERR_DEVICE = -4   /* the GPU or its runtime reported an error */
} ut_status;

/* Element types. UT_F32 (float32) is the default. UT_BF16 (bfloat16: float32's sign and
   exponent, 8 significant bits) is for the activations of mixed-precision training: a UT_BF16
   tensor keeps 2 bytes per value on the GPU, and its host copy `data` stays float32, holding
   values bf16 represents exactly (the library rounds what it writes to the nearest even bf16;
   values written through `data` are rounded when they are uploaded). So `data` is float* for
   every tensor. Ops compute in float32 and round their bf16 outputs: on the GPU in native bf16
   kernels (half the memory traffic, tensor cores for GEMMs), on the CPU on the float host copy
   (an emulation: the same numbers, no faster than float32). Which arguments may be bf16 is said
   per op below ("bf16: ..."); an op given a bf16 tensor elsewhere fails with UT_ERR_ARG.
   Parameters, their gradients, optimizer state, batchnorm statistics and losses stay float32. */
typedef enum ut_dtype { UT_F32 = 0, UT_BF16 = 1 } ut_dtype;

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
  bool shared;     /* others see gpu_buf (ut_wrap, DLPack export): the host copy is a snapshot */
  /* Memory the tensor borrows (ut_wrap): called once, at the last ut_free, instead of freeing
     it. NULL for memory the library owns. */
  void (*release)(void* ctx);
  void* release_ctx;
  /* Bumped by every write the library makes to the values (op outputs, in-place ops, optimizer
     steps) and by ut_sync_cpu, which hands the host a writable copy; the bindings compare it to
     refuse a backward whose saved input was changed after its forward. Wraps around. */
  unsigned int version;
  ut_dtype dtype;  /* UT_F32 unless made bf16 (ut_alloc_dtype, ut_to_dtype); UT_F32 is 0, so a
                      zeroed struct is float32 */
  /* Writes the library does not see: `tracked` (ut_track_writes) says every write to the host
     values goes through the library or through a view counted in `views` while open
     (ut_view_open / ut_view_close; `view_closes` counts the closed ones). Only then may the CPU
     backend keep what it derives from the values (`derived`, private: a weight's packed GEMM
     panels) across calls, for as long as `version` and `view_closes` are unchanged and no view
     is open. (A closed view does not move `version`: backward compares that, and reading a
     layer's input through numpy between forward and backward is fine.) Zero in a new tensor:
     nothing is kept. */
  bool tracked;
  int views;
  unsigned int view_closes;
  void* derived;
} ut_tensor;

/* ---- library and errors ----------------------------------------------------------------------- */
int ut_version(void);                 /* UT_VERSION the library was built from */
const char* ut_last_error(void);      /* this thread's last error message ("" if none) */
ut_status ut_last_status(void);       /* this thread's last error status (UT_OK if none) */
void ut_clear_error(void);
void ut_seed(unsigned long long seed);   /* reseeds the shared RNG used by ut_randn */
int ut_set_num_threads(int n);        /* CPU threads per op (n >= 1); returns status */
int ut_get_num_threads(void);
long long ut_live_tensors(void);      /* tensors allocated and not yet freed */
/* The values of those tensors, 4 bytes each (a bf16 tensor's device copy is half that): what
   a network keeps between its forward and backward, for memory tests and profiling. The peak
   is the highest since the last reset (reset != 0 returns it and starts over from now). */
long long ut_live_bytes(void);
long long ut_peak_live_bytes(int reset);
/* Freed host blocks of 128 KiB or more stay cached for the next tensor of their size (eight
   sizes per power of two), up to 1 GiB in all (the environment's UTENSIL_HOST_CACHE_MB, read at
   the first allocation, sets another cap; 0 turns the cache off): fresh pages from the system
   cost a page fault each on first touch, a third of a batch-8 MobileNetV2 forward. An
   allocation that fails empties the cache and tries again. ut_host_empty_cache hands the blocks
   back to the system; ut_host_cached_bytes: how much is cached now. */
int ut_host_empty_cache(void);        /* status (UT_OK) */
long long ut_host_cached_bytes(void);
/* Layout of public structs as the C compiler sees them (for binding checks); -1 if unknown. */
long long ut_type_size(const char* type_name);
long long ut_field_offset(const char* type_name, const char* field_name);

/* ---- devices ------------------------------------------------------------------------------ */
bool ut_cuda_available(void);         /* a GPU is present and the CUDA backend is built in */
const char* ut_backend_name(ut_dev dev); /* "cpu" or "cuda": where ops on dev really run */
/* Host<->GPU copies the mirror has made since the process started (for tests and profiling). */
void ut_transfer_counts(long long* uploads, long long* downloads);
int ut_cuda_mem_info(size_t* free_bytes, size_t* total_bytes); /* status; error without GPU */
/* Freed GPU memory stays cached for the next allocation of its size (cudaMalloc and cudaFree
   stall the device). ut_cuda_empty_cache hands the cached blocks back to the driver, for other
   users of the GPU (PyTorch in the same process, other processes); blocks that recorded graphs
   own stay until the graph is freed. ut_cuda_cached_bytes: how much is cached now. Both no-ops
   (0) without a GPU; empty_cache is an error while a graph is recorded. */
int ut_cuda_empty_cache(void);        /* status */
long long ut_cuda_cached_bytes(void);
int ut_cuda_synchronize(void);        /* wait for all queued GPU work; no-op without a GPU */
/* Make `waiting` wait for the work queued so far on `signalling` (cudaStream_t handles; NULL is
   the stream the library queues its work on). No-op without a GPU. */
int ut_cuda_stream_wait(void* waiting, void* signalling);

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
ut_tensor* ut_alloc_dtype(int ndim, const int* shape, ut_dev dev, ut_dtype dtype); /* zeroed */
/* a new tensor with t's shape, device and values, as dtype (to bf16: rounded to nearest even;
   NaN stays NaN, overflow goes to infinity as in PyTorch) */
ut_tensor* ut_to_dtype(ut_tensor* t, ut_dtype dtype);
const char* ut_dtype_name(ut_dtype dtype); /* "float32", "bfloat16"; "?" if invalid */
ut_tensor* ut_retain(ut_tensor* t);   /* rc += 1, returns t */
void ut_free(ut_tensor* t);           /* rc -= 1, frees at 0; NULL is ignored */
void ut_free_n(ut_tensor** ts, int n);
int ut_sync_cpu(ut_tensor* t);        /* host copy current and owner; returns status */
int ut_sync_cpu_readonly(ut_tensor* t); /* host copy current, device copy stays valid */
int ut_sync_gpu(ut_tensor* t);        /* device copy current (no-op without one) */
int ut_to_device(ut_tensor* t, ut_dev dev); /* retag in place, moving data as needed */
/* Writes outside the library (see the struct's `tracked`). ut_track_writes: from now on every
   write to t's host values is the library's or goes through a view that ut_view_open announced
   (a numpy or DLPack view); never for borrowed memory (ut_wrap), whose owner writes unseen.
   ut_view_close: that view is gone (what was derived before it is not used again). A C
   program that writes t->data itself simply never calls ut_track_writes. Return status. */
int ut_track_writes(ut_tensor* t);
int ut_view_open(ut_tensor* t);
int ut_view_close(ut_tensor* t);
ut_tensor* ut_copy(ut_tensor* t);     /* a new tensor with the same shape, device and values */
/* dst = src (same nelem, same device); dtypes may differ: the values are converted (the step
   that writes a bf16 copy of float32 master weights) */
int ut_copy_into(ut_tensor* dst, ut_tensor* src);
ut_tensor* ut_reshape(ut_tensor* t, int ndim, const int* shape); /* copy with a new shape */
int ut_fill(ut_tensor* t, float value);
ut_tensor* ut_transpose(ut_tensor* t, int d0, int d1); /* new tensor with dims d0, d1 swapped */

/* ---- elementwise and dense ---------------------------------------------------------------- */
ut_tensor* ut_relu(ut_tensor* x);     /* any shape -> same shape */
ut_tensor* ut_relu6(ut_tensor* x);    /* min(max(x, 0), 6) */
/* grad_out, fwd_input: same shape; gradient passes except where x <= 0 (relu), x <= 0 or
   x >= 6 (relu6): a NaN input passes it on, as in PyTorch */
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
  ut_tensor* col;   /* the input itself for 1x1, stride 1, pad 0, computed per image; else
                       NULL: backward rebuilds the columns from the input */
} ut_conv2d_cache;

typedef struct ut_dwconv2d {
  ut_tensor* weight; /* [C*mult, kh, kw] — mult filters per channel, no cross-channel mixing */
  ut_tensor* bias;   /* [C*mult] or NULL */
  int c, kh, kw, stride, pad;
  int dilation; /* taps dilation apart (0 reads as 1: structs built field by field stay valid) */
  int mult;     /* channel multiplier: output o reads input channel o / mult (0 reads as 1) */
} ut_dwconv2d;

typedef struct ut_dwconv2d_cache {
  ut_tensor* input; /* [N, C, H, W] */
  /* Set by ut_batchnorm2d_dwconv2d_forward where its kernels folded the BatchNorm, else NULL:
     the layer's input was act(bn(input)), never written; bn holds [4, C]: the BatchNorm's mean,
     var, gamma and beta of that forward, with its eps and activation (bn_act, a
     ut_activation), so backward normalizes input again as it loads it */
  ut_tensor* bn;
  float bn_eps;
  int bn_act;
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

/* An activation: what ut_activation_forward computes, and what a layer may apply to its own
   output in the same pass over the data (fused: BatchNorm2d takes every kind, its backward
   recomputing the pre-activation from the input it keeps). ReLU6 is min(max(x, 0), 6);
   backward masks the gradient as relu_backward would.
   The others are PyTorch's (torch.nn.functional.<name>), forward and backward, their values at
   the kinks and for NaN and infinities included:
     SILU         x sigmoid(x), computed x / (1 + exp(-x))                        (swish)
     HARDSWISH    x min(max(x + 3, 0), 6) / 6; gradient 0 for x <= -3, x/3 + 1/2 for
                  -3 < x < 3, 1 for x >= 3 (and for NaN x: the gradient passes)
     HARDSIGMOID  min(max(x + 3, 0), 6) / 6; gradient 1/6 for -3 < x < 3, else 0 (NaN x too)
     SIGMOID      1 / (1 + exp(-x))
     GELU         x (1 + erf(x / sqrt 2)) / 2                       (approximate='none')
     GELU_TANH    x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2   (approximate='tanh') */
typedef enum {
  UT_ACT_NONE = 0,
  UT_ACT_RELU = 1,
  UT_ACT_RELU6 = 2,
  UT_ACT_SILU = 3,
  UT_ACT_HARDSWISH = 4,
  UT_ACT_HARDSIGMOID = 5,
  UT_ACT_SIGMOID = 6,
  UT_ACT_GELU = 7,
  UT_ACT_GELU_TANH = 8
} ut_activation;

/* ---- activations (issue 30) ----------------------------------------------------------------
   One forward and one backward for every kind, the kind an argument (not a function per
   activation): the same enum names a layer's fused activation and selects the backend's one
   act_fwd / act_bwd slot pair, so a new kind is an enum value and a case, not new symbols in
   the library, the bindings and both backends' tables. Any kind is taken: NONE is the identity
   (a copy), RELU and RELU6 are ut_relu / ut_relu6 (and their backward) to the bit.
   x: any shape -> y: same shape, same dtype (float32, or bfloat16: computed in float32) */
ut_tensor* ut_activation_forward(ut_tensor* x, ut_activation a);
/* grad_out, fwd_input (the forward's x): same shape and dtype -> grad_out * f'(x) */
ut_tensor* ut_activation_backward(ut_tensor* grad_out, ut_tensor* fwd_input, ut_activation a);
/* "silu", "hardswish", ... (PyTorch's function names; "none", "relu", "relu6"); "?" if invalid */
const char* ut_activation_name(ut_activation a);

typedef struct ut_batchnorm2d {
  ut_tensor* weight;       /* [C] gain */
  ut_tensor* bias;         /* [C] shift */
  ut_tensor* running_mean; /* [C] */
  ut_tensor* running_var;  /* [C] unbiased batch variance, averaged */
  int c;
  float eps;
  float momentum;          /* running = (1 - momentum) * running + momentum * batch */
  bool training;           /* true: batch statistics; false: running statistics */
  int activation;          /* ut_activation applied to the output (UT_ACT_NONE by default) */
} ut_batchnorm2d;

typedef struct ut_batchnorm2d_cache {
  ut_tensor* input; /* [N, C, H, W] */
  ut_tensor* mean;  /* [C] statistics the forward pass normalized with */
  ut_tensor* rstd;  /* [C] */
  bool training;    /* the mode of that forward pass */
  int activation;   /* and its activation: backward recomputes the pre-activation from input */
  bool synced;      /* its statistics were every rank's (ut_batchnorm2d_forward_sync) */
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
/* ut_conv2d_backward's dW, db without dx (no dx GEMM, no col2im) -> UT_OK or a status < 0 */
int ut_conv2d_backward_params(ut_conv2d* l, ut_conv2d_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db);
void ut_conv2d_cache_free(ut_conv2d_cache* c);
void ut_conv2d_free(ut_conv2d* l);

/* x: [N, C, H, W] -> [N, C, Ho, Wo], each channel convolved with its own kh x kw filter */
ut_dwconv2d ut_dwconv2d_alloc(int c, int kh, int kw, int stride, int pad, bool bias, ut_dev dev);
/* x: [N, C, H, W] -> [N, C*mult, Ho, Wo], Ho = (H + 2 pad - dilation (kh-1) - 1) / stride + 1:
   output channel o is input channel o / mult convolved with filter o, whose taps lie dilation
   apart (PyTorch: Conv2d(C, mult*C, groups=C, dilation=...); TensorFlow: depth_multiplier) */
ut_dwconv2d ut_dwconv2d_alloc_ex(int c, int mult, int kh, int kw, int stride, int pad,
                                 int dilation, bool bias, ut_dev dev);
ut_tensor* ut_dwconv2d_forward(ut_dwconv2d* l, ut_tensor* x, ut_dwconv2d_cache* cache);
/* grad_out: [N, C*mult, Ho, Wo], dW: C*mult*kh*kw elements, db: C*mult -> dx [N, C, H, W] */
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

/* x: [..., D] float32 or bfloat16 -> same shape and dtype, normalized over the last dimension
   (weight = 1, bias = 0 when allocated) */
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
/* Synchronized batchnorm (PyTorch's SyncBatchNorm): in training mode the statistics are those
   of every rank's batch together, which data-parallel training on small per-GPU batches needs.
   reduce(ctx, t) must make t (a tensor on x's device) the sum of every rank's t and return a
   status: ut_dist_sum with a ut_dist* as ctx is one. Forward calls it twice (the means, then
   the spread around the common mean: no cancellation), backward once; every rank must make
   the same calls in the same order. Ranks may hold batches of different sizes. dW and db get
   this rank's share (a data-parallel wrapper averages them as any gradient); dx is exact for
   the sum of the ranks' losses. reduce == NULL or eval mode: the plain layer. A cache filled by
   one kind of forward is refused by the other kind of backward. */
typedef int (*ut_reduce_fn)(void* ctx, ut_tensor* t);
ut_tensor* ut_batchnorm2d_forward_sync(ut_batchnorm2d* l, ut_tensor* x,
                                       ut_batchnorm2d_cache* cache, ut_reduce_fn reduce,
                                       void* ctx);
ut_tensor* ut_batchnorm2d_backward_sync(ut_batchnorm2d* l, ut_batchnorm2d_cache* cache,
                                        ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db,
                                        ut_reduce_fn reduce, void* ctx);

/* ---- inference: a convolution and the BatchNorm2d after it in one pass (issue 32) ----------
   Eval only: no cache, no gradient. y = bn(conv(x)) with bn's running statistics and its fused
   activation (bn->activation), as ut_conv2d_forward / ut_dwconv2d_forward then
   ut_batchnorm2d_forward in eval mode give it, within float32 rounding. The BatchNorm is folded
   into the convolution: per output channel o, scale[o] = gamma[o] / sqrt(var[o] + eps) and
   shift[o] = beta[o] + (bias[o] - mean[o]) scale[o] (bias: the convolution's, or 0). The fold is
   recomputed from the layers' current values at every call (a few values per channel, against a
   whole convolution): nothing is cached, so nothing can go stale, whatever wrote the weights or
   statistics (an optimizer, load_state_dict, a numpy view the library cannot see). On the CPU
   (float32) scale, shift and activation are applied to each tile of the output while it is in
   cache: the GEMM's epilogue (dense), each few planes as the depthwise engine writes them (the
   filters themselves scaled there, kh*kw values per channel). On a GPU and for bfloat16 the two
   layers' own forwards run, one after the other. bn must be in eval mode (training false) with
   bn->c the convolution's output channels. `act` is an activation layer after the BatchNorm
   folded too (y = act(bn(conv(x))), ut_activation_forward's values): UT_ACT_NONE, or any kind
   when bn->activation is UT_ACT_NONE (one activation per call, never two composed).
   x: [N, in_c, H, W] -> [N, out_c, Ho, Wo] (ut_conv2d_forward's shapes) */
ut_tensor* ut_conv2d_bn_forward(ut_conv2d* l, ut_batchnorm2d* bn, ut_tensor* x,
                                ut_activation act);
/* x: [N, C, H, W] -> [N, C*mult, Ho, Wo] (ut_dwconv2d_forward's shapes) */
ut_tensor* ut_dwconv2d_bn_forward(ut_dwconv2d* l, ut_batchnorm2d* bn, ut_tensor* x,
                                  ut_activation act);

/* ---- training: a BatchNorm2d folded into the depthwise convolution after it (issue 31) ------
   y = l(act(bn(x))), act = bn->activation: the values, gradients, running statistics and caches
   of ut_batchnorm2d_forward(bn, x, bn_cache) followed by ut_dwconv2d_forward(l, that, cache), to
   the bit, without writing act(bn(x)) to memory: the GPU's depthwise kernels normalize x as they
   load it, in forward and again in backward's weight gradient (two trips through memory fewer
   per step, and no tensor held from forward to backward for it). bn_cache is filled as
   ut_batchnorm2d_forward fills it; cache->input is x and cache->bn the normalization, so
   ut_dwconv2d_backward(l, cache, go, ...) gives the gradient at act(bn(x)), and
   ut_batchnorm2d_backward(bn, bn_cache, that, ...) the rest. Both caches are required. Where the
   kernels have no such load (the CPU, an activation past RELU6, a channel multiplier, filters
   outside the strip kernels) the two layers run as they are: act(bn(x)) is written and kept as
   cache->input, cache->bn stays NULL.
   x: [N, C, H, W] -> [N, C*mult, Ho, Wo] (ut_dwconv2d_forward's shapes) */
ut_tensor* ut_batchnorm2d_dwconv2d_forward(ut_batchnorm2d* bn, ut_dwconv2d* l, ut_tensor* x,
                                           ut_batchnorm2d_cache* bn_cache,
                                           ut_dwconv2d_cache* cache);

/* A depthwise-separable block in one call (inference, eval mode; issue 32): MobileNet v1's
   depthwise + pointwise pair, and the inverted residual of MobileNetV2, MNASNet, MobileNetV3
   and EfficientNet:
       e = act_expand(bn_expand(expand(x)))       expand: a 1x1 Conv2d, stride 1, no padding;
                                                  NULL: e = x (bn_expand unused)
       d = act_dw(bn_dw(dw(e)))                   dw: a DWConv2d
       d = d * excitation(d)                      with squeeze-and-excitation (se_reduce set)
       y = act_project(bn_project(project(d)))    project: a 1x1 Conv2d, stride 1, no padding
       y = y + x                                  when residual (x and y of one shape)
   each convolution and its BatchNorm folded as ut_conv2d_bn_forward folds them (the same
   checks; every act_* as its act). On the CPU in float32, for a block with an expand over
   large planes and a depthwise of multiplier and dilation 1, stride 1 or 2, each thread takes
   bands of output rows and runs them through all three layers a few rows at a time: the
   expanded rows and the depthwise's output rows live in a per-thread scratch block that stays
   in cache (the rows a depthwise window shares with the step before are kept, not
   recomputed), and no intermediate tensor is written to memory. Otherwise (smaller planes, no
   expand, squeeze-and-excitation, a GPU, bfloat16, other depthwise geometries) the three folded
   forwards run one after the other; on the CPU in float32 the excitation then scales the
   project's weight per image, or a copy of its input columns where those are fewer, instead
   of d. Either way the result is the layers' own forwards within float32 rounding.
   x: [N, C, H, W] -> [N, project out_c, Ho, Wo] */
typedef struct ut_separable_block {
  ut_conv2d* expand; /* or NULL */
  ut_batchnorm2d* bn_expand;
  ut_activation act_expand;
  ut_dwconv2d* dw;
  ut_batchnorm2d* bn_dw;
  ut_activation act_dw;
  ut_conv2d* project;
  ut_batchnorm2d* bn_project;
  ut_activation act_project;
  bool residual;
  /* squeeze-and-excitation between dw and project (MobileNetV3, EfficientNet), both or neither:
     d = d * act_se_expand(se_expand(act_se_reduce(se_reduce(mean of d over H and W)))),
     se_reduce and se_expand 1x1 Conv2ds (stride 1, no padding) as torchvision's fc1 and fc2 */
  ut_conv2d* se_reduce; /* or NULL */
  ut_activation act_se_reduce;
  ut_conv2d* se_expand;
  ut_activation act_se_expand;
} ut_separable_block;
ut_tensor* ut_separable_block_forward(const ut_separable_block* b, ut_tensor* x);

/* x: [N, C, H, W] -> [N, C], the mean over H and W */
ut_tensor* ut_global_avgpool2d_forward(ut_tensor* x);
/* grad_out: [N, C] -> dx [N, C, h, w] */
ut_tensor* ut_global_avgpool2d_backward(ut_tensor* grad_out, int h, int w);

/* ---- channel scales and LayerNorm2d (squeeze-and-excitation, ConvNeXt; issue 30) ----------
   The excitation s is an activation (the output of the block's small branch), so it has x's
   dtype and its gradient ds too (summed in float32 in a fixed order, rounded once). The layer
   scale gamma is a parameter: float32, its gradient accumulated (+=) in float32. */
/* x: [N, C, ...], s: [N, C] or [N, C, 1, ..., 1] of x's dtype -> y like x,
   y[n, c, ...] = x[n, c, ...] * s[n, c] (squeeze-and-excitation's last step) */
ut_tensor* ut_channel_scale(ut_tensor* x, ut_tensor* s);
/* grad_out like x -> *dx = grad_out * s (like x), *ds[n, c] = sum over ... of grad_out * x
   (like s). dx or ds may be NULL (that output is not made); on failure both are set NULL.
   Returns a status. */
int ut_channel_scale_backward(ut_tensor* grad_out, ut_tensor* x, ut_tensor* s, ut_tensor** dx,
                              ut_tensor** ds);
/* x: [N, C, ...], gamma: [C] or [C, 1, ..., 1] float32 -> y like x, y[n, c, ...] =
   x[n, c, ...] * gamma[c] (ConvNeXt's layer scale, torchvision's layer_scale [C, 1, 1]) */
ut_tensor* ut_layer_scale(ut_tensor* x, ut_tensor* gamma);
/* grad_out like x -> dx = grad_out * gamma; dgamma (C float32 elements, or NULL) +=
   sum over n and ... of grad_out * x */
ut_tensor* ut_layer_scale_backward(ut_tensor* grad_out, ut_tensor* x, ut_tensor* gamma,
                                   ut_tensor* dgamma);
/* LayerNorm2d (torchvision.models.convnext.LayerNorm2d): x: [N, C, H, W] -> same shape, each
   (n, h, w) normalized over the C channels, with a ut_layernorm of dim C (weight, bias: [C];
   ConvNeXt's eps is 1e-6). Activations float32 or bf16; statistics float32, kept in the cache
   as mean, rstd: [N, H, W] (a rows layernorm's cache holds [rows]: each backward refuses the
   other's cache). */
ut_tensor* ut_layernorm2d_forward(ut_layernorm* l, ut_tensor* x, ut_layernorm_cache* cache);
/* grad_out: [N, C, H, W], dW: C, db: C (+=, each may be NULL) -> dx [N, C, H, W] */
ut_tensor* ut_layernorm2d_backward(ut_layernorm* l, ut_layernorm_cache* cache,
                                   ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db);

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
/* PyTorch's label smoothing (eps = label_smoothing in [0, 1]): the target is (1 - eps) onehot
   + eps / K, so the loss is the mean over the batch of
     (1 - eps) (-log softmax[label]) + eps mean_k(-log softmax[k])
   and its gradient (softmax - (1 - eps) onehot - eps / K) / N. eps 0: the calls above. */
ut_tensor* ut_cross_entropy_loss_smoothed(ut_tensor* logits, ut_tensor* labels,
                                          float label_smoothing);
ut_tensor* ut_cross_entropy_backward_smoothed(ut_tensor* logits, ut_tensor* labels,
                                              float label_smoothing);

/* ---- regularisation: Dropout, StochasticDepth (issue 30) ---------------------------------- */
/* [shape] float32 from the shared RNG (ut_seed): each element 0 with probability p, else
   1 / (1 - p) (p in [0, 1]; p 1: all 0; a double, as PyTorch's Python float: 1 - p is
   computed before rounding). Drawn on the host, uploaded for UT_CUDA. */
ut_tensor* ut_dropout_mask(int ndim, const int* shape, double p, ut_dev dev);
/* x: any shape, float32 or bf16, viewed as [R, inner] with R = mask's element count (which
   must divide x's); mask: float32, x's device. In place x[r, :] *= mask[r]: Dropout (R = the
   element count) and StochasticDepth's row mode (R = N); backward applies the same mask to
   grad_out. A bf16 x is rounded once, after the float32 product. */
int ut_mask_scale(ut_tensor* x, ut_tensor* mask);
/* The exponential moving average of weights (AveragedModel with get_ema_multi_avg_fn): for each
   i < count, avg[i] += weight * (cur[i] - avg[i]) as PyTorch's lerp_ computes it (weight =
   1 - decay, in [0, 1]); float32, same element count and device pairwise. All are checked
   before any changes. */
int ut_lerp_many(ut_tensor** avg, ut_tensor** cur, int count, float weight);

/* ---- optimizers: update param in place from grad (same nelem, same device) ---------------- */
/* velocity = momentum * velocity + grad; param -= lr * velocity (velocity NULL: plain SGD) */
int ut_sgd_step(ut_tensor* param, ut_tensor* grad, ut_tensor* velocity, float lr, float momentum);
/* ut_sgd_step on count parameters in one call (an optimizer's step: on the GPU a launch per
   40 parameters instead of one each). Every argument is checked before any parameter changes;
   velocities NULL: plain SGD for all (else velocities[i] NULL for none is refused). */
int ut_sgd_step_many(ut_tensor** params, ut_tensor** grads, ut_tensor** velocities, int count,
                     float lr, float momentum);
/* ut_fill(ts[i], value) for count tensors in one call (zero_grad); all are checked first */
int ut_fill_many(ut_tensor** ts, int count, float value);
/* The gradient buffer of data-parallel training: flat holds ts[0..count) end to end (flat's
   element count is their sum; all on flat's device). ut_pack copies them into flat, ut_unpack
   copies flat back out (one all-reduce of flat then serves every tensor). */
int ut_pack(ut_tensor* flat, ut_tensor** ts, int count);
int ut_unpack(ut_tensor* flat, ut_tensor** ts, int count);
/* Adam with bias correction; step is the 1-based update count; m, v start at zero */
int ut_adam_step(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step, float lr,
                 float beta1, float beta2, float eps);
/* PyTorch's SGD in full (torch.optim.SGD; ut_sgd_step_many is its momentum-only case):
     d = grad + weight_decay * param
     velocity = momentum * velocity + (1 - dampening) * d     (velocities NULL: no momentum)
     d = nesterov ? d + momentum * velocity : velocity
     param -= lr * d
   PyTorch's first step sets velocity = d: pass dampening 0 on a zeroed velocity for that step.
   weight_decay >= 0; nesterov needs momentum > 0 and dampening 0 (PyTorch's rules). */
int ut_sgd_step_many_ex(ut_tensor** params, ut_tensor** grads, ut_tensor** velocities, int count,
                        float lr, float momentum, float dampening, float weight_decay,
                        bool nesterov);
/* Adam with weight decay (weight_decay >= 0): decoupled false is PyTorch's Adam (grad +
   weight_decay * param goes into the moments), true is AdamW (param *= 1 - lr * weight_decay
   before the Adam update). The hyperparameters are doubles, as PyTorch's Python floats: 1 -
   beta2 and the bias corrections are computed from them in double (float32's 0.999 is 1.3e-5
   off in 1 - beta2). ut_adam_step is its weight_decay 0 case on float32 values. */
int ut_adam_step_ex(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool decoupled);

/* ---- matrix products on the GPU ----------------------------------------------------------
   GEMMs on the GPU (matmul, linear, conv2d) run on NVIDIA's cuBLAS when it can be loaded at run
   time, else on utensil's own kernels; the library never links it. The default search runs at
   the first GEMM on the GPU: $UTENSIL_CUBLAS_LIB when set (a path; set but empty: no cuBLAS),
   else the path given to ut_cublas_hint (the Python bindings give the nvidia-cublas wheel's),
   then the system loader (libcublas.so.13, libcublas.so.12). Not finding it is no error: the
   own kernels run and ut_cublas_info() says why. */
int ut_cublas_load(const char* path); /* load now from path (NULL: the default search); status */
int ut_cublas_hint(const char* path); /* a path the default search tries first; loads nothing */
/* on (the default): GEMMs on cuBLAS, loading it if needed (an error when it cannot be loaded);
   off: on the own kernels (the reference the tests compare cuBLAS with) */
int ut_cublas_enable(bool on);
bool ut_cublas_active(void);          /* GEMMs on the GPU run on cuBLAS now */
/* "cuBLAS 13.1.0 (path)", or why GEMMs run on the own kernels. Valid until the next
   ut_cublas_load or ut_cublas_enable. */
const char* ut_cublas_info(void);
/* How float32 GEMMs on the GPU may round, with PyTorch's names (torch.set_float32_matmul_
   precision): "highest" (the default) multiplies and adds in fp32. "high" and "medium" let
   cuBLAS use TF32 tensor cores: each product's inputs are rounded to a 10-bit mantissa (relative
   error up to 2^-11 each) and sums stay fp32, so a k-term dot product is off by about
   2^-11 sqrt(k) of the magnitude of its terms. The own kernels and the CPU are always fp32. */
int ut_set_float32_matmul_precision(const char* precision);
const char* ut_get_float32_matmul_precision(void);
/* ---- captured GPU work (CUDA graphs) -------------------------------------------------------
   A training step on small shapes spends more time launching kernels than running them.
   Between ut_cuda_graph_begin() and ut_cuda_graph_end() the GPU work of the library's calls
   made by the calling thread is recorded instead of run (the calls return as usual, their
   outputs not yet computed); ut_cuda_graph_replay() runs the recording again as one launch:
   the same kernels on the same memory. So a replay reads whatever the recorded input tensors
   hold then (write the next batch into them; a tensor changed on the host is uploaded before
   the replay) and writes the same output tensors, which the graph keeps alive until
   ut_cuda_graph_free. Rules; breaking one is an error, never a wrong replay:
   - run the work once before recording it: first calls load cuBLAS and size workspaces, which
     waits for the GPU, and nothing may wait for the GPU while recording;
   - while recording, no GPU tensor is read on the host or uploaded (inputs must be current on
     the GPU when the recording starts), and GPU calls from other threads fail;
   - host-side values are recorded as they were: scalars such as a learning rate or Adam's bias
     correction, shapes, train/eval mode. CPU tensors are computed at once, not recorded.
   - a tensor the graph uses stays on the GPU in its dtype: moved away, the replay refuses.
   One recording at a time; graphs hold their device memory until freed. */
typedef struct ut_cuda_graph ut_cuda_graph;
int ut_cuda_graph_begin(void);              /* status; an error without a GPU */
ut_cuda_graph* ut_cuda_graph_end(void);     /* NULL + error when the recording failed */
int ut_cuda_graph_replay(ut_cuda_graph* g); /* status */
void ut_cuda_graph_free(ut_cuda_graph* g);  /* NULL is ignored */
/* ---- several processes: NCCL, loaded at run time ------------------------------------------
   Data-parallel training runs one process per GPU, each on the GPU current for it (the
   launcher gives each process one). Their gradients are averaged by NVIDIA's NCCL, loaded at
   the first ut_dist_* call and never linked or shipped: $UTENSIL_NCCL_LIB when set (a path; set
   but empty: no NCCL), else the path given to ut_nccl_hint (the Python bindings give the
   nvidia-nccl-cu13 wheel's), then libnccl.so.2 from the system loader. Without it every
   ut_dist_* call fails with UT_ERR_DEVICE and ut_nccl_info() says why; one-GPU work is not
   affected. The id that makes processes one group comes from ut_dist_unique_id on one rank (or
   on every rank, given NCCL_COMM_ID=host:port) and reaches the others by any channel. */
#define UT_DIST_ID_BYTES 128
typedef struct ut_dist ut_dist;
int ut_nccl_hint(const char* path);       /* a path the search tries first; loads nothing */
const char* ut_nccl_info(void);           /* "NCCL 2.28.9 (path)", or why it is not loaded */
int ut_dist_unique_id(unsigned char* id); /* UT_DIST_ID_BYTES bytes; status */
/* joins the group (blocks until all world_size ranks have joined); NULL + error on failure */
ut_dist* ut_dist_init(int world_size, int rank, const unsigned char* id);
/* t (a GPU tensor) becomes the sum of every rank's t, or their mean with average: queued on the
   library's stream, in place, the same call on every rank in the same order */
int ut_dist_all_reduce(ut_dist* d, ut_tensor* t, bool average);
int ut_dist_broadcast(ut_dist* d, ut_tensor* t, int root); /* every rank's t = root's t */
/* status: an error when NCCL reported one in the background (a peer died, a network failure);
   poll it while waiting so a dead peer becomes an error, not a hang */
int ut_dist_check(ut_dist* d);
/* waits for the library's queued GPU work (collectives included) while polling NCCL's errors:
   a peer that died or hangs makes it abort the group (every later call on d fails) and fail
   with UT_ERR_DEVICE after at most timeout_s seconds, instead of blocking forever. The
   collectives themselves return at once; call this where the host would wait anyway. */
int ut_dist_wait(ut_dist* d, double timeout_s);
int ut_dist_sum(void* d, ut_tensor* t); /* ut_dist_all_reduce(d, t, false) as a ut_reduce_fn */
void ut_dist_free(ut_dist* d);  /* leaves the group, after its queued work */
void ut_dist_abort(ut_dist* d); /* leaves at once, work in flight dropped (a peer is gone) */
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
   (native/cuda/common.cuh, which defines UT_BACKEND_INTERFACE before including this header).
   Plain C that also compiles as C++: no compound literals here.

   A backend is a table of functions over raw buffers of its own memory (host pointers for the
   CPU backend, device pointers for CUDA). The public entry points validate arguments, allocate
   outputs, make inputs current on the backend's side, call one or more of these, and mark which
   side they wrote. Every function returns UT_OK or a negative ut_status after ut__set_error().
   Counts are elements, not bytes. Outputs are fully overwritten unless the comment says "+=".

   Element types: one slot per op. A slot that reads or writes activations takes their element
   type as its first parameter, `ut_dtype dt` (cast and gemm, whose buffers have two types, take
   two), and those buffers as void*; parameters (w, bias, gamma, beta), statistics, sums and
   gradient accumulators (dw, dgamma, dbeta, channel_sum's out) are float* and float32 whatever
   dt says. Activations are read into float32, computed in float32 and rounded to nearest even
   when stored as bf16. Each backend switches on dt inside its own function, to one kernel per
   type, and fails with UT_ERR_ARG (never an abort) on a type it has no kernel for. The core
   passes the type of the buffer on the backend's side (ut__buf_dtype): the CUDA backend gets
   UT_F32 or UT_BF16; the CPU backend only ever gets UT_F32, since it computes a bf16 tensor on
   its float32 host copy and the core rounds what it wrote (ut__wrote). Slots without dt (copy,
   layernorm, losses, optimizers, the running statistics) are float32 only.
   ============================================================================================ */
#if defined(UT_IMPLEMENTATION) || defined(UT_BACKEND_INTERFACE)
#ifndef UTENSIL_BACKEND_INTERFACE_H
#define UTENSIL_BACKEND_INTERFACE_H
#include <math.h> /* expf, erfcf, tanhf: the activations' formulas at the end of this part */
#ifdef __cplusplus
extern "C" {
#endif

typedef long long ut__i64;

/* A 2-D convolution's geometry: input [n, c, h, w], filter kh x kw with its taps dil apart
   (dilation; the window spans (kh-1)*dil + 1 rows), output [n, ?, ho, wo]. kp: the rows of
   an image's im2col columns, c*kh*kw, or more (the rows past c*kh*kw zero) where a device's
   GEMM wants k a multiple of 8 (ut__conv_col_rows); 0 reads as c*kh*kw. */
typedef struct ut__conv_geom {
  int n, c, h, w, kh, kw, stride, pad, ho, wo, dil, kp;
} ut__conv_geom;
/* A BatchNorm folded into a depthwise convolution's loads (dw_fwd_bn, dw_bwd_dw_bn): each
   input value v of channel j is read as act(z), z = (v - mean[j]) gamma[j] / sqrt(var[j] + eps)
   + beta[j], computed as the backend's bn_apply computes it (a ut_activation) */
typedef struct ut__dw_bn {
  const float *mean, *var, *gamma, *beta; /* [c] each */
  float eps;
  int act;
} ut__dw_bn;
/* A convolution's three directions: y = conv(x, w) + b, dx = conv^T(go, w), dW += go (x) x. */
typedef enum { UT__CONV_Y, UT__CONV_DX, UT__CONV_DW } ut__conv_dir;

/* Row-major batched GEMM: for each i < batch,
     C_i = alpha * op(A_i) * op(B_i) + beta * C_i,   op(A_i): [m, k], op(B_i): [k, n], C_i: [m, n]
   A_i = a + i*stride_a is [m, k] with row stride lda, or [k, m] when trans_a (likewise B).
   With sum_batch the products of all batch items are summed into one C (stride_c ignored):
     C = alpha * sum_i op(A_i) op(B_i) + beta * C.
   beta == 0 means C is not read (it may hold garbage). Strides and leading dimensions count
   elements of the buffers' types, which the gemm slot takes (ab_dt for A and B, c_dt for C);
   the products and sums are float32 whatever the types. */
typedef struct ut__gemm_args {
  bool trans_a, trans_b, sum_batch;
  int m, n, k, batch;
  float alpha, beta;
  const void* a;
  int lda;
  ut__i64 stride_a;
  const void* b;
  int ldb;
  ut__i64 stride_b;
  void* c;
  int ldc;
  ut__i64 stride_c;
  /* Inference's epilogue (issue 32; the CPU backend's gemm only, so the core sets it for the
     CPU only; never with sum_batch): row_scale non-NULL makes each element of C, once summed,
     act(row_scale[i] C[i, j] + row_shift[i]) for its row i (act a ut_activation). */
  const float* row_scale;
  const float* row_shift;
  int act;
  /* Inference's implicit convolution (the CPU backend's float32 gemm only, like the epilogue):
     B_i is not stored. op(B_i)[k, j] is the column matrix im2col makes of image i of x = b
     (images stride_b apart) under this geometry (dilation 1): k = (c, ky, kx), j = (oy, ox),
     zero where the window leaves the input. trans_b and ldb are unused. */
  const ut__conv_geom* b_conv;
  /* Inference's kept weight (the CPU backend's float32 gemm only): A is this tensor's values
     (a == a_owner->data, not transposed, one A for the whole batch), which the gemm may pack
     once and keep on the tensor (ut__packed) while they are unchanged. NULL: packed per call. */
  ut_tensor* a_owner;
  const float* a_packed; /* the backend's own: A's kept panels for this call, or NULL */
} ut__gemm_args;
/* The most rows (out_c) of an implicit convolution: the CPU GEMM's block of rows (UT__CPU_MC,
   a tuning choice, so the two may part without harm), inside which each column panel is
   packed once. */
#define UT__IMPLICIT_CONV_MAX_OUT 192

/* Inference's depthwise-separable block (ut_separable_block_forward) with every BatchNorm
   folded: the expand GEMM and the project GEMM with per-row epilogues (scale, shift, act, as
   ut__gemm_args' row_scale), the depthwise with its filters already scaled and `dshift` as its
   bias. Host memory: the CPU backend's slot only. */
typedef struct ut__sep_args {
  const float* x; /* [n, c, h, w] */
  float* y;       /* [n, oc, ho, wo] */
  int c, oc;
  const float* we; /* expand [e, c], or NULL (then e == c and the depthwise reads x) */
  const float *escale, *eshift;
  int eact;
  const float *wd, *dshift; /* the depthwise's folded filters [e, kh, kw] and shift [e] */
  int dact;
  ut__conv_geom gd; /* the depthwise's geometry: n, e channels, h, w, ..., ho, wo */
  const float* wp;  /* project [oc, e] */
  const float *pscale, *pshift;
  int pact;
  bool residual; /* y += x (oc == c, ho == h, wo == w) */
  ut_tensor *we_owner, *wp_owner; /* the tensors of we and wp (ut__gemm_args' a_owner) */
} ut__sep_args;

/* The optimizers' hyperparameters, as their slots take them (ut_sgd_step_many_ex and
   ut_adam_step_ex say what each is; zero decay is the plain step of ut_sgd_step / ut_adam_step). */
typedef struct ut__sgd_hp {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;
} ut__sgd_hp;
typedef struct ut__adam_hp {
  float b1, b2, omb1, omb2;  /* omb: 1 - b, from the double betas */
  float eps;
  float step_size, sqrt_bc2; /* lr / (1 - b1^step), sqrt(1 - b2^step) */
  float weight_decay;        /* L2 into the gradient (Adam); 0 when decoupled */
  float decay;               /* AdamW's p *= decay = 1 - lr weight_decay; 1 when not */
} ut__adam_hp;

typedef struct ut__backend {
  const char* name;
  /* device memory; NULL for the CPU backend, whose buffers are the tensors' host copies */
  void* (*mem_alloc)(size_t bytes);                    /* NULL + error on failure */
  void (*mem_free)(void* p);
  int (*upload)(void* dst, const float* src, size_t bytes);
  int (*download)(float* dst, const void* src, size_t bytes);
  int (*mem_info)(size_t* free_bytes, size_t* total_bytes);
  int (*empty_cache)(void);       /* cached device blocks back to the driver */
  long long (*cached_bytes)(void);
  int (*synchronize)(void);                            /* wait for all queued work */
  /* make stream `waiting` wait for the work queued so far on `signalling` (NULL: the library's
     stream, the legacy default stream) */
  int (*stream_wait)(void* waiting, void* signalling);
  /* recording (ut_cuda_graph_begin/end): *g is the backend's graph; replay runs it on the
     library's stream; free waits for the device first */
  int (*graph_begin)(void);
  int (*graph_end)(void** g);
  int (*graph_replay)(void* g);
  void (*graph_free)(void* g);

  /* elementwise; cap > 0 clamps at cap (relu6), cap <= 0 is plain relu */
  int (*fill)(ut_dtype dt, void* x, ut__i64 n, float v);
  int (*copy)(float* dst, const float* src, ut__i64 n);
  /* dst[r, :cols] = src[r, :cols] for r < rows, rows src_ld and dst_ld elements apart; the rest
     of dst is left as it is */
  int (*copy2d)(ut_dtype dt, const void* src, ut__i64 src_ld, void* dst, ut__i64 dst_ld,
                int rows, ut__i64 cols);
  /* dst[i] = src[i] converted (any pair of types, also equal: then a copy) */
  int (*cast)(ut_dtype src_dt, ut_dtype dst_dt, const void* src, void* dst, ut__i64 n);
  int (*axpy)(ut_dtype dt, void* y, const void* x, ut__i64 n, float alpha); /* y += alpha x */
  int (*scale)(ut_dtype dt, void* x, ut__i64 n, float alpha);              /* x *= alpha */
  int (*relu_fwd)(ut_dtype dt, const void* x, void* y, ut__i64 n, float cap);
  /* gi = 0 where x <= 0 (or x >= cap when cap > 0), else go (NaN x passes go, like PyTorch) */
  int (*relu_bwd)(ut_dtype dt, const void* go, const void* x, void* gi, ut__i64 n, float cap);
  /* the activations from UT_ACT_SILU on (ReLU and ReLU6 keep relu_fwd / relu_bwd): one slot
     pair for all, each backend switching on act inside, to the formulas of ut__act_value /
     ut__act_grad below (shared by both backends). y = f(x); gi = go f'(x) */
  int (*act_fwd)(ut_dtype dt, int act, const void* x, void* y, ut__i64 n);
  int (*act_bwd)(ut_dtype dt, int act, const void* go, const void* x, void* gi, ut__i64 n);

  /* in: [outer, d0, mid, d1, inner] -> out: [outer, d1, mid, d0, inner] */
  int (*transpose)(ut_dtype dt, const void* in, void* out, int outer, int d0, int mid, int d1,
                   int inner);
  /* ab_dt: A's and B's type; c_dt: C's. The pairs there are: float32 throughout, and bf16 A
     and B into a bf16 or a float32 C (a device backend's) */
  int (*gemm)(ut_dtype ab_dt, ut_dtype c_dt, const ut__gemm_args* args);
  /* x: [n, c, inner]; x[i, j, :] += bias[j] */
  int (*bias_add)(ut_dtype dt, void* x, const float* bias, int n, int c, ut__i64 inner);
  /* x: [n, c, inner]; out[j] = beta * out[j] + sum_{i, :} x[i, j, :]  (beta is 0 or 1) */
  int (*channel_sum)(ut_dtype dt, const void* x, float* out, int n, int c, ut__i64 inner,
                     float beta);
  /* x: [rows, cols] -> y: [rows] mean of each row */
  int (*row_mean)(ut_dtype dt, const void* x, void* y, int rows, ut__i64 cols);
  /* go: [rows] -> dx: [rows, cols], dx[r, :] = go[r] / cols */
  int (*row_mean_bwd)(ut_dtype dt, const void* go, void* dx, int rows, ut__i64 cols);

  /* x: [n, c, h, w] -> col: [n, c*kh*kw, ho*wo] (zero where the window hits padding); with
     g->kp, [n, kp, ho*wo] and the rows past c*kh*kw zero (a device backend's only) */
  int (*im2col)(ut_dtype dt, const void* x, void* col, const ut__conv_geom* g);
  /* col: [n, c*kh*kw (or g->kp), ho*wo] -> dx: [n, c, h, w], the adjoint of im2col
     (overwrites dx) */
  int (*col2im)(ut_dtype dt, const void* col, void* dx, const ut__conv_geom* g);
  /* The dense conv2d's exact pass, after the im2col GEMM of a padded convolution (pad > 0): the
     GEMM multiplies the columns' padding zeros too, which a non-finite weight (forward) or
     grad_out (dW) turns into NaN where the convolution, summed over real input only as
     PyTorch's is, keeps the value.
     UT__CONV_Y: y [n, out_c, ho, wo] (the GEMM's, bias added) is recomputed from x and
       w [out_c, c*kh*kw] (and bias [out_c] or NULL) for every output channel whose weights are
       not all finite.
     UT__CONV_DW: dw [out_c, c*kh*kw] (float32) += part, the GEMM's sum of go (x) columns taken
       with beta 0 (float32), each element whose part could have met padding (a NaN; on the CPU
       every element once grad_out is not all finite) summed again over real input from go and
       x. x, go and w are of type dt. */
  int (*conv_exact)(ut_dtype dt, ut__conv_dir dir, const void* x, const void* go, const void* w,
                    const float* bias, const float* part, void* dst, int out_c,
                    const ut__conv_geom* g);

  /* depthwise: x: [n, c, h, w], w: [c, kh, kw], bias: [c] or NULL -> y: [n, c, ho, wo], the
     taps g->dil apart (the channel multiplier is the core's: see ut__dw_repeat) */
  int (*dw_fwd)(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                const ut__conv_geom* g);
  /* dw_fwd, then y = act(y) (a ut_activation) applied as the output is written (inference,
     issue 32); NULL where a backend has none (the core then runs the layers one by one) */
  int (*dw_fwd_act)(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                    const ut__conv_geom* g, int act);
  /* inference's depthwise-separable block (see ut__sep_args); NULL where a backend has none.
     sep_takes says, from the geometry alone (gd: the depthwise's, c: the block's input
     channels), whether sep_fwd runs a block; where it does not, the core runs the three
     folded forwards one after the other, before folding anything for sep_fwd */
  bool (*sep_takes)(const ut__conv_geom* gd, int c, bool expand);
  int (*sep_fwd)(const ut__sep_args* a);
  /* go: [n, c, ho, wo], w -> dx: [n, c, h, w] (overwrites) */
  int (*dw_bwd_dx)(ut_dtype dt, const void* go, const float* w, void* dx, const ut__conv_geom* g);
  /* go, x -> dw: [c, kh, kw]  += */
  int (*dw_bwd_dw)(ut_dtype dt, const void* go, const void* x, float* dw, const ut__conv_geom* g);
  /* dw_fwd and dw_bwd_dw on act(bn(x)) (ut_batchnorm2d_dwconv2d_forward), x normalized as it is
     loaded, to the bit as bn_apply writes it (rounded to dt); NULL where a backend has none, 1
     (nothing done) where it does not serve the geometry or activation: the core then writes
     act(bn(x)) with bn_apply and calls dw_fwd or dw_bwd_dw */
  int (*dw_fwd_bn)(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                   const ut__conv_geom* g, const ut__dw_bn* bn);
  /* the fold's numbers in one pass: rstd[j] as bn_apply computes it, and st [4, c] = mean, var,
     gamma, beta (what the depthwise cache keeps); NULL where dw_fwd_bn is */
  int (*bn_fold_pack)(const float* mean, const float* var, const float* gamma,
                      const float* beta, float* rstd, float* st, int c, float eps);
  int (*dw_bwd_dw_bn)(ut_dtype dt, const void* go, const void* x, float* dw,
                      const ut__conv_geom* g, const ut__dw_bn* bn);
  /* x: [n, c, inner] -> y: [n, c*m, inner], y[i, j*m + r, :] = x[i, j, :] */
  int (*chan_repeat)(ut_dtype dt, const void* x, void* y, int n, int c, int m, ut__i64 inner);
  /* x: [n, c*m, inner] -> y: [n, c, inner], y[i, j, :] = sum over r = 0..m-1 in order of
     x[i, j*m + r, :] (overwrites) */
  int (*chan_group_sum)(ut_dtype dt, const void* x, void* y, int n, int c, int m, ut__i64 inner);

  /* x: [rows, dim] -> y, mean: [rows], rstd: [rows]; y = (x - mean) * rstd * gamma + beta */
  int (*layernorm_fwd)(const float* x, const float* gamma, const float* beta, float* y,
                       float* mean, float* rstd, int rows, int dim, float eps);
  /* -> dx (overwrites); dgamma, dbeta: [dim] += (each may be NULL) */
  int (*layernorm_bwd)(const float* go, const float* x, const float* gamma, const float* mean,
                       const float* rstd, float* dx, float* dgamma, float* dbeta, int rows,
                       int dim);

  /* channel scales and LayerNorm2d (issue 30). x: [n, c, inner]; y[i, j, :] = x[i, j, :] *
     s[i*c + j], or s[j] when shared; s of type s_dt (dt, or float32 for a shared scale) */
  int (*chan_scale)(ut_dtype dt, ut_dtype s_dt, const void* x, const void* s, void* y, int n,
                    int c, ut__i64 inner, bool shared);
  /* a, b: [n, c, inner] -> out[i*c + j] = beta * out[i*c + j] + sum_: a[i, j, :] b[i, j, :],
     or when shared out[j] = beta * out[j] + sum over i and : (beta 0 or 1); float32 sums in
     an order fixed by the shapes alone (deterministic) */
  int (*chan_dot)(ut_dtype dt, const void* a, const void* b, float* out, int n, int c,
                  ut__i64 inner, bool shared, float beta);
  /* x: [n, c, inner], each (i, :) normalized over j -> y; mean, rstd: [n, inner];
     y = (x - mean) * rstd * gamma[j] + beta[j] */
  int (*ln2d_fwd)(ut_dtype dt, const void* x, const float* gamma, const float* beta, void* y,
                  float* mean, float* rstd, int n, int c, ut__i64 inner, float eps);
  /* -> dx (overwrites) = rstd (g - mean_j(g) - xhat mean_j(g xhat)), g = go gamma;
     dgamma += sum go xhat, dbeta += sum go over i and : (each may be NULL) */
  int (*ln2d_bwd)(ut_dtype dt, const void* go, const void* x, const float* gamma,
                  const float* mean, const float* rstd, void* dx, float* dgamma, float* dbeta,
                  int n, int c, ut__i64 inner);

  /* x: [n, c, inner] -> mean, var: [c], the biased batch statistics per channel */
  int (*bn_stats)(ut_dtype dt, const void* x, float* mean, float* var, int n, int c,
                  ut__i64 inner);
  /* running = (1 - momentum) running + momentum * stat, with var scaled by unbias first */
  int (*bn_update_running)(float* running_mean, float* running_var, const float* mean,
                           const float* var, int c, float momentum, float unbias);
  /* rstd[j] = 1/sqrt(var[j] + eps); z = (x - mean) * (rstd * gamma) + beta; y = act(z), act
     any ut_activation (the core checked it): NONE y = z, RELU and RELU6 relu_fwd's rules, the
     others ut__act_value */
  int (*bn_apply)(ut_dtype dt, const void* x, void* y, const float* mean, const float* var,
                  const float* gamma, const float* beta, float* rstd, int n, int c,
                  ut__i64 inner, float eps, int act);
  /* g = go f'(z), z recomputed as bn_apply computes it, to the bit (NONE: g = go; RELU, RELU6:
     go masked as relu_bwd masks it; the others ut__act_grad). training: dx = gamma rstd (g -
     mean(g) - xhat mean(g xhat)) per channel; eval: dx = gamma rstd g. dgamma += sum(g xhat),
     dbeta += sum(g) (each may be NULL) */
  int (*bn_bwd)(ut_dtype dt, const void* go, const void* x, const float* mean, const float* rstd,
                const float* gamma, const float* beta, void* dx, float* dgamma, float* dbeta,
                int n, int c, ut__i64 inner, bool training, int act);
  /* synchronized batchnorm, in the order the core calls them (a and b summed over the ranks
     in between): a == NULL: out[j] = count mean[j], out[c] = count; else, with the common
     mean M[j] = a[j] / a[c]: out[j] = count (var[j] + (mean[j] - M[j])^2) */
  int (*bn_sync_pack)(const float* mean, const float* var, const float* a, float* out, int c,
                      float count);
  /* mean = a[j] / a[c], var = b[j] / a[c]; running statistics updated as bn_update_running,
     the variance unbiased by the total count a[c] */
  int (*bn_sync_unpack)(const float* a, const float* b, float* mean, float* var,
                        float* running_mean, float* running_var, int c, float momentum);
  /* bn_bwd in two halves around the sum over the ranks: sums[2j] = sum g, sums[2j+1] =
     sum g xhat, sums[2c] = n inner, dgamma/dbeta += them (each may be NULL); then dx as bn_bwd
     in training mode with the (summed) sums and count sums[2c] */
  int (*bn_bwd_sums)(ut_dtype dt, const void* go, const void* x, const float* mean,
                     const float* rstd, const float* gamma, const float* beta, float* sums,
                     float* dgamma, float* dbeta, int n, int c, ut__i64 inner, int act);
  int (*bn_bwd_dx)(ut_dtype dt, const void* go, const void* x, const float* mean,
                   const float* rstd, const float* gamma, const float* beta, const float* sums,
                   void* dx, int n, int c, ut__i64 inner, int act);

  /* out[0] = mean((p - t)^2);  g = 2 (p - t) / n */
  int (*mse_fwd)(const float* p, const float* t, float* out, ut__i64 n);
  int (*mse_bwd)(const float* p, const float* t, float* g, ut__i64 n);
  /* logits: [n, k], labels: [n] -> out[0] = mean -log softmax[label]; g = (softmax - onehot)/n.
     A label that is not an integer in [0, k) gives NaN (the core checks labels on the host). */
  int (*ce_fwd)(const float* logits, const float* labels, float* out, int n, int k, float eps);
  int (*ce_bwd)(const float* logits, const float* labels, float* g, int n, int k, float eps);

  /* NCCL (NULL in the CPU backend): the public ut_dist_* calls, see there; comm is the
     backend's communicator */
  int (*dist_unique_id)(unsigned char* id);
  int (*dist_init)(int world_size, int rank, const unsigned char* id, void** comm);
  int (*dist_all_reduce)(void* comm, float* x, ut__i64 n, bool average);
  int (*dist_broadcast)(void* comm, float* x, ut__i64 n, int root);
  int (*dist_check)(void* comm);
  /* ut_dist_wait; on an error or the timeout the communicator is aborted, *aborted set */
  int (*dist_wait)(void* comm, double timeout_s, bool* aborted);
  void (*dist_free)(void* comm, bool abort);
  const char* (*nccl_info)(void);

  /* cuBLAS for gemm (NULL in the CPU backend): the public ut_cublas_* calls, see there */
  int (*blas_load)(const char* path);
  int (*blas_enable)(bool on);
  bool (*blas_active)(void);
  const char* (*blas_info)(void);

  /* Dropout's mask drawn on the device (NULL in the CPU backend, which draws on the host):
     out[i] = scale where uniform(key, counter + i) <= keep, else 0, the counter held in device
     memory and advanced by n on the stream, so a recorded graph draws anew at each replay.
     epoch changes with each ut_seed: the first call that sees a new epoch outside a recording
     sets the device's key and counter 0 (a recording cannot hold that reset: each replay would
     redraw the same mask) */
  int (*rng_mask)(float* out, ut__i64 n, double keep, float scale, unsigned long long key,
                  unsigned long long epoch, bool recording);
  /* x[i] *= s[i / inner] (s float32, x of type dt): Dropout's and StochasticDepth's mask */
  int (*mask_scale)(ut_dtype dt, void* x, const float* s, ut__i64 n, ut__i64 inner);
  /* a = lerp(a, b, w) = a + w (b - a) (w < 0.5; else b - (b - a)(1 - w)), PyTorch's lerp_ */
  int (*lerp)(float* a, const float* b, ut__i64 n, float w);

  /* d = g + wd p; v = momentum v + (1 - dampening) d; d = nesterov ? d + momentum v : v;
     p -= lr d   (v NULL: p -= lr d); the hyperparameters in ut__sgd_hp */
  int (*sgd)(float* p, const float* g, float* v, ut__i64 n, ut__sgd_hp h);
  /* sgd and fill on count buffers at once (v NULL: no momentum): an optimizer step or
     zero_grad over a whole network in one call */
  int (*sgd_many)(float* const* p, const float* const* g, float* const* v, const ut__i64* n,
                  int count, ut__sgd_hp h);
  int (*fill_many)(float* const* x, const ut__i64* n, int count, float v);
  /* p *= decay (AdamW; 1 otherwise); g += wd p (Adam's L2; 0 otherwise); m = lerp(m, g,
     1-b1); v = b2 v + (1-b2) g^2; p -= step_size m / (sqrt(v) / sqrt_bc2 + eps) (PyTorch's
     order); the hyperparameters in ut__adam_hp */
  int (*adam)(float* p, const float* g, float* m, float* v, ut__i64 n, ut__adam_hp h);
} ut__backend;

/* Set by any part of the library; formats like printf. Returns status for `return ut__fail(...)`. */
int ut__set_error(int status, const char* fmt, ...);
/* ut_set_float32_matmul_precision's setting: 0 "highest", 1 "high", 2 "medium" */
int ut__matmul_precision(void);
/* Copies ut_cublas_hint's path (or "") into out (n bytes, n > 0). */
void ut__cublas_hint_copy(char* out, size_t n);
/* Copies ut_nccl_hint's path (or "") into out (n bytes, n > 0). */
void ut__nccl_hint_copy(char* out, size_t n);

/* The CUDA backend when built in and a GPU is present, else NULL. Defined in
   native/cuda/backend.cu; the implementation adds a weak stand-in ("backend selection"),
   marked weak here, before any call to it. */
#if defined(UT_IMPLEMENTATION) && !defined(UT_NO_CUDA) && defined(__GNUC__) && \
    (defined(__ELF__) || defined(__APPLE__))
#define UT__CUDA_WEAK_STANDIN
__attribute__((weak))
#endif
const ut__backend* ut__cuda_backend(void);

/* The activations' formulas at one float32 value, for the CPU kernels and the CUDA ones alike
   (nvcc compiles them for the device too), so both backends evaluate the same expressions in
   the same order: PyTorch's, from its CPU kernels (aten/src/ATen/native/cpu/Activation.cpp,
   UnaryOpsKernel.cpp), whose order decides the special values: silu(-inf) = -inf / inf = NaN,
   hardswish(-inf) = -inf * 0 = NaN, gelu_tanh's gradient at |x| >= 2e19 = 0 * inf = NaN.
   min/max are comparisons that let NaN through (fminf/fmaxf would drop it); an act outside
   the slots' kinds returns x (forward) or go (backward): the entry points never pass one.
   The kind is a constant where the kernels call these, so each loop compiles to one formula. */
#ifdef __CUDACC__
#define UT__ACT_FN static __host__ __device__ __forceinline__
#elif defined(__GNUC__)
/* always_inline: the CPU loops that call these are compiled with other optimize options
   (UT__CPU_ACT_OPT), and GCC inlines across that difference only when told to */
#define UT__ACT_FN static inline __attribute__((always_inline))
#else
#define UT__ACT_FN static inline
#endif
#define UT__GELU_SQRT1_2 0.70710678118654752440f   /* 1 / sqrt(2) */
#define UT__GELU_PDF0 0.39894228040143267794f      /* 1 / sqrt(2 pi) */
#define UT__GELU_TANH_BETA 0.79788456080286535588f /* sqrt(2 / pi) */
#define UT__GELU_TANH_KAPPA 0.044715f
UT__ACT_FN float ut__act_hard(float x) { /* min(max(x + 3, 0), 6), NaN passing */
  float h = x + 3.0f;
  h = h < 0.0f ? 0.0f : h;
  return 6.0f < h ? 6.0f : h;
}
#ifdef __CUDACC__
UT__ACT_FN float ut__expf(float x) { return expf(x); }
UT__ACT_FN float ut__expf_den(float x) { return expf(x); }
UT__ACT_FN float ut__gelu_cdf(float x) { return 0.5f * erfcf(-x * UT__GELU_SQRT1_2); }
UT__ACT_FN float ut__gelu_cdf_pdf(float x, float* pdf) {
  *pdf = expf(-0.5f * (x * x)) * UT__GELU_PDF0;
  return ut__gelu_cdf(x);
}
#else
/* expf for the CPU's SiLU and Sigmoid: selects and bit operations only, so the loops that call
   it vectorize (glibc's expf is one call per value: BatchNorm2d + SiLU was half of
   EfficientNet-B0's CPU inference). exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2
   in two parts (Cody and Waite), exp(r) by a degree-5 polynomial (Cephes' coefficients):
   within about one ulp of expf (2.2e-7 relative in SiLU measured). 2^n is applied as two
   factors, so results down to the subnormals round once (gradual underflow kept); above 88.72
   it is inf, below -103.97 zero, NaN passes. */
/* n = round(x / ln 2), as a float, of x clamped to [lo, 89] (NaN taken as 0: no NaN into the
   integer conversion); *xc: the clamped x */
UT__ACT_FN float ut__expf_n(float x, float lo, float* xc) {
  float c = x == x ? x : 0.0f;
  c = c < lo ? lo : c;
  c = c > 89.0f ? 89.0f : c;
  *xc = c;
  float nf = c * 1.44269504088896341f + 12582912.0f; /* + 1.5 2^23: rounds to an integer */
  return nf - 12582912.0f;
}
/* exp(r) for |r| <= ln 2 / 2 */
UT__ACT_FN float ut__expf_poly(float r) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * (r * r) + r + 1.0f;
}
UT__ACT_FN float ut__expf_parts(float hi, float lo) {
  const float x = hi + lo; /* the clamps and the integer part; the reduction keeps lo's bits */
  float xc, nf = ut__expf_n(x, -104.0f, &xc);
  float r = hi - nf * 0.693359375f; /* exact: nf ln2's upper part is near hi */
  r = r - nf * -2.12194440e-4f;
  r = r + lo;
  float p = ut__expf_poly(r);
  int n = (int)nf, n1 = n / 2, n2 = n - n1; /* each in [-75, 65]: normal powers of two */
  union { int i; float f; } s1 = {.i = (n1 + 127) * (1 << 23)}, s2 = {.i = (n2 + 127) * (1 << 23)};
  float v = p * s1.f * s2.f;
  v = x > 88.72283905f ? (float)INFINITY : v;
  v = x < -103.972084f ? 0.0f : v;
  return x == x ? v : x;
}
UT__ACT_FN float ut__expf(float x) { return ut__expf_parts(x, 0.0f); }
/* exp(x) where only 1 + exp(x) is wanted (SiLU's and Sigmoid's denominators): where exp(x) <
   2^-24, 1 + exp(x) rounds to 1 whatever it is, so below x = -87 any value in [0, 2^-24) does,
   and 2^n is one factor (n + 126 is a normal exponent) instead of ut__expf_parts' two. Elsewhere
   the same operations as ut__expf, so 1 + ut__expf_den(x) == 1 + ut__expf(x) for every float x,
   NaNs included (checked over all 2^32 through SiLU, Sigmoid and their gradients); a quarter
   fewer vector operations: SiLU 0.81 -> 0.62 ns a value on one AVX-512 core. */
UT__ACT_FN float ut__expf_den(float t) {
  const float x = t + 0.0f; /* ut__expf_parts' hi + lo: the same NaN */
  float xc, nf = ut__expf_n(x, -87.0f, &xc);
  float r = xc - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  float p = ut__expf_poly(r);
  union { int i; float f; } s = {.i = ((int)nf + 126) * (1 << 23)}; /* 2^(n - 1), n <= 128 */
  float v = p * s.f * 2.0f;
  v = x > 88.72283905f ? (float)INFINITY : v;
  return x == x ? v : x;
}
/* GELU's Phi(x) = erfc(-x / sqrt 2) / 2 for the CPU, vectorizable as ut__expf is (glibc's
   erfcf made GELU a sixth of ConvNeXt's CPU training step). For a = |z|: erfc(a) =
   t exp(-a^2 + Q(t)), t = 2 / (2 + a), Q a degree-10 polynomial in t - 0.6 fitted by us (least
   squares reweighted toward the worst point) to log(erfc(a) / t) + a^2 over a in [0, 10.5],
   within 6.7e-9 there. a^2 = hi^2 + (hi - a)(hi + a), hi being a's upper 12 significand bits
   (hi^2 exact), and exp takes hi^2 apart from the rest, so the argument loses nothing for
   large a. Measured within 4e-7 relative of erfc wherever erfc is a normal float32 (plus
   ut__expf's ulp); above 10.5 it is 0 (erfc(10.5) < 1e-49), and erfc(-a) = 2 - erfc(a).
   exp(-a^2) is the density's factor too: with pdf, the backward has it from the same split. */
UT__ACT_FN float ut__gelu_q(float t) {
  const float u = t - 0.6f;
  float q = -0.1337122619152069f;
  q = q * u + 0.12267311662435532f;
  q = q * u + 0.15833555161952972f;
  q = q * u + -0.22528766095638275f;
  q = q * u + -0.07951820641756058f;
  q = q * u + 0.2886218726634979f;
  q = q * u + -0.010383550077676773f;
  q = q * u + -0.40889912843704224f;
  q = q * u + 0.07027825713157654f;
  q = q * u + 1.37142014503479f;
  q = q * u + -0.5357597470283508f;
  return q;
}
/* z = -x / sqrt 2 as a = |z| (clamped), hi (a's upper 12 significand bits) and t */
UT__ACT_FN float ut__gelu_split(float x, float* hi, float* t) {
  float a = fabsf(x * UT__GELU_SQRT1_2);
  a = a > 10.5f ? 10.5f : a; /* NaN stays NaN */
  union { float f; unsigned i; } h = {.f = a};
  h.i &= 0xFFFFF000u;
  *hi = h.f;
  *t = 2.0f / (2.0f + a);
  return a;
}
UT__ACT_FN float ut__gelu_cdf(float x) {
  float hi, t, a = ut__gelu_split(x, &hi, &t);
  const float r = t * ut__expf_parts(-(hi * hi), (hi - a) * (hi + a) + ut__gelu_q(t));
  return x > 0.0f ? 1.0f - 0.5f * r : 0.5f * r; /* r = erfc(a) */
}
UT__ACT_FN float ut__gelu_cdf_pdf(float x, float* pdf) {
  float hi, t, a = ut__gelu_split(x, &hi, &t);
  const float e = ut__expf_parts(-(hi * hi), (hi - a) * (hi + a)); /* exp(-x^2 / 2) */
  *pdf = e * UT__GELU_PDF0;
  const float r = t * e * ut__expf(ut__gelu_q(t));
  return x > 0.0f ? 1.0f - 0.5f * r : 0.5f * r;
}
#endif
UT__ACT_FN float ut__act_value(int act, float x) {
  switch (act) {
    case UT_ACT_SILU: return x / (1.0f + ut__expf_den(-x));
    case UT_ACT_HARDSWISH: return x * ut__act_hard(x) / 6.0f;
    case UT_ACT_HARDSIGMOID: return ut__act_hard(x) / 6.0f;
    case UT_ACT_SIGMOID: return 1.0f / (1.0f + ut__expf_den(-x));
    /* erfc(-z), not 1 + erf(z): no cancellation in the left tail (x = -3: 2e-5 relative) */
    case UT_ACT_GELU: return x * ut__gelu_cdf(x);
    case UT_ACT_GELU_TANH: {
      float inner = UT__GELU_TANH_BETA * (x + UT__GELU_TANH_KAPPA * (x * x * x));
      return 0.5f * x * (1.0f + tanhf(inner));
    }
  }
  return x;
}
/* go * f'(x); the kinks' and NaN's cases as PyTorch's backward takes them (see ut_activation) */
UT__ACT_FN float ut__act_grad(int act, float go, float x) {
  switch (act) {
    case UT_ACT_SILU: {
      float s = 1.0f / (1.0f + ut__expf_den(-x));
      return go * s * (1.0f + x * (1.0f - s));
    }
    /* the middle pieces computed unconditionally, then selected: no branch, so the CPU loops
       vectorize (with UT__CPU_ACT_OPT's no-trapping-math) */
    case UT_ACT_HARDSWISH: {
      float mid = go * (x / 3.0f + 0.5f);
      return x <= -3.0f ? 0.0f : x < 3.0f ? mid : go;
    }
    case UT_ACT_HARDSIGMOID: {
      float mid = go * (1.0f / 6.0f);
      return (x > -3.0f) & (x < 3.0f) ? mid : 0.0f;
    }
    case UT_ACT_SIGMOID: { /* PyTorch's backward reads the output: go (1 - y) y */
      float y = 1.0f / (1.0f + ut__expf_den(-x));
      return go * (1.0f - y) * y;
    }
    case UT_ACT_GELU: {
      float pdf, cdf = ut__gelu_cdf_pdf(x, &pdf);
      return go * (cdf + x * pdf);
    }
    case UT_ACT_GELU_TANH: {
      float x2 = x * x;
      float inner = UT__GELU_TANH_BETA * (x + UT__GELU_TANH_KAPPA * (x2 * x));
      float t = tanhf(inner);
      float left = 0.5f * x, right = 1.0f + t;
      float dinner = UT__GELU_TANH_BETA * (1.0f + 3.0f * UT__GELU_TANH_KAPPA * x2);
      return go * (0.5f * right + left * (1.0f - t * t) * dinner);
    }
  }
  return go;
}

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
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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
static atomic_llong ut__live_bytes = 0, ut__peak_bytes = 0;
static atomic_int ut__nthreads = 0; /* 0: not yet set, use the cores present */

int ut_set_num_threads(int n) {
  UT__CHECK(n >= 1 && n <= 4096, UT_ERR_ARG, "ut_set_num_threads: n must be in [1, 4096], got %d", n);
  atomic_store(&ut__nthreads, n);
  return UT_OK;
}
/* The cores this process may run on (its affinity mask where the build can read it, as
   utensil.c's _GNU_SOURCE allows; else the cores online), found once. */
static int ut__default_threads(void) {
  static atomic_int cached = 0;
  int n = atomic_load(&cached);
  if (n > 0) return n;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
#if defined(__linux__) && defined(CPU_COUNT)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) cores = CPU_COUNT(&set);
#endif
  n = cores > 0 ? (cores < 4096 ? (int)cores : 4096) : 1;
  atomic_store(&cached, n);
  return n;
}
int ut_get_num_threads(void) {
  int n = atomic_load(&ut__nthreads);
  return n > 0 ? n : ut__default_threads();
}
long long ut_live_tensors(void) { return atomic_load(&ut__live); }
long long ut_live_bytes(void) { return atomic_load(&ut__live_bytes); }
long long ut_peak_live_bytes(int reset) {
  long long peak = reset ? atomic_exchange(&ut__peak_bytes, atomic_load(&ut__live_bytes))
                         : atomic_load(&ut__peak_bytes);
  return peak;
}
/* a tensor of n values born (+) or freed (-) */
static void ut__count_bytes(long long n, int sign) {
  long long now = atomic_fetch_add(&ut__live_bytes, sign * n * (long long)sizeof(float)) +
                  sign * n * (long long)sizeof(float);
  long long peak = atomic_load(&ut__peak_bytes);
  while (now > peak && !atomic_compare_exchange_weak(&ut__peak_bytes, &peak, now)) {
  }
}

static atomic_llong ut__uploads = 0, ut__downloads = 0;
void ut_transfer_counts(long long* uploads, long long* downloads) {
  if (uploads) *uploads = atomic_load(&ut__uploads);
  if (downloads) *downloads = atomic_load(&ut__downloads);
}

/* The RNG: xoshiro256** seeded through splitmix64, shared by all threads under a lock. */
static pthread_mutex_t ut__rng_lock = PTHREAD_MUTEX_INITIALIZER;
static void ut__pool_init(void); /* registers the fork handlers, which hold this lock too */
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
/* the device RNG's stream (rng_mask): its key, and how many times ut_seed set it */
static unsigned long long ut__dev_rng_key = 0x5eedULL, ut__dev_rng_epoch = 1;
void ut_seed(unsigned long long seed) {
  ut__pool_init();
  pthread_mutex_lock(&ut__rng_lock);
  ut__rng_seed_locked(seed);
  uint64_t k = seed ^ 0x6a09e667f3bcc909ULL; /* not the host stream's first state */
  ut__dev_rng_key = ut__splitmix64(&k);
  ut__dev_rng_epoch++;
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
  ut__pool_init();
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

/* ---- backend selection ---------------------------------------------------------------- */
static const ut__backend ut__cpu_backend; /* the CPU backend's table, at its end */

/* CUDA BACKEND. ut__cuda_backend() is defined by native/cuda/backend.cu when its objects are
   linked in. So that a plain `cc app.c` links and runs on the CPU without them, the
   implementation defines a stand-in that returns NULL ("no CUDA backend built in"): on GCC and
   Clang (ELF, Mach-O) a weak definition (the declaration above carries the attribute), which
   the linker drops in favour of backend.cu's strong one when both are linked, so the GPU comes
   with the objects and no define. A weak definition rather than a weak reference tested for
   NULL, so that every caller stays a plain call. Other compilers have no portable weak
   symbols: there a CPU-only build defines UT_NO_CUDA, the explicit opt-out that works
   everywhere (a strong stand-in, so linking backend.cu's objects as well fails to link). */
#if defined(UT_NO_CUDA) || defined(UT__CUDA_WEAK_STANDIN)
const ut__backend* ut__cuda_backend(void) { return NULL; }
#endif

/* ---- the recording in progress (ut_cuda_graph_begin) ---------------------------------------
   Every GPU tensor an op reads, writes or creates on the recording thread is held (one
   reference per sighting) until ut_cuda_graph_end, which keeps what the graph needs: tensors
   it reads or writes that existed before or are still held after (a replay refreshes their
   mirror state), while temporaries born and dropped inside the recording are let go (their
   device blocks stay the graph's, see backend.cu). */
enum { UT__SEEN_READ = 1, UT__SEEN_WROTE = 2, UT__SEEN_BORN = 4 };
typedef struct {
  pthread_t thread;
  ut_tensor** t;
  unsigned char* how;
  size_t n, cap;
  bool oom;
} ut__recording;
static ut__recording* ut__rec; /* atomic loads: any thread checks it */
static pthread_mutex_t ut__rec_lock = PTHREAD_MUTEX_INITIALIZER;
/* graphs freed while a recording runs: freeing one waits for the device, which a recording
   forbids, so they go when it ends (guarded by ut__rec_lock) */
static struct ut_cuda_graph** ut__graphs_freed_late;
static size_t ut__graphs_freed_late_n;

static ut__recording* ut__recording_now(void) {
  return __atomic_load_n(&ut__rec, __ATOMIC_ACQUIRE);
}
/* The gate of every GPU op while a recording runs: only the recording thread passes. */
static int ut__recording_gate(const ut__recording* r, const char* what) {
  UT__CHECK(pthread_equal(r->thread, pthread_self()), UT_ERR_ARG,
            "%s: another thread is recording a CUDA graph (ut_cuda_graph_begin); GPU calls "
            "from other threads fail until it ends",
            what);
  return UT_OK;
}
static void ut__recording_note(ut__recording* r, ut_tensor* t, unsigned char how) {
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 256;
    ut_tensor** nt = (ut_tensor**)realloc(r->t, cap * sizeof *nt);
    if (nt) r->t = nt;
    unsigned char* nh = (unsigned char*)realloc(r->how, cap);
    if (nh) r->how = nh;
    if (!nt || !nh) {
      r->oom = true;
      return;
    }
    r->cap = cap;
  }
  r->t[r->n] = ut_retain(t);
  r->how[r->n++] = how;
}

static const ut__backend* ut__backend_for(ut_dev dev) {
  if (dev == UT_CUDA) {
    const ut__backend* gpu = ut__cuda_backend();
    if (gpu) return gpu;
  }
  return &ut__cpu_backend;
}
static bool ut__is_device_backend(const ut__backend* be) { return be->mem_alloc != NULL; }
/* For GPU ops that write a tensor without reading one (fill): the gate of ut__in. */
static int ut__device_gate(const ut__backend* be, const char* who) {
  ut__recording* r = ut__is_device_backend(be) ? ut__recording_now() : NULL;
  return r ? ut__recording_gate(r, who) : UT_OK;
}

bool ut_cuda_available(void) { return ut__cuda_backend() != NULL; }
const char* ut_backend_name(ut_dev dev) {
  if (dev != UT_CPU && dev != UT_CUDA) return "invalid";
  return ut__backend_for(dev)->name;
}
int ut_cuda_synchronize(void) {
  UT__CHECK(!ut__recording_now(), UT_ERR_ARG,
            "ut_cuda_synchronize: waiting for the GPU while a CUDA graph is recorded: the "
            "recorded work has not run (wait after ut_cuda_graph_end, or after a replay)");
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->synchronize() : UT_OK;
}
int ut_cuda_empty_cache(void) {
  UT__CHECK(!ut__recording_now(), UT_ERR_ARG,
            "ut_cuda_empty_cache: called while a CUDA graph is recorded (the device cannot be "
            "waited for then: empty the cache after ut_cuda_graph_end)");
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->empty_cache() : UT_OK;
}
long long ut_cuda_cached_bytes(void) {
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->cached_bytes() : 0;
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

/* ---- matrix products on the GPU: cuBLAS and the float32 precision ------------------------- */
static pthread_mutex_t ut__cublas_hint_lock = PTHREAD_MUTEX_INITIALIZER;
static char ut__cublas_hint_path[4096];

int ut_cublas_hint(const char* path) {
  UT__CHECK(path, UT_ERR_ARG, "ut_cublas_hint: NULL path");
  UT__CHECK(strlen(path) < sizeof ut__cublas_hint_path, UT_ERR_ARG,
            "ut_cublas_hint: the path is longer than %d bytes",
            (int)sizeof ut__cublas_hint_path - 1);
  pthread_mutex_lock(&ut__cublas_hint_lock);
  strcpy(ut__cublas_hint_path, path);
  pthread_mutex_unlock(&ut__cublas_hint_lock);
  return UT_OK;
}
void ut__cublas_hint_copy(char* out, size_t n) {
  pthread_mutex_lock(&ut__cublas_hint_lock);
  snprintf(out, n, "%s", ut__cublas_hint_path);
  pthread_mutex_unlock(&ut__cublas_hint_lock);
}
int ut_cublas_load(const char* path) {
  const ut__backend* gpu = ut__cuda_backend();
  UT__CHECK(gpu, UT_ERR_DEVICE, "ut_cublas_load: no CUDA device is available");
  return gpu->blas_load(path);
}
int ut_cublas_enable(bool on) {
  const ut__backend* gpu = ut__cuda_backend();
  if (!gpu && !on) return UT_OK;
  UT__CHECK(gpu, UT_ERR_DEVICE, "ut_cublas_enable: no CUDA device is available");
  return gpu->blas_enable(on);
}
bool ut_cublas_active(void) {
  const ut__backend* gpu = ut__cuda_backend();
  return gpu && gpu->blas_active();
}
const char* ut_cublas_info(void) {
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->blas_info() : "no CUDA device: GEMMs run on the CPU";
}

static atomic_int ut__precision = 0;
static const char* const ut__precision_names[] = {"highest", "high", "medium"};
int ut_set_float32_matmul_precision(const char* precision) {
  UT__CHECK(precision, UT_ERR_ARG, "ut_set_float32_matmul_precision: NULL precision");
  for (int i = 0; i < 3; i++) {
    if (strcmp(precision, ut__precision_names[i]) == 0) {
      atomic_store(&ut__precision, i);
      return UT_OK;
    }
  }
  return ut__set_error(UT_ERR_ARG,
                       "ut_set_float32_matmul_precision: precision must be \"highest\", "
                       "\"high\" or \"medium\", got \"%.64s\"", precision);
}
const char* ut_get_float32_matmul_precision(void) {
  return ut__precision_names[atomic_load(&ut__precision)];
}
int ut__matmul_precision(void) { return atomic_load(&ut__precision); }

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

static bool ut__dtype_valid(ut_dtype d) { return d == UT_F32 || d == UT_BF16; }
/* bytes of one value in device memory (the host copy is always float) */
static size_t ut__dtype_bytes(ut_dtype d) { return d == UT_BF16 ? 2 : sizeof(float); }
/* device bytes of t, rounded up as the allocator rounds */
static size_t ut__dev_bytes(const ut_tensor* t) {
  return ((size_t)t->shape.nelem * ut__dtype_bytes(t->dtype) + 63) & ~(size_t)63;
}
const char* ut_dtype_name(ut_dtype dtype) {
  return dtype == UT_F32 ? "float32" : dtype == UT_BF16 ? "bfloat16" : "?";
}

/* bf16 on the host: round a float to the nearest even bf16 and back (NaN stays a quiet NaN,
   overflow goes to infinity: what __float2bfloat16_rn does on the GPU). */
static inline uint16_t ut__bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float ut__bf16_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* x[i] = x[i] rounded as ut__bf16_bits rounds, in place, on the CPU's thread pool (CPU
   BACKEND): what every CPU op on a bf16 tensor ends with */
static void ut__cpu_bf16_round(float* x, ut__i64 n);

/* ---- host memory cache (see ut_host_empty_cache) -------------------------------------------
   One free list per size class, linked through the blocks' first bytes, under one lock. Off
   under AddressSanitizer, whose use-after-free checks a reused block would blind. */
#define UT__HOST_CACHE_MIN ((size_t)128 << 10)
#define UT__HOST_CACHE_CLASSES 512
#define UT__HOST_CACHE_DEFAULT_MB 1024
static pthread_mutex_t ut__host_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t ut__host_once = PTHREAD_ONCE_INIT;
static void* ut__host_lists[UT__HOST_CACHE_CLASSES]; /* under ut__host_lock */
static atomic_llong ut__host_cached = 0;            /* changed under ut__host_lock */
static long long ut__host_limit = 0;                /* bytes; set once (ut__host_once) */

static void ut__host_prepare(void) { pthread_mutex_lock(&ut__host_lock); }
static void ut__host_parent(void) { pthread_mutex_unlock(&ut__host_lock); }
static void ut__host_child(void) { pthread_mutex_init(&ut__host_lock, NULL); }
static void ut__host_setup(void) {
  long long mb = UT__HOST_CACHE_DEFAULT_MB;
  const char* env = getenv("UTENSIL_HOST_CACHE_MB");
  if (env && *env) {
    char* end;
    long long v = strtoll(env, &end, 10);
    if (*end == '\0' && v >= 0 && v <= (1LL << 30)) mb = v; /* else the default */
  }
#if defined(__SANITIZE_ADDRESS__)
  mb = 0;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  mb = 0;
#endif
#endif
  ut__host_limit = mb << 20;
  pthread_atfork(ut__host_prepare, ut__host_parent, ut__host_child);
}
/* The size class of a block of `bytes` (>= UT__HOST_CACHE_MIN) and its rounded size. */
static int ut__host_class(size_t bytes, size_t* rounded) {
  int e = 0;
  while (e < 62 && ((size_t)1 << (e + 1)) <= bytes) e++; /* 2^e <= bytes < 2^(e+1) */
  size_t step = (size_t)1 << (e - 3);
  size_t r = (bytes + step - 1) / step * step; /* up to 2^(e+1), one of 8 steps */
  *rounded = r;
  int c = (e - 17) * 8 + (int)(r >> (e - 3)) - 8;
  return c < UT__HOST_CACHE_CLASSES ? c : -1;
}
/* Host memory for `bytes` (a multiple of 64), 64-byte aligned; NULL when there is none. */
static float* ut__host_alloc(size_t bytes) {
  pthread_once(&ut__host_once, ut__host_setup);
  size_t r = bytes;
  int c = bytes >= UT__HOST_CACHE_MIN && ut__host_limit > 0 ? ut__host_class(bytes, &r) : -1;
  if (c < 0) r = bytes;
  void* p = NULL;
  if (c >= 0) {
    pthread_mutex_lock(&ut__host_lock);
    p = ut__host_lists[c];
    if (p) {
      memcpy(&ut__host_lists[c], p, sizeof(void*));
      atomic_fetch_sub(&ut__host_cached, (long long)r);
    }
    pthread_mutex_unlock(&ut__host_lock);
    if (p) return (float*)p;
  }
  p = aligned_alloc(64, r);
  if (!p && atomic_load(&ut__host_cached) > 0) {
    ut_host_empty_cache();
    p = aligned_alloc(64, r);
  }
  return (float*)p;
}
/* Gives back what ut__host_alloc(bytes) returned: to the cache while it has room. */
static void ut__host_release(float* p, size_t bytes) {
  if (!p) return;
  size_t r = bytes;
  int c = bytes >= UT__HOST_CACHE_MIN && ut__host_limit > 0 ? ut__host_class(bytes, &r) : -1;
  if (c >= 0) {
    pthread_mutex_lock(&ut__host_lock);
    if (atomic_load(&ut__host_cached) + (long long)r <= ut__host_limit) {
      void* next = ut__host_lists[c];
      memcpy(p, &next, sizeof(void*));
      ut__host_lists[c] = p;
      atomic_fetch_add(&ut__host_cached, (long long)r);
      p = NULL;
    }
    pthread_mutex_unlock(&ut__host_lock);
  }
  free(p);
}
int ut_host_empty_cache(void) {
  pthread_once(&ut__host_once, ut__host_setup);
  pthread_mutex_lock(&ut__host_lock);
  for (int c = 0; c < UT__HOST_CACHE_CLASSES; c++) {
    void* p = ut__host_lists[c];
    while (p) {
      void* next;
      memcpy(&next, p, sizeof(void*));
      free(p);
      p = next;
    }
    ut__host_lists[c] = NULL;
  }
  atomic_store(&ut__host_cached, 0);
  pthread_mutex_unlock(&ut__host_lock);
  return UT_OK;
}
long long ut_host_cached_bytes(void) { return atomic_load(&ut__host_cached); }
/* the host bytes of a tensor of n values (what ut__host_alloc is asked for) */
static size_t ut__host_bytes(ut__i64 n) { return ((size_t)n * sizeof(float) + 63) & ~(size_t)63; }

/* A tensor with uninitialized contents. Its host copy is allocated but not touched, so large
   GPU-resident intermediates cost no host memory until someone reads them. */
static ut_tensor* ut__new_typed(int ndim, const int* shape, ut_dev dev, ut_dtype dtype,
                                const char* who) {
  UT__CHECK_NULL(ut__dev_valid(dev), UT_ERR_ARG, "%s: invalid device %d", who, (int)dev);
  UT__CHECK_NULL(ut__dtype_valid(dtype), UT_ERR_ARG, "%s: invalid dtype %d", who, (int)dtype);
  ut_shape s;
  if (ut__shape_make(&s, ndim, shape, who) < 0) return NULL;
  size_t bytes = ut__host_bytes(s.nelem);
  ut_tensor* t = (ut_tensor*)calloc(1, sizeof *t);
  float* data = ut__host_alloc(bytes);
  if (!t || !data) {
    free(t);
    ut__host_release(data, bytes);
    ut__set_error(UT_ERR_MEMORY, "%s: out of host memory allocating %zu bytes", who, bytes);
    return NULL;
  }
  t->shape = s;
  t->data = data;
  t->dev = dev;
  t->dtype = dtype;
  t->rc = 1;
  const ut__backend* be = ut__backend_for(dev);
  ut__recording* r = ut__is_device_backend(be) ? ut__recording_now() : NULL;
  if (r && ut__recording_gate(r, who) < 0) {
    ut__host_release(data, bytes);
    free(t);
    return NULL;
  }
  if (ut__is_device_backend(be)) {
    t->gpu_buf = be->mem_alloc(ut__dev_bytes(t));
    if (!t->gpu_buf) {
      ut__host_release(data, bytes);
      free(t);
      return NULL; /* the backend set the error */
    }
  }
  atomic_fetch_add(&ut__live, 1);
  ut__count_bytes(t->shape.nelem, 1);
  if (r) ut__recording_note(r, t, UT__SEEN_BORN);
  return t;
}
static ut_tensor* ut__new(int ndim, const int* shape, ut_dev dev, const char* who) {
  return ut__new_typed(ndim, shape, dev, UT_F32, who);
}
/* same shape, device and dtype */
static ut_tensor* ut__new_like(const ut_tensor* t, const char* who) {
  return ut__new_typed(t->shape.ndim, t->shape.shape, t->dev, t->dtype, who);
}
/* A tensor whose host copy the caller just filled: the host owns the values. */
static void ut__host_wrote(ut_tensor* t) {
  __atomic_fetch_add(&t->version, 1u, __ATOMIC_RELAXED);
  t->dirty_cpu = false;
  t->dirty_gpu = t->gpu_buf != NULL;
}

ut_tensor* ut_alloc(int ndim, const int* shape, ut_dev dev) {
  return ut_alloc_dtype(ndim, shape, dev, UT_F32);
}
ut_tensor* ut_alloc_dtype(int ndim, const int* shape, ut_dev dev, ut_dtype dtype) {
  ut_tensor* t = ut__new_typed(ndim, shape, dev, dtype, dtype == UT_F32 ? "ut_alloc" : "ut_alloc_dtype");
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
  if (t && dev == UT_CUDA) host = ut__host_alloc(ut__host_bytes(s.nelem));
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
    t->shared = true;
  } else {
    t->data = (float*)ptr;
  }
  atomic_fetch_add(&ut__live, 1);
  ut__count_bytes(t->shape.nelem, 1);
  return t;
}

/* rc stays a plain int (the bindings declare the struct), updated with atomic builtins so two
   threads may retain and free one tensor at once. */
ut_tensor* ut_retain(ut_tensor* t) {
  if (t) __atomic_fetch_add(&t->rc, 1, __ATOMIC_RELAXED);
  return t;
}

/* What the CPU backend derives from a tensor's values and keeps on it (ut_tensor.derived):
   a weight's GEMM panels, packed once (ut__cpu_gemm_f32). Each holder (the tensor, a GEMM
   using it) counts in rc, so a forward on another thread may replace the tensor's entry while
   this one still reads the old one. The entry is valid for the values at `version` and
   `view_closes`. */
typedef struct ut__packed {
  int rc;
  unsigned version, view_closes;
  int m, k, lda, MR, KC; /* op(A) [m, k], rows lda apart; MR-row panels of KC-deep blocks */
  void* raw;
  float* data;
} ut__packed;
/* Guards every tensor's `derived` pointer (held for a few loads and stores; the fork handlers
   take it, like the pool's and the generator's locks). */
static pthread_mutex_t ut__derived_lock = PTHREAD_MUTEX_INITIALIZER;
static void ut__packed_release(ut__packed* e) {
  if (e && __atomic_sub_fetch(&e->rc, 1, __ATOMIC_ACQ_REL) == 0) {
    free(e->raw);
    free(e);
  }
}

void ut_free(ut_tensor* t) {
  if (!t || __atomic_sub_fetch(&t->rc, 1, __ATOMIC_ACQ_REL) > 0) return;
  ut__packed_release((ut__packed*)t->derived);
  bool own_gpu = !(t->borrowed && t->dev == UT_CUDA), own_host = !(t->borrowed && t->dev == UT_CPU);
  if (t->gpu_buf && own_gpu) {
    const ut__backend* gpu = ut__cuda_backend();
    if (gpu) gpu->mem_free(t->gpu_buf);
  }
  if (own_host) ut__host_release(t->data, ut__host_bytes(t->shape.nelem));
  if (t->release) t->release(t->release_ctx);
  ut__count_bytes(t->shape.nelem, -1);
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
  /* a struct whose shape was overwritten would send the kernels past its buffer */
  long long n = 1;
  for (int i = 0; i < t->shape.ndim && n <= INT_MAX; i++)
    n *= t->shape.shape[i] >= 1 ? t->shape.shape[i] : (long long)INT_MAX + 1;
  UT__CHECK(n == t->shape.nelem, UT_ERR_ARG,
            "%s: %s is not a live tensor (its shape does not match its %d elements)", who, name,
            t->shape.nelem);
  return UT_OK;
}

int ut_track_writes(ut_tensor* t) {
  UT__TRY(ut__check_tensor(t, "ut_track_writes", "t"));
  UT__CHECK(!t->borrowed, UT_ERR_ARG,
            "ut_track_writes: the memory of a wrapped tensor (ut_wrap) is written by its owner");
  __atomic_store_n(&t->tracked, true, __ATOMIC_RELEASE);
  return UT_OK;
}
int ut_view_open(ut_tensor* t) {
  UT__TRY(ut__check_tensor(t, "ut_view_open", "t"));
  __atomic_fetch_add(&t->views, 1, __ATOMIC_ACQ_REL);
  return UT_OK;
}
int ut_view_close(ut_tensor* t) {
  UT__TRY(ut__check_tensor(t, "ut_view_close", "t"));
  UT__CHECK(__atomic_load_n(&t->views, __ATOMIC_ACQUIRE) > 0, UT_ERR_ARG,
            "ut_view_close: the tensor has no open view");
  /* the count of closes first: whoever sees the view closed sees the new count too */
  __atomic_fetch_add(&t->view_closes, 1u, __ATOMIC_ACQ_REL);
  __atomic_fetch_sub(&t->views, 1, __ATOMIC_ACQ_REL);
  return UT_OK;
}
/* Two arguments an op reads and writes in an order that needs them apart. */
/* The one rule for a learning rate, in every optimizer: finite and >= 0 (0 freezes the weights,
   as in PyTorch). The Python layer applies the same rule up front (_args.to_lr). */
static int ut__check_lr(float lr, const char* who) {
  UT__CHECK(isfinite(lr) && lr >= 0.f, UT_ERR_ARG, "%s: lr must be finite and >= 0", who);
  return UT_OK;
}

static int ut__check_distinct(const ut_tensor* a, const ut_tensor* b, const char* who,
                              const char* an, const char* bn) {
  UT__CHECK(!a || !b || (a != b && a->data != b->data && (!a->gpu_buf || a->gpu_buf != b->gpu_buf)),
            UT_ERR_ARG, "%s: %s and %s must be different tensors", who, an, bn);
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
/* The element type of t's buffer on be's side, the dt a backend slot takes (see ut_dtype and
   BACKEND INTERFACE): t's dtype on a device backend; float32 on the CPU, which computes a bf16
   tensor on its float32 host copy (ut__wrote rounds what it wrote). Arguments that must be
   float32 (parameters, gradients, statistics, what an op does not take in bf16) are checked
   with ut__check_f32. */
static ut_dtype ut__buf_dtype(const ut_tensor* t, const ut__backend* be) {
  return ut__is_device_backend(be) ? t->dtype : UT_F32;
}
static int ut__check_f32(const ut_tensor* t, const char* who, const char* name) {
  UT__CHECK(!t || t->dtype == UT_F32, UT_ERR_ARG,
            "%s: %s is %s, and it must be float32 here (bfloat16 is for activations: convert "
            "with ut_to_dtype)", who, name, ut_dtype_name(t->dtype));
  return UT_OK;
}
/* the activations of one op (input, grad_out, a cache's input) share their dtype */
static int ut__check_dtype_as(const ut_tensor* t, const ut_tensor* ref, const char* who,
                              const char* name, const char* ref_name) {
  UT__CHECK(!t || !ref || t->dtype == ref->dtype, UT_ERR_ARG,
            "%s: %s is %s but %s is %s (they must match)", who, name, ut_dtype_name(t->dtype),
            ref_name, ut_dtype_name(ref->dtype));
  return UT_OK;
}
static bool ut__same_shape(const ut_tensor* a, const ut_tensor* b) {
  if (a->shape.ndim != b->shape.ndim) return false;
  for (int i = 0; i < a->shape.ndim; i++)
    if (a->shape.shape[i] != b->shape.shape[i]) return false;
  return true;
}
/* A shape as messages print it, "[2, 3, 4]": `ut__shape_text(t).s` lives to the end of the
   statement that formats the message. The bindings raise these messages as they are, so they
   name the shape the caller passed rather than only the rule it broke. */
typedef struct ut__shape_str {
  char s[UT_MAX_DIMS * 13 + 3];
} ut__shape_str;
static ut__shape_str ut__shape_text(const ut_tensor* t) {
  ut__shape_str r = {"["};
  size_t n = 1;
  for (int i = 0; i < t->shape.ndim && i < UT_MAX_DIMS; i++)
    n += (size_t)snprintf(r.s + n, sizeof r.s - n, i ? ", %d" : "%d", t->shape.shape[i]);
  snprintf(r.s + n, sizeof r.s - n, "]");
  return r;
}

/* ---- the host/device mirror --------------------------------------------------------------- */
/* A bf16 tensor's values cross as bf16 (half the bytes) and are widened or rounded on the host
   in a staging buffer; float32 values cross as they are. */
static int ut__download_values(const ut__backend* gpu, ut_tensor* t) {
  size_t n = (size_t)t->shape.nelem;
  if (t->dtype == UT_F32) return gpu->download(t->data, t->gpu_buf, n * sizeof(float));
  uint16_t* h = (uint16_t*)malloc(n * 2 + 2);
  UT__CHECK(h, UT_ERR_MEMORY, "downloading a bfloat16 tensor: out of host memory");
  int rc = gpu->download((float*)h, t->gpu_buf, n * 2);
  if (rc >= 0)
    for (size_t i = 0; i < n; i++) t->data[i] = ut__bf16_float(h[i]);
  free(h);
  return rc;
}
static int ut__upload_values(const ut__backend* gpu, ut_tensor* t) {
  size_t n = (size_t)t->shape.nelem;
  if (t->dtype == UT_F32) return gpu->upload(t->gpu_buf, t->data, n * sizeof(float));
  uint16_t* h = (uint16_t*)malloc(n * 2 + 2);
  UT__CHECK(h, UT_ERR_MEMORY, "uploading a bfloat16 tensor: out of host memory");
  for (size_t i = 0; i < n; i++) h[i] = ut__bf16_bits(t->data[i]);
  int rc = gpu->upload(t->gpu_buf, (const float*)h, n * 2);
  free(h);
  return rc;
}
static int ut__download(ut_tensor* t) {
  /* A shared device copy may have been written behind the mirror's back: read it again, unless
     the host holds a write not yet pushed. */
  if (t->gpu_buf && (t->dirty_cpu || (t->shared && !t->dirty_gpu))) {
    const ut__backend* gpu = ut__cuda_backend();
    UT__CHECK(gpu, UT_ERR_DEVICE, "ut_sync_cpu: the tensor's GPU copy is unreachable");
    UT__CHECK(!ut__recording_now(), UT_ERR_ARG,
              "reading a GPU tensor on the host while a CUDA graph is recorded: its value is "
              "not computed yet (read it after ut_cuda_graph_end, or after a replay)");
    UT__TRY(ut__download_values(gpu, t));
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
    UT__CHECK(!ut__recording_now(), UT_ERR_ARG,
              "uploading a tensor written on the host while a CUDA graph is recorded: a replay "
              "would not repeat it (put inputs on the GPU before ut_cuda_graph_begin; a replay "
              "uploads recorded tensors changed on the host)");
    UT__TRY(ut__upload_values(gpu, t));
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
    void* buf = be->mem_alloc(ut__dev_bytes(t));
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
    ut__recording* r = ut__recording_now();
    if (r && ut__recording_gate(r, "a GPU op") < 0) return NULL;
    if (ut_sync_gpu(t) < 0) return NULL;
    if (r) ut__recording_note(r, t, UT__SEEN_READ);
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
  __atomic_fetch_add(&t->version, 1u, __ATOMIC_RELAXED);
  if (ut__is_device_backend(be)) {
    ut__recording* r = ut__recording_now();
    if (r && pthread_equal(r->thread, pthread_self())) ut__recording_note(r, t, UT__SEEN_WROTE);
    t->dirty_cpu = true;
    t->dirty_gpu = false;
  } else {
    /* the CPU computes a bf16 tensor's values in float: store what bf16 holds */
    if (t->dtype == UT_BF16) ut__cpu_bf16_round(t->data, t->shape.nelem);
    t->dirty_cpu = false;
    t->dirty_gpu = t->gpu_buf != NULL;
  }
}
/* Release a tensor and return NULL: for `return ut__drop(out);` on a failure path. */
static ut_tensor* ut__drop(ut_tensor* t) {
  ut_free(t);
  return NULL;
}
/* The end of every layer backward: on failure (rc < 0) free dx and return NULL; else mark
   dx and the gradients the backend accumulated into (dW, db where dWp, dbp were taken) as
   written and return dx. dx is NULL when the backward made none (ut_conv2d_backward_params). */
static ut_tensor* ut__backward_done(int rc, const ut__backend* be, ut_tensor* dx, ut_tensor* dW,
                                    const float* dWp, ut_tensor* db, const float* dbp) {
  if (rc < 0) return ut__drop(dx);
  if (dWp) ut__wrote(dW, be);
  if (dbp) ut__wrote(db, be);
  if (dx) ut__wrote(dx, be);
  return dx;
}
/* Run one backend call that wrote `out`: on failure free out and return NULL. */
static ut_tensor* ut__finish(ut_tensor* out, const ut__backend* be, int rc) {
  if (rc < 0) return ut__drop(out);
  ut__wrote(out, be);
  return out;
}

/* ---- captured GPU work (CUDA graphs) ------------------------------------------------------- */
struct ut_cuda_graph {
  void* g;          /* the backend's */
  ut_tensor** t;    /* what a replay refreshes, held until ut_cuda_graph_free */
  unsigned char* how;
  void** buf;       /* t[i]'s device buffer when recorded: the memory the replay touches */
  size_t n;
};

static void ut__recording_free(ut__recording* r) {
  for (size_t i = 0; i < r->n; i++) ut_free(r->t[i]);
  free(r->t);
  free(r->how);
  free(r);
}

int ut_cuda_graph_begin(void) {
  const ut__backend* gpu = ut__cuda_backend();
  UT__CHECK(gpu, UT_ERR_DEVICE, "ut_cuda_graph_begin: no CUDA device is available");
  ut__recording* r = (ut__recording*)calloc(1, sizeof *r);
  UT__CHECK(r, UT_ERR_MEMORY, "ut_cuda_graph_begin: out of host memory");
  r->thread = pthread_self();
  pthread_mutex_lock(&ut__rec_lock);
  int rc = ut__rec ? ut__set_error(UT_ERR_ARG, "ut_cuda_graph_begin: a CUDA graph is being "
                                               "recorded already (one at a time)")
                   : gpu->graph_begin();
  if (rc >= 0) __atomic_store_n(&ut__rec, r, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&ut__rec_lock);
  if (rc < 0) free(r);
  return rc;
}

static int ut__cmp_seen(const void* a, const void* b) {
  uintptr_t x = (uintptr_t) * (ut_tensor* const*)a, y = (uintptr_t) * (ut_tensor* const*)b;
  return x < y ? -1 : x > y;
}

ut_cuda_graph* ut_cuda_graph_end(void) {
  const ut__backend* gpu = ut__cuda_backend();
  UT__CHECK_NULL(gpu, UT_ERR_DEVICE, "ut_cuda_graph_end: no CUDA device is available");
  pthread_mutex_lock(&ut__rec_lock);
  ut__recording* r = ut__rec;
  if (!r || !pthread_equal(r->thread, pthread_self())) {
    pthread_mutex_unlock(&ut__rec_lock);
    ut__set_error(UT_ERR_ARG, "ut_cuda_graph_end: %s",
                  r ? "the recording was begun by another thread"
                    : "no CUDA graph is being recorded (ut_cuda_graph_begin first)");
    return NULL;
  }
  void* g = NULL;
  int rc = gpu->graph_end(&g);
  __atomic_store_n(&ut__rec, NULL, __ATOMIC_RELEASE);
  struct ut_cuda_graph** late = ut__graphs_freed_late;
  size_t nlate = ut__graphs_freed_late_n;
  ut__graphs_freed_late = NULL;
  ut__graphs_freed_late_n = 0;
  pthread_mutex_unlock(&ut__rec_lock);
  for (size_t i = 0; i < nlate; i++) ut_cuda_graph_free(late[i]);
  free(late);
  if (rc < 0) {
    ut__recording_free(r);
    return NULL;
  }
  /* one entry per tensor with its sightings merged */
  ut_cuda_graph* out = (ut_cuda_graph*)calloc(1, sizeof *out);
  ut_tensor** t = (ut_tensor**)malloc((r->n ? r->n : 1) * sizeof *t);
  unsigned char* how = (unsigned char*)calloc(r->n ? r->n : 1, 1);
  void** buf = (void**)malloc((r->n ? r->n : 1) * sizeof *buf);
  if (r->oom || !out || !t || !how || !buf) {
    free(out);
    free(t);
    free(how);
    free(buf);
    gpu->graph_free(g);
    ut__recording_free(r);
    ut__set_error(UT_ERR_MEMORY, "ut_cuda_graph_end: out of host memory");
    return NULL;
  }
  if (r->n) memcpy(t, r->t, r->n * sizeof *t);
  qsort(t, r->n, sizeof *t, ut__cmp_seen);
  size_t u = 0;
  for (size_t i = 0; i < r->n; i++)
    if (u == 0 || t[u - 1] != t[i]) t[u++] = t[i];
  for (size_t i = 0; i < r->n; i++) {
    ut_tensor** hit = (ut_tensor**)bsearch(&r->t[i], t, u, sizeof *t, ut__cmp_seen);
    how[hit - t] |= r->how[i];
  }
  /* the graph's own reference to each, then the sightings' go; temporaries (born inside the
     recording and held by nobody else now) are let go as well */
  for (size_t i = 0; i < u; i++) ut_retain(t[i]);
  for (size_t i = 0; i < r->n; i++) ut_free(r->t[i]);
  size_t kept = 0;
  for (size_t i = 0; i < u; i++) {
    if ((how[i] & UT__SEEN_BORN) && __atomic_load_n(&t[i]->rc, __ATOMIC_ACQUIRE) == 1) {
      ut_free(t[i]);
      continue;
    }
    t[kept] = t[i];
    buf[kept] = t[i]->gpu_buf;
    how[kept++] = how[i];
  }
  free(r->t);
  free(r->how);
  free(r);
  out->g = g;
  out->t = t;
  out->how = how;
  out->buf = buf;
  out->n = kept;
  return out;
}

int ut_cuda_graph_replay(ut_cuda_graph* g) {
  UT__CHECK(g && g->g, UT_ERR_ARG, "ut_cuda_graph_replay: graph is NULL or freed");
  UT__CHECK(!ut__recording_now(), UT_ERR_ARG,
            "ut_cuda_graph_replay: a CUDA graph is being recorded (replay after its end)");
  const ut__backend* gpu = ut__cuda_backend();
  /* a held tensor moved to the CPU or cast since has given its device buffer back (to the
     cache, or the driver): the replay would write memory it no longer owns */
  for (size_t i = 0; i < g->n; i++)
    UT__CHECK(g->t[i]->dev == UT_CUDA && g->t[i]->gpu_buf == g->buf[i], UT_ERR_ARG,
              "ut_cuda_graph_replay: a tensor the graph uses has left its device memory since "
              "the recording (moved to the CPU or to another dtype): record the step again");
  for (size_t i = 0; i < g->n; i++)
    if (g->how[i] & UT__SEEN_READ) UT__TRY(ut_sync_gpu(g->t[i]));
  UT__TRY(gpu->graph_replay(g->g));
  for (size_t i = 0; i < g->n; i++)
    if (g->how[i] & UT__SEEN_WROTE) {
      ut_tensor* t = g->t[i];
      __atomic_fetch_add(&t->version, 1u, __ATOMIC_RELAXED);
      t->dirty_cpu = true;
      t->dirty_gpu = false;
    }
  return UT_OK;
}

void ut_cuda_graph_free(ut_cuda_graph* g) {
  if (!g) return;
  pthread_mutex_lock(&ut__rec_lock);
  if (ut__rec) {
    ut_cuda_graph** late = (ut_cuda_graph**)realloc(
        ut__graphs_freed_late, (ut__graphs_freed_late_n + 1) * sizeof *late);
    if (late) {
      ut__graphs_freed_late = late;
      late[ut__graphs_freed_late_n++] = g;
      pthread_mutex_unlock(&ut__rec_lock);
      return;
    }
    /* no memory to defer it: its memory is kept, which is safe, and its references go */
    pthread_mutex_unlock(&ut__rec_lock);
    for (size_t i = 0; i < g->n; i++) ut_free(g->t[i]);
    g->n = 0;
    return;
  }
  pthread_mutex_unlock(&ut__rec_lock);
  const ut__backend* gpu = ut__cuda_backend();
  if (gpu && g->g) gpu->graph_free(g->g);
  for (size_t i = 0; i < g->n; i++) ut_free(g->t[i]);
  free(g->t);
  free(g->how);
  free(g->buf);
  free(g);
}

/* ---- several processes: NCCL ------------------------------------------------------------ */
static char ut__nccl_hint_path[4096];

int ut_nccl_hint(const char* path) {
  UT__CHECK(path, UT_ERR_ARG, "ut_nccl_hint: NULL path");
  UT__CHECK(strlen(path) < sizeof ut__nccl_hint_path, UT_ERR_ARG,
            "ut_nccl_hint: the path is longer than %d bytes", (int)sizeof ut__nccl_hint_path - 1);
  pthread_mutex_lock(&ut__cublas_hint_lock);
  strcpy(ut__nccl_hint_path, path);
  pthread_mutex_unlock(&ut__cublas_hint_lock);
  return UT_OK;
}
void ut__nccl_hint_copy(char* out, size_t n) {
  pthread_mutex_lock(&ut__cublas_hint_lock);
  snprintf(out, n, "%s", ut__nccl_hint_path);
  pthread_mutex_unlock(&ut__cublas_hint_lock);
}
const char* ut_nccl_info(void) {
  const ut__backend* gpu = ut__cuda_backend();
  return gpu ? gpu->nccl_info() : "no CUDA device: NCCL is not used";
}

struct ut_dist {
  void* comm;
  int world_size, rank;
};

int ut_dist_unique_id(unsigned char* id) {
  UT__CHECK(id, UT_ERR_ARG, "ut_dist_unique_id: NULL id");
  const ut__backend* gpu = ut__cuda_backend();
  UT__CHECK(gpu, UT_ERR_DEVICE, "ut_dist_unique_id: no CUDA device is available");
  return gpu->dist_unique_id(id);
}

ut_dist* ut_dist_init(int world_size, int rank, const unsigned char* id) {
  UT__CHECK_NULL(id, UT_ERR_ARG, "ut_dist_init: NULL id");
  UT__CHECK_NULL(world_size >= 1, UT_ERR_ARG, "ut_dist_init: world_size must be >= 1, got %d",
                 world_size);
  UT__CHECK_NULL(rank >= 0 && rank < world_size, UT_ERR_ARG,
                 "ut_dist_init: rank %d is not in [0, %d)", rank, world_size);
  const ut__backend* gpu = ut__cuda_backend();
  UT__CHECK_NULL(gpu, UT_ERR_DEVICE, "ut_dist_init: no CUDA device is available");
  ut_dist* d = (ut_dist*)calloc(1, sizeof *d);
  UT__CHECK_NULL(d, UT_ERR_MEMORY, "ut_dist_init: out of host memory");
  if (gpu->dist_init(world_size, rank, id, &d->comm) < 0) {
    free(d);
    return NULL;
  }
  d->world_size = world_size;
  d->rank = rank;
  return d;
}

static int ut__dist_tensor(ut_dist* d, ut_tensor* t, const char* who, const ut__backend** gpu) {
  UT__CHECK(d && d->comm, UT_ERR_ARG, "%s: the group is NULL or freed", who);
  UT__TRY(ut__check_tensor(t, who, "t"));
  UT__CHECK(t->dev == UT_CUDA, UT_ERR_DEVICE, "%s: t must be a GPU tensor (NCCL moves GPU memory)",
            who);
  UT__TRY(ut__check_f32(t, who, "t"));
  *gpu = ut__cuda_backend();
  UT__CHECK(*gpu, UT_ERR_DEVICE, "%s: no CUDA device is available", who);
  return UT_OK;
}

int ut_dist_all_reduce(ut_dist* d, ut_tensor* t, bool average) {
  const ut__backend* gpu;
  UT__TRY(ut__dist_tensor(d, t, "ut_dist_all_reduce", &gpu));
  float* p = ut__inout(t, gpu);
  if (!p) return ut__err_status;
  UT__TRY(gpu->dist_all_reduce(d->comm, p, t->shape.nelem, average));
  ut__wrote(t, gpu);
  return UT_OK;
}

int ut_dist_broadcast(ut_dist* d, ut_tensor* t, int root) {
  const ut__backend* gpu;
  UT__TRY(ut__dist_tensor(d, t, "ut_dist_broadcast", &gpu));
  UT__CHECK(root >= 0 && root < d->world_size, UT_ERR_ARG,
            "ut_dist_broadcast: root %d is not in [0, %d)", root, d->world_size);
  float* p = ut__inout(t, gpu);
  if (!p) return ut__err_status;
  UT__TRY(gpu->dist_broadcast(d->comm, p, t->shape.nelem, root));
  ut__wrote(t, gpu);
  return UT_OK;
}

int ut_dist_check(ut_dist* d) {
  UT__CHECK(d && d->comm, UT_ERR_ARG, "ut_dist_check: the group is NULL, freed or aborted");
  return ut__cuda_backend()->dist_check(d->comm);
}

int ut_dist_wait(ut_dist* d, double timeout_s) {
  UT__CHECK(d && d->comm, UT_ERR_ARG, "ut_dist_wait: the group is NULL, freed or aborted");
  UT__CHECK(timeout_s > 0.0 && timeout_s <= 1e9, UT_ERR_ARG,
            "ut_dist_wait: timeout_s must be in (0, 1e9] seconds, got %g", timeout_s);
  UT__CHECK(!ut__recording_now(), UT_ERR_ARG,
            "ut_dist_wait: waiting for the GPU while a CUDA graph is recorded: the recorded "
            "work has not run (wait after ut_cuda_graph_end, or after a replay)");
  bool aborted = false;
  int rc = ut__cuda_backend()->dist_wait(d->comm, timeout_s, &aborted);
  if (aborted) d->comm = NULL; /* NCCL freed it; ut_dist_free then frees only d */
  return rc;
}

int ut_dist_sum(void* d, ut_tensor* t) { return ut_dist_all_reduce((ut_dist*)d, t, false); }

static void ut__dist_leave(ut_dist* d, bool abort) {
  if (!d) return;
  const ut__backend* gpu = ut__cuda_backend();
  if (gpu && d->comm) gpu->dist_free(d->comm, abort);
  free(d);
}
void ut_dist_free(ut_dist* d) { ut__dist_leave(d, false); }
void ut_dist_abort(ut_dist* d) { ut__dist_leave(d, true); }

/* ---- whole-tensor utilities --------------------------------------------------------------- */
/* dst = src converted to dst's dtype, both checked, on dst's backend (on the CPU a float32
   copy, which ut__wrote rounds for a bf16 dst) */
static int ut__convert(ut_tensor* dst, ut_tensor* src, const ut__backend* be) {
  const float* s = ut__in(src, be);
  if (!s) return ut__err_status;
  UT__TRY(be->cast(ut__buf_dtype(src, be), ut__buf_dtype(dst, be), s, ut__out(dst, be),
                   dst->shape.nelem));
  ut__wrote(dst, be);
  return UT_OK;
}

static ut_tensor* ut__to_dtype(ut_tensor* t, ut_dtype dtype, const char* who) {
  if (ut__check_tensor(t, who, "t") < 0) return NULL;
  ut_tensor* out = ut__new_typed(t->shape.ndim, t->shape.shape, t->dev, dtype, who);
  if (!out) return NULL;
  if (ut__convert(out, t, ut__backend_for(t->dev)) < 0) return ut__drop(out);
  return out;
}
ut_tensor* ut_to_dtype(ut_tensor* t, ut_dtype dtype) { return ut__to_dtype(t, dtype, "ut_to_dtype"); }
ut_tensor* ut_copy(ut_tensor* t) {
  if (ut__check_tensor(t, "ut_copy", "t") < 0) return NULL;
  return ut__to_dtype(t, t->dtype, "ut_copy");
}

int ut_copy_into(ut_tensor* dst, ut_tensor* src) {
  UT__TRY(ut__check_tensor(dst, "ut_copy_into", "dst"));
  UT__TRY(ut__check_arg(src, dst, dst->shape.nelem, "ut_copy_into", "src"));
  if (dst == src) return UT_OK;
  return ut__convert(dst, src, ut__backend_for(dst->dev));
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
  UT__TRY(ut__device_gate(be, "ut_fill"));
  UT__TRY(be->fill(ut__buf_dtype(t, be), ut__out(t, be), t->shape.nelem, value));
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
  ut_tensor* out = ut__new_typed(nd, oshape, t->dev, t->dtype, "ut_transpose");
  if (!out) return NULL;
  return ut__finish(out, be, be->transpose(ut__buf_dtype(t, be), src, ut__out(out, be), outer,
                                           sh[d0], mid, sh[d1], inner));
}

/* ---- elementwise -------------------------------------------------------------------------- */
static ut_tensor* ut__relu_fwd(ut_tensor* x, float cap, const char* who) {
  if (ut__check_tensor(x, who, "x") < 0) return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  if (!xp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  if (!y) return NULL;
  return ut__finish(y, be,
                    be->relu_fwd(ut__buf_dtype(x, be), xp, ut__out(y, be), x->shape.nelem, cap));
}
ut_tensor* ut_relu(ut_tensor* x) { return ut__relu_fwd(x, 0.f, "ut_relu"); }
ut_tensor* ut_relu6(ut_tensor* x) { return ut__relu_fwd(x, 6.f, "ut_relu6"); }

static ut_tensor* ut__relu_bwd(ut_tensor* go, ut_tensor* x, float cap, const char* who) {
  if (ut__check_tensor(go, who, "grad_out") < 0 || ut__check_arg(x, go, -1, who, "fwd_input") < 0)
    return NULL;
  UT__CHECK_NULL(ut__same_shape(go, x), UT_ERR_SHAPE,
                 "%s: grad_out has shape %s but fwd_input has shape %s (they must match)", who,
                 ut__shape_text(go).s, ut__shape_text(x).s);
  if (ut__check_dtype_as(x, go, who, "fwd_input", "grad_out") < 0) return NULL;
  const ut__backend* be = ut__backend_for(go->dev);
  const float* gp = ut__in(go, be);
  const float* xp = gp ? ut__in(x, be) : NULL;
  if (!xp) return NULL;
  ut_tensor* gi = ut__new_like(go, who);
  if (!gi) return NULL;
  return ut__finish(gi, be, be->relu_bwd(ut__buf_dtype(go, be), gp, xp, ut__out(gi, be),
                                         go->shape.nelem, cap));
}
ut_tensor* ut_relu_backward(ut_tensor* grad_out, ut_tensor* fwd_input) {
  return ut__relu_bwd(grad_out, fwd_input, 0.f, "ut_relu_backward");
}
ut_tensor* ut_relu6_backward(ut_tensor* grad_out, ut_tensor* fwd_input) {
  return ut__relu_bwd(grad_out, fwd_input, 6.f, "ut_relu6_backward");
}

/* ---- activations (issue 30) ---------------------------------------------------------------- */
static const char* const ut__act_names[] = {"none",    "relu",        "relu6",
                                            "silu",    "hardswish",   "hardsigmoid",
                                            "sigmoid", "gelu",        "gelu_tanh"};
/* the entry points' names with the kind, so a message says which activation refused */
static const char* const ut__act_fwd_who[] = {
    "ut_activation_forward(none)",        "ut_activation_forward(relu)",
    "ut_activation_forward(relu6)",       "ut_activation_forward(silu)",
    "ut_activation_forward(hardswish)",   "ut_activation_forward(hardsigmoid)",
    "ut_activation_forward(sigmoid)",     "ut_activation_forward(gelu)",
    "ut_activation_forward(gelu_tanh)"};
static const char* const ut__act_bwd_who[] = {
    "ut_activation_backward(none)",       "ut_activation_backward(relu)",
    "ut_activation_backward(relu6)",      "ut_activation_backward(silu)",
    "ut_activation_backward(hardswish)",  "ut_activation_backward(hardsigmoid)",
    "ut_activation_backward(sigmoid)",    "ut_activation_backward(gelu)",
    "ut_activation_backward(gelu_tanh)"};

static bool ut__act_valid(int a) { return a >= UT_ACT_NONE && a <= UT_ACT_GELU_TANH; }

const char* ut_activation_name(ut_activation a) {
  return ut__act_valid((int)a) ? ut__act_names[a] : "?";
}

ut_tensor* ut_activation_forward(ut_tensor* x, ut_activation a) {
  UT__CHECK_NULL(ut__act_valid((int)a), UT_ERR_ARG,
                 "ut_activation_forward: a must be a ut_activation (%d to %d), got %d",
                 UT_ACT_NONE, UT_ACT_GELU_TANH, (int)a);
  const char* who = ut__act_fwd_who[a];
  if (a == UT_ACT_RELU || a == UT_ACT_RELU6)
    return ut__relu_fwd(x, a == UT_ACT_RELU6 ? 6.f : 0.f, who);
  if (ut__check_tensor(x, who, "x") < 0) return NULL;
  if (a == UT_ACT_NONE) return ut_copy(x);
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  if (!xp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  if (!y) return NULL;
  return ut__finish(y, be, be->act_fwd(ut__buf_dtype(x, be), (int)a, xp, ut__out(y, be),
                                       x->shape.nelem));
}

ut_tensor* ut_activation_backward(ut_tensor* grad_out, ut_tensor* fwd_input, ut_activation a) {
  UT__CHECK_NULL(ut__act_valid((int)a), UT_ERR_ARG,
                 "ut_activation_backward: a must be a ut_activation (%d to %d), got %d",
                 UT_ACT_NONE, UT_ACT_GELU_TANH, (int)a);
  const char* who = ut__act_bwd_who[a];
  if (a == UT_ACT_RELU || a == UT_ACT_RELU6)
    return ut__relu_bwd(grad_out, fwd_input, a == UT_ACT_RELU6 ? 6.f : 0.f, who);
  ut_tensor* go = grad_out;
  ut_tensor* x = fwd_input;
  if (ut__check_tensor(go, who, "grad_out") < 0 || ut__check_arg(x, go, -1, who, "fwd_input") < 0)
    return NULL;
  UT__CHECK_NULL(ut__same_shape(go, x), UT_ERR_SHAPE,
                 "%s: grad_out has shape %s but fwd_input has shape %s (they must match)", who,
                 ut__shape_text(go).s, ut__shape_text(x).s);
  if (ut__check_dtype_as(x, go, who, "fwd_input", "grad_out") < 0) return NULL;
  if (a == UT_ACT_NONE) return ut_copy(go);
  const ut__backend* be = ut__backend_for(go->dev);
  const float* gp = ut__in(go, be);
  const float* xp = gp ? ut__in(x, be) : NULL;
  if (!xp) return NULL;
  ut_tensor* gi = ut__new_like(go, who);
  if (!gi) return NULL;
  return ut__finish(gi, be, be->act_bwd(ut__buf_dtype(go, be), (int)a, gp, xp, ut__out(gi, be),
                                        go->shape.nelem));
}

int ut_add_into(ut_tensor* dst, ut_tensor* src) {
  UT__TRY(ut__check_tensor(dst, "ut_add_into", "dst"));
  UT__TRY(ut__check_arg(src, dst, dst->shape.nelem, "ut_add_into", "src"));
  UT__TRY(ut__check_dtype_as(src, dst, "ut_add_into", "src", "dst"));
  const ut__backend* be = ut__backend_for(dst->dev);
  const float* s = ut__in(src, be);
  float* d = s ? ut__inout(dst, be) : NULL;
  if (!d) return ut__err_status;
  UT__TRY(be->axpy(ut__buf_dtype(dst, be), d, s, dst->shape.nelem, 1.f));
  ut__wrote(dst, be);
  return UT_OK;
}

int ut_scale(ut_tensor* t, float alpha) {
  UT__TRY(ut__check_tensor(t, "ut_scale", "t"));
  const ut__backend* be = ut__backend_for(t->dev);
  float* p = ut__inout(t, be);
  if (!p) return ut__err_status;
  UT__TRY(be->scale(ut__buf_dtype(t, be), p, t->shape.nelem, alpha));
  ut__wrote(t, be);
  return UT_OK;
}

/* ---- dense -------------------------------------------------------------------------------- */
ut_tensor* ut_matmul(ut_tensor* a, ut_tensor* b) {
  const char* who = "ut_matmul";
  if (ut__check_tensor(a, who, "a") < 0 || ut__check_arg(b, a, -1, who, "b") < 0 ||
      ut__check_f32(a, who, "a") < 0 || ut__check_f32(b, who, "b") < 0)
    return NULL;
  UT__CHECK_NULL(a->shape.ndim == 2 && b->shape.ndim == 2 && b->shape.shape[0] == a->shape.shape[1],
                 UT_ERR_SHAPE, "%s: cannot multiply a %s by b %s (a must be [M, K], b [K, N])",
                 who, ut__shape_text(a).s, ut__shape_text(b).s);
  int M = a->shape.shape[0], K = a->shape.shape[1], N = b->shape.shape[1];
  const ut__backend* be = ut__backend_for(a->dev);
  const float* ap = ut__in(a, be);
  const float* bp = ap ? ut__in(b, be) : NULL;
  if (!bp) return NULL;
  ut_tensor* c = ut__new(2, (int[]){M, N}, a->dev, who);
  if (!c) return NULL;
  ut__gemm_args g = {.m = M, .n = N, .k = K, .batch = 1, .alpha = 1.f, .beta = 0.f,
                     .a = ap, .lda = K, .b = bp, .ldb = N, .c = ut__out(c, be), .ldc = N};
  return ut__finish(c, be, be->gemm(UT_F32, UT_F32, &g));
}

int ut_bias_add(ut_tensor* x, ut_tensor* bias) {
  const char* who = "ut_bias_add";
  UT__TRY(ut__check_tensor(x, who, "x"));
  UT__CHECK(x->shape.ndim >= 2, UT_ERR_SHAPE, "%s: x must be [N, C, ...], got shape %s", who,
            ut__shape_text(x).s);
  int C = x->shape.shape[1];
  UT__TRY(ut__check_arg(bias, x, C, who, "bias"));
  UT__TRY(ut__check_f32(bias, who, "bias"));
  const ut__backend* be = ut__backend_for(x->dev);
  const float* bp = ut__in(bias, be);
  float* xp = bp ? ut__inout(x, be) : NULL;
  if (!xp) return ut__err_status;
  ut__i64 inner = (ut__i64)x->shape.nelem / ((ut__i64)x->shape.shape[0] * C);
  UT__TRY(be->bias_add(ut__buf_dtype(x, be), xp, bp, x->shape.shape[0], C, inner));
  ut__wrote(x, be);
  return UT_OK;
}

/* ---- convolutions ------------------------------------------------------------------------- */
/* x must be [N, c, H, W] and the window (kh x kw taps, dil apart) must fit the padded input;
   fills g. */
static int ut__conv_geometry(ut__conv_geom* g, const ut_tensor* x, int c, int out_c, int kh,
                             int kw, int stride, int pad, int dil, const char* who) {
  UT__CHECK(x->shape.ndim == 4, UT_ERR_SHAPE, "%s: x must be [N, C, H, W], got shape %s", who,
            ut__shape_text(x).s);
  UT__CHECK(x->shape.shape[1] == c, UT_ERR_SHAPE, "%s: x has %d channels, the layer expects %d",
            who, x->shape.shape[1], c);
  UT__CHECK(kh >= 1 && kw >= 1, UT_ERR_ARG, "%s: kernel size must be positive, got %dx%d", who, kh,
            kw);
  UT__CHECK(stride >= 1, UT_ERR_ARG, "%s: stride must be >= 1, got %d", who, stride);
  UT__CHECK(pad >= 0, UT_ERR_ARG, "%s: padding must be >= 0, got %d", who, pad);
  UT__CHECK(dil >= 1, UT_ERR_ARG, "%s: dilation must be >= 1, got %d", who, dil);
  long long H = x->shape.shape[2], W = x->shape.shape[3], Hp = H + 2LL * pad, Wp = W + 2LL * pad;
  long long eh = (kh - 1LL) * dil + 1, ew = (kw - 1LL) * dil + 1; /* the window's extent */
  if (dil == 1)
    UT__CHECK(Hp >= kh && Wp >= kw, UT_ERR_SHAPE,
              "%s: input %lldx%lld (padding %d) is smaller than the %dx%d kernel", who, H, W, pad,
              kh, kw);
  else
    UT__CHECK(Hp >= eh && Wp >= ew, UT_ERR_SHAPE,
              "%s: input %lldx%lld (padding %d) is smaller than the %dx%d kernel's window with "
              "dilation %d (%lldx%lld)",
              who, H, W, pad, kh, kw, dil, eh, ew);
  long long ho = (Hp - eh) / stride + 1, wo = (Wp - ew) / stride + 1;
  /* With one output pixel the stride is never applied: the kernels get stride 1, so that their
     int index arithmetic (iy + stride, phase rows of `stride` columns, ...) stays within the
     padded extent plus the stride. Otherwise stride <= the padded extent. */
  long long s = ho == 1 && wo == 1 ? 1 : stride;
  UT__CHECK(Hp + s <= INT_MAX && Wp + s <= INT_MAX, UT_ERR_SHAPE,
            "%s: the padded input %lldx%lld (padding %d) with stride %d is too large: padded "
            "height and width plus the stride must stay below 2^31",
            who, Hp, Wp, pad, stride);
  long long n = x->shape.shape[0]; /* each factor < 2^31: every product of two fits */
  UT__CHECK(ho * wo <= INT_MAX && n * out_c <= INT_MAX && ho * wo * (n * out_c) <= INT_MAX,
            UT_ERR_SHAPE,
            "%s: the output [%lld, %d, %lld, %lld] would have more than %d elements", who, n, out_c,
            ho, wo, INT_MAX);
  *g = (ut__conv_geom){.n = (int)n, .c = c, .h = (int)H, .w = (int)W, .kh = kh, .kw = kw,
                       .stride = (int)s, .pad = pad, .ho = (int)ho, .wo = (int)wo, .dil = dil};
  return UT_OK;
}

/* A layer's weight and optional bias: live, on one device, with the expected element counts. */
static int ut__check_params(const ut_tensor* w, const ut_tensor* b, long long wn, long long bn,
                            const char* who) {
  UT__TRY(ut__check_arg(w, NULL, wn, who, "the layer's weight"));
  UT__TRY(ut__check_f32(w, who, "the layer's weight"));
  if (b) UT__TRY(ut__check_arg(b, w, bn, who, "the layer's bias"));
  if (b) UT__TRY(ut__check_f32(b, who, "the layer's bias"));
  return UT_OK;
}
/* A GEMM layer (conv2d, linear) on bf16 activations multiplies by a bf16 copy of its float32
   weight, made per call: the weight is small next to the activations, and the optimizer keeps
   updating the float32 master. NULL + error on failure; on float32 activations the weight
   itself, retained. */
static ut_tensor* ut__gemm_weight(ut_tensor* w, const ut_tensor* x, const char* who) {
  if (x->dtype == UT_F32) return ut_retain(w);
  return ut__to_dtype(w, x->dtype, who);
}
static int ut__check_kernel_args(int kh, int kw, int stride, int pad, const char* who) {
  UT__CHECK(kh >= 1 && kw >= 1, UT_ERR_ARG, "%s: kernel size must be positive, got %dx%d", who, kh,
            kw);
  UT__CHECK(stride >= 1, UT_ERR_ARG, "%s: stride must be >= 1, got %d", who, stride);
  UT__CHECK(pad >= 0, UT_ERR_ARG, "%s: padding must be >= 0, got %d", who, pad);
  /* every input's padded extent (>= max(kernel, 2*padding + 1)) plus the stride must fit int */
  UT__CHECK(2LL * pad + 2 <= INT_MAX && kh < INT_MAX && kw < INT_MAX, UT_ERR_ARG,
            "%s: padding %d with a %dx%d kernel fits no input: 2*padding + 2 and the kernel size "
            "must stay below 2^31",
            who, pad, kh, kw);
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
                                   int stride, int pad, int dil, const ut_tensor* grad_out,
                                   const ut_tensor* dW, const ut_tensor* db, const char* who) {
  UT__CHECK(input, UT_ERR_ARG, "%s: the cache is empty (run forward with a cache first)", who);
  UT__TRY(ut__check_arg(input, w, -1, who, "cache->input"));
  UT__TRY(ut__conv_geometry(g, input, in_c, out_c, kh, kw, stride, pad, dil, who));
  UT__TRY(ut__check_arg(grad_out, w, -1, who, "grad_out"));
  UT__TRY(ut__check_dtype_as(grad_out, input, who, "grad_out", "cache->input"));
  UT__TRY(ut__check_arg(dW, w, w->shape.nelem, who, "dW"));
  UT__TRY(ut__check_f32(dW, who, "dW"));
  if (db && has_bias) UT__TRY(ut__check_arg(db, w, out_c, who, "db"));
  if (db && has_bias) UT__TRY(ut__check_f32(db, who, "db"));
  UT__TRY(ut__check_distinct(dW, w, who, "dW", "the layer's weight"));
  UT__TRY(ut__check_distinct(dW, grad_out, who, "dW", "grad_out"));
  UT__TRY(ut__check_distinct(dW, input, who, "dW", "cache->input"));
  if (db && has_bias) UT__TRY(ut__check_distinct(dW, db, who, "dW", "db"));
  const int* gs = grad_out->shape.shape;
  UT__CHECK(grad_out->shape.ndim == 4 && gs[0] == g->n && gs[1] == out_c && gs[2] == g->ho &&
                gs[3] == g->wo,
            UT_ERR_SHAPE, "%s: grad_out has shape %s, the forward output had [%d, %d, %d, %d]", who,
            ut__shape_text(grad_out).s, g->n, out_c, g->ho, g->wo);
  return UT_OK;
}

static bool ut__conv_is_pointwise(const ut__conv_geom* g) {
  return g->kh == 1 && g->kw == 1 && g->stride == 1 && g->pad == 0 && g->ho == g->h &&
         g->wo == g->w;
}
/* A pointwise convolution may run as one GEMM over the whole batch, W [out_c, c] . X [c, n*P],
   on inputs regrouped channel-major ([n, c, P] -> [c, n, P]) and its output regrouped back,
   where the per-image GEMMs [out_c, c] . [c, P] would be slow:
   - on the CPU over small images (late MobileNet layers: 7x7, 4x4, 2x2), P far under the
     micro-kernel's width;
   - on the GPU in bf16 where P is not a multiple of 8 (14x14, 7x7): the per-image rows are then
     not 16-byte aligned and cuBLAS picks kernels several times slower (MobileNet v1 at 224²,
     batch 256: 150 µs for a 14x14 512 -> 512 GEMM that takes under 50 µs aligned). The
     regrouping costs two transposes at memory speed per pass; the weight gradient then needs
     none (it is one GEMM over n*P).
   The float32 GEMMs on the GPU keep the per-image form: they have no such cliff. */
#define UT__PW_BATCH_MERGE_P 256
#define UT__PW_BATCH_MERGE_P_KEPT 128 /* the CPU's inference forward (its weight panels kept) */
static bool ut__conv_merges_batch(const ut__conv_geom* g, const ut__backend* be, ut_dtype dt) {
  if (!ut__conv_is_pointwise(g) || g->n <= 1) return false;
  ut__i64 P = (ut__i64)g->h * g->w;
  if (ut__is_device_backend(be)) return dt == UT_BF16 && P % 8 != 0;
  return P < UT__PW_BATCH_MERGE_P;
}
/* The same regrouping for a k x k convolution without padding on the CPU (ConvNeXt's 4x4
   stem and 2x2 downsampling): its im2col columns [n, K, P] regrouped [K, n, P] for the GEMMs
   only, the cache keeping the per-image columns. Over small planes the per-image GEMMs are
   as slow as a pointwise one's (P = 4 at ConvNeXt's last downsampling from 64^2: the [768, 1536]
   weight gradient was 8 GEMMs of depth 4, 27 ms of a 30 ms layer). With padding the per-image
   form stays: its exact pass (conv_exact) sums per image. */
static bool ut__conv_regroups_batch(const ut__conv_geom* g, const ut__backend* be) {
  return !ut__conv_is_pointwise(g) && g->pad == 0 && g->n > 1 && !ut__is_device_backend(be) &&
         (ut__i64)g->ho * g->wo < UT__PW_BATCH_MERGE_P;
}
/* The merged GEMM's columns: x [n, c, P] regrouped [c, n, P]; NULL on failure. */
static ut_tensor* ut__conv_batch_columns(const ut__backend* be, const float* xp,
                                         const ut__conv_geom* g, const ut_tensor* x,
                                         const char* who) {
  int P = g->ho * g->wo;
  ut_tensor* col = xp ? ut__new_typed(3, (int[]){g->c, g->n, P}, x->dev, x->dtype, who) : NULL;
  if (!col) return NULL;
  return ut__finish(col, be, be->transpose(ut__buf_dtype(x, be), xp, ut__out(col, be), 1, g->n,
                                           1, g->c, P));
}
/* A pointwise convolution's columns with each (image, channel) row scaled, x[n, c, P] s[n, c]:
   [n, c, P], or regrouped [c, n, P] when merged; on the CPU's threads (chan_scale, transpose). */
static ut_tensor* ut__conv_columns_scaled(const ut__backend* be, const float* xp, const float* s,
                                          const ut__conv_geom* g, bool merged, const ut_tensor* x,
                                          const char* who) {
  int P = g->ho * g->wo;
  ut_tensor* col = xp ? ut__new_typed(3, (int[]){g->n, g->c, P}, x->dev, x->dtype, who) : NULL;
  if (!col) return NULL;
  ut_dtype dt = ut__buf_dtype(x, be);
  col = ut__finish(col, be, be->chan_scale(dt, dt, xp, s, ut__out(col, be), g->n, g->c, P,
                                           false));
  if (!col || !merged) return col;
  ut_tensor* reg = ut__conv_batch_columns(be, ut__in(col, be), g, x, who);
  ut_free(col);
  return reg;
}
/* ws[n, o, k] = w[o, k] s[n, k]: a pointwise weight [out_c, kp] scaled per image and input
   channel (host memory). */
static void ut__scale_weight_columns(const float* w, const float* s, float* ws, int n, int out_c,
                                     int kp) {
  for (int i = 0; i < n; i++)
    for (int o = 0; o < out_c; o++) {
      const float* wr = w + (ut__i64)o * kp;
      const float* sr = s + (ut__i64)i * kp;
      float* dr = ws + ((ut__i64)i * out_c + o) * kp;
      for (int k = 0; k < kp; k++) dr[k] = wr[k] * sr[k];
    }
}
/* The rows of an image's im2col columns (g->kp). On the GPU in bf16 a depth K = c*kh*kw that
   is not a multiple of 8 (a 3-channel 3x3 stem: 27) leaves the weight's rows and the weight
   gradient's rows off 16-byte alignment, and cuBLAS then runs align-1 kernels: MobileNet v1's
   stem at 224^2, batch 256, took 0.68 ms of an 18 ms step in its forward and weight-gradient
   GEMMs. The columns then get zero rows up to a multiple of 8, the weight zero columns. */
static int ut__conv_col_rows(const ut__conv_geom* g, const ut__backend* be, ut_dtype dt) {
  int K = g->c * g->kh * g->kw;
  if (!ut__is_device_backend(be) || dt != UT_BF16 || ut__conv_is_pointwise(g) || K % 8 == 0)
    return K;
  long long kp = (K + 7LL) / 8 * 8;
  return kp * g->ho * g->wo * g->n > INT_MAX ? K : (int)kp; /* the columns stay indexable */
}
/* The weight [out_c, K] as the GEMM's [out_c, kp], zero past K; the weight itself (retained)
   when kp == K. Consumes wt (the layer's GEMM weight, ut__gemm_weight's). */
static ut_tensor* ut__conv_pad_weight(const ut__backend* be, ut_tensor* wt, int out_c, int K,
                                      int kp, const char* who) {
  if (!wt || kp == K) return wt;
  ut_tensor* wp = ut__new_typed(2, (int[]){out_c, kp}, wt->dev, wt->dtype, who);
  ut_dtype dt = ut__buf_dtype(wt, be);
  const float* src = ut__in(wt, be);
  float* dst = wp && src ? ut__out(wp, be) : NULL;
  int rc = dst ? be->fill(dt, dst, (ut__i64)out_c * kp, 0.f) : ut__err_status;
  if (rc >= 0) rc = be->copy2d(dt, src, K, dst, kp, out_c, K);
  ut_free(wt);
  return ut__finish(wp, be, rc);
}

/* The im2col buffer [n, c*kh*kw, ho*wo] of a convolution that needs one must be a tensor. */
static int ut__check_col(const ut__conv_geom* g, const char* who) {
  if (ut__conv_is_pointwise(g)) return UT_OK;
  long long K = (long long)g->c * g->kh * g->kw, P = (long long)g->ho * g->wo;
  UT__CHECK(K <= INT_MAX && K * P <= INT_MAX && K * P * g->n <= INT_MAX, UT_ERR_SHAPE,
            "%s: the im2col buffer [%d, %lld, %lld] would have more than %d elements", who, g->n,
            K, P, INT_MAX);
  return UT_OK;
}

/* Inference's fold of a BatchNorm into the convolution before it (ut_conv2d_bn_forward): per
   output channel, y = act(scale y + shift), in host memory (the CPU's). */
typedef struct ut__conv_epi {
  const float* scale;
  const float* shift;
  int act;
  /* or NULL; a pointwise convolution's input scaled per (image, input channel) first:
     y = conv(x * in_scale[n, c]) (squeeze-and-excitation before a separable block's project) */
  const float* in_scale;
} ut__conv_epi;

/* ut_conv2d_forward, and with epi (the CPU's float32 only; no cache) the fused inference
   forward: the GEMM applies epi in its epilogue, which then replaces the bias pass, and the
   caller has made sure that the padded exact pass has nothing to redo (finite weights). */
static ut_tensor* ut__conv2d_forward_epi(ut_conv2d* l, ut_tensor* x, ut_conv2d_cache* cache,
                                         const ut__conv_epi* epi, const char* who) {
  ut__conv_geom g;
  if (ut__check_conv2d(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->in_c, l->out_c, l->kh, l->kw, l->stride, l->pad, 1, who) < 0 ||
      ut__check_col(&g, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  int K = l->in_c * l->kh * l->kw, P = g.ho * g.wo;
  ut_dtype dt = ut__buf_dtype(x, be); /* the activations', the columns' and the GEMMs' */
  const float* xp = ut__in(x, be);
  ut_tensor* wt = xp ? ut__gemm_weight(l->weight, x, who) : NULL;
  const float* wp = wt ? ut__in(wt, be) : NULL;
  const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
  if (!wp || (l->bias && !bp)) return ut__drop(wt);
  const int kp = g.kp = ut__conv_col_rows(&g, be, dt);
  ut_tensor* wk = ut__conv_pad_weight(be, ut_retain(wt), l->out_c, K, kp, who);
  const float* wkp = wk ? ut__in(wk, be) : NULL;
  if (!wkp) {
    ut_free(wk);
    return ut__drop(wt);
  }

  /* a pointwise convolution over 1x1 planes (squeeze-and-excitation's, on pooled [N, C, 1,
     1]) is a Linear on the CPU: y [N, out_c] = x [N, in_c] . W^T, one product for the batch
     reading W in place. As products of one column per image, each column was padded to a
     whole panel (SE's 1152 -> 48 on one image 41 -> 8 us on 2 cores), and a batch went
     through two transposes (merged). With epi the per-channel epilogue needs W . x's rows. */
  bool as_linear = !epi && P == 1 && ut__conv_is_pointwise(&g) && !ut__is_device_backend(be) &&
                   dt == UT_F32;
  /* inference on the CPU keeps the weight's packed panels (ut__cpu_packed_a), so per-image
     GEMMs no longer pack it per image: over 14^2 planes they beat the merged GEMM and its two
     transposes (batch 8, 2 threads, rounds alternated in one process: 96 -> 576, 576 -> 96,
     64 -> 384, 384 -> 64 1.11-1.18x); over 7^2 the merged one still wins (0.88-0.98x) */
  bool merged = !as_linear && ut__conv_merges_batch(&g, be, x->dtype) &&
                !(epi && !ut__is_device_backend(be) && P >= UT__PW_BATCH_MERGE_P_KEPT);
  bool regroup = !merged && ut__conv_regroups_batch(&g, be);
  /* inference (nothing cached) on the CPU: the GEMM packs its panels of the columns from x
     instead of copying them from a column matrix. It pays where each panel is packed once, in
     one block of rows (out_c <= UT__IMPLICIT_CONV_MAX_OUT): 2 threads, batch 1, 32 -> 32 3x3
     at 56^2 0.55 -> 0.46 ms, 96 -> 192 2x2 s2 0.59 -> 0.53 ms, a 3 -> 24 stem at 64^2, batch
     8, 0.16 -> 0.13 ms; 192 -> 384 2x2 s2 in two blocks of rows, 0.58 -> 0.68 ms, gathers each
     strided panel twice */
  bool implicit = epi && !cache && !merged && !regroup && !ut__conv_is_pointwise(&g) &&
                  !ut__is_device_backend(be) && dt == UT_F32 && g.dil <= 1 &&
                  l->out_c <= UT__IMPLICIT_CONV_MAX_OUT;
  /* pointwise only (the caller's check). The scale rides on whichever is smaller per image:
     x's columns (c * P values; the merged product's regrouped copy) or the weight (out_c * c:
     W[o, c] s[n, c]) */
  const float* in_scale = epi ? epi->in_scale : NULL;
  bool scale_w = in_scale && !merged && P >= l->out_c;
  ut_tensor* col;
  if (in_scale && !scale_w) {
    col = ut__conv_columns_scaled(be, xp, in_scale, &g, merged, x, who);
  } else if (merged) { /* backward reuses the regrouped columns */
    col = ut__conv_batch_columns(be, xp, &g, x, who);
  } else if (ut__conv_is_pointwise(&g) || implicit) {
    col = ut_retain(x); /* a 1x1 window's columns are the input itself; implicit: read from x */
  } else {
    col = ut__new_typed(3, (int[]){g.n, kp, P}, x->dev, x->dtype, who);
    if (col) col = ut__finish(col, be, be->im2col(dt, xp, ut__out(col, be), &g));
  }
  ut_tensor* out = col ? ut__new_typed(4, (int[]){g.n, l->out_c, g.ho, g.wo}, x->dev, x->dtype,
                                       who)
                       : NULL;
  if (!out) {
    ut_free_all(wt, wk);
    return ut__drop(col);
  }
  float* op = ut__out(out, be);
  int rc;
  if (merged || regroup) { /* Y [out_c, n*P] = W . X, then back to [n, out_c, P] */
    ut_tensor* yt = ut__new_typed(3, (int[]){l->out_c, g.n, P}, x->dev, x->dtype, who);
    ut_tensor* xr = yt && regroup ? ut__new_typed(3, (int[]){K, g.n, P}, x->dev, x->dtype, who)
                                  : NULL;
    if (!yt || (regroup && !xr)) {
      ut_free_all(yt, wt, wk);
      ut_free(col);
      return ut__drop(out);
    }
    rc = regroup ? be->transpose(dt, ut__in(col, be), ut__out(xr, be), 1, g.n, 1, K, P) : UT_OK;
    ut__gemm_args mm = {.m = l->out_c, .n = g.n * P, .k = K, .batch = 1, .alpha = 1.f,
                        .beta = 0.f, .a = wp, .lda = K,
                        .b = regroup ? ut__out(xr, be) : ut__in(col, be), .ldb = g.n * P,
                        .c = ut__out(yt, be), .ldc = g.n * P,
                        .row_scale = epi ? epi->scale : NULL,
                        .row_shift = epi ? epi->shift : NULL, .act = epi ? epi->act : 0,
                        .a_owner = epi ? l->weight : NULL};
    if (rc >= 0) rc = be->gemm(dt, dt, &mm);
    if (rc >= 0) rc = be->transpose(dt, ut__out(yt, be), op, 1, l->out_c, 1, g.n, P);
    ut_free_all(yt, xr);
  } else if (as_linear) {
    ut__gemm_args mm = {.trans_b = true, .m = g.n, .n = l->out_c, .k = K, .batch = 1,
                        .alpha = 1.f, .beta = 0.f, .a = xp, .lda = K, .b = wkp, .ldb = K,
                        .c = op, .ldc = l->out_c};
    rc = be->gemm(dt, dt, &mm);
  } else {
    ut_tensor* ws = scale_w ? ut__new(3, (int[]){g.n, l->out_c, kp}, UT_CPU, who) : NULL;
    if (scale_w && !ws) {
      ut_free_all(wt, wk, col);
      return ut__drop(out);
    }
    if (ws) ut__scale_weight_columns(wkp, in_scale, ws->data, g.n, l->out_c, kp);
    ut__gemm_args mm = {.m = l->out_c, .n = P, .k = kp, .batch = g.n, .alpha = 1.f,
                        .beta = 0.f, .a = ws ? ws->data : wkp, .lda = kp,
                        .stride_a = ws ? (ut__i64)l->out_c * kp : 0,
                        .b = ut__in(col, be), .ldb = P, .stride_b = (ut__i64)kp * P,
                        .c = op, .ldc = P, .stride_c = (ut__i64)l->out_c * P,
                        .row_scale = epi ? epi->scale : NULL,
                        .row_shift = epi ? epi->shift : NULL, .act = epi ? epi->act : 0,
                        .b_conv = implicit ? &g : NULL, .a_owner = epi ? l->weight : NULL};
    if (implicit) mm.stride_b = (ut__i64)g.c * g.h * g.w;
    rc = be->gemm(dt, dt, &mm);
    ut_free(ws);
  }
  if (rc >= 0 && bp && !epi) rc = be->bias_add(dt, op, bp, g.n, l->out_c, P);
  /* the columns' padding zeros times a non-finite weight: redo with real input only */
  if (rc >= 0 && g.pad > 0 && !epi)
    rc = be->conv_exact(dt, UT__CONV_Y, xp, NULL, wp, bp, NULL, op, l->out_c, &g);
  ut_free_all(wt, wk);
  if (rc < 0) {
    ut_free(col);
    return ut__drop(out);
  }
  ut__wrote(out, be);
  if (cache) cache->input = ut_retain(x);
  /* Other columns (im2col's, kh*kw times the input for a 3x3; the regrouped copy of a merged
     pointwise GEMM) are not kept: they would be a second copy of the input, held from forward
     to the end of the step. Backward rebuilds them from the input, one memory-speed pass. */
  if (cache && col == x) cache->col = col;
  else ut_free(col);
  return out;
}

ut_tensor* ut_conv2d_forward(ut_conv2d* l, ut_tensor* x, ut_conv2d_cache* cache) {
  return ut__conv2d_forward_epi(l, x, cache, NULL, "ut_conv2d_forward");
}

/* The body of ut_conv2d_backward (dxo: where dx goes) and ut_conv2d_backward_params (dxo NULL).
   Without dxo no dx or dcol is allocated and neither the dx GEMM nor col2im runs: for a network's
   first layer, whose input is the data, they are most of its backward and nobody reads them. */
static int ut__conv2d_backward(ut_conv2d* l, ut_conv2d_cache* cache, ut_tensor* grad_out,
                               ut_tensor* dW, ut_tensor* db, ut_tensor** dxo, const char* who) {
  ut__conv_geom g;
  if (ut__check_conv2d(l, who) < 0 ||
      ut__check_conv_backward(&g, l->weight, l->bias != NULL, cache ? cache->input : NULL,
                              l->in_c, l->out_c, l->kh, l->kw, l->stride, l->pad, 1, grad_out,
                              dW, db, who) < 0 ||
      ut__check_col(&g, who) < 0)
    return ut__err_status;
  const ut__backend* be = ut__backend_for(grad_out->dev);
  int K = l->in_c * l->kh * l->kw, P = g.ho * g.wo;
  bool pointwise = ut__conv_is_pointwise(&g),
       merged = ut__conv_merges_batch(&g, be, grad_out->dtype);
  ut_dtype dt = ut__buf_dtype(grad_out, be); /* the buffers' and the GEMMs' element type */
  ut_dtype at = grad_out->dtype;              /* the tensors': dx's and the columns' */
  const int kp = g.kp = ut__conv_col_rows(&g, be, dt);

  ut_tensor* col = cache->col;
  bool own_col = false;
  /* a pointwise conv's columns are the input itself (4-D) or, merged, regrouped (3-D) */
  if (!col || col->shape.nelem != (long long)g.n * kp * P || col->dev != grad_out->dev ||
      col->dtype != at || merged != (pointwise && col->shape.ndim == 3)) {
    /* the forward kept no columns (see ut_conv2d_forward), or another layout: from the input */
    own_col = true;
    if (merged) {
      if (!(col = ut__conv_batch_columns(be, ut__in(cache->input, be), &g, cache->input, who)))
        return ut__err_status;
    } else if (pointwise) {
      col = ut_retain(cache->input);
    } else {
      const float* xp = ut__in(cache->input, be);
      col = xp ? ut__new_typed(3, (int[]){g.n, kp, P}, grad_out->dev, at, who) : NULL;
      if (!col || !ut__finish(col, be, be->im2col(dt, xp, ut__out(col, be), &g)))
        return ut__err_status;
    }
  }
  ut_tensor *dx = NULL, *dcol = NULL;
  const float* gop = ut__in(grad_out, be);
  const float* colp = gop ? ut__in(col, be) : NULL;
  /* the dx GEMMs' weight, [out_c, kp] zero past K (not made when no dx is wanted) */
  ut_tensor* wt = colp && dxo ? ut__gemm_weight(l->weight, grad_out, who) : NULL;
  if (wt) wt = ut__conv_pad_weight(be, wt, l->out_c, K, kp, who);
  const float* wp = wt ? ut__in(wt, be) : NULL;
  float* dWp = colp && (wp || !dxo) ? ut__inout(dW, be) : NULL;
  float* dbp = (dWp && db && l->bias) ? ut__inout(db, be) : NULL;
  int rc = (!dWp || (db && l->bias && !dbp)) ? ut__err_status : UT_OK;
  if (rc >= 0 && dxo) {
    dx = ut__new_typed(4, cache->input->shape.shape, grad_out->dev, at, who);
    if (!pointwise && dx) dcol = ut__new_typed(3, (int[]){g.n, kp, P}, grad_out->dev, at, who);
    if (!dx || (!pointwise && !dcol)) rc = ut__err_status;
  }
  if (rc >= 0 && dbp) rc = be->channel_sum(dt, gop, dbp, g.n, l->out_c, P, 1.f);
  bool regroup = !merged && ut__conv_regroups_batch(&g, be);
  ut_tensor* colr = NULL; /* regroup: the per-image columns regrouped [K, n, P] */
  if (rc >= 0 && regroup) {
    colr = ut__new_typed(3, (int[]){K, g.n, P}, grad_out->dev, at, who);
    float* colrp = colr ? ut__out(colr, be) : NULL;
    rc = colrp ? be->transpose(dt, colp, colrp, 1, g.n, 1, K, P) : ut__err_status;
    colp = colrp;
  }
  if (rc >= 0 && (merged || regroup)) {
    /* as forward: G [out_c, n*P] regrouped once; dW += G . X^T; dX = W^T . G, back to
       [n, c, P] (regroup: dcol, for col2im) */
    ut_tensor* gr = ut__new_typed(3, (int[]){l->out_c, g.n, P}, grad_out->dev, at, who);
    ut_tensor* dxt = gr && dxo ? ut__new_typed(3, (int[]){K, g.n, P}, grad_out->dev, at, who)
                               : NULL;
    float* grp = gr ? ut__out(gr, be) : NULL;
    rc = gr && (dxt || !dxo) ? UT_OK : ut__err_status;
    if (rc >= 0) rc = be->transpose(dt, gop, grp, 1, g.n, 1, l->out_c, P);
    ut__gemm_args dw_mm = {.trans_b = true, .m = l->out_c, .n = K, .k = g.n * P, .batch = 1,
                           .alpha = 1.f, .beta = 1.f, .a = grp, .lda = g.n * P,
                           .b = colp, .ldb = g.n * P, .c = dWp, .ldc = K};
    if (rc >= 0) rc = be->gemm(dt, UT_F32, &dw_mm);
    ut__gemm_args dx_mm = {.trans_a = true, .m = K, .n = g.n * P, .k = l->out_c, .batch = 1,
                           .alpha = 1.f, .beta = 0.f, .a = wp, .lda = K,
                           .b = grp, .ldb = g.n * P, .c = dxt ? ut__out(dxt, be) : NULL,
                           .ldc = g.n * P};
    if (rc >= 0 && dxo) rc = be->gemm(dt, dt, &dx_mm);
    if (rc >= 0 && dxo)
      rc = be->transpose(dt, ut__out(dxt, be), ut__out(regroup ? dcol : dx, be), 1, K, 1, g.n,
                         P);
    if (rc >= 0 && dxo && regroup) rc = be->col2im(dt, ut__out(dcol, be), ut__out(dx, be), &g);
    ut_free(gr);
    ut_free(dxt);
  } else if (rc >= 0) {
    /* dW += sum_n grad_out[n] [out_c, P] . col[n]^T [P, K]; with padding, the sum goes to a
       part of its own first, for the exact pass to add: a non-finite grad_out times the
       columns' padding zeros is NaN there, where the sum over real input is not. Columns of
       kp rows give a part [out_c, kp], its first K columns then taken (kpart). */
    bool own_part = g.pad > 0 || kp != K;
    ut_tensor* part = own_part ? ut__new_typed(2, (int[]){l->out_c, kp}, grad_out->dev, UT_F32,
                                               who)
                               : NULL;
    ut_tensor* kpart = part && kp != K ? ut__new_typed(2, (int[]){l->out_c, K}, grad_out->dev,
                                                       UT_F32, who)
                                       : NULL;
    float* partp = part ? ut__out(part, be) : NULL;
    ut__gemm_args mm = {.trans_b = true, .sum_batch = true,
                        .m = l->out_c, .n = kp, .k = P, .batch = g.n, .alpha = 1.f,
                        .beta = part ? 0.f : 1.f,
                        .a = gop, .lda = P, .stride_a = (ut__i64)l->out_c * P,
                        .b = colp, .ldb = P, .stride_b = (ut__i64)kp * P,
                        .c = part ? partp : dWp, .ldc = kp};
    rc = own_part && (!partp || (kp != K && !kpart)) ? ut__err_status
                                                      : be->gemm(dt, UT_F32, &mm);
    if (rc >= 0 && kpart) {
      rc = be->copy2d(UT_F32, partp, kp, ut__out(kpart, be), K, l->out_c, K);
      partp = ut__out(kpart, be);
    }
    if (rc >= 0 && g.pad > 0)
      rc = be->conv_exact(dt, UT__CONV_DW, ut__in(cache->input, be), gop, NULL, NULL, partp, dWp,
                          l->out_c, &g);
    else if (rc >= 0 && kpart)
      rc = be->axpy(UT_F32, dWp, partp, (ut__i64)l->out_c * K, 1.f);
    ut_free_all(part, kpart);
  }
  if (rc >= 0 && !merged && !regroup && dxo) {
    /* dcol[n] = W^T [K, out_c] . grad_out[n] [out_c, P]; a 1x1 conv's dcol is dx itself */
    float* dst = pointwise ? ut__out(dx, be) : ut__out(dcol, be);
    ut__gemm_args mm = {.trans_a = true,
                        .m = kp, .n = P, .k = l->out_c, .batch = g.n, .alpha = 1.f, .beta = 0.f,
                        .a = wp, .lda = kp, .stride_a = 0,
                        .b = gop, .ldb = P, .stride_b = (ut__i64)l->out_c * P,
                        .c = dst, .ldc = P, .stride_c = (ut__i64)kp * P};
    rc = be->gemm(dt, dt, &mm);
    if (rc >= 0 && !pointwise) rc = be->col2im(dt, dst, ut__out(dx, be), &g);
  }
  ut_free_all(wt, colr);
  if (own_col) ut_free(col);
  ut_free(dcol);
  dx = ut__backward_done(rc, be, dx, dW, dWp, db, dbp);
  if (dxo) *dxo = dx;
  return rc < 0 ? rc : UT_OK;
}

ut_tensor* ut_conv2d_backward(ut_conv2d* l, ut_conv2d_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db) {
  ut_tensor* dx = NULL;
  if (ut__conv2d_backward(l, cache, grad_out, dW, db, &dx, "ut_conv2d_backward") < 0) return NULL;
  return dx;
}

int ut_conv2d_backward_params(ut_conv2d* l, ut_conv2d_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db) {
  return ut__conv2d_backward(l, cache, grad_out, dW, db, NULL, "ut_conv2d_backward_params");
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
  return ut_dwconv2d_alloc_ex(c, 1, kh, kw, stride, pad, 1, bias, dev);
}

/* The layer's multiplier and dilation, with 0 (a struct built field by field) read as 1. */
static int ut__dw_mult(const ut_dwconv2d* l) { return l->mult ? l->mult : 1; }
static int ut__dw_dil(const ut_dwconv2d* l) { return l->dilation ? l->dilation : 1; }

static int ut__check_dw_extra(int c, int mult, int dilation, const char* who) {
  UT__CHECK(c >= 1, UT_ERR_ARG, "%s: channel count must be positive, got %d", who, c);
  UT__CHECK(mult >= 1, UT_ERR_ARG, "%s: the channel multiplier must be >= 1, got %d", who, mult);
  UT__CHECK(dilation >= 1, UT_ERR_ARG, "%s: dilation must be >= 1, got %d", who, dilation);
  UT__CHECK((long long)c * mult <= INT_MAX, UT_ERR_ARG,
            "%s: %d channels times multiplier %d is more than %d output channels", who, c, mult,
            INT_MAX);
  return UT_OK;
}

ut_dwconv2d ut_dwconv2d_alloc_ex(int c, int mult, int kh, int kw, int stride, int pad,
                                 int dilation, bool bias, ut_dev dev) {
  const char* who = mult == 1 && dilation == 1 ? "ut_dwconv2d_alloc" : "ut_dwconv2d_alloc_ex";
  ut_dwconv2d l = {.c = c, .kh = kh, .kw = kw, .stride = stride, .pad = pad,
                   .dilation = dilation, .mult = mult};
  if (ut__check_kernel_args(kh, kw, stride, pad, who) < 0 ||
      ut__check_dw_extra(c, mult, dilation, who) < 0)
    return l;
  int oc = c * mult;
  float std = sqrtf(2.f / (float)((double)kh * kw));
  ut_tensor* w = ut_randn(3, (int[]){oc, kh, kw}, 0.f, std, dev);
  ut_tensor* b = (w && bias) ? ut_alloc(1, (int[]){oc}, dev) : NULL;
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
  UT__TRY(ut__check_dw_extra(l->c, ut__dw_mult(l), ut__dw_dil(l), who));
  int oc = l->c * ut__dw_mult(l);
  return ut__check_params(l->weight, l->bias, ut__prod(oc, l->kh, l->kw, 1), oc, who);
}

/* With a multiplier m the input's channels are repeated m times ([n, c, h, w] -> [n, c*m, h, w],
   channel o = input channel o / m) and the backends' depthwise kernels run on c*m channels:
   their fast paths, unchanged. dx is summed back over each channel's m copies, in order. */
static ut_tensor* ut__dw_repeat(ut_tensor* x, const float* xp, int m, const ut__backend* be,
                                const char* who) {
  const int* s = x->shape.shape;
  ut_tensor* r = ut__new_typed(4, (int[]){s[0], s[1] * m, s[2], s[3]}, x->dev, x->dtype, who);
  if (!r) return NULL;
  ut__i64 inner = (ut__i64)s[2] * s[3];
  return ut__finish(r, be, be->chan_repeat(ut__buf_dtype(x, be), xp, ut__out(r, be), s[0], s[1],
                                           m, inner));
}

/* act(bn(x)) written out, for a backward whose kernels cannot normalize as they load: scratch
   the caller frees */
static ut_tensor* ut__dw_bn_input(const ut__backend* be, const ut_tensor* x, const float* xp,
                                  const ut__dw_bn* bn, const char* who) {
  ut_tensor* y = ut__new_like(x, who);
  if (!y) return NULL;
  const int* s = x->shape.shape;
  return ut__finish(y, be,
                    be->bn_apply(ut__buf_dtype(x, be), xp, ut__out(y, be), bn->mean, bn->var,
                                 bn->gamma, bn->beta, NULL, s[0], s[1], (ut__i64)s[2] * s[3],
                                 bn->eps, bn->act));
}

/* ut_dwconv2d_forward past its checks */
static ut_tensor* ut__dw_forward(ut_dwconv2d* l, ut_tensor* x, ut__conv_geom g, const char* who) {
  const ut__backend* be = ut__backend_for(x->dev);
  const int m = ut__dw_mult(l);
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
  if (!wp || (l->bias && !bp)) return NULL;
  ut_tensor* xr = NULL;
  if (m > 1) {
    if (!(xr = ut__dw_repeat(x, xp, m, be, who))) return NULL;
    xp = ut__out(xr, be);
    g.c *= m;
  }
  ut_tensor* out = ut__new_typed(4, (int[]){g.n, g.c, g.ho, g.wo}, x->dev, x->dtype, who);
  if (out)
    out = ut__finish(out, be, be->dw_fwd(ut__buf_dtype(x, be), xp, wp, bp, ut__out(out, be), &g));
  ut_free(xr);
  return out;
}

ut_tensor* ut_dwconv2d_forward(ut_dwconv2d* l, ut_tensor* x, ut_dwconv2d_cache* cache) {
  const char* who = "ut_dwconv2d_forward";
  ut__conv_geom g;
  if (ut__check_dwconv2d(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->c, l->c * ut__dw_mult(l), l->kh, l->kw, l->stride, l->pad,
                        ut__dw_dil(l), who) < 0)
    return NULL;
  ut_tensor* out = ut__dw_forward(l, x, g, who);
  if (out && cache) {
    cache->input = ut_retain(x);
    cache->bn = NULL;
  }
  return out;
}

/* the weight gradient from go and the forward's input (act(bn(input)) when cache->bn is set),
   that input repeated over the multiplier's copies (*xr, *xb: scratch the caller frees, the
   input's pointer in *xp on return for dx's chan_group_sum shapes) */
static int ut__dw_backward_dw(const ut__backend* be, ut_dtype dt, const ut_dwconv2d_cache* cache,
                              const float* gop, const float** xp, float* dWp,
                              const ut__conv_geom* g, int m, ut_tensor** xb, ut_tensor** xr,
                              const char* who) {
  const ut_tensor* x = cache->input;
  ut__dw_bn d;
  if (cache->bn) {
    const float* sp = ut__in(cache->bn, be);
    if (!sp) return ut__err_status;
    const int C = x->shape.shape[1];
    d = (ut__dw_bn){sp, sp + C, sp + 2 * C, sp + 3 * C, cache->bn_eps, cache->bn_act};
    if (m == 1 && be->dw_bwd_dw_bn) {
      int rc = be->dw_bwd_dw_bn(dt, gop, *xp, dWp, g, &d);
      if (rc != 1) return rc;
    }
    if (!(*xb = ut__dw_bn_input(be, x, *xp, &d, who))) return ut__err_status;
    *xp = ut__in(*xb, be);
  }
  if (m > 1) {
    if (!(*xr = ut__dw_repeat(*xb ? *xb : (ut_tensor*)x, *xp, m, be, who))) return ut__err_status;
    *xp = ut__out(*xr, be);
  }
  ut__conv_geom gm = *g;
  gm.c *= m;
  return be->dw_bwd_dw(dt, gop, *xp, dWp, &gm);
}

/* cache->bn as ut_batchnorm2d_dwconv2d_forward leaves it: [4, C] float32 beside the input */
static int ut__check_dw_cache_bn(const ut_dwconv2d_cache* cache, const char* who) {
  if (!cache || !cache->bn || !cache->input) return UT_OK;
  const int C = cache->input->shape.ndim == 4 ? cache->input->shape.shape[1] : 0;
  UT__TRY(ut__check_arg(cache->bn, cache->input, (ut__i64)4 * C, who, "cache->bn"));
  UT__TRY(ut__check_f32(cache->bn, who, "cache->bn"));
  UT__CHECK(ut__act_valid(cache->bn_act), UT_ERR_ARG,
            "%s: cache->bn_act must be a ut_activation (%d to %d), got %d", who, UT_ACT_NONE,
            UT_ACT_GELU_TANH, cache->bn_act);
  UT__CHECK(cache->bn_eps >= 0.f, UT_ERR_ARG, "%s: cache->bn_eps must be >= 0, got %g", who,
            (double)cache->bn_eps);
  return UT_OK;
}

ut_tensor* ut_dwconv2d_backward(ut_dwconv2d* l, ut_dwconv2d_cache* cache, ut_tensor* grad_out,
                                ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_dwconv2d_backward";
  ut__conv_geom g;
  if (ut__check_dwconv2d(l, who) < 0 ||
      ut__check_conv_backward(&g, l->weight, l->bias != NULL, cache ? cache->input : NULL, l->c,
                              l->c * ut__dw_mult(l), l->kh, l->kw, l->stride, l->pad,
                              ut__dw_dil(l), grad_out, dW, db, who) < 0 ||
      ut__check_dw_cache_bn(cache, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(grad_out->dev);
  const int m = ut__dw_mult(l);
  const float* gop = ut__in(grad_out, be);
  const float* xp = gop ? ut__in(cache->input, be) : NULL;
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  float* dWp = wp ? ut__inout(dW, be) : NULL;
  float* dbp = (dWp && db && l->bias) ? ut__inout(db, be) : NULL;
  if (!dWp || (db && l->bias && !dbp)) return NULL;
  ut_dtype dt = ut__buf_dtype(grad_out, be);
  ut_tensor* dx = ut__new_like(cache->input, who);
  if (!dx) return NULL;
  ut_tensor *xb = NULL, *xr = NULL, *dxr = NULL;
  int rc = ut__dw_backward_dw(be, dt, cache, gop, &xp, dWp, &g, m, &xb, &xr, who);
  float* dxp = ut__out(dx, be);
  if (rc >= 0 && m > 1) { /* dx over the c*m channels, summed back over each channel's copies */
    dxr = ut__new_typed(4, (int[]){g.n, g.c * m, g.h, g.w}, dx->dev, dx->dtype, who);
    if (!dxr) rc = ut__err_status;
    else {
      dxp = ut__out(dxr, be);
      g.c *= m;
    }
  }
  ut__i64 P = (ut__i64)g.ho * g.wo, HW = (ut__i64)g.h * g.w;
  if (rc >= 0 && dbp) rc = be->channel_sum(dt, gop, dbp, g.n, g.c, P, 1.f);
  if (rc >= 0) rc = be->dw_bwd_dx(dt, gop, wp, dxp, &g);
  if (rc >= 0 && dxr) rc = be->chan_group_sum(dt, dxp, ut__out(dx, be), g.n, l->c, m, HW);
  ut_free_all(xr, xb, dxr);
  return ut__backward_done(rc, be, dx, dW, dWp, db, dbp);
}

void ut_dwconv2d_cache_free(ut_dwconv2d_cache* c) {
  if (!c) return;
  ut_free_all(c->input, c->bn);
  c->input = c->bn = NULL;
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
  UT__CHECK(x->shape.ndim == 2 && x->shape.shape[1] == cols, UT_ERR_SHAPE,
            "%s: %s must be [N, %d], got shape %s", who, name, cols, ut__shape_text(x).s);
  return UT_OK;
}

ut_tensor* ut_linear_forward(ut_linear* l, ut_tensor* x, ut_linear_cache* cache) {
  const char* who = "ut_linear_forward";
  if (ut__check_linear(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__check_rows(x, l->in_f, who, "x") < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  int N = x->shape.shape[0];
  ut_dtype dt = ut__buf_dtype(x, be);
  const float* xp = ut__in(x, be);
  ut_tensor* wt = xp ? ut__gemm_weight(l->weight, x, who) : NULL;
  const float* wp = wt ? ut__in(wt, be) : NULL;
  const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
  ut_tensor* y = wp && (!l->bias || bp)
                     ? ut__new_typed(2, (int[]){N, l->out_f}, x->dev, x->dtype, who)
                     : NULL;
  if (!y) return ut__drop(wt);
  float* yp = ut__out(y, be);
  ut__gemm_args mm = {.trans_b = true, .m = N, .n = l->out_f, .k = l->in_f, .batch = 1,
                      .alpha = 1.f, .beta = 0.f, .a = xp, .lda = l->in_f, .b = wp,
                      .ldb = l->in_f, .c = yp, .ldc = l->out_f};
  int rc = be->gemm(dt, dt, &mm);
  if (rc >= 0 && bp) rc = be->bias_add(dt, yp, bp, N, l->out_f, 1);
  ut_free(wt);
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
      ut__check_dtype_as(grad_out, x, who, "grad_out", "cache->input") < 0 ||
      ut__check_arg(dW, l->weight, l->weight->shape.nelem, who, "dW") < 0 ||
      ut__check_f32(dW, who, "dW") < 0 ||
      (db && l->bias && ut__check_arg(db, l->weight, l->out_f, who, "db") < 0) ||
      (db && l->bias && ut__check_f32(db, who, "db") < 0))
    return NULL;
  int N = x->shape.shape[0];
  UT__CHECK_NULL(grad_out->shape.shape[0] == N, UT_ERR_SHAPE,
                 "%s: grad_out has shape %s, the forward output had [%d, %d]", who,
                 ut__shape_text(grad_out).s, N, l->out_f);
  if (ut__check_distinct(dW, l->weight, who, "dW", "the layer's weight") < 0 ||
      ut__check_distinct(dW, grad_out, who, "dW", "grad_out") < 0 ||
      ut__check_distinct(dW, x, who, "dW", "cache->input") < 0 ||
      (db && l->bias && ut__check_distinct(dW, db, who, "dW", "db") < 0))
    return NULL;
  const ut__backend* be = ut__backend_for(grad_out->dev);
  ut_dtype dt = ut__buf_dtype(grad_out, be);
  const float* gop = ut__in(grad_out, be);
  const float* xp = gop ? ut__in(x, be) : NULL;
  ut_tensor* wt = xp ? ut__gemm_weight(l->weight, grad_out, who) : NULL;
  const float* wp = wt ? ut__in(wt, be) : NULL;
  float* dWp = wp ? ut__inout(dW, be) : NULL;
  float* dbp = (dWp && db && l->bias) ? ut__inout(db, be) : NULL;
  ut_tensor* dx = dWp && (!db || !l->bias || dbp)
                      ? ut__new_typed(2, (int[]){N, l->in_f}, grad_out->dev, grad_out->dtype, who)
                      : NULL;
  if (!dx) return ut__drop(wt);
  /* dW += grad_out^T [out, N] . x [N, in];  dx = grad_out [N, out] . W [out, in] */
  ut__gemm_args dw = {.trans_a = true, .m = l->out_f, .n = l->in_f, .k = N, .batch = 1,
                      .alpha = 1.f, .beta = 1.f, .a = gop, .lda = l->out_f, .b = xp,
                      .ldb = l->in_f, .c = dWp, .ldc = l->in_f};
  ut__gemm_args dxa = {.m = N, .n = l->in_f, .k = l->out_f, .batch = 1, .alpha = 1.f,
                       .beta = 0.f, .a = gop, .lda = l->out_f, .b = wp, .ldb = l->in_f,
                       .c = ut__out(dx, be), .ldc = l->in_f};
  int rc = be->gemm(dt, UT_F32, &dw);
  if (rc >= 0 && dbp) rc = be->channel_sum(dt, gop, dbp, N, l->out_f, 1, 1.f);
  if (rc >= 0) rc = be->gemm(dt, dt, &dxa);
  ut_free(wt);
  return ut__backward_done(rc, be, dx, dW, dWp, db, dbp);
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

static int ut__check_grad_like(const ut_tensor* go, const ut_tensor* x, const char* who) {
  UT__TRY(ut__check_arg(go, x, -1, who, "grad_out"));
  UT__CHECK(ut__same_shape(go, x), UT_ERR_SHAPE,
            "%s: grad_out has shape %s but x has shape %s (they must match)", who,
            ut__shape_text(go).s, ut__shape_text(x).s);
  return ut__check_dtype_as(go, x, who, "grad_out", "x");
}

static int ut__check_layernorm(const ut_layernorm* l, const ut_tensor* x, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__CHECK(l->dim >= 1, UT_ERR_ARG, "%s: invalid dim %d", who, l->dim);
  UT__TRY(ut__check_eps(l->eps, who));
  UT__CHECK(l->bias, UT_ERR_ARG, "%s: the layer's bias is NULL", who);
  UT__TRY(ut__check_params(l->weight, l->bias, l->dim, l->dim, who));
  UT__TRY(ut__check_arg(x, l->weight, -1, who, "x"));
  UT__CHECK(x->shape.shape[x->shape.ndim - 1] == l->dim, UT_ERR_SHAPE,
            "%s: x must be [..., %d], got shape %s", who, l->dim, ut__shape_text(x).s);
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
  /* bf16 rows on the GPU (a mixed-precision head) take the typed NCHW kernel with H*W = 1:
     [rows, dim] is [N, C, 1, 1]; the cache keeps its rows shape, so the backward pairs them
     alike. The CPU computes on a float32 copy, so it keeps the rows kernel. */
  int rc = !rstd ? ut__err_status
           : ut__buf_dtype(x, be) == UT_F32
               ? be->layernorm_fwd(xp, wp, bp, ut__out(y, be), ut__out(mean, be),
                                   ut__out(rstd, be), rows, l->dim, l->eps)
               : be->ln2d_fwd(ut__buf_dtype(x, be), xp, wp, bp, ut__out(y, be),
                              ut__out(mean, be), ut__out(rstd, be), rows, l->dim, 1, l->eps);
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

/* What both LayerNorm backwards read and write, on the backend of the cached input. */
typedef struct {
  const float *go, *x, *w, *mean, *rstd;
  float *dW, *db;
} ut__ln_grad_io;

/* The cached statistics (`count` values each; ndim 1: one per row, from ut_layernorm_forward;
   3: one per NCHW position, from ut_layernorm2d_forward, so a cache filled by the other forward
   is refused) and the optional dW / db are checked, then every pointer fetched. */
static int ut__ln_grad_io_get(ut_layernorm* l, ut_layernorm_cache* cache, ut_tensor* grad_out,
                              ut_tensor* dW, ut_tensor* db, int count, int ndim, const char* who,
                              const ut__backend* be, ut__ln_grad_io* io) {
  ut_tensor* x = cache->input;
  UT__TRY(ut__check_arg(cache->mean, x, count, who, "cache->mean"));
  UT__TRY(ut__check_arg(cache->rstd, x, count, who, "cache->rstd"));
  if (dW) UT__TRY(ut__check_arg(dW, x, l->dim, who, "dW"));
  if (db) UT__TRY(ut__check_arg(db, x, l->dim, who, "db"));
  UT__TRY(ut__check_f32(dW, who, "dW"));
  UT__TRY(ut__check_f32(db, who, "db"));
  UT__CHECK(cache->mean->shape.ndim == ndim && cache->rstd->shape.ndim == ndim, UT_ERR_ARG,
            "%s: the cache was filled by %s, not %s", who,
            ndim == 1 ? "ut_layernorm2d_forward" : "ut_layernorm_forward (rows)",
            ndim == 1 ? "ut_layernorm_forward" : "ut_layernorm2d_forward");
  io->go = ut__in(grad_out, be);
  io->x = io->go ? ut__in(x, be) : NULL;
  io->w = io->x ? ut__in(l->weight, be) : NULL;
  io->mean = io->w ? ut__in(cache->mean, be) : NULL;
  io->rstd = io->mean ? ut__in(cache->rstd, be) : NULL;
  io->dW = (io->rstd && dW) ? ut__inout(dW, be) : NULL;
  io->db = (io->rstd && db) ? ut__inout(db, be) : NULL;
  return (!io->rstd || (dW && !io->dW) || (db && !io->db)) ? UT_ERR_ARG : UT_OK;
}

ut_tensor* ut_layernorm_backward(ut_layernorm* l, ut_layernorm_cache* cache, ut_tensor* grad_out,
                                 ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_layernorm_backward";
  UT__CHECK_NULL(cache && cache->input && cache->mean && cache->rstd, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  ut_tensor* x = cache->input;
  if (ut__check_layernorm(l, x, who) < 0 || ut__check_grad_like(grad_out, x, who) < 0)
    return NULL;
  int rows = x->shape.nelem / l->dim;
  const ut__backend* be = ut__backend_for(x->dev);
  ut__ln_grad_io io;
  if (ut__ln_grad_io_get(l, cache, grad_out, dW, db, rows, 1, who, be, &io) < 0) return NULL;
  ut_tensor* dx = ut__new_like(x, who);
  if (!dx) return NULL;
  int rc = ut__buf_dtype(x, be) == UT_F32
               ? be->layernorm_bwd(io.go, io.x, io.w, io.mean, io.rstd, ut__out(dx, be), io.dW,
                                   io.db, rows, l->dim)
               : be->ln2d_bwd(ut__buf_dtype(x, be), io.go, io.x, io.w, io.mean, io.rstd,
                              ut__out(dx, be), io.dW, io.db, rows, l->dim, 1);
  return ut__backward_done(rc, be, dx, dW, io.dW, db, io.db);
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
  UT__TRY(ut__check_f32(l->running_mean, who, "running_mean"));
  UT__TRY(ut__check_f32(l->running_var, who, "running_var"));
  UT__TRY(ut__check_arg(x, l->weight, -1, who, "x"));
  UT__CHECK(ut__act_valid(l->activation), UT_ERR_ARG,
            "%s: activation must be a ut_activation (%d to %d), got %d", who, UT_ACT_NONE,
            UT_ACT_GELU_TANH, l->activation);
  UT__CHECK(x->shape.ndim == 4 && x->shape.shape[1] == l->c, UT_ERR_SHAPE,
            "%s: x must be [N, %d, H, W], got shape %s", who, l->c, ut__shape_text(x).s);
  return UT_OK;
}

/* bn_stats and bn_apply over x [n, c, h, w] */
static int ut__bn_stats(const ut__backend* be, const ut_tensor* x, const float* xp, float* mean,
                        float* var) {
  const int* s = x->shape.shape;
  ut__i64 inner = (ut__i64)s[2] * s[3];
  return be->bn_stats(ut__buf_dtype(x, be), xp, mean, var, s[0], s[1], inner);
}
static int ut__bn_apply(const ut__backend* be, const ut_tensor* x, const float* xp, ut_tensor* y,
                        const float* mean, const float* var, const float* gamma,
                        const float* beta, float* rstd, float eps, int activation) {
  const int* s = x->shape.shape;
  ut__i64 inner = (ut__i64)s[2] * s[3];
  return be->bn_apply(ut__buf_dtype(x, be), xp, ut__out(y, be), mean, var, gamma, beta, rstd,
                      s[0], s[1], inner, eps, activation);
}

/* The plain and the synchronized forward start alike: one place checks the layer and x,
   fetches what both read and makes the tensors both write, so the two keep the same checks,
   messages and allocations. All or nothing: on failure nothing is left allocated. */
typedef struct ut__bn_forward_args {
  const ut__backend* be;
  const float *xp, *wp, *bp;        /* x, gamma, beta */
  ut_tensor *y, *mean, *var, *rstd; /* y like x; mean, var, rstd [C] */
  ut__i64 count;                    /* values per channel: N H W */
} ut__bn_forward_args;
static int ut__bn_forward_prepare(ut_batchnorm2d* l, ut_tensor* x, bool sync, bool make_y,
                                  const char* who, ut__bn_forward_args* fw) {
  UT__TRY(ut__check_batchnorm2d(l, x, who));
  int C = l->c;
  ut__i64 inner = (ut__i64)x->shape.shape[2] * x->shape.shape[3];
  fw->count = x->shape.shape[0] * inner;
  UT__CHECK(!l->training || fw->count > 1, UT_ERR_SHAPE,
            sync ? "%s: training needs more than one value per channel on each rank, got shape "
                   "%s (N*H*W = 1)"
                 : "%s: training needs more than one value per channel, got shape %s "
                   "(N*H*W = 1)",
            who, ut__shape_text(x).s);
  const ut__backend* be = fw->be = ut__backend_for(x->dev);
  fw->xp = ut__in(x, be);
  fw->wp = fw->xp ? ut__in(l->weight, be) : NULL;
  fw->bp = fw->wp ? ut__in(l->bias, be) : NULL;
  if (!fw->bp) return ut__err_status;
  fw->y = make_y ? ut__new_like(x, who) : NULL;
  fw->mean = (fw->y || !make_y) ? ut__new(1, (int[]){C}, x->dev, who) : NULL;
  fw->var = fw->mean ? ut__new(1, (int[]){C}, x->dev, who) : NULL;
  fw->rstd = fw->var ? ut__new(1, (int[]){C}, x->dev, who) : NULL;
  if (fw->rstd) return UT_OK;
  int rc = ut__err_status;
  ut_free_all(fw->var, fw->mean, fw->y);
  return rc;
}
/* The end of both forwards, once var and their own scratch are freed: on failure free y, mean
   and rstd and return NULL; else return y, handing x, mean and rstd to the cache if any. */
static ut_tensor* ut__bn_forward_done(int rc, const ut_batchnorm2d* l, ut_tensor* x,
                                      ut_batchnorm2d_cache* cache, const ut__bn_forward_args* fw,
                                      bool synced) {
  if (rc < 0 || !cache) {
    ut_free_all(fw->mean, fw->rstd);
    if (rc < 0) return fw->y ? ut__drop(fw->y) : NULL;
    ut__wrote(fw->y, fw->be);
    return fw->y;
  }
  if (fw->y) ut__wrote(fw->y, fw->be);
  ut__wrote(fw->mean, fw->be);
  ut__wrote(fw->rstd, fw->be);
  cache->input = ut_retain(x);
  cache->mean = fw->mean;
  cache->rstd = fw->rstd;
  cache->training = synced || l->training; /* a synchronized forward always trains */
  cache->activation = l->activation;
  cache->synced = synced;
  return fw->y;
}

/* The statistics a plain forward normalizes with: the batch's (running statistics updated) in
   training mode, else the running ones, into fw->mean and fw->var */
static int ut__bn_forward_stats(ut_batchnorm2d* l, ut_tensor* x, const ut__bn_forward_args* fw) {
  const ut__backend* be = fw->be;
  int C = l->c, rc;
  if (l->training) {
    float* rm = ut__inout(l->running_mean, be);
    float* rv = rm ? ut__inout(l->running_var, be) : NULL;
    rc = rv ? ut__bn_stats(be, x, fw->xp, ut__out(fw->mean, be), ut__out(fw->var, be))
            : ut__err_status;
    if (rc >= 0)
      rc = be->bn_update_running(rm, rv, ut__out(fw->mean, be), ut__out(fw->var, be), C,
                                 l->momentum,
                                 (float)((double)fw->count / (double)(fw->count - 1)));
    if (rc >= 0) {
      ut__wrote(l->running_mean, be);
      ut__wrote(l->running_var, be);
    }
  } else {
    const float* rm = ut__in(l->running_mean, be);
    const float* rv = rm ? ut__in(l->running_var, be) : NULL;
    rc = rv ? be->copy(ut__out(fw->mean, be), rm, C) : ut__err_status;
    if (rc >= 0) rc = be->copy(ut__out(fw->var, be), rv, C);
  }
  return rc;
}

ut_tensor* ut_batchnorm2d_forward(ut_batchnorm2d* l, ut_tensor* x, ut_batchnorm2d_cache* cache) {
  const char* who = "ut_batchnorm2d_forward";
  ut__bn_forward_args fw;
  if (ut__bn_forward_prepare(l, x, false, true, who, &fw) < 0) return NULL;
  const ut__backend* be = fw.be;
  int rc = ut__bn_forward_stats(l, x, &fw);
  if (rc >= 0)
    rc = ut__bn_apply(be, x, fw.xp, fw.y, ut__out(fw.mean, be), ut__out(fw.var, be), fw.wp,
                      fw.bp, ut__out(fw.rstd, be), l->eps, l->activation);
  ut_free(fw.var);
  return ut__bn_forward_done(rc, l, x, cache, &fw, false);
}

/* ut_batchnorm2d_forward without its output: the statistics and caches, then the depthwise
   forward on act(bn(x)) (see the declaration) */
ut_tensor* ut_batchnorm2d_dwconv2d_forward(ut_batchnorm2d* bn, ut_dwconv2d* l, ut_tensor* x,
                                           ut_batchnorm2d_cache* bn_cache,
                                           ut_dwconv2d_cache* cache) {
  const char* who = "ut_batchnorm2d_dwconv2d_forward";
  ut__conv_geom g;
  UT__CHECK_NULL(bn_cache && cache, UT_ERR_ARG,
                 "%s: both caches are required (backward reads them), got bn_cache %s and "
                 "cache %s", who, bn_cache ? "set" : "NULL", cache ? "set" : "NULL");
  if (ut__check_dwconv2d(l, who) < 0 || ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->c, l->c * ut__dw_mult(l), l->kh, l->kw, l->stride, l->pad,
                        ut__dw_dil(l), who) < 0)
    return NULL;
  ut__bn_forward_args fw;
  if (ut__bn_forward_prepare(bn, x, false, false, who, &fw) < 0) return NULL;
  const ut__backend* be = fw.be;
  const int C = bn->c;
  const ut_dtype dt = ut__buf_dtype(x, be);
  int rc = ut__bn_forward_stats(bn, x, &fw);
  float *mp = ut__out(fw.mean, be), *vp = ut__out(fw.var, be), *rp = ut__out(fw.rstd, be);
  ut_tensor *st = NULL, *out = NULL, *y = NULL;
  bool folded = false;
  if (rc >= 0 && be->dw_fwd_bn && be->bn_fold_pack && ut__dw_mult(l) == 1) {
    /* the normalization the dw cache keeps (mean, var, gamma, beta) and rstd for the
       BatchNorm's cache, then the kernels that normalize as they load, where the backend has
       them for this geometry and activation */
    st = ut__new(2, (int[]){4, C}, x->dev, who);
    float* sp = st ? ut__out(st, be) : NULL;
    rc = sp ? be->bn_fold_pack(mp, vp, fw.wp, fw.bp, rp, sp, C, bn->eps) : ut__err_status;
    const float* wp = rc >= 0 ? ut__in(l->weight, be) : NULL;
    const float* bp = (wp && l->bias) ? ut__in(l->bias, be) : NULL;
    out = (wp && (bp || !l->bias))
              ? ut__new_typed(4, (int[]){g.n, g.c, g.ho, g.wo}, x->dev, x->dtype, who)
              : NULL;
    if (rc >= 0 && !out) rc = ut__err_status;
    if (rc >= 0) {
      ut__wrote(st, be);
      ut__dw_bn d = {sp, sp + C, sp + 2 * C, sp + 3 * C, bn->eps, bn->activation};
      int took = be->dw_fwd_bn(dt, fw.xp, wp, bp, ut__out(out, be), &g, &d);
      folded = took != 1;
      if (took < 0) rc = took;
    }
    if (rc >= 0 && folded) {
      ut__wrote(out, be);
    } else {
      ut_free_all(st, out);
      st = out = NULL;
    }
  }
  if (rc >= 0 && !folded) {
    /* no such kernels here: the two layers as they are, act(bn(x)) kept for backward */
    y = ut__new_like(x, who);
    rc = y ? ut__bn_apply(be, x, fw.xp, y, mp, vp, fw.wp, fw.bp, rp, bn->eps, bn->activation)
           : ut__err_status;
    if (rc >= 0) {
      ut__wrote(y, be);
      out = ut__dw_forward(l, y, g, who);
      if (!out) rc = ut__err_status;
    }
  }
  ut_free(fw.var);
  ut__bn_forward_done(rc, bn, x, bn_cache, &fw, false);
  if (rc < 0) {
    ut_free_all(st, y, out);
    return NULL;
  }
  cache->input = folded ? ut_retain(x) : y;
  cache->bn = st;
  cache->bn_eps = bn->eps;
  cache->bn_act = bn->activation;
  return out;
}

/* Both backwards take the same arguments past the cache's own checks (which differ: each
   refuses the other forward's cache): one place checks them and fetches what the kernels read,
   so the two keep the same checks and messages. */
typedef struct ut__bn_backward_args {
  const ut__backend* be;
  const float *gop, *xp, *wp, *bp, *mp, *rp; /* grad_out, x, gamma, beta, mean, rstd */
  float *dWp, *dbp;                          /* NULL where dW, db are */
  int n, c;
  ut__i64 inner;
} ut__bn_backward_args;
static int ut__bn_backward_prepare(ut_batchnorm2d* l, ut_batchnorm2d_cache* cache,
                                   ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db,
                                   const char* who, ut__bn_backward_args* bw) {
  ut_tensor* x = cache->input;
  UT__TRY(ut__check_batchnorm2d(l, x, who));
  /* backward applies the activation the forward applied, which the cache holds */
  UT__CHECK(ut__act_valid(cache->activation), UT_ERR_ARG,
            "%s: cache->activation must be a ut_activation (%d to %d), got %d", who, UT_ACT_NONE,
            UT_ACT_GELU_TANH, cache->activation);
  UT__TRY(ut__check_arg(grad_out, x, x->shape.nelem, who, "grad_out"));
  UT__TRY(ut__check_dtype_as(grad_out, x, who, "grad_out", "cache->input"));
  UT__TRY(ut__check_arg(cache->mean, x, l->c, who, "cache->mean"));
  UT__TRY(ut__check_arg(cache->rstd, x, l->c, who, "cache->rstd"));
  if (dW) UT__TRY(ut__check_arg(dW, x, l->c, who, "dW"));
  if (db) UT__TRY(ut__check_arg(db, x, l->c, who, "db"));
  UT__TRY(ut__check_f32(dW, who, "dW"));
  UT__TRY(ut__check_f32(db, who, "db"));
  UT__CHECK(ut__same_shape(grad_out, x), UT_ERR_SHAPE,
            "%s: grad_out has shape %s, the forward output had %s", who,
            ut__shape_text(grad_out).s, ut__shape_text(x).s);
  bw->n = x->shape.shape[0];
  bw->c = l->c;
  bw->inner = (ut__i64)x->shape.shape[2] * x->shape.shape[3];
  const ut__backend* be = bw->be = ut__backend_for(x->dev);
  bw->gop = ut__in(grad_out, be);
  bw->xp = bw->gop ? ut__in(x, be) : NULL;
  bw->wp = bw->xp ? ut__in(l->weight, be) : NULL;
  bw->bp = bw->wp ? ut__in(l->bias, be) : NULL;
  bw->mp = bw->bp ? ut__in(cache->mean, be) : NULL;
  bw->rp = bw->mp ? ut__in(cache->rstd, be) : NULL;
  bw->dWp = (bw->rp && dW) ? ut__inout(dW, be) : NULL;
  bw->dbp = (bw->rp && db) ? ut__inout(db, be) : NULL;
  if (!bw->rp || (dW && !bw->dWp) || (db && !bw->dbp)) return ut__err_status;
  return UT_OK;
}

ut_tensor* ut_batchnorm2d_backward(ut_batchnorm2d* l, ut_batchnorm2d_cache* cache,
                                   ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_batchnorm2d_backward";
  UT__CHECK_NULL(cache && cache->input && cache->mean && cache->rstd, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  UT__CHECK_NULL(!(cache->synced && cache->training), UT_ERR_ARG,
                 "%s: the cache is from ut_batchnorm2d_forward_sync: use "
                 "ut_batchnorm2d_backward_sync with the same reduce", who);
  ut__bn_backward_args bw;
  if (ut__bn_backward_prepare(l, cache, grad_out, dW, db, who, &bw) < 0) return NULL;
  ut_tensor* x = cache->input;
  const ut__backend* be = bw.be;
  ut_tensor* dx = ut__new_like(x, who);
  if (!dx) return NULL;
  int rc = be->bn_bwd(ut__buf_dtype(x, be), bw.gop, bw.xp, bw.mp, bw.rp, bw.wp, bw.bp,
                      ut__out(dx, be), bw.dWp, bw.dbp, bw.n, bw.c, bw.inner, cache->training,
                      cache->activation);
  return ut__backward_done(rc, be, dx, dW, bw.dWp, db, bw.dbp);
}

/* reduce(ctx, t) on a tensor the core made: the callee sees t current on the device */
static int ut__reduce_call(ut_reduce_fn reduce, void* ctx, ut_tensor* t, const ut__backend* be,
                           const char* who) {
  ut__wrote(t, be);
  ut_clear_error();
  int rc = reduce(ctx, t);
  if (rc < 0) {
    if (!ut__err_msg[0]) ut__set_error(rc, "%s: reduce failed with status %d", who, rc);
    return rc;
  }
  return ut__inout(t, be) ? UT_OK : ut__err_status;
}

ut_tensor* ut_batchnorm2d_forward_sync(ut_batchnorm2d* l, ut_tensor* x,
                                       ut_batchnorm2d_cache* cache, ut_reduce_fn reduce,
                                       void* ctx) {
  const char* who = "ut_batchnorm2d_forward_sync";
  if (!reduce || (l && !l->training)) return ut_batchnorm2d_forward(l, x, cache);
  ut__bn_forward_args fw;
  if (ut__bn_forward_prepare(l, x, true, true, who, &fw) < 0) return NULL;
  const ut__backend* be = fw.be;
  int C = l->c;
  float count = (float)fw.count;
  ut_tensor* a = ut__new(1, (int[]){C + 1}, x->dev, who);
  ut_tensor* b = a ? ut__new(1, (int[]){C + 1}, x->dev, who) : NULL;
  int rc = b ? UT_OK : ut__err_status;
  float* mp = ut__out(fw.mean, be);
  float* vp = ut__out(fw.var, be);
  if (rc >= 0) rc = ut__bn_stats(be, x, fw.xp, mp, vp);
  if (rc >= 0) rc = be->bn_sync_pack(mp, vp, NULL, ut__out(a, be), C, count);
  if (rc >= 0) rc = ut__reduce_call(reduce, ctx, a, be, who);
  if (rc >= 0) rc = be->bn_sync_pack(mp, vp, ut__in(a, be), ut__out(b, be), C, count);
  if (rc >= 0) rc = ut__reduce_call(reduce, ctx, b, be, who);
  float* rm = rc >= 0 ? ut__inout(l->running_mean, be) : NULL;
  float* rv = rm ? ut__inout(l->running_var, be) : NULL;
  if (rc >= 0 && !rv) rc = ut__err_status;
  if (rc >= 0)
    rc = be->bn_sync_unpack(ut__in(a, be), ut__in(b, be), mp, vp, rm, rv, C, l->momentum);
  if (rc >= 0) {
    ut__wrote(l->running_mean, be);
    ut__wrote(l->running_var, be);
    rc = ut__bn_apply(be, x, fw.xp, fw.y, mp, vp, fw.wp, fw.bp, ut__out(fw.rstd, be), l->eps,
                      l->activation);
  }
  ut_free_all(fw.var, a, b);
  return ut__bn_forward_done(rc, l, x, cache, &fw, true);
}

ut_tensor* ut_batchnorm2d_backward_sync(ut_batchnorm2d* l, ut_batchnorm2d_cache* cache,
                                        ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db,
                                        ut_reduce_fn reduce, void* ctx) {
  const char* who = "ut_batchnorm2d_backward_sync";
  UT__CHECK_NULL(cache && cache->input && cache->mean && cache->rstd, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  if (!cache->training || !reduce) {
    UT__CHECK_NULL(!cache->synced || !cache->training, UT_ERR_ARG,
                   "%s: the cache's statistics were every rank's: backward needs the reduce "
                   "too (got NULL)", who);
    return ut_batchnorm2d_backward(l, cache, grad_out, dW, db);
  }
  UT__CHECK_NULL(cache->synced, UT_ERR_ARG,
                 "%s: the cache is from ut_batchnorm2d_forward (this rank's statistics only): "
                 "a synchronized backward needs ut_batchnorm2d_forward_sync", who);
  ut__bn_backward_args bw;
  if (ut__bn_backward_prepare(l, cache, grad_out, dW, db, who, &bw) < 0) return NULL;
  ut_tensor* x = cache->input;
  const ut__backend* be = bw.be;
  ut_tensor* sums = ut__new(1, (int[]){2 * bw.c + 1}, x->dev, who);
  ut_tensor* dx = sums ? ut__new_like(x, who) : NULL;
  if (!dx) return ut__drop(sums);
  int act = cache->activation;
  ut_dtype dt = ut__buf_dtype(x, be);
  int rc = be->bn_bwd_sums(dt, bw.gop, bw.xp, bw.mp, bw.rp, bw.wp, bw.bp, ut__out(sums, be),
                           bw.dWp, bw.dbp, bw.n, bw.c, bw.inner, act);
  if (rc >= 0) {
    /* this rank's share of dW and db is final: mark it before the reduce runs other code */
    if (bw.dWp) ut__wrote(dW, be);
    if (bw.dbp) ut__wrote(db, be);
    rc = ut__reduce_call(reduce, ctx, sums, be, who);
  }
  if (rc >= 0)
    rc = be->bn_bwd_dx(dt, bw.gop, bw.xp, bw.mp, bw.rp, bw.wp, bw.bp, ut__in(sums, be),
                       ut__out(dx, be), bw.n, bw.c, bw.inner, act);
  ut_free(sums);
  return ut__finish(dx, be, rc);
}

/* ---- inference: convolution + BatchNorm2d folded (issue 32) -------------------------------- */

/* The BatchNorm after a convolution of out_c channels: in eval mode, its tensors on w's device. */
static int ut__check_fold_bn(const ut_batchnorm2d* bn, int out_c, const ut_tensor* w, int act,
                             const char* who) {
  UT__CHECK(bn, UT_ERR_ARG, "%s: the BatchNorm2d is NULL", who);
  UT__CHECK(!bn->training, UT_ERR_ARG,
            "%s: the BatchNorm2d is in training mode; the fold uses its running statistics, so "
            "it is for eval mode only (set training false, or run the two layers' forwards)",
            who);
  UT__CHECK(bn->c == out_c, UT_ERR_SHAPE,
            "%s: the BatchNorm2d has %d channels, the convolution %d output channels", who,
            bn->c, out_c);
  UT__TRY(ut__check_eps(bn->eps, who));
  UT__CHECK(ut__act_valid(bn->activation), UT_ERR_ARG,
            "%s: the BatchNorm2d's activation must be a ut_activation (%d to %d), got %d", who,
            UT_ACT_NONE, UT_ACT_GELU_TANH, bn->activation);
  UT__CHECK(ut__act_valid(act), UT_ERR_ARG, "%s: act must be a ut_activation (%d to %d), got %d",
            who, UT_ACT_NONE, UT_ACT_GELU_TANH, act);
  UT__CHECK(act == UT_ACT_NONE || bn->activation == UT_ACT_NONE, UT_ERR_ARG,
            "%s: the BatchNorm2d applies %s already; act (%s) must be UT_ACT_NONE", who,
            ut_activation_name((ut_activation)bn->activation),
            ut_activation_name((ut_activation)act));
  UT__CHECK(bn->weight && bn->bias && bn->running_mean && bn->running_var, UT_ERR_ARG,
            "%s: the BatchNorm2d's tensors are not allocated", who);
  const ut_tensor* t[4] = {bn->weight, bn->bias, bn->running_mean, bn->running_var};
  const char* names[4] = {"the BatchNorm2d's weight", "the BatchNorm2d's bias",
                          "the BatchNorm2d's running_mean", "the BatchNorm2d's running_var"};
  for (int i = 0; i < 4; i++) {
    UT__TRY(ut__check_arg(t[i], w, out_c, who, names[i]));
    UT__TRY(ut__check_f32(t[i], who, names[i]));
  }
  return UT_OK;
}

/* (the CPU backend's host arithmetic, at its end) */
static void ut__fold_rows(int c, double eps, const float* g, const float* b, const float* m,
                          const float* v, const float* cb, float* scale, float* shift);
static void ut__scale_filters(int c, ut__i64 taps, const float* w, const float* scale,
                              float* out);
static bool ut__cpu_all_finite(const float* x, ut__i64 n);

/* scale and shift [c] (host memory) from the layers' values now, in double, rounded once:
   batchnorm's own rstd = 1 / sqrt(var + eps) in double, so a channel's scale is its gamma rstd.
   The CPU backend's host copies are the only ones: read in place. */
static int ut__fold_bn(ut_batchnorm2d* bn, ut_tensor* conv_bias, const ut__backend* be,
                       float* scale, float* shift) {
  const float* g = ut__in(bn->weight, be);
  const float* b = g ? ut__in(bn->bias, be) : NULL;
  const float* m = b ? ut__in(bn->running_mean, be) : NULL;
  const float* v = m ? ut__in(bn->running_var, be) : NULL;
  const float* cb = v && conv_bias ? ut__in(conv_bias, be) : NULL;
  if (!v || (conv_bias && !cb)) return ut__err_status;
  ut__fold_rows(bn->c, (double)bn->eps, g, b, m, v, cb, scale, shift);
  return UT_OK;
}

/* the one activation of the call: the BatchNorm's own, or the layer's after it (never both) */
static int ut__fold_act(const ut_batchnorm2d* bn, ut_activation act) {
  return bn->activation != UT_ACT_NONE ? bn->activation : (int)act;
}

/* Whether the fused path serves x (the CPU, float32); else each layer's forward in turn. The
   CPU backend's host copies are the only copies, so the fold reads them in place. */
static bool ut__fold_runs_here(const ut_tensor* x, const ut__backend* be) {
  return !ut__is_device_backend(be) && x->dtype == UT_F32;
}
static ut_tensor* ut__bn_after(ut_tensor* y, ut_batchnorm2d* bn, int act) {
  if (!y) return NULL;
  ut_tensor* out = ut_batchnorm2d_forward(bn, y, NULL);
  ut_free(y);
  if (!out || act == UT_ACT_NONE) return out;
  ut_tensor* a = ut_activation_forward(out, (ut_activation)act);
  ut_free(out);
  return a;
}

/* the fused path's call: bn folded into a scale and shift per output channel (fresh from its
   statistics each call), the conv's epilogue applying them and act; in_scale as
   ut__conv_epi's (NULL: none) */
static ut_tensor* ut__conv2d_folded(ut_conv2d* l, ut_batchnorm2d* bn, ut_tensor* x, int act,
                                    const float* in_scale, const ut__backend* be,
                                    const char* who) {
  ut_tensor* fold = ut__new(1, (int[]){2 * l->out_c}, UT_CPU, who);
  if (!fold) return NULL;
  if (ut__fold_bn(bn, l->bias, be, fold->data, fold->data + l->out_c) < 0) return ut__drop(fold);
  ut__conv_epi epi = {fold->data, fold->data + l->out_c, ut__fold_act(bn, act), in_scale};
  ut_tensor* out = ut__conv2d_forward_epi(l, x, NULL, &epi, who);
  ut_free(fold);
  return out;
}

ut_tensor* ut_conv2d_bn_forward(ut_conv2d* l, ut_batchnorm2d* bn, ut_tensor* x,
                                ut_activation act) {
  const char* who = "ut_conv2d_bn_forward";
  ut__conv_geom g;
  if (ut__check_conv2d(l, who) < 0 ||
      ut__check_fold_bn(bn, l->out_c, l->weight, (int)act, who) < 0 ||
      ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->in_c, l->out_c, l->kh, l->kw, l->stride, l->pad, 1, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  if (!ut__fold_runs_here(x, be)) return ut__bn_after(ut_conv2d_forward(l, x, NULL), bn, act);
  const float* w = ut__in(l->weight, be);
  if (!w) return NULL;
  /* a padded layer's non-finite weight needs the exact pass (conv_exact), which the epilogue
     would run before: the unfused path */
  if (l->pad > 0 && !ut__cpu_all_finite(w, l->weight->shape.nelem))
    return ut__bn_after(ut_conv2d_forward(l, x, NULL), bn, act);
  return ut__conv2d_folded(l, bn, x, (int)act, NULL, be, who);
}

/* ut_conv2d_bn_forward of x * s[n, c] for a pointwise l (checked by the caller, as s: [N, c,
   1, 1] of x's dtype and device). The fused path scales the weight per image or a copy of the
   columns (ut__conv2d_forward_epi's in_scale); elsewhere ut_channel_scale runs first. */
static ut_tensor* ut__conv2d_bn_scaled(ut_conv2d* l, ut_batchnorm2d* bn, ut_tensor* x,
                                       ut_tensor* s, int act, const char* who) {
  const ut__backend* be = ut__backend_for(x->dev);
  if (!ut__fold_runs_here(x, be)) {
    ut_tensor* xs = ut_channel_scale(x, s);
    ut_tensor* y = xs ? ut_conv2d_bn_forward(l, bn, xs, (ut_activation)act) : NULL;
    ut_free(xs);
    return y;
  }
  const float* sp = ut__in(s, be);
  return sp ? ut__conv2d_folded(l, bn, x, act, sp, be, who) : NULL;
}

ut_tensor* ut_dwconv2d_bn_forward(ut_dwconv2d* l, ut_batchnorm2d* bn, ut_tensor* x,
                                  ut_activation act) {
  const char* who = "ut_dwconv2d_bn_forward";
  ut__conv_geom g;
  const int m = l ? ut__dw_mult(l) : 1;
  if (ut__check_dwconv2d(l, who) < 0 ||
      ut__check_fold_bn(bn, l->c * m, l->weight, (int)act, who) < 0 ||
      ut__check_arg(x, l->weight, -1, who, "x") < 0 ||
      ut__conv_geometry(&g, x, l->c, l->c * m, l->kh, l->kw, l->stride, l->pad, ut__dw_dil(l),
                        who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  if (!ut__fold_runs_here(x, be) || !be->dw_fwd_act)
    return ut__bn_after(ut_dwconv2d_forward(l, x, NULL), bn, act);
  /* the filters scaled per channel (kh*kw values each), the shift as their bias */
  int oc = l->c * m;
  ut__i64 taps = (ut__i64)l->kh * l->kw;
  ut_tensor* fold = ut__new(1, (int[]){(int)(oc * (taps + 2))}, UT_CPU, who);
  if (!fold) return NULL;
  float *scale = fold->data, *shift = scale + oc, *wf = shift + oc;
  const float* w = ut__in(l->weight, be);
  const float* xp = w ? ut__in(x, be) : NULL;
  if (!xp || ut__fold_bn(bn, l->bias, be, scale, shift) < 0) return ut__drop(fold);
  ut__scale_filters(oc, taps, w, scale, wf);
  ut_tensor *xr = NULL, *out = NULL;
  if (m > 1) {
    xr = ut__dw_repeat(x, xp, m, be, who);
    xp = xr ? xr->data : NULL;
    g.c *= m;
  }
  if (xp) out = ut__new_typed(4, (int[]){g.n, g.c, g.ho, g.wo}, x->dev, x->dtype, who);
  if (out)
    out = ut__finish(out, be, be->dw_fwd_act(UT_F32, xp, wf, shift, out->data, &g,
                                             ut__fold_act(bn, act)));
  ut_free_all(xr, fold);
  return out;
}

/* A 1x1, stride 1, unpadded convolution (the expand and project of a separable block). */
static int ut__check_pointwise(const ut_conv2d* l, const ut_tensor* x, const char* who,
                               const char* name) {
  UT__CHECK(l, UT_ERR_ARG, "%s: %s is NULL", who, name);
  UT__TRY(ut__check_conv2d(l, who));
  UT__CHECK(l->kh == 1 && l->kw == 1 && l->stride == 1 && l->pad == 0, UT_ERR_ARG,
            "%s: %s must be a 1x1 convolution with stride 1 and no padding, got %dx%d, stride "
            "%d, padding %d", who, name, l->kh, l->kw, l->stride, l->pad);
  return ut__check_same_dev(x, l->weight, who, name);
}

/* The block's squeeze-and-excitation: both convolutions or neither, pointwise, c -> r -> c
   over the depthwise's c output channels, valid activations. */
static int ut__check_sep_se(const ut_separable_block* b, const ut_tensor* x, int c,
                            const char* who) {
  if (!b->se_reduce && !b->se_expand) return UT_OK;
  UT__CHECK(b->se_reduce && b->se_expand, UT_ERR_ARG,
            "%s: se_reduce and se_expand are both set or both NULL, got %s NULL", who,
            b->se_reduce ? "se_expand" : "se_reduce");
  UT__TRY(ut__check_pointwise(b->se_reduce, x, who, "se_reduce"));
  UT__TRY(ut__check_pointwise(b->se_expand, x, who, "se_expand"));
  int r = b->se_reduce->out_c;
  UT__CHECK(b->se_reduce->in_c == c && b->se_expand->in_c == r && b->se_expand->out_c == c,
            UT_ERR_SHAPE,
            "%s: the squeeze-and-excitation must map the depthwise's %d channels to r and back "
            "(se_reduce %d -> %d, se_expand %d -> %d)", who, c, b->se_reduce->in_c, r,
            b->se_expand->in_c, b->se_expand->out_c);
  UT__CHECK(ut__act_valid(b->act_se_reduce) && ut__act_valid(b->act_se_expand), UT_ERR_ARG,
            "%s: act_se_reduce and act_se_expand must be ut_activations (%d to %d), got %d and "
            "%d", who, UT_ACT_NONE, UT_ACT_GELU_TANH, b->act_se_reduce, b->act_se_expand);
  return UT_OK;
}

/* The block's fused path: the CPU in float32, a depthwise the row engines take on a band of
   rows (pad_h 0 over rows the block zeroes itself) without a pass of its own, a geometry the
   backend takes. */
static bool ut__sep_fused_here(const ut_separable_block* b, const ut_tensor* x,
                               const ut__conv_geom* gd, const ut__backend* be) {
  const ut_dwconv2d* d = b->dw;
  return be->sep_fwd && be->sep_takes && ut__fold_runs_here(x, be) && ut__dw_mult(d) == 1 &&
         ut__dw_dil(d) == 1 && d->stride <= 2 && d->kh <= 7 && d->kw <= 7 &&
         be->sep_takes(gd, x->shape.shape[1], b->expand != NULL);
}

/* act(x), consuming x; x itself for UT_ACT_NONE */
static ut_tensor* ut__act_consume(ut_tensor* x, ut_activation act) {
  if (!x || act == UT_ACT_NONE) return x;
  ut_tensor* y = ut_activation_forward(x, act);
  ut_free(x);
  return y;
}
/* The excitation of d [N, C, H, W]: [N, C, 1, 1] =
   act_se_expand(se_expand(act_se_reduce(se_reduce(mean over H, W of d)))) */
static ut_tensor* ut__sep_excitation(const ut_separable_block* b, ut_tensor* d) {
  ut_tensor* p = ut_global_avgpool2d_forward(d);
  if (!p) return NULL;
  ut_shape s4;
  if (ut__shape_make(&s4, 4, (int[]){p->shape.shape[0], p->shape.shape[1], 1, 1},
                     "ut_separable_block_forward") < 0)
    return ut__drop(p);
  p->shape = s4; /* [N, C] as the 1x1 convolutions' [N, C, 1, 1]: the same values */
  ut_tensor* r = ut__act_consume(ut_conv2d_forward(b->se_reduce, p, NULL), b->act_se_reduce);
  ut_free(p);
  if (!r) return NULL;
  ut_tensor* e = ut__act_consume(ut_conv2d_forward(b->se_expand, r, NULL), b->act_se_expand);
  ut_free(r);
  return e;
}

/* The three folded forwards in turn (and the excitation, the residual): every path but the
   fused one. */
static ut_tensor* ut__sep_unfused(const ut_separable_block* b, ut_tensor* x) {
  ut_tensor* e = x;
  if (b->expand) e = ut_conv2d_bn_forward(b->expand, b->bn_expand, x, b->act_expand);
  if (!e) return NULL;
  ut_tensor* d = ut_dwconv2d_bn_forward(b->dw, b->bn_dw, e, b->act_dw);
  if (e != x) ut_free(e);
  if (!d) return NULL;
  ut_tensor* y = NULL;
  if (b->se_reduce) {
    ut_tensor* s = ut__sep_excitation(b, d);
    if (s) y = ut__conv2d_bn_scaled(b->project, b->bn_project, d, s, b->act_project,
                                    "ut_separable_block_forward");
    ut_free(s);
  } else {
    y = ut_conv2d_bn_forward(b->project, b->bn_project, d, b->act_project);
  }
  ut_free(d);
  if (y && b->residual && ut_add_into(y, x) < 0) return ut__drop(y);
  return y;
}

ut_tensor* ut_separable_block_forward(const ut_separable_block* b, ut_tensor* x) {
  const char* who = "ut_separable_block_forward";
  UT__CHECK_NULL(b, UT_ERR_ARG, "%s: the block is NULL", who);
  UT__CHECK_NULL(b->dw, UT_ERR_ARG, "%s: the block's dw is NULL", who);
  if (ut__check_dwconv2d(b->dw, who) < 0 || ut__check_arg(x, b->dw->weight, -1, who, "x") < 0 ||
      ut__check_pointwise(b->project, x, who, "project") < 0 ||
      (b->expand && ut__check_pointwise(b->expand, x, who, "expand") < 0))
    return NULL;
  const ut_dwconv2d* dl = b->dw;
  int m = ut__dw_mult(dl), e = dl->c, oc = b->project->out_c;
  ut__conv_geom gx, gd;
  if (b->expand) {
    if (ut__conv_geometry(&gx, x, b->expand->in_c, b->expand->out_c, 1, 1, 1, 0, 1, who) < 0)
      return NULL;
    UT__CHECK_NULL(b->expand->out_c == e, UT_ERR_SHAPE,
                   "%s: expand has %d output channels, dw expects %d", who, b->expand->out_c, e);
  }
  /* the depthwise's geometry over the expanded channels: x's shape with e channels */
  ut_tensor xe = *x;
  xe.shape.shape[1] = e;
  if (ut__conv_geometry(&gd, b->expand ? &xe : x, e, e * m, dl->kh, dl->kw, dl->stride, dl->pad,
                        ut__dw_dil(dl), who) < 0)
    return NULL;
  UT__CHECK_NULL(b->project->in_c == e * m, UT_ERR_SHAPE,
                 "%s: dw has %d output channels, project expects %d", who, e * m,
                 b->project->in_c);
  UT__CHECK_NULL(!b->residual || (oc == x->shape.shape[1] && gd.ho == gd.h && gd.wo == gd.w),
                 UT_ERR_SHAPE,
                 "%s: the residual needs y of x's shape: x %s, y [%d, %d, %d, %d] (stride 1, "
                 "project out_c == x's channels)",
                 who, ut__shape_text(x).s, gd.n, oc, gd.ho, gd.wo);
  if (ut__check_sep_se(b, x, e * m, who) < 0) return NULL;
  if ((b->expand && ut__check_fold_bn(b->bn_expand, e, b->expand->weight, (int)b->act_expand,
                                      who) < 0) ||
      ut__check_fold_bn(b->bn_dw, e * m, dl->weight, (int)b->act_dw, who) < 0 ||
      ut__check_fold_bn(b->bn_project, oc, b->project->weight, (int)b->act_project, who) < 0)
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  /* the excitation needs the whole depthwise output before the project: no bands */
  if (b->se_reduce || !ut__sep_fused_here(b, x, &gd, be)) return ut__sep_unfused(b, x);
  /* the folds: expand's and project's scale and shift, the depthwise's filters scaled */
  ut__i64 taps = (ut__i64)dl->kh * dl->kw;
  ut__i64 nf = 2LL * e + 2LL * e + e * taps + 2LL * oc;
  ut_tensor* fold = ut__new(1, (int[]){(int)nf}, UT_CPU, who);
  if (!fold) return NULL;
  float *es = fold->data, *eh = es + e, *ds = eh + e, *dh = ds + e, *wd = dh + e,
        *ps = wd + e * taps, *ph = ps + oc;
  const float* wdl = ut__in(dl->weight, be);
  const float* wp = wdl ? ut__in(b->project->weight, be) : NULL;
  const float* we = wp && b->expand ? ut__in(b->expand->weight, be) : NULL;
  const float* xp = wp && (!b->expand || we) ? ut__in(x, be) : NULL;
  if (!xp || (b->expand && ut__fold_bn(b->bn_expand, b->expand->bias, be, es, eh) < 0) ||
      ut__fold_bn(b->bn_dw, dl->bias, be, ds, dh) < 0 ||
      ut__fold_bn(b->bn_project, b->project->bias, be, ps, ph) < 0)
    return ut__drop(fold);
  ut__scale_filters(e, taps, wdl, ds, wd);
  /* the rows past the image the fused path zeroes itself are padding the depthwise multiplies:
     a non-finite filter needs the exact pass of the layer's own path */
  if (!ut__cpu_all_finite(wd, e * taps)) {
    ut_free(fold);
    return ut__sep_unfused(b, x);
  }
  ut_tensor* out = ut__new_typed(4, (int[]){gd.n, oc, gd.ho, gd.wo}, x->dev, x->dtype, who);
  if (out) {
    int eact = b->expand ? ut__fold_act(b->bn_expand, b->act_expand) : UT_ACT_NONE;
    ut__sep_args a = {xp, out->data, x->shape.shape[1], oc, we, es, eh, eact,
                      wd, dh, ut__fold_act(b->bn_dw, b->act_dw), gd, wp, ps, ph,
                      ut__fold_act(b->bn_project, b->act_project), b->residual,
                      b->expand ? b->expand->weight : NULL, b->project->weight};
    out = ut__finish(out, be, be->sep_fwd(&a));
  }
  ut_free(fold);
  return out;
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
  if (ut__check_tensor(x, who, "x") < 0) return NULL;
  UT__CHECK_NULL(x->shape.ndim == 4, UT_ERR_SHAPE, "%s: x must be [N, C, H, W], got shape %s", who,
                 ut__shape_text(x).s);
  int N = x->shape.shape[0], C = x->shape.shape[1];
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  if (!xp) return NULL;
  ut_tensor* y = ut__new_typed(2, (int[]){N, C}, x->dev, x->dtype, who);
  if (!y) return NULL;
  ut__i64 hw = (ut__i64)x->shape.shape[2] * x->shape.shape[3];
  return ut__finish(y, be, be->row_mean(ut__buf_dtype(x, be), xp, ut__out(y, be), N * C, hw));
}

ut_tensor* ut_global_avgpool2d_backward(ut_tensor* grad_out, int h, int w) {
  const char* who = "ut_global_avgpool2d_backward";
  if (ut__check_tensor(grad_out, who, "grad_out") < 0) return NULL;
  UT__CHECK_NULL(grad_out->shape.ndim == 2, UT_ERR_SHAPE,
                 "%s: grad_out must be [N, C], got shape %s", who, ut__shape_text(grad_out).s);
  UT__CHECK_NULL(h >= 1 && w >= 1, UT_ERR_SHAPE, "%s: h and w must be positive, got %d x %d", who,
                 h, w);
  int N = grad_out->shape.shape[0], C = grad_out->shape.shape[1];
  const ut__backend* be = ut__backend_for(grad_out->dev);
  const float* gp = ut__in(grad_out, be);
  if (!gp) return NULL;
  ut_tensor* dx = ut__new_typed(4, (int[]){N, C, h, w}, grad_out->dev, grad_out->dtype, who);
  if (!dx) return NULL;
  ut__i64 hw = (ut__i64)h * w;
  return ut__finish(dx, be,
                    be->row_mean_bwd(ut__buf_dtype(grad_out, be), gp, ut__out(dx, be), N * C, hw));
}

/* ---- channel scales and LayerNorm2d (squeeze-and-excitation, ConvNeXt; issue 30) ---------- */
/* x: [N, C, ...]; s (named sname) of x's device: [N, C, 1, ..., 1] (per sample), or
   [C, 1, ..., 1] when shared */
static int ut__check_chan_scale(const ut_tensor* x, const ut_tensor* s, bool shared,
                                const char* who, const char* sname) {
  UT__TRY(ut__check_tensor(x, who, "x"));
  UT__CHECK(x->shape.ndim >= 2, UT_ERR_SHAPE, "%s: x must be [N, C, ...], got shape %s", who,
            ut__shape_text(x).s);
  UT__TRY(ut__check_arg(s, x, -1, who, sname));
  const int N = x->shape.shape[0], C = x->shape.shape[1];
  const int lead = shared ? 1 : 2;
  bool ok = s->shape.ndim >= lead &&
            (shared ? s->shape.shape[0] == C
                    : s->shape.shape[0] == N && s->shape.shape[1] == C);
  for (int i = lead; ok && i < s->shape.ndim; i++) ok = s->shape.shape[i] == 1;
  if (shared)
    UT__CHECK(ok, UT_ERR_SHAPE, "%s: %s must be [%d] or [%d, 1, ..., 1] (x has shape %s), got "
              "shape %s", who, sname, C, C, ut__shape_text(x).s, ut__shape_text(s).s);
  else
    UT__CHECK(ok, UT_ERR_SHAPE, "%s: %s must be [%d, %d] or [%d, %d, 1, ..., 1] (x has shape "
              "%s), got shape %s", who, sname, N, C, N, C, ut__shape_text(x).s,
              ut__shape_text(s).s);
  return shared ? ut__check_f32(s, who, sname) : ut__check_dtype_as(s, x, who, sname, "x");
}
/* grad_out: x's shape, dtype and device */
static ut__i64 ut__chan_inner(const ut_tensor* x) {
  return (ut__i64)x->shape.nelem / ((ut__i64)x->shape.shape[0] * x->shape.shape[1]);
}

/* y = x * s per channel (dx = grad_out * s is the same call on grad_out) */
static ut_tensor* ut__chan_scale(ut_tensor* x, ut_tensor* s, bool shared, const char* who) {
  const ut__backend* be = ut__backend_for(x->dev);
  const float* xp = ut__in(x, be);
  const float* sp = xp ? ut__in(s, be) : NULL;
  if (!sp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  if (!y) return NULL;
  return ut__finish(y, be, be->chan_scale(ut__buf_dtype(x, be), ut__buf_dtype(s, be), xp, sp,
                                          ut__out(y, be), x->shape.shape[0], x->shape.shape[1],
                                          ut__chan_inner(x), shared));
}

ut_tensor* ut_channel_scale(ut_tensor* x, ut_tensor* s) {
  const char* who = "ut_channel_scale";
  if (ut__check_chan_scale(x, s, false, who, "s") < 0) return NULL;
  return ut__chan_scale(x, s, false, who);
}

int ut_channel_scale_backward(ut_tensor* grad_out, ut_tensor* x, ut_tensor* s, ut_tensor** dx,
                              ut_tensor** ds) {
  const char* who = "ut_channel_scale_backward";
  if (dx) *dx = NULL;
  if (ds) *ds = NULL;
  UT__TRY(ut__check_chan_scale(x, s, false, who, "s"));
  UT__TRY(ut__check_grad_like(grad_out, x, who));
  UT__CHECK(!dx || dx != ds, UT_ERR_ARG, "%s: dx and ds must be different pointers", who);
  ut_tensor* dxt = NULL;
  if (dx && !(dxt = ut__chan_scale(grad_out, s, false, who))) return ut__err_status;
  if (ds) {
    const int N = x->shape.shape[0], C = x->shape.shape[1];
    const ut__backend* be = ut__backend_for(x->dev);
    const float* gp = ut__in(grad_out, be);
    const float* xp = gp ? ut__in(x, be) : NULL;
    ut_tensor* dst = xp ? ut__new_like(s, who) : NULL;
    if (!dst) {
      ut_free(dxt);
      return ut__err_status;
    }
    const ut_dtype dt = ut__buf_dtype(x, be);
    int rc;
    if (dt == UT_F32) {
      rc = be->chan_dot(dt, gp, xp, ut__out(dst, be), N, C, ut__chan_inner(x), false, 0.f);
    } else {
      /* the sums are float32: rounded to the activations' type once, at the end */
      ut_tensor* sum = ut__new(2, (int[]){N, C}, x->dev, who);
      rc = sum ? be->chan_dot(dt, gp, xp, ut__out(sum, be), N, C, ut__chan_inner(x), false, 0.f)
               : ut__err_status;
      if (rc >= 0) rc = be->cast(UT_F32, dt, ut__out(sum, be), ut__out(dst, be), (ut__i64)N * C);
      ut_free(sum);
    }
    if (!ut__finish(dst, be, rc)) {
      ut_free(dxt);
      return ut__err_status;
    }
    *ds = dst;
  }
  if (dx) *dx = dxt;
  return UT_OK;
}

ut_tensor* ut_layer_scale(ut_tensor* x, ut_tensor* gamma) {
  const char* who = "ut_layer_scale";
  if (ut__check_chan_scale(x, gamma, true, who, "gamma") < 0) return NULL;
  return ut__chan_scale(x, gamma, true, who);
}

ut_tensor* ut_layer_scale_backward(ut_tensor* grad_out, ut_tensor* x, ut_tensor* gamma,
                                   ut_tensor* dgamma) {
  const char* who = "ut_layer_scale_backward";
  if (ut__check_chan_scale(x, gamma, true, who, "gamma") < 0 ||
      ut__check_grad_like(grad_out, x, who) < 0)
    return NULL;
  const int N = x->shape.shape[0], C = x->shape.shape[1];
  if (dgamma && (ut__check_arg(dgamma, x, C, who, "dgamma") < 0 ||
                 ut__check_f32(dgamma, who, "dgamma") < 0 ||
                 ut__check_distinct(gamma, dgamma, who, "gamma", "dgamma") < 0))
    return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  const float* gp = ut__in(grad_out, be);
  const float* xp = gp ? ut__in(x, be) : NULL;
  const float* sp = xp ? ut__in(gamma, be) : NULL;
  float* dgp = (sp && dgamma) ? ut__inout(dgamma, be) : NULL;
  if (!sp || (dgamma && !dgp)) return NULL;
  ut_tensor* dx = ut__new_like(x, who);
  if (!dx) return NULL;
  const ut_dtype dt = ut__buf_dtype(x, be);
  int rc = be->chan_scale(dt, UT_F32, gp, sp, ut__out(dx, be), N, C, ut__chan_inner(x), true);
  if (rc >= 0 && dgp) rc = be->chan_dot(dt, gp, xp, dgp, N, C, ut__chan_inner(x), true, 1.f);
  return ut__backward_done(rc, be, dx, dgamma, dgp, NULL, NULL);
}

static int ut__check_layernorm2d(const ut_layernorm* l, const ut_tensor* x, const char* who) {
  UT__CHECK(l, UT_ERR_ARG, "%s: layer is NULL", who);
  UT__CHECK(l->dim >= 1, UT_ERR_ARG, "%s: invalid dim %d", who, l->dim);
  UT__TRY(ut__check_eps(l->eps, who));
  UT__CHECK(l->bias, UT_ERR_ARG, "%s: the layer's bias is NULL", who);
  UT__TRY(ut__check_params(l->weight, l->bias, l->dim, l->dim, who));
  UT__TRY(ut__check_arg(x, l->weight, -1, who, "x"));
  UT__CHECK(x->shape.ndim == 4 && x->shape.shape[1] == l->dim, UT_ERR_SHAPE,
            "%s: x must be [N, %d, H, W], got shape %s", who, l->dim, ut__shape_text(x).s);
  return UT_OK;
}

ut_tensor* ut_layernorm2d_forward(ut_layernorm* l, ut_tensor* x, ut_layernorm_cache* cache) {
  const char* who = "ut_layernorm2d_forward";
  if (ut__check_layernorm2d(l, x, who) < 0) return NULL;
  const ut__backend* be = ut__backend_for(x->dev);
  const int N = x->shape.shape[0], H = x->shape.shape[2], W = x->shape.shape[3];
  const float* xp = ut__in(x, be);
  const float* wp = xp ? ut__in(l->weight, be) : NULL;
  const float* bp = wp ? ut__in(l->bias, be) : NULL;
  if (!bp) return NULL;
  ut_tensor* y = ut__new_like(x, who);
  ut_tensor* mean = y ? ut__new(3, (int[]){N, H, W}, x->dev, who) : NULL;
  ut_tensor* rstd = mean ? ut__new(3, (int[]){N, H, W}, x->dev, who) : NULL;
  int rc = rstd ? be->ln2d_fwd(ut__buf_dtype(x, be), xp, wp, bp, ut__out(y, be),
                               ut__out(mean, be), ut__out(rstd, be), N, l->dim,
                               (ut__i64)H * W, l->eps)
                : ut__err_status;
  if (rc < 0 || !cache) {
    ut_free_all(mean, rstd);
    return ut__finish(y, be, rc);
  }
  ut__wrote(y, be);
  ut__wrote(mean, be);
  ut__wrote(rstd, be);
  cache->input = ut_retain(x);
  cache->mean = mean;
  cache->rstd = rstd;
  return y;
}

ut_tensor* ut_layernorm2d_backward(ut_layernorm* l, ut_layernorm_cache* cache,
                                   ut_tensor* grad_out, ut_tensor* dW, ut_tensor* db) {
  const char* who = "ut_layernorm2d_backward";
  UT__CHECK_NULL(cache && cache->input && cache->mean && cache->rstd, UT_ERR_ARG,
                 "%s: the cache is empty (run forward with a cache first)", who);
  ut_tensor* x = cache->input;
  if (ut__check_layernorm2d(l, x, who) < 0 || ut__check_grad_like(grad_out, x, who) < 0)
    return NULL;
  const int N = x->shape.shape[0], H = x->shape.shape[2], W = x->shape.shape[3];
  const ut__backend* be = ut__backend_for(x->dev);
  ut__ln_grad_io io;
  if (ut__ln_grad_io_get(l, cache, grad_out, dW, db, x->shape.nelem / l->dim, 3, who, be, &io) < 0)
    return NULL;
  ut_tensor* dx = ut__new_like(x, who);
  if (!dx) return NULL;
  int rc = be->ln2d_bwd(ut__buf_dtype(x, be), io.go, io.x, io.w, io.mean, io.rstd,
                        ut__out(dx, be), io.dW, io.db, N, l->dim, (ut__i64)H * W);
  return ut__backward_done(rc, be, dx, dW, io.dW, db, io.db);
}

/* ---- losses ------------------------------------------------------------------------------- */
static int ut__check_pair(ut_tensor* pred, ut_tensor* target, const char* who) {
  UT__TRY(ut__check_tensor(pred, who, "pred"));
  UT__TRY(ut__check_arg(target, pred, -1, who, "target"));
  UT__TRY(ut__check_f32(pred, who, "pred"));
  UT__TRY(ut__check_f32(target, who, "target"));
  UT__CHECK(ut__same_shape(pred, target), UT_ERR_SHAPE,
            "%s: pred has shape %s but target has shape %s (they must match)", who,
            ut__shape_text(pred).s, ut__shape_text(target).s);
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
  UT__CHECK(logits->shape.ndim == 2, UT_ERR_SHAPE, "%s: logits must be [N, K], got shape %s", who,
            ut__shape_text(logits).s);
  int N = logits->shape.shape[0], K = logits->shape.shape[1];
  UT__TRY(ut__check_arg(labels, logits, -1, who, "labels"));
  UT__TRY(ut__check_f32(labels, who, "labels"));
  UT__CHECK(labels->shape.ndim == 1 && labels->shape.shape[0] == N, UT_ERR_SHAPE,
            "%s: labels must be [N] = [%d] (one class index per row of logits), got shape %s", who,
            N, ut__shape_text(labels).s);
  if (!labels->dirty_cpu) { /* the host copy is current: check the labels without a transfer */
    for (int i = 0; i < N; i++) {
      float v = labels->data[i];
      UT__CHECK(v >= 0.f && (double)v < (double)K && v == floorf(v), UT_ERR_ARG,
                "%s: labels[%d] = %.9g is not a class index in [0, %d)", who, i, (double)v, K);
    }
  }
  return UT_OK;
}

/* The loss is float32 math whatever the logits' type (bf16 logits are widened first: a
   [N, K] copy, small next to the network's activations); the gradient has the logits' type. */
static int ut__check_smoothing(float eps, const char* who) {
  UT__CHECK(eps >= 0.f && eps <= 1.f, UT_ERR_ARG,
            "%s: label_smoothing must be between 0.0 and 1.0. Got: %g", who, (double)eps);
  return UT_OK;
}

static ut_tensor* ut__ce_loss(ut_tensor* logits, ut_tensor* labels, float eps, const char* who) {
  if (ut__check_ce(logits, labels, who) < 0 || ut__check_smoothing(eps, who) < 0) return NULL;
  ut_tensor* lf = logits->dtype == UT_F32 ? ut_retain(logits) : ut__to_dtype(logits, UT_F32, who);
  const ut__backend* be = ut__backend_for(logits->dev);
  const float* lp = lf ? ut__in(lf, be) : NULL;
  const float* yp = lp ? ut__in(labels, be) : NULL;
  ut_tensor* out = yp ? ut__new(1, (int[]){1}, logits->dev, who) : NULL;
  if (out)
    out = ut__finish(out, be, be->ce_fwd(lp, yp, ut__out(out, be), logits->shape.shape[0],
                                         logits->shape.shape[1], eps));
  ut_free(lf);
  return out;
}

ut_tensor* ut_cross_entropy_loss(ut_tensor* logits, ut_tensor* labels) {
  return ut__ce_loss(logits, labels, 0.f, "ut_cross_entropy_loss");
}
ut_tensor* ut_cross_entropy_loss_smoothed(ut_tensor* logits, ut_tensor* labels,
                                          float label_smoothing) {
  return ut__ce_loss(logits, labels, label_smoothing, "ut_cross_entropy_loss_smoothed");
}

static ut_tensor* ut__ce_bwd(ut_tensor* logits, ut_tensor* labels, float eps, const char* who) {
  if (ut__check_ce(logits, labels, who) < 0 || ut__check_smoothing(eps, who) < 0) return NULL;
  ut_tensor* lf = logits->dtype == UT_F32 ? ut_retain(logits) : ut__to_dtype(logits, UT_F32, who);
  const ut__backend* be = ut__backend_for(logits->dev);
  const float* lp = lf ? ut__in(lf, be) : NULL;
  const float* yp = lp ? ut__in(labels, be) : NULL;
  ut_tensor* g = yp ? ut__new(2, logits->shape.shape, logits->dev, who) : NULL;
  if (g)
    g = ut__finish(g, be, be->ce_bwd(lp, yp, ut__out(g, be), logits->shape.shape[0],
                                     logits->shape.shape[1], eps));
  ut_free(lf);
  if (!g || logits->dtype == UT_F32) return g;
  ut_tensor* gb = ut__to_dtype(g, logits->dtype, who);
  ut_free(g);
  return gb;
}

ut_tensor* ut_cross_entropy_backward(ut_tensor* logits, ut_tensor* labels) {
  return ut__ce_bwd(logits, labels, 0.f, "ut_cross_entropy_backward");
}
ut_tensor* ut_cross_entropy_backward_smoothed(ut_tensor* logits, ut_tensor* labels,
                                              float label_smoothing) {
  return ut__ce_bwd(logits, labels, label_smoothing, "ut_cross_entropy_backward_smoothed");
}

/* ---- optimizers --------------------------------------------------------------------------- */
int ut_sgd_step(ut_tensor* param, ut_tensor* grad, ut_tensor* velocity, float lr, float momentum) {
  const char* who = "ut_sgd_step";
  UT__TRY(ut__check_tensor(param, who, "param"));
  UT__TRY(ut__check_arg(grad, param, param->shape.nelem, who, "grad"));
  if (velocity) UT__TRY(ut__check_arg(velocity, param, param->shape.nelem, who, "velocity"));
  UT__TRY(ut__check_f32(param, who, "param"));
  UT__TRY(ut__check_f32(grad, who, "grad"));
  UT__TRY(ut__check_f32(velocity, who, "velocity"));
  UT__TRY(ut__check_distinct(velocity, param, who, "velocity", "param"));
  UT__TRY(ut__check_distinct(velocity, grad, who, "velocity", "grad"));
  UT__TRY(ut__check_lr(lr, who));
  UT__CHECK(isfinite(momentum) && momentum >= 0.f, UT_ERR_ARG,
            "%s: momentum must be finite and >= 0", who);
  const ut__backend* be = ut__backend_for(param->dev);
  const float* g = ut__in(grad, be);
  float* p = g ? ut__inout(param, be) : NULL;
  float* v = (p && velocity) ? ut__inout(velocity, be) : NULL;
  if (!p || (velocity && !v)) return ut__err_status;
  ut__sgd_hp h = {lr, momentum, 0.f, 0.f, false};
  UT__TRY(be->sgd(p, g, v, param->shape.nelem, h));
  ut__wrote(param, be);
  if (v) ut__wrote(velocity, be);
  return UT_OK;
}

/* Re-sets the thread's error with "who: item i: " before its message. */
static int ut__item_error(const char* who, int i) {
  char msg[sizeof ut__err_msg];
  snprintf(msg, sizeof msg, "%s", ut__err_msg);
  return ut__set_error(ut__err_status, "%s: item %d: %s", who, i, msg);
}

/* The many-tensor calls: the items are gathered per backend (CPU, GPU) and each backend gets
   them in one call (its sgd_many / fill_many). */
typedef struct ut__many {
  float** p;
  const float** g;
  float** v;
  ut__i64* n;
  int k; /* items gathered */
} ut__many;
static int ut__many_alloc(ut__many* m, int count, const char* who) {
  size_t k = count > 0 ? (size_t)count : 1;
  m->p = (float**)calloc(k, sizeof(float*));
  m->g = (const float**)calloc(k, sizeof(float*));
  m->v = (float**)calloc(k, sizeof(float*));
  m->n = (ut__i64*)calloc(k, sizeof(ut__i64));
  m->k = 0;
  if (m->p && m->g && m->v && m->n) return UT_OK;
  return ut__set_error(UT_ERR_MEMORY, "%s: out of host memory", who);
}
static void ut__many_free(ut__many* m) {
  free(m->p);
  free((void*)m->g);
  free(m->v);
  free(m->n);
}
/* [0]: the CPU's items, [1]: the GPU's */
static int ut__many_pair_alloc(ut__many m[2], int count, const char* who) {
  memset(m, 0, 2 * sizeof(ut__many));
  if (ut__many_alloc(&m[0], count, who) < 0 || ut__many_alloc(&m[1], count, who) < 0) {
    ut__many_free(&m[0]);
    ut__many_free(&m[1]);
    return ut__err_status;
  }
  return UT_OK;
}

static int ut__sgd_many(ut_tensor** params, ut_tensor** grads, ut_tensor** velocities, int count,
                        ut__sgd_hp h, const char* who) {
  float lr = h.lr, momentum = h.momentum;
  UT__CHECK(count >= 0, UT_ERR_ARG, "%s: count must be >= 0, got %d", who, count);
  UT__CHECK(count == 0 || (params && grads), UT_ERR_ARG, "%s: NULL params or grads", who);
  UT__TRY(ut__check_lr(lr, who));
  UT__CHECK(isfinite(momentum) && momentum >= 0.f, UT_ERR_ARG,
            "%s: momentum must be finite and >= 0", who);
  /* PyTorch's messages (torch.optim.SGD) */
  UT__CHECK(isfinite(h.weight_decay) && h.weight_decay >= 0.f, UT_ERR_ARG,
            "%s: Invalid weight_decay value: %g", who, (double)h.weight_decay);
  UT__CHECK(isfinite(h.dampening), UT_ERR_ARG, "%s: dampening must be finite", who);
  UT__CHECK(!h.nesterov || (momentum > 0.f && h.dampening == 0.f), UT_ERR_ARG,
            "%s: Nesterov momentum requires a momentum and zero dampening", who);
  for (int i = 0; i < count; i++) {
    ut_tensor *p = params[i], *g = grads[i], *v = velocities ? velocities[i] : NULL;
    if (ut__check_tensor(p, who, "param") < 0 ||
        ut__check_arg(g, p, p->shape.nelem, who, "grad") < 0 ||
        (velocities && ut__check_arg(v, p, p->shape.nelem, who, "velocity") < 0) ||
        ut__check_f32(p, who, "param") < 0 || ut__check_f32(g, who, "grad") < 0 ||
        ut__check_f32(v, who, "velocity") < 0 ||
        ut__check_distinct(v, p, who, "velocity", "param") < 0 ||
        ut__check_distinct(v, g, who, "velocity", "grad") < 0)
      return ut__item_error(who, i);
  }
  ut__many m[2];
  UT__TRY(ut__many_pair_alloc(m, count, who));
  int rc = UT_OK;
  for (int i = 0; rc >= 0 && i < count; i++) {
    ut_tensor *p = params[i], *v = velocities ? velocities[i] : NULL;
    const ut__backend* be = ut__backend_for(p->dev);
    const float* gp = ut__in(grads[i], be);
    float* pp = gp ? ut__inout(p, be) : NULL;
    float* vp = (pp && v) ? ut__inout(v, be) : NULL;
    if (!pp || (v && !vp)) {
      rc = ut__err_status;
    } else {
      ut__many* mm = &m[ut__is_device_backend(be)];
      mm->p[mm->k] = pp, mm->g[mm->k] = gp, mm->v[mm->k] = vp, mm->n[mm->k] = p->shape.nelem;
      mm->k++;
    }
  }
  for (int d = 0; rc >= 0 && d < 2; d++) {
    const ut__backend* be = ut__backend_for(d ? UT_CUDA : UT_CPU);
    ut__many* mm = &m[d];
    if (mm->k > 0)
      rc = be->sgd_many(mm->p, mm->g, velocities ? mm->v : NULL, mm->n, mm->k, h);
  }
  ut__many_free(&m[0]);
  ut__many_free(&m[1]);
  if (rc < 0) return rc;
  for (int i = 0; i < count; i++) {
    const ut__backend* be = ut__backend_for(params[i]->dev);
    ut__wrote(params[i], be);
    if (velocities) ut__wrote(velocities[i], be);
  }
  return UT_OK;
}

int ut_sgd_step_many(ut_tensor** params, ut_tensor** grads, ut_tensor** velocities, int count,
                     float lr, float momentum) {
  ut__sgd_hp h = {lr, momentum, 0.f, 0.f, false};
  return ut__sgd_many(params, grads, velocities, count, h, "ut_sgd_step_many");
}

int ut_sgd_step_many_ex(ut_tensor** params, ut_tensor** grads, ut_tensor** velocities, int count,
                        float lr, float momentum, float dampening, float weight_decay,
                        bool nesterov) {
  ut__sgd_hp h = {lr, momentum, dampening, weight_decay, nesterov};
  return ut__sgd_many(params, grads, velocities, count, h, "ut_sgd_step_many_ex");
}

static int ut__check_pack(ut_tensor* flat, ut_tensor** ts, int count, const char* who) {
  UT__TRY(ut__check_tensor(flat, who, "flat"));
  UT__TRY(ut__check_f32(flat, who, "flat"));
  UT__CHECK(count >= 0, UT_ERR_ARG, "%s: count must be >= 0, got %d", who, count);
  UT__CHECK(count == 0 || ts, UT_ERR_ARG, "%s: NULL tensors", who);
  long long total = 0;
  for (int i = 0; i < count; i++) {
    if (ut__check_arg(ts[i], flat, -1, who, "t") < 0 || ut__check_f32(ts[i], who, "t") < 0 ||
        ut__check_distinct(ts[i], flat, who, "t", "flat") < 0)
      return ut__item_error(who, i);
    total += ts[i]->shape.nelem;
  }
  UT__CHECK(total == flat->shape.nelem, UT_ERR_SHAPE,
            "%s: the %d tensors hold %lld elements, flat holds %d", who, count, total,
            flat->shape.nelem);
  return UT_OK;
}

int ut_pack(ut_tensor* flat, ut_tensor** ts, int count) {
  UT__TRY(ut__check_pack(flat, ts, count, "ut_pack"));
  const ut__backend* be = ut__backend_for(flat->dev);
  float* fp = ut__out(flat, be);
  ut__i64 off = 0;
  for (int i = 0; i < count; i++) {
    const float* src = ut__in(ts[i], be);
    if (!src) return ut__item_error("ut_pack", i);
    UT__TRY(be->copy(fp + off, src, ts[i]->shape.nelem));
    off += ts[i]->shape.nelem;
  }
  ut__wrote(flat, be);
  return UT_OK;
}

int ut_unpack(ut_tensor* flat, ut_tensor** ts, int count) {
  UT__TRY(ut__check_pack(flat, ts, count, "ut_unpack"));
  const ut__backend* be = ut__backend_for(flat->dev);
  const float* fp = ut__in(flat, be);
  if (!fp) return ut__err_status;
  ut__i64 off = 0;
  for (int i = 0; i < count; i++) {
    int rc = be->copy(ut__out(ts[i], be), fp + off, ts[i]->shape.nelem);
    if (rc < 0) return rc;
    ut__wrote(ts[i], be);
    off += ts[i]->shape.nelem;
  }
  return UT_OK;
}

int ut_fill_many(ut_tensor** ts, int count, float value) {
  const char* who = "ut_fill_many";
  UT__CHECK(count >= 0, UT_ERR_ARG, "%s: count must be >= 0, got %d", who, count);
  UT__CHECK(count == 0 || ts, UT_ERR_ARG, "%s: NULL tensors", who);
  for (int i = 0; i < count; i++)
    if (ut__check_tensor(ts[i], who, "t") < 0 || ut__check_f32(ts[i], who, "t") < 0)
      return ut__item_error(who, i);
  ut__many m[2];
  UT__TRY(ut__many_pair_alloc(m, count, who));
  int rc = UT_OK;
  for (int i = 0; rc >= 0 && i < count; i++) {
    const ut__backend* be = ut__backend_for(ts[i]->dev);
    float* x = ut__device_gate(be, who) < 0 ? NULL : ut__out(ts[i], be);
    if (!x) {
      rc = ut__err_status;
    } else {
      ut__many* mm = &m[ut__is_device_backend(be)];
      mm->p[mm->k] = x, mm->n[mm->k] = ts[i]->shape.nelem;
      mm->k++;
    }
  }
  for (int d = 0; rc >= 0 && d < 2; d++) {
    const ut__backend* be = ut__backend_for(d ? UT_CUDA : UT_CPU);
    ut__many* mm = &m[d];
    if (mm->k > 0) rc = be->fill_many(mm->p, mm->n, mm->k, value);
  }
  ut__many_free(&m[0]);
  ut__many_free(&m[1]);
  if (rc < 0) return rc;
  for (int i = 0; i < count; i++) ut__wrote(ts[i], ut__backend_for(ts[i]->dev));
  return UT_OK;
}

/* The hyperparameters arrive as doubles (PyTorch's Python floats): 1 - beta2 and the bias
   corrections from a float32 beta2 = 0.999 would be 1.3e-5 off in relative terms. */
static int ut__adam(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool decoupled, const char* who) {
  UT__TRY(ut__check_tensor(param, who, "param"));
  int n = param->shape.nelem;
  UT__TRY(ut__check_arg(grad, param, n, who, "grad"));
  UT__TRY(ut__check_arg(m, param, n, who, "m"));
  UT__TRY(ut__check_arg(v, param, n, who, "v"));
  const ut_tensor* four[4] = {param, grad, m, v};
  const char* names[4] = {"param", "grad", "m", "v"};
  for (int i = 0; i < 4; i++) UT__TRY(ut__check_f32(four[i], who, names[i]));
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++) UT__TRY(ut__check_distinct(four[i], four[j], who, names[i], names[j]));
  UT__CHECK(step >= 1, UT_ERR_ARG, "%s: step must be >= 1 (1-based), got %d", who, step);
  UT__CHECK(isfinite(lr) && isfinite((float)lr), UT_ERR_ARG, "%s: lr must be finite and >= 0", who);
  UT__TRY(ut__check_lr((float)lr, who));
  UT__CHECK(beta1 >= 0.0 && (float)beta1 < 1.f && beta2 >= 0.0 && (float)beta2 < 1.f, UT_ERR_ARG,
            "%s: betas must be in [0, 1)", who);
  UT__CHECK(isfinite(eps) && isfinite((float)eps) && eps >= 0.0, UT_ERR_ARG,
            "%s: eps must be finite and >= 0", who);
  UT__CHECK(isfinite(weight_decay) && isfinite((float)weight_decay) && weight_decay >= 0.0,
            UT_ERR_ARG, "%s: Invalid weight_decay value: %g", who, weight_decay);
  const ut__backend* be = ut__backend_for(param->dev);
  const float* g = ut__in(grad, be);
  float* p = g ? ut__inout(param, be) : NULL;
  float* mp = p ? ut__inout(m, be) : NULL;
  float* vp = mp ? ut__inout(v, be) : NULL;
  if (!vp) return ut__err_status;
  /* PyTorch's scalars: step_size = lr / bc1 and sqrt(bc2) in double, then float32 */
  double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
  ut__adam_hp h;
  h.b1 = (float)beta1, h.b2 = (float)beta2;
  h.omb1 = (float)(1.0 - beta1), h.omb2 = (float)(1.0 - beta2);
  h.eps = (float)eps;
  h.step_size = (float)(lr / bc1), h.sqrt_bc2 = (float)sqrt(bc2);
  h.weight_decay = decoupled ? 0.f : (float)weight_decay;
  h.decay = decoupled ? (float)(1.0 - lr * weight_decay) : 1.f;
  UT__TRY(be->adam(p, g, mp, vp, n, h));
  ut__wrote(param, be);
  ut__wrote(m, be);
  ut__wrote(v, be);
  return UT_OK;
}

int ut_adam_step(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step, float lr,
                 float beta1, float beta2, float eps) {
  return ut__adam(param, grad, m, v, step, lr, beta1, beta2, eps, 0.0, false, "ut_adam_step");
}

int ut_adam_step_ex(ut_tensor* param, ut_tensor* grad, ut_tensor* m, ut_tensor* v, int step,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool decoupled) {
  return ut__adam(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, decoupled,
                  "ut_adam_step_ex");
}

/* ---- regularisation and the EMA of weights (issue 30) ------------------------------------- */
/* The mask comes from an RNG that ut_seed seeds, so a seeded run repeats: on the CPU the host
   RNG; on the GPU a counter-based stream drawn by a kernel (no upload, and a step recorded in a
   CUDA graph draws a new mask at each replay, as an upload could not). The two devices draw
   different masks from one seed, as PyTorch's do. */
ut_tensor* ut_dropout_mask(int ndim, const int* shape, double p, ut_dev dev) {
  const char* who = "ut_dropout_mask";
  UT__CHECK_NULL(p >= 0.0 && p <= 1.0, UT_ERR_ARG,
                 "%s: the drop probability must be in [0, 1], got %g", who, p);
  ut_tensor* t = ut__new(ndim, shape, dev, who);
  if (!t) return NULL;
  /* PyTorch's bernoulli_(1 - p).div_(1 - p): the scale rounded as a float32 division */
  float keep = (float)(1.0 - p), scale = p < 1.0 ? 1.0f / keep : 0.f;
  ut__pool_init();
  const ut__backend* be = ut__backend_for(dev);
  if (be->rng_mask) {
    float* out = ut__out(t, be);
    pthread_mutex_lock(&ut__rng_lock); /* one key/counter update at a time */
    int rc = out ? be->rng_mask(out, t->shape.nelem, 1.0 - p, scale, ut__dev_rng_key,
                                ut__dev_rng_epoch, ut__recording_now() != NULL)
                 : ut__err_status;
    pthread_mutex_unlock(&ut__rng_lock);
    if (rc < 0) return ut__drop(t);
    ut__wrote(t, be);
    return t;
  }
  pthread_mutex_lock(&ut__rng_lock);
  if (!ut__rng_seeded) ut__rng_seed_locked(0x5eed);
  /* uniform in (0, 1]: kept when u <= 1 - p, so p 0 keeps all and p 1 none */
  for (ut__i64 i = 0; i < t->shape.nelem; i++)
    t->data[i] = ut__rng_uniform_locked() <= 1.0 - p ? scale : 0.f;
  pthread_mutex_unlock(&ut__rng_lock);
  ut__host_wrote(t);
  return t;
}

int ut_mask_scale(ut_tensor* x, ut_tensor* mask) {
  const char* who = "ut_mask_scale";
  UT__TRY(ut__check_tensor(x, who, "x"));
  UT__TRY(ut__check_arg(mask, x, -1, who, "mask"));
  UT__TRY(ut__check_f32(mask, who, "mask"));
  UT__TRY(ut__check_distinct(x, mask, who, "x", "mask"));
  ut__i64 n = x->shape.nelem, r = mask->shape.nelem;
  UT__CHECK(r >= 1 && n % r == 0, UT_ERR_SHAPE,
            "%s: the mask's %lld elements do not divide x's %lld (x %s, mask %s)", who,
            (long long)r, (long long)n, ut__shape_text(x).s, ut__shape_text(mask).s);
  const ut__backend* be = ut__backend_for(x->dev);
  const float* s = ut__in(mask, be);
  void* xp = s ? ut__inout(x, be) : NULL;
  if (!xp) return ut__err_status;
  UT__TRY(be->mask_scale(ut__buf_dtype(x, be), xp, s, n, n / r));
  ut__wrote(x, be);
  return UT_OK;
}

int ut_lerp_many(ut_tensor** avg, ut_tensor** cur, int count, float weight) {
  const char* who = "ut_lerp_many";
  UT__CHECK(count >= 0, UT_ERR_ARG, "%s: count must be >= 0, got %d", who, count);
  UT__CHECK(count == 0 || (avg && cur), UT_ERR_ARG, "%s: NULL avg or cur", who);
  UT__CHECK(weight >= 0.f && weight <= 1.f, UT_ERR_ARG, "%s: weight must be in [0, 1], got %g",
            who, (double)weight);
  for (int i = 0; i < count; i++)
    if (ut__check_tensor(avg[i], who, "avg") < 0 ||
        ut__check_arg(cur[i], avg[i], avg[i]->shape.nelem, who, "cur") < 0 ||
        ut__check_f32(avg[i], who, "avg") < 0 || ut__check_f32(cur[i], who, "cur") < 0 ||
        ut__check_distinct(avg[i], cur[i], who, "avg", "cur") < 0)
      return ut__item_error(who, i);
  for (int i = 0; i < count; i++) {
    const ut__backend* be = ut__backend_for(avg[i]->dev);
    const float* b = ut__in(cur[i], be);
    float* a = b ? ut__inout(avg[i], be) : NULL;
    if (!a) return ut__item_error(who, i);
    UT__TRY(be->lerp(a, b, avg[i]->shape.nelem, weight));
    ut__wrote(avg[i], be);
  }
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
    UT__FIELD(ut_tensor, shared),
    UT__FIELD(ut_tensor, release), UT__FIELD(ut_tensor, release_ctx),
    UT__FIELD(ut_tensor, version), UT__FIELD(ut_tensor, dtype), UT__FIELD(ut_tensor, tracked),
    UT__FIELD(ut_tensor, views), UT__FIELD(ut_tensor, view_closes),
    UT__FIELD(ut_tensor, derived),
    UT__SIZE(ut_conv2d), UT__FIELD(ut_conv2d, weight), UT__FIELD(ut_conv2d, bias),
    UT__FIELD(ut_conv2d, in_c), UT__FIELD(ut_conv2d, out_c), UT__FIELD(ut_conv2d, kh),
    UT__FIELD(ut_conv2d, kw), UT__FIELD(ut_conv2d, stride), UT__FIELD(ut_conv2d, pad),
    UT__SIZE(ut_conv2d_cache), UT__FIELD(ut_conv2d_cache, input), UT__FIELD(ut_conv2d_cache, col),
    UT__SIZE(ut_dwconv2d), UT__FIELD(ut_dwconv2d, weight), UT__FIELD(ut_dwconv2d, bias),
    UT__FIELD(ut_dwconv2d, c), UT__FIELD(ut_dwconv2d, kh), UT__FIELD(ut_dwconv2d, kw),
    UT__FIELD(ut_dwconv2d, stride), UT__FIELD(ut_dwconv2d, pad), UT__FIELD(ut_dwconv2d, dilation),
    UT__FIELD(ut_dwconv2d, mult),
    UT__SIZE(ut_dwconv2d_cache), UT__FIELD(ut_dwconv2d_cache, input),
    UT__FIELD(ut_dwconv2d_cache, bn), UT__FIELD(ut_dwconv2d_cache, bn_eps),
    UT__FIELD(ut_dwconv2d_cache, bn_act),
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
    UT__FIELD(ut_batchnorm2d, activation), UT__FIELD(ut_batchnorm2d_cache, activation),
    UT__SIZE(ut_batchnorm2d_cache), UT__FIELD(ut_batchnorm2d_cache, input),
    UT__FIELD(ut_batchnorm2d_cache, mean), UT__FIELD(ut_batchnorm2d_cache, rstd),
    UT__FIELD(ut_batchnorm2d_cache, training), UT__FIELD(ut_batchnorm2d_cache, synced),
    UT__SIZE(ut_separable_block), UT__FIELD(ut_separable_block, expand),
    UT__FIELD(ut_separable_block, bn_expand), UT__FIELD(ut_separable_block, act_expand),
    UT__FIELD(ut_separable_block, dw), UT__FIELD(ut_separable_block, bn_dw),
    UT__FIELD(ut_separable_block, act_dw), UT__FIELD(ut_separable_block, project),
    UT__FIELD(ut_separable_block, bn_project), UT__FIELD(ut_separable_block, act_project),
    UT__FIELD(ut_separable_block, residual), UT__FIELD(ut_separable_block, se_reduce),
    UT__FIELD(ut_separable_block, act_se_reduce), UT__FIELD(ut_separable_block, se_expand),
    UT__FIELD(ut_separable_block, act_se_expand),
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

/* ============================================================================================
   CPU BACKEND (after the core, which reaches it only through its table).

   Every function here is a ut__backend entry over host buffers; arguments were validated by
   the core. Work is split over ut_get_num_threads() threads by the library's thread pool
   (ut__parallel_run): each parallel loop is a part function over a context struct, its
   range cut per tid by ut__cpu_part; calls below ~32K elements run serially so small ops
   stay cheap.

   Determinism: every reduction is computed by one thread in a fixed order (partitioned by
   output element: channel, column, row or fixed-size block), so results do not depend on the
   thread count or on scheduling. Reductions over many elements sum 16 float lanes per short
   run and carry the runs in double.

   Hot kernels (GEMM micro-kernel, depthwise planes) are compiled three times on x86-64 —
   baseline, AVX2+FMA and AVX-512 — and picked at run time through ut__cpu_isa() (ISA
   VARIANTS, the last section), so a build without -march=native still uses the machine's
   vector units. UT_CPU_NO_DISPATCH turns that off.
   ============================================================================================ */
/* ---- thread pool ---------------------------------------------------------------------------
   The CPU backend's parallel loops run on the library's own pthreads, not OpenMP: libgomp's
   workers were still running when the library was unloaded at interpreter exit (a crash), and
   a fork()ed child inherited none of them while libgomp believed they existed (a hang).

   ut__parallel_run(nt, fn, ctx) calls fn(ctx, tid, nt) once for every tid in [0, nt) and
   returns when all have returned. The caller takes tids like the workers do, so a worker that
   is slow to wake costs nothing but parallelism. Which thread runs a tid never matters: a tid
   names a fixed part of the work (ut__cpu_part) and a scratch slot, so results do not depend
   on scheduling. One caller at a time owns the workers; a second caller (another thread, or
   a parallel op nested in a part) runs its nt parts itself in order, with the same result.

   The job is one atomic word: generation (32 bits) | nt (16) | next tid (16). A tid is taken
   by compare-and-swap on the whole word, so a late worker never takes a part of a newer job,
   and the owner only starts a new job after every part of the last one has returned.

   Workers spin a short while for the next job (ops often come back to back), then sleep on a
   condition variable. pthread_atfork: the child keeps no workers (they were not copied) and
   creates new ones at its next parallel op. The library is linked with -z nodelete, so code
   that parked workers return into is never unmapped. */
typedef void (*ut__pool_fn)(void* ctx, int tid, int nt);

/* How long the workers (for the next job) and the owner (for the last parts) spin before they
   sleep, in nanoseconds of the monotonic clock (a count of pauses was 23 us on one Xeon and
   ~100 on another: a pause takes 3 to 140 cycles). Between the ops of a Python forward lie
   tens of microseconds of interpreter: with 23 us the worker slept through most of them, and
   waking it cost more than the op (MobileNetV2's batch-1 forward on 2 cores: 12.4 ms, 9 ms
   with the worker kept awake). 200 us covers those gaps; an idle pool still sleeps after it,
   so it does not keep a 2-core machine's CPU from its neighbours. */
#define UT__POOL_SPIN_NS 200000
#define UT__POOL_SPIN_CHECK 32     /* pauses between two reads of the clock */
#define UT__POOL_SPIN_MAX 1000000   /* pauses at most, whatever the clock says */

static pthread_mutex_t ut__pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ut__pool_wake = PTHREAD_COND_INITIALIZER; /* workers: a new job */
static pthread_cond_t ut__pool_idle = PTHREAD_COND_INITIALIZER; /* owner: the last part done */
static pthread_once_t ut__pool_once = PTHREAD_ONCE_INIT;
static atomic_bool ut__pool_busy = false;
static atomic_ullong ut__pool_job = 0;
static atomic_int ut__pool_done = 0;     /* parts of the current job that returned */
static atomic_int ut__pool_sleepers = 0; /* workers waiting on ut__pool_wake */
static atomic_int ut__pool_waiting = 0;  /* the owner waits on ut__pool_idle */
static int ut__pool_nworkers = 0;        /* changed by the owner, under ut__pool_lock */
static uint32_t ut__pool_gen = 0;        /* the owner's */
static ut__pool_fn ut__pool_fn_cur;      /* stable while any part of the job is unfinished */
static void* ut__pool_ctx_cur;

/* (a plain -std=c11 program that includes the implementation has no POSIX clocks: the
   calendar clock then, which may jump, so the spins are also capped by a count) */
static inline long long ut__pool_now_ns(void) {
  struct timespec t;
#if defined(CLOCK_MONOTONIC)
  clock_gettime(CLOCK_MONOTONIC, &t);
#else
  timespec_get(&t, TIME_UTC);
#endif
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void ut__pool_relax(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__ __volatile__("pause");
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* fork: the prepare handler holds the library's locks so that the child copies them
   unlocked-able and consistent; the child then starts without workers. */
static void ut__pool_prepare(void) {
  pthread_mutex_lock(&ut__rng_lock);
  pthread_mutex_lock(&ut__derived_lock);
  pthread_mutex_lock(&ut__pool_lock);
}
static void ut__pool_parent(void) {
  pthread_mutex_unlock(&ut__pool_lock);
  pthread_mutex_unlock(&ut__derived_lock);
  pthread_mutex_unlock(&ut__rng_lock);
}
static void ut__pool_child(void) {
  pthread_mutex_init(&ut__pool_lock, NULL);
  pthread_mutex_init(&ut__derived_lock, NULL);
  pthread_mutex_init(&ut__rng_lock, NULL);
  pthread_cond_init(&ut__pool_wake, NULL);
  pthread_cond_init(&ut__pool_idle, NULL);
  ut__pool_nworkers = 0;
  ut__pool_gen = (uint32_t)(atomic_load(&ut__pool_job) >> 32) + 1;
  atomic_store(&ut__pool_job, (unsigned long long)ut__pool_gen << 32); /* nt 0: no parts */
  atomic_store(&ut__pool_done, 0);
  atomic_store(&ut__pool_sleepers, 0);
  atomic_store(&ut__pool_waiting, 0);
  atomic_store(&ut__pool_busy, false); /* the owner, if any, was another thread */
}
static void ut__pool_register(void) {
  pthread_atfork(ut__pool_prepare, ut__pool_parent, ut__pool_child);
}
static void ut__pool_init(void) { pthread_once(&ut__pool_once, ut__pool_register); }

/* Takes a part of job `gen`: its tid (and *nt), or -1 when none is left. */
static int ut__pool_take(uint32_t gen, int* nt) {
  unsigned long long w = atomic_load(&ut__pool_job);
  for (;;) {
    unsigned next = (unsigned)(w & 0xffff), n = (unsigned)((w >> 16) & 0xffff);
    if ((uint32_t)(w >> 32) != gen || next >= n) return -1;
    if (atomic_compare_exchange_weak(&ut__pool_job, &w, w + 1)) {
      *nt = (int)n;
      return (int)next;
    }
  }
}

/* Runs parts of job `gen` until none is left. */
static void ut__pool_work(uint32_t gen) {
  int tid, nt;
  while ((tid = ut__pool_take(gen, &nt)) >= 0) {
    ut__pool_fn_cur(ut__pool_ctx_cur, tid, nt);
    /* after the last part's count the owner may start the next job: read nothing of this one */
    if (atomic_fetch_add(&ut__pool_done, 1) + 1 == nt && atomic_load(&ut__pool_waiting)) {
      pthread_mutex_lock(&ut__pool_lock);
      pthread_cond_signal(&ut__pool_idle);
      pthread_mutex_unlock(&ut__pool_lock);
    }
  }
}

static void* ut__pool_worker(void* arg) {
  uint32_t seen = (uint32_t)(uintptr_t)arg; /* the generation before the job it was made for */
  for (;;) {
    unsigned long long w = atomic_load(&ut__pool_job);
    long long until = ut__pool_now_ns() + UT__POOL_SPIN_NS;
    for (int i = 1; (uint32_t)(w >> 32) == seen; i++) {
      ut__pool_relax();
      w = atomic_load(&ut__pool_job);
      if (i % UT__POOL_SPIN_CHECK == 0 && (ut__pool_now_ns() > until || i > UT__POOL_SPIN_MAX))
        break;
    }
    if ((uint32_t)(w >> 32) == seen) {
      /* sleepers is raised before the job is read again and the owner reads it after
         publishing the job (both seq_cst), so one of the two sees the other */
      pthread_mutex_lock(&ut__pool_lock);
      atomic_fetch_add(&ut__pool_sleepers, 1);
      while ((uint32_t)((w = atomic_load(&ut__pool_job)) >> 32) == seen)
        pthread_cond_wait(&ut__pool_wake, &ut__pool_lock);
      atomic_fetch_sub(&ut__pool_sleepers, 1);
      pthread_mutex_unlock(&ut__pool_lock);
    }
    seen = (uint32_t)(w >> 32);
    ut__pool_work(seen);
  }
  return NULL;
}

/* Up to `want` workers; fewer when threads cannot be created (the owner then runs more parts). */
static void ut__pool_grow(int want) {
  if (ut__pool_nworkers >= want) return;
  pthread_mutex_lock(&ut__pool_lock);
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) == 0) {
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (ut__pool_nworkers < want) {
      pthread_t th;
      if (pthread_create(&th, &attr, ut__pool_worker, (void*)(uintptr_t)ut__pool_gen) != 0) break;
      ut__pool_nworkers++;
    }
    pthread_attr_destroy(&attr);
  }
  pthread_mutex_unlock(&ut__pool_lock);
}

static void ut__parallel_run(int nt, ut__pool_fn fn, void* ctx) {
  if (nt <= 1) {
    fn(ctx, 0, 1);
    return;
  }
  bool idle = false;
  if (nt > 0xffff || !atomic_compare_exchange_strong(&ut__pool_busy, &idle, true)) {
    for (int t = 0; t < nt; t++) fn(ctx, t, nt);
    return;
  }
  ut__pool_init();
  ut__pool_grow(nt - 1);
  ut__pool_fn_cur = fn;
  ut__pool_ctx_cur = ctx;
  atomic_store(&ut__pool_done, 0);
  uint32_t gen = ++ut__pool_gen;
  atomic_store(&ut__pool_job, (unsigned long long)gen << 32 | (unsigned long long)nt << 16);
  if (atomic_load(&ut__pool_sleepers) > 0) {
    pthread_mutex_lock(&ut__pool_lock);
    pthread_cond_broadcast(&ut__pool_wake);
    pthread_mutex_unlock(&ut__pool_lock);
  }
  ut__pool_work(gen);
  long long until = ut__pool_now_ns() + UT__POOL_SPIN_NS;
  for (int i = 1; atomic_load(&ut__pool_done) != nt; i++) {
    ut__pool_relax();
    if (i % UT__POOL_SPIN_CHECK == 0 && (ut__pool_now_ns() > until || i > UT__POOL_SPIN_MAX))
      break;
  }
  if (atomic_load(&ut__pool_done) != nt) {
    pthread_mutex_lock(&ut__pool_lock);
    atomic_store(&ut__pool_waiting, 1);
    while (atomic_load(&ut__pool_done) != nt) pthread_cond_wait(&ut__pool_idle, &ut__pool_lock);
    atomic_store(&ut__pool_waiting, 0);
    pthread_mutex_unlock(&ut__pool_lock);
  }
  atomic_store(&ut__pool_busy, false);
}

/* Part tid of nt of [0, n), cut as OpenMP's schedule(static) cuts it (contiguous blocks, the
   first n % nt of them one longer), so per-part reductions keep their order. */
static inline void ut__cpu_part(ut__i64 n, int tid, int nt, ut__i64* lo, ut__i64* hi) {
  if (n <= 0) {
    *lo = *hi = 0;
    return;
  }
  ut__i64 q = n / nt, r = n % nt;
  *lo = q * tid + (tid < r ? tid : r);
  *hi = *lo + q + (tid < r ? 1 : 0);
}

/* The next task of a dynamic schedule (one at a time, whoever asks first). */
static inline ut__i64 ut__cpu_next_task(atomic_llong* next) { return atomic_fetch_add(next, 1); }


/* Prefetches for operands that a network's step finds cold (weights, their gradients): for
   reading, and for writing (the line comes exclusive, so the store does not wait on it). */
#if defined(__GNUC__)
#define UT__PREFETCH_R(p) __builtin_prefetch((p), 0, 3)
#define UT__PREFETCH_W(p) __builtin_prefetch((p), 1, 3)
#else
#define UT__PREFETCH_R(p) ((void)(p))
#define UT__PREFETCH_W(p) ((void)(p))
#endif
/* UT__CPU_OPT: full vectorization and FMA contraction for the loops that need them (-O2 in
   GCC 12 only vectorizes loops with known trip counts, and -std=c11 turns contraction off). */
#if defined(__GNUC__) && !defined(__clang__)
#define UT__CPU_OPT __attribute__((optimize("O3", "fp-contract=fast", "no-tree-loop-distribute-patterns")))
#else
#define UT__CPU_OPT
#endif
#if defined(__GNUC__)
#define UT__CPU_INL static inline __attribute__((always_inline)) UT__CPU_OPT
#else
#define UT__CPU_INL static inline
#endif

#define UT__CPU_SERIAL_BELOW 32768 /* elements (or MACs) below which a call runs serially */
#define UT__CPU_MIN(a, b) ((a) < (b) ? (a) : (b))
#define UT__CPU_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Set while a thread runs one part of a call that parallelizes at its own level (the
   separable block's bands): the kernels it calls then run in that thread alone. */
static _Thread_local bool ut__cpu_one_thread;

/* Threads for a call touching about `work` elements (1 below the serial threshold). */
static int ut__cpu_nt(double work) {
  if (work < UT__CPU_SERIAL_BELOW || ut__cpu_one_thread) return 1;
  int nt = ut_get_num_threads();
  return nt < 1 ? 1 : nt;
}

static float* ut__cpu_align64(void* p) {
  return (float*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* Sum of x[0..n) in a fixed order: 16 float lanes per run of 1024, runs carried in double. */
UT__CPU_INL double ut__cpu_sum_body(const float* restrict x, ut__i64 n) {
  double total = 0.0;
  for (ut__i64 i0 = 0; i0 < n; i0 += 1024) {
    ut__i64 len = UT__CPU_MIN((ut__i64)1024, n - i0);
    const float* p = x + i0;
    float l[16] = {0};
    ut__i64 i = 0;
    for (; i + 16 <= len; i += 16)
      for (int j = 0; j < 16; j++) l[j] += p[i + j];
    float t = 0.0f;
    for (; i < len; i++) t += p[i];
    for (int j = 0; j < 8; j++) l[j] += l[j + 8];
    for (int j = 0; j < 4; j++) l[j] += l[j + 4];
    total += (double)((l[0] + l[2]) + (l[1] + l[3])) + (double)t;
  }
  return total;
}
UT__CPU_OPT static double ut__cpu_sum(const float* x, ut__i64 n) { return ut__cpu_sum_body(x, n); }

/* ---- elementwise ---------------------------------------------------------------------- */

typedef struct {
  float* x;
  ut__i64 n;
  float v;
} ut__cpu_fill_ctx;
UT__CPU_OPT static void ut__cpu_fill_part(void* vc, int tid, int nt) {
  const ut__cpu_fill_ctx* c = (const ut__cpu_fill_ctx*)vc;
  float* x = c->x;
  float v = c->v;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (ut__i64 i = lo; i < hi; i++) x[i] = v;
}
UT__CPU_OPT static int ut__cpu_fill_f32(float* x, ut__i64 n, float v) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_fill_ctx c = {x, n, v};
  ut__parallel_run(nt, ut__cpu_fill_part, &c);
  return UT_OK;
}

typedef struct {
  float* dst;
  const float* src;
  ut__i64 n, chunk;
} ut__cpu_copy_ctx;
static void ut__cpu_copy_part(void* vc, int t, int nt) {
  const ut__cpu_copy_ctx* c = (const ut__cpu_copy_ctx*)vc;
  float* dst = c->dst;
  const float* src = c->src;
  ut__i64 n = c->n, chunk = c->chunk;
  (void)nt;
  {
    ut__i64 lo = (ut__i64)t * chunk, hi = UT__CPU_MIN(n, lo + chunk);
    if (lo < hi) memcpy(dst + lo, src + lo, (size_t)(hi - lo) * sizeof(float));
  }
}
static int ut__cpu_copy(float* dst, const float* src, ut__i64 n) {
  int nt = ut__cpu_nt((double)n / 4);
  if (nt <= 1) {
    if (n > 0 && dst != src) memmove(dst, src, (size_t)n * sizeof(float));
    return UT_OK;
  }
  ut__i64 chunk = ((n + nt - 1) / nt + 15) & ~(ut__i64)15;
  ut__cpu_copy_ctx c = {dst, src, n, chunk};
  ut__parallel_run(nt, ut__cpu_copy_part, &c);
  return UT_OK;
}

typedef struct {
  float* y;
  const float* x;
  ut__i64 n;
  float alpha;
} ut__cpu_axpy_ctx;
UT__CPU_OPT static void ut__cpu_axpy_part(void* vc, int tid, int nt) {
  const ut__cpu_axpy_ctx* c = (const ut__cpu_axpy_ctx*)vc;
  float* restrict y = c->y;
  const float* restrict x = c->x;
  float alpha = c->alpha;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (ut__i64 i = lo; i < hi; i++) y[i] += alpha * x[i];
}
UT__CPU_OPT static int ut__cpu_axpy_f32(float* restrict y, const float* restrict x, ut__i64 n,
                                        float alpha) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_axpy_ctx c = {y, x, n, alpha};
  ut__parallel_run(nt, ut__cpu_axpy_part, &c);
  return UT_OK;
}

typedef struct {
  float* x;
  ut__i64 n;
} ut__cpu_round_ctx;
/* branch-free, so the loop vectorizes; the same bits as ut__bf16_bits */
UT__CPU_OPT static void ut__cpu_bf16_round_part(void* vc, int tid, int nt) {
  const ut__cpu_round_ctx* c = (const ut__cpu_round_ctx*)vc;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  uint32_t* u = (uint32_t*)(void*)c->x;
  for (ut__i64 i = lo; i < hi; i++) {
    uint32_t v = u[i];
    uint32_t even = (v + 0x7fffu + ((v >> 16) & 1u)) & 0xffff0000u;
    uint32_t quiet = (v | 0x00400000u) & 0xffff0000u; /* NaN: stays a NaN */
    u[i] = (v & 0x7fffffffu) > 0x7f800000u ? quiet : even;
  }
}
static void ut__cpu_bf16_round(float* x, ut__i64 n) {
  ut__cpu_round_ctx c = {x, n};
  ut__parallel_run(ut__cpu_nt((double)n), ut__cpu_bf16_round_part, &c);
}

typedef struct {
  float* x;
  ut__i64 n;
  float alpha;
} ut__cpu_scale_ctx;
UT__CPU_OPT static void ut__cpu_scale_part(void* vc, int tid, int nt) {
  const ut__cpu_scale_ctx* c = (const ut__cpu_scale_ctx*)vc;
  float* x = c->x;
  float alpha = c->alpha;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (ut__i64 i = lo; i < hi; i++) x[i] *= alpha;
}
UT__CPU_OPT static int ut__cpu_scale_f32(float* x, ut__i64 n, float alpha) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_scale_ctx c = {x, n, alpha};
  ut__parallel_run(nt, ut__cpu_scale_part, &c);
  return UT_OK;
}

/* NaN propagates (like torch.relu): the comparisons are false for NaN. */
typedef struct {
  const float* x;
  const float* go;
  float* y;
  ut__i64 n;
  float cap;
} ut__cpu_relu_ctx;
UT__CPU_OPT static void ut__cpu_relu_fwd_part(void* vc, int tid, int nt) {
  const ut__cpu_relu_ctx* c = (const ut__cpu_relu_ctx*)vc;
  const float* restrict x = c->x;
  float* restrict y = c->y;
  float cap = c->cap;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  if (cap > 0.0f) {
    for (ut__i64 i = lo; i < hi; i++) {
      float v = x[i] < 0.0f ? 0.0f : x[i];
      y[i] = v > cap ? cap : v;
    }
  } else {
    for (ut__i64 i = lo; i < hi; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
  }
}
UT__CPU_OPT static int ut__cpu_relu_fwd_f32(const float* restrict x, float* restrict y, ut__i64 n,
                                            float cap) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_relu_ctx c = {x, NULL, y, n, cap};
  ut__parallel_run(nt, ut__cpu_relu_fwd_part, &c);
  return UT_OK;
}

UT__CPU_OPT static void ut__cpu_relu_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_relu_ctx* c = (const ut__cpu_relu_ctx*)vc;
  const float* restrict go = c->go;
  const float* restrict x = c->x;
  float* restrict gi = c->y;
  float cap = c->cap;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  if (cap > 0.0f) {
    for (ut__i64 i = lo; i < hi; i++) {
      float v = x[i], g = go[i]; /* both loaded unconditionally: a branch-free select */
      int stop = (v <= 0.0f) | (v >= cap); /* false for NaN: it passes g on, like PyTorch */
      gi[i] = stop ? 0.0f : g;
    }
  } else {
    for (ut__i64 i = lo; i < hi; i++) {
      float v = x[i], g = go[i];
      gi[i] = v <= 0.0f ? 0.0f : g;
    }
  }
}
UT__CPU_OPT static int ut__cpu_relu_bwd_f32(const float* restrict go, const float* restrict x,
                                            float* restrict gi, ut__i64 n, float cap) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_relu_ctx c = {x, go, gi, n, cap};
  ut__parallel_run(nt, ut__cpu_relu_bwd_part, &c);
  return UT_OK;
}

/* The activations of act_fwd / act_bwd (ut__act_value, ut__act_grad: the formulas both
   backends share). One loop per kind, the kind a constant in it, so the switch is outside the
   loop and the piecewise kinds (hardswish, hardsigmoid) vectorize as selects, SiLU, Sigmoid
   and GELU through ut__expf and ut__gelu_cdf; GELU's tanh form calls tanhf per value, split over
   the threads as a bigger job. */
typedef struct {
  const float* x;
  const float* go;
  float* y;
  ut__i64 n;
  int act;
} ut__cpu_act_ctx;
/* and no-trapping-math: the selects of the piecewise kinds may then evaluate both sides'
   comparisons (an ordered comparison with NaN raises FE_INVALID, which GCC otherwise keeps
   conditional), so they vectorize; the values are the same, no one reads the FP flags */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && \
    !defined(__SANITIZE_THREAD__) && !defined(UT_NO_TARGET_CLONES)
/* On x86-64 (glibc, for the ifunc that picks a clone at load time) the loops are also built
   for AVX2 and AVX-512, which the baseline build (SSE2) leaves unused: SiLU's loop ran 2.6x
   (AVX2) and 5x (AVX-512) faster than SSE2's on one core. fp-contract=off keeps the clones'
   results those of the baseline to the bit (AVX-512 has FMA; SSE2 cannot contract anyway), so
   a machine's ISA does not change a result. Not under ThreadSanitizer, whose program crashes
   in an ifunc resolver that runs before it is set up (a segfault at start measured), nor with
   UT_NO_TARGET_CLONES defined (an application's own opt-out). */
#define UT__CPU_ACT_OPT                                                                     \
  __attribute__((optimize("O3", "fp-contract=off", "no-tree-loop-distribute-patterns",     \
                          "no-trapping-math"),                                             \
                 target_clones("avx512f", "avx2", "default")))
#elif defined(__GNUC__) && !defined(__clang__)
#define UT__CPU_ACT_OPT \
  __attribute__((optimize("O3", "fp-contract=fast", "no-tree-loop-distribute-patterns", \
                          "no-trapping-math")))
#else
#define UT__CPU_ACT_OPT
#endif
/* unrolled: GELU's and SiLU's values are long dependency chains, and four in flight keep the
   FMA units busy (GELU forward 1.4-1.5x faster on AVX-512) */
#if defined(__GNUC__) && !defined(__clang__)
#define UT__ACT_UNROLL _Pragma("GCC unroll 4")
#else
#define UT__ACT_UNROLL
#endif
#define UT__CPU_ACT_LOOP(A, EXPR)                             \
  case A:                                                     \
    UT__ACT_UNROLL                                            \
    for (ut__i64 i = lo; i < hi; i++) y[i] = EXPR;            \
    break
UT__CPU_ACT_OPT static void ut__cpu_act_fwd_part(void* vc, int tid, int nt) {
  const ut__cpu_act_ctx* c = (const ut__cpu_act_ctx*)vc;
  const float* restrict x = c->x;
  float* restrict y = c->y;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  switch (c->act) {
    UT__CPU_ACT_LOOP(UT_ACT_SILU, ut__act_value(UT_ACT_SILU, x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_HARDSWISH, ut__act_value(UT_ACT_HARDSWISH, x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_HARDSIGMOID, ut__act_value(UT_ACT_HARDSIGMOID, x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_SIGMOID, ut__act_value(UT_ACT_SIGMOID, x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_GELU, ut__act_value(UT_ACT_GELU, x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_GELU_TANH, ut__act_value(UT_ACT_GELU_TANH, x[i]));
  }
}
UT__CPU_ACT_OPT static void ut__cpu_act_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_act_ctx* c = (const ut__cpu_act_ctx*)vc;
  const float* restrict x = c->x;
  const float* restrict go = c->go;
  float* restrict y = c->y;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  switch (c->act) {
    UT__CPU_ACT_LOOP(UT_ACT_SILU, ut__act_grad(UT_ACT_SILU, go[i], x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_HARDSWISH, ut__act_grad(UT_ACT_HARDSWISH, go[i], x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_HARDSIGMOID, ut__act_grad(UT_ACT_HARDSIGMOID, go[i], x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_SIGMOID, ut__act_grad(UT_ACT_SIGMOID, go[i], x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_GELU, ut__act_grad(UT_ACT_GELU, go[i], x[i]));
    UT__CPU_ACT_LOOP(UT_ACT_GELU_TANH, ut__act_grad(UT_ACT_GELU_TANH, go[i], x[i]));
  }
}
#undef UT__CPU_ACT_LOOP
/* the work estimate for the thread count: a transcendental costs some ten plain operations */
static double ut__cpu_act_work(int act, ut__i64 n) {
  return (act == UT_ACT_HARDSWISH || act == UT_ACT_HARDSIGMOID ? 1.0 : 10.0) * (double)n;
}
static int ut__cpu_act_bad(const char* slot, int act) {
  return ut__set_error(UT_ERR_ARG, "cpu %s: activation %d has no kernel here", slot, act);
}
static bool ut__cpu_act_kind(int act) { return act >= UT_ACT_SILU && act <= UT_ACT_GELU_TANH; }
static int ut__cpu_act_fwd_f32(int act, const float* x, float* y, ut__i64 n) {
  if (!ut__cpu_act_kind(act)) return ut__cpu_act_bad("act_fwd", act);
  ut__cpu_act_ctx c = {x, NULL, y, n, act};
  ut__parallel_run(ut__cpu_nt(ut__cpu_act_work(act, n)), ut__cpu_act_fwd_part, &c);
  return UT_OK;
}
static int ut__cpu_act_bwd_f32(int act, const float* go, const float* x, float* gi, ut__i64 n) {
  if (!ut__cpu_act_kind(act)) return ut__cpu_act_bad("act_bwd", act);
  ut__cpu_act_ctx c = {x, go, gi, n, act};
  ut__parallel_run(ut__cpu_nt(ut__cpu_act_work(act, n)), ut__cpu_act_bwd_part, &c);
  return UT_OK;
}

/* ---- inference's output epilogue (issue 32) -------------------------------------------------
   y = act(scale y + shift) over a short run of outputs that the GEMM or the depthwise engine
   has just written (still in cache), in place: the folded BatchNorm's affine map and its
   activation. One loop per kind, the switch outside, as act_fwd's (and its options, so the
   values are act_fwd's and relu_fwd's to the bit for the same input). */
#define UT__CPU_EPI_LOOP(A)                                               \
  case A:                                                                 \
    for (ut__i64 i = 0; i < n; i++) y[i] = ut__act_value(A, y[i]);        \
    break
UT__CPU_ACT_OPT static void ut__cpu_epi_run(float* restrict y, ut__i64 n, int act) {
  switch (act) {
    case UT_ACT_RELU: /* relu_fwd's rule: NaN passes */
      for (ut__i64 i = 0; i < n; i++) y[i] = y[i] < 0.0f ? 0.0f : y[i];
      break;
    case UT_ACT_RELU6:
      for (ut__i64 i = 0; i < n; i++) {
        float v = y[i] < 0.0f ? 0.0f : y[i];
        y[i] = v > 6.0f ? 6.0f : v;
      }
      break;
    UT__CPU_EPI_LOOP(UT_ACT_SILU);
    UT__CPU_EPI_LOOP(UT_ACT_HARDSWISH);
    UT__CPU_EPI_LOOP(UT_ACT_HARDSIGMOID);
    UT__CPU_EPI_LOOP(UT_ACT_SIGMOID);
    UT__CPU_EPI_LOOP(UT_ACT_GELU);
    UT__CPU_EPI_LOOP(UT_ACT_GELU_TANH);
  }
}
#undef UT__CPU_EPI_LOOP
/* ut__cpu_epi_run over n values on the pool's threads (a pass of its own) */
typedef struct {
  float* y;
  ut__i64 n;
  int act;
} ut__cpu_epi_ctx;
static void ut__cpu_epi_part(void* vc, int tid, int nt) {
  const ut__cpu_epi_ctx* c = (const ut__cpu_epi_ctx*)vc;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  ut__cpu_epi_run(c->y + lo, hi - lo, c->act);
}
static void ut__cpu_epi_pass(float* y, ut__i64 n, int act) {
  ut__cpu_epi_ctx c = {y, n, act};
  ut__parallel_run(ut__cpu_nt(ut__cpu_act_work(act, n)), ut__cpu_epi_part, &c);
}
/* rows x cols of a row-major block (row stride ld), row r taking scale[r] and shift[r] */
UT__CPU_ACT_OPT static void ut__cpu_epi_rows(float* y, ut__i64 ld, int rows, ut__i64 cols,
                                             const float* scale, const float* shift, int act) {
  for (int r = 0; r < rows; r++) {
    float* restrict yr = y + r * ld;
    const float s = scale[r], t = shift[r];
    for (ut__i64 i = 0; i < cols; i++) yr[i] = yr[i] * s + t;
    if (act != UT_ACT_NONE) ut__cpu_epi_run(yr, cols, act);
  }
}

/* ---- layout ------------------------------------------------------------------------------ */

/* in: [outer, d0, mid, d1, inner] -> out: [outer, d1, mid, d0, inner], in tiles of 32 x 32. */
typedef struct {
  const float* in;
  float* out;
  int d0, mid, d1, inner;
  ut__i64 nti, ntj, tasks, in_i, out_j;
} ut__cpu_transpose_ctx;
UT__CPU_OPT static void ut__cpu_transpose_part(void* vc, int tid, int nt) {
  const ut__cpu_transpose_ctx* c = (const ut__cpu_transpose_ctx*)vc;
  const int T = 32;
  const float* in = c->in;
  float* out = c->out;
  int d0 = c->d0, mid = c->mid, d1 = c->d1, inner = c->inner;
  ut__i64 nti = c->nti, ntj = c->ntj, in_i = c->in_i, out_j = c->out_j;
  ut__i64 lo, hi;
  ut__cpu_part(c->tasks, tid, nt, &lo, &hi);
  for (ut__i64 t = lo; t < hi; t++) {
    ut__i64 jt = t % ntj, om = t / ntj;
    int m = (int)(om % mid), o = (int)(om / mid);
    int j0 = (int)jt * T, j1 = UT__CPU_MIN(d1, j0 + T);
    const float* src = in + ((ut__i64)o * d0 * mid + m) * d1 * inner;
    float* dst = out + ((ut__i64)o * d1 * mid + m) * d0 * inner;
    for (ut__i64 it = 0; it < nti; it++) {
      int i0 = (int)it * T, i1 = UT__CPU_MIN(d0, i0 + T);
      for (int j = j0; j < j1; j++) {
        float* dr = dst + (ut__i64)j * out_j;
        if (inner == 1) {
          for (int i = i0; i < i1; i++) dr[i] = src[(ut__i64)i * in_i + j];
        } else if (inner <= 64) {
          /* short rows (a merged pointwise conv's planes: 4, 16, 64 floats): an inlined copy,
             not a call to memcpy per row */
          for (int i = i0; i < i1; i++) {
            float* restrict d = dr + (ut__i64)i * inner;
            const float* restrict s = src + (ut__i64)i * in_i + (ut__i64)j * inner;
            for (int q = 0; q < inner; q++) d[q] = s[q];
          }
        } else {
          for (int i = i0; i < i1; i++)
            memcpy(dr + (ut__i64)i * inner, src + (ut__i64)i * in_i + (ut__i64)j * inner,
                   (size_t)inner * sizeof(float));
        }
      }
    }
  }
}
static int ut__cpu_transpose_f32(const float* in, float* out, int outer, int d0, int mid, int d1,
                                 int inner) {
  const int T = 32;
  ut__i64 nti = (d0 + T - 1) / T, ntj = (d1 + T - 1) / T;
  ut__i64 tasks = (ut__i64)outer * mid * ntj;
  ut__i64 total = (ut__i64)outer * d0 * mid * d1 * inner;
  int nt = ut__cpu_nt((double)total);
  ut__i64 in_i = (ut__i64)mid * d1 * inner, out_j = (ut__i64)mid * d0 * inner;
  ut__cpu_transpose_ctx c = {in, out, d0, mid, d1, inner, nti, ntj, tasks, in_i, out_j};
  ut__parallel_run(nt, ut__cpu_transpose_part, &c);
  return UT_OK;
}

typedef struct {
  float* x;
  const float* bias;
  int c;
  ut__i64 inner, rows;
} ut__cpu_bias_add_ctx;
UT__CPU_OPT static void ut__cpu_bias_add_part(void* vc, int tid, int nt) {
  const ut__cpu_bias_add_ctx* cx = (const ut__cpu_bias_add_ctx*)vc;
  float* x = cx->x;
  const float* bias = cx->bias;
  int c = cx->c;
  ut__i64 inner = cx->inner;
  ut__i64 lo, hi;
  ut__cpu_part(cx->rows, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++) {
    float b = bias[r % c];
    float* p = x + r * inner;
    for (ut__i64 i = 0; i < inner; i++) p[i] += b;
  }
}
UT__CPU_OPT static int ut__cpu_bias_add_f32(float* x, const float* bias, int n, int c,
                                            ut__i64 inner) {
  ut__i64 rows = (ut__i64)n * c;
  int nt = ut__cpu_nt((double)rows * inner);
  ut__cpu_bias_add_ctx cx = {x, bias, c, inner, rows};
  ut__parallel_run(nt, ut__cpu_bias_add_part, &cx);
  return UT_OK;
}

/* The channel multiplier's repeat and its adjoint (see ut__dw_repeat), over the input's rows
   [n*c] of `inner` floats. */
typedef struct {
  const float* x;
  float* y;
  int m;
  ut__i64 inner, rows;
} ut__cpu_chan_ctx;
UT__CPU_OPT static void ut__cpu_chan_repeat_part(void* vc, int tid, int nt) {
  const ut__cpu_chan_ctx* cx = (const ut__cpu_chan_ctx*)vc;
  ut__i64 lo, hi;
  ut__cpu_part(cx->rows, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++)
    for (int k = 0; k < cx->m; k++)
      memcpy(cx->y + (r * cx->m + k) * cx->inner, cx->x + r * cx->inner,
             sizeof(float) * (size_t)cx->inner);
}
UT__CPU_OPT static void ut__cpu_chan_group_sum_part(void* vc, int tid, int nt) {
  const ut__cpu_chan_ctx* cx = (const ut__cpu_chan_ctx*)vc;
  ut__i64 lo, hi, inner = cx->inner;
  ut__cpu_part(cx->rows, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++) {
    float* y = cx->y + r * inner;
    const float* x = cx->x + r * cx->m * inner;
    memcpy(y, x, sizeof(float) * (size_t)inner);
    for (int k = 1; k < cx->m; k++)
      for (ut__i64 i = 0; i < inner; i++) y[i] += x[k * inner + i];
  }
}
static int ut__cpu_chan_repeat_f32(const float* x, float* y, int n, int c, int m, ut__i64 inner) {
  ut__cpu_chan_ctx cx = {x, y, m, inner, (ut__i64)n * c};
  ut__parallel_run(ut__cpu_nt((double)cx.rows * m * inner), ut__cpu_chan_repeat_part, &cx);
  return UT_OK;
}
static int ut__cpu_chan_group_sum_f32(const float* x, float* y, int n, int c, int m,
                                      ut__i64 inner) {
  ut__cpu_chan_ctx cx = {x, y, m, inner, (ut__i64)n * c};
  ut__parallel_run(ut__cpu_nt((double)cx.rows * m * inner), ut__cpu_chan_group_sum_part, &cx);
  return UT_OK;
}

/* Row sums and means: x [rows, cols] in, per-row out (part: doubles, y: floats). */
typedef struct {
  const float* x;
  double* part;
  float* y;
  ut__i64 rows, cols;
} ut__cpu_rows_ctx;
static void ut__cpu_channel_sum_part(void* vc, int tid, int nt) {
  const ut__cpu_rows_ctx* c = (const ut__cpu_rows_ctx*)vc;
  const float* x = c->x;
  double* part = c->part;
  ut__i64 inner = c->cols;
  ut__i64 lo, hi;
  ut__cpu_part(c->rows, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++) part[r] = ut__cpu_sum(x + r * inner, inner);
}

/* Per-row partial sums (in parallel), then each channel adds its rows in order of i. */
static int ut__cpu_channel_sum_f32(const float* x, float* out, int n, int c, ut__i64 inner,
                                   float beta) {
  ut__i64 rows = (ut__i64)n * c;
  double stackbuf[256];
  double* part = rows <= 256 ? stackbuf : (double*)malloc((size_t)rows * sizeof(double));
  if (!part) return ut__set_error(UT_ERR_MEMORY, "channel_sum: out of memory");
  int nt = ut__cpu_nt((double)rows * inner);
  ut__cpu_rows_ctx rc = {x, part, NULL, rows, inner};
  ut__parallel_run(nt, ut__cpu_channel_sum_part, &rc);
  for (int j = 0; j < c; j++) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += part[(ut__i64)i * c + j];
    out[j] = (beta != 0.0f ? beta * out[j] : 0.0f) + (float)s;
  }
  if (part != stackbuf) free(part);
  return UT_OK;
}

static void ut__cpu_row_mean_part(void* vc, int tid, int nt) {
  const ut__cpu_rows_ctx* c = (const ut__cpu_rows_ctx*)vc;
  const float* x = c->x;
  float* y = c->y;
  ut__i64 cols = c->cols;
  ut__i64 lo, hi;
  ut__cpu_part(c->rows, tid, nt, &lo, &hi);
  for (int r = (int)lo; r < hi; r++)
    y[r] = cols > 0 ? (float)(ut__cpu_sum(x + (ut__i64)r * cols, cols) / (double)cols) : 0.0f;
}
static int ut__cpu_row_mean_f32(const float* x, float* y, int rows, ut__i64 cols) {
  int nt = ut__cpu_nt((double)rows * cols);
  ut__cpu_rows_ctx c = {x, NULL, y, rows, cols};
  ut__parallel_run(nt, ut__cpu_row_mean_part, &c);
  return UT_OK;
}

/* x is go here, y is dx */
UT__CPU_OPT static void ut__cpu_row_mean_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_rows_ctx* c = (const ut__cpu_rows_ctx*)vc;
  const float* go = c->x;
  float* dx = c->y;
  ut__i64 cols = c->cols;
  ut__i64 lo, hi;
  ut__cpu_part(c->rows, tid, nt, &lo, &hi);
  for (int r = (int)lo; r < hi; r++) {
    float v = (float)((double)go[r] / (double)cols);
    float* p = dx + (ut__i64)r * cols;
    for (ut__i64 i = 0; i < cols; i++) p[i] = v;
  }
}
UT__CPU_OPT static int ut__cpu_row_mean_bwd_f32(const float* go, float* dx, int rows,
                                                ut__i64 cols) {
  int nt = ut__cpu_nt((double)rows * cols);
  ut__cpu_rows_ctx c = {go, NULL, dx, rows, cols};
  ut__parallel_run(nt, ut__cpu_row_mean_bwd_part, &c);
  return UT_OK;
}

/* ---- convolution geometry helpers ---------------------------------------------------------
   For an output column ox and tap kx the input column is ix = ox*s + kx - p. lo/hi bound the
   output columns whose ix lies in [0, w): ox in [lo, hi), clamped to [0, wo]. p may be
   negative (the transposed form of a convolution whose padding exceeds kernel-1). */
static inline int ut__cpu_ceil_div(int t, int s) { /* t > 0; strides 1 and 2 skip the divide */
  return s == 1 ? t : s == 2 ? (t + 1) >> 1 : (t + s - 1) / s;
}
static inline int ut__cpu_lo(int kx, int s, int p, int wo) {
  int t = p - kx;
  int r = t <= 0 ? 0 : ut__cpu_ceil_div(t, s);
  return r < wo ? r : wo;
}
static inline int ut__cpu_hi(int kx, int s, int p, int w, int wo) {
  int t = w + p - kx;
  int r = t <= 0 ? 0 : ut__cpu_ceil_div(t, s);
  return r < wo ? r : wo;
}

/* ---- depthwise engines ----------------------------------------------------------------------
   Three engines, written over vectors of V floats
   (ut__vec) and built once per width in ISA VARIANTS (the last section): 16 for AVX-512, 8 for
   AVX2, 4 for the baseline. Plane sizes in the call's context (vectors per row, lane masks)
   are laid out for the width that runs (ut__cpu_isa()->dw_lanes).

   Row engine (any geometry). Output row oy of a correlation with stride s reads the input rows
   iy = oy*s - py + ky. Each input row is turned once into s phase rows (zero padded at the
   ends, P_b[c] = x[iy][c*s + b - px]) kept in a ring of kh slots, so every tap (ky, kx) is one
   contiguous stream P_{kx%s}[ox + kx/s] and a vector of 16 outputs is kh*kw loads + FMAs with
   the weights in registers; rows outside x read a zero slot. 3x3 and 5x5 at stride 1 are
   compiled with constant sizes; every other filter up to 7x7 (any stride, any dilation, the
   taps spaced by the engine rather than by zeros in the filter) runs on the any-height
   engines, compiled per filter width, which keep their sums in registers over the filter rows
   and split strided rows into phases with vector shuffles (ut__dwf_rows_kw, ut__dwdw_rows_kw).

   Flat engine (stride 1, "same" geometry: ho == h, wo == w, small planes). The plane is one
   stream: output o reads input o + d_t for tap t, d_t = (ky-py)*w + kx-px, and a precomputed
   lane mask per (output vector, tap) zeroes the lanes whose tap falls outside the plane. The
   loads may run into the neighbouring planes of the same tensor (masked away); planes at the
   ends of the tensor are copied into a buffer with a margin first.

   Phase-plane engine (stride 2, square 3x3 to 7x7 filters, planes up to 4 MB). The plane is
   split once into its four phase planes (row parity x column parity), zero padded, rows C->s2pw
   long; every tap is then a stride-1 read of one of them, the outputs one flat run over rows
   s2pw long whose columns past wo are junk, copied out row by row (ut__dwf_s2_planes). Small
   planes go several at a time through each stage.

   Stores: vectors of 16 outputs are stored whole when they end before `ylim` (the end of the
   calling thread's range of planes): the lanes past a row land in rows this thread computes
   later, which overwrite them. Only stores reaching past ylim are cut.
   ============================================================================================ */
#define UT__DW_R16(v) (((v) + 15) & ~(ut__i64)15)
/* go rows a block of the any-height filter-gradient engine (ut__dwdw_rows_kw) */
#define UT__DWDW_RB 8

/* Everything a depthwise call needs; built by the entry points, read by the ISA variants. */
typedef struct ut__dwctx {
  const float* x;  /* input [planes, h, w] (go for dx) */
  const float* go; /* dW: [planes, ho, wo] */
  const float* wt; /* [c, kh, kw] (turned by 180 degrees for the stride-1 dx) */
  const float* bias;
  float* y;
  float* dw;
  int c, h, w, kh, kw, s, py, px, ho, wo;
  int dil; /* tap spacing of the any-height row engine (ut__dwf_rows_kw); 0 or 1: none */
  ut__i64 planes;
  /* row engine sizes */
  int Wq, nv, PS, SL; /* phase row length, vectors per output row, phase row / slot stride */
  /* flat engine */
  int flat, nvec, taps, dmin, dmax, marg;
  const int* d;      /* [taps] */
  const int32_t* M;  /* [nvec][taps][16] lane masks; then [nvec][16] output-valid masks */
  /* stride-2 phase-plane engine (ut__dwf_s2_planes): s2 is the filter size (3, 5 or 7), or 0 */
  int s2, s2pw, s2rows, s2g; /* a phase plane's row length and rows; planes at a time */
  int act; /* forward: a ut_activation applied to each few planes once written (issue 32) */
} ut__dwctx;

/* complete unrolling of the filter loops (GCC's size limits stop short of 5x5 with two rows) */
#if defined(__GNUC__) && !defined(__clang__)
#define UT__DW_UNROLL _Pragma("GCC unroll 32")
#elif defined(__clang__)
#define UT__DW_UNROLL _Pragma("unroll")
#else
#define UT__DW_UNROLL
#endif

/* ---- the kernels of one instruction set ------------------------------------------------
   The hot kernels (depthwise engines, the transposed-convolution gather, the GEMM micro-kernel
   and dot-product engine) are built once per instruction set in ISA VARIANTS, the last
   section, each into a table like this one; ut__cpu_isa() returns the table for this CPU. */
typedef void (*ut__cpu_dwf_fn)(const ut__dwctx* C, ut__i64 q0, ut__i64 q1, float* buf);
typedef void (*ut__cpu_dwdw_fn)(const ut__dwctx* C, int ch, double* dacc, float* buf);
typedef void (*ut__cpu_tconv_fn)(const float* src, ut__i64 tap_stride, const float* wk,
                                 float* dx, int h, int w, int kh, int kw, int s, int p, int ho,
                                 int wo, float* tmp);
/* The micro-kernel reads A's value (row r, step k) at ap[r * a_rs + k * a_ks] and B's NR values
   of step k at bp + k * b_ks: packed panels (a_rs 1, a_ks MR, b_ks NR), or the operands in place
   where a panel would be used only once or twice (see ut__cpu_gemm_task). */
typedef void (*ut__cpu_gemm_kern)(int kc, const float* ap, ut__i64 a_rs, ut__i64 a_ks,
                                  const float* bp, ut__i64 b_ks, float* c, ut__i64 ldc, int mr,
                                  int nr, float alpha, float beta, const float* rs,
                                  const float* rt, int act);
typedef void (*ut__cpu_dot_kern)(const float* a, int lda, const float* b, int ldb, int mc, int nc,
                                 int kc, float* acc);
/* 8 rows of A (row stride lda) over kc steps -> one k-major 8-row micro-panel */
typedef void (*ut__cpu_pack8_fn)(const float* a, ut__i64 lda, int kc, float* dst);
typedef struct ut__cpu_isa_kernels {
  const char* name;         /* "avx512", "avx2" or "base" */
  int dw_lanes;             /* the depthwise engines' vector width (plane layouts follow it) */
  ut__cpu_dwf_fn dw_forward; /* forward over planes [q0, q1) (and the stride-1 dx) */
  ut__cpu_dwf_fn dw_dx;      /* input gradient, stride >= 2, over planes [q0, q1) */
  ut__cpu_dwdw_fn dw_dw;     /* filter gradient of one channel */
  ut__cpu_tconv_fn tconv;    /* col2im's gather, one plane */
  ut__cpu_gemm_kern gemm;    /* MR x NR micro-kernel */
  int gemm_mr, gemm_nr;
  bool gemm_epi;             /* the micro-kernel applies inference's epilogue itself */
  ut__cpu_pack8_fn pack_a8;  /* ut__cpu_pack_a of 8-row panels from rows of A, or NULL */
  ut__cpu_dot_kern dot;      /* dot-product engine: dot_vl lanes, dot_rm x dot_rn tiles */
  int dot_vl, dot_rm, dot_rn;
} ut__cpu_isa_kernels;
static const ut__cpu_isa_kernels* ut__cpu_isa(void);

/* ---- im2col / col2im ----------------------------------------------------------------------- */

typedef struct {
  const float* x;
  float* col;
  const ut__conv_geom* g;
} ut__cpu_im2col_ctx;
static void ut__cpu_im2col_part(void* vc, int tid, int nt) {
  const ut__cpu_im2col_ctx* c = (const ut__cpu_im2col_ctx*)vc;
  const float* x = c->x;
  float* col = c->col;
  const ut__conv_geom* g = c->g;
  int h = g->h, w = g->w, kh = g->kh, kw = g->kw, s = g->stride, p = g->pad, ho = g->ho,
      wo = g->wo;
  ut__i64 rows = (ut__i64)g->n * g->c * kh * kw, hw = (ut__i64)ho * wo;
  ut__i64 lo_r, hi_r;
  ut__cpu_part(rows, tid, nt, &lo_r, &hi_r);
  for (ut__i64 r = lo_r; r < hi_r; r++) {
    int kx = (int)(r % kw), ky = (int)(r / kw % kh);
    ut__i64 plane = r / ((ut__i64)kh * kw);
    const float* xp = x + plane * h * w;
    float* dst = col + r * hw;
    int lo = ut__cpu_lo(kx, s, p, wo), hi = UT__CPU_MAX(ut__cpu_hi(kx, s, p, w, wo), lo);
    int off = kx - p;
    for (int oy = 0; oy < ho; oy++) {
      float* d = dst + (ut__i64)oy * wo;
      int iy = oy * s - p + ky;
      if (iy < 0 || iy >= h) {
        memset(d, 0, (size_t)wo * sizeof(float));
        continue;
      }
      const float* xr = xp + (ut__i64)iy * w;
      for (int ox = 0; ox < lo; ox++) d[ox] = 0.0f;
      if (s == 1) {
        if (hi > lo) memcpy(d + lo, xr + lo + off, (size_t)(hi - lo) * sizeof(float));
      } else {
        for (int ox = lo; ox < hi; ox++) d[ox] = xr[ox * s + off];
      }
      for (int ox = hi; ox < wo; ox++) d[ox] = 0.0f;
    }
  }
}

/* x: [n, c, h, w] -> col: [n, c*kh*kw, ho*wo]; one task per (n, c, ky, kx) row of col. */
static int ut__cpu_im2col_f32(const float* x, float* col, const ut__conv_geom* g) {
  ut__i64 rows = (ut__i64)g->n * g->c * g->kh * g->kw, hw = (ut__i64)g->ho * g->wo;
  int nt = ut__cpu_nt((double)rows * hw);
  ut__cpu_im2col_ctx c = {x, col, g};
  ut__parallel_run(nt, ut__cpu_im2col_part, &c);
  return UT_OK;
}

typedef struct {
  const float* col;
  float* dx;
  const ut__conv_geom* g;
  const float* ones;
  float* tmp0;
  ut__i64 tmpn;
  ut__cpu_tconv_fn fn;
} ut__cpu_col2im_ctx;
static void ut__cpu_col2im_part(void* vc, int tid, int nt) {
  const ut__cpu_col2im_ctx* c = (const ut__cpu_col2im_ctx*)vc;
  const ut__conv_geom* g = c->g;
  int h = g->h, w = g->w, kh = g->kh, kw = g->kw, s = g->stride, p = g->pad, ho = g->ho,
      wo = g->wo;
  ut__i64 planes = (ut__i64)g->n * g->c, hw = (ut__i64)ho * wo, taps = (ut__i64)kh * kw;
  const float* col = c->col;
  float* dx = c->dx;
  const float* ones = c->ones;
  ut__cpu_tconv_fn fn = c->fn;
  ut__i64 lo, hi;
  ut__cpu_part(planes, tid, nt, &lo, &hi);
  for (ut__i64 pl = lo; pl < hi; pl++) {
    float* tmp = c->tmp0 + (ut__i64)tid * c->tmpn;
    fn(col + pl * taps * hw, hw, ones, dx + pl * h * w, h, w, kh, kw, s, p, ho, wo, tmp);
  }
}

/* col: [n, c*kh*kw, ho*wo] -> dx: [n, c, h, w], gathered per (n, c) plane. */
static int ut__cpu_col2im_f32(const float* col, float* dx, const ut__conv_geom* g) {
  int w = g->w, kh = g->kh, kw = g->kw, s = g->stride, ho = g->ho, wo = g->wo;
  ut__i64 planes = (ut__i64)g->n * g->c, hw = (ut__i64)ho * wo, taps = (ut__i64)kh * kw;
  int nt = ut__cpu_nt((double)planes * taps * hw);
  ut__i64 qn = (w + s - 1) / s, tmpn = s > 1 ? (ut__i64)s * qn : 0;
  float* buf = (float*)malloc((size_t)(taps + (ut__i64)nt * tmpn) * sizeof(float));
  if (!buf) return ut__set_error(UT_ERR_MEMORY, "col2im: out of memory");
  for (ut__i64 t = 0; t < taps; t++) buf[t] = 1.0f;
  const float* ones = buf;
  float* tmp0 = buf + taps;
  ut__cpu_tconv_fn fn = ut__cpu_isa()->tconv;
  ut__cpu_col2im_ctx c = {col, dx, g, ones, tmp0, tmpn, fn};
  ut__parallel_run(nt, ut__cpu_col2im_part, &c);
  free(buf);
  return UT_OK;
}

/* ---- depthwise convolution ----------------------------------------------------------------- */

/* At stride 2, filter tap t under padding p reads input row (column) 2 o + t - p: phase
   (t - p) & 1, index o + ut__dw_s2_lo(t, p) of that phase. */
static inline int ut__dw_s2_lo(int t, int p) {
  int d = t - p;
  return (d - (d & 1)) / 2;
}

/* Row engine sizes and, for stride-1 "same" small planes with 3x3 or 5x5 filters, the flat
   engine's tables. Returns the floats each thread needs (0 on overflow). *tab: malloc'd tables
   (free it), NULL when unused. */
static ut__i64 ut__dw_setup(ut__dwctx* C, void** tab) {
  const int V = ut__cpu_isa()->dw_lanes;
  int s = C->s, dl = C->dil > 1 ? C->dil : 1;
  int kh = (C->kh - 1) * dl + 1, kw = (C->kw - 1) * dl + 1; /* the window's extent */
  *tab = NULL;
  /* the ring of phase rows (s * PS floats a slot) and the stride >= 2 gather's s * s tables grow
     with the stride: geometries whose scratch would not fit an int index or 2^40 floats a
     thread are refused (0) rather than overflowing the sizes below */
  ut__i64 ps = UT__DW_R16(((ut__i64)C->wo + V - 1) / V * V + (kw - 1) / s);
  if ((double)s * ps > (double)(INT_MAX / 2) ||
      (double)s * s * (3.0 * kh * kw + 1) + (double)(kh + 8 * s + 3) * s * ps > 1099511627776.0)
    return 0;
  C->Wq = C->wo + (kw - 1) / s;
  C->nv = (C->wo + V - 1) / V;
  C->PS = (int)UT__DW_R16((ut__i64)C->nv * V + (kw - 1) / s);
  C->SL = (int)UT__DW_R16((ut__i64)s * C->PS);
  ut__i64 taps = (ut__i64)kh * kw;
  /* kh + s + 1 ring slots and the zero slot: the any-height row engine's two output rows */
  ut__i64 per = (ut__i64)(kh + s + 3) * C->SL + 2 * ((ut__i64)C->nv * V + V) +
                taps * V + kh + kw + s + 192;
  /* the any-height filter gradient's block: ring, go rows, partial sums, tags */
  {
    ut__i64 nb = (ut__i64)(UT__DWDW_RB - 1) * s + kh;
    per = UT__CPU_MAX(per, (nb + 3) * C->SL + UT__DWDW_RB * ((ut__i64)C->nv * V + V) +
                               taps * V + 3 * nb + 256);
  }
  /* stride >= 2 input gradient */
  {
    int L = (kw - 1) / s, nq = (C->w + s - 1) / s, nvq = (nq + V - 1) / V;
    ut__i64 GP = UT__DW_R16(L + UT__CPU_MAX(nvq * V, C->wo) + (s - 1 + C->py) / s + 1);
    ut__i64 NS = (kh + s - 1) / s + 1;
    ut__i64 need = GP * (NS + 1) + (ut__i64)s * nvq * V + 4 * taps + 3 * NS + 64 +
                   (ut__i64)s * s * (3 * taps + 1);
    per = UT__CPU_MAX(per, need);
  }
  /* stride 2, square 3x3 to 7x7 filters: the phase-plane engine's four planes and its flat
     output run (ut__dwf_s2_planes) */
  C->s2 = 0;
  if (s == 2 && dl == 1 && C->kh == C->kw && (C->kh == 3 || C->kh == 5 || C->kh == 7) &&
      C->py >= 0 && C->px >= 0 && C->py < C->kh && C->px < C->kw) {
    int k = C->kh;
    ut__i64 pw = (ut__i64)C->wo + ut__dw_s2_lo(k - 1, C->px) - ut__dw_s2_lo(0, C->px);
    ut__i64 rows = (ut__i64)C->ho + ut__dw_s2_lo(k - 1, C->py) - ut__dw_s2_lo(0, C->py);
    ut__i64 one = 4 * UT__DW_R16(rows * pw + 3 * V) + UT__DW_R16(C->ho * pw + 2 * V);
    if (rows * pw <= (1 << 20)) { /* planes beyond 4 MB: the row engine's ring of rows */
      C->s2 = k;
      C->s2pw = (int)pw;
      C->s2rows = (int)rows;
      C->s2g = (int)UT__CPU_MAX(1, UT__CPU_MIN(8, 4096 / one)); /* 16 KB of small planes */
      per = UT__CPU_MAX(per, C->s2g * one);
    }
  }
  C->flat = 0;
  ut__i64 hw = (ut__i64)C->h * C->w;
  if (s == 1 && dl == 1 && C->ho == C->h && C->wo == C->w && (taps == 9 || taps == 25) &&
      C->w < 32 && hw <= 256 && C->py == (kh - 1) / 2 && C->px == (kw - 1) / 2) {
    int nvec = (int)((hw + V - 1) / V);
    size_t bytes = sizeof(int) * (size_t)taps +
                   sizeof(int32_t) * (size_t)V * (size_t)nvec * (size_t)(taps + 1) + 64;
    void* t = malloc(bytes);
    if (t) {
      int* d = (int*)t;
      int32_t* M = (int32_t*)(void*)ut__cpu_align64(d + taps);
      int h = C->h, w = C->w, dmin = 0, dmax = 0;
      for (int ky = 0; ky < kh; ky++)
        for (int kx = 0; kx < kw; kx++) {
          int dv = (ky - C->py) * w + (kx - C->px);
          d[ky * kw + kx] = dv;
          dmin = UT__CPU_MIN(dmin, dv);
          dmax = UT__CPU_MAX(dmax, dv);
        }
      for (int j = 0; j < nvec; j++)
        for (int l = 0; l < V; l++) {
          int o = j * V + l, oy = o / w, ox = o % w;
          for (int ky = 0; ky < kh; ky++)
            for (int kx = 0; kx < kw; kx++) {
              int iy = oy + ky - C->py, ix = ox + kx - C->px;
              bool ok = o < hw && iy >= 0 && iy < h && ix >= 0 && ix < w;
              M[((ut__i64)j * taps + ky * kw + kx) * V + l] = ok ? -1 : 0;
            }
          M[((ut__i64)nvec * taps + j) * V + l] = o < hw ? -1 : 0;
        }
      C->flat = 1;
      C->nvec = nvec;
      C->taps = (int)taps;
      C->d = d;
      C->M = M;
      C->dmin = dmin;
      C->dmax = dmax;
      C->marg = (int)UT__DW_R16(UT__CPU_MAX(-dmin, dmax));
      per = UT__CPU_MAX(per, 2 * UT__DW_R16(2 * (ut__i64)C->marg + (ut__i64)nvec * V +
                                             V) + 64);
      *tab = t;
    }
  }
  return UT__DW_R16(per);
}

/* Per-thread buffers, zeroed (the vector loops read slack past the data). per_thread 0: the
   geometry's scratch does not fit (ut__dw_setup), NULL. */
static float* ut__cpu_dw_bufs(int nt, ut__i64 per_thread, void** raw) {
  *raw = NULL;
  if (per_thread <= 0 || (double)nt * per_thread > (double)(SIZE_MAX / sizeof(float) / 2))
    return NULL;
  *raw = calloc((size_t)(nt * per_thread + 16), sizeof(float));
  return *raw ? ut__cpu_align64(*raw) : NULL;
}

typedef struct {
  const ut__dwctx* C;
  ut__cpu_dwf_fn fn;
  float* bufs;
  ut__i64 per;
} ut__cpu_dw_planes_ctx;
/* planes' outputs run through the activation together: some 64 KB, still in cache */
#define UT__CPU_DW_ACT_FLOATS 16384
static void ut__cpu_dw_planes_part(void* vc, int t, int nt) {
  const ut__cpu_dw_planes_ctx* c = (const ut__cpu_dw_planes_ctx*)vc;
  const ut__dwctx* C = c->C;
  ut__i64 planes = C->planes, per = c->per;
  ut__i64 lo = planes * t / nt, hi = planes * (t + 1) / nt;
  float* buf = c->bufs + (ut__i64)t * per;
  if (C->act == UT_ACT_NONE || C->act == UT_ACT_RELU || C->act == UT_ACT_RELU6) {
    c->fn(C, lo, hi, buf); /* the ReLUs in the engines' stores (ut__v_relus) */
    return;
  }
  ut__i64 plane = (ut__i64)C->ho * C->wo, step = UT__CPU_MAX(1, UT__CPU_DW_ACT_FLOATS / plane);
  for (ut__i64 p = lo; p < hi; p += step) {
    ut__i64 q = UT__CPU_MIN(hi, p + step);
    c->fn(C, p, q, buf);
    ut__cpu_epi_run(C->y + p * plane, (q - p) * plane, C->act);
  }
}

/* Runs fn over the planes, one contiguous range per thread. */
static int ut__cpu_dw_planes(ut__dwctx* C, bool gather_dx, double work, const char* what) {
  void* tab;
  ut__i64 per = ut__dw_setup(C, &tab);
  ut__i64 planes = C->planes;
  int nt = ut__cpu_nt(work);
  if (nt > planes) nt = (int)planes;
  void* raw;
  float* bufs = ut__cpu_dw_bufs(nt, per, &raw);
  if (!bufs) {
    free(tab);
    return per > 0 ? ut__set_error(UT_ERR_MEMORY, "%s: out of memory", what)
                   : ut__set_error(UT_ERR_SHAPE,
                                   "%s: stride %d and output width %d need more scratch memory "
                                   "than a depthwise convolution may use",
                                   what, C->s, C->wo);
  }
  ut__cpu_dwf_fn fn = gather_dx ? ut__cpu_isa()->dw_dx : ut__cpu_isa()->dw_forward;
  ut__cpu_dw_planes_ctx c = {C, fn, bufs, per};
  ut__parallel_run(nt, ut__cpu_dw_planes_part, &c);
  free(raw);
  free(tab);
  return UT_OK;
}

/* x * 0 is 0 for a finite x and NaN for an inf or a NaN: a sum of those vectorizes, where a
   test per element does not (4-10x faster on the scans before convolutions' fast paths). */
UT__CPU_OPT static bool ut__cpu_all_finite(const float* x, ut__i64 n) {
  for (ut__i64 i0 = 0; i0 < n; i0 += 4096) {
    ut__i64 len = UT__CPU_MIN((ut__i64)4096, n - i0);
    float acc[16] = {0};
    ut__i64 i = 0;
    for (; i + 16 <= len; i += 16)
      for (int u = 0; u < 16; u++) acc[u] += x[i0 + i + u] * 0.0f;
    for (; i < len; i++) acc[0] += x[i0 + i] * 0.0f;
    float t = 0.0f;
    for (int u = 0; u < 16; u++) t += acc[u];
    if (t != t) return false;
  }
  return true;
}
/* A convolution summed over the (output, tap) pairs whose input lies inside x only, as
   PyTorch's CPU convolutions (oneDNN, the depthwise 3x3 kernel) do: the fast paths here multiply
   padding zeros, which a non-finite weight or grad_out turns into NaN where PyTorch keeps the
   value finite. groups == c: depthwise ([c, kh, kw] weights), groups == 1: dense. The three
   directions: y = conv(x, w) + b (dst = y), dx = conv^T(go, w) (dst = dx), dW += go (x) x. */
static void ut__cpu_conv_real_input(ut__conv_dir dir, const float* x, const float* go,
                                    const float* w, const float* bias, float* dst, int out_c,
                                    bool depthwise, const ut__conv_geom* g) {
  int kh = g->kh, kw = g->kw, s = g->stride, p = g->pad, cin = g->c, d = g->dil;
  ut__i64 hw = (ut__i64)g->h * g->w, ohw = (ut__i64)g->ho * g->wo, taps = (ut__i64)kh * kw;
  int in_per = depthwise ? 1 : cin;
  if (dir == UT__CONV_DX) memset(dst, 0, sizeof(float) * (size_t)(g->n * cin * hw));
  if (dir == UT__CONV_Y)
    for (int n = 0; n < g->n; n++)
      for (int o = 0; o < out_c; o++)
        for (ut__i64 i = 0; i < ohw; i++) dst[((ut__i64)n * out_c + o) * ohw + i] = bias ? bias[o] : 0.f;
  for (int o = 0; o < out_c; o++)
    for (int j = 0; j < in_per; j++) {
      int ci = depthwise ? o : j;
      for (ut__i64 t = 0; t < taps; t++) {
        int ky = (int)(t / kw), kx = (int)(t % kw);
        ut__i64 wi = ((ut__i64)o * in_per + j) * taps + t;
        double acc = 0.0;
        for (int n = 0; n < g->n; n++) {
          const float* xp = x ? x + ((ut__i64)n * cin + ci) * hw : NULL;
          float* dxp = dst + ((ut__i64)n * cin + ci) * hw;
          ut__i64 ob = ((ut__i64)n * out_c + o) * ohw;
          for (int oy = 0; oy < g->ho; oy++) {
            ut__i64 iy = (ut__i64)oy * s - p + (ut__i64)ky * d;
            if (iy < 0 || iy >= g->h) continue;
            for (int ox = 0; ox < g->wo; ox++) {
              ut__i64 ix = (ut__i64)ox * s - p + (ut__i64)kx * d, xi = iy * g->w + ix, oi = (ut__i64)oy * g->wo + ox;
              if (ix < 0 || ix >= g->w) continue;
              if (dir == UT__CONV_Y) dst[ob + oi] += w[wi] * xp[xi];
              else if (dir == UT__CONV_DX) dxp[xi] += go[ob + oi] * w[wi];
              else acc += (double)go[ob + oi] * xp[xi];
            }
          }
        }
        if (dir == UT__CONV_DW) dst[wi] += (float)acc;
      }
    }
}

/* Strided depthwise convolutions of small planes run as stride 1 on the full grid: the flat
   engine (stride 1, "same", planes up to 256 pixels) is 4-8x faster per plane than the row
   engine's phase rows at stride 2 and 3, more than the s*s times the taps it computes.
   Forward keeps every s-th output (the forward at stride 2 has its own engine); dx and dW see
   grad_out spread onto the full grid (zeros between), which is exactly the strided transposed
   convolution. Returns the stride-1 geometry in g1, or false when the shape is not such a
   case. */
static bool ut__cpu_dw_via_stride1(const ut__conv_geom* g, ut__conv_geom* g1) {
  if (g->stride < 2 || g->dil > 1 || g->kh != g->kw || (g->kh != 3 && g->kh != 5) ||
      g->pad != (g->kh - 1) / 2 ||
      g->w >= 32 || (ut__i64)g->h * g->w > 256 || g->ho != (g->h - 1) / g->stride + 1 ||
      g->wo != (g->w - 1) / g->stride + 1)
    return false;
  *g1 = *g;
  g1->stride = 1;
  g1->ho = g->h;
  g1->wo = g->w;
  return true;
}
/* go [planes, ho, wo] -> [planes, h, w] with go at every s-th row and column, zeros elsewhere */
static float* ut__cpu_dw_spread(const float* go, const ut__conv_geom* g) {
  ut__i64 planes = (ut__i64)g->n * g->c, hw = (ut__i64)g->h * g->w;
  float* up = (float*)calloc((size_t)(planes * hw) + 1, sizeof(float));
  if (!up) return NULL;
  int s = g->stride;
  for (ut__i64 q = 0; q < planes; q++)
    for (int oy = 0; oy < g->ho; oy++)
      for (int ox = 0; ox < g->wo; ox++)
        up[q * hw + (ut__i64)oy * s * g->w + (ut__i64)ox * s] =
            go[(q * g->ho + oy) * g->wo + ox];
  return up;
}

/* Dilation: the filter spread onto its full window, zeros between the taps
   ([c, kh, kw] -> [c, (kh-1)d+1, (kw-1)d+1]), runs on the undilated engines: the same outputs,
   d^2 times the taps (2.8x for 3x3 at d = 2), where a kernel per dilation would duplicate
   every engine. The zero taps meet every input in the window, so non-finite input (x forward,
   go for dx) goes to the exact convolution instead, which reads the real taps only. */
typedef struct {
  ut__conv_geom g;  /* undilated, on the spread filter */
  float* w;         /* the spread filter (NULL: out of memory, error set) */
} ut__cpu_dw_undilated;
static ut__cpu_dw_undilated ut__cpu_dw_undilate(const float* wt, const ut__conv_geom* g) {
  ut__cpu_dw_undilated r = {*g, NULL};
  int d = g->dil, eh = (g->kh - 1) * d + 1, ew = (g->kw - 1) * d + 1;
  r.g.kh = eh;
  r.g.kw = ew;
  r.g.dil = 1;
  r.w = (float*)calloc((size_t)g->c * eh * ew + 1, sizeof(float));
  if (!r.w) {
    ut__set_error(UT_ERR_MEMORY, "depthwise dilation: out of memory");
    return r;
  }
  if (wt)
    for (ut__i64 ch = 0; ch < g->c; ch++)
      for (int ky = 0; ky < g->kh; ky++)
        for (int kx = 0; kx < g->kw; kx++)
          r.w[(ch * eh + (ut__i64)ky * d) * ew + (ut__i64)kx * d] =
              wt[(ch * g->kh + ky) * g->kw + kx];
  return r;
}
static int ut__cpu_dw_fwd_f32(const float* x, const float* wt, const float* bias, float* y,
                              const ut__conv_geom* g);
static int ut__cpu_dw_bwd_dx_f32(const float* go, const float* wt, float* dx,
                                 const ut__conv_geom* g);
static int ut__cpu_dw_bwd_dw_f32(const float* go, const float* x, float* dw,
                                 const ut__conv_geom* g);
static int ut__cpu_dw_dilated(ut__conv_dir dir, const float* x, const float* go, const float* wt,
                              const float* bias, float* dst, const ut__conv_geom* g) {
  ut__i64 planes = (ut__i64)g->n * g->c;
  if (dir == UT__CONV_Y && !ut__cpu_all_finite(x, planes * g->h * g->w)) {
    ut__cpu_conv_real_input(UT__CONV_Y, x, NULL, wt, bias, dst, g->c, true, g);
    return UT_OK;
  }
  if (dir == UT__CONV_DX && !ut__cpu_all_finite(go, planes * g->ho * g->wo)) {
    ut__cpu_conv_real_input(UT__CONV_DX, NULL, go, wt, NULL, dst, g->c, true, g);
    return UT_OK;
  }
  ut__cpu_dw_undilated f = ut__cpu_dw_undilate(dir == UT__CONV_DW ? NULL : wt, g);
  if (!f.w) return ut__err_status;
  int st;
  if (dir == UT__CONV_Y) st = ut__cpu_dw_fwd_f32(x, f.w, bias, dst, &f.g);
  else if (dir == UT__CONV_DX) st = ut__cpu_dw_bwd_dx_f32(go, f.w, dst, &f.g);
  else { /* dW of the spread filter (its exact per-tap fallback included), then the real taps */
    st = ut__cpu_dw_bwd_dw_f32(go, x, f.w, &f.g);
    int d = g->dil, eh = f.g.kh, ew = f.g.kw;
    for (ut__i64 ch = 0; st >= 0 && ch < g->c; ch++)
      for (int ky = 0; ky < g->kh; ky++)
        for (int kx = 0; kx < g->kw; kx++)
          dst[(ch * g->kh + ky) * g->kw + kx] +=
              f.w[(ch * eh + (ut__i64)ky * d) * ew + (ut__i64)kx * d];
  }
  free(f.w);
  return st;
}

/* Dilated filters up to 7x7 run on the any-height row engines, which space the taps
   themselves: no zero taps, so no d^2 times the work. */
static bool ut__cpu_dw_dil_native(const ut__conv_geom* g) {
  return g->kh <= 7 && g->kw <= 7;
}

/* Depthwise over small planes (at most UT__DW_SMALL_HW values in and out, or at a stride up to
   UT__DW_SMALL_IN in: the late layers of a network trained at 64^2, ConvNeXt's 4x4 and 2x2
   under a 7x7 filter, MobileNet v1's 8x8 -> 4x4): the plane engines run
   vectors along a plane's rows, four or two values wide there, and over every tap, most of
   them padding (at 4x4, 16 of a 7x7 filter's 49 taps meet the input). Here the (output, tap,
   input) triples that meet real input are listed once per call, and each block of channels is
   turned channels-last in a scratch buffer, so a triple is one vector operation over the
   block's channels. Only real input enters a sum, which is what the exact passes of the other
   engines compute for non-finite values: no check is needed. The order of every sum is fixed
   (taps in order, images in order for dW), whatever the thread count. */
#define UT__DW_SMALL_HW 16
#define UT__DW_SMALL_IN 64 /* a strided plane's input values (its output: UT__DW_SMALL_HW) */
#define UT__DW_SMALL_TAPS 49
#define UT__DW_SMALL_CB 64 /* channels per block: the scratch planes stay in L1 */
/* Where the turn to channels-last costs less than the padding taps save (2 cores, batch 8,
   forward + backward): 4x4 under 7x7 1.26 -> 0.43 ms (384 channels), 2x2 under 7x7 1.61 ->
   0.21 ms (768), 2x2 under 5x5 0.52 -> 0.18 ms (960); the plane engines stay faster under a
   3x3 filter at stride 1 (4x4: 0.15 against 0.32 ms) and from 8x8 on (8x8 under 7x7: 1.06
   against 1.44). Strided, a 3x3 filter's small planes are the phase-plane engine's worst case
   (4x4 -> 2x2 over 512 channels, batch 8: forward 118-167 against 35-48 us, backward 176-182
   against 85-96 us), and so are strided planes of up to 64 values whose outputs fit 16 values
   (7x7 and 8x8 -> 4x4, 512 channels, batch 8, forward + backward: 3x3 0.58-0.66 against
   0.39-0.47 ms, 5x5 0.90-0.95 against 0.64-0.75). */
static bool ut__cpu_dw_small(const ut__conv_geom* g) {
  int taps = g->kh * g->kw;
  ut__i64 hw = (ut__i64)g->h * g->w;
  if ((ut__i64)g->ho * g->wo > UT__DW_SMALL_HW || taps > UT__DW_SMALL_TAPS || g->c < 8)
    return false;
  if (g->stride >= 2 && taps >= 9) return hw <= UT__DW_SMALL_IN;
  return hw <= UT__DW_SMALL_HW && (taps >= 25 || hw <= 4);
}
typedef struct {
  const ut__conv_geom* g;
  ut__conv_dir dir;
  const float* src;  /* x (forward, dW) or grad_out (dx) */
  const float* go;   /* dW: grad_out */
  const float* wtt;  /* forward, dx: the filter channels-last, [taps][c] */
  const float* bias; /* forward */
  float* dst;        /* y, dx, or dW (added to) */
  const int* tri;    /* [ntri][3]: output, tap, input (plane offsets), by output then tap */
  int ntri;
  ut__i64 tasks, cblocks;
  double* scratch; /* per tid: UT__DW_SMALL_SCRATCH doubles */
} ut__dw_small_ctx;
/* two channels-last planes of floats and the dW accumulators, in doubles */
#define UT__DW_SMALL_SCRATCH \
  (UT__DW_SMALL_IN * UT__DW_SMALL_CB + UT__DW_SMALL_TAPS * UT__DW_SMALL_CB)
/* plane-major [cb][hw] (row stride hw) <-> channels-last [hw][cb] */
UT__CPU_INL void ut__dw_small_to_last(const float* restrict src, ut__i64 hw, int cb,
                                      float* restrict dst) {
  for (int ch = 0; ch < cb; ch++)
    for (ut__i64 i = 0; i < hw; i++) dst[i * cb + ch] = src[ch * hw + i];
}
UT__CPU_INL void ut__dw_small_from_last(const float* restrict src, ut__i64 hw, int cb,
                                        float* restrict dst) {
  for (int ch = 0; ch < cb; ch++)
    for (ut__i64 i = 0; i < hw; i++) dst[ch * hw + i] = src[i * cb + ch];
}
/* (UT__CPU_ACT_OPT: built for AVX-512 and AVX2 too, without contraction, so the same bits on
   every ISA; as the baseline's 4-lane SSE2 the dW of 3x3 over 8x8 -> 4x4 ran 15-20% slower) */
UT__CPU_ACT_OPT static void ut__dw_small_part(void* vc, int tid, int nt) {
  const ut__dw_small_ctx* cx = (const ut__dw_small_ctx*)vc;
  const ut__conv_geom* g = cx->g;
  const int* tri = cx->tri;
  int c = g->c, ntri = cx->ntri;
  ut__i64 hw = (ut__i64)g->h * g->w, ohw = (ut__i64)g->ho * g->wo;
  double* acc = cx->scratch + (size_t)tid * UT__DW_SMALL_SCRATCH;
  float* in = (float*)(void*)(acc + UT__DW_SMALL_TAPS * UT__DW_SMALL_CB);
  float* out = in + UT__DW_SMALL_IN * UT__DW_SMALL_CB;
  ut__i64 lo, hi;
  ut__cpu_part(cx->tasks, tid, nt, &lo, &hi);
  for (ut__i64 t = lo; t < hi; t++) {
    int cbi = (int)(t % cx->cblocks), c0 = cbi * UT__DW_SMALL_CB;
    int cb = UT__CPU_MIN(UT__DW_SMALL_CB, c - c0);
    if (cx->dir == UT__CONV_DW) { /* task: a channel block, every image in order */
      int taps = g->kh * g->kw;
      for (ut__i64 i = 0; i < (ut__i64)taps * cb; i++) acc[i] = 0.0;
      for (int n = 0; n < g->n; n++) {
        ut__dw_small_to_last(cx->src + ((ut__i64)n * c + c0) * hw, hw, cb, in);
        ut__dw_small_to_last(cx->go + ((ut__i64)n * c + c0) * ohw, ohw, cb, out);
        for (int e = 0; e < ntri; e++) {
          const float* restrict gr = out + (ut__i64)tri[3 * e] * cb;
          const float* restrict xr = in + (ut__i64)tri[3 * e + 2] * cb;
          double* restrict ar = acc + (ut__i64)tri[3 * e + 1] * cb;
          for (int ch = 0; ch < cb; ch++) ar[ch] += (double)gr[ch] * xr[ch];
        }
      }
      for (int ch = 0; ch < cb; ch++)
        for (int tp = 0; tp < taps; tp++)
          cx->dst[(ut__i64)(c0 + ch) * taps + tp] += (float)acc[(ut__i64)tp * cb + ch];
      continue;
    }
    /* forward (output from input) or dx (input from output): task = image x channel block */
    int n = (int)(t / cx->cblocks);
    bool fwd = cx->dir == UT__CONV_Y;
    ut__i64 src_hw = fwd ? hw : ohw, dst_hw = fwd ? ohw : hw;
    ut__dw_small_to_last(cx->src + ((ut__i64)n * c + c0) * src_hw, src_hw, cb, in);
    for (ut__i64 i = 0; i < dst_hw; i++)
      for (int ch = 0; ch < cb; ch++)
        out[i * cb + ch] = fwd && cx->bias ? cx->bias[c0 + ch] : 0.0f;
    int to = fwd ? 0 : 2, from = fwd ? 2 : 0;
    for (int e = 0; e < ntri; e++) {
      float* restrict orow = out + (ut__i64)tri[3 * e + to] * cb;
      const float* restrict irow = in + (ut__i64)tri[3 * e + from] * cb;
      const float* restrict wr = cx->wtt + (ut__i64)tri[3 * e + 1] * c + c0;
      for (int ch = 0; ch < cb; ch++) orow[ch] += wr[ch] * irow[ch];
    }
    ut__dw_small_from_last(out, dst_hw, cb, cx->dst + ((ut__i64)n * c + c0) * dst_hw);
  }
}
/* dir's result over small planes: y = conv(x) + b, dx (dst overwritten), or dW += (dst). */
static int ut__cpu_dw_small_run(ut__conv_dir dir, const float* x, const float* go,
                                const float* wt, const float* bias, float* dst,
                                const ut__conv_geom* g) {
  int taps = g->kh * g->kw, c = g->c;
  if (g->n <= 0 || c <= 0 || g->ho <= 0 || g->wo <= 0) return UT_OK;
  int* tri = (int*)malloc((size_t)g->ho * g->wo * taps * 3 * sizeof(int));
  float* wtt = dir == UT__CONV_DW ? NULL : (float*)malloc((size_t)taps * c * sizeof(float));
  if (!tri || (dir != UT__CONV_DW && !wtt)) {
    free(tri);
    free(wtt);
    return ut__set_error(UT_ERR_MEMORY, "dw: out of memory");
  }
  int ntri = 0;
  for (int oy = 0; oy < g->ho; oy++)
    for (int ox = 0; ox < g->wo; ox++)
      for (int ky = 0; ky < g->kh; ky++)
        for (int kx = 0; kx < g->kw; kx++) {
          int iy = oy * g->stride - g->pad + ky * g->dil, ix = ox * g->stride - g->pad + kx * g->dil;
          if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w) continue;
          tri[3 * ntri] = oy * g->wo + ox;
          tri[3 * ntri + 1] = ky * g->kw + kx;
          tri[3 * ntri + 2] = iy * g->w + ix;
          ntri++;
        }
  /* 16 channels at a time: each write a line of its own, channel by channel, cost a 7x7
     forward over 4x4 planes (512 channels, batch 8) about a third of its time */
  for (int c0 = 0; wtt && c0 < c; c0 += 16)
    for (int tp = 0; tp < taps; tp++)
      for (int ch = c0; ch < UT__CPU_MIN(c0 + 16, c); ch++)
        wtt[(ut__i64)tp * c + ch] = wt[(ut__i64)ch * taps + tp];
  ut__i64 cblocks = (c + UT__DW_SMALL_CB - 1) / UT__DW_SMALL_CB;
  ut__i64 tasks = dir == UT__CONV_DW ? cblocks : cblocks * g->n;
  int nt = ut__cpu_nt((double)ntri * g->n * c);
  if (nt > tasks) nt = (int)tasks;
  double* scratch = (double*)malloc((size_t)nt * UT__DW_SMALL_SCRATCH * sizeof(double));
  if (!scratch) {
    free(tri);
    free(wtt);
    return ut__set_error(UT_ERR_MEMORY, "dw: out of memory");
  }
  ut__dw_small_ctx cx = {g, dir, dir == UT__CONV_DX ? go : x, go, wtt, bias, dst,
                         tri, ntri, tasks, cblocks, scratch};
  ut__parallel_run(nt, ut__dw_small_part, &cx);
  free(scratch);
  free(tri);
  free(wtt);
  return UT_OK;
}

static int ut__cpu_dw_fwd_act_f32(const float* x, const float* wt, const float* bias, float* y,
                                  const ut__conv_geom* g, int act);
static int ut__cpu_dw_fwd_f32(const float* x, const float* wt, const float* bias, float* y,
                              const ut__conv_geom* g) {
  return ut__cpu_dw_fwd_act_f32(x, wt, bias, y, g, UT_ACT_NONE);
}
/* The paths other than the planes' engines apply act in a pass of its own (inference only). */
static int ut__cpu_dw_act_after(int st, float* y, const ut__conv_geom* g, int act) {
  if (st >= 0 && act != UT_ACT_NONE)
    ut__cpu_epi_pass(y, (ut__i64)g->n * g->c * g->ho * g->wo, act);
  return st;
}
/* The planes engines' context for a forward over g (the separable block's bands then
   narrow it to a tile). */
static void ut__cpu_dw_forward_ctx(ut__dwctx* C, const float* x, const float* wt,
                                   const float* bias, float* y, const ut__conv_geom* g, int act) {
  memset(C, 0, sizeof *C);
  C->x = x;
  C->wt = wt;
  C->bias = bias;
  C->y = y;
  C->c = g->c;
  C->h = g->h;
  C->w = g->w;
  C->kh = g->kh;
  C->kw = g->kw;
  C->s = g->stride;
  C->py = C->px = g->pad;
  C->dil = g->dil;
  C->ho = g->ho;
  C->wo = g->wo;
  C->planes = (ut__i64)g->n * g->c;
  C->act = act;
}
static int ut__cpu_dw_fwd_act_f32(const float* x, const float* wt, const float* bias, float* y,
                                  const ut__conv_geom* g, int act) {
  if (ut__cpu_dw_small(g))
    return ut__cpu_dw_act_after(ut__cpu_dw_small_run(UT__CONV_Y, x, NULL, wt, bias, y, g), y, g,
                                act);
  if (g->dil > 1 && !ut__cpu_dw_dil_native(g))
    return ut__cpu_dw_act_after(ut__cpu_dw_dilated(UT__CONV_Y, x, NULL, wt, bias, y, g), y, g,
                                act);
  ut__conv_geom g1;
  /* (not at stride 2: the phase-plane engine is as fast over 14^2 planes, faster over larger) */
  if (g->stride != 2 && ut__cpu_dw_via_stride1(g, &g1)) {
    ut__i64 planes = (ut__i64)g->n * g->c, hw = (ut__i64)g->h * g->w;
    float* full = (float*)malloc((size_t)(planes * hw) * sizeof(float) + 1);
    if (!full) return ut__set_error(UT_ERR_MEMORY, "dw_fwd: out of memory");
    int st = ut__cpu_dw_fwd_f32(x, wt, bias, full, &g1);
    int s = g->stride;
    for (ut__i64 q = 0; st >= 0 && q < planes; q++)
      for (int oy = 0; oy < g->ho; oy++)
        for (int ox = 0; ox < g->wo; ox++)
          y[(q * g->ho + oy) * g->wo + ox] = full[q * hw + (ut__i64)oy * s * g->w + (ut__i64)ox * s];
    free(full);
    return ut__cpu_dw_act_after(st, y, g, act);
  }
  if (!ut__cpu_all_finite(wt, (ut__i64)g->c * g->kh * g->kw)) {
    ut__cpu_conv_real_input(UT__CONV_Y, x, NULL, wt, bias, y, g->c, true, g);
    return ut__cpu_dw_act_after(UT_OK, y, g, act);
  }
  ut__dwctx C;
  ut__cpu_dw_forward_ctx(&C, x, wt, bias, y, g, act);
  if (C.planes <= 0 || C.ho <= 0 || C.wo <= 0) return UT_OK;
  return ut__cpu_dw_planes(&C, false, (double)C.planes * C.ho * C.wo * g->kh * g->kw / 4,
                           "dw_fwd");
}

/* Stride 1: dx is the correlation of go with the filter turned by 180 degrees and padding
   k-1-p (negative when p > k-1, which the row engine handles). Larger strides gather per
   column phase (ut__dwdx_range_body). */
static int ut__cpu_dw_bwd_dx_f32(const float* go, const float* wt, float* dx,
                                 const ut__conv_geom* g) {
  if (ut__cpu_dw_small(g)) return ut__cpu_dw_small_run(UT__CONV_DX, NULL, go, wt, NULL, dx, g);
  if (g->dil > 1 && !(g->stride == 1 && ut__cpu_dw_dil_native(g)))
    return ut__cpu_dw_dilated(UT__CONV_DX, NULL, go, wt, NULL, dx, g);
  ut__conv_geom g1;
  if (ut__cpu_dw_via_stride1(g, &g1) && ut__cpu_all_finite(wt, (ut__i64)g->c * g->kh * g->kw)) {
    float* up = ut__cpu_dw_spread(go, g);
    if (!up) return ut__set_error(UT_ERR_MEMORY, "dw_bwd_dx: out of memory");
    int st = ut__cpu_dw_bwd_dx_f32(up, wt, dx, &g1);
    free(up);
    return st;
  }
  int c = g->c, kh = g->kh, kw = g->kw, s = g->stride, p = g->pad;
  ut__i64 planes = (ut__i64)g->n * c, taps = (ut__i64)kh * kw;
  if (planes <= 0 || g->h <= 0 || g->w <= 0) return UT_OK;
  if (!ut__cpu_all_finite(wt, c * taps)) { /* the engines multiply go's padding zeros by w */
    ut__cpu_conv_real_input(UT__CONV_DX, NULL, go, wt, NULL, dx, c, true, g);
    return UT_OK;
  }
  double work = (double)planes * g->h * g->w * taps / 4;
  ut__dwctx C;
  memset(&C, 0, sizeof C);
  C.x = go;
  C.y = dx;
  C.c = c;
  C.kh = kh;
  C.kw = kw;
  C.s = s;
  C.planes = planes;
  if (s == 1) {
    float* rot = (float*)malloc((size_t)(c * taps) * sizeof(float) + 1);
    if (!rot) return ut__set_error(UT_ERR_MEMORY, "dw_bwd_dx: out of memory");
    for (ut__i64 ch = 0; ch < c; ch++)
      for (ut__i64 t = 0; t < taps; t++) rot[ch * taps + t] = wt[ch * taps + (taps - 1 - t)];
    C.wt = rot;
    C.h = g->ho;
    C.w = g->wo;
    C.ho = g->h;
    C.wo = g->w;
    C.py = (kh - 1) * g->dil - p;
    C.px = (kw - 1) * g->dil - p;
    C.dil = g->dil;
    int st = ut__cpu_dw_planes(&C, false, work, "dw_bwd_dx");
    free(rot);
    return st;
  }
  C.wt = wt;
  C.h = g->h;
  C.w = g->w;
  C.ho = g->ho;
  C.wo = g->wo;
  C.py = C.px = p;
  return ut__cpu_dw_planes(&C, true, work, "dw_bwd_dx");
}

/* One tap of dW summed over the (output, tap) pairs whose input lies inside x, as PyTorch's CPU
   kernels do: the vector engines multiply padding zeros with go (and go's padding lanes with
   x), which turns a NaN or inf there into NaN taps that PyTorch leaves finite. Run for the taps
   whose fast sum is not finite: any non-finite input reaches every fast sum it takes part in
   (padding products included), so a finite fast sum met none and is already exact. */
static double ut__cpu_dw_bwd_dw_exact(const float* go, const float* x, int ch, ut__i64 t,
                                      const ut__conv_geom* g) {
  int s = g->stride, p = g->pad, ky = (int)(t / g->kw), kx = (int)(t % g->kw);
  double acc = 0.0;
  for (int n = 0; n < g->n; n++) {
    ut__i64 q = (ut__i64)n * g->c + ch;
    const float* xp = x + q * g->h * g->w;
    const float* gp = go + q * g->ho * g->wo;
    for (int oy = 0; oy < g->ho; oy++) {
      ut__i64 iy = (ut__i64)oy * s - p + (ut__i64)ky * g->dil;
      if (iy < 0 || iy >= g->h) continue;
      for (int ox = 0; ox < g->wo; ox++) {
        ut__i64 ix = (ut__i64)ox * s - p + (ut__i64)kx * g->dil;
        if (ix >= 0 && ix < g->w) acc += (double)gp[(ut__i64)oy * g->wo + ox] * xp[iy * g->w + ix];
      }
    }
  }
  return acc;
}

typedef struct {
  const ut__dwctx* Cp;
  ut__cpu_dwdw_fn fn;
  float* bufs;
  ut__i64 per;
  float* dw;
  int V;
  const float* ex_go;        /* the exact fallback's grad_out and geometry: the caller's, also */
  const ut__conv_geom* ex_g; /* when the engines run on grad_out spread to stride 1 */
} ut__cpu_dw_bwd_dw_ctx;
static void ut__cpu_dw_bwd_dw_part(void* vc, int tid, int nt) {
  const ut__cpu_dw_bwd_dw_ctx* cx = (const ut__cpu_dw_bwd_dw_ctx*)vc;
  const ut__dwctx* Cp = cx->Cp;
  ut__cpu_dwdw_fn fn = cx->fn;
  float* bufs = cx->bufs;
  float* dw = cx->dw;
  ut__i64 per = cx->per, taps = (ut__i64)Cp->kh * Cp->kw;
  int V = cx->V;
  ut__i64 lo, hi;
  ut__cpu_part(Cp->c, tid, nt, &lo, &hi);
  for (int ch = (int)lo; ch < hi; ch++) {
    float* buf = bufs + (ut__i64)tid * per;
    double* dacc = (double*)(void*)(buf + per - UT__DW_R16(taps * V * 2));
    for (ut__i64 i = 0; i < taps * V; i++) dacc[i] = 0.0;
    fn(Cp, ch, dacc, buf);
    for (ut__i64 t = 0; t < taps; t++) {
      double sum = 0.0;
      for (int l = 0; l < V; l++) sum += dacc[t * V + l];
      if (!isfinite(sum)) sum = ut__cpu_dw_bwd_dw_exact(cx->ex_go, Cp->x, ch, t, cx->ex_g);
      dw[(ut__i64)ch * taps + t] += (float)sum;
    }
  }
}

static int ut__cpu_dw_bwd_dw_run(const float* go, const float* x, float* dw,
                                 const ut__conv_geom* g, const float* ex_go,
                                 const ut__conv_geom* ex_g);
static int ut__cpu_dw_bwd_dw_f32(const float* go, const float* x, float* dw,
                                 const ut__conv_geom* g) {
  if (ut__cpu_dw_small(g)) return ut__cpu_dw_small_run(UT__CONV_DW, x, go, NULL, NULL, dw, g);
  if (g->dil > 1 && !ut__cpu_dw_dil_native(g))
    return ut__cpu_dw_dilated(UT__CONV_DW, x, go, NULL, NULL, dw, g);
  ut__conv_geom g1;
  if (ut__cpu_dw_via_stride1(g, &g1)) {
    float* up = ut__cpu_dw_spread(go, g);
    if (!up) return ut__set_error(UT_ERR_MEMORY, "dw_bwd_dw: out of memory");
    int st = ut__cpu_dw_bwd_dw_run(up, x, dw, &g1, go, g);
    free(up);
    return st;
  }
  return ut__cpu_dw_bwd_dw_run(go, x, dw, g, go, g);
}

/* Parallel over channels; each channel loops over the batch in order (deterministic). */
static int ut__cpu_dw_bwd_dw_run(const float* go, const float* x, float* dw,
                                 const ut__conv_geom* g, const float* ex_go,
                                 const ut__conv_geom* ex_g) {
  const int V = ut__cpu_isa()->dw_lanes;
  int c = g->c;
  ut__i64 taps = (ut__i64)g->kh * g->kw;
  if (c <= 0 || g->n <= 0 || g->ho <= 0 || g->wo <= 0) return UT_OK;
  ut__dwctx C;
  memset(&C, 0, sizeof C);
  C.x = x;
  C.go = go;
  C.c = c;
  C.h = g->h;
  C.w = g->w;
  C.kh = g->kh;
  C.kw = g->kw;
  C.s = g->stride;
  C.py = C.px = g->pad;
  C.dil = g->dil;
  C.ho = g->ho;
  C.wo = g->wo;
  C.planes = (ut__i64)g->n * c;
  void* tab;
  ut__i64 per = ut__dw_setup(&C, &tab);
  if (per <= 0)
    return ut__set_error(UT_ERR_SHAPE,
                         "dw_bwd_dw: stride %d and output width %d need more scratch memory than "
                         "a depthwise convolution may use",
                         C.s, C.wo);
  per += UT__DW_R16(taps * V * 2); /* + the doubles */
  int nt = ut__cpu_nt((double)C.planes * g->ho * g->wo * taps / 4);
  if (nt > c) nt = c;
  void* raw;
  float* bufs = ut__cpu_dw_bufs(nt, per, &raw);
  if (!bufs) {
    free(tab);
    return ut__set_error(UT_ERR_MEMORY, "dw_bwd_dw: out of memory");
  }
  ut__cpu_dwdw_fn fn = ut__cpu_isa()->dw_dw;
  ut__cpu_dw_bwd_dw_ctx cx = {&C, fn, bufs, per, dw, V, ex_go, ex_g};
  ut__parallel_run(nt, ut__cpu_dw_bwd_dw_part, &cx);
  free(raw);
  free(tab);
  return UT_OK;
}

/* ---- GEMM ---------------------------------------------------------------------------------
   Goto-style: op(B) is packed in KC x NR micro-panels, op(A) in MR x KC micro-panels (zero
   padded at the edges); a register-blocked MR x NR micro-kernel computes each tile of C. The
   work is split into tasks (batch item, block of rows, block of columns), each of which runs
   the whole K loop, so every element of C is summed in the same order whatever the thread
   count. sum_batch runs the batch as a continuation of K. */
#define UT__CPU_KC 256
#define UT__CPU_MC 192
#define UT__CPU_NC 1024

/* op(A)[i0 .. i0+mc, k0 .. k0+kc] -> MR-row micro-panels, k-major inside each. */
UT__CPU_OPT static void ut__cpu_pack_a(const float* a, int lda, bool ta, int i0, int mc, int k0,
                                       int kc, int MR, float* restrict dst) {
  ut__cpu_pack8_fn pack8 = MR == 8 && !ta ? ut__cpu_isa()->pack_a8 : NULL;
  if (ta) {
    /* op(A) = A^T: row k of A holds column k of every panel. Read each row once, in order
       (mc contiguous floats), not MR floats per row, panel by panel: the weight of an input
       gradient (dX = W^T G) is cold in a network's backward, and MR-float reads a row apart
       defeated the prefetcher (ConvNeXt's 3072 x 768 weight: a new page every read) */
    int panels = (mc + MR - 1) / MR;
    for (int k = 0; k < kc; k++) {
      const float* src = a + (ut__i64)(k0 + k) * lda + i0;
      if (k + 4 < kc) /* each row is a new page for a wide weight: the prefetcher starts late */
        for (int l = 0; l < mc; l += 16) UT__PREFETCH_R(src + 4 * (ut__i64)lda + l);
      for (int pnl = 0; pnl < panels; pnl++) {
        int rows = UT__CPU_MIN(MR, mc - pnl * MR);
        float* d = dst + (ut__i64)pnl * kc * MR + (ut__i64)k * MR;
        for (int r = 0; r < rows; r++) d[r] = src[pnl * MR + r];
        for (int r = rows; r < MR; r++) d[r] = 0.0f;
      }
    }
    return;
  }
  for (int ip = 0; ip < mc; ip += MR) {
    int rows = UT__CPU_MIN(MR, mc - ip);
    if (pack8 && rows == 8) {
      pack8(a + (ut__i64)(i0 + ip) * lda + k0, lda, kc, dst);
    } else if (!ta) {
      for (int r = 0; r < rows; r++) {
        const float* src = a + (ut__i64)(i0 + ip + r) * lda + k0;
        for (int k = 0; k < kc; k++) dst[k * MR + r] = src[k];
      }
      for (int r = rows; r < MR; r++)
        for (int k = 0; k < kc; k++) dst[k * MR + r] = 0.0f;
    } else {
      for (int k = 0; k < kc; k++) {
        const float* src = a + (ut__i64)(k0 + k) * lda + i0 + ip;
        float* d = dst + k * MR;
        for (int r = 0; r < rows; r++) d[r] = src[r];
        for (int r = rows; r < MR; r++) d[r] = 0.0f;
      }
    }
    dst += (ut__i64)kc * MR;
  }
}

/* op(B)[k0 .. k0+kc, j0 .. j0+nc] -> NR-column micro-panels, k-major inside each. */
UT__CPU_OPT static void ut__cpu_pack_b(const float* b, int ldb, bool tb, int k0, int kc, int j0,
                                       int nc, int NR, float* restrict dst) {
  for (int jp = 0; jp < nc; jp += NR) {
    int cols = UT__CPU_MIN(NR, nc - jp);
    if (!tb) {
      for (int k = 0; k < kc; k++) {
        const float* src = b + (ut__i64)(k0 + k) * ldb + j0 + jp;
        float* d = dst + k * NR;
        for (int j = 0; j < cols; j++) d[j] = src[j];
        for (int j = cols; j < NR; j++) d[j] = 0.0f;
      }
    } else {
      for (int j = 0; j < cols; j++) {
        const float* src = b + (ut__i64)(j0 + jp + j) * ldb + k0;
        for (int k = 0; k < kc; k++) dst[k * NR + j] = src[k];
      }
      for (int j = cols; j < NR; j++)
        for (int k = 0; k < kc; k++) dst[k * NR + j] = 0.0f;
    }
    dst += (ut__i64)kc * NR;
  }
}

/* len values from src (zeros when src is NULL) into packed columns jj.. of row k: the B panels
   of ut__cpu_pack_b, NR columns each, k-major inside. */
UT__CPU_INL void ut__cpu_pack_b_put(float* restrict dst, int kc, int NR, int k, int jj,
                                    const float* src, int len) {
  while (len > 0) {
    int lane = jj % NR, n = UT__CPU_MIN(NR - lane, len);
    float* d = dst + (ut__i64)(jj / NR) * kc * NR + (ut__i64)k * NR + lane;
    if (src) {
      for (int j = 0; j < n; j++) d[j] = src[j];
      src += n;
    } else {
      for (int j = 0; j < n; j++) d[j] = 0.0f;
    }
    jj += n;
    len -= n;
  }
}
/* ut__cpu_pack_b of the column matrix of one image x [c, h, w] under cg (ut__gemm_args.b_conv),
   made straight from x: the same panels, so the same products and the same result, without
   writing the matrix out and reading it back (a stem's 27 x 112^2 columns are 1.35 MB per
   image; its panels stay in L1). Row k of the matrix, columns j0.., is read row by row of
   output: zeros where the window leaves the input. This one gathers every value on its own:
   ut__cpu_pack_b_conv's fallback for geometries its phase rows do not fit. */
UT__CPU_OPT static void ut__cpu_pack_b_conv_gather(const float* x, const ut__conv_geom* cg,
                                                   int k0, int kc, int j0, int nc, int NR,
                                                   float* restrict dst) {
  int h = cg->h, w = cg->w, kh = cg->kh, kw = cg->kw, s = cg->stride, p = cg->pad, wo = cg->wo;
  float tmp[64];
  for (int k = 0; k < kc; k++) {
    int kg = k0 + k, taps = kh * kw;
    int ci = kg / taps, ky = kg % taps / kw, kx = kg % kw;
    const float* xp = x + (ut__i64)ci * h * w;
    int lo = ut__cpu_lo(kx, s, p, wo), hi = UT__CPU_MAX(ut__cpu_hi(kx, s, p, w, wo), lo);
    int off = kx - p, oy = j0 / wo, ox = j0 % wo;
    for (int jj = 0; jj < nc; oy++, ox = 0) {
      int run = UT__CPU_MIN(wo - ox, nc - jj), end = ox + run;
      int iy = oy * s - p + ky;
      if (iy < 0 || iy >= h) {
        ut__cpu_pack_b_put(dst, kc, NR, k, jj, NULL, run);
        jj += run;
        continue;
      }
      const float* xr = xp + (ut__i64)iy * w;
      int a = UT__CPU_MIN(UT__CPU_MAX(lo, ox), end), b = UT__CPU_MIN(UT__CPU_MAX(hi, a), end);
      ut__cpu_pack_b_put(dst, kc, NR, k, jj, NULL, a - ox);
      if (s == 1) {
        ut__cpu_pack_b_put(dst, kc, NR, k, jj + a - ox, xr + a + off, b - a);
      } else {
        for (int c0 = a; c0 < b; c0 += 64) {
          int n = UT__CPU_MIN(64, b - c0);
          for (int j = 0; j < n; j++) tmp[j] = xr[(c0 + j) * s + off];
          ut__cpu_pack_b_put(dst, kc, NR, k, jj + c0 - ox, tmp, n);
        }
      }
      ut__cpu_pack_b_put(dst, kc, NR, k, jj + b - ox, NULL, end - b);
      jj += run;
    }
    if (nc % NR) /* the last panel's padding columns */
      ut__cpu_pack_b_put(dst, kc, NR, k, nc, NULL, NR - nc % NR);
  }
}

/* The same panels from phase rows: the taps kx of a filter row (ci, ky) read one input row,
   tap kx at columns ox*s + kx - p, that is phase kx % s of the row at ox + kx / s, where phase b
   holds the row's columns b - p, s + b - p, ... (zero outside the input). Each input row is
   split into its phases once for all kw taps, and every tap is then a contiguous copy. The
   gather (a stride-2 load per value) was half of a 3 -> 32 stride-2 stem's time at 224^2, as
   long as its GEMM. */
#define UT__PACK_PHASE_COLS 256  /* output columns per phase fill */
#define UT__PACK_PHASE_FLOATS 4096
UT__CPU_OPT static void ut__cpu_pack_b_conv(const float* x, const ut__conv_geom* cg, int k0,
                                            int kc, int j0, int nc, int NR, float* restrict dst) {
  int h = cg->h, w = cg->w, kh = cg->kh, kw = cg->kw, s = cg->stride, p = cg->pad, wo = cg->wo;
  int np = UT__CPU_MIN(s, kw), ext = (kw - 1) / s + 1; /* phases read; columns past a chunk */
  int len = UT__PACK_PHASE_COLS + ext;                 /* one phase row */
  if ((long long)np * len > UT__PACK_PHASE_FLOATS || cg->dil > 1) {
    ut__cpu_pack_b_conv_gather(x, cg, k0, kc, j0, nc, NR, dst);
    return;
  }
  float ph[UT__PACK_PHASE_FLOATS];
  for (int fr = k0 / kw; fr * kw < k0 + kc; fr++) { /* filter rows (ci, ky) */
    int ci = fr / kh, ky = fr % kh;
    int xa = UT__CPU_MAX(k0 - fr * kw, 0), xb = UT__CPU_MIN(k0 + kc - fr * kw, kw);
    const float* xp = x + (ut__i64)ci * h * w;
    int oy = j0 / wo, ox = j0 % wo;
    for (int jj = 0; jj < nc; oy++, ox = 0) {
      int run = UT__CPU_MIN(wo - ox, nc - jj), iy = oy * s - p + ky;
      for (int c0 = 0; c0 < run; c0 += UT__PACK_PHASE_COLS) {
        int cols = UT__CPU_MIN(UT__PACK_PHASE_COLS, run - c0), q0 = ox + c0;
        if (iy < 0 || iy >= h) {
          for (int kx = xa; kx < xb; kx++)
            ut__cpu_pack_b_put(dst, kc, NR, fr * kw + kx - k0, jj + c0, NULL, cols);
          continue;
        }
        const float* xr = xp + (ut__i64)iy * w;
        /* ph[b * len + i] = xr[(q0 + i) * s + b - p] for i < cols + ext - 1 */
        int fill = cols + ext - 1;
        for (int b = 0; b < np; b++) {
          float* d = ph + (ut__i64)b * len;
          int lo = ut__cpu_lo(b, s, p - q0 * s, fill);
          int hi = UT__CPU_MAX(ut__cpu_hi(b, s, p - q0 * s, w, fill), lo);
          const float* src = xr + (ut__i64)q0 * s + b - p;
          for (int i = 0; i < lo; i++) d[i] = 0.0f;
          if (s == 1)
            memcpy(d + lo, src + lo, (size_t)(hi - lo) * sizeof(float));
          else if (s == 2)
            for (int i = lo; i < hi; i++) d[i] = src[2 * i];
          else
            for (int i = lo; i < hi; i++) d[i] = src[(ut__i64)i * s];
          for (int i = hi; i < fill; i++) d[i] = 0.0f;
        }
        for (int kx = xa; kx < xb; kx++)
          ut__cpu_pack_b_put(dst, kc, NR, fr * kw + kx - k0, jj + c0,
                             ph + (ut__i64)(kx % s) * len + kx / s, cols);
      }
      jj += run;
    }
  }
  if (nc % NR) /* the last panel's padding columns */
    for (int k = 0; k < kc; k++) ut__cpu_pack_b_put(dst, kc, NR, k, nc, NULL, NR - nc % NR);
}

/* Whether the micro-kernel computes a last panel of nr columns on its narrow path (AVX-512's
   8 x 32 tiles; ut__gemm_micro_narrow): 1 to 4 columns, alone or past a vector of 16. It
   needs A packed (a step's MR values together). */
static inline bool ut__gemm_narrow(int nr, int MR, int NR) {
  return MR == 8 && NR == 32 && ((nr > 0 && nr <= 4) || (nr > 16 && nr <= 20));
}

/* One block of C (rows i0.., columns j0..) summed over batch items [b0, b1), into c0 (row
   stride ldc; beta applies to the first item only). Its rows go in blocks of MC (A's packed
   panels, sized for L2) under each k block's packed B, which is packed once for all of them:
   packed per block of MC rows, B was 7% of MobileNetV2's batch-8 forward, packed up to 7 times
   (a 160 -> 960 expand over merged 7x7 planes).
   A packed panel pays for itself when the kernel reads it many times: A's MR-row panels are read
   once per NR-column panel of the block, B's once per row panel. When the block is at most two
   panels across (a short side: pointwise convs over small images, Linear layers), the full
   panels are read in place instead (the same products in the same order, so the same result);
   the edge panels are still packed, their padding rows and columns being zeros. */
static void ut__cpu_gemm_task(const ut__gemm_args* g, ut__cpu_gemm_kern kern, int MR, int NR,
                              int MC, bool epi_kern, int b0, int b1, float* c0, int ldc,
                              float beta0, int i0, int mt, int j0, int nc, float* abuf,
                              float* bbuf) {
  bool first = true;
  int b_full = mt <= 2 * MR && !g->trans_b && !g->b_conv ? nc / NR * NR : 0; /* B in place */
  ut__i64 a_rs = g->trans_a ? 1 : g->lda, a_ks = g->trans_a ? g->lda : 1;
  for (int bb = b0; bb < b1; bb++) {
    const float* a = (const float*)g->a + (ut__i64)bb * g->stride_a;
    const float* b = (const float*)g->b + (ut__i64)bb * g->stride_b;
    for (int k0 = 0; k0 < g->k; k0 += UT__CPU_KC) {
      int kc = UT__CPU_MIN(UT__CPU_KC, g->k - k0);
      if (g->b_conv)
        ut__cpu_pack_b_conv(b, g->b_conv, k0, kc, j0, nc, NR, bbuf);
      else if (b_full < nc)
        ut__cpu_pack_b(b, g->ldb, g->trans_b, k0, kc, j0 + b_full, nc - b_full, NR, bbuf);
      float beta = first ? beta0 : 1.0f;
      first = false;
      bool epi_now = g->row_scale && bb == b1 - 1 && k0 + kc >= g->k;
      /* ReLU-family epilogues in the micro-kernel's registers (the same operations in the
         same order as ut__cpu_epi_rows, so the same bits); other activations after it */
      bool epi_in_kern = epi_now && epi_kern &&
                         (g->act == UT_ACT_NONE || g->act == UT_ACT_RELU || g->act == UT_ACT_RELU6);
      for (int r0 = 0; r0 < mt; r0 += MC) { /* a block of rows: i0 + r0.. */
        int mc = UT__CPU_MIN(MC, mt - r0), ir = i0 + r0;
        float* c = c0 + (ut__i64)ir * ldc + j0;
        /* A's rows in place; packed where the last panel takes the narrow path */
        int a_full = nc <= 2 * NR && !g->trans_a && !ut__gemm_narrow(nc % NR, MR, NR)
                         ? mc / MR * MR
                         : 0;
        const float* apk = abuf; /* A's packed panels for these rows */
        if (g->a_packed) {
          a_full = 0;
          apk = g->a_packed + (ut__i64)k0 * ((g->m + MR - 1) / MR * MR) + (ut__i64)ir * kc;
        } else if (a_full < mc) {
          ut__cpu_pack_a(a, g->lda, g->trans_a, ir + a_full, mc - a_full, k0, kc, MR, abuf);
        }
        for (int jp = 0; jp < nc; jp += NR) {
          const float* bp = jp < b_full ? b + (ut__i64)k0 * g->ldb + j0 + jp
                                        : bbuf + (ut__i64)((jp - b_full) / NR) * kc * NR;
          ut__i64 b_ks = jp < b_full ? g->ldb : NR;
          for (int ip = 0; ip < mc; ip += MR) {
            /* the next tile's C rows, a tile ahead: a short K loop (a weight gradient over
               small planes, k = 32) is over before a line of C comes from memory */
            if (ip + MR < mc)
              for (int r = 0; r < UT__CPU_MIN(MR, mc - ip - MR); r++) {
                float* cn = c + (ut__i64)(ip + MR + r) * ldc + jp;
                UT__PREFETCH_W(cn);
                UT__PREFETCH_W(cn + UT__CPU_MIN(NR, nc - jp) - 1);
              }
            const float* ap;
            if (ip < a_full)
              ap = a + (ut__i64)(ir + ip) * a_rs + (ut__i64)k0 * a_ks;
            else
              ap = apk + (ut__i64)((ip - a_full) / MR) * kc * MR;
            kern(kc, ap, ip < a_full ? a_rs : 1, ip < a_full ? a_ks : MR, bp, b_ks,
                 c + (ut__i64)ip * ldc + jp, ldc, UT__CPU_MIN(MR, mc - ip),
                 UT__CPU_MIN(NR, nc - jp), g->alpha, beta,
                 epi_in_kern ? g->row_scale + ir + ip : NULL,
                 epi_in_kern ? g->row_shift + ir + ip : NULL, g->act);
            if (epi_now && !epi_in_kern) /* a final tile: the epilogue while it is in cache */
              ut__cpu_epi_rows(c + (ut__i64)ip * ldc + jp, ldc, UT__CPU_MIN(MR, mc - ip),
                               UT__CPU_MIN(NR, nc - jp), g->row_scale + ir + ip,
                               g->row_shift + ir + ip, g->act);
          }
        }
      }
    }
  }
}

/* C = beta * C over an m x n block (beta 0: C is not read). */
static void ut__cpu_gemm_scale_c(float* c, int ldc, int m, int n, float beta) {
  for (int i = 0; i < m; i++) {
    float* cr = c + (ut__i64)i * ldc;
    for (int j = 0; j < n; j++) cr[j] = beta != 0.0f ? beta * cr[j] : 0.0f;
  }
}

#define UT__CPU_GEMM_CHUNKS 8           /* batch chunks of a sum_batch GEMM */
#define UT__CPU_GEMM_PART_MAX (1 << 24) /* floats of partial C for them, at most */

/* Row i of C = beta C + the partials summed in chunk order. */
UT__CPU_OPT static void ut__cpu_gemm_sum_parts(const ut__gemm_args* g, const float* part,
                                               size_t pstride, int nck, int i) {
  int n = g->n;
  float* restrict cr = (float*)g->c + (ut__i64)i * g->ldc;
  const float* restrict p0 = part + (ut__i64)i * n;
  if (g->beta != 0.0f) {
    for (int j = 0; j < n; j++) cr[j] = g->beta * cr[j] + p0[j];
  } else {
    for (int j = 0; j < n; j++) cr[j] = p0[j];
  }
  for (int q = 1; q < nck; q++) {
    const float* restrict pq = part + (size_t)q * pstride + (ut__i64)i * n;
    for (int j = 0; j < n; j++) cr[j] += pq[j];
  }
}

/* The second phase of a chunked sum_batch: C = ((beta C + p0) + p1) + ..., each row by one
   thread (after every chunk's partial is complete). */
typedef struct {
  const ut__gemm_args* g;
  const float* part;
  size_t pstride;
  int nck;
} ut__cpu_gemm_sum_ctx;
static void ut__cpu_gemm_sum_part(void* vc, int tid, int nt) {
  const ut__cpu_gemm_sum_ctx* c = (const ut__cpu_gemm_sum_ctx*)vc;
  ut__i64 lo, hi;
  ut__cpu_part(c->g->m, tid, nt, &lo, &hi);
  for (int i = (int)lo; i < hi; i++) ut__cpu_gemm_sum_parts(c->g, c->part, c->pstride, c->nck, i);
}

#define UT__CPU_DOT_MC 64
#define UT__CPU_DOT_NC 64
#define UT__CPU_DOT_KC 512 /* a multiple of every VL */
#define UT__CPU_DOT_TASKS 16 /* tasks (blocks x batch chunks) a dot-engine GEMM aims for */

typedef struct {
  const ut__gemm_args* g;
  ut__cpu_dot_kern kern;
  int VL, RM, RN, nck, per, MC, NC;
  ut__i64 ib, jb, tasks;
  float* base;
  float* part;
  size_t accsz, pstride;
  atomic_llong next; /* the dynamic schedule's next task */
} ut__cpu_gemm_dot_ctx;
static void ut__cpu_gemm_dot_part(void* vc, int tid, int nt) {
  ut__cpu_gemm_dot_ctx* cx = (ut__cpu_gemm_dot_ctx*)vc;
  const ut__gemm_args* g = cx->g;
  int m = g->m, n = g->n, k = g->k;
  ut__cpu_dot_kern kern = cx->kern;
  int VL = cx->VL, RM = cx->RM, RN = cx->RN, nck = cx->nck, per = cx->per, MC = cx->MC,
      NC = cx->NC;
  ut__i64 ib = cx->ib, jb = cx->jb, tasks = cx->tasks;
  float* part = cx->part;
  size_t pstride = cx->pstride;
  (void)nt;
  {
    float* acc = cx->base + (size_t)tid * cx->accsz;
    for (ut__i64 t = ut__cpu_next_task(&cx->next); t < tasks; t = ut__cpu_next_task(&cx->next)) {
      ut__i64 jj = t % jb, rest = t / jb;
      int ii = (int)(rest % ib), ci = (int)(rest / ib);
      int i0 = ii * MC, j0 = (int)jj * NC;
      int mc = UT__CPU_MIN(MC, m - i0), nc = UT__CPU_MIN(NC, n - j0);
      int b0 = ci * per, b1 = UT__CPU_MIN(g->batch, b0 + per);
      int ntj = (nc + RN - 1) / RN;
      memset(acc, 0, (size_t)((mc + RM - 1) / RM) * ntj * RM * RN * VL * sizeof(float));
      for (int bb = b0; bb < b1; bb++) {
        const float* a = (const float*)g->a + (ut__i64)bb * g->stride_a + (ut__i64)i0 * g->lda;
        const float* b = (const float*)g->b + (ut__i64)bb * g->stride_b + (ut__i64)j0 * g->ldb;
        for (int k0 = 0; k0 < k; k0 += UT__CPU_DOT_KC)
          kern(a + k0, g->lda, b + k0, g->ldb, mc, nc, UT__CPU_MIN(UT__CPU_DOT_KC, k - k0), acc);
      }
      float* c;
      int ldc;
      float beta;
      if (nck > 1) {
        c = part + (size_t)ci * pstride;
        ldc = n;
        beta = 0.0f;
      } else {
        c = (float*)g->c;
        ldc = g->ldc;
        beta = g->beta;
      }
      for (int r = 0; r < mc; r++) {
        float* cr = c + (ut__i64)(i0 + r) * ldc + j0;
        for (int q = 0; q < nc; q++) {
          const float* lanes =
              acc + (((size_t)(r / RM) * ntj + q / RN) * RM * RN + (r % RM) * RN + q % RN) * VL;
          float sum = 0.0f;
          for (int l = 0; l < VL; l++) sum += lanes[l];
          float v = g->alpha * sum;
          cr[q] = beta != 0.0f ? v + beta * cr[q] : v;
        }
      }
    }
  }
}

/* sum_batch (or one batch item) with A [m, k] and B^T [n, k] (both k-contiguous): blocks of C
   summed per batch chunk (chunks as in ut__cpu_gemm_f32) with the dot-product engine, no
   packing. */
static int ut__cpu_gemm_dot(const ut__gemm_args* g) {
  int m = g->m, n = g->n, k = g->k;
  const ut__cpu_isa_kernels* isa = ut__cpu_isa();
  ut__cpu_dot_kern kern = isa->dot;
  int VL = isa->dot_vl, RM = isa->dot_rm, RN = isa->dot_rn;
  int MC = UT__CPU_DOT_MC, NC = UT__CPU_DOT_NC;
  ut__i64 ib = (m + MC - 1) / MC, jb = (n + NC - 1) / NC;
  /* batch chunks only as many as the blocks of C need to make UT__CPU_DOT_TASKS tasks: each
     chunk's lanes are reduced and its partial C summed, which cost more than the products
     when a chunk is one image (ConvNeXt's stage-1 weight gradients, k = 256) */
  ut__i64 want = (UT__CPU_DOT_TASKS + ib * jb - 1) / (ib * jb);
  int nck = (int)UT__CPU_MIN((ut__i64)UT__CPU_MIN(g->batch, UT__CPU_GEMM_CHUNKS), want);
  while (nck > 1 && (double)nck * m * n > (double)UT__CPU_GEMM_PART_MAX) nck--;
  int per = (g->batch + nck - 1) / nck;
  nck = (g->batch + per - 1) / per;
  ut__i64 tasks = (ut__i64)nck * ib * jb;
  int nt = ut__cpu_nt((double)m * n * k * g->batch / 2);
  if (tasks < nt) nt = (int)tasks;
  int ntj_max = (NC + RN - 1) / RN;
  size_t accn = (size_t)((MC + RM - 1) / RM) * ntj_max * RM * RN * VL;
  size_t accsz = (accn + 15) & ~(size_t)15;
  size_t pstride = ((size_t)m * n + 15) & ~(size_t)15, psz = nck > 1 ? pstride * nck : 0;
  void* raw = malloc((accsz * (size_t)nt + psz) * sizeof(float) + 64);
  if (!raw) return ut__set_error(UT_ERR_MEMORY, "gemm: out of memory");
  float* base = ut__cpu_align64(raw);
  float* part = base + accsz * (size_t)nt;
  ut__cpu_gemm_dot_ctx cx = {g, kern, VL, RM, RN, nck, per, MC, NC, ib, jb, tasks,
                             base, part, accsz, pstride, 0};
  ut__parallel_run(nt, ut__cpu_gemm_dot_part, &cx);
  if (nck > 1) {
    ut__cpu_gemm_sum_ctx sc = {g, part, pstride, nck};
    ut__parallel_run(nt, ut__cpu_gemm_sum_part, &sc);
  }
  free(raw);
  return UT_OK;
}

typedef struct {
  const ut__gemm_args* g;
  ut__cpu_gemm_kern kern;
  bool epi_kern;
  int MR, NR, MC, MT, NC, nck, per;
  ut__i64 ib, jb, tasks;
  float* base;
  float* part;
  size_t asz, bsz, pstride;
  atomic_llong next; /* the dynamic schedule's next task */
} ut__cpu_gemm_ctx;
static void ut__cpu_gemm_part(void* vc, int tid, int nt) {
  ut__cpu_gemm_ctx* cx = (ut__cpu_gemm_ctx*)vc;
  const ut__gemm_args* g = cx->g;
  int m = g->m, n = g->n;
  ut__cpu_gemm_kern kern = cx->kern;
  int MR = cx->MR, NR = cx->NR, MC = cx->MC, MT = cx->MT, NC = cx->NC, nck = cx->nck;
  int per = cx->per;
  ut__i64 ib = cx->ib, jb = cx->jb, tasks = cx->tasks;
  float* part = cx->part;
  size_t asz = cx->asz, bsz = cx->bsz, pstride = cx->pstride;
  (void)nt;
  {
    float* abuf = cx->base + (size_t)tid * (asz + bsz);
    float* bbuf = abuf + asz;
    for (ut__i64 t = ut__cpu_next_task(&cx->next); t < tasks; t = ut__cpu_next_task(&cx->next)) {
      ut__i64 jj = t % jb, rest = t / jb;
      ut__i64 ii = rest % ib, bi = rest / ib;
      int i0 = (int)ii * MT, j0 = (int)jj * NC;
      int b0, b1, ldc = g->ldc;
      float* c;
      float beta = g->beta;
      if (nck > 1) {
        b0 = (int)bi * per;
        b1 = UT__CPU_MIN(g->batch, b0 + per);
        c = part + (size_t)bi * pstride;
        ldc = n;
        beta = 0.0f;
      } else if (g->sum_batch) {
        b0 = 0;
        b1 = g->batch;
        c = (float*)g->c;
      } else {
        b0 = (int)bi;
        b1 = b0 + 1;
        c = (float*)g->c + (ut__i64)bi * g->stride_c;
      }
      ut__cpu_gemm_task(g, kern, MR, NR, MC, cx->epi_kern, b0, b1, c, ldc, beta, i0,
                        UT__CPU_MIN(MT, m - i0), j0, UT__CPU_MIN(NC, n - j0), abuf, bbuf);
    }
  }
}

/* A's panels as ut__cpu_pack_a lays them out for every row and k block (block k0 at
   k0 * m rounded up to MR, rows i.. of it at i * kc), kept on g->a_owner and shared by the
   calls that find its values unchanged; NULL (pack per call) when the owner's writes are not
   all seen (ut_track_writes, an open view), or when memory is short. The caller releases it. */
static ut__packed* ut__cpu_packed_a(const ut__gemm_args* g, int MR) {
  ut_tensor* t = g->a_owner;
  if (!t || g->trans_a || g->sum_batch || (g->batch > 1 && g->stride_a != 0) ||
      g->a != (const void*)t->data || t->dev != UT_CPU || t->dtype != UT_F32 || t->borrowed ||
      !__atomic_load_n(&t->tracked, __ATOMIC_ACQUIRE) || g->lda < g->k ||
      (ut__i64)(g->m - 1) * g->lda + g->k > t->shape.nelem)
    return NULL;
  unsigned vc = __atomic_load_n(&t->view_closes, __ATOMIC_ACQUIRE);
  if (__atomic_load_n(&t->views, __ATOMIC_ACQUIRE) > 0) return NULL;
  unsigned v = __atomic_load_n(&t->version, __ATOMIC_ACQUIRE);
  pthread_mutex_lock(&ut__derived_lock);
  ut__packed* e = (ut__packed*)t->derived;
  if (e && (e->version != v || e->view_closes != vc || e->m != g->m || e->k != g->k ||
            e->lda != g->lda || e->MR != MR || e->KC != UT__CPU_KC))
    e = NULL;
  if (e) __atomic_fetch_add(&e->rc, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&ut__derived_lock);
  if (e) return e;
  int mu = (g->m + MR - 1) / MR * MR;
  e = (ut__packed*)calloc(1, sizeof *e);
  void* raw = e ? malloc((size_t)mu * g->k * sizeof(float) + 64) : NULL;
  if (!raw) {
    free(e);
    return NULL; /* packed per call instead: slower, not wrong */
  }
  *e = (ut__packed){.rc = 2, .version = v, .view_closes = vc, .m = g->m, .k = g->k,
                    .lda = g->lda, .MR = MR, .KC = UT__CPU_KC, .raw = raw,
                    .data = ut__cpu_align64(raw)};
  for (int k0 = 0; k0 < g->k; k0 += UT__CPU_KC)
    ut__cpu_pack_a(t->data, g->lda, false, 0, g->m, k0, UT__CPU_MIN(UT__CPU_KC, g->k - k0), MR,
                   e->data + (ut__i64)k0 * mu);
  pthread_mutex_lock(&ut__derived_lock);
  ut__packed* old = (ut__packed*)t->derived;
  t->derived = e; /* the tensor's reference; the caller holds the other */
  pthread_mutex_unlock(&ut__derived_lock);
  ut__packed_release(old);
  return e;
}

static int ut__cpu_gemm_f32(const ut__gemm_args* g) {
  int m = g->m, n = g->n, k = g->k;
  int nbt = g->sum_batch ? 1 : g->batch;
  if (m <= 0 || n <= 0 || nbt <= 0) return UT_OK;
  /* the epilogue is applied as the packed engine finishes each tile (ut__cpu_gemm_task) */
  if (g->row_scale && (g->sum_batch || k <= 0 || g->batch <= 0))
    return ut__set_error(UT_ERR_ARG, "gemm: the epilogue needs a plain product (k %d, batch %d)",
                         k, g->batch);
  if (k <= 0 || g->batch <= 0) {
    for (int bi = 0; bi < nbt; bi++)
      ut__cpu_gemm_scale_c((float*)g->c + (g->sum_batch ? 0 : (ut__i64)bi * g->stride_c), g->ldc,
                           m, n, g->beta);
    return UT_OK;
  }
  /* One to eight columns of B [k, n] in one product (a 1x1 convolution over 1x1 or 2x2 planes:
     the last stages of a network at 32^2, one image or a batch merged): the packed engine would
     pack the whole weight (A) for those columns, more than the products cost (17% of
     MobileNetV2's 32^2 forward), or read it in place at a quarter of its lanes. The dot-product
     engine reads A in place, against B's columns turned k-contiguous; the epilogue then runs
     over C's rows. */
  if (!g->b_conv && !g->sum_batch && g->batch == 1 && !g->trans_a && !g->trans_b && n <= 8 &&
      k >= 32 && g->beta == 0.0f) {
    float* bt = (float*)malloc((size_t)n * k * sizeof(float));
    if (!bt) return ut__set_error(UT_ERR_MEMORY, "gemm: out of memory");
    const float* b = (const float*)g->b;
    for (int j = 0; j < n; j++)
      for (int kk = 0; kk < k; kk++) bt[(ut__i64)j * k + kk] = b[(ut__i64)kk * g->ldb + j];
    ut__gemm_args gd = *g;
    gd.trans_b = true;
    gd.b = bt;
    gd.ldb = k;
    gd.row_scale = gd.row_shift = NULL;
    int rc = ut__cpu_gemm_dot(&gd);
    free(bt);
    if (rc >= 0 && g->row_scale)
      ut__cpu_epi_rows((float*)g->c, g->ldc, m, n, g->row_scale, g->row_shift, g->act);
    return rc;
  }
  /* where packing would cost about as much as the products: a long k and few rows (a Linear
     forward, x [batch, in] . W^T with W [out, in]; a weight gradient summed over the batch
     into a narrow layer's weight) or columns, or a small C from one product. Elsewhere the
     packed engine was faster, up to 2x: ConvNeXt's 96 <-> 384 weight gradients over 16x16
     planes (k 256 per image, 8 images) 1.37 -> 0.68 ms on 2 cores, MobileNetV2's 192 x 32
     at 28x28 0.65 -> 0.33 ms; the dot engine kept 1.5-4x where m <= 24 or n <= 16 (16 x 96
     at 112x112, a 10-class head) and at 48 x 48 (1.65x). One row or column (a matrix-vector
     product: a Linear over one sample, squeeze-and-excitation's 1x1 convs over pooled
     [1, C, 1, 1]) from a depth of 32: the packed engine would pad it to a whole panel and pack
     the matrix for one use (Linear(48, 1152) on one sample 32 -> 21 us on 2 cores; below 32
     the dot engine's remainder path costs more: 28 -> 672 14 -> 24 us) */
  if (!g->row_scale && !g->b_conv && (g->sum_batch || g->batch == 1) && !g->trans_a &&
      g->trans_b &&
      ((k >= 256 && (m <= 24 || n <= 16 || (g->batch == 1 && (ut__i64)m * n <= 48 * 48))) ||
       ((m == 1 || n == 1) && k >= 32)))
    return ut__cpu_gemm_dot(g);
  const ut__cpu_isa_kernels* isa = ut__cpu_isa();
  ut__cpu_gemm_kern kern = isa->gemm;
  int MR = isa->gemm_mr, NR = isa->gemm_nr;
  int mr_up = (m + MR - 1) / MR * MR, nr_up = (n + NR - 1) / NR * NR;
  int MC = UT__CPU_MIN(mr_up, UT__CPU_MC / MR * MR); /* A's blocks */
  int MT = mr_up;                                     /* a task's rows: MC blocks under one B */
  int NC = UT__CPU_MIN(nr_up, UT__CPU_NC / NR * NR);
  double macs = (double)m * n * k * g->batch;
  int nt = ut__cpu_nt(macs / 2);
  (void)nt;
  /* sum_batch: the batch is cut into `nck` fixed chunks (chosen from the shape alone, never
     from the thread count), each summed in parallel into its own partial C; the partials are
     then added in chunk order. Same result for any number of threads. */
  int nck = 1, per = g->batch;
  if (g->sum_batch && g->batch >= 2 && macs >= UT__CPU_SERIAL_BELOW * 8.0) {
    nck = UT__CPU_MIN(g->batch, UT__CPU_GEMM_CHUNKS);
    while (nck > 1 && (double)nck * m * n > (double)UT__CPU_GEMM_PART_MAX) nck--;
    per = (g->batch + nck - 1) / nck;
    nck = (g->batch + per - 1) / per;
  }
  if (nck > 1) nbt = nck;
  /* Tasks: ib blocks of rows x jb blocks of columns (x nbt batch items). A task packs its rows
     of A once per k block for each of its column blocks and its columns of B once for all its
     rows, so the split moves m*k*jb + k*n*ib floats into packed panels: the cheapest split
     with enough tasks for the threads (2 each, where the shape allows). Packing the larger
     operand fewer times measured 7-17% on MobileNet's 1x1 layers (96 -> 576 over 14x14,
     batch 8; 160 -> 960 over 7x7, batch 1); blocks of B stay within NC columns. */
  {
    ut__i64 want = nt > 1 ? 2 * nt : 1, ibx = (m + MR - 1) / MR, jbx = (n + NR - 1) / NR;
    ut__i64 jb0 = (n + NC - 1) / NC, best_ib = ibx, best_jb = jbx;
    double best = -1.0;
    for (ut__i64 i = 1; i <= ibx; i++)
      for (ut__i64 j = jb0; j <= jbx; j++) {
        if (nbt * i * j < want && (i < ibx || j < jbx)) continue;
        double cost = (double)m * j + (double)n * i;
        if (best < 0.0 || cost < best) best = cost, best_ib = i, best_jb = j;
        break; /* more column blocks only cost more */
      }
    MT = (int)(((m + best_ib - 1) / best_ib + MR - 1) / MR * MR);
    NC = (int)(((n + best_jb - 1) / best_jb + NR - 1) / NR * NR);
  }
  ut__i64 ib = (m + MT - 1) / MT, jb = (n + NC - 1) / NC, tasks = (ut__i64)nbt * ib * jb;
  if (tasks < nt) nt = (int)tasks;
  MC = UT__CPU_MIN(MC, MT);
  int KCe = UT__CPU_MIN(UT__CPU_KC, k);
  size_t asz = ((size_t)MC * KCe + 15) & ~(size_t)15, bsz = ((size_t)NC * KCe + 15) & ~(size_t)15;
  size_t psz = nck > 1 ? (((size_t)m * n + 15) & ~(size_t)15) * (size_t)nck : 0;
  void* raw = malloc(((asz + bsz) * (size_t)nt + psz) * sizeof(float) + 64);
  if (!raw) return ut__set_error(UT_ERR_MEMORY, "gemm: out of memory");
  float* base = ut__cpu_align64(raw);
  float* part = base + (asz + bsz) * (size_t)nt;
  size_t pstride = ((size_t)m * n + 15) & ~(size_t)15;
  ut__packed* kept = ut__cpu_packed_a(g, MR);
  ut__gemm_args gk;
  if (kept) {
    gk = *g;
    gk.a_packed = kept->data;
    g = &gk;
  }
  ut__cpu_gemm_ctx cx = {g, kern, isa->gemm_epi, MR, NR, MC, MT, NC, nck, per, ib, jb, tasks,
                         base, part, asz, bsz, pstride, 0};
  ut__parallel_run(nt, ut__cpu_gemm_part, &cx);
  ut__packed_release(kept);
  if (nck > 1) {
    /* C = ((beta C + p0) + p1) + ..., each row by one thread */
    ut__cpu_gemm_sum_ctx sc = {g, part, pstride, nck};
    ut__parallel_run(nt, ut__cpu_gemm_sum_part, &sc);
  }
  free(raw);
  return UT_OK;
}

/* ---- layer norm ----------------------------------------------------------------------------- */

/* The arguments of the layer norm ops (fwd: go, dx, dgamma, dbeta unused; bwd: y, beta). */
typedef struct {
  const float* go;
  const float* x;
  const float* gamma;
  const float* beta;
  float* y;
  float* mean;
  float* rstd;
  float* dx;
  float* dgamma;
  float* dbeta;
  int rows, dim;
  float eps;
} ut__cpu_layernorm_ctx;
UT__CPU_OPT static void ut__cpu_layernorm_fwd_part(void* vc, int tid, int nt) {
  const ut__cpu_layernorm_ctx* c = (const ut__cpu_layernorm_ctx*)vc;
  const float* x = c->x;
  const float* gamma = c->gamma;
  const float* beta = c->beta;
  float* y = c->y;
  float* mean = c->mean;
  float* rstd = c->rstd;
  int dim = c->dim;
  float eps = c->eps;
  ut__i64 lo, hi;
  ut__cpu_part(c->rows, tid, nt, &lo, &hi);
  for (int r = (int)lo; r < hi; r++) {
    const float* xr = x + (ut__i64)r * dim;
    float* yr = y + (ut__i64)r * dim;
    double mu = ut__cpu_sum_body(xr, dim) / dim;
    double ss = 0.0;
    for (int i = 0; i < dim; i++) {
      double d = (double)xr[i] - mu;
      ss += d * d;
    }
    float rs = (float)(1.0 / sqrt(ss / dim + (double)eps));
    float m = (float)mu;
    if (mean) mean[r] = m;
    if (rstd) rstd[r] = rs;
    for (int i = 0; i < dim; i++) {
      float v = (xr[i] - m) * rs;
      yr[i] = (gamma ? v * gamma[i] : v) + (beta ? beta[i] : 0.0f);
    }
  }
}
UT__CPU_OPT static int ut__cpu_layernorm_fwd(const float* x, const float* gamma, const float* beta,
                                             float* y, float* mean, float* rstd, int rows,
                                             int dim, float eps) {
  int nt = ut__cpu_nt((double)rows * dim);
  ut__cpu_layernorm_ctx c = {NULL, x, gamma, beta, y, mean, rstd, NULL, NULL, NULL, rows, dim, eps};
  ut__parallel_run(nt, ut__cpu_layernorm_fwd_part, &c);
  return UT_OK;
}

/* dx = rstd (gamma go - mean(gamma go) - xhat mean(gamma go xhat)); the parameter gradients
   are summed per column over the rows in order (column blocks in parallel). */
UT__CPU_OPT static void ut__cpu_layernorm_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_layernorm_ctx* c = (const ut__cpu_layernorm_ctx*)vc;
  const float* go = c->go;
  const float* x = c->x;
  const float* gamma = c->gamma;
  const float* mean = c->mean;
  const float* rstd = c->rstd;
  float* dx = c->dx;
  int dim = c->dim;
  ut__i64 lo, hi;
  ut__cpu_part(c->rows, tid, nt, &lo, &hi);
  for (int r = (int)lo; r < hi; r++) {
    const float* gr = go + (ut__i64)r * dim;
    const float* xr = x + (ut__i64)r * dim;
    float* dr = dx + (ut__i64)r * dim;
    float m = mean[r], rs = rstd[r];
    double s1 = 0.0, s2 = 0.0;
    for (int i = 0; i < dim; i++) {
      double gg = (double)gr[i] * (gamma ? gamma[i] : 1.0f);
      s1 += gg;
      s2 += gg * (double)((xr[i] - m) * rs);
    }
    float a = (float)(s1 / dim), bq = (float)(s2 / dim);
    for (int i = 0; i < dim; i++) {
      float gg = gr[i] * (gamma ? gamma[i] : 1.0f);
      float xh = (xr[i] - m) * rs;
      dr[i] = rs * (gg - a - xh * bq);
    }
  }
}
#define UT__CPU_LN_CB 64 /* columns per block of the parameter gradients */
UT__CPU_OPT static void ut__cpu_layernorm_bwd_params_part(void* vc, int tid, int nt) {
  const ut__cpu_layernorm_ctx* c = (const ut__cpu_layernorm_ctx*)vc;
  const float* go = c->go;
  const float* x = c->x;
  const float* mean = c->mean;
  const float* rstd = c->rstd;
  float* dgamma = c->dgamma;
  float* dbeta = c->dbeta;
  int rows = c->rows, dim = c->dim;
  const int CB = UT__CPU_LN_CB;
  int nblk = (dim + CB - 1) / CB;
  ut__i64 lo, hi;
  ut__cpu_part(nblk, tid, nt, &lo, &hi);
  for (int bk = (int)lo; bk < hi; bk++) {
    int d0 = bk * CB, d1 = UT__CPU_MIN(dim, d0 + CB);
    double ag[64] = {0}, ab[64] = {0};
    for (int r = 0; r < rows; r++) {
      const float* gr = go + (ut__i64)r * dim;
      const float* xr = x + (ut__i64)r * dim;
      float m = mean[r], rs = rstd[r];
      for (int i = d0; i < d1; i++) {
        ag[i - d0] += (double)(gr[i] * ((xr[i] - m) * rs));
        ab[i - d0] += (double)gr[i];
      }
    }
    for (int i = d0; i < d1; i++) {
      if (dgamma) dgamma[i] += (float)ag[i - d0];
      if (dbeta) dbeta[i] += (float)ab[i - d0];
    }
  }
}
UT__CPU_OPT static int ut__cpu_layernorm_bwd(const float* go, const float* x, const float* gamma,
                                             const float* mean, const float* rstd, float* dx,
                                             float* dgamma, float* dbeta, int rows, int dim) {
  int nt = ut__cpu_nt((double)rows * dim);
  ut__cpu_layernorm_ctx c = {go, x, gamma, NULL, NULL, (float*)mean, (float*)rstd, dx,
                             dgamma, dbeta, rows, dim, 0.0f};
  ut__parallel_run(nt, ut__cpu_layernorm_bwd_part, &c);
  if (!dgamma && !dbeta) return UT_OK;
  const int CB = UT__CPU_LN_CB;
  int nblk = (dim + CB - 1) / CB;
  int nt2 = UT__CPU_MIN(nt, nblk);
  ut__parallel_run(nt2, ut__cpu_layernorm_bwd_params_part, &c);
  return UT_OK;
}

/* ---- channel scales and LayerNorm2d (issue 30); x: [n, c, inner] ------------------------- */
typedef struct {
  const float* x;
  const float* b; /* chan_scale: s; chan_dot: the second factor */
  float* y;       /* chan_scale: y; chan_dot: out */
  int n, c;
  ut__i64 inner;
  bool shared;
  float beta;
} ut__cpu_cscale_ctx;
UT__CPU_OPT static void ut__cpu_chan_scale_part(void* vc, int tid, int nt) {
  const ut__cpu_cscale_ctx* c = (const ut__cpu_cscale_ctx*)vc;
  const ut__i64 inner = c->inner;
  ut__i64 lo, hi;
  ut__cpu_part((ut__i64)c->n * c->c, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++) {
    const float s = c->b[c->shared ? r % c->c : r];
    const float* xr = c->x + r * inner;
    float* yr = c->y + r * inner;
    for (ut__i64 k = 0; k < inner; k++) yr[k] = xr[k] * s;
  }
}
static int ut__cpu_chan_scale_f32(const float* x, const float* s, float* y, int n, int c,
                                  ut__i64 inner, bool shared) {
  ut__cpu_cscale_ctx ctx = {x, s, y, n, c, inner, shared, 0.f};
  ut__parallel_run(ut__cpu_nt((double)n * c * inner), ut__cpu_chan_scale_part, &ctx);
  return UT_OK;
}
UT__CPU_INL double ut__cpu_dot_body(const float* restrict a, const float* restrict b,
                                    ut__i64 n) {
  double t = 0.0;
  for (ut__i64 k = 0; k < n; k++) t += (double)a[k] * b[k];
  return t;
}
/* per sample: a part of the rows (n, c); shared: a part of the channels, each summed over the
   samples in order */
UT__CPU_OPT static void ut__cpu_chan_dot_part(void* vc, int tid, int nt) {
  const ut__cpu_cscale_ctx* c = (const ut__cpu_cscale_ctx*)vc;
  const ut__i64 inner = c->inner;
  ut__i64 lo, hi;
  ut__cpu_part(c->shared ? c->c : (ut__i64)c->n * c->c, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++) {
    double t = 0.0;
    if (c->shared)
      for (int i = 0; i < c->n; i++) {
        const ut__i64 off = ((ut__i64)i * c->c + r) * inner;
        t += ut__cpu_dot_body(c->x + off, c->b + off, inner);
      }
    else
      t = ut__cpu_dot_body(c->x + r * inner, c->b + r * inner, inner);
    c->y[r] = (c->beta != 0.f ? c->y[r] : 0.f) + (float)t;
  }
}
static int ut__cpu_chan_dot_f32(const float* a, const float* b, float* out, int n, int c,
                                ut__i64 inner, bool shared, float beta) {
  ut__cpu_cscale_ctx ctx = {a, b, out, n, c, inner, shared, beta};
  int nt = ut__cpu_nt((double)n * c * inner);
  nt = (int)UT__CPU_MIN((ut__i64)nt, shared ? (ut__i64)c : (ut__i64)n * c);
  ut__parallel_run(nt < 1 ? 1 : nt, ut__cpu_chan_dot_part, &ctx);
  return UT_OK;
}

/* LayerNorm2d walks blocks of UT__CPU_LN2D_KB positions of one sample, channel by channel:
   each channel's run of positions is contiguous (an NCHW tensor's channel stride is inner),
   so the per-position sums stay in a small local array instead of striding through memory. */
#define UT__CPU_LN2D_KB 256
typedef struct {
  const float* go;
  const float* x;
  const float* gamma;
  const float* beta;
  float* y; /* forward: y; backward: dx */
  float* mean;
  float* rstd;
  float* dgamma;
  float* dbeta;
  int n, c;
  ut__i64 inner;
  float eps;
} ut__cpu_ln2d_ctx;
static ut__i64 ut__cpu_ln2d_units(const ut__cpu_ln2d_ctx* c) {
  return (ut__i64)c->n * ((c->inner + UT__CPU_LN2D_KB - 1) / UT__CPU_LN2D_KB);
}
UT__CPU_OPT static void ut__cpu_ln2d_fwd_part(void* vc, int tid, int nt) {
  const ut__cpu_ln2d_ctx* c = (const ut__cpu_ln2d_ctx*)vc;
  const ut__i64 inner = c->inner, kblocks = (inner + UT__CPU_LN2D_KB - 1) / UT__CPU_LN2D_KB;
  const int C = c->c;
  ut__i64 lo, hi;
  ut__cpu_part(ut__cpu_ln2d_units(c), tid, nt, &lo, &hi);
  for (ut__i64 u = lo; u < hi; u++) {
    const ut__i64 i = u / kblocks, k0 = (u % kblocks) * UT__CPU_LN2D_KB;
    const int kn = (int)UT__CPU_MIN((ut__i64)UT__CPU_LN2D_KB, inner - k0);
    const float* xs = c->x + i * C * inner + k0;
    float* ys = c->y + i * C * inner + k0;
    double s1[UT__CPU_LN2D_KB], s2[UT__CPU_LN2D_KB];
    float m[UT__CPU_LN2D_KB], rs[UT__CPU_LN2D_KB];
    for (int k = 0; k < kn; k++) s1[k] = s2[k] = 0.0;
    for (int j = 0; j < C; j++)
      for (int k = 0; k < kn; k++) s1[k] += xs[(ut__i64)j * inner + k];
    for (int k = 0; k < kn; k++) s1[k] /= C;
    for (int j = 0; j < C; j++)
      for (int k = 0; k < kn; k++) {
        const double d = xs[(ut__i64)j * inner + k] - s1[k];
        s2[k] += d * d;
      }
    for (int k = 0; k < kn; k++) {
      m[k] = (float)s1[k];
      rs[k] = (float)(1.0 / sqrt(s2[k] / C + (double)c->eps));
      c->mean[i * inner + k0 + k] = m[k];
      c->rstd[i * inner + k0 + k] = rs[k];
    }
    for (int j = 0; j < C; j++) {
      const float g = c->gamma[j], b = c->beta[j];
      for (int k = 0; k < kn; k++)
        ys[(ut__i64)j * inner + k] = (xs[(ut__i64)j * inner + k] - m[k]) * rs[k] * g + b;
    }
  }
}
static int ut__cpu_ln2d_fwd_f32(const float* x, const float* gamma, const float* beta, float* y,
                                float* mean, float* rstd, int n, int c, ut__i64 inner,
                                float eps) {
  ut__cpu_ln2d_ctx ctx = {NULL, x, gamma, beta, y, mean, rstd, NULL, NULL, n, c, inner, eps};
  int nt = (int)UT__CPU_MIN((ut__i64)ut__cpu_nt((double)n * c * inner), ut__cpu_ln2d_units(&ctx));
  ut__parallel_run(nt < 1 ? 1 : nt, ut__cpu_ln2d_fwd_part, &ctx);
  return UT_OK;
}
/* dx = rstd (g - mean_j(g) - xhat mean_j(g xhat)), g = go gamma, as the rows layernorm */
UT__CPU_OPT static void ut__cpu_ln2d_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_ln2d_ctx* c = (const ut__cpu_ln2d_ctx*)vc;
  const ut__i64 inner = c->inner, kblocks = (inner + UT__CPU_LN2D_KB - 1) / UT__CPU_LN2D_KB;
  const int C = c->c;
  ut__i64 lo, hi;
  ut__cpu_part(ut__cpu_ln2d_units(c), tid, nt, &lo, &hi);
  for (ut__i64 u = lo; u < hi; u++) {
    const ut__i64 i = u / kblocks, k0 = (u % kblocks) * UT__CPU_LN2D_KB;
    const int kn = (int)UT__CPU_MIN((ut__i64)UT__CPU_LN2D_KB, inner - k0);
    const float* xs = c->x + i * C * inner + k0;
    const float* gs = c->go + i * C * inner + k0;
    float* ds = c->y + i * C * inner + k0;
    const float* m = c->mean + i * inner + k0;
    const float* rs = c->rstd + i * inner + k0;
    double s1[UT__CPU_LN2D_KB], s2[UT__CPU_LN2D_KB];
    float a[UT__CPU_LN2D_KB], b[UT__CPU_LN2D_KB];
    for (int k = 0; k < kn; k++) s1[k] = s2[k] = 0.0;
    for (int j = 0; j < C; j++) {
      const float g = c->gamma[j];
      for (int k = 0; k < kn; k++) {
        const ut__i64 e = (ut__i64)j * inner + k;
        const double gg = (double)gs[e] * g;
        s1[k] += gg;
        s2[k] += gg * (double)((xs[e] - m[k]) * rs[k]);
      }
    }
    for (int k = 0; k < kn; k++) {
      a[k] = (float)(s1[k] / C);
      b[k] = (float)(s2[k] / C);
    }
    for (int j = 0; j < C; j++) {
      const float g = c->gamma[j];
      for (int k = 0; k < kn; k++) {
        const ut__i64 e = (ut__i64)j * inner + k;
        const float xh = (xs[e] - m[k]) * rs[k];
        ds[e] = rs[k] * (gs[e] * g - a[k] - xh * b[k]);
      }
    }
  }
}
/* dgamma, dbeta: a part of the channels, each summed over samples and positions in order */
UT__CPU_OPT static void ut__cpu_ln2d_params_part(void* vc, int tid, int nt) {
  const ut__cpu_ln2d_ctx* c = (const ut__cpu_ln2d_ctx*)vc;
  const ut__i64 inner = c->inner;
  ut__i64 lo, hi;
  ut__cpu_part(c->c, tid, nt, &lo, &hi);
  for (ut__i64 j = lo; j < hi; j++) {
    double ag = 0.0, ab = 0.0;
    for (int i = 0; i < c->n; i++) {
      const ut__i64 off = ((ut__i64)i * c->c + j) * inner;
      const float* m = c->mean + (ut__i64)i * inner;
      const float* rs = c->rstd + (ut__i64)i * inner;
      for (ut__i64 k = 0; k < inner; k++) {
        const float g = c->go[off + k];
        ag += (double)(g * ((c->x[off + k] - m[k]) * rs[k]));
        ab += (double)g;
      }
    }
    if (c->dgamma) c->dgamma[j] += (float)ag;
    if (c->dbeta) c->dbeta[j] += (float)ab;
  }
}
static int ut__cpu_ln2d_bwd_f32(const float* go, const float* x, const float* gamma,
                                const float* mean, const float* rstd, float* dx, float* dgamma,
                                float* dbeta, int n, int c, ut__i64 inner) {
  ut__cpu_ln2d_ctx ctx = {go, x, gamma, NULL, dx, (float*)mean, (float*)rstd, dgamma, dbeta,
                          n, c, inner, 0.f};
  const int nt0 = ut__cpu_nt((double)n * c * inner);
  int nt = (int)UT__CPU_MIN((ut__i64)nt0, ut__cpu_ln2d_units(&ctx));
  if (dx) ut__parallel_run(nt < 1 ? 1 : nt, ut__cpu_ln2d_bwd_part, &ctx);
  if (!dgamma && !dbeta) return UT_OK;
  nt = UT__CPU_MIN(nt0, c);
  ut__parallel_run(nt < 1 ? 1 : nt, ut__cpu_ln2d_params_part, &ctx);
  return UT_OK;
}

/* ---- batch norm (x: [n, c, inner]); every reduction is per channel, one thread each ---- */

/* The arguments of the batch norm ops (x: [n, c, inner]); each uses its own. */
typedef struct {
  const float* go;
  const float* x;
  float* y;
  const float* mean;
  const float* var;
  const float* rstd;
  const float* gamma;
  const float* beta;
  float* dx;
  float* dgamma;
  float* dbeta;
  float* mean_out;
  float* var_out;
  int n, c;
  ut__i64 inner;
  float eps;
  int act; /* bn_apply's and bn_bwd's: a ut_activation */
  bool training;
  float* sums_out;      /* bn_bwd_sums: the per-channel sums, no dx */
  const float* sums_in; /* bn_bwd_dx: dx from these sums (and count sums_in[2c]) */
  float* gscratch;      /* act from SILU on: per thread, n inner floats (ut__cpu_bn_bwd_run), or
                           n UT__BN_RUN over small planes (ut__cpu_bn_bwd_small) */
} ut__cpu_bn_ctx;

/* batchnorm's output before its activation, one expression for apply and for backward's mask
   (the same operations in the same order give the same bits); always inlined, also into the
   activations' loops (UT__CPU_ACT_OPT: other options, across which GCC inlines only when told) */
UT__CPU_INL float ut__cpu_bn_z(float x, float m, float sc, float bt) { return (x - m) * sc + bt; }
/* relu_fwd's and relu_bwd's rules at z (act >= 0; act > 0 caps) */
UT__CPU_INL float ut__cpu_bn_relu(float z, float act) {
  float v = z < 0.0f ? 0.0f : z;
  return act > 0.0f && v > act ? act : v;
}
UT__CPU_INL float ut__cpu_bn_relu_grad(float g, float z, float act) {
  /* g's bits cleared through a mask (the tests are false for a NaN z: it passes g on): GCC
     vectorizes that, where a select of 0 or g left bn_bwd's sums scalar and branching on
     the data's signs (64 channels at 32^2, batch 8: 2 ms) */
  uint32_t gb, stop = (uint32_t)((z <= 0.0f) | ((act > 0.0f) & (z >= act)));
  memcpy(&gb, &g, sizeof gb);
  gb &= stop - 1u;
  memcpy(&g, &gb, sizeof g);
  return g;
}
/* batchnorm backward's gradient at one element for NONE, RELU and RELU6: go, masked at the
   pre-activation recomputed from x; computed where it is used, in both passes, rather than
   stored. act is a constant wherever this is inlined (ut__cpu_bn_bwd_part instantiates its
   body per kind), so each loop compiles to one formula. */
UT__CPU_INL float ut__cpu_bn_g(float g, float x, float m, float sc, float bt, int act) {
  if (act == UT_ACT_NONE) return g;
  return ut__cpu_bn_relu_grad(g, ut__cpu_bn_z(x, m, sc, bt), act == UT_ACT_RELU6 ? 6.0f : 0.0f);
}
/* the kinds from SILU on: g = go f'(z) over one row, z recomputed from x as bn_apply computes
   it; one loop per kind, as act_bwd's (and with its options: the piecewise kinds vectorize) */
#define UT__CPU_BN_GRAD_LOOP(A)                                              \
  case A:                                                                    \
    for (ut__i64 t = 0; t < inner; t++) g[t] = ut__act_grad(A, go[t], g[t]); \
    break
/* g = go f'(z) over inner values, g holding z on entry */
UT__CPU_ACT_OPT static void ut__cpu_bn_grad_kinds(const float* restrict go, float* restrict g,
                                                  ut__i64 inner, int act) {
  switch (act) {
    UT__CPU_BN_GRAD_LOOP(UT_ACT_SILU);
    UT__CPU_BN_GRAD_LOOP(UT_ACT_HARDSWISH);
    UT__CPU_BN_GRAD_LOOP(UT_ACT_HARDSIGMOID);
    UT__CPU_BN_GRAD_LOOP(UT_ACT_SIGMOID);
    UT__CPU_BN_GRAD_LOOP(UT_ACT_GELU);
    UT__CPU_BN_GRAD_LOOP(UT_ACT_GELU_TANH);
  }
}
#undef UT__CPU_BN_GRAD_LOOP
UT__CPU_ACT_OPT static void ut__cpu_bn_grad_row(const float* restrict go, const float* restrict x,
                                                float* restrict g, ut__i64 inner, float m,
                                                float sc, float bt, int act) {
  /* z first, in a loop of its own that vectorizes (tanhf keeps the other scalar);
     the same loop as bn_apply's for these kinds, so the same z to the bit */
  for (ut__i64 t = 0; t < inner; t++) g[t] = ut__cpu_bn_z(x[t], m, sc, bt);
  ut__cpu_bn_grad_kinds(go, g, inner, act);
}
/* bn_apply's activation from SILU on over inner values of yr (z on entry): one loop per kind,
   the switch outside it, as act_fwd's loops (and their options: the piecewise kinds vectorize
   as selects) */
#define UT__CPU_BN_ACT_LOOP(A)                                         \
  case A:                                                              \
    for (ut__i64 i = 0; i < inner; i++) yr[i] = ut__act_value(A, yr[i]); \
    break
UT__CPU_ACT_OPT static void ut__cpu_bn_act_kinds(float* restrict yr, ut__i64 inner, int act) {
  switch (act) {
    UT__CPU_BN_ACT_LOOP(UT_ACT_SILU);
    UT__CPU_BN_ACT_LOOP(UT_ACT_HARDSWISH);
    UT__CPU_BN_ACT_LOOP(UT_ACT_HARDSIGMOID);
    UT__CPU_BN_ACT_LOOP(UT_ACT_SIGMOID);
    UT__CPU_BN_ACT_LOOP(UT_ACT_GELU);
    UT__CPU_BN_ACT_LOOP(UT_ACT_GELU_TANH);
  }
}
#undef UT__CPU_BN_ACT_LOOP
/* Batch norm over small planes (inner < UT__BN_SMALL). The per-row loops below are mostly
   setup there: a 16-lane block and its reductions for 4 values of a 2x2 plane; BatchNorm's
   training forward over [8, 1024, 2, 2] took 8x the time per value of one over [8, 128, 16,
   16]. Here the rows of a block of channels, contiguous in each image (channels j0..j0+b: b *
   inner values), are one run; the loops go along the run and across the images, with each
   slot's channel parameters spread into arrays the run's length. */
#define UT__BN_SMALL 64
#define UT__BN_RUN 256  /* values in a run: UT__BN_RUN / inner channels a block */
#define UT__BN_CHUNK 64 /* images summed in float before a slot's double */

/* out[k] = the sum over n images of p's run (image i's at p + i * stride, len values), or with
   ms, of (p[k] - ms[k])^2 */
UT__CPU_INL void ut__cpu_bn_run_sums(const float* restrict p, ut__i64 stride, int n, ut__i64 len,
                                     const float* restrict ms, double* restrict out) {
  float acc[UT__BN_RUN];
  for (ut__i64 k = 0; k < len; k++) out[k] = 0.0;
  for (int i0 = 0; i0 < n; i0 += UT__BN_CHUNK) {
    int i1 = UT__CPU_MIN(n, i0 + UT__BN_CHUNK);
    for (ut__i64 k = 0; k < len; k++) acc[k] = 0.0f;
    if (ms) {
      for (int i = i0; i < i1; i++) {
        const float* q = p + (ut__i64)i * stride;
        for (ut__i64 k = 0; k < len; k++) {
          float d = q[k] - ms[k];
          acc[k] += d * d;
        }
      }
    } else {
      for (int i = i0; i < i1; i++) {
        const float* q = p + (ut__i64)i * stride;
        for (ut__i64 k = 0; k < len; k++) acc[k] += q[k];
      }
    }
    for (ut__i64 k = 0; k < len; k++) out[k] += (double)acc[k];
  }
}
/* the channel sums of a block from its slots' */
UT__CPU_INL double ut__cpu_bn_slot_total(const double* s, ut__i64 inner) {
  double t = 0.0;
  for (ut__i64 k = 0; k < inner; k++) t += s[k];
  return t;
}
/* bn_stats over channels [lo, hi) of small planes: mean, then the squares about it */
UT__CPU_INL void ut__cpu_bn_stats_small(const ut__cpu_bn_ctx* cx, ut__i64 lo, ut__i64 hi) {
  ut__i64 inner = cx->inner, per = UT__BN_RUN / inner, cs = (ut__i64)cx->c * inner;
  double cnt = (double)cx->n * inner, s[UT__BN_RUN], mu[UT__BN_RUN];
  float ms[UT__BN_RUN];
  for (ut__i64 j0 = lo; j0 < hi; j0 += per) {
    ut__i64 nb = UT__CPU_MIN(per, hi - j0), len = nb * inner;
    const float* p = cx->x + j0 * inner;
    ut__cpu_bn_run_sums(p, cs, cx->n, len, NULL, s);
    for (ut__i64 b = 0; b < nb; b++) {
      mu[b] = cnt > 0 ? ut__cpu_bn_slot_total(s + b * inner, inner) / cnt : 0.0;
      float mf = (float)mu[b];
      cx->mean_out[j0 + b] = mf;
      for (ut__i64 k = 0; k < inner; k++) ms[b * inner + k] = mf;
    }
    ut__cpu_bn_run_sums(p, cs, cx->n, len, ms, s);
    for (ut__i64 b = 0; b < nb; b++) {
      /* as ut__cpu_bn_stats_part: the float mean's rounding error adds (mean - mf)^2 */
      double dm = mu[b] - (double)ms[b * inner];
      double v = cnt > 0 ? ut__cpu_bn_slot_total(s + b * inner, inner) / cnt - dm * dm : 0.0;
      cx->var_out[j0 + b] = (float)(v < 0.0 ? 0.0 : v);
    }
  }
}
/* channel j's bn_apply factors: the normalized value's scale (rstd * gamma) and shift (beta) */
UT__CPU_INL void ut__cpu_bn_factors(const ut__cpu_bn_ctx* cx, int j, float* sc, float* bt) {
  float rs = cx->rstd ? cx->rstd[j] : (float)(1.0 / sqrt((double)cx->var[j] + (double)cx->eps));
  *sc = rs * (cx->gamma ? cx->gamma[j] : 1.0f);
  *bt = cx->beta ? cx->beta[j] : 0.0f;
}
/* bn_apply over channels [lo, hi) of small planes */
UT__CPU_INL void ut__cpu_bn_apply_small(const ut__cpu_bn_ctx* cx, ut__i64 lo, ut__i64 hi) {
  ut__i64 inner = cx->inner, per = UT__BN_RUN / inner, cs = (ut__i64)cx->c * inner;
  float ms[UT__BN_RUN], scs[UT__BN_RUN], bts[UT__BN_RUN];
  float cap = cx->act == UT_ACT_RELU6 ? 6.0f : 0.0f;
  for (ut__i64 j0 = lo; j0 < hi; j0 += per) {
    ut__i64 nb = UT__CPU_MIN(per, hi - j0), len = nb * inner;
    for (ut__i64 b = 0; b < nb; b++) {
      float sc, bt, m = cx->mean[j0 + b];
      ut__cpu_bn_factors(cx, (int)(j0 + b), &sc, &bt);
      for (ut__i64 k = b * inner; k < (b + 1) * inner; k++) {
        ms[k] = m;
        scs[k] = sc;
        bts[k] = bt;
      }
    }
    for (int i = 0; i < cx->n; i++) {
      const float* restrict xr = cx->x + (ut__i64)i * cs + j0 * inner;
      float* restrict yr = cx->y + (ut__i64)i * cs + j0 * inner;
      if (cx->act == UT_ACT_RELU || cx->act == UT_ACT_RELU6) {
        for (ut__i64 k = 0; k < len; k++)
          yr[k] = ut__cpu_bn_relu(ut__cpu_bn_z(xr[k], ms[k], scs[k], bts[k]), cap);
      } else {
        for (ut__i64 k = 0; k < len; k++) yr[k] = ut__cpu_bn_z(xr[k], ms[k], scs[k], bts[k]);
        if (cx->act != UT_ACT_NONE) ut__cpu_bn_act_kinds(yr, len, cx->act);
      }
    }
  }
}
/* bn_bwd over channels [lo, hi) of small planes for thread tid, act (NONE, RELU or RELU6) a
   constant where it is inlined, as ut__cpu_bn_bwd_run's, the same sums, outputs and formulas;
   the kinds from SILU on come with act NONE and first put g = go f'(z) of the block's runs in
   the thread's scratch, as that function does per channel */
UT__CPU_INL void ut__cpu_bn_bwd_small(const ut__cpu_bn_ctx* cx, int tid, ut__i64 lo, ut__i64 hi,
                                      const int act) {
  int n = cx->n, c = cx->c;
  ut__i64 inner = cx->inner, per = UT__BN_RUN / inner, cs = (ut__i64)c * inner;
  double cnt = cx->sums_in ? (double)cx->sums_in[2 * c] : (double)n * inner;
  float ms[UT__BN_RUN], scs[UT__BN_RUN], bts[UT__BN_RUN], a1[UT__BN_RUN], a2[UT__BN_RUN];
  float k0s[UT__BN_RUN], mgs[UT__BN_RUN], mgxs[UT__BN_RUN], rss[UT__BN_RUN];
  double s1[UT__BN_RUN], s2[UT__BN_RUN];
  for (ut__i64 j0 = lo; j0 < hi; j0 += per) {
    ut__i64 nb = UT__CPU_MIN(per, hi - j0), len = nb * inner, off = j0 * inner;
    for (ut__i64 b = 0; b < nb; b++) {
      int j = (int)(j0 + b);
      float sc = cx->rstd[j] * (cx->gamma ? cx->gamma[j] : 1.0f); /* as bn_apply */
      float bt = cx->beta ? cx->beta[j] : 0.0f;
      for (ut__i64 k = b * inner; k < (b + 1) * inner; k++) {
        ms[k] = cx->mean[j];
        scs[k] = sc;
        bts[k] = bt;
      }
    }
    /* go's run of image i is gb + i gs */
    const float* gb = cx->go + off;
    ut__i64 gs = cs;
    if (act == UT_ACT_NONE && cx->act >= UT_ACT_SILU) {
      float* sb = cx->gscratch + (size_t)tid * n * UT__BN_RUN;
      for (int i = 0; i < n; i++) {
        const float* xq = cx->x + (ut__i64)i * cs + off;
        float* g = sb + (ut__i64)i * len;
        for (ut__i64 k = 0; k < len; k++) g[k] = ut__cpu_bn_z(xq[k], ms[k], scs[k], bts[k]);
        ut__cpu_bn_grad_kinds(cx->go + (ut__i64)i * cs + off, g, len, cx->act);
      }
      gb = sb;
      gs = len;
    }
    for (ut__i64 k = 0; k < len; k++) s1[k] = s2[k] = 0.0;
    for (int i0 = 0; i0 < (cx->sums_in ? 0 : n); i0 += UT__BN_CHUNK) {
      for (ut__i64 k = 0; k < len; k++) a1[k] = a2[k] = 0.0f;
      for (int i = i0; i < UT__CPU_MIN(n, i0 + UT__BN_CHUNK); i++) {
        const float* restrict gq = gb + (ut__i64)i * gs;
        const float* restrict xq = cx->x + (ut__i64)i * cs + off;
        for (ut__i64 k = 0; k < len; k++) {
          float g = ut__cpu_bn_g(gq[k], xq[k], ms[k], scs[k], bts[k], act);
          a1[k] += g;
          a2[k] += g * (xq[k] - ms[k]);
        }
      }
      for (ut__i64 k = 0; k < len; k++) {
        s1[k] += (double)a1[k];
        s2[k] += (double)a2[k];
      }
    }
    for (ut__i64 b = 0; b < nb; b++) {
      int j = (int)(j0 + b);
      float rs = cx->rstd[j], gm = cx->gamma ? cx->gamma[j] : 1.0f;
      double sg = ut__cpu_bn_slot_total(s1 + b * inner, inner);
      double sgx = ut__cpu_bn_slot_total(s2 + b * inner, inner) * rs;
      if (cx->sums_in) {
        sg = cx->sums_in[2 * j];
        sgx = cx->sums_in[2 * j + 1];
      }
      if (cx->dgamma) cx->dgamma[j] += (float)sgx;
      if (cx->dbeta) cx->dbeta[j] += (float)sg;
      if (cx->sums_out) {
        cx->sums_out[2 * j] = (float)sg;
        cx->sums_out[2 * j + 1] = (float)sgx;
        continue;
      }
      float mg = cx->training && cnt > 0 ? (float)(sg / cnt) : 0.0f;
      float mgx = cx->training && cnt > 0 ? (float)(sgx / cnt) : 0.0f;
      for (ut__i64 k = b * inner; k < (b + 1) * inner; k++) {
        k0s[k] = gm * rs;
        mgs[k] = mg;
        mgxs[k] = mgx;
        rss[k] = rs;
      }
    }
    if (cx->sums_out) continue;
    for (int i = 0; i < n; i++) {
      const float* restrict gp = gb + (ut__i64)i * gs;
      const float* restrict xp = cx->x + (ut__i64)i * cs + off;
      float* restrict dp = cx->dx + (ut__i64)i * cs + off;
      if (cx->training) {
        for (ut__i64 k = 0; k < len; k++)
          dp[k] = k0s[k] * (ut__cpu_bn_g(gp[k], xp[k], ms[k], scs[k], bts[k], act) - mgs[k] -
                            (xp[k] - ms[k]) * rss[k] * mgxs[k]);
      } else {
        for (ut__i64 k = 0; k < len; k++)
          dp[k] = k0s[k] * ut__cpu_bn_g(gp[k], xp[k], ms[k], scs[k], bts[k], act);
      }
    }
  }
}
UT__CPU_ACT_OPT static void ut__cpu_bn_stats_part(void* vc, int tid, int nt) {
  const ut__cpu_bn_ctx* cx = (const ut__cpu_bn_ctx*)vc;
  const float* x = cx->x;
  float* mean = cx->mean_out;
  float* var = cx->var_out;
  int n = cx->n, c = cx->c;
  ut__i64 inner = cx->inner;
  double cnt = (double)n * inner;
  ut__i64 lo, hi;
  ut__cpu_part(c, tid, nt, &lo, &hi);
  if (inner < UT__BN_SMALL) {
    ut__cpu_bn_stats_small(cx, lo, hi);
    return;
  }
  for (int j = (int)lo; j < hi; j++) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += ut__cpu_sum_body(x + ((ut__i64)i * c + j) * inner, inner);
    double mu = cnt > 0 ? s / cnt : 0.0;
    float mf = (float)mu;
    double ss = 0.0;
    for (int i = 0; i < n; i++) {
      const float* p = x + ((ut__i64)i * c + j) * inner;
      for (ut__i64 i0 = 0; i0 < inner; i0 += 1024) {
        ut__i64 len = UT__CPU_MIN((ut__i64)1024, inner - i0);
        const float* q = p + i0;
        float l[16] = {0};
        ut__i64 t = 0;
        for (; t + 16 <= len; t += 16)
          for (int u = 0; u < 16; u++) {
            float d = q[t + u] - mf;
            l[u] += d * d;
          }
        float tl = 0.0f;
        for (; t < len; t++) {
          float d = q[t] - mf;
          tl += d * d;
        }
        for (int u = 0; u < 8; u++) l[u] += l[u + 8];
        for (int u = 0; u < 4; u++) l[u] += l[u + 4];
        ss += (double)((l[0] + l[2]) + (l[1] + l[3])) + (double)tl;
      }
    }
    /* the float mean's rounding error adds (mean - mf)^2 per element */
    double dm = mu - (double)mf;
    double v = cnt > 0 ? ss / cnt - dm * dm : 0.0;
    mean[j] = mf;
    var[j] = (float)(v < 0.0 ? 0.0 : v); /* a NaN variance stays NaN, as in PyTorch */
  }
}
UT__CPU_OPT static int ut__cpu_bn_stats_f32(const float* x, float* mean, float* var, int n, int c,
                                            ut__i64 inner) {
  int nt = ut__cpu_nt((double)n * c * inner);
  if (nt > c) nt = c;
  ut__cpu_bn_ctx cx = {0};
  cx.x = x;
  cx.mean_out = mean;
  cx.var_out = var;
  cx.n = n;
  cx.c = c;
  cx.inner = inner;
  ut__parallel_run(nt, ut__cpu_bn_stats_part, &cx);
  return UT_OK;
}

static int ut__cpu_bn_update_running(float* running_mean, float* running_var, const float* mean,
                                     const float* var, int c, float momentum, float unbias) {
  for (int j = 0; j < c; j++) {
    running_mean[j] = (1.0f - momentum) * running_mean[j] + momentum * mean[j];
    running_var[j] = (1.0f - momentum) * running_var[j] + momentum * (var[j] * unbias);
  }
  return UT_OK;
}

/* one row of bn_apply with an activation from SILU on: one loop per kind, the switch outside
   it, as act_fwd's loops (and their options: the piecewise kinds vectorize as selects) */
UT__CPU_ACT_OPT static void ut__cpu_bn_apply_act_row(const float* restrict xr, float* restrict yr,
                                                     ut__i64 inner, float m, float sc, float bt,
                                                     int act) {
  /* z first, in a loop of its own that vectorizes (see ut__cpu_bn_grad_row) */
  for (ut__i64 i = 0; i < inner; i++) yr[i] = ut__cpu_bn_z(xr[i], m, sc, bt);
  ut__cpu_bn_act_kinds(yr, inner, act);
}

UT__CPU_ACT_OPT static void ut__cpu_bn_apply_part(void* vc, int tid, int nt) {
  const ut__cpu_bn_ctx* cx = (const ut__cpu_bn_ctx*)vc;
  const float* x = cx->x;
  float* y = cx->y;
  const float* mean = cx->mean;
  const float* var = cx->var;
  const float* gamma = cx->gamma;
  const float* beta = cx->beta;
  const float* rstd = cx->rstd;
  int c = cx->c;
  ut__i64 inner = cx->inner;
  float eps = cx->eps;
  ut__i64 lo, hi;
  if (inner < UT__BN_SMALL) {
    ut__cpu_part(c, tid, nt, &lo, &hi);
    ut__cpu_bn_apply_small(cx, lo, hi);
    return;
  }
  ut__cpu_part((ut__i64)cx->n * c, tid, nt, &lo, &hi);
  for (ut__i64 r = lo; r < hi; r++) {
    int j = (int)(r % c);
    float rs = rstd ? rstd[j] : (float)(1.0 / sqrt((double)var[j] + (double)eps));
    float sc = rs * (gamma ? gamma[j] : 1.0f), m = mean[j], bt = beta ? beta[j] : 0.0f;
    const float* xr = x + r * inner;
    float* yr = y + r * inner;
    if (cx->act == UT_ACT_NONE) {
      for (ut__i64 i = 0; i < inner; i++) yr[i] = ut__cpu_bn_z(xr[i], m, sc, bt);
    } else if (cx->act == UT_ACT_RELU || cx->act == UT_ACT_RELU6) {
      float act = cx->act == UT_ACT_RELU6 ? 6.0f : 0.0f;
      for (ut__i64 i = 0; i < inner; i++) yr[i] = ut__cpu_bn_relu(ut__cpu_bn_z(xr[i], m, sc, bt), act);
    } else {
      ut__cpu_bn_apply_act_row(xr, yr, inner, m, sc, bt, cx->act);
    }
  }
}
UT__CPU_OPT static int ut__cpu_bn_apply_f32(const float* x, float* y, const float* mean,
                                            const float* var, const float* gamma, const float* beta,
                                            float* rstd, int n, int c, ut__i64 inner, float eps,
                                            int act) {
  for (int j = 0; j < c; j++) {
    float rs = (float)(1.0 / sqrt((double)var[j] + (double)eps));
    if (rstd) rstd[j] = rs;
  }
  ut__i64 rows = (ut__i64)n * c;
  int nt = ut__cpu_nt((double)rows * inner);
  ut__cpu_bn_ctx cx = {0};
  cx.x = x;
  cx.y = y;
  cx.mean = mean;
  cx.var = var;
  cx.gamma = gamma;
  cx.beta = beta;
  cx.rstd = rstd;
  cx.n = n;
  cx.c = c;
  cx.inner = inner;
  cx.eps = eps;
  cx.act = act;
  ut__parallel_run(nt, ut__cpu_bn_apply_part, &cx);
  return UT_OK;
}

/* bn_bwd's work for threads tid of nt, act (NONE, RELU or RELU6) a constant where it is
   inlined (C's template). The kinds from SILU on come with act NONE: per channel, g = go f'(z)
   is first computed into the thread's scratch (cx->gscratch, ut__cpu_bn_grad_row), which the
   passes then read in place of go: the formula, which costs more than a second read of a
   channel still in cache, runs once per element. */
UT__CPU_INL void ut__cpu_bn_bwd_run(const ut__cpu_bn_ctx* cx, int tid, int nt, const int act) {
  const float* go = cx->go;
  const float* x = cx->x;
  const float* mean = cx->mean;
  const float* rstd = cx->rstd;
  const float* gamma = cx->gamma;
  float* dx = cx->dx;
  float* dgamma = cx->dgamma;
  float* dbeta = cx->dbeta;
  int n = cx->n, c = cx->c;
  ut__i64 inner = cx->inner;
  bool training = cx->training;
  double cnt = cx->sums_in ? (double)cx->sums_in[2 * c] : (double)n * inner;
  ut__i64 lo, hi;
  ut__cpu_part(c, tid, nt, &lo, &hi);
  if (inner < UT__BN_SMALL) {
    ut__cpu_bn_bwd_small(cx, tid, lo, hi, act);
    return;
  }
  for (int j = (int)lo; j < hi; j++) {
    float m = mean[j], rs = rstd[j], gm = gamma ? gamma[j] : 1.0f;
    float sc = rs * gm, bt = cx->beta ? cx->beta[j] : 0.0f; /* as bn_apply */
    /* go's row i of channel j is gb + i gs */
    const float* gb = go + (ut__i64)j * inner;
    ut__i64 gs = (ut__i64)c * inner;
    if (act == UT_ACT_NONE && cx->act >= UT_ACT_SILU) {
      float* sb = cx->gscratch + (size_t)tid * n * inner;
      for (int i = 0; i < n; i++)
        ut__cpu_bn_grad_row(go + ((ut__i64)i * c + j) * inner, x + ((ut__i64)i * c + j) * inner,
                            sb + (ut__i64)i * inner, inner, m, sc, bt, cx->act);
      gb = sb;
      gs = inner;
    }
    double sg = 0.0, sgx = 0.0;
    for (int i = 0; i < (cx->sums_in ? 0 : n); i++) {
      const float* gp = gb + (ut__i64)i * gs;
      const float* xp = x + ((ut__i64)i * c + j) * inner;
      for (ut__i64 i0 = 0; i0 < inner; i0 += 1024) {
        ut__i64 len = UT__CPU_MIN((ut__i64)1024, inner - i0);
        const float* gq = gp + i0;
        const float* xq = xp + i0;
        float l1[16] = {0}, l2[16] = {0};
        ut__i64 t = 0;
        for (; t + 16 <= len; t += 16)
          for (int u = 0; u < 16; u++) {
            float g = ut__cpu_bn_g(gq[t + u], xq[t + u], m, sc, bt, act);
            l1[u] += g;
            l2[u] += g * (xq[t + u] - m);
          }
        float t1 = 0.0f, t2 = 0.0f;
        for (; t < len; t++) {
          float g = ut__cpu_bn_g(gq[t], xq[t], m, sc, bt, act);
          t1 += g;
          t2 += g * (xq[t] - m);
        }
        for (int u = 0; u < 8; u++) {
          l1[u] += l1[u + 8];
          l2[u] += l2[u + 8];
        }
        for (int u = 0; u < 4; u++) {
          l1[u] += l1[u + 4];
          l2[u] += l2[u + 4];
        }
        sg += (double)((l1[0] + l1[2]) + (l1[1] + l1[3])) + (double)t1;
        sgx += (double)((l2[0] + l2[2]) + (l2[1] + l2[3])) + (double)t2;
      }
    }
    sgx *= rs; /* sum(go * xhat) */
    if (cx->sums_in) {
      sg = cx->sums_in[2 * j];
      sgx = cx->sums_in[2 * j + 1];
    }
    if (dgamma) dgamma[j] += (float)sgx;
    if (dbeta) dbeta[j] += (float)sg;
    if (cx->sums_out) {
      cx->sums_out[2 * j] = (float)sg;
      cx->sums_out[2 * j + 1] = (float)sgx;
      continue;
    }
    float k0 = gm * rs;
    float mg = training && cnt > 0 ? (float)(sg / cnt) : 0.0f;
    float mgx = training && cnt > 0 ? (float)(sgx / cnt) : 0.0f;
    for (int i = 0; i < n; i++) {
      float* dp = dx + ((ut__i64)i * c + j) * inner;
      const float* gp = gb + (ut__i64)i * gs;
      const float* xp = x + ((ut__i64)i * c + j) * inner;
      if (training) {
        for (ut__i64 t = 0; t < inner; t++)
          dp[t] = k0 * (ut__cpu_bn_g(gp[t], xp[t], m, sc, bt, act) - mg - (xp[t] - m) * rs * mgx);
      } else {
        for (ut__i64 t = 0; t < inner; t++)
          dp[t] = k0 * ut__cpu_bn_g(gp[t], xp[t], m, sc, bt, act);
      }
    }
  }
}
UT__CPU_ACT_OPT static void ut__cpu_bn_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_bn_ctx* cx = (const ut__cpu_bn_ctx*)vc;
  switch (cx->act) {
    case UT_ACT_RELU: ut__cpu_bn_bwd_run(cx, tid, nt, UT_ACT_RELU); break;
    case UT_ACT_RELU6: ut__cpu_bn_bwd_run(cx, tid, nt, UT_ACT_RELU6); break;
    default: ut__cpu_bn_bwd_run(cx, tid, nt, UT_ACT_NONE); /* and the kinds from SILU on */
  }
}
/* the scratch of ut__cpu_bn_bwd_run for the kinds from SILU on (none for the others) */
static int ut__cpu_bn_scratch(ut__cpu_bn_ctx* cx, int nt) {
  if (cx->act < UT_ACT_SILU) return UT_OK;
  /* per thread: a channel's rows, or a block's runs over small planes (ut__cpu_bn_bwd_small) */
  ut__i64 per = cx->inner < UT__BN_SMALL ? UT__BN_RUN : cx->inner;
  cx->gscratch = (float*)malloc((size_t)nt * cx->n * per * sizeof(float) + 1);
  return cx->gscratch ? UT_OK : ut__set_error(UT_ERR_MEMORY, "bn_bwd: out of memory");
}
UT__CPU_OPT static int ut__cpu_bn_bwd_f32(const float* go, const float* x, const float* mean,
                                          const float* rstd, const float* gamma, const float* beta,
                                          float* dx, float* dgamma, float* dbeta, int n, int c,
                                          ut__i64 inner, bool training, int act) {
  int nt = ut__cpu_nt((double)n * c * inner);
  if (nt > c) nt = c;
  ut__cpu_bn_ctx cx = {0};
  cx.go = go;
  cx.x = x;
  cx.mean = mean;
  cx.rstd = rstd;
  cx.gamma = gamma;
  cx.beta = beta;
  cx.dx = dx;
  cx.dgamma = dgamma;
  cx.dbeta = dbeta;
  cx.n = n;
  cx.c = c;
  cx.inner = inner;
  cx.training = training;
  cx.act = act;
  UT__TRY(ut__cpu_bn_scratch(&cx, nt));
  ut__parallel_run(nt, ut__cpu_bn_bwd_part, &cx);
  free(cx.gscratch);
  return UT_OK;
}
static int ut__cpu_bn_bwd_sums_f32(const float* go, const float* x, const float* mean,
                                   const float* rstd, const float* gamma, const float* beta,
                                   float* sums, float* dgamma, float* dbeta, int n, int c,
                                   ut__i64 inner, int act) {
  int nt = ut__cpu_nt((double)n * c * inner);
  if (nt > c) nt = c;
  ut__cpu_bn_ctx cx = {.go = go, .x = x, .mean = mean, .rstd = rstd, .gamma = gamma,
                       .beta = beta, .dgamma = dgamma, .dbeta = dbeta, .n = n, .c = c,
                       .inner = inner, .act = act, .training = true, .sums_out = sums};
  UT__TRY(ut__cpu_bn_scratch(&cx, nt));
  ut__parallel_run(nt, ut__cpu_bn_bwd_part, &cx);
  free(cx.gscratch);
  sums[2 * c] = (float)((double)n * inner);
  return UT_OK;
}
static int ut__cpu_bn_bwd_dx_f32(const float* go, const float* x, const float* mean,
                                 const float* rstd, const float* gamma, const float* beta,
                                 const float* sums, float* dx, int n, int c, ut__i64 inner,
                                 int act) {
  int nt = ut__cpu_nt((double)n * c * inner);
  if (nt > c) nt = c;
  ut__cpu_bn_ctx cx = {.go = go, .x = x, .mean = mean, .rstd = rstd, .gamma = gamma,
                       .beta = beta, .dx = dx, .n = n, .c = c, .inner = inner, .act = act,
                       .training = true, .sums_in = sums};
  UT__TRY(ut__cpu_bn_scratch(&cx, nt));
  ut__parallel_run(nt, ut__cpu_bn_bwd_part, &cx);
  free(cx.gscratch);
  return UT_OK;
}
static int ut__cpu_bn_sync_pack(const float* mean, const float* var, const float* a, float* out,
                                int c, float count) {
  for (int j = 0; j < c; j++) {
    if (!a) {
      out[j] = count * mean[j];
    } else {
      float d = mean[j] - a[j] / a[c];
      out[j] = count * (var[j] + d * d);
    }
  }
  out[c] = count;
  return UT_OK;
}
static int ut__cpu_bn_sync_unpack(const float* a, const float* b, float* mean, float* var,
                                  float* running_mean, float* running_var, int c,
                                  float momentum) {
  float n = a[c], unbias = (float)((double)n / ((double)n - 1.0));
  for (int j = 0; j < c; j++) {
    mean[j] = a[j] / n;
    var[j] = b[j] / n;
  }
  return ut__cpu_bn_update_running(running_mean, running_var, mean, var, c, momentum, unbias);
}

/* ---- losses --------------------------------------------------------------------------------
   Sums over many items are cut into fixed blocks (at most 256 of them) whose partial sums are
   added in order, independent of the thread count. */
#define UT__CPU_NBLK 256

/* The arguments of the losses; mse: p, t, g; cross-entropy: logits (p), labels (t), g, the
   label smoothing (sc). */
typedef struct {
  const float* p;
  const float* t;
  float* g;
  double* part;
  ut__i64 n, bs;
  int nb, k;
  float sc;
  double inv_n;
} ut__cpu_loss_ctx;
UT__CPU_OPT static void ut__cpu_mse_fwd_part(void* vc, int tid, int nt) {
  const ut__cpu_loss_ctx* c = (const ut__cpu_loss_ctx*)vc;
  const float* p = c->p;
  const float* t = c->t;
  double* part = c->part;
  ut__i64 n = c->n, bs = c->bs;
  ut__i64 blo, bhi;
  ut__cpu_part(c->nb, tid, nt, &blo, &bhi);
  for (int b = (int)blo; b < bhi; b++) {
    ut__i64 lo = (ut__i64)b * bs, hi = UT__CPU_MIN(n, lo + bs);
    double s = 0.0;
    for (ut__i64 i0 = lo; i0 < hi; i0 += 512) {
      ut__i64 i1 = UT__CPU_MIN(hi, i0 + 512);
      float l[16] = {0};
      ut__i64 i = i0;
      for (; i + 16 <= i1; i += 16)
        for (int u = 0; u < 16; u++) {
          float d = p[i + u] - t[i + u];
          l[u] += d * d;
        }
      float tl = 0.0f;
      for (; i < i1; i++) {
        float d = p[i] - t[i];
        tl += d * d;
      }
      for (int u = 0; u < 8; u++) l[u] += l[u + 8];
      for (int u = 0; u < 4; u++) l[u] += l[u + 4];
      s += (double)((l[0] + l[2]) + (l[1] + l[3])) + (double)tl;
    }
    part[b] = s;
  }
}
UT__CPU_OPT static int ut__cpu_mse_fwd(const float* p, const float* t, float* out, ut__i64 n) {
  double part[UT__CPU_NBLK];
  ut__i64 bs = UT__CPU_MAX((ut__i64)4096, (n + UT__CPU_NBLK - 1) / UT__CPU_NBLK);
  int nb = (int)((n + bs - 1) / bs);
  int nt = ut__cpu_nt((double)n);
  ut__cpu_loss_ctx c = {p, t, NULL, part, n, bs, nb, 0, 0.0f, 0.0};
  ut__parallel_run(nt, ut__cpu_mse_fwd_part, &c);
  double s = 0.0;
  for (int b = 0; b < nb; b++) s += part[b];
  out[0] = n > 0 ? (float)(s / (double)n) : 0.0f;
  return UT_OK;
}

UT__CPU_OPT static void ut__cpu_mse_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_loss_ctx* c = (const ut__cpu_loss_ctx*)vc;
  const float* restrict p = c->p;
  const float* restrict t = c->t;
  float* restrict g = c->g;
  float sc = c->sc;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (ut__i64 i = lo; i < hi; i++) g[i] = sc * (p[i] - t[i]);
}
UT__CPU_OPT static int ut__cpu_mse_bwd(const float* restrict p, const float* restrict t,
                                       float* restrict g, ut__i64 n) {
  float sc = n > 0 ? (float)(2.0 / (double)n) : 0.0f;
  int nt = ut__cpu_nt((double)n);
  ut__cpu_loss_ctx c = {p, t, g, NULL, n, 0, 0, 0, sc, 0.0};
  ut__parallel_run(nt, ut__cpu_mse_bwd_part, &c);
  return UT_OK;
}

/* -1 when the label is not an integer in [0, k). */
static inline int ut__cpu_label(float v, int k) {
  if (!(v >= 0.0f) || !((double)v < (double)k) || floorf(v) != v) return -1;
  return (int)v;
}

/* -log softmax(row)[label] with max subtraction, and with label smoothing eps the mix
   (1 - eps) that + eps mean_j(-log softmax(row)[j]); NaN for an invalid label. */
UT__CPU_OPT static double ut__cpu_ce_row(const float* row, int k, int lab, float eps) {
  if (lab < 0) return NAN;
  float mx = row[0];
  for (int j = 1; j < k; j++) mx = row[j] > mx ? row[j] : mx;
  double s = 0.0;
  for (int j = 0; j < k; j++) s += exp((double)(row[j] - mx));
  /* log(s) + mx loses log(s) for mx ~ 1e30: the logits' offsets from mx go in instead */
  if (eps == 0.0f) return log(s) - ((double)row[lab] - (double)mx);
  double all = 0.0;
  for (int j = 0; j < k; j++) all += (double)row[j] - (double)mx;
  return log(s) - (1.0 - (double)eps) * ((double)row[lab] - (double)mx) - (double)eps * all / k;
}

static void ut__cpu_ce_fwd_part(void* vc, int tid, int nt) {
  const ut__cpu_loss_ctx* c = (const ut__cpu_loss_ctx*)vc;
  const float* logits = c->p;
  const float* labels = c->t;
  double* part = c->part;
  int n = (int)c->n, k = c->k, bs = (int)c->bs;
  ut__i64 blo, bhi;
  ut__cpu_part(c->nb, tid, nt, &blo, &bhi);
  for (int b = (int)blo; b < bhi; b++) {
    int lo = b * bs, hi = UT__CPU_MIN(n, lo + bs);
    double s = 0.0;
    for (int i = lo; i < hi; i++)
      s += ut__cpu_ce_row(logits + (ut__i64)i * k, k, ut__cpu_label(labels[i], k), c->sc);
    part[b] = s;
  }
}
static int ut__cpu_ce_fwd(const float* logits, const float* labels, float* out, int n, int k,
                          float eps) {
  double part[UT__CPU_NBLK];
  int bs = UT__CPU_MAX(1, (n + UT__CPU_NBLK - 1) / UT__CPU_NBLK);
  int nb = (n + bs - 1) / bs;
  int nt = ut__cpu_nt((double)n * k * 4);
  if (nt > nb) nt = nb;
  ut__cpu_loss_ctx c = {logits, labels, NULL, part, n, bs, nb, k, eps, 0.0};
  ut__parallel_run(nt, ut__cpu_ce_fwd_part, &c);
  double s = 0.0;
  for (int b = 0; b < nb; b++) s += part[b];
  out[0] = n > 0 ? (float)(s / n) : 0.0f;
  return UT_OK;
}

UT__CPU_OPT static void ut__cpu_ce_bwd_part(void* vc, int tid, int nt) {
  const ut__cpu_loss_ctx* c = (const ut__cpu_loss_ctx*)vc;
  const float* logits = c->p;
  const float* labels = c->t;
  float* g = c->g;
  int k = c->k;
  double inv_n = c->inv_n;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (int i = (int)lo; i < hi; i++) {
    const float* row = logits + (ut__i64)i * k;
    float* gr = g + (ut__i64)i * k;
    int lab = ut__cpu_label(labels[i], k);
    if (lab < 0) {
      for (int j = 0; j < k; j++) gr[j] = NAN;
      continue;
    }
    float mx = row[0];
    for (int j = 1; j < k; j++) mx = row[j] > mx ? row[j] : mx;
    double s = 0.0;
    for (int j = 0; j < k; j++) s += exp((double)(row[j] - mx));
    double sc = inv_n / s;
    if (c->sc == 0.0f) {
      for (int j = 0; j < k; j++) gr[j] = (float)(exp((double)(row[j] - mx)) * sc);
      gr[lab] -= (float)inv_n;
    } else { /* the smoothed target (1 - eps) onehot + eps / K, subtracted in double */
      double eps = c->sc, off = eps / k * inv_n;
      for (int j = 0; j < k; j++) gr[j] = (float)(exp((double)(row[j] - mx)) * sc - off);
      gr[lab] = (float)(exp((double)(row[lab] - mx)) * sc - off - (1.0 - eps) * inv_n);
    }
  }
}
UT__CPU_OPT static int ut__cpu_ce_bwd(const float* logits, const float* labels, float* g, int n,
                                      int k, float eps) {
  int nt = ut__cpu_nt((double)n * k * 4);
  if (nt > n) nt = n;
  double inv_n = 1.0 / (n > 0 ? n : 1);
  ut__cpu_loss_ctx c = {logits, labels, g, NULL, n, 0, 0, k, eps, inv_n};
  ut__parallel_run(nt, ut__cpu_ce_bwd_part, &c);
  return UT_OK;
}

/* ---- regularisation ------------------------------------------------------------------------- */
typedef struct {
  float* x;
  const float* s;
  ut__i64 n, inner;
} ut__cpu_mask_scale_ctx;
UT__CPU_OPT static void ut__cpu_mask_scale_part(void* vc, int tid, int nt) {
  const ut__cpu_mask_scale_ctx* c = (const ut__cpu_mask_scale_ctx*)vc;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (ut__i64 i = lo; i < hi; i++) c->x[i] *= c->s[i / c->inner];
}
static int ut__cpu_mask_scale_f32(float* x, const float* s, ut__i64 n, ut__i64 inner) {
  ut__cpu_mask_scale_ctx c = {x, s, n, inner};
  ut__parallel_run(ut__cpu_nt((double)n), ut__cpu_mask_scale_part, &c);
  return UT_OK;
}

typedef struct {
  float* a;
  const float* b;
  ut__i64 n;
  float w;
} ut__cpu_lerp_ctx;
UT__CPU_OPT static void ut__cpu_lerp_part(void* vc, int tid, int nt) {
  const ut__cpu_lerp_ctx* c = (const ut__cpu_lerp_ctx*)vc;
  float w = c->w, omw = 1.0f - w;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  if (w < 0.5f) {
    for (ut__i64 i = lo; i < hi; i++) c->a[i] = c->a[i] + w * (c->b[i] - c->a[i]);
  } else {
    for (ut__i64 i = lo; i < hi; i++) c->a[i] = c->b[i] - (c->b[i] - c->a[i]) * omw;
  }
}
static int ut__cpu_lerp(float* a, const float* b, ut__i64 n, float w) {
  ut__cpu_lerp_ctx c = {a, b, n, w};
  ut__parallel_run(ut__cpu_nt((double)n), ut__cpu_lerp_part, &c);
  return UT_OK;
}

/* ---- optimizers ----------------------------------------------------------------------------- */

/* The optimizers' arguments (sgd: v is the momentum buffer or NULL; adam: m and v). */
typedef struct {
  float* p;
  const float* g;
  float* m;
  float* v;
  ut__i64 n;
  ut__sgd_hp sgd;
  ut__adam_hp adam;
} ut__cpu_optim_ctx;
/* elements [lo, hi) of one parameter: the one-tensor and the many-tensor steps share it. The
   plain case (no decay, no dampening, no Nesterov) keeps its own loop: it is every step of the
   seed's SGD, and its rounding stays the one it always had. */
UT__CPU_OPT static inline void ut__cpu_sgd_range(float* restrict p, const float* restrict g,
                                                 float* restrict v, ut__i64 lo, ut__i64 hi,
                                                 ut__sgd_hp h) {
  float lr = h.lr, momentum = h.momentum;
  if (h.weight_decay != 0.f || h.dampening != 0.f || h.nesterov) {
    float wd = h.weight_decay, keep = 1.f - h.dampening;
    for (ut__i64 i = lo; i < hi; i++) {
      float d = wd != 0.f ? g[i] + wd * p[i] : g[i];
      if (v) {
        float vi = momentum * v[i] + keep * d;
        v[i] = vi;
        d = h.nesterov ? d + momentum * vi : vi;
      }
      p[i] -= lr * d;
    }
  } else if (v) {
    for (ut__i64 i = lo; i < hi; i++) {
      float vi = momentum * v[i] + g[i];
      v[i] = vi;
      p[i] -= lr * vi;
    }
  } else {
    for (ut__i64 i = lo; i < hi; i++) p[i] -= lr * g[i];
  }
}
UT__CPU_OPT static void ut__cpu_sgd_part(void* vc, int tid, int nt) {
  const ut__cpu_optim_ctx* c = (const ut__cpu_optim_ctx*)vc;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  ut__cpu_sgd_range(c->p, c->g, c->v, lo, hi, c->sgd);
}
UT__CPU_OPT static int ut__cpu_sgd(float* restrict p, const float* restrict g, float* restrict v,
                                   ut__i64 n, ut__sgd_hp h) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_optim_ctx c;
  memset(&c, 0, sizeof c);
  c.p = p, c.g = g, c.v = v, c.n = n, c.sgd = h;
  ut__parallel_run(nt, ut__cpu_sgd_part, &c);
  return UT_OK;
}

/* Many tensors in one parallel run: the parts cut the tensors' elements laid end to end, so a
   network's hundred small parameters cost one wake-up of the pool, not a hundred. */
typedef struct {
  float* const* p;
  const float* const* g;
  float* const* v;
  const ut__i64* n;
  int count;
  ut__i64 total;
  ut__sgd_hp h;
  float value;
  bool fill;
} ut__cpu_many_ctx;
/* x[a, b) = value. Long ranges (zero_grad over a network's gradients: ConvNeXt-tiny's 114 MB
   took 9.8 ms of a 200 ms CPU step) with streaming stores, which skip reading each line
   before writing it: the lines go to memory, not to the cache that the range would overflow. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__SSE__) && defined(__x86_64__)
#define UT__CPU_STREAM_FILL 1
typedef float ut__v4f __attribute__((vector_size(16)));
#endif
#define UT__CPU_STREAM_MIN (1 << 16) /* floats: below, the range may well be read again soon */
UT__CPU_OPT static void ut__cpu_fill_range(float* restrict x, ut__i64 a, ut__i64 b, float value) {
#ifdef UT__CPU_STREAM_FILL
  if (b - a >= UT__CPU_STREAM_MIN) {
    for (; a < b && ((uintptr_t)(x + a) & 15) != 0; a++) x[a] = value;
    ut__v4f v = {value, value, value, value};
    for (; a + 4 <= b; a += 4) __builtin_ia32_movntps(x + a, v);
    __builtin_ia32_sfence(); /* ordered before the pool reports the part done */
  }
#endif
  for (ut__i64 i = a; i < b; i++) x[i] = value;
}
UT__CPU_OPT static void ut__cpu_many_part(void* vc, int tid, int nt) {
  const ut__cpu_many_ctx* c = (const ut__cpu_many_ctx*)vc;
  ut__i64 lo, hi, base = 0;
  ut__cpu_part(c->total, tid, nt, &lo, &hi);
  for (int t = 0; t < c->count && base < hi; base += c->n[t], t++) {
    ut__i64 a = lo > base ? lo - base : 0, b = hi - base < c->n[t] ? hi - base : c->n[t];
    if (a >= b) continue;
    if (c->fill) {
      ut__cpu_fill_range(c->p[t], a, b, c->value);
    } else {
      ut__cpu_sgd_range(c->p[t], c->g[t], c->v ? c->v[t] : NULL, a, b, c->h);
    }
  }
}
static int ut__cpu_many_run(ut__cpu_many_ctx* c) {
  c->total = 0;
  for (int t = 0; t < c->count; t++) c->total += c->n[t];
  ut__parallel_run(ut__cpu_nt((double)c->total), ut__cpu_many_part, c);
  return UT_OK;
}
static int ut__cpu_sgd_many(float* const* p, const float* const* g, float* const* v,
                            const ut__i64* n, int count, ut__sgd_hp h) {
  ut__cpu_many_ctx c = {p, g, v, n, count, 0, h, 0.0f, false};
  return ut__cpu_many_run(&c);
}
static int ut__cpu_fill_many(float* const* x, const ut__i64* n, int count, float value) {
  ut__sgd_hp none = {0.f, 0.f, 0.f, 0.f, false};
  ut__cpu_many_ctx c = {x, NULL, NULL, n, count, 0, none, value, true};
  return ut__cpu_many_run(&c);
}

/* m = lerp(m, g, w) as PyTorch's lerp_ computes it (the exp_avg update), so both round alike */
static inline float ut__cpu_lerp1(float m, float g, float w) {
  float d = g - m;
  return fabsf(w) < 0.5f ? m + w * d : g - d * (1.0f - w);
}
UT__CPU_OPT static void ut__cpu_adam_part(void* vc, int tid, int nt) {
  const ut__cpu_optim_ctx* c = (const ut__cpu_optim_ctx*)vc;
  float* restrict p = c->p;
  const float* restrict g = c->g;
  float* restrict m = c->m;
  float* restrict v = c->v;
  ut__adam_hp h = c->adam;
  ut__i64 lo, hi;
  ut__cpu_part(c->n, tid, nt, &lo, &hi);
  for (ut__i64 i = lo; i < hi; i++) {
    float pi = p[i];
    if (h.decay != 1.0f) pi *= h.decay; /* AdamW: decoupled decay first, as PyTorch's mul_ */
    float gi = h.weight_decay != 0.0f ? g[i] + h.weight_decay * pi : g[i];
    float mi = ut__cpu_lerp1(m[i], gi, h.omb1);
    float vi = h.b2 * v[i] + h.omb2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - h.step_size * (mi / (sqrtf(vi) / h.sqrt_bc2 + h.eps));
  }
}
/* PyTorch's order: (1-b2)*g*g scales before squaring, and the bias corrections divide after
   the square root and outside m/denom, so v/bc2 and lr*m never overflow on their own */
UT__CPU_OPT static int ut__cpu_adam(float* restrict p, const float* restrict g, float* restrict m,
                                    float* restrict v, ut__i64 n, ut__adam_hp h) {
  int nt = ut__cpu_nt((double)n);
  ut__cpu_optim_ctx c;
  memset(&c, 0, sizeof c);
  c.p = p, c.g = g, c.m = m, c.v = v, c.n = n, c.adam = h;
  ut__parallel_run(nt, ut__cpu_adam_part, &c);
  return UT_OK;
}

/* ---- the slots: one per op, dt switched here -------------------------------------------------
   The table's element-typed slots (BACKEND INTERFACE) land here and go on to the float32
   kernels above. The CPU computes a bf16 tensor on its float32 host copy (the core rounds what
   it wrote), so UT_F32 is the one type it is given; any other is refused, not guessed at. */
static int ut__cpu_no_dtype(const char* op, ut_dtype dt) {
  return ut__set_error(UT_ERR_ARG,
                       "cpu %s: element type %s (%d) has no kernel here (the CPU backend "
                       "computes on float32 host copies)",
                       op, ut_dtype_name(dt), (int)dt);
}
static int ut__cpu_fill(ut_dtype dt, void* x, ut__i64 n, float v) {
  return dt == UT_F32 ? ut__cpu_fill_f32(x, n, v) : ut__cpu_no_dtype("fill", dt);
}
static int ut__cpu_copy2d(ut_dtype dt, const void* src, ut__i64 src_ld, void* dst,
                          ut__i64 dst_ld, int rows, ut__i64 cols) {
  if (dt != UT_F32) return ut__cpu_no_dtype("copy2d", dt);
  for (int r = 0; r < rows; ++r)
    memmove((float*)dst + r * dst_ld, (const float*)src + r * src_ld,
            (size_t)cols * sizeof(float));
  return UT_OK;
}
static int ut__cpu_cast(ut_dtype src_dt, ut_dtype dst_dt, const void* src, void* dst,
                        ut__i64 n) {
  if (src_dt != UT_F32) return ut__cpu_no_dtype("cast", src_dt);
  return dst_dt == UT_F32 ? ut__cpu_copy(dst, src, n) : ut__cpu_no_dtype("cast", dst_dt);
}
static int ut__cpu_axpy(ut_dtype dt, void* y, const void* x, ut__i64 n, float alpha) {
  return dt == UT_F32 ? ut__cpu_axpy_f32(y, x, n, alpha) : ut__cpu_no_dtype("axpy", dt);
}
static int ut__cpu_scale(ut_dtype dt, void* x, ut__i64 n, float alpha) {
  return dt == UT_F32 ? ut__cpu_scale_f32(x, n, alpha) : ut__cpu_no_dtype("scale", dt);
}
static int ut__cpu_mask_scale(ut_dtype dt, void* x, const float* s, ut__i64 n, ut__i64 inner) {
  return dt == UT_F32 ? ut__cpu_mask_scale_f32(x, s, n, inner)
                      : ut__cpu_no_dtype("mask_scale", dt);
}
static int ut__cpu_relu_fwd(ut_dtype dt, const void* x, void* y, ut__i64 n, float cap) {
  return dt == UT_F32 ? ut__cpu_relu_fwd_f32(x, y, n, cap) : ut__cpu_no_dtype("relu_fwd", dt);
}
static int ut__cpu_relu_bwd(ut_dtype dt, const void* go, const void* x, void* gi, ut__i64 n,
                            float cap) {
  return dt == UT_F32 ? ut__cpu_relu_bwd_f32(go, x, gi, n, cap)
                      : ut__cpu_no_dtype("relu_bwd", dt);
}
static int ut__cpu_act_fwd(ut_dtype dt, int act, const void* x, void* y, ut__i64 n) {
  return dt == UT_F32 ? ut__cpu_act_fwd_f32(act, x, y, n) : ut__cpu_no_dtype("act_fwd", dt);
}
static int ut__cpu_act_bwd(ut_dtype dt, int act, const void* go, const void* x, void* gi,
                           ut__i64 n) {
  return dt == UT_F32 ? ut__cpu_act_bwd_f32(act, go, x, gi, n) : ut__cpu_no_dtype("act_bwd", dt);
}
static int ut__cpu_transpose(ut_dtype dt, const void* in, void* out, int outer, int d0, int mid,
                             int d1, int inner) {
  return dt == UT_F32 ? ut__cpu_transpose_f32(in, out, outer, d0, mid, d1, inner)
                      : ut__cpu_no_dtype("transpose", dt);
}
static int ut__cpu_gemm(ut_dtype ab_dt, ut_dtype c_dt, const ut__gemm_args* g) {
  if (ab_dt != UT_F32) return ut__cpu_no_dtype("gemm", ab_dt);
  return c_dt == UT_F32 ? ut__cpu_gemm_f32(g) : ut__cpu_no_dtype("gemm", c_dt);
}
static int ut__cpu_bias_add(ut_dtype dt, void* x, const float* bias, int n, int c,
                            ut__i64 inner) {
  return dt == UT_F32 ? ut__cpu_bias_add_f32(x, bias, n, c, inner)
                      : ut__cpu_no_dtype("bias_add", dt);
}
static int ut__cpu_channel_sum(ut_dtype dt, const void* x, float* out, int n, int c,
                               ut__i64 inner, float beta) {
  return dt == UT_F32 ? ut__cpu_channel_sum_f32(x, out, n, c, inner, beta)
                      : ut__cpu_no_dtype("channel_sum", dt);
}
static int ut__cpu_row_mean(ut_dtype dt, const void* x, void* y, int rows, ut__i64 cols) {
  return dt == UT_F32 ? ut__cpu_row_mean_f32(x, y, rows, cols) : ut__cpu_no_dtype("row_mean", dt);
}
static int ut__cpu_row_mean_bwd(ut_dtype dt, const void* go, void* dx, int rows, ut__i64 cols) {
  return dt == UT_F32 ? ut__cpu_row_mean_bwd_f32(go, dx, rows, cols)
                      : ut__cpu_no_dtype("row_mean_bwd", dt);
}
/* after the dense conv's GEMM (see the slot): the forward redone when a weight is not finite,
   dW summed over real input when grad_out is not (the GEMM's part then unused) */
static int ut__cpu_conv_exact(ut_dtype dt, ut__conv_dir dir, const void* x, const void* go,
                             const void* w, const float* bias, const float* part, void* dst,
                             int out_c, const ut__conv_geom* g) {
  if (dt != UT_F32) return ut__cpu_no_dtype("conv_exact", dt);
  ut__i64 K = (ut__i64)g->c * g->kh * g->kw;
  if (dir == UT__CONV_Y) {
    if (!ut__cpu_all_finite(w, out_c * K))
      ut__cpu_conv_real_input(UT__CONV_Y, x, NULL, w, bias, dst, out_c, false, g);
    return UT_OK;
  }
  if (dir != UT__CONV_DW) return ut__set_error(UT_ERR_ARG, "conv_exact: no dx pass");
  float* dw = (float*)dst;
  if (ut__cpu_all_finite(go, (ut__i64)g->n * out_c * g->ho * g->wo))
    for (ut__i64 i = 0; i < out_c * K; i++) dw[i] += part[i];
  else
    ut__cpu_conv_real_input(UT__CONV_DW, x, go, NULL, NULL, dw, out_c, false, g);
  return UT_OK;
}
static int ut__cpu_im2col(ut_dtype dt, const void* x, void* col, const ut__conv_geom* g) {
  return dt == UT_F32 ? ut__cpu_im2col_f32(x, col, g) : ut__cpu_no_dtype("im2col", dt);
}
static int ut__cpu_col2im(ut_dtype dt, const void* col, void* dx, const ut__conv_geom* g) {
  return dt == UT_F32 ? ut__cpu_col2im_f32(col, dx, g) : ut__cpu_no_dtype("col2im", dt);
}
static int ut__cpu_dw_fwd(ut_dtype dt, const void* x, const float* w, const float* bias, void* y,
                          const ut__conv_geom* g) {
  return dt == UT_F32 ? ut__cpu_dw_fwd_f32(x, w, bias, y, g) : ut__cpu_no_dtype("dw_fwd", dt);
}
/* ---- inference's depthwise-separable block (issue 32) ---------------------------------------
   Bands, for large planes with an expand of 4x or more (an image's expanded and depthwise planes
   above UT__SEP_BANDS_ABOVE floats: MobileNetV2's first stages). Each task is one band of output
   rows of one image, run by one thread in steps of T rows: the expand GEMM writes the input rows
   the step's depthwise windows need into a tile [e][rows][w] (rows outside the image zeroed: the
   depthwise then runs with no vertical padding), the depthwise row engine writes [e][T][wo], and
   the project GEMM writes the output rows in place, the residual added while they are in cache.
   Consecutive steps share (extent - stride) input rows, copied from the previous tile (two tiles
   alternate). The tiles are sized to stay in L2 (UT__SEP_TILE_FLOATS per thread). Other blocks are
   left to the core (ut__cpu_sep_takes). */
#define UT__SEP_TILE_FLOATS (384 * 1024)
#define UT__SEP_BANDS_ABOVE (512 * 1024)

typedef struct {
  const ut__sep_args* a;
  int bands, T, rows_cap;
  ut__i64 tasks, per; /* per: scratch floats per thread */
  float* scratch;
  atomic_llong next;
  atomic_int status;
  char msg[512]; /* the first failing task's message (errors are per thread) */
} ut__cpu_sep_ctx;

/* GEMM C[m, n] = act(scale A[m, k] B[k, n] + shift) with B's rows ldb apart (a tile or x's
   rows), into C's rows ldc apart. */
static int ut__cpu_sep_gemm(const float* A, ut_tensor* a_owner, int m, int k, const float* B,
                            int ldb, int n, float* C, int ldc, const float* scale,
                            const float* shift, int act) {
  ut__gemm_args g;
  memset(&g, 0, sizeof g);
  g.a_owner = a_owner;
  g.m = m;
  g.n = n;
  g.k = k;
  g.batch = 1;
  g.alpha = 1.0f;
  g.a = A;
  g.lda = k;
  g.b = B;
  g.ldb = ldb;
  g.c = C;
  g.ldc = ldc;
  g.row_scale = scale;
  g.row_shift = shift;
  g.act = act;
  return ut__cpu_gemm_f32(&g);
}

/* Output rows [oy_a, oy_b) of image img, in steps. */
static int ut__cpu_sep_band(const ut__cpu_sep_ctx* cx, int img, int oy_a, int oy_b, float* buf) {
  const ut__sep_args* a = cx->a;
  const ut__conv_geom* g = &a->gd;
  int e = g->c, h = g->h, w = g->w, s = g->stride, ho = g->ho, wo = g->wo, ext = g->kh;
  ut__i64 cap = (ut__i64)cx->rows_cap * w;
  float* tiles[2] = {buf, buf + e * cap};
  float* dwo = buf + 2 * e * cap; /* [e][T][wo] */
  const float* x = a->x + (ut__i64)img * a->c * h * w;
  float* y = a->y + (ut__i64)img * a->oc * ho * wo;
  int prev_lo = 0, prev_rows = 0, step = 0;
  for (int oy0 = oy_a; oy0 < oy_b; oy0 += cx->T, step++) {
    int t = UT__CPU_MIN(cx->T, oy_b - oy0);
    int lo = oy0 * s - g->pad, rows = (t - 1) * s + ext;
    float* cur = tiles[step & 1];
    const float* prev = tiles[(step & 1) ^ 1];
    ut__i64 rw = (ut__i64)rows * w;
    /* the rows this step shares with the last */
    int keep = step > 0 ? UT__CPU_MAX(0, UT__CPU_MIN(prev_lo + prev_rows, lo + rows) - lo) : 0;
    if (keep > 0)
      for (int c = 0; c < e; c++)
        memcpy(cur + c * rw, prev + (ut__i64)c * prev_rows * w + (ut__i64)(lo - prev_lo) * w,
               sizeof(float) * (size_t)keep * w);
    int r0 = lo + keep, r1 = lo + rows;                         /* new input rows */
    int i0 = UT__CPU_MAX(r0, 0), i1 = UT__CPU_MIN(r1, h);       /* of them, inside the image */
    if (i1 < i0) i0 = i1 = UT__CPU_MAX(r0, UT__CPU_MIN(r1, h)); /* none inside */
    for (int c = 0; c < e; c++) {
      float* tc = cur + c * rw;
      if (i0 > r0) memset(tc + (ut__i64)(r0 - lo) * w, 0, sizeof(float) * (size_t)(i0 - r0) * w);
      if (r1 > i1) memset(tc + (ut__i64)(i1 - lo) * w, 0, sizeof(float) * (size_t)(r1 - i1) * w);
    }
    if (i1 > i0) {
      int st = ut__cpu_sep_gemm(a->we, a->we_owner, e, a->c, x + (ut__i64)i0 * w, h * w,
                                (i1 - i0) * w, cur + (ut__i64)(i0 - lo) * w, (int)rw, a->escale,
                                a->eshift, a->eact);
      if (st < 0) return st;
    }
    /* the depthwise over the tile: rows input rows, t output rows, no vertical padding */
    ut__dwctx C;
    ut__cpu_dw_forward_ctx(&C, cur, a->wd, a->dshift, dwo, g, a->dact);
    C.h = rows;
    C.py = 0;
    C.ho = t;
    C.planes = e;
    int st = ut__cpu_dw_planes(&C, false, (double)e * t * wo * g->kh * g->kw / 4,
                               "ut_separable_block_forward");
    if (st < 0) return st;
    float* yr = y + (ut__i64)oy0 * wo;
    st = ut__cpu_sep_gemm(a->wp, a->wp_owner, a->oc, e, dwo, t * wo, t * wo, yr, ho * wo,
                          a->pscale, a->pshift, a->pact);
    if (st < 0) return st;
    if (a->residual) /* oc == c, ho == h, wo == w */
      for (int c = 0; c < a->oc; c++) {
        float* restrict yc = yr + (ut__i64)c * ho * wo;
        const float* restrict xc = x + (ut__i64)c * h * w + (ut__i64)oy0 * w;
        for (ut__i64 i = 0; i < (ut__i64)t * wo; i++) yc[i] += xc[i];
      }
    prev_lo = lo;
    prev_rows = rows;
  }
  return UT_OK;
}

static void ut__cpu_sep_part(void* vc, int tid, int nt) {
  ut__cpu_sep_ctx* cx = (ut__cpu_sep_ctx*)vc;
  (void)nt;
  bool was = ut__cpu_one_thread;
  ut__cpu_one_thread = true;
  float* buf = cx->scratch + (ut__i64)tid * cx->per;
  int ho = cx->a->gd.ho;
  for (ut__i64 t = ut__cpu_next_task(&cx->next); t < cx->tasks; t = ut__cpu_next_task(&cx->next)) {
    int img = (int)(t / cx->bands), band = (int)(t % cx->bands);
    int oy_a = (int)((ut__i64)ho * band / cx->bands);
    int oy_b = (int)((ut__i64)ho * (band + 1) / cx->bands);
    if (oy_b > oy_a && ut__cpu_sep_band(cx, img, oy_a, oy_b, buf) < 0) {
      int ok = UT_OK;
      if (atomic_compare_exchange_strong(&cx->status, &ok, ut_last_status()))
        snprintf(cx->msg, sizeof cx->msg, "%s", ut_last_error());
      break;
    }
  }
  ut__cpu_one_thread = was;
}

/* Bands pay where the block expands large planes: the expanded tensor, six times the input,
   then never goes to memory (MobileNetV2 224^2, 2 cores, the 112^2 and 56^2 blocks 15-25%
   faster). Elsewhere they cost: over small planes they cut the GEMMs' columns short and pack
   every weight once per band (14^2 and 7^2 blocks 5-10% slower), and without an expand the
   depthwise's output is all they keep from memory (MobileNet v1 224^2 4-6% slower whole), nor
   with an expansion below 4 (MNASNet's 3x blocks at 112^2: its network 5% slower at batch 1).
   Those blocks take the layers' own folded forwards. */
static bool ut__cpu_sep_takes(const ut__conv_geom* g, int c, bool expand) {
  ut__i64 e = g->c;
  return expand && e >= 4LL * c &&
         e * ((ut__i64)g->h * g->w + (ut__i64)g->ho * g->wo) > UT__SEP_BANDS_ABOVE;
}

static int ut__cpu_sep_fwd(const ut__sep_args* a) {
  const ut__conv_geom* g = &a->gd;
  int e = g->c, s = g->stride, ext = g->kh;
  if (g->n <= 0 || g->ho <= 0 || g->wo <= 0) return UT_OK;
  double macs = (double)g->n * g->ho * g->wo * e * (a->oc + g->kh * g->kw) +
                (double)g->n * g->h * g->w * e * a->c;
  int nt = ut__cpu_nt(macs / 4);
  ut__i64 per_row = (ut__i64)e * (2LL * s * g->w + g->wo);
  /* bands: one per image, or an image cut in enough bands for every thread */
  int bands = g->n >= nt ? 1 : UT__CPU_MIN(g->ho, (nt + g->n - 1) / g->n);
  int band_rows = (g->ho + bands - 1) / bands;
  /* output rows a step: the two input tiles and the depthwise's rows within the budget */
  int T = (int)UT__CPU_MAX(1, UT__CPU_MIN((ut__i64)band_rows, UT__SEP_TILE_FLOATS / per_row));
  int rows_cap = (T - 1) * s + ext;
  ut__i64 per = UT__DW_R16(2LL * e * rows_cap * g->w + (ut__i64)e * T * g->wo);
  ut__i64 tasks = (ut__i64)g->n * bands;
  if (nt > tasks) nt = (int)tasks;
  /* from the host cache, as tensors are: a fresh block of megabytes would be page faults on
     every call */
  size_t bytes = sizeof(float) * (size_t)(per * nt);
  float* scratch = ut__host_alloc(bytes);
  ut__cpu_sep_ctx* cx = scratch ? (ut__cpu_sep_ctx*)calloc(1, sizeof *cx) : NULL;
  if (!cx) {
    ut__host_release(scratch, bytes);
    return ut__set_error(UT_ERR_MEMORY, "ut_separable_block_forward: out of memory");
  }
  cx->a = a;
  cx->bands = bands;
  cx->T = T;
  cx->rows_cap = rows_cap;
  cx->tasks = tasks;
  cx->per = per;
  cx->scratch = scratch;
  atomic_init(&cx->next, 0);
  atomic_init(&cx->status, UT_OK);
  ut__parallel_run(nt, ut__cpu_sep_part, cx);
  int st = atomic_load(&cx->status);
  if (st < 0) ut__set_error(st, "%s", cx->msg);
  free(cx);
  ut__host_release(scratch, bytes);
  return st < 0 ? st : UT_OK;
}

static int ut__cpu_dw_fwd_act(ut_dtype dt, const void* x, const float* w, const float* bias,
                              void* y, const ut__conv_geom* g, int act) {
  return dt == UT_F32 ? ut__cpu_dw_fwd_act_f32(x, w, bias, y, g, act)
                      : ut__cpu_no_dtype("dw_fwd_act", dt);
}
static int ut__cpu_dw_bwd_dx(ut_dtype dt, const void* go, const float* w, void* dx,
                             const ut__conv_geom* g) {
  return dt == UT_F32 ? ut__cpu_dw_bwd_dx_f32(go, w, dx, g) : ut__cpu_no_dtype("dw_bwd_dx", dt);
}
static int ut__cpu_dw_bwd_dw(ut_dtype dt, const void* go, const void* x, float* dw,
                             const ut__conv_geom* g) {
  return dt == UT_F32 ? ut__cpu_dw_bwd_dw_f32(go, x, dw, g) : ut__cpu_no_dtype("dw_bwd_dw", dt);
}
static int ut__cpu_chan_repeat(ut_dtype dt, const void* x, void* y, int n, int c, int m,
                               ut__i64 inner) {
  return dt == UT_F32 ? ut__cpu_chan_repeat_f32(x, y, n, c, m, inner)
                      : ut__cpu_no_dtype("chan_repeat", dt);
}
static int ut__cpu_chan_group_sum(ut_dtype dt, const void* x, void* y, int n, int c, int m,
                                  ut__i64 inner) {
  return dt == UT_F32 ? ut__cpu_chan_group_sum_f32(x, y, n, c, m, inner)
                      : ut__cpu_no_dtype("chan_group_sum", dt);
}
static int ut__cpu_bn_stats(ut_dtype dt, const void* x, float* mean, float* var, int n, int c,
                            ut__i64 inner) {
  return dt == UT_F32 ? ut__cpu_bn_stats_f32(x, mean, var, n, c, inner)
                      : ut__cpu_no_dtype("bn_stats", dt);
}
static int ut__cpu_bn_apply(ut_dtype dt, const void* x, void* y, const float* mean,
                            const float* var, const float* gamma, const float* beta, float* rstd,
                            int n, int c, ut__i64 inner, float eps, int act) {
  return dt == UT_F32
             ? ut__cpu_bn_apply_f32(x, y, mean, var, gamma, beta, rstd, n, c, inner, eps, act)
             : ut__cpu_no_dtype("bn_apply", dt);
}
static int ut__cpu_bn_bwd(ut_dtype dt, const void* go, const void* x, const float* mean,
                          const float* rstd, const float* gamma, const float* beta, void* dx,
                          float* dgamma, float* dbeta, int n, int c, ut__i64 inner,
                          bool training, int act) {
  return dt == UT_F32 ? ut__cpu_bn_bwd_f32(go, x, mean, rstd, gamma, beta, dx, dgamma, dbeta, n,
                                           c, inner, training, act)
                      : ut__cpu_no_dtype("bn_bwd", dt);
}
static int ut__cpu_bn_bwd_sums(ut_dtype dt, const void* go, const void* x, const float* mean,
                               const float* rstd, const float* gamma, const float* beta,
                               float* sums, float* dgamma, float* dbeta, int n, int c,
                               ut__i64 inner, int act) {
  return dt == UT_F32 ? ut__cpu_bn_bwd_sums_f32(go, x, mean, rstd, gamma, beta, sums, dgamma,
                                                dbeta, n, c, inner, act)
                      : ut__cpu_no_dtype("bn_bwd_sums", dt);
}
static int ut__cpu_bn_bwd_dx(ut_dtype dt, const void* go, const void* x, const float* mean,
                             const float* rstd, const float* gamma, const float* beta,
                             const float* sums, void* dx, int n, int c, ut__i64 inner,
                             int act) {
  return dt == UT_F32 ? ut__cpu_bn_bwd_dx_f32(go, x, mean, rstd, gamma, beta, sums, dx, n, c,
                                              inner, act)
                      : ut__cpu_no_dtype("bn_bwd_dx", dt);
}

/* channel scales and LayerNorm2d (issue 30) */
static int ut__cpu_chan_scale(ut_dtype dt, ut_dtype s_dt, const void* x, const void* s, void* y,
                              int n, int c, ut__i64 inner, bool shared) {
  if (s_dt != UT_F32) return ut__cpu_no_dtype("chan_scale", s_dt);
  return dt == UT_F32 ? ut__cpu_chan_scale_f32(x, s, y, n, c, inner, shared)
                      : ut__cpu_no_dtype("chan_scale", dt);
}
static int ut__cpu_chan_dot(ut_dtype dt, const void* a, const void* b, float* out, int n, int c,
                            ut__i64 inner, bool shared, float beta) {
  return dt == UT_F32 ? ut__cpu_chan_dot_f32(a, b, out, n, c, inner, shared, beta)
                      : ut__cpu_no_dtype("chan_dot", dt);
}
static int ut__cpu_ln2d_fwd(ut_dtype dt, const void* x, const float* gamma, const float* beta,
                            void* y, float* mean, float* rstd, int n, int c, ut__i64 inner,
                            float eps) {
  return dt == UT_F32 ? ut__cpu_ln2d_fwd_f32(x, gamma, beta, y, mean, rstd, n, c, inner, eps)
                      : ut__cpu_no_dtype("ln2d_fwd", dt);
}
static int ut__cpu_ln2d_bwd(ut_dtype dt, const void* go, const void* x, const float* gamma,
                            const float* mean, const float* rstd, void* dx, float* dgamma,
                            float* dbeta, int n, int c, ut__i64 inner) {
  return dt == UT_F32 ? ut__cpu_ln2d_bwd_f32(go, x, gamma, mean, rstd, dx, dgamma, dbeta, n, c,
                                             inner)
                      : ut__cpu_no_dtype("ln2d_bwd", dt);
}

static const ut__backend ut__cpu_backend = {
    .name = "cpu",
    .mem_alloc = NULL,
    .mem_free = NULL,
    .upload = NULL,
    .download = NULL,
    .mem_info = NULL,
    .empty_cache = NULL,
    .cached_bytes = NULL,
    .fill = ut__cpu_fill,
    .copy = ut__cpu_copy,
    .copy2d = ut__cpu_copy2d,
    .cast = ut__cpu_cast,
    .axpy = ut__cpu_axpy,
    .scale = ut__cpu_scale,
    .relu_fwd = ut__cpu_relu_fwd,
    .relu_bwd = ut__cpu_relu_bwd,
    .act_fwd = ut__cpu_act_fwd,
    .act_bwd = ut__cpu_act_bwd,
    .transpose = ut__cpu_transpose,
    .gemm = ut__cpu_gemm,
    .bias_add = ut__cpu_bias_add,
    .channel_sum = ut__cpu_channel_sum,
    .chan_repeat = ut__cpu_chan_repeat,
    .chan_group_sum = ut__cpu_chan_group_sum,
    .row_mean = ut__cpu_row_mean,
    .row_mean_bwd = ut__cpu_row_mean_bwd,
    .im2col = ut__cpu_im2col,
    .col2im = ut__cpu_col2im,
    .conv_exact = ut__cpu_conv_exact,
    .dw_fwd = ut__cpu_dw_fwd,
    .dw_fwd_act = ut__cpu_dw_fwd_act,
    .sep_takes = ut__cpu_sep_takes,
    .sep_fwd = ut__cpu_sep_fwd,
    .dw_bwd_dx = ut__cpu_dw_bwd_dx,
    .dw_bwd_dw = ut__cpu_dw_bwd_dw,
    .layernorm_fwd = ut__cpu_layernorm_fwd,
    .layernorm_bwd = ut__cpu_layernorm_bwd,
    .chan_scale = ut__cpu_chan_scale, /* issue 30: channel scales, LayerNorm2d */
    .chan_dot = ut__cpu_chan_dot,
    .ln2d_fwd = ut__cpu_ln2d_fwd,
    .ln2d_bwd = ut__cpu_ln2d_bwd,
    .bn_stats = ut__cpu_bn_stats,
    .bn_update_running = ut__cpu_bn_update_running,
    .bn_apply = ut__cpu_bn_apply,
    .bn_bwd = ut__cpu_bn_bwd,
    .bn_sync_pack = ut__cpu_bn_sync_pack,
    .bn_sync_unpack = ut__cpu_bn_sync_unpack,
    .bn_bwd_sums = ut__cpu_bn_bwd_sums,
    .bn_bwd_dx = ut__cpu_bn_bwd_dx,
    .mse_fwd = ut__cpu_mse_fwd,
    .mse_bwd = ut__cpu_mse_bwd,
    .ce_fwd = ut__cpu_ce_fwd,
    .ce_bwd = ut__cpu_ce_bwd,
    .mask_scale = ut__cpu_mask_scale,
    .lerp = ut__cpu_lerp,
    .sgd = ut__cpu_sgd,
    .sgd_many = ut__cpu_sgd_many,
    .fill_many = ut__cpu_fill_many,
    .adam = ut__cpu_adam,
};

/* ============================================================================================
   ISA VARIANTS. Each hot kernel is an always-inline body (UT__CPU_INL) that takes its vector
   width V (and register blocking) as constant parameters, plus one thin wrapper per
   instruction set that calls it with that ISA's constants under a target attribute:
       NAME_avx512   AVX-512 (F, VL, BW, DQ), V = 16
       NAME_avx2     AVX2 + FMA, V = 8
       NAME_base     the build's own flags: V = 16 with -mavx512f, 8 with -mavx, else 4
   so GCC and Clang compile every body once per ISA, fully inlined and vectorized for it, and
   a build without -march=native still uses the machine's vector units. Each ISA's wrappers
   are collected in one ut__cpu_isa_kernels table; ut__cpu_isa() is the one run-time dispatch
   point (cpuid through __builtin_cpu_supports). Off x86-64, on compilers without target
   attributes, and with UT_CPU_NO_DISPATCH, only the base table exists.
   ============================================================================================ */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(UT_CPU_NO_DISPATCH)
#define UT__CPU_X86 1
#define UT__TGT_AVX2 __attribute__((target("avx2,fma,bmi,bmi2,f16c")))
#if defined(__clang__)
#define UT__TGT_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi,bmi2,f16c")))
#else
#define UT__TGT_AVX512                                                                      \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi,bmi2,f16c," \
                        "prefer-vector-width=512")))
#endif
#endif

/* -1: pick from the CPU; 0, 3, 4: force baseline / AVX2 / AVX-512 kernels (tests). */
static int ut__cpu_force_level = -1;

static int ut__cpu_level(void) {
  if (ut__cpu_force_level >= 0) return ut__cpu_force_level;
#ifdef UT__CPU_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
    return 4;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 3;
#endif
  return 0;
}

/* ---- vectors of V floats ----------------------------------------------------------------------
   A ut__vec holds one vector of V = 16, 8 or 4 floats (one zmm, ymm or xmm register). V is a
   constant in every variant (a literal in its wrapper), so each helper below folds to the one
   operation of that width: no vector wider than the ISA's is ever formed (GCC would lower it
   through the stack). Each width has its own member of a struct, not of a union: GCC
   optimizes an always-inline body once on its own, V unknown, before inlining it, and
   overlapping members of different sizes would then keep the instantiations copying vectors
   through the stack; separate members become separate registers, and those of the other
   widths vanish. The members are 16-byte aligned so that a by-value ut__vec has one calling
   convention across GCC versions (no -Wpsabi note; the helpers are always inlined anyway).
   Plain arrays and loops where the compiler has no vector extensions. */
#if defined(__GNUC__)
typedef float ut__v4f __attribute__((vector_size(16)));
typedef float ut__v8f __attribute__((vector_size(32), aligned(16)));
typedef float ut__v16f __attribute__((vector_size(64), aligned(16)));
typedef int32_t ut__v4i __attribute__((vector_size(16)));
typedef int32_t ut__v8i __attribute__((vector_size(32), aligned(16)));
typedef int32_t ut__v16i __attribute__((vector_size(64), aligned(16)));
/* unaligned, aliasing views of memory, for loads and stores */
typedef float ut__v4fu __attribute__((vector_size(16), aligned(4), may_alias));
typedef float ut__v8fu __attribute__((vector_size(32), aligned(4), may_alias));
typedef float ut__v16fu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t ut__v4iu __attribute__((vector_size(16), aligned(4), may_alias));
typedef int32_t ut__v8iu __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t ut__v16iu __attribute__((vector_size(64), aligned(4), may_alias));
typedef float ut__v2fu __attribute__((vector_size(8), aligned(4), may_alias));
typedef double ut__v2du __attribute__((vector_size(16), aligned(8), may_alias));
typedef double ut__v4du __attribute__((vector_size(32), aligned(8), may_alias));
typedef double ut__v8du __attribute__((vector_size(64), aligned(8), may_alias));
typedef struct ut__vec {
  ut__v16f z; /* V = 16 */
  ut__v8f y;  /* V = 8 */
  ut__v4f x;  /* V = 4 */
} ut__vec;

UT__CPU_INL ut__vec ut__v_ld(const float* p, const int V) {
  ut__vec r;
  if (V == 16) r.z = *(const ut__v16fu*)(const void*)p;
  else if (V == 8) r.y = *(const ut__v8fu*)(const void*)p;
  else r.x = *(const ut__v4fu*)(const void*)p;
  return r;
}
UT__CPU_INL void ut__v_st(float* p, ut__vec v, const int V) {
  if (V == 16) *(ut__v16fu*)(void*)p = v.z;
  else if (V == 8) *(ut__v8fu*)(void*)p = v.y;
  else *(ut__v4fu*)(void*)p = v.x;
}
UT__CPU_INL ut__vec ut__v_dup(float s, const int V) {
  ut__vec r;
  if (V == 16) r.z = (ut__v16f){0} + s;
  else if (V == 8) r.y = (ut__v8f){0} + s;
  else r.x = (ut__v4f){0} + s;
  return r;
}
/* acc + w v (one FMA: the CPU backend compiles with fp-contract=fast) */
UT__CPU_INL ut__vec ut__v_fma(ut__vec acc, float w, ut__vec v, const int V) {
  if (V == 16) acc.z = acc.z + w * v.z;
  else if (V == 8) acc.y = acc.y + w * v.y;
  else acc.x = acc.x + w * v.x;
  return acc;
}
/* acc + a b, lane by lane */
UT__CPU_INL ut__vec ut__v_fmav(ut__vec acc, ut__vec a, ut__vec b, const int V) {
  if (V == 16) acc.z = acc.z + a.z * b.z;
  else if (V == 8) acc.y = acc.y + a.y * b.y;
  else acc.x = acc.x + a.x * b.x;
  return acc;
}
UT__CPU_INL ut__vec ut__v_add(ut__vec a, ut__vec b, const int V) {
  if (V == 16) a.z += b.z;
  else if (V == 8) a.y += b.y;
  else a.x += b.x;
  return a;
}
UT__CPU_INL ut__vec ut__v_scale(ut__vec a, float s, const int V) {
  if (V == 16) a.z = a.z * s;
  else if (V == 8) a.y = a.y * s;
  else a.x = a.x * s;
  return a;
}
/* v with the lanes cleared where the int32 mask m[0..V) is 0 (masks are 0 or ~0) */
UT__CPU_INL ut__vec ut__v_and(ut__vec v, const int32_t* m, const int V) {
  if (V == 16) v.z = (ut__v16f)((ut__v16i)v.z & *(const ut__v16iu*)(const void*)m);
  else if (V == 8) v.y = (ut__v8f)((ut__v8i)v.y & *(const ut__v8iu*)(const void*)m);
  else v.x = (ut__v4f)((ut__v4i)v.x & *(const ut__v4iu*)(const void*)m);
  return v;
}
/* d[0..V) += (double)v, lane by lane */
UT__CPU_INL void ut__v_acc_d(double* d, ut__vec v, const int V) {
  float t[16];
  ut__v_st(t, v, V);
  if (V == 16) {
    *(ut__v8du*)(void*)d += __builtin_convertvector(*(const ut__v8fu*)(const void*)t, ut__v8du);
    *(ut__v8du*)(void*)(d + 8) +=
        __builtin_convertvector(*(const ut__v8fu*)(const void*)(t + 8), ut__v8du);
  } else if (V == 8) {
    *(ut__v4du*)(void*)d += __builtin_convertvector(*(const ut__v4fu*)(const void*)t, ut__v4du);
    *(ut__v4du*)(void*)(d + 4) +=
        __builtin_convertvector(*(const ut__v4fu*)(const void*)(t + 4), ut__v4du);
  } else {
    *(ut__v2du*)(void*)d += __builtin_convertvector(*(const ut__v2fu*)(const void*)t, ut__v2du);
    *(ut__v2du*)(void*)(d + 2) +=
        __builtin_convertvector(*(const ut__v2fu*)(const void*)(t + 2), ut__v2du);
  }
}
/* a shuffle of two vectors with constant lane indices (0.. for x, then x's width.. for y):
   clang takes the indices as arguments, GCC as a vector of the lane type */
#if defined(__clang__)
#define UT__V_SHUFFLE(x, y, itype, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define UT__V_SHUFFLE(x, y, itype, ...) __builtin_shuffle(x, y, (itype){__VA_ARGS__})
#endif
/* the even lanes of x0 then of x1 (a stride-2 row's phase 0) */
UT__CPU_INL ut__vec ut__v_even(ut__vec x0, ut__vec x1, const int V) {
  ut__vec r;
  if (V == 16)
    r.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                        28, 30);
  else if (V == 8) r.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 0, 2, 4, 6, 8, 10, 12, 14);
  else r.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 0, 2, 4, 6);
  return r;
}
/* the odd lanes of x0 then of x1 (a stride-2 row's phase 1) */
UT__CPU_INL ut__vec ut__v_odd(ut__vec x0, ut__vec x1, const int V) {
  ut__vec r;
  if (V == 16)
    r.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                        29, 31);
  else if (V == 8) r.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 1, 3, 5, 7, 9, 11, 13, 15);
  else r.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 1, 3, 5, 7);
  return r;
}
/* lanes b, b+3, b+6, ... of x0, x1, x2 (a stride-3 row's phase b): two two-vector shuffles */
UT__CPU_INL ut__vec ut__v_third(ut__vec x0, ut__vec x1, ut__vec x2, int b, const int V) {
  ut__vec t, r;
  if (V == 16) {
    if (b == 0) {
      t.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0, 0, 0,
                          0, 0);
      r.z = UT__V_SHUFFLE(t.z, x2.z, ut__v16i, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 20, 23, 26,
                          29);
    } else if (b == 1) {
      t.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 0, 0, 0,
                          0, 0);
      r.z = UT__V_SHUFFLE(t.z, x2.z, ut__v16i, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 18, 21, 24, 27,
                          30);
    } else {
      t.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0, 0, 0, 0,
                          0, 0);
      r.z = UT__V_SHUFFLE(t.z, x2.z, ut__v16i, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19, 22, 25, 28,
                          31);
    }
  } else if (V == 8) {
    if (b == 0) {
      t.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 0, 3, 6, 9, 12, 15, 0, 0);
      r.y = UT__V_SHUFFLE(t.y, x2.y, ut__v8i, 0, 1, 2, 3, 4, 5, 10, 13);
    } else if (b == 1) {
      t.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 1, 4, 7, 10, 13, 0, 0, 0);
      r.y = UT__V_SHUFFLE(t.y, x2.y, ut__v8i, 0, 1, 2, 3, 4, 8, 11, 14);
    } else {
      t.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 2, 5, 8, 11, 14, 0, 0, 0);
      r.y = UT__V_SHUFFLE(t.y, x2.y, ut__v8i, 0, 1, 2, 3, 4, 9, 12, 15);
    }
  } else {
    if (b == 0) {
      t.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 0, 3, 6, 0);
      r.x = UT__V_SHUFFLE(t.x, x2.x, ut__v4i, 0, 1, 2, 5);
    } else if (b == 1) {
      t.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 1, 4, 7, 0);
      r.x = UT__V_SHUFFLE(t.x, x2.x, ut__v4i, 0, 1, 2, 6);
    } else {
      t.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 2, 5, 0, 0);
      r.x = UT__V_SHUFFLE(t.x, x2.x, ut__v4i, 0, 1, 4, 7);
    }
  }
  return r;
}
/* vector m (0..2) of x0, x1, x2 interleaved by threes (x0[0], x1[0], x2[0], x0[1], ...): a
   stride-3 row's phases put back in place; two two-vector shuffles */
UT__CPU_INL ut__vec ut__v_inter3(ut__vec x0, ut__vec x1, ut__vec x2, int m, const int V) {
  ut__vec t, r;
  if (V == 16) {
    if (m == 0) {
      t.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 0, 16, 0, 1, 17, 0, 2, 18, 0, 3, 19, 0, 4, 20, 0,
                          5);
      r.z = UT__V_SHUFFLE(t.z, x2.z, ut__v16i, 0, 1, 16, 3, 4, 17, 6, 7, 18, 9, 10, 19, 12, 13, 20,
                          15);
    } else if (m == 1) {
      t.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 21, 0, 6, 22, 0, 7, 23, 0, 8, 24, 0, 9, 25, 0, 10,
                          26);
      r.z = UT__V_SHUFFLE(t.z, x2.z, ut__v16i, 0, 21, 2, 3, 22, 5, 6, 23, 8, 9, 24, 11, 12, 25, 14,
                          15);
    } else {
      t.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 0, 11, 27, 0, 12, 28, 0, 13, 29, 0, 14, 30, 0, 15,
                          31, 0);
      r.z = UT__V_SHUFFLE(t.z, x2.z, ut__v16i, 26, 1, 2, 27, 4, 5, 28, 7, 8, 29, 10, 11, 30, 13, 14,
                          31);
    }
  } else if (V == 8) {
    if (m == 0) {
      t.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 0, 8, 0, 1, 9, 0, 2, 10);
      r.y = UT__V_SHUFFLE(t.y, x2.y, ut__v8i, 0, 1, 8, 3, 4, 9, 6, 7);
    } else if (m == 1) {
      t.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 0, 3, 11, 0, 4, 12, 0, 5);
      r.y = UT__V_SHUFFLE(t.y, x2.y, ut__v8i, 10, 1, 2, 11, 4, 5, 12, 7);
    } else {
      t.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 13, 0, 6, 14, 0, 7, 15, 0);
      r.y = UT__V_SHUFFLE(t.y, x2.y, ut__v8i, 0, 13, 2, 3, 14, 5, 6, 15);
    }
  } else {
    if (m == 0) {
      t.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 0, 4, 0, 1);
      r.x = UT__V_SHUFFLE(t.x, x2.x, ut__v4i, 0, 1, 4, 3);
    } else if (m == 1) {
      t.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 5, 0, 2, 6);
      r.x = UT__V_SHUFFLE(t.x, x2.x, ut__v4i, 0, 5, 2, 3);
    } else {
      t.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 0, 3, 7, 0);
      r.x = UT__V_SHUFFLE(t.x, x2.x, ut__v4i, 6, 1, 2, 7);
    }
  }
  return r;
}
/* x0 and x1 interleaved (x0[0], x1[0], x0[1], ...): its first V lanes (lo) and last V (hi) */
UT__CPU_INL ut__vec ut__v_zip_lo(ut__vec x0, ut__vec x1, const int V) {
  ut__vec r;
  if (V == 16)
    r.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                        23);
  else if (V == 8) r.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 0, 8, 1, 9, 2, 10, 3, 11);
  else r.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 0, 4, 1, 5);
  return r;
}
UT__CPU_INL ut__vec ut__v_zip_hi(ut__vec x0, ut__vec x1, const int V) {
  ut__vec r;
  if (V == 16)
    r.z = UT__V_SHUFFLE(x0.z, x1.z, ut__v16i, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14,
                        30, 15, 31);
  else if (V == 8) r.y = UT__V_SHUFFLE(x0.y, x1.y, ut__v8i, 4, 12, 5, 13, 6, 14, 7, 15);
  else r.x = UT__V_SHUFFLE(x0.x, x1.x, ut__v4i, 2, 6, 3, 7);
  return r;
}
#else /* no vector extensions */
typedef struct ut__vec {
  float f[16];
} ut__vec;
static inline ut__vec ut__v_ld(const float* p, const int V) {
  ut__vec r;
  memcpy(r.f, p, (size_t)V * sizeof(float));
  return r;
}
static inline void ut__v_st(float* p, ut__vec v, const int V) {
  memcpy(p, v.f, (size_t)V * sizeof(float));
}
static inline ut__vec ut__v_dup(float s, const int V) {
  ut__vec r;
  for (int i = 0; i < V; i++) r.f[i] = s;
  return r;
}
static inline ut__vec ut__v_fma(ut__vec acc, float w, ut__vec v, const int V) {
  for (int i = 0; i < V; i++) acc.f[i] += w * v.f[i];
  return acc;
}
static inline ut__vec ut__v_fmav(ut__vec acc, ut__vec a, ut__vec b, const int V) {
  for (int i = 0; i < V; i++) acc.f[i] += a.f[i] * b.f[i];
  return acc;
}
static inline ut__vec ut__v_add(ut__vec a, ut__vec b, const int V) {
  for (int i = 0; i < V; i++) a.f[i] += b.f[i];
  return a;
}
static inline ut__vec ut__v_scale(ut__vec a, float s, const int V) {
  for (int i = 0; i < V; i++) a.f[i] = a.f[i] * s;
  return a;
}
static inline ut__vec ut__v_and(ut__vec v, const int32_t* m, const int V) {
  for (int i = 0; i < V; i++) {
    int32_t b;
    memcpy(&b, &v.f[i], 4);
    b &= m[i];
    memcpy(&v.f[i], &b, 4);
  }
  return v;
}
static inline void ut__v_acc_d(double* d, ut__vec v, const int V) {
  for (int i = 0; i < V; i++) d[i] += (double)v.f[i];
}
#endif

/* Inference's epilogue on values still in registers (the GEMM micro-kernel's): y s + t, then
   ReLU or ReLU6, the operations of ut__cpu_epi_rows in its order and rounding. That loop is
   built with fp-contract=off, so the product is rounded before the add here too: an empty asm
   on the product hides it from FMA contraction (x86 only: the kernels that fuse the epilogue,
   ut__cpu_isa_kernels.gemm_epi, are the x86 ones). The operand is named in memory ("m"):
   a store and a load per vector of a finished tile, nothing in the K loop. A register ("v")
   was refused by the GPU machines' GCC, at -O0 in code without AVX-512 (where the 16-lane
   branch is emitted too) and at -O1 with the sanitizers (where the vector is addressable),
   and "vm" together as inconsistent. ReLU keeps relu_fwd's rules: NaN and -0 pass. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define UT__NO_CONTRACT(x) __asm__("" : "+m"(x))
#else
#define UT__NO_CONTRACT(x) ((void)0)
#endif
UT__CPU_INL float ut__epi_scalar(float y, float s, float t, int act) {
  float p = y * s;
  UT__NO_CONTRACT(p);
  y = p + t;
  if (act == UT_ACT_RELU || act == UT_ACT_RELU6) y = y < 0.0f ? 0.0f : y;
  if (act == UT_ACT_RELU6) y = y > 6.0f ? 6.0f : y;
  return y;
}
/* v through act when act is ReLU or ReLU6 (else v): ut__cpu_epi_run's operations, so its bits
   (-0 and NaN pass). The depthwise engines apply it as they store (a pass of its own over the
   output, even in cache, cost a 144-channel 56^2 forward a third of its time), the GEMM's
   epilogue after its affine map (ut__v_epi). */
UT__CPU_INL ut__vec ut__v_relus(ut__vec v, int act, const int V) {
  if (act != UT_ACT_RELU && act != UT_ACT_RELU6) return v;
#if defined(__GNUC__)
  if (V == 16) {
    ut__v16f p = v.z, zero = {0}, six = zero + 6.0f;
    p = (ut__v16f)((ut__v16i)p & ~(p < zero));
    if (act == UT_ACT_RELU6) {
      ut__v16i m = p > six;
      p = (ut__v16f)(((ut__v16i)p & ~m) | ((ut__v16i)six & m));
    }
    v.z = p;
    return v;
  }
  if (V == 8) {
    ut__v8f p = v.y, zero = {0}, six = zero + 6.0f;
    p = (ut__v8f)((ut__v8i)p & ~(p < zero));
    if (act == UT_ACT_RELU6) {
      ut__v8i m = p > six;
      p = (ut__v8f)(((ut__v8i)p & ~m) | ((ut__v8i)six & m));
    }
    v.y = p;
    return v;
  }
#endif
  float f[16];
  ut__v_st(f, v, V);
  for (int i = 0; i < V; i++) {
    float y = f[i] < 0.0f ? 0.0f : f[i];
    f[i] = act == UT_ACT_RELU6 && y > 6.0f ? 6.0f : y;
  }
  return ut__v_ld(f, V);
}
/* act(s v + t) for the ReLU family (else s v + t), ut__epi_scalar's operations lane by lane */
#if defined(__GNUC__)
UT__CPU_INL ut__vec ut__v_epi(ut__vec v, float s, float t, int act, const int V) {
  if (V == 16) {
    ut__v16f p = v.z * s;
    UT__NO_CONTRACT(p);
    v.z = p + t;
  } else if (V == 8) {
    ut__v8f p = v.y * s;
    UT__NO_CONTRACT(p);
    v.y = p + t;
  } else {
    float f[4];
    ut__v_st(f, v, V);
    for (int i = 0; i < 4; i++) f[i] = ut__epi_scalar(f[i], s, t, act);
    return ut__v_ld(f, V);
  }
  return ut__v_relus(v, act, V);
}
#else
static inline ut__vec ut__v_epi(ut__vec v, float s, float t, int act, const int V) {
  for (int i = 0; i < V; i++) v.f[i] = ut__epi_scalar(v.f[i], s, t, act);
  return v;
}
#endif

/* Store the V lanes of v at p, cut at lim: whole when they end before lim (see "depthwise
   engines" for why the lanes past a row may be stored), else only those before lim. */
UT__CPU_INL void ut__v_st_lim(float* p, ut__vec v, const float* lim, const int V) {
  if (p + V <= lim) {
    ut__v_st(p, v, V);
  } else if (p < lim) {
    float t[16];
    ut__v_st(t, v, V);
    for (ut__i64 i = 0; i < lim - p && i < V; i++) p[i] = t[i]; /* (lim - p < V) */
  }
}

/* ---- depthwise engines (see "depthwise engines" in the CPU backend) -------------------------- */
/* Input row iy as phase rows, from the ring (slot iy % nslots) or the zero slot. */
UT__CPU_INL const float* ut__dw_row(const float* restrict xp, int iy, int h, int w, int s, int px,
                                    int Wq, int PS, int SL, int nslots, float* restrict slots,
                                    int* restrict tags, const int V) {
  if (iy < 0 || iy >= h) return slots;
  int k = iy % nslots;
  float* dst = slots + (ut__i64)(k + 1) * SL;
  if (tags[k] == iy) return dst;
  tags[k] = iy;
  const float* xr = xp + (ut__i64)iy * w;
  for (int b = 0; b < s; b++) {
    float* d = dst + (ut__i64)b * PS;
    int lo = ut__cpu_lo(b, s, px, Wq), hi = UT__CPU_MAX(ut__cpu_hi(b, s, px, w, Wq), lo);
    int off = b - px;
    for (int c = 0; c < lo; c++) d[c] = 0.0f;
    if (s == 1) {
      if (hi > lo) memcpy(d + lo, xr + lo + off, (size_t)(hi - lo) * sizeof(float));
    } else if (s == 2) {
      int c = lo;
#if defined(__GNUC__)
      for (; c + V <= hi && 2 * c + off + 2 * V <= w; c += V) {
        ut__vec x0 = ut__v_ld(xr + 2 * c + off, V), x1 = ut__v_ld(xr + 2 * c + off + V, V);
        ut__v_st(d + c, ut__v_even(x0, x1, V), V);
      }
#endif
      for (; c < hi; c++) d[c] = xr[2 * c + off];
    } else {
      for (int c = lo; c < hi; c++) d[c] = xr[c * s + off];
    }
    for (int c = hi; c < Wq; c++) d[c] = 0.0f;
  }
  return dst;
}

/* Row engine, one plane, K x K filter at stride S (constants when inlined with literals). At
   stride 1 two output rows are computed together: each of their K+1 input rows is loaded once
   per tap column and feeds both (the ring holds K+1 rows). Vectors are stored last to first, so
   that the spill of a row's last vector into the next row is overwritten by that row's first. */
UT__CPU_INL void ut__dwf_rows_k(const ut__dwctx* C, const float* restrict xp,
                                const float* restrict wk, float b, float* restrict yp,
                                const float* ylim, float* restrict buf, const int K, const int S,
                                const int V) {
  int h = C->h, w = C->w, py = C->py, px = C->px, ho = C->ho, wo = C->wo;
  int Wq = C->Wq, nv = C->nv, PS = C->PS, SL = C->SL;
  const int NR = S == 1 ? 2 : 1; /* output rows per step */
  const int NI = (NR - 1) * S + K; /* input rows per step */
  float* slots = buf;
  int* tags = (int*)(void*)(buf + (ut__i64)(NI + 1) * SL);
  for (int k = 0; k < NI; k++) tags[k] = -1;
  float wr[49];
  UT__DW_UNROLL
  for (int t = 0; t < K * K; t++) wr[t] = wk[t];
  for (int oy = 0; oy < ho; oy += NR) {
    const float* rp[8];
    UT__DW_UNROLL
    for (int r = 0; r < NI; r++)
      rp[r] = ut__dw_row(xp, oy * S - py + r, h, w, S, px, Wq, PS, SL, NI, slots, tags, V);
    float* yr0 = yp + (ut__i64)oy * wo;
    float* yr1 = yr0 + wo;
    bool two = NR == 2 && oy + 1 < ho;
    for (int v = nv - 1; v >= 0; v--) {
      ut__vec a0 = ut__v_dup(b, V), a1 = ut__v_dup(b, V);
      if (NR == 2) {
        ut__vec c0 = ut__v_dup(0.0f, V), c1 = ut__v_dup(0.0f, V);
        UT__DW_UNROLL
        for (int r = 0; r < NI; r++)
          UT__DW_UNROLL
          for (int kx = 0; kx < K; kx++) {
            ut__vec xv = ut__v_ld(rp[r] + kx + v * V, V);
            if (r < K) {
              if (r & 1)
                c0 = ut__v_fma(c0, wr[r * K + kx], xv, V);
              else
                a0 = ut__v_fma(a0, wr[r * K + kx], xv, V);
            }
            if (r >= 1) {
              if (r & 1)
                a1 = ut__v_fma(a1, wr[(r - 1) * K + kx], xv, V);
              else
                c1 = ut__v_fma(c1, wr[(r - 1) * K + kx], xv, V);
            }
          }
        a0 = ut__v_add(a0, c0, V);
        a1 = ut__v_add(a1, c1, V);
      } else {
        ut__vec c0 = ut__v_dup(0.0f, V);
        UT__DW_UNROLL
        for (int ky = 0; ky < K; ky++)
          UT__DW_UNROLL
          for (int kx = 0; kx < K; kx++) {
            ut__vec xv = ut__v_ld(rp[ky] + (kx % S) * PS + kx / S + v * V, V);
            if (ky & 1)
              c0 = ut__v_fma(c0, wr[ky * K + kx], xv, V);
            else
              a0 = ut__v_fma(a0, wr[ky * K + kx], xv, V);
          }
        a0 = ut__v_add(a0, c0, V);
      }
      ut__v_st_lim(yr0 + v * V, ut__v_relus(a0, C->act, V), ylim, V);
      if (two) ut__v_st_lim(yr1 + v * V, ut__v_relus(a1, C->act, V), ylim, V);
    }
  }
}

/* Row engine, any geometry: the output row is accumulated in a buffer, one input row at a
   time. */
UT__CPU_INL void ut__dwf_rows_gen(const ut__dwctx* C, const float* restrict xp,
                                  const float* restrict wk, float b, float* restrict yp,
                                  float* restrict buf, const int V) {
  int h = C->h, w = C->w, kh = C->kh, kw = C->kw, s = C->s, py = C->py, px = C->px,
      ho = C->ho, wo = C->wo;
  int Wq = C->Wq, nv = C->nv, PS = C->PS, SL = C->SL;
  float* slots = buf;
  float* ye = buf + (ut__i64)(kh + 1) * SL;
  int* tags = (int*)(void*)(ye + (ut__i64)nv * V);
  for (int k = 0; k < kh; k++) tags[k] = -1;
  for (int oy = 0; oy < ho; oy++) {
    for (int v = 0; v < nv; v++) ut__v_st(ye + v * V, ut__v_dup(b, V), V);
    for (int ky = 0; ky < kh; ky++) {
      int iy = oy * s - py + ky;
      if (iy < 0 || iy >= h) continue;
      const float* r = ut__dw_row(xp, iy, h, w, s, px, Wq, PS, SL, kh, slots, tags, V);
      for (int kx = 0; kx < kw; kx++) {
        float wv = wk[ky * kw + kx];
        const float* src = r + (ut__i64)(kx % s) * PS + kx / s;
        for (int v = 0; v < nv; v++)
          ut__v_st(ye + v * V,
                    ut__v_fma(ut__v_ld(ye + v * V, V), wv, ut__v_ld(src + v * V, V), V), V);
      }
    }
    if (C->act == UT_ACT_RELU || C->act == UT_ACT_RELU6)
      for (int v = 0; v < nv; v++)
        ut__v_st(ye + v * V, ut__v_relus(ut__v_ld(ye + v * V, V), C->act, V), V);
    memcpy(yp + (ut__i64)oy * wo, ye, (size_t)wo * sizeof(float));
  }
}

/* Input row iy as s phase rows like ut__dw_row, for strides 2 and 3 through tmp (a zero padded
   copy of the row: tmp[j] = x[iy][j - px]) split into its phases by vector shuffles, where
   ut__dw_row moves one float at a time (on 28-pixel rows that moving cost more than the FMAs).
   The vectors whose s V floats lie inside the row are read from x itself, not from tmp just
   after memcpy wrote it (a load spanning several stores is not forwarded): ~2% of a 3x3
   stride-2 forward over 112^2 planes.
   tmp: s * (PS + V) + 16 floats. */
UT__CPU_INL const float* ut__dw_row_split(const float* restrict xp, int iy, int h, int w, int s,
                                          int px, int Wq, int PS, int SL, int nslots,
                                          float* restrict slots, int* restrict tags,
                                          float* restrict tmp, const int V) {
#if defined(__GNUC__)
  if (s == 1 || s > 3 || V == 1 || iy < 0 || iy >= h)
    return ut__dw_row(xp, iy, h, w, s, px, Wq, PS, SL, nslots, slots, tags, V);
  int k = iy % nslots;
  float* dst = slots + (ut__i64)(k + 1) * SL;
  if (tags[k] == iy) return dst;
  tags[k] = iy;
  int nc = (Wq + V - 1) / V * V; /* phase floats written (<= PS: zeros past Wq) */
  int tn = s * nc + s * V;       /* tmp floats read */
  int c0 = UT__CPU_MIN(px, tn), c1 = UT__CPU_MIN(px + w, tn);
  for (int j = 0; j < c0; j++) tmp[j] = 0.0f;
  if (c1 > c0) memcpy(tmp + c0, xp + (ut__i64)iy * w, (size_t)(c1 - c0) * sizeof(float));
  for (int j = UT__CPU_MAX(c1, c0); j < tn; j++) tmp[j] = 0.0f;
  const float* xr = xp + (ut__i64)iy * w; /* xr[j - px] = tmp[j] for j in [px, px + w) */
  if (s == 2) {
    for (int c = 0; c < nc; c += V) {
      bool in = 2 * c >= px && 2 * c + 2 * V <= px + w;
      const float* t = in ? xr + (2 * c - px) : tmp + 2 * c;
      ut__vec x0 = ut__v_ld(t, V), x1 = ut__v_ld(t + V, V);
      ut__v_st(dst + c, ut__v_even(x0, x1, V), V);
      ut__v_st(dst + PS + c, ut__v_odd(x0, x1, V), V);
    }
  } else {
    for (int c = 0; c < nc; c += V) {
      bool in = 3 * c >= px && 3 * c + 3 * V <= px + w;
      const float* t = in ? xr + (3 * c - px) : tmp + 3 * c;
      ut__vec x0 = ut__v_ld(t, V), x1 = ut__v_ld(t + V, V), x2 = ut__v_ld(t + 2 * V, V);
      for (int bb = 0; bb < 3; bb++)
        ut__v_st(dst + (ut__i64)bb * PS + c, ut__v_third(x0, x1, x2, bb, V), V);
    }
  }
  return dst;
#else
  (void)tmp;
  return ut__dw_row(xp, iy, h, w, s, px, Wq, PS, SL, nslots, slots, tags, V);
#endif
}

/* Row engine, one plane, any filter height: KW taps a row (a constant when inlined with a
   literal) at any stride with the taps C->dil apart (rows too). A step computes two output rows
   and two vectors of each: four independent sums stay in registers over the filter rows' loop,
   where ut__dwf_rows_gen adds every tap into memory; a lone last vector splits its sums over
   even and odd filter rows instead. The ring holds the s + (kh-1)*dil + 1 input rows a step
   spans. Stores go last vector to first, as in ut__dwf_rows_k. */
UT__CPU_INL void ut__dwf_rows_kw(const ut__dwctx* C, const float* restrict xp,
                                 const float* restrict wk, float b, float* restrict yp,
                                 const float* ylim, float* restrict buf, const int KW,
                                 const int V) {
  int h = C->h, w = C->w, kh = C->kh, s = C->s, py = C->py, px = C->px, ho = C->ho, wo = C->wo;
  int Wq = C->Wq, nv = C->nv, PS = C->PS, SL = C->SL, D = C->dil > 1 ? C->dil : 1;
  int NI = s + (kh - 1) * D + 1, act = C->act;
  float* slots = buf;
  int* tags = (int*)(void*)(buf + (ut__i64)(NI + 1) * SL);
  float* tmp = buf + (ut__i64)(NI + 1) * SL + 64;
  for (int k = 0; k < NI; k++) tags[k] = -1;
  int off[7];
  UT__DW_UNROLL
  for (int kx = 0; kx < KW; kx++) off[kx] = (kx * D % s) * PS + kx * D / s;
  for (int oy = 0; oy < ho; oy += 2) {
    const float* r0[7];
    const float* r1[7];
    for (int ky = 0; ky < kh; ky++)
      r0[ky] = ut__dw_row_split(xp, oy * s - py + ky * D, h, w, s, px, Wq, PS, SL, NI, slots,
                                tags, tmp, V);
    /* the second row's filter rows are mostly the first's, s input rows on (a ring lookup
       apiece costs more than the FMAs of a narrow filter) */
    int sh = s % D == 0 ? s / D : kh;
    for (int ky = 0; ky < kh; ky++)
      r1[ky] = ky + sh < kh ? r0[ky + sh]
                            : ut__dw_row_split(xp, oy * s - py + ky * D + s, h, w, s, px, Wq,
                                               PS, SL, NI, slots, tags, tmp, V);
    float* yr0 = yp + (ut__i64)oy * wo;
    float* yr1 = yr0 + wo;
    bool two = oy + 1 < ho;
    for (int v = nv - 1; v >= 1; v -= 2) {
      int u = v - 1;
      /* eight sums: (row, vector) x (even, odd filter row), enough chains to fill both FMA
         ports through their latency */
      ut__vec a0 = ut__v_dup(b, V), c0 = ut__v_dup(b, V), a1 = ut__v_dup(b, V),
              c1 = ut__v_dup(b, V);
      ut__vec e0 = ut__v_dup(0.0f, V), f0 = ut__v_dup(0.0f, V), e1 = ut__v_dup(0.0f, V),
              f1 = ut__v_dup(0.0f, V);
      int ky = 0;
      for (; ky + 1 < kh; ky += 2) {
        const float* p0 = r0[ky];
        const float* p1 = r1[ky];
        const float* q0 = r0[ky + 1];
        const float* q1 = r1[ky + 1];
        const float* wr = wk + ky * KW;
        UT__DW_UNROLL
        for (int kx = 0; kx < KW; kx++) {
          float wv = wr[kx], wn = wr[KW + kx];
          a0 = ut__v_fma(a0, wv, ut__v_ld(p0 + off[kx] + v * V, V), V);
          c0 = ut__v_fma(c0, wv, ut__v_ld(p0 + off[kx] + u * V, V), V);
          a1 = ut__v_fma(a1, wv, ut__v_ld(p1 + off[kx] + v * V, V), V);
          c1 = ut__v_fma(c1, wv, ut__v_ld(p1 + off[kx] + u * V, V), V);
          e0 = ut__v_fma(e0, wn, ut__v_ld(q0 + off[kx] + v * V, V), V);
          f0 = ut__v_fma(f0, wn, ut__v_ld(q0 + off[kx] + u * V, V), V);
          e1 = ut__v_fma(e1, wn, ut__v_ld(q1 + off[kx] + v * V, V), V);
          f1 = ut__v_fma(f1, wn, ut__v_ld(q1 + off[kx] + u * V, V), V);
        }
      }
      if (ky < kh) {
        const float* p0 = r0[ky];
        const float* p1 = r1[ky];
        const float* wr = wk + ky * KW;
        UT__DW_UNROLL
        for (int kx = 0; kx < KW; kx++) {
          float wv = wr[kx];
          a0 = ut__v_fma(a0, wv, ut__v_ld(p0 + off[kx] + v * V, V), V);
          c0 = ut__v_fma(c0, wv, ut__v_ld(p0 + off[kx] + u * V, V), V);
          a1 = ut__v_fma(a1, wv, ut__v_ld(p1 + off[kx] + v * V, V), V);
          c1 = ut__v_fma(c1, wv, ut__v_ld(p1 + off[kx] + u * V, V), V);
        }
      }
      ut__v_st_lim(yr0 + v * V, ut__v_relus(ut__v_add(a0, e0, V), act, V), ylim, V);
      ut__v_st_lim(yr0 + u * V, ut__v_relus(ut__v_add(c0, f0, V), act, V), ylim, V);
      if (two) {
        ut__v_st_lim(yr1 + v * V, ut__v_relus(ut__v_add(a1, e1, V), act, V), ylim, V);
        ut__v_st_lim(yr1 + u * V, ut__v_relus(ut__v_add(c1, f1, V), act, V), ylim, V);
      }
    }
    if (nv & 1) { /* vector 0 alone: sums over even and odd filter rows */
      ut__vec a0 = ut__v_dup(b, V), c0 = ut__v_dup(0.0f, V), a1 = ut__v_dup(b, V),
              c1 = ut__v_dup(0.0f, V);
      int ky = 0;
      for (; ky + 1 < kh; ky += 2) {
        const float* wr = wk + ky * KW;
        UT__DW_UNROLL
        for (int kx = 0; kx < KW; kx++) {
          a0 = ut__v_fma(a0, wr[kx], ut__v_ld(r0[ky] + off[kx], V), V);
          a1 = ut__v_fma(a1, wr[kx], ut__v_ld(r1[ky] + off[kx], V), V);
          c0 = ut__v_fma(c0, wr[KW + kx], ut__v_ld(r0[ky + 1] + off[kx], V), V);
          c1 = ut__v_fma(c1, wr[KW + kx], ut__v_ld(r1[ky + 1] + off[kx], V), V);
        }
      }
      if (ky < kh) {
        const float* wr = wk + ky * KW;
        UT__DW_UNROLL
        for (int kx = 0; kx < KW; kx++) {
          a0 = ut__v_fma(a0, wr[kx], ut__v_ld(r0[ky] + off[kx], V), V);
          a1 = ut__v_fma(a1, wr[kx], ut__v_ld(r1[ky] + off[kx], V), V);
        }
      }
      ut__v_st_lim(yr0, ut__v_relus(ut__v_add(a0, c0, V), act, V), ylim, V);
      if (two) ut__v_st_lim(yr1, ut__v_relus(ut__v_add(a1, c1, V), act, V), ylim, V);
    }
  }
}

/* The any-height row engines cover filters up to 7x7 at any stride and dilation (their
   buffers are sized by ut__dw_setup); the width is a constant per call. */
static inline bool ut__dw_rows_kw_fits(const ut__dwctx* C) {
  return C->kh >= 1 && C->kh <= 7 && C->kw >= 1 && C->kw <= 7;
}
UT__CPU_INL void ut__dwf_rows_any(const ut__dwctx* C, const float* restrict xp,
                                  const float* restrict wk, float b, float* restrict yp,
                                  const float* ylim, float* restrict buf, const int V) {
  switch (C->kw) {
    case 1: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 1, V); break;
    case 2: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 2, V); break;
    case 3: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 3, V); break;
    case 4: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 4, V); break;
    case 5: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 5, V); break;
    case 6: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 6, V); break;
    default: ut__dwf_rows_kw(C, xp, wk, b, yp, ylim, buf, 7, V); break;
  }
}

/* One phase-plane row of ut__dwf_s2_planes: phase row r (input row 2 r + a, zeros when outside x)
   split into its even columns (e) and odd ones (o), `lead` zeros first, then the columns
   c = 0 .. cols-1 of each phase (zeros past the input). Vectors may read past the row, up
   to xend, and store up to V - 1 floats past the phase row: into the next row (built after
   it) or the plane's slack. */
UT__CPU_INL void ut__dwf_s2_row(const float* restrict xr, const float* xend, int w, int lead,
                                int cols, float* restrict e, float* restrict o, const int V) {
  static const int32_t first[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                    -1, -1}; /* &first[16 - n]: n lanes on */
  for (int c = 0; c < lead; c++) e[c] = o[c] = 0.0f;
  e += lead;
  o += lead;
  if (!xr) {
    for (int c = 0; c < cols; c += V) {
      ut__v_st(e + c, ut__v_dup(0.0f, V), V);
      ut__v_st(o + c, ut__v_dup(0.0f, V), V);
    }
    return;
  }
  int ne = UT__CPU_MIN(cols, (w + 1) / 2), no = UT__CPU_MIN(cols, w / 2); /* inside x */
  int c = 0;
  for (; c < cols && xr + 2 * c + 2 * V <= xend; c += V) {
    ut__vec x0 = ut__v_ld(xr + 2 * c, V), x1 = ut__v_ld(xr + 2 * c + V, V);
    ut__vec ve = ut__v_even(x0, x1, V), vo = ut__v_odd(x0, x1, V);
    if (c + V > ne) ve = ut__v_and(ve, first + 16 - UT__CPU_MAX(0, ne - c), V);
    if (c + V > no) vo = ut__v_and(vo, first + 16 - UT__CPU_MAX(0, no - c), V);
    ut__v_st(e + c, ve, V);
    ut__v_st(o + c, vo, V);
  }
  /* the tensor's last values one at a time (a zeroed copy for the vector loads missed store
     forwarding: a third of the engine's time) */
  for (int i = c; i < ne; i++) e[i] = xr[2 * i];
  for (int i = UT__CPU_MAX(c, ne); i < cols; i++) e[i] = 0.0f;
  for (int i = c; i < no; i++) o[i] = xr[2 * i + 1];
  for (int i = UT__CPU_MAX(c, no); i < cols; i++) o[i] = 0.0f;
}

/* Stride-2 engine over planes [q0, q1), K x K filter (K 3, 5 or 7: a constant when inlined).
   Each plane is split once into its four phase planes (row parity x column parity, zero
   padded, rows of C->s2pw floats), where every tap is a stride-1 read; its outputs are then
   computed as one flat run of rows s2pw long (the columns past wo junk) and copied out row by
   row. The row engine deinterleaved each input row into a ring and spent more on that
   bookkeeping than on the FMAs (3x3, 144 channels at 56^2 -> 28^2: 8-10 GFLOP/s on 2 cores).
   Small planes go C->s2g at a time through each stage: a vector load that spans two recent
   stores waits for them to retire, and one small plane's stages read what the last wrote. */
UT__CPU_INL void ut__dwf_s2_planes(const ut__dwctx* C, ut__i64 q0, ut__i64 q1,
                                   float* restrict buf, const int K, const int V) {
  int h = C->h, w = C->w, py = C->py, px = C->px, ho = C->ho, wo = C->wo, c = C->c;
  int pw = C->s2pw, rows = C->s2rows, G = C->s2g;
  int ry0 = ut__dw_s2_lo(0, py), cx0 = ut__dw_s2_lo(0, px);
  ut__i64 psz = UT__DW_R16((ut__i64)rows * pw + 3 * V), hw = (ut__i64)h * w;
  ut__i64 osz = UT__DW_R16((ut__i64)ho * pw + 2 * V), per = 4 * psz + osz, ohw = (ut__i64)ho * wo;
  ut__i64 nflat = (ut__i64)ho * pw;
  const float* xend = C->x + C->planes * hw;
  const float* ylim = C->y + q1 * ohw;
  ut__i64 off[49]; /* tap t reads phase plane (a, b) at off[t] + j: (a, b) = parities */
  UT__DW_UNROLL
  for (int ky = 0; ky < K; ky++)
    UT__DW_UNROLL
    for (int kx = 0; kx < K; kx++)
      off[ky * K + kx] = (ut__i64)(2 * ((ky - py) & 1) + ((kx - px) & 1)) * psz +
                         (ut__i64)(ut__dw_s2_lo(ky, py) - ry0) * pw + ut__dw_s2_lo(kx, px) - cx0;
  for (ut__i64 g0 = q0; g0 < q1; g0 += G) {
    int gn = (int)UT__CPU_MIN((ut__i64)G, q1 - g0);
    for (int i = 0; i < gn; i++) { /* phase planes at buf + i * per + (2 a + b) * psz */
      const float* xp = C->x + (g0 + i) * hw;
      for (int a = 0; a < 2; a++)
        for (int r = 0; r < rows; r++) {
          int iy = 2 * (r + ry0) + a;
          float* e = buf + i * per + (ut__i64)(2 * a) * psz + (ut__i64)r * pw;
          ut__dwf_s2_row(iy >= 0 && iy < h ? xp + (ut__i64)iy * w : NULL, xend, w, -cx0,
                         pw + cx0, e, e + psz, V);
        }
    }
    for (int i = 0; i < gn; i++) {
      int ch = (int)((g0 + i) % c);
      const float* wk = C->wt + (ut__i64)ch * K * K;
      float b = C->bias ? C->bias[ch] : 0.0f;
      const float* ph = buf + i * per;
      float* out = buf + i * per + 4 * psz;
      if (K > 3) {
        /* a filter row at a time into the output run: K pointers live, where K * K of them
           (one per tap) were kept on the stack and stepped there (7x7 over 14^2 planes: 6.5
           cycles an FMA) */
        for (ut__i64 j = 0; j < nflat; j += V) ut__v_st(out + j, ut__v_dup(b, V), V);
        for (int ky = 0; ky < K; ky++) {
          const float* rp[7];
          float wr[7];
          UT__DW_UNROLL
          for (int kx = 0; kx < K; kx++) {
            rp[kx] = ph + off[ky * K + kx];
            wr[kx] = wk[ky * K + kx];
          }
          for (ut__i64 j = 0; j < nflat; j += V) {
            ut__vec a0 = ut__v_ld(out + j, V), c0 = ut__v_dup(0.0f, V);
            UT__DW_UNROLL
            for (int kx = 0; kx < K; kx++) {
              if (kx & 1)
                c0 = ut__v_fma(c0, wr[kx], ut__v_ld(rp[kx] + j, V), V);
              else
                a0 = ut__v_fma(a0, wr[kx], ut__v_ld(rp[kx] + j, V), V);
            }
            ut__v_st(out + j, ut__v_add(a0, c0, V), V);
          }
        }
        continue;
      }
      float wr[49];
      UT__DW_UNROLL
      for (int t = 0; t < K * K; t++) wr[t] = wk[t];
      /* two vectors a step, four sums: enough chains to cover the FMA's latency; a lone last
         vector alone */
      ut__i64 j = 0;
      for (; j + V < nflat; j += 2 * V) {
        ut__vec a0 = ut__v_dup(b, V), c0 = ut__v_dup(0.0f, V);
        ut__vec a1 = ut__v_dup(b, V), c1 = ut__v_dup(0.0f, V);
        UT__DW_UNROLL
        for (int ky = 0; ky < K; ky++)
          UT__DW_UNROLL
          for (int kx = 0; kx < K; kx++) {
            const float* src = ph + off[ky * K + kx] + j;
            ut__vec x0 = ut__v_ld(src, V), x1 = ut__v_ld(src + V, V);
            if (ky & 1) {
              c0 = ut__v_fma(c0, wr[ky * K + kx], x0, V);
              c1 = ut__v_fma(c1, wr[ky * K + kx], x1, V);
            } else {
              a0 = ut__v_fma(a0, wr[ky * K + kx], x0, V);
              a1 = ut__v_fma(a1, wr[ky * K + kx], x1, V);
            }
          }
        ut__v_st(out + j, ut__v_add(a0, c0, V), V);
        ut__v_st(out + j + V, ut__v_add(a1, c1, V), V);
      }
      if (j < nflat) {
        ut__vec a0 = ut__v_dup(b, V), c0 = ut__v_dup(0.0f, V);
        UT__DW_UNROLL
        for (int ky = 0; ky < K; ky++)
          UT__DW_UNROLL
          for (int kx = 0; kx < K; kx++) {
            ut__vec x0 = ut__v_ld(ph + off[ky * K + kx] + j, V);
            if (ky & 1)
              c0 = ut__v_fma(c0, wr[ky * K + kx], x0, V);
            else
              a0 = ut__v_fma(a0, wr[ky * K + kx], x0, V);
          }
        ut__v_st(out + j, ut__v_add(a0, c0, V), V);
      }
    }
    /* rows in order, whole vectors: a row's spill is overwritten by the next row's start */
    for (int i = 0; i < gn; i++) {
      const float* out = buf + i * per + 4 * psz;
      float* yp = C->y + (g0 + i) * ohw;
      for (int oy = 0; oy < ho; oy++)
        for (int cc = 0; cc < wo; cc += V)
          ut__v_st_lim(yp + (ut__i64)oy * wo + cc,
                       ut__v_relus(ut__v_ld(out + (ut__i64)oy * pw + cc, V), C->act, V), ylim,
                       V);
    }
  }
}

/* Flat engine, one plane (src may be a copy with a margin), TAPS taps. */
UT__CPU_INL void ut__dwf_flat_k(const ut__dwctx* C, const float* restrict src,
                                const float* restrict wk, float b, float* restrict yp,
                                const float* ylim, const int TAPS, const int V) {
  int nvec = C->nvec;
  const int* d = C->d;
  const int32_t* M = C->M;
  for (int j = 0; j < nvec; j++) {
    ut__vec acc = ut__v_dup(b, V);
    const float* sj = src + j * V;
    const int32_t* Mj = M + (ut__i64)j * TAPS * V;
    UT__DW_UNROLL
    for (int t = 0; t < TAPS; t++)
      acc = ut__v_fma(acc, wk[t], ut__v_and(ut__v_ld(sj + d[t], V), Mj + t * V, V), V);
    ut__v_st_lim(yp + j * V, ut__v_relus(acc, C->act, V), ylim, V);
  }
}

/* The plane q of a tensor of `planes` planes of hw floats, or a copy of it with a margin when
   the flat engine's loads would leave the tensor. */
UT__CPU_INL const float* ut__dw_flat_src(const ut__dwctx* C, const float* base, ut__i64 q,
                                         ut__i64 hw, float* restrict pbuf, const int V) {
  const float* p = base + q * hw;
  if (q * hw + C->dmin >= 0 && q * hw + (ut__i64)C->nvec * V + C->dmax <= C->planes * hw)
    return p;
  memcpy(pbuf + C->marg, p, (size_t)hw * sizeof(float));
  return pbuf + C->marg;
}

/* Forward over planes [q0, q1) (also the stride-1 input gradient). */
UT__CPU_INL void ut__dwf_range_body(const ut__dwctx* C, ut__i64 q0, ut__i64 q1,
                                    float* restrict buf, const int V) {
  int c = C->c, kh = C->kh, kw = C->kw, s = C->s;
  ut__i64 hw = (ut__i64)C->h * C->w, ohw = (ut__i64)C->ho * C->wo, taps = (ut__i64)kh * kw;
  const float* ylim = C->y + q1 * ohw;
  if (C->s2 == 3) {
    ut__dwf_s2_planes(C, q0, q1, buf, 3, V);
    return;
  } else if (C->s2 == 5) {
    ut__dwf_s2_planes(C, q0, q1, buf, 5, V);
    return;
  } else if (C->s2 == 7) {
    ut__dwf_s2_planes(C, q0, q1, buf, 7, V);
    return;
  }
  for (ut__i64 q = q0; q < q1; q++) {
    int ch = (int)(q % c);
    const float* wk = C->wt + ch * taps;
    float b = C->bias ? C->bias[ch] : 0.0f;
    float* yp = C->y + q * ohw;
    if (C->flat) {
      const float* src = ut__dw_flat_src(C, C->x, q, hw, buf, V);
      if (taps == 9)
        ut__dwf_flat_k(C, src, wk, b, yp, ylim, 9, V);
      else if (taps == 25)
        ut__dwf_flat_k(C, src, wk, b, yp, ylim, 25, V);
      else
        ut__dwf_flat_k(C, src, wk, b, yp, ylim, (int)taps, V);
      continue;
    }
    const float* xp = C->x + q * hw;
    bool plain = C->dil <= 1;
    if (plain && kh == 3 && kw == 3 && s == 1)
      ut__dwf_rows_k(C, xp, wk, b, yp, ylim, buf, 3, 1, V);
    else if (plain && kh == 5 && kw == 5 && s == 1)
      ut__dwf_rows_k(C, xp, wk, b, yp, ylim, buf, 5, 1, V);
    else if (plain && kh == 7 && kw == 7 && s == 1) /* 10-27% over the any-height engine */
      ut__dwf_rows_k(C, xp, wk, b, yp, ylim, buf, 7, 1, V);
    else if (ut__dw_rows_kw_fits(C))
      ut__dwf_rows_any(C, xp, wk, b, yp, ylim, buf, V);
    else
      ut__dwf_rows_gen(C, xp, wk, b, yp, buf, V);
  }
}

/* Input gradient for stride s >= 2 over planes [q0, q1), as a gather per dx row and column
   phase b (ix = s*qx + b): dx[iy][s*qx+b] = sum over ky = iy+p (mod s), kx = b+p (mod s) of
   wk[ky][kx] * go[(iy+p-ky)/s][qx + (b+p-kx)/s]. go rows are kept zero padded (L floats on the
   left) in a ring; each phase is a contiguous stream. The taps of each (row class, phase) are
   listed once per call; stride 2 interleaves the two phases in registers. */
UT__CPU_INL void ut__dwdx_range_body(const ut__dwctx* C, ut__i64 q0, ut__i64 q1,
                                     float* restrict buf, const int V) {
  int c = C->c, h = C->h, w = C->w, kh = C->kh, kw = C->kw, s = C->s, p = C->py, ho = C->ho,
      wo = C->wo;
  ut__i64 hw = (ut__i64)h * w, ohw = (ut__i64)ho * wo, taps = (ut__i64)kh * kw;
  int L = (kw - 1) / s, nq = (w + s - 1) / s, nvq = (nq + V - 1) / V;
  int GP = (int)UT__DW_R16(L + UT__CPU_MAX(nvq * V, wo) + (s - 1 + p) / s + 1);
  int NS = (kh + s - 1) / s + 1;
  float* ring = buf;
  float* E = ring + (ut__i64)NS * GP;
  const float** tp = (const float**)(void*)(E + (ut__i64)s * nvq * V);
  float* tw = (float*)(void*)(tp + taps);
  const float** grow = /* [NS] this dx row's go rows (8-byte aligned) */
      (const float**)(void*)(tw + taps + (taps & 1));
  int* tags = (int*)(void*)(grow + NS);
  /* tap table: for class a = (iy+p) mod s and phase b, entries (dky, t, e) */
  int* tcnt = tags + NS;           /* [s*s] */
  int* tab = tcnt + (ut__i64)s * s; /* [s*s][taps][3] */
  for (int a = 0; a < s; a++)
    for (int bb = 0; bb < s; bb++) {
      int* cnt = tcnt + a * s + bb;
      int* e3 = tab + (ut__i64)(a * s + bb) * taps * 3;
      *cnt = 0;
      for (int ky = a; ky < kh; ky += s)
        for (int kx = 0; kx < kw; kx++) {
          int u = bb + p - kx;
          if (((u % s) + s) % s != 0) continue;
          e3[*cnt * 3 + 0] = (ky - a) / s;
          e3[*cnt * 3 + 1] = ky * kw + kx;
          e3[*cnt * 3 + 2] = u >= 0 ? u / s : -((-u) / s);
          (*cnt)++;
        }
    }
  const float* dlim = C->y + q1 * hw;
  for (ut__i64 q = q0; q < q1; q++) {
    int ch = (int)(q % c);
    const float* wk = C->wt + ch * taps;
    const float* gp = C->x + q * ohw;
    float* dxp = C->y + q * hw;
    for (int k = 0; k < NS; k++) tags[k] = -1;
    for (int iy = 0; iy < h; iy++) {
      int a = (iy + p) % s, oyb = (iy + p - a) / s;
      /* the go rows oyb - dky this row reads, looked up once for all its phases and taps */
      for (int j = 0; j < NS; j++) {
        int oy = oyb - j;
        if (oy < 0 || oy >= ho) {
          grow[j] = NULL;
          continue;
        }
        int k = oy % NS;
        float* row = ring + (ut__i64)k * GP;
        if (tags[k] != oy) {
          tags[k] = oy;
          for (int jj = 0; jj < L; jj++) row[jj] = 0.0f;
          memcpy(row + L, gp + (ut__i64)oy * wo, (size_t)wo * sizeof(float));
          for (int jj = L + wo; jj < GP; jj++) row[jj] = 0.0f;
        }
        grow[j] = row + L;
      }
      for (int bb = 0; bb < s; bb++) {
        int nt = 0, cnt = tcnt[a * s + bb];
        const int* e3 = tab + (ut__i64)(a * s + bb) * taps * 3;
        for (int i = 0; i < cnt; i++) {
          const float* row = grow[e3[3 * i]];
          if (!row) continue;
          tp[nt] = row + e3[3 * i + 2];
          tw[nt] = wk[e3[3 * i + 1]];
          nt++;
        }
        float* Eb = E + (ut__i64)bb * nvq * V;
        int v = 0;
        for (; v + 2 <= nvq; v += 2) { /* two vectors: two independent sums */
          ut__vec a0 = ut__v_dup(0.0f, V), a1 = ut__v_dup(0.0f, V);
          for (int i = 0; i < nt; i++) {
            a0 = ut__v_fma(a0, tw[i], ut__v_ld(tp[i] + v * V, V), V);
            a1 = ut__v_fma(a1, tw[i], ut__v_ld(tp[i] + v * V + V, V), V);
          }
          ut__v_st(Eb + v * V, a0, V);
          ut__v_st(Eb + v * V + V, a1, V);
        }
        for (; v < nvq; v++) { /* a lone vector: two sums over alternate taps */
          ut__vec a0 = ut__v_dup(0.0f, V), a1 = ut__v_dup(0.0f, V);
          int i = 0;
          for (; i + 1 < nt; i += 2) {
            a0 = ut__v_fma(a0, tw[i], ut__v_ld(tp[i] + v * V, V), V);
            a1 = ut__v_fma(a1, tw[i + 1], ut__v_ld(tp[i + 1] + v * V, V), V);
          }
          if (i < nt) a0 = ut__v_fma(a0, tw[i], ut__v_ld(tp[i] + v * V, V), V);
          ut__v_st(Eb + v * V, ut__v_add(a0, a1, V), V);
        }
      }
      float* dr = dxp + (ut__i64)iy * w;
      if (s == 2) {
        const float* e0 = E;
        const float* e1 = E + (ut__i64)nvq * V;
#if defined(__GNUC__)
        /* whole vectors; the spill past the row lands in rows written later (or is cut) */
        for (int v = 0; v < nvq; v++) {
          ut__vec x0 = ut__v_ld(e0 + v * V, V), x1 = ut__v_ld(e1 + v * V, V);
          ut__vec lo = ut__v_zip_lo(x0, x1, V), hi = ut__v_zip_hi(x0, x1, V);
          float* d0 = dr + 2 * v * V;
          if (2 * v * V < w) ut__v_st_lim(d0, lo, dlim, V);
          if (2 * v * V + V < w) ut__v_st_lim(d0 + V, hi, dlim, V);
        }
#else
        int w2 = w / 2;
        for (int i = 0; i < w2; i++) {
          dr[2 * i] = e0[i];
          dr[2 * i + 1] = e1[i];
        }
        if (w & 1) dr[w - 1] = e0[w2];
#endif
#if defined(__GNUC__)
      } else if (s == 3) { /* whole vectors, as at stride 2 */
        const float* e0 = E;
        const float* e1 = E + (ut__i64)nvq * V;
        const float* e2 = e1 + (ut__i64)nvq * V;
        for (int v = 0; v < nvq; v++) {
          ut__vec x0 = ut__v_ld(e0 + v * V, V), x1 = ut__v_ld(e1 + v * V, V),
                  x2 = ut__v_ld(e2 + v * V, V);
          for (int m = 0; m < 3; m++)
            if (3 * v * V + m * V < w)
              ut__v_st_lim(dr + 3 * v * V + m * V, ut__v_inter3(x0, x1, x2, m, V), dlim, V);
        }
#endif
      } else {
        for (int bb = 0; bb < s; bb++) {
          const float* eb = E + (ut__i64)bb * nvq * V;
          for (int i = 0; i * s + bb < w; i++) dr[i * s + bb] = eb[i];
        }
      }
    }
  }
}

/* Filter gradient of one channel over the batch, row engine: K x K filter, stride S. The 16
   lanes of each tap's float accumulator are added into doubles (acc: taps x 16) every ~128
   vectors and at the end of each plane, in a fixed order. */
UT__CPU_INL void ut__dwdw_rows_k(const ut__dwctx* C, int ch, double* restrict dacc,
                                 float* restrict buf, const int K, const int S, const int V) {
  int c = C->c, h = C->h, w = C->w, py = C->py, px = C->px, ho = C->ho, wo = C->wo;
  int Wq = C->Wq, nv = C->nv, PS = C->PS, SL = C->SL;
  ut__i64 hw = (ut__i64)h * w, ohw = (ut__i64)ho * wo;
  const int NR = S == 1 ? 2 : 1; /* go rows per step (as in ut__dwf_rows_k) */
  const int NI = (NR - 1) * S + K;
  float* slots = buf;
  float* gt0 = buf + (ut__i64)(NI + 1) * SL;
  float* gt1 = gt0 + (ut__i64)nv * V + V;
  int* tags = (int*)(void*)(gt1 + (ut__i64)nv * V + V);
  int flush_rows = UT__CPU_MAX(1, 128 / nv);
  flush_rows += flush_rows & 1;
  for (int n = 0; n < C->planes / c; n++) {
    ut__i64 q = (ut__i64)n * c + ch;
    const float* xp = C->x + q * hw;
    const float* gp = C->go + q * ohw;
    for (int k = 0; k < NI; k++) tags[k] = -1;
    for (int oy0 = 0; oy0 < ho; oy0 += flush_rows) {
      int oy1 = UT__CPU_MIN(ho, oy0 + flush_rows);
      ut__vec A[25];
      UT__DW_UNROLL
      for (int t = 0; t < K * K; t++) A[t] = ut__v_dup(0.0f, V);
      for (int oy = oy0; oy < oy1; oy += NR) {
        const float* rp[6];
        UT__DW_UNROLL
        for (int r = 0; r < NI; r++)
          rp[r] = ut__dw_row(xp, oy * S - py + r, h, w, S, px, Wq, PS, SL, NI, slots, tags, V);
        memcpy(gt0, gp + (ut__i64)oy * wo, (size_t)wo * sizeof(float));
        if (NR == 2) {
          if (oy + 1 < ho) {
            memcpy(gt1, gp + (ut__i64)(oy + 1) * wo, (size_t)wo * sizeof(float));
          } else {
            for (int i = 0; i < wo; i++) gt1[i] = 0.0f;
            rp[NI - 1] = slots; /* the zero slot: 0 * x could be NaN */
          }
          for (int v = 0; v < nv; v++) {
            ut__vec g0 = ut__v_ld(gt0 + v * V, V), g1 = ut__v_ld(gt1 + v * V, V);
            UT__DW_UNROLL
            for (int r = 0; r < NI; r++)
              UT__DW_UNROLL
              for (int kx = 0; kx < K; kx++) {
                ut__vec xv = ut__v_ld(rp[r] + kx + v * V, V);
                if (r < K) A[r * K + kx] = ut__v_fmav(A[r * K + kx], g0, xv, V);
                if (r >= 1) A[(r - 1) * K + kx] = ut__v_fmav(A[(r - 1) * K + kx], g1, xv, V);
              }
          }
        } else {
          for (int v = 0; v < nv; v++) {
            ut__vec g = ut__v_ld(gt0 + v * V, V);
            UT__DW_UNROLL
            for (int ky = 0; ky < K; ky++)
              UT__DW_UNROLL
              for (int kx = 0; kx < K; kx++)
                A[ky * K + kx] = ut__v_fmav(
                    A[ky * K + kx], g, ut__v_ld(rp[ky] + (kx % S) * PS + kx / S + v * V, V), V);
          }
        }
      }
      UT__DW_UNROLL
      for (int t = 0; t < K * K; t++) ut__v_acc_d(dacc + t * V, A[t], V);
    }
  }
}

/* Filter gradient, row engine, any geometry (float lanes per tap in memory). */
UT__CPU_INL void ut__dwdw_rows_gen(const ut__dwctx* C, int ch, double* restrict dacc,
                                   float* restrict buf, const int V) {
  int c = C->c, h = C->h, w = C->w, kh = C->kh, kw = C->kw, s = C->s, py = C->py, px = C->px,
      ho = C->ho, wo = C->wo;
  int Wq = C->Wq, nv = C->nv, PS = C->PS, SL = C->SL;
  ut__i64 hw = (ut__i64)h * w, ohw = (ut__i64)ho * wo, taps = (ut__i64)kh * kw;
  float* slots = buf;
  float* gt = buf + (ut__i64)(kh + 1) * SL;
  float* A = gt + (ut__i64)nv * V + V;
  int* tags = (int*)(void*)(A + taps * V);
  int flush_rows = UT__CPU_MAX(1, 128 / nv);
  for (int n = 0; n < C->planes / c; n++) {
    ut__i64 q = (ut__i64)n * c + ch;
    const float* xp = C->x + q * hw;
    const float* gp = C->go + q * ohw;
    for (int k = 0; k < kh; k++) tags[k] = -1;
    for (int oy0 = 0; oy0 < ho; oy0 += flush_rows) {
      int oy1 = UT__CPU_MIN(ho, oy0 + flush_rows);
      for (ut__i64 t = 0; t < taps; t++) ut__v_st(A + t * V, ut__v_dup(0.0f, V), V);
      for (int oy = oy0; oy < oy1; oy++) {
        memcpy(gt, gp + (ut__i64)oy * wo, (size_t)wo * sizeof(float));
        for (int ky = 0; ky < kh; ky++) {
          int iy = oy * s - py + ky;
          if (iy < 0 || iy >= h) continue;
          const float* r = ut__dw_row(xp, iy, h, w, s, px, Wq, PS, SL, kh, slots, tags, V);
          for (int kx = 0; kx < kw; kx++) {
            const float* src = r + (ut__i64)(kx % s) * PS + kx / s;
            float* a = A + (ut__i64)(ky * kw + kx) * V;
            ut__vec av = ut__v_ld(a, V);
            for (int v = 0; v < nv; v++)
              av = ut__v_fmav(av, ut__v_ld(gt + v * V, V), ut__v_ld(src + v * V, V), V);
            ut__v_st(a, av, V);
          }
        }
      }
      for (ut__i64 t = 0; t < taps; t++) ut__v_acc_d(dacc + t * V, ut__v_ld(A + t * V, V), V);
    }
  }
}

/* Filter gradient of one channel over the batch, any filter height: KW taps a row (a constant
   when inlined with a literal), any stride, taps C->dil apart. Blocks of UT__DWDW_RB go rows:
   the input rows a block reads are split into phase rows once (a ring of NB slots), then each
   filter row's KW taps are summed in registers over the whole block (2 or 4 sets over go rows
   when KW <= 3, for independent chains), into float partial sums per tap that are added
   into the doubles every ~128 vectors, as ut__dwdw_rows_k does. */
UT__CPU_INL void ut__dwdw_rows_kw(const ut__dwctx* C, int ch, double* restrict dacc,
                                  float* restrict buf, const int KW, const int V) {
  int c = C->c, h = C->h, w = C->w, kh = C->kh, s = C->s, py = C->py, px = C->px, ho = C->ho,
      wo = C->wo;
  int Wq = C->Wq, nv = C->nv, PS = C->PS, SL = C->SL, D = C->dil > 1 ? C->dil : 1;
  ut__i64 hw = (ut__i64)h * w, ohw = (ut__i64)ho * wo;
  const int RB = UT__DWDW_RB;
  const int NA = KW <= 2 ? 4 : KW == 3 ? 2 : 1; /* NA * KW >= 4 independent sums */
  int NB = (RB - 1) * s + (kh - 1) * D + 1, GS = nv * V + V;
  float* slots = buf;
  float* gt = buf + (ut__i64)(NB + 1) * SL; /* the block's go rows, zero past wo */
  float* A = gt + (ut__i64)RB * GS;          /* [kh * KW][V] float partial sums */
  int* tags = (int*)(void*)(A + (ut__i64)kh * KW * V);
  float* tmp = A + (ut__i64)kh * KW * V + 64;
  int flush = UT__CPU_MAX(RB, 128 / nv / RB * RB);
  int off[7];
  UT__DW_UNROLL
  for (int kx = 0; kx < KW; kx++) off[kx] = (kx * D % s) * PS + kx * D / s;
  const float** rows = (const float**)(void*)(tmp + (ut__i64)s * (PS + V) + 16);
  for (int n = 0; n < C->planes / c; n++) {
    ut__i64 q = (ut__i64)n * c + ch;
    const float* xp = C->x + q * hw;
    const float* gp = C->go + q * ohw;
    for (int k = 0; k < NB; k++) tags[k] = -1;
    for (int oy0 = 0; oy0 < ho; oy0 += flush) {
      int oyf = UT__CPU_MIN(ho, oy0 + flush);
      for (ut__i64 t = 0; t < (ut__i64)kh * KW; t++) ut__v_st(A + t * V, ut__v_dup(0.0f, V), V);
      for (int ob = oy0; ob < oyf; ob += RB) {
        int nb = UT__CPU_MIN(RB, oyf - ob), nr = (nb - 1) * s + (kh - 1) * D + 1;
        for (int i = 0; i < nr; i++)
          rows[i] = ut__dw_row_split(xp, ob * s - py + i, h, w, s, px, Wq, PS, SL, NB, slots,
                                     tags, tmp, V);
        for (int r = 0; r < nb; r++)
          memcpy(gt + (ut__i64)r * GS, gp + (ut__i64)(ob + r) * wo, (size_t)wo * sizeof(float));
        for (int ky = 0; ky < kh; ky++) {
          float* Ak = A + (ut__i64)ky * KW * V;
          ut__vec a[4][7]; /* NA sets of KW sums, one per go row of each group of NA */
          UT__DW_UNROLL
          for (int j = 0; j < NA; j++)
            UT__DW_UNROLL
            for (int kx = 0; kx < KW; kx++)
              a[j][kx] = j ? ut__v_dup(0.0f, V) : ut__v_ld(Ak + kx * V, V);
          int r = 0;
          for (; r + NA <= nb; r += NA) {
            const float* pj[4];
            UT__DW_UNROLL
            for (int j = 0; j < NA; j++) pj[j] = rows[(r + j) * s + ky * D];
            const float* g0 = gt + (ut__i64)r * GS;
            for (int v = 0; v < nv; v++)
              UT__DW_UNROLL
              for (int j = 0; j < NA; j++) {
                ut__vec G = ut__v_ld(g0 + (ut__i64)j * GS + v * V, V);
                UT__DW_UNROLL
                for (int kx = 0; kx < KW; kx++)
                  a[j][kx] = ut__v_fmav(a[j][kx], G, ut__v_ld(pj[j] + off[kx] + v * V, V), V);
              }
          }
          for (; r < nb; r++) {
            const float* p0 = rows[r * s + ky * D];
            const float* g0 = gt + (ut__i64)r * GS;
            for (int v = 0; v < nv; v++) {
              ut__vec G0 = ut__v_ld(g0 + v * V, V);
              UT__DW_UNROLL
              for (int kx = 0; kx < KW; kx++)
                a[0][kx] = ut__v_fmav(a[0][kx], G0, ut__v_ld(p0 + off[kx] + v * V, V), V);
            }
          }
          UT__DW_UNROLL
          for (int j = 1; j < NA; j++)
            UT__DW_UNROLL
            for (int kx = 0; kx < KW; kx++) a[0][kx] = ut__v_add(a[0][kx], a[j][kx], V);
          UT__DW_UNROLL
          for (int kx = 0; kx < KW; kx++) ut__v_st(Ak + kx * V, a[0][kx], V);
        }
      }
      for (ut__i64 t = 0; t < (ut__i64)kh * KW; t++)
        ut__v_acc_d(dacc + t * V, ut__v_ld(A + t * V, V), V);
    }
  }
}
UT__CPU_INL void ut__dwdw_rows_any(const ut__dwctx* C, int ch, double* restrict dacc,
                                   float* restrict buf, const int V) {
  switch (C->kw) {
    case 1: ut__dwdw_rows_kw(C, ch, dacc, buf, 1, V); break;
    case 2: ut__dwdw_rows_kw(C, ch, dacc, buf, 2, V); break;
    case 3: ut__dwdw_rows_kw(C, ch, dacc, buf, 3, V); break;
    case 4: ut__dwdw_rows_kw(C, ch, dacc, buf, 4, V); break;
    case 5: ut__dwdw_rows_kw(C, ch, dacc, buf, 5, V); break;
    case 6: ut__dwdw_rows_kw(C, ch, dacc, buf, 6, V); break;
    default: ut__dwdw_rows_kw(C, ch, dacc, buf, 7, V); break;
  }
}

/* Filter gradient, flat engine, TAPS taps: go lanes past the plane are masked by the
   output-valid mask, x lanes outside the plane by the tap masks. */
UT__CPU_INL void ut__dwdw_flat_k(const ut__dwctx* C, int ch, double* restrict dacc,
                                 float* restrict buf, const int TAPS, const int V) {
  int c = C->c, nvec = C->nvec;
  ut__i64 hw = (ut__i64)C->h * C->w;
  const int* d = C->d;
  const int32_t* M = C->M;
  const int32_t* Mo = M + (ut__i64)nvec * TAPS * V;
  float* xbuf = buf;
  float* gbuf = buf + UT__DW_R16(2 * C->marg + (ut__i64)nvec * V + V);
  ut__vec A[25];
  int nb = C->planes / c;
  int flush = UT__CPU_MAX(1, 128 / nvec);
  for (int n0 = 0; n0 < nb; n0 += flush) {
    UT__DW_UNROLL
    for (int t = 0; t < TAPS; t++) A[t] = ut__v_dup(0.0f, V);
    for (int n = n0; n < UT__CPU_MIN(nb, n0 + flush); n++) {
      ut__i64 q = (ut__i64)n * c + ch;
      const float* xs = ut__dw_flat_src(C, C->x, q, hw, xbuf, V);
      const float* gs = ut__dw_flat_src(C, C->go, q, hw, gbuf, V);
      for (int j = 0; j < nvec; j++) {
        ut__vec g = ut__v_and(ut__v_ld(gs + j * V, V), Mo + j * V, V);
        const float* sj = xs + j * V;
        const int32_t* Mj = M + (ut__i64)j * TAPS * V;
        UT__DW_UNROLL
        for (int t = 0; t < TAPS; t++)
          A[t] = ut__v_fmav(A[t], g, ut__v_and(ut__v_ld(sj + d[t], V), Mj + t * V, V), V);
      }
    }
    UT__DW_UNROLL
    for (int t = 0; t < TAPS; t++) ut__v_acc_d(dacc + t * V, A[t], V);
  }
}

UT__CPU_INL void ut__dwdw_chan_body(const ut__dwctx* C, int ch, double* restrict dacc,
                                    float* restrict buf, const int V) {
  int kh = C->kh, kw = C->kw, s = C->s;
  if (C->flat) {
    if (kh * kw == 9)
      ut__dwdw_flat_k(C, ch, dacc, buf, 9, V);
    else if (kh * kw == 25)
      ut__dwdw_flat_k(C, ch, dacc, buf, 25, V);
    else
      ut__dwdw_rows_gen(C, ch, dacc, buf, V); /* (flat is only chosen for 9 and 25 taps) */
    return;
  }
  bool plain = C->dil <= 1;
  if (plain && kh == 3 && kw == 3 && s == 1)
    ut__dwdw_rows_k(C, ch, dacc, buf, 3, 1, V);
  else if (plain && kh == 5 && kw == 5 && s == 1)
    ut__dwdw_rows_k(C, ch, dacc, buf, 5, 1, V);
  else if (ut__dw_rows_kw_fits(C))
    ut__dwdw_rows_any(C, ch, dacc, buf, V);
  else
    ut__dwdw_rows_gen(C, ch, dacc, buf, V);
}

/* ---- transposed-convolution gather (col2im) -------------------------------------------------- */
/* Adjoint of a strided correlation for one plane, as a gather per input row: dx[iy, ix] =
   sum over taps (ky, kx) and output pixels (oy, ox) with oy*s-p+ky = iy, ox*s-p+kx = ix of
   wk[ky,kx] * src_tap[oy, ox], where src_tap = src + (ky*kw+kx)*tap_stride ([ho, wo]).
   tmp holds s rows of ceil(w/s) (unused when s == 1): contributions land in phase rows
   (ix mod s) contiguously and are interleaved into dx at the end of each row. */
UT__CPU_INL void ut__cpu_tconv_body(const float* restrict src, ut__i64 tap_stride,
                                    const float* restrict wk, float* restrict dx, int h, int w,
                                    int kh, int kw, int s, int p, int ho, int wo,
                                    float* restrict tmp) {
  int qn = (w + s - 1) / s;
  for (int iy = 0; iy < h; iy++) {
    float* dxr = dx + (ut__i64)iy * w;
    float* acc = s == 1 ? dxr : tmp;
    for (int i = 0; i < s * qn; i++) acc[i] = 0.0f;
    for (int ky = 0; ky < kh; ky++) {
      int t = iy + p - ky;
      if (t < 0 || t % s != 0) continue;
      int oy = t / s;
      if (oy >= ho) continue;
      for (int kx = 0; kx < kw; kx++) {
        float wv = wk[ky * kw + kx];
        const float* restrict gr = src + (ky * kw + kx) * tap_stride + (ut__i64)oy * wo;
        int lo = ut__cpu_lo(kx, s, p, wo), hi = ut__cpu_hi(kx, s, p, w, wo);
        int d = kx - p; /* ix = ox*s + d = (ox + qd)*s + rd */
        int qd = d >= 0 ? d / s : -((-d + s - 1) / s);
        int rd = d - qd * s;
        float* ar = acc + rd * qn;
        for (int ox = lo; ox < hi; ox++) ar[ox + qd] += wv * gr[ox];
      }
    }
    if (s > 1) {
      if (s == 2) {
        int q2 = w / 2;
        for (int q = 0; q < q2; q++) {
          dxr[2 * q] = tmp[q];
          dxr[2 * q + 1] = tmp[qn + q];
        }
        if (w & 1) dxr[w - 1] = tmp[q2];
      } else {
        for (int r = 0; r < s; r++)
          for (int q = 0; q * s + r < w; q++) dxr[q * s + r] = tmp[r * qn + q];
      }
    }
  }
}

/* ---- GEMM micro-kernel and dot-product engine -------------------------------------------------
   C tile (mr x nr valid of MR x 2V) = alpha * A_panel B_panel + beta * C (beta 0: not read). */
/* A packed panel's NN (1 to 4) columns from j0 on as vectors over its 8 rows of A (eight floats
   a step: a half vector of AVX-512), a broadcast of B each, into nacc[j]; with VEC also its
   first V columns as ut__gemm_micro_body's one-vector path does, into acc0. Each value is the
   same FMAs in the same order as there (fma(a, b, s) = fma(b, a, s)). */
UT__CPU_INL void ut__gemm_micro_narrow(int kc, const float* restrict ap,
                                       const float* restrict bp, ut__i64 b_ks, int j0,
                                       ut__vec* acc0, ut__vec* nacc, const bool VEC, const int NN,
                                       const int V) {
  for (int k = 0; k < kc; k++) {
    if (VEC) {
      ut__vec b0 = ut__v_ld(bp, V);
      UT__DW_UNROLL
      for (int r = 0; r < 8; r++) acc0[r] = ut__v_fma(acc0[r], ap[r], b0, V);
    }
    ut__vec a8 = ut__v_ld(ap, 8);
    UT__DW_UNROLL
    for (int j = 0; j < NN; j++) nacc[j] = ut__v_fma(nacc[j], bp[j0 + j], a8, 8);
    ap += 8;
    bp += b_ks;
  }
}

/* A full tile's rows stored, through inference's epilogue when EPI (act a constant at each
   call, so its tests fold away) */
UT__CPU_INL void ut__gemm_store_tile(float* restrict c, ut__i64 ldc, const ut__vec* acc0,
                                     const ut__vec* acc1, const float* rs, const float* rt,
                                     int act, const bool EPI, const int V, const int MR) {
  UT__DW_UNROLL
  for (int r = 0; r < MR; r++) {
    float* cr = c + (ut__i64)r * ldc;
    ut__vec o0 = acc0[r], o1 = acc1[r];
    if (EPI) {
      o0 = ut__v_epi(o0, rs[r], rt[r], act, V);
      o1 = ut__v_epi(o1, rs[r], rt[r], act, V);
    }
    ut__v_st(cr, o0, V);
    ut__v_st(cr + V, o1, V);
  }
}

UT__CPU_INL void ut__gemm_micro_body(int kc, const float* restrict ap, ut__i64 a_rs,
                                     ut__i64 a_ks, const float* restrict bp, ut__i64 b_ks,
                                     float* restrict c, ut__i64 ldc, int mr, int nr, float alpha,
                                     float beta, const float* rs, const float* rt, int act,
                                     const int V, const int MR) {
  ut__vec acc0[8], acc1[8];
  UT__DW_UNROLL
  for (int r = 0; r < MR; r++) {
    acc0[r] = acc1[r] = ut__v_dup(0.0f, V);
    UT__PREFETCH_W(c + (ut__i64)r * ldc);
    UT__PREFETCH_W(c + (ut__i64)r * ldc + 2 * V - 1);
  }
  /* a last panel's few columns past a vector (7^2 planes: 49 = 32 + 16 + 1; 14^2: 196 = 6 * 32
     + 4) as vectors over the rows (AVX-512's 8 x 32 tiles), where a vector of B would compute
     up to V - 1 columns for nothing: a 17-column panel's step 16 FMAs of 16 lanes -> 8 and one
     of 8 (960 x 160 x 49 on one core 82 -> 97 GFLOP/s) */
  ut__vec nacc[4];
  int nn = 0, jn = 0;
  if (V == 16 && a_rs == 1 && a_ks == MR && ut__gemm_narrow(nr, MR, 2 * V)) {
    jn = nr <= 4 ? 0 : V;
    nn = nr - jn;
    for (int j = 0; j < 4; j++) nacc[j] = ut__v_dup(0.0f, 8);
    bool vec = jn > 0;
    switch (nn) {
      case 1:
        if (vec) ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, true, 1, V);
        else ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, false, 1, V);
        break;
      case 2:
        if (vec) ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, true, 2, V);
        else ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, false, 2, V);
        break;
      case 3:
        if (vec) ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, true, 3, V);
        else ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, false, 3, V);
        break;
      default:
        if (vec) ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, true, 4, V);
        else ut__gemm_micro_narrow(kc, ap, bp, b_ks, jn, acc0, nacc, false, 4, V);
        break;
    }
  } else if (nr <= V && a_rs == 1 && a_ks == MR) {
    /* a last panel of at most V columns (196 = 6 * 32 + 4 over 14^2 planes): one vector of
       B, half the FMAs; the sums of its columns are the same operations in the same order */
    for (int k = 0; k < kc; k++) {
      ut__vec b0 = ut__v_ld(bp, V);
      UT__DW_UNROLL
      for (int r = 0; r < MR; r++) acc0[r] = ut__v_fma(acc0[r], ap[r], b0, V);
      ap += MR;
      bp += b_ks;
    }
  } else if (a_rs == 1 && a_ks == MR) {
    /* a packed panel: the MR values of a step sit together, one address register for all */
    for (int k = 0; k < kc; k++) {
      ut__vec b0 = ut__v_ld(bp, V), b1 = ut__v_ld(bp + V, V);
      UT__DW_UNROLL
      for (int r = 0; r < MR; r++) {
        float av = ap[r];
        acc0[r] = ut__v_fma(acc0[r], av, b0, V);
        acc1[r] = ut__v_fma(acc1[r], av, b1, V);
      }
      ap += MR;
      bp += b_ks;
    }
  } else {
    for (int k = 0; k < kc; k++) {
      /* A read in place, MR rows of a (cold) weight at once: each row a line ahead of use */
      if ((k & 15) == 0 && a_ks == 1)
        for (int r = 0; r < mr; r++) UT__PREFETCH_R(ap + r * a_rs + 64);
      ut__vec b0 = ut__v_ld(bp, V), b1 = ut__v_ld(bp + V, V);
      UT__DW_UNROLL
      for (int r = 0; r < MR; r++) {
        float av = ap[r * a_rs];
        acc0[r] = ut__v_fma(acc0[r], av, b0, V);
        acc1[r] = ut__v_fma(acc1[r], av, b1, V);
      }
      ap += a_ks;
      bp += b_ks;
    }
  }
  if (mr == MR && nr == 2 * V && alpha == 1.0f && beta == 0.0f) {
    /* the common full tile (inference's forward, training's products): the epilogue's
       activation chosen once per tile, not per row (each row's tests cost a small-k product,
       24 -> 144 over 56^2 on one core, ~8% of the micro-kernel's time); x * 1 is x */
    if (!rs)
      ut__gemm_store_tile(c, ldc, acc0, acc1, NULL, NULL, UT_ACT_NONE, false, V, MR);
    else if (act == UT_ACT_RELU6)
      ut__gemm_store_tile(c, ldc, acc0, acc1, rs, rt, UT_ACT_RELU6, true, V, MR);
    else if (act == UT_ACT_RELU)
      ut__gemm_store_tile(c, ldc, acc0, acc1, rs, rt, UT_ACT_RELU, true, V, MR);
    else /* UT_ACT_NONE: the kernels take no other (ut__cpu_gemm_task) */
      ut__gemm_store_tile(c, ldc, acc0, acc1, rs, rt, UT_ACT_NONE, true, V, MR);
  } else if (mr == MR && nr == 2 * V) {
    UT__DW_UNROLL
    for (int r = 0; r < MR; r++) {
      float* cr = c + (ut__i64)r * ldc;
      ut__vec o0 = ut__v_scale(acc0[r], alpha, V), o1 = ut__v_scale(acc1[r], alpha, V);
      if (beta != 0.0f) {
        o0 = ut__v_fma(o0, beta, ut__v_ld(cr, V), V);
        o1 = ut__v_fma(o1, beta, ut__v_ld(cr + V, V), V);
      }
      if (rs) {
        o0 = ut__v_epi(o0, rs[r], rt[r], act, V);
        o1 = ut__v_epi(o1, rs[r], rt[r], act, V);
      }
      ut__v_st(cr, o0, V);
      ut__v_st(cr + V, o1, V);
    }
  } else {
    float buf[8 * 2 * 16];
    UT__DW_UNROLL
    for (int r = 0; r < MR; r++) {
      ut__v_st(buf + r * 2 * V, acc0[r], V);
      ut__v_st(buf + r * 2 * V + V, acc1[r], V);
    }
    for (int j = 0; j < nn; j++) { /* the narrow columns: lane r is row r */
      float col[8];
      ut__v_st(col, nacc[j], 8);
      for (int r = 0; r < 8; r++) buf[r * 2 * V + jn + j] = col[r];
    }
    /* the epilogue on the tile's row as vectors (ut__v_epi: ut__epi_scalar's operations lane by
       lane, so the same bits), its lanes past nr computed and dropped: value by value, its
       branches and stores cost more than the edge panel's products (a 1x1 160 -> 960 over
       7^2 with BatchNorm and ReLU6, one core: 213 -> 168 us; 28^2 and 14^2 planes end in such
       panels too) */
    for (int r = 0; r < mr; r++) {
      float* cr = c + (ut__i64)r * ldc;
      float* br = buf + r * 2 * V;
      for (int j = 0; j < nr; j++) {
        float v = alpha * br[j];
        br[j] = beta != 0.0f ? v + beta * cr[j] : v;
      }
      if (rs) {
        ut__v_st(br, ut__v_epi(ut__v_ld(br, V), rs[r], rt[r], act, V), V);
        if (nr > V) ut__v_st(br + V, ut__v_epi(ut__v_ld(br + V, V), rs[r], rt[r], act, V), V);
      }
      for (int j = 0; j < nr; j++) cr[j] = br[j];
    }
  }
}

/* Dot-product engine for C = sum_b A_b B_b^T with both operands k-contiguous (the weight
   gradient: no transposing pack). For an mc x nc block at A[i0, k0] / B[j0, k0], adds the
   products over kc into VL-lane accumulators acc[tile][RM x RN] (reduced later, in a fixed
   order, by ut__cpu_dot_finish). Edge tiles repeat the last row / column and drop it. */
UT__CPU_INL void ut__gemm_dot_body(const float* a, int lda, const float* b, int ldb, int mc,
                                   int nc, int kc, float* acc, const int V, const int RM,
                                   const int RN) {
  int ntj = (nc + RN - 1) / RN, kv = kc / V * V, rem = kc - kv;
  for (int ti = 0; ti * RM < mc; ti++) {
    const float* ar[4];
    UT__DW_UNROLL
    for (int r = 0; r < RM; r++) ar[r] = a + (ut__i64)UT__CPU_MIN(ti * RM + r, mc - 1) * lda;
    for (int tj = 0; tj < ntj; tj++) {
      const float* br[4];
      UT__DW_UNROLL
      for (int q = 0; q < RN; q++) br[q] = b + (ut__i64)UT__CPU_MIN(tj * RN + q, nc - 1) * ldb;
      float* ap = acc + ((ut__i64)ti * ntj + tj) * (RM * RN * V);
      ut__vec s[4][4];
      UT__DW_UNROLL
      for (int r = 0; r < RM; r++)
        UT__DW_UNROLL
        for (int q = 0; q < RN; q++) s[r][q] = ut__v_ld(ap + (r * RN + q) * V, V);
      for (int kk = 0; kk < kv; kk += V) {
        ut__vec av[4], bv[4];
        UT__DW_UNROLL
        for (int r = 0; r < RM; r++) av[r] = ut__v_ld(ar[r] + kk, V);
        UT__DW_UNROLL
        for (int q = 0; q < RN; q++) bv[q] = ut__v_ld(br[q] + kk, V);
        UT__DW_UNROLL
        for (int r = 0; r < RM; r++)
          UT__DW_UNROLL
          for (int q = 0; q < RN; q++) s[r][q] = ut__v_fmav(s[r][q], av[r], bv[q], V);
      }
      if (rem) {
        ut__vec av[4], bv[4];
        UT__DW_UNROLL
        for (int r = 0; r < RM; r++) {
          float t[16] = {0};
          memcpy(t, ar[r] + kv, (size_t)rem * sizeof(float));
          av[r] = ut__v_ld(t, V);
        }
        UT__DW_UNROLL
        for (int q = 0; q < RN; q++) {
          float t[16] = {0};
          memcpy(t, br[q] + kv, (size_t)rem * sizeof(float));
          bv[q] = ut__v_ld(t, V);
        }
        UT__DW_UNROLL
        for (int r = 0; r < RM; r++)
          UT__DW_UNROLL
          for (int q = 0; q < RN; q++) s[r][q] = ut__v_fmav(s[r][q], av[r], bv[q], V);
      }
      UT__DW_UNROLL
      for (int r = 0; r < RM; r++)
        UT__DW_UNROLL
        for (int q = 0; q < RN; q++) ut__v_st(ap + (r * RN + q) * V, s[r][q], V);
    }
  }
}

/* ut__cpu_pack_a's common case (rows of A, 8 of them): 8 x 8 blocks transposed in registers
   (three rounds of two-vector shuffles) instead of 64 strided scalar stores; the columns past
   the last whole block one by one. */
UT__CPU_INL void ut__gemm_pack8_body(const float* a, ut__i64 lda, int kc, float* dst) {
  int k = 0;
#if defined(__GNUC__)
  for (; k + 8 <= kc; k += 8) {
    ut__v8f r0, r1, r2, r3, r4, r5, r6, r7;
    r0 = *(const ut__v8fu*)(const void*)(a + k);
    r1 = *(const ut__v8fu*)(const void*)(a + lda + k);
    r2 = *(const ut__v8fu*)(const void*)(a + 2 * lda + k);
    r3 = *(const ut__v8fu*)(const void*)(a + 3 * lda + k);
    r4 = *(const ut__v8fu*)(const void*)(a + 4 * lda + k);
    r5 = *(const ut__v8fu*)(const void*)(a + 5 * lda + k);
    r6 = *(const ut__v8fu*)(const void*)(a + 6 * lda + k);
    r7 = *(const ut__v8fu*)(const void*)(a + 7 * lda + k);
    /* pairs of rows interleaved, then pairs of pairs, then the two halves */
    ut__v8f t0 = UT__V_SHUFFLE(r0, r1, ut__v8i, 0, 8, 1, 9, 4, 12, 5, 13);
    ut__v8f t1 = UT__V_SHUFFLE(r0, r1, ut__v8i, 2, 10, 3, 11, 6, 14, 7, 15);
    ut__v8f t2 = UT__V_SHUFFLE(r2, r3, ut__v8i, 0, 8, 1, 9, 4, 12, 5, 13);
    ut__v8f t3 = UT__V_SHUFFLE(r2, r3, ut__v8i, 2, 10, 3, 11, 6, 14, 7, 15);
    ut__v8f t4 = UT__V_SHUFFLE(r4, r5, ut__v8i, 0, 8, 1, 9, 4, 12, 5, 13);
    ut__v8f t5 = UT__V_SHUFFLE(r4, r5, ut__v8i, 2, 10, 3, 11, 6, 14, 7, 15);
    ut__v8f t6 = UT__V_SHUFFLE(r6, r7, ut__v8i, 0, 8, 1, 9, 4, 12, 5, 13);
    ut__v8f t7 = UT__V_SHUFFLE(r6, r7, ut__v8i, 2, 10, 3, 11, 6, 14, 7, 15);
    ut__v8f u0 = UT__V_SHUFFLE(t0, t2, ut__v8i, 0, 1, 8, 9, 4, 5, 12, 13);
    ut__v8f u1 = UT__V_SHUFFLE(t0, t2, ut__v8i, 2, 3, 10, 11, 6, 7, 14, 15);
    ut__v8f u2 = UT__V_SHUFFLE(t1, t3, ut__v8i, 0, 1, 8, 9, 4, 5, 12, 13);
    ut__v8f u3 = UT__V_SHUFFLE(t1, t3, ut__v8i, 2, 3, 10, 11, 6, 7, 14, 15);
    ut__v8f u4 = UT__V_SHUFFLE(t4, t6, ut__v8i, 0, 1, 8, 9, 4, 5, 12, 13);
    ut__v8f u5 = UT__V_SHUFFLE(t4, t6, ut__v8i, 2, 3, 10, 11, 6, 7, 14, 15);
    ut__v8f u6 = UT__V_SHUFFLE(t5, t7, ut__v8i, 0, 1, 8, 9, 4, 5, 12, 13);
    ut__v8f u7 = UT__V_SHUFFLE(t5, t7, ut__v8i, 2, 3, 10, 11, 6, 7, 14, 15);
    float* d = dst + (ut__i64)k * 8;
    *(ut__v8fu*)(void*)(d + 0) = UT__V_SHUFFLE(u0, u4, ut__v8i, 0, 1, 2, 3, 8, 9, 10, 11);
    *(ut__v8fu*)(void*)(d + 8) = UT__V_SHUFFLE(u1, u5, ut__v8i, 0, 1, 2, 3, 8, 9, 10, 11);
    *(ut__v8fu*)(void*)(d + 16) = UT__V_SHUFFLE(u2, u6, ut__v8i, 0, 1, 2, 3, 8, 9, 10, 11);
    *(ut__v8fu*)(void*)(d + 24) = UT__V_SHUFFLE(u3, u7, ut__v8i, 0, 1, 2, 3, 8, 9, 10, 11);
    *(ut__v8fu*)(void*)(d + 32) = UT__V_SHUFFLE(u0, u4, ut__v8i, 4, 5, 6, 7, 12, 13, 14, 15);
    *(ut__v8fu*)(void*)(d + 40) = UT__V_SHUFFLE(u1, u5, ut__v8i, 4, 5, 6, 7, 12, 13, 14, 15);
    *(ut__v8fu*)(void*)(d + 48) = UT__V_SHUFFLE(u2, u6, ut__v8i, 4, 5, 6, 7, 12, 13, 14, 15);
    *(ut__v8fu*)(void*)(d + 56) = UT__V_SHUFFLE(u3, u7, ut__v8i, 4, 5, 6, 7, 12, 13, 14, 15);
  }
#endif
  for (; k < kc; k++)
    for (int r = 0; r < 8; r++) dst[(ut__i64)k * 8 + r] = a[(ut__i64)r * lda + k];
}

/* ---- the wrappers, one set per ISA ---------------------------------------------------------- */
#if defined(__AVX512F__)
#define UT__CPU_BASE_LANES 16
#elif defined(__AVX__)
#define UT__CPU_BASE_LANES 8
#else
#define UT__CPU_BASE_LANES 4
#endif

#ifdef UT__CPU_X86
UT__TGT_AVX512 UT__CPU_OPT static void ut__dw_forward_planes_avx512(const ut__dwctx* C,
                                                                   ut__i64 q0, ut__i64 q1,
                                                                   float* buf) {
  ut__dwf_range_body(C, q0, q1, buf, 16);
}
UT__TGT_AVX512 UT__CPU_OPT static void ut__dw_dx_planes_avx512(const ut__dwctx* C, ut__i64 q0,
                                                              ut__i64 q1, float* buf) {
  ut__dwdx_range_body(C, q0, q1, buf, 16);
}
UT__TGT_AVX512 UT__CPU_OPT static void ut__dw_dw_channel_avx512(const ut__dwctx* C, int ch,
                                                               double* dacc, float* buf) {
  ut__dwdw_chan_body(C, ch, dacc, buf, 16);
}
UT__TGT_AVX512 UT__CPU_OPT static void ut__tconv_plane_avx512(
    const float* src, ut__i64 tap_stride, const float* wk, float* dx, int h, int w, int kh,
    int kw, int s, int p, int ho, int wo, float* tmp) {
  ut__cpu_tconv_body(src, tap_stride, wk, dx, h, w, kh, kw, s, p, ho, wo, tmp);
}
UT__TGT_AVX512 UT__CPU_OPT static void ut__gemm_micro_avx512(
    int kc, const float* ap, ut__i64 a_rs, ut__i64 a_ks, const float* bp, ut__i64 b_ks, float* c,
    ut__i64 ldc, int mr, int nr, float alpha, float beta, const float* rs, const float* rt,
    int act) {
  ut__gemm_micro_body(kc, ap, a_rs, a_ks, bp, b_ks, c, ldc, mr, nr, alpha, beta, rs, rt, act, 16,
                      8);
}
UT__TGT_AVX512 UT__CPU_OPT static void ut__gemm_dot_avx512(const float* a, int lda,
                                                          const float* b, int ldb, int mc,
                                                          int nc, int kc, float* acc) {
  ut__gemm_dot_body(a, lda, b, ldb, mc, nc, kc, acc, 16, 4, 4);
}
UT__TGT_AVX512 UT__CPU_OPT static void ut__gemm_pack8_avx512(const float* a, ut__i64 lda, int kc,
                                                            float* dst) {
  ut__gemm_pack8_body(a, lda, kc, dst);
}
static const ut__cpu_isa_kernels ut__cpu_isa_avx512 = {
    "avx512", 16, ut__dw_forward_planes_avx512, ut__dw_dx_planes_avx512,
    ut__dw_dw_channel_avx512, ut__tconv_plane_avx512, ut__gemm_micro_avx512, 8, 32, true,
    ut__gemm_pack8_avx512, ut__gemm_dot_avx512, 16, 4, 4};

UT__TGT_AVX2 UT__CPU_OPT static void ut__dw_forward_planes_avx2(const ut__dwctx* C, ut__i64 q0,
                                                               ut__i64 q1, float* buf) {
  ut__dwf_range_body(C, q0, q1, buf, 8);
}
UT__TGT_AVX2 UT__CPU_OPT static void ut__dw_dx_planes_avx2(const ut__dwctx* C, ut__i64 q0,
                                                          ut__i64 q1, float* buf) {
  ut__dwdx_range_body(C, q0, q1, buf, 8);
}
UT__TGT_AVX2 UT__CPU_OPT static void ut__dw_dw_channel_avx2(const ut__dwctx* C, int ch,
                                                           double* dacc, float* buf) {
  ut__dwdw_chan_body(C, ch, dacc, buf, 8);
}
UT__TGT_AVX2 UT__CPU_OPT static void ut__tconv_plane_avx2(const float* src, ut__i64 tap_stride,
                                                         const float* wk, float* dx, int h,
                                                         int w, int kh, int kw, int s, int p,
                                                         int ho, int wo, float* tmp) {
  ut__cpu_tconv_body(src, tap_stride, wk, dx, h, w, kh, kw, s, p, ho, wo, tmp);
}
UT__TGT_AVX2 UT__CPU_OPT static void ut__gemm_micro_avx2(
    int kc, const float* ap, ut__i64 a_rs, ut__i64 a_ks, const float* bp, ut__i64 b_ks, float* c,
    ut__i64 ldc, int mr, int nr, float alpha, float beta, const float* rs, const float* rt,
    int act) {
  ut__gemm_micro_body(kc, ap, a_rs, a_ks, bp, b_ks, c, ldc, mr, nr, alpha, beta, rs, rt, act, 8,
                      6);
}
UT__TGT_AVX2 UT__CPU_OPT static void ut__gemm_dot_avx2(const float* a, int lda, const float* b,
                                                      int ldb, int mc, int nc, int kc,
                                                      float* acc) {
  ut__gemm_dot_body(a, lda, b, ldb, mc, nc, kc, acc, 8, 2, 4);
}
static const ut__cpu_isa_kernels ut__cpu_isa_avx2 = {
    "avx2", 8, ut__dw_forward_planes_avx2, ut__dw_dx_planes_avx2, ut__dw_dw_channel_avx2,
    ut__tconv_plane_avx2, ut__gemm_micro_avx2, 6, 16, true, NULL, ut__gemm_dot_avx2, 8, 2, 4};
#endif

UT__CPU_OPT static void ut__dw_forward_planes_base(const ut__dwctx* C, ut__i64 q0, ut__i64 q1,
                                                   float* buf) {
  ut__dwf_range_body(C, q0, q1, buf, UT__CPU_BASE_LANES);
}
UT__CPU_OPT static void ut__dw_dx_planes_base(const ut__dwctx* C, ut__i64 q0, ut__i64 q1,
                                              float* buf) {
  ut__dwdx_range_body(C, q0, q1, buf, UT__CPU_BASE_LANES);
}
UT__CPU_OPT static void ut__dw_dw_channel_base(const ut__dwctx* C, int ch, double* dacc,
                                               float* buf) {
  ut__dwdw_chan_body(C, ch, dacc, buf, UT__CPU_BASE_LANES);
}
UT__CPU_OPT static void ut__tconv_plane_base(const float* src, ut__i64 tap_stride,
                                             const float* wk, float* dx, int h, int w, int kh,
                                             int kw, int s, int p, int ho, int wo, float* tmp) {
  ut__cpu_tconv_body(src, tap_stride, wk, dx, h, w, kh, kw, s, p, ho, wo, tmp);
}
/* (4 lanes whatever the flags: the base GEMM's blocking is fixed) */
UT__CPU_OPT static void ut__gemm_micro_base(int kc, const float* ap, ut__i64 a_rs,
                                            ut__i64 a_ks, const float* bp, ut__i64 b_ks,
                                            float* c, ut__i64 ldc, int mr, int nr, float alpha,
                                            float beta, const float* rs, const float* rt,
                                            int act) {
  (void)rs; /* gemm_epi false: the epilogue runs after it (ut__cpu_epi_rows) */
  ut__gemm_micro_body(kc, ap, a_rs, a_ks, bp, b_ks, c, ldc, mr, nr, alpha, beta, NULL, rt, act,
                      4, 6);
}
UT__CPU_OPT static void ut__gemm_dot_base(const float* a, int lda, const float* b, int ldb,
                                          int mc, int nc, int kc, float* acc) {
  ut__gemm_dot_body(a, lda, b, ldb, mc, nc, kc, acc, 4, 2, 4);
}
static const ut__cpu_isa_kernels ut__cpu_isa_base = {
    "base", UT__CPU_BASE_LANES, ut__dw_forward_planes_base, ut__dw_dx_planes_base,
    ut__dw_dw_channel_base, ut__tconv_plane_base, ut__gemm_micro_base, 6, 8, false, NULL,
    ut__gemm_dot_base, 4, 2, 4};

static const ut__cpu_isa_kernels* ut__cpu_isa(void) {
#ifdef UT__CPU_X86
  int level = ut__cpu_level();
  if (level >= 4) return &ut__cpu_isa_avx512;
  if (level >= 3) return &ut__cpu_isa_avx2;
#endif
  return &ut__cpu_isa_base;
}

/* ---- the inference fold's arithmetic (declared with ut__fold_bn) ------------------------------
   Every folded call redoes its BatchNorm's fold, a double square root and division per channel:
   scalar, ~7 us of a 960-channel 1x1 layer's ~100 on 2 cores. GCC keeps sqrt's errno path
   (which blocks vectorizing) even under an optimize("no-math-errno") attribute, so the AVX
   variant names the instruction; the same IEEE operations, so the same bits as the scalar
   loop. */
/* channel o's scale and shift from its rstd rs */
static inline void ut__fold_row(float rs, const float* g, const float* b, const float* m,
                                const float* cb, float* scale, float* shift, int o) {
  double s = (double)rs * g[o];
  scale[o] = (float)s;
  shift[o] = (float)((double)b[o] + ((cb ? (double)cb[o] : 0.0) - m[o]) * s);
}
static void ut__fold_rows_scalar(int c, double eps, const float* g, const float* b,
                                 const float* m, const float* v, const float* cb, float* scale,
                                 float* shift, int o) {
  for (; o < c; o++)
    ut__fold_row((float)(1.0 / sqrt((double)v[o] + eps)), g, b, m, cb, scale, shift, o);
}
#ifdef UT__CPU_X86
typedef double ut__v4d __attribute__((vector_size(32)));
__attribute__((target("avx"))) static void ut__fold_rows_avx(int c, double eps, const float* g,
                                                            const float* b, const float* m,
                                                            const float* v, const float* cb,
                                                            float* scale, float* shift) {
  int o = 0;
  for (; o + 4 <= c; o += 4) {
    ut__v4d d = {(double)v[o] + eps, (double)v[o + 1] + eps, (double)v[o + 2] + eps,
                 (double)v[o + 3] + eps};
    ut__v4d r = (ut__v4d){1.0, 1.0, 1.0, 1.0} / __builtin_ia32_sqrtpd256(d);
    for (int i = 0; i < 4; i++) ut__fold_row((float)r[i], g, b, m, cb, scale, shift, o + i);
  }
  ut__fold_rows_scalar(c, eps, g, b, m, v, cb, scale, shift, o);
}
#endif
static void ut__fold_rows(int c, double eps, const float* g, const float* b, const float* m,
                          const float* v, const float* cb, float* scale, float* shift) {
#ifdef UT__CPU_X86
  if (ut__cpu_level() >= 3) {
    ut__fold_rows_avx(c, eps, g, b, m, v, cb, scale, shift);
    return;
  }
#endif
  ut__fold_rows_scalar(c, eps, g, b, m, v, cb, scale, shift, 0);
}
/* out[o, t] = w[o, t] scale[o] over c rows of taps values (a depthwise's folded filters) */
UT__CPU_OPT static void ut__scale_filters(int c, ut__i64 taps, const float* restrict w,
                                          const float* restrict scale, float* restrict out) {
  for (int o = 0; o < c; o++) {
    float so = scale[o];
    for (ut__i64 t = 0; t < taps; t++) out[o * taps + t] = w[o * taps + t] * so;
  }
}

#endif /* UTENSIL_IMPLEMENTATION_DONE */
#endif /* UT_IMPLEMENTATION */
