"""The simulator (no torch): m GPUs shared by N apps, driving the manager's own policies."""

from drbalance.policy import POLICIES
from drbalance.sim.engine import SimConfig, SimResult, Simulation, simulate

__all__ = ["POLICIES", "SimConfig", "SimResult", "Simulation", "simulate"]
