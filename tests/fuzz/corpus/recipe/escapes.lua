local t = {}
for i = 1, 10 do t[i] = tostring(i):rep(i) end
local ok = pcall(function() return string.dump(print) end)
return { name = table.concat(t, ","):sub(1, 8), options = { lr = { default = 1, type = "number" } },
  validate = function(o) if o.lr > 10 then error("lr: too large", 0) end end,
  route = function(p) return ("r"):gsub("r", { r = "r" }) end,
  routes = { r = { step = function(g, o, ctx) ctx.report("x", ms.json.encode({ ctx.step, ok })) end } } }
