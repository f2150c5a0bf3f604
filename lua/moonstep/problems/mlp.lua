--[[
moonstep.problems.mlp -- an MLP classifier on interleaved spirals: `classes` arms in the plane, each a
spiral of `turns` turns with angular noise, so the classes are separable only by a curved boundary and a
linear model stays near chance.

  h      = relu(input_proj(x))                        x = (x, y, x^2, y^2, xy) of a point
  h      = h + relu(fc(rmsnorm(h)))                   per hidden layer (layers.<i>.*)
  logits = classifier(rmsnorm(h))

The points are generated on the host from the seed (a Park-Miller stream), identical on every device; the
validation set is a second draw from the same distribution.  Reported: cross-entropy and accuracy.
]]
local ms = require("moonstep")
local L = require("moonstep.problems.layers")

local P = {
  name = "mlp",
  summary = "MLP classifier on noisy interleaved spirals (several classes)",
  options = {
    classes = { default = 5, type = "integer", min = 2, doc = "number of spiral arms (classes)" },
    points = { default = 400, type = "integer", min = 1, doc = "training points per class" },
    turns = { default = 2.5, type = "number", above = 0, doc = "turns of each spiral" },
    noise = { default = 0.2, type = "number", min = 0, doc = "angular noise (radians)" },
    hidden = { default = 128, type = "integer", min = 1, doc = "hidden width" },
    layers = { default = 2, type = "integer", min = 0, doc = "residual hidden layers" },
    batch = { default = 128, type = "integer", min = 1, doc = "points per training step" },
  },
  defaults = { steps = 800, eval_every = 50, schedule = "cosine", warmup = 20, clip = 1.0 },
  -- starting points per recipe (a few values each, at the defaults); --opt overrides them
  recipe_options = {
    sgd = { lr = 0.1, momentum = 0.9 },
    adamw = { lr = 5e-3, weight_decay = 0.01, no_decay_1d = true },
    sinkgd = { lr = 5e-3, sinkgd_lr_scale = 1 },
    lion = { lr = 5e-3, weight_decay = 0.1 },
    muon = { lr = 0.02, adam_lr = 5e-3 },
  },
}

-- n points per class: (features [n*K, 5], labels) from uniform stream u
local function spirals(o, n, u)
  local feats, labels = {}, {}
  for k = 0, o.classes - 1 do
    for _ = 1, n do
      local t = u()                                              -- position along the arm, 0..1
      local r = 0.15 + 0.85 * t
      local a = 2 * math.pi * (o.turns * t + k / o.classes) + o.noise * L.gauss(u)
      local x, y = r * math.cos(a), r * math.sin(a)
      feats[#feats + 1] = { x, y, x * x, y * y, x * y }
      labels[#labels + 1] = k
    end
  end
  return feats, labels
end

-- The generators' seeds: the data sets' (stream 1 training, 2 validation) and each step's batch.  The data
-- seeds are negated: as seed * 7919 + stream they met the batch seeds seed * 1000003 + step at seed 0 (the
-- default), whose steps 1 and 2 then drew their points with the generators that made the two sets.
function P.data_seed(seed, stream) return -(seed * 7919 + stream) end
function P.batch_seed(seed, step) return seed * 1000003 + step end

function P.new(o, env)
  local ctx, seed = env.ctx, env.seed
  local penv = { ctx = ctx, dtype = env.dtype }
  local K, H = o.classes, o.hidden

  local function dataset(n, stream)
    local f, l = spirals(o, n, L.rng(P.data_seed(seed, stream)))
    return { x = ms.tensor(f, penv), y = L.onehot(l, K, penv), labels = l, feats = f, n = #l }
  end
  local train, val = dataset(o.points, 1), dataset(math.max(50, math.floor(o.points / 2)), 2)

  local params, W, k = {}, {}, 0
  local function add(name, t, tags)
    local p = L.param(name, t, tags)
    params[#params + 1] = p
    W[name] = p
  end
  local function normal(shape, std) k = k + 1 return L.normal(shape, std, seed, 100 + k, penv) end
  add("input_proj.weight", normal({ H, 5 }, 1))
  add("input_proj.bias", ms.zeros({ H }, penv), { "no_decay" })
  for i = 0, o.layers - 1 do
    local pre = "layers." .. i .. "."
    add(pre .. "norm.weight", ms.ones({ H }, penv), { "no_decay" })
    add(pre .. "fc.weight", normal({ H, H }, 1 / math.sqrt(H)))
    add(pre .. "fc.bias", ms.zeros({ H }, penv), { "no_decay" })
  end
  add("norm.weight", ms.ones({ H }, penv), { "no_decay" })
  add("classifier.weight", normal({ K, H }, 1 / math.sqrt(H)))
  add("classifier.bias", ms.zeros({ K }, penv), { "no_decay" })

  local inst = { params = params, tokens_per_step = o.batch }

  --- A minibatch of training points drawn from (seed, step).
  function inst.train_batch(step)
    local u = L.rng(P.batch_seed(seed, step))
    local f, l = {}, {}
    for i = 1, math.min(o.batch, train.n) do
      local j = 1 + math.floor(u() * train.n)
      f[i], l[i] = train.feats[j], train.labels[j]
    end
    return { x = ms.tensor(f, penv), y = L.onehot(l, K, penv), n = #l }
  end

  local function forward(b, want_grad)
    local a0 = L.linear(b.x, W["input_proj.weight"].param, W["input_proj.bias"].param)
    local h = a0:relu()
    local caches = {}
    for i = 0, o.layers - 1 do
      local pre = "layers." .. i .. "."
      local n, nc = L.rmsnorm(h, W[pre .. "norm.weight"].param, 1e-6)
      local a = L.linear(n, W[pre .. "fc.weight"].param, W[pre .. "fc.bias"].param)
      h = h + a:relu()
      caches[i] = { n = n, nc = nc, a = a }
    end
    local n, nc = L.rmsnorm(h, W["norm.weight"].param, 1e-6)
    local logits = L.linear(n, W["classifier.weight"].param, W["classifier.bias"].param)
    local loss, dlogits, correct = L.softmax_xent(logits, b.y, want_grad, not want_grad)
    if not want_grad then return loss, correct end

    local dn = L.linear_backward(dlogits, n, W["classifier.weight"].param, W["classifier.weight"].grad,
                                 W["classifier.bias"].grad)
    local dh = L.rmsnorm_backward(dn, nc, W["norm.weight"].param, W["norm.weight"].grad)
    for i = o.layers - 1, 0, -1 do
      local pre, c = "layers." .. i .. ".", caches[i]
      local da = L.relu_backward(dh, c.a)
      local dni = L.linear_backward(da, c.n, W[pre .. "fc.weight"].param, W[pre .. "fc.weight"].grad, W[pre .. "fc.bias"].grad)
      dh = dh + L.rmsnorm_backward(dni, c.nc, W[pre .. "norm.weight"].param, W[pre .. "norm.weight"].grad)
    end
    L.linear_backward(L.relu_backward(dh, a0), b.x, W["input_proj.weight"].param, W["input_proj.weight"].grad,
                      W["input_proj.bias"].grad, false)
    return loss
  end

  function inst.loss_grad(b) return forward(b, true) end
  function inst.loss(b) return (forward(b, false)) end
  function inst.evaluate()
    local loss, correct = forward(val, false)
    return { loss = loss, accuracy = correct / val.n }
  end
  function inst.describe()
    local n = 0
    for _, p in ipairs(params) do n = n + p.param:numel() end
    return ("mlp: %d parameters (hidden %d, %d layers); %d spirals of %g turns, %d training / %d validation points")
      :format(n, H, o.layers, K, o.turns, train.n, val.n)
  end
  return inst
end

return P
