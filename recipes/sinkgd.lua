--[[
sinkgd -- SinkGD: gradient descent on the SR-Sinkhorn-normalized gradient for matrices, AdamW for the rest.

For a matrix parameter W [m, n] (or a stack [..., m, n] of independent matrices, e.g. MoE experts) with
gradient G, SR-Sinkhorn alternates L times
    X <- sqrt(n) X / ||row norms of X||      then      X <- sqrt(m) X / ||column norms of X||     (X0 = G)
so that every row of X has norm sqrt(n) and every column sqrt(m) (an Adam-like per-entry scale with no state),
and the step is
    W <- W (1 - eta wd) - eta X,          eta = lr * alpha_eff
with alpha_eff = sinkgd_lr_scale, times (sinkgd_base_width / n)^sinkgd_lr_width_exponent when
sinkgd_base_width is set (width transfer; n = d_in = the last dim).  Weight decay is scaled by eta, as in
axolotl: with alpha 0.05 it is 20 times weaker than AdamW's with the same weight_decay.  As in axolotl, m and n
are the last two dims whatever the layout: experts stored [E, in, out] get the width factor and the muon
target of their transpose.
  spectral (sinkgd_spectral_norm): the step is rescaled to operator norm eta * tau, tau = 1 ("unit") or
    sqrt(m / n) ("muon"), with sigma = ||X||_2 estimated by warm-started power iteration (state specnorm_u).
    A u that X nearly annihilates (||X u|| <= 1e-4 ||X||_F ||u||) restarts the step once from the seeded start
    vector, and X^T v = 0 keeps u, so no step starts from a zero vector (axolotl has neither guard).
  sphere (sinkgd_md_sphere, SinkGDMD): W moves on the sphere of radius ||W||_F captured at its first step
    (state md_target_norm): W <- (W - a X) t / ||W - a X||, a = eta t / sigma.  No weight decay; it ignores
    sinkgd_spectral_norm and sinkgd_spectral_target.
The engine carries X as two scale vectors (X = diag(r) G diag(c)), never writing it: same math, no rounding of
X between half-steps (ms.sinkgd_step; semantics in moonstep.h).

Everything else -- parameters of fewer than 2 dims, and by default those whose names contain embed_tokens,
lm_head, wte or word_embeddings or end with modules_to_save.default.weight (PEFT) -- goes to AdamW with
weight_decay 0 and the plain lr, its moments in 8 bits (torchao's block-wise dynamic-tree quantization) when
the tensor has >= 4096 elements and a multiple of block_size, else in f32.

Sources: Scetbon, Ma, Gong, Meeds, "Gradient Multi-Normalization for Efficient LLM Training" (arXiv
2502.06742, Algorithms 3 and 4); axolotl's SinkGD / SinkGDMD (PRs 3763 and 3785: knobs, routing, spectral
target, sphere variant, width transfer); torchao's AdamW8bit (Dettmers et al., arXiv 2110.02861).  Digest:
research/sinkgd.md.

Routing, first rule that applies (tags are given with the parameter: {name=, param=, grad=, tags={"adamw"}}):
  1. tag "adamw" or "sinkgd" (a parameter tagged sinkgd must have >= 2 dims)
  2. fewer than 2 dims                                  -> adamw
  3. name matches one of sinkgd_patterns                -> sinkgd
  4. name matches one of adamw_patterns                 -> adamw
  5. a dim equal to one of adamw_dims (e.g. the vocab)  -> adamw
  6. name contains embed_tokens, lm_head, wte or word_embeddings, or ends with
     modules_to_save.default.weight                    -> adamw
  7. otherwise                                          -> sinkgd
A parameter tagged "no_decay" (the Python bridge's param groups with weight_decay 0) takes no weight decay.
Patterns are Lua patterns (string.find), e.g. "tok_embeddings", "^output%.weight$", "wpe".  Rule 6 is
axolotl's, suffix included: the matrices inside a saved module (modules_to_save.default.dense.weight) and
another adapter's copies go to SinkGD there, so here too; adamw_patterns = {"modules_to_save"} sends them all
to AdamW.

Options (axolotl's names and defaults; strings from config files are converted: "False", "0.1"):
  lr                          base learning rate (the runtime's schedule scales it)            1e-3
  weight_decay                SinkGD weight decay (scaled by eta; AdamW group: always 0)       0
  betas                       AdamW {beta1, beta2}                                             {0.9, 0.999}
  eps                         AdamW denominator term                                           1e-8
  sinkhorn_iters              SR-Sinkhorn iterations L (0: plain SGD on the gradient, times alpha)   5
  sinkgd_lr_scale             alpha: SinkGD's step is lr * alpha_eff                           0.05
  sinkgd_eps                  lower clamp of every row, column and vector norm                 1e-8
  sinkgd_spectral_norm        rescale each update to the spectral target                       false
  sinkgd_spectral_norm_iters  power-iteration steps per update (>= 1; warm-started)             1
  sinkgd_spectral_target      "unit" (||update||_2 = eta) or "muon" (eta sqrt(m / n))          "unit"
  sinkgd_base_width           width transfer: alpha_eff = alpha (base / d_in)^exponent; nil = off   nil
  sinkgd_lr_width_exponent    the exponent above (0 disables)                                  1.0
  sinkgd_md_sphere            the SinkGDMD weight-sphere variant                               false
  bf16_stochastic_round       stochastic rounding when storing bf16 params (f16 params too)    false
  block_size                  elements per 8-bit quantization block of the AdamW state         256
  sinkgd_fused_kernel         accepted for axolotl configs; no effect (moonstep is always fused)  false
  sinkgd_fused_min_numel      accepted for axolotl configs; no effect                          33554432
moonstep's own:
  adamw_state                 AdamW moment format: "8bit" (f32 for tensors too small or not a
                              multiple of block_size), "f32" or "bf16"                         "8bit"
  adamw_patterns              names (Lua patterns) routed to AdamW; a list or "a,b"           {}
  sinkgd_patterns             names routed to SinkGD (ahead of adamw_patterns and the defaults)   {}
  adamw_dims                  dim sizes that route a parameter to AdamW (e.g. {vocab_size})    {}
  seed                        Philox key of the stochastic rounding and of the power iteration's
                              first vector, below 2^32 (each call's key: ctx.rng_key(seed))    0
Refused: sinkhorn_iters < 0, sinkgd_spectral_norm_iters < 1, a target other than unit/muon, and
sinkgd_base_width together with sinkgd_spectral_norm and the muon target (both correct for width: the
correction would count twice; axolotl refuses it too).

Where moonstep deliberately differs from axolotl (options, defaults, routing and the math above are its):
  - X is never rounded between half-steps (above); results match axolotl's compiled path to bf16 tolerance.
  - the power iteration's first u is the seeded vector of ms.sinkgd_step (key: seed), not an unseeded
    torch.randn, and has the two guards above.
  - AdamW moments too small for 8 bits (or not a multiple of block_size) are f32; torchao keeps them in the
    param's dtype (bf16 for bf16 params).
  - the 8-bit step is ms_adamw_step's f32 math (m = b1 m + (1 - b1) g, lr / bc1 folded in f64) where torchao
    lerps and folds in f32, and its quantization maps are rounded once from f64 where torch computes them in
    f32 (moonstep.h, ms_adamw8_qmap: some codes differ in the last bit or two): parameters agree to f32
    rounding and codes but at rounding thresholds (tests/python/test_bridge.py checks it against torchao's
    formulas).
  - bf16_stochastic_round rounds f16 params too (axolotl: bf16 only).
  - every option given as a string is converted; axolotl's "k=v" optim_args leave sinkgd_eps,
    bf16_stochastic_round and block_size strings (its "False" turns stochastic rounding on).
  - refused where axolotl goes on: sinkgd_spectral_norm_iters = 0 (axolotl crashes in the step), eps = 0 or
    sinkgd_eps = 0 (torchao takes eps = 0: a zero gradient element then gives 0/0), sinkgd_base_width < 1,
    a flag string other than true/false, 1/0, yes/no, on/off (axolotl reads any other word as false).
  - a matrix with an empty last dim (d_in = 0) takes the plain alpha (axolotl divides by zero).

State: sinkgd matrices none (base), specnorm_u f32 [..., n] (spectral, sphere), md_target_norm f32 [...]
(sphere; -1 until captured); adamw exp_avg and exp_avg_sq (u8 codes with f32 exp_avg_scale and
exp_avg_sq_scale [numel / block_size] in 8 bits).

Several ranks (moonstep.optim, "Several ranks"): a parameter sharded by rows or columns is one matrix to the
recipe -- info.shape is the whole one (alpha_eff's width, the muon target), the state is the slice's
(specnorm_u [..., n_local] for columns) -- and ms.sinkgd_step exchanges the norm vectors across the ranks
(moonstep.shard).  A slice's AdamW moments are 8-bit only when its blocks are the whole parameter's (see
uses_8bit).
]]

-- rule 6 (axolotl's names and PEFT suffix): moonstep.routing, shared with dash
local adamw_by_name = ms.routing.adamw_by_name

-- whether name holds one of list's entries (Lua patterns: the pattern options, matched here under the sandbox's
-- limits)
local function finds_any(name, list)
  for _, pat in ipairs(list) do
    if name:find(pat) then return true end
  end
  return false
end

local function mode_of(o)
  if o.sinkgd_md_sphere then return "sphere" end
  if o.sinkgd_spectral_norm then return "spectral" end
  return "base"
end

-- SinkGD's learning-rate multiplier for a matrix whose last dim (d_in) is n (an empty one, n = 0, has nothing to
-- scale: the plain alpha, not the infinite width factor the engine would refuse for the whole group)
local function alpha_eff(shape, o)
  local a = o.sinkgd_lr_scale
  if o.sinkgd_base_width ~= nil and shape[#shape] > 0 then
    a = a * (o.sinkgd_base_width / shape[#shape]) ^ o.sinkgd_lr_width_exponent
  end
  return a
end

-- 8-bit moments quantize blocks of block_size consecutive elements of the flattened parameter.  A slice of a
-- sharded parameter (this rank's part, info.shard) takes them only when it is a block-aligned run of the
-- whole parameter's elements (rows of a matrix from a multiple of block_size elements): its blocks are then
-- the whole parameter's, as on one rank, and checkpoints join and cut them.  Other slices keep f32 moments.
-- The whole parameter must take them on one rank too (info.numel, a multiple of block_size): an aligned
-- slice of a matrix kept in f32 there would otherwise quantize its moments, unlike one rank.
local function uses_8bit(m, o)
  local numel, s = m.param:numel(), m.info.shard
  if o.adamw_state ~= "8bit" or m.param:dtype() == "f64" or m.info.numel < 4096 or m.info.numel % o.block_size ~= 0
     or numel % o.block_size ~= 0 then
    return false
  end
  return s == nil or (s.dim == "rows" and m.info.ndim == 2 and s.offset * m.info.shape[2] % o.block_size == 0)
end

-- the route of parameter p, by the rules of the header (rule 1 to 7)
local function pick_route(p, o)
  local tagged_a, tagged_s = p.tags.adamw, p.tags.sinkgd
  if tagged_a and tagged_s then
    error(("sinkgd: parameter '%s' is tagged both adamw and sinkgd"):format(p.name), 0)
  end
  if tagged_s and p.ndim < 2 then
    error(("sinkgd: parameter '%s' is tagged sinkgd but has shape [%s]; SinkGD needs >= 2 dims")
          :format(p.name, table.concat(p.shape, ",")), 0)
  end
  if tagged_a then return "adamw" end
  if tagged_s then return "sinkgd" end
  if p.ndim < 2 then return "adamw" end
  if finds_any(p.name, o.sinkgd_patterns) then return "sinkgd" end
  if finds_any(p.name, o.adamw_patterns) then return "adamw" end
  for _, d in ipairs(p.shape) do
    for _, a in ipairs(o.adamw_dims) do
      if d == a then return "adamw" end
    end
  end
  if adamw_by_name(p.name) then return "adamw" end
  return "sinkgd"
end


return {
  name = "sinkgd",
  version = 1,
  options = {
    lr = { default = 1e-3, type = "number", min = 0, doc = "base learning rate (the schedule scales it)" },
    weight_decay = { default = 0.0, type = "number", min = 0, doc = "SinkGD weight decay, scaled by lr * alpha_eff" },
    betas = { default = { 0.9, 0.999 }, type = "numbers", length = 2, min = 0, below = 1, doc = "AdamW {beta1, beta2}" },
    eps = { default = 1e-8, type = "number", above = 0, doc = "AdamW denominator term" },
    sinkhorn_iters = { default = 5, type = "integer", min = 0, doc = "SR-Sinkhorn iterations" },
    sinkgd_lr_scale = { default = 0.05, type = "number", min = 0, doc = "alpha: SinkGD step = lr * alpha_eff" },
    sinkgd_eps = { default = 1e-8, type = "number", above = 0, doc = "lower clamp of every norm" },
    sinkgd_spectral_norm = { default = false, type = "boolean", doc = "rescale updates to the spectral target" },
    sinkgd_spectral_norm_iters = { default = 1, type = "integer", min = 1, doc = "power-iteration steps per update" },
    sinkgd_spectral_target = { default = "unit", type = "string", values = { "unit", "muon" }, doc = "unit or muon (sqrt(m/n))" },
    sinkgd_base_width = { type = "integer", min = 1, doc = "width transfer base (nil: off)" },
    sinkgd_lr_width_exponent = { default = 1.0, type = "number", doc = "width transfer exponent" },
    sinkgd_md_sphere = { default = false, type = "boolean", doc = "weight-sphere (SinkGDMD) variant" },
    bf16_stochastic_round = { default = false, type = "boolean", doc = "stochastic rounding of bf16/f16 params" },
    block_size = { default = 256, type = "integer", min = 1, max = 4096, doc = "8-bit AdamW state block" },
    sinkgd_fused_kernel = { default = false, type = "boolean", doc = "axolotl's; no effect (always fused)" },
    sinkgd_fused_min_numel = { default = 33554432, type = "integer", min = 0, doc = "axolotl's; no effect" },
    adamw_state = { default = "8bit", type = "string", values = { "8bit", "f32", "bf16" }, doc = "AdamW moment format" },
    adamw_patterns = { default = {}, type = "patterns", doc = "name patterns routed to AdamW" },
    sinkgd_patterns = { default = {}, type = "patterns", doc = "name patterns routed to SinkGD" },
    adamw_dims = { default = {}, type = "numbers", integer = true, min = 1, doc = "dim sizes routed to AdamW" },
    seed = { default = 0, type = "integer", min = 0, max = 2 ^ 32 - 1, doc = "stochastic rounding and power-iteration key" },
  },

  validate = function(o)
    if o.sinkgd_base_width ~= nil and o.sinkgd_spectral_norm and o.sinkgd_spectral_target == "muon" then
      error("sinkgd: option 'sinkgd_base_width' cannot be combined with sinkgd_spectral_norm and "
            .. "sinkgd_spectral_target = 'muon': both correct the step for the width, which would count twice", 0)
    end
  end,

  route = function(p, o)
    local r = pick_route(p, o)
    if r == "sinkgd" and p.tags.no_decay then return r, { weight_decay = 0 } end
    return r
  end,

  routes = {
    sinkgd = {
      -- (1) state: none in base mode; u (zeros: the kernel starts it) and the radius (-1: not captured)
      init = function(group, o)
        local mode = mode_of(o)
        if mode == "base" then return end
        for _, m in ipairs(group) do
          local shape, ctx = m.param:shape(), m.param:context()
          local lead = {}
          for d = 1, #shape - 2 do lead[d] = shape[d] end
          local ushape = { unpack(lead) }
          ushape[#ushape + 1] = shape[#shape]
          m.state.specnorm_u = ms.zeros(ushape, { dtype = "f32", ctx = ctx })
          if mode == "sphere" then m.state.md_target_norm = ms.full(lead, -1, { dtype = "f32", ctx = ctx }) end
        end
      end,
      -- (2) one fused call for the whole group; alpha_eff per member, lr and step as device scalars
      step = function(group, o, ctx)
        local mode = mode_of(o)
        local params, grads, us, ts, scales = {}, {}, {}, {}, {}
        for i, m in ipairs(group) do
          params[i], grads[i], scales[i] = m.param, m.grad, alpha_eff(m.info.shape, o)
          us[i], ts[i] = m.state.specnorm_u, m.state.md_target_norm
        end
        ms.sinkgd_step {
          params = params, grads = grads, scales = scales, lr = ctx.lr_t, step = ctx.step_t,
          specnorm_u = mode ~= "base" and us or nil, md_target_norm = mode == "sphere" and ts or nil,
          mode = mode, iters = o.sinkhorn_iters, sn_iters = o.sinkgd_spectral_norm_iters,
          target = o.sinkgd_spectral_target, eps = o.sinkgd_eps,
          weight_decay = mode == "sphere" and 0 or o.weight_decay,
          stochastic_round = o.bf16_stochastic_round, seed = ctx.rng_key(o.seed),
          skip = ctx.skip_t,   -- the runtime's device-side non-finite flag (captured steps)
        }
      end,
      -- (3) a sharded member's state across the ranks (checkpoints): u follows the columns where they are
      -- split (rows-sharded: every rank holds all of u); the sphere's radius is the whole matrix's everywhere
      state_shard = function(m, key)
        if key == "specnorm_u" and m.info.shard.dim == "cols" then return m.info.ndim - 2 end
        return false
      end,
    },

    adamw = {
      init = function(group, o)
        for _, m in ipairs(group) do
          local shape, ctx = m.param:shape(), m.param:context()
          if uses_8bit(m, o) then
            local blocks = { m.param:numel() / o.block_size }
            m.state.exp_avg = ms.zeros(shape, { dtype = "u8", ctx = ctx })
            m.state.exp_avg_scale = ms.zeros(blocks, { dtype = "f32", ctx = ctx })
            m.state.exp_avg_sq = ms.zeros(shape, { dtype = "u8", ctx = ctx })
            m.state.exp_avg_sq_scale = ms.zeros(blocks, { dtype = "f32", ctx = ctx })
          else
            local dt = o.adamw_state == "bf16" and "bf16" or "f32"
            m.state.exp_avg = ms.zeros(shape, { dtype = dt, ctx = ctx })
            m.state.exp_avg_sq = ms.zeros(shape, { dtype = dt, ctx = ctx })
          end
        end
      end,
      -- at most two launches: the 8-bit members, then the others (more only when members count different
      -- steps: a parameter's bias corrections count the steps it had a gradient in, as torchao's state["step"]);
      -- no weight decay (axolotl's fallback group)
      step = function(group, o, ctx)
        local q = { params = {}, grads = {}, exp_avg = {}, exp_avg_scale = {}, exp_avg_sq = {}, exp_avg_sq_scale = {},
                    steps = {} }
        local f = { params = {}, grads = {}, exp_avg = {}, exp_avg_sq = {}, steps = {} }
        for _, m in ipairs(group) do
          local s = m.state
          local into = s.exp_avg_scale and q or f
          local k = #into.params + 1
          into.params[k], into.grads[k], into.exp_avg[k], into.exp_avg_sq[k] = m.param, m.grad, s.exp_avg, s.exp_avg_sq
          into.steps[k] = ctx.step_of(m)
          if into == q then q.exp_avg_scale[k], q.exp_avg_sq_scale[k] = s.exp_avg_scale, s.exp_avg_sq_scale end
        end
        for _, set in ipairs { q, f } do
          if #set.params > 0 then
            set.lr, set.skip = ctx.lr_t, ctx.skip_t
            set.beta1, set.beta2, set.eps, set.weight_decay = o.betas[1], o.betas[2], o.eps, 0
            -- two calls, two random streams (a direct engine call numbers its members from 0; the runtime's
            -- members carry their place in the route: ms.set_rng_origin)
            set.seed = ctx.rng_key(o.seed, set == q and 0 or 1)
            set.stochastic_round, set.block_size = o.bf16_stochastic_round, o.block_size
            if set == q then ms.adamw8_step(set) else set.block_size = nil ms.adamw_step(set) end
          end
        end
      end,
      -- a sharded member's 8-bit scales: one per block of the flattened rows (the moments: like the slice)
      state_shard = function(m, key, o)
        if key == "exp_avg_scale" or key == "exp_avg_sq_scale" then return 0, m.info.shape[2], o.block_size end
      end,
    },
  },
}
