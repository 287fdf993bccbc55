"""Compiling Triton kernels ahead of time for sm_90 on a machine without a GPU (Triton's own ptxas), for the
kernel tests that read the PTX: a kernel that would not compile on the H200, or that loses its vectorised
pipeline, fails on the CPU before a GPU session is spent on it."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs the triton package")
compiler = pytest.importorskip("triton.compiler")
backend = pytest.importorskip("triton.backends.compiler")
if not hasattr(compiler, "ASTSource") or not hasattr(backend, "GPUTarget"):
    pytest.skip("this Triton has no ASTSource / GPUTarget AOT API", allow_module_level=True)

KERNELS = Path(__file__).resolve().parents[3] / "rubin_compile" / "kernels" / "triton"


def load_plain(name: str, alias: str):
    """kernels/triton/<name>.py loaded as a plain module named ``alias`` (the package refuses to import without
    CUDA); the caller removes ``sys.modules[alias]`` when done."""
    spec = importlib.util.spec_from_file_location(alias, KERNELS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


def _constexpr_defaults(fn) -> dict:
    """The defaults of ``fn``'s constexpr parameters (a launch that omits one gets its default, not an argument)."""
    params = inspect.signature(fn.fn).parameters.values()
    return {
        p.name: p.default
        for p in params
        if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)
    }


def compile_sm90(fn, constexprs: dict, pointers: dict, num_stages: int = 4) -> str:
    """PTX of ``fn`` for sm_90 with every non-pointer, non-constexpr argument an unspecialised i32."""
    constexprs = {**_constexpr_defaults(fn), **constexprs}
    params = inspect.signature(fn.fn).parameters
    sig = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in params}
    src = compiler.ASTSource(fn, sig, constexprs=constexprs)
    k = triton.compile(
        src, target=backend.GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": num_stages}
    )
    return k.asm["ptx"]


def compile_like_a_launch(
    fn,
    constexprs: dict,
    pointers: dict,
    ints: dict,
    num_stages: int = 4,
    floats: tuple = (),
    asm: dict = None,
    num_warps: int = 4,
    descriptors: dict = None,
) -> str:
    """PTX of ``fn`` as Triton specialises a real launch: pointers 16-byte aligned, integer arguments equal to
    1 made constants and those divisible by 16 marked so -- except the ``do_not_specialize`` ones; the
    arguments named in ``floats`` are fp32 scalars; those in ``descriptors`` host-side TMA descriptors (typed as a
    launch types them). A Gluon kernel (``@gluon.jit``) is compiled from Gluon's own source. ``asm``, if given,
    receives every stage's text (ttgir, ...), the cubin and the compiled kernel's ``metadata`` (``.shared``: its
    shared memory in bytes)."""
    from triton.runtime.jit import mangle_type

    params = list(inspect.signature(fn.fn).parameters)
    dns = {params[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
    sig, attrs, consts = {}, {}, {**_constexpr_defaults(fn), **constexprs}
    descriptors = descriptors or {}
    for i, p in enumerate(params):
        if p in consts:
            sig[p] = "constexpr"
        elif p in descriptors:
            sig[p] = mangle_type(descriptors[p])
        elif p in pointers:
            sig[p], attrs[(i,)] = pointers[p], [["tt.divisibility", 16]]
        elif p in floats:
            sig[p] = "fp32"
        elif p not in dns and ints.get(p) == 1:
            sig[p], consts[p] = "constexpr", 1
        else:
            sig[p] = "i32"
            if p not in dns and ints.get(p, 0) % 16 == 0 and ints.get(p, 0) > 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = compiler.ASTSource
    try:  # a Gluon kernel is compiled from its own source kind (Triton >= 3.5)
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

        if isinstance(fn, GluonJITFunction):
            source = GluonASTSource
    except ImportError:
        pass
    src = source(fn, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(
        src, target=backend.GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    if asm is not None:
        asm.update(k.asm)
        asm["metadata"] = k.metadata  # shared memory bytes (.shared), ...
    return k.asm["ptx"]


def async_copy_sizes(ptx: str) -> set[str]:
    """The byte sizes of the PTX's global -> shared asynchronous copies (``{"0x10"}``: 16-byte copies only)."""
    return set(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]+\], \[[^\]]+\], (0x\w+|\d+)", ptx))


def loop_bodies(ptx: str) -> list[list[str]]:
    """The lines of each innermost loop of the PTX, from the header block LLVM marks (``// =>This Inner Loop
    Header``, on the block's label line or a comment line after it: ``//   Parent Loop ...`` comes between them in
    a nested loop) to the branch back to it."""
    lines = ptx.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "Inner Loop Header" not in line:
            continue
        at = next(j for j in range(i, -1, -1) if re.match(r"\s*\$L\w+:", lines[j]))
        label = lines[at].split(":")[0].strip()
        back = re.compile(r"\bbra(?:\.uni)?\s+" + re.escape(label) + r";")
        end = next((j for j in range(i + 1, len(lines)) if back.search(lines[j])), None)
        if end is not None:
            out.append(lines[i : end + 1])
    return out


SM90_REGS, SM90_SMEM, SM90_WARPS = 65536, 228 * 1024, 64  # per SM of an H100 / H200
SM90_SMEM_RESERVED = 1024  # shared memory the driver reserves per resident block


def resident_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """How many programs of a kernel fit on one sm_90 SM at once: registers (allocated per warp in units of 256),
    shared memory (plus the driver's reserve per block) and warps (CUDA's occupancy rules for compute capability
    9.0)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(SM90_REGS // (per_warp * num_warps), SM90_SMEM // (shared + SM90_SMEM_RESERVED), SM90_WARPS // num_warps)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, local memory (spills) and shared memory per thread / block of a cubin's one kernel, as Triton's
    own ``cuobjdump --dump-resource-usage`` reports them ({"REG": 86, "LOCAL": 0, "SHARED": 1024, ...})."""
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        pytest.skip(f"this Triton ships no cuobjdump ({tool})")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout)}
