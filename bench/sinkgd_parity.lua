--[[
bench/sinkgd_parity.lua -- parity of the CUDA SinkGD step with the pinned PyTorch baseline (axolotl's compiled
path, which rounds the iterate to the grad dtype every half-step), issue 5.  Two halves, one command on the GPU
host:

  build/moonstep bench/sinkgd_parity.lua DIR      -- inputs and moonstep's results to DIR/parity.safetensors
  python3 bench/sinkgd_parity.py DIR              -- the baseline's sinkgd_step on the same inputs; compares

bf16 gradients, f32 params (so the update is not lost under the param's rounding), sinkhorn_iters 5, lr 1e-3,
no weight decay, base and spectral (unit target, one power step from the same random u).  Fresh random
inputs; the check is |dp_moonstep - dp_torch| <= 3e-2 max |dp_torch| per matrix set, the same for the
spectral step's new u against the baseline's, and u untouched by a base step.
]]
local ms = require("moonstep")
local dir = assert(arg and arg[1], "usage: moonstep bench/sinkgd_parity.lua DIR")
assert(ms.device_count("cuda") > 0, "sinkgd_parity: no CUDA device")
local ctx = ms.context { device = "cuda" }
ms.manual_seed(20261129)

local SHAPES = { { 256, 512 }, { 1024, 4096 }, { 4096, 1024 }, { 8, 64, 128 }, { 1, 300 }, { 300, 1 } }
local out, meta = {}, { shapes = {} }
for k, shape in ipairs(SHAPES) do
  local tag = table.concat(shape, "x")
  meta.shapes[k] = tag
  local p0 = ms.randn(shape, { ctx = ctx })
  local g = ms.randn(shape, { ctx = ctx }):to("bf16")
  local ushape = {}
  for d = 1, #shape - 2 do ushape[d] = shape[d] end
  ushape[#ushape + 1] = shape[#shape]
  local u0 = ms.randn(ushape, { ctx = ctx })
  out[tag .. ".p"], out[tag .. ".g"], out[tag .. ".u"] = p0:to("cpu"), g:to("cpu"), u0:to("cpu")
  for _, mode in ipairs { "base", "spectral" } do
    local p, u = p0:clone(), u0:clone()
    ms.sinkgd_step { params = { p }, grads = { g }, specnorm_u = { u }, lr = 1e-3, mode = mode, iters = 5,
                     sn_iters = 1, target = "unit", eps = 1e-8 }
    out[tag .. "." .. mode .. ".p"] = p:to("cpu")
    out[tag .. "." .. mode .. ".u"] = u:to("cpu")
  end
end
meta.shapes = table.concat(meta.shapes, ",")
ms.save(dir .. "/parity.safetensors", out, meta)
print(("sinkgd_parity: %d shapes written to %s/parity.safetensors"):format(#SHAPES, dir))
