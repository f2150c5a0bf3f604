--[[
muon -- MomentUm Orthogonalized by Newton-Schulz: for the hidden weight matrices, the momentum of the
gradient is replaced by the nearest semi-orthogonal matrix (its singular values pushed to about 1) before
the step; every other parameter (embeddings, output head, biases, norm gains) is updated by AdamW.

Muon route, per [rows, cols] matrix:
  buf = momentum * buf + (1 - momentum) * g                            (the momentum, as an EMA)
  u   = nesterov ? (1 - momentum) * g + momentum * buf : buf
  X   = u / (||u||_F + 1e-7), transposed when rows > cols so that X X^T is the smaller Gram matrix
  ns_steps times:  A = X X^T;  B = b A + c A A;  X = a X + B X        (a, b, c) = (3.4445, -4.7750, 2.0315)
  p   = p - lr * weight_decay * p - lr * sqrt(max(1, rows / cols)) * X
The matrices: a 2-D parameter is one; a 3-D one [k, rows, cols] (stacked experts, fused q/k/v) is k of them,
each orthogonalised and normalised on its own, as the reference's batched iteration does; one of 4 or more
dims (conv filters [out, in, kh, kw]) is viewed as one [out, in * kh * kw] matrix, as the reference does for
4-D.  For those the reference scales by its last two dims (sqrt(max(1, kh / kw))), here by the matrix's
rows / cols, the same rule as for every other matrix (1 for a filter whose out <= in * kh * kw).

The quintic iteration (coefficients chosen to maximise the slope at zero, 3.4445) maps the singular values
of the normalised u into roughly [0.7, 1.2] in five steps, without an SVD -- those above about 1.5e-3 of
||u||_F; smaller ones grow by at most 3.4445^5 ~ 485.  The sqrt(max(1, rows/cols)) factor keeps the update's
RMS alike across shapes.

Source: Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024,
kellerjordan.github.io/posts/muon) and its reference implementation (github.com/KellerJordan/Muon,
muon.py: zeropower_via_newtonschulz5, muon_update, MuonWithAuxAdam); defaults are that implementation's.  It
runs the iteration in bf16 for speed; here it runs in the parameter's dtype unless ns_dtype says "bf16".

Routing: parameters with 2 or more dims whose names contain none of embed_tokens, lm_head, wte,
word_embeddings, embed (and are not tagged "adamw", or "adam") take the "muon" route; the rest take "adamw", with its own
learning rate (adam_lr, scaled by the same schedule as lr), betas, eps and weight decay.  A parameter tagged
"no_decay" (the Python bridge's param groups with weight_decay 0) takes no weight decay on either route.

A worked example of a recipe on public primitives only: matmul (with transposes, alpha and beta), lerp,
elementwise ops, reductions, and the fused AdamW kernel for the auxiliary route.  The learning rate comes
from the device scalar ctx.lr_t, so the step can be captured in a CUDA graph.

Options:
  lr                 learning rate of the Muon route (> 0; the schedule scales it)     default 0.02
  momentum           momentum coefficient                                            default 0.95
  nesterov           Nesterov-style momentum                                         default true
  ns_steps           Newton-Schulz iterations                                        default 5
  ns_dtype           dtype of the iteration: "param" (the parameter's) or "bf16"     default "param"
  weight_decay       decoupled weight decay of the Muon route                        default 0
  adam_lr            learning rate of the AdamW route (the schedule scales it)       default 3e-4
  adam_betas         {beta1, beta2} of the AdamW route                               default {0.9, 0.95}
  adam_eps           eps of the AdamW route                                          default 1e-10
  adam_weight_decay  decoupled weight decay of the AdamW route                       default 0
]]
local NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315
local EMBEDDING_NAMES = { "embed_tokens", "lm_head", "wte", "word_embeddings", "embed" }

-- the orthogonalised direction of u [rows, cols] or a stack [k, rows, cols] of matrices (each on its own; rows
-- <= cols after the transpose), as a new tensor
local function newton_schulz(u, steps, dtype)
  local shape = u:shape()
  local nd = #shape
  local tall = shape[nd - 1] > shape[nd]
  local x = tall and u:transpose(nd - 2, nd - 1) or u
  if dtype ~= x:dtype() then x = x:to(dtype) end
  -- each matrix's ||u||_F ([k, 1, 1] for a stack) stays on the device: no host round trip inside a step
  local nrm = x:square():sum(nd - 1, true):sum(nd - 2, true):sqrt():add_(1e-7)
  x = x / nrm
  for _ = 1, steps do
    local a = ms.matmul(x, x, { trans_b = true })                       -- A = X X^T
    local b = a * NS_B
    ms.matmul(a, a, { alpha = NS_C, beta = 1, out = b })                -- B = b A + c A A
    local nx = x * NS_A
    ms.matmul(b, x, { beta = 1, out = nx })                             -- X = a X + B X
    x = nx
  end
  return tall and x:transpose(nd - 2, nd - 1) or x
end

-- the route of parameter p, by the rules of the header
local function pick_route(p, o)
  -- "adamw" as sinkgd and dash name the tag; "adam", this recipe's first name for it, still works
  if p.ndim < 2 or p.tags.adamw or p.tags.adam then return "adamw" end
  for _, n in ipairs(EMBEDDING_NAMES) do
    if p.name:find(n, 1, true) then return "adamw" end
  end
  return "muon"
end

return {
  name = "muon",
  version = 1,
  options = {
    -- above 0: the AdamW route's rate is applied as a multiple of it (see its step)
    lr = { default = 0.02, type = "number", above = 0, doc = "learning rate of the Muon route" },
    momentum = { default = 0.95, type = "number", min = 0, below = 1, doc = "momentum coefficient" },
    nesterov = { default = true, type = "boolean", doc = "Nesterov-style momentum" },
    ns_steps = { default = 5, type = "integer", min = 0, doc = "Newton-Schulz iterations" },
    ns_dtype = { default = "param", type = "string", values = { "param", "bf16" }, doc = "dtype of the iteration" },
    weight_decay = { default = 0, type = "number", min = 0, doc = "decoupled weight decay (Muon route)" },
    adam_lr = { default = 3e-4, type = "number", min = 0, doc = "learning rate of the AdamW route" },
    adam_betas = { default = { 0.9, 0.95 }, type = "numbers", length = 2, min = 0, below = 1, doc = "{beta1, beta2} (AdamW route)" },
    adam_eps = { default = 1e-10, type = "number", above = 0, doc = "eps (AdamW route)" },
    adam_weight_decay = { default = 0, type = "number", min = 0, doc = "decoupled weight decay (AdamW route)" },
  },

  route = function(p, o)
    local r = pick_route(p, o)
    if p.tags.no_decay then return r, r == "muon" and { weight_decay = 0 } or { adam_weight_decay = 0 } end
    return r
  end,

  routes = {
    muon = {
      init = function(group, o)
        for _, m in ipairs(group) do
          -- Newton-Schulz orthogonalises the whole matrix: a slice of it would be orthogonalised on its own
          if m.info.shard then
            error(("muon: parameter '%s' is sharded across ranks; Muon orthogonalises whole matrices (leave it "
                   .. "unsharded: with settings.distribute = 'owner' each rank updates whole parameters of its own)")
                  :format(m.name), 0)
          end
          m.state.momentum_buffer = ms.zeros_like(m.param)
        end
      end,
      step = function(group, o, ctx)
        local beta = o.momentum
        for _, m in ipairs(group) do
          if m.param:numel() > 0 then   -- (an empty matrix has nothing to update, and no rows to divide by)
            local p, g, buf = m.param, m.grad, m.state.momentum_buffer
            -- (1) momentum as an EMA; the Nesterov direction looks one step ahead
            buf:lerp_(g, 1 - beta)
            local u = o.nesterov and ms.lerp(g, buf, beta) or buf
            -- (2) orthogonalise: a 3-D parameter as a stack of matrices, 4-D and up as [rows, rest] (header)
            local shape = p:shape()
            local mshape
            if #shape == 3 then mshape = shape else mshape = { shape[1], p:numel() / shape[1] } end
            local rows, cols = mshape[#mshape - 1], mshape[#mshape]
            local x = newton_schulz(u:reshape(mshape), o.ns_steps, o.ns_dtype == "bf16" and "bf16" or u:dtype())
            if x:dtype() ~= p:dtype() then x = x:to(p:dtype()) end
            -- (3) decoupled decay and the step, scaled by the device learning rate
            if o.weight_decay ~= 0 then ms.addcmul(p, p, ctx.lr_t, -o.weight_decay, p) end
            ms.addcmul(p, x:reshape(shape), ctx.lr_t, -math.sqrt(math.max(1, rows / cols)), p)
          end
        end
      end,
    },
    adamw = {
      init = function(group, o)
        -- f32 moments whatever the parameter's dtype (the fused kernel keeps states in f32 or bf16)
        for _, m in ipairs(group) do
          m.state.exp_avg = ms.zeros(m.param:shape(), { ctx = m.param:context() })
          m.state.exp_avg_sq = ms.zeros(m.param:shape(), { ctx = m.param:context() })
        end
      end,
      step = function(group, o, ctx)
        -- the fused kernel's lr is ctx.lr_t (lr * schedule); each member's scale turns it into adam_lr * schedule
        local params, grads, m1, m2, scales, steps = {}, {}, {}, {}, {}, {}
        local scale = o.adam_lr / o.lr
        for i, m in ipairs(group) do
          params[i], grads[i], m1[i], m2[i], scales[i] = m.param, m.grad, m.state.exp_avg, m.state.exp_avg_sq, scale
          steps[i] = ctx.step_of(m)   -- its own step count (the steps it had a gradient in)
        end
        ms.adamw_step {
          params = params, grads = grads, exp_avg = m1, exp_avg_sq = m2, scales = scales,
          lr = ctx.lr_t, steps = steps, beta1 = o.adam_betas[1], beta2 = o.adam_betas[2], eps = o.adam_eps,
          weight_decay = o.adam_weight_decay, skip = ctx.skip_t,
        }
      end,
    },
  },
}
