-- ctx.rng_key: each route's engine calls draw their random numbers (stochastic rounding, power-iteration starts)
-- from streams of their own, not from the recipe's seed shared by every call (whose members all count from 0).
local ms = require("moonstep")

local function entry(name, t, options)
  return { name = name, param = t:clone(), grad = ms.zeros(t:shape(), { dtype = t:dtype() }), options = options }
end

-- a bf16 tensor's values (exact in f32)
local function values(t) return H.flat(t:to("f32"):totable()) end

-- a recipe of routes "b" and "a" (sorted: a is place 0, b place 1) that each step their group with AdamW,
-- keyed by ctx.rng_key(o.seed) (or by the seed itself: own_keys = false); seen collects {route, probe(ctx)}
-- from every route's step
local function two_routes(own_keys, probe, seen)
  local function step(route)
    return function(group, o, ctx)
      if probe then seen[#seen + 1] = { route, probe(ctx) } end
      local params, grads, m1, m2 = {}, {}, {}, {}
      for i, m in ipairs(group) do params[i], grads[i], m1[i], m2[i] = m.param, m.grad, m.state.m, m.state.v end
      ms.adamw_step { params = params, grads = grads, exp_avg = m1, exp_avg_sq = m2, lr = ctx.lr_t, step = ctx.step,
                      stochastic_round = true, seed = own_keys and ctx.rng_key(o.seed) or o.seed }
    end
  end
  local function init(group)
    for _, m in ipairs(group) do m.state.m, m.state.v = ms.zeros(m.param:shape()), ms.zeros(m.param:shape()) end
  end
  return {
    name = "two_routes",
    options = { lr = { default = 1e-3, type = "number" }, seed = { default = 0, type = "integer", min = 0 } },
    route = function(info) return info.name:match("^a") and "a" or "b" end,
    routes = { b = { init = init, step = step("b") }, a = { init = init, step = step("a") } },
  }
end

describe("ctx.rng_key", function()
  it("puts the route's place among the recipe's sorted routes and the stream in the key's high word", function()
    local seen = {}
    local recipe = two_routes(true, function(ctx)
      local keys = { ctx.rng_key(7), ctx.rng_key(7, 1), ctx.rng_key(7, 7), ctx.rng_key(0) }
      local errs = {}
      for _, bad in ipairs { { -1 }, { 2 ^ 32 }, { 1.5 }, { "7" }, { 7, 8 }, { 7, -1 }, { 7, 0.5 } } do
        local ok, err = pcall(ctx.rng_key, bad[1], bad[2])
        errs[#errs + 1] = not ok and err or "accepted"
      end
      return keys, errs
    end, seen)
    local w = ms.randn({ 4 }, { seed = H.seed() }):to("bf16")
    -- groups: b (b1), a (a1), a with lr 0.2 (a2): routes step group by group, in order of first appearance
    local set = { entry("b1", w), entry("a1", w), entry("a2", w, { lr = 0.2 }) }
    local opt = ms.optim.new(recipe, set)
    for _, e in ipairs(set) do e.grad:copy_(ms.randn({ 4 }, { seed = H.seed() }):to("bf16")) end
    opt:step()
    assert.equals(3, #seen)
    assert.same({ "b", "a", "a" }, { seen[1][1], seen[2][1], seen[3][1] })
    local hi = 2 ^ 32
    assert.same({ 7 + 8 * hi, 7 + 9 * hi, 7 + 15 * hi, 8 * hi }, seen[1][2])   -- b: place 1
    assert.same({ 7, 7 + hi, 7 + 7 * hi, 0 }, seen[2][2])                       -- a: place 0, stream 0 is the seed
    assert.same(seen[2][2], seen[3][2])                                         -- the groups of a route share them
    for i, want in ipairs { "seed must be an integer in [0, 2^32) (got -1)", "seed must be", "seed must be",
                            "seed must be", "stream k must be an integer in [0, 7] (got 8)", "stream k must be",
                            "stream k must be" } do
      assert.truthy(seen[1][3][i]:find(want, 1, true), ("case %d: %s"):format(i, seen[1][3][i]))
    end
  end)

  it("rounds identical bf16 parameters of two routes with different uniforms", function()
    -- two routes doing the same arithmetic: with one key for both calls, member 0 of each would round every
    -- element the same way
    local w = ms.randn({ 64, 64 }, { seed = H.seed() }):to("bf16")
    local g = ms.randn({ 64, 64 }, { seed = H.seed() }):to("bf16")
    local function run(own_keys)
      local set = { entry("a", w), entry("b", w) }
      local opt = ms.optim.new(two_routes(own_keys), set, { seed = 5 })
      for _ = 1, 2 do
        for _, e in ipairs(set) do e.grad:copy_(g) end
        opt:step()
      end
      return values(set[1].param), values(set[2].param)
    end
    local x, y = run(false)
    assert.same(x, y)   -- the same arithmetic and one key: the same bits
    x, y = run(true)
    local differ = 0
    for i = 1, #x do if x[i] ~= y[i] then differ = differ + 1 end end
    -- each rounding is a coin flip where the f32 value falls between two bf16 neighbours: independent streams
    -- disagree on a good part of the 4096 elements
    assert.is_true(differ > #x / 8, ("%d of %d elements rounded differently"):format(differ, #x))
  end)

  it("is refused past 2^32 as the built-in recipes' seed option, which keys their calls", function()
    local w = ms.randn({ 4 }, { seed = H.seed() })
    for _, name in ipairs { "adamw", "sgd", "sinkgd", "dash" } do
      H.expect_error(function() ms.optim.new(name, { entry("w", w) }, { seed = 2 ^ 32 }) end, "seed")
      ms.optim.new(name, { entry("w", w) }, { seed = 2 ^ 32 - 1 })
    end
  end)
end)
