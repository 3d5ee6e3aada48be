/* nccl.cu — the ut_dist_* calls on NVIDIA's NCCL, loaded at run time (dlopen; the search order
   and the rules are utensil.h's, "several processes"). The files and the naming: common.cuh.

   NCCL's few types are declared here, so no NCCL header is needed to build: ncclUniqueId is
   128 bytes passed by value, ncclComm_t a pointer, the enums ints (ncclFloat32 = 7, ncclSum = 0,
   ncclAvg = 4, which needs NCCL 2.10 or newer). */
#include "common.cuh"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void* ut__nccl_comm;
typedef struct {
  char internal[UT_DIST_ID_BYTES];
} ut__nccl_id;
enum { UT__NCCL_FLOAT32 = 7, UT__NCCL_SUM = 0, UT__NCCL_AVG = 4 };

struct ut__nccl {
  int (*get_unique_id)(ut__nccl_id*);
  int (*comm_init_rank)(ut__nccl_comm*, int, ut__nccl_id, int);
  int (*all_reduce)(const void*, void*, size_t, int, int, ut__nccl_comm, cudaStream_t);
  int (*broadcast)(const void*, void*, size_t, int, int, ut__nccl_comm, cudaStream_t);
  int (*comm_destroy)(ut__nccl_comm);
  int (*comm_abort)(ut__nccl_comm);
  int (*get_async_error)(ut__nccl_comm, int*);
  const char* (*error_string)(int);
  int version;
};

static std::mutex ut__nccl_lock;
static ut__nccl* ut__nccl_current = NULL; /* loaded once, never unloaded */
static bool ut__nccl_searched = false;
static char ut__nccl_info_text[2048] = "NCCL not searched for yet (no ut_dist_* call so far)";

/* dlopen path and take the symbols; NULL with why on failure */
static ut__nccl* ut__nccl_open(const char* path, char* why, size_t why_n) {
  dlerror();
  void* dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    const char* e = dlerror();
    snprintf(why, why_n, "%s", e ? e : "dlopen failed");
    return NULL;
  }
  const char* names[] = {"ncclGetUniqueId",  "ncclCommInitRank", "ncclAllReduce",
                         "ncclBroadcast",    "ncclCommDestroy",  "ncclCommAbort",
                         "ncclCommGetAsyncError", "ncclGetErrorString", "ncclGetVersion"};
  void* sym[9];
  for (int i = 0; i < 9; i++) {
    if (!(sym[i] = dlsym(dl, names[i]))) {
      snprintf(why, why_n, "%s is not a usable NCCL: it has no %s", path, names[i]);
      dlclose(dl);
      return NULL;
    }
  }
  ut__nccl* n = (ut__nccl*)calloc(1, sizeof *n);
  if (!n) {
    snprintf(why, why_n, "out of host memory");
    return NULL;
  }
  n->get_unique_id = (decltype(n->get_unique_id))sym[0];
  n->comm_init_rank = (decltype(n->comm_init_rank))sym[1];
  n->all_reduce = (decltype(n->all_reduce))sym[2];
  n->broadcast = (decltype(n->broadcast))sym[3];
  n->comm_destroy = (decltype(n->comm_destroy))sym[4];
  n->comm_abort = (decltype(n->comm_abort))sym[5];
  n->get_async_error = (decltype(n->get_async_error))sym[6];
  n->error_string = (decltype(n->error_string))sym[7];
  ((int (*)(int*))sym[8])(&n->version);
  if (n->version < 21000) { /* ncclAvg came with 2.10 */
    snprintf(why, why_n, "%s is NCCL %d.%d, older than the 2.10 utensil needs", path,
             n->version / 1000, n->version / 100 % 10);
    free(n);
    return NULL;
  }
  return n;
}

/* The loaded NCCL, searching on first use; NULL + error when there is none. */
static ut__nccl* ut__nccl_get(const char* who) {
  std::lock_guard<std::mutex> lk(ut__nccl_lock);
  if (!ut__nccl_searched) {
    ut__nccl_searched = true;
    char why[1024], hint[4096], tried[1536] = "";
    const char* env = getenv("UTENSIL_NCCL_LIB");
    ut__nccl_hint_copy(hint, sizeof hint);
    const char* names[] = {env ? env : hint, env ? "" : "libnccl.so.2"};
    if (env && !*env)
      snprintf(ut__nccl_info_text, sizeof ut__nccl_info_text,
               "NCCL not loaded (UTENSIL_NCCL_LIB is set and empty)");
    for (const char* name : names) {
      if (!*name || ut__nccl_current) continue;
      ut__nccl_current = ut__nccl_open(name, why, sizeof why);
      if (ut__nccl_current) {
        int v = ut__nccl_current->version;
        snprintf(ut__nccl_info_text, sizeof ut__nccl_info_text, "NCCL %d.%d.%d (%s)",
                 v / 10000, v / 100 % 100, v % 100, name);
      } else {
        size_t k = strlen(tried);
        snprintf(tried + k, sizeof tried - k, "%s%s: %s", k ? "; " : "", name, why);
      }
    }
    if (!ut__nccl_current && tried[0])
      snprintf(ut__nccl_info_text, sizeof ut__nccl_info_text,
               "NCCL not found (%s): install the nvidia-nccl-cu13 wheel (pip install "
               "'utensil-ffi[cuda]') or set UTENSIL_NCCL_LIB",
               tried);
  }
  if (!ut__nccl_current) ut__set_error(UT_ERR_DEVICE, "%s: %s", who, ut__nccl_info_text);
  return ut__nccl_current;
}

static int ut__nccl_fail(const ut__nccl* n, int st, const char* what) {
  return ut__set_error(UT_ERR_DEVICE, "nccl: %s failed: %s (%d)", what,
                       n->error_string ? n->error_string(st) : "NCCL error", st);
}

static int ut__cuda_dist_unique_id(unsigned char* id) {
  ut__nccl* n = ut__nccl_get("ut_dist_unique_id");
  if (!n) return UT_ERR_DEVICE;
  ut__nccl_id u;
  int st = n->get_unique_id(&u);
  if (st) return ut__nccl_fail(n, st, "ncclGetUniqueId");
  memcpy(id, u.internal, UT_DIST_ID_BYTES);
  return UT_OK;
}

static int ut__cuda_dist_init(int world_size, int rank, const unsigned char* id, void** comm) {
  ut__nccl* n = ut__nccl_get("ut_dist_init");
  if (!n) return UT_ERR_DEVICE;
  ut__nccl_id u;
  memcpy(u.internal, id, UT_DIST_ID_BYTES);
  ut__nccl_comm c = NULL;
  int st = n->comm_init_rank(&c, world_size, u, rank);
  if (st) return ut__nccl_fail(n, st, "ncclCommInitRank");
  *comm = c;
  return UT_OK;
}

static int ut__cuda_dist_all_reduce(void* comm, float* x, ut__i64 count, bool average) {
  ut__nccl* n = ut__nccl_get("ut_dist_all_reduce");
  if (!n) return UT_ERR_DEVICE;
  int st = n->all_reduce(x, x, (size_t)count, UT__NCCL_FLOAT32,
                         average ? UT__NCCL_AVG : UT__NCCL_SUM, (ut__nccl_comm)comm,
                         ut__cuda_stream);
  if (st) return ut__nccl_fail(n, st, "ncclAllReduce");
  return UT_OK;
}

static int ut__cuda_dist_broadcast(void* comm, float* x, ut__i64 count, int root) {
  ut__nccl* n = ut__nccl_get("ut_dist_broadcast");
  if (!n) return UT_ERR_DEVICE;
  int st = n->broadcast(x, x, (size_t)count, UT__NCCL_FLOAT32, root, (ut__nccl_comm)comm,
                        ut__cuda_stream);
  if (st) return ut__nccl_fail(n, st, "ncclBroadcast");
  return UT_OK;
}

static int ut__cuda_dist_check(void* comm) {
  ut__nccl* n = ut__nccl_get("ut_dist_check");
  if (!n) return UT_ERR_DEVICE;
  int async = 0;
  int st = n->get_async_error((ut__nccl_comm)comm, &async);
  if (st) return ut__nccl_fail(n, st, "ncclCommGetAsyncError");
  /* 7 is ncclInProgress: a non-blocking call still running, not an error */
  if (async && async != 7) return ut__nccl_fail(n, async, "the group (reported asynchronously)");
  return UT_OK;
}

/* Wait for the stream's work by polling an event (a blocking wait could never return if a
   peer is gone: NCCL's kernel would spin forever), checking NCCL's asynchronous error between
   polls; on an error or the timeout abort the communicator, which ends the spinning kernel. */
static int ut__cuda_dist_wait(void* comm, double timeout_s, bool* aborted) {
  ut__nccl* n = ut__nccl_get("ut_dist_wait");
  if (!n) return UT_ERR_DEVICE;
  cudaEvent_t ev;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ev, ut__cuda_stream);
  if (e != cudaSuccess) return ut__cuda_fail(e, "ut_dist_wait");
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long pause_us = 20;
  int rc = UT_OK;
  for (;;) {
    e = cudaEventQuery(ev);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      rc = ut__cuda_fail(e, "ut_dist_wait");
      break;
    }
    int async = 0;
    int st = n->get_async_error((ut__nccl_comm)comm, &async);
    if (st || (async && async != 7)) {
      rc = ut__nccl_fail(n, st ? st : async, "the group (a peer died or the network failed)");
      break;
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    double waited = (double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec);
    if (waited > timeout_s) {
      rc = ut__set_error(UT_ERR_DEVICE,
                         "ut_dist_wait: the group's work did not finish in %g s: a peer rank "
                         "is gone or hangs (the group is aborted)",
                         timeout_s);
      break;
    }
    usleep((useconds_t)pause_us);
    if (pause_us < 2000) pause_us *= 2;
  }
  if (rc < 0) {
    n->comm_abort((ut__nccl_comm)comm);
    *aborted = true;
  }
  cudaEventDestroy(ev);
  return rc;
}

static void ut__cuda_dist_free(void* comm, bool abort) {
  ut__nccl* n = ut__nccl_get("ut_dist_free");
  if (!n || !comm) return;
  if (abort) {
    n->comm_abort((ut__nccl_comm)comm);
  } else {
    cudaDeviceSynchronize(); /* the group's queued work first */
    n->comm_destroy((ut__nccl_comm)comm);
  }
}

static const char* ut__cuda_nccl_info(void) {
  std::lock_guard<std::mutex> lk(ut__nccl_lock);
  return ut__nccl_info_text;
}

void ut__cuda_nccl_fill(ut__backend* t) {
  t->dist_unique_id = ut__cuda_dist_unique_id;
  t->dist_init = ut__cuda_dist_init;
  t->dist_all_reduce = ut__cuda_dist_all_reduce;
  t->dist_broadcast = ut__cuda_dist_broadcast;
  t->dist_check = ut__cuda_dist_check;
  t->dist_wait = ut__cuda_dist_wait;
  t->dist_free = ut__cuda_dist_free;
  t->nccl_info = ut__cuda_nccl_info;
}
