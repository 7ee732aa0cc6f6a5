"""Commands that run real jobs: ``drbalance launch`` and ``demo``, and the training scripts they start."""
