--[[
bench/timing.lua -- the benchmarks' clock (DESIGN.md, "Performance"): CUDA events around R back-to-back calls,
the median of several trials after a warm-up.

  local time, release, each = dofile("bench/timing.lua")(ctx)
  local ms_per_call = time(function(i) ... end, reps, trials)   -- i = 1, 2, ... rotates the buffer sets
  release()                                                      -- frees the two events

Variants compared in one table (base against spectral) are timed interleaved by the third function:
  local ms = each({ fa, fb }, reps, trials)   -- ms[1], ms[2]: each variant's median over the same trials
Trial j runs every variant for `reps` calls, in an order that rotates with j, so that no variant always runs
on a GPU its predecessor has warmed.
]]
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C
local median = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "bench") .. "/measure.lua").median

return function(ctx)
  local h = tensor.handle_ctx(ctx)
  local ev = ffi.new("ms_event *[2]")
  core.check(C.ms_event_new(h, ev))
  core.check(C.ms_event_new(h, ev + 1))
  local elapsed = ffi.new("double[1]")
  local function each(fns, reps, trials)
    trials = trials or 7
    for _, fn in ipairs(fns) do for i = 1, 3 do fn(i) end end
    ctx:sync()
    local t, k = {}, 0
    for v = 1, #fns do t[v] = {} end
    for j = 1, trials do
      for o = 0, #fns - 1 do
        local v = (j + o - 1) % #fns + 1
        core.check(C.ms_event_record(h, ev[0]))
        for _ = 1, reps do k = k + 1 fns[v](k) end
        core.check(C.ms_event_record(h, ev[1]))
        core.check(C.ms_event_elapsed(ev[0], ev[1], elapsed))
        t[v][j] = elapsed[0] / reps
      end
    end
    local out = {}
    for v = 1, #fns do out[v] = median(t[v]) end   -- an even count of trials: the mean of the middle two
    return out
  end
  return function(fn, reps, trials) return each({ fn }, reps, trials)[1] end, function()
    C.ms_event_free(ev[0])
    C.ms_event_free(ev[1])
  end, each
end
