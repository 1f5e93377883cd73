# Source this file (after scripts/toolchain.sh): it puts zig and cargo-zigbuild on PATH from a
# venv under ~/.cache/scfoundry keyed by ci/requirements-zig.txt's hash, and names the release
# target. The CPU release binary is built with
#   cargo zigbuild --release --locked --target "$SCF_ZIG_TARGET"
# which links against glibc 2.28's symbol versions (RHEL/Rocky 8, Debian 10, Ubuntu 18.10 and
# later), and lands in $CARGO_TARGET_DIR/$SCF_RELEASE_TRIPLE/release/scfoundry.
_zreq="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/ci/requirements-zig.txt"
_zstamp="$(sha256sum "$_zreq" | cut -c1-16)"
_zvenv="$SCF_CACHE/zig-venv"
if [ ! -f "$_zvenv/.stamp-$_zstamp" ]; then
  echo "zig: installing ziglang and cargo-zigbuild from PyPI into $_zvenv" >&2
  rm -rf "$_zvenv"
  python3 -m venv "$_zvenv"
  "$_zvenv/bin/pip" install -q --disable-pip-version-check -r "$_zreq"
  touch "$_zvenv/.stamp-$_zstamp"
fi
export PATH="$_zvenv/bin:$PATH"
# glibc version floor of the release binary; scripts/test.sh checks the built binary against it
export SCF_GLIBC_FLOOR="${SCF_GLIBC_FLOOR:-2.28}"
export SCF_RELEASE_TRIPLE="${SCF_RELEASE_TRIPLE:-x86_64-unknown-linux-gnu}"
export SCF_ZIG_TARGET="$SCF_RELEASE_TRIPLE.$SCF_GLIBC_FLOOR"
