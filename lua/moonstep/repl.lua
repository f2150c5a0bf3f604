--[[
moonstep.repl -- the interactive prompt of `moonstep`: evaluates Lua lines with `ms` loaded, prints
results (tensors pretty-printed, tables shown), keeps going after errors, continues incomplete chunks.
]]
local M = {}

local function show_table(t, depth, seen)
  depth, seen = depth or 0, seen or {}
  if seen[t] then return "<cycle>" end
  seen[t] = true
  if depth > 2 then return "{...}" end
  local parts, n = {}, 0
  for k, v in pairs(t) do
    n = n + 1
    if n > 20 then parts[#parts + 1] = "..." break end
    local vs = type(v) == "table" and getmetatable(v) == nil and show_table(v, depth + 1, seen)
      or (type(v) == "string" and ("%q"):format(v) or tostring(v))
    parts[#parts + 1] = (type(k) == "string" and k:match("^[%a_][%w_]*$") and k or "[" .. tostring(k) .. "]") .. " = " .. vs
  end
  seen[t] = nil
  return "{" .. table.concat(parts, ", ") .. "}"
end

function M.show(v)
  if type(v) == "table" and getmetatable(v) == nil then return show_table(v) end
  if type(v) == "string" then return ("%q"):format(v) end
  return tostring(v)
end

function M.run()
  local config = package.loaded["moonstep.config"] or {}
  local readline = config.readline or function(prompt)
    io.write(prompt) io.flush()
    return io.read("*l")
  end
  if config.interactive ~= false then
    print(("moonstep %s -- `ms` is loaded; Ctrl-D exits"):format(ms and ms.version or "?"))
  end
  local env = setmetatable({}, { __index = _G, __newindex = _G })
  while true do
    local line = readline("> ")
    if line == nil then break end
    local chunk, err = loadstring("return " .. line, "=stdin")
    if not chunk then
      chunk, err = loadstring(line, "=stdin")
      while not chunk and err and err:match("<eof>'?$") do   -- incomplete: read more lines
        local more = readline(">> ")
        if more == nil then break end
        line = line .. "\n" .. more
        chunk, err = loadstring(line, "=stdin")
      end
    end
    if chunk then
      setfenv(chunk, env)
      local res = { xpcall(chunk, debug.traceback) }
      if res[1] then
        for i = 2, table.maxn(res) do print(M.show(res[i])) end
      else
        print(res[2])
      end
    else
      print(err)
    end
  end
  if config.interactive ~= false then io.write("\n") end
end

return M
