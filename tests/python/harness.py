"""What the NumPy test scripts of the Python bridge share (test_bridge.py, test_comm.py): the import of
python/moonstep from this checkout, NumPy or a clean skip, the test registry and runner, and the checks.

A script does `from harness import np, moonstep, test, assert_close, expect_status, run` after putting this
folder first on sys.path (Python does: it is the script's own folder), then `sys.exit(run())`.
"""
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

try:
    import numpy as np
except ImportError:
    print("numpy is missing: the bridge's NumPy tests need it")
    print("0 passed, 0 failed, 1 skipped")
    sys.exit(0)

import moonstep  # noqa: E402

TESTS = []


def test(fn):
    """Registers fn as a test (run in the order registered)."""
    TESTS.append(fn)
    return fn


def assert_close(got, want, rtol, atol, what):
    """|got - want| <= atol + rtol |want| elementwise, same shapes; NaN fails (the comparison is false)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, "%s: shape %s, want %s" % (what, got.shape, want.shape)
    err = np.abs(got - want)
    bound = atol + rtol * np.abs(want)
    if not np.all(err <= bound):
        worst = int(np.nanargmax(np.where(np.isnan(err), np.inf, err / bound)))
        raise AssertionError("%s: worst element %d: got %r, want %r (tolerance %g)"
                             % (what, worst, got.flat[worst], want.flat[worst], bound.flat[worst]))


def expect(exc, needle, fn, *args, **kwargs):
    """fn(...) raises exc with needle in its message; returns the exception."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert needle in str(e), "message lacks %r: %s" % (needle, e)
        return e
    raise AssertionError("no %s; wanted one with %r" % (exc.__name__, needle))


def expect_status(status, needle, fn, *args, **kwargs):
    """fn(...) fails with moonstep's status (e.g. "MS_E_SHAPE") and needle in its message."""
    e = expect(moonstep.MoonstepError, needle, fn, *args, **kwargs)
    assert e.status == status, "status %s, want %s (%s)" % (e.status, status, e)
    return e


def run():
    """Runs every registered test: one line each, then "N passed, N failed"; the exit status."""
    passed = failed = 0
    for fn in TESTS:
        try:
            fn()
            passed += 1
            print("ok   %s" % fn.__name__)
        except Exception:
            failed += 1
            print("FAIL %s\n%s" % (fn.__name__, traceback.format_exc()))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0
