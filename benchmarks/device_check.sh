#!/usr/bin/env bash
# The device check: kvcore's CUDA paths on a GPU machine that reaches no package registry.
#
#   bash benchmarks/device_check.sh                      on the GPU machine (run from any folder)
#   KVCORE_DEVICE=cpu bash benchmarks/device_check.sh    the same steps on the CPU (proves the script;
#                                                        the CUDA-only steps say "skipped: no CUDA")
#   bash benchmarks/device_check.sh --print-stamp        the source stamp fetch_device_wheels.sh records
#
# Before it, on a machine with PyPI: bash benchmarks/fetch_device_wheels.sh (pydantic's wheels, and
# kvcore's own as a fallback), and bring benchmarks/wheels/ along (it is git-ignored: pass it as a
# carried path).  Every figure goes as JSON under $OUT (default ./device-out); summary.json lists
# each step with its status ("ok", "failed (rc N)", "timed out after N s", "skipped: why"), rewritten
# after every step.  Each step is time-boxed and a failing step does not stop the next.  The whole
# run stays under KVCORE_CHECK_BUDGET seconds (default 420).  It only reads the accelerator's state
# (through torch); it never changes its settings.
#
# Environment: KVCORE_DEVICE (default cuda), KVCORE_DEVICE_PYTHON (the interpreter that has torch;
# default: the first of python3 and python that imports it), KVCORE_DEVICE_VENV (default /tmp/kvcore-device-venv: a venv over that
# interpreter's packages, where kvcore and pydantic are installed), KVCORE_CHECK_BUDGET.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The stamp of the sources kvcore's wheels are built from: the packaging files and every file of the
# packages (kvcore/, plugins/*/kvcore_*/), tracked or not, in a fixed order, hashed by content.
source_stamp() {
  find pyproject.toml plugins/*/pyproject.toml kvcore plugins/*/kvcore_* -type f -not -path '*/__pycache__/*' -not -path '*.egg-info*' \
    -not -name '*.pyc' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-32
}
if [ "${1:-}" = "--print-stamp" ]; then source_stamp; exit 0; fi
if [ $# -gt 0 ]; then echo "device_check: unknown argument '$1' (only --print-stamp)" >&2; exit 2; fi

dev="${KVCORE_DEVICE:-cuda}"
# The interpreter that has torch: KVCORE_DEVICE_PYTHON, else the first of python3 and python that imports it.
base_py="${KVCORE_DEVICE_PYTHON:-}"
if [ -z "$base_py" ]; then
  for cand in python3 python; do
    if "$cand" -c 'import torch' 2>/dev/null; then base_py="$cand"; break; fi
  done
  base_py="${base_py:-python3}"
fi
venv="${KVCORE_DEVICE_VENV:-/tmp/kvcore-device-venv}"
budget="${KVCORE_CHECK_BUDGET:-420}"
OUT="${OUT:-$root/device-out}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
wheels="$root/benchmarks/wheels"
steps_tsv="$OUT/logs/steps.tsv"
: > "$steps_tsv"
t_begin=$SECONDS
py="$base_py"          # becomes the venv's python once it is installed
installed=0
has_cuda=0

# One line per step into steps.tsv, then summary.json rewritten from it (so a run killed midway leaves one).
record() {  # name status seconds [figures file]
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$steps_tsv"
  echo "device_check: $1: $2 (${3} s)" >&2
  "$base_py" - "$steps_tsv" "$OUT/summary.json" "$dev" "$budget" <<'EOF' || true
import json, sys
tsv, out, dev, budget = sys.argv[1:5]
steps = []
for line in open(tsv):
    name, status, secs, fig = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": status, "seconds": int(secs), "figures": fig or None})
summary = {"device": dev, "budget_s": int(budget), "steps": steps,
           "ok": sum(s["status"] == "ok" for s in steps),
           "failed": [s["step"] for s in steps if s["status"].startswith(("failed", "timed out"))],
           "skipped": [s["step"] for s in steps if s["status"].startswith("skipped")]}
json.dump(summary, open(out, "w"), indent=2)
EOF
}

# step NAME LIMIT_S FIGURES_FILE CMD...: stdout to the figures file (or the log), stderr to the log.
step() {
  local name="$1" limit="$2" fig="$3"; shift 3
  local left=$(( budget - (SECONDS - t_begin) ))
  if [ "$left" -lt 15 ]; then record "$name" "skipped: out of time (budget ${budget} s)" 0; return; fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local t0=$SECONDS rc
  local dest="${fig:-$OUT/logs/$name.out}"
  # Through bash -c so that a step can be one of the functions below (exported with their variables).
  timeout --kill-after=10 "$limit" bash -c '"$@"' step "$@" > "$dest" 2> "$OUT/logs/$name.err"
  rc=$?
  local secs=$(( SECONDS - t0 ))
  if [ $rc -eq 0 ]; then record "$name" ok "$secs" "${fig#"$OUT"/}"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then record "$name" "timed out after ${limit} s" "$secs" "${fig#"$OUT"/}"
  else record "$name" "failed (rc $rc): $(tail -n 1 "$OUT/logs/$name.err" | cut -c1-300 | tr '\t' ' ')" "$secs" "${fig#"$OUT"/}"
  fi
  return $rc
}

skip() { record "$1" "skipped: $2" 0; }

# json_get FILE WHAT: one figure of a file this script wrote (WHAT: collected, line, failed).
json_get() {
  "$base_py" - "$1" "$2" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
what = sys.argv[2]
if what == "collected":
    print(sum(d["counts"].values()))
elif what == "failed":
    print(len(d["failed"]))
else:
    print(f"{d['ok']} ok, failed: {', '.join(d['failed']) or 'none'}, skipped: {', '.join(d['skipped']) or 'none'}")
EOF
}

export dev base_py venv OUT wheels root
export -f source_stamp

# ---------------------------------------------------------------- 1. what this machine is
env_json() {
  "$base_py" - "$dev" <<'EOF'
import json, platform, sys
info = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "requested_device": sys.argv[1]}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["gpus"] = [{"name": torch.cuda.get_device_name(i),
                         "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                         "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                        for i in range(torch.cuda.device_count())]
except ImportError as exc:
    info["torch"] = f"not importable: {exc}"
from importlib.metadata import PackageNotFoundError, version
for dist in ("numpy", "pluggy", "typer", "rich", "pytest", "hypothesis", "pydantic", "setuptools", "pip"):
    try:
        info[dist] = version(dist)
    except PackageNotFoundError:
        info[dist] = None
print(json.dumps(info, indent=2))
EOF
}
export -f env_json
step env 60 "$OUT/env.json" env_json
if "$base_py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then has_cuda=1; fi
if [ "$dev" != "cpu" ] && [ $has_cuda -eq 0 ]; then
  echo "device_check: KVCORE_DEVICE=$dev but torch sees no CUDA here; the device steps will say so" >&2
fi

# ---------------------------------------------------------------- 2. install kvcore offline
# A venv whose own site-packages come first (kvcore, and pydantic when the image lacks it), over
# every package the base interpreter sees (torch and the rest, read through a .pth file).
install() {
  set -e
  rm -rf "$venv"
  "$base_py" -m venv --without-pip "$venv"
  local vpy="$venv/bin/python" sp
  sp="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$base_py" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$sp/kvcore_device_base.pth"
  "$vpy" -m pip --version >&2   # the base interpreter's pip, seen through the .pth file
  local pip=("$vpy" -m pip install -q --disable-pip-version-check --no-index)
  if ! "$vpy" -c 'import pydantic, sys; sys.exit(0 if int(pydantic.VERSION.split(".")[0]) >= 2 else 1)' 2>/dev/null; then
    local ver tag
    ver="$("$vpy" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    tag="cp${ver/./}"
    if ! compgen -G "$wheels/pydantic_core-*-$tag-*manylinux*x86_64*.whl" > /dev/null; then
      echo "device_check: no pydantic-core wheel for CPython $ver ($tag) in benchmarks/wheels/: run benchmarks/fetch_device_wheels.sh $ver where PyPI is reachable and bring benchmarks/wheels/ along" >&2
      return 3
    fi
    "${pip[@]}" --find-links "$wheels" pydantic
  fi
  local dists=(-e .)
  for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && dists+=(-e "$p"); done
  if "$vpy" -c 'import setuptools, sys; sys.exit(0 if int(setuptools.__version__.split(".")[0]) >= 64 else 1)' 2>/dev/null \
      && "${pip[@]}" --no-deps --no-build-isolation "${dists[@]}"; then
    echo "device_check: kvcore installed editable from the working tree" >&2
  else
    # No usable setuptools here: the wheels fetch_device_wheels.sh built, if they are of these sources.
    local want have
    want="$(source_stamp)"; have="$(cat "$wheels/kvcore/SOURCE-STAMP" 2>/dev/null || echo none)"
    if [ "$want" != "$have" ]; then
      echo "device_check: no setuptools >= 64 for an editable install, and benchmarks/wheels/kvcore/ is not of this tree (stamp $have, tree $want): run benchmarks/fetch_device_wheels.sh again" >&2
      return 4
    fi
    "${pip[@]}" --no-deps --force-reinstall "$wheels"/kvcore/*.whl
    echo "device_check: kvcore installed from benchmarks/wheels/kvcore (stamp $have)" >&2
  fi
  # Everything kvcore imports, from where the run will import it.
  "$vpy" -c 'import kvcore, pydantic, typer, rich, pluggy, numpy, torch; print(kvcore.__file__)' >&2
  "$venv/bin/kvcore" backends --json
}
export -f install
if step install 180 "$OUT/backends.json" install; then installed=1; py="$venv/bin/python"; fi
export py

# Runs the CLI and the benchmarks with the venv; "skipped" when the install failed, or when the
# device is CUDA and torch sees none here.
need_install() {
  [ $installed -eq 1 ] || { skip "$1" "install failed"; return 1; }
  [ "$dev" = cpu ] || [ $has_cuda -eq 1 ] || { skip "$1" "no CUDA (KVCORE_DEVICE=cpu runs the steps on the CPU)"; return 1; }
}

# ---------------------------------------------------------------- 3. the CUDA tests
junit_json() {  # junit.xml -> counts and every test's outcome
  "$py" - "$1" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
cases = []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            msg = (el.get("message") or "")[:300]
            break
    else:
        msg = ""
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time") or 0), "message": msg})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
print(json.dumps({"counts": counts, "tests": cases}, indent=2))
EOF
}
cuda_tests() {
  "$py" -m pytest -m cuda -q -rs -p no:cacheprovider --junitxml="$OUT/logs/cuda-tests.xml" tests plugins >&2
  local rc=$?
  junit_json "$OUT/logs/cuda-tests.xml"
  return $rc
}
export -f junit_json cuda_tests
if need_install cuda-tests; then
  if [ $has_cuda -eq 1 ] && [ "$dev" != "cpu" ]; then
    step cuda-tests 150 "$OUT/cuda-tests.json" cuda_tests
  else
    # Still collected and run, to prove the selection: every test marked cuda skips here.
    if step cuda-tests-collect 120 "$OUT/cuda-tests.json" cuda_tests; then
      skip cuda-tests "no CUDA ($(json_get "$OUT/cuda-tests.json" collected) tests marked cuda collected, all skipped here)"
    fi
  fi
fi

# ---------------------------------------------------------------- 4. bandwidths (short, bounded)
if need_install kv-write; then
  # One torch thread on the CPU: a shared CPU's OpenMP barriers make multi-threaded figures noise.
  threads=(); [ "$dev" = cpu ] && threads=(--threads 1)
  step kv-write 60 "$OUT/kv-write.json" "$py" benchmarks/bench_kv_write.py --device "$dev" "${threads[@]}" --json
fi
if need_install hisparse-h2d; then
  if [ $has_cuda -eq 1 ] && [ "$dev" != "cpu" ]; then
    step hisparse-h2d 60 "$OUT/hisparse-h2d.json" "$py" plugins/hisparse/benchmarks/bench_swap_in.py --device "$dev" --json
  else
    # The same code on the CPU (host to host), so the benchmark itself is proven; no CUDA figure.
    step hisparse-swap-in-cpu 60 "$OUT/hisparse-swap-in-cpu.json" \
      "$py" plugins/hisparse/benchmarks/bench_swap_in.py --device cpu --json --repeats 3
    skip hisparse-h2d "no CUDA"
  fi
fi

# ---------------------------------------------------------------- 5. kvcore bench on the device
# K/V bytes are written on cuda (the bench's default there; off on the CPU, where kv-write covers the writer).
# The bench exits 2 when a run leaked or broke an invariant: a failed step, its JSON kept.
if need_install bench-swa; then
  step bench-swa 100 "$OUT/bench-swa.json" "$venv/bin/kvcore" bench --backend swa --device "$dev" --json --no-progress
fi
if need_install bench-shared-prefix; then
  step bench-shared-prefix 100 "$OUT/bench-shared-prefix.json" \
    "$venv/bin/kvcore" bench --compare radix,swa --workload shared-prefix --device "$dev" --json --no-progress
fi

# ---------------------------------------------------------------- 6. fuzz on the device, one step a backend
for b in chunk radix swa hisparse; do
  if need_install "fuzz-$b"; then
    step "fuzz-$b" 30 "$OUT/fuzz-$b.json" "$py" benchmarks/fuzz_device.py --device "$dev" \
      --backend "$b" --ops "${KVCORE_FUZZ_OPS:-5000}"
  fi
done

echo "device_check: $(json_get "$OUT/summary.json" line); figures in $OUT" >&2
# Exit 1 when a step failed or timed out (the summary says which); 3 when CUDA was asked for and
# torch saw none (nothing ran on a device); skips alone are not failures.
[ "$(json_get "$OUT/summary.json" failed)" = 0 ] || exit 1
if [ "$dev" != cpu ] && [ $has_cuda -eq 0 ]; then exit 3; fi
