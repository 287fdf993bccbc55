"""What a user debugging a model sees: dumps, reports, ``python -m rubin_compile explain DIR``."""
