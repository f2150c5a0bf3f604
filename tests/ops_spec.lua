-- The CPU backend's elementwise ops, casts, fills, reductions and dot, each checked against its f64
-- formula computed here in Lua from the inputs' exact values (read back with totable), with fresh random
-- inputs per run, every float dtype, broadcasting, strided and in-place operands, NaN and empty cases.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local C = core.C

local NaN, inf = 0 / 0, math.huge
local FLOATS = { "f32", "f64", "bf16", "f16" }

-- ---------------------------------------------------------------------------------------------------
-- local helpers
-- ---------------------------------------------------------------------------------------------------
local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- nested table of `shape` from a flat row-major array
local function nest(flat, shape)
  if #shape == 0 then return flat[1] end
  local pos = 0
  local function build(d)
    local out = {}
    for i = 1, shape[d] do
      if d == #shape then pos = pos + 1 out[i] = flat[pos] else out[i] = build(d + 1) end
    end
    return out
  end
  return build(1)
end

-- fresh inputs: normal (scaled) or uniform on [lo, hi), drawn directly in the dtype
local function randn(shape, dt, std)
  return ms.randn(shape, { dtype = dt or "f32", seed = H.seed(), std = std or 1 })
end
local function urand(shape, dt, lo, hi)
  return ms.rand(shape, { dtype = dt or "f32", seed = H.seed(), low = lo, high = hi })
end

-- an operand for the reference: its exact values and shape, or a plain number
local function val(t)
  if type(t) == "number" then return t end
  return { vals = t:tolist_flat(), shape = t:shape() }
end

-- fn applied elementwise to inputs broadcast to out_shape: the f64 reference, flat row-major
local function ref_map(out_shape, fn, ...)
  local ins = { ... }
  local nd, n = #out_shape, numel(out_shape)
  local idx, res = {}, {}
  for d = 1, nd do idx[d] = 0 end
  local args = {}
  for i = 1, n do
    for k, inp in ipairs(ins) do
      if type(inp) == "number" then
        args[k] = inp
      else
        local sh, off = inp.shape, 0
        local lead = nd - #sh
        for d = 1, #sh do off = off * sh[d] + (sh[d] == 1 and 0 or idx[lead + d]) end
        args[k] = inp.vals[off + 1]
      end
    end
    res[i] = fn(unpack(args, 1, #ins))
    for d = nd, 1, -1 do
      idx[d] = idx[d] + 1
      if idx[d] < out_shape[d] then break end
      idx[d] = 0
    end
  end
  return res
end

local function bitwise_equal(a, b, what)
  assert.equals(#a, #b, what)
  for i = 1, #a do
    if not (a[i] == b[i] or (a[i] ~= a[i] and b[i] ~= b[i])) then
      error(("%s: element %d differs: %.17g vs %.17g"):format(what, i, a[i], b[i]), 2)
    end
  end
end

-- low-level calls for forms the Lua surface does not offer (explicit dst of another dtype or layout)
local function ctxh(t) return T.handle_ctx(t:context()) end
local function h(t) return T.handle(t) end
local function ok(st) core.check(st, 2) end

-- round-to-nearest-even of x to a float format (p significand bits, smallest normal 2^emin), in Lua
local FMT = { f32 = { 24, -126, (2 - 2 ^ -23) * 2 ^ 127 }, bf16 = { 8, -126, (2 - 2 ^ -7) * 2 ^ 127 },
              f16 = { 11, -14, 65504 } }
local function round_fp(x, dt)
  if dt == "f64" or x ~= x or x == inf or x == -inf or x == 0 then return x end
  local p, emin, maxv = FMT[dt][1], FMT[dt][2], FMT[dt][3]
  local _, e = math.frexp(x)                      -- |x| in [2^(e-1), 2^e)
  local ulp = 2 ^ (math.max(e - 1, emin) - (p - 1))
  local r = x / ulp
  local f = math.floor(r)
  local diff = r - f
  if diff > 0.5 or (diff == 0.5 and f % 2 == 1) then f = f + 1 end
  local y = f * ulp
  if math.abs(y) > maxv then y = y > 0 and inf or -inf end
  return y
end

-- the documented casts: floats round once through f32 (f64 sources too), integers truncate and saturate
local function cast(x, dt)
  if dt == "f64" then return x end
  if dt == "i32" or dt == "u8" then
    if x ~= x then return 0 end
    local lo, hi = dt == "i32" and -2147483648 or 0, dt == "i32" and 2147483647 or 255
    if x >= hi then return hi end
    if x <= lo then return lo end
    return x >= 0 and math.floor(x) or math.ceil(x)
  end
  return round_fp(round_fp(x, "f32"), dt)
end

local function check_op(got, want, what)
  local dt = got:dtype()
  if FMT[dt] then   -- results past the dtype's range are stored as infinities
    for i = 1, #want do
      if math.abs(want[i]) > FMT[dt][3] then want[i] = round_fp(want[i], dt) end
    end
  end
  H.assert_close(got:tolist_flat(), want, H.tol[dt].rtol, H.tol[dt].atol, what .. " (" .. dt .. ")")
end

-- ---------------------------------------------------------------------------------------------------
-- unary
-- ---------------------------------------------------------------------------------------------------
local function sign(x) return x > 0 and 1 or (x < 0 and -1 or x) end
local UNARY = {
  neg = function(x) return -x end, abs = math.abs, sqrt = math.sqrt,
  rsqrt = function(x) return 1 / math.sqrt(x) end, exp = math.exp, log = math.log, sign = sign,
  square = function(x) return x * x end, reciprocal = function(x) return 1 / x end, tanh = math.tanh,
  sigmoid = function(x) return 1 / (1 + math.exp(-x)) end,
  relu = function(x) return (x > 0 or x ~= x) and x or 0 end, sin = math.sin, cos = math.cos,
}
local POSITIVE = { sqrt = true, rsqrt = true, log = true, reciprocal = true }
local function unary_input(op, shape, dt)
  if POSITIVE[op] then return urand(shape, dt, 0.25, 4) end
  return randn(shape, dt, 2)
end

describe("cpu unary ops", function()
  it("match their f64 formulas in every float dtype, out of place and in place", function()
    for _, dt in ipairs(FLOATS) do
      for op, fn in pairs(UNARY) do
        local x = unary_input(op, { 3, 37 }, dt)
        local want = ref_map({ 3, 37 }, fn, val(x))
        check_op(x[op](x), want, op)
        local y = x:clone()
        y[op .. "_"](y)
        check_op(y, want, op .. "_")
      end
    end
  end)

  it("read strided sources and write strided destinations", function()
    for _, dt in ipairs { "f32", "bf16" } do
      for op, fn in pairs(UNARY) do
        local base = unary_input(op, { 37, 3 }, dt)
        local x = base:t()                                   -- [3, 37], not contiguous
        local want = ref_map({ 3, 37 }, fn, val(x))
        check_op(x[op](x), want, op .. " of a transposed view")
        x[op .. "_"](x)                                      -- in place through the view
        check_op(x, want, op .. "_ on a transposed view")
        local s = unary_input(op, { 4, 20 }, dt):slice(1, 1, 19, 3)   -- [4, 6] with step 3
        check_op(s[op](s), ref_map({ 4, 6 }, fn, val(s)), op .. " of a stepped slice")
      end
    end
  end)

  it("cast between dtypes when dst and src differ", function()
    for _, pair in ipairs { { "bf16", "f32" }, { "f32", "f16" }, { "f64", "bf16" }, { "f16", "f64" } } do
      local x = randn({ 5, 9 }, pair[1], 2)
      local dst = ms.empty({ 5, 9 }, { dtype = pair[2] })
      ok(C.ms_unary(ctxh(x), h(dst), h(x), C.MS_UNARY_TANH))
      check_op(dst, ref_map({ 5, 9 }, math.tanh, val(x)), "tanh " .. pair[1] .. " -> " .. pair[2])
    end
  end)

  it("run the parallel paths on large tensors", function()
    for _, dt in ipairs { "f32", "f64", "bf16" } do
      for _, op in ipairs { "exp", "sigmoid", "sqrt", "neg" } do
        local x = unary_input(op, { 256, 300 }, dt)
        check_op(x[op](x), ref_map({ 256, 300 }, UNARY[op], val(x)), op .. " large")
        local v = x:t()
        check_op(v[op](v), ref_map({ 300, 256 }, UNARY[op], val(v)), op .. " large transposed")
      end
    end
  end)

  it("handle NaN, infinities and the stable ends of sigmoid", function()
    local special = { NaN, inf, -inf, 0, -1000, 1000 }
    for _, dt in ipairs(FLOATS) do
      local x = ms.tensor(special, { dtype = dt })
      local sx = val(x)
      for _, op in ipairs { "neg", "abs", "sign", "square", "tanh", "sigmoid", "relu", "exp" } do
        check_op(x[op](x), ref_map({ #special }, UNARY[op], sx), op .. " of specials")
      end
      assert.same({ 0, 1, 0, 1 }, ms.tensor({ -1000, 1000, -inf, inf }, { dtype = dt }):sigmoid():totable())
      -- the far negative end, where exp(-x) overflows the compute type but sigmoid(x) = exp(x) / (1 + exp(x))
      -- is still a (subnormal) number: 1 / (1 + exp(-x)) would give 0 there
      local far = ({ f32 = -90, bf16 = -90, f64 = -720 })[dt]
      if far then
        local xf = far + 0.5 * ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item()
        xf = ms.tensor({ xf }, { dtype = dt }):item()
        local got, want = ms.tensor({ xf }, { dtype = dt }):sigmoid():item(), math.exp(xf)
        -- bf16 keeps 8 bits, and there only multiples of its smallest subnormal, 2^-133
        local tol = dt == "bf16" and 2 ^ -8 * want + 2 ^ -134 or 4e-6 * want   -- f32 at -90: subnormal, ~2^-20 apart
        assert(got > 0 and math.abs(got - want) <= tol,
               ("%s: sigmoid(%.17g) = %.17g, want %.17g"):format(dt, xf, got, want))
      end
      local r = ms.tensor({ NaN, -1, 2 }, { dtype = dt }):relu():totable()
      assert.is_true(r[1] ~= r[1], "relu(NaN) is NaN")
      local sg = ms.tensor({ NaN }, { dtype = dt }):sign():totable()
      assert.is_true(sg[1] ~= sg[1], "sign(NaN) is NaN")
    end
  end)

  it("work on 0-dim and empty tensors", function()
    assert.equals(math.exp(1.5), ms.tensor(1.5, { dtype = "f64" }):exp():item())
    local e = ms.empty({ 0, 3 }):exp()
    assert.same({ 0, 3 }, e:shape())
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- binary and scalar ops
-- ---------------------------------------------------------------------------------------------------
local function b2n(c) return c and 1 or 0 end
local function nanmax(a, b) if a ~= a or b ~= b then return NaN end return math.max(a, b) end
local function nanmin(a, b) if a ~= a or b ~= b then return NaN end return math.min(a, b) end
local BINARY = {
  add = function(a, b) return a + b end, sub = function(a, b) return a - b end,
  mul = function(a, b) return a * b end, div = function(a, b) return a / b end,
  pow = function(a, b) return a ^ b end, maximum = nanmax, minimum = nanmin,
  eq = function(a, b) return b2n(a == b) end, ne = function(a, b) return b2n(a ~= b) end,
  lt = function(a, b) return b2n(a < b) end, le = function(a, b) return b2n(a <= b) end,
  gt = function(a, b) return b2n(a > b) end, ge = function(a, b) return b2n(a >= b) end,
}
local COMPARE = { eq = true, ne = true, lt = true, le = true, gt = true, ge = true }

-- operands suited to the op: positive bases for pow, denominators away from zero, ties for comparisons
local function binary_inputs(op, sa, sb, dta, dtb)
  if op == "pow" then return urand(sa, dta, 0.5, 2), randn(sb, dtb, 1.5) end
  if op == "div" then return randn(sa, dta), urand(sb, dtb, 0.5, 2) end
  if COMPARE[op] then   -- small integers: many equal pairs
    local function ints(shape, dt)
      local flat = randn(shape, "f64", 1.5):tolist_flat()
      for i = 1, #flat do flat[i] = math.floor(flat[i]) end
      return ms.tensor(nest(flat, shape), { dtype = dt })
    end
    return ints(sa, dta), ints(sb, dtb)
  end
  return randn(sa, dta), randn(sb, dtb)
end

local BROADCASTS = {
  { { 4, 1, 5 }, { 3, 1 }, { 4, 3, 5 } },
  { {}, { 3, 4 }, { 3, 4 } },
  { { 5 }, { 2, 5 }, { 2, 5 } },
  { { 2, 3 }, { 2, 3 }, { 2, 3 } },
  { { 1 }, { 1 }, { 1 } },
}

describe("cpu binary ops", function()
  it("match their f64 formulas with broadcasting in every float dtype", function()
    for _, dt in ipairs(FLOATS) do
      for op, fn in pairs(BINARY) do
        for _, case in ipairs(BROADCASTS) do
          local a, b = binary_inputs(op, case[1], case[2], dt, dt)
          local got = a[op](a, b)
          assert.same(case[3], got:shape())
          check_op(got, ref_map(case[3], fn, val(a), val(b)), op .. " " .. table.concat(case[1], "x") ..
                   " with " .. table.concat(case[2], "x"))
        end
      end
    end
  end)

  it("mix dtypes (the result computed in f64 when f64 or i32 is involved)", function()
    local pairs_ = { { "f32", "bf16" }, { "f64", "f16" }, { "bf16", "f16" }, { "f32", "f64" }, { "i32", "f32" } }
    for _, p in ipairs(pairs_) do
      for _, op in ipairs { "add", "mul", "div", "maximum" } do
        local a, b
        if p[1] == "i32" then
          a = ms.tensor({ { 3, -7, 100000001 }, { 5, 1, -2 } }, { dtype = "i32" })
          b = urand({ 2, 3 }, p[2], 0.5, 2)
        else
          a, b = binary_inputs(op, { 2, 3 }, { 3 }, p[1], p[2])
        end
        check_op(a[op](a, b), ref_map({ 2, 3 }, BINARY[op], val(a), val(b)), op .. " " .. p[1] .. "," .. p[2])
      end
    end
    -- an i32 operand makes the op wide: 100000001 + 0.5 is exact in f64 and stored as f64
    local a = ms.tensor({ 100000001 }, { dtype = "i32" })
    local b = ms.tensor({ 0.5 }, { dtype = "f64" })
    assert.equals(100000001.5, (a + b):item())
  end)

  it("read transposed and stepped operands and write in place through views", function()
    for _, dt in ipairs { "f32", "f16" } do
      for _, op in ipairs { "add", "sub", "mul", "div", "maximum", "lt" } do
        local a0, b = binary_inputs(op, { 3, 2 }, { 2, 3 }, dt, dt)
        local a = a0:t()
        check_op(a[op](a, b), ref_map({ 2, 3 }, BINARY[op], val(a), val(b)), op .. " transposed a")
        local s, bb = binary_inputs(op, { 4, 10 }, { 4, 4 }, dt, dt)
        s = s:slice(1, 1, 9, 2)
        check_op(s[op](s, bb), ref_map({ 4, 4 }, BINARY[op], val(s), val(bb)), op .. " stepped a")
        local want = ref_map({ 2, 3 }, BINARY[op], val(a), val(b))
        a[op .. "_"](a, b)
        check_op(a, want, op .. "_ into a transposed view")
      end
    end
  end)

  it("runs in place with dst the same view as the second operand, and with a broadcast source", function()
    local a, b = randn({ 4, 6 }), randn({ 4, 6 })
    local want = ref_map({ 4, 6 }, BINARY.sub, val(a), val(b))
    ms.sub(a, b, b)
    check_op(b, want, "sub into b")
    local x, row = randn({ 5, 8 }, "bf16"), randn({ 8 }, "bf16")
    local want2 = ref_map({ 5, 8 }, BINARY.mul, val(x), val(row))
    x:mul_(row)
    check_op(x, want2, "mul_ with a broadcast row")
  end)

  it("takes scalars on either side", function()
    for _, dt in ipairs(FLOATS) do
      local x = randn({ 4, 5 }, dt)
      local px = urand({ 4, 5 }, dt, 0.5, 2)
      local v = val(x)
      check_op(x + 2.5, ref_map({ 4, 5 }, function(a) return a + 2.5 end, v), "x + s")
      check_op(2.5 - x, ref_map({ 4, 5 }, function(a) return 2.5 - a end, v), "s - x")
      check_op(x / 3, ref_map({ 4, 5 }, function(a) return a / 3 end, v), "x / s")
      check_op(3 / px, ref_map({ 4, 5 }, function(a) return 3 / a end, val(px)), "s / x")
      check_op(px ^ 2.5, ref_map({ 4, 5 }, function(a) return a ^ 2.5 end, val(px)), "x ^ s")
      check_op(2 ^ x, ref_map({ 4, 5 }, function(a) return 2 ^ a end, v), "s ^ x")
      check_op(ms.maximum(x, 0.25), ref_map({ 4, 5 }, function(a) return nanmax(a, 0.25) end, v), "maximum(x, s)")
      check_op(x:gt(0), ref_map({ 4, 5 }, function(a) return b2n(a > 0) end, v), "x > 0")
      check_op(-x, ref_map({ 4, 5 }, function(a) return -a end, v), "unary minus")
      local y = x:clone()
      y:mul_(-1.5)
      check_op(y, ref_map({ 4, 5 }, function(a) return a * -1.5 end, v), "mul_ by a scalar")
    end
  end)

  it("propagates NaN through maximum/minimum and compares NaN as false", function()
    for _, dt in ipairs(FLOATS) do
      local a = ms.tensor({ 1, NaN, 3, NaN }, { dtype = dt })
      local b = ms.tensor({ NaN, 2, 0, NaN }, { dtype = dt })
      for _, op in ipairs { "maximum", "minimum", "add", "eq", "ne", "lt", "ge" } do
        check_op(a[op](a, b), ref_map({ 4 }, BINARY[op], val(a), val(b)), op .. " with NaN")
      end
      local m = a:maximum(1.5):totable()
      assert.is_true(m[2] ~= m[2] and m[1] == 1.5 and m[3] == 3, "maximum with a scalar keeps NaN")
    end
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- clamp, lerp, addcmul, addcdiv
-- ---------------------------------------------------------------------------------------------------
describe("cpu clamp, lerp, addcmul, addcdiv", function()
  it("clamp bounds every value, keeps NaN, and accepts open sides", function()
    for _, dt in ipairs(FLOATS) do
      local x = randn({ 6, 7 }, dt)
      local v = val(x)
      local function cl(lo, hi) return function(a) if a ~= a then return a end return math.min(math.max(a, lo), hi) end end
      check_op(x:clamp(-0.5, 0.7), ref_map({ 6, 7 }, cl(-0.5, 0.7), v), "clamp")
      check_op(x:clamp(nil, 0.1), ref_map({ 6, 7 }, cl(-inf, 0.1), v), "clamp above")
      check_op(x:clamp(-0.2), ref_map({ 6, 7 }, cl(-0.2, inf), v), "clamp below")
      local y = x:t()
      y:clamp_(-1, 1)
      check_op(y, ref_map({ 7, 6 }, cl(-1, 1), val(x:t())), "clamp_ on a transposed view")
      local n = ms.tensor({ NaN, 5, -5 }, { dtype = dt }):clamp(-1, 1):totable()
      assert.is_true(n[1] ~= n[1] and n[2] == 1 and n[3] == -1, "clamp keeps NaN")
    end
  end)

  it("lerp follows a + w (b - a) with number or tensor weights, broadcasting and in place", function()
    for _, dt in ipairs(FLOATS) do
      local a, b = randn({ 3, 5 }, dt), randn({ 5 }, dt)
      local function lerp(w) return function(x, y) return x + w * (y - x) end end
      check_op(ms.lerp(a, b, 0.3), ref_map({ 3, 5 }, lerp(0.3), val(a), val(b)), "lerp")
      -- a device scalar of another float dtype: its stored value is what counts
      local wt = ms.tensor({ 0.7 }, { dtype = "bf16" })
      check_op(ms.lerp(a, b, wt), ref_map({ 3, 5 }, lerp(wt:item()), val(a), val(b)), "lerp with a bf16 weight tensor")
      local want = ref_map({ 3, 5 }, lerp(-0.25), val(a), val(b))
      a:lerp_(b, -0.25)
      check_op(a, want, "lerp_")
    end
  end)

  it("addcmul and addcdiv compute a + v b c and a + v b / c", function()
    for _, dt in ipairs(FLOATS) do
      local a, b, c = randn({ 4, 6 }, dt), randn({ 4, 6 }, dt), urand({ 1, 6 }, dt, 0.5, 2)
      local function mul(v) return function(x, y, z) return x + v * y * z end end
      local function div(v) return function(x, y, z) return x + v * y / z end end
      check_op(ms.addcmul(a, b, c, 0.5), ref_map({ 4, 6 }, mul(0.5), val(a), val(b), val(c)), "addcmul")
      check_op(ms.addcdiv(a, b, c, -2), ref_map({ 4, 6 }, div(-2), val(a), val(b), val(c)), "addcdiv")
      local vt = ms.tensor(0.125, { dtype = "f64" })
      check_op(ms.addcdiv(a, b, c, vt), ref_map({ 4, 6 }, div(0.125), val(a), val(b), val(c)), "addcdiv with a value tensor")
      local want = ref_map({ 4, 6 }, mul(3), val(a), val(b), val(c))
      a:addcmul_(b, c, 3)
      check_op(a, want, "addcmul_")
      local at = randn({ 6, 4 }, dt):t()
      local want2 = ref_map({ 4, 6 }, div(1), val(at), val(b), val(c))
      at:addcdiv_(b, c)
      check_op(at, want2, "addcdiv_ into a transposed view")
    end
  end)

  it("run the fused ternaries on large tensors", function()
    local a, b, c = randn({ 200, 300 }), randn({ 200, 300 }), urand({ 200, 300 }, "f32", 0.5, 2)
    check_op(ms.addcdiv(a, b, c, 0.1), ref_map({ 200, 300 }, function(x, y, z) return x + 0.1 * y / z end,
             val(a), val(b), val(c)), "large addcdiv")
    check_op(ms.lerp(a, b, 0.9), ref_map({ 200, 300 }, function(x, y) return x + 0.9 * (y - x) end, val(a), val(b)),
             "large lerp")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- copy (casts) and fill
-- ---------------------------------------------------------------------------------------------------
local ALL = { "f32", "f64", "bf16", "f16", "i32", "u8" }

describe("cpu copy and fill", function()
  local function source(dt)
    if dt == "i32" then
      local flat = randn({ 40 }, "f64", 1e5):tolist_flat()
      for i = 1, #flat do flat[i] = math.floor(flat[i]) end
      flat[1], flat[2], flat[3] = 16777217, -70000, 300     -- rounds in f32, overflows f16, saturates u8
      return ms.tensor(flat, { dtype = "i32" })
    elseif dt == "u8" then
      local flat = urand({ 40 }, "f64", 0, 256):tolist_flat()
      for i = 1, #flat do flat[i] = math.floor(flat[i]) end
      return ms.tensor(flat, { dtype = "u8" })
    end
    return randn({ 40 }, dt, 150)     -- fractions, negatives, values past 255
  end

  it("casts between all six dtypes: floats round to nearest even, integers truncate and saturate", function()
    for _, sdt in ipairs(ALL) do
      local src = source(sdt)
      local sv = src:tolist_flat()
      for _, ddt in ipairs(ALL) do
        local got = ms.empty({ 40 }, { dtype = ddt }):copy_(src):tolist_flat()
        for i = 1, 40 do
          local want = cast(sv[i], ddt)
          if not (got[i] == want) then
            error(("copy %s -> %s: element %d (%.17g) gave %.17g, expected %.17g"):format(sdt, ddt, i, sv[i], got[i], want))
          end
        end
      end
    end
  end)

  it("casts special values", function()
    local special = ms.tensor({ NaN, inf, -inf, 70000, -70000, 1e-8, -2.5, 2.5, 3.5, 255.9, -0.9 }, { dtype = "f64" })
    local sv = special:tolist_flat()
    for _, ddt in ipairs(ALL) do
      local got = special:to(ddt):tolist_flat()
      for i = 1, #sv do
        local want = cast(sv[i], ddt)
        assert.is_true(got[i] == want or (got[i] ~= got[i] and want ~= want),
                       ("f64 %g -> %s gave %g, expected %g"):format(sv[i], ddt, got[i], want))
      end
    end
  end)

  it("copies into strided views, broadcasts its source and leaves the rest untouched", function()
    for _, dt in ipairs { "f32", "bf16", "i32" } do
      local base = ms.zeros({ 4, 6 }, { dtype = dt })
      local src = ms.tensor({ { 1, 2, 3 } }, { dtype = "f64" })
      base:slice(1, 0, 6, 2):copy_(src)                     -- every other column of every row
      assert.same({ 1, 0, 2, 0, 3, 0 }, base:totable()[3])
      local t = ms.empty({ 3, 4 }, { dtype = dt })
      local x = randn({ 4, 3 }, "f32", 10)
      t:t():copy_(x)
      local want = ref_map({ 4, 3 }, function(a) return cast(a, dt) end, val(x))
      H.assert_close(t:t():tolist_flat(), want, 0, 0, "copy into a transposed view")
    end
    local x = randn({ 1000 })
    local before = x:tolist_flat()
    x:copy_(x)
    bitwise_equal(x:tolist_flat(), before, "copy onto itself")
  end)

  it("fills every dtype and layout, from numbers or value tensors", function()
    for _, dt in ipairs(ALL) do
      local want = cast(2.75, dt)
      local t = ms.empty({ 3, 5 }, { dtype = dt }):fill_(2.75)
      for _, x in ipairs(t:tolist_flat()) do assert.equals(want, x) end
      local base = ms.zeros({ 6, 4 }, { dtype = dt })
      base:t():slice(0, 1, 4, 2):fill_(-1)                  -- columns 1 and 3
      assert.same({ 0, cast(-1, dt), 0, cast(-1, dt) }, base:totable()[6])
    end
    local vt = ms.tensor({ -0.3 }, { dtype = "f16" })
    local t = ms.empty({ 7 }, { dtype = "f64" }):fill_(0, vt)
    for _, x in ipairs(t:tolist_flat()) do assert.equals(vt:item(), x) end
    local big = ms.empty({ 300, 200 }):fill_(1.5)
    assert.equals(1.5 * 60000, big:sum())
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- reductions and dot
-- ---------------------------------------------------------------------------------------------------
-- f64 reference of a reduction along dim (nil: everything), with the scale sum|x| (or sum x^2) that bounds
-- the accumulation error
local function ref_reduce(v, shape, op, dim)
  local outer, len, inner = 1, numel(shape), 1
  if dim then
    len = shape[dim + 1]
    for d = 1, dim do outer = outer * shape[d] end
    for d = dim + 2, #shape do inner = inner * shape[d] end
  end
  local want, scale = {}, {}
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local s, sa, sq, mx, mn, am = 0, 0, 0, -inf, inf, 0
      local nan = false
      for k = 0, len - 1 do
        local x = v[(o * len + k) * inner + i + 1]
        if x ~= x then nan = true end
        s, sa, sq = s + x, sa + math.abs(x), sq + x * x
        mx, mn, am = math.max(mx, x), math.min(mn, x), math.max(am, math.abs(x))
      end
      local r = ({ sum = s, mean = s / len, max = mx, min = mn, norm = math.sqrt(sq), sumsq = sq, amax = am })[op]
      if nan and (op == "max" or op == "min" or op == "amax") then r = NaN end
      want[#want + 1] = r
      scale[#scale + 1] = ({ sum = sa, mean = sa / len, sumsq = sq, norm = math.sqrt(sq) })[op] or 0
    end
  end
  return want, scale
end

local RED = { "sum", "mean", "max", "min", "norm", "sumsq", "amax" }

-- |got - want| <= rtol(out dtype) |want| + acc * scale: output rounding plus accumulation in acc's precision
local function check_reduce(got, want, scale, out_dt, acc, what)
  local rtol, atol = H.tol[out_dt].rtol, H.tol[out_dt].atol
  for i = 1, #want do
    local err, tolv = math.abs(got[i] - want[i]), atol + rtol * math.abs(want[i]) + acc * scale[i]
    if want[i] ~= want[i] then
      if got[i] == got[i] then error(("%s: element %d is %.9g, expected NaN"):format(what, i, got[i]), 2) end
    elseif not (err <= tolv) then
      error(("%s: element %d is %.9g, expected %.9g (error %.3g > %.3g)"):format(what, i, got[i], want[i], err, tolv), 2)
    end
  end
end

local function acc_err(dt) return (dt == "f64" or dt == "i32") and 1e-13 or 4e-6 end
local function out_dtype(dt) return (dt == "f64" or dt == "i32") and "f64" or (dt == "u8" and "f32" or dt) end

describe("cpu reductions", function()
  local function check_all(x, dims, what)
    local dt = x:dtype()
    local v, shape = x:tolist_flat(), x:shape()
    for _, op in ipairs(RED) do
      local want, scale = ref_reduce(v, shape, op, nil)
      check_reduce({ x[op](x) }, want, scale, dt == "f64" and "f64" or "f32", acc_err(dt), what .. " " .. op .. "()")
      for _, d in ipairs(dims) do
        local got = x[op](x, d)
        local dd = d < 0 and d + #shape or d
        want, scale = ref_reduce(v, shape, op, dd)
        check_reduce(got:tolist_flat(), want, scale, out_dtype(dt), acc_err(dt), what .. " " .. op .. "(" .. d .. ")")
        local kept = x[op](x, d, true):shape()
        assert.equals(1, kept[dd + 1])
        assert.equals(#shape, #kept)
      end
    end
  end

  it("reduce along every dim and over everything in every float dtype", function()
    for _, dt in ipairs(FLOATS) do
      check_all(randn({ 7, 300 }, dt), { 0, 1, -1 }, dt .. " [7,300]")
      check_all(randn({ 3, 4, 5 }, dt), { 0, 1, 2 }, dt .. " [3,4,5]")
      check_all(randn({ 1, 1 }, dt), { 0, 1 }, dt .. " [1,1]")
    end
  end)

  it("reduce strided sources (transposed, stepped) and long dims spanning several chunks", function()
    check_all(randn({ 300, 7 }):t(), { 0, 1 }, "transposed [7,300]")
    check_all(randn({ 20, 9, 30 }, "bf16"):slice(2, 1, 29, 4):permute(2, 0, 1), { 0, 1, 2 }, "stepped permuted bf16")
    check_all(randn({ 2, 9000 }), { 1 }, "[2,9000]")
    check_all(randn({ 9000, 20 }, "f64"), { 0 }, "f64 [9000,20]")
    check_all(randn({ 5000, 3 }, "f16", 0.5), { 0, 1 }, "f16 [5000,3]")
  end)

  it("accumulate integer sources in f64", function()
    local x = ms.tensor({ { 2147483647, 2147483647, -5 }, { 1, 2, 3 } }, { dtype = "i32" })
    assert.equals(2 * 2147483647 - 5 + 6, x:sum())
    assert.same({ 2 * 2147483647 - 5, 6 }, x:sum(1):totable())
    assert.equals("f64", x:sum(1):dtype())
  end)

  it("propagate NaN through every op, wherever it sits", function()
    for _, dt in ipairs { "f32", "f64", "bf16" } do
      local base = randn({ 2, 9000 }, "f64"):tolist_flat()
      base[4500] = NaN              -- row 0, second chunk
      local x = ms.tensor(nest(base, { 2, 9000 }), { dtype = dt })
      for _, op in ipairs(RED) do
        local all = x[op](x)
        assert.is_true(all ~= all, op .. " over everything is NaN")
        local rows = x[op](x, 1):totable()
        assert.is_true(rows[1] ~= rows[1], op .. " of the NaN row is NaN")
        assert.is_true(rows[2] == rows[2], op .. " of the clean row is a number")
      end
      local first = ms.tensor({ NaN, 1, 2 }, { dtype = dt })
      assert.is_true(first:max() ~= first:max() and first:min() ~= first:min(), "a leading NaN sticks")
    end
  end)

  it("reduce empty and 0-dim tensors as documented", function()
    local e = ms.zeros({ 0, 4 })
    assert.equals(0, e:sum())
    assert.equals(0, e:sumsq())
    assert.equals(0, e:norm())
    local m = e:mean()
    assert.is_true(m ~= m, "mean of nothing is NaN")
    H.expect_error(function() e:max() end, "zero elements")
    H.expect_error(function() e:amax(0) end, "zero elements")
    assert.same({ 0, 0, 0, 0 }, e:sum(0):totable())
    for _, x in ipairs(e:mean(0):totable()) do assert.is_true(x ~= x) end
    assert.same({ 0 }, e:sum(1):shape())
    assert.equals(3.5, ms.tensor(3.5):sum())
    assert.equals(2, ms.tensor(-2):amax())
  end)

  it("give bitwise the same results for any thread count", function()
    local seed = H.seed()
    local results = {}
    for _, threads in ipairs { 1, 2, 3 } do
      local ctx = ms.context { device = "cpu", num_threads = threads }
      local x = ms.randn({ 400, 1000 }, { seed = seed, ctx = ctx })
      local y = ms.randn({ 400, 1000 }, { seed = seed, offset = 1, ctx = ctx })
      local r = { x:sum(), x:norm(), x:max(), ms.dot(x, y), x:t():sum() }
      for _, op in ipairs { "sum", "mean", "sumsq", "amax" } do
        for _, d in ipairs { 0, 1 } do
          for _, v in ipairs(x[op](x, d):tolist_flat()) do r[#r + 1] = v end
        end
      end
      results[threads] = r
    end
    bitwise_equal(results[1], results[2], "1 vs 2 threads")
    bitwise_equal(results[1], results[3], "1 vs 3 threads")
    -- and the shared result is right
    local x = ms.randn({ 400, 1000 }, { seed = seed })
    local want, scale = ref_reduce(x:tolist_flat(), { 400, 1000 }, "sum", nil)
    check_reduce({ results[1][1] }, want, scale, "f32", 1e-5, "sum of 400k")
  end)
end)

describe("cpu dot", function()
  local function ref_dot(a, b)
    local s, sa = 0, 0
    for i = 1, #a do s, sa = s + a[i] * b[i], sa + math.abs(a[i] * b[i]) end
    return s, sa
  end

  it("matches sum(a * b) in every float dtype and layout", function()
    for _, dt in ipairs(FLOATS) do
      for _, shape in ipairs { { 17 }, { 30, 40 }, { 3, 50000 } } do
        local a, b = randn(shape, dt), randn(shape, dt)
        local want, scale = ref_dot(a:tolist_flat(), b:tolist_flat())
        check_reduce({ ms.dot(a, b) }, { want }, { scale }, dt == "f64" and "f64" or "f32", acc_err(dt),
                     "dot " .. dt .. " " .. table.concat(shape, "x"))
      end
      local at, b = randn({ 40, 30 }, dt):t(), randn({ 30, 40 }, dt)
      local want, scale = ref_dot(at:tolist_flat(), b:tolist_flat())
      check_reduce({ ms.dot(at, b) }, { want }, { scale }, dt == "f64" and "f64" or "f32", acc_err(dt), "dot transposed")
    end
    assert.equals(0, ms.dot(ms.zeros({ 0 }), ms.zeros({ 0 })))
    local n = ms.dot(ms.tensor({ 1, NaN }), ms.tensor({ 2, 3 }))
    assert.is_true(n ~= n, "dot with NaN is NaN")
  end)
end)

-- moonstep.h, "Ops": a scalar takes the computation's precision, so with f32 tensors an f64 scalar (a host
-- double or an f64 device scalar) is rounded to f32 first.  2^24 + (1 + 2^-30) is a tie in f32 once the scalar
-- is 1 (kept at 2^24, even), and 2^24 + 2 in f64: the two rules differ in the result.
describe("scalar precision", function()
  local function check(dev)
    local ctx = ms.device(dev)
    local ch = T.handle_ctx(ctx)
    local s = 1 + 2 ^ -30
    local a = ms.tensor({ 2 ^ 24, 2 ^ 24 + 2 }, { dtype = "f32", ctx = ctx })
    local ones = ms.ones({ 2 }, { ctx = ctx })
    for _, sdt in ipairs { "f64", "f32" } do
      local s_t = ms.tensor({ s }, { dtype = sdt, ctx = ctx })
      local calls = {
        { "ms_binary_scalar, host", function(d) return C.ms_binary_scalar(ch, T.handle(d), T.handle(a), s, nil, C.MS_BINARY_ADD, 0) end },
        { "ms_binary_scalar, s_t", function(d) return C.ms_binary_scalar(ch, T.handle(d), T.handle(a), 0, T.handle(s_t), C.MS_BINARY_ADD, 0) end },
        { "ms_addcmul, host", function(d) return C.ms_addcmul(ch, T.handle(d), T.handle(a), T.handle(ones), T.handle(ones), s, nil) end },
        { "ms_addcmul, v_t", function(d) return C.ms_addcmul(ch, T.handle(d), T.handle(a), T.handle(ones), T.handle(ones), 0, T.handle(s_t)) end },
      }
      for _, c in ipairs(calls) do
        local d = ms.full({ 2 }, -7, { ctx = ctx })
        assert.equals(C.MS_OK, c[2](d), c[1])
        local got = d:totable()
        assert.are.same({ 2 ^ 24, 2 ^ 24 + 4 }, got, ("%s (%s scalar) on %s"):format(c[1], sdt, dev))
      end
    end
  end
  it("an f64 scalar with f32 tensors is rounded to f32 (CPU)", function() check("cpu") end)
  H.cuda_it("an f64 scalar with f32 tensors is rounded to f32 (CUDA, as the CPU)", function() check("cuda") end)
end)
