from rubin_compile import ops  # noqa: F401
