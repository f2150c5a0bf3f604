--[[
bench/dist_bench.lua -- the optimizer step on N ranks (one GPU each) against one GPU, in the same command (issue 9):

  build/moonstep launch -n 2 bench/dist_bench.lua [--what sinkgd,dash,allreduce] [--modes base,spectral]
                                                  [--trials 7] [--no-single] [--json PATH] [--tiny]
  build/moonstep launch -n 1 bench/dist_bench.lua --what sinkgd        -- the one-GPU rows alone (so does
                                                                        -- build/moonstep bench/dist_bench.lua)

  sinkgd     recipes/sinkgd.lua through ms.optim on the Llama-3-8B matrix set of bench/sinkgd_bench.lua (224
             matrices, bf16 params and grads, sinkhorn_iters 5; --modes: base, spectral = unit target, 1 power
             step), rows-sharded: rank r holds rows [floor(r m / N), floor((r + 1) m / N)) of every matrix
             (settings.comm and shard entries; ms_sinkgd_step_sharded underneath).
  dash       recipes/dash.lua on DASH's whole Llama-953M (research/dash.md §1.5: the 80 layer matrices, wte and
             lm_head tagged "dash" as DASH preconditions them, 33 RMSNorm vectors on AdamW; f32, B = 1024), NDB with power-iteration scaling (NDB-PIM: 10 Newton steps, PIM 16 vectors x 10 steps in
             bf16, tolerance 0: fixed work), a refresh every step; every rank holds every parameter and
             distribute = "owner": each rank solves its parameters' blocks, then broadcasts them.
  allreduce  in-place f32 all-reduces from 4 KB to 1 GB: the link's time and bandwidth.

Method: CUDA events around opt:step() on each rank's stream (bench/timing.lua: 3 warm-up steps, the median of
--trials), the slowest rank's median.  "1 GPU": rank 0 alone runs the whole set with no communicator while the
other ranks wait, in the same launch (--no-single leaves it out); with -n 1 that is the only row.  Settings
nonfinite = "apply" (no host sync), no clipping: the step's own work and its communication only.
Bytes per step: the collectives the runtime issues through the Lua communicator (DASH's broadcasts, ...) are
counted as they are issued (the payload of each call: its tensor, all-gather's output, reduce-scatter's input);
sharded SinkGD's exchanges happen inside ms_sinkgd_step_sharded and follow moonstep.h's contract, from which
they are computed: rows-sharded, per Sinkhorn iteration one sum of the matrices' column sums of squares
(sum of n, f32 on CUDA, f64 on the CPU), per power step X^T v [n] plus 2 scalars per matrix, all matrices in
one buffer (column "source" says which).  The same bytes are then all-reduced plainly in the same run: as one
call, and as the step's sequence of calls; "step / all-reduce" is the N-rank step over the latter.
--tiny: every dimension / 64 (SinkGD) or / 32 (DASH, B = 32), 2 layers, on the CPU's communicator (no GPU),
for the smoke test (tests/dist_bench_spec.lua).
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local json = ms.json
local C = core.C

-- ---------------------------------------------------------------------------------------------------
-- arguments
-- ---------------------------------------------------------------------------------------------------
local A = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/args.lua")
local args = A.parse("dist_bench", { what = "sinkgd,dash,allreduce", modes = "base", trials = 7 },
                     { tiny = true, no_single = true })
local list = A.list
local function has(lst, x) for _, v in ipairs(lst) do if v == x then return true end end return false end
local WHAT, MODES = list(args.what), list(args.modes)
for _, w in ipairs(WHAT) do
  if not has({ "sinkgd", "dash", "allreduce" }, w) then error("dist_bench: --what takes sinkgd, dash, allreduce (got " .. w .. ")") end
end
for _, m in ipairs(MODES) do
  if m ~= "base" and m ~= "spectral" then error("dist_bench: --modes takes base, spectral (got " .. m .. ")") end
end
local TRIALS = args.tiny and math.min(args.trials, 3) or args.trials

-- ---------------------------------------------------------------------------------------------------
-- the world
-- ---------------------------------------------------------------------------------------------------
if not args.tiny then assert(ms.device_count("cuda") > 0, "dist_bench: no CUDA device (--tiny runs on the CPU)") end
-- started without a launcher (`moonstep bench/dist_bench.lua`): a world of one
local comm = os.getenv("RANK") and ms.comm.from_env { ctx = args.tiny and ms.device("cpu") or nil, timeout = 300 }
             or ms.comm.new { ctx = ms.device(args.tiny and "cpu" or "cuda"), rank = 0, world_size = 1 }
local ctx, rank, world = comm:context(), comm:rank(), comm:size()
local h = tensor.handle_ctx(ctx)
local on_cuda = tonumber(C.ms_ctx_device_type(h)) == C.MS_DEVICE_CUDA
local time, release_timer = dofile((arg and arg[0] and arg[0]:match("^(.*)/") or "bench") .. "/timing.lua")(ctx)

local function say(...) if rank == 0 then print(string.format(...)) io.stdout:flush() end end

-- the largest of the ranks' values (every rank calls it)
local scratch = ms.zeros({ 1 }, { dtype = "f64", ctx = ctx })
local function world_max(v)
  scratch:fill_(v)
  comm:all_reduce(scratch, "max")
  return scratch:item()
end
local function barrier() world_max(0) end

local function release()
  collectgarbage()
  collectgarbage()
  ctx:sync()
  if on_cuda then core.check(C.ms_ctx_empty_cache(h)) end
end

say("moonstep %s dist bench: %d rank%s on %s%s  [%s]", ms.version, world, world > 1 and "s" or "", ctx:name(),
    world > 1 and " .. " or "", ms.build_info)

-- ---------------------------------------------------------------------------------------------------
-- counting the collectives: every call through a Lua communicator while `counting`
-- ---------------------------------------------------------------------------------------------------
local DT_BYTES = { f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, u8 = 1 }
local counting = nil       -- { bytes =, calls = {sizes in bytes} } while a step is counted
local function payload(t) return t:numel() * DT_BYTES[t:dtype()] end
do
  local Comm = getmetatable(comm)
  local measure = {
    all_reduce = function(dst) return payload(dst) end,
    broadcast = function(t) return payload(t) end,
    all_gather = function(dst) return payload(dst) end,
    reduce_scatter = function(_, src) return payload(src) end,
  }
  for name, size in pairs(measure) do
    local f = Comm[name]
    Comm[name] = function(self, a, b, c)
      if counting then
        local n = size(a, b)
        counting.bytes = counting.bytes + n
        counting.calls[#counting.calls + 1] = n
      end
      return f(self, a, b, c)
    end
  end
end

-- ms of one all-reduce of each size in `calls` (bytes, f32 buffers), in order, in place; the slowest rank's median
local function allreduce_ms(calls)
  local bufs = {}
  for i, n in ipairs(calls) do bufs[i] = ms.zeros({ math.max(1, math.ceil(n / 4)) }, { ctx = ctx }) end
  local t = time(function() for _, b in ipairs(bufs) do comm:all_reduce(b) end end, 1, TRIALS)
  bufs = nil
  release()
  return world_max(t)
end

-- ---------------------------------------------------------------------------------------------------
-- the optimizer runs
-- ---------------------------------------------------------------------------------------------------
local rows = {}

-- This rank's [lo, hi) of n split over the world.
local function split(n)
  return math.floor(rank * n / world), math.floor((rank + 1) * n / world)
end

-- Times opt:step() of an optimizer made by make(sharded): the 1-GPU run on rank 0 alone, then the world's.
-- extra_calls(sharded): the exchanges inside the engine that the Lua communicator does not see (sizes, bytes).
local function bench_step(name, make, extra_calls)
  local row = { what = name, ranks = world }
  if world == 1 or not args.no_single then
    if rank == 0 then
      local opt = make(false)
      row.single_ms = time(function() opt:step() end, 1, TRIALS)
      opt = nil
      release()
    end
    row.single_ms = world_max(row.single_ms or 0)     -- the other ranks wait here meanwhile
    say("  %-28s 1 GPU      %10.3f ms", name, row.single_ms)
  end
  if world > 1 then
    local opt = make(true)
    opt:step()
    ctx:sync()
    counting = { bytes = 0, calls = {} }
    opt:step()
    local counted = counting
    counting = nil
    ctx:sync()
    local t = time(function() opt:step() end, 1, TRIALS)
    row.step_ms = world_max(t)
    opt = nil
    release()
    local calls = {}
    for _, n in ipairs(counted.calls) do calls[#calls + 1] = n end
    row.counted_bytes, row.counted_calls = counted.bytes, #counted.calls
    local extra = extra_calls and extra_calls() or {}
    local extra_bytes = 0
    for _, n in ipairs(extra) do calls[#calls + 1] = n extra_bytes = extra_bytes + n end
    row.contract_bytes, row.contract_calls = extra_bytes, #extra
    row.bytes, row.calls = counted.bytes + extra_bytes, #calls
    row.source = (#counted.calls > 0 and "counted" or "") .. (#counted.calls > 0 and #extra > 0 and " + " or "")
                 .. (#extra > 0 and "contract" or "")
    if row.bytes > 0 then
      row.allreduce_one_ms = allreduce_ms({ row.bytes })
      row.allreduce_calls_ms = allreduce_ms(calls)
    end
    say("  %-28s %d ranks   %10.3f ms   %.4g MB in %d collectives (%s)", name, world, row.step_ms, row.bytes / 1e6,
        row.calls, row.source ~= "" and row.source or "none")
  end
  rows[#rows + 1] = row
end

-- ---------------------------------------------------------------------------------------------------
-- SinkGD: Llama-3-8B's matrices, rows-sharded
-- ---------------------------------------------------------------------------------------------------
local function sinkgd_set()
  local scale, layers = args.tiny and 64 or 1, args.tiny and 2 or 32
  local layer = { { "q_proj", 4096, 4096 }, { "k_proj", 1024, 4096 }, { "v_proj", 1024, 4096 }, { "o_proj", 4096, 4096 },
                  { "gate_proj", 14336, 4096 }, { "up_proj", 14336, 4096 }, { "down_proj", 4096, 14336 } }
  local set = {}
  for l = 0, layers - 1 do
    for _, p in ipairs(layer) do
      set[#set + 1] = { name = ("layers.%d.%s.weight"):format(l, p[1]), m = p[2] / scale, n = p[3] / scale }
    end
  end
  return set
end

local function sinkgd_options(mode)
  return { lr = 1e-3, weight_decay = 0, sinkhorn_iters = 5, sinkgd_lr_scale = 1,
           sinkgd_spectral_norm = mode == "spectral", sinkgd_spectral_norm_iters = 1, sinkgd_spectral_target = "unit" }
end

local function run_sinkgd(mode)
  local set = sinkgd_set()
  local dtype = args.tiny and "f32" or "bf16"
  local function make(sharded)
    local ps = {}
    for i, s in ipairs(set) do
      local lo, hi = 0, s.m
      if sharded then lo, hi = split(s.m) end
      ps[i] = { name = s.name, param = ms.randn({ hi - lo, s.n }, { ctx = ctx, dtype = dtype, std = 0.02 }),
                grad = ms.randn({ hi - lo, s.n }, { ctx = ctx, dtype = dtype }),
                shard = sharded and { dim = "rows", offset = lo, size = s.m } or nil }
    end
    return ms.optim.new("sinkgd", ps, sinkgd_options(mode),
                        { ctx = ctx, comm = sharded and comm or nil, nonfinite = "apply" })
  end
  -- moonstep.h's contract for rows-sharded matrices: per Sinkhorn iteration the column sums of squares [n];
  -- per power step X^T v [n] and 2 scalars (||v||^2, ||X||_F^2) per matrix; every matrix in one buffer
  local function contract()
    local o, sum_n = sinkgd_options(mode), 0
    for _, s in ipairs(set) do sum_n = sum_n + s.n end
    local bytes = on_cuda and 4 or 8
    local calls = {}
    for _ = 1, o.sinkhorn_iters do calls[#calls + 1] = sum_n * bytes end
    if o.sinkgd_spectral_norm then
      for _ = 1, o.sinkgd_spectral_norm_iters do calls[#calls + 1] = (sum_n + 2 * #set) * bytes end
    end
    return calls
  end
  local mb = 0
  for _, s in ipairs(set) do mb = mb + s.m * s.n * DT_BYTES[dtype] / 1e6 end
  bench_step(("sinkgd %s (%d matrices, %.0f MB)"):format(mode, #set, mb), make, contract)
end

-- ---------------------------------------------------------------------------------------------------
-- DASH: Llama-953M's matrices, owned by ranks
-- ---------------------------------------------------------------------------------------------------
local function run_dash()
  local scale, layers, B = args.tiny and 32 or 1, args.tiny and 2 or 16, args.tiny and 32 or 1024
  local layer = { { "c_attn", 6144, 2048 }, { "attn_c_proj", 2048, 2048 }, { "w1", 5632, 2048 }, { "w2", 5632, 2048 },
                  { "mlp_c_proj", 2048, 5632 } }
  local set = {}
  local d, vocab = math.floor(2048 / scale), math.floor(32000 / scale)
  for l = 0, layers - 1 do
    for _, p in ipairs(layer) do
      set[#set + 1] = { name = ("layers.%d.%s"):format(l, p[1]), shape = { math.floor(p[2] / scale), math.floor(p[3] / scale) } }
    end
    for _, norm in ipairs { "ln_1", "ln_2" } do set[#set + 1] = { name = ("layers.%d.%s"):format(l, norm), shape = { d } } end
  end
  -- the whole model, as DASH runs it (research/dash.md §1.5): untied wte and lm_head preconditioned too (tagged:
  -- the recipe's default routes embeddings to AdamW), the final RMSNorm
  set[#set + 1] = { name = "wte", shape = { vocab, d }, tags = { "dash" } }
  set[#set + 1] = { name = "lm_head", shape = { vocab, d }, tags = { "dash" } }
  set[#set + 1] = { name = "ln_f", shape = { d } }
  local options = {
    lr = 1e-3, weight_decay = 0, beta_G = 0.9, beta_LR = 0.95, beta_graft = 0.95, eps_grafting = 1e-8,
    start_prec_step = -1, block_size = B, inv_root_method = "ndb", eps_inv_root = 0, newton_steps = 10,
    matrix_scaling_type = "pim", matrix_scaling_pi_steps = 10, matrix_scaling_const = 2,
    matrix_scaling_pi_vectors = 16, eps_power_iter = 1e-6, pi_bf16 = true, allow_tf32 = true, ndb_tolerance = 0,
    matmul_dtype = "f32", mu = 0, use_bias_correction = true, algo_one_dim = "adamw", inv_root_freq = 1,
  }
  local function make(distributed)
    local ps = {}
    for i, s in ipairs(set) do
      -- every rank the same values (seeded by the parameter): the owners' updates replace them anyway
      ps[i] = { name = s.name, param = ms.randn(s.shape, { ctx = ctx, seed = 100 + i, std = 0.02 }),
                grad = ms.randn(s.shape, { ctx = ctx, seed = 200 + i }), tags = s.tags }
    end
    return ms.optim.new("dash", ps, options, { ctx = ctx, comm = distributed and comm or nil, nonfinite = "apply",
                                               distribute = distributed and "owner" or nil })
  end
  local mb, numel, matrices = 0, 0, 0
  for _, s in ipairs(set) do
    local n = s.shape[1] * (s.shape[2] or 1)
    numel, mb = numel + n, mb + n * 4 / 1e6
    if s.shape[2] then matrices = matrices + 1 end
  end
  bench_step(("dash ndb-pim (%.1fM params: %d matrices + %d norms, %.0f MB)"):format(numel / 1e6, matrices,
             #set - matrices, mb), make, nil)
end

-- ---------------------------------------------------------------------------------------------------
-- plain all-reduces
-- ---------------------------------------------------------------------------------------------------
local sweep = {}
local function run_allreduce()
  local top = args.tiny and 2 ^ 20 or 2 ^ 30
  local n = 4096
  while n <= top do
    local t = allreduce_ms({ n })
    sweep[#sweep + 1] = { bytes = n, ms = t, algo_GBps = n / (t * 1e-3) / 1e9,
                          bus_GBps = 2 * (world - 1) / world * n / (t * 1e-3) / 1e9 }
    say("  all-reduce %10d bytes  %9.4f ms", n, t)
    n = n * 4
  end
end

for _, w in ipairs(WHAT) do
  if w == "sinkgd" then for _, m in ipairs(MODES) do run_sinkgd(m) end end
  if w == "dash" then run_dash() end
  if w == "allreduce" and world > 1 then run_allreduce() end
end
release_timer()

-- ---------------------------------------------------------------------------------------------------
-- the tables (rank 0)
-- ---------------------------------------------------------------------------------------------------
local function num(v, fmt) return v and fmt:format(v) or "-" end
if rank == 0 then
  print()
  print(("%d rank%s, %s; median of %d steps per rank, the slowest rank's"):format(world, world > 1 and "s" or "",
        ctx:name() .. (world > 1 and " .. " or ""), TRIALS))
  print()
  local ranks = world .. (world > 1 and " ranks" or " rank")
  print("| step | 1 GPU (ms) | " .. ranks .. " (ms) | speed-up | " .. ranks .. " / 1 GPU | bytes / step | "
        .. "collectives / step | source | all-reduce of those bytes, 1 call (ms) | same, the step's calls (ms) | "
        .. "step / all-reduce |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for _, r in ipairs(rows) do
    local speed = r.single_ms and r.step_ms and r.single_ms / r.step_ms
    print(("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"):format(r.what, num(r.single_ms, "%.3f"),
          num(r.step_ms, "%.3f"), num(speed, "%.2fx"), num(speed and 1 / speed, "%.2f"),
          r.bytes and ("%.4g MB"):format(r.bytes / 1e6) or "-", r.calls and tostring(r.calls) or "-",
          r.source ~= "" and r.source or "-", num(r.allreduce_one_ms, "%.3f"), num(r.allreduce_calls_ms, "%.3f"),
          num(r.step_ms and r.allreduce_calls_ms and r.allreduce_calls_ms > 0 and r.step_ms / r.allreduce_calls_ms,
              "%.1f")))
  end
  if #sweep > 0 then
    print()
    print("| all-reduce (f32, in place) | ms | algorithm GB/s | bus GB/s |")
    print("|---|---|---|---|")
    for _, s in ipairs(sweep) do
      print(("| %d bytes | %.4f | %.2f | %.2f |"):format(s.bytes, s.ms, s.algo_GBps, s.bus_GBps))
    end
  end
  if args.json then
    local f = assert(io.open(args.json, "w"))
    f:write(json.encode({ ranks = world, device = ctx:name(), trials = TRIALS, steps = rows, allreduce = sweep }), "\n")
    f:close()
  end
end
barrier()
comm:free()
