"""Validation of a run with data.retrieval_mix on: held-out needle documents scored teacher-forced
(training.validation.needle_set, evaluate_needles) and logged as val/needle_acc by the trainer."""
import pytest
import torch
from torch import nn

from data import load_tokenizer
from data.retrieval_mix import heldout_needle_documents
from tests.training.helpers import metrics, run_train, small_cfg
from training.validation import IGNORE_INDEX, evaluate_needles, needle_set

SEQ_LEN = 300
TASKS = ["niah_single_1", "niah_single_2"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer({"type": "sentencepiece", "vocab_size": 8192})


@pytest.fixture(scope="module")
def needles(tok):
    docs = heldout_needle_documents({"tasks": TASKS}, tok, seq_len=SEQ_LEN, seed=0, num=6,
                                    essay_words=["a", "long", "essay", "about", "nothing", "in", "particular"])
    return docs, needle_set(docs, tok, SEQ_LEN)


class Oracle(nn.Module):
    """A model whose top prediction after each token of a known row is that row's next token, except at the k-th
    answer token of each (row, k) in `wrong`; it keeps only the logits asked for, or returns every position."""

    def __init__(self, batch, vocab, wrong=(), keeps=True):
        super().__init__()
        self.inputs, self.vocab, self.keeps = batch["inputs"], vocab, keeps
        self.next = torch.cat([self.inputs[:, 1:], self.inputs[:, -1:]], 1)
        for row, k in wrong:
            at = int((batch["labels"][row] != IGNORE_INDEX).nonzero()[k])
            self.next[row, at] = (self.next[row, at] + 1) % vocab

    def forward(self, input_ids, use_cache=False, logits_to_keep=None):
        rows = [int((self.inputs == r).all(-1).nonzero()) for r in input_ids]
        logits = nn.functional.one_hot(self.next[rows], self.vocab).float()
        if self.keeps and logits_to_keep is not None:
            logits = logits[:, logits_to_keep]
        return type("Out", (), {"logits": logits})()


def test_the_labels_are_the_answer_tokens_after_the_prompt(tok, needles):
    docs, batch = needles
    assert batch["inputs"].shape == batch["labels"].shape == (len(docs), SEQ_LEN)
    assert batch["tasks"] == [d.task for d in docs]
    for doc, ids, labels in zip(docs, batch["inputs"], batch["labels"], strict=True):
        n = len(doc.input_ids)
        assert ids[:n].tolist() == doc.input_ids and (ids[n:] == tok.eos_id).all()
        at = (labels != IGNORE_INDEX).nonzero().squeeze(-1)
        assert labels[at].tolist() == tok.encode(doc.answer)  # the answer's tokens, one span
        assert at.tolist() == list(range(int(at[0]), int(at[0]) + len(at)))
        assert (labels[at] == ids[at + 1]).all()  # each predicted from the token before it
        assert at[-1] + 1 == n - 2 and ids[n - 1] == tok.eos_id  # the last answer token, then the closing EOS


@pytest.mark.parametrize("keeps", [True, False])
def test_scores_count_documents_wholly_right_and_tokens(tok, needles, keeps):
    _, batch = needles
    vocab = tok.vocab_size
    right = evaluate_needles(Oracle(batch, vocab, keeps=keeps), batch, batch_size=4, device="cpu")
    assert right == {"val/needle_acc": 1.0, "val/needle_token_acc": 1.0, "val/needle_acc/niah_single_1": 1.0,
                     "val/needle_acc/niah_single_2": 1.0}
    # rows 0 and 2 are niah_single_1: one wrong token each; row 1 (niah_single_2) two wrong tokens
    model = Oracle(batch, vocab, wrong=[(0, 0), (2, 3), (1, 0), (1, 1)], keeps=keeps)
    scored = evaluate_needles(model, batch, batch_size=4, device="cpu")
    tokens = int((batch["labels"] != IGNORE_INDEX).sum())
    assert scored["val/needle_acc"] == pytest.approx(3 / 6)
    assert scored["val/needle_token_acc"] == pytest.approx(1 - 4 / tokens)
    assert scored["val/needle_acc/niah_single_1"] == pytest.approx(1 / 3)
    assert scored["val/needle_acc/niah_single_2"] == pytest.approx(2 / 3)


def test_a_run_with_the_mix_logs_needle_accuracy(tmp_path):
    cfg = small_cfg("model=transformer", "trainer.seq_len=256", "trainer.batch_size=2", "trainer.max_steps=2",
                    "trainer.val_every=2", "trainer.val_batches=1", "trainer.save_every=0", "trainer.device=cpu",
                    "trainer.final_eval=false", "data.retrieval_mix.fraction=0.5", f"data.retrieval_mix.tasks={TASKS}")
    run_train(cfg, tmp_path / "run")
    val = [r for r in metrics(tmp_path / "run") if "val/loss" in r]
    assert [r["step"] for r in val][-1] == 2
    for row in val:
        assert set(row) >= {"val/needle_acc", "val/needle_token_acc", *(f"val/needle_acc/{t}" for t in TASKS)}
        assert all(0 <= row[k] <= 1 for k in row if k.startswith("val/needle"))
