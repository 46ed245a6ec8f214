#!/bin/bash
# The working tree a device call carries (tracked files, 64 MiB with what it carries, counted in disk blocks)
# had 62.8 MB tracked in session 43: no room left for a 5.5-MB part of the GGUF. Before a lease:
#   bash benchmarks/gpu_lean.sh lean      # takes older sessions' GPU results out of the working tree
# and after it (before any commit: `git commit -a` would record them deleted):
#   bash benchmarks/gpu_lean.sh restore   # puts them back from git
# Kept: the current session's folder ($2, default: the highest gpu_sessionN) and everything outside results/.
set -e
cd "$(git rev-parse --show-toplevel)"
keep=${2:-$(ls -d benchmarks/results/gpu_session* | sort -V | tail -1)}
case "$1" in
  lean)
    git ls-files -z benchmarks/results | grep -zv "^${keep%/}/" | grep -zE '^benchmarks/results/(gpu_session|adaptive/)' \
      | xargs -0 rm -f
    echo "lean: kept $keep; tracked files now $(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1) KiB on disk"
    ;;
  restore)
    git checkout -- benchmarks/results
    git status --short benchmarks/results | head -3
    echo restored
    ;;
  *) echo "usage: $0 lean|restore [kept folder]"; exit 2 ;;
esac
