#!/usr/bin/env bash
# Print the path of a Python interpreter of the wanted minor version (default 3.12), looking on
# PATH and in pyenv's versions (machines of this kind carry 3.12 there beside the default 3.11).
set -euo pipefail
want="${1:-3.12}"
candidates=("python$want")
for dir in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin; do
  [ -x "$dir/python$want" ] && candidates+=("$dir/python$want")
done
candidates+=("/usr/bin/python$want" "/usr/local/bin/python$want")
for py in "${candidates[@]}"; do
  if "$py" -c "import sys, venv; assert sys.version_info[:2] == tuple(map(int, '$want'.split('.')))" >/dev/null 2>&1; then
    command -v "$py" || echo "$py"
    exit 0
  fi
done
echo "error: Python $want not found (looked on PATH and in pyenv); install it, or set PYTHON=/path/to/python$want" >&2
exit 1
