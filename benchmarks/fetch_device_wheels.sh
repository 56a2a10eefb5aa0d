#!/usr/bin/env bash
# Run on a machine that reaches PyPI, before benchmarks/device_check.sh runs on a GPU machine that does not.
#
#   bash benchmarks/fetch_device_wheels.sh [PYTHON_VERSION ...]     (default: 3.10 3.11 3.12 3.13 3.14)
#
# Puts into benchmarks/wheels/ (git-ignored; pass it to the GPU machine with the working tree):
#   * pydantic and what it needs that the GPU image lacks (pydantic-core, annotated-types,
#     typing-extensions, typing-inspection): CPython manylinux x86_64 wheels for each version;
#   * kvcore/: wheels of kvcore and every plugin, built from this tree, with SOURCE-STAMP (the
#     fallback when the GPU machine has no setuptools for an editable install; device_check.sh
#     refuses them when the tree changed since).
# pydantic is pinned to the version in .venv (./dev setup) so both machines run the same one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="benchmarks/wheels"
pip_py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && pip_py=".venv/bin/python"
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(3.10 3.11 3.12 3.13 3.14)

spec="pydantic>=2.6"
if pv="$("$pip_py" -c 'import importlib.metadata as m; print(m.version("pydantic"))' 2>/dev/null)"; then
  spec="pydantic==$pv"
fi
# pip's notes about absent local package mirrors are noise here; real errors still show.
pip_quiet() { "$@" 2>&1 | sed '/^WARNING: Location .* is ignored/d' >&2; return "${PIPESTATUS[0]}"; }
mkdir -p "$out"
failed=()
for v in "${versions[@]}"; do
  if [[ ! "$v" =~ ^3\.[0-9]+$ ]]; then
    echo "fetch_device_wheels: '$v' is not a Python version like 3.12" >&2
    exit 2
  fi
  echo "fetch_device_wheels: $spec for CPython $v (manylinux x86_64)" >&2
  if ! pip_quiet "$pip_py" -m pip download -q --disable-pip-version-check --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --implementation cp --python-version "$v" -d "$out" "$spec"; then
    failed+=("$v")
  fi
done

# kvcore and its plugins as wheels, with the stamp of the sources they were built from; built from a
# copy of the tree so that setuptools' build/ and egg-info folders stay out of it.
rm -rf "$out/kvcore"
mkdir -p "$out/kvcore"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp -r pyproject.toml README.md kvcore plugins "$tmp/"
dists=("$tmp")
for p in "$tmp"/plugins/*/; do [ -f "$p/pyproject.toml" ] && dists+=("$p"); done
pip_quiet "$pip_py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out/kvcore" "${dists[@]}"
bash benchmarks/device_check.sh --print-stamp > "$out/kvcore/SOURCE-STAMP"

ls -1 "$out" "$out/kvcore" >&2
du -sh "$out" >&2
if [ ${#failed[@]} -gt 0 ]; then
  echo "fetch_device_wheels: no $spec wheels for CPython ${failed[*]} (see pip's message above)" >&2
  exit 1
fi
