/*
** The CPU member of the sharded SinkGD step (ms_sinkgd_step_sharded) on 1 to 4 ranks simulated by threads in
** one process, each with its own context and a slice of every matrix, their exchanges summed in rank order
** through a barrier: the slices each rank keeps after the step must be the slices of ms_sinkgd_step's result
** on the whole matrices (one f32 rounding apart: the sums are added in another order), as must u and t, for
** every mode, rows and cols sharding, uneven splits and empty slices, 3-D stacks, mixed calls, fresh and
** warm state, a u that must restart, and bf16 params with stochastic rounding (drawn with the global element
** index, so nearly every element rounds as the unsharded step rounds it).  The exchanges must have the same
** sizes on every rank and come as often as the design says (one per Sinkhorn iteration and power step).
** The multi-process path (communicators, validation) is tests/sinkgd_shard_spec.lua's.
*/
#include "check.h"
#include "../../engine/cpu/cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANKS 4
#define MAX_MEMBERS 3

/* --- the simulated world: a sum over threads, in rank order --------------------------------------- */

typedef struct world {
    int               ranks;
    pthread_barrier_t barrier;
    double           *bufs[MAX_RANKS];
    int64_t           counts[MAX_RANKS];
    int               exchanges[MAX_RANKS];
    int               mismatched;        /* exchanges whose sizes differed between ranks */
} world;

typedef struct rank_user {
    world *w;
    int    rank;
} rank_user;

static ms_status thread_sum(void *user, void *buf, int64_t count, ms_dtype dt)
{
    rank_user *u = user;
    world *w = u->w;
    if (dt != MS_DTYPE_F64) return MS_E_DTYPE;
    w->bufs[u->rank] = buf;
    w->counts[u->rank] = count;
    pthread_barrier_wait(&w->barrier);
    bool same = true;
    for (int r = 0; r < w->ranks; r++) same = same && w->counts[r] == count;
    double *sum = same ? malloc((size_t)(count > 0 ? count : 1) * sizeof *sum) : NULL;
    if (sum)
        for (int64_t i = 0; i < count; i++) {
            double s = 0;
            for (int r = 0; r < w->ranks; r++) s += w->bufs[r][i];
            sum[i] = s;
        }
    pthread_barrier_wait(&w->barrier);   /* every rank has read every buffer */
    u->w->exchanges[u->rank]++;
    if (!same) {
        if (u->rank == 0) w->mismatched++;
        return MS_E_SHAPE;
    }
    if (sum == NULL) return MS_E_OOM;
    memcpy(buf, sum, (size_t)count * sizeof *sum);
    free(sum);
    return MS_OK;
}

/* --- cases ---------------------------------------------------------------------------------------- */

typedef struct member_spec {
    int          ndim;
    int64_t      shape[3];        /* global: [m, n] or [E, m, n] */
    ms_shard_dim dim;
    int64_t      split[MAX_RANKS];   /* sizes along dim per rank; all zero: as even as possible */
    int          zero_expert;     /* 3-D: expert 0's grad is zero (X^T v = 0 keeps u) */
} member_spec;

typedef struct case_spec {
    const char      *name;
    ms_sinkgd_mode   mode;
    ms_sinkgd_target target;
    int              iters, sn_iters, ranks, nmem;
    member_spec      mem[MAX_MEMBERS];
    double           wd;
    int              bf16_sr;        /* bf16 params with stochastic rounding */
    int              orthogonal_u;   /* 1-row grads of ones with u = (1, -1, ...): the first power step restarts */
    int              exchanges;      /* per step when no restart happens */
} case_spec;

static uint64_t rng_state;
static double uniform(void)   /* in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1p-52 - 1.0;
}

static int64_t lead_count(const member_spec *m) { return m->ndim == 3 ? m->shape[0] : 1; }
static int64_t rows_of(const member_spec *m) { return m->shape[m->ndim - 2]; }
static int64_t cols_of(const member_spec *m) { return m->shape[m->ndim - 1]; }

/* this rank's [offset, offset + size) along the member's sharded dim */
static void slice_of(const member_spec *m, int ranks, int r, int64_t *offset, int64_t *size)
{
    int64_t global = m->dim == MS_SHARD_ROWS ? rows_of(m) : cols_of(m);
    if (m->dim == MS_SHARD_NONE) { *offset = 0; *size = global; return; }
    bool given = false;
    for (int q = 0; q < ranks; q++) given = given || m->split[q] != 0;
    int64_t off = 0;
    for (int q = 0; q <= r; q++) {
        int64_t s = given ? m->split[q] : global / ranks + (q < global % ranks);
        if (q == r) { *offset = off; *size = s; }
        off += s;
    }
}

/* The global state of one member: f32 copies of everything, and the tensors of the reference step. */
typedef struct global_member {
    int64_t  E, m, n;
    float   *p, *g, *u, *t;      /* [E m n], [E m n], [E n], [E] */
} global_member;

typedef struct rank_args {
    const case_spec     *c;
    world               *w;
    int                  rank;
    const global_member *gm;     /* the inputs of the step */
    const global_member *want;   /* the reference's results */
    ms_dtype             pdt;
    int                  step;
    ms_status            status;
    int                  bad_p, bad_u, bad_t, sr_mismatch;
    int64_t              compared;
    double               worst;   /* the largest error in ulps */
} rank_args;

static double ulp_f32(double x)
{
    int e;
    frexp(fabs(x) > 0x1p-126 ? x : 0x1p-126, &e);
    return ldexp(1.0, e - 24);
}
static double ulp_bf16(double x)
{
    int e;
    frexp(fabs(x) > 0x1p-126 ? x : 0x1p-126, &e);
    return ldexp(1.0, e - 8);
}

static ms_tensor *new_tensor(ms_ctx *ctx, ms_dtype dt, int ndim, const int64_t *shape)
{
    ms_tensor *t = NULL;
    if (ms_tensor_new(ctx, dt, ndim, shape, &t) != MS_OK) return NULL;
    return t;
}

static void put(ms_tensor *t, int64_t k, double v)
{
    if (t->dtype == MS_DTYPE_BF16) ((uint16_t *)ms_tensor_data_ptr(t))[k] = ms_f32_to_bf16((float)v);
    else ((float *)ms_tensor_data_ptr(t))[k] = (float)v;
}
static double get(const ms_tensor *t, int64_t k)
{
    if (t->dtype == MS_DTYPE_BF16) return ms_bf16_to_f32(((const uint16_t *)ms_tensor_data_ptr(t))[k]);
    return ((const float *)ms_tensor_data_ptr(t))[k];
}

/* |got - want| within 1 ulp of the stored dtype (plus a hair for cancellation), NaN failing */
static bool near(double got, double want, bool bf16, double scale, double *worst)
{
    double u = bf16 ? ulp_bf16(want) : ulp_f32(want);
    double err = fabs(got - want);
    if (err / u > *worst) *worst = err / u;
    return err <= u + 1e-12 * scale;
}

static void *rank_main(void *arg)
{
    rank_args *a = arg;
    const case_spec *c = a->c;
    int r = a->rank, nmem = c->nmem;
    ms_ctx *ctx = NULL;
    ms_ctx_options copts = { .num_threads = 2 };
    a->status = ms_ctx_new("cpu", &copts, &ctx);
    if (a->status != MS_OK) return NULL;
    ms_tensor *p[MAX_MEMBERS], *g[MAX_MEMBERS], *u[MAX_MEMBERS], *t[MAX_MEMBERS];
    ms_shard sh[MAX_MEMBERS];
    int64_t off[MAX_MEMBERS], len[MAX_MEMBERS];
    for (int i = 0; i < nmem; i++) {
        const member_spec *ms = &c->mem[i];
        const global_member *G = &a->gm[i];
        slice_of(ms, c->ranks, r, &off[i], &len[i]);
        int64_t lm = ms->dim == MS_SHARD_ROWS ? len[i] : G->m, ln = ms->dim == MS_SHARD_COLS ? len[i] : G->n;
        int64_t pshape[3], ushape[2], tshape[1] = { G->E };
        int nd = ms->ndim;
        if (nd == 3) { pshape[0] = G->E; pshape[1] = lm; pshape[2] = ln; ushape[0] = G->E; ushape[1] = ln; }
        else { pshape[0] = lm; pshape[1] = ln; ushape[0] = ln; }
        p[i] = new_tensor(ctx, a->pdt, nd, pshape);
        g[i] = new_tensor(ctx, MS_DTYPE_F32, nd, pshape);
        u[i] = new_tensor(ctx, MS_DTYPE_F32, nd - 1, ushape);
        t[i] = new_tensor(ctx, MS_DTYPE_F32, nd == 3 ? 1 : 0, tshape);
        int64_t ro = ms->dim == MS_SHARD_ROWS ? off[i] : 0, co = ms->dim == MS_SHARD_COLS ? off[i] : 0;
        for (int64_t b = 0; b < G->E; b++) {
            for (int64_t ii = 0; ii < lm; ii++)
                for (int64_t j = 0; j < ln; j++) {
                    int64_t k = (b * lm + ii) * ln + j, gk = (b * G->m + ro + ii) * G->n + co + j;
                    put(p[i], k, G->p[gk]);
                    put(g[i], k, G->g[gk]);
                }
            for (int64_t j = 0; j < ln; j++) put(u[i], b * ln + j, G->u[b * G->n + co + j]);
            put(t[i], b, G->t[b]);
        }
        sh[i] = (ms_shard){ ms->dim, off[i], ms->dim == MS_SHARD_ROWS ? G->m : ms->dim == MS_SHARD_COLS ? G->n : 0 };
    }
    ms_sinkgd_options o = { .lr = 0.05, .step = a->step, .mode = c->mode, .iters = c->iters, .sn_iters = c->sn_iters,
                            .target = c->target, .eps = 1e-8, .weight_decay = c->wd,
                            .stochastic_round = c->bf16_sr, .seed = 77 };
    rank_user user = { a->w, r };
    ms_exchange x = { thread_sum, &user };
    double scales[MAX_MEMBERS] = { 1.0, 0.5, 2.0 };
    /* as the core hands them over: u outside base mode, t in sphere mode */
    a->status = ms_cpu_sinkgd_step_sharded(ctx, nmem, p, (const ms_tensor *const *)g,
                                           c->mode != MS_SINKGD_BASE ? u : NULL, c->mode == MS_SINKGD_SPHERE ? t : NULL,
                                           scales, sh, &o, &x);

    bool bf16 = a->pdt == MS_DTYPE_BF16;
    for (int i = 0; a->status == MS_OK && i < nmem; i++) {
        const member_spec *ms = &c->mem[i];
        const global_member *W = &a->want[i];
        int64_t lm = ms->dim == MS_SHARD_ROWS ? len[i] : W->m, ln = ms->dim == MS_SHARD_COLS ? len[i] : W->n;
        int64_t ro = ms->dim == MS_SHARD_ROWS ? off[i] : 0, co = ms->dim == MS_SHARD_COLS ? off[i] : 0;
        double pscale = 0;
        for (int64_t k = 0; k < W->E * W->m * W->n; k++) pscale = fmax(pscale, fabs(W->p[k]));
        for (int64_t b = 0; b < W->E; b++) {
            for (int64_t ii = 0; ii < lm; ii++)
                for (int64_t j = 0; j < ln; j++) {
                    int64_t k = (b * lm + ii) * ln + j, gk = (b * W->m + ro + ii) * W->n + co + j;
                    double got = get(p[i], k), want = W->p[gk];
                    a->compared++;
                    if (!near(got, want, bf16, pscale, &a->worst)) a->bad_p++;
                    if (bf16 && got != want) a->sr_mismatch++;
                }
            if (c->mode != MS_SINKGD_BASE)
                for (int64_t j = 0; j < ln; j++)
                    if (!near(get(u[i], b * ln + j), W->u[b * W->n + co + j], false, 1.0, &a->worst)) a->bad_u++;
            if (c->mode == MS_SINKGD_SPHERE && !near(get(t[i], b), W->t[b], false, 1.0, &a->worst)) a->bad_t++;
        }
    }
    for (int i = 0; i < nmem; i++) {
        ms_tensor_free(p[i]);
        ms_tensor_free(g[i]);
        ms_tensor_free(u[i]);
        ms_tensor_free(t[i]);
    }
    ms_ctx_free(ctx);
    return NULL;
}

/* The reference: ms_sinkgd_step on the whole matrices; in/out global state (f32 copies) */
static ms_status reference_step(const case_spec *c, ms_dtype pdt, int step, const global_member *in,
                                global_member *out)
{
    ms_ctx *ctx = NULL;
    MS_TRY(ms_ctx_new("cpu", NULL, &ctx));
    ms_tensor *p[MAX_MEMBERS], *g[MAX_MEMBERS], *u[MAX_MEMBERS], *t[MAX_MEMBERS];
    for (int i = 0; i < c->nmem; i++) {
        const global_member *G = &in[i];
        int nd = c->mem[i].ndim;
        int64_t pshape[3] = { G->E, G->m, G->n }, ushape[2] = { G->E, G->n }, tshape[1] = { G->E };
        const int64_t *ps = nd == 3 ? pshape : pshape + 1, *us = nd == 3 ? ushape : ushape + 1;
        p[i] = new_tensor(ctx, pdt, nd, ps);
        g[i] = new_tensor(ctx, MS_DTYPE_F32, nd, ps);
        u[i] = new_tensor(ctx, MS_DTYPE_F32, nd - 1, us);
        t[i] = new_tensor(ctx, MS_DTYPE_F32, nd == 3 ? 1 : 0, tshape);
        for (int64_t k = 0; k < G->E * G->m * G->n; k++) { put(p[i], k, G->p[k]); put(g[i], k, G->g[k]); }
        for (int64_t k = 0; k < G->E * G->n; k++) put(u[i], k, G->u[k]);
        for (int64_t k = 0; k < G->E; k++) put(t[i], k, G->t[k]);
    }
    ms_sinkgd_options o = { .lr = 0.05, .step = step, .mode = c->mode, .iters = c->iters, .sn_iters = c->sn_iters,
                            .target = c->target, .eps = 1e-8, .weight_decay = c->wd,
                            .stochastic_round = c->bf16_sr, .seed = 77 };
    double scales[MAX_MEMBERS] = { 1.0, 0.5, 2.0 };
    ms_status st = ms_sinkgd_step(ctx, c->nmem, p, (const ms_tensor *const *)g, u, t, scales, &o);
    for (int i = 0; i < c->nmem; i++) {
        global_member *W = &out[i];
        for (int64_t k = 0; k < W->E * W->m * W->n; k++) { W->p[k] = (float)get(p[i], k); W->g[k] = in[i].g[k]; }
        for (int64_t k = 0; k < W->E * W->n; k++) W->u[k] = (float)get(u[i], k);
        for (int64_t k = 0; k < W->E; k++) W->t[k] = (float)get(t[i], k);
        ms_tensor_free(p[i]);
        ms_tensor_free(g[i]);
        ms_tensor_free(u[i]);
        ms_tensor_free(t[i]);
    }
    ms_ctx_free(ctx);
    return st;
}

static void alloc_member(global_member *G, const member_spec *ms)
{
    G->E = lead_count(ms);
    G->m = rows_of(ms);
    G->n = cols_of(ms);
    G->p = calloc((size_t)(G->E * G->m * G->n + 1), sizeof(float));
    G->g = calloc((size_t)(G->E * G->m * G->n + 1), sizeof(float));
    G->u = calloc((size_t)(G->E * G->n + 1), sizeof(float));
    G->t = calloc((size_t)(G->E + 1), sizeof(float));
}
static void free_member(global_member *G)
{
    free(G->p);
    free(G->g);
    free(G->u);
    free(G->t);
}

/* Two steps: fresh state (u zero, t not captured), then the reference's state after step 1 and new grads. */
static void run_case(const case_spec *c)
{
    ms_dtype pdt = c->bf16_sr ? MS_DTYPE_BF16 : MS_DTYPE_F32;
    global_member in[MAX_MEMBERS], want[MAX_MEMBERS];
    rng_state = 0x9e3779b97f4a7c15ull ^ (uint64_t)strlen(c->name) * 1315423911u;
    for (int i = 0; i < c->nmem; i++) {
        alloc_member(&in[i], &c->mem[i]);
        alloc_member(&want[i], &c->mem[i]);
        global_member *G = &in[i];
        for (int64_t k = 0; k < G->E * G->m * G->n; k++) G->p[k] = (float)(0.5 * uniform());
        for (int64_t k = 0; k < G->E; k++) G->t[k] = -1;
        if (c->orthogonal_u)
            for (int64_t k = 0; k < G->E * G->n; k++) G->u[k] = (k % G->n) % 2 ? -1.0f : 1.0f;
    }
    for (int step = 1; step <= 2; step++) {
        for (int i = 0; i < c->nmem; i++) {
            global_member *G = &in[i];
            for (int64_t k = 0; k < G->E * G->m * G->n; k++) {
                G->g[k] = c->orthogonal_u ? 1.0f : (float)(uniform() * (1 + (k % 7)));
                if (c->mem[i].zero_expert && k < G->m * G->n) G->g[k] = 0;
            }
        }
        ms_status st = reference_step(c, pdt, step, in, want);
        CHECK(st == MS_OK, "%s: the reference step failed: %s", c->name, ms_last_error());
        if (st != MS_OK) break;

        world w = { .ranks = c->ranks };
        pthread_barrier_init(&w.barrier, NULL, (unsigned)c->ranks);
        rank_args args[MAX_RANKS];
        pthread_t th[MAX_RANKS];
        for (int r = 0; r < c->ranks; r++) {
            args[r] = (rank_args){ .c = c, .w = &w, .rank = r, .gm = in, .want = want, .pdt = pdt, .step = step };
            pthread_create(&th[r], NULL, rank_main, &args[r]);
        }
        for (int r = 0; r < c->ranks; r++) pthread_join(th[r], NULL);
        pthread_barrier_destroy(&w.barrier);

        int64_t compared = 0, sr_mismatch = 0;
        for (int r = 0; r < c->ranks; r++) {
            rank_args *a = &args[r];
            CHECK(a->status == MS_OK, "%s step %d rank %d: status %d", c->name, step, r, (int)a->status);
            CHECK(a->bad_p == 0 && a->bad_u == 0 && a->bad_t == 0,
                  "%s step %d rank %d: %d params, %d u and %d t values off (worst %.2f ulp)", c->name, step, r,
                  a->bad_p, a->bad_u, a->bad_t, a->worst);
            CHECK(w.exchanges[r] == w.exchanges[0], "%s step %d: rank %d made %d exchanges, rank 0 %d", c->name,
                  step, r, w.exchanges[r], w.exchanges[0]);
            compared += a->compared;
            sr_mismatch += a->sr_mismatch;
        }
        /* every element of every global matrix was compared once over the ranks */
        int64_t total = 0;
        for (int i = 0; i < c->nmem; i++) total += in[i].E * in[i].m * in[i].n * (c->mem[i].dim == MS_SHARD_NONE ? c->ranks : 1);
        CHECK(compared == total, "%s step %d: compared %lld elements of %lld", c->name, step, (long long)compared,
              (long long)total);
        CHECK(w.mismatched == 0, "%s step %d: %d exchanges had different sizes on different ranks", c->name, step,
              w.mismatched);
        /* step 1 redoes the first power exchange for a fresh cols-sharded u (its zeros show only in the sum) and
        ** for an orthogonal u; a rows-sharded u is whole on every rank, so its zeros are seen at once */
        bool has_cols = false;
        for (int i = 0; i < c->nmem; i++) has_cols = has_cols || c->mem[i].dim == MS_SHARD_COLS;
        int want_x = c->exchanges + (step == 1 && c->mode != MS_SINKGD_BASE && (has_cols || c->orthogonal_u));
        CHECK(w.exchanges[0] == want_x, "%s step %d: %d exchanges, %d expected", c->name, step, w.exchanges[0], want_x);
        if (c->bf16_sr)   /* the same random bits as the unsharded step: only values 1 f32 ulp apart may differ */
            CHECK(sr_mismatch * 100 <= compared, "%s step %d: %lld of %lld bf16 values rounded differently", c->name,
                  step, (long long)sr_mismatch, (long long)compared);
        /* the reference's results are the next step's inputs */
        for (int i = 0; i < c->nmem; i++) {
            global_member *G = &in[i], *W = &want[i];
            memcpy(G->p, W->p, (size_t)(G->E * G->m * G->n) * sizeof(float));
            memcpy(G->u, W->u, (size_t)(G->E * G->n) * sizeof(float));
            memcpy(G->t, W->t, (size_t)G->E * sizeof(float));
        }
    }
    for (int i = 0; i < c->nmem; i++) {
        free_member(&in[i]);
        free_member(&want[i]);
    }
}

#define ROWS MS_SHARD_ROWS
#define COLS MS_SHARD_COLS
#define NONE MS_SHARD_NONE
/* members: [m, n] and [E, m, n], split evenly or as given; Z: expert 0's grad is zero */
#define M2(m, n, d) { 2, { m, n }, d, { 0 }, 0 }
#define M3(e, m, n, d) { 3, { e, m, n }, d, { 0 }, 0 }
#define M2S(m, n, d, ...) { 2, { m, n }, d, { __VA_ARGS__ }, 0 }
#define M3Z(e, m, n, d) { 3, { e, m, n }, d, { 0 }, 1 }

int main(void)
{
    /* name, mode, target, iters, sn_iters, ranks, members, weight decay, bf16 + stochastic rounding, orthogonal
    ** u, exchanges per step: iters for the Sinkhorn sums (twice when both kinds are in the call), then per power
    ** step one (rows) or two (cols), then one for the sphere sums */
    static const case_spec cases[] = {
        { "base rows 7x5 over 2", MS_SINKGD_BASE, 0, 3, 1, 2, 1, { M2(7, 5, ROWS) }, 0.1, 0, 0, 3 },
        { "base cols 6x9 over 3", MS_SINKGD_BASE, 0, 3, 1, 3, 1, { M2(6, 9, COLS) }, 0, 0, 0, 3 },
        { "spectral rows over 2", MS_SINKGD_SPECTRAL, MS_SINKGD_TARGET_UNIT, 3, 2, 2, 1, { M2(9, 6, ROWS) }, 0.1, 0, 0, 5 },
        { "spectral muon cols over 2", MS_SINKGD_SPECTRAL, MS_SINKGD_TARGET_MUON, 3, 2, 2, 1, { M2(5, 11, COLS) },
          0, 0, 0, 7 },
        { "spectral muon rows 3-D over 3", MS_SINKGD_SPECTRAL, MS_SINKGD_TARGET_MUON, 2, 3, 3, 1, { M3(3, 8, 5, ROWS) },
          0.05, 0, 0, 5 },
        { "sphere rows over 2", MS_SINKGD_SPHERE, 0, 3, 2, 2, 1, { M2(7, 6, ROWS) }, 0, 0, 0, 6 },
        { "sphere cols 3-D over 3", MS_SINKGD_SPHERE, 0, 2, 1, 3, 1, { M3(2, 4, 10, COLS) }, 0, 0, 0, 5 },
        { "sphere cols with an empty slice", MS_SINKGD_SPHERE, 0, 3, 2, 3, 1, { M2S(5, 6, COLS, 4, 0, 2) }, 0, 0, 0, 8 },
        { "spectral rows, 2 rows over 3 ranks", MS_SINKGD_SPECTRAL, 0, 3, 1, 3, 1, { M2(2, 6, ROWS) }, 0, 0, 0, 4 },
        { "spectral rows, all rows on the last rank", MS_SINKGD_SPECTRAL, 0, 2, 2, 2, 1, { M2S(6, 4, ROWS, 0, 6) },
          0, 0, 0, 4 },
        { "one rank", MS_SINKGD_SPHERE, 0, 2, 2, 1, 1, { M2(6, 5, COLS) }, 0, 0, 0, 7 },
        { "four ranks, big and small slices", MS_SINKGD_SPECTRAL, MS_SINKGD_TARGET_MUON, 2, 1, 4, 2,
          { M2S(600, 257, ROWS, 200, 100, 150, 150), M3(2, 40, 1100, COLS) }, 0.1, 0, 0, 6 },
        { "mixed rows, cols and unsharded", MS_SINKGD_SPHERE, 0, 3, 2, 3, 3,
          { M2(7, 4, ROWS), M3(2, 5, 7, COLS), M2(3, 3, NONE) }, 0, 0, 0, 11 },
        { "an expert with a zero grad keeps u", MS_SINKGD_SPECTRAL, 0, 2, 2, 2, 2,
          { M3Z(3, 5, 4, ROWS), M3Z(2, 4, 6, COLS) }, 0, 0, 0, 8 },
        { "a u orthogonal to a 1-row matrix restarts (rows)", MS_SINKGD_SPECTRAL, 0, 0, 2, 2, 1, { M2(1, 8, ROWS) },
          0, 0, 1, 2 },
        { "a u orthogonal to a 1-row matrix restarts (cols)", MS_SINKGD_SPECTRAL, 0, 0, 2, 2, 1, { M2(1, 8, COLS) },
          0, 0, 1, 4 },
        { "bf16 with stochastic rounding, rows", MS_SINKGD_SPECTRAL, 0, 3, 1, 2, 1, { M2(64, 48, ROWS) }, 0.1, 1, 0, 4 },
        { "bf16 with stochastic rounding, cols 3-D", MS_SINKGD_BASE, 0, 3, 1, 3, 1, { M3(2, 40, 50, COLS) }, 0, 1, 0, 3 },
    };
    for (size_t q = 0; q < sizeof cases / sizeof cases[0]; q++) run_case(&cases[q]);
    return CHECK_REPORT();
}
