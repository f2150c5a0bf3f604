-- The optimizer runtime: recipe loading and option specs, routing and grouping, schedules, the
-- learning rate and device scalars, clipping, the non-finite guard, loss scaling, master weights,
-- introspection, and checkpoints that resume bit for bit.
local ms = require("moonstep")

local function randn(shape, dtype) return ms.randn(shape, { dtype = dtype or "f32", seed = H.seed() }) end

-- a parameter with a gradient buffer, and a fresh random gradient written into it per step
local function param(name, shape, dtype, tags)
  return { name = name, param = randn(shape, dtype), grad = ms.zeros(shape, { dtype = dtype or "f32" }), tags = tags }
end
local function fill_grads(params, seed)
  for i, p in ipairs(params) do
    p.grad:copy_(ms.randn(p.param:shape(), { seed = seed, offset = i }))
  end
end

local function copy_params(params)
  local out = {}
  for i, p in ipairs(params) do out[i] = p.param:totable() end
  return out
end

describe("recipe loading", function()
  it("finds built-in recipes and refuses names that are paths", function()
    local r = ms.recipe.get("adamw")
    assert.equals("adamw", r.name)
    assert.truthy(r.routes.adamw)
    H.expect_error(function() ms.recipe.get("nope") end, "no recipe named", "nope")
    H.expect_error(function() ms.recipe.get("recipes/adamw.lua") end, "no '/'")
  end)

  it("searches MOONSTEP_RECIPE_PATH after the built-ins", function()
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir -p " .. dir)
    local f = assert(io.open(dir .. "/mine.lua", "w"))
    f:write([[return {name = "mine", options = {lr = {default = 1, type = "number"}},
      route = function() return "r" end, routes = {r = {step = function() end}}}]])
    f:close()
    local build = os.getenv("MOONSTEP_BUILD") or "build"
    local p = io.popen("MOONSTEP_RECIPE_PATH=" .. dir .. " " .. build .. "/moonstep -e 'print(ms.recipe.get(\"mine\").name)' 2>&1")
    local out = p:read("*a")
    p:close()
    os.execute("rm -rf " .. dir)
    assert.equals("mine\n", out)
  end)

  it("runs untrusted recipes in a restricted environment", function()
    local probe = [[
      local found = {}
      for _, k in ipairs {"io", "os", "require", "debug", "package", "loadstring", "dofile", "load",
                          "collectgarbage", "setfenv", "getfenv", "jit", "bit", "rawset", "newproxy"} do
        if _G[k] ~= nil then found[#found + 1] = k end
      end
      if ms.save ~= nil or ms.load ~= nil or ms.context ~= nil then found[#found + 1] = "ms file/context access" end
      return {name = table.concat(found, ","), options = {}, route = function() return "r" end,
              routes = {r = {step = function() end}}}]]
    local ok, err = pcall(ms.recipe.load_string, probe, "=probe")
    -- an empty name is refused, so success would mean something was reachable
    assert.is_false(ok)
    assert.truthy(tostring(err):find("field 'name'", 1, true), err)
    local trusted = ms.recipe.load_string(probe, "=probe", { trusted = true })
    assert.truthy(trusted.name:find("io", 1, true))
  end)

  it("refuses bytecode, syntax errors and malformed recipes with clear errors", function()
    H.expect_error(function() ms.recipe.load_string(string.dump(function() end), "=bc") end, "bytecode")
    H.expect_error(function() ms.recipe.load_string("return {", "=broken") end, "recipe =broken")
    H.expect_error(function() ms.recipe.load_string("return 5", "=five") end, "must return a table")
    H.expect_error(function()
      ms.recipe.load_string([[return {name = "x", options = {}, route = function() end, routes = {r = {}}}]], "=x")
    end, "route 'r' needs a step function")
    H.expect_error(function()
      ms.recipe.load_string([[return {name = "x", options = {a = {type = "float"}}, route = function() end,
        routes = {r = {step = function() end}}}]], "=x")
    end, "option 'a' has unknown type")
    H.expect_error(function() ms.recipe.load("/nonexistent/recipe.lua") end, "cannot read recipe")
  end)

  it("gives built-ins a content hash", function()
    local a, b = ms.recipe.get("adamw"), ms.recipe.get("sgd")
    assert.equals(16, #ms.recipe.meta[a].hash)
    assert.are_not.equal(ms.recipe.meta[a].hash, ms.recipe.meta[b].hash)
    assert.equals(ms.recipe.meta[a].hash, ms.recipe.meta[ms.recipe.get("adamw")].hash)
  end)
end)

describe("option specs", function()
  local sgd = ms.recipe.get("sgd")
  local adamw = ms.recipe.get("adamw")

  it("fills defaults and converts strings from config files by the declared type", function()
    local o = ms.recipe.options(sgd, { lr = "0.1", momentum = "0.9", nesterov = "True" })
    assert.equals(0.1, o.lr)
    assert.equals(0.9, o.momentum)
    assert.is_true(o.nesterov)
    assert.equals(0, o.weight_decay)
    assert.is_false(ms.recipe.options(sgd, { nesterov = "False" }).nesterov)
    assert.is_false(ms.recipe.options(sgd, { nesterov = "0" }).nesterov)
    assert.same({ 0.9, 0.95 }, ms.recipe.options(adamw, { betas = "(0.9, 0.95)" }).betas)
    assert.equals(1e-3, ms.recipe.options(adamw, { lr = "1e-3" }).lr)
  end)

  it("refuses unknown options, wrong types, bad strings and out-of-range values, naming the option", function()
    H.expect_error(function() ms.recipe.options(sgd, { lrr = 1 }) end, "unknown option 'lrr'", "known:")
    H.expect_error(function() ms.recipe.options(sgd, { lr = "fast" }) end, "option 'lr'", "a number is needed")
    H.expect_error(function() ms.recipe.options(sgd, { lr = "0.1x" }) end, "option 'lr'")
    H.expect_error(function() ms.recipe.options(sgd, { nesterov = "nope" }) end, "option 'nesterov'", "boolean")
    H.expect_error(function() ms.recipe.options(sgd, { nesterov = 1 }) end, "option 'nesterov'")
    H.expect_error(function() ms.recipe.options(sgd, { lr = -1 }) end, "option 'lr'", "below its minimum")
    H.expect_error(function() ms.recipe.options(sgd, { state_dtype = "f16" }) end, "option 'state_dtype'", "one of f32, bf16")
    H.expect_error(function() ms.recipe.options(adamw, { betas = { 0.9 } }) end, "option 'betas' needs 2 numbers")
    H.expect_error(function() ms.recipe.options(adamw, { betas = { 0.9, 1.0 } }) end, "option 'betas'[2]", "must be < 1")
    H.expect_error(function() ms.recipe.options(adamw, { eps = 0 }) end, "option 'eps'", "must be > 0")
    H.expect_error(function() ms.recipe.options(sgd, { seed = 1.5 }) end, "option 'seed'", "integer")
    H.expect_error(function() ms.recipe.options(sgd, { nesterov = true }) end, "option 'nesterov' needs momentum > 0")
  end)

  it("refuses infinite and NaN numbers, which a min/max range lets through", function()
    -- the lr reaches the step as a device scalar (lr_t), which the engine cannot check: an infinite lr once
    -- passed and the first step wrote -inf into every parameter; a NaN beta turned them all to NaN
    local lion = ms.recipe.get("lion")
    H.expect_error(function() ms.recipe.options(adamw, { lr = "1e999" }) end, "option 'lr'", "finite")
    H.expect_error(function() ms.recipe.options(adamw, { lr = math.huge }) end, "option 'lr'", "finite")
    H.expect_error(function() ms.recipe.options(sgd, { momentum = -math.huge, lr = 0.1 }) end, "option 'momentum'")
    H.expect_error(function() ms.recipe.options(lion, { betas = { 0 / 0, 0.99 } }) end, "option 'betas'")
    H.expect_error(function() ms.recipe.options(lion, { betas = "0.9, 1e999" }) end, "option 'betas'")
    local p = { name = "w", param = ms.ones({ 2, 2 }), grad = ms.ones({ 2, 2 }) }
    local opt = ms.optim.new("sgd", { p }, { lr = 0.1 })
    H.expect_error(function() opt:set_lr(math.huge) end, "set_lr")
    opt:step()
    H.assert_close(p.param:totable(), { { 0.9, 0.9 }, { 0.9, 0.9 } })
  end)

  it("takes lists of strings and of name patterns as tables or comma-separated strings, item by item", function()
    local r = {
      name = "lists",
      options = {
        methods = { default = { "cn" }, type = "strings", values = { "cn", "ndb" }, nonempty = true },
        tags = { default = {}, type = "strings" },
        names = { default = {}, type = "patterns" },
      },
    }
    local given = { "ndb", "cn" }
    local o = ms.recipe.options(r, { methods = given, tags = " a , b,, c ", names = "^layer%.%d+, lm_head$" })
    assert.same({ "ndb", "cn" }, o.methods)
    assert.are_not.equal(given, o.methods)   -- a copy: the caller's table stays the caller's
    assert.same({ "a", "b", "c" }, o.tags)
    assert.same({ "^layer%.%d+", "lm_head$" }, o.names)
    assert.same({ "cn" }, ms.recipe.options(r, {}).methods)
    assert.same({}, ms.recipe.options(r, {}).names)
    local function bad(opts, ...) H.expect_error(function() ms.recipe.options(r, opts) end, ...) end
    bad({ methods = "cn,evd" }, "option 'methods'[2] = \"evd\"", "must be one of cn, ndb")
    bad({ methods = {} }, "option 'methods' needs at least one item")
    bad({ methods = "" }, "option 'methods' needs at least one item")
    bad({ tags = 5 }, "option 'tags' = 5", "a list of strings is needed")
    bad({ tags = { "a", 2 } }, "option 'tags' = {\"a\", 2}", "item 2 must be a non-empty string")
    bad({ tags = { "a", "" } }, "option 'tags'", "item 2 must be a non-empty string")
    bad({ tags = { x = "a" } }, "option 'tags'", "keys 1..n")
    bad({ names = { "ok", "[oops" } }, "option 'names'", "item 2 = \"[oops\" is not a valid Lua pattern")
    bad({ names = true }, "option 'names'", "a list of name patterns is needed")
  end)
end)

describe("the no_decay tag", function()
  -- every recipe with weight decay honours it (the Python bridge tags a param group with weight_decay 0 so):
  -- a tagged parameter with weight decay set steps bit for bit as with weight decay 0, and an untagged one
  -- does not.  w is 2-D (each recipe's main route), b 1-D (the AdamW route of sinkgd, muon and dash).
  local cases = {
    { "sgd", { weight_decay = 0.1, momentum = 0.9 }, { "weight_decay" } },
    { "adamw", { weight_decay = 0.1 }, { "weight_decay" } },
    { "lion", { weight_decay = 0.1 }, { "weight_decay" } },
    { "sinkgd", { weight_decay = 0.1, lr = 0.05, sinkgd_lr_scale = 1 }, { "weight_decay" } },
    { "muon", { weight_decay = 0.1, adam_weight_decay = 0.1 }, { "weight_decay", "adam_weight_decay" } },
    { "dash", { weight_decay = 0.1, adamw_weight_decay = 0.1, start_prec_step = 1 },
      { "weight_decay", "adamw_weight_decay" } },
  }
  for _, case in ipairs(cases) do
    local recipe, opts, keys = case[1], case[2], case[3]
    it(recipe .. ": a parameter tagged no_decay takes no weight decay, on every route", function()
      local w0, b0 = randn({ 12, 16 }), randn({ 16 })
      local gw, gb = {}, {}
      for s = 1, 2 do gw[s], gb[s] = randn({ 12, 16 }), randn({ 16 }) end
      local function run(o, tags)
        local ps = { { name = "layers.0.w", param = w0:clone(), grad = ms.zeros({ 12, 16 }), tags = tags },
                     { name = "layers.0.b", param = b0:clone(), grad = ms.zeros({ 16 }), tags = tags } }
        local opt = ms.optim.new(recipe, ps, o)
        for s = 1, 2 do
          ps[1].grad:copy_(gw[s])
          ps[2].grad:copy_(gb[s])
          opt:step()
        end
        return ps[1].param:totable(), ps[2].param:totable()
      end
      local none = {}
      for k, v in pairs(opts) do none[k] = v end
      for _, k in ipairs(keys) do none[k] = 0 end
      local wn, bn = run(none, nil)
      local wt, bt = run(opts, { "no_decay" })
      assert.are.same(wn, wt, "tagged matrix against weight decay 0")
      assert.are.same(bn, bt, "tagged vector against weight decay 0")
      local wd = run(opts, nil)
      assert.are_not.same(wn, wd, "an untagged matrix takes the weight decay")
    end)
  end
end)

describe("ms.optim.new", function()
  it("checks parameters and settings", function()
    local p = param("w", { 3, 4 })
    H.expect_error(function() ms.optim.new("sgd", { p, p }) end, "duplicate name 'w'")
    -- a checkpoint, a profile and the C ABI read a name up to its NUL: these two were one name there
    local a, b = param("w\0a", { 3, 4 }), param("w\0b", { 3, 4 })
    H.expect_error(function() ms.optim.new("sgd", { a, b }) end, 'params[1]: name must not contain a NUL byte (got "w\\0a")')
    H.expect_error(function()
      ms.optim.new("sgd", { { name = "w", param = ms.zeros({ 3, 4 }), grad = ms.zeros({ 4, 3 }) } })
    end, "grad shape [4,3] != param shape [3,4]")
    H.expect_error(function() ms.optim.new("sgd", { { name = "w", param = 5 } }) end, "param must be a tensor")
    H.expect_error(function() ms.optim.new("sgd", { p }, {}, { clip = 1 }) end, "unknown setting 'clip'")
    H.expect_error(function() ms.optim.new("sgd", { p }, {}, { nonfinite = "ignore" }) end, "nonfinite")
    H.expect_error(function() ms.optim.new("sgd", { p }, { lr = "x" }) end, "option 'lr'")
    H.expect_error(function() ms.optim.new("sgd", { p }, {}, { schedule = { kind = "exp" } }) end, "unknown kind")
  end)

  it("routes and groups parameters, registers tied parameters once, and reports state bytes", function()
    local w = param("layer.weight", { 8, 4 })
    local b = param("layer.bias", { 8 })
    local n = param("norm.weight", { 4 }, "f32", { "no_decay" })
    local tied = { name = "lm_head.weight", param = w.param, grad = w.grad }
    local opt = ms.optim.new("adamw", { w, b, n, tied }, { no_decay_1d = true })
    local info, text = opt:info()
    assert.equals(2, #info.groups)
    assert.equals("adamw.0", info.groups[1].id)
    assert.same({ "layer.weight" }, info.groups[1].params)
    assert.same({ "layer.bias", "norm.weight" }, info.groups[2].params)
    assert.equals(0, info.groups[2].overrides.weight_decay)
    assert.equals(0, opt.groups[2].options.weight_decay)
    assert.equals(0.01, opt.groups[1].options.weight_decay)
    assert.equals((32 + 8 + 4) * 2 * 4, info.total_state_bytes)
    local found
    for _, p in ipairs(info.params) do if p.name == "lm_head.weight" then found = p end end
    assert.equals("layer.weight", found.tied_to)
    assert.truthy(text:find("tied to layer.weight", 1, true))
    assert.truthy(text:find("total", 1, true))
  end)

  it("refuses what the engine would refuse mid-step (aliased grads, strided params) before any route steps", function()
    -- muon steps the matrix in one route and the bias in another: the bias route's engine call refused the
    -- aliasing or the strides, but only after the matrix had been updated (and the step count had not moved)
    local w = { name = "w", param = ms.ones({ 4, 4 }), grad = ms.ones({ 4, 4 }) }
    local bias = ms.ones({ 4 })
    H.expect_error(function() ms.optim.new("muon", { w, { name = "bias", param = bias, grad = bias } }) end,
                   "parameter 'bias'", "shares memory")
    local big = ms.ones({ 6 })
    H.expect_error(function()
      ms.optim.new("sgd", { w, { name = "half", param = big:slice(0, 0, 4), grad = big:slice(0, 2, 6) } })
    end, "parameter 'half'", "shares memory")
    local opt = ms.optim.new("muon", { w, { name = "bias", param = bias, grad = ms.ones({ 4 }) } })
    H.expect_error(function() opt:set_grad("bias", bias) end, "parameter 'bias'", "shares memory")
    H.expect_error(function()
      ms.optim.new("muon", { w, { name = "bias", param = ms.ones({ 8 }):slice(0, 0, 8, 2), grad = ms.ones({ 4 }) } })
    end, "parameter 'bias'", "contiguous")
    assert.same(ms.ones({ 4, 4 }):totable(), w.param:totable())
  end)

  it("refuses parameters and gradients that share memory across parameters, at registration and after set_grad", function()
    -- one gradient buffer given to two parameters was scaled twice by clipping and counted twice in the norm; a
    -- parameter inside another's memory was written through both
    local buf = ms.randn({ 2, 8 }, { seed = H.seed() })
    local pa, pb = ms.randn({ 8 }), ms.randn({ 8 })
    H.expect_error(function()
      ms.optim.new("adamw", { { name = "a", param = pa, grad = buf[0] }, { name = "b", param = pb, grad = buf[0] } })
    end, "shares memory with parameter")
    H.expect_error(function()
      ms.optim.new("sgd", { { name = "a", param = pa, grad = pb }, { name = "b", param = pb, grad = buf[1] } })
    end, "shares memory with parameter")
    local big = ms.randn({ 12 })
    H.expect_error(function()
      ms.optim.new("sgd", { { name = "a", param = big:narrow(0, 0, 8), grad = buf[0] },
                            { name = "b", param = big:narrow(0, 4, 8), grad = buf[1] } })
    end, "parameter 'b': its param shares memory with parameter 'a''s param")
    -- the same weights given again as another view (a tie is the same tensor) would be stepped twice
    local w = ms.randn({ 4, 4 })
    H.expect_error(function()
      ms.optim.new("sgd", { { name = "w", param = w, grad = ms.randn({ 4, 4 }) },
                            { name = "w_flat", param = w:reshape({ 16 }), grad = ms.randn({ 16 }) } })
    end, "parameter 'w_flat': its param shares memory with parameter 'w''s param")
    -- disjoint views of one flat buffer (a bucketed trainer's gradients) are fine, and so are tied parameters
    local opt = ms.optim.new("adamw", { { name = "a", param = pa, grad = buf[0] }, { name = "b", param = pb, grad = buf[1] },
                                        { name = "tied", param = pa, grad = buf[0] } })
    assert.is_true(opt:step())
    local a1, b1 = pa:clone(), pb:clone()
    opt:set_grad("b", buf[0])
    H.expect_error(function() opt:step() end, "shares memory with parameter")
    H.expect_error(function() opt:step() end, "shares memory with parameter")   -- and again, unchanged
    assert.same(a1:totable(), pa:totable())
    assert.same(b1:totable(), pb:totable())
    opt:set_grad("b", buf[1])
    assert.is_true(opt:step())
  end)

  it("needs a recipe with a number option 'lr'", function()
    local r = { name = "nolr", options = {}, route = function() return "r" end, routes = { r = { step = function() end } } }
    H.expect_error(function() ms.optim.new(r, { param("w", { 2 }) }) end, "recipe nolr has no number option 'lr'")
  end)

  it("refuses a route the recipe does not have", function()
    local r = { name = "bad", options = { lr = { default = 1, type = "number" } }, route = function() return "nowhere" end, routes = { r = { step = function() end } } }
    H.expect_error(function() ms.optim.new(r, { param("w", { 2 }) }) end, "route() gave nowhere", "'w'")
  end)
end)

-- a recipe that records what the runtime hands it
local function recorder()
  local seen = {}
  local r = {
    name = "recorder", version = 1,
    options = { lr = { default = 0.5, type = "number" } },
    route = function() return "rec" end,
    routes = { rec = {
      init = function(group) group.state.calls = 0 end,
      plan = function(group, o, ctx) return ctx.step % 2 == 0 and "even" or "odd" end,
      step = function(group, o, ctx)
        group.state.calls = group.state.calls + 1
        local names = {}
        for i, m in ipairs(group) do names[i] = m.name end
        seen[#seen + 1] = { step = ctx.step, lr = ctx.lr, lr_t = ctx.lr_t:item(), step_t = ctx.step_t:item(),
                            plan = ctx.plan, names = names }
        ctx.report("members", #group)
      end,
    } },
  }
  return r, seen
end

describe("schedules and the learning rate", function()
  it("computes each schedule kind", function()
    local function mult(s, step) return (ms.schedule.compile(s))(step) end
    assert.equals(1, mult(nil, 5))
    assert.equals(0.5, mult({ kind = "linear_warmup", warmup_steps = 10 }, 5))
    assert.equals(1, mult({ kind = "linear_warmup", warmup_steps = 10 }, 11))
    local cos = { kind = "cosine", warmup_steps = 10, total_steps = 110, min_lr_ratio = 0.1 }
    assert.equals(0.1, mult(cos, 1))
    assert.near(1, mult(cos, 10), 1e-12)
    assert.near(0.1 + 0.9 * 0.5, mult(cos, 60), 1e-12)
    assert.near(0.1, mult(cos, 110), 1e-12)
    assert.near(0.1, mult(cos, 500), 1e-12)
    local wsd = { kind = "wsd", warmup_steps = 2, stable_steps = 3, decay_steps = 4, min_lr_ratio = 0 }
    assert.equals(0.5, mult(wsd, 1))
    assert.equals(1, mult(wsd, 5))
    assert.equals(0.5, mult(wsd, 7))
    assert.equals(0, mult(wsd, 9))
    assert.equals(0.25, mult(function(step) return step / 4 end, 1))
    H.expect_error(function() mult(function() return -1 end, 1) end, "schedule function returned -1")
    H.expect_error(function() mult({ kind = "cosine", total_steps = 5, warmup_steps = 5 }, 1) end, "total_steps")
    H.expect_error(function() mult({ kind = "wsd", stable_steps = 1, decay_steps = 1, min_lr_ratio = 2 }, 1) end, "min_lr_ratio")
    -- a mistyped false is refused, not read as the default
    H.expect_error(function() mult({ kind = "cosine", total_steps = 5, min_lr_ratio = false }, 1) end, "min_lr_ratio", "false")
    H.expect_error(function() mult({ kind = "wsd", stable_steps = 1, decay_steps = 1, decay = false }, 1) end, "decay", "false")
    assert.near(0.5, mult({ kind = "wsd", stable_steps = 0, decay_steps = 2, decay = "cosine" }, 1), 1e-12)
  end)

  it("refuses NaN and infinite schedule values (a range check lets NaN through, an integer check inf)", function()
    local function mult(s, step) return (ms.schedule.compile(s))(step) end
    H.expect_error(function() mult({ kind = "cosine", total_steps = 10, min_lr_ratio = 0 / 0 }, 1) end, "min_lr_ratio")
    H.expect_error(function() mult({ kind = "wsd", stable_steps = 1, decay_steps = 1, min_lr_ratio = 0 / 0 }, 1) end,
                   "min_lr_ratio")
    H.expect_error(function() mult({ kind = "linear_warmup", warmup_steps = math.huge }, 1) end, "warmup_steps")
    H.expect_error(function() mult({ kind = "cosine", total_steps = math.huge }, 1) end, "total_steps")
    H.expect_error(function() mult({ kind = "wsd", stable_steps = math.huge, decay_steps = 1 }, 1) end, "stable_steps")
    H.expect_error(function() mult({ kind = "wsd", stable_steps = 1, decay_steps = math.huge }, 1) end, "decay_steps")
    H.expect_error(function() mult(function() return math.huge end, 3) end, "schedule function returned inf at step 3")
    local p = param("w", { 3 })
    H.expect_error(function()
      ms.optim.new("sgd", { p }, {}, { schedule = { kind = "cosine", total_steps = 10, min_lr_ratio = 0 / 0 } })
    end, "min_lr_ratio")
  end)

  it("hands recipes the step, the scheduled lr, device scalars and the plan; set_lr overrides", function()
    local r, seen = recorder()
    local p = param("w", { 3 })
    local opt = ms.optim.new(r, { p }, { lr = 0.5 }, { schedule = { kind = "linear_warmup", warmup_steps = 4 } })
    opt:step()
    opt:step()
    assert.same({ step = 1, lr = 0.125, lr_t = 0.125, step_t = 1, plan = "odd", names = { "w" } }, seen[1])
    assert.same({ step = 2, lr = 0.25, lr_t = 0.25, step_t = 2, plan = "even", names = { "w" } }, seen[2])
    opt:set_lr(0.03)
    opt:step()
    assert.equals(0.03, seen[3].lr)
    assert.near(0.03, seen[3].lr_t, 1e-8)
    assert.equals(1, opt:stats().last.reports.members)
    assert.equals(3, opt.groups[1].state.calls)
    H.expect_error(function() opt:set_lr(-1) end, "set_lr")
  end)

  it("steps a group with its own lr (a parameter's lr option) at that multiple of the scheduled lr", function()
    local a, b = param("a", { 4 }), param("b", { 4 })
    b.options = { lr = 0.5 }
    local opt = ms.optim.new("sgd", { a, b }, { lr = 0.1 }, { schedule = { kind = "linear_warmup", warmup_steps = 4 } })
    for s = 1, 3 do
      if s == 3 then opt:set_lr(0.2) end
      fill_grads({ a, b }, H.seed())
      local pa, pb, ga, gb = a.param:totable(), b.param:totable(), a.grad:totable(), b.grad:totable()
      local lr = s == 3 and 0.2 or 0.1 * s / 4
      opt:step()
      for i = 1, 4 do
        H.assert_close(a.param:totable()[i], pa[i] - lr * ga[i], 1e-6, 1e-7, "a")
        H.assert_close(b.param:totable()[i], pb[i] - 5 * lr * gb[i], 1e-6, 1e-7, "b: 5x the lr")
      end
    end
    local c = param("c", { 4 })
    c.options = { lr = 0.5 }
    H.expect_error(function() ms.optim.new("sgd", { param("d", { 4 }), c }, { lr = 0 }) end, "option lr = 0.5", "base lr is 0")
  end)

  it("skips parameters without a gradient", function()
    local r, seen = recorder()
    local a, b = param("a", { 2 }), { name = "b", param = randn({ 2 }) }
    local opt = ms.optim.new(r, { a, b })
    opt:step()
    assert.same({ "a" }, seen[1].names)
    opt:set_grad("b", ms.zeros({ 2 }))
    opt:step()
    assert.same({ "a", "b" }, seen[2].names)
    H.expect_error(function() opt:set_grad("c", ms.zeros({ 2 })) end, "no parameter named 'c'")
    H.expect_error(function() opt:set_grad("b", ms.zeros({ 3 })) end, "grad shape [3] != param shape [2]")
  end)
end)

describe("the step guard", function()
  it("skips a step with non-finite gradients and changes nothing", function()
    local a, b = param("a", { 4, 4 }), param("b", { 5 })
    local opt = ms.optim.new("sgd", { a, b }, { lr = 0.1, momentum = 0.9 })
    fill_grads({ a, b }, H.seed())
    assert.is_true(opt:step())
    local before = copy_params({ a, b })
    local buf = opt.members[1].state.momentum_buffer:totable()
    b.grad[2] = 0 / 0
    assert.is_false(opt:step())
    assert.same(before, copy_params({ a, b }))
    assert.same(buf, opt.members[1].state.momentum_buffer:totable())
    local st = opt:stats()
    assert.equals(1, st.skipped_steps)
    assert.equals(1, st.step)
    assert.same({ "b" }, st.last.nonfinite)
    b.grad[2] = 1 / 0
    assert.is_false(opt:step())
    assert.equals(2, opt:stats().skipped_steps)
  end)

  it("counts a gradient whose sum of squares overflows f32 as non-finite (SinkGD's CUDA sums would too)", function()
    local a, b = param("a.weight", { 6, 4 }), param("b", { 5 })
    local opt = ms.optim.new("sinkgd", { a, b }, { lr = 0.1 })
    fill_grads({ a, b }, H.seed())
    local before = copy_params({ a, b })
    a.grad:copy_(ms.mul(a.grad, 1e20))   -- every element finite, the f32 sum of their squares is not
    assert.is_false(opt:step())
    assert.same(before, copy_params({ a, b }))
    assert.same({ "a.weight" }, opt:stats().last.nonfinite)
  end)

  it("raises naming the parameters when asked to", function()
    local a = param("enc.weight", { 3 })
    local opt = ms.optim.new("sgd", { a }, {}, { nonfinite = "raise" })
    a.grad:fill_(0 / 0)
    H.expect_error(function() opt:step() end, "non-finite gradients in enc.weight")
  end)

  it("clips the global gradient norm", function()
    local a, b = param("a", { 6 }), param("b", { 3, 2 })
    local opt = ms.optim.new("sgd", { a, b }, { lr = 1 }, { clip_grad_norm = 0.5 })
    fill_grads({ a, b }, H.seed())
    local g = { a.grad:totable(), H.flat(b.grad:totable()) }
    local total = 0
    for _, t in ipairs(g) do for _, v in ipairs(t) do total = total + v * v end end
    local norm = math.sqrt(total)
    local p0 = { a.param:totable(), H.flat(b.param:totable()) }
    opt:step()
    local coef = 0.5 / (norm + 1e-6)
    local want = {}
    for i = 1, 6 do want[i] = p0[1][i] - coef * g[1][i] end
    H.assert_close(a.param:totable(), want, 1e-5, 1e-6, "clipped update")
    assert.is_true(opt:stats().last.clipped)
    H.assert_close(opt:stats().last.grad_norm, norm, 1e-5, 0)
  end)

  it("unscales gradients of a scaled loss and skips on overflow", function()
    local a = param("a", { 5 })
    local opt = ms.optim.new("sgd", { a }, { lr = 0.5 })
    fill_grads({ a }, H.seed())
    local g = a.grad:totable()
    local p0 = a.param:totable()
    a.grad:mul_(1024)
    opt:step { grad_scale = 1024 }
    local want = {}
    for i = 1, 5 do want[i] = p0[i] - 0.5 * g[i] end
    H.assert_close(a.param:totable(), want, 1e-6, 1e-7, "unscaled update")
    a.grad:fill_(1 / 0)
    assert.is_false(opt:step { grad_scale = 1024 })
    H.expect_error(function() opt:step { grad_scale = 0 } end, "grad_scale")
    H.expect_error(function() opt:step { grad_scale = 1e-320 } end, "grad_scale 9.9998886718268301e-321 is too small")
  end)

  it("counts a gradient that a grad_scale below 1 could take past its dtype's largest value as non-finite", function()
    -- unscaling works in the gradient's own dtype: f16 40000 / 0.5 and f32 1 / 1e-40 are infinite there, and
    -- the step was taken on them (NaN parameters, under "skip" and "raise")
    for _, dev in ipairs(H.has_cuda and { "cpu", "cuda" } or { "cpu" }) do
      local ctx = ms.device(dev)
      for _, c in ipairs { { "f16", 40000, 0.5 }, { "f32", 1, 1e-40 }, { "bf16", 1e38, 0.25 } } do
        local dt, v, scale = c[1], c[2], c[3]
        for _, checks in ipairs { "host", "device" } do
          for _, nonfinite in ipairs(checks == "host" and { "skip", "raise" } or { "skip" }) do
            local w = { name = "w", param = ms.ones({ 4 }, { dtype = dt, ctx = ctx }),
                        grad = ms.full({ 4 }, v, { dtype = dt, ctx = ctx }) }
            local b = { name = "b", param = ms.ones({ 3 }, { ctx = ctx }), grad = ms.ones({ 3 }, { ctx = ctx }) }
            local opt = ms.optim.new("adamw", { w, b }, { lr = 0.1 },
                                     { nonfinite = nonfinite, device_checks = checks == "device" or nil })
            local what = ("%s: %s %s, %s checks, %s"):format(dev, dt, tostring(v), checks, nonfinite)
            if nonfinite == "raise" and checks == "host" then
              H.expect_error(function() opt:step { grad_scale = scale } end,
                             ("non-finite gradients in w (%s, which 1 / grad_scale"):format(dt))
            else
              opt:step { grad_scale = scale }
              if checks == "host" then
                assert.is_true(opt:stats().last.skipped, what)
                assert.truthy(opt:stats().last.nonfinite[1]:find("could take past its largest value", 1, true), what)
              end
            end
            assert.same({ 1, 1, 1, 1 }, w.param:to("f32"):tolist_flat(), what .. ": w unchanged")
            assert.same({ 1, 1, 1 }, b.param:tolist_flat(), what .. ": b unchanged")
          end
        end
      end
    end
    -- a grad_scale of 1 or more never enlarges: the same gradients step (an f16 norm past 65504 included)
    for _, checks in ipairs { "host", "device" } do
      local w = { name = "w", param = ms.ones({ 4 }, { dtype = "f16" }), grad = ms.full({ 4 }, 40000, { dtype = "f16" }) }
      local opt = ms.optim.new("adamw", { w }, { lr = 0.1 }, { device_checks = checks == "device" or nil })
      opt:step { grad_scale = 1 }
      assert.is_false(opt:stats().last.skipped == true, checks)
      for _, x in ipairs(w.param:to("f32"):tolist_flat()) do assert.is_true(x > 0.85 and x < 0.95, checks .. ": " .. x) end
    end
  end)
end)

describe("step(args) refused", function()
  it("changes no gradient when one of args.grads, or grad_scale, is bad", function()
    -- (one gradient each way round, so that the good one is replaced first whatever order pairs() takes)
    for _, bad_name in ipairs { "a", "b" } do
      local a, b = param("a", { 3 }), param("b", { 3 })
      fill_grads({ a, b }, H.seed())
      local opt = ms.optim.new("sgd", { a, b }, { lr = 0.1 })
      local other = ms.full({ 3 }, 100)
      local grads = { a = other, b = other }
      grads[bad_name] = ms.ones({ 4 })
      H.expect_error(function() opt:step { grads = grads } end, "grad shape [4]")
      H.expect_error(function() opt:step { grads = { a = other, b = other, nope = other } } end, "nope")
      H.expect_error(function() opt:step { grads = { a = other, b = other }, grad_scale = -1 } end, "grad_scale")
      assert.equals(a.grad, opt.by_name.a.member.grad)
      assert.equals(b.grad, opt.by_name.b.member.grad)
      assert.equals(0, opt:stats().step)
      -- a parameter without a gradient stays without one (and its own step count unchanged)
      local c = { name = "c", param = ms.ones({ 3 }) }
      local opt2 = ms.optim.new("sgd", { a, c }, { lr = 0.1 })
      H.expect_error(function() opt2:step { grads = { c = other }, grad_scale = 0 } end, "grad_scale")
      assert.is_nil(opt2.by_name.c.member.grad)
      opt2:step()
      assert.same({ 1, 1, 1 }, c.param:totable())
    end
  end)

  it("names a misspelt or mistyped argument of step, prepare_replay and load, and steps nothing", function()
    local a = param("a", { 3 })
    fill_grads({ a }, H.seed())
    local opt = ms.optim.new("sgd", { a }, { lr = 0.1 })
    local before = a.param:totable()
    -- grad_scal = 1024 ignored would apply gradients 1024 times too large
    H.expect_error(function() opt:step { grad_scal = 1024 } end, "step: unknown argument 'grad_scal'")
    H.expect_error(function() opt:step(1024) end, "step: the arguments must be a table")
    H.expect_error(function() opt:prepare_replay { grads = {} } end, "prepare_replay: unknown argument 'grads'")
    assert.same(before, a.param:totable())
    assert.equals(0, opt:stats().step)
    local path = os.tmpname()
    opt:save(path)
    H.expect_error(function() opt:load(path, { forse = true }) end, "load: unknown argument 'forse'")
    H.expect_error(function() opt:load(path, true) end, "load: the arguments must be a table")
    assert.same({ step = 0, recipe = "sgd" }, opt:load(path, { force = true }))
    os.remove(path)
  end)
end)

describe("fused recipes through the runtime", function()
  local function sgd_reference(p, grads, o)
    local buf, out = nil, {}
    for i = 1, #p do out[i] = p[i] end
    for t, g in ipairs(grads) do
      local bnew = {}
      for i = 1, #out do
        local d = g[i] + o.weight_decay * out[i]
        if o.momentum > 0 then
          bnew[i] = t == 1 and d or o.momentum * buf[i] + (1 - o.dampening) * d
          d = o.nesterov and d + o.momentum * bnew[i] or bnew[i]
        end
        out[i] = out[i] - o.lr * d
      end
      buf = bnew
    end
    return out
  end

  it("sgd with momentum and nesterov follows torch.optim.SGD", function()
    for _, o in ipairs {
      { lr = 0.1, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false },
      { lr = 0.05, momentum = 0.9, dampening = 0.1, weight_decay = 0.01, nesterov = false },
      { lr = 0.05, momentum = 0.9, dampening = 0, weight_decay = 0, nesterov = true },
    } do
      local a = param("a", { 7 })
      local p0 = a.param:totable()
      local opt = ms.optim.new("sgd", { a }, o)
      local grads = {}
      for s = 1, 4 do
        fill_grads({ a }, H.seed())
        grads[s] = a.grad:totable()
        opt:step()
      end
      H.assert_close(a.param:totable(), sgd_reference(p0, grads, o), 1e-5, 1e-6, "sgd")
    end
  end)

  it("adamw follows torch.optim.AdamW over several steps", function()
    local a, b = param("w", { 4, 3 }), param("b", { 3 })
    local p0 = { H.flat(a.param:totable()), b.param:totable() }
    local opt = ms.optim.new("adamw", { a, b }, { lr = 0.01, weight_decay = 0.1, betas = { 0.8, 0.99 } })
    local m, v = { {}, {} }, { {}, {} }
    local p = { p0[1], p0[2] }
    for s = 1, 5 do
      fill_grads({ a, b }, H.seed())
      local gs = { H.flat(a.grad:totable()), b.grad:totable() }
      opt:step()
      for k = 1, 2 do
        for i = 1, #p[k] do
          local g = gs[k][i]
          m[k][i] = 0.8 * (m[k][i] or 0) + 0.2 * g
          v[k][i] = 0.99 * (v[k][i] or 0) + 0.01 * g * g
          p[k][i] = p[k][i] * (1 - 0.01 * 0.1)
          p[k][i] = p[k][i] - 0.01 * (m[k][i] / (1 - 0.8 ^ s)) / (math.sqrt(v[k][i] / (1 - 0.99 ^ s)) + 1e-8)
        end
      end
    end
    H.assert_close(H.flat(a.param:totable()), p[1], 1e-5, 1e-6, "adamw w")
    H.assert_close(b.param:totable(), p[2], 1e-5, 1e-6, "adamw b")
  end)

  it("counts each parameter's own steps (torch's state['step']): the steps it had no gradient in are not its own", function()
    -- b has no gradient at steps 2 and 3: its 2nd AdamW step (optimizer step 4) takes bias corrections of t = 2,
    -- and sgd's momentum buffer starts (buf = d, no dampening) at c's first gradient (step 3)
    local o = { lr = 0.01, weight_decay = 0.1, betas = { 0.8, 0.99 } }
    local function adamw_ref(p, g, st)
      st.t, st.m, st.v = (st.t or 0) + 1, st.m or {}, st.v or {}
      for i = 1, #p do
        st.m[i] = 0.8 * (st.m[i] or 0) + 0.2 * g[i]
        st.v[i] = 0.99 * (st.v[i] or 0) + 0.01 * g[i] * g[i]
        p[i] = p[i] * (1 - 0.01 * 0.1) - 0.01 * (st.m[i] / (1 - 0.8 ^ st.t)) / (math.sqrt(st.v[i] / (1 - 0.99 ^ st.t)) + 1e-8)
      end
    end
    local function absent(s) return s == 2 or s == 3 end
    local function run(path, save_at, from, params, opt)
      for s = from, 6 do
        if absent(s) then opt:set_grad("b", nil) else opt:set_grad("b", params[2].grad) end
        fill_grads({ params[1], params[2] }, 4000 + s)
        opt:step()
        if s == save_at then opt:save(path) end
      end
    end
    local function make()
      local params = { param("a", { 3, 2 }), param("b", { 5 }) }
      for i, q in ipairs(params) do q.param:copy_(ms.randn(q.param:shape(), { seed = 7, offset = i })) end
      return params, ms.optim.new("adamw", params, o)
    end
    local path = os.tmpname()
    local params, opt = make()
    local want, st = { params[1].param:tolist_flat(), params[2].param:tolist_flat() }, { {}, {} }
    run(path, 3, 1, params, opt)
    for s = 1, 6 do
      for k = 1, 2 do
        if k == 1 or not absent(s) then
          local g = ms.randn(params[k].param:shape(), { seed = 4000 + s, offset = k }):tolist_flat()
          adamw_ref(want[k], g, st[k])
        end
      end
    end
    H.assert_close(params[1].param:tolist_flat(), want[1], 1e-5, 1e-6, "a")
    H.assert_close(params[2].param:tolist_flat(), want[2], 1e-5, 1e-6, "b (2 of its steps without a gradient)")
    -- resumed from the checkpoint of step 3, where b had no gradient: the uninterrupted run's bits
    local upto, oup = make()
    for s = 1, 3 do
      if absent(s) then oup:set_grad("b", nil) end
      fill_grads({ upto[1], upto[2] }, 4000 + s)
      oup:step()
    end
    local again, opt2 = make()
    for i = 1, 2 do again[i].param:copy_(upto[i].param) end
    opt2:set_grad("b", nil)
    opt2:load(path)
    os.remove(path)
    run(nil, nil, 4, again, opt2)
    for i = 1, 2 do assert.same(params[i].param:tolist_flat(), again[i].param:tolist_flat()) end

    local c = param("c", { 4 })
    local sgd = ms.optim.new("sgd", { c }, { lr = 0.1, momentum = 0.9, dampening = 0.5 })
    sgd:set_grad("c", nil)
    sgd:step()
    sgd:step()
    local p0 = c.param:totable()
    sgd:set_grad("c", c.grad)
    fill_grads({ c }, H.seed())
    local g = c.grad:totable()
    sgd:step()
    for i = 1, 4 do H.assert_close(c.param:totable()[i], p0[i] - 0.1 * g[i], 1e-6, 1e-7, "sgd: buf = d at c's first step") end
  end)

  it("updates a 300-tensor group in at most 4 launches", function()
    local params = {}
    for i = 1, 300 do params[i] = param("p" .. i, { (i % 7) + 1, (i % 5) + 2 }) end
    local opt = ms.optim.new("adamw", params)
    fill_grads(params, H.seed())
    opt:step()
    assert.is_true(opt:stats().last.launches <= 4, "launches: " .. opt:stats().last.launches)
  end)

  it("keeps f32 master weights for bf16 parameters", function()
    local w = { name = "w", param = ms.ones({ 64 }, { dtype = "bf16" }), grad = ms.ones({ 64 }, { dtype = "bf16" }) }
    local opt = ms.optim.new("sgd", { w }, { lr = 1e-4 }, { master_weights = true })
    for _ = 1, 10 do opt:step() end
    local master = opt.members[1].master
    assert.equals("f32", master:dtype())
    H.assert_close(master:totable()[1], 1 - 10 * 1e-4, 1e-6, 0, "master accumulates small steps")
    assert.same(master:to("bf16"):totable(), w.param:totable())
    local _, text = opt:info()
    assert.truthy(text:find("f32 master", 1, true))
    -- without masters, bf16 loses every one of those steps (1 - 1e-4 rounds back to 1)
    local v = { name = "v", param = ms.ones({ 64 }, { dtype = "bf16" }), grad = ms.ones({ 64 }, { dtype = "bf16" }) }
    local plain = ms.optim.new("sgd", { v }, { lr = 1e-4 })
    for _ = 1, 10 do plain:step() end
    assert.equals(1, v.param:totable()[1])
  end)
end)

describe("checkpoints", function()
  local saved_rng
  local function run(recipe, options, settings, steps, save_at, path)
    ms.manual_seed(11)
    local params = { param("a", { 5, 3 }), param("b", { 4 }, "bf16"), param("c", { 2, 2 }) }
    for i, p in ipairs(params) do p.param:copy_(ms.randn(p.param:shape(), { seed = 99, offset = i })) end
    local opt = ms.optim.new(recipe, params, options, settings)
    for s = 1, steps do
      fill_grads(params, 1000 + s)
      opt:step()
      if save_at == s then opt:save(path) saved_rng = ms.rng_state() end
    end
    return params, opt
  end

  local function resume(recipe, options, settings, steps, save_at, path)
    local params = { param("a", { 5, 3 }), param("b", { 4 }, "bf16"), param("c", { 2, 2 }) }
    local ref_params = run(recipe, options, settings, save_at, nil, nil)
    for i, p in ipairs(params) do p.param:copy_(ref_params[i].param) end
    local opt = ms.optim.new(recipe, params, options, settings)
    ms.manual_seed(12345)   -- the generator must come back from the checkpoint, not from replaying its steps
    opt:load(path)
    assert.same(saved_rng, ms.rng_state())
    for s = save_at + 1, steps do
      fill_grads(params, 1000 + s)
      opt:step()
    end
    return params, opt
  end

  -- every state tensor (master weights included) of two optimizers, bit for bit, by checkpoint name
  local function assert_same_state(a, b)
    local ta, sa = a:_state_entries()
    local tb, sb = b:_state_entries()
    local n = 0
    for name, t in pairs(ta) do
      assert(tb[name], "state tensor " .. name .. " missing after resuming")
      assert(H.same_bits(t:tolist_flat(), tb[name]:tolist_flat()), "state tensor " .. name .. " differs after resuming")
      n = n + 1
    end
    for name in pairs(tb) do assert(ta[name], "state tensor " .. name .. " only after resuming") end
    assert.same(sa, sb)
    -- the masters straight from the members, not through _state_entries (which save() uses too)
    for i, m in ipairs(a.members) do
      local mb = b.members[i]
      assert.equals(m.master == nil, mb.master == nil)
      if m.master then
        assert(H.same_bits(m.master:tolist_flat(), mb.master:tolist_flat()), m.name .. ": master differs after resuming")
        n = n + 1
      end
    end
    return n
  end

  for _, case in ipairs {
    { "adamw", { lr = 0.01, weight_decay = 0.1 }, { schedule = { kind = "cosine", warmup_steps = 2, total_steps = 10 } } },
    { "adamw", { state_dtype = "bf16" }, { master_weights = true } },
    { "sgd", { lr = 0.05, momentum = 0.9, nesterov = true }, { clip_grad_norm = 1.0 } },
  } do
    it(("resumes %s %s bit for bit"):format(case[1], ms.json.encode(case[2])), function()
      local path = os.tmpname()
      local full, full_opt = run(case[1], case[2], case[3], 8, 3, path)
      local resumed, opt = resume(case[1], case[2], case[3], 8, 3, path)
      os.remove(path)
      assert.equals(8, opt.step_count)
      for i = 1, #full do assert.same(full[i].param:totable(), resumed[i].param:totable()) end
      -- the params alone can hide a state the checkpoint lost (a bf16 param rounds an f32 master's drift away)
      assert(assert_same_state(full_opt, opt) > 0, "no state tensors compared")
      if case[3].master_weights then assert(opt.members[2].master, "member b keeps an f32 master") end
    end)
  end

  it("restores a learning rate set with set_lr (the schedule stays bypassed)", function()
    local path = os.tmpname()
    local lr = 0.01 + 0.01 * ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()
    local settings = { schedule = { kind = "cosine", warmup_steps = 2, total_steps = 10 } }
    local _, opt = run("adamw", { lr = 0.5 }, settings, 2, nil, nil)
    opt:set_lr(lr)
    opt:save(path)
    local opt2 = ms.optim.new("adamw", { param("a", { 5, 3 }), param("b", { 4 }, "bf16"), param("c", { 2, 2 }) },
                              { lr = 0.5 }, settings)
    opt2:load(path)
    os.remove(path)
    assert.equals(lr, opt2:get_lr())
  end)

  it("restores scalars and tensors of group and member state", function()
    local r = {
      name = "stateful", options = { lr = { default = 1, type = "number" } },
      route = function() return "s" end,
      routes = { s = {
        init = function(g)
          g.state.count, g.state.tag, g.state.blocks = 0, "x", { ms.zeros({ 2 }), ms.zeros({ 3 }) }
          for _, m in ipairs(g) do m.state.seen = false end
        end,
        step = function(g, o, ctx)
          g.state.count = g.state.count + 1
          g.state.tag = "step" .. ctx.step
          g.state.blocks[2]:add_(1)
          for _, m in ipairs(g) do m.state.seen = true end
        end,
      } },
    }
    local p = param("w", { 2 })
    local opt = ms.optim.new(r, { p })
    opt:step() opt:step()
    local path = os.tmpname()
    opt:save(path)
    local opt2 = ms.optim.new(r, { param("w", { 2 }) })
    opt2:load(path)
    os.remove(path)
    local st = opt2.groups[1].state
    assert.equals(2, st.count)
    assert.equals("step2", st.tag)
    assert.same({ 2, 2, 2 }, st.blocks[2]:totable())
    assert.is_true(opt2.members[1].state.seen)
    assert.equals(2, opt2.step_count)
  end)

  it("keeps infinite and NaN state numbers (a 'best so far' that starts at math.huge)", function()
    local r = {
      name = "nonfinite", options = { lr = { default = 1, type = "number" } },
      route = function() return "s" end,
      routes = { s = {
        init = function(g)
          g.state.best, g.state.low, g.state.ratio, g.state.n = math.huge, -math.huge, 0 / 0, 0
          for _, m in ipairs(g) do m.state.worst = -math.huge end
        end,
        step = function(g) g.state.n = g.state.n + 1 end,
      } },
    }
    local opt = ms.optim.new(r, { param("w", { 2 }) })
    opt:step()
    local path = os.tmpname()
    opt:save(path)
    local opt2 = ms.optim.new(r, { param("w", { 2 }) })
    local st = opt2.groups[1].state
    st.best, st.low, st.ratio, opt2.members[1].state.worst = 1, 2, 3, 4
    opt2:load(path)
    os.remove(path)
    assert.equals(math.huge, st.best)
    assert.equals(-math.huge, st.low)
    assert.is_true(st.ratio ~= st.ratio)
    assert.equals(1, st.n)
    assert.equals(-math.huge, opt2.members[1].state.worst)
  end)

  it("refuses corrupt checkpoint metadata before changing anything, the global generator included", function()
    local path, bad = os.tmpname(), os.tmpname()
    local opt = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9 })
    opt:step()
    opt:save(path)
    local tensors, filemeta = ms.load(path)
    ms.manual_seed(5)
    local rng = ms.rng_state()
    for _, case in ipairs {
      { "rng", 5 }, { "rng", { seed = "x", offset = 0 } }, { "rng", { seed = -1, offset = 1.5 } },
      { "step", -3 }, { "step", 2.5 }, { "step", 2 ^ 53 }, { "step", 1e300 }, { "skipped", "many" }, { "lr_override", "fast" }, { "lr_override", -1 },
    } do
      local meta = ms.json.decode(filemeta.moonstep)
      meta[case[1]] = case[2]
      ms.save(bad, tensors, { moonstep = ms.json.encode(meta) })
      local fresh = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9 })
      local buf = fresh.members[1].state.momentum_buffer
      buf:fill_(7)
      H.expect_error(function() fresh:load(bad) end, bad, case[1])
      assert.equals(0, fresh.step_count)
      assert.same({ 7, 7, 7 }, buf:totable())
      assert.same(rng, ms.rng_state())
      assert.is_nil(fresh.lr_override)
    end
    H.expect_error(function() ms.set_rng_state({ seed = "x", offset = 0 }) end, "set_rng_state")
    assert.same(rng, ms.rng_state())
    os.remove(path)
    os.remove(bad)
  end)

  it("refuses an index whose parts are elsewhere, of another checkpoint or with slices that overlap", function()
    -- each index and part below is written by hand, as a two-rank save would write them, then doctored
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir) == 0)
    local path = dir .. "/ck"
    local opt = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9 })
    opt:step()
    opt:save(path)
    local _, filemeta = ms.load(path)
    local meta = ms.json.decode(filemeta.moonstep)
    local key = "param/a/momentum_buffer"
    local function part(r, world, values, changes)
      local m = {}
      for k, v in pairs(meta) do m[k] = v end
      m.world, m.rank = world, r
      for k, v in pairs(changes or {}) do m[k] = v end
      local name = ("ck.rank%d-of-%d"):format(r, world)
      ms.save(dir .. "/" .. name, { [key] = ms.tensor(values) }, { moonstep = ms.json.encode(m) })
      return name
    end
    local function index(parts, changes)
      local m = { moonstep = meta.moonstep, schema = meta.schema, recipe = meta.recipe, step = meta.step, rng = meta.rng,
                  world = #parts, parts = parts }
      for k, v in pairs(changes or {}) do m[k] = v end
      ms.save(path, {}, { moonstep = ms.json.encode(m) })
    end
    local function split(lo, hi) return { split = { [key] = { axis = 0, lo = lo, hi = hi, total = 3 } } } end
    local function refused(...)
      local fresh = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9 })
      local buf = fresh.members[1].state.momentum_buffer
      buf:fill_(7)
      H.expect_error(function() fresh:load(path) end, ...)
      assert.equals(0, fresh.step_count)
      assert.same({ 7, 7, 7 }, buf:totable())
    end
    -- a part outside the index's folder (the load read whatever file the index named)
    local outside = "../" .. dir:match("[^/]*$") .. "/" .. part(0, 1, { 1, 2, 3 })
    index({ outside })
    refused(path, "part 0 is \"" .. outside .. "\", not a file name ending in .rank0-of-1")
    index({ "/etc/passwd" })
    refused("part 0 is \"/etc/passwd\"")
    index({ 5 })
    refused("part 0 is number")
    -- a part of another recipe's checkpoint at the same step and world size (it loaded)
    index({ part(0, 1, { 1, 2, 3 }, { recipe = { name = "adamw", hash = "0123456789abcdef", version = 1 } }) })
    refused("ck.rank0-of-1: part 0 of 1", "of recipe 'adamw'", "a part of another checkpoint?")
    -- slices whose lengths add up to the whole but overlap, leaving row 2 as it was (it loaded 1, 5, 7)
    index({ part(0, 2, { 1, 2 }, split(0, 2)), part(1, 2, { 5 }, split(1, 2)) })
    refused("the slices of 'param/a/momentum_buffer'", "overlap: [0, 2) and [1, 2) along dim 0")
    -- a slice out of its range (lo = -1 copied the wrong rows), and metadata of the wrong kinds (bare Lua errors)
    index({ part(0, 1, { 1, 2, 3, 4 }, split(-1, 3)) })
    refused("ck.rank0-of-1: corrupt checkpoint metadata: the split of 'param/a/momentum_buffer'")
    index({ part(0, 1, { 1, 2, 3 }, { split = 5 }) })
    refused("ck.rank0-of-1: corrupt checkpoint metadata: 'split' is a number, not an object")
    index({ part(0, 1, { 1, 2, 3 }, split(0, 3.5)) })
    refused("corrupt checkpoint metadata: the split of")
    -- and the well-formed two-part index loads
    index({ part(0, 2, { 1, 2 }, split(0, 2)), part(1, 2, { 5 }, split(2, 3)) })
    local fresh = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9 })
    assert.equals(1, fresh:load(path).step)
    assert.same({ 1, 2, 5 }, fresh.members[1].state.momentum_buffer:totable())
    os.execute("rm -r " .. dir)
  end)

  it("refuses another recipe's checkpoint unless forced, and names mismatched tensors", function()
    local path = os.tmpname()
    local a = param("a", { 3 })
    local opt = ms.optim.new("sgd", { a }, { momentum = 0.9 })
    opt:step()
    opt:save(path)
    local other = ms.optim.new("adamw", { param("a", { 3 }) })
    H.expect_error(function() other:load(path) end, "checkpoint of recipe 'sgd'", "force")
    local wrong = ms.optim.new("sgd", { param("a", { 4 }) }, { momentum = 0.9 })
    H.expect_error(function() wrong:load(path) end, "param/a/momentum_buffer", "[3]", "[4]")
    local missing = ms.optim.new("sgd", { param("a", { 3 }), param("z", { 2 }) }, { momentum = 0.9 })
    H.expect_error(function() missing:load(path) end, "'param/z/momentum_buffer' is missing")
    local bf = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9, state_dtype = "bf16" })
    H.expect_error(function() bf:load(path) end, "param/a/momentum_buffer", "f32", "bf16")
    local f = assert(io.open(path, "r+b"))
    f:seek("set", 3)
    f:write("\255\255")
    f:close()
    local fresh = ms.optim.new("sgd", { param("a", { 3 }) }, { momentum = 0.9 })
    H.expect_error(function() fresh:load(path) end, "ms_safetensors_load")
    os.remove(path)
  end)
end)
