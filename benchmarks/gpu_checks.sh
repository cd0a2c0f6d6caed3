#!/usr/bin/env bash
# The device checks of the decode work in one run, on a GPU machine where the
# package is installed (see ../shared/gpu/README.md for bringing MLX's CUDA
# build there): the core tests, then decode speed and peak memory against
# stock, then the kernel's tile and ring sizes. Writes every output under $OUT
# (default: benchmarks/results/gpu). SWEEP=0 leaves the sizes out.
#   bash benchmarks/gpu_checks.sh            # not yet timed on a GPU
#   QUICK=1 bash benchmarks/gpu_checks.sh    # small sizes: checks the script itself
set -u
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -n "${QUICK:-}" ]; then
    contexts="1024 2048"; batches="1 2"; context=2048; steps=8; start=512
    sweep="--contexts 2048 --batches 1 --repeats 2 --calls 2"
else
    contexts="1024 4096 16384 32768 131072"; batches="1 8"; context=32768; steps=256; start=4096
    sweep="--contexts 131072 --batches 1 8 --repeats 3"
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
# The kernel's tile and ring sizes side by side, with their share of the peak.
[ "${SWEEP:-1}" = 0 ] && exit 0
$py benchmarks/kernel_tiles.py $sweep --json "$out/kernel_tiles.json" > "$out/kernel_tiles.txt" 2> "$out/kernel_tiles.err"
tail -n 60 "$out/kernel_tiles.txt"
