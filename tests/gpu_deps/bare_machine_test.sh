#!/usr/bin/env bash
# scripts/gpu-check's 'bare machine' path, on a machine without a GPU:
#
#   1. the build machine's step: scripts/gpu-deps makes a folder with apt (from apt's cache or the
#      network), or, where that cannot work, the checkout's own .gpu-deps is taken as it is;
#   2. the folder travels: it is moved to another absolute path;
#   3. the GPU machine's step, with apt gone: scripts/gpu-deps (which must see no apt and use the
#      folder as it came), then scripts/gpu-check's configure and build (COMM_GPU_CHECK_BUILD_ONLY)
#      of comm-run, nccl_info (NCCL), collectives_demo (Gloo) and the doctest harness library.
#
# Step 3 runs in a private mount namespace (unshare -m) where apt-get, apt-cache, dpkg, dpkg-deb
# and the system's Gloo, GSL and doctest (headers, CMake files, libgloo and the libraries it loads)
# are hidden (masked by empty files and directories), so nothing can come from them; where no
# mount namespace can be made, apt is hidden by failing stand-ins first on PATH only. Either way
# the build is then checked: the CMake packages found, every Gloo, GSL and doctest header the
# compiler read (ninja's dependency records; no comm header includes GSL), libgloo and what it
# loads (ldd), all from the moved
# folder; and the Gloo demo runs at 2 ranks on the carried libgloo.
#
#   bare_machine_test.sh <source dir> <work dir>      exit 0 passed, 1 failed, 77 skipped (why printed)
set -uo pipefail
src=${1:?source dir}
work=${2:?work dir}
fail() { echo "gpu_deps: FAILED: $*"; exit 1; }
skip() { echo "gpu_deps: SKIPPED: $*"; exit 77; }

if [[ ${GPU_DEPS_INNER:-} != 1 ]]; then
  rm -rf "$work"
  mkdir -p "$work"
  # 1. The folder, made where apt works.
  made=$work/made
  if COMM_GPU_DEPS_DIR=$made COMM_GPU_DEPS_NO_UPDATE=1 "$src/scripts/gpu-deps" >"$work/deps-apt.log" 2>&1; then
    echo "gpu_deps: step 1: scripts/gpu-deps made the folder with apt: $(grep 'ready:' "$work/deps-apt.log" | tail -1)"
  elif [[ -f $src/.gpu-deps/manifest.txt ]] && "$src/scripts/gpu-deps" --check >>"$work/deps-apt.log" 2>&1; then
    cp -a "$src/.gpu-deps" "$made" || fail "cannot copy $src/.gpu-deps"
    echo "gpu_deps: step 1: no folder could be made with apt here; using the checkout's .gpu-deps"
  else
    skip "no folder: apt could not make one here ($(tr '\n' ' ' <"$work/deps-apt.log" | cut -c1-400)) and $src/.gpu-deps is absent"
  fi
  # 2. It travels.
  carried=$work/elsewhere/carried-deps
  mkdir -p "$work/elsewhere" && mv "$made" "$carried" || fail "cannot move the folder"
  echo "gpu_deps: step 2: folder moved to $carried ($(du -sk "$carried" | cut -f1) KiB)"
  # 3. apt gone.
  shims=$work/no-apt
  mkdir -p "$shims"
  for b in apt apt-get apt-cache dpkg dpkg-deb dpkg-query dpkg-architecture; do
    printf '#!/bin/sh\necho "%s: hidden by tests/gpu_deps (a machine without apt)" >&2\nexit 127\n' "$b" >"$shims/$b"
    chmod +x "$shims/$b"
  done
  export GPU_DEPS_INNER=1 GPU_DEPS_CARRIED=$carried GPU_DEPS_SHIMS=$shims PATH=$shims:$PATH
  if [[ ${COMM_GPU_DEPS_NO_NAMESPACE:-} != 1 ]] && unshare -m true 2>/dev/null; then
    exec unshare -m env GPU_DEPS_HIDE=1 bash "$0" "$src" "$work"
  elif [[ ${COMM_GPU_DEPS_NO_NAMESPACE:-} != 1 ]] && unshare -rm true 2>/dev/null; then
    exec unshare -rm env GPU_DEPS_HIDE=1 bash "$0" "$src" "$work"
  fi
  echo "gpu_deps: no mount namespace here: apt hidden on PATH only, the system's Gloo/GSL/doctest stay visible"
  GPU_DEPS_HIDE=0 exec bash "$0" "$src" "$work"
fi

# ---- inside: the GPU machine's view ------------------------------------------------------------------
carried=$GPU_DEPS_CARRIED
hidden=()
if [[ ${GPU_DEPS_HIDE:-0} == 1 ]]; then
  mask_dir() { [[ -d $1 ]] && mount -t tmpfs -o size=64k,mode=755 none "$1" && hidden+=("$1"); }
  mask_file() { [[ -e $1 ]] && mount --bind "$2" "$1" && hidden+=("$1"); }
  for d in /usr/include/gloo /usr/include/gsl /usr/include/doctest /usr/share/cmake/Gloo /usr/share/cmake/Microsoft.GSL \
    /usr/lib/cmake/doctest /var/cache/apt/archives /var/lib/apt/lists; do
    mask_dir "$d" || true
  done
  # The system's libgloo and what it loads: empty files, so any use of them fails to load.
  empty=$(mktemp)
  declare -A done_=()
  for f in /usr/lib/libgloo.so* /usr/lib/*-linux-gnu/libgloo.so* /usr/lib/*-linux-gnu/libhiredis.so* \
    /usr/lib/*-linux-gnu/libibverbs.so* /usr/lib/*-linux-gnu/libnl-3.so* /usr/lib/*-linux-gnu/libnl-route-3.so* \
    /lib/*-linux-gnu/libnl-3.so* /lib/*-linux-gnu/libnl-route-3.so*; do
    [[ -e $f ]] || continue
    real=$(readlink -f "$f")
    [[ -z ${done_[$real]:-} ]] || continue
    done_[$real]=1
    mask_file "$real" "$empty" || true
  done
  for b in apt apt-get apt-cache dpkg dpkg-deb dpkg-query dpkg-architecture; do
    p=$(PATH=${PATH#"$GPU_DEPS_SHIMS":} command -v "$b") && mask_file "$p" "$GPU_DEPS_SHIMS/$b"
  done
  [[ ! -e /usr/include/gloo/context.h ]] || fail "could not hide /usr/include/gloo"
  echo "gpu_deps: step 3: in a private mount namespace, hidden: ${#hidden[@]} paths (${hidden[*]:0:6} ...)"
fi
if apt-get --version >/dev/null 2>&1 || dpkg-deb --version >/dev/null 2>&1; then fail "apt is still usable"; fi

# The dependency step alone: it must see no apt and take the folder as it came.
out=$(COMM_GPU_DEPS_DIR=$carried "$src/scripts/gpu-deps" 2>&1)
rc=$?
echo "$out" | sed 's/^/  | /'
((rc == 0)) || fail "scripts/gpu-deps on the bare machine: exit $rc"
grep -q "no apt on this machine: using $carried as it came" <<<"$out" || fail "scripts/gpu-deps did not take the bare-machine path"

# gpu-check's dependency step, configure and build (short: -O0, four targets).
build=$work/build
start=$SECONDS
out=$(cd / && COMM_GPU_DEPS_DIR=$carried COMM_BUILD_DIR=$build COMM_GPU_CHECK_BUILD_ONLY=1 \
  COMM_GPU_CHECK_TARGETS="comm-run nccl_info collectives_demo comm_test_main" COMM_JOBS=${COMM_JOBS:-2} \
  COMM_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O0 -DCOMM_BUILD_BENCHMARKS=OFF" \
  "$src/scripts/gpu-check" 2>&1)
rc=$?
echo "$out" | sed 's/^/  | /'
((rc == 0)) || fail "scripts/gpu-check (build only): exit $rc; $build/configure.log, $build/build.log"
echo "gpu_deps: step 3: gpu-check configured and built in $((SECONDS - start)) s"
for t in "target comm-run" "target nccl_info" "target collectives_demo" "target comm_test_main"; do
  grep -q "built .*${t#target }" <<<"$out" || fail "gpu-check did not build ${t#target }"
done
grep -q "comm::gloo defined" "$build/configure.log" || fail "comm::gloo not defined"
grep -q "comm::nccl defined" "$build/configure.log" || fail "comm::nccl not defined"

# Where everything came from.
for v in Gloo_DIR doctest_DIR Microsoft.GSL_DIR; do
  got=$(sed -n "s/^$v:[A-Z]*=//p" "$build/CMakeCache.txt")
  [[ $got == "$carried"/* ]] || fail "$v is $got, not in the carried folder"
done
cd "$build" || fail "no $build"
objs=$(ninja -t targets all 2>/dev/null | sed -n 's/^\(.*\(collectives_demo\|multirank_main\)\.cpp\.o\): .*/\1/p')
[[ -n $objs ]] || fail "no object files of collectives_demo / multirank_main in $build"
headers=$(for o in $objs; do ninja -t deps "$o"; done | awk '/^ +\//{print $1}' | grep -E '/(gloo|doctest)/' | sort -u)
# (No comm header includes GSL: the Microsoft.GSL package, checked above, is all comm takes of it.)
for kind in gloo doctest; do
  n=$(grep -c "/include/$kind/" <<<"$headers")
  ((n > 0)) || fail "no $kind header among those the compiler read"
  outside=$(grep "/include/$kind/" <<<"$headers" | grep -v "^$carried/" | head -3)
  [[ -z $outside ]] || fail "$kind headers read from outside the folder: $outside"
  echo "gpu_deps: $n $kind headers read, all from $carried/root/usr/include/$kind"
done
demo=$(find "$build" -name collectives_demo -type f -perm -u+x | head -1)
readelf -d "$demo" | grep -q "RUNPATH.*$carried/root/usr/lib" || fail "collectives_demo has no RUNPATH to the folder"
# shellcheck source=/dev/null
source "$carried/env.sh"
libs=$(ldd "$demo" 2>&1)
for l in libgloo.so.0 libhiredis.so.0.14 libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
  grep -q "^[[:space:]]*$l => $carried/" <<<"$libs" || fail "$l does not load from the folder: $(grep "$l" <<<"$libs" | xargs)"
done
! grep -q "not found" <<<"$libs" || fail "ldd: $(grep 'not found' <<<"$libs" | xargs)"
echo "gpu_deps: libgloo and the 4 libraries it loads resolve to the folder (ldd)"
run=$(timeout 120 "$build/tools/comm-run" -n 2 "$demo" 2>&1)
rc=$?
((rc == 0)) && grep -q "rank 0: async all_reduce before \[1\]  after \[3\]" <<<"$run" ||
  fail "collectives_demo at 2 ranks on the carried libgloo: exit $rc: $(tail -5 <<<"$run")"
echo "gpu_deps: collectives_demo ran at 2 ranks on the carried libgloo"
"$build/tests/nccl/nccl_info" >/dev/null 2>&1 || "$(find "$build" -name nccl_info -type f -perm -u+x | head -1)" >/dev/null ||
  fail "nccl_info does not run"
if [[ ${GPU_DEPS_HIDE:-0} == 1 ]]; then
  echo "gpu_deps: PASSED: bare machine (apt, the system's Gloo/GSL/doctest and libgloo's libraries hidden)"
else
  echo "gpu_deps: PASSED: apt hidden on PATH (no mount namespace: the system's packages were visible but unused)"
fi
