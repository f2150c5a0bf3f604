--[[
moonstep.core -- loads libmoonstep through the FFI, declares its ABI from the cdef the library itself
carries (generated from moonstep.h at build time, never hand-copied), checks the ABI version, and turns
status codes into Lua errors.  Everything above this module talks to C only through it.

The library is found, in order: MOONSTEP_LIB (a path), the path the moonstep host registered in
package.loaded["moonstep.config"], the build folder next to this source tree, the install layout
(<prefix>/lib beside <prefix>/share/lua/5.1), then the system loader ("moonstep").
]]
local ffi = require("ffi")

local M = { ffi = ffi }

-- the only hand-written declarations: enough to ask the library for its own cdef
ffi.cdef [[
const char *ms_cdef(void);
int ms_abi_version(void);
]]

local function file_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

local function here()
  local src = debug.getinfo(1, "S").source
  return (src:sub(1, 1) == "@" and src:sub(2) or src):match("^(.*)/[^/]*$") or "."
end

local function candidates()
  local list = {}
  local env = os.getenv("MOONSTEP_LIB")
  if env and env ~= "" then list[#list + 1] = env end
  local ok, config = pcall(require, "moonstep.config")
  if ok and type(config) == "table" and config.library then list[#list + 1] = config.library end
  local dir = here()                                             -- .../lua/moonstep
  local build = os.getenv("MOONSTEP_BUILD") or "build"
  local root = dir .. "/../.."
  if build:sub(1, 1) == "/" then list[#list + 1] = build .. "/libmoonstep.so"
  else list[#list + 1] = root .. "/" .. build .. "/libmoonstep.so" end
  list[#list + 1] = dir .. "/../../../../lib/libmoonstep.so"    -- <prefix>/share/lua/5.1/moonstep
  return list
end

local function load_library()
  local tried = {}
  for _, path in ipairs(candidates()) do
    if file_exists(path) then
      local ok, lib = pcall(ffi.load, path)
      if ok then return lib, path end
      tried[#tried + 1] = path .. " (" .. tostring(lib) .. ")"
    else
      tried[#tried + 1] = path .. " (missing)"
    end
  end
  local ok, lib = pcall(ffi.load, "moonstep")
  if ok then return lib, "moonstep" end
  error("moonstep: cannot find libmoonstep; tried " .. table.concat(tried, ", ") ..
        " and the system loader (set MOONSTEP_LIB, or run `make`)", 0)
end

local C, path = load_library()
M.C = C
M.library_path = path

-- the cdef the library was built from: declare it, minus the two bootstrap lines above
local cdef = ffi.string(C.ms_cdef())
cdef = cdef:gsub("[^\n]*ms_cdef%(void%);\n", ""):gsub("[^\n]*int ms_abi_version%(void%);\n", "")
ffi.cdef(cdef)
if C.ms_abi_version() ~= C.MS_ABI then
  error(("moonstep: library %s has ABI %d but its cdef declares %d"):format(path, C.ms_abi_version(),
        tonumber(C.MS_ABI)), 0)
end
M.ABI_VERSION = tonumber(C.MS_ABI)

-- preallocated out-parameters (one per kind; the binding is single-threaded like a LuaJIT state)
M.out_ctx = ffi.new("ms_ctx *[1]")
M.out_tensor = ffi.new("ms_tensor *[1]")
M.out_set = ffi.new("ms_tensor_set *[1]")
M.out_int = ffi.new("int[1]")

--- Raises the engine's last error as a Lua error (level: the caller of the binding function).
function M.raise(st, level)
  local msg = ffi.string(C.ms_last_error())
  if msg == "" then msg = ffi.string(C.ms_status_name(st)) end
  error(msg, (level or 2) + 1)
end

--- Checks a status; raises on failure.
function M.check(st, level)
  if st ~= 0 then M.raise(st, (level or 2) + 1) end
end

--- Calls fn(...) -> status; on out-of-memory collects garbage (tensors the GC has not finalised yet may
--- hold device memory it cannot see) and tries once more.
function M.check_alloc(fn, ...)
  local st = fn(...)
  if st == C.MS_E_OOM then
    collectgarbage("collect")
    collectgarbage("collect")
    st = fn(...)
  end
  if st ~= 0 then M.raise(st, 3) end
end

-- the folder of the runtime's own files (this one's)
local OWN_DIR = debug.getinfo(1, "S").source:match("^@(.*[/\\])") or ""

--- msg without a leading position in the runtime's own files ("/.../lua/moonstep/optim.lua:1286: "), and
--- whether it had one: such an error names its problem itself, and where the runtime raised it tells a user
--- (a trainer through the C API, the command line) nothing.  A recipe's or a script's position stays.
function M.strip_own_position(msg)
  if type(msg) ~= "string" or OWN_DIR == "" or msg:sub(1, #OWN_DIR) ~= OWN_DIR then return msg, false end
  return (msg:gsub("^[^\n]-%.lua:%d+: ", "", 1)), true
end

--- Seconds on a monotonic wall clock (os.clock would count the CPU time of every OpenMP thread, spinning ones
--- included): ms_clock, which allocates nothing.
M.clock = C.ms_clock

--- Owning pointers get their finalizer here, the single place they are received.
function M.own_tensor(p) return ffi.gc(p, C.ms_tensor_free) end
function M.own_ctx(p) return ffi.gc(p, C.ms_ctx_free) end
function M.own_set(p) return ffi.gc(p, C.ms_tensor_set_free) end

--- Refuses a key of table t that the set `known` (name -> true) lacks, naming it and the known ones: a misspelt
--- argument would otherwise leave its default in force, silently.  `what` leads the message ("block_plan"),
--- `noun` names the kind of key ("option" unless given); the error is raised at `level` of the caller (0: none).
function M.check_keys(what, t, known, level, noun)
  for k in pairs(t) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      error(("%s: unknown %s '%s' (known: %s)"):format(what, noun or "option", tostring(k), table.concat(names, ", ")),
            level == 0 and 0 or level + 1)
    end
  end
end


-- The kinds of values that arguments and options take.  Unchecked, the FFI truncates a fractional integer
-- toward zero (iters = 2.5 runs 2), wraps one past the C type's range, and takes a flag by Lua's truth
-- ("false" and 0 are true).  `words` completes "<name> must be ...".
local function finite(v) return type(v) == "number" and v > -math.huge and v < math.huge end
-- the largest C int (dims, iteration counts), and the largest double below 2^64 (seeds: uint64_t; converting
-- 2^64 or more is undefined)
M.INT_MAX, M.UINT64_MAX = 2 ^ 31 - 1, 2 ^ 64 - 2 ^ 11
M.kinds = {
  integer = { test = function(v) return finite(v) and v == math.floor(v) end, words = "an integer" },
  -- (NaN and inf pass: the engine names them with the value's own rule, "alpha = nan must be finite")
  number = { test = function(v) return type(v) == "number" end, words = "a number" },
  boolean = { test = function(v) return type(v) == "boolean" end, words = "true or false" },
  string = { test = function(v) return type(v) == "string" end, words = "a string" },
  table = { test = function(v) return type(v) == "table" end, words = "a table" },
  ["function"] = { test = function(v) return type(v) == "function" end, words = "a function" },
  -- a Philox seed or offset (uint64_t): a whole number, or a 64-bit integer cdata (2^63 + k is no double's)
  uint64 = {
    test = function(v)
      if type(v) == "cdata" then return ffi.istype("uint64_t", v) or (ffi.istype("int64_t", v) and v >= 0) end
      return finite(v) and v == math.floor(v) and v >= 0 and v <= M.UINT64_MAX
    end,
    words = "an integer in [0, 2^64)",
  },
}
-- specs of the common integer options: a count held in a C int (iterations, vectors, p), a Philox seed or offset
M.COUNT = { "integer", min = 0, max = M.INT_MAX }
M.SEED = "uint64"

--- A value as an error message shows it: strings quoted, numbers and booleans as written, else its type.
function M.show(v)
  if type(v) == "string" then return ("%q"):format(v) end
  if type(v) == "number" or type(v) == "boolean" or v == nil then return tostring(v) end
  return "a " .. type(v)
end

--- Checks one value against `spec`: a kind of M.kinds ("integer", "number", "boolean", "string", "table",
--- "function", "uint64"), or a table
--- {kind, min =, max =, values = {allowed strings}}.  Raises "<what>: <name> must be ..." at `level` of the
--- caller (0: none); returns v.  nil is refused like any other wrong kind: callers check optional ones only
--- when given.
function M.check_value(what, name, v, spec, level)
  local kind = type(spec) == "table" and spec[1] or spec
  local lvl = level == 0 and 0 or level + 1
  local k = M.kinds[kind]
  if not k.test(v) then
    error(("%s: %s must be %s (got %s)"):format(what, name, k.words, M.show(v)), lvl)
  end
  if type(spec) ~= "table" then return v end
  if spec.values then
    for _, a in ipairs(spec.values) do if a == v then return v end end
    error(("%s: %s must be one of %s (got %s)"):format(what, name, table.concat(spec.values, ", "), M.show(v)), lvl)
  end
  -- (written so that NaN fails them)
  if spec.min ~= nil and not (v >= spec.min) then
    error(("%s: %s must be >= %s (got %s)"):format(what, name, tostring(spec.min), M.show(v)), lvl)
  end
  if spec.max ~= nil and not (v <= spec.max) then
    error(("%s: %s must be <= %s (got %s)"):format(what, name, tostring(spec.max), M.show(v)), lvl)
  end
  return v
end

--- Returns s, a Lua string handed to C as a NUL-terminated char *, or raises "<what>: <name> must not contain a
--- NUL byte" at `level` of the caller: C reads it only up to its first NUL, so a path "w.st\0.bak" would write
--- w.st and a name "w\0x" save the tensor as w, silently.
function M.c_string(what, name, s, level)
  if s:find("\0", 1, true) then
    error(("%s: %s must not contain a NUL byte (got %s)"):format(what, name, M.show(s)), level == 0 and 0 or level + 1)
  end
  return s
end

--- Checks an option table: unknown keys refused (check_keys), then every value given against specs[key] (as
--- check_value; a function spec is a test of its own: fn(v) -> nil or the words "must be ..." completes).  nil
--- gives {} (no options); anything else not a table is refused.  Returns the table.
function M.check_options(what, t, specs, level)
  local lvl = level == 0 and 0 or level + 1
  if t == nil then return {} end
  -- (a tensor is a table too; its metatable is hidden behind this name)
  if type(t) ~= "table" or getmetatable(t) == "moonstep.Tensor" then
    error(("%s: options must be a table (got %s)"):format(what, M.show(t)), lvl)
  end
  M.check_keys(what, t, specs, lvl)
  for key, v in pairs(t) do
    local spec = specs[key]
    if type(spec) == "function" then
      local words = spec(v)
      if words then error(("%s: %s must be %s (got %s)"):format(what, key, words, M.show(v)), lvl) end
    else
      M.check_value(what, key, v, spec, lvl)
    end
  end
  return t
end

return M
