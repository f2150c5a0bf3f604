--[[
moonstep.dash -- the Lua face of Shampoo on stacked blocks (moonstep.h, "Shampoo on stacked blocks (DASH)"):
moving blocks between parameters and [N, r, c] stacks, DASH's grafting state, inverse p-th roots and
spectrum estimates.  Options are tables with DASH's defaults; scalars that change every step (lr, step) may be
numbers or one-element device tensors.

  local list = ms.block_list({{tensor = w, row0 = 0, col0 = 0}, {tensor = w, row0 = 0, col0 = 64}})
  local G = ms.blocks_gather(ms.empty({2, 64, 64}), list)
  local X, res = ms.inv_root(A, {method = "ndb", root = 4, steps = 10, scaling = "pim", residual = true})

A block list is built once (ms.block_list) and reused every step; a plain Lua array of {tensor=, row0=, col0=}
is accepted too (converted on each call).  Lists hide their C array: recipes never see a pointer.
An option table with an unknown key or a value of the wrong type is refused with an error naming it.
]]
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C
local check, H = core.check, tensor.handle

local M = {}

-- ---------------------------------------------------------------------------------------------------
-- block lists
-- ---------------------------------------------------------------------------------------------------
local lists = setmetatable({}, { __mode = "k" })   -- list object -> {array = ms_block[n], tensors = {...}}
local List = { __metatable = "moonstep.BlockList" }
List.__index = function(self, k)
  if k == "n" then return lists[self].n end
  return nil
end
List.__newindex = function() error("a block list is read-only", 2) end
List.__len = function(self) return lists[self].n end

local function integer(v, what, level)
  -- (inf passes v == floor(v), and converting it to int64_t is undefined)
  if not core.kinds.integer.test(v) or v < 0 or v >= 2 ^ 63 then
    error(("%s must be a non-negative integer (got %s)"):format(what, tostring(v)), level + 1)
  end
  return v
end

local function build(blocks, level)
  if type(blocks) ~= "table" then error("blocks must be an array of {tensor=, row0=, col0=}", level + 1) end
  local n = #blocks
  local arr = ffi.new("ms_block[?]", n > 0 and n or 1)
  local keep = {}
  for i = 1, n do
    local b = blocks[i]
    if type(b) ~= "table" or not tensor.is_tensor(b.tensor) then
      error(("blocks[%d] must be {tensor = <tensor>, row0 =, col0 =}"):format(i), level + 1)
    end
    arr[i - 1].tensor = H(b.tensor)
    arr[i - 1].row0 = integer(b.row0 or 0, ("blocks[%d].row0"):format(i), level + 1)
    arr[i - 1].col0 = integer(b.col0 or 0, ("blocks[%d].col0"):format(i), level + 1)
    keep[i] = b.tensor
  end
  return { n = n, array = arr, tensors = keep }
end

--- ms.block_list(blocks) -> a reusable list of blocks ({tensor=, row0=, col0=} each, as moonstep.h's ms_block)
function M.block_list(blocks)
  local l = setmetatable({}, List)
  lists[l] = build(blocks, 2)
  return l
end

local function resolve(blocks, level)
  local l = lists[blocks]
  if l then return l end
  return build(blocks, level + 1)
end

local function ctx_of(t) return tensor.handle_ctx(t:context()) end

-- Option tables are checked before anything runs (core.check_options): a misspelt key (pi_step, wieght_decay)
-- would otherwise be dropped silently for its default, and a mistyped value reach the FFI as "cannot convert",
-- truncated (steps = 2.5 runs 2) or, for a flag, as Lua's truth (tf32 = 0 would turn TF32 on).  Besides
-- core's kinds: a tensor, a scalar (a number or a one-element tensor), ids (a tensor or a Lua array), an output
-- (a tensor or a boolean), any.
local tensor_kind, scalar_kind, step_kind, any_kind = tensor.kinds.tensor, tensor.kinds.scalar, tensor.kinds.step,
                                                    tensor.kinds.any
local function ids_kind(v) if type(v) ~= "table" then return "an i32 tensor or a Lua array" end end
local function output_kind(v)
  if type(v) ~= "boolean" and not tensor.is_tensor(v) then return "a tensor or a boolean" end
end
local COUNT, SEED = core.COUNT, core.SEED
local function check_options(what, t, spec, level)
  return core.check_options(what, t, spec, level + 1)
end
local need_tensor = tensor.need_tensor

local GRAFT = { grad_ema = tensor_kind, adam_v = tensor_kind, norm = tensor_kind, pgraft = tensor_kind,
                beta_grad = "number", beta_graft = "number", eps = "number", step = step_kind,
                bias_correction = "boolean", skip = tensor_kind }
local DASH_GRAFT = { grad = tensor_kind }
for k, v in pairs(GRAFT) do DASH_GRAFT[k] = v end
local GATHER_FACTORS = { stack = tensor_kind, blocks = any_kind, left = tensor_kind, right = tensor_kind,
                         alpha = "number", beta = "number", tf32 = "boolean", graft = any_kind }
local APPLY = { blocks = any_kind, stack = tensor_kind, scale = tensor_kind, lr = scalar_kind, weight_decay = "number",
                step = step_kind, stochastic_round = "boolean", seed = SEED, skip = tensor_kind, rng_ids = ids_kind }
local ROOT = { method = "string", root = COUNT, steps = COUNT, eps = "number", scaling = "string",
               pi_steps = COUNT, pi_vectors = COUNT, pi_const = "number", eps_power_iter = "number",
               pi_bf16 = "boolean", tolerance = "number", matmul_dtype = "string", tf32 = "boolean",
               evd_shift = "boolean", seed = SEED, index = ids_kind, rng_ids = ids_kind, out = tensor_kind,
               residual = output_kind, iters = output_kind }
local SPECTRUM = { vectors = COUNT, steps = COUNT, eps = "number", bf16 = "boolean", root = COUNT,
                   seed = SEED, rng_ids = ids_kind, x_root = tensor_kind, lam_max = tensor_kind, lam_min = tensor_kind }

-- a scalar option: number -> (value, nil); device tensor -> (0, handle)
local function scalar(v, default)
  if v == nil then return default, nil end
  if type(v) == "number" then return v, nil end
  return 0, H(v)
end

local function opt_handle(t) return t ~= nil and H(t) or nil end

-- ---------------------------------------------------------------------------------------------------
-- gather, apply, scatter
-- ---------------------------------------------------------------------------------------------------
--- ms.blocks_gather(stack, blocks) -> stack: stack [N, r, c] f32 <- the blocks
function M.blocks_gather(stack, blocks)
  need_tensor("blocks_gather", "stack", stack, 2)
  local l = resolve(blocks, 2)
  check(C.ms_blocks_gather(ctx_of(stack), H(stack), l.n, l.array))
  return stack
end

-- ms_dash_graft_options from a table (ms.dash_graft's keys and defaults)
local function graft_options(a)
  local o = ffi.new("ms_dash_graft_options")
  o.beta_grad, o.beta_graft = a.beta_grad or 0.9, a.beta_graft or 0.95
  o.eps = a.eps or 1e-8
  o.step, o.step_t = scalar(a.step, 1)
  o.bias_correction = a.bias_correction == false and 0 or 1
  o.skip_t = opt_handle(a.skip)
  return o
end

--- ms.blocks_gather_factors{stack=, blocks=, left=, right=, alpha=, beta=, tf32=false, graft=} -> stack: the gather,
---   then left[k] <- beta left[k] + alpha G G^T and (right given) right[k] <- beta right[k] + alpha G^T G, G = stack[k];
---   graft = {grad_ema=, adam_v=, norm=, pgraft=, beta_grad=, ...} (ms.dash_graft's table, grad = the stack): that
---   update in the same pass
function M.blocks_gather_factors(a)
  if type(a) ~= "table" or not tensor.is_tensor(a.stack) then error("blocks_gather_factors: stack must be a tensor", 2) end
  if not tensor.is_tensor(a.left) then error("blocks_gather_factors: left must be a tensor", 2) end
  if type(a.alpha) ~= "number" or type(a.beta) ~= "number" then
    error("blocks_gather_factors: alpha and beta must be numbers (no defaults)", 2)
  end
  check_options("blocks_gather_factors", a, GATHER_FACTORS, 2)
  local l = resolve(a.blocks, 2)
  local o = ffi.new("ms_dash_factor_options")
  o.alpha, o.beta, o.allow_tf32 = a.alpha, a.beta, a.tf32 and 1 or 0
  local go
  if a.graft ~= nil then
    local g = a.graft
    if type(g) ~= "table" or not tensor.is_tensor(g.norm) then
      error("blocks_gather_factors: graft must be a table {grad_ema=, adam_v=, norm=, ...} with a norm tensor", 2)
    end
    check_options("blocks_gather_factors: graft", g, GRAFT, 2)
    go = graft_options(g)
    o.graft = go
    o.grad_ema, o.adam_v, o.norm, o.pgraft = opt_handle(g.grad_ema), opt_handle(g.adam_v), H(g.norm), opt_handle(g.pgraft)
  end
  check(C.ms_blocks_gather_factors(ctx_of(a.stack), H(a.stack), H(a.left), opt_handle(a.right), l.n, l.array, o))
  local _ = go   -- the graft options stay alive through the call
  return a.stack
end

-- Checks a Lua array of ids (index, rng_ids) before it is made an i32 tensor: that conversion takes 0.5 and NaN
-- as 0, 2^31 wrapped, so block 0 was worked on, silently.  Every entry an integer in the i32 range, no holes
-- ({0, nil, 2} has # 1 or 3) and no other keys.  A tensor or nil passes.  Raised at `level` of the caller.
local function check_ids(what, name, v, level)
  if type(v) ~= "table" or tensor.is_tensor(v) then return end
  local n, top = #v, 0
  for k in pairs(v) do
    if type(k) ~= "number" or k < 1 or k ~= math.floor(k) then
      error(("%s: %s must be an array of integers (got the key %s)"):format(what, name, core.show(k)), level + 1)
    end
    if k > top then top = k end
  end
  for k = 1, math.max(n, top) do
    local x = v[k]
    if not core.kinds.integer.test(x) then
      error(("%s: %s[%d] must be an integer (got %s)"):format(what, name, k, core.show(x)), level + 1)
    end
    if x < -2 ^ 31 or x >= 2 ^ 31 then
      error(("%s: %s[%d] must be an integer in the i32 range (got %s)"):format(what, name, k, core.show(x)), level + 1)
    end
  end
end

-- an i32 tensor on `like`'s device from a tensor or a Lua array (index, rng_ids; check_ids first); nil stays nil
local function i32_of(v, like)
  if type(v) == "table" and not tensor.is_tensor(v) then return tensor.tensor(v, { dtype = "i32", ctx = like:context() }) end
  return v
end

--- ms.blocks_apply{blocks=, stack=, scale=, lr=1e-3, weight_decay=0, step=1, stochastic_round=false, seed=0, skip=,
---   rng_ids=}
---   p <- p (1 - lr wd) - lr scale[k] stack[k] on every block k; rng_ids (i32 [N], tensor or Lua array): block k's
---   stochastic rounding keyed by rng_ids[k] instead of k
function M.blocks_apply(a)
  a = check_options("blocks_apply", a, APPLY, 2)
  check_ids("blocks_apply", "rng_ids", a.rng_ids, 2)
  need_tensor("blocks_apply", "stack", a.stack, 2)
  local l = resolve(a.blocks, 2)
  local o = ffi.new("ms_blocks_apply_options")
  o.lr, o.lr_t = scalar(a.lr, 1e-3)
  o.step, o.step_t = scalar(a.step, 1)
  o.weight_decay = a.weight_decay or 0
  o.stochastic_round = a.stochastic_round and 1 or 0
  o.seed = a.seed or 0
  o.skip_t = opt_handle(a.skip)
  local ids = i32_of(a.rng_ids, a.stack)
  o.rng_ids = opt_handle(ids)
  check(C.ms_blocks_apply(ctx_of(a.stack), l.n, l.array, H(a.stack), opt_handle(a.scale), o))
end

--- ms.blocks_scatter(blocks, stack [, scale]): p_k <- scale[k] stack[k] (scale nil: 1)
function M.blocks_scatter(blocks, stack, scale)
  need_tensor("blocks_scatter", "stack", stack, 2)
  if scale ~= nil then need_tensor("blocks_scatter", "scale", scale, 2) end
  local l = resolve(blocks, 2)
  check(C.ms_blocks_apply(ctx_of(stack), l.n, l.array, H(stack), opt_handle(scale), nil))
end

-- ---------------------------------------------------------------------------------------------------
-- grafting
-- ---------------------------------------------------------------------------------------------------
--- ms.dash_graft{grad=, grad_ema=, adam_v=, norm=, pgraft=, beta_grad=0.9, beta_graft=0.95, eps=1e-8, step=1,
---   bias_correction=true, skip=} -> norm ([N] f32, created when not given)
function M.dash_graft(a)
  a = check_options("dash_graft", a, DASH_GRAFT, 2)
  local g = a.grad
  if not tensor.is_tensor(g) then error("dash_graft: grad must be a tensor", 2) end
  local norm = a.norm or tensor.empty({ g:size(0) }, { dtype = "f32", ctx = g:context() })
  check(C.ms_dash_graft(ctx_of(g), opt_handle(a.grad_ema), opt_handle(a.adam_v), H(norm), opt_handle(a.pgraft),
                        H(g), graft_options(a)))
  return norm
end

-- ---------------------------------------------------------------------------------------------------
-- inverse roots and spectrum estimates
-- ---------------------------------------------------------------------------------------------------
local methods = { evd = C.MS_ROOT_EVD, cn = C.MS_ROOT_CN, ndb = C.MS_ROOT_NDB, chebyshev = C.MS_ROOT_CHEBYSHEV }
local scalings = { fro = C.MS_SCALING_FRO, pi = C.MS_SCALING_PI, pim = C.MS_SCALING_PIM }
local matmul_dtypes = { f32 = C.MS_DTYPE_F32, bf16 = C.MS_DTYPE_BF16, f16 = C.MS_DTYPE_F16 }
M.root_methods = { "evd", "cn", "ndb", "chebyshev" }
M.root_scalings = { "fro", "pi", "pim" }

local function enum(map, v, what, default)
  local x = map[v == nil and default or v]
  if x == nil then
    local names = {}
    for k in pairs(map) do names[#names + 1] = k end
    table.sort(names)
    error(("inv_root: %s must be one of %s (got %s)"):format(what, table.concat(names, ", "), tostring(v)), 3)
  end
  return x
end

-- a per-block output: a tensor as given, true for a new one, nil for none
local function per_block(v, n, dtype, like)
  if v == nil or v == false then return nil end
  if v == true then return tensor.empty({ n }, { dtype = dtype, ctx = like:context() }) end
  return v
end

--- ms.inv_root(a, {method="ndb"|"cn"|"evd"|"chebyshev", root=4, steps=10, eps=0, scaling="pim", pi_steps=10,
---   pi_vectors=16, pi_const=2, eps_power_iter=1e-6, pi_bf16=true, tolerance=0, matmul_dtype="f32", tf32=false,
---   evd_shift=true, seed=0, index=, rng_ids=, out=, residual=, iters=}) -> x, residual, iters
--- x [N, b, b] <- (a + eps I)^(-1/root) per block (evd with evd_shift, DistributedShampoo's: the eigenvalues l of
--- a + eps I taken as l + eps - min(l_min, 0)); steps: 60 for chebyshev (its degree); residual (f32 [N]) and
--- iters (i32 [N]) when asked for
--- (true, or tensors to write); index: an i32 tensor (or a Lua array of 0-based block numbers) to work on;
--- rng_ids: an i32 tensor (or Lua array) of N ids, block k's random vectors drawn as block rng_ids[k]'s.
function M.inv_root(a, opts)
  if not tensor.is_tensor(a) then error("inv_root: a must be a tensor", 2) end
  opts = check_options("inv_root", opts, ROOT, 2)
  check_ids("inv_root", "index", opts.index, 2)
  check_ids("inv_root", "rng_ids", opts.rng_ids, 2)
  local n = a:dim() == 3 and a:size(0) or 0
  local o = ffi.new("ms_root_options")
  o.method = enum(methods, opts.method, "method", "ndb")
  o.root = opts.root or 4
  o.steps = opts.steps or (opts.method == "chebyshev" and 60 or 10)
  o.eps = opts.eps or 0
  o.scaling = enum(scalings, opts.scaling, "scaling", "pim")
  o.pi_steps, o.pi_vectors, o.pi_const = opts.pi_steps or 10, opts.pi_vectors or 16, opts.pi_const or 2
  o.eps_power_iter = opts.eps_power_iter or 1e-6
  o.pi_bf16 = opts.pi_bf16 == false and 0 or 1
  o.tolerance = opts.tolerance or 0
  o.matmul_dtype = enum(matmul_dtypes, opts.matmul_dtype, "matmul_dtype", "f32")
  o.allow_tf32 = opts.tf32 and 1 or 0
  o.evd_shift = opts.evd_shift == false and 0 or 1
  o.seed = opts.seed or 0
  if opts.method ~= "evd" then
    tensor.charge_work("inv_root", o.steps + (opts.scaling ~= "fro" and o.pi_steps or 0))
  end
  local x = opts.out or tensor.empty(a:shape(), { dtype = "f32", ctx = a:context() })
  local residual = per_block(opts.residual, n, "f32", a)
  local iters = per_block(opts.iters, n, "i32", a)
  -- made last: only the options struct points at these temporaries, and a collection between here and the
  -- call (no allocation comes in between) could free them under it
  local index, ids = i32_of(opts.index, a), i32_of(opts.rng_ids, a)
  o.index, o.rng_ids = opt_handle(index), opt_handle(ids)
  check(C.ms_inv_root(ctx_of(a), H(x), opt_handle(residual), opt_handle(iters), H(a), o))
  return x, residual, iters
end

--- ms.spectrum_estimate(a, {vectors=16, steps=10, eps=1e-6, bf16=false, root=4, seed=0, rng_ids=, x_root=, lam_max=,
---   lam_min=}) -> lam_max, lam_min (lam_min only with x_root, an inverse root of a); rng_ids as ms.inv_root's
function M.spectrum_estimate(a, opts)
  if not tensor.is_tensor(a) then error("spectrum_estimate: a must be a tensor", 2) end
  opts = check_options("spectrum_estimate", opts, SPECTRUM, 2)
  check_ids("spectrum_estimate", "rng_ids", opts.rng_ids, 2)
  local n = a:dim() == 3 and a:size(0) or 0
  local o = ffi.new("ms_spectrum_options")
  o.vectors, o.steps = opts.vectors or 16, opts.steps or 10
  o.eps = opts.eps or 1e-6
  o.bf16 = opts.bf16 and 1 or 0
  o.root = opts.root or 4
  o.seed = opts.seed or 0
  tensor.charge_work("spectrum_estimate", o.steps)
  local lam_max = opts.lam_max or tensor.empty({ n }, { dtype = "f32", ctx = a:context() })
  local lam_min = opts.lam_min or (opts.x_root and tensor.empty({ n }, { dtype = "f32", ctx = a:context() })) or nil
  local ids = i32_of(opts.rng_ids, a)   -- (last, as in inv_root: only the options struct points at it)
  o.rng_ids = opt_handle(ids)
  check(C.ms_spectrum_estimate(ctx_of(a), H(lam_max), opt_handle(lam_min), H(a), opt_handle(opts.x_root), o))
  return lam_max, lam_min
end

return M
