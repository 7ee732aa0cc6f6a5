"""drbalance in the frameworks that build DDP for you: PyTorch Lightning and Hugging Face Accelerate.

- :mod:`drbalance.integrations.lightning`: importing it registers the ``"drbalance"`` strategy, so
  ``Trainer(strategy="drbalance", devices=N)`` trains with ``BalancedDistributedDataParallel``,
  the balanced loader and a manager ``Session`` (``pip install 'drbalance[lightning]'``).
- :mod:`drbalance.integrations.accelerate`: ``BalancedAccelerator(epochs=N)`` in place of
  ``Accelerator()``; ``accelerator.prepare(model, optimizer, loader)`` then builds the same
  (``pip install 'drbalance[accelerate]'``).

Neither framework is imported by ``import drbalance`` or by this package: only by the module of
each integration, which says which extra to install when its framework is missing. See
docs/integrations.md.
"""
