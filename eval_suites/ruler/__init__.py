"""RULER needle-in-a-haystack suite, offline: RULER's eight NIAH tasks, written from its protocol.

    from eval_suites import ruler
    result = ruler.evaluate(model, tokenizer, lengths=[4096, 8192, 16384])   # 25 samples per task and length
    print(ruler.format_table(result))
    ruler.write_report(result, out_dir)                                      # ruler.json + ruler.png

Tasks (``TASKS``): niah_single_1 (noise haystack, word keys, 7-digit number values), niah_single_2 (essay,
words, numbers), niah_single_3 (essay, words, uuids), niah_multikey_1 (essay, 4 keys of which one is asked),
niah_multikey_2 (a haystack of distractor needles, words, numbers), niah_multikey_3 (distractor needles, uuid
keys and values), niah_multivalue (4 values for the asked key), niah_multiquery (4 keys asked). Prompts,
haystacks and length fitting: ``niah``; scoring (string_match_all): ``scoring``; the run: ``suite``; the
table, JSON/PNG and W&B: ``report``.
"""
from .niah import (
    ANSWER_PREFIX,
    DEFAULT_HAYSTACK,
    DEPTHS,
    NEEDLE,
    NOISE,
    TASK_NAMES,
    TASKS,
    TEMPLATE,
    NiahTask,
    Sample,
    build_samples,
    load_haystack,
    load_words,
    make_sample,
    sample_seed,
    templates,
)
from .report import format_table, log_to_wandb, write_report
from .scoring import postprocess, string_match_all
from .suite import evaluate, generate_answer, generate_answers, summarize

__all__ = [
    "ANSWER_PREFIX", "DEFAULT_HAYSTACK", "DEPTHS", "NEEDLE", "NOISE", "TASKS", "TASK_NAMES", "TEMPLATE", "NiahTask",
    "Sample", "build_samples", "evaluate", "format_table", "generate_answer", "generate_answers", "load_haystack",
    "load_words", "log_to_wandb", "make_sample", "postprocess", "sample_seed", "string_match_all", "summarize",
    "templates", "write_report",
]
