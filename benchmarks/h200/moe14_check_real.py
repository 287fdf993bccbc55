"""Issue 14 GPU check: every persistent tile of the tuner at a benchmark shape's real size, against the float32
reference, one process per (shape, format) so that a fault names its shape and the last config printed before it
(CUDA_LAUNCH_BLOCKING). The GPU tests cover the tiles at small shapes; this covers the sizes the tuner times.
    python3 benchmarks/h200/moe14_check_real.py [--tokens 4096]            # spawns the children
"""

import argparse
import json
import os
import subprocess
import sys

import torch


def child(shape: str, wfmt: str, T: int) -> None:
    from rubin_compile.kernels.triton import moe
    from rubin_compile.kernels.triton.tune_moe import SHAPES, make_routing, make_weights, persistent_candidates
    from rubin_compile.ops.moe import moe_reference

    sh = SHAPES[shape]
    E, H, I, k = sh["E"], sh["H"], sh["I"], sh["k"]
    w = make_weights(E, H, I, wfmt, seed=3)
    x = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    tw, ids = make_routing(T, E, k)
    up = (lambda t: t.float()) if wfmt == "bf16" else (lambda t: t)
    ref = moe_reference(
        x.float(),
        up(w["w13"]),
        up(w["w2"]),
        tw,
        ids,
        w13_scale=w.get("w13_scale"),
        w2_scale=w.get("w2_scale"),
        block_shape=w.get("block_shape"),
    )
    for cfg in persistent_candidates(moe, T, wfmt):
        tag = json.dumps(cfg.to_json()["fc1"]) + " / " + json.dumps(cfg.to_json()["fc2"])
        print(f"{shape} {wfmt} T={T} running {tag}", flush=True)
        got = moe.fused_moe(
            x,
            w["w13"],
            w["w2"],
            tw,
            ids,
            config=cfg,
            w13_scale=w.get("w13_scale"),
            w2_scale=w.get("w2_scale"),
            block_shape=w.get("block_shape"),
        )
        torch.cuda.synchronize()
        err = ((got.float() - ref).norm() / ref.norm()).item()
        print(f"{shape} {wfmt} T={T} rel err {err:.2e} {'OK' if err < 6e-2 else 'WRONG'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], int(a.child[2]))
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", s, wf, str(a.tokens)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for s in ("qwen3-30b-a3b", "deepseek-v3-tp8", "mixtral-8x7b")
        for wf in ("bf16", "fp8_block")
    ]
    for p in procs:
        out, _ = p.communicate()
        lines = out.splitlines()
        keep = [ln for ln in lines if " rel err " in ln or " running " in ln]
        print("\n".join(keep[-16:]))
        if p.returncode:
            print(f"  exit {p.returncode}: " + " | ".join(ln for ln in lines[-4:])[:600])


if __name__ == "__main__":
    main()
