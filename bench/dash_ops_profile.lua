--[[
bench/dash_ops_profile.lua -- where a DASH step's GPU time goes, primitive by primitive: CUDA events around every
call recipes/dash.lua makes (ms.matmul, blocks_gather, dash_graft, inv_root, blocks_apply and the tensor
arithmetic), summed over 5 steps after 3 warm-up steps, on the benchmark's subset (the first 12 parameters of
DASH's Llama-953M, B = 1024, random gradients), CN with Frobenius scaling.

  build/moonstep bench/dash_ops_profile.lua [refresh]     -- apply-only steps (default), or refreshing every step
  build/moonstep bench/dash_ops_profile.lua products      -- also the step's products alone, each way they can run
  DEV=cpu build/moonstep bench/dash_ops_profile.lua       -- the same on the CPU (slow)

The events themselves add a little to the step; the rows are for finding what to work on, the step time of
record is bench/dash_bench.lua's.  (nsys is not on the GPU host.)
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C
local ctx = ms.device(os.getenv("DEV") or "cuda")
local h = tensor.handle_ctx(ctx)
local LAYER = { { "c_attn", 6144, 2048 }, { "attn_c_proj", 2048, 2048 }, { "w1", 5632, 2048 }, { "w2", 5632, 2048 },
                { "mlp_c_proj", 2048, 5632 } }
local ps = {}
for l = 0, 1 do for _, p in ipairs(LAYER) do
  if #ps < 12 then
    local i = #ps + 1
    ps[i] = { name = ("layers.%d.%s"):format(l, p[1]), param = ms.randn({ p[2], p[3] }, { ctx = ctx, seed = 100 + i, std = 0.02 }),
              grad = ms.randn({ p[2], p[3] }, { ctx = ctx, seed = 200 + i, std = 1e-3 }) }
  end
end end
local opts = { lr = 1e-3, weight_decay = 0, beta_G = 0.9, beta_LR = 0.95, beta_graft = 0.95, eps_grafting = 1e-8,
  start_prec_step = -1, block_size = 1024, newton_steps = 10, allow_tf32 = true, mu = 0, use_bias_correction = true,
  algo_one_dim = "adamw", inv_root_method = "cn", matrix_scaling_type = "fro", eps_inv_root = 1e-6, cn_tolerance = 0,
  inv_root_freq = arg[1] == "refresh" and 1 or 1000000000 }
local opt = ms.optim.new("dash", ps, opts, { nonfinite = "apply", ctx = ctx })
for _ = 1, 3 do opt:step() end
ctx:sync()
local free = {}   -- events to reuse
local function event() local e = table.remove(free) if e then return e end local p = ffi.new("ms_event *[1]") core.check(C.ms_event_new(h, p)) return p[0] end
local marks = {}
local function wrap(tbl, name)
  local f = tbl[name]
  tbl[name] = function(...)
    local a, b = event(), event()
    core.check(C.ms_event_record(h, a))
    local r1, r2, r3 = f(...)
    core.check(C.ms_event_record(h, b))
    marks[#marks + 1] = { name, a, b }
    return r1, r2, r3
  end
end
-- the products of the 1024 x 1024 stack alone (108 blocks, TF32), each way they can run: the factor products
-- through ms.blocks_gather_factors per MOONSTEP_DASH_FACTOR_GEMM path (lt, ex, nt), with the grafting fused
-- into the gather or not (MOONSTEP_DASH_GATHER_GRAFT), and the preconditioning products as (L G) R (the
-- recipe's) and L (G R) with G R written transposed (both operands K-major)
if arg[1] == "products" then
  pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite);")
  local n, b = 108, 1024
  local blocks = {}
  local gw = ms.randn({ 12 * b, 9 * b }, { ctx = ctx, seed = 7, std = 1e-3 })
  for i = 0, n - 1 do blocks[#blocks + 1] = { tensor = gw, row0 = (i % 12) * b, col0 = math.floor(i / 12) * b } end
  local list = ms.block_list(blocks)
  local G, L, R = ms.empty({ n, b, b }, { ctx = ctx }), ms.zeros({ n, b, b }, { ctx = ctx }), ms.zeros({ n, b, b }, { ctx = ctx })
  local X, Y = ms.empty({ n, b, b }, { ctx = ctx }), ms.empty({ n, b, b }, { ctx = ctx })
  local e0, e1, el = event(), event(), ffi.new("double[1]")
  local function time(label, f)
    f() ctx:sync()
    core.check(C.ms_event_record(h, e0))
    for _ = 1, 10 do f() end
    core.check(C.ms_event_record(h, e1))
    ctx:sync()
    core.check(C.ms_event_elapsed(e0, e1, el))
    print(("  %-44s %8.3f ms"):format(label, el[0] / 10))
  end
  print(("products of %d blocks of %d^2, TF32 (mean of 10 after one):"):format(n, b))
  for _, path in ipairs { "nt", "ex", "lt" } do
    ffi.C.setenv("MOONSTEP_DASH_FACTOR_GEMM", path, 1)
    time("gather + factors, beta 0.95, path " .. path, function()
      ms.blocks_gather_factors { stack = G, blocks = list, left = L, right = R, alpha = 0.05, beta = 0.95, tf32 = true }
    end)
    time("gather + left factor only, path " .. path, function()
      ms.blocks_gather_factors { stack = G, blocks = list, left = L, alpha = 0.05, beta = 0.95, tf32 = true }
    end)
  end
  ffi.C.setenv("MOONSTEP_DASH_FACTOR_GEMM", "lt", 1)
  local m, v, nrm = ms.zeros({ n, b, b }, { ctx = ctx }), ms.zeros({ n, b, b }, { ctx = ctx }), ms.zeros({ n }, { ctx = ctx })
  local graft = { grad_ema = m, adam_v = v, norm = nrm, beta_grad = 0.9, beta_graft = 0.95, eps = 1e-8, step = 3 }
  for _, fused in ipairs { "1", "0" } do
    ffi.C.setenv("MOONSTEP_DASH_GATHER_GRAFT", fused, 1)
    time("gather + graft + factors, graft fused " .. fused, function()
      ms.blocks_gather_factors { stack = G, blocks = list, left = L, right = R, alpha = 0.05, beta = 0.95, tf32 = true,
                                 graft = graft }
    end)
  end
  ffi.C.setenv("MOONSTEP_DASH_GATHER_GRAFT", "1", 1)
  time("gather alone", function() ms.blocks_gather(G, list) end)
  time("graft alone", function()
    ms.dash_graft { grad = G, grad_ema = m, adam_v = v, norm = nrm, beta_grad = 0.9, beta_graft = 0.95, eps = 1e-8, step = 3 }
  end)
  time("(L G) R: L G, then (L G) R", function()
    ms.matmul(L, G, { out = X, tf32 = true }) ms.matmul(X, R, { out = Y, tf32 = true })
  end)
  time("L (G R): G R^T written transposed, then L V", function()
    local V = X:transpose(1, 2)
    ms.matmul(G, R, { trans_b = true, out = V, tf32 = true }) ms.matmul(L, V, { out = Y, tf32 = true })
  end)
  time("G G^T, beta 0 (ms.matmul)", function() ms.matmul(G, G, { trans_b = true, out = X, tf32 = true }) end)
end

for _, n in ipairs { "matmul", "blocks_gather", "blocks_gather_factors", "dash_graft", "blocks_apply", "inv_root", "mul", "add" } do if ms[n] then wrap(ms, n) end end
local T = tensor.Tensor
for _, n in ipairs { "norm", "reshape", "copy_", "mul_", "add_" } do if type(T[n]) == "function" then wrap(T, n) end end
local mt = tensor.Tensor
for _, n in ipairs { "__div", "__add", "__mul", "__sub" } do if mt[n] then wrap(mt, n) end end
local sum, cnt = {}, {}
local e0, e1 = event(), event()
local el = ffi.new("double[1]")
local total = 0
local N = 5
for _ = 1, N do
  marks = {}
  core.check(C.ms_event_record(h, e0))
  opt:step()
  core.check(C.ms_event_record(h, e1))
  ctx:sync()
  core.check(C.ms_event_elapsed(e0, e1, el))
  total = total + el[0]
  for _, m in ipairs(marks) do
    core.check(C.ms_event_elapsed(m[2], m[3], el))
    sum[m[1]] = (sum[m[1]] or 0) + el[0]
    cnt[m[1]] = (cnt[m[1]] or 0) + 1
    free[#free + 1] = m[2] free[#free + 1] = m[3]
  end
end
print(("step %.3f ms (mean of %d)"):format(total / N, N))
local acc = 0
for k, v in pairs(sum) do print(("  %-14s %8.3f ms  %5.1f calls") :format(k, v / N, cnt[k] / N)) acc = acc + v / N end
print(("  %-14s %8.3f ms"):format("(covered)", acc))
