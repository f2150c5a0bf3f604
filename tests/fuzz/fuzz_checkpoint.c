/*
** libFuzzer harness for the optimizer checkpoint loader (opt:load in lua/moonstep/optim.lua, over the
** safetensors reader): an SGD-with-momentum optimizer is built once; each input is written to a file and
** loaded into it, strictly and with {force = true}; a checkpoint that loads must leave a working optimizer,
** and one that fails to load must leave it as it was (state, step count, global generator).
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
    "-- what a load may change: the state tensors and scalars, the step count and friends, the global generator\n"
    "local function snapshot()\n"
    "  local tensors, scalars = opt:_state_entries()\n"
    "  local out = {}\n"
    "  for name, t in pairs(tensors) do out[#out + 1] = name .. '=' .. table.concat(t:tolist_flat(), ',') end\n"
    "  for name, v in pairs(scalars) do out[#out + 1] = name .. '=' .. tostring(v) end\n"
    "  for _, m in ipairs(opt.members) do out[#out + 1] = m.name .. ':lag=' .. tostring(m.lag) end\n"
    "  local r = ms.rng_state()\n"
    "  out[#out + 1] = ('step=%s skipped=%s lr_override=%s rng=%s/%s'):format(tostring(opt.step_count),\n"
    "    tostring(opt.skipped), tostring(opt.lr_override), tostring(r.seed), tostring(r.offset))\n"
    "  table.sort(out)\n"
    "  return table.concat(out, ';')\n"
    "end\n"
    "function FUZZ(data)\n"
    "  local f = assert(io.open(path, 'wb'))\n"
    "  f:write(data)\n"
    "  f:close()\n"
    "  for _, o in ipairs {{}, {force = true}} do\n"
    "    local before = snapshot()\n"
    "    if pcall(opt.load, opt, path, o) then opt:step()\n"
    "    elseif snapshot() ~= before then return 'a failed load changed the optimizer' end\n"
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
