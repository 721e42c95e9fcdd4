"""What the engines' tests and the benches share, on the real engines, nothing mocked:

* `decoder` — the decoder's side (MLX, mlx-lm, `pdbridge_mlx`): its reconstruction bundle and its
  own cache and layer inputs for a prompt;
* `prefill` — the prefill side (vLLM, `pdbridge_vllm`): prefilld's end of the plugin's socket, a
  vLLM server started the way prefilld starts it, prompts of real text.

Installed editable by `scripts/setup-engines.sh` (cpu profile): the paths below are the checkout's.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")
# The test model (scripts/prepare-model.py): the decoder's mlx-lm folder and vLLM's HF folder.
HF_DIR = REPO / "models" / "smollm2-hf"
MLX_DIR = REPO / "models" / "smollm2-mlx"
NUM_LAYERS = 30
