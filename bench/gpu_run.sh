#!/usr/bin/env bash
# The GPU rows on a lent machine that has CUDA's compiler but no package registry (README,
# "On an NVIDIA H100 (CUDA)"): what travels is prepared here, the rest is built there.
#
#   bash bench/gpu_run.sh prepare .dev   # here: wheels the machine lacks, a slim
#                                        # llama-cpp-python source (~11 MB) and SmolLM2's
#                                        # skeleton for bench.shape_clone (1.8 MB): ~26 MB
#   bash bench/gpu_run.sh run .dev       # there, from the repository's root (carry .dev):
#                                        # llama-cpp-python built for sm_90 (~250 s on 16
#                                        # cores), the clone, then row 7, row 2,
#                                        # kv_view --shared and gpu_check --families
#
# Each stage has a time limit of its own (ROW7_S, ROW2_S, KV_VIEW_S, FAMILIES_S seconds), so
# that the whole run ends inside one 10-minute call; what each stage printed is in $OUT/gpu.tar.gz
# (and its summary on standard output) as soon as the stage ends. BUILD=0 PY=.venv/bin/python
# runs the stages with the llama.cpp already installed (a check of this script on a CPU).
set -u
command=${1:?prepare or run}; dir=${2:?a folder, e.g. .dev}
py_version=3.12 # the lent machine's python3
llama_version=0.3.36

if [ "$command" = prepare ]; then
  set -e
  mkdir -p "$dir/whl" "$dir/skel"
  py=.venv/bin/python
  version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
  wheels=()
  for name in grpcio grpcio-health-checking protobuf tenacity structlog pydantic pydantic_core \
    annotated-types typing-inspection typing_extensions diskcache gguf py-spy; do
    wheels+=("$name==$(version "$name")")
  done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir/whl" "${wheels[@]}"
  bash ../shared/tools/slim-llama-sdist.sh "$llama_version" "$dir"
  model=$("$py" -c "from bench.common import MODEL, ROOT
from disagg_mesh.server.common.models import resolve_model_path
print(resolve_model_path(MODEL, ROOT))")
  "$py" -m bench.shape_clone skeleton "$model" "$dir/skel"
  du -sh "$dir"
  exit 0
fi

[ "$command" = run ] || { echo "prepare or run, not $command" >&2; exit 2; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
logs=/tmp/gpu-logs
mkdir -p "$OUT" "$logs"
started=$(date +%s)
say() { echo "[$(($(date +%s) - started)) s] $*"; }
# A stage cut off by its time limit can leave its mesh's nodes running.
keep() { pkill -f disagg_mesh.server.node; tar czf "$OUT/gpu.tar.gz" -C "$logs" --exclude=build.log .; }
quiet() { grep -v -E '^(llama|load|print_info|graph|init|sched|create_tensor|\.)' "$1" | tail -"$2"; }

py=${PY:-python3}
if [ "${BUILD:-1}" = 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$dir"/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/llama:/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" \
    "$py" -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target /tmp/llama \
    "$dir/llama_cpp_python-$llama_version-slim.tar.gz" > "$logs/build.log" 2>&1 ||
    { tail -40 "$logs/build.log"; exit 1; }
  say "llama-cpp-python built"
fi
"$py" -m bench.shape_clone build "$dir/skel" /tmp/clone.gguf || exit 1
export BENCH_MODEL=/tmp/clone.gguf

timeout "${ROW7_S:-150}" "$py" -m bench.batching --rows 7 8 --repeats 2 --out "$logs" \
  > "$logs/row7.log" 2>&1
say "rows 7 and 8: rc $?"; keep; quiet "$logs/row7.log" 12
timeout "${ROW2_S:-120}" "$py" -m bench.run --only overhead --out "$logs" > "$logs/row2.log" 2>&1
say "row 2: rc $?"; keep; quiet "$logs/row2.log" 10
timeout "${KV_VIEW_S:-60}" "$py" -m bench.kv_view --layouts unified streams --shared 1500 \
  --streams 8 16 --other 0 4096 --repeats 3 --new-tokens 64 > "$logs/kv_view.log" 2>&1
say "kv_view --shared: rc $?"; keep; quiet "$logs/kv_view.log" 10
timeout "${FAMILIES_S:-90}" "$py" -m bench.gpu_check --families llama,gemma3,gpt-oss,qwen3moe \
  --out "$logs" > "$logs/families.log" 2>&1
say "gpu_check --families: rc $?"; keep; quiet "$logs/families.log" 12
