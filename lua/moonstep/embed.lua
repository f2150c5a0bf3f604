--[[
moonstep.embed -- the Lua half of the C embedding API (engine/core/embed.c; moonstep.h, "Embedding").

Each ms_optimizer owns one LuaJIT state, in which embed.c calls M.new once and then the methods of the
object it returns.  Engine handles arrive as light userdata that already hold their own reference (the
caller's context retained, new tensor handles sharing the trainer's storage): each gets its finalizer
first thing, so nothing leaks whatever fails afterwards.

Parameters are collected until the optimizer starts (first step, save, load, info, stats or capture), when
ms.optim.new routes them all at once; until then a probe optimizer without parameters, built by M.new, has
checked the recipe, the options and the settings, and answers get_lr.  Several ranks: set_comm hands over
the caller's communicator (borrowed: ms.comm.borrow, never freed here) as settings.comm, and add_param's
shard arguments become the entry's shard = {dim =, offset =, size =}; ms.optim does the rest.  Tied parameters
(one tensor under several names: ms.optim's "Tied parameters") are checked as they are added, and a set_grad
through any of their names gives the tie its one gradient, before the start as after it.

Errors reach C through M.handler as {status =, message =}: status is an ms_status code, or nil to let the
C side use the call's default class.

While the context's stream is being captured (a trainer's own CUDA graph, moonstep.h "Inside a trainer's
CUDA graph"), only the calls that neither read the device nor allocate from the driver run: a step is
recorded into the trainer's graph (ms.optim's joined capture) and prepare_replay, outside the capture,
readies each replay.  The collector is stopped during such calls: a finalizer could free an event or a
graph, driver calls that a capture refuses.
]]
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local json = require("moonstep.json")
local comm = require("moonstep.comm")
local ffi, C = core.ffi, core.C

local M = {}

-- The status of the engine call that failed during the current API call: the binding raises every
-- engine failure through core.raise (check and check_alloc call it through the module table), so wrapping
-- it here, in this optimizer's own state, tells an engine error from a Lua one.
local engine_status, engine_message = nil, nil
local raise = core.raise
core.raise = function(st, level)
  engine_status, engine_message = tonumber(st), ffi.string(C.ms_last_error())
  return raise(st, level)     -- a tail call: the error's level stays the caller's
end

local Failure = {}            -- metatable of the errors this module classifies itself

local function fail(status, fmt, ...)
  error(setmetatable({ status = tonumber(status), message = fmt:format(...) }, Failure), 0)
end

local TRACEBACK_LINES = 12
local traceback = false       -- whether the current call runs recipe code, where a traceback helps

--- The message handler of every call from C.
function M.handler(e)
  if type(e) == "table" and getmetatable(e) == Failure then return e end
  local msg = type(e) == "string" and e or ("(a Lua error that is a " .. type(e) .. ", not a message)")
  local status = nil
  if engine_status and engine_message ~= "" and msg:find(engine_message, 1, true) then status = engine_status end
  -- (an error of the runtime's own files names its problem: no position in them, no traceback through them)
  local own
  msg, own = core.strip_own_position(msg)
  if own or not traceback then return { status = status, message = msg } end
  local lines = {}
  for line in debug.traceback(msg, 2):gmatch("[^\n]+") do
    if #lines == TRACEBACK_LINES then lines[#lines + 1] = "\t..." break end
    lines[#lines + 1] = line
  end
  return { status = status, message = table.concat(lines, "\n") }
end

-- JSON null means "not given"
local function strip_nulls(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do
    if x ~= json.null then out[k] = strip_nulls(x) end
  end
  return out
end

local function decode(text)
  if text == nil or text == "" then return {} end
  return strip_nulls(json.decode(text))       -- embed.c has checked it is a well-formed object
end

-- what JSON can hold: non-finite numbers as strings, tensors as their values (small ones) or a summary
-- info's and stats' lists, which must stay JSON arrays when empty (a 0-dim parameter's shape, no parameters)
local array_keys = { shape = true, local_shape = true, params = true, groups = true }

local function for_json(v, depth)
  local tv = type(v)
  if tv == "number" then
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    return v
  end
  if tv == "string" or tv == "boolean" then return v end
  if ms.is_tensor(v) then
    if v:numel() <= 64 then return for_json(v:tolist_flat(), depth) end
    return ("tensor [%s] %s"):format(table.concat(v:shape(), ","), v:dtype())
  end
  if tv == "table" and depth < 16 then
    local out = {}
    for k, x in pairs(v) do
      if type(k) == "string" or type(k) == "number" then
        out[k] = for_json(x, depth + 1)
        if array_keys[k] and type(x) == "table" and next(x) == nil then out[k] = json.empty_array end
      end
    end
    return out
  end
  return tv
end

local function file_readable(path)
  local f, err = io.open(path, "rb")
  if not f then return false, err end
  f:close()
  return true
end

local function tensor_from(p, ctx)
  if p == nil then return nil end
  return tensor.wrap(ffi.cast("ms_tensor *", p), ctx)
end

local function parse_tags(s)
  if s == nil then return nil end
  local tags = {}
  for item in s:gmatch("[^,]+") do
    item = item:match("^%s*(.-)%s*$")
    if item ~= "" then tags[#tags + 1] = item end
  end
  return tags
end

local dtype_bytes = tensor.dtype_bytes
-- Replaced gradients may hold a trainer's memory (a DLPack import keeps it until its handle goes) that the
-- collector cannot see: collect once this many bytes of them have been let go.
local RELEASED_BUDGET = 256 * 2 ^ 20

local Embedded = {}
Embedded.__index = Embedded

--- M.new(ctx, recipe, options_json, settings_json, abi_fn) -> the object embed.c keeps.
--- ctx: a retained ms_ctx *; abi_fn: the address of ms_abi_version in the library that embeds this state.
function M.new(ctx_p, recipe, options_json, settings_json, abi_fn)
  engine_status, engine_message, traceback = nil, nil, false
  local ctx = tensor.wrap_context(ffi.cast("ms_ctx *", ctx_p))
  -- handles must not cross between two loaded copies of the engine
  if ffi.cast("void *", abi_fn) ~= ffi.cast("void *", C.ms_abi_version) then
    fail(C.MS_E_IO, "the Lua binding loaded %s, which is not the libmoonstep that embeds it (MOONSTEP_LIB set to another build?)",
         core.library_path)
  end
  local options, settings = decode(options_json), decode(settings_json)
  for _, k in ipairs { "ctx", "device" } do
    if settings[k] ~= nil then
      fail(C.MS_E_ARG, "setting '%s': the optimizer runs on the context given to ms_optimizer_new", k)
    end
  end
  if settings.comm ~= nil then
    fail(C.MS_E_ARG, "setting 'comm': JSON cannot hold a communicator; hand it over with ms_optimizer_set_comm")
  end
  if recipe:find("/", 1, true) or recipe:find("%.lua$") then
    local ok, err = file_readable(recipe)
    if not ok then fail(C.MS_E_IO, "cannot read recipe %s: %s", recipe, tostring(err)) end
  end
  settings.ctx = ctx
  -- with no parameters, ms.optim.new checks the settings, loads the recipe and checks the options
  local probe = ms.optim.new(recipe, {}, options, settings)
  return setmetatable({
    ctx = ctx, ctx_h = tensor.handle_ctx(ctx), recipe = probe.recipe, options = options, settings = settings,
    probe = probe, params = {}, by_name = {}, ties = {}, tie_of = {}, opt = nil, lr = nil, released = 0,
    recorded = nil,           -- {scaled =} once a step was recorded into a graph (prepare_replay needs one)
    in_capture = false,       -- the current call runs while the context's stream is being captured
  }, Embedded)
end

local methods = {}

-- the optimizer over the parameters added so far: routed, with the recipe's state
local function build(self)
  local opt = ms.optim.new(self.recipe, self.params, self.options, self.settings)
  if self.lr ~= nil then opt:set_lr(self.lr) end
  return opt
end

-- routes the parameters and creates the recipe's state, once
local function start(self)
  if self.opt then return self.opt end
  local opt = build(self)
  self.opt, self.probe = opt, nil
  return opt
end

local function release(self, old)
  if old == nil then return end
  self.released = self.released + old:numel() * dtype_bytes[old:dtype()]
  if self.released > RELEASED_BUDGET and not self.in_capture then
    self.released = 0
    collectgarbage()
    collectgarbage()
  end
end

-- shard_dim ("rows" | "cols"), shard_offset, shard_size: this rank's slice (embed.c has checked it fits)
function methods:add_param(name, param_p, grad_p, tags, shard_dim, shard_offset, shard_size)
  local param, grad = tensor_from(param_p, self.ctx), tensor_from(grad_p, self.ctx)
  if self.opt then
    fail(C.MS_E_ARG, "parameter '%s': the optimizer has started (a step, save, load, info, stats or capture ran); add every parameter before", name)
  end
  if self.by_name[name] then fail(C.MS_E_ARG, "duplicate parameter name '%s'", name) end
  -- tied parameters (one tensor under several names) have one gradient: ms.optim would refuse two only when
  -- the optimizer starts
  local entry = { name = name, param = param, grad = grad, tags = parse_tags(tags) }
  if shard_dim ~= nil then entry.shard = { dim = shard_dim, offset = shard_offset, size = shard_size } end
  local key = ms.optim._tie_key(param)
  local tie = self.ties[key] or {}
  for _, e in ipairs(tie) do   -- routed by the first name's tags; the gradient given through any name so far
    local why = ms.optim._tie_conflict({ name = e.name, tags = tie[1].tags, grad = e.grad }, entry)
    if why then fail(C.MS_E_ARG, "%s", why) end
  end
  local why = ms.optim._shared_memory(entry, self.params, function(o) return self.tie_of[o.name] == tie end)
  if why then fail(C.MS_E_ARG, "%s", why) end
  self.tie_of[name] = tie   -- (not in the entry: ms.optim.new refuses keys it does not know)
  tie[#tie + 1] = entry
  self.ties[key] = tie
  self.params[#self.params + 1] = entry
  self.by_name[name] = entry
end

-- the world this optimizer is one rank of (settings.comm for ms.optim): a communicator the caller owns
function methods:set_comm(comm_p)
  if self.opt then
    fail(C.MS_E_ARG, "the optimizer has started (a step, save, load, info, stats or capture ran); set the communicator before")
  end
  self.settings.comm = comm_p ~= nil and comm.borrow(ffi.cast("ms_comm *", comm_p), self.ctx) or nil
end

function methods:set_grad(name, grad_p)
  local grad = tensor_from(grad_p, self.ctx)
  local entry = self.by_name[name]
  if not entry then fail(C.MS_E_ARG, "no parameter named '%s'", name) end
  if grad ~= nil then
    local gs, ps = grad:shape(), entry.param:shape()
    if table.concat(gs, ",") ~= table.concat(ps, ",") then
      fail(C.MS_E_SHAPE, "parameter '%s': grad shape [%s] != param shape [%s]", name, table.concat(gs, ","),
           table.concat(ps, ","))
    end
    -- as add_param (engine/core/embed.c): ms.optim would refuse it only when the optimizer starts
    if C.ms_tensor_overlaps(tensor.handle(entry.param), tensor.handle(grad)) ~= 0 then
      fail(C.MS_E_ARG, "parameter '%s': grad shares memory with the param (it is updated in place)", name)
    end
    if not self.opt then   -- (once started, the optimizer's own check runs at the next step, which it fails)
      local tie = self.tie_of[name]
      local why = ms.optim._shared_memory({ name = name, grad = grad }, self.params,
                                          function(o) return self.tie_of[o.name] == tie end)
      if why then fail(C.MS_E_ARG, "%s", why) end
    end
  end
  local old = entry.grad
  if self.opt then self.opt:set_grad(name, grad) end
  -- through any name of a tie: its one gradient
  for _, e in ipairs(self.tie_of[name]) do e.grad = grad end
  if old ~= grad then release(self, old) end
end

function methods:step(grad_scale)
  local args = grad_scale and { grad_scale = grad_scale } or nil
  if not self.in_capture then
    local opt = start(self)
    local applied = opt:step(args)
    -- the graph the next ms_optimizer_step may replay without entering Lua (engine/core/embed.c)
    return applied, args == nil and opt._bare_replay_graph and opt:_bare_replay_graph() or nil
  end
  -- recorded into the capturer's graph: what a capture cannot do (create the recipe's state, the context's
  -- handles, the memory the step's temporaries take) must have happened in an uncaptured step
  local opt = self.opt
  if opt == nil then
    fail(C.MS_E_UNSUPPORTED, "the first step cannot be captured into a CUDA graph (it creates the optimizer's "
         .. "state): run one step uncaptured before capturing, with the setting \"device_checks\": true")
  end
  if not (opt.settings.device_checks or opt.graphs) then
    fail(C.MS_E_UNSUPPORTED, "a step captured into a CUDA graph checks the gradients on the device: create the "
         .. "optimizer with the setting \"device_checks\": true (or call ms_optimizer_capture) and run one step "
         .. "uncaptured before capturing")
  end
  if next(opt.warm_keys) == nil then
    fail(C.MS_E_UNSUPPORTED, "no step has run uncaptured with the checks on the device yet: run one before "
         .. "capturing (it fills the memory a capture cannot allocate)")
  end
  -- the uncaptured steps' temporaries back to the pool's cache, which serves the recorded step's allocations
  -- (the finalizers that run only return memory to the pool and drop imported tensors: no driver call)
  collectgarbage()
  collectgarbage()
  local applied = opt:step(args)
  self.recorded = { scaled = grad_scale ~= nil }
  return applied
end

-- before each replay of a graph that holds a recorded step: this replay's lr and step into the device scalars
function methods:prepare_replay(grad_scale)
  if tonumber(C.ms_ctx_device_type(self.ctx_h)) ~= C.MS_DEVICE_CUDA then
    fail(C.MS_E_UNSUPPORTED, "the optimizer runs on %s, whose steps are never captured into a CUDA graph: there "
         .. "is no replay to prepare", self.ctx:name())
  end
  if self.in_capture then
    fail(C.MS_E_UNSUPPORTED, "the context's stream is being captured: call it before each replay of the graph, "
         .. "outside the capture")
  end
  local rec = self.recorded
  if rec == nil then
    fail(C.MS_E_ARG, "no step has been recorded into a CUDA graph yet (ms_optimizer_step while the context's "
         .. "stream is being captured): there is no replay to prepare")
  end
  if rec.scaled and grad_scale == nil then
    fail(C.MS_E_ARG, "the recorded step was given a grad_scale: give this replay's (ms_optimizer_prepare_replay_with)")
  end
  if grad_scale ~= nil and not rec.scaled then
    fail(C.MS_E_ARG, "the recorded step was given no grad_scale, so its replays cannot unscale the gradients "
         .. "(record a step with one)")
  end
  self.opt:prepare_replay(grad_scale and { grad_scale = grad_scale } or nil)
end

-- steps engine/core/embed.c replayed without calling in (the graph _bare_replay_graph named)
function methods:replayed(n)
  if self.opt then self.opt:_replayed(n) end
end

function methods:set_lr(lr)
  if self.opt then self.opt:set_lr(lr) else self.probe:set_lr(lr) self.lr = lr end
end

function methods:get_lr()
  return (self.opt or self.probe):get_lr()
end

function methods:save(path) start(self):save(path) end

function methods:load(path)
  -- a load that fails changes nothing, and does not start the optimizer: parameters may still be added
  -- after it (before the start, the optimizer it loads into is kept only once the load succeeded)
  -- several ranks: no early return here, which would leave the others waiting in load's vote (and then pair
  -- their collectives with this rank's next ones); a file that this rank cannot read fails its part of the vote
  if self.settings.comm == nil then
    local ok, err = file_readable(path)
    if not ok then fail(C.MS_E_IO, "cannot read checkpoint %s: %s", path, tostring(err)) end
  end
  local opt = self.opt or build(self)
  local ok, err = pcall(opt.load, opt, path)
  if not ok then
    -- the Lua optimizer's advice for another recipe's checkpoint is an option ms_optimizer_load does not have
    if type(err) == "string" then
      err = err:gsub("; pass {force = true} to load it anyway", "; ms_optimizer_load takes only checkpoints of the "
                     .. "recipe it runs (the same name and content hash)")
    end
    error(err, 0)
  end
  self.opt, self.probe = opt, nil
end

function methods:info() return json.encode(for_json((start(self):info()), 0)) end
function methods:stats() return json.encode(for_json(start(self):stats(), 0)) end

function methods:capture()
  local opt = start(self)
  if type(opt.capture) ~= "function" then
    fail(C.MS_E_UNSUPPORTED, "graph capture is not available: this moonstep's Lua optimizer has no capture()")
  end
  opt:capture()
end

-- Calls that may run while the context's stream is being captured, and those of them that would start
-- the optimizer (allocating its state).  The others read the device or allocate.
local capture_safe = { add_param = true, set_grad = true, step = true, set_lr = true, get_lr = true,
                       prepare_replay = true, info = true, stats = true }
local starts = { info = true, stats = true }

-- a call made while the context's stream is being captured: the collector stopped meanwhile
local function call_in_capture(name, f, self, ...)
  if not capture_safe[name] or (starts[name] and self.opt == nil) then
    fail(C.MS_E_UNSUPPORTED, "refused while the context's stream is being captured into a CUDA graph: it "
         .. "would read the device or allocate%s", starts[name] and " (before the first step)" or "")
  end
  collectgarbage("stop")
  self.in_capture = true
  local ok, res = xpcall(f, M.handler, self, ...)
  self.in_capture = false
  collectgarbage("restart")
  if not ok then error(setmetatable(res, Failure), 0) end   -- classified already: passed through as is
  return res
end

-- every method starts a new API call: forget the previous call's engine failure
local runs_recipe = { step = true, capture = true }
for name, f in pairs(methods) do
  local tb = runs_recipe[name] or false
  Embedded[name] = function(self, ...)
    engine_status, engine_message, traceback = nil, nil, tb
    if tonumber(C.ms_ctx_is_capturing(self.ctx_h)) ~= 0 then return call_in_capture(name, f, self, ...) end
    return f(self, ...)
  end
end

return M
