"""What ``import drbalance.client`` costs a process beyond ``import torch``.

    python -m benchmarks.import_time                  # 7 fresh interpreters each, interleaved
    python -m benchmarks.import_time --baseline /tmp/old-checkout   # and another tree's client beside it

Every training process (a job, each DDP rank, each test process) imports the client. Each repeat
starts fresh interpreters in turn: one that imports ``torch`` alone and one that imports
``torch`` and then ``drbalance.client``, each timing its imports with ``time.perf_counter`` (so
interpreter start-up is not in either). Medians over the repeats; the client's cost is the second
import's time. Each interpreter then makes a ``torch.optim.SGD``, as a training script does next:
PyTorch's optimizers load ``torch._dynamo`` themselves, so that time is recorded too (the
client's and the optimizer's together are what a training job pays before its first step).
Writes ``benchmarks/results/import_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.timing import add_no_write, save
from drbalance.argtypes import positive_int

PROBE = (
    "import sys, time\n"
    "started = time.perf_counter()\n"
    "import torch\n"
    "torch_done = time.perf_counter()\n"
    "if sys.argv[1] == 'client':\n"
    "    import drbalance.client\n"
    "client_done = time.perf_counter()\n"
    "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # what a training script makes next\n"
    "print(torch_done - started, client_done - torch_done, time.perf_counter() - client_done,\n"
    "      'torch._dynamo' in sys.modules)\n"
)


ROOT = Path(__file__).resolve().parent.parent


def probe(what: str, tree: Path = ROOT) -> tuple[float, float, float, bool]:
    """One fresh interpreter: seconds to import torch, seconds to import the client (of the
    checkout ``tree``) after it (0 for ``torch``), seconds to make a ``torch.optim.SGD`` after
    that, and whether dynamo ended up loaded (torch's optimizers load it themselves)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", PROBE, what], capture_output=True, text=True, check=True,
                         timeout=600, env=env, cwd=tree).stdout.split()
    return float(out[0]), float(out[1]), float(out[2]), out[3] == "True"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--baseline", type=Path, default=None, metavar="TREE",
                        help="another checkout whose client is timed beside this one's")
    add_no_write(parser)
    args = parser.parse_args(argv)
    torch_alone, optimizer_alone, client, client_optimizer, baseline, baseline_optimizer = [], [], [], [], [], []
    for _ in range(args.repeats):
        first, _, then, _ = probe("torch")
        torch_alone.append(first)
        optimizer_alone.append(then)
        _, imported, then, _ = probe("client")
        client.append(imported)
        client_optimizer.append(imported + then)
        if args.baseline is not None:
            _, imported, then, _ = probe("client", args.baseline)
            baseline.append(imported)
            baseline_optimizer.append(imported + then)
    torch_s = statistics.median(torch_alone)
    result = {"repeats": args.repeats, "torch_s": torch_s, "client_after_torch_s": statistics.median(client),
              "client_over_torch": statistics.median(client) / torch_s,
              "optimizer_after_torch_s": statistics.median(optimizer_alone),
              "client_and_optimizer_after_torch_s": statistics.median(client_optimizer),
              "samples": {"torch": torch_alone, "optimizer": optimizer_alone, "client": client,
                          "client_and_optimizer": client_optimizer}}
    if baseline:
        result.update(baseline_tree=str(args.baseline), baseline_client_after_torch_s=statistics.median(baseline),
                      baseline_client_over_torch=statistics.median(baseline) / torch_s,
                      baseline_client_and_optimizer_after_torch_s=statistics.median(baseline_optimizer))
        result["samples"].update(baseline=baseline, baseline_client_and_optimizer=baseline_optimizer)
    print(json.dumps({key: value for key, value in result.items() if key != "samples"}, indent=2))
    save("import_time", "benchmarks.import_time", argv, result, args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
