--[[
Shared helpers for the busted specs (loaded by .busted as the helper).  Comparisons against f64 reference
values computed in Lua: |got - want| <= atol + rtol * |want| elementwise, where NaN always fails unless the
reference is NaN too.
]]
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path

local H = {}
_G.H = H

local ms = require("moonstep")
H.ms = ms

-- per-dtype tolerances for results computed from exactly-known inputs (one rounding of the output,
-- plus accumulation error for reductions, which specs widen where needed)
H.tol = {
  f64  = { rtol = 1e-12, atol = 1e-12 },
  f32  = { rtol = 2e-6,  atol = 1e-6 },
  bf16 = { rtol = 8e-3,  atol = 1e-3 },
  f16  = { rtol = 1e-3,  atol = 1e-4 },
  i32  = { rtol = 0,     atol = 0 },
  u8   = { rtol = 0,     atol = 0 },
}

H.has_cuda = ms.device_count("cuda") > 0
H.dtypes_float = { "f32", "f64", "bf16", "f16" }

local function isnan(x) return x ~= x end

-- walks got/want (numbers or nested tables) and returns the worst violation, if any
local function compare(got, want, rtol, atol, path, worst)
  if type(want) == "table" then
    if type(got) ~= "table" then return { path = path, msg = "expected a table, got " .. type(got) } end
    if #got ~= #want then return { path = path, msg = ("length %d, expected %d"):format(#got, #want) } end
    for i = 1, #want do
      local bad = compare(got[i], want[i], rtol, atol, path .. "[" .. i .. "]", worst)
      if bad and bad.msg then return bad end
    end
    return nil
  end
  if type(got) ~= "number" then return { path = path, msg = "expected a number, got " .. type(got) } end
  if isnan(want) then
    if isnan(got) then return nil end
    return { path = path, msg = ("got %.9g, expected NaN"):format(got) }
  end
  if want == math.huge or want == -math.huge then
    if got == want then return nil end
    return { path = path, msg = ("got %.9g, expected %s"):format(got, tostring(want)) }
  end
  local err = math.abs(got - want)
  local tol = atol + rtol * math.abs(want)
  if not (err <= tol) then
    return { path = path, msg = ("got %.9g, expected %.9g (error %.3g > tolerance %.3g)"):format(got, want, err, tol) }
  end
  if worst then worst.max = math.max(worst.max, err / (tol > 0 and tol or 1)) end
  return nil
end

--- Asserts got ~ want (numbers or nested tables).  rtol/atol default to H.tol.f32.
function H.assert_close(got, want, rtol, atol, what)
  rtol = rtol or H.tol.f32.rtol
  atol = atol or H.tol.f32.atol
  local bad = compare(got, want, rtol, atol, "", { max = 0 })
  if bad then error((what and (what .. ": ") or "") .. "mismatch at " .. (bad.path ~= "" and bad.path or "value") .. ": " .. bad.msg, 2) end
end

--- Tolerance pair for a dtype, optionally scaled (e.g. for long reductions).
function H.tols(dtype, scale)
  local t = H.tol[dtype]
  scale = scale or 1
  return t.rtol * scale, t.atol * scale
end

--- Flattens nested tables of numbers.
function H.flat(t, out)
  out = out or {}
  if type(t) == "number" then out[#out + 1] = t return out end
  for i = 1, #t do H.flat(t[i], out) end
  return out
end

--- Maps fn over nested tables (f64 reference of an elementwise op).
function H.map(t, fn)
  if type(t) == "number" then return fn(t) end
  local out = {}
  for i = 1, #t do out[i] = H.map(t[i], fn) end
  return out
end

--- Asserts fn() raises an error whose message contains every given plain substring; returns the message.
function H.expect_error(fn, ...)
  local ok, err = pcall(fn)
  if ok then error("expected an error, but the call succeeded", 2) end
  err = tostring(err)
  for _, s in ipairs { ... } do
    if not err:find(s, 1, true) then error(("error message %q does not contain %q"):format(err, s), 2) end
  end
  return err
end

--- A fresh seed per call, so specs never reuse inputs by accident, yet every test's inputs can be had again: the
--- seed is a hash of the run's base (MOONSTEP_TEST_SEED, else the clock; printed when the run starts), the
--- running test's name and the call's index within the test.  So `MOONSTEP_TEST_SEED=<base> busted <spec>
--- --filter <name>` gives a failing test the inputs it failed on, alone or in the whole suite.
--- (Scripts that specs run in a child process load this file too, outside busted: they count from their base.)
H.seed_base = tonumber(os.getenv("MOONSTEP_TEST_SEED") or "") or os.time() % 100000
local seed_test, seed_calls = "", 0
local has_busted, busted = pcall(require, "busted")
if has_busted and type(busted) == "table" and type(busted.subscribe) == "function" then
  io.stdout:write(("test inputs: MOONSTEP_TEST_SEED=%d\n"):format(H.seed_base))
  local function seed_scope(element)   -- a spec file (its describe blocks' calls), then each test
    seed_test, seed_calls = element.name or "", 0
    return nil, true
  end
  busted.subscribe({ "file", "start" }, seed_scope)
  busted.subscribe({ "test", "start" }, seed_scope)
end
function H.seed()
  seed_calls = seed_calls + 1
  local h = 2166136261   -- FNV-1a (32 bits) of "base|test name|index"
  local key = ("%d|%s|%d"):format(H.seed_base, seed_test, seed_calls)
  for i = 1, #key do
    local x = bit.bxor(h, key:byte(i))
    h = bit.tobit(bit.lshift(x, 24) + x * 403)   -- x * 16777619 mod 2^32, exact in doubles
  end
  return bit.band(h, 0x7fffffff)
end

--- it() for specs that need a GPU: runs where one is present, else pending (counted as skipped).
--- busted gives `it` and `pending` to each spec file's environment, so they are looked up in the caller's.
function H.cuda_it(name, fn)
  local env = getfenv(2)
  if H.has_cuda then env.it(name, fn) else env.pending(name .. " (no CUDA device)") end
end

--- it() for specs tagged #multigpu (several ranks, one GPU each): runs where two CUDA devices are usable, else
--- pending with the reason.  Add "#multigpu" to the name so `busted --tags=multigpu` selects them.
H.cuda_devices = ms.device_count("cuda")
function H.multigpu_it(name, fn)
  local env = getfenv(2)
  if H.cuda_devices >= 2 then env.it(name, fn)
  else env.pending(("%s (needs 2 CUDA devices, found %d)"):format(name, H.cuda_devices)) end
end

--- The spacing of dt's values (f32, bf16, f16) around x: one unit in the last place.
local MANT, EMIN = { f32 = 24, bf16 = 8, f16 = 11 }, { f32 = -126, bf16 = -126, f16 = -14 }
function H.ulp(x, dt)
  local e = EMIN[dt]
  if x ~= 0 then
    local _, ex = math.frexp(math.abs(x))
    e = math.max(ex - 1, EMIN[dt])
  end
  return 2 ^ (e - MANT[dt] + 1)
end

--- Equal value lists, NaN matching NaN and -0 told from +0: for f32, bf16 and f16 values, the same bits.
function H.same_bits(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do
    local x, y = a[i], b[i]
    if x ~= y and not (x ~= x and y ~= y) then return false end
    if x == 0 and 1 / x ~= 1 / y then return false end
  end
  return true
end

--- Asserts H.same_bits(got, want), naming the first element that differs.
function H.assert_same(got, want, what)
  if H.same_bits(got, want) then return end
  if #got ~= #want then error(("%s: %d values, expected %d"):format(what, #got, #want), 2) end
  for i = 1, #want do
    if not H.same_bits({ got[i] }, { want[i] }) then
      error(("%s: element %d is %s, expected %s (the same bits)"):format(what, i, tostring(got[i]), tostring(want[i])), 2)
    end
  end
end

--- Asserts |got - want| <= k ulp(want) + atol elementwise in dtype dt (k = 1, atol = 0 unless given); NaN matches
--- only NaN.
function H.assert_ulps(got, want, dt, what, k, atol)
  k, atol = k or 1, atol or 0
  if #got ~= #want then error(("%s: %d values, expected %d"):format(what, #got, #want), 2) end
  for i = 1, #want do
    local w, g = want[i], got[i]
    if w ~= w then
      if g == g then error(("%s: element %d is %.9g, expected NaN"):format(what, i, g), 2) end
    elseif not (math.abs(g - w) <= k * H.ulp(w, dt) + atol) then
      error(("%s: element %d is %.9g, expected %.9g (error %.3g > %.3g)"):format(what, i, g, w, math.abs(g - w),
            k * H.ulp(w, dt) + atol), 2)
    end
  end
end

--- Eigenvalue lists of b entries for SPD test blocks of condition number kappa: spread log-uniformly from 1
--- down to 1 / kappa, or in two clusters (near 1 and near 1 / kappa).
function H.spectrum_spread(kappa, b)
  local l = {}
  for i = 1, b do l[i] = b == 1 and 1 or kappa ^ (-(i - 1) / (b - 1)) end
  return l
end
function H.spectrum_clustered(kappa, b)
  local l = {}
  for i = 1, b do l[i] = (1 + 0.01 * i) / (i <= b / 2 and 1 or kappa) end
  return l
end

-- ---------------------------------------------------------------------------------------------------
-- specs that start processes (`moonstep launch -n N` rank scripts)
-- ---------------------------------------------------------------------------------------------------
local build = os.getenv("MOONSTEP_BUILD") or "build"
H.root = os.getenv("PWD")
H.build_dir = build:sub(1, 1) == "/" and build or (H.root .. "/" .. build)
H.host = H.build_dir .. "/moonstep"

--- s quoted for the shell.
function H.q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

--- Runs a shell command: its output (stdout and stderr) followed by a line "exit=STATUS", and that status.
function H.shell(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"exit=$?\"")
  local out = p:read("*a")
  p:close()
  return out, tonumber(out:match("exit=(%d+)\n$"))
end

--- Runs `moonstep ARGS` from the project root, `prefix` (environment assignments, `timeout N`, ...) before the
--- host; returns its output (stdout and stderr), exit status and wall time in seconds.
function H.moonstep(args, prefix)
  local t0 = require("moonstep.experiment").clock()
  local out, code = H.shell(("cd %s && %s %s %s"):format(H.q(H.root), prefix or "", H.q(H.host), args))
  return out:match("^(.-)exit=%d+\n$") or out, code, require("moonstep.experiment").clock() - t0
end

--- A new empty folder (mktemp -d); the caller removes it.
function H.tmpdir()
  local p = io.popen("mktemp -d")
  local d = p:read("*l")
  p:close()
  return d
end

--- Writes `bytes` to `path`, replacing what was there.
function H.write_file(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

--- The bytes of `path`, or nil when it cannot be opened.
function H.read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local temp_dir
--- Writes text to `name` in a folder of this run's own (made once); returns the path.
function H.temp_file(name, text)
  if temp_dir == nil then temp_dir = H.tmpdir() end
  local path = temp_dir .. "/" .. name
  H.write_file(path, text)
  return path
end

return H
