-- Sharded SinkGD (ms_sinkgd_step_sharded, moonstep.shard, ms.sinkgd_step's switch to it).
--
-- In one process: every member unsharded, or each slice the whole matrix with no communicator, is
-- ms_sinkgd_step (the same bits; one f32 rounding apart through the sharded path's order of sums); every
-- validation error names its problem and changes nothing; moonstep.shard refuses what cannot be a slice, and
-- one call refuses members sharded over different communicators.  Across processes (`moonstep launch -n 2`
-- and `-n 3` on the CPU, the TCP communicator): each rank's slice after two steps -- fresh state, then warm u
-- and captured t -- is the slice of ms_sinkgd_step's result on the whole matrix, computed in the same rank
-- script, for every mode and target, rows and cols, 2-D and 3-D, uneven splits, a rank holding no rows, bf16
-- with stochastic rounding and a mixed call.  Tagged #multigpu: the same on 2 CUDA ranks against the CPU.
-- (tests/c/test_sinkgd_shard.c checks the CPU member itself with up to 4 ranks simulated by threads.)
local ffi = require("ffi")
local ms = require("moonstep")
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local shard = require("moonstep.shard")
local C = core.C

local cpu = ms.device("cpu")
local CTX = T.handle_ctx(cpu)
local abs, max = math.abs, math.max

-- ---------------------------------------------------------------------------------------------------
-- helpers
-- ---------------------------------------------------------------------------------------------------
local function randn(shape, dt) return ms.randn(shape, { dtype = dt or "f32", seed = H.seed() }) end
local function vals(t) return t:tolist_flat() end

local function ulp(x) return H.ulp(x, "f32") end

-- |got - want| <= k ulp(want) + atol elementwise, NaN failing
local function assert_ulps(got, want, what, k, atol)
  assert.equals(#want, #got, what .. ": length")
  for i = 1, #want do
    local tol = (k or 1) * ulp(want[i]) + (atol or 0)
    if not (abs(got[i] - want[i]) <= tol) then
      error(("%s: element %d is %.9g, expected %.9g (error %.3g > %.3g)"):format(what, i, got[i], want[i],
            abs(got[i] - want[i]), tol), 2)
    end
  end
end

local function same(got, want, what)
  assert.equals(#want, #got, what .. ": length")
  for i = 1, #want do
    if got[i] ~= want[i] then error(("%s: element %d is %.9g, expected %.9g (the same bits)"):format(what, i, got[i], want[i]), 2) end
  end
end

local DIMS = { none = C.MS_SHARD_NONE, rows = C.MS_SHARD_ROWS, cols = C.MS_SHARD_COLS }

local function opts(o)
  local c = ffi.new("ms_sinkgd_options")
  c.lr, c.step = o.lr or 0.05, o.step or 1
  c.mode = o.mode or C.MS_SINKGD_SPECTRAL
  c.target = C.MS_SINKGD_TARGET_UNIT
  c.iters, c.sn_iters = o.iters or 3, o.sn_iters or 1
  c.eps, c.weight_decay = 1e-8, o.weight_decay or 0
  return c
end

-- ms_sinkgd_step_sharded through the C ABI: members {p =, g =, u =, t =, shard = {dim, offset, global}}
local function sharded_raw(comm, members, o, ctx)
  local n = #members
  local p, g = ffi.new("ms_tensor *[?]", n), ffi.new("const ms_tensor *[?]", n)
  local u, t = ffi.new("ms_tensor *[?]", n), ffi.new("ms_tensor *[?]", n)
  local sh = ffi.new("ms_shard[?]", n)
  for i, mb in ipairs(members) do
    p[i - 1], g[i - 1] = T.handle(mb.p), T.handle(mb.g)
    u[i - 1] = mb.u and T.handle(mb.u) or nil
    t[i - 1] = mb.t and T.handle(mb.t) or nil
    local s = mb.shard or {}
    sh[i - 1].dim = type(s[1]) == "number" and s[1] or DIMS[s[1] or "none"]
    sh[i - 1].offset, sh[i - 1].global = s[2] or 0, s[3] or 0
  end
  return C.ms_sinkgd_step_sharded(ctx or CTX, comm, n, p, g, u, t, nil, sh, opts(o or {}))
end

local function status_of(st) return ffi.string(C.ms_status_name(st)), ffi.string(C.ms_last_error()) end

-- ---------------------------------------------------------------------------------------------------
-- one process
-- ---------------------------------------------------------------------------------------------------
describe("ms_sinkgd_step_sharded in one process", function()
  -- a fresh group and its twin for the plain step
  local function group(specs, mode)
    local a, b = {}, {}
    for k, s in ipairs(specs) do
      local shape = s.shape
      local ushape, tshape = {}, {}
      for d = 1, #shape - 2 do ushape[d], tshape[d] = shape[d], shape[d] end
      ushape[#ushape + 1] = shape[#shape]
      local mb = { p = randn(shape), g = randn(shape), u = ms.zeros(ushape), t = ms.full(tshape, -1), shard = s.shard }
      a[k] = mb
      b[k] = { p = mb.p:clone(), g = mb.g, u = mb.u:clone(), t = mb.t:clone() }
    end
    return a, b
  end
  local function plain(members, mode)
    local ps, gs, us, ts = {}, {}, {}, {}
    for k, mb in ipairs(members) do ps[k], gs[k], us[k], ts[k] = mb.p, mb.g, mb.u, mb.t end
    ms.sinkgd_step { params = ps, grads = gs, specnorm_u = us, md_target_norm = ts, mode = mode, iters = 3,
                     lr = 0.05, weight_decay = mode == "sphere" and 0 or nil }
  end
  local mode_code = { base = C.MS_SINKGD_BASE, spectral = C.MS_SINKGD_SPECTRAL, sphere = C.MS_SINKGD_SPHERE }

  it("with every member unsharded (shards NULL or MS_SHARD_NONE) and no communicator is ms_sinkgd_step, bit for bit", function()
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      local a, b = group({ { shape = { 7, 5 } }, { shape = { 3, 4, 6 }, shard = { "none", 99, 99 } } }, mode)
      local st = sharded_raw(nil, a, { mode = mode_code[mode] })
      assert.equals("MS_OK", (status_of(st)))
      plain(b, mode)
      for k = 1, 2 do
        same(vals(a[k].p), vals(b[k].p), mode .. " param " .. k)
        if mode ~= "base" then same(vals(a[k].u), vals(b[k].u), mode .. " u " .. k) end
        if mode == "sphere" then same(vals(a[k].t), vals(b[k].t), mode .. " t " .. k) end
      end
    end
  end)

  it("with whole slices and no communicator takes the sharded path and rounds as ms_sinkgd_step (1 ulp)", function()
    for _, mode in ipairs { "base", "spectral", "sphere" } do
      local a, b = group({ { shape = { 7, 5 }, shard = { "rows", 0, 7 } }, { shape = { 2, 4, 9 }, shard = { "cols", 0, 9 } },
                           { shape = { 3, 3 } } }, mode)
      local before = vals(a[1].p)
      local st = sharded_raw(nil, a, { mode = mode_code[mode] })
      assert.equals("MS_OK", (status_of(st)))
      plain(b, mode)
      for k = 1, 3 do
        assert_ulps(vals(a[k].p), vals(b[k].p), mode .. " param " .. k, 1, 1e-12)
        if mode ~= "base" then assert_ulps(vals(a[k].u), vals(b[k].u), mode .. " u " .. k, 1, 1e-12) end
        if mode == "sphere" then assert_ulps(vals(a[k].t), vals(b[k].t), mode .. " t " .. k, 1) end
      end
      assert.is_true(vals(a[1].p)[1] ~= before[1], "the step changed nothing")
    end
  end)

  it("goes through moonstep.shard: ms.sinkgd_step with registered whole slices matches the plain step", function()
    local a, b = group({ { shape = { 6, 4 } }, { shape = { 2, 5, 3 } } }, "spectral")
    shard.set(a[1].p, { dim = "rows", offset = 0, size = 6 })
    shard.set(a[2].p, { dim = "cols", offset = 0, size = 3 })
    assert.same({ dim = "rows", offset = 0, global = 6 }, shard.get(a[1].p))
    local before = vals(a[1].p)
    plain(a, "spectral")
    plain(b, "spectral")
    for k = 1, 2 do assert_ulps(vals(a[k].p), vals(b[k].p), "param " .. k, 1, 1e-12) end
    assert.is_true(vals(a[1].p)[1] ~= before[1])
    shard.clear(a[1].p)
    shard.clear(a[2].p)
    assert.is_nil(shard.get(a[1].p))
  end)

  it("refuses bad shards, naming the problem and changing nothing", function()
    local p, g = randn({ 6, 4 }), randn({ 6, 4 })
    local u, t = ms.zeros({ 4 }), ms.full({}, -1)
    local function refused(members, comm, want_status, ...)
      local before = {}
      for k, mb in ipairs(members) do before[k] = { vals(mb.p), mb.u and vals(mb.u) } end
      local st, msg = status_of(sharded_raw(comm, members, { mode = C.MS_SINKGD_SPHERE }))
      assert.equals(want_status, st, msg)
      for _, s in ipairs { ... } do assert.is_truthy(msg:find(s, 1, true), msg .. " lacks " .. s) end
      assert.is_truthy(msg:find("ms_sinkgd_step_sharded", 1, true), msg)
      for k, mb in ipairs(members) do
        same(vals(mb.p), before[k][1], "param " .. k .. " after a refusal")
        if mb.u then same(vals(mb.u), before[k][2], "u " .. k .. " after a refusal") end
      end
    end
    local function mb(shard_, extra)
      local m = { p = p, g = g, u = u, t = t, shard = shard_ }
      for k, v in pairs(extra or {}) do m[k] = v end
      return m
    end
    refused({ mb({ 7, 0, 6 }) }, nil, "MS_E_ARG", "shards[0].dim = 7")
    refused({ mb({ "rows", -1, 6 }) }, nil, "MS_E_ARG", "offset -1", "member 0")
    refused({ mb({ "rows", 3, 8 }) }, nil, "MS_E_ARG", "6 rows from offset 3", "[0, 8)")
    refused({ mb({ "cols", 0, 3 }) }, nil, "MS_E_ARG", "4 columns from offset 0", "[0, 3)")          -- global < local
    refused({ mb({ "rows", 2, 12 }) }, nil, "MS_E_ARG", "rows [2, 8) of 12", "comm is NULL")        -- a partial slice
    refused({ mb({ "rows", 0, 6 }), mb({ "cols", 0, 4 }, { p = randn({ 6, 4 }, "f64") }) }, nil, "MS_E_DTYPE",
            "member 1 (param) has dtype f64")
    refused({ mb({ "cols", 0, 6 }, { p = randn({ 4, 6 }), g = randn({ 4, 6 }), u = ms.zeros({ 4 }) }) }, nil,
            "MS_E_SHAPE", "member 0 (specnorm_u)")                                                 -- u must be [n_local]
    refused({ mb({ "rows", 0, 6 }, { g = randn({ 5, 4 }) }) }, nil, "MS_E_SHAPE", "member 0 (grad)")
    refused({ mb({ "rows", 0, 6 }, { p = randn({ 4, 6 }):t(), g = randn({ 6, 4 }) }) }, nil, "MS_E_LAYOUT",
            "not contiguous")
    -- a communicator of one rank: the slice must be the whole dim; one on another context is refused
    local comm1 = ms.comm.new { ctx = cpu, rank = 0, world_size = 1 }
    refused({ mb({ "cols", 1, 5 }, { p = randn({ 6, 4 }), u = ms.zeros({ 4 }) }) }, ms.comm.handle(comm1), "MS_E_ARG",
            "comm has one rank")
    local other = ms.context { device = "cpu", num_threads = 1 }
    local comm2 = ms.comm.new { ctx = other, rank = 0, world_size = 1 }
    refused({ mb({ "rows", 0, 6 }) }, ms.comm.handle(comm2), "MS_E_ARG", "another context")
    -- whereas a whole slice over a one-rank communicator steps
    local st, msg = status_of(sharded_raw(ms.comm.handle(comm1), { mb({ "rows", 0, 6 }, { p = randn({ 6, 4 }) }) },
                                          { mode = C.MS_SINKGD_SPHERE }))
    assert.equals("MS_OK", st, msg)
    comm1:free()
    comm2:free()
  end)

  it("moonstep.shard refuses what cannot be a slice, and ms.sinkgd_step members over two communicators", function()
    local w = randn({ 6, 4 })
    H.expect_error(function() shard.set({}, { dim = "rows", offset = 0, size = 6 }) end, "expected a tensor")
    H.expect_error(function() shard.set(randn({ 6 }), { dim = "rows", offset = 0, size = 6 }) end, "[..., m, n]")
    H.expect_error(function() shard.set(w, { dim = "diag", offset = 0, size = 6 }) end, "dim must be 'rows', 'cols'")
    H.expect_error(function() shard.set(w, { dim = "rows", offset = -2, size = 6 }) end, "offset must be an integer in [0, 2^53)")
    -- inf == floor(inf): an infinite offset or size once passed, to be converted to a C integer later
    H.expect_error(function() shard.set(w, { dim = "rows", offset = math.huge, size = 6 }) end, "offset must be an integer")
    H.expect_error(function() shard.set(w, { dim = "rows", offset = 0, size = math.huge }) end, "size must be an integer")
    H.expect_error(function() shard.set(w, { dim = "rows", offset = 1.5, size = 6 }) end, "offset must be an integer")
    H.expect_error(function() shard.set(w, { dim = "rows", offset = 4, size = 9 }) end, "past the global size 9")
    H.expect_error(function() shard.set(w, { dim = "cols", offset = 2, size = 8 }) end, "pass the communicator")
    H.expect_error(function() shard.set(w, { dim = "rows", offset = 0, size = 6 }, {}) end, "comm must be a communicator")
    assert.is_nil(shard.get(w))

    local c1 = ms.comm.new { ctx = cpu, rank = 0, world_size = 1 }
    local c2 = ms.comm.new { ctx = cpu, rank = 0, world_size = 1 }
    local a, b = randn({ 6, 4 }), randn({ 5, 3 })
    shard.set(a, { dim = "rows", offset = 0, size = 6 }, c1)
    shard.set(b, { dim = "none" }, c2)
    local ga, gb = randn({ 6, 4 }), randn({ 5, 3 })
    local before = vals(a)
    H.expect_error(function() ms.sinkgd_step { params = { a, b }, grads = { ga, gb } } end,
                   "params 1 and 2 are sharded over different communicators")
    same(vals(a), before, "param after the refusal")
    -- one communicator: the step runs (a one-rank world)
    shard.set(b, { dim = "none" }, c1)
    ms.sinkgd_step { params = { a, b }, grads = { ga, gb } }
    assert.is_true(vals(a)[1] ~= before[1])
    shard.clear(a)
    shard.clear(b)
    c1:free()
    c2:free()
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- ranks: `moonstep launch -n N` (CPU), and #multigpu
-- ---------------------------------------------------------------------------------------------------
local q = H.q
local function launch(args) return H.moonstep(args, "timeout 120") end

-- Every rank builds the same global matrices from fixed seeds, steps them whole with ms.sinkgd_step on the
-- CPU (the reference) and its slices through moonstep.shard on its device, twice, and compares; it prints
-- "ok RANK CASE" or "bad RANK CASE: why".  arg[1]: "cpu" or "cuda".
local RANK_SCRIPT = [[
local device = arg[1] or "cpu"
local cpu = ms.device("cpu")
local ctx = device == "cuda" and ms.device("cuda:" .. os.getenv("LOCAL_RANK")) or cpu
local comm = ms.comm.from_env { ctx = ctx, timeout = 30 }
local rank, world = comm:rank(), comm:size()
local abs, max = math.abs, math.max

local function ulp(x, dt)
  local mant = dt == "bf16" and 8 or 24
  local e = -126
  if x ~= 0 then
    local _, ex = math.frexp(abs(x))
    e = max(ex - 1, -126)
  end
  return 2 ^ (e - mant + 1)
end

-- this rank's [offset, offset + size) of `global` (as even as possible, the first ranks one longer)
local function slice_of(global)
  local base, extra = math.floor(global / world), global % world
  local off = rank * base + math.min(rank, extra)
  return off, base + (rank < extra and 1 or 0)
end

local cases = {
  { name = "base rows uneven", mode = "base", wd = 0.1, members = { { shape = { 7, 5 }, dim = "rows" } } },
  { name = "base cols", mode = "base", members = { { shape = { 6, 9 }, dim = "cols" } } },
  { name = "spectral unit rows 3-D", mode = "spectral", wd = 0.05, members = { { shape = { 3, 7, 6 }, dim = "rows" } } },
  { name = "spectral muon cols", mode = "spectral", target = "muon", sn_iters = 2,
    members = { { shape = { 5, 11 }, dim = "cols" } } },
  { name = "spectral muon rows", mode = "spectral", target = "muon", members = { { shape = { 8, 5 }, dim = "rows" } } },
  { name = "spectral unit cols 3-D", mode = "spectral", members = { { shape = { 2, 4, 7 }, dim = "cols" } } },
  { name = "sphere rows", mode = "sphere", sn_iters = 2, members = { { shape = { 8, 5 }, dim = "rows" } } },
  { name = "sphere cols 3-D", mode = "sphere", members = { { shape = { 2, 4, 9 }, dim = "cols" } } },
  { name = "rows fewer than ranks", mode = "sphere", members = { { shape = { 2, 6 }, dim = "rows" } } },
  { name = "cols fewer than ranks", mode = "spectral", members = { { shape = { 5, 2 }, dim = "cols" } } },
  { name = "mixed call", mode = "spectral", target = "muon",
    members = { { shape = { 7, 4 }, dim = "rows" }, { shape = { 3, 5, 7 }, dim = "cols" }, { shape = { 3, 3 } } } },
  { name = "bf16 stochastic rounding", mode = "spectral", dtype = "bf16", sr = true,
    members = { { shape = { 16, 12 }, dim = "rows" }, { shape = { 9, 20 }, dim = "cols" } } },
}

local function lead(shape)
  local l = {}
  for d = 1, #shape - 2 do l[d] = shape[d] end
  return l
end

for ci, c in ipairs(cases) do
  local ok, err = pcall(function()
    local dt = c.dtype or "f32"
    local ref, loc = {}, {}
    for k, mb in ipairs(c.members) do
      local shape, nd = mb.shape, #mb.shape
      local p0 = ms.randn(shape, { seed = 1000 * ci + k, ctx = cpu }):to(dt)
      local ushape = lead(shape)
      ushape[#ushape + 1] = shape[nd]
      local r = { p = p0:clone(), u = ms.zeros(ushape, { ctx = cpu }), t = ms.full(lead(shape), -1, { ctx = cpu }) }
      local l = { dim = mb.dim }
      if mb.dim then
        l.axis = mb.dim == "rows" and nd - 2 or nd - 1
        l.global = shape[l.axis + 1]
        l.off, l.len = slice_of(l.global)
      else
        l.axis, l.off, l.len = nd - 1, 0, shape[nd]
      end
      l.p = p0:narrow(l.axis, l.off, l.len):clone():to(ctx)
      local ul = lead(shape)
      ul[#ul + 1] = mb.dim == "cols" and l.len or shape[nd]
      l.u, l.t = ms.zeros(ul, { ctx = ctx }), ms.full(lead(shape), -1, { ctx = ctx })
      if mb.dim then ms.shard.set(l.p, { dim = mb.dim, offset = l.off, size = l.global }, comm) end
      ref[k], loc[k] = r, l
    end
    for step = 1, 2 do
      local args = { mode = c.mode, target = c.target, iters = 3, sn_iters = c.sn_iters or 1, lr = 0.05, step = step,
                     weight_decay = c.wd, stochastic_round = c.sr, seed = 5 }
      local function run(list, grads)
        local a = {}
        for key, v in pairs(args) do a[key] = v end
        a.params, a.grads, a.specnorm_u, a.md_target_norm = {}, grads, {}, {}
        for k, x in ipairs(list) do a.params[k], a.specnorm_u[k], a.md_target_norm[k] = x.p, x.u, x.t end
        ms.sinkgd_step(a)
      end
      local gfull, gloc, before = {}, {}, {}
      for k, mb in ipairs(c.members) do
        gfull[k] = ms.randn(mb.shape, { seed = 5000 * ci + 10 * step + k, ctx = cpu })
        gloc[k] = gfull[k]:narrow(loc[k].axis, loc[k].off, loc[k].len):to(ctx)   -- a strided slice: any layout
        before[k] = ref[k].p:narrow(loc[k].axis, loc[k].off, loc[k].len):clone():to("f64"):tolist_flat()
      end
      run(ref, gfull)
      run(loc, gloc)
      for k, mb in ipairs(c.members) do
        local l, r = loc[k], ref[k]
        local want = r.p:narrow(l.axis, l.off, l.len):to("f64"):tolist_flat()
        local got = l.p:cpu():to("f64"):tolist_flat()
        assert(#got == #want, "length")
        local maxupd = 0
        for i = 1, #want do maxupd = max(maxupd, abs(want[i] - before[k][i])) end
        -- the CPU: one rounding apart (step 2 starts from state one rounding apart: 2 ulp); CUDA sums in f32
        local k_ulp, atol = step == 1 and 1 or 2, device == "cuda" and 1e-5 * maxupd or 1e-7 * maxupd
        for i = 1, #want do
          local tol = k_ulp * ulp(want[i], dt) + atol
          if not (abs(got[i] - want[i]) <= tol) then
            error(("step %d member %d param element %d: %.9g, expected %.9g"):format(step, k, i, got[i], want[i]))
          end
        end
        assert(maxupd > 0 or #want == 0, "the reference step changed nothing")
        if c.mode ~= "base" then
          local wu = (l.dim == "cols" and r.u:narrow(#mb.shape - 2, l.off, l.len) or r.u):to("f64"):tolist_flat()
          local gu = l.u:cpu():to("f64"):tolist_flat()
          for i = 1, #wu do
            local tol = device == "cuda" and 1e-4 or 2 * ulp(wu[i], "f32") + 1e-7
            if not (abs(gu[i] - wu[i]) <= tol) then
              error(("step %d member %d u element %d: %.9g, expected %.9g"):format(step, k, i, gu[i], wu[i]))
            end
          end
        end
        if c.mode == "sphere" then
          local wt, gt = r.t:to("f64"):tolist_flat(), l.t:cpu():to("f64"):tolist_flat()
          for i = 1, #wt do
            if not (wt[i] > 0 and abs(gt[i] - wt[i]) <= 2 * ulp(wt[i], "f32") + (device == "cuda" and 1e-6 * wt[i] or 0)) then
              error(("step %d member %d t %d: %.9g, expected %.9g"):format(step, k, i, gt[i], wt[i]))
            end
          end
        end
      end
    end
  end)
  io.stdout:write(ok and ("ok %d %s\n"):format(rank, c.name) or ("bad %d %s: %s\n"):format(rank, c.name, tostring(err)))
  io.stdout:flush()
end
print(("cases %d %d"):format(rank, #cases))
comm:free()
]]

local script_path
local function rank_script()
  script_path = script_path or H.temp_file("sinkgd_shard_ranks.lua", RANK_SCRIPT)
  return script_path
end


local function check_ranks(out, code, n)
  assert.equals(0, code, out)
  assert.is_nil(out:find("bad ", 1, true), out)
  local cases = tonumber(out:match("cases 0 (%d+)"))
  assert.is_truthy(cases and cases >= 12, out)
  for r = 0, n - 1 do
    local count = 0
    for _ in out:gmatch("\nok " .. r .. " ") do count = count + 1 end
    if out:sub(1, 5) == "ok " .. r .. " " then count = count + 1 end
    assert.equals(cases, count, "rank " .. r .. ": " .. out)
  end
end

describe("ms_sinkgd_step_sharded across ranks", function()
  it("on 2 CPU ranks: every rank's slice is the slice of ms_sinkgd_step's result on the whole matrix", function()
    local out, code = launch(("launch -n 2 %s cpu"):format(q(rank_script())))
    check_ranks(out, code, 2)
  end)

  it("on 3 CPU ranks, where one holds no rows of a 2-row matrix", function()
    local out, code = launch(("launch -n 3 %s cpu"):format(q(rank_script())))
    check_ranks(out, code, 3)
  end)
end)

describe("ms_sinkgd_step_sharded on 2 GPUs #multigpu", function()
  H.multigpu_it("every rank's slice (cuda:LOCAL_RANK) is the slice of the CPU step on the whole matrix #multigpu", function()
    local out, code = launch(("launch -n 2 %s cuda"):format(q(rank_script())))
    check_ranks(out, code, 2)
  end)
end)
