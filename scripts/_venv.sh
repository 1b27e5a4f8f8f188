# Sourced by scripts/demo and scripts/test: make sure .venv (Python 3.12) exists and holds the
# package with the extras named in $EXTRAS, then activate it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

find_python312() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for candidate in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      [ -x "$candidate" ] && { echo "$candidate"; return 0; }
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY312="$(find_python312)"; then
    echo "error: Python 3.12 is required (jax 0.11.2 needs >= 3.12; the GPU image runs 3.12)." >&2
    echo "       Put python3.12 on PATH, install it with pyenv (pyenv install 3.12), or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "creating $VENV with $PY312" >&2
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi

echo "installing jax-hybrid-attn[${EXTRAS:-}] into .venv" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT${EXTRAS:+[$EXTRAS]}"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
