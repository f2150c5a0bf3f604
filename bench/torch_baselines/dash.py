# Copied unchanged from ../shared/tools/torch_baselines/dash.py (the pinned baseline; the GPU host receives only the repository).
#!/usr/bin/env python3
"""PyTorch eager baselines for DASH's inverse-root solvers (root 4) on stacked factor blocks.

Run on the GPU host, in its own process:
  python3 dash.py [--blocks 228 --small 12] [--B 1024] [--spectrum controlled|random] [--tf32 1]
The stack is --blocks blocks of B plus --small blocks of B/2 (the subset of research/anchors-h200.md is 228 of
1024 and 12 of 512). "random": EMAs (beta 0.95) of G Gᵀ over 4 Gaussian steps (condition numbers near 10,
easy); "controlled": Q diag(λ) Qᵀ with each block's condition number log-uniform in [1e1, 1e7] and every
tenth block rank-deficient (half its eigenvalues zero), as real factors are. This times the solvers only
(root inversion is ~92% of DASH's step, research/dash.md §8). Reports per solver: time (CUDA events, median),
the GEMM floor (GEMM count x one batched GEMM of the same size, median of 20), and the error of the
normalized root (scalars cancel under DASH's grafting) against the f64 root of the same factor on 4
full-rank blocks, the reference damped by --ref-damping x lambda_max (see error()).
Semantics: research/dash.md §2–§3 (10 Newton steps, eps_inv_root 0 for NDB/CN, 1e-10 for EVD).
"""
import argparse, json
import torch


def timed(fn, reps):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def factors(n, b, spectrum, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if spectrum == "random":
        a = torch.zeros(n, b, b, device="cuda")
        for _ in range(4):
            x = torch.randn(n, b, b, device="cuda", generator=g)
            a.lerp_(torch.bmm(x, x.transpose(1, 2)), 0.05)
        return a
    q, _ = torch.linalg.qr(torch.randn(n, b, b, device="cuda", generator=g))
    kappa = 10 ** (1 + 6 * torch.rand(n, 1, device="cuda", generator=g))
    t = torch.linspace(0, 1, b, device="cuda").expand(n, b)
    lam = kappa ** (-t)                                 # from 1 down to 1/kappa, log-uniform
    lam[::10, b // 2:] = 0                              # rank-deficient blocks
    return torch.bmm(q * lam.unsqueeze(1), q.transpose(1, 2))


def scale_fro(a):
    return torch.linalg.matrix_norm(a).clamp_min(1e-30)[:, None, None]


def scale_pim(a, vecs=16, steps=10, const=2.0, damp=1e-6):
    a16 = (a + damp * torch.eye(a.shape[-1], device=a.device)).bfloat16()
    v = torch.randn(a.shape[0], a.shape[-1], vecs, device=a.device).bfloat16()
    for _ in range(steps):
        v = torch.nn.functional.normalize(torch.bmm(a16, v).float(), dim=1).bfloat16()
    lam = (v.float() * torch.bmm(a16, v).float()).sum(dim=1).max(dim=1).values
    return (const * lam).clamp_min(1e-30)[:, None, None]


def ndb(an, steps, want_sqrt):
    eye = torch.eye(an.shape[-1], device=an.device).expand_as(an)
    e = 1.5 * eye - 0.5 * an                            # first step: Z0 = I, one GEMM
    y, z = torch.bmm(an, e), e
    for _ in range(steps - 1):
        e = 1.5 * eye - 0.5 * torch.bmm(z, y)
        y, z = torch.bmm(y, e), torch.bmm(e, z)
    return y if want_sqrt else z


def ndb_root4(a, scaling, steps=10):
    s = scale_pim(a) if scaling == "pim" else scale_fro(a)
    return ndb(ndb(a / s, steps, True), steps, False)   # (A/s)^{-1/4}; s^{-1/4} cancels in grafting


def cn_root4(a, steps=10, p=4):
    s = scale_fro(a)
    eye = torch.eye(a.shape[-1], device=a.device).expand_as(a)
    z = (p + 1) / (2 * s)
    x, m = z ** (1.0 / p) * eye, z * a
    for _ in range(steps):
        nm = ((p + 1) * eye - m) / p
        x = torch.bmm(x, nm)
        n2 = torch.bmm(nm, nm)
        m = torch.bmm(n2, torch.bmm(n2, m))
    return x


def evd_root4(a, eps=1e-10, p=4):
    lam, q = torch.linalg.eigh(a + eps * torch.eye(a.shape[-1], device=a.device))
    lam = lam + eps - torch.clamp(lam.min(dim=-1, keepdim=True).values, max=0)
    return torch.bmm(q * lam.pow(-1.0 / p).unsqueeze(-2), q.transpose(1, 2))


SOLVERS = {"ndb_pim": (56, lambda a: ndb_root4(a, "pim")), "ndb_fro": (56, lambda a: ndb_root4(a, "fro")),
           "cn_fro": (40, cn_root4), "evd": (None, evd_root4)}


def error(a, x, rel_damping, k=4):
    """Error of the normalized root against the f64 root of the factor damped by rel_damping * lambda_max.

    Without damping, ill-conditioned blocks make the normalized root all about the smallest eigenvalues,
    which no f32 solver resolves (f32 eigh included); the solvers' implicit floor acts as relative damping.
    """
    idx = [i for i in range(a.shape[0]) if i % 10 != 0][:k]
    lam, q = torch.linalg.eigh(a[idx].double())
    lam = lam.clamp_min(0) + rel_damping * lam.max(dim=-1, keepdim=True).values
    ref = (q * lam.clamp_min(1e-300).pow(-0.25).unsqueeze(-2)) @ q.transpose(1, 2)
    xn = x[idx].double() / torch.linalg.matrix_norm(x[idx].double())[:, None, None]
    rn = ref / torch.linalg.matrix_norm(ref)[:, None, None]
    return (torch.linalg.matrix_norm(xn - rn) / torch.linalg.matrix_norm(rn)).max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=228)
    ap.add_argument("--small", type=int, default=12)
    ap.add_argument("--B", type=int, default=1024)
    ap.add_argument("--spectrum", choices=["controlled", "random"], default="controlled")
    ap.add_argument("--tf32", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--solvers", default="ndb_pim,ndb_fro,cn_fro,evd")
    ap.add_argument("--ref-damping", type=float, default=None,
                    help="relative damping of the f64 reference (default 0 for random spectra, 1e-3 for controlled)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = bool(a.tf32)
    damping = a.ref_damping if a.ref_damping is not None else (1e-3 if a.spectrum == "controlled" else 0.0)
    stacks = [factors(a.blocks, a.B, a.spectrum, 1)] + ([factors(a.small, a.B // 2, a.spectrum, 2)] if a.small else [])
    gemm = sum(timed(lambda: torch.bmm(s, s), 20) for s in stacks)
    print(json.dumps({"blocks": a.blocks, "small": a.small, "B": a.B, "spectrum": a.spectrum, "tf32": a.tf32,
                      "one_batched_gemm_ms": gemm}), flush=True)
    rows = []
    for name in a.solvers.split(","):
        count, fn = SOLVERS[name]
        if name == "evd":  # eigh is per block and slow: time 16 blocks of each stack and scale
            t = sum(timed(lambda: fn(s[:16]), 1) * s.shape[0] / min(16, s.shape[0]) for s in stacks)
        else:
            t = timed(lambda: [fn(s) for s in stacks], a.reps)
        row = {"solver": name, "ms": t, "gemm_floor_ms": count * gemm if count else None,
               "rel_err_normalized_root": error(stacks[0], fn(stacks[0][:40]), damping)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{a.blocks}x{a.B} + {a.small}x{a.B // 2}, {a.spectrum} spectra, tf32={a.tf32}, one batched GEMM {gemm:.2f} ms, "
          f"reference damping {damping:g} x lambda_max")
    for r in rows:
        fl = f"{r['gemm_floor_ms']:.1f}" if r["gemm_floor_ms"] else "-"
        print(f"{r['solver']:8s} {r['ms']:9.1f} ms  floor {fl:>7s} ms  err {r['rel_err_normalized_root']:.1e}")


if __name__ == "__main__":
    main()
