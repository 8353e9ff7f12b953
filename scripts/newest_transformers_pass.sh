#!/usr/bin/env bash
# CI's second pass: a short run of the suite against the newest transformers the package registry
# serves (everything else as installed from constraints.txt), so a new transformers release that
# breaks the exporter shows before users meet it. Runs in a venv layered on the installed
# environment; the environment itself is left as it is.
#   L3 + L4 on three families (Gemma 4, Llama, Qwen3), L1 on Gemma 4 (multimodal and E2B's shape),
#   and every layer class copied rather than traced against a trace of every layer (a new release
#   whose layer forward branched on its index would show there).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${NEWEST_VENV:-${TMPDIR:-/tmp}/genai-exporter-newest-transformers}"
python -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --upgrade --upgrade-strategy only-if-needed "transformers<6"
"$venv/bin/python" -c "import transformers; print('second pass on transformers', transformers.__version__)"
"$venv/bin/python" -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider \
  -m "l3 or l4" -k "tiny-gemma-4 or tiny-llama or tiny-qwen3" \
  tests/exporter/test_parity.py tests/exporter/test_generation.py
"$venv/bin/python" -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider \
  -m l1 tests/exporter/test_multimodal.py tests/exporter/test_e2b_shape.py
"$venv/bin/python" -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider tests/exporter/trace/test_layer_replicas.py
