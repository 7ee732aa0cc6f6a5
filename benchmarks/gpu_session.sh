#!/usr/bin/env bash
# The GPU checks of docs/gpu-results.md in one run, about 7 minutes on one H200, each step with
# its own time limit so that one failure loses no other step's result.
#
#   bash benchmarks/gpu_session.sh OUT_DIR
#
# Needs: one CUDA GPU, torch + torchvision + nvidia-ml-py + pytest (+ pytest-timeout,
# hypothesis), posix-ipc, and this checkout on PYTHONPATH (or installed). Writes into OUT_DIR:
# gpu_session.log (every step's output), results.tgz (the benchmarks' JSON files, the manager's
# log) and colocation.json.
set -u
out=${1:?usage: gpu_session.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step environment
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, torchvision, pynvml; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0))"

step "pytest: the CUDA tests (tests/client/test_parallel_cuda.py, tests/client/test_distributed_cuda.py)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "" -rs tests/client/test_parallel_cuda.py tests/client/test_distributed_cuda.py
echo "pytest rc=$?"

step "what a chunk time covers (benchmarks.cuda_chunk_time, ResNet-50, batch 64)"
timeout 150 python3 -m benchmarks.cuda_chunk_time --model resnet50 --batch 64 --steps 40
echo "rc=$?"

step "wrapper overhead against nn.DataParallel (benchmarks.bench_parallel --gpu-only)"
timeout 120 python3 -m benchmarks.bench_parallel --gpu-only --repeats 50
echo "rc=$?"
timeout 150 python3 -m benchmarks.bench_parallel --gpu-only --repeats 30 --model resnet50 --batch 64 --image 224
echo "rc=$?"

step "what a DR change costs a job on CUDA (benchmarks.change_cost, cudnn.benchmark on)"
timeout 200 python3 -m benchmarks.change_cost --devices cuda --model resnet50 --image 224 --batch 64 --changes 3
echo "rc=$?"

step "where the wrapper's host time goes (benchmarks.profile_wrapper, ResNet-18)"
timeout 90 python3 -m benchmarks.profile_wrapper --steps 300 --top 30
echo "rc=$?"

step "real NVML: drbalance-manager --source nvml beside a training job on cuda:0"
export DRBALANCE_NAMESPACE="gpucheck$$"
timeout 90 python3 -c 'import sys; from drbalance.manager.cli import main; sys.exit(main())' \
    --namespace "$DRBALANCE_NAMESPACE" --source nvml --policy fair --duration 40 --util-log-period 1 \
    --log "$work/manager.jsonl" &
manager=$!
sleep 4
timeout 80 python3 -m drbalance.runs.train --model resnet50 --devices cuda --batch-size 64 --epochs 1 \
    --iterations 150 --solo-time 30 --no-progress --report-every 5 > "$work/train.txt" 2>&1 &
train=$!
sleep 20
timeout 20 python3 -m drbalance status --namespace "$DRBALANCE_NAMESPACE" 2>&1 | head -20
wait $train; echo "train rc=$?"; tail -5 "$work/train.txt"
wait $manager; echo "manager rc=$?"
grep -c '"util"' "$work/manager.jsonl" | sed 's/^/util records: /'
grep '"util"' "$work/manager.jsonl" | head -3
grep -E '"(app_added|gpu_uuids|decision)"' "$work/manager.jsonl" | head -4 | cut -c1-400
cp "$work/manager.jsonl" benchmarks/results/nvml_manager_log_gpu.jsonl 2>/dev/null

step "co-located jobs on one GPU and the batch-size sweep (benchmarks.colocation)"
timeout 280 python3 -m benchmarks.colocation --device cuda:0 --batch 64 --seconds 4 --timeout 90 --budget 240 \
    --sweep resnet50 --batches 16,32,64,128,256 --sweep-seconds 3 \
    --groups "resnet50 alexnet mnasnet1_0 densenet121 resnet50+resnet50 resnet50+alexnet resnet50+mnasnet1_0 densenet121+resnet50 alexnet+alexnet mnasnet1_0+mnasnet1_0 resnet50+resnet50+resnet50" \
    --json "$out/colocation.json"
echo "rc=$?"

step "results"
tar czf "$out/results.tgz" benchmarks/results/*_gpu*.json benchmarks/results/cuda_chunk_time_*.json \
    benchmarks/results/nvml_manager_log_gpu.jsonl 2>/dev/null
tar tzf "$out/results.tgz"
