"""The Python bridge with PyTorch and CuPy (for the GPU host, where both are installed; CPU tensors when torch has
no GPU):

    python3 tests/python/test_torch.py          (MOONSTEP_LIBRARY picks the library; default build/)

- a small MLP trained for 200 steps by moonstep's AdamW (TorchOptimizer, a torch LR scheduler driving it)
  tracks torch.optim.AdamW from the same start, and moonstep's SinkGD tracks the SinkGD formula written here
  in f64 (AdamW for the biases, as the recipe routes them);
- parameters are updated in place (same storage), on torch's current stream (a side stream too);
- a torch.optim.AdamW state dict moves into moonstep mid-run and the run goes on as torch's would;
- state_dict / load_state_dict through torch.save resumes bit for bit;
- CuPy arrays (DLPack) with moonstep's AdamW against an f64 AdamW;
- inside torch.cuda.graph (capturable=True): a 2-layer MLP's forward, backward and moonstep step captured
  and replayed under a torch LR scheduler tracks the same run done eagerly, step for step (AdamW, SinkGD);
  the optimizer step alone, recorded between torch copies, replays bit for bit like eager steps (with a NaN
  gradient skipped on the device, and moonstep's state compared byte for byte); the refusals (no warm-up,
  no device checks, prepare_replay inside the capture or before any recording) leave the capture valid;
  prepare_replay on a CPU optimizer is refused.
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
    # 200 steps carry the f32 rounding of the SR-Sinkhorn sums along the trajectory (on the GPU, 5.4e-4 once the sweeps
    # scale G before squaring it, 2e534dd); a wrong step (alpha, routing, options) is off by ~1e-3 in each step
    assert_params_close(ref_model, model, 1e-3, "SinkGD parameters")


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
def frozen_parameters_get_no_state_and_a_torch_adamw_state_still_moves():
    # a LoRA-style run: the first layer frozen.  torch.optim.AdamW over every parameter makes no state for it;
    # moonstep leaves it out (its recipes allocate state at creation) and tracks torch on the rest
    import moonstep
    data = make_data()
    ref_model = make_model(5)
    ref_model[0].requires_grad_(False)
    hp = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **hp)
    train(ref_model, ref_opt, data, 10)
    model = copy.deepcopy(ref_model)
    opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=hp["lr"], options={"weight_decay": 0.0})
    names = [p["name"] for p in opt.moonstep.info()["params"]]
    assert "0.weight" not in names and "0.bias" not in names and len(names) == 4, names
    assert opt.param_names == names, (opt.param_names, names)
    # the torch state dict counts the frozen parameters by position: matched all the same
    report = opt.load_state_dict(ref_opt.state_dict())
    assert sorted(report["loaded"]) == sorted(names) and report["kept"] == [], report
    la = train(ref_model, ref_opt, data, 30)
    lb = train(model, opt, data, 30)
    assert_tracks(la, lb, 1e-3, "losses with a frozen layer")
    assert_params_close(ref_model, model, 1e-4, "parameters with a frozen layer")
    # unfrozen after the optimizer was made: refused by name, nothing stepped
    model[0].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.mse_loss(model(data[0]), data[1])
    opt.zero_grad()
    loss.backward()
    try:
        opt.step()
    except moonstep.MoonstepError as e:
        assert "'0.weight'" in str(e) and "frozen" in str(e), e
    else:
        raise AssertionError("a step with a gradient on a parameter frozen at creation was not refused")
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p.detach()), "the refused step changed a parameter"
    model[0].requires_grad_(False)
    model[0].weight.grad = None
    model[0].bias.grad = None
    try:
        moonstep.TorchOptimizer([p for p in model[0].parameters()], "adamw")
    except ValueError as e:
        assert "requires_grad=False" in str(e), e
    else:
        raise AssertionError("an optimizer of frozen parameters only was not refused")


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


# ---------------------------------------------------------------------------------------------------
# Inside torch.cuda.graph
# ---------------------------------------------------------------------------------------------------
GRAPH_STEPS, GRAPH_WARMUP = 24, 3
GRAPH_RECIPES = [("adamw", {"weight_decay": 0.01}),
                 ("sinkgd", {"sinkhorn_iters": 5, "sinkgd_lr_scale": 1.0, "adamw_state": "f32"})]


def lr_factor(step):
    """A learning rate that changes at every step (LambdaLR's multiplier)."""
    return 1.0 / (1.0 + 0.15 * step)


def graph_batches(n, seed):
    """n batches (x, y) of a fixed teacher, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(64, 16, generator=g)
        out.append((x.cuda(), torch.tanh(x @ teacher).cuda()))
    return out


def graph_mlp(recipe, options):
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4)).cuda()
    import moonstep
    opt = moonstep.TorchOptimizer(model.named_parameters(), recipe, lr=1e-2, options=options, capturable=True)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def mlp_step(model, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def expect_moonstep_error(status, needle, fn, *args):
    import moonstep
    try:
        fn(*args)
    except moonstep.MoonstepError as e:
        assert e.status == status and needle in str(e), "%s, want %s with %r" % (e.status, status, needle) + ": %s" % e
        return
    raise AssertionError("no error; wanted %s with %r" % (status, needle))


@test({"torch", "cuda"})
def an_mlp_step_captured_in_a_torch_graph_tracks_the_eager_run():
    import moonstep
    batches = graph_batches(GRAPH_STEPS, 31)
    side = torch.cuda.Stream()            # both runs on the capture's stream: the same cuBLAS handle
    for recipe, options in GRAPH_RECIPES:
        # eager: zero_grad, forward, backward, step, scheduler step
        ref, ref_opt, ref_sched = graph_mlp(recipe, options)
        ref_losses = []
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x, y in batches:
                ref_opt.zero_grad(set_to_none=True)
                ref_losses.append(mlp_step(ref, x, y).detach().clone())
                ref_opt.step()
                ref_sched.step()
        torch.cuda.current_stream().wait_stream(side)

        # the same run: warm-up steps uncaptured on the side stream, then one captured step replayed
        model, opt, sched = graph_mlp(recipe, options)
        pointers = [p.data_ptr() for p in model.parameters()]
        static_x, static_y = torch.empty_like(batches[0][0]), torch.empty_like(batches[0][1])
        losses = []
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x, y in batches[:GRAPH_WARMUP]:
                static_x.copy_(x)
                static_y.copy_(y)
                opt.zero_grad(set_to_none=True)
                losses.append(mlp_step(model, static_x, static_y).detach().clone())
                opt.step()
                sched.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)      # backward allocates the gradients from the graph's pool
        with torch.cuda.graph(graph, stream=side):
            static_loss = mlp_step(model, static_x, static_y)
            opt.step()
        assert opt.moonstep.stats()["step"] == GRAPH_WARMUP, "recording counts no step"
        for x, y in batches[GRAPH_WARMUP:]:
            static_x.copy_(x)
            static_y.copy_(y)
            opt.prepare_replay()
            graph.replay()
            losses.append(static_loss.detach().clone())
            sched.step()
        torch.cuda.synchronize()

        la, lb = [v.item() for v in ref_losses], [v.item() for v in losses]
        assert lb[-1] < lb[0], "%s: trained: %g -> %g" % (recipe, lb[0], lb[-1])
        assert_tracks(la, lb, 1e-5, "%s: captured vs eager losses" % recipe)
        assert_params_close(model, ref, 1e-5, "%s: captured vs eager parameters" % recipe)
        assert [p.data_ptr() for p in model.parameters()] == pointers, "updated in place"
        for o in (opt, ref_opt):
            st = o.moonstep.stats()
            assert st["step"] == GRAPH_STEPS and st["skipped_steps"] == 0, st
            assert st["lr"] == 1e-2 * lr_factor(GRAPH_STEPS - 1), st      # the last step's (replay's) lr
        diff = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        print("     %s: %d replays; largest parameter difference from the eager run %.3g%s"
              % (recipe, GRAPH_STEPS - GRAPH_WARMUP, diff, " (bit for bit)" if diff == 0 else ""))
        del graph
        opt.moonstep.close()
        ref_opt.moonstep.close()


def checkpoint_tensors(opt):
    import moonstep
    tensors, _ = moonstep._read_safetensors(opt.moonstep.checkpoint_bytes())
    return tensors


@test({"torch", "cuda"})
def the_recorded_step_replays_bit_for_bit_between_torch_work():
    import moonstep
    steps, nan_at = 12, 6
    shapes = {"block.weight": (40, 24), "block.bias": (40,), "head.weight": (8, 40)}
    for recipe, options in GRAPH_RECIPES:
        gen = torch.Generator().manual_seed(41)
        start = {n: 0.5 * torch.randn(s, generator=gen) for n, s in shapes.items()}
        grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(steps)]
        grads[nan_at]["head.weight"][3, 5] = float("nan")

        def make():
            params = {n: torch.nn.Parameter(start[n].cuda()) for n in shapes}
            for p in params.values():
                p.grad = torch.zeros_like(p)       # registered now: the same buffers for every step
            opt = moonstep.TorchOptimizer(list(params.items()), recipe, lr=2e-2, options=options, capturable=True)
            return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

        ref, ref_opt, ref_sched = make()
        cap, opt, sched = make()
        src = {n: torch.empty_like(p) for n, p in cap.items()}
        snap = {n: torch.empty_like(p) for n, p in cap.items()}
        expect_moonstep_error("MS_E_ARG", "no step has been recorded into a CUDA graph", opt.prepare_replay)
        for params, o, sc in ((ref, ref_opt, ref_sched), (cap, opt, sched)):     # step 1, uncaptured
            for n, p in params.items():
                p.grad.copy_(grads[0][n])
            o.step()
            sc.step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for n, p in cap.items():
                p.grad.copy_(src[n])               # torch work the step must follow
            opt.step()
            for n, p in cap.items():
                snap[n].copy_(p)                   # torch work that must see the step's result
            expect_moonstep_error("MS_E_UNSUPPORTED", "being captured", opt.prepare_replay)
        for t in range(1, steps):
            before = {n: p.detach().clone() for n, p in cap.items()}
            for n, p in ref.items():
                p.grad.copy_(grads[t][n])
                src[n].copy_(grads[t][n])
            ref_opt.step()
            ref_sched.step()
            opt.prepare_replay()
            graph.replay()
            last = opt.moonstep.stats()["last"]
            assert last["step"] == t + 1 and last["lr"] == opt.param_groups[0]["lr"], (last, opt.param_groups[0]["lr"])
            sched.step()
            for n, p in cap.items():
                assert torch.equal(p, ref[n]), "%s: step %d: %s differs from the eager step" % (recipe, t + 1, n)
                assert torch.equal(snap[n], p), "%s: step %d: the torch copy after the step missed it" % (recipe, t + 1)
                if t == nan_at:
                    assert torch.equal(p, before[n]), "%s: the NaN step was not skipped" % recipe
                else:
                    assert torch.isfinite(p).all() and not torch.equal(p, before[n]), "%s: step %d moved %s" % (recipe, t + 1, n)
        for o in (opt, ref_opt):
            st = o.moonstep.stats()
            assert st["step"] == steps and st["skipped_steps"] == 1, st
        a, b = checkpoint_tensors(opt), checkpoint_tensors(ref_opt)
        assert sorted(a) == sorted(b) and len(a) >= 2, sorted(a)
        for name in a:
            assert a[name] == b[name], "%s: state %s differs" % (recipe, name)
        del graph
        opt.moonstep.close()
        ref_opt.moonstep.close()


@test({"torch", "cuda"})
def captures_are_refused_clearly_and_the_torch_capture_stays_valid():
    import moonstep
    x = torch.randn(32, 8, device="cuda")
    for capturable, warm, needle in ((True, False, "the first step cannot be captured"),
                                     (False, True, "capturable=True")):
        torch.manual_seed(5)
        model = torch.nn.Linear(8, 4).cuda()
        opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=1e-3, capturable=capturable)
        model(x).square().mean().backward()
        if warm:
            opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.graph(graph, stream=side):
                doubled = x * 2                     # torch work in the same capture
                opt.step()
        except moonstep.MoonstepError as e:
            assert e.status == "MS_E_UNSUPPORTED" and needle in str(e), "%s: %s" % (e.status, e)
        else:
            raise AssertionError("a step was recorded (capturable=%s, warm=%s)" % (capturable, warm))
        graph.replay()                              # the capture ended well: its torch work replays
        torch.cuda.synchronize()
        assert torch.equal(doubled, x * 2)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "nothing changed"
        assert opt.moonstep.stats()["step"] == (1 if warm else 0)
        opt.step()                                  # still usable
        assert opt.moonstep.stats()["step"] == (2 if warm else 1)
        del graph
        opt.moonstep.close()
    with_false = dict(capturable=True, settings={"device_checks": False})
    try:
        moonstep.TorchOptimizer(torch.nn.Linear(2, 2).cuda().named_parameters(), "adamw", **with_false)
    except ValueError as e:
        assert "device_checks" in str(e), e
    else:
        raise AssertionError("capturable=True with device_checks false was accepted")


@test({"torch"})
def prepare_replay_is_refused_for_a_cpu_optimizer():
    import moonstep
    torch.manual_seed(6)
    model = torch.nn.Linear(6, 3)
    opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=1e-3, capturable=True)
    before = [p.detach().clone() for p in model.parameters()]
    expect_moonstep_error("MS_E_UNSUPPORTED", "the optimizer runs on cpu, whose steps are never captured",
                          opt.prepare_replay)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "nothing changed"
    assert opt.moonstep.stats()["step"] == 0
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert opt.moonstep.stats()["step"] == 1 and not torch.equal(model.weight, before[0])


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
