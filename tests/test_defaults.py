"""Each shared default lives once, in drbalance/defaults.py: the manager, the simulator, the policies
and the command lines all start from the same values."""

import argparse

import pytest

from drbalance import defaults, env
from drbalance.manager.cli import build_parser as manager_parser
from drbalance.manager.daemon import ManagerSettings
from drbalance.policy import PolicyConfig
from drbalance.profiling import command as profile_command
from drbalance.runs import launch
from drbalance.sim import command as simulate_command
from drbalance.sim.engine import SimConfig


def _parsed(add_arguments, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_thresholds_and_sampling_agree_between_manager_simulator_and_policy():
    manager, sim, policy = ManagerSettings(), SimConfig(), PolicyConfig(gpu_count=4)
    for settings in (manager, sim, policy):
        assert (settings.sd_threshold, settings.util_threshold) == (defaults.SD_THRESHOLD, defaults.UTIL_THRESHOLD)
    for settings in (manager, sim):
        assert (settings.sample_period, settings.window, settings.util_log_period) == (
            defaults.SAMPLE_PERIOD, defaults.UTIL_WINDOW, defaults.UTIL_LOG_PERIOD)


def test_command_lines_start_from_the_shared_defaults(monkeypatch):
    manager = manager_parser().parse_args([])
    simulated = _parsed(simulate_command.add_arguments, "a")
    for args in (manager, simulated):
        assert (args.sd_threshold, args.util_threshold) == (defaults.SD_THRESHOLD, defaults.UTIL_THRESHOLD)
    launched = _parsed(launch.add_arguments, "a", "--run-dir", "unused")
    options = launch.LaunchOptions(scenario=None, policy="fair", run_dir=None, devices="emulated")
    assert (launched.time_scale, launched.real_batch, launched.image_size) == (
        options.time_scale, options.real_batch, options.image_size) == (
        defaults.EMULATED_TIME_SCALE, defaults.EMULATED_REAL_BATCH, defaults.IMAGE_SIZE)
    profiled = _parsed(profile_command.add_arguments, "name")
    monkeypatch.delenv("DRBALANCE_PROFILE_ITERATIONS", raising=False)
    monkeypatch.delenv("DRBALANCE_PROFILE_WARMUP", raising=False)
    assert (profiled.iterations, profiled.warmup) == (env.profile_iterations(), env.profile_warmup()) == (
        defaults.MEASURE_ITERATIONS, defaults.MEASURE_WARMUP)


def test_the_exit_grace_is_a_positive_finite_number_of_seconds(monkeypatch):
    monkeypatch.delenv("DRBALANCE_EXIT_GRACE", raising=False)
    assert env.exit_grace() == defaults.EXIT_GRACE_SECONDS
    monkeypatch.setenv("DRBALANCE_EXIT_GRACE", "2.5")
    assert env.exit_grace() == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("DRBALANCE_EXIT_GRACE", bad)
        with pytest.raises(ValueError, match="DRBALANCE_EXIT_GRACE"):
            env.exit_grace()
