--[[
moonstep.json -- a small JSON encoder/decoder for metadata, options and settings (RFC 8259).
encode: tables with only 1..n integer keys become arrays, others objects (keys sorted, so output is
stable); numbers print round-trippably; NaN/Inf are refused.  decode: strict, with error positions.
]]
local M = {}

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n",
                  ["\r"] = "\\r", ["\t"] = "\\t" }

local function encode_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return escapes[c] or ("\\u%04x"):format(c:byte()) end) .. '"'
end

local function is_array(t)
  local n = 0
  for k in pairs(t) do
    if type(k) ~= "number" or k < 1 or k ~= math.floor(k) then return false end
    n = math.max(n, k)
  end
  return n == #t, n
end

local function encode(v, seen)
  local tv = type(v)
  if tv == "nil" then return "null"
  elseif tv == "boolean" then return tostring(v)
  elseif tv == "number" then
    if v ~= v or v == math.huge or v == -math.huge then error("json: cannot encode " .. tostring(v), 0) end
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%.0f"):format(v) end
    for _, f in ipairs { "%.15g", "%.16g" } do     -- the shortest form that reads back exactly
      local s = f:format(v)
      if tonumber(s) == v then return s end
    end
    return ("%.17g"):format(v)
  elseif tv == "string" then return encode_string(v)
  elseif tv == "table" then
    if v == M.empty_array then return "[]" end
    if seen[v] then error("json: cannot encode a table that contains itself", 0) end
    seen[v] = true
    local out = {}
    local arr = is_array(v)
    if arr and next(v) ~= nil then
      for i = 1, #v do out[i] = encode(v[i], seen) end
      seen[v] = nil
      return "[" .. table.concat(out, ",") .. "]"
    end
    local keys = {}
    for k in pairs(v) do
      if type(k) ~= "string" then error("json: object keys must be strings (got " .. type(k) .. ")", 0) end
      keys[#keys + 1] = k
    end
    table.sort(keys)
    for i, k in ipairs(keys) do out[i] = encode_string(k) .. ":" .. encode(v[k], seen) end
    seen[v] = nil
    return "{" .. table.concat(out, ",") .. "}"
  end
  error("json: cannot encode a " .. tv, 0)
end

function M.encode(v) return encode(v, {}) end

local function decode_error(s, i, what)
  error(("json: %s at byte %d"):format(what, i), 0)
end

local function skip(s, i)
  local _, e = s:find("^[ \t\r\n]*", i)
  return e + 1
end

local decode_value

local function utf8_char(cp)
  if cp < 0x80 then return string.char(cp)
  elseif cp < 0x800 then return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)
  elseif cp < 0x10000 then
    return string.char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return string.char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
                     0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

local function decode_string(s, i)
  local out, j = {}, i + 1
  while true do
    local c = s:sub(j, j)
    if c == "" then decode_error(s, j, "unterminated string") end
    if c == '"' then return table.concat(out), j + 1 end
    if c == "\\" then
      local e = s:sub(j + 1, j + 1)
      local simple = ({ ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" })[e]
      if simple then out[#out + 1] = simple j = j + 2
      elseif e == "u" then
        local hex = s:sub(j + 2, j + 5)
        if not hex:match("^%x%x%x%x$") then decode_error(s, j, "bad \\u escape") end
        local cp = tonumber(hex, 16)
        j = j + 6
        if cp >= 0xD800 and cp <= 0xDBFF then
          local lo = s:match("^\\u(%x%x%x%x)", j)
          local lov = lo and tonumber(lo, 16)
          if not lov or lov < 0xDC00 or lov > 0xDFFF then decode_error(s, j, "lone surrogate") end
          cp = 0x10000 + (cp - 0xD800) * 1024 + (lov - 0xDC00)
          j = j + 6
        elseif cp >= 0xDC00 and cp <= 0xDFFF then decode_error(s, j, "lone surrogate") end
        out[#out + 1] = utf8_char(cp)
      else decode_error(s, j, "bad escape") end
    elseif c:byte() < 32 then decode_error(s, j, "control character in string")
    else
      -- only bytes below 0x20 must be escaped in JSON: DEL (0x7f, which %c also matches) is plain text,
      -- and stopping on it here would never advance
      local k = s:find('[%z\1-\31"\\]', j) or #s + 1
      out[#out + 1] = s:sub(j, k - 1)
      j = k
    end
  end
end

function decode_value(s, i, depth)
  if depth > 64 then decode_error(s, i, "nesting too deep") end
  i = skip(s, i)
  local c = s:sub(i, i)
  if c == "{" then
    local obj = {}
    i = skip(s, i + 1)
    if s:sub(i, i) == "}" then return obj, i + 1 end
    while true do
      if s:sub(i, i) ~= '"' then decode_error(s, i, "expected a string key") end
      local k, at = nil, i
      k, i = decode_string(s, i)
      -- (as the engine's parser: the last of two values would win silently, e.g. a checkpoint's "step")
      if obj[k] ~= nil then decode_error(s, at, ("duplicate key %q"):format(k)) end
      i = skip(s, i)
      if s:sub(i, i) ~= ":" then decode_error(s, i, "expected ':'") end
      obj[k], i = decode_value(s, i + 1, depth + 1)
      i = skip(s, i)
      local d = s:sub(i, i)
      if d == "}" then return obj, i + 1 end
      if d ~= "," then decode_error(s, i, "expected ',' or '}'") end
      i = skip(s, i + 1)
    end
  elseif c == "[" then
    local arr = {}
    i = skip(s, i + 1)
    if s:sub(i, i) == "]" then return arr, i + 1 end
    while true do
      arr[#arr + 1], i = decode_value(s, i, depth + 1)
      i = skip(s, i)
      local d = s:sub(i, i)
      if d == "]" then return arr, i + 1 end
      if d ~= "," then decode_error(s, i, "expected ',' or ']'") end
      i = i + 1
    end
  elseif c == '"' then return decode_string(s, i)
  elseif s:find("^true", i) then return true, i + 4
  elseif s:find("^false", i) then return false, i + 5
  elseif s:find("^null", i) then return M.null, i + 4
  else
    local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", i)
    if not num or not num:match("^-?0$") and not num:match("^-?[1-9]") and not num:match("^-?0[.eE]") then
      decode_error(s, i, "unexpected character")
    end
    -- (a fraction needs a digit after its point, exponent or not: "1.e5" is not JSON)
    if not num:match("^-?%d+$") and not num:match("^-?%d+%.%d+$") and not num:match("^-?%d+[eE][-+]?%d+$")
       and not num:match("^-?%d+%.%d+[eE][-+]?%d+$") then
      decode_error(s, i, "malformed number")
    end
    local x = tonumber(num)
    -- "1e999" reads as an infinity, which JSON cannot hold (the engine's parser refuses it too)
    if x == math.huge or x == -math.huge then decode_error(s, i, "number out of the range of a double") end
    return x, i + #num
  end
end

--- A sentinel for an empty JSON array: an empty Lua table encodes as {}, which for a 0-dim tensor's shape or a
--- list with nothing in it is the wrong type in other languages.  Read-only, like json.null.
M.empty_array = setmetatable({}, {
  __tostring = function() return "[]" end,
  __newindex = function() error("json.empty_array is read-only", 2) end,
  __metatable = false,
})

--- A sentinel for JSON null inside arrays and objects.
-- Read-only and with its metatable hidden: the sentinel is shared by every caller, sandboxed recipes included.
M.null = setmetatable({}, {
  __tostring = function() return "null" end,
  __newindex = function() error("json.null is read-only", 2) end,
  __metatable = false,
})

function M.decode(s)
  if type(s) ~= "string" then error("json: expected a string", 2) end
  local v, i = decode_value(s, 1, 0)
  i = skip(s, i)
  if i <= #s then decode_error(s, i, "trailing characters") end
  return v
end

return M
