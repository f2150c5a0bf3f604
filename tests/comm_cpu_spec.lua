-- The CPU communicator (moonstep.h, "Communicators"): ranks started by `moonstep launch -n 2` and `-n 3` on
-- CPU contexts, joined over TCP through rank 0.  Every collective in every dtype and op, in place and out of
-- place, against the same computation on the CPU (in rank order; bf16/f16 through f32), which is itself
-- checked against the f64 formula; groups; NaN; a buffer larger than the sockets' buffers; and the failures:
-- arguments refused locally, ranks whose calls disagree, a rank that exits early or never calls, all ending
-- in an error on every rank within the timeout instead of a hang.
local q = H.q
local clock = require("moonstep.experiment").clock
local launch, write_script = H.moonstep, H.temp_file

-- What every rank script starts with: the helpers, a CPU communicator from the launcher's environment, and
-- each rank's inputs, which every rank can make (the references need all of them): seeded by the spec's
-- seed, the rank and a salt per use.
local prelude = [[
local H = dofile("tests/helpers.lua")
local SEED = tonumber(arg[1])
local cpu = ms.device("cpu")
local comm = ms.comm.from_env { ctx = cpu, timeout = tonumber(arg[2]) or 20 }
local rank, world = comm:rank(), comm:size()
assert(rank == tonumber(os.getenv("RANK")) and world == tonumber(os.getenv("WORLD_SIZE")))
assert(comm:context() == cpu)

local function numel(shape)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  return n
end

local function input(dt, r, shape, salt)
  local seed = SEED * 1000 + salt * 8 + r
  if dt == "i32" or dt == "u8" then
    math.randomseed(seed)
    local v = {}
    for i = 1, numel(shape) do v[i] = dt == "i32" and math.random(-1000000, 1000000) or math.random(1, 80) end
    return ms.tensor(v, { dtype = dt, ctx = cpu }):view(unpack(shape))   -- u8 sums stay below 256
  end
  return ms.randn(shape, { dtype = "f32", seed = seed, std = 3, ctx = cpu }):to(dt)
end
local function inputs(dt, shape, salt)
  local ins = {}
  for r = 0, world - 1 do ins[r + 1] = input(dt, r, shape, salt) end
  return ins
end

local function report(what, st)
  io.stdout:write(("%s %d %s\n"):format(what, rank, st))
  io.stdout:flush()
end
]]

-- ---------------------------------------------------------------------------------------------------
-- correctness
-- ---------------------------------------------------------------------------------------------------
local collectives = prelude .. [[
local dtypes = { "f32", "bf16", "f16", "f64", "i32", "u8" }
local cpu_op = { sum = ms.add, avg = ms.add, max = ms.maximum, min = ms.minimum }
local f64_op = { sum = function(a, b) return a + b end, max = math.max, min = math.min }
f64_op.avg = f64_op.sum

-- The CPU computation of op over the ranks' tensors: in rank order, bf16/f16 through f32 and rounded once
-- (what the communicator promises), checked against the f64 formula on the inputs.
local function reference(dt, op, ins)
  local wide = (dt == "bf16" or dt == "f16") and "f32" or dt
  local acc = ins[1]:to(wide)
  for r = 2, #ins do acc = cpu_op[op](acc, ins[r]:to(wide)) end
  if op == "avg" then acc = ms.div(acc, #ins) end
  acc = acc:to(dt)
  local lists, want = {}, {}
  for r = 1, #ins do lists[r] = ins[r]:tolist_flat() end
  for i = 1, #lists[1] do
    local x = lists[1][i]
    for r = 2, #ins do x = f64_op[op](x, lists[r][i]) end
    want[i] = op == "avg" and x / #ins or x
  end
  local rtol, atol = H.tols(dt)
  H.assert_close(acc:tolist_flat(), want, rtol, atol, ("reference %s %s"):format(dt, op))
  return acc:tolist_flat()
end

-- the communicator must give the reference's own values, bit for bit: the same sums in the same order
local function same(got, want, dt, op, what)
  H.assert_close(got:tolist_flat(), want, 0, 0, ("%s %s %s (rank %d of %d)"):format(what, dt, op, rank, world))
end

for salt, dt in ipairs(dtypes) do
  local float = dt ~= "i32" and dt ~= "u8"
  for oi, op in ipairs { "sum", "max", "min", "avg" } do
    if op ~= "avg" or float then
      -- all_reduce: out of place (the source kept), then in place
      local ins = inputs(dt, { 7, 13 }, 10 * salt + oi)
      local want = reference(dt, op, ins)
      local src = ins[rank + 1]:clone()
      local dst = ms.full({ 7, 13 }, 99, { dtype = dt, ctx = cpu })
      comm:all_reduce(dst, src, op)
      same(dst, want, dt, op, "all_reduce")
      H.assert_close(src:tolist_flat(), ins[rank + 1]:tolist_flat(), 0, 0, "all_reduce's source " .. dt)
      comm:all_reduce(src, op)
      same(src, want, dt, op, "all_reduce in place")

      -- reduce_scatter: rank r keeps rows [5r, 5r + 5) of the reduction; both shapes of src, and in place
      local big = inputs(dt, { world * 5, 3 }, 10 * salt + oi + 5)
      local full = reference(dt, op, big)
      local slice = {}
      for i = 1, 15 do slice[i] = full[rank * 15 + i] end
      local part = ms.full({ 5, 3 }, 99, { dtype = dt, ctx = cpu })
      comm:reduce_scatter(part, big[rank + 1], op)
      same(part, slice, dt, op, "reduce_scatter")
      comm:reduce_scatter(part, big[rank + 1]:view(world, 5, 3), op)
      same(part, slice, dt, op, "reduce_scatter of [world, 5, 3]")
      local whole = big[rank + 1]:clone()
      local mine = whole:view(world, 5, 3):select(0, rank)
      comm:reduce_scatter(mine, whole, op)
      same(mine, slice, dt, op, "reduce_scatter in place")
    end
  end

  -- broadcast from every root (rank 0's own too)
  local ins = inputs(dt, { 4, 9 }, 10 * salt + 7)
  for r = 0, world - 1 do
    local t = ins[rank + 1]:clone()
    comm:broadcast(t, r)
    H.assert_close(t:tolist_flat(), ins[r + 1]:tolist_flat(), 0, 0, ("broadcast %s from %d"):format(dt, r))
  end

  -- all_gather into [world, 37] and, in place, into [world * 37]
  ins = inputs(dt, { 37 }, 10 * salt + 8)
  local want = {}
  for r = 1, world do
    for _, x in ipairs(ins[r]:tolist_flat()) do want[#want + 1] = x end
  end
  local g = ms.full({ world, 37 }, 99, { dtype = dt, ctx = cpu })
  comm:all_gather(g, ins[rank + 1])
  H.assert_close(g:tolist_flat(), want, 0, 0, "all_gather " .. dt)
  local g2 = ms.full({ world * 37 }, 99, { dtype = dt, ctx = cpu })
  local piece = g2:view(world, 37):select(0, rank)
  piece:copy_(ins[rank + 1])
  comm:all_gather(g2, piece)
  H.assert_close(g2:tolist_flat(), want, 0, 0, "all_gather in place " .. dt)
  report("ok", dt)
end

-- a group of broadcasts, one from each rank, nested in another group: run in order on the CPU
local ins = inputs("f32", { 6 }, 90)
local ts = {}
for r = 0, world - 1 do ts[r + 1] = ins[rank + 1]:clone() end
comm:group(function()
  comm:group_begin()
  for r = 0, world - 1 do comm:broadcast(ts[r + 1], r) end
  comm:group_end()
end)
for r = 0, world - 1 do
  H.assert_close(ts[r + 1]:tolist_flat(), ins[r + 1]:tolist_flat(), 0, 0, "grouped broadcast from " .. r)
end
report("ok", "group")

-- NaN and infinities cross the ranks: the last rank has NaN at 0 and +inf at 1, rank 0 -inf at 2
local v = input("f32", rank, { 5 }, 91):tolist_flat()
if rank == world - 1 then v[1], v[2] = 0 / 0, math.huge end
if rank == 0 then v[3] = -math.huge end
for _, op in ipairs { "sum", "max", "min" } do
  local t = ms.tensor(v, { ctx = cpu })
  comm:all_reduce(t, op)
  local got = t:tolist_flat()
  assert(got[1] ~= got[1], op .. ": NaN was lost: " .. tostring(got[1]))
  if op == "sum" then assert(got[2] == math.huge and got[3] == -math.huge, op) end
  if op == "max" then assert(got[2] == math.huge, op) end
  if op == "min" then assert(got[3] == -math.huge, op) end
end
report("ok", "nan")

-- more than the sockets hold at once (4 MiB per rank), in place: every rank's sum equals the reference
local n = 2 ^ 20
local bigs = {}
for r = 0, world - 1 do bigs[r + 1] = ms.randn({ n }, { seed = SEED * 1000 + 500 + r, ctx = cpu }) end
local acc = bigs[1]
for r = 2, world do acc = ms.add(acc, bigs[r]) end
local mine = bigs[rank + 1]:clone()
comm:all_reduce(mine)
local diff = ms.sum(ms.abs(ms.sub(mine, acc)))
assert(diff == 0, "the large all_reduce differs from the reference by " .. tostring(diff))
local g = ms.empty({ world, n }, { ctx = cpu })
comm:all_gather(g, bigs[rank + 1])
for r = 0, world - 1 do
  local d = ms.sum(ms.abs(ms.sub(g:select(0, r), bigs[r + 1])))
  assert(d == 0, ("the large all_gather's piece %d differs by %s"):format(r, tostring(d)))
end
report("ok", "large")
comm:free()
report("done", "-")
]]

local function expect_all_ok(out, world, tags)
  for r = 0, world - 1 do
    for _, tag in ipairs(tags) do
      assert.is_truthy(out:find(("ok %d %s\n"):format(r, tag), 1, true), ("rank %d, %s:\n%s"):format(r, tag, out))
    end
    assert.is_truthy(out:find(("done %d -"):format(r), 1, true), out)
  end
end

describe("the CPU communicator between ranks of `moonstep launch`", function()
  local tags = { "f32", "bf16", "f16", "f64", "i32", "u8", "group", "nan", "large" }

  it("gives every collective in every dtype the CPU computation's values (2 ranks)", function()
    local s = write_script("collectives.lua", collectives)
    local out, code, wall = launch(("launch -n 2 %s %d"):format(q(s), H.seed()))
    assert.are.equal(0, code, out)
    expect_all_ok(out, 2, tags)
    assert.is_true(wall < 15, "took " .. wall .. " s")
  end)

  it("and between 3 ranks", function()
    local s = write_script("collectives.lua", collectives)
    local out, code, wall = launch(("launch -n 3 %s %d"):format(q(s), H.seed()))
    assert.are.equal(0, code, out)
    expect_all_ok(out, 3, tags)
    assert.is_true(wall < 15, "took " .. wall .. " s")
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- failures
-- ---------------------------------------------------------------------------------------------------
-- "status RANK STATUS MS MESSAGE" lines: what a failing collective said on each rank, and when
local function status_lines(out)
  local res = {}
  for r, st, ms_, msg in out:gmatch("status (%d+) (%S+) (%d+) ([^\n]*)") do
    res[tonumber(r)] = { status = st, ms = tonumber(ms_), msg = msg }
  end
  return res
end

local failing = prelude .. [[
local ffi = require("ffi")
local C = require("moonstep.core").C
local tensor = require("moonstep.tensor")
-- runs fn (a collective) and reports its status, message and time taken
local function attempt(fn)
  local t0 = require("moonstep.experiment").clock()
  local ok, err = pcall(fn)
  local ms_ = math.floor((require("moonstep.experiment").clock() - t0) * 1000)
  io.stdout:write(("status %d %s %d %s\n"):format(rank, ok and "ok" or "error", ms_, tostring(err):gsub("\n", " ")))
  io.stdout:flush()
  return ok
end
local x = input("f32", rank, { 8 }, 1)
local case = arg[3]
if case == "local" then
  -- refused before anything is sent: every rank refuses alike, and the communicator still works afterwards
  H.expect_error(function() comm:all_reduce(ms.empty({ 9 }, { ctx = cpu }), x) end, "dst has shape [9] but src [8]")
  H.expect_error(function() comm:all_reduce(ms.empty({ 8 }, { dtype = "f64", ctx = cpu }), x) end,
    "dst is f64 but src is f32")
  H.expect_error(function() comm:all_reduce(ms.randn({ 4, 4 }, { ctx = cpu }):transpose(0, 1)) end, "is not contiguous")
  H.expect_error(function() comm:all_reduce(ms.empty({ 8 }, { dtype = "i32", ctx = cpu }), "avg") end,
    "MS_COMM_AVG needs a float dtype")
  H.expect_error(function() comm:broadcast(x, world) end, ("root %d is outside [0, %d)"):format(world, world))
  H.expect_error(function() comm:all_gather(ms.empty({ world + 1, 8 }, { ctx = cpu }), x) end,
    ("with world size %d"):format(world))
  H.expect_error(function() comm:reduce_scatter(ms.empty({ 3 }, { ctx = cpu }), x) end, "with world size")
  H.expect_error(function() comm:all_reduce(x, "prod") end, "op must be one of sum, max, min, avg")
  local big = ms.empty({ world * 8 }, { ctx = cpu })
  H.expect_error(function() comm:all_gather(big, big:view(world, 8):select(0, (rank + 1) % world)) end,
    "share memory")
  H.expect_error(function() comm:group_end() end, "no group is open")
  local y = x:clone()
  comm:all_reduce(y, "max")
  report("ok", "after-refusals")
elseif case == "disagree" then
  -- rank 1 sums 9 elements where the others sum 8: every rank hears it, the call named for both
  attempt(function() comm:all_reduce(rank == 1 and input("f32", rank, { 9 }, 2) or x) end)
  -- and the communicator is done for
  attempt(function() comm:all_reduce(x) end)
elseif case == "empty" then
  -- empty on every rank: nothing to do, but still one call each (an empty reduce_scatter and all_gather too)
  local none = ms.empty({ 0 }, { ctx = cpu })
  attempt(function()
    comm:all_reduce(none) comm:broadcast(none, world - 1)
    comm:all_gather(ms.empty({ 0 }, { ctx = cpu }), none) comm:reduce_scatter(none, ms.empty({ 0 }, { ctx = cpu }))
    local y = x:clone()
    comm:all_reduce(y)
  end)
  -- rank 1's tensor is empty where the others' are not: every rank hears it at once, none waits for the timeout
  attempt(function() comm:all_reduce(rank == 1 and ms.empty({ 0 }, { ctx = cpu }) or x) end)
elseif case == "abort-step" then
  -- a recipe that fails on the last rank alone, after the step's checks: the other ranks are then in the owners'
  -- broadcasts, and must fail at once, naming that rank, while it stays alive without another collective
  local probe = { name = "probe", options = { lr = { default = 0.1, type = "number" } }, route = function() return "r" end,
    routes = { r = { init = function() end,
                     step = function() if rank == world - 1 then error("out of memory here", 0) end end } } }
  local params = {}
  for i = 1, world do params[i] = { name = "p" .. i, param = ms.zeros({ 4, 4 }, { ctx = cpu }), grad = ms.ones({ 4, 4 }, { ctx = cpu }) } end
  local opt = ms.optim.new(probe, params, {}, { comm = comm })
  attempt(function() opt:step() end)
  if rank == world - 1 then local t0 = os.time() while os.time() - t0 < 3 do end end
  attempt(function() comm:all_reduce(x) end)
elseif case == "abort" then
  -- comm:abort on rank 0 (between collectives) and then on another rank: every rank's next collective fails
  if rank == 1 then comm:abort("bad batch") end
  attempt(function() comm:all_reduce(x) end)
elseif case == "kind" then
  -- the last rank broadcasts where the others all-reduce
  attempt(function() if rank == world - 1 then comm:broadcast(x, 0) else comm:all_reduce(x) end end)
elseif case == "exit" then
  -- the last rank leaves after one collective; the others' next one fails at once
  comm:all_reduce(x)
  if rank == world - 1 then os.exit(0, true) end   -- (closing the state: nothing left for the leak checker)
  attempt(function() comm:all_reduce(x) end)
elseif case == "silent" then
  -- the last rank stays alive but never makes the call: the others fail at the timeout
  if rank == world - 1 then
    local t0 = os.time()
    while os.time() - t0 < 4 do end
  else
    attempt(function() comm:all_gather(ms.empty({ world, 8 }, { ctx = cpu }), x) end)
  end
elseif case == "root-exit" then
  -- rank 0 leaves: the others' collective fails at once
  if rank == 0 then os.exit(0, true) end
  attempt(function() comm:broadcast(x, 0) end)
end
report("done", case)
]]

describe("the CPU communicator's failures", function()
  local s

  local function run(case, n, timeout)
    s = s or write_script("failing.lua", failing)
    return launch(("launch -n %d %s %d %s %s"):format(n, q(s), H.seed(), timeout or 5, case))
  end

  it("refuses bad arguments on each rank before sending anything, and goes on working", function()
    local out, code = run("local", 2)
    assert.are.equal(0, code, out)
    for r = 0, 1 do assert.is_truthy(out:find(("ok %d after-refusals"):format(r), 1, true), out) end
  end)

  it("fails on every rank, naming both calls, when the ranks' calls disagree, and refuses what follows", function()
    local out, code, wall = run("disagree", 3)
    assert.are.equal(0, code, out)
    local lines = {}
    for r, st, msg in out:gmatch("status (%d) (%S+) %d+ ([^\n]*)") do
      lines[#lines + 1] = { r = tonumber(r), st = st, msg = msg }
    end
    assert.are.equal(6, #lines, out)
    local want = "the ranks disagree on collective #1: rank 0 calls ms_comm_all_reduce (sum) of 8 f32 elements, "
      .. "rank 1 ms_comm_all_reduce (sum) of 9 f32 elements"
    local firsts, seconds = {}, {}
    for _, l in ipairs(lines) do
      assert.are.equal("error", l.st, out)
      if l.msg:find("this communicator failed earlier", 1, true) then seconds[l.r] = true
      elseif l.msg:find(want, 1, true) then firsts[l.r] = true end
    end
    for r = 0, 2 do
      assert.is_true(firsts[r] == true, "rank " .. r .. ": " .. out)
      assert.is_true(seconds[r] == true, "rank " .. r .. ": " .. out)
    end
    assert.is_true(wall < 5, "took " .. wall .. " s")
  end)

  it("runs empty collectives as calls, so that a rank whose tensor alone is empty fails every rank at once", function()
    local out, code, wall = run("empty", 3, 30)
    assert.are.equal(0, code, out)
    local lines = {}
    for r, st, msg in out:gmatch("status (%d) (%S+) %d+ ([^\n]*)") do
      lines[tonumber(r)] = lines[tonumber(r)] or {}
      table.insert(lines[tonumber(r)], { st = st, msg = msg })
    end
    local want = "the ranks disagree on collective #6: rank 0 calls ms_comm_all_reduce (sum) of 8 f32 elements, "
      .. "rank 1 ms_comm_all_reduce (sum) of 0 f32 elements"
    for r = 0, 2 do
      local l = lines[r]
      assert.is_truthy(l and #l == 2, out)
      assert.are.equal("ok", l[1].st, out)
      assert.are.equal("error", l[2].st, out)
      assert.is_truthy(l[2].msg:find(want, 1, true), out)
    end
    assert.is_true(wall < 10, "took " .. wall .. " s")
  end)

  it("fails every rank at once, naming it, when a rank's recipe fails mid-step and it stays alive", function()
    local out, code, wall = run("abort-step", 3, 30)
    assert.are.equal(0, code, out)
    local lines = {}
    for r, st, ms_, msg in out:gmatch("status (%d) (%S+) (%d+) ([^\n]*)") do
      lines[tonumber(r)] = lines[tonumber(r)] or {}
      table.insert(lines[tonumber(r)], { st = st, ms = tonumber(ms_), msg = msg })
    end
    for r = 0, 2 do
      local l = lines[r]
      assert.is_truthy(l and #l == 2, out)
      assert.are.equal("error", l[1].st, out)
      assert.are.equal("error", l[2].st, out)
      assert.is_true(l[1].ms < 2000, ("rank %d took %d ms"):format(r, l[1].ms))
      assert.is_truthy(l[2].msg:find("this communicator failed earlier", 1, true), out)
    end
    assert.is_truthy(lines[2][1].msg:find("out of memory here", 1, true), out)
    assert.is_truthy(lines[0][1].msg:find("ms_comm_broadcast: rank 2 gave up the communicator (rank 2, step 1: out of "
      .. "memory here)", 1, true), out)
    assert.is_truthy(lines[1][1].msg:find("rank 0 reports: ms_comm_broadcast: rank 2 gave up the communicator", 1, true), out)
  end)

  it("comm:abort makes every rank's next collective fail at once, with the reason", function()
    local out, code = run("abort", 3, 30)
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    for r = 0, 2 do
      assert.are.equal("error", res[r].status, out)
      assert.is_true(res[r].ms < 2000, ("rank %d took %d ms"):format(r, res[r].ms))
      assert.is_truthy(res[r].msg:find(r == 1 and "this communicator failed earlier (rank 1 gave up the communicator "
        .. "(bad batch))" or "rank 1 gave up the communicator (bad batch) before collective #1", 1, true), out)
    end
  end)

  it("fails on every rank when one makes another collective", function()
    local out, code = run("kind", 2)
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    for r = 0, 1 do
      assert.are.equal("error", res[r].status, out)
      assert.is_truthy(res[r].msg:find("rank 0 calls ms_comm_all_reduce (sum) of 8 f32 elements, rank 1 "
        .. "ms_comm_broadcast (root 0) of 8 f32 elements", 1, true), out)
    end
  end)

  it("fails at once, on every rank left, when a rank exits", function()
    local out, code, wall = run("exit", 3, 30)
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("error", res[0].status, out)
    assert.is_truthy(res[0].msg:find("rank 2 closed its connection (it exited or failed) during collective #2", 1,
      true), out)
    assert.are.equal("error", res[1].status, out)
    assert.is_truthy(res[1].msg:find("rank 0 reports: ms_comm_all_reduce: rank 2 closed its connection", 1, true), out)
    for r = 0, 1 do assert.is_true(res[r].ms < 2000, ("rank %d took %d ms"):format(r, res[r].ms)) end
    assert.is_true(wall < 10, "took " .. wall .. " s")
  end)

  it("fails at once when rank 0 exits", function()
    local out, code = run("root-exit", 2, 30)
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("error", res[1].status, out)
    assert.is_truthy(res[1].msg:find("rank 1 lost its connection to rank 0", 1, true), out)
    assert.is_true(res[1].ms < 2000, "took " .. res[1].ms .. " ms")
  end)

  it("refuses, on both sides and at once, a rank that wants NCCL's id where rank 0 makes a CPU communicator", function()
    local mixed = write_script("mixed.lua", [[
local rank = tonumber(os.getenv("RANK"))
local ok, err
if rank == 0 then ok, err = pcall(ms.comm.from_env, { ctx = ms.device("cpu"), timeout = 10 })
else ok, err = pcall(ms.comm.rendezvous, { rank = 1, world_size = 2, timeout = 10 }) end
print(("status %d %s 0 %s"):format(rank, ok and "ok" or "error", tostring(err)))
]])
    local out, code, wall = launch(("launch -n 2 %s"):format(q(mixed)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    local why = "rank 1 wants an NCCL id (CUDA or ms_rendezvous), rank 0 a CPU (TCP) communicator"
    assert.are.equal("error", res[0].status, out)
    assert.is_truthy(res[0].msg:find(why, 1, true), out)
    assert.are.equal("error", res[1].status, out)
    assert.is_truthy(res[1].msg:find("rank 0 refused the rendezvous: " .. why, 1, true), out)
    assert.is_true(wall < 5, "took " .. wall .. " s")
  end)

  it("fails at the timeout, naming the rank, when one never makes the call", function()
    local out, code, wall = run("silent", 3, 1)
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("error", res[0].status, out)
    assert.is_truthy(res[0].msg:find("ms_comm_all_gather: rank 0 waited", 1, true), out)
    assert.is_truthy(res[0].msg:find("for rank 2 (collective #1 of a world of 3", 1, true), out)
    assert.is_true(res[0].ms >= 990 and res[0].ms < 2000, "rank 0 gave up after " .. res[0].ms .. " ms")
    -- rank 1 waits a little longer than rank 0, so that it hears which rank was missing
    assert.are.equal("error", res[1].status, out)
    assert.is_truthy(res[1].msg:find("rank 0 reports: ms_comm_all_gather: rank 0 waited", 1, true), out)
    assert.is_true(res[1].ms < 2500, "rank 1 gave up after " .. res[1].ms .. " ms")
    assert.is_true(wall < 8, "took " .. wall .. " s")
  end)
end)
