# Source this file: it prepares what building scfoundry needs, idempotently.
#  - CARGO_TARGET_DIR outside the repository (reused between builds and by CI when present);
#  - CMake >= 3.26 for the bundled static HDF5 (Debian 12 ships 3.25), from PyPI into a
#    small tools venv under ~/.cache/scfoundry.
set -euo pipefail
SCF_CACHE="${SCFOUNDRY_CACHE:-$HOME/.cache/scfoundry}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$SCF_CACHE/target}"
mkdir -p "$SCF_CACHE" "$CARGO_TARGET_DIR"
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_tools="$SCF_CACHE/tools-venv"
_need_cmake=1
if command -v cmake >/dev/null 2>&1; then
  _v="$(cmake --version | head -1 | awk '{print $3}')"
  if printf '3.26\n%s\n' "$_v" | sort -V -C; then _need_cmake=0; fi
fi
if [ "$_need_cmake" = 1 ]; then
  if [ ! -x "$_tools/bin/cmake" ]; then
    echo "toolchain: installing CMake from PyPI into $_tools (HDF5's bundled build needs >= 3.26)" >&2
    python3 -m venv "$_tools"
    "$_tools/bin/pip" install -q --disable-pip-version-check -r "$_repo/ci/requirements-build.txt"
  fi
  export PATH="$_tools/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "toolchain: cargo not found; install Rust from https://rustup.rs" >&2
  return 1 2>/dev/null || exit 1
fi
