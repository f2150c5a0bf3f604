--[[
moonstep.graph -- capture a sequence of ops on a CUDA context and replay it (ms_graph_* in moonstep.h).

  local graph = require("moonstep.graph")
  local lr = ms.full({1}, 1e-3, {device = "cuda"})          -- a device scalar the ops read
  step()                                                    -- run once first: temporaries get cached
  local g = graph.capture("cuda", step)                     -- step's ops are recorded, not run
  lr:fill_(5e-4); g:launch()                                -- replays with the new value

While a context captures, its allocations come only from its pool's cache, host transfers and syncs are
refused, and a failing op makes the capture fail (moonstep.h, "Graphs").  Tensors the captured ops use
must outlive the graph.

  graph.state(ctx)              -- "none", "graph" (a moonstep capture) or "foreign" (the stream's owner
                                --   captures it: a trainer's torch.cuda.graph)
  graph.join(ctx, fn)           -- runs fn inside the owner's capture (ms_graph_join / ms_graph_leave)

The optimizer captures its own steps (opt:capture(), moonstep.optim); this module is for sequences of ops.
]]
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C

local M = {}

local Graph = {}
Graph.__index = Graph

local out_graph = ffi.new("ms_graph *[1]")

--- Runs fn() with ctx (a Context or a device name) capturing, and returns the captured Graph.  An error
--- in fn, or an op that failed during the capture, ends the capture and is raised.
function M.capture(ctx, fn)
  if type(fn) ~= "function" then error("graph.capture: fn must be a function (got " .. type(fn) .. ")", 2) end
  ctx = tensor.device(ctx)
  local h = tensor.handle_ctx(ctx)
  core.check(C.ms_graph_begin(h), 2)
  local ok, err = pcall(fn)
  local st = C.ms_graph_end(h, out_graph)
  if not ok then
    if st == 0 then C.ms_graph_free(out_graph[0]) end
    error(err, 2)
  end
  core.check(st, 2)
  return setmetatable({ ctx = ctx, h = ffi.gc(out_graph[0], C.ms_graph_free) }, Graph)
end

local state_names = { [0] = "none", [1] = "graph", [2] = "foreign" }

--- Who captures ctx's stream now: "none", "graph" (between ms_graph_begin and ms_graph_end) or "foreign".
function M.state(ctx)
  return state_names[tonumber(C.ms_ctx_is_capturing(tensor.handle_ctx(tensor.device(ctx))))]
end

--- Runs fn() while ctx's stream is being captured by its owner (state "foreign"), so that the ops fn calls
--- on ctx are recorded into the owner's graph with the memory rules of a capture (ms_graph_join); returns
--- fn's results.  An error in fn ends the join and is raised.
function M.join(ctx, fn)
  if type(fn) ~= "function" then error("graph.join: fn must be a function (got " .. type(fn) .. ")", 2) end
  local h = tensor.handle_ctx(tensor.device(ctx))
  core.check(C.ms_graph_join(h), 2)
  local res = { pcall(fn) }
  local st = C.ms_graph_leave(h)
  if not res[1] then error(res[2], 2) end
  core.check(st, 2)
  return unpack(res, 2, table.maxn(res))
end

--- Queues one replay on the graph's context (asynchronous, like any op).
function Graph:launch()
  if self.h == nil then error("graph: launch after free", 2) end
  core.check(C.ms_graph_launch(tensor.handle_ctx(self.ctx), self.h), 2)
end

--- Number of operations (graph nodes) the capture recorded.
function Graph:num_nodes()
  if self.h == nil then return 0 end
  return tonumber(C.ms_graph_num_nodes(self.h))
end

--- Frees the graph now (the garbage collector does it otherwise); idempotent.
function Graph:free()
  if self.h ~= nil then
    C.ms_graph_free(ffi.gc(self.h, nil))
    self.h = nil
  end
end

Graph.__tostring = function(self)
  return ("moonstep.Graph(%s, %d nodes)"):format(self.ctx:name(), self:num_nodes())
end

return M
