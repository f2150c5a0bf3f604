/*
** The heap cap of the recipe sandbox (moonstep.h, "A cap on a Lua state's heap"): a lua_Alloc that forwards
** to the one it wraps and refuses growth past a limit.
*/
#include "internal.h"

#include <pthread.h>
#include <stdlib.h>

static ms_lua_heap_cap *caps;   /* every cap made, for the life of the process */
static pthread_mutex_t caps_lock = PTHREAD_MUTEX_INITIALIZER;

MS_API ms_lua_heap_cap *ms_lua_heap_cap_new(void)
{
    ms_lua_heap_cap *cap = calloc(1, sizeof *cap);
    if (cap == NULL) return NULL;
    pthread_mutex_lock(&caps_lock);
    cap->next = caps;
    caps = cap;
    pthread_mutex_unlock(&caps_lock);
    return cap;
}

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
    if (p != NULL || nsize == 0) {
        cap->grown += delta;
        if (delta > 0) cap->allocated += delta;
    }
    return p;
}

MS_API void ms_lua_heap_cap_disarm(ms_lua_heap_cap *cap)
{
    if (cap && cap->setallocf) cap->setallocf(cap->L, (void *)cap->alloc, cap->ud);
}
