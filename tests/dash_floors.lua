--[[
dash_floors.lua -- measures each inverse-root solver's resolution floor on this build (CPU, f32): the smallest
normalized eigenvalue y = lambda / s (s the solver's Frobenius scale) at which the normalized root X / ||X||_F
is still within `tol` of the exact one (f64 eigendecomposition).  The spectrum is 63 eigenvalues log-uniform in
[0.1, 1] plus one eigenvalue swept down; b = 64.  The numbers are quoted in engine/cpu/dash.c.

  luajit tests/dash_floors.lua [tol]
]]
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local ms = require("moonstep")
local tol = tonumber(arg and arg[1]) or 1e-4
local b = 64

-- an orthogonal f64 matrix: the eigenvectors of a random symmetric one
local G = ms.randn({ b, b }, { dtype = "f64", seed = 7 })
local _, Q = ms.eigh(G + G:t())

local function spectrum(ysmall)
  local l = {}
  for i = 1, b - 1 do l[i] = 0.1 ^ ((i - 1) / (b - 2)) end
  local s2 = 0
  for i = 1, b - 1 do s2 = s2 + l[i] ^ 2 end
  -- the small eigenvalue is y * s with s = ||A||_F (its own square is negligible against s2 here)
  l[b] = ysmall * math.sqrt(s2)
  return l
end

local function build(l, p)
  local d = ms.tensor(l, { dtype = "f64" })
  local A = ms.matmul(Q * d, Q, { trans_b = true })
  local inv = {}
  for i = 1, #l do inv[i] = l[i] ^ (-1 / p) end
  local X = ms.matmul(Q * ms.tensor(inv, { dtype = "f64" }), Q, { trans_b = true })
  return A, X
end

local function normalized_error(X, Xt)
  local x = X:to("f64")
  return (x / x:norm() - Xt / Xt:norm()):norm()
end

local solvers = {
  { "ndb", { method = "ndb", steps = 10, scaling = "fro" } },
  { "cn", { method = "cn", steps = 10, scaling = "fro" } },
  { "chebyshev", { method = "chebyshev", steps = 60, scaling = "fro" } },
  { "evd", { method = "evd", evd_shift = false } },
}
for _, p in ipairs { 2, 4 } do
  for _, s in ipairs(solvers) do
    local floor = nil
    for e = 0, 160 do
      local y = 10 ^ (-e / 16)
      local A, Xt = build(spectrum(y), p)
      local o = {}
      for k, v in pairs(s[2]) do o[k] = v end
      o.root = p
      local X = ms.inv_root(A:to("f32"):reshape({ 1, b, b }), o)
      local err = normalized_error(X:reshape({ b, b }), Xt)
      if err <= tol then floor = y else break end
    end
    print(("%-10s p=%d  floor %.2g"):format(s[1], p, floor or 1))
  end
end
