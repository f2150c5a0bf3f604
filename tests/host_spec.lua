-- build/moonstep, the embedding host: scripts with arguments, -e, the prompt, errors, any directory.
local build = os.getenv("MOONSTEP_BUILD") or "build"
local host = (build:sub(1, 1) == "/" and build or (os.getenv("PWD") .. "/" .. build)) .. "/moonstep"

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"exit=$?\"")
  local out = p:read("*a")
  p:close()
  local body, code = out:match("^(.-)exit=(%d+)\n$")
  return body, tonumber(code)
end

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

describe("the moonstep host", function()
  it("runs code with -e and has `ms` preloaded, from any directory", function()
    local out, code = sh("cd / && " .. host .. " -e " .. q("print(ms.version, ms.zeros({2,3}):sum(), type(require('moonstep')))"))
    assert.equals(0, code)
    assert.truthy(out:match("^%d+%.%d+%.%d+\t0\ttable\n$"), out)
  end)

  it("runs a script with its arguments in `arg`, with `run` or directly", function()
    local path = os.tmpname() .. ".lua"
    local f = assert(io.open(path, "w"))
    f:write("print(arg[0] ~= nil, select('#', ...), arg[1], arg[2], ms.tensor({1,2}):sum())\n")
    f:close()
    local out1, c1 = sh("cd /tmp && " .. host .. " " .. path .. " x 'y z'")
    local out2, c2 = sh(host .. " run " .. path .. " x 'y z'")
    os.remove(path)
    assert.equals(0, c1)
    assert.equals(0, c2)
    assert.equals("true\t2\tx\ty z\t3\n", out1)
    assert.equals(out1, out2)
  end)

  it("reports errors with a traceback and a non-zero exit", function()
    local out, code = sh(host .. " -e " .. q("local x = ms.zeros({2}) + ms.zeros({3})"))
    assert.equals(1, code)
    assert.truthy(out:find("do not broadcast", 1, true), out)
    assert.truthy(out:find("stack traceback", 1, true), out)
    -- a script that is not there is a usage error (2), one that fails is a failure (1)
    local out2, code2 = sh(host .. " /nonexistent.lua")
    assert.equals(2, code2)
    assert.truthy(out2:find("cannot read the script '/nonexistent.lua'", 1, true), out2)
    local out3, code3 = sh(host .. " --bogus")
    assert.equals(2, code3)
    assert.truthy(out3:find("unknown option '--bogus'", 1, true), out3)
  end)

  it("prints its version and usage", function()
    local out, code = sh(host .. " --version")
    assert.equals(0, code)
    assert.truthy(out:match("^moonstep %d+%.%d+%.%d+ %(abi %d+%)\n$"), out)
    local help = sh(host .. " --help")
    assert.truthy(help:find("usage: moonstep", 1, true))
  end)

  it("evaluates lines at the prompt, prints results and survives errors", function()
    local input = "1 + 2\nms.tensor({{1, 2}})\nerror('boom')\nlocal x = 4\nfor i = 1, 2 do\nprint(i * 10)\nend\n{a = 1}\n"
    local out, code = sh("printf " .. q(input) .. " | " .. host)
    assert.equals(0, code)
    assert.truthy(out:find("\n3\n", 1, true) or out:find("^3\n") or out:find("> 3\n", 1, true), out)
    assert.truthy(out:find("tensor([[1, 2]], dtype=f32", 1, true), out)
    assert.truthy(out:find("boom", 1, true), out)
    assert.truthy(out:find("10", 1, true) and out:find("20", 1, true), out)
    assert.truthy(out:find("{a = 1}", 1, true), out)
  end)
end)
