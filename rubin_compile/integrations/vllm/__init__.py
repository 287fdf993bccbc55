"""rubin and vLLM. Every use of vLLM objects in rubin lives in this package:

    routes.py      the post-grad pass vLLM runs (``rubin_compile.vllm_pass``), the backend route's cache key
    engine.py      the engine adapter the passes ask (layers by name, CUDA-graph mode, attention facts, the
                   CPU build's weight layout)
    layer_ops.py   ``rubin.vllm_moe_layer`` / ``_shared``: vLLM's MoE layer run through rubin.moe's kernels

vLLM itself is imported only when it is used (a graph holding vLLM's ops, a vLLM config in scope).
"""

from rubin_compile.integrations.vllm.routes import VllmPass, backend_route_cache_key, vllm_pass

__all__ = ["VllmPass", "backend_route_cache_key", "vllm_pass"]
