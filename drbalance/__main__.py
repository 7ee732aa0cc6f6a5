"""``python -m drbalance``: the ``drbalance`` command (for environments without its console script)."""

from drbalance.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
