#!/bin/sh
# Generates the LuaJIT cdef of the public header as a C string (build/gen/cdef.inc), so the library
# carries the exact declarations it was compiled from (ms_cdef()), and a plain copy for reading.
# Usage: gen-cdef.sh CC HEADER OUTDIR
set -eu
cc=$1; header=$2; out=$3
mkdir -p "$out"
"$cc" -E -P -DMS_CDEF_GEN -x c "$header" | grep -v '^[[:space:]]*$' > "$out/cdef.h.tmp"
mv "$out/cdef.h.tmp" "$out/cdef.h"
sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/"/' -e 's/$/\\n"/' "$out/cdef.h" > "$out/cdef.inc.tmp"
mv "$out/cdef.inc.tmp" "$out/cdef.inc"
