"""The Python bridge (python/moonstep) on NumPy arrays: AdamW and SinkGD against f64 formulas written here, zero
copies (wrapped arrays and DLPack imports updated in place, DLPack memory released when the optimizer goes),
schedules, grad_scale, errors with their statuses, checkpoints and state dicts (moonstep's own and a
torch.optim.AdamW-style one), info and stats.

    python3 tests/python/test_bridge.py         (MOONSTEP_LIBRARY picks the library; default build/)

Prints one line per test and ends with "N passed, N failed"; exits 1 on a failure.  Without NumPy it says
so and prints "0 passed, 0 failed, 1 skipped".
"""
import gc
import math
import os
import sys
import tempfile
import weakref

from harness import assert_close, expect, expect_status, moonstep, np, run, test


def rng(seed):
    return np.random.default_rng(seed)


def expect_error(status, needle, fn, *args, **kwargs):
    return expect_status(status, needle, fn, *args, **kwargs)


def adamw_reference(p, m, v, g, t, lr, b1, b2, eps, wd):
    """One torch.optim.AdamW step in f64 (in place on p, m, v)."""
    p *= 1 - lr * wd
    m[:] = b1 * m + (1 - b1) * g
    v[:] = b2 * v + (1 - b2) * g * g
    p -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


# ---------------------------------------------------------------------------------------------------
@test
def adamw_matches_the_formula():
    r = rng(1)
    w = r.standard_normal((5, 7)).astype(np.float32)
    b = r.standard_normal(7).astype(np.float32)
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    opt = moonstep.Optimizer([("layer.weight", w, gw), ("layer.bias", b, gb, ["no_decay"])], "adamw",
                             {"lr": 0.01, "betas": [0.85, 0.99], "eps": 1e-7, "weight_decay": 0.1})
    ref = {"w": [w.astype(np.float64), np.zeros(w.shape), np.zeros(w.shape), 0.1],
           "b": [b.astype(np.float64), np.zeros(b.shape), np.zeros(b.shape), 0.0]}
    for t in range(1, 31):
        gw[:] = r.standard_normal(gw.shape) * (1 + t % 3)      # fresh gradients into the registered buffers
        gb[:] = r.standard_normal(gb.shape)
        assert opt.step() is True
        for key, g in (("w", gw), ("b", gb)):
            p, m, v, wd = ref[key]
            adamw_reference(p, m, v, g.astype(np.float64), t, 0.01, 0.85, 0.99, 1e-7, wd)
    assert_close(w, ref["w"][0], 1e-5, 1e-6, "weight")
    assert_close(b, ref["b"][0], 1e-5, 1e-6, "bias (no_decay: no weight decay)")
    opt.close()


@test
def wrapped_arrays_are_updated_in_place():
    r = rng(2)
    w = r.standard_normal((4, 6)).astype(np.float32)
    g_storage = r.standard_normal((6, 4)).astype(np.float32)
    g = g_storage.T                                   # a strided gradient (any layout is accepted)
    address, before = w.ctypes.data, w.copy()
    with moonstep.Optimizer({"w": (w, g)}, "sgd", {"lr": 0.5}) as opt:
        opt.step()
        assert w.ctypes.data == address
        assert_close(w, before - 0.5 * g, 1e-6, 1e-6, "SGD step seen through the array")
        g_storage *= 2                                # the trainer rewrites the same buffer
        before = w.copy()
        opt.step()
        assert_close(w, before - 0.5 * g, 1e-6, 1e-6, "the second step used the new gradient values")


@test
def sinkgd_matches_the_formula():
    r = rng(3)
    m_rows, n_cols, iters, alpha, lr, wd = 6, 5, 3, 0.5, 0.02, 0.01
    w = r.standard_normal((m_rows, n_cols)).astype(np.float32)
    g = np.zeros_like(w)
    opt = moonstep.Optimizer({"blocks.0.mlp.weight": (w, g)}, "sinkgd",
                             {"lr": lr, "sinkhorn_iters": iters, "sinkgd_lr_scale": alpha, "weight_decay": wd})
    assert opt.info()["params"][0]["route"] == "sinkgd"
    ref = w.astype(np.float64)
    for _ in range(5):
        g[:] = r.standard_normal(g.shape)
        opt.step()
        x = g.astype(np.float64)
        for _ in range(iters):                        # rows to norm sqrt(n), then columns to sqrt(m)
            x = math.sqrt(n_cols) * x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
            x = math.sqrt(m_rows) * x / np.maximum(np.linalg.norm(x, axis=0, keepdims=True), 1e-8)
        eta = lr * alpha
        ref = ref * (1 - eta * wd) - eta * x
    assert_close(w, ref, 1e-5, 1e-6, "SinkGD")
    opt.close()


@test
def schedule_set_lr_and_grad_scale():
    r = rng(4)
    w = r.standard_normal(8).astype(np.float32)
    g = np.zeros_like(w)
    opt = moonstep.Optimizer({"w": (w, g)}, "sgd", {"lr": 0.3},
                             {"schedule": {"kind": "cosine", "warmup_steps": 3, "total_steps": 13}})
    for t in range(1, 9):
        want = 0.3 * t / 3 if t <= 3 else 0.3 * 0.5 * (1 + math.cos(math.pi * (t - 3) / 10))
        assert abs(opt.lr - want) < 1e-12, (t, opt.lr, want)
        unscaled = r.standard_normal(8).astype(np.float32)
        g[:] = unscaled * 4                           # exact in f32
        before = w.copy()
        opt.step(grad_scale=4)
        assert_close(g, unscaled, 0, 0, "the gradients were unscaled in place")
        assert_close(w, before - want * unscaled.astype(np.float64), 1e-6, 1e-6, "step %d" % t)
    opt.lr = 0.05
    assert opt.lr == 0.05
    before = w.copy()
    opt.step(grads={"w": np.ones(8, np.float32)})    # a gradient given for this step
    assert_close(w, before - 0.05, 1e-6, 1e-6, "set lr and per-step grads")
    opt.close()


@test
def nonfinite_gradients_skip_the_step():
    w = np.ones(4, np.float32)
    g = np.array([1, np.nan, 1, 1], np.float32)
    opt = moonstep.Optimizer({"w": (w, g)}, "adamw")
    assert opt.step() is False
    assert np.all(w == 1)
    stats = opt.stats()
    assert stats["skipped_steps"] == 1 and stats["step"] == 0, stats
    opt.close()


@test
def errors_name_the_problem():
    w, g = np.ones(6, np.float32), np.ones(6, np.float32)
    expect_error("MS_E_ARG", "unknown option 'lrr'", moonstep.Optimizer, {"w": (w, g)}, "adamw", {"lrr": 1})
    expect_error("MS_E_ARG", "option 'lr'", moonstep.Optimizer, {"w": (w, g)}, "adamw", {"lr": "fast"})
    expect_error("MS_E_ARG", "option 'betas' needs 2 numbers", moonstep.Optimizer, {"w": (w, g)}, "adamw",
                 {"betas": [0.9]})
    # JSON has no NaN or infinity: named as the engine names a bad value, not as text that is not JSON
    expect_error("MS_E_ARG", "ms_optimizer_new: option 'lr': a finite number is needed (got nan)", moonstep.Optimizer,
                 {"w": (w, g)}, "adamw", {"lr": float("nan")})
    expect_error("MS_E_ARG", "option 'betas' item 2: a finite number is needed (got inf)", moonstep.Optimizer,
                 {"w": (w, g)}, "adamw", {"betas": (0.9, np.float32("inf"))})
    expect_error("MS_E_ARG", "setting 'clip_grad_norm': a finite number is needed (got -inf)", moonstep.Optimizer,
                 {"w": (w, g)}, "adamw", None, {"clip_grad_norm": np.array(-np.inf)})
    expect_error("MS_E_ARG", "unknown setting 'schedul'", moonstep.Optimizer, {"w": (w, g)}, "adamw", None,
                 {"schedul": "cosine"})
    expect_error("MS_E_ARG", "no recipe named \"adamv\"", moonstep.Optimizer, {"w": (w, g)}, "adamv")
    expect_error("MS_E_IO", "cannot read recipe", moonstep.Optimizer, {"w": (w, g)}, "/nonexistent/optim.lua")
    expect_error("MS_E_SHAPE", "grad shape [2,3] != param shape [6]", moonstep.Optimizer,
                 {"w": (w, np.ones((2, 3), np.float32))})
    expect_error("MS_E_DTYPE", "not a float dtype", moonstep.Optimizer, {"w": (w, np.ones(6, np.int32))})
    expect_error("MS_E_LAYOUT", "parameter 'w': ms_tensor_wrap: negative stride", moonstep.Optimizer,
                 {"w": (w[::-1], g)})
    expect_error("MS_E_LAYOUT", "gradient of 'w': ms_tensor_wrap: negative stride", moonstep.Optimizer,
                 {"w": (w, g[::-1])})
    # not an array: named for the first parameter too (whose device picks the context)
    for params in ({"w": ([1.0] * 6, g)}, {"w": (w, g), "v": ([1.0] * 6, None)}):
        e = expect(TypeError, "expected a NumPy array or a tensor with __dlpack__", moonstep.Optimizer, params)
        assert str(e).startswith("parameter '%s': " % list(params)[-1]), str(e)
    frozen = np.ones(6, np.float32)
    frozen.flags.writeable = False
    try:
        moonstep.Optimizer({"w": (frozen, g)})
        raise AssertionError("a read-only parameter was accepted")
    except ValueError as e:
        assert "read-only" in str(e)
    opt = moonstep.Optimizer({"w": (w, g)})
    expect_error("MS_E_ARG", "duplicate parameter name 'w'", opt.add_param, "w", w, g)
    expect_error("MS_E_SHAPE", "grad shape [5] != param shape [6]", opt.set_grad, "w", np.ones(5, np.float32))
    expect_error("MS_E_ARG", "lr must be a non-negative finite number", setattr, opt, "lr", -1.0)
    expect(TypeError, "lr must be a number (got 'fast')", setattr, opt, "lr", "fast")
    expect(TypeError, "lr must be a number (got None)", setattr, opt, "lr", None)
    opt.lr = np.float32(0.25)
    assert opt.lr == 0.25
    opt.close()


@test
def a_recipe_error_mid_step_is_an_error_not_a_crash():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "flaky.lua")
        with open(path, "w") as f:
            f.write('return {\n'
                    '  name = "flaky", version = 1,\n'
                    '  options = { lr = { default = 0.1, type = "number" } },\n'
                    '  route = function(p, o) return "plain" end,\n'
                    '  routes = { plain = { step = function(group, o, ctx)\n'
                    '    if ctx.step == 3 then error("no step 3 today") end\n'
                    '    for _, m in ipairs(group) do ms.addcmul(m.param, m.grad, ctx.lr_t, -1, m.param) end\n'
                    '  end } },\n'
                    '}\n')
        w, g = np.ones(3, np.float32), np.full(3, 0.5, np.float32)
        opt = moonstep.Optimizer({"w": (w, g)}, path)
        opt.step()
        opt.step()
        e = expect_error("MS_E_ARG", "flaky.lua:6: no step 3 today", opt.step)
        assert "stack traceback" in str(e)
        assert_close(w, np.full(3, 0.9), 1e-6, 1e-6, "two steps happened")
        assert opt.stats()["step"] == 2
        opt.close()


@test
def checkpoints_resume_bit_for_bit_and_corrupt_ones_are_refused():
    r = rng(5)
    w0 = r.standard_normal((3, 4)).astype(np.float32)
    grads = [r.standard_normal((3, 4)).astype(np.float32) for _ in range(12)]
    options = {"lr": 0.02, "weight_decay": 0.05}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "opt.safetensors")
        wa, ga = w0.copy(), np.zeros_like(w0)
        a = moonstep.Optimizer({"w": (wa, ga)}, "adamw", options)
        for g in grads[:5]:
            ga[:] = g
            a.step()
        a.save(path)
        wb, gb = wa.copy(), np.zeros_like(w0)
        b = moonstep.Optimizer({"w": (wb, gb)}, "adamw", options)
        expect_error("MS_E_IO", "cannot read checkpoint", b.load, os.path.join(d, "missing.safetensors"))
        data = open(path, "rb").read()
        bad = os.path.join(d, "bad.safetensors")
        open(bad, "wb").write(data[:len(data) // 2])
        expect_error("MS_E_FORMAT", "", b.load, bad)
        open(bad, "wb").write(b"\xff" * 8 + data[8:])
        expect_error("MS_E_FORMAT", "", b.load, bad)
        b.load(path)
        sd = b.state_dict()
        for g in grads[5:]:
            ga[:] = g
            gb[:] = g
            a.step()
            b.step()
        assert np.array_equal(wa, wb), "resumed bit for bit"
        # the state dict (bytes) restores the same point
        wc = wa.copy()
        c = moonstep.Optimizer({"w": (wc, np.zeros_like(w0))}, "adamw", options)
        c.load_state_dict(sd)
        assert c.stats()["step"] == 5
        for x in (a, b, c):
            x.close()


@test
def a_torch_adamw_state_dict_moves_over():
    r = rng(6)
    # sinkgd routes the matrix to SinkGD (no moments) and the bias to AdamW (f32 moments: a small tensor)
    w = r.standard_normal((4, 5)).astype(np.float32)
    b = r.standard_normal(5).astype(np.float32)
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    opt = moonstep.Optimizer([("proj.weight", w, gw), ("proj.bias", b, gb)], "sinkgd",
                             {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8})
    m_b, v_b = r.standard_normal(5) * 0.1, r.random(5) * 0.01 + 1e-3
    torch_like = {
        "state": {0: {"step": 7.0, "exp_avg": r.standard_normal((4, 5)), "exp_avg_sq": r.random((4, 5))},
                  1: {"step": 7.0, "exp_avg": m_b, "exp_avg_sq": v_b}},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "params": [0, 1]}],
    }
    report = opt.load_adamw_state(torch_like)
    assert report == {"loaded": ["proj.bias"], "kept": ["proj.weight"]}, report
    assert opt.stats()["step"] == 7
    ref = [b.astype(np.float64), m_b.astype(np.float32).astype(np.float64), v_b.astype(np.float32).astype(np.float64)]
    for t in range(8, 12):
        gw[:] = r.standard_normal(gw.shape)
        gb[:] = r.standard_normal(gb.shape)
        opt.step()
        adamw_reference(ref[0], ref[1], ref[2], gb.astype(np.float64), t, 0.01, 0.9, 0.99, 1e-8, 0.0)
    assert_close(b, ref[0], 1e-5, 1e-6, "AdamW continued from the torch moments and step")
    # by name, and refusals
    torch_like["param_groups"][0]["param_names"] = ["proj.bias", "proj.weight"]
    torch_like["state"] = {0: {"step": 2, "exp_avg": m_b, "exp_avg_sq": v_b}}
    assert opt.load_adamw_state(torch_like)["loaded"] == ["proj.bias"]
    opt.close()
    # moonstep keeps one step count: moments at different steps are refused
    x, y = np.ones(2, np.float32), np.ones(3, np.float32)
    opt = moonstep.Optimizer([("x", x, x.copy()), ("y", y, y.copy())], "adamw")
    try:
        opt.load_adamw_state({"state": {0: {"step": 2, "exp_avg": np.zeros(2), "exp_avg_sq": np.zeros(2)},
                                        1: {"step": 3, "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)}},
                              "param_groups": [{"params": [0, 1]}]})
        raise AssertionError("different steps were accepted")
    except ValueError as e:
        assert "different steps" in str(e), e
    opt.close()
    # 8-bit moments cannot take a torch state
    big = r.standard_normal(4096).astype(np.float32)
    opt = moonstep.Optimizer({"norm.weight": (big, np.zeros_like(big))}, "sinkgd")
    try:
        opt.load_adamw_state({"state": {0: {"step": 1, "exp_avg": np.zeros(4096), "exp_avg_sq": np.zeros(4096)}},
                              "param_groups": [{"params": [0]}]})
        raise AssertionError("an 8-bit state took a torch state")
    except ValueError as e:
        assert "8-bit" in str(e), e
    opt.close()


class DLPackOnly:
    """Exposes an array through the DLPack protocol alone (what a PyTorch or CuPy tensor offers)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@test
def dlpack_imports_share_memory_and_are_released():
    r = rng(7)
    w = r.standard_normal(10).astype(np.float32)
    g = r.standard_normal(10).astype(np.float32)
    alive = weakref.ref(w)
    before = w.copy()
    opt = moonstep.Optimizer({"w": (DLPackOnly(w), DLPackOnly(g))}, "sgd", {"lr": 0.25})
    opt.step()
    assert_close(w, before - 0.25 * g, 1e-6, 1e-6, "the DLPack import is the array's memory")
    view = w
    del w, view
    gc.collect()
    assert alive() is not None, "moonstep keeps the memory it imported"
    opt.close()
    gc.collect()
    assert alive() is None, "closing the optimizer released the DLPack import"
    # refusals name the parameter or gradient, not the engine's argument alone
    w = np.ones(4, np.float32)
    expect_error("MS_E_DTYPE", "gradient of 'w': ms_tensor_from_dlpack: managed's DLPack dtype", moonstep.Optimizer,
                 {"w": (DLPackOnly(w), DLPackOnly(np.ones(4, np.int64)))})

    class Spent(DLPackOnly):
        def __dlpack__(self, stream=None):
            return "not a capsule"
    expect(TypeError, "parameter 'w': __dlpack__() gave str, not an unused capsule named 'dltensor'",
           moonstep.Optimizer, {"w": (Spent(w), None)})
    expect(TypeError, "a parameter's name must be a non-empty string (got None)", moonstep.Optimizer,
           [(None, w, None)])


@test
def info_stats_tied_parameters_and_two_optimizers():
    r = rng(8)
    w = r.standard_normal((3, 3)).astype(np.float32)
    g = r.standard_normal((3, 3)).astype(np.float32)
    ctx = moonstep.Context("cpu", num_threads=1)
    opt = moonstep.Optimizer([("embed.weight", w, g), ("head.weight", w, g)], "adamw", context=ctx)
    other = moonstep.Optimizer({"x": (np.ones(2, np.float32), np.ones(2, np.float32))}, "sgd", context=ctx)
    opt.step()
    other.step()
    info = opt.info()
    tied = [p for p in info["params"] if p.get("tied_to")]
    assert tied == [{"name": "head.weight", "tied_to": "embed.weight", "route": "adamw", "state_bytes": 0}], tied
    assert info["total_state_bytes"] == 2 * 9 * 4, info
    stats = opt.stats()
    assert stats["step"] == 1 and stats["last"]["skipped"] is False and stats["last"]["grad_norm"] > 0, stats
    assert other.stats()["step"] == 1
    opt.close()
    other.close()
    ctx.close()


@test
def prepare_replay_is_refused_on_the_cpu_and_changes_nothing():
    # a CPU context records no CUDA graph, so there is no replay to prepare; bad grad_scales are named first
    r = rng(9)
    w = r.standard_normal(6).astype(np.float32)
    g = r.standard_normal(6).astype(np.float32)
    before = w.copy()
    opt = moonstep.Optimizer({"w": (w, g)}, "adamw", {"lr": 0.05, "weight_decay": 0.0}, {"device_checks": True})
    for bad in (-1.0, float("nan"), float("inf")):
        expect_error("MS_E_ARG", "ms_optimizer_prepare_replay_with: grad_scale must be a positive finite number",
                     opt.prepare_replay, grad_scale=bad)
    for bad in (True, "4", [4.0]):   # bool() or float() would take these
        expect(TypeError, "prepare_replay: grad_scale must be a number (got %r)" % (bad,), opt.prepare_replay,
               grad_scale=bad)
    for round_ in range(2):
        expect_error("MS_E_UNSUPPORTED", "the optimizer runs on cpu, whose steps are never captured into a CUDA graph",
                     opt.prepare_replay)
        expect_error("MS_E_UNSUPPORTED", "never captured", opt.prepare_replay, grad_scale=4.0)
        stats = opt.stats()
        assert stats["step"] == round_ and stats["lr"] == 0.05, stats
        assert np.array_equal(w, before), "a refused prepare_replay changed the parameters"
        assert opt.step() is None, "device-checked steps leave the skip decision to the device"
        assert np.all(np.isfinite(w)) and np.all(w != before), "the step after the refusals moved every element"
        before = w.copy()
    opt.close()


@test
def a_step_refused_for_a_bad_gradient_changes_nothing():
    a, b = np.ones(4, np.float32), np.ones(4, np.float32)
    ga, gb = np.ones(4, np.float32), np.ones(4, np.float32)
    opt = moonstep.Optimizer({"a": (a, ga), "b": (b, gb)}, "sgd", {"lr": 0.5})
    # a's new gradient is fine, b's has the wrong shape: the call fails, and a keeps its own gradient
    expect_error("MS_E_SHAPE", "grad shape [3] != param shape [4]", opt.step,
                 grads={"a": np.full(4, 9, np.float32), "b": np.ones(3, np.float32)})
    assert np.all(a == 1) and np.all(b == 1), "the refused step moved the parameters"
    assert opt.step() is True
    assert_close(a, np.full(4, 0.5), 0, 0, "a stepped on its own gradient (ones), not the refused call's")
    # the gradients are fine but the grad_scale is not: refused, and the gradients stay as they were too
    for bad in (float("nan"), -1.0, float("inf")):
        expect_error("MS_E_ARG", "grad_scale must be a positive finite number", opt.step,
                     grads={"a": np.full(4, 9, np.float32)}, grad_scale=bad)
    for bad in (True, "4"):
        expect(TypeError, "step: grad_scale must be a number (got %r)" % (bad,), opt.step,
               grads={"a": np.full(4, 9, np.float32)}, grad_scale=bad)
    assert_close(a, np.full(4, 0.5), 0, 0, "the refused steps moved the parameters")
    assert opt.step() is True
    assert_close(a, np.zeros(4), 0, 0, "a stepped on its own gradient (ones), not a refused call's")
    opt.close()


@test
def tied_parameters_have_one_gradient_given_through_any_name():
    r = rng(14)
    w = r.standard_normal((3, 4)).astype(np.float32)
    ga, gb, g3 = (r.standard_normal((3, 4)).astype(np.float32) for _ in range(3))
    # two different gradients for one tensor: refused (the step would use one of them)
    expect_error("MS_E_ARG", "parameters 'embed' and 'head' are tied (one tensor) but were given different gradients",
                 moonstep.Optimizer, [("embed", w, ga), ("head", w, gb)], "sgd")
    # the gradient given through the second name only is the tie's
    opt = moonstep.Optimizer([("embed", w, None), ("head", w, ga)], "sgd", {"lr": 0.5})
    before = w.copy()
    assert opt.step() is True
    assert_close(w, before - 0.5 * ga, 0, 0, "the tie stepped on the gradient given through 'head'")
    for _ in range(2):   # refused at every step, changing nothing
        before = w.copy()
        expect_error("MS_E_ARG", "are tied (one tensor) but were given different gradients", opt.step,
                     grads={"embed": gb, "head": g3})
        assert np.array_equal(w, before), "the refused step moved the tie"
    assert opt.step(grads={"embed": g3}) is True
    assert_close(w, before - 0.5 * g3, 0, 0, "the step's gradient, through 'embed'")
    before = w.copy()
    assert opt.step() is True
    assert_close(w, before - 0.5 * ga, 0, 0, "afterwards the tie's registered gradient again")
    opt.close()


@test
def step_grads_serve_that_step_only():
    # they stayed registered: the next plain step applied them again
    r = rng(15)
    w, b = r.standard_normal(5).astype(np.float32), r.standard_normal(5).astype(np.float32)
    gw, g1, g2 = (r.standard_normal(5).astype(np.float32) for _ in range(3))
    opt = moonstep.Optimizer([("w", w, gw), ("b", b, None)], "sgd", {"lr": 0.5})
    w0, b0 = w.copy(), b.copy()
    assert opt.step(grads={"w": g1, "b": g2}) is True
    assert_close(w, w0 - 0.5 * g1, 0, 0, "w on this step's gradient")
    assert_close(b, b0 - 0.5 * g2, 0, 0, "b on this step's gradient")
    w0, b0 = w.copy(), b.copy()
    assert opt.step() is True
    assert_close(w, w0 - 0.5 * gw, 0, 0, "w on its registered gradient again")
    assert np.array_equal(b, b0), "b has no gradient of its own: left alone"
    assert opt.step(grads={"w": None}) is True          # no gradient for w this step
    assert np.array_equal(w, w0 - 0.5 * gw), "w given none this step moved"
    expect_error("MS_E_ARG", "no parameter named 'v'", opt.step, grads={"v": g1})
    expect(TypeError, "grads must be a dict", opt.step, grads=[g1])
    opt.close()


@test
def step_grads_import_only_the_given_gradients():
    # the registered gradients come back after the step from the handles kept for them: each step(grads=)
    # imports what it is given, once (it also imported every registered gradient again, each step)
    r = rng(16)
    ps = [r.standard_normal(6).astype(np.float32) for _ in range(3)]
    gs = [r.standard_normal(6).astype(np.float32) for _ in range(3)]
    opt = moonstep.Optimizer([("p%d" % i, ps[i], gs[i]) for i in range(3)], "sgd", {"lr": 0.25})
    real, calls = moonstep._import, []
    moonstep._import = lambda *a: calls.append(a[2]) or real(*a)
    try:
        for k in range(3):
            g = r.standard_normal(6).astype(np.float32)
            before = ps[1].copy()
            assert opt.step(grads={"p1": g}) is True
            assert_close(ps[1], before - 0.25 * g, 0, 0, "p1 on this step's gradient")
            assert calls == ["gradient of 'p1'"] * (k + 1), "imports: %r" % (calls,)
        opt.set_grad("p1", None)                      # then none registered: none comes back either
        assert opt.step(grads={"p1": r.standard_normal(6).astype(np.float32)}) is True
        before = [x.copy() for x in ps]
        assert opt.step() is True
        assert np.array_equal(ps[1], before[1]), "p1 has no registered gradient: left alone"
        assert_close(ps[2], before[2] - 0.25 * gs[2], 0, 0, "p2 on its registered gradient")
    finally:
        moonstep._import = real
    opt.close()


@test
def an_expanded_gradient_is_refused_when_handed_over():
    # steps rescale gradients in place: a writable array whose rows share memory failed only at such a step
    w, g = np.ones((4, 3), np.float32), np.ones((4, 3), np.float32)
    row = np.arange(3, dtype=np.float32)
    wide = np.lib.stride_tricks.as_strided(row, shape=(4, 3), strides=(0, 4))
    expect_error("MS_E_LAYOUT", "parameter 'w': grad [4,3] has strides [0,1]", moonstep.Optimizer, {"w": (w, wide)})
    opt = moonstep.Optimizer({"w": (w, g)}, "sgd", {"lr": 0.5})
    expect_error("MS_E_LAYOUT", "must be writable", opt.set_grad, "w", wide)
    expect_error("MS_E_LAYOUT", "must be writable", opt.step, grads={"w": wide}, grad_scale=2.0)
    assert np.all(w == 1), "a refused step moved w"
    assert opt.step() is True and np.all(w == 0.5), "w stepped on its own gradient"
    opt.close()


@test
def bad_tags_and_option_values_are_named():
    w, g = np.ones(6, np.float32), np.ones(6, np.float32)
    expect(TypeError, "parameter 'w': tags[1] must be a string (got int)", moonstep.Optimizer,
           {"w": {"param": w, "grad": g, "tags": ["no_decay", 3]}})
    expect(TypeError, "parameter 'w': tags must be a list of strings or a comma-separated string (got int)",
           moonstep.Optimizer, {"w": {"param": w, "grad": g, "tags": 5}})
    expect(ValueError, "parameter 'w': tags[0] 'a,b' holds a comma", moonstep.Optimizer,
           {"w": {"param": w, "grad": g, "tags": ["a,b"]}})
    # a value JSON cannot hold is named as a bad value is, with the option (the message named neither)
    expect_error("MS_E_ARG", "ms_optimizer_new: option 'betas': a value of type set cannot be written as JSON",
                 moonstep.Optimizer, {"w": (w, g)}, "adamw", {"betas": {0.9, 0.99}})
    expect_error("MS_E_ARG", "setting 'schedule' ['kind']: a value of type object cannot be written",
                 moonstep.Optimizer, {"w": (w, g)}, "adamw", None, {"schedule": {"kind": object()}})
    expect(TypeError, "options must be a dict", moonstep.Optimizer, {"w": (w, g)}, "adamw", "lr=1")
    with moonstep.Optimizer({"w": {"param": w, "grad": g, "tags": "no_decay, extra"}}) as opt:   # text: as it is
        assert opt.step() is True


@test
def closing_the_context_under_an_open_optimizer_is_refused():
    ctx = moonstep.Context("cpu")
    w, g = np.ones(4, np.float32), np.ones(4, np.float32)
    opt = moonstep.Optimizer({"w": (w, g)}, "sgd", {"lr": 0.5}, context=ctx)
    try:
        ctx.close()
    except ValueError as e:
        assert "close the optimizer first" in str(e), str(e)
    else:
        raise AssertionError("Context.close() under an open optimizer was allowed")
    opt.set_grad("w", np.full(4, 2, np.float32))    # the optimizer still wraps its tensors on ctx
    assert opt.step() is True
    assert_close(w, np.zeros(4), 0, 0, "one step on the new gradient")
    opt.close()
    ctx.close()                                      # once the optimizer is closed
    assert "closed" in repr(ctx)


@test
def a_refused_optimizer_leaves_its_context_free_to_close():
    # the constructor's optimizer was made before a bad parameter was refused: while the caller kept the error
    # (its traceback holds the half-made optimizer), Context.close() was refused under it
    ctx = moonstep.Context("cpu")
    err = None
    try:
        moonstep.Optimizer({"a": (np.ones(2, np.float32), None), "b": (np.ones(2, np.int64), None)}, context=ctx)
    except TypeError as e:
        err = e
    assert err is not None and "parameter 'b'" in str(err), err
    ctx.close()
    assert "closed" in repr(ctx)


@test
def a_closed_context_says_so():
    # as a closed Optimizer or Comm does: its properties read no freed handle (device was "(null)"), and an
    # optimizer or communicator is not made on it (the engine's "ctx is NULL" named no cause)
    ctx = moonstep.Context("cpu")
    ctx.close()
    for call in (lambda: ctx.device, lambda: ctx.is_cuda, lambda: ctx.index, lambda: ctx.stream, ctx.sync,
                 lambda: moonstep.Optimizer({"w": (np.ones(4, np.float32), None)}, "sgd", context=ctx),
                 lambda: moonstep.Comm(0, 1, context=ctx)):
        try:
            call()
        except ValueError as e:
            assert str(e) == "the context is closed", str(e)
        else:
            raise AssertionError("a closed context was used")
    assert repr(ctx) == "moonstep.Context(closed)"
    ctx.close()                                      # idempotent


@test
def a_read_only_gradient_is_refused_since_steps_rescale_gradients_in_place():
    # clipping and grad_scale divide the gradients in place: a read-only array (here the memory of an immutable
    # bytes object) must not be handed over, neither at add_param nor at set_grad or step(grads=)
    raw = np.full(4, 10, np.float32).tobytes()
    frozen = np.frombuffer(raw, np.float32)
    w = np.ones(4, np.float32)
    opt = moonstep.Optimizer({"w": (w, None)}, "sgd", {"lr": 0.1}, {"clip_grad_norm": 1.0})
    for call in (lambda: moonstep.Optimizer({"w": (w, frozen)}, "sgd", {"lr": 0.1}, {"clip_grad_norm": 1.0}),
                 lambda: opt.set_grad("w", frozen), lambda: opt.step(grads={"w": frozen})):
        try:
            call()
            raise AssertionError("a read-only gradient was accepted")
        except ValueError as e:
            assert "read-only" in str(e), str(e)
    assert raw == np.full(4, 10, np.float32).tobytes(), "the read-only gradient's memory was written"
    assert np.all(w == 1)
    opt.close()


@test
def save_and_load_take_any_filesystem_path():
    # os.fspath gives str or bytes; a name that is not UTF-8 decodes to surrogates (os.fsdecode): all are paths
    import pathlib
    w, g = np.zeros(4, np.float32), np.ones(4, np.float32)
    opt = moonstep.Optimizer({"w": (w, g)}, "adamw", {"lr": 0.1})
    opt.step()
    with tempfile.TemporaryDirectory() as d:
        for path in (pathlib.Path(d, "caf\u00e9.safetensors"), os.path.join(d, "caf\u00e9.safetensors").encode(),
                     os.fsdecode(os.path.join(d.encode(), b"x\xff.safetensors")),
                     os.path.join(d.encode(), b"raw\xff.safetensors")):
            opt.save(path)
            assert os.path.exists(path), path
            opt.load(path)
        assert opt.stats()["step"] == 1
    opt.close()


@test
def nul_characters_are_refused_not_cut_short():
    # the library reads its strings up to the first NUL: "layer\0.weight" was registered as "layer", a recipe
    # "adamw\0-x" ran adamw, save("ckpt.st\0.tmp") wrote ckpt.st; each is refused, naming the argument
    w, g = np.ones(4, np.float32), np.ones(4, np.float32)
    expect(ValueError, "a parameter's name must not hold a NUL character (got 'layer\\x00.weight')",
           moonstep.Optimizer, {"layer\0.weight": (w, g)})
    expect(ValueError, "recipe must not hold a NUL character (got 'adamw\\x00-experimental')", moonstep.Optimizer,
           {"w": (w, g)}, "adamw\0-experimental")
    expect(ValueError, "parameter 'w': tags must not hold a NUL character", moonstep.Optimizer,
           {"w": {"param": w, "grad": g, "tags": "no_decay\0,x"}})
    expect(ValueError, "parameter 'w': tags[1] must not hold a NUL character (got 'x\\x00y')", moonstep.Optimizer,
           {"w": {"param": w, "grad": g, "tags": ["no_decay", "x\0y"]}})
    expect(ValueError, "device must not hold a NUL character", moonstep.Context, "cpu\0:1")
    opt = moonstep.Optimizer({"w": (w, g)}, "adamw", {"lr": 0.1})
    expect(ValueError, "a parameter's name must not hold a NUL character", opt.add_param, "v\0", np.ones(2, np.float32))
    expect(ValueError, "name must not hold a NUL character", opt.set_grad, "w\0", g)
    opt.step()
    with tempfile.TemporaryDirectory() as d:
        for path in (os.path.join(d, "ckpt.st\0.tmp"), os.path.join(d, "ckpt.st\0.tmp").encode()):
            expect(ValueError, "path must not hold a NUL character", opt.save, path)
            expect(ValueError, "path must not hold a NUL character", opt.load, path)
        assert os.listdir(d) == [], os.listdir(d)
    assert opt.names == ["w"] and [p["name"] for p in opt.info()["params"]] == ["w"], opt.info()["params"]
    assert opt.stats()["step"] == 1
    opt.close()


@test
def arguments_of_the_wrong_type_are_named():
    w, g = np.ones(4, np.float32), np.ones(4, np.float32)
    # NumPy dtypes: the message lists what parameters and gradients may be (int32 and uint8 are refused too)
    e = expect(TypeError, "parameter 'w': dtype int64 is not one of float32, float64, bfloat16, float16",
               moonstep.Optimizer, {"w": (np.ones(4, np.int64), None)})
    assert "int32" not in str(e) and "uint8" not in str(e), str(e)
    for dtype in (np.int32, np.uint8):
        expect_error("MS_E_DTYPE", "not a float dtype", moonstep.Optimizer, {"w": (np.ones(4, dtype), None)})
    expect(TypeError, "context must be a moonstep.Context (got str)", moonstep.Optimizer, {"w": (w, g)},
           context="cpu")
    expect(TypeError, "num_threads must be an integer (got '4')", moonstep.Context, "cpu", num_threads="4")
    expect(TypeError, "mem_limit must be an integer (got 1.5)", moonstep.Context, "cpu", mem_limit=1.5)
    expect(TypeError, "stream must be an integer (got 'x')", moonstep.Context, "cpu", stream="x")
    with moonstep.Optimizer({"w": (w, g)}, "sgd", {"lr": 0.5}) as opt:
        expect(TypeError, "lr must be a number (got array([0.1])", setattr, opt, "lr", np.array([0.1]))
        assert opt.lr == 0.5
        data = opt.checkpoint_bytes()
        for bad in ("abc", 16, None):
            expect(TypeError, "load_checkpoint_bytes: data must be bytes-like (bytes, bytearray, memoryview; got %s)"
                   % type(bad).__name__, opt.load_checkpoint_bytes, bad)
        opt.step()
        for good in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
            opt.load_checkpoint_bytes(good)
            assert opt.stats()["step"] == 0
    ctx = moonstep.Context("cpu", num_threads=np.int64(2), mem_limit=1 << 30)
    assert ctx.device == "cpu"
    ctx.close()


@test
def closing_from_another_thread_while_it_is_used_does_not_crash():
    # close() freed the handle before forgetting it: a thread between reading the handle and the library's call
    # (opt.lr, a step, its _restore_grad's kept gradient handles) used freed memory (a segfault); now one lock
    # per object orders them, and the other thread's later calls say "... is closed"
    import threading
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                   # switch threads as often as possible
    try:
        for trial in range(40):
            w, g = np.ones(256, np.float32), np.ones(256, np.float32)
            ctx = moonstep.Context("cpu")
            opt = moonstep.Optimizer({"w": (w, g), "v": (np.ones(8, np.float32), np.ones(8, np.float32))},
                                     "adamw", {"lr": 1e-3}, context=ctx)
            comm = moonstep.Comm(0, 1, context=moonstep.Context("cpu"), timeout=5)
            started, errors = threading.Event(), []

            def use(calls, what):
                started.set()
                try:
                    for _ in range(100):
                        for call in calls:
                            call()
                except Exception as e:          # anything but the closed object's ValueError is wrong
                    if not (isinstance(e, ValueError) and str(e) == "the %s is closed" % what):
                        errors.append(e)

            threads = [threading.Thread(target=use, args=(calls, what)) for calls, what in (
                ((lambda: opt.lr, opt.step, lambda: opt.step(grads={"w": g}), lambda: opt.set_grad("v", None)),
                 "optimizer"),
                ((lambda: ctx.device, lambda: ctx.index, ctx.sync), "context"),
                ((lambda: comm.rank, lambda: comm.world_size), "communicator"))]
            for t in threads:
                t.start()
            started.wait()
            for _ in range(trial % 4 * 20):      # let them run a little before closing
                pass
            opt.close()
            ctx.close()
            comm.close()
            for t in threads:
                t.join()
            comm.context.close()
            assert not errors, errors
    finally:
        sys.setswitchinterval(interval)


# ---------------------------------------------------------------------------------------------------
# 8-bit AdamW moments against torchao's AdamW8bit, written here from its definitions (torchao/optim:
# quant_utils.py create_dynamic_map, scale_tensor, quantize_8bit_with_qmap, dequant_with_qmap; adam.py
# single_param_adam), in f32 as torch computes them
def dynamic_map(signed):
    # the map's values computed in f64 and rounded once (moonstep.h, ms_adamw8_qmap: torch's own f32 arithmetic
    # can differ in the last bit or two of some codes)
    values = [0.0, 1.0]
    for k in range(7):
        cells = 2 ** k if signed else 2 ** (k + 1)
        for i in range(cells):
            mid = 10.0 ** (k - 6) * (0.1 + 0.9 * (i + 0.5) / cells)
            values += [mid, -mid] if signed else [mid]
    return np.array(sorted(values), dtype=np.float32)


def torchao_quantize(x, qmap, block):
    """scale_tensor + quantize_8bit_with_qmap: absmax scales (clipped at 1e-12), then the 8-step search for the
    largest code <= y and the step up to the next code from half way on."""
    f = np.float32
    xb = x.reshape(-1, block)
    scale = np.maximum(np.abs(xb).max(axis=1), f(1e-12)).astype(np.float32)
    y = (xb / scale[:, None]).astype(np.float32)
    codes = np.where(y >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes = codes + np.where(y >= qmap[codes + step], step, 0)
    up = np.minimum(codes + 1, 255)
    lo, hi = qmap[codes], qmap[up]
    codes = np.where((y - lo).astype(np.float32) >= ((hi - lo) * f(0.5)).astype(np.float32), up, codes)
    return codes.astype(np.uint8).reshape(x.shape), scale


def torch_lerp(a, b, w):
    """torch.lerp in f32: a + w (b - a) for w < 0.5, else b - (b - a) (1 - w)."""
    w = np.float32(w)
    if w < 0.5:
        return (a + w * (b - a)).astype(np.float32)
    return (b - (b - a) * (np.float32(1) - w)).astype(np.float32)


@test
def adamw8_moments_step_as_torchao_adamw8bit():
    # SinkGD's AdamW route keeps an 8-bit-eligible tensor (>= 4096 elements, whole blocks of 256) in 8 bits.
    # Each step starts torchao's formulas from moonstep's own state (read from its checkpoint), so nothing drifts:
    # the codes must be torchao's but where f32 rounding puts y at a rounding threshold (then one code apart),
    # the scales its, and the parameter its to f32 rounding (moonstep folds lr / bc1 in f64 and blends the
    # moments as b m + (1 - b) g rather than lerp: a few ulps).
    f, block = np.float32, 256
    qs, qu = dynamic_map(True), dynamic_map(False)
    r = rng(21)
    w = r.standard_normal((64, 128)).astype(np.float32)
    g = np.zeros_like(w)
    lr, b1, b2, eps = 3e-3, 0.9, 0.95, 1e-8
    opt = moonstep.Optimizer([("lm_head.weight", w, g)], "sinkgd", {"lr": lr, "betas": [b1, b2], "eps": eps})

    def state():
        tensors, _ = moonstep._read_safetensors(opt.checkpoint_bytes())
        out = {}
        for key, dt in (("exp_avg", np.uint8), ("exp_avg_sq", np.uint8), ("exp_avg_scale", np.float32),
                        ("exp_avg_sq_scale", np.float32)):
            dtype, shape, raw = tensors["param/lm_head.weight/" + key]
            assert dtype == ("U8" if dt is np.uint8 else "F32"), (key, dtype)
            out[key] = np.frombuffer(raw, dt).reshape(shape)
        return out

    differing = 0
    for t in range(1, 31):
        s, p = state(), w.copy()
        g[:] = r.standard_normal(g.shape) * (1e-3 if t % 3 == 0 else 1.0)   # scales of both kinds
        assert opt.step() is True
        # torchao, from the same state: dequantize, lerp, requantize; the update from the unquantized moments
        m_old = (qs[s["exp_avg"].astype(int)].reshape(-1, block) * s["exp_avg_scale"][:, None]).reshape(w.shape)
        v_old = (qu[s["exp_avg_sq"].astype(int)].reshape(-1, block) * s["exp_avg_sq_scale"][:, None]).reshape(w.shape)
        m = torch_lerp(m_old.astype(np.float32), g, 1 - b1)
        v = torch_lerp(v_old.astype(np.float32), (g * g).astype(np.float32), 1 - b2)
        bc1 = f(1) - np.power(f(b1), f(t), dtype=np.float32)
        bc2 = f(1) - np.power(f(b2), f(t), dtype=np.float32)
        denom = (np.sqrt(v) / np.sqrt(bc2) + f(eps)).astype(np.float32)
        update = (f(lr) * (m / bc1).astype(np.float32) / denom).astype(np.float32)
        want_p = (p - update).astype(np.float32)
        err = np.abs(w - want_p) - 2 * np.spacing(np.abs(want_p))
        assert (err <= 4e-6 * np.abs(update)).all(), \
            "step %d: parameter off torchao's by %.3g of the update" % (t, (err / np.abs(update)).max())
        got = state()
        for key, x, qmap in (("exp_avg", m, qs), ("exp_avg_sq", v, qu)):
            codes, scale = torchao_quantize(x, qmap, block)
            assert_close(got[key + "_scale"], scale, 1e-6, 0, "step %d %s scales" % (t, key))
            delta = np.abs(got[key].astype(int) - codes.astype(int))
            assert delta.max() <= 1, "step %d %s: a code %d away from torchao's" % (t, key, delta.max())
            differing += int((delta > 0).sum())
    assert differing <= 2 * w.size * 30 // 10000, "%d codes differ from torchao's" % differing
    opt.close()


@test
def the_module_docstring_example_runs_as_written():
    # the example at the top of moonstep's docstring (help(moonstep)), its indented block, run on the CPU
    import textwrap
    lines = moonstep.__doc__.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    scope = {}
    exec(compile(textwrap.dedent("\n".join(lines[start:end])), "moonstep.__doc__", "exec"), scope)
    assert scope["opt"].stats()["step"] == 500
    scope["opt"].close()


def main():
    return run()


if __name__ == "__main__":
    sys.exit(main())
