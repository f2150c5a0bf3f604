/*
** Shared by the Lua-side harnesses: one LuaJIT state per fuzzing process, running the tree's lua/ modules
** over the fuzz build of the engine.  The harness's setup script defines a global FUZZ(data); each input
** is passed to it under lua_pcall, so Lua errors are expected outcomes; crashes, sanitizer reports and a
** string returned by FUZZ (a broken invariant it checked) are findings.
*/
#ifndef MS_FUZZ_LUA_HARNESS_H
#define MS_FUZZ_LUA_HARNESS_H

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <stdio.h>
#include <stdlib.h>

#ifndef MS_SOURCE_DIR
#define MS_SOURCE_DIR "."
#endif
#ifndef MS_FUZZ_BUILD
#define MS_FUZZ_BUILD "build-fuzz"
#endif

static lua_State *fuzz_L;

static void fuzz_lua_init(const char *setup)
{
    /* the binding finds libmoonstep through MOONSTEP_BUILD: the sanitized fuzz build, not the plain one */
    setenv("MOONSTEP_BUILD", MS_SOURCE_DIR "/" MS_FUZZ_BUILD, 0);
    setenv("MOONSTEP_LIB", MS_SOURCE_DIR "/" MS_FUZZ_BUILD "/libmoonstep-fuzz.so", 0);
    fuzz_L = luaL_newstate();
    if (!fuzz_L) abort();
    luaL_openlibs(fuzz_L);
    lua_getglobal(fuzz_L, "package");
    lua_pushstring(fuzz_L, MS_SOURCE_DIR "/lua/?.lua;" MS_SOURCE_DIR "/lua/?/init.lua");
    lua_setfield(fuzz_L, -2, "path");
    lua_pop(fuzz_L, 1);
    if (luaL_loadstring(fuzz_L, setup) != 0 || lua_pcall(fuzz_L, 0, 0, 0) != 0) {
        fprintf(stderr, "fuzz setup failed: %s\n", lua_tostring(fuzz_L, -1));
        abort();
    }
}

static void fuzz_lua_run(const unsigned char *data, size_t size)
{
    lua_getglobal(fuzz_L, "FUZZ");
    lua_pushlstring(fuzz_L, (const char *)data, size);
    if (lua_pcall(fuzz_L, 1, 1, 0) == 0 && lua_type(fuzz_L, -1) == LUA_TSTRING) {
        fprintf(stderr, "fuzz finding: %s\n", lua_tostring(fuzz_L, -1));
        abort();
    }
    lua_pop(fuzz_L, 1);
}

#endif /* MS_FUZZ_LUA_HARNESS_H */
