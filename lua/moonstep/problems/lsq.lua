--[[
moonstep.problems.lsq -- ill-conditioned least squares, where preconditioning shows:

  minimise  0.5 * mean_i || W x_i + b - y_i ||^2      W = proj.weight [outputs, dim], b = proj.bias

The inputs are built so that the Hessian X^T X / n has exactly the eigenvalues 1 .. 1/cond, spread
geometrically, along random directions:  X = sqrt(n) U diag(s) V^T with U's columns orthonormal (a
Gaussian matrix orthonormalised through the eigendecomposition of its Gram matrix), V a random rotation
(eigenvectors of a random symmetric matrix) and s_k^2 = cond^(-k/(dim-1)).  Targets come from a random
W*, b* plus optional noise, so without noise the minimum is 0.  Full-batch gradients: the curve shows
the optimizer, not sampling noise.  The validation set is a second draw with the same spectrum and
rotation.  The data is made on the CPU in f64 and moved to the device, so every device sees the same data.
]]
local ms = require("moonstep")
local L = require("moonstep.problems.layers")

local P = {
  name = "lsq",
  summary = "ill-conditioned least squares (condition number `cond`)",
  options = {
    dim = { default = 64, type = "integer", min = 1, doc = "input features" },
    outputs = { default = 16, type = "integer", min = 1, doc = "regression targets per sample" },
    samples = { default = 512, type = "integer", min = 1, doc = "training samples (full batch)" },
    cond = { default = 1e4, type = "number", min = 1, doc = "condition number of the Hessian X^T X / n" },
    noise = { default = 0, type = "number", min = 0, doc = "standard deviation of the target noise" },
  },
  -- full-batch losses need no smoothing (smooth = 1): final and best are the raw values; the cosine decay
  -- lets sign-based updates (lion) settle instead of oscillating at the scale of their step
  defaults = { steps = 300, eval_every = 25, schedule = "cosine", warmup = 0, clip = nil, log_plot = true, smooth = 1 },
  -- starting points per recipe (a few values each, at the defaults); --opt overrides them
  recipe_options = {
    sgd = { lr = 1, momentum = 0.9 },
    adamw = { lr = 0.1, weight_decay = 0 },
    sinkgd = { lr = 0.1, sinkgd_lr_scale = 1 },
    lion = { lr = 0.03, weight_decay = 0 },
    muon = { lr = 0.1, adam_lr = 0.1, weight_decay = 0 },
  },
}

-- an [n, d] matrix with orthonormal columns: Z (Z^T Z)^(-1/2), through eigh (n >= d)
local function orthonormal_columns(n, d, seed, offset)
  local z = ms.randn({ n, d }, { seed = seed, offset = offset, dtype = "f64", device = "cpu" })
  local lam, q = ms.eigh(ms.matmul(z, z, { trans_a = true }))
  return ms.matmul(ms.matmul(z, q), q * lam:rsqrt(), { trans_b = true })
end

-- [n, dim] inputs with the Hessian spectrum of the problem (n >= dim: U has orthonormal columns;
-- n < dim: the spectrum is that of the n-dim subspace the samples span)
local function inputs(n, dim, s, v, seed, offset)
  local k = math.min(n, dim)
  local u = orthonormal_columns(n, k, seed, offset)
  local sv = s:slice(0, 0, k)
  return ms.matmul(u * sv, v:slice(1, 0, k), { trans_b = true }) * math.sqrt(n)
end

function P.new(o, env)
  local ctx, seed = env.ctx, env.seed
  local dim, n = o.dim, o.samples
  local cpu = { dtype = "f64", device = "cpu" }
  -- the spectrum: s_k^2 from 1 down to 1/cond
  local s = {}
  for k = 0, dim - 1 do s[k + 1] = math.sqrt(o.cond ^ (-(dim > 1 and k / (dim - 1) or 0))) end
  s = ms.tensor(s, cpu)
  local a = ms.randn({ dim, dim }, { seed = seed, offset = 1, dtype = "f64", device = "cpu" })
  local _, v = ms.eigh(a + a:t())
  local w_star = ms.randn({ o.outputs, dim }, { seed = seed, offset = 2, dtype = "f64", device = "cpu" })
  local b_star = ms.randn({ o.outputs }, { seed = seed, offset = 3, dtype = "f64", device = "cpu" })
  local function draw(offset)
    local x = inputs(n, dim, s, v, seed, offset)
    local y = ms.matmul(x, w_star, { trans_b = true }) + b_star
    if o.noise > 0 then y = y + ms.randn(y:shape(), { seed = seed, offset = offset + 1, std = o.noise, dtype = "f64", device = "cpu" }) end
    return { x = x:to(ctx):to(env.dtype), y = y:to(ctx):to(env.dtype), n = n }
  end
  local train, val = draw(10), draw(20)

  local penv = { ctx = ctx, dtype = env.dtype }
  local w = L.param("proj.weight", ms.zeros({ o.outputs, dim }, penv))
  local b = L.param("proj.bias", ms.zeros({ o.outputs }, penv), { "no_decay" })
  local inst = { params = { w, b }, tokens_per_step = n, train_data = train, val_data = val }

  local function residual(batch) return L.linear(batch.x, w.param, b.param) - batch.y end

  function inst.train_batch() return train end
  function inst.loss_grad(batch)
    local r = residual(batch)
    local scaled = r * (1 / batch.n)
    L.linear_backward(scaled, batch.x, w.param, w.grad, b.grad, false)
    return 0.5 * r:sumsq() / batch.n
  end
  function inst.loss(batch) return 0.5 * residual(batch):sumsq() / batch.n end
  function inst.evaluate() return { loss = inst.loss(val) } end
  function inst.describe()
    return ("lsq: W [%d, %d] + b, %d samples, Hessian condition number %g%s"):format(o.outputs, dim, n, o.cond,
      o.noise > 0 and (", target noise %g"):format(o.noise) or ", no noise (minimum 0)")
  end
  return inst
end

return P
