-- The REPL as a person uses it: `moonstep` in a terminal (a tmux pane, so readline sees a real tty), keys
-- sent one line at a time, the screen read back.  Line editing, history (in the session and across
-- sessions), printed results, errors that do not end the session, :reload of an edited recipe in place,
-- and the live progress line of `moonstep train` on a terminal.
local q, root, host = H.q, H.root, H.host

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  p:close()
  return out
end

local have_tmux = sh("command -v tmux") ~= ""
local socket = "moonstep-spec-" .. tostring(os.time()) .. "-" .. tostring(math.random(1e6))

local function tmux(args) return sh("tmux -L " .. socket .. " " .. args) end

-- a terminal running `cmd`, 160 columns wide
local function terminal(cmd, env)
  tmux(("new-session -d -s t -x 160 -y 50 %s"):format(q("cd " .. q(root) .. " && env " .. (env or "") .. " " .. cmd)))
  tmux("set-option -t t remain-on-exit on")
  local term = {}
  function term.screen() return tmux("capture-pane -p -J -S -200 -t t") end
  function term.keys(...)
    local args = {}
    for _, k in ipairs { ... } do args[#args + 1] = q(k) end
    tmux("send-keys -t t " .. table.concat(args, " "))
  end
  function term.line(s) term.keys("-l", s) term.keys("Enter") end
  -- waits until the screen contains `text` n times (default once); returns the screen
  function term.wait(text, n, timeout)
    n = n or 1
    local deadline = os.time() + (timeout or 15)
    local screen
    repeat
      screen = term.screen()
      local count, from = 0, 1
      while true do
        local i = screen:find(text, from, true)
        if not i then break end
        count, from = count + 1, i + #text
      end
      if count >= n then return screen end
      os.execute("sleep 0.05")
    until os.time() > deadline
    error(("timed out waiting for %q (x%d); the screen:\n%s"):format(text, n, (screen:gsub("%s+$", ""))), 2)
  end
  -- waits until the screen matches a Lua pattern; returns the screen
  function term.wait_match(pattern, timeout)
    local deadline = os.time() + (timeout or 15)
    local screen
    repeat
      screen = term.screen()
      if screen:match(pattern) then return screen end
      os.execute("sleep 0.05")
    until os.time() > deadline
    error(("timed out waiting for the pattern %q; the screen:\n%s"):format(pattern, (screen:gsub("%s+$", ""))), 2)
  end
  function term.dead() return tmux("display-message -p -t t '#{pane_dead}'"):match("1") ~= nil end
  function term.close() tmux("kill-server") end
  return term
end

local tmpdir, write = H.tmpdir, H.write_file

local describe_tty = have_tmux and describe or function(name) pending(name .. " (tmux is not installed)") end

describe_tty("the REPL in a terminal #external", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function()
    tmux("kill-server")
    os.execute("rm -rf " .. q(dir))
  end)

  it("runs a line that starts with a Lua label as code, not as a prompt command", function()
    local out = sh(("cd %s && printf '%%s\\n' '::top:: print(\"label ran\")' ':nosuch' ':quit' | %s"):format(q(root), q(host)))
    assert.truthy(out:find("\nlabel ran\n", 1, true), out)
    assert.falsy(out:find("unknown prompt command '::top::", 1, true), out)
    assert.truthy(out:find("unknown prompt command ':nosuch'", 1, true), out)
  end)

  it("evaluates, prints, survives errors, edits lines and keeps history #external", function()
    local hist = dir .. "/history"
    local t = terminal(q(host), "MOONSTEP_HISTORY=" .. q(hist))
    t.wait("`ms` is loaded")
    t.line("1 + 2")
    t.wait("\n3\n")
    t.line("ms.tensor({{1, 2}, {3, 4}}) * 2")
    t.wait("tensor([[2, 4],")
    t.line("{b = 2, a = 1, 'x'}")
    t.wait('{"x", a = 1, b = 2}')
    t.line("error('boom')")
    t.wait("boom")
    t.line("for i = 1, 2 do")
    t.line("print(i * 100)")
    t.line("end")
    t.wait("200")
    -- line editing: type the end of a line, jump to its start (Ctrl-A), type the beginning
    t.keys("-l", "+ 30")
    t.keys("C-a")
    t.keys("-l", "12 ")
    t.keys("Enter")
    t.wait("\n42\n")
    -- history: Up brings back the last line, "12 + 30"
    t.keys("Up", "Enter")
    t.wait("\n42\n", 2)
    t.line(":help")
    t.wait(":reload [NAME]")
    t.line(":quit")
    local deadline = os.time() + 10
    while not t.dead() and os.time() < deadline do os.execute("sleep 0.05") end
    assert.is_true(t.dead(), "the REPL did not leave on :quit")
    t.close()
    -- a second session finds the first one's history
    local t2 = terminal(q(host), "MOONSTEP_HISTORY=" .. q(hist))
    t2.wait("`ms` is loaded")
    t2.keys("Up", "Up", "Enter")   -- ":quit" then ":help"
    t2.wait("prompt commands:")
    t2.close()
  end)

  it(":reload updates a recipe in place: the optimizer runs the edited code from its next step", function()
    local path = dir .. "/optim.lua"
    local src = [[
return {
  name = "fill", options = {lr = {default = 1, type = "number"}, value = {default = 1, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o) for _, m in ipairs(group) do m.param:fill_(o.value * %d) end end}},
}]]
    write(path, src:format(1))
    local t = terminal("env MOONSTEP_HISTORY= " .. q(host) .. " repl")
    t.wait("`ms` is loaded")
    t.line(("r = ms.recipe.load(%q)"):format(path))
    t.line("w = ms.zeros({2})")
    t.line("opt = ms.optim.new(r, {{name = 'w', param = w, grad = ms.ones({2})}})")
    t.line("opt:step(); print('sum=' .. w:sum())")
    t.wait("sum=2")
    t.line(":reload")
    t.wait("fill: unchanged")
    write(path, src:format(7))
    t.line(":reload")
    t.wait("fill: reloaded from " .. path)
    t.wait("1 optimizer updated")
    -- the live optimizer runs the new code from its next step
    t.line("opt:step(); print('sum=' .. w:sum())")
    t.wait("sum=14")
    -- a broken edit leaves the working version in place
    write(path, "return {name = 'fill', options = {}, route = 'oops'}")
    t.line(":reload fill")
    t.wait("not reloaded, the old version stays")
    t.line("opt:step(); print('sum=' .. w:sum(), 'same hash: ' .. tostring(opt.recipe_hash == ms.recipe.meta[r].hash))")
    t.wait("same hash: true")
    t.line(":recipes")
    t.wait("(sandboxed)")
    t.line(":reload nosuch")
    t.wait("no recipe named 'nosuch'")
    t.close()
  end)

  it("moonstep train shows a live progress line on a terminal", function()
    local t = terminal(q(host) .. " train --problem lm --width 16 --embed 2 --batch 2 --steps 1000000 --recipe sgd --eval-every 1000000",
                       "MOONSTEP_HISTORY=")
    local screen = t.wait_match("step %d+/1000000  loss [%d%.]+  [%d%.]+ steps/s  ETA %d+:%d%d")
    -- one line, rewritten in place: no second line of progress below it
    local _, lines = screen:gsub("ETA", "")
    assert.equals(1, lines, screen)
    t.keys("C-c")
    t.close()
  end)

  it("moonstep train ends its live progress line when Ctrl-C stops it", function()
    -- (a shell that outlives the signal, to print after it: the line it printed on was the progress line's)
    local t = terminal("sh -c " .. q("trap : INT; " .. q(host) .. " train --problem lm --width 16 --embed 2 --batch 2 " ..
                       "--steps 1000000 --recipe sgd --eval-every 1000000; echo after-status-$?; sleep 60"), "MOONSTEP_HISTORY=")
    t.wait_match("step %d+/1000000  loss [%d%.]+  [%d%.]+ steps/s  ETA %d+:%d%d")
    t.keys("C-c")
    local screen = t.wait("after-status-130")
    assert.truthy(screen:match("ETA %d+:%d%d[^\n]*\nafter%-status%-130"), screen)
    t.close()
  end)
end)

-- the REPL with piped input (no terminal needed): what it prints and whether the session survives
describe("the REPL with piped input", function()
  local function session(lines, env)
    local d = tmpdir()
    local path = d .. "/input"
    write(path, table.concat(lines, "\n") .. "\n")
    local out, code = H.moonstep("< " .. q(path), "MOONSTEP_HISTORY= " .. (env or ""))
    os.execute("rm -rf " .. q(d))
    return out, code
  end

  it("survives a result that cannot be shown (its __tostring fails)", function()
    local out, code = session {
      "x = setmetatable({}, {__tostring = function() error('cannot show me') end})",
      "x",
      "print('still' .. ' alive')",
    }
    assert.equals(0, code, out)
    assert.truthy(out:find("cannot show me", 1, true), out)
    assert.truthy(out:find("still alive", 1, true), out)
  end)

  it("prints the value of an expression spread over several lines, and goes on", function()
    local out, code = session { "(40 +", "2)", "ms.tensor({1,", "2})", "print('after')" }
    assert.equals(0, code, out)
    assert.truthy(out:find("\n42\n", 1, true), out)
    assert.truthy(out:find("tensor([1, 2]", 1, true), out)
    assert.truthy(out:find("after", 1, true), out)
    assert.falsy(out:find("syntax error", 1, true), out)
  end)

  it("shows every value a line returns, nil included", function()
    local out, code = session { "1, nil", "nil" }
    assert.equals(0, code, out)
    assert.truthy(out:find("\n1\nnil\n", 1, true), out)
    assert.truthy(out:find("> nil\nnil\n", 1, true), out)
  end)
  it("echoes piped lines without terminal escape codes, even lines longer than 80 columns", function()
    -- (readline, given a TERM, redraws a line that ends at its 80th column with cursor motions)
    local lines = {}
    for n = 70, 90 do lines[#lines + 1] = "x = 1 + 1 -- " .. ("a"):rep(n - 13) end
    lines[#lines + 1] = "x * 21"
    local out, code = session(lines, "TERM=xterm ")
    assert.equals(0, code, out)
    assert.falsy(out:find("\27", 1, true), "escape codes in piped output:\n" .. out)
    assert.truthy(out:find("> " .. lines[9] .. "\n> " .. lines[10] .. "\n", 1, true), out)
    assert.truthy(out:find("> x * 21\n42\n", 1, true), out)
  end)

  it(":reload and :recipes list a reloaded recipe once", function()
    local d = tmpdir()
    local src = [[
return {
  name = "twice", options = {lr = {default = %s, type = "number"}},
  route = function() return "all" end,
  routes = {all = {step = function(group, o, ctx)
    for _, m in ipairs(group) do m.param:sub_(m.grad * ctx.lr) end
  end}},
}]]
    local path = d .. "/twice.lua"
    write(path, src:format("0.1"))
    local out, code = session {
      ("r = ms.recipe.load(%q)"):format(path),
      ("f = io.open(%q, 'w') f:write(%q) f:close()"):format(path, src:format("0.2")),
      ":reload", ":reload twice", ":recipes", "r.options.lr.default",
    }
    os.execute("rm -rf " .. q(d))
    assert.equals(0, code, out)
    local function count(s)
      local n, from = 0, 1
      while true do
        local i = out:find(s, from, true)
        if not i then return n end
        n, from = n + 1, i + #s
      end
    end
    assert.equals(1, count("twice: reloaded from"), out)
    assert.equals(1, count("twice: unchanged"), out)
    assert.equals(1, count("twice      " .. path), out)
    assert.truthy(out:find("\n0.2\n", 1, true), out)
  end)
end)
