-- bench/dist_bench.lua runs (its --tiny set, on the CPU's communicator): 2 ranks through `moonstep launch` give
-- a markdown table of 1-rank and 2-rank step times with the bytes each step communicates, and one rank the
-- 1-rank rows alone.  The numbers here are CPU timings of toy shapes: only that they exist and are sane is
-- checked, and the bytes against what the problem implies.
local function run(args)
  local out, code = H.moonstep("launch " .. args)
  return out, code
end

local function positive(v) return type(v) == "number" and v > 0 and v < math.huge end

describe("bench/dist_bench.lua --tiny", function()
  it("times 1 rank and 2 ranks and counts the bytes a step communicates", function()
    local json_path = os.tmpname()
    local out, code = run("-n 2 bench/dist_bench.lua --tiny --what sinkgd,dash --trials 2 --json " .. json_path)
    assert.are.equal(0, code, out)
    assert.is_truthy(out:find("| step | 1 GPU (ms) | 2 ranks (ms) | speed-up |", 1, true), out)
    local f = assert(io.open(json_path))
    local res = H.ms.json.decode(f:read("*a"))
    f:close()
    os.remove(json_path)
    assert.are.equal(2, res.ranks)
    local sinkgd, dash = res.steps[1], res.steps[2]
    assert.is_truthy(sinkgd.what:find("^sinkgd base"), sinkgd.what)
    assert.is_truthy(dash.what:find("^dash ndb%-pim"), dash.what)
    for _, r in ipairs { sinkgd, dash } do
      assert.is_true(positive(r.single_ms) and positive(r.step_ms), r.what)
      assert.is_true(positive(r.allreduce_one_ms) and positive(r.allreduce_calls_ms), r.what)
      assert.is_true(r.calls >= 1 and positive(r.bytes), r.what)
      assert.is_truthy(out:find("| " .. r.what .. " |", 1, true), out)
    end
    -- rows-sharded SinkGD, 5 Sinkhorn iterations: 5 exchanges of the 14 matrices' column sums (f64 on the CPU)
    local sum_n = 2 * (6 * 4096 + 14336) / 64
    assert.are.equal(5, sinkgd.contract_calls)
    assert.are.equal(5 * sum_n * 8, sinkgd.contract_bytes)
    -- DASH, owner: every parameter broadcast from its owner once a step (counted at the communicator): the
    -- layers' matrices and norms, wte, lm_head and the final norm (the whole model, at 1/32 of every dim)
    local params = 0
    for _, s in ipairs { { 6144, 2048 }, { 2048, 2048 }, { 5632, 2048 }, { 5632, 2048 }, { 2048, 5632 } } do
      params = params + 2 * (s[1] / 32) * (s[2] / 32)
    end
    params = params + 2 * 2 * (2048 / 32) + 2 * (32000 / 32) * (2048 / 32) + 2048 / 32
    assert.are.equal(params * 4, dash.counted_bytes)
    assert.is_true(dash.counted_calls >= 1)
  end)

  it("gives the one-rank rows alone with -n 1", function()
    local out, code = run("-n 1 bench/dist_bench.lua --tiny --what sinkgd --trials 2")
    assert.are.equal(0, code, out)
    local line = out:match("\n(| sinkgd base [^\n]*)")
    assert.is_truthy(line, out)
    local cells = {}
    for c in line:gmatch("|([^|]*)") do cells[#cells + 1] = c:match("^%s*(.-)%s*$") end
    assert.is_true(positive(tonumber(cells[2])), line)
    assert.are.equal("-", cells[3], line)
  end)

  it("refuses unknown arguments", function()
    local out, code = run("-n 1 bench/dist_bench.lua --tiny --what everything")
    assert.are_not.equal(0, code, out)
    assert.is_truthy(out:find("--what takes sinkgd, dash, allreduce (got everything)", 1, true), out)
  end)
end)
