--[[
bench/overhead.lua -- the host's overhead per optimizer step, captured (opt:capture(): one CUDA graph replay
per step) against uncaptured, on the GPU host (issue 7, item 3; target: under 50 us captured).

  build/moonstep bench/overhead.lua [results.json|-] [llama,small] [steps]

Models:
  llama   the Llama-3-8B matrix set under SinkGD (recipe sinkgd, base mode, 5 SR-Sinkhorn iterations): 32 layers
          of q 4096x4096, k and v 1024x4096, o 4096x4096, gate and up 14336x4096, down 4096x14336; bf16 params
          and grads (224 matrices, 7.0e9 parameters: 14 GB of params + 14 GB of grads)
  small   300 small tensors under AdamW (f32): 100 each of [256, 256], [1024] and [64, 384]

Modes, each a fresh optimizer over the same tensors (default settings: nonfinite = "skip"):
  host      uncaptured; the non-finite check reads the gradients' sums of squares back (one wait per step)
  device    uncaptured with settings.device_checks: the check runs on the device, the step never waits
  captured  opt:capture(): after the warm-up and capturing steps, each step replays one graph, which advances
            the device's step number itself; while nothing changed since the previous step (no set_grad, a
            constant lr) the call is a bare replay (optim.lua's Optimizer:_replay; the C embedding replays
            without entering Lua at all)

Method (DESIGN.md, "Performance"; medians, after 3 warm-up steps per mode):
  gpu       the device time of one step: CUDA events around opt:step() of the captured optimizer queued
            behind ~2 ms of other GPU work, so that the host has queued the whole step before the first event
            runs and the events time only the step's kernels (the same kernels every mode runs)
  call      host wall time of the opt:step() call alone (CLOCK_MONOTONIC), after a synchronisation and then 32
            tiny kernels queued, as the tail of a trainer's backward pass is: the time the trainer's thread
            spends in it; for "host" it includes the wait for the check's read-back.  (The first few launches
            after a pause of ~80 ms -- one Llama step's GPU time -- cost 30-95 us each of driver time on the H200
            host whatever the launch, measured by probes (bench/RESULTS.md, "overhead"): a cost of the pause,
            which the backward pass's own launches absorb in training.)
  overhead  host wall time from the call's start to the end of the step's work (a synchronisation right
            after the call), minus gpu: what a step costs beyond its GPU work when nothing else hides it
            (it includes the synchronisation's own wake-up latency, a few us)
  pipelined wall time per step of `steps` back-to-back steps without synchronisation, minus gpu (floor 0):
            ~0 when the host keeps ahead of the GPU
The target (issue 7: under 50 us captured) is judged on call, the host time a step costs the trainer's
thread.  On the 83 ms Llama step, overhead and pipelined also hold what is not the host's: the step's GPU time
varies by ~0.1% (80 us) between runs, and a step started on an idle GPU waits for the GPU to start.
Captured mode also prints where a full (not bare) replay's host time goes (medians over `steps` more steps,
from an idle GPU):
  prelude   lr, the runs and the plan key              scalars  writing lr_t / step_t (a launch each that
  checks    does the graph still fit its members                changed; the lr is constant here)
  launch    the graph launch (ms_graph_launch)          total    the whole opt:step() call
  and, each alone: one ms_graph_launch of the step's graph (with its node count), one ms_fill of a device
  scalar, and `paired`: the overhead with each step's gpu time measured just before it behind the blocker
  (removes the drift of a long step's GPU time between the gpu column's run and the step's).
The GC runs as it would in training.  Results go to results.json when a path is given.
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C

local out_path = arg and arg[1] ~= "-" and arg[1] or nil
local which = arg and arg[2] or "llama,small"
local steps_arg = tonumber(arg and arg[3])
assert(ms.device_count("cuda") > 0, "overhead: no CUDA device")
local ctx = ms.context { device = "cuda" }
local h = tensor.handle_ctx(ctx)

local function now_us() return core.clock() * 1e6 end

local ev = ffi.new("ms_event *[2]")
core.check(C.ms_event_new(h, ev))
core.check(C.ms_event_new(h, ev + 1))
local ev0, ev1 = ffi.gc(ev[0], C.ms_event_free), ffi.gc(ev[1], C.ms_event_free)
local elapsed = ffi.new("double[1]")

local function median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

print(("moonstep %s host-overhead bench on %s  [%s]"):format(ms.version, ctx:name(), ms.build_info))
ms.manual_seed(20261201)

-- the tail of the trainer's backward pass before opt:step() (see "call" above)
local primer = ms.zeros({ 1 }, { ctx = ctx })
local function prime() for i = 1, 32 do primer:fill_(i) end end

-- ~2 ms of GPU work to queue a step behind (a 512 MiB buffer scaled in place, 8 times)
local blocker = ms.ones({ 2 ^ 27 }, { ctx = ctx })
local function block() for _ = 1, 8 do blocker:mul_(1) end end

local models = {}

function models.llama()
  local shapes = {
    { "self_attn.q_proj", { 4096, 4096 } }, { "self_attn.k_proj", { 1024, 4096 } }, { "self_attn.v_proj", { 1024, 4096 } },
    { "self_attn.o_proj", { 4096, 4096 } }, { "mlp.gate_proj", { 14336, 4096 } }, { "mlp.up_proj", { 14336, 4096 } },
    { "mlp.down_proj", { 4096, 14336 } },
  }
  local params = {}
  for layer = 0, 31 do
    for k, s in ipairs(shapes) do
      params[#params + 1] = {
        name = ("model.layers.%d.%s.weight"):format(layer, s[1]),
        param = ms.randn(s[2], { dtype = "bf16", ctx = ctx, std = 0.02, seed = layer * 16 + k }),
        grad = ms.randn(s[2], { dtype = "bf16", ctx = ctx, std = 1e-3, seed = 1000 + layer * 16 + k }),
      }
    end
  end
  return { name = "llama", recipe = "sinkgd", options = { lr = 1e-3 }, params = params, steps = 30 }
end

function models.small()
  local shapes = { { 256, 256 }, { 1024 }, { 64, 384 } }
  local params = {}
  for i = 1, 300 do
    local s = shapes[(i - 1) % 3 + 1]
    params[i] = {
      name = ("small.%d"):format(i),
      param = ms.randn(s, { ctx = ctx, std = 0.02, seed = i }),
      grad = ms.randn(s, { ctx = ctx, std = 1e-3, seed = 5000 + i }),
    }
  end
  return { name = "small", recipe = "adamw", options = { lr = 1e-3, weight_decay = 0.01 }, params = params, steps = 300 }
end

local function print_row(r)
  print(("%-6s %-9s %6d %12.3f %12.1f %12.1f %12.1f %9d%s"):format(r.model, r.mode, r.steps, r.gpu_ms, r.call_us,
        r.overhead_us, r.pipelined_us, r.launches,
        r.mode == "captured" and (r.call_us < 50 and "   (target < 50 us of host time: met)" or "   (target < 50 us of host time: NOT met)") or ""))
end

local function fmt_parts(b)
  return ("prelude %.1f  scalars %.1f  checks %.1f  launch %.1f  total %.1f"):format(b.prelude, b.scalars, b.checks,
         b.launch, b.total)
end

-- where a captured replay's host time goes (see the header); r gets the numbers
local function breakdown(opt, n, r)
  local parts = { prelude = {}, scalars = {}, checks = {}, launch = {}, total = {} }
  opt.host_clock = now_us
  for i = 1, n do
    ctx:sync()
    prime()
    opt.fast = nil        -- the full replay path (the bare replay that steps take otherwise has no parts)
    opt:step()
    local hu = assert(opt.last.host_us, "the optimizer gave no host_us breakdown")
    for k, v in pairs(parts) do v[i] = hu[k] end
  end
  opt.host_clock = nil
  local b = {}
  for k, v in pairs(parts) do b[k] = median(v) end
  -- the graph launch alone, and one device-scalar fill alone
  local e = opt.graphs.step
  local launch, fill, paired = {}, {}, {}
  local scalar = ms.zeros({ 1 }, { ctx = ctx })   -- not the optimizer's own step_t: the graphs advance that one
  for i = 1, n do
    ctx:sync()
    prime()
    local t0 = now_us()
    core.check(C.ms_graph_launch(h, e.graph.h))
    launch[i] = now_us() - t0
    ctx:sync()
    prime()
    t0 = now_us()
    scalar:fill_(i)
    fill[i] = now_us() - t0
  end
  -- paired: each step's gpu time behind the blocker, then the same step from an idle GPU
  for i = 1, math.min(n, 15) do
    ctx:sync()
    block()
    core.check(C.ms_event_record(h, ev0))
    opt:step()
    core.check(C.ms_event_record(h, ev1))
    core.check(C.ms_event_elapsed(ev0, ev1, elapsed))
    local g = elapsed[0]
    ctx:sync()
    local t0 = now_us()
    opt:step()
    ctx:sync()
    paired[i] = now_us() - t0 - g * 1e3
  end
  r.host_us = b
  r.graph_launch_us, r.fill_us, r.paired_overhead_us = median(launch), median(fill), median(paired)
  r.graph_nodes = e.graph:num_nodes()
  print(("         host us: %s | alone: ms_graph_launch %.1f (%d nodes), ms_fill %.1f | paired overhead %.1f")
        :format(fmt_parts(b), r.graph_launch_us, r.graph_nodes, r.fill_us, r.paired_overhead_us))
end

local function measure(model, mode, gpu_ms)
  local settings = { ctx = ctx, device_checks = mode == "device" }
  local opt = ms.optim.new(model.recipe, model.params, model.options, settings)
  if mode == "captured" then opt:capture() end
  for _ = 1, 3 do opt:step() end
  ctx:sync()
  collectgarbage()
  local n = steps_arg or model.steps
  local calls, totals = {}, {}
  for i = 1, n do
    ctx:sync()
    prime()
    local t0 = now_us()
    opt:step()
    local t1 = now_us()
    ctx:sync()
    local t2 = now_us()
    calls[i], totals[i] = t1 - t0, t2 - t0
  end
  ctx:sync()
  local t0 = now_us()
  for _ = 1, n do opt:step() end
  ctx:sync()
  local per_step = (now_us() - t0) / n
  local st = opt:stats()
  assert(st.skipped_steps == 0, "a step was skipped: the gradients must be finite")
  if mode == "captured" then
    assert(st.captures == 1 and st.graphs.step, "the captured optimizer replays one graph")
    assert(opt.last.captured == "step")
  end
  local r = {
    model = model.name, mode = mode, steps = n, gpu_ms = gpu_ms, call_us = median(calls),
    overhead_us = median(totals) - gpu_ms * 1e3, pipelined_us = math.max(0, per_step - gpu_ms * 1e3),
    launches = opt.last.launches,
  }
  print_row(r)
  if mode == "captured" then breakdown(opt, n, r) end
  opt:uncapture()
  return r
end

-- the device time of one step: a captured replay queued behind the blocker
local function gpu_time(model)
  local opt = ms.optim.new(model.recipe, model.params, model.options, { ctx = ctx }):capture()
  for _ = 1, 3 do opt:step() end
  local t = {}
  for i = 1, 11 do
    ctx:sync()
    block()
    core.check(C.ms_event_record(h, ev0))
    opt:step()
    core.check(C.ms_event_record(h, ev1))
    core.check(C.ms_event_elapsed(ev0, ev1, elapsed))
    t[i] = elapsed[0]
  end
  opt:uncapture()
  return median(t)
end

local results = {}
print(("%-6s %-9s %6s %12s %12s %12s %12s %9s"):format("model", "mode", "steps", "gpu ms", "call us", "overhead us",
      "pipelined us", "launches"))
for name in which:gmatch("[^,]+") do
  assert(models[name], "unknown model '" .. name .. "' (llama, small)")
  local model = models[name]()
  local g = gpu_time(model)
  for _, mode in ipairs { "host", "device", "captured" } do
    local r = measure(model, mode, g)
    results[#results + 1] = r
  end
  model.params = nil
  collectgarbage()
  collectgarbage()
  core.check(C.ms_ctx_empty_cache(h))
end

if out_path then
  local f = assert(io.open(out_path, "w"))
  f:write(ms.json.encode({ device = ctx:name(), version = ms.version, build = ms.build_info, results = results }))
  f:close()
  print("results: " .. out_path)
end
