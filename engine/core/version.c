/*
** Version, ABI number, build description, the generated LuaJIT cdef of moonstep.h, and the host clock.
*/
#include "internal.h"

#include <time.h>

MS_API int ms_abi_version(void) { return MS_ABI_VERSION; }
MS_API const char *ms_version(void) { return MS_VERSION_STRING; }

MS_API const char *ms_cdef(void)
{
    /* build/gen/cdef.inc: the preprocessed public header as string literals (scripts/gen-cdef.sh) */
    return
#include "cdef.inc"
        ;
}

MS_API double ms_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

MS_API const char *ms_build_info(void)
{
    return "moonstep " MS_VERSION_STRING " (abi " MS_STRINGIFY(MS_ABI_VERSION) "); backends: cpu"
#ifdef MS_WITH_CUDA
           ", cuda"
#endif
           "; blas: OpenBLAS; lapack: LAPACKE; compiler: " __VERSION__;
}
