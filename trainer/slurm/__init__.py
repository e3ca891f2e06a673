"""SLURM: :mod:`~trainer.slurm.submit` renders and submits the sbatch script of a recipe (``draftsmith slurm``), and
:mod:`~trainer.slurm.requeue` runs around the fit in that script (``python -m trainer.slurm.requeue``), requeueing a
job that made progress."""
