"""vLLM's Triton fused MoE as a baseline for benchmarks/moe.py, loaded from vLLM's own source at run time.

What vLLM 0.32-0.33 runs for an unquantised MoE layer on a Hopper GPU (``fused_experts`` with the Triton experts):
``moe_align_block_size`` (tokens sorted by expert into BLOCK_SIZE_M blocks), ``fused_moe_kernel`` for FC1 into
``[T, k, 2I]``, ``silu_and_mul`` into ``[T * k, I]``, ``fused_moe_kernel`` for FC2 with the routed weights into
``[T, k, H]``, and the sum over the k slots -- with the config vLLM picks: its tuned file for the GPU
(``configs/E=<E>,N=<I>,device_name=<GPU>.json``, the batch size nearest T) or, without one, its
``get_default_config``.

The H200 machine has no vLLM, and vLLM's package does not import beside another torch build, but the module that
holds the kernel is Python and Triton. So this file reads ``fused_moe.py`` from a vLLM source folder (``--vllm-src``:
``vllm/model_executor/layers/fused_moe`` of an installed vLLM or of an unpacked wheel, carried with the GPU run; by
default the installed vLLM's), compiles from it only ``fused_moe_kernel``, the helper it calls and
``get_default_config`` (with stand-ins for the two vLLM objects that one reads: no batch-invariant mode, a CUDA
platform), and calls the kernel with the arguments vLLM's ``invoke_fused_moe_triton_kernel`` passes for bf16. Nothing
of vLLM is copied into this project; a vLLM whose kernel signature differs fails here with the error.

Two steps are not vLLM's kernels: the alignment runs in torch outside the timed region (``align``, called from the
benchmark's refresh: vLLM's CUDA op takes a few microseconds, so leaving it out favours vLLM), and the activation and
the k-sum are torch's ``silu(gate) * up`` and ``sum`` (vLLM's fused CUDA ops, about the same bytes).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_WANTED = ("write_zeros_to_output", "fused_moe_kernel", "get_default_config")


def source_dir(vllm_src: Optional[str] = None) -> Path:
    """The folder holding vLLM's ``fused_moe.py`` and ``configs/``: ``vllm_src`` or the installed vLLM's."""
    if vllm_src:
        path = Path(vllm_src)
    else:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "vLLM is not installed here: pass --vllm-src <dir> (vllm/model_executor/layers/fused_moe of a vLLM "
                "source tree or unpacked wheel)"
            )
        path = Path(spec.submodule_search_locations[0]) / "model_executor" / "layers" / "fused_moe"
    if not (path / "fused_moe.py").is_file():
        raise FileNotFoundError(f"{path / 'fused_moe.py'} does not exist (--vllm-src names the fused_moe folder)")
    return path


class _CudaPlatform:
    """The two questions get_default_config asks of vLLM's current_platform, answered for an NVIDIA GPU."""

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_device_capability(cc: int) -> bool:
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor == cc


@functools.lru_cache(maxsize=None)
def load(vllm_src: Optional[str] = None) -> SimpleNamespace:
    """vLLM's kernel and default-config function, compiled from its source file (module docstring)."""
    path = source_dir(vllm_src) / "fused_moe.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _WANTED]
    missing = set(_WANTED) - {n.name for n in found}
    if missing:
        raise RuntimeError(f"{path} has no {sorted(missing)}: not the vLLM 0.32-0.33 layout this baseline reads")
    namespace: dict[str, Any] = {
        # the functions' __module__: Triton's code generator reads it on every @triton.jit function a kernel calls
        # (fused_moe_kernel calls write_zeros_to_output); without it the compile failed on the H200 with
        # "'NoneType' object has no attribute 'startswith'"
        "__name__": "rubin_vllm_fused_moe",
        "triton": triton,
        "tl": tl,
        "torch": torch,
        "envs": SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "current_platform": _CudaPlatform(),
        "next_power_of_2": triton.next_power_of_2,
        "should_moe_wna16_use_cuda": lambda *a, **k: False,
    }
    # Line numbers are kept, so triton.jit reads each kernel's source from vLLM's own file.
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return SimpleNamespace(
        kernel=namespace["fused_moe_kernel"], default_config=namespace["get_default_config"], path=path
    )


def config_for(
    T: int, E: int, H: int, I: int, k: int, vllm_src: Optional[str] = None, device_name: Optional[str] = None
) -> tuple[dict, str]:
    """(the config vLLM runs a bf16 call of T tokens with, where it came from): its tuned file for this GPU
    (``device_name``, this machine's by default; the entry of the batch size nearest T), else get_default_config."""
    here = load(vllm_src)
    name = (device_name or torch.cuda.get_device_name()).replace(" ", "_").replace("/", "_")
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"  # as vLLM's get_config_file_name does for the H200 family
    tuned = here.path.parent / "configs" / f"E={E},N={I},device_name={name}.json"
    if tuned.is_file():
        table = {int(m): c for m, c in json.loads(tuned.read_text()).items() if m.isdigit()}
        return dict(table[min(table, key=lambda m: abs(m - T))]), f"tuned file {tuned.name}"
    return dict(here.default_config(T, E, I, H, k, None, None)), "vLLM's get_default_config (no tuned file)"


_COMPUTE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class VllmMoE:
    """One MoE shape run the way vLLM runs it: ``align(ids)`` (outside the timed region) then ``__call__``. bf16 on
    the GPU; ``dtype=torch.float32`` / ``device="cpu"`` with ``config`` given is for the CPU test under Triton's
    interpreter (whose bf16 products are not exact)."""

    def __init__(
        self,
        T: int,
        E: int,
        H: int,
        I: int,
        k: int,
        vllm_src: Optional[str] = None,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cuda",
        config: Optional[dict] = None,
    ):
        self.T, self.E, self.H, self.I, self.k = T, E, H, I, k
        if config is None:
            self.config, self.config_source = config_for(T, E, H, I, k, vllm_src)
        else:
            self.config, self.config_source = dict(config), "given"
        self.kernel = load(vllm_src).kernel
        self.compute_type = _COMPUTE[dtype]
        bm = self.config["BLOCK_SIZE_M"]
        S = T * k
        padded = S + E * (bm - 1)  # vLLM's bound on the padded length (moe_align_block_size)
        self.sorted_ids = torch.empty(padded, dtype=torch.int32, device=device)
        self.expert_ids = torch.empty(triton.cdiv(padded, bm), dtype=torch.int32, device=device)
        self.num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
        self.cache1 = torch.empty((T, k, 2 * I), dtype=dtype, device=device)
        self.cache3 = torch.empty((T, k, H), dtype=dtype, device=device)

    def align(self, topk_ids: torch.Tensor) -> None:
        """What vLLM's moe_align_block_size writes, in torch: the slots sorted by expert, each expert's run padded to
        BLOCK_SIZE_M with the invalid slot id T * k, the expert of each block, and the padded length."""
        bm, E = self.config["BLOCK_SIZE_M"], self.E
        flat = topk_ids.reshape(-1).long()
        S = flat.numel()
        counts = torch.zeros(E, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        padded = (counts + bm - 1) // bm * bm
        pad_end = padded.cumsum(0)
        order = torch.argsort(flat, stable=True)
        expert_sorted = flat[order]
        rank = torch.arange(S, device=flat.device) - (counts.cumsum(0) - counts)[expert_sorted]
        self.sorted_ids.fill_(S)
        self.sorted_ids.scatter_(0, pad_end[expert_sorted] - padded[expert_sorted] + rank, order.to(torch.int32))
        blocks = torch.arange(self.expert_ids.numel(), device=flat.device) * bm
        self.expert_ids.copy_(torch.searchsorted(pad_end, blocks, right=True).clamp(max=E - 1).to(torch.int32))
        self.num_post_padded.copy_(pad_end[-1:].to(torch.int32))

    def _gemm(self, A, B, C, topk_weights, mul_routed_weight: bool, top_k: int) -> None:
        cfg = dict(self.config)
        block_k = cfg.pop("BLOCK_SIZE_K")
        cfg.pop("SPLIT_K", None)
        bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
        M = A.size(0)
        EM = self.sorted_ids.size(0)
        if M < bm:  # vLLM's small-batch bound on the blocks that can hold tokens
            EM = min(EM, M * top_k * bm)
        grid = (triton.cdiv(EM, bm) * triton.cdiv(B.size(1), bn),)
        self.kernel[grid](
            A,
            B,
            C,
            None,
            None,
            None,
            topk_weights,
            self.sorted_ids,
            self.expert_ids,
            self.num_post_padded,
            B.size(1),
            B.size(2),
            EM,
            M * top_k,
            A.stride(0),
            A.stride(1),
            B.stride(0),
            B.stride(2),
            B.stride(1),
            C.stride(1),
            C.stride(2),
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            MUL_ROUTED_WEIGHT=mul_routed_weight,
            top_k=top_k,
            compute_type=self.compute_type,
            use_fp8_w8a8=False,
            use_int8_w8a8=False,
            use_int8_w8a16=False,
            per_channel_quant=False,
            naive_block_assignment=False,
            HAS_BIAS=False,
            BLOCK_SIZE_K=block_k,
            SWAP_AB=False,
            USE_TD=False,
            SPLIT_K=1,
            **cfg,
        )

    def __call__(self, x, w13, w2, topk_weights) -> torch.Tensor:
        """FC1, SiLU-and-mul, FC2 with the routed weights, the k-sum; ``align`` must have run on this routing."""
        self._gemm(x, w13, self.cache1, topk_weights, False, self.k)
        g = self.cache1.view(-1, 2 * self.I)
        act = F.silu(g[:, : self.I]) * g[:, self.I :]
        self._gemm(act, w2, self.cache3, topk_weights, True, 1)
        return self.cache3.sum(dim=1)
