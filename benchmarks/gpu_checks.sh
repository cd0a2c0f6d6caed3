#!/usr/bin/env bash
# The device checks of the decode work in one run, on a GPU machine where the
# package is installed (see ../shared/gpu/README.md for bringing MLX's CUDA
# build there): the core tests, then decode speed and peak memory against
# stock. Writes every output under $OUT (default: benchmarks/results/gpu).
#   bash benchmarks/gpu_checks.sh            # ~8 min on an H200
#   QUICK=1 bash benchmarks/gpu_checks.sh    # small sizes: checks the script itself
set -u
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -n "${QUICK:-}" ]; then
    contexts="1024 2048"; batches="1 2"; context=2048; steps=8; start=512
else
    contexts="1024 4096 16384 32768 131072"; batches="1 8"; context=32768; steps=256; start=4096
fi
$py -c "import mlx.core as mx, mlx_lm; print(mx.default_device(), mx.__version__, mlx_lm.__version__)" | tee "$out/device.txt"
$py -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_decode_cuda.py tests/test_fidelity.py tests/test_latent.py \
    tests/test_models.py tests/test_batching.py > "$out/tests.txt" 2>&1
echo "tests: $(tail -n 1 "$out/tests.txt")"
# On CUDA: the kernel (ours*) and the portable path (portable*) side by side.
$py benchmarks/decode_speed.py --contexts $contexts --batches $batches --reps 3 \
    --json "$out/decode_speed.json" > "$out/decode_speed.txt" 2> "$out/decode_speed.err"
tail -n 40 "$out/decode_speed.txt"
$py benchmarks/peak_memory.py --context $context --steps $steps --start $start --variants stock ours ours8 ours4 \
    --json "$out/peak_memory.json" > "$out/peak_memory.txt" 2> "$out/peak_memory.err"
tail -n 8 "$out/peak_memory.txt"
