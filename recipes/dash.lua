--[[
dash -- DASH: block Shampoo on stacked blocks, grafted to Adam per block, for matrices; AdamW for the rest.

Every parameter is first squeezed, as DASH does (dims of size 1 dropped: [1, n] is a vector, [1, s, d] the
matrix [s, d]).  Each matrix parameter W (more dims: viewed as [d0, rest]) is cut into blocks of at most
block_size^2 (any shape: the remainders give smaller blocks); blocks of equal size are stacked and every
per-block operation is one batched call (ms.block_plan, ms.blocks_gather, ...).  For a block G with factors
L (r x r), R (c x c), gradient EMA Gt, Adam second moment A, at step t (research/dash.md §1.2):
    W <- W (1 - lr wd)                                                       (decoupled; matrices only)
    L <- beta_LR L + (1 - beta_LR) G G^T      R <- beta_LR R + (1 - beta_LR) G^T G      (beta_LR = 1: sums)
    A <- beta_graft A + (1 - beta_graft) G^2
    refresh steps: Lbar = (L + eps_inv_root I)^(-1/4), Rbar likewise (inv_root_method)
    Gt <- beta_G Gt + (1 - beta_G) G
    P_graft = Gt^ / (eps_grafting + sqrt(A^))        (^: bias-corrected when use_bias_correction)
    U = Lbar Gt Rbar,   P = U ||P_graft||_F / (||U||_F + 1e-16)   (per block: only U's direction is used)
    before start_prec_step: P = P_graft (Adam)
    mu > 0:  M <- mu M + P,  P = P + mu M (use_nesterov) or M
    W <- W - lr P
Refresh steps are t >= start_prec_step and (t == 1 or t % inv_root_freq == 0), and the first step at or past
start_prec_step (so roots are never used before they exist).  plan() returns "refresh" on them (auto:
"refresh..." naming its class layout) and "apply" otherwise.  1-D parameters go to AdamW (algo_one_dim = "adamw") or DASH's Shampoo-as-AdaGrad path
("shampoo"): pieces of (b, 1) with only a left factor, root 2, no weight decay.

Sources: Modoranu, Zmushko, Schultheis, Safaryan, Alistarh, "DASH: Faster Shampoo via Batched Block
Preconditioning and Efficient Inverse-Root Solvers" (arXiv 2602.02016) and its code (IST-DASLab, DashGpu
v1.1.15 numerics); Gupta, Koren, Singer, "Shampoo" (2018); DistributedShampoo (Shi et al., 2023) for the
blocking of any shape.  Digest: research/dash.md.

Routing, first rule that applies (tags are given with the parameter: {name=, param=, grad=, tags={"adamw"}}):
  1. tag "adamw" -> adamw; 0 dims (a scalar, whatever its tags) -> adamw; tag "dash" -> dash
  2. 1 dim once squeezed ([n], [1, n]; [1] and [1, 1] too: a 1 x 1 piece) -> "dash" with algo_one_dim =
     "shampoo", else adamw
  3. name matches one of dash_patterns -> dash;  one of adamw_patterns -> adamw
  4. a dim equal to one of adamw_dims (e.g. the vocab) -> adamw
  5. name contains embed_tokens, lm_head, wte or word_embeddings, or ends with modules_to_save.default.weight
     (a PEFT head copy; the matrices inside a saved module go on) -> adamw
  6. otherwise -> dash
Rule 5 is moonstep's (as sinkgd's and muon's), not DASH's: DASH preconditions every parameter of 2 or more
dims, the embedding and lm_head included (dash_base.py; research/dash.md §1.5 counts their blocks).
dash_patterns = {"embed_tokens", "lm_head", "wte"} (the model's names) routes them as DASH does.
A parameter tagged "no_decay" (the Python bridge's param groups with weight_decay 0) takes no weight decay on
either route.  A matrix routed to AdamW (rules 1, 3-5) takes adamw_weight_decay, not weight_decay (DASH
decays every matrix with weight_decay; its AdamW route has only 1-D parameters, undecayed).

Where moonstep differs from DASH on purpose (research/dash.md; the rest follows DashGpu v1.1.15's numerics):
  - shapes: any shape is blocked, both dims cut (DistributedShampoo's rule) where DASH needs R % B == 0 or
    C % B == 0; 1-D parameters of any length (DashGpu: all of one length, a multiple of B).
  - refresh: also on the first step at or past start_prec_step (DASH waits for t % f == 0 there, using roots
    it never computed).
  - CN stops each block on its own at cn_tolerance (DASH: one test over the whole stacked batch, all blocks
    iterating until the worst converges); NDB may stop at ndb_tolerance (DASH: never; the default 0 is DASH's).
    Both stop a block whose iterate leaves the region of convergence, keeping it finite (the CPU always,
    CUDA when the tolerance is > 0: moonstep.h, ms_inv_root).
  - chebyshev is moonstep's interpolant of y^(-1/p) on [25 / d^2, 1] of A_reg / s, rescaled by s^(-1/p),
    and eps_inv_root is absolute (A + eps I) as for the other solvers; DASH fits on [eps, 1 + eps] of A / s,
    i.e. its eps is relative to the scale s (moonstep.h, ms_inv_root).
  - evd: with eps_inv_root = 0 a zero eigenvalue contributes 0 (pseudo-inverse) where DASH's root is Inf/NaN;
    a factor block with a NaN/Inf entry gets a NaN root and the other blocks are solved (DASH's eigh raises).
    A finite block whose EVD fails (LAPACK / cuSOLVER did not converge; rare) gets coupled Newton's root with
    the CN settings instead of failing the step (DASH raises; DistributedShampoo's use_protected_eigh retries
    in f64, then keeps the previous root); the step reports their count as "dash.evd_cn_fallbacks".
  - matmul_dtype bf16/f16 in CN keeps M in 16 bits between iterations (DASH keeps M in f32 and casts the
    operand); Frobenius scales are computed in f32 (DASH HEAD: on a bf16 copy).
  - use_nesterov is DashLayerwise's P + mu M (DashGpu computes mu P + M).
  - the weight update is one f32 expression rounded once into a bf16/f16 parameter (DASH: two 16-bit ops).

Options (DASH's names; defaults of the paper grid's EVD run, research/dash.md §4, except algo_one_dim =
"adamw", DashConfig's default, where the grid ran "shampoo"; set every knob explicitly):
  lr                         base learning rate (the runtime's schedule scales it)                 1e-3
  weight_decay               decoupled, matrices only                                              0
  beta_G                     gradient EMA ("beta1"; 0: the raw gradient)                          0.9
  beta_LR                    factor EMA ("beta2"; 1: plain sums, AdaGrad-style)                    0.95
  beta_graft                 Adam grafting second moment                                           0.95
  eps_grafting               Adam grafting denominator term                                        1e-8
  eps_inv_root               the roots are of L + eps I (grid: EVD 1e-10, CN/NDB 0)               1e-10
  inv_root_method            evd | cn | ndb | chebyshev | auto                                     "evd"
  inv_root_freq              f: roots recomputed every f steps (grid: EVD 1 or 10, others 1)      10
  start_prec_step            first step of Shampoo (before: Adam); -1 = from step 1                -1
  block_size                 B                                                                     1024
  newton_steps               CN iterations / NDB steps per square root                             10
  matrix_scaling_type        fro | pi | pim (multi-vector power iteration)                         "pim"
  matrix_scaling_pi_steps    power-iteration steps                                                  10
  matrix_scaling_const       safety factor on the power-iteration estimate                         2
  matrix_scaling_pi_vectors  vectors of pim (DASH: 16)                                              16
  eps_power_iter             damping of the power iteration (no NaN on zero blocks)                1e-6
  pi_bf16                    power iteration in bf16, as DASH                                       true
  matmul_dtype               f32 | bf16 | f16: operands of the solvers' products (not EVD)        "f32"
  allow_tf32                 TF32 GEMMs on the GPU (DASH's "FP32" results had it on)              true
  cbshv_degree               Chebyshev degree                                                       60
  cn_tolerance               CN: a block stops once max |M - I| is below it                        1e-6
  ndb_tolerance              NDB: a block stops once max |Z Y - I| is below it (DASH: none, 0)     0
  evd_heuristic              shampoo (lambda + eps - min(lambda_min, 0)) | none                   "shampoo"
  mu                         momentum on the update (the paper: 0; 0.9 diverged)                   0
  use_nesterov               Nesterov form of the momentum (at mu = 0, DASH's pair: none)           false
  use_bias_correction        Adam grafting bias corrections                                         true
  algo_one_dim               adamw | shampoo (the paper's runs: shampoo)                           "adamw"
  adamw_betas / adamw_eps / adamw_weight_decay   the AdamW route (DashLayerwise's)     {0.9, 0.95} / 1e-8 / 0
  bf16_stochastic_round      stochastic rounding when storing bf16/f16 params                       false
  seed                       Philox key (below 2^32): power iterations, residual sketches,          0
                             stochastic rounding (its calls' keys: ctx.rng_key(seed))
  adamw_patterns, dash_patterns, adamw_dims      routing (Lua patterns; dim sizes)                 {}
`auto` (moonstep's own; research/dash.md §7): the cheapest solver that gives each factor block NDB-10's
resolution.  A T-step Newton solver resolves the normalized eigenvalues y = lambda / s (s: its scale) down to a
floor; below it NDB-10 leaves the root wrong by design (moonstep.h: its root 4 over-inverts by up to 2.2x, its
root 2 under-inverts), so its roots of blocks with condition numbers past ~1 / floor are not "exact" either.
The policy, per factor block and from the estimates of the last refresh (lambda_max by power iteration,
lambda_min from the last root, the root's residual), is the table SOLVERS below (GEMMs per block for T
iterations on the GPU; floors from the scalar iterations, at auto_tolerance) and auto_pick:
  - a (nearly) zero block (lambda_max within the power iteration's noise: 2^-6 eps_power_iter with pi_bf16,
    2^-16 eps_power_iter in f32) gets the cheapest class (CN, 1 iteration: no GEMM);
  - a block with y >= y_damp = auto_damping lambda_max / s gets the cheapest (method, T) whose floor lies
    auto_margin below y, when that costs no more than the damped class below (it does for every y NDB-10
    resolves);
  - every other block -- beyond the floors, or whose last root missed its class's residual -- is unresolved:
    auto_unresolved = "damp" (default) solves (A + auto_damping lambda_max I)^(-1/p), whose normalized
    eigenvalues are >= y_damp, with the cheapest class resolving y_damp; auto_damping defaults to NDB-10's
    documented floor for the block's p (3.2e-3 / 2.4e-3), the damping NDB-10 acts like.  "evd" sends them to
    EVD instead (~1000 GEMMs a block).
With DASH's PIM scaling (s = 2 lambda_max) and the defaults, p = 4: y_damp = 1.2e-3, damped blocks take CN
with 9 iterations (32 GEMMs against NDB-10's 54), blocks of condition ~10 CN with 6 (20); p = 2: CN with
10 (27, NDB-10's count).  CN classes stop
per block at cn_tolerance.  The first refresh treats every block as unresolved; reclassification runs on the
refreshes 1, k, 2k, ... (k = auto_reclassify_every) and the refresh before each computes the estimates; in
between the damping follows lambda_max on the device.  A refresh's plan key names its class layout (a
captured refresh is captured again when the layout changes).  dash.auto.report(group) returns the decisions
and the GEMMs planned and run; plan() reports "dash.auto_classes", "dash.auto_gemms", "dash.auto_ndb10_gemms".
  auto_methods               iterative methods to choose from ("cn,ndb")                            {"cn", "ndb"}
  auto_tolerance             accuracy of each resolved eigenvalue's root the floors are set for    1e-3
  auto_max_steps             the most steps an iterative class may take                             20
  auto_margin                y_min must exceed the floor by this factor (estimates within 2x)      2
  auto_unresolved            damp | evd: blocks no class resolves within NDB-10's reach            "damp"
  auto_damping               relative damping {p = 2, p = 4} of unresolved blocks (x lambda_max)  {3.2e-3, 2.4e-3}
  auto_reclassify_every      refreshes between reclassifications                                    10
  auto_residual              a residual above max(this, 1e-6 kappa) marks the block unresolved     1e-2

State: per stack of blocks (key "r x c"; "b x 1v" for 1-D pieces) grad_ema, adam_v (and momentum); per factor
stack (key "<size>p<root>") factor and root, and for auto class (i32: the code of auto_pick), lam_max, lam_min,
residual, fro; the refresh count.  The route's slots() names the block behind every slot of that state, so
a checkpoint loads block by block (by parameter name, whatever the stacks' order).  AdamW: exp_avg, exp_avg_sq.
Random vectors (power-iteration starts, residual sketches, stochastic rounding) are drawn by block identity:
every call takes the whole stack and gives each block an id hashed from its parameter's name, its place in
the parameter and its side (rng_ids; recipe code: "random streams by identity"), never its position in a
stack.  So with several ranks (settings.distribute = "owner": each rank stacks only the parameters it owns)
every parameter gets the update one rank would give it, and the solvers stay one batched call per stack.
Device-side skipping (captured steps) is not offered by the dash route: its factor products have no skip
flag, so a captured DASH step needs settings.nonfinite = "apply".
]]

-- rule 5 (sinkgd's: axolotl's names and PEFT suffix): moonstep.routing
local adamw_by_name = ms.routing.adamw_by_name

-- whether name holds one of list's entries (Lua patterns: the pattern options, matched here under the sandbox's
-- limits)
local function finds_any(name, list)
  for _, pat in ipairs(list) do
    if name:find(pat) then return true end
  end
  return false
end

-- ---------------------------------------------------------------------------------------------------
-- the auto policy: a table of solvers, their floors, and the function that picks
-- ---------------------------------------------------------------------------------------------------
-- Per solver: the products of b x b matrices (GEMMs) one block costs for T iterations, as the CUDA backend
-- performs them (engine/cuda/dash.c: CN's first iteration is elementwise and its last skips the M recursion;
-- NDB's first step is one product and its last skips the one it does not return), and what the iteration
-- makes of one normalized eigenvalue y = lambda / s (moonstep.h's iterations on a 1 x 1 matrix in f64, with
-- DASH's scales: CN z = (p + 1) / 2, NDB y in (0, 1]).  Floors follow from the maps (floor_of).
-- Chebyshev is not in the table: degree d costs d - 1 products for a floor near 25 / d^2 (moonstep.h), about
-- 160 products to resolve y = 1e-3 where CN needs 32.
local function ndb_chain(y, T)
  local e = 1.5 - 0.5 * y
  local Y, Z = y * e, e
  for _ = 2, T do
    e = 1.5 - 0.5 * Z * Y
    Y, Z = Y * e, e * Z
  end
  return Y, Z
end

local SOLVERS = {
  cn = {
    gemms = function(T, p) return (p == 4 and 4 or 3) * (T - 1) end,
    root = function(y, T, p)
      local z = (p + 1) / 2
      local X, M = z ^ (1 / p), z * y
      for _ = 1, T do
        local N = ((p + 1) - M) / p
        X, M = X * N, M * N ^ p
      end
      return X
    end,
  },
  ndb = {
    gemms = function(T, p)
      local chain = T == 1 and 1 or 3 * T - 3
      return p == 4 and 2 * chain or chain
    end,
    root = function(y, T, p)
      if p == 2 then return select(2, ndb_chain(y, T)) end
      return select(2, ndb_chain((ndb_chain(y, T)), T))
    end,
  },
}
-- EVD: ~7 ms per 1024 block on the H200, where one TF32 GEMM of that block takes ~6 us
local EVD_GEMMS = 1000
-- NDB with 10 steps' resolution floors (moonstep.h; p = 2, p = 4): the default relative damping
local NDB10_FLOOR = { 3.2e-3, 2.4e-3 }
-- no margin on a damped spectrum's lower end: the damping d = auto_damping lambda_max and the solver's scale
-- s = pi_const lambda_max come from the same power iteration (same start vectors), so d / s is y_damp itself
local DAMPED_MARGIN = 1

-- the smallest y down to which every root is within tol: a scan down from 1 finds the first y that misses
-- (NDB's root 4 is not monotone below its floor: its error falls again where it turns from over- to
-- under-inverting), then bisection on log y inside that step
local floors = {}
local function floor_of(method, T, p, tol)
  local key = ("%s:%d:%d:%g"):format(method, T, p, tol)
  if floors[key] then return floors[key] end
  local root = SOLVERS[method].root
  local function bad(y) return not (math.abs(root(y, T, p) * y ^ (1 / p) - 1) <= tol) end
  local hi, lo = 1.0, nil
  for e = 1, 16 * 16 do
    local y = 10 ^ (-e / 16)
    if bad(y) then lo = y break end
    hi = y
  end
  if lo == nil then floors[key] = hi return hi end
  for _ = 1, 60 do
    local mid = math.sqrt(lo * hi)
    if bad(mid) then lo = mid else hi = mid end
  end
  floors[key] = hi
  return hi
end

local function gemms_of(method, T, p) return SOLVERS[method].gemms(T, p) end

--- The ladder for root p: (method, iterations) classes ordered by cost, each kept only when it resolves deeper
--- than every cheaper one.  ladder[i] = {method, steps, gemms, floor}.
local ladders = {}
local function auto_ladder(o, p)
  local key = ("%s:%d:%g:%d"):format(table.concat(o.auto_methods, ","), p, o.auto_tolerance, o.auto_max_steps)
  if ladders[key] then return ladders[key] end
  local cands = {}
  for _, m in ipairs(o.auto_methods) do
    for T = 1, o.auto_max_steps do
      cands[#cands + 1] = { method = m, steps = T, gemms = gemms_of(m, T, p), floor = floor_of(m, T, p, o.auto_tolerance) }
    end
  end
  table.sort(cands, function(a, b)
    if a.gemms ~= b.gemms then return a.gemms < b.gemms end
    return a.floor < b.floor
  end)
  local ladder, best = {}, math.huge
  for _, c in ipairs(cands) do
    if c.floor < best then ladder[#ladder + 1] = c best = c.floor end
  end
  ladders[key] = ladder
  return ladder
end

-- the first (cheapest) class of the ladder whose floor, times margin, lies at or below y; nil: none does
local function cheapest(ladder, y, margin)
  for i, c in ipairs(ladder) do
    if c.floor * margin <= y then return i end
  end
  return nil
end

--- The relative damping of unresolved blocks of root p (auto_damping = {p = 2, p = 4}).
local function damping_of(o, p) return o.auto_damping[p == 2 and 1 or 2] end

-- The lambda_max estimate at or below which a block counts as zero: the power iteration's own noise.  It runs
-- on A + eps_power_iter I, rounded to bf16 with pi_bf16: a zero block's estimate is off by up to ~3e-3
-- eps_power_iter there (~1e-7 in f32); 2^-6 (2^-16) leaves a margin of 5x (100x).  Not eps_power_iter itself:
-- gradients of 1e-5 give 1024-blocks lambda_max ~ 1e-7, which NDB-10 still resolves to condition ~20
-- (y_max = lambda / 2 (lambda + eps_power_iter) ~ 0.05), where the cheapest class resolves nothing.
local function zero_level(o) return o.eps_power_iter * (o.pi_bf16 and 2 ^ -6 or 2 ^ -16) end

--- What one block gets, as the code stored in state.class: i > 0 ladder class i on the factor itself,
--- -i the ladder class i on the factor damped by auto_damping lambda_max I, #ladder + 1 EVD.
--- e = {lam_max, y, y_damp, kappa, residual, previous}: the block's lambda_max estimate, its normalized
--- smallest eigenvalue y = lambda_min / s and the normalized damping y_damp = auto_damping lambda_max / s
--- (s the solver's scale), its condition estimate, the residual of its last root and that root's code (nil
--- at the first classification: no residual yet).
local function auto_pick(ladder, o, e)
  if e.lam_max <= zero_level(o) then return 1 end    -- (nearly) zero: nothing to resolve
  local damped = cheapest(ladder, e.y_damp, DAMPED_MARGIN) or #ladder
  -- a root that missed its class's promise (beyond f32's 1e-7 kappa) leaves y overestimated: not trusted
  local trusted = e.previous == nil or e.residual <= math.max(o.auto_residual, 1e-6 * e.kappa)
  if trusted and e.y >= e.y_damp then
    local id = cheapest(ladder, e.y, o.auto_margin)
    if id and ladder[id].gemms <= ladder[damped].gemms then return id end
  end
  if o.auto_unresolved == "evd" then return #ladder + 1 end
  return -damped
end

--- A code's description: method, steps, GEMMs per block, damped.
local function describe(ladder, code)
  if code > #ladder then return "evd", 0, EVD_GEMMS, false end
  local c = ladder[math.abs(code)]
  return c.method, c.steps, c.gemms, code < 0
end

-- ---------------------------------------------------------------------------------------------------
-- the dash route
-- ---------------------------------------------------------------------------------------------------
local work = setmetatable and setmetatable({}, { __mode = "k" }) or {}   -- group.state -> transient tensors
local member_names = setmetatable and setmetatable({}, { __mode = "k" }) or {}   -- group.state -> names (init's)

local function f32(shape, ctx) return ms.zeros(shape, { dtype = "f32", ctx = ctx }) end

local function root_options(o, method, steps, p, seed)
  return {
    method = method, root = p, steps = steps, eps = o.eps_inv_root, scaling = o.matrix_scaling_type,
    pi_steps = o.matrix_scaling_pi_steps, pi_vectors = o.matrix_scaling_pi_vectors, pi_const = o.matrix_scaling_const,
    eps_power_iter = o.eps_power_iter, pi_bf16 = o.pi_bf16,
    tolerance = method == "cn" and o.cn_tolerance or method == "ndb" and o.ndb_tolerance or 0,
    matmul_dtype = method == "evd" and "f32" or o.matmul_dtype, tf32 = o.allow_tf32,
    evd_shift = o.evd_heuristic == "shampoo", seed = seed,
  }
end

-- EVD's error for a block it could not decompose although its entries are finite (moonstep.h, ms_inv_root:
-- LAPACK or cuSOLVER did not converge, or the CPU's root came out non-finite after its retry), which names the
-- block as "ms_inv_root: EVD of block k ..."; a non-finite entry has a message of its own
local function evd_failed(e) return type(e) == "string" and e:find("ms_inv_root: EVD of block", 1, true) ~= nil end

-- Solves the blocks `list` of ro by EVD; a block that EVD cannot decompose although it is finite gets coupled
-- Newton's root (the recipe's CN settings: newton_steps, cn_tolerance, matmul_dtype) instead of failing the
-- step -- as DistributedShampoo's use_protected_eigh keeps training going, but with a fresh root rather than
-- the previous one (there is none at the first refresh).  The call's error names one block; halving the list
-- finds every such block in a few calls each (rare: no cost otherwise).  Appends them to `fallen`.
local function evd_or_cn(A, ro, list, o, fallen)
  local again = {}
  for key, v in pairs(ro) do again[key] = v end
  again.index = list
  local ok, err = pcall(ms.inv_root, A, again)
  if ok then return end
  if not evd_failed(err) then error(err, 0) end
  if #list == 1 then
    local cn = root_options(o, "cn", o.newton_steps, ro.root, ro.seed)
    cn.index, cn.out, cn.residual, cn.iters, cn.rng_ids = list, ro.out, ro.residual, ro.iters, ro.rng_ids
    ms.inv_root(A, cn)
    fallen[#fallen + 1] = list[1]
    return
  end
  local half = math.floor(#list / 2)
  evd_or_cn(A, ro, { unpack(list, 1, half) }, o, fallen)
  evd_or_cn(A, ro, { unpack(list, half + 1) }, o, fallen)
end

-- ms.inv_root(A, ro), except that EVD's non-finite blocks do not stop the others, nor does a finite block EVD
-- cannot decompose (evd_or_cn).  EVD refuses a whole call with a non-finite block (moonstep.h: MS_E_NUMERIC,
-- nothing written), where the iterative solvers give that block a NaN root and the others theirs; a factor once
-- NaN stays NaN (its EMA keeps it), so one NaN gradient (settings.nonfinite = "apply") or an overflowing factor
-- would stop every later refresh of the group.  On that error (rare: no cost otherwise) the finite blocks are
-- solved and the others get NaN roots (residuals), as with the other solvers; any other error goes on up.
-- Returns how many blocks took CN's root in EVD's place.
local function inv_root_isolated(A, ro, o)
  if ro.method ~= "evd" then
    ms.inv_root(A, ro)
    return 0
  end
  local ok, err = pcall(ms.inv_root, A, ro)
  if ok then return 0 end
  local n = A:size(0)
  -- max |a| per block: NaN or inf exactly where the block has a non-finite entry (max propagates NaN)
  local read, amax = pcall(function() return A:reshape({ n, A:size(1) * A:size(2) }):amax(1):tolist_flat() end)
  if not read then error(err, 0) end   -- (the first error is the one to report)
  local wanted = ro.index and (ms.is_tensor(ro.index) and ro.index:tolist_flat() or ro.index) or nil
  if not wanted then
    wanted = {}
    for k = 1, n do wanted[k] = k - 1 end
  end
  local good, bad = {}, {}
  for _, k in ipairs(wanted) do
    local v = amax[k + 1]
    if v - v == 0 then good[#good + 1] = k else bad[#bad + 1] = k end   -- v - v: NaN for NaN and inf
  end
  if #bad == 0 and not evd_failed(err) then error(err, 0) end
  local fallen = {}
  if #good > 0 then evd_or_cn(A, ro, good, o, fallen) end
  for _, k in ipairs(bad) do
    ro.out:select(0, k):fill_(0 / 0)
    if ms.is_tensor(ro.residual) then ro.residual:narrow(0, k, 1):fill_(0 / 0) end
    if ms.is_tensor(ro.iters) then ro.iters:narrow(0, k, 1):fill_(0) end
  end
  return #fallen
end

-- the shape DASH works on: the parameter's, squeezed (dims of size 1 dropped; all of them: [1])
local function dash_shape(shape)
  local out = {}
  for _, d in ipairs(shape) do if d ~= 1 then out[#out + 1] = d end end
  if #out == 0 then out[1] = 1 end
  return out
end

-- the members' params or grads seen with that shape (views: dropping dims of size 1 never copies), one per
-- member, so that a parameter's blocks all name the one tensor
local function dash_views(group, key)
  local out = {}
  for i, m in ipairs(group) do
    local t = m[key]
    local shape = dash_shape(t:shape())
    out[i] = #shape == t:dim() and t or t:view(shape)
  end
  return out
end

local function plan_of(group, o)
  local params = {}
  for i, m in ipairs(group) do params[i] = { name = m.name, shape = dash_shape(m.info.shape) } end
  return ms.block_plan(params, { block_size = o.block_size })
end

-- ---------------------------------------------------------------------------------------------------
-- random streams by identity.  The engine draws a block's random vectors (power-iteration starts, residual
-- sketches; stochastic rounding) from the call's seed and the block's id in the call's rng_ids (moonstep.h,
-- "Random vectors").  Each block's id comes from what it is -- its parameter's name, its corner in the
-- parameter, and for factors its side -- never from its position in a stack, so a block gets the same vectors
-- whichever other parameters share its stacks: on one rank, or on a rank stepping only the parameters it owns
-- (settings.distribute = "owner").  Ids are built with the plan, identically on every rank; two blocks whose
-- ids collide only share start vectors.
-- ---------------------------------------------------------------------------------------------------
-- a number in [0, 2^31 - 1) from a string (a polynomial hash modulo the prime 2^31 - 1; exact in a Lua number,
-- arithmetic only for the sandbox): an i32 id
local function id_of(s)
  local h = 0
  for i = 1, #s do h = (h * 257 + string.byte(s, i)) % 2147483647 end
  return h
end

-- a block's identity: "<param>@<row0>,<col0>" (its factors: "/L", "/R" appended); checkpoints name slots so too
local function block_name(plan, blk) return ("%s@%d,%d"):format(plan.params[blk.param].name, blk.row0, blk.col0) end

-- the transient tensors and block lists of a group (rebuilt lazily: they are not state), and the blocks' rng ids:
-- per factor stack (roots, estimates) and, with stochastic rounding, per stack (the apply)
local function work_of(group, o)
  local st = group.state
  local w = work[st]
  if w then return w end
  local ctx = group[1].param:context()
  local plan, params = plan_of(group, o), dash_views(group, "param")
  w = { plan = plan, G = {}, T = {}, U = {}, P = {}, norm = {}, left = {}, right = {}, lroot = {}, rroot = {},
        grads = {}, grad_list = {}, param_list = {}, rng_ids = {}, apply_ids = {} }
  local factor_ids = {}
  for _, f in ipairs(plan.factors) do factor_ids[f.key] = {} end
  for _, s in ipairs(plan.stacks) do
    local k, shape = s.key, { s.n, s.r, s.c }
    w.G[k], w.U[k], w.norm[k] = f32(shape, ctx), f32(shape, ctx), f32({ s.n }, ctx)
    w.P[k] = f32(shape, ctx)
    if s.right then w.T[k] = f32(shape, ctx) end
    local lf = st.factor[s.left.factor]
    w.left[k] = lf:slice(0, s.left.offset, s.left.offset + s.n)
    w.lroot[k] = st.root[s.left.factor]:slice(0, s.left.offset, s.left.offset + s.n)
    if s.right then
      w.right[k] = st.factor[s.right.factor]:slice(0, s.right.offset, s.right.offset + s.n)
      w.rroot[k] = st.root[s.right.factor]:slice(0, s.right.offset, s.right.offset + s.n)
    end
    local pb, ids = {}, {}
    for j, blk in ipairs(s.blocks) do
      pb[j] = { tensor = params[blk.param], row0 = blk.row0, col0 = blk.col0 }
      local name = block_name(plan, blk)
      ids[j] = id_of(name)
      factor_ids[s.left.factor][s.left.offset + j] = id_of(name .. "/L")
      if s.right then factor_ids[s.right.factor][s.right.offset + j] = id_of(name .. "/R") end
    end
    w.param_list[k] = ms.block_list(pb)
    if o.bf16_stochastic_round then w.apply_ids[k] = ms.tensor(ids, { dtype = "i32", ctx = ctx }) end
  end
  for _, f in ipairs(plan.factors) do w.rng_ids[f.key] = ms.tensor(factor_ids[f.key], { dtype = "i32", ctx = ctx }) end
  work[st] = w
  return w
end

-- every member must have its gradient: the stacks mix parameters (the runtime hands over only those with one)
local function check_members(group)
  local names = member_names[group.state]
  if #group == #names then return end
  local have = {}
  for _, m in ipairs(group) do have[m.name] = true end
  local missing = {}
  for _, n in ipairs(names) do if not have[n] then missing[#missing + 1] = n end end
  error(("dash: %s have no gradient this step; DASH stacks the blocks of all parameters of a group, so give "
         .. "them a (zero) gradient or tag them adamw"):format(table.concat(missing, ", ")), 0)
end

-- gather lists follow the grads' tensors (a trainer may hand over new ones)
local function bind_grads(group, w)
  local changed = false
  for i, m in ipairs(group) do
    if w.grads[i] ~= m.grad then changed = true w.grads[i] = m.grad end
  end
  if not changed then return end
  local grads = dash_views(group, "grad")
  for _, s in ipairs(w.plan.stacks) do
    local gb = {}
    for j, blk in ipairs(s.blocks) do gb[j] = { tensor = grads[blk.param], row0 = blk.row0, col0 = blk.col0 } end
    w.grad_list[s.key] = ms.block_list(gb)
  end
end

local function preconditioning(o, t) return o.start_prec_step <= 1 or t >= o.start_prec_step end

-- the scale s of a block (y = lambda / s): PI / PIM pi_const (lambda_max + eps's), Frobenius the measured
-- ||A_reg||_F, or before any measurement its largest possible value sqrt(b) lambda_max
local function scale_of(o, b, lam_max, fro)
  if o.matrix_scaling_type ~= "fro" then return o.matrix_scaling_const * (lam_max + o.eps_inv_root + o.eps_power_iter) end
  return fro or math.sqrt(b) * lam_max
end

-- the per-factor tensors auto's calls read (transient, kept so that a captured refresh replays with their
-- new contents): the classes' index lists, the damping mask, the damped factors, iterations
local function auto_work(w, f, ctx)
  local a = w.auto_t[f.key]
  if a then return a end
  a = { index = ms.empty({ f.n }, { dtype = "i32", ctx = ctx }), mask = f32({ f.n }, ctx), d = f32({ f.n }, ctx), eye = ms.eye(f.size, { dtype = "f32", ctx = ctx }),
        iters = ms.zeros({ f.n }, { dtype = "i32", ctx = ctx }) }
  w.auto_t[f.key] = a
  return a
end

-- auto (host side, in plan): classify when due (this reads the estimates: one wait for the device), else
-- keep the last decisions; then the calls of this refresh, one per class, and whether the refresh leaves
-- estimates for the next classification.  Returns the refresh's plan key: it names the layout (class
-- sizes), so a captured refresh is captured again when the layout changes and replays otherwise.
local function auto_plan(group, o, w)
  local st = group.state
  local r, every = st.refreshes, o.auto_reclassify_every
  local due = r <= 1 or r % every == 0
  w.auto, w.auto_t = w.auto or {}, w.auto_t or {}
  w.auto_estimate = r == 0 or (r + 1) % every == 0
  local sig = {}
  for _, f in ipairs(w.plan.factors) do
    local p, n, ctx = f.root, f.n, st.class[f.key]:context()
    local ladder, damping = auto_ladder(o, p), damping_of(o, p)
    local t = auto_work(w, f, ctx)
    local a = w.auto[f.key]
    if due or not a then
      local codes = st.class[f.key]:tolist_flat()
      if due then
        local lam_max, lam_min = st.lam_max[f.key]:tolist_flat(), st.lam_min[f.key]:tolist_flat()
        local res, fro = st.residual[f.key]:tolist_flat(), st.fro[f.key]:tolist_flat()
        for k = 1, n do
          local prev = codes[k]
          if prev == 0 then
            -- never solved: unresolved until a root says otherwise
            codes[k] = auto_pick(ladder, o, { lam_max = math.huge, y = 0, y_damp = damping / scale_of(o, f.size, 1), previous = nil })
          else
            local lmax = lam_max[k]
            local s = scale_of(o, f.size, lmax, o.matrix_scaling_type == "fro" and fro[k] or nil)
            -- the last root of a damped block was of A + d I: its lambda_min estimate includes d
            local d = prev < 0 and damping * lmax or 0
            codes[k] = auto_pick(ladder, o, {
              lam_max = lmax, y = (lam_min[k] - d) / s, y_damp = damping * lmax / s,
              kappa = (lmax + o.eps_inv_root + d) / lam_min[k], residual = res[k], previous = prev,
            })
          end
        end
        st.class[f.key]:copy_(ms.tensor(codes, { dtype = "i32", ctx = ctx }))
      end
      -- the calls: one per code that has blocks (a code that has all of them needs no index)
      local members, order = {}, {}
      for k = 1, n do
        local c = codes[k]
        if not members[c] then members[c] = {} order[#order + 1] = c end
        members[c][#members[c] + 1] = k - 1
      end
      table.sort(order, function(x, y) return math.abs(x) < math.abs(y) or (math.abs(x) == math.abs(y) and x > y) end)
      local calls, parts, mask = {}, {}, {}
      for k = 1, n do mask[k] = codes[k] < 0 and 1 or 0 end
      -- the classes' index lists one after the other in one buffer of n entries, each call reading its part: a
      -- captured refresh replays with the buffer written for its layout (the offsets follow from the layout,
      -- which its key names), and the buffer is the only one whatever layouts a long run meets (one per
      -- (code, count) seen grew with each new one)
      local all = {}
      for _, c in ipairs(order) do
        local method, steps, gemms, damped = describe(ladder, c)
        local m = members[c]
        local call = { code = c, method = method, steps = steps, gemms = gemms, damped = damped, blocks = #m }
        if #m < n then
          call.index = t.index:narrow(0, #all, #m)
          for _, k in ipairs(m) do all[#all + 1] = k end
        end
        calls[#calls + 1] = call
        parts[#parts + 1] = ("%s%s%s:%d"):format(method, steps > 0 and ("-" .. steps) or "", damped and "+damp" or "", #m)
      end
      if #all > 0 then t.index:narrow(0, 0, #all):copy_(ms.tensor(all, { dtype = "i32", ctx = ctx })) end
      t.mask:copy_(ms.tensor(mask, { dtype = "f32", ctx = ctx }))
      local any_damped = false
      for _, call in ipairs(calls) do any_damped = any_damped or call.damped end
      if any_damped and not t.damped then t.damped = f32({ n, f.size, f.size }, ctx) end
      a = { calls = calls, ladder = ladder, damping = damping, damped = any_damped, summary = table.concat(parts, " ") }
      w.auto[f.key] = a
    end
    sig[#sig + 1] = f.key .. " " .. a.summary
  end
  return "refresh" .. (w.auto_estimate and "+estimate" or "") .. "|" .. table.concat(sig, "; ")
end

-- auto (device side, in step): the damping (following this refresh's lambda_max estimate), each class's call,
-- then, when the next refresh classifies, the estimates it reads; every call on the whole factor stack, its
-- random vectors keyed by the blocks' ids
local function auto_refresh(o, st, w, f, seed)
  local A, X, ids = st.factor[f.key], st.root[f.key], w.rng_ids[f.key]
  local a, t = w.auto[f.key], w.auto_t[f.key]
  local pi = { vectors = o.matrix_scaling_pi_vectors, steps = o.matrix_scaling_pi_steps, eps = o.eps_power_iter,
               bf16 = o.pi_bf16, root = f.root, seed = seed, rng_ids = ids, lam_max = st.lam_max[f.key] }
  if a.damped then
    ms.spectrum_estimate(A, pi)
    ms.mul(st.lam_max[f.key], t.mask, t.d)
    ms.addcmul(A, t.eye, t.d:view({ f.n, 1, 1 }), a.damping, t.damped)
  end
  local fallen = 0
  for _, call in ipairs(a.calls) do
    local ro = root_options(o, call.method, call.steps, f.root, seed)
    ro.index, ro.rng_ids, ro.out, ro.iters = call.index, ids, X, t.iters
    if w.auto_estimate then ro.residual = st.residual[f.key] end
    fallen = fallen + inv_root_isolated(call.damped and t.damped or A, ro, o)
  end
  if w.auto_estimate then
    pi.x_root, pi.lam_min = X, st.lam_min[f.key]
    ms.spectrum_estimate(A, pi)
    if o.matrix_scaling_type == "fro" then
      -- the Frobenius scale of A + eps I, bounded above by ||A||_F + eps sqrt(b)
      st.fro[f.key]:copy_(A:reshape({ f.n, f.size * f.size }):norm(1)):add_(o.eps_inv_root * math.sqrt(f.size))
    end
  end
  return fallen
end

-- auto's decisions at the last refresh of a dash group (see the recipe's auto.report)
local function auto_report(group)
  local w = work[group.state]
  if not (w and w.auto) then return nil end
  local out = { stacks = {}, gemms = 0, gemms_run = 0, ndb10_gemms = 0, evd_blocks = 0, damped_blocks = 0 }
  for _, f in ipairs(w.plan.factors) do
    local a, t = w.auto[f.key], w.auto_t[f.key]
    local codes = group.state.class[f.key]:tolist_flat()
    local iters = t.iters:tolist_flat()
    local s = { key = f.key, blocks = f.n, root = f.root, damping = a.damping, classes = {}, gemms = 0, gemms_run = 0,
                ndb10_gemms = f.n * gemms_of("ndb", 10, f.root) }
    for i, call in ipairs(a.calls) do
      s.classes[i] = { method = call.method, steps = call.steps, damped = call.damped, blocks = call.blocks, gemms = call.gemms }
      if call.method == "evd" then out.evd_blocks = out.evd_blocks + call.blocks
      else s.gemms = s.gemms + call.blocks * call.gemms end
      if call.damped then out.damped_blocks = out.damped_blocks + call.blocks end
    end
    for k = 1, f.n do
      local method = describe(a.ladder, codes[k])
      if method == "cn" then s.gemms_run = s.gemms_run + gemms_of("cn", math.max(iters[k], 1), f.root)
      elseif method == "ndb" then
        local T = f.root == 4 and iters[k] / 2 or iters[k]
        s.gemms_run = s.gemms_run + gemms_of("ndb", math.max(math.floor(T + 0.5), 1), f.root)
      end
    end
    s.summary = a.summary
    out.stacks[#out.stacks + 1] = s
    out.gemms, out.gemms_run, out.ndb10_gemms = out.gemms + s.gemms, out.gemms_run + s.gemms_run, out.ndb10_gemms + s.ndb10_gemms
  end
  return out
end

local dash_route = {
  -- (1) the plan, and state: per stack grad EMA, Adam second moment (momentum); per factor stack factors, roots
  init = function(group, o)
    local st = group.state
    for _, m in ipairs(group) do
      if m.info.shard then
        error(("dash: parameter '%s' is sharded across ranks; DASH preconditions whole parameters (leave it "
               .. "unsharded: with settings.distribute = 'owner' each rank updates whole parameters of its own)"):format(m.name), 0)
      end
    end
    local ctx = group[1].param:context()
    local plan = plan_of(group, o)
    local names = {}
    for i, m in ipairs(group) do names[i] = m.name end
    member_names[st] = names
    st.refreshes, st.roots_ready = 0, false
    st.grad_ema, st.adam_v, st.factor, st.root = {}, {}, {}, {}
    if o.mu > 0 then st.momentum = {} end
    for _, s in ipairs(plan.stacks) do
      st.grad_ema[s.key], st.adam_v[s.key] = f32({ s.n, s.r, s.c }, ctx), f32({ s.n, s.r, s.c }, ctx)
      if st.momentum then st.momentum[s.key] = f32({ s.n, s.r, s.c }, ctx) end
    end
    for _, f in ipairs(plan.factors) do
      st.factor[f.key], st.root[f.key] = f32({ f.n, f.size, f.size }, ctx), f32({ f.n, f.size, f.size }, ctx)
    end
    if o.inv_root_method == "auto" then
      st.class, st.lam_max, st.lam_min, st.residual, st.fro = {}, {}, {}, {}, {}
      for _, f in ipairs(plan.factors) do
        st.class[f.key] = ms.zeros({ f.n }, { dtype = "i32", ctx = ctx })
        st.lam_max[f.key], st.lam_min[f.key] = f32({ f.n }, ctx), f32({ f.n }, ctx)
        st.residual[f.key], st.fro[f.key] = f32({ f.n }, ctx), f32({ f.n }, ctx)
      end
    end
  end,

  -- the block behind each slot of the stacked state (dim 0): "<param>@<row0>,<col0>", factors "/L" or "/R".
  -- A checkpoint records them, so state loads block by block, whichever parameters a rank's stacks hold.
  slots = function(group, o)
    local st, plan = group.state, plan_of(group, o)
    local map, factor_ids = {}, {}
    for _, f in ipairs(plan.factors) do factor_ids[f.key] = {} end
    for _, s in ipairs(plan.stacks) do
      local ids = {}
      for j, blk in ipairs(s.blocks) do
        ids[j] = block_name(plan, blk)
        factor_ids[s.left.factor][s.left.offset + j] = ids[j] .. "/L"
        if s.right then factor_ids[s.right.factor][s.right.offset + j] = ids[j] .. "/R" end
      end
      for _, k in ipairs { "grad_ema", "adam_v", "momentum" } do
        if st[k] then map[k .. "/" .. s.key] = ids end
      end
    end
    for _, f in ipairs(plan.factors) do
      for _, k in ipairs { "factor", "root", "class", "lam_max", "lam_min", "residual", "fro" } do
        if st[k] then map[k .. "/" .. f.key] = factor_ids[f.key] end
      end
    end
    return map
  end,

  -- (2) refresh or apply; host-side bookkeeping and the auto policy live here (step() may be replayed)
  plan = function(group, o, ctx)
    local st = group.state
    check_members(group)
    local w = work_of(group, o)
    local t = ctx.step
    if not preconditioning(o, t) then return "apply" end
    if not (t == 1 or t % o.inv_root_freq == 0 or not st.roots_ready) then return "apply" end
    local key = "refresh"
    if o.inv_root_method == "auto" then
      key = auto_plan(group, o, w)
      -- what the policy decided, without reading the device: classes, planned GEMMs against NDB-10's
      local parts, gemms, ndb10 = {}, 0, 0
      for _, f in ipairs(w.plan.factors) do
        local a = w.auto[f.key]
        parts[#parts + 1] = f.key .. " " .. a.summary
        for _, call in ipairs(a.calls) do
          if call.method ~= "evd" then gemms = gemms + call.blocks * call.gemms end
        end
        ndb10 = ndb10 + f.n * gemms_of("ndb", 10, f.root)
      end
      ctx.report("dash.auto_classes", table.concat(parts, "; "))
      ctx.report("dash.auto_gemms", gemms)
      ctx.report("dash.auto_ndb10_gemms", ndb10)
    end
    w.refresh_seed = o.seed + st.refreshes
    st.refreshes, st.roots_ready = st.refreshes + 1, true
    return key
  end,

  -- (3) the step of research/dash.md §1.2 on every stack
  step = function(group, o, ctx)
    local st = group.state
    check_members(group)
    local w = work_of(group, o)
    bind_grads(group, w)
    local pre = preconditioning(o, ctx.step)
    local sum = o.beta_LR >= 1
    local alpha, beta = sum and 1 or 1 - o.beta_LR, sum and 1 or o.beta_LR
    for _, s in ipairs(w.plan.stacks) do
      local k, G = s.key, w.G[s.key]
      -- G, the grafting state from it, then L <- beta L + alpha G G^T and R <- beta R + alpha G^T G, in one call
      -- (on the GPU one pass gathers, grafts and writes G^T, so that the products read K-major operands: TF32
      -- runs at full rate only on those)
      ms.blocks_gather_factors {
        stack = G, blocks = w.grad_list[k], left = w.left[k], right = s.right and w.right[k] or nil, alpha = alpha,
        beta = beta, tf32 = o.allow_tf32,
        graft = { grad_ema = st.grad_ema[k], adam_v = st.adam_v[k], norm = w.norm[k], pgraft = not pre and w.P[k] or nil,
                  beta_grad = o.beta_G, beta_graft = o.beta_graft, eps = o.eps_grafting, step = ctx.step_t,
                  bias_correction = o.use_bias_correction },
      }
    end
    if ctx.plan ~= "apply" then
      local seed = w.refresh_seed or o.seed
      local fallen = 0
      for _, f in ipairs(w.plan.factors) do
        if o.inv_root_method == "auto" then
          fallen = fallen + auto_refresh(o, st, w, f, seed)
        else
          local steps = o.inv_root_method == "chebyshev" and o.cbshv_degree or o.newton_steps
          local ro = root_options(o, o.inv_root_method, steps, f.root, seed)
          ro.out, ro.rng_ids = st.root[f.key], w.rng_ids[f.key]
          fallen = fallen + inv_root_isolated(st.factor[f.key], ro, o)
        end
      end
      -- (blocks EVD could not decompose, which took CN's root: evd_or_cn)
      if fallen > 0 then ctx.report("dash.evd_cn_fallbacks", fallen) end
    end
    for _, s in ipairs(w.plan.stacks) do
      local k = s.key
      local P, scale = w.P[k], nil
      if pre then
        P = w.U[k]
        if s.right then
          ms.matmul(w.lroot[k], st.grad_ema[k], { out = w.T[k], tf32 = o.allow_tf32 })
          ms.matmul(w.T[k], w.rroot[k], { out = P, tf32 = o.allow_tf32 })
        else
          ms.matmul(w.lroot[k], st.grad_ema[k], { out = P, tf32 = o.allow_tf32 })
        end
        scale = w.norm[k] / (P:reshape({ s.n, s.r * s.c }):norm(1) + 1e-16)
      end
      if o.mu > 0 then
        local M = st.momentum[k]
        if scale then ms.mul(P, scale:view({ s.n, 1, 1 }), w.P[k]) P, scale = w.P[k], nil end
        M:mul_(o.mu):add_(P)
        if o.use_nesterov then ms.add(P, M * o.mu, w.P[k]) P = w.P[k] else P = M end
      end
      ms.blocks_apply {
        blocks = w.param_list[k], stack = P, scale = scale, lr = ctx.lr_t, step = ctx.step_t,
        weight_decay = s.one_dim and 0 or o.weight_decay, stochastic_round = o.bf16_stochastic_round,
        seed = ctx.rng_key(o.seed), rng_ids = w.apply_ids[k],
      }
    end
  end,
}

-- the route of parameter p, by the rules of the header
local function pick_route(p, o)
  local tagged_a, tagged_d = p.tags.adamw, p.tags.dash
  if tagged_a and tagged_d then error(("dash: parameter '%s' is tagged both adamw and dash"):format(p.name), 0) end
  if tagged_a then return "adamw" end
  if p.ndim == 0 then return "adamw" end
  if tagged_d then return "dash" end
  local ndim = 0   -- DASH's rank of the parameter: its squeezed shape's
  for _, d in ipairs(p.shape) do if d ~= 1 then ndim = ndim + 1 end end
  if ndim <= 1 then return o.algo_one_dim == "shampoo" and "dash" or "adamw" end
  if finds_any(p.name, o.dash_patterns) then return "dash" end
  if finds_any(p.name, o.adamw_patterns) then return "adamw" end
  for _, d in ipairs(p.shape) do
    for _, a in ipairs(o.adamw_dims) do if d == a then return "adamw" end end
  end
  if adamw_by_name(p.name) then return "adamw" end
  return "dash"
end

return {
  name = "dash",
  version = 1,
  -- the auto policy's parts, for tests and for recipes that build on this one
  auto = { solvers = SOLVERS, floor = floor_of, gemms = gemms_of, ladder = auto_ladder, pick = auto_pick,
           damping = damping_of, describe = describe, report = auto_report, ndb10_floor = NDB10_FLOOR,
           evd_gemms = EVD_GEMMS, damped_margin = DAMPED_MARGIN },
  options = {
    lr = { default = 1e-3, type = "number", min = 0, doc = "base learning rate (the schedule scales it)" },
    weight_decay = { default = 0.0, type = "number", min = 0, doc = "decoupled weight decay (matrices)" },
    beta_G = { default = 0.9, type = "number", min = 0, below = 1, doc = "gradient EMA (0: the raw gradient)" },
    beta_LR = { default = 0.95, type = "number", min = 0, max = 1, doc = "factor EMA (1: plain sums)" },
    beta_graft = { default = 0.95, type = "number", min = 0, below = 1, doc = "Adam grafting second moment" },
    eps_grafting = { default = 1e-8, type = "number", above = 0, doc = "Adam grafting denominator term" },
    eps_inv_root = { default = 1e-10, type = "number", min = 0, doc = "roots of L + eps I" },
    inv_root_method = { default = "evd", type = "string", values = { "evd", "cn", "ndb", "chebyshev", "auto" },
                        doc = "inverse-root solver" },
    inv_root_freq = { default = 10, type = "integer", min = 1, doc = "refresh the roots every f steps" },
    start_prec_step = { default = -1, type = "integer", min = -1, doc = "first Shampoo step (-1: step 1)" },
    block_size = { default = 1024, type = "integer", min = 1, max = 32000, doc = "largest block side B" },
    newton_steps = { default = 10, type = "integer", min = 1, max = 1000, doc = "CN iterations / NDB steps" },
    matrix_scaling_type = { default = "pim", type = "string", values = { "fro", "pi", "pim" }, doc = "solver scaling" },
    matrix_scaling_pi_steps = { default = 10, type = "integer", min = 1, max = 1000, doc = "power-iteration steps" },
    matrix_scaling_const = { default = 2, type = "number", min = 1, doc = "power-iteration safety factor" },
    matrix_scaling_pi_vectors = { default = 16, type = "integer", min = 1, max = 64, doc = "pim vectors" },
    eps_power_iter = { default = 1e-6, type = "number", min = 0, doc = "power-iteration damping" },
    pi_bf16 = { default = true, type = "boolean", doc = "power iteration in bf16" },
    matmul_dtype = { default = "f32", type = "string", values = { "f32", "bf16", "f16" }, doc = "solver product operands" },
    allow_tf32 = { default = true, type = "boolean", doc = "TF32 GEMMs on the GPU" },
    cbshv_degree = { default = 60, type = "integer", min = 8, max = 10000, doc = "Chebyshev degree" },
    cn_tolerance = { default = 1e-6, type = "number", min = 0, doc = "CN per-block stopping tolerance" },
    ndb_tolerance = { default = 0.0, type = "number", min = 0, doc = "NDB per-block stopping tolerance (0: none)" },
    evd_heuristic = { default = "shampoo", type = "string", values = { "shampoo", "none" }, doc = "EVD eigenvalue shift" },
    mu = { default = 0.0, type = "number", min = 0, below = 1, doc = "momentum on the update" },
    use_nesterov = { default = false, type = "boolean", doc = "Nesterov form of the momentum" },
    use_bias_correction = { default = true, type = "boolean", doc = "Adam grafting bias corrections" },
    algo_one_dim = { default = "adamw", type = "string", values = { "adamw", "shampoo" }, doc = "1-D parameters" },
    adamw_betas = { default = { 0.9, 0.95 }, type = "numbers", length = 2, min = 0, below = 1, doc = "AdamW {beta1, beta2}" },
    adamw_eps = { default = 1e-8, type = "number", above = 0, doc = "AdamW eps" },
    adamw_weight_decay = { default = 0.0, type = "number", min = 0, doc = "AdamW weight decay" },
    bf16_stochastic_round = { default = false, type = "boolean", doc = "stochastic rounding of bf16/f16 params" },
    seed = { default = 0, type = "integer", min = 0, max = 2 ^ 32 - 1, doc = "Philox key" },
    adamw_patterns = { default = {}, type = "patterns", doc = "name patterns routed to AdamW" },
    dash_patterns = { default = {}, type = "patterns", doc = "name patterns routed to DASH" },
    adamw_dims = { default = {}, type = "numbers", integer = true, min = 1, doc = "dim sizes routed to AdamW" },
    auto_methods = { default = { "cn", "ndb" }, type = "strings", values = { "cn", "ndb" }, nonempty = true,
                     doc = "auto: iterative methods" },
    auto_tolerance = { default = 1e-3, type = "number", above = 0, below = 1, doc = "auto: accuracy of resolved roots" },
    auto_max_steps = { default = 20, type = "integer", min = 1, max = 100, doc = "auto: most steps of a class" },
    auto_margin = { default = 2, type = "number", min = 1, doc = "auto: y_min over the floor" },
    auto_unresolved = { default = "damp", type = "string", values = { "damp", "evd" }, doc = "auto: unresolved blocks" },
    auto_damping = { default = { NDB10_FLOOR[1], NDB10_FLOOR[2] }, type = "numbers", length = 2, above = 0, below = 1,
                     doc = "auto: relative damping {p = 2, p = 4} of unresolved blocks" },
    auto_reclassify_every = { default = 10, type = "integer", min = 1, doc = "auto: refreshes per classification" },
    auto_residual = { default = 1e-2, type = "number", above = 0, doc = "auto: residual that escalates a block" },
  },

  validate = function(o)
    if o.start_prec_step == 0 then
      error("dash: option 'start_prec_step' = 0: steps count from 1 (use -1 or 1 for Shampoo from the start)", 0)
    end
    if o.inv_root_method == "evd" and o.matmul_dtype ~= "f32" then
      error("dash: option 'matmul_dtype' = " .. o.matmul_dtype .. ": EVD computes in f32 (use cn, ndb or chebyshev)", 0)
    end
  end,

  route = function(p, o)
    local r = pick_route(p, o)
    if p.tags.no_decay then return r, r == "dash" and { weight_decay = 0 } or { adamw_weight_decay = 0 } end
    return r
  end,

  routes = {
    dash = dash_route,
    adamw = {
      init = function(group, o)
        for _, m in ipairs(group) do
          m.state.exp_avg = ms.zeros(m.param:shape(), { dtype = "f32", ctx = m.param:context() })
          m.state.exp_avg_sq = ms.zeros(m.param:shape(), { dtype = "f32", ctx = m.param:context() })
        end
      end,
      step = function(group, o, ctx)
        local params, grads, m1, m2, steps = {}, {}, {}, {}, {}
        for i, m in ipairs(group) do
          params[i], grads[i], m1[i], m2[i] = m.param, m.grad, m.state.exp_avg, m.state.exp_avg_sq
          steps[i] = ctx.step_of(m)   -- its own step count (the steps it had a gradient in)
        end
        ms.adamw_step {
          params = params, grads = grads, exp_avg = m1, exp_avg_sq = m2, lr = ctx.lr_t, steps = steps,
          beta1 = o.adamw_betas[1], beta2 = o.adamw_betas[2], eps = o.adamw_eps, weight_decay = o.adamw_weight_decay,
          stochastic_round = o.bf16_stochastic_round, seed = ctx.rng_key(o.seed), skip = ctx.skip_t,
        }
      end,
    },
  },
}
