"""Validation during training: held-out rows of the training data and the mean next-token loss over them."""
from __future__ import annotations

import torch

from data import iter_heldout_documents


def heldout_rows(data_cfg, tokenizer, seq_len: int, num_rows: int) -> torch.Tensor:
    """Held-out rows of seq_len tokens, each cut from one document (never across documents)."""
    rows = []
    for doc in iter_heldout_documents(data_cfg, tokenizer, min_tokens=seq_len, max_docs=None):
        for start in range(0, len(doc) - seq_len + 1, seq_len):
            rows.append(doc[start:start + seq_len])
            if len(rows) == num_rows:
                return torch.tensor(rows, dtype=torch.long)
    if not rows:
        raise ValueError(
            f"no held-out document has {seq_len} tokens; lower trainer.seq_len or point data.heldout at longer text")
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, batch_size: int, accelerator) -> float:
    """Mean next-token loss over held-out rows, split across ranks and summed in float64."""
    world, rank = accelerator.num_processes, accelerator.process_index
    usable = (len(rows) // world) * world or len(rows)  # equal work per rank (FSDP forwards are collective)
    mine = rows[:usable][rank::world] if usable >= world else rows
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i in range(0, len(mine), batch_size):
        batch = mine[i:i + batch_size].to(accelerator.device)
        with accelerator.autocast():  # FSDP2 models get no autocast wrapper from accelerate (see fsdp_plugin)
            out = model(input_ids=batch, labels=batch, use_cache=False, return_logits=False)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total[0] += out.loss.double() * n
        total[1] += n
    if world > 1 and usable >= world:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return (total[0] / total[1]).item()
