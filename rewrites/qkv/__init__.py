"""The QKV family: an RMS norm feeding three 4-bit Q/K/V projections -> ``MatMulNBitsQkv``.

:mod:`.rule` holds the rule and its near misses; :mod:`.pattern` the norm and projection
patterns; :mod:`.norm` the norm's proofs; :mod:`.projections` the projections' proofs;
:mod:`.roles` which projection is Q, K and V; :mod:`.graph` the small graph facts they share.
"""
