-- The numbers of moonstep.experiment and moonstep.report that need no training: moving averages, the
-- mean over seeds of runs that stopped at different steps, time formatting.
local E = require("moonstep.experiment")

-- the average of xs[i - w + 1 .. i], summed directly
local function direct(xs, i, w)
  local s, n = 0, 0
  for j = math.max(1, i - w + 1), i do s, n = s + xs[j], n + 1 end
  return s / n
end

describe("experiment numbers", function()
  it("names the folder of a checkpoint whose run description is corrupt", function()
    local ms = H.ms
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir) == 0)
    for text, why in pairs { ['{"steps":1,'] = "expected a string key", ["[1]"] = "not an object naming its problem", ['{"seed":1,"seed":2}'] = "duplicate key" } do
      ms.save(dir .. "/model.safetensors", { w = ms.zeros({ 1 }) }, { moonstep_train = text })
      H.expect_error(function() E.checkpoint_info(dir) end, dir .. ": model.safetensors: corrupt run description", why)
    end
    os.execute("rm -r " .. dir)
  end)

  it("names the folder and the field of a run description whose fields are wrong", function()
    local ms, json = H.ms, require("moonstep.json")
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir) == 0)
    local good = { problem = "lsq", problem_options = {}, seed = 0, step = 3, steps = 6, schedule = "cosine",
                   warmup = 0, clip = false, recipe = "sgd", recipe_options = {} }
    local function with(k, v)
      local t = {}
      for a, b in pairs(good) do t[a] = b end
      t[k] = v
      return t
    end
    ms.save(dir .. "/model.safetensors", { w = ms.zeros({ 1 }) }, { moonstep_train = json.encode(good) })
    assert.equals(6, E.checkpoint_info(dir).steps)
    for _, case in ipairs {
      { "steps", "abc", "'steps' is \"abc\"" }, { "steps", 0, "'steps' is 0" }, { "step", 2.5, "'step' is 2.5" },
      { "seed", -1, "'seed' is -1" }, { "warmup", "w", "'warmup' is \"w\"" }, { "clip", "c", "'clip' is \"c\"" },
      { "schedule", "weird", "'schedule' is \"weird\"" }, { "problem_options", 5, "'problem_options' is 5" },
      { "recipe_options", "zz", "'recipe_options' is \"zz\"" }, { "recipe", 7, "'recipe' is 7" },
      { "losses", { 1, "x" }, "'losses' is" }, { "losses", 3, "'losses' is 3" },
    } do
      ms.save(dir .. "/model.safetensors", { w = ms.zeros({ 1 }) }, { moonstep_train = json.encode(with(case[1], case[2])) })
      H.expect_error(function() E.checkpoint_info(dir) end, dir .. ": model.safetensors: corrupt run description", case[3])
    end
    -- a problem option the problem refuses: named with the folder, before any training
    ms.save(dir .. "/model.safetensors", { w = ms.zeros({ 1 }) },
            { moonstep_train = json.encode(with("problem_options", { dim = "x" })) })
    H.expect_error(function() E.run { problem = "lsq", recipe = "sgd", resume = dir, device = "cpu" } end,
                   dir .. ": model.safetensors: corrupt run description", "option 'dim'")
    os.execute("rm -r " .. dir)
  end)

  it("refuses a mistyped setting by name before anything runs", function()
    -- they failed as bare Lua errors deep inside, or only when first used: a callback after the first
    -- step, a save folder given as a number after the whole run, warmup = 1.5 was taken
    local dir = os.tmpname()
    os.remove(dir)
    local called = false
    local function cfg(extra, recipes)
      local t = { problem = "lsq", device = "cpu", steps = 3, on_step = function() called = true end }
      if recipes then t.recipes = { "sgd" } else t.recipe = "sgd" end
      for k, v in pairs(extra) do t[k] = v end
      return t
    end
    for _, case in ipairs {
      { { problem = 5 }, "run: problem must be a problem name or table (got 5)" },
      { { problem_options = 5 }, "run: problem_options must be a table (got 5)" },
      { { recipe = 5 }, "run: recipe must be a recipe name, a file path or a recipe table (got 5)" },
      { { recipe_options = "x" }, 'run: recipe_options must be a table (got "x")' },
      { { device = 5 }, "run: device must be a string (got 5)" },
      { { ctx = {} }, "run: ctx must be a moonstep context (got a table)" },
      { { schedule = 5 }, "run: schedule must be a string (got 5)" },
      { { steps = "3" }, 'run: steps must be an integer >= 1 (got "3")' },
      { { warmup = 1.5 }, "run: warmup must be an integer >= 0 (got 1.5)" },
      { { warmup = "x" }, 'run: warmup must be an integer >= 0 (got "x")' },
      { { on_eval = "x", on_step = 5 }, "must be a function" },
      { { save = 5 }, "run: save must be a folder's path (got 5)" },
      { { save = "" }, "run: save must be a folder's path" },
      { { resume = true }, "run: resume must be a folder's path (got true)" },
      { { save = dir .. "\0x" }, "run: save must not contain a NUL byte" },
      { { resume = dir .. "\0x" }, "run: resume must not contain a NUL byte" },
    } do
      H.expect_error(function() E.run(cfg(case[1])) end, case[2])
    end
    for _, case in ipairs {
      { { recipes = 5 }, "compare: recipes must be a table (got 5)" },
      { { recipes = { "sgd", 7 } }, "compare: recipes[2] must be a recipe name, a file path or a recipe table (got 7)" },
      { { options = 5 }, "compare: options must be a table (got 5)" },
      { { options = { { value = 1 } } }, "compare: options[1] must be a table {key = option name" },
      { { on_run = 5 }, "compare: on_run must be a function (got 5)" },
      { { on_loaded = 5 }, "compare: on_loaded must be a function (got 5)" },
      { { on_fail = 5 }, "compare: on_fail must be a function (got 5)" },
    } do
      H.expect_error(function() E.compare(cfg(case[1], true)) end, case[2])
    end
    assert.is_false(called)   -- no run started
    assert.is_nil(io.open(dir, "r"))   -- no folder made for a refused save
  end)

  it("a resumed run's final and best losses and moving average are the uninterrupted run's", function()
    -- they covered only the resumed part: its best was the best since the resume, its average restarted there
    local dir = os.tmpname()
    os.remove(dir)
    local base = { problem = "lsq", recipe = "adamw", device = "cpu", steps = 40, smooth = 8,
                   problem_options = { dim = 8, outputs = 2, samples = 32 } }
    local function run(extra)
      local cfg = {}
      for k, v in pairs(base) do cfg[k] = v end
      for k, v in pairs(extra) do cfg[k] = v end
      return E.run(cfg)
    end
    local whole = run {}
    local first = run { stop_after = 13, save = dir .. "/a" }
    assert.equals(13, #E.checkpoint_info(dir .. "/a").losses)
    local rest = run { resume = dir .. "/a", save = dir .. "/b" }
    assert.equals(14, rest.start_step)
    assert.equals(27, #rest.losses)
    for i = 1, 13 do assert.equals(whole.losses[i], first.losses[i]) end
    for i = 1, 27 do
      assert.equals(whole.losses[13 + i], rest.losses[i], "loss of step " .. (13 + i))
      assert.equals(whole.smoothed[13 + i], rest.smoothed[i], "moving average at step " .. (13 + i))
    end
    assert.equals(whole.final_loss, rest.final_loss)
    assert.equals(whole.best_loss, rest.best_loss)
    assert.equals(40, #E.checkpoint_info(dir .. "/b").losses)
    -- the checks before a resumed run (moonstep train's: checkpoint_info, then resume_config, then the run's
    -- own) read the checkpoint's header; its parameters are read once, by the run (it read them three times)
    local ms, loads = H.ms, 0
    local real = ms.load
    ms.load = function(path, ...)
      if tostring(path):find("model.safetensors", 1, true) then loads = loads + 1 end
      return real(path, ...)
    end
    local good, err = pcall(function()
      E.checkpoint_info(dir .. "/a")
      local cfg = { resume = dir .. "/a", steps = 40 }
      for k, v in pairs(base) do cfg[k] = cfg[k] or v end
      E.resume_config(cfg, require("moonstep.problems").get("lsq"))
      run { resume = dir .. "/a", steps = 40 }
    end)
    ms.load = real
    assert(good, err)
    assert.equals(1, loads, "reads of model.safetensors")
    -- a model file whose header reads but whose data is cut short is refused before any step, naming it
    local f = assert(io.open(dir .. "/a/model.safetensors", "rb"))
    local bytes = f:read("*a")
    f:close()
    f = assert(io.open(dir .. "/a/model.safetensors", "wb"))
    f:write(bytes:sub(1, #bytes - 4))
    f:close()
    local steps = 0
    H.expect_error(function() run { resume = dir .. "/a", on_step = function() steps = steps + 1 end } end,
                   dir .. "/a: cannot read model.safetensors")
    assert.equals(0, steps, "steps taken before the refusal")
    os.execute("rm -r " .. dir)
  end)

  it("moving averages stay accurate when the loss falls by many orders of magnitude", function()
    -- a running sum that adds the new value and subtracts the one leaving the window keeps the rounding
    -- error of the largest values it has seen: 1e-16 of 1e4 swamps a loss of 1e-13
    local xs = {}
    for i = 1, 200 do xs[i] = 1e4 * 10 ^ (-i / 10) end
    for _, w in ipairs { 1, 2, 3, 7, 10, 64, 200, 500 } do
      local got = E.moving_average(xs, w)
      assert.equals(#xs, #got)
      for i = 1, #xs do
        H.assert_close(got[i], direct(xs, i, w), 1e-12, 0, ("window %d, step %d"):format(w, i))
      end
    end
    assert.same({}, E.moving_average({}, 5))
  end)

  it("a diverged run's last loss (NaN or inf) reaches only the averages that include it", function()
    for _, bad in ipairs { 0 / 0, math.huge } do
      local xs = { 4, 3, 2, 1, 0.5, bad }
      local got = E.moving_average(xs, 2)
      for i = 1, 5 do H.assert_close(got[i], direct(xs, i, 2), 1e-15, 0, "step " .. i) end
      assert.is_false(got[6] == got[6] and got[6] < math.huge)
    end
  end)
end)

describe("experiment settings", function()
  local small = { dim = 4, outputs = 2, samples = 8 }
  it("E.run and E.compare refuse an unknown key or a value they would misread, before training", function()
    local function run(extra)
      local cfg = { problem = "lsq", recipe = "adamw", steps = 2, device = "cpu", problem_options = small }
      for k, v in pairs(extra) do cfg[k] = v end
      return function() return E.run(cfg) end
    end
    H.expect_error(run { step = 3 }, "run: unknown setting 'step'")
    H.expect_error(run { seed = 1.5 }, "run: seed must be an integer >= 0 (got 1.5)")
    H.expect_error(run { seed = -1 }, "seed must be an integer >= 0")
    H.expect_error(run { smooth = 0 }, "run: smooth must be an integer >= 1")
    H.expect_error(run { eval_every = 0 }, "run: eval_every must be an integer >= 1")
    H.expect_error(run { clip = "x" }, "run: clip must be a number >= 0 or false")
    H.expect_error(run { dtype = "f65" }, "run: dtype: unknown dtype \"f65\"")
    H.expect_error(function() E.compare { problem = "lsq", recipes = { "adamw" }, steps = 2, seeds = 1, sed = 1 } end,
      "compare: unknown setting 'sed'")
    local r = run { seed = 2, smooth = 1, eval_every = 1 }()
    assert.are.equal(2, #r.evals)
    local c = E.compare { problem = "lsq", recipes = { "adamw" }, steps = 2, device = "cpu", problem_options = small,
                          seeds = 1, skip_missing = true, on_run = function() end }
    assert.is_nil(c.rows[1].failed)
    assert.are.equal(1, c.rows[1].seeds)
  end)
end)

describe("report files", function()
  -- a comparison as E.compare returns it, without training: one recipe, one seed, two steps
  local function comparison(name)
    local run = { seed = 0, start_step = 1, losses = { 1, 0.5 }, smoothed = { 1, 0.75 }, smooth = 2,
                  evals = { { step = 2, loss = 0.6, accuracy = 0.5 } } }
    local row = { recipe = name, seeds = 1, val_loss = 0.6, val_spread = 0, final_loss = 0.75, best_loss = 0.75,
                  val_accuracy = 0.5, seconds = 0.1, steps_per_s = 20, state_bytes = 64 }
    return { rows = { row }, runs = { [name] = { run } }, seeds = 1 }
  end

  -- the fields of one CSV line (RFC 4180: quoted fields, "" inside them)
  local function fields(line)
    local out, i = {}, 1
    while i <= #line + 1 do
      if line:sub(i, i) == '"' then
        local s, j = {}, i + 1
        while true do
          local c = line:sub(j, j)
          if c == '"' and line:sub(j + 1, j + 1) == '"' then s[#s + 1] = '"' j = j + 2
          elseif c == '"' then j = j + 1 break
          else assert(c ~= "", "unterminated quoted field in " .. line) s[#s + 1] = c j = j + 1 end
        end
        out[#out + 1] = table.concat(s)
        i = j + 1
      else
        local j = line:find(",", i, true) or #line + 1
        out[#out + 1] = line:sub(i, j - 1)
        i = j + 1
      end
    end
    return out
  end

  it("quotes recipe names that hold commas or quotes in the CSV files", function()
    local report = require("moonstep.report")
    local dir = H.tmpdir()
    for _, name in ipairs { "plain", 'my,recipe', 'say "hi"' } do
      local files = report.write(dir, comparison(name), { problem = { name = "p", defaults = {} }, steps = 2, plotter = "builtin" })
      local lines = {}
      for l in H.read_file(files.csv):gmatch("[^\n]+") do lines[#lines + 1] = l end
      assert.equals(3, #lines)
      local f = fields(lines[3])
      assert.equals(7, #f, lines[3])
      assert.equals(name, f[1])
      assert.equals("2", f[3])
      lines = {}
      for l in H.read_file(files.summary):gmatch("[^\n]+") do lines[#lines + 1] = l end
      f = fields(lines[2])
      assert.equals(11, #f, lines[2])
      assert.equals(name, f[1])
      assert.equals("ok", f[11])
    end
    os.execute("rm -rf " .. H.q(dir))
  end)
end)
