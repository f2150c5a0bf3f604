# Copied unchanged from ../shared/tools/torch_baselines/sinkgd.py (the pinned baseline; the GPU host receives only the repository).
#!/usr/bin/env python3
"""PyTorch baselines for the SinkGD step, following research/sinkgd.md §2.5 (axolotl's compiled path).

Run on the GPU host, in its own process; prints one JSON object per shape and a table:
  python3 sinkgd.py [--shapes 4096x4096,8x1408x2048 | --set llama3-8b] [--iters 5] [--mode base|spec]
"eager" is the per-parameter formula; "compiled" is the same under torch.compile(fullgraph=True,
dynamic=False). lr 1e-3, weight decay 0, alpha 1 (match these in the benchmark you compare with). Inputs
rotate over several buffers so repeated timing does not measure the L2 cache (not for --set, which is far
larger than L2). Spectral mode: L-1 full iterations, then the row scale, the last column scale kept as an fp32
vector d, one warm-started power-iteration step with d folded into the vectors, unit target.
Floors at the copy bandwidth of the same run: base (L+1) reads of G + read and write of p; spectral adds two
reads of G for the power step.
"""
import argparse, json, math
import torch
from triton.testing import do_bench

SHAPES = "2048x2048,4096x4096,1024x4096,14336x4096,4096x14336,8x1408x2048"
LLAMA3_8B = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
             (14336, 4096), (14336, 4096), (4096, 14336)] * 32


def sinkgd_step(p, g, u, lr, iters, eps, mode):
    m, n = g.shape[-2], g.shape[-1]
    sqrt_n, sqrt_m = math.sqrt(n), math.sqrt(m)
    x = g
    full = iters if mode == "base" else max(iters - 1, 0)
    for _ in range(full):
        rn = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        x = x * (sqrt_n / rn.clamp_min(eps)).to(x.dtype)
        cn = torch.linalg.vector_norm(x, dim=-2, keepdim=True, dtype=torch.float32)
        x = x * (sqrt_m / cn.clamp_min(eps)).to(x.dtype)
    if mode == "base":
        p.copy_(p.float() - lr * x.float())
        return
    if iters > 0:
        rn = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        x = x * (sqrt_n / rn.clamp_min(eps)).to(x.dtype)
        d = sqrt_m / torch.linalg.vector_norm(x, dim=-2, keepdim=True, dtype=torch.float32).clamp_min(eps)
    else:
        d = torch.ones_like(x[..., :1, :], dtype=torch.float32)
    dv = d.squeeze(-2)
    v = torch.matmul(x, (dv * u).to(x.dtype).unsqueeze(-1)).squeeze(-1).float()
    v = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(eps)
    w = torch.matmul(v.to(x.dtype).unsqueeze(-2), x).squeeze(-2).float() * dv
    sigma = torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp_min(eps)
    u.copy_(w / sigma)
    scale = (1.0 / sigma.reshape(*sigma.shape[:-1], 1, 1)) * d
    p.copy_(p.float() - (lr * scale) * x.float())


def copy_bandwidth():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() / (t * 1e-3) / 1e9


def make(shape, dt):
    return (torch.randn(*shape, device="cuda", dtype=dt), torch.randn(*shape, device="cuda", dtype=dt),
            torch.nn.functional.normalize(torch.randn(*shape[:-2], shape[-1], device="cuda"), dim=-1))


def floors(nbytes, bw, iters, mode):
    passes = iters + 3 + (2 if mode == "spec" else 0)
    return 3 * nbytes / (bw * 1e9) * 1e3, passes * nbytes / (bw * 1e9) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--set", choices=["llama3-8b"], default=None, help="time a whole model's matrices as one step")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mode", choices=["base", "spec"], default="base")
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--rotate", type=int, default=4, help="input sets to rotate over")
    a = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    compiled = torch.compile(sinkgd_step, fullgraph=True, dynamic=False)
    rows = []
    if a.set:
        mats = [make(s, dt) for s in LLAMA3_8B]
        nbytes = sum(p.numel() * p.element_size() for p, _, _ in mats)
        def whole(fn):
            for p, g, u in mats:
                fn(p, g, u, 1e-3, a.iters, 1e-8, a.mode)
        f3, fl = floors(nbytes, bw, a.iters, a.mode)
        row = {"set": a.set, "matrices": len(mats), "dtype": a.dtype, "mode": a.mode, "iters": a.iters,
               "MB": nbytes / 1e6, "copy_GBps": bw, "floor_3pass_ms": f3, "floor_ms": fl,
               "eager_ms": do_bench(lambda: whole(sinkgd_step), warmup=200, rep=2000, return_mode="median"),
               "compiled_ms": do_bench(lambda: whole(compiled), warmup=2000, rep=2000, return_mode="median")}
        print(json.dumps(row), flush=True)
        print(f"\n{a.set}: {len(mats)} matrices, {nbytes/1e9:.1f} GB, floor {fl:.2f} ms, eager {row['eager_ms']:.2f} ms, "
              f"compiled {row['compiled_ms']:.2f} ms ({a.mode}, {a.dtype}, copy {bw:.0f} GB/s)")
        return
    for spec in a.shapes.split(","):
        shape = tuple(int(s) for s in spec.split("x"))
        sets = [make(shape, dt) for _ in range(a.rotate)]
        k = [0]

        def run(fn):
            p, g, u = sets[k[0] % a.rotate]; k[0] += 1
            fn(p, g, u, 1e-3, a.iters, 1e-8, a.mode)

        nbytes = sets[0][0].numel() * sets[0][0].element_size()
        f3, fl = floors(nbytes, bw, a.iters, a.mode)
        row = {"shape": spec, "dtype": a.dtype, "mode": a.mode, "iters": a.iters, "MB": nbytes / 1e6,
               "copy_GBps": bw, "floor_3pass_ms": f3, "floor_ms": fl,
               "eager_ms": do_bench(lambda: run(sinkgd_step), warmup=25, rep=200, return_mode="median"),
               "compiled_ms": do_bench(lambda: run(compiled), warmup=25, rep=200, return_mode="median")}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw:.0f} GB/s; {a.mode}, {a.dtype}, iters={a.iters}")
    print("shape | MB | floor 3-pass | floor | eager | compiled   (ms)")
    for r in rows:
        print(f"{r['shape']} | {r['MB']:.0f} | {r['floor_3pass_ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{r['eager_ms']:.3f} | {r['compiled_ms']:.3f}")


if __name__ == "__main__":
    main()
