--[[
adamw -- Adam with decoupled weight decay, as torch.optim.AdamW.

  p = p * (1 - lr * weight_decay)
  m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g^2
  p = p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Source: Kingma & Ba, "Adam" (2015); Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (2019).
One fused multi-tensor kernel updates every parameter of a group (ms.adamw_step).

Routing: every parameter goes to "adamw"; parameters tagged "no_decay", and 1-D parameters (biases, norm
gains) when no_decay_1d is set, form a second group with weight_decay = 0.

Options:
  lr                learning rate (the runtime's schedule scales it)                    default 1e-3
  betas             {beta1, beta2}                                                      default {0.9, 0.999}
  eps               added to the denominator                                            default 1e-8
  weight_decay      decoupled weight decay                                              default 0.01
  bias_correction   divide the moments by 1 - beta^t                                    default true
  no_decay_1d       no weight decay for parameters of fewer than 2 dims                 default false
  state_dtype       dtype of exp_avg / exp_avg_sq: "f32" or "bf16"                      default "f32"
  stochastic_round  round bf16/f16 parameters stochastically when storing them         default false
  seed              key of the stochastic rounding, below 2^32 (ctx.rng_key)            default 0
]]
return {
  name = "adamw",
  version = 1,
  options = {
    lr = { default = 1e-3, type = "number", min = 0, doc = "learning rate (the schedule scales it)" },
    betas = { default = { 0.9, 0.999 }, type = "numbers", length = 2, min = 0, below = 1, doc = "{beta1, beta2}" },
    eps = { default = 1e-8, type = "number", above = 0, doc = "denominator term" },
    weight_decay = { default = 0.01, type = "number", min = 0, doc = "decoupled weight decay" },
    bias_correction = { default = true, type = "boolean", doc = "divide the moments by 1 - beta^t" },
    no_decay_1d = { default = false, type = "boolean", doc = "no weight decay for parameters of < 2 dims" },
    state_dtype = { default = "f32", type = "string", values = { "f32", "bf16" }, doc = "moment state dtype" },
    stochastic_round = { default = false, type = "boolean", doc = "stochastic rounding of bf16/f16 params" },
    seed = { default = 0, type = "integer", min = 0, max = 2 ^ 32 - 1, doc = "stochastic rounding key" },
  },

  route = function(p, o)
    if p.tags.no_decay or (o.no_decay_1d and p.ndim < 2) then return "adamw", { weight_decay = 0 } end
    return "adamw"
  end,

  routes = {
    adamw = {
      init = function(group, o)
        for _, m in ipairs(group) do
          local opts = { dtype = o.state_dtype, ctx = m.param:context() }
          m.state.exp_avg = ms.zeros(m.param:shape(), opts)
          m.state.exp_avg_sq = ms.zeros(m.param:shape(), opts)
        end
      end,
      step = function(group, o, ctx)
        -- each parameter's bias corrections count the steps it had a gradient in (torch's state["step"])
        local params, grads, m1, m2, steps = {}, {}, {}, {}, {}
        for i, m in ipairs(group) do
          params[i], grads[i], m1[i], m2[i] = m.param, m.grad, m.state.exp_avg, m.state.exp_avg_sq
          steps[i] = ctx.step_of(m)
        end
        ms.adamw_step {
          params = params, grads = grads, exp_avg = m1, exp_avg_sq = m2, lr = ctx.lr_t, steps = steps,
          beta1 = o.betas[1], beta2 = o.betas[2], eps = o.eps, weight_decay = o.weight_decay,
          bias_correction = o.bias_correction, stochastic_round = o.stochastic_round, seed = ctx.rng_key(o.seed),
          skip = ctx.skip_t,   -- the runtime's device-side non-finite flag (captured steps)
        }
      end,
    },
  },
}
