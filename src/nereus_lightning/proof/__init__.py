"""Proofs that a model family computes exactly when sharded: the self-check and admission by proof.

:mod:`.selfcheck` compares a tiny random model of a family, sharded at every layout, against the
unsharded transformers model and through Split/Merge; :mod:`.admission` runs it once for a family
outside the registry and caches the verdict that ``spec.families`` reads.
"""
