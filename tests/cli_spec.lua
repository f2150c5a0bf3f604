-- The `moonstep` command's subcommands, run as a user runs them (the built host, output and exit
-- status): help, train (progress, summary, options, checkpoints and resuming, recipe files sandboxed or
-- trusted, failures mid-run), compare (table, CSV, plots with gnuplot and without), bench, info, and
-- bad input everywhere.  The REPL, driven through a terminal, is in repl_spec.lua.
-- ms_run(ARGS, ENV): `moonstep ARGS` (a shell fragment) run from the project root; stdout+stderr and the exit status
local q, ms_run = H.q, H.moonstep
local tmpdir, write, read = H.tmpdir, H.write_file, H.read_file

local function has(out, ...)
  for _, s in ipairs { ... } do
    assert(out:find(s, 1, true), ("output does not contain %q:\n%s"):format(s, out))
  end
end

local dirs = {}
local function scratch()
  local d = tmpdir()
  dirs[#dirs + 1] = d
  return d
end

-- a tiny, quick lsq problem for the commands below
local LSQ = "--problem lsq --dim 8 --outputs 2 --samples 32 --cond 100 --device cpu"
-- a short AdamW run of a small MLP, for the checkpoint specs
local SMALL_MLP = "train --problem mlp --points 20 --hidden 8 --classes 3 --batch 16 --recipe adamw --steps 12 --eval-every 100 "

describe("moonstep command line", function()
  teardown(function()
    for _, d in ipairs(dirs) do os.execute("rm -rf " .. q(d)) end
  end)

  it("lists its commands and gives each one help", function()
    local out, code = ms_run("--help")
    assert.equals(0, code)
    has(out, "usage: moonstep", "repl", "run", "train", "compare", "bench", "info")
    for _, c in ipairs { "repl", "run", "train", "compare", "bench", "info" } do
      local h, hc = ms_run(c .. " --help")
      assert.equals(0, hc, c)
      has(h, "usage: moonstep " .. c)
      local h2 = ms_run("help " .. c)
      assert.equals(h, h2)
      assert.is_nil(h:find("flags:%s*$"), c .. ": a flags heading with no flags under it")
    end
    -- a problem's options become flags, with their docs
    local h = ms_run("train --problem lm --help")
    has(h, "--width", "hidden width", "--data", "flags of problem lm")
  end)

  it("gives help on every command it lists, both ways, and refuses its unknown flags by name", function()
    local usage = ms_run("--help")
    local names = {}
    for line in usage:match("commands:\n(.-)\n\n"):gmatch("[^\n]+") do names[#names + 1] = line:match("^  (%S+)") end
    assert.is_true(#names >= 8, usage)
    for _, c in ipairs(names) do
      local h, hc = ms_run(c .. " --help")
      assert.equals(0, hc, c .. " --help:\n" .. h)
      local h2, hc2 = ms_run("help " .. c)
      assert.equals(0, hc2, "help " .. c)
      assert.equals(h, h2, c)
      local o, rc = ms_run(c .. " --no-such-flag x")
      assert.equals(2, rc, c .. ":\n" .. o)
      has(o, "unknown flag '--no-such-flag'")
    end
    -- what follows the command's name is the command's: a problem's flags are shown
    local h, hc = ms_run("help train --problem lm")
    assert.equals(0, hc, h)
    has(h, "flags of problem lm", "--width")
    -- help on run and bench shows their help, and never runs the script or the benchmark
    local dir = scratch()
    local marker = dir .. "/ran"
    write(dir .. "/s.lua", ("io.open(%q, 'w'):close()"):format(marker))
    for _, c in ipairs { "help run " .. q(dir .. "/s.lua"), "run --help " .. q(dir .. "/s.lua"), "help bench core" } do
      local o, rc = ms_run(c, "timeout 60")
      assert.equals(0, rc, c .. ":\n" .. o)
      has(o, "usage: moonstep")
      assert.is_nil(io.open(marker, "r"), c .. " ran the script")
    end
    local o, rc = ms_run("help --no-such-flag")
    assert.equals(2, rc)
    has(o, "unknown flag '--no-such-flag' for 'moonstep help'")
  end)

  it("names unknown commands and flags, and exits 2", function()
    local out, code = ms_run("trian --problem lsq")
    assert.equals(2, code)
    has(out, "unknown command 'trian'")
    for _, c in ipairs { "train " .. LSQ .. " --recipe adamw --stpes 3", "compare " .. LSQ .. " --recipes adamw --stpes 3",
                         "info --stpes 3", "repl --stpes 3" } do
      local o, rc = ms_run(c)
      assert.equals(2, rc, c)
      has(o, "unknown flag '--stpes'")
    end
    local o, rc = ms_run("train " .. LSQ .. " --recipe adamw --steps many")
    assert.equals(2, rc)
    has(o, "--steps", "not an integer")
    -- tonumber reads "inf" and "nan": --steps inf once trained forever, --clip nan trained without clipping
    for _, c in ipairs { { "--steps inf --until 2", "--steps", "not an integer" }, { "--steps 3 --clip nan", "--clip", "not a number" },
                         { "--steps 3 --clip 1e999", "--clip", "not a number" }, { "--steps 3 --threads inf", "--threads" },
                         { "--steps 0x10", "--steps", "not an integer" },
                         -- a seed past 2^53 read as a nearby double: another seed, silently
                         { "--steps 3 --seed 9007199254740993", "--seed", "not below 2^53" } } do
      o, rc = ms_run("train " .. LSQ .. " --recipe sgd " .. c[1])
      assert.equals(2, rc, c[1])
      has(o, unpack(c, 2))
    end
    o, rc = ms_run("train --problem lsq --recipe adamw --steps")
    assert.equals(2, rc)
    has(o, "--steps needs a value")
    o, rc = ms_run("train --recipe adamw")
    assert.equals(2, rc)
    has(o, "train needs --problem")
    o, rc = ms_run("compare --problem lsq")
    assert.equals(2, rc)
    has(o, "compare needs --recipes")
  end)

  it("refuses, as usage errors before any training: extra words, empty values, too many threads, a recipe folder, "
     .. "a recipe given twice, a cut-short or mixed checkpoint", function()
    local dir = scratch()
    for _, c in ipairs {
      { "train " .. LSQ .. " --recipe adamw --steps 3 extra", "train takes flags only (got 'extra')" },
      { "train " .. LSQ .. " --recipe adamw --steps 3 -- --hidden 3", "train takes flags only (got '--hidden')" },
      { "compare " .. LSQ .. " --recipes sgd --steps 3 --out " .. q(dir .. "/c") .. " extra", "compare takes flags only" },
      { "train " .. LSQ .. " --recipe adamw --steps 3 --save ''", "--save: the value is empty" },
      { "train " .. LSQ .. " --recipe adamw --steps 3 --threads 100000", "--threads: 100000 is above the maximum 4096" },
      { "train " .. LSQ .. " --recipe " .. q(dir) .. " --steps 3", "cannot read recipe " .. dir .. ": Is a directory" },
      { "compare " .. LSQ .. " --recipes sgd,sgd --steps 3 --out " .. q(dir .. "/c"), "recipe 'sgd' is given twice" },
    } do
      local out, code = ms_run(c[1])
      assert.equals(2, code, c[1] .. ":\n" .. out)
      has(out, c[2])
      assert.falsy(out:find(".lua:", 1, true), out)
    end
    assert.is_nil(io.open(dir .. "/c/summary.csv"), "compare ran")
    -- checkpoints: a file cut short, and an optimizer file of another run's recipe, are found before the run
    local a, b = dir .. "/a", dir .. "/b"
    assert.equals(0, select(2, ms_run(SMALL_MLP .. "--save " .. q(a))))
    assert.equals(0, select(2, ms_run(SMALL_MLP:gsub("adamw", "sgd") .. "--save " .. q(b))))
    for _, c in ipairs {
      { "cut", "optim.safetensors", function(d) os.execute(("truncate -s -100 %s"):format(q(d .. "/optim.safetensors"))) end,
        "optim.safetensors is cut short" },
      { "cutm", "model.safetensors", function(d) os.execute(("truncate -s -100 %s"):format(q(d .. "/model.safetensors"))) end,
        "model.safetensors: it is cut short" },
      { "mixed", "optim.safetensors", function(d) os.execute(("cp %s %s"):format(q(b .. "/optim.safetensors"), q(d))) end,
        "optim.safetensors holds recipe 'sgd'" },
    } do
      local d = dir .. "/" .. c[1]
      os.execute(("cp -r %s %s"):format(q(a), q(d)))
      c[3](d)
      local out, code = ms_run("train --resume " .. q(d))
      assert.equals(2, code, c[1] .. ":\n" .. out)
      has(out, c[4])
      assert.falsy(out:find("train mlp with", 1, true), c[1] .. ": the run started:\n" .. out)
    end
    -- a sandboxed recipe reaching for a refused library is told so, without the runtime's file positions
    write(dir .. "/evil.lua", "os.execute('true')\nreturn {}\n")
    local out, code = ms_run("train " .. LSQ .. " --recipe " .. q(dir .. "/evil.lua") .. " --steps 3")
    assert.equals(1, code)
    has(out, "'os' is not available to a sandboxed recipe")
    assert.falsy(out:find("lua/moonstep/", 1, true), out)
    -- a benchmark's deliberate message comes without a traceback
    out, code = ms_run("bench core --bogus")
    assert.equals(1, code)
    has(out, "bench core: its argument is a device")
    assert.falsy(out:find("traceback", 1, true), out)
  end)

  it("exits 2 for a script that is not there, 1 for one that fails", function()
    local d = scratch()
    for _, c in ipairs { "run " .. q(d .. "/missing.lua"), q(d .. "/missing.lua"), "run " .. q(d .. "/missing.lua") .. " a b" } do
      local o, rc = ms_run(c)
      assert.equals(2, rc, c .. ":\n" .. o)
      has(o, "cannot read the script '" .. d .. "/missing.lua'")
    end
    write(d .. "/bad.lua", "error('on purpose')")
    write(d .. "/syntax.lua", "local = 1")
    for _, c in ipairs { "run " .. q(d .. "/bad.lua"), q(d .. "/syntax.lua") } do
      local o, rc = ms_run(c)
      assert.equals(1, rc, c .. ":\n" .. o)
    end
  end)

  it("hands the words after -e 'code' to the chunk, in `arg` and `...`, as a script gets its own", function()
    local out, code = ms_run([[-e 'print(select("#", ...), table.concat({...}, "|"), arg[0], arg[1], arg[2])' a "b c"]])
    assert.equals(0, code, out)
    has(out, "2\ta|b c\t-e\ta\tb c")
    out, code = ms_run([[-e 'print(select("#", ...), arg[0], arg[1])']])
    assert.equals(0, code, out)
    has(out, "0\t-e\tnil")
  end)

  it("launch names a missing or infinite -n or --port value, and exits 2", function()
    -- a missing value read as "nil" is not an integer; inf passed as whole and printed as -9223372036854775808
    for _, c in ipairs { { "launch -n", "-n needs a value (N)" }, { "launch -n 2 --port", "--port needs a value (P)" },
                         { "launch -n 1e999 x.lua", '-n: "1e999" is not an integer' },
                         { "launch -n -inf x.lua", '-n: "-inf" is not an integer' },
                         { "launch -n 2 --port=inf x.lua", '--port: "inf" is not an integer' } } do
      local o, rc = ms_run(c[1])
      assert.equals(2, rc, c[1])
      has(o, c[2])
      assert.is_nil(o:find("9223372036854775808", 1, true), o)
    end
  end)

  describe("train", function()
    it("trains, prints progress lines (not a terminal) and a summary", function()
      local out, code = ms_run("train " .. LSQ .. " --recipe adamw --steps 30 --eval-every 10 --opt lr=0.1")
      assert.equals(0, code, out)
      has(out, "train lsq with adamw on cpu", "step 10/30", "step 20/30", "val ", "steps/s", "ETA",
          "recipe adamw (hash ", "lr=0.1", "train loss  final", "val loss", "optimizer state 144 bytes")
      assert.is_nil(out:find("\r", 1, true), "no carriage returns when stdout is not a terminal")
      -- the final loss is below the initial one: it trained
      local first = tonumber(out:match("step 10/30  loss ([%d%.]+)"))
      local final = tonumber(out:match("train loss  final ([%d%.]+)"))
      assert.is_true(final < first, out)
    end)

    it("takes the last --problem given, with that problem's flags, as it takes the last of any flag", function()
      -- the first one picked the problem flags and the problem, while the parse kept the last
      local out, code = ms_run("train --problem mlp " .. LSQ .. " --recipe sgd --steps 2")
      assert.equals(0, code, out)
      has(out, "train lsq with sgd on cpu")
      out, code = ms_run("train --problem=lsq --problem=mlp --dim 8 --recipe sgd --steps 2")
      assert.equals(2, code, out)
      has(out, "unknown flag '--dim'")
    end)

    it("refuses unknown problems and recipes, bad options and a missing recipe file, as usage errors (exit 2)", function()
      local out, code = ms_run("train --problem nope --recipe adamw")
      assert.equals(2, code)
      has(out, "unknown problem 'nope'", "lsq, mlp, lm")
      -- a recipe or an --opt the command line names wrongly is a usage error (they exited 1, as a failed run)
      out, code = ms_run("train " .. LSQ .. " --recipe nosuch")
      assert.equals(2, code, out)
      has(out, 'no recipe named "nosuch"')
      out, code = ms_run("train " .. LSQ .. " --recipe adamw --opt lrate=1")
      assert.equals(2, code, out)
      has(out, "adamw: unknown option 'lrate'")
      out, code = ms_run("train " .. LSQ .. " --recipe adamw --opt lr=fast")
      assert.equals(2, code, out)
      has(out, "option 'lr'", "a number is needed")
      assert.falsy(out:find("step 1", 1, true), out)
      out, code = ms_run("train " .. LSQ .. " --recipe adamw --opt lr")
      assert.equals(2, code)
      has(out, "expected key=value")
      out, code = ms_run("train " .. LSQ .. " --recipe /nonexistent/optim.lua")
      assert.equals(2, code, out)
      has(out, "cannot read recipe /nonexistent/optim.lua")
      out, code = ms_run("train --problem lsq --cond 0.5 --recipe adamw")
      assert.equals(2, code)
      has(out, "option 'cond'", "minimum")
      out, code = ms_run("train " .. LSQ .. " --recipe adamw --schedule sometimes")
      assert.equals(2, code)
      has(out, "unknown schedule 'sometimes'")
      out, code = ms_run("train " .. LSQ .. " --recipe adamw --device tpu")
      assert.equals(2, code)
      has(out, "--device tpu: ms_ctx_new: unknown device \"tpu\"")
      assert.is_nil(out:find(".lua:", 1, true), "a Lua position in the message: " .. out)
    end)

    it("reports a recipe that fails mid-run with the step", function()
      local d = scratch()
      write(d .. "/optim.lua", [[
return {
  name = "flaky", options = {lr = {default = 0.1, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o, ctx)
    if ctx.step == 3 then error("flaky: out of luck") end
    for _, m in ipairs(group) do m.param:sub_(m.grad * ctx.lr) end
  end}},
}]])
      local out, code = ms_run("train " .. LSQ .. " --steps 10 --recipe " .. q(d .. "/optim.lua"))
      assert.equals(1, code)
      has(out, "recipe 'flaky' failed at step 3", "flaky: out of luck")
    end)

    it("sandboxes a recipe file unless --trusted", function()
      local d = scratch()
      -- a recipe that reads a file while loading: allowed only when trusted
      write(d .. "/optim.lua", [[
local f = io.open("/dev/null")
f:close()
return {
  name = "curious", options = {lr = {default = 0.1, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o, ctx)
    for _, m in ipairs(group) do m.param:sub_(m.grad * ctx.lr) end
  end}},
}]])
      local out, code = ms_run("train " .. LSQ .. " --steps 5 --recipe " .. q(d .. "/optim.lua"))
      assert.equals(1, code)
      has(out, "io")
      out, code = ms_run("train " .. LSQ .. " --steps 5 --trusted --recipe " .. q(d .. "/optim.lua"))
      assert.equals(0, code, out)
      has(out, "train lsq with curious")
    end)

    it("saves a checkpoint and resumes exactly; refuses another recipe unless --force", function()
      local d = scratch()
      local common = SMALL_MLP
      local full, c1 = ms_run(common .. "--save " .. q(d .. "/full"))
      assert.equals(0, c1, full)
      local half, c2 = ms_run(common .. "--until 6 --save " .. q(d .. "/half"))
      assert.equals(0, c2, half)
      has(half, "steps 1-6 of 12")
      assert.truthy(read(d .. "/half/model.safetensors") and read(d .. "/half/optim.safetensors"))
      -- the resumed run takes the rest of its settings from the checkpoint
      local rest, c3 = ms_run("train --problem mlp --recipe adamw --resume " .. q(d .. "/half") .. " --save " .. q(d .. "/rest"))
      assert.equals(0, c3, rest)
      has(rest, "resuming", "steps 7-12 of 12")
      -- bit for bit: the parameters after 6 + 6 steps equal those after 12
      local ms = H.ms
      local a = ms.load(d .. "/full/model.safetensors")
      local b = ms.load(d .. "/rest/model.safetensors")
      local n = 0
      for name, t in pairs(a) do
        assert.equals(0, (t - b[name]):abs():max(), name)
        n = n + 1
      end
      assert.is_true(n >= 5)
      -- another recipe: refused, then accepted with --force (plain sgd keeps no state: nothing to restore)
      local other, c4 = ms_run("train --problem mlp --recipe sgd --opt momentum=0 --resume " .. q(d .. "/half"))
      assert.equals(2, c4, other)
      has(other, "checkpoint of recipe 'adamw'", "pass --force")
      local forced, c5 = ms_run("train --problem mlp --recipe sgd --opt momentum=0 --force --resume " .. q(d .. "/half"))
      assert.equals(0, c5, forced)
      has(forced, "steps 7-12 of 12")
      -- a resume that contradicts the checkpoint, or a folder that is not one
      local bad, c6 = ms_run("train --problem mlp --hidden 16 --recipe adamw --resume " .. q(d .. "/half"))
      assert.equals(2, c6, bad)
      has(bad, "problem option 'hidden'")
      local wrong, c7 = ms_run("train --problem lsq --recipe adamw --resume " .. q(d .. "/half"))
      assert.equals(2, c7, wrong)
      has(wrong, "checkpoint of problem 'mlp'")
      local none, c8 = ms_run("train --problem mlp --recipe adamw --resume " .. q(d .. "/nothing"))
      assert.equals(2, c8, none)
      has(none, "not a checkpoint folder")
    end)

    it("resumes from the checkpoint folder alone (its problem, problem flags and recipe); refuses a --problem or --recipe that contradicts it", function()
      local d = scratch()
      local _, c1 = ms_run(SMALL_MLP .. "--device cpu --save " .. q(d .. "/full"))
      assert.equals(0, c1)
      local _, c2 = ms_run(SMALL_MLP .. "--device cpu --until 6 --save " .. q(d .. "/half"))
      assert.equals(0, c2)
      -- no --problem, no --recipe, no --device: all from the checkpoint (the first two were required; the device
      -- was the best one, a GPU where there is one), and the run continues bit for bit
      local rest, c3 = ms_run("train --resume " .. q(d .. "/half") .. " --save " .. q(d .. "/rest"))
      assert.equals(0, c3, rest)
      has(rest, "train mlp with adamw on cpu (resuming", "steps 7-12 of 12")
      local a, b = H.ms.load(d .. "/full/model.safetensors"), H.ms.load(d .. "/rest/model.safetensors")
      for name, t in pairs(a) do assert.equals(0, (t - b[name]):abs():max(), name) end
      -- the checkpoint's problem's flags are known without --problem
      local flags, c4 = ms_run("train --resume " .. q(d .. "/half") .. " --hidden 8 --until 8")
      assert.equals(0, c4, flags)
      has(flags, "steps 7-8 of 12")
      -- `train --resume DIR --steps N`: a run of a constant schedule, extended
      local _, cf = ms_run(SMALL_MLP .. "--schedule constant --warmup 0 --until 6 --save " .. q(d .. "/flat"))
      assert.equals(0, cf)
      local longer, cl = ms_run("train --resume " .. q(d .. "/flat") .. " --steps 20")
      assert.equals(0, cl, longer)
      has(longer, "train mlp with adamw", "steps 7-20 of 20")
      -- a --recipe or --problem that contradicts the checkpoint: a usage error naming both (--force allows another
      -- recipe, as it does under --problem; never another problem, whose parameters these are not)
      local other, c5 = ms_run("train --resume " .. q(d .. "/half") .. " --recipe sgd")
      assert.equals(2, c5, other)
      has(other, "checkpoint of recipe 'adamw'", "not 'sgd'", "pass --force")
      local forced, c6 = ms_run("train --resume " .. q(d .. "/half") .. " --recipe sgd --opt momentum=0 --force")
      assert.equals(0, c6, forced)
      has(forced, "train mlp with sgd", "steps 7-12 of 12")
      for _, force in ipairs { "", " --force" } do
        local wrong, c7 = ms_run("train --resume " .. q(d .. "/half") .. " --problem lsq" .. force)
        assert.equals(2, c7, wrong)
        has(wrong, "checkpoint of problem 'mlp', not 'lsq'")
      end
      -- a recipe file: found again by the path the checkpoint recorded; gone, named in the error
      write(d .. "/optim.lua", [[
return {
  name = "mine", options = {lr = {default = 0.1, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o, ctx)
    for _, m in ipairs(group) do m.param:sub_(m.grad * ctx.lr) end
  end}},
}]])
      local _, c8 = ms_run("train " .. LSQ .. " --steps 6 --until 3 --recipe " .. q(d .. "/optim.lua") .. " --save " .. q(d .. "/ck"))
      assert.equals(0, c8)
      local mine, c9 = ms_run("train --resume " .. q(d .. "/ck"))
      assert.equals(0, c9, mine)
      has(mine, "train lsq with mine", "steps 4-6 of 6")
      os.rename(d .. "/optim.lua", d .. "/moved.lua")
      local gone, c10 = ms_run("train --resume " .. q(d .. "/ck"))
      assert.equals(2, c10, gone)
      has(gone, "the checkpoint's recipe: cannot read recipe", "optim.lua", "name the recipe with --recipe")
      local named, c11 = ms_run("train --resume " .. q(d .. "/ck") .. " --recipe " .. q(d .. "/moved.lua"))
      assert.equals(0, c11, named)
      has(named, "steps 4-6 of 6")
    end)

    it("resumes on the checkpoint's device, or on the best one with a note where that device is not usable", function()
      local d = scratch()
      local _, c1 = ms_run(SMALL_MLP .. "--device cpu --until 6 --save " .. q(d .. "/ck"))
      assert.equals(0, c1)
      local tensors, meta = H.ms.load(d .. "/ck/model.safetensors")
      local info = H.ms.json.decode(meta.moonstep_train)
      assert.equals("cpu", info.device)
      -- the same checkpoint, as if it had run on a GPU this machine does not have
      info.device = "cuda:97"
      os.execute("mkdir " .. q(d .. "/moved") .. " && cp " .. q(d .. "/ck/optim.safetensors") .. " " .. q(d .. "/moved/"))
      H.ms.save(d .. "/moved/model.safetensors", tensors, { moonstep_train = H.ms.json.encode(info) })
      local out, c2 = ms_run("train --resume " .. q(d .. "/moved"))
      assert.equals(0, c2, out)
      has(out, "note: the checkpoint ran on cuda:97, which is not usable here; running on " .. H.ms.best_device(),
          "train mlp with adamw on " .. H.ms.best_device(), "steps 7-12 of 12")
      -- --device still decides
      local cpu, c3 = ms_run("train --resume " .. q(d .. "/moved") .. " --device cpu")
      assert.equals(0, c3, cpu)
      has(cpu, "train mlp with adamw on cpu (resuming")
      assert.falsy(cpu:find("note:", 1, true), cpu)
      -- a device field that is no name is a corrupt description
      info.device = 7
      H.ms.save(d .. "/moved/model.safetensors", tensors, { moonstep_train = H.ms.json.encode(info) })
      local bad, c4 = ms_run("train --resume " .. q(d .. "/moved"))
      assert.equals(2, c4, bad)
      has(bad, "corrupt run description: 'device' is 7, not a device name")
    end)

    it("refuses to --save over another run's checkpoint unless --force; the resumed one's folder is its own", function()
      local d = scratch()
      local _, c1 = ms_run(SMALL_MLP .. "--until 6 --save " .. q(d .. "/ck"))
      assert.equals(0, c1)
      local before = read(d .. "/ck/model.safetensors")
      -- another run (it overwrote the checkpoint silently)
      local out, c2 = ms_run("train " .. LSQ .. " --recipe sgd --steps 3 --save " .. q(d .. "/ck"))
      assert.equals(2, c2, out)
      has(out, "--save " .. d .. "/ck", "checkpoint of another run", "--force")
      assert.falsy(out:find("step 1", 1, true), out)
      assert.equals(before, read(d .. "/ck/model.safetensors"))
      -- ... or half of one: a folder with optim.safetensors alone
      os.execute("mkdir " .. q(d .. "/half") .. " && cp " .. q(d .. "/ck/optim.safetensors") .. " " .. q(d .. "/half/"))
      out, c2 = ms_run("train " .. LSQ .. " --recipe sgd --steps 3 --save " .. q(d .. "/half"))
      assert.equals(2, c2, out)
      -- resuming into the folder it resumes from continues that run (a path to it of another spelling too)
      out, c2 = ms_run("train --resume " .. q(d .. "/ck") .. " --until 8 --save " .. q(d .. "/./ck/"))
      assert.equals(0, c2, out)
      has(out, "steps 7-8 of 12")
      assert.equals(8, require("moonstep.experiment").checkpoint_info(d .. "/ck").step)
      -- and --force overwrites another run's
      out, c2 = ms_run("train " .. LSQ .. " --recipe sgd --steps 3 --force --save " .. q(d .. "/ck"))
      assert.equals(0, c2, out)
      assert.equals("lsq", require("moonstep.experiment").checkpoint_info(d .. "/ck").problem)
      -- an empty folder, or one without a checkpoint, is no other run's
      os.execute("mkdir " .. q(d .. "/empty"))
      os.execute("mkdir " .. q(d .. "/notes"))
      write(d .. "/notes/readme.txt", "notes")
      for _, f in ipairs { "/empty", "/notes" } do
        out, c2 = ms_run("train " .. LSQ .. " --recipe sgd --steps 3 --save " .. q(d .. f))
        assert.equals(0, c2, out)
      end
    end)

    it("resumes with the recipe options of the checkpoint's run (--opt given to the first run)", function()
      local d = scratch()
      local common = SMALL_MLP .. "--opt lr=0.01 "
      local _, c1 = ms_run(common .. "--save " .. q(d .. "/full"))
      assert.equals(0, c1)
      local _, c2 = ms_run(common .. "--until 6 --save " .. q(d .. "/half"))
      assert.equals(0, c2)
      -- no --opt here: lr=0.01 comes from the checkpoint, as the problem options and the schedule do
      local rest, c3 = ms_run("train --problem mlp --recipe adamw --resume " .. q(d .. "/half") .. " --save " .. q(d .. "/rest"))
      assert.equals(0, c3, rest)
      has(rest, "lr=0.01")
      local ms = H.ms
      local a = ms.load(d .. "/full/model.safetensors")
      local b = ms.load(d .. "/rest/model.safetensors")
      for name, t in pairs(a) do assert.equals(0, (t - b[name]):abs():max(), name) end
      -- an option given on resuming still wins
      local other, c4 = ms_run("train --problem mlp --recipe adamw --opt lr=0.02 --resume " .. q(d .. "/half"))
      assert.equals(0, c4, other)
      has(other, "lr=0.02")
    end)

    it("refuses a --steps, --schedule, --warmup or --clip that changes the checkpoint's schedule, unless --force", function()
      local d = scratch()
      -- cosine over 12 steps, stopped at 6
      local _, c1 = ms_run(SMALL_MLP .. "--schedule cosine --clip 1 --until 6 --save " .. q(d .. "/half"))
      assert.equals(0, c1)
      local resume = "train --problem mlp --recipe adamw --resume " .. q(d .. "/half")
      for _, case in ipairs {
        { "--steps 20", "steps 20 (the checkpoint's run: 12)" },
        { "--schedule constant", "schedule constant (the checkpoint's run: cosine)" },
        { "--warmup 3", "warmup 3" },
        { "--clip 0", "clip off (the checkpoint's run: 1)" },
      } do
        local out, code = ms_run(resume .. " " .. case[1])
        assert.equals(2, code, out)
        has(out, case[2], "pass --force")
        assert.falsy(out:find("steps 7-", 1, true), out)
      end
      -- the same values as the checkpoint's are no contradiction; --force resumes under the new schedule
      local same, c2 = ms_run(resume .. " --steps 12 --schedule cosine --clip 1")
      assert.equals(0, c2, same)
      has(same, "steps 7-12 of 12")
      local forced, c3 = ms_run(resume .. " --steps 20 --force")
      assert.equals(0, c3, forced)
      has(forced, "steps 7-20 of 20")
      -- a constant schedule does not depend on --steps: extending such a run continues it
      local _, c4 = ms_run(SMALL_MLP .. "--schedule constant --warmup 0 --until 6 --save " .. q(d .. "/flat"))
      assert.equals(0, c4)
      local longer, c5 = ms_run("train --problem mlp --recipe adamw --steps 20 --resume " .. q(d .. "/flat"))
      assert.equals(0, c5, longer)
      has(longer, "steps 7-20 of 20")
    end)

    it("refuses a checkpoint whose two files are from different steps (a save interrupted between them)", function()
      local d = scratch()
      local common = SMALL_MLP
      local _, c1 = ms_run(common .. "--until 3 --save " .. q(d .. "/ck"))
      assert.equals(0, c1)
      local _, c2 = ms_run(common .. "--until 6 --save " .. q(d .. "/later"))
      assert.equals(0, c2)
      -- saving over ck at step 6, stopped after optim.safetensors was replaced and before model.safetensors
      write(d .. "/ck/optim.safetensors", read(d .. "/later/optim.safetensors"))
      local out, code = ms_run("train --problem mlp --recipe adamw --resume " .. q(d .. "/ck"))
      assert.equals(2, code, out)
      has(out, "step 6", "step 3")
      assert.falsy(out:find("steps 7-12", 1, true), out)
    end)

    it("refuses to resume under an edited recipe file (its content hash changed)", function()
      local d = scratch()
      local src = [[
return {
  name = "mine", options = {lr = {default = %s, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o, ctx)
    for _, m in ipairs(group) do m.param:sub_(m.grad * ctx.lr) end
  end}},
}]]
      write(d .. "/optim.lua", src:format("0.1"))
      local _, c1 = ms_run("train " .. LSQ .. " --steps 6 --until 3 --recipe " .. q(d .. "/optim.lua") .. " --save " .. q(d .. "/ck"))
      assert.equals(0, c1)
      write(d .. "/optim.lua", src:format("0.2"))    -- same name, different code
      local out, c2 = ms_run("train --problem lsq --recipe " .. q(d .. "/optim.lua") .. " --resume " .. q(d .. "/ck"))
      assert.equals(2, c2, out)
      has(out, "checkpoint of recipe 'mine'", "pass --force")
    end)
  end)

  it("checks the output and checkpoint folders before training, not after", function()
    local d = scratch()
    write(d .. "/file", "not a folder")
    local out, code = ms_run("compare " .. LSQ .. " --recipes adamw,sgd --steps 5 --out " .. q(d .. "/file/out"))
    assert.equals(1, code, out)
    has(out, "cannot create output folder")
    assert.falsy(out:find("[1/2]", 1, true), "trained before finding the output folder unusable:\n" .. out)
    out, code = ms_run("train " .. LSQ .. " --recipe adamw --steps 5 --save " .. q(d .. "/file/ck"))
    assert.equals(1, code, out)
    has(out, "cannot create checkpoint folder")
    assert.falsy(out:find("step 5/5", 1, true), "trained before finding the checkpoint folder unusable:\n" .. out)
  end)

  it("compare leaves no output folder behind when its recipes or options are refused", function()
    local d = scratch()
    for _, case in ipairs {
      { "--recipes adamw,sgd --opt lrate=1", 2 },   -- no recipe has the option
      { "--recipes adamw --opt lr=fast", 2 },       -- a bad value
      { "--recipes adamw,nosuch", 2 },              -- a recipe that is not found
      { "--recipes adamw,adamw", 2 },               -- the same recipe twice
    } do
      local bad = case[1]
      local out, code = ms_run("compare " .. LSQ .. " --steps 5 " .. bad .. " --out " .. q(d .. "/new/out"))
      assert.equals(case[2], code, bad .. ":\n" .. out)
      assert.falsy(out:find("[1/", 1, true), out)
      assert.equals("exit=0\n", H.shell("ls -A " .. q(d)), bad .. ": an output folder was created:\n" .. out)
    end
  end)

  describe("compare", function()
    it("fails, and keeps the files of an earlier comparison whole, when it cannot write its own", function()
      local d = scratch()
      local cmd = "compare " .. LSQ .. " --recipes sgd,adamw --eval-every 100 --plotter builtin --out " .. q(d)
      local out, code = ms_run(cmd .. " --steps 20")
      assert.equals(0, code, out)
      local before = read(d .. "/loss.csv")
      assert.truthy(#before > 1024 and #before < 2048, #before)
      -- files of at most 2 KiB (SIGXFSZ ignored: a write past the limit fails with EFBIG): the new loss.csv does
      -- not fit
      out, code = ms_run(cmd .. " --steps 60", "trap '' XFSZ; ulimit -f 2;")
      assert.equals(1, code, out)
      has(out, "cannot write " .. d .. "/loss.csv")
      assert.equals(before, read(d .. "/loss.csv"))
      local left = H.shell("ls -A " .. q(d))
      assert.falsy(left:find("tmp", 1, true), left)
    end)

    it("runs every recipe on the same data and writes the table, CSV and plots #external", function()
      local d = scratch()
      local out, code = ms_run("compare " .. LSQ .. " --recipes sgd,adamw,lion --steps 20 --seeds 2 --eval-every 10 --opt adamw.lr=0.05 --out " .. q(d))
      assert.equals(0, code, out)
      has(out, "compare lsq on cpu: sgd, adamw, lion, 20 steps, 2 seeds", "[1/6] sgd, seed 0", "[6/6] lion, seed 1",
          "recipe", "val loss (±range)", "state bytes", "best: ", "worst: ", "seed-to-seed range", "plot: ")
      -- every recipe has a row, with state bytes from opt:info() (lion and sgd with momentum one buffer, adamw two)
      local rows = {}
      for line in out:gmatch("[^\n]+") do
        local name, bytes = line:match("^(%a+)%s+[%d%.]+ ±[%d%.]+.-(%d+)$")
        if name then rows[name] = tonumber(bytes) end
      end
      assert.same({ sgd = 4 * (16 + 2), adamw = 2 * 4 * (16 + 2), lion = 4 * (16 + 2) }, rows)
      -- CSV: a header and one line per step, recipe and seed
      local csv = read(d .. "/loss.csv")
      local n = 0
      for _ in csv:gmatch("\n") do n = n + 1 end
      assert.equals(1 + 3 * 2 * 20, n)
      has(csv, "recipe,seed,step,train_loss,train_loss_avg,val_loss,val_accuracy", "adamw,1,20,")
      -- the same seed means the same data: the first step's loss is the same for every recipe
      local first = {}
      for r, l in csv:gmatch("\n(%a+),0,1,([^,]+),") do first[#first + 1] = l end
      assert.equals(3, #first)
      assert.equals(first[1], first[2])
      assert.equals(first[1], first[3])
      has(read(d .. "/summary.csv"), "recipe,seeds,val_loss", "adamw,2,")
      has(read(d .. "/summary.txt"), "best: ")
      if require("moonstep.plot").find_gnuplot() then
        assert.equals("\137PNG", read(d .. "/loss.png"):sub(1, 4))
        has(read(d .. "/loss.svg"), "<svg")
        has(out, d .. "/loss.png", "plotted with gnuplot")
      else
        has(out, "built-in renderer")
      end
    end)

    it("leaves no stale plot of an earlier comparison beside a new one drawn without gnuplot", function()
      local d = scratch()
      -- an earlier comparison in the same folder, plotted by a "gnuplot" (a stand-in that writes both files)
      local fake = d .. "/fake-gnuplot"
      write(fake, "#!/bin/sh\nprintf '\\211PNG old' > loss.png\necho '<svg>old</svg>' > loss.svg\n")
      os.execute("chmod +x " .. q(fake))
      local out, code = ms_run("compare " .. LSQ .. " --recipes sgd --steps 4 --out " .. q(d .. "/out"), "MOONSTEP_GNUPLOT=" .. q(fake))
      assert.equals(0, code, out)
      assert.truthy(read(d .. "/out/loss.png") and read(d .. "/out/loss.gp"))
      -- the new one, without gnuplot: its SVG alone, and no loss.png / loss.gp of the old curves beside it
      out, code = ms_run("compare " .. LSQ .. " --recipes adamw --steps 4 --out " .. q(d .. "/out"), "MOONSTEP_GNUPLOT=none")
      assert.equals(0, code, out)
      has(read(d .. "/out/loss.svg"), "adamw")
      assert.is_nil(read(d .. "/out/loss.png"), "a stale loss.png of the earlier comparison is left")
      assert.is_nil(read(d .. "/out/loss.gp"), "a stale loss.gp of the earlier comparison is left")
    end)

    it("draws the SVG itself when gnuplot is missing, and says so", function()
      local d = scratch()
      local out, code = ms_run("compare " .. LSQ .. " --recipes sgd,adamw --steps 8 --out " .. q(d), "MOONSTEP_GNUPLOT=none")
      assert.equals(0, code, out)
      has(out, "gnuplot not found", "drew the SVG with the built-in renderer (no PNG)", "plot: " .. d .. "/loss.svg")
      assert.is_nil(read(d .. "/loss.png"))
      local svg = read(d .. "/loss.svg")
      has(svg, "<svg", "<polyline", "sgd (train", "adamw (validation)")
      local out2, code2 = ms_run("compare " .. LSQ .. " --recipes sgd --steps 4 --plotter builtin --out " .. q(d .. "/b"))
      assert.equals(0, code2, out2)
      has(out2, "built-in renderer")
      local _, code3 = ms_run("compare " .. LSQ .. " --recipes sgd --steps 4 --plotter gnuplot --out " .. q(d .. "/c"), "MOONSTEP_GNUPLOT=none")
      assert.equals(1, code3)
    end)

    it("refuses --plotter gnuplot without gnuplot before the runs", function()
      -- found after the runs, it ended the command with the table unprinted
      local d = scratch()
      local out, code = ms_run("compare " .. LSQ .. " --recipes sgd --steps 3 --plotter gnuplot --out " .. q(d),
                               "MOONSTEP_GNUPLOT=none")
      assert.equals(1, code, out)
      has(out, "--plotter gnuplot: gnuplot is not found")
      assert.is_nil(out:find("[1/1]", 1, true), "a run started:\n" .. out)
      assert.is_nil(read(d .. "/loss.csv"), "a run was written")
    end)

    it("keeps going when one recipe fails, marks it, and exits 1", function()
      local d = scratch()
      write(d .. "/broken.lua", [[
return {
  name = "broken", options = {lr = {default = 0.1, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o, ctx) if ctx.step == 2 then error("broken on purpose") end end}},
}]])
      local out, code = ms_run("compare " .. LSQ .. " --recipes " .. q(d .. "/broken.lua") .. ",sgd --steps 5 --seeds 2 --out " .. q(d .. "/o"))
      assert.equals(1, code)
      has(out, "broken failed (seed 0): recipe 'broken' failed at step 2", "broken       failed:", "only sgd finished")
      assert.truthy(read(d .. "/o/loss.csv"))
      -- summary.csv counts the seeds that ran, not those asked for
      local summary = read(d .. "/o/summary.csv")
      has(summary, "\nsgd,2,", "\nbroken,0,")
    end)

    it("checks option assignments against the recipes of the run", function()
      local unused = scratch()
      local out, code = ms_run("compare " .. LSQ .. " --recipes sgd,adamw --steps 3 --opt betas=0.9,0.9 --out " .. q(unused))
      assert.equals(0, code, out)    -- betas exists in adamw only: applied there
      out, code = ms_run("compare " .. LSQ .. " --recipes sgd,adamw --steps 3 --opt nesterovv=true")
      assert.equals(2, code, out)
      has(out, "no recipe of this run (sgd, adamw) has an option 'nesterovv'")
      out, code = ms_run("compare " .. LSQ .. " --recipes sgd,adamw --steps 3 --opt lion.lr=1")
      assert.equals(2, code, out)
      has(out, "no recipe named 'lion' in this run")
      out, code = ms_run("compare " .. LSQ .. " --recipes sgd,sgd --steps 3")
      assert.equals(2, code)
      has(out, "recipe 'sgd' is given twice")
      -- a recipe that does not exist stops the comparison, unless --skip-missing leaves it out (make run)
      out, code = ms_run("compare " .. LSQ .. " --recipes nosuch,sgd --steps 3 --out " .. q(unused))
      assert.equals(2, code, out)
      has(out, 'no recipe named "nosuch"')
      out, code = ms_run("compare " .. LSQ .. " --recipes nosuch,sgd --steps 3 --skip-missing --out " .. q(unused))
      assert.equals(0, code, out)
      has(out, 'skipping nosuch: no recipe named "nosuch"', "compare lsq on cpu: sgd, 3 steps")
      out, code = ms_run("compare " .. LSQ .. " --recipes nosuch --steps 3 --skip-missing")
      assert.equals(1, code)
      has(out, "none of the recipes could be loaded")
    end)
  end)

  describe("bench", function()
    it("lists the benchmarks and runs one by name, with arguments", function()
      local out, code = ms_run("bench")
      assert.equals(0, code)
      has(out, "core", "core ops")
      -- the dispatcher is a table: a registry with a script of our own
      local d = scratch()
      write(d .. "/benches.lua", [[return {{name = "echo", script = "echo.lua", summary = "says its arguments", args = {"first"}}}]])
      write(d .. "/echo.lua", [[print("bench echo:", table.concat(arg, " "), ms ~= nil)]])
      out, code = ms_run("bench echo second", "MOONSTEP_BENCH_DIR=" .. q(d))
      assert.equals(0, code, out)
      has(out, "bench echo:\tfirst second\ttrue")
      out, code = ms_run("bench nope", "MOONSTEP_BENCH_DIR=" .. q(d))
      assert.equals(2, code)
      has(out, "unknown benchmark 'nope' (known: echo)")
    end)
  end)

  it("compare's verdict gives no relative difference against a best validation loss of 0", function()
    local E = require("moonstep.experiment")
    local rows = { { recipe = "a", val_loss = 0, val_spread = 0 }, { recipe = "b", val_loss = 0.25, val_spread = 0 } }
    local _, verdict = E.format_table({ seeds = 1, rows = rows })
    assert.truthy(verdict:find("+0.2500)", 1, true), verdict)
    assert.falsy(verdict:find("inf") or verdict:find("nan"), verdict)
    rows[1].val_loss = 0.2
    _, verdict = E.format_table({ seeds = 1, rows = rows })
    assert.truthy(verdict:find("+0.0500, 25.0%)", 1, true), verdict)
  end)

  it("info prints the version, build, devices and libraries", function()
    local out, code = ms_run("info")
    assert.equals(0, code)
    has(out, "moonstep " .. H.ms.version, "build ", "backends: cpu", "library ", "LuaJIT", "openblas  OpenBLAS",
        "devices", "  cpu ", "GiB of system memory", "cuda", "recipes ", "lion", "muon", "problems  lsq, mlp, lm", "best ")
    if H.has_cuda then has(out, "cuda:0") end
  end)
end)
