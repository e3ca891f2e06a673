"""What runs a recipe on several processes and nodes: :mod:`~trainer.distributed.strategies` (DDP, FSDP2 and DeepSpeed
ZeRO, on CPU and CUDA), :mod:`~trainer.distributed.sequence_parallel` (one long row split across ranks) and
:mod:`~trainer.distributed.preemption` (checkpoint-and-stop at a step boundary on a job's signal)."""
