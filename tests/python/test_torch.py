"""The Python bridge with PyTorch and CuPy (for the GPU host, where both are installed; CPU tensors when torch has
no GPU):

    python3 tests/python/test_torch.py          (MOONSTEP_LIBRARY picks the library; default build/)

- a small MLP trained for 200 steps by moonstep's AdamW (TorchOptimizer, a torch LR scheduler driving it)
  tracks torch.optim.AdamW from the same start, and moonstep's SinkGD tracks the SinkGD formula written here
  in f64 (AdamW for the biases, as the recipe routes them);
- parameters are updated in place (same storage), on torch's current stream (a side stream too);
- a torch.optim.AdamW state dict moves into moonstep mid-run and the run goes on as torch's would;
- state_dict / load_state_dict through torch.save resumes bit for bit;
- CuPy arrays (DLPack) with moonstep's AdamW against an f64 AdamW.
Prints one line per test and "N passed, N failed[, N skipped]"; exits 1 on a failure.
"""
import copy
import io
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

try:
    import torch
except ImportError:
    torch = None
try:
    import cupy
except ImportError:
    cupy = None

TESTS = []
STEPS = 200


def test(needs):
    def register(fn):
        TESTS.append((fn, needs))
        return fn
    return register


def available(needs):
    if "torch" in needs and torch is None:
        return "torch is missing"
    if "cuda" in needs and (torch is None or not torch.cuda.is_available()):
        return "no CUDA device for torch"
    if "cupy" in needs:
        if cupy is None:
            return "cupy is missing"
        try:
            if cupy.cuda.runtime.getDeviceCount() == 0:
                return "no CUDA device for cupy"
        except Exception as e:  # no driver
            return "cupy cannot reach a GPU (%s)" % e
    return None


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4)).to(device())


def make_data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 16, generator=g)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        y = teacher(x)
    return x.to(device()), y.to(device())


def train(model, opt, data, steps, sched=None, lrs=None):
    x, y = data
    losses = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if lrs is not None:
            lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


def assert_tracks(la, lb, rtol, what):
    for i, (a, b) in enumerate(zip(la, lb)):
        if not abs(a - b) <= rtol * max(abs(a), 1e-3):       # NaN fails
            raise AssertionError("%s: step %d loss %.7g vs %.7g (rtol %g)" % (what, i, a, b, rtol))


def assert_params_close(ma, mb, atol, what):
    for (name, a), b in zip(ma.named_parameters(), mb.parameters()):
        err = (a.detach().double() - b.detach().double()).abs().max().item()
        if not err <= atol:
            raise AssertionError("%s: parameter %s differs by %.3g (atol %g)" % (what, name, err, atol))


# ---------------------------------------------------------------------------------------------------
@test({"torch"})
def adamw_tracks_torch_adamw_with_a_scheduler():
    import moonstep
    data = make_data()
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    pointers = [p.data_ptr() for p in model.parameters()]
    hp = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **hp)
    opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=hp["lr"],
                                  options={"betas": list(hp["betas"]), "eps": hp["eps"], "weight_decay": hp["weight_decay"]})
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=STEPS)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    lrs = []
    la = train(ref_model, ref_opt, data, STEPS, ref_sched)
    lb = train(model, opt, data, STEPS, sched, lrs)
    assert lb[-1] < 0.5 * lb[0], "trained: %g -> %g" % (lb[0], lb[-1])
    assert_tracks(la, lb, 1e-3, "AdamW losses")
    assert_params_close(ref_model, model, 1e-4, "AdamW parameters")
    assert [p.data_ptr() for p in model.parameters()] == pointers, "updated in place"
    # the scheduler's lr reached every step
    assert lrs[0] == hp["lr"] and lrs[-1] < 1e-3 * hp["lr"], (lrs[0], lrs[-1])
    last = opt.moonstep.stats()["last"]
    assert abs(last["lr"] - lrs[-1]) <= 1e-15 and last["step"] == STEPS, last


def sinkgd_reference_step(w, g, lr, alpha, iters, eps=1e-8):
    x = g.double()
    m, n = x.shape
    for _ in range(iters):
        x = math.sqrt(n) * x / x.norm(dim=1, keepdim=True).clamp_min(eps)
        x = math.sqrt(m) * x / x.norm(dim=0, keepdim=True).clamp_min(eps)
    w.copy_((w.double() - lr * alpha * x).to(w.dtype))


@test({"torch"})
def sinkgd_tracks_the_formula():
    import moonstep
    data = make_data()
    ref_model = make_model(1)
    model = copy.deepcopy(ref_model)
    lr, alpha, iters = 2e-2, 0.05, 5
    opt = moonstep.TorchOptimizer(model.named_parameters(), "sinkgd", lr=lr,
                                  options={"sinkhorn_iters": iters, "sinkgd_lr_scale": alpha, "betas": [0.9, 0.999],
                                           "adamw_state": "f32"})
    routes = {p["name"]: p["route"] for p in opt.moonstep.info()["params"]}
    assert routes == {"0.weight": "sinkgd", "0.bias": "adamw", "2.weight": "sinkgd", "2.bias": "adamw",
                      "4.weight": "sinkgd", "4.bias": "adamw"}, routes
    matrices = [p for p in ref_model.parameters() if p.ndim >= 2]
    biases = [p for p in ref_model.parameters() if p.ndim < 2]
    bias_opt = torch.optim.AdamW(biases, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)

    class Reference:
        def zero_grad(self):
            bias_opt.zero_grad()
            for p in matrices:
                p.grad = None

        @torch.no_grad()
        def step(self):
            for p in matrices:
                sinkgd_reference_step(p, p.grad, lr, alpha, iters)
            bias_opt.step()

    la = train(ref_model, Reference(), data, STEPS)
    lb = train(model, opt, data, STEPS)
    assert lb[-1] < lb[0], "trained: %g -> %g" % (lb[0], lb[-1])
    assert_tracks(la, lb, 2e-3, "SinkGD losses")
    assert_params_close(ref_model, model, 5e-4, "SinkGD parameters")


@test({"torch"})
def a_torch_adamw_run_moves_to_moonstep():
    import moonstep
    data = make_data()
    ref_model = make_model(2)
    hp = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **hp)
    train(ref_model, ref_opt, data, 50)
    model = copy.deepcopy(ref_model)
    opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=hp["lr"], options={"weight_decay": 0.0})
    report = opt.load_state_dict(ref_opt.state_dict())
    assert len(report["loaded"]) == 6 and report["kept"] == [], report
    assert opt.moonstep.stats()["step"] == 50
    la = train(ref_model, ref_opt, data, 100)
    lb = train(model, opt, data, 100)
    assert_tracks(la, lb, 1e-3, "losses after the move")
    assert_params_close(ref_model, model, 1e-4, "parameters after the move")


@test({"torch"})
def state_dict_through_torch_save_resumes_bit_for_bit():
    import moonstep
    data = make_data()
    model = make_model(3)
    opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=1e-3)
    train(model, opt, data, 20)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    twin = make_model(4)
    twin_opt = moonstep.TorchOptimizer(twin.named_parameters(), "adamw", lr=1e-3)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    twin.load_state_dict(saved["model"])
    twin_opt.load_state_dict(saved["optim"])
    la = train(model, opt, data, 20)
    lb = train(twin, twin_opt, data, 20)
    assert la == lb, "resumed losses differ"
    assert_params_close(model, twin, 0, "resumed parameters")


@test({"torch", "cuda"})
def a_side_stream_gives_the_same_steps():
    import moonstep
    data = make_data()
    base = make_model(5)
    side_model = copy.deepcopy(base)
    opt = moonstep.TorchOptimizer(base.named_parameters(), "adamw", lr=1e-3)
    la = train(base, opt, data, 30)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side_opt = moonstep.TorchOptimizer(side_model.named_parameters(), "adamw", lr=1e-3)
        assert side_opt.moonstep.context.stream == stream.cuda_stream, "bound to the current stream"
        lb = train(side_model, side_opt, data, 30)
    torch.cuda.current_stream().wait_stream(stream)
    assert la == lb, "the side stream changed the results"
    assert_params_close(base, side_model, 0, "side stream")


@test({"cupy"})
def cupy_arrays_with_adamw():
    import numpy as np
    import moonstep
    rs = np.random.default_rng(9)
    w_host = rs.standard_normal((8, 5)).astype(np.float32)
    w = cupy.asarray(w_host)
    g = cupy.zeros_like(w)
    opt = moonstep.Optimizer({"w": (w, g)}, "adamw", {"lr": 0.01, "weight_decay": 0.1})
    assert opt.context.is_cuda
    ref, m, v = w_host.astype(np.float64), np.zeros(w.shape), np.zeros(w.shape)
    for t in range(1, 21):
        gh = rs.standard_normal(w.shape).astype(np.float32)
        g[...] = cupy.asarray(gh)
        opt.step()
        ref *= 1 - 0.01 * 0.1
        m = 0.9 * m + 0.1 * gh
        v = 0.999 * v + 0.001 * gh.astype(np.float64) ** 2
        ref -= 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    cupy.cuda.get_current_stream().synchronize()
    err = np.abs(cupy.asnumpy(w) - ref).max()
    assert err <= 1e-5, "CuPy AdamW vs f64: %g" % err
    opt.close()


def main():
    passed = failed = skipped = 0
    for fn, needs in TESTS:
        why = available(needs)
        if why:
            skipped += 1
            print("skip %s (%s)" % (fn.__name__, why))
            continue
        try:
            fn()
            passed += 1
            print("ok   %s" % fn.__name__)
        except Exception:
            failed += 1
            print("FAIL %s\n%s" % (fn.__name__, traceback.format_exc()))
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
