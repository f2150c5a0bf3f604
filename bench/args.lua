--[[
bench/args.lua -- the benchmarks' command line: `--name value` options and `--flag` switches (dashes in names
read as underscores), numbers converted, a comma list split by list().

  local A = dofile("bench/args.lua")   -- (scripts: relative to arg[0])
  local args = A.parse("dash_bench", { set = "subset", trials = 5 }, { tiny = true, splits = true })
  for _, s in ipairs(A.list(args.solvers)) do ... end
]]
local A = {}

--- defaults: option -> default value (a copy is returned, filled from `arg`); flags: the names that take no value.
function A.parse(bench, defaults, flags)
  local args = {}
  for k, v in pairs(defaults) do args[k] = v end
  local a, i = arg or {}, 1
  while i <= #a do
    local k = a[i]:match("^%-%-(.+)$")
    if not k then error(bench .. ": unexpected argument " .. a[i]) end
    k = k:gsub("-", "_")
    if flags[k] then
      args[k] = true
      i = i + 1
    else
      if a[i + 1] == nil then error(bench .. ": --" .. k .. " needs a value") end
      args[k] = tonumber(a[i + 1]) or a[i + 1]
      i = i + 2
    end
  end
  return args
end

--- "a,b,c" -> { "a", "b", "c" }
function A.list(s)
  local t = {}
  for x in tostring(s):gmatch("[^,]+") do t[#t + 1] = x end
  return t
end

return A
