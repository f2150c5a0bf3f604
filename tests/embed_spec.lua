-- The C embedding API from the outside, as trainers use it: examples/c_train (built by `make examples`)
-- trains its MLP through ms_optimizer_* on the CPU (and on the GPU where there is one), and the README's C
-- trainer compiles against the build and runs as written.  The error paths are tests/c/test_embed.c's.
local root, build_dir, run = H.root, H.build_dir, H.shell

-- the losses the program printed, in order
local function losses(out)
  local list = {}
  for v in out:gmatch("step%s+%d+%s+loss%s+(%S+)") do list[#list + 1] = tonumber(v) end
  return list
end

local function assert_trained(out, factor)
  local l = losses(out)
  assert.is_true(#l >= 3, "no loss lines in:\n" .. out)
  for _, v in ipairs(l) do assert.is_true(v == v, "NaN loss in:\n" .. out) end
  assert.is_true(l[#l] < l[1] / factor, ("loss %g -> %g, not %gx lower:\n%s"):format(l[1], l[#l], factor, out))
end

describe("examples/c_train", function()
  local exe = build_dir .. "/examples/c_train"

  it("trains an MLP through the embedding API on the CPU (AdamW)", function()
    local out, rc = run(exe .. " cpu adamw 400")
    assert.equals(0, rc, out)
    assert_trained(out, 10)
    assert.truthy(out:find('"recipe":"adamw"', 1, true), out)
  end)

  it("runs SinkGD, which routes the biases to AdamW", function()
    local out, rc = run(exe .. " cpu sinkgd 600")
    assert.equals(0, rc, out)
    assert_trained(out, 10)
    assert.truthy(out:find('"name":"layers.0.weight","route":"sinkgd"', 1, true), out)
    assert.truthy(out:find('"name":"layers.0.bias","route":"adamw"', 1, true), out)
  end)

  it("reports an unknown recipe and exits 1", function()
    local out, rc = run(exe .. " cpu no_such_recipe 10")
    assert.equals(1, rc, out)
    assert.truthy(out:find('no recipe named "no_such_recipe"', 1, true), out)
  end)

  it("refuses a step count that is not a positive integer, and exits 2", function()
    for _, bad in ipairs { "ten", "0", "-5", "12x" } do
      local out, rc = run(exe .. " cpu adamw " .. bad)
      assert.equals(2, rc, out)
      assert.truthy(out:find("steps must be an integer", 1, true), out)
    end
  end)

  H.cuda_it("trains on the GPU", function()
    local out, rc = run(exe .. " cuda adamw 400")
    assert.equals(0, rc, out)
    assert_trained(out, 10)
  end)
end)

describe("the README's C trainer", function()
  it("compiles against the build and trains", function()
    local readme = assert(io.open("README.md")):read("*a")
    local block
    for b in readme:gmatch("```c\n(.-)```") do
      if b:find("ms_optimizer_new", 1, true) and b:find("int main", 1, true) then block = b end
    end
    assert.truthy(block, "README.md has a complete C program using ms_optimizer_new")
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. dir) == 0)
    local f = assert(io.open(dir .. "/train.c", "w"))
    f:write(block)
    f:close()
    -- under `make memcheck` the program is sanitized like the library, the compiler is not (LD_PRELOAD)
    local san = os.getenv("MOONSTEP_ASAN") == "1" and " -fsanitize=address" or ""
    local cc = "env -u LD_PRELOAD " .. (os.getenv("CC") or "cc") .. san
    local out, rc = run(("%s -std=c11 -Wall -Wextra -Werror -I%s/engine/include %s/train.c -o %s/train -L%s -lmoonstep "
                         .. "-Wl,-rpath,%s -lm"):format(cc, root, dir, dir, build_dir, build_dir))
    assert.equals(0, rc, out)
    out, rc = run(dir .. "/train")
    os.execute("rm -rf " .. dir)
    assert.equals(0, rc, out)
    assert_trained(out, 100)
  end)
end)
