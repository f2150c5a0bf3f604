--[[
bench/measure.lua -- the benchmarks' arithmetic, pure Lua (no device), so the specs can check it on the CPU
(tests/bench_measure_spec.lua): the median of trials and the SinkGD floor (DESIGN.md, "Performance";
research/anchors-h200.md).

  local M = dofile("bench/measure.lua")   -- (scripts: relative to arg[0])
  M.median({ 3, 1, 2, 4 })                 -- 2.5: the mean of the two middle values when the count is even
  M.sinkgd_floor_bytes(gbytes, pbytes, iters, spectral, sn_iters)
  M.floor_ms(bytes, bytes_per_second)
]]
local M = {}

--- The median of a list of numbers (the list is not changed): the middle value, or for an even count the mean
--- of the two middle values.
function M.median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  assert(#s > 0, "median of no values")
  table.sort(s)
  local n = #s
  if n % 2 == 1 then return s[(n + 1) / 2] end
  return (s[n / 2] + s[n / 2 + 1]) / 2
end

--- Bytes of one element of a params/grads dtype of the SinkGD bench.
function M.elem_bytes(dtype)
  local b = ({ f32 = 4, bf16 = 2, f16 = 2 })[dtype]
  return assert(b, "unknown dtype " .. tostring(dtype))
end

--- The bytes a SinkGD step must move (research/anchors-h200.md, issue 5): (L + 1) reads of G and a read and a
--- write of p; spectral mode adds two reads of G per power-iteration step.  gbytes, pbytes: the bytes of G and
--- of p (each of their own dtype).
function M.sinkgd_floor_bytes(gbytes, pbytes, iters, spectral, sn_iters)
  return (iters + 1) * gbytes + 2 * pbytes + (spectral and 2 * (sn_iters or 1) * gbytes or 0)
end

--- Milliseconds to move `bytes` at `bw` bytes per second.
function M.floor_ms(bytes, bw)
  return bytes / bw * 1e3
end

return M
