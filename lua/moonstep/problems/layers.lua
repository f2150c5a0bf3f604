--[[
moonstep.problems.layers -- the differentiable pieces the built-in problems are made of, each a forward
function and a hand-written backward, on public tensor ops only (so every problem runs wherever the ops
run: CPU and CUDA).  Weights follow PyTorch's layout, [out, in], so y = x W^T + b.

Backward functions write parameter gradients straight into the caller's gradient buffers (the tensors
registered with ms.optim) and return the gradient of the input, so a step allocates no gradient copies.
]]
local ms = require("moonstep")

local L = {}

local PM = 2147483647   -- 2^31 - 1, the Park-Miller modulus

-- a * b mod PM, exact in doubles for 0 <= a, b < 2^32 (every partial product stays below 2^48)
local function mulmod(a, b)
  local hi, lo = math.floor(b / 65536), b % 65536
  return ((a * hi) % PM * 65536 + a * lo) % PM
end

--- A deterministic uniform [0, 1) generator on the host (Park-Miller "minimal standard", exact in doubles),
--- for data sampling and batch positions: the same seed gives the same data on every device.  The seeding
--- is exact for every integer seed below 2^53 (the product seed * 2654435761 is reduced piecewise: formed
--- whole it would be rounded for seeds above about 3.4e6, leaving large seeds a few streams between them).
function L.rng(seed)
  local s = (mulmod(math.floor(seed) % PM, 2654435761 % PM) + 12345) % PM
  if s == 0 then s = 1 end
  return function()
    s = (s * 48271) % PM
    return s / PM
  end
end

--- A normal deviate from a uniform generator (Box-Muller).
function L.gauss(u)
  local a = u()
  if a < 1e-300 then a = 1e-300 end
  return math.sqrt(-2 * math.log(a)) * math.cos(2 * math.pi * u())
end

--- A [shape] tensor of N(0, std^2) values: counter-based, so (seed, offset) fixes it on every device.
function L.normal(shape, std, seed, offset, env)
  return ms.randn(shape, { seed = seed, offset = offset, std = std, ctx = env.ctx, dtype = env.dtype })
end

--- A parameter entry for ms.optim, with its gradient buffer.
function L.param(name, t, tags)
  return { name = name, param = t, grad = ms.zeros_like(t), tags = tags }
end

local ranges = setmetatable({}, { __mode = "k" })   -- per env: the 0..n-1 row and column it compares against

local function range(n, env, column)
  local per = ranges[env]
  if not per then per = {} ranges[env] = per end
  local key = n .. (column and "c" or "r")
  if not per[key] then
    local r = {}
    for i = 1, n do r[i] = i - 1 end
    per[key] = ms.tensor(r, { ctx = env.ctx, dtype = env.dtype }):view(column and { n, 1 } or { 1, n })
  end
  return per[key]
end

--- The [#ids, n] one-hot matrix of integer ids in [0, n) (or its transpose [n, #ids] when `transposed`):
--- the ids compared against 0..n-1, so only the ids travel to the device.  The transposed form is the
--- faster one to build for long id lists (each output row is then contiguous).
function L.onehot(ids, n, env, transposed)
  local t = ms.tensor(ids, { ctx = env.ctx, dtype = env.dtype })
  if transposed then return ms.eq(range(n, env, true), t:view({ 1, #ids })) end
  return ms.eq(t:view({ #ids, 1 }), range(n, env, false))
end

--- y = x W^T (+ b)
function L.linear(x, w, b)
  local y = ms.matmul(x, w, { trans_b = true })
  if b then y:add_(b) end
  return y
end

--- Gradients of y = x W^T + b: gw = dy^T x, gb = sum_rows(dy), returns dx = dy W (nil when not wanted).
function L.linear_backward(dy, x, w, gw, gb, want_dx)
  ms.matmul(dy, x, { trans_a = true, out = gw })
  if gb then gb:copy_(dy:sum(0)) end
  if want_dx == false then return nil end
  return ms.matmul(dy, w)
end

--- RMS normalisation over the last dim with a gain: y = x / sqrt(mean(x^2) + eps) * g.
--- Returns y and what the backward pass needs.
function L.rmsnorm(x, g, eps)
  local r = (x:square():mean(1, true) + eps):rsqrt()      -- [rows, 1]
  local xhat = x * r
  return xhat * g, { xhat = xhat, r = r }
end

--- dx of the RMS norm; gg (the gain's gradient) is written.
---   dx = r * (dxhat - xhat * mean(dxhat * xhat))   with dxhat = dy * g
function L.rmsnorm_backward(dy, cache, g, gg)
  gg:copy_((dy * cache.xhat):sum(0))
  local dxhat = dy * g
  local proj = (dxhat * cache.xhat):mean(1, true)
  return (dxhat - cache.xhat * proj) * cache.r
end

--- dy masked by where the ReLU's input was positive.
function L.relu_backward(dy, pre)
  return dy * ms.gt(pre, 0)
end

--- Mean softmax cross-entropy of logits [rows, classes] against one-hot targets.  Returns the loss (a
--- number), the gradient with respect to the logits (unless want_grad is false) and the number of rows
--- whose arg-max is the target (the accuracy numerator).
function L.softmax_xent(logits, target, want_grad, want_correct)
  local rows = logits:shape()[1]
  local mx = logits:max(1, true)
  local z = logits - mx
  local e = z:exp()
  local s = e:sum(1, true)
  local logp = z - s:log()
  local loss = -ms.dot(target, logp) / rows
  local correct
  if want_correct then
    -- the target's logit equals the row's maximum (ties count as correct, which random data never makes)
    correct = ms.dot(target, ms.ge(z, 0))
  end
  if want_grad == false then return loss, nil, correct end
  local d = (e / s - target) * (1 / rows)
  return loss, d, correct
end

return L
