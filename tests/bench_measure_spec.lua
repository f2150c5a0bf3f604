-- The benchmarks' arithmetic (bench/measure.lua) and clock (bench/timing.lua) on the CPU: the median of trials
-- and the SinkGD floors against hand computations (issue 5, research/anchors-h200.md).  No timing is asserted.
local M = dofile("bench/measure.lua")

describe("bench/measure.lua", function()
  it("median: the middle value, or the mean of the middle two for an even count", function()
    assert.are.equal(2, M.median({ 3, 1, 2 }))
    assert.are.equal(2.5, M.median({ 4, 1, 3, 2 }))
    assert.are.equal(5, M.median({ 5 }))
    assert.are.equal(1.5, M.median({ 2, 1 }))
    -- six trials, as the Llama-3-8B set is timed: not the lower middle value (3), the mean of 3 and 5
    assert.are.equal(4, M.median({ 9, 1, 3, 5, 2, 7 }))
    local t = { 3, 1, 2, 4 }
    M.median(t)
    assert.are.same({ 3, 1, 2, 4 }, t)
  end)

  it("SinkGD floor: (L+1) reads of G + read and write of p, spectral + 2 reads of G a power step", function()
    local g = 2048 * 2048 * 2   -- bf16 G and p
    assert.are.equal(8 * g, M.sinkgd_floor_bytes(g, g, 5, false))
    assert.are.equal(10 * g, M.sinkgd_floor_bytes(g, g, 5, true, 1))
    assert.are.equal(12 * g, M.sinkgd_floor_bytes(g, g, 5, true, 2))
    -- f32 p with bf16 G: p's bytes count at 4, G's at 2
    assert.are.equal(6 * g + 2 * 2 * g, M.sinkgd_floor_bytes(g, 2 * g, 5, false))
    assert.are.equal(2, M.elem_bytes("bf16"))
    assert.are.equal(2, M.elem_bytes("f16"))
    assert.are.equal(4, M.elem_bytes("f32"))
  end)

  it("SinkGD floors in ms match research/anchors-h200.md and issue 5", function()
    local bw = 4248e9
    -- anchors, sinkgd.py table: 2048x2048 base 0.016 / spectral 0.020; 14336x4096 0.221 / 0.276 ms
    local b = 2048 * 2048 * 2
    assert.is_true(math.abs(M.floor_ms(M.sinkgd_floor_bytes(b, b, 5, false), bw) - 0.016) < 0.0005)
    assert.is_true(math.abs(M.floor_ms(M.sinkgd_floor_bytes(b, b, 5, true, 1), bw) - 0.020) < 0.0005)
    b = 14336 * 4096 * 2
    assert.is_true(math.abs(M.floor_ms(M.sinkgd_floor_bytes(b, b, 5, false), bw) - 0.221) < 0.0005)
    assert.is_true(math.abs(M.floor_ms(M.sinkgd_floor_bytes(b, b, 5, true, 1), bw) - 0.276) < 0.0005)
    -- issue 5: the Llama-3-8B set (32 layers of q, k, v, o, gate, up, down), bf16, floor 26.3 ms at 4.25 TB/s
    local per_layer = 4096 * 4096 * 2 + 1024 * 4096 * 2 + 14336 * 4096 * 3
    b = 32 * per_layer * 2
    assert.are.equal(13958643712, b)
    assert.is_true(math.abs(M.floor_ms(M.sinkgd_floor_bytes(b, b, 5, false), 4.25e12) - 26.3) < 0.05)
    -- and spectral at 4248 GB/s: anchors 32.9 ms
    assert.is_true(math.abs(M.floor_ms(M.sinkgd_floor_bytes(b, b, 5, true, 1), bw) - 32.9) < 0.05)
  end)
end)

describe("bench/timing.lua on the CPU context", function()
  it("each: 3 warm-up calls a variant, then reps calls a trial, indices rising across variants", function()
    local ms = H.ms
    local time, release, each = dofile("bench/timing.lua")(ms.device("cpu"))
    local seen = { {}, {} }
    local fns = {}
    for v = 1, 2 do fns[v] = function(i) seen[v][#seen[v] + 1] = i end end
    local out = each(fns, 4, 6)
    assert.are.equal(2, #out)
    for v = 1, 2 do
      assert.is_true(out[v] >= 0 and out[v] < math.huge)
      assert.are.equal(3 + 4 * 6, #seen[v])
      assert.are.same({ 1, 2, 3 }, { seen[v][1], seen[v][2], seen[v][3] })
    end
    -- the timed calls number 1 .. 2 * 4 * 6 over both variants, each once (buffer rotation sees every index)
    local all = {}
    for v = 1, 2 do for k = 4, #seen[v] do all[#all + 1] = seen[v][k] end end
    table.sort(all)
    for k = 1, 48 do assert.are.equal(k, all[k]) end
    -- trial 1 runs variant 1 first, trial 2 variant 2 first (the order rotates)
    assert.are.equal(1, seen[1][4])
    assert.are.equal(5, seen[2][4])
    assert.are.equal(9, seen[2][8])
    assert.is_true(time(function() end, 2, 3) >= 0)
    release()
  end)
end)
