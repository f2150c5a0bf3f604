/*
** CPU AdamW with 8-bit block-quantized moments (ms_adamw8_step): torchao's OptimState8bit layout -- u8 codes
** into the dynamic-tree map (signed for exp_avg, unsigned for exp_avg_sq) and one f32 absmax scale per block
** (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861) -- with the element
** math of ms_adamw_step (engine/cpu/optim.c), so an 8-bit run differs from an f32-state run only by the
** quantization.  Tasks are runs of whole blocks: a block is decoded, updated and re-encoded by one thread.
*/
#include "cpu.h"

#include <math.h>

#define TASK_ELEMENTS 2048                   /* about this many elements (whole blocks) per task */
#define PAR_MIN (MS_CPU_PAR_MIN / 4)         /* as the other fused steps: an element costs several ns */
#define SCALE_MIN 1e-12f                     /* torchao's clip of a block's absmax (an all-zero block) */

typedef struct adamw8_call {
    ms_tensor *const       *params;
    const ms_tensor *const *grads;
    ms_tensor *const       *codes[2];        /* exp_avg, exp_avg_sq */
    ms_tensor *const       *scale[2];
    const double           *scales;
    double                  lr, b1, b2, eps, wd, bc1, bc2_sqrt;
    int                     block, blocks_per_task;
    float                   qmap[2][256];    /* signed (exp_avg), unsigned (exp_avg_sq) */
    ms_cpu_rounding         round;
} adamw8_call;

/* The code of y in the ascending map q: the largest c with q[c] <= y by an 8-step binary search (0 when y is
** below q[0], as the search never compares q[0]), then rounded up to c + 1 when y is at least half way there.
** Exactly torchao's quantize_8bit_with_qmap, comparisons and f32 arithmetic included. */
static uint8_t encode(float y, const float *q)
{
    int c = y >= q[128] ? 128 : 0;
    for (int step = 64; step >= 1; step >>= 1)
        if (y >= q[c + step]) c += step;
    int up = c < 255 ? c + 1 : 255;
    float lo = q[c];
    if (y - lo >= (q[up] - lo) * 0.5f) c = up;
    return (uint8_t)c;
}

/* Encodes x[0..len) (one block) into codes and its scale. */
static void encode_block(const float *x, int len, const float *q, uint8_t *codes, float *scale)
{
    float amax = 0;
    for (int j = 0; j < len; j++) {
        float a = fabsf(x[j]);
        if (a > amax || a != a) amax = a;   /* NaN sticks, as torch's amax */
    }
    float s = amax > SCALE_MIN || amax != amax ? amax : SCALE_MIN;
    for (int j = 0; j < len; j++) codes[j] = encode(x[j] / s, q);
    *scale = s;
}

/* Blocks [b0, b0 + nb) of member i. */
static void adamw8_blocks(const adamw8_call *c, int i, int64_t b0, int64_t nb)
{
    const int B = c->block;
    double lr_i = c->lr * (c->scales ? c->scales[i] : 1.0);
    const float dec = (float)(1.0 - lr_i * c->wd), ss = (float)(lr_i / c->bc1);
    const float b1 = (float)c->b1, omb1 = (float)(1.0 - c->b1), b2 = (float)c->b2, omb2 = (float)(1.0 - c->b2);
    const float eps = (float)c->eps, bc2s = (float)c->bc2_sqrt;
    const float *qs = c->qmap[0], *qu = c->qmap[1];
    ms_cpu_view pv, gv;
    ms_cpu_view_of(&pv, c->params[i]);
    ms_cpu_view_of(&gv, c->grads[i]);
    uint8_t *cm = ms_tensor_ptr(c->codes[0][i]), *cv = ms_tensor_ptr(c->codes[1][i]);
    float *sm = ms_tensor_ptr(c->scale[0][i]), *sv = ms_tensor_ptr(c->scale[1][i]);
    const ms_rng_map map = ms_rng_map_of(c->params[i], i);
    float gb[MS_ADAMW8_BLOCK_MAX], pb[MS_ADAMW8_BLOCK_MAX], m[MS_ADAMW8_BLOCK_MAX], v[MS_ADAMW8_BLOCK_MAX];
    for (int64_t b = b0; b < b0 + nb; b++) {
        int64_t e0 = b * B;
        const float *g = ms_cpu_load_f32(&gv, e0, B, gb);
        float *p = pv.dtype == MS_DTYPE_F32 ? (float *)pv.base + e0 : pb;
        if (p == pb) ms_cpu_load_f32(&pv, e0, B, pb);
        const float mscale = sm[b], vscale = sv[b];
        /* the element math of ms_adamw_step, on the decoded moments */
        for (int j = 0; j < B; j++) {
            const float gj = g[j];
            const float mj = b1 * (qs[cm[e0 + j]] * mscale) + omb1 * gj;
            const float vj = b2 * (qu[cv[e0 + j]] * vscale) + omb2 * gj * gj;
            m[j] = mj;
            v[j] = vj;
            p[j] = p[j] * dec - ss * (mj / (sqrtf(vj) / bc2s + eps));
        }
        if (p == pb) ms_cpu_store_param_f32(&pv, &c->round, &map, e0, B, pb);
        encode_block(m, B, qs, cm + e0, &sm[b]);
        encode_block(v, B, qu, cv + e0, &sv[b]);
    }
}

ms_status ms_cpu_adamw8_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                             ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                             const double *scales, const ms_adamw8_options *o8)
{
    const ms_adamw_options *o = &o8->adamw;
    if (o->skip_t != NULL && ms_cpu_read_scalar(&(ms_scalar){ 0, o->skip_t }) != 0) return MS_OK;   /* NaN skips */
    double step = rint(ms_cpu_read_scalar(&(ms_scalar){ o->step, o->step_t }));
    /* the call's constants are ~2 KiB (the maps): on the heap of the context, not the stack of every thread */
    adamw8_call *c;
    MS_TRY(ms_ctx_alloc(ctx, sizeof *c, (void **)&c));
    *c = (adamw8_call){
        .params = params, .grads = grads, .codes = { exp_avg, exp_avg_sq }, .scale = { exp_avg_scale, exp_avg_sq_scale },
        .scales = scales, .lr = ms_cpu_read_scalar(&(ms_scalar){ o->lr, o->lr_t }), .b1 = o->beta1, .b2 = o->beta2,
        .eps = o->eps, .wd = o->weight_decay, .bc1 = 1.0, .bc2_sqrt = 1.0, .block = o8->block_size,
        .round = ms_cpu_rounding_of(o->stochastic_round != 0, o->seed, step),
    };
    if (o->bias_correction) {
        c->bc1 = 1.0 - pow(o->beta1, step);
        c->bc2_sqrt = sqrt(1.0 - pow(o->beta2, step));
    }
    ms_adamw8_qmap(1, c->qmap[0]);
    ms_adamw8_qmap(0, c->qmap[1]);
    c->blocks_per_task = c->block >= TASK_ELEMENTS ? 1 : TASK_ELEMENTS / c->block;

    /* tasks: member i owns tasks [first[i], first[i + 1]); first[] is on the stack for small groups */
    int64_t stack_first[257], *first = stack_first;
    size_t first_bytes = (size_t)(n + 1) * sizeof(int64_t);
    if (n > 256) {
        ms_status st = ms_ctx_alloc(ctx, first_bytes, (void **)&first);
        if (st != MS_OK) {
            ms_ctx_dealloc(ctx, c, sizeof *c);
            return st;
        }
    }
    int64_t ntask = 0, numel = 0;
    for (int i = 0; i < n; i++) {
        int64_t blocks = ms_tensor_numel(params[i]) / c->block;
        first[i] = ntask;
        ntask += (blocks + c->blocks_per_task - 1) / c->blocks_per_task;
        numel += blocks * c->block;
    }
    first[n] = ntask;
    int nt = ms_cpu_threads(ctx);
    if (numel < PAR_MIN || ntask < 2) nt = 1;
    else if (ntask < nt) nt = (int)ntask;

    #pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
    for (int64_t t = 0; t < ntask; t++) {
        int lo = 0, hi = n - 1;   /* the member of task t: the last i with first[i] <= t */
        while (lo < hi) {
            int mid = lo + (hi - lo + 1) / 2;
            if (first[mid] <= t) lo = mid;
            else hi = mid - 1;
        }
        int64_t blocks = ms_tensor_numel(params[lo]) / c->block, b0 = (t - first[lo]) * c->blocks_per_task;
        adamw8_blocks(c, lo, b0, blocks - b0 < c->blocks_per_task ? blocks - b0 : c->blocks_per_task);
    }
    if (first != stack_first) ms_ctx_dealloc(ctx, first, first_bytes);
    ms_ctx_dealloc(ctx, c, sizeof *c);
    return MS_OK;
}
