"""Inter-process communication between training jobs and the manager (POSIX IPC, no torch)."""
