#!/usr/bin/env bash
# The GPU machine has no network and none of ray, prefect, sglang-router, megatron-core, mbridge or
# their dependencies. This script carries them there as wheels, in two parts that each fit one call's
# 64 MiB transfer, and installs them (docs/gpu.md has the whole recipe):
#
#   bench/gpu_env.sh download   here (network): .whl/1 (ray, the trainer's, engines' and rollout's
#                               dependencies: bench/gpu_env/wheels-1.txt) and .whl/2 (sglang-router,
#                               prefect and its dependencies: wheels-2.txt), cp312 wheels; ray without its
#                               Java jar and dashboard source map, ray and sglang-router with their
#                               binaries stripped (each part < 60 MB)
#   bench/gpu_env.sh install [PARTS]   there, in the repository root: installs the parts that were
#                               carried (pip --no-index --no-deps into the machine's python) and checks
#                               that PARTS (default "1 2") import
#
# On the device, two calls back to back (the machine stays warm ~30 s between calls, and what a call
# installed stays with it): first carry .whl/1 and run `bash bench/gpu_env.sh install 1 && <work that needs
# no Prefect>`, then carry .whl/2 and run `bash bench/gpu_env.sh install && <the GPU work>`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT=$((60 * 1000 * 1000))  # bytes per part: a call carries 64 MiB with the working tree

download() {
  local platforms=()
  for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
  for part in 1 2; do
    mkdir -p .whl/all-$part .whl/$part
    grep -v '^#' bench/gpu_env/wheels-$part.txt | xargs "$PY" -m pip download --quiet --no-deps \
      --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl/all-$part
    rm -f .whl/$part/*.whl
    for w in .whl/all-$part/*.whl; do
      case "$w" in
        # ray: the Java workers' jar (34 MB) and the dashboard's source map are unused by a Python job
        */ray-*) "$PY" bench/gpu_env/repack_wheel.py "$w" .whl/$part --drop 'ray/jars/*' --drop '*.js.map' --strip ;;
        */sglang_router-*) "$PY" bench/gpu_env/repack_wheel.py "$w" .whl/$part --strip ;;
        *) cp "$w" .whl/$part/ ;;
      esac
    done
    local size
    size=$(du -cb .whl/$part/*.whl | tail -1 | cut -f1)
    (( size < LIMIT )) || { echo "part $part is $size bytes, over $LIMIT: move wheels to the other part" >&2; exit 1; }
  done
  du -sh .whl/1 .whl/2
}

install() {
  local want=${1:-"1 2"} parts=()
  for d in .whl/1 .whl/2; do compgen -G "$d/*.whl" > /dev/null && parts+=("$d"/*.whl); done
  if (( ${#parts[@]} )); then
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --root-user-action=ignore "${parts[@]}"
  fi
  # the parts asked for must be in by now (this call's, and the one before it on this warm machine)
  WANT="$want" "$PY" - <<'PY'
import importlib, os, sys
modules = {"1": ("ray", "megatron.core", "mbridge", "math_verify", "pylatexenc", "aiohttp", "uvloop", "fastapi"),
           "2": ("prefect", "sglang_router")}
missing = []
for part in os.environ["WANT"].split():
    for name in modules[part]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - report every missing part
            missing.append(f"{name} of part {part} ({type(exc).__name__}: {exc})")
if missing:
    sys.exit("gpu_env: not installed: " + "; ".join(missing) + ". Carry .whl/1 and .whl/2 in two calls back to "
             "back (bench/gpu_env.sh, docs/gpu.md); a machine given back in between starts bare.")
import ray, torch
print(f"gpu_env: parts {os.environ['WANT']} in; ray {ray.__version__}, torch {torch.__version__}, "
      f"{torch.cuda.device_count()} GPU(s)")
PY
}

case "${1:-}" in
  download) download ;;
  install) install "${2:-}" ;;
  *) echo "usage: $0 download | install [1|2|\"1 2\"]" >&2; exit 2 ;;
esac
