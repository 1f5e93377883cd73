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
stamp="$(cat "${reqs[@]}" | sha256sum | cut -c1-16)"
if [ ! -f "$venv/.stamp-$stamp" ]; then
  echo "test: creating the Python venv $venv from ${reqs[*]}" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip
  for r in "${reqs[@]}"; do "$venv/bin/pip" install -q --disable-pip-version-check -r "$r"; done
  touch "$venv/.stamp-$stamp"
fi
export SCFOUNDRY_TEST_PYTHON="$venv/bin/python"

# Services the tests need are started here (see scripts/*-up.sh) and stopped on exit.
cleanup() { :; }
trap cleanup EXIT

"$venv/bin/python" scripts/check_registry.py
cargo build --release --locked
cargo test --release --locked
