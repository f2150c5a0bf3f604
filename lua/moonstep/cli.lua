--[[
moonstep.cli -- the `moonstep` command.  The C host (engine/host/main.c) sets up the Lua state and hands
its arguments to M.main, which returns the exit status: 0 success, 1 a failure while running, 2 a usage
error (unknown command or flag, a bad value, a bad --opt key or value, a script or recipe that is not there,
a resume folder that is no checkpoint or contradicts the command line).

Each subcommand is an entry of M.commands: name, one-line summary, help text, run(argv).  Flags are
declared per command (see `parse`); a problem's options become flags of train/compare once --problem names
it (`moonstep train --problem lm --width 512`).
]]
local ms = require("moonstep")
local ffi = require("ffi")
local core = require("moonstep.core")

local M = {}

-- ---------------------------------------------------------------------------------------------------
-- errors and output
-- ---------------------------------------------------------------------------------------------------
local Usage = {}
Usage.__tostring = function(e) return e.msg end

--- Raises a usage error: printed as "moonstep: msg", exit status 2.
local function usage_error(msg, cmd)
  error(setmetatable({ msg = msg, cmd = cmd }, Usage), 0)
end
M.usage_error = usage_error

pcall(ffi.cdef, "int isatty(int fd);")
local function stdout_is_tty() return ffi.C.isatty(1) == 1 end

local function out(...) io.stdout:write(...) end
local function outln(s) io.stdout:write(s or "", "\n") io.stdout:flush() end

-- ---------------------------------------------------------------------------------------------------
-- flags
-- ---------------------------------------------------------------------------------------------------
-- A flag spec: {name = "steps", arg = "N", type = "integer"|"number"|"string"|"boolean", many = true,
-- doc = "...", min = n, max = n}.  Values come as "--name value" or "--name=value"; "-h"/"--help" is always
-- known.  A string flag's value is never empty (an empty path or name named nothing, and ran as if not given).
local function convert(cmd, f, v)
  if f.type == "integer" or f.type == "number" then
    local n = tonumber(v)
    -- tonumber reads "inf" and "nan" (and "1e999" as inf), and hexadecimal ("0x10" as 16): no flag means any
    if n ~= nil and (n ~= n or n == math.huge or n == -math.huge or v:match("^%s*[-+]?0[xX]")) then n = nil end
    if n == nil or (f.type == "integer" and n ~= math.floor(n)) then
      usage_error(("--%s: %s is not %s"):format(f.name, ("%q"):format(v), f.type == "integer" and "an integer" or "a number"), cmd)
    end
    -- a double holds integers exactly only below 2^53: "9007199254740993" would silently read as ...992
    if f.type == "integer" and math.abs(n) >= 2 ^ 53 then
      usage_error(("--%s: %s is not below 2^53, the largest integer a flag holds exactly"):format(f.name, v), cmd)
    end
    if f.min and n < f.min then usage_error(("--%s: %s is below the minimum %s"):format(f.name, v, tostring(f.min)), cmd) end
    if f.max and n > f.max then usage_error(("--%s: %s is above the maximum %s"):format(f.name, v, tostring(f.max)), cmd) end
    return n
  end
  if f.type ~= "boolean" and v == "" then usage_error(("--%s: the value is empty"):format(f.name), cmd) end
  return v
end

--- Parses argv (a Lua array) against flag specs.  Returns values {name = value or {values...}} and the
--- positional arguments; stops at the first positional when stop_at_positional (a script's own flags).
function M.parse(cmd, argv, flags, stop_at_positional)
  local by_name = {}
  for _, f in ipairs(flags) do by_name[f.name] = f end
  local vals, pos = {}, {}
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "-h" or a == "--help" then
      vals.help = true
    elseif a == "--" then
      for j = i + 1, #argv do pos[#pos + 1] = argv[j] end
      break
    elseif a:sub(1, 2) == "--" then
      local name, value = a:match("^%-%-([^=]+)=(.*)$")
      name = name or a:sub(3)
      local f = by_name[name] or by_name[name:gsub("_", "-")]
      if not f then usage_error(("unknown flag '--%s' for 'moonstep %s'"):format(name, cmd), cmd) end
      if f.type == "boolean" then
        if value ~= nil then usage_error(("--%s takes no value"):format(f.name), cmd) end
        value = true
      elseif value == nil then
        i = i + 1
        value = argv[i]
        if value == nil then usage_error(("--%s needs a value (%s)"):format(f.name, f.arg or "VALUE"), cmd) end
      end
      value = convert(cmd, f, value)
      local key = f.key or f.name
      if f.many then
        vals[key] = vals[key] or {}
        table.insert(vals[key], value)
      else
        vals[key] = value
      end
    elseif a:sub(1, 1) == "-" and #a > 1 then
      usage_error(("unknown flag '%s' for 'moonstep %s'"):format(a, cmd), cmd)
    else
      if stop_at_positional then
        for j = i, #argv do pos[#pos + 1] = argv[j] end
        break
      end
      pos[#pos + 1] = a
    end
    i = i + 1
  end
  return vals, pos
end

local function flag_help(flags)
  local lines = {}
  for _, f in ipairs(flags) do
    local left = "--" .. f.name .. (f.arg and (" " .. f.arg) or "")
    lines[#lines + 1] = ("  %-24s %s"):format(left, f.doc or "")
  end
  return table.concat(lines, "\n")
end

-- ---------------------------------------------------------------------------------------------------
-- running Lua code: scripts and -e
-- ---------------------------------------------------------------------------------------------------
-- errors of user code (scripts, -e) carry their traceback; the command's own errors are messages for
-- people (MOONSTEP_TRACEBACK=1 adds the traceback to those too, for debugging moonstep itself)
local function traceback(e)
  if getmetatable(e) == Usage then return e end
  return debug.traceback(tostring(e), 2)
end
-- a benchmark's message raised without a position (error(msg, 0): its own word on its arguments or the machine)
-- comes without a traceback; any other error of it with one
local function bench_traceback(e)
  if type(e) == "string" and not e:match("^[^\n]-:%d+: ") then return e end
  return traceback(e)
end
local function message(e)
  if getmetatable(e) == Usage then return e end
  if not os.getenv("MOONSTEP_TRACEBACK") then return (core.strip_own_position(e)) end
  return debug.traceback(tostring(e), 2)
end

-- a script that is not there is a usage error (status 2); one that fails is its own failure (status 1)
local function check_script(path, cmd)
  local f, err = io.open(path, "r")
  if not f then usage_error(("cannot read the script '%s' (%s)"):format(path, (tostring(err):match(":%s*([^:]*)$") or tostring(err))), cmd) end
  f:close()
end

--- Runs a script file with its arguments (in `arg`, as luajit does, and as the chunk's varargs); handler: its
--- errors' message handler (default: with a traceback).
function M.run_script(path, args, handler)
  local chunk, err = loadfile(path)
  if not chunk then error(err, 0) end
  local a = { [0] = path }
  for i, v in ipairs(args) do a[i] = v end
  _G.arg = a
  local ok, e = xpcall(function() return chunk(unpack(args)) end, handler or traceback)
  if not ok then error(e, 0) end
end

-- ---------------------------------------------------------------------------------------------------
-- commands
-- ---------------------------------------------------------------------------------------------------
M.commands = {}
local by_name = {}
local function command(c)
  M.commands[#M.commands + 1] = c
  by_name[c.name] = c
end

local function show_help(c, extra)
  outln(c.help)
  if c.flags and #c.flags > 0 then outln("\nflags:\n" .. flag_help(c.flags)) end
  if extra then outln(extra) end
end

-- repl ------------------------------------------------------------------------------------------------
command {
  name = "repl",
  summary = "interactive prompt with `ms` loaded (the default without arguments)",
  help = [=[usage: moonstep repl

An interactive Lua prompt with `ms` (the moonstep module) loaded: line editing and history (readline;
the history is kept in ~/.moonstep_history, or MOONSTEP_HISTORY, "" for none), results printed (tensors
pretty-printed, tables shown), errors shown without leaving.  Unfinished statements continue on the next
line.  Also defined: `problems` (moonstep.problems) and `experiment` (moonstep.experiment: experiment.run{...}).

prompt commands:
  :reload [NAME]   re-read recipe files loaded in this session (all, or the one called NAME) and update
                   them in place: optimizers made with them run the new code from their next step
  :recipes         recipes loaded in this session, with their files and hashes
  :help            this list
  :quit            leave (Ctrl-D too)]=],
  flags = {},
  run = function(argv)
    local vals, pos = M.parse("repl", argv, {})
    if vals.help then show_help(by_name.repl) return 0 end
    if #pos > 0 then usage_error("repl takes no arguments (got '" .. pos[1] .. "')", "repl") end
    require("moonstep.repl").run()
    return 0
  end,
}

-- run ---------------------------------------------------------------------------------------------------
command {
  name = "run",
  summary = "run a Lua script: moonstep run FILE.lua [args...]",
  help = [=[usage: moonstep run FILE.lua [args...]
       moonstep FILE.lua [args...]

Runs a Lua script with `ms` loaded.  The script's arguments are in `arg` (arg[0] is the script) and in
`...`, as with luajit.  An error prints its traceback and exits with status 1.]=],
  run = function(argv)
    local vals, pos = M.parse("run", argv, {}, true)
    -- (--help before the script: `moonstep help run x.lua` must not run x.lua; after it, --help is the script's)
    if vals.help then show_help(by_name.run) return 0 end
    if #pos == 0 then usage_error("run needs a script: moonstep run FILE.lua [args...]", "run") end
    local args = {}
    for i = 2, #pos do args[#args + 1] = pos[i] end
    check_script(pos[1], "run")
    M.follow_launcher()
    M.run_script(pos[1], args)
    return 0
  end,
}

-- train and compare: shared flags -------------------------------------------------------------------------
local problems = require("moonstep.problems")

local problem_flag = { name = "problem", arg = "P", doc = "the problem: " .. table.concat(problems.names, ", ") }
local common_flags = {
  { name = "steps", arg = "N", type = "integer", min = 1, doc = "optimizer steps (default: the problem's)" },
  { name = "device", arg = "D", doc = "cpu, cuda, cuda:N (default: the best found, ms.best_device(); under --resume, the device the checkpoint ran on where it is usable)" },
  { name = "eval-every", key = "eval_every", arg = "N", type = "integer", min = 1, doc = "validation interval in steps (default: the problem's)" },
  { name = "schedule", arg = "KIND", doc = "learning-rate schedule: constant, cosine, linear_warmup, wsd (default: the problem's)" },
  { name = "warmup", arg = "N", type = "integer", min = 0, doc = "warmup steps of the schedule (default: the problem's)" },
  { name = "clip", arg = "X", type = "number", min = 0, doc = "global gradient-norm clipping, 0 = off (default: the problem's)" },
  { name = "threads", arg = "N", type = "integer", min = 0, max = 4096, doc = "CPU threads (default 1: faster for these small matrices; 0 = OpenMP's default)" },
  { name = "trusted", type = "boolean", doc = "run recipe files unsandboxed (full Lua: io, os, ffi)" },
}

-- the concatenation of flag lists
local function with(...)
  local t = {}
  for _, list in ipairs { ... } do
    for _, f in ipairs(list) do t[#t + 1] = f end
  end
  return t
end

-- the value of --NAME in argv, if any, before the parse (problem options become flags once the problem is
-- known: from --problem, or from the checkpoint of --resume); the last one, as for every other flag
local function find_flag(argv, flag)
  local found
  for i, a in ipairs(argv) do
    if a == "--" .. flag then found = argv[i + 1] end
    found = a:match("^%-%-" .. flag .. "=(.*)$") or found
  end
  return found
end

-- the problem named by --problem, else `default` (the checkpoint's), and its options as flags
local function problem_flags(cmd, argv, default)
  local name = find_flag(argv, "problem") or default
  if not name then return nil, {} end
  local ok, p = pcall(problems.get, name)
  if not ok then usage_error(tostring(p), cmd) end
  local flags = {}
  local names = {}
  for n in pairs(p.options) do names[#names + 1] = n end
  table.sort(names)
  for _, n in ipairs(names) do
    local spec = p.options[n]
    flags[#flags + 1] = { name = n:gsub("_", "-"), key = "popt:" .. n, arg = spec.type == "string" and "S" or "X", doc = spec.doc }
  end
  return p, flags
end

-- A recipe that is not there (no such file, no built-in of that name) is a usage error; one that is there
-- and fails to load (a sandbox refusal, a syntax error) is a failure of its code, status 1.
-- (`from` names where a recipe not given on the command line came from)
local function check_recipe_found(cmd, spec, from)
  local msg
  if spec:find("/", 1, true) or spec:find("%.lua$") then
    local f, err = io.open(spec, "rb")
    -- (a folder opens, and its read fails)
    local ok, rerr = true, nil
    if f then ok, rerr = f:read(0), select(2, f:read(0)) f:close() end
    if not f then msg = ("cannot read recipe %s: %s"):format(spec, tostring(err))
    elseif ok == nil and rerr then msg = ("cannot read recipe %s: %s"):format(spec, tostring(rerr)) end
  else
    local okf, path, why = pcall(require("moonstep.recipe").find, spec)
    if not okf or not path then msg = okf and why or path end
  end
  if msg and from then msg = ("%s; name the recipe with --recipe"):format(from .. msg) end
  if msg then usage_error(msg, cmd) end
end

-- the recipe options of --opt (key=value assignments) for each of `recipes`, checked as the run would check
-- them: a key no recipe has, or a value its recipe refuses, is a usage error (found before any run)
local function checked_options(cmd, problem, recipes, assignments)
  local E = require("moonstep.experiment")
  local ok, given = pcall(E.distribute_options, recipes, assignments)
  if not ok then usage_error(given, cmd) end
  for _, r in ipairs(recipes) do
    local okr, err = pcall(require("moonstep.recipe").options, r, E.recipe_options(problem, r, given[r]))
    if not okr then usage_error(err, cmd) end
  end
  return given
end

-- "key=value" or "recipe.key=value" -> {recipe =, key =, value =}
local function parse_assignment(cmd, s)
  local lhs, value = s:match("^([^=]+)=(.*)$")
  if not lhs then usage_error(("--opt %s: expected key=value (or recipe.key=value)"):format(s), cmd) end
  local recipe, key = lhs:match("^(.+)%.([%w_]+)$")
  return { recipe = recipe, key = key or lhs, value = value }
end

-- the run configuration shared by train and compare, from parsed flags
local function run_config(cmd, vals, problem, saved_device)
  local popts = {}
  for k, v in pairs(vals) do
    local n = type(k) == "string" and k:match("^popt:(.*)$")
    if n then popts[n] = v end
  end
  local ok, err = pcall(problems.options, problem, popts)
  if not ok then usage_error(err, cmd) end
  if vals.schedule then
    local known = false
    for _, s in ipairs(require("moonstep.experiment").schedules) do known = known or s == vals.schedule end
    if not known then usage_error(("--schedule: unknown schedule '%s' (constant, cosine, linear_warmup, wsd)"):format(vals.schedule), cmd) end
  end
  local function open(device)
    return pcall(function()
      if device == "cpu" then return ms.context { device = "cpu", num_threads = vals.threads or 1 } end
      return ms.device(device)
    end)
  end
  local device, okd, ctx = vals.device, nil, nil
  if not device and saved_device then
    -- a resumed run continues where it ran, unless that device is not here (a checkpoint moved to another machine)
    okd, ctx = open(saved_device)
    if okd then device = saved_device
    else outln(("note: the checkpoint ran on %s, which is not usable here; running on %s"):format(saved_device,
                                                                                                 ms.best_device())) end
  end
  if not okd then
    device = device or ms.best_device()
    okd, ctx = open(device)
  end
  -- (without the Lua position ms.device's error carries: the engine's message names the problem)
  if not okd then usage_error(("--device %s: %s"):format(device, (tostring(ctx):gsub("^[^\n]-%.lua:%d+: ", ""))), cmd) end
  return {
    problem = problem, problem_options = popts, steps = vals.steps, ctx = ctx, eval_every = vals.eval_every,
    schedule = vals.schedule, warmup = vals.warmup, clip = vals.clip, trusted = vals.trusted,
  }
end

local function fmt_time(s)
  if s ~= s or s == math.huge then return "?" end
  s = math.floor(s + 0.5)
  if s >= 3600 then return ("%d:%02d:%02d"):format(math.floor(s / 3600), math.floor((s % 3600) / 60), s % 60) end
  return ("%d:%02d"):format(math.floor(s / 60), s % 60)
end

--- A progress reporter: a live line on a terminal (rewritten at most ten times a second), plain lines at
--- each validation otherwise.  Returns the on_step / on_eval callbacks and finish().
function M.progress(total, opts)
  opts = opts or {}
  local E = require("moonstep.experiment")
  local tty = opts.tty
  if tty == nil then tty = stdout_is_tty() end
  local t_start, last_draw = E.clock(), -1
  local ema, val, acc, first_step
  local alpha, seen = 2 / (math.max(1, math.floor(total / 20)) + 1), 0
  local p = {}
  local function line(step)
    -- the rate counts from the end of the first step (building the problem is not training)
    local el = E.clock() - t_start
    local done = step - (first_step or step)
    local rate = done > 0 and done / math.max(el, 1e-9) or 0
    return ("  step %d/%d  loss %.4f%s%s  %.1f steps/s  ETA %s"):format(step, total, ema or 0,
      val and ("  val %.4f"):format(val) or "", acc and ("  acc %.4f"):format(acc) or "", rate,
      rate > 0 and fmt_time((total - step) / rate) or "?")
  end
  -- while the live line is drawn, Ctrl-C ends it before the process dies (the host's SIGINT handler: the
  -- shell's next output started on the line); absent when moonstep runs inside another host
  local okc, config = pcall(require, "moonstep.config")
  local sigint_newline = okc and type(config) == "table" and config.sigint_newline or function() end
  function p.on_step(step, loss)
    if not first_step then first_step, t_start = step, E.clock() end
    -- (over the steps seen while they are fewer than the window: from the first loss alone, a 5% window of a
    -- long run showed about the initial loss for thousands of steps)
    seen = seen + 1
    ema = ema and (ema + math.max(alpha, 2 / (seen + 1)) * (loss - ema)) or loss
    if tty then
      local now = E.clock()
      if now - last_draw >= 0.1 or step == total then
        if last_draw < 0 then sigint_newline(true) end
        out("\r\27[K", line(step))
        io.stdout:flush()
        last_draw = now
      end
    end
  end
  function p.on_eval(step, ev)
    val, acc = ev.loss, ev.accuracy
    if not tty then outln(line(step)) end
  end
  function p.finish()
    if tty then out("\r\27[K") io.stdout:flush() sigint_newline(false) end
  end
  return p
end

-- train ---------------------------------------------------------------------------------------------------
local train_flags = with({ problem_flag }, {
  { name = "recipe", arg = "R", doc = "a built-in recipe name (adamw, ...) or a recipe file (sandboxed unless --trusted)" },
  { name = "opt", arg = "KEY=VALUE", many = true, doc = "a recipe option (repeatable), e.g. --opt lr=3e-4 --opt betas=0.9,0.95" },
  { name = "seed", arg = "S", type = "integer", min = 0, doc = "seed of the data, the initial weights and the batches (default 0)" },
  { name = "save", arg = "DIR", doc = "write a checkpoint folder at the end (model.safetensors + optim.safetensors); one holding another run's checkpoint is refused unless --force" },
  { name = "resume", arg = "DIR", doc = "continue from a checkpoint folder (unset options, the problem and the recipe come from it)" },
  { name = "force", type = "boolean", doc = "resume even when the checkpoint was made by another recipe (or version), or with another schedule (--steps, --schedule, --warmup, --clip); --save over another run's checkpoint" },
  { name = "until", key = "stop_after", arg = "N", type = "integer", min = 1, doc = "stop after step N; the schedule still spans --steps (to split a run)" },
}, common_flags)

local function problem_list()
  local lines = { "problems:" }
  for _, n in ipairs(problems.names) do
    local p = problems.get(n)
    lines[#lines + 1] = ("  %-5s %s"):format(n, p.summary)
  end
  lines[#lines + 1] = "(moonstep train --problem NAME --help shows the problem's own flags)"
  return table.concat(lines, "\n")
end

local function problem_help(p)
  if not p then return "\n" .. problem_list() end
  local d = p.defaults or {}
  return ("\nflags of problem %s (%s):\n%s\nits defaults: %d steps, validation every %d, schedule %s, warmup %d, clip %s")
    :format(p.name, p.summary, problems.doc(p), d.steps or 100, d.eval_every or 10, d.schedule or "constant",
            d.warmup or 0, d.clip and tostring(d.clip) or "off")
end

command {
  name = "train",
  summary = "train a built-in problem with a recipe",
  help = [=[usage: moonstep train --problem P --recipe R [--opt key=value ...] [--steps N] [--device D]
                      [--seed S] [--save DIR] [--resume DIR] [--trusted] [--force] [problem flags]
       moonstep train --resume DIR [--steps N] [--save DIR] ...

Trains problem P with recipe R and prints a summary: the training loss (its moving average over 5% of
the run, final and best), the validation loss, time, and the optimizer's state bytes.  A live progress
line on a terminal (step, loss, steps/s, ETA); plain lines at each validation otherwise.

A recipe given as a file (path/to/model/optim.lua) runs sandboxed unless --trusted.  The checkpoint
records the problem, the recipe (its name, its file's path for a file, its content hash), the run's
settings and its device: --resume DIR alone continues that run, with that problem, recipe and device (a
recipe file sandboxed unless --trusted, as ever; a device not usable here gives way to the best one).  Resuming as another problem is refused; under another recipe, or with --steps,
--schedule, --warmup or --clip that change the run's learning-rate schedule or clipping, unless --force.  Starting
points for the known recipes' options come from the problem; --opt overrides them.]=],
  flags = train_flags,
  run = function(argv)
    local E = require("moonstep.experiment")
    -- a resumed run's problem (its flags with it) and recipe are the checkpoint's unless given; given, what
    -- contradicts the checkpoint is refused (E.resume_config, below)
    local resume_dir, saved = find_flag(argv, "resume"), nil
    if resume_dir then
      local ok, info = pcall(E.checkpoint_info, resume_dir)
      if ok then saved = info
      else
        -- (`train --resume DIR --help` still shows the help)
        local help = false
        for _, a in ipairs(argv) do help = help or a == "-h" or a == "--help" end
        if not help then usage_error(info, "train") end
      end
    end
    local problem, pflags = problem_flags("train", argv, saved and saved.problem)
    local flags = with(train_flags, pflags)
    local vals, extra = M.parse("train", argv, flags)
    if vals.help then show_help({ help = by_name.train.help, flags = flags }, problem_help(problem)) return 0 end
    if #extra > 0 then usage_error(("train takes flags only (got '%s')"):format(extra[1]), "train") end
    if not problem then usage_error("train needs --problem (" .. table.concat(problems.names, ", ") .. ")", "train") end
    local spec, from = vals.recipe, nil
    if not spec and saved then
      -- a recipe file by the path the checkpoint recorded; --trusted is not recorded: the folder cannot grant it
      spec = saved.recipe_file or saved.recipe
      from = ("%s: the checkpoint's recipe: "):format(resume_dir)
      if not spec then usage_error(("%s: the checkpoint does not name its recipe; name it with --recipe"):format(resume_dir), "train") end
    end
    if not spec then usage_error("train needs --recipe (a name such as adamw, or a recipe file)", "train") end
    local cfg = run_config("train", vals, problem, saved and saved.device)
    check_recipe_found("train", spec, from)
    local recipe = E.recipe(spec, vals.trusted)
    local assignments = {}
    for _, s in ipairs(vals.opt or {}) do assignments[#assignments + 1] = parse_assignment("train", s) end
    cfg.recipe = recipe
    cfg.recipe_options = checked_options("train", problem, { recipe }, assignments)[recipe]
    cfg.seed, cfg.save, cfg.resume, cfg.force, cfg.stop_after = vals.seed, vals.save, vals.resume, vals.force, vals.stop_after
    local total = cfg.steps
    if cfg.resume then
      -- a checkpoint that is not one, or that the command line contradicts, is refused before the run starts
      local okr, merged = pcall(E.resume_config, cfg, problem)
      if not okr then usage_error(merged, "train") end
      total = merged.steps
    end
    -- another run's checkpoint is not overwritten unless --force (the one resumed is: that run, continued)
    if cfg.save and not cfg.force then
      local held = false
      for _, f in ipairs { "/model.safetensors", "/optim.safetensors" } do
        local h = io.open(cfg.save .. f, "rb")
        if h then h:close() held = true end
      end
      if held and not (cfg.resume and E.realpath(cfg.save) == E.realpath(cfg.resume)) then
        usage_error(("--save %s: the folder holds the checkpoint of another run; pass --force to overwrite it, or --save another folder")
          :format(cfg.save), "train")
      end
    end
    total = total or (problem.defaults or {}).steps or 100
    local prog = M.progress(total)
    cfg.on_step, cfg.on_eval = prog.on_step, prog.on_eval
    outln(("train %s with %s on %s%s"):format(problem.name, recipe.name, cfg.ctx:name(),
      cfg.resume and (" (resuming " .. cfg.resume .. ")") or ""))
    local ok, r = pcall(E.run, cfg)
    prog.finish()
    if not ok then error(r, 0) end
    outln("  " .. r.describe)
    local opts = {}
    for k, v in pairs(r.recipe_options) do
      opts[#opts + 1] = k .. "=" .. (type(v) == "table" and table.concat(v, ",") or tostring(v))
    end
    table.sort(opts)
    outln(("  recipe %s (hash %s): %s"):format(r.recipe, r.recipe_hash, table.concat(opts, " ")))
    local done = r.steps_done - r.start_step + 1
    if done <= 0 then
      outln(("  nothing to do: the checkpoint is at step %d of %d"):format(r.steps_done, r.steps))
    elseif r.diverged then
      outln(("  diverged at step %d (loss is not finite)"):format(r.diverged))
    else
      outln(("  steps %d-%d of %d in %s (%.1f steps/s)"):format(r.start_step, r.steps_done, r.steps, E.format_seconds(r.seconds), r.steps_per_s))
      outln(("  train loss  final %.4f  best %.4f  (moving average over %d steps)"):format(r.final_loss, r.best_loss, r.smooth))
      if r.val_loss then
        outln(("  val loss    %.4f%s"):format(r.val_loss, r.val_accuracy and ("  (accuracy %.4f)"):format(r.val_accuracy) or ""))
      end
    end
    outln(("  optimizer state %d bytes (%d parameters in %d groups)"):format(r.state_bytes, #r.info.params, #r.info.groups))
    if r.saved then outln("  checkpoint " .. r.saved .. "/") end
    if r.diverged then return 1 end
    return 0
  end,
}

-- compare -------------------------------------------------------------------------------------------------
local compare_flags = with({ problem_flag }, {
  { name = "recipes", arg = "a,b,c", doc = "recipes to compare: names or files, comma-separated" },
  { name = "opt", arg = "[R.]KEY=VALUE", many = true, doc = "a recipe option for every recipe that has it, or for recipe R only (repeatable)" },
  { name = "seed", arg = "S", type = "integer", min = 0, doc = "first seed (default 0)" },
  { name = "seeds", arg = "K", type = "integer", min = 1, doc = "seeds per recipe: S .. S+K-1 (default 1)" },
  { name = "out", arg = "DIR", doc = "output folder (default runs/<problem>)" },
  { name = "plotter", arg = "P", doc = "auto (gnuplot when installed), gnuplot, builtin (SVG only)" },
  { name = "skip-missing", key = "skip_missing", type = "boolean", doc = "leave out recipes that cannot be found or loaded (make run: whichever of sinkgd, adamw, dash exist)" },
}, common_flags)

command {
  name = "compare",
  summary = "train a problem with several recipes and plot their loss curves",
  help = [=[usage: moonstep compare --problem P --recipes a,b,c [--steps N] [--out DIR] [--seeds K]
                        [--opt [recipe.]key=value ...] [--device D] [problem flags]

Trains problem P once per recipe and seed, from the same initial weights and the same batches, then
prints a table (sorted by validation loss: validation loss, its range over seeds, the final and best
training loss, validation accuracy, time per run, steps/s, optimizer state bytes) and how far apart the
best and the worst are.  Writes to DIR: loss.csv (every step of every run), summary.csv, summary.txt, and
the loss curves as loss.png and loss.svg (gnuplot; without it the SVG alone, drawn by moonstep).]=],
  flags = compare_flags,
  run = function(argv)
    local problem, pflags = problem_flags("compare", argv)
    local flags = with(compare_flags, pflags)
    local vals, extra = M.parse("compare", argv, flags)
    if vals.help then show_help({ help = by_name.compare.help, flags = flags }, problem_help(problem)) return 0 end
    if #extra > 0 then usage_error(("compare takes flags only (got '%s')"):format(extra[1]), "compare") end
    if not vals.problem then usage_error("compare needs --problem (" .. table.concat(problems.names, ", ") .. ")", "compare") end
    if not vals.recipes then usage_error("compare needs --recipes a,b,c", "compare") end
    if vals.plotter and vals.plotter ~= "auto" and vals.plotter ~= "gnuplot" and vals.plotter ~= "builtin" then
      usage_error(("--plotter: unknown plotter '%s' (auto, gnuplot, builtin)"):format(vals.plotter), "compare")
    end
    -- before the runs: a plotter found missing after them would end the command without its table
    if vals.plotter == "gnuplot" and not require("moonstep.plot").find_gnuplot() then
      error("--plotter gnuplot: gnuplot is not found (--plotter builtin draws the SVG without it)", 0)
    end
    local cfg = run_config("compare", vals, problem)
    local specs = {}
    for s in vals.recipes:gmatch("[^,]+") do specs[#specs + 1] = s end
    if #specs == 0 then usage_error("--recipes: no recipe named", "compare") end
    local seen = {}
    for _, spec in ipairs(specs) do
      if seen[spec] then usage_error(("--recipes: recipe '%s' is given twice"):format(spec), "compare") end
      seen[spec] = true
    end
    if not vals.skip_missing then
      for _, spec in ipairs(specs) do check_recipe_found("compare", spec) end
    end
    cfg.recipes, cfg.seeds, cfg.seed = specs, vals.seeds or 1, vals.seed or 0
    cfg.options = {}
    for _, s in ipairs(vals.opt or {}) do cfg.options[#cfg.options + 1] = parse_assignment("compare", s) end
    local E = require("moonstep.experiment")
    local total = cfg.steps or (problem.defaults or {}).steps or 100
    local prog
    local dir = vals.out or ("runs/" .. problem.name)
    local report = require("moonstep.report")
    cfg.on_run = function(name, seed, i, n)
      -- the output folder once the recipes and their options are checked (bad input leaves no empty
      -- folder behind) and before the first run (an unusable folder found after the runs would lose them)
      if i == 1 then report.mkdir(dir) end
      if prog then prog.finish() end
      outln(("[%d/%d] %s, seed %d"):format(i, n, name, seed))
      prog = M.progress(total)
    end
    cfg.on_step = function(...) return prog.on_step(...) end
    cfg.on_eval = function(...) return prog.on_eval(...) end
    cfg.on_fail = function(name, seed, msg)
      if prog then prog.finish() prog = nil end
      outln(("  %s failed (seed %d): %s"):format(name, seed, msg))
    end
    cfg.skip_missing = vals.skip_missing
    cfg.on_loaded = function(recipes, skipped)
      -- (a usage error raised here leaves E.compare before its first run)
      checked_options("compare", problem, recipes, cfg.options)
      -- the reason without the list of folders searched (moonstep info shows where recipes are found)
      for _, sk in ipairs(skipped) do outln(("skipping %s: %s"):format(sk.recipe, (sk.error:gsub(" %(searched .*$", "")))) end
      local names = {}
      for _, r in ipairs(recipes) do names[#names + 1] = r.name end
      outln(("compare %s on %s: %s, %d step%s, %d seed%s"):format(problem.name, cfg.ctx:name(), table.concat(names, ", "),
        total, total == 1 and "" or "s", cfg.seeds, cfg.seeds == 1 and "" or "s"))
    end
    local result = E.compare(cfg)
    if prog then prog.finish() end
    local any = result.rows[1]
    if any and any.describe then outln("  " .. any.describe) end
    local files, note = report.write(dir, result, { plotter = vals.plotter, problem = problem, ctx = cfg.ctx, steps = total })
    local text, verdict = E.format_table(result)
    outln("")
    outln(text)
    if verdict then outln(verdict) end
    outln("")
    outln("plot: " .. (files.png or files.svg))
    if files.png and files.svg then outln("      " .. files.svg) end
    outln("data: " .. files.csv .. ", " .. files.summary)
    outln("(" .. note .. ")")
    for _, row in ipairs(result.rows) do if row.failed then return 1 end end
    return 0
  end,
}

-- bench ---------------------------------------------------------------------------------------------------
local function bench_dir()
  local ok, config = pcall(require, "moonstep.config")
  local cands = {}
  if os.getenv("MOONSTEP_BENCH_DIR") then cands[#cands + 1] = os.getenv("MOONSTEP_BENCH_DIR") end
  if ok and type(config) == "table" and config.lua_dir then cands[#cands + 1] = config.lua_dir .. "/../bench" end
  local src = debug.getinfo(1, "S").source:sub(2):match("^(.*)/[^/]*$") or "."
  cands[#cands + 1] = src .. "/../../bench"
  for _, d in ipairs(cands) do
    local f = io.open(d .. "/benches.lua", "r")
    if f then f:close() return d end
  end
  return nil, cands
end

--- The benchmark registry (bench/benches.lua) and its folder.
function M.benches()
  local dir, tried = bench_dir()
  if not dir then error("no benchmarks found (looked for benches.lua in " .. table.concat(tried, ", ") .. ")", 0) end
  local list = dofile(dir .. "/benches.lua")
  return list, dir
end

command {
  name = "bench",
  summary = "run a benchmark (moonstep bench lists them)",
  help = [=[usage: moonstep bench [NAME [args...]]

Runs the benchmark NAME (a script in bench/, listed in bench/benches.lua) with its default arguments
followed by yours; without NAME, lists the benchmarks.  Benchmarks print their own tables.]=],
  run = function(argv)
    local vals, pos = M.parse("bench", argv, {}, true)
    local list, dir = M.benches()
    -- (--help before the name: `moonstep help bench core` must not run the benchmark)
    if vals.help then
      show_help(by_name.bench)
      pos = {}
    end
    if #pos == 0 then
      outln("benchmarks (moonstep bench NAME [args...]):")
      for _, b in ipairs(list) do outln(("  %-10s %s"):format(b.name, b.summary or "")) end
      return 0
    end
    local name = pos[1]
    for _, b in ipairs(list) do
      if b.name == name then
        local args = {}
        for _, a in ipairs(b.args or {}) do args[#args + 1] = a end
        for i = 2, #pos do args[#args + 1] = pos[i] end
        if b.cuda and ms.device_count("cuda") == 0 then
          error(("benchmark '%s' needs a CUDA device, and this machine has none"):format(name), 0)
        end
        M.run_script(dir .. "/" .. b.script, args, bench_traceback)
        return 0
      end
    end
    local names = {}
    for _, b in ipairs(list) do names[#names + 1] = b.name end
    usage_error(("unknown benchmark '%s' (known: %s)"):format(name, table.concat(names, ", ")), "bench")
  end,
}

-- info ----------------------------------------------------------------------------------------------------
local function read_first_line(cmd)
  local p = io.popen(cmd .. " 2>/dev/null")
  if not p then return nil end
  local s = p:read("*l")
  p:close()
  return s
end

local function meminfo()
  local f = io.open("/proc/meminfo", "r")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  local kb = s:match("MemTotal:%s*(%d+)")
  return kb and tonumber(kb) * 1024
end

local function cpu_count()
  local f = io.open("/proc/cpuinfo", "r")
  if not f then return nil end
  local n = 0
  for line in f:lines() do if line:match("^processor%s*:") then n = n + 1 end end
  f:close()
  return n
end

local function gib(b) return ("%.1f GiB"):format(b / 2 ^ 30) end

command {
  name = "info",
  summary = "version, build, backends, devices and library versions",
  help = [=[usage: moonstep info

Prints the version and build of moonstep, its backends, the devices found with their memory, where the
library, Lua modules and recipes were found, and the versions of the libraries around it.]=],
  run = function(argv)
    local vals, pos = M.parse("info", argv, {})
    if vals.help then show_help(by_name.info) return 0 end
    if #pos > 0 then usage_error("info takes no arguments", "info") end
    local core = require("moonstep.core")
    local okc, config = pcall(require, "moonstep.config")
    config = okc and type(config) == "table" and config or {}
    outln(("moonstep %s (abi %d)"):format(ms.version, ms.abi_version))
    outln("build     " .. ms.build_info)
    outln("library   " .. tostring(core.library_path or config.library or "?"))
    outln("lua       " .. (jit and (jit.version .. " (JIT " .. (jit.status() and "on" or "off") .. ", " .. jit.arch .. ")") or _VERSION)
      .. (config.lua_dir and ("; modules in " .. config.lua_dir) or ""))
    local okb, blas = pcall(function()
      pcall(ffi.cdef, "char *openblas_get_config(void);")
      -- the engine's OpenBLAS is already loaded; ffi.load returns its handle (its symbols are not global)
      return ffi.string(ffi.load("openblas").openblas_get_config())
    end)
    outln("openblas  " .. (okb and blas or "(version not available in this process)"))
    outln("readline  " .. (config.readline_version and config.readline_version or "not linked (plain line input)"))
    local gp = require("moonstep.plot").find_gnuplot()
    outln("gnuplot   " .. (gp and (read_first_line(("'%s' --version"):format(gp)) or gp) or "not found (compare draws SVG only)"))
    local names = {}
    local R = require("moonstep.recipe")
    local seen = {}
    for _, d in ipairs(R.search_path()) do
      local p = io.popen("ls '" .. d .. "' 2>/dev/null")
      for f in p:lines() do
        local n = f:match("^(.+)%.lua$")
        if n and not seen[n] then seen[n] = true names[#names + 1] = n end
      end
      p:close()
    end
    table.sort(names)
    outln("recipes   " .. table.concat(names, ", ") .. ((config.recipe_dir and config.recipe_dir ~= "") and ("  (" .. config.recipe_dir .. ")") or ""))
    outln("problems  " .. table.concat(problems.names, ", "))
    outln("devices")
    local cpu = ms.device("cpu")
    local st = cpu:mem_stats()
    local mem = meminfo()
    outln(("  cpu      %s cores%s, %s of system memory; moonstep holds %d bytes"):format(tostring(cpu_count() or "?"),
      os.getenv("OMP_NUM_THREADS") and (" (OMP_NUM_THREADS=" .. os.getenv("OMP_NUM_THREADS") .. ")") or "",
      mem and gib(mem) or "?", st.bytes_in_use))
    local n = ms.device_count("cuda")
    if not ms.build_info:find("cuda", 1, true) then
      outln("  cuda     not in this build (built without nvcc)")
    elseif n == 0 then
      outln("  cuda     no usable GPU (no device or no driver)")
    else
      -- moonstep's ABI reports what its pools hold; the totals come from nvidia-smi where it exists
      local smi = {}
      local p = io.popen("nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader 2>/dev/null")
      if p then
        for l in p:lines() do
          local i, name, total, used = l:match("^(%d+),%s*([^,]+),%s*([^,]+),%s*(.+)$")
          if i then smi[tonumber(i)] = ("%s, %s total, %s used"):format(name, total, used) end
        end
        p:close()
      end
      for i = 0, n - 1 do
        local okd, ctx = pcall(ms.device, "cuda:" .. i)
        if okd then
          local s = ctx:mem_stats()
          outln(("  cuda:%d   %s; moonstep holds %d bytes (%d cached)"):format(i, smi[i] or "memory totals unknown (no nvidia-smi)",
            s.bytes_in_use, s.bytes_cached))
        else
          outln(("  cuda:%d   cannot open: %s"):format(i, tostring(ctx)))
        end
      end
    end
    outln("best      " .. ms.best_device())
    return 0
  end,
}

-- launch --------------------------------------------------------------------------------------------------
pcall(ffi.cdef, [[
int posix_spawn(int *pid, const char *path, const void *file_actions, const void *attrp, char *const argv[],
                char *const envp[]);
int waitpid(int pid, int *status, int options);
int kill(int pid, int sig);
long readlink(const char *path, char *buf, size_t size);
int usleep(unsigned int usec);
long sysconf(int name);
extern char **environ;
int getpid(void);
int getppid(void);
int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4, unsigned long arg5);
int unsetenv(const char *name);
]])

-- variables the launcher decides for its ranks (an inherited value would mislead them)
local launch_owned = { RANK = true, WORLD_SIZE = true, LOCAL_RANK = true, LOCAL_WORLD_SIZE = true,
                       MASTER_ADDR = true, MASTER_PORT = true, CUDA_VISIBLE_DEVICES = true, NCCL_NVLS_ENABLE = true,
                       MOONSTEP_LAUNCHER_PID = true }

--- In a rank started by `moonstep launch` (MOONSTEP_LAUNCHER_PID): the rank gets SIGTERM when the launcher dies,
--- however it dies (killed from outside its process group, it could not stop its ranks, which then waited in
--- the rendezvous or a collective until their timeouts), and ends at once when the launcher is gone already.
--- The variable is removed, so that the rank's own children are not tied to the launcher.
function M.follow_launcher()
  local want = tonumber(os.getenv("MOONSTEP_LAUNCHER_PID") or "")
  if want == nil then return end
  ffi.C.unsetenv("MOONSTEP_LAUNCHER_PID")
  pcall(function() ffi.C.prctl(1, 15, 0, 0, 0) end)   -- PR_SET_PDEATHSIG, SIGTERM (Linux)
  if ffi.C.getppid() ~= want then
    io.stderr:write("moonstep: the launcher that started this rank is gone; stopping\n")
    os.exit(143)
  end
end

-- this process's environment minus the launcher's variables, plus `extra` (an array of "K=V")
local function rank_environment(extra)
  local env = {}
  local e = ffi.C.environ
  local i = 0
  while e[i] ~= nil do
    local kv = ffi.string(e[i])
    if not launch_owned[kv:match("^([^=]*)")] then env[#env + 1] = kv end
    i = i + 1
  end
  for _, kv in ipairs(extra) do env[#env + 1] = kv end
  return env
end

-- a NULL-terminated char *[] of strings; `keep` holds the Lua strings it points into
local function cstrings(list, keep)
  local arr = ffi.new("char *[?]", #list + 1)
  for i, s in ipairs(list) do
    keep[#keep + 1] = s
    arr[i - 1] = ffi.cast("char *", s)
  end
  arr[#list] = nil
  return arr
end

local function self_executable()
  local exe = os.getenv("MOONSTEP_EXE")
  if exe and exe ~= "" then return exe end
  local buf = ffi.new("char[4096]")
  local n = tonumber(ffi.C.readlink("/proc/self/exe", buf, 4095))
  exe = n > 0 and ffi.string(buf, n) or nil
  if exe == nil or not exe:match("moonstep[^/]*$") then
    error("launch: cannot tell where the moonstep executable is (run it as `moonstep launch`, or set MOONSTEP_EXE)", 0)
  end
  return exe
end

-- the exit status of a waitpid status word: the code, or 128 + the signal
local function exit_code(w)
  local sig = bit.band(w, 0x7f)
  if sig == 0 then return bit.band(bit.rshift(w, 8), 0xff) end
  return 128 + sig
end

--- Starts n ranks of `exe run script args...`; waits for them all; returns the first non-zero exit status
--- (0 when all succeeded).  When one fails the others get SIGTERM, and SIGKILL after `grace` seconds.
local LAUNCH_OPTIONS = { exe = "string", port = { "integer", min = 1, max = 65535 }, grace = { "number", min = 0 } }
function M.launch(n, script, args, opts)
  -- (n = 2.5 started 2 ranks told WORLD_SIZE=2.5; a misspelt key was dropped for its default)
  local core = require("moonstep.core")
  core.check_value("launch", "n", n, { "integer", min = 1, max = 1024 }, 2)
  if type(script) ~= "string" then error("launch: script must be a path (got " .. core.show(script) .. ")", 2) end
  opts = core.check_options("launch", opts, LAUNCH_OPTIONS, 2)
  local exe = opts.exe or self_executable()
  local port = opts.port or ms.comm.free_port()
  local keep = {}
  local argv = cstrings((function()
    local a = { exe, "run", script }
    for _, v in ipairs(args or {}) do a[#a + 1] = v end
    return a
  end)(), keep)
  local pids, rank_of = {}, {}
  local pid = ffi.new("int[1]")
  -- ranks on one host share its cores: N OpenMP teams of every core each would oversubscribe them (CPU
  -- ranks compute on those threads), so each gets its share unless the caller chose
  local threads = nil
  if os.getenv("OMP_NUM_THREADS") == nil then
    local cores = tonumber(ffi.C.sysconf(84))                   -- _SC_NPROCESSORS_ONLN
    threads = math.max(1, math.floor((cores > 0 and cores or 1) / n))
  end
  for r = 0, n - 1 do
    local extra = {
      "RANK=" .. r, "WORLD_SIZE=" .. n, "LOCAL_RANK=" .. r, "LOCAL_WORLD_SIZE=" .. n,
      "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" .. port, "NCCL_NVLS_ENABLE=0",
      "MOONSTEP_LAUNCHER_PID=" .. ffi.C.getpid(),
    }
    if threads then extra[#extra + 1] = "OMP_NUM_THREADS=" .. threads end
    local envp = cstrings(rank_environment(extra), keep)
    local rc = ffi.C.posix_spawn(pid, exe, nil, nil, argv, envp)
    if rc ~= 0 then
      for _, p in ipairs(pids) do ffi.C.kill(p, 9) ffi.C.waitpid(p, nil, 0) end
      error(("launch: cannot start rank %d (%s): error %d"):format(r, exe, rc), 0)
    end
    pids[#pids + 1] = pid[0]
    rank_of[pid[0]] = r
  end
  local status = ffi.new("int[1]")
  local alive, first_failure, kill_at = n, nil, nil
  local grace = opts.grace or 3
  while alive > 0 do
    local exited = false
    for p, r in pairs(rank_of) do                    -- only our ranks (waitpid(-1) would reap others' children)
      local w = ffi.C.waitpid(p, status, 1)          -- WNOHANG
      if w ~= 0 then
        exited = true
        alive = alive - 1
        rank_of[p] = nil
        local code = w > 0 and exit_code(status[0]) or 1
        if code ~= 0 and first_failure == nil then
          first_failure = code
          io.stderr:write(("moonstep launch: rank %d exited with status %d; stopping the other ranks\n"):format(r, code))
          for q in pairs(rank_of) do ffi.C.kill(q, 15) end   -- SIGTERM
          kill_at = os.time() + grace
        end
        break                                        -- rank_of changed: iterate afresh
      end
    end
    if not exited then
      if kill_at and os.time() >= kill_at then
        for q in pairs(rank_of) do ffi.C.kill(q, 9) end
        kill_at = nil
      end
      ffi.C.usleep(5000)
    end
  end
  return first_failure or 0
end

command {
  name = "launch",
  summary = "run a script as N local ranks: moonstep launch -n N FILE.lua [args...]",
  help = [=[usage: moonstep launch -n N [--port P] FILE.lua [args...]

Starts N processes of `moonstep run FILE.lua args...` on this host, one per GPU (or on the CPU), with the
environment that torchrun would give them: RANK and LOCAL_RANK (0 .. N-1), WORLD_SIZE and LOCAL_WORLD_SIZE
(N), MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port, or P), and NCCL_NVLS_ENABLE=0 (no NVLink multicast);
OMP_NUM_THREADS (the cores divided by N) unless it is set already.  CUDA_VISIBLE_DEVICES is removed: each
rank uses cuda:LOCAL_RANK, or the CPU where no GPU is usable (ms.comm.from_env() does; a CPU communicator
runs over TCP through rank 0).
Waits for all ranks and exits with the first non-zero status among them; when a rank fails, the others are
stopped (SIGTERM, then SIGKILL after 3 s).  The ranks get SIGTERM when the launcher itself dies, however it
dies (on Linux).]=],
  run = function(argv)
    local n, port, i = nil, nil, 1
    while i <= #argv do
      local a = argv[i]
      local name, value = a:match("^(%-%-?[%w-]+)=(.*)$")
      name = name or a
      if name == "-h" or name == "--help" then show_help(by_name.launch) return 0
      elseif name == "-n" or name == "--nproc" or name == "--port" then
        if value == nil then i = i + 1 value = argv[i] end
        if value == nil then usage_error(("%s needs a value (%s)"):format(name, name == "--port" and "P" or "N"), "launch") end
        local v = tonumber(value)
        -- tonumber reads "inf" (and "1e999" as inf), which floor leaves whole
        if v == nil or v ~= math.floor(v) or math.abs(v) == math.huge then
          usage_error(("%s: %q is not an integer"):format(name, value), "launch")
        end
        if name == "--port" then
          if v < 1 or v > 65535 then usage_error(("--port %d is outside [1, 65535]"):format(v), "launch") end
          port = v
        else
          if v < 1 or v > 1024 then usage_error(("%s %d: the number of ranks must be in [1, 1024]"):format(name, v), "launch") end
          n = v
        end
      elseif a:sub(1, 1) == "-" then
        usage_error(("unknown flag '%s' for 'moonstep launch'"):format(a), "launch")
      else
        break
      end
      i = i + 1
    end
    if n == nil then usage_error("launch needs the number of ranks: moonstep launch -n N FILE.lua [args...]", "launch") end
    local script = argv[i]
    if script == nil then usage_error("launch needs a script: moonstep launch -n N FILE.lua [args...]", "launch") end
    local f = io.open(script, "r")
    if not f then usage_error(("launch: cannot read the script '%s'"):format(script), "launch") end
    f:close()
    local args = {}
    for k = i + 1, #argv do args[#args + 1] = argv[k] end
    return M.launch(n, script, args, { port = port })
  end,
}

-- help ----------------------------------------------------------------------------------------------------
local function usage_text()
  local lines = { "usage: moonstep [COMMAND] [ARGS...]", "", "commands:" }
  for _, c in ipairs(M.commands) do lines[#lines + 1] = ("  %-9s %s"):format(c.name, c.summary) end
  lines[#lines + 1] = ""
  lines[#lines + 1] = "other forms:"
  lines[#lines + 1] = "  moonstep FILE.lua [args...]   run a script (`arg` holds its arguments, as in luajit)"
  lines[#lines + 1] = "  moonstep -e 'lua code' [args] run a chunk of code with `ms` loaded (`arg` and `...` hold args)"
  lines[#lines + 1] = "  moonstep --version | --help"
  lines[#lines + 1] = ""
  lines[#lines + 1] = "moonstep COMMAND --help (or moonstep help COMMAND) describes a command."
  lines[#lines + 1] = ""
  lines[#lines + 1] = "exit status: 0 success, 1 a failure while running (a recipe or script that errors, a run that"
  lines[#lines + 1] = "diverges), 2 a usage error (an unknown command or flag, a bad value or --opt, a script or recipe"
  lines[#lines + 1] = "that is not there, a --resume folder that is no checkpoint or that the command line contradicts)"
  return table.concat(lines, "\n")
end
M.usage = usage_text

command {
  name = "help",
  summary = "help on a command: moonstep help train",
  help = "usage: moonstep help [COMMAND]",
  run = function(argv)
    -- (stops at the command's name: what follows is the command's, `moonstep help train --problem lm`)
    local _, pos = M.parse("help", argv, {}, true)
    if #pos == 0 then outln(usage_text()) return 0 end
    local c = by_name[pos[1]]
    if not c then usage_error(("unknown command '%s'"):format(pos[1]), nil) end
    local rest = { "--help" }
    for i = 2, #pos do rest[#rest + 1] = pos[i] end
    return c.run(rest)
  end,
}

-- ---------------------------------------------------------------------------------------------------
-- main
-- ---------------------------------------------------------------------------------------------------
local function dispatch(argv)
  local a1 = argv[1]
  if a1 == nil then return by_name.repl.run({}) end
  if a1 == "--help" or a1 == "-h" then outln(usage_text()) return 0 end
  if a1 == "--version" then outln(("moonstep %s (abi %d)"):format(ms.version, ms.abi_version)) return 0 end
  local rest = {}
  for i = 2, #argv do rest[#rest + 1] = argv[i] end
  if a1 == "-e" then
    if #rest == 0 then usage_error("-e needs a chunk of Lua code", nil) end
    local chunk, err = loadstring(rest[1], "=(command line)")
    if not chunk then error(err, 0) end
    -- the words after the chunk are its arguments, as a script's are (they were dropped silently)
    local args, a = {}, { [0] = "-e" }
    for i = 2, #rest do args[#args + 1] = rest[i] a[i - 1] = rest[i] end
    _G.arg = a
    local ok, e = xpcall(function() return chunk(unpack(args)) end, traceback)
    if not ok then error(e, 0) end
    return 0
  end
  if a1:sub(1, 1) == "-" then usage_error(("unknown option '%s'"):format(a1), nil) end
  local c = by_name[a1]
  if c then return c.run(rest) or 0 end
  -- a script; a bare word that is no file is more likely a mistyped command
  local f = io.open(a1, "r")
  if f then f:close()
  elseif not a1:find("[/.]") then
    usage_error(("unknown command '%s'"):format(a1), nil)
  else
    check_script(a1, nil)
  end
  M.run_script(a1, rest)
  return 0
end

--- Runs the command line argv (an array of strings, without the program name); returns the exit status.
function M.main(argv)
  local ok, res = xpcall(dispatch, message, argv or {})
  io.stdout:flush()
  if ok then return tonumber(res) or 0 end
  if getmetatable(res) == Usage then
    io.stderr:write("moonstep: ", res.msg, "\n")
    io.stderr:write(res.cmd and ("(moonstep %s --help lists its flags)\n"):format(res.cmd)
                    or "(moonstep --help lists the commands)\n")
    return 2
  end
  io.stderr:write("moonstep: ", tostring(res), "\n")
  return 1
end

return M
