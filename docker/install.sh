#!/usr/bin/env bash
# Install geonear from this source tree into the Python given as $1 (default python3) and
# check that the installed command runs. Used by the Dockerfile and by the packaging test.
set -euo pipefail
python="${1:-python3}"
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$python" -m pip install --no-cache-dir --disable-pip-version-check --quiet "$src"
# Check from elsewhere: in the source tree, ./geonear would shadow the installed package.
cd /
bindir="$(dirname "$("$python" -c 'import sys; print(sys.executable)')")"
"$bindir/geonear" --help >/dev/null
"$python" -c 'import geonear, geonear.service.server; print("geonear", geonear.__version__, "installed")'
