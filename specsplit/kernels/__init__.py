"""Triton kernels, each with a checking wrapper and a plain-torch reference beside it."""
