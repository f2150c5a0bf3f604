--[[
moonstep.recipe -- finding, loading and checking recipes (the contract is in DESIGN.md, "Recipes").

  ms.recipe.get("adamw")                        built-in (recipes/ of the install or tree), then MOONSTEP_RECIPE_PATH
  ms.recipe.load("model/optim.lua", {trusted = false})
  ms.recipe.load_string(src, "=my recipe", {trusted = true})
  ms.recipe.options(recipe, {lr = "0.1"})       options checked against the recipe's specs, defaults filled

Built-in recipes are trusted.  Any other file is untrusted unless the caller says trusted = true: it then
runs in the sandbox (safe Lua and the moonstep primitives only, text chunks only, with instruction, memory,
retained-memory and engine-allocation limits; see "the sandbox for untrusted recipes" below).  The runtime
calls every recipe function through M.call(guard, fn, ...), where guard = M.guard(recipe, limits) is nil for
trusted ones, and hands the recipe tables it keeps (groups, members, state) through M.keep(guard, t).
]]
local bit = require("bit")

local M = {}

-- ---------------------------------------------------------------------------------------------------
-- finding recipes
-- ---------------------------------------------------------------------------------------------------
local function here()
  local src = debug.getinfo(1, "S").source
  return (src:sub(1, 1) == "@" and src:sub(2) or src):match("^(.*)/[^/]*$") or "."
end

--- The folders searched for built-in recipes, in order.
function M.search_path()
  local dirs = {}
  local ok, config = pcall(require, "moonstep.config")
  if ok and type(config) == "table" and config.recipe_dir and config.recipe_dir ~= "" then
    dirs[#dirs + 1] = config.recipe_dir
  end
  local dir = here()
  dirs[#dirs + 1] = dir .. "/../../recipes"                 -- source tree: lua/moonstep -> recipes
  dirs[#dirs + 1] = dir .. "/../../../moonstep/recipes"     -- install: share/lua/5.1/moonstep -> share/moonstep
  return dirs
end

local function user_path()
  local dirs = {}
  for d in (os.getenv("MOONSTEP_RECIPE_PATH") or ""):gmatch("[^:]+") do dirs[#dirs + 1] = d end
  return dirs
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("*a")
  f:close()
  return s
end

-- 64-bit FNV-1a of the source text, as 16 hex digits: the recipe's content hash in checkpoints
local FNV_OFFSET, FNV_PRIME = 0xcbf29ce484222325ULL, 0x100000001b3ULL
function M.hash(s)
  local h = FNV_OFFSET
  for i = 1, #s do
    h = bit.bxor(h, s:byte(i))
    h = h * FNV_PRIME
  end
  return bit.tohex(h, 16)
end

-- ---------------------------------------------------------------------------------------------------
-- the sandbox for untrusted recipes
-- ---------------------------------------------------------------------------------------------------
--[[
What an untrusted recipe can reach: the globals below (safe Lua: no io, os, ffi, require, debug, package,
load/loadstring/dofile, string.dump, collectgarbage, setfenv/getfenv, getmetatable/setmetatable,
rawget/rawset, coroutine, jit, bit, newproxy), read-only copies of math/string/table subsets, and a
read-only `ms` facade of tensor functions.  Tensors are tables whose engine handle lives in a private weak
table of moonstep.tensor; their metatable answers getmetatable() with a string and its __index is a
function, so neither the Tensor nor the Context method table can be reached, let alone changed.

Strings: every string's methods come from the one string metatable, whose __index is the real `string`
table (`("").dump` would reach string.dump).  While an untrusted function runs, M.call points that
__index at the safe string table and puts it back afterwards, on errors too.  Trusted code called from the
recipe meanwhile sees the same safe functions, which behave like the real ones within the limits below.

Limits, enforced while untrusted code runs (M.call):
  instructions  a count hook (debug.sethook, every HOOK_EVERY VM instructions) stops a call that runs more
                than this many.  The recipe's functions are never compiled (jit.off on its chunk, which
                covers every function defined in it), because LuaJIT does not run hooks inside traces.
                Trusted code reachable from the sandbox only loops over bounded data (no walk of a
                possibly cyclic table), so compiled trusted traces end on their own; trusted code whose loop
                counts come from the recipe's numbers (ms.block_plan) is never compiled.
  memory        the Lua heap may grow by at most this many bytes during one call (checked in the hook;
                a full collection first, so garbage does not count), and between two looks of the hook the
                state's allocator refuses growth past twice the limit (garbage included; see heap_arm).
                String functions that can build a large result in one C call (rep, gsub, format,
                table.concat) check its size beforehand, and pattern functions refuse patterns whose
                backtracking cost on the subject is too large.
                The copies and walks those library calls make in C count against the instruction limit
                (lib_work): a string result of n bytes as n / 16 instructions, gsub's scan of its subject
                as a byte an instruction, an insert or remove as the elements it shifts; table.sort compares
                with a Lua function (the recipe's, or a default never compiled) and table.maxn is Lua, so the
                hook counts them.  Each call was bounded, but a loop of them was not.  The heap the call
                allocates counts too, an instruction per 4 bytes, read by the hook off the heap cap (the work
                of `..`, one VM instruction however long its strings, and of any C function that builds a
                string or a table; where the Lua API is not exported, no cap and no such count).  The
                searches of find, match, gmatch and gsub count as the time they took, an instruction per 4
                ns, less a function replacement's time (searched: how much a match backtracked is not
                visible from outside the C matcher).  Not counted: a `..` whose result is a string that exists already
                (LuaJIT finds it and allocates nothing, after copying and comparing both strings).
                A C primitive whose loop count the recipe passes (ms.sinkgd_step's iters and sn_iters,
                ms.inv_root's steps and pi_steps, ms.spectrum_estimate's steps) runs out of the hook's reach:
                each of its iterations counts as HOOK_EVERY instructions, checked before the call.  An op
                over an expanded view counts one instruction an element (moonstep.tensor, "overlapping").
  retained      bytes of Lua data the recipe keeps from one call to the next (per guard, i.e. per optimizer):
                what is reachable from the recipe's table, its environment (module globals), its functions'
                upvalues and the tables the runtime keeps for it (M.keep: groups, members, their state, beyond
                what they held when kept), counted as tables (array and hash slots allocated), strings and
                closures; the sandbox's shared objects and tensors (the quota's) are left out, and so are the
                host's own heap and garbage, which no walk from these roots reaches.  The walk runs at the end of
                a call, not every call: once the heap the guard's calls allocated since the last walk (the heap
                cap adds it up; without the cap, each call's net growth) could have taken the recipe past the
                limit, and near the limit after every eighth of it.  (A string that exists already, interned, costs
                no allocation to keep: keeping one is seen at the next walk that other allocation brings.)  A call
                that leaves the recipe over the limit fails; while it stays over, every call walks, and one that
                adds to what the recipe keeps fails too.
  quota         bytes of engine memory held by tensors the recipe allocated (live, per optimizer: a
                charge is released when the tensor and all its views are collected).
  seconds       (none by default) wall-clock seconds a call may run, checked by the hook (so an engine
                call in progress finishes first): the bound for what the instruction count cannot see (a
                `..` rebuilding a string that exists), left to the caller because it counts the engine's
                work too, which on a CPU can legitimately take minutes (a large DASH refresh).
Once a limit trips, the sandbox's pcall/xpcall re-raise the error, so a recipe cannot swallow it.
Trusted recipes never pass through any of this: M.call(nil, fn, ...) is a plain tail call.
]]
local tensor = require("moonstep.tensor")
local core = require("moonstep.core")
local jit_off = jit and jit.off

local MiB = 2 ^ 20
M.limits = { instructions = 1e8, memory = 256 * MiB, retained = 256 * MiB, quota = 64 * MiB }
-- the default engine quota of an optimizer: this many times its parameters' bytes, plus limits.quota
M.QUOTA_PER_PARAM_BYTE = 4
local HOOK_EVERY = 1000

local active = nil                      -- the guard of the untrusted call in progress
local string_mt = getmetatable("")
local real_string_index = string_mt.__index
local real_tostring, real_pcall, real_xpcall = tostring, pcall, xpcall
local str_rep, str_gsub, str_format, str_find = string.rep, string.gsub, string.format, string.find
local str_match, str_gmatch, tbl_concat, tbl_insert = string.match, string.gmatch, table.concat, table.insert
local str_sub, real_getmetatable, real_getfenv = string.sub, getmetatable, getfenv
local str_upper, str_lower, str_reverse, tbl_remove, tbl_sort = string.upper, string.lower, string.reverse,
                                                                 table.remove, table.sort

local function memory_cap() return active and active.memory or M.limits.memory end

-- The hard cap on the heap (moonstep.h, "A cap on a Lua state's heap"): the hook checks the memory limit only
-- every HOOK_EVERY instructions, and `t[i] = s .. s .. i` in a loop builds gigabytes in fewer.  While an
-- untrusted call runs, the state's allocator refuses growth past HEAP_CAP_FACTOR times the memory limit
-- (garbage counts there until collected, hence the headroom).  The state is reached through a coroutine
-- (lua_setallocf acts on the state's global part, which all its threads share); where the Lua API is not
-- exported, the hook is the only check.
local HEAP_CAP_FACTOR = 2
local heap = (function()
  local ffi = core.ffi
  local ok = pcall(ffi.cdef, [[
    void *lua_getallocf(void *L, void **ud);
    void lua_setallocf(void *L, void *f, void *ud);]])
  local thread = coroutine.create(function() end)
  local addr = real_tostring(thread):match("^thread: 0x(%x+)$")
  if not (ok and addr and pcall(function() return ffi.C.lua_getallocf end)) then return nil end
  local L = ffi.cast("void *", tonumber(addr, 16))
  -- the cap lives outside the Lua heap, never freed (ms_lua_heap_cap_new): lua_close frees every Lua object
  -- through the allocator that is current then, so a cap left armed must not be one of them
  local cap = core.C.ms_lua_heap_cap_new()
  if cap == nil then return nil end
  return { L = L, thread = thread, C = ffi.C, cap = cap, ud = ffi.new("void *[1]"), alloc = core.C.ms_lua_heap_cap_alloc,
           setallocf = ffi.cast("void (*)(void *, void *, void *)", ffi.C.lua_setallocf),
           disarm = core.C.ms_lua_heap_cap_disarm, armed = false }
end)()

local HEAP_CAP_FLOOR = 2 ^ 20
local function heap_arm(limit)
  if heap == nil or heap.armed then return end
  local cap = heap.cap[0]
  cap.alloc = heap.C.lua_getallocf(heap.L, heap.ud)
  -- (the floor leaves room for the call's own bookkeeping under a tiny limit, which the hook enforces; a limit
  -- past int64 would convert to garbage)
  cap.ud, cap.grown, cap.limit, cap.refused = heap.ud[0], 0, math.min(math.max(limit, HEAP_CAP_FLOOR), 2 ^ 62), 0
  cap.allocated = 0
  cap.L, cap.setallocf = heap.L, heap.setallocf
  heap.C.lua_setallocf(heap.L, heap.alloc, heap.cap)
  heap.armed = true
end

local function heap_disarm()
  if heap == nil or not heap.armed then return end
  heap.disarm(heap.cap)
  heap.armed = false
end

-- true once the cap refused a request during the call in progress
-- (through the pointer: no struct reference to allocate while the cap is armed)
local function heap_refused() return heap ~= nil and heap.cap.refused ~= 0 end

local function too_big(what, n)
  if n > memory_cap() then
    error(str_format("%s: result of %.0f bytes exceeds the recipe's memory limit of %.0f bytes", what, n,
                     memory_cap()), 3)
  end
end

-- C work of a library call, out of the hook's reach, counted against the instruction limit of the untrusted
-- call in progress as moonstep.tensor.charge_work counts a C loop (past the limit it trips like the hook).
-- The guard's own messages are formatted with the real string.format: through the safe one, a message formatted
-- past the limit would be charged, trip, and format its own message again.
local BYTES_PER_INSTRUCTION = 16
-- Lua heap allocated during an untrusted call counts in the hook, an instruction per this many bytes: about the
-- time an allocation takes against the VM's pace under the hook (~2.5 ns an instruction here): a 64-byte table
-- ~40 ns, a 1 MiB string built by `..` ~0.6 ms with its page faults and its collection
local ALLOC_BYTES_PER_INSTRUCTION = 4
local function lib_work(what, instructions)
  if active ~= nil and instructions > 0 then active.work(what, instructions / HOOK_EVERY, true) end
end
-- The searches of find, match, gmatch and gsub run in C, out of the hook's reach, for as long as their pattern
-- makes them (check_pattern bounds one call, not a loop of them), and how much backtracking a match did is not
-- visible from outside the matcher: each search counts as the instructions the VM runs in the time it took,
-- one per NS_PER_INSTRUCTION ns (the interpreter under the hook runs ~2.5 ns an instruction here).  The only
-- charge read off a clock, so a loop of searches trips after about the same time as any other loop, not after
-- the same count.
local NS_PER_INSTRUCTION = 4
local clock = core.clock
-- what the clock and the pcall cost around a search that does no work, taken off every search's time, so that a
-- name's match is charged its matching, not the timing (the VM instructions of the wrappers are the hook's to
-- count): the shortest of a few empty searches timed here, lowered by any shorter search timed later
local search_floor = math.huge
for _ = 1, 32 do
  local t0 = clock()
  real_pcall(str_find, "", "", 1, true)
  search_floor = math.min(search_floor, clock() - t0)
end
local function search_work(what, seconds)
  if active == nil then return end
  if seconds < search_floor then search_floor = seconds end
  lib_work(what, (seconds - search_floor) * (1e9 / NS_PER_INSTRUCTION))
end
-- The C function runs under pcall so that its time is charged whatever it does; its own error (a bad argument,
-- a malformed pattern) is raised again at the recipe's call (`level` of the caller), as a tail call of it named
-- the recipe's line and the function (through pcall the name is '?').
local function raise_as(name, e, level)
  if type(e) == "string" then e = str_gsub(e, "^(bad argument #%d+ to )'%?'", "%1'" .. name .. "'") end
  error(e, level + 1)
end
-- (tail-called from the wrappers: level 2 is the recipe)
local function searched(what, name, t0, ok, ...)
  if not ok and heap_refused() then error((...), 0) end   -- (the guard names the memory limit)
  search_work(what, clock() - t0)
  if not ok then raise_as(name, (...), 2) end
  return ...
end
-- gmatch's iterators (trusted closures) -> their subject: the retained-memory walk counts it, as it counts a
-- string the recipe keeps itself
local iterator_subject = setmetatable({}, { __mode = "k" })

-- v, after charging the copy that made it (a string of n bytes: n / BYTES_PER_INSTRUCTION)
local function copied(what, v, ...)
  if type(v) == "string" then lib_work(what, #v / BYTES_PER_INSTRUCTION) end
  return v, ...
end

-- Worst-case backtracking of a Lua pattern grows like n^(k+1) for k quantifiers (*, +, -, ?, %b) on a
-- subject of n bytes, times the pattern's length m (each attempt may walk all of it: a literal pattern of
-- 2^19 "a"s and a "b" compares 2^19 bytes at each of 2^21 start positions of ("a"):rep(2^21)); the C
-- matcher cannot be interrupted by the hook, so an expensive pattern is refused up front.  Anchored
-- patterns lose the factor for trying every start position.  A plain find (and a pattern without special
-- characters, which the matcher searches the same way) compares up to (n - m + 1) * m bytes.
local PATTERN_BUDGET = 1e8
local function check_pattern(what, s, p, init, plain)
  if type(s) ~= "string" or type(p) ~= "string" then return end
  -- the bytes searched: from init on only where init is a position the C function reads as given; it converts
  -- init to an int32, and a number past that range (1e47) wrapped to a negative start, which searches the whole
  -- string, so anything else counts the whole string
  local from = (type(init) == "number" and init > 1 and init < 2 ^ 31) and math.floor(init) or 1
  local len = #s - (from - 1)
  if plain then
    local m = #p
    if m > 1 and m <= len and (len - m + 1) * m > PATTERN_BUDGET then
      error(str_format("%s: a plain search for %d bytes in %d bytes is too expensive for a sandboxed recipe", what,
                       m, len), 3)
    end
    return
  end
  local k, i, n = 0, 1, #p
  while i <= n do
    local c = p:byte(i)
    if c == 37 then                                   -- '%': an escape, or %b (counted), %f
      if p:byte(i + 1) == 98 then k = k + 1 end
      i = i + 2
    elseif c == 91 then                               -- '[': skip the set
      i = i + 1
      if p:byte(i) == 94 then i = i + 1 end
      if p:byte(i) == 93 then i = i + 1 end
      while i <= n and p:byte(i) ~= 93 do i = i + (p:byte(i) == 37 and 2 or 1) end
      i = i + 1
    else
      if c == 42 or c == 43 or c == 45 or c == 63 then k = k + 1 end
      i = i + 1
    end
  end
  if len < 1 then len = 1 end
  local cost = len ^ (k + ((p:byte(1) == 94) and 0 or 1)) * math.max(n, 1)
  if cost > PATTERN_BUDGET then
    error(str_format("%s: pattern of %d bytes with %d repetitions on %d bytes is too expensive for a sandboxed recipe",
                     what, n, k, len), 3)
  end
end

-- the length of v as the string functions take it: numbers are converted to strings (and numeric strings to
-- numbers where a count is expected: tonumber, as the C functions read them)
local function str_len(v)
  if type(v) == "string" then return #v end
  if type(v) == "number" then return #real_tostring(v) end
  return 0
end

-- The wrappers' first argument checked as the C function checks it, so that an error names the function and the
-- recipe's line (from the wrapper, the C function's error named 'str_sub' at a line of this file); sub's
-- positions as well
local function string_arg(name, ...)
  local n, s = select("#", ...), (...)
  local function bad(k, want, v, given)
    error(str_format("bad argument #%d to '%s' (%s expected, got %s)", k, name, want, given and type(v) or "no value"), 4)
  end
  if type(s) ~= "string" and type(s) ~= "number" then bad(1, "string", s, n >= 1) end
  if name == "sub" then
    local i, j = select(2, ...)
    if tonumber(i) == nil then bad(2, "number", i, n >= 2) end
    if j ~= nil and tonumber(j) == nil then bad(3, "number", j, true) end
  end
end

local safe_tostring   -- (below: string.format needs it)
local safe_string = {
  byte = string.byte, char = string.char, len = string.len,
  reverse = function(...) string_arg("reverse", ...) return copied("string.reverse", str_reverse(...)) end,
  sub = function(...) string_arg("sub", ...) return copied("string.sub", str_sub(...)) end,
  upper = function(...) string_arg("upper", ...) return copied("string.upper", str_upper(...)) end,
  lower = function(...) string_arg("lower", ...) return copied("string.lower", str_lower(...)) end,
  rep = function(s, n, sep)
    local count = tonumber(n)
    if count and count > 0 then too_big("string.rep", (str_len(s) + str_len(sep)) * count) end
    return copied("string.rep", str_rep(s, n, sep))
  end,
  find = function(s, p, init, plain)
    check_pattern("string.find", s, p, init, plain)
    local t0 = clock()
    return searched("string.find", "find", t0, real_pcall(str_find, s, p, init, plain))
  end,
  match = function(s, p, init)
    check_pattern("string.match", s, p, init)
    local t0 = clock()
    return searched("string.match", "match", t0, real_pcall(str_match, s, p, init))
  end,
  gmatch = function(s, p)
    check_pattern("string.gmatch", s, p)
    local t0 = clock()
    local ok, next_match = real_pcall(str_gmatch, s, p)
    if not ok then return searched("string.gmatch", "gmatch", t0, ok, next_match) end   -- (raises, at the recipe's line)
    local function iterate()
      local t1 = clock()
      return searched("string.gmatch", "gmatch", t1, real_pcall(next_match))
    end
    iterator_subject[iterate] = s
    return iterate
  end,
  gsub = function(s, p, repl, n)
    check_pattern("string.gsub", s, p)
    local inside, replacing = false, 0   -- in the replacement when an error comes; its seconds
    if type(s) == "string" or type(s) == "number" then
      if type(repl) == "string" or type(repl) == "number" then
        too_big("string.gsub", str_len(s) + (str_len(s) + 1) * str_len(repl))
      elseif type(repl) == "table" or type(repl) == "function" then
        -- each replacement comes from recipe data: count the bytes as they are produced
        local total, lookup = str_len(s), repl
        repl = function(...)
          local t1 = clock()
          inside = true
          local v
          if type(lookup) == "table" then v = lookup[(...)] else v = lookup(...) end
          inside = false
          replacing = replacing + (clock() - t1)
          if type(v) == "string" or type(v) == "number" then
            total = total + str_len(v)
            too_big("string.gsub", total)
          end
          return v
        end
      end
    end
    -- (it scans the whole subject: a byte an instruction, the pattern matcher's pace; then the copy.  Its
    -- search time counts too, as find's, less the time in the replacement function or table lookup, which
    -- the hook counts)
    if type(s) == "string" then lib_work("string.gsub", #s) end
    local t0 = clock()
    local ok, r, count = real_pcall(str_gsub, s, p, repl, n)
    -- an error of the replacement (the recipe's, or a limit) goes on as it was raised, and so does a request the
    -- heap cap refused (the guard names the memory limit)
    if not ok and (inside or heap_refused()) then error(r, 0) end
    search_work("string.gsub", clock() - t0 - replacing)
    if not ok then raise_as("gsub", r, 2) end   -- (gsub's own: the recipe's call's, as the others')
    return copied("string.gsub", r, count)
  end,
  format = function(fmt, ...)
    -- %s of a table or function prints its heap address, and %p any object's: tostring() hides them, and so
    -- must format (objects go through safe_tostring, %p is refused)
    if type(fmt) == "string" then
      for conv in str_gmatch(fmt, "%%[-+ #0]*%d*%.?%d*(.)") do
        if conv == "p" then error("string.format: %p (an object's address) is not available to a sandboxed recipe", 2) end
      end
    end
    local args = { ... }
    local n = type(fmt) == "string" and #fmt or 0
    for i = 1, select("#", ...) do
      local v = args[i]
      if type(v) ~= "string" and type(v) ~= "number" then v = safe_tostring(v) args[i] = v end
      n = n + (type(v) == "string" and #v or 0) + 128      -- a number or a width/precision pads to < 128
    end
    too_big("string.format", n)
    return copied("string.format", str_format(fmt, unpack(args, 1, select("#", ...))))
  end,
}

local function less_than(a, b) return a < b end
if jit_off then jit_off(less_than) end

-- the elements a shift of t from pos on moves (table.insert, table.remove): #t - pos + 1, within [0, #t]
local function shifted(t, pos)
  if type(t) ~= "table" then return 0 end
  local n, at = #t, tonumber(pos) or #t
  return math.max(math.min(n - at + 1, n), 0)
end
local safe_table = {
  remove = function(t, ...)
    if select("#", ...) > 0 then lib_work("table.remove", shifted(t, (...))) end
    return tbl_remove(t, ...)
  end,
  -- (the comparisons are the work: a recipe's comparator is its own code, which the hook counts, and the
  -- default one is the Lua comparison below, never compiled.  A charge of n log2 n was not enough: an input
  -- built against the quicksort's median of three takes n^2 / 4 comparisons, 2.6 s for 40000 values)
  sort = function(t, cmp)
    if cmp ~= nil then return tbl_sort(t, cmp) end
    local ok, e = real_pcall(tbl_sort, t, less_than)
    if ok then return end
    if active and active.tripped then error(e, 0) end   -- (a limit, as the hook raised it)
    -- a comparison error names the recipe's line, as the C comparison's did, not less_than's
    error(type(e) == "string" and (str_gsub(e, "^[^:]*:%d+: ", "")) or e, 2)
  end,
  -- (in Lua: its walk of the whole table, hash part included, is then the hook's to count)
  maxn = function(t)
    if type(t) ~= "table" then error(str_format("bad argument #1 to 'maxn' (table expected, got %s)", type(t)), 2) end
    local m = 0
    for k in pairs(t) do
      if type(k) == "number" and k > m then m = k end
    end
    return m
  end,
  -- insert(t, pos, v) shifts t[pos .. #t] in one C loop: a position below 1 (down to -2^31) makes that loop as
  -- long as the recipe likes, out of the hook's reach.  Positions 1 .. #t + 1 keep it bounded by the table.
  insert = function(t, ...)
    if select("#", ...) == 2 and type(t) == "table" then
      local pos = tonumber((...))
      -- (the C function reads pos as an int32: NaN and 2^31 or more become -2^31, a shift of 2^31 elements)
      if pos and not (pos >= 1 and pos < 2 ^ 31) then
        error(str_format("table.insert: position %s out of bounds", real_tostring(pos)), 2)
      end
      lib_work("table.insert", shifted(t, pos))
    end
    return tbl_insert(t, ...)
  end,
  concat = function(t, sep, i, j)
    if type(t) == "table" then
      local n, seplen = 0, type(sep) == "string" and #sep or 0
      i = i or 1
      j = j or #t
      -- stops at the first non-string (concat itself then raises): bounded by the table's contents
      for k = i, j do
        local v = t[k]
        if type(v) == "string" then n = n + #v + seplen
        elseif type(v) == "number" then n = n + 24 + seplen
        else break end
        too_big("table.concat", n)
      end
    end
    return copied("table.concat", tbl_concat(t, sep, i, j))
  end,
}

-- (never compiled: LuaJIT runs no hook inside a trace, and this walk's length is the recipe's table's)
if jit_off then jit_off(safe_table.maxn) end

local safe_math = {}
for _, k in ipairs { "abs", "acos", "asin", "atan", "atan2", "ceil", "cos", "cosh", "deg", "exp", "floor", "fmod",
                     "frexp", "huge", "ldexp", "log", "log10", "max", "min", "modf", "pi", "pow", "rad", "sin",
                     "sinh", "sqrt", "tan", "tanh" } do
  safe_math[k] = math[k]
end

-- the moonstep functions a sandboxed recipe may call: tensor math, no files, no contexts on foreign streams
local safe_ms = {
  "empty", "full", "zeros", "ones", "zeros_like", "empty_like", "tensor", "rand", "randn", "is_tensor",
  "broadcast_shapes", "lerp", "addcmul", "addcdiv", "dot", "matmul", "eye", "diag", "eigh",
  "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
  "neg", "abs", "sqrt", "rsqrt", "exp", "log", "sign", "square", "reciprocal", "tanh", "sigmoid", "relu",
  "sin", "cos", "sum", "mean", "max", "min", "norm", "sumsq", "amax",
  "adamw_step", "sgd_step", "foreach_sumsq", "foreach_scale", "version",
  "sinkgd_step", "adamw8_step", "adamw8_qmap",
  "block_list", "blocks_gather", "blocks_apply", "blocks_scatter", "dash_graft", "inv_root", "spectrum_estimate",
  "block_plan", "blocks_gather_factors",
}

-- the sandbox's own tables, shared by every recipe: no recipe's retained memory
local shared = setmetatable({}, { __mode = "k" })

local function readonly(t, what)
  local proxy = setmetatable({}, {
    __index = t,
    __newindex = function(_, k) error(str_format("%s is read-only (tried to set %s)", what, real_tostring(k)), 2) end,
    __metatable = false,
  })
  shared[proxy] = true
  return proxy
end

local safe_string_ro = readonly(safe_string, "string")
local safe_table_ro = readonly(safe_table, "table")
local safe_math_ro = readonly(safe_math, "math")

-- after a limit has tripped, the error goes on up whatever the recipe's pcall caught
local refused
local function settle(ok, ...)
  if active and (active.tripped or refused(active)) then error(active.tripped, 0) end
  -- a trusted function's message may print an argument with the real tostring ("table: 0x7f..."): the
  -- recipe that catches it sees the kind only, as from its own tostring
  if not ok and type((...)) == "string" then return ok, (str_gsub((...), "(%a+): 0x%x+", "%1")) end
  return ok, ...
end

-- tostring without heap addresses (functions, tables): they help no recipe and would help an exploit
safe_tostring = function(v)
  local tv = type(v)
  if tv == "string" or tv == "number" or tv == "boolean" or tv == "nil" then return real_tostring(v) end
  if tv == "table" and (tensor.is_tensor(v) or getmetatable(v) == "moonstep.Context") then return real_tostring(v) end
  return tv
end

local safe_globals = {
  assert = assert, error = error, ipairs = ipairs, next = next, pairs = pairs, select = select,
  tonumber = tonumber, type = type, unpack = unpack, rawequal = rawequal, tostring = safe_tostring,
  pcall = function(f, ...) return settle(real_pcall(f, ...)) end,
  xpcall = function(f, h, ...)
    local handler = h
    if type(h) == "function" then    -- (the handler sees the message first: scrubbed as settle does)
      handler = function(e)
        if type(e) == "string" then e = str_gsub(e, "(%a+): 0x%x+", "%1") end
        return h(e)
      end
    end
    return settle(real_xpcall(f, handler, ...))
  end,
}

-- what README's "Refused" list names: absent from a sandboxed recipe's globals (nil: a recipe may probe for one,
-- `setmetatable and setmetatable(...)`); an error from using one says why (refused_note)
local REFUSED = {}
for _, k in ipairs { "io", "os", "ffi", "require", "debug", "package", "load", "loadstring", "loadfile", "dofile",
                     "collectgarbage", "setfenv", "getfenv", "getmetatable", "setmetatable", "rawget", "rawset",
                     "coroutine", "jit" } do
  REFUSED[k] = true
end
local function refused_note(msg)
  if type(msg) ~= "string" then return msg end
  local name = msg:match("attempt to %a+ global '([%w_]+)' %(a nil value%)")
  if name and REFUSED[name] then
    return msg .. (" ('%s' is not available to a sandboxed recipe; a trusted one runs unsandboxed)"):format(name)
  end
  return msg
end

local function sandbox_env(ms)
  local env = {}
  for k, v in pairs(safe_globals) do env[k] = v end
  env.string, env.table, env.math = safe_string_ro, safe_table_ro, safe_math_ro
  local m = {}
  for _, k in ipairs(safe_ms) do m[k] = ms[k] end
  m.json = readonly({ encode = ms.json.encode, decode = ms.json.decode }, "ms.json")
  m.routing = readonly({ adamw_by_name = ms.routing.adamw_by_name }, "ms.routing")
  env.ms = readonly(m, "ms")
  env._G = env
  return env
end

-- ---------------------------------------------------------------------------------------------------
-- the Lua data a recipe keeps across calls (limits.retained)
-- ---------------------------------------------------------------------------------------------------
-- sizes of LuaJIT's objects on a 64-bit machine, near enough for a limit: a table's header, an array slot and a
-- hash node; a string's header; a closure's header, a reference to an upvalue and the upvalue itself
local TABLE_BYTES, ARRAY_SLOT_BYTES, HASH_SLOT_BYTES = 64, 8, 24
local STRING_BYTES, CLOSURE_BYTES, UPREF_BYTES, UPVALUE_BYTES = 24, 40, 8, 48

-- A table's array and hash slots as allocated, used or not (a table the recipe emptied keeps them): LuaJIT's
-- GCtab holds them (asize, hmask) at an offset that depends on its build, found here on tables of known sizes
-- (table.new).  nil where no offset checks out: the sizes are then estimated from the entries.
local table_slots = (function()
  local ffi = core.ffi
  local ok, table_new = pcall(require, "table.new")
  if not ok then return nil end
  local function at(offset)
    return function(t)
      local p = ffi.cast("const uint32_t *", tonumber(str_sub(str_format("%p", t), 3), 16) + offset)
      return p[0], p[1] + 1
    end
  end
  for _, offset in ipairs { 48, 24 } do            -- GC64, then 32-bit references
    local slots = at(offset)
    local ok1, a1, h1 = pcall(slots, table_new(100, 0))
    local ok2, a2, h2 = pcall(slots, table_new(0, 100))
    local ok3, a3, h3 = pcall(slots, table_new(7, 9))
    if ok1 and ok2 and ok3 and a1 == 101 and h1 == 1 and a2 == 0 and h2 == 128 and a3 == 8 and h3 == 16 then
      return slots
    end
  end
  return nil
end)()

local function table_bytes(t)
  if table_slots then
    local array, hash = table_slots(t)
    return TABLE_BYTES + array * ARRAY_SLOT_BYTES + hash * HASH_SLOT_BYTES
  end
  local entries, border = 0, #t
  for _ in next, t do entries = entries + 1 end
  return TABLE_BYTES + border * ARRAY_SLOT_BYTES + math.max(entries - border, 0) * HASH_SLOT_BYTES
end

-- a table's slots and the strings it holds directly: what a table the runtime keeps counts as its own
local function own_bytes(t)
  local bytes = table_bytes(t)
  for k, v in next, t do
    if type(k) == "string" then bytes = bytes + STRING_BYTES + #k end
    if type(v) == "string" then bytes = bytes + STRING_BYTES + #v end
  end
  return bytes
end

-- objects no walk enters: the sandbox's shared tables, tensors (the quota counts their memory; their Lua side
-- is the runtime's) and contexts
local function not_the_recipes(t)
  return shared[t] or tensor.is_tensor(t) or real_getmetatable(t) == "moonstep.Context"
end

-- each recipe loaded untrusted: its environment, and that table's own bytes before the recipe ran (the
-- environment held weakly, as the recipe's functions hold it: weak keys do not stop a value that leads back to
-- its key from keeping the key alive)
local sandboxes = setmetatable({}, { __mode = "k" })

--- The runtime keeps table t for the recipe of guard g across calls (a group, a member, a state table, a view):
--- it becomes a root of the recipe's retained memory, which counts what is added to it from now on.  Tables
--- reachable from t are kept with it, except those kept already (a state table the recipe has filled since),
--- so keep what the runtime builds before the recipe can write into it.  A no-op for trusted recipes (g nil).
function M.keep(g, t)
  if g == nil or type(t) ~= "table" then return end
  local kept, stack = g.kept, { t }
  while #stack > 0 do
    local x = stack[#stack]
    stack[#stack] = nil
    if kept[x] == nil and not not_the_recipes(x) then
      kept[x] = own_bytes(x)
      for k, v in next, x do
        if type(k) == "table" then stack[#stack + 1] = k end
        if type(v) == "table" then stack[#stack + 1] = v end
      end
    end
  end
end

local upvalue_id = debug.upvalueid

-- The bytes of Lua data the recipe of guard g can reach from its roots: its table, its environment, the
-- upvalues of its functions and the tables the runtime keeps for it (less their own bytes when kept).  A walk,
-- each object once: garbage is never reached, nor the host's heap (the runtime's functions, whose environment
-- is not the recipe's, are not entered).
local function retained_bytes(g)
  local kept, env = g.kept, g.env
  local seen, stack, n, total = {}, {}, 0, 0
  local function push(v)
    local tv = type(v)
    if (tv == "table" or tv == "string" or tv == "function") and not seen[v] then
      seen[v] = true
      n = n + 1
      stack[n] = v
    end
  end
  push(g.recipe)
  push(env)
  for t in next, kept do push(t) end
  while n > 0 do
    local v = stack[n]
    stack[n] = nil
    n = n - 1
    local tv = type(v)
    if tv == "string" then
      total = total + STRING_BYTES + #v
    elseif tv == "table" then
      if not not_the_recipes(v) then
        total = total + table_bytes(v) - (kept[v] or 0)
        for k, x in next, v do
          push(k)
          push(x)
        end
      end
    elseif iterator_subject[v] ~= nil then   -- a gmatch iterator the recipe keeps: its subject
      total = total + CLOSURE_BYTES
      push(iterator_subject[v])
    elseif real_getfenv(v) == env then       -- a function the recipe made: a closure and its upvalues
      local ups = debug.getinfo(v, "u").nups
      total = total + CLOSURE_BYTES + ups * UPREF_BYTES
      for i = 1, ups do
        local id = upvalue_id and upvalue_id(v, i)
        if id == nil or not seen[id] then
          if id ~= nil then seen[id] = true end
          total = total + UPVALUE_BYTES
          local _, x = debug.getupvalue(v, i)
          push(x)
        end
      end
    end
  end
  return math.max(total, 0)
end

-- heap allocated during the call of guard g that just ended: the growth the heap cap granted (frees not taken
-- off), or without the cap the heap's net growth over the call (which what the call's collection steps freed
-- can hide: the walk then comes later than it should)
local function allocated_in_call(g)
  if heap ~= nil then return tonumber(heap.cap.allocated) end
  return math.max((collectgarbage("count") - g.mem0) * 1024, 0)
end

-- Near the limit, a walk after every RETAINED_STEP of it allocated: a recipe that keeps a little more at every
-- call is stopped at most that much past its limit, and one that only makes garbage near it pays a walk per
-- RETAINED_STEP of its limit allocated.
local RETAINED_STEP = 1 / 8

-- The retained limit, checked at the end of a guarded call of a loaded recipe: a walk only when what the calls
-- allocated since the last one could have taken the recipe past its limit (the first call walks, to start;
-- while over the limit, every call walks).  The call fails when it leaves the recipe over its limit holding more
-- than at the last walk: the call that crossed it and any later one that adds to it.  One that keeps as much or
-- lets go runs (a route's plan, or the step that gets the recipe back under).
local function check_retained(g)
  if g.env == nil then return end
  local before = g.found
  if before ~= nil and before <= g.retained and g.since < math.max(g.retained - before, g.retained * RETAINED_STEP) then
    return
  end
  local found = retained_bytes(g)
  g.found, g.since, g.walks = found, 0, g.walks + 1
  if found > g.retained and (before == nil or found > before) then
    error(("%s: retained memory limit of %.0f bytes exceeded: the recipe keeps %.0f bytes of Lua data across calls "
           .. "(reachable from its module, upvalues and state, after call %d)")
          :format(g.name, g.retained, found, g.calls), 0)
  end
end

-- a guard: the limits of one optimizer's (or one load's) untrusted calls and its engine-memory account
local function check_limits(limits)
  local out = { instructions = M.limits.instructions, memory = M.limits.memory, retained = M.limits.retained,
                quota = nil, seconds = nil }
  if limits == nil then return out end
  if type(limits) ~= "table" then
    error("sandbox limits must be a table {instructions=, memory=, retained=, quota=, seconds=}", 4)
  end
  for k, v in pairs(limits) do
    if out[k] == nil and k ~= "quota" and k ~= "seconds" then
      error(("unknown sandbox limit '%s' (limits: instructions, memory, retained, quota, seconds)")
            :format(real_tostring(k)), 4)
    end
    local x = M.types.number(v)
    if not x or x <= 0 then error(("sandbox limit %s must be a positive number (got %s)"):format(k, real_tostring(v)), 4) end
    out[k] = x
  end
  return out
end

--- The guard for running `recipe` untrusted, or nil when it is trusted (its calls then run unguarded).
--- limits = {instructions =, memory = (bytes of Lua heap growth per call), retained = (bytes of Lua data kept
--- across calls), quota = (engine bytes), seconds = (wall-clock time per call)}; params (optional, the
--- optimizer's parameter list) sets the default quota from their size.  guard.walks counts the walks of the
--- retained check, guard.found is the last one's bytes.
local new_guard
function M.guard(recipe, limits, params)
  local meta = M.meta[recipe]
  if meta == nil or meta.trusted then return nil end
  local g = new_guard(("recipe %s (%s)"):format(real_tostring(recipe.name), meta.chunkname), limits, params)
  local sandbox = sandboxes[recipe]
  if sandbox and sandbox.env then    -- the roots of its retained memory (a load's guard has none: one call)
    g.recipe, g.env = recipe, sandbox.env
    g.kept[sandbox.env] = sandbox.bytes
  end
  return g
end

local guards = setmetatable({}, { __mode = "k" })   -- the guards new_guard made (M.call takes no other)
new_guard = function(name, limits, params)
  local l = check_limits(limits)
  if l.quota == nil then
    local bytes = 0
    for _, p in ipairs(type(params) == "table" and params or {}) do
      if type(p) == "table" and tensor.is_tensor(p.param) then
        bytes = bytes + p.param:numel() * ({ f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, u8 = 1 })[p.param:dtype()]
      end
    end
    l.quota = M.limits.quota + M.QUOTA_PER_PARAM_BYTE * bytes
  end
  -- the engine-memory account: held bytes, in a table of its own that the charges' finalizers close over.  Not
  -- g: a charged tensor's token sits in a weak-keyed table (moonstep.tensor's anchors) and LuaJIT has no
  -- ephemerons, so a token reaching g, g.env and a recipe global holding that tensor kept the tensor, the
  -- guard, the recipe and its optimizer alive for good
  local account = { held = 0 }
  local g = { name = name, instructions = l.instructions, memory = l.memory, retained = l.retained, quota = l.quota,
              seconds = l.seconds, account = account, calls = 0, since = 0, walks = 0,
              kept = setmetatable({}, { __mode = "k" }) }      -- (tables the runtime keeps: M.keep)
  guards[g] = true
  -- the engine-memory account: a token per allocation, released by its finalizer (two collections after
  -- the tensor and its views die: the first clears the weak entry, the second finalizes the token)
  g.reserve = function(bytes)
    if account.held + bytes <= g.quota then return end
    collectgarbage()
    collectgarbage()
    if account.held + bytes > g.quota then
      error(str_format("%s: engine allocation quota exceeded (%.0f bytes held, %.0f more asked, quota %.0f)",
                       g.name, account.held, bytes, g.quota), 0)
    end
  end
  -- host memory one trusted call is about to build for the recipe (tensor data read back into Lua): checked
  -- beforehand against the memory limit, like string.rep's result, since it is built where the hook never runs
  g.host = function(what, bytes)
    if bytes > g.memory then
      error(str_format("%s: %s of %.0f bytes exceeds the recipe's memory limit of %.0f bytes", g.name, what, bytes,
                       g.memory), 0)
    end
  end
  -- iterations of a C loop the recipe sized (moonstep.tensor.charge_work): each counts as one hook period of
  -- instructions, since no hook runs inside the call; past the limit it trips like the hook (no pcall keeps it).
  -- A library call's C work (lib_work) comes as such periods too, and its message counts instructions.
  g.work = function(what, iterations, library)
    -- (the message first: formatting runs code the hook counts, and with the count already past the limit the
    -- hook would trip first, with its own vaguer message)
    if (g.count + iterations) * HOOK_EVERY > g.instructions then
      if library then
        g.why = str_format("instruction limit of %.0f exceeded: %s's work in C counts as %.0f instructions, after "
                           .. "%.0f", g.instructions, what, iterations * HOOK_EVERY, g.count * HOOK_EVERY)
      else
        g.why = str_format("instruction limit of %.0f exceeded: %s asks for %.0f iterations (each counts as %d "
                           .. "instructions)", g.instructions, what, iterations, HOOK_EVERY)
      end
      g.tripped = str_format("%s: %s", g.name, g.why)
      g.count = g.count + iterations
      error(g.tripped, 0)
    end
    g.count = g.count + iterations
  end
  g.charge = function(t, bytes)
    local token = newproxy(true)
    getmetatable(token).__gc = function() account.held = account.held - bytes end
    account.held = account.held + bytes
    tensor.set_anchor(t, token)
  end
  return g
end

local call, leave

-- a request the heap cap refused trips the guard like the hook's own memory check (its "not enough memory"
-- error could be caught by the recipe); true when tripped
refused = function(g)
  if g.tripped == nil and heap_refused() then
    g.why = str_format("Lua memory limit of %.0f bytes exceeded (an allocation past %d times it was refused)",
                       g.memory, HEAP_CAP_FACTOR)
    g.tripped = str_format("%s: %s", g.name, g.why)
  end
  return g.tripped ~= nil
end

local function trip(g, why)
  g.tripped = str_format("%s: %s", g.name, why)
  -- never raise inside M.call's own bookkeeping (outside its pcall): the pcall's result carries it instead
  local f = debug.getinfo(3, "f")
  if f and (f.func == call or f.func == leave) then return end
  error(g.tripped, 0)
end

local function hook()
  local g = active
  if g == nil then return end
  if g.tripped or refused(g) then trip(g, g.why) return end
  g.count = g.count + 1
  -- the Lua heap the call allocated since the last look: the work of `..` and of any C function that builds a
  -- string or a table, an instruction per ALLOC_BYTES_PER_INSTRUCTION bytes (garbage included: building it was
  -- work)
  if heap ~= nil and heap.armed then
    local a = tonumber(heap.cap.allocated)
    local counts = (a - g.alloc_seen) / (ALLOC_BYTES_PER_INSTRUCTION * HOOK_EVERY)
    g.count, g.alloc_counts, g.alloc_seen = g.count + counts, g.alloc_counts + counts, a
  end
  if g.count * HOOK_EVERY > g.instructions then
    g.why = str_format("instruction limit of %.0f exceeded (an endless loop?)", g.instructions)
    if g.alloc_counts > 0.1 * g.count then
      g.why = str_format("instruction limit of %.0f exceeded (%.0f of them for the %.0f bytes of Lua heap the call "
                         .. "allocated, an instruction per %d bytes)", g.instructions, g.alloc_counts * HOOK_EVERY,
                         g.alloc_seen, ALLOC_BYTES_PER_INSTRUCTION)
    end
    trip(g, g.why)
    return
  end
  if g.deadline and clock() > g.deadline then
    g.why = str_format("time limit of %g s exceeded", g.seconds)
    trip(g, g.why)
    return
  end
  if (collectgarbage("count") - g.mem0) * 1024 > g.memory then
    collectgarbage()
    if (collectgarbage("count") - g.mem0) * 1024 > g.memory then
      g.why = str_format("Lua memory limit of %.0f bytes exceeded", g.memory)
      trip(g, g.why)
      return
    end
  end
end

leave = function(g, prev, ok, ...)
  -- (first: what follows may need memory the cap would refuse)
  heap_disarm()
  active = nil
  debug.sethook(prev[1], prev[2], prev[3])
  refused(g)
  string_mt.__index = real_string_index
  tensor.set_alloc_guard(prev[4])
  g.since = g.since + allocated_in_call(g)
  local tripped = g.tripped
  g.tripped, g.why = nil, nil
  if tripped then error(tripped, 0) end
  if not ok then error(refused_note((...)), 0) end
  check_retained(g)
  return ...
end

-- armed and disarmed inside the pcall, so that no request is refused outside it, where the error would escape
-- M.call with its hook still set (a refused request disarms the cap by itself: see moonstep.h).  The guard
-- is let go there too: no recipe code runs after that, and a hook that tripped between the end of fn and
-- leave's restore would raise outside the pcall, leaving the hook set and the guard active for all the code
-- that follows (a tripped guard then raises its error again anywhere)
local function disarmed(...)
  heap_disarm()
  active = nil
  return ...
end
local function armed(limit, fn, ...)
  heap_arm(limit)
  return disarmed(fn(...))
end
local function disarm_on_error(e)
  heap_disarm()
  active = nil
  return e
end

--- Runs fn(...) as untrusted code under guard g (from M.guard), or plainly when g is nil (trusted).
--- Every call of a recipe function by the runtime goes through here.
call = function(g, fn, ...)
  if g == nil or active ~= nil then return fn(...) end     -- trusted, or already inside a guarded call
  -- (checked before the hook, string metatable and allocation guard are swapped: an error after that
  -- would leave them set for all code that follows)
  if not guards[g] then error(("recipe.call: guard must be one M.guard made (got %s)"):format(core.show(g)), 2) end
  if type(fn) ~= "function" then error(("recipe.call: fn must be a function (got %s)"):format(core.show(fn)), 2) end
  local h, mask, count = debug.gethook()
  local prev = { h, mask, count, tensor.set_alloc_guard(g) }
  g.count, g.mem0, g.calls, g.alloc_seen, g.alloc_counts = 0, collectgarbage("count"), g.calls + 1, 0, 0
  g.deadline = g.seconds and clock() + g.seconds
  string_mt.__index = safe_string_ro
  active = g
  debug.sethook(hook, "", HOOK_EVERY)
  return leave(g, prev, real_xpcall(armed, disarm_on_error, HEAP_CAP_FACTOR * g.memory, fn, ...))
end
M.call = call

-- ---------------------------------------------------------------------------------------------------
-- loading
-- ---------------------------------------------------------------------------------------------------
local function check_shape(r, chunkname)
  if type(r) ~= "table" then error(("recipe %s must return a table (got %s)"):format(chunkname, type(r)), 0) end
  if type(r.name) ~= "string" or r.name == "" then error(("recipe %s: field 'name' must be a string"):format(chunkname), 0) end
  if type(r.options) ~= "table" then error(("recipe %s: field 'options' must be a table"):format(r.name), 0) end
  if type(r.route) ~= "function" then error(("recipe %s: field 'route' must be a function"):format(r.name), 0) end
  if type(r.routes) ~= "table" or next(r.routes) == nil then error(("recipe %s: field 'routes' must be a non-empty table"):format(r.name), 0) end
  for rname, route in pairs(r.routes) do
    if type(route) ~= "table" or type(route.step) ~= "function" then
      error(("recipe %s: route '%s' needs a step function"):format(r.name, tostring(rname)), 0)
    end
    for _, f in ipairs { "init", "plan" } do
      if route[f] ~= nil and type(route[f]) ~= "function" then
        error(("recipe %s: route '%s': %s must be a function"):format(r.name, rname, f), 0)
      end
    end
  end
  if r.validate ~= nil and type(r.validate) ~= "function" then error(("recipe %s: validate must be a function"):format(r.name), 0) end
  for oname, spec in pairs(r.options) do
    if type(oname) ~= "string" or type(spec) ~= "table" then error(("recipe %s: option specs must be tables keyed by name"):format(r.name), 0) end
    if not M.types[spec.type] then
      error(("recipe %s: option '%s' has unknown type %s"):format(r.name, oname, tostring(spec.type)), 0)
    end
  end
  return r
end

-- (trusted = "false" or 0 is true to Lua: it would run the recipe unsandboxed)
local LOAD_OPTIONS = { trusted = "boolean", limits = function() end }   -- (limits: check_limits)

--- Loads a recipe from source text.  opts.trusted (default false) runs it with the full Lua environment.
function M.load_string(src, chunkname, opts)
  if type(src) ~= "string" then error("recipe source must be a string", 2) end
  core.check_options("recipe.load", opts, LOAD_OPTIONS, 2)
  chunkname = chunkname or "=(recipe)"
  local trusted = opts and opts.trusted
  if src:sub(1, 1) == "\27" then error(("recipe %s: precompiled bytecode is not accepted"):format(chunkname), 2) end
  local env = trusted and setmetatable({ ms = require("moonstep") }, { __index = _G }) or sandbox_env(require("moonstep"))
  local env_bytes = not trusted and own_bytes(env) or nil
  local chunk, err = load(src, chunkname, "t", env)
  if not chunk then error("recipe " .. chunkname .. ": " .. err, 2) end
  local ok, r
  if trusted then
    ok, r = pcall(chunk)
  else
    -- every function the recipe defines is a child of this chunk: none of them is ever compiled, so the
    -- instruction hook always runs in recipe code
    jit_off(chunk, true)
    ok, r = pcall(call, new_guard("recipe " .. chunkname, opts and opts.limits), chunk)
  end
  if not ok then
    local msg = tostring(r)
    if msg:sub(1, 7 + #chunkname) ~= "recipe " .. chunkname then msg = "recipe " .. chunkname .. ": " .. msg end
    error(msg, 2)
  end
  r = check_shape(r, chunkname)
  -- the contract's metadata, kept beside the recipe (not inside it: a sandboxed table could lie)
  M.meta[r] = { source = src, hash = M.hash(src), chunkname = chunkname, trusted = trusted and true or false }
  if not trusted then sandboxes[r] = setmetatable({ env = env, bytes = env_bytes }, { __mode = "v" }) end
  return r
end

M.meta = setmetatable({}, { __mode = "k" })

--- Loads a recipe file (untrusted unless opts.trusted).
function M.load(path, opts)
  if type(path) ~= "string" then error("recipe path must be a string", 2) end
  -- (io.open hands the path to C, which would open the file named by the part before a NUL)
  core.c_string("recipe", "path", path, 2)
  local src, err = read_file(path)
  if not src then error("cannot read recipe " .. path .. ": " .. tostring(err), 2) end
  local r = M.load_string(src, "@" .. path, opts)
  M.meta[r].path = path
  return r
end

-- a built-in recipe's name, as M.find and M.get take it (errors name the caller's call)
local function check_builtin_name(name)
  if type(name) == "string" then core.c_string("recipe", "name", name, 3) end
  if type(name) ~= "string" or name == "" or name:find("/", 1, true) or name:find("%.lua$") then
    error(("recipe name %q: a built-in name has no '/' and no '.lua' (use ms.recipe.load for files)"):format(tostring(name)), 3)
  end
end

--- Where the recipe called `name` is: its file and whether it is trusted (a built-in), or nil and the message
--- that get() raises (the folders searched).  Finds without loading: `moonstep train` tells a recipe that is
--- not there (a usage error) from one that fails to load.
function M.find(name)
  check_builtin_name(name)
  local tried = {}
  for _, d in ipairs(M.search_path()) do
    local p = d .. "/" .. name .. ".lua"
    if read_file(p) then return p, true end
    tried[#tried + 1] = d
  end
  for _, d in ipairs(user_path()) do
    local p = d .. "/" .. name .. ".lua"
    if read_file(p) then return p, false end
    tried[#tried + 1] = d
  end
  return nil, ("no recipe named %q (searched %s and MOONSTEP_RECIPE_PATH)"):format(name, table.concat(tried, ", "))
end

--- A built-in recipe by name (no '/' and no '.lua'), searched in the recipe folders and then
--- MOONSTEP_RECIPE_PATH.  Built-ins are trusted; recipes found through MOONSTEP_RECIPE_PATH are not.
function M.get(name)
  check_builtin_name(name)
  local p, trusted = M.find(name)
  if not p then error(trusted, 2) end
  local r = M.load(p, { trusted = trusted })
  -- (a checkpoint records a recipe found by name by its name alone: its file moves with the installation)
  M.meta[r].by_name = name
  return r
end

--- A recipe table from a table, a built-in name or a file path.
function M.resolve(recipe, opts)
  if type(recipe) == "table" then
    if not M.meta[recipe] then
      check_shape(recipe, "(table)")
      M.meta[recipe] = { hash = "table:" .. recipe.name .. ":" .. tostring(recipe.version or 0), trusted = true }
    end
    return recipe
  end
  if type(recipe) ~= "string" then error("recipe must be a table, a built-in name or a file path", 3) end
  if recipe:find("/", 1, true) or recipe:find("%.lua$") then return M.load(recipe, opts) end
  return M.get(recipe)
end

-- ---------------------------------------------------------------------------------------------------
-- option specs
-- ---------------------------------------------------------------------------------------------------
-- a decimal number written out in full ("0.1", "-3e-4"); hex, "inf", "nan" and trailing junk are refused
local function strict_number(s)
  if type(s) ~= "string" then return nil end
  local t = s:match("^%s*(.-)%s*$")
  if not t:match("^[-+]?%d*%.?%d*[eE]?[-+]?%d*$") then return nil end
  return tonumber(t)
end

-- config-file flag words, any case, blanks around dropped; "on" / "off" too, as axolotl's optim_args strings
-- (its _as_bool) take them
local booleans = { ["true"] = true, ["false"] = false, ["1"] = true, ["0"] = false, yes = true, no = false, on = true,
                   off = false }

-- the strings of a list option: a table that is a sequence of non-empty strings, or "a, b" (blanks around an
-- item dropped, empty items skipped); returns a fresh table, or nil and why
local function string_list(v, what)
  if type(v) == "string" then
    local t = {}
    for part in v:gmatch("[^,]+") do
      local item = part:match("^%s*(.-)%s*$")
      if item ~= "" then t[#t + 1] = item end
    end
    return t
  end
  local needed = "a list of " .. what .. " is needed"
  if type(v) ~= "table" then return nil, needed end
  local count = 0
  for _ in pairs(v) do count = count + 1 end
  if count ~= #v then return nil, needed .. " (a table with keys 1..n)" end
  local out = {}
  for i = 1, #v do
    if type(v[i]) ~= "string" or v[i] == "" then return nil, ("item %d must be a non-empty string"):format(i) end
    out[i] = v[i]
  end
  return out
end

-- each type: convert(value) -> converted or nil, why
M.types = {
  -- finite only: a min/max range lets inf through ("1e999" reads as inf) and NaN too, and values such as the lr
  -- reach the engine as device scalars it cannot check
  number = function(v)
    if type(v) == "string" then v = strict_number(v) end
    if type(v) ~= "number" or v ~= v then return nil, "a number is needed" end
    if v == math.huge or v == -math.huge then return nil, "a finite number is needed" end
    return v
  end,
  integer = function(v)
    if type(v) == "string" then v = strict_number(v) end
    if type(v) ~= "number" or v ~= math.floor(v) or v ~= v or math.abs(v) == math.huge then return nil, "an integer is needed" end
    return v
  end,
  boolean = function(v)
    if type(v) == "string" then
      local b = booleans[v:match("^%s*(.-)%s*$"):lower()]
      if b == nil then return nil, "a boolean is needed (true/false)" end
      return b
    end
    if type(v) ~= "boolean" then return nil, "a boolean is needed" end
    return v
  end,
  string = function(v)
    if type(v) ~= "string" then return nil, "a string is needed" end
    return v
  end,
  numbers = function(v)        -- an array of numbers (e.g. betas); "0.9,0.999" and "(0.9, 0.999)" accepted
    if type(v) == "string" then
      local t = {}
      for part in v:gsub("^%s*[%(%[]", ""):gsub("[%)%]]%s*$", ""):gmatch("[^,]+") do
        local x = strict_number(part)
        if not x then return nil, "a list of numbers is needed" end
        t[#t + 1] = x
      end
      v = t
    end
    if type(v) ~= "table" then return nil, "a list of numbers is needed" end
    local out = {}
    for i = 1, #v do
      local x = v[i]
      if type(x) ~= "number" then return nil, "a list of numbers is needed" end
      if x ~= x or x == math.huge or x == -math.huge then return nil, ("item %d is not a finite number"):format(i) end
      out[i] = x
    end
    return out
  end,
  -- an array of non-empty strings (e.g. methods); "a,b" accepted, blanks around an item dropped
  strings = function(v) return string_list(v, "strings") end,
  -- strings that are each a valid Lua pattern (name routing: string.find)
  patterns = function(v)
    local t, why = string_list(v, "name patterns")
    if t == nil then return nil, why end
    for i, s in ipairs(t) do
      local ok, err = pcall(string.find, "", s)
      if not ok then return nil, ("item %d = %q is not a valid Lua pattern: %s"):format(i, s, err) end
    end
    return t
  end,
  ["nil"] = nil,
}
M.types.any = function(v) return v end

local function describe(v)
  if type(v) == "string" then return ("%q"):format(v) end
  if type(v) == "table" and #v > 0 then   -- a list, as written in Lua
    local items = {}
    for i = 1, math.min(#v, 8) do items[i] = type(v[i]) == "table" and "{...}" or describe(v[i]) end
    return "{" .. table.concat(items, ", ") .. (#v > 8 and ", ..." or "") .. "}"
  end
  return core.show(v)   -- ("a table", not its address)
end

--- Checks one option value against its spec; returns the converted value or raises naming the option.
function M.check_option(rname, name, spec, v)
  local conv = M.types[spec.type]
  local x, why = conv(v)
  if x == nil then error(("%s: option '%s' = %s: %s"):format(rname, name, describe(v), why), 0) end
  if spec.values then   -- of the value, or of each item of a list
    local list = type(x) == "table"
    for i, y in ipairs(list and x or { x }) do
      local ok = false
      for _, a in ipairs(spec.values) do if a == y then ok = true end end
      if not ok then
        error(("%s: option '%s'%s = %s: must be one of %s"):format(rname, name, list and "[" .. i .. "]" or "",
          describe(list and y or v), table.concat(spec.values, ", ")), 0)
      end
    end
  end
  if spec.nonempty and type(x) == "table" and #x == 0 then
    error(("%s: option '%s' needs at least one item"):format(rname, name), 0)
  end
  local function range(y, label)
    if spec.min ~= nil and y < spec.min then error(("%s: option '%s'%s = %s is below its minimum %s"):format(rname, name, label, describe(y), tostring(spec.min)), 0) end
    if spec.max ~= nil and y > spec.max then error(("%s: option '%s'%s = %s is above its maximum %s"):format(rname, name, label, describe(y), tostring(spec.max)), 0) end
    if spec.above ~= nil and not (y > spec.above) then error(("%s: option '%s'%s = %s must be > %s"):format(rname, name, label, describe(y), tostring(spec.above)), 0) end
    if spec.below ~= nil and not (y < spec.below) then error(("%s: option '%s'%s = %s must be < %s"):format(rname, name, label, describe(y), tostring(spec.below)), 0) end
  end
  if type(x) == "number" then range(x, "")
  elseif spec.type == "numbers" then
    if spec.length and #x ~= spec.length then
      error(("%s: option '%s' needs %d numbers (got %d)"):format(rname, name, spec.length, #x), 0)
    end
    for i, y in ipairs(x) do
      -- (integer = true: a list of counts or sizes, e.g. dims, that a fraction would never match)
      if spec.integer and y ~= math.floor(y) then
        error(("%s: option '%s'[%d] = %s: an integer is needed"):format(rname, name, i, describe(y)), 0)
      end
      range(y, "[" .. i .. "]")
    end
  end
  return x
end

--- Options for a recipe: the given ones checked and converted, defaults filled in, then validate().
--- Unknown options are refused.  `base` (optional) supplies values for options not given (group overrides).
-- A recipe table from a name, a path or the table itself; anything else is named (it failed inside, as
-- "attempt to index a number")
local function recipe_arg(what, recipe)
  if type(recipe) == "string" then return M.resolve(recipe) end
  if type(recipe) ~= "table" or type(recipe.name) ~= "string" or type(recipe.options) ~= "table" then
    error(("%s: recipe must be a recipe table, a built-in name or a file path (got %s)"):format(what, core.show(recipe)), 3)
  end
  return recipe
end

function M.options(recipe, given, base, guard)
  recipe = recipe_arg("recipe.options", recipe)
  given = given or {}
  if type(given) ~= "table" then error(recipe.name .. ": options must be a table", 2) end
  core.check_keys(recipe.name, given, recipe.options, 0)
  local out = {}
  for k, v in pairs(given) do out[k] = M.check_option(recipe.name, k, recipe.options[k], v) end
  for k, spec in pairs(recipe.options) do
    if out[k] == nil then
      if base and base[k] ~= nil then out[k] = base[k]
      elseif spec.default ~= nil then out[k] = M.check_option(recipe.name, k, spec, spec.default) end
    end
  end
  if recipe.validate then
    -- an untrusted recipe's validate runs guarded (the optimizer's guard, or one with the default limits)
    call(guard or M.guard(recipe), recipe.validate, out)
  end
  return out
end

--- The options documentation of a recipe, as lines "name (type, default): doc".
function M.doc(recipe)
  recipe = recipe_arg("recipe.doc", recipe)
  local names = {}
  for n in pairs(recipe.options) do names[#names + 1] = n end
  table.sort(names)
  local lines = {}
  for _, n in ipairs(names) do
    local s = recipe.options[n]
    local d = s.default
    if type(d) == "table" then d = "{" .. table.concat(d, ", ") .. "}" end
    lines[#lines + 1] = ("%-28s %-8s default %-10s %s"):format(n, s.type, tostring(d), s.doc or "")
  end
  return table.concat(lines, "\n")
end

return M
