-- Counter-based random numbers on the CPU: every element checked against a Philox4x32-10 written here in
-- Lua (itself checked against Random123's known-answer vectors) and the formulas of moonstep.h, plus
-- moments, ranges, reproducibility, and independence from layout and thread count.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local bit = require("bit")
local ffi, C = core.ffi, core.C

local TWO32 = 4294967296
local inf = math.huge

-- ---------------------------------------------------------------------------------------------------
-- the reference generator (all arithmetic exact in doubles)
-- ---------------------------------------------------------------------------------------------------
local function u32(x) return x % TWO32 end
local function xor(a, b) return u32(bit.bxor(a, b)) end

-- 32 x 32 -> 64-bit product as (hi, lo), through 16-bit halves
local function mulhilo(a, b)
  local ah, al = math.floor(a / 65536), a % 65536
  local bh, bl = math.floor(b / 65536), b % 65536
  local mid = ah * bl + al * bh
  local lo_full = al * bl + (mid % 65536) * 65536
  local hi = ah * bh + math.floor(mid / 65536) + math.floor(lo_full / TWO32)
  return u32(hi), lo_full % TWO32
end

local function philox(c0, c1, c2, c3, k0, k1)
  for r = 1, 10 do
    if r > 1 then k0, k1 = u32(k0 + 0x9E3779B9), u32(k1 + 0xBB67AE85) end
    local hi0, lo0 = mulhilo(0xD2511F53, c0)
    local hi1, lo1 = mulhilo(0xCD9E8D57, c2)
    c0, c1, c2, c3 = xor(xor(hi1, c1), k0), lo1, xor(xor(hi0, c3), k1), lo0
  end
  return c0, c1, c2, c3
end

local function words(i, seed, offset)
  return philox(i % TWO32, math.floor(i / TWO32), offset % TWO32, math.floor(offset / TWO32),
                seed % TWO32, math.floor(seed / TWO32))
end

local function u24(w) return math.floor(w / 256) * 2 ^ -24 end
local function u53(hi, lo) return (math.floor(hi / 32) * 2 ^ 26 + math.floor(lo / 64)) * 2 ^ -53 end

-- round-to-nearest-even into a narrower float format (p significand bits, smallest normal 2^emin)
local FMT = { f32 = { 24, -126 }, bf16 = { 8, -126 }, f16 = { 11, -14 } }
local function round_fp(x, dt)
  if dt == "f64" or x == 0 then return x end
  local p, emin = FMT[dt][1], FMT[dt][2]
  local _, e = math.frexp(x)
  local ulp = 2 ^ (math.max(e - 1, emin) - (p - 1))
  local r = x / ulp
  local f = math.floor(r)
  if r - f > 0.5 or (r - f == 0.5 and f % 2 == 1) then f = f + 1 end
  return f * ulp
end
-- what a store keeps: f64 values reach bf16/f16 through f32
local function stored(x, dt)
  if dt == "f64" then return x end
  return round_fp(round_fp(x, "f32"), dt)
end
-- the largest value of dt below b
local function below(b, dt)
  local r = stored(b, dt)
  if r < b then return r end
  local _, e = math.frexp(r)
  local p, emin = dt == "f64" and 53 or FMT[dt][1], dt == "f64" and -1022 or FMT[dt][2]
  local step = 2 ^ (math.max(e - 1, emin) - (p - 1))
  if r > 0 and r == 2 ^ (e - 1) and e - 1 > emin then step = step / 2 end   -- just below a power of two
  return r - step
end

-- the smallest value of dt at or above a (dt's formats are symmetric: minus the largest value below -a, when a
-- itself is not a value of dt)
local function above(a, dt)
  local r = stored(a, dt)
  if r >= a then return r end
  return -below(-r, dt)
end

-- element i of ms.rand / ms.randn as documented
local function expected(i, dt, dist, a, b, seed, offset)
  local w0, w1, w2, w3 = words(i, seed, offset)
  local wide = dt == "f64"
  if dist == "uniform" then
    local v = stored(a + (b - a) * (wide and u53(w0, w1) or u24(w0)), dt)
    if b > a and v >= b then v = below(b, dt) elseif b > a and v < a then v = above(a, dt) end
    return v
  end
  local u1 = wide and u53(w0, w1) + 2 ^ -53 or u24(w0) + 2 ^ -24
  local u2 = wide and u53(w2, w3) or u24(w2)
  return stored(a + b * (math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)), dt)
end

local function draw(dist, shape, dt, seed, offset, a, b, ctx)
  local opts = { dtype = dt, seed = seed, offset = offset, ctx = ctx }
  if dist == "uniform" then
    opts.low, opts.high = a or 0, b or 1
    return ms.rand(shape, opts)
  end
  opts.mean, opts.std = a or 0, b or 1
  return ms.randn(shape, opts)
end

local function moments(v)
  local n, s = #v, 0
  for i = 1, n do s = s + v[i] end
  local mean, m2, m3, m4 = s / n, 0, 0, 0
  for i = 1, n do
    local d = v[i] - mean
    m2, m3, m4 = m2 + d * d, m3 + d * d * d, m4 + d * d * d * d
  end
  m2, m3, m4 = m2 / n, m3 / n, m4 / n
  return mean, m2, m3 / m2 ^ 1.5, m4 / (m2 * m2)
end

-- ---------------------------------------------------------------------------------------------------
describe("Philox4x32-10", function()
  it("the Lua reference reproduces Random123's known-answer vectors", function()
    local kat = {
      { { 0, 0, 0, 0 }, { 0, 0 }, { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 } },
      { { 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff }, { 0xffffffff, 0xffffffff },
        { 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd } },
      { { 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344 }, { 0xa4093822, 0x299f31d0 },
        { 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1 } },
    }
    for n, v in ipairs(kat) do
      local got = { philox(v[1][1], v[1][2], v[1][3], v[1][4], v[2][1], v[2][2]) }
      for j = 1, 4 do
        assert.equals(v[3][j], got[j], ("vector %d word %d"):format(n, j))
      end
    end
  end)

  it("ms.rand element 0 of seed 0, offset 0 carries the first KAT vector's words", function()
    -- f32: w0 >> 8; f64: w0 >> 5 and w1 >> 6
    assert.equals(math.floor(0x6627e8d5 / 256) * 2 ^ -24, ms.rand({ 1 }, { seed = 0, offset = 0 }):item())
    assert.equals(u53(0x6627e8d5, 0xe169c58d), ms.rand({ 1 }, { dtype = "f64", seed = 0, offset = 0 }):item())
  end)
end)

describe("cpu rand", function()
  local configs = {
    { seed = 0, offset = 0 }, { seed = 1, offset = 7 }, { seed = 2 ^ 40 + 12345, offset = 2 ^ 32 + 5 },
  }

  it("draws exactly the documented uniforms in every float dtype", function()
    local extra = { seed = H.seed() * 7919, offset = H.seed() }
    for _, cfg in ipairs { configs[1], configs[2], configs[3], extra } do
      for _, dt in ipairs { "f32", "f64", "bf16", "f16" } do
        for _, range in ipairs { { 0, 1 }, { -3, 5 } } do
          local got = draw("uniform", { 40, 50 }, dt, cfg.seed, cfg.offset, range[1], range[2]):tolist_flat()
          for i = 1, #got do
            local want = expected(i - 1, dt, "uniform", range[1], range[2], cfg.seed, cfg.offset)
            if got[i] ~= want then
              error(("uniform %s seed %.0f offset %.0f [%g,%g) element %d: %.17g, expected %.17g"):format(
                dt, cfg.seed, cfg.offset, range[1], range[2], i - 1, got[i], want))
            end
          end
        end
      end
    end
  end)

  it("draws the documented Box-Muller normals (f64 formula, rounded once)", function()
    for _, cfg in ipairs { configs[2], configs[3], { seed = H.seed(), offset = 3 } } do
      for _, dt in ipairs { "f32", "f64", "bf16", "f16" } do
        local got = draw("normal", { 1000 }, dt, cfg.seed, cfg.offset, 2, 0.5):tolist_flat()
        local want = {}
        for i = 1, #got do want[i] = expected(i - 1, dt, "normal", 2, 0.5, cfg.seed, cfg.offset) end
        -- libm's log/cos against the Lua VM's: equal up to an f64 ulp, which rounding to dt can expose once
        local rtol = ({ f64 = 1e-14, f32 = 1.2e-7, bf16 = 7.9e-3, f16 = 9.8e-4 })[dt]
        H.assert_close(got, want, rtol, 1e-12, "normal " .. dt)
      end
    end
  end)

  it("keeps uniforms inside [low, high) even where rounding would reach high", function()
    for _, dt in ipairs { "bf16", "f16", "f32" } do
      for _, range in ipairs { { 0, 1 }, { 1, 2 }, { -1, 1 } } do
        local v = draw("uniform", { 200000 }, dt, H.seed(), 0, range[1], range[2]):tolist_flat()
        local top = -inf
        for i = 1, #v do
          if not (v[i] >= range[1] and v[i] < range[2]) then
            error(("%s uniform [%g,%g): element %d is %.9g"):format(dt, range[1], range[2], i, v[i]))
          end
          top = math.max(top, v[i])
        end
        if dt ~= "f32" then   -- the largest value below high does occur (2^-9 of bf16 draws land there)
          assert.equals(below(range[2], dt), top, dt .. " reaches the top of its range")
        end
      end
    end
  end)

  it("keeps uniforms at or above a low that the dtype cannot hold", function()
    -- bf16 has no -0.1: -0.1 + 0.2 u rounds to -0.10009765625 for u below ~7e-4 (and 0.301 + 0.2 u to
    -- 0.30078125), which must become the smallest bf16 value at or above low
    for _, dt in ipairs { "bf16", "f16", "f32" } do
      for _, range in ipairs { { -0.1, 0.1 }, { 0.301, 0.5 }, { 1 / 3, 1 } } do
        local seed = H.seed()
        local v = draw("uniform", { 200000 }, dt, seed, 0, range[1], range[2]):tolist_flat()
        local low = inf
        for i = 1, #v do
          if not (v[i] >= range[1] and v[i] < range[2]) then
            error(("%s uniform [%.17g,%.17g): element %d is %.17g"):format(dt, range[1], range[2], i - 1, v[i]))
          end
          if v[i] ~= expected(i - 1, dt, "uniform", range[1], range[2], seed, 0) then
            error(("%s uniform [%.17g,%.17g): element %d is %.17g, expected %.17g"):format(dt, range[1], range[2],
              i - 1, v[i], expected(i - 1, dt, "uniform", range[1], range[2], seed, 0)))
          end
          low = math.min(low, v[i])
        end
        if dt == "bf16" then   -- the clamped draws do occur
          assert.equals(above(range[1], dt), low, dt .. " reaches the bottom of its range")
        end
      end
    end
  end)

  it("refuses a uniform range that holds no value of the dtype", function()
    -- bf16 steps by 2^-10 near 0.1: [0.1001, 0.1002) lies between two neighbours, and f16 has nothing finite at or
    -- above 65520; drawing would have to break [low, high)
    for _, case in ipairs { { "bf16", 0.1001, 0.1002 }, { "f16", 65520, 1e6 }, { "f16", 1 + 2 ^ -12, 1 + 2 ^ -11 } } do
      local ok, err = pcall(draw, "uniform", { 8 }, case[1], 1, 0, case[2], case[3])
      assert.is_false(ok, case[1])
      assert.is_truthy(tostring(err):find("holds no " .. case[1] .. " value", 1, true), tostring(err))
    end
    -- a range as narrow that does hold a value draws it
    local v = draw("uniform", { 64 }, "bf16", 1, 0, 0.1, 0.1002):tolist_flat()
    for i = 1, #v do assert.equals(stored(0.1, "bf16") >= 0.1 and stored(0.1, "bf16") or above(0.1, "bf16"), v[i]) end
  end)

  it("has the moments of its distributions", function()
    local n = 200000
    for _, dt in ipairs { "f32", "f64" } do
      local mean, var = moments(draw("uniform", { n }, dt, H.seed(), 0):tolist_flat())
      assert.is_true(math.abs(mean - 0.5) < 5 * math.sqrt(1 / 12 / n), dt .. " uniform mean " .. mean)
      assert.is_true(math.abs(var - 1 / 12) < 5 * math.sqrt(1 / 180 / n), dt .. " uniform variance " .. var)
      local v = draw("normal", { n }, dt, H.seed(), 0):tolist_flat()
      local m, s2, skew, kurt = moments(v)
      assert.is_true(math.abs(m) < 5 / math.sqrt(n), dt .. " normal mean " .. m)
      assert.is_true(math.abs(s2 - 1) < 5 * math.sqrt(2 / n), dt .. " normal variance " .. s2)
      assert.is_true(math.abs(skew) < 5 * math.sqrt(6 / n), dt .. " normal skewness " .. skew)
      assert.is_true(math.abs(kurt - 3) < 5 * math.sqrt(24 / n), dt .. " normal kurtosis " .. kurt)
      for i = 1, n do assert(v[i] == v[i] and math.abs(v[i]) < 10, "normal values are finite and sane") end
    end
    local m, s2 = moments(draw("normal", { n }, "bf16", H.seed(), 0, -1, 3):tolist_flat())
    assert.is_true(math.abs(m + 1) < 5 * 3 / math.sqrt(n) + 0.01, "bf16 normal mean " .. m)
    assert.is_true(math.abs(s2 / 9 - 1) < 0.03, "bf16 normal variance " .. s2)
  end)

  it("repeats with the same seed and offset, and changes with either", function()
    local seed = H.seed()
    local a = draw("normal", { 3000 }, "f32", seed, 4):tolist_flat()
    local b = draw("normal", { 3000 }, "f32", seed, 4):tolist_flat()
    local c = draw("normal", { 3000 }, "f32", seed, 5):tolist_flat()
    local d = draw("normal", { 3000 }, "f32", seed + 1, 4):tolist_flat()
    local same_c, same_d = 0, 0
    for i = 1, #a do
      assert(a[i] == b[i], "same seed and offset give the same values")
      if a[i] == c[i] then same_c = same_c + 1 end
      if a[i] == d[i] then same_d = same_d + 1 end
    end
    assert.is_true(same_c < 3 and same_d < 3, ("other offset/seed repeats %d/%d values"):format(same_c, same_d))
    -- the global generator advances its offset per draw and restarts with manual_seed
    ms.manual_seed(seed)
    local g1, g2 = ms.rand({ 100 }):tolist_flat(), ms.rand({ 100 }):tolist_flat()
    ms.manual_seed(seed)
    assert.same(g1, ms.rand({ 100 }):tolist_flat())
    assert.are_not.same(g1, g2)
    assert.same(draw("uniform", { 100 }, "f32", seed, 1):tolist_flat(), g2)
  end)

  it("the global generator never repeats an offset past 2^53, where a double cannot count by one", function()
    local seed, before = H.seed(), ms.rng_state()
    for _, start in ipairs { 2 ^ 53 - 1, 2 ^ 53, 2 ^ 60 } do
      ms.set_rng_state { seed = seed, offset = start }
      local seen, offsets = {}, {}
      for i = 1, 3 do
        offsets[i] = ms.rng_state().offset
        local v = ms.rand({ 4 }, { dtype = "f64" }):tolist_flat()
        local key = table.concat(v, ",")
        assert.is_nil(seen[key], ("draw %d from offset %.0f repeats draw %s"):format(i, start, tostring(seen[key])))
        seen[key] = i
        assert.same(draw("uniform", { 4 }, "f64", seed, offsets[i]):tolist_flat(), v)
      end
      assert.is_true(offsets[1] < offsets[2] and offsets[2] < offsets[3])
    end
    ms.set_rng_state { seed = seed, offset = core.UINT64_MAX }
    H.expect_error(function() ms.rand({ 1 }) end, "the global generator's offsets are spent")
    assert.equals(core.UINT64_MAX, ms.rng_state().offset)
    ms.set_rng_state(before)
  end)

  it("depends on the logical index only: any layout, any thread count", function()
    local seed = H.seed()
    local o = ffi.new("ms_rand_options")
    o.dist, o.a, o.b, o.seed, o.offset = C.MS_RAND_NORMAL, 0, 1, seed, 9
    local want = draw("normal", { 7, 5 }, "f32", seed, 9):tolist_flat()
    local base = ms.zeros({ 5, 7 })
    local view = base:t()                                   -- [7, 5], column-major
    core.check(C.ms_rand(T.handle_ctx(view:context()), T.handle(view), o))
    assert.same(want, view:tolist_flat())
    local wide = ms.zeros({ 7, 10 }, { dtype = "bf16" })
    local stepped = wide:slice(1, 0, 10, 2)                 -- every other column
    core.check(C.ms_rand(T.handle_ctx(stepped:context()), T.handle(stepped), o))
    assert.same(draw("normal", { 7, 5 }, "bf16", seed, 9):tolist_flat(), stepped:tolist_flat())
    assert.equals(0, wide:slice(1, 1, 10, 2):amax())        -- untouched in between

    local r1 = draw("uniform", { 300, 400 }, "f32", seed, 2, nil, nil, ms.context { num_threads = 1 })
    local r3 = draw("uniform", { 300, 400 }, "f32", seed, 2, nil, nil, ms.context { num_threads = 3 })
    assert.is_true(ms.dot(r1 - r3, r1 - r3) == 0, "1 and 3 threads draw the same numbers")
    local flat = r1:tolist_flat()
    for _, i in ipairs { 1, 777, 120000 } do
      assert.equals(expected(i - 1, "f32", "uniform", 0, 1, seed, 2), flat[i])
    end
  end)

  it("draws nothing for empty tensors and one value for 0-dim ones", function()
    assert.same({ 0, 3 }, ms.rand({ 0, 3 }):shape())
    local seed = H.seed()
    assert.equals(expected(0, "f64", "normal", 0, 1, seed, 0), ms.randn({}, { dtype = "f64", seed = seed }):item())
  end)
end)

