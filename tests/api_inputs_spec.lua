-- Inputs of the Lua tensor API that were taken silently or failed inside the binding: each bad call must be
-- refused with an error naming the argument (raised where the caller called, not inside moonstep's files), and
-- change nothing; the values an op gives must not be truncated to an integer dtype.
local ms = H.ms

local function vals(t) return t:tolist_flat() end

-- the error of fn, asserted to point at this file (the caller), not into the binding
local function caller_error(fn, ...)
  local err = H.expect_error(fn, ...)
  assert.truthy(err:find("api_inputs_spec.lua", 1, true), err)
  assert.falsy(err:find("moonstep/", 1, true), err)
  return err
end

describe("fused steps: steps and step", function()
  it("are exclusive (step was dropped for steps, silently), and nothing changes", function()
    local p = ms.tensor({ 1, 2 })
    local m, v = ms.zeros({ 2 }), ms.zeros({ 2 })
    caller_error(function()
      ms.sgd_step { params = { p }, grads = { ms.ones({ 2 }) }, steps = { 1 }, step = 5, lr = 0.1 }
    end, "sgd_step: steps and step are exclusive")
    caller_error(function()
      ms.adamw_step { params = { p }, grads = { ms.ones({ 2 }) }, exp_avg = { m }, exp_avg_sq = { v }, steps = { 1 },
                      step = 2 }
    end, "adamw_step: steps and step are exclusive")
    local p8 = ms.zeros({ 256 })
    local c1, c2 = ms.zeros({ 256 }, { dtype = "u8" }), ms.zeros({ 256 }, { dtype = "u8" })
    local s1, s2 = ms.zeros({ 1 }), ms.zeros({ 1 })
    caller_error(function()
      ms.adamw8_step { params = { p8 }, grads = { ms.ones({ 256 }) }, exp_avg = { c1 }, exp_avg_sq = { c2 },
                       exp_avg_scale = { s1 }, exp_avg_sq_scale = { s2 }, steps = { 1 }, step = 1 }
    end, "adamw8_step: steps and step are exclusive")
    assert.same({ 1, 2 }, vals(p))
    assert.same({ 0, 0 }, vals(m))
    assert.same({ 0 }, vals(s1))
    -- either alone still steps
    ms.sgd_step { params = { p }, grads = { ms.ones({ 2 }) }, steps = { 1 }, lr = 0.5 }
    ms.sgd_step { params = { p }, grads = { ms.ones({ 2 }) }, step = 1, lr = 0.5 }
    assert.same({ 0, 1 }, vals(p))
  end)
end)

describe("lerp, addcdiv and addcmul on integer tensors", function()
  local function i32(v) return ms.tensor({ v }, { dtype = "i32" }) end

  it("give a float result where the values may be fractions, as division does", function()
    local r = ms.lerp(i32(0), i32(3), 0.5)
    assert.equals("f32", r:dtype())
    assert.same({ 1.5 }, vals(r))
    r = ms.lerp(ms.tensor({ 0 }, { dtype = "u8" }), ms.tensor({ 3 }, { dtype = "u8" }), 0.5)
    assert.equals("f32", r:dtype())
    assert.same({ 1.5 }, vals(r))
    r = ms.addcdiv(i32(0), i32(3), i32(2))
    assert.equals("f32", r:dtype())
    assert.same({ 1.5 }, vals(r))
    r = ms.addcmul(i32(0), i32(3), i32(1), 0.5)
    assert.equals("f32", r:dtype())
    assert.same({ 1.5 }, vals(r))
    -- a device scalar's value is not known here: a float result
    r = ms.lerp(i32(0), i32(3), ms.tensor({ 0.5 }))
    assert.equals("f32", r:dtype())
    assert.same({ 1.5 }, vals(r))
    r = ms.addcmul(i32(0), i32(3), i32(1), ms.tensor({ 0.5 }))
    assert.equals("f32", r:dtype())
    assert.same({ 1.5 }, vals(r))
  end)

  it("keep the integer dtype where the math is whole numbers (as mul), and in place", function()
    local r = ms.addcmul(i32(1), i32(3), i32(2))
    assert.equals("i32", r:dtype())
    assert.same({ 7 }, vals(r))
    r = ms.addcmul(i32(1), i32(3), i32(2), 2)
    assert.equals("i32", r:dtype())
    assert.same({ 13 }, vals(r))
    r = ms.lerp(i32(1), i32(3), 2)
    assert.equals("i32", r:dtype())
    assert.same({ 5 }, vals(r))
    local a = i32(0)
    a:lerp_(i32(4), 0.5)
    assert.equals("i32", a:dtype())
    assert.same({ 2 }, vals(a))
    -- float operands as before
    assert.equals("f64", ms.addcdiv(ms.tensor({ 1 }, { dtype = "f64" }), i32(1), i32(2)):dtype())
  end)
end)

describe("fused steps: a non-tensor member", function()
  it("is named with its array and index, raised at the caller, and nothing changes", function()
    local p = ms.tensor({ 1, 2, 3, 4 })
    local z = function() return ms.zeros({ 4 }) end
    local m, v = z(), z()
    caller_error(function()
      ms.adamw_step { params = { 1 }, grads = { ms.ones({ 4 }) }, exp_avg = { z() }, exp_avg_sq = { z() } }
    end, "adamw_step: params[1] must be a tensor (got 1)")
    caller_error(function()
      ms.adamw_step { params = { p }, grads = { "g" }, exp_avg = { m }, exp_avg_sq = { v } }
    end, 'adamw_step: grads[1] must be a tensor (got "g")')
    caller_error(function()
      ms.adamw_step { params = { p }, grads = { z() }, exp_avg = { m }, exp_avg_sq = { 5 } }
    end, "adamw_step: exp_avg_sq[1] must be a tensor (got 5)")
    caller_error(function() ms.sinkgd_step { params = { "w" }, grads = { ms.ones({ 2, 2 }) } } end,
      'sinkgd_step: params[1] must be a tensor (got "w")')
    caller_error(function()
      ms.sgd_step { params = { p }, grads = { ms.ones({ 4 }) }, momentum_buf = { true }, momentum = 0.9 }
    end, "sgd_step: momentum_buf[1] must be a tensor (got true)")
    caller_error(function()
      ms.sgd_step { params = { p }, grads = { ms.ones({ 4 }) }, steps = { 1 }, momentum_buf = { {} }, momentum = 0.9 }
    end, "sgd_step: momentum_buf[1] must be a tensor (got a table)")
    caller_error(function() ms.foreach_scale({ p, 3 }, 2) end, "foreach_scale: tensors[2] must be a tensor (got 3)")
    assert.same({ 1, 2, 3, 4 }, vals(p))
    assert.same({ 0, 0, 0, 0 }, vals(m))
  end)

  it("includes a hole, whatever # makes of it", function()
    local p, t = ms.tensor({ 1, 2, 3, 4 }), ms.ones({ 4 })
    local z = function() return ms.zeros({ 4 }) end
    local params = { p, nil, t }      -- # is 1 or 3
    caller_error(function()
      ms.adamw_step { params = params, grads = { z(), z(), z() }, exp_avg = { z(), z(), z() },
                      exp_avg_sq = { z(), z(), z() } }
    end, "adamw_step: params[2] must be a tensor (got nil)")
    local grads = { z() }
    grads[3] = z()                    -- # is 1 or 3
    caller_error(function() ms.sgd_step { params = { p }, grads = grads, lr = 1 } end,
      "sgd_step: grads[2] must be a tensor (got nil)")
    caller_error(function() ms.sgd_step { params = { p }, grads = grads, lr = 1, steps = { 1 } } end,
      "sgd_step: grads[2] must be a tensor (got nil)")
    local arr = { p }
    arr[3] = t
    caller_error(function() ms.foreach_scale(arr, 2) end, "foreach_scale: tensors[2] must be a tensor (got nil)")
    assert.same({ 1, 2, 3, 4 }, vals(p))
    assert.same({ 1, 1, 1, 1 }, vals(t))
  end)
end)

describe("ms.tensor's data", function()
  it("refuses holes and non-array keys (the data after them was dropped, silently), at the caller", function()
    caller_error(function() ms.tensor({ 1, nil, 3 }) end, "tensor data has a hole or a non-integer key at dim 0")
    caller_error(function() ms.tensor({ 1, 2, x = 3 }) end, "tensor data has a hole or a non-integer key at dim 0")
    caller_error(function() ms.tensor({ { 1, 2 }, { 3, 4, [4] = 5 } }) end,
      "tensor data has a hole or a non-integer key at dim 1")
    caller_error(function() ms.tensor({ [0] = 1, 2 }) end, "hole or a non-integer key at dim 0")
    caller_error(function() ms.tensor({ 1, 2, [2.5] = 3 }) end, "hole or a non-integer key at dim 0")
    -- the older refusals raise at the caller too
    caller_error(function() ms.tensor({ { 1, 2 }, { 3 } }) end, "tensor data is not rectangular (dim 1)")
    caller_error(function() ms.tensor({ 1, "2" }) end, 'tensor data must contain numbers (got "2")')
    caller_error(function() ms.tensor("1") end, "tensor: data must be a number or a nested table")
    -- plain arrays as before
    assert.same({ 2, 2 }, ms.tensor({ { 1, 2 }, { 3, 4 } }):shape())
    assert.same({ 0 }, ms.tensor({}):shape())
    assert.same({}, ms.tensor(3):shape())
  end)
end)

describe("DASH ids given as Lua arrays", function()
  it("must be integers in the i32 range (0.5 and NaN were taken as block 0), and nothing changes", function()
    local a = ms.eye(2):view(1, 2, 2):clone()
    local out = ms.zeros({ 1, 2, 2 })
    caller_error(function() ms.inv_root(a, { index = { 0.5 }, out = out }) end,
      "inv_root: index[1] must be an integer (got 0.5)")
    caller_error(function() ms.inv_root(a, { index = { 0 / 0 }, out = out }) end,
      "inv_root: index[1] must be an integer (got nan)")
    caller_error(function() ms.inv_root(a, { index = { "0" }, out = out }) end,
      'inv_root: index[1] must be an integer (got "0")')
    caller_error(function() ms.inv_root(a, { index = { 2 ^ 31 }, out = out }) end,
      "inv_root: index[1] must be an integer in the i32 range")
    caller_error(function() ms.inv_root(a, { rng_ids = { 1.7 }, out = out }) end,
      "inv_root: rng_ids[1] must be an integer (got 1.7)")
    local ids = { 0 }
    ids[3] = 0
    caller_error(function() ms.inv_root(a, { rng_ids = ids, out = out }) end,
      "inv_root: rng_ids[2] must be an integer (got nil)")
    assert.same({ 0, 0, 0, 0 }, vals(out))
    local lam = ms.zeros({ 1 })
    caller_error(function() ms.spectrum_estimate(a, { rng_ids = { 0.25 }, lam_max = lam }) end,
      "spectrum_estimate: rng_ids[1] must be an integer (got 0.25)")
    assert.same({ 0 }, vals(lam))
    local w = ms.ones({ 2, 2 })
    caller_error(function()
      ms.blocks_apply { blocks = { { tensor = w } }, stack = ms.ones({ 1, 2, 2 }), lr = 1, rng_ids = { -0.5 } }
    end, "blocks_apply: rng_ids[1] must be an integer (got -0.5)")
    assert.same({ 1, 1, 1, 1 }, vals(w))
    -- whole ids still run
    ms.inv_root(a, { index = { 0 }, rng_ids = { 7 }, out = out })
    assert.same({ 1, 0, 0, 1 }, vals(out))
  end)
end)

describe("small messages", function()
  it("eye checks n and m", function()
    H.expect_error(function() ms.eye() end, "eye: n must be an integer >= 0 (got nil)")
    H.expect_error(function() ms.eye(2.5) end, "eye: n must be an integer >= 0 (got 2.5)")
    H.expect_error(function() ms.eye(2, -1) end, "eye: m must be an integer >= 0 (got -1)")
    assert.same({ 2, 3 }, ms.eye(2, 3):shape())
    assert.same({ 2, 2 }, ms.eye(2, { dtype = "f64" }):shape())
  end)

  it("a non-tensor out of a binary op is named", function()
    H.expect_error(function() ms.add(ms.ones({ 2 }), ms.ones({ 2 }), 5) end, "add: out must be a tensor (got 5)")
    H.expect_error(function() ms.mul(ms.ones({ 2 }), 2, {}) end, "mul: out must be a tensor (got a table)")
    local out = ms.zeros({ 2 })
    ms.add(ms.ones({ 2 }), 1, out)
    assert.same({ 2, 2 }, vals(out))
  end)

  it("t[i] = v names a value that is neither a number nor a tensor, and changes nothing", function()
    local t = ms.ones({ 2, 2 })
    caller_error(function() t[0] = "x" end, 't[0] = v: v must be a number or a tensor (got "x")')
    caller_error(function() t[1] = {} end, "t[1] = v: v must be a number or a tensor (got a table)")
    assert.same({ 1, 1, 1, 1 }, vals(t))
    t[0] = 3
    t[1] = ms.tensor({ 4, 5 })
    assert.same({ 3, 3, 4, 5 }, vals(t))
  end)

  it("to() says a name is neither a dtype nor a device", function()
    H.expect_error(function() ms.ones({ 1 }):to("f33") end, 'to: "f33" is neither a dtype', "nor a device")
    assert.equals("f64", ms.ones({ 1 }):to("f64"):dtype())
    assert.equals("cpu", ms.ones({ 1 }):to("cpu"):device())
  end)
end)

describe("printing and reading large tensors", function()
  it("tostring reads only the elements it shows", function()
    local s = tostring(ms.zeros({ 1 }):expand(2 ^ 40))
    assert.equals("tensor([0, 0, 0, ..., 0, 0, 0], dtype=f32, device=cpu, shape=[1099511627776])", s)
    local big = ms.zeros({ 2 ^ 28 }, { dtype = "u8" })
    big:slice(0, 2 ^ 28 - 1):fill_(7)
    big:slice(0, 1, 2):fill_(1)
    assert.equals("tensor([0, 1, 0, ..., 0, 0, 7], dtype=u8, device=cpu, shape=[268435456])", tostring(big))
    big = nil
    collectgarbage()
    -- the edges of every dim, in their places
    local rows = {}
    for i = 1, 20 do
      rows[i] = {}
      for j = 1, 100 do rows[i][j] = i * 1000 + j end
    end
    local x = ms.tensor(rows, { dtype = "i32" })
    assert.equals(table.concat({
      "tensor([[ 1001,  1002,  1003, ...,  1098,  1099,  1100],",
      "        [ 2001,  2002,  2003, ...,  2098,  2099,  2100],",
      "        [ 3001,  3002,  3003, ...,  3098,  3099,  3100],",
      "        ...,",
      "        [18001, 18002, 18003, ..., 18098, 18099, 18100],",
      "        [19001, 19002, 19003, ..., 19098, 19099, 19100],",
      "        [20001, 20002, 20003, ..., 20098, 20099, 20100]], dtype=i32, device=cpu, shape=[20,100])" }, "\n"),
      tostring(x))
    -- a transposed (non-contiguous) view
    assert.truthy(tostring(x:t()):find("[ 1001,  2001,  3001, ...,", 1, true))
  end)

  it("tolist_flat refuses past 2^27 elements, naming the count", function()
    H.expect_error(function() ms.zeros({ 1 }):expand(2 ^ 40):tolist_flat() end,
      "tolist_flat: the tensor has 1099511627776 elements")
    assert.same({ 0, 0, 0 }, ms.zeros({ 1 }):expand(3):tolist_flat())
  end)
end)
