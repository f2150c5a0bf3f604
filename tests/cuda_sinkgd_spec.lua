-- The CUDA SinkGD step (kernels/sinkgd.cu) and the CUDA 8-bit AdamW (kernels/adamw8.cu) against the CPU backend
-- (engine/cpu/sinkgd.c, engine/cpu/adamw8.c) on the same fresh random inputs, through the C ABI, beyond the four
-- parity specs of tests/sinkgd_spec.lua: every thread map of the sweep (chunks per thread K = 1, 2, 4, and 8 for
-- f32; row lanes within a warp and across warps; row pairs and the wide path for long rows; the generic path
-- for odd widths and strided grads), f16 and mixed param/grad dtypes, matrices split over many CTAs and CTAs
-- spanning matrices, non-contiguous grads, iters 0 and several power steps, zero and NaN gradients, a zero u and
-- the restart of a degenerate u, device scalars and skip_t, stochastic rounding, bitwise reproducibility, groups
-- larger than one launch table, the launch count, graph capture, and the pool's cache.  SinkGD is compared to one rounding of the
-- stored param (the GPU sums in f32, the CPU in f64): |gpu - cpu| <= 1 ulp + 1e-5 of the largest update.  8-bit
-- AdamW is compared bit for bit.
-- Every spec is a cuda_it: pending where no GPU is present.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local graph = require("moonstep.graph")
local ffi, C = core.ffi, core.C

local cuda_it = H.cuda_it
local abs, max, sqrt = math.abs, math.max, math.sqrt
local GPU = H.has_cuda and ms.device("cuda") or nil
local CPU = ms.device("cpu")

-- ---------------------------------------------------------------------------------------------------
-- helpers
-- ---------------------------------------------------------------------------------------------------
local function vals(t) return t:tolist_flat() end
local function randn(shape, dt, ctx) return ms.randn(shape, { dtype = dt or "f32", seed = H.seed(), ctx = ctx }) end
local function urand(shape, lo, hi) return ms.rand(shape, { seed = H.seed(), low = lo, high = hi }) end
local function gpu(t) return t:to(GPU) end

local assert_ulps, same_bits, assert_same = H.assert_ulps, H.same_bits, H.assert_same

local A = dofile("tests/abi.lua")
local handles, doubles, ok, lead_of, ushape_of = A.handles, A.doubles, A.ok, A.lead_of, A.ushape_of
local function launches(ctx) return ctx:mem_stats().launches end

-- one call on ctx with members {p=, g=, u=, t=}; returns the status and the launches the engine counted (not
-- counted when `quiet`, e.g. while capturing)
local function sinkgd_raw(ctx, members, o, scales, quiet)
  local n0 = not quiet and launches(ctx) or 0
  local st = A.sinkgd_step(ctx, members, o, scales)
  return st, not quiet and launches(ctx) - n0 or 0
end

-- a CPU member and its GPU twin: p of pdt, g of gdt, u random (spectral/sphere), t -1 or a radius (sphere).
-- spec.grad: "transposed" (the GPU grad a transposed view), "sliced" (rows of a wider tensor), "permuted"
-- (3-D: the leading dim moved inside).  The CPU's grad is contiguous with the same values.
local function twin(spec, mode, k)
  local shape, pdt, gdt = spec.shape, spec.pdt or spec.dt or "bf16", spec.gdt or spec.dt or "bf16"
  local c = { p = randn(shape, pdt), dt = pdt, shape = shape }
  local gg
  if spec.grad == "transposed" then
    local m, n = shape[1], shape[2]
    local base = randn({ n, m }, gdt, GPU)
    gg = base:t()
    c.g = gg:to(CPU):contiguous()
  elseif spec.grad == "sliced" then
    local m, n = shape[1], shape[2]
    local base = randn({ m, n + 24 }, gdt, GPU)
    gg = base:slice(1, 8, 8 + n)
    c.g = gg:to(CPU):contiguous()
  elseif spec.grad == "permuted" then
    local b, m, n = shape[1], shape[2], shape[3]
    local base = randn({ m, b, n }, gdt, GPU)
    gg = base:permute(1, 0, 2)
    c.g = gg:to(CPU):contiguous()
  else
    c.g = randn(shape, gdt)
    gg = gpu(c.g)
  end
  if mode ~= "base" then c.u = urand(ushape_of(shape), -1, 1) end
  if mode == "sphere" then c.t = ms.full(lead_of(shape), k % 2 == 1 and -1 or 3.5 + k, { dtype = "f32" }) end
  local g = { p = gpu(c.p), g = gg, u = c.u and gpu(c.u), t = c.t and gpu(c.t), dt = pdt, shape = shape }
  return c, g
end

-- steps both groups with o and compares (params to one rounding plus 1e-5 of the largest update, u, t).  The GPU
-- starts from the CPU's state: the two may round a stored param an ulp apart, and carried into the next step an
-- ulp of a large param can be several of a smaller result.
-- the options of a 5-iteration step with one power step (no weight decay on the sphere)
local function step_options(mode)
  return { mode = mode, iters = 5, sn_iters = 1, lr = 0.05, weight_decay = mode == "sphere" and 0 or 0.02, step = 1 }
end

-- fails on the first NaN among the members' parameters
local function assert_no_nan(members, what)
  for k, mb in ipairs(members) do
    for i, x in ipairs(vals(mb.p)) do assert(x == x, ("%s: member %d element %d is NaN"):format(what, k, i)) end
  end
end

local function step_and_compare(cpu_m, gpu_m, o, scales, what)
  local before = {}
  for k, mb in ipairs(cpu_m) do
    before[k] = vals(mb.p)
    gpu_m[k].p:copy_(gpu(mb.p))
    if mb.u then gpu_m[k].u:copy_(gpu(mb.u)) end
    if mb.t then gpu_m[k].t:copy_(gpu(mb.t)) end
  end
  ok(sinkgd_raw(CPU, cpu_m, o, scales))
  ok(sinkgd_raw(GPU, gpu_m, o, scales))
  for k, mb in ipairs(cpu_m) do
    local want, got = vals(mb.p), vals(gpu_m[k].p)
    local maxupd = 0
    for i = 1, #want do
      local d = abs(want[i] - before[k][i])
      if d == d then maxupd = max(maxupd, d) end
    end
    assert_ulps(got, want, mb.dt, ("%s member %d %s"):format(what, k, table.concat(mb.shape, "x")), 1, 1e-5 * maxupd)
    if mb.u then H.assert_close(vals(gpu_m[k].u), vals(mb.u), 1e-4, 1e-5, what .. " member " .. k .. " u") end
    if mb.t then H.assert_close(vals(gpu_m[k].t), vals(mb.t), 1e-6, 0, what .. " member " .. k .. " t") end
  end
end

local function group(specs, mode)
  local cm, gm = {}, {}
  for k, s in ipairs(specs) do cm[k], gm[k] = twin(s, mode, k) end
  return cm, gm
end

local function fresh_grads(cm, gm)
  for k, mb in ipairs(cm) do
    local g = randn(mb.g:shape(), mb.g:dtype())
    mb.g:copy_(g)
    gm[k].g:copy_(gpu(g))
  end
end

-- every thread map of the sweep and the elementwise passes (kernels/sinkgd.cu, plan_chunk)
local PATHS = {
  { shape = { 3000, 256 }, dt = "bf16" },            -- row lanes of 32 threads within a warp, many groups
  { shape = { 8, 8192 }, dt = "bf16" },              -- K = 2 chunks a thread (G in L2), else 4
  { shape = { 4, 14336 }, dt = "bf16" },             -- K = 4 (the Llama MLP width)
  { shape = { 2, 20000 }, dt = "bf16" },             -- rows too long for one CTA's registers: a pair of CTAs
  { shape = { 3, 32768 }, dt = "bf16" },             -- a pair's longest rows (2048 chunks a CTA)
  { shape = { 2, 16392 }, dt = "f16" },              -- a pair's halves of 1025 and 1024 chunks
  { shape = { 3, 9000 }, dt = "f32" },               -- f32 K = 8 (2250 chunks of 4, a row in two stages)
  { shape = { 2, 16384 }, dt = "f32" },              -- f32 K = 8, every thread of the lane
  { shape = { 2, 16400 }, dt = "f32" },              -- f32 wide (4100 chunks)
  { shape = { 2, 3, 16400 }, dt = "f16" },           -- pair experts
  { shape = { 2, 40000 }, dt = "bf16" },             -- 16-bit wide (5000 chunks)
  { shape = { 2, 50000 }, dt = "bf16" },             -- wide, beyond one block of cached column factors
  { shape = { 3, 100008 }, dt = "f32" },             -- f32 wide, three blocks
  { shape = { 2, 20004 }, dt = "bf16" },             -- long rows, width not a multiple of 8: generic path
  { shape = { 1100, 1024 }, dt = "f32" },            -- row lanes across warps, a matrix over many CTAs
  { shape = { 5, 4096 }, dt = "f32" },               -- f32 K = 2
  { shape = { 3, 8192 }, dt = "f32" },               -- f32 K = 4
  { shape = { 64, 300 }, dt = "f32" },               -- 96-thread row lanes (not a power of two)
  { shape = { 40, 3072 }, dt = "f16" },              -- K = 2: 2 lanes of 192 threads (2 rows each), 128 idle threads
  { shape = { 1400, 5120 }, dt = "bf16" },           -- K = 2: a lane of 320 threads, 192 idle ones, ~5 groups a CTA
  { shape = { 33, 12 }, dt = "bf16" },               -- width not a multiple of 8: generic path
  { shape = { 1, 8 }, dt = "f16" },                  -- one row
  { shape = { 7, 1 }, dt = "f32" },                  -- one column
  { shape = { 2, 3, 40, 24 }, dt = "f16" },          -- 4-D: six matrices
  { shape = { 96, 64 }, pdt = "f32", gdt = "bf16" }, -- mixed param and grad dtypes
  { shape = { 48, 256 }, pdt = "bf16", gdt = "f32" },
  { shape = { 40, 512 }, dt = "f16" },
}

-- ---------------------------------------------------------------------------------------------------
describe("cuda ms_sinkgd_step", function()
  for _, mode in ipairs { "base", "spectral", "sphere" } do
    cuda_it(mode .. ": the CPU's results on every thread map, f16 and mixed dtypes, in one group over two steps",
            function()
      local cm, gm = group(PATHS, mode)
      local scales = {}
      for k = 1, #PATHS do scales[k] = 0.5 + k / 8 end
      local o = { mode = mode, iters = 5, sn_iters = 2, target = "muon", lr = 0.05,
                  weight_decay = mode == "sphere" and 0 or 0.02 }
      for step = 1, 2 do
        o.step = step
        fresh_grads(cm, gm)
        step_and_compare(cm, gm, o, scales, mode .. " step " .. step)
      end
    end)
  end

  -- plan_chunk gives K = 2 chunks a thread when the call's G fits in L2 (every group above), K = 4 when it
  -- streams from DRAM; MOONSTEP_SINKGD_K forces either, so both thread maps meet every shape here
  cuda_it("the CPU's results with K = 4 and K = 2 forced on every thread map, base and spectral", function()
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    for _, kforce in ipairs { "4", "2" } do
      ffi.C.setenv("MOONSTEP_SINKGD_K", kforce, 1)
      local ok, err = pcall(function()
        for _, mode in ipairs { "base", "spectral" } do
          local cm, gm = group(PATHS, mode)
          local o = { mode = mode, iters = 5, sn_iters = 2, target = "unit", lr = 0.05, weight_decay = 0.02, step = 1 }
          step_and_compare(cm, gm, o, nil, mode .. " K = " .. kforce)
        end
      end)
      ffi.C.unsetenv("MOONSTEP_SINKGD_K")
      assert(ok, err)
    end
  end)

  -- a ladder of row widths across every boundary of plan_chunk's thread maps (K = 1, 2, 4, 8 chunks a thread; lanes
  -- within a warp, of a power of two warps and of other counts with idle threads past the last lane; one lane; a
  -- pair), each matrix ~400K elements so that its CTAs take several row groups each, under K = 2 and K = 4 forced,
  -- every mode
  cuda_it("the CPU's results on a ladder of row widths across the thread maps' boundaries, K = 2 and 4 forced",
          function()
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local function ladder(widths, pdt, gdt)
      local specs = {}
      for k, n in ipairs(widths) do specs[k] = { shape = { max(4, math.floor(400000 / n)), n }, pdt = pdt, gdt = gdt } end
      return specs
    end
    local ladders = {
      ladder({ 8, 24, 40, 264, 520, 776, 1544, 2056, 2568, 3080, 4104, 5128, 6152, 7176, 8200, 10248, 12296, 14344,
               16392 }, "bf16", "bf16"),
      ladder({ 1032, 3080, 6152, 9224 }, "f32", "f16"),
      ladder({ 4, 12, 132, 1028, 1540, 2052, 3076, 4100, 6148, 8196, 12292 }, "f32", "f32"),
    }
    for _, specs in ipairs(ladders) do
      for _, kforce in ipairs { "2", "4" } do
        ffi.C.setenv("MOONSTEP_SINKGD_K", kforce, 1)
        local good, err = pcall(function()
          for _, mode in ipairs { "base", "spectral", "sphere" } do
            local cm, gm = group(specs, mode)
            local o = { mode = mode, iters = 5, sn_iters = 1, target = "unit", lr = 0.05,
                        weight_decay = mode == "sphere" and 0 or 0.02, step = 1 }
            step_and_compare(cm, gm, o, nil, ("%s %s K = %s"):format(specs[1].gdt, mode, kforce))
          end
        end)
        ffi.C.unsetenv("MOONSTEP_SINKGD_K")
        assert(good, err)
      end
    end
  end)

  -- a class (one row width and grad dtype) of MOONSTEP_SINKGD_SPLIT bytes of G or more runs in launch sequences of
  -- its own (the default, 1 GiB, splits the Llama-3-8B set's down projections from the rest), the classes in the
  -- order of their first matrices, then the rest in the call's order
  cuda_it("splits a call's large classes into launch sequences of their own, with the CPU's results", function()
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local shapes = { { shape = { 3, 64, 1024 }, dt = "bf16" }, { shape = { 50, 24 }, dt = "f32" },
                     { shape = { 100, 8192 }, dt = "bf16" }, { shape = { 2, 40, 1024 }, dt = "f16" },
                     { shape = { 30, 8192 }, dt = "bf16" } }
    local per = 2 * 5 + 2   -- base, iters 5: the sweeps and folds, the apply, the tables
    -- threshold -> sequences: 1 GiB (default) none split; 1e6 the 8192-wide bf16 class (2.1 MB) and the rest;
    -- 1 every class alone (4)
    local good, err = pcall(function()
      for _, case in ipairs { { nil, 1 }, { "1000000", 2 }, { "1", 4 } } do
        if case[1] then ffi.C.setenv("MOONSTEP_SINKGD_SPLIT", case[1], 1) end
        for _, mode in ipairs { "base", "spectral" } do
          local cm, gm = group(shapes, mode)
          local o = { mode = mode, iters = 5, sn_iters = 1, target = "unit", lr = 0.05, weight_decay = 0.02, step = 1 }
          step_and_compare(cm, gm, o, nil, ("%s, split at %s bytes"):format(mode, case[1] or "1 GiB"))
          if mode == "base" then
            local st, n = sinkgd_raw(GPU, gm, o)
            ok(st)
            assert.equals(case[2] * per, n, "launches with the split at " .. (case[1] or "1 GiB"))
          end
        end
      end
    end)
    ffi.C.unsetenv("MOONSTEP_SINKGD_SPLIT")
    assert(good, err)
  end)

  -- 5 experts of 64 row groups each: plan_chunk gives each 26 whole CTA ranges (130 CTAs, none crossing from one
  -- matrix into the next) instead of splitting 320 groups over 132 CTAs
  cuda_it("the CPU's results for equal experts planned on whole ranges (5 x 512 x 2048), every mode", function()
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      local cm, gm = group({ { shape = { 5, 512, 2048 }, dt = "bf16" }, { shape = { 3, 256, 1024 }, pdt = "f32", gdt = "bf16" } },
                           mode)
      local o = { mode = mode, iters = 5, sn_iters = 1, target = "unit", lr = 0.05,
                  weight_decay = mode == "sphere" and 0 or 0.02, step = 1 }
      step_and_compare({ cm[1] }, { gm[1] }, o, nil, mode .. " experts")
      step_and_compare(cm, gm, o, nil, mode .. " experts and more")   -- unequal counts: the even split
    end
  end)

  -- a group of shapes against the CPU in every mode with iters 0, 1 and 5 (the power restart's sweeps included);
  -- launches(gm, o) checks the launch counts of its base step with 5 iterations
  local function every_mode_and_iters(shapes, what, launches)
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      for _, iters in ipairs { 0, 1, 5 } do
        local cm, gm = group(shapes, mode)
        local o = { mode = mode, iters = iters, sn_iters = 2, target = "muon", lr = 0.05,
                    weight_decay = mode == "sphere" and 0 or 0.02, step = 1 }
        step_and_compare(cm, gm, o, nil, ("%s iters %d %s"):format(mode, iters, what))
        if mode == "base" and iters == 5 then launches(gm, o) end
      end
    end
  end

  -- every_mode_and_iters' launch check: a base step of 5 iterations (and the step's 2 other launches) launches
  -- `mixed` kernels an iteration for the whole group, which ends with a fast matrix, and `alone` for its first two
  -- matrices
  local function launches_an_iteration(mixed, alone, what)
    return function(gm, o)
      local st, n = sinkgd_raw(GPU, gm, o)
      ok(st)
      assert.equals(mixed * 5 + 2, n, "launches of a base step with " .. what .. " and a fast matrix")
      st, n = sinkgd_raw(GPU, { gm[1], gm[2] }, o)
      ok(st)
      assert.equals(alone * 5 + 2, n, "launches of a base step with " .. what .. " alone")
    end
  end

  -- the wide path over many CTAs: each of 300 rows' sums is one CTA's, each band's column partials are a
  -- columns pass's (kernels/sinkgd.cu, wide_rows_segment and wide_cols_segment), with the fast path in the
  -- same call
  cuda_it("the wide path (f32 rows beyond 16384 elements, 16-bit beyond 32768) over many bands, with a fast matrix, "
          .. "every mode and "
          .. "iters 0, 1 and 5", function()
    every_mode_and_iters({ { shape = { 300, 16400 }, dt = "f32" }, { shape = { 70, 40000 }, pdt = "f32", gdt = "bf16" },
                           { shape = { 256, 512 }, dt = "bf16" } }, "wide",
                         -- an iteration: the sweep (the fast matrix), the wide rows and columns passes, the fold;
                         -- a call of wide matrices alone launches no sweep
                         launches_an_iteration(4, 3, "wide matrices"))
  end)

  -- 16-bit rows of 2049-4096 chunks (16385-32768 elements: a Llama-3-70B down projection) take the sweep on
  -- clusters of two CTAs, each half of every row, the row sums exchanged between them (kernels/sinkgd.cu,
  -- pair_kernel): rows over many bands, odd and even chunk counts, experts, beside a fast matrix; one sweep
  -- launch for the pairs an iteration.  MOONSTEP_SINKGD_PAIR = 0 sends the same rows to the wide path.
  cuda_it("16-bit rows of 16385-32768 elements in row pairs over many bands, every mode and iters 0, 1 and 5",
          function()
    local shapes = { { shape = { 300, 28672 }, dt = "bf16" }, { shape = { 2, 90, 16392 }, pdt = "bf16", gdt = "f16" },
                     { shape = { 256, 512 }, dt = "bf16" } }
    every_mode_and_iters(shapes, "pairs", launches_an_iteration(3, 2, "pairs"))
    -- a call of 7 row groups: 7 CTA ranges, the last pair's second range empty
    for _, mode in ipairs { "base", "spectral" } do
      local cm, gm = group({ { shape = { 7, 20000 }, dt = "bf16" } }, mode)
      step_and_compare(cm, gm, { mode = mode, iters = 5, sn_iters = 1, lr = 0.05, weight_decay = 0.02, step = 1 }, nil,
                       mode .. " 7 rows")
    end
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    ffi.C.setenv("MOONSTEP_SINKGD_PAIR", "0", 1)
    local good, err = pcall(function()
      local cm, gm = group(shapes, "spectral")
      local o = { mode = "spectral", iters = 5, sn_iters = 1, lr = 0.05, weight_decay = 0.02, step = 1 }
      step_and_compare(cm, gm, o, nil, "the same rows on the wide path")
      local st, n = sinkgd_raw(GPU, { gm[1], gm[2] }, { mode = "base", iters = 5 })
      ok(st)
      assert.equals(3 * 5 + 2, n, "launches of a base step on the wide path")
    end)
    ffi.C.unsetenv("MOONSTEP_SINKGD_PAIR")
    assert(good, err)
  end)

  -- G's columns in equal pairs and u = (b, -b) on each pair: X u = 0 (the pair's c are the same bits), a restart
  -- of a matrix of more than 256 rows and columns (the restart's 256 threads each walk several of both)
  local function restarting(mb, m, n)
    local g, u = {}, {}
    for i = 1, m do
      for k = 1, n / 2 do
        local x = math.random() - 0.5
        g[(i - 1) * n + 2 * k - 1], g[(i - 1) * n + 2 * k] = x, x
      end
    end
    for k = 1, n / 2 do
      local b = 0.1 + math.random()
      u[2 * k - 1], u[2 * k] = b, -b
    end
    mb.g:copy_(ms.tensor(g):view(m, n):to(mb.g:dtype()))
    if mb.u then mb.u:copy_(ms.tensor(u)) end
  end

  -- a chunk of many fold blocks (more than 4 an SM) whose matrices have at most 16 bands each folds its plain SINK
  -- iterations a warp a fold block (kernels/sinkgd.cu, fold_warp_kernel): the CPU's results, and the bits of
  -- fold_kernel (MOONSTEP_SINKGD_WARP_FOLD = 0), in every mode, the START fold's walk of u's start included (a
  -- zero u in every third member) and the restart of a u orthogonal to X's rows (the last member, as below).  40
  -- matrices of 512 columns: 640 fold blocks, 2-4 bands a matrix; the 3 x 9000 member adds 282 blocks of one band.
  cuda_it("folds a chunk of many matrices of few bands a warp a fold block, with fold_kernel's bits", function()
    local specs = {}
    for k = 1, 40 do specs[k] = { shape = { 64, 512 }, dt = k % 2 == 0 and "bf16" or "f32" } end
    specs[41] = { shape = { 3, 9000 }, pdt = "bf16", gdt = "f32" }
    specs[42] = { shape = { 1, 2 }, dt = "f32" }
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      local cm, gm = group(specs, mode)
      for k = 3, #cm, 3 do if cm[k].u then cm[k].u:zero_() end end
      local a, b = 0.3 + math.random(), 0.2 + math.random()
      cm[42].g:copy_(ms.tensor({ { a, a } }))
      gm[42].g:copy_(gpu(cm[42].g))
      if cm[42].u then cm[42].u:copy_(ms.tensor({ b, -b })) end
      restarting(cm[40], 64, 512)   -- (a restart of 512 columns: the last warp walks 2 a virtual thread)
      gm[40].g:copy_(gpu(cm[40].g))
      local u40 = cm[40].u and cm[40].u:clone()
      if u40 then gm[40].u:copy_(gpu(u40)) end
      local o = step_options(mode)
      step_and_compare(cm, gm, o, nil, mode .. " many matrices")
      for k = 3, #gm, 3 do if gm[k].u then gm[k].u:zero_() end end
      if gm[42].u then gm[42].u:copy_(gpu(ms.tensor({ b, -b }))) end
      if u40 then gm[40].u:copy_(gpu(u40)) end
      local start, first = {}, {}
      for k, mb in ipairs(gm) do start[k] = { p = mb.p:clone(), u = mb.u and mb.u:clone(), t = mb.t and mb.t:clone() } end
      ok(sinkgd_raw(GPU, gm, o))
      for k, mb in ipairs(gm) do
        first[k] = { p = vals(mb.p), u = mb.u and vals(mb.u) }
        mb.p:copy_(start[k].p)
        if mb.u then mb.u:copy_(start[k].u) end
        if mb.t then mb.t:copy_(start[k].t) end
      end
      ffi.C.setenv("MOONSTEP_SINKGD_WARP_FOLD", "0", 1)
      local good, err = pcall(function()
        ok(sinkgd_raw(GPU, gm, o))
        for k, mb in ipairs(gm) do
          assert_same(vals(mb.p), first[k].p, mode .. " p " .. k .. " with fold_kernel")
          if mb.u then assert_same(vals(mb.u), first[k].u, mode .. " u " .. k .. " with fold_kernel") end
        end
      end)
      ffi.C.unsetenv("MOONSTEP_SINKGD_WARP_FOLD")
      assert(good, err)
    end
  end)

  -- a chunk of at most 16 dense matrices of one dtype pair is applied by flat_apply_kernel (kernels/sinkgd.cu, its
  -- launch table a kernel parameter) in base and spectral mode: the CPU's results, and the ring's bits
  -- (MOONSTEP_SINKGD_FLAT_APPLY = 0), for every dtype pair, iters 5 and 0 (no r or c), stochastic rounding, and row
  -- groups of 1-32 rows split over several blocks (a 4 x 14336 row is 1792 chunks: 4 blocks of 512)
  cuda_it("applies a chunk of at most 16 dense matrices of one dtype pair in one flat pass, with the ring's bits",
          function()
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local pairs_ = { { "bf16", "bf16" }, { "f32", "bf16" }, { "f16", "f16" }, { "f32", "f32" }, { "bf16", "f32" },
                     { "f16", "f32" } }
    for pi, dts in ipairs(pairs_) do
      local gdt, pdt = dts[1], dts[2]
      local specs = { { shape = { 300, 512 }, gdt = gdt, pdt = pdt }, { shape = { 3, 40, 1024 }, gdt = gdt, pdt = pdt },
                      { shape = { 4, 14336 }, gdt = gdt, pdt = pdt }, { shape = { 17, 8 }, gdt = gdt, pdt = pdt } }
      for _, mode in ipairs { "base", "spectral" } do
        for _, iters in ipairs { 5, 0 } do
          local cm, gm = group(specs, mode)
          local o = { mode = mode, iters = iters, sn_iters = 1, lr = 0.03, weight_decay = 0.01, step = 2, seed = 5,
                      stochastic_round = pdt ~= "f32" and pi % 2 == 1 }
          local what = ("%s/%s %s iters %d"):format(gdt, pdt, mode, iters)
          step_and_compare(cm, gm, o, nil, what)
          local start, flat = {}, {}
          for k, mb in ipairs(gm) do start[k] = { p = mb.p:clone(), u = mb.u and mb.u:clone() } end
          ok(sinkgd_raw(GPU, gm, o))
          for k, mb in ipairs(gm) do
            flat[k] = vals(mb.p)
            mb.p:copy_(start[k].p)
            if mb.u then mb.u:copy_(start[k].u) end
          end
          ffi.C.setenv("MOONSTEP_SINKGD_FLAT_APPLY", "0", 1)
          local good, err = pcall(function()
            ok(sinkgd_raw(GPU, gm, o))
            for k, mb in ipairs(gm) do assert_same(vals(mb.p), flat[k], what .. " p " .. k .. " with the ring") end
          end)
          ffi.C.unsetenv("MOONSTEP_SINKGD_FLAT_APPLY")
          assert(good, err)
        end
      end
    end
  end)

  -- f32 rows of 2049-4096 chunks (8193-16384 elements: a Llama down projection with f32 grads) take the sweep with
  -- 8 chunks a thread, a row's sum finished over two ring stages (kernels/sinkgd.cu, fast_segment with K = 8):
  -- rows over many bands, lanes of 384 and 512 threads, beside a K = 4 matrix; one sweep an iteration
  cuda_it("f32 rows of 8193-16384 elements in the sweep (K = 8) over many bands, every mode and iters 0, 1 and 5",
          function()
    every_mode_and_iters({ { shape = { 500, 12000 }, dt = "f32" }, { shape = { 2, 130, 16384 }, pdt = "bf16", gdt = "f32" },
                           { shape = { 256, 512 }, dt = "f32" } }, "f32 K = 8", function(gm, o)
      local st, n = sinkgd_raw(GPU, gm, o)
      ok(st)
      assert.equals(2 * 5 + 2, n, "launches of a base step: a sweep and a fold an iteration, the apply, the tables")
    end)
  end)

  cuda_it("takes transposed, row-sliced and permuted grads in place (the CPU's results)", function()
    for _, mode in ipairs { "base", "spectral" } do
      local cm, gm = group({
        { shape = { 512, 256 }, dt = "bf16", grad = "transposed" },
        { shape = { 64, 96 }, dt = "f32", grad = "transposed" },
        { shape = { 128, 1024 }, dt = "bf16", grad = "sliced" },
        { shape = { 3, 40, 64 }, dt = "bf16", grad = "permuted" },
      }, mode)
      step_and_compare(cm, gm, { mode = mode, iters = 5, lr = 0.1, weight_decay = 0.01 }, nil, mode .. " strided")
    end
  end)

  cuda_it("iters = 0 (X = G) and three power steps with either target, every mode", function()
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      for _, iters in ipairs { 0, 1 } do
        for _, target in ipairs { "unit", "muon" } do
          local cm, gm = group({ { shape = { 200, 512 }, dt = "bf16" }, { shape = { 30, 50 }, dt = "f32" },
                                 { shape = { 2, 16, 64 }, dt = "f32" } }, mode)
          local o = { mode = mode, iters = iters, sn_iters = 3, target = target, lr = 0.03,
                      weight_decay = mode == "sphere" and 0 or 0.1 }
          step_and_compare(cm, gm, o, nil, ("%s iters %d %s"):format(mode, iters, target))
        end
      end
    end
  end)

  -- sn_iters 2: a second power step after the restart.  Member 7's 17000 columns make the chunk's fold grid more
  -- than a wave (546 blocks against 4 x 132), so its START and POWER folds are the FOLD_PACKED instances.
  cuda_it("zero gradients, zero rows and columns, a zero u (its first value) and a u orthogonal to X's rows "
          .. "(the restart), one or two power steps, a fold grid of one wave or more: the CPU's results, no NaN",
          function()
    for _, sn in ipairs { 1, 2 } do
      for _, mode in ipairs { "base", "spectral", "sphere" } do
        for _, many in ipairs { false, true } do
          local members = { { shape = { 64, 128 }, dt = "bf16" }, { shape = { 40, 256 }, dt = "f32" },
                            { shape = { 1, 2 }, dt = "f32" }, { shape = { 16, 16 }, dt = "f16" },
                            { shape = { 300, 600 }, dt = "f32" }, { shape = { 260, 520 }, dt = "bf16" } }
          if many then members[7] = { shape = { 3, 17000 }, dt = "f32" } end
          local cm, gm = group(members, mode)
          -- member 1: rows 3..9 and columns 5..20 zero; member 2: all zero; member 3: G = [a, a] and u = [b, -b]
          local g1 = vals(cm[1].g)
          for i = 3, 9 do for j = 1, 128 do g1[(i - 1) * 128 + j] = 0 end end
          for i = 1, 64 do for j = 5, 20 do g1[(i - 1) * 128 + j] = 0 end end
          cm[1].g:copy_(ms.tensor(g1):view(64, 128):to("bf16"))
          cm[2].g:zero_()
          local a, b = 0.3 + math.random(), 0.2 + math.random()
          cm[3].g:copy_(ms.tensor({ { a, a } }))
          if cm[3].u then cm[3].u:copy_(ms.tensor({ b, -b })) end
          if cm[4].u then cm[4].u:zero_() end
          restarting(cm[5], 300, 600)    -- members 5 and 6: u orthogonal to X's rows, larger
          restarting(cm[6], 260, 520)
          for k, mb in ipairs(cm) do
            gm[k].g:copy_(gpu(mb.g))
            if mb.u then gm[k].u:copy_(gpu(mb.u)) end
          end
          step_and_compare(cm, gm, { mode = mode, iters = 5, sn_iters = sn, lr = 0.1 }, nil,
                           ("%s zeros, %d power steps%s"):format(mode, sn, many and ", many folds" or ""))
          assert_no_nan(gm, mode)
        end
      end
    end
  end)

  -- a row (column) of G 1e-20 of the rest: the eps clamp lets its r (c) grow 1e8-fold an iteration until it
  -- normalises the row, to ~1e20, whose square overflows f32.  r^2 G^2 and G^2 c^2 made every element of the matrix
  -- NaN; scaled before the square, as the CPU and the generic path do ((G c)^2, (r G)^2), they give the CPU's step.
  -- A row, a column and both, on the fast path's maps (lanes within a warp, K = 1; across warps; idle threads past
  -- the last lane) under K = 2 and 4 forced, row pairs, f32 K = 8 and the wide path.
  cuda_it("a row or a column of G 1e-20 of the rest: the CPU's results, no NaN, on every sweep path, every mode",
          function()
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local specs = { { shape = { 64, 256 }, gdt = "bf16", pdt = "bf16", row = 1 },
                    { shape = { 48, 512 }, gdt = "f32", pdt = "bf16", col = 6 },
                    { shape = { 96, 24 }, gdt = "bf16", pdt = "f32", row = 5, col = 17 },
                    { shape = { 40, 2056 }, gdt = "bf16", pdt = "bf16", col = 2050 },
                    { shape = { 33, 4096 }, gdt = "bf16", pdt = "bf16", row = 33, col = 1 },
                    { shape = { 6, 20000 }, gdt = "bf16", pdt = "bf16", row = 3 },
                    { shape = { 5, 9000 }, gdt = "f32", pdt = "bf16", row = 2 },
                    { shape = { 8, 40000 }, gdt = "bf16", pdt = "f32", row = 4 },
                    { shape = { 6, 16400 }, gdt = "f32", pdt = "bf16", col = 8 } }
    for _, kforce in ipairs { "2", "4" } do
      ffi.C.setenv("MOONSTEP_SINKGD_K", kforce, 1)
      local good, err = pcall(function()
        for _, mode in ipairs { "base", "spectral", "sphere" } do
          local cm, gm = group(specs, mode)
          for k, s in ipairs(specs) do
            local m, n = s.shape[1], s.shape[2]
            local g = vals(cm[k].g)
            if s.row then for j = 1, n do g[(s.row - 1) * n + j] = g[(s.row - 1) * n + j] * 1e-20 end end
            if s.col then for i = 1, m do g[(i - 1) * n + s.col] = g[(i - 1) * n + s.col] * 1e-20 end end
            cm[k].g:copy_(ms.tensor(g):view(m, n):to(s.gdt))
            gm[k].g:copy_(gpu(cm[k].g))
          end
          local what = ("%s K = %s, a tiny row or column"):format(mode, kforce)
          step_and_compare(cm, gm, step_options(mode), nil, what)
          assert_no_nan(gm, what)
        end
      end)
      ffi.C.unsetenv("MOONSTEP_SINKGD_K")
      assert(good, err)
    end
  end)

  cuda_it("gradients 1e30 times larger: NaN for the matrices whose f32 squares overflow, the CPU's results for "
          .. "the others in the same call; 1e-15 times smaller: the CPU's results; every thread map, every mode",
          function()
    -- the CPU sums in f64, where the update of 1e30 * G is G's; CUDA's f32 sums of (G c)^2 overflow beyond ~1.8e19
    -- (1e20 left a row of a few small random values below it now and then), and such a matrix must come out NaN
    -- (as for a NaN gradient), never as a finite update that leaves the
    -- overflowing row out.  Tiny gradients meet the eps clamp of the norms on both backends (1e-15: their f32 squares
    -- stay in range; see moonstep.h for squares that underflow).
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      for _, scale in ipairs { "huge", "tiny" } do
        local cm, gm = group(PATHS, mode)
        local rest_c, rest_g, big = {}, {}, {}
        for k, mb in ipairs(cm) do
          -- huge: the first row of every other 2-D member (f16 cannot hold 1e30)
          local huge = scale == "huge" and k % 2 == 1 and mb.g:dtype() ~= "f16" and #mb.shape == 2
          if scale == "tiny" or huge then
            local g = mb.g:to("f32"):contiguous()
            local rows = huge and g:slice(0, 0, 1) or g
            rows:copy_(ms.mul(rows, huge and 1e30 or 1e-15))
            g = g:to(mb.g:dtype())
            mb.g:copy_(g)
            gm[k].g:copy_(gpu(g))
          end
          if huge then big[#big + 1] = gm[k] else rest_c[#rest_c + 1], rest_g[#rest_g + 1] = mb, gm[k] end
        end
        -- one GPU call of every member (the overflowing ones last), the rest compared with the CPU's
        local all_g = {}
        for _, mb in ipairs(rest_g) do all_g[#all_g + 1] = mb end
        for _, mb in ipairs(big) do all_g[#all_g + 1] = mb end
        local what = ("%s, gradients %s"):format(mode, scale)
        step_and_compare(rest_c, all_g, step_options(mode), nil, what)
        assert_no_nan(rest_g, what)
        for k, mb in ipairs(big) do
          for i, x in ipairs(vals(mb.p)) do
            assert(x ~= x, ("%s: overflowing member %d element %d is %s, not NaN"):format(what, k, i, x))
          end
        end
        assert.is_true(#big >= (scale == "huge" and 8 or 0))
      end
    end
  end)

  cuda_it("a NaN in one matrix's gradient makes that matrix NaN, as on the CPU, and leaves the others alone",
          function()
    for _, mode in ipairs { "base", "spectral" } do
      local cm, gm = group({ { shape = { 2, 32, 256 }, dt = "bf16" }, { shape = { 50, 70 }, dt = "f32" } }, mode)
      local g = vals(cm[1].g)
      g[5] = 0 / 0   -- matrix 0 of member 1
      cm[1].g:copy_(ms.tensor(g):view(2, 32, 256):to("bf16"))
      gm[1].g:copy_(gpu(cm[1].g))
      step_and_compare(cm, gm, { mode = mode, lr = 0.1 }, nil, mode .. " NaN")
      local p = vals(gm[1].p)
      assert(p[1] ~= p[1], "matrix 0 of member 1 should be NaN")
      assert(p[32 * 256 + 1] == p[32 * 256 + 1], "matrix 1 of member 1 should not be NaN")
    end
  end)

  cuda_it("reads lr and step from device scalars; skip_t nonzero or NaN changes nothing, state included", function()
    local cm, gm = group({ { shape = { 128, 512 }, dt = "bf16" }, { shape = { 3, 20, 24 }, dt = "f32" } }, "sphere")
    local lr_c, step_c = ms.tensor({ 0.07 }), ms.tensor({ 2.4 })
    local lr_g, step_g = gpu(lr_c), gpu(step_c)
    local o_c = { mode = "sphere", lr_t = lr_c, step_t = step_c, stochastic_round = true, seed = 9 }
    local o_g = { mode = "sphere", lr_t = lr_g, step_t = step_g, stochastic_round = true, seed = 9 }
    local before = {}
    for k, mb in ipairs(cm) do before[k] = vals(mb.p) end
    ok(sinkgd_raw(CPU, cm, o_c))
    ok(sinkgd_raw(GPU, gm, o_g))
    for k, mb in ipairs(cm) do
      local want, got, maxupd = vals(mb.p), vals(gm[k].p), 0
      for i = 1, #want do maxupd = max(maxupd, abs(want[i] - before[k][i])) end
      assert(maxupd > 0, "the step moved nothing")
      assert_ulps(got, want, mb.dt, "device scalars member " .. k, 1, 1e-5 * maxupd)
      H.assert_close(vals(gm[k].t), vals(mb.t), 1e-6, 0, "t")
    end
    for _, skip in ipairs { 1, 0 / 0 } do
      local snap = {}
      for k, mb in ipairs(gm) do snap[k] = { p = vals(mb.p), u = vals(mb.u), t = vals(mb.t) } end
      fresh_grads(cm, gm)
      local o = { mode = "sphere", lr_t = lr_g, step_t = step_g, skip_t = gpu(ms.tensor({ skip })) }
      ok(sinkgd_raw(GPU, gm, o))
      for k, mb in ipairs(gm) do
        assert_same(vals(mb.p), snap[k].p, "skipped p")
        assert_same(vals(mb.u), snap[k].u, "skipped u")
        assert_same(vals(mb.t), snap[k].t, "skipped t")
      end
    end
  end)

  cuda_it("stochastic rounding of bf16 and f16 params: within an ulp of the CPU's, the same bits when repeated, "
          .. "and unlike round-to-nearest", function()
    for _, dt in ipairs { "bf16", "f16" } do
      local cm, gm = group({ { shape = { 256, 512 }, dt = dt }, { shape = { 17, 40 }, dt = dt } }, "base")
      local start = {}
      for k, mb in ipairs(gm) do start[k] = mb.p:clone() end
      local o = { lr = 0.01, step = 3, seed = 77, stochastic_round = true }
      step_and_compare(cm, gm, o, nil, dt .. " SR")
      local first = {}
      for k, mb in ipairs(gm) do first[k] = vals(mb.p) mb.p:copy_(start[k]) end
      ok(sinkgd_raw(GPU, gm, o))
      for k, mb in ipairs(gm) do assert_same(vals(mb.p), first[k], dt .. " SR repeated member " .. k) end
      for k, mb in ipairs(gm) do mb.p:copy_(start[k]) end
      o.stochastic_round = false
      ok(sinkgd_raw(GPU, gm, o))
      local differ = 0
      local rne = vals(gm[1].p)
      for i = 1, #rne do if rne[i] ~= first[1][i] then differ = differ + 1 end end
      assert(differ > #rne / 20, ("%s: only %d of %d elements differ from round-to-nearest"):format(dt, differ, #rne))
    end
  end)

  cuda_it("is bitwise reproducible: the same call twice gives the same params, u and radius", function()
    local cm, gm = group({ { shape = { 2000, 512 }, dt = "bf16" }, { shape = { 4, 14336 }, dt = "bf16" },
                           { shape = { 300, 300 }, dt = "f32" } }, "sphere")
    local start = {}
    for k, mb in ipairs(gm) do start[k] = { p = mb.p:clone(), u = mb.u:clone(), t = mb.t:clone() } end
    local o = { mode = "sphere", sn_iters = 2, lr = 0.02 }
    ok(sinkgd_raw(GPU, gm, o))
    local first = {}
    for k, mb in ipairs(gm) do
      first[k] = { p = vals(mb.p), u = vals(mb.u), t = vals(mb.t) }
      mb.p:copy_(start[k].p)
      mb.u:copy_(start[k].u)
      mb.t:copy_(start[k].t)
    end
    ok(sinkgd_raw(GPU, gm, o))
    for k, mb in ipairs(gm) do
      assert_same(vals(mb.p), first[k].p, "p " .. k)
      assert_same(vals(mb.u), first[k].u, "u " .. k)
      assert_same(vals(mb.t), first[k].t, "t " .. k)
    end
  end)

  cuda_it("updates a 300-matrix group in two launch sequences (224 matrices a table) with the CPU's results; "
          .. "2 L + 2 launches a sequence in base mode, 2 L + 4 spectral, 2 L + 5 sphere (one writes the launch tables; "
          .. "a restart is the power fold's, no launch of its own)",
          function()
    local CAP = 224
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      local cm, gm = group({ { shape = { 250, 12, 16 }, dt = "bf16" }, { shape = { 50, 8, 8 }, dt = "f32" } }, mode)
      local st, n = sinkgd_raw(GPU, gm, { mode = mode, iters = 4, sn_iters = 1 })
      ok(st)
      local per = ({ base = 2 * 4 + 2, spectral = 2 * 4 + 4, sphere = 2 * 4 + 5 })[mode]
      assert.equals(2 * per, n, mode .. " launches for 300 matrices")
      cm, gm = group({ { shape = { 5, 12, 16 }, dt = "bf16" } }, mode)
      st, n = sinkgd_raw(GPU, gm, { mode = mode, iters = 4 })
      ok(st)
      assert.equals(per, n, mode .. " launches for 5 matrices")
      cm, gm = group({ { shape = { 250, 12, 16 }, dt = "bf16" }, { shape = { 50, 8, 8 }, dt = "f32" } }, mode)
      step_and_compare(cm, gm, { mode = mode, iters = 4, lr = 0.05 }, nil, mode .. " 300 matrices")
    end
    assert(CAP < 300)
  end)

  cuda_it("captures a spectral step in a graph that replays with new device-scalar lr and step values; the "
          .. "scratch comes from the pool's cache (no driver allocation after the first step)", function()
    local ctx = ms.context { device = "cuda" }
    local cm = {}
    local specs = { { shape = { 512, 1024 }, dt = "bf16" }, { shape = { 3, 64, 96 }, dt = "f32" } }
    local gm = {}
    for k, s in ipairs(specs) do
      local c = twin(s, "spectral", k)
      cm[k] = c
      gm[k] = { p = c.p:to(ctx), g = c.g:to(ctx), u = c.u:to(ctx), dt = c.dt, shape = c.shape }
    end
    local lr_t, step_t = ms.full({ 1 }, 0.01, { ctx = ctx }), ms.full({ 1 }, 1, { ctx = ctx })
    local o = { mode = "spectral", target = "muon", lr_t = lr_t, step_t = step_t }
    ok(sinkgd_raw(ctx, gm, o))   -- the first call sets the counters up and leaves the scratch in the cache
    ok(sinkgd_raw(CPU, cm, { mode = "spectral", target = "muon", lr = 0.01 }))
    local allocs = ctx:mem_stats().num_device_allocs
    ok(sinkgd_raw(ctx, gm, o))
    ok(sinkgd_raw(CPU, cm, { mode = "spectral", target = "muon", lr = 0.01 }))
    assert.equals(allocs, ctx:mem_stats().num_device_allocs, "driver allocations in a second step")
    local gr = graph.capture(ctx, function() ok(sinkgd_raw(ctx, gm, o, nil, true)) end)
    for k, lr in ipairs { 0.02, 0.005 } do
      lr_t:fill_(lr)
      step_t:fill_(k + 2)
      local before = {}
      for j, mb in ipairs(cm) do   -- each replay from the CPU's state (see step_and_compare); same tensors, in place
        before[j] = vals(mb.p)
        gm[j].p:copy_(mb.p:to(ctx))
        gm[j].u:copy_(mb.u:to(ctx))
      end
      gr:launch()
      ok(sinkgd_raw(CPU, cm, { mode = "spectral", target = "muon", lr = lr, step = k + 2 }))
      for j, mb in ipairs(cm) do
        local want, got, maxupd = vals(mb.p), vals(gm[j].p), 0
        for i = 1, #want do maxupd = max(maxupd, abs(want[i] - before[j][i])) end
        assert_ulps(got, want, mb.dt, "replay " .. k .. " member " .. j, 1, 1e-5 * maxupd)
        H.assert_close(vals(gm[j].u), vals(mb.u), 1e-4, 1e-5, "replay u")
      end
    end
    gr:free()
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- 8-bit AdamW
-- ---------------------------------------------------------------------------------------------------
local function adamw8_raw(ctx, members, o)
  local P, G, CM, SM, CV, SV = {}, {}, {}, {}, {}, {}
  for k, mb in ipairs(members) do P[k], G[k], CM[k], SM[k], CV[k], SV[k] = mb.p, mb.g, mb.cm, mb.sm, mb.cv, mb.sv end
  local c = A.adamw8_options(o)
  local n0 = launches(ctx)
  local st = C.ms_adamw8_step(T.handle_ctx(ctx), #members, handles(P), handles(G, true), handles(CM), handles(SM),
                              handles(CV), handles(SV), doubles(o.scales, #members), c)
  return st, launches(ctx) - n0
end

-- a CPU member with random state and its GPU twin (grad: "transposed" makes the GPU's a transposed view)
local function twin8(shape, dt, block, grad)
  local numel = 1
  for _, d in ipairs(shape) do numel = numel * d end
  local c = { p = randn(shape, dt), cm = ms.zeros(shape, { dtype = "u8" }), cv = ms.zeros(shape, { dtype = "u8" }),
              sm = ms.zeros({ numel / block }), sv = ms.zeros({ numel / block }), dt = dt }
  c.cm:copy_(urand(shape, 0, 256))
  c.cv:copy_(urand(shape, 0, 256))
  c.sm:copy_(urand({ numel / block }, 0.01, 1))
  c.sv:copy_(urand({ numel / block }, 0.001, 0.1))
  local g = { p = gpu(c.p), cm = gpu(c.cm), cv = gpu(c.cv), sm = gpu(c.sm), sv = gpu(c.sv), dt = dt, grad = grad }
  return c, g
end

local function grads8(cm, gm)
  for k, mb in ipairs(cm) do
    local shape = mb.p:shape()
    if gm[k].grad == "transposed" then
      local base = randn({ shape[2], shape[1] }, "f32", GPU)
      gm[k].g = base:t()
      mb.g = gm[k].g:to(CPU):contiguous()
    else
      mb.g = randn(shape, "f32")
      gm[k].g = gpu(mb.g)
    end
  end
end

local function compare8(cm, gm, what, ulps)
  for k, mb in ipairs(cm) do
    if ulps then assert_ulps(vals(gm[k].p), vals(mb.p), mb.dt, what .. " param " .. k, ulps)
    else assert_same(vals(gm[k].p), vals(mb.p), what .. " param " .. k) end
    local a, b, differ = vals(gm[k].cm), vals(mb.cm), 0
    for i = 1, #a do if a[i] ~= b[i] then differ = differ + 1 assert(abs(a[i] - b[i]) == 1, "codes differ by more than one") end end
    local a2, b2 = vals(gm[k].cv), vals(mb.cv)
    for i = 1, #a2 do if a2[i] ~= b2[i] then differ = differ + 1 assert(abs(a2[i] - b2[i]) == 1, "codes differ by more than one") end end
    if ulps then assert(differ <= #a / 500, differ .. " codes differ")
    else assert.equals(0, differ, what .. " codes of member " .. k) end
    if ulps then
      H.assert_close(vals(gm[k].sm), vals(mb.sm), 1e-6, 0, what .. " exp_avg scales")
      H.assert_close(vals(gm[k].sv), vals(mb.sv), 1e-6, 0, what .. " exp_avg_sq scales")
    else
      assert_same(vals(gm[k].sm), vals(mb.sm), what .. " exp_avg scales " .. k)
      assert_same(vals(gm[k].sv), vals(mb.sv), what .. " exp_avg_sq scales " .. k)
    end
  end
end

describe("cuda ms_adamw8_step", function()
  cuda_it("the CPU's bits: f32, bf16 and f16 params, block sizes 32, 256 and 4096, a transposed grad, weight "
          .. "decay and per-member scales, host lr and step, over three steps", function()
    for _, block in ipairs { 32, 256, 4096 } do
      local cm, gm = {}, {}
      local specs = { { { 64, 128 }, "bf16" }, { { 32, 256 }, "f32", "transposed" }, { { 8192 }, "f16" },
                      { { 16, 512 }, "bf16", "transposed" } }
      for k, s in ipairs(specs) do cm[k], gm[k] = twin8(s[1], s[2], block, s[3]) end
      for step = 1, 3 do
        grads8(cm, gm)
        local o = { lr = 0.01, step = step, block_size = block, weight_decay = 0.05, scales = { 1, 0.5, 2, 0.25 } }
        ok(adamw8_raw(CPU, cm, o))
        ok(adamw8_raw(GPU, gm, o))
        compare8(cm, gm, ("block %d step %d"):format(block, step))
      end
    end
  end)

  cuda_it("device lr and step (bias corrections from CUDA's pow: params within an ulp), stochastic rounding, "
          .. "and skip_t nonzero or NaN changing nothing", function()
    local cm, gm = {}, {}
    for k, dt in ipairs { "bf16", "f16", "f32" } do cm[k], gm[k] = twin8({ 64, 64 }, dt, 256) end
    grads8(cm, gm)
    local o_c = { lr_t = ms.tensor({ 0.02 }), step_t = ms.tensor({ 5 }), stochastic_round = true, seed = 3 }
    local o_g = { lr_t = gpu(o_c.lr_t), step_t = gpu(o_c.step_t), stochastic_round = true, seed = 3 }
    ok(adamw8_raw(CPU, cm, o_c))
    ok(adamw8_raw(GPU, gm, o_g))
    compare8(cm, gm, "device scalars + SR", 1)
    for _, skip in ipairs { 1, 0 / 0 } do
      local snap = {}
      for k, mb in ipairs(gm) do snap[k] = { vals(mb.p), vals(mb.cm), vals(mb.sm), vals(mb.cv), vals(mb.sv) } end
      grads8(cm, gm)
      o_g.skip_t = gpu(ms.tensor({ skip }))
      ok(adamw8_raw(GPU, gm, o_g))
      for k, mb in ipairs(gm) do
        local now = { vals(mb.p), vals(mb.cm), vals(mb.sm), vals(mb.cv), vals(mb.sv) }
        for q = 1, 5 do assert_same(now[q], snap[k][q], "skipped member " .. k .. " part " .. q) end
      end
    end
  end)

  cuda_it("updates 300 members in two launches (224 a table) with the CPU's bits", function()
    local cm, gm = {}, {}
    for k = 1, 300 do cm[k], gm[k] = twin8({ 256 + 256 * (k % 3) }, k % 2 == 0 and "bf16" or "f32", 256) end
    grads8(cm, gm)
    local o = { lr = 0.003, step = 2, block_size = 256 }
    ok(adamw8_raw(CPU, cm, o))
    local st, n = adamw8_raw(GPU, gm, o)
    ok(st)
    assert.equals(2, n)
    compare8(cm, gm, "300 members")
  end)
end)
