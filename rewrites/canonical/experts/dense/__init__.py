"""The dense all-experts form (every expert on every token, masked) -> the per-slot form.

:mod:`.dense_experts` (``CanonicalDenseExpertsPass``) proves a layer from :mod:`.routing`,
:mod:`.mask`, :mod:`.combine` and :mod:`.ffn` (one expert MLP; :mod:`.nbits` for MatMulNBits
projections), into a :class:`~.layer.DenseLayer`, and :mod:`.emit` writes the per-slot layer
(weights stacked by :mod:`.stack`); :mod:`.consts` holds the readers they share.
"""
