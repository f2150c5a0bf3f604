-- Random vectors keyed by block id (moonstep.h, "Random vectors": the options' rng_ids), on the CPU: a block
-- whose id is i draws what the block at stack position i draws without ids, in ms_inv_root (PI / PIM scaling,
-- the residual sketch), ms_spectrum_estimate (lam_max, lam_min) and ms_blocks_apply's stochastic rounding; ids
-- 0..N-1 change nothing, bit for bit; the offsets follow the f64 power iteration from ms_rand's normals (ids
-- read as unsigned 32-bit values); bad ids are refused, naming rng_ids, and change nothing.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local ffi, C = core.ffi, core.C

local B = 10

local function vals(t) return t:tolist_flat() end

-- fresh SPD blocks [n, b, b] f32: G G^T / b + 0.1 I with G normal
local function spd(n, b, seed)
  local g = ms.randn({ n, b, b }, { seed = seed })
  return ms.matmul(g, g, { trans_b = true }) * (1 / b) + ms.eye(b) * 0.1
end

-- the block at position i of a stack
local function block(t, i) return t:select(0, i) end

-- bitwise equality of two tensors (NaN never equals)
local function same(a, b, what)
  local x, y = vals(a), vals(b)
  assert.are.equal(#y, #x, what)
  for i = 1, #x do
    if not (x[i] == y[i]) then error(("%s: value %d is %.9g, expected %.9g"):format(what, i, x[i], y[i]), 2) end
  end
end

local function differs(a, b)
  local x, y = vals(a), vals(b)
  for i = 1, #x do if x[i] ~= y[i] then return true end end
  return false
end

local function finite(t)
  for _, v in ipairs(vals(t)) do if not (v == v and math.abs(v) < math.huge) then return false end end
  return true
end

-- the solver cases: every method that draws random vectors, with PI and PIM scaling; few power-iteration steps so
-- that the scale (hence the root) depends on the start vectors
local CASES = {}
for _, m in ipairs { { "ndb", 6 }, { "cn", 8 }, { "chebyshev", 16 } } do
  for _, sc in ipairs { "pi", "pim" } do
    for _, p in ipairs { 2, 4 } do
      CASES[#CASES + 1] = { method = m[1], steps = m[2], scaling = sc, root = p }
    end
  end
end

local function root_opts(c, seed, extra)
  local o = { method = c.method, steps = c.steps, scaling = c.scaling, root = c.root, eps = 1e-3, pi_steps = 2,
              pi_vectors = 4, seed = seed, residual = true, iters = true }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

local function name_of(c) return ("%s-%d %s p=%d"):format(c.method, c.steps, c.scaling, c.root) end

describe("rng_ids: ms_inv_root", function()
  it("ids 0..N-1 give the call without ids, bit for bit (roots, residuals, iterations)", function()
    local a, seed = spd(5, B, H.seed()), H.seed()
    local ids = ms.tensor({ 0, 1, 2, 3, 4 }, { dtype = "i32" })
    for _, c in ipairs(CASES) do
      local x0, r0, i0 = ms.inv_root(a, root_opts(c, seed))
      local x1, r1, i1 = ms.inv_root(a, root_opts(c, seed, { rng_ids = ids }))
      assert(finite(x0) and finite(r0), name_of(c))
      same(x1, x0, name_of(c) .. " x")
      same(r1, r0, name_of(c) .. " residual")
      same(i1, i0, name_of(c) .. " iters")
    end
  end)

  it("a block with id i draws the vectors of stack position i: [A, B] with ids {7, 3} solves as A at 7, B at 3", function()
    local big, seed = spd(8, B, H.seed()), H.seed()
    local small = ms.empty({ 2, B, B })
    block(small, 0):copy_(block(big, 7))
    block(small, 1):copy_(block(big, 3))
    for _, c in ipairs(CASES) do
      local xb, rb, ib = ms.inv_root(big, root_opts(c, seed))
      local xs, rs, is = ms.inv_root(small, root_opts(c, seed, { rng_ids = { 7, 3 } }))
      assert(finite(xb) and finite(rb), name_of(c))
      same(block(xs, 0), block(xb, 7), name_of(c) .. " A's root")
      same(block(xs, 1), block(xb, 3), name_of(c) .. " B's root")
      local r, rbl, it, ibl = vals(rs), vals(rb), vals(is), vals(ib)
      assert.are.same({ rbl[8], rbl[4] }, r, name_of(c) .. " residuals")
      assert.are.same({ ibl[8], ibl[4] }, it, name_of(c) .. " iterations")
      -- the ids matter: without them the two blocks draw position 0's and 1's vectors, and their roots differ
      local xn, rn = ms.inv_root(small, root_opts(c, seed))
      assert(differs(block(xn, 0), block(xb, 7)) or differs(block(xn, 1), block(xb, 3)), name_of(c) .. ": roots ignore the vectors")
      assert(vals(rn)[1] ~= rbl[8] and vals(rn)[2] ~= rbl[4], name_of(c) .. ": the residual ignores the sketch")
    end
  end)

  it("with index, block k (a position) draws as id rng_ids[k]; blocks outside index stay as they are", function()
    local big, seed = spd(8, B, H.seed()), H.seed()
    local small = ms.empty({ 3, B, B })
    block(small, 0):copy_(block(big, 6))
    block(small, 1):copy_(block(big, 1))
    block(small, 2):copy_(block(big, 2))
    for _, c in ipairs { CASES[1], CASES[#CASES] } do
      local xb, rb = ms.inv_root(big, root_opts(c, seed))
      local x, res = ms.full({ 3, B, B }, 5), ms.full({ 3 }, -2)
      ms.inv_root(small, root_opts(c, seed, { rng_ids = { 6, 4, 2 }, index = { 2, 0 }, out = x, residual = res }))
      same(block(x, 0), block(xb, 6), name_of(c) .. " block 0")
      same(block(x, 2), block(xb, 2), name_of(c) .. " block 2")
      for _, v in ipairs(vals(block(x, 1))) do assert.are.equal(5, v) end
      local r, rr = vals(res), vals(rb)
      assert.are.same({ rr[7], -2, rr[3] }, r)
    end
  end)

  it("EVD with ids draws only the residual sketch, keyed by id", function()
    local big, seed = spd(8, B, H.seed()), H.seed()
    local small = ms.empty({ 2, B, B })
    block(small, 0):copy_(block(big, 5))
    block(small, 1):copy_(block(big, 0))
    local o = { method = "evd", root = 4, eps = 1e-3, seed = seed, residual = true }
    local xb, rb = ms.inv_root(big, o)
    o.rng_ids = { 5, 0 }
    local xs, rs = ms.inv_root(small, o)
    same(block(xs, 0), block(xb, 5), "EVD root 0")
    same(block(xs, 1), block(xb, 0), "EVD root 1")
    assert.are.same({ vals(rb)[6], vals(rb)[1] }, vals(rs))
  end)
end)

-- moonstep.h's power iteration in f64 on the start vectors ms_rand gives for key seed and offset off
local function power_estimate(S, eps, m, steps, seed, off)
  local b = #S
  local V0 = ms.randn({ b, m }, { seed = seed, offset = off }):tolist_flat()
  local v = {}
  for j = 1, m do
    v[j] = {}
    for i = 1, b do v[j][i] = V0[(i - 1) * m + j] end
  end
  local function normalize(x)
    local nn = 0
    for i = 1, b do nn = nn + x[i] * x[i] end
    local f = nn > 0 and 1 / math.sqrt(nn) or 0
    for i = 1, b do x[i] = x[i] * f end
  end
  local function apply(x)
    local y = {}
    for i = 1, b do
      local acc = eps * x[i]
      for k = 1, b do acc = acc + S[i][k] * x[k] end
      y[i] = acc
    end
    return y
  end
  local best = -math.huge
  for j = 1, m do
    local x = v[j]
    normalize(x)
    for _ = 1, steps do
      x = apply(x)
      normalize(x)
    end
    local y, q = apply(x), 0
    for i = 1, b do q = q + x[i] * y[i] end
    if q > best then best = q end
  end
  return best
end

local function matrix(t)
  local f, b, S = vals(t), t:size(0), {}
  for i = 1, b do
    S[i] = {}
    for k = 1, b do S[i][k] = f[(i - 1) * b + k] end
  end
  return S
end

describe("rng_ids: ms_spectrum_estimate", function()
  it("ids 0..N-1 change nothing; [A, B] with ids {7, 3} estimates as A at 7 and B at 3 (lam_max and lam_min)", function()
    local big, xr, seed = spd(8, B, H.seed()), spd(8, B, H.seed()), H.seed()
    for _, bf16 in ipairs { false, true } do
      local o = { vectors = 3, steps = 1, eps = 1e-6, bf16 = bf16, root = 4, seed = seed, x_root = xr }
      local lb, mb = ms.spectrum_estimate(big, o)
      o.rng_ids = { 0, 1, 2, 3, 4, 5, 6, 7 }
      local li, mi = ms.spectrum_estimate(big, o)
      same(li, lb, "lam_max with ids 0..7")
      same(mi, mb, "lam_min with ids 0..7")
      local a, x = ms.empty({ 2, B, B }), ms.empty({ 2, B, B })
      for q, k in ipairs { 7, 3 } do
        block(a, q - 1):copy_(block(big, k))
        block(x, q - 1):copy_(block(xr, k))
      end
      o.x_root, o.rng_ids = x, ms.tensor({ 7, 3 }, { dtype = "i32" })
      local ls, ms_ = ms.spectrum_estimate(a, o)
      assert.are.same({ vals(lb)[8], vals(lb)[4] }, vals(ls))
      assert.are.same({ vals(mb)[8], vals(mb)[4] }, vals(ms_))
      o.rng_ids = nil
      local ln, mn = ms.spectrum_estimate(a, o)
      assert(vals(ln)[1] ~= vals(lb)[8] and vals(mn)[1] ~= vals(mb)[8], "the estimates ignore the start vectors")
    end
  end)

  it("offsets are id, 2^32 + id (on the root), read as unsigned: the f64 power iteration on ms_rand's normals", function()
    local a, xr, seed = spd(3, B, H.seed()), spd(3, B, H.seed()), H.seed()
    local ids = { -1, 5, 2147483647 }   -- -1 is 2^32 - 1
    local eps, m, steps = 1e-3, 2, 1
    local lmax, lmin = ms.spectrum_estimate(a, { vectors = m, steps = steps, eps = eps, root = 2, seed = seed, x_root = xr,
                                                 rng_ids = ids })
    local got_max, got_min = vals(lmax), vals(lmin)
    for q = 1, 3 do
      local u = ids[q] % 4294967296
      local want = power_estimate(matrix(block(a, q - 1)), eps, m, steps, seed, u) - eps
      local mu = power_estimate(matrix(block(xr, q - 1)), 0, m, steps, seed, 4294967296 + u)
      assert(math.abs(got_max[q] - want) <= 1e-5 * math.abs(want), ("lam_max[%d] = %.9g, f64 %.9g"):format(q, got_max[q], want))
      local want_min = mu ^ -2
      assert(math.abs(got_min[q] - want_min) <= 1e-4 * want_min, ("lam_min[%d] = %.9g, f64 %.9g"):format(q, got_min[q], want_min))
      -- other offsets give other estimates, far beyond the tolerance above (one step from the start vectors is far
      -- from converged; one offset alone came within 1e-3 of it for ~1.5% of the seeds, so the farthest of three)
      local far = 0
      for _, off in ipairs { q - 1, q + 7, q + 1000 } do
        far = math.max(far, math.abs(power_estimate(matrix(block(a, q - 1)), eps, m, steps, seed, off) - eps - want))
      end
      assert(far > 1e-4 * math.abs(want), "the check cannot tell offsets apart")
    end
  end)
end)

describe("rng_ids: ms_blocks_apply's stochastic rounding", function()
  -- n bf16 params [5, 6] and a stack of their updates
  local function setup(n, seed)
    local params, list = {}, {}
    for i = 1, n do
      params[i] = ms.randn({ 5, 6 }, { seed = seed, offset = i }):to("bf16")
      list[i] = { tensor = params[i], row0 = 0, col0 = 0 }
    end
    return params, list, ms.randn({ n, 5, 6 }, { seed = seed + 1 }) * 0.01
  end
  local function apply(list, stack, seed, ids)
    ms.blocks_apply { blocks = list, stack = stack, lr = 0.37, weight_decay = 0.1, step = 5, stochastic_round = true,
                      seed = seed, rng_ids = ids }
  end

  it("ids 0..N-1 change nothing; blocks with ids {7, 3} round as positions 7 and 3 of a larger call", function()
    local seed = H.seed()
    local p0, l0, s0 = setup(8, seed)
    local p1, l1 = setup(8, seed)
    apply(l0, s0, seed)
    apply(l1, s0, seed, { 0, 1, 2, 3, 4, 5, 6, 7 })
    for i = 1, 8 do same(p1[i], p0[i], "param " .. i) end
    -- the same two updates alone, with ids
    local pa, la = setup(8, seed)
    local two = ms.empty({ 2, 5, 6 })
    block(two, 0):copy_(block(s0, 7))
    block(two, 1):copy_(block(s0, 3))
    apply({ la[8], la[4] }, two, seed, ms.tensor({ 7, 3 }, { dtype = "i32" }))
    same(pa[8], p0[8], "block with id 7")
    same(pa[4], p0[4], "block with id 3")
    -- without ids they round as members 0 and 1: other bits
    local pb, lb = setup(8, seed)
    apply({ lb[8], lb[4] }, two, seed)
    assert(differs(pb[8], p0[8]) and differs(pb[4], p0[4]), "the rounding ignores the member")
  end)
end)

describe("rng_ids: bad ids", function()
  it("refuses another dtype, shape or a strided view, naming rng_ids, and changes nothing", function()
    local a = spd(2, 6, H.seed())
    local bads = {
      { ms.tensor({ 0, 1 }), "dtype" },
      { ms.tensor({ 0, 1, 2 }, { dtype = "i32" }), "shape" },
      { ms.tensor({ { 0 }, { 1 } }, { dtype = "i32" }), "shape" },
      { ms.tensor({ 0, 9, 1, 9 }, { dtype = "i32" }):slice(0, 0, 4, 2), "contiguous" },
    }
    for i, bad in ipairs(bads) do
      local ids, what = bad[1], bad[2]
      local x, res, its = ms.full({ 2, 6, 6 }, 3), ms.full({ 2 }, 4), ms.full({ 2 }, 6, { dtype = "i32" })
      H.expect_error(function()
        ms.inv_root(a, { method = "ndb", scaling = "pim", rng_ids = ids, out = x, residual = res, iters = its })
      end, "ms_inv_root", "rng_ids", what)
      for _, v in ipairs(vals(x)) do assert.are.equal(3, v) end
      assert.are.same({ 4, 4 }, vals(res))
      assert.are.same({ 6, 6 }, vals(its))
      local lmax, lmin = ms.full({ 2 }, 7), ms.full({ 2 }, 8)
      H.expect_error(function()
        ms.spectrum_estimate(a, { rng_ids = ids, x_root = a:clone(), lam_max = lmax, lam_min = lmin })
      end, "ms_spectrum_estimate", "rng_ids", what)
      assert.are.same({ 7, 7 }, vals(lmax))
      assert.are.same({ 8, 8 }, vals(lmin))
      local p = ms.randn({ 6, 6 }, { seed = 40 + i }):to("bf16")
      local before = vals(p)
      H.expect_error(function()
        ms.blocks_apply { blocks = { { tensor = p, row0 = 0, col0 = 0 }, { tensor = p, row0 = 3, col0 = 0 } },
                          stack = ms.ones({ 2, 3, 6 }), lr = 0.1, step = 1, stochastic_round = true, rng_ids = ids }
      end, "ms_blocks_apply", "rng_ids", what)
      assert.are.same(before, vals(p))
    end
  end)

  it("refuses ids that share memory with an output", function()
    local a = spd(2, 6, H.seed())
    local res = ms.zeros({ 2 }, { dtype = "i32" })
    H.expect_error(function()
      ms.inv_root(a, { method = "cn", scaling = "pi", iters = res, rng_ids = res })
    end, "rng_ids", "share memory")
    -- the raw status of a wrong dtype is MS_E_DTYPE, of a wrong shape MS_E_SHAPE
    local o = ffi.new("ms_spectrum_options")
    o.vectors, o.steps, o.eps, o.root = 2, 2, 1e-6, 4
    local lm = ms.zeros({ 2 })
    local cpu = T.handle_ctx(ms.device("cpu"))
    local f32ids, long = ms.zeros({ 2 }), ms.zeros({ 3 }, { dtype = "i32" })
    o.rng_ids = T.handle(f32ids)
    assert.are.equal(C.MS_E_DTYPE, C.ms_spectrum_estimate(cpu, T.handle(lm), nil, T.handle(a), nil, o))
    o.rng_ids = T.handle(long)
    assert.are.equal(C.MS_E_SHAPE, C.ms_spectrum_estimate(cpu, T.handle(lm), nil, T.handle(a), nil, o))
  end)

  H.cuda_it("refuses ids on another device", function()
    local a = spd(2, 6, H.seed())
    local ids = ms.tensor({ 0, 1 }, { dtype = "i32" }):to("cuda")
    H.expect_error(function() ms.inv_root(a, { method = "ndb", rng_ids = ids }) end, "rng_ids")
    H.expect_error(function() ms.spectrum_estimate(a, { rng_ids = ids }) end, "rng_ids")
  end)
end)
