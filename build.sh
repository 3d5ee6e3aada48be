#!/usr/bin/env bash
# build.sh — build and test utensil's native library.
#
# USAGE
#   ./build.sh [lib]     build $BUILD_DIR/libutensil.so and the test binary $BUILD_DIR/utensil_test
#                        (with the CUDA backend when nvcc is found, else the C part alone)
#   ./build.sh test      build the C tests under AddressSanitizer + UBSan into $BUILD_DIR/asan/
#                        and run them, then build (as `lib`) and run the plain test binary, which
#                        exercises the CUDA paths when a GPU is present. Exits non-zero on any
#                        failure. The sanitized build is always CPU-only (-DUT_NO_CUDA): ASan and
#                        the CUDA runtime do not mix well.
#   ./build.sh asan-lib  build a sanitized, CPU-only $BUILD_DIR/asan/libutensil.so, for loading
#                        into Python with
#                          LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0
#   ./build.sh clean     remove $BUILD_DIR
#
# SETTINGS (environment variables only)
#   CC              C compiler                                  (default: cc)
#   CFLAGS          C optimization/warning flags                (default: -O2 -Wall -Wextra)
#                   -std=c11 -fPIC -pthread are always added (the CPU backend's threads are its
#                   own pthreads, no OpenMP)
#   NVCC            CUDA compiler                               (default: nvcc)
#   NVCCFLAGS       extra nvcc flags                            (default: -O3)
#                   -std=c++17 -Xcompiler -fPIC and the -gencode flags are always added
#   BUILD_DIR       output directory                            (default: build)
#   UT_CUDA=0       build without CUDA even when nvcc is present
#   UT_CUDA_ARCHS   SM architectures to compile for             (default: "80 90"); a PTX entry
#                   for compute_90 is always included so newer GPUs can JIT it
#
# The CUDA runtime is linked statically (-cudart static), so libutensil.so has no load-time
# dependency on libcuda/libcudart: it loads on machines without a GPU and falls back to the CPU.
# libutensil.so is linked with -z nodelete: dlclose never unmaps it, so its worker threads
# (parked, or finishing an op at interpreter exit) never run unmapped code.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

CC="${CC:-cc}"
CFLAGS="${CFLAGS:--O2 -Wall -Wextra}"
NVCC="${NVCC:-nvcc}"
NVCCFLAGS="${NVCCFLAGS:--O3}"
BUILD_DIR="${BUILD_DIR:-build}"
UT_CUDA="${UT_CUDA:-1}"
UT_CUDA_ARCHS="${UT_CUDA_ARCHS:-80 90}"

SRC_C=native/utensil.c
SRC_CU=native/utensil_cuda.cu
SRC_TEST=native/test.c
HDR=native/utensil.h

log() { printf '[build.sh] %s\n' "$*" >&2; }
die() { printf '[build.sh] error: %s\n' "$*" >&2; exit 1; }
run() { printf '+ %s\n' "$*" >&2; "$@"; }

# word-split a flags string into an array (flags never contain spaces here)
read -r -a cflags <<<"$CFLAGS"
read -r -a nvccflags <<<"$NVCCFLAGS"

nodelete=(-Wl,-z,nodelete)

# Decides whether CUDA is built; sets cuda_reason when it is not.
cuda_reason=""
want_cuda() {
  if [[ "$UT_CUDA" == "0" ]]; then
    cuda_reason="UT_CUDA=0"
  elif ! command -v "$NVCC" >/dev/null 2>&1; then
    cuda_reason="'$NVCC' not found"
  elif [[ ! -f "$SRC_CU" ]]; then
    cuda_reason="$SRC_CU does not exist"
  fi
  [[ -z "$cuda_reason" ]]
}

build_lib() {
  command -v "$CC" >/dev/null 2>&1 || die "C compiler '$CC' not found"
  local obj="$BUILD_DIR/obj"
  mkdir -p "$obj"
  local so="$BUILD_DIR/libutensil.so" exe="$BUILD_DIR/utensil_test"
  rm -f "$so" "$exe" "$obj"/*.o

  if want_cuda; then
    log "building with CUDA (archs: $UT_CUDA_ARCHS)"
    local gencode=() a
    for a in $UT_CUDA_ARCHS; do
      gencode+=(-gencode "arch=compute_$a,code=sm_$a")
    done
    gencode+=(-gencode "arch=compute_90,code=compute_90")

    run "$CC" -std=c11 -fPIC -pthread "${cflags[@]}" -c "$SRC_C" -o "$obj/utensil.o"
    run "$NVCC" -std=c++17 -Xcompiler -fPIC "${nvccflags[@]}" "${gencode[@]}" \
      -c "$SRC_CU" -o "$obj/utensil_cuda.o"
    run "$CC" -std=c11 -pthread "${cflags[@]}" -c "$SRC_TEST" -o "$obj/test.o"

    run "$NVCC" -shared -cudart static -Xlinker -z,nodelete -o "$so" "$obj/utensil.o" \
      "$obj/utensil_cuda.o" -lpthread -lm
    run "$NVCC" -cudart static -o "$exe" "$obj/test.o" "$obj/utensil.o" "$obj/utensil_cuda.o" \
      -lpthread -lm

    # The .so must load on machines without the CUDA driver or toolkit.
    if command -v ldd >/dev/null 2>&1; then
      if ldd "$so" | grep -Eq 'libcuda\.|libcudart'; then
        ldd "$so" >&2
        die "$so depends on a CUDA library at load time"
      fi
    fi
  else
    echo "building without CUDA: $cuda_reason"
    run "$CC" -std=c11 -fPIC -pthread "${cflags[@]}" -DUT_NO_CUDA \
      -c "$SRC_C" -o "$obj/utensil.o"
    run "$CC" -std=c11 -pthread "${cflags[@]}" -c "$SRC_TEST" -o "$obj/test.o"
    run "$CC" -shared -pthread "${nodelete[@]}" -o "$so" "$obj/utensil.o" -lm
    run "$CC" -pthread -o "$exe" "$obj/test.o" "$obj/utensil.o" -lm
  fi
  log "built $so and $exe"
}

asan_flags=(-std=c11 -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -Wall -Wextra
  -pthread -DUT_NO_CUDA)

build_asan_test() {
  mkdir -p "$BUILD_DIR/asan"
  run "$CC" "${asan_flags[@]}" "$SRC_C" "$SRC_TEST" \
    -o "$BUILD_DIR/asan/utensil_test" -lm
}

build_asan_lib() {
  mkdir -p "$BUILD_DIR/asan"
  run "$CC" "${asan_flags[@]}" "${nodelete[@]}" -fPIC -shared "$SRC_C" \
    -o "$BUILD_DIR/asan/libutensil.so" -lm
  log "built $BUILD_DIR/asan/libutensil.so (load with LD_PRELOAD=\$($CC -print-file-name=libasan.so))"
}

run_tests() {
  local status=0
  build_asan_test
  log "running sanitized tests ($BUILD_DIR/asan/utensil_test)"
  if ! ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$BUILD_DIR/asan/utensil_test"; then
    log "FAILED: sanitized tests"
    status=1
  fi
  build_lib
  log "running plain tests ($BUILD_DIR/utensil_test)"
  if ! "$BUILD_DIR/utensil_test"; then
    log "FAILED: plain tests"
    status=1
  fi
  [[ $status -eq 0 ]] && log "all tests passed"
  return $status
}

[[ -f "$HDR" ]] || die "run from the repository (missing $HDR)"

case "${1:-lib}" in
  lib) build_lib ;;
  test) run_tests ;;
  asan-lib) build_asan_lib ;;
  clean) run rm -rf "$BUILD_DIR" ;;
  -h | --help | help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  *) die "unknown target '$1' (expected lib, test, asan-lib or clean; see ./build.sh --help)" ;;
esac
