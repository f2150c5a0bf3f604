--[[
moonstep.plot -- loss-curve plots for `moonstep compare`: PNG and SVG through gnuplot (Debian's
gnuplot-nox) when it is installed, otherwise an SVG drawn by the small renderer below (no PNG then: say so).

  local plot = require("moonstep.plot")
  local files, how = plot.write("out/loss", {
    title = "lm on cpu", xlabel = "step", ylabel = "loss", logy = false,
    ymin = nil, ymax = nil,     -- the visible range (nil: the data's); curves are clipped to it
    series = {{name = "adamw", train = {xs, ys}, val = {xs, ys}}, ...},
  }, {plotter = "auto"})        -- "auto" | "gnuplot" | "builtin"

Returns the files written and a sentence saying how (what the CLI prints).
]]
local M = {}

M.palette = { "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf" }

local function finite(v) return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge end

--- The gnuplot executable to use, or nil: MOONSTEP_GNUPLOT (a path; "" or "none" disables), else PATH.
function M.find_gnuplot()
  local env = os.getenv("MOONSTEP_GNUPLOT")
  if env ~= nil then
    if env == "" or env == "none" then return nil end
    local f = io.open(env, "rb")
    if f then f:close() return env end
    return nil
  end
  local p = io.popen("command -v gnuplot 2>/dev/null")
  local path = p and p:read("*l")
  if p then p:close() end
  return path and path ~= "" and path or nil
end

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

--- Writes text to path whole or not at all: into path .. ".tmp" beside it, checked, then renamed over path,
--- so a write that fails (a full disk, a file size limit) raises and leaves an earlier file as it was.
function M.write_file(path, text)
  -- (checked before the temporary file is made: a failing write left it behind; io reads a path up to a NUL)
  if type(path) ~= "string" or path == "" or path:find("\0", 1, true) then
    error(("write_file: path must be a file name without NUL bytes (got %s)"):format(require("moonstep.core").show(path)), 2)
  end
  if type(text) ~= "string" then error(("write_file: text must be a string (got %s)"):format(type(text)), 2) end
  local tmp = path .. ".tmp"
  local f, err = io.open(tmp, "wb")
  if not f then error(("cannot write %s: %s"):format(path, tostring(err)), 0) end
  local ok, werr = f:write(text)
  local closed, cerr = f:close()
  if not ok or not closed then
    os.remove(tmp)
    error(("cannot write %s: %s"):format(path, tostring(werr or cerr)), 0)
  end
  local moved, rerr = os.rename(tmp, path)
  if not moved then
    os.remove(tmp)
    error(("cannot write %s: %s"):format(path, tostring(rerr)), 0)
  end
end

-- ---------------------------------------------------------------------------------------------------
-- gnuplot
-- ---------------------------------------------------------------------------------------------------
-- a gnuplot string literal: single-quoted, where a backslash is itself and '' is a quote (inside double
-- quotes a " in a recipe's name ended the string, a syntax error, and a backslash started an escape)
local function gp_str(s)
  return "'" .. tostring(s):gsub("[\r\n]", " "):gsub("'", "''") .. "'"
end

local function gnuplot_script(base, spec)
  local name = base:match("([^/]+)$")
  local out = {}
  local function w(s) out[#out + 1] = s end
  for i, s in ipairs(spec.series) do
    for _, kind in ipairs { "train", "val" } do
      local d = s[kind]
      if d and #d[1] > 0 then
        w(("$%s%d << EOD"):format(kind, i))
        for j = 1, #d[1] do
          if finite(d[2][j]) and (not spec.logy or d[2][j] > 0) then w(("%.10g %.10g"):format(d[1][j], d[2][j])) end
        end
        w("EOD")
      end
    end
  end
  w("set termoption noenhanced")
  w(("set title %s"):format(gp_str(spec.title or "")))
  w(("set xlabel %s"):format(gp_str(spec.xlabel or "step")))
  w(("set ylabel %s"):format(gp_str(spec.ylabel or "loss")))
  w("set grid lc rgb '#dddddd'")
  w("set key top right box opaque")
  if spec.logy then w("set logscale y") end
  if spec.ymin or spec.ymax then
    w(("set yrange [%s:%s]"):format(spec.ymin and ("%.10g"):format(spec.ymin) or "*", spec.ymax and ("%.10g"):format(spec.ymax) or "*"))
  end
  local plots = {}
  for i, s in ipairs(spec.series) do
    local color = M.palette[(i - 1) % #M.palette + 1]
    if s.train and #s.train[1] > 0 then
      plots[#plots + 1] = ('$train%d using 1:2 with lines lw 2 lc rgb "%s" title %s'):format(i, color,
        gp_str(s.train_label or (s.name .. " (train)")))
    end
    if s.val and #s.val[1] > 0 then
      plots[#plots + 1] = ('$val%d using 1:2 with linespoints dt 2 lw 1.5 pt 7 ps 0.7 lc rgb "%s" title %s'):format(i, color,
        gp_str(s.name .. " (validation)"))
    end
  end
  local plot_cmd = "plot " .. table.concat(plots, ", \\\n     ")
  w(("set terminal pngcairo size 1000,600 font 'sans,10'"))
  w(("set output '%s.png'"):format(name))
  w(plot_cmd)
  w(("set terminal svg size 1000,600 dynamic font 'sans,10' background '#ffffff'"))
  w(("set output '%s.svg'"):format(name))
  w(plot_cmd)
  w("unset output")
  return table.concat(out, "\n") .. "\n"
end

local function run_gnuplot(gnuplot, base, spec)
  local dir = base:match("^(.*)/[^/]+$") or "."
  local name = base:match("([^/]+)$")
  local wrote, err = pcall(M.write_file, base .. ".gp", gnuplot_script(base, spec))
  if not wrote then return false, tostring(err) end
  local cmd = ("cd %s && %s %s > %s 2>&1"):format(shell_quote(dir), shell_quote(gnuplot), shell_quote(name .. ".gp"),
                                                  shell_quote(name .. ".gp.log"))
  local rc = os.execute(cmd)
  local ok = rc == 0 or rc == true
  local log = io.open(base .. ".gp.log", "r")
  local msg = log and log:read("*a") or ""
  if log then log:close() end
  if not ok then return false, "gnuplot failed: " .. msg:gsub("%s+$", "") end
  os.remove(base .. ".gp.log")
  for _, ext in ipairs { ".png", ".svg" } do
    local g = io.open(base .. ext, "rb")
    if not g then return false, "gnuplot wrote no " .. base .. ext end
    g:close()
  end
  return true
end

-- ---------------------------------------------------------------------------------------------------
-- the built-in SVG renderer
-- ---------------------------------------------------------------------------------------------------
local function esc(s)
  return (tostring(s):gsub("&", "&amp;"):gsub("<", "&lt;"):gsub(">", "&gt;"):gsub('"', "&quot;"))
end

-- "nice" tick positions covering [lo, hi]: steps of 1, 2 or 5 times a power of ten, about n of them
function M.ticks(lo, hi, n)
  if hi <= lo then hi = lo + 1 end
  local raw = (hi - lo) / (n or 6)
  local mag = 10 ^ math.floor(math.log10(raw))
  local step = mag
  for _, m in ipairs { 1, 2, 5, 10 } do
    if m * mag >= raw then step = m * mag break end
  end
  local out = {}
  for v = math.ceil(lo / step) * step, hi + step * 1e-9, step do out[#out + 1] = math.abs(v) < step * 1e-9 and 0 or v end
  return out
end

local function label(v)
  if v == 0 then return "0" end
  local a = math.abs(v)
  if a >= 1e5 or a < 1e-3 then return ("%.0e"):format(v) end
  return (("%.4f"):format(v):gsub("0+$", ""):gsub("%.$", ""))
end

--- The SVG text of a plot (also what the fallback writes).
function M.svg(spec)
  local W, Hh = 1000, 600
  local ml, mr, mt, mb = 80, 30, 50, 60
  local pw, ph = W - ml - mr, Hh - mt - mb
  local xmin, xmax, ymin, ymax = math.huge, -math.huge, math.huge, -math.huge
  local function ok(y) return finite(y) and (not spec.logy or y > 0) end
  for _, s in ipairs(spec.series) do
    for _, kind in ipairs { "train", "val" } do   -- (not ipairs { s.train, s.val }: it stops at a missing train)
      local d = s[kind]
      if d then
        for j = 1, #d[1] do
          local x, y = d[1][j], d[2][j]
          if ok(y) then
            xmin, xmax = math.min(xmin, x), math.max(xmax, x)
            ymin, ymax = math.min(ymin, y), math.max(ymax, y)
          end
        end
      end
    end
  end
  -- no drawable point: an empty frame over [0, 1] x [1, 10] (a range that has a logarithm too)
  if xmin > xmax then xmin, xmax, ymin, ymax = 0, 1, 1, 10 end
  -- the requested range where it can be drawn: finite, and positive on a log axis (log10 of 0 is -inf,
  -- and a tick loop from -inf never ends)
  if ok(spec.ymin) then ymin = spec.ymin end
  if ok(spec.ymax) then ymax = spec.ymax end
  if ymax < ymin then ymin, ymax = ymax, ymin end
  if xmax == xmin then xmax = xmin + 1 end
  local ty = spec.logy and math.log10 or function(v) return v end
  local y0, y1 = ty(ymin), ty(ymax)
  if y1 - y0 < 1e-12 then y0, y1 = y0 - 0.5, y1 + 0.5 end
  if not (ok(spec.ymin) or ok(spec.ymax)) then
    local pad = (y1 - y0) * 0.04
    y0, y1 = y0 - pad, y1 + pad
  end
  local function px(x) return ml + (x - xmin) / (xmax - xmin) * pw end
  local function py(y) return mt + (1 - (ty(y) - y0) / (y1 - y0)) * ph end

  local o = {}
  local function w(s) o[#o + 1] = s end
  w(('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">')
    :format(W, Hh, W, Hh))
  w(('<rect width="%d" height="%d" fill="#ffffff"/>'):format(W, Hh))
  w(('<defs><clipPath id="plotarea"><rect x="%d" y="%d" width="%d" height="%d"/></clipPath></defs>'):format(ml, mt, pw, ph))
  w(('<text x="%d" y="28" text-anchor="middle" font-size="15">%s</text>'):format(W / 2, esc(spec.title or "")))
  -- grid and ticks
  for _, v in ipairs(M.ticks(xmin, xmax, 8)) do
    local x = px(v)
    w(('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e0e0e0"/>'):format(x, mt, x, mt + ph))
    w(('<text x="%.1f" y="%d" text-anchor="middle">%s</text>'):format(x, mt + ph + 18, label(v)))
  end
  local yt
  if spec.logy then
    yt = {}
    local e0, e1 = math.floor(y0), math.ceil(y1)
    local mult = (e1 - e0) <= 2 and { 1, 2, 5 } or { 1 }
    for e = e0, e1 do
      for _, m in ipairs(mult) do
        local v = m * 10 ^ e
        if math.log10(v) >= y0 and math.log10(v) <= y1 then yt[#yt + 1] = v end
      end
    end
  else
    yt = M.ticks(y0, y1, 6)
  end
  for _, v in ipairs(yt) do
    local y = py(v)
    if y >= mt - 0.5 and y <= mt + ph + 0.5 then
      w(('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e0e0e0"/>'):format(ml, y, ml + pw, y))
      w(('<text x="%d" y="%.1f" text-anchor="end">%s</text>'):format(ml - 6, y + 4, label(v)))
    end
  end
  w(('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333333"/>'):format(ml, mt, pw, ph))
  w(('<text x="%d" y="%d" text-anchor="middle">%s</text>'):format(ml + pw / 2, Hh - 15, esc(spec.xlabel or "step")))
  w(('<text x="20" y="%d" text-anchor="middle" transform="rotate(-90 20 %d)">%s%s</text>')
    :format(mt + ph / 2, mt + ph / 2, esc(spec.ylabel or "loss"), spec.logy and " (log scale)" or ""))
  -- curves
  local legend = {}
  for i, s in ipairs(spec.series) do
    local color = M.palette[(i - 1) % #M.palette + 1]
    for _, kind in ipairs { "train", "val" } do
      local d = s[kind]
      if d and #d[1] > 0 then
        local pts = {}
        for j = 1, #d[1] do
          if ok(d[2][j]) then pts[#pts + 1] = ("%.1f,%.1f"):format(px(d[1][j]), py(d[2][j])) end
        end
        if #pts > 0 then
          w(('<polyline clip-path="url(#plotarea)" fill="none" stroke="%s" stroke-width="%s"%s points="%s"/>'):format(color,
            kind == "train" and "2" or "1.5", kind == "val" and ' stroke-dasharray="6,4"' or "", table.concat(pts, " ")))
          if kind == "val" then
            for _, p in ipairs(pts) do
              local x, y = p:match("([^,]+),(.+)")
              w(('<circle clip-path="url(#plotarea)" cx="%s" cy="%s" r="3" fill="%s"/>'):format(x, y, color))
            end
          end
          legend[#legend + 1] = { color = color, dashed = kind == "val",
                                  text = kind == "train" and (s.train_label or (s.name .. " (train)")) or (s.name .. " (validation)") }
        end
      end
    end
  end
  -- legend, top right inside the frame
  local lw = 0
  for _, l in ipairs(legend) do lw = math.max(lw, #l.text) end
  lw = lw * 7 + 50
  local lx, ly = ml + pw - lw - 10, mt + 10
  w(('<rect x="%d" y="%d" width="%d" height="%d" fill="#ffffff" stroke="#999999"/>'):format(lx, ly, lw, #legend * 18 + 8))
  for j, l in ipairs(legend) do
    local y = ly + j * 18 - 2
    w(('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'):format(lx + 8, y - 4, lx + 36, y - 4,
      l.color, l.dashed and ' stroke-dasharray="6,4"' or ""))
    w(('<text x="%d" y="%d">%s</text>'):format(lx + 42, y, esc(l.text)))
  end
  w("</svg>")
  return table.concat(o, "\n") .. "\n"
end

--- Writes base.png and base.svg (gnuplot; base.gp beside them) or base.svg alone (built-in renderer).
--- opts.plotter: "auto" (gnuplot when found), "gnuplot" (required), "builtin".
--- Returns {files}, note.
local SPEC_KEYS = { title = true, xlabel = true, ylabel = true, logy = true, ymin = true, ymax = true, series = true }
function M.write(base, spec, opts)
  -- (a misspelt key, logY or plotr, would draw with the default silently)
  local core = require("moonstep.core")
  if type(spec) ~= "table" then error("plot.write: spec must be a table (got " .. type(spec) .. ")", 2) end
  core.check_keys("plot.write", spec, SPEC_KEYS, 2, "spec key")
  if opts ~= nil then core.check_options("plot.write", opts, { plotter = "string" }, 2) end
  local plotter = opts and opts.plotter or "auto"
  if plotter ~= "auto" and plotter ~= "gnuplot" and plotter ~= "builtin" then
    error(("unknown plotter '%s' (auto, gnuplot or builtin)"):format(tostring(plotter)), 0)
  end
  local why
  if plotter ~= "builtin" then
    local gp = M.find_gnuplot()
    if gp then
      local ok, err = run_gnuplot(gp, base, spec)
      if ok then return { base .. ".png", base .. ".svg" }, "plotted with gnuplot; its script: " .. base .. ".gp" end
      why = err
    else
      why = "gnuplot not found (apt-get install gnuplot-nox for PNG output)"
    end
    if plotter == "gnuplot" then error(why, 0) end
  end
  -- no PNG this time: one left from an earlier plot here (and its script) would show other curves
  os.remove(base .. ".png")
  os.remove(base .. ".gp")
  M.write_file(base .. ".svg", M.svg(spec))
  return { base .. ".svg" }, (why and (why .. "; ") or "") .. "drew the SVG with the built-in renderer (no PNG)"
end

return M
