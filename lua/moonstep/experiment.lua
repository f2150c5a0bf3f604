--[[
moonstep.experiment -- trains a built-in problem with a recipe: the loop behind `moonstep train` and
`moonstep compare`, usable from Lua (and the REPL) as well.

  local E = require("moonstep.experiment")
  local r = E.run{problem = "lsq", recipe = "adamw", steps = 200, seed = 1,
                  recipe_options = {lr = 0.05}, device = "cpu"}
  print(r.final_loss, r.val_loss, r.state_bytes)

What a run reports: the training loss of every step; `final_loss` and `best_loss` are the last and the
lowest value of its moving average over `smooth` steps (5% of the run unless the problem says otherwise:
minibatch losses are noisy), over the whole run for a resumed one (its checkpoint records the losses); validation every `eval_every` steps and after the last one; wall time of the
steps (evaluations excluded); optimizer state bytes from opt:info().

Checkpoints are folders: optim.safetensors (the ms.optim checkpoint: recipe name and content hash, options,
step, state) and model.safetensors (the parameters, with the problem, its options, the seed, the recipe (and
its file's path, for a recipe file), its options and the run's settings in the metadata).  Batches are a
function of (seed, step), so a resumed run continues exactly as an uninterrupted one would.
]]
local ms = require("moonstep")
local problems = require("moonstep.problems")
local R = require("moonstep.recipe")
local json = require("moonstep.json")
local ffi = require("ffi")

local E = {}

-- a monotonic wall clock (moonstep.core's)
E.clock = require("moonstep.core").clock

--- A recipe table from a name or path; files outside the built-in folders are sandboxed unless trusted.
function E.recipe(spec, trusted)
  -- ("false" is true to Lua: the file would run unsandboxed)
  if trusted ~= nil then require("moonstep.core").check_value("recipe", "trusted", trusted, "boolean", 2) end
  if type(spec) == "table" then return R.resolve(spec) end
  return R.resolve(spec, { trusted = trusted and true or false })
end

--- The options a recipe runs with on a problem: the problem's starting point for that recipe (only the
--- options the recipe has), then the caller's values on top.
function E.recipe_options(problem, recipe, given)
  local out = {}
  for k, v in pairs((problem.recipe_options or {})[recipe.name] or {}) do
    if recipe.options[k] ~= nil then out[k] = v end
  end
  for k, v in pairs(given or {}) do out[k] = v end
  return out
end

local SCHEDULES = { constant = true, cosine = true, linear_warmup = true, wsd = true }
E.schedules = { "constant", "cosine", "linear_warmup", "wsd" }

--- Runtime settings for ms.optim from a run's config (schedule over the whole run, clipping).
function E.settings(cfg, steps)
  local kind = cfg.schedule or "constant"
  if not SCHEDULES[kind] then
    error(("unknown schedule '%s' (known: %s)"):format(tostring(kind), table.concat(E.schedules, ", ")), 0)
  end
  local s = { trusted = cfg.trusted and true or false, ctx = cfg.ctx }
  local w = math.min(cfg.warmup or 0, steps - 1)
  -- each kind spans the whole run: cosine decays to 0 at the last step, wsd decays over its last 20%
  if kind == "cosine" then
    s.schedule = { kind = "cosine", warmup_steps = w, total_steps = steps }
  elseif kind == "wsd" then
    local d = math.max(1, math.floor(steps * 0.2))
    s.schedule = { kind = "wsd", warmup_steps = w, stable_steps = math.max(0, steps - w - d), decay_steps = d }
  elseif kind == "linear_warmup" or w > 0 then
    s.schedule = { kind = "linear_warmup", warmup_steps = w }
  end
  if cfg.clip and cfg.clip > 0 then s.clip_grad_norm = cfg.clip end
  return s
end

-- moving average over `w` steps of losses[1..n].  A running sum that subtracts the value leaving the
-- window keeps the rounding error of the largest values it ever held (1e-16 of an initial 1e4 swamps a
-- later loss of 1e-13), so the window sums are made of additions only: the losses are cut into blocks of
-- w; a window is the tail of one block (suffix sums) plus the head of the next (prefix sums).  O(n).
local function moving_average(losses, w)
  local n = #losses
  local prefix, suffix = {}, {}
  for i = 1, n do
    prefix[i] = ((i - 1) % w == 0) and losses[i] or prefix[i - 1] + losses[i]
  end
  for i = n, 1, -1 do
    suffix[i] = (i % w == 0 or i == n) and losses[i] or suffix[i + 1] + losses[i]
  end
  local out = {}
  for i = 1, n do
    local start = i - w + 1
    local sum
    if start <= 1 then sum = prefix[i]                         -- the first block: all of 1..i
    elseif (start - 1) % w == 0 then sum = prefix[i]           -- the window is exactly one block
    else sum = suffix[start] + prefix[i] end                   -- a tail and a head
    out[i] = sum / math.min(i, w)
  end
  return out
end
E.moving_average = moving_average

pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);")
--- The absolute path of an existing file or folder, without links or ".."; nil for one that does not exist.
function E.realpath(path)
  local buf = ffi.new("char[4097]")
  local r = ffi.C.realpath(path, buf)
  return r ~= nil and ffi.string(r) or nil
end

local function model_path(dir) return dir .. "/model.safetensors" end
local function optim_path(dir) return dir .. "/optim.safetensors" end

--- Creates folder dir and its parents; raises "cannot create <what> 'dir'" when it cannot.
function E.mkdir(dir, what)
  local ok = os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  if ok ~= 0 and ok ~= true then error(("cannot create %s '%s'"):format(what or "folder", dir), 0) end
end
local function mkdir_p(dir) E.mkdir(dir, "checkpoint folder") end

-- Frees the engine memory of unreachable tensors: a tensor's handle sits in a weak table keyed by the
-- tensor object, so its finalizer runs in the cycle after the one that collects the object: two cycles.
local function full_collect()
  collectgarbage()
  collectgarbage()
end

-- the entries of t that JSON holds (a caller from Lua may give any value: what cannot be recorded is left out)
local function json_values(t)
  local out = {}
  for k, v in pairs(t) do
    if type(k) == "string" and pcall(json.encode, v) then out[k] = v end
  end
  return out
end

-- the metadata of a safetensors file, read from its header alone (its tensors may be large)
local function safetensors_meta(path)
  local f = io.open(path, "rb")
  if not f then return nil, "cannot be read" end
  local head = f:read(8)
  local n = 0
  for i = #(head or ""), 1, -1 do n = n * 256 + head:byte(i) end
  local text = #(head or "") == 8 and n < 2 ^ 27 and f:read(n) or nil
  local size = f:seek("end")
  f:close()
  local ok, h = pcall(json.decode, text or "")
  if not ok or type(h) ~= "table" then return nil, "has no readable safetensors header" end
  -- a file cut short (a copy or a save that did not finish): found here, before a run starts on it
  local need = 0
  for k, v in pairs(h) do
    local o = k ~= "__metadata__" and type(v) == "table" and v.data_offsets
    if type(o) == "table" and type(o[2]) == "number" and o[2] > need then need = o[2] end
  end
  if size and size < 8 + n + need then
    return nil, ("is cut short: its tensors need %.0f bytes of data, it holds %.0f"):format(need, size - 8 - n)
  end
  return type(h.__metadata__) == "table" and h.__metadata__ or {}
end

--- Reads a checkpoint folder's run description (what model.safetensors records), from the file's header alone:
--- the parameters are read once, by the run that resumes (E.run), not by each check before it.
function E.checkpoint_info(dir)
  local f = io.open(model_path(dir), "rb")
  if not f then error(("%s: not a checkpoint folder (no model.safetensors)"):format(dir), 0) end
  f:close()
  local meta, why = safetensors_meta(model_path(dir))
  if not meta then error(("%s: cannot read model.safetensors: it %s"):format(dir, why), 0) end
  if not meta.moonstep_train then error(("%s: model.safetensors was not written by moonstep train"):format(dir), 0) end
  -- (a bare json error would name neither the folder nor the file)
  local okj, info = pcall(json.decode, meta.moonstep_train)
  if not okj or type(info) ~= "table" or type(info.problem) ~= "string" then
    error(("%s: model.safetensors: corrupt run description: %s"):format(dir,
          okj and "not an object naming its problem" or tostring(info)), 0)
  end
  -- the fields a resumed run uses, checked here: a bad one would fail deep inside the run, naming neither
  -- the folder nor the field (or run with a value no run of moonstep train wrote)
  local function bad(field, want)
    local v = info[field]
    error(("%s: model.safetensors: corrupt run description: '%s' is %s, not %s"):format(dir, field,
          type(v) == "string" and ("%q"):format(v) or tostring(v), want), 0)
  end
  local function whole(v, min) return type(v) == "number" and v == math.floor(v) and v >= min and v < 2 ^ 53 end
  if not whole(info.steps, 1) then bad("steps", "a whole number of steps >= 1") end
  if info.step ~= nil and not whole(info.step, 0) then bad("step", "a step number >= 0") end
  if info.seed ~= nil and not whole(info.seed, 0) then bad("seed", "a seed >= 0") end
  if info.warmup ~= nil and not whole(info.warmup, 0) then bad("warmup", "a number of steps >= 0") end
  if info.clip ~= nil and info.clip ~= false and not (type(info.clip) == "number" and info.clip >= 0 and info.clip < math.huge) then
    bad("clip", "a number >= 0 or false")
  end
  if info.schedule ~= nil and not SCHEDULES[info.schedule] then bad("schedule", "one of " .. table.concat(E.schedules, ", ")) end
  for _, field in ipairs { "problem_options", "recipe_options" } do
    if info[field] ~= nil and type(info[field]) ~= "table" then bad(field, "an object") end
  end
  if info.recipe ~= nil and type(info.recipe) ~= "string" then bad("recipe", "a recipe name") end
  if info.recipe_file ~= nil and type(info.recipe_file) ~= "string" then bad("recipe_file", "a path") end
  if info.device ~= nil and type(info.device) ~= "string" then bad("device", "a device name") end
  if info.losses ~= nil then
    local ok = type(info.losses) == "table"
    for i, v in ipairs(ok and info.losses or {}) do ok = ok and type(v) == "number" and i <= 2 ^ 31 end
    if not ok then bad("losses", "a list of numbers") end
  end
  return info
end

--- The configuration of a run that resumes from cfg.resume, checked against its checkpoint before anything
--- is built: the problem, its options, the seed, the schedule and clipping, a resolved recipe (name and
--- content hash; cfg.force allows another), and the step of the checkpoint's two files.  Returns cfg with what
--- it leaves unset taken from the checkpoint, and the run description.  E.run calls it; `moonstep train` calls
--- it first, so that what it refuses is a usage error, not a failed run.
function E.resume_config(cfg, problem)
  local defaults = problem.defaults or {}
  local resume_info = E.checkpoint_info(cfg.resume)
  if resume_info.problem ~= problem.name then
    error(("%s: checkpoint of problem '%s', not '%s'"):format(cfg.resume, tostring(resume_info.problem), problem.name), 0)
  end
  local given = problems.options(problem, cfg.problem_options)
  local oks, saved = pcall(problems.options, problem, resume_info.problem_options)
  if not oks then
    error(("%s: model.safetensors: corrupt run description: %s"):format(cfg.resume, tostring(saved)), 0)
  end
  for k in pairs(cfg.problem_options or {}) do
    if given[k] ~= saved[k] then
      error(("%s: problem option '%s' is %s in the checkpoint, %s here"):format(cfg.resume, k, tostring(saved[k]), tostring(given[k])), 0)
    end
  end
  if cfg.seed and cfg.seed ~= resume_info.seed then
    error(("%s: the checkpoint's run has seed %s, not %s (its data order depends on it)"):format(cfg.resume, tostring(resume_info.seed), tostring(cfg.seed)), 0)
  end
  local merged = {}
  for k, v in pairs(cfg) do merged[k] = v end
  merged.problem_options = resume_info.problem_options
  merged.seed = resume_info.seed
  if merged.steps == nil then merged.steps = resume_info.steps end
  if merged.schedule == nil then merged.schedule = resume_info.schedule end
  if merged.warmup == nil then merged.warmup = resume_info.warmup end
  if merged.clip == nil then merged.clip = resume_info.clip or 0 end
  -- the schedule spans the whole run: another --steps (or schedule, warmup, clip) would run the rest of
  -- the steps under other learning rates than the checkpoint's run had, not as that run continued
  if not cfg.force then
    local function shape(c)
      local s = E.settings({ schedule = c.schedule or defaults.schedule, warmup = c.warmup or defaults.warmup or 0,
                             clip = c.clip }, c.steps or defaults.steps or 100)
      return json.encode({ schedule = s.schedule or "constant", clip = s.clip_grad_norm or false })
    end
    local saved_run = { steps = resume_info.steps, schedule = resume_info.schedule, warmup = resume_info.warmup,
                        clip = resume_info.clip or 0 }
    if shape(merged) ~= shape(saved_run) then
      local diffs = {}
      for _, k in ipairs { "steps", "schedule", "warmup", "clip" } do
        local a, b = cfg[k], saved_run[k]
        if k == "clip" then a, b = a and a > 0 and a or nil, b and b ~= false and b > 0 and b or nil end
        if cfg[k] ~= nil and a ~= b then
          diffs[#diffs + 1] = ("%s %s (the checkpoint's run: %s)"):format(k, tostring(a or "off"), tostring(b or (k == "clip" and "off" or "default")))
        end
      end
      error(("%s: resuming with %s would change the learning-rate schedule or clipping of the checkpoint's run: " ..
        "it would not continue as that run (pass --force to resume it anyway)"):format(cfg.resume, table.concat(diffs, ", ")), 0)
    end
  end

  -- (checked again, in full, when the optimizer loads the file: these are the refusals a command line meets)
  local recipe = cfg.recipe
  if type(recipe) == "table" and R.meta[recipe] and not cfg.force
     and (resume_info.recipe ~= recipe.name or resume_info.recipe_hash ~= R.meta[recipe].hash) then
    error(("%s: checkpoint of recipe '%s' (hash %s), not '%s' (hash %s); pass --force to resume it anyway"):format(cfg.resume,
      tostring(resume_info.recipe), tostring(resume_info.recipe_hash), recipe.name, R.meta[recipe].hash), 0)
  end
  local om, why = safetensors_meta(optim_path(cfg.resume))
  if not om then error(("%s: optim.safetensors %s"):format(cfg.resume, why), 0) end
  local okm, ometa = pcall(json.decode, om.moonstep or "")
  if okm and type(ometa) == "table" and resume_info.step ~= nil and ometa.step ~= resume_info.step then
    error(("%s: optim.safetensors is at step %s but model.safetensors at step %s (a save that did not finish?)")
      :format(cfg.resume, tostring(ometa.step), tostring(resume_info.step)), 0)
  end
  -- the two files of one run: an optimizer file of another run's recipe (copied in) is no --force's business
  local orec = okm and type(ometa) == "table" and type(ometa.recipe) == "table" and ometa.recipe or nil
  if orec and resume_info.recipe ~= nil and (orec.name ~= resume_info.recipe or orec.hash ~= resume_info.recipe_hash) then
    error(("%s: optim.safetensors holds recipe '%s' (hash %s) but model.safetensors names '%s' (hash %s): the two "
           .. "files are of different runs"):format(cfg.resume, tostring(orec.name), tostring(orec.hash),
           tostring(resume_info.recipe), tostring(resume_info.recipe_hash)), 0)
  end
  return merged, resume_info
end

--- Trains one problem with one recipe.  cfg:
---   problem (name or module), problem_options, recipe (name, path or table), recipe_options, trusted,
---   steps, seed, device | ctx, dtype, eval_every, smooth, schedule, warmup, clip,
---   save (folder), resume (folder), force (resume under another recipe or schedule), stop_after (step),
---   on_step(step, loss, run) and on_eval(step, eval, run) callbacks.  Unset values come from the problem's
---   defaults, else steps 100, seed 0, eval_every steps / 10, smooth steps / 20; unknown keys are refused.
--- Returns a table: losses, smoothed, evals {step, loss, accuracy}, final_loss, best_loss, val_loss,
--- val_accuracy, seconds, steps_per_s, state_bytes, info (opt:info()), recipe, recipe_hash, steps_done,
--- start_step, diverged (step) ...
-- The keys E.run and E.compare take.  A misspelt one (step = 3, recipe_opts) would otherwise run with the
-- default silently, possibly for minutes; values a run would truncate or trip over later are checked too.
local RUN_KEYS = {
  "problem", "problem_options", "recipe", "recipe_options", "trusted", "steps", "seed", "device", "ctx", "dtype",
  "eval_every", "smooth", "schedule", "warmup", "clip", "save", "resume", "force", "stop_after", "on_step", "on_eval",
}
local COMPARE_KEYS = { "recipes", "options", "seeds", "skip_missing", "on_run", "on_loaded", "on_fail" }
local function key_set(...)
  local set = {}
  for _, list in ipairs { ... } do for _, k in ipairs(list) do set[k] = true end end
  return set
end
local run_keys, compare_keys = key_set(RUN_KEYS), key_set(RUN_KEYS, COMPARE_KEYS)

local function check_cfg(what, cfg, keys)
  if type(cfg) ~= "table" then error(("%s: the configuration must be a table (got %s)"):format(what, type(cfg)), 0) end
  local core = require("moonstep.core")
  core.check_keys(what, cfg, keys, 0, "setting")
  -- each setting's kind, before anything runs: a wrong one otherwise failed deep inside (a Lua error naming
  -- neither the setting nor the call), or only when first used -- a callback after the first step, a
  -- checkpoint folder given as a number at the end of the run
  local function kind(name, k)
    if cfg[name] ~= nil then core.check_value(what, name, cfg[name], k, 0) end
  end
  kind("problem_options", "table") kind("recipe_options", "table") kind("options", "table")
  kind("device", "string") kind("schedule", "string")
  for _, f in ipairs { "on_step", "on_eval", "on_run", "on_loaded", "on_fail" } do kind(f, "function") end
  if cfg.problem ~= nil and type(cfg.problem) ~= "string" and type(cfg.problem) ~= "table" then
    error(("%s: problem must be a problem name or table (got %s)"):format(what, core.show(cfg.problem)), 0)
  end
  if cfg.recipe ~= nil and type(cfg.recipe) ~= "string" and type(cfg.recipe) ~= "table" then
    error(("%s: recipe must be a recipe name, a file path or a recipe table (got %s)"):format(what, core.show(cfg.recipe)), 0)
  end
  if cfg.ctx ~= nil and require("moonstep.tensor").handle_ctx(cfg.ctx) == nil then
    error(("%s: ctx must be a moonstep context (got %s)"):format(what, core.show(cfg.ctx)), 0)
  end
  -- folders: io and the shell read a path up to a NUL byte (another folder would be written or read)
  for _, name in ipairs { "save", "resume" } do
    local v = cfg[name]
    if v ~= nil then
      if type(v) ~= "string" or v == "" then
        error(("%s: %s must be a folder's path (got %s)"):format(what, name, core.show(v)), 0)
      end
      core.c_string(what, name, v, 0)
    end
  end
  if cfg.recipes ~= nil then
    kind("recipes", "table")
    for i, spec in ipairs(cfg.recipes) do
      if type(spec) ~= "string" and type(spec) ~= "table" then
        error(("%s: recipes[%d] must be a recipe name, a file path or a recipe table (got %s)"):format(what, i,
              core.show(spec)), 0)
      end
    end
  end
  for i, a in ipairs(cfg.options or {}) do
    if type(a) ~= "table" or type(a.key) ~= "string" or (a.recipe ~= nil and type(a.recipe) ~= "string") then
      error(("%s: options[%d] must be a table {key = option name, value = v[, recipe = name]} (got %s)"):format(
            what, i, core.show(a)), 0)
    end
  end
  local function whole(name, min)
    local v = cfg[name]
    -- (inf passes v == floor(v): seeds = inf would compare forever)
    if v ~= nil and (type(v) ~= "number" or v ~= math.floor(v) or v < min or v == math.huge) then
      error(("%s: %s must be an integer >= %d (got %s)"):format(what, name, min, type(v) == "string" and ("%q"):format(v) or tostring(v)), 0)
    end
  end
  whole("seed", 0) whole("seeds", 1) whole("smooth", 1) whole("eval_every", 1) whole("stop_after", 1)
  whole("steps", 1) whole("warmup", 0)
  -- (trusted = "false" is true to Lua: a recipe file would run unsandboxed)
  for _, flag in ipairs { "trusted", "force", "skip_missing" } do
    if cfg[flag] ~= nil then require("moonstep.core").check_value(what, flag, cfg[flag], "boolean", 0) end
  end
  if cfg.clip ~= nil and cfg.clip ~= false and (type(cfg.clip) ~= "number" or not (cfg.clip >= 0)) then
    error(("%s: clip must be a number >= 0 or false (got %s)"):format(what, tostring(cfg.clip)), 0)
  end
  if cfg.dtype ~= nil then
    local ok, err = pcall(require("moonstep.tensor").norm_dtype, cfg.dtype, 0)
    if not ok then error(("%s: dtype: %s"):format(what, tostring(err)), 0) end
  end
end

function E.run(cfg)
  check_cfg("run", cfg, run_keys)
  local problem = type(cfg.problem) == "table" and cfg.problem or problems.get(cfg.problem)
  local defaults = problem.defaults or {}

  -- a resumed run takes what it was not told from the checkpoint, and refuses what contradicts it
  local resume_info, resume_tensors
  if cfg.resume then
    cfg, resume_info = E.resume_config(cfg, problem)
    local ok, tensors = pcall(ms.load, model_path(cfg.resume))
    if not ok then error(("%s: cannot read model.safetensors: %s"):format(cfg.resume, tostring(tensors)), 0) end
    resume_tensors = tensors
  end

  local steps = cfg.steps or defaults.steps or 100
  if type(steps) ~= "number" or steps < 1 or steps ~= math.floor(steps) or steps == math.huge then
    error("steps must be a positive integer (got " .. tostring(steps) .. ")", 0)
  end
  local ctx = cfg.ctx or ms.device(cfg.device or ms.best_device())
  local seed = cfg.seed or 0

  local popts = problems.options(problem, cfg.problem_options)
  local inst = problem.new(popts, { ctx = ctx, dtype = cfg.dtype or "f32", seed = seed })
  local recipe = E.recipe(cfg.recipe, cfg.trusted)
  local given = cfg.recipe_options
  -- a resumed run keeps the recipe options its checkpoint was trained with (under the same recipe; those
  -- the recipe still has), and the caller's on top
  if resume_info and type(resume_info.recipe_options) == "table" and resume_info.recipe == recipe.name then
    given = {}
    for k, v in pairs(resume_info.recipe_options) do
      if recipe.options[k] ~= nil then given[k] = v end
    end
    for k, v in pairs(cfg.recipe_options or {}) do given[k] = v end
  end
  local ropts = E.recipe_options(problem, recipe, given)
  local run_cfg = {
    schedule = cfg.schedule or defaults.schedule, warmup = cfg.warmup or defaults.warmup or 0,
    clip = cfg.clip == nil and defaults.clip or cfg.clip, trusted = cfg.trusted, ctx = ctx,
  }
  local opt = ms.optim.new(recipe, inst.params, ropts, E.settings(run_cfg, steps))

  local start = 1
  if cfg.resume then
    for _, p in ipairs(inst.params) do
      local t = resume_tensors[p.name]
      if not t then error(("%s: parameter '%s' is missing from the checkpoint"):format(cfg.resume, p.name), 0) end
      local ok, err = pcall(function() p.param:copy_(t:to(ctx)) end)
      if not ok then error(("%s: parameter '%s': %s"):format(cfg.resume, p.name, tostring(err)), 0) end
    end
    local ok, err = pcall(opt.load, opt, optim_path(cfg.resume), { force = cfg.force })
    if not ok then
      error(tostring(err):gsub("pass {force = true} to load it anyway", "pass --force to resume it anyway"), 0)
    end
    -- the two files are written one after the other: a save stopped between them leaves them at
    -- different steps, and weights of one step with the optimizer state of another do not resume exactly
    if resume_info.step ~= nil and opt.step_count ~= resume_info.step then
      error(("%s: optim.safetensors is at step %d but model.safetensors at step %s (a save that did not finish?)")
        :format(cfg.resume, opt.step_count, tostring(resume_info.step)), 0)
    end
    start = opt.step_count + 1
  end

  local eval_every = cfg.eval_every or defaults.eval_every or math.max(1, math.floor(steps / 10))
  local last_step = math.min(steps, cfg.stop_after or steps)
  local result = {
    problem = problem.name, problem_options = popts, recipe = recipe.name, recipe_hash = R.meta[recipe].hash,
    recipe_options = opt.options, seed = seed, device = ctx:name(), steps = steps, start_step = start,
    losses = {}, evals = {}, describe = inst.describe(), opt = opt, instance = inst,
  }
  local losses = result.losses

  local function evaluate(step)
    local ev = inst.evaluate()
    full_collect()
    ev.step = step
    result.evals[#result.evals + 1] = ev
    if cfg.on_eval then cfg.on_eval(step, ev, result) end
    return ev
  end

  -- Lua's collector sees only the small tables wrapping tensors, not the engine memory behind them, so
  -- a step's temporaries would pile up (on a GPU too): collect whenever the context holds much more than
  -- it did after the last collection
  full_collect()
  local mem_base = ctx:mem_stats().bytes_in_use
  local function tidy()
    if ctx:mem_stats().bytes_in_use > 2 * mem_base + 64 * 2 ^ 20 then
      full_collect()
      mem_base = ctx:mem_stats().bytes_in_use
    end
  end

  -- the checkpoint folder before the steps: an unusable one found after them would lose the run
  if cfg.save then mkdir_p(cfg.save) end

  local seconds = 0
  local t0 = E.clock()
  for step = start, last_step do
    local loss = inst.loss_grad(inst.train_batch(step))
    local ok, err = pcall(opt.step, opt)
    if not ok then
      error(("recipe '%s' failed at step %d: %s"):format(recipe.name, step, tostring(err)), 0)
    end
    tidy()
    losses[#losses + 1] = loss
    result.steps_done = step
    if loss ~= loss or loss == math.huge then
      result.diverged = step
      break
    end
    if cfg.on_step then cfg.on_step(step, loss, result) end
    if step % eval_every == 0 and step ~= last_step then
      ctx:sync()   -- the step's device work is the step's time, not the evaluation's (steps/s read high on a GPU)
      seconds = seconds + (E.clock() - t0)
      evaluate(step)
      t0 = E.clock()
    end
  end
  ctx:sync()
  seconds = seconds + (E.clock() - t0)
  result.steps_done = result.steps_done or start - 1
  if not result.diverged and result.steps_done >= start then evaluate(result.steps_done) end

  local n = #losses
  local w = cfg.smooth or defaults.smooth or math.max(1, math.floor(steps / 20))
  result.smooth = w
  -- the run's whole loss history: a resumed run's final and best losses (and its moving average) are those of
  -- the uninterrupted run, from the losses its checkpoint recorded (older checkpoints have none: this part's)
  local history = {}
  if resume_info and type(resume_info.losses) == "table" and #resume_info.losses == start - 1 then
    for i, v in ipairs(resume_info.losses) do history[i] = v end
  end
  local earlier = #history
  for i = 1, n do history[earlier + i] = losses[i] end
  local smoothed = moving_average(history, w)
  result.smoothed = {}
  for i = 1, n do result.smoothed[i] = smoothed[earlier + i] end
  result.final_loss = smoothed[#history]
  local best = math.huge
  for _, v in ipairs(smoothed) do if v < best then best = v end end
  result.best_loss = #history > 0 and best or nil
  local last_eval = result.evals[#result.evals]
  result.val_loss = not result.diverged and last_eval and last_eval.loss or nil
  result.val_accuracy = last_eval and last_eval.accuracy
  result.seconds = seconds
  result.steps_per_s = n > 0 and n / seconds or 0
  result.info = opt:info()
  result.state_bytes = result.info.total_state_bytes

  if cfg.save then
    mkdir_p(cfg.save)
    local tensors = {}
    for _, p in ipairs(inst.params) do tensors[p.name] = p.param end
    local meta = {
      problem = problem.name, problem_options = popts, seed = seed, step = result.steps_done, steps = steps,
      schedule = run_cfg.schedule, warmup = run_cfg.warmup, clip = run_cfg.clip or false,
      recipe = recipe.name, recipe_hash = result.recipe_hash, recipe_options = json_values(ropts), moonstep = ms.version,
      device = ctx:name(),
    }
    -- a recipe file by its absolute path, so that a resume finds it again without --recipe (one found by
    -- name is recorded by its name alone: its file moves with the installation)
    local rmeta = R.meta[recipe]
    if rmeta and rmeta.path and not rmeta.by_name then meta.recipe_file = E.realpath(rmeta.path) end
    -- the loss history, for a resumed run's final and best losses (JSON has no NaN: a diverged run has none)
    local finite = true
    for _, v in ipairs(history) do finite = finite and v == v and v > -math.huge and v < math.huge end
    if finite then meta.losses = history end
    opt:save(optim_path(cfg.save))
    ms.save(model_path(cfg.save), tensors, { moonstep_train = json.encode(meta) })
    result.saved = cfg.save
  end
  return result
end

-- ---------------------------------------------------------------------------------------------------
-- comparisons
-- ---------------------------------------------------------------------------------------------------
local function mean(t)
  local s = 0
  for _, v in ipairs(t) do s = s + v end
  return #t > 0 and s / #t or nil
end

local function spread(t)
  if #t < 2 then return 0 end
  local lo, hi = math.huge, -math.huge
  for _, v in ipairs(t) do lo, hi = math.min(lo, v), math.max(hi, v) end
  return hi - lo
end

--- Options for each recipe from a list of {recipe = name or nil, key = k, value = v} assignments: an
--- unqualified one goes to every recipe that has the option (and must fit at least one), a qualified one
--- to that recipe only.  Returns {[recipe table] = {k = v}}.
function E.distribute_options(recipes, assignments)
  local out = {}
  for _, r in ipairs(recipes) do out[r] = {} end
  for _, a in ipairs(assignments or {}) do
    local hit = false
    for _, r in ipairs(recipes) do
      if a.recipe == nil or a.recipe == r.name then
        if r.options[a.key] ~= nil then
          out[r][a.key] = a.value
          hit = true
        elseif a.recipe ~= nil then
          local known = {}
          for n in pairs(r.options) do known[#known + 1] = n end
          table.sort(known)
          error(("%s: unknown option '%s' (known: %s)"):format(r.name, a.key, table.concat(known, ", ")), 0)
        end
      end
    end
    if not hit then
      if #recipes == 1 and a.recipe == nil then
        local r = recipes[1]
        local known = {}
        for n in pairs(r.options) do known[#known + 1] = n end
        table.sort(known)
        error(("%s: unknown option '%s' (known: %s)"):format(r.name, a.key, table.concat(known, ", ")), 0)
      end
      if a.recipe then
        error(("--opt %s.%s: no recipe named '%s' in this run"):format(a.recipe, a.key, a.recipe), 0)
      end
      local names = {}
      for _, r in ipairs(recipes) do names[#names + 1] = r.name end
      error(("--opt %s: no recipe of this run (%s) has an option '%s'"):format(a.key, table.concat(names, ", "), a.key), 0)
    end
  end
  return out
end

--- Trains the same problem (same seeds, so the same initial weights and batches) with several recipes.
--- cfg: as E.run, with recipes = {spec, ...} instead of recipe, options = {assignment, ...} (see
--- distribute_options), seeds = K (seeds seed .. seed + K - 1), skip_missing (recipes that cannot be
--- loaded are left out and listed in `skipped` instead of stopping the comparison), and
--- on_run(recipe_name, seed, index, total) called before each run.  A recipe that fails while running is
--- reported in its row, the others still run.
--- Returns {rows = {...} (sorted by validation loss), runs = {[name] = {result per seed}}, recipes = {...}}.
function E.compare(cfg)
  check_cfg("compare", cfg, compare_keys)
  local problem = type(cfg.problem) == "table" and cfg.problem or problems.get(cfg.problem)
  if type(cfg.recipes) ~= "table" or #cfg.recipes == 0 then error("compare: no recipes given", 0) end
  local recipes, seen, skipped = {}, {}, {}
  for _, spec in ipairs(cfg.recipes) do
    local ok, r = pcall(E.recipe, spec, cfg.trusted)
    if not ok then
      if not cfg.skip_missing then error(r, 0) end
      skipped[#skipped + 1] = { recipe = spec, error = tostring(r) }
    else
      if seen[r.name] then error(("compare: recipe '%s' is given twice"):format(r.name), 0) end
      seen[r.name] = true
      recipes[#recipes + 1] = r
    end
  end
  if #recipes == 0 then error("compare: none of the recipes could be loaded (" .. skipped[1].error .. ")", 0) end
  if cfg.on_loaded then cfg.on_loaded(recipes, skipped) end
  local given = E.distribute_options(recipes, cfg.options)
  -- check every recipe's options before the first run, so a typo does not cost the runs before it
  for _, r in ipairs(recipes) do R.options(r, E.recipe_options(problem, r, given[r])) end
  local seeds = cfg.seeds or 1
  local seed0 = cfg.seed or 0
  local out = { problem = problem.name, recipes = recipes, runs = {}, rows = {}, seeds = seeds, skipped = skipped }
  local index, total = 0, #recipes * seeds
  for _, r in ipairs(recipes) do
    local runs = {}
    out.runs[r.name] = runs
    local row = { recipe = r.name, seeds = seeds, vals = {}, finals = {}, bests = {}, accs = {}, secs = {}, rates = {} }
    for k = 0, seeds - 1 do
      index = index + 1
      if cfg.on_run then cfg.on_run(r.name, seed0 + k, index, total) end
      local rc = {}
      for key, v in pairs(cfg) do if run_keys[key] then rc[key] = v end end
      rc.recipe, rc.recipe_options, rc.seed = r, given[r], seed0 + k
      local ok, res = pcall(E.run, rc)
      if not ok then
        row.failed = tostring(res)
        if cfg.on_fail then cfg.on_fail(r.name, seed0 + k, row.failed) end
        break
      end
      -- keep the numbers, not the model and its optimizer: the next run needs the (device) memory
      res.opt, res.instance = nil, nil
      full_collect()
      runs[#runs + 1] = res
      if res.diverged then row.diverged = res.diverged end
      if res.val_loss then row.vals[#row.vals + 1] = res.val_loss end
      if res.final_loss then row.finals[#row.finals + 1] = res.final_loss end
      if res.best_loss then row.bests[#row.bests + 1] = res.best_loss end
      if res.val_accuracy then row.accs[#row.accs + 1] = res.val_accuracy end
      row.secs[#row.secs + 1] = res.seconds
      row.rates[#row.rates + 1] = res.steps_per_s
      row.state_bytes = res.state_bytes
      row.describe = res.describe
      row.device = res.device
    end
    row.seeds = #runs   -- the seeds that ran to the end (a failed run stops its recipe's seeds)
    row.val_loss, row.val_spread = mean(row.vals), spread(row.vals)
    row.final_loss, row.best_loss, row.val_accuracy = mean(row.finals), mean(row.bests), mean(row.accs)
    row.seconds, row.steps_per_s = mean(row.secs), mean(row.rates)
    out.rows[#out.rows + 1] = row
  end
  table.sort(out.rows, function(a, b)
    local va, vb = (a.failed or a.diverged) and math.huge or (a.val_loss or math.huge), (b.failed or b.diverged) and math.huge or (b.val_loss or math.huge)
    return va < vb
  end)
  return out
end

--- Seconds for people: "0.42 s", "12.3 s", "2:05".
function E.format_seconds(s)
  if s < 10 then return ("%.2f s"):format(s) end
  if s < 120 then return ("%.1f s"):format(s) end
  return ("%d:%02d"):format(math.floor(s / 60), math.floor(s % 60))
end

--- The comparison table as text, and a sentence on best versus worst.
function E.format_table(cmp)
  local lines = {}
  local multi = cmp.seeds > 1
  lines[1] = ("%-12s %-18s %-10s %-10s %-8s %-10s %-9s %s"):format("recipe",
    multi and ("val loss (±range)") or "val loss", "final", "best", "val acc", "time/run", "steps/s", "state bytes")
  for _, r in ipairs(cmp.rows) do
    if r.failed then
      lines[#lines + 1] = ("%-12s failed: %s"):format(r.recipe, r.failed)
    else
      local val = r.diverged and ("diverged @" .. r.diverged)
        or (r.val_loss and (multi and ("%.4f ±%.4f"):format(r.val_loss, r.val_spread) or ("%.4f"):format(r.val_loss)) or "-")
      lines[#lines + 1] = ("%-12s %-18s %-10s %-10s %-8s %-10s %-9s %d"):format(r.recipe, val,
        r.final_loss and ("%.4f"):format(r.final_loss) or "-", r.best_loss and ("%.4f"):format(r.best_loss) or "-",
        r.val_accuracy and ("%.4f"):format(r.val_accuracy) or "-", E.format_seconds(r.seconds or 0),
        ("%.1f"):format(r.steps_per_s or 0), r.state_bytes or 0)
    end
  end
  -- best against worst, measured against the seed-to-seed spread
  local ok = {}
  for _, r in ipairs(cmp.rows) do if not r.failed and not r.diverged and r.val_loss then ok[#ok + 1] = r end end
  local verdict
  if #ok >= 2 then
    local best, worst = ok[1], ok[#ok]
    local diff = worst.val_loss - best.val_loss
    -- (a relative difference only against a best loss above 0: 0 would print inf% or nan%)
    verdict = ("best: %s, validation loss %.4f; worst: %s, %.4f (+%.4f%s)"):format(best.recipe, best.val_loss,
      worst.recipe, worst.val_loss, diff, best.val_loss > 0 and (", %.1f%%"):format(100 * diff / best.val_loss) or "")
    if multi then
      local s = math.max(best.val_spread, worst.val_spread)
      verdict = verdict .. (s > 0 and ("; the difference is %.1fx the larger seed-to-seed range (%.4f over %d seeds)")
        :format(diff / s, s, cmp.seeds) or "; no seed-to-seed variation")
    else
      verdict = verdict .. " (one seed: --seeds 3 measures the seed-to-seed range)"
    end
  elseif #ok == 1 then
    verdict = ("only %s finished"):format(ok[1].recipe)
  end
  return table.concat(lines, "\n"), verdict
end

return E
