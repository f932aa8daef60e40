"""data.retrieval_mix: needle documents in place of training rows. Rows are checked against RULER's format written
out here (regexes, not the module's templates), against the plain loader's rows at the same positions (the rest of
the stream unchanged, essay haystacks made of the replaced row's text), across loaders, resumes and ranks, and the
bad settings' errors; data.niah's interpolated haystack search against a brute-force scan."""

import hashlib
import json
import random
import re

import pytest
import torch
from omegaconf import OmegaConf

from data import build_train_loader, load_tokenizer
from data.niah import _interpolated_fitting, _largest_fitting
from data.retrieval_mix import min_seq_len
from data.sources import REPO_ROOT
from tests.data.helpers import jsonl_lines, make_docs, write_jsonl

SEQ_LEN = 400  # fits every task's document with a short haystack, and keeps the tests fast
ALL_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
             "niah_multikey_3", "niah_multivalue", "niah_multiquery"]
ESSAY_TASKS = {"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"}
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
QUESTION_RE = re.compile(r"\nWhat (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\? The "
                         r"special magic \w+ for \1 mentioned in the provided text (?:is|are)$")
HEAD_RE = re.compile(r"^(A|Some) special magic \w+ (is|are) hidden within the following text\. Make sure to memorize "
                     r"it\. I will quiz you about the \w+ afterwards\.\n")
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer({"type": "sentencepiece", "vocab_size": 8192})


def cfg(packing="fixed", fraction=None, tasks=ALL_TASKS, **extra):
    """The shipped default data config (the embedded corpus), without prefetching unless asked."""
    out = {**OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf/data/default.yaml")), "packing": packing,
           "prefetch": 0, **extra}
    if fraction is None:
        del out["retrieval_mix"]  # the loader as it was before the mix existed
    else:
        out["retrieval_mix"] = {"fraction": fraction, "tasks": tasks}
    return out


def take(loader, n):
    return [next(loader) for _ in range(n)]


def rows_of(batch, seq_len=SEQ_LEN):
    """(input_ids, labels) per row as lists, for either layout."""
    ids, labels = batch["input_ids"].reshape(-1, seq_len), batch["labels"].reshape(-1, seq_len)
    return list(zip(ids.tolist(), labels.tolist()))


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def parse_needle_row(ids, labels, tok):
    """A needle row written out from RULER's protocol: [eos] prompt answer [eos], then EOS padding with ignored
    labels. Returns (whether the template is the singular one, the context, the answer's values, the padding
    length)."""
    eos = tok.eos_id
    assert ids[0] == eos, "a needle document opens with EOS"
    end = ids.index(eos, 1) + 1  # the document's closing EOS: none of its text tokens is EOS
    assert all(t == eos for t in ids[end:]), "EOS padding after the document"
    # the LM loss over the whole document (its opening EOS ignored under varlen, as any document's first token)
    assert labels[1:end] == ids[1:end] and labels[0] in (eos, -100) and all(lab == -100 for lab in labels[end:])
    text = tok.decode(ids[1:end - 1])
    head = HEAD_RE.match(text)
    assert head, text[:200]
    answer_at = text.rindex(" mentioned in the provided text ") + len(" mentioned in the provided text ")
    answer_at = text.index(" ", answer_at)  # after "is" / "are"
    prompt, answer = text[:answer_at], text[answer_at:]
    assert ids[1:1 + len(tok.encode(prompt))] == tok.encode(prompt), "the prompt's tokens are an eval sample's"
    question = QUESTION_RE.search(prompt)
    assert question, prompt[-300:]
    context = prompt[head.end():question.start()]
    keys = re.split(r", and |, ", question.group(1))
    needles = NEEDLE_RE.findall(context)
    # the answer comes after the question: every value of the asked keys, key by key in the question's order
    assert answer.startswith(" ") and answer.endswith(".")
    said = re.split(r", and |, ", answer[1:-1])
    values = []
    for key in keys:
        of_key = [v for _, k, v in needles if k == key]
        assert of_key and sorted(said[len(values):len(values) + len(of_key)]) == sorted(of_key), (key, answer)
        values += said[len(values):len(values) + len(of_key)]
    assert said == values and (len(said) == 1) == (head.group(1) == "A")
    return head.group(1) == "A", context, values, len(ids) - end


def test_fraction_zero_is_the_plain_stream(tok, tmp_path):
    # two sources of short documents, so a change to the loader's source draws would show too
    for k in range(2):
        write_jsonl(tmp_path / f"s{k}.jsonl", jsonl_lines(make_docs(f"s{k}_", 40, seed=k, max_len=300)))
    sources = [{"type": "files", "paths": [str(tmp_path / f"s{k}.jsonl")], "weight": w}
               for k, w in ((0, 0.6), (1, 0.4))]
    for packing in ("fixed", "varlen"):
        plain = take(build_train_loader(cfg(packing, sources=sources), tok, seq_len=SEQ_LEN, batch_size=3, seed=5), 6)
        shipped = {**cfg(packing, sources=sources), "retrieval_mix": OmegaConf.to_container(
            OmegaConf.load(REPO_ROOT / "conf/data/default.yaml"))["retrieval_mix"]}
        assert shipped["retrieval_mix"]["fraction"] == 0
        for data_cfg in (shipped, cfg(packing, 0.0, sources=sources), cfg(packing, 0, sources=sources)):
            loader = build_train_loader(data_cfg, tok, seq_len=SEQ_LEN, batch_size=3, seed=5)
            assert_same(take(loader, 6), plain)
            assert loader.stats["retrieval_rows"] == 0


@pytest.mark.parametrize("packing", ["fixed", "varlen"])
def test_fraction_one_rows_are_needle_documents(tok, packing):
    loader = build_train_loader(cfg(packing, 1.0), tok, seq_len=SEQ_LEN, batch_size=4, seed=3)
    plain = build_train_loader(cfg(packing), tok, seq_len=SEQ_LEN, batch_size=4, seed=3)
    kinds = set()
    for _ in range(6):
        batch, reference = next(loader), next(plain)
        assert batch["input_ids"].numel() == 4 * SEQ_LEN
        for row, ((ids, labels), (plain_ids, _)) in enumerate(zip(rows_of(batch), rows_of(reference))):
            _, context, values, pad = parse_needle_row(ids, labels, tok)
            if packing == "varlen":  # the document and its padding are segments of their own, positions from 0
                ends = [c - row * SEQ_LEN for c in batch["cu_seqlens"].tolist() if 0 < c - row * SEQ_LEN <= SEQ_LEN]
                assert ends == ([SEQ_LEN - pad] if pad else []) + [SEQ_LEN]
                positions = batch["position_ids"][0, row * SEQ_LEN:(row + 1) * SEQ_LEN].tolist()
                assert positions == list(range(SEQ_LEN - pad)) + list(range(pad))
            words = " ".join(tok.decode(part) for part in _split(plain_ids, tok.eos_id)).split()
            lines = context.split("\n")
            if all(line == NOISE_LINE or NEEDLE_RE.fullmatch(line) for line in lines) and NOISE_LINE in lines:
                kinds.add("noise")
                assert pad < 40  # one noise line is about 25 tokens
            elif all(NEEDLE_RE.fullmatch(line) for line in lines) and len(lines) > len(values):
                kinds.add("needle")
                assert pad < 100  # a distractor needle of uuids is about 60 tokens
            else:  # essay: the replaced plain row's words, in order, the needles taken out
                kinds.add("essay")
                haystack = NEEDLE_RE.sub("", context).split()
                assert haystack and haystack == (words * (1 + len(haystack) // len(words)))[:len(haystack)]
                assert pad < 12  # one word
        assert loader.stats["retrieval_rows"] == loader.stats["rows"]
    assert kinds == {"noise", "needle", "essay"}


def _split(ids, eos):
    parts, current = [], []
    for t in ids:
        if t == eos:
            parts.append(current)
            current = []
        else:
            current.append(t)
    return [p for p in parts + [current] if p]


def documented_rule(seed, rank, row, fraction):
    """docs/configuration.md: row i is replaced when the first draw of a Random seeded by a hash of (train-niah,
    seed, rank, i) is below fraction (a namespace RULER's ruler/<seed>/<task>/<length>/<index> seeds never use)."""
    digest = hashlib.sha256(f"train-niah/{seed}/{rank}/{row}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little")).random() < fraction


@pytest.mark.parametrize("rank", [0, 1])
def test_other_rows_are_the_plain_rows_and_fraction_is_followed(tok, rank):
    kw = {"seq_len": SEQ_LEN, "batch_size": 5, "seed": 1, "rank": rank, "world_size": 2}
    mixed = build_train_loader(cfg("fixed", 0.3, ["niah_single_1"]), tok, **kw)
    plain = build_train_loader(cfg("fixed"), tok, **kw)
    replaced = []
    for step in range(12):
        for i, ((ids, labels), (plain_ids, plain_labels)) in enumerate(zip(rows_of(next(mixed)),
                                                                          rows_of(next(plain)))):
            if ids[0] == tok.eos_id and tok.decode(ids[1:20]).startswith("A special magic"):
                parse_needle_row(ids, labels, tok)
                replaced.append(step * 5 + i)
            else:
                assert (ids, labels) == (plain_ids, plain_labels)
    assert replaced == [row for row in range(60) if documented_rule(1, rank, row, 0.3)]
    assert 8 <= len(replaced) <= 28 and mixed.stats["retrieval_rows"] == len(replaced)  # 0.3 of 60 rows


@pytest.mark.parametrize("packing", ["fixed", "varlen"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_deterministic_across_loaders_and_resume(tok, packing, prefetch):
    data_cfg = cfg(packing, 0.5, ["niah_single_1", "niah_single_2", "niah_multikey_3"], prefetch=prefetch)
    kw = {"seq_len": SEQ_LEN, "batch_size": 3, "seed": 11, "rank": 1, "world_size": 2}
    reference = take(build_train_loader(data_cfg, tok, **kw), 8)
    assert_same(take(build_train_loader(data_cfg, tok, **kw), 8), reference)
    first = build_train_loader(data_cfg, tok, **kw)
    head = take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build_train_loader(data_cfg, tok, **kw)
    resumed.load_state_dict(state)
    assert_same(head + take(resumed, 5), reference)
    assert resumed.stats["retrieval_rows"] == sum(
        ids[0] == tok.eos_id and "special magic" in tok.decode(ids[:40]) for b in reference for ids, _ in rows_of(b))
    for loader in (first, resumed):
        if hasattr(loader, "close"):
            loader.close()


def test_a_state_saved_before_the_row_count_resumes(tok):
    data_cfg = cfg("fixed", 0.5, ["niah_single_1"])
    kw = {"seq_len": SEQ_LEN, "batch_size": 2, "seed": 2}
    first = build_train_loader(data_cfg, tok, **kw)
    take(first, 3)
    state = first.state_dict()
    reference = take(first, 4)
    del state["counters"]["rows"], state["counters"]["retrieval_rows"]
    resumed = build_train_loader(data_cfg, tok, **kw)
    resumed.load_state_dict(state)
    assert_same(take(resumed, 4), reference)


def test_ranks_differ_and_row_sharding_is_world_size_invariant(tok):
    data_cfg = cfg("fixed", 0.5, ["niah_single_1"])
    per_rank = [[r for b in take(build_train_loader(data_cfg, tok, seq_len=SEQ_LEN, batch_size=4, seed=0, rank=rank,
                                                    world_size=2), 5) for r in rows_of(b)] for rank in range(2)]
    is_needle = [[ids[0] == tok.eos_id and "special magic" in tok.decode(ids[:40]) for ids, _ in rows]
                 for rows in per_rank]
    assert is_needle[0] != is_needle[1] and all(sum(flags) > 0 for flags in is_needle)
    answers = [{tuple(parse_needle_row(ids, labels, tok)[2]) for (ids, labels), n in zip(rows, flags) if n}
               for rows, flags in zip(per_rank, is_needle)]
    assert not answers[0] & answers[1]
    # data.shard=rows: the 2-process global batch is the 1-process batch, needle rows included
    rows = {**data_cfg, "shard": "rows"}
    one = take(build_train_loader(rows, tok, seq_len=SEQ_LEN, batch_size=4, seed=0), 3)
    two = [take(build_train_loader(rows, tok, seq_len=SEQ_LEN, batch_size=2, seed=0, rank=r, world_size=2), 3)
           for r in range(2)]
    for step, batch in enumerate(one):
        assert torch.equal(batch["input_ids"], torch.cat([two[0][step]["input_ids"], two[1][step]["input_ids"]]))
        assert torch.equal(batch["labels"], torch.cat([two[0][step]["labels"], two[1][step]["labels"]]))
    assert any((b["labels"] == -100).any() for b in one)  # some needle rows were in there


@pytest.mark.parametrize("mix, needle", [
    ({"fraction": -0.1, "tasks": ["niah_single_1"]}, r"fraction=-0\.1: expected a number in \[0, 1\]"),
    ({"fraction": 1.5, "tasks": ["niah_single_1"]}, r"fraction=1\.5: expected a number in \[0, 1\]"),
    ({"fraction": "0.5", "tasks": ["niah_single_1"]}, r"fraction='0\.5': expected a number"),
    ({"fraction": True, "tasks": ["niah_single_1"]}, r"fraction=True: expected a number"),
    ({"fraction": 0.5, "tasks": ["niah_single_9"]}, r"unknown task 'niah_single_9'; choose from niah_single_1, "),
    ({"fraction": 0.0, "tasks": ["niah_single_9"]}, r"unknown task 'niah_single_9'"),
    ({"fraction": 0.5, "tasks": "niah_single_1"}, r"tasks='niah_single_1': expected a non-empty list"),
    ({"fraction": 0.5, "tasks": []}, r"expected a non-empty list"),
    ({"fraction": 0.5, "tasks": ["niah_single_1"], "depth": 3}, r"unknown key\(s\) depth; valid: fraction, tasks"),
    (0.5, r"retrieval_mix=0\.5: expected a mapping"),
])
def test_bad_settings_name_the_fix(tok, mix, needle):
    with pytest.raises(ValueError, match=needle):
        build_train_loader({**cfg(), "retrieval_mix": mix}, tok, seq_len=SEQ_LEN, batch_size=1)


def test_seq_len_too_short_names_the_task_and_the_fix(tok):
    with pytest.raises(ValueError, match=r"niah_multiquery needle document needs seq_len >= \d+ tokens .*trainer\."
                                         r"seq_len is 200: raise trainer\.seq_len, drop niah_multiquery"):
        build_train_loader(cfg("fixed", 0.5, ["niah_single_1", "niah_multiquery"]), tok, seq_len=200, batch_size=1)
    # off, a short seq_len is fine (the shipped configs train tiny models at 128 tokens)
    next(build_train_loader(cfg("fixed", 0.0, ["niah_multiquery"]), tok, seq_len=64, batch_size=1))
    # the shortest accepted seq_len builds documents
    for task in ("niah_single_1", "niah_multiquery"):
        shortest = min_seq_len(task, tok)
        batch = next(build_train_loader(cfg("fixed", 1.0, [task]), tok, seq_len=shortest, batch_size=2))
        for ids, labels in rows_of(batch, shortest):
            parse_needle_row(ids, labels, tok)


def test_interpolated_haystack_search_finds_the_largest_fitting_size():
    rng = random.Random(0)
    evaluations = {"interpolated": 0, "bisection": 0}
    for trial in range(300):
        # a haystack's token count: grows by 1 to `unit` tokens a unit, from a prompt of c0 tokens
        unit, c0 = rng.choice([1, 2, 3, 25, 60]), rng.randint(1, 300)
        table = [c0]
        for _ in range(3000):
            table.append(table[-1] + rng.randint(1, unit))
        budget = rng.randint(c0, table[-1] - 1)
        expected = max(n for n in range(len(table)) if table[n] <= budget)  # brute force
        for name, search in (("interpolated", _interpolated_fitting),
                             ("bisection", lambda c, b, u: _largest_fitting(c, b, u, None))):
            seen = set()

            def count(n, seen=seen, table=table):
                seen.add(n)
                return table[n] if n < len(table) else table[-1] + n

            assert search(count, budget, budget + 1) == expected, (trial, name)
            evaluations[name] += len(seen)
    assert evaluations["interpolated"] < evaluations["bisection"] / 2  # why it exists: fewer prompt encodes


def test_heldout_needle_documents_are_fixed_and_apart_from_training_and_ruler(tok):
    """The documents a run validates its retrieval on: the mix's tasks in turn, the same for the same seed, other
    needles for another seed, and never a training row's or a RULER sample's needles (their own namespaces)."""
    from data.retrieval_mix import heldout_needle_documents
    from eval_suites.ruler.niah import make_sample

    tasks = ["niah_single_1", "niah_single_2"]
    essay = NOISE_LINE.replace("The", "An").split()
    docs = heldout_needle_documents({"fraction": 0.5, "tasks": tasks}, tok, seq_len=SEQ_LEN, seed=3, num=6,
                                    essay_words=essay)
    assert [d.task for d in docs] == tasks * 3
    assert all(len(d.input_ids) <= SEQ_LEN for d in docs)
    again = heldout_needle_documents({"tasks": tasks}, tok, seq_len=SEQ_LEN, seed=3, num=6, essay_words=essay)
    assert [d.input_ids for d in again] == [d.input_ids for d in docs]
    other = heldout_needle_documents({"tasks": tasks}, tok, seq_len=SEQ_LEN, seed=4, num=6, essay_words=essay)
    values = {v for d in docs for _, v, _ in d.needles}
    assert not values & {v for d in other for _, v, _ in d.needles}
    assert "An grass" in docs[1].prompt and "An grass" not in docs[0].prompt  # the essay task's haystack is essay
    loader = build_train_loader(cfg("fixed", 1.0, tasks), tok, seq_len=SEQ_LEN, batch_size=4, seed=3)
    trained = {tok.decode(ids) for batch in take(loader, 4) for ids, _ in rows_of(batch)}
    assert not any(v in text for v in values for text in trained)
    ruler = [make_sample(t, length=SEQ_LEN, tokenizer=tok, index=i, seed=3, essay_words=essay, max_new_tokens=16)
             for t in tasks for i in range(3)]
    assert not values & {a for s in ruler for a in s.answers}
