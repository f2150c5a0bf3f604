-- recipes/lion.lua and recipes/muon.lua, the worked examples of recipes on public primitives: a few
-- steps against f64 references written in plain Lua, routing, option checks, loading them sandboxed,
-- and Newton-Schulz's promise (singular values of the update near 1).
local ms = H.ms

-- plain-Lua matrices (arrays of rows) for the references
local function mat(t, rows, cols)
  local flat, out = t:tolist_flat(), {}
  for i = 1, rows do
    out[i] = {}
    for j = 1, cols do out[i][j] = flat[(i - 1) * cols + j] end
  end
  return out
end
local function mm(a, b)
  local out = {}
  for i = 1, #a do
    out[i] = {}
    for j = 1, #b[1] do
      local s = 0
      for k = 1, #b do s = s + a[i][k] * b[k][j] end
      out[i][j] = s
    end
  end
  return out
end
local function tr(a)
  local out = {}
  for j = 1, #a[1] do
    out[j] = {}
    for i = 1, #a do out[j][i] = a[i][j] end
  end
  return out
end
local function lin(alpha, a, beta, b)   -- alpha a + beta b, elementwise
  local out = {}
  for i = 1, #a do
    out[i] = {}
    for j = 1, #a[1] do out[i][j] = alpha * a[i][j] + (b and beta * b[i][j] or 0) end
  end
  return out
end
local function flat(a)
  local out = {}
  for i = 1, #a do for j = 1, #a[1] do out[#out + 1] = a[i][j] end end
  return out
end
local function sign(x) return x > 0 and 1 or (x < 0 and -1 or 0) end

-- the learning rate as the recipes see it: the runtime's device scalar ctx.lr_t is f32
local function f32(x) return ms.tensor({ x }):tolist_flat()[1] end

-- Keller Jordan's zeropower_via_newtonschulz5, in f64 on Lua tables
local function ns5(g, steps)
  local a, b, c = 3.4445, -4.7750, 2.0315
  local tall = #g > #g[1]
  local x = tall and tr(g) or g
  local n = 0
  for _, row in ipairs(x) do for _, v in ipairs(row) do n = n + v * v end end
  x = lin(1 / (math.sqrt(n) + 1e-7), x)
  for _ = 1, steps do
    local A = mm(x, tr(x))
    local B = lin(b, A, c, mm(A, A))
    x = lin(a, x, 1, mm(B, x))
  end
  return tall and tr(x) or x
end

-- parameters and, per step, gradients (f64, fresh random values)
local function setup(shapes, seed, device)
  local params, grads = {}, {}
  for i, s in ipairs(shapes) do
    params[i] = { name = s.name, param = ms.randn(s.shape, { seed = seed, offset = i, dtype = "f64", device = device }),
                  grad = ms.zeros(s.shape, { dtype = "f64", device = device }), tags = s.tags }
  end
  local function grad_at(step, i, shape)
    return ms.randn(shape, { seed = seed, offset = 100 * step + i, dtype = "f64", device = device })
  end
  return params, grad_at
end

describe("recipes/lion.lua", function()
  it("matches an f64 reference over several steps, with and without weight decay", function()
    local seed = H.seed()
    local shapes = { { name = "w", shape = { 4, 3 } }, { name = "b", shape = { 3 }, tags = { "no_decay" } } }
    local params, grad_at = setup(shapes, seed)
    local o = { lr = 0.01, betas = { 0.8, 0.95 }, weight_decay = 0.3 }
    local opt = ms.optim.new("lion", params, o)
    local ref = {}
    for i, p in ipairs(params) do ref[i] = { p = p.param:tolist_flat(), m = {} } for k = 1, #ref[i].p do ref[i].m[k] = 0 end end
    for step = 1, 4 do
      for i, p in ipairs(params) do
        p.grad:copy_(grad_at(step, i, shapes[i].shape))
        local g = p.grad:tolist_flat()
        local wd = shapes[i].tags and 0 or o.weight_decay
        local r = ref[i]
        local lr = f32(o.lr)
        for k = 1, #g do
          local cdir = o.betas[1] * r.m[k] + (1 - o.betas[1]) * g[k]
          r.p[k] = r.p[k] * (1 - lr * wd) - lr * sign(cdir)
          r.m[k] = o.betas[2] * r.m[k] + (1 - o.betas[2]) * g[k]
        end
      end
      opt:step()
      for i, p in ipairs(params) do
        H.assert_close(p.param:tolist_flat(), ref[i].p, 1e-12, 1e-14, ("step %d %s"):format(step, p.name))
        H.assert_close(opt.members[i].state.exp_avg:tolist_flat(), ref[i].m, 1e-12, 1e-14, "exp_avg")
      end
    end
    -- the no_decay parameter went to its own group with weight_decay 0
    local info = opt:info()
    assert.equals(2, #info.groups)
    assert.equals(0, opt.groups[2].options.weight_decay)
  end)

  it("checks its options", function()
    local p = { { name = "w", param = ms.zeros({ 2 }), grad = ms.zeros({ 2 }) } }
    H.expect_error(function() ms.optim.new("lion", p, { betas = { 0.9, 1.5 } }) end, "lion", "betas", "maximum")
    H.expect_error(function() ms.optim.new("lion", p, { lr = -1 }) end, "lion", "'lr'")
    H.expect_error(function() ms.optim.new("lion", p, { momentum = 0.9 }) end, "unknown option 'momentum'")
  end)
end)

describe("recipes/muon.lua", function()
  local shapes = {
    { name = "layers.0.weight", shape = { 5, 3 } },          -- tall: orthogonalised through its transpose
    { name = "layers.1.weight", shape = { 3, 7 } },          -- wide
    { name = "embed_tokens.weight", shape = { 6, 4 } },      -- a matrix, but an embedding: AdamW route
    { name = "layers.0.bias", shape = { 3 } },               -- 1-D: AdamW route
  }

  it("routes hidden matrices to Muon and the rest to AdamW", function()
    local params = setup(shapes, 1)
    local info = ms.optim.new("muon", params):info()
    local route = {}
    for _, p in ipairs(info.params) do route[p.name] = p.route end
    assert.same({ ["layers.0.weight"] = "muon", ["layers.1.weight"] = "muon", ["embed_tokens.weight"] = "adamw",
                  ["layers.0.bias"] = "adamw" }, route)
    -- a hidden matrix tagged for AdamW, by the tag sinkgd and dash take ("adamw") or this recipe's older "adam"
    for _, tag in ipairs { "adamw", "adam" } do
      local tagged = setup(shapes, 1)
      tagged[1].tags = { tag }
      local by = {}
      for _, p in ipairs(ms.optim.new("muon", tagged):info().params) do by[p.name] = p.route end
      assert.equals("adamw", by["layers.0.weight"], tag)
      assert.equals("muon", by["layers.1.weight"], tag)
    end
  end)

  it("matches an f64 reference (Nesterov momentum, Newton-Schulz, AdamW for the rest)", function()
    local seed = H.seed()
    local params, grad_at = setup(shapes, seed)
    local o = { lr = 0.02, momentum = 0.9, weight_decay = 0.1, adam_lr = 3e-3, adam_betas = { 0.9, 0.95 },
                adam_eps = 1e-8, adam_weight_decay = 0.01 }
    local opt = ms.optim.new("muon", params, o)
    local ref = {}
    for i, p in ipairs(params) do
      local s = shapes[i].shape
      local rows, cols = s[1], s[2] or 1
      ref[i] = { p = mat(p.param, rows, cols), buf = lin(0, mat(p.param, rows, cols)), m = lin(0, mat(p.param, rows, cols)),
                 v = lin(0, mat(p.param, rows, cols)), rows = rows, cols = cols }
    end
    for step = 1, 3 do
      for i, p in ipairs(params) do
        p.grad:copy_(grad_at(step, i, shapes[i].shape))
        local r = ref[i]
        local g = mat(p.grad, r.rows, r.cols)
        if i <= 2 then
          r.buf = lin(o.momentum, r.buf, 1 - o.momentum, g)
          local u = lin(1 - o.momentum, g, o.momentum, r.buf)
          local x = ns5(u, 5)
          local scale = math.sqrt(math.max(1, r.rows / r.cols))
          local lr = f32(o.lr)
          r.p = lin(1 - lr * o.weight_decay, r.p, -lr * scale, x)
        else
          -- the fused kernel's rate: the device lr times the member's scale adam_lr / lr
          local alr = f32(o.lr) * (o.adam_lr / o.lr)
          local b1, b2 = o.adam_betas[1], o.adam_betas[2]
          local bc1, bc2 = 1 - b1 ^ step, 1 - b2 ^ step
          for a = 1, r.rows do
            for b = 1, r.cols do
              r.m[a][b] = b1 * r.m[a][b] + (1 - b1) * g[a][b]
              r.v[a][b] = b2 * r.v[a][b] + (1 - b2) * g[a][b] ^ 2
              r.p[a][b] = r.p[a][b] * (1 - alr * o.adam_weight_decay)
                - (alr / bc1) * r.m[a][b] / (math.sqrt(r.v[a][b]) / math.sqrt(bc2) + o.adam_eps)
            end
          end
        end
      end
      opt:step()
      for i, p in ipairs(params) do
        -- the AdamW route keeps its moments in f32: its parameters match to f32 rounding of the update
        local rtol, atol = 1e-10, 1e-12
        if i > 2 then rtol, atol = 1e-9, 1e-9 end
        H.assert_close(p.param:tolist_flat(), flat(ref[i].p), rtol, atol, ("step %d %s"):format(step, p.name))
      end
    end
    H.assert_close(opt.members[1].state.momentum_buffer:tolist_flat(), flat(ref[1].buf), 1e-12, 1e-14, "momentum_buffer")
  end)

  it("orthogonalises a 3-D parameter matrix by matrix (the reference's batched Muon) and views 4-D as [out, rest]", function()
    -- stacked experts [3, 5, 4]: each [5, 4] matrix normalised, transposed and iterated on its own, scaled by
    -- sqrt(5 / 4); a conv filter [2, 3, 2, 1] is one [2, 6] matrix (scale 1).  The old code flattened the
    -- stack to one [3, 20] matrix.
    local seed = H.seed()
    local specs = { { name = "layers.0.experts", shape = { 3, 5, 4 } }, { name = "conv.weight", shape = { 2, 3, 2, 1 } } }
    local params, grad_at = setup(specs, seed)
    local o = { lr = 0.02, momentum = 0.9, nesterov = false, weight_decay = 0 }
    local opt = ms.optim.new("muon", params, o)
    for i, p in ipairs(params) do p.grad:copy_(grad_at(1, i, specs[i].shape)) end
    local before = {}
    for i, p in ipairs(params) do before[i] = p.param:tolist_flat() end
    opt:step()
    local lr = f32(o.lr)
    -- experts: buf = 0.1 g after one step (the iteration is scale-invariant up to its 1e-7)
    local want = {}
    for e = 0, 2 do
      local g = mat(params[1].grad:select(0, e), 5, 4)
      local x = ns5(lin(1 - o.momentum, g), 5)
      local p0 = {}
      for r = 1, 5 do p0[r] = {} for c = 1, 4 do p0[r][c] = before[1][e * 20 + (r - 1) * 4 + c] end end
      for _, v in ipairs(flat(lin(1, p0, -lr * math.sqrt(5 / 4), x))) do want[#want + 1] = v end
    end
    H.assert_close(params[1].param:tolist_flat(), want, 1e-10, 1e-12, "experts, matrix by matrix")
    local gc = mat(params[2].grad:reshape({ 2, 6 }), 2, 6)
    local p0 = {}
    for r = 1, 2 do p0[r] = {} for c = 1, 6 do p0[r][c] = before[2][(r - 1) * 6 + c] end end
    H.assert_close(params[2].param:tolist_flat(), flat(lin(1, p0, -lr, ns5(lin(1 - o.momentum, gc), 5))), 1e-10, 1e-12,
                   "conv filter as [out, in * kh * kw]")
  end)

  it("makes updates whose singular values are near 1 (Newton-Schulz)", function()
    local w = ms.zeros({ 8, 16 }, { dtype = "f64" })
    local g = ms.randn({ 8, 16 }, { seed = H.seed(), dtype = "f64" })
    -- an ill-conditioned gradient: rows scaled over two orders of magnitude (the quintic lifts singular
    -- values above ~1.5e-3 of the Frobenius norm into [0.7, 1.2] in five steps)
    local scales = {}
    for i = 1, 8 do scales[i] = { 10 ^ (-2 * (i - 1) / 7) } end
    g = g * ms.tensor(scales, { dtype = "f64" })
    local opt = ms.optim.new("muon", { { name = "h.weight", param = w, grad = g } }, { lr = 1, momentum = 0.5, nesterov = false })
    opt:step()
    local x = w * -1    -- lr 1, scale sqrt(max(1, 8/16)) = 1: the update is -X
    local sv = ms.eigh(ms.matmul(x, x, { trans_b = true })):sqrt():tolist_flat()
    for _, s in ipairs(sv) do assert.is_true(s > 0.6 and s < 1.25, "singular value " .. s) end
  end)

  it("runs the iteration in bf16 when asked, close to the f32 result", function()
    local g = ms.randn({ 16, 32 }, { seed = H.seed() })
    local function update(dtype)
      local w = ms.zeros({ 16, 32 })
      local opt = ms.optim.new("muon", { { name = "h.weight", param = w, grad = g } }, { ns_dtype = dtype })
      opt:step()
      return w
    end
    local a, b = update("param"), update("bf16")
    -- bf16 keeps 8 bits of mantissa through five iterations: a few percent, as in the reference implementation
    local rel = (a - b):norm() / a:norm()
    assert.is_true(rel < 0.05, "bf16 iteration too far from f32: " .. rel)
    assert.is_true((a - b):abs():max() > 0, "bf16 made no difference at all: was it used?")
  end)

  it("steps a group holding empty matrices ([0, n], [0, m, n], [m, 0]), updating the others", function()
    local params = {}
    for i, s in ipairs { { 0, 4 }, { 0, 3, 3 }, { 4, 0 }, { 4, 4 } } do
      params[i] = { name = "layers." .. i .. ".weight", param = ms.randn(s, { seed = i }), grad = ms.randn(s, { seed = 10 + i }) }
    end
    local before = params[4].param:tolist_flat()
    ms.optim.new("muon", params, {}):step()
    local after = params[4].param:tolist_flat()
    local moved = 0
    for i = 1, #after do if after[i] ~= before[i] then moved = moved + 1 end end
    assert.equals(#after, moved)
  end)

  it("checks its options", function()
    local p = { { name = "w", param = ms.zeros({ 2, 2 }), grad = ms.zeros({ 2, 2 }) } }
    H.expect_error(function() ms.optim.new("muon", p, { lr = 0 }) end, "muon", "'lr'", "must be > 0")
    H.expect_error(function() ms.optim.new("muon", p, { ns_dtype = "f16" }) end, "ns_dtype", "one of")
    H.expect_error(function() ms.optim.new("muon", p, { momentum = 1 }) end, "momentum")
  end)
end)

describe("lion and muon as files", function()
  it("run sandboxed (public primitives only) with the same results as the built-ins", function()
    for _, name in ipairs { "lion", "muon" } do
      local seed = H.seed()
      local function run(recipe)
        local params, grad_at = setup({ { name = "layers.0.weight", shape = { 4, 6 } }, { name = "layers.0.bias", shape = { 6 } } }, seed)
        local opt = ms.optim.new(recipe, params, {})
        for step = 1, 2 do
          for i, p in ipairs(params) do p.grad:copy_(grad_at(step, i, p.param:shape())) end
          opt:step()
        end
        return params[1].param:tolist_flat(), opt
      end
      local builtin = run(name)
      local sandboxed, opt = run("recipes/" .. name .. ".lua")
      assert.is_false(require("moonstep.recipe").meta[opt.recipe].trusted)
      H.assert_close(sandboxed, builtin, 0, 0, name)
    end
  end)

  it("train a problem: the loss goes down", function()
    local E = require("moonstep.experiment")
    for _, name in ipairs { "lion", "muon" } do
      local r = E.run { problem = "mlp", recipe = name, steps = 40, device = "cpu", seed = 1, eval_every = 40,
                        problem_options = { points = 40, hidden = 16, classes = 3 } }
      assert.is_true(r.final_loss < r.losses[1] * 0.9, name .. ": " .. r.losses[1] .. " -> " .. r.final_loss)
    end
  end)

  H.cuda_it("give the CPU's results on CUDA", function()
    for _, name in ipairs { "lion", "muon" } do
      local function run(device)
        local w = ms.randn({ 12, 20 }, { seed = 3, device = device })
        local g = ms.randn({ 12, 20 }, { seed = 4, device = device })
        local opt = ms.optim.new(name, { { name = "h.weight", param = w, grad = g } }, {})
        opt:step()
        opt:step()
        return w:tolist_flat()
      end
      H.assert_close(run("cuda"), run("cpu"), 1e-4, 1e-6, name)
    end
    -- Muon's stacked experts: batched products and per-matrix norms, one matrix transposed (wide) per stack
    for _, shape in ipairs { { 3, 12, 20 }, { 2, 20, 12 } } do
      local function run(device)
        local w = ms.randn(shape, { seed = 5, device = device })
        local g = ms.randn(shape, { seed = 6, device = device })
        local opt = ms.optim.new("muon", { { name = "layers.0.experts", param = w, grad = g } }, {})
        opt:step()
        g:mul_(-0.5)
        opt:step()
        return w:tolist_flat()
      end
      H.assert_close(run("cuda"), run("cpu"), 1e-4, 1e-6, "muon " .. table.concat(shape, "x"))
    end
  end)
end)
