--[[
moonstep.report -- the files of a comparison (moonstep compare): every step of every run as CSV, the
summary table as CSV and text, and the loss curves as PNG + SVG (moonstep.plot).

  loss.csv      recipe,seed,step,train_loss,train_loss_avg,val_loss,val_accuracy   (one row per step;
                the validation columns are filled on the steps where validation ran)
  summary.csv   one row per recipe: seeds, validation loss (mean, range), final/best training loss,
                validation accuracy, seconds per run, steps/s, optimizer state bytes, status
  summary.txt   the table `moonstep compare` prints
  loss.png/svg  moving-average training loss (mean over seeds) and validation loss per recipe
]]
local E = require("moonstep.experiment")
local plot = require("moonstep.plot")

local M = {}

local function num(v) return v == nil and "" or ("%.9g"):format(v) end

-- a CSV field (RFC 4180): quoted, with "" for a quote, when it holds a comma, a quote or a line break
-- (recipe names are whatever a recipe file declares)
local function field(s)
  s = tostring(s)
  if not s:find('[,"\r\n]') then return s end
  return '"' .. s:gsub('"', '""') .. '"'
end

local function mkdir_p(dir) E.mkdir(dir, "output folder") end

--- Creates the output folder (and its parents); raises a clear error when it cannot.  compare calls it
--- before training, so that an unusable folder does not cost the runs.
M.mkdir = mkdir_p

local write_file = plot.write_file    -- whole or not at all

-- mean over seeds of per-step series (runs may stop early: the mean covers the steps all of them reached)
local function mean_series(runs, get)
  local n = math.huge
  for _, r in ipairs(runs) do n = math.min(n, #get(r)) end
  if n == math.huge then return {} end
  local out = {}
  for i = 1, n do
    local s = 0
    for _, r in ipairs(runs) do s = s + get(r)[i] end
    out[i] = s / #runs
  end
  return out
end

-- at most `max` evenly spaced points (keeping the last), so plots stay light for long runs
local function thin(xs, ys, max)
  if #xs <= max then return { xs, ys } end
  local ox, oy = {}, {}
  local stride = #xs / max
  for k = 0, max - 1 do
    local i = math.floor(k * stride) + 1
    ox[#ox + 1], oy[#oy + 1] = xs[i], ys[i]
  end
  ox[#ox + 1], oy[#oy + 1] = xs[#xs], ys[#ys]
  return { ox, oy }
end

--- The plot description of a comparison (mean over seeds per recipe).
function M.plot_spec(cmp, opts)
  local problem = opts.problem
  local series = {}
  for _, row in ipairs(cmp.rows) do
    local runs = cmp.runs[row.recipe] or {}
    if #runs > 0 then
      local ys = mean_series(runs, function(r) return r.smoothed end)
      local xs = {}
      local start = runs[1].start_step
      for i = 1, #ys do xs[i] = start + i - 1 end
      local vx, vy = {}, {}
      local evals = mean_series(runs, function(r)
        local t = {}
        for _, ev in ipairs(r.evals) do t[#t + 1] = ev.loss end
        return t
      end)
      for i, v in ipairs(evals) do vx[i], vy[i] = runs[1].evals[i].step, v end
      series[#series + 1] = {
        name = row.recipe, train = thin(xs, ys, 800), val = { vx, vy },
        train_label = ("%s (train, avg of %d steps)"):format(row.recipe, runs[1].smooth),
      }
    end
  end
  -- a linear axis shows the end of the runs, where recipes differ: it starts a tenth into the runs (the
  -- first drop from the initial loss would flatten everything else); log axes show everything
  local ymin, ymax
  if not (problem.defaults or {}).log_plot then
    local lo, hi = math.huge, -math.huge
    for _, s in ipairs(series) do
      local xs, ys = s.train[1], s.train[2]
      local cut = xs[1] and (xs[1] + 0.1 * (xs[#xs] - xs[1])) or 0
      for j = 1, #xs do
        local y = ys[j]
        if y == y and y < math.huge then
          lo = math.min(lo, y)
          if xs[j] >= cut then hi = math.max(hi, y) end
        end
      end
      for j, x in ipairs(s.val[1]) do
        if x >= cut and s.val[2][j] == s.val[2][j] then hi = math.max(hi, s.val[2][j]) lo = math.min(lo, s.val[2][j]) end
      end
    end
    if lo < hi and hi < math.huge then
      local pad = (hi - lo) * 0.05
      ymin, ymax = lo - pad, hi + pad
    end
  end
  local device = opts.ctx and opts.ctx:name() or "?"
  return {
    ymin = ymin, ymax = ymax,
    title = ("%s on %s: %d steps, %d seed%s per recipe"):format(problem.name, device, opts.steps, cmp.seeds,
      cmp.seeds == 1 and "" or "s"),
    xlabel = "step", ylabel = "loss", logy = (problem.defaults or {}).log_plot, series = series,
  }
end

local REPORT_KEYS = { problem = true, ctx = true, steps = true, plotter = true }
--- Writes the comparison's files into dir.  opts: problem, ctx, steps, plotter.
--- Returns {csv=, summary=, txt=, png=, svg=}, and a note on how the plot was made.
function M.write(dir, cmp, opts)
  -- (a misspelt plotter key would plot with "auto", silently)
  require("moonstep.core").check_keys("report.write", opts or {}, REPORT_KEYS, 2)
  mkdir_p(dir)
  local files = { csv = dir .. "/loss.csv", summary = dir .. "/summary.csv", txt = dir .. "/summary.txt" }

  local lines = { "recipe,seed,step,train_loss,train_loss_avg,val_loss,val_accuracy" }
  for _, row in ipairs(cmp.rows) do
    for _, r in ipairs(cmp.runs[row.recipe] or {}) do
      local ev_at = {}
      for _, ev in ipairs(r.evals) do ev_at[ev.step] = ev end
      for i, loss in ipairs(r.losses) do
        local step = r.start_step + i - 1
        local ev = ev_at[step]
        lines[#lines + 1] = ("%s,%d,%d,%s,%s,%s,%s"):format(field(row.recipe), r.seed, step, num(loss), num(r.smoothed[i]),
          num(ev and ev.loss), num(ev and ev.accuracy))
      end
    end
  end
  write_file(files.csv, table.concat(lines, "\n") .. "\n")

  local s = { "recipe,seeds,val_loss,val_loss_range,final_loss,best_loss,val_accuracy,seconds_per_run,steps_per_s,state_bytes,status" }
  for _, row in ipairs(cmp.rows) do
    local status = row.failed and ("failed: " .. row.failed:gsub("[\r\n,]", " ")) or (row.diverged and ("diverged at step " .. row.diverged) or "ok")
    s[#s + 1] = ("%s,%d,%s,%s,%s,%s,%s,%s,%s,%s,%s"):format(field(row.recipe), row.seeds, num(row.val_loss), num(row.val_spread),
      num(row.final_loss), num(row.best_loss), num(row.val_accuracy), num(row.seconds), num(row.steps_per_s),
      row.state_bytes and tostring(row.state_bytes) or "", status)
  end
  write_file(files.summary, table.concat(s, "\n") .. "\n")

  local text, verdict = E.format_table(cmp)
  write_file(files.txt, text .. "\n" .. (verdict and (verdict .. "\n") or ""))

  local written, note = plot.write(dir .. "/loss", M.plot_spec(cmp, opts), { plotter = opts.plotter })
  for _, f in ipairs(written) do
    if f:match("%.png$") then files.png = f else files.svg = f end
  end
  return files, note
end

return M
