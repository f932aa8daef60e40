"""The remote code of a hilo model directory (transformers' trust_remote_code), copied there by
HiloConfig.save_pretrained and named by config.json's auto_map:

    AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)   # no `import models`

It holds no model code of its own: it imports hilo's installed packages (`models`, and `kernels` under them), so
the model that loads is hilo's HiloForCausalLM with its Triton kernels, the same classes `import models` registers.
Where hilo is not installed the load stops here with an ImportError saying what to install (docs/checkpoints.md).
"""

try:  # transformers' check of a remote module's imports skips try blocks: the message below is the one shown
    from models import HiloConfig, HiloForCausalLM, HiloModel
except ImportError as e:
    raise ImportError(
        f"this model directory runs hilo's model code (its HiloForCausalLM and Triton kernels are hilo's installed "
        f"packages `models` and `kernels`), which cannot be imported here ({e}). Install hilo in this environment "
        f"(`pip install -e <hilo checkout>`, or put the checkout first on PYTHONPATH), then load again. A hilo "
        f"transformer or mamba2 (mlp=false) model can instead be exported to plain transformers classes that need "
        f"no hilo: `python -m training.convert export <checkpoint> <out dir>`") from e

__all__ = ["HiloConfig", "HiloForCausalLM", "HiloModel"]
