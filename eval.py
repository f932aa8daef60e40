"""hilo evaluation entry point.

    python eval.py checkpoint=<name> eval=ppl_by_position [eval.seq_len=4096 eval.num_documents=32]
    python eval.py checkpoint=<name> eval=ruler eval.lengths=[4096,8192,16384] [eval.num_samples=25]
    python eval.py checkpoint=<mqar run> eval=mqar                 # a run trained with data=mqar
    python eval.py checkpoint=<name> eval=lm_harness [eval.tasks=[piqa,arc_easy] eval.batch_size=16]
    python eval.py checkpoint=/path/to/run/checkpoints/step_00000300 ...

checkpoint= is a path (absolute, or relative to the working directory) when one exists there, else a run name or a
path under paths.runs (conf/paths/default.yaml), where train.py puts its runs.

Loads the checkpoint's model (AutoModelForCausalLM after `import models`) and tokenizer, the held-out data of its
training config (or `data=...`), runs the suite and writes JSON + PNG beside the checkpoint, and to the run's
W&B run unless `logger=none`. A checkpoint whose saved weights do not match its model (missing or unexpected
tensors) is refused unless `eval.allow_partial_weights=true` (docs/robustness.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

REPO_ROOT = Path(__file__).resolve().parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from training.config import anchor_paths, locate_checkpoint, runs_dir  # registers ${hilo.root:} before Hydra composes


def run(cfg: DictConfig) -> dict:
    from training import resolve_checkpoint, resolve_wandb_mode
    from training.evaluation import evaluate_checkpoint

    anchor_paths(cfg)
    ckpt = resolve_checkpoint(locate_checkpoint(cfg.checkpoint, runs_dir(cfg)))  # FileNotFoundError naming the fix
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available; use device=auto or device=cpu")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    dtypes = {"auto": torch.bfloat16 if use_cuda else torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}
    if cfg.dtype not in dtypes:
        raise ValueError(f"dtype={cfg.dtype!r}: expected one of {', '.join(dtypes)}")

    wandb_run = None
    mode = resolve_wandb_mode(str(cfg.logger.mode))
    if mode != "disabled":
        import wandb

        state = json.loads((ckpt / "trainer_state.json").read_text())
        wandb_run = wandb.init(project=cfg.logger.project, entity=cfg.logger.entity, id=state.get("wandb_id"),
                               resume="allow", dir=str(ckpt.parent.parent), mode=mode)
    result = evaluate_checkpoint(ckpt, cfg.eval, device=torch.device("cuda" if use_cuda else "cpu"),
                                 dtype=dtypes[cfg.dtype], data_cfg=cfg.data, wandb_run=wandb_run)
    if wandb_run is not None:
        wandb_run.finish()
    if cfg.eval.suite == "ruler":
        from eval_suites import ruler

        print(f"ruler: string_match_all (%), {cfg.eval.num_samples} samples per task and length")
        print(ruler.format_table(result))
    elif cfg.eval.suite == "lm_harness":
        from eval_suites import lm_harness

        print(lm_harness.format_table(result))
    elif cfg.eval.suite == "mqar":
        from eval_suites import mqar

        print("mqar: accuracy at the query positions")
        print(mqar.format_table(result))
    else:
        print(f"{cfg.eval.suite}: ppl {result['ppl']:.3f} over {result['num_documents']} documents of "
              f"{cfg.eval.seq_len} tokens")
    print(f"wrote {result['json_path']}" + (f" and {result['png_path']}" if result.get("png_path") else ""))
    return result


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
