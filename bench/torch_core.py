#!/usr/bin/env python3
"""PyTorch baselines for bench/core_bench.lua: the same shapes, dtypes and method, in their own process.

  python3 bench/torch_core.py [moonstep_results.json]

CUDA events around R back-to-back ops, median of 7 trials after a warm-up, inputs rotating over the same
number of buffer sets as the moonstep bench.  With moonstep's JSON (written by core_bench.lua in the same
command) it prints the comparison table of bench/RESULTS.md: time, floor, time/floor, PyTorch's time and
the speed ratio (PyTorch time / moonstep time).  Floors: bytes moved at the best copy bandwidth measured in
this command (moonstep's or PyTorch's), or flops at PyTorch's measured matrix rate.
"""
import json
import sys

import torch


def timed(fn, reps, trials=7):
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    ts, k = [], 0
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            k += 1
            fn(k)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / reps)
    ts.sort()
    return ts[(len(ts) - 1) // 2]


def main():
    dev = torch.device("cuda")
    torch.manual_seed(20261129)
    res = {}

    def record(name, ms, nbytes=None, flops=None):
        res[name] = {"name": name, "ms": ms, "bytes": nbytes, "flops": flops}
        rate = f"{nbytes / ms / 1e6:8.1f} GB/s" if nbytes else f"{flops / ms / 1e9:8.1f} TFLOP/s"
        print(f"  {name:<44} {ms:9.4f} ms  {rate}", flush=True)

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    n = 1 << 28
    src = [torch.rand(n, device=dev) for _ in range(2)]
    dst = [torch.empty(n, device=dev) for _ in range(2)]
    record("copy f32 1 GiB (d2d)", timed(lambda i: dst[i % 2].copy_(src[(i + 1) % 2]), 20), 2 * n * 4)
    del src, dst

    n = 1 << 26
    a, b, c, d = ([torch.randn(n, device=dev) for _ in range(3)] for _ in range(4))
    record("addcmul f32 64M (3 reads + 1 write)",
           timed(lambda i: torch.addcmul(a[i % 3], b[i % 3], c[i % 3], value=0.5, out=d[i % 3]), 30), 4 * n * 4)
    del a, b, c, d
    m = 1 << 27
    x, y, z = ([torch.randn(m, device=dev, dtype=torch.bfloat16) for _ in range(3)] for _ in range(3))
    record("lerp bf16 128M, device scalar (2 reads + 1 write)",
           timed(lambda i: torch.lerp(x[i % 3], y[i % 3], 0.1, out=z[i % 3]), 30), 3 * m * 2)
    del x, y, z

    n = 1 << 28
    xs = [torch.randn(n, device=dev) for _ in range(2)]
    s = torch.empty((), device=dev)
    record("sum f32 1 GiB (whole)", timed(lambda i: torch.sum(xs[i % 2], dim=0, out=s), 20), n * 4)
    mats = [x.view(16384, 16384) for x in xs]
    r = torch.empty(16384, device=dev)
    record("sum f32 16384x16384 along dim 1 (rows)", timed(lambda i: torch.sum(mats[i % 2], dim=1, out=r), 20),
           n * 4 + 16384 * 4)
    record("norm f32 16384x16384 along dim 0 (columns)",
           timed(lambda i: torch.linalg.vector_norm(mats[i % 2], dim=0, out=r), 20), n * 4 + 16384 * 4)
    del xs, mats

    def bench_mm(name, batch, n, dtype, tf32):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = [torch.randn(batch, n, n, device=dev, dtype=dtype) for _ in range(2)]
        b = [torch.randn(batch, n, n, device=dev, dtype=dtype) for _ in range(2)]
        d = torch.empty(batch, n, n, device=dev, dtype=dtype)
        record(name, timed(lambda i: torch.bmm(a[i % 2], b[i % 2], out=d), 10), flops=2 * batch * n ** 3)

    bench_mm("matmul bf16 16x4096x4096x4096", 16, 4096, torch.bfloat16, False)
    bench_mm("matmul f32 TF32 228x1024x1024x1024", 228, 1024, torch.float32, True)

    if len(sys.argv) < 2:
        return
    with open(sys.argv[1]) as f:
        ours = {r["name"]: r for r in json.load(f)["results"]}
    name = "copy f32 1 GiB (d2d)"
    copy_bw = max(ours[name]["bytes"] / ours[name]["ms"], res[name]["bytes"] / res[name]["ms"]) / 1e6  # GB/s
    print(f"\nfloors: copy bandwidth {copy_bw:.0f} GB/s (best of this command); matmul: PyTorch's rate\n")
    print("| op | moonstep ms | floor ms | moonstep / floor | moonstep rate | PyTorch ms | PyTorch / moonstep |")
    print("|---|---|---|---|---|---|---|")
    for name, t in res.items():
        o = ours.get(name)
        if o is None:
            continue
        if t["bytes"]:
            floor = t["bytes"] / copy_bw / 1e6
            rate = f"{o['bytes'] / o['ms'] / 1e6:.0f} GB/s ({o['bytes'] / o['ms'] / 1e6 / copy_bw:.0%} of copy)"
        else:
            floor = t["ms"]
            rate = f"{o['flops'] / o['ms'] / 1e9:.0f} TFLOP/s"
        print(f"| {name} | {o['ms']:.4f} | {floor:.4f} | {o['ms'] / floor:.2f} | {rate} | {t['ms']:.4f} | "
              f"{t['ms'] / o['ms']:.2f} |")


if __name__ == "__main__":
    main()
