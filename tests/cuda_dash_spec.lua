-- The CUDA backend of Shampoo on stacked blocks (engine/cuda/dash.c, kernels/dash.cu) against the CPU reference
-- (engine/cpu/dash.c) on the same fresh random inputs: gather and apply of f32/bf16/f16 blocks of every layout
-- (bit for bit, stochastic rounding and device scalars included), the grafting state (bit for bit) and its
-- norms, and every inverse-root solver -- NDB, CN, Chebyshev, EVD; p = 2 and 4; Frobenius, PI and PIM scaling
-- (f32 and bf16 power iterations); f32, TF32 and 16-bit products -- on SPD blocks with controlled spectra,
-- judged as DASH uses roots: the normalized root X / ||X||_F against the f64 root (above the solvers' floors)
-- and against the CPU's (below them, where both under-invert by the same map).  Also: iteration counts,
-- per-block early exit with the working set compacted, index subsets, awkward block sizes (uneven panels,
-- partial tiles), panels vs plain products and the eigensolver paths (MOONSTEP_DASH_SPLIT, MOONSTEP_DASH_EVD),
-- residuals against an f64 evaluation, zero and non-finite blocks, spectrum estimates, and graph capture.
-- Every spec is a cuda_it (pending without a GPU).  MOONSTEP_DASH_SPEC_SELF=1 runs the parity specs with the CPU
-- in the GPU's place (it checks this file's own logic on a machine without a GPU).
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local graph = require("moonstep.graph")
local ffi, C = core.ffi, core.C

local SELF = os.getenv("MOONSTEP_DASH_SPEC_SELF") == "1"
local CPU = ms.device("cpu")
local GPU = SELF and CPU or (H.has_cuda and ms.device("cuda") or nil)
local abs, max, min, sqrt = math.abs, math.max, math.min, math.sqrt

-- cuda_it, or it() on the CPU in self mode; gpu_only: pending in self mode (the spec needs the real device)
local function cuda_it(name, fn, gpu_only)
  local env = getfenv(2)
  if SELF then
    if gpu_only then env.pending(name .. " (GPU only)") else env.it(name, fn) end
  elseif H.has_cuda then
    env.it(name, fn)
  else
    env.pending(name .. " (no CUDA device)")
  end
end

pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")
local function with_env(name, value, fn)
  if value == nil then ffi.C.unsetenv(name) else ffi.C.setenv(name, tostring(value), 1) end
  local ok, err = pcall(fn)
  ffi.C.unsetenv(name)
  if not ok then error(err, 0) end
end

-- ---------------------------------------------------------------------------------------------------
-- helpers
-- ---------------------------------------------------------------------------------------------------
local function vals(t) return t:tolist_flat() end
local function dev(t) return t:to(GPU) end
local function host(t) return t:to(CPU) end

local function assert_same(got, want, what)
  assert.are.equal(#want, #got, what .. ": length")
  for i = 1, #want do
    local g, w = got[i], want[i]
    if not (g == w or (g ~= g and w ~= w)) then
      error(("%s: element %d is %.9g, expected %.9g (the same bits)"):format(what, i, g, w), 2)
    end
  end
end

local function finite(list)
  for _, v in ipairs(list) do if v ~= v or v == math.huge or v == -math.huge then return false end end
  return true
end

local function orthogonal(b, seed)
  local G = ms.randn({ b, b }, { dtype = "f64", seed = seed })
  local _, Q = ms.eigh(G + G:t())
  return Q
end

local spread, clustered = H.spectrum_spread, H.spectrum_clustered

-- a [#specs, b, b] f32 stack (CPU) of Q diag(l) Q^T, each times a random size in [1e-2, 1e2]; specs: eigenvalue lists
local function spd_stack(specs, seed)
  local b = #specs[1]
  local s = ms.empty({ #specs, b, b })
  for i, l in ipairs(specs) do
    local size = 10 ^ (4 * ms.rand({ 1 }, { dtype = "f64", seed = seed + 500 + i }):item() - 2)
    local ls = {}
    for j = 1, b do ls[j] = l[j] * size end
    local Q = orthogonal(b, seed + i)
    s:select(0, i - 1):copy_(ms.matmul(Q * ms.tensor(ls, { dtype = "f64" }), Q, { trans_b = true }))
  end
  return s
end

-- the exact root of block k of a (f32, CPU) plus eps I, in f64
local function exact_root(a, k, eps, p)
  local A = a:select(0, k):to("f64")
  local b = A:size(0)
  local w, V = ms.eigh(A + ms.eye(b, { dtype = "f64" }) * eps)
  local wl = w:tolist_flat()
  local inv = {}
  for j = 1, b do inv[j] = wl[j] > 0 and wl[j] ^ (-1 / p) or 0 end
  return ms.matmul(V * ms.tensor(inv, { dtype = "f64" }), V, { trans_b = true })
end

local function normalized_error(x, xt)
  local nx, nt = x:norm(), xt:norm()
  if nx == 0 and nt == 0 then return 0 end
  return (x / nx - xt / nt):norm()
end

-- ||X^p (A + eps I) V - V||_F / ||V||_F in f64 with moonstep.h's sketch of block k (the reference of `residual`)
local function residual_f64(a, x, k, eps, p, seed)
  local A, X = a:select(0, k):to("f64"), x:select(0, k):to("f64")
  local b = A:size(0)
  local V = ms.randn({ b, 4 }, { seed = seed, offset = 0x4000000000000000ULL + k }):to("f64")
  local W = ms.matmul(A + ms.eye(b, { dtype = "f64" }) * eps, V)
  for _ = 1, p do W = ms.matmul(X, W) end
  local nv = V:norm()
  return nv > 0 and (W - V):norm() / nv or 0
end

-- inv_root on both devices (the same options; `gpu_extra` only on the GPU, e.g. tf32)
local function both(a, opts, gpu_extra)
  local xc, rc, ic = ms.inv_root(a, opts)
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  for k, v in pairs(gpu_extra or {}) do o[k] = v end
  if T.is_tensor(o.index) then o.index = dev(o.index) end
  local xg, rg, ig = ms.inv_root(dev(a), o)
  return { x = xc, r = rc, it = ic }, { x = host(xg), r = rg and host(rg), it = ig and host(ig) }
end

-- ---------------------------------------------------------------------------------------------------
-- gather, apply, graft
-- ---------------------------------------------------------------------------------------------------
describe("CUDA DASH blocks", function()
  -- the same tensors on both devices: a [37, 50] f32, a transposed [50, 37] bf16 view, a [6, 5, 7] f16 (viewed as
  -- [6, 35]), a [40] f32 (viewed as [40, 1])
  local function tensors(ctx, seed)
    local base = {
      ms.randn({ 37, 50 }, { seed = seed }), ms.randn({ 37, 50 }, { seed = seed + 1, dtype = "bf16" }),
      ms.randn({ 6, 5, 7 }, { seed = seed + 2, dtype = "f16" }), ms.randn({ 40 }, { seed = seed + 3 }),
    }
    local t = {}
    for i, x in ipairs(base) do t[i] = x:to(ctx) end
    t[2] = t[2]:t()
    return t
  end

  cuda_it("gathers f32, bf16 and f16 blocks of every layout exactly as the CPU", function()
    local seed = H.seed()
    local tc, tg = tensors(CPU, seed), tensors(GPU, seed)
    local function blocks(t)
      return {
        { tensor = t[1], row0 = 0, col0 = 0 }, { tensor = t[1], row0 = 21, col0 = 34 }, { tensor = t[1], row0 = 5, col0 = 17 },
        { tensor = t[2], row0 = 0, col0 = 0 }, { tensor = t[2], row0 = 34, col0 = 21 }, { tensor = t[2], row0 = 13, col0 = 2 },
        { tensor = t[3], row0 = 0, col0 = 19 }, { tensor = t[3], row0 = 0, col0 = 0 },
      }
    end
    local sc, sg = ms.empty({ 8, 6, 16 }), ms.empty({ 8, 6, 16 }, { ctx = GPU })
    ms.blocks_gather(sc, blocks(tc))
    ms.blocks_gather(sg, ms.block_list(blocks(tg)))
    assert_same(vals(sg), vals(sc), "2-D, transposed and 3-D blocks")
    local vc, vg = ms.empty({ 3, 9, 1 }), ms.empty({ 3, 9, 1 }, { ctx = GPU })
    local function vblocks(t) return { { tensor = t[4], row0 = 0 }, { tensor = t[4], row0 = 31 }, { tensor = t[4], row0 = 17 } } end
    ms.blocks_gather(vc, vblocks(tc))
    ms.blocks_gather(vg, vblocks(tg))
    assert_same(vals(vg), vals(vc), "1-D blocks")
  end)

  -- a block of 2^32 elements or more: its element indices and rows take 64 bits (kernels/dash.cu, block_row).  The
  -- block is the last 2^31 + 8 columns of a [2, 2^31 + 16] bf16 tensor (row stride past its width: a wrong row
  -- lands 8 elements off); the tail of its second row is marked, gathered into the stack and applied back
  cuda_it("gathers and applies a block of more than 2^32 elements (64-bit indices)", function()
    local c = 2 ^ 31 + 8
    local p = ms.zeros({ 2, c + 8 }, { dtype = "bf16", ctx = GPU })
    local marks = { 1, 2, 3, 4, 5, 6, 7, 8 }
    p:slice(0, 1, 2):slice(1, c, c + 8):copy_(ms.tensor({ marks }, { dtype = "bf16" }):to(GPU))
    local block = { { tensor = p, row0 = 0, col0 = 8 } }
    local stack = ms.empty({ 1, 2, c }, { ctx = GPU })
    ms.blocks_gather(stack, block)
    assert_same(vals(stack:select(0, 0):slice(0, 1, 2):slice(1, c - 16, c)), { 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8 },
                "the block's second row's tail")
    assert_same(vals(stack:select(0, 0):slice(0, 0, 1):slice(1, c - 8, c)), { 0, 0, 0, 0, 0, 0, 0, 0 }, "its first row's tail")
    -- p <- p - 1 * stack on the block: the marks become zeros, and nothing else changes
    p:slice(0, 0, 1):slice(1, 0, 8):copy_(ms.tensor({ marks }, { dtype = "bf16" }):to(GPU))
    ms.blocks_apply { blocks = block, stack = stack, lr = 1 }
    assert_same(vals(p:slice(0, 1, 2):slice(1, c - 8, c + 8)), { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 },
                "the second row's tail after the apply")
    assert_same(vals(p:slice(0, 0, 1):slice(1, 0, 8)), marks, "the columns left of the block")
    stack, p = nil, nil
    collectgarbage()
  end, true)

  cuda_it("applies decay, per-block scales, device scalars and stochastic rounding bit for bit as the CPU", function()
    for _, dt in ipairs { "f32", "bf16", "f16" } do
      for _, sr in ipairs { false, true } do
        local seed = H.seed()
        -- two params partitioned into 8 x 8 blocks: [16, 24] (6 blocks) and [24, 16] (6 blocks)
        local p0 = { ms.randn({ 16, 24 }, { seed = seed, dtype = dt }), ms.randn({ 24, 16 }, { seed = seed + 1, dtype = dt }) }
        local stack = ms.randn({ 12, 8, 8 }, { seed = seed + 2 })
        local scale = ms.rand({ 12 }, { seed = seed + 3, low = 0.5, high = 2 })
        local function run(ctx, opts)
          local p = { p0[1]:to(ctx):clone(), p0[2]:to(ctx):clone() }
          local bl = {}
          for r = 0, 1 do for c = 0, 2 do bl[#bl + 1] = { tensor = p[1], row0 = 8 * r, col0 = 8 * c } end end
          for r = 0, 2 do for c = 0, 1 do bl[#bl + 1] = { tensor = p[2], row0 = 8 * r, col0 = 8 * c } end end
          local o = { blocks = bl, stack = stack:to(ctx), scale = scale:to(ctx) }
          for k, v in pairs(opts) do o[k] = T.is_tensor(v) and v:to(ctx) or v end
          ms.blocks_apply(o)
          return vals(p[1]), vals(p[2])
        end
        local opts = { lr = 0.05, weight_decay = 0.1, step = 3, stochastic_round = sr, seed = seed }
        local c1, c2 = run(CPU, opts)
        local g1, g2 = run(GPU, opts)
        assert_same(g1, c1, dt .. (sr and " sr" or "") .. " param 1")
        assert_same(g2, c2, dt .. (sr and " sr" or "") .. " param 2")
        -- device scalars: lr_t and step_t read at execution time; skip_t leaves everything as it was
        local dopts = { lr = ms.full({ 1 }, 0.02), step = ms.full({ 1 }, 7), weight_decay = 0.3, stochastic_round = sr, seed = seed }
        c1, c2 = run(CPU, dopts)
        g1, g2 = run(GPU, dopts)
        assert_same(g1, c1, dt .. " device scalars")
        assert_same(g2, c2, dt .. " device scalars")
        g1 = run(GPU, { lr = 0.05, skip = ms.full({ 1 }, 1) })
        assert_same(g1, vals(p0[1]), dt .. " skip")
      end
    end
  end)

  -- the decay (float)(1 - lr wd) in f64 as the CPU rounds it, the product then the difference: for these pairs one
  -- FMA (what nvcc makes of the expression unless told otherwise) rounds to the next f32 below the CPU's
  cuda_it("rounds the decay 1 - lr wd as the CPU does (no FMA contraction), bit for bit", function()
    for _, c in ipairs { { 0.0012550690257394218, 0.10004006285267383 }, { 0.03521924889825151, 0.10000068607327894 },
                         { 0.004773460305003912, 0.09999953224359748 } } do
      local got = {}
      for _, ctx in ipairs { CPU, GPU } do
        local p = ms.full({ 4, 6 }, 1, { ctx = ctx })
        ms.blocks_apply { blocks = { { tensor = p, row0 = 0, col0 = 0 } }, stack = ms.zeros({ 1, 4, 6 }, { ctx = ctx }),
                          lr = c[1], weight_decay = c[2] }
        got[#got + 1] = vals(p)
      end
      assert_same(got[2], got[1], ("lr %.17g, weight_decay %.17g"):format(c[1], c[2]))
    end
  end)

  cuda_it("scatters with a scale (opts NULL) and applies to a transposed f32 view as the CPU", function()
    local seed = H.seed()
    local w0 = ms.randn({ 20, 12 }, { seed = seed })
    local stack = ms.randn({ 2, 12, 10 }, { seed = seed + 1 })
    local scale = ms.tensor({ 0.5, -3 })
    local function run(ctx, update)
      local w = w0:to(ctx):clone()
      local v = w:t()                                 -- [12, 20], strides (1, 12)
      local bl = { { tensor = v, row0 = 0, col0 = 0 }, { tensor = v, row0 = 0, col0 = 10 } }
      if update then ms.blocks_apply { blocks = bl, stack = stack:to(ctx), scale = scale:to(ctx), lr = 0.1, weight_decay = 0.5 }
      else ms.blocks_scatter(bl, stack:to(ctx), scale:to(ctx)) end
      return vals(w)
    end
    assert_same(run(GPU, false), run(CPU, false), "scatter")
    assert_same(run(GPU, true), run(CPU, true), "apply on a transposed view")
  end)

  cuda_it("updates the grafting state bit for bit and the norms to 1e-6 as the CPU (EMA, beta_grad 0, no bias correction, step_t, skip, pgraft)", function()
    for _, case in ipairs {
      { beta_grad = 0.9, beta_graft = 0.95, bias = true }, { beta_grad = 0, beta_graft = 0.9, bias = true },
      { beta_grad = 0.8, beta_graft = 0.99, bias = false },
    } do
      local seed = H.seed()
      local g = { ms.randn({ 5, 7, 9 }, { seed = seed }), ms.randn({ 5, 7, 9 }, { seed = seed + 1 }) }
      local function run(ctx, device_step)
        local m, v = ms.zeros({ 5, 7, 9 }, { ctx = ctx }), ms.zeros({ 5, 7, 9 }, { ctx = ctx })
        local pg = ms.zeros({ 5, 7, 9 }, { ctx = ctx })
        local norm
        for t = 1, 2 do
          norm = ms.dash_graft { grad = g[t]:to(ctx), grad_ema = m, adam_v = v, pgraft = pg, beta_grad = case.beta_grad,
                                 beta_graft = case.beta_graft, eps = 1e-8, bias_correction = case.bias,
                                 step = device_step and ms.full({ 1 }, t, { ctx = ctx }) or t }
        end
        return m, v, pg, norm
      end
      local mc, vc, pc, nc = run(CPU, false)
      for _, ds in ipairs { false, true } do
        local mg, vg, pgg, ng = run(GPU, ds)
        assert_same(vals(mg), vals(mc), "grad_ema")
        assert_same(vals(vg), vals(vc), "adam_v")
        assert_same(vals(pgg), vals(pc), "pgraft")
        H.assert_close(vals(ng), vals(nc), 1e-6, 0, "norms")
        -- skip_t: nothing changes, the norms included
        local before = vals(mg)
        ms.dash_graft { grad = dev(g[1]), grad_ema = mg, adam_v = vg, norm = ng, beta_grad = 0.9, beta_graft = 0.95,
                        step = 3, skip = ms.full({ 1 }, 1, { ctx = GPU }) }
        assert_same(vals(mg), before, "skip grad_ema")
        H.assert_close(vals(ng), vals(nc), 1e-6, 0, "skip norms")
      end
    end
  end)

  -- empty blocks ([N, 0, c]): nothing to update, the norms become 0 -- unless skip_t (read on the device) says
  -- skip, which leaves them as they were, as engine/cpu/dash.c checks skip first
  cuda_it("grafts empty blocks as the CPU: norms 0, or left as they were when skip_t is set", function()
    for _, skip in ipairs { 0, 1 } do
      local got = {}
      for _, ctx in ipairs { CPU, GPU } do
        local m, v = ms.zeros({ 3, 0, 4 }, { ctx = ctx }), ms.zeros({ 3, 0, 4 }, { ctx = ctx })
        local norm = ms.full({ 3 }, 7, { ctx = ctx })
        ms.dash_graft { grad = ms.zeros({ 3, 0, 4 }, { ctx = ctx }), grad_ema = m, adam_v = v, norm = norm,
                        beta_grad = 0.9, beta_graft = 0.95, step = 2, skip = ms.full({ 1 }, skip, { ctx = ctx }) }
        got[#got + 1] = vals(norm)
      end
      assert_same(got[1], skip == 1 and { 7, 7, 7 } or { 0, 0, 0 }, "CPU norms, skip " .. skip)
      assert_same(got[2], got[1], "norms, skip " .. skip)
    end
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- inverse roots
-- ---------------------------------------------------------------------------------------------------
describe("CUDA ms.inv_root", function()
  local B = 64
  -- well conditioned: every method resolves every eigenvalue under every scaling (y_min >= 1.7e-2)
  local easy = {}
  for _, k in ipairs { 2, 5, 10 } do
    easy[#easy + 1] = spread(k, B)
    easy[#easy + 1] = clustered(k, B)
  end
  local easy_stack = spd_stack(easy, 7100)

  local configs = {}
  for _, p in ipairs { 2, 4 } do
    configs[#configs + 1] = { method = "evd", root = p, eps = 1e-10 }
    for _, m in ipairs { "ndb", "cn" } do
      configs[#configs + 1] = { method = m, root = p, scaling = "fro" }
      for _, sc in ipairs { "pi", "pim" } do
        for _, bf in ipairs { true, false } do configs[#configs + 1] = { method = m, root = p, scaling = sc, pi_bf16 = bf } end
      end
    end
    configs[#configs + 1] = { method = "chebyshev", root = p, scaling = "fro", steps = 60 }
    configs[#configs + 1] = { method = "chebyshev", root = p, scaling = "pim", steps = 60, pi_bf16 = false }
  end

  local function label(c)
    return ("%s p=%d %s%s"):format(c.method, c.root, c.scaling or "", c.pi_bf16 == false and " f32-PI" or "")
  end

  cuda_it("matches the f64 root (1e-4 in f32, 5e-3 in TF32) and the CPU (1e-4) on well-conditioned blocks, every method, root and scaling", function()
    for _, cfg in ipairs(configs) do
      local opts = { residual = true, iters = true, seed = 31 }
      for k, v in pairs(cfg) do opts[k] = v end
      local cpu, gpu = both(easy_stack, opts)
      local _, tf = both(easy_stack, opts, { tf32 = true })
      local ic, ig, it = vals(cpu.it), vals(gpu.it), vals(tf.it)
      local rg = vals(gpu.r)
      for k = 0, #easy - 1 do
        local xt = exact_root(easy_stack, k, cfg.eps or 0, cfg.root)
        local xg, xc, xtf = gpu.x:select(0, k):to("f64"), cpu.x:select(0, k):to("f64"), tf.x:select(0, k):to("f64")
        local what = ("%s block %d"):format(label(cfg), k)
        local e1, e2, e3 = normalized_error(xg, xt), normalized_error(xg, xc), normalized_error(xtf, xt)
        assert(e1 <= 1e-4, ("%s: GPU error %.3g vs the f64 root"):format(what, e1))
        assert(e2 <= 1e-4, ("%s: GPU differs from the CPU by %.3g"):format(what, e2))
        assert(e3 <= 5e-3, ("%s: TF32 error %.3g"):format(what, e3))
        assert.are.equal(ic[k + 1], ig[k + 1], what .. ": iterations")
        assert.are.equal(ic[k + 1], it[k + 1], what .. ": iterations (TF32)")
        local rr = residual_f64(easy_stack, gpu.x, k, cfg.eps or 0, cfg.root, 31)
        H.assert_close(rg[k + 1], rr, 1e-5, 1e-9, what .. ": residual vs its f64 evaluation")
        assert(rg[k + 1] <= 1e-3, ("%s: residual %.3g"):format(what, rg[k + 1]))
      end
    end
  end)

  cuda_it("rounds the products' operands to bf16 / f16 as documented (accuracy of the rounding)", function()
    for _, m in ipairs { "ndb", "cn", "chebyshev" } do
      for _, p in ipairs { 2, 4 } do
        for dt, tol in pairs { bf16 = 3e-2, f16 = 5e-3 } do
          local opts = { method = m, root = p, scaling = "fro", matmul_dtype = dt, steps = m == "chebyshev" and 60 or 10 }
          local cpu, gpu = both(easy_stack, opts)
          local x32 = host(ms.inv_root(dev(easy_stack), { method = m, root = p, scaling = "fro", steps = opts.steps }))
          for k = 0, #easy - 1 do
            local xt = exact_root(easy_stack, k, 0, p)
            local xg = gpu.x:select(0, k):to("f64")
            local err = normalized_error(xg, xt)
            assert(err <= tol, ("%s p=%d %s block %d: error %.3g > %.3g"):format(m, p, dt, k, err, tol))
            assert(normalized_error(xg, x32:select(0, k):to("f64")) > 1e-6, m .. " " .. dt .. ": no rounding seen")
            assert(normalized_error(xg, cpu.x:select(0, k):to("f64")) <= tol, m .. " " .. dt .. ": far from the CPU")
          end
        end
      end
    end
  end)

  cuda_it("under-inverts ill-conditioned, rank-deficient and zero blocks by the CPU's map (f32, 1e-4), never NaN", function()
    local b = 48
    local specs = { spread(1e3, b), spread(1e5, b), spread(1e7, b), clustered(1e4, b) }
    local rd = spread(1e2, b)
    for i = b - 5, b do rd[i] = 0 end
    specs[#specs + 1] = rd
    local zero = {}
    for i = 1, b do zero[i] = 0 end
    specs[#specs + 1] = zero
    local a = spd_stack(specs, 7200)
    for _, m in ipairs { "ndb", "cn", "chebyshev" } do
      for _, p in ipairs { 2, 4 } do
        for _, sc in ipairs { "fro", "pim" } do
          local opts = { method = m, root = p, scaling = sc, pi_bf16 = false, residual = true, iters = true, seed = 3,
                         steps = m == "chebyshev" and 60 or 10 }
          local cpu, gpu = both(a, opts)
          local xg = vals(gpu.x)
          assert(finite(xg), m .. ": non-finite root")
          assert.are.same(vals(cpu.it), vals(gpu.it))
          for k = 0, #specs - 1 do
            -- Blocks 0-4 have eigenvalues below every solver's floor, where a root's small components are built
            -- from iterates whose f32 rounding noise (~1e-7 of their norm, in another summation order on each
            -- device) is large relative to those components: the two devices then agree to ~1e-7 / y_eff, not
            -- to 1e-4 (measured on the H200: NDB p = 4, kappa 1e5, 2.5e-4).  1e-3 bounds that noise; the
            -- under-inversion map itself differs by orders of magnitude more between solvers.  The zero block
            -- (5) is exact on both.
            local tol = k == 5 and 1e-4 or 1e-3
            local e = normalized_error(gpu.x:select(0, k):to("f64"), cpu.x:select(0, k):to("f64"))
            assert(e <= tol, ("%s p=%d %s block %d: GPU differs from the CPU by %.3g"):format(m, p, sc, k, e))
            local rr = residual_f64(a, gpu.x, k, 0, p, 3)
            H.assert_close(vals(gpu.r)[k + 1], rr, 1e-5, 1e-9, ("%s block %d residual"):format(m, k))
          end
          assert(vals(gpu.r)[1 + 5] == vals(gpu.r)[1 + 5], "NaN residual of the zero block")
        end
      end
    end
    -- EVD below its floor: finite, bounded by eps^(-1/p) with the shift (the noise eigenvalues differ by device)
    local X = host(ms.inv_root(dev(a), { method = "evd", root = 4, eps = 1e-6 }))
    assert(finite(vals(X)), "EVD non-finite")
    for k = 0, #specs - 1 do
      local w = vals((ms.eigh(X:select(0, k):to("f64"))))
      assert(w[#w] <= (1e-6) ^ (-1 / 4) * (1 + 1e-3), "EVD root above eps^(-1/p)")
    end
  end)

  -- NDB as the benchmark runs it (PIM in bf16 and Frobenius scaling, p = 2 and 4, 10 steps) on blocks of condition
  -- 1e1..1e6.  f32: the GPU against the CPU and against the f64 scalar map of its own chains (moonstep.h's NDB
  -- applied to each eigenvalue y = lambda / s with the GPU's scale s: Frobenius in f64, PIM as
  -- ms.spectrum_estimate computes the same power iteration) -- a wrong scale, chain order or un-scaling is off
  -- by 1e-1 or more.  1e-3 bounds f32 rounding below the floor (a numpy f32 emulation of the chains: <= 1.1e-4
  -- from the map at kappa 1e7, b = 256).  TF32 (operands rounded to 2^-11 of their largest entries) against
  -- the CPU's f32: the emulation's worst over 3 seeds, both TF32 rounding modes, b = 64, is 2.7e-2 for p = 2 at
  -- any kappa and 8.3e-3 for p = 4 up to kappa 1e3 -- tolerances 6e-2 and 2e-2.  Beyond kappa 1e3, p = 4 in TF32
  -- is not an approximation of the map: the first chain's square root carries TF32 noise of ~5e-4 y_max into
  -- the second chain's inverse root, which amplifies it (emulation: 0.1 at 1e4, 0.8-1.0 at 1e5-1e6; the
  -- benchmark's NDB-PIM "own map" error of 1.0 on the H200 is this, not a defect of the GPU code); it stays finite.
  cuda_it("NDB (pim, fro; p = 2, 4) on kappa 1e1..1e6 matches the CPU and its own f64 map in f32, the CPU in TF32 and with f16 products where they resolve", function()
    local b = 64
    local kappas = { 1e1, 1e2, 1e3, 1e4, 1e5, 1e6 }
    local specs = {}
    for i, k in ipairs(kappas) do specs[i] = spread(k, b) end
    local a = spd_stack(specs, 7250)
    local ag = dev(a)
    local function chain(y, T, want_y)
      local Y, E = y, 1.5 - 0.5 * y
      local Z = E
      Y = Y * E
      for _ = 2, T do
        E = 1.5 - 0.5 * Z * Y
        Y, Z = Y * E, E * Z
      end
      return want_y and Y or Z
    end
    local eig = {}
    for k = 0, #specs - 1 do
      local A = a:select(0, k):to("f64")
      local w, V = ms.eigh(A)
      eig[k] = { w = vals(w), V = V, fro = A:norm() }
    end
    for _, sc in ipairs { "pim", "fro" } do
      local lam = sc == "pim" and vals(ms.spectrum_estimate(ag, { vectors = 16, steps = 10, eps = 1e-6, bf16 = true, seed = 5 }))
      for _, p in ipairs { 2, 4 } do
        local opts = { method = "ndb", root = p, steps = 10, scaling = sc, pi_vectors = 16, pi_steps = 10, pi_const = 2,
                       eps_power_iter = 1e-6, pi_bf16 = true, seed = 5 }
        local cpu, gpu = both(a, opts)
        local _, tf = both(a, opts, { tf32 = true })
        -- 16-bit products (f16 operands and iterates, f32 accumulation): the same 10-bit mantissa as TF32, so
        -- held to TF32's tolerances (the benchmark's NDB-PIM f16 rests on this)
        local _, h16 = both(a, opts, { matmul_dtype = "f16" })
        assert(finite(vals(gpu.x)) and finite(vals(tf.x)) and finite(vals(h16.x)), ("ndb %s p=%d: non-finite root"):format(sc, p))
        for k = 0, #specs - 1 do
          local what = ("ndb %s p=%d kappa %g"):format(sc, p, kappas[k + 1])
          local e = eig[k]
          local s = sc == "pim" and 2 * (lam[k + 1] + 1e-6) or e.fro
          local f = {}
          for j = 1, b do
            local y = math.max(e.w[j], 0) / s
            f[j] = p == 2 and chain(y, 10, false) or chain(chain(y, 10, true), 10, false)
          end
          local xm = ms.matmul(e.V * ms.tensor(f, { dtype = "f64" }), e.V, { trans_b = true })
          local xg, xc = gpu.x:select(0, k):to("f64"), cpu.x:select(0, k):to("f64")
          local tol = kappas[k + 1] <= 1e2 and 1e-4 or 1e-3
          local e1, e2 = normalized_error(xg, xc), normalized_error(xg, xm)
          assert(e1 <= tol, ("%s: GPU differs from the CPU by %.3g"):format(what, e1))
          assert(e2 <= 1e-3, ("%s: GPU differs from its f64 map by %.3g"):format(what, e2))
          if p == 2 or kappas[k + 1] <= 1e3 then
            local e3 = normalized_error(tf.x:select(0, k):to("f64"), xc)
            local ttol = p == 2 and 6e-2 or 2e-2
            assert(e3 <= ttol, ("%s: TF32 differs from the CPU by %.3g (> %.g)"):format(what, e3, ttol))
            local e4 = normalized_error(h16.x:select(0, k):to("f64"), xc)
            assert(e4 <= ttol, ("%s: f16 products differ from the CPU by %.3g (> %.g)"):format(what, e4, ttol))
          end
        end
      end
    end
  end)

  cuda_it("gives finite roots and residual 1 for all-zero blocks with every method, scaling and PI precision", function()
    local Z = ms.zeros({ 3, 40, 40 }, { ctx = GPU })
    for _, m in ipairs { "ndb", "cn", "chebyshev" } do
      for _, sc in ipairs { "fro", "pi", "pim" } do
        for _, bf in ipairs { true, false } do
          local X, r = ms.inv_root(Z, { method = m, scaling = sc, pi_bf16 = bf, residual = true,
                                        steps = m == "chebyshev" and 60 or 10 })
          assert(finite(vals(X)), m .. "/" .. sc)
          H.assert_close(vals(r), { 1, 1, 1 }, 1e-6, 1e-6, m .. "/" .. sc .. " residual")
        end
      end
    end
    local X = ms.inv_root(Z, { method = "evd", eps = 1e-6, root = 4 })
    H.assert_close(vals(X:select(0, 0)), vals(ms.eye(40) * (2e-6) ^ (-1 / 4)), 1e-5, 1e-5, "EVD zero block")
  end)

  cuda_it("stops each block on its own as the CPU does, with the working set compacted (lag 0, 1, 2 agree)", function()
    local b, specs = 32, {}
    for i = 1, 20 do specs[#specs + 1] = spread(1.5 + i / 5, b) end            -- easy: converge early
    for i = 1, 20 do specs[#specs + 1] = spread(10 ^ (4 + i / 10), b) end      -- hard: run every step
    local a = spd_stack(specs, 7300)
    for _, m in ipairs { "cn", "ndb" } do
      local opts = { method = m, root = 4, steps = 20, scaling = "fro", tolerance = 1e-4, iters = true }
      local cpu, gpu = both(a, opts)
      local ic, ig = vals(cpu.it), vals(gpu.it)
      assert.are.same(ic, ig)
      local full = m == "ndb" and 40 or 20
      assert(ig[1] < full / 2, m .. ": the easy blocks did not stop early: " .. ig[1])
      assert(ig[40] > ig[1] + 4, m .. ": the hardest block stopped about as early as the easiest")
      -- The hard blocks (20..39, kappa 1.3e4..1e6) run every step (both devices agree on every block's count,
      -- asserted above: no stop differs) and sit below the floors, where f32 noise against their small components
      -- limits agreement.  NDB runs the CPU's recursion: 1e-3 bounds that noise (see above).  CN in f32 runs the N
      -- recursion on the GPU (engine/cuda/dash.c, cn_solve): N ~ (p + 1) / p I stores M's small eigenvalues in
      -- the low bits of its diagonal, an M-perturbation of ~(p + 1) u against ~u / 4 for the CPU's M -- about 10x
      -- the CPU's noise below the floor.  A numpy f32 emulation of both recursions on these blocks: the N
      -- recursion 5e-5 (kappa 1.3e4) to 4.5e-3 (1e6) from the f64 iteration, the M recursion 5e-6 to 3.5e-4;
      -- measured on the H200 1.15e-3 at block 33 (kappa 2.5e5; emulated 2.2e-3).  Tolerance 1e-2 for CN's hard
      -- blocks; a wrong stop or scale is off by 1e-1 or more.  NDB's root 4 amplifies that noise below its floor
      -- (its second chain inverts the first one's square root): measured on the H200 1.45e-3 at block 39 (kappa
      -- 1e6, the hardest), so 5e-3 for NDB's hard blocks.
      local function tol_of(k) return k < 20 and 1e-4 or (m == "cn" and 1e-2 or 5e-3) end
      for k = 0, #specs - 1 do
        local e = normalized_error(gpu.x:select(0, k):to("f64"), cpu.x:select(0, k):to("f64"))
        assert(e <= tol_of(k), ("%s block %d: GPU differs from the CPU by %.3g"):format(m, k, e))
      end
      if not SELF then
        for _, lag in ipairs { 0, 1 } do
          with_env("MOONSTEP_DASH_LAG", lag, function()
            local x, _, its = ms.inv_root(dev(a), opts)
            assert.are.same(ig, vals(its))
            -- a shorter batch may get another cuBLAS kernel (another summation order): the hard blocks then
            -- differ by their below-floor noise, as between the devices
            for k = 0, #specs - 1 do
              local e = normalized_error(host(x):select(0, k):to("f64"), gpu.x:select(0, k):to("f64"))
              local tol = k < 20 and 1e-5 or tol_of(k)
              assert(e <= tol, ("%s lag %d block %d: differs by %.3g"):format(m, lag, k, e))
            end
          end)
        end
      end
    end
  end)

  -- moonstep.h: with a tolerance, a block whose iterate leaves the region of convergence (A_reg with a negative
  -- eigenvalue; NDB: max |Z Y - I| > 2, CN: max |M - I| > p + 1) stops as a converged one does, on the CUDA backend
  -- too.  Iterated on, its negative eigenvalue grows cubically once near -1: Inf and NaN within ~7 more steps.
  cuda_it("stops a diverging block (A_reg indefinite) as the CPU does when a tolerance is given: finite, same iterations", function()
    local b = 32
    local healthy, bad1, bad2 = spread(10, b), spread(10, b), spread(3, b)
    bad1[b] = -0.3   -- one negative eigenvalue, a tenth of the largest's size
    bad2[b] = -0.6
    local a = spd_stack({ healthy, bad1, bad2 }, 7350)
    for _, m in ipairs { "ndb", "cn" } do
      for _, p in ipairs { 2, 4 } do
        local opts = { method = m, root = p, steps = 16, scaling = "fro", eps = 0, tolerance = 1e-4, iters = true }
        local cpu, gpu = both(a, opts)
        local what = ("%s p=%d"):format(m, p)
        local ic = vals(cpu.it)
        local full = m == "ndb" and p == 4 and 32 or 16
        assert(ic[2] < full and ic[3] < full, what .. ": the reference ran the diverging blocks to the end")
        assert(finite(vals(gpu.x)), what .. ": non-finite root")
        assert.are.same(ic, vals(gpu.it))
        for k = 0, 2 do
          -- f32 noise, amplified by the few unstable steps before the stop
          local e = normalized_error(gpu.x:select(0, k):to("f64"), cpu.x:select(0, k):to("f64"))
          assert(e <= 1e-3, ("%s block %d: GPU differs from the CPU by %.3g"):format(what, k, e))
        end
      end
    end
  end)

  cuda_it("works only on the blocks of `index` (any order), leaving the others and their outputs as they were", function()
    local a = spd_stack({ spread(3, 40), spread(8, 40), clustered(5, 40), spread(20, 40), spread(2, 40),
                          clustered(3, 40), spread(6, 40), spread(4, 40) }, 7400)
    local ag = dev(a)
    for _, m in ipairs { "ndb", "cn", "evd", "chebyshev" } do
      for _, tol in ipairs { 0, 1e-4 } do
        if tol == 0 or m == "ndb" or m == "cn" then
          local o = { method = m, scaling = "pim", eps = m == "evd" and 1e-10 or 0, tolerance = tol, seed = 9,
                      steps = m == "chebyshev" and 60 or 10 }
          local full, rfull, ifull = ms.inv_root(ag, { method = o.method, scaling = o.scaling, eps = o.eps, tolerance = tol,
                                                      seed = 9, steps = o.steps, residual = true, iters = true })
          local x = ms.full({ 8, 40, 40 }, 7, { ctx = GPU })
          local res, its = ms.full({ 8 }, -7, { ctx = GPU }), ms.full({ 8 }, -7, { dtype = "i32", ctx = GPU })
          o.out, o.residual, o.iters = x, res, its
          o.index = ms.tensor({ 6, 1, 4 }, { dtype = "i32", ctx = GPU })
          ms.inv_root(ag, o)
          local rv, iv, rf, itf = vals(res), vals(its), vals(rfull), vals(ifull)
          for k = 0, 7 do
            local got = vals(x:select(0, k))
            if k == 6 or k == 1 or k == 4 then
              local e = normalized_error(x:select(0, k):to("f64"):to(CPU), full:select(0, k):to("f64"):to(CPU))
              assert(e <= 1e-5, ("%s block %d: differs from the full call by %.3g"):format(m, k, e))
              H.assert_close(rv[k + 1], rf[k + 1], 1e-4, 1e-9, m .. " residual")
              assert.are.equal(itf[k + 1], iv[k + 1])
            else
              for _, v in ipairs(got) do assert.are.equal(7, v) end
              assert.are.equal(-7, rv[k + 1])
              assert.are.equal(-7, iv[k + 1])
            end
          end
        end
      end
    end
  end)

  cuda_it("skips an out-of-range index entry on the device (the CPU refuses it) and computes the others", function()
    local a = dev(spd_stack({ spread(3, 16), spread(5, 16), spread(7, 16) }, 7450))
    local x = ms.full({ 3, 16, 16 }, 7, { ctx = GPU })
    ms.inv_root(a, { method = "cn", scaling = "fro", out = x, index = ms.tensor({ 2, 99, -1 }, { dtype = "i32", ctx = GPU }) })
    local full = ms.inv_root(a, { method = "cn", scaling = "fro" })
    for _, v in ipairs(vals(x:select(0, 0))) do assert.are.equal(7, v) end
    for _, v in ipairs(vals(x:select(0, 1))) do assert.are.equal(7, v) end
    local e = normalized_error(host(x):select(0, 2):to("f64"), host(full):select(0, 2):to("f64"))
    assert(e <= 1e-5, ("block 2 differs from the full call by %.3g"):format(e))
  end, true)

  cuda_it("handles awkward block sizes (1, 2, 31, 33, 100, 257, 520: no panels, uneven panels, partial tiles)", function()
    for _, b in ipairs { 1, 2, 31, 33, 100, 257, 520 } do
      local a = spd_stack({ spread(4, b), clustered(3, b) }, 7500 + b)
      for _, cfg in ipairs {
        { method = "ndb", scaling = "pim", pi_bf16 = false }, { method = "cn", scaling = "fro" }, { method = "evd", eps = 1e-10 },
        { method = "chebyshev", scaling = "fro", steps = 40 },
      } do
        local o = { root = 4, iters = true }
        for k, v in pairs(cfg) do o[k] = v end
        local cpu, gpu = both(a, o)
        assert.are.same(vals(cpu.it), vals(gpu.it))
        for k = 0, 1 do
          local e = normalized_error(gpu.x:select(0, k):to("f64"), cpu.x:select(0, k):to("f64"))
          assert(e <= 1e-4, ("b = %d %s block %d: GPU differs from the CPU by %.3g"):format(b, cfg.method, k, e))
        end
      end
    end
  end)

  cuda_it("gives the same roots with panel products and plain ones (MOONSTEP_DASH_SPLIT) and with every eigensolver path", function()
    for _, b in ipairs { 256, 512 } do
      local a = dev(spd_stack({ spread(6, b), clustered(4, b), spread(30, b) }, 7600 + b))
      for _, m in ipairs { "ndb", "cn", "chebyshev", "evd" } do
        local o = { method = m, root = 4, scaling = "pim", eps = m == "evd" and 1e-10 or 0, steps = m == "chebyshev" and 60 or 10 }
        local ref
        with_env("MOONSTEP_DASH_SPLIT", 1, function() ref = host(ms.inv_root(a, o)) end)
        for _, split in ipairs { 2, 4 } do
          with_env("MOONSTEP_DASH_SPLIT", split, function()
            local x = host(ms.inv_root(a, o))
            for k = 0, 2 do
              local e = normalized_error(x:select(0, k):to("f64"), ref:select(0, k):to("f64"))
              assert(e <= 1e-5, ("b %d %s split %d block %d: %.3g from the plain products"):format(b, m, split, k, e))
              -- symmetric (the panels outside the diagonal ones are mirrored copies)
              local xs = x:select(0, k):to("f64")
              local asym = (xs - xs:t()):norm() / xs:norm()
              assert(asym <= 1e-6, ("b %d %s split %d block %d: asymmetry %.3g"):format(b, m, split, k, asym))
            end
          end)
        end
      end
    end
    local function evd_paths(b, paths)
      local a = dev(spd_stack({ spread(6, b), clustered(40, b), spread(1e3, b) }, 7700 + b))
      local ref
      with_env("MOONSTEP_DASH_EVD", paths[1], function() ref = host(ms.inv_root(a, { method = "evd", eps = 1e-10, root = 2 })) end)
      for i = 2, #paths do
        with_env("MOONSTEP_DASH_EVD", paths[i], function()
          local x = host(ms.inv_root(a, { method = "evd", eps = 1e-10, root = 2 }))
          for k = 0, 2 do
            local e = normalized_error(x:select(0, k):to("f64"), ref:select(0, k):to("f64"))
            assert(e <= 1e-4, ("b %d EVD %s vs %s block %d: %.3g"):format(b, paths[i], paths[1], k, e))
          end
        end)
      end
    end
    evd_paths(96, { "streams", "batched" })
    evd_paths(24, { "streams", "batched", "jacobi" })
  end, true)

  -- CN's TF32 products go through cuBLASLt (A transposed, 128 x 128 tiles preferred) on Hopper when a stack fills
  -- 32 waves of tiles (engine/cuda/dash.c, solver_tile); MOONSTEP_DASH_TILE = 20 forces that path on any stack,
  -- 0 the default GEMM.  Against the CPU's f32 root, and the f64 one where kappa <= 1e2, the Lt path is no worse
  -- than the default one (TF32 rounds operands to 2^-11 of their largest entries), and a captured call through it
  -- replays as the uncaptured one.
  cuda_it("runs CN's TF32 products through cuBLASLt's preferred tile as accurately as the default GEMM, captured too", function()
    local b = 256
    local a = spd_stack({ spread(10, b), clustered(1e2, b), spread(1e3, b), spread(1e5, b) }, 7650)
    for _, p in ipairs { 2, 4 } do
      local o = { method = "cn", root = p, scaling = "fro", iters = true }
      local cpu, _, ic = ms.inv_root(a, o)
      local x, it = {}, {}
      for _, tile in ipairs { 0, 20 } do
        with_env("MOONSTEP_DASH_TILE", tile, function()
          local xg, _, ig = ms.inv_root(dev(a), { method = "cn", root = p, scaling = "fro", iters = true, tf32 = true })
          x[tile], it[tile] = host(xg), vals(host(ig))
        end)
      end
      assert.are.same(vals(ic), it[20])
      assert(finite(vals(x[20])), "non-finite root through the Lt path")
      for k = 0, 3 do
        local xc = cpu:select(0, k):to("f64")
        local e0 = normalized_error(x[0]:select(0, k):to("f64"), xc)
        local e1 = normalized_error(x[20]:select(0, k):to("f64"), xc)
        local what = ("cn p=%d block %d"):format(p, k)
        assert(e1 <= 1.5 * e0 + 1e-3, ("%s: the Lt path differs from the CPU by %.3g, the default GEMM by %.3g"):format(what, e1, e0))
        if k <= 1 then   -- resolved blocks: against the f64 root too (TF32 at b = 256: ~5e-3 on either path)
          local xt = exact_root(a, k, 0, p)
          local t0 = normalized_error(x[0]:select(0, k):to("f64"), xt)
          local t1 = normalized_error(x[20]:select(0, k):to("f64"), xt)
          assert(t1 <= 1.5 * t0 + 1e-3 and t1 <= 2e-2,
                 ("%s: the Lt path's error %.3g vs the f64 root, the default GEMM's %.3g"):format(what, t1, t0))
        end
      end
    end
    with_env("MOONSTEP_DASH_TILE", 20, function()
      local a1, a2 = dev(a), dev(spd_stack({ spread(5, b), spread(2, b), clustered(30, b), spread(1e4, b) }, 7660))
      local x = ms.empty({ 4, b, b }, { ctx = GPU })
      local o = { method = "cn", root = 4, scaling = "fro", tf32 = true, out = x }
      ms.inv_root(a1, o)   -- warm-up: the pool caches the call's scratch, the Lt handle is made
      GPU:sync()
      local g = graph.capture(GPU, function() ms.inv_root(a1, o) end)
      a1:copy_(a2)
      g:launch()
      GPU:sync()
      local want = host(ms.inv_root(a2, { method = "cn", root = 4, scaling = "fro", tf32 = true }))
      for k = 0, 3 do
        local e = normalized_error(host(x):select(0, k):to("f64"), want:select(0, k):to("f64"))
        assert(e <= 1e-5, ("block %d: the replay differs by %.3g"):format(k, e))
      end
      g:free()
    end)
  end)

  cuda_it("refuses a non-finite block for EVD, naming it, and leaves x unchanged", function()
    local a = spd_stack({ spread(3, 12), spread(3, 12), spread(3, 12) }, 7800)
    a:select(0, 2):select(0, 4):select(0, 7):fill_(0 / 0)
    local x = ms.full({ 3, 12, 12 }, 3, { ctx = GPU })
    H.expect_error(function() ms.inv_root(dev(a), { method = "evd", eps = 1e-10, out = x }) end, "block 2", "non-finite")
    for _, v in ipairs(vals(x)) do assert.are.equal(3, v) end
    -- an iterative method passes NaN through to that block only (the residual shows it)
    local xn, rn = ms.inv_root(dev(a), { method = "cn", residual = true })
    local r = vals(rn)
    assert(r[3] ~= r[3], "NaN block: residual should be NaN")
    assert(r[1] == r[1] and r[2] == r[2], "the other blocks are unaffected")
    assert(finite(vals(xn:select(0, 0))), "block 0 finite")
  end)

  cuda_it("replays a captured inv_root (fixed steps and early exit) with new inputs as an uncaptured call", function()
    local a1 = spd_stack({ spread(3, 64), spread(1e4, 64), clustered(5, 64) }, 7900)
    local a2 = spd_stack({ spread(5, 64), spread(2, 64), clustered(1e3, 64) }, 7910)
    for _, tol in ipairs { 0, 1e-4 } do
      for _, m in ipairs { "ndb", "cn" } do
        local a = dev(a1)
        local x = ms.empty({ 3, 64, 64 }, { ctx = GPU })
        local its = ms.empty({ 3 }, { dtype = "i32", ctx = GPU })
        local o = { method = m, scaling = "pim", tolerance = tol, out = x, iters = its, seed = 4 }
        ms.inv_root(a, o)                                  -- warm-up: the pool caches the call's scratch
        GPU:sync()
        local g = graph.capture(GPU, function() ms.inv_root(a, o) end)
        a:copy_(dev(a2))
        g:launch()
        GPU:sync()
        local want, _, wits = ms.inv_root(dev(a2), { method = m, scaling = "pim", tolerance = tol, seed = 4, iters = true })
        assert.are.same(vals(wits), vals(its))
        for k = 0, 2 do
          local e = normalized_error(host(x):select(0, k):to("f64"), host(want):select(0, k):to("f64"))
          assert(e <= 1e-5, ("%s tol %g block %d: the replay differs by %.3g"):format(m, tol, k, e))
        end
        g:free()
      end
    end
  end, true)
end)

describe("CUDA ms.spectrum_estimate", function()
  cuda_it("matches the CPU: lam_max, and lam_min from an inverse root (f32 1e-4, bf16 1e-2)", function()
    local b = 48
    local a = spd_stack({ spread(10, b), spread(1e3, b), clustered(1e2, b), spread(1e5, b) }, 8000)
    local X = ms.inv_root(a, { method = "evd", eps = 0, root = 4 })
    for _, bf in ipairs { false, true } do
      local o = { x_root = X, root = 4, eps = 1e-6, bf16 = bf, seed = 12, vectors = 16, steps = 10 }
      local mc, nc = ms.spectrum_estimate(a, o)
      o.x_root = dev(X)
      local mg, ng = ms.spectrum_estimate(dev(a), o)
      local tol = bf and 1e-2 or 1e-4
      H.assert_close(vals(mg), vals(mc), tol, 0, "lam_max")
      H.assert_close(vals(ng), vals(nc), tol * 4, 0, "lam_min")
    end
    -- a zero block: lam_max = 0 (q - eps), lam_min = +inf, no NaN
    local lmax, lmin = ms.spectrum_estimate(ms.zeros({ 1, 8, 8 }, { ctx = GPU }),
                                            { x_root = ms.zeros({ 1, 8, 8 }, { ctx = GPU }), eps = 1e-6 })
    H.assert_close(vals(lmax)[1], 0, 0, 1e-9, "zero block lam_max")
    assert.are.equal(math.huge, vals(lmin)[1])
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- rng_ids: random vectors keyed by block id (moonstep.h, "Random vectors"); ids read on the device
-- ---------------------------------------------------------------------------------------------------
describe("CUDA DASH rng_ids", function()
  -- relative Frobenius distance of two lists
  local function rel(x, y)
    local d, n = 0, 0
    for i = 1, #y do d, n = d + (x[i] - y[i]) ^ 2, n + y[i] ^ 2 end
    return math.sqrt(d / math.max(n, 1e-300))
  end
  -- unconverged settings: the roots, residuals and estimates depend on the start vectors far beyond the
  -- CPU / GPU rounding differences (checked: the call without ids is far from the one with them)
  local b = 24
  local a = spd_stack({ spread(10, b), clustered(30, b), spread(50, b), spread(5, b), clustered(8, b) }, 8100)
  local ids = { 900001, -5, 3, 2147483647, 17 }

  cuda_it("inv_root with rng_ids (and index) matches the CPU with them: roots, residuals, iterations", function()
    for _, m in ipairs { { "ndb", 3 }, { "cn", 3 }, { "chebyshev", 8 } } do
      for _, sc in ipairs { "pi", "pim" } do
        local o = { method = m[1], steps = m[2], scaling = sc, root = 4, eps = 1e-4, pi_steps = 1, pi_vectors = 3,
                    pi_bf16 = false, seed = 77, residual = true, iters = true, rng_ids = ms.tensor(ids, { dtype = "i32" }) }
        local what = m[1] .. " " .. sc
        local xc, rc, ic = ms.inv_root(a, o)
        o.rng_ids = dev(o.rng_ids)
        local xg, rg, ig = ms.inv_root(dev(a), o)
        local e = rel(vals(host(xg)), vals(xc))
        assert(e <= 1e-4, ("%s: the GPU's roots differ from the CPU's by %.3g"):format(what, e))
        H.assert_close(vals(host(rg)), vals(rc), 1e-4, 1e-9, what .. ": residuals")
        assert.are.same(vals(ic), vals(host(ig)), what .. ": iterations")
        local xn, rn = ms.inv_root(a, { method = m[1], steps = m[2], scaling = sc, root = 4, eps = 1e-4, pi_steps = 1,
                                        pi_vectors = 3, pi_bf16 = false, seed = 77, residual = true })
        assert(rel(vals(rn), vals(rc)) > 1e-2, what .. ": the residuals ignore the sketch (the check cannot fail)")
        if sc == "pi" and m[1] ~= "chebyshev" then
          assert(rel(vals(xn), vals(xc)) > 1e-3, what .. ": the roots ignore the start vectors (the check cannot fail)")
        end
        -- index: positions 4 and 1 only, each drawing as its id
        local x = ms.full({ 5, b, b }, 7, { ctx = GPU })
        local res = ms.full({ 5 }, -7, { ctx = GPU })
        o.out, o.residual, o.iters, o.index = x, res, nil, ms.tensor({ 4, 1 }, { dtype = "i32", ctx = GPU })
        ms.inv_root(dev(a), o)
        local xs, rv, rcv = host(x), vals(host(res)), vals(rc)
        for k = 0, 4 do
          if k == 4 or k == 1 then
            local ek = rel(vals(xs:select(0, k)), vals(xc:select(0, k)))
            assert(ek <= 1e-4, ("%s index: block %d differs from the CPU by %.3g"):format(what, k, ek))
            H.assert_close(rv[k + 1], rcv[k + 1], 1e-4, 1e-9, what .. " index: residual")
          else
            for _, v in ipairs(vals(xs:select(0, k))) do assert.are.equal(7, v) end
            assert.are.equal(-7, rv[k + 1])
          end
        end
      end
    end
  end)

  cuda_it("spectrum_estimate with rng_ids matches the CPU with them (lam_max, lam_min; f32 and bf16)", function()
    local X = ms.inv_root(a, { method = "evd", eps = 1e-4, root = 2 })
    for _, bf in ipairs { false, true } do
      local o = { x_root = X, root = 2, eps = 1e-6, bf16 = bf, seed = 13, vectors = 2, steps = 1,
                  rng_ids = ms.tensor(ids, { dtype = "i32" }) }
      local mc, nc = ms.spectrum_estimate(a, o)
      o.x_root, o.rng_ids = dev(X), dev(o.rng_ids)
      local mg, ng = ms.spectrum_estimate(dev(a), o)
      local tol = bf and 1e-2 or 1e-4
      H.assert_close(vals(host(mg)), vals(mc), tol, 0, "lam_max")
      H.assert_close(vals(host(ng)), vals(nc), tol * 4, 0, "lam_min")
      local mn = ms.spectrum_estimate(a, { root = 2, eps = 1e-6, bf16 = bf, seed = 13, vectors = 2, steps = 1 })
      assert(rel(vals(mn), vals(mc)) > 10 * tol, "the estimates ignore the start vectors (the check cannot fail)")
    end
  end)

  cuda_it("blocks_apply's stochastic rounding keys on rng_ids bit for bit as the CPU", function()
    for _, dt in ipairs { "bf16", "f16" } do
      local seed = H.seed()
      local p0 = ms.randn({ 16, 24 }, { seed = seed, dtype = dt })
      local stack = ms.randn({ 6, 8, 8 }, { seed = seed + 1 }) * 0.01
      local bids = ms.tensor({ 12, -3, 5, 0, 77777, 2 }, { dtype = "i32" })
      local function run(ctx, with_ids)
        local p = p0:to(ctx):clone()
        local bl = {}
        for r = 0, 1 do for c = 0, 2 do bl[#bl + 1] = { tensor = p, row0 = 8 * r, col0 = 8 * c } end end
        ms.blocks_apply { blocks = bl, stack = stack:to(ctx), lr = 0.3, weight_decay = 0.1, step = 4,
                          stochastic_round = true, seed = seed, rng_ids = with_ids and bids:to(ctx) or nil }
        return vals(host(p))
      end
      local c, g = run(CPU, true), run(GPU, true)
      assert_same(g, c, dt .. " with ids")
      local n = run(CPU, false)
      local diff = false
      for i = 1, #n do diff = diff or n[i] ~= c[i] end
      assert(diff, dt .. ": the rounding ignores the ids (the check cannot fail)")
    end
  end)

  cuda_it("a captured inv_root and spectrum_estimate read the ids at replay (new ids, new vectors)", function()
    local ag = dev(a)
    local idt = ms.tensor(ids, { dtype = "i32", ctx = GPU })
    local x, res = ms.empty({ 5, b, b }, { ctx = GPU }), ms.empty({ 5 }, { ctx = GPU })
    local lmax = ms.empty({ 5 }, { ctx = GPU })
    local o = { method = "ndb", steps = 3, scaling = "pim", root = 4, eps = 1e-4, pi_steps = 1, pi_vectors = 3,
                pi_bf16 = false, seed = 5, out = x, residual = res, rng_ids = idt }
    local so = { vectors = 2, steps = 1, eps = 1e-6, seed = 5, rng_ids = idt, lam_max = lmax }
    ms.inv_root(ag, o)
    ms.spectrum_estimate(ag, so)
    GPU:sync()
    local g = graph.capture(GPU, function() ms.inv_root(ag, o) ms.spectrum_estimate(ag, so) end)
    local new = { 8, 6, 4, 2, 0 }
    idt:copy_(ms.tensor(new, { dtype = "i32", ctx = GPU }))
    g:launch()
    GPU:sync()
    local wx, wr = ms.inv_root(a, { method = "ndb", steps = 3, scaling = "pim", root = 4, eps = 1e-4, pi_steps = 1,
                                    pi_vectors = 3, pi_bf16 = false, seed = 5, residual = true, rng_ids = new })
    local wl = ms.spectrum_estimate(a, { vectors = 2, steps = 1, eps = 1e-6, seed = 5, rng_ids = new })
    assert(rel(vals(host(x)), vals(wx)) <= 1e-4, "the replayed roots are not those of the new ids")
    H.assert_close(vals(host(res)), vals(wr), 1e-4, 1e-9, "replayed residuals")
    H.assert_close(vals(host(lmax)), vals(wl), 1e-4, 0, "replayed lam_max")
    g:free()
  end, true)
end)

-- ---------------------------------------------------------------------------------------------------
-- gather with the factor products
-- ---------------------------------------------------------------------------------------------------
describe("CUDA ms.blocks_gather_factors", function()
  -- blocks of 37 x 50 (partial 32 x 32 tiles of the transposing gather) from an f32 [74, 100] and a transposed
  -- bf16 [100, 74] view; the same values on both devices
  local function problem(ctx, seed)
    local a = ms.randn({ 74, 100 }, { seed = seed }):to(ctx)
    local b = ms.randn({ 100, 74 }, { seed = seed + 1, dtype = "bf16" }):to(ctx):t()
    local blocks = {}
    for _, t in ipairs { a, b } do
      for r = 0, 1 do for c = 0, 1 do blocks[#blocks + 1] = { tensor = t, row0 = 37 * r, col0 = 50 * c } end end
    end
    return blocks, a
  end

  -- the worst block's max |got - want| / max |want|
  local function worst(got, want)
    local e = 0
    for k = 0, want:size(0) - 1 do
      local w, g = want:select(0, k):to("f64"), host(got):select(0, k):to("f64")
      local m = (g - w):abs():max()
      local s = w:abs():max()
      m, s = type(m) == "number" and m or m:item(), type(s) == "number" and s or s:item()
      e = max(e, m / s)
      if m ~= m then return 0 / 0 end
    end
    return e
  end

  cuda_it("matches the CPU on every product path (lt, ex, nt) in f32 and TF32, reproducibly, with and without a right factor", function()
    local seed = H.seed()
    local bc, bg = problem(CPU, seed), problem(GPU, seed)
    local lg = ms.block_list(bg)
    local l0, r0 = ms.randn({ 8, 37, 37 }, { seed = seed + 2 }), ms.randn({ 8, 50, 50 }, { seed = seed + 3 })
    local Gc, Lc, Rc = ms.empty({ 8, 37, 50 }), l0:clone(), r0:clone()
    ms.blocks_gather_factors { stack = Gc, blocks = bc, left = Lc, right = Rc, alpha = 0.05, beta = 0.95 }
    for _, path in ipairs { "lt", "ex", "nt" } do
      for _, tf32 in ipairs { false, true } do
        with_env("MOONSTEP_DASH_FACTOR_GEMM", path, function()
          local what = ("%s%s"):format(path, tf32 and " tf32" or "")
          local G, L, R = ms.empty({ 8, 37, 50 }, { ctx = GPU }), dev(l0):clone(), dev(r0):clone()
          ms.blocks_gather_factors { stack = G, blocks = lg, left = L, right = R, alpha = 0.05, beta = 0.95, tf32 = tf32 }
          assert_same(vals(G), vals(Gc), what .. ": stack")
          local tol = tf32 and 3e-3 or 2e-6
          local el, er = worst(L, Lc), worst(R, Rc)
          assert(el <= tol and er <= tol, ("%s: left %.3g, right %.3g off the CPU (tolerance %g)"):format(what, el, er, tol))
          local L2, R2 = dev(l0):clone(), dev(r0):clone()
          ms.blocks_gather_factors { stack = G, blocks = lg, left = L2, right = R2, alpha = 0.05, beta = 0.95, tf32 = tf32 }
          assert_same(vals(L2), vals(L), what .. ": left again")
          assert_same(vals(R2), vals(R), what .. ": right again")
          -- no right factor: the left alone, beta = 0 ignoring old NaNs
          local L3 = ms.full({ 8, 37, 37 }, 0 / 0, { ctx = GPU })
          ms.blocks_gather_factors { stack = G, blocks = lg, left = L3, alpha = 2, beta = 0, tf32 = tf32 }
          local Lw = ms.matmul(Gc, Gc, { trans_b = true }) * 2
          local e3 = worst(L3, Lw)
          assert(e3 <= tol, ("%s: left alone %.3g off"):format(what, e3))
        end)
      end
    end
  end)

  -- a stack or factor may be a contiguous view at any element offset into a larger buffer; cuBLASLt's heuristic takes
  -- operands to be 256-byte aligned unless told, and on the H200 the TF32 algorithm it picks for aligned 64 x 64
  -- operands answers CUBLAS_STATUS_NOT_SUPPORTED for an A 4, 8 or 12 bytes off
  cuda_it("takes a stack and factors at any element offset on the cuBLASLt path (f32 and TF32), as the CPU", function()
    local seed = H.seed()
    local n, r, c = 6, 64, 64
    local src = ms.randn({ n * r, c }, { seed = seed })
    local l0, r0 = ms.randn({ n, r, r }, { seed = seed + 1 }), ms.randn({ n, c, c }, { seed = seed + 2 })
    local function blocks(t)
      local b = {}
      for k = 0, n - 1 do b[#b + 1] = { tensor = t, row0 = r * k, col0 = 0 } end
      return b
    end
    local Gc, Lc, Rc = ms.empty({ n, r, c }), l0:clone(), r0:clone()
    ms.blocks_gather_factors { stack = Gc, blocks = blocks(src), left = Lc, right = Rc, alpha = 0.05, beta = 0.95 }
    local bg = ms.block_list(blocks(dev(src)))
    -- a contiguous view `off` elements into a buffer of its own, holding init (when given)
    local function at(off, shape, init)
      local len = shape[1] * shape[2] * shape[3]
      local v = ms.empty({ len + off }, { ctx = GPU }):slice(0, off, off + len):view(shape)
      if init then v:copy_(dev(init)) end
      return v
    end
    for _, off in ipairs { 0, 1, 2, 3 } do
      for _, tf32 in ipairs { false, true } do
        local what = ("offset %d%s"):format(off, tf32 and " tf32" or "")
        local G, L, R = at(off, { n, r, c }), at(off, { n, r, r }, l0), at(off, { n, c, c }, r0)
        ms.blocks_gather_factors { stack = G, blocks = bg, left = L, right = R, alpha = 0.05, beta = 0.95, tf32 = tf32 }
        assert_same(vals(G), vals(Gc), what .. ": stack")
        local tol = tf32 and 3e-3 or 2e-6
        local el, er = worst(L, Lc), worst(R, Rc)
        assert(el <= tol and er <= tol, ("%s: left %.3g, right %.3g off the CPU (tolerance %g)"):format(what, el, er, tol))
      end
    end
  end)

  cuda_it("grafts bit for bit as the CPU, in its own pass and fused into the gather (norms to 1e-6; EMA, beta_grad 0, pgraft, step_t, skip; with and without G^T)", function()
    local seed = H.seed()
    local bc, bg = problem(CPU, seed), problem(GPU, seed)
    local lg = ms.block_list(bg)
    local m0, v0 = ms.randn({ 8, 37, 50 }, { seed = seed + 4 }), ms.rand({ 8, 37, 50 }, { seed = seed + 5 })
    local cases = {
      { beta_grad = 0.9, beta_graft = 0.95, step = 3, pg = true, right = true },
      { beta_grad = 0, beta_graft = 0.9, step = 5, device_step = true, bias_correction = false, right = true },
      { beta_grad = 0.8, beta_graft = 0.99, step = 2, pg = true, right = false },
      { beta_grad = 0.9, beta_graft = 0.95, step = 4, skip = true, right = true },
    }
    for i, case in ipairs(cases) do
      local function run(ctx, blocks)
        local G = ms.empty({ 8, 37, 50 }, { ctx = ctx })
        local L, R = ms.zeros({ 8, 37, 37 }, { ctx = ctx }), case.right and ms.zeros({ 8, 50, 50 }, { ctx = ctx }) or nil
        local g = { grad_ema = m0:to(ctx):clone(), adam_v = v0:to(ctx):clone(), norm = ms.full({ 8 }, -1, { ctx = ctx }),
                    pgraft = case.pg and ms.empty({ 8, 37, 50 }, { ctx = ctx }) or nil, beta_grad = case.beta_grad,
                    beta_graft = case.beta_graft, eps = 1e-8, bias_correction = case.bias_correction,
                    step = case.device_step and ms.full({ 1 }, case.step, { ctx = ctx }) or case.step,
                    skip = case.skip and ms.full({ 1 }, 1, { ctx = ctx }) or nil }
        ms.blocks_gather_factors { stack = G, blocks = blocks, left = L, right = R, alpha = 1, beta = 0, graft = g }
        return G, g
      end
      local Gc, gc = run(CPU, bc)
      for _, fused in ipairs { "0", "1" } do
      local Gg, gg
      with_env("MOONSTEP_DASH_GATHER_GRAFT", fused, function() Gg, gg = run(GPU, lg) end)
      local what = ("case %d, fused %s"):format(i, fused)
      assert_same(vals(Gg), vals(Gc), what .. ": stack")
      assert_same(vals(gg.grad_ema), vals(gc.grad_ema), what .. ": grad_ema")
      assert_same(vals(gg.adam_v), vals(gc.adam_v), what .. ": adam_v")
      if case.pg then assert_same(vals(gg.pgraft), vals(gc.pgraft), what .. ": pgraft") end
      local nc, ng = vals(gc.norm), vals(gg.norm)
      for k = 1, 8 do
        assert(abs(ng[k] - nc[k]) <= 1e-6 * abs(nc[k]), ("%s: norm %d is %.9g, the CPU's %.9g"):format(what, k, ng[k], nc[k]))
      end
      if case.skip then assert_same(vals(gg.grad_ema), vals(m0), what .. ": skip leaves grad_ema") end
      end
    end
  end)

  cuda_it("replays a captured call with new gradients as an uncaptured call", function()
    local seed = H.seed()
    local bg, a = problem(GPU, seed)
    local list = ms.block_list(bg)
    local l0, r0 = ms.randn({ 8, 37, 37 }, { seed = seed + 2 }), ms.randn({ 8, 50, 50 }, { seed = seed + 3 })
    local G, L, R = ms.empty({ 8, 37, 50 }, { ctx = GPU }), dev(l0):clone(), dev(r0):clone()
    local o = { stack = G, blocks = list, left = L, right = R, alpha = 0.05, beta = 0.95, tf32 = true }
    ms.blocks_gather_factors(o)                     -- warm-up: handle, algorithm and scratch exist before capture
    GPU:sync()
    local g = graph.capture(GPU, function() ms.blocks_gather_factors(o) end)
    L:copy_(dev(l0):clone())
    R:copy_(dev(r0):clone())
    a:copy_(ms.randn({ 74, 100 }, { seed = seed + 9 }):to(GPU))
    g:launch()
    GPU:sync()
    local G2, L2, R2 = ms.empty({ 8, 37, 50 }, { ctx = GPU }), dev(l0):clone(), dev(r0):clone()
    ms.blocks_gather_factors { stack = G2, blocks = list, left = L2, right = R2, alpha = 0.05, beta = 0.95, tf32 = true }
    assert_same(vals(G), vals(G2), "stack")
    assert_same(vals(L), vals(L2), "left")
    assert_same(vals(R), vals(R2), "right")
    g:free()
  end, true)
end)
