"""Train a torchvision model with BalancedDistributedDataParallel under torchrun; see drbalance/examples/train_ddp.py.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --help
"""

from drbalance.examples.train_ddp import main

if __name__ == "__main__":
    raise SystemExit(main())
