"""Small ready-made models for examples, tests and benchmarks.

``Transformer`` is a plain ``flax.linen`` causal language model with dropout
on its residual branches and attention weights (unsplit's drop-ins by default;
``with_flax_dropout(model)`` swaps in Flax's own). It is written for ONE example
(``tokens: int[L]``), the way :func:`unsplit.value_and_grad` calls a loss.
``megatron_specs``, ``tensor_parallel_specs`` and ``fsdp_specs`` give its params'
PartitionSpecs for tensor parallel and FSDP layouts; ``on_mesh`` places them.

Example:
    >>> import jax
    >>> from unsplit import models
    >>> config = models.TransformerConfig(vocab=16, length=8, width=16, heads=2, layers=1)
    >>> model = models.Transformer(config)
    >>> params = models.init_params(model)
    >>> batch = models.synthetic_batch(config, 4)
    >>> loss_sum, tokens = models.token_loss(model)(
    ...     params, jax.tree.map(lambda x: x[0], batch), jax.random.key(0))
    >>> loss_sum.shape, tokens.shape
    ((), ())
"""

from unsplit._src.extras import require

require("flax", extra="flax", what="unsplit.models")

from unsplit._src.models.specs import fsdp_specs as fsdp_specs
from unsplit._src.models.specs import megatron_specs as megatron_specs
from unsplit._src.models.specs import on_mesh as on_mesh
from unsplit._src.models.specs import tensor_parallel_specs as tensor_parallel_specs
from unsplit._src.models.transformer import Block as Block
from unsplit._src.models.transformer import Transformer as Transformer
from unsplit._src.models.transformer import TransformerConfig as TransformerConfig
from unsplit._src.models.transformer import init_params as init_params
from unsplit._src.models.transformer import mean_loss as mean_loss
from unsplit._src.models.transformer import synthetic_batch as synthetic_batch
from unsplit._src.models.transformer import token_loss as token_loss
from unsplit._src.models.transformer import with_flax_dropout as with_flax_dropout

__all__ = [
    "Block",
    "Transformer",
    "TransformerConfig",
    "fsdp_specs",
    "init_params",
    "mean_loss",
    "megatron_specs",
    "on_mesh",
    "synthetic_batch",
    "tensor_parallel_specs",
    "token_loss",
    "with_flax_dropout",
]
