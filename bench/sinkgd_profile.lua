--[[
bench/sinkgd_profile.lua -- a few CUDA SinkGD steps on one shape, for a profiler (GPU host):

  ncu -k regex:'sweep_kernel|elem_kernel' --launch-skip S --launch-count N \
      build/moonstep bench/sinkgd_profile.lua [14336x4096] [base|spectral] [steps]

bf16 params and grads, sinkhorn_iters 5, lr 1e-3 (bench/sinkgd_bench.lua's settings); the first step is a warm-up
that the profiler can skip.  Prints each step's time from CUDA events (meaningless under a replaying profiler).
]]
local ms = require("moonstep")

local spec = arg and arg[1] or "14336x4096"
local mode = arg and arg[2] or "base"
local steps = tonumber(arg and arg[3] or "3")
assert(ms.device_count("cuda") > 0, "sinkgd_profile: no CUDA device")
local ctx = ms.context { device = "cuda" }
local shape = {}
for d in spec:gmatch("%d+") do shape[#shape + 1] = tonumber(d) end
assert(#shape >= 2, "sinkgd_profile: a shape is MxN or BxMxN")
ms.manual_seed(20261130)
local p = ms.randn(shape, { ctx = ctx, dtype = "bf16" })
local g = ms.randn(shape, { ctx = ctx, dtype = "bf16" })
local ushape = {}
for d = 1, #shape - 2 do ushape[d] = shape[d] end
ushape[#ushape + 1] = shape[#shape]
local u = ms.rand(ushape, { ctx = ctx, low = -1, high = 1 })
local time = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/timing.lua")(ctx)
for i = 1, steps do
  local t = time(function()
    ms.sinkgd_step { params = { p }, grads = { g }, specnorm_u = mode == "spectral" and { u } or nil, lr = 1e-3, mode = mode,
                     iters = 5, sn_iters = 1, target = "unit" }
  end, 1, 1)
  print(("step %d: %.4f ms"):format(i, t))
end
