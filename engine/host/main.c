/*
** build/moonstep -- a small C host that embeds LuaJIT with moonstep preloaded.  It is also the example of
** how a C program embeds moonstep: open a Lua state, point package.path at the moonstep modules, tell the
** binding where the library is (package.loaded["moonstep.config"]), and run Lua code.
**
** The command line itself is Lua's business: the host passes its arguments to
** require("moonstep.cli").main(argv), which dispatches the subcommands (repl, run, train, compare, bench,
** info), scripts (moonstep FILE.lua [args]) and -e, and returns the exit status.  What only C can do is
** given to Lua through moonstep.config: readline (line editing and history) for the prompt, and a SIGINT
** handler that ends train's live progress line.
*/
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#if MS_HAVE_READLINE
#include <readline/history.h>
#include <readline/readline.h>
#endif

#include "moonstep.h"

static int file_exists(const char *path) { return access(path, R_OK) == 0; }

/* The folder this executable lives in (build/ in a source tree, <prefix>/bin when installed). */
static void exe_dir(char *out, size_t n)
{
    ssize_t len = readlink("/proc/self/exe", out, n - 1);
    if (len <= 0) { snprintf(out, n, "."); return; }
    out[len] = '\0';
    char *slash = strrchr(out, '/');
    if (slash) *slash = '\0';
}

/* The first candidate (dir + suffix) that exists, into out; 0 when none does. */
static int find_path(char *out, size_t n, const char *dir, const char *const *suffixes, const char *probe)
{
    for (int i = 0; suffixes[i]; i++) {
        char test[PATH_MAX + 64];
        snprintf(out, n, "%s/%s", dir, suffixes[i]);
        snprintf(test, sizeof test, "%s%s", out, probe);
        if (file_exists(test)) return 1;
    }
    return 0;
}

#if MS_HAVE_READLINE
static char history_path[PATH_MAX];   /* where each line is appended, "" for no history file */
#endif

/* readline(prompt) -> line or nil at end of input: the REPL's line editor, given to Lua by the host */
static int l_readline(lua_State *L)
{
    const char *prompt = luaL_optstring(L, 1, "> ");
#if MS_HAVE_READLINE
    char *line = readline(prompt);
    if (line == NULL) return 0;
    if (*line) {
        add_history(line);
        if (history_path[0]) append_history(1, history_path);
    }
    lua_pushstring(L, line);
    free(line);
    return 1;
#else
    char buf[4096];
    fputs(prompt, stdout);
    fflush(stdout);
    if (fgets(buf, sizeof buf, stdin) == NULL) return 0;
    buf[strcspn(buf, "\n")] = '\0';
    lua_pushstring(L, buf);
    return 1;
#endif
}

/* history_file(path) -> true: loads the history kept in path (the last 1000 lines) and appends every
** new line to it; history_file("") stops writing.  false without readline. */
static int l_history_file(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
#if MS_HAVE_READLINE
    history_path[0] = '\0';
    if (*path) {
        FILE *f = fopen(path, "a");          /* append_history needs the file to exist */
        if (f == NULL) { lua_pushboolean(L, 0); return 1; }
        fclose(f);
        history_truncate_file(path, 1000);
        read_history(path);
        snprintf(history_path, sizeof history_path, "%s", path);
    }
    lua_pushboolean(L, 1);
#else
    (void)path;
    lua_pushboolean(L, 0);
#endif
    return 1;
}

/* Ctrl-C while a live progress line is on the terminal (moonstep train): the line is ended before the process
** dies of the signal, as it would have without this handler; otherwise the shell's next output starts on it.
** LuaJIT has no signal API, and a Lua callback cannot run in a signal handler: Lua turns this on and off. */
static struct sigaction sigint_before;

static void end_line_on_sigint(int sig)
{
    ssize_t n = write(STDOUT_FILENO, "\n", 1);
    (void)n;
    sigaction(sig, &sigint_before, NULL);
    raise(sig);                 /* delivered once this handler returns, under the handler it replaced */
}

/* sigint_newline(on): while on, SIGINT ends the terminal's line first; an ignored SIGINT stays ignored */
static int l_sigint_newline(lua_State *L)
{
    static int on;
    if (lua_toboolean(L, 1) && !on) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = end_line_on_sigint;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, NULL, &sigint_before);
        if (sigint_before.sa_handler == SIG_IGN) return 0;
        sigaction(SIGINT, &sa, NULL);
        on = 1;
    } else if (!lua_toboolean(L, 1) && on) {
        sigaction(SIGINT, &sigint_before, NULL);
        on = 0;
    }
    return 0;
}

static int traceback(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (msg == NULL) msg = "(error object is not a string)";
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* Prints a failed chunk's error; returns the exit status (1 on failure). */
static int report(lua_State *L, int status)
{
    if (status == 0) return 0;
    fprintf(stderr, "moonstep: %s\n", lua_tostring(L, -1));
    lua_pop(L, 1);
    return 1;
}

static int run_protected(lua_State *L, int nargs)
{
    int base = lua_gettop(L) - nargs;
    lua_pushcfunction(L, traceback);
    lua_insert(L, base);
    int status = lua_pcall(L, nargs, 0, base);
    lua_remove(L, base);
    return report(L, status);
}

/* package.path, moonstep.config and the global `ms`. */
static int setup(lua_State *L, const char *dir)
{
    static const char *const lua_dirs[] = { "../lua", "../share/lua/5.1", NULL };
    static const char *const lib_paths[] = { "libmoonstep.so", "../lib/libmoonstep.so", NULL };
    static const char *const recipe_dirs[] = { "../recipes", "../share/moonstep/recipes", NULL };
    char luadir[PATH_MAX], lib[PATH_MAX], recipes[PATH_MAX];
    if (!find_path(luadir, sizeof luadir, dir, lua_dirs, "/moonstep/init.lua")) {
        fprintf(stderr, "moonstep: cannot find the moonstep Lua modules near %s\n", dir);
        return 1;
    }
    if (!find_path(lib, sizeof lib, dir, lib_paths, "")) snprintf(lib, sizeof lib, "libmoonstep.so");
    if (!find_path(recipes, sizeof recipes, dir, recipe_dirs, "")) recipes[0] = '\0';

    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", luadir, luadir, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
    lua_getfield(L, -1, "loaded");
    lua_newtable(L);
    lua_pushstring(L, lib);
    lua_setfield(L, -2, "library");
    lua_pushstring(L, luadir);
    lua_setfield(L, -2, "lua_dir");
    lua_pushstring(L, recipes);
    lua_setfield(L, -2, "recipe_dir");
    lua_pushcfunction(L, l_readline);
    lua_setfield(L, -2, "readline");
    lua_pushcfunction(L, l_history_file);
    lua_setfield(L, -2, "history_file");
    lua_pushcfunction(L, l_sigint_newline);
    lua_setfield(L, -2, "sigint_newline");
#if MS_HAVE_READLINE
    lua_pushstring(L, rl_library_version);
    lua_setfield(L, -2, "readline_version");
#endif
    lua_pushboolean(L, isatty(STDIN_FILENO));
    lua_setfield(L, -2, "interactive");
    lua_setfield(L, -2, "moonstep.config");
    lua_pop(L, 2);

    lua_getglobal(L, "require");
    lua_pushstring(L, "moonstep");
    if (run_protected(L, 1) != 0) return 1;
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonstep");
    lua_call(L, 1, 1);          /* cached now: cannot fail */
    lua_setglobal(L, "ms");
    return 0;
}

/* require("moonstep.cli").main({argv[1], ...}) -> the exit status */
static int run_cli(lua_State *L, int argc, char **argv)
{
    lua_pushcfunction(L, traceback);
    int base = lua_gettop(L);
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonstep.cli");
    if (lua_pcall(L, 1, 1, base) != 0) return report(L, 1);
    lua_getfield(L, -1, "main");
    lua_createtable(L, argc > 1 ? argc - 1 : 0, 0);
    for (int i = 1; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i);
    }
    if (lua_pcall(L, 1, 1, base) != 0) return report(L, 1);
    int status = lua_isnumber(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    lua_settop(L, base - 1);
    return status;
}

int main(int argc, char **argv)
{
    char dir[PATH_MAX];
    exe_dir(dir, sizeof dir);
    lua_State *L = luaL_newstate();
    if (L == NULL) { fprintf(stderr, "moonstep: cannot create a Lua state\n"); return 1; }
    luaL_openlibs(L);
    int status = setup(L, dir);
    if (status == 0) status = run_cli(L, argc, argv);
    lua_close(L);     /* runs the finalizers: every tensor and context is freed before exit */
    return status;
}
