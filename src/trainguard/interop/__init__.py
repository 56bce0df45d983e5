"""Export to and import from the formats other tools use: safetensors (single or sharded, Hugging Face's
layout), plain DCP directories and ``torch.save`` files; and :func:`dcp_reader` for plain ``dcp.load``.

``export`` consolidates sharded checkpoints into full tensors; ``import_checkpoint`` never runs code from its
source. Optional packages (``safetensors``) are imported only when used.
"""

from .dcp_reader import dcp_reader
from .export import ExportResult, export
from .import_ import ImportResult, import_checkpoint

__all__ = ["ExportResult", "ImportResult", "dcp_reader", "export", "import_checkpoint"]
