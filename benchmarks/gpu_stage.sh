#!/bin/bash
# The SmolLM2 GGUF and the wheels the device machine lacks, staged there for the GPU benchmarks (BENCHMARKS.md,
# "GPU machine"). A device call carries the tracked tree (~22 MB) plus the git-ignored paths it names, 64 MiB in
# all, and the GGUF is 98 MB: it travels in parts, one a call, joined in /tmp on the machine.
#
# Here, once (the checkout the device calls send):
#   bash benchmarks/gpu_stage.sh prepare [parts, default 4]
#     -> .stage1/ .. .stageN/ (the GGUF split, with its md5) and .whl/ (wheels of this venv's versions)
# There, one call per part, back to back (a machine idle for 30 s goes back, /tmp with it):
#   bash benchmarks/gpu_stage.sh .stage1        (carry .stage1 and .whl: installs the wheels into /tmp/site)
#   bash benchmarks/gpu_stage.sh .stage2        (carry .stage2)
#   bash benchmarks/gpu_stage.sh .stage3        (carry .stage3)
#   bash benchmarks/gpu_stage.sh .stage4        (carry .stage4: the last part joins /tmp/m.gguf, md5 checked)
# and every benchmark call starts with `export PYTHONPATH=/tmp/site:$PWD`.
set -euo pipefail
WHEELS="gguf fastapi uvicorn starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
        opentelemetry-api pyzmq msgspec httptools xgrammar apache-tvm-ffi jsonschema jsonschema-specifications
        referencing rpds-py"

prepare() {
    local n=${1:-4} py=${PYTHON:-python3}
    [ -x .venv/bin/python ] && py=${PYTHON:-.venv/bin/python}
    local gguf=${GGUF:-$($py -c 'from specserve.loader import default_model_path; print(default_model_path())')}
    rm -rf .stage[0-9]* && mkdir -p .whl
    local sum
    sum=$(md5sum "$gguf" | cut -d' ' -f1)
    split -n "$n" -d -a 1 "$gguf" /tmp/gguf.part
    for i in $(seq 1 "$n"); do
        mkdir ".stage$i" && mv "/tmp/gguf.part$((i - 1))" ".stage$i/gguf.part$((i - 1))"
        echo "$sum $n" > ".stage$i/md5"
    done
    for w in $WHEELS; do
        v=$($py -c "import importlib.metadata as m; print(m.version('$w'))")
        ls .whl | grep -qi "^${w//-/_}-$v-" || python3 -m pip download -q --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 -d .whl "$w==$v"
    done
    local tree part whl
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    part=$(du -cb .stage1 | tail -1 | cut -f1)
    whl=$(du -cb .whl | tail -1 | cut -f1)
    echo "md5 $sum, $n parts; tracked $tree B + a part $part B + .whl $whl B = $((tree + part + whl)) B" \
         "(a call carries at most $((64 << 20)) B)"
}

stage() {
    local dir=${1%/} sum n
    read -r sum n < "$dir/md5"
    mkdir -p /tmp/st
    if [ -d .whl ] && [ ! -d /tmp/site/fastapi ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    cp "$dir"/gguf.part* /tmp/st/
    local parts
    parts=$(seq -f /tmp/st/gguf.part%g 0 $((n - 1)))
    if ls $parts > /dev/null 2>&1; then
        cat $parts > /tmp/m.gguf && rm -f $parts
        [ "$(md5sum /tmp/m.gguf | cut -d' ' -f1)" = "$sum" ] || { echo "md5 of /tmp/m.gguf is not $sum"; exit 1; }
        echo "/tmp/m.gguf ready (md5 $sum)"
    else
        echo "staged $(ls /tmp/st | wc -l) of $n parts"
    fi
}

case "${1:-}" in
    prepare) prepare "${2:-}" ;;
    .stage*) stage "$1" ;;
    *) echo "usage: $0 prepare [parts] | $0 .stage<N>"; exit 2 ;;
esac
