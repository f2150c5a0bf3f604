--[[
The sandbox for untrusted recipes (DESIGN.md, "Loading"; moonstep.recipe, "the sandbox"): real escape
attempts, each of which must end in an error, in bounded time, with the trusted side unchanged; and
legitimate untrusted recipes that must still work.
]]
local ms = H.ms
local R = ms.recipe

-- a recipe whose pieces run the given code: top level, validate, route, init, plan, step
local function recipe_src(parts)
  return ([[
%s
return {
  name = "evil", version = 1,
  options = { lr = { default = 0.1, type = "number" } },
  validate = function(o) %s end,
  route = function(p, o) %s return "r" end,
  routes = { r = {
    init = function(group, o) %s end,
    plan = function(group, o, ctx) %s return "step" end,
    step = function(group, o, ctx) %s end,
  } },
}]]):format(parts.top or "", parts.validate or "", parts.route or "", parts.init or "", parts.plan or "",
             parts.step or "")
end

-- loads the recipe untrusted, builds an optimizer over one parameter and takes `steps` steps
local function run(parts, settings, steps)
  local r = R.load_string(recipe_src(parts), "=evil")
  local p, g = ms.randn({ 4, 3 }), ms.randn({ 4, 3 })
  local opt = ms.optim.new(r, { { name = "w", param = p, grad = g } }, {}, settings)
  for _ = 1, steps or 1 do opt:step() end
  return opt, p
end

-- asserts that fn fails with a message containing `want` (plain text) in less than `limit` seconds
local function fails(fn, want, limit)
  local t0 = os.clock()
  local ok, err = pcall(fn)
  local dt = os.clock() - t0
  assert.is_false(ok, "expected an error containing '" .. want .. "'")
  assert.truthy(tostring(err):find(want, 1, true), ("error %q lacks %q"):format(tostring(err), want))
  assert.truthy(dt < (limit or 2), ("took %.2f s"):format(dt))
  return tostring(err)
end

-- the trusted side's state an untrusted recipe must not be able to change
local function snapshot()
  local s = { hook = debug.gethook(), strindex = getmetatable("").__index }
  for _, lib in ipairs { "string", "math", "table" } do
    for k, v in pairs(_G[lib]) do s[lib .. "." .. k] = v end
  end
  for k, v in pairs(ms) do s["ms." .. k] = v end
  for k, v in pairs(ms.Tensor) do s["Tensor." .. k] = v end
  for k, v in pairs(require("moonstep.tensor").Context) do s["Context." .. k] = v end
  for k, v in pairs(ms.json) do s["json." .. k] = v end
  return s
end
local function same_as(before)
  local now = snapshot()
  for k, v in pairs(before) do assert.equals(v, now[k], "trusted " .. k .. " changed") end
  for k in pairs(now) do assert.is_not_nil(before[k], "trusted " .. k .. " appeared") end
end

describe("the recipe sandbox", function()
  local before
  before_each(function() before = snapshot() end)
  after_each(function() same_as(before) end)

  it("has none of the forbidden globals", function()
    local uses = {
      io = "io.open('/etc/passwd')", os = "os.execute('true')", ffi = "ffi.C.abort()", require = "require('ffi')",
      debug = "debug.getregistry()", package = "package.loaded.ffi", load = "load('return 1')",
      loadstring = "loadstring('return 1')", dofile = "dofile('/dev/null')", loadfile = "loadfile('/dev/null')",
      collectgarbage = "collectgarbage('count')", setfenv = "setfenv(1, {})", getfenv = "getfenv(1).x",
      getmetatable = "getmetatable('').__index", setmetatable = "setmetatable({}, {})", rawget = "rawget(ms, 'x')",
      rawset = "rawset(ms, 'x', 1)", newproxy = "newproxy(true)", coroutine = "coroutine.create(print)",
      jit = "jit.on()", bit = "bit.band(1, 1)", module = "module('x')", gcinfo = "gcinfo()", print = "print(1)",
    }
    for name, use in pairs(uses) do
      local code = "local _ = " .. use
      fails(function() R.load_string(recipe_src { top = code }, "=g_" .. name) end, "recipe =g_" .. name)
      -- README's refused libraries are named as refused; the rest are simply absent (nil, as in plain Lua)
      local refused = not ({ newproxy = true, bit = true, module = true, gcinfo = true, print = true })[name]
      fails(function() R.load_string(recipe_src { top = code }, "=g_" .. name) end,
            refused and ("'%s' is not available to a sandboxed recipe"):format(name) or "(a nil value)")
    end
    -- the same code runs when trusted: the failures above come from the sandbox, not from the code
    assert.equals("table", type(R.load_string(recipe_src { top = "local x = io.open and package.loaded" }, "=t",
                                               { trusted = true })))
  end)

  it("refuses bytecode in every form", function()
    fails(function() R.load_string(string.dump(function() end), "=bc") end, "bytecode")
    fails(function() R.load_string(recipe_src { top = "local s = string.dump(function() end)" }, "=d") end, "dump")
    -- string methods come from the safe table while a recipe runs: ("").dump is not there
    fails(function() R.load_string(recipe_src { top = "local s = ('').dump(function() end)" }, "=d2") end,
          "attempt to call field 'dump'")
    fails(function() run { step = "local f = ('x').dump; f(function() end)" } end, "a nil value")
    -- a text chunk that hides a binary one cannot be loaded by anything the sandbox offers
    fails(function() R.load_string("--\n" .. string.dump(function() end), "=bc2") end, "recipe =bc2")
  end)

  it("hands out no shared metatable and no writable shared table", function()
    local tries = {
      "string.x = 1", "math.pi = 3", "table.insert = nil", "ms.zeros = nil", "ms.json.decode = nil",
      "ms.x = 1", "_G.ms = nil; ms.zeros({1})",
      "local t = ms.zeros({2}); t.x = 1",
      "local t = ms.zeros({2}); t.__index.zeros = 1",               -- __index is a function
      "local t = ms.zeros({2}); t.__index(t, 'sum').x = 1",
      "local c = ms.zeros({2}):context(); c.__index.name = 1",       -- Context's __index too
      "local c = ms.zeros({2}):context(); c.x = 1; if c.x then error('context writable') end",
      "local n = ms.json.decode('[null]')[1]; n.x = 1",              -- the shared json.null
      "if ('').rep ~= string.rep then error('string methods are not the safe ones') end; ('').x = 1",
      "local mt = ms.zeros({2}).__metatable; if type(mt) ~= 'string' then error('metatable reachable') end; mt.x = 1",
    }
    for i, code in ipairs(tries) do
      fails(function() run { step = code } end, "", 2)
      local ok = pcall(run, { step = code })
      assert.is_false(ok, "escape " .. i .. " succeeded: " .. code)
    end
    -- rawequal stays (harmless) and reports the facades are not the real tables
    local o = run { step = "ctx.report('same', rawequal(ms.zeros, ms.zeros) and not rawequal(string, ('').sub))" }
    assert.is_true(o:stats().last.reports.same)
  end)

  it("lets no cdata, userdata, thread or address be reached from anything it can walk", function()
    -- the walker runs inside the sandbox, in step: everything reachable from _G, ms, tensors, contexts,
    -- the group, its members, the options and the step context, including what methods and facade
    -- functions return or raise when called with plausible arguments
    local walker = [[
      local seen, bad, visited = {}, {}, 0
      local function note(path, v)
        local tv = type(v)
        if tv ~= "nil" and tv ~= "boolean" and tv ~= "number" and tv ~= "string" and tv ~= "table" and tv ~= "function" then
          bad[#bad + 1] = path .. " is a " .. tv
        end
        local s = tostring(v)
        if s:find("cdata", 1, true) or s:find("0x%x%x%x%x") then bad[#bad + 1] = path .. " prints as " .. s end
      end
      local walk
      local methods = {"shape", "strides", "dtype", "device", "context", "numel", "dim", "is_contiguous",
                       "tolist_flat", "clone", "contiguous", "t", "flatten", "float", "cpu", "name", "device_type",
                       "mem_stats", "sync", "__index", "__tostring", "__metatable", "__len", "__gc", "__newindex"}
      -- a method's results are explored for the first two receivers of each kind (tensor dtype, context):
      -- every kind of object is still walked, without building a tree of tens of thousands of tensors
      local explored = {}
      walk = function(path, v, depth)
        note(path, v)
        if type(v) ~= "table" or seen[v] or depth > 6 then return end
        seen[v] = true
        visited = visited + 1
        for k, x in pairs(v) do note(path .. "[key]", k) walk(path .. "." .. tostring(k), x, depth + 1) end
        -- tensors and contexts have no fields: look through their methods
        local kind = ms.is_tensor(v) and "tensor " .. v:dtype() or tostring(v):find("Context", 1, true) and "context"
        if kind and (explored[kind] or 0) < 2 then
          explored[kind] = (explored[kind] or 0) + 1
          for _, m in ipairs(methods) do
            local f = v[m]
            note(path .. ":" .. m, f)
            if type(f) == "function" then
              local res = { pcall(f, v) }
              for i = 1, #res do walk(path .. ":" .. m .. "()[" .. i .. "]", res[i], depth + 1) end
            elseif type(f) == "table" then walk(path .. "." .. m, f, depth + 1) end
          end
        end
      end
      walk("_G", _G, 0)
      walk("group", group, 0)
      walk("o", o, 0)
      walk("ctx", ctx, 0)
      local t = ms.randn({3, 2})
      local args = { {}, {t}, {t, t}, {t, 2}, {{2, 2}}, {{2, 2}, {dtype = "f64"}}, {2}, {"x"}, {{params = {t}, grads = {t}}} }
      for _, name in ipairs {"empty", "full", "zeros", "ones", "zeros_like", "empty_like", "tensor", "rand", "randn",
                              "is_tensor", "broadcast_shapes", "lerp", "addcmul", "addcdiv", "dot", "matmul", "eye",
                              "diag", "eigh", "add", "mul", "sqrt", "sum", "norm", "adamw_step", "sgd_step",
                              "foreach_sumsq", "foreach_scale", "sinkgd_step", "adamw8_step", "adamw8_qmap"} do
        for j, a in ipairs(args) do
          local res = { pcall(ms[name], unpack(a)) }
          for i = 1, #res do walk(name .. "#" .. j .. "[" .. i .. "]", res[i], 1) end
        end
      end
      ctx.report("bad", table.concat(bad, "; "))
      ctx.report("visited", visited)
    ]]
    local o = run({ step = walker }, { sandbox = { quota = 2 ^ 30, instructions = 1e10 } })
    local rep = o:stats().last.reports
    assert.equals("", rep.bad)
    assert.truthy(rep.visited > 50, "the walk reached only " .. tostring(rep.visited) .. " tables")
  end)

  it("stops endless loops anywhere in a recipe, in bounded time, naming the recipe", function()
    local loops = {
      "while true do end",
      "local i = 0; repeat i = i + 1 until false",
      "for i = 1, 1e15 do end",
      "while true do pcall(function() while true do end end) end",            -- swallowing the error
      "while true do xpcall(function() while true do end end, function(e) return e end) end",
      "local function f() return f() end f()",                                -- a tail-call loop
      "string.gsub(('x'):rep(100), '.', function() while true do end end)",
      "local t = {3, 2, 1}; table.sort(t, function() while true do end end)",
    }
    for _, where in ipairs { "top", "validate", "route", "init", "plan", "step" } do
      for _, loop in ipairs(loops) do
        local msg = fails(function() run({ [where] = loop }, { sandbox = { instructions = 2e7 } }) end,
                          "instruction limit", 2)
        assert.truthy(msg:find("recipe =evil", 1, true) or msg:find("recipe evil", 1, true), msg)
      end
    end
    -- the default limit stops it too (in about a quarter of a second here)
    fails(function() run { step = "while true do end" } end, "instruction limit of 100000000", 2)
  end)

  it("stops library calls whose work the recipe's arguments set, not its data", function()
    -- table.insert(t, pos, v) shifts t[pos .. #t] up one in C, where the hook never runs: a negative pos made
    -- one call loop 2^31 times (about 20 s here) under an instruction limit that stops a loop in 0.05 s
    fails(function() run({ step = "table.insert({}, -2^31 + 2, 1)" }, { sandbox = { instructions = 2e7 } }) end,
          "table.insert", 2)
    fails(function() run({ step = "table.insert({}, '-2147483646', 1)" }) end, "table.insert", 2)
    local o = run { step = [[
      local t = {1, 3}
      table.insert(t, 2, 2) table.insert(t, 4) table.insert(t, 5, 5) table.insert(t, 1, 0)
      ctx.report('t', table.concat(t, ','))]] }
    assert.equals("0,1,2,3,4,5", o:stats().last.reports.t)
  end)

  it("stops trusted helpers whose loops the recipe's numbers size (ms.block_plan)", function()
    -- the plan's loops run once per block; compiled, they ran out of the hook's reach: this plan of 2^21
    -- blocks once finished (3.6 s, 1.1 GB) under an instruction limit of 1e6, and {2^40, 1} grew the heap to
    -- 13 GB under the default 256 MB limit before the hook ran again
    fails(function()
      run({ step = "ms.block_plan({ { name = 'w', shape = { 2^21, 1 } } }, { block_size = 1 })" },
          { sandbox = { instructions = 1e6, memory = 2 ^ 30 } })
    end, "instruction limit", 1)
    local o = run { step = [[
      local p = ms.block_plan({ { name = 'w', shape = { 300, 70 } }, { name = 'b', shape = { 300 } } }, { block_size = 64 })
      ctx.report('stacks', #p.stacks)]] }
    assert.equals(6, o:stats().last.reports.stacks)
  end)

  it("counts the iterations of C loops whose counts the recipe passes (sinkgd iters, root and power steps)", function()
    -- (one call runs them all in C, out of the hook's reach: iters = 2^31 - 1 would run for hours; each
    -- iteration now counts as one hook period, so 1e6 instructions allow 1000 of them per call)
    local calls = {
      "ms.sinkgd_step{params = {ms.randn({2, 2})}, grads = {ms.randn({2, 2})}, lr = 0.1, iters = 2e6}",
      "ms.sinkgd_step{params = {ms.randn({2, 2})}, grads = {ms.randn({2, 2})}, lr = 0.1, mode = 'spectral', " ..
        "specnorm_u = {ms.zeros({2})}, iters = 1, sn_iters = 2e6}",
      "ms.inv_root(ms.eye(2):reshape({1, 2, 2}), {method = 'ndb', steps = 2e6, scaling = 'fro'})",
      "ms.inv_root(ms.eye(2):reshape({1, 2, 2}), {method = 'cn', steps = 1, pi_steps = 2e6})",
      "ms.spectrum_estimate(ms.eye(2):reshape({1, 2, 2}), {steps = 2e6})",
      -- a recipe's pcall does not swallow it
      "pcall(ms.sinkgd_step, {params = {ms.randn({2, 2})}, grads = {ms.randn({2, 2})}, lr = 0.1, iters = 2e6})",
      -- nor do calls that each stay below the limit add up past it
      "for i = 1, 20 do ms.sinkgd_step{params = {ms.randn({2, 2})}, grads = {ms.randn({2, 2})}, lr = 0.1, iters = 1e5} end",
    }
    for _, c in ipairs(calls) do
      fails(function() run({ step = c }, { sandbox = { instructions = 1e6 } }) end, "instruction limit", 10)
    end
    local o = run({ step = "ms.sinkgd_step{params = {ms.randn({2, 2})}, grads = {ms.randn({2, 2})}, lr = 0.1, iters = 500} " ..
                           "ctx.report('ok', true)" }, { sandbox = { instructions = 1e6 } })
    assert.is_true(o:stats().last.reports.ok)
  end)

  it("counts the C work of library calls in a loop: string copies, gsub's scan, sorts, shifts, maxn", function()
    -- each call is bounded (its sizes by the memory limit) and costs a few VM instructions, so a loop of them ran
    -- far past the instruction limit's time: each of these took 10-30 s here; the limit stops them in under 1 s
    local big = "local s = ('x'):rep(2^20) "
    local array = "local t = {} for i = 1, 2^16 do t[i] = i end "
    local bombs = {
      big .. "for i = 1, 2e4 do local u = s:upper() end",
      big .. "for i = 1, 2e4 do local u = s:lower():reverse() end",
      big .. "for i = 1, 1e5 do local u = string.format('%s', s) end",
      big .. "for i = 1, 5000 do local r = s:gsub('y', 'z') end",
      array .. "for i = 1, 2000 do table.sort(t) end",
      array .. "for i = 1, 1e5 do table.insert(t, 1, 0) table.remove(t, 1) end",
      "local t = {} for i = 1, 2^16 do t[i * 2.5] = i end for i = 1, 1e5 do local m = table.maxn(t) end",
    }
    for _, b in ipairs(bombs) do fails(function() run { step = b } end, "instruction limit", 3) end
    -- an input built against the quicksort (McIlroy's adversary: the comparisons of a sort of indices decide
    -- the values as late as they can) takes n^2 / 4 comparisons where n log2 n was charged: 100 sorts of 8000
    -- took ~10 s; every comparison now counts
    local n, gas, val, solid, candidate, idx = 8000, 8001, {}, 0, nil, {}
    for i = 1, n do val[i], idx[i] = gas, i end
    local function freeze(x) val[x], solid = solid, solid + 1 end
    table.sort(idx, function(x, y)
      if val[x] == gas and val[y] == gas then freeze(x == candidate and x or y) end
      if val[x] == gas then candidate = x elseif val[y] == gas then candidate = y end
      return val[x] < val[y]
    end)
    for i = 1, n do if val[i] == gas then freeze(i) end end
    local killer = "local K = {" .. table.concat(val, ",") .. "}"
    fails(function()
      run({ top = killer, step = "for r = 1, 100 do local c = {} for i = 1, #K do c[i] = K[i] end table.sort(c) end" },
          { sandbox = { memory = 2 ^ 26 } })
    end, "instruction limit", 5)
    -- table.insert reads its position as an int32: NaN or 2^31 and past became -2^31, a shift of 2^31 elements
    for _, pos in ipairs { "2^40", "0/0", "2^31" } do
      fails(function() run { step = "local t = {1, 2, 3} table.insert(t, " .. pos .. ", 0)" } end, "out of bounds")
    end
    -- the wrappers' argument errors name the function and the recipe's line, as the C functions' did
    local err = fails(function() run { step = "local x = string.reverse()" } end, "bad argument #1 to 'reverse'")
    assert.truthy(err:find("evil:", 1, true), err)
    fails(function() run { step = "local x = ('abc'):sub({})" } end, "bad argument #2 to 'sub' (number expected, got table)")
    -- small strings and tables stay cheap
    local o = run { step = "local n = 0 for i = 1, 1e4 do n = n + #(('abc'):rep(10):upper()) end " ..
                          "local t = { 3, 1, 2 } table.sort(t) table.insert(t, 1, 0) table.remove(t, 1) " ..
                          "ctx.report('ok', n == 3e5 and t[1] == 1 and table.maxn(t) == 3)" }
    assert.is_true(o:stats().last.reports.ok)
  end)

  it("counts the heap a loop allocates (`..` included) and the time of its searches", function()
    -- `..` is one VM instruction however long its strings, and a search runs in C for as long as its pattern
    -- makes it (each call within check_pattern's budget): these loops took 60-700 s here under the default
    -- limit; the heap allocated and the searches' time now count, and they stop in about a second
    local s1, s5 = "local s = ('x'):rep(2^20) ", "local s = ('a'):rep(5000) "
    local bombs = {
      { s1 .. "for i = 1, 1e5 do local t = s .. i end", "bytes of Lua heap the call allocated" },
      { s1 .. "for i = 1, 1e5 do local t = { s .. i, i } end", "bytes of Lua heap the call allocated" },
      { s5 .. "for i = 1, 1e4 do local a = s:find('.-b') end", "string.find's work in C" },
      { s5 .. "for i = 1, 1e4 do local a = s:match('.-b') end", "string.match's work in C" },
      { s5 .. "for i = 1, 1e4 do for w in s:gmatch('.-b') do end end", "string.gmatch's work in C" },
      { s5 .. "for i = 1, 1e4 do local a = s:gsub('.-b', '') end", "string.gsub's work in C" },
      -- (the search's time less the replacement's, which never runs here: nothing matches)
      { s5 .. "for i = 1, 1e4 do local a = s:gsub('.-b', function() end) end", "string.gsub's work in C" },
      { s5 .. "for i = 1, 1e4 do local a = s:gsub('.-b', {}) end", "string.gsub's work in C" },
      { "local s = ('a'):rep(2^20) for i = 1, 1e7 do local a = s:find('b', 1, true) end", "string.find's work in C" },
    }
    for _, b in ipairs(bombs) do fails(function() run { step = b[1] } end, b[2], 5) end
    -- the recipe's pcall does not keep it going
    fails(function() run { step = s5 .. "for i = 1, 1e4 do pcall(string.find, s, '.-b') end" } end, "instruction limit", 5)
    -- what a recipe does with names and small strings stays well below the limit: 2e4 matches, finds, gmatch
    -- loops and concatenations (~7e6 instructions here) under a limit of 2e7, a fifth of the default
    local o = run({ step = [[
      local n = 0
      for k = 1, 100 do
        for i = 1, 200 do
          local name = 'model.layers.' .. i .. '.mlp.gate_proj.weight'
          local layer, rest = name:match('^model%.layers%.(%d+)%.(.-)%.weight$')
          if tonumber(layer) == i and name:find('gate', 1, true) then n = n + 1 end
          for part in rest:gmatch('[^.]+') do n = n + 0 end
        end
      end
      ctx.report('n', n)]] }, { sandbox = { instructions = 2e7 } })
    assert.equals(2e4, o:stats().last.reports.n)
    -- the searches' own errors still name the function and the recipe's line (they run under a pcall now)
    for _, c in ipairs {
      { "local x = string.find()", "evil:%d+: bad argument #1 to 'find' %(string expected" },
      { "local x = ('abc'):find('[')", "evil:%d+: malformed pattern %(missing ']'%)" },
      { "local x = ('abc'):match()", "evil:%d+: bad argument #2 to 'match'" },
      { "local x = string.gmatch('a')", "evil:%d+: bad argument #2 to 'gmatch'" },
      { "for w in ('abc'):gmatch('[') do end", "evil:%d+: malformed pattern %(missing ']'%)" },
      { "local x = ('abc'):gsub('[', '')", "evil:%d+: malformed pattern %(missing ']'%)" },
      { "local x = ('abc'):gsub('b', function() error('mine') end)", "evil:%d+: mine" },
    } do
      local ok, err = pcall(run, { step = c[1] })
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[2]), c[1] .. ": " .. tostring(err))
    end
    -- what the searches return is what the C functions return
    o = run { step = [[
      local s = 'key=val, k2=v2'
      local a, b, c, d = s:find('(%w+)=(%w+)')
      local e, f = s:match('()k2=(%w+)')
      local ws = {}
      for k, v in s:gmatch('(%w+)=(%w+)') do ws[#ws + 1] = k .. v end
      local r, count = s:gsub('%w+', { key = 'K' })
      ctx.report('ok', a == 1 and b == 7 and c == 'key' and d == 'val' and e == 10 and f == 'v2'
                       and table.concat(ws, ',') == 'keyval,k2v2' and r == 'K=val, k2=v2' and count == 4
                       and select('#', s:find('zz')) == 1 and s:match('zz') == nil)]] }
    assert.is_true(o:stats().last.reports.ok)
    -- a gmatch iterator the recipe keeps holds its subject: the retained limit sees it
    fails(function()
      run({ top = "local keep = {}", step = "for i = 1, 16 do keep[#keep + 1] = (('x'):rep(2^20) .. i):gmatch('y') end" },
          { sandbox = { retained = 2 ^ 23 } })
    end, "retained memory limit")
  end)

  it("bounds a call's wall-clock time when asked (seconds): a loop of `..` that rebuilds an existing string", function()
    -- each `s .. s` copies and compares 2 MiB and allocates nothing (the result exists): ~0.1 ms an iteration
    -- for 4 instructions, days under the default instruction limit
    local bomb = "local s = ('x'):rep(2^20) local keep = s .. s for i = 1, 1e9 do local t = s .. s end"
    fails(function() run({ step = bomb }, { sandbox = { seconds = 1 } }) end, "time limit of 1 s exceeded", 4)
    -- a call within it runs, and every call gets the whole time
    local o = run({ step = "local n = 0 for i = 1, 1e5 do n = n + i end ctx.report('n', n)" }, { sandbox = { seconds = 1 } }, 3)
    assert.equals(5000050000, o:stats().last.reports.n)
  end)

  it("counts the elements of ops over expanded views, which loop in C and allocate nothing", function()
    -- an expanded view costs no memory and no quota, and an op over it ran out of the hook's reach: the sum of
    -- 2^34 elements took 20 s here under an instruction limit that stops a loop in 0.25 s, and 2^50 would take days
    local bombs = {
      "local x = ms.zeros({1}):expand({2^50}):sum()",
      "local x = ms.dot(ms.zeros({1}):expand({2^50}), ms.zeros({1}):expand({2^50}))",
      "ms.zeros({1}):expand({2^50}):fill_(1)",
      "local x = ms.foreach_sumsq({ ms.zeros({1}):expand({2^50}) })",
      "local x = ms.zeros({1, 1}):expand({2^25, 2^25}):slice(0, 0, 2^24):t():amax()",    -- views of one too
      "for i = 1, 200 do local x = ms.ones({1}):expand({2^20}):sum() end",             -- each below, together past
    }
    for _, b in ipairs(bombs) do
      fails(function() run { step = b } end, "instruction limit of 100000000 exceeded", 2)
    end
    fails(function() run { step = bombs[1] } end, "an op over an expanded view of 1125899906842624 elements")
    -- what stays cheap: properties and views of a huge one, and ops over a small one
    local o = run { step = [[
      local e = ms.zeros({1}):expand({2^50})
      local v = e:slice(0, 0, 10):view({2, 5})
      ctx.report('meta', e:numel() + e:dim() + #e:shape() + v:numel())
      ctx.report('sum', ms.ones({1}):expand({1000}):sum())]] }
    assert.equals(2 ^ 50 + 12, o:stats().last.reports.meta)
    assert.equals(1000, o:stats().last.reports.sum)
  end)

  it("bounds what reading a tensor back into Lua may build, expanded views included", function()
    -- an expanded view costs no engine memory, so no quota: reading 2^26 elements of one back built a 512 MB
    -- Lua table (in compiled code, out of the hook's reach) under the 256 MB memory limit, and the call succeeded
    for _, use in ipairs { "t:tolist_flat()", "t:totable()" } do
      fails(function() run { step = "local t = ms.zeros({1}):expand({2^26}); local x = " .. use } end, "memory limit", 5)
    end
    -- (tostring reads only the elements it shows)
    local shown = run { step = "ctx.report('s', #tostring(ms.zeros({1}):expand({2^26})))" }
    assert.is_true(shown:stats().last.reports.s < 1000)
    local o = run { step = "ctx.report('n', #ms.ones({1}):expand({1000}):tolist_flat())" }
    assert.equals(1000, o:stats().last.reports.n)
  end)

  it("lets a recipe go that keeps a tensor in a global", function()
    -- a charged tensor's token (in moonstep.tensor's weak-keyed anchors) had a finalizer closing over the guard,
    -- whose roots hold the recipe's environment and so the tensor again: LuaJIT has no ephemerons, so the
    -- tensor, its engine memory, the guard and the recipe were never collected (fuzz_recipe grew 28 KB an input)
    local weak = setmetatable({}, { __mode = "k" })
    for _ = 1, 4 do
      local r = R.load_string(recipe_src { step = "kept = ms.zeros({1000})" }, "=evil")
      local o = ms.optim.new(r, { { name = "w", param = ms.randn({ 4, 3 }), grad = ms.randn({ 4, 3 }) } }, {})
      o:step()
      weak[r] = true
    end
    for _ = 1, 4 do collectgarbage() end
    local alive = 0
    for _ in pairs(weak) do alive = alive + 1 end
    assert.is_true(alive <= 1, alive .. " of 4 recipes still alive")   -- (the last may sit in a dead stack slot)
  end)

  it("stops memory bombs", function()
    local bombs = {
      { "return string.rep('x', 2^30)", "string.rep" },
      { "return ('x'):rep(2^30)", "string.rep" },
      { "return ('x'):rep(2^20, ('y'):rep(2^10))", "string.rep" },
      -- (the heap these allocate counts as instructions too, and under the default limits the instruction limit
      -- can come first; under a smaller memory limit it is the memory's)
      { "local t = {} for i = 1, 1e9 do t[i] = i end", "limit of" },
      { "local t = {} for i = 1, 1e9 do t[i] = {} end", "limit of" },
      { "local t = {} for i = 1, 1e9 do t[#t + 1] = ('x'):rep(1e5) .. i end", "limit of" },
      { "local t = {} for i = 1, 1e9 do t[i] = i end", "Lua memory limit of 16777216", 2 ^ 24 },
      { "local t = {} for i = 1, 1e9 do t[i] = {} end", "Lua memory limit of 16777216", 2 ^ 24 },
      { "local t = {} for i = 1, 1e9 do t[#t + 1] = ('x'):rep(1e5) .. i end", "Lua memory limit of 16777216", 2 ^ 24 },
      { "local s = ('x'):rep(2^20); return s:gsub('', s)", "string.gsub" },
      -- (a table or function replacement is counted as gsub produces it, and the C buffer's intermediate
      -- copies can reach the heap cap first: which of the two limits names it depends on the heap's state)
      { "local s = ('x'):rep(2^20); return s:gsub('x', {x = s})", "memory limit" },
      { "local s = ('x'):rep(2^20); return s:gsub('x', function() return s end)", "memory limit" },
      { "local s, t = ('x'):rep(2^20), {} for i = 1, 1000 do t[i] = s end return table.concat(t)", "table.concat" },
      { "local s = ('x'):rep(2^24); return string.format(('%s'):rep(64), " ..
        ("s, "):rep(63) .. "s)", "string.format" },
      { "return string.find(('a'):rep(4000), '.-.-.-.-.-b')", "too expensive" },
      { "return ('a'):rep(1e5):match('(a*)*b')", "too expensive" },
      -- a long literal needle: each of the 2^21 start positions compares up to 2^19 bytes, out of the hook's
      -- reach (a plain find of this took 15 s under an instruction limit of 2e6, and the pattern functions
      -- passed it as a pattern without repetitions)
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:find(p, 1, true)", "plain search" },
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:find(p)", "too expensive" },
      -- (an init past int32, which the C function wraps to a negative start: the whole string; found by fuzz_recipe)
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:find(p, 1.2e47, true)", "plain search" },
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:find(p, 2^32 + 1, true)", "plain search" },
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:match(p, 1e300)", "too expensive" },
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:match(p)", "too expensive" },
      { "local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b' return s:gsub(p, '')", "too expensive" },
      { "local s = ('a'):rep(5000) return s:match('a-' .. ('a'):rep(5000) .. 'b')", "too expensive" },
    }
    -- (the bound only tells a stopped bomb from a hung one: filling the memory limit takes 1-3 s of CPU on a
    -- 2-core CI machine, more under a sanitizer)
    for _, b in ipairs(bombs) do
      -- (the memory limit is on the heap's net growth: the garbage the bomb before left, freed during the call,
      -- would give this one that much more room)
      collectgarbage()
      fails(function() run({ step = b[1] }, b[3] and { sandbox = { memory = b[3] } }) end, b[2], 10)
    end
    -- cheap patterns on long strings, anchored scans and plain finds stay allowed
    local o = run { step = [[
      local s, short = ('ab'):rep(1e5), ('ab'):rep(2000)
      ctx.report('ok', #s:gsub('a', 'c') == 2e5 and s:find('^a') == 1 and s:find('ba', 1, true) == 2
                       and select(2, short:gsub('%a+', '')) == 1 and ('x'):rep(3) == 'xxx')]] }
    assert.is_true(o:stats().last.reports.ok)
  end)

  it("caps the heap between two looks of the hook (concatenation builds gigabytes in a few instructions)", function()
    -- 40 strings of 16 MB in about 400 instructions, before the hook's first look: the call used to succeed,
    -- holding 640 MB under a memory limit of 16 MB (with 64 MB strings, 100 of them, the machine ran out)
    local bombs = {
      "local s = ('x'):rep(2^22) local t = {} for i = 1, 40 do t[i] = s .. s .. s .. s .. i end",
      -- the recipe's pcall catches the "not enough memory" of the refused request, and the guard trips anyway
      "local s = ('x'):rep(2^22) local t = {} for i = 1, 40 do pcall(function() t[i] = s .. s .. s .. s .. i end) end",
    }
    for _, b in ipairs(bombs) do
      fails(function() run({ step = b }, { sandbox = { memory = 2 ^ 24 } }) end, "memory limit of 16777216", 10)
    end
    -- the cap is lifted when the call ends, failed or not: the trusted side allocates freely again
    local big = ("x"):rep(2 ^ 26) .. "y"
    assert.equals(2 ^ 26 + 1, #big)
    -- and a recipe that stays within its limit runs
    local o = run({ step = "local s = ('x'):rep(2^20) local t = {} for i = 1, 4 do t[i] = s .. i end ctx.report('n', #t)" },
                  { sandbox = { memory = 2 ^ 24 } })
    assert.equals(4, o:stats().last.reports.n)
    -- limits at either end: twice 1e19 bytes once converted to a negative cap that refused everything (and the
    -- process crashed at exit); a tiny one leaves the call's own bookkeeping room (the hook enforces it)
    for _, memory in ipairs { 1e19, 2 ^ 63, 1e300, 1 } do
      o = run({ step = "local t = {} for i = 1, 100 do t[i] = {i} end ctx.report('n', #t)" }, { sandbox = { memory = memory } })
      assert.equals(100, o:stats().last.reports.n)
    end
  end)

  it("sizes string results from arguments the C functions convert (numeric strings, numbers)", function()
    -- (string.rep reads a count "4194304" as 4194304, and numbers become strings of up to 24 bytes: the size
    -- checks must count them as the C functions will, or one call builds past the limit before the hook looks)
    local bombs = {
      { "return string.rep('x', '4194304')", "string.rep" },
      { "return ('x'):rep(' 0x400000 ')", "string.rep" },
      { "return string.rep(-1.2345678901234e-300, 50000)", "string.rep" },
      { "return ('x'):rep(2^16, -1.2345678901234e-300)", "string.rep" },
      { "local s = ('x'):rep(2^19); return string.gsub(123456789012, '', s)", "string.gsub" },
      { "local s = ('x'):rep(2^19); return s:gsub('x', -1.2345678901234e-300)", "string.gsub" },
      -- (counted as produced: "string.gsub" or the heap cap's "Lua memory limit", as in the bombs above)
      { "local s = ('x'):rep(2^19); return s:gsub('x', function() return -1.2345678901234e-300 end)", "memory limit" },
      { "local s = ('x'):rep(2^19); return s:gsub('x', {x = -1.2345678901234e-300})", "memory limit" },
    }
    for _, b in ipairs(bombs) do
      fails(function() run({ step = b[1] }, { sandbox = { memory = 2 ^ 20 } }) end, b[2], 10)
    end
    local o = run({ step = "ctx.report('ok', ('ab'):rep('3') == 'ababab' and string.rep(12, 2) == '1212' and "
                         .. "select(2, ('aaa'):gsub('a', 7)) == 3)" }, { sandbox = { memory = 2 ^ 20 } })
    assert.is_true(o:stats().last.reports.ok)
  end)

  it("enforces the engine allocation quota, releasing what the recipe lets go", function()
    fails(function() run { init = "ms.zeros({1e12})" } end, "engine allocation quota", 2)
    fails(function() run { step = "local keep = {} for i = 1, 1e4 do keep[i] = ms.zeros({2^20}) end" } end,
          "engine allocation quota", 5)
    -- state kept across steps is still held: the quota is live bytes, not per call
    fails(function() run({ step = "group.state[ctx.step] = ms.zeros({2^20})" }, { sandbox = { quota = 2 ^ 24 } }, 20) end,
          "engine allocation quota", 5)
    -- a view keeps its base's storage alive, so it keeps the base's charge
    fails(function() run { step = "local keep = {} for i = 1, 1e3 do keep[i] = ms.zeros({2^20}):slice(0, 0, 1) end" } end,
          "engine allocation quota", 5)
    -- temporaries that die are released: 400 MB allocated in total under a 16 MB quota
    local o = run({ step = "for i = 1, 100 do local x = ms.zeros({2^20}) + 1 end ctx.report('done', true)" },
                  { sandbox = { quota = 2 ^ 24 } })
    assert.is_true(o:stats().last.reports.done)
    -- the default quota grows with the parameters (4x their bytes + 64 MiB)
    local r = R.load_string(recipe_src {}, "=q")
    local g = R.guard(r, nil, { { param = ms.zeros({ 2 ^ 20 }) } })
    assert.equals(64 * 2 ^ 20 + 16 * 2 ^ 20, g.quota)
  end)

  it("bounds the Lua data a recipe keeps across calls (limits.retained): state, upvalues, globals", function()
    -- each call keeps a little more, within its per-call memory limit: the process used to run out of memory
    -- after enough steps.  Now the call that takes the recipe past its retained limit (8 MiB here) fails,
    -- naming the recipe and the limit.
    -- (what these recipes keep is garbage once the test ends: collected, so that the per-call memory limits of
    -- later tests, which count the heap's net growth, are not measured over it)
    finally(function() collectgarbage() end)
    local MB = 2 ^ 20
    -- (each case keeps strings of its own: a string that exists already, interned, costs no allocation, and the
    -- walks come after what the calls allocated; see moonstep.recipe)
    local case = 0
    local function steps_until_stopped(parts, max_steps)
      case = case + 1
      for k, code in pairs(parts) do parts[k] = code:gsub("CASE", case) end
      local r = R.load_string(recipe_src(parts), "=keeper")
      local p, g = ms.randn({ 4, 3 }), ms.randn({ 4, 3 })
      local opt = ms.optim.new(r, { { name = "w", param = p, grad = g } }, {}, { sandbox = { retained = 8 * MB } })
      for i = 1, max_steps do
        local ok, err = pcall(opt.step, opt)
        if not ok then return i, tostring(err), opt end
      end
      return nil, "not stopped", opt
    end
    local keepers = {
      state = { step = "group.state[#group.state + 1] = ('x'):rep(2^20) .. 'CASE.' .. ctx.step" },
      member_state = { step = "local s = group[1].state s[#s + 1] = ('x'):rep(2^20) .. 'CASE.' .. ctx.step" },
      upvalue = { top = "local kept = {}", step = "kept[#kept + 1] = ('x'):rep(2^20) .. 'CASE.' .. ctx.step" },
      global = { step = "kept = kept or {} kept[#kept + 1] = ('x'):rep(2^20) .. 'CASE.' .. ctx.step" },
      -- on the group table itself, in a closure's upvalue, as keys
      group = { step = "group.mine = group.mine or {} group.mine[('x'):rep(2^20) .. 'CASE.' .. ctx.step] = true" },
      closure = { step = "local s = ('x'):rep(2^20) .. 'CASE.' .. ctx.step local prev = group.state.f "
                         .. "group.state.f = function() return s, prev end" },
    }
    for what, parts in pairs(keepers) do
      local stopped, err, opt = steps_until_stopped(parts, 30)
      assert.truthy(err:find("recipe evil (=keeper): retained memory limit of 8388608 bytes exceeded", 1, true),
                    what .. ": " .. err)
      -- stopped once about 8 MB were kept, give or take the last step and an eighth of the limit
      assert.truthy(stopped >= 8 and stopped <= 10, ("%s: stopped at step %s"):format(what, tostring(stopped)))
      assert.truthy(opt.guard.found > 8 * MB and opt.guard.found < 11 * MB, what .. ": found " .. opt.guard.found)
      -- each step walked only once what it could have kept came near the limit: about log2(8) + 8 walks, not 10
      -- per step of a 1 MB
      assert.truthy(opt.guard.walks <= 8, what .. ": " .. opt.guard.walks .. " walks")
    end
    -- tables count by the slots they hold allocated (an emptied one keeps them), and small tables add up too
    local stopped, err = steps_until_stopped({ step = [[
      local t = {} for i = 1, 2^17 do t[i] = true end for i = 1, 2^17 do t[i] = nil end
      group.state[ctx.step] = t]] }, 30)
    assert.truthy(stopped and stopped <= 10, err)
    stopped, err = steps_until_stopped({ step = "for i = 1, 2^14 do group.state[#group.state + 1] = {i} end" }, 30)
    assert.truthy(stopped and stopped <= 10, err)
    -- over the limit, a step that keeps more fails too (its plan, which keeps nothing, runs); once the 13th
    -- step lets go of it all, steps run again
    local opt
    stopped, err, opt = steps_until_stopped({ top = "local calls = 0", step = [[
      calls = calls + 1
      if calls <= 12 then group.state[calls] = ('x'):rep(2^20) .. 'CASE.' .. calls
      else for k in pairs(group.state) do group.state[k] = nil end end]] }, 30)
    assert.truthy(err:find("retained memory limit", 1, true), err)
    local results, want = {}, {}
    for call = stopped + 1, 15 do
      results[#results + 1] = pcall(opt.step, opt)
      want[#want + 1] = call >= 13
    end
    assert.same(want, results)
  end)

  it("walks a well-behaved recipe's data rarely, blaming it neither for garbage nor for the host's", function()
    finally(function() collectgarbage() end)
    local MB = 2 ^ 20
    -- the built-in adamw and sinkgd, loaded from their files untrusted: hundreds of steps, one walk (the first
    -- call's), a few kilobytes found
    for _, name in ipairs { "adamw", "sinkgd" } do
      local r = R.load("recipes/" .. name .. ".lua")
      assert.is_false(R.meta[r].trusted)
      local params = {}
      for i = 1, 4 do params[i] = { name = "w" .. i, param = ms.randn({ 16, 8 }), grad = ms.randn({ 16, 8 }) } end
      local opt = ms.optim.new(r, params, {})
      for _ = 1, 300 do opt:step() end
      assert.is_true(opt.guard.walks <= 2, name .. ": " .. opt.guard.walks .. " walks")
      assert.is_true(opt.guard.found < 64 * 1024, name .. ": found " .. opt.guard.found)
    end
    -- a recipe that makes 1 MB of garbage a step under a retained limit of 4 MB walks often (every eighth of the
    -- limit allocated, once near it), and the host keeps 2 MB more between its steps: neither counts
    local r = R.load_string(recipe_src { step = "local junk = ('x'):rep(2^20) .. ctx.step group.state.n = ctx.step" },
                            "=tidy")
    local p, g = ms.randn({ 4, 3 }), ms.randn({ 4, 3 })
    local opt = ms.optim.new(r, { { name = "w", param = p, grad = g } }, {}, { sandbox = { retained = 4 * MB } })
    local host = {}
    for i = 1, 40 do
      opt:step()
      local t = { ("y"):rep(2 * MB) .. i }
      for j = 2, 1000 do t[j] = { j } end
      host[i] = t
    end
    assert.is_true(opt.guard.walks >= 5, opt.guard.walks .. " walks")
    assert.is_true(opt.guard.found < 64 * 1024, "found " .. opt.guard.found)
    assert.equals(40, #host)
  end)

  it("reports only plain values to the trainer, no recipe function or table holding one", function()
    -- a function reported would run later in the trainer's hands, without the hook, the limits or the safe strings
    local before = snapshot()
    fails(function() run({ step = [[ctx.report("later", function() while true do end end)]] }) end, "ctx.report")
    fails(function() run({ step = [[ctx.report("t", { f = function() while true do end end })]] }) end, "ctx.report")
    fails(function() run({ step = [[ctx.report(1, 2)]] }) end, "under a number key")
    same_as(before)
    local opt = run({ step = [[ctx.report("n", 3) ctx.report("s", "x") ctx.report("b", true)]] })
    assert.same({ n = 3, s = "x", b = true }, opt:stats().last.reports)
  end)

  it("checks its settings", function()
    H.expect_error(function() run({}, { sandbox = { instructions = -1 } }) end, "sandbox limit instructions")
    H.expect_error(function() run({}, { sandbox = { cpu = 1 } }) end, "unknown sandbox limit 'cpu'")
    H.expect_error(function() run({}, { sandbox = { seconds = -1 } }) end, "sandbox limit seconds must be a positive number")
    H.expect_error(function() run({}, { sandbox = { retained = 0 } }) end, "sandbox limit retained must be a positive")
    H.expect_error(function() run({}, { sandbox = 5 }) end, "sandbox limits must be a table")
    -- a tighter memory limit trips earlier
    fails(function() run({ step = "local t = {} for i = 1, 1e6 do t[i] = i end" }, { sandbox = { memory = 2 ^ 20 } }) end,
          "memory limit of 1048576")
  end)

  it("restores the hook and the string metatable after every call, failed or not", function()
    local function mark() end
    debug.sethook(mark, "", 1e6)
    pcall(run, { step = "error('boom')" })
    pcall(run, { step = "while true do end" })
    run { step = "local x = ('x'):rep(3)" }
    local h, mask, count = debug.gethook()
    debug.sethook()
    assert.equals(mark, h)
    assert.equals("", mask)
    assert.equals(1e6, count)
    assert.equals(string, getmetatable("").__index)
    assert.is_function(("x").dump)
  end)

  it("shows recipe code strings whose methods are the safe ones, and no heap addresses", function()
    local o = run { step = [[
      ctx.report('dump', type(('x').dump))
      ctx.report('rep', ('ab'):rep(2))
      ctx.report('fn', tostring(print or function() end))
      ctx.report('tensor', tostring(ms.tensor({1, 2})):sub(1, 7))]] }
    local rep = o:stats().last.reports
    assert.equals("nil", rep.dump)
    assert.equals("abab", rep.rep)
    assert.equals("function", rep.fn)
    assert.equals("tensor(", rep.tensor)
  end)

  it("lets string.format print no heap address either (%s of a table or function, %p)", function()
    -- tostring hid them, but string.format('%s', {}) printed "table: 0x7f...", and '%p' any object's address
    local o = run { step = [[
      ctx.report('s', string.format('%s %s %s %5s', {}, function() end, group, true))
      ctx.report('t', ('%s|%s|%d%%'):format(ms.tensor({1}), nil, 3):sub(1, 7))]] }
    local rep = o:stats().last.reports
    assert.equals("table function table  true", rep.s)
    assert.equals("tensor(", rep.t)
    for _, f in ipairs { "string.format('%p', {})", "string.format('%%d %-12p', 1, ctx)", "('%p'):format('x')" } do
      fails(function() run { step = "local s = " .. f } end, "string.format: %p")
    end
  end)

  it("shows no heap address in the messages of trusted functions that a recipe catches", function()
    -- block_plan names a bad size with the real tostring: the message the recipe caught held "table: 0x7f..."
    local o = run { step = [[
      local bad = { { name = 'w', shape = { {} } } }
      ctx.report('p', select(2, pcall(ms.block_plan, bad, { block_size = 1 })))
      local seen
      xpcall(ms.block_plan, function(e) seen = e end, bad, { block_size = 1 })
      ctx.report('x', seen)]] }
    local rep = o:stats().last.reports
    for _, k in ipairs { "p", "x" } do
      assert.truthy(rep[k]:find("shape[1] = table is not a size", 1, true), rep[k])
      assert.falsy(rep[k]:find("0x", 1, true), rep[k])
    end
  end)

  it("runs a legitimate untrusted recipe end to end, with the same result as the trusted one", function()
    local src = io.open("recipes/sgd.lua"):read("*a")
    local path = os.tmpname() .. ".lua"
    local f = io.open(path, "w")
    f:write(src)
    f:close()
    local function train(recipe, settings)
      ms.manual_seed(7)
      local p, g = ms.randn({ 8, 5 }), ms.randn({ 8, 5 })
      local opt = ms.optim.new(recipe, { { name = "w", param = p, grad = g } }, { lr = 0.1, momentum = 0.9 }, settings)
      for _ = 1, 5 do opt:step() end
      return opt, p:tolist_flat()
    end
    local opt, got = train(path)
    os.remove(path)
    assert.is_false(R.meta[opt.recipe].trusted)
    assert.is_not_nil(opt.guard)
    assert.equals(8, opt.guard.calls)                  -- validate, route, init, then five steps: all guarded
    local topt, want = train("sgd")
    assert.is_nil(topt.guard)
    assert.same(want, got)
    -- and it saves and loads its state like any other
    local ck = os.tmpname()
    opt:save(ck)
    assert.equals(5, opt:load(ck).step)
    os.remove(ck)
  end)

  it("runs trusted recipes unguarded: no hook, the real string table, full speed", function()
    local r = R.load_string(recipe_src { step = [[
      ctx.report('hook', debug.gethook() == nil)
      ctx.report('dump', ('x').dump == string.dump)]] }, "=trusted", { trusted = true })
    assert.is_nil(R.guard(r))
    local p, g = ms.randn({ 2 }), ms.randn({ 2 })
    local opt = ms.optim.new(r, { { name = "w", param = p, grad = g } })
    opt:step()
    assert.is_true(opt:stats().last.reports.hook)
    assert.is_true(opt:stats().last.reports.dump)
    -- R.call with no guard is a plain call
    assert.equals(3, R.call(nil, function(a, b) return a + b end, 1, 2))
  end)
end)
