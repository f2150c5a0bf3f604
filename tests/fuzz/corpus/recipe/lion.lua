--[[
lion -- EvoLved Sign Momentum: the update is the sign of an interpolation between the momentum and the
gradient, so every coordinate moves by exactly lr (plus decay), and the momentum is kept with a slower
rate than the one used for the update.

  c = beta1 * m + (1 - beta1) * g              interpolation used for this step's direction
  p = p - lr * weight_decay * p                decoupled weight decay (as AdamW)
  p = p - lr * sign(c)
  m = beta2 * m + (1 - beta2) * g              momentum, updated after the step

Source: Chen et al., "Symbolic Discovery of Optimization Algorithms" (NeurIPS 2023), Algorithm 2; the
defaults are the paper's (betas 0.9, 0.99).  The paper's advice: an lr 3-10x smaller than AdamW's and a
weight decay 3-10x larger, since a sign update has a larger norm.

A worked example of a recipe written with public primitives only (no new C): lerp, sign, addcmul.  The
learning rate is read from the device scalar ctx.lr_t, so the step can be captured in a CUDA graph and
replayed with a new learning rate.  One state tensor per parameter (exp_avg), as in the paper: half the
state of AdamW.

Routing: every parameter takes the "lion" route; parameters tagged "no_decay", and 1-D parameters when
no_decay_1d is set, form a second group with weight_decay = 0.

Options:
  lr            learning rate (the runtime's schedule scales it)                    default 1e-4
  betas         {beta1 (update interpolation), beta2 (momentum)}                    default {0.9, 0.99}
  weight_decay  decoupled weight decay                                              default 0
  no_decay_1d   no weight decay for parameters of fewer than 2 dims                 default false
]]
return {
  name = "lion",
  version = 1,
  options = {
    lr = { default = 1e-4, type = "number", min = 0, doc = "learning rate (the schedule scales it)" },
    betas = { default = { 0.9, 0.99 }, type = "numbers", length = 2, min = 0, max = 1,
              doc = "{beta1 (update interpolation), beta2 (momentum)}" },
    weight_decay = { default = 0, type = "number", min = 0, doc = "decoupled weight decay" },
    no_decay_1d = { default = false, type = "boolean", doc = "no weight decay for parameters of < 2 dims" },
  },

  route = function(p, o)
    if p.tags.no_decay or (o.no_decay_1d and p.ndim < 2) then return "lion", { weight_decay = 0 } end
    return "lion"
  end,

  routes = {
    lion = {
      init = function(group, o)
        for _, m in ipairs(group) do m.state.exp_avg = ms.zeros_like(m.param) end
      end,
      step = function(group, o, ctx)
        local beta1, beta2 = o.betas[1], o.betas[2]
        for _, m in ipairs(group) do
          local p, g, mom = m.param, m.grad, m.state.exp_avg
          -- (1) the direction: sign of the interpolation (lerp(m, g, w) = m + w (g - m))
          local dir = ms.lerp(mom, g, 1 - beta1):sign_()
          -- (2) decoupled weight decay, then the signed step, both scaled by the device learning rate
          if o.weight_decay ~= 0 then ms.addcmul(p, p, ctx.lr_t, -o.weight_decay, p) end
          ms.addcmul(p, dir, ctx.lr_t, -1, p)
          -- (3) the momentum, with the slower rate
          mom:lerp_(g, 1 - beta2)
        end
      end,
    },
  },
}
