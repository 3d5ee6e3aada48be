#!/usr/bin/env bash
# build.sh — build and test utensil's native library.
#
# USAGE
#   ./build.sh [lib]     build $BUILD_DIR/libutensil.so and the test binary $BUILD_DIR/utensil_test
#                        (with the CUDA backend when nvcc is found, else the C part alone)
#   ./build.sh test      build the C tests under AddressSanitizer + UBSan into $BUILD_DIR/asan/
#                        and run them, then build (as `lib`) and run the plain test binary, which
#                        exercises the CUDA paths when a GPU is present; then the single-header
#                        check: native/test.c as a one-file program that defines
#                        UT_IMPLEMENTATION, built with a plain `cc -std=c11 app.c -lm -lpthread`
#                        and run ($BUILD_DIR/app/app_cpu), and, when nvcc built the CUDA objects,
#                        the same program linked with them and run ($BUILD_DIR/app/app_cuda: on
#                        the GPU when one is present). Exits non-zero on any failure. The
#                        sanitized build is always CPU-only (-DUT_NO_CUDA): ASan and the CUDA
#                        runtime do not mix well.
#   ./build.sh test-asan   the sanitized half of `test` alone (it never touches the library)
#   ./build.sh test-plain  the other half: `lib`, the plain test binary and the one-file program
#                        (.ci/gpu runs the two at once on a GPU machine: UT_CTESTS_ASYNC=1)
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
#   UT_CUDA=0       build without CUDA even when nvcc is present: the CPU part alone builds in
#                   seconds, the CUDA files take minutes (`UT_CUDA=0 pip install .` skips them too)
#   UT_CUDA_ARCHS   SM architectures to compile for             (default: "80 90"); a PTX entry
#                   for compute_90 is always included so newer GPUs can JIT it
#   UTENSIL_EXPECT_CUDA=1   (`test`; .ci/gpu sets it) fail when CUDA is not built or no GPU is
#                   usable, instead of running the UT_CUDA tests on the CPU paths and passing
#
# Each stage prints one "utensil build: ..." line to stderr (`pip install -v .` shows them; the
# commands themselves follow as "+ ..." lines).
#
# The CUDA backend is native/cuda/*.cu, one object per file (compiled in parallel), linked with
# utensil.o. The CUDA runtime is linked statically (-cudart static), so libutensil.so has no
# load-time dependency on libcuda/libcudart: it loads on machines without a GPU and falls back to
# the CPU. libutensil.so is linked with -z nodelete: dlclose never unmaps it, so its worker threads
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
SRC_H=native/utensil.h
CUDA_DIR=native/cuda
SRC_TEST=native/test.c
HDR=native/utensil.h

log() { printf '[build.sh] %s\n' "$*" >&2; }
# One line per stage, in words, for whoever waits on `pip install -v` (a CUDA build is minutes).
say() { printf 'utensil build: %s\n' "$*" >&2; }
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
  elif [[ ! -f "$CUDA_DIR/backend.cu" ]]; then
    cuda_reason="$CUDA_DIR/backend.cu does not exist"
  fi
  [[ -z "$cuda_reason" ]]
}

# The CUDA objects of the last build_lib ($obj/cuda_<name>.o), empty when it built without CUDA.
cuda_objs=()

cuda_seen="" # the files cuda_includes has listed

# The files that $1 includes with #include "..." (found beside the including file), and the
# ones those include, each once: native/cuda/X.cu -> common.cuh, utensil.h, depthwise.cuh, ...
cuda_includes() {
  local file="$1" inc dep
  while IFS= read -r inc; do
    dep="$(dirname "$file")/$inc"
    [[ -f "$dep" ]] || continue
    case " $cuda_seen " in *" $dep "*) continue ;; esac
    cuda_seen+=" $dep"
    printf '%s\n' "$dep"
    cuda_includes "$dep"
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$file")
}

# Whether object $1, made by command $2, is newer than source $3 and everything it includes.
cuda_obj_fresh() {
  local o="$1" cmd="$2" src="$3" dep deps=()
  [[ -f "$o" && "$(cat "$o.cmd" 2>/dev/null)" == "$cmd" ]] || return 1
  cuda_seen=""
  mapfile -t deps < <(cuda_includes "$src")
  for dep in "$src" "$SRC_H" "${deps[@]}"; do
    [[ "$o" -nt "$dep" ]] || return 1
  done
}

# Compiles each native/cuda/*.cu into $1/cuda_<name>.o, all at once (nvcc spends most of its
# time in one file's device code, so the files overlap well); fails if any of them fails.
# An object is kept when it is newer than its .cu and every file that .cu includes with
# #include "..." (followed through those files: common.cuh, utensil.h, the family headers such
# as depthwise.cuh) and was made by the same command (saved beside it as <object>.cmd): a full
# CUDA build takes minutes on a small machine, and CI builds the same objects more than once.
build_cuda_objs() {
  local obj="$1" gencode=() a src pids=() pid status=0 stale=() cmds=()
  for a in $UT_CUDA_ARCHS; do
    gencode+=(-gencode "arch=compute_$a,code=sm_$a")
  done
  gencode+=(-gencode "arch=compute_90,code=compute_90")
  cuda_objs=()
  for src in "$CUDA_DIR"/*.cu; do
    local o cmd
    o="$obj/cuda_$(basename "$src" .cu).o"
    cuda_objs+=("$o")
    cmd="$NVCC -std=c++17 -Xcompiler -fPIC ${nvccflags[*]} ${gencode[*]} -c $src"
    if cuda_obj_fresh "$o" "$cmd" "$src"; then
      log "up to date: $o"
      continue
    fi
    stale+=("$src")
    cmds+=("$cmd")
  done
  if [[ ${#stale[@]} -eq 0 ]]; then
    say "the ${#cuda_objs[@]} CUDA objects are up to date"
    return 0
  fi
  say "compiling ${#stale[@]} CUDA files with nvcc for sm_${UT_CUDA_ARCHS// /, sm_} (about 2" \
    "minutes on a few cores; UT_CUDA=0 skips them)"
  local i
  for i in "${!stale[@]}"; do
    src="${stale[$i]}"
    local o="$obj/cuda_$(basename "$src" .cu).o" cmd="${cmds[$i]}"
    rm -f "$o" "$o.cmd"
    { run "$NVCC" -std=c++17 -Xcompiler -fPIC "${nvccflags[@]}" "${gencode[@]}" -c "$src" -o "$o" &&
        printf '%s' "$cmd" >"$o.cmd"; } &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  [[ $status -eq 0 ]] || die "nvcc failed"
}

# Whether a GPU is visible here (for a hint only: the build never depends on it).
gpu_visible() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

build_lib() {
  command -v "$CC" >/dev/null 2>&1 || die "C compiler '$CC' not found"
  local obj="$BUILD_DIR/obj"
  mkdir -p "$obj"
  local so="$BUILD_DIR/libutensil.so" exe="$BUILD_DIR/utensil_test"
  rm -f "$so" "$exe" "$obj"/utensil.o "$obj"/test.o
  want_cuda || rm -f "$obj"/cuda_*.o "$obj"/cuda_*.o.cmd

  cuda_objs=()
  if want_cuda; then
    log "building with CUDA (archs: $UT_CUDA_ARCHS)"
    # One library serves machines with and without a GPU, so nvcc is used whenever present;
    # where no GPU is visible, say how to skip the minutes it takes.
    gpu_visible || say "nvcc found but no GPU visible: building the CUDA backend anyway (the" \
      "library falls back to the CPU at run time); UT_CUDA=0 builds the CPU part alone"
    build_cuda_objs "$obj"
    say "compiling the CPU core (native/utensil.c)"
    run "$CC" -std=c11 -fPIC -pthread "${cflags[@]}" -c "$SRC_C" -o "$obj/utensil.o"
    say "compiling the C tests (native/test.c)"
    run "$CC" -std=c11 -pthread "${cflags[@]}" -c "$SRC_TEST" -o "$obj/test.o"

    say "linking $so and $exe with the CUDA objects"
    run "$NVCC" -shared -cudart static -Xlinker -z,nodelete -o "$so" "$obj/utensil.o" \
      "${cuda_objs[@]}" -lpthread -lm -ldl
    run "$NVCC" -cudart static -o "$exe" "$obj/test.o" "$obj/utensil.o" "${cuda_objs[@]}" \
      -lpthread -lm -ldl

    # utensil.o's ut__cuda_backend is a weak stand-in (utensil.h); backend.cu's must win.
    if command -v nm >/dev/null 2>&1 && [[ "$(nm -D "$so")" != *" T ut__cuda_backend"* ]]; then
      die "$so: ut__cuda_backend is not the CUDA backend's (is $CUDA_DIR/backend.cu linked?)"
    fi

    # The .so must load on machines without the CUDA driver or toolkit.
    if command -v ldd >/dev/null 2>&1; then
      if ldd "$so" | grep -Eq 'libcuda\.|libcudart'; then
        ldd "$so" >&2
        die "$so depends on a CUDA library at load time"
      fi
    fi
  else
    say "building without CUDA ($cuda_reason)"
    say "compiling the CPU core (native/utensil.c)"
    run "$CC" -std=c11 -fPIC -pthread "${cflags[@]}" -DUT_NO_CUDA \
      -c "$SRC_C" -o "$obj/utensil.o"
    say "compiling the C tests (native/test.c)"
    run "$CC" -std=c11 -pthread "${cflags[@]}" -c "$SRC_TEST" -o "$obj/test.o"
    say "linking $so and $exe"
    run "$CC" -shared -pthread "${nodelete[@]}" -o "$so" "$obj/utensil.o" -lm
    run "$CC" -pthread -o "$exe" "$obj/test.o" "$obj/utensil.o" -lm
  fi
  say "built $so and $exe"
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

# The single-header promise: a one-file C program that defines UT_IMPLEMENTATION builds with a
# plain cc and runs on the CPU; linking the CUDA objects into it adds the GPU, with no define.
# The program is native/test.c itself. Needs build_lib first (for cuda_objs).
run_app_tests() {
  local dir="$BUILD_DIR/app" status=0
  mkdir -p "$dir"
  rm -f "$dir"/app_cpu "$dir"/app_cuda "$dir"/app.o
  local how="plain cc"
  [[ ${#cuda_objs[@]} -eq 0 ]] || how+=", then linked with the CUDA objects"
  say "building native/test.c as a one-file program ($how)"
  printf '#define UT_IMPLEMENTATION\n#include "%s/native/test.c"\n' "$PWD" >"$dir/app.c"
  run "$CC" -std=c11 -O2 "$dir/app.c" -o "$dir/app_cpu" -lm -lpthread
  log "running the one-file program ($dir/app_cpu)"
  # CPU-only by construction: UTENSIL_EXPECT_CUDA is for the binaries that link the CUDA objects
  if ! env -u UTENSIL_EXPECT_CUDA "$dir/app_cpu"; then
    log "FAILED: one-file program, plain cc"
    status=1
  fi
  if [[ ${#cuda_objs[@]} -gt 0 ]]; then
    run "$CC" -std=c11 -O2 -c "$dir/app.c" -o "$dir/app.o"
    run "$NVCC" -cudart static -o "$dir/app_cuda" "$dir/app.o" "${cuda_objs[@]}" -lpthread -lm -ldl
    log "running the one-file program linked with the CUDA objects ($dir/app_cuda)"
    if ! "$dir/app_cuda"; then
      log "FAILED: one-file program with the CUDA objects"
      status=1
    fi
  fi
  return $status
}

# .ci/gpu: a build without CUDA would run the UT_CUDA tests on the CPU and pass; fail before
# the minutes of building instead (a GPU that is absent is caught by the test binaries)
check_expect_cuda() {
  if [[ "${UTENSIL_EXPECT_CUDA:-}" == "1" ]] && ! want_cuda; then
    die "UTENSIL_EXPECT_CUDA=1 but the library would be built without CUDA ($cuda_reason)"
  fi
}

# The test runs record a failure here and go on (a sanitized failure still runs the plain
# tests); a build that fails stops the script (set -e), so no stale binary is run.
test_status=0
run_asan_tests() {
  say "building the C tests with AddressSanitizer + UBSan (CPU only)"
  build_asan_test
  log "running sanitized tests ($BUILD_DIR/asan/utensil_test)"
  # CPU-only by construction (-DUT_NO_CUDA): UTENSIL_EXPECT_CUDA is for the plain binary
  if ! ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    env -u UTENSIL_EXPECT_CUDA "$BUILD_DIR/asan/utensil_test"; then
    log "FAILED: sanitized tests"
    test_status=1
  fi
}

run_plain_tests() {
  build_lib
  log "running plain tests ($BUILD_DIR/utensil_test)"
  if ! "$BUILD_DIR/utensil_test"; then
    log "FAILED: plain tests"
    test_status=1
  fi
  run_app_tests || test_status=1
}

run_tests() {
  check_expect_cuda
  run_asan_tests
  run_plain_tests
  [[ $test_status -eq 0 ]] && log "all tests passed"
  return $test_status
}

[[ -f "$HDR" ]] || die "run from the repository (missing $HDR)"

case "${1:-lib}" in
  lib) build_lib ;;
  test) run_tests ;;
  test-asan) run_asan_tests; exit $test_status ;;
  test-plain) check_expect_cuda; run_plain_tests; exit $test_status ;;
  asan-lib) build_asan_lib ;;
  clean) run rm -rf "$BUILD_DIR" ;;
  -h | --help | help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  *) die "unknown target '$1' (expected lib, test, test-asan, test-plain, asan-lib or clean;" \
    "see ./build.sh --help)" ;;
esac
