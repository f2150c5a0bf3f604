--[[
moonstep.problems.lm -- a small byte-level language model: predict the next byte from the `context`
bytes before it.

  e      = embed_tokens[x_1 .. x_T]                      T position-ordered embeddings, concatenated
  h      = context_proj(e)                               [batch, width]: each position has its own columns
  h      = h + down_proj(relu(up_proj(rmsnorm(h))))      per hidden layer (layers.<i>.*)
  logits = lm_head(rmsnorm(h))                           untied output matrix, 256 classes

Concatenating the embeddings keeps order (byte i of the context meets its own columns of context_proj),
as in Bengio et al.'s neural probabilistic language model (2003); the residual blocks with RMS norms are
those of current transformers without attention.  Parameter names follow Hugging Face models
(embed_tokens, lm_head, layers.<i>.*) so recipes route them as they would a real model: SinkGD sends
embed_tokens and lm_head to AdamW, Muon orthogonalises only the hidden matrices.

Data: `data` (any file; bytes) or the default corpus, the license texts every Debian system carries in
/usr/share/common-licenses (package base-files), or, where those are absent, text generated here.  The
corpus is cut into 2 KiB blocks; every tenth block is held out for the validation loss, and windows never
cross a block edge, so no validation byte is ever a training target or context.
]]
local ms = require("moonstep")
local L = require("moonstep.problems.layers")

local P = {
  name = "lm",
  summary = "byte-level language model (ordered context, residual MLP blocks, RMS norms)",
  options = {
    width = { default = 0, type = "integer", min = 0, doc = "hidden width (0: 256 on the CPU, 1024 on a GPU)" },
    layers = { default = 2, type = "integer", min = 0, doc = "residual hidden layers" },
    context = { default = 32, type = "integer", min = 1, doc = "bytes of context, in order" },
    embed = { default = 16, type = "integer", min = 1, doc = "token embedding size per context byte" },
    ffn = { default = 0, type = "integer", min = 0, doc = "inner width of the hidden layers (0: width)" },
    batch = { default = 64, type = "integer", min = 1, doc = "windows per training step" },
    data = { default = "", type = "string", doc = "training text (default: Debian's license texts)" },
    val_windows = { default = 4096, type = "integer", min = 1, doc = "held-out windows for the validation loss" },
  },
  -- how `moonstep train` / `compare` run it unless told otherwise: about 20 s per AdamW run on two CPU
  -- cores (make run's budget), cosine decay to 0 so the last steps average out the minibatch noise
  defaults = { steps = 2000, eval_every = 250, schedule = "cosine", warmup = 50, clip = 1.0 },
  -- starting points per recipe, tuned on the default corpus at width 256 (2000 steps, batch 64, a few
  -- values each); --opt overrides them.  sinkgd: the axolotl default alpha 0.05 is meant for larger base
  -- rates; with lr 3e-3 shared with its AdamW part, alpha 1 gives its matrices AdamW-sized steps
  recipe_options = {
    adamw = { lr = 3e-3, weight_decay = 0.1, no_decay_1d = true },
    sinkgd = { lr = 3e-3, sinkgd_lr_scale = 1 },
    sgd = { lr = 0.3, momentum = 0.9, nesterov = true },
    lion = { lr = 5e-3, weight_decay = 0.1 },
    muon = { lr = 0.02, adam_lr = 3e-3 },
    dash = { lr = 3e-3 },   -- measured: val loss 1.4865 at 3e-3 vs 1.6667 at 1e-3
  },
}

local BLOCK = 2048

-- the default corpus: Debian's license texts (one copy of each; GPL is a link to GPL-3, ...)
local LICENSES = {
  "GPL-3", "GPL-2", "GPL-1", "LGPL-3", "LGPL-2.1", "LGPL-2", "Apache-2.0", "MPL-2.0", "MPL-1.1", "GFDL-1.3",
  "GFDL-1.2", "Artistic", "CC0-1.0", "BSD",
}

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- Generated text for systems without /usr/share/common-licenses: sentences from a small grammar with
-- agreement and arithmetic, so that what comes next depends on bytes far back in the context.
local function generated_corpus(nbytes)
  local u = L.rng(20240601)
  local function pick(t) return t[1 + math.floor(u() * #t)] end
  local subj = { { "the engine", "runs" }, { "a recipe", "routes" }, { "the kernel", "reads" },
                 { "two workers", "share" }, { "the solvers", "converge" }, { "each tensor", "holds" } }
  local objs = { "the gradient", "every block", "a small matrix", "its state", "the learning rate", "the stream" }
  local advs = { "quickly", "in place", "without copies", "on the device", "step by step" }
  local out, n = {}, 0
  while n < nbytes do
    local s
    if u() < 0.3 then
      local a, b = math.floor(u() * 50), math.floor(u() * 50)
      s = ("%d plus %d is %d. "):format(a, b, a + b)
    else
      local sv = pick(subj)
      s = ("%s %s %s %s. "):format(sv[1], sv[2], pick(objs), pick(advs))
      s = s:sub(1, 1):upper() .. s:sub(2)
    end
    out[#out + 1] = s
    n = n + #s
  end
  return table.concat(out)
end

--- The text the problem trains on, and where it came from.
function P.corpus(path)
  if path and path ~= "" then
    local s = read(path)
    if not s then error(("lm: cannot read data file '%s'"):format(path), 0) end
    return s, path
  end
  local parts, names = {}, {}
  for _, name in ipairs(LICENSES) do
    local s = read("/usr/share/common-licenses/" .. name)
    if s then parts[#parts + 1] = s names[#names + 1] = name end
  end
  if #parts > 0 then return table.concat(parts, "\n"), "/usr/share/common-licenses (" .. #names .. " texts)" end
  return generated_corpus(200000), "generated text (no /usr/share/common-licenses here)"
end

function P.new(o, env)
  local ctx, seed = env.ctx, env.seed
  local width = o.width > 0 and o.width or (ctx:device_type() == "cuda" and 1024 or 256)
  local ffn = o.ffn > 0 and o.ffn or width
  local T, E, V = o.context, o.embed, 256
  local text, source = P.corpus(o.data)
  if #text < 4 * (T + 1) then error(("lm: the data has %d bytes; at least %d are needed"):format(#text, 4 * (T + 1)), 0) end

  -- windows (start offsets) that fit inside one block; every tenth block is the validation split.  Each
  -- split is kept as runs of consecutive starts, one per block (a list of every start took 8 bytes per
  -- byte of data, and the bytes as a Lua array another 8), and its k-th window is found by bisection
  local function windows() return { first = {}, before = {}, count = {}, n = 0 } end
  local function add(w, a, b)
    if b < a then return end
    local r = #w.first + 1
    w.first[r], w.before[r], w.count[r] = a, w.n, b - a + 1
    w.n = w.n + (b - a + 1)
  end
  local function at(w, k)   -- the k-th start, 1 <= k <= w.n, in the order they were added
    local lo, hi = 1, #w.first
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if w.before[mid] < k then lo = mid else hi = mid - 1 end
    end
    return w.first[lo] + (k - w.before[lo] - 1)
  end
  local train_w, val_w = windows(), windows()
  local block = math.min(BLOCK, math.max(T + 1, math.floor(#text / 10)))
  for b0 = 0, #text - (T + 1), block do
    local last = math.min(b0 + block, #text) - (T + 1)
    add((math.floor(b0 / block) % 10 == 9) and val_w or train_w, b0, last)
  end
  if val_w.n == 0 then   -- a short file: hold out its last tenth instead
    local cut = math.floor(train_w.n * 0.9)
    local head = windows()
    for r = 1, #train_w.first do
      local a, c, before = train_w.first[r], train_w.count[r], train_w.before[r]
      local keep = math.max(0, math.min(c, cut - before))
      add(head, a, a + keep - 1)
      add(val_w, a + keep, a + c - 1)
    end
    train_w = head
  end
  -- a fixed, evenly spread subset of the validation windows
  local val = {}
  local nval = math.min(o.val_windows, val_w.n)
  for i = 0, nval - 1 do val[#val + 1] = at(val_w, 1 + math.floor(i * val_w.n / nval)) end

  local penv = { ctx = ctx, dtype = env.dtype }
  local params, W = {}, {}
  local k = 0
  local function add(name, t, tags)
    k = k + 1
    local p = L.param(name, t, tags)
    params[#params + 1] = p
    W[name] = p
    return p
  end
  local function normal(shape, std) k = k + 1 return L.normal(shape, std, seed, 1000 + k, penv) end
  add("embed_tokens.weight", normal({ V, E }, 1))
  add("context_proj.weight", normal({ width, T * E }, 1 / math.sqrt(T * E)))
  add("context_proj.bias", ms.zeros({ width }, penv), { "no_decay" })
  for i = 0, o.layers - 1 do
    local pre = "layers." .. i .. "."
    add(pre .. "norm.weight", ms.ones({ width }, penv), { "no_decay" })
    add(pre .. "up_proj.weight", normal({ ffn, width }, 1 / math.sqrt(width)))
    add(pre .. "up_proj.bias", ms.zeros({ ffn }, penv), { "no_decay" })
    -- residual branches start small, so the stack begins close to the identity (GPT-2's scaling)
    add(pre .. "down_proj.weight", normal({ width, ffn }, 1 / math.sqrt(ffn * 2 * math.max(o.layers, 1))))
    add(pre .. "down_proj.bias", ms.zeros({ width }, penv), { "no_decay" })
  end
  add("norm.weight", ms.ones({ width }, penv), { "no_decay" })
  add("lm_head.weight", normal({ V, width }, 1 / math.sqrt(width)))

  local inst = {
    params = params, width = width, source = source, corpus_bytes = #text,
    train_windows = train_w.n, val_windows = #val,
    tokens_per_step = o.batch,
  }

  --- A batch from windows given as arrays of T + 1 byte values (context in order, then the target): the
  --- one-hot context, transposed [256, B*T], and the one-hot targets [B, 256].
  function inst.batch_of_bytes(rows)
    local ids, tgt = {}, {}
    for i, row in ipairs(rows) do
      if #row ~= T + 1 then error(("lm: a window needs %d bytes (got %d)"):format(T + 1, #row), 2) end
      for t = 1, T do ids[(i - 1) * T + t] = row[t] end
      tgt[i] = row[T + 1]
    end
    return { xt = L.onehot(ids, V, penv, true), y = L.onehot(tgt, V, penv), n = #rows }
  end

  -- the batch of the windows starting at the given offsets of the text
  local function batch_of(starts)
    local rows = {}
    for i, s in ipairs(starts) do
      local row = {}
      for t = 1, T + 1 do row[t] = text:byte(s + t) end
      rows[i] = row
    end
    return inst.batch_of_bytes(rows)
  end

  --- The training batch of a step: positions drawn from (seed, step) alone, so a resumed run sees the
  --- same batches as an uninterrupted one.
  function inst.train_batch(step)
    local u = L.rng(seed * 1000003 + step)
    local starts = {}
    for i = 1, o.batch do starts[i] = at(train_w, 1 + math.floor(u() * train_w.n)) end
    return batch_of(starts)
  end

  local function forward(b, want_grad)
    local B = b.n
    local emb = ms.matmul(b.xt, W["embed_tokens.weight"].param, { trans_a = true })   -- [B*T, E]
    local cat = emb:view({ B, T * E })
    local h = L.linear(cat, W["context_proj.weight"].param, W["context_proj.bias"].param)
    local caches = {}
    for i = 0, o.layers - 1 do
      local pre = "layers." .. i .. "."
      local n, nc = L.rmsnorm(h, W[pre .. "norm.weight"].param, 1e-6)
      local a = L.linear(n, W[pre .. "up_proj.weight"].param, W[pre .. "up_proj.bias"].param)
      local r = a:relu()
      h = h + L.linear(r, W[pre .. "down_proj.weight"].param, W[pre .. "down_proj.bias"].param)
      caches[i] = { n = n, nc = nc, a = a, r = r }
    end
    local n, nc = L.rmsnorm(h, W["norm.weight"].param, 1e-6)
    local logits = L.linear(n, W["lm_head.weight"].param)
    local loss, dlogits, correct = L.softmax_xent(logits, b.y, want_grad, not want_grad)
    if not want_grad then return loss, correct end

    -- backward, last layer first
    local dn = L.linear_backward(dlogits, n, W["lm_head.weight"].param, W["lm_head.weight"].grad)
    local dh = L.rmsnorm_backward(dn, nc, W["norm.weight"].param, W["norm.weight"].grad)
    for i = o.layers - 1, 0, -1 do
      local pre, c = "layers." .. i .. ".", caches[i]
      local dr = L.linear_backward(dh, c.r, W[pre .. "down_proj.weight"].param, W[pre .. "down_proj.weight"].grad,
                                   W[pre .. "down_proj.bias"].grad)
      local da = L.relu_backward(dr, c.a)
      local dni = L.linear_backward(da, c.n, W[pre .. "up_proj.weight"].param, W[pre .. "up_proj.weight"].grad,
                                    W[pre .. "up_proj.bias"].grad)
      dh = dh + L.rmsnorm_backward(dni, c.nc, W[pre .. "norm.weight"].param, W[pre .. "norm.weight"].grad)
    end
    local dcat = L.linear_backward(dh, cat, W["context_proj.weight"].param, W["context_proj.weight"].grad,
                                   W["context_proj.bias"].grad)
    ms.matmul(b.xt, dcat:view({ B * T, E }), { out = W["embed_tokens.weight"].grad })
    return loss
  end

  --- Loss of a batch, gradients written into the registered buffers.
  function inst.loss_grad(b) return forward(b, true) end
  --- Loss of a batch, no gradients.
  function inst.loss(b) return (forward(b, false)) end

  --- Validation: mean loss (nats per byte) and next-byte accuracy over the held-out windows.
  function inst.evaluate()
    local total, correct, chunk = 0, 0, 256
    for i = 1, #val, chunk do
      local starts = {}
      for j = i, math.min(i + chunk - 1, #val) do starts[#starts + 1] = val[j] end
      local loss, c = forward(batch_of(starts), false)
      total = total + loss * #starts
      correct = correct + c
    end
    return { loss = total / #val, accuracy = correct / #val }
  end

  function inst.describe()
    local n = 0
    for _, p in ipairs(params) do n = n + p.param:numel() end
    return ("lm: %d parameters (width %d, %d layers, context %d bytes x %d-dim embeddings); %d bytes of %s, %d training / %d validation windows")
      :format(n, width, o.layers, T, E, #text, source, train_w.n, #val)
  end
  return inst
end

return P
