-- The README's Lua examples run as written (each complete ```lua block that loads moonstep).
local build = os.getenv("MOONSTEP_BUILD") or "build"
local host = (build:sub(1, 1) == "/" and build or (os.getenv("PWD") .. "/" .. build)) .. "/moonstep"

describe("README examples", function()
  local readme = assert(io.open("README.md")):read("*a")
  local n = 0
  for block in readme:gmatch("```lua\n(.-)```") do
    if block:find('require("moonstep")', 1, true) then
      n = n + 1
      local idx = n
      it("example " .. idx .. " runs", function()
        local dir = os.tmpname()
        os.remove(dir)
        assert(os.execute("mkdir -p " .. dir) == 0)
        local f = assert(io.open(dir .. "/example.lua", "w"))
        f:write(block)
        f:close()
        local p = io.popen("cd " .. dir .. " && " .. host .. " example.lua 2>&1; echo \"exit=$?\"")
        local out = p:read("*a")
        p:close()
        os.execute("rm -rf " .. dir)
        assert.truthy(out:match("exit=0\n$"), out)
      end)
    end
  end
  it("has examples", function() assert.is_true(n >= 2) end)
end)
