return { name = "m", options = { lr = { default = 0.1, type = "number" } },
  route = function(p, o) return p.ndim >= 2 and "a" or "b" end,
  routes = { a = { step = function(g, o, ctx) for _, m in ipairs(g) do m.param:sub_(m.grad * ctx.lr) end end },
             b = { init = function(g) for _, m in ipairs(g) do m.state.n = ms.zeros_like(m.param) end end,
                   plan = function(g, o, ctx) return ctx.step % 2 == 0 and "even" or "odd" end,
                   step = function(g, o, ctx) local s = ("%d"):format(ctx.step):rep(2) end } } }
