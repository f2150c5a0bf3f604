#!/usr/bin/env python3
"""Second half of bench/sinkgd_parity.lua: runs the pinned baseline's sinkgd_step (bench/torch_baselines/sinkgd.py)
on the inputs moonstep saved and compares the updates and the power vectors u.  Exit status 1 when any check fails."""
import json, os, struct, sys
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_baselines"))
from sinkgd import sinkgd_step  # noqa: E402  (the pinned baseline)

DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load(path):   # a small safetensors reader: 8-byte header length, JSON header, raw little-endian data
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    meta = head.pop("__metadata__", {})
    out = {}
    for name, h in head.items():
        a, b = h["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DT[h["dtype"]]).reshape(h["shape"])
        out[name] = t
    return out, meta


def main():
    ts, meta = load(os.path.join(sys.argv[1], "parity.safetensors"))
    bad = 0
    for tag in meta["shapes"].split(","):
        for mode, bmode in (("base", "base"), ("spectral", "spec")):
            p0 = ts[tag + ".p"].cuda()
            g = ts[tag + ".g"].cuda()
            u = ts[tag + ".u"].cuda().clone()
            p = p0.clone()
            sinkgd_step(p, g, u, 1e-3, 5, 1e-8, bmode)
            d_ref = (p - p0).double()
            d_ms = (ts[tag + "." + mode + ".p"].cuda() - p0).double()
            err = (d_ms - d_ref).abs().max().item()
            scale = d_ref.abs().max().item()
            rel = err / scale if scale > 0 else err
            ok = rel <= 3e-2 and rel == rel
            bad += not ok
            print(f"  {tag:>12} {mode:>8}: max |dp - dp_torch| = {err:.3e}, largest update {scale:.3e}, "
                  f"ratio {rel:.2e}  {'ok' if ok else 'FAIL'}")
            # the persisted power vector: the baseline's new u (spectral; a unit vector per matrix, so the same
            # bound on its largest element), and untouched by a base step
            u_ms = ts[tag + "." + mode + ".u"].cuda()
            if mode == "base":
                ok = torch.equal(u_ms, ts[tag + ".u"].cuda())
                print(f"  {tag:>12} {mode:>8}: u unchanged  {'ok' if ok else 'FAIL'}")
            else:
                uerr = (u_ms.double() - u.double()).abs().max().item()
                uscale = u.double().abs().max().item()
                urel = uerr / uscale if uscale > 0 else uerr
                ok = urel <= 3e-2 and urel == urel
                print(f"  {tag:>12} {mode:>8}: max |u - u_torch| = {uerr:.3e}, largest |u| {uscale:.3e}, "
                      f"ratio {urel:.2e}  {'ok' if ok else 'FAIL'}")
            bad += not ok
    print(f"sinkgd parity with the pinned baseline: {'PASS' if bad == 0 else f'{bad} FAILED'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
