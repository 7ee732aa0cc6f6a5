"""Solo-run profiles: the store of measured solo-run times and the ``drbalance profile`` command."""
