"""Test doubles shipped with the library (the fake NVML), shared by tests, benchmarks and demos."""
