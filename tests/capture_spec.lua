-- Captured optimizer steps (opt:capture(), moonstep.optim "Captured steps"), their device-side checks,
-- timings and profiler ranges.
--
-- On the CPU: the clear refusals (capture on a CPU context, settings, the capture ABI), and the captured
-- steps' semantics run uncaptured (settings.device_checks: the non-finite flag, the norm and the clip factor
-- computed by tensor ops, ctx.skip_t handed to the recipe), checked bit for bit against the host path, plus
-- the timings with the host clock.  On a GPU (cuda_it, pending elsewhere): captured SGD, AdamW and SinkGD
-- steps against uncaptured ones bit for bit under a schedule, re-capture when a gradient's memory moves,
-- non-finite gradients skipped by a replay, one graph per plan key, no driver allocation during replays,
-- timings of replays, and steps recorded inside a moonstep capture and inside the stream owner's capture.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local graph = require("moonstep.graph")
local ffi, C = core.ffi, core.C

local cuda_it = H.cuda_it
local CPU = ms.device("cpu")
local NaN = 0 / 0

-- ---------------------------------------------------------------------------------------------------
-- helpers
-- ---------------------------------------------------------------------------------------------------
-- parameters {name, shape, dtype, tags} on ctx from one seed, twice: the same values in two independent sets
local function model(ctx, spec)
  local a, b = {}, {}
  for i, s in ipairs(spec) do
    local p = ms.randn(s[2], { dtype = s[3] or "f32", seed = H.seed(), ctx = ctx, std = 0.5 })
    a[i] = { name = s[1], param = p, grad = ms.zeros(s[2], { dtype = s[3] or "f32", ctx = ctx }), tags = s[4] }
    b[i] = { name = s[1], param = p:clone(), grad = ms.zeros(s[2], { dtype = s[3] or "f32", ctx = ctx }), tags = s[4] }
  end
  return a, b
end

-- this step's gradients: fresh random values, the same in every set given
local function fill_grads(seed, ...)
  for _, set in ipairs { ... } do
    for i, p in ipairs(set) do
      p.grad:copy_(ms.randn(p.param:shape(), { seed = seed, offset = i, ctx = p.param:context() }))
    end
  end
end

local function values(set)
  local out = {}
  for i, p in ipairs(set) do out[i] = p.param:tolist_flat() end
  return out
end

-- every state tensor of an optimizer, by checkpoint name, as flat value lists
local function state_values(opt)
  local tensors = opt:_state_entries()
  local out = {}
  for name, t in pairs(tensors) do out[name] = t:tolist_flat() end
  return out
end

-- asserts bit-identical values (NaN anywhere fails: NaN ~= NaN)
local function same_bits(got, want, what)
  for i = 1, #want do
    local g, w = got[i], want[i]
    if type(w) == "table" then same_bits(g, w, what .. "[" .. i .. "]")
    elseif not (g == w) then error(("%s: element %d is %.17g, expected %.17g"):format(what, i, g or NaN, w), 2) end
  end
  assert.equals(#want, #got, what .. ": length")
end

local function same_states(a, b, what)
  local sa, sb = state_values(a), state_values(b)
  local n = 0
  for name, v in pairs(sb) do
    assert.truthy(sa[name], what .. ": state " .. name .. " missing")
    same_bits(sa[name], v, what .. " state " .. name)
    n = n + 1
  end
  return n
end

local SCHEDULE = { kind = "cosine", warmup_steps = 2, total_steps = 8 }

-- ---------------------------------------------------------------------------------------------------
describe("capture on the CPU", function()
  it("refuses to capture a CPU optimizer with the engine's MS_E_UNSUPPORTED, and keeps working", function()
    local set = model(CPU, { { "w", { 4, 3 } } })
    local opt = ms.optim.new("sgd", set, { lr = 0.1 })
    local err = H.expect_error(function() opt:capture() end, "capture: the optimizer runs on cpu",
                               "cannot capture graphs", "CUDA contexts only")
    -- the engine's own message is inside, so the embedding API reports the engine's status
    assert.truthy(err:find(ffi.string(C.ms_last_error()), 1, true), err)
    assert.equals(C.MS_E_UNSUPPORTED, tonumber(C.ms_graph_begin(T.handle_ctx(CPU))))
    assert.is_nil(opt.graphs)
    fill_grads(H.seed(), set)
    assert.is_true(opt:step())
    assert.is_false(opt:stats().captured)
    opt:uncapture()                                   -- nothing captured: a no-op
    assert.is_true(opt:step())
  end)

  it("validates the capture, timing and device-check settings, naming them", function()
    local set = model(CPU, { { "w", { 3 } } })
    H.expect_error(function() ms.optim.new("sgd", set, {}, { capture_on_change = "maybe" }) end,
                   "capture_on_change must be 'recapture' or 'error'", "maybe")
    H.expect_error(function() ms.optim.new("sgd", set, {}, { timings = "often" }) end, "setting timings must be a boolean")
    H.expect_error(function() ms.optim.new("sgd", set, {}, { device_checks = 3 }) end, "setting device_checks must be a boolean")
    H.expect_error(function() ms.optim.new("sgd", set, {}, { device_checks = true, nonfinite = "raise" }) end,
                   "device_checks", "'raise'")
    local err = H.expect_error(function() ms.optim.new("sgd", set, {}, { timingz = true }) end, "unknown setting 'timingz'")
    for _, name in ipairs { "timings", "device_checks", "capture_on_change" } do
      assert.truthy(err:find(name, 1, true), name .. " missing from: " .. err)
    end
    local opt = ms.optim.new("sgd", set, {}, { capture_on_change = "error", timings = true, device_checks = false })
    assert.equals("error", opt.settings.capture_on_change)
    assert.equals("recapture", ms.optim.new("sgd", set).settings.capture_on_change)
  end)

  it("answers the capture ABI on the CPU: not capturing, joins refused, profiler ranges are no-ops", function()
    local h = T.handle_ctx(CPU)
    assert.equals(C.MS_CAPTURE_NONE, tonumber(C.ms_ctx_is_capturing(h)))
    assert.equals(C.MS_CAPTURE_NONE, tonumber(C.ms_ctx_is_capturing(nil)))
    assert.equals(C.MS_E_UNSUPPORTED, tonumber(C.ms_graph_join(h)))
    assert.truthy(ffi.string(C.ms_last_error()):find("ms_graph_join: cpu has no graph capture", 1, true))
    assert.equals(C.MS_E_UNSUPPORTED, tonumber(C.ms_graph_leave(h)))
    assert.equals(C.MS_E_ARG, tonumber(C.ms_graph_join(nil)))
    assert.equals(C.MS_E_ARG, tonumber(C.ms_graph_leave(nil)))
    C.ms_profile_push(h, "moonstep:spec")
    C.ms_profile_pop(h)
    C.ms_profile_push(nil, nil)
    C.ms_profile_pop(nil)
    assert.equals("none", graph.state("cpu"))
    local ran = false
    H.expect_error(function() graph.join("cpu", function() ran = true end) end, "no graph capture")
    assert.is_false(ran)
    assert.equals(graph, ms.graph)
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("device-checked steps (the captured steps' semantics, uncaptured)", function()
  local cases = {
    { "sgd", { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.01 } },
    { "adamw", { lr = 0.01, weight_decay = 0.1 } },
    { "sinkgd", { lr = 0.02, sinkgd_spectral_norm = true } },
    { "adamw", { lr = 0.01 }, "bf16", { master_weights = true, stats = true } },
  }
  for _, case in ipairs(cases) do
    it(("match the host path bit for bit under a schedule (%s%s)"):format(case[1], case[3] and ", bf16 with f32 masters" or ""), function()
      local dt = case[3]
      local spec = { { "layers.0.weight", { 12, 10 }, dt }, { "layers.1.weight", { 10, 12 }, dt }, { "norm", { 10 }, dt },
                     { "bias", { 12 }, dt } }
      local a, b = model(CPU, spec)
      local s1, s2 = { schedule = SCHEDULE }, { schedule = SCHEDULE, device_checks = true }
      for k, v in pairs(case[4] or {}) do s1[k], s2[k] = v, v end
      local host = ms.optim.new(case[1], a, case[2], s1)
      local dev = ms.optim.new(case[1], b, case[2], s2)
      for step = 1, 6 do
        local seed = H.seed()
        fill_grads(seed, a, b)
        assert.is_true(host:step())
        assert.is_nil(dev:step(), "a device-checked step is decided on the device")
        assert.is_nil(dev.last.skipped)
        local st = dev:stats()
        assert.is_false(st.last.skipped)
        H.assert_close(st.last.grad_norm, host.last.grad_norm, 1e-12, 0, "grad norm, step " .. step)
        same_bits(values(b), values(a), case[1] .. " params after step " .. step)
        if case[4] then
          assert.equals(host.last.update_norms["bias"], dev.last.update_norms["bias"])
          assert.is_true(dev.last.update_norms["bias"] > 0)
        end
      end
      assert.is_true(same_states(dev, host, case[1]) > 0 or case[1] == "sgd")
      assert.equals(0, dev:stats().skipped_steps)
      assert.equals(6, dev:stats().step)
    end)
  end

  it("skip a step with non-finite gradients on the device, count it, and keep the count in checkpoints", function()
    local a, b = model(CPU, { { "w", { 5, 4 } }, { "v", { 7 } } })
    local host = ms.optim.new("sgd", a, { lr = 0.1, momentum = 0.9 })
    local dev = ms.optim.new("sgd", b, { lr = 0.1, momentum = 0.9 }, { device_checks = true })
    fill_grads(H.seed(), a, b)
    host:step()
    dev:step()
    local p0, s0 = values(b), state_values(dev)
    b[2].grad[3] = NaN
    assert.is_nil(dev:step())
    same_bits(values(b), p0, "params after a skipped step")
    same_bits(state_values(dev)["param/w/momentum_buffer"], s0["param/w/momentum_buffer"], "momentum after a skipped step")
    local st = dev:stats()
    assert.is_true(st.last.skipped)
    assert.is_nil(st.last.grad_norm)
    assert.equals(1, st.skipped_steps)
    assert.equals(2, st.step, "a skipped device-decided step still advances the step count")
    -- the next finite step applies, as the host path's second step does
    local seed = H.seed()
    fill_grads(seed, a, b)
    host:step()
    dev:step()
    same_bits(values(b), values(a), "params after the skip")
    assert.is_false(dev:stats().last.skipped)
    -- the device's count survives a checkpoint
    local path = os.tmpname()
    dev:save(path)
    local c = model(CPU, { { "w", { 5, 4 } }, { "v", { 7 } } })
    local again = ms.optim.new("sgd", c, { lr = 0.1, momentum = 0.9 }, { device_checks = true })
    again:load(path)
    os.remove(path)
    assert.equals(1, again:stats().skipped_steps)
  end)

  it("read the flag back on a route's first device-checked step, so a first non-finite step is caught", function()
    local set = model(CPU, { { "w", { 6 } } })
    local opt = ms.optim.new("adamw", set, { lr = 0.1 }, { device_checks = true })
    set[1].grad:fill_(1 / 0)
    local p0 = values(set)
    assert.is_false(opt:step(), "known on the host: the step was verified")
    same_bits(values(set), p0, "params")
    assert.same({ 0, 0, 0, 0, 0, 0 }, opt.members[1].state.exp_avg:tolist_flat())
    assert.equals(1, opt:stats().skipped_steps)
  end)

  it("clip and unscale on the device as the host path does", function()
    for _, clip in ipairs { 0.5, 1e6 } do
      local a, b = model(CPU, { { "w", { 6, 5 } }, { "v", { 4 } } })
      local host = ms.optim.new("sgd", a, { lr = 1 }, { clip_grad_norm = clip })
      local dev = ms.optim.new("sgd", b, { lr = 1 }, { clip_grad_norm = clip, device_checks = true })
      for _ = 1, 3 do
        local seed = H.seed()
        fill_grads(seed, a, b)
        for _, set in ipairs { a, b } do for _, p in ipairs(set) do p.grad:mul_(8) end end
        host:step { grad_scale = 8 }
        dev:step { grad_scale = 8 }
        local st = dev:stats()
        H.assert_close(st.last.grad_norm, host.last.grad_norm, 1e-12, 0, "grad norm")
        assert.equals(host.last.clipped, st.last.clipped)
        if clip > 1 then
          same_bits(values(b), values(a), "unclipped params")      -- a factor of exactly 1 changes nothing
        else
          local va, vb = values(a), values(b)
          for i = 1, #va do H.assert_close(vb[i], va[i], 1e-6, 1e-7, "clipped params") end
        end
      end
      assert.equals(clip < 1, host.last.clipped == true)
    end
  end)

  it("refuse a route that does not read ctx.skip_t after its verified step, then run on the host path", function()
    local a, b = model(CPU, { { "w", { 4, 4 } } })
    local host = ms.optim.new("lion", a, { lr = 0.01 })
    local dev = ms.optim.new("lion", b, { lr = 0.01 }, { device_checks = true })
    fill_grads(H.seed(), a, b)
    host:step()
    H.expect_error(function() dev:step() end, "route 'lion' of recipe lion does not read ctx.skip_t",
                   "skip = ctx.skip_t", "nonfinite = 'apply'")
    same_bits(values(b), values(a), "the verified step was applied")
    assert.equals(1, dev.step_count)
    assert.is_false(dev.settings.device_checks)
    fill_grads(H.seed(), a, b)
    host:step()
    assert.is_true(dev:step())
    same_bits(values(b), values(a), "host path afterwards")
    -- without a skip flag there is nothing to honour: device-checked lion runs, and is known applied
    local c, d = model(CPU, { { "w", { 4, 4 } } })
    local h2 = ms.optim.new("lion", c, { lr = 0.01 }, { nonfinite = "apply", clip_grad_norm = 0.1 })
    local d2 = ms.optim.new("lion", d, { lr = 0.01 }, { nonfinite = "apply", clip_grad_norm = 0.1, device_checks = true })
    fill_grads(H.seed(), c, d)
    assert.is_true(h2:step())
    assert.is_true(d2:step())
    local vc, vd = values(c), values(d)
    for i = 1, #vc do H.assert_close(vd[i], vc[i], 1e-6, 1e-7, "lion clipped") end
  end)

  it("hand ctx.skip_t to the recipe only in device-checked steps, behind a protected metatable", function()
    local seen = {}
    local recipe = {
      name = "probe", options = { lr = { default = 0.1, type = "number" } },
      route = function() return "r" end,
      routes = { r = { step = function(group, o, ctx)
        seen[#seen + 1] = { skip = ctx.skip_t, value = ctx.skip_t and ctx.skip_t:item(), mt = getmetatable(ctx) }
        ms.sgd_step { params = { group[1].param }, grads = { group[1].grad }, lr = ctx.lr_t, skip = ctx.skip_t }
      end } },
    }
    local a, b = model(CPU, { { "w", { 3 } } })
    ms.optim.new(recipe, a):step()
    ms.optim.new(recipe, b, {}, { device_checks = true }):step()
    assert.is_nil(seen[1].skip)
    assert.is_true(ms.is_tensor(seen[2].skip))
    assert.equals(0, seen[2].value)
    assert.equals("moonstep.step_ctx", seen[2].mt)
  end)

  it("prepare_replay writes the next step's learning rate and step number and counts the step", function()
    local set = model(CPU, { { "w", { 3 } } })
    local opt = ms.optim.new("adamw", set, { lr = 0.2 }, { schedule = { kind = "linear_warmup", warmup_steps = 4 } })
    local want = opt:get_lr()
    opt:prepare_replay()
    assert.equals(1, opt.step_count)
    H.assert_close(opt.lr_t:item(), want, 1e-7, 0, "lr_t")
    assert.equals(1, opt.step_t:item())
    opt:prepare_replay { grad_scale = 4 }
    assert.equals(2, opt.step_t:item())
    assert.equals(0.25, opt:_checks(1).inv:item())
    H.expect_error(function() opt:prepare_replay { grad_scale = 0 } end, "grad_scale must be a positive finite number")
    assert.equals(2, opt.step_count)
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("timings", function()
  it("are reported per route with the host clock on the CPU, read lazily, over more steps than the ring", function()
    local set = model(CPU, { { "layers.0.weight", { 24, 16 } }, { "layers.0.bias", { 24 } } })
    for _, device_checks in ipairs { false, true } do
      local opt = ms.optim.new("sinkgd", set, { lr = 1e-3 }, { timings = true, device_checks = device_checks })
      local n = 40
      local t0 = os.clock()
      for _ = 1, n do
        fill_grads(H.seed(), set)
        opt:step()
      end
      local cpu_ms = (os.clock() - t0) * 1e3
      assert.is_nil(opt.last.timings, "not read before stats()")
      local st = opt:stats()
      local t = st.timings
      assert.equals(n, t.step.steps)
      assert.equals(n, t.checks.steps)
      for _, route in ipairs { "sinkgd", "adamw" } do
        local r = t.routes[route]
        assert.equals(n, r.steps, route)
        assert.is_true(r.total_ms > 0 and r.min_ms > 0 and r.min_ms <= r.mean_ms and r.mean_ms <= r.max_ms, route)
        H.assert_close(r.mean_ms, r.total_ms / n, 1e-12, 0, route .. " mean")
        assert.equals(r.last_ms, st.last.timings.routes[route])
      end
      -- the routes and the checks fit inside the steps, which fit inside the wall time of the loop (the
      -- process's CPU time bounds the single-threaded host clock's span from above, with slack for OpenMP)
      assert.is_true(t.routes.sinkgd.total_ms + t.routes.adamw.total_ms + t.checks.total_ms <= t.step.total_ms * (1 + 1e-9))
      assert.is_true(t.step.total_ms <= cpu_ms * 64 + 50, ("%g ms of steps in %g ms of CPU time"):format(t.step.total_ms, cpu_ms))
      assert.equals(opt.last.step, st.last.timings.step)
      assert.is_nil(t.graph)
    end
  end)

  it("are absent unless asked for", function()
    local set = model(CPU, { { "w", { 3 } } })
    local opt = ms.optim.new("sgd", set)
    fill_grads(H.seed(), set)
    opt:step()
    assert.is_nil(opt:stats().timings)
    assert.is_nil(opt.timing)
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- CUDA
-- ---------------------------------------------------------------------------------------------------
local GPU = H.has_cuda and ms.device("cuda") or nil

-- a reference optimizer (uncaptured, host checks) and a captured one over the same parameters
local function pair(recipe, spec, options, settings, ctx)
  ctx = ctx or GPU
  local a, b = model(ctx, spec)
  local s1, s2 = {}, {}
  for k, v in pairs(settings or {}) do s1[k], s2[k] = v, v end
  s1.ctx, s2.ctx = ctx, ctx
  local ref = ms.optim.new(recipe, a, options, s1)
  local cap = ms.optim.new(recipe, b, options, s2):capture()
  return ref, cap, a, b
end

local LLAMA_LIKE = {
  { "layers.0.self_attn.q_proj.weight", { 64, 64 }, "bf16" }, { "layers.0.self_attn.k_proj.weight", { 16, 64 }, "bf16" },
  { "layers.0.mlp.down_proj.weight", { 64, 160 }, "bf16" }, { "layers.0.input_layernorm.weight", { 64 }, "bf16" },
  { "embed_tokens.weight", { 96, 64 }, "bf16" },
}

describe("captured steps on CUDA", function()
  local cases = {
    { "sgd", { { "w", { 33, 17 } }, { "b", { 17 } }, { "h", { 8, 8 }, "bf16" } }, { lr = 0.05, momentum = 0.9, weight_decay = 0.01 } },
    { "adamw", { { "w", { 33, 17 } }, { "b", { 17 } }, { "h", { 8, 8 }, "bf16" } }, { lr = 0.01, weight_decay = 0.1 } },
    { "sinkgd", LLAMA_LIKE, { lr = 0.02, sinkgd_spectral_norm = true, bf16_stochastic_round = true } },
  }
  for _, case in ipairs(cases) do
    cuda_it(("replay %s bit for bit with uncaptured steps under a schedule"):format(case[1]), function()
      local ref, cap, a, b = pair(case[1], case[2], case[3], { schedule = SCHEDULE })
      for step = 1, 7 do
        fill_grads(H.seed(), a, b)
        assert.is_true(ref:step())
        assert.is_nil(cap:step())
        if step == 1 then assert.is_nil(cap.last.captured, "the first step of a key runs uncaptured")
        else assert.equals("step", cap.last.captured) end
        assert.equals(step == 2, cap.last.capture == true, "captured on the second step")
        assert.equals(step, cap.step_t:item(), "step_t: the graph advances it itself")
        same_bits(values(b), values(a), ("%s params after step %d"):format(case[1], step))
      end
      assert.is_true(same_states(cap, ref, case[1]) > 0 or case[1] == "sgd")
      local st = cap:stats()
      assert.is_false(st.last.skipped)
      H.assert_close(st.last.grad_norm, ref.last.grad_norm, 1e-12, 0, "grad norm")
      assert.equals(1, st.captures)
      assert.equals(0, st.recaptures)
      assert.is_true(st.graphs.step > 0, "nodes in the graph")
      H.assert_close(cap.lr_t:item(), ref.last.lr, 1e-7, 0, "lr_t holds the last step's scheduled lr")
      cap:uncapture()
      assert.is_nil(cap:stats().graphs)
      fill_grads(H.seed(), a, b)
      ref:step()
      assert.is_true(cap:step(), "uncaptured again: the host path")
      same_bits(values(b), values(a), "after uncapture")
    end)
  end

  cuda_it("re-capture when a gradient's memory moves, adopt a gradient over the same memory, or refuse", function()
    local spec = { { "w", { 20, 12 } }, { "v", { 12 } } }
    local ref, cap, a, b = pair("adamw", spec, { lr = 0.01 })
    for _ = 1, 3 do fill_grads(H.seed(), a, b) ref:step() cap:step() end
    assert.equals("step", cap.last.captured)
    -- the same memory through another tensor object: the graph still fits
    local view = b[1].grad:view({ 240 }):view({ 20, 12 })
    cap:set_grad("w", view)
    fill_grads(H.seed(), a, b)
    ref:step() cap:step()
    assert.equals("step", cap.last.captured)
    assert.is_nil(cap.last.recaptured)
    -- new memory: this step runs uncaptured, the next one captures again
    local moved = ms.zeros({ 20, 12 }, { ctx = GPU })
    cap:set_grad("w", moved)
    b[1].grad = moved
    fill_grads(H.seed(), a, b)
    ref:step() cap:step()
    assert.truthy(cap.last.recaptured:find("the gradient of 'w'", 1, true), cap.last.recaptured)
    assert.is_nil(cap.last.captured)
    fill_grads(H.seed(), a, b)
    ref:step() cap:step()
    assert.is_true(cap.last.capture)
    fill_grads(H.seed(), a, b)
    ref:step() cap:step()
    same_bits(values(b), values(a), "params across the re-capture")
    local st = cap:stats()
    assert.equals(1, st.recaptures)
    assert.equals(2, st.captures)
    -- or an error, by the setting, that changes nothing
    local ref2, strict, c, d = pair("sgd", spec, { lr = 0.1 }, { capture_on_change = "error" })
    for _ = 1, 3 do fill_grads(H.seed(), c, d) ref2:step() strict:step() end
    strict:set_grad("v", ms.zeros({ 12 }, { ctx = GPU }))
    local p0, n0 = values(d), strict.step_count
    H.expect_error(function() strict:step() end, "no longer fits", "the gradient of 'v'", "capture_on_change = 'error'")
    same_bits(values(d), p0, "params after the refused step")
    assert.equals(n0, strict.step_count)
  end)

  cuda_it("re-capture after a load that changes a parameter's own step count", function()
    -- a graph holds each parameter's steps without a gradient as a constant: a checkpoint whose 'v' went 2 steps
    -- without one must not replay with the 0 captured before the load (AdamW's bias correction would be off)
    local spec = { { "w", { 20, 12 } }, { "v", { 12 } } }
    local ref, cap, a, b = pair("adamw", spec, { lr = 0.01 })
    for _ = 1, 3 do fill_grads(H.seed(), a, b) ref:step() cap:step() end
    assert.equals("step", cap.last.captured)
    local src = model(GPU, spec)
    local v_grad = src[2].grad
    src[2].grad = nil
    local from = ms.optim.new("adamw", src, { lr = 0.01 }, { ctx = GPU })
    for _ = 1, 2 do fill_grads(H.seed(), { src[1] }) from:step() end
    from:set_grad("v", v_grad)
    src[2].grad = v_grad
    for _ = 1, 2 do fill_grads(H.seed(), src) from:step() end
    local path = os.tmpname()
    from:save(path)
    ref:load(path)
    cap:load(path)
    os.remove(path)
    for step = 1, 3 do
      fill_grads(H.seed(), a, b)
      ref:step() cap:step()
      if step == 1 then assert.truthy((cap.last.recaptured or ""):find("2 steps without a gradient", 1, true), cap.last.recaptured) end
      same_bits(values(b), values(a), ("params %d steps after the load"):format(step))
    end
    assert.equals("step", cap.last.captured)
  end)

  cuda_it("skip non-finite gradients in a replay, on the device, and count them", function()
    local ref, cap, a, b = pair("sgd", { { "w", { 16, 16 } }, { "v", { 16 } } }, { lr = 0.1, momentum = 0.9 })
    for _ = 1, 3 do fill_grads(H.seed(), a, b) ref:step() cap:step() end
    local p0, s0 = values(b), state_values(cap)
    fill_grads(H.seed(), b)
    b[2].grad[5] = NaN
    local allocs = GPU:mem_stats().num_device_allocs
    assert.is_nil(cap:step())
    assert.equals("step", cap.last.captured)
    same_bits(values(b), p0, "params after a skipped replay")
    same_bits(state_values(cap)["param/w/momentum_buffer"], s0["param/w/momentum_buffer"], "momentum")
    local st = cap:stats()
    assert.is_true(st.last.skipped)
    assert.equals(1, st.skipped_steps)
    assert.equals(allocs, GPU:mem_stats().num_device_allocs)
    fill_grads(H.seed(), a, b)
    ref:step()
    cap:step()
    same_bits(values(b), values(a), "the next finite replay applies")
    assert.is_false(cap:stats().last.skipped)
  end)

  cuda_it("keep one graph per plan key, each replaying its own plan", function()
    -- a recipe whose plan alternates: odd steps take twice the step of even ones (a per-member scale)
    local recipe = {
      name = "two_plans", options = { lr = { default = 0.1, type = "number" } },
      route = function() return "r" end,
      routes = { r = {
        plan = function(group, o, ctx) return ctx.step % 2 == 1 and "odd" or "even" end,
        step = function(group, o, ctx)
          local params, grads, scales = {}, {}, {}
          for i, m in ipairs(group) do params[i], grads[i], scales[i] = m.param, m.grad, ctx.plan == "odd" and 2 or 1 end
          ms.sgd_step { params = params, grads = grads, scales = scales, lr = ctx.lr_t, step = ctx.step_t, skip = ctx.skip_t }
        end,
      } },
    }
    local ref, cap, a, b = pair(recipe, { { "w", { 9, 7 } }, { "v", { 5 } } }, {}, { schedule = SCHEDULE })
    for step = 1, 8 do
      fill_grads(H.seed(), a, b)
      ref:step()
      cap:step()
      if step >= 3 then assert.equals(step % 2 == 1 and "odd" or "even", cap.last.captured) end
      same_bits(values(b), values(a), "params after step " .. step)
    end
    local st = cap:stats()
    assert.is_true(st.graphs.odd > 0 and st.graphs.even > 0)
    assert.equals(2, st.captures)
  end)

  cuda_it("keep at most max_graphs graphs, freeing the one replayed longest ago", function()
    -- five plan keys in turn: a graph per key would be kept for the rest of the run (DASH's auto names its
    -- class layout in its key, and a long run meets many)
    local recipe = {
      name = "five_plans", options = { lr = { default = 0.1, type = "number" } },
      route = function() return "r" end,
      routes = { r = {
        plan = function(group, o, ctx) return "k" .. (ctx.step % 5) end,
        step = function(group, o, ctx)
          local params, grads, scales = {}, {}, {}
          local k = tonumber(ctx.plan:sub(2))
          for i, m in ipairs(group) do params[i], grads[i], scales[i] = m.param, m.grad, 1 + k end
          ms.sgd_step { params = params, grads = grads, scales = scales, lr = ctx.lr_t, step = ctx.step_t, skip = ctx.skip_t }
        end,
      } },
    }
    H.expect_error(function() pair(recipe, { { "w", { 9, 7 } } }, {}, { max_graphs = 0 }) end,
                   "setting max_graphs must be an integer >= 1 (got 0)")
    local ref, cap, a, b = pair(recipe, { { "w", { 9, 7 } }, { "v", { 5 } } }, {}, { max_graphs = 2 })
    for step = 1, 25 do
      fill_grads(H.seed(), a, b)
      ref:step()
      cap:step()
      same_bits(values(b), values(a), "params after step " .. step)
      local n = 0
      for _ in pairs(cap:stats().graphs) do n = n + 1 end
      assert.is_true(n <= 2, ("%d graphs kept after step %d"):format(n, step))
    end
    local st = cap:stats()
    assert.is_true(st.evictions > 0 and st.captures > 5, ("%d evictions, %d captures"):format(st.evictions, st.captures))
  end)

  cuda_it("allocate nothing from the driver during replays", function()
    local ref, cap, a, b = pair("sinkgd", LLAMA_LIKE, { lr = 0.01 }, { clip_grad_norm = 1.0 })
    for _ = 1, 3 do fill_grads(H.seed(), a, b) ref:step() cap:step() end
    fill_grads(H.seed(), a, b)                       -- the grads' temporaries come and go before counting
    collectgarbage()
    collectgarbage()
    local m0 = GPU:mem_stats()
    for _ = 1, 6 do cap:step() end
    local m1 = GPU:mem_stats()
    assert.equals(m0.num_device_allocs, m1.num_device_allocs)
    assert.equals(m0.bytes_in_use, m1.bytes_in_use)
    assert.equals("step", cap.last.captured)
  end)

  cuda_it("time replays with CUDA events, per route while uncaptured", function()
    local ref, cap, a, b = pair("sinkgd", LLAMA_LIKE, { lr = 0.01 }, { timings = true })
    for _ = 1, 5 do fill_grads(H.seed(), a, b) ref:step() cap:step() end
    local t = cap:stats().timings
    assert.equals(4, t.step.steps, "the capturing step has no timing (events cannot be recorded while capturing)")
    assert.equals(3, t.graph.steps)
    assert.is_true(t.graph.min_ms > 0 and t.graph.max_ms < 1e4)
    assert.equals(1, t.routes.sinkgd.steps)
    assert.equals(1, t.routes.adamw.steps)
    assert.is_true(t.routes.sinkgd.last_ms > 0)
    assert.equals(cap.last.step, cap.last.timings.step)
    assert.is_true(ref:stats().timings.routes.sinkgd.steps == 5)
  end)

  cuda_it("run inside a moonstep graph capture, with prepare_replay before each launch", function()
    local spec = { { "w", { 24, 8 } }, { "v", { 8 } } }
    local a, b = model(GPU, spec)
    local ref = ms.optim.new("adamw", a, { lr = 0.01 }, { schedule = SCHEDULE })
    local opt = ms.optim.new("adamw", b, { lr = 0.01 }, { schedule = SCHEDULE, device_checks = true })
    -- not warm yet: refused with the reason
    H.expect_error(function() graph.capture(GPU, function() opt:step() end) end, "has not run uncaptured",
                   "device_checks = true")
    fill_grads(H.seed(), a, b)
    ref:step()
    opt:step()
    collectgarbage()
    collectgarbage()
    local g = graph.capture(GPU, function() opt:step() end)
    assert.equals(1, opt.step_count, "recording counts no step")
    assert.is_true(opt.last.in_capture)
    for _ = 1, 4 do
      fill_grads(H.seed(), a, b)
      ref:step()
      opt:prepare_replay()
      g:launch()
      same_bits(values(b), values(a), "replay of step " .. opt.step_count)
    end
    assert.equals(5, opt:stats().step)
    g:free()
  end)

  -- the CUDA runtime the engine uses, for specs that capture as a trainer (torch.cuda.graph) would
  local function cudart()
    local path
    for line in io.lines("/proc/self/maps") do
      path = path or line:match("(/%S*libcudart%.so[%.%d]*)$")
    end
    assert.truthy(path, "libcudart is mapped into the process")
    pcall(ffi.cdef, [[
      int cudaStreamCreateWithFlags(void **stream, unsigned int flags);
      int cudaStreamBeginCapture(void *stream, int mode);
      int cudaStreamEndCapture(void *stream, void **graph);
      int cudaGraphInstantiate(void **exec, void *graph, unsigned long long flags);
      int cudaGraphLaunch(void *exec, void *stream);
      int cudaGraphExecDestroy(void *exec);
      int cudaGraphDestroy(void *graph);
      int cudaStreamSynchronize(void *stream);
    ]])
    return ffi.load(path)
  end

  -- a stream of the caller's (non-blocking) and a moonstep context on it, with its handle
  local function stream_context(rt)
    local stream = ffi.new("void *[1]")
    assert.equals(0, rt.cudaStreamCreateWithFlags(stream, 1))
    local ctx = ms.context { device = "cuda", stream = stream[0] }
    return stream, ctx, T.handle_ctx(ctx)
  end

  cuda_it("run inside the stream owner's own capture (joined), replayed by the owner", function()
    -- the owner here is this spec, capturing through the CUDA runtime as a trainer (torch.cuda.graph) would
    local rt = cudart()
    local stream, ctx, h = stream_context(rt)
    local spec = { { "layers.0.weight", { 40, 24 }, "bf16" }, { "layers.0.bias", { 40 }, "bf16" } }
    local a, b = model(ctx, spec)
    local ref = ms.optim.new("sinkgd", a, { lr = 0.01 }, { ctx = ctx, schedule = SCHEDULE })
    local opt = ms.optim.new("sinkgd", b, { lr = 0.01 }, { ctx = ctx, schedule = SCHEDULE, device_checks = true })
    fill_grads(H.seed(), a, b)
    ref:step()
    opt:step()                                         -- the warm-up the owner runs before capturing
    assert.equals(C.MS_CAPTURE_NONE, tonumber(C.ms_ctx_is_capturing(h)))
    assert.equals(C.MS_E_UNSUPPORTED, tonumber(C.ms_graph_join(h)))
    assert.truthy(ffi.string(C.ms_last_error()):find("not being captured", 1, true))
    assert.equals(C.MS_E_ARG, tonumber(C.ms_graph_leave(h)))
    collectgarbage()
    collectgarbage()
    collectgarbage("stop")                             -- no finalizer may call the driver while capturing
    local allocs = ctx:mem_stats().num_device_allocs
    assert.equals(0, rt.cudaStreamBeginCapture(stream[0], 1))   -- thread-local mode
    local state = graph.state(ctx)
    local ok, err = pcall(opt.step, opt)
    local cgraph = ffi.new("void *[1]")
    local ended = rt.cudaStreamEndCapture(stream[0], cgraph)
    collectgarbage("restart")
    assert.equals("foreign", state)
    assert.is_true(ok, tostring(err))
    assert.equals(0, ended)
    assert.equals(allocs, ctx:mem_stats().num_device_allocs, "no driver allocation inside the owner's capture")
    assert.is_true(opt.last.in_capture)
    local exec = ffi.new("void *[1]")
    assert.equals(0, rt.cudaGraphInstantiate(exec, cgraph[0], 0))
    for _ = 1, 4 do
      fill_grads(H.seed(), a, b)
      ref:step()
      opt:prepare_replay()
      assert.equals(0, rt.cudaGraphLaunch(exec[0], stream[0]))
      ctx:sync()
      same_bits(values(b), values(a), "owner's replay, step " .. opt.step_count)
    end
    -- a joined capture refuses a second join, and leaves cleanly
    assert.equals(0, rt.cudaStreamBeginCapture(stream[0], 1))
    assert.equals(0, tonumber(C.ms_graph_join(h)))
    local again = tonumber(C.ms_graph_join(h))
    local left = tonumber(C.ms_graph_leave(h))
    local g2 = ffi.new("void *[1]")
    rt.cudaStreamEndCapture(stream[0], g2)
    if g2[0] ~= nil then rt.cudaGraphDestroy(g2[0]) end
    assert.equals(C.MS_E_UNSUPPORTED, again)
    assert.equals(0, left)
    rt.cudaGraphExecDestroy(exec[0])
    rt.cudaGraphDestroy(cgraph[0])
  end)

  -- call() inside the stream owner's capture, before ms_graph_join and between it and ms_graph_leave: refused
  -- both times (MS_E_UNSUPPORTED, the message saying why), the join and leave fine, the owner's capture valid at
  -- its end; after_leave(), if given, runs after the leave, still inside the capture
  local function refused_in_owners_capture(rt, stream, h, call, why, after_leave)
    collectgarbage()
    collectgarbage("stop")   -- (no finalizer frees device memory inside the capture)
    assert.equals(0, rt.cudaStreamBeginCapture(stream[0], 1))   -- thread-local mode
    local plain = tonumber(call())
    local plain_msg = ffi.string(C.ms_last_error())
    local joined = tonumber(C.ms_graph_join(h))
    local inside = tonumber(call())
    local left = tonumber(C.ms_graph_leave(h))
    if after_leave then after_leave() end
    local cgraph = ffi.new("void *[1]")
    local ended = rt.cudaStreamEndCapture(stream[0], cgraph)
    collectgarbage("restart")
    if cgraph[0] ~= nil then rt.cudaGraphDestroy(cgraph[0]) end
    assert.equals(C.MS_E_UNSUPPORTED, plain)
    assert.truthy(plain_msg:find(why, 1, true), plain_msg)
    assert.equals(0, joined)
    assert.equals(C.MS_E_UNSUPPORTED, inside)
    assert.equals(0, left)
    assert.equals(0, ended, "the owner's capture was not invalidated")
  end

  cuda_it("refuse ms_graph_begin inside the stream owner's capture, joined or not, leaving it valid", function()
    -- ms_graph_begin made the context's cuBLAS/cuSOLVER handles (driver calls) and then failed in
    -- cudaStreamBeginCapture (MS_E_BACKEND) inside the owner's capture, instead of refusing at once
    local rt = cudart()
    local stream, ctx, h = stream_context(rt)
    local state
    refused_in_owners_capture(rt, stream, h, function() return C.ms_graph_begin(h) end, "being captured by its owner",
                              function() state = tonumber(C.ms_ctx_is_capturing(h)) end)
    assert.equals(C.MS_CAPTURE_FOREIGN, state)
    -- outside the owner's capture the context captures graphs of its own
    local x = ms.full({ 8 }, 1, { ctx = ctx })
    local g = graph.capture(ctx, function() x:add_(1) end)
    g:launch()
    assert.equals(16, x:sum())
    g:free()
  end)

  cuda_it("refuse to empty the cache inside the stream owner's capture, joined or not, keeping the blocks", function()
    -- the pool waited for the captured stream (invalidating the owner's capture) and called cudaFree there,
    -- which the runtime refuses: the blocks were dropped from the pool but never returned to the driver
    local rt = cudart()
    local stream, ctx, h = stream_context(rt)
    local x = ms.full({ 2 ^ 16 }, 1, { ctx = ctx })
    ctx:sync()
    x = nil
    collectgarbage()
    collectgarbage()
    local cached = ctx:mem_stats().bytes_cached
    assert.is_true(cached > 0)
    refused_in_owners_capture(rt, stream, h, function() return C.ms_ctx_empty_cache(h) end, "owner captures it")
    assert.equals(cached, ctx:mem_stats().bytes_cached)
    -- outside the capture the cache empties
    assert.equals(0, tonumber(C.ms_ctx_empty_cache(h)))
    assert.equals(0, ctx:mem_stats().bytes_cached)
  end)

  cuda_it("refuse ms_event_record inside the stream owner's capture, joined or not; events time work outside", function()
    -- recorded into the owner's capture, the event marked no point of the stream (and ms_event_elapsed failed on it)
    local rt = cudart()
    local stream, ctx, h = stream_context(rt)
    local ev = ffi.new("ms_event *[2]")
    assert.equals(0, tonumber(C.ms_event_new(h, ev)))
    assert.equals(0, tonumber(C.ms_event_new(h, ev + 1)))
    refused_in_owners_capture(rt, stream, h, function() return C.ms_event_record(h, ev[0]) end, "owner captures it")
    local elapsed = ffi.new("double[1]")
    assert.equals(C.MS_E_ARG, tonumber(C.ms_event_elapsed(ev[0], ev[1], elapsed)))   -- never recorded
    -- outside the capture the events time the stream's work
    assert.equals(0, tonumber(C.ms_event_record(h, ev[0])))
    local x = ms.full({ 2 ^ 16 }, 1, { ctx = ctx })
    assert.equals(0, tonumber(C.ms_event_record(h, ev[1])))
    assert.equals(0, tonumber(C.ms_event_elapsed(ev[0], ev[1], elapsed)))
    assert.is_true(elapsed[0] >= 0)
    assert.equals(2 ^ 16, x:sum())
    C.ms_event_free(ev[0])
    C.ms_event_free(ev[1])
  end)

  cuda_it("take no runtime error left by the caller's own CUDA calls for a failure of theirs", function()
    -- a trainer's failed runtime call it never read (here cudaSetDevice of a device that does not exist) stayed
    -- the runtime's last error, and moonstep's next kernel launch check reported it as its own failure
    local rt = cudart()
    pcall(ffi.cdef, "int cudaSetDevice(int device); int cudaGetDevice(int *device);")
    local dev = ffi.new("int[1]")
    assert.equals(0, rt.cudaGetDevice(dev))
    assert.are_not.equal(0, rt.cudaSetDevice(100000))
    assert.equals(0, rt.cudaGetDevice(dev))
    local t = ms.full({ 1000 }, 2, { ctx = GPU })
    assert.equals(2000, t:sum())
  end)

  cuda_it("keep the blocks of one joined capture from the allocations of a later one", function()
    -- a tensor made inside one trainer capture and dropped inside a later one: the first graph's replays still
    -- write its block, so the second capture may not take it
    local rt = cudart()
    local stream, ctx, h = stream_context(rt)
    local n = 2 ^ 20
    local spares = {}
    -- cached blocks of the size for the captures (filled: the context's first kernels run before any capture)
    for i = 1, 3 do spares[i] = ms.full({ n }, 0, { ctx = ctx }) end
    ctx:sync()
    spares = nil
    collectgarbage()
    collectgarbage()
    local function ptr(t) return tonumber(ffi.cast("uintptr_t", C.ms_tensor_data_ptr(T.handle(t)))) end
    local function foreign(fn)
      assert.equals(0, rt.cudaStreamBeginCapture(stream[0], 1))
      local joined = tonumber(C.ms_graph_join(h))
      local ok, err = pcall(fn)
      local left = tonumber(C.ms_graph_leave(h))
      local g = ffi.new("void *[1]")
      local ended = rt.cudaStreamEndCapture(stream[0], g)
      assert.equals(0, joined)
      assert.is_true(ok, tostring(err))
      assert.equals(0, left)
      assert.equals(0, ended)
      return g[0]
    end
    local t, u, old
    -- no finalizer of another test's tensors may run inside the captures: those calls on other streams would
    -- invalidate a thread-local capture (the second capture collects only t then)
    collectgarbage()
    collectgarbage()
    collectgarbage("stop")
    local ok, g1, g2 = pcall(function()
      local a = foreign(function() t = ms.full({ n }, 1, { ctx = ctx }) end)
      old = ptr(t)
      local b = foreign(function()
        t = nil
        collectgarbage()
        collectgarbage()
        u = ms.full({ n }, 5, { ctx = ctx })
      end)
      return a, b
    end)
    collectgarbage("restart")
    assert.is_true(ok, tostring(g1))
    local new = ptr(u)
    rt.cudaGraphDestroy(g1)
    rt.cudaGraphDestroy(g2)
    assert.is_true(new ~= old, "the second capture took a block the first graph's replays write")
  end)

  cuda_it("refuse, inside a joined capture, a first call that would set the context up (no driver allocation)", function()
    -- a context's counters (and cuBLAS/cuSOLVER handles) are made by its first call; inside a trainer's capture
    -- that cudaMalloc invalidated the trainer's graph instead of failing with a clear error
    local rt = cudart()
    local stream, ctx, h = stream_context(rt)
    local x = ms.randn({ 257 }, { ctx = ctx, seed = H.seed() })
    local out = ms.zeros({ 1 }, { ctx = ctx })
    ctx:sync()
    collectgarbage()
    collectgarbage("stop")
    assert.equals(0, rt.cudaStreamBeginCapture(stream[0], 1))   -- thread-local mode
    local joined = tonumber(C.ms_graph_join(h))
    local ok, err = pcall(ms.foreach_sumsq, { x }, out)
    local left = tonumber(C.ms_graph_leave(h))
    local cgraph = ffi.new("void *[1]")
    local ended = rt.cudaStreamEndCapture(stream[0], cgraph)
    collectgarbage("restart")
    if cgraph[0] ~= nil then rt.cudaGraphDestroy(cgraph[0]) end
    assert.equals(0, joined)
    assert.equals(0, left)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("cannot be captured", 1, true), tostring(err))
    assert.equals(0, ended, "the owner's capture was not invalidated")
    -- outside a capture the same call sets the context up and runs
    ms.foreach_sumsq({ x }, out)
    local want = 0
    for _, v in ipairs(x:tolist_flat()) do want = want + v * v end
    H.assert_close(out:item(), want, 1e-5, 0, "sum of squares")
  end)

  cuda_it("replay from the C embedding without entering Lua, bit for bit, with the step count kept", function()
    -- engine/core/embed.c replays the previous step's graph by itself while the lr is constant (here set by
    -- ms_optimizer_set_lr half-way) and no other call came in between; any other call tells Lua the count
    local spec = { { "w", { 33, 17 } }, { "b", { 17 } }, { "h", { 24, 40 } } }
    local a, b = model(GPU, spec)
    local ref = ms.optim.new("sinkgd", a, { lr = 0.02, sinkgd_spectral_norm = true }, { ctx = GPU })
    local out = ffi.new("ms_optimizer *[1]")
    core.check(C.ms_optimizer_new(T.handle_ctx(GPU), "sinkgd", '{"lr": 0.02, "sinkgd_spectral_norm": true}', "{}", out))
    local opt = ffi.gc(out[0], C.ms_optimizer_free)
    for _, p in ipairs(b) do core.check(C.ms_optimizer_add_param(opt, p.name, T.handle(p.param), T.handle(p.grad), nil)) end
    core.check(C.ms_optimizer_capture(opt))
    local applied = ffi.new("int[1]")
    local function info()
      local s = ffi.new("char *[1]")
      core.check(C.ms_optimizer_info(opt, s))
      local text = ffi.string(s[0])
      C.ms_string_free(s[0])
      return text
    end
    for step = 1, 9 do
      if step == 6 then
        ref:set_lr(0.01)
        core.check(C.ms_optimizer_set_lr(opt, 0.01))
      end
      fill_grads(H.seed(), a, b)
      ref:step()
      core.check(C.ms_optimizer_step_with(opt, nil, applied))
      assert.equals(-1, applied[0], "the device decides a captured step")
      same_bits(values(b), values(a), ("params after step %d"):format(step))
    end
    local stats = ffi.new("char *[1]")
    core.check(C.ms_optimizer_stats(opt, stats))
    local text = ffi.string(stats[0])
    C.ms_string_free(stats[0])
    assert.truthy(text:find('"skipped_steps":0', 1, true), text)
    assert.truthy(text:find('"step":9,', 1, true) or text:find('"step":9}', 1, true), text)
    assert.truthy(info():find('"name":"w"', 1, true))
  end)

  cuda_it("report the capture state of a moonstep capture", function()
    local x = ms.ones({ 8 }, { ctx = GPU })
    local inside
    local g = graph.capture(GPU, function()
      inside = graph.state(GPU)
      x:add_(1)
    end)
    assert.equals("graph", inside)
    assert.equals("none", graph.state(GPU))
    assert.equals(C.MS_E_UNSUPPORTED, tonumber((function()
      local st
      graph.capture(GPU, function() st = C.ms_graph_join(T.handle_ctx(GPU)) end)
      return st
    end)()))
    g:launch()
    assert.equals(16, x:sum())
    g:free()
  end)
end)
