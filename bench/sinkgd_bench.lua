--[[
bench/sinkgd_bench.lua -- the CUDA SinkGD step (ms.sinkgd_step, kernels/sinkgd.cu) against its floor, on the GPU
host: bf16 params and grads, sinkhorn_iters 5, base and spectral modes (unit target, 1 power step), on the shapes
of issue 5 and on the whole Llama-3-8B matrix set as one step.

  build/moonstep bench/sinkgd_bench.lua [results.json] [shape,shape,...|none] [set|f32set|noset]
  (a shape "MxN" is bf16; "f32:MxN" or "f16:MxN" gives params and grads that dtype; f32set: the Llama set with f32
  params and grads, as an AMP run has them, instead of bf16)
  python3 bench/torch_baselines/sinkgd.py ...        -- the pinned PyTorch baselines, own process

Method (DESIGN.md, "Performance"): CUDA events around R back-to-back steps, median of 7 trials (the set: 6) after a warm-up
(each shape also as one captured CUDA graph of a step per set, replayed: the GPU time without the host's); the
two modes' trials alternate (bench/timing.lua, `each`), so both run at the clocks the GPU's power cap allows at
that point -- timed one mode after the other, the set's spectral steps ran on a GPU the base steps had pushed
into its 700 W cap, which alone added 5-8 points to the spectral overhead;
lr 1e-3, weight decay 0, alpha 1 (the baseline's settings).  Each shape's steps rotate over enough (p, g, u)
sets that the sets together are at least 256 MB (4x the L2), so a step never finds its inputs in L2 from an
earlier step; within a step the passes do reuse G from L2 where it fits (4096x4096, 8x1408x2048 and the small
shapes, 8-46 MB), which is the kernel's design, not a measurement artefact.  The Llama set (224 matrices,
14 GB of params) is one set, far beyond L2.  Floor: the bytes the step must move at the device-to-device copy
bandwidth measured in this run: (L + 1) reads of G + a read and a write of p (spectral: + 2 reads of G per
power step), research/anchors-h200.md's definition.
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local graph = require("moonstep.graph")
local json = ms.json
local C = core.C
local ffi = core.ffi

local out_path = arg and arg[1]
local shape_arg = arg and arg[2] or "2048x2048,4096x4096,1024x4096,14336x4096,4096x14336,8x1408x2048"
local want_set = not (arg and arg[3] == "noset")
local set_dtype = arg and arg[3] == "f32set" and "f32" or "bf16"
assert(ms.device_count("cuda") > 0, "sinkgd_bench: no CUDA device")
local ctx = ms.context { device = "cuda" }
local h = tensor.handle_ctx(ctx)

-- median milliseconds per call of fn(i) (i = 1, 2, ... rotates the buffer sets)
local here = arg and arg[0] and arg[0]:match("^(.*)/") or "bench"
local time, release_timer, time_each = dofile(here .. "/timing.lua")(ctx)
local M = dofile(here .. "/measure.lua")   -- the floor's arithmetic (tests/bench_measure_spec.lua)

local ITERS, SN_ITERS, LR = 5, 1, 1e-3
print(("moonstep %s sinkgd bench on %s  [%s]"):format(ms.version, ctx:name(), ms.build_info))
ms.manual_seed(20261130)

-- copy bandwidth: 1 GiB f32 buffers, bytes read + written
local bw
do
  local n = 2 ^ 28
  local src = { ms.rand({ n }, { ctx = ctx }), ms.rand({ n }, { ctx = ctx }) }
  local dst = { ms.empty({ n }, { ctx = ctx }), ms.empty({ n }, { ctx = ctx }) }
  local t = time(function(i) dst[i % 2 + 1]:copy_(src[(i + 1) % 2 + 1]) end, 20)
  bw = 2 * n * 4 / (t * 1e-3)   -- bytes per second
  print(("  copy f32 1 GiB (d2d): %.4f ms, %.0f GB/s"):format(t, bw / 1e9))
  src, dst = nil, nil
  collectgarbage()
  core.check(C.ms_ctx_empty_cache(h))
end

local elem_bytes = M.elem_bytes

local function make_set(shapes, dtype)
  local s = { p = {}, g = {}, u = {} }
  for k, shape in ipairs(shapes) do
    s.p[k] = ms.randn(shape, { ctx = ctx, dtype = dtype })
    s.g[k] = ms.randn(shape, { ctx = ctx, dtype = dtype })
    local us = {}
    for d = 1, #shape - 2 do us[d] = shape[d] end
    us[#us + 1] = shape[#shape]
    s.u[k] = ms.rand(us, { ctx = ctx, low = -1, high = 1 })
  end
  return s
end

local function step(s, mode)
  ms.sinkgd_step { params = s.p, grads = s.g, specnorm_u = mode == "spectral" and s.u or nil, lr = LR,
                   mode = mode, iters = ITERS, sn_iters = SN_ITERS, target = "unit" }
end

local function floor_ms(gbytes, pbytes, mode)
  return M.floor_ms(M.sinkgd_floor_bytes(gbytes, pbytes, ITERS, mode == "spectral", SN_ITERS), bw)
end

local results = { device = ctx:name(), copy_GBps = bw / 1e9, iters = ITERS, rows = {} }
local function record(name, mb, mode, t, fl, nsets)
  local r = { name = name, MB = mb, mode = mode, ms = t, floor_ms = fl, ratio = t / fl, sets = nsets }
  results.rows[#results.rows + 1] = r
  print(("  %-26s %-8s %7.0f MB  %9.4f ms  floor %8.4f ms  x%.2f  (%d sets)"):format(name, mode, mb, t, fl, t / fl, nsets))
end

if shape_arg ~= "none" then
  for spec in shape_arg:gmatch("[^,]+") do
    -- "MxN" (bf16) or "f32:MxN" / "f16:MxN": params and grads of that dtype
    local dtype = spec:match("^(%a[%w]*):") or "bf16"
    local shape = {}
    for d in spec:gsub("^%a[%w]*:", ""):gmatch("%d+") do shape[#shape + 1] = tonumber(d) end
    local numel = 1
    for _, d in ipairs(shape) do numel = numel * d end
    local bytes = numel * elem_bytes(dtype)
    local nsets = math.max(2, math.ceil(256e6 / (2 * bytes)))
    local sets = {}
    for i = 1, nsets do sets[i] = make_set({ shape }, dtype) end
    local modes = { "base", "spectral" }
    local reps = math.max(10, math.min(200, math.floor(2e9 / (bytes * 10))))
    local calls, graphs = {}, {}
    for k, mode in ipairs(modes) do calls[k] = function(i) step(sets[(i - 1) % nsets + 1], mode) end end
    local t = time_each(calls, reps)
    for k, mode in ipairs(modes) do record(spec, bytes / 1e6, mode, t[k], floor_ms(bytes, bytes, mode), nsets) end
    -- the same steps replayed from one CUDA graph a mode (one step per set, in order): the GPU's time without
    -- the host's per-call work, which bounds the small shapes above
    for k, mode in ipairs(modes) do
      -- (run once first: the graphs captured before hold the pool's cached blocks, and a capture cannot allocate)
      for i = 1, nsets do step(sets[i], mode) end
      ctx:sync()
      local okg, gr = pcall(graph.capture, ctx, function() for i = 1, nsets do step(sets[i], mode) end end)
      if not okg then print("  graph capture failed: " .. tostring(gr)) break end
      graphs[k] = gr
      calls[k] = function() gr:launch() end
    end
    if #graphs == #modes then
      local tg = time_each(calls, math.max(3, math.ceil(reps / nsets)))
      for k, mode in ipairs(modes) do
        record(spec, bytes / 1e6, mode .. "/graph", tg[k] / nsets, floor_ms(bytes, bytes, mode), nsets)
      end
    end
    for _, gr in ipairs(graphs) do gr:free() end
    sets = nil
    collectgarbage()
    core.check(C.ms_ctx_empty_cache(h))
  end
end

if want_set then
  local layer = { { 4096, 4096 }, { 1024, 4096 }, { 1024, 4096 }, { 4096, 4096 }, { 14336, 4096 }, { 14336, 4096 },
                  { 4096, 14336 } }
  local shapes = {}
  for _ = 1, 32 do for _, s in ipairs(layer) do shapes[#shapes + 1] = s end end
  local s = make_set(shapes, set_dtype)
  local bytes = 0
  for _, sh in ipairs(shapes) do bytes = bytes + sh[1] * sh[2] * elem_bytes(set_dtype) end
  local t = time_each({ function() step(s, "base") end, function() step(s, "spectral") end }, 3, 6)
  local name = set_dtype == "f32" and "llama3-8b set f32 (224)" or "llama3-8b set (224)"
  record(name, bytes / 1e6, "base", t[1], floor_ms(bytes, bytes, "base"), 1)
  record(name, bytes / 1e6, "spectral", t[2], floor_ms(bytes, bytes, "spectral"), 1)
end

release_timer()
local st = ctx:mem_stats()
print(("  pool: %d driver allocations, %.1f MB cached, %d launches"):format(st.num_device_allocs,
      st.bytes_cached / 1e6, st.launches))
if out_path then
  local f = assert(io.open(out_path, "w"))
  f:write(json.encode(results), "\n")
  f:close()
end
