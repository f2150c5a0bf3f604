-- moonstep.json, the Lua-side encoder/decoder for metadata, options and settings.
local json = require("moonstep.json")

describe("moonstep.json", function()
  it("round-trips values exactly, with stable key order", function()
    local v = { b = { 1, 2.5, -3e-300, 0.1 }, a = "q\"\\\n\t\1é", c = true, d = false, e = {} }
    local s = json.encode(v)
    assert.equals('{"a":"q\\"\\\\\\n\\t\\u0001é","b":[1,2.5,-3e-300,0.1],"c":true,"d":false,"e":{}}', s)
    assert.same(v, json.decode(s))
    assert.equals("0.1", json.encode(0.1))
    assert.equals(2 ^ -40, json.decode(json.encode(2 ^ -40)))
  end)

  it("encodes json.empty_array as [] (an empty table is {}), and keeps it read-only", function()
    assert.equals('{"e":{},"shape":[]}', json.encode({ shape = json.empty_array, e = {} }))
    assert.equals("[[],1]", json.encode({ json.empty_array, 1 }))
    assert.has_error(function() json.empty_array[1] = 2 end)
    assert.equals("[]", json.encode(json.empty_array))
  end)

  it("decodes escapes and surrogate pairs", function()
    assert.equals("A\240\159\152\128", json.decode('"\\u0041\\ud83d\\ude00"'))
    assert.equals(json.null, json.decode("[null]")[1])
  end)

  it("refuses what it cannot encode and malformed text, with positions", function()
    assert.has_error(function() json.encode(0 / 0) end)
    assert.has_error(function() json.encode({ [1.5] = 1 }) end)
    local t = {}
    t.self = t
    assert.has_error(function() json.encode(t) end)
    for _, bad in ipairs { "", "{", "[1,]", "{\"a\" 1}", "01", "1.", "1.e5", "-2.E-1", "\"\\ud800\"", "tru", "[1] x", "\"a\nb\"" } do
      local ok, err = pcall(json.decode, bad)
      assert.is_false(ok, bad)
      assert.truthy(tostring(err):find("json:", 1, true), err)
    end
  end)

  it("reads the number forms RFC 8259 allows", function()
    for text, v in pairs { ["1e5"] = 1e5, ["-1.5E+2"] = -150, ["0.25e-1"] = 0.025, ["-0"] = 0, ["7"] = 7 } do
      assert.equals(v, json.decode(text), text)
    end
  end)

  it("refuses what the engine's parser refuses: a key given twice, a number past the range of a double", function()
    -- (read leniently, {"step":1,"step":2} in a checkpoint's metadata loaded as step 2, and 1e999 as inf)
    for bad, why in pairs { ['{"step":1,"step":2}'] = 'duplicate key "step" at byte 11', ['[1,{"a":null,"a":3}]'] = "duplicate key",
                            ["1e999"] = "out of the range of a double", ["[-1e400]"] = "out of the range of a double at byte 2" } do
      local ok, err = pcall(json.decode, bad)
      assert.is_false(ok, bad)
      assert.truthy(tostring(err):find(why, 1, true), err)
    end
    -- the same key in two objects, and numbers near the limits, are fine
    assert.same({ { a = 1 }, { a = 2 } }, json.decode('[{"a":1},{"a":2}]'))
    assert.equals(1.7976931348623157e308, json.decode("1.7976931348623157e308"))
    assert.equals(0, json.decode("1e-999"))
  end)

  -- found by tests/fuzz/fuzz_checkpoint: a DEL byte in a string made the decoder spin forever
  it("takes DEL (0x7f) in strings as text, and round-trips it", function()
    assert.equals("a\127b", json.decode('"a\127b"'))
    assert.equals("x\127", json.decode(json.encode("x\127")))
  end)
end)
