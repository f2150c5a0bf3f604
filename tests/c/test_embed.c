/*
** The embedding API (ms_optimizer_*) as a C trainer uses it, on wrapped host memory: its error paths (NULL
** arguments, malformed JSON, unknown and mistyped options and settings, unknown recipes, parameters that do
** not fit, a recipe that fails mid-step, corrupt checkpoints), the AdamW recipe against an f64 AdamW written
** here, a least-squares problem trained to a small loss, schedules and grad_scale, and checkpoints that
** resume bit for bit.  Several ranks: ms_optimizer_set_comm and ms_optimizer_add_param_sharded's refusals, a
** world of one, and two ranks (this program started twice more, on the CPU's communicator) whose sharded and
** replicated parameters end where one optimizer on the whole tensors does.  Linked to libmoonstep.so like a
** trainer (the Lua side loads that same library).
*/
#include <arpa/inet.h>
#include <dlfcn.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "moonstep.h"

static ms_ctx *cpu;
static char dir[64];    /* a fresh temporary folder for recipe files and checkpoints */

static int contains(const char *s, const char *sub) { return s && strstr(s, sub) != NULL; }

static int ends_with(const char *s, const char *tail)
{
    size_t n = s ? strlen(s) : 0, k = strlen(tail);
    return s && n >= k && strcmp(s + n - k, tail) == 0;
}

/* A fixed-seed generator of values in [-1, 1), never all zeros. */
static uint64_t rng_state = 0x2545F4914F6CDD1DULL;
static double uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1p-53 * 2.0 - 1.0;
}

static void fill_random(float *x, int n, double scale)
{
    for (int i = 0; i < n; i++) x[i] = (float)(scale * uniform());
}

static ms_tensor *wrap(float *data, int ndim, const int64_t *shape)
{
    ms_tensor *t = NULL;
    ms_status st = ms_tensor_wrap(cpu, data, MS_DTYPE_F32, ndim, shape, NULL, &t);
    CHECK(st == MS_OK, "wrap: %s", ms_last_error());
    return t;
}

static const char *path_in_dir(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", dir, name);
    return buf;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "cannot write %s", path);
    if (f) { fputs(text, f); fclose(f); }
}

/* An optimizer over one wrapped parameter (and gradient), added under `name`; NULL on failure. */
static ms_optimizer *make_opt(const char *recipe, const char *options, const char *settings, const char *name,
                              float *p, float *g, int n)
{
    ms_optimizer *opt = NULL;
    ms_status st = ms_optimizer_new(cpu, recipe, options, settings, &opt);
    CHECK(st == MS_OK, "ms_optimizer_new(%s, %s, %s): %s", recipe, options, settings, ms_last_error());
    if (st != MS_OK) return NULL;
    int64_t shape[1] = { n };
    ms_tensor *tp = wrap(p, 1, shape), *tg = wrap(g, 1, shape);
    st = ms_optimizer_add_param(opt, name, tp, tg, NULL);
    CHECK(st == MS_OK, "add_param: %s", ms_last_error());
    ms_tensor_free(tp);      /* the optimizer keeps its own handles */
    ms_tensor_free(tg);
    return opt;
}

/* --- error paths ----------------------------------------------------------------------------------- */

static void test_null_arguments(void)
{
    ms_optimizer *opt = (ms_optimizer *)0x1;
    CHECK(ms_optimizer_new(NULL, "adamw", NULL, NULL, &opt) == MS_E_ARG && opt == NULL, "NULL ctx");
    CHECK(contains(ms_last_error(), "ctx is NULL"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, NULL) == MS_E_ARG, "NULL out");
    CHECK(ms_optimizer_new(cpu, NULL, NULL, NULL, &opt) == MS_E_ARG && opt == NULL, "NULL recipe");
    CHECK(ms_optimizer_new(cpu, "", NULL, NULL, &opt) == MS_E_ARG, "empty recipe");

    double lr;
    char *json = (char *)0x1;
    CHECK(ms_optimizer_add_param(NULL, "w", NULL, NULL, NULL) == MS_E_ARG, "add_param(NULL)");
    CHECK(contains(ms_last_error(), "opt is NULL"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(NULL, "w", NULL) == MS_E_ARG, "set_grad(NULL)");
    CHECK(ms_optimizer_step(NULL) == MS_E_ARG, "step(NULL)");
    CHECK(ms_optimizer_step_with(NULL, NULL, NULL) == MS_E_ARG, "step_with(NULL)");
    CHECK(ms_optimizer_set_lr(NULL, 0.1) == MS_E_ARG, "set_lr(NULL)");
    CHECK(ms_optimizer_get_lr(NULL, &lr) == MS_E_ARG, "get_lr(NULL)");
    CHECK(ms_optimizer_save(NULL, "x") == MS_E_ARG, "save(NULL)");
    CHECK(ms_optimizer_load(NULL, "x") == MS_E_ARG, "load(NULL)");
    CHECK(ms_optimizer_info(NULL, &json) == MS_E_ARG && json == NULL, "info(NULL) clears json_out");
    json = (char *)0x1;
    CHECK(ms_optimizer_stats(NULL, &json) == MS_E_ARG && json == NULL, "stats(NULL) clears json_out");
    CHECK(ms_optimizer_capture(NULL) == MS_E_ARG, "capture(NULL)");
    ms_optimizer_free(NULL);
    ms_string_free(NULL);

    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, &opt) == MS_OK, "adamw: %s", ms_last_error());
    float p[3] = { 1, 2, 3 };
    int64_t shape[1] = { 3 };
    ms_tensor *tp = wrap(p, 1, shape);
    CHECK(ms_optimizer_add_param(opt, NULL, tp, NULL, NULL) == MS_E_ARG, "NULL name");
    CHECK(ms_optimizer_add_param(opt, "", tp, NULL, NULL) == MS_E_ARG, "empty name");
    CHECK(ms_optimizer_add_param(opt, "w", NULL, NULL, NULL) == MS_E_ARG, "NULL param");
    CHECK(contains(ms_last_error(), "'w': param is NULL"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(opt, NULL, NULL) == MS_E_ARG, "set_grad NULL name");
    CHECK(ms_optimizer_get_lr(opt, NULL) == MS_E_ARG, "get_lr NULL out");
    CHECK(ms_optimizer_info(opt, NULL) == MS_E_ARG, "info NULL out");
    CHECK(ms_optimizer_save(opt, NULL) == MS_E_ARG && ms_optimizer_load(opt, "") == MS_E_ARG, "NULL/empty path");
    CHECK(ms_optimizer_set_lr(opt, -1) == MS_E_ARG && ms_optimizer_set_lr(opt, NAN) == MS_E_ARG &&
          ms_optimizer_set_lr(opt, INFINITY) == MS_E_ARG, "set_lr refuses negative, NaN, inf");
    ms_step_options so = { .grad_scale = -2 };
    CHECK(ms_optimizer_step_with(opt, &so, NULL) == MS_E_ARG, "negative grad_scale");
    so.grad_scale = NAN;
    CHECK(ms_optimizer_step_with(opt, &so, NULL) == MS_E_ARG, "NaN grad_scale");
    CHECK(contains(ms_last_error(), "grad_scale"), "message: %s", ms_last_error());
    so.grad_scale = 1e-320;   /* subnormal: its inverse, which unscales the gradients, is Inf */
    CHECK(ms_optimizer_step_with(opt, &so, NULL) == MS_E_ARG, "subnormal grad_scale");
    CHECK(contains(ms_last_error(), "too small"), "message: %s", ms_last_error());
    ms_tensor_free(tp);
    ms_optimizer_free(opt);
}

static void expect_new_fails(const char *recipe, const char *options, const char *settings, ms_status want,
                             const char *needle)
{
    ms_optimizer *opt = (ms_optimizer *)0x1;
    ms_status st = ms_optimizer_new(cpu, recipe, options, settings, &opt);
    CHECK(st == want && opt == NULL, "new(%s, %s, %s): %s, want %s", recipe, options ? options : "NULL",
          settings ? settings : "NULL", ms_status_name(st), ms_status_name(want));
    CHECK(contains(ms_last_error(), needle), "message lacks \"%s\": %s", needle, ms_last_error());
    CHECK(contains(ms_ctx_last_error(cpu), needle), "context message: %s", ms_ctx_last_error(cpu));
    if (st == MS_OK) ms_optimizer_free(opt);
}

static void test_bad_json(void)
{
    expect_new_fails("adamw", "{lr: 1}", NULL, MS_E_FORMAT, "options_json is not valid JSON");
    expect_new_fails("adamw", "{\"lr\": 1e-3,}", NULL, MS_E_FORMAT, "options_json is not valid JSON");
    expect_new_fails("adamw", "{\"lr\": 1} x", NULL, MS_E_FORMAT, "options_json is not valid JSON");
    expect_new_fails("adamw", "[0.1]", NULL, MS_E_FORMAT, "options_json must be a JSON object");
    expect_new_fails("adamw", "{\"lr\": 0.1, \"lr\": 0.2}", NULL, MS_E_FORMAT, "gives \"lr\" twice");
    expect_new_fails("adamw", NULL, "{\"schedule\": ", MS_E_FORMAT, "settings_json is not valid JSON");
    expect_new_fails("adamw", NULL, "\"cosine\"", MS_E_FORMAT, "settings_json must be a JSON object");
}

static void test_bad_options_and_settings(void)
{
    expect_new_fails("adamw", "{\"lrr\": 0.1}", NULL, MS_E_ARG, "unknown option 'lrr'");
    expect_new_fails("adamw", "{\"lr\": \"fast\"}", NULL, MS_E_ARG, "option 'lr'");
    expect_new_fails("adamw", "{\"lr\": true}", NULL, MS_E_ARG, "option 'lr'");
    expect_new_fails("adamw", "{\"eps\": 0}", NULL, MS_E_ARG, "option 'eps'");
    expect_new_fails("adamw", "{\"betas\": [0.9]}", NULL, MS_E_ARG, "option 'betas' needs 2 numbers");
    expect_new_fails("adamw", "{\"state_dtype\": \"f8\"}", NULL, MS_E_ARG, "must be one of f32, bf16");
    expect_new_fails("adamw", NULL, "{\"schedul\": {}}", MS_E_ARG, "unknown setting 'schedul'");
    expect_new_fails("adamw", NULL, "{\"nonfinite\": \"maybe\"}", MS_E_ARG, "setting nonfinite");
    expect_new_fails("adamw", NULL, "{\"clip_grad_norm\": -1}", MS_E_ARG, "clip_grad_norm");
    /* the runtime's own errors name the problem without its file's position or a traceback through it */
    CHECK(!contains(ms_last_error(), ".lua:") && !contains(ms_last_error(), "traceback"), "message: %s", ms_last_error());
    expect_new_fails("adamw", "{\"lr\": {\"a\": 1}}", NULL, MS_E_ARG, "option 'lr' = a table");
    expect_new_fails("adamw", NULL, "{\"schedule\": {\"kind\": \"sawtooth\"}}", MS_E_ARG, "unknown kind sawtooth");
    expect_new_fails("adamw", NULL, "{\"schedule\": {\"kind\": \"cosine\", \"total_steps\": 10, \"warmup_steps\": 20}}",
                     MS_E_ARG, "total_steps 10 must exceed warmup_steps 20");
    expect_new_fails("adamw", NULL, "{\"device\": \"cpu\"}", MS_E_ARG, "setting 'device'");
    /* JSON null: the option's default */
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_new(cpu, "adamw", "{\"lr\": null}", "{\"schedule\": null}", &opt) == MS_OK, "null options: %s",
          ms_last_error());
    double lr = 0;
    CHECK(ms_optimizer_get_lr(opt, &lr) == MS_OK && lr == 1e-3, "default lr %g", lr);
    ms_optimizer_free(opt);
}

static void test_unknown_recipes(void)
{
    char path[128];
    expect_new_fails("no_such_recipe", NULL, NULL, MS_E_ARG, "no recipe named \"no_such_recipe\"");
    expect_new_fails("/nonexistent/recipe.lua", NULL, NULL, MS_E_IO, "cannot read recipe /nonexistent/recipe.lua");
    write_file(path_in_dir(path, sizeof path, "syntax.lua"), "return { name = \"broken\", \n");
    expect_new_fails(path, NULL, NULL, MS_E_ARG, "syntax.lua");
    write_file(path_in_dir(path, sizeof path, "number.lua"), "return 42\n");
    expect_new_fails(path, NULL, NULL, MS_E_ARG, "must return a table");
    /* untrusted by default: the sandbox has no io */
    write_file(path_in_dir(path, sizeof path, "escape.lua"), "local f = io.open('/etc/passwd')\nreturn {}\n");
    expect_new_fails(path, NULL, NULL, MS_E_ARG, "io");
    /* MOONSTEP_LUA_DIR that holds no modules */
    setenv("MOONSTEP_LUA_DIR", dir, 1);
    expect_new_fails("adamw", NULL, NULL, MS_E_IO, "MOONSTEP_LUA_DIR");
    unsetenv("MOONSTEP_LUA_DIR");
}

static void test_parameter_errors(void)
{
    float p[6], g[6], g5[5];
    fill_random(p, 6, 1);
    fill_random(g, 6, 1);
    fill_random(g5, 5, 1);
    int32_t ip[6] = { 1, 2, 3, 4, 5, 6 };
    int64_t s6[1] = { 6 }, s23[2] = { 2, 3 }, s5[1] = { 5 };
    ms_tensor *tp = wrap(p, 1, s6), *tg = wrap(g, 1, s6), *tg23 = wrap(g, 2, s23), *tg5 = wrap(g5, 1, s5), *ti;
    CHECK(ms_tensor_wrap(cpu, ip, MS_DTYPE_I32, 1, s6, NULL, &ti) == MS_OK, "wrap i32");
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, &opt) == MS_OK, "adamw: %s", ms_last_error());

    CHECK(ms_optimizer_add_param(opt, "w", tp, tg23, NULL) == MS_E_SHAPE, "grad [2,3] for param [6]");
    CHECK(contains(ms_last_error(), "grad shape [2,3] != param shape [6]"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "w", ti, NULL, NULL) == MS_E_DTYPE, "i32 param");
    CHECK(contains(ms_last_error(), "i32"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "w", tp, ti, NULL) == MS_E_DTYPE, "i32 grad");
    /* what the optimizer refuses when it starts is refused here: a step could never run, and a parameter
    ** cannot be taken back */
    ms_tensor *tt;
    CHECK(ms_tensor_transpose(cpu, tg23, 0, 1, &tt) == MS_OK, "transpose: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "t", tt, NULL, NULL) == MS_E_LAYOUT, "non-contiguous param");
    CHECK(contains(ms_last_error(), "param must be contiguous"), "message: %s", ms_last_error());
    ms_tensor_free(tt);
    CHECK(ms_optimizer_add_param(opt, "w", tp, tp, NULL) == MS_E_ARG, "grad sharing the param's memory");
    CHECK(contains(ms_last_error(), "grad shares memory with the param"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "w", tp, tg, "no_decay, extra") == MS_OK, "add: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "w", tp, tg, NULL) == MS_E_ARG, "duplicate name");
    CHECK(contains(ms_last_error(), "duplicate parameter name 'w'"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(opt, "v", tg) == MS_E_ARG, "set_grad of an unknown name");
    CHECK(contains(ms_last_error(), "no parameter named 'v'"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(opt, "w", tg5) == MS_E_SHAPE, "set_grad [5] before the start");
    CHECK(contains(ms_last_error(), "grad shape [5] != param shape [6]"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(opt, "w", ti) == MS_E_DTYPE, "set_grad i32");
    /* as add_param: a gradient in the parameter's own memory is refused before the start too (the first step
    ** would fail), and the gradient given before stays */
    CHECK(ms_optimizer_set_grad(opt, "w", tp) == MS_E_ARG, "set_grad sharing the param's memory, before the start");
    CHECK(contains(ms_last_error(), "grad shares memory with the param"), "message: %s", ms_last_error());

    float before[6];
    memcpy(before, p, sizeof p);
    CHECK(ms_optimizer_step(opt) == MS_OK, "step: %s", ms_last_error());
    int moved = 0;
    for (int i = 0; i < 6; i++) moved += p[i] != before[i];
    CHECK(moved == 6, "the step updated the wrapped memory in place (%d of 6 moved)", moved);
    char *info = NULL;
    CHECK(ms_optimizer_info(opt, &info) == MS_OK, "info: %s", ms_last_error());
    /* the tag routed w to AdamW without weight decay */
    CHECK(contains(info, "\"weight_decay\":0"), "tags reach route(): %s", info);
    ms_string_free(info);

    float q[6];
    fill_random(q, 6, 1);
    ms_tensor *tq = wrap(q, 1, s6);
    CHECK(ms_optimizer_add_param(opt, "q", tq, NULL, NULL) == MS_E_ARG, "add after the start");
    CHECK(contains(ms_last_error(), "has started"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(opt, "w", tg5) == MS_E_SHAPE, "set_grad [5] after the start");
    CHECK(ms_optimizer_set_grad(opt, "w", tp) == MS_E_ARG, "set_grad sharing the param's memory, after the start");
    CHECK(contains(ms_last_error(), "grad shares memory with the param"), "message: %s", ms_last_error());
    /* no gradient: the step leaves w alone */
    CHECK(ms_optimizer_set_grad(opt, "w", NULL) == MS_OK, "set_grad NULL: %s", ms_last_error());
    memcpy(before, p, sizeof p);
    CHECK(ms_optimizer_step(opt) == MS_OK && memcmp(before, p, sizeof p) == 0, "no grad, no change");
    CHECK(ms_optimizer_set_grad(opt, "w", tg) == MS_OK, "grad back: %s", ms_last_error());
    CHECK(ms_optimizer_step(opt) == MS_OK && memcmp(before, p, sizeof p) != 0, "grad again, a change");

    ms_tensor_free(tq);
    ms_tensor_free(tp);
    ms_tensor_free(tg);
    ms_tensor_free(tg23);
    ms_tensor_free(tg5);
    ms_tensor_free(ti);
    ms_optimizer_free(opt);
}

/* SGD (lr 0.5) moved p by -0.5 g, exactly (a power of two: one rounding either way). */
static int sgd_moved(const float *now, const float *before, const float *g, int n)
{
    for (int i = 0; i < n; i++)
        if (now[i] != before[i] - 0.5f * g[i]) return 0;
    return 1;
}

/* Parameters and gradients sharing memory (not a tie) are refused when given, not at every step after: the
** optimizer had no way to drop them and could never step. */
static void test_shared_memory_refused_when_given(void)
{
    float buf[12], ga[6], gb[6], gc[6], pc[6], before[6];
    fill_random(buf, 12, 1);
    fill_random(ga, 6, 1);
    fill_random(gb, 6, 1);
    fill_random(pc, 6, 1);
    int64_t s6[1] = { 6 };
    ms_tensor *pa = wrap(buf, 1, s6), *pb = wrap(buf + 2, 1, s6), *tpc = wrap(pc, 1, s6), *tga = wrap(ga, 1, s6),
              *tgb = wrap(gb, 1, s6), *tgc = wrap(gc, 1, s6), *over_pc = wrap(pc + 1, 1, s6);
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_new(cpu, "sgd", "{\"lr\": 0.5}", NULL, &opt) == MS_OK, "sgd: %s", ms_last_error());
    if (opt == NULL) return;
    CHECK(ms_optimizer_add_param(opt, "a", pa, tga, NULL) == MS_OK, "a: %s", ms_last_error());
    ms_status st = ms_optimizer_add_param(opt, "b", pb, tgb, NULL);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "parameter 'b': its param shares memory with parameter 'a''s param"),
          "overlapping params: %s %s", ms_status_name(st), ms_last_error());
    st = ms_optimizer_add_param(opt, "c", tpc, tga, NULL);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "parameter 'c': its grad shares memory with parameter 'a''s grad"),
          "a shared gradient: %s %s", ms_status_name(st), ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "c", tpc, tgc, NULL) == MS_OK, "c: %s", ms_last_error());
    st = ms_optimizer_set_grad(opt, "a", over_pc);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "parameter 'a': its grad shares memory with parameter 'c''s param"),
          "a gradient over another parameter: %s %s", ms_status_name(st), ms_last_error());
    /* what was refused left nothing behind: the optimizer steps a and c with their own gradients */
    fill_random(gc, 6, 1);
    memcpy(before, buf, sizeof before);
    CHECK(ms_optimizer_step(opt) == MS_OK, "step: %s", ms_last_error());
    CHECK(sgd_moved(buf, before, ga, 6), "a stepped with its gradient");
    ms_optimizer_free(opt);
    ms_tensor *all[] = { pa, pb, tpc, tga, tgb, tgc, over_pc };
    for (int i = 0; i < 7; i++) ms_tensor_free(all[i]);
}

static void test_tied_and_unwritable_grads(void)
{
    float w[6], ga[6], gb[6], e[6], before[6];
    fill_random(w, 6, 1);
    fill_random(ga, 6, 1);
    fill_random(gb, 6, 1);
    fill_random(e, 2, 1);
    int64_t s23[2] = { 2, 3 }, zero_row[2] = { 0, 1 };
    ms_tensor *tw = wrap(w, 2, s23), *ta = wrap(ga, 2, s23), *ta2 = wrap(ga, 2, s23), *tb = wrap(gb, 2, s23), *te;
    /* an expanded gradient: every row is e[0..2] */
    CHECK(ms_tensor_wrap(cpu, e, MS_DTYPE_F32, 2, s23, zero_row, &te) == MS_OK, "wrap expanded: %s", ms_last_error());
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_new(cpu, "sgd", "{\"lr\": 0.5}", NULL, &opt) == MS_OK, "sgd: %s", ms_last_error());
    if (opt == NULL) return;
    /* tied weights (an embedding and its head) with their gradient given through the second name only: it was
    ** dropped, and the tie stepped with none */
    CHECK(ms_optimizer_add_param(opt, "embed", tw, NULL, NULL) == MS_OK, "embed: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "head", tw, ta, NULL) == MS_OK, "head: %s", ms_last_error());
    ms_status st = ms_optimizer_add_param(opt, "head2", tw, tb, NULL);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "parameters 'head' and 'head2' are tied (one tensor) but were "
          "given different gradients"), "two gradients for a tie: %s %s", ms_status_name(st), ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "head3", tw, ta2, NULL) == MS_OK, "the same gradient again (another handle): %s",
          ms_last_error());
    /* routed once: by the first name's tags (a later name may repeat them, or give none) */
    st = ms_optimizer_add_param(opt, "head4", tw, NULL, "no_decay");
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "parameters 'embed' and 'head4' are tied (one tensor) but were "
          "given different tags ([], [no_decay])"), "other tags for a tie: %s %s", ms_status_name(st), ms_last_error());
    /* a gradient the steps cannot rescale in place: refused here, not at a step with grad_scale */
    st = ms_optimizer_add_param(opt, "x", tb, te, NULL);
    CHECK(st == MS_E_LAYOUT && contains(ms_last_error(), "parameter 'x': grad [2,3] has strides [0,1]") &&
          contains(ms_last_error(), "must be writable"), "expanded grad: %s %s", ms_status_name(st), ms_last_error());
    memcpy(before, w, sizeof w);
    ms_step_options so = { .grad_scale = 1 };
    CHECK(ms_optimizer_step_with(opt, &so, NULL) == MS_OK, "step: %s", ms_last_error());
    CHECK(sgd_moved(w, before, ga, 6), "the tie stepped once, with the gradient given through 'head'");
    st = ms_optimizer_set_grad(opt, "embed", te);
    CHECK(st == MS_E_LAYOUT && contains(ms_last_error(), "parameter 'embed'") &&
          contains(ms_last_error(), "must be writable"), "set_grad expanded: %s %s", ms_status_name(st), ms_last_error());
    /* set_grad through any name replaces the tie's gradient */
    CHECK(ms_optimizer_set_grad(opt, "embed", tb) == MS_OK, "set_grad embed: %s", ms_last_error());
    memcpy(before, w, sizeof w);
    CHECK(ms_optimizer_step(opt) == MS_OK && sgd_moved(w, before, gb, 6), "stepped with embed's new gradient: %s",
          ms_last_error());
    ms_optimizer_free(opt);

    /* before the optimizer starts too: a set_grad through one name is the tie's, not a second gradient */
    CHECK(ms_optimizer_new(cpu, "sgd", "{\"lr\": 0.5}", NULL, &opt) == MS_OK, "sgd: %s", ms_last_error());
    if (opt == NULL) return;
    CHECK(ms_optimizer_add_param(opt, "embed", tw, ta, NULL) == MS_OK, "embed: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "head", tw, NULL, NULL) == MS_OK, "head: %s", ms_last_error());
    CHECK(ms_optimizer_set_grad(opt, "head", tb) == MS_OK, "set_grad head: %s", ms_last_error());
    memcpy(before, w, sizeof w);
    CHECK(ms_optimizer_step(opt) == MS_OK, "step: %s", ms_last_error());
    CHECK(sgd_moved(w, before, gb, 6), "stepped with the gradient set through 'head'");
    ms_optimizer_free(opt);
    ms_tensor_free(tw);
    ms_tensor_free(ta);
    ms_tensor_free(ta2);
    ms_tensor_free(tb);
    ms_tensor_free(te);
}

static const char *failing_recipe =
    "-- a recipe whose step fails: its own error at step 3, an engine error at step `bad_step`\n"
    "return {\n"
    "  name = \"fails\", version = 1,\n"
    "  options = { lr = { default = 0.1, type = \"number\", min = 0 },\n"
    "              engine_error_at = { default = 0, type = \"integer\" } },\n"
    "  route = function(p, o) return \"plain\" end,\n"
    "  routes = { plain = { step = function(group, o, ctx)\n"
    "    if ctx.step == 3 then error(\"deliberate failure at step 3\") end\n"
    "    if ctx.step == o.engine_error_at then ms.matmul(ms.zeros({2, 3}), ms.zeros({4, 5})) end\n"
    "    for _, m in ipairs(group) do ms.addcmul(m.param, m.grad, ctx.lr_t, -1, m.param) end\n"
    "  end } },\n"
    "}\n";

static void test_recipe_error_mid_step(void)
{
    char path[128];
    write_file(path_in_dir(path, sizeof path, "fails.lua"), failing_recipe);
    for (int trusted = 0; trusted <= 1; trusted++) {
        float p[4], g[4], p0[4];
        fill_random(p, 4, 1);
        fill_random(g, 4, 1);
        memcpy(p0, p, sizeof p);
        ms_optimizer *opt = make_opt(path, "{\"lr\": 0.5}", trusted ? "{\"trusted\": true}" : NULL, "w", p, g, 4);
        if (!opt) continue;
        CHECK(ms_optimizer_step(opt) == MS_OK && ms_optimizer_step(opt) == MS_OK, "steps 1-2: %s", ms_last_error());
        for (int i = 0; i < 4; i++)
            CHECK(fabsf(p[i] - (p0[i] - 2 * 0.5f * g[i])) <= 1e-6f, "two SGD steps on element %d", i);
        ms_status st = ms_optimizer_step(opt);
        CHECK(st == MS_E_ARG, "step 3 fails (trusted %d): %s", trusted, ms_status_name(st));
        CHECK(contains(ms_last_error(), "ms_optimizer_step: ") && contains(ms_last_error(), "fails.lua:8:") &&
              contains(ms_last_error(), "deliberate failure at step 3"), "message: %s", ms_last_error());
        CHECK(contains(ms_last_error(), "stack traceback"), "with a traceback: %s", ms_last_error());
        /* still usable: the failed step was not counted */
        char *stats = NULL;
        CHECK(ms_optimizer_stats(opt, &stats) == MS_OK && contains(stats, "\"step\":2"), "stats: %s", stats);
        ms_string_free(stats);
        double lr = 0;
        CHECK(ms_optimizer_get_lr(opt, &lr) == MS_OK && lr == 0.5, "lr %g", lr);
        ms_optimizer_free(opt);
    }

    /* an engine error inside the recipe keeps the engine's status and message */
    float p[4], g[4];
    fill_random(p, 4, 1);
    fill_random(g, 4, 1);
    ms_optimizer *opt = make_opt(path, "{\"engine_error_at\": 2}", NULL, "w", p, g, 4);
    if (opt) {
        CHECK(ms_optimizer_step(opt) == MS_OK, "step 1: %s", ms_last_error());
        ms_status st = ms_optimizer_step(opt);
        CHECK(st == MS_E_SHAPE, "engine error status: %s", ms_status_name(st));
        CHECK(contains(ms_last_error(), "ms_matmul") && contains(ms_last_error(), "fails.lua:9"), "message: %s",
              ms_last_error());
        ms_optimizer_free(opt);
    }
}

static void test_nonfinite(void)
{
    float p[4], g[4], before[4];
    fill_random(p, 4, 1);
    fill_random(g, 4, 1);
    g[2] = NAN;
    memcpy(before, p, sizeof p);
    ms_optimizer *opt = make_opt("adamw", NULL, NULL, "w", p, g, 4);
    if (opt) {
        int applied = -1;
        CHECK(ms_optimizer_step_with(opt, NULL, &applied) == MS_OK && applied == 0, "skipped: applied %d", applied);
        CHECK(memcmp(before, p, sizeof p) == 0, "a skipped step changes nothing");
        char *stats = NULL;
        CHECK(ms_optimizer_stats(opt, &stats) == MS_OK && contains(stats, "\"skipped_steps\":1"), "stats: %s", stats);
        ms_string_free(stats);
        ms_optimizer_free(opt);
    }
    opt = make_opt("adamw", NULL, "{\"nonfinite\": \"raise\"}", "w", p, g, 4);
    if (opt) {
        ms_status st = ms_optimizer_step(opt);
        CHECK(st == MS_E_ARG && contains(ms_last_error(), "non-finite gradients in w"), "raise: %s %s",
              ms_status_name(st), ms_last_error());
        ms_optimizer_free(opt);
    }
    /* checks on the device: the host learns of a skip from the stats */
    g[2] = 0.25f;
    opt = make_opt("adamw", NULL, "{\"device_checks\": true}", "w", p, g, 4);
    if (opt) {
        int applied = 2;
        CHECK(ms_optimizer_step_with(opt, NULL, &applied) == MS_OK && applied != 0, "device checks, finite: %d (%s)",
              applied, ms_last_error());
        g[2] = NAN;
        memcpy(before, p, sizeof p);
        CHECK(ms_optimizer_step_with(opt, NULL, &applied) == MS_OK && applied == -1, "device checks: applied %d (%s)",
              applied, ms_last_error());
        CHECK(memcmp(before, p, sizeof p) == 0, "a step skipped on the device changes nothing");
        char *stats = NULL;
        CHECK(ms_optimizer_stats(opt, &stats) == MS_OK && contains(stats, "\"skipped_steps\":1"), "stats: %s", stats);
        ms_string_free(stats);
        ms_optimizer_free(opt);
    }
}

static void test_capture_on_cpu(void)
{
    float p[4], g[4];
    fill_random(p, 4, 1);
    fill_random(g, 4, 1);
    ms_optimizer *opt = make_opt("adamw", NULL, NULL, "w", p, g, 4);
    if (!opt) return;
    ms_status st = ms_optimizer_capture(opt);
    CHECK(st == MS_E_UNSUPPORTED, "capture on the CPU: %s (%s)", ms_status_name(st), ms_last_error());
    CHECK(ms_optimizer_step(opt) == MS_OK, "steps go on: %s", ms_last_error());
    ms_optimizer_free(opt);
}

/* ms_optimizer_prepare_replay's refusals that a CPU context reaches: NULL, bad grad_scale, and no graphs on
** the CPU at all; none of them changes the optimizer, which keeps stepping. */
static void test_prepare_replay_on_cpu(void)
{
    CHECK(ms_optimizer_prepare_replay(NULL) == MS_E_ARG, "prepare_replay(NULL)");
    CHECK(contains(ms_last_error(), "opt is NULL"), "message: %s", ms_last_error());
    CHECK(ms_optimizer_prepare_replay_with(NULL, NULL) == MS_E_ARG, "prepare_replay_with(NULL)");

    float p[5], g[5], before[5];
    fill_random(p, 5, 1);
    fill_random(g, 5, 1);
    ms_optimizer *opt = make_opt("adamw", "{\"lr\": 0.05}", "{\"device_checks\": true}", "w", p, g, 5);
    if (!opt) return;
    memcpy(before, p, sizeof p);
    double lr0 = 0, lr = 0;
    CHECK(ms_optimizer_get_lr(opt, &lr0) == MS_OK && lr0 == 0.05, "lr %g", lr0);

    const double bad[] = { -1, NAN, INFINITY };
    for (int i = 0; i < 3; i++) {
        ms_step_options so = { .grad_scale = bad[i] };
        ms_status st = ms_optimizer_prepare_replay_with(opt, &so);
        CHECK(st == MS_E_ARG, "grad_scale %g: %s", bad[i], ms_status_name(st));
        CHECK(contains(ms_last_error(), "ms_optimizer_prepare_replay_with: grad_scale must be a positive finite number"),
              "message: %s", ms_last_error());
    }
    /* before the first step and after one: a CPU optimizer has no replays */
    for (int round = 0; round < 2; round++) {
        ms_status st = ms_optimizer_prepare_replay(opt);
        CHECK(st == MS_E_UNSUPPORTED, "round %d: %s", round, ms_status_name(st));
        CHECK(contains(ms_last_error(), "ms_optimizer_prepare_replay: the optimizer runs on cpu") &&
              contains(ms_last_error(), "never captured into a CUDA graph"), "message: %s", ms_last_error());
        CHECK(contains(ms_ctx_last_error(cpu), "never captured"), "context message: %s", ms_ctx_last_error(cpu));
        ms_step_options so = { .grad_scale = 4 };
        CHECK(ms_optimizer_prepare_replay_with(opt, &so) == MS_E_UNSUPPORTED, "round %d, with grad_scale", round);
        /* nothing changed: no step counted, same lr, same parameters */
        char *stats = NULL;
        /* the stats' keys are sorted: the step count is the last one */
        CHECK(ms_optimizer_stats(opt, &stats) == MS_OK && ends_with(stats, round ? "\"step\":1}" : "\"step\":0}"),
              "round %d: stats %s", round, stats);
        ms_string_free(stats);
        CHECK(ms_optimizer_get_lr(opt, &lr) == MS_OK && lr == lr0, "round %d: lr %g", round, lr);
        CHECK(memcmp(before, p, sizeof p) == 0, "round %d: parameters unchanged", round);
        if (round == 0) {
            CHECK(ms_optimizer_step(opt) == MS_OK, "the step after the refusals: %s", ms_last_error());
            int moved = 0;
            for (int i = 0; i < 5; i++) moved += p[i] != before[i] && isfinite(p[i]);
            CHECK(moved == 5, "the step updated every element (%d of 5)", moved);
            memcpy(before, p, sizeof p);
        }
    }
    ms_optimizer_free(opt);
}

/* --- inside a trainer's CUDA graph (a GPU host; skipped elsewhere) ------------------------------------- */

/* The CUDA runtime calls a trainer captures with, found in the process (libmoonstep links libcudart), as
** torch.cuda.graph would make them: cudaStreamBeginCapture in global mode on the context's stream. */
typedef struct cudart {
    int (*stream_create)(void **stream, unsigned flags);
    int (*stream_destroy)(void *stream);
    int (*begin_capture)(void *stream, int mode);
    int (*end_capture)(void *stream, void **graph);
    int (*instantiate)(void **exec, void *graph, unsigned long long flags);
    int (*launch)(void *exec, void *stream);
    int (*exec_destroy)(void *exec);
    int (*graph_destroy)(void *graph);
} cudart;

static int load_cudart(cudart *rt)
{
    struct { void *slot; const char *name; } want[] = {
        { &rt->stream_create, "cudaStreamCreateWithFlags" }, { &rt->stream_destroy, "cudaStreamDestroy" },
        { &rt->begin_capture, "cudaStreamBeginCapture" }, { &rt->end_capture, "cudaStreamEndCapture" },
        { &rt->instantiate, "cudaGraphInstantiate" }, { &rt->launch, "cudaGraphLaunch" },
        { &rt->exec_destroy, "cudaGraphExecDestroy" }, { &rt->graph_destroy, "cudaGraphDestroy" },
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        void *f = dlsym(RTLD_DEFAULT, want[i].name);
        if (f == NULL) return 0;
        memcpy(want[i].slot, &f, sizeof f);
    }
    return 1;
}

enum { CAPTURE_GLOBAL = 0, STREAM_NON_BLOCKING = 1 };
enum { G_ROWS = 24, G_COLS = 16, G_STEPS = 9, G_NAN_STEP = 5, G_SET_LR_STEP = 7 };

typedef struct gset {
    ms_tensor *w, *b, *gw, *gb;
    ms_optimizer *opt;
} gset;

static ms_tensor *gpu_tensor(ms_ctx *ctx, int ndim, const int64_t *shape, const float *values, size_t n)
{
    ms_tensor *t = NULL;
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, ndim, shape, &t) == MS_OK, "tensor: %s", ms_last_error());
    if (t) CHECK(ms_tensor_write(ctx, t, values, n * sizeof(float)) == MS_OK, "write: %s", ms_last_error());
    return t;
}

/* Step t's gradients (fresh random values; a NaN at G_NAN_STEP) into both sets. */
static void write_grads(ms_ctx *ctx, gset *sets, int t)
{
    float gw[G_ROWS * G_COLS], gb[G_ROWS];
    fill_random(gw, G_ROWS * G_COLS, 1);
    fill_random(gb, G_ROWS, 0.5);
    if (t == G_NAN_STEP) gw[17] = NAN;
    for (int i = 0; i < 2; i++) {
        CHECK(ms_tensor_write(ctx, sets[i].gw, gw, sizeof gw) == MS_OK, "grads: %s", ms_last_error());
        CHECK(ms_tensor_write(ctx, sets[i].gb, gb, sizeof gb) == MS_OK, "grads: %s", ms_last_error());
    }
}

/* Records ms_optimizer_step_with(opt), and the calls refused inside the capture, into a graph of the caller's
** own; *exec <- the instantiated graph when the step was recorded (NULL otherwise), message <- the step's
** error message. */
static ms_status record_step(const cudart *rt, void *stream, ms_optimizer *opt, void **exec, char *message,
                             size_t n, const char *what)
{
    *exec = NULL;
    void *graph = NULL;
    CHECK(rt->begin_capture(stream, CAPTURE_GLOBAL) == 0, "%s: begin capture", what);
    int applied = 7;
    ms_status st = ms_optimizer_step_with(opt, NULL, &applied);
    snprintf(message, n, "%s", st == MS_OK ? "" : ms_last_error());
    if (st == MS_OK) {
        CHECK(applied == -1, "%s: a recorded step's applied is -1 (got %d)", what, applied);
        /* inside the capture: no replay to prepare, nothing that reads the device */
        ms_status in = ms_optimizer_prepare_replay(opt);
        CHECK(in == MS_E_UNSUPPORTED && contains(ms_last_error(), "being captured"), "%s: prepare_replay inside: %s %s",
              what, ms_status_name(in), ms_last_error());
        char path[128];
        in = ms_optimizer_save(opt, path_in_dir(path, sizeof path, "never.safetensors"));
        CHECK(in == MS_E_UNSUPPORTED && contains(ms_last_error(), "refused while the context's stream is being captured"),
              "%s: save inside: %s %s", what, ms_status_name(in), ms_last_error());
        CHECK(access(path, F_OK) != 0, "%s: nothing saved", what);
    }
    int ended = rt->end_capture(stream, &graph);
    CHECK(ended == 0, "%s: the capture ended (error %d): moonstep's calls kept it valid", what, ended);
    if (st == MS_OK && ended == 0) CHECK(rt->instantiate(exec, graph, 0) == 0, "%s: instantiate", what);
    if (graph) rt->graph_destroy(graph);
    return st;
}

/* Reads a set's parameters into w (G_ROWS * G_COLS) and b (G_ROWS). */
static void read_params(ms_ctx *ctx, const gset *g, float *w, float *b)
{
    CHECK(ms_tensor_read(ctx, g->w, w, sizeof(float) * G_ROWS * G_COLS) == MS_OK, "read: %s", ms_last_error());
    CHECK(ms_tensor_read(ctx, g->b, b, sizeof(float) * G_ROWS) == MS_OK, "read: %s", ms_last_error());
}

/* Parameters w (G_ROWS x G_COLS) and b (G_ROWS) from w0, b0, gradient buffers, and an optimizer over them. */
static int new_set(ms_ctx *ctx, gset *g, const char *recipe, const char *settings, const float *w0, const float *b0)
{
    const int64_t ws[2] = { G_ROWS, G_COLS }, bs[1] = { G_ROWS };
    g->w = gpu_tensor(ctx, 2, ws, w0, G_ROWS * G_COLS);
    g->gw = gpu_tensor(ctx, 2, ws, w0, G_ROWS * G_COLS);
    g->b = gpu_tensor(ctx, 1, bs, b0, G_ROWS);
    g->gb = gpu_tensor(ctx, 1, bs, b0, G_ROWS);
    g->opt = NULL;
    if (!g->w || !g->gw || !g->b || !g->gb) return 0;
    ms_status st = ms_optimizer_new(ctx, recipe, "{\"lr\": 0.02}", settings, &g->opt);
    CHECK(st == MS_OK, "%s optimizer: %s", recipe, ms_last_error());
    if (st != MS_OK) return 0;
    CHECK(ms_optimizer_add_param(g->opt, "layers.0.weight", g->w, g->gw, NULL) == MS_OK, "add: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(g->opt, "layers.0.bias", g->b, g->gb, NULL) == MS_OK, "add: %s", ms_last_error());
    return 1;
}

static void free_set(gset *g)
{
    ms_optimizer_free(g->opt);
    ms_tensor_free(g->w);
    ms_tensor_free(g->gw);
    ms_tensor_free(g->b);
    ms_tensor_free(g->gb);
}

static int count_moved(const float *now, const float *before, int n)
{
    int moved = 0;
    for (int i = 0; i < n; i++) moved += now[i] != before[i] && isfinite(now[i]);
    return moved;
}

/* A C trainer that records moonstep's step into a CUDA graph of its own and replays it: bit for bit the
** parameters of the same steps run uncaptured (both device-checked), under a cosine schedule, a set_lr and a
** replay with a NaN gradient that the device skips; the refusals before the warm-up, without device checks
** and inside the capture, and prepare_replay's own checks. */
static void test_trainer_graph(const cudart *rt, const char *recipe)
{
    enum { NW = G_ROWS * G_COLS };
    void *stream = NULL;
    ms_ctx *gpu = NULL;
    CHECK(rt->stream_create(&stream, STREAM_NON_BLOCKING) == 0, "%s: a stream of the trainer's", recipe);
    ms_ctx_options o = { .stream = stream };
    if (ms_ctx_new("cuda", &o, &gpu) != MS_OK) {
        CHECK(0, "%s: a context on the trainer's stream: %s", recipe, ms_last_error());
        return;
    }
    static float w0[NW], b0[G_ROWS];
    fill_random(w0, NW, 0.5);
    fill_random(b0, G_ROWS, 0.5);
    const char *settings = "{\"schedule\": {\"kind\": \"cosine\", \"warmup_steps\": 2, \"total_steps\": 12}, "
                           "\"device_checks\": true}";
    gset sets[2] = { 0 }, plain = { 0 };
    int ok = new_set(gpu, &sets[0], recipe, settings, w0, b0) && new_set(gpu, &sets[1], recipe, settings, w0, b0) &&
             new_set(gpu, &plain, recipe, NULL, w0, b0);
    ms_optimizer *ref = sets[0].opt, *opt = sets[1].opt;
    void *exec = NULL;
    char message[1024];
    char *stats = NULL;
    ms_status st;
    if (!ok) goto done;

    /* before the warm-up: no replay to prepare, the first step is not recorded */
    st = ms_optimizer_prepare_replay(opt);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "no step has been recorded into a CUDA graph"),
          "%s: prepare_replay before a recording: %s %s", recipe, ms_status_name(st), ms_last_error());
    st = record_step(rt, stream, opt, &exec, message, sizeof message, "the first step");
    CHECK(st == MS_E_UNSUPPORTED && contains(message, "the first step cannot be captured") &&
          contains(message, "\"device_checks\": true"), "%s: first step recorded: %s %s", recipe, ms_status_name(st),
          message);

    /* the warm-up: step 1, uncaptured */
    write_grads(gpu, sets, 1);
    CHECK(ms_optimizer_step(ref) == MS_OK && ms_optimizer_step(opt) == MS_OK, "%s: step 1: %s", recipe, ms_last_error());
    /* an optimizer without device checks, warm: refused, and still usable */
    CHECK(ms_optimizer_step(plain.opt) == MS_OK, "%s: plain step: %s", recipe, ms_last_error());
    st = record_step(rt, stream, plain.opt, &exec, message, sizeof message, "no device checks");
    CHECK(st == MS_E_UNSUPPORTED && contains(message, "\"device_checks\": true"), "%s: without device checks: %s %s",
          recipe, ms_status_name(st), message);
    CHECK(ms_optimizer_step(plain.opt) == MS_OK, "%s: plain steps go on: %s", recipe, ms_last_error());

    st = record_step(rt, stream, opt, &exec, message, sizeof message, "the recorded step");
    CHECK(st == MS_OK && exec != NULL, "%s: recording: %s %s", recipe, ms_status_name(st), message);
    CHECK(ms_optimizer_stats(opt, &stats) == MS_OK && ends_with(stats, "\"step\":1}"), "%s: recording counts no step: %s",
          recipe, stats);
    ms_string_free(stats);

    static float wa[NW], ba[G_ROWS], wb[NW], bb[G_ROWS], wprev[NW], bprev[G_ROWS];
    read_params(gpu, &sets[1], wprev, bprev);
    for (int t = 2; t <= G_STEPS && exec; t++) {
        write_grads(gpu, sets, t);
        if (t == G_SET_LR_STEP)
            CHECK(ms_optimizer_set_lr(ref, 0.004) == MS_OK && ms_optimizer_set_lr(opt, 0.004) == MS_OK, "set_lr");
        double lr_ref = -1, lr_opt = -2;
        CHECK(ms_optimizer_get_lr(ref, &lr_ref) == MS_OK && ms_optimizer_get_lr(opt, &lr_opt) == MS_OK &&
              lr_ref == lr_opt, "%s: step %d: lr %g vs %g", recipe, t, lr_ref, lr_opt);
        CHECK(ms_optimizer_step(ref) == MS_OK, "%s: step %d: %s", recipe, t, ms_last_error());
        CHECK(ms_optimizer_prepare_replay(opt) == MS_OK, "%s: prepare_replay %d: %s", recipe, t, ms_last_error());
        CHECK(rt->launch(exec, stream) == 0, "%s: replay %d", recipe, t);
        read_params(gpu, &sets[0], wa, ba);
        read_params(gpu, &sets[1], wb, bb);
        CHECK(memcmp(wa, wb, sizeof wa) == 0 && memcmp(ba, bb, sizeof ba) == 0,
              "%s: step %d: the replay differs from the uncaptured step (w[0] %.9g vs %.9g)", recipe, t, wb[0], wa[0]);
        if (t == G_NAN_STEP)
            CHECK(memcmp(wb, wprev, sizeof wb) == 0 && memcmp(bb, bprev, sizeof bb) == 0,
                  "%s: the replay with a NaN gradient changed the parameters", recipe);
        else {
            int moved = count_moved(wb, wprev, NW) + count_moved(bb, bprev, G_ROWS);
            CHECK(moved > (NW + G_ROWS) / 2, "%s: step %d: the replay moved %d of %d values", recipe, t, moved,
                  NW + G_ROWS);
        }
        memcpy(wprev, wb, sizeof wb);
        memcpy(bprev, bb, sizeof bb);
    }
    /* a grad_scale for a step recorded without one: refused, nothing counted */
    ms_step_options so = { .grad_scale = 2 };
    st = ms_optimizer_prepare_replay_with(opt, &so);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "given no grad_scale"), "%s: grad_scale: %s %s", recipe,
          ms_status_name(st), ms_last_error());
    char want[64];
    snprintf(want, sizeof want, "\"step\":%d}", G_STEPS);       /* the last key: the step count */
    for (int i = 0; i < 2; i++) {
        CHECK(ms_optimizer_stats(sets[i].opt, &stats) == MS_OK && ends_with(stats, want) &&
              contains(stats, "\"skipped_steps\":1,"), "%s: stats of set %d: %s", recipe, i, stats);
        ms_string_free(stats);
    }

done:
    if (exec) rt->exec_destroy(exec);
    free_set(&sets[0]);
    free_set(&sets[1]);
    free_set(&plain);
    ms_ctx_free(gpu);           /* its tensors went first: this waits for the stream, which goes next */
    if (stream) rt->stream_destroy(stream);
}

/* --- numerics -------------------------------------------------------------------------------------- */

/* AdamW (torch.optim.AdamW's formula) in f64 on 40 fresh random gradients, against the adamw recipe on f32
** parameters in wrapped memory, with weight decay and the lr changed by set_lr half way. */
static void test_adamw_matches_formula(void)
{
    enum { N = 37, STEPS = 40 };
    float p[N], g[N];
    double ref[N], m[N] = { 0 }, v[N] = { 0 };
    fill_random(p, N, 1);
    for (int i = 0; i < N; i++) ref[i] = p[i];
    ms_optimizer *opt = make_opt("adamw", "{\"lr\": 0.01, \"betas\": [0.8, 0.95], \"eps\": 1e-6, \"weight_decay\": 0.1}",
                                 NULL, "layer.weight", p, g, N);
    if (!opt) return;
    const double b1 = 0.8, b2 = 0.95, eps = 1e-6, wd = 0.1;
    double worst = 0;
    for (int t = 1; t <= STEPS; t++) {
        double lr = t <= STEPS / 2 ? 0.01 : 0.003;
        if (t == STEPS / 2 + 1) CHECK(ms_optimizer_set_lr(opt, lr) == MS_OK, "set_lr: %s", ms_last_error());
        fill_random(g, N, 1 + t % 3);
        CHECK(ms_optimizer_step(opt) == MS_OK, "step %d: %s", t, ms_last_error());
        for (int i = 0; i < N; i++) {
            ref[i] *= 1 - lr * wd;
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * (double)g[i] * g[i];
            ref[i] -= lr * (m[i] / (1 - pow(b1, t))) / (sqrt(v[i] / (1 - pow(b2, t))) + eps);
        }
    }
    for (int i = 0; i < N; i++) {
        double err = fabs(p[i] - ref[i]) / (1e-6 + 1e-5 * fabs(ref[i]));
        if (!(err <= worst)) worst = err;   /* NaN sticks */
    }
    CHECK(worst <= 1, "AdamW vs the f64 formula: worst error %.3g of the tolerance", worst);
    double lr = 0;
    CHECK(ms_optimizer_get_lr(opt, &lr) == MS_OK && lr == 0.003, "get_lr after set_lr: %g", lr);
    ms_optimizer_free(opt);
}

/* The schedule of the settings and grad_scale, through SGD (p <- p - lr g). */
static void test_schedule_and_grad_scale(void)
{
    enum { N = 8 };
    float p[N], g[N];
    fill_random(p, N, 1);
    ms_optimizer *opt = make_opt("sgd", "{\"lr\": 0.2}",
                                 "{\"schedule\": {\"kind\": \"cosine\", \"warmup_steps\": 4, \"total_steps\": 20}}",
                                 "w", p, g, N);
    if (!opt) return;
    const double pi = 3.14159265358979323846;
    for (int t = 1; t <= 12; t++) {
        double want = t <= 4 ? 0.2 * t / 4 : 0.2 * 0.5 * (1 + cos(pi * (t - 4) / 16.0));
        double lr = -1;
        CHECK(ms_optimizer_get_lr(opt, &lr) == MS_OK && fabs(lr - want) <= 1e-12, "step %d lr %g, want %g", t, lr, want);
        fill_random(g, N, 1);
        float before[N];
        memcpy(before, p, sizeof p);
        double scale = t % 2 ? 1 : 8;
        float unscaled[N];
        memcpy(unscaled, g, sizeof g);
        for (int i = 0; i < N; i++) g[i] = (float)(g[i] * scale);   /* a "scaled loss": exact in f32 */
        ms_step_options so = { .grad_scale = t % 2 ? 0 : scale };
        int applied = -1;
        CHECK(ms_optimizer_step_with(opt, &so, &applied) == MS_OK && applied == 1, "step %d: %s", t, ms_last_error());
        CHECK(memcmp(g, unscaled, sizeof g) == 0, "step %d: the gradients were unscaled in place", t);
        double worst = 0;
        for (int i = 0; i < N; i++) {
            double expect = before[i] - want * unscaled[i];
            double err = fabs(p[i] - expect) / (1e-6 * (1 + fabs(expect)));
            if (!(err <= worst)) worst = err;
        }
        CHECK(worst <= 1, "step %d: SGD with grad_scale %g, worst error %.3g of the tolerance", t, scale, worst);
    }
    ms_optimizer_free(opt);
}

/* Least squares min ||X w + b - y||^2 / n, gradients computed here into the registered buffers. */
typedef struct lsq {
    int n, d;
    float *X, *y, *w, *b, *gw, *gb;
} lsq;

static void lsq_init(lsq *q, int n, int d)
{
    q->n = n, q->d = d;
    q->X = malloc(sizeof(float) * (size_t)(n * d));
    q->y = malloc(sizeof(float) * (size_t)n);
    q->w = calloc((size_t)d, sizeof(float));
    q->gw = calloc((size_t)d, sizeof(float));
    q->b = calloc(1, sizeof(float));
    q->gb = calloc(1, sizeof(float));
    fill_random(q->X, n * d, 1);
    float *w_true = malloc(sizeof(float) * (size_t)d);
    fill_random(w_true, d, 2);
    for (int i = 0; i < n; i++) {
        double s = 0.7;
        for (int j = 0; j < d; j++) s += (double)q->X[i * d + j] * w_true[j];
        q->y[i] = (float)(s + 0.01 * uniform());
    }
    free(w_true);
}

static void lsq_free(lsq *q)
{
    free(q->X); free(q->y); free(q->w); free(q->gw); free(q->b); free(q->gb);
}

/* the loss at the current parameters; gradients into gw, gb */
static double lsq_grad(lsq *q)
{
    double loss = 0, gb = 0;
    double *gw = calloc((size_t)q->d, sizeof(double));
    for (int i = 0; i < q->n; i++) {
        double r = q->b[0] - q->y[i];
        for (int j = 0; j < q->d; j++) r += (double)q->X[i * q->d + j] * q->w[j];
        loss += r * r;
        gb += 2 * r;
        for (int j = 0; j < q->d; j++) gw[j] += 2 * r * q->X[i * q->d + j];
    }
    for (int j = 0; j < q->d; j++) q->gw[j] = (float)(gw[j] / q->n);
    q->gb[0] = (float)(gb / q->n);
    free(gw);
    return loss / q->n;
}

static ms_optimizer *lsq_optimizer(lsq *q, const char *recipe, const char *options, const char *settings)
{
    ms_optimizer *opt = NULL;
    if (ms_optimizer_new(cpu, recipe, options, settings, &opt) != MS_OK) {
        CHECK(0, "new %s: %s", recipe, ms_last_error());
        return NULL;
    }
    int64_t sw[2] = { q->d, 1 }, sb[1] = { 1 };
    ms_tensor *w = wrap(q->w, 2, sw), *gw = wrap(q->gw, 2, sw), *b = wrap(q->b, 1, sb), *gb = wrap(q->gb, 1, sb);
    CHECK(ms_optimizer_add_param(opt, "proj.weight", w, gw, NULL) == MS_OK, "add w: %s", ms_last_error());
    CHECK(ms_optimizer_add_param(opt, "proj.bias", b, gb, "no_decay") == MS_OK, "add b: %s", ms_last_error());
    ms_tensor_free(w); ms_tensor_free(gw); ms_tensor_free(b); ms_tensor_free(gb);
    return opt;
}

static void test_training(void)
{
    lsq q;
    lsq_init(&q, 200, 16);
    ms_optimizer *opt = lsq_optimizer(&q, "adamw", "{\"lr\": 0.05, \"weight_decay\": 0}",
                                      "{\"schedule\": {\"kind\": \"cosine\", \"warmup_steps\": 10, \"total_steps\": 400}}");
    if (opt) {
        double first = lsq_grad(&q), loss = first;
        for (int t = 1; t <= 400; t++) {
            CHECK(ms_optimizer_step(opt) == MS_OK, "step %d: %s", t, ms_last_error());
            loss = lsq_grad(&q);
        }
        CHECK(loss < 1e-3 * first && loss < 1e-2, "least squares: loss %.3g -> %.3g after 400 AdamW steps", first, loss);
        char *info = NULL;
        CHECK(ms_optimizer_info(opt, &info) == MS_OK, "info: %s", ms_last_error());
        CHECK(contains(info, "\"recipe\":\"adamw\"") && contains(info, "\"name\":\"proj.weight\"") &&
              contains(info, "\"total_state_bytes\":136"), "info: %s", info);   /* 2 moments x 17 floats */
        ms_string_free(info);
        char *stats = NULL;
        CHECK(ms_optimizer_stats(opt, &stats) == MS_OK && contains(stats, "\"step\":400"), "stats: %s", stats);
        ms_string_free(stats);
        ms_optimizer_free(opt);
    }
    lsq_free(&q);
}

/* Two optimizers alive at once, each in its own Lua state, do not disturb each other. */
static void test_two_optimizers(void)
{
    lsq a, b;
    lsq_init(&a, 64, 8);
    rng_state = 0x9E3779B97F4A7C15ULL;
    lsq_init(&b, 64, 8);
    ms_optimizer *oa = lsq_optimizer(&a, "adamw", "{\"lr\": 0.05}", NULL);
    ms_optimizer *ob = lsq_optimizer(&b, "sgd", "{\"lr\": 0.05}", NULL);
    if (oa && ob) {
        double la0 = lsq_grad(&a), lb0 = lsq_grad(&b), la = la0, lb = lb0;
        for (int t = 0; t < 100; t++) {
            CHECK(ms_optimizer_step(oa) == MS_OK && ms_optimizer_step(ob) == MS_OK, "interleaved steps: %s", ms_last_error());
            la = lsq_grad(&a);
            lb = lsq_grad(&b);
        }
        CHECK(la < 0.1 * la0 && lb < 0.1 * lb0, "both train: %.3g -> %.3g, %.3g -> %.3g", la0, la, lb0, lb);
    }
    ms_optimizer_free(oa);
    ms_optimizer_free(ob);
    lsq_free(&a);
    lsq_free(&b);
}

/* --- checkpoints ------------------------------------------------------------------------------------ */

static void corrupt_copy(const char *src, const char *dst, long at, int truncate)
{
    FILE *f = fopen(src, "rb");
    CHECK(f != NULL, "open %s", src);
    if (!f) return;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n);
    CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n, "read %s", src);
    fclose(f);
    if (at >= 0 && at < n) buf[at] ^= 0x5a;
    FILE *o = fopen(dst, "wb");
    if (o) { fwrite(buf, 1, (size_t)(truncate ? n / 2 : n), o); fclose(o); }
    free(buf);
}

static void test_save_load(void)
{
    char ck[128], bad[128], other[128];
    path_in_dir(ck, sizeof ck, "opt.safetensors");
    path_in_dir(bad, sizeof bad, "bad.safetensors");
    path_in_dir(other, sizeof other, "sgd.safetensors");
    lsq a, b;
    rng_state = 0x1234567ULL;
    lsq_init(&a, 64, 8);
    rng_state = 0x1234567ULL;
    lsq_init(&b, 64, 8);      /* the same problem: b resumes what a saved */
    const char *options = "{\"lr\": 0.03, \"weight_decay\": 0.01}";
    const char *settings = "{\"schedule\": {\"kind\": \"linear_warmup\", \"warmup_steps\": 20}}";
    ms_optimizer *oa = lsq_optimizer(&a, "adamw", options, settings);
    ms_optimizer *ob = lsq_optimizer(&b, "adamw", options, settings);
    if (!oa || !ob) goto done;
    for (int t = 0; t < 7; t++) { lsq_grad(&a); CHECK(ms_optimizer_step(oa) == MS_OK, "a: %s", ms_last_error()); }
    CHECK(ms_optimizer_save(oa, ck) == MS_OK, "save: %s", ms_last_error());
    memcpy(b.w, a.w, sizeof(float) * 8);            /* the weights are the trainer's to save */
    b.b[0] = a.b[0];

    /* failed loads change nothing */
    CHECK(ms_optimizer_load(ob, "/nonexistent/opt.safetensors") == MS_E_IO, "missing file: %s", ms_last_error());
    CHECK(contains(ms_last_error(), "/nonexistent/opt.safetensors"), "message: %s", ms_last_error());
    {   /* nor do they start the optimizer: parameters may still be added */
        float p[2] = { 1, 2 }, g[2] = { 0.5f, 0.5f }, q[2] = { 3, 4 };
        int64_t s2[1] = { 2 };
        ms_optimizer *ol = make_opt("adamw", NULL, NULL, "w", p, g, 2);
        if (ol) {
            CHECK(ms_optimizer_load(ol, "/nonexistent/opt.safetensors") == MS_E_IO, "missing file: %s", ms_last_error());
            ms_tensor *tq = wrap(q, 1, s2);
            CHECK(ms_optimizer_add_param(ol, "q", tq, NULL, NULL) == MS_OK, "add after a failed load: %s",
                  ms_last_error());
            ms_tensor_free(tq);
            ms_optimizer_free(ol);
        }
    }
    corrupt_copy(ck, bad, -1, 1);
    ms_status st = ms_optimizer_load(ob, bad);
    CHECK(st == MS_E_FORMAT, "truncated checkpoint: %s %s", ms_status_name(st), ms_last_error());
    corrupt_copy(ck, bad, 3, 0);                     /* the header length */
    st = ms_optimizer_load(ob, bad);
    CHECK(st == MS_E_FORMAT, "corrupt header length: %s %s", ms_status_name(st), ms_last_error());
    corrupt_copy(ck, bad, 12, 0);                    /* inside the JSON header */
    st = ms_optimizer_load(ob, bad);
    CHECK(st == MS_E_FORMAT, "corrupt header: %s %s", ms_status_name(st), ms_last_error());
    write_file(bad, "not a checkpoint at all");
    CHECK(ms_optimizer_load(ob, bad) == MS_E_FORMAT, "text file: %s", ms_last_error());
    {   /* a checkpoint of another recipe */
        float p[1] = { 1 }, g[1] = { 0.5f };
        ms_optimizer *os = make_opt("sgd", NULL, NULL, "proj.weight", p, g, 1);
        if (os) {
            CHECK(ms_optimizer_step(os) == MS_OK && ms_optimizer_save(os, other) == MS_OK, "sgd save: %s", ms_last_error());
            st = ms_optimizer_load(ob, other);
            CHECK(st == MS_E_FORMAT && contains(ms_last_error(), "recipe 'sgd'") &&
                      contains(ms_last_error(), "ms_optimizer_load takes only checkpoints of the recipe it runs") &&
                      !contains(ms_last_error(), "force"), "other recipe: %s %s", ms_status_name(st), ms_last_error());
            ms_optimizer_free(os);
        }
    }
    {   /* a readable checkpoint that does not load (corrupt, another recipe's) does not start the optimizer either */
        float p[2] = { 1, 2 }, g[2] = { 0.5f, 0.5f }, q[2] = { 3, 4 };
        int64_t s2[1] = { 2 };
        ms_optimizer *ol = make_opt("adamw", NULL, NULL, "w", p, g, 2);
        if (ol) {
            CHECK(ms_optimizer_load(ol, bad) == MS_E_FORMAT, "text file: %s", ms_last_error());
            CHECK(ms_optimizer_load(ol, other) == MS_E_FORMAT, "other recipe: %s", ms_last_error());
            ms_tensor *tq = wrap(q, 1, s2);
            CHECK(ms_optimizer_add_param(ol, "q", tq, NULL, NULL) == MS_OK, "add after a refused load: %s",
                  ms_last_error());
            ms_tensor_free(tq);
            CHECK(ms_optimizer_step(ol) == MS_OK, "step after a refused load: %s", ms_last_error());
            ms_optimizer_free(ol);
        }
    }
    CHECK(ms_optimizer_load(ob, ck) == MS_OK, "load: %s", ms_last_error());
    double la = 0, lb = 0;
    CHECK(ms_optimizer_get_lr(oa, &la) == MS_OK && ms_optimizer_get_lr(ob, &lb) == MS_OK && la == lb,
          "the schedule resumes: %g vs %g", la, lb);
    for (int t = 0; t < 15; t++) {
        lsq_grad(&a);
        lsq_grad(&b);
        CHECK(ms_optimizer_step(oa) == MS_OK && ms_optimizer_step(ob) == MS_OK, "resumed steps: %s", ms_last_error());
    }
    CHECK(memcmp(a.w, b.w, sizeof(float) * 8) == 0 && a.b[0] == b.b[0], "resumed bit for bit");
done:
    ms_optimizer_free(oa);
    ms_optimizer_free(ob);
    lsq_free(&a);
    lsq_free(&b);
    unlink(ck);
    unlink(bad);
    unlink(other);
}


/* --- several ranks ----------------------------------------------------------------------------------- */

/* A generator of its own per seed, so that every process makes the same full tensors. */
static void fill_seeded(float *x, int n, uint64_t seed, double scale)
{
    uint64_t s = (seed + 1) * 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = (float)(scale * ((double)(s >> 11) * 0x1p-53 * 2.0 - 1.0));
    }
}

static void test_comm_and_shard_errors(void)
{
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_set_comm(NULL, NULL) == MS_E_ARG && contains(ms_last_error(), "opt is NULL"),
          "set_comm(NULL): %s", ms_last_error());
    CHECK(ms_optimizer_add_param_sharded(NULL, "w", NULL, NULL, NULL, NULL) == MS_E_ARG, "add_param_sharded(NULL)");
    ms_status st = ms_optimizer_new(cpu, "sinkgd", NULL, "{\"comm\": 2}", &opt);
    CHECK(st == MS_E_ARG && opt == NULL && contains(ms_last_error(), "setting 'comm'") &&
          contains(ms_last_error(), "ms_optimizer_set_comm"), "comm in the settings: %s %s", ms_status_name(st),
          ms_last_error());

    CHECK(ms_optimizer_new(cpu, "sinkgd", NULL, NULL, &opt) == MS_OK, "sinkgd: %s", ms_last_error());
    if (opt == NULL) return;
    CHECK(ms_optimizer_set_comm(opt, NULL) == MS_OK, "set_comm(opt, NULL): %s", ms_last_error());
    /* a world of one on the optimizer's context is accepted; one on another context (even of the same device) is
    ** not: the collectives would be queued apart from the step */
    ms_ctx *other = NULL;
    ms_comm *mine = NULL, *theirs = NULL;
    ms_comm_options one = { .rank = 0, .world_size = 1 };
    CHECK(ms_ctx_new("cpu", NULL, &other) == MS_OK && ms_comm_new(cpu, &one, &mine) == MS_OK &&
          ms_comm_new(other, &one, &theirs) == MS_OK, "worlds of one: %s", ms_last_error());
    st = ms_optimizer_set_comm(opt, theirs);
    CHECK(st == MS_E_DEVICE && contains(ms_last_error(), "the communicator was made on another context"),
          "a comm of another context: %s %s", ms_status_name(st), ms_last_error());
    CHECK(ms_optimizer_set_comm(opt, mine) == MS_OK, "a comm of the optimizer's context: %s", ms_last_error());
    float w[24], g[24], b[6];
    fill_random(w, 24, 1);
    fill_random(g, 24, 1);
    fill_random(b, 6, 1);
    int64_t s46[2] = { 4, 6 }, s6[1] = { 6 };
    ms_tensor *tw = wrap(w, 2, s46), *tg = wrap(g, 2, s46), *tb = wrap(b, 1, s6);
    struct { ms_shard shard; ms_tensor *param; const char *needle; } bad[] = {
        { { (ms_shard_dim)7, 0, 8 }, tw, "shard dim 7 is none of MS_SHARD_NONE" },
        { { MS_SHARD_ROWS, 0, 8 }, tb, "a param of shape [6] has no rows to shard" },
        { { MS_SHARD_COLS, 0, 6 }, tb, "a param of shape [6] has no columns to shard" },
        { { MS_SHARD_ROWS, -1, 8 }, tw, "rows [-1, 3) held here do not lie within the global [0, 8)" },
        { { MS_SHARD_ROWS, 5, 8 }, tw, "rows [5, 9) held here do not lie within the global [0, 8)" },
        { { MS_SHARD_COLS, 0, 5 }, tw, "columns [0, 6) held here do not lie within the global [0, 5)" },
        { { MS_SHARD_COLS, 0, 0 }, tw, "columns [0, 6) held here do not lie within the global [0, 0)" },
        /* offset + the slice's size passes INT64_MAX: the message must not compute it (signed overflow) */
        { { MS_SHARD_ROWS, INT64_MAX, 8 }, tw, "rows [9223372036854775807, 9223372036854775807 + 4) held here" },
        /* the runtime's Lua holds offsets and sizes as doubles: past 2^53 they would be rounded */
        { { MS_SHARD_ROWS, 0, ((int64_t)1 << 53) + 1 }, tw, "a global size of 9007199254740993 rows is past 2^53" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        st = ms_optimizer_add_param_sharded(opt, "w", bad[i].param, NULL, NULL, &bad[i].shard);
        CHECK(st == MS_E_ARG && contains(ms_last_error(), bad[i].needle) && contains(ms_last_error(), "'w'"),
              "bad shard %zu: %s %s", i, ms_status_name(st), ms_last_error());
    }
    ms_shard rows = { MS_SHARD_ROWS, 4, 8 }, none = { MS_SHARD_NONE, 3, 1 };
    st = ms_optimizer_add_param_sharded(opt, "w", tw, tb, NULL, &rows);
    CHECK(st == MS_E_SHAPE && contains(ms_last_error(), "grad shape [6] != param shape [4,6]"), "grad of another "
          "shape: %s %s", ms_status_name(st), ms_last_error());
    /* the checks refused everything above: "w" is still free */
    CHECK(ms_optimizer_add_param_sharded(opt, "w", tw, tg, "sinkgd", NULL) == MS_OK, "NULL shard: %s", ms_last_error());
    CHECK(ms_optimizer_add_param_sharded(opt, "b", tb, NULL, NULL, &none) == MS_OK, "MS_SHARD_NONE (its offset "
          "and global unused): %s", ms_last_error());
    CHECK(ms_optimizer_add_param_sharded(opt, "b", tb, NULL, NULL, &none) == MS_E_ARG &&
          contains(ms_last_error(), "duplicate parameter name 'b'"), "duplicate: %s", ms_last_error());
    char *info = NULL;
    CHECK(ms_optimizer_info(opt, &info) == MS_OK, "info: %s", ms_last_error());   /* starts the optimizer */
    ms_string_free(info);
    st = ms_optimizer_add_param_sharded(opt, "v", tw, NULL, NULL, &rows);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "has started"), "sharded param after the start: %s",
          ms_last_error());
    st = ms_optimizer_set_comm(opt, NULL);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "has started") && contains(ms_last_error(), "communicator"),
          "set_comm after the start: %s", ms_last_error());
    CHECK(ms_optimizer_step(opt) == MS_OK, "the optimizer still steps: %s", ms_last_error());
    ms_optimizer_free(opt);
    ms_comm_free(mine);       /* after the optimizer that used it */
    ms_comm_free(theirs);
    ms_ctx_free(other);

    /* a slice that is not the whole parameter, with no other rank to hold the rest: refused when the optimizer
    ** starts, naming the parameter, and nothing is updated */
    float before[24];
    memcpy(before, w, sizeof w);
    CHECK(ms_optimizer_new(cpu, "sinkgd", NULL, NULL, &opt) == MS_OK, "sinkgd: %s", ms_last_error());
    CHECK(ms_optimizer_add_param_sharded(opt, "half", tw, tg, NULL, &rows) == MS_OK, "rows [4, 8): %s",
          ms_last_error());
    st = ms_optimizer_step(opt);
    CHECK(st != MS_OK && contains(ms_last_error(), "half"), "a partial slice on one rank: %s %s", ms_status_name(st),
          ms_last_error());
    CHECK(memcmp(before, w, sizeof w) == 0, "the refused step changed nothing");
    ms_optimizer_free(opt);
    ms_tensor_free(tw);
    ms_tensor_free(tg);
    ms_tensor_free(tb);
}

/* The distributed problem: every param's full values, and each rank's slice of it. */
enum { DIST_PARAMS = 5, DIST_STEPS = 3, DIST_MAX = 64 };
typedef struct dist_param {
    const char  *name;
    int          ndim;
    int64_t      shape[3];
    ms_shard_dim dim;
    int64_t      split;       /* rank 0 holds [0, split) of the sharded dim, rank 1 the rest */
} dist_param;

static const dist_param dist_params[DIST_PARAMS] = {
    { "a.weight", 2, { 8, 6 }, MS_SHARD_ROWS, 5 },        /* uneven rows */
    { "b.weight", 2, { 6, 10 }, MS_SHARD_COLS, 4 },       /* columns */
    { "c.weight", 2, { 4, 4 }, MS_SHARD_NONE, 0 },        /* whole on every rank: one owner updates it */
    { "c.bias", 1, { 6 }, MS_SHARD_NONE, 0 },             /* AdamW, owned */
    { "d.weight", 3, { 2, 3, 5 }, MS_SHARD_ROWS, 1 },     /* a stack, rows of each matrix */
};
static const char *dist_options = "{\"lr\": 0.05, \"sinkgd_lr_scale\": 1, \"sinkgd_spectral_norm\": true, "
                                  "\"adamw_state\": \"f32\"}";

static int64_t numel_of(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

/* rank's slice (rank -1: the whole) of param k's full values `full` into out; its shape into shape. */
static int64_t dist_slice(const dist_param *d, int rank, const float *full, float *out, int64_t *shape)
{
    memcpy(shape, d->shape, sizeof d->shape);
    if (rank < 0 || d->dim == MS_SHARD_NONE) {
        int64_t n = numel_of(d->ndim, d->shape);
        memcpy(out, full, (size_t)n * sizeof *out);
        return n;
    }
    int axis = d->ndim - (d->dim == MS_SHARD_ROWS ? 2 : 1);
    int64_t lo = rank == 0 ? 0 : d->split, hi = rank == 0 ? d->split : d->shape[axis];
    shape[axis] = hi - lo;
    int64_t outer = 1, inner = 1;       /* full = [outer, shape[axis], inner] */
    for (int i = 0; i < axis; i++) outer *= d->shape[i];
    for (int i = axis + 1; i < d->ndim; i++) inner *= d->shape[i];
    int64_t n = 0;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t j = lo; j < hi; j++)
            for (int64_t i = 0; i < inner; i++) out[n++] = full[(o * d->shape[axis] + j) * inner + i];
    return n;
}

/* Runs the problem as `rank` of 2 (comm given) or alone (rank -1, comm NULL): params[k] <- the final slices. */
static bool dist_run(int rank, ms_comm *comm, float params[DIST_PARAMS][DIST_MAX])
{
    ms_optimizer *opt = NULL;
    ms_status st = ms_optimizer_new(cpu, "sinkgd", dist_options, NULL, &opt);
    CHECK(st == MS_OK, "rank %d: new: %s", rank, ms_last_error());
    if (st != MS_OK) return false;
    if (comm) CHECK((st = ms_optimizer_set_comm(opt, comm)) == MS_OK, "rank %d: set_comm: %s", rank, ms_last_error());
    static float grads[DIST_PARAMS][DIST_MAX];
    float full[DIST_MAX];
    int64_t n[DIST_PARAMS];
    for (int k = 0; st == MS_OK && k < DIST_PARAMS; k++) {
        const dist_param *d = &dist_params[k];
        int64_t shape[3];
        fill_seeded(full, (int)numel_of(d->ndim, d->shape), 1000 + k, 1);
        n[k] = dist_slice(d, rank, full, params[k], shape);
        ms_tensor *tp = NULL, *tg = NULL;
        st = ms_tensor_wrap(cpu, params[k], MS_DTYPE_F32, d->ndim, shape, NULL, &tp);
        if (st == MS_OK) st = ms_tensor_wrap(cpu, grads[k], MS_DTYPE_F32, d->ndim, shape, NULL, &tg);
        int axis = d->ndim - (d->dim == MS_SHARD_ROWS ? 2 : 1);
        ms_shard shard = { rank < 0 ? MS_SHARD_NONE : d->dim, rank == 1 ? d->split : 0, d->shape[axis] };
        if (st == MS_OK) st = ms_optimizer_add_param_sharded(opt, d->name, tp, tg, NULL, &shard);
        CHECK(st == MS_OK, "rank %d: add %s: %s", rank, d->name, ms_last_error());
        ms_tensor_free(tp);
        ms_tensor_free(tg);
    }
    for (int s = 1; st == MS_OK && s <= DIST_STEPS; s++) {
        for (int k = 0; k < DIST_PARAMS; k++) {
            int64_t shape[3];
            fill_seeded(full, (int)numel_of(dist_params[k].ndim, dist_params[k].shape), 100 * s + k, 0.5);
            dist_slice(&dist_params[k], rank, full, grads[k], shape);
        }
        st = ms_optimizer_step(opt);
        CHECK(st == MS_OK, "rank %d: step %d: %s", rank, s, ms_last_error());
    }
    ms_optimizer_free(opt);
    for (int k = 0; st == MS_OK && k < DIST_PARAMS; k++)
        for (int64_t i = 0; i < n[k]; i++)
            if (!isfinite(params[k][i])) st = MS_E_ARG;
    CHECK(st == MS_OK, "rank %d: finite results", rank);
    return st == MS_OK;
}

/* info's lists stay JSON arrays when empty: a 0-dim parameter's shape, an optimizer with no parameters (a
** Lua table cannot tell [] from {}, and Python read them as dicts) */
static void test_info_arrays(void)
{
    ms_optimizer *opt = NULL;
    char *info = NULL;
    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, &opt) == MS_OK && ms_optimizer_info(opt, &info) == MS_OK,
          "info with no parameters: %s", ms_last_error());
    CHECK(contains(info, "\"params\":[]") && contains(info, "\"groups\":[]"), "empty lists: %s", info);
    ms_string_free(info);
    ms_optimizer_free(opt);
    float s = 0.5f, gs = 0.25f;
    ms_tensor *ts = NULL, *tgs = NULL;
    CHECK(ms_tensor_wrap(cpu, &s, MS_DTYPE_F32, 0, NULL, NULL, &ts) == MS_OK &&
          ms_tensor_wrap(cpu, &gs, MS_DTYPE_F32, 0, NULL, NULL, &tgs) == MS_OK, "0-dim: %s", ms_last_error());
    info = NULL;
    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, &opt) == MS_OK &&
          ms_optimizer_add_param(opt, "scale", ts, tgs, NULL) == MS_OK && ms_optimizer_info(opt, &info) == MS_OK,
          "info with a 0-dim parameter: %s", ms_last_error());
    CHECK(contains(info, "\"shape\":[]") && !contains(info, "\"shape\":{}"), "a 0-dim shape: %s", info);
    ms_string_free(info);
    ms_optimizer_free(opt);
    ms_tensor_free(ts);
    ms_tensor_free(tgs);
}

/* One rank of the two (this program, started by test_two_ranks): its slices into dir/rank<r>.bin. */
static int dist_rank_main(const char *out_dir)
{
    int rank = atoi(getenv("RANK"));
    ms_comm *comm = NULL;
    ms_status st = ms_comm_new_from_env(cpu, 20000, &comm);
    CHECK(st == MS_OK && ms_comm_size(comm) == 2 && ms_comm_rank(comm) == rank, "rank %d: comm from the environment: "
          "%s", rank, ms_last_error());
    if (st != MS_OK) return CHECK_REPORT();
    static float params[DIST_PARAMS][DIST_MAX];
    if (dist_run(rank, comm, params)) {
        char path[128];
        snprintf(path, sizeof path, "%s/rank%d.bin", out_dir, rank);
        FILE *f = fopen(path, "wb");
        CHECK(f && fwrite(params, sizeof params, 1, f) == 1, "rank %d: write %s", rank, path);
        if (f) fclose(f);
    }
    float p[12], g[12];
    fill_random(p, 12, 1);
    fill_random(g, 12, 1);
    int64_t s34[2] = { 3, 4 };
    ms_tensor *tp = wrap(p, 2, s34), *tg = wrap(g, 2, s34);
    /* a checkpoint that one rank cannot read: every rank refuses the load, none waits on a vote the other never
    ** joins, and the world still steps together afterwards */
    char ck[160];
    snprintf(ck, sizeof ck, "%s/replicated.safetensors", out_dir);
    ms_optimizer *saver = NULL, *loader = NULL;
    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, &saver) == MS_OK && ms_optimizer_set_comm(saver, comm) == MS_OK &&
          ms_optimizer_add_param(saver, "w", tp, tg, NULL) == MS_OK && ms_optimizer_step(saver) == MS_OK &&
          ms_optimizer_save(saver, ck) == MS_OK, "rank %d: a checkpoint to load: %s", rank, ms_last_error());
    ms_optimizer_free(saver);
    CHECK(ms_optimizer_new(cpu, "adamw", NULL, NULL, &loader) == MS_OK && ms_optimizer_set_comm(loader, comm) == MS_OK &&
          ms_optimizer_add_param(loader, "w", tp, tg, NULL) == MS_OK, "rank %d: %s", rank, ms_last_error());
    st = ms_optimizer_load(loader, rank == 0 ? "/nonexistent/replicated.safetensors" : ck);
    CHECK(st != MS_OK && (rank == 0 ? contains(ms_last_error(), "/nonexistent/")
                                    : contains(ms_last_error(), "1 of the 2 ranks cannot load it")),
          "rank %d: a load rank 0 cannot read: %s %s", rank, ms_status_name(st), ms_last_error());
    CHECK(ms_optimizer_step(loader) == MS_OK, "rank %d: the world steps after the refused load: %s", rank, ms_last_error());
    ms_optimizer_free(loader);
    /* slices that overlap (rows [0, 3) of 4 on both ranks): both ranks refuse at the start, naming it */
    ms_shard overlap = { MS_SHARD_ROWS, 0, 4 };
    ms_optimizer *opt = NULL;
    CHECK(ms_optimizer_new(cpu, "sinkgd", NULL, NULL, &opt) == MS_OK && ms_optimizer_set_comm(opt, comm) == MS_OK &&
          ms_optimizer_add_param_sharded(opt, "overlapping", tp, tg, NULL, &overlap) == MS_OK, "rank %d: %s", rank,
          ms_last_error());
    st = ms_optimizer_step(opt);
    CHECK(st != MS_OK && contains(ms_last_error(), "overlapping"), "rank %d: overlapping slices: %s %s", rank,
          ms_status_name(st), ms_last_error());
    ms_optimizer_free(opt);
    ms_tensor_free(tp);
    ms_tensor_free(tg);
    ms_comm_free(comm);
    printf("rank %d: ", rank);
    return CHECK_REPORT();
}

/* A free TCP port on 127.0.0.1 (0 when there is none). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

extern char **environ;

/* Two ranks on the CPU's communicator (this program again, as `moonstep launch` would start it), against
** one optimizer on the whole tensors here. */
static void test_two_ranks(void)
{
    int port = free_port();
    CHECK(port > 0, "a free port");
    if (port <= 0) return;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", port_s, 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MS_TEST_EMBED_RANK_DIR", dir, 1);
    pid_t pid[2] = { -1, -1 };
    for (int r = 0; r < 2; r++) {
        char rank_s[4];
        snprintf(rank_s, sizeof rank_s, "%d", r);
        setenv("RANK", rank_s, 1);
        setenv("LOCAL_RANK", rank_s, 1);
        char *argv[] = { "test_embed", NULL };
        CHECK(posix_spawn(&pid[r], "/proc/self/exe", NULL, NULL, argv, environ) == 0, "start rank %d", r);
    }
    const char *vars[] = { "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MS_TEST_EMBED_RANK_DIR" };
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    /* the ranks' communicator times out after 20 s; a rank still running at 60 s is hung */
    int status[2] = { -1, -1 };
    for (int tick = 0, left = 2; left > 0 && tick < 600; tick++) {
        for (int r = 0; r < 2; r++)
            if (pid[r] > 0 && status[r] == -1 && waitpid(pid[r], &status[r], WNOHANG) == 0) status[r] = -1;
        left = (status[0] == -1 && pid[0] > 0) + (status[1] == -1 && pid[1] > 0);
        if (left) nanosleep(&(struct timespec){ .tv_nsec = 100000000 }, NULL);
    }
    for (int r = 0; r < 2; r++) {
        if (pid[r] > 0 && status[r] == -1) {
            kill(pid[r], SIGKILL);
            waitpid(pid[r], NULL, 0);
        }
        CHECK(status[r] != -1 && WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0, "rank %d: %s %d", r,
              status[r] == -1 ? "still running after 60 s, killed" : WIFEXITED(status[r]) ? "exit status" : "signal",
              status[r] == -1 ? 0 : WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : WTERMSIG(status[r]));
    }

    static float want[DIST_PARAMS][DIST_MAX], got[2][DIST_PARAMS][DIST_MAX];
    if (!dist_run(-1, NULL, want)) return;
    for (int r = 0; r < 2; r++) {
        char path[128];
        snprintf(path, sizeof path, "%s/rank%d.bin", dir, r);
        FILE *f = fopen(path, "rb");
        CHECK(f && fread(got[r], sizeof got[r], 1, f) == 1, "read %s", path);
        if (f) fclose(f);
        unlink(path);
        if (!f) return;
    }
    for (int k = 0; k < DIST_PARAMS; k++) {
        const dist_param *d = &dist_params[k];
        float want_slice[DIST_MAX], before[DIST_MAX];
        int64_t shape[3];
        fill_seeded(before, (int)numel_of(d->ndim, d->shape), 1000 + k, 1);
        for (int r = 0; r < 2; r++) {
            int64_t n = dist_slice(d, r, want[k], want_slice, shape);
            float start[DIST_MAX];
            dist_slice(d, r, before, start, shape);
            double worst = 0;
            int moved = 0;
            for (int64_t i = 0; i < n; i++) {
                double err = fabs((double)got[r][k][i] - want_slice[i]) / (1e-6 + 1e-5 * fabs(want_slice[i]));
                worst = err > worst || err != err ? err : worst;
                moved += got[r][k][i] != start[i];
            }
            CHECK(worst <= 1, "%s on rank %d: %.3g times the tolerance from one optimizer on the whole", d->name, r,
                  worst);
            CHECK(moved == n, "%s on rank %d: %d of %lld elements moved", d->name, r, moved, (long long)n);
        }
    }
}

/* --- out of memory in the Lua state ----------------------------------------------------------------- */

/* Bytes of address space this process has mapped now (/proc/self/statm's first field, in pages); -1 if unknown. */
static long long mapped_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long long pages = -1;
    if (f && fscanf(f, "%lld", &pages) != 1) pages = -1;
    if (f) fclose(f);
    return pages < 0 ? -1 : pages * sysconf(_SC_PAGESIZE);
}

/* Caps the address space at what is mapped now plus room; room < 0 lifts the cap again. */
static int cap_address_space(long long room)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_AS, &r) != 0) return -1;
    long long now = mapped_bytes();
    if (room >= 0 && now < 0) return -1;
    r.rlim_cur = room < 0 ? r.rlim_max : (rlim_t)(now + room);
    return setrlimit(RLIMIT_AS, &r);
}

enum { HUGE_STRING = 256 << 20, LUA_ROOM = 96 << 20 };

/* This program started again by test_lua_out_of_memory: the calls that made a string in the optimizer's Lua state
** outside lua_pcall (a parameter's name, a path, the recipe), given one too large for the address space left.
** LuaJIT's panic on that ended the process (exit status 1); now each is MS_E_OOM and nothing leaks. */
static int lua_oom_main(void)
{
    char *huge = malloc((size_t)HUGE_STRING + 1);
    if (huge == NULL) { printf("lua oom: no memory for the string\n"); return 1; }
    memset(huge, 'n', HUGE_STRING);
    huge[HUGE_STRING] = '\0';
    ms_ctx *own = NULL;   /* a context of its own, whose bytes_in_use shows whether a handle leaked */
    CHECK(ms_ctx_new("cpu", NULL, &own) == MS_OK, "lua oom: a second CPU context: %s", ms_last_error());
    int64_t s4[1] = { 4 };
    ms_tensor *p = NULL, *g = NULL;
    CHECK(ms_tensor_new(own, MS_DTYPE_F32, 1, s4, &p) == MS_OK && ms_tensor_new(own, MS_DTYPE_F32, 1, s4, &g) == MS_OK &&
          ms_fill(own, p, 1, NULL) == MS_OK && ms_fill(own, g, 0.5, NULL) == MS_OK, "lua oom: tensors: %s", ms_last_error());
    ms_optimizer *opt = NULL, *other = (ms_optimizer *)0x1;
    CHECK(ms_optimizer_new(cpu, "adamw", "{\"lr\": 0.1}", NULL, &opt) == MS_OK, "lua oom: adamw: %s", ms_last_error());
    if (opt == NULL || p == NULL || g == NULL) return CHECK_REPORT();

    CHECK(cap_address_space(LUA_ROOM) == 0, "lua oom: cap the address space");
    static const struct { const char *fn; int which; } calls[] = {
        { "ms_optimizer_add_param", 0 }, { "ms_optimizer_add_param_sharded", 1 }, { "ms_optimizer_set_grad", 2 },
        { "ms_optimizer_save", 3 }, { "ms_optimizer_load", 4 },
    };
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        ms_shard rows = { .dim = MS_SHARD_ROWS, .offset = 0, .global = 4 };
        int64_t s22[2] = { 2, 2 };
        ms_tensor *p2 = NULL, *g2 = NULL;
        ms_status st;
        switch (calls[i].which) {
        case 0: st = ms_optimizer_add_param(opt, huge, p, g, NULL); break;
        case 1:
            ms_tensor_reshape(own, p, 2, s22, &p2);
            ms_tensor_reshape(own, g, 2, s22, &g2);
            st = ms_optimizer_add_param_sharded(opt, "w", p2, g2, huge, &rows);   /* the tags */
            break;
        case 2: st = ms_optimizer_set_grad(opt, huge, g); break;
        case 3: st = ms_optimizer_save(opt, huge); break;
        default: st = ms_optimizer_load(opt, huge); break;
        }
        ms_tensor_free(p2);
        ms_tensor_free(g2);
        char want[160];
        snprintf(want, sizeof want, "%s: the optimizer's Lua state is out of memory", calls[i].fn);
        CHECK(st == MS_E_OOM && strncmp(ms_last_error(), want, strlen(want)) == 0, "lua oom: %s: %s %s", calls[i].fn,
              ms_status_name(st), ms_last_error());
    }
    /* the recipe's name is made after the modules are loaded (within the room): the message says which failed */
    ms_status st = ms_optimizer_new(cpu, huge, NULL, NULL, &other);
    static const char new_oom[] = "ms_optimizer_new: the optimizer's Lua state is out of memory";
    CHECK(st == MS_E_OOM && other == NULL && strncmp(ms_last_error(), new_oom, sizeof new_oom - 1) == 0,
          "lua oom: ms_optimizer_new with a huge recipe name: %s %s", ms_status_name(st), ms_last_error());
    CHECK(cap_address_space(-1) == 0, "lua oom: lift the cap");

    /* the optimizer goes on: a parameter and a step */
    CHECK(ms_optimizer_add_param(opt, "w", p, g, NULL) == MS_OK && ms_optimizer_step(opt) == MS_OK,
          "lua oom: afterwards, add_param and step: %s", ms_last_error());
    float after[4] = { 0 };
    ms_tensor_read(own, p, after, sizeof after);
    CHECK(after[0] < 1 && after[3] < 1, "lua oom: the step moved the param (%g)", after[0]);
    ms_optimizer_free(opt);
    ms_tensor_free(p);
    ms_tensor_free(g);
    ms_mem_stats ms;
    CHECK(ms_ctx_mem_stats(own, &ms) == MS_OK && ms.bytes_in_use == 0, "lua oom: %lld bytes still held (a handle "
          "made for a call that was not made leaked)", (long long)ms.bytes_in_use);
    ms_ctx_free(own);
    free(huge);
    printf("lua oom: ");
    return CHECK_REPORT();
}

static void test_lua_out_of_memory(void)
{
#if defined(__SANITIZE_ADDRESS__)
    printf("skip: the Lua out-of-memory test caps the address space, which AddressSanitizer's shadow memory needs\n");
#else
    setenv("MS_TEST_EMBED_LUA_OOM", "1", 1);
    char *argv[] = { "test_embed", NULL };
    pid_t pid = -1;
    fflush(stdout);
    CHECK(posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ) == 0, "start the lua oom process");
    unsetenv("MS_TEST_EMBED_LUA_OOM");
    int status = -1;
    if (pid > 0) waitpid(pid, &status, 0);
    CHECK(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "lua oom: %s %d (1: LuaJIT's panic ended it)",
          WIFEXITED(status) ? "exit status" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
#endif
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/ms_embed_XXXXXX");
    if (mkdtemp(dir) == NULL) { printf("cannot make a temporary folder\n0 passed, 1 failed\n"); return 1; }
    if (ms_ctx_new("cpu", NULL, &cpu) != MS_OK) { printf("cpu context: %s\n0 passed, 1 failed\n", ms_last_error()); return 1; }
    const char *rank_dir = getenv("MS_TEST_EMBED_RANK_DIR");
    if (rank_dir) {                   /* one of test_two_ranks's ranks */
        rmdir(dir);
        int rc = dist_rank_main(rank_dir);
        ms_ctx_free(cpu);
        return rc;
    }
    if (getenv("MS_TEST_EMBED_LUA_OOM")) {   /* test_lua_out_of_memory's process */
        rmdir(dir);
        int rc = lua_oom_main();
        ms_ctx_free(cpu);
        return rc;
    }
    test_null_arguments();
    test_bad_json();
    test_bad_options_and_settings();
    test_unknown_recipes();
    test_parameter_errors();
    test_tied_and_unwritable_grads();
    test_shared_memory_refused_when_given();
    test_recipe_error_mid_step();
    test_info_arrays();
    test_nonfinite();
    test_capture_on_cpu();
    test_adamw_matches_formula();
    test_schedule_and_grad_scale();
    test_training();
    test_two_optimizers();
    test_save_load();
    test_prepare_replay_on_cpu();
    test_comm_and_shard_errors();
    test_two_ranks();
    test_lua_out_of_memory();
    ms_ctx *probe = NULL;
    cudart rt;
    if (ms_ctx_new("cuda", NULL, &probe) != MS_OK) {
        printf("skip: the trainer-graph tests need a GPU (%s)\n", ms_last_error());
    } else if (!load_cudart(&rt)) {
        CHECK(0, "the CUDA runtime's graph calls are not in the process (libmoonstep links libcudart)");
    } else {
        test_trainer_graph(&rt, "adamw");
        test_trainer_graph(&rt, "sinkgd");
    }
    ms_ctx_free(probe);
    ms_ctx_free(cpu);
    const char *names[] = { "syntax.lua", "number.lua", "escape.lua", "fails.lua" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char p[128];
        unlink(path_in_dir(p, sizeof p, names[i]));
    }
    rmdir(dir);
    return CHECK_REPORT();
}
