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
    from rubin_compile.kernels.triton.tune_moe import (
        SHAPES,
        make_routing,
        make_weights,
        persistent_candidates,
        reference,
        rel_error,
    )

    sh = SHAPES[shape]
    w = make_weights(sh["E"], sh["H"], sh["I"], wfmt, seed=3)
    x = torch.randn((T, sh["H"]), device="cuda", dtype=torch.bfloat16)
    tw, ids = make_routing(T, sh["E"], sh["k"])
    ref = reference(x, w, tw, ids, wfmt)
    for cfg in persistent_candidates(moe, T, wfmt):
        tag = json.dumps(cfg.to_json()["fc1"]) + " / " + json.dumps(cfg.to_json()["fc2"])
        print(f"{shape} {wfmt} T={T} running {tag}{' a_fp8' if cfg.a_fp8 else ''}", flush=True)
        err = rel_error(moe, cfg, x, w, tw, ids, ref)
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
        for s in ("qwen3-30b-a3b", "deepseek-v3-tp8", "mixtral-8x7b", "minimax-m2")
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
