#!/usr/bin/env bash
# The GPU check of issue 43, sized for about 7 minutes on one H100 (16 cores):
#
#   bash benchmarks/device_check.sh OUTDIR            # on a machine with a CUDA GPU
#   bash benchmarks/device_check.sh OUTDIR --dry-run  # here: every part that needs no GPU, tiny sizes
#
# Writes into OUTDIR:
#   env.txt           nvidia-smi, CPU, torch / CUDA / triton / PyG / numba versions, commit, source hash
#   cuda_vs_cpu.json  losses of 3 steps (dropout 0.5) on CUDA and on the CPU, six models, synthetic:small,
#                     and the mixture of accelerators' against the CPU's for GCN / SAGE / GIN
#   pytest_cuda.txt   pytest -m cuda tests/test_cuda.py and the quantizer's CUDA test, then
#                     tests/backends/test_triton.py on CUDA tensors
#   train_gpu.json    tessera vs PyG on the GPU, synthetic:products, GCN / SAGE / GAT / GIN: median epoch
#   train_gpu.md      (10 after 2 warm-up) and peak GPU memory; the same as a table; and the mixture of
#                     accelerators (--aggregate-on cpu: CPU aggregation, GPU update) for GCN / SAGE / GIN
#   kernel_choices.json  the backends tessera's auto measured and chose (its decision cache)
#   logs/             each driver child's output;   README.txt  what ran, each section's exit and time
#
# Every section runs under `timeout`, and the Python driver (benchmarks/device_check.py) writes
# each finished cell at once, so a failing or hanging part leaves the others' results. The whole
# run stays within DEVICE_CHECK_BUDGET_S seconds (default 420). PYTHON names the interpreter
# (default: .venv/bin/python where its torch fits the run, else python3). Where that interpreter
# has no pytest, build/device_deps is put on its path if present; make it (pure Python) with
#   mkdir -p build/device_deps && cp -r .venv/lib/python3.*/site-packages/{pytest,_pytest,pluggy,iniconfig,packaging,pygments,py.py} build/device_deps/
# and carry build/device_deps to the GPU machine.
set -euo pipefail

usage() {
    echo "usage: $0 OUTDIR [--dry-run]" >&2
    exit 2
}
[[ $# -ge 1 && $# -le 2 ]] || usage
OUT=$1
DRY=0
if [[ $# -eq 2 ]]; then
    [[ $2 == --dry-run ]] || usage
    DRY=1
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# The interpreter: $PYTHON, else the first of .venv/bin/python, python3, python whose torch
# imports (for a real run: and sees a GPU).
want_cuda=$((1 - DRY))
pick_python() {
    local c
    for c in .venv/bin/python python3 python; do
        command -v "$c" >/dev/null 2>&1 || continue
        if "$c" -c "import sys, torch; sys.exit(0 if ($want_cuda == 0 or torch.cuda.is_available()) else 1)" 2>/dev/null; then
            echo "$c"
            return 0
        fi
    done
    command -v python3 || echo python
}
PY=${PYTHON:-$(pick_python)}
DEPS=$REPO/build/device_deps
if ! "$PY" -c "import pytest" >/dev/null 2>&1 && [[ -d $DEPS ]]; then
    export PYTHONPATH="$PYTHONPATH:$DEPS"
fi

BUDGET=${DEVICE_CHECK_BUDGET_S:-420}
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
min() { if (($1 < $2)); then echo "$1"; else echo "$2"; fi; }

# the commit (on a copy without .git, name it: DEVICE_CHECK_COMMIT=...); env.txt adds a hash of the sources
if [[ -z ${DEVICE_CHECK_COMMIT:-} ]]; then
    if git rev-parse --git-dir >/dev/null 2>&1; then
        DEVICE_CHECK_COMMIT="$(git rev-parse --short HEAD) (+$(git status --short | wc -l | tr -d ' ') changed paths)"
    else
        DEVICE_CHECK_COMMIT="unknown (no git here)"
    fi
fi
export DEVICE_CHECK_COMMIT PY

STATUS=()
# section NAME SECONDS COMMAND...: run COMMAND under `timeout SECONDS`, note its exit status and time
section() {
    local name=$1 limit=$2 t0=$SECONDS rc=0
    shift 2
    if ((limit < 5)); then
        STATUS+=("$name: skipped, time budget spent")
        echo "== $name: skipped (time budget spent)"
        return 0
    fi
    echo "== $name (at most ${limit} s)"
    timeout -k 10 "$limit" "$@" || rc=$?
    local note=""
    ((rc == 124 || rc == 137)) && note=" (timed out)"
    STATUS+=("$name: exit $rc$note, $((SECONDS - t0)) s of at most $limit s")
    echo "== $name: exit $rc$note in $((SECONDS - t0)) s"
}

cat >"$OUT/README.txt" <<EOF
benchmarks/device_check.sh $([[ $DRY == 1 ]] && echo "--dry-run (CPU only, tiny sizes: no figure here is a GPU's)")
started $(date -u +%FT%TZ) on ${HOSTNAME:-$(uname -n)}, commit $DEVICE_CHECK_COMMIT, python $PY
Mixture of accelerators (MixGCN: aggregation on the CPU, update on the GPU, --aggregate-on cpu)
against GPU-only: the tessera-mixture cells of train_gpu.json (GCN, SAGE, GIN) and the
losses/mixture-* cells of cuda_vs_cpu.json.
EOF
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
    echo "pytest is not importable by $PY: the test sections fail (see the header of device_check.sh)" >>"$OUT/README.txt"
fi

# ---------------------------------------------------------------------------------- env.txt
env_report() {
    echo "# nvidia-smi"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
        nvidia-smi || true
    else
        echo "nvidia-smi: not available on this machine"
    fi
    echo
    echo "# host"
    echo "nproc $(nproc)"
    (lscpu 2>/dev/null | grep -E '^(Model name|Socket|Core|Thread|NUMA node\(s\))' || true)
    (free -g 2>/dev/null || true)
    echo
    echo "# software"
    echo "commit $DEVICE_CHECK_COMMIT"
    "$PY" - <<'PYEOF'
import hashlib, importlib, importlib.metadata, pathlib, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable, platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm {p.major}.{p.minor}", f"{p.multi_processor_count} SMs")
for name in ("pytest", "triton", "torch_geometric", "torch_scatter", "torch_sparse", "pyg_lib", "numba", "numpy", "scipy", "pymetis"):
    try:
        mod = importlib.import_module(name)
    except Exception as e:
        print(name, "absent:", type(e).__name__, e)
        continue
    try:
        version = getattr(mod, "__version__", None) or importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    print(name, version, pathlib.Path(mod.__file__ or "").parent)
import tessera
from tessera.backends import available_backends
src = pathlib.Path(tessera.__file__).parent
h = hashlib.sha1()
for f in sorted(src.rglob("*.py")):
    h.update(str(f.relative_to(src)).encode())
    h.update(f.read_bytes())
print("tessera", src, "sources sha1", h.hexdigest()[:12], "backends", available_backends())
PYEOF
}
export -f env_report
section env 60 bash -c env_report >"$OUT/env.txt" 2>&1

# ---------------------------------------------------------------------------------- sizes
if ((DRY)); then
    DEVICE=cpu
    LOSSES=(--device cpu --backend torch --dataset synthetic:tiny --steps 2)
    TRAIN=(--device cpu --graph synthetic:tiny --epochs 2 --warmup 1 --hidden 16 --heads 2)
    CAP_LOSSES=40 CAP_PYTEST=40 CAP_TRAIN=60 TRITON_MIN=0
else
    DEVICE=cuda
    LOSSES=(--device cuda --dataset synthetic:small --steps 3)
    TRAIN=(--device cuda --graph synthetic:products --epochs 10 --warmup 2 --hidden 256 --heads 8)
    CAP_LOSSES=75 CAP_PYTEST=100 CAP_TRAIN=200 TRITON_MIN=60
fi

# ---------------------------------------------------------------------------------- cuda_vs_cpu.json
T=$(min "$CAP_LOSSES" "$(left)")
section losses "$T" "$PY" benchmarks/device_check.py losses "${LOSSES[@]}" \
    --budget-s $((T > 15 ? T - 10 : T)) --out "$OUT/cuda_vs_cpu.json" >"$OUT/logs/losses.txt" 2>&1

# ---------------------------------------------------------------------------------- pytest_cuda.txt
T=$(min "$CAP_PYTEST" "$(left)")
{
    echo "# python -m pytest -q -m cuda tests/test_cuda.py tests/comm/test_quantize_torch.py   (device $DEVICE)"
    section pytest-cuda "$T" "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/comm/test_quantize_torch.py \
        --durations=8 --junitxml "$OUT/pytest_cuda.xml"
} >"$OUT/pytest_cuda.txt" 2>&1

# ---------------------------------------------------------------------------------- train_gpu.json
T=$(min "$CAP_TRAIN" $(($(left) - TRITON_MIN)))
section train "$T" "$PY" benchmarks/device_check.py train "${TRAIN[@]}" \
    --budget-s $((T > 15 ? T - 10 : T)) --out "$OUT/train_gpu.json" >"$OUT/logs/train.txt" 2>&1

# ---------------------------------------------------------------------------------- Triton tests
T=$(min 240 "$(left)")
{
    echo
    if ((DRY)); then
        echo "# python -m pytest -q --collect-only tests/backends/test_triton.py   (dry run: collected, not run)"
        section pytest-triton "$T" "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/backends/test_triton.py
    else
        echo "# python -m pytest -q tests/backends/test_triton.py   (CUDA tensors)"
        section pytest-triton "$T" "$PY" -m pytest -q -p no:cacheprovider tests/backends/test_triton.py \
            --durations=8 --junitxml "$OUT/pytest_triton.xml"
    fi
} >>"$OUT/pytest_cuda.txt" 2>&1

# ---------------------------------------------------------------------------------- wrap up
"$PY" -c "from tessera.backends.select import cache_file; import shutil, sys; p = cache_file(); p.is_file() and shutil.copy(p, sys.argv[1])" \
    "$OUT/kernel_choices.json" 2>>"$OUT/logs/wrapup.txt" || true
{
    echo
    echo "sections (finished $(date -u +%FT%TZ), $((SECONDS - START)) s of a budget of $BUDGET s):"
    printf '  %s\n' "${STATUS[@]}"
} >>"$OUT/README.txt"
cat "$OUT/README.txt"
