"""``draftsmith export``: a trained drafter in a serving engine's format.

:mod:`~trainer.export.cli` is the command (the formats themselves live with their methods, ``trainer/methods/<method>/
export.py``); :mod:`~trainer.export.files` the folders of one ``config.json`` beside one safetensors file;
:mod:`~trainer.export.hf` the HF transformers folders; :mod:`~trainer.export.speculators` the block every
speculators-format export writes and reads; :mod:`~trainer.export.serving` the engine command an export prints."""
