"""Parts of a layer recognised by what they compute: probe the subgraph, compare with the op.

The part recognisers (:mod:`..parts`) match spellings; what no spelling matches is recognised
here by behaviour. The activation between FC1 (+FC3) and FC2 (:mod:`.activation`) is cut out of
the graph as an element-wise region (:mod:`.region`), its column routing (which FC1 columns feed
each output column, through Slice/Split/Gather) is derived symbolically, and its arithmetic is
evaluated per op in numpy (:mod:`.interpret`) on a dense probe grid (:mod:`.probes`) and compared
with every activation the fused ops offer, parameters read from the region's constants. The
same is done for the router's softmax and the renormalisation of the top-k values
(:mod:`.routing`). A region fuses only when every probe agrees within float rounding; otherwise
the refusal names the closest candidate and its largest deviation.

Nothing here imports the fuser runtime or the kernels (tests/test_import_layers.py).
"""
