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
    -- named by the call, with one source location (the allocator's; naming the call added a second)
    local function one_location(msg)
      local _, n = msg:gsub("%(engine/[%w_/]+%.c:%d+%)", "")
      assert.equals(1, n, msg)
    end
    assert.truthy(last():find("^ms_tensor_new: out of memory"), last())
    one_location(last())
    -- a strided tensor staged through a contiguous copy that the limit refuses
    local small = ms.context { device = "cpu", mem_limit = 600 }
    local xt = ms.zeros({ 10, 10 }, { ctx = small }):t()
    local buf = ffi.new("float[100]")
    for call, run in pairs {
      ms_tensor_read = function() return C.ms_tensor_read(tensor.handle_ctx(small), h(xt), buf, 400) end,
      ms_tensor_write = function() return C.ms_tensor_write(tensor.handle_ctx(small), h(xt), buf, 400) end,
      ms_tensor_contiguous = function() return C.ms_tensor_contiguous(tensor.handle_ctx(small), h(xt), core.out_tensor) end,
    } do
      assert.equals(C.MS_E_OOM, run(), call)
      assert.truthy(last():find("^" .. call .. ": .*out of memory"), last())
      one_location(last())
    end
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

  -- dst of shape [3, 3] over 5 floats with strides [1, 1]: elements (0, 1) and (1, 0) are one address
  local function self_overlapping(ctx_h, buf, shape, strides)
    local sh, st = ffi.new("int64_t[2]", shape), ffi.new("int64_t[2]", strides)
    assert.equals(C.MS_OK, C.ms_tensor_wrap(ctx_h, buf, C.MS_DTYPE_F32, 2, sh, st, core.out_tensor))
    return ffi.gc(core.out_tensor[0], C.ms_tensor_free)
  end
  it("MS_E_LAYOUT: a destination two of whose elements share an address, through every writing call", function()
    local buf = ffi.new("float[16]")
    for i = 0, 15 do buf[i] = i + 0.5 end
    local function unchanged()
      for i = 0, 15 do assert.equals(i + 0.5, buf[i]) end
    end
    local d = self_overlapping(cpu(), buf, { 3, 3 }, { 1, 1 })
    local src, one = ms.ones({ 3, 3 }), ms.ones({ 1 })
    local host = ffi.new("float[9]")
    local list = ffi.new("ms_tensor *[1]", d)
    local calls = {
      { "ms_fill", function() return C.ms_fill(cpu(), d, 2, nil) end },
      { "ms_copy", function() return C.ms_copy(cpu(), d, h(src)) end },
      { "ms_binary_scalar", function() return C.ms_binary_scalar(cpu(), d, h(src), 2, nil, C.MS_BINARY_MUL, 0) end },
      { "ms_reduce", function() return C.ms_reduce(cpu(), d, h(ms.ones({ 3, 3, 2 })), C.MS_REDUCE_SUM, 2) end },
      { "ms_matmul", function() return C.ms_matmul(cpu(), d, h(src), h(src), nil) end },
      { "ms_tensor_write", function() return C.ms_tensor_write(cpu(), d, host, 36) end },
      { "ms_foreach_scale", function() return C.ms_foreach_scale(cpu(), 1, list, 2, h(one)) end },
    }
    for _, c in ipairs(calls) do
      assert.equals(C.MS_E_LAYOUT, c[2](), c[1])
      assert.truthy(last():find(c[1] .. ": ", 1, true), last())
      assert.truthy(last():find("[3,3] has strides [1,1], under which two elements can share an address (dim 1's stride 1",
                                1, true), last())
      unchanged()
    end
    -- strides that interleave without touching are refused as well (documented); nested ones are written
    local inter = self_overlapping(cpu(), buf, { 2, 3 }, { 4, 3 })
    assert.equals(C.MS_E_LAYOUT, C.ms_fill(cpu(), inter, 2, nil))
    assert.truthy(last():find("dim 0's stride 4 lies within the span", 1, true), last())
    unchanged()
    local nested = self_overlapping(cpu(), buf, { 2, 2 }, { 3, 2 })   -- elements 0, 2, 3, 5
    assert.equals(C.MS_OK, C.ms_fill(cpu(), nested, -1, nil))
    for i = 0, 15 do assert.equals((i == 0 or i == 2 or i == 3 or i == 5) and -1 or i + 0.5, buf[i]) end
  end)

  it("names every status", function()
    for _, s in ipairs { "MS_OK", "MS_E_ARG", "MS_E_SHAPE", "MS_E_DTYPE", "MS_E_DEVICE", "MS_E_OOM", "MS_E_NUMERIC",
                         "MS_E_IO", "MS_E_FORMAT", "MS_E_UNSUPPORTED", "MS_E_LAYOUT", "MS_E_BACKEND" } do
      assert.equals(s, ffi.string(C.ms_status_name(C[s])))
    end
  end)
end)
