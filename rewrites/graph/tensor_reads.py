"""Reading a constant's numbers without keeping them: memory that does not grow with the model.

The rules and canonicalisation passes read each layer's weights into numpy to prove and repack
them. onnx-ir's ``ExternalTensor.numpy()`` maps the data file and keeps the mapping and the array
on the tensor for good (a 4-bit tensor keeps a whole unpacked copy, two bytes of memory for each
byte on disk). A model loaded lazily (``ir.load``) would then hold every layer it ever read, and
the fuser's memory would grow with the model.

:func:`read_array` reads an external tensor that nobody has mapped yet into an array of its own
and unmaps the file again, so a layer's weights live only as long as the check or rewrite that
reads them. Any other tensor (in memory, lazy, already mapped by someone else) is read as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["read_array"]


def read_array(tensor: ir.TensorProtocol) -> np.ndarray:
    """``tensor``'s numbers; an external tensor is left unmapped, as it was before the read."""
    if not isinstance(tensor, ir.ExternalTensor) or tensor.raw is not None:
        return tensor.numpy()
    mapped = tensor.numpy()
    # sub-byte types come back unpacked into a fresh array; the others are views of the mapping
    array = mapped if tensor.dtype.bitwidth < 8 else np.array(mapped, copy=True)
    del mapped
    try:
        tensor.release()
    except BufferError:  # a view of the mapping escaped (another thread read it): keep it
        pass
    return array
