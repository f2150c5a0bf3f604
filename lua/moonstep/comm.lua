--[[
moonstep.comm -- communicators (moonstep.h, "Communicators"): collectives over the tensors of one context
per rank.  On CUDA contexts through NCCL, queued on the context's stream; on CPU contexts over TCP through
rank 0 (reduced in rank order, done when the call returns).

  local ms = require("moonstep")
  local comm = ms.comm.from_env()                 -- RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; ctx cuda:LOCAL_RANK
                                                  -- (cpu where no GPU is usable, or {ctx = ms.device("cpu")})
  local g = ms.randn({1024}, {ctx = comm:context()})
  comm:all_reduce(g, "avg")                       -- in place
  comm:all_gather(big, piece); comm:reduce_scatter(piece, big, "sum"); comm:broadcast(t, 0)
  comm:group(function() for _, p in ipairs(ps) do comm:broadcast(p, owner[p]) end end)   -- one NCCL group

Start the ranks with `moonstep launch -n N script.lua` (or torchrun).  Timeouts are in seconds.  The id
exchange alone (ms.comm.rendezvous) needs no GPU and no NCCL.
]]
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C
local check, H = core.check, tensor.handle

local M = {}
M.ID_BYTES = tonumber(C.MS_COMM_ID_SIZE)

local Comm = {}
Comm.__index = Comm
local handle = setmetatable({}, { __mode = "k" })   -- Comm -> cdata ms_comm * (owning)
local context_of = setmetatable({}, { __mode = "k" })

local ops = { sum = C.MS_COMM_SUM, max = C.MS_COMM_MAX, min = C.MS_COMM_MIN, avg = C.MS_COMM_AVG }

local function op_of(op, level)
  if op == nil then return C.MS_COMM_SUM end
  local v = ops[op]
  if v == nil then error(("op must be one of sum, max, min, avg (got %s)"):format(tostring(op)), level + 1) end
  return v
end

local function timeout_ms(seconds, level)
  if seconds == nil then return 0 end
  if type(seconds) ~= "number" or not (seconds > 0) or seconds * 1000 > 2 ^ 31 - 1 then
    error(("timeout must be a positive number of seconds (got %s)"):format(tostring(seconds)), level + 1)
  end
  return math.max(1, math.floor(seconds * 1000 + 0.5))
end

local function integer(v, name, level)
  -- (inf passes v == floor(v); past a C int's range the FFI would wrap it)
  if not core.kinds.integer.test(v) or math.abs(v) > core.INT_MAX then
    error(("%s must be an integer (got %s)"):format(name, tostring(v)), level + 1)
  end
  return v
end

-- The keys of each call's table (core.check_options; the values are checked where they are read): a misspelt
-- one (world_sise, timout) would leave its default in force, silently -- one rank, no timeout.
local function any() end
local RENDEZVOUS = { rank = any, world_size = any, id = any, addr = "string", port = any, timeout = any }
local NEW = { ctx = any, device = any }
for k, v in pairs(RENDEZVOUS) do NEW[k] = v end
local FROM_ENV = { ctx = any, device = any, timeout = any }

local function id_bytes(id, level)
  if type(id) ~= "string" or #id ~= M.ID_BYTES then
    error(("id must be a string of %d bytes (from ms.comm.unique_id() on rank 0; got %s)"):format(M.ID_BYTES,
          type(id) == "string" and (#id .. " bytes") or type(id)), level + 1)
  end
  return id
end

--- A new NCCL unique id (128-byte string), made on rank 0 and handed to every rank.
function M.unique_id()
  local buf = ffi.new("unsigned char[?]", M.ID_BYTES)
  check(C.ms_comm_unique_id(buf))
  return ffi.string(buf, M.ID_BYTES)
end

--- ms.comm.rendezvous{rank =, world_size =, id = (rank 0: the bytes to hand out), addr =, port =, timeout =}
--- -> the id (every rank).  addr/port default to MASTER_ADDR/MASTER_PORT.
function M.rendezvous(o)
  if type(o) ~= "table" then error("rendezvous takes a table {rank =, world_size =, id =, addr =, port =, timeout =}", 2) end
  core.check_options("rendezvous", o, RENDEZVOUS, 2)
  if o.addr ~= nil then core.c_string("rendezvous", "addr", o.addr, 2) end
  local rank, world = integer(o.rank, "rank", 2), integer(o.world_size, "world_size", 2)
  local buf = ffi.new("unsigned char[?]", M.ID_BYTES)
  if rank == 0 then ffi.copy(buf, id_bytes(o.id, 2), M.ID_BYTES) end
  check(C.ms_rendezvous(o.addr, o.port and integer(o.port, "port", 2) or 0, rank, world, timeout_ms(o.timeout, 2), buf))
  return ffi.string(buf, M.ID_BYTES)
end

local function wrap(p, ctx)
  local c = setmetatable({}, Comm)
  handle[c] = ffi.gc(p, C.ms_comm_free)
  context_of[c] = ctx
  return c
end

local borrowed = setmetatable({}, { __mode = "k" })   -- Comms over a communicator their caller frees

--- ms.comm.borrow(p, ctx): a Comm over the ms_comm * p that someone else owns and frees, after this Comm's
--- last use (the C embedding's ms_optimizer_set_comm); ctx: p's context, or one of the same device and stream.
function M.borrow(p, ctx)
  local c = setmetatable({}, Comm)
  handle[c] = p
  context_of[c] = ctx
  borrowed[c] = true
  return c
end

local function ctx_arg(o, default_device)
  if o.ctx ~= nil then
    if tensor.handle_ctx(o.ctx) == nil then error("ctx must be a moonstep context", 3) end
    return o.ctx
  end
  return tensor.device(o.device or default_device)
end

--- ms.comm.new{ctx =, rank =, world_size =, id =, addr =, port =, timeout =}: id (from ms.comm.unique_id()
--- on rank 0, the same on every rank) or the rendezvous at addr:port (default MASTER_ADDR/MASTER_PORT).
function M.new(o)
  o = o or {}
  if type(o) ~= "table" then error("comm.new takes a table of options", 2) end
  core.check_options("comm.new", o, NEW, 2)
  if o.addr ~= nil then core.c_string("comm.new", "addr", o.addr, 2) end
  local ctx = ctx_arg(o, nil)
  local opts = ffi.new("ms_comm_options")
  opts.rank = o.rank ~= nil and integer(o.rank, "rank", 2) or 0
  opts.world_size = o.world_size ~= nil and integer(o.world_size, "world_size", 2) or 1
  local id
  if o.id ~= nil then
    id = ffi.new("unsigned char[?]", M.ID_BYTES)
    ffi.copy(id, id_bytes(o.id, 2), M.ID_BYTES)
    opts.unique_id = id
  end
  opts.addr = o.addr
  opts.port = o.port ~= nil and integer(o.port, "port", 2) or 0
  opts.timeout_ms = timeout_ms(o.timeout, 2)
  local out = ffi.new("ms_comm *[1]")
  check(C.ms_comm_new(tensor.handle_ctx(ctx), opts, out))
  return wrap(out[0], ctx)
end

--- ms.comm.from_env{ctx =, timeout =}: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher; the
--- context defaults to cuda:LOCAL_RANK (one GPU per rank), or to the CPU where no GPU is usable.
function M.from_env(o)
  o = o or {}
  if type(o) ~= "table" then error("comm.from_env takes a table of options", 2) end
  core.check_options("comm.from_env", o, FROM_ENV, 2)
  local gpus = C.ms_device_count(C.MS_DEVICE_CUDA) > 0
  local ctx = ctx_arg(o, gpus and "cuda:" .. (os.getenv("LOCAL_RANK") or "0") or "cpu")
  local out = ffi.new("ms_comm *[1]")
  check(C.ms_comm_new_from_env(tensor.handle_ctx(ctx), timeout_ms(o.timeout, 2), out))
  return wrap(out[0], ctx)
end

local function self_handle(c)
  local h = handle[c]
  if h == nil then error("expected a communicator (ms.comm.new), got " .. type(c), 3) end
  return h
end

function Comm:rank() return tonumber(C.ms_comm_rank(self_handle(self))) end
function Comm:size() return tonumber(C.ms_comm_size(self_handle(self))) end
function Comm:context() self_handle(self) return context_of[self] end

--- ms.comm.handle(c): the ms_comm * under a Comm (valid while c lives), for other modules' FFI calls
--- (moonstep.fused's sharded SinkGD); nil when c is not a live Comm.
function M.handle(c) return handle[c] end

--- comm:all_reduce(t [, op]) in place, or comm:all_reduce(dst, src [, op]); op: "sum" (default), max, min, avg.
function Comm:all_reduce(dst, src, op)
  if type(src) == "string" or src == nil then src, op = dst, src end
  check(C.ms_comm_all_reduce(self_handle(self), H(dst), H(src), op_of(op, 2)))
  return dst
end

--- comm:broadcast(t, root): t <- root's t on every rank.
function Comm:broadcast(t, root)
  check(C.ms_comm_broadcast(self_handle(self), H(t), integer(root or 0, "root", 2)))
  return t
end

--- comm:all_gather(dst, src): dst <- the ranks' src in rank order ([world, ...] or dim 0 times world).
function Comm:all_gather(dst, src)
  check(C.ms_comm_all_gather(self_handle(self), H(dst), H(src)))
  return dst
end

--- comm:reduce_scatter(dst, src [, op]): dst <- this rank's slice of op over the ranks' src.
function Comm:reduce_scatter(dst, src, op)
  check(C.ms_comm_reduce_scatter(self_handle(self), H(dst), H(src), op_of(op, 2)))
  return dst
end

--- comm:group_begin() / comm:group_end(): the collectives between them are one group (NCCL: one launch;
--- CPU: they run at once).  Groups nest; every rank makes the same calls.
function Comm:group_begin()
  check(C.ms_comm_group_begin(self_handle(self)))
  return self
end
function Comm:group_end()
  check(C.ms_comm_group_end(self_handle(self)))
  return self
end

local function packed(...) return { n = select("#", ...), ... } end

--- comm:group(fn, ...): fn(...) inside one group, which is ended even when fn fails (fn's error is
--- raised then, after the group's end); returns fn's results.
function Comm:group(fn, ...)
  if type(fn) ~= "function" then error("group takes a function (got " .. type(fn) .. ")", 2) end
  check(C.ms_comm_group_begin(self_handle(self)))
  local res = packed(pcall(fn, ...))
  local ended = C.ms_comm_group_end(handle[self])
  if not res[1] then error(res[2], 0) end
  check(ended)
  return unpack(res, 2, res.n)
end

--- comm:abort([why]): gives the communicator up after an error on this rank that the others cannot see; their
--- current or next collective fails at once, naming this rank and why (CPU communicators; NCCL's refuse).
function Comm:abort(why)
  check(C.ms_comm_abort(self_handle(self), why ~= nil and tostring(why) or nil))
  return self
end

--- Destroys the communicator now (on every rank) rather than at garbage collection.
function Comm:free()
  local h = handle[self]
  if h ~= nil and not borrowed[self] then
    handle[self] = nil
    C.ms_comm_free(ffi.gc(h, nil))
  end
end

Comm.__tostring = function(self)
  local h = handle[self]
  if h == nil then return "moonstep.Comm(freed)" end
  return ("moonstep.Comm(rank %d of %d)"):format(self:rank(), self:size())
end

-- ---------------------------------------------------------------------------------------------------
-- a free TCP port on 127.0.0.1 (the launcher's rendezvous): bind port 0, read what the kernel chose
-- ---------------------------------------------------------------------------------------------------
pcall(ffi.cdef, [[
struct ms_sockaddr_in4 { uint16_t family; uint16_t port; uint32_t addr; uint8_t zero[8]; };
int socket(int domain, int type, int protocol);
int bind(int fd, const void *addr, uint32_t len);
int getsockname(int fd, void *addr, uint32_t *len);
int close(int fd);
]])

function M.free_port()
  local fd = ffi.C.socket(2, 1, 0)                 -- AF_INET, SOCK_STREAM
  if fd < 0 then error("free_port: socket() failed", 2) end
  local a = ffi.new("struct ms_sockaddr_in4")
  a.family = 2
  ffi.copy(ffi.cast("uint8_t *", a) + 4, "\127\0\0\1", 4)   -- 127.0.0.1, network order
  local len = ffi.new("uint32_t[1]", ffi.sizeof(a))
  local ok = ffi.C.bind(fd, ffi.cast("void *", a), ffi.sizeof(a)) == 0 and ffi.C.getsockname(fd, ffi.cast("void *", a), len) == 0
  ffi.C.close(fd)
  if not ok then error("free_port: cannot bind a port on 127.0.0.1", 2) end
  local p = ffi.cast("uint8_t *", a) + 2
  return p[0] * 256 + p[1]
end

return M
