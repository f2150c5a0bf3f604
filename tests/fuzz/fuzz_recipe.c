/*
** libFuzzer harness for the recipe loader: each input is loaded as an untrusted recipe with small
** instruction and memory limits; one that loads is made into an optimizer and stepped, so its route,
** init, plan and step run in the sandbox too.  Escapes show up as crashes or sanitizer reports, and a
** sandbox that fails to stop the input shows up as a libFuzzer timeout.
*/
#include "lua_harness.h"

static const char setup[] =
    "local ms = require('moonstep')\n"
    "local limits = {instructions = 2e6, memory = 2^24, quota = 2^24}\n"
    "local p, g = ms.randn({4, 3}), ms.randn({4, 3})\n"
    "function FUZZ(src)\n"
    "  local ok, r = pcall(ms.recipe.load_string, src, '=fuzz', {trusted = false, limits = limits})\n"
    "  if not ok then return end\n"
    "  pcall(function()\n"
    "    local opt = ms.optim.new(r, {{name = 'w', param = p, grad = g}}, {}, {sandbox = limits})\n"
    "    opt:step()\n"
    "  end)\n"
    "  -- the trusted side must be as it was\n"
    "  if getmetatable('').__index ~= string or debug.gethook() ~= nil then return 'sandbox state leaked' end\n"
    "end\n";

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    fuzz_lua_init(setup);
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size)
{
    fuzz_lua_run(data, size);
    return 0;
}
