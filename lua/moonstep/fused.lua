--[[
moonstep.fused -- the Lua face of the engine's multi-tensor helpers and fused optimizer steps
(moonstep.h, "Multi-tensor helpers and fused optimizer steps").  Members come as Lua arrays of tensors;
scalars that change every step (lr, step) may be numbers or one-element device tensors.
]]
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C
local shard = require("moonstep.shard")
local comms = require("moonstep.comm")
local check, H = core.check, tensor.handle

local M = {}

-- The first missing member of a Lua array: `#` of a table with a hole may stop before it ({p, nil, t} has
-- # 1 or 3), so the highest positive integer key is looked for too; nil when arr is an array 1..#arr.
local function hole_of(arr)
  local n, top = #arr, 0
  for k in pairs(arr) do
    if type(k) == "number" and k >= 1 and k == math.floor(k) and k > top then top = k end
  end
  if top <= n then return nil end
  for i = 1, top do if arr[i] == nil then return i end end
end

-- Raises "<fn>: <what>[i] must be a tensor (got ...)" at `level` for the first member of arr that is not a
-- tensor (a hole included); the member arrays are checked so before `#` or arr[i]:context() would fail on them
-- unnamed, inside this file.
local function need_tensors(fn, what, arr, level)
  local i = hole_of(arr)
  if i then error(("%s: %s[%d] must be a tensor (got nil)"):format(fn, what, i), level + 1) end
  for j = 1, #arr do
    if not tensor.is_tensor(arr[j]) then
      error(("%s: %s[%d] must be a tensor (got %s)"):format(fn, what, j, core.show(arr[j])), level + 1)
    end
  end
end

-- a C array of the tensors' handles: "ms_tensor *[?]" for tensors written, "const ms_tensor *[?]" for sources;
-- errors raised at `level` (default 2: the caller of the function that calls list)
local function list(fn, arr, what, n, optional, const, level)
  level = (level or 2) + 1
  if arr == nil and optional then return nil end
  -- (a tensor is a table too, and indexes as its rows: taken for an array, it would update every row as a param)
  if type(arr) ~= "table" or tensor.is_tensor(arr) then
    error(("%s: %s must be an array of tensors%s"):format(fn, what,
          tensor.is_tensor(arr) and " (got a tensor: wrap it, {t})" or (" (got " .. core.show(arr) .. ")")), level)
  end
  need_tensors(fn, what, arr, level)
  n = n or #arr
  if #arr ~= n then error(("%s: %s has %d entries, %d expected"):format(fn, what, #arr, n), level) end
  local out = ffi.new(const and "const ms_tensor *[?]" or "ms_tensor *[?]", n > 0 and n or 1)
  for i = 1, n do out[i - 1] = H(arr[i]) end
  return out
end

local function scales_of(s, n)
  if s == nil then return nil end
  if type(s) ~= "table" then error("scales must be an array of numbers, one per member", 3) end
  if #s ~= n then error(("scales has %d entries, %d expected"):format(#s, n), 3) end
  local out = ffi.new("double[?]", n > 0 and n or 1)
  for i = 1, n do
    if type(s[i]) ~= "number" then error(("scales[%d] must be a number (got %s)"):format(i, core.show(s[i])), 3) end
    out[i - 1] = s[i]
  end
  return out
end

-- a scalar option: number -> (value, nil); device tensor -> (0, handle)
local function scalar(v, default, name)
  if v == nil then return default, nil end
  if type(v) == "number" then return v, nil end
  if not tensor.is_tensor(v) then
    error(("%s must be a number or a one-element device tensor (got %s)"):format(name or "scalar", type(v)), 3)
  end
  return 0, H(v)
end

-- (arr checked by list or need_tensors first: arr[1] is a tensor)
local function ctx_for(arr)
  if #arr == 0 then return tensor.handle_ctx(tensor.device("cpu")) end
  return tensor.handle_ctx(tensor.ctx_object(arr[1]))
end

-- Each call's arguments and their kinds (core.check_options): a misspelt one (weight_decy =) would otherwise
-- leave its default in force, silently, a fractional count (iters = 2.5) reach the FFI truncated, and a flag
-- given as "false" or 0 count as true.  Checked first, with the member arrays, so that a refused call changes
-- nothing.  (Arrays are checked where they are read: list, scales_of, by_step.)
local K = tensor.kinds
local COMMON = { params = K.any, grads = K.any, scales = K.any, lr = K.scalar, step = K.step, stochastic_round = "boolean",
                 seed = core.SEED, skip = K.tensor }
local ADAMW = { steps = K.any, exp_avg = K.any, exp_avg_sq = K.any, beta1 = "number", beta2 = "number", eps = "number",
                weight_decay = "number", bias_correction = "boolean" }
local function specs(...)
  local t = {}
  for _, part in ipairs { ... } do for k, v in pairs(part) do t[k] = v end end
  return t
end
local ARGS = {
  adamw_step = specs(COMMON, ADAMW),
  sgd_step = specs(COMMON, { steps = K.any, momentum_buf = K.any, momentum = "number", dampening = "number",
                             weight_decay = "number", nesterov = "boolean" }),
  sinkgd_step = specs(COMMON, { specnorm_u = K.any, md_target_norm = K.any, mode = "string", iters = core.COUNT,
                                sn_iters = core.COUNT, target = "string", eps = "number", weight_decay = "number" }),
  adamw8_step = specs(COMMON, ADAMW, { exp_avg_scale = K.any, exp_avg_sq_scale = K.any, block_size = core.COUNT }),
}

local function check_args(a, what)
  if type(a) ~= "table" then error(("%s takes a table of arguments (got %s)"):format(what, type(a)), 3) end
  core.check_keys(what, a, ARGS[what], 3, "argument")
  if type(a.params) ~= "table" or tensor.is_tensor(a.params) then
    error(("%s: params must be an array of tensors%s"):format(what,
          tensor.is_tensor(a.params) and " (got a tensor: wrap it, {t})" or ""), 3)
  end
  core.check_options(what, a, ARGS[what], 3)
  -- (given both, step was dropped for steps, silently)
  if a.steps ~= nil and a.step ~= nil then error(("%s: steps and step are exclusive"):format(what), 3) end
  need_tensors(what, "params", a.params, 3)
end

-- The arrays of a call that hold one entry per member.
local MEMBER_ARRAYS = { "params", "grads", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "momentum_buf",
                        "scales" }

-- A call given steps = {each member's own step} (a number or a device scalar each; ctx.step_of(m)) as calls with
-- one step each: one call when every member has the same step, members in their order.
local function by_step(a, what)
  local n = #a.params
  if type(a.steps) ~= "table" or tensor.is_tensor(a.steps) or #a.steps ~= n then
    error(("%s: steps must be an array of %d steps (numbers or device scalars), one per member"):format(what, n), 3)
  end
  for i = 1, n do
    local why = tensor.kinds.step(a.steps[i])
    if why then error(("%s: steps[%d] must be %s (got %s)"):format(what, i, why, core.show(a.steps[i])), 3) end
  end
  -- the member arrays checked whole before the first of several calls runs: a refused call changes nothing,
  -- and its error counts the caller's members, not one call's
  for _, f in ipairs(MEMBER_ARRAYS) do
    if f == "scales" then scales_of(a.scales, n)
    elseif a[f] ~= nil or f == "grads" then
      list(what, a[f], f, n, false, true, 3)
    end
  end
  -- the usual step: every member had every gradient, so one step for all and the arrays as they are (a copy
  -- of the call, not of its arrays)
  if n == 0 then return {} end
  local same = true
  for i = 2, n do
    if a.steps[i] ~= a.steps[1] then same = false break end
  end
  if same then
    local c = {}
    for k, v in pairs(a) do c[k] = v end
    c.steps, c.step = nil, a.steps[1]
    return { c }
  end
  local calls, of = {}, {}
  for i = 1, n do
    local s = a.steps[i]
    local c = of[s]
    if c == nil then
      c = {}
      for k, v in pairs(a) do c[k] = v end
      for _, f in ipairs(MEMBER_ARRAYS) do if a[f] ~= nil then c[f] = {} end end
      c.steps, c.step = nil, s
      of[s] = c
      calls[#calls + 1] = c
    end
    for _, f in ipairs(MEMBER_ARRAYS) do if a[f] ~= nil then c[f][#c[f] + 1] = a[f][i] end end
  end
  return calls
end

-- A device scalar holding 1 per context: the skip of the checking calls below
local skip_all = setmetatable({}, { __mode = "k" })

-- Runs a call given per-member steps through step_fn, one engine call per distinct step.  The engine checks a
-- member (shape, dtype, overlap with another member) and a step only when it is called, so a group split in
-- several calls is first checked by calls that change nothing (skip = 1, read when they run): the whole group
-- at the first step, then one member at each other step.  A refused group then leaves every member as it was.
local function run_by_step(a, step_fn, what)
  local calls = by_step(a, what)
  if #calls > 1 then
    local ctx = a.params[1]:context()
    skip_all[ctx] = skip_all[ctx] or tensor.ones({ 1 }, { dtype = "f32", ctx = ctx })
    for i, c in ipairs(calls) do
      local probe = {}
      for k, v in pairs(i == 1 and a or c) do probe[k] = v end
      if i == 1 then
        probe.steps, probe.step = nil, c.step
      else
        for _, f in ipairs(MEMBER_ARRAYS) do if c[f] ~= nil then probe[f] = { c[f][1] } end end
      end
      probe.skip = skip_all[ctx]
      step_fn(probe)
    end
  end
  for _, c in ipairs(calls) do step_fn(c) end
end

--- ms.adamw_step{params=, grads=, exp_avg=, exp_avg_sq=, scales=, lr=, step=, beta1=, beta2=, eps=,
---   weight_decay=, bias_correction=true, stochastic_round=false, seed=0, skip=}
---   (steps = {per member} instead of step: each member's own step count, as torch's state["step"]; a call per
---   distinct step)
function M.adamw_step(a)
  check_args(a, "adamw_step")
  if a.steps ~= nil then
    return run_by_step(a, M.adamw_step, "adamw_step")
  end
  local n = #a.params
  local o = ffi.new("ms_adamw_options")
  o.lr, o.lr_t = scalar(a.lr, 1e-3, "lr")
  o.step, o.step_t = scalar(a.step, 1, "step")
  o.beta1, o.beta2 = a.beta1 or 0.9, a.beta2 or 0.999
  o.eps, o.weight_decay = a.eps or 1e-8, a.weight_decay or 0
  o.bias_correction = a.bias_correction == false and 0 or 1
  o.stochastic_round = a.stochastic_round and 1 or 0
  o.seed = a.seed or 0
  o.skip_t = a.skip and H(a.skip) or nil
  local F = "adamw_step"
  local params, grads = list(F, a.params, "params"), list(F, a.grads, "grads", n, false, true)
  local m, v = list(F, a.exp_avg, "exp_avg", n), list(F, a.exp_avg_sq, "exp_avg_sq", n)
  check(C.ms_adamw_step(ctx_for(a.params), n, params, grads, m, v, scales_of(a.scales, n), o))
end

--- ms.sgd_step{params=, grads=, momentum_buf=, scales=, lr=, step=, momentum=0, dampening=0,
---   weight_decay=0, nesterov=false, stochastic_round=false, seed=0, skip=}   (steps =: as ms.adamw_step)
function M.sgd_step(a)
  check_args(a, "sgd_step")
  if a.steps ~= nil then
    return run_by_step(a, M.sgd_step, "sgd_step")
  end
  local n = #a.params
  local o = ffi.new("ms_sgd_options")
  o.lr, o.lr_t = scalar(a.lr, 1e-3, "lr")
  o.step, o.step_t = scalar(a.step, 1, "step")
  o.momentum, o.dampening, o.weight_decay = a.momentum or 0, a.dampening or 0, a.weight_decay or 0
  o.nesterov = a.nesterov and 1 or 0
  o.stochastic_round = a.stochastic_round and 1 or 0
  o.seed = a.seed or 0
  o.skip_t = a.skip and H(a.skip) or nil
  local F = "sgd_step"
  local params, grads = list(F, a.params, "params"), list(F, a.grads, "grads", n, false, true)
  local buf = list(F, a.momentum_buf, "momentum_buf", n, true)
  check(C.ms_sgd_step(ctx_for(a.params), n, params, grads, buf, scales_of(a.scales, n), o))
end

-- the tensors of a foreach call, checked before `#` and arr[1]:context() would fail on them unnamed
local function foreach_tensors(what, arr)
  if type(arr) ~= "table" or tensor.is_tensor(arr) then
    error(("%s: tensors must be an array of tensors (got %s)"):format(what, tensor.is_tensor(arr) and "a tensor: wrap it, {t}"
          or core.show(arr)), 3)
  end
  for i = 1, #arr do
    if not tensor.is_tensor(arr[i]) then error(("%s: tensors[%d] must be a tensor (got %s)"):format(what, i, core.show(arr[i])), 3) end
  end
end

--- ms.foreach_sumsq(tensors [, out]) -> a [n] f32 tensor of the tensors' sums of squares (on their device)
function M.foreach_sumsq(arr, out)
  foreach_tensors("foreach_sumsq", arr)
  if out ~= nil and not tensor.is_tensor(out) then error("foreach_sumsq: out must be a tensor (got " .. core.show(out) .. ")", 2) end
  local n = #arr
  out = out or tensor.empty({ n }, { dtype = "f32", ctx = n > 0 and arr[1]:context() or nil })
  check(C.ms_foreach_sumsq(tensor.handle_ctx(out:context()), H(out), n, list("foreach_sumsq", arr, "tensors", nil, false, true)))
  return out
end

--- ms.foreach_scale(tensors, s): every tensor multiplied in place by s (a number or a device scalar)
function M.foreach_scale(arr, s)
  foreach_tensors("foreach_scale", arr)
  if s == nil then error("foreach_scale: s is needed (a number or a device scalar)", 2) end
  local v, vt = scalar(s, 1, "foreach_scale: s")
  check(C.ms_foreach_scale(ctx_for(arr), #arr, list("foreach_scale", arr, "tensors"), v, vt))
end


local sinkgd_modes = { base = "MS_SINKGD_BASE", spectral = "MS_SINKGD_SPECTRAL", sphere = "MS_SINKGD_SPHERE" }
local sinkgd_targets = { unit = "MS_SINKGD_TARGET_UNIT", muon = "MS_SINKGD_TARGET_MUON" }
local shard_dims = { none = C.MS_SHARD_NONE, rows = C.MS_SHARD_ROWS, cols = C.MS_SHARD_COLS }

-- the members' shards (moonstep.shard) as an ms_shard array and their one communicator's handle; nil when no
-- member is registered
local function shards_of(params, n)
  local arr, comm, comm_at
  for i = 1, n do
    local e = shard.get(params[i])
    if e ~= nil then
      arr = arr or ffi.new("ms_shard[?]", n)
      arr[i - 1].dim = shard_dims[e.dim]
      arr[i - 1].offset, arr[i - 1].global = e.offset or 0, e.global or 0
      if e.comm ~= nil then
        if comm ~= nil and comms.handle(e.comm) ~= comms.handle(comm) then
          error(("sinkgd_step: params %d and %d are sharded over different communicators; one call exchanges over "
                 .. "one"):format(comm_at, i), 3)
        end
        comm, comm_at = e.comm, comm_at or i
      end
    end
  end
  if arr == nil then return nil end
  return arr, comm and comms.handle(comm) or nil
end

--- ms.sinkgd_step{params=, grads=, specnorm_u=, md_target_norm=, scales=, lr=, step=, mode="base"|"spectral"|
---   "sphere", iters=5, sn_iters=1, target="unit"|"muon", eps=1e-8, weight_decay=0, stochastic_round=false,
---   seed=0, skip=}   (moonstep.h, ms_sinkgd_step: params [..., m, n]; specnorm_u [..., n] f32 for the
---   spectral and sphere modes; md_target_norm [...] f32, negative until captured, for the sphere mode).
---   A param registered with moonstep.shard is a slice of a matrix split across ranks: the call is then
---   ms_sinkgd_step_sharded over the members' one communicator (specnorm_u of a cols slice: [..., n_local]).
function M.sinkgd_step(a)
  check_args(a, "sinkgd_step")
  local n = #a.params
  local o = ffi.new("ms_sinkgd_options")
  o.lr, o.lr_t = scalar(a.lr, 1e-3, "lr")
  o.step, o.step_t = scalar(a.step, 1, "step")
  local mode, target = sinkgd_modes[a.mode or "base"], sinkgd_targets[a.target or "unit"]
  if not mode then error("sinkgd_step: mode must be 'base', 'spectral' or 'sphere' (got " .. tostring(a.mode) .. ")", 2) end
  if not target then error("sinkgd_step: target must be 'unit' or 'muon' (got " .. tostring(a.target) .. ")", 2) end
  o.mode, o.target = mode, target
  o.iters, o.sn_iters = a.iters or 5, a.sn_iters or 1
  tensor.charge_work("sinkgd_step", o.iters + (mode ~= sinkgd_modes.base and o.sn_iters or 0))
  o.eps, o.weight_decay = a.eps or 1e-8, a.weight_decay or 0
  o.stochastic_round = a.stochastic_round and 1 or 0
  o.seed = a.seed or 0
  o.skip_t = a.skip and H(a.skip) or nil
  local F = "sinkgd_step"
  local params, grads = list(F, a.params, "params"), list(F, a.grads, "grads", n, false, true)
  local u, t = list(F, a.specnorm_u, "specnorm_u", n, true), list(F, a.md_target_norm, "md_target_norm", n, true)
  local shards, comm = shards_of(a.params, n)
  if shards ~= nil then
    check(C.ms_sinkgd_step_sharded(ctx_for(a.params), comm, n, params, grads, u, t, scales_of(a.scales, n), shards, o))
  else
    check(C.ms_sinkgd_step(ctx_for(a.params), n, params, grads, u, t, scales_of(a.scales, n), o))
  end
end

--- ms.adamw8_step{params=, grads=, exp_avg=, exp_avg_scale=, exp_avg_sq=, exp_avg_sq_scale=, block_size=256, ...}
---   AdamW with 8-bit moments (u8 codes shaped like the params, f32 scales [numel / block_size]); the other
---   arguments as ms.adamw_step.
function M.adamw8_step(a)
  check_args(a, "adamw8_step")
  if a.steps ~= nil then
    return run_by_step(a, M.adamw8_step, "adamw8_step")
  end
  local n = #a.params
  local o = ffi.new("ms_adamw8_options")
  local w = o.adamw
  w.lr, w.lr_t = scalar(a.lr, 1e-3, "lr")
  w.step, w.step_t = scalar(a.step, 1, "step")
  w.beta1, w.beta2 = a.beta1 or 0.9, a.beta2 or 0.999
  w.eps, w.weight_decay = a.eps or 1e-8, a.weight_decay or 0
  w.bias_correction = a.bias_correction == false and 0 or 1
  w.stochastic_round = a.stochastic_round and 1 or 0
  w.seed = a.seed or 0
  w.skip_t = a.skip and H(a.skip) or nil
  o.block_size = a.block_size or 256
  local F = "adamw8_step"
  local params, grads = list(F, a.params, "params"), list(F, a.grads, "grads", n, false, true)
  local m, ms_ = list(F, a.exp_avg, "exp_avg", n), list(F, a.exp_avg_scale, "exp_avg_scale", n)
  local v, vs = list(F, a.exp_avg_sq, "exp_avg_sq", n), list(F, a.exp_avg_sq_scale, "exp_avg_sq_scale", n)
  check(C.ms_adamw8_step(ctx_for(a.params), n, params, grads, m, ms_, v, vs, scales_of(a.scales, n), o))
end

--- ms.adamw8_qmap(signed) -> the 256 values of the dynamic quantization map, ascending (Lua numbers)
function M.adamw8_qmap(signed)
  if signed ~= nil then core.check_value("adamw8_qmap", "signed", signed, "boolean", 2) end
  local q = ffi.new("float[256]")
  C.ms_adamw8_qmap(signed and 1 or 0, q)
  local out = {}
  for i = 0, 255 do out[i + 1] = q[i] end
  return out
end

return M
