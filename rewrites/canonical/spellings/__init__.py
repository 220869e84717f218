"""Canonicalisation of op spellings: other ways of writing an op, rewritten to the one the rules match.

:mod:`.normalize_spellings` (``NormalizeSpellingsPass``) runs the spelling rules: activations
(:mod:`.activation`), arithmetic (:mod:`.arith`), casts (:mod:`.cast`), clamps (:mod:`.clamp`),
Einsum (:mod:`.einsum`), split token rows (:mod:`.split_rows`), Tile (:mod:`.tile`); what they
share is in :mod:`.common`.
"""
