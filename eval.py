"""hilo evaluation entry point.

    python eval.py checkpoint=runs/<name> eval=ppl_by_position [eval.seq_len=4096 eval.num_documents=32]

Loads the checkpoint's model (AutoModelForCausalLM after `import models`), its tokenizer and the held-out data of
its training config, runs the suite and writes JSON + PNG next to the checkpoint (and to the run's W&B run).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SUITES = ("ppl_by_position",)


def run(cfg: DictConfig) -> dict:
    from data import iter_heldout_documents
    from eval_suites import ppl_by_position
    from training import load_checkpoint_model, load_checkpoint_tokenizer, resolve_checkpoint, resolve_wandb_mode

    suite = cfg.eval.suite
    if suite not in SUITES:
        raise ValueError(f"eval={suite!r} is not a known suite; choose one of {', '.join(SUITES)}")
    ckpt = resolve_checkpoint(cfg.checkpoint)  # clear FileNotFoundError when missing
    train_cfg = OmegaConf.load(ckpt / "config.yaml")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available; use device=auto or device=cpu")
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = {"auto": torch.bfloat16 if use_cuda else torch.float32, "fp32": torch.float32,
             "bf16": torch.bfloat16}[cfg.dtype]

    tokenizer = load_checkpoint_tokenizer(ckpt)
    model = load_checkpoint_model(ckpt, dtype=dtype).to(device).eval()
    data_cfg = OmegaConf.to_container(cfg.data if cfg.data is not None else train_cfg.data, resolve=True)

    ev = cfg.eval
    docs = list(iter_heldout_documents(data_cfg, tokenizer, min_tokens=int(ev.seq_len) + 1,
                                       max_docs=int(ev.num_documents)))
    result = ppl_by_position.evaluate(model, docs, seq_len=int(ev.seq_len), batch_size=int(ev.batch_size),
                                      device=device, train_len=int(train_cfg.trainer.seq_len),
                                      smooth_window=ev.smooth_window)
    result["checkpoint"] = str(ckpt)
    out_dir = Path(ev.out_dir) if ev.out_dir else ckpt.parent.parent / "eval" / f"{suite}_T{ev.seq_len}"
    json_path, png_path = ppl_by_position.write_report(result, out_dir, title=f"{train_cfg.name} ({ckpt.name})")
    print(f"{suite}: ppl {result['ppl']:.3f} over {result['num_documents']} documents of {ev.seq_len} tokens")
    print(f"wrote {json_path} and {png_path}")

    mode = resolve_wandb_mode(str(cfg.logger.mode))
    if mode != "disabled":
        import wandb

        state = json.loads((ckpt / "trainer_state.json").read_text())
        run = wandb.init(project=cfg.logger.project, entity=cfg.logger.entity, id=state.get("wandb_id"),
                         resume="allow", dir=str(ckpt.parent.parent), mode=mode, name=str(train_cfg.name))
        ppl_by_position.log_to_wandb(result, run)
        run.finish()
    return {"ppl": result["ppl"], "json": str(json_path), "png": str(png_path)}


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
