/*
** The CPU backend's communicators: one TCP socket from each rank to rank 0, opened by the rendezvous
** (ms_rendezvous_connect, engine/core/rendezvous.c) and kept for the collectives.  The core
** (engine/core/comm.c) has checked every argument; what crosses ranks is checked here.
**
** Every collective is a star through rank 0: each rank r > 0 sends a call (what it is doing) and its data;
** rank 0 reads the ranks in order 1 .. N-1, combines in rank order 0 .. N-1 (so the result does not depend
** on timing), and answers each rank with its result.  Reductions are in the dtype's own arithmetic (f32 in
** f32, f64 in f64, i32 and u8 wrapping), bf16 and f16 in f32, rounded once at the end; avg is the sum
** divided by the world size.  max and min keep NaN.
**
** Messages (integers big-endian):
**   call,   rank r -> rank 0:  "MSCC" | seq | kind | dtype | op or root | 0 | count (u64)      (32 bytes)
**   answer, rank 0 -> rank r:  "MSCA" | seq | status | 0 | bytes (u64)                       (24 bytes)
** followed by the data; an answer with a status other than 0 carries rank 0's message instead.  A rank that
** gives the communicator up (ms_comm_abort) sends, in place of its next call, one of kind 5 whose count is the
** length of its reason, which follows.  seq counts
** the collectives, so a rank that skipped one is caught.  When a collective fails anywhere the sockets are
** out of step: the communicator refuses every later collective, and rank 0 tells every rank why (a rank
** reads it at its next collective if this one already succeeded there).  Waits end at the timeout given to
** ms_comm_new (per collective); ranks other than 0 wait a second longer, so that rank 0's account of a
** missing rank reaches them before their own timeout does.
*/
#include "cpu.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_TIMEOUT_MS 300000
#define GRACE_MS 1000                  /* a rank > 0 waits this much longer than rank 0 */
#define CALL_MAGIC "MSCC"
#define ANSWER_MAGIC "MSCA"
#define CALL_BYTES 32
#define ANSWER_BYTES 24
#define WHY_BYTES 512                  /* the longest message rank 0 relays */

/* CALL_ABORT: a rank gave the communicator up (ms_comm_abort); its count is the length of the reason that follows */
enum { CALL_ALL_REDUCE = 1, CALL_BROADCAST = 2, CALL_ALL_GATHER = 3, CALL_REDUCE_SCATTER = 4, CALL_ABORT = 5 };
static const char *const call_name[] = { "?", "ms_comm_all_reduce", "ms_comm_broadcast", "ms_comm_all_gather",
                                         "ms_comm_reduce_scatter", "ms_comm_abort" };
static const char *const op_name[] = { "sum", "max", "min", "avg" };

typedef struct cpu_comm {
    int       rank, world_size, timeout_ms;
    int      *fd;                /* rank 0: fd[r] to rank r (fd[0] = -1); rank r > 0: fd[0] to rank 0 */
    uint32_t  seq;               /* collectives begun: the same on every rank */
    bool      failed;            /* a collective failed: refuse the later ones */
    char      why[WHY_BYTES];    /* the first failure's message */
} cpu_comm;

/* What one rank says it is doing: the same on every rank of a collective. */
typedef struct call {
    uint32_t seq, kind, dtype, arg;   /* arg: the op (reductions) or the root (broadcast) */
    uint64_t count;                   /* elements of dst (all_reduce, reduce_scatter), src (all_gather), t */
} call;

static void put_u64(unsigned char *p, uint64_t v) { ms_put_be32(p, (uint32_t)(v >> 32)); ms_put_be32(p + 4, (uint32_t)v); }
static uint64_t get_u64(const unsigned char *p) { return (uint64_t)ms_get_be32(p) << 32 | ms_get_be32(p + 4); }

/* --- sockets ------------------------------------------------------------------------------------- */

typedef enum { IO_OK, IO_CLOSED, IO_TIMEOUT, IO_ANSWERED, IO_FAILED } io_result;

/* Sends n bytes before the deadline.  With watch_input, stops at IO_ANSWERED when the peer has something
** to say first (rank 0 answers a rank before it has read all of its data only to report a failure). */
static io_result send_all(int fd, const void *buf, size_t n, int64_t deadline, bool watch_input)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);   /* a peer gone must not raise SIGPIPE */
        if (k > 0) { p += k; n -= (size_t)k; continue; }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) return IO_CLOSED;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return IO_FAILED;
        int64_t left = deadline - ms_now_ms();
        if (left <= 0) return IO_TIMEOUT;
        struct pollfd q = { .fd = fd, .events = (short)(POLLOUT | (watch_input ? POLLIN : 0)) };
        if (poll(&q, 1, (int)(left < 1000 ? left : 1000)) < 0 && errno != EINTR) return IO_FAILED;
        if (watch_input && (q.revents & POLLIN)) return IO_ANSWERED;
        if ((q.revents & (POLLERR | POLLHUP)) && !(q.revents & POLLOUT)) return IO_CLOSED;
    }
    return IO_OK;
}

/* Receives exactly n bytes before the deadline. */
static io_result recv_all(int fd, void *buf, size_t n, int64_t deadline)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k > 0) { p += k; n -= (size_t)k; continue; }
        if (k == 0) return IO_CLOSED;
        if (errno == EINTR) continue;
        if (errno == ECONNRESET) return IO_CLOSED;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return IO_FAILED;
        int64_t left = deadline - ms_now_ms();
        if (left <= 0) return IO_TIMEOUT;
        struct pollfd q = { .fd = fd, .events = POLLIN };
        if (poll(&q, 1, (int)(left < 1000 ? left : 1000)) < 0 && errno != EINTR) return IO_FAILED;
    }
    return IO_OK;
}

/* --- failures ------------------------------------------------------------------------------------ */

static void describe(char *buf, size_t n, const call *k)
{
    const char *kind = k->kind >= 1 && k->kind <= 4 ? call_name[k->kind] : "an unknown collective";
    const char *dt = ms_dtype_name((ms_dtype)k->dtype);
    switch (k->kind) {
    case CALL_BROADCAST:
        snprintf(buf, n, "%s (root %u) of %llu %s elements", kind, k->arg, (unsigned long long)k->count, dt);
        break;
    case CALL_ALL_GATHER:
        snprintf(buf, n, "%s of %llu %s elements each", kind, (unsigned long long)k->count, dt);
        break;
    default:
        snprintf(buf, n, "%s (%s) of %llu %s elements%s", kind, k->arg <= 3 ? op_name[k->arg] : "?",
                 (unsigned long long)k->count, dt, k->kind == CALL_REDUCE_SCATTER ? " each" : "");
    }
}

/* Sends an answer header (and `bytes` of data to follow, or the message when status != 0). */
static io_result send_answer(int fd, uint32_t seq, ms_status status, const void *data, uint64_t bytes,
                             int64_t deadline)
{
    unsigned char h[ANSWER_BYTES] = { 0 };
    memcpy(h, ANSWER_MAGIC, 4);
    ms_put_be32(h + 4, seq);
    ms_put_be32(h + 8, (uint32_t)status);
    put_u64(h + 16, bytes);
    io_result io = send_all(fd, h, sizeof h, deadline, false);
    if (io == IO_OK && bytes > 0) io = send_all(fd, data, (size_t)bytes, deadline, false);
    return io;
}

/* Records a failure of this collective: the communicator is done for.  Rank 0 tells every rank (best
** effort: some may be gone).  Returns st with the message on ctx. */
static ms_status fail(ms_ctx *ctx, cpu_comm *c, ms_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static ms_status fail(ms_ctx *ctx, cpu_comm *c, ms_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->why, sizeof c->why, fmt, ap);
    va_end(ap);
    c->failed = true;
    if (c->rank == 0) {
        int64_t deadline = ms_now_ms() + 200;   /* a rank that does not read is gone or will time out itself */
        for (int r = 1; r < c->world_size; r++)
            if (c->fd[r] >= 0) send_answer(c->fd[r], c->seq, st, c->why, strlen(c->why) + 1, deadline);
    } else if (c->fd[0] >= 0) {
        shutdown(c->fd[0], SHUT_RDWR);       /* rank 0 sees the end of the stream at once */
    }
    return MS_FAIL(ctx, st, "%s", c->why);
}

static ms_status io_fail(ms_ctx *ctx, cpu_comm *c, const char *fn, io_result io, int peer, int64_t waited_ms)
{
    if (c->rank == 0) {
        if (io == IO_TIMEOUT)
            return fail(ctx, c, MS_E_IO, "%s: rank 0 waited %lld ms for rank %d (collective #%u of a world of %d; "
                        "that rank is stuck, slower than the timeout, or skipped the call)", fn,
                        (long long)waited_ms, peer, c->seq, c->world_size);
        if (io == IO_CLOSED)
            return fail(ctx, c, MS_E_IO, "%s: rank %d closed its connection (it exited or failed) during collective "
                        "#%u", fn, peer, c->seq);
        return fail(ctx, c, MS_E_IO, "%s: the connection to rank %d failed during collective #%u: %s", fn, peer,
                    c->seq, strerror(errno));
    }
    if (io == IO_TIMEOUT)
        return fail(ctx, c, MS_E_IO, "%s: rank %d had no answer from rank 0 within %lld ms (collective #%u; rank 0 "
                    "or another rank is stuck, slower than the timeout, or skipped the call)", fn, c->rank,
                    (long long)waited_ms, c->seq);
    if (io == IO_CLOSED)
        return fail(ctx, c, MS_E_IO, "%s: rank %d lost its connection to rank 0 (rank 0 exited or failed) during "
                    "collective #%u", fn, c->rank, c->seq);
    return fail(ctx, c, MS_E_IO, "%s: rank %d's connection to rank 0 failed during collective #%u: %s", fn, c->rank,
                c->seq, strerror(errno));
}

/* --- reductions in rank order ------------------------------------------------------------------- */

#define REDUCE_LOOP(T, acc, x, n, op)                                                                     \
    do {                                                                                                  \
        T *a_ = (T *)(acc);                                                                               \
        const T *x_ = (const T *)(x);                                                                     \
        for (int64_t i = 0; i < (n); i++) a_[i] = op(a_[i], x_[i]);                                       \
    } while (0)
#define SUM(a, b) ((a) + (b))
#define MAX_NAN(a, b) ((a) != (a) || (a) >= (b) ? (a) : (b))   /* NaN wins, as it should be seen */
#define MIN_NAN(a, b) ((a) != (a) || (a) <= (b) ? (a) : (b))
#define MAX_INT(a, b) ((a) >= (b) ? (a) : (b))
#define MIN_INT(a, b) ((a) <= (b) ? (a) : (b))
#define SUM_I32(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))   /* wraps, as NCCL's does */
#define SUM_U8(a, b) ((uint8_t)((a) + (b)))

static bool is_half(ms_dtype dt) { return dt == MS_DTYPE_BF16 || dt == MS_DTYPE_F16; }

static float half_to_f32(ms_dtype dt, uint16_t h) { return dt == MS_DTYPE_BF16 ? ms_bf16_to_f32(h) : ms_f16_to_f32(h); }
static uint16_t f32_to_half(ms_dtype dt, float f) { return dt == MS_DTYPE_BF16 ? ms_f32_to_bf16(f) : ms_f32_to_f16(f); }

/* acc <- op(acc, x), elementwise; acc is f32 for bf16/f16 (x in the dtype), the dtype otherwise. */
static void combine(ms_dtype dt, ms_comm_op op, void *acc, const void *x, int64_t n)
{
    bool sum = op == MS_COMM_SUM || op == MS_COMM_AVG, max = op == MS_COMM_MAX;
    if (is_half(dt)) {
        float *a = acc;
        const uint16_t *h = x;
        for (int64_t i = 0; i < n; i++) {
            float v = half_to_f32(dt, h[i]);
            a[i] = sum ? a[i] + v : max ? MAX_NAN(a[i], v) : MIN_NAN(a[i], v);
        }
        return;
    }
    switch (dt) {
    case MS_DTYPE_F32:
        if (sum) REDUCE_LOOP(float, acc, x, n, SUM);
        else if (max) REDUCE_LOOP(float, acc, x, n, MAX_NAN);
        else REDUCE_LOOP(float, acc, x, n, MIN_NAN);
        break;
    case MS_DTYPE_F64:
        if (sum) REDUCE_LOOP(double, acc, x, n, SUM);
        else if (max) REDUCE_LOOP(double, acc, x, n, MAX_NAN);
        else REDUCE_LOOP(double, acc, x, n, MIN_NAN);
        break;
    case MS_DTYPE_I32:
        if (sum) REDUCE_LOOP(int32_t, acc, x, n, SUM_I32);
        else if (max) REDUCE_LOOP(int32_t, acc, x, n, MAX_INT);
        else REDUCE_LOOP(int32_t, acc, x, n, MIN_INT);
        break;
    default:   /* MS_DTYPE_U8 */
        if (sum) REDUCE_LOOP(uint8_t, acc, x, n, SUM_U8);
        else if (max) REDUCE_LOOP(uint8_t, acc, x, n, MAX_INT);
        else REDUCE_LOOP(uint8_t, acc, x, n, MIN_INT);
    }
}

/* A reduction on rank 0: the accumulator starts as rank 0's data and takes in the other ranks' in order. */
typedef struct reduction {
    ms_dtype   dt;
    ms_comm_op op;
    int64_t    n;
    void      *acc;       /* f32 for bf16/f16 (n floats), else out itself */
    void      *scratch;   /* one rank's data as received */
} reduction;

/* false when there is no memory for the buffers */
static bool reduction_begin(reduction *R, ms_dtype dt, ms_comm_op op, int64_t n, const void *mine, void *out)
{
    size_t es = ms_dtype_size(dt), n1 = n > 0 ? (size_t)n : 1;   /* (an empty call too: malloc(0) may be NULL) */
    *R = (reduction){ .dt = dt, .op = op, .n = n };
    R->scratch = malloc(n1 * es);
    R->acc = is_half(dt) ? malloc(n1 * sizeof(float)) : out;
    if (R->scratch == NULL || (is_half(dt) && R->acc == NULL)) {   /* (out is NULL for an empty tensor) */
        free(R->scratch);
        if (R->acc != out) free(R->acc);
        return false;
    }
    if (is_half(dt)) {
        const uint16_t *h = mine;
        float *a = R->acc;
        for (int64_t i = 0; i < n; i++) a[i] = half_to_f32(dt, h[i]);
    } else if (out != mine && n > 0) {
        memcpy(out, mine, (size_t)n * es);
    }
    return true;
}

/* out <- the accumulated result (averaged, rounded to the dtype), and the buffers go. */
static void reduction_end(reduction *R, void *out, int world_size)
{
    if (is_half(R->dt)) {
        float *a = R->acc;
        uint16_t *h = out;
        float div = R->op == MS_COMM_AVG ? (float)world_size : 1.0f;
        for (int64_t i = 0; i < R->n; i++) h[i] = f32_to_half(R->dt, a[i] / div);
        free(R->acc);
    } else if (R->op == MS_COMM_AVG) {
        if (R->dt == MS_DTYPE_F32) {
            float *a = out;
            for (int64_t i = 0; i < R->n; i++) a[i] /= (float)world_size;
        } else {
            double *a = out;
            for (int64_t i = 0; i < R->n; i++) a[i] /= (double)world_size;
        }
    }
    free(R->scratch);
    R->scratch = R->acc = NULL;
}

static void reduction_abort(reduction *R)
{
    free(R->scratch);
    if (is_half(R->dt)) free(R->acc);
}

/* --- rank 0 ---------------------------------------------------------------------------------------- */

/* Reads rank r's call and checks it is `want`. */
static ms_status read_call(ms_ctx *ctx, cpu_comm *c, int r, const call *want, int64_t start, int64_t deadline)
{
    const char *fn = call_name[want->kind];
    unsigned char h[CALL_BYTES];
    io_result io = recv_all(c->fd[r], h, sizeof h, deadline);
    if (io != IO_OK) return io_fail(ctx, c, fn, io, r, ms_now_ms() - start);
    if (memcmp(h, CALL_MAGIC, 4) != 0)
        return fail(ctx, c, MS_E_IO, "%s: rank %d sent something other than a collective's call (%02x %02x %02x %02x)",
                    fn, r, h[0], h[1], h[2], h[3]);
    call got = { .seq = ms_get_be32(h + 4), .kind = ms_get_be32(h + 8), .dtype = ms_get_be32(h + 12), .arg = ms_get_be32(h + 16),
                 .count = get_u64(h + 24) };
    if (got.kind == CALL_ABORT) {
        char why[WHY_BYTES] = "";
        size_t take = got.count < sizeof why ? (size_t)got.count : sizeof why - 1;
        if (recv_all(c->fd[r], why, take, ms_now_ms() + 1000) != IO_OK) snprintf(why, sizeof why, "(reason lost)");
        why[sizeof why - 1] = '\0';
        return fail(ctx, c, MS_E_IO, "%s: rank %d gave up the communicator (%s) before collective #%u", fn, r, why,
                    want->seq);
    }
    if (got.seq != want->seq)
        return fail(ctx, c, MS_E_ARG, "%s: the ranks are out of step: rank %d is at collective #%u, rank 0 at #%u "
                    "(every rank must make the same collective calls in the same order)", fn, r, got.seq, want->seq);
    if (got.kind != want->kind || got.dtype != want->dtype || got.arg != want->arg || got.count != want->count) {
        char mine[160], theirs[160];
        describe(mine, sizeof mine, want);
        describe(theirs, sizeof theirs, &got);
        return fail(ctx, c, MS_E_ARG, "%s: the ranks disagree on collective #%u: rank 0 calls %s, rank %d %s", fn,
                    want->seq, mine, r, theirs);
    }
    return MS_OK;
}

static ms_status read_data(ms_ctx *ctx, cpu_comm *c, const char *fn, int r, void *buf, size_t bytes, int64_t start,
                           int64_t deadline)
{
    io_result io = recv_all(c->fd[r], buf, bytes, deadline);
    return io == IO_OK ? MS_OK : io_fail(ctx, c, fn, io, r, ms_now_ms() - start);
}

/* Sends rank r its answer: `bytes` of data. */
static ms_status answer(ms_ctx *ctx, cpu_comm *c, const char *fn, int r, const void *data, size_t bytes, int64_t start,
                        int64_t deadline)
{
    io_result io = send_answer(c->fd[r], c->seq, MS_OK, data, bytes, deadline);
    if (io == IO_OK) return MS_OK;
    shutdown(c->fd[r], SHUT_RDWR);   /* cut short mid-answer: nothing more may follow on this stream */
    return io_fail(ctx, c, fn, io, r, ms_now_ms() - start);
}

/* Every rank's n elements (at `mine` here), reduced in rank order into out (n elements; may be mine). */
static ms_status reduce_from_ranks(ms_ctx *ctx, cpu_comm *c, const call *k, ms_comm_op op, int64_t n, const void *mine,
                                   void *out, int64_t start, int64_t deadline)
{
    const char *fn = call_name[k->kind];
    ms_dtype dt = (ms_dtype)k->dtype;
    reduction R;
    if (!reduction_begin(&R, dt, op, n, mine, out))
        return fail(ctx, c, MS_E_OOM, "%s: no host memory for rank 0's reduction of %lld elements", fn, (long long)n);
    for (int r = 1; r < c->world_size; r++) {
        ms_status st = read_call(ctx, c, r, k, start, deadline);
        if (st == MS_OK) st = read_data(ctx, c, fn, r, R.scratch, (size_t)n * ms_dtype_size(dt), start, deadline);
        if (st != MS_OK) {
            reduction_abort(&R);
            return st;
        }
        combine(dt, op, R.acc, R.scratch, n);
    }
    reduction_end(&R, out, c->world_size);
    return MS_OK;
}

/* --- the collectives ------------------------------------------------------------------------------ */

/* The 32-byte header of a call (the file's comment) */
static void put_call(unsigned char h[CALL_BYTES], const call *k)
{
    memset(h, 0, CALL_BYTES);
    memcpy(h, CALL_MAGIC, 4);
    ms_put_be32(h + 4, k->seq);
    ms_put_be32(h + 8, k->kind);
    ms_put_be32(h + 12, k->dtype);
    ms_put_be32(h + 16, k->arg);
    put_u64(h + 24, k->count);
}

/* A rank > 0's part: its call, `out_bytes` of data, then rank 0's answer of `in_bytes` into `in`. */
static ms_status take_part(ms_ctx *ctx, cpu_comm *c, const call *k, const void *out, size_t out_bytes, void *in,
                           size_t in_bytes)
{
    const char *fn = call_name[k->kind];
    int64_t start = ms_now_ms(), deadline = start + c->timeout_ms + GRACE_MS;
    int fd = c->fd[0];
    unsigned char h[CALL_BYTES];
    put_call(h, k);
    io_result io = send_all(fd, h, sizeof h, deadline, true);
    if (io == IO_OK && out_bytes > 0) io = send_all(fd, out, out_bytes, deadline, true);
    if (io != IO_OK && io != IO_ANSWERED) return io_fail(ctx, c, fn, io, 0, ms_now_ms() - start);
    bool cut_short = io == IO_ANSWERED;

    unsigned char a[ANSWER_BYTES];
    io = recv_all(fd, a, sizeof a, deadline);
    if (io != IO_OK) return io_fail(ctx, c, fn, io, 0, ms_now_ms() - start);
    if (memcmp(a, ANSWER_MAGIC, 4) != 0)
        return fail(ctx, c, MS_E_IO, "%s: rank %d got something other than an answer from rank 0 (%02x %02x %02x %02x)",
                    fn, c->rank, a[0], a[1], a[2], a[3]);
    int32_t status = (int32_t)ms_get_be32(a + 8);
    uint64_t bytes = get_u64(a + 16);
    if (status != MS_OK) {   /* rank 0's account of the failure (of this collective or an earlier one) */
        char why[WHY_BYTES] = "";
        size_t take = bytes < sizeof why ? (size_t)bytes : sizeof why - 1;
        if (recv_all(fd, why, take, ms_now_ms() + 1000) != IO_OK) snprintf(why, sizeof why, "(message lost)");
        why[sizeof why - 1] = '\0';
        ms_status st = status < 0 && status >= MS_E_BACKEND ? (ms_status)status : MS_E_IO;
        return fail(ctx, c, st, "%s: rank %d: rank 0 reports: %s", fn, c->rank, why);
    }
    if (cut_short || ms_get_be32(a + 4) != k->seq)
        return fail(ctx, c, MS_E_IO, "%s: rank %d got rank 0's answer to collective #%u during #%u%s", fn, c->rank,
                    ms_get_be32(a + 4), k->seq, cut_short ? " before it had sent all its data" : "");
    if (bytes != in_bytes)
        return fail(ctx, c, MS_E_IO, "%s: rank %d expected %zu bytes from rank 0, it sends %llu", fn, c->rank, in_bytes,
                    (unsigned long long)bytes);
    if (in_bytes > 0) {
        io = recv_all(fd, in, in_bytes, deadline);
        if (io != IO_OK) return io_fail(ctx, c, fn, io, 0, ms_now_ms() - start);
    }
    return MS_OK;
}

/* Checks the communicator can still run a collective and numbers the call. */
static ms_status begin(ms_ctx *ctx, cpu_comm *c, call *k, uint32_t kind, ms_dtype dt, uint32_t arg, int64_t count)
{
    if (c->failed)
        return MS_FAIL(ctx, MS_E_IO, "%s: this communicator failed earlier (%s); free it and make a new one on every "
                       "rank", call_name[kind], c->why);
    *k = (call){ .seq = ++c->seq, .kind = kind, .dtype = (uint32_t)dt, .arg = arg, .count = (uint64_t)count };
    return MS_OK;
}

ms_status ms_cpu_comm_all_reduce(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op)
{
    cpu_comm *c = comm;
    int64_t n = ms_tensor_numel(dst);
    size_t bytes = (size_t)n * ms_dtype_size(dst->dtype);
    call k;
    MS_TRY(begin(ctx, c, &k, CALL_ALL_REDUCE, dst->dtype, (uint32_t)op, n));
    if (c->rank != 0) return take_part(ctx, c, &k, ms_tensor_ptr(src), bytes, ms_tensor_ptr(dst), bytes);
    int64_t start = ms_now_ms(), deadline = start + c->timeout_ms;
    MS_TRY(reduce_from_ranks(ctx, c, &k, op, n, ms_tensor_ptr(src), ms_tensor_ptr(dst), start, deadline));
    for (int r = 1; r < c->world_size; r++)
        MS_TRY(answer(ctx, c, call_name[k.kind], r, ms_tensor_ptr(dst), bytes, start, deadline));
    return MS_OK;
}

ms_status ms_cpu_comm_reduce_scatter(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op)
{
    cpu_comm *c = comm;
    int64_t n = ms_tensor_numel(dst), all = n * c->world_size;
    size_t bytes = (size_t)n * ms_dtype_size(dst->dtype);
    call k;
    MS_TRY(begin(ctx, c, &k, CALL_REDUCE_SCATTER, dst->dtype, (uint32_t)op, n));
    if (c->rank != 0) return take_part(ctx, c, &k, ms_tensor_ptr(src), bytes * (size_t)c->world_size,
                                       ms_tensor_ptr(dst), bytes);
    int64_t start = ms_now_ms(), deadline = start + c->timeout_ms;
    char *out = malloc(bytes * (size_t)c->world_size + 1);   /* dst may be a slice of src: reduce aside (+1: never malloc(0)) */
    if (out == NULL)
        return fail(ctx, c, MS_E_OOM, "ms_comm_reduce_scatter: no host memory for rank 0's %lld-element result",
                    (long long)all);
    ms_status st = reduce_from_ranks(ctx, c, &k, op, all, ms_tensor_ptr(src), out, start, deadline);
    if (st == MS_OK && bytes > 0) memmove(ms_tensor_ptr(dst), out, bytes);
    for (int r = 1; r < c->world_size && st == MS_OK; r++)
        st = answer(ctx, c, call_name[k.kind], r, out + bytes * (size_t)r, bytes, start, deadline);
    free(out);
    return st;
}

ms_status ms_cpu_comm_all_gather(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src)
{
    cpu_comm *c = comm;
    int64_t n = ms_tensor_numel(src);
    size_t bytes = (size_t)n * ms_dtype_size(src->dtype);
    char *out = ms_tensor_ptr(dst);
    call k;
    MS_TRY(begin(ctx, c, &k, CALL_ALL_GATHER, src->dtype, 0, n));
    if (c->rank != 0) return take_part(ctx, c, &k, ms_tensor_ptr(src), bytes, out, bytes * (size_t)c->world_size);
    int64_t start = ms_now_ms(), deadline = start + c->timeout_ms;
    if (bytes > 0) memmove(out, ms_tensor_ptr(src), bytes);   /* a no-op in place */
    for (int r = 1; r < c->world_size; r++) {
        MS_TRY(read_call(ctx, c, r, &k, start, deadline));
        MS_TRY(read_data(ctx, c, call_name[k.kind], r, out + bytes * (size_t)r, bytes, start, deadline));
    }
    for (int r = 1; r < c->world_size; r++)
        MS_TRY(answer(ctx, c, call_name[k.kind], r, out, bytes * (size_t)c->world_size, start, deadline));
    return MS_OK;
}

ms_status ms_cpu_comm_broadcast(ms_ctx *ctx, void *comm, ms_tensor *t, int root)
{
    cpu_comm *c = comm;
    int64_t n = ms_tensor_numel(t);
    size_t bytes = (size_t)n * ms_dtype_size(t->dtype);
    call k;
    MS_TRY(begin(ctx, c, &k, CALL_BROADCAST, t->dtype, (uint32_t)root, n));
    if (c->rank != 0) {
        bool mine = c->rank == root;
        return take_part(ctx, c, &k, ms_tensor_ptr(t), mine ? bytes : 0, ms_tensor_ptr(t), mine ? 0 : bytes);
    }
    int64_t start = ms_now_ms(), deadline = start + c->timeout_ms;
    for (int r = 1; r < c->world_size; r++) {
        MS_TRY(read_call(ctx, c, r, &k, start, deadline));
        if (r == root) MS_TRY(read_data(ctx, c, call_name[k.kind], r, ms_tensor_ptr(t), bytes, start, deadline));
    }
    for (int r = 1; r < c->world_size; r++)
        MS_TRY(answer(ctx, c, call_name[k.kind], r, ms_tensor_ptr(t), r == root ? 0 : bytes, start, deadline));
    return MS_OK;
}

/* --- set-up ---------------------------------------------------------------------------------------- */

ms_status ms_cpu_comm_connect(ms_ctx *ctx, const char *addr, int port, int rank, int world_size, int timeout_ms,
                              void **out)
{
    cpu_comm *c = calloc(1, sizeof *c);
    int *fd = malloc(sizeof(int) * (size_t)world_size);
    if (c == NULL || fd == NULL) {
        free(c);
        free(fd);
        return MS_FAIL(ctx, MS_E_OOM, "ms_comm_new: no host memory for a communicator of %d ranks", world_size);
    }
    if (timeout_ms == 0) timeout_ms = DEFAULT_TIMEOUT_MS;
    ms_status st = ms_rendezvous_connect(addr, port, rank, world_size, timeout_ms, fd);
    if (st != MS_OK) {   /* the rendezvous's own message, kept on the context too */
        snprintf(ctx->last_error, sizeof ctx->last_error, "%s", ms_last_error());
        free(c);
        free(fd);
        return st;
    }
    int one = 1;
    for (int r = 0; r < world_size; r++)
        if (fd[r] >= 0) setsockopt(fd[r], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);   /* small calls, at once */
    c->rank = rank;
    c->world_size = world_size;
    c->timeout_ms = timeout_ms;
    c->fd = fd;
    *out = c;
    return MS_OK;
}

/* After a failure rank 0 may hold data the ranks sent for the failed collective.  Closing a socket with
** unread data resets the connection, and a reset can destroy rank 0's account of the failure before the
** rank has read it: so rank 0 first reads until every rank has closed its end (a rank closes when it has
** heard about the failure), for at most `ms` milliseconds. */
static void drain_before_close(cpu_comm *c, int ms)
{
    int64_t deadline = ms_now_ms() + ms;
    struct pollfd *q = calloc((size_t)c->world_size, sizeof *q);
    if (q == NULL) return;
    for (int r = 1; r < c->world_size; r++)
        if (c->fd[r] >= 0) shutdown(c->fd[r], SHUT_WR);
    char sink[4096];
    for (;;) {
        int open = 0;
        for (int r = 1; r < c->world_size; r++) {
            if (c->fd[r] < 0) continue;
            ssize_t k;
            while ((k = recv(c->fd[r], sink, sizeof sink, 0)) > 0) {}
            if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                close(c->fd[r]);   /* the rank's end is closed: nothing left to lose */
                c->fd[r] = -1;
            } else {
                q[open++] = (struct pollfd){ .fd = c->fd[r], .events = POLLIN };
            }
        }
        int64_t left = deadline - ms_now_ms();
        if (open == 0 || left <= 0 || poll(q, (nfds_t)open, (int)left) < 0) break;
    }
    free(q);
}

void ms_cpu_comm_abort(ms_ctx *ctx, void *comm, const char *why)
{
    cpu_comm *c = comm;
    if (c->failed) return;   /* the others were told already, or told this rank */
    if (c->rank != 0 && c->fd[0] >= 0) {
        /* in place of this rank's next call: rank 0 reads it at its next collective with this rank (or now,
        ** when it waits for this rank in one) and fails it on every rank, with the reason */
        size_t len = strnlen(why, WHY_BYTES - 1);
        unsigned char h[CALL_BYTES];
        put_call(h, &(call){ .seq = c->seq + 1, .kind = CALL_ABORT, .count = len });
        int64_t deadline = ms_now_ms() + 1000;
        if (send_all(c->fd[0], h, sizeof h, deadline, false) == IO_OK) send_all(c->fd[0], why, len, deadline, false);
    }
    fail(ctx, c, MS_E_IO, "rank %d gave up the communicator (%s)", c->rank, why);   /* rank 0: tells every rank */
}

void ms_cpu_comm_destroy(ms_ctx *ctx, void *comm)
{
    (void)ctx;
    cpu_comm *c = comm;
    if (c->failed && c->rank == 0) drain_before_close(c, 500);
    for (int r = 0; r < c->world_size; r++)
        if (c->fd[r] >= 0) close(c->fd[r]);
    free(c->fd);
    free(c);
}
