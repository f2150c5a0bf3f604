--[[
moonstep.optim -- the optimizer runtime: turns a recipe and a trainer's parameters into an optimizer
that does one step per call (DESIGN.md, "Recipes (policy in Lua): the contract").

  local opt = ms.optim.new("adamw", {
    {name = "layer.weight", param = w, grad = gw},
    {name = "layer.bias",   param = b, grad = gb, tags = {"no_decay"}},
  }, {lr = 3e-4, weight_decay = 0.1},                    -- the recipe's options (checked against its specs)
  {schedule = {kind = "cosine", warmup_steps = 100, total_steps = 10000}, clip_grad_norm = 1.0})
  for step = 1, n do  compute gradients into gw, gb ...;  opt:step()  end
  opt:save("ckpt.safetensors")

Settings (the runtime's, kept apart from the recipe's options):
  schedule        {kind = constant|linear_warmup|cosine|wsd, ...} or function(step) -> multiplier
  clip_grad_norm  global gradient-norm clipping threshold (nil: off)
  nonfinite       "skip" (default: a step with NaN/Inf gradients changes nothing and is counted),
                  "raise" (an error naming the parameters), or "apply"
  master_weights  keep f32 master copies of bf16/f16 parameters (the recipe updates the masters)
  trusted         run a recipe loaded from a file with the full Lua environment
  sandbox         limits of an untrusted recipe: {instructions =, memory =, quota =} (moonstep.recipe)
  ctx / device    the context or device the optimizer runs on (default: the first parameter's)
  stats           true: opt:stats() also reports each parameter's update norm (costs a copy per step)
]]
local ms = require("moonstep")
local R = require("moonstep.recipe")
local S = require("moonstep.schedule")
local json = require("moonstep.json")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")

local M = {}
local Optimizer = {}
Optimizer.__index = Optimizer
M.Optimizer = Optimizer

M.SCHEMA = 1

local setting_names = {
  schedule = true, clip_grad_norm = true, nonfinite = true, master_weights = true, trusted = true, ctx = true,
  device = true, stats = true, sandbox = true,
}

local function check_settings(s)
  s = s or {}
  if type(s) ~= "table" then error("settings must be a table", 3) end
  for k in pairs(s) do
    if not setting_names[k] then
      local names = {}
      for n in pairs(setting_names) do names[#names + 1] = n end
      table.sort(names)
      error(("unknown setting '%s' (settings: %s; recipe options go in the third argument)"):format(tostring(k),
            table.concat(names, ", ")), 3)
    end
  end
  local out = {}
  for k, v in pairs(s) do out[k] = v end
  if out.clip_grad_norm ~= nil then
    local v = R.types.number(out.clip_grad_norm)
    if not v or v <= 0 then error("setting clip_grad_norm must be a positive number (got " .. tostring(out.clip_grad_norm) .. ")", 3) end
    out.clip_grad_norm = v
  end
  out.nonfinite = out.nonfinite or "skip"
  if out.nonfinite ~= "skip" and out.nonfinite ~= "raise" and out.nonfinite ~= "apply" then
    error("setting nonfinite must be 'skip', 'raise' or 'apply' (got " .. tostring(out.nonfinite) .. ")", 3)
  end
  for _, b in ipairs { "master_weights", "trusted", "stats" } do
    if out[b] ~= nil then
      local v = R.types.boolean(out[b])
      if v == nil then error(("setting %s must be a boolean (got %s)"):format(b, tostring(out[b])), 3) end
      out[b] = v
    end
  end
  return out
end

local function shape_str(t) return "[" .. table.concat(t:shape(), ",") .. "]" end

local function same_shape(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return false end
  for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
  return true
end

local function data_key(t)
  return tostring(core.ffi.cast("uintptr_t", core.C.ms_tensor_data_ptr(tensor.handle(t)))) .. ":" ..
         table.concat(t:shape(), "x") .. ":" .. t:dtype()
end

-- the parameter description a recipe's route() sees
local function param_info(entry)
  local tags = {}
  for _, t in ipairs(entry.tags or {}) do tags[t] = true end
  return {
    name = entry.name, shape = entry.param:shape(), ndim = entry.param:dim(), dtype = entry.param:dtype(),
    numel = entry.param:numel(), tags = tags,
  }
end

--- ms.optim.new(recipe, params, options, settings) -> optimizer
function M.new(recipe, params, options, settings)
  settings = check_settings(settings)
  recipe = R.resolve(recipe, { trusted = settings.trusted })
  local meta = R.meta[recipe]
  local lr_spec = recipe.options.lr
  if type(lr_spec) ~= "table" or lr_spec.type ~= "number" then
    error(("recipe %s has no number option 'lr': the runtime owns the learning rate and schedules options.lr"):format(recipe.name), 2)
  end
  -- untrusted recipes: every call into the recipe goes through R.call with this guard (nil when trusted)
  local guard = R.guard(recipe, settings.sandbox, params)
  local opts = R.options(recipe, options, nil, guard)
  if type(params) ~= "table" then error("params must be an array of {name=, param=, grad=, tags=}", 2) end

  local self = setmetatable({
    recipe = recipe, recipe_hash = meta.hash, options = opts, settings = settings, step_count = 0,
    skipped = 0, groups = {}, members = {}, by_name = {}, aliases = {}, reports = {}, last = {}, guard = guard,
  }, Optimizer)
  self.schedule, self.schedule_kind = S.compile(settings.schedule)

  -- the context: given, or that of the first parameter
  local ctx = settings.ctx or (settings.device and ms.device(settings.device))
  if not ctx then
    local first = params[1]
    ctx = first and ms.is_tensor(first.param) and first.param:context() or ms.device()
  end
  self.ctx = ctx
  self.lr_t = ms.zeros({ 1 }, { ctx = ctx })
  self.step_t = ms.zeros({ 1 }, { ctx = ctx })

  -- parameters: names unique, tensors on the optimizer's device, tied parameters registered once
  local seen = {}
  local entries = {}
  for i, p in ipairs(params) do
    if type(p) ~= "table" then error(("params[%d] must be a table {name=, param=, grad=}"):format(i), 2) end
    if type(p.name) ~= "string" or p.name == "" then error(("params[%d]: name must be a non-empty string"):format(i), 2) end
    if self.by_name[p.name] or self.aliases[p.name] then error(("params[%d]: duplicate name '%s'"):format(i, p.name), 2) end
    if not ms.is_tensor(p.param) then error(("parameter '%s': param must be a tensor"):format(p.name), 2) end
    if p.param:device() ~= ctx:name() then
      error(("parameter '%s' is on %s but the optimizer runs on %s"):format(p.name, p.param:device(), ctx:name()), 2)
    end
    if p.grad ~= nil then self:_check_grad(p.name, p.param, p.grad, 3) end
    if p.tags ~= nil and type(p.tags) ~= "table" then error(("parameter '%s': tags must be an array of strings"):format(p.name), 2) end
    local key = data_key(p.param)
    if seen[key] then
      self.aliases[p.name] = seen[key].name
    else
      local e = { name = p.name, param = p.param, grad = p.grad, tags = p.tags, options = p.options }
      seen[key] = e
      entries[#entries + 1] = e
      self.by_name[p.name] = e
    end
  end

  -- routing and grouping: by route and identical overrides, groups in order of first appearance
  local group_of = {}
  local route_count = {}
  for _, e in ipairs(entries) do
    local info = param_info(e)
    local route, overrides = R.call(guard, recipe.route, info, opts)
    if type(route) ~= "string" or not recipe.routes[route] then
      error(("%s: route() gave %s for parameter '%s', which is not one of its routes"):format(recipe.name, tostring(route), e.name), 2)
    end
    local ov = {}
    for k, v in pairs(overrides or {}) do ov[k] = v end
    for k, v in pairs(e.options or {}) do ov[k] = v end
    local gkey = route .. "\0" .. json.encode(next(ov) and ov or {})
    local g = group_of[gkey]
    if not g then
      local gopts = next(ov) and R.options(recipe, ov, opts, guard) or opts
      route_count[route] = (route_count[route] or 0)
      g = { route = route, index = route_count[route], options = gopts, overrides = ov, state = {} }
      g.id = route .. "." .. g.index
      route_count[route] = route_count[route] + 1
      group_of[gkey] = g
      self.groups[#self.groups + 1] = g
    end
    local m = { name = e.name, param = e.param, grad = e.grad, tags = info.tags, info = info, state = {}, route = route }
    if settings.master_weights and (e.param:dtype() == "bf16" or e.param:dtype() == "f16") then
      m.model_param = e.param
      m.param = e.param:to("f32")
      m.master = m.param
    end
    g[#g + 1] = m
    e.member, e.group = m, g
    self.members[#self.members + 1] = m
  end

  -- state: created by each route's init, owned by the optimizer
  for _, g in ipairs(self.groups) do
    local r = recipe.routes[g.route]
    if r.init then R.call(guard, r.init, g, g.options) end
  end
  return self
end

function Optimizer:_check_grad(name, param, grad, level)
  if not ms.is_tensor(grad) then error(("parameter '%s': grad must be a tensor"):format(name), level) end
  if not same_shape(param, grad) then
    error(("parameter '%s': grad shape %s != param shape %s"):format(name, shape_str(grad), shape_str(param)), level)
  end
  if grad:device() ~= param:device() then
    error(("parameter '%s': grad is on %s, param on %s"):format(name, grad:device(), param:device()), level)
  end
  local dt = grad:dtype()
  if dt ~= "f32" and dt ~= "f64" and dt ~= "bf16" and dt ~= "f16" then
    error(("parameter '%s': grad dtype %s is not a float dtype"):format(name, dt), level)
  end
end

--- The learning rate the next step will use.
function Optimizer:get_lr()
  if self.lr_override then return self.lr_override end
  return self.options.lr * self.schedule(self.step_count + 1)
end

--- Sets the learning rate for the following steps (the schedule is then bypassed).
function Optimizer:set_lr(x)
  local v = R.types.number(x)
  if v == nil or v < 0 then error("set_lr: a non-negative number is needed (got " .. tostring(x) .. ")", 2) end
  self.lr_override = v
end

--- Replaces the gradient tensor of a parameter (a trainer whose gradient buffers move).
function Optimizer:set_grad(name, grad)
  local e = self.by_name[name] or self.by_name[self.aliases[name] or ""]
  if not e then error("set_grad: no parameter named '" .. tostring(name) .. "'", 2) end
  if grad ~= nil then self:_check_grad(name, e.param, grad, 3) end
  e.grad, e.member.grad = grad, grad
end

-- the step's context, as recipes see it
local function step_ctx(self, step, lr)
  local report = self.reports
  return {
    step = step, lr = lr, lr_t = self.lr_t, step_t = self.step_t, context = self.ctx, device = self.ctx:name(),
    world = { rank = 0, size = 1 },
    report = function(key, value) report[key] = value end,
  }
end

--- One optimizer step.  args (optional): grad_scale = s (gradients are s times too large: unscaled here),
--- grads = {name = tensor} (this step's gradients, for trainers that pass them per step).
--- Returns true when the step was applied, false when it was skipped (non-finite gradients).
function Optimizer:step(args)
  args = args or {}
  if args.grads then for name, g in pairs(args.grads) do self:set_grad(name, g) end end
  local step = self.step_count + 1
  local lr = self:get_lr()
  local launches0 = self.ctx:mem_stats().launches
  self.reports = {}
  local last = { step = step, lr = lr }
  self.last = last

  -- the gradients this step uses (parameters without one are skipped)
  local active = {}
  for _, m in ipairs(self.members) do if m.grad then active[#active + 1] = m end end

  -- one reduction over every gradient: finiteness, the global norm for clipping, the loss-scale check
  local grad_scale = args.grad_scale
  if grad_scale ~= nil and (type(grad_scale) ~= "number" or not (grad_scale > 0) or grad_scale == math.huge) then
    error("step: grad_scale must be a positive finite number (got " .. tostring(grad_scale) .. ")", 2)
  end
  local inv = grad_scale and 1 / grad_scale or 1
  local clip = self.settings.clip_grad_norm
  if #active > 0 and (self.settings.nonfinite ~= "apply" or clip or inv ~= 1) then
    local grads = {}
    for i, m in ipairs(active) do grads[i] = m.grad end
    local sums = ms.foreach_sumsq(grads):tolist_flat()
    local total = 0
    for _, v in ipairs(sums) do total = total + v end
    if total ~= total or total == math.huge then
      if self.settings.nonfinite ~= "apply" then
        local bad = {}
        for i, v in ipairs(sums) do if v ~= v or v == math.huge then bad[#bad + 1] = active[i].name end end
        if self.settings.nonfinite == "raise" then
          error(("step %d: non-finite gradients in %s"):format(step, table.concat(bad, ", ")), 2)
        end
        self.skipped = self.skipped + 1
        last.skipped, last.nonfinite = true, bad
        last.launches = self.ctx:mem_stats().launches - launches0
        return false
      end
    end
    local norm = math.sqrt(total) * inv
    last.grad_norm = norm
    local scale = inv
    if clip and norm > clip then scale = scale * clip / (norm + 1e-6) last.clipped = true end
    if scale ~= 1 then ms.foreach_scale(grads, scale) end
  end

  -- device scalars first, so captured kernels read this step's values
  self.lr_t:fill_(lr)
  self.step_t:fill_(step)
  local before
  if self.settings.stats then
    before = {}
    for _, m in ipairs(active) do before[m] = m.param:clone() end
  end
  local c = step_ctx(self, step, lr)
  for _, g in ipairs(self.groups) do
    local run = g
    local n_active = 0
    for _, m in ipairs(g) do if m.grad then n_active = n_active + 1 end end
    if n_active > 0 then
      if n_active < #g then   -- a view of the group with only the members that have gradients
        run = { route = g.route, index = g.index, id = g.id, options = g.options, state = g.state }
        for _, m in ipairs(g) do if m.grad then run[#run + 1] = m end end
      end
      local r = self.recipe.routes[g.route]
      c.plan = r.plan and R.call(self.guard, r.plan, run, g.options, c) or "step"
      R.call(self.guard, r.step, run, g.options, c)
    end
  end
  for _, m in ipairs(active) do
    if m.model_param then m.model_param:copy_(m.param) end
  end
  if before then
    last.update_norms = {}
    for m, old in pairs(before) do last.update_norms[m.name] = (m.param - old):norm() end
  end
  self.step_count = step
  last.skipped = false
  last.reports = self.reports
  last.launches = self.ctx:mem_stats().launches - launches0
  return true
end

-- ---------------------------------------------------------------------------------------------------
-- introspection
-- ---------------------------------------------------------------------------------------------------
local function state_bytes(state)
  local n = 0
  for _, v in pairs(state) do
    if ms.is_tensor(v) then
      local sz = ({ f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, u8 = 1 })[v:dtype()]
      n = n + v:numel() * sz
    elseif type(v) == "table" then
      n = n + state_bytes(v)
    end
  end
  return n
end

--- Routing and state sizes: returns data {params = {...}, groups = {...}, total_state_bytes} and a
--- readable table as the second value.
function Optimizer:info()
  local data = { recipe = self.recipe.name, params = {}, groups = {}, total_state_bytes = 0 }
  for _, g in ipairs(self.groups) do
    local gb = state_bytes(g.state)
    local names = {}
    for _, m in ipairs(g) do
      local b = state_bytes(m.state) + (m.master and m.master:numel() * 4 or 0)
      data.params[#data.params + 1] = {
        name = m.name, route = g.route, group = g.id, shape = m.info.shape, dtype = m.info.dtype,
        state_bytes = b, master_weights = m.master ~= nil,
      }
      data.total_state_bytes = data.total_state_bytes + b
      names[#names + 1] = m.name
    end
    data.total_state_bytes = data.total_state_bytes + gb
    data.groups[#data.groups + 1] = { id = g.id, route = g.route, params = names, overrides = g.overrides, state_bytes = gb }
  end
  for alias, target in pairs(self.aliases) do
    data.params[#data.params + 1] = { name = alias, tied_to = target, route = self.by_name[target].group.route, state_bytes = 0 }
  end
  local lines = { ("%-40s %-10s %-12s %-6s %12s"):format("parameter", "route", "shape", "dtype", "state bytes") }
  for _, p in ipairs(data.params) do
    lines[#lines + 1] = ("%-40s %-10s %-12s %-6s %12d%s"):format(p.name, p.route,
      p.shape and table.concat(p.shape, "x") or "", p.dtype or "", p.state_bytes,
      p.tied_to and ("  (tied to " .. p.tied_to .. ")") or (p.master_weights and "  (+ f32 master)" or ""))
  end
  lines[#lines + 1] = ("%-40s %-10s %-12s %-6s %12d"):format("total", "", "", "", data.total_state_bytes)
  return data, table.concat(lines, "\n")
end

--- Counters and the last step's numbers: skipped steps, grad norm, launches, update norms, recipe reports.
function Optimizer:stats()
  return { step = self.step_count, skipped_steps = self.skipped, lr = self:get_lr(), last = self.last }
end

-- ---------------------------------------------------------------------------------------------------
-- checkpoints
-- ---------------------------------------------------------------------------------------------------
-- walks a state table: tensors by name, other values (numbers, strings, booleans) into `scalars`
local function flatten_state(prefix, state, tensors, scalars)
  for k, v in pairs(state) do
    local name = prefix .. "/" .. tostring(k)
    if ms.is_tensor(v) then tensors[name] = v
    elseif type(v) == "table" then flatten_state(name, v, tensors, scalars)
    elseif type(v) == "number" or type(v) == "string" or type(v) == "boolean" then scalars[name] = v
    else error(("state %s holds a %s, which a checkpoint cannot keep"):format(name, type(v)), 0) end
  end
end

function Optimizer:_state_entries()
  local tensors, scalars, groups = {}, {}, {}
  for _, g in ipairs(self.groups) do
    local names = {}
    for _, m in ipairs(g) do
      flatten_state("param/" .. m.name, m.state, tensors, scalars)
      if m.master then tensors["param/" .. m.name .. "/master"] = m.master end
      names[#names + 1] = m.name
    end
    flatten_state("group/" .. g.id, g.state, tensors, scalars)
    groups[g.id] = names
  end
  return tensors, scalars, groups
end

--- Writes the optimizer's state to a safetensors file (atomically).
function Optimizer:save(path)
  local tensors, scalars, groups = self:_state_entries()
  local meta = {
    moonstep = ms.version, schema = M.SCHEMA,
    recipe = { name = self.recipe.name, version = self.recipe.version or 0, hash = self.recipe_hash },
    options = self.options, step = self.step_count, skipped = self.skipped, lr_override = self.lr_override,
    schedule = self.schedule_kind, rng = ms.rng_state(), scalars = scalars, groups = groups,
  }
  ms.save(path, tensors, { moonstep = json.encode(meta) })
end

--- Restores a checkpoint written by save() into this optimizer (created with the same recipe and
--- parameters).  opts.force = true accepts a checkpoint of another recipe (or recipe version).
function Optimizer:load(path, opts)
  local force = opts and opts.force
  local loaded, filemeta = ms.load(path, { device = self.ctx })
  if not filemeta.moonstep then error(path .. ": not a moonstep optimizer checkpoint (no 'moonstep' metadata)", 2) end
  local ok, meta = pcall(json.decode, filemeta.moonstep)
  if not ok or type(meta) ~= "table" then error(path .. ": corrupt checkpoint metadata: " .. tostring(meta), 2) end
  if meta.schema ~= M.SCHEMA then
    error(("%s: checkpoint schema %s, this moonstep reads schema %d"):format(path, tostring(meta.schema), M.SCHEMA), 2)
  end
  local rec = meta.recipe or {}
  if not force and (rec.name ~= self.recipe.name or rec.hash ~= self.recipe_hash) then
    error(("%s: checkpoint of recipe '%s' (hash %s), this optimizer runs '%s' (hash %s); pass {force = true} to load it anyway")
          :format(path, tostring(rec.name), tostring(rec.hash), self.recipe.name, self.recipe_hash), 2)
  end
  local tensors, scalars = self:_state_entries()
  -- check everything before changing anything
  for name, t in pairs(tensors) do
    local src = loaded[name]
    if not src then error(("%s: tensor '%s' is missing from the checkpoint"):format(path, name), 2) end
    if src:dtype() ~= t:dtype() or not same_shape(src, t) then
      error(("%s: tensor '%s' is %s %s in the checkpoint but %s %s here"):format(path, name, src:dtype(),
            shape_str(src), t:dtype(), shape_str(t)), 2)
    end
  end
  if not force then
    for name in pairs(loaded) do
      if not tensors[name] then error(("%s: tensor '%s' in the checkpoint has no place in this optimizer"):format(path, name), 2) end
    end
  end
  local file_scalars = meta.scalars or {}
  for name, v in pairs(scalars) do
    if file_scalars[name] == nil then error(("%s: state value '%s' is missing from the checkpoint"):format(path, name), 2) end
    if type(file_scalars[name]) ~= type(v) then error(("%s: state value '%s' has the wrong type"):format(path, name), 2) end
  end
  if type(meta.step) ~= "number" then error(path .. ": checkpoint has no step", 2) end
  for name, t in pairs(tensors) do t:copy_(loaded[name]) end
  -- scalars live in the state tables: walk to each by its path
  local function set_scalar(path_name, v)
    local kind, rest = path_name:match("^(%a+)/(.*)$")
    local root
    if kind == "param" then
      for _, m in ipairs(self.members) do
        if rest:sub(1, #m.name + 1) == m.name .. "/" then root, rest = m.state, rest:sub(#m.name + 2) break end
      end
    else
      for _, g in ipairs(self.groups) do
        if rest:sub(1, #g.id + 1) == g.id .. "/" then root, rest = g.state, rest:sub(#g.id + 2) break end
      end
    end
    local keys = {}
    for k in rest:gmatch("[^/]+") do keys[#keys + 1] = k end
    for i = 1, #keys - 1 do root = root[keys[i]] or root[tonumber(keys[i])] end
    local last = keys[#keys]
    if root[last] == nil and tonumber(last) then last = tonumber(last) end
    root[last] = v
  end
  for name in pairs(scalars) do set_scalar(name, file_scalars[name]) end
  self.step_count = meta.step
  self.skipped = meta.skipped or 0
  self.lr_override = meta.lr_override
  if meta.rng then ms.set_rng_state(meta.rng) end
  return { step = meta.step, recipe = rec.name }
end

return M
