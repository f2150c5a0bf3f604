/*
** libFuzzer harness for the optimizer checkpoint loader (opt:load in lua/moonstep/optim.lua, over the
** safetensors reader): an SGD-with-momentum optimizer is built once; each input is written to a file and
** loaded into it, strictly and with {force = true}; a checkpoint that loads must leave a working optimizer.
*/
#include "lua_harness.h"

static const char setup[] =
    "local ms = require('moonstep')\n"
    "ms.manual_seed(1)\n"
    "local params = {\n"
    "  {name = 'layer.weight', param = ms.randn({4, 3}), grad = ms.randn({4, 3})},\n"
    "  {name = 'layer.bias', param = ms.randn({3}), grad = ms.randn({3})},\n"
    "}\n"
    "local opt = ms.optim.new('sgd', params, {lr = 0.1, momentum = 0.9})\n"
    "opt:step()\n"
    "local path = os.tmpname()\n"
    "function FUZZ(data)\n"
    "  local f = assert(io.open(path, 'wb'))\n"
    "  f:write(data)\n"
    "  f:close()\n"
    "  for _, o in ipairs {{}, {force = true}} do\n"
    "    if pcall(opt.load, opt, path, o) then opt:step() end\n"
    "  end\n"
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
