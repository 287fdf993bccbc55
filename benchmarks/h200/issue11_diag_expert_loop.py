"""Issue 11 diagnosis: why the expert loop of tests/gpu/test_select_kernels_gpu.py is not matched on the H200
(each activation's pattern failure at expert 0's body)."""

import subprocess

import torch
from rubin_compile.passes.match_moe import expert_loop as EL
from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

orig = EL._match_body


def spy(node, dtype):
    from torch._inductor.pattern_matcher import Match

    out = orig(node, dtype)
    if out[1] is None:
        for act in EL._BODIES:
            m = EL._body_pattern(act, dtype).match(node)
            print(
                "FAIL", act, "at", node.format_node()[:160], "->", str(m)[:300] if not isinstance(m, Match) else "match"
            )
    return out


EL._match_body = spy
model = LoopMoE(hidden=256, inter=256, experts=8, k=2).to("cuda", torch.bfloat16).eval()
x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    torch.compile(model, backend="rubin", options={"dump_dir": "/tmp/diag"})(x)
print(
    subprocess.run(
        "grep -n 'mm\\|silu\\|sigmoid\\|mul' /tmp/diag/*/00-input.py | head -30",
        shell=True,
        capture_output=True,
        text=True,
    ).stdout
)
