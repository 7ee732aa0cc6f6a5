"""Reports of runs: metrics over time, summary tables, PNG plots (plots need matplotlib)."""
