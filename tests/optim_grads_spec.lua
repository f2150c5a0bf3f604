-- How parameters and gradients reach ms.optim: tied parameters (one tensor under several names, one gradient),
-- gradients the steps cannot write (refused when handed over), step{grads =}, whose gradients serve that step
-- only, and the entries' tags.
-- SGD without momentum throughout: a step is p - lr * g, exactly what the checks below compute.
local ms = require("moonstep")

local function randn(shape) return ms.randn(shape, { seed = H.seed() }) end

local LR = 0.5
-- p - LR * g (f32, as the engine computes it: one rounding of LR * g, one of the difference)
local function sgd(p, g) return (p - g * LR):totable() end

describe("tied parameters", function()
  it("take their gradient from whichever name gives it", function()
    -- the head's gradient was dropped when only the head gave one: the tie stepped with none
    local w = randn({ 6, 4 })
    local g = randn({ 6, 4 })
    local opt = ms.optim.new("sgd", { { name = "embed", param = w }, { name = "head", param = w, grad = g } },
                             { lr = LR })
    local want = sgd(w, g)
    assert.is_true(opt:step())
    assert.same(want, w:totable())
    -- set_grad and step{grads =} through either name replace the tie's one gradient
    local g2, g3 = randn({ 6, 4 }), randn({ 6, 4 })
    opt:set_grad("embed", g2)
    want = sgd(w, g2)
    opt:step()
    assert.same(want, w:totable())
    want = sgd(w, g3)
    opt:step({ grads = { head = g3 } })
    assert.same(want, w:totable())
    -- the same gradient through both names is one gradient
    local g4 = randn({ 6, 4 })
    want = sgd(w, g4)
    opt:step({ grads = { embed = g4, head = g4 } })
    assert.same(want, w:totable())
  end)

  it("refuse two different gradients, at registration and at every step{grads =}, changing nothing", function()
    local w = randn({ 6, 4 })
    local ga, gb = randn({ 6, 4 }), randn({ 6, 4 })
    H.expect_error(function()
      ms.optim.new("sgd", { { name = "embed", param = w, grad = ga }, { name = "head", param = w, grad = gb } })
    end, "parameters 'embed' and 'head' are tied (one tensor) but were given different gradients")
    -- a tie is routed once: a later name may repeat the first one's tags and options, or give none
    H.expect_error(function()
      ms.optim.new("adamw", { { name = "embed", param = w, tags = { "embedding" } },
                              { name = "head", param = w, tags = { "no_decay" } } })
    end, "parameters 'embed' and 'head' are tied (one tensor) but were given different tags ([embedding], [no_decay])")
    H.expect_error(function()
      ms.optim.new("adamw", { { name = "embed", param = w }, { name = "head", param = w, options = { lr = 1 } } })
    end, "parameters 'embed' and 'head' are tied (one tensor) but were given different options")
    ms.optim.new("adamw", { { name = "embed", param = w, tags = { "a", "b" }, options = { lr = 1 } },
                            { name = "head", param = w, tags = { "b", "a" }, options = { lr = 1 } },
                            { name = "out", param = w, tags = {} } })
    -- another view of the same memory is the same gradient
    local opt = ms.optim.new("sgd", { { name = "embed", param = w, grad = ga },
                                      { name = "head", param = w, grad = ga:reshape({ 6, 4 }) } }, { lr = LR })
    for _ = 1, 2 do
      local before = w:totable()
      H.expect_error(function() opt:step({ grads = { embed = ga, head = gb } }) end,
                     "parameters 'embed' and 'head' are tied (one tensor) but were given different gradients")
      assert.same(before, w:totable())
      assert.is_true(rawequal(ga, opt.by_name.embed.grad))
      local want = sgd(w, ga)
      assert.is_true(opt:step())   -- the refused step left the registered gradient in place
      assert.same(want, w:totable())
    end
  end)
end)

describe("gradients the steps must write", function()
  it("are refused when handed over, naming the parameter: an expanded view cannot be rescaled in place", function()
    -- accepted before, it failed only at a step that rescaled it (grad_scale, clipping), naming no parameter
    local w = randn({ 4, 4 })
    local wide = randn({ 1, 4 }):expand(4, 4)
    local err = H.expect_error(function() ms.optim.new("sgd", { { name = "w", param = w, grad = wide } }) end,
                               "parameter 'w': grad [4,4] has strides [0,1]", "must be writable")
    assert.falsy(err:find("ms_foreach", 1, true))
    local g = randn({ 4, 4 })
    local opt = ms.optim.new("sgd", { { name = "w", param = w, grad = g } }, { lr = LR }, { clip_grad_norm = 1e-3 })
    H.expect_error(function() opt:set_grad("w", wide) end, "parameter 'w'", "must be writable")
    local before = w:totable()
    H.expect_error(function() opt:step({ grads = { w = wide }, grad_scale = 2 }) end, "parameter 'w'",
                   "must be writable")
    assert.same(before, w:totable())
    assert.is_true(rawequal(g, opt.by_name.w.grad))
    assert.is_true(opt:step())
  end)
end)

describe("step{grads =}", function()
  it("uses the gradients for that step only: the registered ones (or none) are back afterwards", function()
    -- they stayed registered, and the next plain step applied them again
    local w, b = randn({ 3, 5 }), randn({ 5 })
    local gw, g1, g2 = randn({ 3, 5 }), randn({ 3, 5 }), randn({ 5 })
    local opt = ms.optim.new("sgd", { { name = "w", param = w, grad = gw }, { name = "b", param = b } }, { lr = LR })
    local want_w, want_b = sgd(w, g1), sgd(b, g2)
    assert.is_true(opt:step({ grads = { w = g1, b = g2 } }))
    assert.same(want_w, w:totable())
    assert.same(want_b, b:totable())
    assert.is_true(rawequal(gw, opt.by_name.w.grad))
    assert.is_nil(opt.by_name.b.grad)
    want_w, want_b = sgd(w, gw), b:totable()
    assert.is_true(opt:step())
    assert.same(want_w, w:totable())
    assert.same(want_b, b:totable())        -- b has no gradient of its own: left alone
  end)

  it("leaves the registered gradients in place when the step is refused", function()
    local w = randn({ 8 })
    local gw = randn({ 8 })
    local opt = ms.optim.new("sgd", { { name = "w", param = w, grad = gw } }, { lr = LR }, { nonfinite = "raise" })
    local bad = ms.full({ 8 }, 0 / 0)
    local before = w:totable()
    H.expect_error(function() opt:step({ grads = { w = bad } }) end, "non-finite gradients in w")
    assert.same(before, w:totable())
    assert.is_true(rawequal(gw, opt.by_name.w.grad))
    assert.equals(0, opt.step_count)
  end)

  it("keeps each member's own step count: steps given no gradient are not its own", function()
    -- AdamW's bias correction reads the member's count: a member given a gradient every other step counts half
    local w, v = randn({ 4 }), randn({ 4 })
    local opt = ms.optim.new("adamw", { { name = "w", param = w, grad = randn({ 4 }) }, { name = "v", param = v } })
    for i = 1, 4 do
      opt:step(i % 2 == 0 and { grads = { v = randn({ 4 }) } } or nil)
    end
    local m = opt.by_name.v.member
    local _, own = opt:_step_of(m, opt.step_count + 1, {})
    assert.equals(3, own)                   -- its third step would be next (it had steps 2 and 4)
  end)
end)

describe("parameter tags", function()
  it("are an array of non-empty strings: anything else is refused, naming the parameter", function()
    -- a set {no_decay = true} was taken as no tags at all, and a number as a tag
    local function new(tags)
      return ms.optim.new("adamw", { { name = "w", param = randn({ 4 }), grad = randn({ 4 }), tags = tags } })
    end
    H.expect_error(function() new({ no_decay = true }) end,
                   "parameter 'w': tags must be an array of strings (it has the key no_decay)")
    H.expect_error(function() new({ "no_decay", 3 }) end,
                   "parameter 'w': tags[2] must be a non-empty string (got number)")
    H.expect_error(function() new({ "" }) end, "parameter 'w': tags[1] must be a non-empty string (got \"\")")
    H.expect_error(function() new("no_decay") end, "parameter 'w': tags must be an array of strings (got a string)")
    local opt = new({ "no_decay" })
    assert.equals(0, opt.groups[1].options.weight_decay)
  end)
end)
