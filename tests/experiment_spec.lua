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
