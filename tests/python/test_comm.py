"""The Python bridge's communicators and sharded parameters (moonstep.Comm, Optimizer(..., comm=), shards) on
NumPy arrays and the CPU's communicator: argument handling and its errors, a world of one, and two ranks (this
script started twice more, as a launcher would) whose sharded SinkGD, owned DASH and checkpoint (saved on 2
ranks, loaded on 1) match one optimizer on the whole tensors (itself checked against f64 formulas by
test_bridge.py and the specs).

    python3 tests/python/test_comm.py          (MOONSTEP_LIBRARY picks the library; default build/)

Prints one line per test and ends with "N passed, N failed"; exits 1 on a failure.  Without NumPy it says so
and prints "0 passed, 0 failed, 1 skipped".  tests/python/test_dist_torch.py is the PyTorch counterpart on GPUs.
"""
import os
import socket
import subprocess
import sys
import tempfile

from harness import assert_close, expect, expect_status, moonstep, np, run, test


def seeded(seed, shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# The distributed problems: full tensors every process can make, and each rank's slice of them
# ---------------------------------------------------------------------------------------------------
SINKGD_OPTIONS = {"lr": 0.05, "sinkhorn_iters": 3, "sinkgd_lr_scale": 1.0, "sinkgd_spectral_norm": True,
                  "adamw_state": "f32"}
# name: (global shape, shard dim or None, rank 0's length along it); 2 ranks
SINKGD_PARAMS = {"mlp.up.weight": ((6, 5), "rows", 4),      # uneven rows
                 "mlp.down.weight": ((4, 7), "cols", 3),    # columns
                 "mlp.gate.weight": ((5, 5), None, 0),      # whole on both ranks: updated by its owner
                 "mlp.up.bias": ((6,), None, 0)}            # AdamW, owned
DASH_OPTIONS = {"lr": 0.01, "block_size": 8, "inv_root_freq": 1, "inv_root_method": "ndb",
                "matrix_scaling_type": "pim", "newton_steps": 6, "start_prec_step": -1}
DASH_PARAMS = {"a.weight": (12, 8), "b.weight": (8, 16), "c.weight": (6, 6), "c.bias": (6,)}
STEPS = 4


def piece(full, dim, lo, hi):
    if dim is None:
        return full.copy()
    axis = full.ndim - (2 if dim == "rows" else 1)
    index = [slice(None)] * full.ndim
    index[axis] = slice(lo, hi)
    return np.ascontiguousarray(full[tuple(index)])


def span(shape, dim, first, rank):
    """[lo, hi) of rank's slice along the shard dim (2 ranks, rank 0 holding `first`)."""
    if dim is None:
        return 0, 0
    n = shape[-2] if dim == "rows" else shape[-1]
    return (0, first) if rank == 0 else (first, n)


def sinkgd_grad(step, k, shape):
    return seeded(100 * step + k, shape, 0.5)


def sinkgd_problem(rank, comm):
    """The SinkGD optimizer of `rank` (None: one optimizer on the whole tensors) and its arrays."""
    arrays, entries = {}, []
    for k, (name, (shape, dim, first)) in enumerate(SINKGD_PARAMS.items()):
        full = seeded(1000 + k, shape)
        d = dim if rank is not None else None
        lo, hi = span(shape, d, first, rank)
        p = piece(full, d, lo, hi)
        g = np.zeros_like(p)
        arrays[name] = (p, g, d, lo, hi)
        shard = (d, lo, shape[-2] if d == "rows" else shape[-1]) if d else None
        entries.append({"name": name, "param": p, "grad": g, "shard": shard})
    return moonstep.Optimizer(entries, "sinkgd", SINKGD_OPTIONS, comm=comm), arrays


def sinkgd_steps(opt, arrays, first, last):
    for step in range(first, last + 1):
        for k, (name, (shape, _, _)) in enumerate(SINKGD_PARAMS.items()):
            p, g, d, lo, hi = arrays[name]
            g[:] = piece(sinkgd_grad(step, k, shape), d, lo, hi)
        opt.step()


def dash_problem(comm):
    arrays = {}
    for k, (name, shape) in enumerate(DASH_PARAMS.items()):
        arrays[name] = (seeded(2000 + k, shape), np.zeros(shape, np.float32))
    opt = moonstep.Optimizer({n: a for n, a in arrays.items()}, "dash", DASH_OPTIONS, comm=comm)
    for step in range(1, STEPS + 1):
        for k, (name, shape) in enumerate(DASH_PARAMS.items()):
            arrays[name][1][:] = seeded(300 * step + k, shape, 0.1)
        opt.step()
    return {n: a[0] for n, a in arrays.items()}


def worker(out_dir):
    """One of the two ranks (started by two_ranks_match_one_optimizer_on_the_whole_tensors)."""
    comm = moonstep.Comm.from_env(device="cpu", timeout=30)
    rank = comm.rank
    assert comm.world_size == 2 and rank == int(os.environ["RANK"]), repr(comm)
    opt, arrays = sinkgd_problem(rank, comm)
    sinkgd_steps(opt, arrays, 1, STEPS)
    expect_status("MS_E_ARG", "one file per rank", opt.checkpoint_bytes)
    opt.save(os.path.join(out_dir, "sinkgd.safetensors"))
    opt.close()
    result = {"sinkgd/" + n: a[0] for n, a in arrays.items()}
    for n, p in dash_problem(comm).items():
        result["dash/" + n] = p
    np.savez(os.path.join(out_dir, "rank%d.npz" % rank), **result)
    comm.close()
    print("rank %d done" % rank)


# ---------------------------------------------------------------------------------------------------
@test
def unique_ids_or_a_clear_refusal():
    try:
        a, b = moonstep.comm_unique_id(), moonstep.comm_unique_id()
    except moonstep.MoonstepError as e:
        assert e.status == "MS_E_UNSUPPORTED" and "without NCCL" in str(e), e
        return
    assert isinstance(a, bytes) and len(a) == 128 and a != b and a != bytes(128)


@test
def comm_arguments_are_checked_before_anything_is_made():
    expect(TypeError, "rank must be an integer", moonstep.Comm, 0.5, 2, device="cpu")
    expect(TypeError, "world_size must be an integer", moonstep.Comm, 0, "2", device="cpu")
    expect(ValueError, "unique_id must be 128 bytes", moonstep.Comm, 0, 2, b"short", device="cpu")
    expect(ValueError, "got str", moonstep.Comm, 0, 2, "x" * 128, device="cpu")
    expect(ValueError, "timeout must be a positive number of seconds", moonstep.Comm, 0, 1, device="cpu", timeout=-1)
    expect(ValueError, "not both", moonstep.Comm, 0, 1, device="cpu", context=moonstep.Context("cpu"))
    expect(TypeError, "context must be a moonstep.Context", moonstep.Comm, 0, 1, context="cpu")
    expect_status("MS_E_ARG", "rank 2 is outside [0, 2)", moonstep.Comm, 2, 2, device="cpu", port=5000)
    expect_status("MS_E_ARG", "world_size 0 is below 1", moonstep.Comm, 0, 0, device="cpu")
    expect_status("MS_E_ARG", "port 70000 is outside [1, 65535]", moonstep.Comm, 1, 2, device="cpu",
                  addr="127.0.0.1", port=70000)


@test
def from_env_names_the_missing_variable():
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        expect_status("MS_E_ARG", "RANK is not set", moonstep.Comm.from_env, device="cpu")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "two"
        expect_status("MS_E_ARG", "WORLD_SIZE='two' is not an integer", moonstep.Comm.from_env, device="cpu")
        os.environ["WORLD_SIZE"] = "1"
        comm = moonstep.Comm.from_env(device="cpu")       # a world of one needs no rendezvous
        assert (comm.rank, comm.world_size) == (0, 1), repr(comm)
        comm.close()
    finally:
        for k in ("RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
        os.environ.update(saved)


@test
def a_world_of_one_steps_as_no_comm_does():
    comm = moonstep.Comm(0, 1, device="cpu")
    assert (comm.rank, comm.world_size) == (0, 1) and "rank 0 of 1 on cpu" in repr(comm)
    ref, ref_arrays = sinkgd_problem(None, None)
    # every shard the whole dim: a world of one with shard entries is the plain optimizer
    entries = []
    arrays = {}
    for k, (name, (shape, dim, _)) in enumerate(SINKGD_PARAMS.items()):
        p, g = seeded(1000 + k, shape), np.zeros(shape, np.float32)
        n = (shape[-2] if dim == "rows" else shape[-1]) if dim else 0
        arrays[name] = (p, g, None, 0, 0)
        entries.append((name, p, g, None, (dim, 0, n) if dim else None))
    opt = moonstep.Optimizer(entries, "sinkgd", SINKGD_OPTIONS, comm=comm)
    assert opt.context is comm.context, "the optimizer runs on the communicator's context"
    sinkgd_steps(opt, arrays, 1, STEPS)
    sinkgd_steps(ref, ref_arrays, 1, STEPS)
    for name in SINKGD_PARAMS:
        assert_close(arrays[name][0], ref_arrays[name][0], 1e-6, 1e-7, name)
        assert not np.array_equal(arrays[name][0], seeded(1000 + list(SINKGD_PARAMS).index(name),
                                                          SINKGD_PARAMS[name][0])), name + " moved"
    assert len(opt.checkpoint_bytes()) > 0          # one rank: one file
    opt.close()
    ref.close()
    comm.close()
    assert "closed" in repr(comm)
    expect(ValueError, "the communicator is closed", lambda: comm.rank)
    comm.close()                                    # idempotent


@test
def a_comm_is_not_closed_under_an_open_optimizer():
    # the optimizer holds the communicator's pointer: closing it first left the next step reading freed memory
    comm = moonstep.Comm(0, 1, device="cpu")
    w, g = seeded(3, (4, 4)), seeded(4, (4, 4))
    opt = moonstep.Optimizer({"w": (w, g)}, "adamw", comm=comm)
    expect(ValueError, "close the optimizer", comm.close)
    assert "rank 0 of 1" in repr(comm), "a refused close keeps the communicator"
    before = w.copy()
    opt.step()
    assert not np.array_equal(w, before), "the optimizer steps on"
    opt.close()
    comm.close()                                    # its optimizer closed: now it goes
    assert "closed" in repr(comm)


@test
def shard_arguments_are_checked():
    comm = moonstep.Comm(0, 1, device="cpu")
    w, g = seeded(1, (4, 6)), np.zeros((4, 6), np.float32)
    for shard, exc, needle in [
        (("diag", 0, 4), ValueError, "shard dim must be 'rows' (dim -2) or 'cols' (dim -1)"),
        (("rows", 0), ValueError, "a shard is (dim, offset, size)"),
        (("rows", 0.5, 4), TypeError, "shard offset must be an integer"),
        ({"dim": "rows", "offset": 0, "size": 4, "axis": 0}, ValueError, "shard keys ['axis']"),
    ]:
        opt = moonstep.Optimizer({}, "sinkgd", comm=comm)
        expect(exc, needle, opt.add_param, "w", w, g, None, shard)
        opt.close()
    opt = moonstep.Optimizer({}, "sinkgd", comm=comm)
    expect_status("MS_E_ARG", "rows [2, 6) held here do not lie within the global [0, 5)", opt.add_param, "w", w, g,
                  None, ("rows", 2, 5))
    expect_status("MS_E_ARG", "a param of shape [6] has no rows to shard", opt.add_param, "b", w[0].copy(), None,
                  None, ("rows", 0, 6))
    # a slice of 4 of 8 rows with no other rank: refused when the optimizer starts, naming it; nothing moves
    before = w.copy()
    opt.add_param("half", w, g, None, {"dim": "rows", "offset": 4, "size": 8})
    g[:] = seeded(2, g.shape)
    expect(moonstep.MoonstepError, "half", opt.step)
    assert np.array_equal(w, before), "a refused step changed nothing"
    opt.close()
    expect(TypeError, "comm must be a moonstep.Comm", moonstep.Optimizer, {"w": (w, g)}, "sinkgd", comm="world")
    expect_status("MS_E_ARG", "setting 'comm'", moonstep.Optimizer, {"w": (w, g)}, "sinkgd", settings={"comm": 1})
    expect_status("MS_E_ARG", "distribute", moonstep.Optimizer, {"w": (w, g)}, "sinkgd",
                  settings={"distribute": "everywhere"}, comm=comm)
    comm.close()


@test
def two_ranks_match_one_optimizer_on_the_whole_tensors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="moonstep-comm-") as out:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", out],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for r in range(2)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=120)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                p.kill()
                outputs.append(p.communicate()[0].decode(errors="replace") + "\n(killed after 120 s)")
        for r, (p, text) in enumerate(zip(procs, outputs)):
            assert p.returncode == 0, "rank %d exited %s:\n%s" % (r, p.returncode, text)
        got = [np.load(os.path.join(out, "rank%d.npz" % r)) for r in range(2)]

        # SinkGD: each rank's slices are the slices of one optimizer's whole tensors
        ref, ref_arrays = sinkgd_problem(None, None)
        sinkgd_steps(ref, ref_arrays, 1, STEPS)
        for name, (shape, dim, first) in SINKGD_PARAMS.items():
            for r in range(2):
                lo, hi = span(shape, dim, first, r)
                assert_close(got[r]["sinkgd/" + name], piece(ref_arrays[name][0], dim, lo, hi), 2e-5, 1e-6,
                             "sinkgd %s on rank %d" % (name, r))
        # the 2-rank checkpoint loads on one rank (slices joined by name) and steps on as the reference does
        whole = {}
        for name, (shape, dim, first) in SINKGD_PARAMS.items():
            if dim is None:
                whole[name] = got[0]["sinkgd/" + name].copy()
            else:
                whole[name] = np.concatenate([got[0]["sinkgd/" + name], got[1]["sinkgd/" + name]],
                                             axis=len(shape) - (2 if dim == "rows" else 1))
        grads = {n: np.zeros_like(p) for n, p in whole.items()}
        resumed = moonstep.Optimizer({n: (whole[n], grads[n]) for n in whole}, "sinkgd", SINKGD_OPTIONS)
        resumed.load(os.path.join(out, "sinkgd.safetensors"))
        assert resumed.stats()["step"] == STEPS
        arrays = {n: (whole[n], grads[n], None, 0, 0) for n in whole}
        sinkgd_steps(resumed, arrays, STEPS + 1, STEPS + 1)
        sinkgd_steps(ref, ref_arrays, STEPS + 1, STEPS + 1)
        for name in SINKGD_PARAMS:
            assert_close(whole[name], ref_arrays[name][0], 2e-5, 1e-6, "resumed on one rank: " + name)
        resumed.close()
        ref.close()

        # DASH: each parameter updated by its owner and broadcast: both ranks hold one optimizer's values
        want = dash_problem(None)
        for name in DASH_PARAMS:
            assert np.array_equal(got[0]["dash/" + name], got[1]["dash/" + name]), "dash %s: the ranks differ" % name
            assert_close(got[0]["dash/" + name], want[name], 1e-5, 1e-7, "dash " + name)
            assert not np.array_equal(want[name], seeded(2000 + list(DASH_PARAMS).index(name), DASH_PARAMS[name]))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    return run()


if __name__ == "__main__":
    sys.exit(main())
