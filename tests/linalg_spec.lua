-- CPU linear algebra against f64 references computed here in Lua: matmul (transposes, views, batch
-- broadcasting, alpha/beta, mixed precision) against a triple loop, eye and diag, and eigh against a Jacobi
-- eigensolver, with reconstruction and orthogonality checks.
local ms = require("moonstep")
local ffi = require("ffi")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local C = core.C

local NaN = 0 / 0

local function randn(shape, dt, std)
  return ms.randn(shape, { dtype = dt or "f32", seed = H.seed(), std = std or 1 })
end

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- ---------------------------------------------------------------------------------------------------
-- matmul reference
-- ---------------------------------------------------------------------------------------------------
-- op(X)[i][k] of batch `bidx` (dst's batch index, 0-based per dim) with X's batch dims broadcast
local function getter(x, trans, nbd)
  local v, s = x:tolist_flat(), x:shape()
  local nb = #s - 2
  local R, Cc = s[nb + 1], s[nb + 2]
  return function(bidx, i, k)
    local off = 0
    for d = 1, nb do off = off * s[d] + (s[d] == 1 and 0 or bidx[nbd - nb + d]) end
    local r, c = i, k
    if trans then r, c = k, i end
    return v[(off * R + r) * Cc + c + 1]
  end
end

-- alpha op(a) op(b) + beta c0 over dst's shape, and the magnitude that bounds its rounding error
local function ref_matmul(a, b, dst_shape, o, c0)
  o = o or {}
  local alpha, beta = o.alpha or 1, o.beta or 0
  local nbd = #dst_shape - 2
  local m, n = dst_shape[nbd + 1], dst_shape[nbd + 2]
  local sa = a:shape()
  local k = o.trans_a and sa[#sa - 1] or sa[#sa]
  local ga, gb = getter(a, o.trans_a, nbd), getter(b, o.trans_b, nbd)
  local want, scale = {}, {}
  local nbatch = numel(dst_shape) / math.max(m * n, 1)
  if m * n == 0 then nbatch = 0 end
  local bidx = {}
  for q = 0, nbatch - 1 do
    local r = q
    for d = nbd, 1, -1 do bidx[d] = r % dst_shape[d] r = math.floor(r / dst_shape[d]) end
    for i = 0, m - 1 do
      for j = 0, n - 1 do
        local s, sabs = 0, 0
        for l = 0, k - 1 do
          local p = ga(bidx, i, l) * gb(bidx, l, j)
          s, sabs = s + p, sabs + math.abs(p)
        end
        local pos = #want + 1
        local prior = beta ~= 0 and beta * c0[pos] or 0
        want[pos] = alpha * s + prior
        scale[pos] = math.abs(alpha) * sabs + math.abs(prior)
      end
    end
  end
  return want, scale
end

local function check_mm(got, want, scale, what, acc)
  local dt = got:dtype()
  local v = got:tolist_flat()
  assert.equals(#want, #v, what .. ": element count")
  acc = acc or (dt == "f64" and 1e-13 or 2e-6)
  local rtol, atol = H.tol[dt].rtol, H.tol[dt].atol
  for i = 1, #want do
    local err, tol = math.abs(v[i] - want[i]), atol + rtol * math.abs(want[i]) + acc * scale[i]
    if not (err <= tol) then
      error(("%s: element %d is %.9g, expected %.9g (error %.3g > %.3g)"):format(what, i, v[i], want[i], err, tol), 2)
    end
  end
end

describe("cpu matmul", function()
  it("multiplies plain matrices in f32 and f64", function()
    for _, dt in ipairs { "f32", "f64" } do
      for _, mkn in ipairs { { 5, 7, 3 }, { 1, 9, 1 }, { 17, 33, 9 }, { 64, 130, 48 } } do
        local m, k, n = mkn[1], mkn[2], mkn[3]
        local a, b = randn({ m, k }, dt), randn({ k, n }, dt)
        local want, scale = ref_matmul(a, b, { m, n })
        check_mm(ms.matmul(a, b), want, scale, ("%s %dx%dx%d"):format(dt, m, k, n))
      end
    end
  end)

  it("honours trans_a / trans_b and operands given as transposed, offset or stepped views", function()
    for _, dt in ipairs { "f32", "f64" } do
      local m, k, n = 6, 11, 4
      for _, ta in ipairs { false, true } do
        for _, tb in ipairs { false, true } do
          local a = randn(ta and { k, m } or { m, k }, dt)
          local b = randn(tb and { n, k } or { k, n }, dt)
          local o = { trans_a = ta, trans_b = tb }
          local want, scale = ref_matmul(a, b, { m, n }, o)
          check_mm(ms.matmul(a, b, o), want, scale, ("trans_a=%s trans_b=%s"):format(tostring(ta), tostring(tb)))
          -- the same through views: a column-major operand, and a transposed view with the flag flipped back
          local av, bv = a, b
          if ta then av = a:t() end
          if tb then bv = b:t() end
          check_mm(ms.matmul(av, bv), want, scale, "as views")
          check_mm(ms.matmul(av:t(), bv, { trans_a = true }), want, scale, "transposed view with trans_a")
        end
      end
      local big = randn({ 9, 20 }, dt)
      local a = big:slice(0, 2, 8):slice(1, 3, 14)          -- [6, 11], row stride 20
      local b = randn({ 11, 12 }, dt):slice(1, 0, 12, 3)    -- [11, 4], column stride 3: gathered
      local want, scale = ref_matmul(a, b, { 6, 4 })
      check_mm(ms.matmul(a, b), want, scale, "offset and stepped operands")
      local e = randn({ 11 }, dt):view({ 1, 11 }):expand({ 6, 11 })   -- stride-0 rows: gathered
      want, scale = ref_matmul(e, b, { 6, 4 })
      check_mm(ms.matmul(e, b), want, scale, "an expanded operand")
    end
  end)

  it("broadcasts batch dims", function()
    local cases = {
      { { 2, 1, 4, 5 }, { 3, 5, 6 }, { 2, 3, 4, 6 } },
      { { 4, 5 }, { 3, 5, 6 }, { 3, 4, 6 } },
      { { 3, 4, 5 }, { 5, 6 }, { 3, 4, 6 } },
      { { 2, 3, 4, 5 }, { 2, 3, 5, 6 }, { 2, 3, 4, 6 } },
    }
    for _, dt in ipairs { "f32", "f64", "bf16" } do
      for _, c in ipairs(cases) do
        local a, b = randn(c[1], dt), randn(c[2], dt)
        local got = ms.matmul(a, b)
        assert.same(c[3], got:shape())
        local want, scale = ref_matmul(a, b, c[3])
        check_mm(got, want, scale, dt .. " batched " .. table.concat(c[3], "x"))
      end
      -- a batched operand transposed through a permutation
      local a = randn({ 3, 5, 4 }, dt):permute(0, 2, 1)
      local b = randn({ 3, 5, 2 }, dt)
      local want, scale = ref_matmul(a, b, { 3, 4, 2 })
      check_mm(ms.matmul(a, b), want, scale, dt .. " permuted batch operand")
    end
  end)

  it("applies alpha and beta, ignores dst when beta is 0 (NaN included), and writes any dst layout", function()
    for _, dt in ipairs { "f32", "f64" } do
      local a, b = randn({ 2, 5, 7 }, dt), randn({ 7, 3 }, dt)
      local out = randn({ 2, 5, 3 }, dt)
      local c0 = out:tolist_flat()
      local o = { alpha = 0.5, beta = -2, out = out }
      local want, scale = ref_matmul(a, b, { 2, 5, 3 }, o, c0)
      check_mm(ms.matmul(a, b, o), want, scale, dt .. " alpha, beta")

      local nan = ms.full({ 2, 5, 3 }, NaN, { dtype = dt })
      want, scale = ref_matmul(a, b, { 2, 5, 3 }, { alpha = 3 })
      check_mm(ms.matmul(a, b, { alpha = 3, out = nan }), want, scale, dt .. " beta 0 over NaN")

      -- column-major dst (written in place by BLAS) and a stepped dst (through a temporary)
      local cm = randn({ 3, 5 }, dt):t()
      c0 = cm:tolist_flat()
      local a2 = a:select(0, 1)
      want, scale = ref_matmul(a2, b, { 5, 3 }, { beta = 1.5 }, c0)
      check_mm(ms.matmul(a2, b, { beta = 1.5, out = cm }), want, scale, dt .. " column-major dst")
      local wide = ms.zeros({ 5, 6 }, { dtype = dt })
      local st = wide:slice(1, 0, 6, 2)
      want, scale = ref_matmul(a2, b, { 5, 3 })
      check_mm(ms.matmul(a2, b, { out = st }), want, scale, dt .. " stepped dst")
      assert.equals(0, wide:slice(1, 1, 6, 2):amax(), "the columns in between stay untouched")
    end
  end)

  it("takes bf16 and f16 inputs with f32 accumulation into any float dst", function()
    for _, dt in ipairs { "bf16", "f16" } do
      local a, b = randn({ 2, 9, 40 }, dt), randn({ 40, 5 }, dt)
      local want, scale = ref_matmul(a, b, { 2, 9, 5 })
      for _, odt in ipairs { "f32", dt, "f64" } do
        check_mm(ms.matmul(a, b, { dtype = odt }), want, scale, dt .. " inputs into " .. odt, 4e-6)
      end
      local out = randn({ 2, 9, 5 }, dt)
      local c0 = out:tolist_flat()
      want, scale = ref_matmul(a, b, { 2, 9, 5 }, { beta = 0.5, trans_b = false }, c0)
      check_mm(ms.matmul(a, b, { beta = 0.5, out = out }), want, scale, dt .. " with beta into " .. dt, 4e-6)
      local at = randn({ 40, 9 }, dt):t()
      want, scale = ref_matmul(at, b, { 9, 5 })
      check_mm(ms.matmul(at, b, { dtype = "f32" }), want, scale, dt .. " transposed input", 4e-6)
    end
  end)

  it("handles empty dims: k = 0 gives beta * dst, m = 0 gives nothing", function()
    for _, dt in ipairs { "f32", "f64", "bf16" } do
      local z = ms.matmul(ms.empty({ 3, 0 }, { dtype = dt }), ms.empty({ 0, 4 }, { dtype = dt }))
      assert.same({ { 0, 0, 0, 0 }, { 0, 0, 0, 0 }, { 0, 0, 0, 0 } }, z:totable())
      local out = randn({ 3, 4 }, dt)
      local c0 = out:tolist_flat()
      ms.matmul(ms.empty({ 3, 0 }, { dtype = dt }), ms.empty({ 0, 4 }, { dtype = dt }), { beta = 2, out = out })
      local got = out:tolist_flat()
      for i = 1, #c0 do assert.equals(2 * c0[i], got[i]) end
      -- beta 0 ignores dst's old contents here too: NaN (and inf) in it give zeros, not 0 * NaN
      local dirty = ms.full({ 3, 4 }, NaN, { dtype = dt })
      dirty[1][2] = math.huge
      ms.matmul(ms.empty({ 3, 0 }, { dtype = dt }), ms.empty({ 0, 4 }, { dtype = dt }), { out = dirty })
      assert.same({ { 0, 0, 0, 0 }, { 0, 0, 0, 0 }, { 0, 0, 0, 0 } }, dirty:totable())
      assert.same({ 0, 4 }, ms.matmul(ms.empty({ 0, 3 }, { dtype = dt }), randn({ 3, 4 }, dt)):shape())
    end
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cpu eye and diag", function()
  it("eye puts ones on the main diagonal of any shape, dtype and layout", function()
    for _, dt in ipairs { "f32", "f64", "bf16", "f16", "i32", "u8" } do
      assert.same({ { 1, 0, 0 }, { 0, 1, 0 }, { 0, 0, 1 } }, ms.eye(3, { dtype = dt }):totable())
      assert.same({ { 1, 0, 0, 0, 0 }, { 0, 1, 0, 0, 0 }, { 0, 0, 1, 0, 0 } }, ms.eye(3, 5, { dtype = dt }):totable())
      assert.same({ { 1, 0 }, { 0, 1 }, { 0, 0 } }, ms.eye(3, 2, { dtype = dt }):totable())
    end
    local batch = randn({ 2, 3, 4 })
    core.check(C.ms_eye(T.handle_ctx(batch:context()), T.handle(batch)))
    local e = batch:totable()
    for q = 1, 2 do
      for i = 1, 3 do
        for j = 1, 4 do assert.equals(i == j and 1 or 0, e[q][i][j]) end
      end
    end
    local tv = randn({ 4, 3 }):t()                             -- [3, 4] column-major view
    core.check(C.ms_eye(T.handle_ctx(tv:context()), T.handle(tv)))
    assert.same(ms.eye(3, 4):totable(), tv:totable())
  end)

  it("diag builds diagonal matrices from vectors and extracts diagonals, batched and strided", function()
    for _, dt in ipairs { "f32", "f64", "bf16", "i32" } do
      local v = ms.tensor({ { 1.5, -2, 3 }, { 4, 5, -6.25 } }, { dtype = dt })
      local vv = v:tolist_flat()
      local m = ms.diag(v)
      assert.same({ 2, 3, 3 }, m:shape())
      local mt = m:totable()
      for q = 1, 2 do
        for i = 1, 3 do
          for j = 1, 3 do assert.equals(i == j and vv[(q - 1) * 3 + i] or 0, mt[q][i][j]) end
        end
      end
      assert.same(v:totable(), ms.diag(m):totable())
    end
    local a = randn({ 5, 5 })
    local at = a:t()
    local d = ms.diag(at):tolist_flat()
    local full = a:totable()
    for i = 1, 5 do assert.equals(full[i][i], d[i]) end
    local sv = randn({ 10 }):slice(0, 0, 10, 2)                -- stepped vector
    local dm = ms.diag(sv):totable()
    local svv = sv:tolist_flat()
    for i = 1, 5 do assert.equals(svv[i], dm[i][i]) end
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- eigh: a cyclic Jacobi eigensolver in f64 is the reference for the eigenvalues
-- ---------------------------------------------------------------------------------------------------
local function jacobi_eigenvalues(A)
  local n = #A
  local a = {}
  local frob = 0
  for i = 1, n do
    a[i] = {}
    for j = 1, n do a[i][j] = A[i][j] frob = frob + A[i][j] ^ 2 end
  end
  for _ = 1, 100 do
    local off = 0
    for p = 1, n do for q = p + 1, n do off = off + a[p][q] ^ 2 end end
    if off <= 1e-32 * frob then break end
    for p = 1, n - 1 do
      for q = p + 1, n do
        if a[p][q] ~= 0 then
          local theta = (a[q][q] - a[p][p]) / (2 * a[p][q])
          local t = (theta >= 0 and 1 or -1) / (math.abs(theta) + math.sqrt(theta * theta + 1))
          local c = 1 / math.sqrt(t * t + 1)
          local s = t * c
          for k = 1, n do
            local akp, akq = a[k][p], a[k][q]
            a[k][p], a[k][q] = c * akp - s * akq, s * akp + c * akq
          end
          for k = 1, n do
            local apk, aqk = a[p][k], a[q][k]
            a[p][k], a[q][k] = c * apk - s * aqk, s * apk + c * aqk
          end
        end
      end
    end
  end
  local w = {}
  for i = 1, n do w[i] = a[i][i] end
  table.sort(w)
  return w
end

-- symmetric [..., n, n] from fresh normals: (x + x^T) / 2 (exact)
local function sym(shape, dt)
  local x = randn(shape, dt)
  return (x + x:transpose(-2, -1)) * 0.5
end

-- per matrix: eigenvalues vs Jacobi, ascending order, A v = V diag(w) reconstruction, V^T V = I
local function check_eigh(A, w, v, tol, what)
  local n = #A
  local frob = 0
  for i = 1, n do for j = 1, n do frob = frob + A[i][j] ^ 2 end end
  frob = math.max(math.sqrt(frob), 1)
  local ref = jacobi_eigenvalues(A)
  for i = 1, n do
    assert(i == 1 or w[i - 1] <= w[i], what .. ": eigenvalues ascend")
    local err = math.abs(w[i] - ref[i])
    if not (err <= tol * frob) then
      error(("%s: eigenvalue %d is %.12g, Jacobi gives %.12g"):format(what, i, w[i], ref[i]))
    end
  end
  if not v then return end
  for i = 1, n do
    for j = 1, n do
      local rec, dotp = 0, 0
      for k = 1, n do
        rec = rec + v[i][k] * w[k] * v[j][k]
        dotp = dotp + v[k][i] * v[k][j]
      end
      local e1, e2 = math.abs(rec - A[i][j]), math.abs(dotp - (i == j and 1 or 0))
      if not (e1 <= tol * frob) then error(("%s: V diag(w) V^T differs from A at [%d,%d] by %.3g"):format(what, i, j, e1)) end
      if not (e2 <= tol * n) then error(("%s: V^T V differs from I at [%d,%d] by %.3g"):format(what, i, j, e2)) end
    end
  end
end

describe("cpu eigh", function()
  local TOL = { f64 = 1e-12, f32 = 3e-6 }

  it("decomposes symmetric matrices: Jacobi eigenvalues, reconstruction, orthogonality", function()
    for _, dt in ipairs { "f64", "f32" } do
      for _, n in ipairs { 1, 2, 5, 16, 40 } do
        local a = sym({ n, n }, dt)
        local w, v = ms.eigh(a)
        assert.same({ n }, w:shape())
        assert.same({ n, n }, v:shape())
        check_eigh(a:totable(), w:tolist_flat(), v:totable(), TOL[dt], ("%s n=%d"):format(dt, n))
      end
    end
  end)

  it("works batched and on strided inputs, and reads only the lower triangle", function()
    for _, dt in ipairs { "f64", "f32" } do
      local a = sym({ 2, 3, 6, 6 }, dt)
      local w, v = ms.eigh(a)
      assert.same({ 2, 3, 6 }, w:shape())
      local at, wt, vt = a:totable(), w:totable(), v:totable()
      for p = 1, 2 do
        for q = 1, 3 do check_eigh(at[p][q], wt[p][q], vt[p][q], TOL[dt], dt .. " batch member") end
      end
      -- a non-symmetric matrix: only its lower triangle counts (through a transposed view: the upper one)
      local x = randn({ 7, 7 }, dt)
      local xt = x:t()
      local full = xt:totable()
      for i = 1, 7 do for j = i + 1, 7 do full[i][j] = full[j][i] end end
      local w2, v2 = ms.eigh(xt)
      check_eigh(full, w2:tolist_flat(), v2:totable(), TOL[dt], dt .. " lower triangle of a transposed view")
      local w3, v3 = ms.eigh(x:t(), { vectors = false })
      assert.is_nil(v3)
      H.assert_close(w3:tolist_flat(), w2:tolist_flat(), TOL[dt] * 10, TOL[dt] * 10, "values only")
    end
  end)

  it("refuses n past 32000 on every backend (the solvers count the workspace in an int), changing nothing", function()
    -- a is read in any layout: an expanded zero is a 32001 x 32001 operand in 4 bytes; values only, so no v
    for _, dev in ipairs(H.has_cuda and { "cpu", "cuda" } or { "cpu" }) do
      local ctx = ms.device(dev)
      local a = ms.zeros({ 1, 1 }, { ctx = ctx }):expand({ 32001, 32001 })
      local w = ms.full({ 32001 }, 7, { ctx = ctx })
      local st = C.ms_eigh(T.handle_ctx(ctx), T.handle(w), nil, T.handle(a), nil)
      assert.equals(C.MS_E_UNSUPPORTED, st, dev)
      assert.truthy(ffi.string(C.ms_last_error()):find("n=32001", 1, true), dev)
      assert.equals(7, w:min(), dev)
      assert.equals(7, w:max(), dev)
    end
  end)

  it("refuses non-finite input with a numerical error and leaves the outputs alone", function()
    local a = sym({ 4, 4 }, "f64")
    local vals = a:totable()
    vals[3][2] = NaN
    local bad = ms.tensor(vals, { dtype = "f64" })
    H.expect_error(function() ms.eigh(bad) end, "non-finite")
    local w = ms.full({ 4 }, 7, { dtype = "f64" })
    local st = C.ms_eigh(T.handle_ctx(bad:context()), T.handle(w), nil, T.handle(bad), core.out_int)
    assert.equals(C.MS_E_NUMERIC, st)
    assert.equals(-5, core.out_int[0])
    assert.same({ 7, 7, 7, 7 }, w:totable())
  end)
end)
