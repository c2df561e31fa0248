"""Benchmarks: transport microbenchmarks, the MoE layer benchmark and the load generator."""
