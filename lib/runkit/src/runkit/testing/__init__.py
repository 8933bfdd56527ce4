"""Test doubles shipped with the template, so that tests, benchmarks and CPU-only demos share them.

:mod:`runkit.testing.fake_nvml` is a pynvml look-alike that scripts GPUs, their metrics over time
and their failures. Nothing here is imported by the training code itself.
"""
