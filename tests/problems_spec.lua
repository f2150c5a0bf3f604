-- The built-in problems (lua/moonstep/problems): hand-written gradients against central finite
-- differences in f64, determinism of data and batches, option checking, and what each problem promises
-- (lsq's condition number, lm's ordered context), on the CPU and, where present, on CUDA.
local problems = require("moonstep.problems")
local L = require("moonstep.problems.layers")

local ms = H.ms

-- small instances: the checks are about the formulas, not the sizes
local SMALL = {
  lsq = { dim = 6, outputs = 3, samples = 20, cond = 50, noise = 0.1 },
  mlp = { classes = 3, points = 10, hidden = 8, layers = 2, batch = 12 },
  lm = { width = 12, layers = 2, context = 32, embed = 3, ffn = 10, batch = 4, val_windows = 16 },
}

-- compares every parameter's gradient with (L(p + h e_i) - L(p - h e_i)) / 2h at `probes` coordinates
local function fd_check(name, seed, probes)
  local inst = problems.new(name, SMALL[name], { device = "cpu", dtype = "f64", seed = seed })
  -- parameters start away from their initial values (zero biases, unit gains) so that every term counts
  for i, p in ipairs(inst.params) do
    p.param:add_(ms.randn(p.param:shape(), { seed = seed, offset = 500 + i, std = 0.3, dtype = "f64" }))
  end
  local batch = inst.train_batch(3)
  local loss = inst.loss_grad(batch)
  assert.is_true(loss > 0 and loss < math.huge, name .. ": loss " .. tostring(loss))
  assert.near(loss, inst.loss(batch), 1e-12 * math.abs(loss))
  local u = L.rng(seed)
  local h = 1e-6
  local checked = 0
  for _, p in ipairs(inst.params) do
    local flat = p.param:view({ p.param:numel() })
    local grad = p.grad:tolist_flat()
    local n = p.param:numel()
    -- half the probes among the coordinates whose gradient is not 0: a sparse gradient (embed_tokens, whose
    -- rows of bytes absent from the batch are 0, about 88% of them here) is otherwise mostly probed where
    -- any formula agrees with the finite difference, and a wrong one passed about every other seed
    local nonzero = {}
    for j = 1, n do if grad[j] ~= 0 then nonzero[#nonzero + 1] = j - 1 end end
    for k = 1, math.min(probes, n) do
      local i = math.floor(u() * n)
      if k % 2 == 1 and #nonzero > 0 then i = nonzero[1 + math.floor(u() * #nonzero)] end
      local x0 = flat[i]:item()
      flat[i] = x0 + h
      local lp = inst.loss(batch)
      flat[i] = x0 - h
      local lm = inst.loss(batch)
      flat[i] = x0
      local fd = (lp - lm) / (2 * h)
      H.assert_close(grad[i + 1], fd, 1e-5, 1e-8, ("%s: d loss / d %s[%d]"):format(name, p.name, i))
      checked = checked + 1
    end
  end
  return checked, inst
end

describe("built-in problems", function()
  describe("gradients match finite differences (f64)", function()
    for _, name in ipairs { "lsq", "mlp", "lm" } do
      it(name, function()
        local checked = fd_check(name, H.seed(), 6)
        assert.is_true(checked >= 6, "too few coordinates checked")
      end)
    end

    it("a wrong gradient is caught by the check (the check can fail)", function()
      local inst = problems.new("lsq", SMALL.lsq, { device = "cpu", dtype = "f64", seed = 1 })
      local batch = inst.train_batch(1)
      inst.loss_grad(batch)
      local p = inst.params[1]
      local g = p.grad:tolist_flat()[1] * 1.001 + 1e-4   -- a slightly wrong derivative
      local flat = p.param:view({ p.param:numel() })
      local x0 = flat[0]:item()
      flat[0] = x0 + 1e-6
      local lp = inst.loss(batch)
      flat[0] = x0 - 1e-6
      local lm = inst.loss(batch)
      flat[0] = x0
      assert.has_error(function() H.assert_close(g, (lp - lm) / 2e-6, 1e-5, 1e-8) end)
    end)
  end)

  it("backward passes overwrite the gradient buffers instead of accumulating", function()
    for _, name in ipairs { "lsq", "mlp", "lm" } do
      local inst = problems.new(name, SMALL[name], { device = "cpu", dtype = "f64", seed = 2 })
      local b = inst.train_batch(1)
      inst.loss_grad(b)
      local first = {}
      for i, p in ipairs(inst.params) do first[i] = p.grad:tolist_flat() end
      inst.loss_grad(b)
      for i, p in ipairs(inst.params) do H.assert_close(p.grad:tolist_flat(), first[i], 0, 0, name .. " " .. p.name) end
    end
  end)

  it("uses realistic parameter names, so recipes route them as they route real models", function()
    local names = {}
    for _, p in ipairs(problems.new("lm", SMALL.lm, { device = "cpu", seed = 1 }).params) do names[p.name] = p end
    for _, n in ipairs { "embed_tokens.weight", "lm_head.weight", "layers.0.up_proj.weight", "layers.0.up_proj.bias",
                         "layers.1.norm.weight", "norm.weight", "context_proj.weight" } do
      assert.is_truthy(names[n], n)
    end
    assert.same({ 256, 3 }, names["embed_tokens.weight"].param:shape())
    assert.same({ 256, 12 }, names["lm_head.weight"].param:shape())       -- untied, [vocab, width]
    -- muon keeps the embedding and the head on its AdamW route, and the hidden matrices on Muon
    local inst = problems.new("lm", SMALL.lm, { device = "cpu", seed = 1 })
    local info = ms.optim.new("muon", inst.params):info()
    local route = {}
    for _, p in ipairs(info.params) do route[p.name] = p.route end
    assert.equals("adamw", route["embed_tokens.weight"])
    assert.equals("adamw", route["lm_head.weight"])
    assert.equals("adamw", route["layers.0.norm.weight"])
    assert.equals("muon", route["layers.0.up_proj.weight"])
    assert.equals("muon", route["context_proj.weight"])
  end)

  it("draws the same data and batches for the same seed, other ones for another seed", function()
    for _, name in ipairs { "lsq", "mlp", "lm" } do
      local a = problems.new(name, SMALL[name], { device = "cpu", seed = 5 })
      local b = problems.new(name, SMALL[name], { device = "cpu", seed = 5 })
      local c = problems.new(name, SMALL[name], { device = "cpu", seed = 6 })
      assert.equals(a.loss(a.train_batch(4)), b.loss(b.train_batch(4)))
      assert.equals(a.evaluate().loss, b.evaluate().loss)
      assert.are_not.equal(a.loss(a.train_batch(4)), c.loss(c.train_batch(4)), name)
      if name ~= "lsq" then   -- minibatch problems: another step, another batch
        assert.are_not.equal(a.loss(a.train_batch(4)), a.loss(a.train_batch(5)), name)
      end
    end
  end)

  it("draws other batches at other steps for every seed, large ones included", function()
    -- the batch positions come from L.rng(seed * 1000003 + step): its seeding must stay exact for large
    -- seeds, or whole runs cycle through a handful of batches
    for _, seed in ipairs { 3, 123456789, 2 ^ 31 - 1, 5e9 } do
      for _, name in ipairs { "mlp", "lm" } do
        local inst = problems.new(name, SMALL[name], { device = "cpu", seed = seed })
        local seen, distinct = {}, 0
        for step = 1, 40 do
          local l = inst.loss(inst.train_batch(step))
          if not seen[l] then seen[l] = true distinct = distinct + 1 end
        end
        assert.is_true(distinct >= 38, ("%s, seed %d: %d distinct batches in 40 steps"):format(name, seed, distinct))
      end
      -- and the uniform stream of one such seed is spread over [0, 1), not stuck on a coarse grid
      local firsts = {}
      for step = 1, 64 do firsts[#firsts + 1] = L.rng(seed * 1000003 + step)() end
      table.sort(firsts)
      local gaps = 0
      for i = 2, #firsts do if firsts[i] ~= firsts[i - 1] then gaps = gaps + 1 end end
      assert.equals(63, gaps, "distinct first draws, seed " .. seed)
    end
  end)

  it("mlp: no step's batch generator is one the data sets were made with", function()
    -- seed 0 (the default) once gave steps 1 and 2 the training and validation sets' own generators
    local mlp = require("moonstep.problems.mlp")
    for _, seed in ipairs { 0, 1, 2, 17, 4242 } do
      local data = {}
      for stream = 1, 2 do data[L.rng(mlp.data_seed(seed, stream))()] = stream end
      for step = 1, 20000 do
        local first = L.rng(mlp.batch_seed(seed, step))()
        assert.is_nil(data[first], ("seed %d, step %d draws with data stream %s's generator"):format(seed, step,
                                                                                         tostring(data[first])))
      end
    end
  end)

  it("lsq: the Hessian X^T X / n has the requested condition number", function()
    local inst = problems.new("lsq", { dim = 16, samples = 64, cond = 1000 }, { device = "cpu", dtype = "f64", seed = H.seed() })
    local x = inst.train_data.x
    local w = ms.eigh(ms.matmul(x, x, { trans_a = true }) / 64):tolist_flat()
    H.assert_close(w[#w], 1, 1e-9, 0, "largest eigenvalue")
    H.assert_close(w[#w] / w[1], 1000, 1e-8, 0, "condition number")
    -- without noise the minimum is 0: the exact solution reaches it
    local quiet = problems.new("lsq", { dim = 4, samples = 16, cond = 10, outputs = 2 }, { device = "cpu", dtype = "f64", seed = 1 })
    assert.is_true(quiet.loss(quiet.train_batch(1)) > 1)
  end)

  it("mlp: starts near chance and reports accuracy", function()
    local inst = problems.new("mlp", { classes = 4, points = 50, hidden = 16 }, { device = "cpu", seed = 3 })
    local ev = inst.evaluate()
    assert.is_true(math.abs(ev.loss - math.log(4)) < 0.7, "initial loss " .. ev.loss)
    assert.is_true(ev.accuracy >= 0 and ev.accuracy <= 1)
    assert.truthy(inst.describe():find("4 spirals", 1, true))
  end)

  describe("lm", function()
    it("conditions on the whole context, in order", function()
      local inst = problems.new("lm", SMALL.lm, { device = "cpu", dtype = "f64", seed = H.seed() })
      local row = {}
      for t = 1, 33 do row[t] = 97 + (t * 7) % 26 end
      local base = inst.loss(inst.batch_of_bytes({ row }))
      -- the oldest of the 32 bytes matters
      local far = { unpack(row) }
      far[1] = 32
      assert.is_true(math.abs(inst.loss(inst.batch_of_bytes({ far })) - base) > 1e-9)
      -- swapping two bytes of the context changes the prediction: order is seen, not only the bag of bytes
      local swapped = { unpack(row) }
      swapped[1], swapped[2] = row[2], row[1]
      assert.is_true(math.abs(inst.loss(inst.batch_of_bytes({ swapped })) - base) > 1e-9)
    end)

    it("trains on --data FILE and holds out validation windows", function()
      local path = os.tmpname()
      local f = assert(io.open(path, "wb"))
      f:write(("the quick brown fox jumps over the lazy dog. "):rep(60))
      f:close()
      local inst = problems.new("lm", { width = 8, embed = 2, context = 32, data = path, val_windows = 50 }, { device = "cpu", seed = 1 })
      os.remove(path)
      assert.equals(45 * 60, inst.corpus_bytes)
      assert.equals(50, inst.val_windows)
      assert.is_true(inst.train_windows > 1000)
      assert.truthy(inst.describe():find(path, 1, true))
      local ev = inst.evaluate()
      assert.is_true(ev.loss > 0 and ev.accuracy >= 0)
    end)

    it("keeps a large --data file in about its own size of memory", function()
      -- a window list of one Lua number per byte (and another per training window) took 16 bytes of heap
      -- per byte of data: 3.7 GB for a 140 MB file, so enwik9-sized data ran out of memory
      local path = os.tmpname()
      local f = assert(io.open(path, "wb"))
      local line = "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.\n"
      f:write(line:rep(math.floor(4 * 2 ^ 20 / #line)))
      f:close()
      collectgarbage()
      collectgarbage()
      local before = collectgarbage("count") * 1024
      local inst = problems.new("lm", { width = 8, embed = 2, context = 8, data = path, val_windows = 16 }, { device = "cpu", seed = 1 })
      collectgarbage()
      collectgarbage()
      local grew = collectgarbage("count") * 1024 - before
      os.remove(path)
      assert.is_true(grew < 3 * inst.corpus_bytes, ("%.0f bytes of Lua heap for %d bytes of data"):format(grew, inst.corpus_bytes))
      assert.is_true(inst.train_windows > 0.85 * inst.corpus_bytes)
      local ev = inst.evaluate()
      assert.is_true(ev.loss > 0 and ev.loss < math.huge)
      assert.is_true(inst.loss(inst.train_batch(7)) > 0)
    end)

    it("defaults to the license texts of Debian (or generated text where they are missing)", function()
      local text, source = require("moonstep.problems.lm").corpus("")
      assert.is_true(#text > 100000, "corpus of " .. #text .. " bytes")
      local f = io.open("/usr/share/common-licenses/GPL-3", "rb")
      if f then
        f:close()
        assert.truthy(source:find("common-licenses", 1, true))
        assert.truthy(text:find("GNU GENERAL PUBLIC LICENSE", 1, true))
      else
        assert.truthy(source:find("generated", 1, true))
      end
    end)

    it("refuses a missing or too short data file", function()
      H.expect_error(function() problems.new("lm", { data = "/nonexistent/corpus.txt" }, { device = "cpu" }) end,
        "cannot read data file '/nonexistent/corpus.txt'")
      local path = os.tmpname()
      local f = assert(io.open(path, "wb"))
      f:write("tiny")
      f:close()
      H.expect_error(function() problems.new("lm", { data = path }, { device = "cpu" }) end, "at least")
      os.remove(path)
    end)
  end)

  it("checks options and names", function()
    H.expect_error(function() problems.get("nope") end, "unknown problem 'nope'", "lsq, mlp, lm")
    H.expect_error(function() problems.new("lsq", { condition = 3 }) end, "unknown problem option 'condition'", "cond")
    H.expect_error(function() problems.new("lm", { width = "wide" }) end, "option 'width'", "integer")
    H.expect_error(function() problems.new("lsq", { cond = 0.5 }) end, "below its minimum")
    H.expect_error(function() problems.new("mlp", {}, { seed = -1 }) end, "seed must be a non-negative integer")
    H.expect_error(function() problems.new("mlp", {}, { sed = 1 }) end, "unknown environment key 'sed'")
    H.expect_error(function() problems.new("lsq", {}, { dtype = "f65" }) end, "unknown dtype \"f65\"")
    -- values from the command line arrive as strings and are converted by the declared type
    local o = problems.options(problems.get("lm"), { width = "64", data = "x.txt" })
    assert.equals(64, o.width)
    assert.equals(32, o.context)
  end)

  H.cuda_it("runs on CUDA with the CPU's data and losses", function()
    for _, name in ipairs { "lsq", "mlp", "lm" } do
      local cpu = problems.new(name, SMALL[name], { device = "cpu", seed = 9 })
      local gpu = problems.new(name, SMALL[name], { device = "cuda", seed = 9 })
      local bc, bg = cpu.train_batch(2), gpu.train_batch(2)
      H.assert_close(gpu.loss_grad(bg), cpu.loss_grad(bc), 1e-4, 1e-5, name .. " loss")
      for i, p in ipairs(cpu.params) do
        H.assert_close(gpu.params[i].grad:tolist_flat(), p.grad:tolist_flat(), 1e-3, 1e-5, name .. " " .. p.name)
      end
      H.assert_close(gpu.evaluate().loss, cpu.evaluate().loss, 1e-4, 1e-5, name .. " validation")
    end
  end)
end)
