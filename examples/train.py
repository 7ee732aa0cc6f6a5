"""Train a torchvision model under drbalance; see drbalance/examples/train.py for the code.

    python examples/train.py --help
"""

from drbalance.examples.train import main

if __name__ == "__main__":
    raise SystemExit(main())
