--[[
moonstep.shard -- which tensors are this rank's slice of a matrix split across ranks, so the fused steps that
need the whole matrix see it: ms.sinkgd_step calls ms_sinkgd_step_sharded when a member is registered here.

  local shard = require("moonstep.shard")
  shard.set(w, { dim = "rows", offset = 512, size = 4096 }, comm)   -- w: rows [512, 512 + w:size(-2)) of 4096
  shard.get(w)   --> { dim = "rows", offset = 512, global = 4096, comm = comm }
  shard.clear(w)

dim "rows" is the matrix's dim -2 (an nn.Linear weight's d_out: FSDP's split), "cols" its dim -1 (tensor
parallelism's row-parallel split), "none" the whole matrix (only the communicator registered).  A partial
slice needs a communicator; the slices of the ranks tiling [0, size) is the caller's to guarantee.  The
registry holds its tensors weakly: a tensor that goes away leaves it.
]]
local tensor = require("moonstep.tensor")
local comms = require("moonstep.comm")

local M = {}

local registry = setmetatable({}, { __mode = "k" })   -- tensor -> { dim =, offset =, global =, comm = }

local dims = { rows = true, cols = true, none = true }
local SPEC_KEYS = { dim = true, offset = true, size = true }

local function integer(v, what)
  -- (inf == floor(inf): the bound keeps it out, and past 2^53 a double no longer holds every integer)
  if type(v) ~= "number" or v ~= math.floor(v) or v < 0 or v >= 2 ^ 53 then
    error(("shard.set: %s must be an integer in [0, 2^53) (got %s)"):format(what, tostring(v)), 3)
  end
  return v
end

--- shard.set(t, {dim = "rows"|"cols"|"none", offset =, size = the global size of dim}, comm): t is this rank's
--- slice; comm (a ms.comm communicator) the world the slices are spread over (nil: one rank, whole slices only).
function M.set(t, spec, comm)
  if not tensor.is_tensor(t) then error("shard.set: expected a tensor, got " .. type(t), 2) end
  if type(spec) ~= "table" then error("shard.set: the shard must be a table {dim =, offset =, size =}", 2) end
  -- (a misspelt offset would fail as "must be an integer", but a stray key beside a whole slice ("none") is
  -- dropped silently)
  require("moonstep.core").check_keys("shard.set", spec, SPEC_KEYS, 2, "key")
  if not dims[spec.dim] then
    error(("shard.set: dim must be 'rows', 'cols' or 'none' (got %s)"):format(tostring(spec.dim)), 2)
  end
  local shape = t:shape()
  if #shape < 2 then
    error(("shard.set: a sharded tensor is a matrix or a stack of them [..., m, n]; got shape [%s]"):format(
          table.concat(shape, ",")), 2)
  end
  if comm ~= nil and comms.handle(comm) == nil then
    error("shard.set: comm must be a communicator (ms.comm.new / from_env), got " .. type(comm), 2)
  end
  local entry = { dim = spec.dim, comm = comm }
  if spec.dim ~= "none" then
    local here = shape[#shape - (spec.dim == "rows" and 1 or 0)]
    entry.offset, entry.global = integer(spec.offset, "offset"), integer(spec.size, "size")
    if entry.offset + here > entry.global then
      error(("shard.set: the tensor holds %d %s from offset %d, past the global size %d"):format(here,
            spec.dim == "rows" and "rows" or "columns", entry.offset, entry.global), 2)
    end
    if comm == nil and (entry.offset ~= 0 or here ~= entry.global) then
      error(("shard.set: %s [%d, %d) of %d is part of the matrix; pass the communicator the other parts are on")
            :format(spec.dim, entry.offset, entry.offset + here, entry.global), 2)
    end
  end
  registry[t] = entry
  return t
end

--- shard.get(t) -> {dim =, offset =, global =, comm =} or nil when t is not registered
function M.get(t) return registry[t] end

--- shard.clear(t): t is a whole tensor again
function M.clear(t) registry[t] = nil end

return M
