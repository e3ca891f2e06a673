"""``draftsmith compare``: every method on one target under one budget, measured by one engine, in one report.

:mod:`~trainer.compare.config` is a compare recipe's schema; :mod:`~trainer.compare.run` trains, exports and measures
each method (a rerun skips what is done); :mod:`~trainer.compare.report`, :mod:`~trainer.compare.plots`,
:mod:`~trainer.compare.fit_logs` and :mod:`~trainer.compare.footprint` write the report, its plots, the training
curves and each run's time and memory."""
