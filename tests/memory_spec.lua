-- Memory across steps: after a few warm-up steps, an optimizer step of any built-in recipe holds no more
-- engine memory than the step before it (every temporary returns to the context, no state grows), and the
-- Lua heap stays flat -- nothing the runtime or a recipe keeps per step (histories, caches keyed by step,
-- tables of views) grows with the number of steps.  On the CPU, and on CUDA where there is a device.
local ms = H.ms

-- a small model with every kind of parameter the recipes route: matrices, stacked experts, vectors, an
-- embedding and a head large enough for 8-bit AdamW state
local SPECS = {
  { name = "model.embed_tokens.weight", shape = { 128, 64 } },
  { name = "layers.0.attn.q.weight", shape = { 48, 64 } },
  { name = "layers.0.mlp.experts", shape = { 2, 24, 48 } },
  { name = "layers.0.norm.weight", shape = { 64 } },
  { name = "lm_head.weight", shape = { 128, 64 } },
}

local CASES = {
  { "adamw", {} },
  { "sgd", { momentum = 0.9, nesterov = true } },
  { "lion", {} },
  { "muon", {} },
  { "sinkgd", {} },
  { "sinkgd", { sinkgd_spectral_norm = true } },
  { "sinkgd", { sinkgd_md_sphere = true, bf16_stochastic_round = true } },
  -- (blocks of 64: the experts are the matrix [2, 1152] to DASH, whose 1024-wide block costs an EVD of 1024)
  { "dash", { inv_root_freq = 3, start_prec_step = 2, block_size = 64 } },
  { "dash", { inv_root_method = "auto", inv_root_freq = 2, block_size = 64, use_nesterov = true, mu = 0.5 } },
}

-- frees the engine memory of unreachable tensors: the handle's finalizer runs in the cycle after the one
-- that collects the tensor object
local function collect()
  collectgarbage()
  collectgarbage()
  collectgarbage()
end

local function check(device)
  local ctx = ms.device(device)
  for _, case in ipairs(CASES) do
    local name, options = case[1], case[2]
    local what = ("%s %s on %s"):format(name, ms.json.encode(options), device)
    local params, grads = {}, {}
    for i, s in ipairs(SPECS) do
      local dtype = (name == "sinkgd" and options.bf16_stochastic_round) and "bf16" or "f32"
      params[i] = { name = s.name, param = ms.randn(s.shape, { seed = H.seed(), ctx = ctx }):to(dtype),
                    grad = ms.zeros(s.shape, { dtype = dtype, ctx = ctx }) }
      -- three fixed gradients a parameter, cycled: fresh values every step without allocating any
      grads[i] = {}
      for k = 1, 3 do grads[i][k] = ms.randn(s.shape, { seed = H.seed(), ctx = ctx }):to(dtype) end
    end
    local opt = ms.optim.new(name, params, options)
    local step = 0
    local function run(n)
      for _ = 1, n do
        step = step + 1
        for i, p in ipairs(params) do p.grad:copy_(grads[i][step % 3 + 1]) end
        opt:step()
        -- (collected as often in every window: the weak tables that hold tensor handles keep the size the
        -- most temporaries alive at once gave them, and a longer stretch without a collection has more)
        if step % 12 == 0 then collect() end
      end
      ctx:sync()
      collect()
      return ctx:mem_stats().bytes_in_use, collectgarbage("count")
    end
    run(12)                                  -- state made, first refreshes done, caches filled
    local bytes1, heap1 = run(24)
    local bytes2, heap2 = run(96)
    assert.equals(bytes1, bytes2, what .. ": engine bytes in use after 36 steps against 132")
    -- the Lua heap, with the JIT off (its traces come and go by the tens of KiB): bounded caches fill and
    -- empty by a few KiB, but a per-step record of even 50 bytes would add more than this over 96 steps
    assert.is_true(heap2 - heap1 < 4, ("%s: the Lua heap grew %.2f KiB over steps 37-132"):format(what, heap2 - heap1))
    for _, p in ipairs(params) do
      for _, v in ipairs(p.param:to("f32"):tolist_flat()) do assert(v == v, what .. ": NaN in " .. p.name) end
    end
  end
end

describe("memory across optimizer steps", function()
  local jit_was
  setup(function()
    jit_was = jit.status()
    jit.off()
    jit.flush()
  end)
  teardown(function() if jit_was then jit.on() end end)

  it("stays flat on the CPU for every built-in recipe (engine memory and the Lua heap)", function()
    check("cpu")
  end)

  H.cuda_it("stays flat on CUDA for every built-in recipe (engine memory and the Lua heap)", function()
    check("cuda")
  end)
end)
