-- The CUDA backend against the CPU backend: every core op on fresh random inputs (every float dtype,
-- broadcasting, strided and transposed operands, in place, empty tensors, NaN), Philox bits, the
-- stream-ordered pool (churn, cross-stream deferred frees, the memory cap), contexts on a caller's stream,
-- graph capture and replay with device scalars, and DLPack round trips.  GPU specs are cuda_it: pending
-- where no GPU is present.
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local graph = require("moonstep.graph")
local ffi, C = core.ffi, core.C

local HT, HC = tensor.handle, tensor.handle_ctx
-- compute-sanitizer serialises kernel launches: work "still queued" on another stream has finished by then
local SANITIZER = os.getenv("MS_UNDER_SANITIZER") == "1"

-- H.cuda_it, with busted's `it` and `pending` of this file's environment (tests/helpers.lua sees only _G)
local function cuda_it(name, fn)
  if H.has_cuda then it(name, fn) else pending(name .. " (no CUDA device)") end
end
local GPU = H.has_cuda and ms.device("cuda") or nil
local FLOATS = { "f32", "f64", "bf16", "f16" }

-- fresh random inputs on the CPU, and the same values on the GPU
local function randn(shape, dt, scale)
  local t = ms.randn(shape, { dtype = "f64", seed = H.seed() })
  if scale then t = t * scale end
  return t:to(dt or "f32")
end
local function gpu(t) return t:to(GPU) end
local function flat(t) return t:tolist_flat() end

-- elementwise comparison with a dtype's tolerance (scaled), NaN only matching NaN
local function same(got, want, dt, scale, what)
  local rt, at = H.tols(dt, scale)
  H.assert_close(flat(got), flat(want), rt, at, what)
end

-- exact equality (NaN equal to NaN)
local function exact(got, want, what) H.assert_close(flat(got), flat(want), 0, 0, what) end

-- normwise relative error, infinite when got has a NaN the reference lacks
local function relerr(got, want)
  local g, w = flat(got), flat(want)
  assert.equals(#w, #g)
  local num, den = 0, 0
  for i = 1, #w do
    if g[i] ~= g[i] and w[i] == w[i] then return math.huge end
    num = num + (g[i] - w[i]) ^ 2
    den = den + w[i] ^ 2
  end
  return math.sqrt(num / math.max(den, 1e-300))
end
local function assert_rel(got, want, tol, what)
  local e = relerr(got, want)
  assert(e <= tol, ("%s: relative error %.3g > %.3g"):format(what or "result", e, tol))
end

local function stats(ctx) return ctx:mem_stats() end
local function data_ptr(t) return tonumber(ffi.cast("uintptr_t", C.ms_tensor_data_ptr(HT(t)))) end

-- ---------------------------------------------------------------------------------------------------
describe("cuda runtime on any machine", function()
  it("counts devices and refuses a cuda context with a reason where there is none", function()
    local n = ms.device_count("cuda")
    assert.is_true(n >= 0)
    if n == 0 then
      local msg = H.expect_error(function() ms.context { device = "cuda" } end, "ms_ctx_new: \"cuda\"")
      assert.truthy(msg:find("no CUDA device is usable", 1, true) or msg:find("this build has no CUDA backend", 1, true),
                    msg)
      assert.equals("cpu", ms.context { device = "auto" }:name())
    else
      H.expect_error(function() ms.context { device = "cuda:" .. n } end, "out of range")
      assert.equals("cuda:0", ms.context { device = "auto" }:name())
    end
  end)

  it("has no stream, nothing cached and no graphs on the CPU; events use the host clock", function()
    local cpu = ms.context { device = "cpu" }
    local h = HC(cpu)
    assert.is_true(C.ms_ctx_stream(h) == nil)
    assert.equals(0, C.ms_ctx_empty_cache(h))
    assert.equals(C.MS_E_UNSUPPORTED, C.ms_graph_begin(h))
    assert.truthy(ffi.string(C.ms_last_error()):find("CUDA contexts only", 1, true))
    H.expect_error(function() graph.capture(cpu, function() end) end, "no graph capture")
    local ev = ffi.new("ms_event *[2]")
    assert.equals(0, C.ms_event_new(h, ev))
    assert.equals(0, C.ms_event_new(h, ev + 1))
    local ms_out = ffi.new("double[1]")
    assert.equals(C.MS_E_ARG, C.ms_event_elapsed(ev[0], ev[1], ms_out))   -- never recorded
    assert.equals(0, C.ms_event_record(h, ev[0]))
    ms.randn({ 256, 256 }):sum()
    assert.equals(0, C.ms_event_record(h, ev[1]))
    assert.equals(0, C.ms_event_elapsed(ev[0], ev[1], ms_out))
    assert.is_true(ms_out[0] >= 0 and ms_out[0] < 60e3)
    C.ms_event_free(ev[0])
    C.ms_event_free(ev[1])
    assert.equals(-1, tonumber(C.ms_graph_num_nodes(nil)))
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda contexts", function()
  cuda_it("own a stream, can run on a caller's stream, and count launches", function()
    local A = ms.context { device = "cuda" }
    local sA = C.ms_ctx_stream(HC(A))
    assert.is_true(sA ~= nil)
    assert.equals("cuda:0", A:name())
    assert.equals("cuda", A:device_type())
    local B = ms.context { device = "cuda", stream = sA }
    assert.is_true(C.ms_ctx_stream(HC(B)) == sA)
    -- one stream: B's op is ordered after A's fill without any sync
    local n = 2 ^ 20
    local x = ms.full({ n }, 3, { ctx = A })
    local y = ms.empty({ n }, { ctx = B })
    ms.mul(x, x, y)
    assert.equals(9 * n, y:sum())
    local before = stats(B).launches
    ms.add(y, y, y)
    assert.equals(before + 1, stats(B).launches)
    ms.dot(y, y)
    assert.is_true(stats(B).launches >= before + 3)   -- products, then their sum
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda copy, cast, fill and random", function()
  cuda_it("casts between all 36 dtype pairs exactly as the CPU, dense, strided and broadcast", function()
    local all = { "f32", "f64", "bf16", "f16", "i32", "u8" }
    local vals = flat(randn({ 9, 13 }, "f64", 200))
    vals[1], vals[2], vals[3], vals[4], vals[5] = 0 / 0, math.huge, -math.huge, 255.5, -0.75
    local src64 = ms.tensor(vals, { dtype = "f64" }):view(9, 13)
    for _, sd in ipairs(all) do
      local src = src64:to(sd)
      local g = gpu(src)
      for _, dd in ipairs(all) do
        exact(g:to(dd), src:to(dd), sd .. "->" .. dd)
        local dc = ms.empty({ 13, 9 }, { dtype = dd })
        local dg = ms.empty({ 13, 9 }, { dtype = dd, ctx = GPU })
        dc:copy_(src:t())
        dg:copy_(g:t())
        exact(dg, dc, sd .. "->" .. dd .. " transposed")
      end
    end
    -- broadcast source, strided destination, and a large dense same-dtype copy (cudaMemcpyAsync)
    local row = randn({ 1, 13 })
    local dst = ms.zeros({ 9, 26 }, { ctx = GPU }):slice(1, 0, 26, 2)
    dst:copy_(gpu(row))
    exact(dst, row:expand(9, 13))
    local big = randn({ 300001 }, "bf16")
    exact(gpu(big):clone(), big)
  end)

  cuda_it("fills every dtype from a number and from a device scalar", function()
    for _, dt in ipairs { "f32", "f64", "bf16", "f16", "i32", "u8" } do
      local v = 3.7 + H.seed() % 7
      exact(ms.full({ 5, 7 }, v, { dtype = dt, ctx = GPU }), ms.full({ 5, 7 }, v, { dtype = dt }), dt)
      local s = ms.tensor({ v + 0.5 }, { ctx = GPU, dtype = "f64" })
      local g = ms.empty({ 33 }, { dtype = dt, ctx = GPU }):fill_(0, s)
      exact(g, ms.full({ 33 }, v + 0.5, { dtype = dt }), dt .. " device scalar")
    end
  end)

  cuda_it("draws the CPU's Philox numbers: same uniform bits, normals to 1e-6", function()
    for _, dt in ipairs(FLOATS) do
      local seed, off = H.seed(), H.seed() * 977
      local o = { dtype = dt, seed = seed, offset = off, low = -2, high = 3 }
      local c = ms.rand({ 1001, 3 }, o)
      o.device = "cuda"
      exact(ms.rand({ 1001, 3 }, o), c, dt .. " uniform")
      local n = { dtype = dt, seed = seed, offset = off, mean = 1, std = 2 }
      local cn = ms.randn({ 50001 }, n)
      n.device = "cuda"
      same(ms.randn({ 50001 }, n), cn, dt, dt == "f64" and nil or 0.5, dt .. " normal")
      -- strided destination: element i of the view's row-major order
      local vc = ms.zeros({ 40, 30 }, { dtype = dt }):t()
      local vg = ms.zeros({ 40, 30 }, { dtype = dt, ctx = GPU }):t()
      local ro = ffi.new("ms_rand_options")
      ro.dist, ro.a, ro.b, ro.seed, ro.offset = C.MS_RAND_UNIFORM, 0, 1, seed, 5
      core.check(C.ms_rand(HC(ms.device("cpu")), HT(vc), ro))
      core.check(C.ms_rand(HC(GPU), HT(vg), ro))
      exact(vg, vc, dt .. " strided")
    end
    -- bf16 [0, 1): values that round up to 1 become the largest bf16 below 1, on both
    local o = { dtype = "bf16", seed = 11, offset = 0 }
    local c = ms.rand({ 20000 }, o)
    o.device = "cuda"
    local g = ms.rand({ 20000 }, o)
    exact(g, c)
    assert.is_true(g:max(0):item() < 1)
    -- bf16 [-0.1, 0.1): bf16 has no -0.1, and values that round below it become the smallest bf16 above it
    o = { dtype = "bf16", seed = 12, offset = 0, low = -0.1, high = 0.1 }
    c = ms.rand({ 200000 }, o)
    o.device = "cuda"
    g = ms.rand({ 200000 }, o)
    exact(g, c)
    assert.is_true(g:min(0):item() >= -0.1)
    -- a range that holds no value of the dtype is refused on the GPU too
    o.low, o.high = 0.1001, 0.1002
    local ok, err = pcall(ms.rand, { 8 }, o)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("holds no bf16 value", 1, true), tostring(err))
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda elementwise ops", function()
  local unary = { "neg", "abs", "sqrt", "rsqrt", "exp", "log", "sign", "square", "reciprocal", "tanh", "sigmoid",
                  "relu", "sin", "cos" }

  cuda_it("unary ops in every float dtype: dense, transposed, in place, NaN", function()
    for _, dt in ipairs(FLOATS) do
      local x = randn({ 37, 129 }, dt, 2)
      x[3] = 0 / 0
      local xg = gpu(x)
      for _, op in ipairs(unary) do
        same(xg[op](xg), x[op](x), dt, 1, dt .. " " .. op)
        same(xg:t()[op](xg:t()), x:t()[op](x:t()), dt, 1, dt .. " " .. op .. " transposed")
        local yc, yg = x:clone(), xg:clone()
        yc[op .. "_"](yc)
        yg[op .. "_"](yg)
        same(yg, yc, dt, 1, dt .. " " .. op .. "_")
      end
    end
  end)

  cuda_it("sigmoid's far negative end: the CPU's subnormal values, not 0 (no flush to zero)", function()
    for _, dt in ipairs { "f32", "bf16", "f64" } do
      local far = dt == "f64" and -720 or -90
      local x = ms.rand({ 64 }, { dtype = dt, seed = H.seed(), low = far, high = far + 0.5 })
      local got, want = flat(gpu(x):sigmoid()), flat(x:sigmoid())
      for i = 1, #want do
        -- a few ulps of the libraries' exp apart; bf16's subnormals are 2^-133 apart
        local tol = dt == "bf16" and 2 ^ -133 or 1e-5 * want[i]
        assert(got[i] > 0 and math.abs(got[i] - want[i]) <= tol,
               ("%s sigmoid near %d: element %d is %.17g on the GPU, %.17g on the CPU"):format(dt, far, i, got[i], want[i]))
      end
    end
  end)

  cuda_it("binary ops: every op and float dtype, broadcasting, mixed dtypes, in place, NaN", function()
    local ops = { "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge" }
    for _, dt in ipairs(FLOATS) do
      local a, b = randn({ 4, 1, 37 }, dt), randn({ 5, 1 }, dt)
      local p = (randn({ 4, 5, 37 }, dt)):abs() + 0.5
      a[0][0][1] = 0 / 0
      local ag, bg, pg = gpu(a), gpu(b), gpu(p)
      for _, op in ipairs(ops) do
        local x, xg = op == "pow" and p or a, op == "pow" and pg or ag
        same(ms[op](xg, bg), ms[op](x, b), dt, 1, dt .. " " .. op)
      end
      -- same shapes, dense: the vectorised path; then in place
      local c, d = randn({ 1000, 37 }, dt), randn({ 1000, 37 }, dt)
      local cg, dg = gpu(c), gpu(d)
      for _, op in ipairs { "add", "mul", "div", "maximum" } do
        same(ms[op](cg, dg), ms[op](c, d), dt, 1, dt .. " " .. op .. " dense")
      end
      c:mul_(d)
      cg:mul_(dg)
      same(cg, c, dt, 1, dt .. " mul_")
    end
    -- mixed dtypes (promoted dst), and an f32 dst written from bf16 and f64 sources
    local a, b = randn({ 33, 65 }, "bf16"), randn({ 33, 65 }, "f64")
    same(gpu(a) + gpu(b), a + b, "f64", 1, "bf16 + f64")
    local out_c, out_g = ms.empty({ 33, 65 }), ms.empty({ 33, 65 }, { ctx = GPU })
    ms.sub(a, b, out_c)
    ms.sub(gpu(a), gpu(b), out_g)
    same(out_g, out_c, "f32", 1, "f32 <- bf16 - f64")
  end)

  cuda_it("scalar ops, clamp, lerp, addcmul and addcdiv with numbers and device scalars", function()
    for _, dt in ipairs(FLOATS) do
      local a, b, c = randn({ 17, 41 }, dt), randn({ 17, 41 }, dt), randn({ 41 }, dt):abs() + 0.5
      a[2] = 0 / 0
      local ag, bg, cg = gpu(a), gpu(b), gpu(c)
      same(ag * 2.5, a * 2.5, dt, 1, dt .. " * s")
      same(2.5 - ag, 2.5 - a, dt, 1, dt .. " s - x")
      same(ag ^ 2, a ^ 2, dt, 1, dt .. " ^ 2")
      same(ag:t() / 3, a:t() / 3, dt, 1, dt .. " transposed / s")
      -- the scalar as a device tensor, both orders
      for _, first in ipairs { 0, 1 } do
        local sc = ms.tensor({ -1.75 })
        local sg = gpu(sc)
        local oc, og = ms.empty({ 17, 41 }, { dtype = dt }), ms.empty({ 17, 41 }, { dtype = dt, ctx = GPU })
        core.check(C.ms_binary_scalar(HC(ms.device("cpu")), HT(oc), HT(a), 0, HT(sc), C.MS_BINARY_DIV, first))
        core.check(C.ms_binary_scalar(HC(GPU), HT(og), HT(ag), 0, HT(sg), C.MS_BINARY_DIV, first))
        same(og, oc, dt, 1, dt .. " device scalar, first=" .. first)
      end
      same(ag:clamp(-0.5, 0.7), a:clamp(-0.5, 0.7), dt, 1, dt .. " clamp")
      same(ag:clamp(0.2, nil), a:clamp(0.2, nil), dt, 1, dt .. " clamp lo")
      same(ms.lerp(ag, bg, 0.3), ms.lerp(a, b, 0.3), dt, 1, dt .. " lerp")
      local w = ms.tensor({ 0.8 }, { dtype = dt })
      same(ms.lerp(ag, bg, gpu(w)), ms.lerp(a, b, w), dt, 1, dt .. " lerp w_t")
      same(ms.addcmul(ag, bg, cg, -0.4), ms.addcmul(a, b, c, -0.4), dt, 1, dt .. " addcmul")
      same(ms.addcdiv(ag, bg, cg, 0.9), ms.addcdiv(a, b, c, 0.9), dt, 1, dt .. " addcdiv")
      local v = ms.tensor({ 1.3 })
      same(ms.addcdiv(ag, bg, cg, gpu(v)), ms.addcdiv(a, b, c, v), dt, 1, dt .. " addcdiv v_t")
      local ic, ig = a:clone(), ag:clone()
      ic:addcmul_(b, c, 0.5)
      ig:addcmul_(bg, cg, 0.5)
      same(ig, ic, dt, 1, dt .. " addcmul_")
    end
  end)

  cuda_it("does nothing on empty tensors and refuses what the CPU refuses", function()
    local e = ms.zeros({ 0, 5 }, { ctx = GPU })
    assert.same({ 0, 5 }, (e + e):shape())
    assert.same({ 0, 5 }, e:exp():shape())
    assert.same({ 0, 5 }, ms.rand({ 0, 5 }, { device = "cuda" }):shape())
    local x = ms.zeros({ 4, 4 }, { ctx = GPU })
    H.expect_error(function() ms.add(x, x, ms.zeros({ 4, 1 }, { ctx = GPU }):expand(4, 4)) end, "expanded")
    H.expect_error(function() ms.add(x, ms.zeros({ 4, 4 }), x) end, "cpu", "cuda:0")
    H.expect_error(function() x:expand(2, 4, 4):fill_(1) end, "expanded")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda reductions", function()
  local ops = { "sum", "mean", "max", "min", "norm", "sumsq", "amax" }

  -- per-output tolerance for sums: rounding grows with the sum of magnitudes
  local function check(got, want, absx, dt, what)
    local g, w, m = flat(got), flat(want), flat(absx)
    local rt, at = H.tols(dt)
    for i = 1, #w do
      local tol = at + rt * math.abs(w[i]) + 2e-6 * (m[i] or m[1])
      if w[i] ~= w[i] then assert(g[i] ~= g[i], ("%s[%d]: got %.9g, expected NaN"):format(what, i, g[i]))
      else assert(math.abs(g[i] - w[i]) <= tol, ("%s[%d]: got %.9g, expected %.9g (tol %.3g)"):format(what, i, g[i], w[i], tol)) end
    end
  end

  cuda_it("every op along every kind of dim, in every float dtype, against the CPU", function()
    local cases = {
      { { 7, 300 }, 1 },         -- short rows: a warp per output
      { { 2, 40000 }, 1 },       -- long rows: chunks, then a second pass
      { { 5000, 9 }, 0 },        -- the reduced dim is not the innermost: a thread per output, row chunks
      { { 6, 70, 33 }, 1 },      -- a middle dim
      { { 6, 70, 33 }, 2, true }, -- keepdim
      { { 300, 7 }, -1 },        -- negative dim
    }
    for _, dt in ipairs(FLOATS) do
      for _, case in ipairs(cases) do
        local shape, dim, keep = case[1], case[2], case[3]
        local x = randn(shape, dt)
        local xg = gpu(x)
        local absx = x:to("f64"):abs():sum(dim, keep)
        for _, op in ipairs(ops) do
          local want = x[op](x, dim, keep)
          local got = xg[op](xg, dim, keep)
          assert.same(want:shape(), got:shape())
          check(got, want, op == "sumsq" and (x:to("f64") * x:to("f64")):sum(dim, keep) or absx, dt,
                ("%s %s dim %d of [%s]"):format(dt, op, dim, table.concat(shape, ",")))
        end
      end
      -- whole-tensor reductions, dense and transposed (a copy first), and dot
      local x = randn({ 317, 331 }, dt)
      local xg = gpu(x)
      local absx = x:to("f64"):abs():sum()
      for _, op in ipairs(ops) do
        local m = op == "sumsq" and (x:to("f64") * x:to("f64")):sum() or absx
        check(ms.tensor(xg[op](xg)), ms.tensor(x[op](x)), ms.tensor(m), "f32", dt .. " whole " .. op)
        check(ms.tensor(xg:t()[op](xg:t())), ms.tensor(x[op](x)), ms.tensor(m), "f32", dt .. " whole transposed " .. op)
      end
      local y = randn({ 317, 331 }, dt)
      check(ms.tensor(ms.dot(xg, gpu(y))), ms.tensor(ms.dot(x, y)), ms.tensor((x:to("f64") * y:to("f64")):abs():sum()),
            "f32", dt .. " dot")
    end
    local a, b = randn({ 10007 }, "f32"), randn({ 10007 }, "f64")
    check(ms.tensor(ms.dot(gpu(a), gpu(b))), ms.tensor(ms.dot(a, b)), ms.tensor((a:to("f64") * b):abs():sum()), "f64",
          "f32 . f64")
  end)

  cuda_it("is deterministic, propagates NaN, and handles empty reductions like the CPU", function()
    local x = gpu(randn({ 3, 100003 }))
    local s1, s2 = flat(x:sum(1)), flat(x:sum(1))
    assert.same(s1, s2)
    assert.equals(x:sum(), x:sum())
    local c = randn({ 4, 9 })
    c[1][4] = 0 / 0
    local g = gpu(c)
    for _, op in ipairs { "sum", "max", "min", "amax", "norm" } do
      same(g[op](g, 1), c[op](c, 1), "f32", 1, "NaN " .. op)
      same(g[op](g, 0), c[op](c, 0), "f32", 1, "NaN " .. op .. " dim 0")
    end
    local e = ms.zeros({ 0, 4 }, { ctx = GPU })
    assert.same({ 0, 0, 0, 0 }, flat(e:sum(0)))
    local mean = flat(e:mean(0))
    assert.is_true(mean[1] ~= mean[1])
    assert.same({ 0, 0, 0 }, flat(ms.zeros({ 3, 0 }, { ctx = GPU }):norm(1)))
    H.expect_error(function() e:max(0) end, "zero elements")
    assert.equals(0, ms.dot(e, e))
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda matmul, eye, diag, eigh", function()
  cuda_it("matmul: transposes, alpha/beta, batches, broadcasting, strided operands and dst", function()
    local function mm(a, b, o)
      return ms.matmul(gpu(a), gpu(b), o), ms.matmul(a, b, o)
    end
    for _, ta in ipairs { false, true } do
      for _, tb in ipairs { false, true } do
        local a = randn(ta and { 48, 64 } or { 64, 48 })
        local b = randn(tb and { 80, 48 } or { 48, 80 })
        local g, c = mm(a, b, { trans_a = ta, trans_b = tb })
        assert_rel(g, c, 1e-5, ("f32 trans %s %s"):format(ta, tb))
      end
    end
    -- alpha, beta with a dst holding values
    local a, b, d = randn({ 31, 17 }), randn({ 17, 23 }), randn({ 31, 23 })
    local dc, dg = d:clone(), gpu(d)
    ms.matmul(a, b, { alpha = -0.5, beta = 2, out = dc })
    ms.matmul(gpu(a), gpu(b), { alpha = -0.5, beta = 2, out = dg })
    assert_rel(dg, dc, 1e-5, "alpha/beta")
    -- batches: shared 2-D operand, and batch dims that do not collapse to one stride
    local x, y = randn({ 3, 33, 17 }), randn({ 17, 29 })
    local g, c = mm(x, y)
    assert_rel(g, c, 1e-5, "batched x 2-D")
    x, y = randn({ 4, 1, 8, 6 }), randn({ 1, 3, 6, 5 })
    g, c = mm(x, y)
    assert.same({ 4, 3, 8, 5 }, g:shape())
    assert_rel(g, c, 1e-5, "broadcast batches")
    -- operands cuBLAS cannot read in place (step-2 columns), transposed views, strided dst
    local big = randn({ 40, 90 })
    local bg = gpu(big)
    local sa, sag = big:slice(1, 0, 90, 2), bg:slice(1, 0, 90, 2)   -- [40, 45]
    local w = randn({ 45, 12 })
    assert_rel(ms.matmul(sag, gpu(w)), ms.matmul(sa, w), 1e-5, "strided a")
    assert_rel(ms.matmul(bg:t(), gpu(big)), ms.matmul(big:t(), big), 1e-5, "transposed view")
    local oc = ms.zeros({ 12, 40 }):t()
    local og = ms.zeros({ 12, 40 }, { ctx = GPU }):t()
    ms.matmul(sa, w, { out = oc })
    ms.matmul(sag, gpu(w), { out = og })
    assert_rel(og, oc, 1e-5, "column-major dst")
    local sc = ms.zeros({ 40, 24 }):slice(1, 0, 24, 2)
    local sg = ms.zeros({ 40, 24 }, { ctx = GPU }):slice(1, 0, 24, 2)
    ms.matmul(sa, w, { out = sc, beta = 1 })
    ms.matmul(sag, gpu(w), { out = sg, beta = 1 })
    assert_rel(sg, sc, 1e-5, "strided dst through a temporary")
    -- k = 0
    local z = ms.matmul(ms.zeros({ 5, 0 }, { ctx = GPU }), ms.zeros({ 0, 4 }, { ctx = GPU }))
    assert.same({ 0, 0, 0, 0, 0 }, flat(z:sum(1)))
    -- k = 0 into a dst holding NaN: beta 0 ignores the old contents (0 * NaN would keep them), as on the CPU
    local nan_dst = ms.full({ 5, 4 }, 0 / 0, { ctx = GPU })
    ms.matmul(ms.zeros({ 5, 0 }, { ctx = GPU }), ms.zeros({ 0, 4 }, { ctx = GPU }), { out = nan_dst })
    assert.same({ 0, 0, 0, 0, 0 }, flat(nan_dst:sum(1)))
  end)

  cuda_it("matmul dtypes: f64, bf16 and f16 (f32 accumulation) into any dst, TF32 on request", function()
    local a, b = randn({ 3, 96, 64 }, "f64"), randn({ 3, 64, 80 }, "f64")
    assert_rel(ms.matmul(gpu(a), gpu(b)), ms.matmul(a, b), 1e-12, "f64")
    for _, dt in ipairs { "bf16", "f16" } do
      local x, y = a:to(dt), b:to(dt)
      local ref = ms.matmul(x:to("f64"), y:to("f64"))   -- exact products of the rounded inputs
      for _, out in ipairs { dt, "f32", "f64" } do
        local g = ms.matmul(gpu(x), gpu(y), { dtype = out })
        assert.equals(out, g:dtype())
        assert_rel(g, ref, out == dt and 1e-2 or 1e-5, dt .. " -> " .. out)
      end
      local yt = gpu(y):transpose(1, 2):contiguous()   -- [3, 80, 64], used as its transpose
      assert_rel(ms.matmul(gpu(x), yt, { trans_b = true }), ref, 1e-2, dt .. " trans_b")
    end
    local x, y = randn({ 8, 128, 256 }), randn({ 8, 256, 64 })
    local ref = ms.matmul(x:to("f64"), y:to("f64"))
    assert_rel(ms.matmul(gpu(x), gpu(y)), ref, 1e-5, "f32")
    local t = ms.matmul(gpu(x), gpu(y), { tf32 = true })
    assert_rel(t, ref, 5e-3, "tf32")
    assert.is_true(relerr(t, ref) > 1e-6)   -- TF32 really was used: inputs rounded to 10 bits
    local h = ms.matmul(gpu(x), gpu(y), { dtype = "bf16" })
    assert_rel(h, ref, 1e-2, "f32 inputs into a bf16 dst")
  end)

  cuda_it("eye and diag, batched, both ways", function()
    exact(ms.eye(5, 7, { ctx = GPU }), ms.eye(5, 7))
    exact(ms.eye(6, { ctx = GPU, dtype = "bf16" }), ms.eye(6, { dtype = "bf16" }))
    local v = randn({ 3, 4, 6 })
    exact(ms.diag(gpu(v)), ms.diag(v), "embed")
    local m = randn({ 3, 6, 6 }, "f64")
    exact(ms.diag(gpu(m)), ms.diag(m), "extract")
    exact(ms.diag(gpu(m):transpose(1, 2)), ms.diag(m:transpose(1, 2)), "extract from a transposed view")
    local bg = ms.zeros({ 2, 4, 4 }, { ctx = GPU })
    core.check(C.ms_eye(HC(GPU), HT(bg)))
    exact(bg, ms.eye(4):expand(2, 4, 4))
  end)

  cuda_it("eigh: values and vectors (Jacobi batches and syevd), lower triangle only, non-finite input", function()
    for _, dt in ipairs { "f32", "f64" } do
      for _, shape in ipairs { { 5, 8, 8 }, { 40, 40 }, { 2, 40, 40 }, { 3, 1, 1 } } do
        local a = randn(shape, dt)   -- not symmetric: only its lower triangle is used
        local wc = ms.eigh(a, { vectors = false })
        local wg, vg = ms.eigh(gpu(a))
        local n = shape[#shape]
        local scale = math.max(math.abs(wc:max()), math.abs(wc:min()))
        local tol = dt == "f32" and 2e-5 * n or 1e-11 * n
        H.assert_close(flat(wg), flat(wc), 0, tol * scale, dt .. " eigenvalues")
        -- A v = v diag(w) with the symmetric matrix made of a's lower triangle
        local flatL = flat(a:to("f64"))
        local vals = {}
        local nb = #flatL / (n * n)
        for q = 0, nb - 1 do
          for i = 0, n - 1 do
            for j = 0, n - 1 do
              local r, c = math.max(i, j), math.min(i, j)
              vals[q * n * n + i * n + j + 1] = flatL[q * n * n + r * n + c + 1]
            end
          end
        end
        local sym = ms.tensor(vals, { dtype = "f64" }):view(shape)
        local V, W = vg:to("cpu"):to("f64"), wg:to("cpu"):to("f64")
        local AV = ms.matmul(sym, V)
        local VW = V * W:unsqueeze(-2)
        assert_rel(AV, VW, dt == "f32" and 1e-4 * n or 1e-10 * n, dt .. " residual")
        local VtV = ms.matmul(V, V, { trans_a = true })
        local I = ms.eye(n, { dtype = "f64" })
        assert_rel(VtV, I:expand(VtV:shape()), dt == "f32" and 1e-4 * n or 1e-10 * n, dt .. " orthonormal")
      end
    end
    -- a NaN above the diagonal is never read; below it, the member is refused (info -5, as LAPACKE)
    local a = randn({ 3, 6, 6 })
    a[1][0][4] = 0 / 0
    local ag = gpu(a)
    ms.eigh(ag)
    a[1][4][0] = 0 / 0
    ag = gpu(a)
    local w0 = ms.full({ 3, 6 }, 7, { ctx = GPU })
    local st = C.ms_eigh(HC(GPU), HT(w0), nil, HT(ag), core.out_int)
    assert.equals(C.MS_E_NUMERIC, st)
    assert.equals(-5, core.out_int[0])
    assert.truthy(ffi.string(C.ms_last_error()):find("batch member 1", 1, true))
    exact(w0, ms.full({ 3, 6 }, 7), "w untouched on failure")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda memory pool", function()
  cuda_it("serves 10k alloc/free cycles from its cache: no growth after warm-up", function()
    local ctx = ms.context { device = "cuda" }
    local h = HC(ctx)
    local out = ffi.new("ms_tensor *[1]")
    local sizes = { 1, 100, 513, 4096, 65537, 2 ^ 20, 3 * 2 ^ 20, 40 * 2 ^ 20 }
    local shape = ffi.new("int64_t[1]")
    local function cycle(i)
      shape[0] = math.floor(sizes[i % #sizes + 1] / 4) + 1
      core.check(C.ms_tensor_new(h, C.MS_DTYPE_F32, 1, shape, out))
      local t = out[0]
      core.check(C.ms_fill(h, t, i, nil))
      if i % 3 == 0 then   -- sometimes two live at once
        core.check(C.ms_tensor_new(h, C.MS_DTYPE_F32, 1, shape, out))
        C.ms_tensor_free(out[0])
      end
      C.ms_tensor_free(t)
    end
    for i = 1, 64 do cycle(i) end
    local warm = stats(ctx)
    for i = 1, 10000 do cycle(i) end
    ctx:sync()
    local after = stats(ctx)
    assert.equals(warm.num_device_allocs, after.num_device_allocs)
    assert.equals(warm.bytes_cached, after.bytes_cached)
    assert.equals(0, after.bytes_in_use)
    assert.is_true(after.num_allocs - warm.num_allocs >= 10000)
    assert.is_true(after.bytes_cached > 40e6)
    core.check(C.ms_ctx_empty_cache(h))
    assert.equals(0, stats(ctx).bytes_cached)
  end)

  -- ~20 ms of context B's work queued, all reading t (n elements): its outputs, each t + t
  local function read_on(B, t, n)
    local outs = {}
    for i = 1, 8 do outs[i] = ms.empty({ n }, { ctx = B }) end
    for _ = 1, 50 do
      for i = 1, 8 do ms.add(t, t, outs[i]) end
    end
    return outs
  end

  cuda_it("does not reuse a block another context's stream still reads", function()
    local A = ms.context { device = "cuda" }
    local B = ms.context { device = "cuda" }
    local n = 16 * 2 ^ 20                      -- 64 MB
    local t = ms.full({ n }, 1, { ctx = A })
    A:sync()
    local outs = read_on(B, t, n)
    local old = data_ptr(t)
    t = nil
    collectgarbage()
    collectgarbage()
    local u = ms.full({ n }, 5, { ctx = A })   -- same size, on A's stream, while B still reads
    if not SANITIZER then
      assert.is_true(data_ptr(u) ~= old, "a block with pending reads on another stream was reused")
    end
    for i = 1, 8 do assert.equals(2 * n, outs[i]:sum()) end
    A:sync()
    B:sync()
    -- once B has passed its uses, the block is reused
    u = nil
    collectgarbage()
    collectgarbage()
    local w = ms.full({ n }, 7, { ctx = A })
    local w2 = ms.full({ n }, 7, { ctx = A })
    assert.is_true(data_ptr(w) == old or data_ptr(w2) == old)
  end)

  cuda_it("does not hand a capture a block another context's stream still reads", function()
    local A = ms.context { device = "cuda" }
    local B = ms.context { device = "cuda" }
    local n = 16 * 2 ^ 20                      -- 64 MB
    local t = ms.full({ n }, 1, { ctx = A })
    local spare = ms.empty({ n }, { ctx = A })  -- a cached block of that size for the capture to take
    A:sync()
    spare = nil
    collectgarbage()
    collectgarbage()
    local outs = read_on(B, t, n)
    local old = data_ptr(t)
    local u
    -- t is freed during the capture while B still reads it: the capture may not reuse its block (its replays
    -- would write it under B's reads), only the spare one
    local g = graph.capture(A, function()
      t = nil
      collectgarbage()
      collectgarbage()
      u = ms.full({ n }, 5, { ctx = A })
    end)
    assert.is_true(data_ptr(u) ~= old, "a capture reused a block with pending reads on another stream")
    g:launch()                              -- at once, while B may still read the old block
    for i = 1, 8 do assert.equals(2 * n, outs[i]:sum()) end
    A:sync()
    B:sync()
    assert.equals(5 * n, u:sum())
    g:free()
  end)

  cuda_it("does not reuse a block a collective on another context's stream still reads, grouped or not", function()
    -- the communicators' collectives marked no use of another context's memory (every other op does): its pool
    -- handed the block out again while the collective, queued behind other work, had not read it yet
    local with_nccl, id = pcall(ms.comm.unique_id)
    if not with_nccl then return end           -- a build without NCCL has no CUDA collectives
    local A = ms.context { device = "cuda" }
    local B = ms.context { device = "cuda" }
    local comm = ms.comm.new { ctx = B, rank = 0, world_size = 1, id = id }
    local n = 16 * 2 ^ 20                      -- 64 MB
    local x = ms.full({ n }, 1, { ctx = B })
    local out = ms.empty({ n }, { ctx = B })
    local function round(value, grouped)
      local t = ms.full({ n }, value, { ctx = A })
      A:sync()
      local busy = read_on(B, x, n)            -- ~20 ms of B's work ahead of the collective
      if grouped then comm:group_begin() end
      comm:all_reduce(out, t)
      if grouped then comm:group_end() end
      local old = data_ptr(t)
      t = nil
      collectgarbage()
      collectgarbage()
      local u = ms.full({ n }, 5, { ctx = A })  -- same size, on A's stream, while the collective is still queued
      if not SANITIZER then
        assert.is_true(data_ptr(u) ~= old, "a block a queued collective reads was reused" .. (grouped and " (grouped)" or ""))
      end
      assert.equals(value * n, out:sum())
      for i = 1, 8 do assert.equals(2 * n, busy[i]:sum()) end
      A:sync()
      B:sync()
      return u
    end
    local u1 = round(1, false)
    local u2 = round(2, true)
    local _ = { u1, u2 }
    comm:free()
  end)

  cuda_it("fails at the memory cap, collects garbage and retries, and recovers", function()
    local ctx = ms.context { device = "cuda", mem_limit = 64 * 2 ^ 20 }
    local h = HC(ctx)
    local out = ffi.new("ms_tensor *[1]")
    local shape = ffi.new("int64_t[1]", 12 * 2 ^ 20)   -- 48 MB of f32
    core.check(C.ms_tensor_new(h, C.MS_DTYPE_F32, 1, shape, out))
    local first = out[0]
    assert.equals(C.MS_E_OOM, C.ms_tensor_new(h, C.MS_DTYPE_F32, 1, shape, out))
    local msg = ffi.string(C.ms_last_error())
    assert.truthy(msg:find("out of memory on cuda:0", 1, true) and msg:find("limit 67108864", 1, true), msg)
    assert.equals(48 * 2 ^ 20, stats(ctx).bytes_in_use)
    C.ms_tensor_free(first)
    core.check(C.ms_tensor_new(h, C.MS_DTYPE_F32, 1, shape, out))
    C.ms_tensor_free(out[0])
    -- the Lua binding frees unreachable tensors and retries once
    local a = ms.empty({ 12 * 2 ^ 20 }, { ctx = ctx })
    a = nil
    local b = ms.empty({ 12 * 2 ^ 20 }, { ctx = ctx })
    assert.equals(48 * 2 ^ 20, stats(ctx).bytes_in_use)
    assert.is_true(stats(ctx).limit == 64 * 2 ^ 20)
    -- the driver's own limit: far more than the device has
    H.expect_error(function() ms.empty({ 2 ^ 40 }, { ctx = GPU }) end, "out of memory on cuda:0")
    local c = ms.full({ 1000 }, 2, { ctx = GPU })
    assert.equals(2000, c:sum())
    local _ = b
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda graphs", function()
  cuda_it("replays a captured sequence with new device-scalar values", function()
    local ctx = ms.context { device = "cuda" }
    local h = HC(ctx)
    local n = 50000
    local a, b = ms.randn({ n }, { ctx = ctx, seed = H.seed() }), ms.randn({ n }, { ctx = ctx, seed = H.seed() })
    local w, s, v = ms.full({ 1 }, 0.25, { ctx = ctx }), ms.full({}, 2, { ctx = ctx }), ms.full({ 1 }, 0.5, { ctx = ctx })
    local o1, o2, o3 = ms.empty({ n }, { ctx = ctx }), ms.empty({ n }, { ctx = ctx }), ms.empty({ n }, { ctx = ctx })
    local total = ms.empty({}, { ctx = ctx })
    local function step()
      ms.lerp(a, b, w, o1)                                                        -- o1 = a + w (b - a)
      core.check(C.ms_binary_scalar(h, HT(o2), HT(o1), 0, HT(s), C.MS_BINARY_MUL, 0)) -- o2 = s o1
      ms.addcmul(o2, a, b, v, o3)                                                 -- o3 = o2 + v a b
      local tmp = o3 * 3                                                          -- a temporary (cached)
      total:copy_(tmp:sum(0))                                                     -- a reduction with scratch
      o3:add_(tmp)                                                                -- o3 = 4 (o2 + v a b)
    end
    step()
    ctx:sync()
    collectgarbage()
    collectgarbage()                        -- the step's temporaries are back in the pool's cache
    local g = graph.capture(ctx, step)
    assert.is_true(g:num_nodes() >= 6, tostring(g))
    local ac, bc = a:cpu():to("f64"), b:cpu():to("f64")
    for _, vals in ipairs { { 0.1, -3, 0.7 }, { 0.9, 0.5, -2 }, { 0.5, 1, 0 } } do
      w:fill_(vals[1])
      s:fill_(vals[2])
      v:fill_(vals[3])
      g:launch()
      local want = (ms.lerp(ac, bc, vals[1]) * vals[2] + ac * bc * vals[3]) * 4
      H.assert_close(flat(o3), flat(want), 1e-5, 1e-5, "replay " .. table.concat(vals, ","))
      assert.is_true(math.abs(total:item() - want:sum() * 3 / 4) <= 1e-4 * (want:abs():sum() + 1))
    end
    g:free()
    g:free()
    H.expect_error(function() g:launch() end, "after free")
  end)

  cuda_it("refuses syncs, host reads and uncached allocations while capturing, and recovers", function()
    local ctx = ms.context { device = "cuda" }
    local x = ms.full({ 100 }, 1, { ctx = ctx })
    H.expect_error(function() graph.capture(ctx, function() ctx:sync() end) end, "captures a graph")
    H.expect_error(function() graph.capture(ctx, function() x:add_(1) x:tolist_flat() end) end, "captures a graph")
    H.expect_error(function() graph.capture(ctx, function() ms.empty({ 98765431 }, { ctx = ctx }) end) end,
                   "while capturing a graph")
    -- a failure poisons the capture even when the caller swallows the error
    local st = C.ms_graph_begin(HC(ctx))
    assert.equals(0, st)
    assert.equals(C.MS_E_UNSUPPORTED, C.ms_ctx_sync(HC(ctx)))
    assert.equals(C.MS_E_UNSUPPORTED, C.ms_graph_begin(HC(ctx)))
    local out = ffi.new("ms_graph *[1]")
    assert.is_true(C.ms_graph_end(HC(ctx), out) ~= 0)
    assert.truthy(ffi.string(C.ms_last_error()):find("failed during the capture", 1, true))
    assert.is_true(out[0] == nil)
    -- the context works normally again; a graph refuses another context
    x:add_(2)
    assert.equals(300, x:sum())
    local g = graph.capture(ctx, function() x:add_(1) end)
    g:launch()
    g:launch()
    assert.equals(500, x:sum())
    assert.equals(C.MS_E_ARG, C.ms_graph_launch(HC(ms.context { device = "cuda" }), g.h))
    assert.equals(C.MS_E_ARG, C.ms_graph_end(HC(ctx), out))   -- not capturing
  end)
end)

-- ---------------------------------------------------------------------------------------------------
pcall(ffi.cdef, [[
typedef struct { int32_t device_type; int32_t device_id; } ms_spec_dldevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } ms_spec_dldtype;
typedef struct { void *data; ms_spec_dldevice device; int ndim; ms_spec_dldtype dtype; int64_t *shape;
                 int64_t *strides; uint64_t byte_offset; } ms_spec_dltensor;
typedef struct ms_spec_dlmanaged { ms_spec_dltensor dl_tensor; void *manager_ctx;
                                   void (*deleter)(struct ms_spec_dlmanaged *); } ms_spec_dlmanaged;
]])

describe("cuda DLPack", function()
  cuda_it("exports and imports CUDA tensors without copies; device checked", function()
    local x = gpu(randn({ 6, 10 })):t()
    local out = ffi.new("void *[1]")
    core.check(C.ms_tensor_to_dlpack(HC(GPU), HT(x), out))
    local m = ffi.cast("ms_spec_dlmanaged *", out[0])
    assert.equals(2, m.dl_tensor.device.device_type)   -- kDLCUDA
    assert.equals(0, m.dl_tensor.device.device_id)
    assert.equals(2, m.dl_tensor.ndim)
    assert.equals(10, tonumber(m.dl_tensor.shape[0]))
    assert.equals(1, tonumber(m.dl_tensor.strides[0]))
    assert.equals(10, tonumber(m.dl_tensor.strides[1]))
    assert.equals(C.MS_E_DEVICE, C.ms_tensor_from_dlpack(HC(ms.device("cpu")), out[0], core.out_tensor))
    core.check(C.ms_tensor_from_dlpack(HC(GPU), out[0], core.out_tensor))
    local y = tensor.wrap(core.out_tensor[0], GPU)
    assert.equals(data_ptr(x), data_ptr(y))
    exact(y, x)
    local want = flat(x * 2)
    y:mul_(2)                                  -- the same memory
    H.assert_close(flat(x), want, 0, 0)
  end)
end)
