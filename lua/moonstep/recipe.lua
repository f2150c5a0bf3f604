--[[
moonstep.recipe -- finding, loading and checking recipes (the contract is in DESIGN.md, "Recipes").

  ms.recipe.get("adamw")                        built-in (recipes/ of the install or tree), then MOONSTEP_RECIPE_PATH
  ms.recipe.load("model/optim.lua", {trusted = false})
  ms.recipe.load_string(src, "=my recipe", {trusted = true})
  ms.recipe.options(recipe, {lr = "0.1"})       options checked against the recipe's specs, defaults filled

Built-in recipes are trusted.  Any other file is untrusted unless the caller says trusted = true: it then
runs in a restricted environment (safe Lua and the moonstep primitives only, text chunks only).
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
-- the sandbox for untrusted recipes (first version: a restricted environment; text chunks only)
-- ---------------------------------------------------------------------------------------------------
local safe_globals = {
  "assert", "error", "ipairs", "next", "pairs", "pcall", "select", "tonumber", "tostring", "type", "unpack",
  "xpcall", "rawequal",
}
local safe_libs = {
  math = { "abs", "acos", "asin", "atan", "atan2", "ceil", "cos", "cosh", "deg", "exp", "floor", "fmod", "frexp",
           "huge", "ldexp", "log", "log10", "max", "min", "modf", "pi", "pow", "rad", "sin", "sinh", "sqrt",
           "tan", "tanh" },
  string = { "byte", "char", "find", "format", "gmatch", "gsub", "len", "lower", "match", "rep", "reverse",
             "sub", "upper" },
  table = { "concat", "insert", "remove", "sort", "maxn" },
}

-- the moonstep functions a sandboxed recipe may call: tensor math, no files, no contexts on foreign streams
local safe_ms = {
  "empty", "full", "zeros", "ones", "zeros_like", "empty_like", "tensor", "rand", "randn", "is_tensor",
  "broadcast_shapes", "lerp", "addcmul", "addcdiv", "dot", "matmul", "eye", "diag", "eigh",
  "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
  "neg", "abs", "sqrt", "rsqrt", "exp", "log", "sign", "square", "reciprocal", "tanh", "sigmoid", "relu",
  "sin", "cos", "sum", "mean", "max", "min", "norm", "sumsq", "amax",
  "adamw_step", "sgd_step", "foreach_sumsq", "foreach_scale", "version",
  "sinkgd_step", "adamw8_step", "adamw8_qmap",
}

local function readonly(t, what)
  return setmetatable({}, {
    __index = t,
    __newindex = function(_, k) error(("%s is read-only (tried to set %s)"):format(what, tostring(k)), 2) end,
    __metatable = false,
  })
end

local function sandbox_env(ms)
  local env = {}
  for _, k in ipairs(safe_globals) do env[k] = _G[k] end
  for lib, names in pairs(safe_libs) do
    local t = {}
    for _, k in ipairs(names) do t[k] = _G[lib][k] end
    env[lib] = readonly(t, lib)
  end
  local m = {}
  for _, k in ipairs(safe_ms) do m[k] = ms[k] end
  m.json = readonly({ encode = ms.json.encode, decode = ms.json.decode }, "ms.json")
  env.ms = readonly(m, "ms")
  env._G = env
  return env
end

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

--- Loads a recipe from source text.  opts.trusted (default false) runs it with the full Lua environment.
function M.load_string(src, chunkname, opts)
  if type(src) ~= "string" then error("recipe source must be a string", 2) end
  chunkname = chunkname or "=(recipe)"
  local trusted = opts and opts.trusted
  if src:sub(1, 1) == "\27" then error(("recipe %s: precompiled bytecode is not accepted"):format(chunkname), 2) end
  local env = trusted and setmetatable({ ms = require("moonstep") }, { __index = _G }) or sandbox_env(require("moonstep"))
  local chunk, err = load(src, chunkname, "t", env)
  if not chunk then error("recipe " .. chunkname .. ": " .. err, 2) end
  local ok, r = pcall(chunk)
  if not ok then error("recipe " .. chunkname .. ": " .. tostring(r), 2) end
  r = check_shape(r, chunkname)
  -- the contract's metadata, kept beside the recipe (not inside it: a sandboxed table could lie)
  M.meta[r] = { source = src, hash = M.hash(src), chunkname = chunkname, trusted = trusted and true or false }
  return r
end

M.meta = setmetatable({}, { __mode = "k" })

--- Loads a recipe file (untrusted unless opts.trusted).
function M.load(path, opts)
  if type(path) ~= "string" then error("recipe path must be a string", 2) end
  local src, err = read_file(path)
  if not src then error("cannot read recipe " .. path .. ": " .. tostring(err), 2) end
  local r = M.load_string(src, "@" .. path, opts)
  M.meta[r].path = path
  return r
end

--- A built-in recipe by name (no '/' and no '.lua'), searched in the recipe folders and then
--- MOONSTEP_RECIPE_PATH.  Built-ins are trusted; recipes found through MOONSTEP_RECIPE_PATH are not.
function M.get(name)
  if type(name) ~= "string" or name == "" or name:find("/", 1, true) or name:find("%.lua$") then
    error(("recipe name %q: a built-in name has no '/' and no '.lua' (use ms.recipe.load for files)"):format(tostring(name)), 2)
  end
  local tried = {}
  for _, d in ipairs(M.search_path()) do
    local p = d .. "/" .. name .. ".lua"
    if read_file(p) then return M.load(p, { trusted = true }) end
    tried[#tried + 1] = d
  end
  for _, d in ipairs(user_path()) do
    local p = d .. "/" .. name .. ".lua"
    if read_file(p) then return M.load(p, { trusted = false }) end
    tried[#tried + 1] = d
  end
  error(("no recipe named %q (searched %s and MOONSTEP_RECIPE_PATH)"):format(name, table.concat(tried, ", ")), 2)
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

local booleans = { ["true"] = true, ["false"] = false, ["1"] = true, ["0"] = false, yes = true, no = false }

-- each type: convert(value) -> converted or nil, why
M.types = {
  number = function(v)
    if type(v) == "string" then v = strict_number(v) end
    if type(v) ~= "number" or v ~= v then return nil, "a number is needed" end
    return v
  end,
  integer = function(v)
    if type(v) == "string" then v = strict_number(v) end
    if type(v) ~= "number" or v ~= math.floor(v) or v ~= v or math.abs(v) == math.huge then return nil, "an integer is needed" end
    return v
  end,
  boolean = function(v)
    if type(v) == "string" then
      local b = booleans[v:lower()]
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
      if type(v[i]) ~= "number" then return nil, "a list of numbers is needed" end
      out[i] = v[i]
    end
    return out
  end,
  ["nil"] = nil,
}
M.types.any = function(v) return v end

local function describe(v)
  if type(v) == "string" then return ("%q"):format(v) end
  return tostring(v)
end

--- Checks one option value against its spec; returns the converted value or raises naming the option.
function M.check_option(rname, name, spec, v)
  local conv = M.types[spec.type]
  local x, why = conv(v)
  if x == nil then error(("%s: option '%s' = %s: %s"):format(rname, name, describe(v), why), 0) end
  if spec.values then
    local ok = false
    for _, a in ipairs(spec.values) do if a == x then ok = true end end
    if not ok then
      error(("%s: option '%s' = %s: must be one of %s"):format(rname, name, describe(v), table.concat(spec.values, ", ")), 0)
    end
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
    for i, y in ipairs(x) do range(y, "[" .. i .. "]") end
  end
  return x
end

--- Options for a recipe: the given ones checked and converted, defaults filled in, then validate().
--- Unknown options are refused.  `base` (optional) supplies values for options not given (group overrides).
function M.options(recipe, given, base)
  given = given or {}
  if type(given) ~= "table" then error(recipe.name .. ": options must be a table", 2) end
  local out = {}
  for k, v in pairs(given) do
    local spec = recipe.options[k]
    if spec == nil then
      local known = {}
      for n in pairs(recipe.options) do known[#known + 1] = n end
      table.sort(known)
      error(("%s: unknown option '%s' (known: %s)"):format(recipe.name, tostring(k), table.concat(known, ", ")), 0)
    end
    out[k] = M.check_option(recipe.name, k, spec, v)
  end
  for k, spec in pairs(recipe.options) do
    if out[k] == nil then
      if base and base[k] ~= nil then out[k] = base[k]
      elseif spec.default ~= nil then out[k] = M.check_option(recipe.name, k, spec, spec.default) end
    end
  end
  if recipe.validate then recipe.validate(out) end
  return out
end

--- The options documentation of a recipe, as lines "name (type, default): doc".
function M.doc(recipe)
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
