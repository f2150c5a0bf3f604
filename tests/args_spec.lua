-- Argument and option checks of the Lua surface: the value kinds of core.check_value / core.check_options, and
-- the modules that use them.  Each bad call must be refused with an error naming the argument or option, and
-- change nothing; a fractional integer must never reach the FFI (which truncates it toward zero).
local ms = require("moonstep")
local core = require("moonstep.core")

local function vals(t) return t:tolist_flat() end

describe("core.check_value and core.check_options", function()
  it("name the argument and the kind, range or strings it needs", function()
    H.expect_error(function() core.check_value("f", "iters", 2.5, "integer", 1) end, "f: iters must be an integer (got 2.5)")
    H.expect_error(function() core.check_value("f", "iters", math.huge, "integer", 1) end, "iters must be an integer")
    H.expect_error(function() core.check_value("f", "flag", "false", "boolean", 1) end, 'flag must be true or false (got "false")')
    H.expect_error(function() core.check_value("f", "flag", 0, "boolean", 1) end, "flag must be true or false (got 0)")
    H.expect_error(function() core.check_value("f", "n", {}, "number", 1) end, "n must be a number (got a table)")
    H.expect_error(function() core.check_value("f", "n", -1, { "integer", min = 0 }, 1) end, "n must be >= 0 (got -1)")
    H.expect_error(function() core.check_value("f", "n", 2 ^ 31, { "integer", max = core.INT_MAX }, 1) end, "n must be <=")
    H.expect_error(function() core.check_value("f", "mode", "x", { "string", values = { "a", "b" } }, 1) end,
      'mode must be one of a, b (got "x")')
    assert.equals(3, core.check_value("f", "n", 3, { "integer", min = 0, max = 3 }, 1))
    assert.equals(false, core.check_value("f", "flag", false, "boolean", 1))
  end)

  it("refuse unknown keys and non-tables, and check every value given", function()
    local specs = { n = "integer", on = "boolean", t = function(v) if v ~= "ok" then return '"ok"' end end }
    assert.are.same({}, core.check_options("f", nil, specs, 1))
    H.expect_error(function() core.check_options("f", { m = 1 }, specs, 1) end, "f: unknown option 'm' (known: n, on, t)")
    H.expect_error(function() core.check_options("f", "n", specs, 1) end, 'f: options must be a table (got "n")')
    H.expect_error(function() core.check_options("f", ms.zeros({ 1 }), specs, 1) end, "f: options must be a table")
    H.expect_error(function() core.check_options("f", { n = 1.5 }, specs, 1) end, "f: n must be an integer (got 1.5)")
    H.expect_error(function() core.check_options("f", { t = "no" }, specs, 1) end, 'f: t must be "ok" (got "no")')
    local o = { n = 2, on = true, t = "ok" }
    assert.equals(o, core.check_options("f", o, specs, 1))
  end)
end)

describe("the DASH primitives' integer options", function()
  it("refuse fractional and out-of-range counts, changing nothing", function()
    local a = ms.tensor({ { { 4, 0 }, { 0, 9 } } }, { dtype = "f32" })
    local out = ms.zeros({ 1, 2, 2 })
    -- each of these would have run truncated (root 2.5 as 2, steps 10.7 as 10, ...)
    for _, o in ipairs {
      { root = 2.5, key = "root" }, { steps = 10.7, key = "steps" }, { pi_steps = 1.5, key = "pi_steps" },
      { pi_vectors = 4.2, key = "pi_vectors" }, { seed = 0.5, key = "seed" }, { seed = -1, key = "seed" },
      { steps = 2 ^ 32 + 10, key = "steps" },
    } do
      local key = o.key
      o.key, o.out, o.method = nil, out, "ndb"
      H.expect_error(function() ms.inv_root(a, o) end, "inv_root: " .. key .. " must be")
    end
    assert.are.same({ 0, 0, 0, 0 }, vals(out))
    local lam = ms.zeros({ 1 })
    for key, v in pairs { vectors = 2.5, steps = 3.5, root = 4.5 } do
      H.expect_error(function() ms.spectrum_estimate(a, { [key] = v, lam_max = lam }) end,
        "spectrum_estimate: " .. key .. " must be an integer")
    end
    assert.are.same({ 0 }, vals(lam))
    local w = ms.zeros({ 2, 3 })
    local list = ms.block_list({ { tensor = w } })
    local stack = ms.ones({ 1, 2, 3 })
    H.expect_error(function() ms.blocks_apply { blocks = list, stack = stack, seed = 1.5 } end, "blocks_apply: seed must be an integer")
    H.expect_error(function() ms.blocks_apply { blocks = list, stack = stack, step = 2.5 } end, "blocks_apply: step must be an integer >= 1")
    H.expect_error(function() ms.blocks_apply { blocks = list, stack = stack, step = 0 } end, "blocks_apply: step must be an integer >= 1")
    assert.are.same({ 0, 0, 0, 0, 0, 0 }, vals(w))
    H.expect_error(function() ms.dash_graft { grad = stack, step = 1.5 } end, "dash_graft: step must be an integer >= 1")
    -- whole values still run
    ms.blocks_apply { blocks = list, stack = stack, lr = 1, step = 2, seed = 3 }
    assert.are.same({ -1, -1, -1, -1, -1, -1 }, vals(w))
    local x = ms.inv_root(a, { method = "evd", root = 2, evd_shift = false, steps = 3, seed = 7 })
    assert(math.abs(vals(x)[1] - 0.5) < 1e-6)
  end)
end)

describe("ms.context and ms.load", function()
  it("refuse unknown keys and mistyped, fractional or out-of-range values, naming them", function()
    H.expect_error(function() ms.context { devise = "cpu" } end, "context: unknown option 'devise'")
    H.expect_error(function() ms.context { num_threads = 2.5 } end, "context: num_threads must be an integer (got 2.5)")
    H.expect_error(function() ms.context { num_threads = 2 ^ 32 + 1 } end, "context: num_threads must be <=")
    H.expect_error(function() ms.context { num_threads = -1 } end, "context: num_threads must be >= 0")
    H.expect_error(function() ms.context { mem_limit = "big" } end, 'context: mem_limit must be an integer (got "big")')
    H.expect_error(function() ms.context { mem_limit = 1.5 } end, "context: mem_limit must be an integer (got 1.5)")
    H.expect_error(function() ms.context { device = 0 } end, "context: device must be a string (got 0)")
    H.expect_error(function() ms.context { stream = "s" } end, "context: stream must be a pointer")
    H.expect_error(function() ms.context(3) end, "context: options must be a table (got 3)")
    -- (C reads a string up to its first NUL: "cpu\0junk" made a CPU context)
    H.expect_error(function() ms.context { device = "cpu\0junk" } end,
                   'context: device must not contain a NUL byte (got "cpu\\0junk")')
    H.expect_error(function() ms.device("cpu\0junk") end, "context: device must not contain a NUL byte")
    local c = ms.context { device = "cpu", num_threads = 1, mem_limit = 2 ^ 20 }
    assert.equals(2 ^ 20, c:mem_stats().limit)
    assert.equals("cpu", ms.context("cpu"):name())
  end)

  it("ms.load refuses unknown option keys and a non-table", function()
    local path = os.tmpname()
    ms.save(path, { w = ms.ones({ 2 }) })
    H.expect_error(function() ms.load(path, { devise = "cpu" }) end, "load: unknown option 'devise' (known: device)")
    H.expect_error(function() ms.load(path, "cpu") end, 'load: options must be a table (got "cpu")')
    H.expect_error(function() ms.load(path, { device = 1 }) end, "load: device must be a device name or a context")
    assert.are.same({ 1, 1 }, vals(ms.load(path, { device = "cpu" }).w))
    assert.are.same({ 1, 1 }, vals(ms.load(path, { device = ms.device("cpu") }).w))
    assert.are.same({ 1, 1 }, vals(ms.load(path).w))
    os.remove(path)
  end)
end)

describe("tensor views", function()
  it("refuse fractional dims and indices, naming the argument", function()
    local t = ms.randn({ 4, 5 })
    H.expect_error(function() t:slice(0.5, 1, 3) end, "slice: dim must be an integer (got 0.5)")
    H.expect_error(function() t:slice(0, 1.5, 3) end, "slice: start must be an integer (got 1.5)")
    H.expect_error(function() t:slice(0, 1, 2.5) end, "slice: stop must be an integer (got 2.5)")
    H.expect_error(function() t:slice(0, 1, 3, 1.5) end, "slice: step must be an integer (got 1.5)")
    H.expect_error(function() t:slice(0, 1, math.huge) end, "slice: stop must be an integer (got inf)")
    H.expect_error(function() t:slice(0, "1", 3) end, 'slice: start must be an integer (got "1")')
    H.expect_error(function() t:slice() end, "slice: dim is needed")
    H.expect_error(function() t:narrow(0, 1.5, 2) end, "narrow: start must be an integer (got 1.5)")
    H.expect_error(function() t:narrow(0, 1, 2.5) end, "narrow: length must be an integer (got 2.5)")
    H.expect_error(function() t:narrow(0.5, 1, 2) end, "narrow: dim must be an integer (got 0.5)")
    H.expect_error(function() t:transpose(0.9, 1) end, "transpose: dim0 must be an integer (got 0.9)")
    H.expect_error(function() t:transpose(0, 1.2) end, "transpose: dim1 must be an integer (got 1.2)")
    H.expect_error(function() t:permute(1.2, 0) end, "permute: dims[1] must be an integer (got 1.2)")
    H.expect_error(function() t:permute({ 1, 0.5 }) end, "permute: dims[2] must be an integer (got 0.5)")
    H.expect_error(function() t:size(0.5) end, "size: dim must be an integer (got 0.5)")
    -- whole values still work
    assert.are.same({ 2, 5 }, t:slice(0, 1, 3):shape())
    assert.are.same({ 4, 2 }, t:narrow(1, -2, 2):shape())
    assert.are.same({ 5, 4 }, t:transpose(0, 1):shape())
    assert.are.same({ 5, 4 }, t:permute(1, 0):shape())
    assert.equals(5, t:size(-1))
  end)
end)

describe("the fused steps' arguments", function()
  local function members(n)
    local p, g, m, v = {}, {}, {}, {}
    for i = 1, n do
      p[i], g[i] = ms.ones({ 4, 4 }), ms.randn({ 4, 4 }, { seed = i })
      m[i], v[i] = ms.zeros({ 4, 4 }), ms.zeros({ 4, 4 })
    end
    return p, g, m, v
  end

  it("refuse fractional counts and seeds, and flags that are not booleans, changing nothing", function()
    local p, g, m, v = members(2)
    local before = vals(p[1])
    local function adamw(extra)
      return function()
        local a = { params = p, grads = g, exp_avg = m, exp_avg_sq = v, lr = 0.1 }
        for k, x in pairs(extra) do a[k] = x end
        ms.adamw_step(a)
      end
    end
    -- "false" and 0 are true to Lua: they would have turned the flag on
    H.expect_error(adamw { bias_correction = "false" }, 'adamw_step: bias_correction must be true or false (got "false")')
    H.expect_error(adamw { stochastic_round = 0 }, "adamw_step: stochastic_round must be true or false (got 0)")
    H.expect_error(adamw { seed = 1.5 }, "adamw_step: seed must be an integer in [0, 2^64) (got 1.5)")
    H.expect_error(adamw { seed = -1 }, "adamw_step: seed must be an integer in [0, 2^64) (got -1)")
    H.expect_error(adamw { step = 2.5 }, "adamw_step: step must be an integer >= 1")
    H.expect_error(adamw { steps = { 1, 1.5 } }, "steps[2] must be an integer >= 1")
    H.expect_error(adamw { beta1 = "0.9" }, 'adamw_step: beta1 must be a number (got "0.9")')
    H.expect_error(adamw { scales = { 1, "x" } }, 'scales[2] must be a number (got "x")')
    H.expect_error(function() ms.sgd_step { params = p, grads = g, nesterov = "no" } end, "sgd_step: nesterov must be true or false")
    H.expect_error(function() ms.sgd_step { params = p, grads = g, momentum = true } end, "sgd_step: momentum must be a number")
    H.expect_error(function() ms.sinkgd_step { params = p, grads = g, iters = 2.5 } end, "sinkgd_step: iters must be an integer (got 2.5)")
    H.expect_error(function() ms.sinkgd_step { params = p, grads = g, sn_iters = 1.5, mode = "spectral" } end,
      "sinkgd_step: sn_iters must be an integer")
    H.expect_error(function() ms.sinkgd_step { params = p, grads = g, iters = 2 ^ 32 + 5 } end, "sinkgd_step: iters must be <=")
    H.expect_error(function() ms.sinkgd_step { params = p, grads = g, mode = 1 } end, "sinkgd_step: mode must be a string")
    H.expect_error(function()
      ms.adamw8_step { params = p, grads = g, exp_avg = m, exp_avg_sq = v, exp_avg_scale = m, exp_avg_sq_scale = v,
                       block_size = 256.5 }
    end, "adamw8_step: block_size must be an integer (got 256.5)")
    H.expect_error(function() ms.adamw8_qmap("yes") end, 'adamw8_qmap: signed must be true or false (got "yes")')
    H.expect_error(function() ms.foreach_scale(p) end, "foreach_scale: s is needed")
    assert.same(before, vals(p[1]))
    assert.same(before, vals(p[2]))
    -- whole values and real flags still step
    adamw { bias_correction = false, stochastic_round = false, seed = 3, step = 2 } ()
    ms.sinkgd_step { params = p, grads = g, iters = 2, lr = 0.1 }
    assert.are_not.same(before, vals(p[1]))
  end)
end)

describe("the tensor constructors and ops with option tables", function()
  it("refuse unknown keys, flags that are not booleans and fractional seeds, naming them", function()
    H.expect_error(function() ms.zeros({ 2 }, { dtpye = "f64" }) end, "zeros: unknown option 'dtpye'")
    H.expect_error(function() ms.empty({ 2 }, { devise = "cpu" }) end, "empty: unknown option 'devise'")
    H.expect_error(function() ms.ones({ 2 }, { dtype = 64 }) end, "ones: dtype must be a string (got 64)")
    H.expect_error(function() ms.full({ 2 }, "1") end, 'full: value must be a number (got "1")')
    H.expect_error(function() ms.tensor({ 1, 2 }, { ctx = "cpu" }) end, "tensor: ctx must be a moonstep context")
    H.expect_error(function() ms.randn({ 2 }, { sed = 3 }) end, "randn: unknown option 'sed'")
    H.expect_error(function() ms.randn({ 2 }, { seed = 1.5 }) end, "randn: seed must be an integer in [0, 2^64) (got 1.5)")
    H.expect_error(function() ms.rand({ 2 }, { offset = -1 }) end, "rand: offset must be an integer in [0, 2^64) (got -1)")
    H.expect_error(function() ms.rand({ 2 }, { mean = 0 }) end, "rand: unknown option 'mean'")
    H.expect_error(function() ms.randn({ 2 }, { std = "1" }) end, 'randn: std must be a number (got "1")')
    local a, b = ms.randn({ 2, 3 }, { seed = 1 }), ms.randn({ 2, 3 }, { seed = 2 })
    -- trans_b = 0 or "false" would have transposed b
    H.expect_error(function() ms.matmul(a, b, { trans_b = 0 }) end, "matmul: trans_b must be true or false (got 0)")
    H.expect_error(function() ms.matmul(a, b, { tf32 = "no" }) end, "matmul: tf32 must be true or false")
    H.expect_error(function() ms.matmul(a, b, { alpha = "2" }) end, "matmul: alpha must be a number")
    H.expect_error(function() ms.matmul(a, b, { out = {} }) end, "matmul: out must be a tensor")
    H.expect_error(function() ms.eigh(ms.eye(2), { vectors = "false" }) end, 'eigh: vectors must be true or false (got "false")')
    H.expect_error(function() ms.eigh(ms.eye(2), { vector = false }) end, "eigh: unknown option 'vector'")
    -- the documented forms still work
    assert.equals("f64", ms.zeros({ 2 }, { dtype = "f64", device = "cpu" }):dtype())
    assert.same(vals(ms.randn({ 3 }, { seed = 4, offset = 1 })), vals(ms.randn({ 3 }, { seed = 4, offset = 1 })))
    -- offsets past 2^53 come as uint64_t cdata (moonstep.h's 2^63 + k)
    assert.same(vals(ms.randn({ 3 }, { seed = 4, offset = 2ULL ^ 63 })), vals(ms.randn({ 3 }, { seed = 4, offset = 2ULL ^ 63 })))
    H.expect_error(function() ms.randn({ 2 }, { offset = -1LL }) end, "randn: offset must be an integer in [0, 2^64)")
    assert.same({ 2, 2 }, ms.matmul(a, b, { trans_b = true, tf32 = false }):shape())
    local w, v = ms.eigh(ms.eye(2), { vectors = false })
    assert.is_nil(v)
    assert.same({ 1, 1 }, vals(w))
  end)
end)

describe("recipe loading, communicators and shards", function()
  it("ms.recipe.load refuses a trusted flag that is not a boolean, and unknown keys", function()
    local path = os.tmpname()
    local f = io.open(path, "w")
    f:write([[return { name = "r", version = 1, options = { lr = { default = 1, type = "number" } },
                       route = function() return "a" end, routes = { a = { step = function() end } } }]])
    f:close()
    -- "false" is true to Lua: the recipe would have run unsandboxed
    H.expect_error(function() ms.recipe.load(path, { trusted = "false" }) end,
      'recipe.load: trusted must be true or false (got "false")')
    H.expect_error(function() ms.recipe.load(path, { trusted = 0 }) end, "recipe.load: trusted must be true or false (got 0)")
    H.expect_error(function() ms.recipe.load(path, { trustd = true }) end, "recipe.load: unknown option 'trustd'")
    assert.is_false(ms.recipe.meta[ms.recipe.load(path, { trusted = false })].trusted)
    assert.is_true(ms.recipe.meta[ms.recipe.load(path, { trusted = true })].trusted)
    assert.is_false(ms.recipe.meta[ms.recipe.load(path)].trusted)
    -- the file is opened by C, which would read the path up to its NUL: another file than the one named
    H.expect_error(function() ms.recipe.load(path .. "\0.other") end,
                   ("recipe: path must not contain a NUL byte (got %q)"):format(path .. "\0.other"))
    H.expect_error(function() ms.optim.new(path .. "\0.other", {}) end, "recipe: path must not contain a NUL byte")
    os.remove(path)
    -- and a built-in name with a NUL got past the "no .lua" rule
    H.expect_error(function() ms.recipe.get("adamw.lua\0") end, 'recipe: name must not contain a NUL byte (got "adamw.lua\\0")')
    H.expect_error(function() ms.recipe.find("adamw\0x") end, "recipe: name must not contain a NUL byte")
  end)

  it("ms.comm calls refuse unknown keys and ranks that are not C ints, naming them", function()
    H.expect_error(function() ms.comm.rendezvous { rank = 0, world_sise = 2 } end, "rendezvous: unknown option 'world_sise'")
    H.expect_error(function() ms.comm.new { rank = 0, world_size = 1, timout = 5 } end, "comm.new: unknown option 'timout'")
    H.expect_error(function() ms.comm.from_env { ctx = ms.device("cpu"), timeot = 5 } end, "comm.from_env: unknown option 'timeot'")
    H.expect_error(function() ms.comm.rendezvous { rank = math.huge, world_size = 2 } end, "rank must be an integer (got inf)")
    H.expect_error(function() ms.comm.rendezvous { rank = 0, world_size = 2 ^ 32 + 2 } end, "world_size must be an integer")
  end)

  it("ms.comm calls refuse an address with a NUL byte (C would read the part before it)", function()
    local port = ms.comm.free_port()
    H.expect_error(function()
      ms.comm.rendezvous { rank = 1, world_size = 2, addr = "127.0.0.1\0.example", port = port, timeout = 0.2 }
    end, 'rendezvous: addr must not contain a NUL byte (got "127.0.0.1\\0.example")')
    H.expect_error(function()
      ms.comm.new { rank = 1, world_size = 2, addr = "127.0.0.1\0.example", port = port, timeout = 0.2 }
    end, "comm.new: addr must not contain a NUL byte")
  end)

  it("shard.set refuses unknown keys of the shard", function()
    local shard = require("moonstep.shard")
    local w = ms.zeros({ 4, 4 })
    H.expect_error(function() shard.set(w, { dim = "none", ofset = 2 }) end, "shard.set: unknown key 'ofset'")
    assert.is_nil(shard.get(w))
    shard.set(w, { dim = "rows", offset = 0, size = 4 })
    assert.equals(4, shard.get(w).global)
    shard.clear(w)
  end)
end)

describe("the optimizer's load", function()
  it("refuses a force flag that is not a boolean, loading nothing", function()
    local function make(recipe)
      local p = { name = "w", param = ms.ones({ 2, 2 }), grad = ms.ones({ 2, 2 }) }
      return ms.optim.new(recipe, { p }, { lr = 0.1 }), p
    end
    local src = make("sgd")
    src:step()
    local path = os.tmpname()
    src:save(path)
    local opt, p = make("adamw")
    -- "false" is true to Lua: the sgd checkpoint would have loaded into the adamw optimizer
    H.expect_error(function() opt:load(path, { force = "false" }) end, 'load: force must be true or false (got "false")')
    H.expect_error(function() opt:load(path, { force = 1 }) end, "load: force must be true or false (got 1)")
    H.expect_error(function() opt:load(path, { force = false }) end, "checkpoint of recipe 'sgd'")
    assert.equals(0, opt.step_count)
    assert.same({ 1, 1, 1, 1 }, vals(p.param))
    os.remove(path)
  end)
end)

describe("flags and options of reductions, eye and the *_like constructors", function()
  it("are refused when mistyped, naming them", function()
    local t = ms.ones({ 2, 3 })
    -- keepdim = "false" is true to Lua: the result kept the dim
    H.expect_error(function() t:sum(0, "false") end, 'sum: keepdim must be true or false (got "false")')
    H.expect_error(function() t:max(1, 0) end, "max: keepdim must be true or false (got 0)")
    H.expect_error(function() ms.eye(2, { dtpye = "f64" }) end, "eye: unknown option 'dtpye'")
    H.expect_error(function() ms.zeros_like(t, { dtpye = "f64" }) end, "zeros_like: unknown option 'dtpye'")
    H.expect_error(function() ms.empty_like(t, { dtype = 1 }) end, "empty_like: dtype must be a string (got 1)")
    assert.same({ 3 }, t:sum(0, false):shape())
    assert.same({ 1, 3 }, t:sum(0, true):shape())
    assert.equals("f64", ms.eye(2, { dtype = "f64" }):dtype())
    assert.equals("f64", ms.zeros_like(t, { dtype = "f64" }):dtype())
    assert.same({ 2, 3 }, ms.empty_like(t):shape())
  end)
end)

describe("the built-in recipes' options", function()
  it("refuse fractional dim sizes and seeds past 2^32, naming the option", function()
    for _, name in ipairs { "sinkgd", "dash" } do
      local r = ms.recipe.get(name)
      -- a fractional size never equals a dim: the parameter it meant went to the other route, silently
      H.expect_error(function() ms.recipe.options(r, { adamw_dims = { 4096.5 } }) end,
        name .. ": option 'adamw_dims'[1] = 4096.5: an integer is needed")
      H.expect_error(function() ms.recipe.options(r, { adamw_dims = "64, 1.5" }) end, "option 'adamw_dims'[2] = 1.5")
      assert.same({ 64, 4096 }, ms.recipe.options(r, { adamw_dims = "64,4096" }).adamw_dims)
    end
    for _, name in ipairs { "adamw", "sgd", "sinkgd", "dash" } do
      local r = ms.recipe.get(name)
      -- the seed is the low word of the calls' keys (ctx.rng_key), whose high word names the stream
      H.expect_error(function() ms.recipe.options(r, { seed = 2 ^ 70 }) end, name .. ": option 'seed'", "above its maximum")
      assert.equals(12345, ms.recipe.options(r, { seed = 12345 }).seed)
    end
  end)
end)

describe("experiment.run and compare", function()
  it("refuse trusted, force and skip_missing flags that are not booleans", function()
    local E = require("moonstep.experiment")
    local base = { problem = "lsq", problem_options = { dim = 4, outputs = 1, samples = 8 }, recipe = "sgd", steps = 1,
                   device = "cpu" }
    local function with(k, v)
      local c = { [k] = v }
      for key, x in pairs(base) do c[key] = x end
      return c
    end
    -- "false" is true to Lua: trusted would run a recipe file unsandboxed
    H.expect_error(function() E.run(with("trusted", "false")) end, 'run: trusted must be true or false (got "false")')
    H.expect_error(function() E.run(with("force", 1)) end, "run: force must be true or false (got 1)")
    local c = with("skip_missing", "yes")
    c.recipe, c.recipes = nil, { "sgd" }
    H.expect_error(function() E.compare(c) end, 'compare: skip_missing must be true or false (got "yes")')
    assert.equals(1, E.run(with("trusted", false)).steps_done)
  end)
end)

describe("values the FFI would convert silently", function()
  it("are refused by name: inf offsets and block sizes, fill values and clamp bounds of another kind", function()
    local w = ms.zeros({ 2, 3 })
    H.expect_error(function() ms.block_list({ { tensor = w, row0 = math.huge } }) end, "blocks[1].row0 must be a non-negative integer (got inf)")
    H.expect_error(function() ms.block_plan({ { name = "a", shape = { 4, 4 } } }, { block_size = math.huge }) end,
      "block_plan: block_size must be an integer >= 1 (got inf)")
    -- the FFI takes true as 1
    H.expect_error(function() w:fill_(true) end, "fill_: value must be a number (got true)")
    H.expect_error(function() w:fill_("1") end, 'fill_: value must be a number (got "1")')
    H.expect_error(function() w:clamp("0") end, 'clamp: min must be a number (got "0")')
    H.expect_error(function() w:clamp_(0, {}) end, "clamp: max must be a number (got a table)")
    assert.same({ 0, 0, 0, 0, 0, 0 }, vals(w))
    assert.same({ 2, 2, 2, 2, 2, 2 }, vals(w:fill_(3):clamp(nil, 2)))
    assert.equals(1, #ms.block_plan({ { name = "a", shape = { 4, 4 } } }, { block_size = 8 }).stacks)
  end)
end)

describe("the optimizer's settings", function()
  it("name a ctx, device or sandbox of the wrong kind", function()
    local p = { name = "w", param = ms.ones({ 2, 2 }), grad = ms.ones({ 2, 2 }) }
    H.expect_error(function() ms.optim.new("sgd", { p }, { lr = 0.1 }, { ctx = "cpu" }) end,
      'setting ctx must be a moonstep context (ms.device, ms.context; got "cpu")')
    H.expect_error(function() ms.optim.new("sgd", { p }, { lr = 0.1 }, { device = 5 }) end, "setting device must be a device name")
    -- (with a trusted recipe the sandbox limits were never read, so a bad one passed unseen)
    H.expect_error(function() ms.optim.new("sgd", { p }, { lr = 0.1 }, { sandbox = 5 }) end, "setting sandbox: the sandbox limits must be a table")
    assert.equals(0, ms.optim.new("sgd", { p }, { lr = 0.1 }, { ctx = ms.device("cpu"), device = "cpu", sandbox = {} }).step_count)
  end)
end)

describe("device_count and graph capture", function()
  it("refuse a device kind other than cpu or cuda, and a capture of no function", function()
    H.expect_error(function() ms.device_count("gpu") end, 'device_count: kind must be one of cpu, cuda (got "gpu")')
    H.expect_error(function() ms.device_count() end, "device_count: kind must be a string (got nil)")
    assert.equals(1, ms.device_count("cpu"))
    H.expect_error(function() ms.graph.capture("cpu", nil) end, "graph.capture: fn must be a function (got nil)")
    H.expect_error(function() ms.graph.join("cpu", "f") end, "graph.join: fn must be a function (got string)")
  end)
end)

describe("sizes, dims, indices and seeds of inf", function()
  it("are refused as not integers, never reaching the FFI as int64_t's smallest value", function()
    local t = ms.zeros({ 4 })
    H.expect_error(function() ms.zeros({ math.huge }) end, "shape[1] must be an integer (got inf)")
    H.expect_error(function() ms.zeros({ 2 ^ 64 }) end, "shape[1] must be an integer")
    H.expect_error(function() t:select(0, math.huge) end, "select: index inf is not an integer")
    H.expect_error(function() t:sum(-math.huge) end, "sum: dim -inf is not an integer")
    H.expect_error(function() ms.manual_seed(math.huge) end, "manual_seed: a non-negative integer below 2^64 is needed")
    local state = ms.rng_state()
    ms.manual_seed(2 ^ 63)
    assert.equals(2 ^ 63, ms.rng_state().seed)
    ms.set_rng_state(state)
  end)
end)

describe("plot.write and report.write", function()
  it("refuse unknown keys of the plot and of the options", function()
    local plot, report = require("moonstep.plot"), require("moonstep.report")
    local spec = { title = "t", series = { { name = "a", train = { { 1, 2 }, { 1, 0.5 } } } } }
    H.expect_error(function() plot.write("/nonexistent/x", { title = "t", logY = true, series = {} }) end,
      "plot.write: unknown spec key 'logY'")
    H.expect_error(function() plot.write("/nonexistent/x", spec, { plotr = "builtin" }) end, "plot.write: unknown option 'plotr'")
    H.expect_error(function() report.write("/nonexistent/x", {}, { plotr = "builtin" }) end, "report.write: unknown option 'plotr'")
    local dir = H.tmpdir()
    local files = plot.write(dir .. "/loss", spec, { plotter = "builtin" })
    assert.equals(dir .. "/loss.svg", files[1])
    os.execute("rm -rf " .. H.q(dir))
  end)
end)

describe("counts of inf where a loop runs that many times", function()
  it("are refused, not run forever", function()
    local E = require("moonstep.experiment")
    -- each of these passed v == floor(v) and would have looped without end
    H.expect_error(function() ms.block_plan({ { name = "w", shape = { math.huge, 4 } } }) end, "shape[1] = inf is not a size")
    local base = { problem = "lsq", problem_options = { dim = 4, outputs = 1, samples = 8 }, recipe = "sgd", device = "cpu" }
    local function with(k, v)
      local c = { [k] = v }
      for key, x in pairs(base) do c[key] = x end
      return c
    end
    H.expect_error(function() E.run(with("steps", math.huge)) end, "run: steps must be an integer >= 1 (got inf)")
    H.expect_error(function() E.run(with("seed", math.huge)) end, "run: seed must be an integer >= 0 (got inf)")
    local c = with("seeds", math.huge)
    c.recipe, c.recipes = nil, { "sgd" }
    H.expect_error(function() E.compare(c) end, "compare: seeds must be an integer >= 1 (got inf)")
    H.expect_error(function() require("moonstep.problems").new("lsq", {}, { seed = math.huge }) end, "seed must be a non-negative integer (got inf)")
  end)
end)

describe("experiment.recipe and cli.launch", function()
  it("refuse a trusted flag that is not a boolean, and a launch of a fractional count of ranks", function()
    local E, cli = require("moonstep.experiment"), require("moonstep.cli")
    H.expect_error(function() E.recipe("x/optim.lua", "false") end, 'recipe: trusted must be true or false (got "false")')
    assert.equals("sgd", E.recipe("sgd", false).name)
    -- nothing is started: each is refused before the first rank
    H.expect_error(function() cli.launch(2.5, "x.lua", {}) end, "launch: n must be an integer (got 2.5)")
    H.expect_error(function() cli.launch(0, "x.lua", {}) end, "launch: n must be >= 1")
    H.expect_error(function() cli.launch(1, "x.lua", {}, { prot = 5000 }) end, "launch: unknown option 'prot'")
    H.expect_error(function() cli.launch(1, "x.lua", {}, { port = 70000 }) end, "launch: port must be <= 65535")
    H.expect_error(function() cli.launch(1, nil, {}) end, "launch: script must be a path (got nil)")
  end)
end)

describe("the foreach helpers", function()
  it("name tensors and out of the wrong kind", function()
    local t = ms.ones({ 2 })
    H.expect_error(function() ms.foreach_sumsq({ t }, {}) end, "foreach_sumsq: out must be a tensor (got a table)")
    H.expect_error(function() ms.foreach_sumsq(5) end, "foreach_sumsq: tensors must be an array of tensors (got 5)")
    H.expect_error(function() ms.foreach_sumsq({ t, "x" }) end, 'foreach_sumsq: tensors[2] must be a tensor (got "x")')
    H.expect_error(function() ms.foreach_scale(5, 2) end, "foreach_scale: tensors must be an array of tensors (got 5)")
    H.expect_error(function() ms.foreach_scale(t, 2) end, "foreach_scale: tensors must be an array of tensors (got a tensor")
    assert.same({ 1, 1 }, vals(t))
    ms.foreach_scale({ t }, 3)
    assert.same({ 18 }, vals(ms.foreach_sumsq({ t })))
  end)
end)

describe("lerp, addcmul and addcdiv", function()
  it("name a weight or value that is neither a number nor a tensor", function()
    local a, b = ms.zeros({ 2 }), ms.ones({ 2 })
    H.expect_error(function() ms.lerp(a, b, "0.5") end, 'lerp: weight must be a number or a one-element device tensor (got "0.5")')
    H.expect_error(function() ms.addcmul(a, b, b, true) end, "addcmul: value must be a number or a one-element device tensor (got true)")
    H.expect_error(function() a:addcdiv_(b, b, {}) end, "addcdiv: value must be a number or a one-element device tensor (got a table)")
    assert.same({ 0, 0 }, vals(a))
    assert.same({ 0.5, 0.5 }, vals(ms.lerp(a, b, ms.full({ 1 }, 0.5))))
  end)
end)

describe("the optimizer's parameter entries", function()
  it("refuse a key they do not know, naming it and the parameter, before anything is made", function()
    local w = ms.randn({ 3, 4 }, { seed = H.seed() })
    -- `tag` for `tags`: the parameter would route as untagged (no_decay lost), silently
    H.expect_error(function()
      ms.optim.new("sinkgd", { { name = "w", param = w, grad = ms.zeros({ 3, 4 }), tag = { "no_decay" } } })
    end, "parameter 'w': unknown key 'tag' (known: grad, name, options, param, shard, tags)")
    local opt = ms.optim.new("sinkgd", { { name = "w", param = w, grad = ms.zeros({ 3, 4 }), tags = { "no_decay" },
                                           options = { lr = 1e-3 } } })
    assert.equals(1, #opt:info().params)
  end)
end)

describe("the module-level forms of the tensor ops", function()
  it("name an argument that is not a tensor (they failed inside, as 'attempt to index a number')", function()
    local t = ms.ones({ 2, 2 })
    for _, case in ipairs {
      { function() return ms.abs(4) end, "abs: t must be a tensor (got 4)" },
      { function() return ms.sqrt("x") end, 'sqrt: t must be a tensor (got "x")' },
      { function() return ms.sum(3) end, "sum: t must be a tensor (got 3)" },
      { function() return ms.zeros_like(5) end, "zeros_like: t must be a tensor (got 5)" },
      { function() return ms.empty_like("t") end, 'empty_like: t must be a tensor (got "t")' },
      { function() return ms.lerp(t, 1, 0.5) end, "lerp: b must be a tensor (got 1)" },
      { function() return ms.lerp(t, t, 0.5, {}) end, "lerp: out must be a tensor (got a table)" },
      { function() return ms.addcmul(2, t, t) end, "addcmul: a must be a tensor (got 2)" },
      { function() return ms.addcdiv(t, t, true) end, "addcdiv: c must be a tensor (got true)" },
      { function() return ms.matmul(t, 7) end, "matmul: b must be a tensor (got 7)" },
      { function() return ms.diag({ 1, 2 }) end, "diag: src must be a tensor (got a table)" },
      { function() return ms.eigh(9) end, "eigh: a must be a tensor (got 9)" },
      { function() return ms.blocks_gather(5, {}) end, "blocks_gather: stack must be a tensor (got 5)" },
      { function() return ms.broadcast_shapes(2, { 2 }) end, "broadcast_shapes: shapes must be tables of sizes" },
    } do
      H.expect_error(case[1], case[2])
    end
  end)

  it("problems and recipes name a wrong problem, recipe or options argument", function()
    local problems, R = require("moonstep.problems"), ms.recipe
    H.expect_error(function() problems.options(5) end, "problems.options: problem must be a problem name or module (got 5)")
    H.expect_error(function() problems.options("lsq", 3) end, "lsq: the problem options must be a table (got 3)")
    H.expect_error(function() problems.doc({}) end, "problems.doc: problem must be a problem name or module (got a table)")
    H.expect_error(function() problems.new("lsq", {}, "cpu") end, 'problems.new: env must be a table (got "cpu")')
    assert.matches("%-%-dim", problems.doc("lsq"))
    H.expect_error(function() R.options(5) end, "recipe.options: recipe must be a recipe table, a built-in name or a file path (got 5)")
    H.expect_error(function() R.doc(true) end, "recipe.doc: recipe must be a recipe table")
    assert.equals(1e-3, R.options("adamw", { lr = 1e-3 }).lr)
    H.expect_error(function() ms.routing.adamw_by_name(5) end, "routing.adamw_by_name: name must be a string (got number)")
  end)

  it("recipe.call refuses a guard it did not make before changing anything", function()
    -- it swapped the debug hook, the string metatable and the allocation guard first, then failed,
    -- leaving them set: every later allocation failed with "attempt to index upvalue 'alloc_guard'"
    H.expect_error(function() ms.recipe.call(5, function() end) end, "recipe.call: guard must be one M.guard made (got 5)")
    H.expect_error(function() ms.recipe.call({}, function() end) end, "recipe.call: guard must be one M.guard made (got a table)")
    assert.is_nil(debug.gethook())
    assert.equals(3, ms.zeros({ 3 }):numel())
    assert.equals("ab", ("a"):rep(1) .. "b")
  end)
end)
