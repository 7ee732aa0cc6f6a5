"""Emulated GPUs for machines without NVIDIA GPUs (no torch): shared device slots + busy accounting."""
