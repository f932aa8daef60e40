"""Evaluation suites of hilo (docs/configuration.md, eval).

Each suite is a module with its own entry points, imported explicitly so that loading one suite never pulls in
the dependencies of another:

    from eval_suites import ppl_by_position
    result = ppl_by_position.evaluate(model, documents, seq_len=4096)
    ppl_by_position.write_report(result, out_dir)
"""
