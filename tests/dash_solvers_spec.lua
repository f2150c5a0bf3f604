-- Inverse p-th roots on stacks (ms_inv_root) and spectrum estimates (ms_spectrum_estimate), judged the way DASH
-- uses roots: per-block grafting cancels any positive scalar, so normalized roots X / ||X||_F (and the grafted
-- direction X G X) are compared with an f64 eigendecomposition of the same damped factor, on SPD blocks with
-- controlled spectra (condition numbers 1e1 to 1e8, spread and clustered, rank-deficient, all-zero), p = 2 and 4.
-- Each method is held to the resolution floor moonstep.h documents: above it (by a margin of 2) the error is
-- <= 1e-4 in f32; below it (by 10) the root under-inverts (never over-inverts, never NaN) and the residual says
-- so.  Then: iteration counts and per-block stopping, index subsets, 16-bit products, condition estimates within
-- 2x up to 1e6, and every bad-input error.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local ffi, C = core.ffi, core.C

local B = 24
-- the documented floors (moonstep.h, engine/cpu/dash.c), normalized eigenvalue y = lambda_min / s
local FLOOR = {
  ndb = { [2] = 3.2e-3, [4] = 2.4e-3 }, cn = { [2] = 2.1e-3, [4] = 4.9e-4 },
  chebyshev = { [2] = 6.5e-3, [4] = 5.6e-3 }, evd = { [2] = 6.5e-5, [4] = 6.5e-5 },
}

-- below the floor, the largest factor by which a method's root can exceed the exact one: NDB's root 4 chains a
-- square root that is too small into an inverse square root (up to 2.15x near y = 1e-5, scalar iteration);
-- everything else only under-inverts
local OVER = { ndb = { [2] = 1, [4] = 2.2 }, cn = { [2] = 1, [4] = 1 }, chebyshev = { [2] = 1, [4] = 1 } }

local function orthogonal(b, seed)
  local G = ms.randn({ b, b }, { dtype = "f64", seed = seed })
  local _, Q = ms.eigh(G + G:t())
  return Q
end

local spread, clustered = H.spectrum_spread, H.spectrum_clustered

-- blocks: {name, eigenvalues (times a random overall size)}; A = Q diag(l) Q^T in f64, stacked in f32
local function make_blocks(b, seed0)
  local cases = {}
  for _, k in ipairs { 3, 1e1, 3e1, 1e2, 1e3, 1e4, 1e6, 1e8 } do
    cases[#cases + 1] = { "spread " .. k, spread(k, b) }
    cases[#cases + 1] = { "clustered " .. k, clustered(k, b) }
  end
  local rd = spread(1e2, b)
  for i = b - 5, b do rd[i] = 0 end
  cases[#cases + 1] = { "rank-deficient", rd }
  local zero = {}
  for i = 1, b do zero[i] = 0 end
  cases[#cases + 1] = { "zero", zero }
  local stack = ms.empty({ #cases, b, b })
  for i, c in ipairs(cases) do
    local size = 10 ^ (4 * ms.rand({ 1 }, { dtype = "f64", seed = seed0 + 1000 + i }):item() - 2)
    for j = 1, b do c[2][j] = c[2][j] * size end
    local Q = orthogonal(b, seed0 + i)
    c.A = ms.matmul(Q * ms.tensor(c[2], { dtype = "f64" }), Q, { trans_b = true })
    stack:select(0, i - 1):copy_(c.A)
    c.A32 = stack:select(0, i - 1):to("f64")    -- what the solver sees
  end
  return cases, stack
end

-- the exact root of A32 + eps I (f64), its eigenvalues (ascending) and eigenvectors
local function exact(c, eps, p)
  local b = c.A32:size(0)
  local w, V = ms.eigh(c.A32 + ms.eye(b, { dtype = "f64" }) * eps)
  local wl = w:tolist_flat()
  local inv = {}
  for j = 1, b do inv[j] = wl[j] > 0 and wl[j] ^ (-1 / p) or 0 end
  return ms.matmul(V * ms.tensor(inv, { dtype = "f64" }), V, { trans_b = true }), wl, V, inv
end

local function normalized_error(x, xt)
  return (x / x:norm() - xt / xt:norm()):norm()
end

local function finite(t)
  for _, v in ipairs(t:tolist_flat()) do if v ~= v or v == math.huge or v == -math.huge then return false end end
  return true
end

local function vals(t) return t:tolist_flat() end

-- y of the smallest eigenvalue under the method's scale (PIM: 2 lambda_max, as pi_const = 2 makes it)
local function y_min(method, scaling, wl, eps, A)
  local s
  if method == "evd" or scaling == "fro" then
    s = (A + ms.eye(A:size(0), { dtype = "f64" }) * eps):norm()
  else
    s = 2 * (wl[#wl] + 1e-6)
  end
  return math.max(wl[1], 0) / s
end

describe("ms.inv_root accuracy against an f64 eigendecomposition", function()
  local cases, stack = make_blocks(B, 4100)
  local G = ms.randn({ B, B }, { dtype = "f64", seed = 4099 })
  for _, method in ipairs { "evd", "cn", "ndb", "chebyshev" } do
    for _, p in ipairs { 2, 4 } do
      for _, scaling in ipairs(method == "evd" and { "fro" } or { "fro", "pim" }) do
        it(("%s, p = %d, %s scaling: within 1e-4 above the floor, under-inverting below it"):format(method, p, scaling), function()
          local eps = method == "evd" and 1e-10 or 0
          local X, res, its = ms.inv_root(stack, { method = method, root = p, scaling = scaling, eps = eps,
                                                   steps = method == "chebyshev" and 60 or 10, residual = true,
                                                   iters = true, seed = 11 })
          local rv, iv = vals(res), vals(its)
          local checked = { above = 0, below = 0 }
          for i, c in ipairs(cases) do
            local x = X:select(0, i - 1):to("f64")
            assert(finite(x), c[1] .. ": non-finite root")
            assert(rv[i] == rv[i], c[1] .. ": NaN residual")
            local want_iters = method == "evd" and 0 or method == "chebyshev" and 60 or method == "ndb" and (p == 4 and 20 or 10) or 10
            assert.are.equal(want_iters, iv[i])
            if c[1] ~= "zero" then
              local xt, wl, V, inv = exact(c, eps, p)
              local y = y_min(method, scaling, wl, eps, c.A32)
              local floor = FLOOR[method][p]
              local err = normalized_error(x, xt)
              if y >= 2 * floor then
                checked.above = checked.above + 1
                assert(err <= 1e-4, ("%s: y = %.2g (floor %.2g): normalized error %.3g > 1e-4"):format(c[1], y, floor, err))
                -- the grafted direction X G X, normalized
                local u, ut = ms.matmul(ms.matmul(x, G), x), ms.matmul(ms.matmul(xt, G), xt)
                local uerr = normalized_error(u, ut)
                assert(uerr <= 2e-4, ("%s: grafted direction error %.3g"):format(c[1], uerr))
                local kappa = wl[#wl] / wl[1]
                assert(rv[i] <= math.max(1e-3, 2e-6 * kappa), ("%s: residual %.3g above the root's accuracy"):format(c[1], rv[i]))
              elseif y <= floor / 10 and method ~= "evd" then
                checked.below = checked.below + 1
                -- in the eigenbasis of A (directions whose eigenvalue is positive after rounding to f32):
                -- no direction inverted more than the documented bound, the smallest one visibly not resolved
                local xmax = 0
                for j = 1, B do xmax = math.max(xmax, inv[j]) end
                local over = OVER[method][p]
                local worst = math.huge
                for j = 1, B do
                  if wl[j] > 0 then
                    local v = V:slice(1, j - 1, j)
                    local rq = ms.matmul(ms.matmul(v, x, { trans_a = true }), v):item()
                    assert(rq <= inv[j] * over * (1 + 1e-3) + 1e-4 * xmax,
                           ("%s: eigen-direction %d inverted %.4gx (bound %g)"):format(c[1], j, rq / inv[j], over))
                    assert(rq > 0, ("%s: eigen-direction %d has root %.3g <= 0"):format(c[1], j, rq))
                    worst = math.min(worst, math.abs(rq / inv[j] - 1) > 1e-2 and 0 or 1)
                  end
                end
                assert(worst == 0, ("%s: y = %.2g far below the floor, yet every direction resolved"):format(c[1], y))
                assert(rv[i] > 1e-3, ("%s: residual %.3g does not show the unresolved directions"):format(c[1], rv[i]))
              end
            end
          end
          -- each method meets both regimes on this set (EVD: only above)
          assert(checked.above >= 3, "too few blocks above the floor: " .. checked.above)
          if method ~= "evd" then assert(checked.below >= 3, "too few blocks below the floor: " .. checked.below) end
        end)
      end
    end
  end

  it("EVD below its floor stays finite and bounded by eps^(-1/p) (evd_shift), and without the shift gives a pseudo-inverse", function()
    for _, p in ipairs { 2, 4 } do
      local eps = 1e-6
      local X = ms.inv_root(stack, { method = "evd", root = p, eps = eps })
      for i, c in ipairs(cases) do
        local x = X:select(0, i - 1):to("f64")
        assert(finite(x), c[1])
        local w = vals((ms.eigh(x)))
        assert(w[#w] <= eps ^ (-1 / p) * (1 + 1e-4), ("%s: largest root eigenvalue %.4g > eps^(-1/p)"):format(c[1], w[#w]))
        assert(w[1] > 0, c[1] .. ": root not positive definite")
      end
      -- the zero block: shift gives eps^(-1/p) I, no shift with eps = 0 gives 0
      local zi = #cases
      local xz = X:select(0, zi - 1):to("f64")
      H.assert_close(vals(xz), vals(ms.eye(B, { dtype = "f64" }) * (2 * eps) ^ (-1 / p)), 1e-5, 1e-5, "zero block")
      local X0 = ms.inv_root(stack:narrow(0, zi - 1, 1), { method = "evd", root = p, eps = 0, evd_shift = false })
      for _, v in ipairs(vals(X0)) do assert.are.equal(0, v) end
    end
  end)

  it("gives finite roots and residuals for an all-zero block with every method and eps = 0", function()
    local Z = ms.zeros({ 2, 8, 8 })
    for _, method in ipairs { "cn", "ndb", "chebyshev" } do
      for _, scaling in ipairs { "fro", "pi", "pim" } do
        local X, res = ms.inv_root(Z, { method = method, scaling = scaling, eps = 0, residual = true })
        assert(finite(X), method .. "/" .. scaling)
        for _, r in ipairs(vals(res)) do H.assert_close(r, 1, 1e-6, 1e-6, method .. " residual of a zero block") end
      end
    end
  end)
end)

describe("ms.inv_root iterations, stopping, subsets and 16-bit products", function()
  local cases, stack = make_blocks(16, 4200)

  it("stops each block on its own (CN: max |M - I|, NDB: max |Z Y - I|) and reports its iterations", function()
    local easy = ms.eye(16):reshape({ 1, 16, 16 }) * 3 + ms.randn({ 1, 16, 16 }, { seed = 4201 }) * 0.01
    easy = ms.matmul(easy, easy, { trans_b = true })
    local pair = ms.empty({ 2, 16, 16 })
    pair:select(0, 0):copy_(easy:select(0, 0))
    pair:select(0, 1):copy_(stack:select(0, 10))         -- spread 1e4: needs many more steps
    for _, m in ipairs { { "cn", 30, 30 }, { "ndb", 30, 60 } } do
      local X0, _, it0 = ms.inv_root(pair, { method = m[1], steps = m[2], scaling = "fro", iters = true })
      local X1, _, it1 = ms.inv_root(pair, { method = m[1], steps = m[2], scaling = "fro", iters = true, tolerance = 1e-5 })
      local i0, i1 = vals(it0), vals(it1)
      assert.are.equal(m[3], i0[1])
      assert.are.equal(m[3], i0[2])
      assert(i1[1] < m[3] / 2, m[1] .. ": the easy block ran " .. i1[1] .. " iterations")
      assert(i1[2] > i1[1] + 4, m[1] .. ": the hard block stopped as early as the easy one")
      -- the early stop changes the easy block's root by no more than its tolerance allows
      local a, b = X0:select(0, 0):to("f64"), X1:select(0, 0):to("f64")
      assert(normalized_error(b, a) < 1e-5, m[1] .. ": early stop moved the root")
    end
  end)

  it("works only on the blocks of `index`, leaving the others (and their outputs) as they were", function()
    local x = ms.full({ stack:size(0), 16, 16 }, 7)
    local res, its = ms.full({ stack:size(0) }, -7), ms.full({ stack:size(0) }, -7, { dtype = "i32" })
    ms.inv_root(stack, { method = "cn", out = x, residual = res, iters = its, index = { 3, 0 } })
    local full = ms.inv_root(stack, { method = "cn" })
    local rv, iv = vals(res), vals(its)
    for k = 0, stack:size(0) - 1 do
      local got = vals(x:select(0, k))
      if k == 0 or k == 3 then
        assert.are.same(vals(full:select(0, k)), got)
        assert(rv[k + 1] >= 0)
        assert.are.equal(10, iv[k + 1])
      else
        for _, v in ipairs(got) do assert.are.equal(7, v) end
        assert.are.equal(-7, rv[k + 1])
        assert.are.equal(-7, iv[k + 1])
      end
    end
    -- an empty index changes nothing
    ms.inv_root(stack, { method = "ndb", out = x, index = ms.empty({ 0 }, { dtype = "i32" }) })
    for _, v in ipairs(vals(x:select(0, 1))) do assert.are.equal(7, v) end
  end)

  it("rounds the operands of the documented products to bf16 / f16 (accuracy of the rounding, not f32's)", function()
    local easy = stack:narrow(0, 0, 2)      -- spread and clustered, kappa 3
    local e = {}
    for i = 1, 2 do e[i] = exact(cases[i], 0, 4) end
    for _, method in ipairs { "cn", "ndb", "chebyshev" } do
      local X32 = ms.inv_root(easy, { method = method, scaling = "fro" })
      for dt, tol in pairs { bf16 = 3e-2, f16 = 5e-3 } do
        local X = ms.inv_root(easy, { method = method, scaling = "fro", matmul_dtype = dt })
        for i = 1, 2 do
          local x = X:select(0, i - 1):to("f64")
          local err = normalized_error(x, e[i])
          assert(err <= tol, ("%s %s block %d: error %.3g > %.3g"):format(method, dt, i, err, tol))
          assert(normalized_error(x, X32:select(0, i - 1):to("f64")) > 1e-5, method .. " " .. dt .. ": no rounding seen")
        end
      end
    end
  end)

  it("is reproducible (the same seed, the same bits) and independent of the thread count", function()
    for _, method in ipairs { "cn", "ndb", "chebyshev", "evd" } do
      local o = { method = method, scaling = "pim", residual = true, seed = 5, eps = method == "evd" and 1e-10 or 0 }
      local a, ra = ms.inv_root(stack, o)
      local one = ms.context({ device = "cpu", num_threads = 1 })
      local s1 = stack:to(one)
      local b, rb = ms.inv_root(s1, o)
      assert.are.same(vals(a), vals(b))
      assert.are.same(vals(ra), vals(rb))
    end
  end)
end)

describe("ms.inv_root and ms.spectrum_estimate under another thread count", function()
  -- Blocks large enough to be solved side by side (engine/cpu/dash.c, blas_one_thread), with OpenBLAS on 2
  -- threads: a context of 1 thread used to leave each block OpenBLAS's threads while one of 3 put OpenBLAS on
  -- one, and OpenBLAS rounds differently on more threads, so the roots (EVD most) and a run resumed under
  -- another --threads came out different.
  pcall(ffi.cdef, "void openblas_set_num_threads(int n); int openblas_get_num_threads(void);")
  local okb, blas = pcall(function()
    local lib = ffi.C
    local _ = lib.openblas_get_num_threads
    return lib
  end)
  if not okb then okb, blas = pcall(ffi.load, "openblas") end
  if not okb then okb, blas = pcall(ffi.load, "libopenblas.so.0") end

  it("gives the same bits under 1 and 3 threads, OpenBLAS on 2 (every method, pim scaling, estimates)", function()
    assert(okb, "OpenBLAS's openblas_set_num_threads is not reachable: " .. tostring(blas))
    local saved = blas.openblas_get_num_threads()
    blas.openblas_set_num_threads(2)
    local ok, err = pcall(function()
      local out = {}
      for _, nt in ipairs { 1, 3 } do
        local cpu = ms.context({ device = "cpu", num_threads = nt })
        local g = ms.randn({ 4, 160, 160 }, { seed = 91, ctx = cpu })
        local a = ms.matmul(g, g, { trans_b = true })
        local r = {}
        for _, method in ipairs { "evd", "cn", "ndb", "chebyshev" } do
          local x, res = ms.inv_root(a, { method = method, root = 4, scaling = "pim", residual = true, seed = 4,
                                          eps = method == "evd" and 1e-10 or 0 })
          r[method], r[method .. " residual"] = vals(x), vals(res)
        end
        local lmax, lmin = ms.spectrum_estimate(a, { x_root = ms.inv_root(a, { method = "evd", root = 4, eps = 1e-10 }),
                                                     root = 4, seed = 6, vectors = 32 })
        r.lam_max, r.lam_min = vals(lmax), vals(lmin)
        out[nt] = r
      end
      for key, want in pairs(out[1]) do
        local got = out[3][key]
        for i = 1, #want do
          if want[i] ~= got[i] and not (want[i] ~= want[i] and got[i] ~= got[i]) then
            error(("%s differs at %d under 3 threads: %.9g, under 1: %.9g"):format(key, i, got[i], want[i]))
          end
        end
      end
    end)
    blas.openblas_set_num_threads(saved)
    assert(ok, err)
  end)
end)

describe("ms.inv_root EVD on the CPU", function()
  it("does a block again alone after the parallel part where asked (MOONSTEP_TEST_EVD_REDO), with the same bits", function()
    -- the path a block takes when its ssyevd, run beside the others, fails or gives a non-finite root
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local cpu = ms.context({ device = "cpu", num_threads = 4 })
    local a = ms.randn({ 8, 64, 64 }, { seed = 77, ctx = cpu })
    local spd = ms.matmul(a, a, { trans_b = true })
    local index = ms.tensor({ 6, 1, 3 }, { dtype = "i32", ctx = cpu })
    for _, o in ipairs {
      { method = "evd", root = 2, eps = 1e-6, residual = true, iters = true, seed = 3 },
      { method = "evd", root = 4, eps = 1e-6, residual = true, seed = 3, index = index },
    } do
      -- (with an index only its blocks are written: the others are compared nowhere)
      local blocks = o.index and { 6, 1, 3 } or { 0, 1, 2, 3, 4, 5, 6, 7 }
      local x0, r0 = ms.inv_root(spd, o)
      local r0v = vals(r0)
      for _, k in ipairs { 0, 3, 7 } do
        ffi.C.setenv("MOONSTEP_TEST_EVD_REDO", tostring(k), 1)
        local ok, x, r = pcall(ms.inv_root, spd, o)
        ffi.C.unsetenv("MOONSTEP_TEST_EVD_REDO")
        assert(ok, x)
        local rv = vals(r)
        for _, j in ipairs(blocks) do
          local want, got = vals(x0:select(0, j)), vals(x:select(0, j))
          for i = 1, #want do
            assert(want[i] - want[i] == 0, "a non-finite root entry")
            if want[i] ~= got[i] then error(("block %d redone: root of block %d differs at %d"):format(k, j, i)) end
          end
          assert.are.equal(r0v[j + 1], rv[j + 1], ("block %d redone: residual of block %d"):format(k, j))
        end
      end
    end
  end)
end)

describe("ms.spectrum_estimate", function()
  it("estimates lambda_max, lambda_min and the condition number within 2x up to 1e6", function()
    local b = 32
    local n = 0
    for _, kappa in ipairs { 1e1, 1e2, 1e4, 1e6 } do
      for _, shape in ipairs { spread, clustered } do
        n = n + 1
        local l = shape(kappa, b)
        local Q = orthogonal(b, 4300 + n)
        local A = ms.matmul(Q * ms.tensor(l, { dtype = "f64" }), Q, { trans_b = true }):to("f32"):reshape({ 1, b, b })
        local X = ms.inv_root(A, { method = "evd", eps = 0, root = 4 })
        for _, bf16 in ipairs { false, true } do
          local lmax, lmin = ms.spectrum_estimate(A, { x_root = X, root = 4, eps = 0, bf16 = bf16, seed = n })
          local hi, lo = lmax:item(), lmin:item()
          local tmax, tmin = math.max(unpack(l)), math.min(unpack(l))
          assert(hi <= tmax * 1.01 and hi >= tmax / 2, ("kappa %g: lam_max %.4g vs %.4g"):format(kappa, hi, tmax))
          assert(lo >= tmin / 2 and lo <= tmin * 2, ("kappa %g: lam_min %.4g vs %.4g"):format(kappa, lo, tmin))
          local k = hi / lo
          assert(k >= kappa / 2 and k <= kappa * 2, ("kappa %g estimated as %.4g"):format(kappa, k))
        end
      end
    end
  end)

  it("gives lam_max = 0 and lam_min = +inf (no NaN) for an all-zero block, and overestimates lam_min from an under-inverted root", function()
    local Z = ms.zeros({ 1, 8, 8 })
    local lmax, lmin = ms.spectrum_estimate(Z, { x_root = ms.zeros({ 1, 8, 8 }), eps = 1e-6 })
    H.assert_close(lmax:item(), 0, 0, 1e-12)
    assert.are.equal(math.huge, lmin:item())
    local l = spread(1e6, 16)
    local A = ms.matmul(orthogonal(16, 4400) * ms.tensor(l, { dtype = "f64" }), orthogonal(16, 4400), { trans_b = true })
    A = A:to("f32"):reshape({ 1, 16, 16 })
    local X = ms.inv_root(A, { method = "cn", root = 2, scaling = "fro" })      -- far below CN's floor
    local _, est = ms.spectrum_estimate(A, { x_root = X, root = 2 })
    assert(est:item() > 10 * l[16], "an under-inverted root should overestimate lambda_min")
  end)

  it("starts from moonstep.h's vectors: ms_rand's normals at offsets k, 2^32 + k (roots), 2^62 + k (sketches)", function()
    local b, seed = 12, 77
    local d = {}
    for i = 1, b do d[i] = 1 + i * 0.37 end
    local A = ms.empty({ 2, b, b })
    A:select(0, 0):copy_(ms.diag(ms.tensor(d)))
    A:select(0, 1):copy_(ms.diag(ms.tensor(d)) * 2)
    -- one power step, one vector, from v0: q = (A v)^T A (A v) / |A v|^2
    local function one_step(scale, offset, root)
      local v = vals(ms.randn({ b, 1 }, { seed = seed, offset = offset }))
      local num, den = 0, 0
      for i = 1, b do
        local a = (scale * d[i]) ^ (root and -1 / 4 or 1)
        num = num + (a * v[i]) ^ 2 * a
        den = den + (a * v[i]) ^ 2
      end
      return num / den
    end
    local X = ms.inv_root(A, { method = "evd", eps = 0 })
    local lmax, lmin = ms.spectrum_estimate(A, { vectors = 1, steps = 1, eps = 0, seed = seed, x_root = X, root = 4 })
    for k = 0, 1 do
      H.assert_close(vals(lmax)[k + 1], one_step(k + 1, k), 1e-5, 0, "lam_max of block " .. k)
      H.assert_close(vals(lmin)[k + 1], one_step(k + 1, 2 ^ 32 + k, true) ^ -4, 1e-4, 0, "lam_min of block " .. k)
    end
    -- the residual's sketch: with evd_shift the EVD root of diag(d) + eps I is diag(d + 2 eps)^(-1/4), so
    -- X^4 A_reg V - V = diag(-eps / (d + 2 eps)) V, weighting each row of V differently
    local eps = 0.5
    local _, res = ms.inv_root(A, { method = "evd", eps = eps, residual = true, seed = seed })
    for k = 0, 1 do
      local v = vals(ms.randn({ b, 4 }, { seed = seed, offset = 0x4000000000000000ULL + k }))   -- 2^62 + k, exact
      local rr, vv = 0, 0
      for i = 1, b do
        for j = 1, 4 do
          local x = v[(i - 1) * 4 + j]
          rr = rr + (eps / ((k + 1) * d[i] + 2 * eps) * x) ^ 2
          vv = vv + x * x
        end
      end
      H.assert_close(vals(res)[k + 1], math.sqrt(rr / vv), 1e-5, 0, "residual of block " .. k)
    end
  end)

  it("counts one launch per call and is reproducible", function()
    local A = ms.randn({ 3, 8, 8 }, { seed = 4500 })
    A = ms.matmul(A, A, { trans_b = true })
    local before = ms.device("cpu"):mem_stats().launches
    local a = ms.spectrum_estimate(A, { seed = 1 })
    assert.are.equal(before + 1, ms.device("cpu"):mem_stats().launches)
    assert.are.same(vals(a), vals(ms.spectrum_estimate(A, { seed = 1 })))
  end)
end)

describe("inverse-root and spectrum errors", function()
  local function raw_opts(over)
    local o = ffi.new("ms_root_options")
    o.method, o.root, o.steps, o.eps, o.scaling = C.MS_ROOT_NDB, 4, 10, 0, C.MS_SCALING_FRO
    o.pi_steps, o.pi_vectors, o.pi_const, o.eps_power_iter = 10, 16, 2, 1e-6
    o.matmul_dtype = C.MS_DTYPE_F32
    for k, v in pairs(over or {}) do o[k] = v end
    return o
  end
  local cpu = T.handle_ctx(ms.device("cpu"))
  local function call(x, a, over, res, its)
    local st = C.ms_inv_root(cpu, x and T.handle(x) or nil, res and T.handle(res) or nil, its and T.handle(its) or nil,
                             a and T.handle(a) or nil, raw_opts(over))
    return st, ffi.string(C.ms_last_error())
  end

  it("refuses bad options, naming them, and changes nothing", function()
    local a = ms.randn({ 2, 6, 6 }, { seed = 4600 })
    a = ms.matmul(a, a, { trans_b = true })
    local x = ms.full({ 2, 6, 6 }, 3)
    for _, case in ipairs {
      { { method = 9 }, "method" }, { { root = 3 }, "root = 3" }, { { steps = 0 }, "steps = 0" },
      { { eps = -1 }, "eps = -1" }, { { eps = 0 / 0 }, "eps" }, { { scaling = 7 }, "scaling" },
      { { scaling = C.MS_SCALING_PIM, pi_steps = 0 }, "pi_steps" },
      { { scaling = C.MS_SCALING_PIM, pi_vectors = 65 }, "pi_vectors" },
      { { scaling = C.MS_SCALING_PI, pi_const = 0.5 }, "pi_const" },
      { { scaling = C.MS_SCALING_PI, eps_power_iter = -1 }, "eps_power_iter" },
      { { tolerance = -1 }, "tolerance" }, { { matmul_dtype = C.MS_DTYPE_F64 }, "matmul_dtype" },
      { { method = C.MS_ROOT_EVD, matmul_dtype = C.MS_DTYPE_BF16 }, "EVD computes in f32" },
      { { method = C.MS_ROOT_CHEBYSHEV, steps = 5 }, "Chebyshev degree" },
    } do
      local st, msg = call(x, a, case[1])
      assert.are.equal(C.MS_E_ARG, st)
      assert(msg:find(case[2], 1, true), ("message %q lacks %q"):format(msg, case[2]))
    end
    for _, v in ipairs(vals(x)) do assert.are.equal(3, v) end
  end)

  it("refuses bad shapes, dtypes, layouts, overlaps, index entries and NaN for EVD", function()
    local a = ms.randn({ 2, 6, 6 }, { seed = 4601 })
    a = ms.matmul(a, a, { trans_b = true })
    local x = ms.full({ 2, 6, 6 }, 3)
    local cases = {
      { function() return call(x, ms.zeros({ 2, 6, 5 })) end, C.MS_E_SHAPE, "square" },
      { function() return call(x, ms.zeros({ 6, 6 })) end, C.MS_E_SHAPE, "3 dims" },
      { function() return call(ms.zeros({ 3, 6, 6 }), a) end, C.MS_E_SHAPE, "x has shape" },
      { function() return call(x, a:to("f64")) end, C.MS_E_DTYPE, "f32" },
      { function() return call(x:to("bf16"), a) end, C.MS_E_DTYPE, "x has dtype bf16" },
      { function() return call(x, a:transpose(1, 2)) end, C.MS_E_LAYOUT, "contiguous" },
      { function() return call(x, a, nil, ms.zeros({ 3 })) end, C.MS_E_SHAPE, "residual" },
      { function() return call(x, a, nil, nil, ms.zeros({ 2 })) end, C.MS_E_DTYPE, "iters" },
      { function() return call(x, x) end, C.MS_E_LAYOUT, "share memory" },
      { function() return call(nil, a) end, C.MS_E_ARG, "x is NULL" },
      { function() return call(x, a, { index = T.handle(ms.tensor({ 0, 2 }, { dtype = "i32" })) }) end, C.MS_E_ARG, "outside [0, 2)" },
      { function() return call(x, a, { index = T.handle(ms.tensor({ 1, 1 }, { dtype = "i32" })) }) end, C.MS_E_ARG, "twice" },
      { function() return call(x, a, { index = T.handle(ms.tensor({ 1 })) }) end, C.MS_E_DTYPE, "index" },
      { function() return call(x, a, { index = T.handle(ms.zeros({ 3 }, { dtype = "i32" })) }) end, C.MS_E_SHAPE, "K <= N" },
    }
    for i, c in ipairs(cases) do
      local st, msg = c[1]()
      assert.are.equal(c[2], st, ("case %d: %s"):format(i, msg))
      assert(msg:find(c[3], 1, true), ("case %d: message %q lacks %q"):format(i, msg, c[3]))
    end
    local bad = a:clone()
    bad:select(0, 1):select(0, 2):select(0, 3):fill_(0 / 0)
    local st, msg = call(x, bad, { method = C.MS_ROOT_EVD, eps = 1e-10 })
    assert.are.equal(C.MS_E_NUMERIC, st)
    assert(msg:find("block 1", 1, true), msg)
    for _, v in ipairs(vals(x)) do assert.are.equal(3, v) end
    -- an iterative method passes NaN through (no crash, the residual shows it)
    local xn, rn = ms.inv_root(bad, { method = "cn", residual = true })
    assert(vals(rn)[2] ~= vals(rn)[2])
  end)

  it("refuses bad spectrum options and tensors", function()
    local a = ms.zeros({ 2, 4, 4 })
    local lmax = ms.zeros({ 2 })
    local function sp(over, lmin, xr, aa, lm)
      local o = ffi.new("ms_spectrum_options")
      o.vectors, o.steps, o.eps, o.root = 4, 3, 1e-6, 4
      for k, v in pairs(over or {}) do o[k] = v end
      local lh = nil
      if lm ~= false then lh = T.handle(lm or lmax) end
      local st = C.ms_spectrum_estimate(cpu, lh, lmin and T.handle(lmin) or nil,
                                        T.handle(aa or a), xr and T.handle(xr) or nil, o)
      return st, ffi.string(C.ms_last_error())
    end
    for _, c in ipairs {
      { { vectors = 0 }, nil, nil, nil, nil, C.MS_E_ARG, "vectors" },
      { { steps = 0 }, nil, nil, nil, nil, C.MS_E_ARG, "steps" },
      { { eps = -1 }, nil, nil, nil, nil, C.MS_E_ARG, "eps" },
      { {}, ms.zeros({ 2 }), nil, nil, nil, C.MS_E_ARG, "x_root" },
      { { root = 3 }, ms.zeros({ 2 }), a:clone(), nil, nil, C.MS_E_ARG, "root" },
      { {}, nil, nil, ms.zeros({ 2, 4, 3 }), nil, C.MS_E_SHAPE, "square" },
      { {}, nil, nil, nil, ms.zeros({ 3 }), C.MS_E_SHAPE, "lam_max" },
      { {}, nil, nil, nil, false, C.MS_E_ARG, "lam_max is NULL" },
      { {}, ms.zeros({ 2 }), ms.zeros({ 2, 4, 4 }, { dtype = "f64" }), nil, nil, C.MS_E_DTYPE, "x_root" },
    } do
      local st, msg = sp(c[1], c[2], c[3], c[4], c[5])
      assert.are.equal(c[6], st, msg)
      assert(msg:find(c[7], 1, true), ("message %q lacks %q"):format(msg, c[7]))
    end
  end)

  H.cuda_it("refuses tensors of another device", function()
    local a = ms.zeros({ 1, 4, 4 }, { device = "cuda" })
    H.expect_error(function() ms.inv_root(a, { method = "cn", out = ms.zeros({ 1, 4, 4 }) }) end, "is on cpu")
  end)
end)
