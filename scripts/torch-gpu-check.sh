#!/usr/bin/env bash
# The torch.distributed backend on a GPU machine with its own torch (2.x with CUDA), no
# internet and no gRPC development files (issue 20, acceptance 5). Two halves:
#
#   scripts/torch-gpu-check.sh pack      HERE: builds libgradsync with CUDA (build-gpu/, like
#                                        scripts/gpu-run.sh) and packs bundle-torch/: the static
#                                        libraries and their link line, the shared libraries they
#                                        need (/work/shared/tools/bundle-deps), gradsyncrun,
#                                        gradsyncd and gradsync-coordinator. Then prints the call.
#   bash scripts/torch-gpu-check.sh run  THERE (repository root, bundle-torch/ carried): builds
#                                        integrations/torch/gradsync_backend.cc against that
#                                        machine's torch (python3 -c 'import torch'), with CUDA,
#                                        and runs tests/torch/ddp_gpu_step.py under gradsyncrun
#                                        --standalone -n 2 with both ranks on GPU 0.
#
# What "run" needs there: python3 with torch (CUDA build) importable; a C++17 compiler (c++ or
# g++); the CUDA runtime headers (CUDA_HOME, /usr/local/cuda, or the nvidia-cuda-runtime wheel
# torch depends on); torch built with the C++11 string ABI, like our libraries
# (torch.compiled_with_cxx11_abi(); pip wheels from torch 2.7 on) - with the old ABI the
# gradsync API's std::string cannot cross and the script stops saying so. Output: one
# "CHECK name: ok|FAILED (why)" line per stage, and logs under $OUT.
# CPU_ONLY=1 tries "run" on a machine without a GPU (no CUDA in the extension; the 2-rank test
# is tests/torch/ddp_gradsync_test.py instead): how the bundle's link line was checked here.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bundle=bundle-torch

pack() {
  set -e
  local build=${GRADSYNC_GPU_BUILD_DIR:-build-gpu}
  mkdir -p "$build"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_WITH_CUDA=ON >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; exit 1; }
  # train_logreg links exactly what a program using libgradsync links: its link line is ours.
  cmake --build "$build" -j "${GRADSYNC_BUILD_JOBS:-2}" --target train_logreg gradsyncrun gradsyncd gradsync-coordinator
  rm -rf "$bundle"
  mkdir -p "$bundle/static" "$bundle/include"
  /work/shared/tools/bundle-deps "$bundle" "$build/bin/train_logreg" "$build/bin/gradsyncrun" \
    "$build/bin/gradsyncd" "$build/bin/gradsync-coordinator"
  rm -f "$bundle/bin/train_logreg"
  cp -r runtime/include/gradsync "$bundle/include/"
  local link=$build/examples/CMakeFiles/train_logreg.dir/link.txt
  : >"$bundle/link-libs.txt"
  # Link words become files of the bundle where they can: our static libraries, the CUDA static
  # runtime, and the shared libraries bundle-deps copied (by their SONAME); the C library's
  # own static stubs (librt.a, ...) stay behind.
  local src soname found
  for word in $(cat "$link"); do
    case "$word" in
      /usr/lib/*.a|/lib/*.a) ;;
      *.a) src=$word; [[ $word = /* ]] || src=$build/examples/$word
           cp "$src" "$bundle/static/"
           echo "static/$(basename "$word")" >>"$bundle/link-libs.txt" ;;
      /*.so*) soname=$(objdump -p "$word" 2>/dev/null | awk '/SONAME/{print $2}')
              [ -n "$soname" ] && [ -e "$bundle/lib/$soname" ] && echo "lib/$soname" >>"$bundle/link-libs.txt" ;;
      -lcudadevrt|-lcudart_static)
              cp "${CUDA_HOME:-/usr/local/cuda}/lib64/lib${word#-l}.a" "$bundle/static/"
              echo "static/lib${word#-l}.a" >>"$bundle/link-libs.txt" ;;
      -l*) found=$(cd "$bundle" && ls lib/lib${word#-l}.so.* 2>/dev/null | head -1 || true)
           echo "${found:-$word}" >>"$bundle/link-libs.txt" ;;
      -pthread) echo "$word" >>"$bundle/link-libs.txt" ;;
    esac
  done
  strip --strip-debug "$bundle"/bin/* "$bundle"/lib/* "$bundle"/static/* 2>/dev/null || true
  echo "torch-gpu-check: $bundle/ is $(du -sh "$bundle" | cut -f1); link order in $bundle/link-libs.txt"
  cat <<EOF

Run on the GPU machine (one GPU is enough: both ranks use GPU 0):
  run(kind="nvidia-h200", carry=["$bundle"], timeout_s=600, command="bash scripts/torch-gpu-check.sh run")
EOF
}

check() {  # name status [why]
  if [ "$2" = 0 ]; then echo "CHECK $1: ok"; else echo "CHECK $1: FAILED (${3:-see \$OUT})"; fi
}

run() {
  local out=${OUT:-$repo/torch-gpu-out}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$repo/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi -L 2>&1 | tee "$out/nvidia-smi.txt"
  local py=${PYTHON:-python3}
  local info
  info=$($py - <<'PY' 2>&1
import torch, torch.utils.cpp_extension as ce
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count(), "cxx11abi", torch.compiled_with_cxx11_abi())
# Older torch takes cuda=True, newer (2.11 on the H200 machine) device_type="cuda".
def paths(f):
    try:
        return f(device_type="cuda")
    except TypeError:
        return f(cuda=True)
print("INCLUDES", " ".join(paths(ce.include_paths)))
print("LIBDIRS", " ".join(paths(ce.library_paths)))
import sysconfig; print("PYINC", sysconfig.get_paths()["include"]); print("EXT", sysconfig.get_config_var("EXT_SUFFIX"))
PY
  )
  local rc=$?
  echo "$info" | tee "$out/torch-info.txt"
  check "python3 imports torch" $rc "$(echo "$info" | tail -1)"
  ((rc == 0)) || return 1
  local cuda_flag=-DGRADSYNC_TORCH_CUDA cuda_libs=(-ltorch_cuda -lc10_cuda) test=tests/torch/ddp_gpu_step.py
  local rank_env=(GRADSYNC_DEVICE=0)  # both ranks' communicators on GPU 0
  local what="2-rank DDP step with CUDA tensors on GPU 0 over gradsync"
  if [ "${CPU_ONLY:-0}" = 1 ]; then
    cuda_flag=-UGRADSYNC_TORCH_CUDA cuda_libs=() test=tests/torch/ddp_gradsync_test.py rank_env=()
    what="2-rank collectives and DDP with CPU tensors over gradsync, against gloo (CPU_ONLY)"
  else
    echo "$info" | grep -q "available True" || { check "torch sees a CUDA device" 1 "torch.cuda.is_available() is False"; return 1; }
  fi
  if echo "$info" | grep -q "cxx11abi False"; then
    check "C++ ABI" 1 "this torch uses the pre-C++11 std::string ABI; libgradsync (built on Debian 12) uses the C++11 one, and the gradsync API passes std::string (Status, JoinOptions): rebuild gradsync with -D_GLIBCXX_USE_CXX11_ABI=0 and its dependencies, or use a torch built with the C++11 ABI (pip wheels from 2.7)"
    return 1
  fi
  local cxx
  cxx=$(command -v c++ || command -v g++ || true)
  [ -n "$cxx" ] || { check "C++ compiler" 1 "no c++/g++ on this machine"; return 1; }
  local includes libdirs pyinc ext
  includes=$(echo "$info" | sed -n 's/^INCLUDES //p')
  libdirs=$(echo "$info" | sed -n 's/^LIBDIRS //p')
  pyinc=$(echo "$info" | sed -n 's/^PYINC //p')
  ext=$(echo "$info" | sed -n 's/^EXT //p')
  local cuda_inc=""
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do [ -n "$d" ] && [ -e "$d/include/cuda_runtime_api.h" ] && cuda_inc="-I$d/include" && break; done
  if [ -z "$cuda_inc" ]; then
    cuda_inc=$($py -c 'import nvidia.cuda_runtime, os; print("-I" + os.path.join(list(nvidia.cuda_runtime.__path__)[0], "include"))' 2>/dev/null || true)
  fi
  mkdir -p "$repo/$bundle/python/gradsync_torch"
  local so=$repo/$bundle/python/gradsync_torch/_gradsync_torch$ext
  local flags=(-O2 -std=c++17 -shared -fPIC $cuda_flag -DTORCH_EXTENSION_NAME=_gradsync_torch
               -D_GLIBCXX_USE_CXX11_ABI=1 -I"$repo/$bundle/include" -Iintegrations/torch -I"$pyinc" $cuda_inc)
  for i in $includes; do flags+=(-I"$i"); done
  local libs=()
  for d in $libdirs; do libs+=(-L"$d" -Wl,-rpath,"$d"); done
  libs+=(-L"$repo/$bundle/lib" -Wl,--start-group)
  while read -r l; do case "$l" in static/*|lib/*) libs+=("$repo/$bundle/$l") ;; *) libs+=("$l") ;; esac; done <"$repo/$bundle/link-libs.txt"
  libs+=(-Wl,--end-group -ltorch_python -ltorch -ltorch_cpu -lc10 "${cuda_libs[@]}")
  echo "$cxx ${flags[*]} integrations/torch/gradsync_backend.cc -o $so ${libs[*]}" >"$out/build-command.txt"
  local t0=$SECONDS
  "$cxx" "${flags[@]}" integrations/torch/gradsync_backend.cc -o "$so" "${libs[@]}" >"$out/build.log" 2>&1
  rc=$?
  check "build the extension against this torch ($((SECONDS - t0)) s)" $rc "$(grep -m1 -i error "$out/build.log")"
  ((rc == 0)) || { tail -30 "$out/build.log"; return 1; }
  cp integrations/torch/gradsync_torch/__init__.py "$repo/$bundle/python/gradsync_torch/"
  export PYTHONPATH=$repo/$bundle/python${PYTHONPATH:+:$PYTHONPATH}
  $py -c 'import gradsync_torch; print("gradsync_torch imported, base class", gradsync_torch.TORCH_BASE_CLASS)' \
    >"$out/import.log" 2>&1
  rc=$?
  check "import gradsync_torch (registers the backend)" $rc "$(tail -1 "$out/import.log")"
  ((rc == 0)) || return 1
  env "${rank_env[@]}" GRADSYNC_TUNE=0 timeout 300 "$repo/$bundle/bin/gradsyncrun" --standalone -n 2 --timeout-s 280 \
    "$py" "$test" >"$out/ddp-gpu.log" 2>&1
  rc=$?
  grep -h "CHECK\|OK:\|FAIL" "$out/ddp-gpu.log" | sort -u
  check "$what" $rc "$(grep -m1 -i "fail\|error" "$out/ddp-gpu.log")"
  return $rc
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
