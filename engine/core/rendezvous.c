/*
** The TCP rendezvous of the ranks at rank 0's address: it hands NCCL's unique id from rank 0 to the other
** ranks (ms_rendezvous), or connects them to rank 0 for good (ms_rendezvous_connect: the CPU
** communicator's sockets, engine/cpu/comm.c).  Plain POSIX sockets, so it works (and is tested) without
** NCCL or a GPU.
**
** Protocol (integers big-endian):
**   hello, rank r -> rank 0:  "MSRZ" | version | r | world_size | mode                  (20 bytes)
**   reply, rank 0 -> rank r:  "MSRZ" | version | status | world_size | payload[128]      (144 bytes)
** mode 0: the id exchange; 1: the connection stays open after the reply.  status 0: payload is the id
** (zeros in mode 1); otherwise payload is a NUL-terminated message, status 1 for a refused request (MS_E_ARG:
** wrong world size or mode, rank claimed twice) and 2 for a timeout (MS_E_IO).  Rank 0 answers only once
** every rank has said hello and is still connected (one that gave up or died since is missing again), so
** that no rank goes on to NCCL's set-up (which would wait forever) when one is missing: all of them fail
** instead.  A hello of another version is answered with this version's reply
** (refused), so that the other side can say which versions met.
*/
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FN "ms_rendezvous"
#define RZ_MAGIC "MSRZ"
#define RZ_VERSION 2u
#define RZ_HELLO_BYTES 20
#define RZ_REPLY_BYTES (16 + MS_COMM_ID_BYTES)
#define RZ_DEFAULT_TIMEOUT_MS 300000
#define RZ_MAX_WORLD (1 << 20)
#define RZ_MAX_STRAYS 64          /* unidentified connections held at once; a newer one drops the oldest */

enum { RZ_OK = 0, RZ_REFUSED = 1, RZ_TIMEOUT = 2 };
enum { RZ_MODE_ID = 0, RZ_MODE_CONNECT = 1 };
static const char *const rz_mode_name[2] = { "an NCCL id (CUDA or ms_rendezvous)", "a CPU (TCP) communicator" };

static void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

/* Sends all of buf before the deadline (the socket is non-blocking); false on failure. */
static bool send_all(int fd, const unsigned char *buf, size_t n, int64_t deadline)
{
    size_t done = 0;
    while (done < n) {
        ssize_t k = send(fd, buf + done, n - done, MSG_NOSIGNAL);   /* a peer gone must not raise SIGPIPE */
        if (k > 0) { done += (size_t)k; continue; }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int64_t left = deadline - ms_now_ms();
            if (left <= 0) return false;
            struct pollfd p = { .fd = fd, .events = POLLOUT };
            if (poll(&p, 1, (int)left) < 0 && errno != EINTR) return false;
            continue;
        }
        return false;
    }
    return true;
}

static void send_reply(int fd, uint32_t status, int world_size, const unsigned char *id, const char *msg)
{
    unsigned char r[RZ_REPLY_BYTES] = { 0 };
    memcpy(r, RZ_MAGIC, 4);
    ms_put_be32(r + 4, RZ_VERSION);
    ms_put_be32(r + 8, status);
    ms_put_be32(r + 12, (uint32_t)world_size);
    if (id) memcpy(r + 16, id, MS_COMM_ID_BYTES);
    else snprintf((char *)r + 16, MS_COMM_ID_BYTES, "%s", msg);
    send_all(fd, r, sizeof r, ms_now_ms() + 1000);   /* best effort: the peer may be gone */
}

/* getaddrinfo for addr:port; MS_E_ARG naming the address when it does not resolve. */
static ms_status resolve(const char *addr, int port, bool passive, struct addrinfo **out)
{
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = passive ? AI_PASSIVE : 0 };
    int e = getaddrinfo(addr, service, &hints, out);
    if (e != 0)
        return MS_FAIL(NULL, MS_E_ARG, FN ": cannot resolve the rendezvous address '%s': %s", addr, gai_strerror(e));
    return MS_OK;
}

/* --- rank 0 ---------------------------------------------------------------------------------------- */

typedef struct rz_conn {
    int           fd;
    unsigned      order;   /* accepted as the order-th connection */
    size_t        got;
    unsigned char hello[RZ_HELLO_BYTES];
} rz_conn;

typedef struct rz_server {
    int      listen_fd;
    int      world_size;
    int     *rank_fd;          /* [world_size]: the connection of each rank that has said hello, else -1 */
    int      arrived;          /* ranks other than 0 that have said hello */
    rz_conn  strays[RZ_MAX_STRAYS];   /* connections that have not said a full hello yet */
    int      nstrays;
    int      dropped;          /* connections that sent something else than a hello */
    unsigned accepted;         /* connections accepted so far */
    uint32_t mode;             /* RZ_MODE_ID or RZ_MODE_CONNECT, and every hello must say the same */
} rz_server;

static void drop_stray(rz_server *s, int i, bool counted)
{
    close(s->strays[i].fd);
    if (counted) s->dropped++;
    s->strays[i] = s->strays[--s->nstrays];
}

/* Sends `msg` with `status` to every rank that has said hello (the others are dropped), and closes all
** but, when `keep` is given, the ranks' connections: keep[r] <- rank r's (keep[0] <- -1). */
static void server_close(rz_server *s, uint32_t status, const unsigned char *id, const char *msg, int *keep)
{
    if (keep) keep[0] = -1;
    for (int r = 1; r < s->world_size; r++) {
        if (s->rank_fd[r] < 0) continue;
        send_reply(s->rank_fd[r], status, s->world_size, id, msg);
        if (keep) keep[r] = s->rank_fd[r];
        else close(s->rank_fd[r]);
        s->rank_fd[r] = -1;
    }
    while (s->nstrays > 0) drop_stray(s, 0, false);
    close(s->listen_fd);
}

/* True, with rank r unregistered, when its connection has closed since its hello: a rank that gave up (its
** own timeout) or died is missing again, not answered as present (the others would go on without it), and
** may come back. */
static bool rank_gone(rz_server *s, int r)
{
    char b;
    ssize_t k = recv(s->rank_fd[r], &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k > 0 || (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) return false;
    close(s->rank_fd[r]);
    s->rank_fd[r] = -1;
    s->arrived--;
    return true;
}

static int ranks_gone(rz_server *s)
{
    int n = 0;
    for (int r = 1; r < s->world_size; r++)
        if (s->rank_fd[r] >= 0 && rank_gone(s, r)) n++;
    return n;
}

/* A complete hello from stray i: accepted (moved to rank_fd), dropped as garbage, or a refusal of the
** whole rendezvous (returns MS_E_ARG with the message in msg). */
static ms_status take_hello(rz_server *s, int i, char *msg, size_t msg_size)
{
    rz_conn *c = &s->strays[i];
    uint32_t rank = ms_get_be32(c->hello + 8), world = ms_get_be32(c->hello + 12), mode = ms_get_be32(c->hello + 16);
    if (world != (uint32_t)s->world_size)
        snprintf(msg, msg_size, "rank %u reports world size %u, rank 0 has %d", rank, world, s->world_size);
    else if (mode != s->mode)
        snprintf(msg, msg_size, "rank %u wants %s, rank 0 %s", rank, mode <= 1 ? rz_mode_name[mode] : "?",
                 rz_mode_name[s->mode]);
    else if (rank == 0 || rank >= (uint32_t)s->world_size)
        snprintf(msg, msg_size, "a process reports rank %u, outside [1, %d)", rank, s->world_size);
    else if (s->rank_fd[rank] >= 0 && !rank_gone(s, (int)rank))
        snprintf(msg, msg_size, "two processes claim rank %u", rank);
    else {
        s->rank_fd[rank] = c->fd;
        s->arrived++;
        s->strays[i] = s->strays[--s->nstrays];
        return MS_OK;
    }
    char why[2 * MS_COMM_ID_BYTES];
    snprintf(why, sizeof why, "rank 0 refused the rendezvous: %s", msg);
    send_reply(c->fd, RZ_REFUSED, s->world_size, NULL, why);
    drop_stray(s, i, false);
    return MS_E_ARG;
}

/* "2, 3, 5" (the first ranks missing, then how many more) */
static void missing_ranks(const rz_server *s, char *buf, size_t n)
{
    size_t k = 0;
    int listed = 0, more = 0;
    buf[0] = '\0';
    for (int r = 1; r < s->world_size; r++) {
        if (s->rank_fd[r] >= 0) continue;
        if (listed < 16 && k < n) {
            k += (size_t)snprintf(buf + k, n - k, listed ? ", %d" : "%d", r);
            listed++;
        } else {
            more++;
        }
    }
    if (more && k < n) snprintf(buf + k, n - k, " and %d more", more);
}

static ms_status serve(const char *addr, int port, int world_size, int timeout_ms, const unsigned char *id,
                       uint32_t mode, int *keep)
{
    int64_t deadline = ms_now_ms() + timeout_ms;
    struct addrinfo *ai;
    MS_TRY(resolve(addr, port, true, &ai));
    int fd = -1, err = 0;
    for (struct addrinfo *a = ai; a != NULL && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) { err = errno; continue; }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);   /* a port in TIME_WAIT from a past job */
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return MS_FAIL(NULL, MS_E_IO, FN ": rank 0 cannot listen on %s:%d: %s", addr, port, strerror(err));
    set_nonblocking(fd);

    rz_server s = { .listen_fd = fd, .world_size = world_size, .mode = mode };
    s.rank_fd = malloc(sizeof(int) * (size_t)world_size);
    if (s.rank_fd == NULL) {
        close(fd);
        return MS_FAIL(NULL, MS_E_OOM, FN ": no host memory for %d ranks", world_size);
    }
    for (int r = 0; r < world_size; r++) s.rank_fd[r] = -1;

    char msg[MS_COMM_ID_BYTES] = "";
    ms_status st = MS_OK;
    struct pollfd fds[1 + RZ_MAX_STRAYS];
    while (s.arrived < world_size - 1 || ranks_gone(&s) > 0) {   /* all there, and none gone since its hello */
        int64_t left = deadline - ms_now_ms();
        if (left <= 0) {
            char missing[256];
            missing_ranks(&s, missing, sizeof missing);
            snprintf(msg, sizeof msg, "rank 0 timed out after %d ms; missing ranks: %.60s", timeout_ms, missing);
            server_close(&s, RZ_TIMEOUT, NULL, msg, NULL);
            st = MS_FAIL(NULL, MS_E_IO,
                         FN ": timed out after %d ms at %s:%d waiting for ranks %s of world size %d (%d of %d "
                         "arrived)%s", timeout_ms, addr, port, missing, world_size, s.arrived + 1, world_size,
                         s.dropped ? "; connections that were no moonstep ranks were dropped" : "");
            free(s.rank_fd);
            return st;
        }
        fds[0] = (struct pollfd){ .fd = fd, .events = POLLIN };
        for (int i = 0; i < s.nstrays; i++) fds[1 + i] = (struct pollfd){ .fd = s.strays[i].fd, .events = POLLIN };
        int nfds = 1 + s.nstrays;
        if (poll(fds, (nfds_t)nfds, (int)left) < 0 && errno != EINTR) {
            err = errno;
            server_close(&s, RZ_TIMEOUT, NULL, "rank 0 failed while waiting", NULL);
            free(s.rank_fd);
            return MS_FAIL(NULL, MS_E_IO, FN ": poll failed on %s:%d: %s", addr, port, strerror(err));
        }
        /* strays first, from the last (drop_stray moves the last one into the slot) */
        for (int i = nfds - 2; i >= 0 && st == MS_OK; i--) {
            if (fds[1 + i].revents == 0) continue;
            rz_conn *c = &s.strays[i];
            ssize_t k = recv(c->fd, c->hello + c->got, RZ_HELLO_BYTES - c->got, 0);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
            if (k <= 0) { drop_stray(&s, i, c->got > 0); continue; }   /* closed before a whole hello */
            c->got += (size_t)k;
            /* garbage is dropped as soon as it shows, another version answered (it may be a whole hello) */
            if (c->got >= 4 && memcmp(c->hello, RZ_MAGIC, 4) != 0) { drop_stray(&s, i, true); continue; }
            if (c->got >= 8 && ms_get_be32(c->hello + 4) != RZ_VERSION) {
                send_reply(c->fd, RZ_REFUSED, world_size, NULL, "another rendezvous version");
                drop_stray(&s, i, true);
                continue;
            }
            if (c->got == RZ_HELLO_BYTES) st = take_hello(&s, i, msg, sizeof msg);
        }
        if (st != MS_OK) {
            char why[2 * MS_COMM_ID_BYTES];
            snprintf(why, sizeof why, "rank 0 refused the rendezvous: %s", msg);
            server_close(&s, RZ_REFUSED, NULL, why, NULL);
            free(s.rank_fd);
            return MS_FAIL(NULL, st, FN ": at %s:%d: %s", addr, port, msg);
        }
        if (fds[0].revents & POLLIN) {
            int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (c >= 0) {
                /* full: the one silent longest goes, not the newcomer, which may be a rank (a rank says its
                ** hello at once; refusing newcomers let 64 silent connections shut every rank out) */
                if (s.nstrays == RZ_MAX_STRAYS) {
                    int oldest = 0;
                    for (int i = 1; i < s.nstrays; i++)
                        if (s.strays[i].order < s.strays[oldest].order) oldest = i;
                    drop_stray(&s, oldest, true);
                }
                s.strays[s.nstrays++] = (rz_conn){ .fd = c, .order = s.accepted++ };
            }
        }
    }
    server_close(&s, RZ_OK, id, NULL, keep);
    free(s.rank_fd);
    return MS_OK;
}

/* --- ranks 1 .. world_size-1 ----------------------------------------------------------------------- */

/* A connected non-blocking socket to addr:port, retrying (rank 0 may not listen yet) until the deadline. */
static ms_status connect_retrying(const char *addr, int port, int rank, int timeout_ms, int64_t deadline, int *out)
{
    int err = 0;
    for (;;) {
        struct addrinfo *ai;
        MS_TRY(resolve(addr, port, false, &ai));
        for (struct addrinfo *a = ai; a != NULL; a = a->ai_next) {
            int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) { err = errno; continue; }
            int rc = connect(fd, a->ai_addr, a->ai_addrlen);
            if (rc != 0 && errno == EINPROGRESS) {
                int64_t left = deadline - ms_now_ms();
                struct pollfd p = { .fd = fd, .events = POLLOUT };
                if (left > 0 && poll(&p, 1, (int)(left < 1000 ? left : 1000)) == 1) {
                    socklen_t len = sizeof err;
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
                    rc = err == 0 ? 0 : -1;
                } else if (err == 0) {
                    err = ETIMEDOUT;
                }
            } else if (rc != 0) {
                err = errno;
            }
            if (rc == 0) {
                freeaddrinfo(ai);
                int one = 1;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                *out = fd;
                return MS_OK;
            }
            close(fd);
        }
        freeaddrinfo(ai);
        int64_t left = deadline - ms_now_ms();
        if (left <= 0)
            return MS_FAIL(NULL, MS_E_IO, FN ": rank %d could not reach rank 0 at %s:%d within %d ms (%s)",
                           rank, addr, port, timeout_ms, strerror(err));
        struct timespec pause = { 0, (left < 50 ? left : 50) * 1000000L };
        nanosleep(&pause, NULL);
    }
}

/* The reply's verdict: MS_OK, or the error it reports (or that it is no reply). */
static ms_status check_reply(const unsigned char *r, size_t got, const char *addr, int port, int rank,
                             int world_size)
{
    if (got >= 4 && memcmp(r, RZ_MAGIC, 4) != 0)
        return MS_FAIL(NULL, MS_E_FORMAT, FN ": rank %d: the peer at %s:%d is not a moonstep rendezvous (it sent "
                       "%02x %02x %02x %02x ...)", rank, addr, port, r[0], r[1], r[2], r[3]);
    if (got >= 8 && ms_get_be32(r + 4) != RZ_VERSION)
        return MS_FAIL(NULL, MS_E_FORMAT, FN ": rank %d: rank 0 at %s:%d speaks rendezvous version %u, this is %u",
                       rank, addr, port, ms_get_be32(r + 4), RZ_VERSION);
    if (got < RZ_REPLY_BYTES)
        return MS_FAIL(NULL, MS_E_IO, FN ": rank %d: rank 0 at %s:%d closed the connection after %zu of %d bytes",
                       rank, addr, port, got, RZ_REPLY_BYTES);
    uint32_t status = ms_get_be32(r + 8);
    if (status != RZ_OK)
        return MS_FAIL(NULL, status == RZ_REFUSED ? MS_E_ARG : MS_E_IO, FN ": rank %d: %.*s", rank,
                       MS_COMM_ID_BYTES - 1, (const char *)r + 16);
    if (ms_get_be32(r + 12) != (uint32_t)world_size)
        return MS_FAIL(NULL, MS_E_ARG, FN ": rank %d has world size %d, rank 0 has %u", rank, world_size,
                       ms_get_be32(r + 12));
    return MS_OK;
}

static ms_status join(const char *addr, int port, int rank, int world_size, int timeout_ms, unsigned char *id,
                      uint32_t mode, int *keep)
{
    int64_t deadline = ms_now_ms() + timeout_ms;
    int fd = -1;
    MS_TRY(connect_retrying(addr, port, rank, timeout_ms, deadline, &fd));
    unsigned char hello[RZ_HELLO_BYTES];
    memcpy(hello, RZ_MAGIC, 4);
    ms_put_be32(hello + 4, RZ_VERSION);
    ms_put_be32(hello + 8, (uint32_t)rank);
    ms_put_be32(hello + 12, (uint32_t)world_size);
    ms_put_be32(hello + 16, mode);
    if (!send_all(fd, hello, sizeof hello, deadline)) {
        int err = errno;
        close(fd);
        return MS_FAIL(NULL, MS_E_IO, FN ": rank %d cannot send to rank 0 at %s:%d: %s", rank, addr, port,
                       strerror(err));
    }
    unsigned char r[RZ_REPLY_BYTES];
    size_t got = 0;
    while (got < sizeof r) {
        int64_t left = deadline - ms_now_ms();
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (left <= 0 || (poll(&p, 1, (int)left) == 0)) {
            close(fd);
            return MS_FAIL(NULL, MS_E_IO, FN ": rank %d reached rank 0 at %s:%d but had no answer within %d ms "
                           "(rank 0 waits for every rank of world size %d: some never arrived)", rank, addr,
                           port, timeout_ms, world_size);
        }
        ssize_t k = recv(fd, r + got, sizeof r - got, 0);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (k <= 0) break;
        got += (size_t)k;
        if (got >= 4 && memcmp(r, RZ_MAGIC, 4) != 0) break;   /* not our peer: say so now, not at the timeout */
        if (got >= 8 && ms_get_be32(r + 4) != RZ_VERSION) break;
    }
    ms_status st = check_reply(r, got, addr, port, rank, world_size);
    if (st == MS_OK && keep != NULL) *keep = fd;   /* the recv above read nothing past the reply */
    else close(fd);
    if (st == MS_OK) memcpy(id, r + 16, MS_COMM_ID_BYTES);
    return st;
}

/* --- the public call -------------------------------------------------------------------------------- */

static ms_status resolve_env(const char *fn, const char **addr, int *port)
{
    if (*addr == NULL) {
        *addr = getenv("MASTER_ADDR");
        if (*addr == NULL || **addr == '\0')
            return MS_FAIL(NULL, MS_E_ARG, "%s: no rendezvous address (pass one, or set MASTER_ADDR)", fn);
    }
    if (*port == 0) {
        const char *p = getenv("MASTER_PORT");
        if (p == NULL || *p == '\0')
            return MS_FAIL(NULL, MS_E_ARG, "%s: no rendezvous port (pass one, or set MASTER_PORT)", fn);
        char *end;
        long v = strtol(p, &end, 10);
        if (*end != '\0' || v < 1 || v > 65535)
            return MS_FAIL(NULL, MS_E_ARG, "%s: MASTER_PORT='%s' is not a port in [1, 65535]", fn, p);
        *port = (int)v;
    }
    if (*port < 1 || *port > 65535)
        return MS_FAIL(NULL, MS_E_ARG, "%s: port %d is outside [1, 65535]", fn, *port);
    return MS_OK;
}

MS_API ms_status ms_rendezvous(const char *addr, int port, int rank, int world_size, int timeout_ms,
                               unsigned char id[MS_COMM_ID_BYTES])
{
    if (id == NULL) return MS_FAIL(NULL, MS_E_ARG, FN ": id is NULL");
    if (world_size < 1) return MS_FAIL(NULL, MS_E_ARG, FN ": world_size %d is below 1", world_size);
    if (world_size > RZ_MAX_WORLD)
        return MS_FAIL(NULL, MS_E_ARG, FN ": world_size %d is above %d", world_size, RZ_MAX_WORLD);
    if (rank < 0 || rank >= world_size)
        return MS_FAIL(NULL, MS_E_ARG, FN ": rank %d is outside [0, %d)", rank, world_size);
    if (timeout_ms < 0) return MS_FAIL(NULL, MS_E_ARG, FN ": timeout_ms %d is negative", timeout_ms);
    if (port < 0 || port > 65535) return MS_FAIL(NULL, MS_E_ARG, FN ": port %d is outside [1, 65535]", port);
    if (world_size == 1) return MS_OK;
    MS_TRY(resolve_env(FN, &addr, &port));
    if (timeout_ms == 0) timeout_ms = RZ_DEFAULT_TIMEOUT_MS;
    return rank == 0 ? serve(addr, port, world_size, timeout_ms, id, RZ_MODE_ID, NULL)
                     : join(addr, port, rank, world_size, timeout_ms, id, RZ_MODE_ID, NULL);
}

ms_status ms_rendezvous_connect(const char *addr, int port, int rank, int world_size, int timeout_ms, int *fds)
{
    /* the caller (ms_comm_new) has checked rank, world size, port and timeout */
    for (int r = 0; r < world_size; r++) fds[r] = -1;
    if (world_size == 1) return MS_OK;
    MS_TRY(resolve_env(FN, &addr, &port));
    if (timeout_ms == 0) timeout_ms = RZ_DEFAULT_TIMEOUT_MS;
    unsigned char id[MS_COMM_ID_BYTES] = { 0 };
    return rank == 0 ? serve(addr, port, world_size, timeout_ms, id, RZ_MODE_CONNECT, fds)
                     : join(addr, port, rank, world_size, timeout_ms, id, RZ_MODE_CONNECT, &fds[0]);
}
