--[[
The optimizer steps' C ABI as the specs call it (the optim, SinkGD and sharded SinkGD specs, and the sharded
specs' rank script): handle arrays, per-member values, the options structs of ms_adamw_step, ms_adamw8_step,
ms_sgd_step and ms_sinkgd_step from Lua tables, the status check, and the SinkGD step on members.  Loaded with
dofile from the project root, by busted and by the ranks.
]]
local T = require("moonstep.tensor")
local core = require("moonstep.core")
local ffi, C = core.ffi, core.C

local A = {}

--- The handles of list[1..n] (n = #list unless given; a missing entry is NULL); ro: the const form that read-only
--- arguments (grads, sources) take (LuaJIT, like C, does not turn ms_tensor ** into const ms_tensor *const *).
function A.handles(list, ro, n)
  n = n or #list
  local a = ffi.new(ro and "const ms_tensor *[?]" or "ms_tensor *[?]", math.max(n, 1))
  for i = 1, n do a[i - 1] = list[i] and T.handle(list[i]) or nil end
  return a
end

--- One value a member (the scales) as a double array, or NULL for nil.  With count, the list must have that
--- many: the engine reads one value a member, so a shorter list would be read past its end.
function A.doubles(list, count)
  if list == nil then return nil end
  assert(count == nil or #list == count, ("%d values for %d members"):format(#list, count or 0))
  local a = ffi.new("double[?]", math.max(#list, 1))
  for i = 1, #list do a[i - 1] = list[i] end
  return a
end

--- Raises the engine's status name and last error when st is not MS_OK (`what`: the call, for the message).
function A.ok(st, what)
  if st ~= 0 then
    error(("%s%s: %s"):format(what and what .. ": " or "", ffi.string(C.ms_status_name(st)),
                              ffi.string(C.ms_last_error())), 2)
  end
end

local MODES = { base = C.MS_SINKGD_BASE, spectral = C.MS_SINKGD_SPECTRAL, sphere = C.MS_SINKGD_SPHERE }
local TARGETS = { unit = C.MS_SINKGD_TARGET_UNIT, muon = C.MS_SINKGD_TARGET_MUON }
local DIMS = { none = C.MS_SHARD_NONE, rows = C.MS_SHARD_ROWS, cols = C.MS_SHARD_COLS }

--- A tensor's handle, or NULL for nil (the device scalars of the options).
function A.h(t) return t and T.handle(t) or nil end
local h = A.h

--- ms_adamw_options from o = {lr, lr_t, beta1, beta2, eps, weight_decay, step, step_t, bias_correction,
--- stochastic_round, seed, skip_t}.
function A.adamw_options(o)
  local c = ffi.new("ms_adamw_options")
  c.lr, c.lr_t = o.lr or 0, h(o.lr_t)
  c.beta1, c.beta2 = o.beta1 or 0.9, o.beta2 or 0.999
  c.eps, c.weight_decay = o.eps or 1e-8, o.weight_decay or 0
  c.step, c.step_t = o.step or 1, h(o.step_t)
  c.bias_correction = o.bias_correction == false and 0 or 1
  c.stochastic_round = o.stochastic_round and 1 or 0
  c.seed = o.seed or 0
  c.skip_t = h(o.skip_t)
  return c
end

--- ms_adamw8_options: o's AdamW options (lr 1e-3 unless given) and block_size (256 unless given).
function A.adamw8_options(o)
  local c = ffi.new("ms_adamw8_options")
  c.adamw = A.adamw_options(setmetatable({ lr = o.lr or 1e-3 }, { __index = o }))
  c.block_size = o.block_size or 256
  return c
end

--- ms_sgd_options from o = {lr, lr_t, momentum, dampening, weight_decay, nesterov, step, step_t,
--- stochastic_round, seed, skip_t}.
function A.sgd_options(o)
  local c = ffi.new("ms_sgd_options")
  c.lr, c.lr_t = o.lr or 0, h(o.lr_t)
  c.momentum, c.dampening, c.weight_decay = o.momentum or 0, o.dampening or 0, o.weight_decay or 0
  c.nesterov = o.nesterov and 1 or 0
  c.step, c.step_t = o.step or 1, h(o.step_t)
  c.stochastic_round = o.stochastic_round and 1 or 0
  c.seed = o.seed or 0
  c.skip_t = h(o.skip_t)
  return c
end

--- ms_sinkgd_options from o = {lr, lr_t, step, step_t, mode, target, iters, sn_iters, eps, weight_decay,
--- stochastic_round, seed, skip_t}, tensors for the *_t device scalars; mode_code and target_code put raw enum
--- values (invalid ones, for the validation specs).  lr defaults to lr0, else 0.05.
function A.sinkgd_options(o, lr0)
  local c = ffi.new("ms_sinkgd_options")
  c.lr, c.lr_t = o.lr or lr0 or 0.05, h(o.lr_t)
  c.step, c.step_t = o.step or 1, h(o.step_t)
  c.mode = o.mode_code or MODES[o.mode or "base"]
  c.target = o.target_code or TARGETS[o.target or "unit"]
  c.iters, c.sn_iters = o.iters or 5, o.sn_iters or 1
  c.eps, c.weight_decay = o.eps or 1e-8, o.weight_decay or 0
  c.stochastic_round = o.stochastic_round and 1 or 0
  c.seed = o.seed or 0
  c.skip_t = h(o.skip_t)
  return c
end

-- the p, g, u and t arrays of members {p=, g=, u=, t=} (u past base mode, t in sphere mode)
local function arrays(members, mode)
  local P, G, U, Tt = {}, {}, {}, {}
  for k, mb in ipairs(members) do P[k], G[k], U[k], Tt[k] = mb.p, mb.g, mb.u, mb.t end
  return A.handles(P), A.handles(G, true), mode ~= "base" and A.handles(U) or nil,
         mode == "sphere" and A.handles(Tt) or nil
end

--- ms_sinkgd_step on ctx (a context object) for members {p=, g=, u=, t=}; returns the status.
function A.sinkgd_step(ctx, members, o, scales)
  local P, G, U, Tt = arrays(members, o.mode or "base")
  return C.ms_sinkgd_step(T.handle_ctx(ctx), #members, P, G, U, Tt, A.doubles(scales, #members), A.sinkgd_options(o))
end

--- ms_sinkgd_step_sharded on members {p=, g=, u=, t=, shard = {dim =, offset =, global =}} (dim "none", "rows"
--- or "cols"; comm nil: NULL); returns the status.
function A.sinkgd_step_sharded(ctx, comm, members, o, scales)
  local P, G, U, Tt = arrays(members, o.mode or "base")
  local sh = ffi.new("ms_shard[?]", math.max(#members, 1))
  for k, mb in ipairs(members) do
    local s = mb.shard or { dim = "none" }
    sh[k - 1].dim = DIMS[s.dim]
    sh[k - 1].offset = s.offset or 0
    sh[k - 1].global = s.global or 0
  end
  return C.ms_sinkgd_step_sharded(T.handle_ctx(ctx), comm and require("moonstep").comm.handle(comm) or nil, #members,
                                  P, G, U, Tt, A.doubles(scales, #members), sh, A.sinkgd_options(o))
end

--- The leading (batch) dims of a [..., m, n] shape, and the shape of its u ([..., n]).
function A.lead_of(shape)
  local l = {}
  for d = 1, #shape - 2 do l[d] = shape[d] end
  return l
end
function A.ushape_of(shape)
  local l = A.lead_of(shape)
  l[#l + 1] = shape[#shape]
  return l
end

return A
