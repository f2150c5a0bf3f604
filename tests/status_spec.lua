-- Every status code the engine returns is reachable through the C ABI, and its message names the problem.
local ms = require("moonstep")
local core = require("moonstep.core")
local tensor = require("moonstep.tensor")
local ffi, C = core.ffi, core.C

local function h(t) return tensor.handle(t) end
local function cpu() return tensor.handle_ctx(ms.device("cpu")) end
local function last() return ffi.string(C.ms_last_error()) end

describe("status codes", function()
  it("MS_E_ARG: an unparsable device, a NULL object", function()
    assert.equals(C.MS_E_ARG, C.ms_ctx_new("tpu", nil, core.out_ctx))
    assert.truthy(last():find('unknown device "tpu"', 1, true))
    assert.equals(C.MS_E_ARG, C.ms_fill(cpu(), nil, 0, nil))
    assert.truthy(last():find("dst is NULL", 1, true))
  end)

  it("MS_E_SHAPE: shapes that do not fit", function()
    local a, b = ms.zeros({ 2, 3 }), ms.zeros({ 4 })
    assert.equals(C.MS_E_SHAPE, C.ms_binary(cpu(), h(a), h(a), h(b), C.MS_BINARY_ADD))
    assert.truthy(last():find("does not broadcast", 1, true))
  end)

  it("MS_E_DTYPE: a dtype the op does not take", function()
    local i = ms.zeros({ 2, 2 }, { dtype = "i32" })
    local w = ms.zeros({ 2 }, { dtype = "i32" })
    assert.equals(C.MS_E_DTYPE, C.ms_eigh(cpu(), h(w), nil, h(i), nil))
    assert.truthy(last():find("i32", 1, true))
  end)

  it("MS_E_DEVICE or MS_E_UNSUPPORTED: a CUDA context without a usable GPU", function()
    if H.has_cuda then
      assert.equals(C.MS_E_DEVICE, C.ms_ctx_new("cuda:1000", nil, core.out_ctx))
    else
      local st = C.ms_ctx_new("cuda:0", nil, core.out_ctx)
      -- built with CUDA: no device (MS_E_DEVICE); built without: MS_E_UNSUPPORTED
      assert.is_true(st == C.MS_E_DEVICE or st == C.MS_E_UNSUPPORTED, ffi.string(C.ms_status_name(st)))
      if ms.build_info:find("cuda", 1, true) then assert.equals(C.MS_E_DEVICE, st) else assert.equals(C.MS_E_UNSUPPORTED, st) end
    end
    assert.truthy(last():find("cuda", 1, true))
  end)

  it("MS_E_OOM: the context's memory limit", function()
    local c = ms.context { device = "cpu", mem_limit = 64 }
    local shape = ffi.new("int64_t[1]", 100)
    assert.equals(C.MS_E_OOM, C.ms_tensor_new(tensor.handle_ctx(c), C.MS_DTYPE_F32, 1, shape, core.out_tensor))
    assert.truthy(last():find("limit 64", 1, true))
  end)

  it("MS_E_NUMERIC: an eigendecomposition of a matrix with NaN", function()
    local a = ms.tensor({ { 1, 0 / 0 }, { 0 / 0, 1 } })
    local w = ms.zeros({ 2 })
    local info = ffi.new("int[1]")
    assert.equals(C.MS_E_NUMERIC, C.ms_eigh(cpu(), h(w), nil, h(a), info))
    assert.equals(-5, info[0])
  end)

  it("MS_E_IO and MS_E_FORMAT: a missing file and a corrupt one", function()
    assert.equals(C.MS_E_IO, C.ms_safetensors_load(cpu(), "/nonexistent/x.safetensors", core.out_set))
    assert.truthy(last():find("/nonexistent/x.safetensors", 1, true))
    local path = os.tmpname()
    local f = assert(io.open(path, "wb"))
    f:write("\4\0\0\0\0\0\0\0{}")      -- header length 4 but only 2 bytes follow
    f:close()
    assert.equals(C.MS_E_FORMAT, C.ms_safetensors_load(cpu(), path, core.out_set))
    os.remove(path)
  end)

  it("MS_E_UNSUPPORTED: a dtype the format names but moonstep does not store", function()
    local path = os.tmpname()
    local header = '{"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}'
    local f = assert(io.open(path, "wb"))
    f:write(string.char(#header, 0, 0, 0, 0, 0, 0, 0), header, "xx")
    f:close()
    assert.equals(C.MS_E_UNSUPPORTED, C.ms_safetensors_load(cpu(), path, core.out_set))
    assert.truthy(last():find("F8_E4M3", 1, true))
    os.remove(path)
  end)

  it("MS_E_LAYOUT: a view the layout cannot give, and writing through an expanded view", function()
    local t = ms.zeros({ 2, 3 }):t()
    local shape = ffi.new("int64_t[1]", 6)
    assert.equals(C.MS_E_LAYOUT, C.ms_tensor_reshape(cpu(), h(t), 1, shape, core.out_tensor))
    local e = ms.zeros({ 1, 3 }):expand({ 4, 3 })
    assert.equals(C.MS_E_LAYOUT, C.ms_fill(cpu(), h(e), 1, nil))
  end)

  it("names every status", function()
    for _, s in ipairs { "MS_OK", "MS_E_ARG", "MS_E_SHAPE", "MS_E_DTYPE", "MS_E_DEVICE", "MS_E_OOM", "MS_E_NUMERIC",
                         "MS_E_IO", "MS_E_FORMAT", "MS_E_UNSUPPORTED", "MS_E_LAYOUT", "MS_E_BACKEND" } do
      assert.equals(s, ffi.string(C.ms_status_name(C[s])))
    end
  end)
end)
