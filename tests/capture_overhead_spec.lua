-- The host side of captured steps kept small (issue 7 item 3, moonstep.optim "Captured steps"): device
-- scalars written only when their value changed (and always again after recipe code ran), the replay's fit
-- check skipped while no set_grad ran, and opt.host_clock's per-phase breakdown (last.host_us).
--
-- On the CPU: device-checked steps and prepare_replay keep lr_t / step_t / the unscale factor right under a
-- schedule, set_lr and changing grad scales, a recipe that overwrites ctx.lr_t gets it rewritten, and the
-- breakdown.  On a GPU (cuda_it): replays with a constant lr launch the graph alone (it advances step_t), stay bit for bit
-- with uncaptured steps through lr, grad-scale and gradient changes, and a moved gradient still re-captures.
local ms = require("moonstep")

local cuda_it = H.cuda_it
local CPU = ms.device("cpu")

local function set_of(ctx, n, seed)
  local out = {}
  for i = 1, n do
    out[i] = {
      name = "w" .. i,
      param = ms.randn({ 6, 5 }, { seed = seed + i, ctx = ctx, std = 0.5 }),
      grad = ms.randn({ 6, 5 }, { seed = seed + 100 + i, ctx = ctx }),
    }
  end
  return out
end

local function fresh_grads(set, seed)
  for i, p in ipairs(set) do
    p.grad:copy_(ms.randn(p.param:shape(), { seed = seed, offset = i, ctx = p.param:context() }))
  end
end

local function same_bits(a, b, what)
  for i, p in ipairs(a) do
    local x, y = p.param:tolist_flat(), b[i].param:tolist_flat()
    for k = 1, #y do
      if not (x[k] == y[k]) then error(("%s: %s[%d] = %.17g, want %.17g"):format(what, p.name, k, x[k], y[k]), 2) end
    end
  end
end

describe("captured-step host work", function()
  it("writes lr and step into the device scalars of every device-checked step and prepare_replay", function()
    local set = set_of(CPU, 3, H.seed())
    local opt = ms.optim.new("sgd", set, { lr = 0.1 }, {
      device_checks = true, schedule = { kind = "cosine", warmup_steps = 2, total_steps = 6 } })
    for step = 1, 5 do
      local lr = opt:get_lr()
      opt:step()
      H.assert_close(opt.lr_t:item(), lr, 1e-7, 0, "lr_t at step " .. step)
      assert.equals(step, opt.step_t:item())
    end
    opt:set_lr(0.25)
    opt:prepare_replay()
    H.assert_close(opt.lr_t:item(), 0.25, 1e-7, 0, "lr_t after set_lr")
    assert.equals(6, opt.step_t:item())
    opt:prepare_replay()                            -- the same lr: step_t still moves on
    H.assert_close(opt.lr_t:item(), 0.25, 1e-7, 0, "lr_t unchanged")
    assert.equals(7, opt.step_t:item())
    -- the unscale factor follows each replay's grad scale, also back to an earlier one
    for _, s in ipairs { 4, 4, 8, 4 } do
      opt:prepare_replay { grad_scale = s }
      assert.equals(1 / s, opt:_checks(3).inv:item())
    end
  end)

  it("writes lr_t again after recipe code ran, even with the lr unchanged", function()
    local clobber = {
      name = "clobber", options = { lr = { default = 0.5, type = "number" } },
      route = function() return "r" end,
      routes = { r = { step = function(_, _, ctx)
        ctx.lr_t:fill_(-7)                          -- a recipe must not, but the runtime copes
        local _ = ctx.skip_t                        -- (it reads the skip flag: device checks allow it)
      end } },
    }
    local opt = ms.optim.new(clobber, set_of(CPU, 2, H.seed()), { lr = 0.5 }, { device_checks = true })
    opt:prepare_replay()
    assert.equals(0.5, opt.lr_t:item())
    opt:step()
    assert.equals(-7, opt.lr_t:item(), "the recipe wrote it")
    opt:prepare_replay()
    assert.equals(0.5, opt.lr_t:item(), "written again: recipe code ran since the last write")
  end)

  it("finds a graph still fits gradients over the same memory, and names what moved or changed layout", function()
    local optim = require("moonstep.optim")
    local set = set_of(CPU, 3, H.seed())
    local opt = ms.optim.new("sgd", set, { lr = 0.1 }, { device_checks = true })
    local _, active = opt:_runs()
    local e = {}
    optim._record_members(e, active, opt.grads_version)
    assert.is_nil(optim._entry_change(e, active), "unchanged")
    local g2 = set[2].grad
    active[2].grad = g2:view({ 30 }):view({ 6, 5 })                -- same memory, another tensor: adopted
    assert.is_nil(optim._entry_change(e, active))
    assert.equals(active[2].grad, e.grads[2])
    local cases = {
      { ms.zeros({ 6, 5 }), "moved memory" },
      { g2:view({ 5, 6 }), "same memory, another shape" },
      { g2:view({ 30 }):view({ 5, 6 }):transpose(0, 1), "same memory and shape, other strides" },
      { g2:to("f64"), "another dtype" },
    }
    for _, c in ipairs(cases) do
      active[2].grad = c[1]
      local why = optim._entry_change(e, active)
      assert.truthy(why and why:find("the gradient of 'w2' is ", 1, true), c[2] .. ": " .. tostring(why))
      assert.truthy(why:find("it was .* at the capture"), why)
    end
    active[2].grad = g2
    assert.is_nil(optim._entry_change(e, active), "back to the recorded tensor")
  end)

  it("breaks a step's host time down when given a clock", function()
    local opt = ms.optim.new("adamw", set_of(CPU, 4, H.seed()), { lr = 0.01 }, { device_checks = true })
    opt:step()
    assert.is_nil(opt.last.host_us, "no breakdown without a clock")
    local ticks = 0
    opt.host_clock = function() ticks = ticks + 1 return ticks * 10 end
    opt:step()
    local hu = opt.last.host_us
    assert.equals(5, ticks, "one reading per phase boundary")
    for _, k in ipairs { "prelude", "scalars", "checks", "launch" } do assert.equals(10, hu[k], k) end
    assert.equals(40, hu.total)
  end)

  cuda_it("replays a constant lr with the graph alone (it advances step_t), bit for bit through lr, scale and grad changes", function()
    local GPU = ms.device("cuda")
    local seed = H.seed()
    local a, b = set_of(GPU, 5, seed), set_of(GPU, 5, seed)
    local ref = ms.optim.new("adamw", a, { lr = 0.01, weight_decay = 0.1 }, { ctx = GPU })
    local cap = ms.optim.new("adamw", b, { lr = 0.01, weight_decay = 0.1 }, { ctx = GPU }):capture()
    local function both(args, what)
      fresh_grads(a, 77 + ref.step_count)
      fresh_grads(b, 77 + cap.step_count)
      ref:step(args)
      cap:step(args)
      same_bits(b, a, what)
    end
    for i = 1, 3 do both(nil, "warm-up step " .. i) end
    assert.equals("step", cap.last.captured)
    both(nil, "constant lr")
    assert.equals(1, cap.last.launches, "the graph alone: lr_t holds the lr already, the graph advances step_t")
    assert.equals(cap.step_count, cap.step_t:item(), "step_t")
    ref:set_lr(0.02) cap:set_lr(0.02)
    both(nil, "new lr")
    assert.equals(2, cap.last.launches, "lr_t and the graph")
    assert.equals(cap.step_count, cap.step_t:item(), "step_t")
    H.assert_close(cap.lr_t:item(), 0.02, 1e-7, 0, "lr_t")
    for i, s in ipairs { 8, 8, 16, 16, 8 } do both({ grad_scale = s }, "grad scale " .. s .. " (" .. i .. ")") end
    -- the same gradient memory through another tensor: adopted (checked once), the replays go on
    cap:set_grad("w2", b[2].grad:view({ 30 }):view({ 6, 5 }))
    both(nil, "adopted gradient")
    assert.equals("step", cap.last.captured)
    assert.is_nil(cap.last.recaptured)
    -- moved memory: re-captured
    local moved = ms.zeros({ 6, 5 }, { ctx = GPU })
    cap:set_grad("w3", moved)
    b[3].grad = moved
    both(nil, "moved gradient")
    assert.truthy(cap.last.recaptured and cap.last.recaptured:find("the gradient of 'w3'", 1, true))
    both(nil, "re-captured")
    both(nil, "replayed again")
    assert.equals("step", cap.last.captured)
  end)
end)
