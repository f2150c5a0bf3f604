#!/bin/bash
# A/B of one environment setting of the SinkGD kernels (e.g. MOONSTEP_SINKGD_K=2), on the GPU host, in one
# command: the SinkGD CUDA specs with the setting on, then bench/sinkgd_bench.lua without and with it, alternated
# process by process (`rounds` times), so that both see the same machine state.
#   bash bench/sinkgd_ab.sh MOONSTEP_SINKGD_SPLIT=1000000000000 [shapes|none] [set|noset] [rounds]
# (from the repository root or a build-gpu/ snapshot, with build/ and .gpu-host/ carried)
set -u
[ -f .gpu-host/env.sh ] && . .gpu-host/env.sh
setting=$1; shapes=${2:-2048x2048,4096x4096,1024x4096,14336x4096,4096x14336,8x1408x2048}; set_arg=${3:-set}
rounds=${4:-2}
out=${OUT:-/tmp}
export MOONSTEP_BUILD=${MOONSTEP_BUILD:-build}
echo "== specs with $setting"
# (timeouts: a kernel that deadlocks must not spend the session's device time)
timeout 300 env "$setting" luajit "$(command -v busted)" tests/cuda_sinkgd_spec.lua tests/capture_spec.lua \
    > "$out/ab_specs.log" 2>&1
echo "rc $?"; grep -B2 -A14 "^Failure ->\|^Error ->" "$out/ab_specs.log" | head -40; tail -n 1 "$out/ab_specs.log"
for r in $(seq 1 "$rounds"); do
    echo "== without, round $r"
    timeout 150 "$MOONSTEP_BUILD/moonstep" bench/sinkgd_bench.lua "$out/ab_a$r.json" "$shapes" "$set_arg" 2>&1 | grep -E " ms  floor|copy"
    echo "== with $setting, round $r"
    timeout 150 env "$setting" "$MOONSTEP_BUILD/moonstep" bench/sinkgd_bench.lua "$out/ab_b$r.json" "$shapes" "$set_arg" 2>&1 |
        grep -E " ms  floor|copy"
done
