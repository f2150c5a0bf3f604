/*
** c_train -- a C program that trains a small MLP end to end with a moonstep optimizer (the embedding API).
**
**   build/examples/c_train [device [recipe [steps]]]     device: cpu (default), cuda, cuda:N or auto;
**                                                        recipe: adamw (default), sinkgd, a recipe file, ...
**
** The trainer owns the model: a 2-layer ReLU network regressing the outputs of a random "teacher" network
** of the same shape, with its forward and backward passes written with moonstep's tensor ops on the chosen
** device.  The optimizer is given the parameters and their gradient buffers once; each step the trainer
** writes the gradients into those buffers and calls ms_optimizer_step, which updates the parameters in
** place (on the context's stream, with no copies).  Prints the loss as it goes down; exits 1 if it did not
** drop tenfold.
*/
#include <stdio.h>
#include <stdlib.h>

#include "moonstep.h"

#define TRY(call)                                                                                  \
    do {                                                                                           \
        ms_status st_ = (call);                                                                    \
        if (st_ != MS_OK) {                                                                        \
            fprintf(stderr, "c_train: %s: %s\n%s\n", ms_status_name(st_), #call, ms_last_error()); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum { N = 512, D = 8, H = 32 };     /* samples, inputs, hidden units */

static ms_ctx *ctx;

/* A new f32 tensor: [rows, cols], [rows] when cols is 0, or one element (0 dims) when both are 0. */
static ms_tensor *tensor(int64_t rows, int64_t cols)
{
    int64_t shape[2] = { rows, cols };
    ms_tensor *t;
    TRY(ms_tensor_new(ctx, MS_DTYPE_F32, rows ? (cols ? 2 : 1) : 0, shape, &t));
    return t;
}

static void randn(ms_tensor *t, double std, uint64_t seed)
{
    ms_rand_options r = { .dist = MS_RAND_NORMAL, .a = 0, .b = std, .seed = seed };
    TRY(ms_rand(ctx, t, &r));
}

static double value(ms_tensor *t)
{
    float v;
    TRY(ms_tensor_read(ctx, t, &v, sizeof v));
    return v;
}

typedef struct mlp {
    ms_tensor *w1, *b1, *w2, *b2;     /* [H, D], [H], [1, H], [1] */
} mlp;

static mlp mlp_new(uint64_t seed)
{
    mlp m = { tensor(H, D), tensor(H, 0), tensor(1, H), tensor(1, 0) };
    randn(m.w1, 1 / 2.8284271247461903, seed);   /* 1 / sqrt(D) */
    randn(m.b1, 0.1, seed + 1);
    randn(m.w2, 1 / 5.656854249492381, seed + 2); /* 1 / sqrt(H) */
    randn(m.b2, 0.1, seed + 3);
    return m;
}

static void mlp_free(mlp *m)
{
    ms_tensor_free(m->w1); ms_tensor_free(m->b1); ms_tensor_free(m->w2); ms_tensor_free(m->b2);
}

/* activations of one forward pass, kept for the backward pass */
typedef struct acts {
    ms_tensor *pre, *h, *out;         /* [N, H], [N, H], [N, 1] */
} acts;

static void forward(const mlp *m, ms_tensor *x, acts *a)
{
    const ms_matmul_options xt = { .trans_b = 1, .alpha = 1 };     /* x W^T */
    TRY(ms_matmul(ctx, a->pre, x, m->w1, &xt));
    TRY(ms_binary(ctx, a->pre, a->pre, m->b1, MS_BINARY_ADD));
    TRY(ms_unary(ctx, a->h, a->pre, MS_UNARY_RELU));
    TRY(ms_matmul(ctx, a->out, a->h, m->w2, &xt));
    TRY(ms_binary(ctx, a->out, a->out, m->b2, MS_BINARY_ADD));
}

int main(int argc, char **argv)
{
    const char *device = argc > 1 ? argv[1] : "cpu";
    const char *recipe = argc > 2 ? argv[2] : "adamw";
    int steps = 600;
    if (argc > 3) {   /* a count of at least 1 (atoi read "ten" as 0, and the run then reported no progress) */
        char *end;
        long v = strtol(argv[3], &end, 10);
        if (end == argv[3] || *end != '\0' || v < 1 || v > 100000000) {
            fprintf(stderr, "c_train: steps must be an integer in [1, 1e8] (got '%s')\n", argv[3]);
            return 2;
        }
        steps = (int)v;
    }
    TRY(ms_ctx_new(device, NULL, &ctx));
    printf("c_train: %s on %s, %d steps\n", recipe, ms_ctx_device_name(ctx), steps);

    /* data: inputs, and the teacher's outputs as targets */
    ms_tensor *x = tensor(N, D), *y = tensor(N, 1);
    randn(x, 1, 100);
    mlp teacher = mlp_new(200), model = mlp_new(300);
    acts a = { tensor(N, H), tensor(N, H), tensor(N, 1) };
    forward(&teacher, x, &a);
    TRY(ms_copy(ctx, y, a.out));

    /* the optimizer: recipe, its options, the runtime's settings; then each parameter and its gradient */
    mlp grad = { tensor(H, D), tensor(H, 0), tensor(1, H), tensor(1, 0) };
    char settings[160];
    snprintf(settings, sizeof settings,
             "{\"schedule\": {\"kind\": \"cosine\", \"warmup_steps\": %d, \"total_steps\": %d}}", steps / 20, steps);
    ms_optimizer *opt;
    TRY(ms_optimizer_new(ctx, recipe, "{\"lr\": 0.01, \"weight_decay\": 0}", settings, &opt));
    TRY(ms_optimizer_add_param(opt, "layers.0.weight", model.w1, grad.w1, NULL));
    TRY(ms_optimizer_add_param(opt, "layers.0.bias", model.b1, grad.b1, "no_decay"));
    TRY(ms_optimizer_add_param(opt, "head.weight", model.w2, grad.w2, NULL));
    TRY(ms_optimizer_add_param(opt, "head.bias", model.b2, grad.b2, "no_decay"));

    ms_tensor *r = tensor(N, 1), *dy = tensor(N, 1), *dh = tensor(N, H), *mask = tensor(N, H), *loss = tensor(0, 0);
    const ms_matmul_options ta = { .trans_a = 1, .alpha = 1 };     /* A^T B */
    double first = 0, last = 0;
    for (int step = 0; step <= steps; step++) {
        /* forward and loss = mean (out - y)^2 */
        forward(&model, x, &a);
        TRY(ms_binary(ctx, r, a.out, y, MS_BINARY_SUB));
        TRY(ms_reduce(ctx, loss, r, MS_REDUCE_SUMSQ, MS_DIM_ALL));
        last = value(loss) / N;
        if (step == 0) first = last;
        double lr;
        TRY(ms_optimizer_get_lr(opt, &lr));
        if (step % 100 == 0 || step == steps) printf("step %4d  loss %.6f  lr %.5f\n", step, last, lr);
        if (step == steps) break;
        /* backward into the registered gradient buffers */
        TRY(ms_binary_scalar(ctx, dy, r, 2.0 / N, NULL, MS_BINARY_MUL, 0));
        TRY(ms_matmul(ctx, grad.w2, dy, a.h, &ta));
        TRY(ms_reduce(ctx, grad.b2, dy, MS_REDUCE_SUM, MS_DIM_ALL));
        TRY(ms_matmul(ctx, dh, dy, model.w2, NULL));
        TRY(ms_binary_scalar(ctx, mask, a.pre, 0, NULL, MS_BINARY_GT, 0));
        TRY(ms_binary(ctx, dh, dh, mask, MS_BINARY_MUL));
        TRY(ms_matmul(ctx, grad.w1, dh, x, &ta));
        TRY(ms_reduce(ctx, grad.b1, dh, MS_REDUCE_SUM, 0));
        /* the update, in place */
        TRY(ms_optimizer_step(opt));
    }

    char *info;
    TRY(ms_optimizer_info(opt, &info));
    printf("optimizer: %s\n", info);
    ms_string_free(info);
    printf("loss %.6f -> %.6f (%.1fx lower)\n", first, last, first / last);

    ms_optimizer_free(opt);
    ms_tensor *all[] = { x, y, a.pre, a.h, a.out, r, dy, dh, mask, loss };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ms_tensor_free(all[i]);
    mlp_free(&teacher);
    mlp_free(&model);
    mlp_free(&grad);
    ms_ctx_free(ctx);
    if (!(last < first / 10)) {
        fprintf(stderr, "c_train: the loss did not drop tenfold\n");
        return 1;
    }
    return 0;
}
