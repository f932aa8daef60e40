"""eval_suites.ruler: golden prompts of the eight NIAH tasks (checked against the protocol written out here, not
against the module's own constants), length fitting with the real default tokenizer, string_match_all with
oracle / empty / partial predictors, greedy decoding through the cache against full-forward argmax decoding,
and eval.py eval=ruler on a trained checkpoint."""

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data import load_tokenizer
from eval_suites import ruler

REPO = Path(__file__).resolve().parents[2]
LENGTH = 600

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HEAD = {True: "A special magic {t} is hidden within the following text. Make sure to memorize it. I will quiz you "
              "about the {t} afterwards.\n",
        False: "Some special magic {t} are hidden within the following text. Make sure to memorize it. I will quiz "
               "you about the {t} afterwards.\n"}
TAIL = {True: "\nWhat is the special magic {t} for {q} mentioned in the provided text? The special magic {t} for {q} "
              "mentioned in the provided text is",
        False: "\nWhat are all the special magic {t} for {q} mentioned in the provided text? The special magic {t} for "
               "{q} mentioned in the provided text are"}
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids|words) for (\S+) is: (\S+)\.")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
WORD_KEY = r"[a-z]+-[a-z]+"
VALUE_RE = {"numbers": re.compile(r"[1-9]\d{6}"), "uuids": re.compile(UUID)}
KEY_RE = {"words": re.compile(WORD_KEY), "uuids": re.compile(UUID)}

# task: haystack, key type, value type, needles (keys x values), seed-42 sample 0 at 600 tokens: queries, answers
GOLDEN = {
    "niah_single_1": ("noise", "words", "numbers", 1, ["chilly-napkin"], ["8999764"]),
    "niah_single_2": ("essay", "words", "numbers", 1, ["short-kitten"], ["8330978"]),
    "niah_single_3": ("essay", "words", "uuids", 1, ["basic-sandal"], ["14a7c36e-43d0-4690-9c8d-ff5dbbb5df43"]),
    "niah_multikey_1": ("essay", "words", "numbers", 4, ["zany-melon"], ["6558085"]),
    "niah_multikey_2": ("needle", "words", "numbers", 1, ["thick-turtle"], ["8652242"]),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, ["27417a76-aaa3-43c7-8f36-cdc897d044d5"],
                        ["b93367bb-64e2-4fdf-ac7b-54b4b33845db"]),
    "niah_multivalue": ("essay", "words", "numbers", 4, ["immense-canoe"],
                        ["4082681", "1110181", "5038221", "5658228"]),
    "niah_multiquery": ("essay", "words", "numbers", 4, ["new-pocket", "healthy-marble", "long-boat", "square-bottle"],
                        ["6207897", "5278953", "4103544", "2788533"]),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer({"type": "sentencepiece", "vocab_size": 8192})


@pytest.fixture(scope="module")
def essay():
    return ruler.load_haystack()


def test_essay_haystack_is_the_heldout_corpus_words(essay, tmp_path):
    import zstandard

    with open(REPO / "data/corpus/heldout.jsonl.zst", "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f).read()
    texts = [json.loads(line)["text"] for line in raw.decode().splitlines() if line.strip()]
    assert essay == [word for text in texts for word in text.split()]
    (tmp_path / "essays.txt").write_text("First  essay.\n\nIt has\ttwo sentences.")
    assert ruler.load_haystack(str(tmp_path / "essays.txt")) == ["First", "essay.", "It", "has", "two", "sentences."]


def _query_text(queries):
    return queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]


def _split(sample, single, value_type):
    t = value_type[:-1] if single else value_type
    q = _query_text(sample.queries)
    head, tail = HEAD[single].format(t=t), TAIL[single].format(t=t, q=q)
    assert sample.prompt.startswith(head) and sample.prompt.endswith(tail)
    return sample.prompt[len(head):-len(tail)]


def test_task_list_is_rulers_eight():
    assert ruler.TASK_NAMES == tuple(GOLDEN)
    for name, task in ruler.TASKS.items():
        haystack, key_type, value_type, num_needles, queries, _ = GOLDEN[name]
        assert (task.haystack, task.key_type, task.value_type) == (haystack, key_type, value_type)
        assert (task.num_keys * task.num_values, task.num_queries) == (num_needles, len(queries))
    with pytest.raises(ValueError, match="needle type"):
        ruler.NiahTask("bad", "noise", "words", "letters")
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.make_sample("niah_single_9", length=600, tokenizer=None)


@pytest.mark.parametrize("task", list(GOLDEN))
def test_golden_prompt(task, tokenizer, essay):
    haystack, key_type, value_type, num_needles, queries, answers = GOLDEN[task]
    sample = ruler.make_sample(task, length=LENGTH, tokenizer=tokenizer, essay_words=essay)
    assert (sample.queries, sample.answers) == (queries, answers)
    single = len(answers) == 1
    context = _split(sample, single, value_type)
    assert sample.input_ids == [tokenizer.eos_id] + tokenizer.encode(sample.prompt)
    adjectives, nouns = ruler.load_words()

    found = NEEDLE_RE.findall(context)
    assert all(kind == value_type for kind, _, _ in found)  # the needle keeps the plural type name
    for _, key, value in found:
        assert KEY_RE[key_type].fullmatch(key) and VALUE_RE[value_type].fullmatch(value)
        if key_type == "words":
            adjective, noun = key.split("-")
            assert adjective in adjectives and noun in nouns
    real = [(key, value) for key, value, _ in sample.needles]
    assert len(real) == num_needles
    assert sorted(real) == sorted((key, value) for _, key, value in found if (key, value) in real)
    asked = [v for q in queries for k, v in real if k == q]
    assert sorted(answers) == sorted(asked) == sorted(v for _, k, v in found if k in queries)
    if task == "niah_multiquery":
        assert answers == asked  # in the order the question names the keys
    depths = [depth for _, _, depth in sample.needles]
    assert depths == sorted(depths) and len(set(depths)) == len(depths)
    assert all(0 <= d <= 100 for d in depths)
    needle_lines = [f"One of the special magic {value_type} for {k} is: {v}." for k, v in real]

    n = sample.num_haystack
    if haystack in ("noise", "needle"):
        lines = context.split("\n")
        assert len(lines) == n + len(real)
        if haystack == "noise":
            assert len(found) == len(real)
            assert [line for line in lines if line not in needle_lines] == [NOISE_LINE] * n
        else:  # every other line is a distractor needle with its own key
            assert len(found) == n + len(real) and len({k for _, k, _ in found}) == len(found)
            assert all(NEEDLE_RE.fullmatch(line) for line in lines)
        for needle, depth in zip(needle_lines, depths):
            before = lines.index(needle)
            assert before - needle_lines.index(needle) == int(n * depth / 100)
    else:
        assert len(found) == len(real)
        text = context
        for needle in needle_lines:
            text = text.replace(" " + needle, "", 1) if " " + needle in text else text.replace(needle + " ", "", 1)
        assert text == " ".join(essay[:n])  # the corpus's first n words, whitespace collapsed
        # The essay's sentences end at '.', '!' or '?' before a space; a needle at depth d follows the first
        # int(sentences * d / 100) of them.
        sentences = len(re.findall(r"[.!?] ", text)) + 1
        for i, (needle, depth) in enumerate(zip(needle_lines, depths)):
            prefix = context[:context.index(needle)]
            for earlier in needle_lines[:i]:
                prefix = prefix.replace(earlier + " ", "", 1)
            assert len(re.findall(r"[.!?] ", prefix)) == int(sentences * depth / 100)


def test_samples_are_reproducible_and_depths_spread(tokenizer):
    first = ruler.make_sample("niah_single_1", length=400, tokenizer=tokenizer, index=3)
    again = ruler.make_sample("niah_single_1", length=400, tokenizer=tokenizer, index=3)
    assert first.prompt == again.prompt and first.answers == again.answers
    assert ruler.make_sample("niah_single_1", length=400, tokenizer=tokenizer, index=4).answers != first.answers
    assert ruler.make_sample("niah_single_1", length=400, tokenizer=tokenizer, index=3, seed=7).answers != \
        first.answers
    samples = ruler.build_samples("niah_single_1", length=400, tokenizer=tokenizer, num_samples=40)
    depths = [s.needles[0][2] for s in samples]
    assert min(depths) <= 10 and max(depths) >= 90 and len(set(depths)) >= 20
    assert len({s.answers[0] for s in samples}) == 40


@pytest.mark.parametrize("length", [1500, 4096])
def test_lengths_are_fitted_in_model_tokens(length, tokenizer, essay):
    # The most one haystack unit costs (a line of the noise / a distractor needle, an essay word), in tokens.
    unit = {"niah_single_1": 40, "niah_multikey_2": 40, "niah_multikey_3": 100}
    for task in ruler.TASK_NAMES:
        sample = ruler.make_sample(task, length=length, tokenizer=tokenizer, essay_words=essay, index=1)
        tokens = 1 + len(tokenizer.encode(sample.prompt))
        assert tokens == sample.prompt_tokens
        assert tokens + 128 <= length, task
        assert length - (tokens + 128) < unit.get(task, 12), (task, tokens)
    with pytest.raises(ValueError, match="without any haystack"):
        ruler.make_sample("niah_multiquery", length=300, tokenizer=tokenizer, essay_words=essay)


def _oracle(sample, fraction=1.0):
    """Answers read off the prompt: the keys from the question, their values from the needle sentences."""
    question = re.search(r"What (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\?",
                         sample.prompt).group(1)
    keys = re.split(r", and |, ", question)
    values = [v for key in keys for _, k, v in NEEDLE_RE.findall(sample.prompt) if k == key]
    kept = values[:math.ceil(len(values) * fraction)]
    return " " + ", ".join(kept).upper() + ".\nSome more text"


def test_string_match_all():
    refs = ["1234567", "abcdef01-0000-4000-8000-000000000000"]
    assert ruler.string_match_all(" 1234567 and ABCDEF01-0000-4000-8000-000000000000.", refs) == 1.0
    assert ruler.string_match_all(" 1234567 only", refs) == 0.5
    assert ruler.string_match_all("", refs) == 0.0
    assert ruler.string_match_all("123456", ["1234567"]) == 0.0
    assert ruler.string_match_all("the value is abcdef01.", ["ABCDEF01", "Value"]) == 1.0
    assert ruler.postprocess("  a\tb\x00c  ") == "a\nb\nc"


def test_scores_oracle_empty_and_partial(tokenizer, tmp_path):
    kwargs = {"lengths": [LENGTH, 700], "num_samples": 2, "log": None}
    oracle = ruler.evaluate(None, tokenizer, predict=_oracle, **kwargs)
    assert oracle["average"] == 100 and all(v == 100 for by in oracle["scores"].values() for v in by.values())
    empty = ruler.evaluate(None, tokenizer, predict=lambda s: "", **kwargs)
    assert empty["average"] == 0
    # 2 of 4 values for the four-answer tasks, and nothing for niah_single_1 at 700 tokens.
    half = ruler.evaluate(None, tokenizer, **kwargs, predict=lambda s: "" if (s.task, s.length) == (
        "niah_single_1", 700) else _oracle(s, 0.5))
    for task, by_length in half["scores"].items():
        expected = 50.0 if task in ("niah_multivalue", "niah_multiquery") else 100.0
        assert by_length == {str(LENGTH): expected, "700": 0.0 if task == "niah_single_1" else expected}
    assert half["average_by_length"] == {str(LENGTH): 87.5, "700": 75.0} and half["average"] == 81.25
    assert half["average_by_task"]["niah_multivalue"] == 50.0 and half["average_by_task"]["niah_single_1"] == 50.0
    assert len(half["samples"]) == 8 * 2 * 2
    assert {s["score"] for s in half["samples"] if s["task"] == "niah_multiquery"} == {0.5}

    json_path, png_path = ruler.write_report(half, tmp_path)
    assert json.loads(json_path.read_text())["scores"] == half["scores"] and png_path.stat().st_size > 0
    table = ruler.format_table(half).splitlines()
    assert table[0].split() == ["task", str(LENGTH), "700", "average"]
    assert table[-1].split() == ["average", "87.5", "75.0", "81.2"]
    assert next(line for line in table if line.startswith("niah_multiquery")).split()[1:] == ["50.0"] * 3


def _greedy_without_cache(model, ids, steps, eos):
    """Argmax decoding with a full forward over the whole sequence each step: (tokens before EOS, forwards run)."""
    seq = torch.tensor([ids])
    out = []
    with torch.no_grad():
        for step in range(steps):
            nxt = int(model(seq, use_cache=False).logits[0, -1].argmax())
            if nxt == eos:
                return out, step + 1
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out, steps


@pytest.mark.parametrize("mixer", ["gated_deltanet", "attention"])
def test_generation_is_greedy_through_the_cache(mixer, tokenizer):
    import models

    torch.manual_seed(0)
    model = models.build_model({"vocab_size": tokenizer.vocab_size, "hidden_size": 64, "num_layers": 2,
                                "num_heads": 2, "mixer": mixer, "mixer_kwargs": {"head_dim": 32} if mixer !=
                                "attention" else {}}).eval()
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, inp, out: fed.append(inp[0].shape[1]))
    result = ruler.evaluate(model, tokenizer, lengths=[300], tasks=["niah_single_1", "niah_multikey_3"],
                            num_samples=1, max_new_tokens=12, log=None)
    hook.remove()
    samples = [ruler.make_sample(t, length=300, tokenizer=tokenizer, max_new_tokens=12)
               for t in ("niah_single_1", "niah_multikey_3")]
    expected_fed = []
    for sample, record in zip(samples, result["samples"]):
        expected, forwards = _greedy_without_cache(model, sample.input_ids, 12, tokenizer.eos_id)
        assert record["prediction"] == tokenizer.decode(expected)
        expected_fed += [sample.prompt_tokens] + [1] * (forwards - 1)  # the prompt once, then one token a step
        assert record["answers"] == sample.answers and record["prompt_tokens"] == sample.prompt_tokens
    assert fed == expected_fed
    assert set(result) >= {"scores", "average", "average_by_length", "average_by_task", "samples", "lengths", "tasks"}
    assert ruler.format_table(result).splitlines()[0].split() == ["task", "300", "average"]


def _tiny_model(mixer, tokenizer, **config):
    import models

    torch.manual_seed(0)
    return models.build_model({"vocab_size": tokenizer.vocab_size, "hidden_size": 64, "num_layers": 2,
                               "num_heads": 2, "mixer": mixer, "mixer_kwargs": {"head_dim": 32} if mixer !=
                               "attention" else {}, **config}).eval()


@pytest.mark.parametrize("mixer", ["gated_deltanet", "attention"])
def test_a_cell_is_decoded_in_batches_with_the_answers_of_one_at_a_time(mixer, tokenizer):
    # One sample per generate() call costs max_new_tokens host-bound steps each; a cell's samples go through
    # together, and each row's greedy answer is still its own (checked against full-forward argmax decoding).
    model = _tiny_model(mixer, tokenizer)
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, inp, out: fed.append(tuple(inp[0].shape)))
    tasks, lengths, steps = ["niah_single_1", "niah_multikey_3"], [300, 340], 10
    result = ruler.evaluate(model, tokenizer, lengths=lengths, tasks=tasks, num_samples=3, max_new_tokens=steps,
                            batch_size=2, log=None)
    hook.remove()
    samples = [ruler.make_sample(t, length=n, tokenizer=tokenizer, index=i, max_new_tokens=steps)
               for t in tasks for n in lengths for i in range(3)]
    forwards = []
    for sample, record in zip(samples, result["samples"], strict=True):
        expected, count = _greedy_without_cache(model, sample.input_ids, steps, tokenizer.eos_id)
        assert record["prediction"] == tokenizer.decode(expected)
        assert (record["task"], record["length"], record["answers"]) == (sample.task, sample.length, sample.answers)
        forwards.append(count)
    # every cell of 3 in batches of 2 and 1: the padded prompts in one forward, then one token per row a step
    # until every row is done
    expected_fed = []
    for cell in range(0, len(samples), 3):
        for batch in ([cell, cell + 1], [cell + 2]):
            width = max(samples[i].prompt_tokens for i in batch)
            expected_fed += [(len(batch), width)] + [(len(batch), 1)] * (max(forwards[i] for i in batch) - 1)
    assert fed == expected_fed
    assert len(fed) <= 8 * steps  # one at a time would be 12 samples x 10 forwards
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        ruler.evaluate(model, tokenizer, lengths=[300], tasks=tasks, num_samples=1, batch_size=0, log=None)


def test_lengths_past_the_training_length_are_announced_once_without_transformers_reminder(tokenizer):
    from transformers.utils import logging as hf_logging

    model = _tiny_model("attention", tokenizer, max_position_embeddings=256)
    hf_logging.warning_once.cache_clear()  # the reminder is shown once per process: let this run show it again
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logger = logging.getLogger("transformers.generation.stopping_criteria")
    hf_logger.addHandler(handler)
    lines = []
    try:
        ruler.evaluate(model, tokenizer, lengths=[240, 300, 320], tasks=["niah_single_1"], num_samples=2,
                       max_new_tokens=4, log=lines.append)
    finally:
        hf_logger.removeHandler(handler)
    assert not [m for m in seen if "predefined maximum length" in m]
    notes = [line for line in lines if "max_position_embeddings" in line]
    assert notes == [("ruler: lengths 300, 320 go past the model's max_position_embeddings (256, its training "
                      "length): those cells measure length extrapolation")]
    assert len([line for line in lines if "over 2 samples" in line]) == 3  # one progress line per cell


def test_eval_py_ruler_on_a_trained_checkpoint(tmp_path):
    from tests.training.helpers import run_train, small_cfg

    run_dir = tmp_path / "run"
    run_train(small_cfg("trainer.max_steps=2", "trainer.val_every=0", "trainer.save_every=2"), run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "eval.py", f"checkpoint={run_dir}", "eval=ruler", "eval.lengths=[320,384]",
                          "eval.num_samples=1", "eval.max_new_tokens=8", "eval.tasks=[niah_single_1,niah_multivalue]",
                          "logger=none", "device=cpu"], check=False, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = run_dir / "eval" / "ruler_T320-384"
    report = json.loads((out / "ruler.json").read_text())
    assert report["lengths"] == [320, 384] and report["tasks"] == ["niah_single_1", "niah_multivalue"]
    assert len(report["samples"]) == 4 and report["checkpoint"].startswith(str(run_dir))
    assert all(s["prompt_tokens"] + 8 <= s["length"] for s in report["samples"])
    assert (out / "ruler.png").stat().st_size > 0
    assert re.search(r"^average\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d$", res.stdout, re.MULTILINE), res.stdout
