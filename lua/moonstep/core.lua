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

return M
