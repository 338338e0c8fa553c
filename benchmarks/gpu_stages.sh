#!/usr/bin/env bash
# The GPU check of the stages themselves (benchmarks/gpu_stages.py): the default's rl stage from the SFT model,
# the eval verdict (RL against SFT), and rl on random Qwen2.5-VL models at 3B and 7B width (7B with LoRA) and on
# random Qwen3-VL and Qwen3.5 models at 8B and 9B width, on a
# bare GPU machine that has torch, transformers and peft but no network, no vLLM, no Ray and no pydantic.
# It installs the wheels carried in .whl/ into /tmp/site (nothing else is installed), prints the GPU and the
# versions, then runs gpu_stages.py with this script's arguments; logs and gpu_stages.json go to $OUT.
#
# Here, before the lease:  make run          (leaves work/sft/model)
#                          make gpu-bundle   (cp312 wheels into .whl/, about 3 MB; checks work/sft/model)
# Carry .whl and work/sft/model, then on the GPU machine, from the checkout's root (about 7 minutes):
#     OUT=gpu-out bash benchmarks/gpu_stages.sh                  # every leg
#     bash benchmarks/gpu_stages.sh --legs bc --set rl.ray.colocate=true   # gpu_stages.py's options pass through
set -u
export OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
site=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "gpu_stages.sh: installing .whl/ failed (cp312 wheels: is python3 3.12?)"; exit 1; }
else
  echo "gpu_stages.sh: no .whl/ here (make gpu-bundle makes it); using what the machine has"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LOUPE_TRACKING=off PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: no GPU"
python3 - <<'EOF'
import importlib.util, platform
import torch, transformers
try:
    import peft
    peft_version = peft.__version__
except ImportError:
    peft_version = "missing (leg e's LoRA fails)"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, peft {peft_version}")
# What the rl and eval stages import beyond torch, transformers and peft (LOUPE_TRACKING=off, Ray off).
needed = ("pydantic", "yaml", "PIL", "numpy", "matplotlib", "scipy", "tqdm", "safetensors", "jinja2", "math_verify")
missing = [name for name in needed if importlib.util.find_spec(name) is None]
print("missing modules: " + (", ".join(missing) if missing else "none"))
EOF
python3 benchmarks/gpu_stages.py "$@" 2>&1 | tee "$OUT/gpu_stages.log"
exit "${PIPESTATUS[0]}"
