--[[
The benchmarks `moonstep bench NAME [args...]` runs: one entry per benchmark, so adding one is adding its
script to bench/ and a line here.  Each entry: name, script (relative to bench/), summary (what
`moonstep bench` lists), args (default arguments, placed before the user's), cuda (true: it needs a CUDA device,
checked before it runs).
]]
return {
  { name = "core", script = "demo.lua", summary = "core ops on the best device: random, elementwise, reductions, matmul, eigh, safetensors" },
  { name = "overhead", script = "overhead.lua", summary = "host overhead per opt:step(), captured vs not: Llama-3-8B SinkGD set, 300 small AdamW tensors (CUDA)", cuda = true },
  { name = "dash", script = "dash_bench.lua", summary = "DASH inverse-root solvers and the dash recipe's step on Llama-953M's factors (controlled spectra; CUDA)", cuda = true },
}
