-- moonstep.plot's built-in SVG renderer on awkward data: empty, NaN and infinite series, log scales with
-- values that have no logarithm, a single point, and names that are not plain text.  Each drawing runs
-- in a child luajit under `timeout`, so a renderer that loops forever fails the test instead of the suite.

-- the SVG of spec (Lua source of a table), drawn in a child; returns the text and the child's exit status
local function draw(spec_src)
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write('package.path = "lua/?.lua;lua/?/init.lua;" .. package.path\n',
          'io.write(require("moonstep.plot").svg(', spec_src, '))\n')
  f:close()
  local out, code = H.shell(("cd %s && timeout 10 luajit %s"):format(H.q(H.root), H.q(script)))
  os.remove(script)
  return out, code
end

local function numbers_ok(svg)
  for _, bad in ipairs { "nan", "inf" } do
    assert.falsy(svg:lower():find("[%s\"=,]%-?" .. bad), "a non-finite coordinate in:\n" .. svg)
  end
end

describe("plot.svg", function()
  for name, src in pairs {
    ["a log axis without any positive value"] =
      '{ title = "t", logy = true, series = {{ name = "a", train = {{ 1, 2, 3 }, { 0/0, 0, -1 }} }} }',
    ["a log axis without any series"] = '{ title = "t", logy = true, series = {} }',
    ["a log axis given a non-positive ymin"] =
      '{ title = "t", logy = true, ymin = 0, series = {{ name = "a", train = {{ 1, 2 }, { 5, 3 }} }} }',
    ["a linear axis of NaN and infinities only"] =
      '{ title = "t", series = {{ name = "a", train = {{ 1, 2 }, { 0/0, 1/0 }}, val = {{ 1 }, { -1/0 }} }} }',
    ["a single point on a log axis"] = '{ title = "t", logy = true, series = {{ name = "a", val = {{ 7 }, { 0.5 }} }} }',
  } do
    it("draws " .. name .. " (finite coordinates, in bounded time)", function()
      local out, code = draw(src)
      assert.equals(0, code, out)
      assert.truthy(out:find("</svg>", 1, true), out)
      numbers_ok(out)
    end)
  end
end)

describe("plot.write with gnuplot", function()
  local gnuplot = require("moonstep.plot").find_gnuplot()
  local run = gnuplot and it or pending
  run("draws series whose names hold quotes and backslashes #external", function()
    local plot = require("moonstep.plot")
    local dir = H.tmpdir()
    for _, name in ipairs { 'say "hi"', [[back\slash]], "it's", [[both "'\n]] } do
      local files, note = plot.write(dir .. "/loss", {
        title = 'lm "quoted" \\ title', xlabel = "step", ylabel = "loss",
        series = { { name = name, train = { { 1, 2, 3 }, { 3, 2, 1 } }, val = { { 3 }, { 1.5 } } } },
      }, { plotter = "gnuplot" })
      assert.truthy(note:find("plotted with gnuplot", 1, true), note)
      local svg = H.read_file(dir .. "/loss.svg")
      local shown = name:gsub('"', "&quot;")
      assert.truthy(svg:find(name .. " (train)", 1, true) or svg:find(shown .. " (train)", 1, true),
        name .. " is not in the legend of " .. files[2])
    end
    os.execute("rm -rf " .. H.q(dir))
  end)
end)
