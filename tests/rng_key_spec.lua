-- ctx.rng_key: each engine call of a step draws its random numbers (stochastic rounding, power-iteration starts)
-- from a stream of its own, not from the recipe's seed shared by every call (whose members all count from 0).
local ms = require("moonstep")

local function entry(name, t, options)
  return { name = name, param = t:clone(), grad = ms.zeros(t:shape(), { dtype = t:dtype() }), options = options }
end

-- a bf16 tensor's values (exact in f32)
local function values(t) return H.flat(t:to("f32"):totable()) end

describe("ctx.rng_key", function()
  it("keys the first group's stream 0 with the seed itself and every other group and stream apart", function()
    local keys, errs = {}, {}
    local recipe = {
      name = "keys", options = { lr = { default = 0.1, type = "number" } },
      route = function(info) return info.name:match("^a") and "a" or "b" end,
      routes = {
        a = { step = function(group, o, ctx)
          keys[#keys + 1] = { ctx.rng_key(7), ctx.rng_key(7, 1), ctx.rng_key(7, 7), ctx.rng_key(0) }
          for _, bad in ipairs { { -1 }, { 2 ^ 32 }, { 1.5 }, { "7" }, { 7, 8 }, { 7, -1 }, { 7, 0.5 } } do
            local ok, err = pcall(ctx.rng_key, bad[1], bad[2])
            errs[#errs + 1] = not ok and err or "accepted"
          end
        end },
        b = { step = function(group, o, ctx) keys[#keys + 1] = { ctx.rng_key(7), ctx.rng_key(7, 1) } end },
      },
    }
    local w = ms.randn({ 4 }, { seed = H.seed() })
    local set = { entry("a1", w), entry("b1", w), entry("a2", w, { lr = 0.2 }) }
    local opt = ms.optim.new(recipe, set)
    for _, e in ipairs(set) do e.grad:copy_(ms.randn({ 4 }, { seed = H.seed() })) end
    opt:step()
    -- groups in order of first appearance: a (a1), b (b1), a with lr 0.2 (a2); routes step group by group
    assert.equals(3, #keys)
    assert.same({ 7, 7 + 2 ^ 32, 7 + 7 * 2 ^ 32, 0 }, keys[1])
    local seen = {}
    for _, ks in ipairs(keys) do
      for _, k in ipairs(ks) do
        if k ~= 0 then
          assert.is_nil(seen[k], ("key %.0f given twice"):format(k))
          seen[k] = true
        end
      end
    end
    -- the third group's stream 0: (place 3 - 1) * 8 in the high word
    assert.equals(7 + 16 * 2 ^ 32, keys[3][1])
    for i, want in ipairs { "seed must be an integer in [0, 2^32)", "seed must be", "seed must be", "seed must be",
                            "stream k must be", "stream k must be", "stream k must be" } do
      assert.truthy(errs[i]:find(want, 1, true), ("case %d: %s"):format(i, errs[i]))
    end
    assert.truthy(errs[1]:find("got -1", 1, true))
  end)

  it("rounds identical bf16 parameters of two groups with different uniforms", function()
    -- two groups doing the same arithmetic (the second's lr override equals the recipe's lr): with one key for
    -- both calls, member 0 of each would round every element the same way
    local w = ms.randn({ 64, 64 }, { seed = H.seed() }):to("bf16")
    local g = ms.randn({ 64, 64 }, { seed = H.seed() }):to("bf16")
    local function run(sr)
      local set = { entry("x", w), entry("y", w, { lr = 1e-3 }) }
      local opt = ms.optim.new("adamw", set, { lr = 1e-3, stochastic_round = sr, seed = 5 })
      for _ = 1, 2 do
        for _, e in ipairs(set) do e.grad:copy_(g) end
        opt:step()
      end
      assert.equals(2, #opt:info().groups)
      return values(set[1].param), values(set[2].param)
    end
    local x, y = run(false)
    assert.same(x, y)   -- the same arithmetic: the same bits without stochastic rounding
    x, y = run(true)
    local differ = 0
    for i = 1, #x do if x[i] ~= y[i] then differ = differ + 1 end end
    -- each rounding is a coin flip where the f32 value falls between two bf16 neighbours: independent streams
    -- disagree on about half of the elements (4096 of them)
    assert.is_true(differ > #x / 8, ("%d of %d elements rounded differently"):format(differ, #x))
  end)

  it("is refused past 2^32 as the recipes' seed option", function()
    local w = ms.randn({ 4 }, { seed = H.seed() })
    for _, name in ipairs { "adamw", "sgd", "sinkgd", "dash" } do
      H.expect_error(function() ms.optim.new(name, { entry("w", w) }, { seed = 2 ^ 32 }) end, "seed")
    end
  end)
end)
