#!/usr/bin/env bash
# Validate scfoundry's Nextflow files with the real parsers that install without Nextflow:
#   - every config (nextflow.config, conf/*.config, and any FILE given) with Groovy's
#     ConfigSlurper, plain and under each of its profiles, includeConfig followed;
#   - every .nf file (main.nf, workflows/, modules/local/) with Groovy's compiler (syntax) and
#     with reftrace (Nextflow-aware), plus our own rules in scripts/check_nf.py.
#
#   scripts/validate-nextflow.sh [EXTRA.config ...]
#
# Installs nothing. Needs `groovy` (apt-get install -y groovy; Groovy 2.4 on OpenJDK 17) and
# the reftrace package in $REFTRACE_PYTHON (default python3; pip install -r
# ci/requirements-nextflow.txt). Exit 0: all valid; 1: a file is invalid; 3: a tool is missing.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${REFTRACE_PYTHON:-python3}

if ! command -v groovy >/dev/null 2>&1; then
    echo "validate-nextflow: groovy not found: apt-get install -y groovy" >&2
    exit 3
fi
# Debian's groovy looks for /usr/lib/jvm/default-java unless JAVA_HOME is set
if [ -z "${JAVA_HOME:-}" ] && [ ! -x /usr/lib/jvm/default-java/bin/java ]; then
    java=$(command -v java || true)
    [ -n "$java" ] || { echo "validate-nextflow: java not found (groovy needs OpenJDK 17)" >&2; exit 3; }
    JAVA_HOME=$(dirname "$(dirname "$(readlink -f "$java")")")
    export JAVA_HOME
fi
if ! "$PY" -c 'import reftrace' >/dev/null 2>&1; then
    echo "validate-nextflow: the reftrace package is missing in $PY: $PY -m pip install -r ci/requirements-nextflow.txt (or set REFTRACE_PYTHON)" >&2
    exit 3
fi

cd "$ROOT"
args=()
for f in nextflow.config conf/*.config; do args+=(--config "$f"); done
for f in "$@"; do args+=(--config "$f"); done
nf=(main.nf workflows/*.nf modules/local/*/main.nf)
for f in "${nf[@]}"; do args+=(--nf "$f"); done

status=0
groovy scripts/NextflowCheck.groovy "${args[@]}" || status=1
"$PY" scripts/check_nf.py "${nf[@]}" || status=1
if [ $status -eq 0 ]; then
    echo "validate-nextflow: all files valid" >&2
else
    echo "validate-nextflow: invalid files above" >&2
fi
exit $status
