"""``flowrl eval`` as a harness: the models a user reports, on a suite of prompts, under a panel of
rewards, with intervals and paired comparisons, as tables, ``eval.json`` and a report a person reads.

- :mod:`~flowrl.eval.suites`: suites with metadata (GenEval's clauses, tags), shipped or from a file.
- :mod:`~flowrl.eval.models`: the models (base recipes and trained runs), labels, the pipeline check.
- :mod:`~flowrl.eval.panel`: sampling and scoring one model, chunk by chunk, resumable.
- :mod:`~flowrl.eval.stats`: pure statistics (bootstrap intervals, paired deltas, win rates).
- :mod:`~flowrl.eval.results`, :mod:`~flowrl.eval.hacking`: the numbers and the hacking verdicts.
- :mod:`~flowrl.eval.report_text`, :mod:`~flowrl.eval.report_html`: the tables and the HTML page.
- :mod:`~flowrl.eval.command`: the command (``docs/report.md``).
"""
