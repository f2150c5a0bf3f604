--[[
bench/dash_bench.lua -- DASH on the GPU host (issue 6): the inverse-root solvers alone and the whole optimizer
step of recipes/dash.lua, on the 2-D parameters of DASH's Llama-953M with B = 1024 (research/dash.md §1.5, §8).

  build/moonstep bench/dash_bench.lua [--set subset|full] [--solvers ndb_pim,ndb_fro,cn_f32,cn_f16,evd,cheb,auto,
                                       ndb_pim_f16,ndb_fro_f16]
                                      (default: all but cheb; the full set leaves evd out unless named)
                                      [--parts solver,step] [--tol 1e-2,1e-3] [--spectrum controlled|random|lm]
                                      [--lm-steps 300] [--lm-width 1024] [--lm-layers 8]
                                      [--trials 5] [--steps 10] [--evd-paths] [--splits] [--stacks] [--json PATH]
                                      [--device cuda] [--tiny] [--capture]
  python3 bench/torch_baselines/dash.py --spectrum controlled      -- DASH's math in PyTorch, own process

Sets: "subset" = the first 12 parameters in layer order (factors 228 x 1024 + 12 x 512, about one of 8 GPUs'
share, the set of research/anchors-h200.md); "full" = all 80 (1568 x 1024 + 96 x 512).  Factors: "controlled"
spectra as the pinned baseline makes them -- Q diag(l) Q^T, condition numbers log-uniform in [1e1, 1e7], every
tenth block rank-deficient (half its eigenvalues 0) -- with Q from a pool of 32 random orthogonal matrices
(eigenvectors of random symmetric matrices; the solvers' work does not depend on Q); "random": EMAs of G G^T
over 4 Gaussian steps (condition ~10, easy); "lm": the factor blocks of a real training run (the built-in lm
problem at width 1024, 8 hidden layers, trained with recipes/dash.lua for --lm-steps steps), repeated to fill
the set's stacks, with a histogram of their condition numbers.

Part "solver": ms.inv_root on the two factor stacks per configuration (TF32 on, DASH's settings: 10 Newton
steps, PIM 16 vectors x 10 steps in bf16, const 2), fixed iterations and, for CN/NDB, early exit at each --tol:
  time      CUDA events around one call of both stacks, median of --trials after 2 warm-ups
  first     the first call of the configuration in this process (host clock; pool allocations, handles)
  floor     the GEMMs the solver performs (its panel products: engine/cuda/dash.c), each timed here as plain
            batched ms.matmul calls of the same sizes and precisions, times their count; "dash floor" is DASH's
            own count of full products (NDB 56, CN 40) at the full-GEMM time
  err       the normalized root X / ||X||_F against f64 roots of 4 sample blocks (condition numbers at the
            quantiles 0.1, 0.4, 0.7, 0.95, never rank-deficient; f64 eigh on the CPU), worst of the 4:
            "err_eps" (column "err (eps)") against the root of A + eps I with the solver's own eps -- at kappa up to
            1e7 dominated by eigenvalues no f32 iterative solver resolves; "err_floor" (column "err (floor-damped)")
            against the root with matched relative damping, lambda_i -> max(lambda_i + eps, y_f s) with the
            solver's documented floor y_f (engine/cpu/dash.c, "Resolution floors") and its scale s -- how well it
            does what it documents, the measure to compare solvers at equal floors
  iters     mean iterations per block (early exit)
Part "step": recipes/dash.lua through ms.optim on the parameters (f32, random gradients of size 1e-8 so that the
factor EMA keeps the injected factors' spectra: L_t = 0.95^t L_0 + O(1e-16)), nonfinite = "apply" (no host
check), every step refreshing (inv_root_freq 1) except EVD (f = 10: refresh and non-refresh steps, amortized =
(refresh + 9 non-refresh) / 10); CUDA events around each opt:step(), median after 2 warm-ups; "first" = the first
opt:step() (state creation, allocations).  `auto` is the recipe's policy (inv_root_freq 1, its defaults).
The step part ends with the table "auto vs NDB-10 (same references)" (issue 6's auto target): every step row's
normalized root on the same samples against three shared f64 roots -- A damped by 1e-3 lambda_max (the pinned
baseline's reference), by 2.4e-3 lambda_max (NDB-10's floor for p = 4), undamped (A + eps I) -- and its solver
time = step ms - the apply-only step ms of the same configuration (an optimizer refreshing only at step 1; EVD:
refresh - non-refresh), with auto's classes per stack and GEMMs run against NDB-10's (the recipe's auto.report).
--evd-paths: EVD per block for MOONSTEP_DASH_EVD = streams (1, 4, 8, 16 streams, one host thread each; 8 streams
from one thread) and batched, on 32 + 12 blocks.
--splits: NDB-PIM's and CN f32's solver time and floor with MOONSTEP_DASH_SPLIT = 1, 2, 3, 4.
--capture: the step part's optimizers capture their steps (opt:capture(): a plan key's first step runs as is, the
next one is captured, the later ones replay the graph), so a timed step is the GPU's work without the host's
launches (the step of a trainer that captures); EVD's refresh cannot be captured (its per-block path synchronises).
--stacks: each solver's fixed-iteration time on each factor stack alone, against the call of both stacks (what a
stack would cost if it ran beside the others).
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local json = ms.json
local ffi, C = core.ffi, core.C

-- ---------------------------------------------------------------------------------------------------
-- arguments
-- ---------------------------------------------------------------------------------------------------
local A = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/args.lua")
local args = A.parse("dash_bench", { set = "subset", parts = "solver,step",
                                    tol = "1e-2,1e-3", spectrum = "controlled", trials = 5, steps = 10,
                                    device = "cuda" },
                     { evd_paths = true, splits = true, tiny = true, stacks = true, capture = true })
-- full-set EVD (about 17 s per refresh) only when asked for by name
args.solvers = args.solvers or (args.set == "full" and "ndb_pim,ndb_fro,cn_f32,cn_f16,auto" or "ndb_pim,ndb_fro,cn_f32,cn_f16,evd,auto")
local list = A.list
local function has(lst, x) for _, v in ipairs(lst) do if v == x then return true end end return false end
local SOLVERS, PARTS, TOLS = list(args.solvers), list(args.parts), {}
for _, t in ipairs(list(args.tol)) do TOLS[#TOLS + 1] = tonumber(t) end

if args.device ~= "cpu" then assert(ms.device_count("cuda") > 0, "dash_bench: no CUDA device (--device cpu --tiny for a smoke run)") end
local ctx = ms.device(args.device)
local h = tensor.handle_ctx(ctx)
local B = args.tiny and 64 or 1024
local SCALE = args.tiny and 32 or 1        -- --tiny: every dimension / 32, B = 64
local T_STEPS = args.steps

pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")
local function with_env(name, value, fn)
  if value == nil then ffi.C.unsetenv(name) else ffi.C.setenv(name, tostring(value), 1) end
  local ok, a, b = pcall(fn)
  ffi.C.unsetenv(name)
  if not ok then error(a, 0) end
  return a, b
end

print(("moonstep %s dash bench on %s  [%s]"):format(ms.version, ctx:name(), ms.build_info))
print(("set %s, B = %d, %s spectra, solvers %s, parts %s, early-exit tolerances %s"):format(args.set, B, args.spectrum,
      args.solvers, args.parts, args.tol))

-- ---------------------------------------------------------------------------------------------------
-- clocks
-- ---------------------------------------------------------------------------------------------------
local ev = ffi.new("ms_event *[2]")
core.check(C.ms_event_new(h, ev))
core.check(C.ms_event_new(h, ev + 1))
local elapsed = ffi.new("double[1]")
-- ms of one fn() between events (waits for the device)
local function timed(fn)
  core.check(C.ms_event_record(h, ev[0]))
  fn()
  core.check(C.ms_event_record(h, ev[1]))
  core.check(C.ms_event_elapsed(ev[0], ev[1], elapsed))
  return elapsed[0]
end
-- (an even count -- EVD's two refresh steps, an even --trials -- gives the mean of the middle two)
local median = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/measure.lua").median
local function time_median(fn, warm, trials)
  for _ = 1, warm do fn() end
  ctx:sync()
  local t = {}
  for j = 1, trials do t[j] = timed(fn) end
  return median(t)
end
-- host ms of fn() up to the device's end of its work (events of the CPU context: the host's monotonic clock)
local cpu_h = tensor.handle_ctx(ms.device("cpu"))
local hev = ffi.new("ms_event *[2]")
core.check(C.ms_event_new(cpu_h, hev))
core.check(C.ms_event_new(cpu_h, hev + 1))
local function wall(fn)
  ctx:sync()
  core.check(C.ms_event_record(cpu_h, hev[0]))
  fn()
  ctx:sync()
  core.check(C.ms_event_record(cpu_h, hev[1]))
  core.check(C.ms_event_elapsed(hev[0], hev[1], elapsed))
  return elapsed[0]
end

local function release()
  collectgarbage()
  collectgarbage()
  ctx:sync()
  if args.device ~= "cpu" then core.check(C.ms_ctx_empty_cache(h)) end
end

-- ---------------------------------------------------------------------------------------------------
-- the parameter set and its factor stacks
-- ---------------------------------------------------------------------------------------------------
local LAYER = { { "c_attn", 6144, 2048 }, { "attn_c_proj", 2048, 2048 }, { "w1", 5632, 2048 }, { "w2", 5632, 2048 },
                { "mlp_c_proj", 2048, 5632 } }
local params = {}
for l = 0, 15 do
  for _, p in ipairs(LAYER) do
    params[#params + 1] = { name = ("layers.%d.%s"):format(l, p[1]), shape = { math.floor(p[2] / SCALE), math.floor(p[3] / SCALE) } }
  end
end
if args.set == "subset" then
  local sub = {}
  for i = 1, 12 do sub[i] = params[i] end
  params = sub
end
local plan = ms.block_plan(params, { block_size = B })
local factor_n = {}
for _, f in ipairs(plan.factors) do factor_n[f.size] = f.n end
local sizes = {}
for _, f in ipairs(plan.factors) do sizes[#sizes + 1] = f.size end
table.sort(sizes, function(a, b) return a > b end)
io.write("factor stacks:")
for _, s in ipairs(sizes) do io.write(("  %d x %d"):format(factor_n[s], s)) end
print()

-- Q: a pool of random orthogonal matrices of size b (eigenvectors of random symmetric ones, on the device)
local function q_pool(b, count, seed)
  local G = ms.randn({ count, b, b }, { ctx = ctx, seed = seed })
  local S = G + G:transpose(1, 2)
  local _, Q = ms.eigh(S)
  return Q
end

-- "lm": the factors of a real training run -- the built-in lm problem (width 1024 or --lm-width, --lm-layers
-- hidden layers) trained with recipes/dash.lua (NDB-PIM, its defaults) for --lm-steps steps; the trained factor
-- blocks of each size, and each block's condition number from an f32 eigendecomposition (eigenvalues below
-- 1e-7 lambda_max count as zero: rank-deficient, kappa = inf)
local lm = nil
local function lm_trained()
  if lm then return lm end
  local E = require("moonstep.experiment")
  local steps = args.lm_steps or 300
  local t0 = E.clock()
  local r = E.run { problem = "lm", problem_options = { width = args.lm_width or (args.tiny and 64 or 1024),
                    layers = args.lm_layers or 8 }, recipe = "dash", recipe_options = { block_size = B },
                    steps = steps, eval_every = steps, ctx = ctx, seed = 1 }
  lm = { stacks = {}, kappa = {}, loss = r.val_loss, steps = steps,
         seconds = E.clock() - t0 }
  for _, g in ipairs(r.opt.groups) do
    if g.route == "dash" then
      for key, f in pairs(g.state.factor) do
        local b = tonumber(key:match("^(%d+)p4$"))
        if b then
          lm.stacks[b] = f:clone()
          local w = ms.eigh(f):to("cpu"):tolist_flat()   -- [m, b] ascending, f32 on the device
          local m = f:size(0)
          lm.kappa[b] = {}
          for k = 1, m do
            local top, low = w[k * b], w[(k - 1) * b + 1]
            lm.kappa[b][k] = (top > 0 and low > 1e-7 * top) and top / low or math.huge
          end
        end
      end
    end
  end
  r = nil
  release()
  return lm
end

-- factors [n, b, b] and each block's condition number (controlled) on the device
local function factors(n, b, seed)
  if args.spectrum == "lm" then
    -- the trained blocks of this size, repeated to fill the stack (the set's block counts, the run's spectra); a
    -- size the run has no blocks of takes the top-left corners of the largest ones (SPD too, kappa at most theirs)
    local t = lm_trained()
    local src = t.stacks[b] or t.stacks[B]
    local kap = t.kappa[b] or t.kappa[B]
    local m = src:size(0)
    local A, kappa = ms.empty({ n, b, b }, { ctx = ctx }), {}
    for k = 0, n - 1 do
      A:select(0, k):copy_(src:select(0, k % m):narrow(0, 0, b):narrow(1, 0, b))
      kappa[k + 1] = kap[k % m + 1]
    end
    return A, kappa
  end
  if args.spectrum == "random" then
    local A = ms.zeros({ n, b, b }, { ctx = ctx })
    for s = 1, 4 do
      local X = ms.randn({ n, b, b }, { ctx = ctx, seed = seed + s })
      A:lerp_(ms.matmul(X, X, { trans_b = true, tf32 = true }), 0.05)
    end
    return A, nil
  end
  local nq = math.min(n, 32)
  local Q = q_pool(b, nq, seed)
  local u = ms.rand({ n }, { seed = seed + 1 }):tolist_flat()
  local kappa, lam = {}, {}
  for k = 1, n do
    kappa[k] = 10 ^ (1 + 6 * u[k])
    lam[k] = {}
    for i = 1, b do
      local t = (i - 1) / math.max(b - 1, 1)
      lam[k][i] = ((k - 1) % 10 == 0 and i > b / 2) and 0 or kappa[k] ^ (-t)
    end
  end
  local L = ms.tensor(lam, { ctx = ctx })                    -- [n, b]
  local A = ms.empty({ n, b, b }, { ctx = ctx })
  local chunk = 16
  for k0 = 0, n - 1, chunk do
    local c = math.min(chunk, n - k0)
    local Qs = ms.empty({ c, b, b }, { ctx = ctx })
    for j = 0, c - 1 do Qs:select(0, j):copy_(Q:select(0, (k0 + j) % nq)) end
    local QL = Qs * L:narrow(0, k0, c):view({ c, 1, b })
    ms.matmul(QL, Qs, { trans_b = true, out = A:narrow(0, k0, c) })
  end
  for k = 1, n do if (k - 1) % 10 == 0 then kappa[k] = math.huge end end
  return A, kappa
end

local stacks, kappas = {}, {}
for i, s in ipairs(sizes) do stacks[s], kappas[s] = factors(factor_n[s], s, 9000 + 100 * i) end
ctx:sync()
if lm then
  -- the trained blocks' condition numbers by decade (issue 6: auto on a real run's factors, with its histogram)
  print(("lm factors: problem lm, %d steps with recipes/dash.lua (%.1f s), validation loss %s"):format(lm.steps,
        lm.seconds, lm.loss and ("%.4f"):format(lm.loss) or "-"))
  for b, kap in pairs(lm.kappa) do
    local bins, order = {}, {}
    for _, k in ipairs(kap) do
      local d = k == math.huge and "inf (rank-deficient)" or ("1e%d-1e%d"):format(math.floor(math.log10(k)), math.floor(math.log10(k)) + 1)
      if not bins[d] then bins[d] = 0 order[#order + 1] = d end
      bins[d] = bins[d] + 1
    end
    table.sort(order)
    io.write(("  %d blocks of %d, condition numbers:"):format(#kap, b))
    for _, d in ipairs(order) do io.write(("  %s: %d"):format(d, bins[d])) end
    print()
  end
end

-- f64 references on the CPU: 4 sample blocks of the largest stack (eigendecomposition kept; the references of
-- each solver are made from it on demand)
local samples = {}
do
  local s = sizes[1]
  local order = {}
  for k = 1, factor_n[s] do
    if not kappas[s] or kappas[s][k] ~= math.huge then order[#order + 1] = k end
  end
  if kappas[s] then table.sort(order, function(a, b) return kappas[s][a] < kappas[s][b] end) end
  for _, q in ipairs { 0.1, 0.4, 0.7, 0.95 } do
    local k = order[math.max(1, math.min(#order, math.floor(q * #order + 0.5)))] - 1
    local A = stacks[s]:select(0, k):to("cpu"):to("f64")
    local w, V = ms.eigh(A)
    local wl = w:tolist_flat()
    samples[#samples + 1] = { k = k, kappa = kappas[s] and kappas[s][k + 1] or wl[#wl] / wl[1], wl = wl, V = V,
                              fro = A:norm(), refs = {} }
  end
end
io.write("accuracy samples (block: kappa):")
for _, smp in ipairs(samples) do io.write((" %d: %.2g"):format(smp.k, smp.kappa)) end
print()

-- Each solver's documented resolution floor for p = 4 (engine/cpu/dash.c, "Resolution floors": the normalized
-- eigenvalue y = lambda / s below which it under-inverts by design; 10 Newton steps, degree 60), and its scale s:
-- Frobenius ||A + eps I||_F, PIM pi_const (2) times lambda_max; EVD has no scale (s = lambda_max).  `auto`
-- mixes solvers and is held to the smallest floor (EVD's).
local FLOOR = { ndb = 2.4e-3, cn = 4.9e-4, chebyshev = 5.6e-3, evd = 6.5e-5 }

-- the normalized f64 root of a sample: eigenvalues l + eps (a pseudo-inverse where that is <= 0), raised to at
-- least `lfloor` when it is given
local function sample_root(smp, eps, lfloor, p)
  local key = ("%.17g/%.17g/%d"):format(eps, lfloor or -1, p)
  if smp.refs[key] then return smp.refs[key] end
  local inv = {}
  for j = 1, #smp.wl do
    local l = smp.wl[j] + eps
    if lfloor then l = math.max(l, lfloor) end
    inv[j] = l > 0 and l ^ (-1 / p) or 0
  end
  local R = ms.matmul(smp.V * ms.tensor(inv, { dtype = "f64" }), smp.V, { trans_b = true })
  smp.refs[key] = R / R:norm()
  return smp.refs[key]
end

-- The solver's own scalar map in f64 (what it computes, by design, for an eigenvalue y = lambda / s; fixed
-- iterations): NDB's chains (moonstep.h), CN's coupled iteration; nil for the others.
local function ndb_chain_scalar(y, T, want_y)
  local Y, E = y, 1.5 - 0.5 * y
  local Z = E
  Y = Y * E
  for _ = 2, T do
    E = 1.5 - 0.5 * Z * Y
    Y, Z = Y * E, E * Z
  end
  return want_y and Y or Z
end
local function scalar_map(method, y, T, p)
  if method == "ndb" then
    if p == 2 then return ndb_chain_scalar(y, T, false) end
    return ndb_chain_scalar(ndb_chain_scalar(y, T, true), T, false)
  elseif method == "cn" then
    local M, X = (p + 1) / 2 * y, ((p + 1) / 2) ^ (1 / p)
    for _ = 1, T do
      local N = ((p + 1) - M) / p
      X, M = X * N, N ^ p * M
    end
    return X
  end
end

-- the normalized root of a sample through the solver's scalar map
local function sample_mapped(smp, method, eps, scale, T, p)
  local key = ("map/%s/%.17g/%.17g/%d/%d"):format(method, eps, scale, T, p)
  if smp.refs[key] then return smp.refs[key] end
  local f = {}
  for j = 1, #smp.wl do f[j] = scalar_map(method, math.max(smp.wl[j] + eps, 0) / scale, T, p) end
  local R = ms.matmul(smp.V * ms.tensor(f, { dtype = "f64" }), smp.V, { trans_b = true })
  smp.refs[key] = R / R:norm()
  return smp.refs[key]
end

-- Accuracy of the normalized roots X / ||X||_F of stack x (the largest size) on the samples, worst of the 4:
--   err_eps    against the f64 root of A + eps I with the solver's own eps (0 for the iterative solvers, 1e-10 EVD):
--              what the solver is asked for; at kappa up to 1e7 in f32 it is dominated by eigenvalues below every
--              iterative solver's floor (and below f32's resolution), so it mostly measures the floor
--   err_floor  against the f64 root with matched relative damping: every eigenvalue raised to at least the
--              solver's floor y_f times its scale s (lambda_i -> max(lambda_i + eps, y_f s)): how well the solver
--              does what it documents, the measure to compare solvers (and DASH's) at equal floors; a hard clamp,
--              so it overstates the error of solvers that partly resolve eigenvalues below their floor (and EVD's,
--              whose sub-floor eigenvalues are f32 noise)
--   err_map    (NDB, CN with fixed iterations) against the solver's own scalar map in f64 applied to each
--              eigenvalue y = lambda / s: the implementation's error (rounding, TF32, 16-bit) alone
local function accuracy(x, cfg, fixed)
  local method = cfg and cfg.method or "evd"
  local eps = cfg and cfg.eps or 0
  local ef, e0, em = 0, 0, nil
  for _, smp in ipairs(samples) do
    local X = x:select(0, smp.k):to("cpu"):to("f64")
    local n = X:norm()
    if not (n > 0 and n < math.huge) then return 0 / 0, 0 / 0 end
    X = X / n
    local lmax = smp.wl[#smp.wl]
    -- ||A + eps I||_F ~ ||A||_F: the iterative configurations here run with eps = 0
    local scale = method == "evd" and lmax or (cfg.scaling == "pim" or cfg.scaling == "pi") and 2 * lmax or smp.fro
    ef = math.max(ef, (X - sample_root(smp, eps, FLOOR[method] * scale, 4)):norm())
    e0 = math.max(e0, (X - sample_root(smp, eps, nil, 4)):norm())
    if fixed and cfg and (method == "ndb" or method == "cn") then
      em = math.max(em or 0, (X - sample_mapped(smp, method, eps, scale, cfg.steps or T_STEPS, 4)):norm())
    end
  end
  return ef, e0, em
end

-- ---------------------------------------------------------------------------------------------------
-- solver configurations and their products
-- ---------------------------------------------------------------------------------------------------
local CONFIG = {
  ndb_pim = { method = "ndb", scaling = "pim", dash = 56, label = "NDB-PIM" },
  ndb_fro = { method = "ndb", scaling = "fro", dash = 56, label = "NDB-Fro" },
  ndb_pim_f16 = { method = "ndb", scaling = "pim", matmul_dtype = "f16", dash = 56, label = "NDB-PIM f16" },
  ndb_fro_f16 = { method = "ndb", scaling = "fro", matmul_dtype = "f16", dash = 56, label = "NDB-Fro f16" },
  cn_f32 = { method = "cn", scaling = "fro", dash = 40, label = "CN-Fro f32" },
  cn_f16 = { method = "cn", scaling = "fro", matmul_dtype = "f16", dash = 40, label = "CN-Fro f16" },
  evd = { method = "evd", eps = 1e-10, label = "EVD" },
  cheb = { method = "chebyshev", scaling = "fro", steps = 60, label = "Chebyshev-60" },
}

local function root_opts(cfg, extra)
  local o = { method = cfg.method, root = 4, steps = cfg.steps or T_STEPS, eps = cfg.eps or 0, scaling = cfg.scaling or "fro",
              pi_steps = 10, pi_vectors = 16, pi_const = 2, eps_power_iter = 1e-6, pi_bf16 = true,
              matmul_dtype = cfg.matmul_dtype or "f32", tf32 = true, evd_shift = true, seed = 1 }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

-- panels of the symmetric products (engine/cuda/dash.c, choose_split)
local function panels(n)
  local split = tonumber(os.getenv("MOONSTEP_DASH_SPLIT") or "1") or 1
  if split < 1 or split > 4 then split = 1 end   -- engine/cuda/dash.c: plain products unless 2..4 panels
  local cut = { 0 }
  if split >= 2 and n >= 64 * split then
    for j = 1, split - 1 do
      local c = math.floor(math.floor(j * n / split) / 32) * 32
      if c <= cut[#cut] then cut = { 0 } break end
      cut[#cut + 1] = c
    end
  end
  if #cut == 1 then return { { 0, n } } end
  cut[#cut + 1] = n
  local p = {}
  for j = 1, #cut - 1 do p[j] = { cut[j], cut[j + 1] } end
  return p
end

-- one symmetric product on a stack of n-blocks as plain matmuls of its panels: in (f32 TF32 or 16-bit), out dtype
local function product_fn(size, in_dt, out_dt, full)
  local n = factor_n[size]
  local A = ms.randn({ n, size, size }, { ctx = ctx, seed = 77, dtype = in_dt })
  local Bm = ms.randn({ n, size, size }, { ctx = ctx, seed = 78, dtype = in_dt })
  local Cm = ms.empty({ n, size, size }, { ctx = ctx, dtype = out_dt })
  local ps = full and { { 0, size } } or panels(size)
  local fn = function()
    for _, pn in ipairs(ps) do
      local c0, c1 = pn[1], pn[2]
      if full or #ps == 1 then
        ms.matmul(A, Bm, { out = Cm, tf32 = true })
      else
        ms.matmul(A:narrow(1, c0, size - c0), Bm:narrow(2, c0, c1 - c0),
                  { out = Cm:narrow(1, c0, size - c0):narrow(2, c0, c1 - c0), tf32 = true })
      end
    end
  end
  return fn
end
local product_ms_cache = {}
local function product_ms(size, in_dt, out_dt, full)
  local key = ("%d:%s:%s:%s:%s"):format(size, in_dt, out_dt, tostring(full), os.getenv("MOONSTEP_DASH_SPLIT") or "")
  if product_ms_cache[key] then return product_ms_cache[key] end
  local t = time_median(product_fn(size, in_dt, out_dt, full), 2, 7)
  product_ms_cache[key] = t
  return t
end

-- The GEMM floor of a configuration on every stack: the products it performs, timed as one back-to-back sequence
-- of plain batched GEMMs (median of 3 after a warm-up).  A sequence, not count x one product: a lone 1.4 ms GEMM
-- runs at boost clocks that ~80 ms of sustained TF32 work does not keep (the previous per-product floor of the
-- same NDB GEMMs read 74.7 ms early in a run and 85.0 ms later in it).  DASH's floor: its product count x one
-- full GEMM, as before.
local floor_cache = {}
local function floor_ms(cfg)
  local T, dash_total = cfg.steps or T_STEPS, 0
  local key = ("%s:%s:%d:%s"):format(cfg.method, cfg.matmul_dtype or "f32", T, os.getenv("MOONSTEP_DASH_SPLIT") or "")
  local seq = {}   -- { fn, count }
  for _, s in ipairs(sizes) do
    local f32 = product_fn(s, "f32", "f32", false)
    if cfg.method == "ndb" then
      seq[#seq + 1] = { f32, 2 * (3 * T - 3) }
    elseif cfg.method == "cn" then
      if cfg.matmul_dtype == "f16" then
        seq[#seq + 1] = { f32, T - 1 }
        seq[#seq + 1] = { product_fn(s, "f16", "f16", false), 2 * (T - 1) }
        seq[#seq + 1] = { product_fn(s, "f16", "f32", false), T - 1 }
      else
        seq[#seq + 1] = { f32, 4 * (T - 1) }
      end
    elseif cfg.method == "chebyshev" then
      seq[#seq + 1] = { f32, (cfg.steps or 60) - 1 }
    else
      seq[#seq + 1] = { f32, 1 }
    end
    if cfg.dash then dash_total = dash_total + cfg.dash * product_ms(s, "f32", "f32", true) end
  end
  if not floor_cache[key] then
    floor_cache[key] = time_median(function()
      for _, e in ipairs(seq) do for _ = 1, e[2] do e[1]() end end
    end, 1, 3)
  end
  seq = nil
  collectgarbage()
  return floor_cache[key], cfg.dash and dash_total or nil
end

-- ---------------------------------------------------------------------------------------------------
-- part "solver"
-- ---------------------------------------------------------------------------------------------------
local rows = {}
local function fmt(x, f) return x == nil and "-" or (x ~= x and "nan" or (f or "%.1f"):format(x)) end

local roots = {}
for _, s in ipairs(sizes) do roots[s] = ms.empty({ factor_n[s], s, s }, { ctx = ctx }) end

-- The own-map error with TF32 off, on the 4 sample blocks alone (a [4, b, b] stack; PIM's start vectors differ
-- from the full call's, its scale by ~1e-3): separates the implementation from TF32.  NDB's root 4 chains a square
-- root whose TF32 rounding (2^-11 of the largest eigenvalue) swamps the eigenvalues below ~1e-3 y_max into the
-- second chain's inverse root, which amplifies that noise: on kappa >= 1e5 blocks the TF32 root is far from the
-- f64 map (a numpy TF32 emulation of the same chains: 0.4-1.0, as measured here) while the f32 one is within 1e-4.
local sample_stack
local function own_map_f32(cfg, o)
  if not (cfg.method == "ndb" or cfg.method == "cn") then return nil end
  if not sample_stack then
    sample_stack = ms.empty({ #samples, sizes[1], sizes[1] }, { ctx = ctx })
    for i, smp in ipairs(samples) do sample_stack:select(0, i - 1):copy_(stacks[sizes[1]]:select(0, smp.k)) end
  end
  local of = {}
  for k, v in pairs(o) do of[k] = v end
  of.tf32, of.tolerance = false, 0
  local X = ms.inv_root(sample_stack, of)
  local em = 0
  for i, smp in ipairs(samples) do
    local x = X:select(0, i - 1):to("cpu"):to("f64")
    local n = x:norm()
    if not (n > 0 and n < math.huge) then return 0 / 0 end
    local scale = (cfg.scaling == "pim" or cfg.scaling == "pi") and 2 * smp.wl[#smp.wl] or smp.fro
    em = math.max(em, (x / n - sample_mapped(smp, cfg.method, cfg.eps or 0, scale, cfg.steps or T_STEPS, 4)):norm())
  end
  return em
end
-- ms.inv_root on the stack of size s into its roots (iteration counts back with want_iters)
local function solve_stack(opts, s, want_iters)
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.out = roots[s]
  if want_iters then o.iters = true end
  local _, _, it = ms.inv_root(stacks[s], o)
  return it
end

local function solve(opts, want_iters)
  local its = {}
  for _, s in ipairs(sizes) do its[s] = solve_stack(opts, s, want_iters) end
  return its
end

if has(PARTS, "solver") then
  print(("\none batched f32 (TF32) GEMM of the %d-stack: %.3f ms; one symmetric product (panels): %.3f ms"):format(
        sizes[1], product_ms(sizes[1], "f32", "f32", true), product_ms(sizes[1], "f32", "f32", false)))
  for _, name in ipairs(SOLVERS) do
    local cfg = CONFIG[name]
    if cfg then
      local modes = { { tol = 0 } }
      if cfg.method == "ndb" or cfg.method == "cn" then for _, t in ipairs(TOLS) do modes[#modes + 1] = { tol = t } end end
      for _, m in ipairs(modes) do
        local o = root_opts(cfg, { tolerance = m.tol })
        local first = wall(function() solve(o) end)
        local t = time_median(function() solve(o) end, 1, cfg.method == "evd" and math.min(args.trials, 3) or args.trials)
        local its = solve(o, m.tol > 0)
        local e1, e0, em = accuracy(roots[sizes[1]], cfg, m.tol == 0)
        local em32 = m.tol == 0 and own_map_f32(cfg, o) or nil
        local mean_it
        if m.tol > 0 then
          local sum, cnt = 0, 0
          for _, s in ipairs(sizes) do for _, v in ipairs(its[s]:tolist_flat()) do sum, cnt = sum + v, cnt + 1 end end
          mean_it = sum / cnt
        end
        local fl, dfl = floor_ms(cfg)
        local row = { part = "solver", solver = cfg.label, mode = m.tol > 0 and ("early %g"):format(m.tol) or "fixed",
                      ms = t, first_ms = first, floor_ms = fl, ratio = t / fl, dash_floor_ms = dfl, err = e1, err0 = e0, err_map = em,
                      err_map_f32 = em32, iters = mean_it }
        rows[#rows + 1] = row
        print(("  %-13s %-11s %9.2f ms  first %9.1f  floor %8.2f (x%.2f)  dash floor %s  err_floor %.2e  err_eps %.2e  err_map %s  err_map f32 %s  iters %s"):format(
              row.solver, row.mode, t, first, fl, row.ratio, fmt(dfl), e1, e0, fmt(em, "%.1e"), fmt(em32, "%.1e"), fmt(mean_it, "%.2f")))
      end
      release()
    end
  end
end

-- ---------------------------------------------------------------------------------------------------
-- part "step": the recipe on the parameters, the controlled factors injected
-- ---------------------------------------------------------------------------------------------------
-- The shared references of the step part (issue 6's "auto ... at equal or better update error against the f64
-- reference"): err (floor-damped) holds each row to its own floor (auto to EVD's), so it cannot compare auto with
-- NDB-10.  These hold every row to the same three f64 roots of each sample: A damped by 1e-3 lambda_max (the
-- pinned baseline's reference, bench/torch_baselines/dash.py: lambda_i -> max(lambda_i, 0) + d lambda_max),
-- by 2.4e-3 lambda_max (NDB-10's documented floor for p = 4), and undamped (A + eps I, the row's eps).
local SHARED_DAMPING = { 1e-3, 2.4e-3 }
local function sample_root_damped(smp, rel, p)
  local key = ("damp/%.17g/%d"):format(rel, p)
  if smp.refs[key] then return smp.refs[key] end
  local d = rel * smp.wl[#smp.wl]
  local inv = {}
  for j = 1, #smp.wl do inv[j] = (math.max(smp.wl[j], 0) + d) ^ (-1 / p) end
  local R = ms.matmul(smp.V * ms.tensor(inv, { dtype = "f64" }), smp.V, { trans_b = true })
  smp.refs[key] = R / R:norm()
  return smp.refs[key]
end
-- worst over the samples of || X / ||X||_F - R / ||R||_F ||_F for each shared reference: { d1, d2, undamped }
local function shared_errors(x, eps)
  local e = { 0, 0, 0 }
  for _, smp in ipairs(samples) do
    local X = x:select(0, smp.k):to("cpu"):to("f64")
    local n = X:norm()
    if not (n > 0 and n < math.huge) then return { 0 / 0, 0 / 0, 0 / 0 } end
    X = X / n
    for i, rel in ipairs(SHARED_DAMPING) do e[i] = math.max(e[i], (X - sample_root_damped(smp, rel, 4)):norm()) end
    e[3] = math.max(e[3], (X - sample_root(smp, eps, nil, 4)):norm())
  end
  return e
end

-- the recipe's options for a solver configuration (`auto`: the recipe's policy with its defaults)
local function step_options(name)
  local cfg = CONFIG[name]
  local opts = {
    lr = 1e-3, weight_decay = 0, beta_G = 0.9, beta_LR = 0.95, beta_graft = 0.95, eps_grafting = 1e-8,
    start_prec_step = -1, block_size = B, newton_steps = T_STEPS, matrix_scaling_pi_steps = 10,
    matrix_scaling_const = 2, matrix_scaling_pi_vectors = 16, eps_power_iter = 1e-6, pi_bf16 = true,
    allow_tf32 = true, cn_tolerance = 0, ndb_tolerance = 0, evd_heuristic = "shampoo", mu = 0,
    use_bias_correction = true, algo_one_dim = "adamw", inv_root_freq = 1,
  }
  if name == "auto" then
    opts.inv_root_method = "auto"
    opts.eps_inv_root = 0
    opts.matrix_scaling_type = "pim"
  else
    opts.inv_root_method = cfg.method
    opts.eps_inv_root = cfg.eps or 0
    opts.matrix_scaling_type = cfg.scaling or "fro"
    opts.matmul_dtype = cfg.matmul_dtype or "f32"
    if cfg.method == "evd" then opts.inv_root_freq = 10 end
    if cfg.method == "chebyshev" then opts.cbshv_degree = cfg.steps end
  end
  return opts
end

-- an optimizer of the configuration on fresh parameters, the controlled factors injected
local function step_optimizer(opts)
  local ps = {}
  for i, p in ipairs(params) do
    ps[i] = { name = p.name, param = ms.randn(p.shape, { ctx = ctx, seed = 100 + i, std = 0.02 }),
              grad = ms.randn(p.shape, { ctx = ctx, seed = 200 + i, std = 1e-8 }) }
  end
  local opt = ms.optim.new("dash", ps, opts, { nonfinite = "apply", ctx = ctx })
  if args.capture then opt:capture() end
  local group = opt.groups[1]
  for _, g in ipairs(opt.groups) do if g.route == "dash" then group = g break end end
  for _, s in ipairs(sizes) do group.state.factor[("%dp4"):format(s)]:copy_(stacks[s]) end
  return opt, ps, group
end

-- the apply-only (non-refresh) step of the same configuration: the roots refreshed at step 1 and never again;
-- CUDA events, median of the steps after 2 warm-ups
local function apply_only_ms(opts)
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.inv_root_freq = 1000000000
  local opt = step_optimizer(o)
  opt:step()
  local times = {}
  local n = math.max(args.trials + 2, 4)
  for t = 2, n do times[t] = timed(function() opt:step() end) end
  local tail = {}
  for t = 3, n do tail[#tail + 1] = times[t] end
  opt = nil
  release()
  return median(tail)
end

local function step_run(name)
  local cfg = CONFIG[name]
  local opts = step_options(name)
  local opt, ps, group = step_optimizer(opts)
  local st = group.state
  local first = wall(function() opt:step() end)
  local times = {}
  local n = cfg and cfg.method == "evd" and 21 or math.max(args.trials + 2, 4)
  for t = 2, n do times[t] = timed(function() opt:step() end) end
  local root = st.root[("%dp4"):format(sizes[1])]
  local e1, e0, em = accuracy(root, cfg, true)
  local row = { part = "step", solver = cfg and cfg.label or "auto", name = name, first_ms = first, err = e1, err0 = e0, err_map = em }
  local shared = shared_errors(root, opts.eps_inv_root)
  row.err_d1e3, row.err_d24e3, row.err_undamped = shared[1], shared[2], shared[3]
  if cfg and cfg.method == "evd" then
    local refresh, other = {}, {}
    for t = 4, n do
      if t % 10 == 0 then refresh[#refresh + 1] = times[t] else other[#other + 1] = times[t] end
    end
    row.refresh_ms, row.apply_ms = median(refresh), median(other)
    row.ms = (row.refresh_ms + 9 * row.apply_ms) / 10
    row.mode = "f=10 amortized"
  else
    local tail = {}
    for t = 3, n do tail[#tail + 1] = times[t] end
    row.ms = median(tail)
    row.mode = "f=1"
  end
  -- the GEMMs of the refresh: auto's report (run: from each block's iterations; NDB-10's for the same blocks),
  -- the fixed-step iterative rows their count
  local rauto = opt.recipe.auto
  row.ndb10_gemms = 0
  for _, s in ipairs(sizes) do row.ndb10_gemms = row.ndb10_gemms + factor_n[s] * rauto.gemms("ndb", 10, 4) end
  if name == "auto" then
    row.classes = opt.last and opt.last.reports and opt.last.reports["dash.auto_classes"] or nil
    local rep = rauto.report(group)
    if rep then
      row.gemms, row.gemms_planned, row.ndb10_gemms = rep.gemms_run, rep.gemms, rep.ndb10_gemms
      row.damped_blocks, row.evd_blocks = rep.damped_blocks, rep.evd_blocks
      row.auto_stacks = {}
      for i, s in ipairs(rep.stacks) do
        row.auto_stacks[i] = { key = s.key, blocks = s.blocks, summary = s.summary, gemms = s.gemms, gemms_run = s.gemms_run,
                               ndb10_gemms = s.ndb10_gemms }
      end
    end
  elseif cfg and (cfg.method == "ndb" or cfg.method == "cn" or cfg.method == "chebyshev") then
    row.gemms = 0
    for _, s in ipairs(sizes) do row.gemms = row.gemms + factor_n[s] * rauto.gemms(cfg.method, cfg.steps or T_STEPS, 4) end
  end
  rows[#rows + 1] = row
  print(("  %-13s %-15s %9.2f ms  first %9.1f%s  err_floor %.2e  err_eps %.2e  err_map %s%s"):format(row.solver, row.mode, row.ms, first,
        row.refresh_ms and ("  refresh %.1f  non-refresh %.2f"):format(row.refresh_ms, row.apply_ms) or "", e1, e0, fmt(em, "%.1e"),
        row.classes and ("  classes: " .. tostring(row.classes)) or ""))
  opt, ps, st, group, root = nil, nil, nil, nil, nil
  release()
  -- the solver's time: the refresh step less the apply-only step of the same configuration
  if cfg and cfg.method == "evd" then
    row.apply_only_ms, row.solver_ms = row.apply_ms, row.refresh_ms - row.apply_ms
  else
    local ok, t = pcall(apply_only_ms, opts)
    if ok then
      row.apply_only_ms, row.solver_ms = t, row.ms - t
    else
      row.apply_error = tostring(t)
      print(("  %-13s apply-only step failed: %s"):format(row.solver, row.apply_error))
      release()
    end
  end
end

if has(PARTS, "step") then
  print(("\nthe optimizer step (recipes/dash.lua, %s factors injected):"):format(args.spectrum))
  for _, name in ipairs(SOLVERS) do
    if CONFIG[name] or name == "auto" then
      local ok, err = pcall(step_run, name)
      if not ok then
        print(("  %-13s failed: %s"):format(name, tostring(err)))
        rows[#rows + 1] = { part = "step", solver = name, error = tostring(err) }
        release()
      end
    end
  end
end

-- ---------------------------------------------------------------------------------------------------
-- --evd-paths, --splits
-- ---------------------------------------------------------------------------------------------------
if args.evd_paths then
  print("\nEVD per block (32 blocks of the largest size, 12 of the next):")
  for _, path in ipairs { { "streams", 1 }, { "streams", 4 }, { "streams", 8 }, { "streams", 16 }, { "streams", 8, 0 },
                          { "batched", 0 } } do
    ffi.C.setenv("MOONSTEP_DASH_EVD", path[1], 1)
    if path[2] > 0 then ffi.C.setenv("MOONSTEP_DASH_EVD_STREAMS", tostring(path[2]), 1) end
    if path[3] then ffi.C.setenv("MOONSTEP_DASH_EVD_THREADS", tostring(path[3]), 1) end
    -- a context makes its eigensolver streams once: a fresh one per stream count
    local c = ms.context { device = args.device }
    for i, s in ipairs(sizes) do
      local a = stacks[s]:narrow(0, 0, math.min(i == 1 and 32 or 12, factor_n[s])):to(c)
      ms.inv_root(a, { method = "evd", eps = 1e-10 })
      c:sync()
      local t = wall(function() ms.inv_root(a, { method = "evd", eps = 1e-10 }) c:sync() end)
      print(("  %-8s %2s streams%s  b = %4d: %8.2f ms per block"):format(path[1], path[2] > 0 and tostring(path[2]) or "-",
            path[3] and ", one host thread" or "", s, t / a:size(0)))
      rows[#rows + 1] = { part = "evd_path", path = path[1], streams = path[2], threads = path[3] ~= 0, b = s,
                          ms_per_block = t / a:size(0) }
    end
    ffi.C.unsetenv("MOONSTEP_DASH_EVD")
    ffi.C.unsetenv("MOONSTEP_DASH_EVD_STREAMS")
    ffi.C.unsetenv("MOONSTEP_DASH_EVD_THREADS")
    c = nil
    collectgarbage()
    collectgarbage()
  end
end

if args.splits then
  print("\nNDB-PIM and CN f32 with the products on panels or plain (MOONSTEP_DASH_SPLIT):")
  for _, name in ipairs { "ndb_pim", "cn_f32" } do
    for _, split in ipairs { 1, 2, 3, 4 } do
      with_env("MOONSTEP_DASH_SPLIT", split, function()
        local o = root_opts(CONFIG[name])
        local t = time_median(function() solve(o) end, 1, args.trials)
        local fl = floor_ms(CONFIG[name])
        print(("  %s split %d: %8.2f ms  floor %8.2f (x%.2f)"):format(name, split, t, fl, t / fl))
        rows[#rows + 1] = { part = "split", solver = name, split = split, ms = t, floor_ms = fl }
      end)
    end
  end
end

if args.stacks then
  print("\nper stack, fixed iterations (ms.inv_root on one stack; both: the two calls back to back):")
  for _, name in ipairs(SOLVERS) do
    local cfg = CONFIG[name]
    if cfg and cfg.method ~= "evd" then
      local o = root_opts(cfg)
      local both = time_median(function() solve(o) end, 1, args.trials)
      local parts = {}
      for _, s in ipairs(sizes) do
        local t = time_median(function() solve_stack(o, s) end, 1, args.trials)
        parts[#parts + 1] = ("%d x %d: %.3f ms"):format(factor_n[s], s, t)
        rows[#rows + 1] = { part = "stack", solver = cfg.label, b = s, blocks = factor_n[s], ms = t, both_ms = both }
      end
      print(("  %-13s both %8.3f ms   %s"):format(cfg.label, both, table.concat(parts, "   ")))
      release()
    end
  end
end

-- ---------------------------------------------------------------------------------------------------
-- the table
-- ---------------------------------------------------------------------------------------------------
local sets = { subset = "228 x 1024 + 12 x 512", full = "1568 x 1024 + 96 x 512" }
print(("\n| set | part | solver | mode | ms | first ms | floor ms | ms / floor | DASH floor ms | err (floor-damped) | err (eps) | err (own map) | err (own map, TF32 off) | iters |"))
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for _, r in ipairs(rows) do
  if r.part == "solver" or r.part == "step" then
    print(("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"):format(
          args.tiny and "tiny" or (sets[args.set] or args.set), r.part, r.solver, r.mode or "-", fmt(r.ms, "%.2f"),
          fmt(r.first_ms), fmt(r.floor_ms, "%.2f"), fmt(r.ratio, "%.2f"), fmt(r.dash_floor_ms), fmt(r.err, "%.1e"),
          fmt(r.err0, "%.1e"), fmt(r.err_map, "%.1e"), fmt(r.err_map_f32, "%.1e"), fmt(r.iters, "%.2f")))
  end
end
-- auto against NDB-10: the same three references for every row, the solver's time as step less apply-only step
do
  local step_rows, by_name = {}, {}
  for _, r in ipairs(rows) do
    if r.part == "step" and not r.error then step_rows[#step_rows + 1] = r by_name[r.name] = r end
  end
  if #step_rows > 0 then
    local base = by_name.ndb_pim or by_name.ndb_fro
    print(("\nauto vs NDB-10 (same references): normalized-root error, worst of the %d samples, against the f64 root of A"
           .. " damped by d x lambda_max (lambda -> max(lambda, 0) + d lambda_max) and undamped (A + eps I); solver ms ="
           .. " step ms - apply-only step ms (EVD: refresh - non-refresh, per refresh)%s"):format(#samples,
           base and ("; ratios against " .. base.solver) or ""))
    print("| solver | step ms | apply-only ms | solver ms | solver / NDB-10 | GEMMs | GEMMs / NDB-10 | err (d = 1e-3) | err (d = 2.4e-3) | err (undamped) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for _, r in ipairs(step_rows) do
      local tr = base and base.solver_ms and r.solver_ms and r.solver_ms / base.solver_ms or nil
      local gr = r.gemms and r.ndb10_gemms and r.ndb10_gemms > 0 and r.gemms / r.ndb10_gemms or nil
      r.solver_ratio, r.gemms_ratio = tr, gr
      print(("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"):format(r.solver, fmt(r.ms, "%.2f"), fmt(r.apply_only_ms, "%.2f"),
            fmt(r.solver_ms, "%.2f"), fmt(tr, "%.2f"), fmt(r.gemms, "%d"), fmt(gr, "%.2f"), fmt(r.err_d1e3, "%.2e"),
            fmt(r.err_d24e3, "%.2e"), fmt(r.err_undamped, "%.2e")))
    end
    local a = by_name.auto
    if a and a.auto_stacks then
      print(("auto's classes at the last refresh (%d damped blocks, %d EVD):"):format(a.damped_blocks or 0, a.evd_blocks or 0))
      for _, s in ipairs(a.auto_stacks) do
        print(("  %-7s %4d blocks: %s  GEMMs run %d (planned %d) vs NDB-10 %d (x%.2f)"):format(s.key, s.blocks, s.summary,
              s.gemms_run, s.gemms, s.ndb10_gemms, s.ndb10_gemms > 0 and s.gemms_run / s.ndb10_gemms or 0 / 0))
      end
    end
    if a then
      for _, key in ipairs { "ndb_pim", "ndb_fro" } do
        local b = by_name[key]
        if b and a.solver_ms and b.solver_ms then
          local ratio = a.solver_ms / b.solver_ms
          local verdict = {}
          for i, f in ipairs { "err_d1e3", "err_d24e3", "err_undamped" } do
            verdict[i] = (a[f] <= b[f]) and "<=" or ">"
          end
          print(("  auto / %s: solver %.2f / %.2f ms = %.2f (target <= 0.70: %s); GEMMs %s / %s = %s; err auto %s %s"
                 .. " at d = 1e-3 (%.2e vs %.2e), %s at d = 2.4e-3 (%.2e vs %.2e), %s undamped (%.2e vs %.2e)"):format(
                b.solver, a.solver_ms, b.solver_ms, ratio, ratio <= 0.70 and "met" or "missed", fmt(a.gemms, "%d"),
                fmt(b.gemms, "%d"), fmt(a.gemms and b.gemms and a.gemms / b.gemms, "%.2f"), verdict[1], b.solver,
                a.err_d1e3, b.err_d1e3, verdict[2], a.err_d24e3, b.err_d24e3, verdict[3], a.err_undamped, b.err_undamped))
        end
      end
    end
  end
end
if args.json then
  local f = assert(io.open(args.json, "w"))
  f:write(json.encode({ device = ctx:name(), set = args.set, spectrum = args.spectrum, B = B, rows = rows }))
  f:close()
end
for _, e in ipairs { ev[0], ev[1], hev[0], hev[1] } do C.ms_event_free(e) end
