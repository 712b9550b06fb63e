"""Logical axis names: what the modules call each axis of their parameters and activations.

`mtjax.flax` annotates every parameter (``nn.with_logical_partitioning``) and every
``[batch, length, ...]`` activation (``nn.with_logical_constraint``) with these names;
`mtjax.sharding.logical_axis_rules` maps each to mesh axes. Defined once here, so a module, a model,
a rule and the training state cannot disagree on a spelling. This module imports nothing from mtjax.
"""

# Parameter axes.
EMBED = "embed"  # the model (hidden) dimension
MLP = "mlp"  # the MLP's inner dimension
HEADS = "heads"  # query heads
KV_HEADS = "kv_heads"  # key/value heads (fewer than HEADS under grouped-query attention)
HEAD_DIM = "head_dim"
VOCAB = "vocab"
RELPOS_BUCKETS = "relpos_buckets"  # relative-position buckets of T5-style attention biases
LAYERS = "layers"  # the leading axis of a scanned stack's parameters

# Activation axes.
ACTIVATION_BATCH = "activation_batch"
ACTIVATION_LENGTH = "activation_length"
ACTIVATION_EMBED = "activation_embed"
ACTIVATION_MLP = "activation_mlp"
ACTIVATION_HEADS = "activation_heads"
ACTIVATION_KV_HEADS = "activation_kv_heads"
ACTIVATION_HEAD_DIM = "activation_head_dim"
ACTIVATION_VOCAB = "activation_vocab"

# The [batch, length, embed] activations every layer reads and writes.
BATCH_LENGTH_EMBED = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_EMBED)
