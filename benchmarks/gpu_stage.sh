#!/bin/bash
# Staging the SmolLM2 GGUF on the device machine, one git-ignored part per call (a call carries
# at most 64 MiB, the working tree included (counted as the disk blocks its files take): ~50 MB of it tracked in session 31, when six parts of
# 16.4 MB no longer fitted beside it, and ~54 MB in session 32, when eight of 12.3 MB left no room for
# untracked results; session 33: twelve of 8.2 MB beside 52 MB tracked; session 42: eighteen of 5.5 MB beside 58 MB,
# 60.6 MB on disk): split -n 18 -d -a 2 <gguf> into
# .stageg1/gguf.part0 .. .stageg18/gguf.part17 (part names without the leading zero), the gguf wheel into
# .whl/, then per call (calls less than 30 s apart: an idle machine is taken back):
# bash benchmarks/gpu_stage.sh .stageg<N> 18
# (carry .stageg<N>; .whl with the last); the last part leaves /tmp/m.gguf. Session 43: 62.8 MB tracked, no room
# for a part: `bash benchmarks/gpu_lean.sh lean` before the calls, `... restore` after them.
# $1 = the part directory, $2 = how many parts there are (default 5).
set -e
mkdir -p /tmp/st
if [ -d .whl ] && [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
cp "$1"/gguf.part* /tmp/st/
ls -la /tmp/st
parts=$(seq -f /tmp/st/gguf.part%g 0 $(( ${2:-5} - 1 )))
if ls $parts >/dev/null 2>&1; then
  cat $parts > /tmp/m.gguf
  md5sum /tmp/m.gguf
fi
