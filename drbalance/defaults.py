"""Shared defaults, each written once: the manager, the simulator, the commands and the client import them here.

Framework-free (imports nothing). A default used by one module only stays in that module (for example
the IPC timeouts in ``drbalance.ipc.link``, the DR granularity ``drbalance.ratio.DEFAULT_TOTAL`` and the
policy ``drbalance.policy.DEFAULT_POLICY``); a default that two places must agree on lives here.
"""

from __future__ import annotations

# --- the policies' thresholds (manager, simulator, their command lines) -------------------------------
SD_THRESHOLD = 0.1
"""SD_th: no DR moves while the largest SD minus the smallest is below this (a ratio of slow-downs)."""
UTIL_THRESHOLD = 20.0
"""Util_th, percentage points: above it the paper policy's utilisation branch runs, else its SD branch."""

# --- what a DR change costs a job (the simulator charges it; fair's plans count it) -----------------
CHANGE_COST_ITERATIONS = 0.15
"""Iterations' worth of time a job loses at a DR change: its first step under a new DR is this
much of a step longer (new chunk shapes; a replica's first use of a device). Above the largest
that ``python -m benchmarks.change_cost`` measures on the CPU and emulated-GPU paths (0.05-0.13;
docs/simulator.md); on a GPU with ``cudnn.benchmark`` it is not measured yet."""

# --- the simulator's noise (its config and the commands that set it) --------------------------------
MAX_JITTER = 2.0
"""The largest relative spread the simulator's jitter takes (2: a log-normal factor of mean 1 and sd 2)."""

# --- utilisation sampling (manager and simulator) ----------------------------------------------------
SAMPLE_PERIOD = 0.5
"""Seconds between utilisation samples."""
UTIL_WINDOW = 6
"""Utilisation smoothing window, in samples (6 x 0.5 s = the last 3 s)."""
UTIL_LOG_PERIOD = 1.0
"""Seconds between utilisation records in the manager log."""

# --- solo-run measurement (``drbalance profile`` and the session it starts) ---------------------------
MEASURE_ITERATIONS = 200
"""Iterations a solo-run measurement runs, warm-up included."""
MEASURE_WARMUP = 10
"""Leading iterations of a solo-run measurement left out of the mean."""

EXIT_GRACE_SECONDS = 60.0
"""Seconds a job has after SIGTERM to unwind before its session's watchdog ends it (``DRBALANCE_EXIT_GRACE``)."""

# --- the training jobs that ``drbalance launch`` / ``demo`` start --------------------------------------
EMULATED_TIME_SCALE = 10.0
"""Emulated GPUs: how many times slower than the modelled GPU (so that a small machine keeps up)."""
MAX_TIME_SCALE = 10_000.0
"""The largest ``--time-scale``: a scenario of minutes then takes weeks. A larger one would end in
an ``OverflowError`` when the launcher sleeps until an app's arrival."""
MAX_WATCH_INTERVAL = 86_400.0
"""Seconds: the longest pause between two frames of ``drbalance status --watch`` (a day)."""
EMULATED_REAL_BATCH = 4
"""Emulated GPUs: real images computed per iteration (the modelled batch is the scenario's)."""
IMAGE_SIZE = 64
"""Side of the synthetic (FakeData) images, pixels."""

# Where a machine's system manager keeps its socket and lock (DRBALANCE_SYSTEM_DIR; drbalance.ipc.system):
# systemd's RuntimeDirectory=drbalance of the system unit, in /run, which only root may write.
SYSTEM_DIR = "/run/drbalance"
