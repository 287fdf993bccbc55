"""The rubin pass pipeline, one module per pass, in this order (manager.py runs them):

    canonicalize -> match_moe -> match_attention -> match_gemm -> select_kernels -> place_locality -> chain_pdl
"""
