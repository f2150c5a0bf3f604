-- ms.blocks_gather_factors (DASH's gather with its factor accumulation, engine/cpu/dash.c) on the CPU: the stack
-- bit for bit as ms.blocks_gather, the factors bit for bit as the ms_matmul calls the recipe made before the op
-- existed, and both against an f64 evaluation of L <- beta L + alpha G G^T, R <- beta R + alpha G^T G on fresh
-- random f32 / bf16 / transposed blocks of uneven sizes; the fused grafting update bit for bit as ms.dash_graft
-- on the gathered stack; beta = 0 ignoring old NaNs, no right factor, and every validation error (changing nothing).  The CUDA backend is checked against this in tests/cuda_dash_spec.lua.
local ms = require("moonstep")

local function vals(t) return t:tolist_flat() end

local function same_bits(got, want, what)
  assert.are.equal(#want, #got, what .. ": length")
  for i = 1, #want do
    if not (got[i] == want[i] or (got[i] ~= got[i] and want[i] ~= want[i])) then
      error(("%s: element %d is %.9g, expected %.9g"):format(what, i, got[i], want[i]), 2)
    end
  end
end

-- two parameters cut into 6 x 10 blocks: an f32 [12, 30] (6 blocks) and a bf16 [30, 12] seen transposed (6)
local function problem(seed)
  local a = ms.randn({ 12, 30 }, { seed = seed })
  local b = ms.randn({ 30, 12 }, { seed = seed + 1, dtype = "bf16" }):t()
  local blocks = {}
  for _, t in ipairs { a, b } do
    for r = 0, 1 do for c = 0, 2 do blocks[#blocks + 1] = { tensor = t, row0 = 6 * r, col0 = 10 * c } end end
  end
  return blocks, a, b
end

-- f64 reference of block k's products: G (f64) from its tensor, beta F + alpha G G^T / G^T G
local function reference(blocks, k, left0, right0, alpha, beta)
  local b = blocks[k + 1]
  local G = b.tensor:to("f64"):slice(0, b.row0, b.row0 + 6):slice(1, b.col0, b.col0 + 10):contiguous()
  local L = ms.matmul(G, G, { trans_b = true }) * alpha
  local R = ms.matmul(G, G, { trans_a = true }) * alpha
  if beta ~= 0 then
    L = L + left0:select(0, k):to("f64") * beta
    R = R + right0:select(0, k):to("f64") * beta
  end
  return L, R
end

local function max_abs(t) local m = t:abs():max() return type(m) == "number" and m or m:item() end

describe("ms.blocks_gather_factors (CPU)", function()
  it("gathers as ms.blocks_gather and accumulates both factors as the f64 formula and the old ms.matmul calls", function()
    local seed = H.seed()
    local blocks = problem(seed)
    local list = ms.block_list(blocks)
    local left0, right0 = ms.randn({ 12, 6, 6 }, { seed = seed + 2 }), ms.randn({ 12, 10, 10 }, { seed = seed + 3 })
    for _, ab in ipairs { { 0.05, 0.95 }, { 1, 1 }, { 0.3, 0 } } do
      local alpha, beta = ab[1], ab[2]
      local G, L, R = ms.empty({ 12, 6, 10 }), left0:clone(), right0:clone()
      ms.blocks_gather_factors { stack = G, blocks = list, left = L, right = R, alpha = alpha, beta = beta }
      local Gw = ms.blocks_gather(ms.empty({ 12, 6, 10 }), list)
      same_bits(vals(G), vals(Gw), "stack")
      local Lw, Rw = left0:clone(), right0:clone()
      ms.matmul(Gw, Gw, { trans_b = true, alpha = alpha, beta = beta, out = Lw })
      ms.matmul(Gw, Gw, { trans_a = true, alpha = alpha, beta = beta, out = Rw })
      same_bits(vals(L), vals(Lw), "left as ms.matmul")
      same_bits(vals(R), vals(Rw), "right as ms.matmul")
      for k = 0, 11 do
        local Lr, Rr = reference(blocks, k, left0, right0, alpha, beta)
        local el = max_abs(L:select(0, k):to("f64") - Lr) / max_abs(Lr)
        local er = max_abs(R:select(0, k):to("f64") - Rr) / max_abs(Rr)
        assert(el <= 2e-6 and er <= 2e-6, ("alpha %g beta %g block %d: left %.3g, right %.3g off the f64 formula"):format(
          alpha, beta, k, el, er))
      end
    end
  end)

  it("with beta = 0 ignores the old factors (NaN included), and without a right factor updates only the left", function()
    local seed = H.seed()
    local blocks = problem(seed)
    local G, L = ms.empty({ 12, 6, 10 }), ms.full({ 12, 6, 6 }, 0 / 0)
    ms.blocks_gather_factors { stack = G, blocks = blocks, left = L, alpha = 2, beta = 0 }
    local want = ms.matmul(G, G, { trans_b = true }) * 2
    same_bits(vals(L), vals(want), "left")
    local R0 = ms.randn({ 12, 10, 10 }, { seed = seed + 5 })
    local R = R0:clone()
    ms.blocks_gather_factors { stack = G, blocks = blocks, left = L, alpha = 1, beta = 0.5 }
    same_bits(vals(R), vals(R0), "an untouched right factor")
  end)

  it("grafts in the same call exactly as ms.dash_graft on the gathered stack (EMA, beta_grad 0, pgraft, step_t, skip)", function()
    local seed = H.seed()
    local blocks = problem(seed)
    local list = ms.block_list(blocks)
    local m0, v0 = ms.randn({ 12, 6, 10 }, { seed = seed + 4 }), ms.rand({ 12, 6, 10 }, { seed = seed + 5 })
    local cases = {
      { beta_grad = 0.9, beta_graft = 0.95, step = 3, pg = true },
      { beta_grad = 0, beta_graft = 0.9, step = ms.full({ 1 }, 5), bias_correction = false },
      { beta_grad = 0.8, beta_graft = 0.99, step = 2, skip = ms.full({ 1 }, 1) },
    }
    for i, case in ipairs(cases) do
      local G, L, R = ms.empty({ 12, 6, 10 }), ms.zeros({ 12, 6, 6 }), ms.zeros({ 12, 10, 10 })
      local m, v, norm, pg = m0:clone(), v0:clone(), ms.full({ 12 }, -1), case.pg and ms.empty({ 12, 6, 10 }) or nil
      local g = { grad_ema = m, adam_v = v, norm = norm, pgraft = pg, eps = 1e-8 }
      for k, x in pairs(case) do if k ~= "pg" then g[k] = x end end
      ms.blocks_gather_factors { stack = G, blocks = list, left = L, right = R, alpha = 0.05, beta = 0.95, graft = g }
      local Gw = ms.blocks_gather(ms.empty({ 12, 6, 10 }), list)
      local mw, vw, pw = m0:clone(), v0:clone(), case.pg and ms.empty({ 12, 6, 10 }) or nil
      local nw = ms.full({ 12 }, -1)
      local gw = { grad = Gw, grad_ema = mw, adam_v = vw, norm = nw, pgraft = pw, eps = 1e-8 }
      for k, x in pairs(case) do if k ~= "pg" then gw[k] = x end end
      ms.dash_graft(gw)
      same_bits(vals(G), vals(Gw), ("case %d: stack"):format(i))
      same_bits(vals(m), vals(mw), ("case %d: grad_ema"):format(i))
      same_bits(vals(v), vals(vw), ("case %d: adam_v"):format(i))
      same_bits(vals(norm), vals(nw), ("case %d: norm"):format(i))
      if pg then same_bits(vals(pg), vals(pw), ("case %d: pgraft"):format(i)) end
      if case.skip then same_bits(vals(m), vals(m0), "skip: grad_ema unchanged") end
      local Lw = ms.matmul(Gw, Gw, { trans_b = true, alpha = 0.05 })
      same_bits(vals(L), vals(Lw), ("case %d: left"):format(i))
    end
  end)

  it("refuses bad factors, options and overlaps, changing nothing", function()
    local seed = H.seed()
    local blocks = problem(seed)
    local G = ms.randn({ 12, 6, 10 }, { seed = seed + 7 })
    local L, R = ms.randn({ 12, 6, 6 }, { seed = seed + 8 }), ms.randn({ 12, 10, 10 }, { seed = seed + 9 })
    local g0, l0, r0 = vals(G), vals(L), vals(R)
    local function call(a)
      return function()
        local o = { stack = G, blocks = blocks, left = L, right = R, alpha = 0.1, beta = 0.9 }
        for k, v in pairs(a) do o[k] = v end
        ms.blocks_gather_factors(o)
      end
    end
    H.expect_error(call { left = ms.zeros({ 12, 10, 10 }) }, "ms_blocks_gather_factors", "left has shape [12,10,10]", "[12, 6, 6]")
    H.expect_error(call { left = ms.zeros({ 11, 6, 6 }) }, "left has shape [11,6,6]")
    H.expect_error(call { right = ms.zeros({ 12, 6, 6 }) }, "right has shape [12,6,6]", "[12, 10, 10]")
    H.expect_error(call { right = ms.zeros({ 12, 10, 10 }, { dtype = "f64" }) }, "right has dtype f64")
    H.expect_error(call { left = ms.zeros({ 12, 12, 6 }):slice(1, 0, 6) }, "left", "contiguous")
    H.expect_error(call { alpha = 0 / 0 }, "alpha = ", "must be finite")
    H.expect_error(call { beta = math.huge }, "beta = inf")
    H.expect_error(call { alpha = "x" }, "alpha and beta must be numbers")
    H.expect_error(call { left = G:reshape({ 720 }):slice(0, 0, 432):reshape({ 12, 6, 6 }) }, "overlap")
    H.expect_error(call { right = L }, "right has shape [12,6,6]")
    local gr = function(x) local g = { grad_ema = ms.zeros({ 12, 6, 10 }), adam_v = ms.zeros({ 12, 6, 10 }), norm = ms.zeros({ 12 }) }
      for k, v in pairs(x) do g[k] = v end return g end
    H.expect_error(call { graft = gr { beta_grad = 1 } }, "beta_grad = 1")
    H.expect_error(call { graft = gr { norm = ms.zeros({ 11 }) } }, "norm has shape [11]")
    H.expect_error(call { graft = gr { adam_v = ms.zeros({ 12, 10, 6 }) } }, "adam_v has shape [12,10,6]")
    H.expect_error(call { graft = gr { grad_ema = G } }, "overlap")
    H.expect_error(call { graft = gr { adam_v = L:reshape({ 432 }):slice(0, 0, 360):reshape({ 12, 6, 5 }) } }, "adam_v")
    H.expect_error(call { graft = { norm = 3 } }, "graft must be a table")
    local Rv = ms.zeros({ 12, 10, 10 })
    H.expect_error(call { stack = ms.zeros({ 11, 6, 10 }) }, "n = 12")
    H.expect_error(call { blocks = { { tensor = Rv, row0 = 0, col0 = 0 } }, stack = ms.zeros({ 1, 6, 10 }),
                          left = ms.zeros({ 1, 6, 6 }), right = Rv:slice(0, 0, 1) }, "overlap")
    same_bits(vals(G), g0, "stack after the errors")
    same_bits(vals(L), l0, "left after the errors")
    same_bits(vals(R), r0, "right after the errors")
  end)
end)
