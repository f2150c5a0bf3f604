--[[
sgd -- stochastic gradient descent with momentum and Nesterov momentum, as torch.optim.SGD.

  d   = g + weight_decay * p                    (coupled weight decay, as torch)
  buf = d on the first step, then momentum * buf + (1 - dampening) * d
  d   = d + momentum * buf (nesterov) or buf
  p   = p - lr * d

Source: Sutskever et al., "On the importance of initialization and momentum in deep learning" (2013);
semantics of torch.optim.SGD.  This file is also the worked example of a recipe: options with their specs,
validate, route, and a route with init (state) and step (one fused multi-tensor kernel for the group).

Options:
  lr            learning rate (the runtime's schedule scales it)                       default 0.01
  momentum      momentum factor (0: plain SGD, no state)                               default 0
  dampening     dampening of the momentum                                              default 0
  weight_decay  coupled L2 penalty added to the gradient                               default 0
  nesterov      Nesterov momentum (needs momentum > 0 and dampening 0)                 default false
  state_dtype   dtype of the momentum buffer: "f32" or "bf16"                          default "f32"
  stochastic_round  round bf16/f16 parameters stochastically when storing them         default false
  seed          key of the stochastic rounding, below 2^32 (ctx.rng_key)               default 0
A parameter tagged "no_decay" (the Python bridge's param groups with weight_decay 0) takes no weight decay.
]]
return {
  name = "sgd",
  version = 1,
  options = {
    lr = { default = 0.01, type = "number", min = 0, doc = "learning rate (the schedule scales it)" },
    momentum = { default = 0, type = "number", min = 0, doc = "momentum factor" },
    dampening = { default = 0, type = "number", min = 0, max = 1, doc = "dampening of the momentum" },
    weight_decay = { default = 0, type = "number", min = 0, doc = "coupled L2 penalty" },
    nesterov = { default = false, type = "boolean", doc = "Nesterov momentum" },
    state_dtype = { default = "f32", type = "string", values = { "f32", "bf16" }, doc = "momentum buffer dtype" },
    stochastic_round = { default = false, type = "boolean", doc = "stochastic rounding of bf16/f16 params" },
    seed = { default = 0, type = "integer", min = 0, max = 2 ^ 32 - 1, doc = "stochastic rounding key" },
  },

  -- cross-option rules; errors name the option
  validate = function(o)
    if o.nesterov and (o.momentum <= 0 or o.dampening ~= 0) then
      error("sgd: option 'nesterov' needs momentum > 0 and dampening = 0", 0)
    end
  end,

  -- every parameter takes the same route; one tagged "no_decay" (the Python bridge's param groups with
  -- weight_decay 0) forms a group without weight decay
  route = function(p, o)
    if p.tags.no_decay then return "sgd", { weight_decay = 0 } end
    return "sgd"
  end,

  routes = {
    sgd = {
      -- (1) state: a momentum buffer per parameter, only when there is momentum
      init = function(group, o)
        if o.momentum > 0 then
          for _, m in ipairs(group) do
            m.state.momentum_buffer = ms.zeros(m.param:shape(), { dtype = o.state_dtype, ctx = m.param:context() })
          end
        end
      end,
      -- (2) one fused launch for the whole group (one per step count); lr and step come as device scalars
      -- (capture-safe)
      step = function(group, o, ctx)
        -- (a parameter's first step, which starts its momentum buffer, is the first it has a gradient in)
        local params, grads, bufs, steps = {}, {}, o.momentum > 0 and {} or nil, {}
        for i, m in ipairs(group) do
          params[i], grads[i] = m.param, m.grad
          if bufs then bufs[i] = m.state.momentum_buffer end
          steps[i] = ctx.step_of(m)
        end
        ms.sgd_step {
          params = params, grads = grads, momentum_buf = bufs, lr = ctx.lr_t, steps = steps,
          momentum = o.momentum, dampening = o.dampening, weight_decay = o.weight_decay, nesterov = o.nesterov,
          stochastic_round = o.stochastic_round, seed = ctx.rng_key(o.seed),
          skip = ctx.skip_t,   -- the runtime's device-side non-finite flag (captured steps)
        }
      end,
    },
  },
}
