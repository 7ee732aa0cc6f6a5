"""Example workloads shipped with the package (need torch and torchvision)."""
