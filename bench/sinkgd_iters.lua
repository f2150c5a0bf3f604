--[[
bench/sinkgd_iters.lua -- where a CUDA SinkGD step's time goes, measured in the pipeline itself (GPU host): base
steps with sinkhorn_iters L = 0, 1, ..., 5 on each shape.  t(0) is the apply alone; t(L) - t(L - 1) is one
SR-Sinkhorn iteration (a sweep over G and its fold) with the L2 as the step leaves it.  A profiler that replays
kernels (ncu) restores memory between its passes and so measures every sweep with a cold L2; this does not.

  build/moonstep bench/sinkgd_iters.lua [shape,shape,...]

bf16 params and grads, lr 1e-3, sets rotated as in bench/sinkgd_bench.lua (at least 256 MB, so a step never
finds its inputs in L2 from the previous step); milliseconds, median of 7 trials (bench/timing.lua).
]]
local ms = require("moonstep")

local shape_arg = arg and arg[1] or "4096x4096,14336x4096,4096x14336,8x1408x2048"
assert(ms.device_count("cuda") > 0, "sinkgd_iters: no CUDA device")
local ctx = ms.context { device = "cuda" }
local time, release_timer = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/timing.lua")(ctx)
ms.manual_seed(20261130)
print(("moonstep %s sinkgd iterations on %s"):format(ms.version, ctx:name()))

for spec in shape_arg:gmatch("[^,]+") do
  local shape, numel = {}, 1
  for d in spec:gmatch("%d+") do
    shape[#shape + 1] = tonumber(d)
    numel = numel * tonumber(d)
  end
  local bytes = numel * 2
  local nsets = math.max(2, math.ceil(256e6 / (2 * bytes)))
  local sets = {}
  for i = 1, nsets do
    sets[i] = { p = ms.randn(shape, { ctx = ctx, dtype = "bf16" }), g = ms.randn(shape, { ctx = ctx, dtype = "bf16" }) }
  end
  local reps = math.max(10, math.min(200, math.floor(2e9 / (bytes * 10))))
  local t = {}
  for L = 0, 5 do
    t[L] = time(function(i)
      local s = sets[(i - 1) % nsets + 1]
      ms.sinkgd_step { params = { s.p }, grads = { s.g }, lr = 1e-3, mode = "base", iters = L }
    end, reps)
  end
  local line = {}
  for L = 1, 5 do line[#line + 1] = ("%.1f"):format((t[L] - t[L - 1]) * 1e3) end
  print(("  %-14s %6.0f MB  apply alone %7.1f us  each iteration (us): %s  (5 iterations %.1f us, G at %.2f TB/s)")
        :format(spec, bytes / 1e6, t[0] * 1e3, table.concat(line, " "), (t[5] - t[0]) * 1e3,
                5 * bytes / ((t[5] - t[0]) * 1e-3) / 1e12))
  sets = nil
  collectgarbage()
end
release_timer()
