#!/bin/bash
# The GPU host's routine, in one command: the whole suite on a carried build (no rebuild there), the CUDA
# specs under compute-sanitizer, and the benchmarks named as arguments (core, ...), each next to its PyTorch
# baseline in a separate process.  Logs go to $OUT when it is set.
# Build here first with `make tests` (the library, the host and the C test programs), then, on the GPU host
# (from the repository root, with build/ and .gpu-host/ carried): bash bench/gpu-host.sh [check] [sanitize] [core] [overhead] [dash]
set -u
. .gpu-host/env.sh
out=${OUT:-/tmp}
export MOONSTEP_BUILD=${MOONSTEP_BUILD:-build}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git_rev=$(cat .git/HEAD 2>/dev/null)
echo "tree: $git_rev"
for what in "$@"; do
    case "$what" in
    check)
        echo "== make check"
        make check 2>&1 | tee "$out/check.log" | tail -n 25 ;;
    sanitize)
        echo "== compute-sanitizer on the CUDA specs"
        for spec in tests/cuda_spec.lua tests/cuda_optim_spec.lua tests/cuda_sinkgd_spec.lua tests/capture_spec.lua tests/cuda_dash_spec.lua; do
            MS_UNDER_SANITIZER=1 compute-sanitizer --tool memcheck --report-api-errors no \
                luajit -joff "$(command -v busted)" "$spec" > "$out/sanitize-$(basename "$spec" .lua).log" 2>&1
            grep -E "ERROR SUMMARY|successes" "$out/sanitize-$(basename "$spec" .lua).log"
        done ;;
    overhead)
        echo "== host overhead per optimizer step, captured vs not (Lua, then C through the embedding API)"
        "$MOONSTEP_BUILD/moonstep" bench/overhead.lua "$out/overhead.json"
        if [ -x "$MOONSTEP_BUILD/bench/overhead_c" ]; then "$MOONSTEP_BUILD/bench/overhead_c"
        else echo "no $MOONSTEP_BUILD/bench/overhead_c: build it with 'make bench-c' before carrying build/"; fi ;;
    dash)
        echo "== DASH: solvers and the optimizer step on the subset (228 x 1024 + 12 x 512), then the PyTorch baseline"
        "$MOONSTEP_BUILD/moonstep" bench/dash_bench.lua --set subset --json "$out/ms_dash.json" 2>&1 | tee "$out/dash.log"
        python3 bench/torch_baselines/dash.py --spectrum controlled 2>&1 | tee "$out/dash_torch.log" ;;
    core)
        echo "== core benchmark"
        "$MOONSTEP_BUILD/moonstep" bench/core_bench.lua "$out/ms_core.json" && python3 bench/torch_core.py "$out/ms_core.json" ;;
    *)
        echo "unknown step '$what'"; exit 2 ;;
    esac
done
