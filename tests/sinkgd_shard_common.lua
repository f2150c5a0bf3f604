--[[
The sharded SinkGD specs' members and checks (tests/cuda_sinkgd_shard_spec.lua), loaded with dofile from the
project root by the spec and by each rank of its #multigpu script: global members on the CPU from a seed (the same
values on every rank), a rank's slice of them, and the slice compared with the CPU step of the whole matrix.
]]
local ms = require("moonstep")
local T = require("moonstep.tensor")
local H = rawget(_G, "H") or dofile("tests/helpers.lua")   -- (busted loads the helpers; a rank loads them here)
local A = dofile("tests/abi.lua")
local abs, max = math.abs, math.max
local unpack = table.unpack or unpack
local K = { ok = A.ok, step = A.sinkgd_step, step_sharded = A.sinkgd_step_sharded }

function K.vals(t) return t:tolist_flat() end
local vals = K.vals

-- a global member on the CPU from `seed` (the same values on every rank): p of pdt, g of gdt, u uniform in [-1, 1)
-- (zeros with spec.zero_u), t (sphere) -1 (captured this step) or spec.t
function K.global_member(spec, mode, seed)
  local shape, pdt, gdt = spec.shape, spec.pdt or spec.dt or "bf16", spec.gdt or spec.dt or "bf16"
  local cpu = ms.device("cpu")
  local mb = { spec = spec, dt = pdt, shape = shape,
               p = ms.randn(shape, { dtype = pdt, seed = seed, ctx = cpu }),
               g = ms.randn(shape, { dtype = gdt, seed = seed + 1, ctx = cpu }) }
  if mode ~= "base" then
    local us = A.lead_of(shape)
    us[#us + 1] = shape[#shape]
    mb.u = spec.zero_u and ms.zeros(us, { dtype = "f32", ctx = cpu })
           or ms.rand(us, { seed = seed + 2, low = -1, high = 1, ctx = cpu })
  end
  if mode == "sphere" then mb.t = ms.full(A.lead_of(shape), spec.t or -1, { dtype = "f32", ctx = cpu }) end
  return mb
end

-- this rank's part [off, off + size) of the member's sharded dim ("rows": dim -2, "cols": dim -1) of a CPU tensor,
-- as a new contiguous tensor on ctx
local function part(t, dim, off, size, ctx)
  local d = t:dim() - (dim == "rows" and 2 or 1)
  return t:slice(d, off, off + size):clone():to(ctx)
end
K.part = part

-- rank r's slice of a global member for a shard dim ("none": the whole of it) as a member on ctx
function K.slice_member(mb, dim, off, size, ctx)
  local s = { dt = mb.dt, shape = mb.shape, shard = { dim = dim, offset = off, global = 0 } }
  if dim == "none" then
    s.p, s.g = mb.p:clone():to(ctx), mb.g:clone():to(ctx)
    s.u, s.t = mb.u and mb.u:clone():to(ctx), mb.t and mb.t:clone():to(ctx)
    return s
  end
  s.shard.global = mb.shape[#mb.shape - (dim == "rows" and 1 or 0)]
  s.p, s.g = part(mb.p, dim, off, size, ctx), part(mb.g, dim, off, size, ctx)
  if mb.u then s.u = dim == "cols" and part(mb.u, "cols", off, size, ctx) or mb.u:clone():to(ctx) end
  s.t = mb.t and mb.t:clone():to(ctx)
  if mb.spec.grad == "transposed" then   -- the same values through a transposed view
    local sh = s.g:shape()
    local lead = #sh - 2
    local perm = {}
    for d = 0, lead - 1 do perm[#perm + 1] = d end
    perm[#perm + 1], perm[#perm + 2] = lead + 1, lead
    s.g = s.g:permute(unpack(perm)):clone():permute(unpack(perm))
  end
  return s
end

-- the slice's state copied from the global member (the GPU starts each step from the reference's state: the two
-- may round a param an ulp apart, and carried into the next step an ulp of a large param is several of a small)
function K.reset(s, mb)
  local dim, off = s.shard.dim, s.shard.offset
  local size = dim == "rows" and s.p:shape()[#s.shape - 1] or s.p:shape()[#s.shape]
  local ctx = T.ctx_object(s.p)
  if dim == "none" then
    s.p:copy_(mb.p:clone():to(ctx))
    if mb.u then s.u:copy_(mb.u:clone():to(ctx)) end
  else
    s.p:copy_(part(mb.p, dim, off, size, ctx))
    if mb.u then s.u:copy_(dim == "cols" and part(mb.u, "cols", off, size, ctx) or mb.u:clone():to(ctx)) end
  end
  if mb.t then s.t:copy_(mb.t:clone():to(ctx)) end
end

-- the slice's grad <- the global member's (a transposed view is written through)
function K.set_grad(s, mb)
  local dim, ctx = s.shard.dim, T.ctx_object(s.p)
  if dim == "none" then s.g:copy_(mb.g:clone():to(ctx)) return end
  local size = dim == "rows" and s.p:shape()[#s.shape - 1] or s.p:shape()[#s.shape]
  s.g:copy_(part(mb.g, dim, s.shard.offset, size, ctx))
end

-- the slice after a step against the global reference after it (`before`: the reference's p before the step)
function K.compare(s, mb, before, what)
  local dim, off = s.shard.dim, s.shard.offset
  local cpu = ms.device("cpu")
  local want, was
  if dim == "none" then
    want, was = vals(mb.p), vals(before)
  else
    local size = dim == "rows" and s.p:shape()[#s.shape - 1] or s.p:shape()[#s.shape]
    want, was = vals(part(mb.p, dim, off, size, cpu)), vals(part(before, dim, off, size, cpu))
  end
  local maxupd = 0
  for i = 1, #want do
    local d = abs(want[i] - was[i])
    if d == d then maxupd = max(maxupd, d) end
  end
  local got = vals(s.p)
  for i = 1, #got do if got[i] ~= got[i] and want[i] == want[i] then error(what .. ": NaN at " .. i, 2) end end
  H.assert_ulps(got, want, s.dt, what .. " p", 1, 1e-5 * maxupd)
  if s.u then
    local wu = dim == "cols" and vals(part(mb.u, "cols", off, s.p:shape()[#s.shape], cpu)) or vals(mb.u)
    H.assert_close(vals(s.u), wu, 1e-4, 1e-5, what .. " u")
  end
  if s.t then H.assert_close(vals(s.t), vals(mb.t), 1e-6, 0, what .. " t") end
end

-- rows [off, off + size) of `global` for rank r of `world`: "even" (the first ranks one more), "uneven" (rank 0
-- about two thirds), "empty0" / "empty1" (that rank none)
function K.split(global, r, world, how)
  local bounds = {}
  if how == "uneven" then
    local a = math.floor(global * 2 / 3 + 0.5)
    bounds = { 0, a, global }
  elseif how == "empty0" then bounds = { 0, 0, global }
  elseif how == "empty1" then bounds = { 0, global, global }
  else
    local b, acc = { 0 }, 0
    for k = 0, world - 1 do
      acc = acc + math.floor(global / world) + (k < global % world and 1 or 0)
      b[#b + 1] = acc
    end
    bounds = b
  end
  if world == 1 then bounds = { 0, global } end
  return bounds[r + 1], bounds[r + 2] - bounds[r + 1]
end

return K
