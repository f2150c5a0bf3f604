--[[
moonstep -- the Lua surface of the moonstep engine.

  local ms = require("moonstep")
  local w = ms.randn({256, 128})                 -- f32 on the default device ("cpu")
  local g = ms.randn({256, 128}, {device = "cuda"})
  print(w:norm(), (w * 2 + 1):sum(0))
  ms.save("w.safetensors", {w = w}, {note = "hello"})

Tensors are objects with methods (t:add(u), t:sum(dim), t:transpose(0, 1), ...) and operators (+ - * /
and unary minus, broadcasting like NumPy).  Dims are 0-based as in PyTorch.  Errors from the engine become
Lua errors carrying its message.
]]
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local json = require("moonstep.json")
local ffi, C = core.ffi, core.C

local ms = {}

ms.version = ffi.string(C.ms_version())
ms.abi_version = core.ABI_VERSION
ms.build_info = ffi.string(C.ms_build_info())
ms.json = json

-- the tensor surface
for _, name in ipairs {
  "context", "device", "set_default_device", "get_default_device", "empty", "full", "zeros", "ones",
  "tensor", "rand", "randn", "manual_seed", "rng_state", "set_rng_state", "is_tensor", "broadcast_shapes", "set_rng_origin",
  "lerp", "addcmul", "addcdiv", "dot", "matmul", "eye", "diag", "eigh",
} do ms[name] = tensor[name] end
for _, name in ipairs {
  "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
  "neg", "abs", "sqrt", "rsqrt", "exp", "log", "sign", "square", "reciprocal", "tanh", "sigmoid", "relu",
  "sin", "cos", "sum", "mean", "max", "min", "norm", "sumsq", "amax",
} do ms[name] = tensor[name] end
ms.Tensor = tensor.Tensor

-- multi-tensor helpers and fused optimizer steps, the optimizer runtime and recipes
local fused = require("moonstep.fused")
for _, name in ipairs { "adamw_step", "sgd_step", "foreach_sumsq", "foreach_scale", "sinkgd_step", "adamw8_step",
                         "adamw8_qmap" } do ms[name] = fused[name] end
-- Shampoo on stacked blocks (DASH): block lists and plans, gather/apply, grafting, inverse roots
local dash = require("moonstep.dash")
for _, name in ipairs { "block_list", "blocks_gather", "blocks_apply", "blocks_scatter", "dash_graft", "inv_root",
                         "spectrum_estimate", "blocks_gather_factors" } do ms[name] = dash[name] end
ms.block_plan = require("moonstep.blocks").plan

-- (a misspelt dtype key would give t's dtype, silently)
local LIKE_OPTIONS = { dtype = "string", ctx = function() end }   -- (ctx: checked by ms.zeros / ms.empty)
function ms.zeros_like(t, opts)
  opts = core.check_options("zeros_like", opts, LIKE_OPTIONS, 2)
  tensor.need_tensor("zeros_like", "t", t, 2)
  return ms.zeros(t:shape(), { dtype = opts.dtype or t:dtype(), ctx = opts.ctx or t:context() })
end
function ms.empty_like(t, opts)
  opts = core.check_options("empty_like", opts, LIKE_OPTIONS, 2)
  tensor.need_tensor("empty_like", "t", t, 2)
  return ms.empty(t:shape(), { dtype = opts.dtype or t:dtype(), ctx = opts.ctx or t:context() })
end

--- Number of devices of a kind ("cpu" or "cuda") usable here.
function ms.device_count(kind)
  -- (any other word counted CPUs: device_count("gpu") was 1)
  core.check_value("device_count", "kind", kind, { "string", values = { "cpu", "cuda" } }, 2)
  return C.ms_device_count(kind == "cuda" and C.MS_DEVICE_CUDA or C.MS_DEVICE_CPU)
end

--- "cuda" when a GPU is usable, else "cpu".
function ms.best_device() return ms.device_count("cuda") > 0 and "cuda" or "cpu" end

-- ---------------------------------------------------------------------------------------------------
-- safetensors
-- ---------------------------------------------------------------------------------------------------
--- ms.save(path, {name = tensor, ...} [, metadata {string = string}])  (atomic write)
function ms.save(path, tensors, metadata)
  if type(path) ~= "string" then error("save: path must be a string", 2) end
  core.c_string("save", "path", path, 2)
  if type(tensors) ~= "table" then error("save: tensors must be a table {name = tensor}", 2) end
  local names = {}
  for k, v in pairs(tensors) do
    if type(k) ~= "string" then error("save: tensor names must be strings (got " .. type(k) .. ")", 2) end
    core.c_string("save", "a tensor name", k, 2)
    if not ms.is_tensor(v) then error("save: '" .. k .. "' is not a tensor", 2) end
    names[#names + 1] = k
  end
  table.sort(names)
  local n = #names
  local cnames = ffi.new("const char *[?]", math.max(n, 1))
  local handles = ffi.new("const ms_tensor *[?]", math.max(n, 1))
  local keep = {}
  for i, k in ipairs(names) do
    keep[i] = k
    cnames[i - 1] = k
    handles[i - 1] = tensor.handle(tensors[k])
  end
  local meta = nil
  if metadata ~= nil then
    if type(metadata) ~= "table" then error("save: metadata must be a table of strings", 2) end
    for k, v in pairs(metadata) do
      if type(k) ~= "string" or type(v) ~= "string" then
        error(("save: metadata must map strings to strings (key %s has a %s value)"):format(tostring(k), type(v)), 2)
      end
    end
    meta = json.encode(next(metadata) == nil and setmetatable({}, nil) or metadata)
    if meta == "[]" then meta = "{}" end
  end
  local ctx = n > 0 and tensors[names[1]]:context() or ms.device("cpu")
  core.check(C.ms_safetensors_save(tensor.handle_ctx(ctx), path, n, cnames, handles, meta))
  return true
end

local LOAD_OPTIONS = {
  device = function(v)
    if type(v) ~= "string" and getmetatable(v) ~= "moonstep.Context" then return "a device name or a context" end
  end,
}
--- ms.load(path [, {device = ...}]) -> {name = tensor}, metadata {string = string}, names (file order)
function ms.load(path, opts)
  if type(path) ~= "string" then error("load: path must be a string", 2) end
  core.c_string("load", "path", path, 2)
  -- (a misspelt device key would load onto the default device, silently)
  opts = core.check_options("load", opts, LOAD_OPTIONS, 2)
  local ctx = ms.device(opts.device)
  core.check(C.ms_safetensors_load(tensor.handle_ctx(ctx), path, core.out_set))
  local set = core.own_set(core.out_set[0])
  local out, order = {}, {}
  for i = 0, C.ms_tensor_set_count(set) - 1 do
    local name = ffi.string(C.ms_tensor_set_name(set, i))
    core.check(C.ms_tensor_set_get(set, i, core.out_tensor))
    out[name] = tensor.wrap(core.out_tensor[0], ctx)
    order[#order + 1] = name
  end
  local meta = json.decode(ffi.string(C.ms_tensor_set_metadata(set)))
  C.ms_tensor_set_free(ffi.gc(set, nil))
  return out, meta, order
end

ms.recipe = require("moonstep.recipe")
ms.graph = require("moonstep.graph")
ms.schedule = require("moonstep.schedule")
ms.routing = require("moonstep.routing")    -- routing by name, shared by the recipes
ms.comm = require("moonstep.comm")          -- communicators (NCCL) and the rendezvous
ms.shard = require("moonstep.shard")        -- tensors that are one rank's slice of a matrix (sharded SinkGD)
package.loaded.moonstep = ms     -- moonstep.optim requires moonstep: give it this table
ms.optim = require("moonstep.optim")

return ms
