-- The CUDA multi-tensor optimizer kernels (kernels/optim.cu) against the CPU backend (engine/cpu/optim.c) on the
-- same fresh random inputs, through the C ABI: ms_adamw_step and ms_sgd_step for every param dtype (f32, bf16,
-- f16, f64) with f32 and bf16 state, transposed, bf16 and 3-D permuted grads, unaligned and empty members, host
-- and device lr/step, skip_t and stochastic rounding; ms_foreach_sumsq and ms_foreach_scale; the launch count of
-- large groups; graph capture; and the runtime (ms.optim) on CUDA, resumed bit for bit from a checkpoint.
-- The kernels do the CPU's arithmetic in its order, correctly rounded, so results are compared bit for bit; only
-- the bias corrections a kernel computes from a device step_t (CUDA's pow, not glibc's) may move a param by an
-- ulp.  Every spec is a cuda_it: pending where no GPU is present.
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local graph = require("moonstep.graph")
local ffi, C = core.ffi, core.C

local cuda_it = H.cuda_it
local GPU = H.has_cuda and ms.device("cuda") or nil
local CPU = ms.device("cpu")
local NaN, inf = 0 / 0, math.huge
local FLOATS = { "f32", "bf16", "f16", "f64" }
local CAP = 320   -- members per launch (kernels/msk.h, MSK_OPTIM_CAP)

-- ---------------------------------------------------------------------------------------------------
-- raw calls
-- ---------------------------------------------------------------------------------------------------
local A = dofile("tests/abi.lua")
local h, doubles, adamw_opts, sgd_opts = A.h, A.doubles, A.adamw_options, A.sgd_options
local function tensors(list, ro) return A.handles(list, ro) end

local function launches(ctx) return ctx:mem_stats().launches end

local ok = A.ok

-- g = {params=, grads=, m=, v=, scales=} on ctx; returns the status and the launches the engine counted
local function adamw_raw(ctx, g, o)
  local args = { tensors(g.params), tensors(g.grads, true), tensors(g.m), tensors(g.v), doubles(g.scales), adamw_opts(o) }
  local n0 = launches(ctx)
  local st = C.ms_adamw_step(T.handle_ctx(ctx), #g.params, unpack(args, 1, 6))
  return st, launches(ctx) - n0
end

-- g = {params=, grads=, m= (the momentum buffers, or nil), scales=}
local function sgd_raw(ctx, g, o)
  local args = { tensors(g.params), tensors(g.grads, true), g.m and tensors(g.m) or nil, doubles(g.scales), sgd_opts(o) }
  local n0 = launches(ctx)
  local st = C.ms_sgd_step(T.handle_ctx(ctx), #g.params, unpack(args, 1, 5))
  return st, launches(ctx) - n0
end

local function sumsq_raw(ctx, dst, srcs)
  local n0 = launches(ctx)
  local st = C.ms_foreach_sumsq(T.handle_ctx(ctx), h(dst), #srcs, tensors(srcs, true))
  return st, launches(ctx) - n0
end

local function scale_raw(ctx, list, s, s_t)
  local n0 = launches(ctx)
  local st = C.ms_foreach_scale(T.handle_ctx(ctx), #list, tensors(list), s, h(s_t))
  return st, launches(ctx) - n0
end

-- ---------------------------------------------------------------------------------------------------
-- inputs: fresh random values on the CPU, the same values (and the same layout) on the GPU
-- ---------------------------------------------------------------------------------------------------
local function rnd(shape, dt, std) return ms.randn(shape, { dtype = dt or "f32", seed = H.seed(), std = std or 1 }) end
local function urnd(shape, dt, lo, hi) return ms.rand(shape, { dtype = dt or "f32", seed = H.seed(), low = lo, high = hi }) end
local function on_gpu(t) return t:to(GPU) end
local function unit_rand() return ms.rand({ 1 }, { dtype = "f64", seed = H.seed() }):item() end

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- a CPU tensor of `shape` and its GPU twin, built by gen(shape, dt) in a layout:
--   nil          contiguous
--   "transposed" a view with the first and last dims swapped (2+ dims)
--   "permuted"   a 3-D view with every dim reversed: three strided dims, which no two-dim layout describes
--   "offset"     1-D, starting one element into a buffer (so not 16-byte aligned)
local function pair(shape, dt, layout, gen)
  if layout == "transposed" then
    local sw = {}
    for i = 1, #shape do sw[i] = shape[i] end
    sw[1], sw[#shape] = shape[#shape], shape[1]
    local base = gen(sw, dt)
    return base:transpose(0, #shape - 1), on_gpu(base):transpose(0, #shape - 1)
  elseif layout == "permuted" then
    local base = gen({ shape[3], shape[2], shape[1] }, dt)
    return base:permute(2, 1, 0), on_gpu(base):permute(2, 1, 0)
  elseif layout == "offset" then
    local n = numel(shape)
    local base = gen({ n + 1 }, dt)
    return base:slice(0, 1, n + 1), on_gpu(base):slice(0, 1, n + 1)
  end
  local t = gen(shape, dt)
  return t, on_gpu(t)
end

local function normal(std) return function(s, d) return rnd(s, d, std) end end
local function uniform(lo, hi) return function(s, d) return urnd(s, d, lo, hi) end end

-- the members of a step group: small with a partial last group, several tiles with a transposed grad, a bf16
-- grad, an empty member, a grad no two-dim layout describes (copied to a temporary: one counted launch), and
-- an unaligned member (element loads instead of 16-byte ones)
local MEMBERS = {
  { shape = { 37 } },
  { shape = { 129, 67 }, grad = "transposed" },
  { shape = { 3, 4, 5 }, gdt = "bf16" },
  { shape = { 0, 5 } },
  { shape = { 6, 5, 7 }, grad = "permuted" },
  { shape = { 1001 }, layout = "offset" },
}
local EXTRA_COPIES = 1   -- the permuted grad

-- a step group on the CPU and its twin on the GPU; nstate = 2 (AdamW), 1 (SGD momentum) or 0
local function step_group(pdt, sdt, nstate, members)
  members = members or MEMBERS
  local c, g = { params = {}, scales = {}, members = members }, { params = {}, scales = {}, members = members }
  if nstate >= 1 then c.m, g.m = {}, {} end
  if nstate >= 2 then c.v, g.v = {}, {} end
  for i, mb in ipairs(members) do
    c.params[i], g.params[i] = pair(mb.shape, pdt, mb.layout, normal(1))
    if nstate >= 1 then c.m[i], g.m[i] = pair(mb.shape, sdt, mb.layout, normal(0.1)) end
    if nstate >= 2 then c.v[i], g.v[i] = pair(mb.shape, sdt, mb.layout, uniform(0.01, 1)) end
    c.scales[i] = 0.5 + 1.5 * unit_rand()
    g.scales[i] = c.scales[i]
  end
  return c, g
end

local function fresh_grads(c, g)
  c.grads, g.grads = {}, {}
  for i, mb in ipairs(c.members) do
    c.grads[i], g.grads[i] = pair(mb.shape, mb.gdt or "f32", mb.grad, normal(1))
  end
end

-- ---------------------------------------------------------------------------------------------------
-- comparisons
-- ---------------------------------------------------------------------------------------------------
local function vals(t) return t:tolist_flat() end

local assert_same = H.assert_same

local function assert_same_tensors(gl, cl, what)
  for i = 1, #cl do assert_same(vals(gl[i]), vals(cl[i]), ("%s, member %d"):format(what, i)) end
end

-- one unit in the last place of dtype dt at w (the spacing of the binade w lies in; subnormal spacing below)
local MANT = { f64 = 52, f32 = 23, bf16 = 7, f16 = 10 }
local EMIN = { f64 = -1022, f32 = -126, bf16 = -126, f16 = -14 }
local function ulp(w, dt)
  local _, e = math.frexp(w)          -- |w| in [2^(e-1), 2^e)
  e = math.max(e - 1, EMIN[dt])
  return 2 ^ (e - MANT[dt])
end

-- |got - want| <= k ulps of dt (at want) + atol; NaN only matching NaN
local function assert_ulps(got, want, dt, k, atol, what)
  assert(#got == #want, ("%s: %d values, expected %d"):format(what, #got, #want))
  for j = 1, #want do
    local x, y = got[j], want[j]
    if y ~= y then
      assert(x ~= x, ("%s: element %d is %.17g, expected NaN"):format(what, j, x))
    else
      local tol = k * ulp(y, dt) + (atol or 0)
      if not (math.abs(x - y) <= tol) then
        error(("%s: element %d is %.17g on the GPU, %.17g on the CPU (more than %g ulp apart)"):format(what, j, x, y, k), 2)
      end
    end
  end
end

local function snapshot(list)
  local s = {}
  for i, t in ipairs(list) do s[i] = vals(t) end
  return s
end

-- ---------------------------------------------------------------------------------------------------
describe("cuda ms_adamw_step", function()
  for _, pdt in ipairs(FLOATS) do
    for _, sdt in ipairs { "f32", "bf16" } do
      cuda_it(("%s params, %s state, host lr and step: the CPU's bits over 3 steps, with and without bias correction "
               .. "and stochastic rounding"):format(pdt, sdt), function()
        local c, g = step_group(pdt, sdt, 2)
        local seed = H.seed()
        for k = 1, 3 do
          fresh_grads(c, g)
          local o = { lr = 0.01, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.05, step = k,
                      bias_correction = k ~= 2, stochastic_round = k >= 2, seed = seed }
          ok(adamw_raw(CPU, c, o))
          local st, nl = adamw_raw(GPU, g, o)
          ok(st)
          assert.equals(1 + EXTRA_COPIES, nl)   -- one kernel for the whole group, one copy of the permuted grad
          local what = ("%s/%s step %d"):format(pdt, sdt, k)
          assert_same_tensors(g.params, c.params, what .. " param")
          assert_same_tensors(g.m, c.m, what .. " exp_avg")
          assert_same_tensors(g.v, c.v, what .. " exp_avg_sq")
        end
      end)
    end
  end

  cuda_it("reads lr and step from device scalars (step rounded): the CPU's bits without bias correction, params "
          .. "within an ulp with it (the device's pow)", function()
    for _, pdt in ipairs(FLOATS) do
      for _, bias in ipairs { false, true } do
        local c, g = step_group(pdt, "f32", 2)
        fresh_grads(c, g)
        local lr_c, step_c = ms.tensor({ 0.01 }), ms.tensor({ 2.6 })   -- f32 device scalars
        local lr_g, step_g = on_gpu(lr_c), on_gpu(step_c)
        local o = { lr = -1, step = 0, weight_decay = 0.1, bias_correction = bias, stochastic_round = true, seed = 3 }
        o.lr_t, o.step_t = lr_c, step_c
        ok(adamw_raw(CPU, c, o))
        o.lr_t, o.step_t = lr_g, step_g
        ok(adamw_raw(GPU, g, o))
        local what = ("%s, bias_correction=%s"):format(pdt, tostring(bias))
        assert_same_tensors(g.m, c.m, what .. " exp_avg")       -- the moments do not see the bias corrections
        assert_same_tensors(g.v, c.v, what .. " exp_avg_sq")
        for i = 1, #c.params do
          if bias then
            assert_ulps(vals(g.params[i]), vals(c.params[i]), pdt, 1, pdt == "f64" and 1e-15 or 1e-7,
                        what .. " param " .. i)
          else
            assert_same(vals(g.params[i]), vals(c.params[i]), what .. " param " .. i)
          end
        end
      end
    end
  end)

  cuda_it("changes nothing, bit for bit, when skip_t is nonzero or NaN (still one launch), and steps when it is 0",
          function()
    local members = { { shape = { 300 } }, { shape = { 17, 9 }, grad = "transposed" } }
    local c, g = step_group("bf16", "f32", 2, members)
    fresh_grads(c, g)
    local all = {}
    for i = 1, #g.params do all[#all + 1] = g.params[i]; all[#all + 1] = g.m[i]; all[#all + 1] = g.v[i] end
    local snap = snapshot(all)
    local o = { lr = 0.1, step = 4, weight_decay = 0.1, stochastic_round = true, seed = 9 }
    for _, v in ipairs { 1, NaN, -2 } do
      o.skip_t = ms.tensor({ v }, { device = "cuda" })
      local st, nl = adamw_raw(GPU, g, o)
      ok(st)
      assert.equals(1, nl)   -- the device decides: no host synchronisation
      for i, t in ipairs(all) do assert_same(vals(t), snap[i], ("skip_t = %s: tensor %d"):format(tostring(v), i)) end
      local sst, snl = sgd_raw(GPU, { params = g.params, grads = g.grads, m = g.m, scales = g.scales },
                               { lr = 0.1, momentum = 0.9, step = 3, skip_t = o.skip_t })
      ok(sst)
      assert.equals(1, snl)
      for i, t in ipairs(all) do assert_same(vals(t), snap[i], ("sgd skip_t = %s: tensor %d"):format(tostring(v), i)) end
    end
    o.skip_t = ms.tensor({ 0 }, { device = "cuda" })
    ok(adamw_raw(GPU, g, o))
    o.skip_t = ms.tensor({ 0 })
    ok(adamw_raw(CPU, c, o))
    assert.is_false(pcall(assert_same, vals(g.params[1]), snap[1], "moved"))
    assert_same_tensors(g.params, c.params, "skip_t = 0 param")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda ms_sgd_step", function()
  for _, pdt in ipairs(FLOATS) do
    cuda_it(("%s params: the CPU's bits over 3 steps without momentum, with momentum, dampening and weight decay "
             .. "(f32 buffer), and nesterov (bf16 buffer); stochastic rounding on the last step"):format(pdt), function()
      for _, cfg in ipairs {
        { momentum = 0, weight_decay = 0, nstate = 0 },
        { momentum = 0.9, dampening = 0.1, weight_decay = 0.01, nstate = 1, sdt = "f32" },
        { momentum = 0.8, nesterov = true, weight_decay = 0, nstate = 1, sdt = "bf16" },
      } do
        local c, g = step_group(pdt, cfg.sdt or "f32", cfg.nstate)
        local seed = H.seed()
        for k = 1, 3 do
          fresh_grads(c, g)
          local o = { lr = 0.05, momentum = cfg.momentum, dampening = cfg.dampening, weight_decay = cfg.weight_decay,
                      nesterov = cfg.nesterov, step = k, stochastic_round = k == 3, seed = seed }
          ok(sgd_raw(CPU, c, o))
          local st, nl = sgd_raw(GPU, g, o)
          ok(st)
          assert.equals(1 + EXTRA_COPIES, nl)
          local what = ("%s momentum=%g step %d"):format(pdt, cfg.momentum, k)
          assert_same_tensors(g.params, c.params, what .. " param")
          if g.m then assert_same_tensors(g.m, c.m, what .. " momentum_buf") end
        end
      end
    end)
  end

  cuda_it("reads lr and step from device scalars: the first step (step_t <= 1) initialises the buffer on the device; "
          .. "the CPU's bits", function()
    for _, stepv in ipairs { 1, 1.4, 2, 5 } do
      local c, g = step_group("f32", "f32", 1)
      fresh_grads(c, g)
      local lr_c, step_c = ms.tensor({ 0.03 }), ms.tensor({ stepv })
      local o = { lr = -1, step = 0, momentum = 0.9, dampening = 0.2, weight_decay = 0.01, lr_t = lr_c, step_t = step_c }
      ok(sgd_raw(CPU, c, o))
      o.lr_t, o.step_t = on_gpu(lr_c), on_gpu(step_c)
      ok(sgd_raw(GPU, g, o))
      assert_same_tensors(g.params, c.params, "step_t " .. stepv .. " param")
      assert_same_tensors(g.m, c.m, "step_t " .. stepv .. " momentum_buf")
    end
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda stochastic rounding", function()
  -- SGD with lr = 1 and no momentum or weight decay computes p - 1 * g, one correctly rounded f32 operation on
  -- either backend, so both round the same f32 values: the lo/hi choice itself is compared, bit for bit.
  for _, case in ipairs { { "bf16", 1 }, { "f16", 1 }, { "f16", 2e-5 } } do
    local dt, scale = case[1], case[2]
    cuda_it(("%s params (|p| ~ %g%s): the CPU's lo/hi choice bit for bit, for every member and step, host or device "
             .. "step"):format(dt, scale, scale < 1e-4 and ", f16 subnormals" or ""), function()
      local members = { { shape = { 4099 } }, { shape = { 0 } }, { shape = { 4099 } }, { shape = { 33, 65 }, grad = "transposed" } }
      local c, g = step_group(dt, "f32", 0, members)
      c.scales, g.scales = nil, nil   -- lr 1 exactly
      for i = 1, #members do   -- params of magnitude ~scale, grads ~1% of that: the result falls between grid points
        c.params[i]:copy_(c.params[i]:to("f32") * scale)
        g.params[i]:copy_(c.params[i])
      end
      c.grads, g.grads = {}, {}
      for i, mb in ipairs(members) do
        c.grads[i], g.grads[i] = pair(mb.shape, "f32", mb.grad, normal(0.01 * scale))
      end
      local nearest = {}
      for i = 1, #members do nearest[i] = c.params[i]:clone() end
      ok(sgd_raw(CPU, { params = nearest, grads = c.grads }, { lr = 1, step = 7 }))
      local seed = H.seed()
      local o = { lr = 1, step = 7, stochastic_round = true, seed = seed }
      ok(sgd_raw(CPU, c, o))
      o.step, o.step_t = 0, ms.tensor({ 7.4 }, { device = "cuda" })   -- rounded to 7 on the device
      ok(sgd_raw(GPU, g, o))
      assert_same_tensors(g.params, c.params, dt .. " stochastically rounded param")
      -- not a trivial agreement: against round-to-nearest some elements went the other way, most did not
      local other, total = 0, 0
      for i = 1, #members do
        local a, b = vals(c.params[i]), vals(nearest[i])
        for j = 1, #a do
          total = total + 1
          if a[j] ~= b[j] then other = other + 1 end
        end
      end
      assert(other > total / 50 and other < total / 2, ("%d of %d elements rounded away from nearest"):format(other, total))
      -- members 1 and 3 had the same draw counters but for the member word: different bits
      assert.is_false(pcall(assert_same, vals(g.params[1]), vals(g.params[3]), "members"))
    end)
  end
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda foreach", function()
  -- the sources of a sumsq or scale group: several chunks and tiles, every dtype, strided, expanded, empty
  local function sources()
    local list = {
      { { 700, 300 }, "f32" },                  -- 52 chunks of 4096: two tiles of 32 chunks
      { { 37 }, "bf16" },
      { { 4099 }, "f16" },
      { { 65, 129 }, "f64" },
      { { 300, 513 }, "f32", "transposed" },    -- a strided source over two tiles
      { { 4, 5, 6 }, "f32", "permuted" },       -- copied to a contiguous temporary
      { { 0 }, "f32" },
      { { 1001 }, "bf16", "offset" },
    }
    local c, g = {}, {}
    for i, s in ipairs(list) do c[i], g[i] = pair(s[1], s[2], s[3], normal(1)) end
    return c, g
  end

  cuda_it("foreach_sumsq: the CPU's sums bit for bit (every dtype, several chunks and tiles, strided, expanded, "
          .. "permuted, empty, one element), f32 and f64 dst, deterministic, one launch", function()
    local c, g = sources()
    local e = rnd({ 1, 7 })
    c[#c + 1], g[#g + 1] = e:expand(5, 7), on_gpu(e):expand(5, 7)   -- stride 0
    c[#c + 1], g[#g + 1] = ms.tensor(2.5), ms.tensor(2.5, { device = "cuda" })
    for _, ddt in ipairs { "f32", "f64" } do
      local dc, dg = ms.empty({ #c }, { dtype = ddt }), ms.empty({ #g }, { dtype = ddt, device = "cuda" })
      ok(sumsq_raw(CPU, dc, c))
      local st, nl = sumsq_raw(GPU, dg, g)
      ok(st)
      assert.equals(2, nl)   -- one kernel, one copy of the permuted source
      local want = vals(dc)
      assert_same(vals(dg), want, "sums into " .. ddt)
      assert.equals(0, want[7])
      assert.equals(6.25, want[#want])
      local again = ms.empty({ #g }, { dtype = ddt, device = "cuda" })
      ok(sumsq_raw(GPU, again, g))
      assert_same(vals(again), vals(dg), "a second run")
    end
  end)

  cuda_it("foreach_sumsq: NaN or Inf in a member (or an overflowing square) makes that member's sum non-finite, "
          .. "only that one", function()
    local base = { rnd({ 200000 }), rnd({ 5000 }), rnd({ 3000 }), rnd({ 100 }, "bf16"), rnd({ 64, 64 }, "f64") }
    base[1]:slice(0, 150000, 150001):fill_(NaN)   -- in the second tile
    base[2]:slice(0, 4500, 4501):fill_(-inf)
    base[3]:slice(0, 7, 8):fill_(3e20)            -- finite, but its square overflows f32
    local c, g = {}, {}
    for i, t in ipairs(base) do c[i], g[i] = t, on_gpu(t) end
    local dc, dg = ms.empty({ #c }), ms.empty({ #g }, { device = "cuda" })
    ok(sumsq_raw(CPU, dc, c))
    ok(sumsq_raw(GPU, dg, g))
    local got = vals(dg)
    assert.is_true(got[1] ~= got[1])
    assert.equals(inf, got[2])
    assert.equals(inf, got[3])
    assert.is_true(got[4] == got[4] and got[4] < inf and got[5] == got[5] and got[5] < inf)
    assert_same(got, vals(dc), "sums")
  end)

  cuda_it("foreach_scale: in place, the CPU's bits (every dtype, strided, permuted, unaligned), host and device "
          .. "scalar", function()
    local c, g = sources()
    local st, nl = scale_raw(CPU, c, 0.37)
    ok(st)
    st, nl = scale_raw(GPU, g, 0.37)
    ok(st)
    assert.equals(1 + 2, nl)   -- one kernel, the permuted member copied out and back
    assert_same_tensors(g, c, "scaled by 0.37")
    local sc = ms.tensor({ -1.9 })
    ok(scale_raw(CPU, c, 0, sc))
    ok(scale_raw(GPU, g, 0, on_gpu(sc)))
    assert_same_tensors(g, c, "scaled by a device scalar")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda groups", function()
  cuda_it("updates a 300-member group in one launch and a 700-member group in three (320 a launch), like the CPU",
          function()
    for _, n in ipairs { 300, 700 } do
      local members = {}
      for i = 1, n do members[i] = { shape = { (i % 7) + 1, (i % 5) + 2 } } end
      local c, g = step_group("f32", "f32", 2, members)
      fresh_grads(c, g)
      local o = { lr = 0.01, weight_decay = 0.1, step = 2 }
      ok(adamw_raw(CPU, c, o))
      local st, nl = adamw_raw(GPU, g, o)
      ok(st)
      assert.equals(math.ceil(n / CAP), nl)
      local sums_c, sums_g = ms.empty({ n }), ms.empty({ n }, { device = "cuda" })
      ok(sumsq_raw(CPU, sums_c, c.params))
      local sst, snl = sumsq_raw(GPU, sums_g, g.params)
      ok(sst)
      assert.equals(math.ceil(n / CAP), snl)
      -- the params of all members at once: their sums of squares and a few members in full
      assert_same(vals(sums_g), vals(sums_c), n .. " members: sums of squares of the params")
      for _, i in ipairs { 1, 2, CAP, CAP + 1, n } do
        if i <= n then
          assert_same(vals(g.params[i]), vals(c.params[i]), n .. " members: param " .. i)
          assert_same(vals(g.v[i]), vals(c.v[i]), n .. " members: exp_avg_sq " .. i)
        end
      end
    end
  end)

  cuda_it("captures adamw_step and foreach_sumsq in a graph that replays with new device-scalar values; the first "
          .. "sumsq of a context is refused while capturing", function()
    local ctx = ms.context { device = "cuda" }   -- a fresh context: its sumsq counters do not exist yet
    local members = { { shape = { 50, 40 } }, { shape = { 7 } }, { shape = { 9, 11 }, grad = "transposed" } }
    local c, twin = step_group("f32", "f32", 2, members)
    fresh_grads(c, twin)
    local function on_ctx(list)   -- copies on ctx (contiguous: the layouts are covered above)
      local out = {}
      for i, t in ipairs(list) do out[i] = t:to(ctx) end
      return out
    end
    local g = { params = on_ctx(c.params), m = on_ctx(c.m), v = on_ctx(c.v), grads = on_ctx(c.grads),
                scales = c.scales }
    local sums = ms.empty({ #members }, { ctx = ctx })
    local err = H.expect_error(function()
      graph.capture(ctx, function() ms.foreach_sumsq(g.grads, sums) end)
    end, "run it once before capturing")
    assert.truthy(err:find("ms_foreach_sumsq", 1, true))
    -- the device scalars first: allocated after the warm-up they would take the scratch block it leaves cached
    local lr_t, step_t = ms.zeros({ 1 }, { ctx = ctx }), ms.zeros({ 1 }, { ctx = ctx })
    ms.foreach_sumsq(g.grads, sums)   -- sets the counters up and leaves the scratch block in the pool's cache
    local gr = graph.capture(ctx, function()
      ms.foreach_sumsq(g.grads, sums)
      ms.adamw_step { params = g.params, grads = g.grads, exp_avg = g.m, exp_avg_sq = g.v, scales = g.scales,
                      lr = lr_t, step = step_t, weight_decay = 0.1, bias_correction = false }
    end)
    local sums_c = ms.empty({ #members })
    ok(sumsq_raw(CPU, sums_c, c.grads))
    for k, lr in ipairs { 0.01, 0.003, 0.02 } do
      lr_t:fill_(lr)
      step_t:fill_(k)
      gr:launch()
      ok(adamw_raw(CPU, c, { lr_t = ms.tensor({ lr }), step_t = ms.tensor({ k }), weight_decay = 0.1,
                             bias_correction = false }))
      assert_same_tensors(g.params, c.params, "replay " .. k .. " param")
      assert_same_tensors(g.m, c.m, "replay " .. k .. " exp_avg")
      assert_same(vals(sums), vals(sums_c), "replay " .. k .. " sums")
    end
    gr:free()
  end)
end)

-- ---------------------------------------------------------------------------------------------------
describe("cuda ms.optim", function()
  local function param(name, shape, dtype, device)
    local t = ms.empty(shape, { dtype = dtype or "f32", device = device })
    return { name = name, param = t, grad = ms.zeros(shape, { dtype = dtype or "f32", device = device }) }
  end
  -- the same gradients on either device: drawn on the CPU, copied
  local function fill_grads(params, seed)
    for i, p in ipairs(params) do p.grad:copy_(ms.randn(p.param:shape(), { seed = seed, offset = i })) end
  end
  local function make(device)
    local params = { param("a", { 5, 3 }, "f32", device), param("b", { 4 }, "bf16", device),
                     param("c", { 2, 2 }, "f32", device), param("w", { 300, 70 }, "f32", device) }
    for i, p in ipairs(params) do p.param:copy_(ms.randn(p.param:shape(), { seed = 99, offset = i })) end
    return params
  end

  local function run(device, recipe, options, settings, steps, save_at, path)
    ms.manual_seed(11)
    local params = make(device)
    local opt = ms.optim.new(recipe, params, options, settings)
    assert.equals(device == "cpu" and "cpu" or "cuda:0", opt.ctx:name())
    for s = 1, steps do
      fill_grads(params, 1000 + s)
      opt:step()
      if save_at == s then opt:save(path) end
    end
    return params, opt
  end

  local function resume(recipe, options, settings, steps, save_at, path)
    local params = make("cuda")
    local at = run("cuda", recipe, options, settings, save_at)
    for i, p in ipairs(params) do p.param:copy_(at[i].param) end
    local opt = ms.optim.new(recipe, params, options, settings)
    opt:load(path)
    for s = save_at + 1, steps do
      fill_grads(params, 1000 + s)
      opt:step()
    end
    return params, opt
  end

  local CASES = {
    { "adamw", { lr = 0.01, weight_decay = 0.1 }, { schedule = { kind = "cosine", warmup_steps = 2, total_steps = 10 } } },
    { "adamw", { state_dtype = "bf16", stochastic_round = true, seed = 5 }, {} },
    { "adamw", { state_dtype = "bf16" }, { master_weights = true } },
    { "sgd", { lr = 0.05, momentum = 0.9, nesterov = true }, { clip_grad_norm = 1.0 } },
    { "sgd", { lr = 0.05, momentum = 0.9, dampening = 0.1, weight_decay = 0.01 }, {} },
  }
  for _, case in ipairs(CASES) do
    cuda_it(("resumes %s %s %s on CUDA bit for bit"):format(case[1], ms.json.encode(case[2]), ms.json.encode(case[3])),
            function()
      local path = os.tmpname()
      local full = run("cuda", case[1], case[2], case[3], 8, 3, path)
      local resumed, opt = resume(case[1], case[2], case[3], 8, 3, path)
      os.remove(path)
      assert.equals(8, opt.step_count)
      for i = 1, #full do assert_same(vals(resumed[i].param), vals(full[i].param), "param " .. full[i].name) end
      -- and the run moved the params: a resume that changed nothing would not pass either
      local start = make("cpu")
      assert.is_false(pcall(assert_same, vals(full[1].param), vals(start[1].param), "moved"))
    end)
  end

  cuda_it("runs the recipes unchanged on CUDA: sgd gives the CPU's bits, adamw the CPU's values within an ulp", function()
    for _, case in ipairs(CASES) do
      local on_cpu = run("cpu", case[1], case[2], case[3], 6)
      local on_cuda = run("cuda", case[1], case[2], case[3], 6)
      for i = 1, #on_cpu do
        local what = ("%s %s: param %s"):format(case[1], ms.json.encode(case[2]), on_cpu[i].name)
        local got, want = vals(on_cuda[i].param), vals(on_cpu[i].param)
        if case[1] == "sgd" then assert_same(got, want, what)
        else assert_ulps(got, want, on_cpu[i].param:dtype(), 2, 1e-7, what) end
      end
    end
  end)

  cuda_it("updates a 300-tensor group through ms.optim in at most 4 launches", function()
    local params = {}
    for i = 1, 300 do params[i] = param("p" .. i, { (i % 7) + 1, (i % 5) + 2 }, "f32", "cuda") end
    for i, p in ipairs(params) do p.param:copy_(ms.randn(p.param:shape(), { seed = 7, offset = i })) end
    local opt = ms.optim.new("adamw", params)
    for s = 1, 2 do
      fill_grads(params, H.seed())
      opt:step()
      assert.is_true(opt:stats().last.launches <= 4, "launches: " .. opt:stats().last.launches)
    end
  end)
end)
