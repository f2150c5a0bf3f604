-- safetensors files through ms.save / ms.load: round trips of every dtype and layout, corrupt files built
-- by hand (each refused with a message naming the problem), atomic writes, and files exchanged with the
-- reference Python implementation (`safetensors` + numpy), when python3 has them.
local ms = require("moonstep")

local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p '" .. dir .. "'")

local function path_of(name) return dir .. "/" .. name end

local write_file, read_file = H.write_file, H.read_file

-- little-endian u64 of an integer below 2^53
local function u64le(n)
  local b = {}
  for i = 1, 8 do
    b[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(b)
end

local function st_bytes(header, data) return u64le(#header) .. header .. (data or "") end

local function entries_in(d)
  local p = io.popen("ls -A '" .. d .. "'")
  local out = p:read("*a")
  p:close()
  local names = {}
  for line in out:gmatch("[^\n]+") do names[#names + 1] = line end
  return names
end

local function temp_files()
  local found = {}
  for _, n in ipairs(entries_in(dir)) do if n:find(".tmp.", 1, true) then found[#found + 1] = n end end
  return found
end

-- exact comparison that treats NaN as equal to NaN and tells -0 from 0
local function same_values(got, want, where)
  assert.equals(#want, #got, where .. ": element count")
  for i = 1, #want do
    local g, w = got[i], want[i]
    local ok = (g ~= g and w ~= w) or (g == w and (g ~= 0 or 1 / g == 1 / w))
    if not ok then error(("%s: element %d is %.17g, expected %.17g"):format(where, i, g, w), 2) end
  end
end

local dtypes = { "f32", "f64", "bf16", "f16", "i32", "u8" }

-- values every dtype holds exactly
local function exact_data(dt)
  if dt == "u8" then return { { 0, 1, 127 }, { 128, 254, 255 } } end
  if dt == "i32" then return { { -2147483648, -1, 0 }, { 1, 65536, 2147483647 } } end
  return { { 1, -2.5, 0.25 }, { 100, -0.0078125, 3 } }
end

teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

describe("safetensors round trips", function()
  it("keeps every dtype bit for bit, with its shape and dtype", function()
    local p = path_of("all.safetensors")
    local src = {}
    for _, dt in ipairs(dtypes) do src["exact_" .. dt] = ms.tensor(exact_data(dt), { dtype = dt }) end
    for _, dt in ipairs(H.dtypes_float) do src["randn_" .. dt] = ms.randn({ 17, 9 }, { dtype = dt }) end
    ms.save(p, src)
    local got, meta, order = ms.load(p)
    local n = 0
    for name, t in pairs(src) do
      n = n + 1
      assert.is_not_nil(got[name], name)
      assert.equals(t:dtype(), got[name]:dtype(), name)
      assert.same(t:shape(), got[name]:shape(), name)
      same_values(got[name]:tolist_flat(), t:tolist_flat(), name)
    end
    assert.equals(n, #order)
    assert.same({}, meta)
    local sorted = {}
    for name in pairs(src) do sorted[#sorted + 1] = name end
    table.sort(sorted)
    assert.same(sorted, order)   -- the binding writes names sorted, and load reports file order
  end)

  it("keeps NaN, infinities and -0", function()
    local p = path_of("special.safetensors")
    for _, dt in ipairs(H.dtypes_float) do
      local src = ms.tensor({ 0 / 0, math.huge, -math.huge, -0.0, 0 }, { dtype = dt })
      ms.save(p, { x = src })
      local got = ms.load(p)
      same_values(got.x:tolist_flat(), src:tolist_flat(), dt)
    end
  end)

  it("writes 0-dim and empty tensors", function()
    local p = path_of("shapes.safetensors")
    ms.save(p, { s = ms.tensor(3.5, { dtype = "f64" }), e = ms.zeros({ 0, 3 }, { dtype = "bf16" }),
                 e2 = ms.zeros({ 4, 0 }, { dtype = "u8" }), one = ms.tensor({ 7 }, { dtype = "i32" }) })
    local got = ms.load(p)
    assert.same({}, got.s:shape())
    assert.equals(3.5, got.s:item())
    assert.same({ 0, 3 }, got.e:shape())
    assert.equals("bf16", got.e:dtype())
    assert.same({ 4, 0 }, got.e2:shape())
    assert.same({ 7 }, got.one:totable())
  end)

  it("writes non-contiguous sources in row-major order", function()
    local p = path_of("strided.safetensors")
    local base = ms.randn({ 5, 7 }, { dtype = "bf16" })
    local t = base:transpose(0, 1)
    local cols = ms.tensor({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 } }, { dtype = "i32" }):slice(1, 0, 4, 2)
    assert.is_false(t:is_contiguous())
    ms.save(p, { t = t, cols = cols })
    local got = ms.load(p)
    assert.same({ 7, 5 }, got.t:shape())
    assert.is_true(got.t:is_contiguous())
    same_values(got.t:tolist_flat(), t:tolist_flat(), "transposed")
    assert.same({ { 1, 3 }, { 5, 7 } }, got.cols:totable())
  end)

  it("keeps metadata, unicode names and many tensors", function()
    local p = path_of("meta.safetensors")
    local src = {}
    for i = 0, 99 do src[("layer.%d.weight"):format(i)] = ms.tensor({ i }, { dtype = "f32" }) end
    src["naïve → 😀"] = ms.ones({ 2 }, { dtype = "u8" })
    local meta = { format = "pt", note = 'line1\nline2 "quoted" \\ é', empty = "", ["ключ"] = "значение" }
    ms.save(p, src, meta)
    local got, gmeta = ms.load(p)
    assert.same(meta, gmeta)
    for i = 0, 99 do assert.same({ i }, got[("layer.%d.weight"):format(i)]:totable()) end
    assert.same({ 1, 1 }, got["naïve → 😀"]:totable())
  end)

  it("pads the header to 8 bytes and aligns every tensor", function()
    local p = path_of("layout.safetensors")
    ms.save(p, { a = ms.ones({ 3 }, { dtype = "u8" }), b = ms.ones({ 3 }, { dtype = "f64" }),
                 c = ms.ones({ 1 }, { dtype = "bf16" }), d = ms.ones({ 2 }, { dtype = "f32" }) })
    local bytes = read_file(p)
    local n = 0
    for i = 8, 1, -1 do n = n * 256 + bytes:byte(i) end
    assert.equals(0, n % 8)
    local header = ms.json.decode(bytes:sub(9, 8 + n))
    local size = { F64 = 8, F32 = 4, BF16 = 2, U8 = 1 }
    local total = 0
    for name, e in pairs(header) do
      assert.equals(0, e.data_offsets[1] % size[e.dtype], name .. " aligned")
      total = total + e.data_offsets[2] - e.data_offsets[1]
    end
    assert.equals(#bytes - 8 - n, total)
    assert.equals(3 + 24 + 2 + 8, total)
  end)
end)

describe("safetensors refuses corrupt files", function()
  local p = path_of("bad.safetensors")
  local function entry(dtype, shape, b, e)
    return ('{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'):format(dtype, shape, b, e)
  end
  local cases = {
    { "invalid JSON", st_bytes("{\"a\":", ""), "header is not valid JSON: header byte 5: unexpected end of input" },
    { "not an object", st_bytes("[1,2]", ""), "header is not a JSON object" },
    { "entry of a wrong type", st_bytes('{"a":"x"}', ""), 'tensor "a": entry is not an object' },
    { "dtype of a wrong type", st_bytes('{"a":{"dtype":1,"shape":[1],"data_offsets":[0,1]}}', "x"), 'tensor "a": dtype is not a string' },
    { "shape of a wrong type", st_bytes('{"a":{"dtype":"U8","shape":"1","data_offsets":[0,1]}}', "x"), 'tensor "a": shape is not an array' },
    { "negative dim", st_bytes('{"a":' .. entry("U8", "-1", 0, 0) .. '}', ""), 'tensor "a": shape[0] is not a non-negative integer' },
    { "fractional dim", st_bytes('{"a":' .. entry("U8", "1.5", 0, 1) .. '}', "x"), "shape[0] is not a non-negative integer" },
    { "offsets of a wrong type", st_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":"0,1"}}', "x"),
      'tensor "a": data_offsets is not [begin, end]' },
    { "missing key", st_bytes('{"a":{"dtype":"U8","shape":[1]}}', "x"), 'tensor "a": missing key "data_offsets"' },
    { "extra key", st_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"crc":0}}', "x"), 'tensor "a": unexpected key "crc"' },
    { "unknown dtype", st_bytes('{"w":' .. entry("F8_E4M3", "2", 0, 2) .. '}', "xx"),
      'tensor "w": dtype "F8_E4M3" is not supported' },
    { "too many dims", st_bytes('{"a":' .. entry("U8", "1,1,1,1,1,1,1,1,1", 0, 1) .. '}', "x"), "9 dims, more than MS_MAX_DIMS (8)" },
    { "size mismatch", st_bytes('{"a":' .. entry("F32", "2,2", 0, 12) .. '}', ("x"):rep(12)),
      'tensor "a": shape [2,2] of F32 needs 16 bytes but data_offsets [0, 12] hold 12' },
    { "begin after end", st_bytes('{"a":' .. entry("U8", "0", 3, 1) .. '}', "xxx"), "data_offsets [3, 1] end before they begin" },
    { "out of range", st_bytes('{"a":' .. entry("U8", "8", 0, 8) .. '}', "xxxx"),
      'tensor "a": data_offsets [0, 8] run past the end of the data (4 bytes; truncated file?)' },
    { "overlap", st_bytes('{"a":' .. entry("U8", "4", 0, 4) .. ',"b":' .. entry("U8", "4", 2, 6) .. '}', "xxxxxx"),
      'tensors "a" and "b" overlap (data_offsets [0, 4] and [2, 6])' },
    { "hole", st_bytes('{"a":' .. entry("U8", "2", 0, 2) .. ',"b":' .. entry("U8", "2", 4, 6) .. '}', "xxxxxx"),
      'data bytes [2, 4) belong to no tensor (a hole before "b")' },
    { "trailing bytes", st_bytes('{"a":' .. entry("U8", "2", 0, 2) .. '}', "xxxxx"), "data bytes [2, 5) at the end belong to no tensor" },
    { "duplicate names", st_bytes('{"a":' .. entry("U8", "1", 0, 1) .. ',"a":' .. entry("U8", "1", 1, 2) .. '}', "xx"),
      'duplicate tensor name "a"' },
    { "metadata of a wrong type", st_bytes('{"__metadata__":{"step":1}}', ""), '__metadata__ value of "step" is not a string' },
    { "short file", "\3\0\0\0", "file of 4 bytes is too short for the 8-byte header length" },
    { "header past the end", u64le(100) .. "{}", "header length 100 runs past the end of the file (10 bytes)" },
    { "absurd header length", "not a safetensors file", "is over the limit of 100000000 bytes" },
  }
  for _, c in ipairs(cases) do
    it("refuses " .. c[1], function()
      write_file(p, c[2])
      H.expect_error(function() ms.load(p) end, "ms_safetensors_load: " .. p .. ": ", c[3])
    end)
  end

  it("refuses a valid file truncated at every length", function()
    local good = path_of("good.safetensors")
    ms.save(good, { w = ms.randn({ 3, 4 }), b = ms.ones({ 5 }, { dtype = "bf16" }) }, { k = "v" })
    local bytes = read_file(good)
    assert.is_true(#bytes > 100)
    for len = 0, #bytes - 1 do
      write_file(p, bytes:sub(1, len))
      local ok, err = pcall(ms.load, p)
      assert.is_false(ok, "a file cut at " .. len .. " bytes loaded")
      assert.truthy(tostring(err):find("ms_safetensors_load: ", 1, true), tostring(err))
    end
    write_file(p, bytes)
    local got = ms.load(p)
    assert.same({ 5 }, got.b:shape())
  end)

  it("reports a missing file with the OS's reason", function()
    local missing = path_of("does-not-exist.safetensors")
    H.expect_error(function() ms.load(missing) end, missing, "No such file or directory")
  end)
end)

describe("safetensors atomic save", function()
  local p = path_of("atomic.safetensors")

  it("leaves no temporary file behind", function()
    ms.save(p, { a = ms.ones({ 4 }) })
    ms.save(p, { a = ms.zeros({ 4 }) })
    assert.same({}, temp_files())
    assert.same({ 0, 0, 0, 0 }, ms.load(p).a:totable())
  end)

  it("refuses bad names before touching the file", function()
    ms.save(p, { old = ms.ones({ 2 }) })
    local before = read_file(p)
    H.expect_error(function() ms.save(p, { ["__metadata__"] = ms.ones({ 1 }) }) end, "ms_safetensors_save", "__metadata__")
    H.expect_error(function() ms.save(p, { [""] = ms.ones({ 1 }) }) end, "ms_safetensors_save", "is empty")
    H.expect_error(function() ms.save(p, { ["bad\255"] = ms.ones({ 1 }) }) end, "not valid UTF-8")
    -- C reads a name up to its first NUL: "w\0x" was saved as w
    H.expect_error(function() ms.save(p, { ["w\0x"] = ms.ones({ 1 }) }) end,
                   'save: a tensor name must not contain a NUL byte (got "w\\0x")')
    assert.equals(before, read_file(p))
    assert.same({}, temp_files())
  end)

  it("refuses a path with a NUL byte, which C would cut there (another file)", function()
    local cut = path_of("cut.safetensors")
    os.remove(cut)
    H.expect_error(function() ms.save(cut .. "\0.bak", { a = ms.ones({ 1 }) }) end, "save: path must not contain a NUL byte")
    assert.is_nil(io.open(cut, "rb"))
    ms.save(cut, { a = ms.ones({ 1 }) })
    H.expect_error(function() ms.load(cut .. "\0.bak") end, "load: path must not contain a NUL byte")
    assert.same({}, temp_files())
  end)

  it("refuses malformed metadata JSON as MS_E_FORMAT and a non-string value as MS_E_ARG", function()
    -- moonstep.h: MS_E_FORMAT is malformed JSON, as ms_optimizer_new's options_json; a mistyped value is MS_E_ARG
    local core, T = require("moonstep.core"), require("moonstep.tensor")
    local ffi, C = core.ffi, core.C
    ms.save(p, { old = ms.ones({ 2 }) })
    local before = read_file(p)
    local names = ffi.new("const char *[1]", { "a" })
    local ts = ffi.new("const ms_tensor *[1]", { T.handle(ms.ones({ 2 })) })
    local ctx = T.handle_ctx(ms.device("cpu"))
    for _, case in ipairs({
      { '{"k":', C.MS_E_FORMAT, "metadata_json is not valid JSON" },
      { '["k"]', C.MS_E_FORMAT, "metadata_json is not a JSON object" },
      { '{"k":"v","k":"w"}', C.MS_E_FORMAT, 'metadata_json has the key "k" twice' },
      { '{"k":"v","step":3}', C.MS_E_ARG, 'the value of "step" is not a string' },
    }) do
      local st = C.ms_safetensors_save(ctx, p, 1, names, ts, case[1])
      assert.equals(ffi.string(C.ms_status_name(case[2])), ffi.string(C.ms_status_name(st)), case[1])
      local msg = ffi.string(C.ms_last_error())
      assert.truthy(msg:find("ms_safetensors_save: ", 1, true) and msg:find(case[3], 1, true), msg)
    end
    assert.equals(before, read_file(p))
    assert.same({}, temp_files())
  end)

  it("leaves the old file intact when a save fails in the middle of the data", function()
    ms.save(p, { old = ms.ones({ 2 }) }, { v = "1" })
    local before = read_file(p)
    -- staging the strided tensor needs 64 more bytes than its context may hold
    local small = ms.context { device = "cpu", mem_limit = 64 }
    local strided = ms.zeros({ 4, 4 }, { ctx = small }):transpose(0, 1)
    H.expect_error(function() ms.save(p, { a = ms.ones({ 1000 }), b = strided }) end,
      "ms_safetensors_save: " .. p, 'reading tensor "b"')
    assert.equals(before, read_file(p))
    assert.same({}, temp_files())
  end)

  it("refuses a path naming an existing folder before writing anything (MS_E_ARG, as moonstep.h says)", function()
    local target = path_of("a-folder")
    os.execute("mkdir -p '" .. target .. "/inside'")
    H.expect_error(function() ms.save(target, { a = ms.ones({ 2 }) }) end, "ms_safetensors_save",
      "names a folder")
    assert.same({}, temp_files())
    assert.same({ "inside" }, entries_in(target))
  end)

  it("reports a missing folder", function()
    H.expect_error(function() ms.save(dir .. "/no/such/x.safetensors", { a = ms.ones({ 1 }) }) end,
      "ms_safetensors_save", "No such file or directory")
  end)
end)

-- --- the reference implementation ------------------------------------------------------------------

-- python runs without the sanitizer runtime `make memcheck` preloads into luajit
local PY = "env -u LD_PRELOAD python3"

local function python_ok()
  local p = io.popen(PY .. " -c 'import safetensors, numpy; print(\"yes\")' 2>/dev/null")
  if not p then return false end
  local out = p:read("*a")
  p:close()
  return out:match("yes") ~= nil
end
local have_python = python_ok()
local py_it = have_python and it or function(name)
  pending(name .. " (python3 with safetensors and numpy is not available)")
end

-- runs a python script with arguments; returns the JSON it printed after "RESULT "
local function python(script, ...)
  local file = path_of("script.py")
  write_file(file, script)
  local args = {}
  for i, a in ipairs { ... } do args[i] = "'" .. a .. "'" end
  local p = io.popen(PY .. " '" .. file .. "' " .. table.concat(args, " ") .. " 2>&1")
  local out = p:read("*a")
  p:close()
  local json = out:match("RESULT (.-)\n")
  if not json then error("python failed:\n" .. out, 2) end
  return ms.json.decode(json)
end

-- Writes with the reference implementation: numpy arrays for what numpy has, raw bf16 bits otherwise.
local py_write = [==[
import sys, json, numpy as np
from safetensors import serialize_file
try:
    from safetensors import TensorSpec   # releases from 0.6 take pointers ...
except ImportError:
    TensorSpec = None                    # ... older ones dicts of bytes
path = sys.argv[1]
i = np.arange(12)
arrays = {
    "f32": ((i - 5) * 0.25).astype(np.float32).reshape(3, 4),
    "f64": np.array([0.1, -1e300, 5e-324, np.pi]),
    "f16": (np.arange(6) * -0.5).astype(np.float16).reshape(2, 3, 1),
    "i32": np.array([[-2**31, 2**31 - 1], [0, -7]], dtype=np.int32),
    "u8": np.arange(0, 256, 51, dtype=np.uint8),
    "scalar": np.array(2.5, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "transposed": np.ascontiguousarray(np.arange(20, dtype=np.float32).reshape(4, 5).T),
}
meta = {"format": "np", "note": "caf\u00e9 \"q\"\n"}
bufs = dict(arrays)
bufs["bf16"] = np.array([0x3f80, 0xc020, 0x3e80, 0x7f80, 0xff80], dtype=np.uint16)   # 1 -2.5 0.25 inf -inf
dtypes = {k: v.dtype.name for k, v in arrays.items()}
dtypes["bf16"] = "bfloat16"
if TensorSpec is not None:
    specs = {k: TensorSpec(dtype=dtypes[k], shape=list(b.shape), data_ptr=b.ctypes.data, data_len=b.nbytes)
             for k, b in bufs.items()}
else:
    specs = {k: {"dtype": dtypes[k], "shape": list(b.shape), "data": b.tobytes()} for k, b in bufs.items()}
serialize_file(specs, path, metadata=meta)
out = {k: {"shape": list(v.shape), "values": [float(x) for x in v.reshape(-1)]} for k, v in arrays.items()}
out["bf16"] = {"shape": [5], "values": [1.0, -2.5, 0.25, "inf", "-inf"]}
print("RESULT " + json.dumps({"tensors": out, "meta": meta}))
]==]

-- Reads with the reference implementation: raw entries (every dtype, bf16 included) and the metadata.
local py_read = [==[
import sys, json, numpy as np
from safetensors import deserialize, safe_open
path = sys.argv[1]
raw = deserialize(open(path, "rb").read())
out = {}
for name, e in raw:
    data = bytes(e["data"])
    if e["dtype"] == "BF16":
        vals = (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        np_dt = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "U8": np.uint8}[e["dtype"]]
        vals = np.frombuffer(data, dtype=np_dt)
    out[name] = {"dtype": e["dtype"], "shape": list(e["shape"]), "values": [repr(float(v)) for v in vals]}
with safe_open(path, framework="np") as f:
    meta = f.metadata() or {}
    names = sorted(f.keys())
print("RESULT " + json.dumps({"tensors": out, "meta": meta, "names": names}))
]==]

local function to_number(v)
  if v == "inf" then return math.huge elseif v == "-inf" then return -math.huge elseif v == "nan" then return 0 / 0 end
  return type(v) == "string" and tonumber(v) or v
end

describe("safetensors and the reference Python implementation", function()
  py_it("reads files the reference implementation wrote", function()
    local p = path_of("from_python.safetensors")
    local ref = python(py_write, p)
    local got, meta = ms.load(p)
    assert.same(ref.meta, meta)
    local want_dtype = { f32 = "f32", f64 = "f64", f16 = "f16", i32 = "i32", u8 = "u8", scalar = "f32",
                         empty = "f32", transposed = "f32", bf16 = "bf16" }
    for name, r in pairs(ref.tensors) do
      local t = got[name]
      assert.is_not_nil(t, name)
      assert.equals(want_dtype[name], t:dtype(), name)
      assert.same(r.shape, t:shape(), name)
      local want = {}
      for i, v in ipairs(r.values) do want[i] = to_number(v) end
      same_values(t:tolist_flat(), want, name)
    end
  end)

  py_it("writes files the reference implementation reads", function()
    local p = path_of("to_python.safetensors")
    local src = {
      f32 = ms.randn({ 3, 5 }, { dtype = "f32" }), f64 = ms.randn({ 4 }, { dtype = "f64" }),
      bf16 = ms.randn({ 2, 3 }, { dtype = "bf16" }), f16 = ms.randn({ 7 }, { dtype = "f16" }),
      i32 = ms.tensor({ { -2147483648, 5 } }, { dtype = "i32" }), u8 = ms.tensor({ 0, 200, 255 }, { dtype = "u8" }),
      scalar = ms.tensor(-1.5, { dtype = "f64" }), empty = ms.zeros({ 2, 0 }, { dtype = "f16" }),
      strided = ms.randn({ 3, 4 }):transpose(0, 1),
    }
    local meta = { recipe = "sinkgd", step = "1200", note = "é\n\"x\"" }
    ms.save(p, src, meta)
    local ref = python(py_read, p)
    assert.same(meta, ref.meta)
    local names = {}
    for name, t in pairs(src) do
      names[#names + 1] = name
      local r = ref.tensors[name]
      assert.is_not_nil(r, name)
      assert.equals(t:dtype():upper(), r.dtype, name)
      assert.same(t:shape(), r.shape, name)
      local want = {}
      for i, v in ipairs(r.values) do want[i] = to_number(v) end
      same_values(t:tolist_flat(), want, name)
    end
    table.sort(names)
    assert.same(names, ref.names)
  end)
end)
