-- The Python bridge (python/moonstep) through its own test scripts, on this build's library:
-- tests/python/test_bridge.py and test_comm.py (communicators, sharded parameters, 2 ranks on the CPU) with NumPy
-- (CI), tests/python/test_torch.py with PyTorch and CuPy (where they are installed: the GPU host), and
-- tests/python/test_dist_torch.py under `torchrun --nproc_per_node=2` (#multigpu: torch and 2 GPUs).  Each script
-- prints "N passed, N failed"; any failure fails the spec, with the script's output.  Tagged #external: python3
-- would inherit the sanitizer that `make memcheck` preloads.
-- The README's Python examples run as written too: the NumPy one here, the PyTorch one where torch has a GPU.
local root, build_dir, run = H.root, H.build_dir, H.shell

local function python_ok(code)
  local _, rc = run("python3 -c '" .. code .. "'")
  return rc == 0
end
local function python_has(module) return python_ok("import " .. module) end

local function run_script(script, launcher)
  local out, rc = run(("MOONSTEP_LIBRARY=%s/libmoonstep.so %s tests/python/%s"):format(build_dir, launcher or "python3",
                                                                                      script))
  local passed, failed = out:match("\n(%d+) passed, (%d+) failed[^\n]*\nexit=%d+\n$")
  assert.truthy(passed, "no summary line:\n" .. out)
  assert.equals("0", failed, out)
  assert.equals(0, rc, out)
  assert.is_true(tonumber(passed) > 0, "nothing ran:\n" .. out)
end

describe("the Python bridge #external", function()
  if python_has("numpy") then
    it("passes tests/python/test_bridge.py (NumPy)", function() run_script("test_bridge.py") end)
    it("passes tests/python/test_comm.py (NumPy, 2 ranks on the CPU)", function() run_script("test_comm.py") end)
  else
    pending("tests/python/test_bridge.py (python3 with numpy is missing)")
    pending("tests/python/test_comm.py (python3 with numpy is missing)")
  end
  if python_ok("import torch; assert torch.cuda.device_count() >= 2") and run("command -v torchrun"):find("torchrun") then
    H.multigpu_it("passes tests/python/test_dist_torch.py under torchrun, 2 ranks #multigpu", function()
      run_script("test_dist_torch.py", "NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2")
    end)
  else
    pending("tests/python/test_dist_torch.py (torch with 2 GPUs and torchrun are missing) #multigpu")
  end
  if python_has("torch") or python_has("cupy") then
    it("passes tests/python/test_torch.py (PyTorch, CuPy)", function() run_script("test_torch.py") end)
  else
    pending("tests/python/test_torch.py (neither torch nor cupy is installed)")
  end

  local readme = assert(io.open("README.md")):read("*a")
  local n = 0
  for block in readme:gmatch("```python\n(.-)```") do
    n = n + 1
    local name = ("runs the README's Python example %d"):format(n)
    local torch = block:find("import torch", 1, true)
    local ready = torch and python_ok("import torch; assert torch.cuda.is_available()") or
                  (not torch and python_has("numpy"))
    if not ready then
      pending(name .. (torch and " (torch with a GPU is missing)" or " (numpy is missing)"))
    else
      it(name, function()
        local dir = os.tmpname()
        os.remove(dir)
        assert(os.execute("mkdir -p " .. dir) == 0)
        local f = assert(io.open(dir .. "/example.py", "w"))
        f:write(block)
        f:close()
        local out, rc = run(("cd %s && PYTHONPATH=%s/python MOONSTEP_LIBRARY=%s/libmoonstep.so python3 example.py")
                            :format(dir, root, build_dir))
        os.execute("rm -rf " .. dir)
        assert.equals(0, rc, out)
      end)
    end
  end
end)
