"""eval_suites.lm_harness: eval.py eval=lm_harness on a trained tiny checkpoint with local task files (multiple
choice, loglikelihood, rolling perplexity, generate_until), its numbers checked against log-likelihoods and greedy
decodings computed here one unpadded row at a time in float64; generate_until batched with left padding, equal to
one prompt at a time."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from eval_suites import lm_harness

REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH = 24   # small enough that the long document spans several rolling windows
MAX_GEN_TOKS = 6

MC = [{"question": "The sky is", "choices": ["blue.", "green.", "loud."], "label": 0},
      {"question": "Fire is", "choices": ["cold.", "hot."], "label": 1},
      {"question": "Water is", "choices": ["wet.", "dry.", "square.", "very tall indeed."], "label": 0}]
CLOZE = [{"text": "The cat sat on the mat"}, {"text": "One two three four"}, {"text": "Paris is in France"}]
DOCS = [{"text": "The quick brown fox jumps over the lazy dog. " * 5 + "The end."},
        {"text": "A short document about nothing."}]
GEN = [{"prompt": "Q: What is two plus two?\nA:", "answer": " four"}, {"prompt": "Say hello:", "answer": " hello"},
       {"prompt": "The", "answer": "."}]


def _task_yaml(name, data_file, output_type, body):
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
            f"output_type: {output_type}\ntest_split: test\n{body}")


def write_tasks(root: Path) -> Path:
    """Four tasks over local jsonl files, the way lm-eval's own tasks are written (dataset_path: json)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, records in (("mc", MC), ("cloze", CLOZE), ("docs", DOCS), ("gen", GEN)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    tasks = {
        "tiny_mc": ("mc", "multiple_choice", ('doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                    "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")),
        "tiny_cloze": ("cloze", "loglikelihood", ("doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                       "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\nmetric_list:\n"
                       "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
                       "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")),
        "tiny_ppl": ("docs", "loglikelihood_rolling", ('doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
                     "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")),
        "tiny_gen": ("gen", "generate_until", ('doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
                     f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n'
                     "metric_list:\n  - metric: exact_match\n")),
    }
    for task, (data, output_type, body) in tasks.items():
        (root / f"{task}.yaml").write_text(_task_yaml(task, root / f"{data}.jsonl", output_type, body))
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.training.helpers import run_train, small_cfg

    run_dir = tmp_path_factory.mktemp("lm_harness") / "run"
    run_train(small_cfg("trainer.max_steps=2", "trainer.val_every=0", "trainer.save_every=2"), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def model_and_tokenizer(checkpoint):
    from training.checkpoint import load_checkpoint_model, load_checkpoint_tokenizer

    return load_checkpoint_model(checkpoint).eval(), load_checkpoint_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def report(checkpoint, tmp_path_factory):
    """eval.py eval=lm_harness at batch size 3 over the four local tasks, every sample logged."""
    root = tmp_path_factory.mktemp("tasks")
    write_tasks(root)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(root / "hf_datasets")}
    res = subprocess.run([sys.executable, "eval.py", f"checkpoint={checkpoint}", "eval=lm_harness",
                          "eval.tasks=[tiny_mc,tiny_cloze,tiny_ppl,tiny_gen]", f"eval.include_path={root}",
                          "eval.batch_size=3", f"eval.max_length={MAX_LENGTH}", "eval.log_samples=true",
                          "eval.bootstrap_iters=0", "logger=none", "device=cpu"],
                         check=False, cwd=REPO, capture_output=True, text=True, timeout=500, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    path = checkpoint / "eval" / "lm_harness" / "lm_harness.json"
    return json.loads(path.read_text()), res.stdout


def _row_logprobs(model, ids):
    """float64 log softmax of the model's logits for one unpadded row: [len(ids), V]."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)


def _pair_loglikelihood(model, tokenizer, context, continuation):
    """(log p(continuation | context), greedy) with lm-eval's split: the trailing spaces of the context move to the
    continuation, which is the tail of the tokens of context + continuation after those of the context."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    cont = whole[len(ctx):]
    row = (ctx + cont)[-(MAX_LENGTH + 1):]
    logprobs = _row_logprobs(model, row[:-1])[-len(cont):]
    picked = [logprobs[k, token].item() for k, token in enumerate(cont)]
    return math.fsum(picked), all(int(logprobs[k].argmax()) == token for k, token in enumerate(cont))


def _document_loglikelihood(model, tokenizer, text):
    """log p(document), EOS before its first token: every token predicted once, in windows of MAX_LENGTH
    predictions, each one forward over the MAX_LENGTH tokens before the window's last prediction (fewer at the
    start)."""
    full = [tokenizer.eos_id] + tokenizer.encode(text)
    total = []
    for start in range(0, len(full) - 1, MAX_LENGTH):  # predict full[start + 1 : end + 1]
        end = min(start + MAX_LENGTH, len(full) - 1)
        first_input = max(0, end - MAX_LENGTH)
        logprobs = _row_logprobs(model, full[first_input:end])
        total += [logprobs[k - 1 - first_input, full[k]].item() for k in range(start + 1, end + 1)]
    return math.fsum(total)


def _greedy_text(model, tokenizer, prompt, stop="\n"):
    """Greedy decoding by full forwards (no cache): up to MAX_GEN_TOKS tokens, cut at EOS and at the stop string."""
    ids = tokenizer.encode(prompt)[-(MAX_LENGTH - MAX_GEN_TOKS):]
    new = []
    for _ in range(MAX_GEN_TOKS):
        token = int(_row_logprobs(model, ids + new)[-1].argmax())
        if token == tokenizer.eos_id:
            break
        new.append(token)
        if stop in tokenizer.decode(new):
            break
    return tokenizer.decode(new).split(stop)[0]


def test_report_layout(report, checkpoint, model_and_tokenizer):
    result, stdout = report
    assert result["suite"] == "lm_harness" and result["checkpoint"].startswith(str(checkpoint))
    assert result["tasks"] == ["tiny_mc", "tiny_cloze", "tiny_ppl", "tiny_gen"]
    assert result["batch_size"] == 3 and result["max_length"] == MAX_LENGTH
    assert {task: counts["effective"] for task, counts in result["n-samples"].items()} == {
        "tiny_mc": 3, "tiny_cloze": 3, "tiny_ppl": 2, "tiny_gen": 3}
    assert set(result["metrics"]) == {"tiny_mc/acc", "tiny_mc/acc_norm", "tiny_cloze/perplexity", "tiny_cloze/acc",
                                      "tiny_ppl/word_perplexity", "tiny_ppl/byte_perplexity",
                                      "tiny_ppl/bits_per_byte", "tiny_gen/exact_match"}
    assert re.search(r"^\|tiny_mc\s*\|.*\|acc\s*\|", stdout, re.MULTILINE), stdout
    assert "wrote " in stdout


def test_multiple_choice_matches_direct_loglikelihoods(report, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    result, _ = report
    samples = sorted(result["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    correct, correct_norm = [], []
    for sample, doc in zip(samples, MC, strict=True):
        assert [tuple(args) for args in sample["arguments"]] == [(doc["question"], " " + c) for c in doc["choices"]]
        direct = [_pair_loglikelihood(model, tokenizer, doc["question"], " " + c)[0] for c in doc["choices"]]
        scored = [resp[0] for resp in sample["filtered_resps"]]
        assert scored == pytest.approx(direct, rel=1e-4, abs=1e-4)
        correct.append(max(range(len(direct)), key=direct.__getitem__) == doc["label"])
        norm = [ll / len(" " + c) for ll, c in zip(direct, doc["choices"], strict=True)]
        correct_norm.append(max(range(len(norm)), key=norm.__getitem__) == doc["label"])
    assert result["metrics"]["tiny_mc/acc"] == pytest.approx(sum(correct) / len(MC))
    assert result["metrics"]["tiny_mc/acc_norm"] == pytest.approx(sum(correct_norm) / len(MC))


def test_cloze_accuracy_and_perplexity_match_direct(report, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    result, _ = report
    pairs = [(" ".join(d["text"].split(" ")[:-1]), " " + d["text"].split(" ")[-1]) for d in CLOZE]
    direct = [_pair_loglikelihood(model, tokenizer, *pair) for pair in pairs]
    samples = sorted(result["samples"]["tiny_cloze"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0][0] for s in samples] == pytest.approx([ll for ll, _ in direct], rel=1e-4)
    assert result["metrics"]["tiny_cloze/acc"] == pytest.approx(sum(greedy for _, greedy in direct) / len(CLOZE))
    assert result["metrics"]["tiny_cloze/perplexity"] == pytest.approx(
        math.exp(-math.fsum(ll for ll, _ in direct) / len(CLOZE)), rel=1e-4)


def test_rolling_perplexity_matches_direct_windows(report, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    result, _ = report
    texts = [d["text"] for d in DOCS]
    assert len(tokenizer.encode(texts[0])) > 2 * MAX_LENGTH  # several windows
    direct = [_document_loglikelihood(model, tokenizer, text) for text in texts]
    samples = sorted(result["samples"]["tiny_ppl"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == pytest.approx(direct, rel=1e-4)
    num_bytes = sum(len(text.encode()) for text in texts)
    num_words = sum(len(re.split(r"\s+", text)) for text in texts)
    assert result["metrics"]["tiny_ppl/bits_per_byte"] == pytest.approx(-math.fsum(direct) / num_bytes / math.log(2),
                                                                        rel=1e-4)
    assert result["metrics"]["tiny_ppl/word_perplexity"] == pytest.approx(math.exp(-math.fsum(direct) / num_words),
                                                                          rel=1e-3)


def test_generation_matches_greedy_decoding(report, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    result, _ = report
    samples = sorted(result["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    expected = [_greedy_text(model, tokenizer, doc["prompt"]) for doc in GEN]
    assert [s["filtered_resps"][0] for s in samples] == expected
    assert result["metrics"]["tiny_gen/exact_match"] == pytest.approx(
        sum(text.strip() == doc["answer"].strip() for text, doc in zip(expected, GEN, strict=True)) / len(GEN))


def _generate_requests(prompts, until=("\n",)):
    from lm_eval.api.instance import Instance

    kwargs = {"until": list(until), "max_gen_toks": MAX_GEN_TOKS, "do_sample": False}
    return [Instance(request_type="generate_until", doc={}, arguments=(prompt, dict(kwargs)), idx=0)
            for prompt in prompts]


def _count_generate_rows(model, monkeypatch):
    rows = []
    original = model.generate

    def generate(input_ids, **kwargs):
        rows.append((input_ids.shape[0], kwargs["attention_mask"].clone()))
        return original(input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return rows


PROMPTS = ["Once upon a time", "Hi", "The weather today is quite nice and", "A"]


def test_generation_is_batched_with_left_padding_for_a_model_that_takes_it(model_and_tokenizer, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)).eval()
    one_by_one = lm_harness.HiloLM(llama, tokenizer, max_length=MAX_LENGTH, batch_size=1).generate_until(
        _generate_requests(PROMPTS), disable_tqdm=True)
    rows = _count_generate_rows(llama, monkeypatch)
    batched = lm_harness.HiloLM(llama, tokenizer, max_length=MAX_LENGTH, batch_size=3).generate_until(
        _generate_requests(PROMPTS), disable_tqdm=True)
    assert batched == one_by_one
    assert [n for n, _ in rows] == [3, 1]
    mask = rows[0][1]  # left padding: each row's zeros come first, the longest prompt has none
    assert (mask.sum(1) == torch.tensor(sorted((len(tokenizer.encode(p)) for p in PROMPTS), reverse=True)[:3])).all()
    assert (mask.cummax(1).values == mask).all()


def test_hilo_generation_is_batched_with_left_padding(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    rows = _count_generate_rows(model, monkeypatch)
    texts = lm_harness.HiloLM(model, tokenizer, max_length=MAX_LENGTH, batch_size=3).generate_until(
        _generate_requests(PROMPTS), disable_tqdm=True)
    assert [n for n, _ in rows] == [3, 1] and not bool(rows[0][1].all())
    assert texts == [_greedy_text(model, tokenizer, prompt) for prompt in PROMPTS]


def test_generation_stops_at_the_tasks_stop_string(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    # a prompt whose free continuation has a non-blank stop string in its second half (a random model writes
    # newlines after some prompts)
    prompt, free = next((p, text) for p in PROMPTS if len((text := _greedy_text(model, tokenizer, p, stop="\0"))
                                                           [len(text) // 2:].strip()) >= 2)
    stop = free[len(free) // 2:].strip()[:2]
    assert free.split(stop)[0] != free
    rows = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: rows.append(original(*a, **k)) or rows[-1])
    texts = lm_harness.HiloLM(model, tokenizer, max_length=MAX_LENGTH).generate_until(
        _generate_requests([prompt], until=(stop,)), disable_tqdm=True)
    assert texts == [free.split(stop)[0]]
    # decoding stopped at the step that completed the stop string, not at the budget
    generated = rows[0][0, len(tokenizer.encode(prompt)):].tolist()
    assert stop in tokenizer.decode(generated) and stop not in tokenizer.decode(generated[:-1])


def test_loglikelihood_does_not_depend_on_batch_size(model_and_tokenizer):
    from lm_eval.api.instance import Instance

    model, tokenizer = model_and_tokenizer
    pairs = [("The sky is", " blue"), ("A much longer context than the others, with more words", " in it"),
             ("Hi", " there my friend"), ("Cold", " water")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0) for pair in pairs]
    results = {batch: lm_harness.HiloLM(model, tokenizer, max_length=MAX_LENGTH, batch_size=batch).loglikelihood(
        requests, disable_tqdm=True) for batch in (1, 3, 4)}
    direct = [_pair_loglikelihood(model, tokenizer, *pair) for pair in pairs]
    for batch, result in results.items():
        assert [ll for ll, _ in result] == pytest.approx([ll for ll, _ in direct], rel=1e-5), batch
        assert [greedy for _, greedy in result] == [greedy for _, greedy in direct], batch


def test_default_tasks_are_lm_evals_and_unknown_ones_are_named(model_and_tokenizer, tmp_path):
    from lm_eval.tasks import TaskManager
    from omegaconf import OmegaConf

    model, tokenizer = model_and_tokenizer
    assert list(OmegaConf.load(REPO / "conf" / "eval" / "lm_harness.yaml").tasks) == list(lm_harness.DEFAULT_TASKS)
    manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")))
    assert set(lm_harness.DEFAULT_TASKS) | {"tiny_mc"} <= set(manager.all_tasks)
    with pytest.raises(ValueError, match="unknown lm-eval task.*no_such_task.*eval.include_path"):
        lm_harness.evaluate(model, tokenizer, tasks=["tiny_mc", "no_such_task"], max_length=MAX_LENGTH,
                            task_manager=manager)
    with pytest.raises(FileNotFoundError, match="eval.include_path"):
        lm_harness.evaluate(model, tokenizer, tasks=["tiny_mc"], max_length=MAX_LENGTH,
                            include_path=str(tmp_path / "missing"))


def test_wandb_gets_the_metrics(report):
    result, _ = report
    logged = {}

    class Run:
        def __init__(self):
            self.summary = {}

        def log(self, values):
            logged.update(values)

    run = Run()
    lm_harness.log_to_wandb(result, run, prefix="lm_harness")
    assert run.summary == {f"lm_harness/{key}": value for key, value in result["metrics"].items()}
    assert len(logged["lm_harness/table"].data) == len(result["metrics"])
    lm_harness.log_to_wandb(result, None)


def _distributed_worker(rank, world_size, init_file, checkpoint, task_dir, out_dir):
    import torch.distributed as dist
    from lm_eval.tasks import TaskManager

    from training.checkpoint import load_checkpoint_model, load_checkpoint_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model, tokenizer = load_checkpoint_model(checkpoint).eval(), load_checkpoint_tokenizer(checkpoint)
        result = lm_harness.evaluate(model, tokenizer, tasks=["tiny_mc", "tiny_ppl", "tiny_gen"],
                                     max_length=MAX_LENGTH, batch_size=2, bootstrap_iters=0,
                                     task_manager=TaskManager(include_path=task_dir, include_defaults=False))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result["metrics"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_ranks_share_the_documents_and_agree(report, checkpoint, tmp_path):
    import torch.multiprocessing as mp

    task_dir = str(write_tasks(tmp_path / "tasks"))
    mp.spawn(_distributed_worker, args=(2, str(tmp_path / "init"), str(checkpoint), task_dir, str(tmp_path)),
             nprocs=2, join=True)
    single = {key: value for key, value in report[0]["metrics"].items() if not key.startswith("tiny_cloze")}
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == pytest.approx(single, rel=1e-5)


def test_the_trainer_takes_lm_harness_as_a_final_evaluation():
    from tests.training.helpers import small_cfg
    from training.config import validate_train_config
    from training.evaluation import final_eval_configs

    cfg = small_cfg("+eval@trainer.final_evals.downstream=lm_harness", "trainer.final_evals.downstream.limit=10")
    validate_train_config(cfg)
    [(name, eval_cfg)] = [pair for pair in final_eval_configs(cfg) if pair[0] is not None]
    assert name == "downstream" and eval_cfg.suite == "lm_harness" and eval_cfg.limit == 10


def test_lm_eval_cli_loads_a_checkpoints_model_directory(report, checkpoint, tmp_path):
    """`lm_eval --model hf --model_args pretrained=<step>/model,trust_remote_code=True` (docs/checkpoints.md): the
    model directory alone (its remote code, tokenizer files and pad token) scores lm-eval's own HF model at batch
    size 2, with the same multiple-choice log-likelihoods as eval=lm_harness."""
    root = tmp_path / "tasks"
    write_tasks(root)
    model_dir = max((checkpoint / "checkpoints").glob("step_*")) / "model"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "hf_datasets")}
    res = subprocess.run([str(Path(sys.executable).with_name("lm_eval")), "--model", "hf", "--model_args",
                          f"pretrained={model_dir},trust_remote_code=True", "--tasks", "tiny_mc", "--include_path",
                          str(root), "--batch_size", "2", "--device", "cpu", "--output_path", str(tmp_path / "out"),
                          "--log_samples"], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=500,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")
               for line in path.read_text().splitlines()]
    ours = {s["doc_id"]: s for s in report[0]["samples"]["tiny_mc"]}
    assert len(samples) == len(ours) == 3
    def loglikelihoods(responses):  # lm-eval writes each choice's (loglikelihood, is_greedy), nested or not
        return [float(r[0][0] if isinstance(r[0], (list, tuple)) else r[0]) for r in responses]

    for sample in samples:
        theirs = loglikelihoods(sample["filtered_resps"])
        assert theirs == pytest.approx(loglikelihoods(ours[sample["doc_id"]]["filtered_resps"]), abs=1e-4)
