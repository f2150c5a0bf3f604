--[[
bench/core_bench.lua -- the CUDA backend's core ops against their floors, on the GPU host:
device-to-device copy bandwidth, one fused elementwise op per family tried (addcmul f32, lerp bf16), three
reductions (whole, rows, columns), and batched bf16 / TF32 matmul through cuBLAS.

  build/moonstep bench/core_bench.lua [results.json]
  python3 bench/torch_core.py [results.json]        -- the PyTorch baselines, same shapes, own process

Method (DESIGN.md, "Performance"): CUDA events around R back-to-back ops, median of 7 trials after a warm-up;
inputs rotate over several buffer sets so that L2 (60 MB) never holds them; floors are the bytes an op must
move at the copy bandwidth measured in this same run, or its flops at the matrix rate of the baseline.
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local json = ms.json
local ffi, C = core.ffi, core.C

local out_path = arg and arg[1]
assert(ms.device_count("cuda") > 0, "core_bench: no CUDA device")
local ctx = ms.context { device = "cuda" }
local h = tensor.handle_ctx(ctx)

-- median milliseconds per call of fn(i) (i = 1, 2, ... rotates the buffer sets)
local time, release_timer = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/timing.lua")(ctx)

local results = {}
local function record(name, ms_time, bytes, flops, extra)
  local r = { name = name, ms = ms_time, bytes = bytes, flops = flops }
  for k, v in pairs(extra or {}) do r[k] = v end
  results[#results + 1] = r
  local rate = bytes and ("%8.1f GB/s"):format(bytes / ms_time / 1e6) or ("%8.1f TFLOP/s"):format(flops / ms_time / 1e9)
  print(("  %-44s %9.4f ms  %s"):format(name, ms_time, rate))
end

local function sets(n, make)
  local s = {}
  for i = 1, n do s[i] = make(i) end
  return s
end

print(("moonstep %s core bench on %s  [%s]"):format(ms.version, ctx:name(), ms.build_info))
ms.manual_seed(20261129)

-- 1. copy: 1 GiB f32 buffers, bytes read + written
do
  local n = 2 ^ 28
  local src = sets(2, function() return ms.rand({ n }, { ctx = ctx }) end)
  local dst = sets(2, function() return ms.empty({ n }, { ctx = ctx }) end)
  local t = time(function(i) dst[i % 2 + 1]:copy_(src[(i + 1) % 2 + 1]) end, 20)
  record("copy f32 1 GiB (d2d)", t, 2 * n * 4)
end

-- 2. fused elementwise: dst = a + 0.5 * b * c (f32, 256 MB each) and dst = lerp(a, b, w_t) (bf16, 256 MB each)
do
  local n = 2 ^ 26
  local a = sets(3, function() return ms.randn({ n }, { ctx = ctx }) end)
  local b = sets(3, function() return ms.randn({ n }, { ctx = ctx }) end)
  local c = sets(3, function() return ms.randn({ n }, { ctx = ctx }) end)
  local d = sets(3, function() return ms.empty({ n }, { ctx = ctx }) end)
  local t = time(function(i) local k = i % 3 + 1 ms.addcmul(a[k], b[k], c[k], 0.5, d[k]) end, 30)
  record("addcmul f32 64M (3 reads + 1 write)", t, 4 * n * 4)
  local m = 2 ^ 27
  local x = sets(3, function() return ms.randn({ m }, { ctx = ctx, dtype = "bf16" }) end)
  local y = sets(3, function() return ms.randn({ m }, { ctx = ctx, dtype = "bf16" }) end)
  local z = sets(3, function() return ms.empty({ m }, { ctx = ctx, dtype = "bf16" }) end)
  local w = ms.full({ 1 }, 0.1, { ctx = ctx })
  t = time(function(i) local k = i % 3 + 1 ms.lerp(x[k], y[k], w, z[k]) end, 30)
  record("lerp bf16 128M, device scalar (2 reads + 1 write)", t, 3 * m * 2)
end

-- 3. reductions: the whole of 1 GiB, and a 16384 x 16384 f32 matrix along rows and along columns
do
  local n = 2 ^ 28
  local x = sets(2, function() return ms.randn({ n }, { ctx = ctx }) end)
  local s = ms.empty({}, { ctx = ctx })
  local t = time(function(i) core.check(C.ms_reduce(h, tensor.handle(s), tensor.handle(x[i % 2 + 1]), C.MS_REDUCE_SUM,
                                                    C.MS_DIM_ALL)) end, 20)
  record("sum f32 1 GiB (whole)", t, n * 4)
  local m = x[1]:view(16384, 16384)
  local m2 = x[2]:view(16384, 16384)
  local r = ms.empty({ 16384 }, { ctx = ctx })
  local mats = { m, m2 }
  t = time(function(i) core.check(C.ms_reduce(h, tensor.handle(r), tensor.handle(mats[i % 2 + 1]), C.MS_REDUCE_SUM, 1)) end, 20)
  record("sum f32 16384x16384 along dim 1 (rows)", t, n * 4 + 16384 * 4)
  t = time(function(i) core.check(C.ms_reduce(h, tensor.handle(r), tensor.handle(mats[i % 2 + 1]), C.MS_REDUCE_NORM2, 0)) end, 20)
  record("norm f32 16384x16384 along dim 0 (columns)", t, n * 4 + 16384 * 4)
end

-- 4. batched matmul: bf16 16 x 4096^3 (f32 accumulation, bf16 out), TF32 228 x 1024^3 (the DASH stack)
do
  local function bench_mm(name, batch, n, dtype, tf32)
    local a = sets(2, function() return ms.randn({ batch, n, n }, { ctx = ctx, dtype = dtype }) end)
    local b = sets(2, function() return ms.randn({ batch, n, n }, { ctx = ctx, dtype = dtype }) end)
    local d = ms.empty({ batch, n, n }, { ctx = ctx, dtype = dtype })
    local o = { out = d, tf32 = tf32 }
    local t = time(function(i) local k = i % 2 + 1 ms.matmul(a[k], b[k], o) end, 10)
    record(name, t, nil, 2 * batch * n ^ 3)
  end
  bench_mm("matmul bf16 16x4096x4096x4096", 16, 4096, "bf16", false)
  bench_mm("matmul f32 TF32 228x1024x1024x1024", 228, 1024, "f32", true)
end

release_timer()
local st = ctx:mem_stats()
print(("  pool: %d driver allocations, %.1f MB cached, %d launches"):format(st.num_device_allocs,
      st.bytes_cached / 1e6, st.launches))
if out_path then
  local f = assert(io.open(out_path, "w"))
  f:write(json.encode({ device = ctx:name(), results = results }), "\n")
  f:close()
end
