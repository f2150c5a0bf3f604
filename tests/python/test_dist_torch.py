"""moonstep on 2 GPUs from PyTorch (issue 9, "the PyTorch path with torchrun and 2 processes"): the Python bridge's
Comm and TorchOptimizer(..., comm=, shards=, distribute=) against one optimizer on the whole model.

    torchrun --nproc_per_node=2 tests/python/test_dist_torch.py       (2 CUDA devices; NCCL_NVLS_ENABLE=0 there)

Every rank builds the same MLP (same seed) and trains it on the same batches; each rank hands moonstep its slice
of every matrix -- half the rows (FSDP-style; views into the weight, no copies) or half the columns (tensor
parallel; tensors of their own) -- with the slice of the gradient, and the biases whole (updated by their owner
and broadcast, or by every rank: distribute).  After each step the slices are all-gathered into the full
weights with torch.distributed, as a sharded trainer would before its next forward pass.  Rank 0 runs the same
training with a one-rank TorchOptimizer on a copy of the model; the two must agree:
  - SinkGD base, rows-sharded; spectral (unit target), columns; sphere (SinkGDMD), rows, distribute "replicate"
  - DASH, every parameter whole, distribute "owner" (each rank solves its parameters' blocks)
  - the 2-rank SinkGD checkpoint (one file per rank) loads into a one-rank optimizer, which steps on as the
    reference does
The communicators come from an NCCL id that rank 0 makes and torch.distributed broadcasts, and from the
environment (a rendezvous on a port that rank 0 picks: torchrun's MASTER_PORT is torch's store).

Prints a line per check and ends with "PASS ..." or "FAIL ..." on rank 0 and "N passed, N failed"; exits 1 on a
failure on any rank.  Without torch, or outside torchrun with 2 ranks and 2 GPUs, it says why and exits 0 with
"0 passed, 0 failed, 1 skipped".
"""
import copy
import datetime
import os
import socket
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


def skip(why):
    print("SKIP test_dist_torch: %s" % why)
    print("0 passed, 0 failed, 1 skipped")
    sys.exit(0)


try:
    import torch
    import torch.distributed as dist
except ImportError:
    skip("torch is missing")
if os.environ.get("WORLD_SIZE") != "2" or "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
    skip("run it with: torchrun --nproc_per_node=2 %s" % sys.argv[0])
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    skip("needs 2 CUDA devices (found %d)" % (torch.cuda.device_count() if torch.cuda.is_available() else 0))

import moonstep  # noqa: E402

RANK, WORLD, LOCAL = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
DEVICE = torch.device("cuda", LOCAL)
STEPS = 5
RESULTS = []       # (name, ok, detail) of this rank


def log(msg):
    print("[rank %d] %s" % (RANK, msg), flush=True)


def check(name, ok, detail=""):
    RESULTS.append((name, bool(ok), detail))
    log("%s %s%s" % ("ok  " if ok else "FAIL", name, (": " + detail) if detail else ""))


def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 48), torch.nn.GELU(),
                               torch.nn.Linear(48, 16)).to(DEVICE)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(128, 32, generator=g).to(DEVICE), torch.randn(128, 16, generator=g).to(DEVICE)


def forward_backward(model, step):
    x, y = batch(step)
    model.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


class Sharded:
    """This rank's slice of a weight w: rows (a view of w's rows: updated in place) or columns (a tensor of its own,
    as a tensor-parallel layer holds it), a leaf parameter whose .grad is the slice of w.grad."""

    def __init__(self, name, w, dim):
        self.name, self.w, self.dim = name, w, dim
        n = w.shape[0] if dim == "rows" else w.shape[1]
        assert n % WORLD == 0, "%s: %d does not split into %d" % (name, n, WORLD)
        self.size, self.len = n, n // WORLD
        self.offset = RANK * self.len
        if dim == "rows":
            self.param = torch.nn.Parameter(w.data[self.offset:self.offset + self.len])
            assert self.param.data_ptr() == w.data[self.offset].data_ptr(), "the rows' parameter is a view of w"
        else:
            self.param = torch.nn.Parameter(w.data[:, self.offset:self.offset + self.len].contiguous())

    def take_grad(self):
        g = self.w.grad
        self.param.grad = g[self.offset:self.offset + self.len] if self.dim == "rows" else \
            g[:, self.offset:self.offset + self.len].contiguous()

    def gather(self):
        """The full weight from every rank's slice (torch.distributed, as a sharded trainer does)."""
        local = self.param.data.contiguous()
        if self.dim == "rows":
            dist.all_gather_into_tensor(self.w.data, local.clone())
        else:
            out = torch.empty((WORLD,) + tuple(local.shape), device=DEVICE, dtype=local.dtype)
            dist.all_gather_into_tensor(out, local)
            self.w.data.copy_(out.permute(1, 0, 2).reshape(self.w.shape))


def flat_params(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def compare(name, model, ref, start):
    """rank 0: model's parameters against ref's (one rank); both ranks: the same values everywhere."""
    mine = flat_params(model)
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    check("%s: the ranks hold the same parameters" % name, torch.equal(mine, theirs),
          "max difference %.3g" % (mine - theirs).abs().max().item())
    if RANK != 0:
        return
    want = flat_params(ref)
    err = (mine - want).abs().max().item()
    tol = 1e-4 * want.abs().max().item() + 1e-6
    moved = (want - start).abs().max().item()
    check("%s: 2 ranks equal 1 rank" % name, err <= tol, "max error %.3g, tolerance %.3g" % (err, tol))
    check("%s: the training moved the parameters far beyond the tolerance" % name, moved > 100 * tol,
          "moved %.3g" % moved)


def sharded_run(name, comm, recipe, options, dims, distribute=None, shards_by_name=False, steps=STEPS):
    """Trains the model on 2 ranks with its matrices sharded as dims says (None: whole) and, on rank 0, a copy
    with one rank.  Returns (model, shards, opt, ref, ref_opt)."""
    model = make_model()
    start = flat_params(model)
    ref = copy.deepcopy(model) if RANK == 0 else None
    shards, params, spec = [], [], {}
    for i, (pname, p) in enumerate(model.named_parameters()):
        dim = dims[i // 2] if p.ndim == 2 else None
        if dim is None:
            params.append((pname, p))
            continue
        s = Sharded(pname, p, dim)
        shards.append(s)
        params.append((pname, s.param))          # the full weight's name: checkpoints match by it
        spec[pname if shards_by_name else s.param] = (dim, s.offset, s.size)
    opt = moonstep.TorchOptimizer(params, recipe, lr=options["lr"], options={k: v for k, v in options.items() if k != "lr"},
                                  comm=comm, shards=spec, distribute=distribute)
    ref_opt = moonstep.TorchOptimizer(ref.named_parameters(), recipe, lr=options["lr"],
                                      options={k: v for k, v in options.items() if k != "lr"}) if RANK == 0 else None
    for step in range(steps):
        forward_backward(model, step)
        for s in shards:
            s.take_grad()
        opt.step()
        for s in shards:
            s.gather()
        if ref_opt is not None:
            forward_backward(ref, step)
            ref_opt.step()
    torch.cuda.synchronize()
    compare(name, model, ref, start)
    return model, shards, opt, ref, ref_opt


SINKGD = {"lr": 2e-2, "sinkhorn_iters": 5, "sinkgd_lr_scale": 1.0, "adamw_state": "f32"}


def test_sinkgd(comm):
    dims = ["rows", "rows", "rows"]
    model, shards, opt, ref, ref_opt = sharded_run("sinkgd base, rows", comm, "sinkgd", SINKGD, dims)
    # a state dict is one file; 2 ranks write one per rank, through save(path)
    try:
        opt.state_dict()
        check("state_dict() on 2 ranks is refused", False, "no error")
    except moonstep.MoonstepError as e:
        check("state_dict() on 2 ranks is refused", e.status == "MS_E_ARG" and "one file per rank" in str(e), str(e))
    box = [tempfile.mkdtemp(prefix="moonstep-dist-") if RANK == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "sinkgd.safetensors")
    opt.moonstep.save(path)
    dist.barrier()
    if RANK == 0:
        # the checkpoint of 2 ranks on one: a copy of the full model, the state joined by name
        resumed_model = copy.deepcopy(model)
        resumed = moonstep.TorchOptimizer(resumed_model.named_parameters(), "sinkgd", lr=SINKGD["lr"],
                                          options={k: v for k, v in SINKGD.items() if k != "lr"})
        why = ""
        try:
            resumed.moonstep.load(path)
        except moonstep.MoonstepError as e:
            why = str(e)
        ok = why == ""
        check("the 2-rank checkpoint loads on 1 rank", ok, why)
        if ok:
            start = flat_params(ref)
            for step in range(STEPS, STEPS + 2):
                forward_backward(resumed_model, step)
                resumed.step()
                forward_backward(ref, step)
                ref_opt.step()
            want, got = flat_params(ref), flat_params(resumed_model)
            err, tol = (got - want).abs().max().item(), 1e-4 * want.abs().max().item() + 1e-6
            check("resumed on 1 rank, it steps on as the reference", err <= tol and (want - start).abs().max() > 10 * tol,
                  "max error %.3g, tolerance %.3g" % (err, tol))
        for f in os.listdir(box[0]):
            os.unlink(os.path.join(box[0], f))
        os.rmdir(box[0])
    dist.barrier()
    sharded_run("sinkgd spectral, cols", comm, "sinkgd", dict(SINKGD, sinkgd_spectral_norm=True),
                ["cols", "cols", "cols"], shards_by_name=True)
    sharded_run("sinkgd sphere, rows and whole, replicate", comm, "sinkgd", dict(SINKGD, sinkgd_md_sphere=True),
                ["rows", None, "rows"], distribute="replicate")


DASH = {"lr": 1e-2, "block_size": 16, "inv_root_method": "ndb", "matrix_scaling_type": "pim", "inv_root_freq": 1,
        "start_prec_step": -1}


def test_dash(comm):
    sharded_run("dash ndb-pim, owner", comm, "dash", DASH, [None, None, None], distribute="owner")


def env_comm():
    """A Comm from the environment, meeting on a port rank 0 picks (torch's store holds MASTER_PORT)."""
    box = [None]
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            box[0] = s.getsockname()[1]
    dist.broadcast_object_list(box, src=0)
    old = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(box[0])
    try:
        return moonstep.Comm.from_env(device="cuda:%d" % LOCAL, timeout=60)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    torch.cuda.set_device(LOCAL)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=180))
    failed = False
    comms = []
    try:
        box = [moonstep.comm_unique_id() if RANK == 0 else None]
        dist.broadcast_object_list(box, src=0)
        comm = moonstep.Comm(RANK, WORLD, box[0], device="cuda:%d" % LOCAL, timeout=60)
        comms.append(comm)
        check("a Comm from the id rank 0 made", (comm.rank, comm.world_size) == (RANK, WORLD), repr(comm))
        test_sinkgd(comm)
        comm2 = env_comm()
        comms.append(comm2)
        check("a Comm from the environment", (comm2.rank, comm2.world_size) == (RANK, WORLD), repr(comm2))
        test_dash(comm2)
    except Exception:
        failed = True
        log("FAIL (exception)\n" + traceback.format_exc())
    bad = sum(1 for _, ok, _ in RESULTS if not ok) + failed
    counts = torch.tensor([len(RESULTS) - bad + failed, bad], device=DEVICE, dtype=torch.int64)
    if not failed:          # a rank that failed part way may be out of step: no collective with it
        dist.all_reduce(counts)
    passed, nfail = int(counts[0]), int(counts[1])
    if RANK == 0 or failed:
        print("%s test_dist_torch: %d passed, %d failed (2 ranks)" % ("PASS" if nfail == 0 else "FAIL", passed, nfail))
        print("%d passed, %d failed" % (passed, nfail))
    torch.cuda.synchronize()
    if not failed:
        dist.barrier()
    dist.destroy_process_group()
    # the optimizers (kept by test locals) are gone; the communicators last
    for c in comms:
        c.close()
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
