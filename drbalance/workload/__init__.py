"""Workload data: per-model cost tables and the paper's scenarios (framework-free; no torch)."""
