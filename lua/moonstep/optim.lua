--[[
moonstep.optim -- the optimizer runtime: turns a recipe and a trainer's parameters into an optimizer
that does one step per call (DESIGN.md, "Recipes (policy in Lua): the contract").

  local opt = ms.optim.new("adamw", {
    {name = "layer.weight", param = w, grad = gw},
    {name = "layer.bias",   param = b, grad = gb, tags = {"no_decay"}},
  }, {lr = 3e-4, weight_decay = 0.1},                    -- the recipe's options (checked against its specs)
  {schedule = {kind = "cosine", warmup_steps = 100, total_steps = 10000}, clip_grad_norm = 1.0})
  for step = 1, n do  compute gradients into gw, gb ...;  opt:step()  end
  opt:save("ckpt.safetensors")

Settings (the runtime's, kept apart from the recipe's options):
  schedule        {kind = constant|linear_warmup|cosine|wsd, ...} or function(step) -> multiplier
  clip_grad_norm  global gradient-norm clipping threshold (nil: off)
  nonfinite       "skip" (default: a step with NaN/Inf gradients changes nothing and is counted),
                  "raise" (an error naming the parameters), or "apply"
  master_weights  keep f32 master copies of bf16/f16 parameters (the recipe updates the masters)
  trusted         run a recipe loaded from a file with the full Lua environment
  sandbox         limits of an untrusted recipe: {instructions =, memory =, retained =, quota =, seconds =}
                  (moonstep.recipe)
  ctx / device    the context or device the optimizer runs on (default: the first parameter's)
  stats           true: opt:stats() also reports each parameter's update norm (costs a copy per step; a
                  sharded parameter's is the whole parameter's, one all-reduce more)
  timings         true: events around each route's step (CUDA events; the host clock on the CPU), read
                  lazily: opt:stats().timings per route, opt.last.timings once stats() has read them
  device_checks   true: the non-finite check and clipping run on the device, as in captured steps, so a
                  step never waits for the GPU (see "Captured steps"; without capture too)
  capture_on_change  what a captured step does when a parameter's or gradient's memory, shape or dtype
                  differs from the capture: "recapture" (default) or "error"
  max_graphs      captured graphs kept at once (default 32): a capture past it frees the graph replayed
                  longest ago (its key captures again when it comes back)
  comm            a communicator (ms.comm): this optimizer is one rank of its world (see "Several ranks")
  distribute      with several ranks, who updates a parameter that is not sharded: "owner" (default: one
                  rank, then a broadcast from it) or "replicate" (every rank; the trainer keeps the gradients
                  identical)

Parameters routed alike with the same option overrides (the route's, and a parameter entry's options = {...})
form a group.  A group whose lr differs from options.lr steps with that multiple of the runtime's learning
rate (its ctx.lr and ctx.lr_t: the schedule and set_lr scale every group alike), as a torch parameter group
with its own lr.

Tied parameters (several names for one tensor: a tied embedding and lm_head) are one parameter, updated once,
with one gradient: given through any of the names (registered with one, or the same tensor with each; set_grad
through any name replaces it), routed once (by the first name's tags and options: a later name may repeat them
or give none).  Two different gradients (or tags, options) for one tie are refused, at registration and in
step{grads =}: the update would use only one of them.  A gradient must be writable (no expanded view): steps
rescale gradients in place (grad_scale, clip_grad_norm).

A parameter without a gradient is skipped, and those steps are not its own: ctx.step_of(member) gives a
member's step count (a device scalar, and the number), the optimizer's less the steps it went without a
gradient, as torch's per-parameter state["step"] counts them (bias corrections, a momentum's first step).
Checkpoints keep these counts.

ctx.rng_key(seed, k) is the Philox key of the k-th random stream (k = 0..7) of the route being stepped: the
32-bit seed in the key's low word, the route's place among the recipe's routes (by name, sorted) and k in its
high word.  An engine call numbers its members from 0 by their place in it, unless a member's param carries an
origin (ms.set_rng_origin): the runtime gives every parameter its place among its route's parameters (entry
order) and a slice its elements' numbers in the whole parameter, on its own handle of the tensor (m.param, an
alias: the caller's handle is left as it was), so a route's members never draw the same numbers, and a split
over ranks or calls (owners, slices, a route's 8-bit and f32 AdamW calls) rounds as one call over the whole
does.  Keyed by rng_key, no two routes share a stream.  The groups of one route share theirs: what a matrix draws
from the key alone (SinkGD's first power vector) is then the same whether it is sharded or whole, alone in its
group or not.

Several ranks (settings.comm of N > 1 ranks).  Every rank makes its optimizer with the same recipe, options,
settings and parameters (same names, same order); the checks at creation (two all-gathers) name what differs
(of the settings: distribute, nonfinite, clip_grad_norm, schedule, master_weights, device_checks, stats; a
schedule given as a function is not compared).
  - A parameter entry may carry shard = {dim = "rows"|"cols", offset = k, size = s}: its param (and grad) is
    this rank's slice of a matrix (or stack of matrices) whose dim -2 (rows) or -1 (cols) is s long, starting
    at k.  The ranks' slices must tile [0, s).  Every rank steps its own slice (SinkGD exchanges its norm
    vectors: moonstep.shard); route() and the recipe see the global shape as info.shape, the slice's as
    info.local_shape, and info.shard.  Sharded and whole parameters never share a group.
  - "owner": each whole parameter is owned by one rank -- DASH's split (research/dash.md §1.5): parameters of
    2+ dims by numel, largest first, each to the least-loaded rank (ties: the lower rank); the others round
    robin.  A rank's recipe initializes and steps only the members it owns (route() still sees them all), and
    after the step every parameter is broadcast from its owner (one group of broadcasts).
  - Every rank takes the same decisions: one all-reduce gives the non-finite flag (any rank, any gradient)
    and clip_grad_norm's global norm (a shard's sum of squares from every rank, a whole parameter's once).
  - ctx.world = {rank =, size =} for the recipes.
  - opt:save(path) writes one part per rank (path .. ".rank<r>-of-<N>", moved there from a ".partial" file
    once every rank has written its own: a failed save leaves the checkpoint at path as it was) and then, from
    rank 0, the index at path; opt:load(path) reads a checkpoint of any world size (one file or an index and its parts) and
    re-shards it by name: slices of sharded state joined or cut along the shard's dim, owned state taken
    wherever its parameter was owned, the stacked state of routes that name their slots (DASH) block by block.
    A route describes its state for that with two optional functions: state_shard(member, key, options) ->
    axis [, num, den] or false (how a sharded member's state tensor is split; default: a tensor shaped like
    the slice is split like it, any other is the same on every rank) and slots(group, options) -> {[path in
    group.state] = {block name per dim-0 slot}} (group state stacked from several parameters).
  - Every rank must give gradients to the same parameters at each step (the checks and broadcasts are
    collectives over them), and step with the same learning rate (set_lr on every rank alike) and
    grad_scale.  Steps checked on the host verify these in the all-reduce they make anyway, and every rank
    raises on a step where they differ, changing nothing; steps that read nothing back (device-checked,
    captured, or nonfinite = "apply" without clipping or loss scaling) do not check them.
  - An error on one rank while the routes update (a recipe's error) gives the communicator up (comm:abort),
    so that the other ranks' collectives in that step fail at once, naming the rank, rather than at the
    timeout; the communicator is then done for on every rank (CPU communicators; NCCL's cannot be told).

Captured steps (CUDA): after opt:capture(), each step replays a CUDA graph per plan key (the plan() keys
of the routes that run, e.g. DASH's "refresh" and "apply"), instead of running the recipe.  The first step
with a new key runs uncaptured (it fills the memory pool's cache), the next one with that key captures and
replays.  Replays read lr and step from the device scalars lr_t / step_t, written before each launch (a
value equal to the last one written is not written again, so recipes read ctx.lr_t / ctx.step_t and never
write them).  A replay checks nothing per member while no set_grad ran (tensors never change their memory,
shape or dtype).  A captured step reads nothing back to the host, so:
  - the non-finite check and clipping run on the device: ctx.skip_t (a device scalar, nonzero on a step with
    NaN/Inf gradients) goes to the recipe, whose fused steps take it as `skip`; a route that does not read
    ctx.skip_t cannot be skipped on the device, and capturing it is refused (unless nonfinite = "apply").
    nonfinite = "raise" cannot be captured.
  - opt:step() returns nil (not true/false), opt.last.skipped, grad_norm and clipped are nil until
    opt:stats() reads them (it waits for the device); skipped_steps counts the device's skips too.
  - a skipped step still advances the step count and the schedule (the host cannot know it was skipped).
  - the recipe's step() runs only while recording: it must not change host state per step (plan() does).
A parameter or gradient whose memory, shape or dtype changed (set_grad with another buffer) is re-captured
(or an error, per capture_on_change); opt:uncapture() frees the graphs.  At most settings.max_graphs graphs are
kept: a route whose plan keys keep changing (DASH's auto names its class layout) does not accumulate one per
key for the rest of the run.  Inside a trainer's own capture of
the context's stream (torch.cuda.graph), opt:step() only queues the capture-safe step (ms_graph_join) and
writes no device scalars: call opt:prepare_replay() before each replay of that graph.
]]
local ms = require("moonstep")
local R = require("moonstep.recipe")
local S = require("moonstep.schedule")
local json = require("moonstep.json")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local fused = require("moonstep.fused")
local graph = require("moonstep.graph")
local bit = require("bit")
local ffi, C = core.ffi, core.C

local M = {}
local Optimizer = {}
Optimizer.__index = Optimizer
M.Optimizer = Optimizer

M.SCHEMA = 1

local setting_names = {
  schedule = true, clip_grad_norm = true, nonfinite = true, master_weights = true, trusted = true, ctx = true,
  device = true, stats = true, sandbox = true, timings = true, device_checks = true, capture_on_change = true,
  comm = true, distribute = true, max_graphs = true,
}

-- a live communicator of moonstep.comm (ms.comm.new, from_env, borrow)
local function is_comm(v) return ms.comm.handle(v) ~= nil end

local function check_settings(s)
  s = s or {}
  if type(s) ~= "table" then error("settings must be a table", 3) end
  for k in pairs(s) do
    if not setting_names[k] then
      local names = {}
      for n in pairs(setting_names) do names[#names + 1] = n end
      table.sort(names)
      error(("unknown setting '%s' (settings: %s; recipe options go in the third argument)"):format(tostring(k),
            table.concat(names, ", ")), 3)
    end
  end
  local out = {}
  for k, v in pairs(s) do out[k] = v end
  if out.clip_grad_norm ~= nil then
    local v = R.types.number(out.clip_grad_norm)
    if not v or v <= 0 then error("setting clip_grad_norm must be a positive number (got " .. tostring(out.clip_grad_norm) .. ")", 3) end
    out.clip_grad_norm = v
  end
  out.nonfinite = out.nonfinite or "skip"
  if out.nonfinite ~= "skip" and out.nonfinite ~= "raise" and out.nonfinite ~= "apply" then
    error("setting nonfinite must be 'skip', 'raise' or 'apply' (got " .. tostring(out.nonfinite) .. ")", 3)
  end
  out.capture_on_change = out.capture_on_change or "recapture"
  out.max_graphs = out.max_graphs == nil and 32 or out.max_graphs
  if type(out.max_graphs) ~= "number" or out.max_graphs ~= math.floor(out.max_graphs) or out.max_graphs < 1
     or out.max_graphs == math.huge then
    error("setting max_graphs must be an integer >= 1 (got " .. core.show(out.max_graphs) .. ")", 3)
  end
  if out.capture_on_change ~= "recapture" and out.capture_on_change ~= "error" then
    error("setting capture_on_change must be 'recapture' or 'error' (got " .. tostring(out.capture_on_change) .. ")", 3)
  end
  for _, b in ipairs { "master_weights", "trusted", "stats", "timings", "device_checks" } do
    if out[b] ~= nil then
      local v = R.types.boolean(out[b])
      if v == nil then error(("setting %s must be a boolean (got %s)"):format(b, tostring(out[b])), 3) end
      out[b] = v
    end
  end
  if out.device_checks and out.nonfinite == "raise" then
    error("setting device_checks: nonfinite = 'raise' needs the gradients read back every step; use 'skip' or 'apply'", 3)
  end
  if out.comm ~= nil and not is_comm(out.comm) then
    error(("setting comm must be a communicator (ms.comm.new, ms.comm.from_env; got %s)"):format(
          type(out.comm) == "table" and "a table" or tostring(out.comm)), 3)
  end
  -- (checked here, where the error can name the setting: later they fail as another function's argument, or
  -- for sandbox, only once a recipe runs untrusted)
  if out.ctx ~= nil and getmetatable(out.ctx) ~= "moonstep.Context" then
    error(("setting ctx must be a moonstep context (ms.device, ms.context; got %s)"):format(core.show(out.ctx)), 3)
  end
  if out.device ~= nil and type(out.device) ~= "string" then
    error(("setting device must be a device name such as \"cuda:0\" (got %s)"):format(core.show(out.device)), 3)
  end
  if out.sandbox ~= nil and type(out.sandbox) ~= "table" then
    error(("setting sandbox: the sandbox limits must be a table {instructions =, memory =, retained =, quota =, "
           .. "seconds =} (got %s)")
          :format(core.show(out.sandbox)), 3)
  end
  if out.distribute ~= nil and out.distribute ~= "owner" and out.distribute ~= "replicate" then
    error("setting distribute must be 'owner' or 'replicate' (got " .. tostring(out.distribute) .. ")", 3)
  end
  return out
end

local function shape_str(t) return "[" .. table.concat(t:shape(), ",") .. "]" end

local function same_shape(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return false end
  for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
  return true
end

-- [lo, hi): the byte addresses of a contiguous tensor's elements (nil for an empty or strided one, whose
-- elements may interleave with another tensor's without sharing any)
local function byte_span(t)
  if t:numel() == 0 or not t:is_contiguous() then return nil end
  local lo = tonumber(ffi.cast("uintptr_t", C.ms_tensor_data_ptr(tensor.handle(t))))
  return lo, lo + t:numel() * tensor.dtype_bytes[t:dtype()]
end

-- Parameters and gradients (tied parameters counted once) must not share memory: a shared gradient is scaled
-- twice by clipping and grad_scale and counted twice in the norm, and a step through one parameter would write
-- another's.  list: {name =, param =, grad =} entries.
local function check_disjoint(list, level)
  local spans = {}
  for _, e in ipairs(list) do
    for _, what in ipairs { "param", "grad" } do
      local t = e[what]
      local lo, hi
      if t ~= nil then lo, hi = byte_span(t) end
      if lo then spans[#spans + 1] = { lo, hi, e.name, what, #spans } end
    end
  end
  -- (equal starts in the order given, so the message names the later one)
  table.sort(spans, function(a, b) if a[1] ~= b[1] then return a[1] < b[1] end return a[5] < b[5] end)
  local far   -- of the spans so far, the one reaching furthest
  for _, s in ipairs(spans) do
    if far and s[1] < far[2] then
      error(("parameter '%s': its %s shares memory with parameter '%s''s %s"):format(s[3], s[4], far[3], far[4]), level)
    end
    if far == nil or s[2] > far[2] then far = s end
  end
end

-- check_disjoint for one entry e against the others of `list` (skip(o) true: o is e's tie, which shares its
-- param): the message naming the first memory shared, or nil.  A registration at a time (the C and Python
-- optimizers' add_param), so that a parameter is refused when it is given, not at every step after.
local function shared_memory(e, list, skip)
  for _, what in ipairs { "param", "grad" } do
    local lo, hi
    if e[what] ~= nil then lo, hi = byte_span(e[what]) end
    if lo then
      for _, o in ipairs(list) do
        if o ~= e and not skip(o) then
          for _, other in ipairs { "param", "grad" } do
            local lo2, hi2
            if o[other] ~= nil then lo2, hi2 = byte_span(o[other]) end
            if lo2 and lo < hi2 and lo2 < hi then
              return ("parameter '%s': its %s shares memory with parameter '%s''s %s"):format(e.name, what, o.name, other)
            end
          end
        end
      end
    end
  end
  return nil
end

-- the key of a (contiguous) parameter's memory: parameters with the same key are tied
local function data_key(t)
  return tostring(core.ffi.cast("uintptr_t", core.C.ms_tensor_data_ptr(tensor.handle(t)))) .. ":" ..
         table.concat(t:shape(), "x") .. ":" .. t:dtype()
end

-- whether a and b (tensors) view the same elements: the same object, or the same address, dtype, shape and strides
local function same_view(a, b)
  if rawequal(a, b) then return true end
  local ha, hb = tensor.handle(a), tensor.handle(b)
  local n = C.ms_tensor_ndim(ha)
  if C.ms_tensor_data_ptr(ha) ~= C.ms_tensor_data_ptr(hb) or C.ms_tensor_dtype(ha) ~= C.ms_tensor_dtype(hb)
     or n ~= C.ms_tensor_ndim(hb) then
    return false
  end
  for d = 0, n - 1 do
    if C.ms_tensor_size(ha, d) ~= C.ms_tensor_size(hb, d) or C.ms_tensor_stride(ha, d) ~= C.ms_tensor_stride(hb, d) then
      return false
    end
  end
  return true
end
local function tag_list(tags)
  local l = {}
  for i, t in ipairs(tags or {}) do l[i] = t end
  table.sort(l)
  return table.concat(l, ",")
end

-- Why entry p cannot join the tie whose first entry is `tie` (nil when it can).  A tie is one parameter: one
-- gradient (given through either name, or the same through both), routed once (by the first name's tags and
-- options: a later name may repeat them, or give none).
local function tie_conflict(tie, p)
  local what
  if p.grad ~= nil and tie.grad ~= nil and not same_view(p.grad, tie.grad) then
    what = "gradients: a tie has one gradient (give it through one name, or the same tensor through both)"
  elseif p.tags ~= nil and next(p.tags) ~= nil and tag_list(p.tags) ~= tag_list(tie.tags) then
    what = ("tags ([%s], [%s]): a tie is routed once (give its tags with one name, or the same with both)")
           :format(tag_list(tie.tags), tag_list(p.tags))
  elseif p.options ~= nil and next(p.options) ~= nil and json.encode(p.options) ~= json.encode(tie.options or {}) then
    what = "options: a tie is routed once (give its options with one name, or the same with both)"
  elseif p.shard ~= nil then
    what = "a shard: a tie is one parameter (give its shard with its first name only)"
  else
    return nil
  end
  return ("parameters '%s' and '%s' are tied (one tensor) but were given different %s"):format(tie.name, p.name, what)
end
-- (moonstep.embed finds tied parameters and checks them as they are added, before the optimizer is built)
M._tie_key, M._tie_conflict, M._shared_memory = data_key, tie_conflict, shared_memory

-- A parameter entry's tags: nil or an array of non-empty strings (a set {no_decay = true} would route as if untagged).
local function check_tags(name, tags, level)
  if tags == nil then return end
  if type(tags) ~= "table" then
    error(("parameter '%s': tags must be an array of strings (got a %s)"):format(name, type(tags)), level)
  end
  local n = #tags
  for k, v in pairs(tags) do
    if type(k) ~= "number" or k < 1 or k > n or k % 1 ~= 0 then
      error(("parameter '%s': tags must be an array of strings (it has the key %s)"):format(name, tostring(k)), level)
    end
    if type(v) ~= "string" or v == "" then
      error(("parameter '%s': tags[%d] must be a non-empty string (got %s)"):format(name, k,
            v == "" and "\"\"" or type(v)), level)
    end
  end
end

-- the parameter description a recipe's route() sees
-- (shape and numel are the global ones: a sharded parameter's, see "Several ranks"; local_shape this rank's)
local function param_info(entry)
  local tags = {}
  for _, t in ipairs(entry.tags or {}) do tags[t] = true end
  local s = entry.shard
  return {
    name = entry.name, shape = s and s.shape or entry.param:shape(), ndim = entry.param:dim(), dtype = entry.param:dtype(),
    numel = s and s.numel or entry.param:numel(), tags = tags, local_shape = entry.param:shape(),
    shard = s and { dim = s.dim, offset = s.offset, size = s.size } or nil,
  }
end

-- ---------------------------------------------------------------------------------------------------
-- several ranks (settings.comm; see "Several ranks" above).  Nothing here runs with one rank.
-- ---------------------------------------------------------------------------------------------------
local SHARD_FROM_END = { rows = 2, cols = 1 }   -- rows: the matrices' dim -2, cols: dim -1
local SHARD_CODE = { rows = 1, cols = 2 }
local SHARD_WORDS = { [0] = "whole", [1] = "sharded by rows", [2] = "sharded by cols" }

local function is_integer(v) return type(v) == "number" and v == math.floor(v) and v > -math.huge and v < math.huge end

-- 32-bit FNV-1a of a name: what the ranks compare at creation
local function name_key(s)
  local h = 2166136261
  for i = 1, #s do
    local x = bit.bxor(h, s:byte(i)) % 4294967296
    h = ((x % 256) * 16777216 + x * 403) % 4294967296    -- x * 16777619 mod 2^32, exactly in doubles
  end
  return h
end

-- The shard of parameter entry e (p.shard), checked against its param: e.shard = {dim, axis (the param's dim,
-- 0-based), offset, size, len (this rank's length), shape and numel (global)}.  With one rank the shard must
-- be the whole dim, and is then no shard.  With several, a problem is kept in e.shard_error until the ranks
-- compare (dist_check), so that no rank waits in that all-gather for one that gave up.
local function shard_entry(self, e, s)
  local shape, why = e.param:shape(), nil
  local axis, len
  if type(s) ~= "table" then
    why = "must be a table {dim = 'rows'|'cols', offset =, size =}"
  elseif not SHARD_FROM_END[s.dim] then
    why = ("dim must be 'rows' or 'cols' (got %s)"):format(tostring(s.dim))
  elseif #shape < 2 then
    why = ("needs a parameter of 2 or more dims (this one is [%s])"):format(table.concat(shape, ","))
  elseif not is_integer(s.offset) or s.offset < 0 then
    why = ("offset must be an integer >= 0 (got %s)"):format(tostring(s.offset))
  elseif not is_integer(s.size) or s.size < 1 then
    why = ("size must be an integer >= 1 (got %s)"):format(tostring(s.size))
  else
    axis = #shape - SHARD_FROM_END[s.dim]
    len = shape[axis + 1]
    if s.offset + len > s.size then
      why = ("holds %s [%d, %d) (its param's dim %d is %d long), outside [0, %d)"):format(s.dim, s.offset,
            s.offset + len, axis, len, s.size)
    end
  end
  if why then
    local msg = ("parameter '%s': shard %s"):format(e.name, why)
    if self.world.size == 1 then error(msg, 3) end
    e.shard_error = msg
    return
  end
  if self.world.size == 1 then
    if s.offset ~= 0 or len ~= s.size then
      error(("parameter '%s': shard holds %s [%d, %d) of [0, %d) but there is no other rank to hold the rest "
             .. "(settings.comm: one rank)"):format(e.name, s.dim, s.offset, s.offset + len, s.size), 3)
    end
    return
  end
  local g, numel = {}, 1
  for d, v in ipairs(shape) do g[d] = v end
  g[axis + 1] = s.size
  for _, v in ipairs(g) do numel = numel * v end
  e.shard = { dim = s.dim, axis = axis, offset = s.offset, size = s.size, len = len, shape = g, numel = numel }
end

-- What decides which collectives a rank makes, compared first (one all-gather of a fixed size, so that it
-- cannot mismatch): the number of parameters (the size of the comparison below; none: no comparison at all),
-- the settings that decide the step's collectives and their results (distribute, nonfinite, clip_grad_norm)
-- and the recipe and its options (the routes' own collectives).
-- A rank that refused its own arguments before getting here (M.new) takes part with column 7 set, so that
-- the others raise too instead of waiting.  Columns 8 to 10 are the settings that change the step's result
-- or its collectives without changing the recipe's options: the schedule (a table or kind name by its
-- fields; a function cannot be compared and counts as "function"), master_weights and device_checks (which
-- makes other collectives), and stats (the sharded update norms' all-reduce).  A rank with another schedule
-- would step its slices with another learning rate.
local NONFINITE_CODE = { skip = 1, raise = 2, apply = 3 }
local HEADER_COLS = 11
local REFUSED_HEADER = { 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0 }
local function header_gather(comm, ctx, v)
  return comm:all_gather(ms.empty({ comm:size() * HEADER_COLS }, { dtype = "f64", ctx = ctx }),
                         ms.tensor(v, { dtype = "f64", ctx = ctx })):tolist_flat()
end
local function schedule_key(schedule)
  if type(schedule) == "function" then return name_key("function") end
  local ok, text = pcall(json.encode, schedule)
  return ok and name_key(text) or 0
end
local function dist_agree(self, n)
  local world, rank, s = self.world.size, self.world.rank, self.settings
  local okj, opts = pcall(json.encode, self.options)
  local v = { n, self.dist.mode == "owner" and 1 or 2, NONFINITE_CODE[s.nonfinite] or 0, s.clip_grad_norm or 0,
              name_key(tostring(self.recipe_hash)), okj and name_key(opts) or 0, 0, schedule_key(s.schedule),
              s.master_weights and 1 or 0, s.device_checks and 1 or 0, s.stats and 1 or 0 }
  if self.progress then self.progress.agreed = true end
  local all = header_gather(self.comm, self.ctx, v)
  local function at(r, c) return all[r * HEADER_COLS + c] end
  for r = 0, world - 1 do
    if at(r, 7) ~= 0 then
      error(("settings.comm: rank %d cannot make its optimizer (its error says why)"):format(r), 4)
    end
  end
  for r = 0, world - 1 do
    if at(r, 1) ~= n then
      error(("settings.comm: rank %d gives %d parameters, this rank (%d) %d: every rank must give the same parameters, "
             .. "in the same order"):format(r, at(r, 1), rank, n), 4)
    end
    for c, name in pairs { [2] = "distribute", [3] = "nonfinite", [4] = "clip_grad_norm", [8] = "schedule",
                           [9] = "master_weights", [10] = "device_checks", [11] = "stats" } do
      if at(r, c) ~= v[c] then
        error(("settings.comm: setting %s differs between rank %d and this rank (%d): every rank must pass the same "
               .. "settings"):format(name, r, rank), 4)
      end
    end
    if at(r, 5) ~= v[5] then
      error(("settings.comm: rank %d runs another recipe (or recipe version) than this rank's %s"):format(r,
            self.recipe.name), 4)
    end
    if at(r, 6) ~= v[6] then
      error(("settings.comm: rank %d gives %s other options than this rank (%d): every rank must pass the same options")
            :format(r, self.recipe.name, rank), 4)
    end
  end
end

-- The ranks compare their parameters with one all-gather (per parameter: name, global numel, shard dim,
-- offset, length, size, refused, global shape, dtype): the same parameters in the same order, of the same
-- shape and dtype (owners are assigned by dims and numel; broadcasts send the dtype), sharded alike, slices
-- that tile.
local CHECK_COLS = 9
local DTYPE_CODE = { f32 = 1, f64 = 2, bf16 = 3, f16 = 4, i32 = 5, u8 = 6 }
local DTYPE_NAME = { "f32", "f64", "bf16", "f16", "i32", "u8" }
local function dist_check(self, entries)
  local n, world, rank = #entries, self.world.size, self.world.rank
  dist_agree(self, n)
  if n == 0 then return end
  local v = {}
  for i, e in ipairs(entries) do
    local s, k = e.shard, (i - 1) * CHECK_COLS
    v[k + 1], v[k + 2] = name_key(e.name), s and s.numel or e.param:numel()
    v[k + 3], v[k + 4] = s and SHARD_CODE[s.dim] or 0, s and s.offset or 0
    v[k + 5], v[k + 6], v[k + 7] = s and s.len or 0, s and s.size or 0, e.shard_error and 1 or 0
    v[k + 8] = name_key(table.concat(s and s.shape or e.param:shape(), ","))
    v[k + 9] = DTYPE_CODE[e.param:dtype()] or name_key(e.param:dtype())
  end
  local all = self.comm:all_gather(ms.empty({ world * n * CHECK_COLS }, { dtype = "f64", ctx = self.ctx }),
                                   ms.tensor(v, { dtype = "f64", ctx = self.ctx })):tolist_flat()
  local function at(r, i, c) return all[(r * n + i - 1) * CHECK_COLS + c] end
  for i, e in ipairs(entries) do
    if e.shard_error then error(e.shard_error, 3) end
    for r = 0, world - 1 do
      if at(r, i, 7) ~= 0 then error(("parameter '%s': rank %d refused its shard (its error says why)"):format(e.name, r), 3) end
    end
  end
  for i, e in ipairs(entries) do
    for r = 0, world - 1 do
      if at(r, i, 1) ~= at(rank, i, 1) then
        error(("settings.comm: parameter %d is '%s' here but another one on rank %d: every rank must give the same "
               .. "parameters, in the same order"):format(i, e.name, r), 3)
      end
      if at(r, i, 3) ~= at(rank, i, 3) then
        error(("parameter '%s' is %s here but %s on rank %d"):format(e.name, SHARD_WORDS[at(rank, i, 3)],
              SHARD_WORDS[at(r, i, 3)], r), 3)
      end
      if at(r, i, 2) ~= at(rank, i, 2) or at(r, i, 6) ~= at(rank, i, 6) then
        error(("parameter '%s' has %d elements here but %d on rank %d (shapes of the whole parameter)"):format(
              e.name, at(rank, i, 2), at(r, i, 2), r), 3)
      end
      if at(r, i, 8) ~= at(rank, i, 8) then
        error(("parameter '%s' has shape [%s] here but another on rank %d (shapes of the whole parameter)"):format(
              e.name, table.concat(e.shard and e.shard.shape or e.param:shape(), ","), r), 3)
      end
      if at(r, i, 9) ~= at(rank, i, 9) then
        error(("parameter '%s' is %s here but %s on rank %d"):format(e.name, e.param:dtype(),
              DTYPE_NAME[at(r, i, 9)] or "another dtype", r), 3)
      end
    end
    local s = e.shard
    if s then
      local pieces = {}
      for r = 0, world - 1 do pieces[r + 1] = { r = r, lo = at(r, i, 4), hi = at(r, i, 4) + at(r, i, 5) } end
      table.sort(pieces, function(a, b) if a.lo ~= b.lo then return a.lo < b.lo end return a.r < b.r end)
      local pos, tiles = 0, true
      for _, p in ipairs(pieces) do
        if p.hi > p.lo then                     -- an empty slice takes no room
          if p.lo ~= pos then tiles = false end
          pos = p.hi
        end
      end
      if not tiles or pos ~= s.size then
        local desc = {}
        for r = 0, world - 1 do desc[r + 1] = ("rank %d [%d, %d)"):format(r, at(r, i, 4), at(r, i, 4) + at(r, i, 5)) end
        error(("parameter '%s': the ranks' %s do not tile [0, %d) without gap or overlap: %s"):format(e.name, s.dim,
              s.size, table.concat(desc, ", ")), 3)
      end
    end
  end
end

-- DASH's split of the whole parameters (research/dash.md §1.5): 2+ dims by numel, largest first, each to the
-- least-loaded rank (ties: the lower rank, then registration order); fewer dims round robin in their order
local function assign_owners(entries, world)
  local big, small = {}, {}
  for i, e in ipairs(entries) do
    if not e.shard then
      local list = e.param:dim() >= 2 and big or small
      list[#list + 1] = { e = e, i = i, numel = e.param:numel() }
    end
  end
  table.sort(big, function(a, b) if a.numel ~= b.numel then return a.numel > b.numel end return a.i < b.i end)
  local load = {}
  for r = 0, world - 1 do load[r] = 0 end
  for _, x in ipairs(big) do
    local best = 0
    for r = 1, world - 1 do if load[r] < load[best] then best = r end end
    x.e.owner, load[best] = best, load[best] + x.numel
  end
  for k, x in ipairs(small) do x.e.owner = (k - 1) % world end
end

-- The numbers member m's stochastic rounding draws (moonstep.tensor.set_rng_origin): its place among the
-- parameters of its route in entry order (each route's calls are keyed apart: ctx.rng_key), and a slice's
-- elements numbered in the whole parameter.  A route with one group steps them in that order, so a recipe that
-- steps its group in one call rounds as it did by position; any split over ranks (owners stepping some of the
-- members, slices, whose groups are apart) rounds as one rank does, bit for bit, and no two members of a route
-- draw the same numbers.
local function rng_origin(m, member, shard)
  local o = { member = member }
  if shard then
    local shape = shard.shape
    o.rows, o.cols = shape[#shape - 1], shape[#shape]
    if shard.dim == "rows" then o.row0 = shard.offset else o.col0 = shard.offset end
  end
  tensor.set_rng_origin(m.param, o)
end

-- a member's part in the world: sharded (every rank steps its slice), owned (stepped = false elsewhere) or
-- replicated; `counted`: its sum of squares goes into the global norm from this rank
local function dist_member(self, e, m)
  local rank = self.world.rank
  if e.shard then
    m.shard, m.counted = e.shard, true
  elseif self.dist.mode == "owner" then
    m.owner, m.counted = e.owner, e.owner == rank
    if e.owner ~= rank then m.stepped = false end
  else
    m.counted = rank == 0
  end
end

-- the members of group g this rank initializes and steps: g itself, a view of them, or nil for none
local function local_view(g)
  local n = 0
  for _, m in ipairs(g) do if m.stepped ~= false then n = n + 1 end end
  if n == #g then return g end
  if n == 0 then return nil end
  local view = { route = g.route, index = g.index, id = g.id, options = g.options, overrides = g.overrides, state = g.state }
  for _, m in ipairs(g) do if m.stepped ~= false then view[#view + 1] = m end end
  return view
end

-- collectives issued as one group (NCCL: one launch) where the communicator offers it
local function comm_group(comm, fn)
  if comm.group then return comm:group(fn) end
  fn()
end

-- registers the sharded members with moonstep.shard, so that the primitives see their slices (sinkgd_step)
function Optimizer:_dist_register()
  local registry
  for _, m in ipairs(self.members) do
    local s = m.shard
    if s then
      registry = registry or require("moonstep.shard")
      local spec = { dim = s.dim, offset = s.offset, size = s.size }
      registry.set(m.param, spec, self.comm)
      if m.model_param then registry.set(m.model_param, spec, self.comm) end
    end
  end
end

-- The step's total sum of squares over the world, from this rank's per-gradient sums: a sharded member's
-- from every rank, another member's once (from its owner; from rank 0 when replicated), and NaN on every
-- rank when any rank has a non-finite gradient (0 * Inf is NaN too).  One all-reduce, which also checks that
-- every rank gives gradients to the same parameters: it sums k and k^2 for k = their count and a 20-bit sum of
-- their names' keys, and the ranks agree when N sum(k^2) = (sum k)^2 (only if every k is the same).  Every
-- rank sees the same sums, so all of them raise, before anything changed, instead of pairing the broadcasts
-- of different parameters.  A 20-bit key of the step's learning rate, number and grad_scale is checked alike:
-- a rank with another lr (set_lr on one rank, a schedule function that differs) would step its slices
-- otherwise, and one with another grad_scale would unscale its own sums of squares alone, so the global norm
-- (clipping) would be wrong on every rank, silently.
function Optimizer:_dist_total(sums, active, step, lr, inv)
  local total = 0
  for i, v in ipairs(sums) do
    if active[i].counted then total = total + v
    elseif v ~= v or v == math.huge or v == -math.huge then total = total + v * 0 end
  end
  local h = 0
  for _, m in ipairs(active) do h = (h + name_key(m.name) % 1048576) % 1048576 end
  local k = name_key(("%a@%d@%a"):format(lr, step, inv)) % 1048576
  local t, buf = self.dist.step_t, self.dist.step_buf
  buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6] = total, #active, #active * #active, h, h * h, k, k * k
  core.check(C.ms_tensor_write(self.ctx_h, tensor.handle(t), buf, 56))   -- (no tensor made per step)
  self.comm:all_reduce(t)
  local r, n = t:tolist_flat(), self.comm:size()
  if n * r[7] ~= r[6] * r[6] then
    error(("step %d: the ranks step with different learning rates, step counts or grad_scale (this rank: lr %.17g at "
           .. "step %d, grad_scale %.17g); every rank must set the same lr and schedule, and pass the same grad_scale")
          :format(step, lr, step, 1 / inv), 0)
  end
  if n * r[3] ~= r[2] * r[2] or n * r[5] ~= r[4] * r[4] then
    error(("step %d: the ranks give gradients to different parameters (this rank to %d); every rank must give "
           .. "gradients to the same parameters at each step"):format(step, #active), 0)
  end
  return r[1]
end

-- the device checks' weights per gradient: 1 where this rank counts its sum of squares, else 0 (which keeps
-- a NaN a NaN, so every rank sees every rank's non-finite gradients)
function Optimizer:_dist_mask(d)
  if d.mask_of ~= d.grads_of then
    local w = {}
    for i, m in ipairs(d.grads_of) do w[i] = m.counted and 1 or 0 end
    d.mask, d.mask_of = ms.tensor(w, { dtype = "f64", ctx = self.ctx }), d.grads_of
  end
  return d.mask
end

-- after the step ("owner"): each whole parameter from its owner, as one group of broadcasts (the model's
-- tensor: the bf16 one when the owner keeps master weights)
function Optimizer:_dist_broadcast(active)
  local d = self.dist
  if d.mode ~= "owner" then return end
  if d.bcast_of ~= active then
    local list = {}
    for _, m in ipairs(active) do if m.owner then list[#list + 1] = m end end
    d.bcast, d.bcast_of = list, active
  end
  local list, comm = d.bcast, self.comm
  if #list == 0 then return end
  comm_group(comm, function()
    for _, m in ipairs(list) do comm:broadcast(m.model_param or m.param, m.owner) end
  end)
end

local build

-- the keys of a parameter entry (ms.optim.new's params)
local PARAM_KEYS = { name = true, param = true, grad = true, tags = true, options = true, shard = true }

--- ms.optim.new(recipe, params, options, settings) -> optimizer
function M.new(recipe, params, options, settings)
  local s = check_settings(settings)
  if not (s.comm and s.comm:size() > 1) then return build(recipe, params, options, settings) end
  -- several ranks: an error before the ranks compare (the recipe, the options, the parameters refused here)
  -- is told to the others in that comparison, so that they raise too rather than wait in it
  local progress = {}
  local ok, res = pcall(build, recipe, params, options, settings, progress)
  if ok then return res end
  if not progress.agreed then
    local ctx = s.comm:context() or ms.device()
    pcall(header_gather, s.comm, ctx, REFUSED_HEADER)
  end
  error(res, 0)
end

function build(recipe, params, options, settings, progress)
  settings = check_settings(settings)
  recipe = R.resolve(recipe, { trusted = settings.trusted })
  local meta = R.meta[recipe]
  local lr_spec = recipe.options.lr
  if type(lr_spec) ~= "table" or lr_spec.type ~= "number" then
    error(("recipe %s has no number option 'lr': the runtime owns the learning rate and schedules options.lr"):format(recipe.name), 2)
  end
  -- untrusted recipes: every call into the recipe goes through R.call with this guard (nil when trusted)
  local guard = R.guard(recipe, settings.sandbox, params)
  local opts = R.options(recipe, options, nil, guard)
  if type(params) ~= "table" then error("params must be an array of {name=, param=, grad=, tags=}", 2) end

  local self = setmetatable({
    recipe = recipe, recipe_hash = meta.hash, options = opts, settings = settings, step_count = 0,
    skipped = 0, groups = {}, members = {}, by_name = {}, aliases = {}, reports = {}, last = {}, guard = guard,
  }, Optimizer)
  self.progress = progress
  self.schedule, self.schedule_kind = S.compile(settings.schedule)

  -- the context: given, or that of the first parameter
  local ctx = settings.ctx or (settings.device and ms.device(settings.device))
  if not ctx then
    local first = params[1]
    ctx = first and ms.is_tensor(first.param) and first.param:context() or ms.device()
  end
  self.ctx = ctx
  self.lr_t = ms.zeros({ 1 }, { ctx = ctx })
  self.step_t = ms.zeros({ 1 }, { ctx = ctx })
  self.ctx_h = tensor.handle_ctx(ctx)
  self.device_name = ctx:name()
  -- captured and device-checked steps (see "Captured steps"): the checks' tensors per gradient count, the
  -- routes seen reading ctx.skip_t, the plan keys that ran uncaptured, and the graphs once opt:capture()
  self.checks, self.skip_readers, self.warm_keys = {}, {}, {}
  self.grads_version, self.captures, self.recaptures, self.evictions = 0, 0, 0, 0
  self.ctx_mt = {
    __index = function(_, k)
      if k ~= "skip_t" then return nil end
      if self.running_route and self.skip_now then self.skip_readers[self.running_route] = true end
      return self.skip_now
    end,
    __metatable = "moonstep.step_ctx",
  }
  if settings.timings then self.timing = { ring = {}, next = 0 } end
  self.world = { rank = 0, size = 1 }
  if settings.comm then
    local cctx = settings.comm:context()
    if cctx and cctx:name() ~= ctx:name() then
      error(("setting comm: the communicator is on %s but the optimizer runs on %s"):format(cctx:name(), ctx:name()), 2)
    end
    self.world = { rank = settings.comm:rank(), size = settings.comm:size() }
    if self.world.size > 1 then
      self.comm = settings.comm
      self.dist = { mode = settings.distribute or "owner", total_t = ms.zeros({ 1 }, { dtype = "f64", ctx = ctx }),
                    step_t = ms.zeros({ 7 }, { dtype = "f64", ctx = ctx }), step_buf = ffi.new("double[7]") }
    end
  end

  -- parameters: names unique, tensors on the optimizer's device, tied parameters registered once
  local seen = {}
  local entries = {}
  for i, p in ipairs(params) do
    if type(p) ~= "table" then error(("params[%d] must be a table {name=, param=, grad=}"):format(i), 2) end
    if type(p.name) ~= "string" or p.name == "" then error(("params[%d]: name must be a non-empty string"):format(i), 2) end
    -- (checkpoints, profiles and the C ABI read a name up to its first NUL: "w\0a" and "w\0b" would be one)
    core.c_string(("params[%d]"):format(i), "name", p.name, 2)
    if self.by_name[p.name] or self.aliases[p.name] then error(("params[%d]: duplicate name '%s'"):format(i, p.name), 2) end
    core.check_keys(("parameter '%s'"):format(p.name), p, PARAM_KEYS, 2, "key")   -- (tag = {...} would route untagged)
    if not ms.is_tensor(p.param) then error(("parameter '%s': param must be a tensor"):format(p.name), 2) end
    if p.param:device() ~= ctx:name() then
      error(("parameter '%s' is on %s but the optimizer runs on %s"):format(p.name, p.param:device(), ctx:name()), 2)
    end
    -- what the fused steps would refuse only when the param's route runs, after earlier routes have stepped
    if not p.param:is_contiguous() then
      error(("parameter '%s': param must be contiguous (it is updated in place; strides %s)"):format(p.name,
            "[" .. table.concat(p.param:strides(), ",") .. "]"), 2)
    end
    if p.grad ~= nil then self:_check_grad(p.name, p.param, p.grad, 3) end
    check_tags(p.name, p.tags, 3)
    local key = data_key(p.param)
    local tie = seen[key]
    if tie then
      local why = tie_conflict(tie, p)
      if why then error(why, 2) end
      tie.grad = tie.grad or p.grad
      self.aliases[p.name] = tie.name
    else
      local e = { name = p.name, param = p.param, grad = p.grad, tags = p.tags, options = p.options }
      if p.shard ~= nil then shard_entry(self, e, p.shard) end
      seen[key] = e
      entries[#entries + 1] = e
      self.by_name[p.name] = e
    end
  end

  check_disjoint(entries, 3)

  if self.dist then
    dist_check(self, entries)
    if self.dist.mode == "owner" then assign_owners(entries, self.world.size) end
  end

  -- routing and grouping: by route and identical overrides (sharded parameters apart), groups in order of
  -- first appearance
  local group_of = {}
  local route_count = {}
  local rng_count = {}   -- members so far of each route (rng_origin)
  for _, e in ipairs(entries) do
    local info = param_info(e)
    -- (every table the runtime keeps and hands an untrusted recipe is kept before the recipe sees it: what the
    -- recipe adds to it counts toward its retained limit, what the runtime put there does not; see R.keep)
    R.keep(guard, info)
    local route, overrides = R.call(guard, recipe.route, info, opts)
    if type(route) ~= "string" or not recipe.routes[route] then
      error(("%s: route() gave %s for parameter '%s', which is not one of its routes"):format(recipe.name, tostring(route), e.name), 2)
    end
    local ov = {}
    for k, v in pairs(overrides or {}) do ov[k] = v end
    for k, v in pairs(e.options or {}) do ov[k] = v end
    local gkey = route .. "\0" .. json.encode(next(ov) and ov or {}) .. (e.shard and "\0sharded" or "")
    local g = group_of[gkey]
    if not g then
      local gopts = next(ov) and R.options(recipe, ov, opts, guard) or opts
      route_count[route] = (route_count[route] or 0)
      g = { route = route, index = route_count[route], options = gopts, overrides = ov, state = {} }
      g.id = route .. "." .. g.index
      route_count[route] = route_count[route] + 1
      group_of[gkey] = g
      self.groups[#self.groups + 1] = g
    end
    -- (m.param: the optimizer's own handle on the caller's tensor, which carries the rounding's origin)
    local m = { name = e.name, param = tensor.alias(e.param), grad = e.grad, tags = info.tags, info = info, state = {},
                route = route, lag = 0, absent_from = e.grad == nil and 0 or nil }
    if self.dist then dist_member(self, e, m) end
    if settings.master_weights and m.stepped ~= false and (e.param:dtype() == "bf16" or e.param:dtype() == "f16") then
      m.model_param = e.param
      m.param = e.param:to("f32")
      m.master = m.param
    end
    g[#g + 1] = m
    e.member, e.group = m, g
    self.members[#self.members + 1] = m
    rng_count[route] = (rng_count[route] or 0) + 1
    rng_origin(m, rng_count[route] - 1, e.shard)
  end

  -- a group whose options give another lr (a per-parameter or route override) steps with that multiple of
  -- the learning rate the runtime computes (schedule, set_lr), as a torch parameter group with its own lr
  self.group_lr = {}
  for _, g in ipairs(self.groups) do
    if g.options.lr ~= opts.lr then
      if not (opts.lr > 0) then
        error(("%s: group %s has option lr = %s but the base lr is %s: a group's lr is applied as a multiple of the "
               .. "base one (which the schedule and set_lr scale), so the base must be > 0"):format(recipe.name, g.id,
               tostring(g.options.lr), tostring(opts.lr)), 2)
      end
      self.group_lr[g.id] = { ratio = g.options.lr / opts.lr, t = ms.zeros({ 1 }, { ctx = ctx }) }
    end
  end

  self.nvtx = {}
  for route in pairs(recipe.routes) do self.nvtx[route] = "moonstep:" .. tostring(route) end

  if self.dist then self:_dist_register() end

  -- state: created by each route's init, owned by the optimizer (with owners: for the members it steps)
  for _, g in ipairs(self.groups) do
    if self.dist then g.view = local_view(g) or false end
    R.keep(guard, g)
    R.keep(guard, g.view)
  end
  R.keep(guard, self.warm_keys)          -- (the plan keys: strings the recipe's plans return)
  for _, g in ipairs(self.groups) do
    local r = recipe.routes[g.route]
    local view = g.view == nil and g or g.view
    if r.init and view then R.call(guard, r.init, view, g.options) end
  end
  self.progress = nil
  return self
end

function Optimizer:_check_grad(name, param, grad, level)
  if not ms.is_tensor(grad) then error(("parameter '%s': grad must be a tensor"):format(name), level) end
  if not same_shape(param, grad) then
    error(("parameter '%s': grad shape %s != param shape %s"):format(name, shape_str(grad), shape_str(param)), level)
  end
  if grad:device() ~= param:device() then
    error(("parameter '%s': grad is on %s, param on %s"):format(name, grad:device(), param:device()), level)
  end
  local dt = grad:dtype()
  if dt ~= "f32" and dt ~= "f64" and dt ~= "bf16" and dt ~= "f16" then
    error(("parameter '%s': grad dtype %s is not a float dtype"):format(name, dt), level)
  end
  -- the fused steps refuse it too, but only when its route runs: after the routes before it have stepped
  if core.C.ms_tensor_overlaps(tensor.handle(param), tensor.handle(grad)) ~= 0 then
    error(("parameter '%s': grad shares memory with the param (it is updated in place)"):format(name), level)
  end
  -- grad_scale and clipping rescale it in place: an expanded view would fail (or race) only at such a step
  if core.C.ms_tensor_is_writable(tensor.handle(grad)) == 0 then
    error(("parameter '%s': grad %s has strides [%s], under which two elements share an address (an expanded "
           .. "view?); steps rescale gradients in place (grad_scale, clip_grad_norm), so it must be writable")
          :format(name, shape_str(grad), table.concat(grad:strides(), ",")), level)
  end
end

--- The learning rate the next step will use.
function Optimizer:get_lr()
  if self.lr_override then return self.lr_override end
  return self.options.lr * self.schedule(self.step_count + 1)
end

--- Sets the learning rate for the following steps (the schedule is then bypassed).
function Optimizer:set_lr(x)
  local v = R.types.number(x)
  if v == nil or v < 0 then error("set_lr: a non-negative number is needed (got " .. tostring(x) .. ")", 2) end
  self.lr_override = v
end

--- Replaces the gradient tensor of a parameter (a trainer whose gradient buffers move).
function Optimizer:set_grad(name, grad)
  local e = self.by_name[name] or self.by_name[self.aliases[name] or ""]
  if not e then error("set_grad: no parameter named '" .. tostring(name) .. "'", 2) end
  if grad ~= nil then self:_check_grad(name, e.param, grad, 3) end
  -- the steps a parameter goes without a gradient are not its steps (its own count, torch's state["step"])
  local m = e.member
  if m.grad == nil and grad ~= nil then
    m.lag, m.absent_from = self:_lag(m), nil
    self:_lag_scalar(m.lag)
  elseif m.grad ~= nil and grad == nil then
    m.absent_from = self.step_count
  end
  e.grad, m.grad = grad, grad
  self.grads_version = self.grads_version + 1
end

-- Whether any member's gradient memory differs from the last overlap check's, noting it.  The same tensor object
-- is the same memory (tensors never change their layout); another object is compared by its byte span.
function Optimizer:_grad_spans_changed()
  local t = self.span_of
  if t == nil then
    t = { tensor = {}, lo = {}, hi = {} }
    self.span_of = t
  end
  local changed = false
  for i, m in ipairs(self.members) do
    local g = m.grad or false
    if g ~= t.tensor[i] then
      local lo, hi = false, false
      if g then lo, hi = byte_span(g) end
      if lo ~= t.lo[i] or hi ~= t.hi[i] or t.tensor[i] == nil then changed = true end
      t.tensor[i], t.lo[i], t.hi[i] = g, lo or false, hi or false
    end
  end
  return changed
end

-- The optimizer steps member m went without a gradient: its own step count is the optimizer's less this.
function Optimizer:_lag(m)
  return m.lag + (m.absent_from and self.step_count - m.absent_from or 0)
end

-- The device scalar that holds step - lag (made between steps, never inside a capture: set_grad, load).
function Optimizer:_lag_scalar(lag)
  if lag == 0 then return nil end
  self.lag_steps = self.lag_steps or {}
  local t = self.lag_steps[lag]
  if t == nil then
    t = ms.zeros({ 1 }, { ctx = self.ctx })
    self.lag_steps[lag] = t
  end
  return t
end

-- The device scalar (and the number) of member m's own step count at step `step`: step_t itself for a
-- member that never lacked a gradient, else a scalar computed from step_t on the device (so a captured step
-- replays with the right value), once per lag and step.
function Optimizer:_step_of(m, step, done)
  local lag = m.lag
  if lag == 0 then return self.step_t, step end
  local t = self:_lag_scalar(lag)
  if not done[lag] then
    tensor.add(self.step_t, -lag, t)
    done[lag] = true
  end
  return t, step - lag
end

-- ctx.rng_key: seed in the low word of the key, route * 8 + k in the high one, route the 0-based place of the
-- route's name among the recipe's, sorted (a recipe's, not a table's order: the same on every rank and run)
local route_places = setmetatable({}, { __mode = "k" })
local function rng_key(recipe, route, seed, k)
  if not core.kinds.integer.test(seed) or seed < 0 or seed >= 2 ^ 32 then
    error(("ctx.rng_key: seed must be an integer in [0, 2^32) (got %s)"):format(tostring(seed)), 3)
  end
  k = k or 0
  if not core.kinds.integer.test(k) or k < 0 or k > 7 then
    error(("ctx.rng_key: stream k must be an integer in [0, 7] (got %s)"):format(tostring(k)), 3)
  end
  if route == nil then error("ctx.rng_key: called outside a route's step", 3) end
  local places = route_places[recipe.routes]
  if not places then
    local names = {}
    for name in pairs(recipe.routes) do names[#names + 1] = name end
    table.sort(names)
    places = {}
    for i, name in ipairs(names) do places[name] = i - 1 end
    route_places[recipe.routes] = places
  end
  return seed + (places[route] * 8 + k) * 2 ^ 32
end
-- the step's context, as recipes see it.  skip_t (the device-side non-finite flag of captured and
-- device-checked steps, nil otherwise) is answered by the metatable, which notes the routes that read it.
local function step_ctx(self, step, lr)
  local report = self.reports
  self.skip_now = nil
  local done = {}
  return setmetatable({
    step = step, lr = lr, lr_t = self.lr_t, step_t = self.step_t, context = self.ctx, device = self.device_name,
    world = { rank = self.world.rank, size = self.world.size },
    report = self.guard and function(key, value)
      -- an untrusted recipe's report reaches the trainer: a function there (or in a table) would run the recipe's
      -- code later, outside the sandbox's limits
      local tv = type(value)
      if type(key) ~= "string" or not (tv == "number" or tv == "string" or tv == "boolean" or ms.is_tensor(value)) then
        error(("ctx.report: an untrusted recipe reports numbers, strings, booleans or tensors under string keys "
               .. "(got %s under a %s key)"):format(tv, type(key)), 2)
      end
      report[key] = value
    end or function(key, value) report[key] = value end,
    -- a member's own step count (device scalar, number): the steps it had a gradient in (bias corrections)
    step_of = function(m) return self:_step_of(m, step, done) end,
    rng_key = function(seed, k) return rng_key(self.recipe, self.running_route, seed, k) end,
  }, self.ctx_mt)
end

-- launches queued on the optimizer's context so far (a reused struct: no table per call)
local mem_stats = ffi.new("ms_mem_stats")
local function launches(h)
  core.check(C.ms_ctx_mem_stats(h, mem_stats))
  return tonumber(mem_stats.launches)
end

-- the groups a step updates (each a view holding only the members that have a gradient) and those members;
-- rebuilt only after set_grad
function Optimizer:_runs()
  if self.runs_version == self.grads_version then return self.runs, self.active end
  -- set_grad checked each gradient against its own parameter; against the others here, when a gradient's
  -- memory moved (a trainer handing over new tensors over the same memory each step pays a compare per member)
  if self:_grad_spans_changed() then
    local given = {}
    for i, m in ipairs(self.members) do given[i] = { name = m.name, param = m.model_param or m.param, grad = m.grad } end
    local ok, err = pcall(check_disjoint, given, 0)
    if not ok then
      self.span_of = nil   -- checked again at the next step, whatever changes before it
      error(err, 0)
    end
  end
  local runs, active = {}, {}
  for _, g in ipairs(self.groups) do
    local n = 0
    for _, m in ipairs(g) do if m.grad and m.stepped ~= false then n = n + 1 end end   -- (stepped: owners)
    if n > 0 then
      local run = g
      if n < #g then
        run = { route = g.route, index = g.index, id = g.id, options = g.options, state = g.state }
        for _, m in ipairs(g) do if m.grad and m.stepped ~= false then run[#run + 1] = m end end
        R.keep(self.guard, run)
      end
      runs[#runs + 1] = run
    end
  end
  for _, m in ipairs(self.members) do if m.grad then active[#active + 1] = m end end
  -- without a route that plans, every run's plan is "step" and so is the step's key (see _plans)
  local plan_free, step_plans = true, {}
  for i, run in ipairs(runs) do
    step_plans[i] = "step"
    if self.recipe.routes[run.route].plan then plan_free = false end
  end
  self.runs, self.active, self.runs_version = runs, active, self.grads_version
  self.step_plans = plan_free and step_plans or nil
  return runs, active
end

-- each run's plan (host policy, outside any capture) and the key of the whole step: the plans of the routes
-- that have a plan() ("step" when none has), and whether the gradients are unscaled (a captured step
-- records that choice)
function Optimizer:_plans(runs, c, scaled)
  local plans, key = {}, nil
  for i, run in ipairs(runs) do
    local r = self.recipe.routes[run.route]
    local p = "step"
    if r.plan then
      self.scalars_written = nil
      p = R.call(self.guard, r.plan, run, run.options, c) or "step"
      key = key and key .. "|" .. tostring(p) or tostring(p)
    end
    plans[i] = p
  end
  key = key or "step"
  if scaled then key = key .. "|unscaled" end
  return plans, key
end

-- every run's step, in an NVTX range "moonstep:<route>"; `rec` (timings) gets an event before each route and
-- one at the end
function Optimizer:_run_routes(runs, plans, c, rec)
  local h = self.ctx_h
  self.scalars_written = nil   -- recipe code runs: every device scalar is written again next step
  local lr, lr_t = c.lr, c.lr_t
  for i, run in ipairs(runs) do
    local r = self.recipe.routes[run.route]
    c.plan = plans[i]
    -- a group with its own lr: lr_t times its ratio, computed on the device (so a captured step replays it)
    local own = self.group_lr[run.id]
    if own then
      tensor.mul(lr_t, own.ratio, own.t)
      c.lr, c.lr_t = lr * own.ratio, own.t
    end
    self.running_route = run.route
    if rec then self:_timing_mark(rec, "route", run.route) end
    C.ms_profile_push(h, self.nvtx[run.route])
    local ok, err = pcall(R.call, self.guard, r.step, run, run.options, c)
    C.ms_profile_pop(h)
    self.running_route = nil
    c.lr, c.lr_t = lr, lr_t
    if not ok then error(err, 0) end
  end
  if rec then self:_timing_mark(rec, nil) end
end

-- Writes this step's lr and step into the device scalars lr_t and step_t (and the unscale factor into the
-- checks' `inv`), on the context's stream before the step's kernels.  A value equal to the one written last
-- is not written again (a launch less per captured replay when the lr is constant): only this module writes
-- these scalars, and recipes read ctx.lr_t / ctx.step_t without writing them (the cache is dropped whenever
-- recipe code ran, all the same).
function Optimizer:_write_scalars(lr, step, inv_t, inv)
  local w = self.scalars_written
  if not w then
    w = {}
    self.scalars_written = w
  end
  if w[self.lr_t] ~= lr then
    w[self.lr_t] = nil
    self.lr_t:fill_(lr)
    w[self.lr_t] = lr
  end
  if w[self.step_t] ~= step then
    w[self.step_t] = nil
    self.step_t:fill_(step)
    w[self.step_t] = step
  end
  if inv_t and w[inv_t] ~= inv then
    w[inv_t] = nil
    inv_t:fill_(inv)
    w[inv_t] = inv
  end
end

-- a call's optional argument table: a misspelt key (grad_scal =) would leave the gradients scaled, silently
local function check_args(what, args, known, level)
  if args == nil then return end
  if type(args) ~= "table" then error(("%s: the arguments must be a table (got %s)"):format(what, type(args)), level + 1) end
  core.check_keys(what, args, known, level + 1, "argument")
end
local STEP_ARGS, REPLAY_ARGS, LOAD_OPTS = { grad_scale = true, grads = true }, { grad_scale = true }, { force = true }

local function check_grad_scale(grad_scale, level)
  if grad_scale ~= nil and (type(grad_scale) ~= "number" or not (grad_scale > 0) or grad_scale == math.huge) then
    error("step: grad_scale must be a positive finite number (got " .. tostring(grad_scale) .. ")", level + 1)
  end
  -- (the gradients are multiplied by 1 / grad_scale: a subnormal scale's inverse is infinite)
  if grad_scale ~= nil and 1 / grad_scale == math.huge then
    error(("step: grad_scale %.17g is too small: its inverse, which unscales the gradients, is infinite"):format(grad_scale),
          level + 1)
  end
end

--- One optimizer step.  args (optional): grad_scale = s (gradients are s times too large: unscaled here),
--- grads = {name = tensor} (this step's gradients, for trainers that pass them per step: afterwards, and after a
--- refused step, each parameter has the gradient it had before; inside a capture of the context's stream they
--- stay, since the graph reads them at every replay).
--- Returns true when the step was applied, false when it was skipped (non-finite gradients), nil when the
--- device decided (captured or device-checked steps: opt:stats() tells).
function Optimizer:step(args)
  local fast = self.fast
  if fast and args == nil then
    self.fast = nil
    if tonumber(C.ms_ctx_is_capturing(self.ctx_h)) == 0 then
      local applied, done = self:_replay(fast)
      if done then return applied end
    end
  end
  check_args("step", args, STEP_ARGS, 2)
  args = args or {}
  local grad_scale = args.grad_scale
  check_grad_scale(grad_scale, 2)
  local cap = tonumber(C.ms_ctx_is_capturing(self.ctx_h))
  if args.grads ~= nil then
    local before = self:_give_grads(args.grads, 3)
    -- recorded into a graph, which reads these gradients at every replay (prepare_replay counts them): they stay
    if cap ~= 0 then return self:_step_in_capture(cap, grad_scale) end
    -- this step's gradients only: afterwards (and after a refused step) each parameter has the one it had
    local ok, applied = pcall(self._step_guarded, self, grad_scale)
    for _, b in pairs(before) do self:set_grad(b.name, b.grad or nil) end
    if not ok then error(applied, 0) end
    return applied
  end
  if cap ~= 0 then return self:_step_in_capture(cap, grad_scale) end
  return self:_step_guarded(grad_scale)
end

-- _step_now; with several ranks, an error on this rank while the routes update (a recipe's error, memory
-- that ran out) gives the communicator up (comm:abort): the other ranks are then in the step's later
-- collectives (SinkGD's exchanges, the owners' broadcasts), and would wait for this rank until the timeout.
-- The checks that every rank fails alike (different gradient sets, learning rates) come before, and keep it.
function Optimizer:_step_guarded(grad_scale)
  if not self.dist then return self:_step_now(grad_scale) end
  self.dist.updating = false
  local ok, res = pcall(self._step_now, self, grad_scale)
  if ok then return res end
  if self.dist.updating and self.comm.abort then
    pcall(self.comm.abort, self.comm, ("rank %d, step %d: %s"):format(self.world.rank, self.step_count + 1, tostring(res)))
  end
  error(res, 0)
end

-- step{grads =}: every gradient checked before any is set (a refused step changes nothing), then set.  Returns
-- what they replaced, {[entry] = {name =, grad = (false: none)}}.  Tied names share one gradient: giving them two
-- is refused, as at registration.
function Optimizer:_give_grads(grads, level)
  if type(grads) ~= "table" then error("step: grads must be a table {name = tensor}", level) end
  local given = {}
  for name, g in pairs(grads) do
    local e = self.by_name[name] or self.by_name[self.aliases[name] or ""]
    if not e then error("step: grads: no parameter named '" .. tostring(name) .. "'", level) end
    self:_check_grad(name, e.param, g, level + 1)
    local other = given[e]
    if other and not same_view(other.grad, g) then
      local a, b = other.name, name
      if b < a then a, b = b, a end
      error(("step: grads: parameters '%s' and '%s' are tied (one tensor) but were given different gradients: a "
             .. "tie has one gradient"):format(a, b), level)
    end
    given[e] = { name = name, grad = g }
  end
  local before = {}
  for e, x in pairs(given) do
    before[e] = { name = x.name, grad = e.grad or false }
    self:set_grad(x.name, x.grad)
  end
  return before
end

-- Unscaling by inv > 1 (grad_scale < 1) enlarges the gradients, in their own dtypes: a gradient whose norm times
-- inv passes its dtype's largest value could overflow (no element is larger than the norm), and its step would
-- be taken on infinities.  Its sum of squares is made infinite, so that the step counts it as non-finite (skip,
-- raise; on every rank) before anything is written.  Conservative: such a norm with every element small enough
-- is refused too (grad_scale < 1 on gradients that large).  The device path does the same on the device.
local DTYPE_MAX = { f32 = 3.4028234663852886e38, f64 = math.huge, bf16 = 3.3895313892515355e38, f16 = 65504 }
local function unscale_overflow(sums, active, inv)
  for i, m in ipairs(active) do
    m.overflow = inv > 1 and math.sqrt(sums[i]) * inv > DTYPE_MAX[m.grad:dtype()] or nil
    if m.overflow then sums[i] = math.huge end
  end
end

-- the step after its arguments were taken: on the device (device_checks, captures) or on the host
function Optimizer:_step_now(grad_scale)
  if self.graphs or self.settings.device_checks then return self:_step_device(grad_scale) end

  local step = self.step_count + 1
  local lr = self:get_lr()
  local launches0 = launches(self.ctx_h)
  self.reports = {}
  local last = { step = step, lr = lr }
  self.last = last
  local rec = self.timing and self:_timing_slot(step)

  -- the gradients this step uses (parameters without one are skipped)
  local runs, active = self:_runs()

  -- one reduction over every gradient: finiteness, the global norm for clipping, the loss-scale check
  local inv = grad_scale and 1 / grad_scale or 1
  local clip = self.settings.clip_grad_norm
  local wanted = self.settings.nonfinite ~= "apply" or clip or inv ~= 1
  local checks = #active > 0 and wanted
  local grads, sums, total = {}, {}, 0
  if checks then
    if rec then self:_timing_mark(rec, "checks") end
    for i, m in ipairs(active) do grads[i] = m.grad end
    sums = ms.foreach_sumsq(grads):tolist_flat()
    unscale_overflow(sums, active, inv)
    for _, v in ipairs(sums) do total = total + v end
  end
  -- several ranks: every one reduces, one without gradients too (nonfinite = "apply" without clipping or loss
  -- scaling reads nothing back, and so checks nothing across the ranks either)
  if self.dist and wanted then total = self:_dist_total(sums, active, step, lr, inv) end
  if checks then
    if total ~= total or total == math.huge then
      if self.settings.nonfinite ~= "apply" then
        local bad = {}
        for i, v in ipairs(sums) do
          if v ~= v or v == math.huge then
            local m = active[i]
            bad[#bad + 1] = m.overflow and ("%s (%s, which 1 / grad_scale = %.17g could take past its largest value)")
                                           :format(m.name, m.grad:dtype(), inv) or m.name
          end
        end
        if #bad == 0 then bad[1] = "the gradients of another rank" end
        if self.settings.nonfinite == "raise" then
          error(("step %d: non-finite gradients in %s"):format(step, table.concat(bad, ", ")), 2)
        end
        self.skipped = self.skipped + 1
        last.skipped, last.nonfinite = true, bad
        last.launches = launches(self.ctx_h) - launches0
        if rec then self:_timing_mark(rec, nil) end
        return false
      end
    end
    local norm = math.sqrt(total) * inv
    last.grad_norm = norm
    local scale = inv
    if clip and norm > clip then scale = scale * clip / (norm + 1e-6) last.clipped = true end
    if scale ~= 1 then ms.foreach_scale(grads, scale) end
  end

  -- device scalars first, so captured kernels read this step's values
  if self.dist then self.dist.updating = true end
  self:_write_scalars(lr, step)
  local before = self.settings.stats and self:_params_before(active)
  local c = step_ctx(self, step, lr)
  local plans = self:_plans(runs, c, false)
  self:_run_routes(runs, plans, c, rec)
  for _, m in ipairs(active) do
    if m.model_param then m.model_param:copy_(m.param) end
  end
  if self.dist then self:_dist_broadcast(active) end
  if before then self:_update_norms(before, last, active) end
  self.step_count = step
  last.skipped = false
  last.reports = self.reports
  last.launches = launches(self.ctx_h) - launches0
  return true
end

function Optimizer:_params_before(active)
  local before = {}
  for _, m in ipairs(active) do before[m] = m.param:clone() end
  return before
end

function Optimizer:_update_norms(before, last, active)
  last.update_norms = {}
  local parts = {}   -- (several ranks) the sharded members' squared norms here, in the order of active
  for _, m in ipairs(active) do
    local norm = (m.param - before[m]):norm()
    if m.shard then parts[#parts + 1] = { m = m, sq = norm * norm } else last.update_norms[m.name] = norm end
  end
  -- a slice's norm is only part of its parameter's: the whole one is the root of the ranks' sum (every rank
  -- has the same sharded members here, in the same order: the step checked it)
  if #parts > 0 then
    local sq = {}
    for i, x in ipairs(parts) do sq[i] = x.sq end
    local r = self.comm:all_reduce(ms.tensor(sq, { dtype = "f64", ctx = self.ctx })):tolist_flat()
    for i, x in ipairs(parts) do last.update_norms[x.m.name] = math.sqrt(r[i]) end
  end
end

-- ---------------------------------------------------------------------------------------------------
-- device-checked and captured steps
-- ---------------------------------------------------------------------------------------------------
-- The tensors of the device-side checks for n gradients, kept across steps (a captured graph writes them).
-- The sum of squares is taken in f64 as the host path does, so the clip factor is the host's to an ulp.
function Optimizer:_checks(n)
  local d = self.checks[n]
  if d then return d end
  local function f64(v) return ms.full({ 1 }, v, { dtype = "f64", ctx = self.ctx }) end
  d = {
    sums = ms.zeros({ n }, { dtype = "f32", ctx = self.ctx }), sums64 = ms.zeros({ n }, { dtype = "f64", ctx = self.ctx }),
    maxes = ms.zeros({ n }, { dtype = "f64", ctx = self.ctx }), over = ms.zeros({ n }, { dtype = "f64", ctx = self.ctx }),
    enlarges = f64(0),
    total = f64(0), nan = f64(0), skip = ms.zeros({ 1 }, { dtype = "f32", ctx = self.ctx }), norm = f64(0),
    inv = f64(1), f = f64(1), gt = f64(0), keep = f64(1), scale = f64(1),
  }
  self.checks[n] = d
  self.skipped_t = self.skipped_t or f64(0)
  return d
end

-- The capture-safe step: non-finite flag, norm and clip factor computed on the device (no host reads), the
-- routes with ctx.skip_t, the master-weight copies.  Returns the checks' tensors (nil when none ran).
function Optimizer:_device_body(runs, active, plans, c, scaled, rec, verify)
  local h, s = self.ctx_h, self.settings
  local clip = s.clip_grad_norm
  local d
  self.skip_now = nil
  if #active > 0 and (s.nonfinite ~= "apply" or clip or scaled) then
    if rec then self:_timing_mark(rec, "checks") end
    d = self:_checks(#active)
    local grads = d.grads_of == active and d.grads or {}
    if d.grads_of ~= active then
      local dtypes = {}
      for i, m in ipairs(active) do grads[i], dtypes[i] = m.grad, m.grad:dtype() end
      d.grads, d.grads_of = grads, active
      -- each gradient's dtype's largest value, written on the device when the dtypes change (fills: no host
      -- buffer to copy from, so a capture may hold them)
      local key = table.concat(dtypes, ",")
      if d.maxes_of ~= key then
        for i, dt in ipairs(dtypes) do d.maxes:slice(0, i - 1, i):fill_(DTYPE_MAX[dt]) end
        d.maxes_of = key
      end
    end
    fused.foreach_sumsq(grads, d.sums)
    d.sums64:copy_(d.sums)
    if self.dist then tensor.mul(d.sums64, self:_dist_mask(d), d.sums64) end   -- each parameter counted once
    if scaled then
      -- unscale_overflow's check with this step's inv: a sum of squares divided by 0 where sqrt(sum) inv could
      -- pass the gradient's dtype's largest value and inv > 1 (Inf, or NaN for 0 / 0: non-finite either way),
      -- by 1 elsewhere (exact)
      core.check(C.ms_unary(h, tensor.handle(d.over), tensor.handle(d.sums64), C.MS_UNARY_SQRT))
      tensor.mul(d.over, d.inv, d.over)
      tensor.gt(d.over, d.maxes, d.over)
      tensor.gt(d.inv, 1, d.enlarges)
      tensor.mul(d.over, d.enlarges, d.over)
      tensor.sub(1, d.over, d.over)
      tensor.div(d.sums64, d.over, d.sums64)
    end
    core.check(C.ms_reduce(h, tensor.handle(d.total), tensor.handle(d.sums64), C.MS_REDUCE_SUM, C.MS_DIM_ALL))
    if self.dist then self.comm:all_reduce(d.total) end
    if s.nonfinite ~= "apply" then
      tensor.mul(d.total, 0, d.nan)                 -- 0 for a finite total, NaN for Inf or NaN
      tensor.ne(d.nan, 0, d.skip)                   -- NaN ~= 0: the skip flag
      tensor.add(self.skipped_t, d.skip, self.skipped_t)
      self.skip_now = d.skip
    end
    core.check(C.ms_unary(h, tensor.handle(d.norm), tensor.handle(d.total), C.MS_UNARY_SQRT))
    if scaled then tensor.mul(d.norm, d.inv, d.norm) end
    if clip then
      -- scale = inv * (norm > clip ? clip / (norm + 1e-6) : 1), selected exactly: keep + gt * f with gt in {0, 1}
      tensor.add(d.norm, 1e-6, d.f)
      tensor.div(clip, d.f, d.f)
      tensor.gt(d.norm, clip, d.gt)
      tensor.sub(1, d.gt, d.keep)
      tensor.addcmul(d.keep, d.f, d.gt, 1, d.scale)
      if scaled then tensor.mul(d.scale, d.inv, d.scale) end
      fused.foreach_scale(grads, d.scale)
    elseif scaled then
      fused.foreach_scale(grads, d.inv)
    end
    if verify and self.skip_now and d.skip:item() ~= 0 then return d, true end
  end
  if self.dist then self.dist.updating = true end   -- (see _step_guarded)
  self:_run_routes(runs, plans, c, rec)
  for _, m in ipairs(active) do
    if m.model_param then m.model_param:copy_(m.param) end
  end
  if self.dist then self:_dist_broadcast(active) end
  if self.skip_now then
    for _, run in ipairs(runs) do
      if not self.skip_readers[run.route] then
        self.skip_refused = run.route
        error(("route '%s' of recipe %s does not read ctx.skip_t, so a step with non-finite gradients cannot be "
               .. "skipped on the device (captured and device-checked steps); its fused steps must take "
               .. "skip = ctx.skip_t, or set settings.nonfinite = 'apply'"):format(run.route, self.recipe.name), 0)
      end
    end
  end
  return d, false
end

-- true when every route of `runs` is known to read ctx.skip_t (or no skip flag is needed)
function Optimizer:_skip_known(runs)
  if self.settings.nonfinite == "apply" then return true end
  for _, run in ipairs(runs) do if not self.skip_readers[run.route] then return false end end
  return true
end

-- what a graph depends on, beyond the optimizer's own tensors: each active member's param and grad
local function tensor_sig(t)
  local p = ffi.cast("uintptr_t", C.ms_tensor_data_ptr(tensor.handle(t)))
  return ("%s %s [%s] strides [%s]"):format(tostring(p):gsub("ULL$", ""), t:dtype(), table.concat(t:shape(), ","),
                                              table.concat(t:strides(), ","))
end

-- the same, as numbers to compare without allocating (a trainer may hand over new gradient tensors each
-- step: each is compared at every replay): data pointer, dtype, ndim, then size and stride per dim
local function tensor_layout(t)
  local h = tensor.handle(t)
  local n = C.ms_tensor_ndim(h)
  local l = { C.ms_tensor_data_ptr(h), C.ms_tensor_dtype(h), n }
  for d = 0, n - 1 do l[4 + 2 * d], l[5 + 2 * d] = C.ms_tensor_size(h, d), C.ms_tensor_stride(h, d) end
  return l
end

local function same_layout(t, l)
  local h = tensor.handle(t)
  local n = C.ms_tensor_ndim(h)
  if C.ms_tensor_data_ptr(h) ~= l[1] or C.ms_tensor_dtype(h) ~= l[2] or n ~= l[3] then return false end
  for d = 0, n - 1 do
    if C.ms_tensor_size(h, d) ~= l[4 + 2 * d] or C.ms_tensor_stride(h, d) ~= l[5 + 2 * d] then return false end
  end
  return true
end

-- A tensor never changes its memory, shape, strides or dtype (no op rebinds them), and a member's param is
-- fixed when the optimizer is made; only set_grad replaces tensors, and it counts grads_version.  So a graph
-- fits its members for certain while grads_version is the one it was checked at (an O(1) test per replay);
-- after a set_grad the members are compared one by one (entry_change).
local function record_members(e, active, version)
  e.members, e.grads, e.params, e.gsig, e.psig, e.glay, e.play, e.lags = {}, {}, {}, {}, {}, {}, {}, {}
  for i, m in ipairs(active) do
    e.members[i], e.grads[i], e.params[i], e.lags[i] = m, m.grad, m.param, m.lag
    e.gsig[i], e.psig[i] = tensor_sig(m.grad), tensor_sig(m.param)
    e.glay[i], e.play[i] = tensor_layout(m.grad), tensor_layout(m.param)
  end
  e.fits_version = version
end

-- nil when the graph of entry e still fits the active members, else why not; a gradient replaced by another
-- tensor over the same memory is adopted
local function entry_change(e, active)
  if #active ~= #e.members then
    return ("%d parameters have gradients, %d did at the capture"):format(#active, #e.members)
  end
  for i, m in ipairs(active) do
    if m ~= e.members[i] then return ("parameter '%s' now has a gradient, '%s' had one at the capture"):format(m.name, e.members[i].name) end
    -- a graph holds each member's steps without a gradient as a constant (its own step count, ctx.step_of)
    if m.lag ~= e.lags[i] then
      return ("parameter '%s' has gone %d steps without a gradient, %d at the capture"):format(m.name, m.lag, e.lags[i])
    end
    local g = m.grad
    if g ~= e.grads[i] then
      if not same_layout(g, e.glay[i]) then
        return ("the gradient of '%s' is %s, it was %s at the capture"):format(m.name, tensor_sig(g), e.gsig[i])
      end
      e.grads[i] = g
    end
    if m.param ~= e.params[i] then
      if not same_layout(m.param, e.play[i]) then
        return ("parameter '%s' is %s, it was %s at the capture"):format(m.name, tensor_sig(m.param), e.psig[i])
      end
      e.params[i] = m.param
    end
  end
  return nil
end
M._entry_change, M._record_members = entry_change, record_members   -- for timing them (specs, benches)

-- entry_change, skipped while no set_grad ran since the graph was last found to fit
local function replay_change(self, e, active)
  if e.fits_version == self.grads_version then return nil end
  local why = entry_change(e, active)
  if why == nil then e.fits_version = self.grads_version end
  return why
end

-- a step with the checks on the device: uncaptured (device_checks, or the first step of a key), captured
-- (the second step of a key), or a replay
--
-- A replay's host work is kept small (issue 7: < 50 us per captured step): no step context or plan table
-- when no route plans, an O(1) fit check while no set_grad ran, a device scalar written only when its value
-- changed, one graph launch.  With opt.host_clock (a function giving microseconds; bench/overhead.lua sets
-- it), last.host_us tells where a step's host time went: prelude (lr, runs, key), scalars, checks (does the
-- graph still fit), launch (the replay, or the whole step when not replayed), total.
function Optimizer:_step_device(grad_scale)
  local clock = self.host_clock
  local t0 = clock and clock()
  local h = self.ctx_h
  local step, lr = self.step_count + 1, self:get_lr()
  local launches0 = launches(h)
  self.reports = {}
  local last = { step = step, lr = lr, device_checks = true }
  self.last = last
  local runs, active = self:_runs()
  local scaled = grad_scale ~= nil
  local c, plans, key
  if self.step_plans then
    plans, key = self.step_plans, scaled and "step|unscaled" or "step"
  else
    c = step_ctx(self, step, lr)
    plans, key = self:_plans(runs, c, scaled)
  end
  local t1 = clock and clock()
  local e = self.graphs and #runs > 0 and self.graphs[key]
  if e and e.graph then
    local why = replay_change(self, e, active)
    if why then
      if self.settings.capture_on_change == "error" then
        error(("step %d: the graph captured for plan '%s' no longer fits: %s (settings.capture_on_change = 'error'; "
               .. "opt:uncapture() or 'recapture')"):format(step, key, why), 2)
      end
      e.graph:free()
      e.graph = nil
      self.recaptures = self.recaptures + 1
      last.recaptured = why
      e = nil             -- this step runs uncaptured; the next one with this key captures again
    end
  end
  local t2 = clock and clock()
  -- a graph adds 1 to step_t itself (its first node), so before a replay the device must hold step - 1, which
  -- the previous replay left there: no write at all while the lr is constant
  local graphed = e and (e.graph or (e.warm and self:_skip_known(runs)))
  local step_w = graphed and step - 1 or step
  if scaled and #active > 0 then
    self:_write_scalars(lr, step_w, self:_checks(#active).inv, 1 / grad_scale)
  else
    self:_write_scalars(lr, step_w)
  end
  local before = self.settings.stats and self:_params_before(active)
  local rec = self.timing and self:_timing_slot(step)
  local t3 = clock and clock()
  if e and e.graph then
    e.used = step
    if rec then self:_timing_mark(rec, "graph") end
    C.ms_profile_push(h, e.nvtx)
    local st = C.ms_graph_launch(h, e.graph.h)
    C.ms_profile_pop(h)
    if self.scalars_written then self.scalars_written[self.step_t] = st == 0 and step or nil end
    core.check(st, 2)
    if rec then self:_timing_mark(rec, nil) end
    last.captured = key
    self.last_checks = e.checks
  elseif graphed then
    -- the second step of this key: its temporaries are in the pool's cache once the collector ran
    if rec then self:_timing_mark(rec, nil) rec = nil end
    c = c or step_ctx(self, step, lr)
    collectgarbage()
    collectgarbage()
    local checks
    local ok, g = pcall(graph.capture, self.ctx, function()
      tensor.add(self.step_t, 1, self.step_t)
      checks = self:_device_body(runs, active, plans, c, scaled)
    end)
    if not ok then
      error(("step %d: capturing plan '%s' failed (the step was not applied; opt:uncapture() runs steps "
             .. "uncaptured): %s"):format(step, key, tostring(g)), 2)
    end
    e.graph, e.checks, e.nvtx, e.used = g, checks, "moonstep:graph:" .. key, step
    self:_bound_graphs(e)
    record_members(e, active, self.grads_version)
    self.captures = self.captures + 1
    C.ms_profile_push(h, e.nvtx)
    local st = C.ms_graph_launch(h, e.graph.h)
    C.ms_profile_pop(h)
    if self.scalars_written then self.scalars_written[self.step_t] = st == 0 and step or nil end
    core.check(st, 2)
    last.captured, last.capture = key, true
    self.last_checks = checks
  else
    -- uncaptured; the first step that needs a route's skip flag reads it back once, so that a route that
    -- ignores ctx.skip_t is found before a non-finite step could reach it
    local verify = not self:_skip_known(runs)
    c = c or step_ctx(self, step, lr)
    local ok, checks, skipped = pcall(self._device_body, self, runs, active, plans, c, scaled, rec, verify)
    if not ok then
      if self.skip_refused then
        -- the step itself was finite and applied (verified); stop capturing and checking on the device
        self.step_count = step
        self:uncapture()
        self.settings.device_checks = false
        self.skip_refused = nil
      end
      error(checks, 0)
    end
    self.last_checks = checks
    if skipped then
      self.step_count = step
      last.skipped = true
      last.launches = launches(h) - launches0
      return false
    end
    self.warm_keys[key] = true
    if self.graphs and #runs > 0 then
      self.graphs[key] = self.graphs[key] or {}
      self.graphs[key].warm = true
    end
  end
  if before then self:_update_norms(before, last, active) end
  self.step_count = step
  last.reports = self.reports
  last.launches = launches(h) - launches0
  -- the next step may be a bare replay of this graph when nothing it depends on can change by itself
  self.fast = last.captured and self.step_plans and not scaled and not rec and not before and e or nil
  if clock then
    local t4 = clock()
    last.host_us = { prelude = t1 - t0, checks = t2 - t1, scalars = t3 - t2, launch = t4 - t3, total = t4 - t0 }
  end
  -- applied for certain when there is no skip flag; otherwise the device decided (stats() reads it)
  if self.settings.nonfinite == "apply" or #active == 0 then
    last.skipped = false
    return true
  end
  return nil
end

-- The bare replay of the previous step's graph (self.fast, set by _step_device when the step's key has no plan
-- and neither timings, stats nor a grad_scale are involved): what a replay in _step_device does, without
-- recomputing what cannot have changed.  Returns (applied, true), or (nil, false) when the full path must run
-- (a set_grad since, the lr or the device's step count not what the graph expects).
function Optimizer:_replay(e)
  local step, lr = self.step_count + 1, self:get_lr()
  local w = self.scalars_written
  if e.graph == nil or e.graph.h == nil or w == nil or w[self.step_t] ~= step - 1 or e.fits_version ~= self.grads_version
     or self.settings.stats or self.timing then
    return nil, false
  end
  local h = self.ctx_h
  local launches0 = launches(h)
  if w[self.lr_t] ~= lr then self:_write_scalars(lr, step - 1) end
  e.used = step
  C.ms_profile_push(h, e.nvtx)
  local st = C.ms_graph_launch(h, e.graph.h)
  C.ms_profile_pop(h)
  w[self.step_t] = st == 0 and step or nil
  core.check(st, 3)
  self.step_count = step
  -- one record for every bare replay (no garbage per step: a collector step inside the call would cost more
  -- than the call); stats() fills in what the device decided
  local last = self.replay_last
  if last == nil then
    last = { device_checks = true, captured = "step", reports = {} }
    self.replay_last = last
  end
  last.step, last.lr, last.launches = step, lr, launches(h) - launches0
  last.skipped, last.grad_norm, last.clipped = nil, nil, nil
  self.reports, self.last, self.last_checks, self.fast = last.reports, last, e.checks, e
  if self.settings.nonfinite == "apply" or #self.active == 0 then
    last.skipped = false
    return true, true
  end
  return nil, true
end

--- For the C embedding (engine/core/embed.c): the graph the next ms_optimizer_step may replay by itself, as a
--- number (its address), or nil.  Only while the lr cannot change by itself (no schedule, or a set lr): C
--- cannot evaluate the schedule.  C reports the steps it replayed with _replayed(n) before any other call.
function Optimizer:_bare_replay_graph()
  local e = self.fast
  if e == nil or e.graph == nil or e.graph.h == nil or self.settings.stats or self.timing then return nil end
  if self.schedule_kind ~= "constant" and self.lr_override == nil then return nil end
  local w = self.scalars_written
  if w == nil or w[self.step_t] ~= self.step_count or w[self.lr_t] ~= self:get_lr() then return nil end
  return tonumber(ffi.cast("uintptr_t", e.graph.h))
end

--- n steps replayed by the C embedding from _bare_replay_graph's graph: the host's step count and the device
--- scalars' cache follow.
function Optimizer:_replayed(n)
  local e = self.fast
  self.step_count = self.step_count + n
  if self.scalars_written then self.scalars_written[self.step_t] = self.step_count end
  self.last = { step = self.step_count, lr = self:get_lr(), device_checks = true, captured = "step", reports = {},
                replayed_by_c = n }
  if e then self.last_checks = e.checks end
end

-- opt:step() while the context's stream is being captured: by a moonstep graph (cap 1) or by its owner (cap 2,
-- joined): the capture-safe step is queued, nothing is written to the device scalars and the host counts no
-- step (opt:prepare_replay() does, before each replay)
function Optimizer:_step_in_capture(cap, grad_scale)
  local s = self.settings
  local where = cap == 2 and "inside a CUDA graph capture of the context's stream by its owner"
                         or "inside a moonstep graph capture"
  if s.nonfinite == "raise" then
    error("step " .. where .. ": settings.nonfinite = 'raise' needs the gradients read back every step; capture with 'skip' or 'apply'", 3)
  end
  if s.stats then error("step " .. where .. ": settings.stats reads update norms back every step; turn it off to capture", 3) end
  local runs, active = self:_runs()
  local scaled = grad_scale ~= nil
  self.reports = {}
  local c = step_ctx(self, self.step_count + 1, self:get_lr())
  local plans, key = self:_plans(runs, c, scaled)
  if not (self.warm_keys[key] and self:_skip_known(runs)) then
    error(("step %s: plan '%s' has not run uncaptured with the checks on the device yet; run opt:step() once "
           .. "before capturing with settings.device_checks = true (or after opt:capture())"):format(where, key), 3)
  end
  local h = self.ctx_h
  if cap == 2 then core.check(C.ms_graph_join(h), 3) end
  local ok, checks = pcall(self._device_body, self, runs, active, plans, c, scaled)
  if cap == 2 then
    local st = C.ms_graph_leave(h)
    if ok then core.check(st, 3) end
  end
  if not ok then error(checks, 0) end
  self.last = { step = self.step_count + 1, lr = c.lr, in_capture = true, reports = self.reports }
  self.last_checks = nil
  return nil
end

--- For a trainer that captured opt:step() into a CUDA graph of its own (inside torch.cuda.graph on the
--- context's stream): writes the next step's learning rate and step number (and 1 / args.grad_scale, when
--- the captured step was given one) into the device scalars that graph reads, and counts the step.  Call it
--- before each replay, outside the capture.
function Optimizer:prepare_replay(args)
  if tonumber(C.ms_ctx_is_capturing(self.ctx_h)) ~= 0 then
    error("prepare_replay: the context's stream is being captured; call it before each replay, outside the capture", 2)
  end
  check_args("prepare_replay", args, REPLAY_ARGS, 2)
  local grad_scale = args and args.grad_scale
  check_grad_scale(grad_scale, 2)
  local step, lr = self.step_count + 1, self:get_lr()
  local _, active = self:_runs()
  if grad_scale and #active > 0 then
    self:_write_scalars(lr, step, self:_checks(#active).inv, 1 / grad_scale)
  else
    self:_write_scalars(lr, step)
  end
  self.step_count = step
  self.last = { step = step, lr = lr, replay = true }
end

--- Captures the following steps into CUDA graphs, one per plan key (see "Captured steps" above).  Errors on a
--- CPU context (MS_E_UNSUPPORTED) and with settings.nonfinite = "raise".
function Optimizer:capture()
  local st = tonumber(C.ms_ctx_device_type(self.ctx_h)) == C.MS_DEVICE_CUDA and 0 or C.ms_graph_begin(self.ctx_h)
  if st ~= 0 then
    local _, err = pcall(core.raise, st, 1)
    error("capture: the optimizer runs on " .. self.ctx:name() .. ", which cannot capture graphs: " .. tostring(err), 2)
  end
  if self.settings.nonfinite == "raise" then
    error("capture: settings.nonfinite = 'raise' needs the gradients read back every step; captured steps "
          .. "support 'skip' and 'apply'", 2)
  end
  self.graphs = self.graphs or {}
  return self
end

-- At most settings.max_graphs captured graphs: past it, the one replayed longest ago (not `keep`, just made) is
-- freed and its key forgotten, so that it runs uncaptured, then captures again, if it comes back.
function Optimizer:_bound_graphs(keep)
  local n, oldest, oldest_key = 0, nil, nil
  for key, e in pairs(self.graphs) do
    if e.graph then
      n = n + 1
      if e ~= keep and (oldest == nil or e.used < oldest.used) then oldest, oldest_key = e, key end
    end
  end
  if n > self.settings.max_graphs and oldest then
    oldest.graph:free()
    self.graphs[oldest_key] = nil
    self.evictions = self.evictions + 1
  end
end

--- Frees the captured graphs; the following steps run uncaptured.  Idempotent.
function Optimizer:uncapture()
  self.fast = nil
  for _, e in pairs(self.graphs or {}) do
    if e.graph then e.graph:free() end
  end
  self.graphs = nil
  return self
end

-- ---------------------------------------------------------------------------------------------------
-- timings: a ring of per-step event records, read lazily (stats(), or when a slot comes round again: a
-- step waits only when the device is TIMING_SLOTS steps behind the host).  A captured step has one interval,
-- the replay ("graph"): events cannot be recorded inside a graph, so its routes are not timed one by one.
-- ---------------------------------------------------------------------------------------------------
local TIMING_SLOTS = 32
local out_event = ffi.new("ms_event *[1]")
local elapsed_ms = ffi.new("double[1]")

local function accumulate(acc, ms_value)
  acc.steps = acc.steps + 1
  acc.total_ms = acc.total_ms + ms_value
  acc.last_ms = ms_value
  acc.min_ms = math.min(acc.min_ms, ms_value)
  acc.max_ms = math.max(acc.max_ms, ms_value)
  acc.mean_ms = acc.total_ms / acc.steps
end
local function new_acc() return { steps = 0, total_ms = 0, min_ms = math.huge, max_ms = 0, mean_ms = 0 } end

function Optimizer:_timing_slot(step)
  local t = self.timing
  if t.step == nil then t.step, t.routes, t.checks, t.graph = new_acc(), {}, new_acc(), new_acc() end
  t.next = t.next % TIMING_SLOTS + 1
  local rec = t.ring[t.next]
  if rec == nil then
    rec = { ev = {}, kind = {}, label = {} }
    t.ring[t.next] = rec
  elseif rec.pending then
    self:_timing_read(rec)
  end
  rec.step, rec.n, rec.pending = step, 0, true
  return rec
end

-- records the next event of rec; kind/label name the interval that starts there (nil: the step's end)
function Optimizer:_timing_mark(rec, kind, label)
  local k = rec.n + 1
  local ev = rec.ev[k]
  if ev == nil then
    core.check(C.ms_event_new(self.ctx_h, out_event))
    ev = ffi.gc(out_event[0], C.ms_event_free)
    rec.ev[k] = ev
  end
  core.check(C.ms_event_record(self.ctx_h, ev))
  rec.kind[k], rec.label[k], rec.n = kind, label, k
end

-- reads a pending record (waits for its last event)
function Optimizer:_timing_read(rec)
  rec.pending = false
  if rec.n < 2 then return end
  local t = self.timing
  local function span(a, b)
    core.check(C.ms_event_elapsed(rec.ev[a], rec.ev[b], elapsed_ms))
    return elapsed_ms[0]
  end
  local step_ms = span(1, rec.n)
  local routes, checks, graph_ms = {}, nil, nil
  for k = 1, rec.n - 1 do
    local v = span(k, k + 1)
    if rec.kind[k] == "route" then routes[rec.label[k]] = (routes[rec.label[k]] or 0) + v
    elseif rec.kind[k] == "checks" then checks = v
    elseif rec.kind[k] == "graph" then graph_ms = v end
  end
  accumulate(t.step, step_ms)
  for route, v in pairs(routes) do
    t.routes[route] = t.routes[route] or new_acc()
    accumulate(t.routes[route], v)
  end
  if checks then accumulate(t.checks, checks) end
  if graph_ms then accumulate(t.graph, graph_ms) end
  t.latest = { step = rec.step, step_ms = step_ms, routes = routes, checks_ms = checks, graph_ms = graph_ms }
end

-- reads every pending record, oldest first
function Optimizer:_timing_drain()
  local t = self.timing
  for i = 1, TIMING_SLOTS do
    local rec = t.ring[(t.next + i - 1) % TIMING_SLOTS + 1]
    if rec and rec.pending then self:_timing_read(rec) end
  end
end

-- ---------------------------------------------------------------------------------------------------
-- introspection
-- ---------------------------------------------------------------------------------------------------
local function state_bytes(state)
  local n = 0
  for _, v in pairs(state) do
    if ms.is_tensor(v) then
      local sz = ({ f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, u8 = 1 })[v:dtype()]
      n = n + v:numel() * sz
    elseif type(v) == "table" then
      n = n + state_bytes(v)
    end
  end
  return n
end

--- Routing and state sizes: returns data {params = {...}, groups = {...}, total_state_bytes} and a
--- readable table as the second value.
function Optimizer:info()
  local data = { recipe = self.recipe.name, params = {}, groups = {}, total_state_bytes = 0 }
  for _, g in ipairs(self.groups) do
    local gb = state_bytes(g.state)
    local names = {}
    for _, m in ipairs(g) do
      local b = state_bytes(m.state) + (m.master and m.master:numel() * 4 or 0)
      data.params[#data.params + 1] = {
        name = m.name, route = g.route, group = g.id, shape = m.info.shape, dtype = m.info.dtype,
        state_bytes = b, master_weights = m.master ~= nil, owner = m.owner, shard = m.info.shard,
      }
      data.total_state_bytes = data.total_state_bytes + b
      names[#names + 1] = m.name
    end
    data.total_state_bytes = data.total_state_bytes + gb
    data.groups[#data.groups + 1] = { id = g.id, route = g.route, params = names, overrides = g.overrides, state_bytes = gb }
  end
  for alias, target in pairs(self.aliases) do
    data.params[#data.params + 1] = { name = alias, tied_to = target, route = self.by_name[target].group.route, state_bytes = 0 }
  end
  local lines = { ("%-40s %-10s %-12s %-6s %12s"):format("parameter", "route", "shape", "dtype", "state bytes") }
  for _, p in ipairs(data.params) do
    lines[#lines + 1] = ("%-40s %-10s %-12s %-6s %12d%s"):format(p.name, p.route,
      p.shape and table.concat(p.shape, "x") or "", p.dtype or "", p.state_bytes,
      p.tied_to and ("  (tied to " .. p.tied_to .. ")") or (p.master_weights and "  (+ f32 master)" or ""))
  end
  lines[#lines + 1] = ("%-40s %-10s %-12s %-6s %12d"):format("total", "", "", "", data.total_state_bytes)
  return data, table.concat(lines, "\n")
end

-- steps skipped so far: counted on the host, and on the device by captured and device-checked steps (a read)
function Optimizer:_skipped_total()
  return self.skipped + (self.skipped_t and self.skipped_t:item() or 0)
end

--- Counters and the last step's numbers: skipped steps, grad norm, launches, update norms, recipe reports;
--- with settings.timings, milliseconds per route (timings.routes[route]: steps, total_ms, mean_ms, last_ms,
--- min_ms, max_ms), per step, for the checks and for graph replays; after opt:capture(), the graphs.
--- After a captured or device-checked step this waits for the device, to read the step's flags (last.skipped,
--- grad_norm, clipped) and the skip count; inside a capture of the context's stream it reads nothing.
function Optimizer:stats()
  local last = self.last
  local s = { step = self.step_count, skipped_steps = self.skipped, lr = self:get_lr(), last = last,
              captured = self.graphs ~= nil }
  if tonumber(C.ms_ctx_is_capturing(self.ctx_h)) ~= 0 then return s end
  s.skipped_steps = self:_skipped_total()
  local d = self.last_checks
  if last.device_checks and d and last.skipped == nil then
    last.skipped = self.settings.nonfinite ~= "apply" and d.skip:item() ~= 0
    if not last.skipped then
      last.grad_norm = d.norm:item()
      if self.settings.clip_grad_norm and d.gt:item() ~= 0 then last.clipped = true end
    end
  end
  if self.timing and self.timing.step then
    self:_timing_drain()
    local t = self.timing
    s.timings = { step = t.step, routes = t.routes }
    if t.checks.steps > 0 then s.timings.checks = t.checks end
    if t.graph.steps > 0 then s.timings.graph = t.graph end
    if t.latest and t.latest.step == last.step then last.timings = t.latest end
  end
  if self.graphs then
    s.graphs = {}
    for key, e in pairs(self.graphs) do if e.graph then s.graphs[key] = e.graph:num_nodes() end end
    s.captures, s.recaptures, s.evictions = self.captures, self.recaptures, self.evictions
  end
  return s
end

-- ---------------------------------------------------------------------------------------------------
-- checkpoints
-- ---------------------------------------------------------------------------------------------------
-- walks a state table: tensors by name, other values (numbers, strings, booleans) into `scalars`
local function flatten_state(prefix, state, tensors, scalars)
  for k, v in pairs(state) do
    local name = prefix .. "/" .. tostring(k)
    if ms.is_tensor(v) then tensors[name] = v
    elseif type(v) == "table" then flatten_state(name, v, tensors, scalars)
    elseif type(v) == "number" or type(v) == "string" or type(v) == "boolean" then scalars[name] = v
    else error(("state %s holds a %s, which a checkpoint cannot keep"):format(name, type(v)), 0) end
  end
end

function Optimizer:_state_entries()
  local tensors, scalars, groups = {}, {}, {}
  for _, g in ipairs(self.groups) do
    local names = {}
    for _, m in ipairs(g) do
      flatten_state("param/" .. m.name, m.state, tensors, scalars)
      if m.master then tensors["param/" .. m.name .. "/master"] = m.master end
      names[#names + 1] = m.name
    end
    flatten_state("group/" .. g.id, g.state, tensors, scalars)
    groups[g.id] = names
  end
  return tensors, scalars, groups
end

--- How state tensor t of a sharded member m lies across the ranks (key: its path in m.state, or "master"):
--- {axis =, lo =, hi =, total =}, this rank's range [lo, hi) of t's dim `axis` (0-based) of the whole
--- tensor's `total`; nil when every rank holds the same whole tensor.  The route's state_shard(m, key, options)
--- -> axis [, num, den] says (dim `axis` holds num / den elements per row or column of the shard's dim; false:
--- not split); without it, or when it gives nil, a tensor shaped like the slice is split as the slice is.
function Optimizer:_state_split(m, key, t)
  local s = m.shard
  if not s then return nil end
  local axis, num, den
  local hook = key ~= "master" and self.recipe.routes[m.route].state_shard
  if type(hook) == "function" then axis, num, den = R.call(self.guard, hook, m, key, self.by_name[m.name].group.options) end
  if axis == false then return nil end
  if axis == nil then
    if not same_shape(t, m.param) then return nil end
    axis = s.axis
  end
  num, den = num or 1, den or 1
  local lo, hi, total = s.offset * num / den, (s.offset + s.len) * num / den, s.size * num / den
  if not (is_integer(axis) and axis >= 0 and axis < t:dim() and is_integer(lo) and is_integer(hi) and is_integer(total)
          and t:size(axis) == hi - lo) then
    error(("%s: state '%s' of parameter '%s' (%s) does not follow its shard: dim %s holding %s / %s per %s of [%d, %d)")
          :format(self.recipe.name, key, m.name, shape_str(t), tostring(axis), tostring(num), tostring(den), s.dim,
                  s.offset, s.offset + s.len), 0)
  end
  return { axis = axis, lo = lo, hi = hi, total = total }
end

-- Where this rank's state sits in the world, for checkpoints: splits (state tensor name -> _state_split of a
-- sharded member's state), slots (name -> the block behind each dim-0 slot of a group's stacked state, from
-- the route's slots(group, options): what lets stacks of other parameter sets load block by block), parts
-- (parameter name -> {owner =} or {shard =}).
function Optimizer:_layout()
  local splits, slots, parts = {}, {}, {}
  for _, g in ipairs(self.groups) do
    for _, m in ipairs(g) do
      local s = m.shard
      if s then
        parts[m.name] = { shard = { dim = s.dim, offset = s.offset, size = s.size } }
        local function walk(prefix, key, state)
          for k, v in pairs(state) do
            local path = key and key .. "/" .. tostring(k) or tostring(k)
            if ms.is_tensor(v) then splits[prefix .. path] = self:_state_split(m, path, v)
            elseif type(v) == "table" then walk(prefix, path, v) end
          end
        end
        walk("param/" .. m.name .. "/", nil, m.state)
        if m.master then splits["param/" .. m.name .. "/master"] = self:_state_split(m, "master", m.master) end
      elseif m.owner then
        parts[m.name] = { owner = m.owner }
      end
    end
    local hook = self.recipe.routes[g.route].slots
    local view = g.view == nil and g or g.view
    if type(hook) == "function" and view then
      local map = R.call(self.guard, hook, view, g.options)
      for rel, ids in pairs(type(map) == "table" and map or {}) do slots["group/" .. g.id .. "/" .. rel] = ids end
    end
  end
  return splits, slots, parts
end

-- the members' nonzero lags by name (checkpoints), nil when none
function Optimizer:_lags()
  local out
  for _, m in ipairs(self.members) do
    local lag = self:_lag(m)
    if lag ~= 0 then
      out = out or {}
      out[m.name] = lag
    end
  end
  return out
end

local function part_path(path, rank, world) return ("%s.rank%d-of-%d"):format(path, rank, world) end

-- a flag set on any rank, summed over the ranks (a barrier that also tells who failed)
function Optimizer:_dist_flag(set)
  local t = self.dist.total_t
  t:fill_(set and 1 or 0)
  self.comm:all_reduce(t)
  return t:item()
end

--- Writes the optimizer's state to a safetensors file (atomically).  With several ranks: each rank's part
--- to path .. ".rank<r>-of-<N>", then (once every part is written) the index, from rank 0, to path.
function Optimizer:save(path)
  if not self.dist then
    local tensors, meta = self:_save_contents()
    ms.save(path, tensors, { moonstep = json.encode(meta) })
    return
  end
  -- with several ranks an error while this rank gathers its state (a route's state_shard hook, a state
  -- tensor that does not follow its shard) is told to the others in the flag below, as a write's failure is:
  -- raised here alone, it left them waiting in that all-reduce until the communicator's timeout
  local world, rank = self.world.size, self.world.rank
  local part = part_path(path, rank, world)
  -- each part is written beside its place first, and moved there once every rank has written its own: a part
  -- that one rank cannot write leaves the checkpoint already at path whole (written in place, the others'
  -- parts of the new step replaced theirs, and the old index pointed at parts of two steps)
  local staged = part .. ".partial"
  local ok, tensors, meta = pcall(self._save_contents, self)
  local err = not ok and tostring(tensors) or nil
  if ok then
    local wrote, why = pcall(function() ms.save(staged, tensors, { moonstep = json.encode(meta) }) end)
    if not wrote then ok, err = false, ("save: %s: %s"):format(part, tostring(why)) end
  end
  local failed = self:_dist_flag(not ok)
  if not ok or failed > 0 then os.remove(staged) end
  if not ok then error(err, 0) end
  if failed > 0 then
    error(("save: %d of the %d ranks could not write their part of %s (their errors say why); the checkpoint there "
           .. "is unchanged"):format(failed, world, path), 2)
  end
  local moved, why = os.rename(staged, part)
  if self:_dist_flag(not moved) > 0 then
    if not moved then os.remove(staged) end
    error(("save: %s: %s"):format(part, moved and ("a rank could not move its part of " .. path .. " into place")
          or ("cannot move " .. staged .. " into place: " .. tostring(why))), 2)
  end
  if rank == 0 then
    local names = {}
    for r = 0, world - 1 do names[r + 1] = part_path(path, r, world):match("[^/]*$") end
    local index = {}
    for _, k in ipairs { "moonstep", "schema", "recipe", "options", "step", "skipped", "lr_override", "schedule", "rng",
                         "lags" } do
      index[k] = meta[k]
    end
    index.world, index.parts = world, names
    ok, err = pcall(ms.save, path, {}, { moonstep = json.encode(index) })
  end
  if self:_dist_flag(not ok) > 0 then
    error(("save: %s: %s"):format(path, rank == 0 and tostring(err) or "rank 0 could not write the index"), 2)
  end
end

-- what save writes to this rank's file: its state tensors and the metadata
function Optimizer:_save_contents()
  local tensors, scalars, groups = self:_state_entries()
  local splits, slots, parts = self:_layout()
  -- JSON has no infinities or NaN: such state numbers go to `nonfinite` by name, as "inf", "-inf" or "nan"
  local nonfinite
  for name, v in pairs(scalars) do
    if type(v) == "number" and not (v > -math.huge and v < math.huge) then
      nonfinite = nonfinite or {}
      nonfinite[name] = v ~= v and "nan" or (v > 0 and "inf" or "-inf")
      scalars[name] = nil
    end
  end
  local meta = {
    moonstep = ms.version, schema = M.SCHEMA,
    recipe = { name = self.recipe.name, version = self.recipe.version or 0, hash = self.recipe_hash },
    options = self.options, step = self.step_count, skipped = self:_skipped_total(), lr_override = self.lr_override,
    schedule = self.schedule_kind, rng = ms.rng_state(), scalars = scalars, nonfinite = nonfinite, groups = groups,
    slots = next(slots) and slots or nil, lags = self:_lags(),
  }
  if self.dist then
    meta.world, meta.rank, meta.params, meta.split = self.world.size, self.world.rank, parts, next(splits) and splits or nil
  end
  return tensors, meta
end

-- a checkpoint file's metadata, checked
local function file_meta(file, filemeta)
  if not filemeta.moonstep then error(file .. ": not a moonstep optimizer checkpoint (no 'moonstep' metadata)", 0) end
  local ok, meta = pcall(json.decode, filemeta.moonstep)
  if not ok or type(meta) ~= "table" then error(file .. ": corrupt checkpoint metadata: " .. tostring(meta), 0) end
  if meta.schema ~= M.SCHEMA then
    error(("%s: checkpoint schema %s, this moonstep reads schema %d"):format(file, tostring(meta.schema), M.SCHEMA), 0)
  end
  -- the tables load() walks: of the wrong kind, they would fail as a bare Lua error (or, a split out of its
  -- range, copy the wrong rows without a word)
  local function corrupt(what) error(("%s: corrupt checkpoint metadata: %s"):format(file, what), 0) end
  for _, k in ipairs { "recipe", "scalars", "nonfinite", "slots", "split", "groups" } do
    if meta[k] ~= nil and type(meta[k]) ~= "table" then corrupt(("'%s' is a %s, not an object"):format(k, type(meta[k]))) end
  end
  for name, ids in pairs(meta.slots or {}) do
    if type(ids) ~= "table" then corrupt(("the slots of '%s' are not a list"):format(tostring(name))) end
  end
  for name, sp in pairs(meta.split or {}) do
    local good = type(sp) == "table" and is_integer(sp.axis) and sp.axis >= 0 and is_integer(sp.total)
    good = good and is_integer(sp.lo) and is_integer(sp.hi) and 0 <= sp.lo and sp.lo <= sp.hi and sp.hi <= sp.total
    if not good then
      corrupt(("the split of '%s' is not {axis =, lo =, hi =, total =} with 0 <= lo <= hi <= total"):format(tostring(name)))
    end
  end
  return meta
end

-- the checkpoint at path: one file, or an index and its parts -> files {{path =, tensors =, meta =}, ...} and
-- the checkpoint's metadata (the file's, or the index's)
local function read_checkpoint(path, device)
  local loaded, filemeta = ms.load(path, { device = device })
  local meta = file_meta(path, filemeta)
  if meta.parts == nil then return { { path = path, tensors = loaded, meta = meta } }, meta end
  local world = meta.world
  if not is_integer(world) or world < 1 or type(meta.parts) ~= "table" or #meta.parts ~= world then
    error(path .. ": corrupt checkpoint index (its parts do not match its world size)", 0)
  end
  local dir, files = path:match("^(.*/)") or "", {}
  for r, name in ipairs(meta.parts) do
    -- a part lies beside its index, named as save() names it: an index must not send the load to any other file
    local suffix = (".rank%d-of-%d"):format(r - 1, world)
    if type(name) ~= "string" or name:find("/", 1, true) or #name <= #suffix or name:sub(-#suffix) ~= suffix then
      error(("%s: corrupt checkpoint index: part %d is %s, not a file name ending in %s beside the index"):format(path,
            r - 1, type(name) == "string" and ("%q"):format(name) or type(name), suffix), 0)
    end
    local file = dir .. name
    local ok, tensors, fm = pcall(ms.load, file, { device = "cpu" })
    if not ok then
      error(("%s: part %d of %d of the checkpoint %s cannot be read: %s"):format(file, r - 1, world, path, tostring(tensors)), 0)
    end
    local pm = file_meta(file, fm)
    local pr, ir = pm.recipe or {}, meta.recipe or {}
    if pr.name ~= ir.name or pr.hash ~= ir.hash then
      error(("%s: part %d of %d of the checkpoint %s is of recipe '%s' (hash %s), the index of '%s' (hash %s): a part of "
             .. "another checkpoint?"):format(file, r - 1, world, path, tostring(pr.name), tostring(pr.hash),
             tostring(ir.name), tostring(ir.hash)), 0)
    end
    if pm.rank ~= r - 1 or pm.world ~= world or pm.step ~= meta.step then
      error(("%s: not part %d of %d of the checkpoint %s at step %s (it is part %s of %s, at step %s)"):format(file, r - 1,
            world, path, tostring(meta.step), tostring(pm.rank), tostring(pm.world), tostring(pm.step)), 0)
    end
    files[r] = { path = file, tensors = tensors, meta = pm }
  end
  return files, meta
end

-- The copies that fill state tensor t (its name) from the checkpoint's files (checked, nothing copied yet):
-- by slot (stacked group state whose blocks both sides name), by range along a split dim (sharded state,
-- split here or in the files), or whole from the first file that has it.  exact: every block of the files
-- must have its place here (one rank to one rank, not forced).
local function plan_copies(path, name, t, files, split, slot_ids, copies, exact)
  local holders = {}
  for _, f in ipairs(files) do if f.tensors[name] then holders[#holders + 1] = f end end
  if #holders == 0 then error(("%s: tensor '%s' is missing from the checkpoint"):format(path, name), 0) end
  local function mismatch(f, src, why)
    error(("%s: tensor '%s' is %s %s in the checkpoint but %s %s here%s"):format(f.path, name, src:dtype(), shape_str(src),
          t:dtype(), shape_str(t), why or ""), 0)
  end
  local slotted = false
  for _, f in ipairs(holders) do slotted = slotted or (f.meta.slots ~= nil and f.meta.slots[name] ~= nil) end
  if slot_ids and slotted then
    if #slot_ids ~= t:size(0) then
      error(("%s: the recipe names %d slots for '%s', which has %d"):format(path, #slot_ids, name, t:size(0)), 0)
    end
    local where = {}
    for _, f in ipairs(holders) do
      local ids, src = f.meta.slots and f.meta.slots[name], f.tensors[name]
      if ids then
        if src:dtype() ~= t:dtype() then mismatch(f, src) end
        if src:dim() < 1 or #ids ~= src:size(0) then
          error(("%s: tensor '%s' has %s slots but its metadata names %d blocks"):format(f.path, name,
                src:dim() > 0 and src:size(0) or 0, #ids), 0)
        end
        for row, id in ipairs(ids) do where[id] = where[id] or { f = f, row = row - 1 } end
      end
    end
    local k, n = 0, #slot_ids
    while k < n do                                   -- runs of slots from consecutive rows of one file: one copy
      local w = where[slot_ids[k + 1]]
      if not w then error(("%s: block '%s' of '%s' is missing from the checkpoint"):format(path, tostring(slot_ids[k + 1]), name), 0) end
      local len = 1
      while k + len < n do
        local w2 = where[slot_ids[k + len + 1]]
        if not (w2 and w2.f == w.f and w2.row == w.row + len) then break end
        len = len + 1
      end
      local src, dst = w.f.tensors[name]:slice(0, w.row, w.row + len), t:slice(0, k, k + len)
      if not same_shape(src, dst) then mismatch(w.f, w.f.tensors[name], (" (block '%s')"):format(slot_ids[k + 1])) end
      copies[#copies + 1] = { dst, src }
      k = k + len
    end
    if exact then
      local here = {}
      for _, id in ipairs(slot_ids) do here[id] = true end
      for id, w in pairs(where) do
        if not here[id] then error(("%s: block '%s' of '%s' in the checkpoint has no place in this optimizer"):format(w.f.path, id, name), 0) end
      end
    end
    return
  end
  local axis, total
  if split then axis, total = split.axis, split.total end
  for _, f in ipairs(holders) do
    local fs = f.meta.split and f.meta.split[name]
    if fs and not axis then axis, total = fs.axis, fs.total end
  end
  if axis then
    local lo, hi = 0, total
    if split then lo, hi = split.lo, split.hi elseif t:dim() <= axis or t:size(axis) ~= total then
      mismatch(holders[1], holders[1].tensors[name], (" (the checkpoint's slices join to %d along dim %d)"):format(total, axis))
    end
    -- a tensor that every rank held whole (a rows-sharded matrix's u, cut here by columns) is in every part,
    -- the same: one copy covers the range (each counted, they overlapped)
    local from = holders
    for _, f in ipairs(holders) do
      if not (f.meta.split and f.meta.split[name]) then from = { f } break end
    end
    local covered, pieces = 0, {}
    for _, f in ipairs(from) do
      local src, fs = f.tensors[name], f.meta.split and f.meta.split[name]
      local flo, fhi = 0, total
      if fs then flo, fhi = fs.lo, fs.hi end
      local fits = src:dtype() == t:dtype() and src:dim() == t:dim() and (fs == nil or (fs.axis == axis and fs.total == total))
                   and src:size(axis) == fhi - flo
      for d = 0, t:dim() - 1 do if fits and d ~= axis and src:size(d) ~= t:size(d) then fits = false end end
      if not fits then
        mismatch(f, src, (" ([%d, %d) of %d along dim %d here, [%d, %d) there)"):format(lo, hi, total, axis, flo, fhi))
      end
      local a, b = math.max(lo, flo), math.min(hi, fhi)
      if b > a then
        copies[#copies + 1] = { t:slice(axis, a - lo, b - lo), src:slice(axis, a - flo, b - flo) }
        covered = covered + (b - a)
        pieces[#pieces + 1] = { a, b, f.path }
      end
    end
    -- slices that overlap could add up to the range and leave a hole: each row must come from one file
    table.sort(pieces, function(x, y) return x[1] < y[1] end)
    for i = 2, #pieces do
      if pieces[i][1] < pieces[i - 1][2] then
        error(("%s: the slices of '%s' in %s and %s overlap: [%d, %d) and [%d, %d) along dim %d"):format(path, name,
              pieces[i - 1][3], pieces[i][3], pieces[i - 1][1], pieces[i - 1][2], pieces[i][1], pieces[i][2], axis), 0)
      end
    end
    if covered ~= hi - lo then
      error(("%s: the slices of '%s' in the checkpoint cover %d of [%d, %d) along dim %d"):format(path, name, covered, lo, hi, axis), 0)
    end
    return
  end
  local f = holders[1]
  local src = f.tensors[name]
  if src:dtype() ~= t:dtype() or not same_shape(src, t) then mismatch(f, src) end
  copies[#copies + 1] = { t, src }
end

-- a checkpoint tensor's place here: its own, or (state moving between ranks) a parameter or group of this optimizer
function Optimizer:_has_place(name, tensors)
  if tensors[name] then return true end
  local kind, rest = name:match("^(%a+)/(.*)$")
  if kind == "param" then
    local pos = 1
    while true do
      local i = rest:find("/", pos, true)
      if not i then return false end
      if self.by_name[rest:sub(1, i - 1)] then return true end
      pos = i + 1
    end
  elseif kind == "group" then
    for _, g in ipairs(self.groups) do if rest:sub(1, #g.id + 1) == g.id .. "/" then return true end end
  end
  return false
end

-- writes value v into the state tables, at the path of a scalar's checkpoint name
function Optimizer:_set_scalar(path_name, v)
  local kind, rest = path_name:match("^(%a+)/(.*)$")
  local root
  if kind == "param" then
    for _, m in ipairs(self.members) do
      if rest:sub(1, #m.name + 1) == m.name .. "/" then root, rest = m.state, rest:sub(#m.name + 2) break end
    end
  else
    for _, g in ipairs(self.groups) do
      if rest:sub(1, #g.id + 1) == g.id .. "/" then root, rest = g.state, rest:sub(#g.id + 2) break end
    end
  end
  local keys = {}
  for k in rest:gmatch("[^/]+") do keys[#keys + 1] = k end
  for i = 1, #keys - 1 do root = root[keys[i]] or root[tonumber(keys[i])] end
  local last = keys[#keys]
  if root[last] == nil and tonumber(last) then last = tonumber(last) end
  root[last] = v
end

--- Restores a checkpoint written by save() into this optimizer (created with the same recipe and
--- parameters), from any world size: see "Several ranks".  opts.force = true accepts a checkpoint of another
--- recipe (or recipe version).  With several ranks every rank checks its part and then they agree: when
--- any rank cannot load, none does (each rank raises), so that no rank goes on from the checkpoint while
--- another goes on from its own state.
function Optimizer:load(path, opts)
  if not self.dist then return self:_load_apply(self:_load_plan(path, opts, 3)) end
  -- the checks differ by rank (its slices, the state of the parameters it owns): all of them before the vote
  local ok, plan = pcall(self._load_plan, self, path, opts, 4)
  -- the vote also compares the step each rank would go on from (k and k^2 summed, as _dist_total does): ranks
  -- given different checkpoints (a stale copy on one host) would otherwise each load their own, silently
  local k = ok and name_key(("%d/%s"):format(plan.meta.step, tostring(plan.meta.lr_override))) % 1048576 or 0
  local t = self.comm:all_reduce(ms.tensor({ ok and 0 or 1, k, k * k }, { dtype = "f64", ctx = self.ctx }))
  local r, n = t:tolist_flat(), self.world.size
  if not ok then error(plan, 0) end
  if r[1] > 0 then
    error(("load: %s: %d of the %d ranks cannot load it (their errors say why); nothing was loaded"):format(path,
          r[1], self.world.size), 2)
  end
  if n * r[3] ~= r[2] * r[2] then
    error(("load: %s: the ranks load checkpoints of different steps or learning rates (this rank's: step %d); every "
           .. "rank must load the same checkpoint; nothing was loaded"):format(path, plan.meta.step), 2)
  end
  return self:_load_apply(plan)
end

-- the state numbers JSON cannot hold, as save() names them in the metadata's `nonfinite`
local NONFINITE = { inf = math.huge, ["-inf"] = -math.huge, nan = 0 / 0 }

-- load's checks (errors at `level`): what it will copy and set, nothing changed yet
function Optimizer:_load_plan(path, opts, level)
  check_args("load", opts, LOAD_OPTS, level)
  -- (force = "false" is true to Lua: it would load another recipe's checkpoint)
  if opts and opts.force ~= nil then core.check_value("load", "force", opts.force, "boolean", level) end
  local force = opts and opts.force
  if type(path) ~= "string" then error("load: path must be a string", level) end
  local files, meta = read_checkpoint(path, self.dist and "cpu" or self.ctx)
  local rec = meta.recipe or {}
  if not force and (rec.name ~= self.recipe.name or rec.hash ~= self.recipe_hash) then
    error(("%s: checkpoint of recipe '%s' (hash %s), this optimizer runs '%s' (hash %s); pass {force = true} to load it anyway")
          :format(path, tostring(rec.name), tostring(rec.hash), self.recipe.name, self.recipe_hash), level)
  end
  -- the metadata that load() writes into the optimizer (and the global generator) after the copies: checked
  -- here, with everything else, so that a corrupt file changes nothing
  -- (past 2^53 a double's step + 1 is the step again: the count would stop advancing, silently)
  if not (is_integer(meta.step) and meta.step >= 0 and meta.step < 2 ^ 53) then
    error(("%s: checkpoint step %s is not an integer in [0, 2^53)"):format(path, tostring(meta.step)), level)
  end
  if meta.skipped ~= nil and not (is_integer(meta.skipped) and meta.skipped >= 0) then
    error(("%s: checkpoint skipped = %s is not a non-negative integer"):format(path, tostring(meta.skipped)), level)
  end
  local lo = meta.lr_override
  if lo ~= nil and not (type(lo) == "number" and lo >= 0 and lo < math.huge) then
    error(("%s: checkpoint lr_override = %s is not a finite number >= 0"):format(path, tostring(meta.lr_override)), level)
  end
  local lags = meta.lags
  if lags ~= nil then
    local good = type(lags) == "table"
    for k, v in pairs(good and lags or {}) do
      good = good and type(k) == "string" and is_integer(v) and v >= 0 and v <= meta.step
    end
    if not good then error(("%s: checkpoint lags are not {name = steps without a gradient}"):format(path), level) end
  end
  local rng = meta.rng
  for _, f in ipairs(files) do
    if f.meta.world == self.world.size and f.meta.rank == self.world.rank and f.meta.rng then rng = f.meta.rng end
  end
  if rng ~= nil and not tensor.valid_rng_state(rng) then
    error(("%s: checkpoint rng state is not {seed =, offset =} of non-negative integers"):format(path), level)
  end
  local tensors, scalars = self:_state_entries()
  local splits, slots = self:_layout()
  -- check everything before changing anything
  local copies = {}
  local strict = #files == 1 and not self.dist       -- one rank to one rank: every tensor is this rank's
  for name, t in pairs(tensors) do plan_copies(path, name, t, files, splits[name], slots[name], copies, strict and not force) end
  if not force then
    for _, f in ipairs(files) do
      for name in pairs(f.tensors) do
        local placed
        if strict then placed = tensors[name] ~= nil else placed = self:_has_place(name, tensors) end
        if not placed then
          error(("%s: tensor '%s' in the checkpoint has no place in this optimizer"):format(f.path, name), level)
        end
      end
    end
  end
  local values = {}
  for name, v in pairs(scalars) do
    for _, f in ipairs(files) do
      local fv = f.meta.scalars and f.meta.scalars[name]
      local nf = fv == nil and type(f.meta.nonfinite) == "table" and f.meta.nonfinite[name] or nil
      if nf ~= nil then
        fv = NONFINITE[nf]
        if fv == nil then error(("%s: state value '%s' is %s, not \"inf\", \"-inf\" or \"nan\""):format(f.path, name, tostring(nf)), level) end
      end
      if fv ~= nil then values[name] = fv break end
    end
    if values[name] == nil then error(("%s: state value '%s' is missing from the checkpoint"):format(path, name), level) end
    if type(values[name]) ~= type(v) then error(("%s: state value '%s' has the wrong type"):format(path, name), level) end
  end
  return { copies = copies, values = values, meta = meta, rng = rng, recipe = rec.name }
end

-- load's changes, once every check has passed (on every rank)
function Optimizer:_load_apply(plan)
  local meta, rng, lags = plan.meta, plan.rng, plan.meta.lags
  for _, c in ipairs(plan.copies) do c[1]:copy_(c[2]) end
  for name, v in pairs(plan.values) do self:_set_scalar(name, v) end
  self.step_count = meta.step
  for _, m in ipairs(self.members) do
    m.lag, m.absent_from = lags and lags[m.name] or 0, m.grad == nil and meta.step or nil
    self:_lag_scalar(m.lag)
  end
  self.grads_version = self.grads_version + 1   -- captured graphs compare their members' lags again
  self.skipped = meta.skipped or 0
  if self.skipped_t then self.skipped_t:fill_(0) end
  self.lr_override = meta.lr_override
  if rng then ms.set_rng_state(rng) end
  return { step = meta.step, recipe = plan.recipe }
end

return M
