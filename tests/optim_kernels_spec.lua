-- The CPU fused optimizer kernels (ms_adamw_step, ms_sgd_step) and multi-tensor helpers (ms_foreach_sumsq,
-- ms_foreach_scale), called through the C ABI and checked against f64 references computed here over several
-- steps of fresh random inputs: every param dtype, f32 and bf16 state, strided grads, device scalars, skip,
-- stochastic rounding, large groups in one launch, and every validation error (which must change nothing).
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local ffi, C = core.ffi, core.C

local cpu = ms.device("cpu")
local CTX = T.handle_ctx(cpu)
local NaN, inf = 0 / 0, math.huge
local STEPS = 6

-- ---------------------------------------------------------------------------------------------------
-- helpers
-- ---------------------------------------------------------------------------------------------------
local A = dofile("tests/abi.lua")
local adamw_opts, sgd_opts = A.adamw_options, A.sgd_options
local function tensors(list, n, ro) return A.handles(list, ro, n) end
local function sources(list, n) return A.handles(list, true, n) end
local function doubles(list) return A.doubles(list) end

local function launches() return cpu:mem_stats().launches end

-- launches counted by the engine during the last adamw_raw / sgd_raw call (its arguments built before)
local last_launches

-- g = {params=, grads=, m=, v=, scales=}; returns the status (callers assert it)
local function adamw_raw(g, o, n)
  n = n or #g.params
  local args = { tensors(g.params, n), sources(g.grads, n), tensors(g.m, n), tensors(g.v, n), doubles(g.scales), adamw_opts(o) }
  local n0 = launches()
  local st = C.ms_adamw_step(CTX, n, unpack(args, 1, 6))
  last_launches = launches() - n0
  return st
end
local function sgd_raw(g, o, n)
  n = n or #g.params
  local args = { tensors(g.params, n), sources(g.grads, n), g.buf and tensors(g.buf, n) or nil, doubles(g.scales), sgd_opts(o) }
  local n0 = launches()
  local st = C.ms_sgd_step(CTX, n, args[1], args[2], args[3], args[4], args[5])
  last_launches = launches() - n0
  return st
end
local ok = A.ok

local function randn(shape, dt, std) return ms.randn(shape, { dtype = dt or "f32", seed = H.seed(), std = std or 1 }) end
local function urand(shape, dt, lo, hi) return ms.rand(shape, { dtype = dt or "f32", seed = H.seed(), low = lo, high = hi }) end

-- a grad of `shape` that is a transposed (non-contiguous) view when the shape has 2+ dims
local function strided_grad(shape, dt)
  if #shape < 2 then return randn(shape, dt) end
  local sw = {}
  for i = 1, #shape do sw[i] = shape[i] end
  sw[1], sw[#shape] = shape[#shape], shape[1]
  local g = randn(sw, dt):transpose(0, #shape - 1)
  assert(not g:is_contiguous() or shape[1] == 1 or shape[#shape] == 1)
  return g
end

local function vals(t) return t:tolist_flat() end

local function sumsq_ref(t)
  local s = 0
  for _, v in ipairs(vals(t)) do s = s + v * v end
  return s
end

-- ms_foreach_sumsq into a new [n] dst, as flat values
local function sumsq(srcs, dst_dt)
  local dst = ms.empty({ #srcs }, { dtype = dst_dt or "f32" })
  ok(C.ms_foreach_sumsq(CTX, T.handle(dst), #srcs, sources(srcs)))
  return vals(dst)
end

local same_bits = H.same_bits

local function snapshot(list)
  local s = {}
  for i, t in ipairs(list) do s[i] = vals(t) end
  return s
end

local function assert_unchanged(list, snap, what)
  for i, t in ipairs(list) do
    assert(same_bits(vals(t), snap[i]), (what or "") .. ": tensor " .. i .. " changed by a failed call")
  end
end

-- the two neighbours of x (exact) in bf16 / f16, and their spacing
local function grid(dt, x)
  local a = math.abs(x)
  local e = math.floor(math.log(a) / math.log(2))
  while 2 ^ e > a do e = e - 1 end
  while 2 ^ (e + 1) <= a do e = e + 1 end
  local sp = dt == "bf16" and 2 ^ (e - 7) or 2 ^ (math.max(e, -14) - 10)
  local lo = math.floor(a / sp) * sp
  local s = x < 0 and -1 or 1
  return s * lo, s * (lo + sp), sp
end

-- ---------------------------------------------------------------------------------------------------
-- f64 references
--
-- Each reference state carries, next to the exact values (p, m, v, b), a bound per element on how far the
-- engine may have drifted from them (ep, em, ev, eb): every step adds the rounding of what it stores (unit
-- roundoff U of the dtype, relative), a few f32 (f64) roundings of the arithmetic, and what the drift of the
-- states does to the update (first order).  A result must lie within H.tol of its dtype plus 1.5 times that
-- bound: "slightly widened for multi-step drift", and no wider.
-- ---------------------------------------------------------------------------------------------------
local U = { f64 = 2 ^ -53, f32 = 2 ^ -24, bf16 = 2 ^ -8, f16 = 2 ^ -11 }

local function units(pdt, sdt)
  return { p = U[pdt], s = U[sdt or "f32"], c = pdt == "f64" and U.f64 or U.f32 }
end

local function ref_adamw(st, g, o, scale, u)
  local lr = o.lr * scale
  local bc1, bc2 = 1, 1
  if o.bias_correction ~= false then bc1, bc2 = 1 - o.beta1 ^ o.step, 1 - o.beta2 ^ o.step end
  local b1, b2, eps, wd = o.beta1, o.beta2, o.eps, o.weight_decay
  local abs, sqrt = math.abs, math.sqrt
  for j = 1, #g do
    local m = b1 * st.m[j] + (1 - b1) * g[j]
    local v = b2 * st.v[j] + (1 - b2) * g[j] * g[j]
    local em = b1 * st.em[j] + (u.s + 4 * u.c) * (abs(m) + (1 - b1) * abs(g[j]))
    local ev = b2 * st.ev[j] + (u.s + 4 * u.c) * v
    local mh, vh = m / bc1, v / bc2
    local den = sqrt(vh) + eps
    local upd = lr * mh / den
    local dupd = lr * ((em / bc1) / den + abs(mh) / (den * den) * (ev / bc2) / (2 * sqrt(vh)))
    local p = st.p[j] * (1 - lr * wd) - upd
    st.ep[j] = st.ep[j] + dupd + u.p * abs(p) + 4 * u.c * (abs(p) + abs(upd))
    st.p[j], st.m[j], st.v[j], st.em[j], st.ev[j] = p, m, v, em, ev
  end
end

local function ref_sgd(st, g, o, scale, u)
  local lr, mom, damp, wd = o.lr * scale, o.momentum or 0, o.dampening or 0, o.weight_decay or 0
  local abs = math.abs
  for j = 1, #g do
    local d, ed = g[j], 0
    if wd ~= 0 then d, ed = d + wd * st.p[j], wd * st.ep[j] + u.c * abs(d + wd * st.p[j]) end
    if mom ~= 0 then
      local b, eb
      if o.step <= 1 then b, eb = d, ed + u.s * abs(d)
      else
        b = mom * st.b[j] + (1 - damp) * d
        eb = mom * st.eb[j] + abs(1 - damp) * ed + (u.s + 4 * u.c) * (abs(b) + abs(d))
      end
      st.b[j], st.eb[j] = b, eb
      if o.nesterov then d, ed = d + mom * b, ed + mom * eb + u.c * abs(d + mom * b) else d, ed = b, eb end
    end
    local p = st.p[j] - lr * d
    st.ep[j] = st.ep[j] + lr * ed + u.p * abs(p) + 4 * u.c * (abs(p) + lr * abs(d))
    st.p[j] = p
  end
end

local function zeros_like(list)
  local z = {}
  for j = 1, #list do z[j] = 0 end
  return z
end

-- got (flat values) against the reference values and their drift bound, within dtype dt's tolerance
local function check_close(got, want, drift, dt, what)
  local rt, at = H.tols(dt)
  for j = 1, #want do H.assert_close(got[j], want[j], rt, at + 1.5 * drift[j], what .. "[" .. j .. "]") end
end

-- a group of members with fresh random contents
local SHAPES = { { 37 }, { 6, 9 }, { 3, 4, 5 } }
local function adamw_group(pdt, sdt, shapes)
  local g = { params = {}, m = {}, v = {}, scales = {}, shapes = shapes or SHAPES }
  for i, shp in ipairs(g.shapes) do
    g.params[i] = randn(shp, pdt)
    g.m[i] = randn(shp, sdt, 0.1)
    g.v[i] = urand(shp, sdt, 0.01, 1)
    g.scales[i] = 0.5 + 1.5 * ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()
  end
  return g
end

local function ref_state(g)
  local r = {}
  for i = 1, #g.params do
    local p = vals(g.params[i])
    r[i] = { p = p, m = g.m and vals(g.m[i]), v = g.v and vals(g.v[i]), b = g.buf and g.buf[i] and vals(g.buf[i]),
             ep = zeros_like(p), em = zeros_like(p), ev = zeros_like(p), eb = zeros_like(p) }
  end
  return r
end

-- fresh grads per step: member 2 strided, member 3 in bf16 (any float dtype and layout is accepted)
local function fresh_grads(g)
  g.grads = {}
  for i, shp in ipairs(g.shapes) do
    if i == 2 then g.grads[i] = strided_grad(shp, "f32")
    elseif i == 3 then g.grads[i] = randn(shp, "bf16")
    else g.grads[i] = randn(shp, "f32") end
  end
end

-- ---------------------------------------------------------------------------------------------------
describe("ms_adamw_step (CPU)", function()
  local function run_case(pdt, sdt, bias, lr, steps, eps)
    local g = adamw_group(pdt, sdt)
    local ref, u = ref_state(g), units(pdt, sdt)
    local o = { lr = lr, beta1 = 0.9, beta2 = 0.999, eps = eps or 1e-8, weight_decay = 0.05, bias_correction = bias }
    for k = 1, steps do
      fresh_grads(g)
      o.step = k
      ok(adamw_raw(g, o))
      for i = 1, #g.params do
        local r = ref[i]
        ref_adamw(r, vals(g.grads[i]), o, g.scales[i], u)
        local what = ("%s params, %s state, bias_correction=%s, step %d, member %d"):format(pdt, sdt, tostring(bias), k, i)
        check_close(vals(g.params[i]), r.p, r.ep, pdt, what .. " param")
        check_close(vals(g.m[i]), r.m, r.em, sdt, what .. " exp_avg")
        check_close(vals(g.v[i]), r.v, r.ev, sdt, what .. " exp_avg_sq")
      end
    end
  end

  for _, pdt in ipairs { "f32", "bf16", "f16", "f64" } do
    for _, sdt in ipairs { "f32", "bf16" } do
      it(("matches the f64 reference over %d steps: %s params, %s state, with and without bias correction")
         :format(STEPS, pdt, sdt), function()
        run_case(pdt, sdt, true, 0.01, STEPS)
        run_case(pdt, sdt, false, 0.003, STEPS)
      end)
    end
  end

  -- eps = 1e-8 is invisible next to sqrt(v_hat) >= 0.1 in f32: eps inside the sqrt, or added before the
  -- division by sqrt(bc2), would pass the cases above.  An eps of the size of sqrt(v_hat) shows where it is.
  for _, pdt in ipairs { "f32", "f64" } do
    it(("adds eps after the bias-corrected sqrt(v), as the reference (eps the size of sqrt(v_hat)): %s params")
       :format(pdt), function()
      run_case(pdt, "f32", true, 0.01, STEPS, 3 * (0.5 + ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()))
      run_case(pdt, "f32", false, 0.01, STEPS, 0.3 * (0.5 + ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()))
    end)
  end

  it("updates a member large enough to be split over threads like the reference", function()
    local shp = { 300, 257 }
    local g = { params = { randn(shp) }, m = { randn(shp, "f32", 0.1) }, v = { urand(shp, "f32", 0.01, 1) },
                shapes = { shp } }
    local ref, u = ref_state(g), units("f32", "f32")
    local o = { lr = 0.01, beta1 = 0.8, beta2 = 0.99, eps = 1e-6, weight_decay = 0.1 }
    for k = 1, 5 do
      g.grads = { strided_grad(shp, "f32") }
      o.step = k
      ok(adamw_raw(g, o))
      ref_adamw(ref[1], vals(g.grads[1]), o, 1, u)
    end
    check_close(vals(g.params[1]), ref[1].p, ref[1].ep, "f32", "param")
    check_close(vals(g.m[1]), ref[1].m, ref[1].em, "f32", "exp_avg")
    check_close(vals(g.v[1]), ref[1].v, ref[1].ev, "f32", "exp_avg_sq")
  end)

  it("gives the same bits with lr and step as device scalars as with doubles (step rounded to nearest)", function()
    local base = adamw_group("bf16", "f32")
    fresh_grads(base)
    local lr_t, step_t = ms.tensor({ 0.01 }), ms.tensor({ 2.6 })   -- f32 device scalars
    local lr = lr_t:item()
    local function copy(g)
      local c = { params = {}, m = {}, v = {}, grads = g.grads, scales = g.scales }
      for i = 1, #g.params do c.params[i], c.m[i], c.v[i] = g.params[i]:clone(), g.m[i]:clone(), g.v[i]:clone() end
      return c
    end
    local a, b = copy(base), copy(base)
    ok(adamw_raw(a, { lr = lr, step = 3, weight_decay = 0.01, stochastic_round = true, seed = 5 }))
    ok(adamw_raw(b, { lr = -1, lr_t = lr_t, step = 0, step_t = step_t, weight_decay = 0.01,
                      stochastic_round = true, seed = 5 }))   -- the doubles are ignored (and not checked)
    -- every member's values, one array (a bf16 member's update is often below half its ulp: stochastic rounding
    -- can leave a small member's every element as it was, so "it changed" is asked of the whole group)
    local function all(list)
      local out = {}
      for _, t in ipairs(list) do for _, x in ipairs(vals(t)) do out[#out + 1] = x end end
      return out
    end
    for i = 1, #a.params do
      assert.is_true(same_bits(vals(a.params[i]), vals(b.params[i])))
      assert.is_true(same_bits(vals(a.m[i]), vals(b.m[i])))
      assert.is_true(same_bits(vals(a.v[i]), vals(b.v[i])))
    end
    assert.is_false(same_bits(all(a.params), all(base.params)))
    -- a new value in the scalar changes the next call's result without anything else changing
    local c = copy(base)
    lr_t:fill_(0.02)
    ok(adamw_raw(c, { lr_t = lr_t, step_t = step_t, weight_decay = 0.01, stochastic_round = true, seed = 5 }))
    assert.is_false(same_bits(all(c.params), all(a.params)))
  end)

  it("changes nothing, bit for bit, when skip_t is nonzero, and steps when it is zero", function()
    local g = adamw_group("f32", "bf16")
    fresh_grads(g)
    local all = {}
    for i = 1, #g.params do all[#all + 1] = g.params[i]; all[#all + 1] = g.m[i]; all[#all + 1] = g.v[i] end
    local snap = snapshot(all)
    ok(adamw_raw(g, { lr = 0.1, step = 4, weight_decay = 0.1, skip_t = ms.tensor({ 1 }) }))
    assert.are.equal(1, last_launches)   -- a skipped step is still one launch (the device decides)
    assert_unchanged(all, snap, "skip_t = 1")
    ok(adamw_raw(g, { lr = 0.1, step = 4, skip_t = ms.tensor({ NaN }) }))
    assert_unchanged(all, snap, "skip_t = NaN")
    ok(adamw_raw(g, { lr = 0.1, step = 4, skip_t = ms.tensor({ 0 }) }))
    assert.is_false(same_bits(vals(g.params[1]), snap[1]))
  end)

  it("treats a zero lr with no weight decay as no change to params but still moves the moments", function()
    local g = adamw_group("f32", "f32")
    fresh_grads(g)
    local p0, m0 = vals(g.params[2]), vals(g.m[2])
    ok(adamw_raw(g, { lr = 0, step = 2, weight_decay = 0.3 }))
    assert.is_true(same_bits(vals(g.params[2]), p0))
    assert.is_false(same_bits(vals(g.m[2]), m0))
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("stochastic rounding of bf16/f16 params", function()
  local N = 16384

  -- N identical elements (one random value p0, one grad g0) in `nmem` members; lr chosen so that the exact
  -- result lies a random fraction f in [0.25, 0.75] of the way between two neighbours of the grid
  local function setup(dt, p0_scale, sign, nmem)
    local p0 = sign * (p0_scale * (1 + 0.9 * ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()))
    p0 = ms.tensor({ p0 }, { dtype = dt }):item()
    local g0 = randn({ 1 }, "f32"):item()
    local m0 = randn({ 1 }, "f32", 0.1):item()
    local v0 = urand({ 1 }, "f32", 0.1, 1):item()
    local o = { beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, step = 1, bias_correction = false }
    -- the update direction r for lr = 1, then lr for a move of f spacings
    local st = { p = { 0 }, m = { m0 }, v = { v0 }, ep = { 0 }, em = { 0 }, ev = { 0 } }
    ref_adamw(st, { g0 }, { lr = 1, beta1 = o.beta1, beta2 = o.beta2, eps = o.eps, weight_decay = 0,
                            step = 1, bias_correction = false }, 1, units("f64"))
    local r = -st.p[1]
    local _, _, sp = grid(dt, p0)
    local f = 0.25 + 0.5 * ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()
    o.lr = f * sp / math.abs(r) * 0.999
    local x = p0 - o.lr * r
    local g = { params = {}, grads = {}, m = {}, v = {} }
    for i = 1, nmem or 1 do
      g.params[i] = ms.full({ N }, p0, { dtype = dt })
      g.grads[i] = ms.full({ N }, g0)
      g.m[i] = ms.full({ N }, m0)
      g.v[i] = ms.full({ N }, v0)
    end
    return g, o, x
  end

  local function fresh_copy(g)
    local c = { params = {}, grads = g.grads, m = {}, v = {} }
    for i = 1, #g.params do c.params[i], c.m[i], c.v[i] = g.params[i]:clone(), g.m[i]:clone(), g.v[i]:clone() end
    return c
  end

  for _, case in ipairs {
    { "bf16", 1, 1 }, { "bf16", 3, -1 }, { "f16", 1, 1 }, { "f16", 200, -1 }, { "f16", 3e-6, 1 },  -- f16 subnormal
  } do
    local dt, scale, sign = case[1], case[2], case[3]
    it(("%s (|p| ~ %g, %s): unbiased, always a neighbour, deterministic, new bits per step, seed and member")
       :format(dt, scale, sign > 0 and "positive" or "negative"), function()
      local g, o, x = setup(dt, scale, sign, 2)
      local lo, hi, sp = grid(dt, x)
      local pristine = fresh_copy(g)
      o.stochastic_round, o.seed = true, H.seed()
      ok(adamw_raw(g, o))
      local r1, r2 = vals(g.params[1]), vals(g.params[2])
      local sum, nhi = 0, 0
      for j = 1, N do
        local v = r1[j]
        assert(v == lo or v == hi, ("element %d: %.10g is not a neighbour (%.10g or %.10g) of %.10g"):format(j, v, lo, hi, x))
        sum = sum + v
        if v == hi then nhi = nhi + 1 end
      end
      local f = (math.abs(x) - math.abs(lo)) / sp
      local sigma = sp * math.sqrt(f * (1 - f) / N)
      assert(math.abs(sum / N - x) < 5 * sigma,
             ("mean %.10g is %.2f sigma from the exact %.10g"):format(sum / N, math.abs(sum / N - x) / sigma, x))
      assert(math.abs(nhi / N - f) < 5 * math.sqrt(f * (1 - f) / N))
      -- the other member draws other numbers (the member index is part of the counter)
      assert.is_false(same_bits(r1, r2))
      -- the same seed and step: the same bits
      local again = fresh_copy(pristine)
      ok(adamw_raw(again, o))
      assert.is_true(same_bits(vals(again.params[1]), r1))
      -- another step (same exact value without bias correction) or another seed: other bits
      local o2 = {}
      for k, v in pairs(o) do o2[k] = v end
      o2.step = 2
      local other = fresh_copy(pristine)
      ok(adamw_raw(other, o2))
      local diff = 0
      for j, v in ipairs(vals(other.params[1])) do if v ~= r1[j] then diff = diff + 1 end end
      assert(diff > N / 10, "only " .. diff .. " elements differ between steps 1 and 2")
      o2.step, o2.seed = 1, o.seed + 1
      local other_seed = fresh_copy(pristine)
      ok(adamw_raw(other_seed, o2))
      assert.is_false(same_bits(vals(other_seed.params[1]), r1))
      -- without stochastic rounding every element is the nearest neighbour
      local rne = fresh_copy(pristine)
      o2.stochastic_round = false
      ok(adamw_raw(rne, o2))
      local nearest = math.abs(x - lo) < math.abs(x - hi) and lo or hi
      for _, v in ipairs(vals(rne.params[1])) do assert.are.equal(nearest, v) end
    end)
  end

  it("keeps NaN and infinite params as they are (bf16 and f16)", function()
    for _, dt in ipairs { "bf16", "f16" } do
      local p = ms.tensor({ NaN, inf, -inf, 1.5 }, { dtype = dt })
      local g = { params = { p }, grads = { randn({ 4 }) }, buf = { randn({ 4 }) } }
      ok(sgd_raw(g, { lr = 0.01, momentum = 0.9, step = 2, stochastic_round = true, seed = H.seed() }))
      local got = vals(p)
      assert.is_true(got[1] ~= got[1])
      assert.are.same({ inf, -inf }, { got[2], got[3] })
      assert.is_true(math.abs(got[4] - 1.5) < 0.05)
    end
  end)

  it("applies to SGD too (unbiased mean, neighbours only) and leaves f32 params to exact rounding", function()
    local p0 = ms.tensor({ 1.0 + 0.9 * urand({ 1 }, "f64", 0, 1):item() }, { dtype = "bf16" }):item()
    local g0 = randn({ 1 }, "f32"):item()
    local _, _, sp = grid("bf16", p0)
    local lr = 0.37 * sp / math.abs(g0)
    local x = p0 - lr * g0
    local lo, hi = grid("bf16", x)
    local g = { params = { ms.full({ N }, p0, { dtype = "bf16" }), ms.full({ N }, p0) }, grads = { ms.full({ N }, g0), ms.full({ N }, g0) } }
    ok(sgd_raw(g, { lr = lr, step = 1, stochastic_round = true, seed = H.seed() }))
    local sum = 0
    for _, v in ipairs(vals(g.params[1])) do
      assert(v == lo or v == hi)
      sum = sum + v
    end
    local f = (math.abs(x) - math.abs(lo)) / sp
    assert(math.abs(sum / N - x) < 5 * sp * math.sqrt(f * (1 - f) / N))
    local want = ms.tensor({ x }, { dtype = "f32" }):item()
    for _, v in ipairs(vals(g.params[2])) do assert(math.abs(v - want) <= 3e-7 * math.abs(want)) end
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("ms_sgd_step (CPU)", function()
  local function sgd_group(pdt, sdt, with_buf)
    local g = { params = {}, buf = with_buf and {} or nil, scales = {}, shapes = SHAPES }
    for i, shp in ipairs(SHAPES) do
      g.params[i] = randn(shp, pdt)
      if with_buf then g.buf[i] = randn(shp, sdt) end   -- garbage that step 1 must overwrite
      g.scales[i] = 0.5 + ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()
    end
    return g
  end

  local variants = {
    { name = "plain", o = { lr = 0.05 } },
    { name = "weight decay", o = { lr = 0.05, weight_decay = 0.1 } },
    { name = "momentum", o = { lr = 0.02, momentum = 0.9 } },
    { name = "momentum + dampening + weight decay", o = { lr = 0.02, momentum = 0.8, dampening = 0.3, weight_decay = 0.05 } },
    { name = "nesterov", o = { lr = 0.02, momentum = 0.9, nesterov = true, weight_decay = 0.01 } },
  }
  for _, var in ipairs(variants) do
    for _, pdt in ipairs { "f32", "bf16", "f16", "f64" } do
      for _, sdt in ipairs { "f32", "bf16" } do
        local with_buf = (var.o.momentum or 0) ~= 0
        if with_buf or sdt == "f32" then
          it(("%s: %s params%s match the f64 reference over %d steps"):format(var.name, pdt,
             with_buf and (", " .. sdt .. " momentum") or "", STEPS), function()
            local g = sgd_group(pdt, sdt, with_buf)
            local ref, u = ref_state(g), units(pdt, sdt)
            local o = {}
            for k, v in pairs(var.o) do o[k] = v end
            for k = 1, STEPS do
              fresh_grads(g)
              o.step = k
              ok(sgd_raw(g, o))
              for i = 1, #g.params do
                local r = ref[i]
                ref_sgd(r, vals(g.grads[i]), o, g.scales[i], u)
                local what = ("%s, %s params, step %d, member %d"):format(var.name, pdt, k, i)
                check_close(vals(g.params[i]), r.p, r.ep, pdt, what .. " param")
                if with_buf then check_close(vals(g.buf[i]), r.b, r.eb, sdt, what .. " momentum_buf") end
              end
            end
          end)
        end
      end
    end
  end

  it("ignores momentum_buf entirely without momentum (NULL entries are fine)", function()
    local g = sgd_group("f32", "f32", false)
    fresh_grads(g)
    g.buf = { nil, nil, nil }
    local ref, u = ref_state(g), units("f32")
    ok(sgd_raw(g, { lr = 0.1, step = 3 }))
    for i = 1, 3 do
      ref_sgd(ref[i], vals(g.grads[i]), { lr = 0.1, step = 3 }, g.scales[i], u)
      check_close(vals(g.params[i]), ref[i].p, ref[i].ep, "f32", "member " .. i)
    end
  end)

  it("reads lr and step from device scalars (step 1 initialises the momentum) and obeys skip_t", function()
    local function group()
      local g = { params = { randn({ 5, 7 }) }, grads = { randn({ 5, 7 }) }, buf = { randn({ 5, 7 }) } }
      return g
    end
    local a = group()
    local b = { params = { a.params[1]:clone() }, grads = a.grads, buf = { a.buf[1]:clone() } }
    local lr_t = ms.tensor({ 0.03 })
    ok(sgd_raw(a, { lr = lr_t:item(), step = 1, momentum = 0.9 }))
    ok(sgd_raw(b, { lr_t = lr_t, step_t = ms.tensor({ 1.2 }), momentum = 0.9 }))
    assert.is_true(same_bits(vals(a.params[1]), vals(b.params[1])))
    assert.is_true(same_bits(vals(a.buf[1]), vals(b.buf[1])))
    assert.is_true(same_bits(vals(a.buf[1]), vals(a.grads[1])))   -- step 1: buf <- g exactly
    local snap = snapshot { a.params[1], a.buf[1] }
    ok(sgd_raw(a, { lr = 0.03, step = 2, momentum = 0.9, skip_t = ms.tensor({ -2 }) }))
    assert_unchanged({ a.params[1], a.buf[1] }, snap, "skip_t = -2")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("ms_foreach_sumsq / ms_foreach_scale (CPU)", function()
  it("matches the f64 sums for every dtype and layout, and ms_reduce bit for bit", function()
    local srcs = {
      randn({ 37 }, "f32"), randn({ 50, 30 }, "bf16"), strided_grad({ 40, 33 }, "f16"), randn({ 9, 7 }, "f64"),
      randn({ 70001 }, "f32"), strided_grad({ 120, 150 }, "f32"), ms.empty({ 0 }), randn({ 3, 1, 2 }, "f32", 100),
    }
    -- members whose last 2..7 elements (past a multiple of 8) go to lanes of their own: one member's bits match
    -- a wrong order of its tail by chance about half the time, two dozen of them almost never
    for k = 1, 24 do srcs[#srcs + 1] = randn({ (k % 3) * 8 + 2 + k % 6 }, k % 4 == 0 and "bf16" or "f32") end
    for _, dst_dt in ipairs { "f32", "f64" } do
      local got = sumsq(srcs, dst_dt)
      for i, s in ipairs(srcs) do
        local rt = (s:dtype() == "f64" and dst_dt == "f64") and 1e-12 or 2e-5
        H.assert_close(got[i], sumsq_ref(s), rt, 1e-6, ("%s dst, member %d (%s)"):format(dst_dt, i, s:dtype()))
        -- the fixed order of ms_reduce: the same bits
        local one = ms.empty({}, { dtype = s:dtype() == "f64" and "f64" or "f32" })
        ok(C.ms_reduce(CTX, T.handle(one), T.handle(s), C.MS_REDUCE_SUMSQ, C.MS_DIM_ALL))
        if s:dtype() == "f64" and dst_dt == "f32" then
          assert.are.equal(ms.tensor({ one:item() }, { dtype = "f32" }):item(), got[i])
        else
          assert.are.equal(one:item(), got[i])
        end
      end
    end
    -- the same result whatever the thread count (fixed chunks)
    local c1 = ms.context { device = "cpu", num_threads = 1 }
    local dst = ms.empty({ #srcs }, { ctx = c1 })
    ok(C.ms_foreach_sumsq(T.handle_ctx(c1), T.handle(dst), #srcs, sources(srcs)))
    assert.is_true(same_bits(vals(dst), sumsq(srcs)))
  end)

  it("propagates NaN and Inf to the member that holds them only", function()
    local a, b, c = randn({ 100 }), randn({ 5000 }), randn({ 7, 3 })
    b:slice(0, 4321, 4322):fill_(NaN)
    c:select(0, 2):select(0, 1):fill_(-inf)
    local got = sumsq { a, b, c }
    H.assert_close(got[1], sumsq_ref(a), 2e-5, 1e-6)
    assert.is_true(got[2] ~= got[2])
    assert.are.equal(inf, got[3])
  end)

  it("scales every tensor in place by a double or a device scalar, strided ones too", function()
    local base = randn({ 30, 40 })
    local list = { randn({ 17 }, "f32"), randn({ 8, 9 }, "bf16"), base:transpose(0, 1), randn({ 3000 }, "f16"), randn({ 4, 4 }, "f64") }
    local before = snapshot(list)
    local s_t = ms.tensor({ 1.5 })
    local n0 = launches()
    ok(C.ms_foreach_scale(CTX, #list, tensors(list), -0.75, nil))
    ok(C.ms_foreach_scale(CTX, #list, tensors(list), 99, T.handle(s_t)))   -- the double is ignored
    assert.are.equal(n0 + 2, launches())
    for i, t in ipairs(list) do
      H.assert_close(vals(t), H.map(before[i], function(x) return x * -0.75 * 1.5 end), H.tols(t:dtype(), 2))
    end
    H.assert_close(vals(base:transpose(0, 1)), vals(list[3]), 0, 0)
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("a 300-member group", function()
  local function shapes300()
    local out = {}
    for i = 1, 300 do
      local k = i % 5
      if k == 0 then out[i] = { i % 7 + 1 }
      elseif k == 1 then out[i] = { 3, i % 4 + 2 }
      elseif k == 2 then out[i] = { 2, 3, i % 3 + 1 }
      elseif k == 3 then out[i] = { 64, 3 }
      else out[i] = { 129 } end
    end
    return out
  end

  it("is updated by AdamW, SGD, foreach_sumsq and foreach_scale in one launch each", function()
    local shapes = shapes300()
    local g = adamw_group("f32", "f32", shapes)
    g.grads = {}
    for i, shp in ipairs(shapes) do g.grads[i] = i % 2 == 0 and strided_grad(shp, "f32") or randn(shp, "bf16") end
    local ref, u = ref_state(g), units("f32", "f32")
    local o = { lr = 0.01, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, weight_decay = 0.01, step = 3 }
    local n0 = launches()
    ok(adamw_raw(g, o))
    assert.are.equal(n0 + 1, launches())
    for i = 1, 300 do
      ref_adamw(ref[i], vals(g.grads[i]), o, g.scales[i], u)
      check_close(vals(g.params[i]), ref[i].p, ref[i].ep, "f32", "adamw member " .. i)
    end

    local s = { params = g.params, grads = g.grads, buf = g.m, scales = g.scales }
    local sref = ref_state(s)
    local so = { lr = 0.1, momentum = 0.5, step = 2 }
    n0 = launches()
    ok(sgd_raw(s, so))
    assert.are.equal(n0 + 1, launches())
    for i = 1, 300 do
      ref_sgd(sref[i], vals(g.grads[i]), so, g.scales[i], u)
      check_close(vals(g.params[i]), sref[i].p, sref[i].ep, "f32", "sgd member " .. i)
      check_close(vals(g.m[i]), sref[i].b, sref[i].eb, "f32", "sgd member " .. i .. " momentum_buf")
    end

    local dst = ms.empty({ 300 })
    local srcs = sources(g.params)
    n0 = launches()
    ok(C.ms_foreach_sumsq(CTX, T.handle(dst), 300, srcs))
    assert.are.equal(n0 + 1, launches())
    local sums = vals(dst)
    for i = 1, 300 do H.assert_close(sums[i], sumsq_ref(g.params[i]), 2e-5, 1e-6, "sumsq member " .. i) end
    n0 = launches()
    ok(C.ms_foreach_scale(CTX, 300, tensors(g.params), 0.5, nil))
    assert.are.equal(n0 + 1, launches())
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("validation", function()
  -- a valid 3-member AdamW group; each case breaks one thing, expects a status and words, and nothing changed
  local function fresh()
    local g = {
      params = { randn({ 4, 5 }), randn({ 6 }), randn({ 2, 3 }) },
      grads = { randn({ 4, 5 }), randn({ 6 }), randn({ 2, 3 }) },
      m = { randn({ 4, 5 }), randn({ 6 }), randn({ 2, 3 }) },
      v = { urand({ 4, 5 }, "f32", 0.1, 1), urand({ 6 }, "f32", 0.1, 1), urand({ 2, 3 }, "f32", 0.1, 1) },
      scales = { 1, 0.5, 2 },
    }
    g.all = {}
    for i = 1, 3 do for _, k in ipairs { "params", "grads", "m", "v" } do g.all[#g.all + 1] = g[k][i] end end
    return g
  end
  local O = { lr = 0.01, step = 2, weight_decay = 0.01 }

  local function expect(st, code, ...)
    local msg = ffi.string(C.ms_last_error())
    assert.are.equal(ffi.string(C.ms_status_name(code)), ffi.string(C.ms_status_name(st)), msg)
    for _, w in ipairs { ... } do
      assert(msg:find(w, 1, true), ("message %q lacks %q"):format(msg, w))
    end
  end

  local function with(o) local c = {} for k, v in pairs(O) do c[k] = v end for k, v in pairs(o) do c[k] = v end return c end

  local adamw_cases = {
    { "negative n", function(g) return adamw_raw(g, O, -1) end, "MS_E_ARG", "n = -1" },
    { "NULL params array", function(g) return C.ms_adamw_step(CTX, 3, nil, sources(g.grads), tensors(g.m), tensors(g.v), nil, adamw_opts(O)) end, "MS_E_ARG", "params is NULL" },
    { "NULL grads array", function(g) return C.ms_adamw_step(CTX, 3, tensors(g.params), nil, tensors(g.m), tensors(g.v), nil, adamw_opts(O)) end, "MS_E_ARG", "grads is NULL" },
    { "NULL exp_avg_sq array", function(g) return C.ms_adamw_step(CTX, 3, tensors(g.params), sources(g.grads), tensors(g.m), nil, nil, adamw_opts(O)) end, "MS_E_ARG", "exp_avg_sq is NULL" },
    { "NULL options", function(g) return C.ms_adamw_step(CTX, 3, tensors(g.params), sources(g.grads), tensors(g.m), tensors(g.v), nil, nil) end, "MS_E_ARG", "opts is NULL" },
    { "NULL ctx", function(g) return C.ms_adamw_step(nil, 3, tensors(g.params), sources(g.grads), tensors(g.m), tensors(g.v), nil, adamw_opts(O)) end, "MS_E_ARG", "ctx is NULL" },
    { "NULL member", function(g) g.params[3] = nil return adamw_raw(g, O, 3) end, "MS_E_ARG", "member 2 (param) is NULL" },
    { "NULL state member", function(g) g.m[2] = nil return adamw_raw(g, O, 3) end, "MS_E_ARG", "member 1 (exp_avg) is NULL" },
    { "i32 param", function(g) g.params[2] = ms.zeros({ 6 }, { dtype = "i32" }) return adamw_raw(g, O) end, "MS_E_DTYPE", "member 1 (param)", "i32" },
    { "u8 grad", function(g) g.grads[3] = ms.ones({ 2, 3 }, { dtype = "u8" }) return adamw_raw(g, O) end, "MS_E_DTYPE", "member 2 (grad)", "u8" },
    { "f16 state", function(g) g.m[1] = randn({ 4, 5 }, "f16") return adamw_raw(g, O) end, "MS_E_DTYPE", "member 0 (exp_avg)", "f32 or bf16" },
    { "mixed state dtypes", function(g) g.v[3] = urand({ 2, 3 }, "bf16", 0.1, 1) return adamw_raw(g, O) end, "MS_E_DTYPE", "member 2 (exp_avg_sq) has dtype bf16", "same dtype" },
    { "grad shape", function(g) g.grads[1] = randn({ 5, 4 }) return adamw_raw(g, O) end, "MS_E_SHAPE", "member 0 (grad): shape [5,4] != param shape [4,5]" },
    { "state shape", function(g) g.m[3] = randn({ 3, 2 }) return adamw_raw(g, O) end, "MS_E_SHAPE", "member 2 (exp_avg): shape [3,2] != param shape [2,3]" },
    { "strided param", function(g) g.params[1] = randn({ 5, 4 }):transpose(0, 1) return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 0 (param) is not contiguous" },
    { "strided state", function(g) g.v[2] = urand({ 12 }, "f32", 0.1, 1):slice(0, 0, 12, 2) return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 1 (exp_avg_sq) is not contiguous" },
    { "negative lr", function(g) return adamw_raw(g, with { lr = -0.1 }) end, "MS_E_ARG", "lr = -0.1" },
    { "NaN lr", function(g) return adamw_raw(g, with { lr = NaN }) end, "MS_E_ARG", "lr = " },
    { "infinite lr", function(g) return adamw_raw(g, with { lr = inf }) end, "MS_E_ARG", "lr = inf" },
    { "beta1 = 1", function(g) return adamw_raw(g, with { beta1 = 1 }) end, "MS_E_ARG", "beta1 = 1 is outside [0, 1)" },
    { "negative beta2", function(g) return adamw_raw(g, with { beta2 = -0.5 }) end, "MS_E_ARG", "beta2 = -0.5" },
    { "eps = 0", function(g) return adamw_raw(g, with { eps = 0 }) end, "MS_E_ARG", "eps = 0" },
    { "negative weight decay", function(g) return adamw_raw(g, with { weight_decay = -1e-3 }) end, "MS_E_ARG", "weight_decay = -0.001" },
    { "step 0", function(g) return adamw_raw(g, with { step = 0 }) end, "MS_E_ARG", "step = 0" },
    { "negative scale", function(g) g.scales[2] = -1 return adamw_raw(g, O) end, "MS_E_ARG", "scales[1] = -1" },
    { "NaN scale", function(g) g.scales[3] = NaN return adamw_raw(g, O) end, "MS_E_ARG", "scales[2]" },
    { "lr_t of two elements", function(g) return adamw_raw(g, with { lr_t = ms.tensor({ 1, 2 }) }) end, "MS_E_SHAPE", "lr_t must hold exactly one element" },
    { "i32 step_t", function(g) return adamw_raw(g, with { step_t = ms.ones({ 1 }, { dtype = "i32" }) }) end, "MS_E_DTYPE", "step_t" },
    { "empty skip_t", function(g) return adamw_raw(g, with { skip_t = ms.empty({ 0 }) }) end, "MS_E_SHAPE", "skip_t" },
    { "a param twice", function(g) g.params[3] = g.params[1] g.grads[3], g.m[3], g.v[3] = g.grads[1], g.m[1], g.v[1] return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 0 (param) and member 2 (param) share memory" },
    { "grad aliasing its param", function(g) g.grads[2] = g.params[2] return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 1 (param) and member 1 (grad)" },
    { "exp_avg = exp_avg_sq", function(g) g.v[1] = g.m[1] return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 0 (exp_avg) and member 0 (exp_avg_sq)" },
    { "overlapping views of one storage", function(g)
        local big = randn({ 40 })
        g.params[1] = big:slice(0, 0, 20):view(4, 5)
        g.m[3] = big:slice(0, 18, 24):view(2, 3)
        return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 0 (param) and member 2 (exp_avg) share memory" },
    { "a grad of another member overlapping a param", function(g) g.grads[2] = g.params[3]:view(6) return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 1 (grad) and member 2 (param)" },
    { "lr_t inside a param", function(g) return adamw_raw(g, with { lr_t = g.params[2]:slice(0, 3, 4) }) end, "MS_E_LAYOUT", "member 1 (param) and lr_t share memory" },
    { "two wraps of the same foreign memory", function(g)
        local buf = ffi.new("float[?]", 40)
        for i = 0, 39 do buf[i] = i + 1 end
        g.keep = buf
        local function wrap(off, shape)
          local sh = ffi.new("int64_t[2]", shape)
          ok(C.ms_tensor_wrap(CTX, buf + off, C.MS_DTYPE_F32, 2, sh, nil, core.out_tensor))
          return T.wrap(core.out_tensor[0], cpu)
        end
        g.params[1] = wrap(0, { 4, 5 })
        g.v[1] = wrap(19, { 4, 5 })
        return adamw_raw(g, O) end, "MS_E_LAYOUT", "member 0 (param) and member 0 (exp_avg_sq) share memory" },
  }
  for _, case in ipairs(adamw_cases) do
    it("ms_adamw_step refuses " .. case[1] .. " (" .. case[3] .. ") and changes nothing", function()
      local g = fresh()
      local snap = snapshot(g.all)
      local n0 = launches()
      last_launches = nil
      expect(case[2](g), C[case[3]], select(4, unpack(case)))
      assert.are.equal(0, last_launches or launches() - n0)
      assert_unchanged(g.all, snap, case[1])
    end)
  end

  it("finds one shared param among 1100 members (beyond the ordered search) and names it", function()
    local g = { params = {}, grads = {}, m = {}, v = {} }
    for i = 1, 1100 do
      g.params[i], g.grads[i], g.m[i], g.v[i] = randn({ 3 }), randn({ 3 }), randn({ 3 }), urand({ 3 }, "f32", 0.1, 1)
    end
    g.params[1001] = g.params[701]
    local snap = snapshot(g.params)
    expect(adamw_raw(g, O), C.MS_E_LAYOUT, "member 700 (param) and member 1000 (param) share memory")
    assert.are.equal(0, last_launches)
    assert_unchanged(g.params, snap, "1100 members")
    g.params[1001] = randn({ 3 })
    ok(adamw_raw(g, O))
    assert.are.equal(1, last_launches)
  end)

  it("accepts grads shared between members, expanded grads, empty members, a bad lr double beside lr_t, n = 0", function()
    local g = fresh()
    local shared = randn({ 6 })
    g.grads[2] = shared
    g.params[4], g.grads[4], g.m[4], g.v[4], g.scales[4] = randn({ 6 }), shared, randn({ 6 }), urand({ 6 }, "f32", 0.1, 1), 1
    g.grads[1] = randn({ 1, 5 }):expand(4, 5)
    g.params[5], g.grads[5], g.m[5], g.v[5], g.scales[5] = ms.empty({ 0, 3 }), ms.empty({ 0, 3 }), ms.empty({ 0, 3 }),
                                                           ms.empty({ 0, 3 }), 1
    local ref, u = ref_state(g), units("f32")
    ok(adamw_raw(g, with { lr = -5, lr_t = ms.tensor({ 0.01 }) }))
    for i = 1, 4 do
      ref_adamw(ref[i], vals(g.grads[i]), { lr = ms.tensor({ 0.01 }):item(), beta1 = 0.9, beta2 = 0.999, eps = 1e-8,
                                            weight_decay = O.weight_decay, step = O.step }, g.scales[i], u)
      check_close(vals(g.params[i]), ref[i].p, ref[i].ep, "f32", "member " .. i)
    end
    ok(C.ms_adamw_step(CTX, 0, nil, nil, nil, nil, nil, adamw_opts(O)))
    ok(C.ms_sgd_step(CTX, 0, nil, nil, nil, nil, sgd_opts(O)))
    ok(C.ms_foreach_scale(CTX, 0, nil, 2, nil))
    ok(C.ms_foreach_sumsq(CTX, T.handle(ms.empty({ 0 })), 0, nil))
  end)

  local function sgd_fresh()
    local g = fresh()
    g.buf = g.m
    return g
  end
  local sgd_cases = {
    { "negative momentum", { momentum = -0.5 }, nil, "MS_E_ARG", "momentum = -0.5" },
    { "nesterov without momentum", { nesterov = true }, nil, "MS_E_ARG", "nesterov needs momentum > 0 and dampening == 0" },
    { "nesterov with dampening", { nesterov = true, momentum = 0.9, dampening = 0.1 }, nil, "MS_E_ARG", "dampening 0.1" },
    { "NaN dampening", { momentum = 0.9, dampening = NaN }, nil, "MS_E_ARG", "dampening = " },
    { "negative weight decay", { weight_decay = -1 }, nil, "MS_E_ARG", "weight_decay = -1" },
    { "no momentum buffers with momentum", { momentum = 0.9 }, function(g) g.buf = nil end, "MS_E_ARG", "momentum_buf is NULL" },
    { "a NULL momentum buffer", { momentum = 0.9 }, function(g) g.buf = { g.m[1], nil, g.m[3] } end, "MS_E_ARG", "member 1 (momentum_buf) is NULL" },
    { "f64 momentum buffer", { momentum = 0.9 }, function(g) g.buf = { g.m[1], g.m[2], randn({ 2, 3 }, "f64") } end, "MS_E_DTYPE", "member 2 (momentum_buf) has dtype f64" },
    { "momentum buffer shape", { momentum = 0.9 }, function(g) g.buf = { g.m[1], randn({ 7 }), g.m[3] } end, "MS_E_SHAPE", "member 1 (momentum_buf): shape [7] != param shape [6]" },
    { "momentum buffer = param", { momentum = 0.9 }, function(g) g.buf = { g.m[1], g.params[2], g.m[3] } end, "MS_E_LAYOUT", "member 1 (param) and member 1 (momentum_buf)" },
    { "lr NaN", { lr = NaN }, nil, "MS_E_ARG", "lr = " },
  }
  for _, case in ipairs(sgd_cases) do
    it("ms_sgd_step refuses " .. case[1] .. " (" .. case[4] .. ") and changes nothing", function()
      local g = sgd_fresh()
      if case[3] then case[3](g) end
      local snap = snapshot(g.all)
      local n = case[1]:find("NULL momentum") and 3 or nil
      expect(sgd_raw(g, with(case[2]), n), C[case[4]], case[5])
      assert.are.equal(0, last_launches)
      assert_unchanged(g.all, snap, case[1])
    end)
  end

  it("ms_foreach_sumsq refuses bad dst and sources, changing nothing", function()
    local srcs = { randn({ 3 }), randn({ 4, 2 }) }
    local dst = ms.full({ 2 }, 7)
    local function call(d, s, n) return C.ms_foreach_sumsq(CTX, d and T.handle(d) or nil, n or #s, sources(s, n or #s)) end
    expect(call(ms.empty({ 2 }, { dtype = "i32" }), srcs), C.MS_E_DTYPE, "dst has dtype i32")
    expect(call(ms.empty({ 2 }, { dtype = "bf16" }), srcs), C.MS_E_DTYPE, "f32 or f64")
    expect(call(ms.empty({ 3 }), srcs), C.MS_E_SHAPE, "dst has shape [3]", "[2]")
    expect(call(ms.empty({ 4 }):slice(0, 0, 4, 2), srcs), C.MS_E_LAYOUT, "dst is not contiguous")
    expect(call(nil, srcs), C.MS_E_ARG, "dst is NULL")
    expect(call(dst, { srcs[1], nil }, 2), C.MS_E_ARG, "member 1 (src) is NULL")
    expect(call(dst, { srcs[1], ms.ones({ 2 }, { dtype = "i32" }) }), C.MS_E_DTYPE, "member 1 (src) has dtype i32")
    expect(call(dst, { srcs[1], dst }), C.MS_E_LAYOUT, "dst and member 1 (src) share memory")
    expect(C.ms_foreach_sumsq(CTX, T.handle(dst), -3, nil), C.MS_E_ARG, "n = -3")
    expect(C.ms_foreach_sumsq(CTX, T.handle(dst), 2, nil), C.MS_E_ARG, "srcs is NULL")
    assert.is_true(same_bits(vals(dst), { 7, 7 }))
    ok(call(dst, { srcs[1], srcs[1] }))   -- sources may repeat
  end)

  it("ms_foreach_scale refuses bad tensors and scalars, changing nothing", function()
    local a, b = randn({ 3 }), randn({ 2, 2 })
    local snap = snapshot { a, b }
    local function call(list, s_t, n) return C.ms_foreach_scale(CTX, n or #list, tensors(list, n or #list), 2, s_t and T.handle(s_t) or nil) end
    expect(call { a, ms.ones({ 2 }, { dtype = "i32" }) }, C.MS_E_DTYPE, "member 1 (tensor) has dtype i32")
    expect(call { a, randn({ 1, 4 }):expand(3, 4) }, C.MS_E_LAYOUT, "member 1 (tensor)", "expanded view")
    expect(call { a, b, a }, C.MS_E_LAYOUT, "member 0 (tensor) and member 2 (tensor) share memory")
    expect(call({ a, b }, ms.tensor({ 1, 2 })), C.MS_E_SHAPE, "s_t must hold exactly one element")
    expect(call({ a, b }, b:view(4):slice(0, 1, 2)), C.MS_E_LAYOUT, "s_t")
    expect(call({ a, nil }, nil, 2), C.MS_E_ARG, "member 1 (tensor) is NULL")
    expect(C.ms_foreach_scale(CTX, 2, nil, 2, nil), C.MS_E_ARG, "tensors is NULL")
    assert_unchanged({ a, b }, snap, "foreach_scale")
  end)

  local cuda_it = H.has_cuda and it or function(name) pending(name .. " (no CUDA device)") end
  cuda_it("refuses members on another device (MS_E_DEVICE), naming them", function()
    local g = fresh()
    g.grads[2] = randn({ 6 }):to("cuda")
    local snap = snapshot(g.all)
    expect(adamw_raw(g, O), C.MS_E_DEVICE, "member 1 (grad) is on cuda")
    assert_unchanged(g.all, snap, "device")
  end)
end)

describe("ms.adamw_step and friends: argument tables (moonstep.fused)", function()
  local function members(n)
    local p, g, m, v = {}, {}, {}, {}
    for i = 1, n do
      p[i], g[i], m[i], v[i] = ms.ones({ 3 }), ms.ones({ 3 }), ms.zeros({ 3 }), ms.zeros({ 3 })
    end
    return p, g, m, v
  end
  local function values(ts)
    local out = {}
    for i, t in ipairs(ts) do out[i] = t:tolist_flat() end
    return out
  end

  it("refuse a misspelt argument, naming it, rather than leave its default in force", function()
    local p, g, m, v = members(2)
    local before = values(p)
    H.expect_error(function()
      ms.adamw_step { params = p, grads = g, exp_avg = m, exp_avg_sq = v, lr = 0.1, weight_decy = 0.1 }
    end, "adamw_step", "unknown argument 'weight_decy'")
    H.expect_error(function() ms.sgd_step { params = p, grads = g, lr = 0.1, momentun = 0.9 } end,
                   "sgd_step", "'momentun'")
    -- sinkgd_step has no per-member steps: taking them would silently step every member at step 1
    H.expect_error(function()
      ms.sinkgd_step { params = { ms.ones({ 3, 3 }) }, grads = { ms.ones({ 3, 3 }) }, steps = { 2 } }
    end, "sinkgd_step", "'steps'")
    H.expect_error(function() ms.adamw_step { params = p, grads = g, exp_avg = m, exp_avg_sq = v, block_size = 256 } end,
                   "'block_size'")
    assert.same(before, values(p))
  end)

  it("name a mistyped lr, step, scales or params", function()
    local p, g, m, v = members(2)
    H.expect_error(function() ms.adamw_step { params = p, grads = g, exp_avg = m, exp_avg_sq = v, lr = "0.1" } end,
                   "lr must be a number or a one-element device tensor")
    H.expect_error(function() ms.sgd_step { params = p, grads = g, step = {} } end, "step must be an integer >= 1")
    H.expect_error(function() ms.sgd_step { params = p, grads = g, scales = 2 } end, "scales must be an array")
    H.expect_error(function() ms.sgd_step { grads = g } end, "sgd_step: params must be an array of tensors")
  end)

  it("with per-member steps, check every member before the first of the calls runs", function()
    local p, g, m, v = members(3)
    local before = values(p)
    -- members 2 and 3 share a step: without the check up front, member 1 was stepped before the second call
    -- refused its short exp_avg (and said "1 entries, 2 expected")
    H.expect_error(function()
      ms.adamw_step { params = p, grads = g, exp_avg = { m[1], m[2] }, exp_avg_sq = v, lr = 0.1, steps = { 1, 2, 2 } }
    end, "exp_avg has 2 entries, 3 expected")
    H.expect_error(function()
      ms.adamw_step { params = p, grads = { g[1], g[2], 5 }, exp_avg = m, exp_avg_sq = v, lr = 0.1, steps = { 1, 2, 2 } }
    end, "grads[3] must be a tensor")
    H.expect_error(function()
      ms.sgd_step { params = p, grads = g, scales = { 1, 1 }, lr = 0.1, steps = { 1, 2, 2 } }
    end, "scales has 2 entries, 3 expected")
    assert.same(before, values(p))
  end)

  it("with per-member steps, let the engine refuse a member or a step before any member changes", function()
    local p, g, m, v = members(3)
    local before, m_before = values(p), values(m)
    -- the engine's own checks (shape, overlap, step) refuse a later call's member: the earlier calls' members
    -- (member 1, at step 1) must not have moved
    local short = ms.ones({ 2 })
    H.expect_error(function()
      ms.adamw_step { params = p, grads = { g[1], g[2], short }, exp_avg = m, exp_avg_sq = v, lr = 0.1, steps = { 1, 2, 2 } }
    end, "ms_adamw_step", "shape")
    -- the same tensor as member 1's param and member 3's: one call refuses the overlap, two calls would step it twice
    H.expect_error(function()
      ms.sgd_step { params = { p[1], p[2], p[1] }, grads = g, lr = 0.1, steps = { 1, 2, 2 } }
    end, "ms_sgd_step")
    H.expect_error(function()
      ms.sgd_step { params = p, grads = g, lr = 0.1, steps = { 1, 2, 0 } }
    end, "steps[3] must be an integer >= 1")
    assert.same(before, values(p))
    assert.same(m_before, values(m))
    -- and a good split call still steps every member, each at its own step
    ms.adamw_step { params = p, grads = g, exp_avg = m, exp_avg_sq = v, lr = 0.1, steps = { 1, 2, 2 } }
    for i = 1, 3 do assert.is_true(p[i]:tolist_flat()[1] < 1) end
  end)
end)
