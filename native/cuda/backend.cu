/* backend.cu — ut__cuda_backend(), the table the C core calls; device memory and
   synchronization. The files and the naming: common.cuh. */
#include "common.cuh"

#include <iterator>
#include <new>
#include <unordered_map>
#include <vector>

/* ============================================================================================
   Runtime helpers
   ============================================================================================ */

int ut__cuda_sms = 132; /* multiprocessors of the device, read at init */

int ut__cuda_fail(cudaError_t e, const char* what) {
  int st = (e == cudaErrorMemoryAllocation) ? UT_ERR_MEMORY : UT_ERR_DEVICE;
  return ut__set_error(st, "cuda: %s: %s", what, cudaGetErrorString(e));
}

/* Where every launch goes: the legacy default stream, or the capture stream while a graph is
   being recorded (see "Captured work" below). */
cudaStream_t ut__cuda_stream = cudaStreamLegacy;

/* Buffers that graphs may use (the workspace, the depthwise flags) are not cudaFree'd while a
   graph exists: a replay would write freed memory. They wait here instead. */
static std::vector<void*> ut__cuda_retired;
static int ut__cuda_graphs_alive = 0; /* guarded by ut__cuda_pool_lock */
static std::mutex ut__cuda_pool_lock;

void ut__cuda_retire(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  if (ut__cuda_graphs_alive) {
    ut__cuda_retired.push_back(p);
    return;
  }
  for (void* q : ut__cuda_retired) cudaFree(q);
  ut__cuda_retired.clear();
  cudaFree(p);
}

/* A device buffer that grows and never shrinks: at least `need` bytes in *buf (*have bytes now),
   made `want` bytes when it grows; growing synchronizes the device before the old buffer goes
   (rare: only when a larger size is first needed). *fresh tells whether it was just made. */
static int ut__cuda_grow(void** buf, size_t* have, size_t need, size_t want, bool* fresh,
                         const char* what) {
  *fresh = false;
  if (need <= *have) return UT_OK;
  if (*buf) {
    UT__CUDA_CHECK(cudaDeviceSynchronize(), what);
    ut__cuda_retire(*buf);
    *buf = NULL;
    *have = 0;
  }
  UT__CUDA_CHECK(cudaMalloc(buf, want), what);
  *have = want;
  *fresh = true;
  return UT_OK;
}

/* the reduction workspace (common.cuh) */
std::mutex ut__cuda_workspace_lock;
static void* ut__cuda_workspace = NULL;
static size_t ut__cuda_workspace_bytes = 0;

int ut__cuda_workspace_acquire(size_t bytes, float** out) {
  if (bytes < 256) bytes = 256;
  bool fresh;
  int st = ut__cuda_grow(&ut__cuda_workspace, &ut__cuda_workspace_bytes, bytes, bytes + bytes / 2,
                         &fresh, "workspace");
  if (st) return st;
  *out = (float*)ut__cuda_workspace;
  return UT_OK;
}

/* the arrival counters (common.cuh), all zero when made */
static void* ut__cuda_counters = NULL;
static size_t ut__cuda_counters_bytes = 0;

int ut__cuda_counters_acquire(int n, unsigned** out) {
  const size_t need = (size_t)n * sizeof(unsigned);
  bool fresh;
  int st = ut__cuda_grow(&ut__cuda_counters, &ut__cuda_counters_bytes, need,
                         n < 4096 ? 4096 * sizeof(unsigned) : need + need / 2, &fresh, "counters");
  if (st) return st;
  if (fresh)
    UT__CUDA_CHECK(cudaMemsetAsync(ut__cuda_counters, 0, ut__cuda_counters_bytes, ut__cuda_stream),
                   "counters clear");
  *out = (unsigned*)ut__cuda_counters;
  return UT_OK;
}

/* ============================================================================================
   Memory
   ============================================================================================ */

/* Device memory is cached: cudaMalloc and cudaFree cost tens of microseconds each and cudaFree
   synchronizes the device, which a training step allocating dozens of temporaries cannot afford.
   Freed blocks go to a free list per rounded size and are handed out again; all work is queued
   on one stream, so a block's next user runs after its last one. The cache is emptied when
   cudaMalloc fails and on ut_cuda_empty_cache (never while a graph is being recorded), and
   cached bytes count as free in mem_info.
   A block handed out while a graph is recorded belongs to that graph until the graph is
   freed: freed, it goes to the graph's own free list (a replay writes it again), never to
   another tensor. So the shared free lists hold no block a live graph uses (the tensors a
   graph reads or writes are held by it), and they can be released while graphs live: the
   recorded fp32 and bf16 steps of one process then no longer keep every other block cached. */
/* rounded size -> blocks */
static std::unordered_map<size_t, std::vector<void*>> ut__cuda_pool_free;
static std::unordered_map<void*, size_t> ut__cuda_pool_size; /* every live or cached block */
static size_t ut__cuda_pool_cached = 0;                      /* bytes in the free lists */

/* A recorded graph, and the blocks it owns: by id in ut__cuda_pool_owner, its free ones here. */
struct ut__cuda_graph_state {
  int id;
  cudaGraphExec_t exec;
  std::unordered_map<size_t, std::vector<void*>> free;
};
static std::unordered_map<int, ut__cuda_graph_state*> ut__cuda_graphs; /* by id */
static std::unordered_map<void*, int> ut__cuda_pool_owner;            /* block -> graph id */
static int ut__cuda_capture_id = 0; /* the graph being recorded (0: none) */
static int ut__cuda_graph_next_id = 0;

static size_t ut__cuda_pool_round(size_t bytes) {
  if (bytes <= 512) return 512;
  if (bytes <= (1u << 20)) return (bytes + 511) & ~(size_t)511;
  return (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
}

/* Caller holds ut__cuda_pool_lock. Not while recording: the device cannot be waited for then. */
static void ut__cuda_pool_release_cached(void) {
  if (ut__cuda_pool_cached == 0 || ut__cuda_capture_id) return;
  cudaDeviceSynchronize();
  for (auto& kv : ut__cuda_pool_free) {
    for (void* p : kv.second) {
      cudaFree(p);
      ut__cuda_pool_size.erase(p);
    }
    kv.second.clear();
  }
  ut__cuda_pool_cached = 0;
  cudaGetLastError();
}

void* ut__cuda_mem_alloc(size_t bytes) {
  size_t size = ut__cuda_pool_round(bytes);
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  if (ut__cuda_capture_id) { /* the recording graph's own freed blocks first */
    auto& own = ut__cuda_graphs[ut__cuda_capture_id]->free[size];
    if (!own.empty()) {
      void* p = own.back();
      own.pop_back();
      return p;
    }
  }
  auto it = ut__cuda_pool_free.find(size);
  if (it != ut__cuda_pool_free.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    ut__cuda_pool_cached -= size;
    if (ut__cuda_capture_id) ut__cuda_pool_owner[p] = ut__cuda_capture_id;
    return p;
  }
  void* p = NULL;
  cudaError_t e = cudaMalloc(&p, size);
  if (e == cudaErrorMemoryAllocation && ut__cuda_pool_cached) {
    cudaGetLastError();
    ut__cuda_pool_release_cached();
    e = cudaMalloc(&p, size);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    ut__cuda_fail(e, "cudaMalloc");
    return NULL;
  }
  ut__cuda_pool_size[p] = size;
  if (ut__cuda_capture_id) ut__cuda_pool_owner[p] = ut__cuda_capture_id;
  return p;
}

void ut__cuda_mem_free(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  auto it = ut__cuda_pool_size.find(p);
  if (it == ut__cuda_pool_size.end()) return; /* not ours: nothing to do */
  auto o = ut__cuda_pool_owner.find(p);
  if (o != ut__cuda_pool_owner.end()) {
    ut__cuda_graphs[o->second]->free[it->second].push_back(p);
    return;
  }
  ut__cuda_pool_free[it->second].push_back(p);
  ut__cuda_pool_cached += it->second;
}

static int ut__cuda_upload(void* dst, const float* src, size_t bytes) {
  if (!bytes) return UT_OK;
  UT__CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload");
  return UT_OK;
}

static int ut__cuda_download(float* dst, const void* src, size_t bytes) {
  if (!bytes) return UT_OK;
  UT__CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "download");
  return UT_OK;
}

static int ut__cuda_mem_info(size_t* free_bytes, size_t* total_bytes) {
  size_t f = 0, t = 0;
  UT__CUDA_CHECK(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
  {
    std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
    f += ut__cuda_pool_cached; /* cached blocks are free for the library to reuse */
  }
  if (free_bytes) *free_bytes = f;
  if (total_bytes) *total_bytes = t;
  return UT_OK;
}

static int ut__cuda_empty_cache(void) {
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  ut__cuda_pool_release_cached();
  return UT_OK;
}

static long long ut__cuda_cached_bytes(void) {
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  return (long long)ut__cuda_pool_cached;
}

static int ut__cuda_synchronize(void) {
  UT__CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return UT_OK;
}

/* An event recorded on `signalling` and waited for on `waiting`: the wait is queued, the host
   does not block. NULL is the library's stream, the legacy default stream. */
static int ut__cuda_stream_wait(void* waiting, void* signalling) {
  cudaStream_t w = waiting ? (cudaStream_t)waiting : cudaStreamLegacy;
  cudaStream_t s = signalling ? (cudaStream_t)signalling : cudaStreamLegacy;
  if (w == s) return UT_OK;
  cudaEvent_t ev;
  UT__CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  cudaError_t e = cudaEventRecord(ev, s);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(w, ev, 0);
  cudaEventDestroy(ev); /* released once the wait has been satisfied */
  UT__CUDA_CHECK(e, "stream wait");
  return UT_OK;
}

/* ============================================================================================
   Captured work (CUDA graphs; the rules are utensil.h's, "captured GPU work")
   ============================================================================================ */

/* Recording runs on a stream of its own (the legacy default stream cannot be captured): work
   queued before it is finished first, and replays run on the legacy stream, in order with
   everything else. Relaxed mode: cudaMalloc may run while recording (the pool grows). */
static cudaStream_t ut__cuda_capture_stream = NULL;

static void ut__cuda_graph_drop_locked(ut__cuda_graph_state* g) {
  for (auto& kv : g->free) {
    for (void* p : kv.second) {
      ut__cuda_pool_free[kv.first].push_back(p);
      ut__cuda_pool_cached += kv.first;
    }
  }
  for (auto it = ut__cuda_pool_owner.begin(); it != ut__cuda_pool_owner.end();)
    it = it->second == g->id ? ut__cuda_pool_owner.erase(it) : std::next(it);
  ut__cuda_graphs.erase(g->id);
  ut__cuda_graphs_alive--;
  delete g;
}

static int ut__cuda_graph_begin(void) {
  if (!ut__cuda_capture_stream)
    UT__CUDA_CHECK(cudaStreamCreateWithFlags(&ut__cuda_capture_stream, cudaStreamNonBlocking),
                   "capture stream");
  UT__CUDA_CHECK(cudaDeviceSynchronize(), "graph begin");
  ut__cuda_graph_state* g = new (std::nothrow) ut__cuda_graph_state();
  if (!g) return ut__set_error(UT_ERR_MEMORY, "graph begin: out of host memory");
  cudaError_t e = cudaStreamBeginCapture(ut__cuda_capture_stream, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    delete g;
    return ut__cuda_fail(e, "cudaStreamBeginCapture");
  }
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  g->id = ++ut__cuda_graph_next_id;
  g->exec = NULL;
  ut__cuda_graphs[g->id] = g;
  ut__cuda_graphs_alive++;
  ut__cuda_capture_id = g->id;
  ut__cuda_stream = ut__cuda_capture_stream;
  return UT_OK;
}

static int ut__cuda_graph_end(void** out) {
  *out = NULL;
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(ut__cuda_capture_stream, &graph);
  ut__cuda_graph_state* g;
  {
    std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
    g = ut__cuda_graphs[ut__cuda_capture_id];
    ut__cuda_capture_id = 0;
    ut__cuda_stream = cudaStreamLegacy;
  }
  cudaGraphExec_t exec = NULL;
  if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
  if (graph) cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    cudaGetLastError();
    std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
    ut__cuda_graph_drop_locked(g);
    return ut__set_error(UT_ERR_DEVICE,
                         "cuda: the recording failed: %s (inside a recording nothing may wait for "
                         "the GPU or copy between host and GPU: run the step once before "
                         "recording it, keep its inputs on the GPU, read results after the end)",
                         cudaGetErrorString(e));
  }
  g->exec = exec;
  *out = g;
  return UT_OK;
}

static int ut__cuda_graph_replay(void* h) {
  UT__CUDA_CHECK(cudaGraphLaunch(((ut__cuda_graph_state*)h)->exec, cudaStreamLegacy),
                 "cudaGraphLaunch");
  return UT_OK;
}

static void ut__cuda_graph_free(void* h) {
  ut__cuda_graph_state* g = (ut__cuda_graph_state*)h;
  if (!g) return;
  cudaDeviceSynchronize(); /* a replay in flight still uses its memory */
  cudaGraphExecDestroy(g->exec);
  std::lock_guard<std::mutex> lock(ut__cuda_pool_lock);
  ut__cuda_graph_drop_locked(g);
}

/* ============================================================================================
   The table
   ============================================================================================ */

static std::once_flag ut__cuda_init_once;
static ut__backend ut__cuda_table;
static bool ut__cuda_table_ok = false;

static void ut__cuda_init(void) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count <= 0) {
    cudaGetLastError(); /* no driver or no device: CPU only */
    return;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    return;
  }
  /* a device this build has no code for is no usable GPU either */
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, ut__cuda_fill_kernel) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  ut__cuda_sms = sms;

  ut__backend* t = &ut__cuda_table;
  t->name = "cuda";
  t->mem_alloc = ut__cuda_mem_alloc;
  t->mem_free = ut__cuda_mem_free;
  t->upload = ut__cuda_upload;
  t->download = ut__cuda_download;
  t->mem_info = ut__cuda_mem_info;
  t->empty_cache = ut__cuda_empty_cache;
  t->cached_bytes = ut__cuda_cached_bytes;
  t->synchronize = ut__cuda_synchronize;
  t->stream_wait = ut__cuda_stream_wait;
  t->fill = ut__cuda_fill; /* the overload with the slot's signature */
  t->copy = ut__cuda_copy;
  t->copy2d = ut__cuda_copy2d;
  t->cast = ut__cuda_cast;
  t->axpy = ut__cuda_axpy;
  t->scale = ut__cuda_scale;
  t->relu_fwd = ut__cuda_relu_fwd;
  t->relu_bwd = ut__cuda_relu_bwd;
  t->act_fwd = ut__cuda_act_fwd;
  t->act_bwd = ut__cuda_act_bwd;
  t->transpose = ut__cuda_transpose;
  t->gemm = ut__cuda_gemm;
  t->bias_add = ut__cuda_bias_add;
  t->chan_repeat = ut__cuda_chan_repeat;
  t->chan_group_sum = ut__cuda_chan_group_sum;
  t->channel_sum = ut__cuda_channel_sum;
  t->row_mean = ut__cuda_row_mean;
  t->row_mean_bwd = ut__cuda_row_mean_bwd;
  t->im2col = ut__cuda_im2col;
  t->col2im = ut__cuda_col2im;
  t->conv_exact = ut__cuda_conv_exact;
  t->dw_fwd = ut__cuda_dw_fwd;
  t->dw_bwd_dx = ut__cuda_dw_bwd_dx;
  t->dw_bwd_dw = ut__cuda_dw_bwd_dw;
  t->dw_fwd_bn = ut__cuda_dw_fwd_bn;
  t->dw_bwd_dw_bn = ut__cuda_dw_bwd_dw_bn;
  t->bn_fold_pack = ut__cuda_bn_fold_pack;
  t->layernorm_fwd = ut__cuda_layernorm_fwd;
  t->layernorm_bwd = ut__cuda_layernorm_bwd;
  t->chan_scale = ut__cuda_chan_scale; /* issue 30: scale.cu */
  t->chan_dot = ut__cuda_chan_dot;
  t->ln2d_fwd = ut__cuda_ln2d_fwd;
  t->ln2d_bwd = ut__cuda_ln2d_bwd;
  t->bn_stats = ut__cuda_bn_stats;
  t->bn_update_running = ut__cuda_bn_update_running;
  t->bn_apply = ut__cuda_bn_apply;
  t->bn_bwd = ut__cuda_bn_bwd;
  t->bn_sync_pack = ut__cuda_bn_sync_pack;
  t->bn_sync_unpack = ut__cuda_bn_sync_unpack;
  t->bn_bwd_sums = ut__cuda_bn_bwd_sums;
  t->bn_bwd_dx = ut__cuda_bn_bwd_dx;
  t->mse_fwd = ut__cuda_mse_fwd;
  t->mse_bwd = ut__cuda_mse_bwd;
  t->ce_fwd = ut__cuda_ce_fwd;
  t->ce_bwd = ut__cuda_ce_bwd;
  t->blas_load = ut__cuda_blas_load;
  t->blas_enable = ut__cuda_blas_enable;
  t->blas_active = ut__cuda_blas_active;
  t->blas_info = ut__cuda_blas_info;
  t->sgd = ut__cuda_sgd;
  t->sgd_many = ut__cuda_sgd_many;
  t->fill_many = ut__cuda_fill_many;
  t->adam = ut__cuda_adam;
  t->mask_scale = ut__cuda_mask_scale; /* issue 30: Dropout, StochasticDepth, EMA */
  t->rng_mask = ut__cuda_rng_mask;
  t->lerp = ut__cuda_lerp;
  t->graph_begin = ut__cuda_graph_begin;
  t->graph_end = ut__cuda_graph_end;
  t->graph_replay = ut__cuda_graph_replay;
  t->graph_free = ut__cuda_graph_free;
  ut__cuda_nccl_fill(t);
  ut__cuda_table_ok = true;
}

extern "C" const ut__backend* ut__cuda_backend(void) {
  std::call_once(ut__cuda_init_once, ut__cuda_init);
  return ut__cuda_table_ok ? &ut__cuda_table : NULL;
}
