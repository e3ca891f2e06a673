"""What a method builds on: the target it drafts for and the layers drafters are made of.

:mod:`~trainer.models.target` loads the target (a folder or hub id) frozen, online or as only the parts shards do not
hold; :mod:`~trainer.models.llama` builds the tiny Llama targets; :mod:`~trainer.models.layers` (RMSNorm, gated MLP,
kv repeat) and :mod:`~trainer.models.block_attention` are the drafters' building blocks;
:mod:`~trainer.models.documents` turns packed rows' document ids into positions and masks;
:mod:`~trainer.models.logit_scaling` is the output scaling some architectures apply after their lm_head."""
