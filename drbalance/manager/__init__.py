"""The manager daemon (no torch): inbox, app table, utilisation sources, policy calls, logs."""
