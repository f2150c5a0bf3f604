--[[
moonstep bench core -- a short timed demonstration of the engine on the best device found: random numbers,
fused elementwise updates, reductions, matmul, a symmetric eigendecomposition, and a safetensors round trip.
Usage: build/moonstep bench/demo.lua [device]
]]
local ms = require("moonstep")

local device = arg and arg[1] or ms.best_device()
local okd, ctx = pcall(ms.device, device)
if not okd then error(("bench core: its argument is a device (cpu, cuda, cuda:1): %s"):format(tostring(ctx):gsub("^.-%.lua:%d+: ", "")), 0) end
print(("moonstep %s on %s  [%s]"):format(ms.version, ctx:name(), ms.build_info))

-- a monotonic wall clock (os.clock counts CPU time of every thread)
local now = require("moonstep.core").clock

local function time(fn, reps)
  fn() ctx:sync()                      -- warm-up
  local t0 = now()
  for _ = 1, reps do fn() end
  ctx:sync()
  return (now() - t0) / reps
end

local rows = {}
local function report(what, seconds, amount, unit)
  rows[#rows + 1] = ("  %-44s %9.3f ms  %9.2f %s"):format(what, seconds * 1e3, amount / seconds / 1e9, unit)
  print(rows[#rows])
end

local big = ctx:device_type() == "cuda" and 8192 or 2048
ms.manual_seed(1234)
local a = ms.randn({ big, big }, { ctx = ctx })
local b = ms.randn({ big, big }, { ctx = ctx })
local c = ms.empty({ big, big }, { ctx = ctx })
local n = big * big

report(("randn %dx%d f32"):format(big, big), time(function() ms.randn({ big, big }, { ctx = ctx }) end, 3), n * 4, "GB/s written")
-- bytes: a and b read, c written (a is two of the operands but one array: it crosses memory once)
report(("addcmul  c = a + 0.5*a*b  (%dx%d f32)"):format(big, big),
       time(function() ms.addcmul(a, a, b, 0.5, c) end, 5), n * 4 * 3, "GB/s")
report(("sum of squares (%dx%d f32)"):format(big, big), time(function() return a:sumsq() end, 5), n * 4, "GB/s")
report(("row norms (%dx%d f32)"):format(big, big), time(function() return a:norm(1) end, 5), n * 4, "GB/s")
local mm = ctx:device_type() == "cuda" and 4096 or 1024
local x, y = ms.randn({ mm, mm }, { ctx = ctx }), ms.randn({ mm, mm }, { ctx = ctx })
report(("matmul %dx%d f32"):format(mm, mm), time(function() ms.matmul(x, y) end, 3), 2 * mm ^ 3, "GFLOP/s")
local xb, yb = x:to("bf16"), y:to("bf16")
report(("matmul %dx%d bf16 (f32 accumulate)"):format(mm, mm), time(function() ms.matmul(xb, yb) end, 3), 2 * mm ^ 3, "GFLOP/s")
local e = 512
local s = ms.randn({ e, e }, { ctx = ctx })
local spd = ms.matmul(s, s, { trans_b = true }) + ms.eye(e, { ctx = ctx })
local w
report(("eigh %dx%d f32 (values and vectors)"):format(e, e), time(function() w = ms.eigh(spd) end, 2), 9 * e ^ 3, "GFLOP/s (~9n^3)")
print(("  smallest / largest eigenvalue of S S^T + I: %.4f / %.1f"):format(w:min(), w:max()))

local path = os.tmpname() .. ".safetensors"
local t0 = now()
ms.save(path, { a = a, spd = spd }, { demo = "moonstep" })
local loaded, meta = ms.load(path, { device = ctx })
local dt = now() - t0
os.remove(path)
local diff = (loaded.a - a):abs():max()
print(("  safetensors save+load of %.1f MB: %.3f s, max |difference| %g, metadata demo=%s"):format(
  (n + e * e) * 4 / 1e6, dt, diff, meta.demo))
