#!/usr/bin/env bash
# Creates .venv in the repository root and installs cutefa into it (editable, with dev extras).
# torch is installed first, on its own, so pip settles the one large dependency before the rest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python3 -m venv .venv
.venv/bin/python -m pip install torch==2.13.0
.venv/bin/python -m pip install -e '.[dev]'
.venv/bin/python -c 'import torch, cutefa; print("cutefa ready; torch", torch.__version__)'
