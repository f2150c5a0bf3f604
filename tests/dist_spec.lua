-- Several ranks in the optimizer runtime (moonstep.optim, "Several ranks"): settings.comm and distribute,
-- sharded parameter entries, owners, the decisions every rank takes together, and checkpoints across world
-- sizes.  The ranks are real processes started by `moonstep launch -n 2` on the CPU (the TCP communicator); one
-- rank script runs every scenario, each against one rank's optimizer computed in the same process from the
-- same fresh random inputs, and prints "result <rank> <scenario> ok|fail <why>".  DASH (owner mode) and
-- elementwise updates must match one rank bit for bit; sharded SinkGD to f32 rounding (its partial sums are
-- added in another order).  The refusals that need no second rank run in this process.
local ms = H.ms

local q = H.q

local rank_script = [==[
local ms = require("moonstep")
local comm = ms.comm.from_env { ctx = ms.device("cpu"), timeout = 20 }
local RANK = comm:rank()
assert(comm:size() == 2, "a world of 2 ranks")
local DIR = arg[1]
local only = arg[2]

local function out(name, ok, msg)
  io.stdout:write(("result %d %s %s %s\n"):format(RANK, name, ok and "ok" or "fail", (tostring(msg or "")):gsub("\n", " | ")))
  io.stdout:flush()
end
local function scenario(name, fn)
  if only and only ~= name then return end
  local ok, err = pcall(fn)
  out(name, ok, err)
end

local function vals(t) return t:tolist_flat() end
-- exact equality, or within rtol (relative to the largest magnitude) when given
local function check_same(a, b, what, rtol)
  local x, y = vals(a), vals(b)
  assert(#x == #y, ("%s: %d values against %d"):format(what, #x, #y))
  local scale = 0
  for i = 1, #x do scale = math.max(scale, math.abs(y[i])) end
  for i = 1, #x do
    local d = math.abs(x[i] - y[i])
    if not (x[i] == y[i] or (rtol and d <= rtol * scale)) then
      error(("%s: value %d is %.17g, expected %.17g"):format(what, i, x[i], y[i]), 2)
    end
  end
end

-- the whole tensor from the ranks' slices along dim `axis` (each rank's at [lo, lo + len)): zeros elsewhere,
-- summed over the ranks (x + 0 = x: exact)
local function gather_whole(slice, axis, lo, total)
  local shape = slice:shape()
  shape[axis + 1] = total
  local whole = ms.zeros(shape, { dtype = slice:dtype() == "u8" and "f32" or slice:dtype() })
  whole:slice(axis, lo, lo + slice:size(axis)):copy_(slice)
  comm:all_reduce(whole)
  return whole
end
local function barrier() comm:all_reduce(ms.zeros({ 1 })) end

-- a model: {name, shape, shard = {dim, {lo per rank}}} -> whole params (same on every rank), this rank's entries
local function model(spec, seed, dtype)
  local whole, entries, cuts = {}, {}, {}
  for i, s in ipairs(spec) do
    local w = ms.randn(s[2], { seed = seed, offset = i })
    if dtype then w = w:to(dtype) end
    whole[i] = w
    local e = { name = s[1], tags = s.tags }
    if s.shard then
      local axis = #s[2] - (s.shard[1] == "rows" and 2 or 1)
      local starts = s.shard[2]
      local lo = starts[RANK + 1]
      local hi = starts[RANK + 2] or s[2][axis + 1]
      e.param = w:slice(axis, lo, hi):contiguous()
      e.shard = { dim = s.shard[1], offset = lo, size = s[2][axis + 1] }
      cuts[i] = { axis = axis, lo = lo, hi = hi }
    else
      e.param = w:clone()
    end
    e.grad = ms.zeros(e.param:shape(), { dtype = e.param:dtype() })
    entries[i] = e
  end
  return whole, entries, cuts
end
local function whole_entries(spec, whole)
  local t = {}
  for i, s in ipairs(spec) do t[i] = { name = s[1], tags = s.tags, param = whole[i]:clone(), grad = ms.zeros(s[2], { dtype = whole[i]:dtype() }) } end
  return t
end
-- step t's gradients: the whole ones (one rank) and this rank's slices of them
local function fill(spec, step, ones, slices, cuts)
  for i, s in ipairs(spec) do
    local g = ms.randn(s[2], { seed = 500 + step, offset = i })
    if ones then ones[i].grad:copy_(g) end
    if slices then
      local c = cuts[i]
      slices[i].grad:copy_(c and g:slice(c.axis, c.lo, c.hi) or g)
    end
  end
end
local function slice_of(t, c) return c and t:slice(c.axis, c.lo, c.hi) or t end

-- (1) DASH: owners on 2 ranks give what 1 rank gives, bit for bit
local dash_spec = { { "a", { 12, 10 } }, { "b", { 5, 2, 3 } }, { "c", { 3, 4 } }, { "n1", { 11 } }, { "d", { 9, 9 } },
                    { "n2", { 7 } }, { "e", { 16, 6 } }, { "head", { 6, 4 }, tags = { "adamw" } } }
scenario("dash_owner", function()
  for _, o in ipairs {
    { inv_root_method = "ndb", block_size = 4, eps_inv_root = 1e-3, algo_one_dim = "shampoo", inv_root_freq = 2 },
    { inv_root_method = "auto", block_size = 4, algo_one_dim = "shampoo", inv_root_freq = 1, auto_reclassify_every = 2,
      mu = 0.5, bf16_stochastic_round = true, seed = 3 },
  } do
    local dtype = o.bf16_stochastic_round and "bf16" or nil
    local whole = model(dash_spec, 11, dtype)
    local one, two = whole_entries(dash_spec, whole), whole_entries(dash_spec, whole)
    local opt1 = ms.optim.new("dash", one, o)
    local opt2 = ms.optim.new("dash", two, o, { comm = comm })
    for t = 1, 5 do
      fill(dash_spec, t, one) fill(dash_spec, t, two)
      opt1:step() opt2:step()
    end
    for i, p in ipairs(one) do check_same(two[i].param, p.param, o.inv_root_method .. " " .. p.name) end
    -- the work is split: this rank's stacks hold only the blocks of the parameters it owns
    local mine, all = 0, 0
    for _, m in ipairs(opt2.members) do
      all = all + 1
      if m.owner == RANK then mine = mine + 1 else assert(next(m.state) == nil, "state for a parameter owned elsewhere") end
    end
    assert(mine > 0 and mine < all, ("rank %d owns %d of %d parameters"):format(RANK, mine, all))
    local blocks = 0
    for _, t in pairs(opt2.groups[1].state.grad_ema) do blocks = blocks + t:size(0) end
    local total = 0
    for _, t in pairs(opt1.groups[1].state.grad_ema) do total = total + t:size(0) end
    assert(blocks > 0 and blocks < total, ("rank %d stacks %d of %d blocks"):format(RANK, blocks, total))
  end
end)

-- (2) SinkGD on rows- and cols-sharded matrices (and whole ones, owned) == one rank
local sink_spec = {
  { "rows", { 9, 6 }, shard = { "rows", { 0, 5 } } },
  { "cols", { 6, 10 }, shard = { "cols", { 0, 4 } } },
  { "stack", { 2, 4, 6 }, shard = { "rows", { 0, 1 } } },
  { "embed_tokens", { 32, 256 }, shard = { "rows", { 0, 16 } } },    -- AdamW, 8-bit moments on both slices
  { "whole", { 5, 7 } }, { "bias", { 7 } },
}
local sink_opts = { sinkgd_spectral_norm = true, lr = 0.02, sinkgd_base_width = 4 }
scenario("sinkgd_sharded", function()
  for _, o in ipairs { sink_opts, { sinkgd_md_sphere = true, lr = 0.02 } } do
    local whole, slices, cuts = model(sink_spec, 21)
    local ones = whole_entries(sink_spec, whole)
    local opt1 = ms.optim.new("sinkgd", ones, o)
    local opt2 = ms.optim.new("sinkgd", slices, o, { comm = comm })
    for t = 1, 4 do
      fill(sink_spec, t, ones, slices, cuts)
      opt1:step() opt2:step()
    end
    for i, e in ipairs(slices) do
      check_same(e.param, slice_of(ones[i].param, cuts[i]), e.name, (e.name == "embed_tokens" or e.name == "bias") and 0 or 2e-6)
    end
    local m = opt2.by_name.embed_tokens.member
    assert(m.state.exp_avg:dtype() == "u8", "8-bit moments on a block-aligned rows slice")
  end
end)

-- (2b) a rows slice aligned to the 8-bit blocks of a matrix whose numel is no multiple of block_size: one rank
-- keeps that matrix's moments in f32, so the slice must too (it took 8 bits, stepped otherwise than one rank,
-- and its checkpoint could not be saved: its scales did not follow the shard)
scenario("sinkgd_8bit_whole_f32", function()
  local spec = { { "embed_odd", { 65, 128 }, shard = { "rows", { 0, 32 } }, tags = { "adamw" } } }
  local whole, slices, cuts = model(spec, 23)
  local ones = whole_entries(spec, whole)
  local opt1 = ms.optim.new("sinkgd", ones, { lr = 0.01 })
  local opt2 = ms.optim.new("sinkgd", slices, { lr = 0.01 }, { comm = comm })
  for t = 1, 3 do
    fill(spec, t, ones, slices, cuts)
    opt1:step() opt2:step()
  end
  assert(opt1.by_name.embed_odd.member.state.exp_avg:dtype() == "f32", "one rank: f32 moments")
  assert(opt2.by_name.embed_odd.member.state.exp_avg:dtype() == "f32",
         "rank " .. RANK .. ": " .. opt2.by_name.embed_odd.member.state.exp_avg:dtype() .. " moments")
  check_same(slices[1].param, slice_of(ones[1].param, cuts[1]), "embed_odd")
  local path = DIR .. "/odd.ckpt"
  opt2:save(path)
  local at3 = gather_whole(slices[1].param, 0, cuts[1].lo, 65)
  local again = whole_entries(spec, { at3 })
  local opt3 = ms.optim.new("sinkgd", again, { lr = 0.01 })
  opt3:load(path)
  check_same(opt3.by_name.embed_odd.member.state.exp_avg, gather_whole(opt2.by_name.embed_odd.member.state.exp_avg, 0,
             cuts[1].lo, 65), "2 -> 1 exp_avg")
end)

-- (2c) stats: a sharded parameter's update norm is the whole parameter's (a slice's alone was reported, a
-- different number on each rank), the others' as one rank's
scenario("stats_sharded", function()
  local whole, slices, cuts = model(sink_spec, 25)
  local ones = whole_entries(sink_spec, whole)
  local opt1 = ms.optim.new("sinkgd", ones, sink_opts, { stats = true })
  local opt2 = ms.optim.new("sinkgd", slices, sink_opts, { comm = comm, stats = true })
  for t = 1, 2 do
    fill(sink_spec, t, ones, slices, cuts)
    opt1:step() opt2:step()
    local n1, n2 = opt1:stats().last.update_norms, opt2:stats().last.update_norms
    for _, s in ipairs(sink_spec) do
      local a, b = n2[s[1]], n1[s[1]]
      assert(a and b and b > 0 and math.abs(a - b) <= 1e-5 * b,
             ("step %d: update norm of %s is %s, one rank's %s"):format(t, s[1], tostring(a), tostring(b)))
    end
  end
end)

-- (3) replicate: every rank steps every parameter, as one rank does
scenario("replicate", function()
  local spec = { { "w", { 6, 5 } }, { "v", { 4, 4 } }, { "b", { 5 } } }
  local whole = model(spec, 31)
  local one, two = whole_entries(spec, whole), whole_entries(spec, whole)
  local opt1 = ms.optim.new("sinkgd", one, sink_opts)
  local opt2 = ms.optim.new("sinkgd", two, sink_opts, { comm = comm, distribute = "replicate" })
  for t = 1, 3 do
    fill(spec, t, one) fill(spec, t, two)
    opt1:step() opt2:step()
  end
  for i, p in ipairs(one) do check_same(two[i].param, p.param, p.name) end
  for _, m in ipairs(opt2.members) do assert(m.owner == nil and next(m.state) ~= nil, m.name .. ": not stepped here") end
end)

-- (3b) stochastic rounding: every parameter numbered in its route, a slice's elements in its whole parameter
-- (moonstep.tensor.set_rng_origin), so owners and slices round bf16 parameters as one rank does, bit for bit
local sr_spec = {
  { "w", { 6, 5 } }, { "v", { 4, 8 } }, { "b", { 5 } }, { "u", { 3, 7 } },
  { "rows", { 9, 6 }, shard = { "rows", { 0, 5 } } }, { "cols", { 6, 10 }, shard = { "cols", { 0, 4 } } },
  { "stack", { 2, 4, 6 }, shard = { "cols", { 0, 2 } } }, { "stack_rows", { 3, 5, 4 }, shard = { "rows", { 0, 3 } } },
}
-- (SinkGD's sharded matrices match one rank to f32 rounding only: here its owned matrices, and its AdamW on
-- owned vectors and on 8-bit row slices)
local sr_sink_spec = { { "w", { 6, 5 } }, { "v", { 4, 8 } }, { "b", { 5 } }, { "u", { 3, 7 } },
                       { "embed_tokens", { 32, 256 }, shard = { "rows", { 0, 16 } } } }
scenario("stochastic_rounding", function()
  for _, c in ipairs {
    { "adamw", sr_spec, { lr = 0.01, weight_decay = 0.1, stochastic_round = true, seed = 5 } },
    { "sgd", sr_spec, { lr = 0.01, momentum = 0.9, stochastic_round = true, seed = 5 } },
    { "sinkgd", sr_sink_spec, { lr = 0.01, weight_decay = 0.1, bf16_stochastic_round = true, seed = 5 } },
  } do
    local recipe, spec, o = c[1], c[2], c[3]
    local whole, slices, cuts = model(spec, 27, "bf16")
    local ones = whole_entries(spec, whole)
    local opt1 = ms.optim.new(recipe, ones, o)
    local opt2 = ms.optim.new(recipe, slices, o, { comm = comm })
    for t = 1, 3 do
      fill(spec, t, ones, slices, cuts)
      opt1:step() opt2:step()
    end
    for i, e in ipairs(slices) do check_same(e.param, slice_of(ones[i].param, cuts[i]), recipe .. " " .. e.name) end
    if recipe == "sinkgd" then
      assert(opt2.by_name.embed_tokens.member.state.exp_avg:dtype() == "u8", "8-bit moments on the rows slice")
    end
  end
end)

-- (4) a NaN gradient on one rank only: every rank skips (host and device checks)
scenario("skip", function()
  for _, settings in ipairs { {}, { device_checks = true } } do
    local whole, slices, cuts = model(sink_spec, 41)
    settings.comm = comm
    local opt = ms.optim.new("sinkgd", slices, sink_opts, settings)
    fill(sink_spec, 1, nil, slices, cuts)
    opt:step()
    local before = {}
    for i, e in ipairs(slices) do before[i] = e.param:clone() end
    fill(sink_spec, 2, nil, slices, cuts)
    if RANK == 1 then slices[5].grad:fill_(0 / 0) end     -- "whole", which rank 0 owns: rank 1's copy counts too
    assert(opt.by_name.whole.member.owner == 0)
    local r = opt:step()
    local st = opt:stats()
    assert(r == false or (settings.device_checks and r == nil), "step returned " .. tostring(r))
    assert(st.last.skipped == true and st.skipped_steps == 1, "not skipped: " .. ms.json.encode(st.last))
    for i, e in ipairs(slices) do check_same(e.param, before[i], "skipped step changed " .. e.name) end
  end
  local _, slices, cuts = model(sink_spec, 42)
  local opt = ms.optim.new("sinkgd", slices, sink_opts, { comm = comm, nonfinite = "raise" })
  fill(sink_spec, 1, nil, slices, cuts)
  if RANK == 0 then slices[1].grad:fill_(1 / 0) end
  local ok, err = pcall(opt.step, opt)
  assert(not ok, "no error")
  assert(tostring(err):find(RANK == 0 and "non%-finite gradients in rows" or "the gradients of another rank"), err)
end)

-- (5) clip_grad_norm over the world: one rank's norm and clipping
scenario("clip", function()
  for _, settings in ipairs { { clip_grad_norm = 0.5 }, { clip_grad_norm = 0.5, device_checks = true } } do
    for _, distribute in ipairs { "owner", "replicate" } do
      local whole, slices, cuts = model(sink_spec, 51)
      local ones = whole_entries(sink_spec, whole)
      local opt1 = ms.optim.new("adamw", ones, { lr = 0.01 }, settings)
      local s2 = { comm = comm, distribute = distribute }
      for k, v in pairs(settings) do s2[k] = v end
      local opt2 = ms.optim.new("adamw", slices, { lr = 0.01 }, s2)
      for t = 1, 3 do
        fill(sink_spec, t, ones, slices, cuts)
        opt1:step() opt2:step()
        local n1, n2 = opt1:stats().last.grad_norm, opt2:stats().last.grad_norm
        assert(n1 > 1 and math.abs(n1 - n2) <= 1e-6 * n1, ("step %d: global norm %.17g, one rank's %.17g"):format(t, n2, n1))
        assert(opt2:stats().last.clipped == true)
      end
      for i, e in ipairs(slices) do check_same(e.param, slice_of(ones[i].param, cuts[i]), distribute .. " " .. e.name, 1e-6) end
    end
  end
end)

-- (6) checkpoints across world sizes
local function continue(opt, entries, spec, cuts, from, to, whole_grads)
  for t = from, to do
    fill(spec, t, whole_grads and entries or nil, (not whole_grads) and entries or nil, cuts)
    opt:step()
  end
end
scenario("checkpoint_dash", function()
  local o = { inv_root_method = "auto", block_size = 4, algo_one_dim = "shampoo", inv_root_freq = 2, auto_reclassify_every = 2, mu = 0.3 }
  local path = DIR .. "/dash.ckpt"
  -- 2 -> 1: the 2-rank run saves at step 3; one rank continues from it as the 2-rank run does
  local whole = model(dash_spec, 61)
  local two = whole_entries(dash_spec, whole)
  local opt2 = ms.optim.new("dash", two, o, { comm = comm })
  continue(opt2, two, dash_spec, {}, 1, 3, true)
  opt2:save(path)
  local at3 = {}
  for i, e in ipairs(two) do at3[i] = e.param:clone() end
  continue(opt2, two, dash_spec, {}, 4, 6, true)
  local one = whole_entries(dash_spec, at3)
  local opt1 = ms.optim.new("dash", one, o)
  opt1:load(path)
  assert(opt1.step_count == 3)
  continue(opt1, one, dash_spec, {}, 4, 6, true)
  for i, e in ipairs(one) do check_same(e.param, two[i].param, "2 -> 1 " .. e.name) end
  -- 1 -> 2: rank 0 saves a 1-rank run at step 3; both ranks continue it as owners
  local path1 = DIR .. "/dash1.ckpt"
  local ref = whole_entries(dash_spec, whole)
  local opt_ref = ms.optim.new("dash", ref, o)
  continue(opt_ref, ref, dash_spec, {}, 1, 3, true)
  if RANK == 0 then opt_ref:save(path1) end
  barrier()
  for i, e in ipairs(ref) do at3[i] = e.param:clone() end
  continue(opt_ref, ref, dash_spec, {}, 4, 6, true)
  local again = whole_entries(dash_spec, at3)
  local opt3 = ms.optim.new("dash", again, o, { comm = comm })
  opt3:load(path1)
  continue(opt3, again, dash_spec, {}, 4, 6, true)
  for i, e in ipairs(again) do check_same(e.param, ref[i].param, "1 -> 2 " .. e.name) end
end)

scenario("checkpoint_sinkgd", function()
  local path = DIR .. "/sink.ckpt"
  -- 2 -> 1: the state joins exactly; one rank continues as the 2-rank run does
  local whole, slices, cuts = model(sink_spec, 71)
  local opt2 = ms.optim.new("sinkgd", slices, sink_opts, { comm = comm })
  continue(opt2, slices, sink_spec, cuts, 1, 3)
  opt2:save(path)
  local at3 = {}
  for i, e in ipairs(slices) do
    local c = cuts[i]
    at3[i] = c and gather_whole(e.param, c.axis, c.lo, sink_spec[i][2][c.axis + 1]) or e.param:clone()
  end
  local ones = whole_entries(sink_spec, at3)
  local opt1 = ms.optim.new("sinkgd", ones, sink_opts)
  opt1:load(path)
  -- state joined: u of the cols slices, 8-bit codes and scales of the rows slices, the owner's moments
  local m2, m1 = opt2.by_name.cols.member, opt1.by_name.cols.member
  check_same(gather_whole(m2.state.specnorm_u, 0, cuts[2].lo, 10), m1.state.specnorm_u, "u of cols")
  check_same(opt2.by_name.rows.member.state.specnorm_u, opt1.by_name.rows.member.state.specnorm_u, "u of rows")
  local e2, e1 = opt2.by_name.embed_tokens.member.state, opt1.by_name.embed_tokens.member.state
  check_same(gather_whole(e2.exp_avg, 0, cuts[4].lo, 32), e1.exp_avg:to("f32"), "8-bit codes")
  -- one scale per block of 256 elements: a row of embed_tokens each
  check_same(gather_whole(e2.exp_avg_scale, 0, cuts[4].lo, 32), e1.exp_avg_scale, "8-bit scales")
  continue(opt2, slices, sink_spec, cuts, 4, 5)
  continue(opt1, ones, sink_spec, {}, 4, 5, true)
  for i, e in ipairs(slices) do check_same(e.param, slice_of(ones[i].param, cuts[i]), "2 -> 1 " .. e.name, 2e-6) end
  -- 1 -> 2: rank 0 saves one rank's run; the ranks take their slices of its state
  local path1 = DIR .. "/sink1.ckpt"
  local ref = whole_entries(sink_spec, whole)
  local opt_ref = ms.optim.new("sinkgd", ref, sink_opts)
  continue(opt_ref, ref, sink_spec, {}, 1, 3, true)
  if RANK == 0 then opt_ref:save(path1) end
  barrier()
  local _, again, _ = model(sink_spec, 71)
  for i, e in ipairs(again) do e.param:copy_(slice_of(ref[i].param, cuts[i])) end
  local opt3 = ms.optim.new("sinkgd", again, sink_opts, { comm = comm })
  opt3:load(path1)
  local u3 = opt3.by_name.cols.member.state.specnorm_u
  check_same(u3, opt_ref.by_name.cols.member.state.specnorm_u:slice(0, cuts[2].lo, cuts[2].hi), "u slice")
  continue(opt_ref, ref, sink_spec, {}, 4, 5, true)
  continue(opt3, again, sink_spec, cuts, 4, 5)
  for i, e in ipairs(again) do check_same(e.param, slice_of(ref[i].param, cuts[i]), "1 -> 2 " .. e.name, 2e-6) end
  -- 2 -> 2 bit for bit, and the parts' errors name the file
  local _, same, _ = model(sink_spec, 71)
  for i, e in ipairs(same) do e.param:copy_(slices[i].param) end
  opt2:save(path)
  continue(opt2, slices, sink_spec, cuts, 6, 7)
  local opt4 = ms.optim.new("sinkgd", same, sink_opts, { comm = comm })
  opt4:load(path)
  continue(opt4, same, sink_spec, cuts, 6, 7)
  for i, e in ipairs(same) do check_same(e.param, slices[i].param, "2 -> 2 " .. e.name) end
  barrier()
  if RANK == 0 then os.remove(path .. ".rank1-of-2") end
  barrier()
  local ok, err = pcall(opt4.load, opt4, path)
  assert(not ok and tostring(err):find("sink.ckpt.rank1%-of%-2") and tostring(err):find("cannot be read"), tostring(err))
  barrier()
  if RANK == 0 then
    local f = assert(io.open(path .. ".rank1-of-2", "w")) f:write("not a checkpoint") f:close()
  end
  barrier()
  ok, err = pcall(opt4.load, opt4, path)
  assert(not ok and tostring(err):find("sink.ckpt.rank1%-of%-2"), tostring(err))
end)

-- the same world sharded another way: rows -> cols (u, whole in every rows part, is cut by columns here) and
-- cols -> rows (u's slices joined) continue as the uninterrupted run
scenario("checkpoint_reshard", function()
  local path = DIR .. "/reshard.ckpt"
  local rows = { { "m", { 6, 8 }, shard = { "rows", { 0, 3 } } } }
  local cols = { { "m", { 6, 8 }, shard = { "cols", { 0, 4 } } } }
  for _, pair in ipairs { { rows, cols }, { cols, rows } } do
    local from, to = pair[1], pair[2]
    local whole, slices, cuts = model(from, 93)
    local opt = ms.optim.new("sinkgd", slices, sink_opts, { comm = comm })
    continue(opt, slices, from, cuts, 1, 3)
    opt:save(path)
    local at3 = { gather_whole(slices[1].param, cuts[1].axis, cuts[1].lo, 6 + 2 * cuts[1].axis) }
    continue(opt, slices, from, cuts, 4, 5)
    local _, again, cuts2 = model(to, 93)
    again[1].param:copy_(slice_of(at3[1], cuts2[1]))
    local opt2 = ms.optim.new("sinkgd", again, sink_opts, { comm = comm })
    opt2:load(path)
    continue(opt2, again, to, cuts2, 4, 5)
    local done = gather_whole(slices[1].param, cuts[1].axis, cuts[1].lo, 6 + 2 * cuts[1].axis)
    check_same(again[1].param, slice_of(done, cuts2[1]), from[1].shard[1] .. " -> " .. to[1].shard[1], 2e-6)
  end
end)

-- a checkpoint one rank cannot load (the state of a parameter it owns is missing) is loaded by none: the
-- other rank's checks pass, but going on from the checkpoint there and from fresh state here would split
-- the world without an error
scenario("checkpoint_all_or_none", function()
  local path = DIR .. "/partial.ckpt"
  local function entries(names)
    local t = {}
    for i, n in ipairs(names) do
      local shape = ({ a = { 8, 8 }, b = { 4, 4 }, c = { 2, 2 } })[n]
      t[i] = { name = n, param = ms.randn(shape, { seed = 90 + i }), grad = ms.randn(shape, { seed = 95 + i }) }
    end
    return t
  end
  local opt = ms.optim.new("adamw", entries { "a", "b" }, { lr = 0.1 }, { comm = comm })
  for _ = 1, 3 do opt:step() end
  opt:save(path)
  -- c is new, owned by rank 1 (a: 64 elements to rank 0, then b and c to the less loaded rank 1)
  local grown = ms.optim.new("adamw", entries { "a", "b", "c" }, { lr = 0.1 }, { comm = comm })
  assert(grown.by_name.c.member.owner == 1 and grown.by_name.a.member.owner == 0, "owners")
  local before = {}
  for name, t in pairs(grown:_state_entries()) do before[name] = t:clone() end
  local ok, err = pcall(grown.load, grown, path)
  assert(not ok, "rank " .. RANK .. " loaded a checkpoint that rank 1 cannot load")
  local want = RANK == 1 and "tensor 'param/c/exp_avg" or "1 of the 2 ranks cannot load it"
  assert(tostring(err):find(want, 1, true), tostring(err))
  assert(grown.step_count == 0, "step count " .. grown.step_count)
  for name, t in pairs(grown:_state_entries()) do check_same(t, before[name], "state " .. name .. " after the refusal") end
  -- and the world goes on
  grown:step()
end)

-- a part that one rank cannot even gather (its route's state does not follow the shard there) fails the save on
-- every rank at once, each saying why, and the world goes on
scenario("save_gather_fails", function()
  local probe = {
    name = "probe", options = { lr = { default = 0.1, type = "number" } },
    route = function() return "r" end,
    routes = { r = {
      init = function(g) for _, m in ipairs(g) do m.state.buf = ms.zeros(RANK == 1 and { 3 } or m.param:shape()) end end,
      step = function() end,
      state_shard = function() if RANK == 1 then return 0 end end,
    } },
  }
  local opt = ms.optim.new(probe, { { name = "w", param = ms.zeros({ 4, 3 }), grad = ms.zeros({ 4, 3 }),
                                      shard = { dim = "rows", offset = RANK * 4, size = 8 } } }, {}, { comm = comm })
  opt:step()
  local t0 = os.time()
  local ok, err = pcall(opt.save, opt, DIR .. "/gather.ckpt")
  assert(not ok, "saved")
  local want = RANK == 1 and "state 'buf' of parameter 'w' ([3]) does not follow its shard"
               or "1 of the 2 ranks could not write their part of " .. DIR .. "/gather.ckpt"
  assert(tostring(err):find(want, 1, true), tostring(err))
  assert(os.time() - t0 < 10, "the save waited for the timeout")
  local t = ms.ones({ 2 })
  comm:all_reduce(t)
  check_same(t, ms.full({ 2 }, 2), "after the failed save")
end)

-- a save that one rank cannot write (its disk full) leaves the checkpoint already at that path loadable: the
-- two small AdamW parameters, the same on every rank (the save and load scenarios below)
local function two_entries()
  local function p(name, shape) return { name = name, param = ms.randn(shape, { seed = 7 }), grad = ms.ones(shape) } end
  return { p("w", { 4, 4 }), p("v", { 3, 2 }) }
end

-- other ranks' parts of the new step must not have replaced theirs
scenario("save_fails_keeps_old", function()
  local path = DIR .. "/keep.ckpt"
  local opt = ms.optim.new("adamw", two_entries(), { lr = 0.1 }, { comm = comm })
  opt:step() opt:step()
  opt:save(path)
  opt:step()
  local real = ms.save
  if RANK == 1 then ms.save = function() error("no space left on device", 0) end end
  local ok, err = pcall(opt.save, opt, path)
  ms.save = real
  assert(not ok, "saved")
  assert(tostring(err):find(RANK == 1 and "keep.ckpt.rank1-of-2: no space left on device"
                            or "1 of the 2 ranks could not write their part of", 1, true), tostring(err))
  local again = ms.optim.new("adamw", two_entries(), { lr = 0.1 }, { comm = comm })
  again:load(path)
  assert(again.step_count == 2, "loaded step " .. again.step_count)
  local f = io.open(path .. ".rank" .. RANK .. "-of-2.partial")
  assert(f == nil, "a staged part was left behind")
end)

-- ranks given different checkpoints (a stale copy on one host) refuse the load on every rank, changing nothing
scenario("load_different_steps", function()
  local opt = ms.optim.new("adamw", two_entries(), { lr = 0.1 }, { comm = comm })
  opt:step() opt:step()
  opt:save(DIR .. "/at2.ckpt")
  opt:step()
  opt:save(DIR .. "/at3.ckpt")
  local again = ms.optim.new("adamw", two_entries(), { lr = 0.1 }, { comm = comm })
  local ok, err = pcall(again.load, again, DIR .. (RANK == 0 and "/at2.ckpt" or "/at3.ckpt"))
  assert(not ok, "loaded")
  assert(tostring(err):find("the ranks load checkpoints of different steps or learning rates (this rank's: step "
                            .. (RANK == 0 and 2 or 3) .. ")", 1, true), tostring(err))
  assert(again.step_count == 0, "step count " .. again.step_count)
  again:load(DIR .. "/at3.ckpt")
  assert(again.step_count == 3 and again:step() == true)
end)

-- what recipes see: the whole shape, the slice's, the shard, the world; owners alone init and step
scenario("info", function()
  local seen = {}
  local probe = {
    name = "probe", options = { lr = { default = 0.1, type = "number" } },
    route = function(p) seen[p.name] = p return "r" end,
    routes = { r = {
      init = function(g) for _, m in ipairs(g) do seen[m.name .. ":init"] = true end end,
      step = function(g, o, ctx) seen.world = ctx.world for _, m in ipairs(g) do seen[m.name .. ":step"] = true end end,
    } },
  }
  local _, slices = model(sink_spec, 81)
  local opt = ms.optim.new(probe, slices, {}, { comm = comm })
  opt:step()
  local r = seen.rows
  assert(table.concat(r.shape, ",") == "9,6" and r.numel == 54, "global shape " .. table.concat(r.shape, ","))
  assert(table.concat(r.local_shape, ",") == (RANK == 0 and "5,6" or "4,6"), "local shape")
  assert(r.shard.dim == "rows" and r.shard.offset == (RANK == 0 and 0 or 5) and r.shard.size == 9, "shard")
  assert(table.concat(seen.cols.shape, ",") == "6,10" and seen.cols.shard.dim == "cols", "cols")
  assert(seen.whole.shard == nil and table.concat(seen.whole.shape, ",") == "5,7", "whole")
  assert(seen.world.rank == RANK and seen.world.size == 2, "ctx.world")
  for _, m in ipairs(opt.members) do
    local mine = m.shard ~= nil or m.owner == RANK
    assert((seen[m.name .. ":init"] == true) == mine and (seen[m.name .. ":step"] == true) == mine,
           ("%s: owner %s, init %s, step %s"):format(m.name, tostring(m.owner), tostring(seen[m.name .. ":init"]),
           tostring(seen[m.name .. ":step"])))
  end
  local data = opt:info()
  for _, p in ipairs(data.params) do
    if p.name == "whole" then assert(p.owner == opt.by_name.whole.member.owner) end
    if p.name == "rows" then assert(p.shard.dim == "rows") end
  end
end)

-- (7) refusals
scenario("errors", function()
  local function expect(fn, ...)
    local ok, err = pcall(fn)
    assert(not ok, "no error")
    for _, s in ipairs { ... } do assert(tostring(err):find(s, 1, true), ("'%s' not in: %s"):format(s, tostring(err))) end
  end
  local function sharded(lo, hi, size, dim, name)
    local shape = dim == "cols" and { 3, hi - lo } or { hi - lo, 3 }
    return { name = name or "w", param = ms.zeros(shape), grad = ms.zeros(shape), shard = { dim = dim or "rows", offset = lo, size = size } }
  end
  -- overlapping and gapped slices
  expect(function() ms.optim.new("adamw", { RANK == 0 and sharded(0, 4, 8) or sharded(3, 8, 8) }, {}, { comm = comm }) end,
         "parameter 'w'", "do not tile [0, 8)", "rank 0 [0, 4), rank 1 [3, 8)")
  expect(function() ms.optim.new("adamw", { RANK == 0 and sharded(0, 3, 8, "cols") or sharded(4, 8, 8, "cols") }, {}, { comm = comm }) end,
         "cols do not tile", "rank 0 [0, 3), rank 1 [4, 8)")
  -- sharded alike, the same parameters, one rank's refusal stops both
  expect(function() ms.optim.new("adamw", { RANK == 0 and sharded(0, 4, 8) or sharded(0, 4, 8, "cols") }, {}, { comm = comm }) end,
         "parameter 'w' is sharded by")
  expect(function() ms.optim.new("adamw", { sharded(0, 4, 4, "rows", RANK == 0 and "w" or "v") }, {}, { comm = comm }) end,
         "parameter 1 is '", "every rank must give the same parameters")
  local bad = sharded(0, 4, 8)
  if RANK == 1 then bad.shard.dim = "diagonal" end
  expect(function() ms.optim.new("adamw", { bad }, {}, { comm = comm }) end,
         RANK == 1 and "shard dim must be 'rows' or 'cols'" or "rank 1 refused its shard")
  -- DASH takes whole parameters
  expect(function() ms.optim.new("dash", { RANK == 0 and sharded(0, 4, 8) or sharded(4, 8, 8) }, {}, { comm = comm }) end,
         "dash: parameter 'w' is sharded")
  -- so does Muon (Newton-Schulz on a slice would orthogonalise the slice alone)
  expect(function() ms.optim.new("muon", { RANK == 0 and sharded(0, 4, 8) or sharded(4, 8, 8) }, {}, { comm = comm }) end,
         "muon: parameter 'w' is sharded")
  -- the world still works
  local t = ms.ones({ 2 })
  comm:all_reduce(t)
  check_same(t, ms.full({ 2 }, 2), "after the errors")
end)
-- (8) what decides the collectives is compared before anything waits on it: a rank with fewer (or no)
-- parameters, another distribute, nonfinite or clip_grad_norm, another recipe or options -- each an error on
-- every rank, with the communicator still usable
scenario("agree", function()
  local function expect(fn, ...)
    local ok, err = pcall(fn)
    assert(not ok, "no error")
    for _, s in ipairs { ... } do assert(tostring(err):find(s, 1, true), ("'%s' not in: %s"):format(s, tostring(err))) end
  end
  local function p(name, shape) return { name = name, param = ms.zeros(shape), grad = ms.zeros(shape) } end
  local function new(recipe, params, options, settings)
    settings = settings or {}
    settings.comm = comm
    return function() ms.optim.new(recipe, params, options or {}, settings) end
  end
  expect(new("adamw", RANK == 0 and { p("w", { 4, 4 }) } or {}), "rank " .. (1 - RANK) .. " gives " .. (RANK == 0 and 0 or 1),
         "every rank must give the same parameters")
  expect(new("adamw", RANK == 0 and { p("w", { 4, 4 }), p("v", { 2, 2 }) } or { p("w", { 4, 4 }) }),
         "rank " .. (1 - RANK) .. " gives " .. (RANK == 0 and 1 or 2) .. " parameters")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { distribute = RANK == 0 and "owner" or "replicate" }), "setting distribute")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { clip_grad_norm = RANK == 0 and 1 or nil }), "setting clip_grad_norm")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { nonfinite = RANK == 0 and "skip" or "apply" }), "setting nonfinite")
  -- the settings that change the step's result or collectives without changing the options: another schedule
  -- would step the ranks' slices with other learning rates, silently
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { schedule = RANK == 0 and { kind = "cosine", total_steps = 10 } or nil }),
         "setting schedule differs")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { schedule = { kind = "cosine", total_steps = RANK == 0 and 10 or 20 } }),
         "setting schedule differs")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { master_weights = RANK == 0 }), "setting master_weights differs")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { device_checks = RANK == 1 }), "setting device_checks differs")
  expect(new("adamw", { p("w", { 4, 4 }) }, {}, { stats = RANK == 1 }), "setting stats differs")
  new("adamw", { p("w", { 4, 4 }) }, {}, { schedule = { kind = "cosine", total_steps = 10 }, device_checks = true })()
  expect(new(RANK == 0 and "adamw" or "sinkgd", { p("w", { 4, 4 }) }), "another recipe")
  expect(new("adamw", { p("w", { 4, 4 }) }, { lr = RANK == 0 and 0.1 or 0.2 }), "other options")
  -- the same numel in another shape or dtype: owners would be assigned differently (2+ dims by numel, the
  -- others round robin), and the broadcasts would disagree
  expect(new("adamw", { p("w", RANK == 0 and { 4, 4 } or { 16 }), p("b", { 3 }) }),
         "parameter 'w' has shape " .. (RANK == 0 and "[4,4]" or "[16]") .. " here but another on rank " .. (1 - RANK))
  local typed = { p("w", { 4, 4 }) }
  if RANK == 1 then typed[1].param, typed[1].grad = ms.zeros({ 4, 4 }, { dtype = "bf16" }), ms.zeros({ 4, 4 }, { dtype = "bf16" }) end
  expect(new("adamw", typed), "parameter 'w' is", RANK == 0 and "bf16 on rank 1" or "f32 on rank 0")
  -- a rank that refuses its own arguments (checked before any collective) does not leave the others waiting
  local t0 = os.time()
  local bad = { p("w", { 4, 4 }) }
  if RANK == 1 then bad[1].grad = ms.zeros({ 4, 3 }) end
  expect(new("adamw", bad), RANK == 1 and "grad shape [4,3] != param shape [4,4]" or "rank 1 cannot make its optimizer")
  expect(new(RANK == 1 and "no_such_recipe" or "adamw", { p("w", { 4, 4 }) }),
         RANK == 1 and "no_such_recipe" or "rank 1 cannot make its optimizer")
  assert(os.time() - t0 < 10, "the refusals waited for the timeout")
  -- the world still works, and agreeing ranks still build their optimizers
  new("adamw", { p("w", { 4, 4 }) }, { lr = 0.1 }, { clip_grad_norm = 1 })()
  local t = ms.ones({ 2 })
  comm:all_reduce(t)
  check_same(t, ms.full({ 2 }, 2), "after the refusals")
end)
-- (9) gradients given to different parameters on the two ranks: every rank refuses the step (host checks,
-- with and without clipping), nothing changes, and the next step runs
scenario("grad_sets", function()
  for _, settings in ipairs { {}, { nonfinite = "apply", clip_grad_norm = 100 } } do
    local function p(name, shape) return { name = name, param = ms.randn(shape, { seed = 7 }), grad = ms.ones(shape) } end
    local ps = { p("w", { 4, 4 }), p("v", { 3, 2 }), p("b", { 4 }) }
    settings.comm = comm
    local opt = ms.optim.new("adamw", ps, { lr = 0.1 }, settings)
    assert(opt:step() == true)
    local before = {}
    for i, e in ipairs(ps) do before[i] = e.param:clone() end
    for _, drop in ipairs { { "v" }, { "w", "v", "b" } } do   -- one parameter, then all of them, on rank 1
      if RANK == 1 then for _, n in ipairs(drop) do opt:set_grad(n, nil) end end
      local ok, err = pcall(opt.step, opt)
      assert(not ok, "the step ran")
      assert(tostring(err):find("step 2: the ranks give gradients to different parameters (this rank to "
                                .. ((RANK == 1 and 3 - #drop) or 3) .. ")", 1, true), tostring(err))
      for i, e in ipairs(ps) do check_same(e.param, before[i], "refused step changed " .. e.name) end
      if RANK == 1 then for i, e in ipairs(ps) do opt:set_grad(e.name, ps[i].grad) end end
    end
    assert(opt:step() == true, "the step after the refusals")
    assert(opt.step_count == 2)
  end
  local t = ms.ones({ 2 })
  comm:all_reduce(t)
  check_same(t, ms.full({ 2 }, 2), "after the refusals")
end)
-- (10) a learning rate set on one rank only (a plateau scheduler fed this rank's loss): every rank refuses the
-- step, changing nothing, instead of stepping the slices with different rates
scenario("lr_differs", function()
  local whole, slices, cuts = model(sink_spec, 91)
  local opt = ms.optim.new("sinkgd", slices, sink_opts, { comm = comm })
  fill(sink_spec, 1, nil, slices, cuts)
  assert(opt:step() == true)
  local before = {}
  for i, e in ipairs(slices) do before[i] = e.param:clone() end
  if RANK == 1 then opt:set_lr(0.01) end
  local ok, err = pcall(opt.step, opt)
  assert(not ok, "the step ran")
  assert(tostring(err):find("step 2: the ranks step with different learning rates, step counts or grad_scale (this "
                            .. "rank: lr " .. (RANK == 1 and "0.01" or "0.02") .. " at step 2, grad_scale 1)", 1, true),
         tostring(err))
  for i, e in ipairs(slices) do check_same(e.param, before[i], "refused step changed " .. e.name) end
  opt:set_lr(0.01)
  -- a loss scale on one rank only: its sums of squares would be unscaled alone (the global norm wrong)
  ok, err = pcall(opt.step, opt, { grad_scale = RANK == 0 and 1024 or nil })
  assert(not ok, "the step with one rank's grad_scale ran")
  assert(tostring(err):find("(this rank: lr 0.01 at step 2, grad_scale " .. (RANK == 0 and 1024 or 1) .. ")", 1, true),
         tostring(err))
  for i, e in ipairs(slices) do check_same(e.param, before[i], "refused step changed " .. e.name) end
  assert(opt:step() == true, "the step after the refusals")
end)
print("done " .. RANK)
]==]

-- one launch of the rank script for every scenario (a few seconds), its results by scenario and rank
local results, output, exit_code
local function run_ranks()
  if results then return results end
  local dir = H.tmpdir()
  local path = dir .. "/ranks.lua"
  H.write_file(path, rank_script)
  -- passive OpenMP waits: two processes spinning on few cores would starve each other's collectives
  output, exit_code = H.moonstep(("launch -n 2 %s %s"):format(q(path), q(dir)), "OMP_WAIT_POLICY=passive timeout 120")
  os.execute("rm -rf " .. q(dir))
  results = {}
  for rank, name, status, why in output:gmatch("result (%d) (%S+) (%S+) ([^\n]*)") do
    results[name] = results[name] or {}
    results[name][tonumber(rank)] = { ok = status == "ok", why = why }
  end
  return results
end

local function passes(name)
  local res = run_ranks()[name]
  assert(res and res[0] and res[1], ("scenario %s did not report on both ranks:\n%s"):format(name, output))
  for r = 0, 1 do assert(res[r].ok, ("scenario %s, rank %d: %s"):format(name, r, res[r].why)) end
  assert(exit_code == 0, ("the ranks exited with %s:\n%s"):format(tostring(exit_code), output))
end

describe("several ranks (settings.comm) on the CPU, through `moonstep launch -n 2`", function()
  it("DASH: owners on 2 ranks give one rank's parameters bit for bit, each rank stacking only its blocks", function()
    passes("dash_owner")
  end)
  it("SinkGD on rows- and cols-sharded matrices (and AdamW on 8-bit row slices) gives one rank's update", function()
    passes("sinkgd_sharded")
  end)
  it("SinkGD's AdamW keeps f32 moments on a block-aligned slice of a matrix one rank keeps in f32", function()
    passes("sinkgd_8bit_whole_f32")
  end)
  it("stats: a sharded parameter's update norm is the whole parameter's", function() passes("stats_sharded") end)
  it("distribute = 'replicate': every rank steps every parameter, as one rank does", function() passes("replicate") end)
  it("stochastic rounding: owners and slices (rows, columns, stacks) round as one rank does, bit for bit", function()
    passes("stochastic_rounding")
  end)
  it("a NaN gradient on one rank makes every rank skip (host and device checks); 'raise' raises on both", function()
    passes("skip")
  end)
  it("clip_grad_norm clips by the norm over the world, each parameter counted once (owner, replicate)", function()
    passes("clip")
  end)
  it("recipes see the whole shape, the slice's, the shard and the world; owners alone init and step", function()
    passes("info")
  end)
  it("DASH checkpoints 2 -> 1 and 1 -> 2 continue as the uninterrupted run, bit for bit", function()
    passes("checkpoint_dash")
  end)
  it("sharded state joins and splits exactly 2 -> 1, 1 -> 2, 2 -> 2; missing or corrupt parts are named", function()
    passes("checkpoint_sinkgd")
  end)
  it("a part that one rank cannot gather fails the save on every rank at once, each saying why", function()
    passes("save_gather_fails")
  end)
  it("sharded state loads into the same world sharded another way (rows <-> cols)", function()
    passes("checkpoint_reshard")
  end)
  it("a save that one rank cannot write leaves the checkpoint already there loadable", function()
    passes("save_fails_keeps_old")
  end)
  it("ranks given checkpoints of different steps refuse the load on every rank", function()
    passes("load_different_steps")
  end)
  it("a checkpoint that one rank cannot load is loaded by none, each rank saying why", function()
    passes("checkpoint_all_or_none")
  end)
  it("refuses slices that do not tile, parameters that differ between ranks and sharded DASH parameters", function()
    passes("errors")
  end)
  it("refuses a step whose learning rate or grad_scale differs on another rank, on every rank, changing nothing", function()
    passes("lr_differs")
  end)
  it("refuses a step whose gradients go to other parameters on another rank, on every rank, changing nothing", function()
    passes("grad_sets")
  end)
  it("refuses ranks whose parameter counts, recipe, options, schedule or collective settings differ, before any waits", function()
    passes("agree")
  end)
end)

describe("settings.comm and distribute in one process", function()
  local function params(seed)
    return {
      { name = "w", param = ms.randn({ 6, 4 }, { seed = seed }), grad = ms.randn({ 6, 4 }, { seed = seed + 1 }) },
      { name = "b", param = ms.randn({ 4 }, { seed = seed + 2 }), grad = ms.randn({ 4 }, { seed = seed + 3 }) },
    }
  end
  local function one_rank_comm() return ms.comm.new { ctx = ms.device("cpu"), rank = 0, world_size = 1 } end

  it("refuses a comm that is no communicator and an unknown distribute, naming the setting", function()
    H.expect_error(function() ms.optim.new("adamw", params(1), {}, { comm = {} }) end, "setting comm must be a communicator")
    H.expect_error(function() ms.optim.new("adamw", params(1), {}, { comm = 3 }) end, "setting comm must be a communicator", "3")
    local freed = one_rank_comm()
    freed:free()
    H.expect_error(function() ms.optim.new("adamw", params(1), {}, { comm = freed }) end, "setting comm")
    H.expect_error(function() ms.optim.new("adamw", params(1), {}, { distribute = "scatter" }) end,
                   "setting distribute must be 'owner' or 'replicate'", "scatter")
  end)

  it("with a world of one rank changes nothing: the same parameters, ctx.world {0, 1}, whole shards only", function()
    local a, b = params(5), params(5)
    local world
    local opt1 = ms.optim.new("sinkgd", a, { lr = 0.01 })
    local opt2 = ms.optim.new("sinkgd", b, { lr = 0.01 }, { comm = one_rank_comm(), distribute = "owner" })
    assert.is_nil(opt2.dist)
    for _ = 1, 3 do opt1:step() opt2:step() end
    for i = 1, 2 do assert.are.same(a[i].param:tolist_flat(), b[i].param:tolist_flat()) end
    local probe = { name = "probe", options = { lr = { default = 0.1, type = "number" } }, route = function() return "r" end,
                    routes = { r = { step = function(_, _, ctx) world = ctx.world end } } }
    local whole = params(6)
    whole[1].shard = { dim = "rows", offset = 0, size = 6 }
    ms.optim.new(probe, whole, {}, { comm = one_rank_comm() }):step()
    assert.are.same({ rank = 0, size = 1 }, world)
    local function refused(shard, ...)
      local ps = params(7)
      ps[1].shard = shard
      H.expect_error(function() ms.optim.new("adamw", ps, {}, { comm = one_rank_comm() }) end, "parameter 'w'", ...)
    end
    refused({ dim = "rows", offset = 2, size = 8 }, "rows [2, 8) of [0, 8)", "no other rank")
    refused({ dim = "cols", offset = 0, size = 3 }, "outside [0, 3)")
    refused({ dim = "rows", offset = -1, size = 6 }, "offset must be an integer >= 0")
    refused({ dim = "rows", offset = 0, size = 0 }, "size must be an integer >= 1")
    refused({ dim = "depth", offset = 0, size = 6 }, "dim must be 'rows' or 'cols'")
    refused("rows", "must be a table")
    local ps = params(8)
    ps[2].shard = { dim = "rows", offset = 0, size = 4 }
    H.expect_error(function() ms.optim.new("adamw", ps) end, "parameter 'b'", "2 or more dims")
  end)

  it("DASH gives every parameter the same update whatever the others, and loads checkpoints block by block", function()
    -- the stacks of {a, b, c} and of {c, a} hold the same blocks at other places; random starts (NDB's power
    -- iteration, auto's estimates) follow each parameter, so the updates and the checkpoint's blocks agree
    local shapes = { a = { 9, 7 }, b = { 5, 8 }, c = { 6, 6 } }
    local function make(names, seed)
      local ps = {}
      for i, n in ipairs(names) do
        ps[i] = { name = n, param = ms.randn(shapes[n], { seed = seed, offset = #n + n:byte() }), grad = ms.zeros(shapes[n]) }
      end
      return ps
    end
    local function fill(ps, t)
      for _, p in ipairs(ps) do p.grad:copy_(ms.randn(shapes[p.name], { seed = 300 + t, offset = p.name:byte() })) end
    end
    local by = function(ps) local t = {} for _, p in ipairs(ps) do t[p.name] = p end return t end
    local path = os.tmpname()
    for _, o in ipairs {
      { inv_root_method = "ndb", block_size = 4, inv_root_freq = 2, eps_inv_root = 1e-3 },
      { inv_root_method = "auto", block_size = 4, inv_root_freq = 1, auto_reclassify_every = 2 },
    } do
      local all, two = make({ "a", "b", "c" }, 9), make({ "c", "a" }, 9)
      local opt_all, opt_two = ms.optim.new("dash", all, o), ms.optim.new("dash", two, o)
      for t = 1, 3 do fill(all, t) fill(two, t) opt_all:step() opt_two:step() end
      local A, B = by(all), by(two)
      for _, n in ipairs { "a", "c" } do
        assert.are.same(A[n].param:tolist_flat(), B[n].param:tolist_flat(), o.inv_root_method .. " " .. n)
      end
      -- {a, b, c} saved, loaded into {c, b, a}: its stacks' slots in another order
      opt_all:save(path)
      local back = make({ "c", "b", "a" }, 9)
      for _, p in ipairs(back) do p.param:copy_(A[p.name].param) end
      local opt_back = ms.optim.new("dash", back, o)
      opt_back:load(path)
      for t = 4, 5 do fill(all, t) fill(back, t) opt_all:step() opt_back:step() end
      local C = by(back)
      for n in pairs(shapes) do
        assert.are.same(A[n].param:tolist_flat(), C[n].param:tolist_flat(), o.inv_root_method .. " resumed " .. n)
      end
      -- a checkpoint of other parameters names the block it lacks
      local other = make({ "a", "c" }, 9)
      H.expect_error(function() ms.optim.new("dash", other, o):load(path) end, "block 'b@", "has no place")
      local reshaped = { { name = "a", param = ms.randn({ 5, 8 }, { seed = 4 }), grad = ms.zeros({ 5, 8 }) } }
      H.expect_error(function() ms.optim.new("dash", reshaped, o):load(path, { force = true }) end, "block 'a@",
                     "is missing from the checkpoint")
    end
    os.remove(path)
  end)
end)
