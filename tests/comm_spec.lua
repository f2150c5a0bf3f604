-- Communicators: the TCP rendezvous that hands NCCL's id from rank 0 to the other ranks (real processes
-- started by `moonstep launch`, on the CPU: equal ids, a rank that never arrives, a wrong world size,
-- connections that speak something else, bad options), the launcher itself (environment, exit status,
-- stopping the other ranks), argument checks, groups, a CPU world of one, and -- tagged #multigpu, run
-- where two CUDA devices are usable -- the four collectives between 2 ranks in every dtype against the
-- same computation on the CPU.  The CPU communicator between ranks: tests/comm_cpu_spec.lua.
local ffi = require("ffi")
local core = require("moonstep.core")
local C = core.C
local ms = H.ms

local q = H.q
local launch, write_script = H.moonstep, H.temp_file

-- a wall clock for the timeout checks (the one moonstep.experiment declares, not a second declaration)
H.now_s = require("moonstep.experiment").clock

-- What every rank script starts with: status-level access to ms_rendezvous, raw sockets for the
-- impostors, a clock, and a deterministic id for rank 0 (the same bytes the spec expects).
local prelude = [[
local ffi = require("ffi")
local C = require("moonstep.core").C
for _, d in ipairs {
  "int connect(int fd, const void *addr, uint32_t len);", "long write(int fd, const void *buf, size_t n);",
  "int listen(int fd, int backlog);", "int accept(int fd, void *addr, void *len);",
  "int setsockopt(int fd, int level, int name, const void *val, uint32_t len);",
  "int poll(void *fds, unsigned long n, int timeout);",
} do pcall(ffi.cdef, d) end
local RANK, WORLD = tonumber(os.getenv("RANK")), tonumber(os.getenv("WORLD_SIZE"))
local PORT = tonumber(os.getenv("MASTER_PORT"))
local clock = require("moonstep.experiment").clock
local function now_ms() return clock() * 1000 end
local function seeded_id(seed)
  local b, x = {}, seed
  for i = 1, 128 do x = (x * 1103515245 + 12345) % 2147483648 b[i] = string.char(x % 251 + 1) end
  return table.concat(b)
end
local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end
-- ms_rendezvous as the C caller sees it: status name, message, id, elapsed ms
local function rendezvous(rank, world, timeout_ms, id)
  local buf = ffi.new("unsigned char[128]")
  if id then ffi.copy(buf, id, 128) end
  local t0 = now_ms()
  local st = C.ms_rendezvous(nil, 0, rank, world, timeout_ms, buf)     -- MASTER_ADDR / MASTER_PORT
  return ffi.string(C.ms_status_name(st)), ffi.string(C.ms_last_error()), ffi.string(buf, 128), now_ms() - t0
end
local function report(st, msg, elapsed)
  io.stdout:write(("status %d %s %d %s\n"):format(RANK, st, math.floor(elapsed), msg))
  io.stdout:flush()
end
-- a raw TCP socket to 127.0.0.1:port, or one listening there
local function raw_socket(port, listen)
  local fd = ffi.C.socket(2, 1, 0)
  local a = ffi.new("struct ms_sockaddr_in4")
  a.family = 2
  ffi.copy(ffi.cast("uint8_t *", a) + 2, string.char(math.floor(port / 256), port % 256, 127, 0, 0, 1), 6)
  if listen then
    ffi.C.setsockopt(fd, 1, 2, ffi.new("int[1]", 1), 4)              -- SO_REUSEADDR
    assert(ffi.C.bind(fd, a, 16) == 0 and ffi.C.listen(fd, 8) == 0, "bind/listen failed")
    return fd
  end
  local deadline = now_ms() + 5000
  while ffi.C.connect(fd, a, 16) ~= 0 do
    assert(now_ms() < deadline, "cannot connect")
    ffi.C.close(fd)
    fd = ffi.C.socket(2, 1, 0)
    ffi.C.poll(nil, 0, 20)
  end
  return fd
end
]]
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")

local SEED = 4242
local function expected_id_hex()
  local b, x = {}, SEED
  for i = 1, 128 do x = (x * 1103515245 + 12345) % 2147483648 b[i] = ("%02x"):format(x % 251 + 1) end
  return table.concat(b)
end

local function status_lines(out)
  local res = {}
  for rank, st, ms_, msg in out:gmatch("status (%d+) (%S+) (%d+) ([^\n]*)") do
    res[tonumber(rank)] = { status = st, ms = tonumber(ms_), msg = msg }
  end
  return res
end

describe("the rendezvous between processes started by `moonstep launch` (CPU)", function()
  it("gives every rank rank 0's id, with the launcher's environment", function()
    local s = write_script("ids.lua", prelude .. [[
local id = RANK == 0 and seeded_id(tonumber(arg[1])) or nil
local st, msg, got = rendezvous(RANK, WORLD, 5000, id)
assert(st == "MS_OK", msg)
print(("id %d %s"):format(RANK, hex(got)))
print(("env %d %s %s %s %s %s %s"):format(RANK, os.getenv("WORLD_SIZE"), os.getenv("LOCAL_RANK"),
  os.getenv("MASTER_ADDR"), os.getenv("NCCL_NVLS_ENABLE"), tostring(os.getenv("CUDA_VISIBLE_DEVICES")),
  os.getenv("LOCAL_WORLD_SIZE")))
]])
    local out, code = launch(("launch -n 3 %s %d"):format(q(s), SEED), "CUDA_VISIBLE_DEVICES=7 RANK=9")
    assert.are.equal(0, code, out)
    local want = expected_id_hex()
    for r = 0, 2 do
      assert.is_truthy(out:find(("id %d %s"):format(r, want), 1, true), "rank " .. r .. ": " .. out)
      assert.is_truthy(out:find(("env %d 3 %d 127.0.0.1 0 nil 3"):format(r, r), 1, true), out)
    end
    -- the id is not the zeros of an untouched buffer
    assert.is_not.equal(("00"):rep(128), want)
  end)

  it("fails on every rank, naming the missing one, soon after the timeout when a rank never arrives", function()
    -- two processes of a world of 3: rank 2 never comes
    local s = write_script("missing.lua", prelude .. [[
-- rank 1 would wait longer: it hears about the timeout from rank 0
local st, msg, _, elapsed = rendezvous(RANK, 3, RANK == 0 and 800 or 4000, RANK == 0 and seeded_id(1) or nil)
report(st, msg, elapsed)
]])
    local out, code, wall = launch(("launch -n 2 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("MS_E_IO", res[0].status, out)
    assert.is_truthy(res[0].msg:find("waiting for ranks 2 of world size 3 (2 of 3 arrived)", 1, true), out)
    assert.is_truthy(res[0].msg:find("timed out after 800 ms", 1, true), out)
    assert.is_true(res[0].ms >= 790 and res[0].ms < 2000, "rank 0 gave up after " .. res[0].ms .. " ms")
    -- the rank that did arrive learns why from rank 0 instead of going on to NCCL
    assert.are.equal("MS_E_IO", res[1].status, out)
    assert.is_truthy(res[1].msg:find("missing ranks: 2", 1, true), out)
    assert.is_true(res[1].ms < 2500, "rank 1 gave up after " .. res[1].ms .. " ms")
    assert.is_true(wall < 6, "the whole launch took " .. wall .. " s")
  end)

  it("refuses a rank that reports another world size, on both sides, without waiting for the timeout", function()
    local s = write_script("world.lua", prelude .. [[
local st, msg, _, elapsed = rendezvous(RANK, RANK == 1 and 3 or 2, 10000, RANK == 0 and seeded_id(2) or nil)
report(st, msg, elapsed)
]])
    local out, code = launch(("launch -n 2 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("MS_E_ARG", res[0].status, out)
    assert.is_truthy(res[0].msg:find("rank 1 reports world size 3, rank 0 has 2", 1, true), out)
    assert.are.equal("MS_E_ARG", res[1].status, out)
    assert.is_truthy(res[1].msg:find("rank 0 refused the rendezvous: rank 1 reports world size 3", 1, true), out)
    assert.is_true(res[0].ms < 5000 and res[1].ms < 5000, out)
  end)

  it("counts a rank that gave up after its hello as missing: every rank fails, none goes on without it", function()
    -- rank 1's timeout is short: it leaves before rank 2 (late) arrives; rank 0 must not answer ranks 0 and 2
    -- as a complete world
    local s = write_script("left.lua", prelude .. [[
if RANK == 2 then ffi.C.poll(nil, 0, 1000) end
local timeout = ({ [0] = 2500, 500, 2500 })[RANK]
local st, msg, _, elapsed = rendezvous(RANK, 3, timeout, RANK == 0 and seeded_id(5) or nil)
report(st, msg, elapsed)
]])
    local out, code = launch(("launch -n 3 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    for r = 0, 2 do assert.are.equal("MS_E_IO", res[r].status, out) end
    assert.is_truthy(res[0].msg:find("waiting for ranks 1 of world size 3", 1, true), out)
    assert.is_truthy(res[2].msg:find("missing ranks: 1", 1, true), out)
  end)

  it("takes a rank back that gave up after its hello and tries again", function()
    local s = write_script("again.lua", prelude .. [[
local st, msg, got
if RANK == 1 then
  st, msg = rendezvous(1, 3, 300)                     -- gives up: rank 2 is late
  assert(st == "MS_E_IO", msg)
  st, msg, got = rendezvous(1, 3, 5000)
else
  if RANK == 2 then ffi.C.poll(nil, 0, 800) end
  st, msg, got = rendezvous(RANK, 3, 5000, RANK == 0 and seeded_id(tonumber(arg[1])) or nil)
end
report(st, msg, 0)
print(("id %d %s"):format(RANK, hex(got)))
]])
    local out, code = launch(("launch -n 3 %s %d"):format(q(s), SEED))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    for r = 0, 2 do
      assert.are.equal("MS_OK", res[r].status, out)
      assert.is_truthy(out:find(("id %d %s"):format(r, expected_id_hex()), 1, true), out)
    end
  end)

  it("drops connections that send garbage or nothing, and still completes", function()
    local s = write_script("garbage_client.lua", prelude .. [[
if RANK == 1 then
  local junk = raw_socket(PORT)                       -- 16 bytes that are no hello
  ffi.C.write(junk, "GET / HTTP/1.0\r\n", 16)
  local silent = raw_socket(PORT)                     -- connects and says nothing, held open
  local half = raw_socket(PORT)                       -- a hello cut short, then closed
  ffi.C.write(half, "MSRZ\0\0", 6)
  ffi.C.close(half)
  local st, msg, got = rendezvous(1, 2, 5000)
  ffi.C.close(junk) ffi.C.close(silent)
  report(st, msg, 0)
  print("id " .. hex(got))
else
  local st, msg = rendezvous(0, 2, 5000, seeded_id(tonumber(arg[1])))
  report(st, msg, 0)
end
]])
    local out, code = launch(("launch -n 2 %s %d"):format(q(s), SEED))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("MS_OK", res[0].status, out)
    assert.are.equal("MS_OK", res[1].status, out)
    assert.is_truthy(out:find("id " .. expected_id_hex(), 1, true), out)
  end)

  it("still takes a rank when more connections than it holds (64) hang on a partial hello", function()
    local s = write_script("strays.lua", prelude .. [[
if RANK == 1 then
  local held = {}
  for i = 1, 64 do
    held[i] = raw_socket(PORT)
    ffi.C.write(held[i], "MS", 2)
  end
  local st, msg = rendezvous(1, 2, 3000)
  for _, fd in ipairs(held) do ffi.C.close(fd) end
  report(st, msg, 0)
else
  local st, msg = rendezvous(0, 2, 3000, seeded_id(4))
  report(st, msg, 0)
end
]])
    local out, code = launch(("launch -n 2 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("MS_OK", res[0].status, out)
    assert.are.equal("MS_OK", res[1].status, out)
  end)

  it("mentions dropped connections when the timeout comes", function()
    local s = write_script("garbage_timeout.lua", prelude .. [[
if RANK == 1 then
  local junk = raw_socket(PORT)
  ffi.C.write(junk, ("\255"):rep(16), 16)
  ffi.C.poll(nil, 0, 900)
else
  local st, msg, _, elapsed = rendezvous(0, 2, 600, seeded_id(3))
  report(st, msg, elapsed)
end
]])
    local out, code = launch(("launch -n 2 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("MS_E_IO", res[0].status, out)
    assert.is_truthy(res[0].msg:find("waiting for ranks 1 of world size 2", 1, true), out)
    assert.is_truthy(res[0].msg:find("connections that were no moonstep ranks were dropped", 1, true), out)
  end)

  it("reports a peer that is no moonstep rendezvous as MS_E_FORMAT, without waiting for the timeout", function()
    local s = write_script("garbage_server.lua", prelude .. [[
if RANK == 0 then
  local fd = raw_socket(PORT, true)
  local c = ffi.C.accept(fd, nil, nil)
  ffi.C.write(c, ("HTTP/1.1 400 Bad Request\r\n"):rep(6), 144)
  ffi.C.poll(nil, 0, 3000)                            -- keep the connection open: the client must not wait
  ffi.C.close(c) ffi.C.close(fd)
else
  local st, msg, _, elapsed = rendezvous(1, 2, 20000)
  report(st, msg, elapsed)
  os.exit(0)
end
]])
    local out, code = launch(("launch -n 2 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    local res = status_lines(out)
    assert.are.equal("MS_E_FORMAT", res[1].status, out)
    assert.is_truthy(res[1].msg:find("is not a moonstep rendezvous (it sent 48 54 54 50", 1, true), out)
    assert.is_true(res[1].ms < 2500, "rank 1 waited " .. res[1].ms .. " ms")
  end)
end)

describe("ms_rendezvous arguments", function()
  local id = ffi.new("unsigned char[128]")
  local function call(addr, port, rank, world, timeout)
    local st = C.ms_rendezvous(addr, port, rank, world, timeout, id)
    return ffi.string(C.ms_status_name(st)), ffi.string(C.ms_last_error())
  end
  pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")

  it("refuses ranks, world sizes, ports and timeouts out of range, naming them", function()
    local st, msg = call("127.0.0.1", 5000, 2, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("rank 2 is outside [0, 2)", 1, true), msg)
    st, msg = call("127.0.0.1", 5000, -1, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("rank -1 is outside [0, 2)", 1, true), msg)
    st, msg = call("127.0.0.1", 5000, 0, 0, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("world_size 0 is below 1", 1, true), msg)
    st, msg = call("127.0.0.1", 5000, 0, 2 ^ 30, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("world_size 1073741824 is above 1048576", 1, true), msg)
    st, msg = call("127.0.0.1", 70000, 0, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("port 70000 is outside [1, 65535]", 1, true), msg)
    st, msg = call("127.0.0.1", 5000, 1, 2, -5)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("timeout_ms -5 is negative", 1, true), msg)
    st, msg = call("127.0.0.1", 5000, 0, 2, 100)
    st = C.ms_rendezvous("127.0.0.1", 5000, 0, 2, 100, nil)
    assert.are.equal(C.MS_E_ARG, st)
  end)

  it("reads MASTER_ADDR and MASTER_PORT when none is given, and says which is missing or malformed", function()
    local old_addr, old_port = os.getenv("MASTER_ADDR"), os.getenv("MASTER_PORT")
    ffi.C.unsetenv("MASTER_ADDR")
    local st, msg = call(nil, 0, 1, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("no rendezvous address (pass one, or set MASTER_ADDR)", 1, true), msg)
    ffi.C.setenv("MASTER_ADDR", "127.0.0.1", 1)
    ffi.C.setenv("MASTER_PORT", "80a", 1)
    st, msg = call(nil, 0, 1, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("MASTER_PORT='80a' is not a port in [1, 65535]", 1, true), msg)
    ffi.C.unsetenv("MASTER_PORT")
    st, msg = call(nil, 0, 1, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("no rendezvous port", 1, true), msg)
    if old_addr then ffi.C.setenv("MASTER_ADDR", old_addr, 1) else ffi.C.unsetenv("MASTER_ADDR") end
    if old_port then ffi.C.setenv("MASTER_PORT", old_port, 1) end
  end)

  it("returns at once for a world of one, and refuses an address that does not resolve", function()
    assert.are.equal("MS_OK", (call(nil, 0, 0, 1, 100)))
    local st, msg = call("no-such-host.invalid", 5000, 1, 2, 100)
    assert.are.equal("MS_E_ARG", st)
    assert.is_truthy(msg:find("cannot resolve the rendezvous address 'no-such-host.invalid'", 1, true), msg)
  end)

  it("fails with MS_E_IO when rank 0 cannot listen (port taken) or nobody listens for a rank", function()
    pcall(ffi.cdef, "int listen(int fd, int backlog);")
    local port = ms.comm.free_port()
    local fd = ffi.C.socket(2, 1, 0)
    local a = ffi.new("struct ms_sockaddr_in4")
    a.family = 2
    ffi.copy(ffi.cast("uint8_t *", a) + 2, string.char(math.floor(port / 256), port % 256, 127, 0, 0, 1), 6)
    assert(ffi.C.bind(fd, a, 16) == 0 and ffi.C.listen(fd, 1) == 0)
    local st, msg = call("127.0.0.1", port, 0, 2, 100)
    ffi.C.close(fd)
    assert.are.equal("MS_E_IO", st)
    assert.is_truthy(msg:find(("rank 0 cannot listen on 127.0.0.1:%d"):format(port), 1, true), msg)
    local t0 = H.now_s()
    st, msg = call("127.0.0.1", ms.comm.free_port(), 1, 2, 300)
    local took = H.now_s() - t0
    assert.are.equal("MS_E_IO", st)
    assert.is_truthy(msg:find("rank 1 could not reach rank 0 at 127.0.0.1:", 1, true), msg)
    assert.is_truthy(msg:find("within 300 ms", 1, true), msg)
    assert.is_true(took >= 0.29 and took < 1.5, "gave up after " .. took .. " s")
  end)

  it("checks the Lua arguments", function()
    H.expect_error(function() ms.comm.rendezvous { rank = 0, world_size = 2, id = "short", port = 5000 } end,
      "id must be a string of 128 bytes", "got 5 bytes")
    H.expect_error(function() ms.comm.rendezvous { rank = 0.5, world_size = 2 } end, "rank must be an integer")
    H.expect_error(function() ms.comm.rendezvous { rank = 1, world_size = 2, port = 5000, timeout = -1 } end,
      "timeout must be a positive number of seconds")
  end)
end)

describe("`moonstep launch`", function()
  it("returns the first failing rank's status and stops the others", function()
    local s = write_script("fail.lua", [[
if os.getenv("RANK") == "1" then os.exit(3) end
local t0 = os.time()
while os.time() - t0 < 30 do end                      -- would run 30 s unless stopped
]])
    local out, code, wall = launch(("launch -n 3 %s"):format(q(s)))
    assert.are.equal(3, code, out)
    assert.is_truthy(out:find("rank 1 exited with status 3; stopping the other ranks", 1, true), out)
    assert.is_true(wall < 10, "launch took " .. wall .. " s")
  end)

  it("ties its ranks to itself: a launcher killed from outside takes its ranks with it", function()
    -- SIGKILL to the launcher alone (not its process group) left the ranks running until their own timeouts
    local d = H.tmpdir()
    local s = write_script("orphan.lua", [[
local ffi = require("ffi")
pcall(ffi.cdef, "int getpid(void);")
local f = assert(io.open(os.getenv("MS_PIDDIR") .. "/" .. os.getenv("RANK"), "w"))
f:write(tostring(ffi.C.getpid()))
f:close()
local t0 = os.time()
while os.time() - t0 < 30 do end                      -- would run 30 s unless stopped
]])
    local out = H.shell(([=[
cd %s
MS_PIDDIR=%s %s launch -n 2 %s >/dev/null 2>&1 &
L=$!
i=0; while [ $i -lt 200 ] && ! { [ -s %s/0 ] && [ -s %s/1 ]; }; do sleep 0.05; i=$((i+1)); done
kill -9 $L
wait $L 2>/dev/null
sleep 1
# (a rank that ended but that nobody reaped, in a container whose init does not, is a zombie: not alive)
alive=0; for r in 0 1; do p=$(cat %s/$r 2>/dev/null); [ -n "$p" ] && grep -q '^State:[[:space:]]*[^Z[:space:]]' /proc/$p/status 2>/dev/null && alive=$((alive+1)); done
for r in 0 1; do p=$(cat %s/$r 2>/dev/null); [ -n "$p" ] && kill -9 "$p" 2>/dev/null; done
echo "ranks started: $(ls %s | wc -l), alive after the launcher died: $alive"
]=]):format(H.q(H.root), H.q(d), H.q(H.host), H.q(s), H.q(d), H.q(d), H.q(d), H.q(d), H.q(d)))
    os.execute("rm -rf " .. H.q(d))
    assert.is_truthy(out:find("ranks started: 2, alive after the launcher died: 0", 1, true), out)
    -- a rank whose launcher is gone before it starts ends at once; its own children are not tied to anyone
    local o2, c2 = H.moonstep(("run %s"):format(q(write_script("gone.lua", "print('ran')"))), "MOONSTEP_LAUNCHER_PID=1")
    assert.are.equal(143, c2, o2)
    assert.is_truthy(o2:find("the launcher that started this rank is gone", 1, true), o2)
  end)

  it("passes the script's arguments and refuses bad usage", function()
    local s = write_script("args.lua", 'print("args " .. os.getenv("RANK") .. " " .. table.concat(arg, ","))')
    local out, code = launch(("launch --nproc=2 %s a b"):format(q(s)))
    assert.are.equal(0, code, out)
    assert.is_truthy(out:find("args 0 a,b", 1, true) and out:find("args 1 a,b", 1, true), out)
    out, code = launch(("launch %s"):format(q(s)))
    assert.are.equal(2, code, out)
    assert.is_truthy(out:find("launch needs the number of ranks", 1, true), out)
    out, code = launch("launch -n 0 x.lua")
    assert.are.equal(2, code, out)
    assert.is_truthy(out:find("-n 0: the number of ranks must be in [1, 1024]", 1, true), out)
    out, code = launch("launch -n 2 /no/such/script.lua")
    assert.are.equal(2, code, out)
    assert.is_truthy(out:find("cannot read the script '/no/such/script.lua'", 1, true), out)
    out, code = launch(("launch -n 2 --port 0 %s"):format(q(s)))
    assert.are.equal(2, code, out)
    assert.is_truthy(out:find("--port 0 is outside [1, 65535]", 1, true), out)
  end)
end)

describe("communicators", function()
  local with_nccl = pcall(ms.comm.unique_id)
  local tctx = require("moonstep.tensor").handle_ctx

  it("give NCCL's 128-byte ids where NCCL is built in, and refuse ids without it", function()
    if with_nccl then
      local a, b = ms.comm.unique_id(), ms.comm.unique_id()
      assert.are.equal(128, #a)
      assert.are_not.equal(a, b)
    else
      H.expect_error(ms.comm.unique_id, "built without NCCL")
    end
  end)

  it("work on a CPU context as a world of one (no rendezvous), and refuse NCCL's id there", function()
    -- (the CPU communicator between ranks: tests/comm_cpu_spec.lua)
    local cpu = ms.device("cpu")
    local comm = ms.comm.new { ctx = cpu }
    assert.are.equal(0, comm:rank())
    assert.are.equal(1, comm:size())
    assert.are.equal(cpu, comm:context())
    local x = ms.randn({ 5, 3 }, { ctx = cpu })
    local y = ms.empty({ 5, 3 }, { ctx = cpu })
    comm:all_reduce(y, x, "avg")
    H.assert_close(y:tolist_flat(), x:tolist_flat(), 0, 0, "one rank's average")
    comm:free()
    local p = ffi.new("ms_comm *[1]")
    local o = ffi.new("ms_comm_options", { rank = 0, world_size = 1, unique_id = ffi.new("unsigned char[128]") })
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new(tctx(cpu), o, p))
    local msg = ffi.string(C.ms_last_error())
    assert.is_truthy(msg:find("unique_id is NCCL's, and a cpu communicator connects its ranks through the TCP "
      .. "rendezvous", 1, true), msg)
    H.expect_error(function() ms.comm.new { ctx = cpu, id = ("x"):rep(128) } end, "pass unique_id NULL")
    assert.are.equal(-1, C.ms_comm_rank(nil))
    assert.are.equal(-1, C.ms_comm_size(nil))
    C.ms_comm_free(nil)
  end)

  it("check options and the launcher's environment before anything else", function()
    local cpu = tctx(ms.device("cpu"))
    local p = ffi.new("ms_comm *[1]")
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new(nil, nil, p))
    assert.is_truthy(ffi.string(C.ms_last_error()):find("ctx is NULL", 1, true))
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new(cpu, nil, nil))
    assert.is_truthy(ffi.string(C.ms_last_error()):find("out is NULL", 1, true))
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new_from_env(nil, 0, p))
    assert.are.equal(C.MS_E_ARG, C.ms_comm_all_reduce(nil, nil, nil, C.MS_COMM_SUM))
    assert.is_truthy(ffi.string(C.ms_last_error()):find("ms_comm_all_reduce: comm is NULL", 1, true))
    assert.are.equal(C.MS_E_ARG, C.ms_comm_broadcast(nil, nil, 0))
    assert.are.equal(C.MS_E_ARG, C.ms_comm_group_begin(nil))
    assert.are.equal(C.MS_E_ARG, C.ms_comm_group_end(nil))
    local function refused(o, want)
      local st = C.ms_comm_new(cpu, ffi.new("ms_comm_options", o), p)
      assert.are.equal(C.MS_E_ARG, st)
      local msg = ffi.string(C.ms_last_error())
      assert.is_truthy(msg:find(want, 1, true), msg)
    end
    refused({ rank = 0, world_size = 0 }, "world_size 0 is below 1")
    refused({ rank = 2, world_size = 2 }, "rank 2 is outside [0, 2) (world_size 2)")
    refused({ rank = 0, world_size = 2, timeout_ms = -1 }, "timeout_ms -1 is negative")
    refused({ rank = 0, world_size = 2, port = 70000 }, "port 70000 is outside [1, 65535]")
    -- the environment a launcher sets, named when missing or malformed (busted runs outside a launcher)
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local saved = { RANK = os.getenv("RANK"), WORLD_SIZE = os.getenv("WORLD_SIZE") }
    ffi.C.unsetenv("RANK")
    H.expect_error(function() ms.comm.from_env { ctx = ms.device("cpu") } end, "RANK is not set")
    ffi.C.setenv("RANK", "one", 1)
    H.expect_error(function() ms.comm.from_env { ctx = ms.device("cpu") } end, "RANK='one' is not an integer >= 0")
    ffi.C.setenv("RANK", "0", 1)
    ffi.C.unsetenv("WORLD_SIZE")
    H.expect_error(function() ms.comm.from_env { ctx = ms.device("cpu") } end, "WORLD_SIZE is not set")
    for k, v in pairs(saved) do
      if v then ffi.C.setenv(k, v, 1) else ffi.C.unsetenv(k) end
    end
    H.expect_error(function() ms.comm.new { ctx = {} } end, "ctx must be a moonstep context")
  end)

  it("leave *out NULL when they fail, as every constructor does", function()
    -- a C host that frees what a failed call handed back (ms_comm_free(NULL) is fine) freed a stale pointer
    local cpu = tctx(ms.device("cpu"))
    local p = ffi.new("ms_comm *[1]")
    local stale = ffi.cast("ms_comm *", 8)
    p[0] = stale
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new(nil, nil, p))
    assert.is_true(p[0] == nil)
    p[0] = stale
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new(cpu, ffi.new("ms_comm_options", { rank = 2, world_size = 2 }), p))
    assert.is_true(p[0] == nil)
    p[0] = stale
    assert.are.equal(C.MS_E_ARG, C.ms_comm_new_from_env(nil, 0, p))
    assert.is_true(p[0] == nil)
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local saved = os.getenv("RANK")
    ffi.C.setenv("RANK", "one", 1)
    p[0] = stale
    local st = C.ms_comm_new_from_env(cpu, 100, p)
    if saved then ffi.C.setenv("RANK", saved, 1) else ffi.C.unsetenv("RANK") end
    assert.are.equal(C.MS_E_ARG, st)
    assert.is_true(p[0] == nil)
  end)

  it("name the call that failed, not the rendezvous or ms_comm_new behind it", function()
    -- moonstep.h: a failing call's message names the function (before any network: no address to meet at)
    local cpu = tctx(ms.device("cpu"))
    local p = ffi.new("ms_comm *[1]")
    pcall(ffi.cdef, "int setenv(const char *k, const char *v, int overwrite); int unsetenv(const char *k);")
    local saved = { RANK = os.getenv("RANK"), WORLD_SIZE = os.getenv("WORLD_SIZE"),
                    MASTER_ADDR = os.getenv("MASTER_ADDR"), MASTER_PORT = os.getenv("MASTER_PORT") }
    ffi.C.unsetenv("MASTER_ADDR")
    ffi.C.unsetenv("MASTER_PORT")
    local function starts(want_st, prefix, needle, st)
      local msg = ffi.string(C.ms_last_error())
      assert.are.equal(want_st, st)
      assert.are.equal(prefix, msg:sub(1, #prefix), msg)
      assert.is_truthy(msg:find(needle, 1, true), msg)
    end
    local ok, err = pcall(function()
      starts(C.MS_E_ARG, "ms_comm_new: ", "no rendezvous address",
        C.ms_comm_new(cpu, ffi.new("ms_comm_options", { rank = 1, world_size = 2, timeout_ms = 100 }), p))
      ffi.C.setenv("RANK", "1", 1)
      ffi.C.setenv("WORLD_SIZE", "2", 1)
      starts(C.MS_E_ARG, "ms_comm_new_from_env: ", "no rendezvous address", C.ms_comm_new_from_env(cpu, 100, p))
      ffi.C.setenv("RANK", "0", 1)
      ffi.C.setenv("WORLD_SIZE", "2000000", 1)
      starts(C.MS_E_ARG, "ms_comm_new_from_env: ", "world_size 2000000 is above", C.ms_comm_new_from_env(cpu, 100, p))
    end)
    for k, v in pairs(saved) do   -- restored whatever happened
      if v then ffi.C.setenv(k, v, 1) else ffi.C.unsetenv(k) end
    end
    if not ok then error(err, 0) end
  end)

  it("refuse an end of group without a begin, and nest groups", function()
    local comm = ms.comm.new { ctx = ms.device("cpu") }
    H.expect_error(function() comm:group_end() end, "no group is open on this communicator")
    comm:group_begin()
    comm:group_begin()
    comm:group_end()
    comm:group_end()
    H.expect_error(function() comm:group_end() end, "no group is open")
    -- comm:group ends its group when the function fails, and raises the function's error
    H.expect_error(function() comm:group(function() error("inside the group") end) end, "inside the group")
    H.expect_error(function() comm:group_end() end, "no group is open")
    local a, b = comm:group(function(x) return x, x + 1 end, 41)
    assert.are.equal(41, a)
    assert.are.equal(42, b)
    H.expect_error(function() comm:group(42) end, "group takes a function (got number)")
    comm:group_begin()
    comm:free()                                       -- ends the open group
  end)
end)

-- ---------------------------------------------------------------------------------------------------
-- #multigpu: 2 ranks, one GPU each, through `moonstep launch -n 2`
-- ---------------------------------------------------------------------------------------------------
local collectives = [[
local H = dofile("tests/helpers.lua")
local comm = ms.comm.from_env { timeout = 60 }
local rank, world = comm:rank(), comm:size()
assert(world == 2 and rank == tonumber(os.getenv("RANK")))
local ctx = comm:context()
assert(ctx:name() == "cuda:" .. os.getenv("LOCAL_RANK"), ctx:name())
local cpu = ms.device("cpu")

-- rank r's input for a dtype: seeded values every rank can recompute (the CPU reference needs all of them)
local function values(dt, r, n, salt)
  math.randomseed(1000 * r + salt)
  local v = {}
  for i = 1, n do
    if dt == "i32" then v[i] = math.random(-1000, 1000)
    elseif dt == "u8" then v[i] = math.random(1, 120)                  -- sums stay below 256
    else v[i] = (math.random() * 2 - 1) * 4 end
  end
  return ms.tensor(v, { dtype = dt, ctx = cpu })                    -- rounded to dt once, here
end
local function on_gpu(t) return t:to(ctx) end
local function flat(t) return t:cpu():to("f64"):tolist_flat() end

-- the CPU reference of a reduction over the ranks, checked against the f64 formula on the rounded inputs
local cpu_op = { sum = ms.add, max = ms.maximum, min = ms.minimum }
local f64_op = { sum = function(a, b) return a + b end, max = math.max, min = math.min }
local function reference(dt, op, ins)
  local acc = ins[1]
  for r = 2, #ins do acc = op == "avg" and ms.add(acc, ins[r]) or cpu_op[op](acc, ins[r]) end
  if op == "avg" then acc = ms.div(acc, #ins) end
  local want = {}
  local lists = {}
  for r = 1, #ins do lists[r] = flat(ins[r]) end
  for i = 1, #lists[1] do
    local x = lists[1][i]
    for r = 2, #ins do x = f64_op[op == "avg" and "sum" or op](x, lists[r][i]) end
    want[i] = op == "avg" and x / #ins or x
  end
  H.assert_close(flat(acc), want, H.tol[dt].rtol, H.tol[dt].atol, "cpu reference " .. dt .. " " .. op)
  return flat(acc)
end

local n = 1000
for salt, dt in ipairs { "f32", "bf16", "f16", "f64", "i32", "u8" } do
  local rtol, atol = H.tols(dt, 2)
  local ins = { values(dt, 0, n, salt), values(dt, 1, n, salt) }
  for _, op in ipairs { "sum", "max", "min", "avg" } do
    if op ~= "avg" or (dt ~= "i32" and dt ~= "u8") then
      local want = reference(dt, op, ins)
      local src = on_gpu(ins[rank + 1])
      local dst = ms.empty({ n }, { dtype = dt, ctx = ctx })
      comm:all_reduce(dst, src, op)
      H.assert_close(flat(dst), want, rtol, atol, "all_reduce " .. dt .. " " .. op)
      H.assert_close(flat(src), flat(ins[rank + 1]), 0, 0, "all_reduce source kept " .. dt)
      comm:all_reduce(src, op)                                          -- in place
      H.assert_close(flat(src), want, rtol, atol, "all_reduce in place " .. dt .. " " .. op)
      -- reduce_scatter: rank r keeps elements [r*n/2, (r+1)*n/2) of the reduction
      local part = ms.empty({ n / 2 }, { dtype = dt, ctx = ctx })
      comm:reduce_scatter(part, on_gpu(ins[rank + 1]), op)
      local slice = {}
      for i = 1, n / 2 do slice[i] = want[rank * n / 2 + i] end
      H.assert_close(flat(part), slice, rtol, atol, "reduce_scatter " .. dt .. " " .. op)
    end
  end
  -- broadcast from each root
  for root = 0, 1 do
    local t = on_gpu(ins[rank + 1])
    comm:broadcast(t, root)
    H.assert_close(flat(t), flat(ins[root + 1]), 0, 0, "broadcast " .. dt .. " from " .. root)
  end
  -- all_gather, both shapes, and in place
  local want = flat(ins[1])
  for _, x in ipairs(flat(ins[2])) do want[#want + 1] = x end
  local g = ms.empty({ 2, n }, { dtype = dt, ctx = ctx })
  comm:all_gather(g, on_gpu(ins[rank + 1]))
  H.assert_close(flat(g), want, 0, 0, "all_gather " .. dt)
  local g2 = ms.empty({ 2 * n }, { dtype = dt, ctx = ctx })
  local mine = g2:view(2, n):select(0, rank)
  mine:copy_(on_gpu(ins[rank + 1]))
  comm:all_gather(g2, mine)
  H.assert_close(flat(g2), want, 0, 0, "all_gather in place " .. dt)
  print(("ok %d %s"):format(rank, dt))
end

-- bad arguments are refused before NCCL sees them (every rank refuses the same way, so none waits)
local a = ms.randn({ 8 }, { ctx = ctx })
H.expect_error(function() comm:all_reduce(ms.empty({ 9 }, { ctx = ctx }), a) end, "dst has shape [9] but src [8]")
H.expect_error(function() comm:all_reduce(ms.empty({ 8 }, { dtype = "f64", ctx = ctx }), a) end, "dst is f64 but src is f32")
H.expect_error(function() comm:all_reduce(a, ms.randn({ 8 })) end, "src is on cpu")
H.expect_error(function() comm:all_reduce(ms.randn({ 4, 4 }, { ctx = ctx }):transpose(0, 1)) end, "is not contiguous")
H.expect_error(function() comm:all_reduce(ms.empty({ 8 }, { dtype = "i32", ctx = ctx }), "avg") end, "MS_COMM_AVG needs a float dtype")
H.expect_error(function() comm:broadcast(a, 2) end, "root 2 is outside [0, 2)")
H.expect_error(function() comm:all_gather(ms.empty({ 3, 8 }, { ctx = ctx }), a) end, "with world size 2")
H.expect_error(function() comm:all_reduce(a, "prod") end, "op must be one of sum, max, min, avg")
local big = ms.empty({ 16 }, { ctx = ctx })
H.expect_error(function() comm:all_gather(big, big:view(2, 8):select(0, 1 - rank)) end, "share memory")
ctx:sync()
comm:free()
print(("done %d"):format(rank))
]]

describe("collectives between 2 ranks #multigpu", function()
  H.multigpu_it("all_reduce, broadcast, all_gather, reduce_scatter equal the CPU computation in every dtype", function()
    local s = write_script("collectives.lua", collectives)
    local out, code = launch(("launch -n 2 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    for r = 0, 1 do
      for _, dt in ipairs { "f32", "bf16", "f16", "f64", "i32", "u8" } do
        assert.is_truthy(out:find(("ok %d %s"):format(r, dt), 1, true), out)
      end
      assert.is_truthy(out:find(("done %d"):format(r), 1, true), out)
    end
  end)

  H.multigpu_it("a communicator whose second rank never comes fails at the timeout instead of hanging", function()
    local s = write_script("comm_missing.lua", [[
-- a world of 2 where only rank 0 runs: the rendezvous times out
local ok, err = pcall(ms.comm.new, { ctx = ms.device("cuda:0"), rank = 0, world_size = 2, timeout = 2 })
print(("result %s %s"):format(tostring(ok), tostring(err)))
]])
    local out, code, wall = launch(("launch -n 1 %s"):format(q(s)))
    assert.are.equal(0, code, out)
    out = out or ""
    assert.is_truthy(out:find("result false", 1, true), out)
    assert.is_truthy(out:find("waiting for ranks 1 of world size 2", 1, true), out)
    assert.is_true(wall < 10, "took " .. wall .. " s")
  end)
end)
