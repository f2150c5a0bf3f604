--[[
moonstep.problems -- the built-in training problems of `moonstep train` and `moonstep compare`: one module
each (lsq, mlp, lm), written on the public tensor ops with hand-written backward passes, so every problem
runs on every backend.

A problem module is a table:
  name, summary            what `moonstep train --help` lists
  options                  specs in the recipe format ({default=, type=, min=, doc=}), checked the same way
  defaults                 {steps=, eval_every=, schedule=, warmup=, clip=, log_plot=}: how train/compare run it
  recipe_options           {recipe name = {option = value}}: starting points for known recipes on this problem
  new(options, env)        env = {ctx=, dtype=, seed=} -> an instance:
    params                 {name=, param=, grad=, tags=} entries for ms.optim (realistic names, so routing applies)
    train_batch(step)      the batch of a step, a function of (seed, step) only: resumed runs see the same data
    loss_grad(batch)       the loss (a number); gradients written into the params' grad buffers
    loss(batch)            the loss alone
    evaluate()             {loss=, accuracy=?} on held-out data
    describe()             one line for humans

  local problems = require("moonstep.problems")
  local inst = problems.new("lm", {width = 128}, {device = "cpu", seed = 1})
]]
local ms = require("moonstep")
local R = require("moonstep.recipe")

local M = {}

M.names = { "lsq", "mlp", "lm" }

--- The problem module called `name`; errors list the known ones.
function M.get(name)
  for _, n in ipairs(M.names) do
    if n == name then return require("moonstep.problems." .. name) end
  end
  error(("unknown problem '%s' (known: %s)"):format(tostring(name), table.concat(M.names, ", ")), 0)
end

-- A problem module from a name or the module itself; anything else is named (it failed inside, as "attempt to
-- index a number")
local function resolve(what, problem)
  if type(problem) == "string" then return M.get(problem) end
  if type(problem) ~= "table" or type(problem.name) ~= "string" or type(problem.options) ~= "table" then
    error(("%s: problem must be a problem name or module (got %s)"):format(what,
          require("moonstep.core").show(problem)), 0)
  end
  return problem
end

--- The problem's options: given values checked against its specs (unknown names refused), defaults filled.
function M.options(problem, given)
  problem = resolve("problems.options", problem)
  if given ~= nil and type(given) ~= "table" then
    error(("%s: the problem options must be a table (got %s)"):format(problem.name, require("moonstep.core").show(given)), 0)
  end
  require("moonstep.core").check_keys(problem.name, given or {}, problem.options, 0, "problem option")
  local out = {}
  for k, v in pairs(given or {}) do out[k] = R.check_option(problem.name, k, problem.options[k], v) end
  for k, spec in pairs(problem.options) do
    if out[k] == nil then out[k] = spec.default end
  end
  return out
end

local ENV_KEYS = { device = true, ctx = true, dtype = true, seed = true }

--- A problem instance: problems.new(name_or_module, options, {device=|ctx=, dtype="f32", seed=0})
function M.new(problem, given, env)
  problem = resolve("problems.new", problem)
  env = env or {}
  if type(env) ~= "table" then error(("problems.new: env must be a table (got %s)"):format(require("moonstep.core").show(env)), 0) end
  -- (a misspelt key would build the instance with the default silently; a bad dtype used to be read as a device)
  require("moonstep.core").check_keys("problems.new", env, ENV_KEYS, 0, "environment key")
  local dtype = require("moonstep.tensor").norm_dtype(env.dtype, 0)
  local ctx = env.ctx or ms.device(env.device)
  local seed = env.seed or 0
  if type(seed) ~= "number" or seed < 0 or seed ~= math.floor(seed) or seed == math.huge then
    error("seed must be a non-negative integer (got " .. tostring(seed) .. ")", 0)
  end
  local inst = problem.new(M.options(problem, given), { ctx = ctx, dtype = dtype, seed = seed })
  inst.problem = problem
  return inst
end

--- The options documentation of a problem, one line per option.
function M.doc(problem)
  problem = resolve("problems.doc", problem)
  local names = {}
  for n in pairs(problem.options) do names[#names + 1] = n end
  table.sort(names)
  local lines = {}
  for _, n in ipairs(names) do
    local s = problem.options[n]
    lines[#lines + 1] = ("    --%-14s %-8s default %-8s %s"):format(n:gsub("_", "-"), s.type,
      s.default == "" and '""' or tostring(s.default), s.doc or "")
  end
  return table.concat(lines, "\n")
end

return M
