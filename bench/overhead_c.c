/*
** bench/overhead_c.c -- the host's overhead per ms_optimizer_step from C (the embedding API), captured
** (ms_optimizer_capture) against uncaptured: the C half of bench/overhead.lua, whose header describes the
** models, the modes (host, device, captured) and the method (gpu, call, overhead, pipelined), all the same.
**
**   make bench-c && build/bench/overhead_c [llama,small] [steps]      (on the GPU host)
**
** Captured mode also prints the cost of a call into the optimizer's Lua state alone (ms_optimizer_get_lr:
** the embedding's share of a step's call time; bench/overhead.lua breaks down the Lua step itself).
*/
#include "moonstep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                                                    \
    do {                                                                                               \
        ms_status st_ = (call);                                                                        \
        if (st_ != MS_OK) {                                                                            \
            fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call, ms_status_name(st_), \
                    ms_last_error());                                                                  \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct model {
    const char *name, *recipe, *options;
    int         n, steps;
    char      **names;
    ms_tensor **params, **grads;
} model;

static ms_tensor *randn(ms_ctx *ctx, ms_dtype dt, int ndim, const int64_t *shape, double std, uint64_t seed)
{
    ms_tensor *t = NULL;
    CHECK(ms_tensor_new(ctx, dt, ndim, shape, &t));
    ms_rand_options o = { .dist = MS_RAND_NORMAL, .a = 0, .b = std, .seed = seed };
    CHECK(ms_rand(ctx, t, &o));
    return t;
}

static void model_alloc(model *m, int n)
{
    m->n = n;
    m->names = calloc((size_t)n, sizeof *m->names);
    m->params = calloc((size_t)n, sizeof *m->params);
    m->grads = calloc((size_t)n, sizeof *m->grads);
    if (!m->names || !m->params || !m->grads) { fprintf(stderr, "out of host memory\n"); exit(1); }
}

static void add(model *m, int i, ms_ctx *ctx, const char *name, ms_dtype dt, int ndim, const int64_t *shape)
{
    m->names[i] = strdup(name);
    m->params[i] = randn(ctx, dt, ndim, shape, 0.02, (uint64_t)i + 1);
    m->grads[i] = randn(ctx, dt, ndim, shape, 1e-3, (uint64_t)i + 100001);
}

/* the Llama-3-8B matrix set, bf16, under SinkGD */
static model llama(ms_ctx *ctx)
{
    static const struct { const char *name; int64_t shape[2]; } mats[] = {
        { "self_attn.q_proj", { 4096, 4096 } },  { "self_attn.k_proj", { 1024, 4096 } },
        { "self_attn.v_proj", { 1024, 4096 } },  { "self_attn.o_proj", { 4096, 4096 } },
        { "mlp.gate_proj", { 14336, 4096 } },    { "mlp.up_proj", { 14336, 4096 } },
        { "mlp.down_proj", { 4096, 14336 } },
    };
    model m = { .name = "llama", .recipe = "sinkgd", .options = "{\"lr\": 1e-3}", .steps = 30 };
    model_alloc(&m, 32 * 7);
    char name[128];
    for (int layer = 0; layer < 32; layer++)
        for (int k = 0; k < 7; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", layer, mats[k].name);
            add(&m, layer * 7 + k, ctx, name, MS_DTYPE_BF16, 2, mats[k].shape);
        }
    return m;
}

/* 300 small f32 tensors under AdamW */
static model small(ms_ctx *ctx)
{
    static const int64_t s0[2] = { 256, 256 }, s1[1] = { 1024 }, s2[2] = { 64, 384 };
    model m = { .name = "small", .recipe = "adamw", .options = "{\"lr\": 1e-3, \"weight_decay\": 0.01}", .steps = 300 };
    model_alloc(&m, 300);
    char name[64];
    for (int i = 0; i < 300; i++) {
        snprintf(name, sizeof name, "small.%d", i + 1);
        if (i % 3 == 0) add(&m, i, ctx, name, MS_DTYPE_F32, 2, s0);
        else if (i % 3 == 1) add(&m, i, ctx, name, MS_DTYPE_F32, 1, s1);
        else add(&m, i, ctx, name, MS_DTYPE_F32, 2, s2);
    }
    return m;
}

static void model_free(model *m)
{
    for (int i = 0; i < m->n; i++) {
        free(m->names[i]);
        ms_tensor_free(m->params[i]);
        ms_tensor_free(m->grads[i]);
    }
    free(m->names);
    free(m->params);
    free(m->grads);
}

static ms_optimizer *optimizer(ms_ctx *ctx, const model *m, const char *settings, int captured)
{
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_new(ctx, m->recipe, m->options, settings, &opt));
    for (int i = 0; i < m->n; i++) CHECK(ms_optimizer_add_param(opt, m->names[i], m->params[i], m->grads[i], NULL));
    if (captured) CHECK(ms_optimizer_capture(opt));
    for (int i = 0; i < 3; i++) CHECK(ms_optimizer_step(opt));   /* warm-up, capture, first replay */
    CHECK(ms_ctx_sync(ctx));
    return opt;
}

/* ~2 ms of GPU work to queue a step behind */
static void block(ms_ctx *ctx, ms_tensor *big)
{
    for (int i = 0; i < 8; i++) CHECK(ms_binary_scalar(ctx, big, big, 1.0, NULL, MS_BINARY_MUL, 0));
}

static double gpu_time(ms_ctx *ctx, const model *m, ms_tensor *big)
{
    ms_optimizer *opt = optimizer(ctx, m, NULL, 1);
    ms_event *e0 = NULL, *e1 = NULL;
    CHECK(ms_event_new(ctx, &e0));
    CHECK(ms_event_new(ctx, &e1));
    double t[11];
    for (int i = 0; i < 11; i++) {
        CHECK(ms_ctx_sync(ctx));
        block(ctx, big);
        CHECK(ms_event_record(ctx, e0));
        CHECK(ms_optimizer_step(opt));
        CHECK(ms_event_record(ctx, e1));
        CHECK(ms_event_elapsed(e0, e1, &t[i]));
    }
    ms_event_free(e0);
    ms_event_free(e1);
    ms_optimizer_free(opt);
    return median(t, 11);
}

static void measure(ms_ctx *ctx, const model *m, const char *mode, double gpu_ms, int steps)
{
    const char *settings = strcmp(mode, "device") == 0 ? "{\"device_checks\": true}" : NULL;
    ms_optimizer *opt = optimizer(ctx, m, settings, strcmp(mode, "captured") == 0);
    /* the tail of the trainer's backward pass before the step (bench/overhead.lua, "call"): the first launches
    ** after a long pause cost 30-95 us each of driver time on the H200 host, a cost of the pause, not the step's */
    ms_tensor *primer = NULL;
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 1, (const int64_t[]){ 1 }, &primer));
    double *calls = calloc((size_t)steps, sizeof *calls), *totals = calloc((size_t)steps, sizeof *totals);
    if (!calls || !totals) { fprintf(stderr, "out of host memory\n"); exit(1); }
    for (int i = 0; i < steps; i++) {
        CHECK(ms_ctx_sync(ctx));
        for (int k = 0; k < 32; k++) CHECK(ms_fill(ctx, primer, (double)k, NULL));
        double t0 = now_us();
        CHECK(ms_optimizer_step(opt));
        double t1 = now_us();
        CHECK(ms_ctx_sync(ctx));
        double t2 = now_us();
        calls[i] = t1 - t0;
        totals[i] = t2 - t0;
    }
    double t0 = now_us();
    for (int i = 0; i < steps; i++) CHECK(ms_optimizer_step(opt));
    CHECK(ms_ctx_sync(ctx));
    double per_step = (now_us() - t0) / steps;
    char *stats = NULL;
    CHECK(ms_optimizer_stats(opt, &stats));
    if (strstr(stats, "\"skipped_steps\":0") == NULL) {
        fprintf(stderr, "a step was skipped (the gradients must be finite): %s\n", stats);
        exit(1);
    }
    ms_string_free(stats);
    double overhead = median(totals, steps) - gpu_ms * 1e3, pipelined = per_step - gpu_ms * 1e3;
    printf("%-6s %-9s %6d %12.3f %12.1f %12.1f %12.1f%s\n", m->name, mode, steps, gpu_ms, median(calls, steps),
           overhead, pipelined > 0 ? pipelined : 0.0,
           strcmp(mode, "captured") ? "" : median(calls, steps) < 50 ? "   (target < 50 us of host time: met)"
                                                                      : "   (target < 50 us of host time: NOT met)");
    if (strcmp(mode, "captured") == 0) {
        enum { CALLS = 1000 };
        double lr = 0, c0 = now_us();
        for (int i = 0; i < CALLS; i++) CHECK(ms_optimizer_get_lr(opt, &lr));
        printf("         C -> Lua call alone (ms_optimizer_get_lr): %.2f us\n", (now_us() - c0) / CALLS);
    }
    free(calls);
    free(totals);
    ms_tensor_free(primer);
    ms_optimizer_free(opt);
}

int main(int argc, char **argv)
{
    const char *which = argc > 1 ? argv[1] : "llama,small";
    int steps_arg = argc > 2 ? atoi(argv[2]) : 0;
    if (ms_device_count(MS_DEVICE_CUDA) == 0) {
        fprintf(stderr, "overhead_c: no CUDA device\n");
        return 1;
    }
    ms_ctx *ctx = NULL;
    CHECK(ms_ctx_new("cuda", NULL, &ctx));
    printf("moonstep %s host-overhead bench (C, embedding API) on %s  [%s]\n", ms_version(), ms_ctx_device_name(ctx),
           ms_build_info());
    int64_t big_shape[1] = { (int64_t)1 << 27 };
    ms_tensor *big = NULL;
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 1, big_shape, &big));
    CHECK(ms_fill(ctx, big, 1.0, NULL));
    printf("%-6s %-9s %6s %12s %12s %12s %12s\n", "model", "mode", "steps", "gpu ms", "call us", "overhead us",
           "pipelined us");
    static const char *const modes[] = { "host", "device", "captured" };
    for (int k = 0; k < 2; k++) {
        const char *name = k == 0 ? "llama" : "small";
        if (strstr(which, name) == NULL) continue;
        model m = k == 0 ? llama(ctx) : small(ctx);
        double g = gpu_time(ctx, &m, big);
        for (int j = 0; j < 3; j++) measure(ctx, &m, modes[j], g, steps_arg > 0 ? steps_arg : m.steps);
        model_free(&m);
        CHECK(ms_ctx_empty_cache(ctx));
    }
    ms_tensor_free(big);
    ms_ctx_free(ctx);
    return 0;
}
