#!/bin/bash
# Staging the SmolLM2 GGUF on the device machine, one git-ignored part per call (a call carries
# at most 64 MiB): split -n 4 -d -a 1 <gguf> into .stageg1/gguf.part0 .. .stageg4/gguf.part3, the
# gguf wheel into .whl/, then per call: bash benchmarks/gpu_stage.sh .stageg<N> (carry .stageg<N>,
# and .whl with the first); the fourth call leaves /tmp/m.gguf. $1 = the part directory.
set -e
mkdir -p /tmp/st
if [ -d .whl ] && [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
cp "$1"/gguf.part* /tmp/st/
ls -la /tmp/st
if [ -f /tmp/st/gguf.part0 ] && [ -f /tmp/st/gguf.part1 ] && [ -f /tmp/st/gguf.part2 ] && [ -f /tmp/st/gguf.part3 ]; then
  cat /tmp/st/gguf.part0 /tmp/st/gguf.part1 /tmp/st/gguf.part2 /tmp/st/gguf.part3 > /tmp/m.gguf
  md5sum /tmp/m.gguf
fi
