-- ms.set_rng_origin (moonstep.h, ms_tensor_set_rng_origin): a param's stochastic rounding numbered as a part of a
-- larger whole.  A slice of a matrix (rows or columns, of a stack too) stepped alone, and a member stepped in
-- another call than its whole group's, round exactly as the whole call does -- on the CPU and on CUDA, where the
-- kernels carry the numbers in their tables.  The runtime's use of it (every member numbered in its route, a
-- slice in its whole parameter) is checked across ranks in tests/dist_spec.lua.
local ms = H.ms

local CPU = ms.device("cpu")
local GPU = H.has_cuda and ms.device("cuda") or nil

local SHAPE = { 2, 12, 64 }   -- a stack of two 12 x 64 matrices: 1536 elements, 6 blocks of 256 (AdamW8)

local function vals(t) return t:to("f32"):tolist_flat() end
-- a copy of t on device (never t itself)
local function on(t, device) return t:to(device):clone() end

-- one step of `kind` on params (bf16, stochastic rounding) with grads, from fresh zero state, on the params' device
local function step(kind, params, grads, seed)
  local z, z8, zs = {}, {}, {}
  for i, p in ipairs(params) do
    local ctx = p:context()
    z[i] = { ms.zeros(p:shape(), { ctx = ctx }), ms.zeros(p:shape(), { ctx = ctx }) }
    z8[i] = { ms.zeros(p:shape(), { dtype = "u8", ctx = ctx }), ms.zeros(p:shape(), { dtype = "u8", ctx = ctx }) }
    local blocks = math.ceil(p:numel() / 256)
    zs[i] = { ms.zeros({ blocks }, { ctx = ctx }), ms.zeros({ blocks }, { ctx = ctx }) }
  end
  local function col(t, k)
    local out = {}
    for i, x in ipairs(t) do out[i] = x[k] end
    return out
  end
  local common = { params = params, grads = grads, lr = 0.03, step = 3, stochastic_round = true, seed = seed }
  if kind == "adamw" then
    common.exp_avg, common.exp_avg_sq, common.weight_decay = col(z, 1), col(z, 2), 0.1
    ms.adamw_step(common)
  elseif kind == "sgd" then
    common.momentum_buf, common.momentum, common.weight_decay = col(z, 1), 0.9, 0.1
    ms.sgd_step(common)
  elseif kind == "adamw8" then
    common.exp_avg, common.exp_avg_sq, common.exp_avg_scale, common.exp_avg_sq_scale = col(z8, 1), col(z8, 2), col(zs, 1), col(zs, 2)
    ms.adamw8_step(common)
  else
    common.iters = 2
    ms.sinkgd_step(common)
  end
end

-- the parts of SHAPE's dim `axis` (1: rows, 2: columns) the slices cover
local CUTS = { [1] = { { 0, 5 }, { 5, 12 } }, [2] = { { 0, 16 }, { 16, 40 }, { 40, 64 } } }
-- (AdamW8's members hold whole blocks of 256)
local CUTS8 = { [1] = { { 0, 4 }, { 4, 12 } }, [2] = { { 0, 32 }, { 32, 64 } } }

local function check_slices(kind, device)
  local seed = H.seed()
  local a = ms.randn({ 256 }, { seed = seed, offset = 1 }):to("bf16")
  local w = ms.randn(SHAPE, { seed = seed, offset = 2 }):to("bf16")
  local ga, gw = ms.randn({ 256 }, { seed = seed, offset = 3 }), ms.randn(SHAPE, { seed = seed, offset = 4 })
  -- the whole call on the CPU: w is member 1, its elements numbered as they are
  local whole = w:clone()
  step(kind, { a:clone(), whole }, { ga, gw }, seed)
  for axis, cuts in pairs(kind == "adamw8" and CUTS8 or CUTS) do
    for _, c in ipairs(cuts) do
      local lo, hi = c[1], c[2]
      local part = w:slice(axis, lo, hi):contiguous():to(device):clone()
      local g = gw:slice(axis, lo, hi):contiguous():to(device):clone()
      local plain = part:clone()
      ms.set_rng_origin(part, { member = 1, rows = 12, cols = 64, row0 = axis == 1 and lo or 0, col0 = axis == 2 and lo or 0 })
      step(kind, { part }, { g }, seed)
      local what = ("%s %s %s [%d, %d) on %s"):format(kind, axis == 1 and "rows" or "cols", "slice", lo, hi, device:name())
      H.assert_same(vals(part), vals(whole:slice(axis, lo, hi)), what)
      -- (and numbered as its own whole it rounds otherwise: the check can fail)
      step(kind, { plain }, { g }, seed)
      assert.is_false(H.same_bits(vals(plain), vals(whole:slice(axis, lo, hi))), what .. " without its origin")
    end
  end
end

local function check_member(kind, device)
  local seed = H.seed()
  local a = ms.randn({ 12, 64 }, { seed = seed, offset = 1 }):to("bf16")
  local w = ms.randn(SHAPE, { seed = seed, offset = 2 }):to("bf16")
  local ga, gw = ms.randn({ 12, 64 }, { seed = seed, offset = 3 }), ms.randn(SHAPE, { seed = seed, offset = 4 })
  local whole = w:clone()
  step(kind, { a:clone(), whole }, { ga, gw }, seed)
  local alone, plain = on(w, device), on(w, device)
  ms.set_rng_origin(alone, { member = 1 })
  step(kind, { alone }, { on(gw, device) }, seed)
  H.assert_same(vals(alone), vals(whole), kind .. " member 1 stepped alone on " .. device:name())
  step(kind, { plain }, { on(gw, device) }, seed)
  assert.is_false(H.same_bits(vals(plain), vals(whole)), kind .. " stepped alone as member 0")
  -- cleared, it is member 0 again
  ms.set_rng_origin(alone, nil)
  local again = on(w, device)
  ms.set_rng_origin(again, { member = 1 })
  ms.set_rng_origin(again, nil)
  step(kind, { again }, { on(gw, device) }, seed)
  H.assert_same(vals(again), vals(plain), kind .. " with its origin cleared")
end

describe("ms.set_rng_origin", function()
  -- (the whole call always on the CPU: CUDA's slices are checked against its bits)
  for _, on_cuda in ipairs { false, true } do
    local where, run = on_cuda and "CUDA" or "CPU", on_cuda and H.cuda_it or it
    for _, kind in ipairs { "adamw", "sgd", "adamw8", "sinkgd" } do
      if kind ~= "sinkgd" then   -- (a SinkGD slice is another matrix: its member word only, below)
        run(("%s: slices of rows and of columns of a stack, stepped alone on the %s, round as the whole call"):format(kind, where),
            function() check_slices(kind, on_cuda and GPU or CPU) end)
      end
      run(("%s: a member stepped in a call of its own on the %s rounds as in its group's call"):format(kind, where),
          function() check_member(kind, on_cuda and GPU or CPU) end)
    end
  end

  it("refuses numbers that do not describe a slice along one dim, naming the problem", function()
    local t = ms.zeros({ 4, 6 })
    for _, c in ipairs {
      { ms.zeros({ 6 }), { member = 0, rows = 1, cols = 6 }, "rows and cols number a matrix's elements, and the tensor has 1 dims" },
      { t, { rows = 4, cols = 5 }, "a [4, 6] matrix at row 0, column 0 does not fit in [4, 5]" },
      { t, { rows = 8, cols = 6, row0 = 5 }, "a [4, 6] matrix at row 5, column 0 does not fit in [8, 6]" },
      { t, { rows = 8, cols = 12 }, "a [4, 6] matrix is a slice of [8, 12] along one dim" },
      { t, { row0 = 1 }, "row0 and col0 need the whole's rows and cols" },
      { t, { member = 2 ^ 32 }, "member must be an integer in [0, 2^32)" },
      { t, { member = -1 }, "member must be an integer in [0, 2^32)" },
      { t, { rows = 1.5, cols = 6 }, "rows must be an integer in [0, 2^53)" },
      { t, { rows = false, cols = 6 }, "rows must be an integer in [0, 2^53) (got false)" },
      { t, { member = 0, colz = 1 }, "colz" },
      { t, 3, "origin must be a table" },
      { 3, {}, "t must be a tensor" },
    } do
      H.expect_error(function() ms.set_rng_origin(c[1], c[2]) end, c[3])
    end
    -- a refused origin changes nothing: t keeps the one it had
    ms.set_rng_origin(t, { member = 3, rows = 8, cols = 6, row0 = 4 })
    H.expect_error(function() ms.set_rng_origin(t, { rows = 8, cols = 12 }) end, "along one dim")
  end)

  it("the runtime numbers its own handles: the caller's tensors, and other optimizers over them, keep theirs", function()
    local seed = H.seed()
    local w0 = ms.randn({ 64, 64 }, { seed = seed, offset = 1 }):to("bf16")
    local g0 = ms.randn({ 64, 64 }, { seed = seed, offset = 2 }):to("bf16")
    local o = { lr = 0.01, stochastic_round = true, seed = 5 }
    local function entry(name, p)
      return { name = name, param = p, grad = p:numel() == g0:numel() and g0:clone() or ms.ones(p:shape(), { dtype = "bf16" }) }
    end
    -- w and v: the same values and gradients, members 1 and 2 of one route
    local function run(second)
      local a, w, v = ms.randn({ 8 }, { seed = seed, offset = 3 }):to("bf16"), w0:clone(), w0:clone()
      local opt1 = ms.optim.new("adamw", { entry("a", a), entry("w", w), entry("v", v) }, o)
      if second then ms.optim.new("adamw", { entry("v", v) }, o) end   -- v alone: member 0 of this one
      opt1:step()
      return vals(w), vals(v)
    end
    local w1, v1 = run(false)
    local w2, v2 = run(true)
    assert.is_false(H.same_bits(w1, v1), "two members of a route drew the same numbers")
    H.assert_same(v2, v1, "v in the first optimizer, with a second optimizer over it")
    H.assert_same(w2, w1, "w in the first optimizer, with a second optimizer over v")
    -- a direct call on a tensor an optimizer holds numbers it by its place in that call, as any tensor
    local held, fresh = w0:clone(), w0:clone()
    ms.optim.new("adamw", { entry("a", ms.zeros({ 8 }, { dtype = "bf16" })), entry("held", held) }, o)
    for _, p in ipairs { held, fresh } do
      ms.adamw_step { params = { p }, grads = { g0 }, exp_avg = { ms.zeros(p:shape()) }, exp_avg_sq = { ms.zeros(p:shape()) },
                      lr = 0.01, step = 1, stochastic_round = true, seed = 5 }
    end
    H.assert_same(vals(held), vals(fresh), "a direct step of a tensor an optimizer holds")
  end)

  H.cuda_it("adamw: a call of 300 members, two of them slices, takes the tables with element numbers (past one launch)", function()
    local seed = H.seed()
    local params, grads, cparams = {}, {}, {}
    for i = 1, 300 do
      local p = ms.randn({ 8, 16 }, { seed = seed, offset = i }):to("bf16")
      cparams[i], params[i] = p:clone(), on(p, GPU)
      grads[i] = ms.randn({ 8, 16 }, { seed = seed, offset = 1000 + i })
    end
    -- member 299 is rows [8, 16) of a [16, 16] whole, member 1 columns [16, 32) of an [8, 32] one
    for _, t in ipairs { params[300], cparams[300] } do ms.set_rng_origin(t, { member = 299, rows = 16, cols = 16, row0 = 8 }) end
    for _, t in ipairs { params[2], cparams[2] } do ms.set_rng_origin(t, { member = 1, rows = 8, cols = 32, col0 = 16 }) end
    local ggrads = {}
    for i, g in ipairs(grads) do ggrads[i] = on(g, GPU) end
    step("adamw", cparams, grads, seed)
    step("adamw", params, ggrads, seed)
    for i = 1, 300 do H.assert_same(vals(params[i]), vals(cparams[i]), "adamw member " .. i) end
  end)
end)
