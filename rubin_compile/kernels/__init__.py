"""Kernels and the registry that binds canonical ops to them (see registry.py)."""
