#!/bin/sh
# Makes build-gpu/: a self-contained snapshot for a GPU-host run, small enough to carry (the run tool copies the
# working tree; C test programs that link the engine statically are ~10 MB each).  It holds the library, the
# host, the generated cdef, the small programs (test_embed, examples, bench programs) and, with --tests, every C
# test program; plus the Lua, recipes, specs, benches and Python files as they are now.  Run `make tests examples
# bench-c` first.  On the GPU host: cd build-gpu && . ../.gpu-host/env.sh && MOONSTEP_BUILD=build ...
set -eu
rm -rf build-gpu && mkdir -p build-gpu/build/tests
for f in build/libmoonstep.so build/libmoonstep.so.[0-9] build/moonstep; do cp -L "$f" build-gpu/build/; done
cp -r build/gen build-gpu/build/
for d in bench examples; do [ -d "build/$d" ] && cp -r "build/$d" build-gpu/build/; done
for t in build/tests/test_*; do
    case "$t" in *.d) continue ;; esac
    if [ "${1:-}" = "--tests" ] || [ "$(stat -c %s "$t")" -lt 2000000 ]; then cp "$t" build-gpu/build/tests/; fi
done
cp -r lua tests recipes bench python examples scripts .busted Makefile README.md build-gpu/ 2>/dev/null || true
mkdir -p build-gpu/engine && cp -r engine/include build-gpu/engine/
du -sh build-gpu
