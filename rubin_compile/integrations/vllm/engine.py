"""vLLM as the passes see it: the engine adapter (``PassContext.engine``) that answers, from vLLM's own
objects, what a pass needs to know of a graph vLLM hands rubin.

Passes never import vLLM; they ask this adapter: the layer a graph's op names (``find_layer``, through vLLM's
forward context at compile time), whether rubin reproduces a MoE layer and what it holds, the rubin op that
runs it, an attention layer's backend and KV cache, the vLLM switches that select a kernel, whether expert
weights vLLM's CPU build prepacked are in one of ``rubin.moe``'s ``"vllm_cpu:<isa>[:vnni]"`` layouts, and whether the graph is
replayed from CUDA graphs. vLLM is imported only when one of these is asked, i.e. only when a graph holds
vLLM's ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from rubin_compile.integrations.vllm import layer_ops
from rubin_compile.ops.nodes import dtype_name
from rubin_compile.passes.base import Engine

if TYPE_CHECKING:
    from rubin_compile.options import RubinOptions

# What each vLLM attention backend runs (vllm/v1/attention/backends/<module>, vLLM 0.32), for the report.
BACKEND_KERNELS: dict[str, str] = {
    "CPU_ATTN": "vLLM's _C.cpu_attention_with_kv_cache (cpu_attn.py)",
    "FLASH_ATTN": "vllm_flash_attn flash_attn_varlen_func, FA2 or FA3 (flash_attn.py)",
    "FLASHINFER": (
        "FlashInfer's paged prefill / decode wrappers (fa2 / fa3), or trtllm-gen "
        "(trtllm_batch_context / decode_with_kv_cache) where vLLM's use_trtllm_attention allows "
        "(flashinfer.py)"
    ),
    "TRITON_ATTN": "vLLM's Triton unified_attention (triton_attn.py)",
    "FLEX_ATTENTION": "torch flex_attention (flex_attention.py)",
    "FLASHINFER_MLA": "FlashInfer trtllm-gen MLA decode (mla/flashinfer_mla.py)",
    "CUTLASS_MLA": "CUTLASS MLA decode (mla/cutlass_mla.py)",
    "FLASHMLA": "FlashMLA (mla/flashmla.py)",
    "TRITON_MLA": "vLLM's Triton MLA decode (mla/triton_mla.py)",
}

# Registry kernel -> the vLLM switches that make vLLM run it (vllm/config/attention.py, vLLM 0.32).
ATTENTION_SWITCHES: dict[str, str] = {
    "flashinfer_trtllm": "--attention-backend FLASHINFER (trtllm-gen; force with "
    "--attention-config.use_trtllm_attention=true)",
    "flashinfer_fa3": "--attention-backend FLASHINFER (FlashInfer's fa3 on sm_90)",
    "flashinfer_fa2": "--attention-backend FLASHINFER (fa2)",
}


class VllmEngine(Engine):
    """The adapter for graphs vLLM hands rubin.

    Parameters
    ----------
    route:
        ``"pass"``: rubin runs as vLLM's post-grad pass, so vLLM's ``cudagraph_mode`` says whether the graph is
        replayed from CUDA graphs; ``"backend"``: ``torch.compile(backend="rubin")``, used by vLLM's backend
        route and by every standalone compile (no vLLM op in the graph: nothing is asked of vLLM), where the
        options say it.
    """

    name = "vllm"

    def __init__(self, route: str = "pass") -> None:
        if route not in ("pass", "backend"):
            raise ValueError(f"VllmEngine: route must be 'pass' or 'backend', got {route!r}")
        self.route = route

    def __repr__(self) -> str:
        return f"VllmEngine(route={self.route!r})"

    def runs_under_cudagraphs(self, options: RubinOptions) -> tuple[bool, str]:
        if self.route != "pass":
            return super().runs_under_cudagraphs(options)
        try:
            import vllm.config as vllm_config

            current = getattr(vllm_config, "get_current_vllm_config_or_none", lambda: None)()
        except ImportError:
            current = None
        if current is None:
            # vLLM 0.32 runs its post-grad passes outside set_current_vllm_config: its cudagraph_mode cannot be
            # read here. vLLM captures CUDA graphs unless enforce_eager is set, so assume its default.
            return True, (
                "vLLM's config is not in scope when its pass manager runs ours: assuming vLLM's default "
                "CUDA graphs (with enforce_eager, set RUBIN_PDL=off)"
            )
        mode = current.compilation_config.cudagraph_mode
        name = getattr(mode, "name", str(mode))
        return name != "NONE", f"vLLM cudagraph_mode={name}"

    def layer_name(self, value: Any) -> Optional[str]:
        name = layer_ops.layer_name_value(value)
        return name if isinstance(name, str) else None

    def find_layer(self, name: str) -> tuple[Any, Optional[str]]:
        return layer_ops.compile_time_layer(name)

    def moe_layer_unsupported(self, layer: Any, shared: bool) -> Optional[str]:
        return layer_ops.layer_unsupported_reason(layer, shared)

    def moe_layer_details(self, layer: Any) -> dict[str, Any]:
        return layer_ops.layer_details(layer)

    def moe_layer_op(self, shared: bool) -> torch._ops.OpOverload:
        layer_ops.define_ops()
        return (torch.ops.rubin.vllm_moe_layer_shared if shared else torch.ops.rubin.vllm_moe_layer).default

    def attention_layer_facts(self, layer: Any) -> dict[str, Any]:
        """Backend, kernel, KV cache and head layout of a vLLM ``Attention`` / ``MLAAttention`` layer."""
        backend_cls = getattr(layer, "attn_backend", None)
        try:
            backend = backend_cls.get_name() if backend_cls is not None else None
        except Exception:  # a backend class without get_name(): report the class
            backend = getattr(backend_cls, "__name__", str(backend_cls))
        impl = getattr(layer, "impl", None)
        kernel = BACKEND_KERNELS.get(backend) or (
            f"{type(impl).__module__}.{type(impl).__name__}" if impl is not None else "unknown"
        )
        isa = getattr(layer, "isa", None)
        if isa:
            kernel += f", isa={isa}"
        kv_torch = getattr(layer, "kv_cache_torch_dtype", None)
        facts = {
            "backend": backend,
            "impl": type(impl).__name__ if impl is not None else None,
            "kernel": kernel,
            "kv_cache_dtype": getattr(layer, "kv_cache_dtype", None),
            "kv_cache_torch_dtype": dtype_name(kv_torch) if isinstance(kv_torch, torch.dtype) else None,
            "num_heads": getattr(layer, "num_heads", None),
            "num_kv_heads": getattr(layer, "num_kv_heads", None),
            "head_size": getattr(layer, "head_size", None),
            "head_size_v": getattr(layer, "head_size_v", None),
            "sliding_window": getattr(layer, "sliding_window", None),
            "scale": getattr(impl, "scale", None),
        }
        return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v)) for k, v in facts.items()}

    def attention_switches(self, kernel: str) -> Optional[str]:
        return ATTENTION_SWITCHES.get(kernel)

    def cpu_weight_layout(self, isa: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[Optional[str], Optional[str]]:
        return layer_ops.packed_weights_layout(isa, w13, w2)
