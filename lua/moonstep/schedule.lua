--[[
moonstep.schedule -- learning-rate schedules: a multiplier of the base learning rate for each 1-based step.

  {kind = "constant"}
  {kind = "linear_warmup", warmup_steps = W}                   1/W -> 1 over steps 1..W, then 1
  {kind = "cosine", warmup_steps = W, total_steps = T, min_lr_ratio = r}
  {kind = "wsd", warmup_steps = W, stable_steps = S, decay_steps = D, min_lr_ratio = r, decay = "linear"|"cosine"}
                                                                warmup-stable-decay (decay: "linear" by default)
  function(step) return multiplier end

Steps count from 1 (the first optimizer step is step 1), and every phase ends on its value: the warmup gives
step / W (1/W at step 1, never 0, and 1 at step W); cosine's decay gives r + (1 - r) (1 + cos(pi (step - W) /
(T - W))) / 2, reaching r at step T and staying there; wsd holds 1 through step W + S and decays to r at step
W + S + D.  So a run of T steps under cosine (or wsd with W + S + D = T) takes its last step at r times the
base rate -- with r = 0, as moonstep.experiment's cosine, a step that changes nothing but the state.  (Hugging
Face's get_*_schedule_with_warmup count from 0 and shift this by one: their first warmup step has rate 0, their
last step a rate above r.)
]]
local M = {}

local kinds = {
  constant = {},
  linear_warmup = { warmup_steps = true },
  cosine = { warmup_steps = true, total_steps = true, min_lr_ratio = true },
  wsd = { warmup_steps = true, stable_steps = true, decay_steps = true, min_lr_ratio = true, decay = true },
}

local function warm(step, w)
  if w > 0 and step <= w then return step / w end
  return nil
end

--- A function step -> multiplier for a schedule description (checked; errors name the field).
function M.compile(s)
  if s == nil then return function() return 1 end, "constant" end
  if type(s) == "function" then
    return function(step)
      local m = s(step)
      if type(m) ~= "number" or not (m >= 0 and m < math.huge) then
        error(("schedule function returned %s at step %d (a finite non-negative number is needed)"):format(tostring(m), step), 0)
      end
      return m
    end, "function"
  end
  if type(s) == "string" then s = { kind = s } end
  if type(s) ~= "table" then error("schedule must be a table, a kind name or a function", 0) end
  local fields = kinds[s.kind]
  if not fields then
    error(("schedule: unknown kind %s (constant, linear_warmup, cosine, wsd)"):format(tostring(s.kind)), 0)
  end
  for k in pairs(s) do
    if k ~= "kind" and not fields[k] then error(("schedule %s: unknown field '%s'"):format(s.kind, tostring(k)), 0) end
  end
  local function int(name, default)
    local v = s[name]
    if v == nil then v = default end
    if type(v) ~= "number" or not (v >= 0 and v < math.huge) or v ~= math.floor(v) then
      error(("schedule %s: %s must be a finite non-negative integer (got %s)"):format(s.kind, name, tostring(v)), 0)
    end
    return v
  end
  local function ratio()
    -- (nil only: `or 0` would take a mistyped false for 0)
    local r = s.min_lr_ratio
    if r == nil then r = 0 end
    if type(r) ~= "number" or not (r >= 0 and r <= 1) then
      error(("schedule %s: min_lr_ratio must be in [0, 1] (got %s)"):format(s.kind, tostring(r)), 0)
    end
    return r
  end
  if s.kind == "constant" then return function() return 1 end, "constant" end
  if s.kind == "linear_warmup" then
    local w = int("warmup_steps")
    return function(step) return warm(step, w) or 1 end, "linear_warmup"
  end
  if s.kind == "cosine" then
    local w, t, r = int("warmup_steps", 0), int("total_steps"), ratio()
    if t <= w then error(("schedule cosine: total_steps %d must exceed warmup_steps %d"):format(t, w), 0) end
    return function(step)
      local m = warm(step, w)
      if m then return m end
      local p = math.min((step - w) / (t - w), 1)
      return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
    end, "cosine"
  end
  -- warmup-stable-decay: linear warmup, a plateau, then a decay to min_lr_ratio (linear or cosine)
  local w, st, d, r = int("warmup_steps", 0), int("stable_steps"), int("decay_steps"), ratio()
  local shape = s.decay
  if shape == nil then shape = "linear" end
  if shape ~= "linear" and shape ~= "cosine" then
    error(("schedule wsd: decay must be 'linear' or 'cosine' (got %s)"):format(tostring(shape)), 0)
  end
  return function(step)
    local m = warm(step, w)
    if m then return m end
    if step <= w + st then return 1 end
    local p = d > 0 and math.min((step - w - st) / d, 1) or 1
    local f = shape == "linear" and (1 - p) or 0.5 * (1 + math.cos(math.pi * p))
    return r + (1 - r) * f
  end, "wsd"
end

return M
