#!/usr/bin/env bash
# On the GPU host, from the repository root of a carried snapshot (scripts/gpu-carry.sh):
#   bash build-gpu/scripts/gpu-specs.sh cuda_spec.lua capture_spec.lua test_embed ...
# runs each named spec file (without the #multigpu tag) or C test program on its own, with a summary line each
# and the failures' messages, then the totals: a whole-suite run outlives one call of the device tool, and a
# run cut off by its limit still shows how far it got.
cd build-gpu || exit 1
ln -sfn ../.gpu-host .gpu-host
. .gpu-host/env.sh
export MOONSTEP_BUILD=build
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date
ok_all=0; bad_all=0
for s in "$@"; do
  case "$s" in
    test_*)
      out=$(build/tests/"$s" 2>&1)
      echo "$s: $(echo "$out" | grep -E 'passed, [0-9]+ failed' | tail -1)"
      echo "$out" | grep -i "fail" | grep -v " 0 failed" | head -5
      continue ;;
  esac
  out=$(timeout 300 luajit "$(command -v busted)" --exclude-tags=multigpu -o TAP "tests/$s" 2>&1)
  ok=$(echo "$out" | grep -c "^ok "); bad=$(echo "$out" | grep -c "^not ok ")
  echo "$s: $ok ok, $bad not ok"
  [ "$bad" -gt 0 ] && echo "$out" | grep -A12 "^not ok " | head -40
  ok_all=$((ok_all + ok)); bad_all=$((bad_all + bad))
done
echo "TOTAL $ok_all ok, $bad_all not ok"
date
