/*
** The embedding API (moonstep.h, "Embedding"): an optimizer for a C trainer.  Each ms_optimizer owns a
** LuaJIT state running the moonstep Lua modules and drives lua/moonstep/embed.lua, which runs the recipe
** through ms.optim.  This is the only code below the ABI that knows Lua exists.
** Every call into Lua is protected: a Lua error becomes a status and a message, never a longjmp out.  So is
** every Lua API call that can raise (out of memory making a string, a table or a reference): unprotected,
** LuaJIT would panic and end the host process.
*/
#include "internal.h"
#include "json.h"

#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

struct ms_optimizer {
    lua_State *L;
    ms_ctx    *ctx;       /* the caller's context; the Lua side holds the optimizer's reference to it */
    int        handler;   /* registry references: moonstep.embed's message handler, */
    int        object;    /* this optimizer's Lua object, */
    int        pusher;    /* and push_string_raw */
    bool       push_failed;   /* an argument of the call being prepared could not be made (see push_string) */
    /* A captured step the next ms_optimizer_step may replay without entering Lua (moonstep.embed's step names
    ** it when nothing the graph depends on can change by itself: see optim.lua's _bare_replay_graph); any
    ** other call into Lua drops it and first tells the Lua side how many steps were replayed so. */
    ms_graph  *replay;
    int        replay_applied;   /* what such a step reports through *applied */
    long       replayed;
};

/* --- finding the Lua modules ------------------------------------------------------------------- */

static bool readable(const char *path) { return access(path, R_OK) == 0; }

/* The resolved path of the shared library holding this code: the Lua binding must load that same copy. */
static ms_status library_path(ms_ctx *ctx, char *out, size_t n)
{
    Dl_info info;
    if (dladdr((void *)ms_optimizer_new, &info) == 0 || info.dli_fname == NULL || !info.dli_fname[0])
        return MS_FAIL(ctx, MS_E_IO, "ms_optimizer_new: cannot tell which file libmoonstep was loaded from");
    char resolved[PATH_MAX];
    snprintf(out, n, "%s", realpath(info.dli_fname, resolved) ? resolved : info.dli_fname);
    return MS_OK;
}

/* The first of dir/<suffix> holding `probe`, into out; false when none does. */
static bool find_dir(char *out, size_t n, const char *dir, const char *const *suffixes, const char *probe)
{
    for (int i = 0; suffixes[i]; i++) {
        char test[PATH_MAX + 64];
        snprintf(out, n, "%s/%s", dir, suffixes[i]);
        snprintf(test, sizeof test, "%s%s", out, probe);
        if (readable(test)) return true;
    }
    return false;
}

typedef struct lua_paths {
    char library[PATH_MAX];
    char lua_dir[PATH_MAX];
    char recipe_dir[PATH_MAX];   /* "" when none was found (moonstep.recipe then searches beside its modules) */
} lua_paths;

static ms_status find_paths(ms_ctx *ctx, lua_paths *p)
{
    static const char *const lua_dirs[] = { "../lua", "../share/lua/5.1", NULL };
    static const char *const recipe_dirs[] = { "../recipes", "../share/moonstep/recipes", NULL };
    MS_TRY(library_path(ctx, p->library, sizeof p->library));
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", p->library);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0'; else snprintf(dir, sizeof dir, ".");

    const char *env = getenv("MOONSTEP_LUA_DIR");
    if (env && *env) {
        char probe[PATH_MAX + 32];
        snprintf(probe, sizeof probe, "%s/moonstep/init.lua", env);
        if (!readable(probe))
            return MS_FAIL(ctx, MS_E_IO, "ms_optimizer_new: MOONSTEP_LUA_DIR=%s has no moonstep/init.lua", env);
        snprintf(p->lua_dir, sizeof p->lua_dir, "%s", env);
    } else if (!find_dir(p->lua_dir, sizeof p->lua_dir, dir, lua_dirs, "/moonstep/init.lua")) {
        return MS_FAIL(ctx, MS_E_IO, "ms_optimizer_new: cannot find the moonstep Lua modules (tried %s/../lua "
                       "and %s/../share/lua/5.1 beside %s); set MOONSTEP_LUA_DIR", dir, dir, p->library);
    }
    if (!find_dir(p->recipe_dir, sizeof p->recipe_dir, dir, recipe_dirs, "")) p->recipe_dir[0] = '\0';
    /* messages and tracebacks then name files without "build/../" */
    char resolved[PATH_MAX];
    if (realpath(p->lua_dir, resolved)) snprintf(p->lua_dir, sizeof p->lua_dir, "%s", resolved);
    if (p->recipe_dir[0] && realpath(p->recipe_dir, resolved))
        snprintf(p->recipe_dir, sizeof p->recipe_dir, "%s", resolved);
    return MS_OK;
}

/* --- calling Lua --------------------------------------------------------------------------------- */

/* The status and message of a failed lua_pcall (its error value on top of the stack). */
static ms_status lua_failure(lua_State *L, ms_ctx *ctx, const char *fn, int rc, ms_status fallback)
{
    if (rc == LUA_ERRMEM) return MS_FAIL(ctx, MS_E_OOM, "%s: the optimizer's Lua state is out of memory", fn);
    ms_status st = fallback;
    if (lua_istable(L, -1)) {          /* {status =, message =} from moonstep.embed's handler */
        lua_getfield(L, -1, "status");
        if (lua_isnumber(L, -1) && lua_tointeger(L, -1) < 0) st = (ms_status)lua_tointeger(L, -1);
        lua_pop(L, 1);
        lua_getfield(L, -1, "message");
    }
    const char *msg = lua_tostring(L, -1);
    return MS_FAIL(ctx, st, "%s: %s", fn, msg ? msg : "(a Lua error without a message)");
}

/* Tells the Lua side about the steps replayed without it, and drops the replay graph (the call about to run
** may change what the graph depends on). */
static void sync_replays(ms_optimizer *opt)
{
    opt->replay = NULL;
    if (opt->replayed == 0) return;
    lua_State *L = opt->L;
    int top = lua_gettop(L);
    lua_rawgeti(L, LUA_REGISTRYINDEX, opt->object);
    lua_getfield(L, -1, "replayed");   /* (cannot raise, as call_begin's lookup) */
    lua_insert(L, -2);
    lua_pushnumber(L, (lua_Number)opt->replayed);
    opt->replayed = 0;
    lua_pcall(L, 2, 0, 0);   /* a step count and a cache entry: nothing that can fail but memory */
    lua_settop(L, top);
}

/* Pushes the message handler, object[method] and the object (self); returns the handler's index.  The
** caller pushes the arguments (strings through push_string), then calls call_end.  None of this can raise: the
** method names are Embedded's keys (strings already made) and its __index is that table. */
static int call_begin(ms_optimizer *opt, const char *method)
{
    sync_replays(opt);
    lua_State *L = opt->L;
    int base = lua_gettop(L) + 1;
    lua_rawgeti(L, LUA_REGISTRYINDEX, opt->handler);
    lua_rawgeti(L, LUA_REGISTRYINDEX, opt->object);
    lua_getfield(L, -1, method);
    lua_insert(L, -2);
    return base;
}

/* lua_pushstring, for push_string to run under lua_pcall. */
static int push_string_raw(lua_State *L)
{
    lua_pushstring(L, lua_touserdata(L, 1));
    return 1;
}

/* Pushes s (nil for NULL) as an argument of the call call_begin prepared.  The string is made under lua_pcall:
** when that fails (out of memory) its error value stands in its place, and call_end reports MS_E_OOM without
** making the call. */
static void push_string(ms_optimizer *opt, const char *s)
{
    lua_State *L = opt->L;
    if (s == NULL) { lua_pushnil(L); return; }
    lua_rawgeti(L, LUA_REGISTRYINDEX, opt->pusher);
    lua_pushlightuserdata(L, (void *)s);
    if (lua_pcall(L, 1, 1, 0) != 0) opt->push_failed = true;
}

/* Runs the call call_begin prepared.  On success its nres results lie above base, and the caller drops
** everything with lua_settop(L, base - 1); on failure that is done here.  A call whose arguments could not all
** be made is not made (the Lua side then never took over the handles among them: the caller frees them). */
static ms_status call_end(ms_optimizer *opt, const char *fn, int base, int nargs, int nres, ms_status fallback)
{
    if (opt->push_failed) {
        opt->push_failed = false;
        lua_settop(opt->L, base - 1);
        return MS_FAIL(opt->ctx, MS_E_OOM, "%s: the optimizer's Lua state is out of memory", fn);
    }
    int rc = lua_pcall(opt->L, nargs + 1, nres, base);
    if (rc == 0) return MS_OK;
    ms_status st = lua_failure(opt->L, opt->ctx, fn, rc, fallback);
    lua_settop(opt->L, base - 1);
    return st;
}

/* A call with no arguments and no results. */
static ms_status call_simple(ms_optimizer *opt, const char *fn, const char *method, ms_status fallback)
{
    int base = call_begin(opt, method);
    ms_status st = call_end(opt, fn, base, 0, 0, fallback);
    if (st == MS_OK) lua_settop(opt->L, base - 1);
    return st;
}

/* Traceback handler for loading the Lua side, before moonstep.embed's own handler exists. */
static int load_traceback(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    luaL_traceback(L, L, msg ? msg : "(a Lua error without a message)", 1);
    return 1;
}

/* What setup_state needs, and what it made. */
typedef struct state_setup {
    const lua_paths *paths;
    int load_rc;    /* the require's lua_pcall status when it failed (its error value is then raised again) */
    int handler;    /* registry references: moonstep.embed's handler, */
    int pusher;     /* and push_string_raw */
} state_setup;

/* open_state's work in the new state, run through lua_cpcall: out of memory anywhere in it comes back as a
** status. */
static int setup_state(lua_State *L)
{
    state_setup *s = lua_touserdata(L, 1);
    luaL_openlibs(L);
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", s->paths->lua_dir, s->paths->lua_dir, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
    lua_getfield(L, -1, "loaded");
    lua_newtable(L);                               /* moonstep.config: what the binding cannot find alone */
    lua_pushstring(L, s->paths->library);
    lua_setfield(L, -2, "library");
    lua_pushstring(L, s->paths->lua_dir);
    lua_setfield(L, -2, "lua_dir");
    lua_pushstring(L, s->paths->recipe_dir);
    lua_setfield(L, -2, "recipe_dir");
    lua_setfield(L, -2, "moonstep.config");
    lua_pop(L, 2);

    lua_pushcfunction(L, load_traceback);
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonstep.embed");
    s->load_rc = lua_pcall(L, 1, 1, -3);
    if (s->load_rc != 0) return lua_error(L);   /* the traceback, out of lua_cpcall */
    lua_getfield(L, -1, "handler");
    s->handler = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushcfunction(L, push_string_raw);
    s->pusher = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}

/* A new Lua state with package.path, moonstep.config and moonstep.embed loaded; the handler referenced. */
static ms_status open_state(ms_optimizer *opt)
{
    lua_paths *paths = malloc(sizeof *paths);
    if (paths == NULL) return MS_FAIL(opt->ctx, MS_E_OOM, "ms_optimizer_new: out of host memory");
    ms_status st = find_paths(opt->ctx, paths);
    if (st != MS_OK) { free(paths); return st; }
    lua_State *L = opt->L = luaL_newstate();
    if (L == NULL) {
        free(paths);
        return MS_FAIL(opt->ctx, MS_E_OOM, "ms_optimizer_new: cannot create a Lua state");
    }
    state_setup setup = { .paths = paths };
    int rc = lua_cpcall(L, setup_state, &setup);
    free(paths);
    if (rc != 0) {
        st = setup.load_rc
            ? lua_failure(L, opt->ctx, "ms_optimizer_new: loading the moonstep Lua modules", setup.load_rc, MS_E_IO)
            : lua_failure(L, opt->ctx, "ms_optimizer_new: setting up its Lua state", rc, MS_E_IO);
        lua_settop(L, 0);
        return st;
    }
    opt->handler = setup.handler;
    opt->pusher = setup.pusher;
    return MS_OK;
}

/* --- argument checks ----------------------------------------------------------------------------- */

static ms_status check_json_object(ms_ctx *ctx, const char *what, const char *text)
{
    if (text == NULL || text[0] == '\0') return MS_OK;
    ms_json *v;
    char err[192];
    ms_status st = ms_json_parse(text, strlen(text), &v, err, sizeof err);
    if (st == MS_E_OOM) return MS_FAIL(ctx, st, "ms_optimizer_new: no memory to parse %s", what);
    if (st != MS_OK) return MS_FAIL(ctx, MS_E_FORMAT, "ms_optimizer_new: %s is not valid JSON: %s", what, err);
    const ms_json *dup = NULL;
    if (v->type != MS_JSON_OBJECT) st = MS_FAIL(ctx, MS_E_FORMAT, "ms_optimizer_new: %s must be a JSON object", what);
    else if ((st = ms_json_dup_key(v, &dup)) != MS_OK) st = MS_FAIL(ctx, st, "ms_optimizer_new: no memory to check %s", what);
    else if (dup) st = MS_FAIL(ctx, MS_E_FORMAT, "ms_optimizer_new: %s gives \"%s\" twice", what, dup->key);
    ms_json_free(v);
    return st;
}

static bool same_device(const ms_ctx *a, const ms_ctx *b) { return a->type == b->type && a->index == b->index; }

static ms_status check_tensor(ms_optimizer *opt, const char *fn, const char *name, const char *role,
                              const ms_tensor *t)
{
    if (!same_device(t->ctx, opt->ctx))
        return MS_FAIL(opt->ctx, MS_E_DEVICE, "%s: parameter '%s': %s is on %s but the optimizer runs on %s", fn,
                       name, role, t->ctx->name, opt->ctx->name);
    if (!ms_dtype_is_float(t->dtype))
        return MS_FAIL(opt->ctx, MS_E_DTYPE, "%s: parameter '%s': %s is %s, not a float dtype (f32, f64, bf16, f16)",
                       fn, name, role, ms_dtype_name(t->dtype));
    return MS_OK;
}

/* Steps rescale gradients in place (grad_scale, clipping): one whose elements share addresses (an expanded view)
** would fail mid-step, or race, so it is refused when it is handed over. */
static ms_status check_grad_writable(ms_optimizer *opt, const char *fn, const char *name, const ms_tensor *grad)
{
    if (ms_tensor_is_writable(grad)) return MS_OK;
    char strides[16 * MS_MAX_DIMS + 4];
    return MS_FAIL(opt->ctx, MS_E_LAYOUT, "%s: parameter '%s': grad %s has strides %s, under which two elements share "
                   "an address (an expanded view?); steps rescale gradients in place (grad_scale, clipping), so it "
                   "must be writable", fn, name, ms_tshape(grad),
                   ms_shape_str(strides, sizeof strides, grad->ndim, grad->strides));
}

static ms_status check_grad(ms_optimizer *opt, const char *fn, const char *name, const ms_tensor *param,
                            const ms_tensor *grad)
{
    if (grad == NULL) return MS_OK;
    MS_TRY(check_tensor(opt, fn, name, "grad", grad));
    bool same = grad->ndim == param->ndim;
    for (int i = 0; same && i < param->ndim; i++) same = grad->shape[i] == param->shape[i];
    if (!same)
        return MS_FAIL(opt->ctx, MS_E_SHAPE, "%s: parameter '%s': grad shape %s != param shape %s", fn, name,
                       ms_tshape(grad), ms_tshape(param));
    /* ms.optim refuses it only when the optimizer starts: the first step would fail, not this call */
    if (ms_tensor_overlaps(param, grad))
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': grad shares memory with the param (it is updated "
                       "in place)", fn, name);
    return check_grad_writable(opt, fn, name, grad);
}

/* A new handle on t's elements (same storage, shape, strides and offset) for the optimizer to own. */
static ms_status tensor_share(ms_ctx *ctx, const ms_tensor *t, ms_tensor **out)
{
    ms_tensor *s = malloc(sizeof *s);
    if (s == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_optimizer: out of host memory");
    *s = *t;
    atomic_fetch_add(&s->storage->refcount, 1);
    ms_ctx_retain(s->ctx);
    *out = s;
    return MS_OK;
}

/* shard: a known dim that param has, and a slice that lies within [0, global). */
static ms_status check_shard(ms_optimizer *opt, const char *fn, const char *name, const ms_tensor *param,
                             const ms_shard *shard)
{
    if (shard->dim != MS_SHARD_ROWS && shard->dim != MS_SHARD_COLS)
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': shard dim %d is none of MS_SHARD_NONE, MS_SHARD_ROWS, "
                       "MS_SHARD_COLS", fn, name, (int)shard->dim);
    const bool rows = shard->dim == MS_SHARD_ROWS;
    const char *what = rows ? "rows" : "columns";
    if (param->ndim < 2)   /* what ms.optim and the sharded primitives take: matrices and stacks of them */
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': a param of shape %s has no %s to shard (a shard is "
                       "rows, dim -2, or columns, dim -1, of a matrix or a stack of matrices)", fn, name,
                       ms_tshape(param), what);
    int64_t local = param->shape[param->ndim - (rows ? 2 : 1)];
    /* the runtime's Lua holds them as doubles: exact to 2^53 (no real matrix comes near it) */
    if (shard->global > ((int64_t)1 << 53))
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': a global size of %lld %s is past 2^53", fn, name,
                       (long long)shard->global, what);
    if (shard->offset >= 0 && shard->global >= 1 && shard->offset <= shard->global - local) return MS_OK;
    /* the slice's end as the message shows it: offset + local can pass INT64_MAX (an offset near it) */
    int64_t end;
    if (__builtin_add_overflow(shard->offset, local, &end))
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': %s [%lld, %lld + %lld) held here do not lie within "
                       "the global [0, %lld)", fn, name, what, (long long)shard->offset, (long long)shard->offset,
                       (long long)local, (long long)shard->global);
    return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': %s [%lld, %lld) held here do not lie within the global "
                   "[0, %lld)", fn, name, what, (long long)shard->offset, (long long)end, (long long)shard->global);
}

/* A tensor handle for the Lua side, which takes it over (nil for NULL). */
static void push_tensor(lua_State *L, ms_tensor *t)
{
    if (t) lua_pushlightuserdata(L, t); else lua_pushnil(L);
}

#define CHECK_OPT(fn) \
    do { if (opt == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: opt is NULL", fn); } while (0)

/* What make_object needs. */
typedef struct new_object {
    ms_optimizer *opt;
    const char   *recipe, *options_json, *settings_json;
    int           new_rc;   /* moonstep.embed.new's lua_pcall status when it failed (its error value is raised again) */
} new_object;

/* opt->object <- moonstep.embed.new(ctx, recipe, options, settings, abi), run through lua_cpcall (as
** setup_state). */
static int make_object(lua_State *L)
{
    new_object *n = lua_touserdata(L, 1);
    ms_optimizer *opt = n->opt;
    lua_rawgeti(L, LUA_REGISTRYINDEX, opt->handler);
    int handler = lua_gettop(L);
    lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");     /* package.loaded: open_state loaded the module */
    lua_getfield(L, -1, "moonstep.embed");
    lua_getfield(L, -1, "new");
    lua_replace(L, -3);
    lua_pop(L, 1);
    lua_pushlightuserdata(L, opt->ctx);
    lua_pushstring(L, n->recipe);
    if (n->options_json && *n->options_json) lua_pushstring(L, n->options_json); else lua_pushnil(L);
    if (n->settings_json && *n->settings_json) lua_pushstring(L, n->settings_json); else lua_pushnil(L);
    lua_pushlightuserdata(L, (void *)ms_abi_version);
    ms_ctx_retain(opt->ctx);   /* the Lua side's reference, owned from its first line (taken after what can fail) */
    n->new_rc = lua_pcall(L, 5, 1, handler);
    if (n->new_rc != 0) return lua_error(L);   /* the handler's {status, message}, out of lua_cpcall */
    opt->object = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}

/* --- the API ------------------------------------------------------------------------------------- */

MS_API ms_status ms_optimizer_new(ms_ctx *ctx, const char *recipe, const char *options_json,
                                  const char *settings_json, ms_optimizer **out)
{
    static const char fn[] = "ms_optimizer_new";
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (recipe == NULL || recipe[0] == '\0') return MS_FAIL(ctx, MS_E_ARG, "%s: recipe is NULL or empty", fn);
    MS_TRY(check_json_object(ctx, "options_json", options_json));
    MS_TRY(check_json_object(ctx, "settings_json", settings_json));

    ms_optimizer *opt = calloc(1, sizeof *opt);
    if (opt == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: out of host memory", fn);
    opt->ctx = ctx;
    ms_status st = open_state(opt);
    if (st == MS_OK) {
        new_object n = { .opt = opt, .recipe = recipe, .options_json = options_json, .settings_json = settings_json };
        int rc = lua_cpcall(opt->L, make_object, &n);
        if (rc != 0) st = lua_failure(opt->L, ctx, fn, n.new_rc ? n.new_rc : rc, MS_E_ARG);
        lua_settop(opt->L, 0);
    }
    if (st != MS_OK) {
        if (opt->L) lua_close(opt->L);
        free(opt);
        return st;
    }
    *out = opt;
    return MS_OK;
}

MS_API void ms_optimizer_free(ms_optimizer *opt)
{
    if (opt == NULL) return;
    lua_close(opt->L);      /* finalizers free every handle, the context reference included */
    free(opt);
}

/* A parameter (and this rank's shard of it: NULL for the whole) handed over to moonstep.embed. */
static ms_status add_param(ms_optimizer *opt, const char *fn, const char *name, ms_tensor *param, ms_tensor *grad,
                           const char *tags, const ms_shard *shard)
{
    CHECK_OPT(fn);
    if (name == NULL || name[0] == '\0') return MS_FAIL(opt->ctx, MS_E_ARG, "%s: name is NULL or empty", fn);
    if (param == NULL) return MS_FAIL(opt->ctx, MS_E_ARG, "%s: parameter '%s': param is NULL", fn, name);
    if (shard) MS_TRY(check_shard(opt, fn, name, param, shard));
    MS_TRY(check_tensor(opt, fn, name, "param", param));
    /* ms.optim refuses it when the optimizer starts, and a parameter cannot be taken back: every step would
    ** fail */
    if (!ms_tensor_is_contiguous(param))
        return MS_FAIL(opt->ctx, MS_E_LAYOUT, "%s: parameter '%s': param must be contiguous (it is updated in "
                       "place; shape %s)", fn, name, ms_tshape(param));
    MS_TRY(check_grad(opt, fn, name, param, grad));
    ms_tensor *p, *g = NULL;
    MS_TRY(tensor_share(opt->ctx, param, &p));
    ms_status st = grad ? tensor_share(opt->ctx, grad, &g) : MS_OK;
    if (st != MS_OK) { ms_tensor_free(p); return st; }
    lua_State *L = opt->L;
    int base = call_begin(opt, "add_param");
    push_string(opt, name);
    push_tensor(L, p);
    push_tensor(L, g);
    push_string(opt, tags);
    int nargs = 4;
    if (shard) {
        push_string(opt, shard->dim == MS_SHARD_ROWS ? "rows" : "cols");
        lua_pushnumber(L, (lua_Number)shard->offset);
        lua_pushnumber(L, (lua_Number)shard->global);
        nargs = 7;
    }
    const bool handed_over = !opt->push_failed;   /* else call_end does not make the call */
    st = call_end(opt, fn, base, nargs, 0, MS_E_ARG);
    if (!handed_over) { ms_tensor_free(p); ms_tensor_free(g); }
    if (st == MS_OK) lua_settop(L, base - 1);
    return st;
}

MS_API ms_status ms_optimizer_add_param(ms_optimizer *opt, const char *name, ms_tensor *param, ms_tensor *grad,
                                        const char *tags)
{
    return add_param(opt, "ms_optimizer_add_param", name, param, grad, tags, NULL);
}

MS_API ms_status ms_optimizer_add_param_sharded(ms_optimizer *opt, const char *name, ms_tensor *param,
                                                ms_tensor *grad, const char *tags, const ms_shard *shard)
{
    if (shard && shard->dim == MS_SHARD_NONE) shard = NULL;
    return add_param(opt, "ms_optimizer_add_param_sharded", name, param, grad, tags, shard);
}

MS_API ms_status ms_optimizer_set_grad(ms_optimizer *opt, const char *name, ms_tensor *grad)
{
    static const char fn[] = "ms_optimizer_set_grad";
    CHECK_OPT(fn);
    if (name == NULL || name[0] == '\0') return MS_FAIL(opt->ctx, MS_E_ARG, "%s: name is NULL or empty", fn);
    ms_tensor *g = NULL;
    if (grad) {
        /* device and dtype here; the shape against the parameter's in moonstep.embed */
        MS_TRY(check_tensor(opt, fn, name, "grad", grad));
        MS_TRY(check_grad_writable(opt, fn, name, grad));
        MS_TRY(tensor_share(opt->ctx, grad, &g));
    }
    int base = call_begin(opt, "set_grad");
    push_string(opt, name);
    push_tensor(opt->L, g);
    const bool handed_over = !opt->push_failed;   /* (as in add_param) */
    ms_status st = call_end(opt, fn, base, 2, 0, MS_E_ARG);
    if (!handed_over) ms_tensor_free(g);
    if (st == MS_OK) lua_settop(opt->L, base - 1);
    return st;
}

MS_API ms_status ms_optimizer_set_comm(ms_optimizer *opt, ms_comm *comm)
{
    static const char fn[] = "ms_optimizer_set_comm";
    CHECK_OPT(fn);
    /* the step's collectives are queued on the comm's context: on any other they would race with its kernels */
    const ms_ctx *cc = ms_comm_context(comm);
    if (comm && cc != opt->ctx)
        return MS_FAIL(opt->ctx, MS_E_DEVICE, "%s: the communicator was made on another context (%s) than the "
                       "optimizer's (%s): create it on the context given to ms_optimizer_new", fn, cc->name,
                       opt->ctx->name);
    int base = call_begin(opt, "set_comm");
    if (comm) lua_pushlightuserdata(opt->L, comm); else lua_pushnil(opt->L);
    ms_status st = call_end(opt, fn, base, 1, 0, MS_E_ARG);
    if (st == MS_OK) lua_settop(opt->L, base - 1);
    return st;
}

/* opts->grad_scale (0 when opts is NULL), checked: 0 means none, else a positive finite number. */
static ms_status grad_scale_of(ms_optimizer *opt, const char *fn, const ms_step_options *opts, double *scale)
{
    *scale = opts ? opts->grad_scale : 0;
    if (!(*scale >= 0) || isinf(*scale))
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: grad_scale must be a positive finite number or 0 (got %g)", fn, *scale);
    if (*scale > 0 && isinf(1.0 / *scale))   /* a subnormal scale: the gradients would be multiplied by Inf */
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: grad_scale %g is too small: its inverse, which unscales the gradients, is "
                       "infinite", fn, *scale);
    return MS_OK;
}

MS_API ms_status ms_optimizer_step_with(ms_optimizer *opt, const ms_step_options *opts, int *applied)
{
    /* errors name the call made: ms_optimizer_step passes no options */
    const char *fn = opts ? "ms_optimizer_step_with" : "ms_optimizer_step";
    CHECK_OPT(fn);
    double scale;
    MS_TRY(grad_scale_of(opt, fn, opts, &scale));
    if (opt->replay != NULL && !(scale > 0) && !ms_ctx_is_capturing(opt->ctx)) {
        /* the previous step's graph again: a step's whole host cost is this launch (issue 7: < 50 us) */
        ms_profile_push(opt->ctx, "moonstep:graph:step");
        ms_status st = ms_graph_launch(opt->ctx, opt->replay);
        ms_profile_pop(opt->ctx);
        if (st != MS_OK) {
            opt->replay = NULL;
            return st;
        }
        opt->replayed++;
        if (applied) *applied = opt->replay_applied;
        return MS_OK;
    }
    int base = call_begin(opt, "step");
    if (scale > 0) lua_pushnumber(opt->L, scale); else lua_pushnil(opt->L);
    ms_status st = call_end(opt, fn, base, 1, 2, MS_E_ARG);
    if (st != MS_OK) return st;
    int a = lua_isnil(opt->L, -2) ? -1 : lua_toboolean(opt->L, -2);
    if (applied) *applied = a;
    if (lua_isnumber(opt->L, -1)) {
        opt->replay = (ms_graph *)(uintptr_t)lua_tonumber(opt->L, -1);
        opt->replay_applied = a;
    }
    lua_settop(opt->L, base - 1);
    return MS_OK;
}

MS_API ms_status ms_optimizer_step(ms_optimizer *opt) { return ms_optimizer_step_with(opt, NULL, NULL); }

MS_API ms_status ms_optimizer_set_lr(ms_optimizer *opt, double lr)
{
    static const char fn[] = "ms_optimizer_set_lr";
    CHECK_OPT(fn);
    if (!(lr >= 0) || isinf(lr))
        return MS_FAIL(opt->ctx, MS_E_ARG, "%s: lr must be a non-negative finite number (got %g)", fn, lr);
    int base = call_begin(opt, "set_lr");
    lua_pushnumber(opt->L, lr);
    ms_status st = call_end(opt, fn, base, 1, 0, MS_E_ARG);
    if (st == MS_OK) lua_settop(opt->L, base - 1);
    return st;
}

MS_API ms_status ms_optimizer_get_lr(ms_optimizer *opt, double *lr)
{
    static const char fn[] = "ms_optimizer_get_lr";
    CHECK_OPT(fn);
    if (lr == NULL) return MS_FAIL(opt->ctx, MS_E_ARG, "%s: lr is NULL", fn);
    int base = call_begin(opt, "get_lr");
    ms_status st = call_end(opt, fn, base, 0, 1, MS_E_ARG);
    if (st != MS_OK) return st;
    *lr = lua_tonumber(opt->L, -1);
    lua_settop(opt->L, base - 1);
    return MS_OK;
}

static ms_status call_path(ms_optimizer *opt, const char *fn, const char *method, const char *path,
                           ms_status fallback)
{
    CHECK_OPT(fn);
    if (path == NULL || path[0] == '\0') return MS_FAIL(opt->ctx, MS_E_ARG, "%s: path is NULL or empty", fn);
    int base = call_begin(opt, method);
    push_string(opt, path);
    ms_status st = call_end(opt, fn, base, 1, 0, fallback);
    if (st == MS_OK) lua_settop(opt->L, base - 1);
    return st;
}

MS_API ms_status ms_optimizer_save(ms_optimizer *opt, const char *path)
{
    return call_path(opt, "ms_optimizer_save", "save", path, MS_E_IO);
}

MS_API ms_status ms_optimizer_load(ms_optimizer *opt, const char *path)
{
    return call_path(opt, "ms_optimizer_load", "load", path, MS_E_FORMAT);
}

static ms_status call_json(ms_optimizer *opt, const char *fn, const char *method, char **json_out)
{
    if (json_out) *json_out = NULL;   /* on every error, a NULL opt included */
    CHECK_OPT(fn);
    if (json_out == NULL) return MS_FAIL(opt->ctx, MS_E_ARG, "%s: json_out is NULL", fn);
    int base = call_begin(opt, method);
    ms_status st = call_end(opt, fn, base, 0, 1, MS_E_ARG);
    if (st != MS_OK) return st;
    size_t len;
    const char *s = lua_tolstring(opt->L, -1, &len);
    char *copy = s ? malloc(len + 1) : NULL;
    if (copy) {
        memcpy(copy, s, len + 1);
        *json_out = copy;
    } else {
        st = MS_FAIL(opt->ctx, MS_E_OOM, "%s: out of host memory", fn);
    }
    lua_settop(opt->L, base - 1);
    return st;
}

MS_API ms_status ms_optimizer_info(ms_optimizer *opt, char **json_out)
{
    return call_json(opt, "ms_optimizer_info", "info", json_out);
}

MS_API ms_status ms_optimizer_stats(ms_optimizer *opt, char **json_out)
{
    return call_json(opt, "ms_optimizer_stats", "stats", json_out);
}

MS_API void ms_string_free(char *s) { free(s); }

MS_API ms_status ms_optimizer_capture(ms_optimizer *opt)
{
    static const char fn[] = "ms_optimizer_capture";
    CHECK_OPT(fn);
    return call_simple(opt, fn, "capture", opt->ctx->type == MS_DEVICE_CPU ? MS_E_UNSUPPORTED : MS_E_ARG);
}

MS_API ms_status ms_optimizer_prepare_replay_with(ms_optimizer *opt, const ms_step_options *opts)
{
    const char *fn = opts ? "ms_optimizer_prepare_replay_with" : "ms_optimizer_prepare_replay";   /* (as above) */
    CHECK_OPT(fn);
    double scale;
    MS_TRY(grad_scale_of(opt, fn, opts, &scale));
    int base = call_begin(opt, "prepare_replay");
    if (scale > 0) lua_pushnumber(opt->L, scale); else lua_pushnil(opt->L);
    ms_status st = call_end(opt, fn, base, 1, 0, MS_E_ARG);
    if (st == MS_OK) lua_settop(opt->L, base - 1);
    return st;
}

MS_API ms_status ms_optimizer_prepare_replay(ms_optimizer *opt) { return ms_optimizer_prepare_replay_with(opt, NULL); }
