#!/usr/bin/env bash
# The newest glibc symbol version a binary needs, from its dynamic symbol table (objdump -T).
#
#   scripts/check-glibc.sh BINARY          # prints e.g. "GLIBC_2.28"
#   scripts/check-glibc.sh BINARY 2.28     # and fails when the binary needs a newer glibc
set -euo pipefail
bin=${1:?usage: check-glibc.sh BINARY [FLOOR]}; floor=${2:-}
[[ -f $bin ]] || { echo "check-glibc: no binary at $bin" >&2; exit 1; }
need=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/^GLIBC_//' | sort -uV | tail -1)
[[ -n $need ]] || { echo "check-glibc: $bin has no GLIBC_ symbol versions (static, or not a glibc binary)" >&2; exit 1; }
echo "GLIBC_$need"
if [[ -n $floor ]] && ! printf '%s\n%s\n' "$need" "$floor" | sort -V -C; then
  echo "check-glibc: $bin needs GLIBC_$need, newer than the supported floor $floor" >&2
  objdump -T "$bin" | grep -F "GLIBC_$need" | head -5 >&2
  exit 1
fi
