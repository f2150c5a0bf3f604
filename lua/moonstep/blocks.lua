--[[
moonstep.blocks -- the block plan of Shampoo on stacked blocks (DASH; research/dash.md §1.4).

  local plan = ms.block_plan({{name = "w", shape = {300, 70}}, {name = "norm", shape = {300}}}, {block_size = 64})

block_size defaults to 1024.

Every parameter is viewed as a matrix: [d0, d1, ..., dk] as [d0, d1 * ... * dk] (the view moonstep.h's
ms_block uses), a 1-D parameter of n elements as [n, 1], a 0-dim one as [1, 1].  Both dims are cut into pieces
of block_size, the last piece of each dim taking the remainder, so any shape is accepted (DistributedShampoo's
rule; DASH itself refuses shapes with remainders in both dims) and every block is at most B x B.

  2-D rule (parameters of 2 or more dims): block G (r x c) has a left factor L (r x r) and a right factor
    R (c x c), both with root 4: the update is L^(-1/4) G R^(-1/4).
  1-D rule (parameters of 0 or 1 dims; DASH's Shampoo-as-AdaGrad path, research/dash.md §1.3): blocks are
    (b, 1) pieces of the vector with a left factor only (b x b, root 2): the update is L^(-1/2) g.

Blocks of one size (and rule) form a *stack* (key "r x c", "b x 1v" for the 1-D rule), filled in parameter
order, each parameter's blocks in row-major order of its grid.  Factors of one (size, root) form a *factor
stack* (key "<size>p<root>"); the L factors of a stack occupy one contiguous slice [offset, offset + n) of
their factor stack and its R factors another, so L <- beta L + (1 - beta) G G^T is one batched matmul into a
slice view.  Stacks are ordered by rule (2-D first), then rows and columns, descending; factor stacks by root
(4 first), then size, descending; slices in stack order, L before R.

The plan (plain Lua tables, no tensors):
  plan.block_size
  plan.params[i]  = {name, shape, rows, cols, one_dim, blocks = {{stack = key, slot = j}, ...}}   (slot 0-based)
  plan.stacks[s]  = {key, r, c, one_dim, n, blocks = {{param = i, row0, col0}, ...},
                     left = {factor = key, offset}, right = {factor = key, offset} or nil}
  plan.factors[f] = {key, size, root, n}
  plan.stack_by_key, plan.factor_by_key
  plan.layout     = a string naming every block ("<stack>:<param>@<row0>,<col0> ...;"): equal plans, equal strings
]]
local M = {}

local function view_dims(shape)
  if #shape == 0 then return 1, 1 end
  local cols = 1
  for i = 2, #shape do cols = cols * shape[i] end
  return shape[1], cols
end

-- pieces of n of at most B: starts and sizes
local function pieces(n, B)
  local out = {}
  for start = 0, n - 1, B do out[#out + 1] = { start, math.min(B, n - start) } end
  return out
end

local function check_params(params, level)
  if type(params) ~= "table" then error("block_plan: params must be an array of {name=, shape=}", level + 1) end
  for i, p in ipairs(params) do
    if type(p) ~= "table" or type(p.name) ~= "string" or type(p.shape) ~= "table" then
      error(("block_plan: params[%d] must be {name = <string>, shape = {...}}"):format(i), level + 1)
    end
    for d, v in ipairs(p.shape) do
      -- (inf passes v == floor(v), and its pieces would never end)
      if type(v) ~= "number" or v ~= math.floor(v) or v < 0 or v == math.huge then
        error(("block_plan: params[%d] ('%s') shape[%d] = %s is not a size"):format(i, p.name, d, tostring(v)), level + 1)
      end
    end
  end
end

--- ms.block_plan(params, {block_size = B (default 1024)}) -> plan (see the header of this file)
function M.plan(params, opts)
  opts = opts or {}
  -- (a misspelt key would otherwise plan with 1024 silently)
  if type(opts) ~= "table" then error(("block_plan: options must be a table (got %s)"):format(type(opts)), 2) end
  require("moonstep.core").check_keys("block_plan", opts, { block_size = true }, 2)
  local B = opts.block_size or 1024
  -- (inf passes B == floor(B))
  if type(B) ~= "number" or B ~= math.floor(B) or B < 1 or B == math.huge then
    error(("block_plan: block_size must be an integer >= 1 (got %s)"):format(tostring(B)), 2)
  end
  check_params(params, 2)
  local plan = { block_size = B, params = {}, stacks = {}, factors = {}, stack_by_key = {}, factor_by_key = {} }

  -- blocks, gathered into stacks by size and rule
  for i, p in ipairs(params) do
    local shape = {}
    for d, v in ipairs(p.shape) do shape[d] = v end
    local rows, cols = view_dims(shape)
    local one_dim = #shape < 2
    local entry = { name = p.name, shape = shape, rows = rows, cols = cols, one_dim = one_dim, blocks = {} }
    plan.params[i] = entry
    for _, rp in ipairs(pieces(rows, B)) do
      for _, cp in ipairs(pieces(cols, B)) do
        local r, c = rp[2], cp[2]
        local key = ("%dx%d%s"):format(r, c, one_dim and "v" or "")
        local s = plan.stack_by_key[key]
        if not s then
          s = { key = key, r = r, c = c, one_dim = one_dim, n = 0, blocks = {} }
          plan.stack_by_key[key] = s
          plan.stacks[#plan.stacks + 1] = s
        end
        s.blocks[#s.blocks + 1] = { param = i, row0 = rp[1], col0 = cp[1] }
        s.n = s.n + 1
      end
    end
  end
  table.sort(plan.stacks, function(a, b)
    if a.one_dim ~= b.one_dim then return not a.one_dim end
    if a.r ~= b.r then return a.r > b.r end
    return a.c > b.c
  end)
  for _, s in ipairs(plan.stacks) do
    for j, blk in ipairs(s.blocks) do
      local e = plan.params[blk.param].blocks
      e[#e + 1] = { stack = s.key, slot = j - 1 }
    end
  end

  -- factor stacks: sizes first, then slices in stack order
  local function factor(size, root)
    local key = ("%dp%d"):format(size, root)
    local f = plan.factor_by_key[key]
    if not f then
      f = { key = key, size = size, root = root, n = 0 }
      plan.factor_by_key[key] = f
      plan.factors[#plan.factors + 1] = f
    end
    return f
  end
  for _, s in ipairs(plan.stacks) do
    factor(s.r, s.one_dim and 2 or 4)
    if not s.one_dim then factor(s.c, 4) end
  end
  table.sort(plan.factors, function(a, b)
    if a.root ~= b.root then return a.root > b.root end
    return a.size > b.size
  end)
  for _, s in ipairs(plan.stacks) do
    local f = plan.factor_by_key[("%dp%d"):format(s.r, s.one_dim and 2 or 4)]
    s.left = { factor = f.key, offset = f.n }
    f.n = f.n + s.n
    if not s.one_dim then
      f = plan.factor_by_key[("%dp4"):format(s.c)]
      s.right = { factor = f.key, offset = f.n }
      f.n = f.n + s.n
    end
  end

  local parts = {}
  for _, s in ipairs(plan.stacks) do
    local names = {}
    for j, blk in ipairs(s.blocks) do
      names[j] = ("%s@%d,%d"):format(plan.params[blk.param].name, blk.row0, blk.col0)
    end
    parts[#parts + 1] = s.key .. ":" .. table.concat(names, " ")
  end
  plan.layout = table.concat(parts, ";")
  return plan
end

-- The loops above run as many times as the shapes and block_size say, numbers an untrusted recipe chooses
-- (ms.block_plan is in its sandbox): compiled, they would run out of reach of its instruction and memory hook
-- ({2^40, 1} in blocks of 1 grew the heap to 13 GB under a 256 MB limit).  A plan is made once per group, so
-- the interpreter costs nothing that matters.
if jit then
  jit.off(pieces)
  jit.off(M.plan, true)
end

return M
