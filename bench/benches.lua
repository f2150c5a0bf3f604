--[[
The benchmarks `moonstep bench NAME [args...]` runs: one entry per benchmark, so adding one is adding its
script to bench/ and a line here.  Each entry: name, script (relative to bench/), summary (what
`moonstep bench` lists), args (default arguments, placed before the user's).
]]
return {
  { name = "core", script = "demo.lua", summary = "core ops on the best device: random, elementwise, reductions, matmul, eigh, safetensors" },
}
