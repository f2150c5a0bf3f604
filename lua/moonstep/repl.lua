--[[
moonstep.repl -- the interactive prompt of `moonstep` (`moonstep repl`, or no arguments): evaluates Lua
lines with `ms` loaded, prints results (tensors pretty-printed, tables shown), keeps going after errors,
continues incomplete chunks, and has a few prompt commands (":help").

Line editing and history come from the host (readline, given through moonstep.config); the history is
kept in MOONSTEP_HISTORY, else ~/.moonstep_history ("" keeps none).

`:reload` re-reads the recipe files this session loaded and updates each recipe table in place: every
optimizer holding it runs the new code from its next step, with its options re-checked against the new
specs (options left at a default take the new version's default) and its content hash updated (so a checkpoint records the code
that produced it).  Parameters keep their routes and state; a new routing needs a new optimizer.
]]
local R = require("moonstep.recipe")

local M = {}

-- ---------------------------------------------------------------------------------------------------
-- showing values
-- ---------------------------------------------------------------------------------------------------
local function key_str(k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") then return k end
  return "[" .. (type(k) == "string" and ("%q"):format(k) or tostring(k)) .. "]"
end

local function show_table(t, depth, seen)
  if seen[t] then return "<cycle>" end
  if depth > 2 then return "{...}" end
  seen[t] = true
  local parts, n = {}, #t
  local function val(v)
    if type(v) == "table" and getmetatable(v) == nil then return show_table(v, depth + 1, seen) end
    if type(v) == "string" then return ("%q"):format(v) end
    return tostring(v)
  end
  for i = 1, n do
    if #parts >= 20 then parts[#parts + 1] = "..." break end
    parts[#parts + 1] = val(t[i])
  end
  -- the other keys in a stable order, so the same table always prints the same way
  local keys = {}
  for k in pairs(t) do
    if not (type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b)
    if type(a) ~= type(b) then return type(a) < type(b) end
    if type(a) == "number" or type(a) == "string" then return a < b end
    return tostring(a) < tostring(b)
  end)
  for i, k in ipairs(keys) do
    if #parts >= 20 then parts[#parts + 1] = ("... (%d more)"):format(#keys - i + 1) break end
    parts[#parts + 1] = key_str(k) .. " = " .. val(t[k])
  end
  seen[t] = nil
  return "{" .. table.concat(parts, ", ") .. "}"
end

--- A value as the prompt prints it: tensors through their __tostring, plain tables expanded (3 levels).
function M.show(v)
  if type(v) == "table" and getmetatable(v) == nil then return show_table(v, 0, {}) end
  if type(v) == "string" then return ("%q"):format(v) end
  return tostring(v)
end

-- ---------------------------------------------------------------------------------------------------
-- :reload
-- ---------------------------------------------------------------------------------------------------
local live = setmetatable({}, { __mode = "k" })   -- optimizers made in this session

-- equal option values (numbers, strings, booleans, lists of numbers)
local function same_value(a, b)
  local json = require("moonstep.json")
  return json.encode(a) == json.encode(b)
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- recipes loaded from files in this session (R.meta is weak: only those still in use)
local function loaded_recipes()
  local list = {}
  for recipe, meta in pairs(R.meta) do
    if meta.path then list[#list + 1] = recipe end
  end
  table.sort(list, function(a, b) return R.meta[a].path < R.meta[b].path end)
  return list
end

--- Re-reads the recipe files of this session (or only recipes called `name`) and updates them in place.
--- Returns the lines to print.
function M.reload(name)
  local lines = {}
  local list = loaded_recipes()
  local matched = 0
  for _, recipe in ipairs(list) do
    local meta = R.meta[recipe]
    if name == nil or recipe.name == name then
      matched = matched + 1
      local src = read(meta.path)
      if not src then
        lines[#lines + 1] = ("%s: cannot read %s"):format(recipe.name, meta.path)
      elseif R.hash(src) == meta.hash then
        lines[#lines + 1] = ("%s: unchanged (%s)"):format(recipe.name, meta.path)
      else
        local ok, new = pcall(R.load, meta.path, { trusted = meta.trusted })
        -- the new table is only a carrier of fields: its metadata entry (R.meta is weak, but until the next
        -- collection) would list the recipe twice in :recipes and reload it twice
        local new_meta = ok and R.meta[new] or nil
        if ok then R.meta[new] = nil end
        if not ok then
          lines[#lines + 1] = ("%s: not reloaded, the old version stays: %s"):format(recipe.name, tostring(new))
        else
          local old = {}
          for k, v in pairs(recipe) do old[k] = v end
          -- in place: whoever holds the table (optimizers, locals) sees the new fields
          for k in pairs(old) do recipe[k] = nil end
          for k, v in pairs(new) do recipe[k] = v end
          local problems = {}
          local n_opt = 0
          for o in pairs(live) do
            if o.recipe == recipe then
              local ok2, err = pcall(function()
                -- values kept: those still known and not left at the old version's default
                local given = {}
                for k, v in pairs(o.options) do
                  local spec = old.options[k]
                  local was_default = spec and spec.default ~= nil and same_value(v, spec.default)
                  if recipe.options[k] ~= nil and not was_default then given[k] = v end
                end
                local opts = R.options(recipe, given)
                for _, g in ipairs(o.groups) do
                  if not recipe.routes[g.route] then error(("route '%s' is gone"):format(g.route), 0) end
                end
                o.options = opts
                for _, g in ipairs(o.groups) do
                  g.options = next(g.overrides) and R.options(recipe, g.overrides, opts) or opts
                end
                o.recipe_hash = new_meta.hash
              end)
              if ok2 then n_opt = n_opt + 1 else problems[#problems + 1] = tostring(err) end
            end
          end
          if #problems > 0 then
            -- an optimizer cannot run the new version: put the old one back for everyone
            for k in pairs(new) do recipe[k] = nil end
            for k, v in pairs(old) do recipe[k] = v end
            lines[#lines + 1] = ("%s: not reloaded, the old version stays: %s"):format(recipe.name, problems[1])
          else
            R.meta[recipe] = new_meta
            lines[#lines + 1] = ("%s: reloaded from %s (hash %s), %d optimizer%s updated"):format(recipe.name,
              meta.path, R.meta[recipe].hash, n_opt, n_opt == 1 and "" or "s")
          end
        end
      end
    end
  end
  if matched == 0 then
    lines[#lines + 1] = name and ("no recipe named '%s' was loaded from a file in this session"):format(name)
      or "no recipe was loaded from a file in this session (ms.recipe.load, ms.recipe.get or ms.optim.new load them)"
  end
  return lines
end

local HELP = [[
prompt commands:
  :reload [NAME]   re-read the recipe files loaded in this session (or the one called NAME), in place
  :recipes         recipes loaded in this session, with their files and hashes
  :help            this list
  :quit            leave (Ctrl-D too)
Lua: any expression or statement; `ms` is moonstep, `problems` and `experiment` are loaded too, e.g.
  experiment.run{problem = "lsq", recipe = "recipes/lion.lua", steps = 100}.val_loss]]

local function command(line, quit)
  local cmd, rest = line:match("^:(%a+)%s*(.-)%s*$")
  if cmd == "quit" or cmd == "q" then quit() return end
  if cmd == "help" then print(HELP) return end
  if cmd == "reload" then
    for _, l in ipairs(M.reload(rest ~= "" and rest or nil)) do print(l) end
    return
  end
  if cmd == "recipes" then
    local list = loaded_recipes()
    if #list == 0 then print("no recipe loaded from a file yet") end
    for _, r in ipairs(list) do
      local m = R.meta[r]
      print(("%-10s %s  hash %s%s"):format(r.name, m.path, m.hash, m.trusted and "" or "  (sandboxed)"))
    end
    return
  end
  print(("unknown prompt command '%s' (:help lists them)"):format(line))
end

-- ---------------------------------------------------------------------------------------------------
-- the loop
-- ---------------------------------------------------------------------------------------------------
-- the traceback of an error in a line typed at the prompt, without the frames of the REPL itself
local function user_traceback(e)
  local tb = debug.traceback(tostring(e), 2)
  local cut = tb:find("\n%s*%[C%]: in function 'xpcall'")
  return cut and tb:sub(1, cut - 1) or tb
end

function M.run()
  local config = package.loaded["moonstep.config"] or {}
  local readline = config.readline
  if not readline or config.interactive == false then
    -- not a terminal (a pipe, a file): no readline, whose redraws of a line longer than its 80 columns
    -- it thinks it has put escape codes into the output; the transcript echoes the lines it read instead
    local echo = config.interactive == false
    readline = function(prompt)
      io.write(prompt) io.flush()
      local line = io.read("*l")
      if echo and line then io.write(line, "\n") end
      return line
    end
  end
  -- history only for a person at a terminal: piped input (scripts, tests) stays out of it
  if config.history_file and config.interactive ~= false then
    local path = os.getenv("MOONSTEP_HISTORY")
    if path == nil then
      local home = os.getenv("HOME")
      path = home and home ~= "" and (home .. "/.moonstep_history") or ""
    end
    config.history_file(path)
  end
  local ms = require("moonstep")
  if config.interactive ~= false then
    print(("moonstep %s -- `ms` is loaded; :help for prompt commands, Ctrl-D exits"):format(ms.version))
  end
  -- optimizers made at the prompt are remembered (weakly) so that :reload can update them
  local new = ms.optim.new
  ms.optim.new = function(...)
    local o = new(...)
    live[o] = true
    return o
  end
  rawset(_G, "problems", require("moonstep.problems"))
  rawset(_G, "experiment", require("moonstep.experiment"))
  local env = setmetatable({}, { __index = _G, __newindex = _G })
  local done = false
  local function quit() done = true end
  while not done do
    local line = readline("> ")
    if line == nil then
      io.write("\n")   -- past the last prompt
      break
    end
    if line:match("^:%a") then   -- a prompt command (a line starting with a Lua label, ::name::, is code)
      command(line, quit)
    else
      local chunk, err = loadstring("return " .. line, "=stdin")
      if not chunk then
        chunk, err = loadstring(line, "=stdin")
        while not chunk and err and err:match("<eof>'?$") do   -- incomplete: read more lines
          local more = readline(">> ")
          if more == nil then break end
          line = line .. "\n" .. more
          -- an expression spread over lines is shown like a one-line one
          chunk = loadstring("return " .. line, "=stdin")
          if not chunk then chunk, err = loadstring(line, "=stdin") end
        end
      end
      if chunk then
        setfenv(chunk, env)
        -- select("#") counts trailing nils, which table.maxn would not see
        local res = (function(...) return { n = select("#", ...), ... } end)(xpcall(chunk, user_traceback))
        if res[1] then
          -- showing a value runs its __tostring: user code, whose errors must not end the session either
          for i = 2, res.n do
            local ok, s = xpcall(M.show, user_traceback, res[i])
            print(s)
            if not ok then break end
          end
        else
          print(res[2])
        end
      else
        print(err)
      end
    end
  end
  ms.optim.new = new
end

return M
