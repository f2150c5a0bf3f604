/*
** The stream-ordered caching pool of a CUDA context: device blocks by size class (4 classes per power of two
** up to 32 MiB, 2 MiB steps above), reused in the context's stream order without the driver; cross-stream
** uses deferred by events; blocks of a graph capture kept for the graph.  Freeing never calls the driver.
*/
#include "cuda.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MIN_BLOCK   512u
#define SMALL_MAX   ((size_t)32 << 20)     /* above: rounded to LARGE_STEP, one list, best fit */
#define LARGE_STEP  ((size_t)2 << 20)
#define NBINS       80

typedef enum block_state {
    BLOCK_LIVE,      /* held by a tensor (or scratch) */
    BLOCK_FREE,      /* in its size class's free list, reusable in stream order */
    BLOCK_PENDING,   /* freed, but other streams' recorded uses may not have passed yet */
    BLOCK_KEPT       /* freed, but a graph may still write it: reusable only inside that graph's capture */
} block_state;

typedef struct use {
    cudaStream_t stream;
    cudaEvent_t  ev;    /* recorded on `stream` after its last use of the block */
} use;

typedef struct block {
    char          *ptr;
    size_t         size;
    int            bin;           /* size class; -1 for large blocks */
    block_state    state;
    ms_cuda_graph *graph;         /* allocated or freed during this graph's capture: kept for it */
    struct block  *next;          /* in a free, pending or capture list */
    int            nuse, capuse;
    use           *uses;
} block;

struct ms_cuda_pool {
    pthread_mutex_t lock;         /* frees may come from any thread */
    ms_ctx         *ctx;          /* the owner (not retained: the pool dies with it) */
    block          *bins[NBINS];  /* free blocks of each size class */
    block          *large;        /* free blocks above SMALL_MAX */
    block          *pending;
    block          *cap_free;     /* blocks freed during the current capture, reusable by it */
    ms_cuda_graph  *capture;
    block         **index;        /* every block the driver gave us, sorted by address */
    int             nindex, capindex;
    int64_t         held;         /* bytes allocated from the driver */
    int64_t         cached;       /* bytes in free, pending and kept blocks */
};

/* Every pool of the process, for finding the owner of memory another context uses. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static ms_cuda_pool **registry;
static int nregistry, capregistry;

/* --- size classes ----------------------------------------------------------------------------------- */

/* The block size serving n bytes, and its class (-1: large). */
static size_t class_of(size_t n, int *bin)
{
    if (n <= MIN_BLOCK) { *bin = 0; return MIN_BLOCK; }
    if (n > SMALL_MAX) { *bin = -1; return (n + LARGE_STEP - 1) / LARGE_STEP * LARGE_STEP; }
    int e = 63 - __builtin_clzll((unsigned long long)(n - 1));   /* 2^e < n <= 2^(e+1), e >= 9 */
    size_t q = (size_t)1 << (e - 2);                              /* a quarter of 2^e */
    size_t steps = (n + q - 1) / q;                               /* 5 .. 8: sizes 2^e * {1.25 .. 2} */
    *bin = 1 + 4 * (e - 9) + (int)(steps - 5);
    return steps * q;
}

/* --- the address index ------------------------------------------------------------------------------ */

/* Position of the last block starting at or below p, or -1. */
static int index_floor(const ms_cuda_pool *pool, const void *p)
{
    int lo = 0, hi = pool->nindex - 1, at = -1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if ((const char *)pool->index[mid]->ptr <= (const char *)p) { at = mid; lo = mid + 1; }
        else hi = mid - 1;
    }
    return at;
}

static block *find_containing(const ms_cuda_pool *pool, const void *p)
{
    int at = index_floor(pool, p);
    if (at < 0) return NULL;
    block *b = pool->index[at];
    return (const char *)p < b->ptr + b->size ? b : NULL;
}

static bool index_insert(ms_cuda_pool *pool, block *b)
{
    if (pool->nindex == pool->capindex) {
        int cap = pool->capindex ? pool->capindex * 2 : 64;
        block **grown = realloc(pool->index, sizeof *grown * (size_t)cap);
        if (grown == NULL) return false;
        pool->index = grown;
        pool->capindex = cap;
    }
    int at = index_floor(pool, b->ptr) + 1;
    memmove(pool->index + at + 1, pool->index + at, sizeof *pool->index * (size_t)(pool->nindex - at));
    pool->index[at] = b;
    pool->nindex++;
    return true;
}

static void index_remove(ms_cuda_pool *pool, block *b)
{
    int at = index_floor(pool, b->ptr);
    if (at < 0 || pool->index[at] != b) return;
    memmove(pool->index + at, pool->index + at + 1, sizeof *pool->index * (size_t)(pool->nindex - at - 1));
    pool->nindex--;
}

/* --- lists ------------------------------------------------------------------------------------------ */

static void push_free(ms_cuda_pool *pool, block *b)
{
    b->state = BLOCK_FREE;
    block **list = b->bin >= 0 ? &pool->bins[b->bin] : &pool->large;
    b->next = *list;
    *list = b;
}

/* Removes and returns the block of `list` serving `size` bytes of class `bin` (best fit for large ones:
** at most 1/8 larger than asked), or NULL. */
static block *take(block **list, int bin, size_t size)
{
    block **best = NULL;
    for (block **pp = list; *pp; pp = &(*pp)->next) {
        block *b = *pp;
        if (bin >= 0) {
            if (b->bin == bin) { best = pp; break; }
        } else if (b->bin < 0 && b->size >= size && b->size - size <= size / 8 &&
                   (best == NULL || b->size < (*best)->size)) {
            best = pp;
        }
    }
    if (best == NULL) return NULL;
    block *b = *best;
    *best = b->next;
    b->next = NULL;
    return b;
}

/* True when every recorded use of b by another stream has completed (never waits). */
static bool uses_done(block *b)
{
    for (int i = 0; i < b->nuse; i++) {
        cudaError_t e = cudaEventQuery(b->uses[i].ev);
        if (e == cudaErrorNotReady) {
            if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
            return false;
        }
        /* another error belongs to the work that recorded it, and is reported there */
        if (e != cudaSuccess) (void)cudaGetLastError();
    }
    return true;
}

static void clear_uses(block *b)
{
    for (int i = 0; i < b->nuse; i++) cudaEventDestroy(b->uses[i].ev);
    b->nuse = 0;
}

/* Pending blocks whose other-stream uses have all passed become free. */
static void poll_pending(ms_cuda_pool *pool)
{
    block **pp = &pool->pending;
    while (*pp) {
        block *b = *pp;
        if (uses_done(b)) {
            *pp = b->next;
            clear_uses(b);
            push_free(pool, b);
        } else {
            pp = &b->next;
        }
    }
}

static void release_block(ms_cuda_pool *pool, block *b)
{
    clear_uses(b);
    index_remove(pool, b);
    cudaFree(b->ptr);
    pool->held -= (int64_t)b->size;
    pool->cached -= (int64_t)b->size;
    free(b->uses);
    free(b);
}

/* Returns every free block to the driver, after the context's stream has passed them. */
static void release_free(ms_cuda_pool *pool)
{
    cudaStreamSynchronize(ms_cuda(pool->ctx)->stream);
    poll_pending(pool);
    for (int i = 0; i < NBINS; i++) {
        while (pool->bins[i]) {
            block *b = pool->bins[i];
            pool->bins[i] = b->next;
            release_block(pool, b);
        }
    }
    while (pool->large) {
        block *b = pool->large;
        pool->large = b->next;
        release_block(pool, b);
    }
    pool->ctx->bytes_cached = pool->cached;
}

/* --- the pool --------------------------------------------------------------------------------------- */

ms_status ms_cuda_pool_new(ms_ctx *ctx, ms_cuda_pool **out)
{
    ms_cuda_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_ctx_new: out of host memory");
    pthread_mutex_init(&pool->lock, NULL);
    pool->ctx = ctx;
    pthread_mutex_lock(&registry_lock);
    if (nregistry == capregistry) {
        int cap = capregistry ? capregistry * 2 : 8;
        ms_cuda_pool **grown = realloc(registry, sizeof *grown * (size_t)cap);
        if (grown == NULL) {
            pthread_mutex_unlock(&registry_lock);
            pthread_mutex_destroy(&pool->lock);
            free(pool);
            return MS_FAIL(ctx, MS_E_OOM, "ms_ctx_new: out of host memory");
        }
        registry = grown;
        capregistry = cap;
    }
    registry[nregistry++] = pool;
    pthread_mutex_unlock(&registry_lock);
    *out = pool;
    return MS_OK;
}

/* Called when the context goes: no tensor or graph uses its memory any more. */
void ms_cuda_pool_destroy(ms_ctx *ctx, ms_cuda_pool *pool)
{
    (void)ctx;
    if (pool == NULL) return;
    pthread_mutex_lock(&registry_lock);
    for (int i = 0; i < nregistry; i++)
        if (registry[i] == pool) { registry[i] = registry[--nregistry]; break; }
    pthread_mutex_unlock(&registry_lock);
    for (int i = 0; i < pool->nindex; i++) {
        block *b = pool->index[i];
        for (int u = 0; u < b->nuse; u++) cudaEventSynchronize(b->uses[u].ev);
        clear_uses(b);
        cudaFree(b->ptr);
        free(b->uses);
        free(b);
    }
    free(pool->index);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

ms_status ms_cuda_pool_alloc(ms_ctx *ctx, size_t nbytes, void **out)
{
    ms_cuda_pool *pool = ms_cuda(ctx)->pool;
    int bin;
    size_t size = class_of(nbytes, &bin);
    *out = NULL;
    pthread_mutex_lock(&pool->lock);
    block *b = NULL;
    if (pool->capture) {
        b = take(&pool->cap_free, bin, size);
        if (b == NULL) b = take(bin >= 0 ? &pool->bins[bin] : &pool->large, bin, size);
        if (b == NULL) {
            pthread_mutex_unlock(&pool->lock);
            return ms_cuda_note_failure(ctx, MS_FAIL(ctx, MS_E_OOM, "out of memory on %s: %zu bytes requested "
                "while capturing a graph, and the pool has no cached block of that size (allocations during "
                "capture never reach the driver: run the sequence once before capturing)", ctx->name, nbytes));
        }
        pool->cached -= (int64_t)b->size;
    } else {
        if (pool->pending) poll_pending(pool);
        b = take(bin >= 0 ? &pool->bins[bin] : &pool->large, bin, size);
        if (b) pool->cached -= (int64_t)b->size;
    }
    if (b == NULL) {
        /* a new block from the driver; with a memory limit, cached blocks go first so the device holds
        ** no more than the limit; when the driver is out of memory, they go and it is asked again */
        if (ctx->mem_limit > 0 && pool->held + (int64_t)size > ctx->mem_limit) release_free(pool);
        void *mem = NULL;
        cudaError_t e = cudaMalloc(&mem, size);
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            release_free(pool);
            e = cudaMalloc(&mem, size);
        }
        b = e == cudaSuccess ? calloc(1, sizeof *b) : NULL;
        if (b) {
            b->ptr = mem;   /* before index_insert, which sorts by it */
            b->size = size;
            b->bin = bin;
        }
        if (b == NULL || !index_insert(pool, b)) {
            int64_t held = pool->held, cached = pool->cached;
            if (mem) cudaFree(mem);
            free(b);
            pthread_mutex_unlock(&pool->lock);
            if (e == cudaSuccess) return MS_FAIL(ctx, MS_E_OOM, "out of host memory on %s", ctx->name);
            (void)cudaGetLastError();
            if (e == cudaErrorMemoryAllocation)
                return MS_FAIL(ctx, MS_E_OOM, "out of memory on %s: %zu bytes requested (a block of %zu), the "
                               "driver has no more (the pool holds %lld bytes, %lld of them cached)", ctx->name,
                               nbytes, size, (long long)held, (long long)cached);
            return ms_cuda_fail(ctx, e, "cudaMalloc", __FILE__, __LINE__);
        }
        pool->held += (int64_t)size;
        ctx->num_device_allocs++;
    }
    b->state = BLOCK_LIVE;
    if (pool->capture) b->graph = pool->capture;
    ctx->bytes_cached = pool->cached;
    pthread_mutex_unlock(&pool->lock);
    *out = b->ptr;
    return MS_OK;
}

void ms_cuda_pool_free(ms_ctx *ctx, void *ptr)
{
    ms_cuda_pool *pool = ms_cuda(ctx)->pool;
    pthread_mutex_lock(&pool->lock);
    int at = index_floor(pool, ptr);
    block *b = at >= 0 && pool->index[at]->ptr == ptr ? pool->index[at] : NULL;
    if (b && b->state == BLOCK_LIVE) {
        if (pool->capture && b->graph == NULL) b->graph = pool->capture;
        if (b->graph && b->graph == pool->capture) {
            /* the capture may still write it, later in its own order: reusable by the capture only -- and not
            ** even by it while another stream's recorded uses may not have passed (a replay on this stream would
            ** write it under their reads); such a block waits for the graph's release, then for those uses */
            b->state = BLOCK_KEPT;
            if (b->nuse == 0) {
                b->next = pool->cap_free;
                pool->cap_free = b;
            }
        } else if (b->graph) {
            b->state = BLOCK_KEPT;       /* replays of its graph write it: kept until the graph goes */
        } else if (b->nuse > 0) {
            b->state = BLOCK_PENDING;
            b->next = pool->pending;
            pool->pending = b;
        } else {
            push_free(pool, b);
        }
        pool->cached += (int64_t)b->size;
        ctx->bytes_cached = pool->cached;
    }
    pthread_mutex_unlock(&pool->lock);
}

ms_status ms_cuda_pool_trim(ms_ctx *ctx)
{
    ms_cuda_pool *pool = ms_cuda(ctx)->pool;
    pthread_mutex_lock(&pool->lock);
    release_free(pool);
    pthread_mutex_unlock(&pool->lock);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? MS_OK : ms_cuda_fail(ctx, e, "cudaFree", __FILE__, __LINE__);
}

void ms_cuda_pool_track(ms_ctx *ctx, const void *p)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (p == NULL || c->capture) return;
    ms_cuda_pool *own = c->pool;
    pthread_mutex_lock(&own->lock);
    bool mine = find_containing(own, p) != NULL;
    pthread_mutex_unlock(&own->lock);
    if (mine) return;
    pthread_mutex_lock(&registry_lock);
    for (int i = 0; i < nregistry; i++) {
        ms_cuda_pool *pool = registry[i];
        if (pool == own || ms_cuda(pool->ctx)->device != c->device) continue;
        pthread_mutex_lock(&pool->lock);
        block *b = find_containing(pool, p);
        if (b && b->state == BLOCK_LIVE) {
            int u = 0;
            while (u < b->nuse && b->uses[u].stream != c->stream) u++;
            if (u == b->nuse) {
                cudaEvent_t ev;
                bool room = b->nuse < b->capuse;
                if (!room) {
                    int cap = b->capuse ? b->capuse * 2 : 2;
                    use *grown = realloc(b->uses, sizeof *grown * (size_t)cap);
                    if (grown) { b->uses = grown; b->capuse = cap; room = true; }
                }
                if (room && cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
                    b->uses[u].stream = c->stream;
                    b->uses[u].ev = ev;
                    b->nuse++;
                } else {
                    u = -1;
                }
            }
            /* re-recording moves the mark to this later use (a stream passes its points in order) */
            if (u >= 0) cudaEventRecord(b->uses[u].ev, c->stream);
        }
        pthread_mutex_unlock(&pool->lock);
        if (b) break;
    }
    pthread_mutex_unlock(&registry_lock);
}

void ms_cuda_pool_capture_begin(ms_ctx *ctx, ms_cuda_graph *g)
{
    ms_cuda_pool *pool = ms_cuda(ctx)->pool;
    pthread_mutex_lock(&pool->lock);
    pool->capture = g;
    pool->cap_free = NULL;
    pthread_mutex_unlock(&pool->lock);
}

void ms_cuda_pool_capture_end(ms_ctx *ctx)
{
    ms_cuda_pool *pool = ms_cuda(ctx)->pool;
    pthread_mutex_lock(&pool->lock);
    for (block *b = pool->cap_free, *next; b; b = next) {   /* stay kept for the graph, out of any list */
        next = b->next;
        b->next = NULL;
    }
    pool->cap_free = NULL;
    pool->capture = NULL;
    pthread_mutex_unlock(&pool->lock);
}

/* The graph is gone: its kept blocks become reusable (its replays were queued on the same stream, so the
** stream's order still protects them), its live ones free normally later. */
void ms_cuda_pool_graph_release(ms_ctx *ctx, ms_cuda_graph *g)
{
    ms_cuda_pool *pool = ms_cuda(ctx)->pool;
    pthread_mutex_lock(&pool->lock);
    for (int i = 0; i < pool->nindex; i++) {
        block *b = pool->index[i];
        if (b->graph != g) continue;
        b->graph = NULL;
        if (b->state != BLOCK_KEPT) continue;
        if (b->nuse > 0) {
            b->state = BLOCK_PENDING;
            b->next = pool->pending;
            pool->pending = b;
        } else {
            push_free(pool, b);
        }
    }
    ctx->bytes_cached = pool->cached;
    pthread_mutex_unlock(&pool->lock);
}
