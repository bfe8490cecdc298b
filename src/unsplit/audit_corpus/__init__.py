"""Small training steps with known schedule problems, for ``unsplit audit`` and its tests.

Every function here is a *factory* for the ``unsplit audit MODULE:FACTORY``
command: it takes no arguments and returns ``(fn, args)`` (an ordinary
batched step, checked with :func:`unsplit.audit_step`) or
``(loss_fn, args, options)`` (a per-example loss, checked with
:func:`unsplit.audit` and ``**options``). Each problem case has exactly one
problem, marked in its source by a ``# expect: <case>`` comment on the line
the audit reports; the clean cases have none::

    unsplit audit unsplit.audit_corpus.batched:same_key_microbatches
    unsplit audit unsplit.audit_corpus.clean:unsplit_step --strict

:data:`PROBLEMS` maps each problem case to ``(module, kind)``; :data:`CLEAN`
lists the clean ones. Everything is tiny (widths of 8) so tracing is fast.
"""

from __future__ import annotations

#: problem case -> (module, the kind of its one finding)
PROBLEMS: dict[str, tuple[str, str]] = {
    "closure_key": ("per_example", "foreign_key"),
    "key_inside_loss": ("per_example", "foreign_key"),
    "linen_captured_rngs": ("per_example", "foreign_key"),
    "nnx_module_rngs": ("per_example", "foreign_key"),
    "linen_batchnorm": ("per_example", "dropped_state"),
    "nnx_batchnorm": ("per_example", "dropped_state"),
    "pmean_in_loss": ("per_example", "cross_example"),
    "rbg_key": ("per_example", "unsafe_key"),
    "attention_dropout": ("per_example", "padding_unstable"),
    "device_index_key": ("per_example", "device_key"),
    "batch_level_dropout": ("batched", "batch_draw"),
    "same_key_microbatches": ("batched", "batch_draw"),
    "constant_size_microbatches": ("batched", "batch_draw"),
    "explicit_mesh_dropout": ("batched", "batch_draw"),
    "shard_prng_key": ("batched", "device_key"),
    "multisteps_token_mean": ("batched", "mean_of_means"),
    "scan_token_means": ("batched", "mean_of_means"),
}

#: clean cases (all in the ``clean`` module): the audit finds nothing.
CLEAN: tuple[str, ...] = (
    "unsplit_loss",
    "nnx_eval_batchnorm",
    "stable_attention",
    "unsplit_step",
    "vmapped_example_keys",
    "constant_size_example_keys",
)
