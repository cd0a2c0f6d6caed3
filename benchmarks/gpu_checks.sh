#!/usr/bin/env bash
# The device checks of the decode work, on a GPU machine where the package is
# installed (see ../shared/gpu/README.md for bringing MLX's CUDA build there),
# in parts: the core tests (tests), decode speed against stock (speed), peak
# memory (memory), the kernel's tile and ring sizes (sweep). Writes every
# output under $OUT (default: benchmarks/results/gpu) and each part's exit and
# seconds; exits with the worst part's status.
#   bash benchmarks/gpu_checks.sh                   # every part; not yet timed on a GPU
#   PARTS="speed sweep" bash benchmarks/gpu_checks.sh
#   PART_LIMIT=240 bash benchmarks/gpu_checks.sh    # stop a part after 240 s
#   QUICK=1 bash benchmarks/gpu_checks.sh           # small sizes: checks the script itself
set -u
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
parts=${PARTS:-tests speed memory sweep}
for name in $parts; do
    case $name in tests|speed|memory|sweep) ;; *) echo "PARTS: no part '$name' (tests, speed, memory, sweep)"; exit 2 ;; esac
done
worst=0
if [ -n "${QUICK:-}" ]; then
    contexts="1024 2048"; batches="1 2"; context=2048; steps=8; start=512
    sweep="--contexts 2048 --batches 1 --repeats 2 --calls 2"
else
    contexts="1024 4096 16384 32768 131072"; batches="1 8"; context=32768; steps=256; start=4096
    sweep="--contexts 131072 --batches 1 8 --repeats 3"
fi

# One part: its command under PART_LIMIT seconds (0: none; killed 10 s after
# its TERM), stdout and stderr into $out/NAME.txt and .err, then its last
# lines (and its errors where it failed) and how long it took.
part() {
    local name=$1 lines=$2; shift 2
    case " $parts " in *" $name "*) ;; *) return 0 ;; esac
    local began=$SECONDS
    timeout -k 10 "${PART_LIMIT:-0}" "$@" > "$out/$name.txt" 2> "$out/$name.err"
    local rc=$?
    tail -n "$lines" "$out/$name.txt"
    [ $rc -ne 0 ] && tail -n 20 "$out/$name.err"
    echo "part $name: exit $rc in $((SECONDS - began)) s" | tee -a "$out/parts.txt"
    [ $rc -gt $worst ] && worst=$rc
    return 0
}

$py -c "import mlx.core as mx, mlx_lm; print(mx.default_device(), mx.__version__, mlx_lm.__version__)" | tee "$out/device.txt"
part tests 3 $py -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_decode_cuda.py \
    tests/test_fidelity.py tests/test_latent.py tests/test_models.py tests/test_batching.py
# On CUDA: the kernel (ours*) and the portable path (portable*) side by side.
part speed 40 $py benchmarks/decode_speed.py --contexts $contexts --batches $batches --reps 3 \
    --json "$out/decode_speed.json"
part memory 8 $py benchmarks/peak_memory.py --context $context --steps $steps --start $start \
    --variants stock ours ours8 ours4 --json "$out/peak_memory.json"
# The kernel's tile and ring sizes side by side, with their share of the peak.
part sweep 60 $py benchmarks/kernel_tiles.py $sweep --json "$out/kernel_tiles.json"
exit $worst
