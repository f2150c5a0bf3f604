--[[
moonstep.tensor -- the Tensor and Context objects of the Lua surface.

A Tensor is a Lua table whose engine handle (ms_tensor *) lives in a private weak table of this module:
the object itself holds no cdata, so code that only sees tensors (an untrusted recipe) cannot reach a
pointer.  Dims are 0-based as in PyTorch and the C ABI; negative dims count from the end.  Being a table, a
tensor has no usable `#` on a stock LuaJIT (always 0, see Tensor.__len): t:size(0) is its length.
]]
local core = require("moonstep.core")
local ffi, C = core.ffi, core.C
local check, check_alloc = core.check, core.check_alloc

local M = {}

local handle = setmetatable({}, { __mode = "k" })   -- Tensor -> ms_tensor* (owning, ffi.gc'd)
local ctx_handle = setmetatable({}, { __mode = "k" }) -- Context -> ms_ctx*
local tensor_ctx = setmetatable({}, { __mode = "k" }) -- Tensor -> its Context (kept alive by the tensor)

local Tensor = {}
Tensor.__index = Tensor
local Context = {}
-- a function, not the table itself: `ctx.__index` must not hand the shared method table to a recipe
Context.__index = function(_, k) return Context[k] end
-- getmetatable() on a tensor or context gives this string, never the shared (mutable) metatable
Tensor.__metatable = "moonstep.Tensor"
Context.__metatable = "moonstep.Context"
M.Tensor, M.Context = Tensor, Context

-- Allocation accounting for untrusted recipes: moonstep.recipe installs a guard while one runs.
-- guard.reserve(bytes) raises when the recipe's quota would be exceeded, guard.charge(t, bytes) records a
-- fresh allocation.  A view keeps its base's charge alive (anchor), so a slice cannot keep a large storage
-- alive after its accounting has been released.
local alloc_guard = nil
local anchor = setmetatable({}, { __mode = "k" })    -- Tensor -> charge token (see moonstep.recipe)
function M.set_alloc_guard(g) local old = alloc_guard; alloc_guard = g; return old end
function M.set_anchor(t, token) anchor[t] = token end
-- iterations of a C loop whose count the caller chose (ms.sinkgd_step's iters, ms.inv_root's steps), counted
-- against an untrusted recipe's instruction limit (guard.work) before the call: the hook cannot stop a C call
function M.charge_work(what, iterations)
  if alloc_guard and alloc_guard.work and type(iterations) == "number" and iterations > 0 then
    alloc_guard.work(what, iterations)
  end
end

-- ---------------------------------------------------------------------------------------------------
-- dtypes
-- ---------------------------------------------------------------------------------------------------
local dtype_enum = {
  f32 = C.MS_DTYPE_F32, f64 = C.MS_DTYPE_F64, bf16 = C.MS_DTYPE_BF16, f16 = C.MS_DTYPE_F16,
  i32 = C.MS_DTYPE_I32, u8 = C.MS_DTYPE_U8,
}
local dtype_alias = {
  float32 = "f32", float = "f32", float64 = "f64", double = "f64", bfloat16 = "bf16", float16 = "f16",
  half = "f16", int32 = "i32", uint8 = "u8",
}
local dtype_name = {}
for k, v in pairs(dtype_enum) do dtype_name[tonumber(v)] = k end
-- promotion order for results of mixed-dtype arithmetic (torch-like: wider float wins)
local rank = { u8 = 0, i32 = 1, f16 = 2, bf16 = 2, f32 = 3, f64 = 4 }

local function norm_dtype(dt, level)
  if dt == nil then return "f32" end
  if type(dt) ~= "string" then error("dtype must be a string such as \"f32\" (got " .. type(dt) .. ")", level or 3) end
  local n = dtype_alias[dt] or dt
  if not dtype_enum[n] then
    error(("unknown dtype %q (expected f32, f64, bf16, f16, i32 or u8)"):format(dt), level or 3)
  end
  return n
end
M.norm_dtype = norm_dtype

local function promote(a, b)
  if a == b then return a end
  if (a == "bf16" and b == "f16") or (a == "f16" and b == "bf16") then return "f32" end
  return rank[a] >= rank[b] and a or b
end

-- the result dtype of an op that yields fractions (true division, sqrt, exp, a fractional scalar): integer
-- operands give f32, as torch's default float dtype (an i32 result would silently truncate 3 / 2 to 1)
local function fractional(dt) return rank[dt] <= rank.i32 and "f32" or dt end

-- ---------------------------------------------------------------------------------------------------
-- contexts
-- ---------------------------------------------------------------------------------------------------
local default_ctx = {}           -- device name -> Context (one per device per process)
local default_device = "cpu"

local function wrap_ctx(p)
  local c = setmetatable({}, Context)
  ctx_handle[c] = core.own_ctx(p)
  return c
end
-- a Context for a handle that holds its own reference (the embedding API hands the caller's context over)
M.wrap_context = wrap_ctx

-- (a misspelt key would leave its default in force; mem_limit = 1.5 or num_threads = 2^32 + 1 would reach the
-- FFI truncated or wrapped)
local CONTEXT_OPTIONS = {
  device = "string",
  num_threads = { "integer", min = 0, max = core.INT_MAX },
  mem_limit = { "integer", min = 0, max = 2 ^ 53 },
  stream = function(v)
    if type(v) ~= "cdata" and type(v) ~= "userdata" then return "a pointer (a cudaStream_t as cdata)" end
  end,
}

--- ms.context{device = "cpu"|"cuda:0"|"auto", num_threads = n, mem_limit = bytes, stream = cdata}
function M.context(opts)
  if type(opts) == "string" then opts = { device = opts } end
  opts = core.check_options("context", opts, CONTEXT_OPTIONS, 2)
  if opts.device then core.c_string("context", "device", opts.device, 2) end
  local o = ffi.new("ms_ctx_options")
  o.mem_limit = opts.mem_limit or 0
  o.num_threads = opts.num_threads or 0
  if opts.stream ~= nil then o.stream = ffi.cast("void *", opts.stream) end
  check(C.ms_ctx_new(opts.device or default_device, o, core.out_ctx))
  return wrap_ctx(core.out_ctx[0])
end

--- The default context of a device (created once per device per process).
function M.device(name)
  name = name or default_device
  if ctx_handle[name] ~= nil then return name end
  local c = default_ctx[name]
  if c then return c end
  c = M.context { device = name }
  local canonical = c:name()
  if default_ctx[canonical] then c = default_ctx[canonical] end
  default_ctx[name], default_ctx[canonical] = c, c
  return c
end

function M.set_default_device(name)
  M.device(name)        -- fails early on a bad name
  default_device = name
end
function M.get_default_device() return default_device end

function Context:name() return ffi.string(C.ms_ctx_device_name(ctx_handle[self])) end
function Context:device_type() return tonumber(C.ms_ctx_device_type(ctx_handle[self])) == 0 and "cpu" or "cuda" end
function Context:sync() check(C.ms_ctx_sync(ctx_handle[self])) end
function Context:mem_stats()
  local s = ffi.new("ms_mem_stats")
  check(C.ms_ctx_mem_stats(ctx_handle[self], s))
  return {
    bytes_in_use = tonumber(s.bytes_in_use), peak_bytes = tonumber(s.peak_bytes),
    bytes_cached = tonumber(s.bytes_cached), limit = tonumber(s.limit), num_allocs = tonumber(s.num_allocs),
    num_frees = tonumber(s.num_frees), num_device_allocs = tonumber(s.num_device_allocs),
    launches = tonumber(s.launches),
  }
end
Context.__tostring = function(self) return "moonstep.Context(" .. self:name() .. ")" end

local function resolve_ctx(opts)
  if opts and opts.ctx then
    -- a table posing as a context would reach C as a NULL handle
    if ctx_handle[opts.ctx] == nil then error("ctx must be a moonstep context (got " .. type(opts.ctx) .. ")", 4) end
    return opts.ctx
  end
  return M.device(opts and opts.device)
end

-- ---------------------------------------------------------------------------------------------------
-- construction
-- ---------------------------------------------------------------------------------------------------
-- Views that overlap themselves (expand: a dim of size > 1 with stride 0), by their element count.  An op over
-- one loops over every element in C, where the hook never runs, and allocates nothing a quota would see: in
-- the sandbox, ms.zeros({1}):expand({2^50}):sum() would run for days.  So while a recipe runs, each op that
-- takes one (H below; not the properties and views, HM) counts its elements against the instruction limit,
-- one instruction an element (charge_work counts an iteration as 1000).
local overlapping = setmetatable({}, { __mode = "k" })
local function overlap_numel(p)
  for i = 0, C.ms_tensor_ndim(p) - 1 do
    if C.ms_tensor_size(p, i) > 1 and C.ms_tensor_stride(p, i) == 0 then return tonumber(C.ms_tensor_numel(p)) end
  end
  return nil
end

local function wrap(p, ctx, base)
  local t = setmetatable({}, Tensor)
  handle[t] = core.own_tensor(p)
  tensor_ctx[t] = ctx
  if base ~= nil and anchor[base] ~= nil then anchor[t] = anchor[base] end   -- a view shares its base's charge
  -- (only views can overlap; checked while a recipe runs, or from a view that does)
  if base ~= nil and (alloc_guard or overlapping[base]) then overlapping[t] = overlap_numel(p) end
  return t
end
M.wrap = wrap

local function HM(t)
  local h = handle[t]
  if h == nil then error("expected a moonstep tensor, got " .. type(t), 3) end
  return h
end

local function H(t)
  local h = handle[t]
  if h == nil then error("expected a moonstep tensor, got " .. type(t), 3) end
  local n = alloc_guard and overlapping[t]
  if n then M.charge_work(("an op over an expanded view of %.0f elements"):format(n), n / 1000) end
  return h
end
M.handle = H   -- for the binding's own modules only (never exported through `ms`)
function M.handle_ctx(c) return ctx_handle[c] end

function M.ctx_object(t)
  local c = tensor_ctx[t]
  if c == nil then error("expected a moonstep tensor, got " .. type(t), 3) end
  return c
end
local function ctx_of(t) return ctx_handle[M.ctx_object(t)] end

-- a whole number (a dim, an index, a size): the FFI would truncate a fractional one toward zero, and turn inf
-- or anything from 2^63 on into int64_t's smallest value
local function integral(v) return core.kinds.integer.test(v) and math.abs(v) < 2 ^ 63 end

local function as_shape(shape, level)
  if type(shape) ~= "table" then error("shape must be a table of sizes (got " .. type(shape) .. ")", level or 3) end
  local n = #shape
  if n > 8 then error(("a tensor has at most 8 dims (got %d)"):format(n), level or 3) end
  local arr = ffi.new("int64_t[?]", n > 0 and n or 1)
  for i = 1, n do
    local v = shape[i]
    if not integral(v) then
      error(("shape[%d] must be an integer (got %s)"):format(i, type(v) == "number" and tostring(v) or type(v)), level or 3)
    end
    arr[i - 1] = v
  end
  return arr, n
end

--- An uninitialised tensor.
-- The garbage collector sees a few bytes per tensor, not the memory the engine holds for it, so a loop
-- that drops large temporaries could grow without bound between collections.  Count the bytes allocated
-- and collect once a budget is passed (twice: the first cycle clears the weak handle entry, the second
-- runs the handle's finalizer).
local dtype_bytes = { f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, u8 = 1 }
M.dtype_bytes = dtype_bytes
local gc_budget, gc_debt = 256 * 2 ^ 20, 0

local function empty(shape, opts)
  local ctx = resolve_ctx(opts)
  local dt = norm_dtype(opts and opts.dtype)
  local arr, n = as_shape(shape)
  local bytes = dtype_bytes[dt]
  for i = 0, n - 1 do bytes = bytes * tonumber(arr[i]) end
  if alloc_guard then alloc_guard.reserve(bytes) end
  gc_debt = gc_debt + bytes
  if gc_debt > gc_budget then
    gc_debt = 0
    collectgarbage()
    collectgarbage()
  end
  check_alloc(C.ms_tensor_new, ctx_handle[ctx], dtype_enum[dt], n, arr, core.out_tensor)
  local t = wrap(core.out_tensor[0], ctx)
  if alloc_guard then alloc_guard.charge(t, bytes) end
  return t
end

-- The options of the constructors, checked where the user calls them (the binding's own calls make their tables
-- right, and skip the check): a misspelt dtype key would give f32, silently, and a misspelt seed the global
-- generator's numbers.
local function device_kind(v)
  if type(v) ~= "string" and ctx_handle[v] == nil then return "a device name or a context" end
end
local function ctx_kind(v) if ctx_handle[v] == nil then return "a moonstep context" end end
local NEW_OPTIONS = { dtype = "string", device = device_kind, ctx = ctx_kind }
local function rand_options(a, b)
  return { dtype = "string", device = device_kind, ctx = ctx_kind, seed = core.SEED, offset = core.SEED,
           [a] = "number", [b] = "number" }
end
local RAND_OPTIONS, RANDN_OPTIONS = rand_options("low", "high"), rand_options("mean", "std")

--- ms.empty(shape, {dtype=, device=, ctx=}): an uninitialised tensor
function M.empty(shape, opts) return empty(shape, core.check_options("empty", opts, NEW_OPTIONS, 2)) end

function M.full(shape, value, opts)
  core.check_options("full", opts, NEW_OPTIONS, 2)
  core.check_value("full", "value", value, "number", 2)
  local t = empty(shape, opts)
  check(C.ms_fill(ctx_handle[M.ctx_object(t)], H(t), value, nil))
  return t
end
function M.zeros(shape, opts)
  core.check_options("zeros", opts, NEW_OPTIONS, 2)
  return M.full(shape, 0, opts)
end
function M.ones(shape, opts)
  core.check_options("ones", opts, NEW_OPTIONS, 2)
  return M.full(shape, 1, opts)
end

-- true when the table's keys are exactly 1..#x: `#` of a table with a hole may stop at it ({1, nil, 3} has # 1
-- or 3), and other keys ({1, 2, x = 3}) would be dropped, silently
local function plain_array(x)
  local n, count = #x, 0
  for k in pairs(x) do
    if type(k) ~= "number" or k < 1 or k > n or k ~= math.floor(k) then return false end
    count = count + 1
  end
  return count == n
end

-- shape of a nested Lua table, checking it is rectangular: (shape) or (nil, why), for the caller to raise where
-- its own caller called it
local function nested_shape(tbl)
  local shape, node = {}, tbl
  while type(node) == "table" and not M.is_tensor(node) do
    -- bounded: a table that contains itself would otherwise spin here in compiled code, where an
    -- untrusted recipe's instruction hook never runs
    if #shape == 8 then return nil, "tensor data is nested more than 8 deep" end
    shape[#shape + 1] = #node
    node = node[1]
  end
  local function walk(x, d)
    if d > #shape then
      if type(x) ~= "number" then return "tensor data must contain numbers (got " .. core.show(x) .. ")" end
      return nil
    end
    if type(x) ~= "table" or M.is_tensor(x) then return "tensor data is not rectangular (dim " .. (d - 1) .. ")" end
    if not plain_array(x) then return "tensor data has a hole or a non-integer key at dim " .. (d - 1) end
    if #x ~= shape[d] then return "tensor data is not rectangular (dim " .. (d - 1) .. ")" end
    for i = 1, #x do
      local why = walk(x[i], d + 1)
      if why then return why end
    end
    return nil
  end
  local why = walk(tbl, 1)
  if why then return nil, why end
  return shape
end

local function flatten(tbl, out)
  if type(tbl) == "number" then out[#out + 1] = tbl return out end
  for i = 1, #tbl do flatten(tbl[i], out) end
  return out
end

--- ms.tensor(nested_table_or_number, {dtype=, device=, ctx=})
function M.tensor(data, opts)
  core.check_options("tensor", opts, NEW_OPTIONS, 2)
  if type(data) ~= "number" and type(data) ~= "table" then
    error("tensor: data must be a number or a nested table of numbers (got " .. core.show(data) .. ")", 2)
  end
  local shape, why = {}, nil
  if type(data) == "table" then shape, why = nested_shape(data) end
  if why then error(why, 2) end
  local flat = flatten(data, {})
  local n = #flat
  local host = empty(shape, { dtype = "f64", device = "cpu" })
  if n > 0 then
    local buf = ffi.new("double[?]", n)
    for i = 1, n do buf[i - 1] = flat[i] end
    local cpu = M.device("cpu")
    check(C.ms_tensor_write(ctx_handle[cpu], H(host), buf, n * 8))
  end
  local dt = norm_dtype(opts and opts.dtype)
  local ctx = resolve_ctx(opts)
  if dt == "f64" and ctx:name() == "cpu" then return host end
  local t = empty(shape, { dtype = dt, ctx = ctx })
  check(C.ms_copy(ctx_handle[ctx], H(t), H(host)))
  return t
end

-- the global generator: (seed, offset); every draw takes the next offset
local rng = { seed = 0, offset = 0 }
-- a generator state: non-negative integers below 2^64 (what the engine's uint64 seed and offset hold), as numbers
local function rng_count(v) return type(v) == "number" and core.kinds.uint64.test(v) end
function M.manual_seed(n)
  if not rng_count(n) then error("manual_seed: a non-negative integer below 2^64 is needed", 2) end
  rng.seed, rng.offset = n, 0
end
function M.rng_state() return { seed = rng.seed, offset = rng.offset } end
function M.valid_rng_state(s) return type(s) == "table" and rng_count(s.seed) and rng_count(s.offset) end
function M.set_rng_state(s)
  -- checked first: a bad value would only fail at the next draw, in every later caller's hands
  if not M.valid_rng_state(s) then error("set_rng_state: {seed =, offset =} of non-negative integers is needed", 2) end
  rng.seed, rng.offset = s.seed, s.offset
end

-- The global generator's offset after `offset`.  Past 2^53 a double cannot count by one: offset + 1 rounded back
-- to offset, and every later draw repeated the same numbers.  There it steps to the next double, an offset no
-- draw has taken (distinct offsets are independent streams); past the last uint64 one it is refused.
local function next_offset(offset, level)
  local after = offset + 1
  if after == offset then
    local _, e = math.frexp(offset)
    after = offset + 2 ^ (e - 53)
  end
  if after > core.UINT64_MAX then
    error(("the global generator's offsets are spent (offset %.0f): set_rng_state or manual_seed"):format(offset), level + 1)
  end
  return after
end

local function draw(shape, opts, dist, a, b)
  local t = empty(shape, opts)
  local o = ffi.new("ms_rand_options")
  o.dist, o.a, o.b = dist, a, b
  if opts and opts.seed then
    o.seed, o.offset = opts.seed, opts.offset or 0
  else
    o.seed, o.offset = rng.seed, rng.offset
    rng.offset = next_offset(rng.offset, 3)
  end
  check(C.ms_rand(ctx_of(t), H(t), o))
  return t
end
--- ms.rand(shape, {dtype=, device=, seed=, offset=, low=, high=}): uniform [low, high)
function M.rand(shape, opts)
  core.check_options("rand", opts, RAND_OPTIONS, 2)
  return draw(shape, opts, C.MS_RAND_UNIFORM, opts and opts.low or 0, opts and opts.high or 1)
end
--- ms.randn(shape, {dtype=, device=, seed=, offset=, mean=, std=})
function M.randn(shape, opts)
  core.check_options("randn", opts, RANDN_OPTIONS, 2)
  return draw(shape, opts, C.MS_RAND_NORMAL, opts and opts.mean or 0, opts and opts.std or 1)
end

-- ---------------------------------------------------------------------------------------------------
-- properties
-- ---------------------------------------------------------------------------------------------------
function Tensor:dim() return C.ms_tensor_ndim(HM(self)) end
Tensor.ndim = Tensor.dim
function Tensor:shape()
  local h = HM(self)
  local s = {}
  for i = 0, C.ms_tensor_ndim(h) - 1 do s[i + 1] = tonumber(C.ms_tensor_size(h, i)) end
  return s
end
function Tensor:size(d)
  if d == nil then return self:shape() end
  if not integral(d) then error(("size: dim must be an integer (got %s)"):format(core.show(d)), 2) end
  local v = tonumber(C.ms_tensor_size(HM(self), d))
  if v < 0 then error(("size: dim %d out of range for a %d-dim tensor"):format(d, self:dim()), 2) end
  return v
end
function Tensor:strides()
  local h = HM(self)
  local s = {}
  for i = 0, C.ms_tensor_ndim(h) - 1 do s[i + 1] = tonumber(C.ms_tensor_stride(h, i)) end
  return s
end
function Tensor:numel() return tonumber(C.ms_tensor_numel(HM(self))) end
function Tensor:dtype() return dtype_name[tonumber(C.ms_tensor_dtype(HM(self)))] end
function Tensor:device() return ffi.string(C.ms_ctx_device_name(C.ms_tensor_ctx(HM(self)))) end
function Tensor:is_contiguous() return C.ms_tensor_is_contiguous(HM(self)) ~= 0 end
function Tensor:context() return M.ctx_object(self) end

function M.is_tensor(x) return type(x) == "table" and handle[x] ~= nil end

--- A new handle on t's elements (same storage, shape and strides): what a holder that sets properties of a
--- handle (set_rng_origin) keeps, so that the caller's own handle stays as it was.
function M.alias(t) return t:expand(t:shape()) end

--- set_rng_origin(t, {member =, rows =, cols =, row0 =, col0 =}) numbers t's stochastic rounding as a part of a
--- larger whole (moonstep.h, ms_tensor_set_rng_origin): the member word, and for a slice of a matrix (or of a
--- stack of them) along one dim, the whole matrix's dims and where the slice starts (rows, cols, row0, col0:
--- 0 when left out).  nil clears it.  The optimizer runtime sets it on its own handles of the parameters it
--- steps (M.alias), never on the caller's.
local ORIGIN_KEYS = { member = true, rows = true, cols = true, row0 = true, col0 = true }
local ORIGIN_ORDER = { "member", "rows", "cols", "row0", "col0" }   -- (the first bad one named: always the same)
function M.set_rng_origin(t, origin)
  M.need_tensor("set_rng_origin", "t", t, 2)
  if origin == nil then
    core.check(C.ms_tensor_set_rng_origin(HM(t), nil), 2)
    return t
  end
  if type(origin) ~= "table" then
    error("set_rng_origin: origin must be a table {member =, rows =, cols =, row0 =, col0 =} or nil (got " ..
          core.show(origin) .. ")", 2)
  end
  core.check_keys("set_rng_origin", origin, ORIGIN_KEYS, 2, "key")
  local o = ffi.new("ms_rng_origin")
  for _, k in ipairs(ORIGIN_ORDER) do
    local v, top = origin[k], k == "member" and 2 ^ 32 or 2 ^ 53
    if v == nil then v = 0 end
    if type(v) ~= "number" or v ~= math.floor(v) or v < 0 or v >= top then
      error(("set_rng_origin: %s must be an integer in [0, 2^%d) (got %s)"):format(k, top == 2 ^ 32 and 32 or 53,
            core.show(origin[k])), 2)
    end
    o[k] = v
  end
  core.check(C.ms_tensor_set_rng_origin(HM(t), o), 2)
  return t
end

--- Raises "<what>: <name> must be a tensor (got ...)" at `level` of the caller unless v is a tensor: the
--- module-level forms (ms.abs(x), ms.matmul(a, b), ...) otherwise failed inside, as "attempt to index a number".
function M.need_tensor(what, name, v, level)
  if not M.is_tensor(v) then error(("%s: %s must be a tensor (got %s)"):format(what, name, core.show(v)), level + 1) end
  return v
end
local need_tensor = M.need_tensor

-- Kinds of option values for core.check_options that involve tensors: fn(v) -> nil, or what v must be.
M.kinds = {
  tensor = function(v) if not M.is_tensor(v) then return "a tensor" end end,
  -- a scalar that may change every step: a number, or a one-element device tensor the kernel reads
  scalar = function(v)
    if type(v) ~= "number" and not M.is_tensor(v) then return "a number or a one-element device tensor" end
  end,
  -- a 1-based step count, or its device tensor (the engine would round 2.5)
  step = function(v)
    if not M.is_tensor(v) and not (core.kinds.integer.test(v) and v >= 1) then
      return "an integer >= 1 or a one-element device tensor"
    end
  end,
  any = function() end,     -- checked where it is used
}

-- ---------------------------------------------------------------------------------------------------
-- views
-- ---------------------------------------------------------------------------------------------------
local function shape_args(...)
  local first = ...
  if type(first) == "table" then return first end
  return { ... }
end

function Tensor:view(...)
  local arr, n = as_shape(shape_args(...))
  check(C.ms_tensor_reshape(ctx_of(self), HM(self), n, arr, core.out_tensor))
  return wrap(core.out_tensor[0], tensor_ctx[self], self)
end

--- reshape: a view when the layout allows it, else a contiguous copy
function Tensor:reshape(...)
  local arr, n = as_shape(shape_args(...))
  local base = self
  local st = C.ms_tensor_reshape(ctx_of(self), HM(self), n, arr, core.out_tensor)
  if st == C.MS_E_LAYOUT then
    base = self:contiguous()
    st = C.ms_tensor_reshape(ctx_of(base), HM(base), n, arr, core.out_tensor)
  end
  check(st)
  return wrap(core.out_tensor[0], tensor_ctx[self], base)
end

function Tensor:flatten() return self:reshape({ self:numel() }) end

-- a dim or an index argument of a view: the FFI would truncate a fractional one toward zero (slice(0, 1.5) from
-- row 1, transpose(0.9, 1) a no-op); nil stays nil for the caller's default
local function index_arg(what, name, v, level)
  if v ~= nil and not integral(v) then
    error(("%s: %s must be an integer (got %s)"):format(what, name, core.show(v)), level + 1)
  end
  return v
end

-- a dim argument: an integer (index_arg) that C's int holds (the FFI wraps 2^31 to -2^31, which C then named
-- in its refusal); any dim that large is out of range anyway
local function dim_arg(what, name, v, ndim, level)
  index_arg(what, name, v, level + 1)
  if v ~= nil and (v >= 2 ^ 31 or v < -2 ^ 31) then
    error(("%s: %s %s is out of range for a %d-dim tensor"):format(what, name, core.show(v), ndim), level + 1)
  end
  return v
end

function Tensor:slice(dim, start, stop, step)
  if dim == nil then error("slice: dim is needed", 2) end
  dim_arg("slice", "dim", dim, self:dim(), 2)
  index_arg("slice", "start", start, 2)
  index_arg("slice", "stop", stop, 2)
  index_arg("slice", "step", step, 2)
  check(C.ms_tensor_slice(ctx_of(self), HM(self), dim, start or 0, stop or 2 ^ 62, step or 1, core.out_tensor))
  return wrap(core.out_tensor[0], tensor_ctx[self], self)
end
--- narrow(dim, start, len): elements [start, start + len) of dim, a negative start counting from the end (as
-- torch.narrow); unlike slice, the range must lie inside the dim (slice would clamp it, or, for a negative
-- start with start + len >= 0, give nothing)
function Tensor:narrow(dim, start, len)
  if dim == nil or start == nil or len == nil then error("narrow: dim, start and length are needed", 2) end
  dim_arg("narrow", "dim", dim, self:dim(), 2)
  index_arg("narrow", "start", start, 2)
  index_arg("narrow", "length", len, 2)
  local size = self:size(dim)
  local s = start < 0 and start + size or start
  if s < 0 or len < 0 or s + len > size then
    error(("narrow: start %d, length %d out of range for dim %d of size %d"):format(start, len, dim, size), 2)
  end
  return self:slice(dim, s, s + len)
end

function Tensor:select(dim, index)
  -- (t[1.9] read row 1; checked without a table, since t[i] comes here)
  if not integral(dim) then error(("select: dim %s is not an integer"):format(tostring(dim)), 2) end
  dim_arg("select", "dim", dim, self:dim(), 2)
  if not integral(index) then error(("select: index %s is not an integer"):format(tostring(index)), 2) end
  check(C.ms_tensor_select(ctx_of(self), HM(self), dim, index, core.out_tensor))
  return wrap(core.out_tensor[0], tensor_ctx[self], self)
end

function Tensor:transpose(d0, d1)
  dim_arg("transpose", "dim0", d0, self:dim(), 2)
  dim_arg("transpose", "dim1", d1, self:dim(), 2)
  check(C.ms_tensor_transpose(ctx_of(self), HM(self), d0 or -2, d1 or -1, core.out_tensor))
  return wrap(core.out_tensor[0], tensor_ctx[self], self)
end
function Tensor:t()
  if self:dim() ~= 2 then error(("t(): a 2-dim tensor is needed (got %d dims)"):format(self:dim()), 2) end
  return self:transpose(0, 1)
end

function Tensor:permute(...)
  local p = shape_args(...)
  local arr = ffi.new("int[?]", #p > 0 and #p or 1)
  for i = 1, #p do arr[i - 1] = dim_arg("permute", ("dims[%d]"):format(i), p[i], self:dim(), 2) end
  check(C.ms_tensor_permute(ctx_of(self), HM(self), #p, arr, core.out_tensor))
  return wrap(core.out_tensor[0], tensor_ctx[self], self)
end

function Tensor:expand(...)
  local arr, n = as_shape(shape_args(...))
  check(C.ms_tensor_expand(ctx_of(self), HM(self), n, arr, core.out_tensor))
  return wrap(core.out_tensor[0], tensor_ctx[self], self)
end

-- a dim argument checked in Lua (range [-n, n), n = ndim + extra): table.insert and the squeeze filter would
-- otherwise leave holes in the shape or ignore the dim
local function check_dim(what, d, ndim, extra)
  local n = ndim + (extra or 0)
  if not integral(d) or d < -n or d >= n then
    error(("%s: dim %s out of range for a %d-dim tensor"):format(what, tostring(d), ndim), 3)
  end
end

function Tensor:unsqueeze(d)
  local s = self:shape()
  check_dim("unsqueeze", d, #s, 1)
  if d < 0 then d = d + #s + 1 end
  table.insert(s, d + 1, 1)
  return self:view(s)
end

function Tensor:squeeze(d)
  local s, out = self:shape(), {}
  if d ~= nil then check_dim("squeeze", d, #s) end
  for i, v in ipairs(s) do
    if not (v == 1 and (d == nil or i - 1 == d or i - 1 == d + #s)) then out[#out + 1] = v end
  end
  return self:view(out)
end

function Tensor:contiguous()
  -- a non-contiguous tensor is copied into fresh storage: that allocation counts against a recipe's quota
  local bytes = alloc_guard and not self:is_contiguous() and self:numel() * dtype_bytes[self:dtype()]
  if bytes then alloc_guard.reserve(bytes) end
  check(C.ms_tensor_contiguous(ctx_of(self), H(self), core.out_tensor))
  local t = wrap(core.out_tensor[0], tensor_ctx[self], not bytes and self or nil)
  if bytes then alloc_guard.charge(t, bytes) end
  return t
end

-- ---------------------------------------------------------------------------------------------------
-- copies and conversion
-- ---------------------------------------------------------------------------------------------------
function Tensor:copy_(src)
  if type(src) == "number" then return self:fill_(src) end
  check(C.ms_copy(ctx_of(self), H(self), H(src)))
  return self
end

function Tensor:fill_(v, v_t)
  -- (the FFI takes true as 1)
  if v ~= nil then core.check_value("fill_", "value", v, "number", 2) end
  if v_t ~= nil and not M.is_tensor(v_t) then error("fill_: the device value must be a tensor (got " .. type(v_t) .. ")", 2) end
  check(C.ms_fill(ctx_of(self), H(self), v or 0, v_t and H(v_t) or nil))
  return self
end
function Tensor:zero_() return self:fill_(0) end

function Tensor:clone()
  local t = empty(self:shape(), { dtype = self:dtype(), ctx = M.ctx_object(self) })
  return t:copy_(self)
end

--- t:to(dtype_or_device [, dtype]) -> a new tensor (self when nothing changes)
function Tensor:to(a, b)
  local dt, dev = self:dtype(), nil
  for _, x in ipairs { a, b } do
    if ctx_handle[x] ~= nil then dev = x
    elseif type(x) == "string" then
      local n = dtype_alias[x] or x
      if dtype_enum[n] then dt = n
      else
        local ok, c = pcall(M.device, x)
        if ok then dev = c
        elseif tostring(c):find("unknown device", 1, true) then
          error(("to: %q is neither a dtype (f32, f64, bf16, f16, i32, u8) nor a device (unknown device %q: "
                 .. "expected \"cpu\", \"cuda\", \"cuda:N\" or \"auto\")"):format(x, x), 2)
        else error(c, 2) end
      end
    elseif x ~= nil then error("to: expected a dtype or a device name", 2) end
  end
  dev = dev or M.ctx_object(self)
  if dt == self:dtype() and dev:name() == self:device() then return self end
  local t = empty(self:shape(), { dtype = dt, ctx = dev })
  check(C.ms_copy(ctx_handle[dev], H(t), H(self)))
  return t
end
function Tensor:cpu() return self:to("cpu") end
function Tensor:float() return self:to("f32") end
function Tensor:double() return self:to("f64") end

-- Numbers read from memory into Lua: LuaJIT keeps its own values in the NaN space of doubles, and its FFI
-- hands a double over bit for bit, so a NaN with another sign and payload than its own (uninitialised memory,
-- a crafted checkpoint, bf16 / f16 NaNs widened) became nil, a light userdata or a bad pointer in Lua (a
-- crash, or forged values in a recipe's hands).  Every NaN is read as Lua's own NaN, by its bits.
local NAN = 0 / 0
local HI = ffi.abi("le") and 1 or 0    -- the index of a double's high 32 bits

local function read_f32(out, buf, n)
  local bits = ffi.cast("const uint32_t *", buf)
  for i = 1, n do
    if bits[i - 1] % 0x80000000 > 0x7f800000 then out[i] = NAN else out[i] = buf[i - 1] end
  end
end

local function read_f64(out, buf, n)
  local words = ffi.cast("const uint32_t *", buf)
  for i = 1, n do
    local hi = words[2 * i - 2 + HI] % 0x80000000
    if hi > 0x7ff00000 or (hi == 0x7ff00000 and words[2 * i - 1 - HI] ~= 0) then out[i] = NAN
    else out[i] = buf[i - 1] end
  end
end

-- the most elements read into Lua at once (a Lua table of 2^27 numbers is 1 GiB, its transfer buffer as much
-- again): past it the FFI failed as "size of C type is unknown or too large", or memory ran out
local TOLIST_MAX = 2 ^ 27

--- The values as a flat Lua array of numbers (row-major).
function Tensor:tolist_flat()
  local n = self:numel()
  local out = {}
  if n == 0 then return out end
  if n > TOLIST_MAX then
    error(("tolist_flat: the tensor has %.0f elements, more than the %.0f (2^27) read into Lua at once; read a "
           .. "slice of it"):format(n, TOLIST_MAX), 2)
  end
  -- a Lua table of n numbers plus a transfer buffer: under a recipe's limits, checked first (an expanded view
  -- holds no quota, yet reads back as n elements)
  if alloc_guard then alloc_guard.host("reading a tensor into Lua", n * 16) end
  local dt = self:dtype()
  if dt == "f32" then     -- a plain transfer: no conversion op on the tensor's device
    local buf = ffi.new("float[?]", n)
    check(C.ms_tensor_read(ctx_of(self), H(self), buf, n * 4))
    read_f32(out, buf, n)
    return out
  end
  local buf = ffi.new("double[?]", n)
  if dt == "f64" then
    check(C.ms_tensor_read(ctx_of(self), H(self), buf, n * 8))
  else
    local host = empty(self:shape(), { dtype = "f64", device = "cpu" })
    check(C.ms_copy(ctx_handle[M.device("cpu")], H(host), H(self)))
    check(C.ms_tensor_read(ctx_handle[M.device("cpu")], H(host), buf, n * 8))
  end
  read_f64(out, buf, n)
  return out
end

--- Nested Lua tables of numbers (a number for a 0-dim tensor).
function Tensor:totable()
  local flat, shape = self:tolist_flat(), self:shape()
  if #shape == 0 then return flat[1] end
  local pos = 0
  local function build(d)
    local out = {}
    for i = 1, shape[d] do
      if d == #shape then pos = pos + 1 out[i] = flat[pos] else out[i] = build(d + 1) end
    end
    return out
  end
  return build(1)
end

--- The single value of a one-element tensor.
function Tensor:item()
  if self:numel() ~= 1 then error(("item(): tensor has %d elements"):format(self:numel()), 2) end
  return self:tolist_flat()[1]
end

-- ---------------------------------------------------------------------------------------------------
-- elementwise arithmetic
-- ---------------------------------------------------------------------------------------------------
local function broadcast_shapes(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then
    error(("broadcast_shapes: shapes must be tables of sizes (got %s and %s)"):format(core.show(a), core.show(b)), 2)
  end
  local n = math.max(#a, #b)
  local out = {}
  for i = 1, n do
    local x = a[#a - n + i] or 1
    local y = b[#b - n + i] or 1
    if x ~= y and x ~= 1 and y ~= 1 then
      error(("shapes [%s] and [%s] do not broadcast"):format(table.concat(a, ","), table.concat(b, ",")), 4)
    end
    out[i] = x == 1 and y or x
  end
  return out
end
M.broadcast_shapes = broadcast_shapes

local binary_ops = {
  add = C.MS_BINARY_ADD, sub = C.MS_BINARY_SUB, mul = C.MS_BINARY_MUL, div = C.MS_BINARY_DIV,
  pow = C.MS_BINARY_POW, maximum = C.MS_BINARY_MAXIMUM, minimum = C.MS_BINARY_MINIMUM,
  eq = C.MS_BINARY_EQ, ne = C.MS_BINARY_NE, lt = C.MS_BINARY_LT, le = C.MS_BINARY_LE,
  gt = C.MS_BINARY_GT, ge = C.MS_BINARY_GE,
}

-- out = a op b for any mix of tensors and numbers (at least one tensor); dst optional (in-place forms)
local function binary(op, a, b, dst)
  local code = binary_ops[op]
  local ta, tb = handle[a] ~= nil, handle[b] ~= nil
  -- a new result takes the operands' promoted dtype; fractions (division, a fractional or negative power, a
  -- fractional scalar) make an integer one f32.  An in-place dst keeps its own dtype (the C ABI's cast).
  local function result_dtype(dt, s)
    local frac = op == "div" or (s ~= nil and s ~= math.floor(s)) or (op == "pow" and s ~= nil and s < 0 and ta)
    return frac and fractional(dt) or dt
  end
  if ta and tb then
    dst = dst or empty(broadcast_shapes(a:shape(), b:shape()), { dtype = result_dtype(promote(a:dtype(), b:dtype())), ctx = M.ctx_object(a) })
    check(C.ms_binary(ctx_of(dst), H(dst), H(a), H(b), code), 3)
  elseif ta and type(b) == "number" then
    dst = dst or empty(a:shape(), { dtype = result_dtype(a:dtype(), b), ctx = M.ctx_object(a) })
    check(C.ms_binary_scalar(ctx_of(dst), H(dst), H(a), b, nil, code, 0), 3)
  elseif tb and type(a) == "number" then
    dst = dst or empty(b:shape(), { dtype = result_dtype(b:dtype(), a), ctx = M.ctx_object(b) })
    check(C.ms_binary_scalar(ctx_of(dst), H(dst), H(b), a, nil, code, 1), 3)
  else
    error(("%s: expected tensors or numbers (got %s and %s)"):format(op, type(a), type(b)), 3)
  end
  return dst
end

for op in pairs(binary_ops) do
  Tensor[op] = function(a, b) return binary(op, a, b) end
  Tensor[op .. "_"] = function(a, b) return binary(op, a, b, a) end
  M[op] = function(a, b, out)
    -- (a non-tensor out failed inside as "expected a moonstep tensor, got number")
    if out ~= nil then need_tensor(op, "out", out, 2) end
    return binary(op, a, b, out)
  end
end
Tensor.__add = function(a, b) return binary("add", a, b) end
Tensor.__sub = function(a, b) return binary("sub", a, b) end
Tensor.__mul = function(a, b) return binary("mul", a, b) end
Tensor.__div = function(a, b) return binary("div", a, b) end
Tensor.__pow = function(a, b) return binary("pow", a, b) end

local unary_ops = {
  neg = C.MS_UNARY_NEG, abs = C.MS_UNARY_ABS, sqrt = C.MS_UNARY_SQRT, rsqrt = C.MS_UNARY_RSQRT,
  exp = C.MS_UNARY_EXP, log = C.MS_UNARY_LOG, sign = C.MS_UNARY_SIGN, square = C.MS_UNARY_SQUARE,
  reciprocal = C.MS_UNARY_RECIPROCAL, tanh = C.MS_UNARY_TANH, sigmoid = C.MS_UNARY_SIGMOID,
  relu = C.MS_UNARY_RELU, sin = C.MS_UNARY_SIN, cos = C.MS_UNARY_COS,
}
-- the ops whose values are fractions: an integer tensor's result is f32 (neg, abs, sign, square and relu keep it)
local fractional_unary = { sqrt = true, rsqrt = true, exp = true, log = true, reciprocal = true, tanh = true,
                           sigmoid = true, sin = true, cos = true }
for op, code in pairs(unary_ops) do
  Tensor[op] = function(self)
    local dt = fractional_unary[op] and fractional(self:dtype()) or self:dtype()
    local dst = empty(self:shape(), { dtype = dt, ctx = M.ctx_object(self) })
    check(C.ms_unary(ctx_of(dst), H(dst), H(self), code))
    return dst
  end
  Tensor[op .. "_"] = function(self)
    check(C.ms_unary(ctx_of(self), H(self), H(self), code))
    return self
  end
  M[op] = function(t) return Tensor[op](need_tensor(op, "t", t, 2)) end
end
Tensor.__unm = function(a) return a:neg() end

local function clamp_into(dst, src, lo, hi)
  if lo ~= nil then core.check_value("clamp", "min", lo, "number", 3) end
  if hi ~= nil then core.check_value("clamp", "max", hi, "number", 3) end
  check(C.ms_clamp(ctx_of(dst), H(dst), H(src), lo or -math.huge, hi or math.huge), 3)
  return dst
end
function Tensor:clamp(lo, hi)
  return clamp_into(empty(self:shape(), { dtype = self:dtype(), ctx = M.ctx_object(self) }), self, lo, hi)
end
function Tensor:clamp_(lo, hi) return clamp_into(self, self, lo, hi) end

-- a scalar argument is a number or a one-element tensor (a device scalar)
local function scalar(x, what, name)
  if type(x) == "number" then return x, nil end
  local why = M.kinds.scalar(x)
  if why then error(("%s: %s must be %s (got %s)"):format(what, name, why, core.show(x)), 3) end
  return 0, H(x)
end

-- a new result of a, b (and c): the broadcast shape and the promoted dtype, made f32 for integer operands when
-- `frac` (the values may be fractions: binary()'s rule for div and a fractional scalar)
local function result_like(frac, a, b, c)
  local shape, dt = a:shape(), a:dtype()
  for _, t in ipairs { b, c } do
    if t then shape = broadcast_shapes(shape, t:shape()) dt = promote(dt, t:dtype()) end
  end
  if frac then dt = fractional(dt) end
  return empty(shape, { dtype = dt, ctx = M.ctx_object(a) })
end

-- a scalar whose values may be fractions: a fractional number, or a device scalar (its value unknown here)
local function fractional_scalar(x) return type(x) ~= "number" or x ~= math.floor(x) end

function M.lerp(a, b, w, out)
  need_tensor("lerp", "a", a, 2) need_tensor("lerp", "b", b, 2)
  if out ~= nil then need_tensor("lerp", "out", out, 2) end
  local v, vt = scalar(w, "lerp", "weight")
  out = out or result_like(fractional_scalar(w), a, b)
  check(C.ms_lerp(ctx_of(out), H(out), H(a), H(b), v, vt))
  return out
end
function Tensor:lerp(b, w) return M.lerp(self, b, w) end
function Tensor:lerp_(b, w) return M.lerp(self, b, w, self) end

function M.addcmul(a, b, c, value, out)
  need_tensor("addcmul", "a", a, 2) need_tensor("addcmul", "b", b, 2) need_tensor("addcmul", "c", c, 2)
  if out ~= nil then need_tensor("addcmul", "out", out, 2) end
  local v, vt = scalar(value == nil and 1 or value, "addcmul", "value")
  out = out or result_like(fractional_scalar(value == nil and 1 or value), a, b, c)
  check(C.ms_addcmul(ctx_of(out), H(out), H(a), H(b), H(c), v, vt))
  return out
end
function M.addcdiv(a, b, c, value, out)
  need_tensor("addcdiv", "a", a, 2) need_tensor("addcdiv", "b", b, 2) need_tensor("addcdiv", "c", c, 2)
  if out ~= nil then need_tensor("addcdiv", "out", out, 2) end
  local v, vt = scalar(value == nil and 1 or value, "addcdiv", "value")
  out = out or result_like(true, a, b, c)   -- (a division: fractions, as binary()'s div)
  check(C.ms_addcdiv(ctx_of(out), H(out), H(a), H(b), H(c), v, vt))
  return out
end
function Tensor:addcmul(b, c, v) return M.addcmul(self, b, c, v) end
function Tensor:addcmul_(b, c, v) return M.addcmul(self, b, c, v, self) end
function Tensor:addcdiv(b, c, v) return M.addcdiv(self, b, c, v) end
function Tensor:addcdiv_(b, c, v) return M.addcdiv(self, b, c, v, self) end

-- ---------------------------------------------------------------------------------------------------
-- reductions
-- ---------------------------------------------------------------------------------------------------
local reduce_ops = {
  sum = C.MS_REDUCE_SUM, mean = C.MS_REDUCE_MEAN, max = C.MS_REDUCE_MAX, min = C.MS_REDUCE_MIN,
  norm = C.MS_REDUCE_NORM2, sumsq = C.MS_REDUCE_SUMSQ, amax = C.MS_REDUCE_AMAX,
}
local function acc_dtype(dt) return (dt == "f64" or dt == "i32") and "f64" or (dt == "u8" and "f32" or dt) end

--- t:sum() -> number; t:sum(dim [, keepdim]) -> tensor.  Likewise mean, max, min, norm, sumsq, amax.
local function reduce(op, self, dim, keepdim)
  local code = reduce_ops[op]
  local ctx = M.ctx_object(self)
  if dim == nil then
    local dst = empty({}, { dtype = acc_dtype(self:dtype()) == "f64" and "f64" or "f32", ctx = ctx })
    check(C.ms_reduce(ctx_handle[ctx], H(dst), H(self), code, C.MS_DIM_ALL), 3)
    return dst:item()
  end
  local shape = self:shape()
  -- (a fractional dim would reach C truncated: sum(0.5) summed dim 0)
  if not integral(dim) then error(("%s: dim %s is not an integer"):format(op, tostring(dim)), 3) end
  -- (keepdim = "false" or 0 is true to Lua)
  if keepdim ~= nil then core.check_value(op, "keepdim", keepdim, "boolean", 3) end
  local d = dim < 0 and dim + #shape or dim
  if d < 0 or d >= #shape then
    error(("%s: dim %d out of range for a %d-dim tensor"):format(op, dim, #shape), 3)
  end
  if keepdim then shape[d + 1] = 1 else table.remove(shape, d + 1) end
  local dst = empty(shape, { dtype = acc_dtype(self:dtype()), ctx = ctx })
  check(C.ms_reduce(ctx_handle[ctx], H(dst), H(self), code, d), 3)
  return dst
end
for op in pairs(reduce_ops) do
  Tensor[op] = function(self, dim, keepdim) return reduce(op, self, dim, keepdim) end
  M[op] = function(t, dim, keepdim) return reduce(op, need_tensor(op, "t", t, 2), dim, keepdim) end
end

--- ms.dot(a, b) -> number (sum of products over all elements)
function M.dot(a, b)
  local ctx = M.ctx_object(a)
  local dst = empty({}, { dtype = acc_dtype(a:dtype()) == "f64" and "f64" or "f32", ctx = ctx })
  check(C.ms_dot(ctx_handle[ctx], H(dst), H(a), H(b)))
  return dst:item()
end
Tensor.dot = M.dot

-- ---------------------------------------------------------------------------------------------------
-- linear algebra
-- ---------------------------------------------------------------------------------------------------
--- ms.matmul(a, b, {trans_a=, trans_b=, alpha=, beta=, tf32=, out=, dtype=})
-- (a misspelt trans_b would silently multiply the untransposed operand, and trans_b = 0 or "false" transpose it)
local MATMUL_OPTIONS = { trans_a = "boolean", trans_b = "boolean", alpha = "number", beta = "number", tf32 = "boolean",
                         out = M.kinds.tensor, dtype = "string" }
function M.matmul(a, b, opts)
  opts = core.check_options("matmul", opts, MATMUL_OPTIONS, 2)
  need_tensor("matmul", "a", a, 2) need_tensor("matmul", "b", b, 2)
  local sa, sb = a:shape(), b:shape()
  if #sa < 2 or #sb < 2 then error("matmul: a and b need at least 2 dims", 2) end
  local m = opts.trans_a and sa[#sa] or sa[#sa - 1]
  local n = opts.trans_b and sb[#sb - 1] or sb[#sb]
  local out = opts.out
  if not out then
    local ba, bb = {}, {}
    for i = 1, #sa - 2 do ba[i] = sa[i] end
    for i = 1, #sb - 2 do bb[i] = sb[i] end
    local shape = broadcast_shapes(ba, bb)
    shape[#shape + 1], shape[#shape + 2] = m, n
    out = empty(shape, { dtype = opts.dtype or a:dtype(), ctx = M.ctx_object(a) })
  end
  local o = ffi.new("ms_matmul_options")
  o.trans_a, o.trans_b = opts.trans_a and 1 or 0, opts.trans_b and 1 or 0
  o.alpha, o.beta = opts.alpha or 1, opts.beta or 0
  o.allow_tf32 = opts.tf32 and 1 or 0
  check(C.ms_matmul(ctx_of(out), H(out), H(a), H(b), o))
  return out
end
Tensor.matmul = M.matmul

function M.eye(n, m, opts)
  if type(m) == "table" then opts, m = m, nil end
  core.check_options("eye", opts, NEW_OPTIONS, 2)
  -- (checked here: C named a missing n as "ms_eye: dst [] needs at least 2 dims")
  for _, a in ipairs { { "n", n }, { "m", m } } do
    if (a[1] == "n" or a[2] ~= nil) and not (integral(a[2]) and a[2] >= 0) then
      error(("eye: %s must be an integer >= 0 (got %s)"):format(a[1], core.show(a[2])), 2)
    end
  end
  local t = empty({ n, m or n }, opts)
  check(C.ms_eye(ctx_of(t), H(t)))
  return t
end

--- ms.diag(v) -> matrix with v on its diagonal; ms.diag(matrix) -> its diagonal (batched)
function M.diag(src)
  need_tensor("diag", "src", src, 2)
  local s = src:shape()
  local shape = {}
  for i = 1, #s - 1 do shape[i] = s[i] end
  if #s >= 2 and s[#s] == s[#s - 1] then
    -- a square (batched) matrix: extract
  else
    shape[#shape + 1] = s[#s]
    shape[#shape + 1] = s[#s]
  end
  local dst = empty(shape, { dtype = src:dtype(), ctx = M.ctx_object(src) })
  check(C.ms_diag(ctx_of(dst), H(dst), H(src)))
  return dst
end
Tensor.diag = M.diag

--- ms.eigh(a [, {vectors = false}]) -> w (ascending), v (eigenvectors in columns)
local EIGH_OPTIONS = { vectors = "boolean" }
function M.eigh(a, opts)
  opts = core.check_options("eigh", opts, EIGH_OPTIONS, 2)
  need_tensor("eigh", "a", a, 2)
  local s = a:shape()
  local ws = {}
  for i = 1, #s - 1 do ws[i] = s[i] end
  local ctx = M.ctx_object(a)
  local w = empty(ws, { dtype = a:dtype(), ctx = ctx })
  local v = opts.vectors ~= false and empty(s, { dtype = a:dtype(), ctx = ctx }) or nil
  check(C.ms_eigh(ctx_handle[ctx], H(w), v and H(v) or nil, H(a), core.out_int))
  return w, v
end

-- ---------------------------------------------------------------------------------------------------
-- indexing and printing
-- ---------------------------------------------------------------------------------------------------
Tensor.__index = function(self, k)
  if type(k) == "number" then return Tensor.select(self, 0, k) end
  return Tensor[k]
end
Tensor.__newindex = function(self, k, v)
  if type(k) == "number" then
    if type(v) ~= "number" and not M.is_tensor(v) then
      error(("t[%s] = v: v must be a number or a tensor (got %s)"):format(tostring(k), core.show(v)), 2)
    end
    local view = Tensor.select(self, 0, k)
    if type(v) == "number" then view:fill_(v) else view:copy_(v) end
    return
  end
  error("tensors have no assignable fields (tried to set '" .. tostring(k) .. "')", 2)
end
-- #t: LuaJIT keeps Lua 5.1's length for tables, which never calls __len, so on a stock LuaJIT #t is 0 (the
-- length of the table's empty array part); t:size(0) is dim 0.  Under LUAJIT_ENABLE_LUA52COMPAT it is dim 0.
Tensor.__len = function(self) local s = self:shape() return s[1] or 0 end

local function fmt_values(vals)
  local maxabs, allint, finite = 0, true, true
  for _, v in ipairs(vals) do
    if v ~= v or v == math.huge or v == -math.huge then finite = false
    else
      maxabs = math.max(maxabs, math.abs(v))
      if v ~= math.floor(v) then allint = false end
    end
  end
  local f
  if allint and maxabs < 1e9 then f = function(v) return ("%.0f"):format(v) end
  elseif maxabs ~= 0 and (maxabs >= 1e5 or maxabs < 1e-3) then f = function(v) return ("%.4e"):format(v) end
  else f = function(v) return ("%.4f"):format(v) end end
  local _ = finite
  local strs, width = {}, 0
  for i, v in ipairs(vals) do
    local s
    if v ~= v then s = "nan" elseif v == math.huge then s = "inf" elseif v == -math.huge then s = "-inf" else s = f(v) end
    strs[i] = s
    width = math.max(width, #s)
  end
  return strs, width
end

function Tensor:__tostring()
  local shape, n = self:shape(), self:numel()
  local meta = ("dtype=%s, device=%s, shape=[%s]"):format(self:dtype(), self:device(), table.concat(shape, ","))
  if n == 0 then return "tensor([], " .. meta .. ")" end
  local edge = n > 1000 and 3 or math.huge
  -- indices shown along each dim (with a gap marker after `edge` leading ones)
  local function shown(len)
    if len <= 2 * edge then
      local r = {}
      for i = 0, len - 1 do r[#r + 1] = i end
      return r
    end
    local r = {}
    for i = 0, edge - 1 do r[#r + 1] = i end
    r[#r + 1] = false
    for i = len - edge, len - 1 do r[#r + 1] = i end
    return r
  end
  -- Only the elements shown are read: a large tensor's values are first copied into a small one (`compact`,
  -- each dim cut to its 2 * edge shown indices, one copy per combination of the dims' leading and trailing
  -- ends); reading all of it failed past the FFI's array size, and read gigabytes to show a few numbers.
  local cshape, pos_of, gapped = {}, {}, {}
  for d = 1, #shape do
    local len = shape[d]
    if len > 2 * edge then
      cshape[d], gapped[#gapped + 1] = 2 * edge, d
      -- a shown index of dim d -> its place in compact's dim
      pos_of[d] = function(i) return i < edge and i or i - (len - 2 * edge) end
    else
      cshape[d], pos_of[d] = len, function(i) return i end
    end
  end
  local src = self
  if #gapped > 0 then
    src = empty(cshape, { dtype = self:dtype(), ctx = M.ctx_object(self) })
    for mask = 0, 2 ^ #gapped - 1 do
      local from, to = self, src
      for j, d in ipairs(gapped) do
        local tail = math.floor(mask / 2 ^ (j - 1)) % 2 == 1
        from = from:slice(d - 1, tail and shape[d] - edge or 0, tail and shape[d] or edge)
        to = to:slice(d - 1, tail and edge or 0, tail and 2 * edge or edge)
      end
      to:copy_(from)
    end
  end
  local flat = src:tolist_flat()
  local strides, acc = {}, 1
  for d = #cshape, 1, -1 do strides[d] = acc acc = acc * cshape[d] end
  local vals = {}
  local function collect(d, base)
    if d > #shape then vals[#vals + 1] = flat[base + 1] return end
    for _, i in ipairs(shown(shape[d])) do if i then collect(d + 1, base + pos_of[d](i) * strides[d]) end end
  end
  collect(1, 0)
  local strs, width = fmt_values(vals)
  local pos = 0
  local function render(d, indent)
    if d > #shape then pos = pos + 1 return (" "):rep(width - #strs[pos]) .. strs[pos] end
    local parts = {}
    for _, i in ipairs(shown(shape[d])) do parts[#parts + 1] = i and render(d + 1, indent .. " ") or "..." end
    local sep = d == #shape and ", " or (",\n" .. ("\n"):rep(#shape - d - 1) .. indent .. " ")
    return "[" .. table.concat(parts, sep) .. "]"
  end
  if #shape == 0 then return "tensor(" .. strs[1] .. ", " .. meta .. ")" end
  return "tensor(" .. render(1, "       ") .. ", " .. meta .. ")"
end

return M
