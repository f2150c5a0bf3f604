/*
** The heap cap of the recipe sandbox (moonstep.h, "A cap on a Lua state's heap"): a lua_Alloc that forwards
** to the one it wraps and refuses growth past a limit.
*/
#include "internal.h"

MS_API void *ms_lua_heap_cap_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    ms_lua_heap_cap *cap = ud;
    /* (Lua passes osize = 0 with ptr = NULL in 5.1, but LuaJIT may pass a type tag there: no old block) */
    int64_t old = ptr ? (int64_t)osize : 0;
    int64_t delta = (int64_t)nsize - old;
    if (delta > 0 && (nsize > (size_t)INT64_MAX || cap->grown + delta > cap->limit)) {
        cap->refused = 1;
        /* (LuaJIT has read allocf for this request already: setting it now takes effect from the next) */
        if (cap->setallocf) cap->setallocf(cap->L, (void *)cap->alloc, cap->ud);
        return NULL;
    }
    void *p = cap->alloc(cap->ud, ptr, osize, nsize);
    /* a failed request changes nothing; a free (nsize 0) always succeeds */
    if (p != NULL || nsize == 0) cap->grown += delta;
    return p;
}

MS_API void ms_lua_heap_cap_disarm(ms_lua_heap_cap *cap)
{
    if (cap && cap->setallocf) cap->setallocf(cap->L, (void *)cap->alloc, cap->ud);
}
